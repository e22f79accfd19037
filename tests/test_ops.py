"""Every numpy op's backward against float64 central finite differences, and forwards against direct formulas.

The ops are dtype-generic, so the checks run them in float64 where finite differences are accurate
to ~1e-8; a wrong term in any backward shows up as an error of order 1.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from xtrain_dist.backend import numpy_ops as ops

EPS = 1e-6


def numeric_grad(f, x, dout, n_probe=40, rng=None):
    """d sum(f(x) * dout) / dx at n_probe random entries of x (all of them if x is small)."""
    rng = rng or np.random.default_rng(0)
    flat = x.reshape(-1)
    idx = np.arange(flat.size) if flat.size <= n_probe else rng.choice(flat.size, n_probe, replace=False)
    grads = {}
    for i in idx:
        keep = flat[i]
        flat[i] = keep + EPS
        up = np.sum(f() * dout)
        flat[i] = keep - EPS
        down = np.sum(f() * dout)
        flat[i] = keep
        grads[int(i)] = (up - down) / (2 * EPS)
    return grads


def assert_grad_close(analytic, numeric, rtol=1e-6, atol=1e-8):
    flat = analytic.reshape(-1)
    for i, value in numeric.items():
        assert flat[i] == pytest.approx(value, rel=rtol, abs=atol), f"entry {i}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_encoder_backward_matches_finite_differences(rng):
    B, T, C, V = 2, 5, 4, 7
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    ids[1, 3] = ids[0, 0]  # a token seen twice must get both rows
    wte, wpe = rng.standard_normal((V, C)), rng.standard_normal((8, C))
    dout = rng.standard_normal((B, T, C))
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    ops.encoder_backward(dwte, dwpe, dout, ids)
    f = lambda: ops.encoder_forward(ids, wte, wpe)  # noqa: E731
    assert_grad_close(dwte, numeric_grad(f, wte, dout))
    assert_grad_close(dwpe, numeric_grad(f, wpe, dout))
    assert np.all(dwpe[T:] == 0)


def test_encoder_backward_adds_a_repeated_token_in_order_as_np_add_at_does(rng):
    """encoder_backward adds element by element (numpy's fast path) what np.add.at adds row by row: float32
    addition is not associative, so a token seen many times, into a gradient that already holds the
    classifier's part, tells the orders apart; the same bits in each, and in the vocabulary-parallel shard."""
    B, T, C, V = 4, 32, 24, 9
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    ids[:, ::3] = 5  # 44 of token 5
    dout = (rng.standard_normal((B, T, C)) * 10.0 ** rng.integers(-4, 4, (B, T, 1))).astype(np.float32)
    start = rng.standard_normal((V, C)).astype(np.float32)
    want = start.copy()
    np.add.at(want, ids.reshape(-1), dout.reshape(-1, C))
    got, dwpe = start.copy(), np.zeros((T, C), np.float32)
    ops.encoder_backward(got, dwpe, dout, ids)
    assert got.tobytes() == want.tobytes()
    shard = start[4:].copy()
    ops.vocab_encoder_backward(shard, dwpe, dout, ids, row0=4)
    assert shard.tobytes() == want[4:].tobytes()
    pairwise = start.copy()  # ... which a different order would not give
    for v in range(V):
        pairwise[v] += dout.reshape(-1, C)[ids.reshape(-1) == v].sum(axis=0)
    assert pairwise.tobytes() != want.tobytes()


def test_layernorm_forward_is_normalised(rng):
    x = rng.standard_normal((3, 4, 16)) * 3 + 1
    out, mean, rstd = ops.layernorm_forward(x, np.ones(16), np.zeros(16))
    np.testing.assert_allclose(out.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(out.var(-1), 1, rtol=1e-4)  # eps 1e-5 makes it slightly below 1
    np.testing.assert_allclose(mean, x.mean(-1))
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(-1) + 1e-5))


def test_layernorm_backward_matches_finite_differences(rng):
    B, T, C = 2, 3, 8
    x, w, b = rng.standard_normal((B, T, C)), rng.standard_normal(C), rng.standard_normal(C)
    dout = rng.standard_normal((B, T, C))
    _, mean, rstd = ops.layernorm_forward(x, w, b)
    residual = rng.standard_normal((B, T, C))  # backward adds into what is already there
    dx, dw, db = residual.copy(), np.full(C, 0.5), np.full(C, -0.25)
    ops.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd)
    f = lambda: ops.layernorm_forward(x, w, b)[0]  # noqa: E731
    assert_grad_close(dx - residual, numeric_grad(f, x, dout))
    assert_grad_close(dw - 0.5, numeric_grad(f, w, dout))
    assert_grad_close(db + 0.25, numeric_grad(f, b, dout))


