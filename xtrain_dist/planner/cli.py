"""xtrain-plan: how much memory each GPU needs and how long a step takes, for a run on 1 to 1024 GPUs.

A preset or a custom shape, a mesh (dp x tp x pp), a batch, a sequence and a precision in; per-device
memory, the step's time by part, and the scaling table out. The arithmetic is planner/projection.py's;
docs/planning.md works an example. Tensor and pipeline parallelism are projections by Megatron-LM's
formulas: the trainer itself splits only the data (dp, with --zero 1 for the optimizer state, 2 and 3 for the gradients
and the parameters too).

    xtrain-plan --model gpt2-124m --gpus 8 --batch 64 --bus-gbps 370 --inter-node-gbps 40
    xtrain-plan --layers 126 --d-model 16384 --d-ff 53248 --heads 128 --vocab 128256 --seq 8192 \\
        --gpus 1024 --tp 8 --pp 16 --zero 1 --sequence-parallel --recompute 2 --attention flash \\
        --batch 512 --grad-accum 64 --bus-gbps 370 --inter-node-gbps 40
"""

import argparse
import json
import math
import sys
from pathlib import Path

from .. import files
from ..command import (
    OneLineParser,
    command_name,
    path_arg,
    positive_int,
    run_command,
)
from ..config import GPT2_VOCAB_SIZE, PRESETS, model_config
from ..errors import XtrainError, shown
from ..profile import PEAK_TFLOPS
from ..train.memory import gib
from .projection import (
    Hardware,
    Mesh,
    Run,
    Shape,
    StepTime,
    check,
    least,
    model_params,
    scaling_table,
    step_time,
)


