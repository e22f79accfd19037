"""xtrain_dist/backend/cuda/cublaslt.py without a GPU: its constants and struct layouts against cublasLt.h, its
argument sizes against the library itself, and its errors.

The [test] extra installs NVIDIA's cuBLAS wheel (header and library) where cuda.pathfinder finds them, as
CuPy's [ctk] does on a GPU machine. Descriptors are host objects: creating them and setting and reading
their attributes needs no GPU, and the library answers CUBLAS_STATUS_INVALID_VALUE to an attribute of
the wrong size, so a wrong ctypes type fails here. What needs a GPU (the handle, the heuristic, the
product) runs in test_cuda_ops.py and test_cuda_bf16.py, on a GPU or on the simulator's stand-in.
"""

import ctypes
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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

CONSTANTS = ["CUBLAS_STATUS_SUCCESS", "CUDA_R_32F"] + [name for name in vars(cublaslt) if name.startswith("CUBLASLT_")]


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
              cublaslt.CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: 14,
              cublaslt.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: 0x7F0000004560,
              cublaslt.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: 3072,
              cublaslt.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: 14}
    assert set(values) == set(cublaslt.DESC_ATTRIBUTE_TYPES)
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
def test_the_record_names_the_library_and_its_version(monkeypatch):
    """What gpu_session/cuda.sh writes into environment.txt: the file loaded and cublasLtGetVersion's
    major * 10000 + minor * 100 + patch (size_t: a wrong return type would give garbage or 0). The library is
    loaded afresh: a test before this one in the same process may have installed the simulator's stand-in as the
    module's loaded library (tests/cudasim/fake_cublaslt.py), which the monkeypatch puts back afterwards."""
    monkeypatch.setattr(cublaslt, "_library", None)
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
    with pytest.raises(XtrainError, match=r"^cuBLASLt has no algorithm for a 3072 x 768 x 8192 product with a "
                                          r"GELU-gradient epilogue \(types 14 -> 14, compute 68\); run without "
                                          r"--matmul cublaslt$"):
        lt.matmul(1, 0, 3072, 8192, 768, 0x1000, 14, 768, 0x2000, 768, 0x3000, 14, 3072, 68, 0,
                  cublaslt.CUBLASLT_EPILOGUE_DGELU, aux=0x5000, ld_aux=3072)


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
        cublaslt.find_library()
    assert str(error.value).startswith("--matmul cublaslt: cannot load libcublasLt (cuda.pathfinder: No module "
                                       "named 'cuda'; libcublasLt.so.13: cannot open shared object file")
    assert str(error.value).endswith("): pip install nvidia-cublas, the wheel CuPy's cuBLAS comes from")



# ---------------------------------------------------------------------------- cublasLt.h read as text

needs_header_file = pytest.mark.skipif(HEADER_DIRS[0] is None,
                                       reason="cublasLt.h not found (pip install nvidia-cublas)")
sys.path.insert(0, str(Path(__file__).resolve().parent / "cudasim"))


def _header() -> str:
    """cublasLt.h without its comments' delimiters kept apart: (text with comments, text without)."""
    return (Path(HEADER_DIRS[0]) / "cublasLt.h").read_text()


def _uncommented(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL))


def header_enums(text: str) -> dict[str, int]:
    """Every enumerator of cublasLt.h's typedef'd enums, its value evaluated (values may name earlier ones; one
    that names another header's, and those after it without a value of their own, are left out)."""
    values: dict[str, int] = {}
    for body in re.findall(r"typedef\s+enum\s*\w*\s*\{(.*?)\}\s*\w+\s*;", _uncommented(text), flags=re.DOTALL):
        following: int | None = 0
        for entry in (e.strip() for e in body.split(",")):
            if not entry:
                continue
            name, _, expression = (part.strip() for part in entry.partition("="))
            if expression:
                named = re.findall(r"\b[A-Za-z_]\w*\b", expression)
                following = None if any(n not in values for n in named) else eval(
                    re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(values[m.group(0)]), expression))
            if following is not None:
                values[name] = following
                following += 1
    return values


