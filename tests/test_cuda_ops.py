"""Every op of the CUDA backend against its numpy_ops oracle, on a GPU (skipped without one).

Inputs are random and drawn fresh each run: the seed comes from the clock and is printed, so a
failure shows it (pytest prints a failing test's captured output) and `XTRAIN_TEST_SEED=<seed>`
replays it. While these tests run, every device allocation is filled with 0xFF bytes (NaN as float32),
so an output element that a kernel forgets to write fails the comparison instead of passing on
stale memory. Shapes are realistic (B=4, T=64, C=128, NH=4, V=4096 with repeated tokens) plus edge
shapes that take the scalar paths: T=1, channel counts and vocabularies that are not multiples of
the 16-byte vector width or of the block size, and views that start off a 16-byte boundary.
"""

import re
import threading

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_device_memory")]  # conftest: skip without a GPU

import small_vocab  # noqa: E402
from dropout_cases import DROPOUT_SHAPES, check_dropout_bitwise, dropout_site  # noqa: E402

from xtrain_dist.backend import numpy_ops as ref  # noqa: E402
from xtrain_dist.backend.cuda import attention as cuda_attention  # noqa: E402
from xtrain_dist.backend.cuda import cublas, cublaslt, gemm  # noqa: E402
from xtrain_dist.backend.cuda import ops as cuda_ops  # noqa: E402
from xtrain_dist.backend.cuda.ops import CudaBackend  # noqa: E402
from xtrain_dist.backend.dropout import ATTENTION_PROBS  # noqa: E402
from xtrain_dist.config import model_config  # noqa: E402
from xtrain_dist.model import GPT2  # noqa: E402

B, T, C, NH, V = 4, 64, 128, 4, 4096


@pytest.fixture(scope="module")
def be():
    return CudaBackend(0)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def token_ids(rng, shape, vocab=V):
    """Ids with many repeats: a third of the positions reuse a few common tokens."""
    ids = rng.integers(0, vocab, shape).astype(np.int32)
    common = rng.integers(0, vocab, 4)
    mask = rng.random(shape) < 0.35
    ids[mask] = rng.choice(common, mask.sum())
    return ids


def check(got, want, rel=1e-5, what=""):
    """Same shape, finite, and close: ||got - want|| <= rel ||want||, and elementwise within
    50 * rel of the largest magnitude (catches a few wrong elements that a norm would hide)."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values (unwritten output?)"
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.linalg.norm((got - want).ravel()) / max(np.linalg.norm(want.ravel()), 1e-30))
    worst = float(np.abs(got - want).max())
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g}"
    assert worst <= 50 * rel * scale, f"{what}: max abs error {worst:.3g} vs scale {scale:.3g}"


def within(got, want, bound, what: str) -> None:
    """|got - want| <= bound elementwise (bound: an array or a number); a failure names how many elements are out
    and the worst few, with their index, both values and their bound, rather than printing the arrays."""
    got = np.asarray(got)
    excess = np.abs(got - want) - bound
    bad = ~(excess <= 0)  # NaN counts as out
    if bad.any():
        bound = np.broadcast_to(bound, want.shape)
        worst = np.argsort(np.where(bad, np.nan_to_num(excess, nan=np.inf), -np.inf), axis=None)[::-1][:5]
        lines = [f"{tuple(int(k) for k in np.unravel_index(i, want.shape))}: {float(got.flat[i])!r} against "
                 f"{float(want.flat[i])!r} (bound {float(bound.flat[i]):.3g})" for i in worst if bad.flat[i]]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements out of bounds "
                             f"({int(np.isnan(got).sum())} NaN); the worst: " + "; ".join(lines))


def unaligned(be, host):
    """A device copy of `host` that starts 4 bytes past a 16-byte boundary (scalar kernel paths)."""
    flat = be.from_host(np.concatenate([np.zeros(1, host.dtype), host.ravel()]))
    return flat[1:].reshape(host.shape)


# ---------------------------------------------------------------------------- encoder

# (2, 5, 270, 40): 270 channels in the scalar path need two blocks along y in encoder_backward_wte (256
# threads a block); the other shapes fit in one, so blockIdx.y would go untested.
ENCODER_SHAPES = [(B, T, C, V), (3, 1, 30, 50), (2, 7, 36, 1000), (2, 5, 270, 40)]


@pytest.mark.parametrize("b,t,c,v", ENCODER_SHAPES)
def test_encoder_forward(be, rng, b, t, c, v):
    ids = token_ids(rng, (b, t), v)
    wte, wpe = randn(rng, v, c), randn(rng, t + 3, c)
    got = be.encoder_forward(be.from_host(ids), be.from_host(wte), be.from_host(wpe))
    check(be.to_host(got), ref.encoder_forward(ids, wte, wpe), 0, "encoder_forward")  # an add: exact


@pytest.mark.parametrize("b,t,c,v", ENCODER_SHAPES)
def test_encoder_backward_matches_and_is_deterministic(be, rng, b, t, c, v):
    ids = token_ids(rng, (b, t), v)
    dout = randn(rng, b, t, c)
    dwte0, dwpe0 = randn(rng, v, c), randn(rng, t + 3, c)  # backward accumulates into what is there
    want_wte, want_wpe = dwte0.copy(), dwpe0.copy()
    ref.encoder_backward(want_wte, want_wpe, dout, ids)
    results = []
    for _ in range(2):
        dwte, dwpe = be.from_host(dwte0), be.from_host(dwpe0)
        be.encoder_backward(dwte, dwpe, be.from_host(dout), be.from_host(ids))
        results.append((be.to_host(dwte), be.to_host(dwpe)))
    check(results[0][0], want_wte, 1e-6, "dwte")
    check(results[0][1], want_wpe, 1e-6, "dwpe")
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def test_out_of_range_ids_give_nan_rows_and_no_gradient(be, rng):
    """The kernels' documented answer to a bad batch (numpy raises IndexError instead): an id outside [0, V)
    gives a NaN embedding row, so the loss shows it, and adds nothing to dwte. Both ends are tried, -1 and V:
    a read or write at either would land outside wte or dwte (the simulator's guard bytes catch it)."""
    b, t, c, v = 2, 4, 36, 50
    bad = np.zeros((b, t), bool)
    bad[0, 1] = bad[1, 3] = True
    ids = token_ids(rng, (b, t), v)
    ids[0, 1], ids[1, 3] = v, -1
    wte, wpe, dout = randn(rng, v, c), randn(rng, t, c), randn(rng, b, t, c)
    got = be.to_host(be.encoder_forward(be.from_host(ids), be.from_host(wte), be.from_host(wpe)))
    assert np.all(np.isnan(got[bad])), "encoder_forward: an out-of-range id must give a NaN row"
    check(got[~bad], ref.encoder_forward(np.where(bad, 0, ids), wte, wpe)[~bad], 0, "encoder_forward, valid rows")

    dwte0, dwpe0 = randn(rng, v, c), randn(rng, t, c)
    want_wte, want_wpe = dwte0.copy(), dwpe0 + dout.sum(axis=0)  # dwpe does not depend on the ids
    np.add.at(want_wte, ids[~bad], dout[~bad])  # in (b, t) order, as the kernel adds
    dwte, dwpe = be.from_host(dwte0), be.from_host(dwpe0)
    be.encoder_backward(dwte, dwpe, be.from_host(dout), be.from_host(ids))
    check(be.to_host(dwte), want_wte, 1e-6, "dwte")
    check(be.to_host(dwpe), want_wpe, 1e-6, "dwpe")


# ---------------------------------------------------------------------------- layernorm

# (2, 3, 768): GPT-2's width, where each lane of the vector path takes more than one chunk of a row
LN_SHAPES = [(B, T, C), (3, 1, 30), (5, 7, 36), (2, 3, 768)]


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_forward(be, rng, shape):
    x = randn(rng, *shape, scale=2.0) + 0.5
    # one row of variance ~1e-5, LN_EPS's size: there eps moves rstd by about half, so an eps dropped or
    # added outside the square root fails here, not only in the whole-model test
    x.reshape(-1, shape[-1])[0] *= 1.5e-3
    w, b = randn(rng, shape[-1]), randn(rng, shape[-1])
    out, mean, rstd = be.layernorm_forward(be.from_host(x), be.from_host(w), be.from_host(b))
    want = ref.layernorm_forward(x, w, b)
    for got, exp, what in zip((out, mean, rstd), want, ("out", "mean", "rstd"), strict=True):
        check(be.to_host(got), exp, 1e-5, what)


@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_residual_layernorm_forward_is_the_sum_then_the_layernorm(be, rng, shape, aligned):
    """The fused kernel against its numpy twin: the residual sum bit for bit (one float32 addition), the
    layernorm of it as layernorm_forward's, on the vector path and on views off a 16-byte boundary."""
    a, b = randn(rng, *shape, scale=2.0) + 0.5, randn(rng, *shape)
    w, bias = randn(rng, shape[-1]), randn(rng, shape[-1])
    put = be.from_host if aligned else (lambda host: unaligned(be, host))
    got = be.residual_layernorm_forward(put(a), put(b), put(w), put(bias))
    want = ref.residual_layernorm_forward(a, b, w, bias)
    assert np.array_equal(be.to_host(got[0]), want[0]), "residual"
    for g, exp, what in zip(got[1:], want[1:], ("out", "mean", "rstd"), strict=True):
        check(be.to_host(g), exp, 1e-5, what)


@pytest.mark.parametrize("shape", [*LN_SHAPES, (2, 33, 512)])
@pytest.mark.parametrize("fused", [True, False])
def test_layernorm_backward_matches_and_is_deterministic(be, rng, monkeypatch, shape, fused):
    """Both paths (all three gradients in one pass, layernorm_backward_fused, where the width fits its
    registers; the input gradient and the column sums apart) against numpy, the gradients accumulated into
    what they held, the same bits on a rerun. (2, 3, 768) in fp32 is beyond the one-pass width: the other
    path either way; (2, 33, 512) fits it exactly, with more rows than one block's warps."""
    monkeypatch.setattr(be, "fused_layernorm_backward", fused)
    c = shape[-1]
    one_pass = fused and c <= cuda_ops.LAYERNORM_FUSED_CHUNKS * 32 * (be._vec_x if c % be._vec_x == 0 else 1)
    assert one_pass == (fused and c != 768)
    for kernel in (("layernorm_backward_input", "layernorm_backward_params") if one_pass
                   else ("layernorm_backward_fused",)):
        monkeypatch.setattr(be._k, kernel, None, raising=False)  # the path not taken: a call would fail
    x, dout, dinp0 = randn(rng, *shape), randn(rng, *shape), randn(rng, *shape)
    w, dw0, db0 = randn(rng, c), randn(rng, c), randn(rng, c)
    _, mean, rstd = ref.layernorm_forward(x, w, randn(rng, c))
    want = dinp0.copy(), dw0.copy(), db0.copy()
    ref.layernorm_backward(*want, dout, x, w, mean, rstd)
    runs = []
    for _ in range(2):
        grads = [be.from_host(a) for a in (dinp0, dw0, db0)]
        be.layernorm_backward(*grads, *(be.from_host(a) for a in (dout, x, w, mean, rstd)))
        runs.append([be.to_host(g) for g in grads])
    for got, exp, what in zip(runs[0], want, ("dinp", "dweight", "dbias"), strict=True):
        check(got, exp, 2e-5, what)
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))


@pytest.mark.parametrize("shape", [(B, T, C), (3, 1, 30), (2, 33, 512)])
def test_the_one_pass_layernorm_backward_has_the_two_kernel_paths_bits(be, rng, monkeypatch, shape):
    """layernorm_backward_fused adds each column in the two-kernel path's order (a warp per row lane of
    the split, rows LAYERNORM_ROWS_PER_BLOCK = COL_ROWS apart, the lanes' sums in order, then the splits),
    and computes dinp as layernorm_backward_input does: the same bits, not only the same values."""
    assert cuda_ops.COLUMN_BLOCK[1] == cuda_ops.LAYERNORM_ROWS_PER_BLOCK
    c = shape[-1]
    x, dout, dinp0 = randn(rng, *shape), randn(rng, *shape), randn(rng, *shape)
    w, dw0, db0 = randn(rng, c), randn(rng, c), randn(rng, c)
    _, mean, rstd = ref.layernorm_forward(x, w, randn(rng, c))
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(be, "fused_layernorm_backward", fused)
        grads = [be.from_host(a) for a in (dinp0, dw0, db0)]
        be.layernorm_backward(*grads, *(be.from_host(a) for a in (dout, x, w, mean, rstd)))
        runs.append([be.to_host(g) for g in grads])
    for one, two, what in zip(*runs, ("dinp", "dweight", "dbias"), strict=True):
        assert np.array_equal(one, two), what


