"""Which steps of a run do what: every "every N steps" option decided in one place.

After each step the loop asks the run's Cadence whether that step logs a progress line (--log-every),
is profiled (--profile-step), evaluates (--eval-every and the end of the run), draws a sample
(--sample-every), which checkpoints it saves and where (--save-every, --keep-every, the end), and
whether a stop request ends the run there; before training, preflight asks it where the run will keep
checkpoints. What each of those does stays where it lives: evaluation in eval/, writing a checkpoint
in checkpoint/, the progress line in train/metrics.py.
"""

import os
from pathlib import Path

from ..config import TrainConfig


def kept_folder(save_dir, step: int) -> Path:
    """Where --keep-every keeps the checkpoint of `step`: DIR.step000300 beside DIR, never replaced by the
    saves into DIR."""
    folder = Path(save_dir)
    if not folder.name:  # "." or "..": name it
        folder = Path(os.path.abspath(save_dir))
    return folder.with_name(f"{folder.name}.step{step:06d}")


class Cadence:
    """The decisions of a run with config `cfg` that continues after step `start` (0: from the beginning).
    Steps count from 1: `done` is the step just finished, cfg.steps the last."""

    def __init__(self, cfg: TrainConfig, start: int):
        self.cfg = cfg
        self.start = start
        # the steps of this run whose checkpoint is kept in a folder of its own, once each
        self.kept_steps = (range((start // cfg.keep_every + 1) * cfg.keep_every, cfg.steps + 1, cfg.keep_every)
                           if cfg.save_dir and cfg.keep_every else range(0))

    def profiles(self, done: int) -> bool:
        """--profile-step N times every op of step N (never with 0: steps count from 1)."""
        return done == self.cfg.profile_step

    def evaluates(self, done: int) -> bool:
        """Every eval_every steps, and at the end of the run (where there is something to evaluate: a
        validation loss or --hellaswag)."""
        cfg = self.cfg
        evaluates = cfg.eval_batches > 0 or bool(cfg.hellaswag)
        return evaluates and (done == cfg.steps or (cfg.eval_every > 0 and done % cfg.eval_every == 0))

    def samples(self, done: int) -> bool:
        """--sample-every N: rank 0 draws after steps N, 2N, ... and after the last."""
        cfg = self.cfg
        return bool(cfg.sample_every) and (done % cfg.sample_every == 0 or done == cfg.steps)

    def stops(self, done: int, requested: bool) -> bool:
        """Whether a stop request (`requested`: some rank of the job was asked) ends the run after `done`;
        after the last step the run ends anyway, as it would have without the request."""
        return bool(requested) and done < self.cfg.steps

    def logs(self, done: int, stopping: bool) -> bool:
        """The run's first step, then steps N, 2N, ... of --log-every N, and every step that has more to show
        (an evaluation, a sample, the last step, the one a stop request ends the run after)."""
        cfg = self.cfg
        return (done == self.start + 1 or done % cfg.log_every == 0 or done == cfg.steps or self.evaluates(done)
                or self.samples(done) or stopping)

    def reads_at_once(self, done: int) -> bool:
        """Whether the host reads step `done`'s loss before queuing the next step: when something after the
        step needs the device or the step's parameters as they are (an evaluation, a sample, a checkpoint,
        --profile-step's report) and at the last step. Every other step is read after the next one is
        queued (train/loop.py), so the read does not leave the GPU idle while the host prepares a step."""
        return (self.evaluates(done) or self.samples(done) or bool(self.saves(done, False)) or self.profiles(done)
                or done == self.cfg.steps)

    def saves(self, done: int, stopping: bool) -> list[Path]:
        """The checkpoints to write after `done`: DIR at every --save-every step, the last, and the one a stop
        request ends the run after (`stopping`); a kept one of its own at every --keep-every step."""
        cfg = self.cfg
        folders = []
        if cfg.save_dir and (done == cfg.steps or stopping or (cfg.save_every and done % cfg.save_every == 0)):
            folders.append(Path(cfg.save_dir))
        if done in self.kept_steps:
            folders.append(kept_folder(cfg.save_dir, done))
        return folders
