"""The kernel sources and their compilation: the text and the NVRTC options each kernels/<file>.cu is
compiled with, for each --dtype, and the table of kernels a backend launches, each file compiled on
first use.

The kernels a file defines are read from the file itself (KERNELS, from its `extern "C" __global__`
definitions), so a kernel added to a file can be launched without an edit here.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from ...errors import XtrainError
from .device import cupy

KERNEL_DIR = Path(__file__).resolve().parents[3] / "kernels"

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
def kernel_table() -> dict[str, tuple[str, ...]]:
    """kernels/<file>.cu -> the kernels (extern "C" entry points) it defines, in the file's order."""
    return {path.stem: tuple(_KERNEL.findall(path.read_text())) for path in sorted(KERNEL_DIR.glob("*.cu"))}


KERNELS = kernel_table()
FILE_OF = {kernel: file for file, names in KERNELS.items() for kernel in names}

# ---------------------------------------------------------------------------- compiling on first use

_modules: dict[tuple[str, str], object] = {}
_modules_lock = threading.Lock()

# The one header a pip-installed CUDA may lack: flash_attention.cu's tensor-core fragments come from
# <mma.h>, which includes crt/mma.h. The nvidia-cuda-runtime wheel ships mma.h but not crt/ (that is the
# nvidia-cuda-crt wheel, which CuPy's [ctk] extra does not pull in), and CuPy compiles against the
# headers beside the libnvrtc it loads.
_MISSING_CRT = re.compile(r'cannot open source file "(crt/[^"]+)"')


class Kernels:
    """The kernels of one --dtype variant, each kernels/<file>.cu compiled on first use of one of its
    kernels (once per process, shared by every rank). So a run compiles only the files it launches:
    one without --attention flash never compiles flash_attention.cu, and a machine without the headers
    that file needs trains everything else."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def __getattr__(self, kernel: str):
        if kernel not in FILE_OF:
            raise AttributeError(kernel)
        file = FILE_OF[kernel]
        key = (file, self.dtype)
        # One lock for all ranks: the first thread compiles (or loads CuPy's disk cache) while the others
        # wait, instead of several threads compiling the same source at once.
        with _modules_lock:
            if key not in _modules:
                _modules[key] = cupy.RawModule(code=kernel_source(file), options=nvrtc_options(self.dtype))
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