# ---------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("rows,ic,oc,bias", [(B * T, C, 3 * C, True), (B * T, 4 * C, C, True), (7, 30, 18, True),
                                             (B * T, C, V, False)])
def test_matmul_forward_backward(be, rng, rows, ic, oc, bias):
    inp, w = randn(rng, rows, ic), randn(rng, ic, oc, scale=0.1)
    b = randn(rng, oc) if bias else None
    dout = randn(rng, rows, oc)
    dw0, db0 = randn(rng, ic, oc), randn(rng, oc)
    want_out = ref.matmul_forward(inp, w, b)
    want_dw, want_db = dw0.copy(), db0.copy()
    want_dinp = ref.matmul_backward(want_dw, want_db if bias else None, dout, inp, w)

    dbias = be.from_host(db0) if bias else None
    got_out = be.matmul_forward(be.from_host(inp), be.from_host(w), be.from_host(b) if bias else None)
    check(be.to_host(got_out), want_out, 1e-5, "matmul_forward")
    dw = be.from_host(dw0)
    got_dinp = be.matmul_backward(dw, dbias, be.from_host(dout), be.from_host(inp), be.from_host(w))
    check(be.to_host(got_dinp), want_dinp, 1e-5, "dinp")
    check(be.to_host(dw), want_dw, 1e-5, "dweight")
    if bias:
        check(be.to_host(dbias), want_db, 1e-5, "dbias")


@pytest.mark.parametrize("rows,ic,oc", [(B * T, C, 3 * C), (B * T, 4 * C, C), (7, 30, 18), (1, 8, 1)])
def test_cublaslt_adds_the_bias_in_the_epilogue(be_lt, rng, rows, ic, oc):
    """--matmul cublaslt: product + bias in one cuBLASLt call, against the oracle, for aligned operands and
    for operands 4 bytes past an aligned address (the weights and biases are views into the flat parameter
    buffer at any offset), the same shape both ways: each alignment gets its own plan, as the heuristic
    picks algorithms for the alignment it is told. Twice: the same bits."""
    inp, w, b = randn(rng, rows, ic), randn(rng, ic, oc, scale=0.1), randn(rng, oc)
    want = ref.matmul_forward(inp, w, b)
    for place in (be_lt.from_host, lambda host: unaligned(be_lt, host)):
        outs = [be_lt.to_host(be_lt.matmul_forward(place(inp), place(w), place(b))) for _ in range(2)]
        check(outs[0], want, 1e-5, "matmul_forward (cublaslt)")
        assert np.array_equal(outs[0], outs[1])
    # plans for this product (cuBLAS's rows x cols x k: oc x rows x ic), by alignment; a weight of one column
    # stays on cublasGemmEx + add_bias, which cuBLASLt's heuristic has refused
    alignments = {key[-1] for key in be_lt._lt._plans if key[2:5] == (oc, rows, ic)}
    assert len(alignments) == (0 if oc == 1 else 2), alignments
    assert be_lt._lt._workspace.nbytes == cublaslt.WORKSPACE_BYTES  # what memory.py counts a rank
    handle = be_lt._cublas[be_lt.stream.ptr]  # the rank stream's: memory.py counts its workspace too
    assert handle._workspace.nbytes == cublas.WORKSPACE_BYTES and handle.stream == be_lt.stream.ptr


# (B * T, C, 4 * C): GPT-2's MLP, every epilogue on --matmul cublaslt; (7, 36, 20): a width not a multiple of
# 8, so no GELU aux matrix (cublasLt.h: its leading dimension must be), the kernels' path with the bias
# gradient still in the product; (1, 8, 16): one row, which cuBLASLt's bias gradient refuses (A = dout)
MLP_SHAPES = [(B * T, C, 4 * C), (7, 36, 20), (1, 8, 16)]
EPILOGUES = {"bias": cublaslt.CUBLASLT_EPILOGUE_BIAS, "gelu": cublaslt.CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
             "dgelu": cublaslt.CUBLASLT_EPILOGUE_DGELU, "bgrad": cublaslt.CUBLASLT_EPILOGUE_BGRADA}


@pytest.mark.parametrize("rows,c,h", MLP_SHAPES)
@pytest.mark.parametrize("matmul", ["cublas", "cublaslt", "cublaslt bgrad"])
def test_the_mlp_products_with_gelu_match_their_twins(be, request, monkeypatch, rng, matmul, rows, c, h):
    """matmul_gelu_forward (c_fc: c -> h, bias, GELU) and matmul_backward_gelu (c_proj's backward, h -> c, and
    GELU's) against numpy_ops, on the kernels' path and through cuBLASLt's epilogues (GELU_AUX_BIAS, DGELU,
    and BGRADA where bias_grad_epilogue is set), with the gradients accumulated into what they held; the
    epilogues each shape takes, asked of the plans (cuBLAS's rows x cols x k of each product)."""
    backend = request.getfixturevalue("be_lt") if matmul.startswith("cublaslt") else be
    if backend is not be:
        monkeypatch.setattr(backend, "bias_grad_epilogue", matmul == "cublaslt bgrad")
        monkeypatch.setattr(backend._lt, "_plans", {})  # this test's plans alone
    x, w_fc, b_fc = randn(rng, rows, c), randn(rng, c, h, scale=0.3), randn(rng, h, scale=0.5)
    w_proj, dout = randn(rng, h, c, scale=0.1), randn(rng, rows, c)
    dw0, db0 = randn(rng, h, c), randn(rng, c)
    want_pre, want_out = ref.matmul_gelu_forward(x, w_fc, b_fc)
    want_dw, want_db = dw0.copy(), db0.copy()
    want_dpre = ref.matmul_backward_gelu(want_dw, want_db, dout, want_out, w_proj, want_pre)

    # cuBLASLt's GELU is an approximation of its own: on an H200 (bin/gelu_epilogue_errors, 1024 x 768 -> 3072,
    # 2026-11-26) GELU up to 9.4e-6 off float64 and its derivative's product 2.4e-5, where gelu.cu's is float32
    # rounding; its bounds are 3x that, still 5x below the erf form's distance from the tanh form (4.8e-4)
    gelu_bound, dpre_slack = (3e-5, 3.0) if backend is not be else (2e-6, 1.0)
    pre, out = backend.matmul_gelu_forward(*(backend.from_host(a) for a in (x, w_fc, b_fc)))
    check(backend.to_host(pre), want_pre, 1e-5, "pre")
    # GELU of the product the GPU made: the product's own rounding (a different summation order from numpy's,
    # an ulp or two of a sum of 128 terms) is pre's check above, not GELU's
    pre_host = backend.to_host(pre)
    within(backend.to_host(out), ref.gelu_forward(pre_host), gelu_bound * (1 + np.abs(pre_host)), "gelu")
    dw, db = backend.from_host(dw0), backend.from_host(db0)
    dpre = backend.matmul_backward_gelu(dw, db, backend.from_host(dout), backend.from_host(want_out),
                                        backend.from_host(w_proj), backend.from_host(want_pre))
    bound = dpre_slack * 1e-5 * (1 + np.abs(want_pre) ** 3) * max(1.0, float(np.abs(want_dpre).max()))
    within(backend.to_host(dpre), want_dpre, bound, "dpre")
    check(backend.to_host(dw), want_dw, 1e-5, "dweight")
    check(backend.to_host(db), want_db, 1e-5, "dbias")
    if backend is not be:
        # c_fc's forward and c_proj's input gradient are both h x rows x c in cuBLAS's terms
        forward = {key[12] for key in backend._lt._plans if key[2:5] == (h, rows, c)}
        grads = {key[12] for key in backend._lt._plans if key[2:5] == (c, h, rows)}
        assert forward == ({EPILOGUES["gelu"], EPILOGUES["dgelu"]} if h % 8 == 0 else set()), forward
        assert grads == ({EPILOGUES["bgrad"]} if rows > 1 and backend.bias_grad_epilogue else set()), grads


# ---------------------------------------------------------------------------- products by measured choice

def _lt_backend(be):
    """A --matmul cublaslt backend made now (so it reads the tuning table as it is now), `be`'s stream current
    again after; the caller makes its stream current while it uses it."""
    backend = CudaBackend(be.device, allow_tf32=be.allow_tf32, dtype=be.dtype, matmul="cublaslt")
    be.stream.use()
    return backend


def _linear_products(backend, x, w, b, dout, dw, db):
    """A linear layer's forward (the bias epilogue), its backward (two plain products: the weight gradient
    accumulated, the input gradient) and the classifier's forward without a bias; host copies of the outputs."""
    backend.stream.use()
    out = backend.matmul_forward(*(backend.from_host(a) for a in (x, w, b)))
    dinp = backend.matmul_backward(dw, db, backend.from_host(dout), backend.from_host(x), backend.from_host(w))
    logits = backend.matmul_forward(backend.from_host(x), backend.from_host(w))
    return [backend.to_host(a) for a in (out, dinp, dw, db, logits)]


def test_a_tuning_table_chooses_each_products_algorithm_and_a_stale_entry_falls_back(be, rng, tmp_path,
                                                                                      monkeypatch):
    """The products section of the GPU's tuning table (gemm.product_choices, read when a --matmul cublaslt
    backend starts): an entry, keyed by cublaslt.product_key, runs the algorithm it names where the heuristic
    offers it (the last the heuristic offers, here), plain products included (they then go through cuBLASLt
    rather than cublasGemmEx); an entry whose words the heuristic does not offer (another cuBLAS version's)
    takes the heuristic's first and is counted as missed; no table is today's path. Same values every way."""
    from xtrain_dist.backend.cuda import tuned
    from xtrain_dist.backend.cuda.device import device_name

    monkeypatch.setattr(tuned, "TUNED_DIR", tmp_path)
    rows, ic, oc = 24, 32, 48
    x, w, b, dout = randn(rng, rows, ic), randn(rng, ic, oc, scale=0.1), randn(rng, oc), randn(rng, rows, oc)
    dw0, db0 = randn(rng, ic, oc), randn(rng, oc)
    want_out = ref.matmul_forward(x, w, b)
    want_dw, want_db = dw0.copy(), db0.copy()
    want_dinp = ref.matmul_backward(want_dw, want_db, dout, x, w)

    def run(backend):
        dw, db = backend.from_host(dw0), backend.from_host(db0)
        got = _linear_products(backend, x, w, b, dout, dw, db)
        be.stream.use()
        for value, want, what in zip(got, (want_out, want_dinp, want_dw, want_db, ref.matmul_forward(x, w)),
                                     ("out", "dinp", "dweight", "dbias", "logits"), strict=True):
            check(value, want, 1e-5, what)
        return got

    plain = _lt_backend(be)  # no table: no choices, the plain products on cublasGemmEx
    assert plain._lt.choices == {}
    baseline = run(plain)
    assert {key[12] for key in plain._lt._plans} == {cublaslt.CUBLASLT_EPILOGUE_BIAS}

    recorder = _lt_backend(be)  # what the search sees: every product, each with the heuristic's candidates
    recorder._lt.record()
    run(recorder)
    offered = {cublaslt.product_key(*key[:-1]): recorder._lt.candidates(key) for key in recorder._lt.recorded}
    epilogues = sorted(key.split()[-2 if "BIAS" in key else -1] for key in offered)
    assert epilogues == ["BIAS", "DEFAULT", "DEFAULT", "DEFAULT"], offered  # forward, dweight, dinp, logits
    chosen = {key: len(algos) - 1 for key, algos in offered.items()}
    entries = {key: {"algo": cublaslt.algo_words(offered[key][rank]), "rank": rank} for key, rank in chosen.items()}
    stale = sorted(offered)[0]
    entries[stale] = {"algo": ["0x7"] * 8, "rank": 0}
    tuned.write_section(device_name(be.device), "products", entries, {"command": "test"})

    tuned_backend = _lt_backend(be)
    ranks = getattr(tuned_backend._lt._lib, "ranks_run", None)  # the simulator's stand-in says which ran
    before = len(ranks or ())
    got = run(tuned_backend)
    assert tuned_backend._lt.choices_missed == {stale}
    assert tuned_backend._lt.choices_used == set(offered) - {stale}
    # the plain products the table names run through cuBLASLt now, each with its entry's algorithm
    algos = {cublaslt.product_key(*key[:-1]): tuple(plan[4].data) for key, plan in tuned_backend._lt._plans.items()}
    for key in offered:
        want = offered[key][0] if key == stale else offered[key][chosen[key]]
        assert algos[key] == tuple(want.data), key
    if ranks is not None:
        assert sorted(ranks[before:]) == sorted(0 if key == stale else chosen[key] for key in offered), ranks
    for a, c in zip(got, baseline, strict=True):  # another algorithm: float32 sums in another order at most
        check(a, c, 1e-5, "tuned against untuned")


