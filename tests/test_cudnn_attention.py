"""--attention cudnn: cuDNN's fused attention (backend/cuda/cudnn_sdpa.py) and the CUDA defaults it leads.

On a GPU the tests marked gpu run cuDNN itself; on the CPU simulator (XTRAIN_CUDASIM=1, how CI runs them
through tests/test_cudasim.py) they run tests/cudasim/fake_cudnn.py, which records the graph the backend
builds and computes numpy_ops' flash attention in bf16, so the plumbing (layouts, strides, UIDs, the
statistics forward hands backward, the stream, the capture) is held to the oracle to the bit there, and to
bf16 bounds on a GPU. The stand-in's functions are checked against the real package's (installed by the
test extra: a 3.4 MB wheel, importable without libcudnn or a GPU). The rest runs on any CPU: the choice of
the CUDA defaults, and the one-line refusals.
"""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cudasim"))

from xtrain_dist.backend.cuda import cudnn_sdpa, defaults  # noqa: E402
from xtrain_dist.errors import XtrainError  # noqa: E402

CUDASIM = os.environ.get("XTRAIN_CUDASIM") == "1"
if CUDASIM:  # the simulated machine has cuDNN for this module (conftest gives it none by default)
    import fake_cudnn

    fake_cudnn.install()


# ---------------------------------------------------------------------------- the defaults (any CPU)

def _choose(attention="auto", matmul="auto", dtype="bf16", head_size=64, table=None, loads=True):
    return defaults.choose(attention, matmul, dtype, head_size, table or {}, lambda: loads)


@pytest.mark.parametrize("dtype, head_size, loads, want", [
    ("bf16", 64, True, "cudnn"), ("bf16", 128, True, "cudnn"), ("bf16", 64, False, "flash"),
    ("bf16", 128, False, "standard"), ("bf16", 32, True, "standard"), ("fp32", 64, True, "standard")])
def test_the_default_attention_is_the_fastest_the_run_can_take(dtype, head_size, loads, want):
    choice = _choose(dtype=dtype, head_size=head_size, loads=loads)
    assert (choice.attention, choice.matmul) == (want, "cublaslt")
    assert choice.line("auto") == f"cuda: attention {want} (default on a GPU), matmul cublaslt (default on a GPU), " \
                                  "graphs on"


def test_what_is_given_stays_and_cudnn_is_not_asked_for_where_it_is_not_chosen():
    asked = []
    choice = defaults.choose("standard", "cublas", "bf16", 64, {}, lambda: asked.append(1) or True)
    assert (choice.attention, choice.matmul, asked) == ("standard", "cublas", [])
    assert choice.line("off") == "cuda: attention standard (given), matmul cublas (given), graphs off"


@pytest.mark.parametrize("tuned, loads, want", [
    ({"attention": "flash", "matmul": "cublas"}, True, ("flash", "cublas", "this GPU's tuning table")),
    ({"attention": "cudnn"}, False, ("flash", "cublaslt", "default on a GPU")),  # the table's choice cannot run
    ({"attention": "nonsense", "matmul": 3}, True, ("cudnn", "cublaslt", "default on a GPU"))])
def test_a_tuning_tables_defaults_section_wins_where_the_run_can_take_it(tuned, loads, want):
    choice = _choose(table={"defaults": tuned}, loads=loads)
    assert (choice.attention, choice.matmul, choice.attention_why) == want


def test_numpy_runs_keep_their_paths_and_say_nothing(tmp_path):
    from xtrain_dist.config import TrainConfig, model_config
    from xtrain_dist.train.preflight import resolve_auto

    cfg, line = resolve_auto(TrainConfig(steps=1, batch=1, seq=8), model_config("tiny", 256))
    assert (cfg.attention, cfg.matmul, line) == ("standard", "cublas", "")


# ---------------------------------------------------------------------------- one-line refusals (any CPU)

