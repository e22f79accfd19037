"""--tensorboard DIR: the records of the metrics file (train/metrics.py) as TensorBoard event files in DIR,
written by rank 0 through tensorboardX, the [tensorboard] extra.

Every number of a step's record becomes a scalar at that step, tagged by what it is: train/loss, train/lr,
train/grad_norm, speed/tokens_per_s, speed/ms, speed/mfu, comm/comm_ms, comm/exposed_comm_ms, eval/val_loss,
eval/hellaswag (a field a strategy adds goes under train/). A run that is resumed writes a new event file
beside the old ones, and TensorBoard shows both as one run.
"""

import os
from pathlib import Path

from .. import files
from ..errors import XtrainError, install_hint

GROUPS = {"loss": "train", "lr": "train", "grad_norm": "train", "tokens_per_s": "speed", "ms": "speed",
          "mfu": "speed", "comm_ms": "comm", "exposed_comm_ms": "comm", "val_loss": "eval", "hellaswag": "eval"}
# seconds between flushes to disk: a run that is killed loses at most this much
FLUSH_S = 10


def summary_writer_class():
    """tensorboardX's SummaryWriter, or one line saying what to install."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise XtrainError(f"--tensorboard needs tensorboardX ({install_hint('tensorboard')})") from None
    return SummaryWriter


def check(logdir) -> None:
    """Fail before training where the writer is missing or DIR cannot take files; leaves nothing behind."""
    summary_writer_class()
    logdir = Path(logdir)
    if logdir.exists() and not logdir.is_dir():
        raise XtrainError(f"--tensorboard '{logdir}' is a file, not a folder")
    try:
        files.probe_in(logdir, f".tensorboard.probe{os.getpid()}")
    except OSError as err:
        raise XtrainError(f"--tensorboard '{logdir}' cannot be written ({err.strerror or err})") from None


def tag(key: str) -> str:
    return f"{GROUPS.get(key, 'train')}/{key}"


def scalars(record: dict) -> dict[str, float]:
    """The scalars of a record, by tag: every number but the step (also what --wandb logs)."""
    return {tag(key): value for key, value in record.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)}


class EventLog:
    """Rank 0's event file: one scalar per number of each record, at the record's step."""

    def __init__(self, logdir):
        self.writer = summary_writer_class()(logdir=str(logdir), flush_secs=FLUSH_S)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.writer.close()