def test_a_damaged_product_entry_stops_the_backend_with_one_line(be, tmp_path, monkeypatch):
    from xtrain_dist.backend.cuda import tuned
    from xtrain_dist.backend.cuda.device import device_name
    from xtrain_dist.errors import XtrainError

    monkeypatch.setattr(tuned, "TUNED_DIR", tmp_path)
    path = tuned.write_section(device_name(be.device), "products", {"NN 8x8x8": {"rank": 2}}, {})
    with pytest.raises(XtrainError, match=rf"^tuning table '{re.escape(str(path))}': product 'NN 8x8x8' has no "
                                          r"algorithm of 8 hexadecimal words \(got None\)$"):
        _lt_backend(be)
    be.stream.use()


def test_the_search_keeps_the_fastest_algorithm_of_each_product_fail_soft(be, rng):
    """cublaslt.search, what bin/bench_gemm --search runs: every recorded product's candidates timed on its
    recorded operands (here by a stand-in clock giving each candidate a time of its own), the fastest kept
    with its words and rank; an algorithm that refuses to run is passed over, and a product whose search
    fails is listed with why while the others are searched. Each candidate's product is right."""
    from xtrain_dist.errors import XtrainError

    backend = _lt_backend(be)
    backend._lt.record()
    rows, ic, oc = 24, 32, 48
    x, w, b, dout = randn(rng, rows, ic), randn(rng, ic, oc, scale=0.1), randn(rng, oc), randn(rng, rows, oc)
    dw, db = backend.from_host(randn(rng, ic, oc)), backend.from_host(randn(rng, oc))
    backend.stream.use()
    operands = [backend.from_host(a) for a in (x, w, b, dout)]  # alive until the search has run on them
    out = backend.matmul_forward(*operands[:3])
    backend.matmul_backward(dw, db, operands[3], operands[0], operands[1])
    keys = {cublaslt.product_key(*key[:-1]): key for key in backend._lt.recorded}
    forward = next(name for name in keys if " BIAS " in name)
    failing = next(name for name in keys if name.startswith("TN"))  # the input gradient (dinp = dout W^T)
    counts = {name: len(backend._lt.candidates(key)) for name, key in keys.items()}
    # the stand-in clock: candidate i of a product of n takes 1 + (3 i + 1) mod n ms, so the fastest is the one
    # with 3 i + 1 = 0 mod n where n is prime to 3; the forward's candidate 0 refuses to run
    times, calls = {}, []

    def time_call(call):
        name = next(n for n, key in keys.items() if key is current[0])
        i = times.setdefault(name, 0)
        times[name] += 1
        if name == forward and i == 0:
            raise XtrainError("cuBLASLt: cublasLtMatmul failed: CUBLAS_STATUS_NOT_SUPPORTED")
        call()
        calls.append(name)
        return 1.0 + (3 * i + 1) % counts[name]

    current = [None]
    real_candidates = backend._lt.candidates

    def candidates(key):
        current[0] = key
        if cublaslt.product_key(*key[:-1]) == failing:
            raise RuntimeError("no candidates today")
        return real_candidates(key)

    backend._lt.candidates = candidates
    entries, failures = cublaslt.search(backend._lt, time_call)
    backend.synchronize()
    be.stream.use()
    assert failures == {failing: "RuntimeError: no candidates today"}
    assert set(entries) == set(keys) - {failing}
    for name, entry in entries.items():
        n = counts[name]
        fastest = min((i for i in range(n) if not (name == forward and i == 0)), key=lambda i: (3 * i + 1) % n)
        assert (entry["rank"], entry["ms"], entry["tried"]) == (fastest, 1.0 + (3 * fastest + 1) % n,
                                                                n - (name == forward)), (name, entry)
        assert entry["algo"] == cublaslt.algo_words(real_candidates(keys[name])[fastest])
        assert entry["first_ms"] == (None if name == forward else 2.0)
    check(backend.to_host(out), ref.matmul_forward(x, w, b), 1e-5, "the forward after every candidate ran")


def test_reading_back_a_strided_view_leaves_the_current_stream_alone(be, rng):
    """CuPy 14.2's get() copies a strided array under `with stream:`, and leaving that block makes the null
    stream current: on the H100 every op after reading back the padded logits failed the stream check.
    to_host makes the copy itself, on the backend's stream, and leaves whichever stream was current."""
    host = randn(rng, 8, 24)
    a = be.from_host(host)
    for view, want in ((a[:, 3:17], host[:, 3:17]), (a.T, host.T)):
        np.testing.assert_array_equal(be.to_host(view), want)
        assert cupy.cuda.get_current_stream().ptr == be.stream.ptr
    side = cupy.cuda.Stream(non_blocking=True)
    side.use()
    try:
        be.synchronize()
        np.testing.assert_array_equal(be.to_host(a[:, 3:17]), host[:, 3:17])
        assert cupy.cuda.get_current_stream().ptr == side.ptr
    finally:
        be.stream.use()


def test_tied_classifier_matmul_with_transposed_views(be, rng):
    """The model passes wte.T and dwte.T (F-contiguous views) and accumulates into dwte. The logits come
    back as the first 1001 columns of rows 1024 apart (cuBLAS's aligned paths), and the fused classifier
    and the backward products take them so: the padded rows, turned into dlogits in place."""
    rows, c, v = B * T, C, 1001
    lnf, wte, dwte0 = randn(rng, rows, c), randn(rng, v, c), randn(rng, v, c)
    targets = token_ids(rng, (rows,), v)
    want_logits = ref.matmul_forward(lnf, wte.T)
    dlogits = want_logits.copy()
    want_losses = ref.fused_classifier(dlogits, targets, 0.5)
    want_dwte = dwte0.copy()
    want_dlnf = ref.matmul_backward(want_dwte.T, None, dlogits, lnf, wte.T)
    wte_d, dwte = be.from_host(wte), be.from_host(dwte0)
    logits = be.matmul_forward(be.from_host(lnf), wte_d.T)
    assert logits.shape == (rows, v) and logits.strides == (1024 * 4, 4), logits.strides
    check(be.to_host(logits), want_logits, 1e-5, "logits")
    check(be.to_host(be.crossentropy_forward(logits, be.from_host(targets))), want_losses, 1e-5, "eval losses")
    check(be.to_host(be.fused_classifier(logits, be.from_host(targets), 0.5)), want_losses, 1e-5, "losses")
    check(be.to_host(logits), dlogits, 1e-5, "dlogits")
    got_dlnf = be.matmul_backward(dwte.T, None, logits, be.from_host(lnf), wte_d.T)
    check(be.to_host(got_dlnf), want_dlnf, 1e-5, "dlnf")
    check(be.to_host(dwte), want_dwte, 1e-5, "dwte")


def test_bias_gradient_is_deterministic_and_takes_unaligned_views(be, rng):
    rows, oc = 1000, 36
    dout, w, inp = randn(rng, rows, oc), randn(rng, 12, oc), randn(rng, rows, 12)
    db0 = randn(rng, oc)
    want = db0.copy()
    ref.matmul_backward(np.zeros_like(w), want, dout, inp, w)
    runs = []
    for _ in range(2):
        db = unaligned(be, db0)
        be.matmul_backward(be.from_host(np.zeros_like(w)), db, be.from_host(dout), be.from_host(inp), be.from_host(w))
        runs.append(be.to_host(db))
    check(runs[0], want, 1e-5, "dbias")
    assert np.array_equal(runs[0], runs[1])


# ---------------------------------------------------------------------------- attention

# (1, 200, 64, 2): rows of scores longer than one pass of a warp's vector loads (128 floats)
@pytest.mark.parametrize("b,t,c,nh", [(B, T, C, NH), (2, 1, 64, 4), (2, 33, 36, 4), (1, 17, 48, 3), (1, 200, 64, 2)])
def test_attention_forward_backward(be, rng, b, t, c, nh):
    qkv, dout = randn(rng, b, t, 3 * c), randn(rng, b, t, c)
    want_out, want_att = ref.attention_forward(qkv, nh)
    want_dqkv = ref.attention_backward(dout, qkv, want_att, nh)
    out, att = be.attention_forward(be.from_host(qkv), nh)
    check(be.to_host(out), want_out, 1e-5, "attention out")
    check(be.to_host(att), want_att, 1e-5, "att")
    assert np.all(be.to_host(att)[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] == 0)
    dqkv = be.attention_backward(be.from_host(dout), be.from_host(qkv), att, nh)
    check(be.to_host(dqkv), want_dqkv, 2e-5, "dqkv")


# ---------------------------------------------------------------------------- dropout (kernels/dropout.cu)

@pytest.mark.parametrize("shape, kind, groups, group0", DROPOUT_SHAPES)
def test_dropout_masks_and_values_are_bitwise_the_oracles(be, rng, shape, kind, groups, group0):
    check_dropout_bitwise(be, ref.NumpyBackend("fp32"), rng, shape, kind, groups, group0)


@pytest.mark.parametrize("b,t,c,nh", [(2, 33, 36, 4)])
def test_attention_with_dropout_follows_numpy(be, rng, b, t, c, nh):
    qkv, dout = randn(rng, b, t, 3 * c), randn(rng, b, t, c)
    step = np.array([3], dtype=np.uint32)
    host_site, site = (dropout_site(s, ATTENTION_PROBS, 1, 2, nh, nh) for s in (step, be.from_host(step)))
    want_out, want_att = ref.attention_forward(qkv, nh, dropout=host_site)
    assert not np.allclose(want_out, ref.attention_forward(qkv, nh)[0])
    want_dqkv = ref.attention_backward(dout, qkv, want_att, nh, dropout=host_site)
    out, att = be.attention_forward(be.from_host(qkv), nh, dropout=site)
    check(be.to_host(out), want_out, 1e-5, "attention out")
    check(be.to_host(att), want_att, 1e-5, "att")
    dqkv = be.attention_backward(be.from_host(dout), be.from_host(qkv), att, nh, dropout=site)
    check(be.to_host(dqkv), want_dqkv, 2e-5, "dqkv")


