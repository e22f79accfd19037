"""The CUDA backend in bf16 (--dtype bf16) against the numpy bf16 emulation, on a GPU (skipped without one).

Every op runs on the same bf16 inputs on both sides (host float32 data rounded once, to nearest even)
and is held to tests/bf16_cases.py's tolerance: a stored bf16 output within 1 bf16 ulp of the
emulation's plus a float32-sized absolute slack (2 ulps and 2^-7 of the largest magnitude where a
product reads a rounded intermediate), and norm-wise within 4e-4 plus one straddle (a misplaced or
missing rounding gives ~1.7e-3); float32 outputs within the fp32 tests' bounds.
tests/test_precision.py shows on the CPU that this tolerance admits another summation order and
rejects truncation, unrounded results and bf16-rounded attention scores. Inputs are fresh each run
(the seed is printed; XTRAIN_TEST_SEED replays it) and device allocations are filled with 0xFF bytes
(bf16 NaN) so an unwritten output fails.
"""

import subprocess
import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_device_memory")]  # conftest: skip without a GPU

import small_vocab  # noqa: E402
from bf16_cases import SHAPES, assert_bf16_close, cases, upload  # noqa: E402
from dropout_cases import DROPOUT_SHAPES, check_dropout_bitwise  # noqa: E402

from xtrain_dist.backend.cuda import attention as cuda_attention  # noqa: E402
from xtrain_dist.backend.cuda.ops import CudaBackend  # noqa: E402
from xtrain_dist.backend.numpy_ops import NumpyBackend, bf16_bits  # noqa: E402
from xtrain_dist.config import TrainConfig, model_config  # noqa: E402
from xtrain_dist.model import GPT2  # noqa: E402
from xtrain_dist.precision import bf16_ulp  # noqa: E402

REF = NumpyBackend("bf16")
REF_LT = NumpyBackend("bf16", epilogues=True)  # the twin of --matmul cublaslt
CASES = [(shape, case) for shape, dims in SHAPES.items() for case in cases(*dims)]


@pytest.fixture(scope="module")
def be():
    return CudaBackend(0, dtype="bf16")


def run_case(backend, case, host):
    return {name: backend.to_host(value) for name, value in case.run(backend, upload(backend, host)).items()}


@pytest.mark.parametrize("shape, kind, groups, group0", DROPOUT_SHAPES)
def test_dropout_is_bitwise_the_emulation(be, rng, shape, kind, groups, group0):
    """In bf16 the kept values are rounded once, after the product, as the emulation's store() rounds them."""
    check_dropout_bitwise(be, NumpyBackend("bf16"), rng, shape, kind, groups, group0)


# ---------------------------------------------------------------------------- every op

@pytest.mark.parametrize("shape, case", CASES, ids=[f"{shape}-{case.name}" for shape, case in CASES])
def test_every_bf16_op_matches_the_numpy_emulation(be, rng, shape, case):
    host = case.inputs(rng)
    want, got = run_case(REF, case, host), run_case(be, case, host)
    for name, kind in case.outputs.items():
        assert_bf16_close(got[name], want[name], kind, f"{case.name} {name}")


LT_CASES = [(shape, case) for shape, case in CASES
            if case.name.startswith("matmul") and "tied" not in case.name]  # the products with a bias


@pytest.mark.parametrize("shape, case", LT_CASES, ids=[f"{shape}-{case.name}" for shape, case in LT_CASES])
def test_cublaslt_epilogues_match_the_numpy_emulation(be_lt, rng, shape, case):
    """--matmul cublaslt: bf16 product + bf16 bias in the float32 accumulator, one rounding, as the
    emulation computes it (and as the default path's float32 product + add_bias does); the bias gradient in
    the weight gradient's product, float32. GELU and its derivative in the epilogue are held to what the
    epilogues compute (lt_emulation: the emulation's ops in float32, one rounding after GELU), within "lt":
    the kernel cuBLASLt picks for a small width may round once more (bf16_cases.py says what an H200 did)."""
    host = case.inputs(rng)
    want, got = run_case(REF, case, host), run_case(be_lt, case, host)
    kinds = dict(case.outputs)
    if "gelu" in case.name:
        epilogue = lt_emulation(case.name, upload(REF, host))
        want.update(epilogue)
        kinds.update(dict.fromkeys(list(epilogue) + (["pre"] if "pre" in kinds else []), "lt"))
    for name, kind in kinds.items():
        assert_bf16_close(got[name], want[name], kind, f"{case.name} {name} (cublaslt)")


