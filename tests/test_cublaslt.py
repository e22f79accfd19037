"""xtrain_dist/backend/cuda/cublaslt.py without a GPU: its constants and struct layouts against cublasLt.h, its
argument sizes against the library itself, and its errors.

The [test] extra installs NVIDIA's cuBLAS wheel (header and library) where cuda.pathfinder finds them, as
CuPy's [ctk] does on a GPU machine. Descriptors are host objects: creating them and setting and reading
their attributes needs no GPU, and the library answers CUBLAS_STATUS_INVALID_VALUE to an attribute of
the wrong size, so a wrong ctypes type fails here. What needs a GPU (the handle, the heuristic, the
product) runs in test_cuda_ops.py and test_cuda_bf16.py, on a GPU or on the simulator's stand-in.
"""

import ctypes
import os
import shutil
import subprocess

import pytest

from xtrain_dist.backend.cuda import cublaslt
from xtrain_dist.errors import XtrainError


def _pathfinder(find):
    try:
        from cuda import pathfinder
        return find(pathfinder)
    except Exception:  # not installed, or it did not find the wheel
        return None


LIBRARY_PATH = _pathfinder(lambda p: p.load_nvidia_dynamic_lib("cublasLt").abs_path)
# cublasLt.h, and what it includes: the runtime's cuda_fp16.h, which includes CCCL's <nv/target>
HEADER_DIRS = [_pathfinder(lambda p, name=name: p.find_nvidia_header_directory(name))
               for name in ("cublas", "cudart", "cccl")]
needs_library = pytest.mark.skipif(LIBRARY_PATH is None, reason="libcublasLt not found (pip install nvidia-cublas)")
needs_header = pytest.mark.skipif(None in HEADER_DIRS or shutil.which("g++") is None,
                                  reason="cublasLt.h (pip install nvidia-cublas), the CUDA headers it includes or "
                                         "g++ not found")

CONSTANTS = ["CUBLAS_STATUS_SUCCESS", "CUBLASLT_MATMUL_DESC_TRANSA", "CUBLASLT_MATMUL_DESC_TRANSB",
             "CUBLASLT_MATMUL_DESC_EPILOGUE", "CUBLASLT_MATMUL_DESC_BIAS_POINTER",
             "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", "CUBLASLT_EPILOGUE_BIAS",
             "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES", "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES", "CUDA_R_32F"]


@needs_header
def test_constants_and_structs_are_the_headers(tmp_path):
    """Every value cublaslt.py hard-codes, the status names, the alignment preferences' order (B, C, D
    follow A) and the heuristic result's size and field offsets, printed by a C program compiled against
    cublasLt.h."""
    lines = [f'printf("{name} %lld\\n", (long long){name});' for name in CONSTANTS]
    lines += [f'printf("status {code} %lld\\n", (long long){name});' for code, name in cublaslt.STATUS_NAMES.items()]
    lines += [f'printf("alignment {i} %lld\\n", (long long)CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{x}_BYTES);'
              for i, x in enumerate("ABCD")]
    lines += ['printf("result %zu %zu %zu %zu %zu %zu\\n", sizeof(cublasLtMatmulHeuristicResult_t), '
              'offsetof(cublasLtMatmulHeuristicResult_t, algo), offsetof(cublasLtMatmulHeuristicResult_t, '
              'workspaceSize), offsetof(cublasLtMatmulHeuristicResult_t, state), '
              'offsetof(cublasLtMatmulHeuristicResult_t, wavesCount), sizeof(cublasLtMatmulAlgo_t));']
    source = tmp_path / "constants.cpp"
    source.write_text("#include <cstddef>\n#include <cstdio>\n#include <cublasLt.h>\nint main() {\n" +
                      "\n".join(lines) + "\nreturn 0;\n}\n")
    subprocess.run(["g++", *(f"-I{d}" for d in HEADER_DIRS), str(source), "-o", str(tmp_path / "constants")],
                   check=True)
    printed = subprocess.run([str(tmp_path / "constants")], capture_output=True, text=True, check=True).stdout
    values = {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in printed.splitlines() if " " in line}
    for name in CONSTANTS:
        assert int(values[name]) == getattr(cublaslt, name), name
    for code in cublaslt.STATUS_NAMES:
        assert int(values[f"status {code}"]) == code
    for i in range(4):
        assert int(values[f"alignment {i}"]) == cublaslt.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i
    result = cublaslt.HeuristicResult
    size, algo, workspace, state, waves = (int(v) for v in printed.split("result ")[1].split()[:5])
    assert (size, algo, workspace, state, waves) == (
        ctypes.sizeof(result), result.algo.offset, result.workspaceSize.offset, result.state.offset,
        result.wavesCount.offset)
    assert int(printed.split("result ")[1].split()[5]) == ctypes.sizeof(cublaslt.MatmulAlgo)