def share_of_one(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(must_be_text("a number from 0 to 1", text))
    return value


share_of_one.__name__ = "a number from 0 to 1"


def number_in(low: float, high: float):
    """An argparse type: a finite number from `low` to `high`, both > 0 where the planner divides by it: 0,
    a subnormal or an infinity would make a step take no time or forever, and NaN anything."""
    what = f"a number from {low:g} to {high:g}"

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(must_be_text(what, text))
        return value
    check.__name__ = what
    return check


def must_be_text(what: str, text: str) -> str:
    return f"must be {what}, got '{shown(text)}'"


# the ranges the planner takes its figures in, from flags and from results files alike: wide enough for any
# device (a CPU measured at 0.01 TFLOP/s, a link at 0.1 GB/s) and narrow enough that no figure is 0, subnormal,
# infinite or NaN, where a step time or an efficiency is divided by it
TFLOPS = (1e-6, 1e6)      # a device's peak, TFLOP/s
MFU = (1e-6, 1.0)         # the share of the peak a step reaches
GBPS = (1e-6, 1e6)        # a bus bandwidth, GB/s
LATENCY_US = (0.0, 1e9)   # one collective call's fixed cost, microseconds
BUCKET_MB = (1e-6, 1e6)   # a gradient bucket, MiB: at least one byte
SECONDS = (1e-9, 3600.0)  # a measured time of one collective call


# --gpu -> (profile.PEAK_TFLOPS key, memory in GiB as the driver reports it: 80 GB parts show 79.2)
GPUS = {"h100": ("H100 SXM", 79.2), "h100-pcie": ("H100 PCIe", 79.2), "h200": ("H200", 139.8),
        "a100": ("A100", 79.2)}


def read_json(path: Path, option: str) -> dict:
    try:
        data = files.loads_json(files.read_regular(path))
    except OSError as e:
        raise XtrainError(f"cannot read {option} '{path}': {e.strerror or e}") from None
    except ValueError as e:
        raise XtrainError(f"cannot read {option} '{path}': {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise XtrainError(f"{option} '{path}' is not a results file (no list of 'rows')")
    return data


def field(path: Path, option: str, index: int, row: dict, key: str, bounds=None, integer: bool = False):
    """rows[index][key] of a results file, a number (an integer where `integer`; never true or false, which
    JSON's readers take for 1 and 0) within `bounds` (or >= 1 for an integer); else one line naming the
    file, the row and the field."""
    value = row.get(key)
    low, high = bounds if bounds else (1, float("inf"))
    kind = "an integer" if integer else "a number"
    what = f"{kind} from {low:g} to {high:g}" if bounds else f"{kind} >= 1"
    fits = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not fits or not math.isfinite(value) or not low <= value <= high:
        raise XtrainError(f"{option} '{path}': rows[{index}].{key} must be {what}, got "
                          f"{shown(json.dumps(value)) if key in row else 'nothing'}")
    return value


def bench_gpu_mfu(path: Path, preset: str | None, precision: str) -> tuple[float, dict]:
    """The MFU a bench_gpu results file measured for our fastest row of this preset and precision (any
    shape), and that row. Every such row's MFU is checked (field), not only the best one's: a NaN compares
    as neither larger nor smaller, and would pick a row by accident."""
    option = "--from-bench-gpu"
    rows = [(i, r) for i, r in enumerate(read_json(path, option)["rows"])
            if isinstance(r, dict) and str(r.get("impl", "")).startswith("ours") and r.get("preset") == preset
            and r.get("precision") == precision]
    if not rows:
        raise XtrainError(f"--from-bench-gpu '{path}' has no row of ours for --model {preset} at --precision "
                          f"{precision}")
    mfus = [(field(path, option, i, r, "mfu", MFU), r) for i, r in rows]
    mfu, best = max(mfus, key=lambda m: m[0])
    return float(mfu), best


def bench_collectives_bus(path: Path, world: int | None = None) -> tuple[float, float, dict]:
    """(bus GB/s, per-call latency in seconds, the row): a bench_collectives results file's all_reduce at
    `world` ranks (its largest world where it has not measured that one) and its largest size there (the bus
    bandwidth), and the time of its smallest size (the call's cost). Every all_reduce row is checked (field)."""
    option = "--from-bench-collectives"
    rows = [(i, r) for i, r in enumerate(read_json(path, option)["rows"])
            if isinstance(r, dict) and r.get("op") == "all_reduce"]
    if not rows:
        raise XtrainError(f"--from-bench-collectives '{path}' has no all_reduce rows")
    for i, r in rows:
        field(path, option, i, r, "world", integer=True)
        field(path, option, i, r, "bytes", integer=True)
        field(path, option, i, r, "median_s", SECONDS)
        field(path, option, i, r, "busbw_gbs", GBPS)
    rows = [r for _, r in rows]
    worlds = {r["world"] for r in rows}
    world = world if world in worlds else max(worlds)
    at_world = [r for r in rows if r["world"] == world]
    largest = max(at_world, key=lambda r: r["bytes"])
    smallest = min(at_world, key=lambda r: r["bytes"])
    return float(largest["busbw_gbs"]), float(smallest["median_s"]), largest


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog=command_name("python -m xtrain_dist.plan"), description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n", 2)[2])
    shape = ap.add_argument_group("the model: a preset, or a shape (--layers, --d-model and --heads at least)")
    shape.add_argument("--model", default=None, help=f"one of {', '.join(PRESETS)} (default gpt2-124m)")
    shape.add_argument("--layers", type=positive_int, default=None)
    shape.add_argument("--d-model", type=positive_int, default=None)
    shape.add_argument("--d-ff", type=positive_int, default=None, help="the MLP's width (default 4 x --d-model)")
    shape.add_argument("--heads", type=positive_int, default=None)
    shape.add_argument("--vocab", type=positive_int, default=GPT2_VOCAB_SIZE)
    run = ap.add_argument_group("the run")
    run.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default the preset's "
                     "context; a shape's context is --seq, 1024 if not given)")
    run.add_argument("--batch", type=positive_int, default=None,
                     help="sequences per step over all data-parallel ranks (default 8 per data-parallel rank)")
    run.add_argument("--grad-accum", type=positive_int, default=1,
                     help="micro-batches per step (the pipeline's m)")
    run.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="bf16",
                     help="bf16: bf16 activations and products; tf32: float32 storage, TF32 products")
    run.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                     help="1: AdamW's state sharded over dp; 2: the gradients too; 3: the parameters too")
    run.add_argument("--recompute", type=int, choices=(0, 1, 2), default=0,
                     help="backward recomputes GELU (1), and the layernorms (2)")
    run.add_argument("--attention", choices=("standard", "flash"), default="standard",
                     help="standard keeps the T x T probabilities for backward; flash one number a row")
    run.add_argument("--grad-compress", choices=("none", "bf16"), default="none")
    run.add_argument("--sequence-parallel", action="store_true",
                     help="the tp group also cuts the layernorms' and the residual's activations by tokens")
    mesh = ap.add_argument_group("the mesh: --gpus = dp x tp x pp")
    mesh.add_argument("--gpus", type=positive_int, default=None, help="default dp x tp x pp")
    mesh.add_argument("--dp", type=positive_int, default=None, help="default --gpus / (tp x pp)")
    mesh.add_argument("--tp", type=positive_int, default=1, help="tensor parallelism (a projection)")
    mesh.add_argument("--pp", type=positive_int, default=1, help="pipeline parallelism (a projection)")
    hw = ap.add_argument_group("the hardware")
    hw.add_argument("--gpu", choices=tuple(GPUS), default="h100", help="its peak (profile.py) and memory")
    hw.add_argument("--peak-tflops", type=number_in(*TFLOPS), default=None,
                    help="a device's peak at --precision instead of --gpu's (a CPU's, measured)")
    hw.add_argument("--mfu", type=number_in(*MFU), default=0.4, help="the share of the peak a step reaches")
    hw.add_argument("--from-bench-gpu", type=path_arg, default=None,
                    help="a bin/bench_gpu JSON: the MFU it measured for the preset at --precision")
    hw.add_argument("--bus-gbps", type=number_in(*GBPS), default=None,
                    help="all-reduce bus bandwidth inside a node in GB/s (nccl-tests' busbw)")
    hw.add_argument("--from-bench-collectives", type=path_arg, default=None,
                    help="a bin/bench_collectives JSON: its all_reduce busbw and per-call time at dp ranks (or "
                    "its largest world)")
    hw.add_argument("--inter-node-gbps", type=number_in(*GBPS), default=None,
                    help="the bus bandwidth once the data-parallel ring spans nodes (default --bus-gbps)")
    hw.add_argument("--tp-bus-gbps", type=number_in(*GBPS), default=None,
                    help="the tensor- and pipeline-parallel links' (default --bus-gbps)")
    hw.add_argument("--node-gpus", type=positive_int, default=8, help="GPUs per node")
    hw.add_argument("--latency-us", type=number_in(*LATENCY_US), default=None,
                    help="the fixed cost of one collective call (default 0, or --from-bench-collectives')")
    hw.add_argument("--bucket-mb", type=number_in(*BUCKET_MB), default=25.0, help="gradient bucket size in MiB")
    hw.add_argument("--overlap", type=share_of_one, default=1.0,
                    help="the share of backward under which gradient buckets travel")
    out = ap.add_argument_group("output")
    out.add_argument("--max-gpus", type=positive_int, default=1024, help="the scaling table's last row")
    out.add_argument("--json", type=path_arg, default=None, help="also write the plan to this file as JSON")
    return ap


