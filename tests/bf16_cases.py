"""Every op of a bf16 backend on random inputs, and the tolerance a bf16 result is held to.

Shared by tests/test_precision.py (CPU: the tolerance admits a different float32 summation order and
rejects a missing rounding) and tests/test_cuda_bf16.py (GPU: every bf16 kernel against the numpy
bf16 emulation).

Why this tolerance. Both sides get the same bf16 inputs, compute in float32 and round each stored
result once to bf16. Their float32 results differ only by summation order (a few float32 ulps,
~1e-7 relative, times the cancellation in the sum); rounding maps both to the same bf16 value
unless they straddle a rounding boundary, and then to neighbours one bf16 ulp apart. So a stored
output ("act") may differ by 1 ulp of itself plus a float32-sized absolute term for results that
cancel to near zero (FLOOR * the largest magnitude). Where a product reads a rounded intermediate
("act2": attention's y reads att, dq and dk read dscores), one straddle upstream moves a result by
up to 2^-8 of one term of its sum, which is many ulps of a small result (15 seen) and, on short
rows (T = 7), up to 3e-3 of the largest magnitude: 2 ulps plus CHAIN_FLOOR = 2^-7 of the largest
magnitude. Norm-wise only the rare straddles count: at most 6e-5 on the realistic shape (float64
against float32 arithmetic, 3 shapes x 20 seeds), while a missing or misplaced rounding gives
~1.7e-3 (bf16's unit roundoff 2^-8 over sqrt(3)); NORM = 4e-4 sits between, plus one ulp of the
largest element, which a single straddle can be of a small array (4.3e-4 seen on 756 elements).
cuBLASLt's GELU epilogues ("lt": pre, GELU's output and its gradient under --matmul cublaslt) round as the
emulation does at GPT-2's widths (on an H200, 2026-11-26, bin/gelu_epilogue_errors: 99.7-99.9% of elements
equal at 1024 x 768 -> 3072), but for the tests' small widths (36 to 128 channels) the kernel cuBLASLt picks
rounds once more, the product before the bias or before GELU's derivative: up to 2 ulps elementwise and
2.7e-3 to 3.2e-3 norm-wise, which a second rounding of every element gives (the same candidates, on the
simulator: 2.7e-3 to 3.1e-3). So "lt" is "act2" elementwise with a norm-wise bound of 2^-8, one extra
rounding everywhere, which the same two steps truncated instead of rounded exceed (6e-3). Which GELU the
epilogue applies (tanh or erf form) is below bf16's resolution: the float32 tests tell them apart.
Outputs that are float32 in every precision (parameter gradients, layernorm statistics, losses)
get the float32 tests' bounds. Flash attention's log-sum-exp ("lse") is float32 but summed from bf16
P: a straddle of one P moves it by at most 2^-8 P / l < 2^-8 (P <= 1 <= l); seen, float64 against
float32 emulation, up to 8e-5 and norm-wise 9e-7, where a sum of unrounded P is 1e-3 and 5e-5 off.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xtrain_dist.precision import bf16_ulp

# the GPU tests' shapes (B, T, C, NH, V): realistic; odd sizes that take the scalar paths (C, hs = C/NH and
# V not multiples of 8 bf16); a single position; GPT-2's width, where a lane of the row kernels' vector
# path (8 bf16) takes more than one chunk of a 768-channel row
SHAPES = {"B4-T64-C128": (4, 64, 128, 4, 4096), "B3-T7-C36-V1001": (3, 7, 36, 3, 1001), "B2-T1-C64": (2, 1, 64, 4, 50),
          "B1-T4-C768": (1, 4, 768, 12, 64)}

NORM = 4e-4        # norm-wise relative error of a bf16 output
FLOOR = 1e-5       # absolute slack, times the largest |want|, for results that cancel to near zero
CHAIN_FLOOR = 2.0 ** -7  # the same for outputs two roundings deep (an upstream straddle, times one term)
F32_NORM = 2e-5    # float32 outputs: norm-wise, and elementwise 50x that of the largest |want|
LSE_MAX, LSE_NORM = 2.0 ** -8, 1e-5  # flash attention's lse: elementwise, and norm-wise plus one straddle
LT_NORM = 2.0 ** -8  # cuBLASLt's GELU epilogues: a second rounding of every element, norm-wise


def bf16_mismatch(got, want, kind: str) -> str | None:
    """Why `got` is not `want` within the tolerance of its kind ("act": one rounding to bf16, "act2": two
    chained, "lt": two for every element, "f32": float32, "lse": float32 summed from bf16), or None if it is."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if not np.all(np.isfinite(got)):
        return "non-finite values (an unwritten output?)"
    diff = np.abs(got - want)
    scale = max(float(np.abs(want).max()), 1e-30)
    norm = float(np.linalg.norm(diff.ravel()) / max(np.linalg.norm(want.ravel()), 1e-30))
    if kind == "lse":
        allowed = LSE_NORM + LSE_MAX / max(float(np.linalg.norm(want.ravel())), 1e-30)
        if diff.max() > LSE_MAX or norm > allowed:
            return f"log-sum-exp: max abs {diff.max():.3g} (allowed {LSE_MAX:g}), norm-wise {norm:.3g} ({allowed:.3g})"
        return None
    if kind == "f32":
        if norm > F32_NORM or diff.max() > 50 * F32_NORM * scale:
            return f"float32 output: norm-wise {norm:.3g}, max abs {diff.max():.3g} (scale {scale:.3g})"
        return None
    if np.any(got.astype(np.float32).view(np.uint32) & 0xFFFF):
        return "values that are not bfloat16 (low 16 bits set)"
    ulps, floor = (2, CHAIN_FLOOR) if kind in ("act2", "lt") else (1, FLOOR)
    excess = diff - (ulps * bf16_ulp(want) + floor * scale)
    if excess.max() > 0:
        i = int(np.argmax(excess))
        return (f"element {np.unravel_index(i, want.shape)}: got {got.flat[i]:.6g}, want {want.flat[i]:.6g}, "
                f"{diff.flat[i] / bf16_ulp(want.flat[i]):.1f} ulps (allowed {ulps} + {floor:g} x {scale:.3g})")
    allowed = (LT_NORM if kind == "lt" else NORM) + float(bf16_ulp(scale)) / max(float(np.linalg.norm(want.ravel())),
                                                                                  1e-30)  # + one straddle
    if norm > allowed:
        return f"norm-wise relative error {norm:.3g} > {allowed:.3g}"
    return None