@pytest.mark.parametrize("chunk", [8, 20, 32])
@pytest.mark.parametrize("b,t,c,nh", [(2, 33, 36, 4), (1, 200, 64, 2)])
def test_attention_in_causal_chunks(be, rng, monkeypatch, chunk, b, t, c, nh):
    """The products run in chunks of query rows, each against only the keys it may see (cuda_attention._causal_chunks,
    256 rows a chunk): with chunks of 8, 20 and 32 rows, several at these T and the last one ragged, the
    results are the oracle's, and the scores right of each chunk's diagonal block, which no product writes
    (they hold poisoned memory, NaN), reach nothing."""
    monkeypatch.setattr(cuda_attention, "CAUSAL_CHUNK", chunk)
    assert len(cuda_attention._causal_chunks(t)) == -(-t // chunk) > 1
    qkv, dout = randn(rng, b, t, 3 * c), randn(rng, b, t, c)
    want_out, want_att = ref.attention_forward(qkv, nh)
    out, att = be.attention_forward(be.from_host(qkv), nh)
    check(be.to_host(out), want_out, 1e-5, "attention out")
    check(be.to_host(att), want_att, 1e-5, "att")
    dqkv = be.attention_backward(be.from_host(dout), be.from_host(qkv), att, nh)
    check(be.to_host(dqkv), ref.attention_backward(dout, qkv, want_att, nh), 2e-5, "dqkv")


def test_batched_products_take_slices_with_contiguous_rows_only(be):
    """_gemm_batched reads each matrix's row stride from the view (a chunk of the T x T scores); a view whose
    rows are not contiguous is refused, not multiplied as if they were."""
    x = be.from_host(np.zeros((2, 4, 6), np.float32))
    assert gemm._batched_layout(x[:, 1:3, :5]) == (6, 24)
    with pytest.raises(ValueError, match=r"^cuda_ops batched gemm: expected contiguous rows, got shape \(2, 4, 3\)"):
        gemm._batched_layout(x[:, :, ::2])


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (5, 1, 1), (2, 33, 33)])
def test_causal_softmax_and_backward(be, rng, shape):
    scores, datt = randn(rng, *shape, scale=3.0), randn(rng, *shape)
    want = ref.causal_softmax(scores)
    att = be.causal_softmax(be.from_host(scores))
    check(be.to_host(att), want, 1e-5, "causal_softmax")
    got = be.causal_softmax_backward(be.from_host(datt), be.from_host(want))
    check(be.to_host(got), ref.causal_softmax_backward(datt, want), 1e-5, "causal_softmax_backward")


# ---------------------------------------------------------------------------- gelu, residual

@pytest.mark.parametrize("n", [B * T * 4 * C, 1, 1001])
@pytest.mark.parametrize("aligned", [True, False])
def test_gelu_and_residual(be, rng, n, aligned):
    x, d, y = randn(rng, n, scale=2.0), randn(rng, n), randn(rng, n)
    put = be.from_host if aligned else (lambda a: unaligned(be, a))
    # Elementwise bounds, not relative ones: 1 + tanh(u) and 1 - tanh(u)^2 cancel for large |x|, so
    # a one-ulp difference between two correct tanhf's is a large relative error in a tiny result.
    got = be.to_host(be.gelu_forward(put(x)))
    assert np.all(np.abs(got - ref.gelu_forward(x)) <= 1e-6 * (1 + np.abs(x))), "gelu_forward"
    got = be.to_host(be.gelu_backward(put(d), put(x)))
    bound = 4e-6 * (1 + np.abs(x) ** 3) * np.maximum(1, np.abs(d))
    assert np.all(np.abs(got - ref.gelu_backward(d, x)) <= bound), "gelu_backward"
    check(be.to_host(be.residual_forward(put(x), put(y))), ref.residual_forward(x, y), 0, "residual")


# ---------------------------------------------------------------------------- classifier

# (4, 1, 1): rows shorter than the scalar head that block_row_read takes up to the first 16-byte boundary
# (rows 1 to 3 start 1 to 3 floats past one): the head must stop at the row's end.
@pytest.mark.parametrize("b,t,v", [(B, T, V), (2, 3, 50257), (3, 1, 1001), (1, 5, 7), (4, 1, 1)])
def test_classifier(be, rng, b, t, v):
    logits, targets = randn(rng, b, t, v, scale=4.0), token_ids(rng, (b, t), v)
    dloss = float(rng.uniform(0.1, 2.0)) / (b * t)
    want_eval = ref.crossentropy_forward(logits, targets)
    got_eval = be.crossentropy_forward(be.from_host(logits), be.from_host(targets))
    check(be.to_host(got_eval), want_eval, 1e-6, "crossentropy_forward")

    want_dlogits = logits.copy()
    want_losses = ref.fused_classifier(want_dlogits, targets, dloss)
    dlogits = be.from_host(logits)
    losses = be.fused_classifier(dlogits, be.from_host(targets), dloss)
    check(be.to_host(losses), want_losses, 1e-6, "fused losses")
    check(be.to_host(dlogits), want_dlogits, 1e-5, "dlogits")


@pytest.mark.parametrize("b,t,v,vp", [(3, 1, 1001, 1024), (2, 3, 50257, 50304), (1, 5, 7, 128)])
def test_classifier_of_a_padded_vocabulary(be, rng, b, t, v, vp):
    """Logits Vp wide (model.py's padded vocabulary) of which the first V are tokens: losses and dlogits as
    numpy's over the first V, whatever the padded columns hold (values that would win the softmax), and
    the padded columns' dlogits exactly +0.0, so wte's padded rows get no gradient."""
    logits = np.concatenate([randn(rng, b, t, v, scale=4.0), np.full((b, t, vp - v), 50.0, np.float32)], axis=-1)
    targets = token_ids(rng, (b, t), v)
    dloss = float(rng.uniform(0.1, 2.0)) / (b * t)
    got_eval = be.crossentropy_forward(be.from_host(logits), be.from_host(targets), v)
    check(be.to_host(got_eval), ref.crossentropy_forward(logits, targets, v), 1e-6, "crossentropy_forward")
    want_dlogits = logits.copy()
    want_losses = ref.fused_classifier(want_dlogits, targets, dloss, v)
    dlogits = be.from_host(logits)
    check(be.to_host(be.fused_classifier(dlogits, be.from_host(targets), dloss, v)), want_losses, 1e-6, "losses")
    got = be.to_host(dlogits)
    check(got[..., :v], want_dlogits[..., :v], 1e-5, "dlogits")
    assert not got[..., v:].view(np.uint32).any(), "the padded columns' dlogits are not +0.0"


def test_padded_vocabulary_rows_stay_zero_through_training(be):
    """V = 1000 (wte 1024 rows) on the GPU: after AdamW steps the padded rows, their gradient, m and v are
    +0.0 bit for bit (tests/test_model.py holds numpy to the same)."""
    from padded_vocab import assert_padded_rows_stay_zero

    assert_padded_rows_stay_zero(GPT2(model_config("tiny", 1000), be, seed=1))


def test_out_of_range_targets_give_nan_losses(be, rng):
    """A target outside [0, V) gives a NaN loss (numpy raises IndexError instead) and its row of dlogits is
    plain softmax * dloss, with no one-hot term; the other rows are unaffected. Both ends are tried, -1 and
    V: reading the logit at either would be outside the row."""
    b, t, v, dloss = 2, 4, 50, 0.25
    bad = np.zeros((b, t), bool)
    bad[0, 1] = bad[1, 3] = True
    targets = token_ids(rng, (b, t), v)
    targets[0, 1], targets[1, 3] = v, -1
    safe = np.where(bad, 0, targets)  # what the oracle can index
    logits = randn(rng, b, t, v, scale=4.0)
    got = be.to_host(be.crossentropy_forward(be.from_host(logits), be.from_host(targets)))
    assert np.all(np.isnan(got[bad])), "crossentropy_forward: an out-of-range target must give a NaN loss"
    check(got[~bad], ref.crossentropy_forward(logits, safe)[~bad], 1e-6, "crossentropy_forward, valid rows")

    want_dlogits = logits.copy()
    want_losses = ref.fused_classifier(want_dlogits, safe, dloss)
    want_dlogits[bad, 0] += np.float32(dloss)  # the oracle took dloss off at target 0: a bad row has no one-hot
    dlogits = be.from_host(logits)
    got = be.to_host(be.fused_classifier(dlogits, be.from_host(targets), dloss))
    assert np.all(np.isnan(got[bad])), "fused_classifier: an out-of-range target must give a NaN loss"
    check(got[~bad], want_losses[~bad], 1e-6, "fused losses, valid rows")
    check(be.to_host(dlogits), want_dlogits, 1e-5, "dlogits")


# ---------------------------------------------------------------------------- vocabulary-parallel (--tp)

# (V, Vp, N): Vp / N rows or logit columns a shard. 45 of 64 in 4: the third shard runs past V into the padded
# rows (13 tokens, 3 padded), the fourth holds padded rows only; 1000 of 1024 in 2 takes the vector paths.
VOCAB_SHARDS = [(45, 64, 4), (1000, 1024, 2)]


@pytest.mark.parametrize("v,vp,n", VOCAB_SHARDS)
def test_vocab_encoder_on_every_shard(be, rng, v, vp, n):
    """Each shard's embedding is numpy_ops.vocab_encoder_forward's, exactly (the token's row plus its position
    where the shard holds the row, 0 elsewhere: ids below and above the shard), and the shards sum to the whole
    encoder_forward bit for bit. Backward: each shard's dwte is numpy's within encoder_backward's bound, the
    shards side by side are the whole table's CUDA encoder_backward bit for bit (the same order of adds, so a
    vocabulary-parallel group keeps tp 1's bits), every shard's dwpe is the same bits, and a rerun too."""
    b, t, c = 2, 5, 36
    rows = vp // n
    ids = token_ids(rng, (b, t), v)
    wte, wpe, dout = randn(rng, vp, c), randn(rng, t + 3, c), randn(rng, b, t, c)
    dwte0, dwpe0 = randn(rng, vp, c), randn(rng, t + 3, c)
    d_ids, d_wpe, d_dout = be.from_host(ids), be.from_host(wpe), be.from_host(dout)
    total = np.zeros((b, t, c), np.float32)
    shard_dwte, shard_dwpe = [], []
    for k in range(n):
        row0 = k * rows
        shard = np.ascontiguousarray(wte[row0:row0 + rows])
        got = be.to_host(be.vocab_encoder_forward(d_ids, be.from_host(shard), d_wpe, row0))
        check(got, ref.vocab_encoder_forward(ids, shard, wpe, row0), 0, f"vocab_encoder_forward shard {k}")
        total += got
        runs = []
        for _ in range(2):
            dwte, dwpe = be.from_host(dwte0[row0:row0 + rows]), be.from_host(dwpe0)
            be.vocab_encoder_backward(dwte, dwpe, d_dout, d_ids, row0)
            runs.append((be.to_host(dwte), be.to_host(dwpe)))
        want_wte, want_wpe = dwte0[row0:row0 + rows].copy(), dwpe0.copy()
        ref.vocab_encoder_backward(want_wte, want_wpe, dout, ids, row0)
        check(runs[0][0], want_wte, 1e-6, f"vocab_encoder_backward dwte shard {k}")
        check(runs[0][1], want_wpe, 1e-6, f"vocab_encoder_backward dwpe shard {k}")
        assert all(np.array_equal(x, y) for x, y in zip(runs[0], runs[1], strict=True)), "a rerun changed bits"
        shard_dwte.append(runs[0][0])
        shard_dwpe.append(runs[0][1])
    assert np.array_equal(total, be.to_host(be.encoder_forward(d_ids, be.from_host(wte), d_wpe)))
    dwte, dwpe = be.from_host(dwte0), be.from_host(dwpe0)
    be.encoder_backward(dwte, dwpe, d_dout, d_ids)
    assert np.array_equal(np.concatenate(shard_dwte), be.to_host(dwte))
    assert all(np.array_equal(x, be.to_host(dwpe)) for x in shard_dwpe)


