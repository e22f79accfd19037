"""Test-session setup, and the fixtures the GPU test modules share.

One BLAS thread per process. The tests run thread ranks on tiny matrices: several ranks each calling a
machine-wide OpenBLAS pool oversubscribe the cores, and on a busy 2-core machine that made a 5-step run
10-50x slower. The variable reaches the processes tests start; in this one numpy is imported above it
(imports come first), and OpenBLAS sizes its pool when it loads, so here the limit is set through
threadpoolctl. A training run sets its own share while it runs (numpy_ops.cpu_threads_per_rank). No
test depends on the thread count: results are compared within one process.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
threadpool_limits(1, user_api="blas")

# XTRAIN_CUDASIM=1: `import cupy` gives tests/cudasim's stand-in, which runs kernels/*.cu on the CPU,
# and `import nccl` one for rank threads of this process, so the GPU tests run without a GPU
# (tests/test_cudasim.py does this in a subprocess; tests/cudasim/README.md says what it checks).
CUDASIM = os.environ.get("XTRAIN_CUDASIM") == "1"
if CUDASIM:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cudasim"))
    import fake_cudnn
    import fake_cupy
    import fake_nccl

    fake_cupy.install()
    fake_nccl.install()
    # cuDNN's stand-in where asked (XTRAIN_CUDASIM_CUDNN=1, or a test module of --attention cudnn installs it),
    # else none: a simulated machine has cuDNN only where a test says so, installed here or not
    fake_cudnn.install() if os.environ.get("XTRAIN_CUDASIM_CUDNN") == "1" else fake_cudnn.block()


@pytest.fixture(autouse=True)
def _no_use_after_free_left():
    """On the simulator, an array a test dropped while another stream might still use it (see
    tests/cudasim/streams.py) fails that test, also when no operation came after to report it."""
    yield
    if CUDASIM:
        import gc

        import streams

        gc.collect()
        # what is alive now lives on past this test (modules, module-scoped fixtures): frozen out of the next
        # tests' collections, which then walk only what those tests made (walking the whole heap after each
        # was a third of test_cuda_ops.py's op tests' time on the simulator). A cycle among the frozen is never
        # collected; what they drop by reference count is still checked when it goes.
        gc.freeze()
        reports = streams.take_deferred()
        assert not reports, "\n".join(reports)


def pytest_configure(config):
    """Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE, as on the CI machine), every process
    a test starts compiled the package from source again: a quarter of a second of each of about 1500
    processes. The suite's first process compiles it once, beside the sources where Python itself would
    have put it; processes read bytecode whatever that variable says. Workers skip it (their controller did)."""
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):
        import compileall

        root = Path(__file__).resolve().parent.parent
        for folder in ("xtrain_dist", "tests"):
            compileall.compile_dir(root / folder, quiet=2, workers=1)
    if not hasattr(config, "workerinput"):
        _rewrite_test_modules_once(config)


def _rewrite_test_modules_once(config) -> None:
    """pytest rewrites the asserts of every test module it imports, and keeps the result beside it (a pyc of its
    own) unless Python is told not to write bytecode. pytest-xdist's workers each collect the whole suite at
    once, so on a fresh clone each rewrote all of it, as did every pytest a test starts (the simulator's, the
    GPU session's): 5 CPU-seconds a collection, 13 in all. The suite's first process writes those pycs once;
    every process reads them (pytest checks each against its source's hash), whatever that variable says.
    Through pytest's own functions, which are not public: where they are not what this expects, nothing is
    written and each process rewrites as before."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        if getattr(state, "mode", None) != "rewrite":
            return
        for source in sorted(Path(__file__).resolve().parent.glob("*.py")):
            if not (source.name.startswith("test_") or source.name == "conftest.py"):
                continue  # what pytest rewrites: test modules and conftest.py
            pyc = rewrite.get_cache_dir(source) / (source.stem + rewrite.PYC_TAIL)
            if rewrite._read_pyc(source, pyc) is None:
                pyc.parent.mkdir(exist_ok=True)
                source_hash, code = rewrite._rewrite_test(source, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
    except (ImportError, AttributeError, KeyError, TypeError, OSError):
        return


def pytest_report_header(config):
    if CUDASIM:
        return (f"cudasim: GPU tests run on the CPU simulator (tests/cudasim), "
                f"XTRAIN_CUDASIM_ORDER={os.environ.get('XTRAIN_CUDASIM_ORDER', 'forward')}")
    return None


def _gpu_usable() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is not loaded (-p no:xdist)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: two workers a core. Many tests wait more than they compute (processes starting, a peer's
    timeout, an MPI job's launch): with one worker a core the cores idled through those waits, about a fifth
    of a run on the 2-core machine; a second worker computes meanwhile."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(2 * cores, 16)


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run first, and tests marked `gpu` skip, each with the reason, where no CUDA device
    is usable."""
    # pytest-xdist hands tests out in this order as workers free up: a test of minutes started last would
    # leave the other workers idle while it ends the run; the simulator's (minutes each) go first of all
    items.sort(key=lambda item: (item.get_closest_marker("long") is None, item.path.name != "test_cudasim.py"))
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and CUDASIM:
        from xtrain_dist.backend.cuda import compile as cuda_compile

        for item in gpu_tests:
            if item.get_closest_marker("real_gpu"):
                item.add_marker(pytest.mark.skip(reason="needs a real GPU, not the CPU simulator"))

        fake_cupy.prebuild([(cuda_compile.kernel_source(f), cuda_compile.nvrtc_options(dtype))
                            for dtype in cuda_compile.PRECISIONS for f in cuda_compile.KERNELS])
    if gpu_tests and not _gpu_usable():
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="no usable CUDA device"))


def _made_once(tmp_path_factory, name: str, make):
    """make(folder) once for the whole run, shared by pytest-xdist's workers: the first to ask makes it under a
    lock, in a folder beside the workers' own (their common parent), and the others read what it returned
    (pickled). A fixture of module scope is made once per worker that runs one of its tests, and xdist_group
    cannot keep such tests on one worker under pytest 9 (xdist's group marks are lost, every test is its own
    group), so the module fixtures that cost tens of seconds (nvcc's builds, the benchmarks' runs) go through
    here. Without workers, make(folder) in the run's own temporary folder."""
    import fcntl
    import pickle
    import tempfile

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/popen-gwK: pytest-N is the run's
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{name}.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        # a folder of its own: where an earlier worker's make failed, what it left stays out of the way, and
        # this one fails on the same problem (not on a folder that already exists)
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=shared))
        value = make(folder)
        done.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def made_once(tmp_path_factory):
    """made_once(name, make): make(folder) once for the whole run, whichever worker asks first (_made_once)."""
    return lambda name, make: _made_once(tmp_path_factory, name, make)


@pytest.fixture
def built_models(monkeypatch) -> list:
    """Every GPT2 the training loop builds in this test (one per rank thread, in the order they are made), kept
    so that a test can compare what the ranks hold after a run."""
    from xtrain_dist.model import GPT2
    from xtrain_dist.train import loop

    models = []

    class Recorded(GPT2):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            models.append(self)

    monkeypatch.setattr(loop, "GPT2", Recorded)
    return models


@pytest.fixture
def rng():
    """A generator seeded from the clock, so every run draws fresh inputs (never zeros); the seed is
    printed, so a failure shows it, and XTRAIN_TEST_SEED=<seed> replays it. Modules that want a fixed
    stream define their own `rng`."""
    seed = int(os.environ.get("XTRAIN_TEST_SEED", time.time_ns() % 2**32))
    print(f"seed = {seed}  (replay: XTRAIN_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture
def unencodable_tokenizer(tmp_path) -> Path:
    """tmp_path/t.json: a WordLevel tokenizer knowing only "cat" and "mat", with no unknown-word token to fall
    back on, so encoding any other word ("dog") fails inside the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"cat": 0, "mat": 1}))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "t.json"))
    return tmp_path / "t.json"


@pytest.fixture
def real_cupy():
    """CuPy itself, for the tests that hold our code or the simulator's stand-in to it: a skip where it is
    not installed, or where the simulator stands in for it in this process."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    if getattr(cupy, "cudasim", False):
        pytest.skip("the CPU simulator stands in for CuPy in this process")
    return cupy


@pytest.fixture(scope="module")
def lt_backend(be):
    """A GPU test module's `be` made again with --matmul cublaslt (same device, dtype and TF32 choice), once
    per module; `be`'s stream is current again after it is made."""
    from xtrain_dist.backend.cuda.ops import CudaBackend

    backend = CudaBackend(be.device, allow_tf32=be.allow_tf32, dtype=be.dtype, matmul="cublaslt")
    be.stream.use()
    return backend


@pytest.fixture
def be_lt(be, lt_backend):
    """A GPU test module's --matmul cublaslt backend (`lt_backend`) with its stream current for the test,
    and the module's `be` stream again after it: each backend makes its own stream the thread's current one,
    and the backends check that their work goes there."""
    lt_backend.stream.use()
    yield lt_backend
    be.stream.use()


@pytest.fixture(scope="module")
def poisoned_device_memory(be):
    """While a GPU test module runs (after its `be` fixture has bound the device), every device
    allocation is filled with 0xFF bytes (NaN as float32), so an output element a kernel forgets to
    write fails the comparison instead of passing on stale memory."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def malloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(malloc)
    yield
    cupy.cuda.set_allocator(pool.malloc)
