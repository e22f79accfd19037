"""Gradient synchronisation: how a rank's flat gradient buffer becomes the sum over all ranks.

Backward calls `on_grads_ready(start, end)` each time grads[start:end] is final (always the next
piece of a growing prefix, see model.py); `finish()` returns once the buffer is reduced. The
strategies differ only in when they reduce and in what pieces:

- per-param: one collective per parameter, after backward (the naive DDP: the most calls).
- flat:      one collective over the whole buffer, after backward (the fewest calls, no overlap).
- bucketed:  the buffer cut into buckets of `bucket_mb`; a bucket is reduced, by a communication
             thread of the rank, as soon as backward has finished it, while the rank's own thread
             goes on with the earlier blocks. What is left when backward ends is the exposed cost;
             the buckets that only backward's end makes final (the first block's ln_1, the
             embeddings) go as one. On the CPU, the embeddings' rows that no token of the step reads
             go first, and the rest from the rank's own thread (`EmbeddingRows`).

What reducing a piece means is the same for every strategy (`PieceReducer`): an all-reduce, or with
ZeRO-1 a reduce-scatter that leaves each rank the part of the piece inside its own shard; with bf16
compression the piece is rounded to bfloat16 before the sum and the sum rounded again after. PowerSGD
(parallel/powersgd.py) reduces pieces of whole parameters instead, each matrix as a low-rank product.

Every rank must issue the same collectives in the same order (the local communicator meets at
barriers, NCCL matches calls by order). The pieces are a pure function of the layout and of
bucket_mb, and one thread per rank issues them in order, so that holds by construction.
"""

import math
import os
import queue
import threading
import weakref
from functools import cache, partial

import numpy as np

from ..comm import shard_offsets
from ..comm.timed import TimedCommunicator
from ..command import must_be, one_of
from ..errors import XtrainError
from ..layout import ALIGN, WPE, WTE
from .powersgd import PowerSGD

MIB = 1 << 20  # --bucket-mb counts mebibytes, like torch DDP's bucket_cap_mb
COMPRESSIONS = ("none", "bf16", "powersgd")
PRIORITIES = ("auto", "realtime", "normal")  # --comm-priority


def bucket_bounds(size: int, bucket_mb: float, itemsize: int = 4) -> list[tuple[int, int]]:
    """[lo, hi) of each bucket: consecutive slices of bucket_mb (rounded to whole ALIGN-element
    groups, at least one), the last one shorter. A function of its arguments only, so every rank
    cuts the same buckets."""
    elems = max(ALIGN, round(bucket_mb * MIB / itemsize / ALIGN) * ALIGN)
    return [(lo, min(lo + elems, size)) for lo in range(0, size, elems)]


def join_the_tail(pieces: list[tuple[int, int]], tail_start: int) -> list[tuple[int, int]]:
    """pieces cut at tail_start, and all of them from there on joined into one. tail_start is where backward's
    last two announcements begin (the first block's ln_1, then the embeddings): they become final together at
    backward's very end, with no compute left to overlap, so one collective reduces them with one call's
    overhead (on the CPU two barriers, on a GPU one launch) instead of one a piece. The piece that reaches
    past tail_start is cut there, so that its part before (the first block's attention products, final one
    product before backward ends) goes as soon as it is final. A function of its arguments only, so every
    rank cuts the same pieces."""
    kept = [p for p in pieces if p[1] <= tail_start]
    lo, hi = (kept[-1][1] if kept else 0), pieces[-1][1]
    cut = [(lo, tail_start)] if lo < tail_start else []
    return [*kept, *cut, (tail_start, hi)] if tail_start < hi else kept


def block_bucket_bounds(model, bucket_mb: float) -> list[tuple[int, int]]:
    """Buckets of whole parameters for PowerSGD: backward's announcements (model.layer_grad_ranges: a block
    at a time) joined in order until a bucket holds bucket_mb, so each is compressed as soon as backward has
    finished its last block."""
    limit = bucket_mb * MIB / model.grads.dtype.itemsize
    buckets = []
    for lo, hi in model.layer_grad_ranges():
        if buckets and buckets[-1][1] - buckets[-1][0] < limit:
            buckets[-1] = (buckets[-1][0], hi)
        else:
            buckets.append((lo, hi))
    return buckets