@pytest.mark.parametrize("v,vp,n", VOCAB_SHARDS)
def test_vocab_classifier_on_every_shard(be, rng, v, vp, n):
    """vocab_max, vocab_sums and vocab_classifier on each shard against numpy_ops' (the maxima exactly, -inf on
    the padded-only shard; the sums, losses and dlogits within the classifier tests' bounds; targets on and off
    each shard), with the group's collectives done here on the host; the padded columns hold values that would
    win the softmax and get dlogits +0.0. The shards' losses and dlogits side by side are the whole
    fused_classifier's and crossentropy_forward's within the same bounds. The first shard's logits rows are
    padded (ld > the shard's width), as matmul_forward pads them."""
    b, t = 3, 2
    rows = vp // n
    logits = np.concatenate([randn(rng, b, t, v, scale=4.0), np.full((b, t, vp - v), 50.0, np.float32)], axis=-1)
    targets = token_ids(rng, (b, t), v)
    dloss = float(rng.uniform(0.1, 2.0)) / (b * t)
    shards = [np.ascontiguousarray(logits[..., k * rows:(k + 1) * rows]) for k in range(n)]

    def put(k):  # the shard's logits on the device, the first in rows 8 elements wider than it
        if k:
            return be.from_host(shards[k])
        return be.from_host(np.concatenate([shards[0], np.zeros((b, t, 8), np.float32)], axis=-1))[..., :rows]

    d_targets = be.from_host(targets)
    maxes = []
    for k in range(n):
        got = be.to_host(be.vocab_max(put(k), v, k * rows))
        assert np.array_equal(got, ref.vocab_max(shards[k], v, k * rows)), f"vocab_max shard {k}"
        maxes.append(got)
    group_max = np.max(maxes, axis=0)
    assert np.isneginf(maxes[-1]).all() == (v <= (n - 1) * rows)
    sums = np.zeros((2, b, t), np.float32)
    for k in range(n):
        got = be.to_host(be.vocab_sums(put(k), d_targets, be.from_host(group_max), v, k * rows))
        want = ref.vocab_sums(shards[k], targets, group_max, v, k * rows)
        mine = (targets >= k * rows) & (targets < (k + 1) * rows)
        assert np.array_equal(got[1], want[1]) and not got[1][~mine].any(), f"target's logit, shard {k}"
        if k * rows < v:
            check(got[0], want[0], 1e-6, f"vocab_sums shard {k}")
        else:  # padded columns only: nothing to add
            assert not got[0].view(np.uint32).any(), f"vocab_sums shard {k}: not +0.0"
        sums += got
    d_max, d_sums = be.from_host(group_max), be.from_host(sums)
    want_losses = ref.crossentropy_forward(logits, targets, v)
    dlogits = []
    for k in range(n):
        eval_losses = be.to_host(be.vocab_classifier(put(k), d_targets, d_max, d_sums, None, v, k * rows))
        check(eval_losses, ref.vocab_classifier(shards[k], targets, group_max, sums, None, v, k * rows), 1e-6,
              f"evaluation losses shard {k}")
        check(eval_losses, want_losses, 1e-6, f"evaluation losses shard {k} against crossentropy_forward")
        d_logits = put(k)
        losses = be.to_host(be.vocab_classifier(d_logits, d_targets, d_max, d_sums, dloss, v, k * rows))
        want_dlogits = shards[k].copy()
        check(losses, ref.vocab_classifier(want_dlogits, targets, group_max, sums, dloss, v, k * rows), 1e-6,
              f"losses shard {k}")
        got = be.to_host(d_logits)
        check(got, want_dlogits, 1e-5, f"dlogits shard {k}")
        tokens = max(0, min(rows, v - k * rows))
        assert not got[..., tokens:].view(np.uint32).any(), f"shard {k}: the padded columns' dlogits are not +0.0"
        dlogits.append(got)
    whole = logits.copy()
    ref.fused_classifier(whole, targets, dloss, v)
    check(np.concatenate(dlogits, axis=-1), whole, 1e-5, "dlogits against fused_classifier")


# ---------------------------------------------------------------------------- optimizer pieces

@pytest.mark.parametrize("n", [1_000_003, 4096, 1])
def test_global_norm_and_clip_are_deterministic(be, rng, n):
    buf = randn(rng, n, scale=0.01)
    want = ref.global_norm_squared(buf)
    for put in (be.from_host, lambda a: unaligned(be, a)):
        runs = [be.to_host(be.global_norm_squared(put(buf))) for _ in range(2)]
        check(runs[0], want, 1e-6, "global_norm_squared")
        assert np.array_equal(runs[0], runs[1])
    for max_norm in (1.0, 0.5 * float(np.sqrt(want[0])), 0.0, -1.0):
        got = be.clip_coefficient(be.from_host(want), max_norm)
        check(be.to_host(got), ref.clip_coefficient(want, max_norm), 1e-7, f"clip max_norm={max_norm}")


def test_a_nan_norm_gives_a_nan_clip_coefficient(be):
    """A NaN gradient must not pass as "no clipping needed": np.minimum propagates the NaN (fmin would give 1)
    so the step, and the loss after it, show it; an infinite norm clips to 0."""
    for norm_squared in (np.nan, np.inf):
        host = np.array([norm_squared], np.float32)
        got = be.to_host(be.clip_coefficient(be.from_host(host), 1.0))
        np.testing.assert_array_equal(got, ref.clip_coefficient(host, 1.0))  # NaN equals NaN here


def test_empty_tensors_launch_nothing(be, rng):
    """A batch of zero rows (CUDA refuses a grid of size 0): every op returns its empty result."""
    w, b = randn(rng, C), randn(rng, C)
    empty = be.from_host(np.zeros((0, T, C), np.float32))
    out, mean, rstd = be.layernorm_forward(empty, be.from_host(w), be.from_host(b))
    assert out.shape == (0, T, C) and mean.shape == rstd.shape == (0, T)
    assert be.gelu_forward(empty).shape == (0, T, C)
    assert be.residual_forward(empty, empty).shape == (0, T, C)
    be.synchronize()


def test_scale(be, rng):
    n = 1001
    buf, factor = randn(rng, n), np.array([rng.uniform(0.1, 2.0)], np.float32)
    for put in (be.from_host, lambda a: unaligned(be, a)):
        for f in (float(factor[0]), be.from_host(factor)):
            want = buf.copy()
            ref.scale(want, factor)
            got = put(buf)
            be.scale(got, f)
            check(be.to_host(got), want, 0, "scale")


@pytest.mark.parametrize("n", [100_003, 7])
def test_adamw_steps_match(be, rng, n):
    params, m, v = randn(rng, n, scale=0.02), np.zeros(n, np.float32), np.zeros(n, np.float32)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    d = [be.from_host(a) for a in (params, m, v)]
    d_mask = be.from_host(mask)
    for step in range(1, 5):
        grads = randn(rng, n, scale=0.1)
        coef = np.array([rng.uniform(0.5, 1.0)], np.float32)
        hyper = dict(step=step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        ref.adamw_update(params, grads, m, v, mask, grad_scale=coef, **hyper)
        be.adamw_update(*d[:1], be.from_host(grads), *d[1:], d_mask, grad_scale=be.from_host(coef), **hyper)
    for got, want, what in zip(d, (params, m, v), ("params", "m", "v"), strict=True):
        check(be.to_host(got), want, 1e-6, what)


def test_adamw_schedule_from_device_memory_is_bitwise_the_arguments(be, rng):
    """lr and the bias corrections read by the kernel from a device array that upload() rewrites each step
    (what a captured step does) give the bits the same values passed as arguments give."""
    n = 10_007
    start = randn(rng, n, scale=0.02)
    mask = be.from_host((rng.random(n) < 0.7).astype(np.uint8))
    grads = [be.from_host(randn(rng, n, scale=0.1)) for _ in range(3)]
    schedule = be.xp.zeros(3, dtype=be.xp.float32)
    finals = []
    for from_memory in (False, True):
        p, m, v = be.from_host(start), be.from_host(np.zeros(n, np.float32)), be.from_host(np.zeros(n, np.float32))
        for step, g in enumerate(grads, start=1):
            fixed = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.8)
            if from_memory:
                be.upload(schedule, ref.adamw_schedule(step, 1e-3 * step, 0.9, 0.95))
                be.adamw_update(p, g, m, v, mask, None, None, schedule=schedule, **fixed)
            else:
                be.adamw_update(p, g, m, v, mask, step, 1e-3 * step, **fixed)
        finals.append([be.to_host(a).view(np.uint32) for a in (p, m, v)])
    for a, b in zip(*finals, strict=True):
        assert np.array_equal(a, b)


def test_tf32_products_run_in_their_own_thread(rng):
    """A second backend belongs to its own thread (streams are per thread), as ranks do."""
    a, w = randn(rng, 256, 128), randn(rng, 128, 384, scale=0.1)
    result = {}

    def rank():
        tf32 = CudaBackend(0, allow_tf32=True)
        result["out"] = tf32.to_host(tf32.matmul_forward(tf32.from_host(a), tf32.from_host(w)))

    thread = threading.Thread(target=rank)
    thread.start()
    thread.join()
    check(result["out"], a @ w, 5e-3, "tf32 matmul")  # tf32: ~1e-3 relative



@pytest.mark.real_gpu
def test_the_clock_times_the_gpu_not_the_host(be, rng):
    """timestamp() marks a point in the stream: a span around a stall behind another stream's work
    measures the stall, though the host queued both marks in microseconds."""
    a = cupy.asarray(randn(rng, 2048, 2048))
    side = cupy.cuda.Stream(non_blocking=True)
    # not `with side:`: on the H100 (CuPy 14.2) leaving it made the null stream current, not the rank's, and
    # every later test of the module failed the backend's stream check
    side.use()
    try:  # a failure here must not leave the module's later tests on the side stream
        # the loop's own first iteration, untimed: cuBLAS's handle set-up and the NVRTC compile of the scaling
        # kernel are host work that would sit inside `busy` (0.5 s of it on the H100, against 6 ms stalled)
        a = a @ a * np.float32(1e-3)
        side.synchronize()
        busy_start = be.timestamp()
        for _ in range(20):
            a = a @ a * np.float32(1e-3)  # a few ms of work on the side stream
        busy_end = be.timestamp()
    finally:
        be.stream.use()
    start = be.timestamp()  # on the rank's stream: reached at once
    be.wait(busy_end)
    end = be.timestamp()    # reached when the side stream's work is done
    busy, stalled = be.elapsed(busy_start, busy_end), be.elapsed(start, end)
    assert busy > 1e-4 and 0.5 * busy < stalled <= busy * 1.05 + 1e-4, (busy, stalled)


# ---------------------------------------------------------------------------- the whole model

def _model_step(backend, config, ids, targets, seed, dropout=0.0):
    model = GPT2(config, backend, seed=seed, dropout=dropout)
    dloss = 1.0 / ids.size
    if dropout:  # a training step's forward: the batch's sequences 2, 4, ... of step 7
        model.set_dropout_step(7)
        losses, tape = model.stage_forward(backend.from_host(ids), None, backend.from_host(targets), dloss,
                                           rows=(2, 2))
        model.stage_backward(tape)
        return model, float(backend.to_host(losses).mean()), backend.to_host(model.grads)
    losses = model.forward(backend.from_host(ids), backend.from_host(targets), dloss=dloss)
    model.backward()
    return model, float(backend.to_host(losses).mean()), backend.to_host(model.grads)


@pytest.mark.parametrize("vocab, matmul", [(4096, "cublas"), (1001, "cublas"), (4096, "cublaslt")])
def test_tiny_model_loss_and_gradients_match_numpy(be, rng, request, vocab, matmul):
    """1001: the logits' rows padded to 1024 (matmul_forward); cublaslt: every bias through the epilogue."""
    config = model_config("tiny", vocab)
    ids, targets = token_ids(rng, (B, T), vocab), token_ids(rng, (B, T), vocab)
    seed = int(rng.integers(0, 2**31))
    _, loss_np, grads_np = _model_step(ref, config, ids, targets, seed)
    backend = request.getfixturevalue("be_lt") if matmul == "cublaslt" else be
    _, loss_cu, grads_cu = _model_step(backend, config, ids, targets, seed)
    assert abs(loss_cu - loss_np) <= 1e-5 * abs(loss_np), (loss_cu, loss_np)
    worst = float(np.abs(grads_cu - grads_np).max())
    assert worst <= 1e-4 * float(np.abs(grads_np).max()), f"gradient max abs error {worst:.3g}"


def test_tiny_model_with_dropout_matches_numpy(be, rng):
    """Every dropout of a training step (embeddings, probabilities, both residual branches), forward and backward."""
    config = model_config("tiny", 1001)
    ids, targets = token_ids(rng, (B, T), 1001), token_ids(rng, (B, T), 1001)
    _, loss_np, grads_np = _model_step(ref, config, ids, targets, 3, dropout=0.2)
    _, loss_cu, grads_cu = _model_step(be, config, ids, targets, 3, dropout=0.2)
    assert loss_np != _model_step(ref, config, ids, targets, 3)[1]
    assert abs(loss_cu - loss_np) <= 1e-5 * abs(loss_np), (loss_cu, loss_np)
    worst = float(np.abs(grads_cu - grads_np).max())
    assert worst <= 1e-4 * float(np.abs(grads_np).max()), f"gradient max abs error {worst:.3g}"


