"""The ZeRO stages: which slices of the flat buffers a rank keeps whole, and which collective fills them.

Every stage cuts the flat layout into the same shards (shard_bounds: rank r owns [lo, hi) of parameters,
gradients and AdamW's m and v alike) and runs AdamW's per-element arithmetic (optim.AdamW) on them:

  stage  parameters        gradients                          optimizer state  filled by
  0      whole             whole                              whole            all-reduce (parallel/ddp.py)
  1      whole             whole, the shard reduced           the shard        reduce-scatter, all-gather after AdamW
  2      whole             the shard + blocks in backward     the shard        reduce-scatter per block, all-gather
  3      the shard + the   the shard + blocks in backward     the shard        all-gather per block before use,
         blocks in use                                                         reduce-scatter per block

ZeRO-1 is ShardedAdamW, whose gradients parallel/ddp.py's PieceReducer reduce-scatters into the shards.
ZeRO-2 (ShardedGradAdamW) and ZeRO-3 (FullyShardedAdamW) are also the model's `units` (model.WholeBuffers'
hooks): backward asks for a block's gradient buffer before the block runs (before_backward) and announces it
final after (on_grads_ready, the gradient sync's call); forward and backward ask ZeRO-3 for a block's
parameters before it runs (before_forward, before_backward). The model never knows the stage, nor the loop.

The unit is what backward announces (model.layer_grad_ranges: a block, with ln_f the last one and with the
embeddings the end) for gradients, and for ZeRO-3's parameters ln_f, each block, wpe and wte (tied with the
classifier) on their own. Every collective of a stage runs on one communication thread per rank, in the
order the rank's own thread hands them over, which is the same on every rank: the passes are the same code.

Reduction order. A shard's gradient is the sum over ranks, in rank order, of each rank's gradient (the
communicator's reduce-scatter, as ZeRO-1's). With one micro-batch per step the per-rank gradient is the same
bits at every stage (backward accumulates into a zeroed buffer the same way), so ZeRO-2 and -3 give ZeRO-1's
bits. With --grad-accum K, ZeRO-2 and -3 reduce every micro-batch and add the sums into the shard (sum over
micro-batches of sums over ranks), where ZeRO-0 and -1 add the micro-batches first on each rank (sum over ranks
of sums over micro-batches): the same value, rounded in another order, so their bits differ from ZeRO-1's by
float32 rounding. Keeping the unit's gradient over the micro-batches instead would keep the whole unsharded
gradient alive through the step, which is what ZeRO-2 removes; reducing each micro-batch costs K times the
reduce-scatters (DeepSpeed's ZeRO-2 does the same). The global norm is every shard's sum of squares
all-reduced in rank order, as ZeRO-1's.
"""

import queue
import threading
import weakref

import numpy as np

from ..comm import shard_offsets
from ..config import TrainConfig
from ..errors import XtrainError
from ..model import ALIGN, bind_views
from ..optim import AdamW, schedule_buffer
from .ddp import make_grad_sync
from .tensor import refuse_what_does_not_work_yet