@cache
def realtime_granted() -> bool:
    """Whether the OS gives this process's threads a real-time priority (Linux: to root, to CAP_SYS_NICE, or up to
    the RLIMIT_RTPRIO that `ulimit -r` shows). Tried by a thread of its own, which ends with the try."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    granted = []

    def attempt():
        try:
            take_priority("realtime")
            granted.append(True)
        except OSError:
            granted.append(False)

    thread = threading.Thread(target=attempt, name="realtime-probe")
    thread.start()
    thread.join()
    return granted[0]


def comm_priority(asked: str) -> str:
    """The priority --comm-priority gives the communication threads: realtime, or normal (auto: realtime where
    the OS grants it)."""
    return "realtime" if asked == "realtime" or (asked == "auto" and realtime_granted()) else "normal"


def take_priority(priority: str) -> None:
    """Called first in a communication thread. realtime: the lowest real-time priority (SCHED_FIFO 1), above every
    ordinary thread. Where the rank threads' BLAS keeps every core busy (the CPU default: cores / ranks threads
    each), an ordinary communication thread that wakes with a bucket to sum waits for a core until the
    scheduler's next tick (4 ms at 250 Hz), and the peer's waits at the collective's barrier with it; at
    real-time priority it takes a core at once. The thread sleeps between buckets and in every barrier, so it
    never holds a core idle."""
    if priority == "realtime":
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(os.sched_get_priority_min(os.SCHED_FIFO)))


def start_comm_thread(ops, priority: str, errors: list) -> None:
    """What a communication thread (this module's, ZeRO-2/3's) does first: take the rank's device (a stream of
    its own on a GPU) and its priority. A priority refused since the check (--comm-priority realtime) goes into
    errors, which the rank's thread raises at its next wait."""
    ops.bind_side_thread()
    try:
        take_priority(priority)
    except OSError as e:
        errors.append(XtrainError(f"--comm-priority {priority}: {e.strerror}"))


def has_comm_thread(cfg) -> bool:
    """Whether the run's gradient sync has a communication thread (the bucketed sync's, ZeRO-2/3's): what
    --comm-priority applies to. cfg: a TrainConfig, or the command line's namespace."""
    return cfg.grad_sync == "bucketed" or cfg.zero >= 2


class PieceReducer:
    """Reduces one slice grads[lo:hi] across the ranks: all-reduce, or reduce-scatter into the shards."""

    def __init__(self, comm, grads, ops, shards=None, compress: str = "none"):
        self.comm, self.grads, self.ops = comm, grads, ops
        self.shards = shards  # ZeRO-1: every rank's (lo, hi) of the flat buffer; None: all-reduce
        self.compress = compress == "bf16"

    def __call__(self, lo: int, hi: int) -> None:
        piece = self.grads[lo:hi]
        if self.shards is None:
            self.all_reduce(piece)
            return
        counts = [max(0, min(hi, s_hi) - max(lo, s_lo)) for s_lo, s_hi in self.shards]
        offsets = shard_offsets(hi - lo, self.comm.world_size, counts)
        rank = self.comm.rank
        result = piece[offsets[rank]:offsets[rank + 1]]  # this rank's part: reduced in place
        self._reduce(piece, result, partial(self.comm.reduce_scatter, piece, result, counts))

    def all_reduce(self, piece) -> None:
        """Sum `piece` (grads' elements, or a copy of some of them) over the ranks, in place."""
        self._reduce(piece, piece, partial(self.comm.all_reduce, piece))

    def _reduce(self, piece, result, collective) -> None:
        if self.compress:
            # what a bf16 wire would carry; the sum itself is exact float32 in rank order
            self.ops.bf16_round(piece)
        collective()
        if self.compress:
            self.ops.bf16_round(result)  # the sum travels back as bfloat16 too

    def reduce_gathered(self, parts) -> None:
        """Sum several parts of grads over the ranks as one piece: each part (view, rows) is view[rows], rows
        of a 2-D view into grads, or with rows None the whole of a view; gathered into one contiguous copy,
        reduced, written back. Each element is summed as an all-reduce of grads in place sums it (in rank
        order), so the same bits."""
        pieces = [(view if rows is None else view[rows]).reshape(-1) for view, rows in parts]
        gathered = np.concatenate(pieces)
        self.all_reduce(gathered)
        at = 0
        for (view, rows), piece in zip(parts, pieces, strict=True):
            summed, at = gathered[at:at + piece.size], at + piece.size
            if rows is None:
                view.reshape(-1)[...] = summed
            else:
                view[rows] = summed.reshape(-1, view.shape[1])