@pytest.mark.training
def test_tiny_model_trains_the_same_for_a_few_steps(be, rng):
    """Three steps of clip + AdamW on both backends. Parameters whose gradient is near zero may take
    opposite-sign Adam steps (sign(m) flips on a 1e-9 difference), so the check is on the losses and
    on the parameters' norm-wise difference, not element by element."""
    config = model_config("tiny", 4096)
    seed = int(rng.integers(0, 2**31))
    batches = [(token_ids(rng, (B, T), 4096), token_ids(rng, (B, T), 4096)) for _ in range(3)]
    trajectories, finals = [], []
    for backend in (ref, be):
        model = GPT2(config, backend, seed=seed)
        xp = backend.xp
        m, v = xp.zeros_like(model.params), xp.zeros_like(model.params)
        losses = []
        for step, (ids, targets) in enumerate(batches, start=1):
            model.zero_grad()
            out = model.forward(backend.from_host(ids), backend.from_host(targets), dloss=1.0 / ids.size)
            model.backward()
            coef = backend.clip_coefficient(backend.global_norm_squared(model.grads), 1.0)
            backend.adamw_update(model.params, model.grads, m, v, model.decay_mask, step=step, lr=1e-3,
                                 beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=coef)
            losses.append(float(backend.to_host(out).mean()))
        trajectories.append(losses)
        finals.append(backend.to_host(model.params))
    np.testing.assert_allclose(trajectories[1], trajectories[0], rtol=1e-4)
    diff = np.linalg.norm(finals[1] - finals[0]) / np.linalg.norm(finals[0])
    assert diff < 1e-4, f"parameters differ by {diff:.3g} (relative norm)"


