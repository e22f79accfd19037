"""Backends: the numpy reference (numpy_ops) and the CUDA kernels (cuda/ops.py), with the same op names.

get_backend returns an object whose attributes are the ops plus `xp` (the array module), `name`,
`dtype` (the activation precision, precision.DTYPES), `act_dtype` (the array dtype activations are
stored in), `to_host`, `from_host`, `from_host_act` and `synchronize`. Asking for CUDA where it is
missing is an error, never a quiet CPU run (the CUDA backend raises XtrainError with the reason: no
CuPy, no device, a bad device id).
"""

from ..command import must_be, one_of
from ..errors import XtrainError
from ..precision import check_dtype

BACKENDS = ("numpy", "cuda")


def get_backend(name: str, device: int | None = None, allow_tf32: bool = False, dtype: str = "fp32",
                matmul: str = "cublas", attention: str = "standard"):
    check_dtype(dtype)
    if name == "numpy":
        from . import numpy_ops
        numpy_ops.keep_freed_arrays()  # the CPU's arrays are this process's heap: let it reuse their pages
        return numpy_ops.NumpyBackend(dtype)
    if name == "cuda":
        from .cuda import ops as cuda_ops
        # --attention cudnn: the flash attention ops run cuDNN's kernels (backend/cuda/cudnn_sdpa.py)
        return cuda_ops.CudaBackend(0 if device is None else device, allow_tf32=allow_tf32, dtype=dtype,
                                     matmul=matmul, flash_kernels="cudnn" if attention == "cudnn" else "mma")
    raise XtrainError(must_be("--backend", one_of(BACKENDS), name))


def rank_device(name: str, local_rank: int) -> int | None:
    """The device a rank thread binds: local ranks take the visible GPUs in turn, so a world larger
    than the GPU count puts several virtual ranks (each with its own stream) on one GPU."""
    if name != "cuda":
        return None
    from .cuda.device import device_count
    return local_rank % device_count()
