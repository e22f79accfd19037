"""The optional libraries the benchmarks use, from the extras in pyproject.toml ([bench]: PyTorch,
transformers; [plot]: matplotlib; [cuda]: CuPy). Each is looked for once a script's arguments are checked, so
that a missing one is one line naming the extra to install, said before any work rather than as an
ImportError when the first row needs it."""

import importlib.util

from ..backend import get_backend
from ..errors import XtrainError, install_hint


def require(module: str, name: str, way_out: str = "") -> None:
    """Stop where `module` (torch, transformers) of the [bench] extra is not installed, with `way_out`, how
    to do without it, after the line. Found, not imported: importing PyTorch takes seconds, and the
    rows that need it import it themselves."""
    if importlib.util.find_spec(module) is None:
        raise XtrainError(f"{name} is not installed ({install_hint('bench')}){way_out}")


def pyplot():
    """matplotlib's pyplot without a display; a missing matplotlib is one clear line."""
    try:
        import matplotlib
    except ImportError:
        raise XtrainError(f"matplotlib is not installed ({install_hint('plot')})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def gpu_libraries(with_torch: bool, torch_way_out: str = "") -> tuple:
    """(cupy, torch) for a GPU benchmark, torch None unless `with_torch` (the rows that race PyTorch). A
    missing library, a PyTorch without CUDA or a CuPy that sees no device is one line; `torch_way_out` is
    the option that does without PyTorch, said beside its extra."""
    try:
        import cupy
    except ImportError:
        raise XtrainError(f"CuPy is not installed ({install_hint('cuda')})") from None
    torch = None
    if with_torch:
        try:
            import torch
        except ImportError:
            raise XtrainError(f"PyTorch is not installed ({install_hint('bench')}{torch_way_out})") \
                from None
        if not torch.cuda.is_available():
            raise XtrainError("PyTorch sees no CUDA device")
    get_backend("cuda", 0)  # one clean line if CuPy sees no device
    return cupy, torch