def plan_inputs(args) -> tuple[Shape, Mesh, Run, Hardware, dict]:
    """The parsed arguments as the projection's inputs, every combination checked; and where each
    measured figure came from."""
    custom = [f"--{n.replace('_', '-')}" for n in ("layers", "d_model", "d_ff", "heads")
              if getattr(args, n) is not None]
    if args.model and custom:
        raise XtrainError(f"--model and {custom[0]} both given: name a preset or give a shape, not both")
    if custom:
        missing = [f for f, v in (("--layers", args.layers), ("--d-model", args.d_model), ("--heads", args.heads))
                   if v is None]
        if missing:
            raise XtrainError(f"a custom shape needs {', '.join(missing)} as well")
        seq = args.seq or 1024
        shape = Shape(args.layers, args.heads, args.d_model, args.d_ff or 4 * args.d_model, args.vocab, seq)
        preset = None
    else:
        preset = args.model or "gpt2-124m"
        shape = Shape.of(model_config(preset, args.vocab))
        seq = args.seq or shape.n_ctx
    tp_pp = args.tp * args.pp
    if args.gpus is None:
        dp = args.dp or 1
        gpus = dp * tp_pp
    else:
        gpus = args.gpus
        if args.dp is None and gpus % tp_pp:
            raise XtrainError(f"--gpus ({gpus}) must be divisible by --tp x --pp ({args.tp} x {args.pp})")
        dp = args.dp or gpus // tp_pp
    if dp * tp_pp != gpus:
        raise XtrainError(f"the mesh --dp {dp} x --tp {args.tp} x --pp {args.pp} = {dp * tp_pp} devices, "
                          f"not --gpus {gpus}")
    mesh = Mesh(dp=dp, tp=args.tp, pp=args.pp)
    if args.tp > args.node_gpus:
        raise XtrainError(f"--tp ({args.tp}) must be at most --node-gpus ({args.node_gpus}): its all-reduces "
                          "run every layer and need a node's links")
    run = Run(batch=args.batch or 8 * dp, seq=seq, precision=args.precision, zero=args.zero,
              recompute=args.recompute, attention=args.attention, grad_accum=args.grad_accum,
              grad_compress=args.grad_compress, sequence_parallel=args.sequence_parallel)
    check(shape, mesh, run)
    sources = {}
    part, memory_gib = GPUS[args.gpu]
    peak = (args.peak_tflops or PEAK_TFLOPS[part][args.precision]) * 1e12
    mfu = args.mfu
    if args.from_bench_gpu and preset is None:
        raise XtrainError("--from-bench-gpu needs --model: bench_gpu measures presets, not a custom shape")
    if args.from_bench_gpu:
        mfu, row = bench_gpu_mfu(args.from_bench_gpu, preset, args.precision)
        sources["mfu"] = {"file": str(args.from_bench_gpu), "batch": row.get("batch"), "seq": row.get("seq"),
                          "impl": row.get("impl"), "ms": row.get("ms"), "mfu": mfu}
    if args.bus_gbps and args.from_bench_collectives:
        raise XtrainError("--bus-gbps and --from-bench-collectives both given: use one")
    latency = 0.0
    if args.from_bench_collectives:
        bus, latency, row = bench_collectives_bus(args.from_bench_collectives, dp)
        sources["bus"] = {"file": str(args.from_bench_collectives), "world": row["world"], "bytes": row["bytes"],
                          "busbw_gbs": bus, "latency_s": latency}
    elif args.bus_gbps:
        bus = args.bus_gbps
    else:
        raise XtrainError("the bus bandwidth is needed: give --bus-gbps (nccl-tests' all_reduce busbw, GB/s) "
                          "or --from-bench-collectives FILE")
    if args.latency_us is not None:
        latency = args.latency_us * 1e-6
    hardware = Hardware(peak_flops=peak, mfu=mfu, bus_gbps=bus, inter_node_gbps=args.inter_node_gbps or bus,
                        tp_bus_gbps=args.tp_bus_gbps or bus, node_gpus=args.node_gpus, latency_s=latency,
                        bucket_bytes=int(args.bucket_mb * (1 << 20)), overlap=args.overlap)
    sources["gpu"] = {"name": args.gpu, "memory_gib": memory_gib, "peak_tflops": peak / 1e12}
    return shape, mesh, run, hardware, sources


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.2f} s"