def lt_emulation(name: str, a: dict) -> dict:
    """What cuBLASLt's GELU epilogues compute from bf16 inputs: the product (+ bias) in float32, GELU or its
    derivative applied to it before the one rounding to bf16 (FP32 is the emulation with no rounding)."""
    if name == "matmul_gelu_forward":
        return {"out": REF_LT.matmul_gelu_forward(a["x"], a["w"], a["b"])[1]}
    return {"dpre": REF_LT.matmul_backward_gelu(a["dw"].copy(), a["db"].copy(), a["dout"], a["x"], a["w"], a["pre"])}


@pytest.mark.parametrize("chunk", [16, 24])
def test_attention_in_causal_chunks_matches_the_numpy_emulation(be, rng, monkeypatch, chunk):
    """Standard attention's products run in chunks of query rows (cuda_attention._causal_chunks, 256 a chunk):
    with chunks of 16 and 24 rows, 4 and 3 of them at T = 64, forward and backward still meet bf16's bounds."""
    monkeypatch.setattr(cuda_attention, "CAUSAL_CHUNK", chunk)
    for case in cases(*SHAPES["B4-T64-C128"]):
        if case.name in ("attention_forward", "attention_backward"):
            host = case.inputs(rng)
            want, got = run_case(REF, case, host), run_case(be, case, host)
            for name, kind in case.outputs.items():
                assert_bf16_close(got[name], want[name], kind, f"{case.name} {name} (chunks of {chunk} rows)")


def unaligned_act(be, host):
    """A bf16 device copy of `host` that starts 2 bytes past a 16-byte boundary (scalar kernel paths)."""
    flat = be.from_host_act(np.concatenate([np.zeros(1, np.float32), np.asarray(host, np.float32).ravel()]))
    return flat[1:].reshape(np.shape(host))


def assert_rounded_within(got, want, f32_bound, what):
    """got is bf16 and within one bf16 ulp of want (a float32 result on either side of a rounding
    boundary) plus f32_bound (how far two correct float32 computations may differ before rounding)."""
    assert not np.any(got.view(np.uint32) & 0xFFFF), f"{what}: values that are not bfloat16"
    excess = np.abs(got.astype(np.float64) - want) - (bf16_ulp(want) + f32_bound)
    i = int(np.argmax(excess))
    assert excess[i] <= 0, f"{what}: element {i}: got {got[i]:.6g}, want {want[i]:.6g}"


@pytest.mark.parametrize("n", [1, 1001, 4 * 4096])
def test_elementwise_ops_on_unaligned_bf16_views(be, rng, n):
    x, d, y = (rng.standard_normal(n) * 2).astype(np.float32), rng.standard_normal(n), rng.standard_normal(n)
    x, d, y = (REF.from_host_act(a) for a in (x, d, y))
    put = lambda a: unaligned_act(be, a)  # noqa: E731
    # gelu: elementwise bounds in x, as test_cuda_ops' float32 test has, plus the one rounding to bf16.
    # 1 + tanh(u) cancels for x in about [-5.4, -4.2], where two correct tanhf's one ulp apart give -0 and
    # -1.6e-7; bf16_mismatch's slack is relative to the largest |want|, which at n = 1 is that element
    # itself, so its bounds failed there on correct kernels (0.27% of draws).
    assert_rounded_within(be.to_host(be.gelu_forward(put(x))), REF.gelu_forward(x), 1e-6 * (1 + np.abs(x)),
                          "gelu_forward")
    assert_rounded_within(be.to_host(be.gelu_backward(put(d), put(x))), REF.gelu_backward(d, x),
                          4e-6 * (1 + np.abs(x) ** 3) * np.maximum(1, np.abs(d)), "gelu_backward")
    assert_bf16_close(be.to_host(be.residual_forward(put(x), put(y))), REF.residual_forward(x, y), "act", "residual")


def test_host_round_trip_is_exact(be, rng):
    x = (rng.standard_normal(10_007) * 100).astype(np.float32)
    assert np.array_equal(be.to_host(be.from_host_act(x)), REF.from_host_act(x))
    assert be.from_host_act(x).dtype == np.uint16 and be.to_host(be.from_host_act(x)).dtype == np.float32


