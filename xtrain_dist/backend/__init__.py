"""Backends: the numpy reference (numpy_ops) and the CUDA kernels (cuda_ops), with the same op names.

get_backend returns an object whose attributes are the ops plus `xp` (the array module), `name`,
`to_host`, `from_host` and `synchronize`. Asking for CUDA where it is missing is an error, never a
quiet CPU run.
"""

from ..errors import XtrainError

BACKENDS = ("numpy", "cuda")


def get_backend(name: str, device: int | None = None):
    if name == "numpy":
        from . import numpy_ops
        return numpy_ops
    if name == "cuda":
        try:
            from . import cuda_ops
        except ImportError as e:
            raise XtrainError(f"--backend cuda needs CuPy: {e} (pip install 'xtrain-dist[cuda]')") from None
        return cuda_ops.CudaBackend(0 if device is None else device)
    raise XtrainError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