def test_a_missing_package_or_library_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    with pytest.raises(XtrainError, match=r"^--attention cudnn needs the nvidia-cudnn-frontend package \(module "
                                          r"cudnn\): pip install 'xtrain-dist\[cuda\]'$"):
        cudnn_sdpa.load()
    assert not cudnn_sdpa.loads()

    class NoLibrary:  # the frontend without libcudnn: its first call says so in a RuntimeError
        @staticmethod
        def backend_version():
            raise RuntimeError("Unable to find symbol cudnnGetVersion")

    monkeypatch.setitem(sys.modules, "cudnn", NoLibrary)
    with pytest.raises(XtrainError, match=r"^--attention cudnn needs libcudnn 9 \(the nvidia-cudnn-cu13 package\): "
                                          r"pip install 'xtrain-dist\[cuda\]' \(Unable to find symbol "
                                          r"cudnnGetVersion\)$"):
        cudnn_sdpa.load()


@pytest.mark.parametrize("dtype, head_size, message", [
    ("fp32", 64, r"^--attention cudnn needs --dtype bf16 \(cuDNN's fused attention takes 16-bit inputs, not "
                 r"float32; float32 runs use --attention standard\)$"),
    ("bf16", 32, r"^--attention cudnn needs heads of 64 or 128 channels; model 'tiny' has 32$")])
def test_what_cudnn_does_not_take_is_one_line(dtype, head_size, message):
    with pytest.raises(XtrainError, match=message):
        cudnn_sdpa.check_cudnn_attention(dtype, head_size, "tiny")


def test_the_command_line_refuses_cudnn_on_numpy_in_one_line():
    run = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "2", "32", "--attention", "cudnn"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("train_ddp: error: --attention cudnn runs cuDNN's attention on a "
                                                   "GPU: it needs --backend cuda, not numpy")


# ---------------------------------------------------------------------------- held to the real package

def _real_parameters(function) -> dict:
    """name -> default (inspect.Parameter.empty where none) of a function of the real module: a Python one's
    signature, or the first line of a pybind11 one's docstring ("name(self: ..., q: ..., x: bool = False)")."""
    try:
        return {name: p.default for name, p in inspect.signature(function).parameters.items()}
    except (TypeError, ValueError):
        pass
    text = function.__doc__.strip().splitlines()
    # an overloaded one's first line is "name(*args, **kwargs)": its first overload, "1. name(...)", is the one
    first = next(line for line in text if "(" in line and "*args" not in line)
    inside = first[first.index("(") + 1: first.rindex(")")]
    params, depth, current = [], 0, ""
    for ch in inside:  # split at top-level commas (types hold brackets)
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += ch
    params.append(current)
    found = {}
    for p in (p.strip() for p in params if p.strip()):
        name = re.match(r"\w+", p).group(0)
        found[name] = _Doc(p.split(" = ", 1)[1]) if " = " in p else inspect.Parameter.empty
    return found


class _Doc(str):
    """A default as a pybind11 docstring writes it: "False", "None", "'test_graph'", "<data_type.NOT_SET: 0>"."""


def _same_default(fake, real) -> bool:
    if real is inspect.Parameter.empty or fake is inspect.Parameter.empty:
        return real is fake
    if isinstance(real, _Doc):
        return real == repr(fake) or (hasattr(fake, "name") and real.startswith(f"<{type(fake).__name__}.{fake.name}:"))
    return real == fake or (hasattr(real, "name") and getattr(real, "name", None) == getattr(fake, "name", None))


def test_the_stand_in_has_the_real_packages_names_and_parameters():
    """Every function of fake_cudnn the backend calls, with the real module's parameter names and defaults;
    the enum members it names; the tensor methods it calls."""
    real = pytest.importorskip("cudnn")
    if getattr(real, "__name__", "") == "fake_cudnn":
        pytest.skip("the simulator's process: the real package is checked in a plain one")
    import fake_cudnn as fake

    assert real.__version__ == "1.25.0", real.__version__  # the version pyproject pins
    pairs = [(fake.pygraph.__init__, real.pygraph.__init__), (fake.pygraph.tensor, real.pygraph.tensor),
             (fake.pygraph.sdpa, real.pygraph.sdpa), (fake.pygraph.sdpa_backward, real.pygraph.sdpa_backward),
             (fake.pygraph.get_workspace_size, real.pygraph.get_workspace_size),
             (fake.pygraph.execute, real.pygraph.execute), (fake.pygraph.validate, real.pygraph.validate),
             (fake.tensor.set_data_type, real.tensor.set_data_type),
             (fake.create_handle, real.create_handle), (fake.set_stream, real.set_stream),
             (fake.backend_version, real.backend_version)]
    for mine, theirs in pairs:
        got, want = _real_parameters(mine), _real_parameters(theirs)
        for name, default in got.items():
            assert name in want, f"{mine.__qualname__}: the real one has no parameter {name!r} ({list(want)})"
            assert _same_default(default, want[name]), (mine.__qualname__, name, default, want[name])
    # build's heuristics list is positional in both (pybind11's arg0)
    assert "arg0: list[cudnn._compiled_module.heur_mode]" in real.pygraph.build.__doc__
    for method in ("set_output", "set_dim", "set_stride", "set_uid", "get_uid", "set_name"):
        assert hasattr(real.tensor, method), method
    for enum_name, members in (("data_type", ("BFLOAT16", "FLOAT", "NOT_SET")), ("heur_mode", ("A", "FALLBACK"))):
        for member in members:
            assert hasattr(getattr(real, enum_name), member), (enum_name, member)
    assert issubclass(real.cudnnGraphNotSupportedError, Exception)