class _AfterBackward:
    """Reduce fixed pieces one after another once backward is done; nothing overlaps."""

    def __init__(self, reduce_piece: PieceReducer, pieces: list[tuple[int, int]]):
        self.reduce_piece = reduce_piece
        self.pieces = pieces

    def on_grads_ready(self, start: int, end: int) -> None:
        pass

    def finish(self) -> None:
        comm = self.reduce_piece.comm
        backward_done = comm.backward_done()
        for lo, hi in self.pieces:
            self.reduce_piece(lo, hi)
        comm.waited_for_peers(backward_done, comm.clock.timestamp())

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class PerParamGradSync(_AfterBackward):
    """One collective per parameter after backward: the naive DDP, what per-call overhead costs."""

    def __init__(self, reduce_piece, model, bucket_mb=None):
        super().__init__(reduce_piece, [(s.offset, s.offset + s.size) for s in model.layout])


class FlatGradSync(_AfterBackward):
    """One collective over the whole flat buffer after backward: the fewest calls, no overlap."""

    def __init__(self, reduce_piece, model, bucket_mb=None):
        super().__init__(reduce_piece, [(0, model.size)])


class EmbeddingRows:
    """What backward's end makes final (the first block's ln_1, wpe, wte) reduced in two parts, so that little of it
    is left for after backward (the bucketed sync on the CPU). The embeddings are last in the layout: the tied
    classifier adds its part of wte's gradient at backward's start, the embedding adds each token's row of wte and
    each position's row of wpe at backward's very end. A row that no token (no position) of the step's global
    batch reads gets nothing from the embedding on any rank: wte's is final once the classifier is done, wpe's
    (past the sequence length) from the start. Only the rows some token reads wait for the end.

    At backward's first announcement the communication thread sums over the ranks which rows of the two tables each
    rank's tokens read (every rank then knows the same sets), and reduces every other row, gathered into one piece;
    the rank's thread meanwhile goes on with backward. After backward, the rank's thread reduces the rest (ln_1, the
    rows read, the padding between) as one more piece. Each element is summed over the ranks in rank order as a
    reduce of grads in place would, so the same bits as the flat sync; two calls more a step than one tail piece
    (the row set, the rows no token reads).

    Only where grads live in host memory: the pieces' sizes depend on the tokens, which a GPU step captured as
    a CUDA graph could not read. The caller gives the token ids of the micro-batch whose backward announces
    (note_tokens; the earlier micro-batches' rows are in the gradient by then) before that backward; a step
    without them reduces it all after backward."""

    def __init__(self, reduce_piece: PieceReducer, model, tail_start: int):
        self.reduce_piece = reduce_piece
        self.lo, self.hi = tail_start, model.size  # [lo, hi): all this reduces, padding included
        self.tables = (model.g.wpe, model.g.wte)  # (rows, C) views into grads, in layout order
        spans = [(s.offset, s.offset + s.size) for s in model.layout if s.name in (WPE, WTE)]
        bounds = [self.lo, *(b for span in spans for b in span), self.hi]
        # the rest of [lo, hi), around the tables: the first block's ln_1 (its attention half's last), padding
        self.between = [model.grads[a:b] for a, b in zip(bounds[::2], bounds[1::2], strict=True)]
        self.tokens = None  # this rank's token ids of the step's announcing micro-batch
        self.read = None    # per table, the rows some token (position) of the step's global batch reads

    @staticmethod
    def applies(reduce_piece, model) -> bool:
        """Whether the split can be made: an all-reduce (not ZeRO-1's reduce-scatter, not PowerSGD) of a model
        whole on the rank (no tensor or pipeline cut), over more than one rank, in host memory."""
        return (isinstance(reduce_piece, PieceReducer) and reduce_piece.shards is None
                and reduce_piece.comm.world_size > 1 and getattr(model, "pp", None) is None
                and getattr(model, "tp", None) is None and model.ops.xp is np and model.tied_range is not None)

    def reduce_unread(self, tokens) -> None:
        """The row sets, then the rows no token reads (the communication thread, at backward's first
        announcement: the classifier's part is final then). tokens: this rank's ids, note_tokens'."""
        wpe, wte = self.tables
        read = np.zeros(wpe.shape[0] + wte.shape[0], np.float32)  # 1 where this rank's tokens read the row
        read[:tokens.shape[-1]] = 1
        read[wpe.shape[0] + tokens.reshape(-1)] = 1
        self.reduce_piece.comm.all_reduce(read)  # > 0 where any rank's do
        per_table = np.split(read, [wpe.shape[0]])
        self.read = tuple(np.flatnonzero(counts) for counts in per_table)
        unread = tuple(np.flatnonzero(counts == 0) for counts in per_table)
        if any(rows.size for rows in unread):  # the same sets on every rank: all skip together
            self.reduce_piece.reduce_gathered(list(zip(self.tables, unread, strict=True)))

    def reduce_rest(self) -> None:
        """What is left (the rank's thread, after backward): all of it where no rows went early."""
        if self.read is None:
            self.reduce_piece(self.lo, self.hi)
            return
        parts = [(self.between[0], None)]
        for table, rows, after in zip(self.tables, self.read, self.between[1:], strict=True):
            parts += [(table, rows), (after, None)]
        self.reduce_piece.reduce_gathered(parts)
        self.read = None