_TYPE_SIZES = {"int8_t": 1, "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8, "void *": 8}


def header_attribute_sizes(text: str) -> dict[str, int]:
    """The size in bytes of each descriptor and preference attribute, from the C type its comment in cublasLt.h
    names (the comment just before the enumerator: "uint32_t, default: ...", "Bias case: const void *, ...")."""
    sizes = {}
    for comment, name in re.findall(r"/\*\*((?:(?!\*/).)*)\*/\s*(CUBLASLT_MATMUL_(?:DESC|PREF)_\w+)\s*=", text,
                                    flags=re.DOTALL):
        named = {_TYPE_SIZES[t.replace("void*", "void *")] for t in
                 re.findall(r"\b(?:u?int(?:8|32|64)_t|void ?\*)", comment.replace("void*", "void *"))}
        if len(named) == 1:
            sizes[name] = named.pop()
    return sizes


def header_prototypes(text: str) -> dict[str, list[tuple[str, str]]]:
    """Each function cublasLt.h declares: its (C type, name) parameters in order."""
    functions = {}
    for name, params in re.findall(r"\bCUBLASWINAPI\s+(\w+)\s*\((.*?)\)\s*;", _uncommented(text), flags=re.DOTALL):
        parsed = []
        for param in (p.strip() for p in params.split(",")):
            if param in ("", "void"):
                continue
            match = re.match(r"(.*?)(\w+)\s*(\[\])?$", " ".join(param.split()))
            parsed.append((match.group(1).strip() + (" *" if match.group(3) else ""), match.group(2)))
        functions[name] = parsed
    return functions


_HANDLES = ("cublasHandle_t", "cublasLtHandle_t", "cublasLtMatmulDesc_t", "cublasLtMatrixLayout_t",
            "cublasLtMatmulPreference_t", "cudaStream_t")
_SCALARS = {"size_t": ctypes.c_size_t, "uint64_t": ctypes.c_uint64, "int64_t": ctypes.c_int64, "int": ctypes.c_int,
            "long long int": ctypes.c_longlong}


def _ctype_fits(c_type: str, argtype) -> bool:
    """Whether a ctypes argument type passes what the C type is: a pointer (an opaque handle or a stream
    included) as c_void_p or a POINTER; an enum (cublas*_t, cudaDataType) as a 32-bit int; a scalar as itself."""
    if "*" in c_type or c_type in _HANDLES:
        return argtype is ctypes.c_void_p or issubclass(argtype, ctypes._Pointer)
    if c_type in _SCALARS:
        return argtype is _SCALARS[c_type]
    return c_type.startswith(("cublas", "cudaDataType")) and argtype is ctypes.c_int32


@needs_header_file
def test_every_enum_value_the_binding_and_the_stand_in_use_is_the_headers():
    """cublaslt.py's enum constants (every CUBLASLT_ name it defines) and fake_cublaslt's (the epilogues and
    attribute ids it interprets) against the enumerators of cublasLt.h, read as text: no compiler needed."""
    import fake_cublaslt

    enums = header_enums(_header())
    assert enums["CUBLASLT_EPILOGUE_DGELU_BGRAD"] == 208 and enums["CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD"] == 12
    for name in CONSTANTS:
        if name.startswith("CUBLASLT_"):
            assert enums[name] == getattr(cublaslt, name), name
    for name in ("DEFAULT", "BIAS", "GELU_AUX_BIAS", "DGELU", "BGRADA"):
        assert getattr(fake_cublaslt, name) == enums[f"CUBLASLT_EPILOGUE_{name}"], name
    for name in ("TRANSA", "TRANSB", "EPILOGUE", "BIAS_POINTER", "AUX_POINTER", "AUX_LD", "AUX_DATA_TYPE",
                 "BIAS_DATA_TYPE"):
        header_name = "CUBLASLT_MATMUL_DESC_" + name.replace("AUX_", "EPILOGUE_AUX_")
        assert getattr(fake_cublaslt, name) == enums[header_name], name
    for value in cublaslt.EPILOGUE_NAMES:
        assert value in enums.values()


@needs_header_file
def test_every_attribute_size_is_the_type_the_header_gives_it():
    """The ctypes type cublaslt.py passes each attribute as, and the size fake_cublaslt accepts, against the C type
    cublasLt.h's comment names for that attribute (a wrong one is CUBLAS_STATUS_INVALID_VALUE on a GPU)."""
    import fake_cublaslt

    text = _header()
    sizes, enums = header_attribute_sizes(text), header_enums(text)
    by_value = {("DESC", v): n for n, v in enums.items() if n.startswith("CUBLASLT_MATMUL_DESC_")}
    by_value |= {("PREF", v): n for n, v in enums.items() if n.startswith("CUBLASLT_MATMUL_PREF_")}
    assert sizes["CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD"] == 8 and sizes["CUBLASLT_MATMUL_DESC_EPILOGUE"] == 4
    for kind, ours, fakes in (("DESC", cublaslt.DESC_ATTRIBUTE_TYPES, fake_cublaslt.DESC_SIZES),
                              ("PREF", cublaslt.PREF_ATTRIBUTE_TYPES, fake_cublaslt.PREF_SIZES)):
        for attribute, ctype in ours.items():
            assert ctypes.sizeof(ctype) == sizes[by_value[kind, attribute]], by_value[kind, attribute]
        for attribute, size in fakes.items():
            assert size == sizes[by_value[kind, attribute]], by_value[kind, attribute]


@needs_header_file
def test_the_binding_and_the_stand_in_take_each_functions_arguments_in_the_headers_order():
    """Each function cublaslt.py binds: its ctypes argument types, position by position, fit the prototype in
    cublasLt.h; and fake_cublaslt's method of that name takes the same parameters, by the header's names, in
    the header's order (so the stand-in is checked against the library's declaration, not only our calls)."""
    import fake_cublaslt

    prototypes = header_prototypes(_header())
    assert [name for _, name in prototypes["cublasLtMatmul"]][12:] == ["algo", "workspace", "workspaceSizeInBytes",
                                                                      "stream"]
    for function, argtypes in cublaslt._SIGNATURES.items():
        params = prototypes[function]
        assert len(params) == len(argtypes), function
        for (c_type, name), argtype in zip(params, argtypes, strict=True):
            assert _ctype_fits(c_type, argtype), f"{function}: {c_type} {name} passed as {argtype}"
        method = getattr(fake_cublaslt.FakeCublasLt, function, None)
        if method is None:
            assert function == "cublasLtMatmulDescGetAttribute"  # only the tests read attributes back
            continue
        names = [p for p in inspect.signature(method).parameters if p != "self"]
        assert names == [name for _, name in params], function


# ---------------------------------------------------------------------------- cublas.py against cublas_api.h

def _cublas_header() -> str:
    return (Path(HEADER_DIRS[0]) / "cublas_api.h").read_text()


@needs_header_file
def test_the_cublas_binding_is_cublas_api_h():
    """cuda/cublas.py binds cuBLAS itself, since CuPy's wrappers cannot be called while a stream captures a
    graph: its enum values are cublas_api.h's, each function's ctypes argument types fit the header's
    prototype position by position, and fake_cublas's method of that name takes the header's parameter
    names in the header's order."""
    import fake_cublas

    from xtrain_dist.backend.cuda import cublas

    text = _cublas_header()
    enums = header_enums(text)
    for name in ("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_POINTER_MODE_HOST", "CUBLAS_COMPUTE_32F",
                 "CUBLAS_COMPUTE_32F_FAST_TF32", "CUBLAS_GEMM_DEFAULT"):
        assert enums[name] == getattr(cublas, name), name
    assert enums["CUBLAS_POINTER_MODE_HOST"] == fake_cublas.POINTER_MODE_HOST
    prototypes = header_prototypes(text)
    assert [name for _, name in prototypes["cublasGemmStridedBatchedEx"]][10:12] == ["strideA", "B"]
    for function, argtypes in cublas._SIGNATURES.items():
        params = prototypes[function]
        assert len(params) == len(argtypes), function
        for (c_type, name), argtype in zip(params, argtypes, strict=True):
            assert _ctype_fits(c_type, argtype), f"{function}: {c_type} {name} passed as {argtype}"
        names = [p for p in inspect.signature(getattr(fake_cublas.FakeCublas, function)).parameters if p != "self"]
        assert names == [name for _, name in params], function