@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_backward_matches_finite_differences(rng, with_bias):
    B, T, IC, OC = 2, 3, 5, 6
    x, w = rng.standard_normal((B, T, IC)), rng.standard_normal((IC, OC))
    b = rng.standard_normal(OC) if with_bias else None
    dout = rng.standard_normal((B, T, OC))
    dw = np.zeros_like(w)
    db = np.zeros(OC) if with_bias else None
    dx = ops.matmul_backward(dw, db, dout, x, w)
    f = lambda: ops.matmul_forward(x, w, b)  # noqa: E731
    assert_grad_close(dx, numeric_grad(f, x, dout))
    assert_grad_close(dw, numeric_grad(f, w, dout))
    if with_bias:
        assert_grad_close(db, numeric_grad(f, b, dout))


def test_matmul_backward_into_transposed_weight_accumulates(rng):
    """The tied classifier passes wte.T and its gradient view dwte.T; the update must land in dwte."""
    V, C = 7, 4
    x, wte = rng.standard_normal((2, 3, C)), rng.standard_normal((V, C))
    dout = rng.standard_normal((2, 3, V))
    dwte = np.ones((V, C))
    ops.matmul_backward(dwte.T, None, dout, x, wte.T)
    expected = 1 + dout.reshape(-1, V).T @ x.reshape(-1, C)
    np.testing.assert_allclose(dwte, expected, rtol=1e-12)