class BucketedGradSync:
    """Buckets reduced by a communication thread while backward goes on (PyTorch DDP's design).

    on_grads_ready hands every bucket that the finished prefix now covers to the rank's communication thread,
    which reduces them in order; finish() hands over whatever is left and waits. The rank's thread makes no
    collective call of its own until the communication thread has done all it was handed (in finish()), so the
    two threads never use the communicator at once. A failure in the communication thread (a peer died:
    CommAborted) is raised by finish(). The thread ends when this object is closed or dropped.

    On a GPU, backward has only *queued* a bucket's gradients when it announces them. Each hand-over
    therefore carries a fence (a CUDA event on the compute stream); the communication thread, bound
    to the rank's device with a stream of its own, makes that stream wait for it before reducing,
    and finish() makes the compute stream wait for the communication stream's last fence. On the
    CPU the fences are None and the waits do nothing.

    On the CPU, the tail is not in the pieces: EmbeddingRows reduces the embeddings' rows that no token
    of the step reads at backward's first announcement (on the communication thread), and the rest after
    backward (on the rank's thread, in finish())."""

    def __init__(self, reduce_piece, model, bucket_mb: float, pieces=None, priority: str = "normal"):
        self.reduce_piece = reduce_piece
        self.comm = reduce_piece.comm
        self.size = model.size
        self.rows = None
        if pieces is None:
            pieces = bucket_bounds(model.size, bucket_mb, model.grads.dtype.itemsize)
            if hasattr(model, "grad_ready_ranges"):  # a model that announces as backward goes
                tail_start = model.grad_ready_ranges()[-2][0]
                pieces = join_the_tail(pieces, tail_start)
                if EmbeddingRows.applies(reduce_piece, model):
                    self.rows = EmbeddingRows(reduce_piece, model, tail_start)
                    pieces = pieces[:-1]  # the tail: EmbeddingRows' two parts
        self.pieces = pieces
        self._ready = 0    # grads[:_ready] is final in this step
        self._issued = 0   # buckets handed to the communication thread in this step
        self._backward_done = None  # the clock mark of this step's last announcement, where taken there
        self._work: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._reduced: list = [None]  # the communication thread's fence after its latest bucket
        self.ops = model.ops
        # the thread holds no reference to self, so dropping self ends it (through the finalizer)
        threading.Thread(target=_serve, args=(self._work, self._errors, self._reduced, self.ops, priority),
                         name=f"rank{self.comm.rank}-comm", daemon=True).start()
        self.close = weakref.finalize(self, self._work.put, None)

    def note_tokens(self, ids) -> None:
        """This rank's token ids of the micro-batch whose backward will announce (train/loop.py, before it): which
        rows of the embeddings' gradients EmbeddingRows can reduce early. Nothing to do without them."""
        if self.rows is not None:
            self.rows.tokens = ids

    def on_grads_ready(self, start: int, end: int) -> None:
        if start != self._ready:
            raise RuntimeError(f"gradients announced out of layout order: [{start}, {end}) after [0, {self._ready})")
        if start == 0 and self.rows is not None and self.rows.tokens is not None:
            # the classifier's part of wte's gradient is final: the embeddings' rows that no token reads go first
            self._work.put((partial(self.rows.reduce_unread, self.rows.tokens), self.ops.fence()))
        self._ready = end
        if end == self.size and self.comm.knows_peers:
            # thread ranks on the CPU: the mark a peer reads once the last pieces are reduced is shared before they
            # go, so that it is there when the peer looks (finish() takes it where backward announces no end)
            self._backward_done = self.comm.backward_done()
        self._issue_up_to(end)

    def reset(self) -> None:
        """Forget a step that stopped part way (a CUDA graph capture that failed, train/graph.py): wait for the
        communication thread to drop what it was handed, so the step can be run again from the start."""
        self._work.join()
        self._errors.clear()
        self._ready = self._issued = 0
        self._backward_done = None
        if self.rows is not None:
            self.rows.tokens = self.rows.read = None

    def settle(self) -> None:
        """Called before the rank's thread queues a collective of another group of its mesh (a tensor-parallel
        all-reduce, a pipeline transfer; train/loop.py on a GPU): wait on the host until the communication
        thread has queued every bucket handed over so far, and make the calling stream wait for the last. Each
        rank's collectives, over all its groups, then run on its device one after another in the order its
        program reaches them, the same on every rank of a group (docs/parallelism.md): no two communicators'
        kernels wait on each other across ranks. The buckets still overlap the backward compute up to the next
        such collective."""
        if self._issued:
            self._work.join()
            self.ops.wait(self._reduced[0])

    def finish(self) -> None:
        backward_done, self._backward_done = self._backward_done, None
        if backward_done is None:
            backward_done = self.comm.backward_done()  # shared before the last pieces go: waited_for_peers reads it
        self._issue_up_to(self.size)  # all of it, also if backward announced nothing
        self._work.join()
        self.ops.wait(self._reduced[0])  # later compute (clipping, AdamW) reads the reduced buckets
        end = self.ops.timestamp()
        self.comm.waited(backward_done, end)  # on a GPU: how long the compute stream stalled
        self._ready = self._issued = 0
        if self._errors:
            raise self._errors[0]
        if self.rows is not None:
            # the tail (ln_1 and the rows the tokens read, or all of it where none went early) on this thread: the
            # communication thread is idle now, and handing it over would cost a wake-up each way. The rank's own
            # collective counts itself as exposed (comm/timed.py)
            self.rows.tokens = None
            self.rows.reduce_rest()
            end = self.ops.timestamp()
        self.comm.waited_for_peers(backward_done, end)

    def _issue_up_to(self, end: int) -> None:
        computed = None
        while self._issued < len(self.pieces) and self.pieces[self._issued][1] <= end:
            computed = computed or self.ops.fence()  # one fence covers every bucket handed over now
            self._work.put((partial(self.reduce_piece, *self.pieces[self._issued]), computed))
            self._issued += 1