def row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<52}{value:>12}" + (f"  {note}" if note else "")


def report_lines(shape: Shape, mesh: Mesh, run: Run, hw: Hardware, t: StepTime, memory_gib: float) -> list[str]:
    m = t.memory
    total = least(m)
    fits = "fits" if total <= memory_gib * (1 << 30) else "does NOT fit"
    n = model_params(shape)
    lines = [
        f"model: {shape.n_layer} layers, d_model {shape.d_model}, d_ff {shape.d_ff}, {shape.n_head} heads, "
        f"vocab {shape.vocab_size}: {n / 1e9:.2f}B parameters" if n >= 1e9 else
        f"model: {shape.n_layer} layers, d_model {shape.d_model}, d_ff {shape.d_ff}, {shape.n_head} heads, "
        f"vocab {shape.vocab_size}: {n / 1e6:.1f}M parameters",
        f"mesh: {mesh.gpus} GPUs = dp {mesh.dp} x tp {mesh.tp} x pp {mesh.pp}; batch {run.batch} x {run.seq} "
        f"tokens in {run.grad_accum} micro-batch(es); {run.precision}, ZeRO-{run.zero}, --recompute "
        f"{run.recompute}, --attention {run.attention}" + (", sequence parallel" if run.sequence_parallel else ""),
        "",
        "memory per device (the device that holds the most):",
        row("parameters (float32 master" + (", bf16 copy" if run.precision == "bf16" else "") + ", decay mask)"
            if run.zero < 3 else "parameters (ZeRO-3 shard, gathered units)",
            gib(m.parameters)),
        row("gradients (float32" + (", shard, units in backward)" if run.zero >= 2 else ")"),
            gib(m.gradients)),
        row("AdamW m and v (float32" + (f", this rank's ZeRO-{run.zero} shard)" if run.zero else ")"),
            gib(m.optimizer)),
        row("activations kept for backward", gib(m.activations)),
        row("total", gib(total), f"{fits} in {memory_gib:g} GiB"),
        "",
        f"step time: peak {hw.peak_flops / 1e12:g} TFLOP/s x MFU {hw.mfu:.3f}; all-reduce bus {hw.bus_gbps:g} GB/s "
        f"in a node, {hw.inter_node_gbps:g} GB/s across; {hw.bucket_bytes / (1 << 20):g} MiB buckets",
        row("compute", ms(t.compute_s)),
    ]
    if mesh.pp > 1:
        lines += [row("pipeline bubble (pp - 1) / m", ms(t.bubble_s)), row("pipeline sends", ms(t.pp_comm_s))]
    if mesh.tp > 1:
        lines.append(row("tensor-parallel all-reduces", ms(t.tp_comm_s)))
    lines += [row("gradient communication, all of it", ms(t.dp_comm_s)),
              row("of it exposed (not hidden by backward)", ms(t.dp_exposed_s)),
              row("step", ms(t.step_s), f"{t.tokens_per_s:,.0f} tokens/s")]
    return lines


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| GPUs | dp x tp x pp | batch | step | tokens/s | efficiency | gradient comm | exposed comm | "
             "memory per GPU |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['gpus']} | {r['dp']} x {r['tp']} x {r['pp']} | {r['batch']} | {ms(r['step_s'])} | "
              f"{r['tokens_per_s']:,.0f} | {r['efficiency']:.1%} | {ms(r['dp_comm_s'])} | {ms(r['exposed_s'])} | "
              f"{gib(r['memory_bytes'])} |" for r in rows]
    return lines