def reference_attention(qkv, n_head):
    """Attention written the slow, obvious way: loops over batch, head and query position."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    out = np.zeros((B, T, C))
    for b in range(B):
        for h in range(n_head):
            q = qkv[b, :, h * hs:(h + 1) * hs]
            k = qkv[b, :, C + h * hs:C + (h + 1) * hs]
            v = qkv[b, :, 2 * C + h * hs:2 * C + (h + 1) * hs]
            for t in range(T):
                s = k[: t + 1] @ q[t] / math.sqrt(hs)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, h * hs:(h + 1) * hs] = p @ v[: t + 1]
    return out


def test_attention_forward_matches_loop_reference(rng):
    qkv = rng.standard_normal((2, 5, 3 * 8))
    out, att = ops.attention_forward(qkv, n_head=2)
    np.testing.assert_allclose(out, reference_attention(qkv, 2), rtol=1e-12, atol=1e-12)
    assert np.all(np.triu(att, k=1) == 0)  # causal: no weight on the future
    np.testing.assert_allclose(att.sum(-1), 1, rtol=1e-12)


def test_attention_backward_matches_finite_differences(rng):
    B, T, C, NH = 2, 4, 8, 2
    qkv = rng.standard_normal((B, T, 3 * C))
    dout = rng.standard_normal((B, T, C))
    _, att = ops.attention_forward(qkv, NH)
    dqkv = ops.attention_backward(dout, qkv, att, NH)
    f = lambda: ops.attention_forward(qkv, NH)[0]  # noqa: E731
    assert_grad_close(dqkv, numeric_grad(f, qkv, dout, n_probe=qkv.size))


@pytest.mark.parametrize("T", [6, 64, 150])
def test_flash_attention_is_the_same_function(rng, T):
    """Forward keeps each row's log-sum-exp instead of the probabilities and gives the same output;
    backward, from out and lse alone, gives the same gradient (both float64: to rounding). T = 150 takes
    forward's online softmax over three key tiles (the last of 22 columns), rescaling what the earlier
    ones summed."""
    B, C, NH = 2, 12, 3
    qkv = rng.standard_normal((B, T, 3 * C))
    dout = rng.standard_normal((B, T, C))
    out, att = ops.attention_forward(qkv, NH)
    flash_out, lse = ops.flash_attention_forward(qkv, NH)
    np.testing.assert_allclose(flash_out, out, rtol=1e-12, atol=1e-14)
    assert lse.shape == (B, NH, T)
    q, k, _ = qkv.reshape(B, T, 3, NH, C // NH).transpose(2, 0, 3, 1, 4)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // NH)
    mask = np.tril(np.ones((T, T), dtype=bool))
    np.testing.assert_allclose(lse, np.log(np.where(mask, np.exp(scores), 0).sum(-1)), rtol=1e-12)
    np.testing.assert_allclose(ops.flash_attention_backward(dout, qkv, flash_out, lse, NH),
                               ops.attention_backward(dout, qkv, att, NH), rtol=1e-10, atol=1e-12)


def test_flash_attention_backward_matches_finite_differences(rng):
    B, T, C, NH = 2, 4, 8, 2
    qkv = rng.standard_normal((B, T, 3 * C))
    dout = rng.standard_normal((B, T, C))
    out, lse = ops.flash_attention_forward(qkv, NH)
    dqkv = ops.flash_attention_backward(dout, qkv, out, lse, NH)
    f = lambda: ops.flash_attention_forward(qkv, NH)[0]  # noqa: E731
    assert_grad_close(dqkv, numeric_grad(f, qkv, dout, n_probe=qkv.size))


def test_gelu_matches_tanh_formula_and_finite_differences(rng):
    x = rng.standard_normal((3, 7)) * 3
    expected = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ops.gelu_forward(x), expected, rtol=1e-14)
    dout = rng.standard_normal(x.shape)
    assert_grad_close(ops.gelu_backward(dout, x), numeric_grad(lambda: ops.gelu_forward(x), x, dout, n_probe=x.size))


def test_crossentropy_matches_log_softmax(rng):
    logits = rng.standard_normal((2, 3, 11)) * 4
    targets = rng.integers(0, 11, (2, 3))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(ops.crossentropy_forward(logits, targets), expected, rtol=1e-12)


def test_fused_classifier_loss_and_gradient(rng):
    logits = rng.standard_normal((2, 3, 11)) * 4
    targets = rng.integers(0, 11, (2, 3))
    dloss = 0.37
    expected_losses = ops.crossentropy_forward(logits, targets)
    f_logits = logits.copy()
    f = lambda: ops.crossentropy_forward(f_logits, targets)  # noqa: E731
    numeric = numeric_grad(f, f_logits, np.full((2, 3), dloss), n_probe=logits.size)
    work = logits.copy()
    losses = ops.fused_classifier(work, targets, dloss)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)
    assert_grad_close(work, numeric)  # the logits buffer now holds dlogits


def test_fused_classifier_writes_the_gradient_into_a_strided_view(rng):
    """The classifier works on blocks of rows of a C-contiguous array; logits whose rows cannot be viewed so
    (here (T, B) transposed to (B, T)) get the same losses and the same dlogits, written into the view."""
    logits = (rng.standard_normal((2, 3, 40)) * 4).astype(np.float32)
    targets = rng.integers(0, 30, (2, 3))
    whole = logits.copy()
    want = ops.fused_classifier(whole, targets, 0.5, 30)
    view = np.ascontiguousarray(logits.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert np.array_equal(ops.fused_classifier(view, targets, 0.5, 30), want)
    assert np.array_equal(view, whole)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_classifier_reads_only_the_first_v_columns_and_zeroes_the_padded_gradient(rng, dtype):
    """Logits of a padded vocabulary (V = 1000 of Vp = 1024, model.py): the losses and dlogits of the first V
    columns are, bit for bit, those of a V-wide buffer, whatever the padded columns hold (here values that
    would dominate the softmax), and the padded columns' dlogits are exactly +0.0."""
    V, Vp = 1000, 1024
    real = (rng.standard_normal((2, 3, V)) * 4).astype(dtype)
    targets = rng.integers(0, V, (2, 3))
    padded = np.concatenate([real, np.full((2, 3, Vp - V), 50.0, dtype=dtype)], axis=-1)
    np.testing.assert_array_equal(ops.crossentropy_forward(padded, targets, V), ops.crossentropy_forward(real, targets))
    want_dlogits = real.copy()
    want = ops.fused_classifier(want_dlogits, targets, 0.37)
    losses = ops.fused_classifier(padded, targets, 0.37, V)
    np.testing.assert_array_equal(losses, want)
    np.testing.assert_array_equal(padded[..., :V], want_dlogits)
    assert not padded[..., V:].view(np.uint32 if dtype == np.float32 else np.uint64).any()
    with pytest.raises(IndexError):  # a target among the padded columns is no token: numpy refuses it
        ops.fused_classifier(padded, np.full((2, 3), V + 3), 0.37, V)


