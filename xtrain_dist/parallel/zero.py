"""The ZeRO stages: which slices of the flat buffers a rank keeps whole, and which collective fills them.

Every stage cuts the flat layout into the same shards (shard_bounds: rank r owns [lo, hi) of parameters,
gradients and AdamW's m and v alike) and runs AdamW's per-element arithmetic (optim.AdamW) on them:

  stage  parameters        gradients                          optimizer state  filled by
  0      whole             whole                              whole            all-reduce (parallel/ddp.py)
  1      whole             whole, the shard reduced           the shard        reduce-scatter, all-gather after AdamW
  2      whole             the shard + units in backward      the shard        reduce-scatter per unit, all-gather
  3      the shard + the   the shard + units in backward      the shard        all-gather per unit before use,
         units in use                                                          reduce-scatter per unit

ZeRO-1 is ShardedAdamW, whose gradients parallel/ddp.py's PieceReducer reduce-scatters into the shards.
ZeRO-2 (ShardedGradAdamW) and ZeRO-3 (FullyShardedAdamW) are also the model's `units` (model.WholeBuffers'
hooks): backward asks for a unit's gradient buffer before the step that writes it (before_backward), which also
says that the units the steps before wrote are final (as does backward's announcement, on_grads_ready, the
gradient sync's call); forward and backward ask ZeRO-3 for a unit's parameters before the step that reads them
(before_forward, before_backward). The model never knows the stage, nor the loop.

The units (param_units) are ln_f, each block's MLP half and attention half, wpe and wte, for gradients and
parameters alike; pass_steps says which steps read and write which. wte (tied with the classifier) is gathered
for the embedding and for the head only, and its gradient exists only during the embedding's backward, where
the model also takes the classifier's part of it (model.WholeBuffers.wte_grad_at_end). Every collective of a
stage runs on one communication thread per rank, in the order the rank's own thread hands them over, which is
the same on every rank: the passes are the same code.

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
from ..layout import ALIGN, BLOCK_HALVES, bind_views, block_half
from ..optim import AdamW, schedule_buffer
from .ddp import comm_priority, make_grad_sync, start_comm_thread
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


class _Call:
    """A call handed to the communication thread: `done` is set once the thread has queued it (on the CPU: run
    it), `after` is then the fence of its work on the thread's stream, and `keep` holds the arrays it uses
    until the rank's thread has waited for it (a GPU frees a dropped array's memory to the next allocation of
    the stream that made it, which must not come before the collective is done with it)."""

    __slots__ = ("after", "call", "computed", "done", "keep")

    def __init__(self, call, computed, keep):
        self.call, self.computed, self.keep = call, computed, keep
        self.done = threading.Event()
        self.after = None


class _CommThread:
    """The rank's communication thread at ZeRO-2 and -3: runs the calls handed to it one after another, in the
    order they came (so every rank issues the same collectives in the same order), while the rank's thread
    computes. submit returns a _Call; wait(call) returns once it is done; drain waits for all of them. A
    failure (a peer died: CommAborted) is raised by the next wait or drain; the calls after it are dropped.
    The thread ends when this object is closed or dropped.

    On a GPU the rank's thread has only queued its work when it hands a call over, and the thread only queues
    the collective. So a call carries a fence of the compute stream, which the thread's stream waits for
    before the collective reads or writes anything (the gradients backward wrote, a buffer the pool handed
    out); after it the thread records a fence of its own stream, and wait and drain make the compute stream
    wait for that (the host waits only until the call is queued), before the rank reads what was gathered or
    drops what was reduced (parallel/ddp.py's bucket fences, the same way). The numpy backend's fences are
    None and its waits nothing: there a call is done when it returns."""

    def __init__(self, ops, name: str, priority: str = "normal"):
        self.ops = ops
        self.work: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.latest: list = [None]  # the fence after the latest call the thread queued
        threading.Thread(target=_serve_calls, args=(self.work, self.errors, self.latest, ops, priority), name=name,
                         daemon=True).start()
        self.close = weakref.finalize(self, self.work.put, None)

    def submit(self, call, keep=()) -> _Call:
        handed = _Call(call, self.ops.fence(), keep)
        self.work.put(handed)
        return handed

    def wait(self, handed: _Call) -> None:
        handed.done.wait()
        if self.errors:
            raise self.errors[0]
        self.ops.wait(handed.after)
        handed.keep = ()

    def drain(self) -> None:
        self.work.join()
        if self.errors:
            raise self.errors[0]
        self.ops.wait(self.latest[0])


def _serve_calls(work: queue.Queue, errors: list, latest: list, ops, priority: str) -> None:
    start_comm_thread(ops, priority, errors)  # as the bucketed sync's (parallel/ddp.py)
    while True:
        handed = work.get()
        try:
            if handed is None:
                return
            try:
                if not errors:  # after a failure, drain without communicating
                    ops.wait(handed.computed)
                    handed.call()
                    handed.after = latest[0] = ops.fence()
            except BaseException as e:  # raised on the rank's thread by wait or drain
                errors.append(e)
            finally:
                handed.call = None  # the arrays the call names live on in handed.keep only
                handed.done.set()
        finally:
            handed = None
            work.task_done()


def param_units(layout, blocks) -> dict:
    """The units ZeRO-2 and -3 gather and reduce-scatter: key -> (lo, hi, specs) of the flat layout. A block is two
    units, its MLP half ("mlp", i: c_proj, c_fc, ln_2) and its attention half ("attn", i: c_proj, c_attn, ln_1),
    each a contiguous run of the layout (layout.block_params lists a block in backward's order); ln_f, wpe and
    wte (tied with the classifier) are one each. Halves, because a rank in backward holds a unit's parameters,
    its gradient, the next unit's prefetched parameters and the previous unit's gradient in its reduce-scatter:
    with whole blocks that is four blocks, with halves about two."""
    units = {}

    def add(key, specs):
        units[key] = (specs[0].offset, specs[-1].offset + specs[-1].size, specs)

    add("ln_f", [s for s in layout if s.name.startswith("transformer.ln_f.")])
    for i in blocks:
        for half in BLOCK_HALVES:
            add((half, i), [s for s in layout if block_half(s.name) == (i, half)])
    add("wpe", [s for s in layout if s.name == "transformer.wpe.weight"])
    add("wte", [s for s in layout if s.name == "transformer.wte.weight"])
    return units


def pass_steps(blocks) -> tuple[list, dict, dict]:
    """The steps of a forward and backward pass in order (the model's before_forward and before_backward calls),
    the units each one reads the parameters of, and the units each one writes the gradients of.

    Forward: the embedding reads wte, wpe and block 0's ln_1 (its layernorm runs with the embedding); a block's
    attention half reads its attention unit, its MLP half (from the residual sum with ln_2 on) its MLP unit and
    the next block's ln_1 or ln_f (the same op sums the residual and runs the next layernorm); the head ln_f and
    wte. Backward: the head reads ln_f and wte and writes ln_f's gradient; each half reads and writes its unit;
    the embedding reads nothing and writes wpe's and wte's gradients, the classifier's part of wte's included
    (the model takes it at the end of backward, ShardedGradAdamW.wte_grad_at_end). Every unit's gradient is
    written by one step only, so it is final when the next step starts."""
    order = [("forward", "embed")]
    for i in blocks:
        order += [("forward", ("attn", i)), ("forward", ("mlp", i))]
    order += [("forward", "head"), ("backward", "head")]
    for i in reversed(blocks):
        order += [("backward", ("mlp", i)), ("backward", ("attn", i))]
    order += [("backward", "embed")]
    needs = {("forward", "embed"): ["wte", "wpe", ("attn", blocks[0])], ("forward", "head"): ["ln_f", "wte"],
             ("backward", "head"): ["ln_f", "wte"], ("backward", "embed"): []}
    writes = {"head": ["ln_f"], "embed": ["wpe", "wte"]}
    for i in blocks:
        needs["forward", ("attn", i)] = [("attn", i)]
        needs["forward", ("mlp", i)] = [("mlp", i), ("attn", i + 1) if i < blocks[-1] else "ln_f"]
        for half in ("mlp", "attn"):
            needs["backward", (half, i)] = [(half, i)]
            writes[half, i] = [(half, i)]
    return order, needs, writes


def window(order, needs, n: int, prefetch: int) -> set:
    """The units a rank holds whole at pass step n: what it reads and what the next `prefetch` steps do."""
    return {key for later in order[n:n + 1 + prefetch] for key in needs[later]}


def transient_bytes(sizes: dict, blocks, stage: int, prefetch: int, param_itemsize: int) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) beside the shards at the pass step where a ZeRO-2 (stage 2) or ZeRO-3
    rank holds the most at once: at ZeRO-3 the gathered units of the step's window (param_itemsize each: the
    activation dtype's), and at both the float32 gradient buffers the step writes. sizes: unit key -> elements
    (param_units' spans, or the planner's closed form). A lower bound: a unit's gradient still in its
    reduce-scatter while the next step runs is not counted (the measured peak holds at most one more)."""
    order, needs, writes = pass_steps(blocks)
    best = (0, 0)
    for n, (direction, step) in enumerate(order):
        gathered = sum(sizes[k] for k in window(order, needs, n, prefetch)) if stage == 3 else 0
        grads = sum(sizes[k] for k in writes[step]) if direction == "backward" else 0
        here = (param_itemsize * gathered, 4 * grads)
        best = max(best, here, key=sum)
    return best


def unit_sizes(layout, blocks) -> dict:
    """param_units' spans in elements (transient_bytes' sizes)."""
    return {key: hi - lo for key, (lo, hi, _) in param_units(layout, blocks).items()}


class ShardedGradAdamW(ShardedAdamW):
    """ZeRO-2: gradients sharded like the optimizer state; parameters whole.

    What a rank holds: the whole float32 parameters (and their bf16 copy under bf16), its shard of the
    gradients (self.grad, hi - lo float32), m and v of its shard, and, during backward, the gradient buffers
    of the units (param_units: ln_f, each block's MLP and attention halves, wpe, wte) that the step running
    writes, and of those its communication thread has not reduce-scattered yet. A unit's gradient is final when
    the next step starts (each is written by one step, pass_steps), or when backward announces its range, which
    ever comes first; it is then handed to the thread, and dropped as soon as its reduce-scatter has added its
    part into the shard. No buffer of the whole gradient exists. wte's gradient lives only through the
    embedding's backward: the model takes the tied classifier's part of it there too (wte_grad_at_end), with
    the same operands and in the same order as at the head, so the same bits.

    The model's gradient views (model.g) point into these buffers while they live and are None otherwise."""

    every_micro_batch = True  # the loop announces every micro-batch's gradients, not only the last one's
    wte_grad_at_end = True  # the model: the classifier's wte gradient at the embedding's backward (see above)

    def __init__(self, model, cfg: TrainConfig, comm):
        super().__init__(model, cfg, comm)
        xp = self.ops.xp
        self.grad = xp.zeros(self.hi - self.lo, dtype=model.grads.dtype)
        self.compress = cfg.grad_compress == "bf16"
        self.param_units = param_units(model.layout, model.blocks)  # key -> (lo, hi, specs) of the flat layout
        self.order, self.needs, self._writes = pass_steps(model.blocks)
        self._filling: dict = {}   # unit key -> its gradient buffer, while backward writes it
        self._reduced: set = set()  # units whose sum is in self.grad this step: the next micro-batch adds to it
        self._in_flight: list = []  # the reduce-scatters handed over (_Call) that the rank has not waited for
        # the most bytes of gathered parameters and gradient buffers alive at once, as (gathered, gradients)
        self.peak_transient = (0, 0)
        self._grad_buffer_bytes = 0
        self._counting = threading.Lock()  # the rank's thread adds a buffer's bytes, the communication thread takes
        self.thread = _CommThread(self.ops, f"rank{comm.rank}-zero", comm_priority(cfg.comm_priority))
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
        self._submit_final(step)
        self._allocate(step)
        self._count()

    def _submit_final(self, step) -> None:
        """Hand the thread the gradients the steps before `step` wrote: no later step writes them."""
        for key in [k for k in self._filling if k not in self._writes[step]]:
            self._submit(key)

    def _allocate(self, step) -> None:
        """Zeroed gradient buffers for the units `step` writes, the model's views bound to them. First the rank
        waits until at most one reduce-scatter is still running (the one just handed over), so that buffers
        do not pile up behind a slow thread: a rank holds the step's buffers and at most one unit's more."""
        if len(self._in_flight) > 1:
            waiting = self.ops.timestamp()
            while len(self._in_flight) > 1:
                self.thread.wait(self._in_flight.pop(0))
            self.comm.waited(waiting, self.ops.timestamp())
        xp = self.ops.xp
        for key in self._writes[step]:
            if key not in self._filling:
                lo, hi, specs = self.param_units[key]
                buf = xp.zeros(hi - lo, dtype=self.grad.dtype)
                self._filling[key] = buf
                with self._counting:
                    self._grad_buffer_bytes += buf.nbytes
                bind_views(self.model.g, buf, specs, lo)

    def _gathered_bytes(self) -> int:
        return 0

    def _count(self) -> None:
        with self._counting:
            here = (self._gathered_bytes(), self._grad_buffer_bytes)
        self.peak_transient = max(self.peak_transient, here, key=sum)

    # ------------------------------------------------------------ the gradient sync's calls
    def on_grads_ready(self, start: int, end: int) -> None:
        # a unit goes once its last element is final: backward announces finer than units (an attention's
        # products before its ln_1, model.grad_ready_ranges), and the announcements are a growing prefix
        for key in [k for k in self._filling if start < self.param_units[k][1] <= end]:
            self._submit(key)

    def _submit(self, key) -> None:
        buf = self._filling.pop(key)
        bind_views(self.model.g, None, self.param_units[key][2])
        self._in_flight.append(self.thread.submit(lambda: self._reduce_into_shard(key, buf), keep=(buf,)))

    def _reduce_into_shard(self, key, buf) -> None:
        """On the communication thread: unit `key`'s gradient summed over the ranks, this rank's part of it added
        into its shard (written, for the step's first micro-batch); then the buffer goes. The sum is elementwise,
        so cutting the gradient into other units gives the same bits."""
        lo, hi, _ = self.param_units[key]
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
        if key in self._reduced:
            into += part
        else:
            into[...] = part
            self._reduced.add(key)
        with self._counting:
            self._grad_buffer_bytes -= buf.nbytes

    def finish(self) -> None:
        backward_done = self.ops.timestamp()
        self.thread.drain()
        self.comm.waited(backward_done, self.ops.timestamp())
        self._reduced.clear()
        self._in_flight.clear()
        if self._filling:
            raise RuntimeError(f"backward never announced the gradients of units {sorted(map(str, self._filling))}")

    def reset(self) -> None:
        self.thread.drain()
        self._reduced.clear()
        self._filling.clear()
        self._in_flight.clear()

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
    gathers a unit's parameters (param_units: ln_f, a block's MLP or attention half, wpe, wte) into a buffer of
    their own just before a pass step reads them, binding the model's views (model.p) to it, and drops it when
    no step in reach needs it.

    What each pass step reads is pass_steps' table: wte is gathered for the embedding and for the head (the
    classifier's product in forward and its input gradient in backward), and dropped between; the embedding's
    backward needs no parameter (the classifier's wte gradient, taken there, reads the logits' gradient and
    ln_f's output). With --zero3-prefetch N the units of the next N steps of the pass are gathered by the
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
        self._position = {at: n for n, at in enumerate(self.order)}
        self.held: dict = {}    # key -> the buffer the model's views point into
        self.coming: dict = {}  # key -> (_Call, float32 buffer) of a gather handed to the thread

    # ------------------------------------------------------------ the model's hooks
    def before_forward(self, step) -> None:
        self._use(("forward", step))
        self._count()

    def before_backward(self, step) -> None:
        # the finished gradients' reduce-scatters are queued before this step's gathers, which the rank then
        # waits for: so they are done, and their buffers gone, by the time the step computes
        self._submit_final(step)
        self._use(("backward", step))
        self._allocate(step)
        self._count()

    def forward_done(self) -> None:
        """A forward without backward (evaluation, generation) ends: wait for what is coming, drop it all."""
        for handed, _ in self.coming.values():
            self.thread.wait(handed)
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

    def _gather(self, key):
        """Hand the all-gather of unit `key`'s parameters to the communication thread: (_Call, buffer)."""
        lo, hi, _ = self.param_units[key]
        counts = _overlaps(lo, hi, self.shards)
        start = min(max(lo, self.lo), self.hi) - self.lo
        send = self.params[start:start + counts[self.comm.rank]]
        buf = self.ops.xp.empty(hi - lo, dtype=self.params.dtype)
        return self.thread.submit(lambda: self.comm.all_gather(send, buf, counts)), buf

    def _bind(self, key) -> None:
        if key in self.held:
            return
        handed, buf = self.coming.pop(key) if key in self.coming else self._gather(key)
        waiting = self.ops.timestamp()
        self.thread.wait(handed)
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

    def _gathered_bytes(self) -> int:
        return sum(b.nbytes for b in self.held.values()) + sum(b.nbytes for _, b in self.coming.values())

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
