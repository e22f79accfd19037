"""--metrics PATH: one JSON line per step, appended, so that a resumed run continues its file.

A line: {"step": 12, "loss": ..., "lr": ..., "grad_norm": ..., "ms": ..., "tokens_per_s": ...}, plus
"val_loss" (and "hellaswag") on evaluation steps, "sample" (the text drawn) on --sample-every steps.
Gradient-sync timing (comm_ms and the like) goes in the same line: the loop passes whatever fields its
strategy reports. Each line is written with one append and the file closed at once, so a crash loses at
most the line being written, and a reader (xtrain-plot) takes the last line for each step: steps
that a run redoes after resuming an older checkpoint replace the ones it lost.

A line cut short (a full disk, a kill mid-write) is never written onto: the next append drops it first,
with a note, and read() skips one at the end of the file, with a note. Only a run that continues another
(--resume) appends to a file that holds records: a fresh run refuses one, since its steps 1, 2, ... would
silently replace the other run's in every reader.
"""

import json
import os
import time
from pathlib import Path

from .. import files
from ..errors import XtrainError


def check_path(path) -> None:
    """Fail before training if PATH cannot be appended to. Leaves nothing behind (a run refused later
    finds no empty file or new folder): an existing file is opened for appending, a new one probed."""
    path = Path(path)
    try:
        if path.exists():
            with open(path, "a", encoding="utf-8"):
                pass
        else:
            files.probe_in(path.parent, f".{path.name}.probe{os.getpid()}")
    except IsADirectoryError:
        raise XtrainError(f"--metrics '{path}' is a folder, not a file") from None
    except OSError as err:
        raise XtrainError(f"--metrics '{path}' cannot be written ({err.strerror})") from None


def refuse_another_runs_records(path) -> None:
    """A run that continues none (no --resume) starts its file: one that already holds records is another
    run's, whose steps 1, 2, ... the new ones would replace in every reader. Refused before training, the
    file left as it is; an empty file, a device or a pipe (/dev/stdout) holds none."""
    path = Path(path)
    if path.is_file() and path.stat().st_size > 0:
        raise XtrainError(f"--metrics '{path}' already holds another run's records: remove it, or pass --resume "
                          "to continue that run")


def progress_line(record: dict, steps: int, times: tuple[float, float] | None = None) -> str:
    """The step's line on the console; `times` (Progress.times): the run's elapsed time and the time left."""
    line = (f"step {record['step']:5d}/{steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"norm {record['grad_norm']:7.4f} | {record['ms']:7.1f} ms | {record['tokens_per_s']:9.0f} tok/s")
    line += f" | MFU {100 * record['mfu']:4.1f}%" if "mfu" in record else ""
    line += f" | {clock_time(times[0])} elapsed, {clock_time(times[1])} left" if times else ""
    line += f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
    return line + (f" | hellaswag {record['hellaswag']:.4f}" if "hellaswag" in record else "")


def clock_time(seconds: float) -> str:
    """Seconds as h:mm:ss (0:01:05), the hours as many as it takes."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Progress:
    """The time a run has taken and the time it has left, for its progress line. The time left is the steps
    to go at the wall time per step since this process's first step ended: that step holds compilation and
    warm-up, the later ones everything a step costs on average (evaluations, samples and saves included).
    Before a second step, the first step's own time stands in."""

    def __init__(self, steps: int, clock=time.perf_counter):
        self.steps, self.clock = steps, clock
        self.start = clock()
        self.first: tuple[int, float] | None = None  # (step, when it ended) of this process's first step

    def times(self, step: int, step_s: float) -> tuple[float, float]:
        """(seconds since the run started, seconds left) once `step`, which took `step_s`, has ended."""
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        first_step, first_end = self.first
        per_step = (now - first_end) / (step - first_step) if step > first_step else step_s
        return now - self.start, (self.steps - step) * per_step


_TAIL_CHUNK = 1 << 16


def _torn_tail(fd: int, size: int) -> int:
    """How many bytes at the end of the file open as `fd` (`size` bytes) follow its last newline: a line a
    write cut short. 0 where the file ends with a newline."""
    end = size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return size - (start + newline + 1)
        end = start
    return size


def append(path, record: dict) -> str | None:
    """Append `record` as one line. A torn last line (a run stopped mid-write) is dropped first, so the
    record starts a line of its own; returns a note saying so, None otherwise."""
    line = (json.dumps(record) + "\n").encode()
    note = None
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # check_path made none
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644) if _is_file(path) else \
            os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # a device or a pipe: written as it is
        try:
            size = os.fstat(fd).st_size
            if size and _is_file(path) and (torn := _torn_tail(fd, size)):
                os.ftruncate(fd, size - torn)
                note = (f"--metrics '{path}': dropped a torn last line ({torn} bytes, a run stopped while "
                        "writing it) before appending")
            written = os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as err:
        raise XtrainError(f"cannot append to --metrics '{path}' ({err.strerror or err})") from None
    if written != len(line):  # a full disk mid-line: the next append drops the torn line, the run stops
        raise XtrainError(f"cannot append to --metrics '{path}' (wrote {written} of {len(line)} bytes: disk full?)")
    return note


def _is_file(path) -> bool:
    """A regular file (or none yet): one that can be read back and cut; not a device or a pipe."""
    path = Path(path)
    return not path.exists() or path.is_file()


def read(path, note=lambda line: None) -> list[dict]:
    """The records of a metrics file in step order, the last line for each step winning; a torn last
    line (a run killed mid-write) is skipped, and `note` told so."""
    by_step = {}
    files.check_input("metrics file", path)  # before the read opens it: a named pipe would block it
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise XtrainError(f"metrics file '{path}' cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise XtrainError(f"metrics file '{path}' is not UTF-8 text (invalid byte at offset {err.start})") from None
    for number, line in enumerate(lines, 1):
        try:
            record = files.loads_json(line)
            by_step[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise XtrainError(f"metrics file '{path}', line {number}: not a metrics record") from None
            note(f"metrics file '{path}', line {number}: skipped a torn last line (a run stopped while writing it)")
    return [by_step[s] for s in sorted(by_step)]