def test_bf16_round_is_bitwise_the_oracle(be, rng):
    """Ties, carries into the exponent, the largest finite values, infinities and NaNs included."""
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.3895314e38, -3.3895314e38, np.inf, -np.inf,
                        np.nan, 1e-40, -1e-40], dtype=np.float32)
    # NaNs with payload in the low 16 bits: the rounding carry alone would turn them into inf, -inf or 0
    nans = np.array([0x7F800001, 0xFF800001, 0xFFFFFFFF, 0x7FBFFFFF], dtype=np.uint32).view(np.float32)
    ties = (np.arange(64, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly half way
    host = np.concatenate([special, nans, ties, randn(rng, 10_007, scale=100.0)])
    for buf in (be.from_host(host), unaligned(be, host)):
        want = host.copy()
        ref.bf16_round(want)
        be.bf16_round(buf)
        assert np.array_equal(be.to_host(buf).view(np.uint32), want.view(np.uint32))


def test_a_device_that_does_not_exist_is_one_line():
    from xtrain_dist.errors import XtrainError

    count = cupy.cuda.runtime.getDeviceCount()
    for device in (count, -1):
        with pytest.raises(XtrainError, match=rf"^--backend cuda: device {device} does not exist \({count} visible\)$"):
            CudaBackend(device)


def test_hellaswag_scores_follow_numpy(be, rng):
    """Each completion's mean loss and the count of right answers (hellaswag.py) on the GPU, against the
    numpy backend on the same weights; examples of random ids, passes of 3 examples."""
    from xtrain_dist.eval.hellaswag import Example, HellaSwag

    def ids(most):
        return rng.integers(0, 4096, size=int(rng.integers(1, most + 1))).astype(np.int32)

    examples = [Example(i, int(rng.integers(0, 4)), ids(20), tuple(ids(9) for _ in range(4))) for i in range(10)]
    config = model_config("tiny", 4096)
    # weights far from the initialisation, so that the completions' scores lie apart (see test_hellaswag.py)
    weights = randn(rng, GPT2(config, ref).size, scale=0.3)
    scores, counts = [], []
    for backend in (ref, be):
        model = GPT2(config, backend)
        model.params[...] = backend.from_host(weights)
        model.refresh_lowp()
        evaluator = HellaSwag(examples, 200, 0, 1, backend)
        scores.append(backend.to_host(evaluator.completion_losses(model)))
        counts.append(evaluator.correct(model))
    check(scores[1], scores[0], rel=1e-5, what="completion losses")
    ordered = np.sort(scores[0], axis=1)
    if np.all(ordered[:, 1] - ordered[:, 0] > 1e-4):  # no near-tie that rounding may decide either way
        assert counts[1] == counts[0]


# ---------------------------------------------------------------------------- training on the GPU

# The training tests' global batch and sequence length: each compares runs (to the bit, or to numpy's within a
# bound that holds at any size), and on the CPU simulator every token of every step costs (the classifier's
# softmax over the vocabulary's logits a token the most), so the batch is small, the sequence 16 tokens (the op
# tests above hold each kernel at lengths past a warp and past a pass of its loads: 33, 200) and the vocabulary
# 512 ids (tests/small_vocab.py). At 4 x 32 the simulator's training tests took 63 CPU-seconds, at 4 x 16 48.
BATCH, SEQ = 4, 16


def _train(log=lambda line: None, stop=None, **kw):
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train

    corpus = small_vocab.corpus()
    # few steps of BATCH x SEQ (above), standard attention and cuBLAS: the paths these tests were written for, not
    # the GPU's defaults (tests/test_cudnn_attention.py has those)
    cfg = TrainConfig(**{"steps": 4, "batch": BATCH, "seq": SEQ, "model": "tiny", "seed": 3, "attention": "standard",
                         "matmul": "cublas", **kw}).resolved()
    return train(cfg, corpus, log=log, stop=stop)


@pytest.mark.training
def test_ddp_two_virtual_ranks_match_single_rank_and_numpy():
    """Two rank threads share device 0, each with its own CudaBackend and stream, reducing through the
    in-process communicator: they follow the 1-rank CUDA run and the numpy run, with identical bits."""
    one = _train(backend="cuda", world_size=1)
    two = _train(backend="cuda", world_size=2)
    reference = _train(backend="numpy", world_size=1)
    for run in (two, reference):
        worst = np.max(np.abs(np.array(run["losses"]) - one["losses"]) / np.array(one["losses"]))
        assert worst < 1e-3, worst
    assert len(two["param_sha256"]) == 2 and len(set(two["param_sha256"])) == 1


@pytest.mark.training
@pytest.mark.parametrize("options", [
    {"grad_sync": "bucketed", "bucket_mb": 0.05}, {"grad_sync": "flat", "dtype": "bf16", "grad_accum": 2},
    {"grad_sync": "per-param", "grad_compress": "bf16"}, {"zero": 1, "matmul": "cublaslt"},
    {"dropout": 0.1, "grad_accum": 2},  # dropout: each replay reads its step's number, so its own masks
    # tp 2 x pp 2 on a GPU per rank (NCCL): each rank captures its stage's part of the 1F1B schedule, with its
    # tensor-parallel all-reduces, its transfers, the wte copies' sum and the overlapped sync settling before each
    {"world_size": 4, "tp": 2, "pp": 2, "grad_accum": 2, "tp_classifier": "replicated", "steps": 3, "batch": 2,
     "seq": 16}])
def test_a_step_replayed_from_a_cuda_graph_gives_the_same_bits(options, monkeypatch):
    """--cuda-graph auto on one rank: the first step runs as usual, the second is captured and launched,
    the rest are launches, and losses and parameters are bitwise those of --cuda-graph off. The graph holds
    the step's collectives (the count is the capture's); replayed steps have no timings of their own."""
    kw = {"backend": "cuda", "world_size": 1, "steps": 4, "eval_batches": 0, **options}
    if kw["world_size"] > 1:  # NCCL: a GPU per rank (on the simulator, as many simulated GPUs)
        if getattr(cupy, "cudasim", False):
            monkeypatch.setenv("XTRAIN_CUDASIM_DEVICES", str(kw["world_size"]))
        elif cupy.cuda.runtime.getDeviceCount() < kw["world_size"]:
            pytest.skip(f"NCCL needs a GPU per rank: {kw['world_size']} GPUs")
    off, graph = _train(cuda_graph="off", **kw), _train(cuda_graph="auto", **kw)
    assert off["cuda_graph"] == {"mode": "off", "replayed_steps": 0, "without": None}
    assert graph["cuda_graph"] == {"mode": "auto", "replayed_steps": kw["steps"] - 1, "without": None}
    assert graph["losses"] == off["losses"] and graph["param_sha256"] == off["param_sha256"]
    assert graph["comm_calls_per_step"] == off["comm_calls_per_step"]


@pytest.mark.training
@pytest.mark.parametrize("refused", ["a host read", "CuPy's cuBLAS"])
def test_a_capture_that_fails_is_one_line_and_the_run_goes_on_without_graphs(monkeypatch, refused):
    """A step that reads a device value on the host cannot be captured (the simulator refuses it, as a GPU
    does), nor one that calls cuBLAS through CuPy's wrappers (CuPy refuses, as it did on an H200): the capture
    is abandoned, the run says so in one line, runs that step and the rest without a graph, and ends on the
    bits of --cuda-graph off."""
    if not getattr(cupy, "cudasim", False):
        pytest.skip("the refusal is planted through the simulator's")
    norm = CudaBackend.global_norm_squared

    def with_a_host_read(self, buf):
        out = norm(self, buf)
        if refused == "a host read":
            float(out.sum())  # fine eagerly, refused in a capture
        else:
            cupy.cuda.device.get_cublas_handle()  # points CuPy's handle at the stream: refused in a capture
        return out

    kw = dict(backend="cuda", world_size=1, steps=3, eval_batches=0, grad_sync="bucketed", bucket_mb=0.05)
    off = _train(cuda_graph="off", **kw)
    monkeypatch.setattr(CudaBackend, "global_norm_squared", with_a_host_read)
    lines = []
    graph = _train(cuda_graph="auto", log=lines.append, **kw)
    [line] = [line for line in lines if line.startswith("--cuda-graph")]
    why = (r"cudaErrorStreamCaptureUnsupported: cudasim: a copy to the host .*" if refused == "a host read" else
           r"CuPy: calling cuBLAS API during stream capture is currently unsupported")
    assert re.fullmatch(r"--cuda-graph auto: rank 0 runs without CUDA graphs: the capture failed: " + why, line), line
    assert graph["cuda_graph"]["replayed_steps"] == 0
    assert graph["losses"] == off["losses"] and graph["param_sha256"] == off["param_sha256"]


@pytest.mark.training
def test_virtual_ranks_say_in_one_line_that_they_run_without_cuda_graphs():
    """Two virtual ranks exchange through the in-process communicator, which synchronizes the rank
    threads on the host: no graph, one line saying why, and the bits of --cuda-graph off."""
    lines = []
    kw = dict(backend="cuda", world_size=2, steps=3, eval_batches=0)
    graph, off = _train(cuda_graph="auto", log=lines.append, **kw), _train(cuda_graph="off", **kw)
    why = ("the in-process communicator of virtual ranks synchronizes the rank threads on the host, which a "
           "captured step cannot do")
    assert [line for line in lines if line.startswith("--cuda-graph")] == [
        f"--cuda-graph auto: rank 0 runs without CUDA graphs: {why}"]
    assert graph["cuda_graph"] == {"mode": "auto", "replayed_steps": 0, "without": why}
    assert graph["param_sha256"] == off["param_sha256"] and graph["losses"] == off["losses"]


@pytest.mark.training
def test_ddp_with_cublaslt_matches_numpy_and_keeps_ranks_equal():
    """--matmul cublaslt through the trainer: two virtual ranks, each with its own cuBLASLt handle and
    workspace on the shared device, follow the numpy run and end with identical bits."""
    two = _train(backend="cuda", world_size=2, matmul="cublaslt")
    reference = _train(backend="numpy", world_size=1)
    worst = np.max(np.abs(np.array(two["losses"]) - reference["losses"]) / np.array(reference["losses"]))
    assert worst < 1e-3, worst
    assert len(two["param_sha256"]) == 2 and len(set(two["param_sha256"])) == 1


@pytest.mark.training
def test_a_training_step_copies_the_batch_in_and_one_array_out():
    """No hidden host<->device traffic in the step: per optimizer step the host uploads each
    micro-batch's ids and targets, the readout array's [0, stop, 0] and AdamW's schedule, queues one
    download (the loss, the stop request and the squared grad norm together), and waits for it only
    after queuing the next step (the event waits after it only turn the step's timing marks into
    seconds). The simulator logs every copy and wait (CuPy has no hook for them), so
    this runs there only."""
    if not getattr(cupy, "cudasim", False):
        pytest.skip("the host traffic log is the CUDA simulator's (tests/cudasim)")
    import fake_cupy

    fake_cupy.host_traffic_by_thread.clear()
    _train(backend="cuda", world_size=1, steps=3, grad_accum=2, eval_batches=0)
    log = " ".join(fake_cupy.host_traffic_by_thread["rank0"])
    assert re.fullmatch(fake_cupy.training_traffic(steps=3, uploads=6), log), log  # 2 x (ids, targets), 2 more


@pytest.mark.training
def test_a_cuda_run_gives_each_steps_mfu_against_its_gpus_peak(tmp_path, monkeypatch):
    """Two virtual ranks share one GPU: the job's peak is that GPU's, read from the name the driver gives
    it, at the run's precision; every step's record and progress line and the report carry the MFU of the
    job's model flops (profile.nanogpt_flops_per_token) in that step's time. The peak is made up, so the figures
    mean nothing here but their arithmetic; bin/bench_gpu measures the real MFU."""
    from xtrain_dist.backend.cuda.device import device_name
    from xtrain_dist.config import TrainConfig, model_config
    from xtrain_dist.profile import nanogpt_flops_per_token
    from xtrain_dist.train import job
    from xtrain_dist.train.metrics import read

    asked = []
    monkeypatch.setattr(job, "peak_for", lambda name: asked.append(name) or {"fp32": 1, "tf32": 2, "bf16": 1e-4})
    corpus, lines = small_vocab.corpus(), []
    cfg = TrainConfig(steps=3, batch=8, seq=64, seed=3, backend="cuda", world_size=2, dtype="bf16", eval_batches=0,
                      metrics=str(tmp_path / "m.jsonl")).resolved()
    report = job.train(cfg, corpus, log=lines.append)
    assert asked == [device_name(0)]
    step_flops = nanogpt_flops_per_token(model_config("tiny", corpus.vocab_size), 64) * 8 * 64
    records = read(tmp_path / "m.jsonl")
    assert [r["mfu"] for r in records] == pytest.approx([step_flops / (r["ms"] * 1e-3) / 1e8 for r in records])
    assert report["mfu"] == pytest.approx(step_flops / (report["ms_per_step"] * 1e-3) / 1e8)
    progress = [line for line in lines if line.startswith("step")]
    # the MFU field, then the clock's (elapsed, left) last on the line
    assert [line.split(" | ")[-2] == f"MFU {100 * r['mfu']:4.1f}%" and line.endswith(" left")
            for line, r in zip(progress, records, strict=True)] == [True] * 3


@pytest.mark.training
@pytest.mark.parametrize("world, options", [
    (1, {}), (1, {"dtype": "bf16"}), (2, {"zero": 1, "grad_sync": "bucketed", "bucket_mb": 0.05}),
    (2, {"zero": 3, "grad_sync": "bucketed"})])
def test_a_cuda_run_resumes_bitwise(tmp_path, world, options):
    """A GPU run saved after 3 of 5 steps and resumed gives the losses of steps 4 and 5, the validation
    loss and the final parameters of the uninterrupted run, to the bit: the float32 masters, AdamW's
    moments (one file per rank under ZeRO-1 and -3) and the sampler's state go through the host and the
    checkpoint, and bf16's weight copy is rebuilt from the masters. ZeRO-3 gathers its parameter shards to save
    them and scores the held-out batches with each unit gathered as in training."""
    kw = dict(backend="cuda", world_size=world, lr_decay_steps=5, eval_batches=2, **options)
    full = _train(steps=5, **kw)
    first = _train(steps=3, save_dir=str(tmp_path / "ck"), **kw)
    resumed = _train(steps=5, resume=str(tmp_path / "ck"), **kw)
    assert first["losses"] == full["losses"][:3]
    assert resumed["start_step"] == 3 and resumed["losses"] == full["losses"][3:]
    assert resumed["param_sha256"] == full["param_sha256"] and resumed["val_losses"] == full["val_losses"]


@pytest.mark.training
def test_a_stop_request_on_the_gpu_ends_after_a_step_and_resumes_bitwise(tmp_path):
    """SIGTERM's path on the GPU (job.StopRequest): the request is a 1 uploaded into the device array the
    step's loss is all-reduced in. Set while step 1 is logged (once step 2 is queued: a step is read after
    the next is queued), it goes in with step 3, is read once step 4 is queued, and both virtual ranks stop
    after step 4, save that step, and the resumed run ends on the uninterrupted run's bits."""
    from xtrain_dist.train.job import StopRequest

    kw = dict(backend="cuda", world_size=2, lr_decay_steps=5, eval_batches=0)
    full = _train(steps=5, **kw)
    stop = StopRequest(str(tmp_path / "ck"))

    def log(line):
        if line.startswith("step     1/5"):
            stop.set()

    stopped = _train(steps=5, save_dir=str(tmp_path / "ck"), log=log, stop=stop, **kw)
    assert stopped["stopped"] == {"step": 4, "signal": None} and stopped["losses"] == full["losses"][:4]
    resumed = _train(steps=5, resume=str(tmp_path / "ck"), **kw)
    assert resumed["start_step"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["param_sha256"] == full["param_sha256"]


@pytest.mark.training
@pytest.mark.parametrize("world", [1, 2])
def test_a_cuda_run_starts_from_init_from_weights_as_numpy_does(tmp_path, world):
    """--init-from on the GPU: each rank uploads the folder's weights into its own model, so the first
    loss is the numpy run's from the same folder (float32 noise apart), the run follows it, and the ranks
    stay bitwise equal."""
    base = _train(steps=3, backend="numpy", save_dir=str(tmp_path / "base"), eval_batches=0)
    kw = dict(steps=3, seed=5, init_from=str(tmp_path / "base"), eval_batches=0, world_size=world)
    on_gpu, on_cpu = _train(backend="cuda", **kw), _train(backend="numpy", **kw)
    np.testing.assert_allclose(on_gpu["losses"], on_cpu["losses"], rtol=1e-4)
    assert abs(on_gpu["losses"][0] - base["losses"][0]) > 1e-3  # not our init: seed 5 draws other batches too
    assert len(set(on_gpu["param_sha256"])) == 1


@pytest.mark.training
def test_a_cuda_checkpoint_evaluates_and_samples_as_on_numpy(be, tmp_path):
    """The folder a GPU run saves is read back by either backend: the same held-out loss (float32 noise
    apart), the same logits, and greedy decoding picks the same ids (a differing id is allowed only
    where numpy's top two logits are a near tie)."""
    from xtrain_dist.backend import numpy_ops
    from xtrain_dist.comm.local import LocalGroup
    from xtrain_dist.eval.evaluate import Evaluator
    from xtrain_dist.eval.sample import generate, load

    _train(backend="cuda", steps=4, lr=1e-2, save_dir=str(tmp_path / "ck"), eval_batches=0)  # away from its init
    corpus = small_vocab.corpus()
    (cpu, tokenizer, _), (gpu, _, _) = load(tmp_path / "ck", numpy_ops), load(tmp_path / "ck", be)
    losses = [Evaluator(corpus.val, 8, 64, 3, 0, 1, m.ops).loss(m, LocalGroup(1).communicator(0)) for m in (cpu, gpu)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)

    prompt = tokenizer.encode("ROMEO:", add_special_tokens=False).ids
    want = generate(cpu, prompt, 16, temperature=0, top_k=None, rng=np.random.default_rng(0))
    got = generate(gpu, prompt, 16, temperature=0, top_k=None, rng=np.random.default_rng(0))
    ids = np.array([prompt + want], dtype=np.int32)
    cpu_logits = cpu.forward(ids)[0]
    np.testing.assert_allclose(be.to_host(gpu.forward(be.from_host(ids)))[0], cpu_logits, rtol=1e-4, atol=1e-4)
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        top2 = np.sort(cpu_logits[len(prompt) + i - 1])[-2:]
        assert top2[1] - top2[0] < 1e-4, (i, got, want, top2)


def test_a_cached_forward_gives_the_logits_of_a_full_forward(be, rng):
    """model.KVCache on the GPU (CuPy's products and elementwise ops, the encoder kernel reading wpe from
    the cache's offset): 17 ids in one pass, then 23 one at a time, against one full forward."""
    from xtrain_dist.model import KVCache

    model = GPT2(model_config("tiny", 4096), be, seed=int(rng.integers(0, 2**31)))
    ids = token_ids(rng, (1, 40), 4096)
    full = be.to_host(model.forward(be.from_host(ids)))
    cache = KVCache(model, batch=1)
    chunks = [ids[:, :17]] + [ids[:, t:t + 1] for t in range(17, 40)]
    pieces = [be.to_host(model.forward(be.from_host(np.ascontiguousarray(c)), cache=cache)) for c in chunks]
    assert cache.length == 40
    check(np.concatenate(pieces, axis=1), full, rel=1e-5, what="cached logits")


@pytest.mark.training
def test_cuda_training_is_bitwise_reproducible_and_sampling_changes_nothing(be, tmp_path):
    """The second run also draws text after steps 2, 4 and 5 (--sample-every, rank 0 on its GPU): the same
    bits, and its last draw is the one the sample command makes on the GPU from the step-5 checkpoint
    (its functions on this module's backend: a CudaBackend made here would take over this thread's
    stream from `be`)."""
    from xtrain_dist.eval.sample import continuation, load

    first = _train(backend="cuda", world_size=2, steps=5)
    second = _train(backend="cuda", world_size=2, steps=5, sample_every=2, sample_tokens=8,
                    save_dir=str(tmp_path / "ck"))
    assert first["param_sha256"] == second["param_sha256"]
    assert first["losses"] == second["losses"]
    assert [step for step, _ in second["samples"]] == [2, 4, 5]
    model, tokenizer, _ = load(tmp_path / "ck", be)
    start = [tokenizer.token_to_id("<|endoftext|>")]
    assert second["samples"][-1][1] == continuation(model, tokenizer, start, 8, seed=3, show_prompt=False)


@pytest.mark.training
def test_recompute_gives_the_same_bits_on_the_gpu():
    """--recompute 2 runs GELU and both layernorms again in backward, on the same inputs: the kernels are
    deterministic, so the parameters are those of the run that kept the activations."""
    kept = _train(backend="cuda", world_size=2, steps=3)
    recomputed = _train(backend="cuda", world_size=2, steps=3, recompute=2)
    assert recomputed["param_sha256"] == kept["param_sha256"]
    assert recomputed["losses"] == kept["losses"]


@pytest.mark.training
@pytest.mark.real_gpu
def test_the_command_line_trains_on_the_gpu():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "40", "8", "64", "--backend", "cuda",
                          "--model", "tiny"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 40 and np.mean(losses[-5:]) < losses[0] - 0.5


@pytest.mark.real_gpu
def test_the_preflight_bound_is_below_what_the_gpu_held(tmp_path):
    """mini at 16 x 256, activations most of it: CuPy's pool holds at least the memory check's bound (which
    leaves out temporaries, so it must be below) and not over twice it plus 256 MiB (so it counts what
    matters). The host's peak RSS is held to the same bounds on the CPU (test_memory)."""
    import json
    import subprocess
    import sys

    from xtrain_dist.train import memory

    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "16", "256", "--backend", "cuda",
                          "--model", "mini", "--eval-batches", "0", "--report", str(report)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(report.read_text())["memory"]
    bound = sum(figures["rank0_bytes_at_least"].values())
    [held] = figures["gpu_pool_bytes"].values()
    assert bound <= held <= 2 * bound + (256 << 20), (bound, held)
    assert out.stdout.splitlines()[-1].endswith(f", GPU memory held {memory.gib(held)}, report {report}")


@pytest.mark.training
@pytest.mark.parametrize("options", [
    {"grad_sync": "flat"}, {"grad_sync": "per-param"}, {"grad_sync": "bucketed", "bucket_mb": 0.05},
    {"zero": 1}, {"zero": 1, "grad_sync": "bucketed", "bucket_mb": 0.05}, {"grad_compress": "bf16"},
    {"grad_accum": 2}, {"grad_compress": "powersgd", "powersgd_start_step": 1, "grad_sync": "flat"},
    {"grad_compress": "powersgd", "powersgd_start_step": 1, "grad_sync": "bucketed", "bucket_mb": 0.05},
    {"zero": 2, "grad_sync": "bucketed", "grad_accum": 2}, {"zero": 3, "grad_sync": "bucketed", "grad_accum": 2}])
def test_every_ddp_option_on_two_virtual_ranks_follows_numpy(options):
    """The communication thread on a side stream (bucketed), sharded AdamW, bf16 rounding on the GPU:
    each follows the same option on the numpy backend, with bitwise-equal ranks.

    The bound. Every kernel is within 1.3e-6 (norm-wise) of its numpy oracle in float32 (the GPU session's
    op table, H100, 2026-11-26; 0 on the simulator, whose products are numpy's), and one step of the tiny
    model composes about 30 of them, so a gradient element differs by at most about 30 x 1.3e-6 = 4e-5 of
    itself, and so do the gradient norms; AdamW's step is the gradient's sign at step 1 and a ratio of
    averages after, moved by as little, so three steps at lr 1e-3 move parameters by ~1e-7 and the losses
    by the same 4e-5 at most. bf16 compression rounds both sides' sums to bf16; where the two straddle a
    rounding boundary one element differs by 2^-8 of itself, rare enough to move the norms by 2e-6
    (measured against PyTorch's hook, tests/test_ddp.py). Hence 1e-4 on losses and gradient norms, where
    a sum of rank 0's gradient alone moves the losses by 7.8e-3 and compression missing the norms by 1e-4
    to 1e-3 (tests/test_ddp.py's figures on numpy). PowerSGD (from step 2) adds rank-1 products and a
    normalisation, each as well conditioned as the products they approximate: the same bound."""
    cuda = _train(backend="cuda", world_size=2, steps=3, **options)
    numpy_run = _train(backend="numpy", world_size=2, steps=3, **options)
    np.testing.assert_allclose(cuda["losses"], numpy_run["losses"], rtol=1e-4)
    np.testing.assert_allclose(cuda["grad_norms"], numpy_run["grad_norms"], rtol=1e-4)
    assert len(set(cuda["param_sha256"])) == 1


@pytest.mark.training
@pytest.mark.parametrize("options", [{}, {"dtype": "bf16"}, {"grad_compress": "bf16", "zero3_prefetch": 0}])
def test_zero_2_and_3_on_two_virtual_ranks_give_zero_1s_bits(options):
    """ZeRO-2 reduce-scatters each unit's gradient on the rank's communication thread, on a stream of its own,
    as backward finishes the unit; ZeRO-3 also all-gathers each unit's parameters there before forward and
    backward read them (the next ones prefetched while the rank computes; under bf16 rounded into a bf16 copy
    at once). With one micro-batch a shard's gradient is each element's sum over the two ranks however the
    gradient is cut (parallel/zero.py), so losses, gradient norms and parameters are ZeRO-1's bits, and the
    two ranks' are equal. --cuda-graph auto says in one line that these stages run without graphs."""
    lines = []
    runs = {zero: _train(backend="cuda", world_size=2, steps=3, zero=zero, grad_sync="bucketed", eval_batches=0,
                         log=lines.append, **options) for zero in (1, 2, 3)}
    for zero in (2, 3):
        assert runs[zero]["losses"] == runs[1]["losses"] and runs[zero]["grad_norms"] == runs[1]["grad_norms"]
        assert runs[zero]["param_sha256"] == runs[1]["param_sha256"] and len(set(runs[1]["param_sha256"])) == 1
        assert (f"--cuda-graph auto: rank 0 runs without CUDA graphs: ZeRO-{zero} is not captured: its communication "
                f"thread's gathers and reduce-scatters, and the unit buffers that come and go with them, run outside "
                f"graphs so far") in lines
    # every rank's report: ZeRO-2 (whole parameters) gathers none; in float32, ZeRO-3's peak is at the head,
    # with wte gathered (under bf16 the gathered wte is half that, and the embedding's wte gradient the peak)
    assert [peak["gathered_params"] for peak in runs[2]["zero_peak_bytes"]] == [0, 0]
    if options.get("dtype") != "bf16":
        assert [peak["gathered_params"] > 0 for peak in runs[3]["zero_peak_bytes"]] == [True, True]


@pytest.mark.training
def test_zero_3_on_two_virtual_ranks_scores_hellaswag_and_samples_as_zero_1_does(tmp_path):
    """Evaluation passes gather each unit as training does, on every rank at once: 5 HellaSwag examples over 2
    ranks (3 and 2, so one rank has fewer to score and still takes part in the other's gathers) and a sample
    drawn on every rank beside rank 0's give ZeRO-1's scores and text."""
    from test_hellaswag import random_examples, write

    path = write(tmp_path / "hs.bin", random_examples(5, seed=0, vocab=small_vocab.corpus().vocab_size))
    kw = dict(backend="cuda", world_size=2, steps=2, eval_batches=1, grad_sync="bucketed", hellaswag=str(path),
              sample_every=2, sample_tokens=4)
    sharded, whole = _train(zero=3, **kw), _train(zero=1, **kw)
    assert sharded["hellaswag"] == whole["hellaswag"] != [] and sharded["samples"] == whole["samples"] != []
    assert sharded["val_losses"] == whole["val_losses"] != [] and sharded["param_sha256"] == whole["param_sha256"]


@pytest.mark.training
@pytest.mark.parametrize("dtype, classifier", [("fp32", "replicated"), ("bf16", "replicated"), ("fp32", "vocab")])
def test_tensor_parallel_on_two_virtual_ranks_follows_numpy_world_one(dtype, classifier):
    """--tp 2 on two virtual ranks of one GPU: each holds half of every block's heads and MLP columns, the
    model all-reduces over the pair, and the run follows numpy's world 1 (fp32: the bound of the DDP options
    above, 1e-4; bf16: 1e-3, as the bf16 DDP test's), both ranks' replicated parameters bitwise equal (the
    report's sha256 is of each rank's own shards, so the two differ). --tp-classifier vocab (the default) also
    cuts wte and the classifier by rows: the embedding's all-reduce, the maxima's all-gather and the sums'
    all-reduce forward, the classifier input gradient's all-reduce backward. Graphs are off, in one line: the
    virtual ranks' communicator cannot be captured (a GPU per rank captures the step: the graph test below)."""
    lines = []
    cuda = _train(backend="cuda", world_size=2, tp=2, steps=3, grad_sync="flat", dtype=dtype, log=lines.append,
                  tp_classifier=classifier)
    numpy_run = _train(backend="numpy", world_size=1, steps=3, dtype=dtype)
    rtol = 1e-4 if dtype == "fp32" else 1e-3
    np.testing.assert_allclose(cuda["losses"], numpy_run["losses"], rtol=rtol)
    np.testing.assert_allclose(cuda["grad_norms"], numpy_run["grad_norms"], rtol=rtol)
    tokens, C = BATCH * SEQ, 64  # tiny: 2 layers, C 64
    blocks = 4 * 2 * tokens * C * 4 + 4  # two all-reduces forward and two backward a block, and the loss's
    vocab = 2 * tokens * C * 4 + tokens * 4 + 2 * tokens * 4  # embedding and dlnf; the maxima, the two sums
    assert cuda["comm_bytes_per_step"]["tp"] == blocks + (vocab if classifier == "vocab" else 0)
    assert any("runs without CUDA graphs: the in-process communicator of virtual ranks" in line
               for line in lines), lines


@pytest.mark.training
def test_sequence_parallel_on_two_virtual_ranks_gives_tensor_parallels_bits():
    """--sequence-parallel at tp 2: each rank keeps half of the tokens between the blocks, and the all-reduces
    become reduce-scatters and all-gathers, which sum the same two partial outputs in the same order: the
    losses and parameters of tp 2 without it, to the bit (bf16's all-gathers move its words as float16)."""
    kw = dict(backend="cuda", world_size=2, tp=2, steps=3, grad_sync="flat", tp_classifier="replicated",
              dtype="bf16")
    cut, whole = _train(sequence_parallel=True, **kw), _train(**kw)
    assert cut["losses"] == whole["losses"] and cut["param_sha256"] == whole["param_sha256"]
    # and the cut did happen: the blocks keep less (the layernorms' and the residual's tokens are halves)
    kept = [run["memory"]["rank0_block_activations"]["bytes"] for run in (cut, whole)]
    assert kept[0] < kept[1], kept


@pytest.mark.training
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pipeline_parallel_on_two_virtual_ranks_follows_numpy_world_one(dtype):
    """--pp 2 on two virtual ranks of one GPU: one block and the embedding on the first, one block and the
    head on the second, 2 micro-batches through 1F1B with the activations and their gradients sent between
    them, and the run follows numpy's world 1 within the bounds of the tensor-parallel test above. The two
    stages' copies of wte end with the same bits. Graphs are off, in one line (as at --tp above)."""
    from xtrain_dist.train import loop

    models, lines = [], []

    class Recorded(loop.GPT2):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            models.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "GPT2", Recorded)
        cuda = _train(backend="cuda", world_size=2, pp=2, grad_accum=2, steps=3, grad_sync="flat", dtype=dtype,
                      log=lines.append)
    numpy_run = _train(backend="numpy", world_size=1, steps=3, dtype=dtype)
    rtol = 1e-4 if dtype == "fp32" else 1e-3
    np.testing.assert_allclose(cuda["losses"], numpy_run["losses"], rtol=rtol)
    np.testing.assert_allclose(cuda["grad_norms"], numpy_run["grad_norms"], rtol=rtol)
    wte = [m.ops.to_host(m.params[s.offset: s.offset + s.size]) for m in models for s in m.layout
           if s.name == "transformer.wte.weight"]
    assert len(wte) == 2 and np.array_equal(wte[0], wte[1])
    # rank 0 sends 2 micro-batches of BATCH / 2 x SEQ x 64 activations (2 bytes each in bf16), wte's gradient
    # (float32) and the gradient norm's float32
    act_bytes = 4 if dtype == "fp32" else 2
    vocab = small_vocab.corpus().vocab_size
    assert cuda["comm_bytes_per_step"]["pp"] == BATCH * SEQ * 64 * act_bytes + vocab * 64 * 4 + 4
    assert any("runs without CUDA graphs: the in-process communicator of virtual ranks" in line
               for line in lines), lines


@pytest.mark.training
@pytest.mark.parametrize("split", [{"tp": 2, "tp_classifier": "replicated"}, {"pp": 2, "grad_accum": 2},
                                   {"tp": 2, "tp_classifier": "replicated", "grad_compress": "powersgd",
                                    "powersgd_start_step": 1, "powersgd_rank": 2}])
def test_the_overlapped_sync_beside_model_parallelism_is_the_flat_syncs_bits(split):
    """dp 2 x tp 2 and dp 2 x pp 2 on four virtual ranks: the overlapped sync's buckets, reduced on the
    communication thread's stream and settled before each tensor-parallel all-reduce or pipeline transfer
    (parallel/ddp.py, one order of collectives on every rank), sum what the flat sync sums in the same order:
    the same losses and parameters to the bit. Also with PowerSGD on the data-parallel group (step 2 compressed,
    its factors through CuPy on the communication thread's stream)."""
    kw = dict(backend="cuda", world_size=4, steps=2, eval_batches=0, **split)
    flat = _train(grad_sync="flat", **kw)
    bucketed = _train(grad_sync="bucketed", bucket_mb=0.05, **kw)
    assert bucketed["losses"] == flat["losses"]
    assert bucketed["param_sha256"] == flat["param_sha256"]


@pytest.mark.parametrize("recompute", [0, 2])
def test_the_memory_checks_figures_are_the_arrays_the_model_keeps(be, rng, recompute):
    from test_memory import expected_arrays, saved_arrays

    config = model_config("tiny", 4096)
    model = GPT2(config, be, seed=int(rng.integers(0, 2**31)), recompute=recompute)
    ids = token_ids(rng, (B, T), 4096)
    model.forward(be.from_host(ids), be.from_host(token_ids(rng, (B, T), 4096)), dloss=1.0)
    assert saved_arrays(model) == expected_arrays(config, B, T, "standard", np.float32, recompute)
