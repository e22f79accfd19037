"""--tensorboard DIR: the records of the metrics file (train/metrics.py) as TensorBoard event files in DIR,
written by rank 0 through tensorboardX, the [tensorboard] extra.

Every number of a step's record becomes a scalar at that step, tagged by what it is: train/loss, train/lr,
train/grad_norm, speed/tokens_per_s, speed/ms, speed/mfu, comm/comm_ms, comm/exposed_comm_ms, comm/peer_wait_ms,
eval/val_loss, eval/hellaswag (a field a strategy adds goes under train/). A run that is resumed writes a new
event file beside the old ones, and TensorBoard shows both as one run.
"""

import contextlib
import os
import time
from pathlib import Path

from .. import files
from ..errors import XtrainError, install_hint

GROUPS = {"loss": "train", "lr": "train", "grad_norm": "train", "tokens_per_s": "speed", "ms": "speed",
          "mfu": "speed", "comm_ms": "comm", "exposed_comm_ms": "comm", "peer_wait_ms": "comm",
          "val_loss": "eval", "hellaswag": "eval"}
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
    """Rank 0's event file: one scalar per number of each record, at the record's step.

    Written on rank 0's own thread, not through SummaryWriter's writer thread: that thread dies on a write
    error (a full disk) with a traceback, and the next records fill its queue and block rank 0 for good,
    with no checkpoint and no line. Here a write error is one XtrainError naming the folder and the cause,
    which ends the run like any rank's failure. The records are buffered and flushed every FLUSH_S seconds
    and at close."""

    def __init__(self, logdir, clock=time.monotonic):
        summary_writer_class()  # the import check's line, should the extra be missing
        from tensorboardX.event_file_writer import EventsWriter
        self.logdir, self.clock = str(logdir), clock
        with self._writing():
            os.makedirs(self.logdir, exist_ok=True)
            self.events = EventsWriter(os.path.join(self.logdir, "events"))
        self.flushed_at = clock()

    @contextlib.contextmanager
    def _writing(self):
        try:
            yield
        except OSError as err:
            raise XtrainError(f"--tensorboard '{self.logdir}' cannot be written ({err.strerror or err})") from None

    def write(self, record: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar
        with self._writing():
            for name, value in scalars(record).items():
                self.events.write_event(Event(wall_time=time.time(), step=record["step"], summary=scalar(name, value)))
            if self.clock() - self.flushed_at >= FLUSH_S:
                self.events.flush()
                self.flushed_at = self.clock()

    def close(self) -> None:
        with self._writing():
            self.events.close()
