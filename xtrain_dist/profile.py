"""Where a training step's time goes: every backend op timed on the backend's own clock.

`OpProfiler(backend)` stands in for the backend: the model and the optimizer built on it call the same
ops, and each op call is bracketed by two `timestamp()` marks. On the CPU a mark is the time now; on a
GPU it is a timing event on the rank's stream, so an op's span is the GPU time from the end of the
previous work to the end of this op's kernels, and the marks cost no synchronisation (they become
seconds only in `report()`). What no op covers, the gaps between spans, is time the device spent
waiting for the host to launch the next op: the launch-bound part of a step.

Matrix products and attention also get their arithmetic rate: matmul_forward and matmul_gelu_forward do
2·rows·in·out flops, matmul_backward and matmul_backward_gelu twice that (dinp and dweight; a matmul_backward
given None for one of them computes, and counts, the other alone); attention (standard or flash) counts the full
T×T square, 4·B·NH·T²·hs forward and 8·B·NH·T²·hs backward, the same counts as nanogpt_flops_per_token below,
which gives the MFU of training runs on GPUs and of bin/bench_gpu (which also gives llm.c's count,
llmc_flops_per_token). Every op also gets the rate at which it moved the
bytes it cannot avoid moving (op_bytes): for the ops bound by memory, not arithmetic (layernorm, GELU, the
residual, the classifier's softmax, AdamW), that GB/s against the GPU's (PEAK_GBPS) says how far each is
from its bound.

    profiler = OpProfiler(backend)
    model = GPT2(config, profiler, seed=1)      # every op the model or AdamW calls is timed
    ...one step...
    print(profiler.markdown(profiler.report()))
"""

import threading
from dataclasses import dataclass

import numpy as np

# the backend functions that are plumbing, not a step's work: never timed
PLUMBING = {"to_host", "to_host_later", "from_host", "upload", "from_host_act", "synchronize", "bind_side_thread",
            "fence", "wait", "timestamp", "elapsed"}


# attention op -> (which argument is qkv, how many T x T x hs products it counts); flash attention is the
# same function, so the same count (its kernels skip the masked half, as MFU conventions ignore)
ATTENTION_SQUARES = {"attention_forward": (0, 2), "flash_attention_forward": (0, 2),
                     "attention_backward": (1, 4), "flash_attention_backward": (1, 4)}


