"""--metrics PATH: one JSON line per step, appended, so that a resumed run continues its file.

A line: {"step": 12, "loss": ..., "lr": ..., "grad_norm": ..., "ms": ..., "tokens_per_s": ...}, plus
"val_loss" (and "hellaswag") on evaluation steps, "sample" (the text drawn) on --sample-every steps.
Gradient-sync timing (comm_ms and the like) goes in the same line: the loop passes whatever fields its
strategy reports. Each line is written with one append and the file closed at once, so a crash loses at
most the line being written, and a reader (bin/plot_metrics) takes the last line for each step: steps
that a run redoes after resuming an older checkpoint replace the ones it lost.
"""

import json
import os
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


def progress_line(record: dict, steps: int) -> str:
    line = (f"step {record['step']:5d}/{steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"norm {record['grad_norm']:7.4f} | {record['ms']:7.1f} ms | {record['tokens_per_s']:9.0f} tok/s")
    line += f" | MFU {100 * record['mfu']:4.1f}%" if "mfu" in record else ""
    line += f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
    return line + (f" | hellaswag {record['hellaswag']:.4f}" if "hellaswag" in record else "")


def append(path, record: dict) -> None:
    line = (json.dumps(record) + "\n").encode()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # check_path made none
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as err:
        raise XtrainError(f"cannot append to --metrics '{path}' ({err.strerror or err})") from None
    if written != len(line):  # a full disk mid-line: the torn line is skipped by read(), the run stops
        raise XtrainError(f"cannot append to --metrics '{path}' (wrote {written} of {len(line)} bytes: disk full?)")


def read(path) -> list[dict]:
    """The records of a metrics file in step order, the last line for each step winning; a torn last
    line (a run killed mid-write) is skipped."""
    by_step = {}
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
    return [by_step[s] for s in sorted(by_step)]