def test_fused_classifier_survives_extreme_logits():
    logits = np.array([[[1000.0, -1000.0, 0.0]]], dtype=np.float32)
    losses = ops.fused_classifier(logits, np.array([[1]]), 1.0)
    assert np.isfinite(losses).all() and losses[0, 0] == pytest.approx(2000.0)


def test_global_norm_and_clip_coefficient(rng):
    g = rng.standard_normal(1000).astype(np.float32)
    sq = ops.global_norm_squared(g)
    assert sq.shape == (1,) and sq.dtype == np.float32
    assert sq[0] == pytest.approx(np.sum(g.astype(np.float64) ** 2), rel=1e-6)
    norm = math.sqrt(sq[0])
    assert ops.clip_coefficient(sq, norm / 2)[0] == pytest.approx(0.5, rel=1e-5)
    assert ops.clip_coefficient(sq, norm * 2)[0] == 1.0
    assert ops.clip_coefficient(sq, 0.0)[0] == 1.0
    # torch.nn.utils.clip_grad_norm_'s max_norm / (norm + 1e-6): it shows at tiny norms, and a zero norm is 1
    assert ops.clip_coefficient(np.array([1e-12], np.float32), 1e-6)[0] == pytest.approx(0.5, rel=1e-5)
    assert ops.clip_coefficient(np.zeros(1, np.float32), 1.0)[0] == 1.0


def test_adamw_matches_torch_formula(rng):
    """Three steps against the update written as torch.optim.AdamW documents it, in float64. The clipping
    coefficient changes from step to step: Adam is blind to a gradient scale that never changes."""
    n = 50
    p = rng.standard_normal(n)
    mask = (np.arange(n) % 3 != 0).astype(np.uint8)
    m, v = np.zeros(n), np.zeros(n)
    p_ref, m_ref, v_ref = p.copy(), np.zeros(n), np.zeros(n)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    for step, clip in zip(range(1, 4), (0.5, 1.0, 0.1), strict=True):
        g = rng.standard_normal(n)
        ops.adamw_update(p, g, m, v, mask, step, lr, b1, b2, eps, wd, np.array([clip]))
        gs = g * clip
        p_ref = p_ref * (1 - lr * wd * mask)  # decoupled decay first, as torch does
        m_ref = b1 * m_ref + (1 - b1) * gs
        v_ref = b2 * v_ref + (1 - b2) * gs * gs
        denom = np.sqrt(v_ref) / math.sqrt(1 - b2**step) + eps
        p_ref = p_ref - lr / (1 - b1**step) * m_ref / denom
        np.testing.assert_allclose(p, p_ref, rtol=1e-6, atol=1e-9)


@pytest.fixture
def small_shares(monkeypatch):
    """Ops split over op_threads' threads at these tests' small sizes too (numpy_ops.PARALLEL_MIN), and the fused
    classifier into several blocks (numpy_ops.CLASSIFIER_BLOCK: 20 of the 1000-wide rows)."""
    monkeypatch.setattr(ops, "PARALLEL_MIN", 4096)
    monkeypatch.setattr(ops, "CLASSIFIER_BLOCK", 20_000)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunked_elementwise_ops_give_the_whole_array_bits(rng, threads, small_shares):
    """gelu (both ways) and AdamW run CHUNK elements at a time (numpy_ops.CHUNK), over op_threads' threads: on
    float32 arrays of a few chunks and a ragged tail, and on a transposed (non-contiguous) input, they give bit
    for bit what the same formulas give evaluated over whole arrays, at every thread count."""
    with ops.op_threads(threads):
        _check_chunked_elementwise_ops(rng)
        assert len(ops._pools) == (threads > 1)  # the blocks did run on a pool


