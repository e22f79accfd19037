"""ZeRO-1: AdamW with its state sharded over the ranks (ShardedAdamW), the shards it cuts the flat
buffer into (shard_bounds), and the choice between it and plain AdamW that --zero makes (make_optimizer).

What is sharded is the optimizer's state and update; gradient synchronisation reduce-scatters into the
same shards (parallel/ddp.py's PieceReducer), and the per-element arithmetic is optim.AdamW's.
"""

from ..config import TrainConfig
from ..model import ALIGN
from ..optim import AdamW, schedule_buffer


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
    return ShardedAdamW(model, cfg, comm) if cfg.zero else AdamW(model, cfg)
