"""AdamW over the flat buffers, and the learning-rate schedule.

The optimizer never loops over tensors: one adamw_update call covers the whole flat parameter
buffer (or, sharded, one contiguous slice of it: ZeRO-1, parallel/zero.py), with a per-element
decay mask saying which entries get weight decay. Under mixed precision it updates the float32
master parameters and rewrites the bfloat16 copy that forward reads in the same pass
(model.params_lowp).
"""

import math

import numpy as np

from .backend.numpy_ops import adamw_schedule
from .config import TrainConfig
from .errors import XtrainError

# the shapes the rate may take after warmup (--lr-schedule); llm.c's schedulers.h offers the same four
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of step `step` (counted from 0): a linear warmup to cfg.lr over warmup_steps,
    then, by cfg.lr_schedule,
      cosine    half a cosine from lr down to min_lr at lr_decay_steps (nanoGPT, GPT-2/3)
      linear    a straight line from lr down to min_lr at lr_decay_steps
      constant  lr for good (min_lr plays no part)
      wsd       warmup-stable-decay: lr until cooldown_steps before lr_decay_steps, then down to min_lr
                along 1 - sqrt(progress) (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
                Beyond Fixed Training Durations"): a run can be resumed from its stable phase with a later
                --lr-decay-steps, and the cooldown starts from there
    Past lr_decay_steps the rate stays at min_lr (lr for constant)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step >= cfg.lr_decay_steps:
        return cfg.min_lr
    decay_start = cfg.lr_decay_steps - cfg.cooldown_steps if cfg.lr_schedule == "wsd" else cfg.warmup_steps
    if step < decay_start:
        return cfg.lr
    progress = (step - decay_start) / max(1, cfg.lr_decay_steps - decay_start)
    if cfg.lr_schedule == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        remaining = 1.0 - progress
    else:
        remaining = 1.0 - math.sqrt(progress)
    return cfg.min_lr + remaining * (cfg.lr - cfg.min_lr)


def check_schedule(cfg: TrainConfig) -> None:
    """Options that would be silently ignored, or a cooldown that overlaps the warmup, are one line each."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise XtrainError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, not {cfg.lr_schedule!r}")
    if cfg.cooldown_steps is not None and cfg.lr_schedule != "wsd":
        raise XtrainError(f"--cooldown-steps is for --lr-schedule wsd (this run's schedule is {cfg.lr_schedule})")
    if cfg.lr_schedule == "wsd" and cfg.warmup_steps + cfg.cooldown_steps > cfg.lr_decay_steps:
        raise XtrainError(f"--warmup-steps ({cfg.warmup_steps}) and --cooldown-steps ({cfg.cooldown_steps}) together "
                          f"exceed --lr-decay-steps ({cfg.lr_decay_steps}): the cooldown would start in the warmup")


def schedule_buffer(ops):
    """Where the step's [lr, 1 - beta1^step, 1 - beta2^step] live on the backend (numpy_ops.adamw_schedule)."""
    return ops.xp.zeros(3, dtype=ops.xp.float32)


class AdamW:
    """torch.optim.AdamW semantics; state (m, v) is two more flat buffers like the parameters."""

    shards = None  # every rank updates the whole buffer

    def __init__(self, model, cfg: TrainConfig):
        self.model = model
        self.ops = model.ops
        self.cfg = cfg
        xp = self.ops.xp
        self.m = xp.zeros_like(model.params)
        self.v = xp.zeros_like(model.params)
        self.step_count = 0
        self.schedule = schedule_buffer(self.ops)

    def grad_norm_squared(self):
        """The squared global norm of the (reduced) gradients, a (1,) array (the whole model's, also where
        the model holds tensor-parallel shards: GPT2.grad_norm_squared)."""
        return self.model.grad_norm_squared()

    def step(self, lr: float, grad_scale) -> None:
        """One update with gradients multiplied by grad_scale (a (1,) array: the clip coefficient)."""
        self.prepare(lr)
        self.update(grad_scale)

    def prepare(self, lr: float) -> None:
        """Count the step and write its learning rate and bias corrections into device memory (an
        asynchronous copy): the part of a step that comes from the host, done before a captured step is
        replayed (train/graph.py), or just before update() without graphs. Both ways the kernel reads the
        same float32 values, so parameters are bitwise the same."""
        self.step_count += 1
        self.ops.upload(self.schedule, adamw_schedule(self.step_count, lr, self.cfg.beta1, self.cfg.beta2))

    def update(self, grad_scale) -> None:
        """The update itself, reading the step's values from the schedule prepare() wrote: nothing here
        depends on the host, so a CUDA graph can hold it."""
        c, m = self.cfg, self.model
        self.ops.adamw_update(m.params, m.grads, self.m, self.v, m.decay_mask, None, None,
                              c.beta1, c.beta2, c.eps, c.weight_decay, grad_scale, params_lowp=m.lowp_copy,
                              schedule=self.schedule)

    @property
    def state_bytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    # ---------------------------------------------------------------- checkpoint state
    # An optimizer keeps m and v for one contiguous range of the flat buffer, `state_range`: all of it
    # here; one rank's shard in a ZeRO-1 optimizer, which sets `sharded = True` so that every rank
    # saves its own range. load_state_dict takes its range out of any state that covers it, so a
    # state saved under one sharding (or world size) loads under another.
    sharded = False

    @property
    def state_range(self) -> tuple[int, int]:
        """[start, end) of the flat buffer whose m and v this optimizer holds."""
        return 0, int(self.m.size)

    def state_dict(self) -> dict:
        """{"step_count", "start", "m", "v"}: host copies of m and v for flat[start : start + len(m)]."""
        start, _ = self.state_range
        return {"step_count": self.step_count, "start": start,
                "m": np.array(self.ops.to_host(self.m)), "v": np.array(self.ops.to_host(self.v))}

    def load_state_dict(self, state: dict) -> None:
        """Restore from a state_dict()-shaped dict whose range covers this optimizer's."""
        lo, hi = self.state_range
        start, m, v = int(state["start"]), state["m"], state["v"]
        if m.shape != v.shape or m.ndim != 1 or not (start <= lo and hi <= start + m.size):
            raise XtrainError(f"optimizer state for flat[{start}:{start + m.size}] cannot restore "
                              f"flat[{lo}:{hi}]")
        take = slice(lo - start, hi - start)
        self.m[...] = self.ops.from_host(np.ascontiguousarray(m[take], dtype=self.m.dtype))
        self.v[...] = self.ops.from_host(np.ascontiguousarray(v[take], dtype=self.v.dtype))
        self.step_count = int(state["step_count"])