def _check_chunked_elementwise_ops(rng):
    f = np.float32
    s, c = f(ops.GELU_SCALE), f(0.044715)
    rows = 2 * ops.CHUNK // 96 + 7
    for x, d in (((rng.standard_normal((rows, 96)) * 3).astype(np.float32), rng.standard_normal((rows, 96))),
                 ((rng.standard_normal((96, rows)) * 3).astype(np.float32).T, rng.standard_normal((rows, 96)))):
        d = d.astype(np.float32)
        assert np.array_equal(ops.gelu_forward(x), f(0.5) * x * (1 + np.tanh(s * (x + c * x * x * x))))
        x2 = x * x
        th = np.tanh(s * x * (1 + c * x2))
        whole = ((th + 1) * f(0.5) + f(0.5) * s * x * (1 + f(3) * c * x2) * (1 - th * th)) * d
        assert np.array_equal(ops.gelu_backward(d, x), whole)

    n = 2 * ops.CHUNK + 12345
    p, m, v = rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    mask = (np.arange(n) % 3 != 0).astype(np.uint8)
    p_ref, m_ref, v_ref = p.copy(), m.copy(), v.copy()
    lr, b1, b2, eps, wd, clip = f(1e-2), 0.9, 0.95, 1e-8, 0.1, np.array([0.5], np.float32)
    for step in range(1, 4):
        g = rng.standard_normal(n).astype(np.float32)
        ops.adamw_update(p, g, m, v, mask, step, lr, b1, b2, eps, wd, clip)
        gs = g * clip.reshape(())
        m_ref = f(b1) * m_ref + f(1 - b1) * gs
        v_ref = f(b2) * v_ref + f(1 - b2) * (gs * gs)
        update = (m_ref / f(1 - b1**step)) / (np.sqrt(v_ref / f(1 - b2**step)) + f(eps)) + f(wd) * mask * p_ref
        p_ref = p_ref - lr * update
        assert np.array_equal(p, p_ref) and np.array_equal(m, m_ref) and np.array_equal(v, v_ref), step


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_layernorm_in_row_blocks_gives_the_whole_array_bits(rng, threads, small_shares):
    """layernorm forward and backward run a block of rows at a time, over op_threads' threads: bit for bit the
    formulas over whole arrays (np.mean for the row means), in float32 and float64, on shapes of several
    blocks with a ragged last one and of a single small block."""
    for dtype, shape in ((np.float32, (3, 300, 384)), (np.float64, (2, 5, 7)), (np.float32, (5, 301, 128))):
        x, w, b, dout = (rng.standard_normal(s).astype(dtype) for s in (shape, shape[-1:], shape[-1:], shape))
        mean = x.mean(axis=-1, keepdims=True)
        norm = x - mean
        rstd = 1.0 / np.sqrt((norm * norm).mean(axis=-1, keepdims=True) + dtype(ops.LN_EPS))
        norm *= rstd
        out = norm * w + b
        g = dout * w
        dx = (g - g.mean(axis=-1, keepdims=True) - norm * (g * norm).mean(axis=-1, keepdims=True)) * rstd
        C = shape[-1]
        grads = [rng.standard_normal(s).astype(dtype) for s in (shape, (C,), (C,))]
        want = [grads[0] + dx, grads[1] + (dout * norm).reshape(-1, C).sum(axis=0),
                grads[2] + dout.reshape(-1, C).sum(axis=0)]
        with ops.op_threads(threads):
            got = ops.layernorm_forward(x, w, b)
            ops.layernorm_backward(*grads, dout, x, w, mean[..., 0], rstd[..., 0])
            assert len(ops._pools) == (threads > 1 and x.size >= 2 * ops.PARALLEL_MIN)
        for ours, theirs in zip((*got, *grads), (out, mean[..., 0], rstd[..., 0], *want), strict=True):
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_the_other_blocked_ops_give_the_same_bits_at_every_thread_count(rng, small_shares):
    """attention (forward and backward, blocks of sequences), the fused classifier and the residual add split
    their blocks over op_threads' threads: on shapes of several blocks, 2 and 3 threads give bit for bit what 1
    gives, in fp32 and emulated bf16."""
    qkv = rng.standard_normal((20, 64, 3 * 32)).astype(np.float32)  # 40 (T, T) matrices: 3 blocks
    dout = rng.standard_normal((20, 64, 32)).astype(np.float32)
    logits = (rng.standard_normal((3, 50, 1000)) * 3).astype(np.float32)
    targets = rng.integers(0, 990, (3, 50))
    a, b = (rng.standard_normal((3, 2 * ops.CHUNK // 64 + 5, 64)).astype(np.float32) for _ in range(2))
    for dtype in ("fp32", "bf16"):
        be = ops.NumpyBackend(dtype)
        seen = []
        for threads in (1, 2, 3):
            with ops.op_threads(threads):
                dlogits = logits.copy()
                losses = be.fused_classifier(dlogits, targets, 0.01, vocab_size=990)
                y, att = be.attention_forward(qkv, 2)
                seen.append((y, att, be.attention_backward(dout, qkv, att, 2), losses, dlogits,
                             be.residual_forward(a, b)))
                assert len(ops._pools) == (threads > 1)
        for other in seen[1:]:
            assert all(np.array_equal(x, y) for x, y in zip(seen[0], other, strict=True))


def test_bf16_round_is_torchs_round_to_nearest_even(rng):
    """Against torch's float32 -> bfloat16 -> float32, on random bit patterns (every exponent,
    subnormals, inf, NaN) and on the cases that decide the rule: exact ties go to the even neighbour,
    the largest floats round up to inf."""
    torch = pytest.importorskip("torch")
    one = np.float32(1.0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, 1.1754942e-38,
                        one + np.float32(2.0 ** -8),      # tie between 1 and 1 + 2^-7: to 1 (even)
                        one + np.float32(3 * 2.0 ** -8),  # tie between 1 + 2^-7 and 1 + 2^-6: to 1 + 2^-6 (even)
                        one + np.float32(2.0 ** -8 + 2.0 ** -20)], np.float32)  # just above the tie: up
    random_bits = rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, random_bits])
    ours = x.copy()
    with np.errstate(invalid="ignore"):
        ops.bf16_round(ours)
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])
    assert np.all(ours.view(np.uint32)[nan] == 0x7FC00000)
    assert list(ours[9:12]) == [1.0, 1.0 + 2.0 ** -6, 1.0 + 2.0 ** -7]
    assert np.all(ours.view(np.uint32) & 0xFFFF == 0)  # representable in bfloat16: widening is exact


