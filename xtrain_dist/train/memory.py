"""How much memory a run needs at least, and the check that it fits before any rank starts.

A rank holds its parameters, their gradients, AdamW's m and v (a shard of them under ZeRO-1), its share of
the held-out windows the validation loss reads and, between forward and backward, the activations backward
reads. Every thread rank of a process holds all of that
for itself, so `--world-size 8` on one machine needs eight times a rank's memory. Without a check, a run
too large for the machine ends in the kernel's OOM killer ("Killed", no word of why) or, with CuPy, in an
out-of-memory error after minutes of setup; this module turns that into one line before anything is
allocated. The figure is a lower bound: it counts the arrays that live through a whole step and leaves
out the transient ones (an op's temporaries, the gradients of activations, allocator slack), so a run
refused by it cannot have fit, and a run it passes may still run short.
"""

import math
import resource
import sys
from dataclasses import dataclass

from ..backend.cuda import cublas, cublaslt
from ..config import GPTConfig
from ..errors import XtrainError
from ..layout import param_layout, stage_blocks, vocab_rows
from ..parallel.pipeline import schedule_peak_in_flight
from ..parallel.powersgd import state_elements
from ..parallel.zero import NOT_YET as ZERO23_NOT_YET
from ..parallel.zero import shard_bounds, transient_bytes, unit_sizes

GIB = float(1 << 30)
ITEMSIZE = {"f32": 4, "i32": 4, "u8": 1}