def main(argv=None) -> int:
    def run_plan() -> int:
        args = build_parser().parse_args(argv)
        shape, mesh, run, hw, sources = plan_inputs(args)
        if args.json:
            files.check_writable(args.json, "--json")
        t = step_time(shape, mesh, run, hw)
        rows = scaling_table(shape, mesh, run, hw, args.max_gpus)
        print("\n".join(report_lines(shape, mesh, run, hw, t, sources["gpu"]["memory_gib"])))
        print(f"\nscaling: every data-parallel rank keeps {run.batch / mesh.dp:g} sequences; efficiency = "
              "tokens/s / (GPUs x one GPU's tokens/s without communication)\n")
        print("\n".join(table_lines(rows)))
        if args.json:
            plan = {"shape": vars(shape), "mesh": vars(mesh), "run": vars(run), "hardware": vars(hw),
                    "sources": sources, "memory": vars(t.memory) | {"total": least(t.memory)},
                    "step": {k: v for k, v in vars(t).items() if k != "memory"}, "scaling": rows}
            files.write_atomic(args.json, json.dumps(plan, indent=1) + "\n", "--json")
        return 0

    return run_command("python -m xtrain_dist.plan", run_plan)  # run_command names a console script itself


if __name__ == "__main__":
    sys.exit(main())