def test_bf16_round_needs_float32():
    with pytest.raises(TypeError, match="bf16_round needs float32, got float64"):
        ops.bf16_round(np.zeros(3))


# ------------------------------------------------------------------ the heap (keep_freed_arrays)

FAULTS = r"""
import resource, sys
import numpy as np
from xtrain_dist.backend import get_backend
if sys.argv[1] == "backend":
    get_backend("numpy")
x = np.ones(1 << 20, np.float32)
y = x * 2; z = y + 1; del y, z                       # the first 4 MiB arrays: fresh pages either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    y = x * 2; z = y + 1; del y, z                   # what a step does: the same sizes, freed and made again
import xtrain_dist.backend.numpy_ops as ops
print(ops._heap_set, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ
                    or "MALLOC_TRIM_THRESHOLD_" in os.environ, reason="glibc's malloc, with its defaults")
def test_the_backend_reuses_the_pages_of_freed_arrays():
    """Twenty rounds of making and freeing two 4 MiB arrays: with glibc's defaults every round faults in
    fresh pages (about 20,000 here; importing the backend changes nothing), once the trainer has made
    its numpy backend none do; a user's MALLOC_* variables are left in charge."""
    def run(mode, **env):
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}).stdout.split()
        return out[0] == "True", int(out[1])

    heap_set, faults = run("plain")
    assert not heap_set and faults >= 20 * 2  # each fresh array faults (1024 pages of 4 KiB, or 2 huge pages)
    heap_set, faults = run("backend")
    assert heap_set and faults < 20  # none here; fewer than one a round allows for the interpreter's own
    assert run("backend", MALLOC_TRIM_THRESHOLD_="131072", MALLOC_MMAP_THRESHOLD_="131072")[0] is False


def test_causal_softmax_backward_matches_finite_differences(rng):
    """The oracle of the GPU's causal_softmax_backward (tests/test_cuda_ops.py compares the kernel to it), so
    it is checked on its own here: against causal_softmax by finite differences, zero above the diagonal."""
    scores = rng.standard_normal((2, 2, 5, 5)) * 2
    datt = rng.standard_normal(scores.shape)
    got = ops.causal_softmax_backward(datt, ops.causal_softmax(scores))
    assert_grad_close(got, numeric_grad(lambda: ops.causal_softmax(scores), scores, datt, n_probe=scores.size))
    assert np.all(np.triu(got, k=1) == 0)