# ---------------------------------------------------------------------------- the op (GPU or simulator)

def _backend():
    from xtrain_dist.backend.cuda.ops import CudaBackend

    return CudaBackend(0, dtype="bf16", flash_kernels="cudnn")


def _check(got, want, kind, what):
    """To the bit on the simulator (the stand-in computes the oracle); within bf16's bounds on a GPU, where
    cuDNN rounds where it rounds (bin/bench_attention measures by how much)."""
    import cupy

    if getattr(cupy, "cudasim", False):
        assert np.array_equal(got, want), f"{what}: max abs {np.abs(got - want).max():.3g}"
        return
    from bf16_cases import assert_bf16_close

    assert_bf16_close(got, want, "lse" if kind == "lse" else "act2", what)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, NH, hs", [(2, 80, 2, 64), (1, 64, 1, 128)])
def test_cudnn_attention_is_numpys_flash_attention(B, T, NH, hs):
    """Forward (out and the log-sum-exp statistics) and backward (dqkv, from forward's out and statistics)
    against numpy_ops' flash attention in bf16, at GPT-2's heads and at 128 channels, T not a multiple of 64;
    a rerun gives the same bits (forward, and the deterministic backward)."""
    from xtrain_dist.backend.numpy_ops import NumpyBackend

    be, ref = _backend(), NumpyBackend("bf16")
    rng = np.random.default_rng(7)
    C = NH * hs
    qkv = ref.store(rng.standard_normal((B, T, 3 * C)).astype(np.float32))
    dout = ref.store(rng.standard_normal((B, T, C)).astype(np.float32))
    want_out, want_lse = ref.flash_attention_forward(qkv, NH)
    d_qkv = be.from_host_act(qkv)
    out, lse = be.flash_attention_forward(d_qkv, NH)
    _check(be.to_host(out), want_out, "act", "out")
    _check(be.to_host(lse), want_lse, "lse", "lse")
    want_dqkv = ref.flash_attention_backward(dout, qkv, be.to_host(out), be.to_host(lse), NH)
    d_dout = be.from_host_act(dout)
    dqkv = be.flash_attention_backward(d_dout, d_qkv, out, lse, NH)
    _check(be.to_host(dqkv), want_dqkv, "act", "dqkv")
    again_out, again_lse = be.flash_attention_forward(d_qkv, NH)
    again = be.flash_attention_backward(d_dout, d_qkv, again_out, again_lse, NH)
    assert np.array_equal(be.to_host(again_out), be.to_host(out))
    assert np.array_equal(be.to_host(again), be.to_host(dqkv))
    assert len(be._cudnn._graphs) == 2  # one graph a direction, built once for the shape


