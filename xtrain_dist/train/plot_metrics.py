"""Draw the train and validation loss curves, and the throughput, of one or more runs into a PNG.

Each run is a metrics file written by `xtrain-train --metrics PATH` (one JSON line per step; where a
resumed run redid steps, the last line for each step counts). Left: training loss (faint: every
step; solid: a moving average) and validation loss (dots); then tokens per second; and where a run
scored HellaSwag (--hellaswag), its accuracy in a third panel.

    xtrain-plot runs/a.jsonl runs/b.jsonl -o docs/loss.png --labels "1 rank,2 ranks"
"""

import io
import sys
from pathlib import Path

import numpy as np

from xtrain_dist import files
from xtrain_dist.bench import extras
from xtrain_dist.command import OneLineParser, command_name, path_arg, positive_int, run_command
from xtrain_dist.errors import XtrainError
from xtrain_dist.train import metrics

PLOTTED = ("loss", "val_loss", "tokens_per_s", "hellaswag")  # a record with none of them draws nothing


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the `window` values centred on each point (fewer at the ends), so that it does not lag."""
    sums = np.cumsum(np.insert(np.asarray(values, dtype=np.float64), 0, 0.0))
    i = np.arange(len(values))
    lo, hi = np.maximum(i - window // 2, 0), np.minimum(i + (window + 1) // 2, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that hold a number under `key`: a line written by another
    version of the trainer, or by a strategy that reports other fields, may lack it."""
    pairs = [(r["step"], r[key]) for r in records
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    steps, values = zip(*pairs, strict=True) if pairs else ((), ())
    return np.array(steps, dtype=np.float64), np.array(values, dtype=np.float64)


def plot(runs: list[tuple[str, list[dict]]], out: Path, title: str | None, smooth: int | None) -> None:
    plt = extras.pyplot()
    scored = any(len(series(records, "hellaswag")[0]) for _, records in runs)
    fig, axes = plt.subplots(1, 2 + scored, figsize=(11 + 4 * scored, 4),
                             gridspec_kw={"width_ratios": [3, 2] + [2] * scored})
    ax_loss, ax_speed = axes[:2]
    for i, (label, records) in enumerate(runs):
        color = f"C{i}"
        steps, loss = series(records, "loss")
        if len(loss):
            window = smooth or max(1, len(loss) // 40)
            ax_loss.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
            ax_loss.plot(steps, moving_average(loss, window), color=color, linewidth=1.8,
                         label=f"{label}: train" + (f" ({window}-step mean)" if window > 1 else ""))
        val_steps, val = series(records, "val_loss")
        if len(val):
            ax_loss.plot(val_steps, val, color=color, linestyle="--", marker="o", markersize=4,
                         label=f"{label}: validation")
        steps, speed = series(records, "tokens_per_s")
        if len(speed):
            window = smooth or max(1, len(speed) // 40)
            ax_speed.plot(steps, speed, color=color, alpha=0.25, linewidth=0.8)
            ax_speed.plot(steps, moving_average(speed, window), color=color, linewidth=1.8, label=label)
        steps, accuracy = series(records, "hellaswag")
        if len(accuracy):
            axes[2].plot(steps, accuracy, color=color, marker="o", markersize=4, label=label)
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax_speed.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax_speed.set_ylim(bottom=0)
    if scored:
        axes[2].set(xlabel="step", ylabel="accuracy", title="HellaSwag")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel: legend() would only warn
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90, pil_kwargs={"optimize": True})
    plt.close(fig)
    files.write_atomic(out, png.getvalue(), "--out")


PROG = "plot_metrics"


def plot_metrics(argv: list[str]) -> int:
    p = OneLineParser(prog=command_name(PROG), description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="METRICS", type=path_arg, help="metrics files (xtrain-train --metrics)")
    p.add_argument("-o", "--out", required=True, type=path_arg, help="the PNG to write")
    p.add_argument("--labels", help="comma-separated names of the runs (default: the file names)")
    p.add_argument("--title")
    p.add_argument("--smooth", type=positive_int, help="moving-average window in steps (default: a 40th of the run)")
    args = p.parse_args(argv)
    out = args.out
    if out.is_dir():
        raise XtrainError(f"--out '{out}' is a folder: name the .png file to write")
    if out.suffix.lower() != ".png":
        raise XtrainError(f"--out '{out}' must name a .png file")
    files.refuse_output_on_inputs(out, "--out", [("the metrics file", run) for run in args.runs],
                                  "the plot would replace it")
    labels = args.labels.split(",") if args.labels else [run.stem for run in args.runs]
    if len(labels) != len(args.runs):
        raise XtrainError(f"--labels names {len(labels)} runs, {len(args.runs)} metrics files were given")
    runs = []
    for label, path in zip(labels, args.runs, strict=True):
        records = metrics.read(path, note=lambda line: print(f"plot_metrics: note: {line}", file=sys.stderr))
        if not any(len(series(records, key)[0]) for key in PLOTTED):
            raise XtrainError(f"metrics file '{path}' has nothing to plot: no record has "
                              f"{', '.join(PLOTTED[:-1])} or {PLOTTED[-1]}")
        runs.append((label, records))
    plot(runs, out, args.title, args.smooth)
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    return run_command(PROG, lambda: plot_metrics(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