def test_a_product_is_never_added_to_a_bf16_output(be, rng):
    """cuBLAS rounds the product to bf16 before it adds a bf16 C (beta != 0), a second rounding the emulation
    does not make (seen on an H100: kernels/matmul.cu), so the backend refuses to ask for it."""
    a, b = (be.from_host_act(rng.standard_normal((8, 8))) for _ in range(2))
    out = be.from_host_act(rng.standard_normal((8, 8)))
    with pytest.raises(TypeError, match=r"^cuda_ops gemm: beta = 1\.0 into a bf16 output would round twice: "
                                        r"cuBLAS rounds the product to bf16 before it adds C$"):
        be._gemm(a, b, out, beta=1.0)


def test_float32_buffer_ops_of_a_bf16_backend(be, rng):
    """scale and bf16_round on a bf16 backend: gradients are float32 in every precision, so these launches
    must be sized by 4 floats per 16 bytes, not by the backend's 8 bf16 activations (a grid sized for 8
    elements a thread covers half the buffer). The fp32 tests cannot see that: there both are 4. n is odd,
    so the scalar tail runs too."""
    n = 10_001
    buf = rng.standard_normal(n).astype(np.float32)
    factor = np.float32(rng.uniform(0.1, 2.0))
    got = be.from_host(buf)
    be.scale(got, float(factor))
    assert np.array_equal(be.to_host(got), buf * factor), "scale"
    got, want = be.from_host(buf * 100), buf * 100
    be.bf16_round(got)
    REF.bf16_round(want)
    assert np.array_equal(be.to_host(got).view(np.uint32), want.view(np.uint32)), "bf16_round"


# ---------------------------------------------------------------------------- the bf16 weight copy

