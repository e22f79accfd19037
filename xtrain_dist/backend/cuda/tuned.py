"""Per-GPU tuning tables: what a benchmark measured fastest on one GPU model, kept as data.

A benchmark run on a GPU writes its choices into kernels/tuned/<gpu>.json (the GPU's name as
`gpu_slug` spells it, e.g. nvidia-h200.json), one section per family of kernels:

    {"products":  {...},            # bin/bench_gemm's algorithm search: one entry per product shape
     "attention": {...},            # bin/bench_attention --sweep: the flash variant per shape
     "measured":  {"products": {"command": ..., "date": ..., "device": ...}, ...}}

The backend reads its section at start-up. No file, or no section, means today's defaults: a table is
an improvement measured on that GPU, never a requirement. A file that exists but cannot be read is an
error, not a silent default, since the run would otherwise be slower than the user was told.
"""

import json
import re
from pathlib import Path

from ...errors import XtrainError
from ...files import write_atomic
from ...shipped import KERNEL_DIR

TUNED_DIR = KERNEL_DIR / "tuned"


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200', 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the file name
    of a GPU model's table (lower case, every run of other characters one '-')."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if not slug:
        raise XtrainError(f"GPU name {device_name!r} gives no tuning-table name")
    return slug


def table_path(device_name: str, folder: Path | None = None) -> Path:
    return Path(folder or TUNED_DIR) / f"{gpu_slug(device_name)}.json"


def load_table(device_name: str, folder: Path | None = None) -> dict:
    """The whole table of this GPU model, or {} where none was written."""
    path = table_path(device_name, folder)
    if not path.exists():
        return {}
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise XtrainError(f"tuning table '{path}' cannot be read ({err})") from None
    if not isinstance(table, dict):
        raise XtrainError(f"tuning table '{path}' is not a JSON object")
    return table


def load_section(device_name: str, section: str, folder: Path | None = None) -> dict:
    """One family's choices ({} where the table or the section is absent)."""
    found = load_table(device_name, folder).get(section, {})
    if not isinstance(found, dict):
        raise XtrainError(f"tuning table '{table_path(device_name, folder)}': section {section!r} is not an object")
    return found


def write_section(device_name: str, section: str, entries: dict, measured: dict,
                  folder: Path | None = None) -> Path:
    """Replace one section of this GPU's table (the others stay), with `measured` (command, date, device)
    recorded beside it; written whole or not at all."""
    table = load_table(device_name, folder)
    table[section] = entries
    table.setdefault("measured", {})[section] = measured
    path = table_path(device_name, folder)
    write_atomic(path, json.dumps(table, indent=1, sort_keys=True) + "\n", "tuning table")
    return path