def saved_activations(config: GPTConfig, B: int, T: int, attention: str,
                      recompute: int = 0, tp: int = 1, pp: int = 1, stage: int = 0,
                      vocab_parallel: bool = True, sequence_parallel: bool = False) -> list[tuple[str, tuple, str]]:
    """What GPT2.forward keeps for backward, array by array: (name, shape, kind), kind "act" for the
    activation dtype, "f32" or "i32" for arrays of that type whatever the precision. Its order and names
    follow GPT2.stage_forward's Tape (forward's `_saved`) and `_LayerActs` (less what --recompute leaves to
    backward), which tests/test_memory.py holds it to. With tp > 1, one tensor-parallel rank's: its heads' q, k, v,
    attention and output, its share of the MLP's hidden width, and (vocab_parallel) its vocab_rows columns of the
    logits; the residual stream is whole on every rank, or with sequence_parallel (B*T dividing by tp) the rank's
    B*T/tp tokens of it, and of the layernorms' outputs and statistics (GPT2.stream_shape).
    With pp > 1, one micro-batch's on pipeline stage `stage` (GPT2.stage_forward's Tape): its blocks', and the
    head's on the last stage only (a stage before it keeps x, the activations it sends)."""
    C, NH, V = config.n_embd, config.n_head, config.padded_vocab_size  # the logits are Vp wide (model.py)
    V = vocab_rows(config, tp) if tp > 1 and vocab_parallel else V  # or a shard's columns of them
    Ct, NHt = C // tp, NH // tp  # the rank's share of the attention's channels and heads
    # the residual stream's tokens on the rank: all of them, or a 1/tp slice of the B*T under sequence parallelism
    tokens = (B * T // tp,) if sequence_parallel and tp > 1 and B * T % tp == 0 else (B, T)
    arrays = [("ids", (B, T), "i32")]
    for layer in stage_blocks(config.n_layer, pp, stage):
        def named(field, shape, kind, layer=layer):
            return (f"h.{layer}.{field}", shape, kind)
        arrays += [
            named("x_in", (*tokens, C), "act"),
            *([named("ln1", (*tokens, C), "act")] if recompute < 2 else []),
            named("ln1_mean", tokens, "f32"), named("ln1_rstd", tokens, "f32"),
            named("qkv", (B, T, 3 * Ct), "act"),
            named("atty", (B, T, Ct), "act"),
            # standard attention keeps the softmax probabilities; flash (and cudnn) one log-sum-exp per row; auto,
            # not yet resolved (preflight resolves it before the check), counts as standard, the most it may keep
            named("att", (B, NHt, T, T), "act") if attention in ("standard", "auto")
            else named("att", (B, NHt, T), "f32"),
            named("x_mid", (*tokens, C), "act"),
            *([named("ln2", (*tokens, C), "act")] if recompute < 2 else []),
            named("ln2_mean", tokens, "f32"), named("ln2_rstd", tokens, "f32"),
            named("fch", (B, T, 4 * Ct), "act"),
            *([named("fch_gelu", (B, T, 4 * Ct), "act")] if recompute < 1 else []),
        ]
    arrays += [("x", (*tokens, C), "act")]
    if stage == pp - 1:
        arrays += [("lnf", (*tokens, C), "act"), ("lnf_mean", tokens, "f32"), ("lnf_rstd", tokens, "f32"),
                   ("dlogits", (B, T, V), "act")]
    return arrays


def array_bytes(shape: tuple, kind: str, act_itemsize: int) -> int:
    """The bytes of one of saved_activations' arrays, its activations at act_itemsize bytes each."""
    return math.prod(shape) * (act_itemsize if kind == "act" else ITEMSIZE[kind])


def block_activation_bytes(saved: list[tuple[str, tuple, str]], act_itemsize: int) -> int:
    """The bytes of saved_activations' arrays that the transformer blocks keep (the h.* ones): what
    textbook_activation_bytes counts."""
    return sum(array_bytes(shape, kind, act_itemsize) for name, shape, kind in saved if name.startswith("h."))


def textbook_activation_bytes(config: GPTConfig, B: int, T: int, layers: int, tp: int = 1,
                              sequence_parallel: bool = False, act_itemsize: int = 2) -> float:
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4) count of
    the activations `layers` transformer blocks keep per rank, s b h (34 + 5 a s / h) bytes a layer with 16-bit
    activations and 1-byte dropout masks; with tensor parallelism over t ranks s b h (10 + 24 / t + 5 a s / (h t)),
    the 10 being what stays whole (the two layernorms' inputs (4), the inputs of the first products (4) and the
    two residual dropout masks (2)); with sequence parallelism s b h (34 / t + 5 a s / (h t)). Per layer, in
    elements: 16 s b h activations (layernorms 2, attention 5: q k v's input, q, k, v, the projection's input; MLP
    9: the input, GELU's input and output of 4 h) and 2 a s^2 b (softmax's output and its dropout's); masks of 1
    byte: 2 s b h and a s^2 b. Here with the activations at act_itemsize bytes (2: the paper's figure). What the
    model keeps differs from it: no masks (backward draws them again), the probabilities once, and each
    layernorm's two float32 statistics a token (saved_activations)."""
    sbh, as2b = T * B * config.n_embd, config.n_head * T * T * B
    whole = 4 * sbh * act_itemsize + 2 * sbh  # what tensor parallelism alone keeps whole
    cut = 12 * sbh * act_itemsize + 2 * as2b * act_itemsize + as2b  # split by heads and by the MLP's width
    per_layer = (whole + cut) / tp if sequence_parallel else whole + cut / tp
    return layers * per_layer


def block_activations(config: GPTConfig, cfg, act_itemsize: int) -> dict[str, int]:
    """What rank 0's transformer blocks keep for backward of one micro-batch, as the model stores it
    (saved_activations) and as Korthikanti et al. count it (textbook_activation_bytes, at the same activation
    width): the report's figures, set side by side."""
    tp, pp = cfg.tp, cfg.pp
    rows = -(-len(range(0, cfg.batch, cfg.world_size // tp // pp)) // cfg.grad_accum)
    sequence_parallel = cfg.sequence_parallel and tp > 1 and rows * cfg.seq % tp == 0
    saved = saved_activations(config, rows, cfg.seq, cfg.attention, cfg.recompute, tp, pp, 0,
                              cfg.tp_classifier == "vocab", sequence_parallel)
    textbook = textbook_activation_bytes(config, rows, cfg.seq, len(stage_blocks(config.n_layer, pp, 0)), tp,
                                         sequence_parallel, act_itemsize)
    return {"bytes": block_activation_bytes(saved, act_itemsize), "textbook_bytes": round(textbook)}


@dataclass
class RankMemory:
    """Bytes one rank holds, by what holds them."""
    parameters: int    # the float32 master, the activation-dtype copy forward reads, the weight-decay mask (ZeRO-3:
    #                    the rank's shards of them, and the units gathered at the pass step that holds the most)
    gradients: int     # the whole buffer, or (ZeRO-2, -3) the rank's shard and that step's units' buffers
    optimizer: int     # AdamW's m and v: the whole buffer, or this rank's ZeRO-1/2/3 shard
    activations: int   # what forward keeps for backward: the rank's largest micro-batch's, times the micro-batches
    #                    a pipeline stage holds at once (parallel/pipeline.py's peak_in_flight)
    validation: int = 0  # its share of the --eval-batches held-out windows and their targets (int32)
    workspace: int = 0   # cuBLAS's workspace on the rank's stream and --matmul cublaslt's, held from the rank's start

    @property
    def persistent(self) -> int:
        """What the rank holds for the whole run."""
        return self.parameters + self.gradients + self.optimizer + self.validation + self.workspace


def least_bytes(needs: list[RankMemory]) -> int:
    """The least that ranks sharing one memory take together: all of their persistent state, and the
    activations of one of them. Rank threads usually run their steps side by side, each holding its own
    activations, but nothing forces it (a rank may finish its backward before another starts its
    forward), so only one rank's activations are certain."""
    return sum(n.persistent for n in needs) + max(n.activations for n in needs)


def gib(n: int) -> str:
    """A size for the message: GiB, or MiB and bytes for the small models' figures."""
    if n >= GIB / 10:
        return f"{n / GIB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= (1 << 20) / 10 else f"{n} B"


def rank_memories(config: GPTConfig, cfg, act_itemsize: int) -> list[RankMemory]:
    """The lower bound for every rank of a run with TrainConfig `cfg`, in rank order, with activations of
    `act_itemsize` bytes (4: float32, and numpy's bf16 emulation; 2: bf16 on a GPU). With --tp a rank
    holds its tensor-parallel shards (param_layout(config, tp)) and takes its data-parallel group's rows. With
    --pp a rank holds its stage's part of the model (param_layout(config, tp, pp, stage)) and the activations
    of as many micro-batches as its stage's schedule keeps in flight."""
    tp, pp = cfg.tp, cfg.pp
    dp = cfg.world_size // tp // pp
    activations = {}  # by (stage, micro-batch rows): ranks differ by at most one row

    def saved_bytes(stage: int, rows: int) -> int:
        if (stage, rows) not in activations:
            saved = saved_activations(config, rows, cfg.seq, cfg.attention, cfg.recompute, tp, pp, stage,
                                      cfg.tp_classifier == "vocab", cfg.sequence_parallel)
            activations[stage, rows] = sum(array_bytes(shape, kind, act_itemsize) for _, shape, kind in saved)
        return activations[stage, rows]

    # (a side thread's cuBLAS handle, the bucketed sync's, has a smaller one of its own, left out of this bound)
    workspace = ((cublas.WORKSPACE_BYTES if cfg.backend == "cuda" else 0)
                 + (cublaslt.WORKSPACE_BYTES if cfg.matmul == "cublaslt" or (cfg.matmul == "auto" and
                                                                              cfg.backend == "cuda") else 0))
    stages = {}  # by stage: what its ranks share, worked out once (thousands of ranks in a what-if run)
    memories = []
    for rank in range(cfg.world_size):
        # the mesh is arange(world).reshape(pp, dp, tp): rank r is on stage r // (dp tp), data-parallel index
        # r // tp % dp
        stage, dp_index = rank // (dp * tp), rank // tp % dp
        if stage not in stages:
            stages[stage] = _stage_figures(config, cfg, tp, pp, dp, stage, act_itemsize)
        size, bounds, compression, transient = stages[stage]
        lowp = act_itemsize if cfg.dtype != "fp32" else 0
        parameters = 4 * size + size * lowp + ITEMSIZE["u8"] * size
        gradients = 4 * size
        # ZeRO-1 shards the rank's flat buffer over its data-parallel group
        lo, hi = bounds[dp_index] if cfg.zero else (0, size)
        if cfg.zero >= 2:  # parallel/zero.py: the shards, and the gathered units and gradient buffers of the pass
            # step that holds the most at once (gathered parameters in the activation dtype)
            gathered, buffers = transient
            gradients = 4 * (hi - lo) + buffers
            if cfg.zero == 3:
                parameters = (4 + ITEMSIZE["u8"]) * (hi - lo) + gathered
        # one micro-batch at a time without a pipeline (gradient accumulation), whatever --pp-schedule says
        in_flight = schedule_peak_in_flight(cfg.pp_schedule, pp, cfg.grad_accum, stage) if pp > 1 else 1
        # the rank takes the sequences i % dp == its data-parallel index, then cuts them into --grad-accum
        # micro-batches
        rows = len(range(dp_index, cfg.batch, dp))
        memories.append(RankMemory(parameters=parameters, gradients=gradients + compression,
                                   optimizer=2 * 4 * (hi - lo),
                                   activations=in_flight * saved_bytes(stage, -(-rows // cfg.grad_accum)),
                                   # evaluate.Evaluator keeps every batch's windows of this rank's rows
                                   validation=cfg.eval_batches * rows * cfg.seq * 2 * ITEMSIZE["i32"],
                                   workspace=workspace))
    return memories


def _stage_figures(config: GPTConfig, cfg, tp: int, pp: int, dp: int, stage: int, act_itemsize: int):
    """What every rank of a pipeline stage shares: (its flat buffer's size, ZeRO's shard bounds over the
    data-parallel group or None, PowerSGD's state bytes, ZeRO-2/3's (gathered, buffers) bytes or None)."""
    layout, size = param_layout(config, tp, pp, stage, cfg.tp_classifier == "vocab")
    bounds = shard_bounds(size, dp) if cfg.zero else None
    # PowerSGD keeps an error buffer as large as each compressed matrix's gradient, and its Q
    compression = 4 * state_elements(layout, cfg.powersgd_rank) if cfg.grad_compress == "powersgd" else 0
    transient = None
    if cfg.zero >= 2:
        blocks = stage_blocks(config.n_layer, pp, stage)
        transient = transient_bytes(unit_sizes(layout, blocks), blocks, cfg.zero, cfg.zero3_prefetch,
                                    act_itemsize if cfg.dtype != "fp32" else 4)
    return size, bounds, compression, transient


def host_available_bytes() -> int | None:
    """Memory this process may still take on this machine: /proc/meminfo's MemAvailable, lowered to what
    the process's cgroup (a container's or a job's limit, v2 or v1) has left. None where neither is
    readable (not Linux)."""
    figures = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    figures.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            figures.append(max(0, int(limit) - usage))
    return min(figures) if figures else None


def either(options: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def check_fits(needs: list[RankMemory], available: int | None, where: str, cfg) -> str | None:
    """XtrainError when the ranks in `needs`, which share one memory (this machine's, or one GPU's),
    cannot fit in `available` bytes of it. When they fit only if their steps do not overlap, a note to
    print; None when they fit either way, or when `available` is unknown."""
    if available is None:
        return None
    least = least_bytes(needs)
    zero3 = not any(asks(cfg) for _, asks, _ in ZERO23_NOT_YET)  # where ZeRO-3 runs: nothing it refuses asked for
    options = ["--zero 1"] if not cfg.zero else ["--zero 3"] if cfg.zero < 3 and zero3 else []
    options += ["--attention flash"] if cfg.attention in ("standard", "auto") else []
    options += ["--recompute 2"] if cfg.recompute < 2 else []
    # the held-out windows are named where they matter, not as 0.6 MiB beside gigabytes of activations
    held_out = max(n.validation for n in needs) * 100 >= least
    lower = "BATCH, SEQ, --world-size or --eval-batches" if held_out else "BATCH, SEQ or --world-size"
    remedy = f"lower {lower}, or raise --grad-accum" + (f", or use {either(options)}" if options else "")
    if least > available:
        top = max(needs, key=lambda n: n.persistent)
        parts = [f"{gib(top.parameters)} of parameters", f"{gib(top.gradients)} of gradients",
                 f"{gib(top.optimizer)} of AdamW state"]
        parts += [f"{gib(top.validation)} of validation windows"] if held_out else []
        parts += [f"{gib(top.workspace)} of cuBLAS workspace"] if top.workspace else []
        state = f"{', '.join(parts[:-1])} and {parts[-1]}"
        acts = f"{gib(max(n.activations for n in needs))} of activations kept for backward"
        if len(needs) == 1:
            detail = f"{state}, and {acts}"
        else:
            detail = f"a rank holds up to {state}, and one rank at a time at least {acts}"
        who = f"its {len(needs)} ranks need" if len(needs) > 1 else "it needs"
        raise XtrainError(f"not enough memory for this run: {who} at least {gib(least)} and {where} has "
                          f"{gib(available)} available ({detail}); {remedy}")
    overlapping = sum(n.persistent + n.activations for n in needs)
    if overlapping > available:
        return (f"note: the {len(needs)} ranks on {where} need at least {gib(least)}, and {gib(overlapping)} when "
                f"their steps overlap, as they usually do; {where} has {gib(available)} available, so the run "
                f"may run out of memory: {remedy}")
    return None


def peak_rss_bytes() -> int:
    """The most memory this process has held at once so far (its peak resident set): what the machine
    really gave the run's ranks of this process, to set beside the lower bound."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB
