"""Every kernels/*.cu compiles, without a GPU: under nvcc (a cubin for sm_90, warnings as errors, ptxas's
resource report) and under NVRTC exactly as the backend compiles it at run time (backend/cuda/compile.py),
for sm_80 and sm_90.

Both precisions are compiled with the options CudaBackend loads them with for each --dtype
(compile.PRECISIONS: float32, and bfloat16 with -DXTRAIN_BF16), warnings as errors. nvcc compiles for
sm_90 alone: sm_80 is NVRTC's to check, the compiler the backend runs; nvcc's PTX for it was the same
front end run again (35 CPU-seconds a run).
nvcc and NVRTC differ (NVRTC has no host headers, its own defaults and the options CuPy adds), so
passing one says little about the other.

The NVRTC tests need `cuda-bindings` (the Python binding) and `nvidia-cuda-nvrtc` (libnvrtc), both
from PyPI, no GPU or driver; the bf16 variant also needs the CUDA runtime headers (a toolkit, or the
`nvidia-cuda-runtime` wheel), found by cuda.pathfinder. The last compile goes through CuPy itself
(its include options, its NVRTC call), so the headers are the ones CuPy would use on a GPU machine with
the same packages. Each part skips when its tool is missing; the [test] extra installs them all, with
the CUDA headers as pip wheels, the layout `pip install -e '.[cuda]'` gives.

Then how the backend loads them: a file is compiled when one of its kernels is first used, and a missing
CUDA header is one line naming the package to install.
"""

import io
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest

from xtrain_dist.backend.cuda import attention as cuda_attention
from xtrain_dist.backend.cuda import compile as cuda_compile
from xtrain_dist.backend.cuda import ops as cuda_ops
from xtrain_dist.errors import XtrainError
from xtrain_dist.precision import DTYPES