def shard_bounds(size: int, world_size: int) -> list[tuple[int, int]]:
    """ZeRO-1's shards: world_size contiguous slices of the flat buffer, cut on ALIGN boundaries (so
    every shard is aligned for vector loads) and as equal as that allows: sizes differ by at most
    ALIGN elements. Nothing is padded; the shards are simply not all the same size."""
    units = -(-size // ALIGN)
    cuts = [min(size, (r * units // world_size) * ALIGN) for r in range(world_size)] + [size]
    return [(cuts[r], cuts[r + 1]) for r in range(world_size)]


class ShardedAdamW(AdamW):
    """ZeRO-1: the optimizer state is sharded over the ranks; parameters and gradients are not.

    Rank r owns params[lo:hi] for its shard (lo, hi) = shards[r]. Gradient sync reduce-scatters the
    gradients so that grads[lo:hi] holds the sum over ranks (the rest of grads is left unreduced and
    is never read); the global norm is an all-reduce of each shard's sum of squares, in rank order,
    so every rank clips with the same bits; AdamW updates the shard with m and v that exist for it
    alone; an all-gather then gives every rank every updated shard. Per element the arithmetic is
    AdamW's, so the run follows the unsharded one (up to the norm's summation order).

    Mixed precision: the float32 shards are gathered, and every rank then rewrites its whole bf16
    copy from them (model.refresh_lowp), rather than gathering the bf16 copies as well. Parameters
    stay whole and bitwise equal on every rank here (checkpoints, digests and resume rely on it), so
    the float32 gather is needed anyway; after it the copy is one local, memory-bound pass (6 bytes
    per parameter of device memory traffic), where gathering the bf16 shards too would add half
    again to the gather's bytes over the interconnect, the slower of the two by far. What would
    halve the gather instead is ZeRO-1 as DeepSpeed runs mixed precision: float32 masters sharded
    with m and v, only bf16 gathered; that changes what a rank's `params` means (a checkpoint then
    gathers the masters) and is not done here."""

    def __init__(self, model, cfg: TrainConfig, comm):
        self.model = model
        self.ops = model.ops
        self.cfg = cfg
        self.comm = comm
        self.shards = shard_bounds(model.size, comm.world_size)
        self.lo, self.hi = self.shards[comm.rank]
        self.counts = [hi - lo for lo, hi in self.shards]
        xp = self.ops.xp
        self.m = xp.zeros(self.hi - self.lo, dtype=model.params.dtype)
        self.v = xp.zeros(self.hi - self.lo, dtype=model.params.dtype)
        self.step_count = 0
        self.schedule = schedule_buffer(self.ops)

    sharded = True  # checkpoints save each rank's optimizer state (checkpoint/resume.py)

    @property
    def state_range(self) -> tuple[int, int]:
        return self.lo, self.hi

    def grad_norm_squared(self):
        partial = self.model.grad_norm_squared(self.lo, self.hi)
        self.comm.all_reduce(partial)
        return partial

    def gather_grads(self, lo: int, hi: int) -> None:
        """The reduced gradients of grads[lo:hi] on every rank of the group: each rank's part of its shard
        there, all-gathered in place (pipeline parallelism's tied wte, whose two copies' stages are shard
        differently, swaps the whole reduced gradient)."""
        counts = [max(0, min(hi, s_hi) - max(lo, s_lo)) for s_lo, s_hi in self.shards]
        start = min(max(lo, self.lo), hi)
        self.comm.all_gather(self.model.grads[start:start + counts[self.comm.rank]], self.model.grads[lo:hi], counts)

    def update(self, grad_scale) -> None:
        c, m, lo, hi = self.cfg, self.model, self.lo, self.hi
        self.ops.adamw_update(m.params[lo:hi], m.grads[lo:hi], self.m, self.v, m.decay_mask[lo:hi], None, None,
                              c.beta1, c.beta2, c.eps, c.weight_decay, grad_scale, schedule=self.schedule)
        self.comm.all_gather(m.params[lo:hi], m.params, self.counts)
        m.refresh_lowp()  # the bf16 copy of every shard, from the gathered float32 (see above)


def make_optimizer(model, cfg: TrainConfig, comm):
    """The optimizer of --zero's stage; at stages 2 and 3 also the model's units and the gradient sync."""
    return {0: AdamW, 1: ShardedAdamW, 2: ShardedGradAdamW, 3: FullyShardedAdamW}[cfg.zero](model, *(
        (cfg,) if cfg.zero == 0 else (cfg, comm)))


def make_stage(model, cfg: TrainConfig, comm):
    """(optimizer, gradient sync) of --zero's stage: at stages 2 and 3 the optimizer is the sync too, which
    reduce-scatters each unit's gradient as backward announces it."""
    optimizer = make_optimizer(model, cfg, comm)
    return optimizer, optimizer if cfg.zero >= 2 else make_grad_sync(cfg, comm, model, shards=optimizer.shards)


def _overlaps(lo: int, hi: int, shards) -> list[int]:
    """How many elements of [lo, hi) each rank's shard holds: a reduce-scatter's or all-gather's counts."""
    return [max(0, min(hi, s_hi) - max(lo, s_lo)) for s_lo, s_hi in shards]


class _CommThread:
    """The rank's communication thread at ZeRO-2 and -3: runs the calls handed to it one after another, in the
    order they came (so every rank issues the same collectives in the same order), while the rank's thread
    computes. submit returns an event set once the call is done; drain waits for all of them. A failure (a
    peer died: CommAborted) is raised by the next wait or drain; the calls after it are dropped. The thread
    ends when this object is closed or dropped.

    On a GPU each call would be queued on a communication stream after an event of the compute stream, and
    the compute stream would wait for the call's own event before reading what it gathered (ddp.py's fences);
    the numpy backend's fences are None and its waits nothing."""

    def __init__(self, ops, name: str):
        self.work: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        threading.Thread(target=_serve_calls, args=(self.work, self.errors, ops), name=name, daemon=True).start()
        self.close = weakref.finalize(self, self.work.put, None)

    def submit(self, call) -> threading.Event:
        done = threading.Event()
        self.work.put((call, done))
        return done

    def wait(self, done: threading.Event) -> None:
        done.wait()
        if self.errors:
            raise self.errors[0]

    def drain(self) -> None:
        self.work.join()
        if self.errors:
            raise self.errors[0]


def _serve_calls(work: queue.Queue, errors: list, ops) -> None:
    ops.bind_side_thread()
    while True:
        item = work.get()
        try:
            if item is None:
                return
            call, done = item
            try:
                if not errors:  # after a failure, drain without communicating
                    call()
            except BaseException as e:  # raised on the rank's thread by wait or drain
                errors.append(e)
            finally:
                done.set()
        finally:
            work.task_done()


def param_units(layout, blocks) -> dict:
    """ZeRO-3's units of the parameters: key ("ln_f", a block's index, "wpe", "wte") -> (lo, hi, specs) of the
    flat layout."""
    units = {}
    for key in ["ln_f", *blocks, "wpe", "wte"]:
        specs = [s for s in layout if s.name.startswith(
            f"transformer.h.{key}." if isinstance(key, int) else f"transformer.{key}.")]
        units[key] = (specs[0].offset, specs[-1].offset + specs[-1].size, specs)
    return units


def pass_steps(blocks) -> tuple[list, dict]:
    """The steps of a forward and backward pass in order, and the units each one reads (see FullyShardedAdamW)."""
    order = ([("forward", "embed")] + [("forward", i) for i in blocks] + [("forward", "head")] +
             [("backward", "head")] + [("backward", i) for i in reversed(blocks)] + [("backward", "embed")])
    needs = {("forward", "embed"): ["wte", "wpe", blocks[0]], ("forward", "head"): ["ln_f", "wte"],
             ("backward", "head"): ["ln_f", "wte"], ("backward", "embed"): []}
    for i in blocks:
        needs["forward", i] = [i, i + 1 if i < blocks[-1] else "ln_f"]
        needs["backward", i] = [i]
    return order, needs


def window(order, needs, n: int, prefetch: int) -> set:
    """The units a rank holds whole at pass step n: what it reads and what the next `prefetch` steps do."""
    return {key for later in order[n:n + 1 + prefetch] for key in needs[later]}


def gathered_elements(layout, blocks, prefetch: int) -> int:
    """The most elements of gathered parameters a ZeRO-3 rank holds at once (the memory bound's figure)."""
    units = param_units(layout, blocks)
    order, needs = pass_steps(blocks)
    return max(sum(units[k][1] - units[k][0] for k in window(order, needs, n, prefetch)) for n in range(len(order)))


def grad_buffer_elements(ranges) -> int:
    """The fewest elements of unit gradient buffers a ZeRO-2/3 rank holds at the worst moment of backward: the
    embeddings' unit (the last range: alive through backward) and the largest other one beside it."""
    sizes = [hi - lo for lo, hi in ranges]
    return sizes[-1] + max(sizes[:-1], default=0)


def _step_specs(model, step) -> list:
    """The parameters a pass step reads or writes the gradient of: the head (ln_f and the tied wte), a block,
    or the embeddings (wpe and wte)."""
    if step == "head":
        return [s for s in model.layout if s.name.startswith("transformer.ln_f.") or s.name.endswith("wte.weight")]
    if step == "embed":
        return [s for s in model.layout if s.name.startswith(("transformer.wte.", "transformer.wpe."))]
    return [s for s in model.layout if s.name.startswith(f"transformer.h.{step}.")]


class ShardedGradAdamW(ShardedAdamW):
    """ZeRO-2: gradients sharded like the optimizer state; parameters whole.

    What a rank holds: the whole float32 parameters (and their bf16 copy under bf16), its shard of the
    gradients (self.grad, hi - lo float32), m and v of its shard, and, during backward, the gradient buffers
    of the units backward is filling or has announced and the communication thread has not reduce-scattered
    yet: the unit of the block running, ln_f's unit (with the last block) from the head's backward until that
    block ends, and the embeddings' unit (wpe and wte) through the whole backward, since the tied classifier
    adds to wte's gradient at its start and the embedding at its end. Announced units wait in the thread's
    queue; each is dropped as soon as its reduce-scatter has added its part into the shard. No buffer of the
    whole gradient exists.

    The model's gradient views (model.g) point into these buffers while they live and are None otherwise."""

    every_micro_batch = True  # the loop announces every micro-batch's gradients, not only the last one's

    def __init__(self, model, cfg: TrainConfig, comm):
        super().__init__(model, cfg, comm)
        xp = self.ops.xp
        self.grad = xp.zeros(self.hi - self.lo, dtype=model.grads.dtype)
        self.compress = cfg.grad_compress == "bf16"
        self.ranges = model.layer_grad_ranges()
        self._range_specs = [[s for s in model.layout if lo <= s.offset < hi] for lo, hi in self.ranges]
        self._range_at = {lo: r for r, (lo, _) in enumerate(self.ranges)}
        # which units' gradient buffers each backward step writes into
        self._writes = {}
        for step in ["head", *model.blocks, "embed"]:
            self._writes[step] = sorted({r for s in _step_specs(model, step) for r, (lo, hi) in enumerate(self.ranges)
                                         if lo <= s.offset < hi})
        self._filling: dict = {}   # unit index -> its gradient buffer, while backward writes it
        self._reduced: set = set()  # units whose sum is in self.grad this step: the next micro-batch adds to it
        self.peak_grad_buffer_bytes = 0  # the most bytes of unit gradient buffers alive at once
        self._grad_buffer_bytes = 0
        self._counting = threading.Lock()  # the rank's thread adds a buffer's bytes, the communication thread takes
        self.thread = _CommThread(self.ops, f"rank{comm.rank}-zero")
        self.close = self.thread.close
        model.grads = None
        bind_views(model.g, None, model.layout)
        model.units = self

    # ------------------------------------------------------------ the model's hooks
    def before_forward(self, step) -> None:
        pass

    def forward_done(self) -> None:
        pass

    def before_backward(self, step) -> None:
        xp = self.ops.xp
        for r in self._writes[step]:
            if r not in self._filling:
                lo, hi = self.ranges[r]
                buf = xp.zeros(hi - lo, dtype=self.grad.dtype)
                self._filling[r] = buf
                with self._counting:
                    self._grad_buffer_bytes += buf.nbytes
                    self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self._grad_buffer_bytes)
                bind_views(self.model.g, buf, self._range_specs[r], lo)

    # ------------------------------------------------------------ the gradient sync's calls
    def on_grads_ready(self, start: int, end: int) -> None:
        r = self._range_at[start]
        buf = self._filling.pop(r)
        bind_views(self.model.g, None, self._range_specs[r])
        self.thread.submit(lambda: self._reduce_into_shard(r, buf))

    def _reduce_into_shard(self, r: int, buf) -> None:
        """On the communication thread: unit r's gradient summed over the ranks, this rank's part of it added
        into its shard (written, for the step's first micro-batch); then the buffer goes."""
        lo, hi = self.ranges[r]
        counts = _overlaps(lo, hi, self.shards)
        offsets = shard_offsets(hi - lo, self.comm.world_size, counts)
        rank = self.comm.rank
        if self.compress:  # what a bf16 wire would carry, as ddp.PieceReducer rounds
            self.ops.bf16_round(buf)
        part = buf[offsets[rank]:offsets[rank + 1]]
        self.comm.reduce_scatter(buf, part, counts)
        if self.compress:
            self.ops.bf16_round(part)
        start = max(lo, self.lo) - self.lo
        into = self.grad[start:start + part.size]
        if r in self._reduced:
            into += part
        else:
            into[...] = part
            self._reduced.add(r)
        with self._counting:
            self._grad_buffer_bytes -= buf.nbytes

    def finish(self) -> None:
        backward_done = self.ops.timestamp()
        self.thread.drain()
        self.comm.waited(backward_done, self.ops.timestamp())
        self._reduced.clear()
        if self._filling:
            raise RuntimeError(f"backward never announced the gradients of units {sorted(self._filling)}")

    def reset(self) -> None:
        self.thread.drain()
        self._reduced.clear()
        self._filling.clear()

    # ------------------------------------------------------------ the step
    @property
    def grad_bytes(self) -> int:
        return int(self.grad.nbytes)

    def grad_norm_squared(self):
        partial = self.ops.global_norm_squared(self.grad)
        self.comm.all_reduce(partial)
        return partial

    def gather_grads(self, lo: int, hi: int) -> None:
        raise NotImplementedError("ZeRO-2 and -3 keep no whole gradient to gather")

    def update(self, grad_scale) -> None:
        c, m, lo, hi = self.cfg, self.model, self.lo, self.hi
        self.ops.adamw_update(m.params[lo:hi], self.grad, self.m, self.v, m.decay_mask[lo:hi], None, None,
                              c.beta1, c.beta2, c.eps, c.weight_decay, grad_scale, schedule=self.schedule)
        self.comm.all_gather(m.params[lo:hi], m.params, self.counts)
        m.refresh_lowp()


class FullyShardedAdamW(ShardedGradAdamW):
    """ZeRO-3: parameters sharded too. A rank keeps its float32 shard of the parameters (self.params), and
    gathers a unit's parameters (ln_f, a block, wpe, wte) into a buffer of their own just before a pass step
    reads them, binding the model's views (model.p) to it, and drops it when no step in reach needs it.

    What a pass step needs: the embedding wte, wpe and block 0 (its ln_1 runs with the embedding); block i's
    forward block i and block i + 1 (the next ln_1, or ln_f, runs in the same op as the residual sum); the
    head ln_f and wte, in forward and backward; block i's backward block i alone; the embedding's backward
    nothing. With --zero3-prefetch N the units of the next N steps of the pass are gathered by the
    communication thread while this one computes; the window (what this step needs and what the next N do) is
    all a rank holds whole, plus the gradient buffers ZeRO-2 holds. Nothing is prefetched past the end of
    backward: the optimizer is about to change the parameters. Under bf16 the gathered float32 unit is
    rounded into a bf16 buffer at once (the float32 one then goes): the same elementwise rounding as
    model.refresh_lowp, so the same bits as ZeRO-1's copy."""

    forward_is_collective = True  # every rank's shard is in each block's gather

    def __init__(self, model, cfg: TrainConfig, comm):
        super().__init__(model, cfg, comm)
        xp = self.ops.xp
        self.params = xp.ascontiguousarray(model.params[self.lo:self.hi]).copy()
        self.decay_mask = xp.ascontiguousarray(model.decay_mask[self.lo:self.hi]).copy()
        self.lowp_dtype = model.params_lowp.dtype if model.lowp_copy is not None else None
        self.prefetch = cfg.zero3_prefetch
        model.params = model.params_lowp = model.decay_mask = None
        bind_views(model.p, None, model.layout)
        self.param_units = param_units(model.layout, model.blocks)  # key -> (lo, hi, specs) of the flat layout
        self.order, self.needs = pass_steps(model.blocks)
        self._position = {at: n for n, at in enumerate(self.order)}
        self.held: dict = {}    # key -> the buffer the model's views point into
        self.coming: dict = {}  # key -> (event, float32 buffer) of a gather handed to the thread
        self.peak_gathered_bytes = 0  # the most bytes of gathered units alive at once (held and coming)

    # ------------------------------------------------------------ the model's hooks
    def before_forward(self, step) -> None:
        self._use(("forward", step))

    def before_backward(self, step) -> None:
        self._use(("backward", step))
        super().before_backward(step)

    def forward_done(self) -> None:
        """A forward without backward (evaluation, generation) ends: wait for what is coming, drop it all."""
        for done, _ in self.coming.values():
            self.thread.wait(done)
        self.coming.clear()
        self._release_all()

    def finish(self) -> None:
        super().finish()
        self.coming.clear()  # backward prefetches nothing past its end, so nothing is coming here
        self._release_all()

    def _use(self, at) -> None:
        n = self._position[at]
        need = self.needs[at]
        ahead = [key for later in self.order[n + 1:n + 1 + self.prefetch] for key in self.needs[later]]
        keep = window(self.order, self.needs, n, self.prefetch)
        for key in [k for k in self.held if k not in keep]:
            self._release(key)
        for key in [k for k in self.coming if k not in keep]:  # a pass that stopped short (evaluation)
            self.thread.wait(self.coming.pop(key)[0])
        for key in need:
            self._bind(key)
        for key in ahead:
            if key not in self.held and key not in self.coming:
                self.coming[key] = self._gather(key)
        self._count()

    def _gather(self, key):
        """Hand the all-gather of unit `key`'s parameters to the communication thread: (event, buffer)."""
        lo, hi, _ = self.param_units[key]
        counts = _overlaps(lo, hi, self.shards)
        start = min(max(lo, self.lo), self.hi) - self.lo
        send = self.params[start:start + counts[self.comm.rank]]
        buf = self.ops.xp.empty(hi - lo, dtype=self.params.dtype)
        return self.thread.submit(lambda: self.comm.all_gather(send, buf, counts)), buf

    def _bind(self, key) -> None:
        if key in self.held:
            return
        done, buf = self.coming.pop(key) if key in self.coming else self._gather(key)
        waiting = self.ops.timestamp()
        self.thread.wait(done)
        self.comm.waited(waiting, self.ops.timestamp())  # the rank stood still for the gather
        if self.lowp_dtype is not None:
            low = self.ops.xp.empty(buf.size, dtype=self.lowp_dtype)
            self.ops.lowp_copy(low, buf)
            buf = low
        lo, _, specs = self.param_units[key]
        bind_views(self.model.p, buf, specs, lo)
        self.held[key] = buf

    def _release(self, key) -> None:
        bind_views(self.model.p, None, self.param_units[key][2])
        del self.held[key]

    def _release_all(self) -> None:
        for key in list(self.held):
            self._release(key)

    def _count(self) -> None:
        alive = sum(b.nbytes for b in self.held.values()) + sum(b.nbytes for _, b in self.coming.values())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, alive)

    # ------------------------------------------------------------ the step and the checkpoints
    @property
    def param_bytes(self) -> int:
        return int(self.params.nbytes)

    def update(self, grad_scale) -> None:
        c = self.cfg
        self.ops.adamw_update(self.params, self.grad, self.m, self.v, self.decay_mask, None, None,
                              c.beta1, c.beta2, c.eps, c.weight_decay, grad_scale, schedule=self.schedule)

    def params_flat(self) -> np.ndarray:
        """The whole parameters on the host, in the full layout: every rank's shard gathered (a collective)."""
        whole = self.ops.xp.empty(self.model.size, dtype=self.params.dtype)
        self.comm.all_gather(self.params, whole, self.counts)
        return np.array(self.ops.to_host(whole)[:self.model.full_size])

    def load_flat(self, flat: np.ndarray) -> None:
        """Parameters from a host buffer of the rank's layout: its shard of them."""
        self.params[...] = self.ops.from_host(np.ascontiguousarray(flat[self.lo:self.hi]))


# What ZeRO-2 and -3 refuse, and why: (option, whether the configuration asks for it, why not)
NOT_YET = (
    ("--tp", lambda cfg: cfg.tp > 1, "the tensor-parallel shards are not cut into ZeRO's shards yet"),
    ("--pp", lambda cfg: getattr(cfg, "pp", 1) > 1, "the pipeline stages' tied wte is not sharded yet"),
    ("--grad-compress powersgd", lambda cfg: cfg.grad_compress == "powersgd",
     "PowerSGD's factors need the whole gradient of a matrix on every rank"),
    ("--backend cuda", lambda cfg: cfg.backend == "cuda",
     "the gathers and reduce-scatters run on the numpy backend only so far"),
    ("--grad-sync per-param", lambda cfg: cfg.grad_sync == "per-param",
     "there is no whole gradient buffer to reduce after backward: each block is reduce-scattered as backward "
     "finishes it (--grad-sync bucketed)"),
    ("--grad-sync flat", lambda cfg: cfg.grad_sync == "flat",
     "there is no whole gradient buffer to reduce after backward: each block is reduce-scattered as backward "
     "finishes it (--grad-sync bucketed)"),
)


def check_config(cfg) -> None:
    """--zero3-prefetch is a count, and a stage above 1 asks for nothing NOT_YET lists (after parallel/ddp.py's
    checks, --zero's stage among them)."""
    prefetch = getattr(cfg, "zero3_prefetch", 1)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise XtrainError(f"--zero3-prefetch must be 0 or more (pass steps gathered ahead), got {prefetch}")
    if cfg.zero >= 2:
        refuse_what_does_not_work_yet(f"--zero {cfg.zero}", NOT_YET, cfg)
