"""What the benchmarks in bin/ share: where results go, the machine they came from, and writing each
result as JSON (the figures), Markdown (the table for the docs) and PNG (the plot).

Results go to bench/<cpu|gpu>/<date>/ by default. Every JSON records the command, the git commit and
the machine, including its load average before and after: on a shared machine a busy neighbour
shows up there rather than silently in the timings.
"""

import contextlib
import datetime
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

from .. import files
from . import extras

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def default_results_dir(kind: str = "cpu") -> Path:
    """bench/cpu/<date> for CPU runs; bench/results/<date> for GPU runs, the project's record of what ran
    on which GPU (bin/bench_gpu writes there too)."""
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"results kind must be 'cpu' or 'gpu', not {kind!r}")
    return REPO / "bench" / ("results" if kind == "gpu" else "cpu") / datetime.date.today().isoformat()


def out_folder(out: Path | None, kind: str) -> Path:
    """--out, or else the day's folder of this kind (default_results_dir), checked now: one that cannot be
    written is one line before the benchmark runs, not a traceback after minutes of it, when the results
    are written."""
    folder = out or default_results_dir(kind)
    files.check_out_dir(folder, "--out")
    return folder


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    """The machine as the results table states it."""
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        mem_gib = float("nan")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def describe(m: dict) -> str:
    load = f", load average {m['loadavg_1m']:.1f}" if m.get("loadavg_1m") is not None else ""
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']:g} GiB, {m['os']}, Python {m['python']}, "
            f"numpy {m['numpy']}{load}")


def header(argv=None) -> dict:
    """The fields every result file starts with."""
    return {
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": machine(),
    }


def markdown_table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def side_bars(rows: list[dict], sides, labels, figure: str, tick, ylabel: str, title: str, log: bool = False):
    """The plot of a race between sides (ours against PyTorch's, ...): a group of bars for each row, one a
    side, each bar the row's "<side>_<figure>"; tick(row) names the group."""
    plt = extras.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(rows))
    width = 0.27
    for i, (side, label) in enumerate(zip(sides, labels, strict=True)):
        ax.bar(x + (i - (len(sides) - 1) / 2) * width, [r[f"{side}_{figure}"] for r in rows], width, label=label)
    ax.set_xticks(x, [tick(r) for r in rows])
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return fig


def write_results(folder: Path, stem: str, data: dict, title: str, table: str, figure) -> list[Path]:
    """Write <stem>.json, <stem>.md and <stem>.png into folder (made if missing); each file appears whole or
    not at all, and a failure is one line. The scripts check the folder first (out_folder)."""
    m = data["machine"]
    if "loadavg_1m" in m:
        m["loadavg_1m_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    md = (f"## {title}\n\n`{data['command']}`, {data['date']}, commit {data['git_commit']}\n\n"
          f"Machine: {describe(m)} (after: {m.get('loadavg_1m_after', float('nan')):.1f})\n\n{table}")
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=110, bbox_inches="tight")
    contents = {f"{stem}.json": json.dumps(data, indent=1) + "\n", f"{stem}.md": md, f"{stem}.png": png.getvalue()}
    for name, content in contents.items():
        files.write_atomic(folder / name, content, "results file")
    return [folder / name for name in contents]


# ---------------------------------------------------------------------------- the GPU benchmarks

def gpu_header(cupy) -> dict:
    """GPU 0 as a GPU benchmark's results state it: name, SMs, memory, driver, CUDA versions, CuPy."""
    from ..backend.cuda.device import device_name

    props = cupy.cuda.runtime.getDeviceProperties(0)
    driver = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or driver

    def version(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    return {
        "gpu": device_name(0),
        "sm_count": props["multiProcessorCount"],
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "driver": driver,
        "cuda_driver_api": version(cupy.cuda.runtime.driverGetVersion()),
        "cuda_runtime": version(cupy.cuda.runtime.runtimeGetVersion()),
        "cupy": cupy.__version__,
    }


def gpu_results_header(cupy, torch) -> dict:
    """The fields every GPU benchmark's results start with: GPU 0 (gpu_header), the PyTorch it raced (None
    where it raced none), Python, the date in UTC and the command line."""
    return {**gpu_header(cupy), "torch": torch.__version__ if torch else None, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv)}