def op_flops(name: str, args: tuple) -> float:
    """Floating-point operations of one call, for the ops whose count is plain; 0 for the others."""
    if name in ("matmul_forward", "matmul_gelu_forward"):
        inp, weight = args[0], args[1]
        in_features, out_features = weight.shape
        return 2.0 * (inp.size // in_features) * in_features * out_features
    if name in ("matmul_backward", "matmul_backward_gelu"):
        dweight, _, dout, inp, weight = args[:5]
        in_features, out_features = inp.shape[-1], dout.shape[-1]
        # dinp and dweight, each a product; matmul_backward computes either alone when given None for the other
        products = 2 if name == "matmul_backward_gelu" else (dweight is not None) + (weight is not None)
        return products * 2.0 * (inp.size // in_features) * in_features * out_features
    if name in ATTENTION_SQUARES:
        where_qkv, squares = ATTENTION_SQUARES[name]
        batch, seq, three_c = args[where_qkv].shape
        return squares * 2.0 * batch * seq * seq * (three_c // 3)  # a T x T x hs product over all heads
    return 0.0


# the arguments each op updates in place, read and then written (the others are read, or written alone)
IN_PLACE = {"matmul_backward": (0, 1), "matmul_backward_gelu": (0, 1), "layernorm_backward": (1, 2),
            "encoder_backward": (0, 1), "adamw_update": (0, 2, 3), "fused_classifier": (0,), "scale": (0,),
            "bf16_round": (0,), "vocab_encoder_backward": (0, 1), "vocab_classifier": (0,)}


def _arrays(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _arrays(v)
        elif hasattr(v, "nbytes") and not isinstance(v, np.generic):  # numpy or CuPy arrays, not scalars
            yield v


def op_bytes(name: str, args: tuple, result) -> int:
    """The bytes one call cannot avoid moving: every array it is given read once (or, where it only writes
    it, written once), every array it returns written once, and every array it updates in place (IN_PLACE)
    read and written. A lower bound of its traffic: an op that reads an input twice, keeps partial sums or
    rereads its output moves more; divided by its time, a floor of its bandwidth."""
    updated = [args[i] for i in IN_PLACE.get(name, ()) if i < len(args)]  # None (no dbias) is no array
    return sum(a.nbytes for a in _arrays([*args, *updated, result]))


# What the GPU benchmarks time, and the keys of PEAK_TFLOPS: --dtype fp32, fp32 with --tf32, --dtype bf16
PRECISIONS = ("fp32", "tf32", "bf16")

# Dense (no 2:4 sparsity) peaks in TFLOP/s at boost clock, from NVIDIA's datasheets: fp32 is the CUDA-core
# rate, tf32 and bf16 the tensor-core rates. H200 has H100 SXM's compute; A100 SXM and PCIe share theirs.
PEAK_TFLOPS = {
    "H100 SXM": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
}


# Memory bandwidth in GB/s (10^9 bytes), from the same datasheets: the bound of the ops op_bytes measures
PEAK_GBPS = {"H100 SXM": 3350, "H200": 4800, "H100 PCIe": 2000, "A100": 2039}


def gpu_part(gpu_name: str) -> str | None:
    """The key of PEAK_TFLOPS and PEAK_GBPS for the GPU named as the driver names it; None for another:
    MFU and bandwidth shares are then not given, rather than given against a wrong peak."""
    name = gpu_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name and "PCIE" in name:
        return "H100 PCIe"
    if "H100" in name and ("SXM" in name or "HBM3" in name):  # "NVIDIA H100 80GB HBM3" is the SXM part
        return "H100 SXM"
    if "A100" in name:
        return "A100"
    return None


def peak_for(gpu_name: str) -> dict | None:
    """The peak TFLOP/s of each precision of the GPU named as the driver names it, or None (gpu_part)."""
    part = gpu_part(gpu_name)
    return PEAK_TFLOPS[part] if part else None


def peak_bandwidth_for(gpu_name: str) -> float | None:
    """The GB/s of the GPU named as the driver names it (an A100's: the 80 GB SXM part's), or None."""
    part = gpu_part(gpu_name)
    return PEAK_GBPS[part] if part else None


def gpt2_num_params(mcfg, vocab: int) -> int:
    """GPT-2's parameters with `vocab` rows in wte (tied to the classifier, counted once), wpe included:
    per layer 12 C^2 + 13 C (four products' weights and biases, two layernorms), and ln_f. Counted from the
    shape, not from a model's layout, so that both MFU counts below hold whatever the layout pads."""
    C, L = mcfg.n_embd, mcfg.n_layer
    return vocab * C + mcfg.n_ctx * C + L * (12 * C * C + 13 * C) + 2 * C


def nanogpt_flops_per_token(mcfg, seq: int) -> float:
    """Model flops of one token's forward and backward as nanoGPT's estimate_mfu counts them: 6 per parameter
    that enters a matrix product (N less wpe, a lookup; wte once, through the tied classifier), at the
    model's vocabulary, plus 12 L C T for attention's two T x T products over the full square (forward
    4 L C T, backward twice that). The count the trainer's MFU and the issue's targets use."""
    matmul_params = gpt2_num_params(mcfg, mcfg.vocab_size) - mcfg.n_ctx * mcfg.n_embd
    return 6.0 * matmul_params + 12.0 * mcfg.n_layer * mcfg.n_embd * seq


def llmc_flops_per_token(mcfg, seq: int) -> float:
    """Model flops of one token as llm.c's gpt2_estimate_mfu counts them: 6 N with N every parameter at the
    padded vocabulary (wpe included, wte at ceil(V / 128) * 128 rows), plus 6 L C T for attention (half of
    nanoGPT's 12: the causal half of the square). Below nanoGPT's count at long sequences, a little above
    it at short ones: for GPT-2 124M at T = 1024, 803.5 against 855.2 MFLOP a token."""
    return 6.0 * gpt2_num_params(mcfg, mcfg.padded_vocab_size) + 6.0 * mcfg.n_layer * mcfg.n_embd * seq


def mfu(step_flops: float, ms: float, peak_flops: float) -> float:
    """Model flops utilisation: the share of `peak_flops` (FLOP/s) that a step of `step_flops` model flops
    taking `ms` milliseconds reaches."""
    return step_flops / (ms * 1e-3) / peak_flops


@dataclass
class OpTime:
    name: str
    calls: int
    seconds: float
    flops: float
    bytes: float = 0.0


class OpProfiler:
    """A transparent stand-in for a backend that records a (start, end) mark pair around each op call."""

    def __init__(self, backend, active: bool = True):
        self._backend = backend
        self.active = active  # off: ops pass straight through, nothing is recorded
        # the thread whose ops are timed (the rank's); another thread's calls pass through, so the bucketed
        # sync's communication thread (its bf16 rounding, its fences) adds no marks to the rank's stream
        self._thread = threading.get_ident()
        self._spans: list[tuple[str, object, object, float, int]] = []
        self._timed: dict = {}

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name.startswith("_") or name in PLUMBING or not callable(attr):
            return attr
        if name not in self._timed:
            backend, spans = self._backend, self._spans

            def timed(*args, **kwargs):
                if not self.active or threading.get_ident() != self._thread:
                    return attr(*args, **kwargs)
                start = backend.timestamp()
                out = attr(*args, **kwargs)
                spans.append((name, start, backend.timestamp(), op_flops(name, args), op_bytes(name, args, out)))
                return out

            self._timed[name] = timed
        return self._timed[name]

    def reset(self) -> None:
        self._spans.clear()

    def report(self) -> dict:
        """{"ops": [OpTime, ...] slowest first, "ops_s": their sum, "span_s": first mark to last,
        "gaps_s": span_s - ops_s}, over the calls since the last reset()."""
        if not self._spans:
            return {"ops": [], "ops_s": 0.0, "span_s": 0.0, "gaps_s": 0.0}
        elapsed = self._backend.elapsed
        totals: dict[str, OpTime] = {}
        for name, start, end, flops, moved in self._spans:
            t = totals.setdefault(name, OpTime(name, 0, 0.0, 0.0))
            t.calls += 1
            t.seconds += max(0.0, elapsed(start, end))
            t.flops += flops
            t.bytes += moved
        ops_s = sum(t.seconds for t in totals.values())
        span_s = max(0.0, elapsed(self._spans[0][1], self._spans[-1][2]))
        return {"ops": sorted(totals.values(), key=lambda t: -t.seconds), "ops_s": ops_s, "span_s": span_s,
                "gaps_s": max(0.0, span_s - ops_s)}

    @staticmethod
    def rows(report: dict) -> list[dict]:
        """The report as JSON-ready rows, with each op's share of the span, its TFLOP/s and its GB/s (op_bytes
        over its time)."""
        span = report["span_s"] or float("nan")
        out = [{"op": t.name, "calls": t.calls, "ms": t.seconds * 1e3, "share": t.seconds / span,
                "tflops": t.flops / t.seconds / 1e12 if t.flops and t.seconds else None,
                "gbps": t.bytes / t.seconds / 1e9 if t.bytes and t.seconds else None} for t in report["ops"]]
        out.append({"op": "(between ops: host work and launches)", "calls": None, "ms": report["gaps_s"] * 1e3,
                    "share": report["gaps_s"] / span, "tflops": None, "gbps": None})
        return out

    @staticmethod
    def markdown(report: dict) -> str:
        return rows_markdown(OpProfiler.rows(report)) + (
            f"| **step (first mark to last)** | | {report['span_s'] * 1e3:.2f} | 100% | | |\n")


def compute_share(rows: list[dict]) -> tuple[float, float, float]:
    """(products and attention, the other ops, between ops): shares of the step in OpProfiler.rows, the
    split of the GPU's time the performance targets read (the other ops are the passes over memory)."""
    between = sum(r["share"] for r in rows if r["calls"] is None)
    compute = sum(r["share"] for r in rows if r["calls"] is not None
                  and (r["op"].startswith("matmul") or "attention" in r["op"]))
    other = sum(r["share"] for r in rows if r["calls"] is not None) - compute
    return compute, other, between


def attention_share(rows: list[dict]) -> float:
    """Attention's share of the step in OpProfiler.rows: every op named *attention* (standard, flash or cuDNN's,
    forward and backward), what --attention changes."""
    return sum(r["share"] for r in rows if r["calls"] is not None and "attention" in r["op"])


def rows_markdown(rows: list[dict]) -> str:
    """OpProfiler.rows (as a results file holds them; those written before GB/s was measured have no
    "gbps") as a Markdown table."""
    lines = ["| op | calls | ms | share of step | TFLOP/s | GB/s (at least) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        calls = "" if r["calls"] is None else str(r["calls"])
        rate = "" if r["tflops"] is None else f"{r['tflops']:.3g}"
        bandwidth = "" if r.get("gbps") is None else f"{r['gbps']:.4g}"
        lines.append(f"| {r['op']} | {calls} | {r['ms']:.2f} | {100 * r['share']:.1f}% | {rate} | {bandwidth} |")
    return "\n".join(lines) + "\n"