def test_softmaxes_survive_scores_far_outside_exps_range(rng):
    """float32 scores of several hundred (exp overflows past 88): the row maximum comes out before exp, so
    causal_softmax, both attentions (forward and backward) and crossentropy_forward give the float64 loop
    reference's finite values, not inf/inf = NaN or a log-sum-exp of inf."""
    B, T, C, NH = 1, 4, 8, 2
    qkv = (rng.standard_normal((B, T, 3 * C)) * 25).astype(np.float32)  # |q.k| / sqrt(hs) up to ~1000
    want = reference_attention(qkv.astype(np.float64), NH)
    out, att = ops.attention_forward(qkv, NH)
    flash_out, lse = ops.flash_attention_forward(qkv, NH)
    for got in (out, flash_out):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.isfinite(lse).all() and np.abs(lse).max() > 200  # the scores really are out of exp's range
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    dqkv = ops.attention_backward(dout, qkv, att, NH)
    assert np.isfinite(dqkv).all()
    np.testing.assert_allclose(ops.flash_attention_backward(dout, qkv, flash_out, lse, NH), dqkv,
                               rtol=1e-3, atol=1e-3 * np.abs(dqkv).max())

    scores = np.array([[[500.0, 0.0], [300.0, 301.0]]], np.float32)  # row 0 sees one key, row 1 two
    np.testing.assert_allclose(ops.causal_softmax(scores)[0], [[1, 0], [1 / (1 + math.e), 1 / (1 + 1 / math.e)]],
                               rtol=1e-6)
    logits = np.array([[[1000.0, -1000.0, 0.0], [-500.0, -499.0, -600.0]]], np.float32)
    np.testing.assert_allclose(ops.crossentropy_forward(logits, np.array([[1, 1]])),
                               [[2000.0, math.log(1 + math.exp(-1) + math.exp(-101))]],
                               rtol=1e-6, atol=1e-4)  # float32: the difference of two values near -500


def test_global_norm_squared_is_the_rounded_exact_sum(rng):
    """float32 squares summed in float64, as kernels/global_norm.cu does: the result is the float32 nearest
    the exact sum (math.fsum). Gradients with a few large entries among many small ones: a float32 partial
    sum of 1.0 drops each small square (~2^-24) added to it, so float32 summation is off here."""
    n = 1 << 20
    g = (rng.standard_normal(n) * 2.0 ** -12).astype(np.float32)
    g[np.arange(n) % 128 < 8] = 1.0
    exact = math.fsum(np.square(g).astype(np.float64))
    assert ops.global_norm_squared(g)[0] == np.float32(exact)


def test_global_norm_squared_is_numpys_float64_sum_bit_for_bit(rng):
    """global_norm_squared sums a CHUNK at a time as numpy's np.sum(np.square(g), dtype=np.float64) does over
    the whole array (its cast buffers' pairwise sums, added in order): the same bits on ragged lengths
    of a few chunks and on squares spread over many binades, where another order would round differently."""
    for n in (1, 8191, 8193, 2 * ops.CHUNK + 3 * 8192 + 5):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
        want = np.sum(np.square(g), dtype=np.float64).reshape(1).astype(np.float32)
        assert ops.global_norm_squared(g).tobytes() == want.tobytes(), n


def test_adamw_schedule_in_memory_gives_the_same_bits(rng):
    """The step's lr and bias corrections read from a schedule array (what a captured step reads) update
    bit for bit as passing step and lr does; passing both ways at once is an error."""
    n = 1000
    mask = (np.arange(n) % 3 != 0).astype(np.uint8)
    start = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    clip = np.array([0.7], np.float32)
    runs = []
    for from_memory in (False, True):
        p, m, v = start.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        for step, g in enumerate(grads, start=1):
            if from_memory:
                ops.adamw_update(p, g, m, v, mask, None, None, 0.9, 0.95, 1e-8, 0.1, clip,
                                 schedule=ops.adamw_schedule(step, 3e-3 * step, 0.9, 0.95))
            else:
                ops.adamw_update(p, g, m, v, mask, step, 3e-3 * step, 0.9, 0.95, 1e-8, 0.1, clip)
        runs.append((p, m, v))
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    with pytest.raises(ValueError, match=r"^adamw_update: step and lr are in the schedule; pass them as None$"):
        ops.adamw_update(p, grads[0], m, v, mask, 1, None, 0.9, 0.95, 1e-8, 0.1, clip,
                         schedule=ops.adamw_schedule(1, 1e-3, 0.9, 0.95))
    assert ops.adamw_schedule(3, 0.1, 0.9, 0.95).tolist() == [np.float32(0.1), np.float32(1 - 0.9 ** 3),
                                                            np.float32(1 - 0.95 ** 3)]