def _serve(work: queue.Queue, errors: list, reduced: list, ops, priority: str) -> None:
    """The communication thread: run the reductions whose (job, fence) arrive, in order, until None."""
    start_comm_thread(ops, priority, errors)
    while True:
        item = work.get()
        try:
            if item is None:
                return
            job, computed = item
            if not errors:  # after a failure, drain without communicating
                ops.wait(computed)
                job()
                reduced[0] = ops.fence()
        except BaseException as e:  # handed to the rank's thread by finish()
            errors.append(e)
        finally:
            work.task_done()


STRATEGIES = {"per-param": PerParamGradSync, "flat": FlatGradSync, "bucketed": BucketedGradSync}


class PowerSGDGradSync:
    """A strategy whose pieces PowerSGD reduces, and the step count PowerSGD keeps (its start step)."""

    def __init__(self, strategy, powersgd: PowerSGD):
        self.strategy, self.powersgd = strategy, powersgd
        self.on_grads_ready, self.reset, self.close = strategy.on_grads_ready, strategy.reset, strategy.close
        if hasattr(strategy, "settle"):  # the overlapped sync beside --tp, --pp on a GPU (train/loop.py)
            self.settle = strategy.settle
        self.elements_sent = 0  # by each rank in the latest step

    def finish(self) -> None:
        self.strategy.finish()
        self.elements_sent, self.powersgd.elements_sent = self.powersgd.elements_sent, 0
        self.powersgd.step_done()