KERNEL_DIR = cuda_compile.KERNEL_DIR
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")  # NVRTC, as CuPy compiles on an A100 and on an H100/H200
NVCC_ARCHS = ("sm_90",)
WORKERS = 4  # nvcc is mostly one process per file; 4 threads keep 2 cores busy through I/O waits

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _entry_points(text: str) -> set[str]:
    return set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(', text))


def test_every_dtype_has_a_kernel_variant():
    """--dtype's choices are exactly the variants the backend compiles; bf16's define reaches the source."""
    assert set(cuda_compile.PRECISIONS) == set(DTYPES) == set(cuda_ops.ACT_DTYPES)
    assert cuda_compile.nvrtc_options("bf16") == (*cuda_compile.NVRTC_OPTIONS, "-DXTRAIN_BF16")
    assert "#if defined(XTRAIN_BF16)" in cuda_compile.kernel_source("gelu")


def test_kernel_table_matches_the_sources():
    """compile.KERNELS names every .cu file and exactly the extern "C" kernels each defines."""
    assert {p.stem for p in SOURCES} == set(cuda_compile.KERNELS)
    for path in SOURCES:
        assert _entry_points(path.read_text()) == set(cuda_compile.KERNELS[path.stem]), path.name


def test_the_kernel_table_and_launch_constants_are_read_from_the_files(tmp_path, monkeypatch):
    """A kernel is an extern "C" definition starting a line, wherever it is (a mention in a comment is
    not); a launch constant is a namespace-scope constexpr int, evaluated through the constants it names
    and common.cuh's, and one that is missing, repeated or not plain arithmetic is an error naming it."""
    (tmp_path / "common.cuh").write_text("constexpr int WARP_SIZE = 32;\n")
    (tmp_path / "demo.cu").write_text(
        '#include "common.cuh"\n'
        "constexpr int DEMO_ROWS = 4;\n"
        "constexpr int DEMO_BLOCK = DEMO_ROWS * WARP_SIZE;\n"
        "constexpr int DEMO_CAST = (int)sizeof(float);\n"
        "template <int N> __device__ void impl() { constexpr int DEMO_ROWS = N; }\n"
        '// extern "C" __global__ void retired(int n) {}\n'
        'extern "C" __global__ void first(int n) {}\n'
        'extern "C" __global__ void __launch_bounds__(DEMO_BLOCK) second(\n    int n) {}\n')
    monkeypatch.setattr(cuda_compile, "KERNEL_DIR", tmp_path)
    assert cuda_compile.kernel_table() == {"demo": ("first", "second")}
    assert cuda_compile.kernel_constant("demo", "DEMO_BLOCK") == 128
    with pytest.raises(ValueError, match=r"^kernels/demo\.cu defines constexpr int DEMO_COLS 0 times, not once$"):
        cuda_compile.kernel_constant("demo", "DEMO_COLS")
    with pytest.raises(ValueError, match=r"^kernels/demo\.cu: constexpr int DEMO_CAST = \(int\)sizeof\(float\): "):
        cuda_compile.kernel_constant("demo", "DEMO_CAST")


def test_kernel_source_inlines_local_includes():
    for file in cuda_compile.KERNELS:
        text = cuda_compile.kernel_source(file)
        assert '#include "' not in text, file
        assert "constexpr int WARP_SIZE" in text, file  # common.cuh is in
        assert f'#line 1 "{file}.cu"' in text


def test_both_flash_attention_kernels_take_the_oracles_tiles():
    """numpy_ops' flash attention is the oracle of both kernel files because it takes the keys in tiles of
    the width they take them (its online softmax rounds each tile's P) and their head size."""
    from xtrain_dist.backend import numpy_ops

    assert cuda_attention.FLASH_TILE == cuda_attention.MMA_TILE == numpy_ops.FLASH_TILE == 64
    assert cuda_attention.FLASH_HS == cuda_attention.MMA_HS == 64
    assert cuda_attention.MMA_BLOCK_ROWS % cuda_attention.MMA_TILE == 0  # a query block ends on a key tile's edge


# ---------------------------------------------------------------------------------------- nvcc

def _nvcc(path: Path, arch: str, dtype: str, out_dir: str) -> tuple[str, int, str, str]:
    """Compile one file for one architecture and dtype, warnings as errors; (command, exit status, log, PTX).
    It goes on to a cubin with ptxas's resource report in the log (-Xptxas -v), its PTX kept: one compile
    serves both tests below, as the front end is most of an nvcc run."""
    work = Path(out_dir) / f"{path.stem}-{arch}-{dtype}"
    work.mkdir()
    target = ["--cubin", "-Xptxas", "-v", "--keep", "--keep-dir", str(work), "-o", str(work / "k.cubin")]
    cmd = [NVCC, "-std=c++17", f"-arch={arch}", "-Werror", "all-warnings", f"-I{KERNEL_DIR}",
           *cuda_compile.PRECISIONS[dtype], *target, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    ptx = (work / f"{path.stem}.ptx").read_text() if proc.returncode == 0 else ""
    return " ".join(cmd), proc.returncode, proc.stdout + proc.stderr, ptx


NVCC_JOBS = [(path, arch, dtype) for path in SOURCES for arch in NVCC_ARCHS for dtype in cuda_compile.PRECISIONS]


@pytest.fixture(scope="module")
def nvcc_builds(made_once):
    """Every file for every architecture and dtype, compiled once for the two tests below, whichever worker runs
    them (conftest's made_once)."""
    def build(folder):
        with ThreadPoolExecutor(WORKERS) as pool:
            return list(pool.map(lambda job: _nvcc(*job, str(folder)), NVCC_JOBS))
    return made_once("nvcc-builds", build)


@needs_nvcc
@pytest.mark.long
def test_every_kernel_compiles_with_nvcc(nvcc_builds):
    # ptxas's resource report is the log of a clean sm_90 build: the warnings are the rest
    report = re.compile(r"ptxas info\s*:|\s+\d+ bytes stack frame|\s*$")
    failures = [f"$ {cmd}\n{log}" for cmd, rc, log, _ in nvcc_builds
                if rc != 0 or not all(report.match(line) for line in log.splitlines())]
    assert not failures, "\n\n".join(failures)
    for (path, _, dtype), (cmd, _, _, ptx) in zip(NVCC_JOBS, nvcc_builds, strict=True):
        entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
        assert entries == set(cuda_compile.KERNELS[path.stem]), f"{cmd}: entry points {sorted(entries)}"
        # the bf16 variant stores bf16 (round-to-nearest conversions); the fp32 one never converts
        if path.stem in ("gelu", "adamw", "attention"):
            assert ("cvt.rn.bf16.f32" in ptx) == (dtype == "bf16"), cmd


@needs_nvcc
def test_kernels_do_not_spill_on_sm90(nvcc_builds):
    """ptxas's resource report: no kernel may use a stack frame or spill registers to local memory
    (a register array indexed at run time, or too much live state, would show up here first)."""
    reports = [(f"{path.name} ({dtype})", log) for (path, arch, dtype), (_, _, log, _) in zip(NVCC_JOBS, nvcc_builds,
                                                                                             strict=True)
               if arch == "sm_90"]
    assert len(reports) == len(SOURCES) * len(cuda_compile.PRECISIONS)
    bad = []
    for name, text in reports:
        spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
        assert spills, f"{name}: no resource report\n{text}"
        if any(int(frame) or int(stores) or int(loads) for frame, stores, loads in spills):
            bad.append(f"{name}:\n{text}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------- NVRTC

def _nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # the binding loads libnvrtc lazily
        pytest.skip(f"libnvrtc cannot be loaded ({e}); pip install nvidia-cuda-nvrtc")
    return nvrtc


def _cuda_include() -> str | None:
    """The CUDA runtime headers, found the way CuPy finds them for RawModule."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    return find_nvidia_header_directory("cudart")


def _nvrtc_compile(nvrtc, file: str, options: tuple[str, ...]) -> tuple[bool, str]:
    source = cuda_compile.kernel_source(file).encode()
    err, prog = nvrtc.nvrtcCreateProgram(source, f"{file}.cu".encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # a mutable buffer: NVRTC writes into it, and `b" " * 1` is CPython's shared one-byte object,
        # which would then hold NUL everywhere a b" " is used in this process
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        ok = err == nvrtc.nvrtcResult.NVRTC_SUCCESS
        return ok, log.decode(errors="replace").strip("\x00 \n")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _cupy_compiles() -> bool:
    """Whether the real CuPy (not the simulator's stand-in) can assemble its NVRTC options here."""
    try:
        import cupy
        from cupy._core import core
    except ImportError:
        return False
    if getattr(cupy, "cudasim", False):
        return False
    try:
        core.assemble_cupy_compiler_options(cuda_compile.nvrtc_options(DTYPES[0]))
    except Exception:
        return False
    return True


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_compiles_with_nvrtc_as_cupy_does(dtype):
    """What CudaBackend(dtype=...) loads: compile.py's source text and options for that dtype, plus what
    CuPy's RawModule appends (-ftz=true, --device-as-default-execution-space, -arch=sm_XX for a cubin,
    the CUDA include path). Any warning fails it: NVRTC prints nothing for a clean compile. (NVRTC 13.0,
    the GPU image's, has no warnings-as-errors option: -Werror=all-warnings came later, and 13.0 refuses
    every kernel with "unrecognized option".) Where CuPy is installed, the next test compiles the same
    files through CuPy's own code, its options assembled by CuPy rather than copied here, and this one
    would repeat it: it is for a machine with the NVRTC binding and no CuPy."""
    if _cupy_compiles():
        pytest.skip("CuPy is installed: its own NVRTC pipeline compiles every kernel below")
    nvrtc = _nvrtc()
    include = _cuda_include()
    if dtype == "bf16" and include is None:
        pytest.skip("the bf16 variant includes cuda_bf16.h and no CUDA headers were found")
    extra = (f"-I{include}",) if include else ()
    jobs = [(file, arch) for file in cuda_compile.KERNELS for arch in ARCHS]

    def compile_one(job):
        file, arch = job
        options = (cuda_compile.nvrtc_options(dtype) + cuda_compile.CUPY_ADDED_OPTIONS
                   + (f"-arch={arch}", *extra))
        ok, log = _nvrtc_compile(nvrtc, file, options)
        return file, arch, options, ok, log

    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(compile_one, jobs))
    # a warning is a failure too: NVRTC prints nothing for a clean compile
    failures = [f"{file} {arch} {' '.join(options)}:\n{log}" for file, arch, options, ok, log in results
                if not ok or log]
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------------- CuPy's own pipeline

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.long
def test_every_kernel_compiles_through_cupys_own_nvrtc_pipeline(dtype, monkeypatch, real_cupy):
    """What RawModule.get_function does on a GPU, run by CuPy's own code up to the cubin: its include
    options (its headers, CCCL, and the CUDA headers beside the libnvrtc it loads: on a pip install,
    site-packages/nvidia/cu13/include), -ftz=true, then compile_using_nvrtc's -arch=sm_XX and
    --device-as-default-execution-space. The device it would ask for the architecture is replaced by
    sm_80 and sm_90. This is how a pip install without the CUDA crt headers was found to fail the bf16
    flash-attention file (crt/mma.h), which the toolkit-header compile above could not show."""
    from cupy._core import core
    from cupy.cuda import compiler

    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    ours = cuda_compile.nvrtc_options(dtype)  # outside the try: a bug in our options must fail, not skip
    try:
        options = (*core.assemble_cupy_compiler_options(ours), "-ftz=true")
    except Exception as e:  # no CUDA headers or NVRTC where CuPy looks
        pytest.skip(f"CuPy cannot assemble its NVRTC options here: {e}")

    def compile_one(job):
        file, arch = job
        log = io.StringIO()
        try:
            binary, _ = compiler.compile_using_nvrtc(cuda_compile.kernel_source(file), options=options, arch=arch[3:],
                                                     filename=f"{file}.cu", log_stream=log, cache_in_memory=True)
        except Exception as e:
            return f"{file} {arch}: {type(e).__name__}: {e}"
        if log.getvalue().strip():  # a warning fails it too
            return f"{file} {arch}: {log.getvalue()}"
        return None if binary else f"{file} {arch}: empty cubin"

    with ThreadPoolExecutor(WORKERS) as pool:
        failures = [f for f in pool.map(compile_one, [(f, a) for f in cuda_compile.KERNELS for a in ARCHS]) if f]
    assert not failures, "\n\n".join(failures)


class _RecordingModule:
    """A stand-in for cupy.RawModule that records compiles and can fail like NVRTC."""
    made: ClassVar[list] = []
    fail_with: ClassVar[str | None] = None

    def __init__(self, code, options):
        self.file = re.search(r'#line 1 "(\w+)\.cu"', code).group(1)
        _RecordingModule.made.append((self.file, options))

    def get_function(self, name):
        if _RecordingModule.fail_with:
            raise RuntimeError(_RecordingModule.fail_with)
        return (self.file, name)


@pytest.fixture
def recording_cupy(monkeypatch):
    from types import SimpleNamespace

    _RecordingModule.made, _RecordingModule.fail_with = [], None
    monkeypatch.setattr(cuda_compile, "cupy", SimpleNamespace(RawModule=_RecordingModule))
    monkeypatch.setattr(cuda_compile, "_modules", {})
    return _RecordingModule


def test_kernels_compile_a_file_when_one_of_its_kernels_is_first_used(recording_cupy):
    """A backend compiles only the files it launches (a run without --attention flash never compiles
    flash_attention.cu), each once per process and dtype, shared by every rank's table."""
    rank0, rank1 = cuda_compile.Kernels("bf16"), cuda_compile.Kernels("bf16")
    assert recording_cupy.made == []
    assert rank0.gelu_forward == ("gelu", "gelu_forward")
    assert rank1.gelu_backward == ("gelu", "gelu_backward")
    assert rank0.gelu_forward == ("gelu", "gelu_forward")
    assert recording_cupy.made == [("gelu", cuda_compile.nvrtc_options("bf16"))]
    assert cuda_compile.Kernels("fp32").gelu_forward == ("gelu", "gelu_forward")
    assert recording_cupy.made[1] == ("gelu", cuda_compile.nvrtc_options("fp32"))
    with pytest.raises(AttributeError):
        rank0.no_such_kernel  # noqa: B018


def test_missing_crt_headers_are_one_line_naming_the_fix(recording_cupy):
    """NVRTC's error for the header a pip CUDA install may lack becomes one line with the remedy; any
    other compile error is a bug in a kernel and is raised as it is."""
    recording_cupy.fail_with = ('site-packages/nvidia/cu13/include/mma.h(55): catastrophic error: cannot open '
                                'source file "crt/mma.h"\n  #include "crt/mma.h"\n')
    with pytest.raises(XtrainError) as e:
        cuda_compile.Kernels("bf16").flash_attention_forward  # noqa: B018
    assert str(e.value) == ("kernels/flash_attention.cu does not compile: the CUDA headers CuPy uses lack "
                            "crt/mma.h; pip install 'cuda-toolkit[crt]==13.*' (the nvidia-cuda-crt wheel, of the "
                            "nvidia-cuda-runtime version installed)")
    recording_cupy.fail_with = "gelu.cu(12): error: identifier \"x\" is undefined"
    with pytest.raises(RuntimeError, match="is undefined"):
        cuda_compile.Kernels("fp32").gelu_forward  # noqa: B018
