"""Validation loss on a fixed set of held-out sequences: the same set, and the same value, whatever
the world size, seed or training state of the run.

The set is `n_batches` global batches of `batch` windows of `seq` tokens from the validation split,
their starts spread evenly over the whole split (no RNG: every run, whatever its seed, is measured
on the same text, so curves of different runs compare). Rank r evaluates the sequences i with
i % world == r, batch by batch as training shards them; each rank sums its per-token losses in
float64 and one all-reduce adds the ranks' sums. World sizes then differ only in how float32
GEMMs round rows of different batch shapes, far below 1e-6 of the mean.
"""

from dataclasses import replace

import numpy as np

from .data import TokenFiles, take_windows
from .errors import XtrainError


class Evaluator:
    def __init__(self, tokens: np.ndarray | TokenFiles, batch: int, seq: int, n_batches: int, rank: int, world: int,
                 backend):
        if len(tokens) < seq + 1:
            raise XtrainError(f"the validation split has {len(tokens)} tokens, too few for one window of "
                              f"SEQ={seq} and its targets")
        self.ops = backend
        n = batch * n_batches
        last = len(tokens) - seq - 1  # the last start whose window and targets fit
        starts = np.arange(n, dtype=np.int64) * last // max(1, n - 1)
        self.batches = []
        for b in range(n_batches):
            windows = take_windows(tokens, starts[b * batch: (b + 1) * batch][rank::world], seq + 1)
            self.batches.append((backend.from_host(np.ascontiguousarray(windows[:, :-1])),
                                 backend.from_host(np.ascontiguousarray(windows[:, 1:]))))
        self.n_tokens = n * seq

    def loss(self, model, comm) -> float:
        """Mean cross-entropy over the whole set, on every rank (a collective: every rank calls it)."""
        xp = self.ops.xp
        total = xp.zeros(1, dtype=xp.float64)
        for ids, targets in self.batches:
            total += model.forward(ids, targets).sum(dtype=xp.float64)
        comm.all_reduce(total)
        return float(self.ops.to_host(total)[0]) / self.n_tokens


def is_eval_step(done: int, cfg) -> bool:
    """After `done` steps: every eval_every steps, and at the end of the run (where there is something to
    evaluate: a validation loss or --hellaswag)."""
    evaluates = cfg.eval_batches > 0 or bool(cfg.hellaswag)
    return evaluates and (done == cfg.steps or (cfg.eval_every > 0 and done % cfg.eval_every == 0))


def check(cfg, corpus, log):
    """Before the run: a validation split too short for SEQ is an error where --eval-every asked for
    evaluation, and skips only the default end-of-run evaluation (with a line saying so)."""
    if cfg.eval_every and not cfg.eval_batches and not cfg.hellaswag:
        raise XtrainError("--eval-every needs --eval-batches of at least 1 (or --hellaswag)")
    if cfg.eval_batches == 0 or len(corpus.val) >= cfg.seq + 1:
        return cfg
    reason = f"{corpus.val_source} has {len(corpus.val)} tokens, at least SEQ+1 = {cfg.seq + 1} are needed"
    if cfg.eval_every and not cfg.hellaswag:
        raise XtrainError(f"--eval-every: {reason}")
    log(f"no validation loss: {reason}")
    return replace(cfg, eval_batches=0)