def check_config(cfg) -> None:
    """The options of this module, checked before any rank starts: one line naming the problem."""
    if cfg.grad_sync not in STRATEGIES:
        raise XtrainError(must_be("--grad-sync", one_of(STRATEGIES), cfg.grad_sync))
    if not (cfg.bucket_mb > 0 and math.isfinite(cfg.bucket_mb)):
        raise XtrainError(f"--bucket-mb must be a positive number, got {cfg.bucket_mb:g}")
    if cfg.grad_compress not in COMPRESSIONS:
        raise XtrainError(must_be("--grad-compress", one_of(COMPRESSIONS), cfg.grad_compress))
    if cfg.comm_priority not in PRIORITIES:
        raise XtrainError(must_be("--comm-priority", one_of(PRIORITIES), cfg.comm_priority))
    if cfg.comm_priority == "realtime" and not realtime_granted():
        raise XtrainError("--comm-priority realtime: the OS refuses this process a real-time priority (Linux grants "
                          "it to root, to CAP_SYS_NICE, or up to `ulimit -r`); --comm-priority auto or normal runs "
                          "the communication threads at normal priority")
    if cfg.grad_compress == "powersgd":
        if cfg.powersgd_rank < 1:
            raise XtrainError(f"--powersgd-rank must be at least 1, got {cfg.powersgd_rank}")
        if cfg.powersgd_start_step < 0:
            raise XtrainError(f"--powersgd-start-step must be 0 or more, got {cfg.powersgd_start_step}")
    if isinstance(cfg.zero, bool) or cfg.zero not in (0, 1, 2, 3):  # the stages parallel/zero.py runs
        raise XtrainError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero}")
    if cfg.grad_accum < 1:
        raise XtrainError(f"--grad-accum must be at least 1, got {cfg.grad_accum}")
    pp = getattr(cfg, "pp", 1)
    if cfg.tp == 1 and pp == 1 and cfg.batch < cfg.world_size * cfg.grad_accum:
        raise XtrainError(f"BATCH ({cfg.batch}) must be at least the world size times --grad-accum "
                          f"({cfg.world_size} x {cfg.grad_accum} = {cfg.world_size * cfg.grad_accum}): "
                          "every micro-batch needs a sequence on every rank")
    dp = cfg.world_size // cfg.tp // pp
    over = " and ".join(flag for flag, size in (("--tp", cfg.tp), ("--pp", pp)) if size > 1)
    if over and cfg.batch < dp * cfg.grad_accum:
        raise XtrainError(f"BATCH ({cfg.batch}) must be at least the data-parallel size (the world size over {over}) "
                          f"times --grad-accum ({dp} x {cfg.grad_accum} = {dp * cfg.grad_accum}): every "
                          "micro-batch needs a sequence in every data-parallel group")