@needs_library
def test_the_library_takes_every_attribute_at_the_size_given_and_refuses_another():
    library = cublaslt.load_library(LIBRARY_PATH)
    desc, preference = ctypes.c_void_p(), ctypes.c_void_p()
    cublaslt.check(library, "cublasLtMatmulDescCreate", ctypes.byref(desc), 68, cublaslt.CUDA_R_32F)
    cublaslt.check(library, "cublasLtMatmulPreferenceCreate", ctypes.byref(preference))
    values = {cublaslt.CUBLASLT_MATMUL_DESC_TRANSA: 1, cublaslt.CUBLASLT_MATMUL_DESC_TRANSB: 1,
              cublaslt.CUBLASLT_MATMUL_DESC_EPILOGUE: cublaslt.CUBLASLT_EPILOGUE_BIAS,
              cublaslt.CUBLASLT_MATMUL_DESC_BIAS_POINTER: 0x7F0000001230,
              cublaslt.CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: 14}
    for attribute, value in values.items():
        cublaslt.set_attribute(library, "cublasLtMatmulDescSetAttribute", desc, attribute, value)
        held, written = cublaslt.DESC_ATTRIBUTE_TYPES[attribute](), ctypes.c_size_t()
        cublaslt.check(library, "cublasLtMatmulDescGetAttribute", desc, attribute, ctypes.byref(held),
                       ctypes.sizeof(held), ctypes.byref(written))
        assert (held.value, written.value) == (value, ctypes.sizeof(held)), attribute
    for attribute in cublaslt.PREF_ATTRIBUTE_TYPES:
        cublaslt.set_attribute(library, "cublasLtMatmulPreferenceSetAttribute", preference, attribute, 16)
    too_wide = ctypes.c_uint64(cublaslt.CUBLASLT_EPILOGUE_BIAS)
    with pytest.raises(XtrainError, match=r"^cuBLASLt: cublasLtMatmulDescSetAttribute failed: "
                                          r"CUBLAS_STATUS_INVALID_VALUE$"):
        cublaslt.check(library, "cublasLtMatmulDescSetAttribute", desc, cublaslt.CUBLASLT_MATMUL_DESC_EPILOGUE,
                       ctypes.byref(too_wide), ctypes.sizeof(too_wide))
    layout = ctypes.c_void_p()
    cublaslt.check(library, "cublasLtMatrixLayoutCreate", ctypes.byref(layout), 14, 2304, 768, 2304)


@needs_library
@pytest.mark.skipif(os.environ.get("XTRAIN_CUDASIM") == "1",
                    reason="under XTRAIN_CUDASIM=1 the module's library is the simulator's stand-in")
def test_the_record_names_the_library_and_its_version():
    """What gpu_session/cuda.sh writes into environment.txt: the file loaded and cublasLtGetVersion's
    major * 10000 + minor * 100 + patch (size_t: a wrong return type would give garbage or 0)."""
    path, version = cublaslt.describe_library().split(", version ")
    assert path.endswith("libcublasLt.so.13") and 130000 <= int(version) < 140000, (path, version)


def test_alignment_is_the_largest_power_of_two_up_to_256():
    assert [cublaslt.alignment(p) for p in (0x1000, 0x1100, 0x1104, 0x1102, 0x1001, 0)] == [256, 256, 4, 2, 1, 256]


class _Library:
    """A libcublasLt whose heuristic finds nothing, as for a combination the library does not support."""

    def __getattr__(self, name):
        return lambda *args: 0

    @staticmethod
    def cublasLtMatmulAlgoGetHeuristic(*args):
        args[-1]._obj.value = 0
        return 0


class _Cupy:
    uint8 = "uint8"

    @staticmethod
    def empty(shape, dtype):
        return type("Array", (), {"data": type("Pointer", (), {"ptr": 0x10000})})()


def test_a_product_without_an_algorithm_is_one_line_naming_it():
    lt = cublaslt.LtMatmul(_Cupy, library=_Library())
    with pytest.raises(XtrainError, match=r"^cuBLASLt has no algorithm for a 2304 x 768 x 8192 product with a bias "
                                          r"epilogue \(types 14 -> 14, compute 68\); run without --matmul cublaslt$"):
        lt.matmul_bias(1, 0, 2304, 8192, 768, 0x1000, 14, 768, 0x2000, 768, 0x3000, 14, 2304, 0x4000, 14, 68, 0)


def test_a_missing_library_is_one_line_naming_the_wheel(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pathfinder(name, *args, **kwargs):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError("No module named 'cuda'")
        return real_import(name, *args, **kwargs)

    def no_library(path, *args, **kwargs):
        raise OSError(f"{path}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(builtins, "__import__", no_pathfinder)
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(XtrainError) as error:
        cublaslt._find_library()
    assert str(error.value).startswith("--matmul cublaslt: cannot load libcublasLt (cuda.pathfinder: No module "
                                       "named 'cuda'; libcublasLt.so.13: cannot open shared object file")
    assert str(error.value).endswith("): pip install nvidia-cublas, the wheel CuPy's cuBLAS comes from")