def cupy_timer(cupy, stream):
    """start() -> stop(), stop() -> the ms on `stream` between the two, by CUDA events (waits for the end)."""
    def start():
        begin = cupy.cuda.Event()
        begin.record(stream)

        def stop():
            end = cupy.cuda.Event()
            end.record(stream)
            end.synchronize()
            return cupy.cuda.get_elapsed_time(begin, end)
        return stop
    return start


def torch_timer(torch):
    """cupy_timer for PyTorch's current stream."""
    def start():
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()

        def stop():
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end)
        return stop
    return start


def write_gpu_results(out: Path, prefix: str, header: dict, rows: list[dict], markdown: str) -> Path:
    """<prefix>-<date>-<gpu>.json ({"header", "rows"}) and .md under `out`, each whole or not at all; returns
    the stem."""
    gpu_slug = re.sub(r"[^A-Za-z0-9]+", "-", header["gpu"]).strip("-").lower()
    stem = out / f"{prefix}-{header['date'][:19].replace(':', '')}-{gpu_slug}"
    files.write_atomic(stem.with_suffix(".json"), json.dumps({"header": header, "rows": rows}, indent=1) + "\n",
                       "results file")
    files.write_atomic(stem.with_suffix(".md"), markdown, "results file")
    return stem


def best_against_peer(rows: list[dict]) -> list[dict]:
    """For each (preset, batch, seq, precision) of bin/bench_gpu's `rows` (one run's, or several runs' put
    together), our fastest row against PyTorch's fastest by tokens/s, over every row of each side there:
    attention, --matmul, eager or either torch.compile mode, padded or unpadded vocabulary. Best against
    best, so that no choice of ours can have weakened the peer. A row that did not run (skipped, an error)
    takes no part; a shape where a side has no row has no ratio. In the order the shapes first appear."""
    best: dict[tuple, dict] = {}
    for row in rows:
        if "tokens_per_s" not in row:
            continue
        sides = best.setdefault((row["preset"], row["batch"], row["seq"], row["precision"]), {})
        side = "ours" if row["impl"].startswith("ours") else "torch"
        if side not in sides or row["tokens_per_s"] > sides[side]["tokens_per_s"]:
            sides[side] = row
    fields = ("impl", "vocab", "ms", "tokens_per_s", "mfu", "mfu_llmc", "loss_mismatch")
    summary = []
    for (preset, batch, seq, precision), sides in best.items():
        ours, torch = sides.get("ours"), sides.get("torch")
        summary.append({"preset": preset, "batch": batch, "seq": seq, "precision": precision,
                        **{side: {k: row[k] for k in fields if k in row} if row else None
                           for side, row in (("ours", ours), ("torch", torch))},
                        "ours_over_torch": ours["tokens_per_s"] / torch["tokens_per_s"] if ours and torch else None})
    return summary


def best_against_peer_markdown(summary: list[dict]) -> str:
    """best_against_peer's rows as a Markdown table (MFU: nanoGPT's count, then llm.c's)."""
    def side(row):
        if row is None:
            return "no row | | |"
        shares = " / ".join(f"{100 * row[k]:.1f}%" if row.get(k) is not None else "n/a" for k in ("mfu", "mfu_llmc"))
        return (f"{row['impl']}{' (MISMATCH)' if 'loss_mismatch' in row else ''} | {row.get('vocab', '')} | "
                f"{row['tokens_per_s']:,.0f} | {shares}")

    lines = ["| preset | B x T | precision | ours (best) | V | tokens/s | MFU nanoGPT / llm.c | PyTorch (best) | V | "
             "tokens/s | MFU nanoGPT / llm.c | ours / PyTorch |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for s in summary:
        ratio = f" {s['ours_over_torch']:.2f}x |" if s["ours_over_torch"] is not None else " |"
        lines.append(f"| {s['preset']} | {s['batch']} x {s['seq']} | {s['precision']} | {side(s['ours'])} | "
                     f"{side(s['torch'])} |{ratio}")
    return "\n".join(lines) + "\n"