def make_grad_sync(cfg, comm, model, shards=None):
    """The strategy cfg.grad_sync names, reducing into ZeRO-1 shards when shards is given."""
    check_config(cfg)
    if not isinstance(comm, TimedCommunicator):
        comm = TimedCommunicator(comm, clock=model.ops)
    if cfg.grad_compress == "powersgd":
        # every piece all-reduced whole, also under ZeRO-1 (whose update reads its own shard of the sums):
        # the low-rank factors are not cut into shards
        powersgd = PowerSGD(comm, model, cfg.powersgd_rank, cfg.powersgd_start_step, cfg.seed)
        if cfg.grad_sync == "bucketed":
            strategy = BucketedGradSync(powersgd, model, cfg.bucket_mb, block_bucket_bounds(model, cfg.bucket_mb),
                                        comm_priority(cfg.comm_priority))
        else:
            strategy = STRATEGIES[cfg.grad_sync](powersgd, model, cfg.bucket_mb)
        return PowerSGDGradSync(strategy, powersgd)
    reduce_piece = PieceReducer(comm, model.grads, model.ops, shards, cfg.grad_compress)
    if cfg.grad_sync == "bucketed":
        return BucketedGradSync(reduce_piece, model, cfg.bucket_mb, priority=comm_priority(cfg.comm_priority))
    return STRATEGIES[cfg.grad_sync](reduce_piece, model, cfg.bucket_mb)


def report_fields(cfg, results) -> dict:
    """The report's communication and memory fields, from every rank's RankResult.

    comm_s and exposed_comm_s are means over this process's ranks and steps (the first step, which pays for
    warm-up, left out when there are others) of the seconds a step spent in collectives, and of the part of
    them the rank's thread waited for (each step record's comm_ms and exposed_comm_ms); peer_wait_s the same
    of the part of that wait spent on a slower rank's compute (peer_wait_ms, thread ranks on the CPU). Steps
    replayed from a CUDA graph (train/graph.py) have no such times: they are left out, and the mean is None if
    no step has."""

    def mean(key: str) -> float | None:
        per_rank = [[record[key] / 1e3 for record in r.records if key in record] for r in results]
        values = [v for steps in per_rank for v in (steps[1:] or steps)]
        return sum(values) / len(values) if values else None

    def by_group() -> dict | None:
        steps = [step for r in results for step in (r.comm_by_group[1:] or r.comm_by_group)]
        if not steps:
            return None
        labels = sorted({label for step in steps for label in step})
        return {label: {"comm_s": sum(step.get(label, (0.0, 0.0))[0] for step in steps) / len(steps),
                        "exposed_s": sum(step.get(label, (0.0, 0.0))[1] for step in steps) / len(steps)}
                for label in labels}

    return {
        "grad_sync": cfg.grad_sync,
        "bucket_mb": cfg.bucket_mb,
        "grad_compress": cfg.grad_compress,
        "powersgd_rank": cfg.powersgd_rank if cfg.grad_compress == "powersgd" else None,
        "powersgd_start_step": cfg.powersgd_start_step if cfg.grad_compress == "powersgd" else None,
        "zero": cfg.zero,
        "grad_accum": cfg.grad_accum,
        # the communication threads' (bucketed, ZeRO-2/3): realtime or normal, what --comm-priority gave them here
        "comm_priority": comm_priority(cfg.comm_priority) if has_comm_thread(cfg) else None,
        "comm_s": mean("comm_ms"),
        "exposed_comm_s": mean("exposed_comm_ms"),
        # the part of exposed_comm_s before the slowest rank of the group ended its backward: waiting for a peer's
        # compute, not for communication (comm/timed.py); None where the ranks share no clock (processes, GPUs)
        "peer_wait_s": mean("peer_wait_ms"),
        # the same two by group (dp, tp, pp, world: comm/timed.py), each {"comm_s", "exposed_s"}: with a mesh, the
        # gradient sync's own hidden share is 1 - exposed_s / comm_s of "dp"
        "comm_s_by_group": by_group(),
        "comm_calls_per_step": results[0].comm_calls,
        # rank 0's payload bytes in the last timed step, by group (dp: the gradient sync's; tp; world)
        "comm_bytes_per_step": results[0].comm_bytes,
        # every rank's shard, also those of other processes: each process cuts the same shards
        "zero_shards": [list(shard) for shard in results[0].zero_shards] if cfg.zero else None,
        # per rank of this process, ZeRO-2/3 (parallel/zero.py): the most bytes of blocks' gradient buffers and of
        # gathered parameters a rank held at once, beside its shards (param_bytes, grad_bytes)
        "zero_peak_bytes": [r.zero_peak_bytes for r in results] if cfg.zero >= 2 else None,
    }