@pytest.mark.gpu
def test_the_graph_reads_c_attns_rows_in_place_and_asks_for_what_the_oracle_is():
    """What the backend built (the simulator records it): q, k and v strided views of the (B, T, 3C) rows,
    no copy; causal, 1/sqrt(hs) in float32, statistics generated; the deterministic backward; bf16 inputs
    with float32 arithmetic."""
    import cupy

    if not getattr(cupy, "cudasim", False):
        pytest.skip("reads the simulator's record of the graph")
    be = _backend()
    B, T, NH, hs = 2, 64, 2, 64
    qkv = be.from_host_act(np.zeros((B, T, 3 * NH * hs), np.float32))
    out, lse = be.flash_attention_forward(qkv, NH)
    be.flash_attention_backward(be.from_host_act(np.zeros((B, T, NH * hs), np.float32)), qkv, out, lse, NH)
    (forward, _), (backward, _) = (be._cudnn._graphs[key] for key in sorted(be._cudnn._graphs, reverse=True))
    assert forward.op["kind"] == "sdpa" and backward.op["kind"] == "sdpa_backward"
    for graph in (forward, backward):
        assert graph.op["q"].stride == [T * 3 * NH * hs, hs, 3 * NH * hs, 1]
        assert graph.op["causal"] and graph.op["attn_scale"] == float(np.float32(1 / np.sqrt(hs)))
        assert graph.io_data_type.name == "BFLOAT16" and graph.compute_data_type.name == "FLOAT"
        assert [m.name for m in graph.heur_modes] == ["A", "FALLBACK"]
    assert forward.op["generate_stats"] and backward.op["deterministic"]
    assert backward.op["dQ"].stride == forward.op["q"].stride
    assert forward.op["o"].stride == [T * NH * hs, hs, NH * hs, 1]


@pytest.mark.gpu
def test_cudnn_attention_replays_from_a_cuda_graph():
    """Built on the first call, outside the capture; captured, the executions replay on the rank's stream
    with the bits of running them directly."""
    be = _backend()
    rng = np.random.default_rng(3)
    B, T, NH, hs = 1, 64, 2, 64
    qkv = be.from_host_act(rng.standard_normal((B, T, 3 * NH * hs)).astype(np.float32))
    dout = be.from_host_act(rng.standard_normal((B, T, NH * hs)).astype(np.float32))

    from xtrain_dist.train.graph import StepGraph

    results = {}

    def step():
        out, lse = be.flash_attention_forward(qkv, NH)
        results["out"], results["dqkv"] = out, be.flash_attention_backward(dout, qkv, out, lse, NH)

    failures = []
    graph = StepGraph(step, be.stream, on_failure=failures.append)  # as --cuda-graph auto runs a step
    assert graph() is False  # the first step, as usual: it builds both cuDNN graphs
    want = [be.to_host(results[key]) for key in ("out", "dqkv")]
    for _ in range(2):  # captured and launched, then launched again
        assert graph() is True, failures
        for key, w in zip(("out", "dqkv"), want, strict=True):
            assert np.array_equal(be.to_host(results[key]), w), key
    assert not failures


@pytest.mark.gpu
def test_cudnn_on_the_backend_without_the_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    with pytest.raises(XtrainError, match=r"^--attention cudnn needs the nvidia-cudnn-frontend package"):
        _backend()


@pytest.mark.gpu
@pytest.mark.training
def test_two_virtual_ranks_train_with_cudnn_attention_like_numpy_and_bitwise_alike():
    """A training step (small: 64-channel heads) at two virtual ranks with --attention cudnn: ranks end on
    the same bits, and the losses follow numpy's flash attention in bf16 (the same bits on the simulator)."""
    from small_vocab import corpus as small_vocab_corpus

    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train

    corpus = small_vocab_corpus()  # 512 ids: the simulator's time (tests/small_vocab.py)
    lines = []

    def run(**kw):
        cfg = TrainConfig(steps=2, batch=2, seq=32, model="small", seed=3, dtype="bf16", world_size=2, eval_batches=0,
                          **kw).resolved()
        return train(cfg, corpus, log=lines.append)

    cuda = run(backend="cuda", attention="cudnn", matmul="cublas", cuda_graph="off")
    assert len(cuda["param_sha256"]) == 2 and len(set(cuda["param_sha256"])) == 1
    assert "cuda: attention cudnn (given), matmul cublas (given), graphs off" in lines
    numpy_run = run(backend="numpy", attention="flash")
    np.testing.assert_allclose(cuda["losses"], numpy_run["losses"], rtol=2e-2)


def test_dropout_makes_auto_take_the_standard_attention():
    """The fused kernels never hold the probabilities --dropout drops, so auto is standard with it, the
    reason on the run's first line, even where cuDNN loads and a table asks for it."""
    choice = defaults.choose("auto", "auto", "bf16", 64, {"defaults": {"attention": "cudnn"}}, lambda: True, 0.1)
    assert (choice.attention, choice.attention_why) == ("standard", "--dropout needs it")
    assert _choose().attention == "cudnn"
