"""AdamW over the flat buffers, and the learning-rate schedule.

The optimizer never loops over tensors: one adamw_update call covers the whole flat parameter
buffer, with a per-element decay mask saying which entries get weight decay.
"""

import math

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to min_lr at lr_decay_steps (nanoGPT).

    step counts from 0; past lr_decay_steps the rate stays at min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.lr_decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


class AdamW:
    """torch.optim.AdamW semantics; state (m, v) is two more flat buffers like the parameters."""

    def __init__(self, model, cfg: TrainConfig):
        self.model = model
        self.ops = model.ops
        self.cfg = cfg
        xp = self.ops.xp
        self.m = xp.zeros_like(model.params)
        self.v = xp.zeros_like(model.params)
        self.step_count = 0

    def step(self, lr: float, grad_scale) -> None:
        """One update with gradients multiplied by grad_scale (a (1,) array: the clip coefficient)."""
        self.step_count += 1
        c, m = self.cfg, self.model
        self.ops.adamw_update(m.params, m.grads, self.m, self.v, m.decay_mask, self.step_count, lr,
                              c.beta1, c.beta2, c.eps, c.weight_decay, grad_scale)

    @property
    def state_bytes(self) -> int:
        return self.m.nbytes + self.v.nbytes