@pytest.mark.parametrize("n, offset", [(100_003, 0), (7, 0), (4099, 1)])
def test_adamw_writes_the_bf16_copy_in_its_pass(be, rng, n, offset):
    """The float32 update is numpy's (as in fp32); the bf16 copy is, bitwise, the rounding to nearest even
    of the updated float32 parameters. offset 1: a ZeRO-like shard that starts off the vector boundary."""
    params = (rng.standard_normal(n) * 0.02).astype(np.float32)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    lowp_host = np.zeros(n, np.float32)
    d_params, d_m, d_v = (be.from_host(np.concatenate([np.zeros(offset, np.float32), a]))[offset:]
                          for a in (params, m, v))
    d_lowp = be.from_host_act(np.concatenate([np.zeros(offset, np.float32), lowp_host]))[offset:]
    d_mask = be.from_host(mask)
    for step in range(1, 4):
        grads = (rng.standard_normal(n) * 0.1).astype(np.float32)
        coef = np.array([rng.uniform(0.5, 1.0)], np.float32)
        hyper = dict(step=step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        REF.adamw_update(params, grads, m, v, mask, grad_scale=coef, params_lowp=lowp_host, **hyper)
        be.adamw_update(d_params, be.from_host(grads), d_m, d_v, d_mask, grad_scale=be.from_host(coef),
                        params_lowp=d_lowp, **hyper)
    got_params = be.to_host(d_params)
    np.testing.assert_allclose(got_params, params, rtol=1e-6, atol=1e-9)
    assert np.array_equal(bf16_bits(be.to_host(d_lowp)), bf16_bits(got_params))


def test_lowp_copy_rounds_to_nearest_even_bitwise(be, rng):
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.3895314e38, -3.4e38, np.inf, -np.inf, 1e-40],
                       dtype=np.float32)
    ties = (np.arange(64, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    src = np.concatenate([special, ties, (rng.standard_normal(10_001) * 100).astype(np.float32)])
    for offset in (0, 1):
        dst = be.from_host_act(np.zeros(src.size + offset, np.float32))[offset:]
        be.lowp_copy(dst, be.from_host(src))
        assert np.array_equal(bf16_bits(be.to_host(dst)), bf16_bits(src))


def test_widen_copy_gives_back_every_bf16_value_exactly(be):
    """lowp_copy's way back (the tensor-parallel all-reduce sums in float32): every one of the 65536 bf16 bit
    patterns but the NaNs widens to the float32 with those upper bits, and the NaNs to NaNs (the hardware's
    conversion need not keep a NaN's payload), at an aligned and an unaligned start."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    want = (bits << 16).view(np.float32)
    for offset in (0, 1):
        src = be.from_host(np.concatenate([np.zeros(offset, np.uint16), bits.astype(np.uint16)]))[offset:]
        dst = be.from_host(np.full(src.size + offset, 7.0, np.float32))[offset:]
        be.widen_copy(dst, src)
        got, nan = be.to_host(dst), np.isnan(want)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), offset
        assert np.isnan(got[nan]).all(), offset


# ---------------------------------------------------------------------------- vocabulary-parallel (--tp)

@pytest.mark.parametrize("v, vp, n", [(45, 64, 4), (1000, 1024, 2)])
def test_vocabulary_parallel_ops_match_the_numpy_emulation(be, rng, v, vp, n):
    """The five vocab_* ops on every shard of Vp / N rows (45 of 64 in 4: a shard running past V into the
    padded rows, one of padded rows only; 1000 of 1024 in 2: the vector paths) against the emulation, on the
    same bf16 inputs and the same group maxima and sums: the embedding and dlogits as bf16 outputs, the
    gradients, sums and losses as float32 ones, the maxima exactly (a maximum of bf16 values)."""
    B, T, C = 3, 4, 36
    rows = vp // n
    ids, targets = (rng.integers(0, v, (B, T)).astype(np.int32) for _ in range(2))
    logits = np.concatenate([rng.standard_normal((B, T, v)) * 3.0, np.full((B, T, vp - v), 50.0)], -1)
    host = {"ids": (ids, "ids"), "targets": (targets, "ids"), "logits": (logits, "act"),
            "wte": (rng.standard_normal((vp, C)) * 0.02, "act"), "wpe": (rng.standard_normal((T + 3, C)) * 0.02, "act"),
            "dout": (rng.standard_normal((B, T, C)), "act"), "dwte": (rng.standard_normal((vp, C)), "f32"),
            "dwpe": (rng.standard_normal((T + 3, C)), "f32")}
    ref, dev = upload(REF, host), upload(be, host)

    def shard(a, k, axis):  # shard k's rows (axis 0) or columns (the last), a contiguous copy where `a` is
        part = a[k * rows:(k + 1) * rows] if axis == 0 else a[..., k * rows:(k + 1) * rows]
        return part.copy()

    for k in range(n):
        row0 = k * rows
        want = REF.vocab_encoder_forward(ref["ids"], shard(ref["wte"], k, 0), ref["wpe"], row0)
        got = be.vocab_encoder_forward(dev["ids"], shard(dev["wte"], k, 0), dev["wpe"], row0)
        assert_bf16_close(be.to_host(got), want, "act", f"vocab_encoder_forward shard {k}")
        want_wte, want_wpe = shard(ref["dwte"], k, 0), ref["dwpe"].copy()
        REF.vocab_encoder_backward(want_wte, want_wpe, ref["dout"], ref["ids"], row0)
        dwte, dwpe = shard(dev["dwte"], k, 0), dev["dwpe"].copy()
        be.vocab_encoder_backward(dwte, dwpe, dev["dout"], dev["ids"], row0)
        assert_bf16_close(be.to_host(dwte), want_wte, "f32", f"vocab_encoder_backward dwte shard {k}")
        assert_bf16_close(be.to_host(dwpe), want_wpe, "f32", f"vocab_encoder_backward dwpe shard {k}")

    shards = [(shard(ref["logits"], k, 2), shard(dev["logits"], k, 2), k * rows) for k in range(n)]
    maxes = [REF.vocab_max(r, v, col0) for r, _, col0 in shards]
    for (_, d, col0), want in zip(shards, maxes, strict=True):
        assert np.array_equal(be.to_host(be.vocab_max(d, v, col0)), want), f"vocab_max from column {col0}"
    group_max = np.max(maxes, axis=0)
    sums = [REF.vocab_sums(r, ref["targets"], group_max, v, col0) for r, _, col0 in shards]
    for (_, d, col0), want in zip(shards, sums, strict=True):
        got = be.vocab_sums(d, dev["targets"], be.from_host(group_max), v, col0)
        assert_bf16_close(be.to_host(got), want, "f32", f"vocab_sums from column {col0}")
    group_sums = np.sum(sums, axis=0)
    for r, d, col0 in shards:
        want_losses = REF.vocab_classifier(r, ref["targets"], group_max, group_sums, 1.0 / (B * T), v, col0)
        losses = be.vocab_classifier(d, dev["targets"], be.from_host(group_max), be.from_host(group_sums),
                                     1.0 / (B * T), v, col0)
        assert_bf16_close(be.to_host(losses), want_losses, "f32", f"vocab_classifier losses from column {col0}")
        assert_bf16_close(be.to_host(d), r, "act", f"vocab_classifier dlogits from column {col0}")


# ---------------------------------------------------------------------------- the whole model

def _model_step(backend, config, ids, targets, seed):
    model = GPT2(config, backend, seed=seed)
    losses = model.forward(backend.from_host(ids), backend.from_host(targets), dloss=1.0 / ids.size)
    model.backward()
    return float(np.mean(backend.to_host(losses))), backend.to_host(model.grads).astype(np.float64)


@pytest.mark.parametrize("backend", ["cuda", "numpy"])
def test_padded_vocabulary_rows_stay_zero_through_bf16_training(be, backend):
    """V = 1000 (wte 1024 rows) in bf16, on the GPU and in the numpy emulation: after AdamW steps the padded
    rows of the float32 master and of the bf16 copy, their gradient, m and v are +0.0 bit for bit."""
    from padded_vocab import assert_padded_rows_stay_zero

    assert_padded_rows_stay_zero(GPT2(model_config("tiny", 1000), be if backend == "cuda" else REF, seed=1))


@pytest.mark.parametrize("matmul", ["cublas", "cublaslt"])
def test_tiny_model_bf16_loss_and_gradients_match_numpy_bf16(be, rng, request, matmul):
    """The whole step against the emulation, and closer to it than bf16 is to fp32. A 1-ulp difference at
    one stored activation propagates through the layers, so whole-model gradients differ by much more than
    any one op: on the CPU, over 20 seeds, the emulation computing in float64 (a proxy for the GPU's other
    summation order) lands at most 0.41 (median 0.19) of the fp32 distance from it, and the loss moves
    < 4e-6 relative; the GPU's own float32 errors add about sqrt(2). A misplaced rounding makes the ratio
    about 1; the op tests above are the sharp check."""
    config = model_config("tiny", 4096)
    ids, targets = (rng.integers(0, 4096, (4, 64)).astype(np.int32) for _ in range(2))
    seed = int(rng.integers(0, 2**31))
    # the emulation of the path under test: with cublaslt, GELU and its derivative before the one rounding
    loss_ref, grads_ref = _model_step(REF_LT if matmul == "cublaslt" else REF, config, ids, targets, seed)
    loss_cu, grads_cu = _model_step(request.getfixturevalue("be_lt") if matmul == "cublaslt" else be, config, ids,
                                    targets, seed)
    _, grads_fp32 = _model_step(NumpyBackend("fp32"), config, ids, targets, seed)

    def dist(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    assert abs(loss_cu - loss_ref) <= 2e-5 * abs(loss_ref), (loss_cu, loss_ref)
    assert dist(grads_cu, grads_ref) < 0.8 * dist(grads_fp32, grads_ref), (dist(grads_cu, grads_ref),
                                                                           dist(grads_fp32, grads_ref))


# ---------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def corpus():
    return small_vocab.corpus()  # 512 ids: the simulator's time (tests/small_vocab.py)


def _train(corpus, **kw):
    from xtrain_dist.train.job import train

    # few steps of 4 x 16 tokens: each test compares runs (to the bit, or to the emulation within a bound that holds
    # at any size), and on the CPU simulator every token of every step costs (the classifier's softmax over the
    # vocabulary's logits a token the most); standard attention and cuBLAS: the paths these tests were written for,
    # not the GPU's defaults (tests/test_cudnn_attention.py has those)
    cfg = TrainConfig(**{"steps": 4, "batch": 4, "seq": 16, "model": "tiny", "seed": 3, "dtype": "bf16",
                         "attention": "standard", "matmul": "cublas", **kw}).resolved()
    return train(cfg, corpus, log=lambda line: None)


@pytest.mark.training
def test_bf16_ddp_two_virtual_ranks_match_one_rank_and_numpy(corpus):
    one = _train(corpus, backend="cuda", world_size=1)
    two = _train(corpus, backend="cuda", world_size=2)
    reference = _train(corpus, backend="numpy", world_size=1)
    for run in (two, reference):
        worst = np.max(np.abs(np.array(run["losses"]) - one["losses"]) / np.array(one["losses"]))
        assert worst < 1e-3, worst
    assert len(two["param_sha256"]) == 2 and len(set(two["param_sha256"])) == 1
    again = _train(corpus, backend="cuda", world_size=2)
    assert again["param_sha256"] == two["param_sha256"] and again["losses"] == two["losses"]


@pytest.mark.training
def test_bf16_ddp_with_cublaslt_follows_numpy_bf16_bitwise_reproducibly(corpus):
    """--matmul cublaslt in training: two virtual ranks, each with its own handle and workspace, follow the
    emulation, stay equal, and a second run gives the same bits (the heuristic's algorithms, once chosen
    per shape, are deterministic)."""
    runs = [_train(corpus, backend="cuda", world_size=2, matmul="cublaslt") for _ in range(2)]
    reference = _train(corpus, backend="numpy", world_size=1)
    np.testing.assert_allclose(runs[0]["losses"], reference["losses"], rtol=1e-3)
    assert len(runs[0]["param_sha256"]) == 2 and len(set(runs[0]["param_sha256"])) == 1
    assert runs[1]["param_sha256"] == runs[0]["param_sha256"] and runs[1]["losses"] == runs[0]["losses"]


@pytest.mark.training
@pytest.mark.parametrize("options", [{"zero": 1}, {"grad_sync": "bucketed", "bucket_mb": 0.05},
                                     {"zero": 1, "grad_sync": "bucketed", "bucket_mb": 0.05, "grad_accum": 2}])
def test_bf16_ddp_options_follow_numpy_bf16(corpus, options):
    cuda = _train(corpus, backend="cuda", world_size=2, steps=3, **options)
    numpy_run = _train(corpus, backend="numpy", world_size=2, steps=3, **options)
    np.testing.assert_allclose(cuda["losses"], numpy_run["losses"], rtol=1e-3)
    assert len(set(cuda["param_sha256"])) == 1


@pytest.mark.training
@pytest.mark.real_gpu
def test_the_command_line_trains_in_bf16_on_the_gpu():
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "40", "8", "64", "--backend", "cuda",
                          "--model", "tiny", "--dtype", "bf16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cuda backend, bf16," in out.stdout
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 40 and np.mean(losses[-5:]) < losses[0] - 0.5


# ---------------------------------------------------------------------------- flash attention

def _relative(got, want) -> float:
    return float(np.linalg.norm((got - want).ravel()) / np.linalg.norm(want.ravel()))


# (kernels, B, NH, T): flash_attention_mma.cu at several shapes, the WMMA kernels it replaced at two
FLASH_SHAPES = [("mma", 2, 3, 1), ("mma", 2, 3, 64), ("mma", 2, 3, 130), ("mma", 2, 3, 256), ("mma", 1, 1, 129),
                ("mma", 3, 2, 200), ("wmma", 2, 3, 130), ("wmma", 1, 2, 256)]


@pytest.mark.parametrize("kernels, B, NH, T", FLASH_SHAPES, ids=[f"{k}-{b}x{nh}x{t}" for k, b, nh, t in FLASH_SHAPES])
def test_flash_attention_matches_the_emulation_and_the_standard_path(be, rng, monkeypatch, kernels, B, NH, T):
    """kernels/flash_attention_mma.cu (and flash_attention.cu, the WMMA kernels bin/bench_attention races
    it against) against numpy_ops.flash_attention_* (the bf16 emulation of their online
    softmax, which rounds each key tile's unnormalised P as it enters P V): out and dqkv within the tolerance
    of outputs two roundings deep ("act2"), lse (float32, summed from rounded P) within bf16_cases' "lse"
    bounds. Backward runs from the oracle's out and lse on both sides, so that it is
    measured alone. Then the kernel's own chain against the GPU's standard path, which rounds elsewhere
    (~1e-3 apart; a wrong tile, mask or rescale is off by O(1)). T = 130 and 200 leave ragged last tiles
    (of keys, and of the 128-query blocks), T = 129 a block of one row past the first, T = 1 a tile of
    one row; NH = 1, 2, 3 and B = 1, 2, 3 place heads and sequences in the grid."""
    monkeypatch.setattr(be, "flash_kernels", kernels)
    C = NH * 64
    qkv = REF.from_host_act(rng.standard_normal((B, T, 3 * C)).astype(np.float32))
    dout = REF.from_host_act(rng.standard_normal((B, T, C)).astype(np.float32))
    out_ref, lse_ref = REF.flash_attention_forward(qkv, NH)
    dqkv_ref = REF.flash_attention_backward(dout, qkv, out_ref, lse_ref, NH)

    d_qkv, d_dout = be.from_host_act(qkv), be.from_host_act(dout)
    out, lse = be.flash_attention_forward(d_qkv, NH)
    out_h, lse_h = be.to_host(out), be.to_host(lse)
    assert_bf16_close(out_h, out_ref, "act2", "flash_attention_forward out")
    assert_bf16_close(lse_h, lse_ref, "lse", "flash_attention_forward lse")
    alone = be.flash_attention_backward(d_dout, d_qkv, be.from_host_act(out_ref), be.from_host(lse_ref), NH)
    assert_bf16_close(be.to_host(alone), dqkv_ref, "act2", "flash_attention_backward dqkv")

    dqkv_h = be.to_host(be.flash_attention_backward(d_dout, d_qkv, out, lse, NH))
    std_out, att = be.attention_forward(d_qkv, NH)
    std_dqkv = be.to_host(be.attention_backward(d_dout, d_qkv, att, NH))
    assert _relative(out_h, be.to_host(std_out)) < 1e-2
    assert _relative(dqkv_h, std_dqkv) < 2e-2

    # no atomics: the same inputs give the same bits
    again_out, again_lse = be.flash_attention_forward(d_qkv, NH)
    again = be.flash_attention_backward(d_dout, d_qkv, again_out, again_lse, NH)
    assert np.array_equal(be.to_host(again), dqkv_h) and np.array_equal(be.to_host(again_out), out_h)


@pytest.mark.training
def test_flash_attention_trains_like_the_emulation_and_the_standard_path(corpus, monkeypatch):
    """A model of 64-channel heads on 2 virtual ranks: --attention flash follows the numpy emulation of the
    same and the GPU's standard attention, with bitwise ranks. The heads are the small preset's; one layer of
    two of them (a preset of this test's own) costs the simulator a twentieth of small's six layers of six."""
    from xtrain_dist import config

    monkeypatch.setitem(config.PRESETS, "one-block-of-64-channel-heads", (1, 2, 128, 128))
    common = {"model": "one-block-of-64-channel-heads", "seq": 128, "batch": 2, "steps": 3,  # 128: two 64-row tiles
              "world_size": 2}
    flash = _train(corpus, backend="cuda", attention="flash", **common)
    emulated = _train(corpus, backend="numpy", attention="flash", **common)
    standard = _train(corpus, backend="cuda", **common)
    for other in (emulated, standard):
        np.testing.assert_allclose(flash["losses"], other["losses"], rtol=5e-3)
    assert len(set(flash["param_sha256"])) == 1


# ---------------------------------------------------------------------------- memory

@pytest.mark.parametrize("attention", ["standard", "flash"])
def test_the_memory_checks_figures_are_the_arrays_a_bf16_model_keeps(be, rng, attention):
    """memory.py counts what forward keeps for backward by dtype: on the GPU activations are 2 bytes and
    the layernorm statistics and flash's log-sum-exp 4, which numpy's float32 emulation cannot show."""
    from test_memory import expected_arrays, saved_arrays

    from xtrain_dist.config import GPTConfig
    config = GPTConfig(vocab_size=512, n_ctx=64, n_layer=2, n_head=2, n_embd=128)  # 64-channel heads: flash
    model = GPT2(config, be, seed=int(rng.integers(0, 2**31)), attention=attention)
    ids = rng.integers(0, 512, (2, 64)).astype(np.int32)
    model.forward(be.from_host(ids), be.from_host(np.roll(ids, -1, axis=1)), dloss=1.0)
    assert saved_arrays(model) == expected_arrays(config, 2, 64, attention, np.uint16)