def assert_bf16_close(got, want, kind: str, what: str) -> None:
    problem = bf16_mismatch(got, want, kind)
    assert problem is None, f"{what}: {problem}"


# ---------------------------------------------------------------------------- the cases

@dataclass
class Case:
    """One op call. inputs(rng) -> {name: (host array, kind)}, kind "act" (uploaded in the activation
    dtype), "f32" (float32 in every precision) or "ids"; run(backend, device inputs) -> {output: device
    array}; outputs: {output: tolerance kind}."""
    name: str
    inputs: Callable
    run: Callable
    outputs: dict


def _randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def _ids(rng, shape, vocab):
    ids = rng.integers(0, vocab, shape).astype(np.int32)
    common = rng.integers(0, vocab, 4)
    mask = rng.random(shape) < 0.35  # repeated tokens: the encoder backward's runs
    ids[mask] = rng.choice(common, mask.sum())
    return ids


def cases(B: int, T: int, C: int, NH: int, V: int) -> list[Case]:
    """The ops at one shape; C must be divisible by NH."""

    def act(*shape, scale=1.0, shift=0.0):
        return lambda rng: (_randn(rng, *shape, scale=scale) + shift, "act")

    def f32(*shape, scale=1.0):
        return lambda rng: (_randn(rng, *shape, scale=scale), "f32")

    def ids():
        return lambda rng: (_ids(rng, (B, T), V), "ids")

    def draw(**makers):
        return lambda rng: {name: make(rng) for name, make in makers.items()}

    def encoder_backward(be, a):
        be.encoder_backward(a["dwte"], a["dwpe"], a["dout"], a["ids"])
        return {"dwte": a["dwte"], "dwpe": a["dwpe"]}

    def layernorm_forward(be, a):
        return dict(zip(("out", "mean", "rstd"), be.layernorm_forward(a["x"], a["w"], a["b"]), strict=True))

    def layernorm_backward_inputs(rng):
        x = _randn(rng, B, T, C, scale=2.0) + 0.5
        rest = draw(w=act(C, scale=0.1, shift=1.0), dout=act(B, T, C), dinp=act(B, T, C), dw=f32(C), db=f32(C))(rng)
        return {"x": (x, "act"), "mean": (x.mean(-1), "f32"), "rstd": (1 / np.sqrt(x.var(-1) + 1e-5), "f32"), **rest}

    def layernorm_backward(be, a):
        be.layernorm_backward(a["dinp"], a["dw"], a["db"], a["dout"], a["x"], a["w"], a["mean"], a["rstd"])
        return {"dinp": a["dinp"], "dweight": a["dw"], "dbias": a["db"]}

    def matmul_backward(be, a):
        dinp = be.matmul_backward(a["dw"], a["db"], a["dout"], a["x"], a["w"])
        return {"dinp": dinp, "dweight": a["dw"], "dbias": a["db"]}

    def attention_forward(be, a):
        return dict(zip(("out", "att"), be.attention_forward(a["qkv"], NH), strict=True))

    def attention_backward_inputs(rng):
        from xtrain_dist.backend.numpy_ops import NumpyBackend

        bf16 = NumpyBackend("bf16")
        qkv = bf16.from_host_act(_randn(rng, B, T, 3 * C))
        _, att = bf16.attention_forward(qkv, NH)  # a valid att: bf16 probabilities, zero above the diagonal
        return {"qkv": (qkv, "act"), "att": (att, "act"), "dout": (_randn(rng, B, T, C), "act")}

    def fused_classifier(be, a):
        losses = be.fused_classifier(a["logits"], a["targets"], 1.0 / (B * T))
        return {"losses": losses, "dlogits": a["logits"]}

    Vp = -(-(V + 1) // 128) * 128  # a padded vocabulary (model.py) of at least one padded column

    def padded_classifier(be, a):
        losses = be.fused_classifier(a["logits"], a["targets"], 1.0 / (B * T), V)
        return {"losses": losses, "dlogits": a["logits"]}

    out = [
        Case("encoder_forward", draw(ids=ids(), wte=act(V, C, scale=0.02), wpe=act(T + 3, C, scale=0.02)),
             lambda be, a: {"out": be.encoder_forward(a["ids"], a["wte"], a["wpe"])}, {"out": "act"}),
        Case("encoder_backward", draw(ids=ids(), dout=act(B, T, C), dwte=f32(V, C), dwpe=f32(T + 3, C)),
             encoder_backward, {"dwte": "f32", "dwpe": "f32"}),
        Case("layernorm_forward",
             draw(x=act(B, T, C, scale=2.0, shift=0.5), w=act(C, scale=0.1, shift=1.0), b=act(C, scale=0.1)),
             layernorm_forward, {"out": "act", "mean": "f32", "rstd": "f32"}),
        Case("residual_layernorm_forward",
             draw(a=act(B, T, C, scale=2.0, shift=0.5), b=act(B, T, C), w=act(C, scale=0.1, shift=1.0),
                  bias=act(C, scale=0.1)),
             lambda be, a: dict(zip(("residual", "out", "mean", "rstd"),
                                    be.residual_layernorm_forward(a["a"], a["b"], a["w"], a["bias"]), strict=True)),
             {"residual": "act", "out": "act", "mean": "f32", "rstd": "f32"}),
        Case("layernorm_backward", layernorm_backward_inputs, layernorm_backward,
             {"dinp": "act", "dweight": "f32", "dbias": "f32"}),
    ]
    for ic, oc in ((C, 3 * C), (4 * C, C)):
        out += [
            Case(f"matmul_forward {ic}x{oc}", draw(x=act(B, T, ic), w=act(ic, oc, scale=0.1), b=act(oc, scale=0.5)),
                 lambda be, a: {"out": be.matmul_forward(a["x"], a["w"], a["b"])}, {"out": "act"}),
            Case(f"matmul_backward {ic}x{oc}",
                 draw(x=act(B, T, ic), w=act(ic, oc, scale=0.1), dout=act(B, T, oc), dw=f32(ic, oc), db=f32(oc)),
                 matmul_backward, {"dinp": "act", "dweight": "f32", "dbias": "f32"}),
        ]
    def matmul_gelu_forward(be, a):
        return dict(zip(("pre", "out"), be.matmul_gelu_forward(a["x"], a["w"], a["b"]), strict=True))

    def matmul_backward_gelu(be, a):
        dpre = be.matmul_backward_gelu(a["dw"], a["db"], a["dout"], a["x"], a["w"], a["pre"])
        return {"dpre": dpre, "dweight": a["dw"], "dbias": a["db"]}

    # GELU after the product, "act2": it reads the product as stored in bf16 (test_cuda_bf16.py holds
    # --matmul cublaslt's epilogues, which read the float32 sum, to an emulation of their own)
    out += [
        Case("matmul_gelu_forward", draw(x=act(B, T, C), w=act(C, 4 * C, scale=0.1), b=act(4 * C, scale=0.5)),
             matmul_gelu_forward, {"pre": "act", "out": "act2"}),
        Case("matmul_backward_gelu",
             draw(x=act(B, T, 4 * C), w=act(4 * C, C, scale=0.1), dout=act(B, T, C), pre=act(B, T, 4 * C, scale=2.0),
                  dw=f32(4 * C, C), db=f32(C)),
             matmul_backward_gelu, {"dpre": "act2", "dweight": "f32", "dbias": "f32"}),
    ]
    out += [
        Case("matmul_forward tied classifier", draw(x=act(B, T, C), wte=act(V, C, scale=0.1)),
             lambda be, a: {"logits": be.matmul_forward(a["x"], a["wte"].T)}, {"logits": "act"}),
        Case("attention_forward", draw(qkv=act(B, T, 3 * C)), attention_forward, {"out": "act2", "att": "act"}),
        Case("attention_backward", attention_backward_inputs,
             lambda be, a: {"dqkv": be.attention_backward(a["dout"], a["qkv"], a["att"], NH)}, {"dqkv": "act2"}),
        Case("causal_softmax", draw(scores=f32(B, NH, T, T, scale=3.0)),
             lambda be, a: {"att": be.causal_softmax(a["scores"])}, {"att": "act"}),
        Case("gelu_forward", draw(x=act(B, T, 4 * C, scale=2.0)),
             lambda be, a: {"out": be.gelu_forward(a["x"])}, {"out": "act"}),
        Case("gelu_backward", draw(x=act(B, T, 4 * C, scale=2.0), dout=act(B, T, 4 * C)),
             lambda be, a: {"dinp": be.gelu_backward(a["dout"], a["x"])}, {"dinp": "act"}),
        Case("residual_forward", draw(a=act(B, T, C), b=act(B, T, C)),
             lambda be, a: {"out": be.residual_forward(a["a"], a["b"])}, {"out": "act"}),
        Case("fused_classifier", draw(logits=act(B, T, V, scale=3.0), targets=ids()), fused_classifier,
             {"losses": "f32", "dlogits": "act"}),
        Case("crossentropy_forward", draw(logits=act(B, T, V, scale=3.0), targets=ids()),
             lambda be, a: {"losses": be.crossentropy_forward(a["logits"], a["targets"])}, {"losses": "f32"}),
        Case("fused_classifier padded vocabulary", draw(logits=act(B, T, Vp, scale=3.0), targets=ids()),
             padded_classifier, {"losses": "f32", "dlogits": "act"}),
        Case("crossentropy_forward padded vocabulary", draw(logits=act(B, T, Vp, scale=3.0), targets=ids()),
             lambda be, a: {"losses": be.crossentropy_forward(a["logits"], a["targets"], V)}, {"losses": "f32"}),
    ]
    return out


def upload(backend, host_inputs: dict, float64: bool = False) -> dict:
    """Device inputs for one case: "act" in the backend's activation dtype, "f32" as float32, "ids" as
    int32. float64 (numpy only): the same values widened, so the ops compute in float64."""
    out = {}
    for name, (value, kind) in host_inputs.items():
        if kind == "ids":
            out[name] = backend.from_host(np.ascontiguousarray(value))
            continue
        x = backend.from_host_act(value) if kind == "act" else backend.from_host(np.asarray(value, np.float32))
        out[name] = np.asarray(x, np.float64) if float64 else x
    return out
