"""The kernel sources and their compilation: the text and the NVRTC options each kernels/<file>.cu is
compiled with, for each --dtype, and the table of kernels a backend launches, each file compiled on
first use.

What a kernel file declares is read from the file itself: the kernels it defines (KERNELS, from its
`extern "C" __global__` definitions) and the block shape each kernel is written for (kernel_constant,
from its `constexpr int` constants). So a kernel added to a file can be launched, and a block size
changed beside a kernel is the one it is launched with, without an edit here.
"""

from __future__ import annotations

import ast
import operator
import re
import threading
from pathlib import Path

from ... import shipped
from ...errors import XtrainError
from .device import cupy

KERNEL_DIR = shipped.KERNEL_DIR

# --dtype -> the extra NVRTC options of the kernel variant a backend of that dtype loads
PRECISIONS: dict[str, tuple[str, ...]] = {"fp32": (), "bf16": ("-DXTRAIN_BF16",)}

# Our options. CuPy adds its own when it compiles: -ftz=true, --device-as-default-execution-space,
# -arch=sm_XX (a cubin for the device it runs on), and include paths for its headers, CCCL and the
# CUDA runtime headers (only the bf16 variant includes one: cuda_bf16.h).
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)

# The options CuPy appends, for tests that compile with NVRTC directly exactly as CuPy would.
CUPY_ADDED_OPTIONS: tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*$')


def kernel_source(file: str) -> str:
    """kernels/<file>.cu with local includes pasted in (each once), as NVRTC receives it."""
    seen: set[str] = set()

    def expand(path: Path) -> list[str]:
        out = [f'#line 1 "{path.name}"']
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = _INCLUDE.match(line)
            if match is None:
                out.append(line)
                continue
            if match.group(1) not in seen:
                seen.add(match.group(1))
                out += expand(KERNEL_DIR / match.group(1))
            out.append(f'#line {number + 1} "{path.name}"')
        return out

    return "\n".join(expand(KERNEL_DIR / f"{file}.cu")) + "\n"


def nvrtc_options(dtype: str = "fp32") -> tuple[str, ...]:
    """The options CudaBackend(dtype=...) compiles every kernel file with (CuPy adds its own)."""
    return NVRTC_OPTIONS + PRECISIONS[dtype]


# ---------------------------------------------------------------------------- what the files declare

# A kernel: an extern "C" entry point whose definition starts a line (a mention in a comment does not)
_KERNEL = re.compile(r'^extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(',
                     re.MULTILINE)
# A constant of the file's launch geometry: a `constexpr int` at namespace scope, so at the start of a
# line (a function's own constants are indented)
_CONSTANT = re.compile(r"^constexpr\s+int\s+(\w+)\s*=\s*([^;]+);", re.MULTILINE)
# A compile-time knob's default, `#define NAME <integer>` (a -DNAME=<integer> option overrides it)
_KNOB = re.compile(r"^#\s*define\s+(\w+)\s+(\d+)\s*$", re.MULTILINE)
# What a constant's value may be built with; C's integer division truncates, which // does for the
# non-negative sizes these are
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv}


def kernel_table() -> dict[str, tuple[str, ...]]:
    """kernels/<file>.cu -> the kernels (extern "C" entry points) it defines, in the file's order."""
    return {path.stem: tuple(_KERNEL.findall(path.read_text())) for path in sorted(KERNEL_DIR.glob("*.cu"))}


def kernel_constant(file: str, name: str, defines: tuple[str, ...] = ()) -> int:
    """The value of `constexpr int <name>` as kernels/<file>.cu is compiled with it (common.cuh pasted in)
    and with the -DNAME=<integer> options `defines`: how the host launches a kernel with the block shape
    the kernel (or that variant of it) is written for. The value is an integer literal, or +, -, * and /
    of literals, of the file's other such constants and of its `#define NAME <integer>` knobs."""
    source = kernel_source(file)
    definitions: dict[str, list[str]] = {}
    for constant, value in _CONSTANT.findall(source):
        definitions.setdefault(constant, []).append(value.strip())
    for knob, value in _KNOB.findall(source):
        definitions.setdefault(knob, [value])  # `#ifndef X / #define X 8`: one default each
    for option in defines:
        knob, _, value = option.removeprefix("-D").partition("=")
        definitions[knob] = [value]

    def value_of(constant: str) -> int:
        found = definitions.get(constant, [])
        if len(found) != 1:
            raise ValueError(f"kernels/{file}.cu defines constexpr int {constant} {len(found)} times, not once")
        try:
            tree = ast.parse(found[0], mode="eval").body
        except SyntaxError:  # a cast, a template, a suffixed literal: C++ that is not also Python
            tree = None
        return evaluate(tree, f"{constant} = {found[0]}")

    def evaluate(node: ast.expr | None, definition: str) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return value_of(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.left, definition), evaluate(node.right, definition))
        raise ValueError(f"kernels/{file}.cu: constexpr int {definition}: not built of integer literals and "
                         "constants with + - * /")

    return value_of(name)


KERNELS = kernel_table()
FILE_OF = {kernel: file for file, names in KERNELS.items() for kernel in names}

# ---------------------------------------------------------------------------- compiling on first use

_modules: dict[tuple[str, str, tuple[str, ...]], object] = {}
_modules_lock = threading.Lock()

# The one header a pip-installed CUDA may lack: flash_attention.cu's tensor-core fragments come from
# <mma.h>, which includes crt/mma.h. The nvidia-cuda-runtime wheel ships mma.h but not crt/ (that is the
# nvidia-cuda-crt wheel, which CuPy's [ctk] extra does not pull in), and CuPy compiles against the
# headers beside the libnvrtc it loads.
_MISSING_CRT = re.compile(r'cannot open source file "(crt/[^"]+)"')


class Kernels:
    """The kernels of one --dtype variant, each kernels/<file>.cu compiled on first use of one of its
    kernels (once per process, shared by every rank). So a run compiles only the files it launches:
    one without --attention flash never compiles the flash attention files, and a machine without the
    headers a file needs trains everything else."""

    def __init__(self, dtype: str, defines: tuple[str, ...] = ()):
        self.dtype = dtype
        self.defines = tuple(defines)  # -D options of a compile-time variant (flash_variants.py), cached apart

    def __getattr__(self, kernel: str):
        if kernel not in FILE_OF:
            raise AttributeError(kernel)
        file = FILE_OF[kernel]
        key = (file, self.dtype, self.defines)
        # One lock for all ranks: the first thread compiles (or loads CuPy's disk cache) while the others
        # wait, instead of several threads compiling the same source at once.
        with _modules_lock:
            if key not in _modules:
                _modules[key] = cupy.RawModule(code=kernel_source(file),
                                               options=nvrtc_options(self.dtype) + self.defines)
            try:
                function = _modules[key].get_function(kernel)  # CuPy compiles the module here
            except Exception as e:
                missing = _MISSING_CRT.search(str(e))
                if missing is None:
                    raise
                raise XtrainError(f"kernels/{file}.cu does not compile: the CUDA headers CuPy uses lack "
                                  f"{missing.group(1)}; pip install 'cuda-toolkit[crt]==13.*' (the "
                                  f"nvidia-cuda-crt wheel, of the nvidia-cuda-runtime version installed)") from None
        setattr(self, kernel, function)  # found as an attribute from now on: __getattr__ is not called again
        return function
