"""The CUDA devices this process sees, their memory, and the calling thread's stream.

CuPy is imported here, once, and may be missing: the package, the kernel sources and their options
import without it, and asking for a device is where its absence becomes an error (device_count). The
device queries are what a run checks before any rank starts (device_count, device_free_bytes,
device_name for the MFU's peak) and reports after (pool_bytes). CuPy keeps the current device and
stream per thread; on_stream and check_stream are how CudaBackend's ops keep their work on the
stream of the thread that made the backend.
"""

from __future__ import annotations

import ctypes
import os

from ...errors import MachineWide, XtrainError, install_hint

try:  # the module imports without CuPy, so the kernel sources and options can be checked anywhere
    import cupy
except ImportError as _e:
    cupy = None
    _CUPY_IMPORT_ERROR: ImportError | None = _e
else:
    _CUPY_IMPORT_ERROR = None


# cudaError_t values getDeviceCount returns where there is no GPU to use: the CUDA runtime says
# "insufficient driver" (35) when the driver library is missing altogether, and "no device" (100) when a
# driver is loaded but sees no GPU
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_DEVICE = 100
DRIVER_LIBRARY = "libcuda.so.1"


def driver_present() -> bool:
    """Whether the NVIDIA driver's library loads: without it there is no GPU, whatever CUDA's error says."""
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    return True


def device_count() -> int:
    """How many CUDA devices this process sees; XtrainError if CuPy or a device is missing."""
    if cupy is None:
        raise MachineWide(f"--backend cuda needs CuPy: {_CUPY_IMPORT_ERROR} ({install_hint('cuda')})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if e.status in (CUDA_ERROR_INSUFFICIENT_DRIVER, CUDA_ERROR_NO_DEVICE) and not driver_present():
            # the runtime reports a missing driver as one too old for it: say what is really the case
            raise MachineWide("--backend cuda: no CUDA device or driver is present on this machine "
                              f"({DRIVER_LIBRARY} cannot be loaded)") from None
        raise XtrainError(f"--backend cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible}): {e}") \
            from None
    if count == 0:
        raise XtrainError(f"--backend cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible})")
    return count


def device_free_bytes(device: int) -> int:
    """Memory free on `device` now (cudaMemGetInfo): what the run's pre-flight check (memory.py) compares
    the ranks sharing that GPU against, before any of them allocates."""
    with cupy.cuda.Device(device):
        free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free)


def device_name(device: int) -> str:
    """The device's name as the driver gives it ("NVIDIA H100 80GB HBM3"): profile.peak_for reads it."""
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def pool_bytes(device: int) -> int:
    """Bytes CuPy's memory pool holds on `device` from the driver. The pool keeps every freed block for
    reuse, so after a run this is the most its arrays held at once, plus the pool's rounding and what its
    blocks could not be split into: the GPU's peer of the host's peak RSS. cuBLAS's workspace, NCCL's
    buffers and the CUDA context are outside it."""
    with cupy.cuda.Device(device):
        return int(cupy.get_default_memory_pool().total_bytes())


# ---------------------------------------------------------------------------- the calling thread's stream

def on_stream(stream, work):
    """work() with `stream` current, and the caller's current stream again after it. CuPy's get() would
    copy a strided array under `with stream:` itself, and leaving such a block has been seen to make the
    null stream current, not the stream that was (docs/cuda_backend.md): the next op then fails
    check_stream."""
    previous = cupy.cuda.get_current_stream()
    stream.use()
    try:
        return work()
    finally:
        previous.use()


def check_stream(own, side_streams: set[int]) -> None:
    """cuBLAS calls and CuPy's allocations and array functions (the model's xp.zeros) go to the
    calling thread's current stream, so an op called from another thread would race with this
    rank's work. Fail loudly instead; the check costs well under a microsecond. A side thread of
    the rank (its communication thread) that called bind_side_thread() runs ops on its own stream
    (its pointer is in `side_streams`), ordered against the rank's by fence()/wait()."""
    current = cupy.cuda.get_current_stream().ptr
    if current != own.ptr and current not in side_streams:
        raise RuntimeError("CudaBackend op called from a thread whose current CuPy stream is not the "
                           "backend's: call a backend's ops only from the thread that created it")
