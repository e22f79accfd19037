"""cuBLAS through ctypes: cublasGemmEx and cublasGemmStridedBatchedEx on handles the backend owns.

CuPy binds these functions (cupy_backends.cuda.libs.cublas), but each of its wrappers first points the
handle at the calling thread's current stream, and CuPy 14.2 refuses to do that while the stream captures a
CUDA graph: "calling cuBLAS API during stream capture is currently unsupported" (NotImplementedError, seen
on an H200 on 2026-11-26). The trainer replays its whole step from a graph (train/graph.py), so the
products call the library directly instead: each `Cublas` is one handle pointed at one stream once, when it
is made, and its calls queue into whatever that stream does, a capture included. cuBLAS's own
documentation on CUDA graphs asks for a workspace set with cublasSetWorkspace, so that no call inside a
capture allocates; each handle has its own, as streams must not share one.

The enum values and prototypes below are cublas_api.h's; tests/test_cublaslt.py holds them to the header,
as it does cublaslt.py's to cublasLt.h.
"""

from __future__ import annotations

import ctypes
import threading

from ...errors import XtrainError
from .cublaslt import STATUS_NAMES, find_library

# cublas_api.h (CUDA 13)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1                      # cublasOperation_t
CUBLAS_POINTER_MODE_HOST = 0                         # cublasPointerMode_t: alpha and beta are host floats
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77  # cublasComputeType_t
CUBLAS_GEMM_DEFAULT = -1                             # cublasGemmAlgo_t: the library's heuristic

WORKSPACE_BYTES = 32 << 20  # what PyTorch gives each cuBLAS handle on Hopper; cuBLASLt's here is the same
SIDE_WORKSPACE_BYTES = 4 << 20  # a side thread's handle (the bucketed sync's): its products are PowerSGD's small ones

_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {  # name: argtypes (each returns cublasStatus_t)
    "cublasCreate_v2": [ctypes.POINTER(_P)],
    "cublasDestroy_v2": [_P],
    "cublasSetStream_v2": [_P, _P],
    "cublasSetPointerMode_v2": [_P, _I],
    "cublasSetWorkspace_v2": [_P, _P, ctypes.c_size_t],
    "cublasGetVersion_v2": [_P, ctypes.POINTER(_I)],
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I],
    "cublasGemmStridedBatchedEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, ctypes.c_longlong, _P, _I, _I,
                                   ctypes.c_longlong, _P, _P, _I, _I, ctypes.c_longlong, _I, _I, _I],
}

_library = None
_library_lock = threading.Lock()


def load_library():
    """libcublas as a ctypes library with its functions' argument types set, found as CuPy's own cuBLAS is
    (NVIDIA's wheel through cuda.pathfinder, else by soname): the same file, so one copy in the process."""
    global _library
    with _library_lock:
        if _library is None:
            library = find_library("cublas", "--backend cuda")
            for name, argtypes in _SIGNATURES.items():
                function = getattr(library, name)
                function.argtypes, function.restype = argtypes, ctypes.c_int
            _library = library
        return _library


def check(library, function: str, *args) -> None:
    status = getattr(library, function)(*args)
    if status != 0:
        raise XtrainError(f"cuBLAS: {function} failed: {STATUS_NAMES.get(status, f'status {status}')}")


class Cublas:
    """One cuBLAS handle on one stream, with its workspace, made on the thread whose device it serves.
    Products are in cuBLAS's column-major terms (gemm.py turns row-major arrays into them); alpha and beta
    are host floats."""

    def __init__(self, cupy, stream: int, workspace_bytes: int = WORKSPACE_BYTES):
        self._lib = load_library()
        self.handle = _P()
        check(self._lib, "cublasCreate_v2", ctypes.byref(self.handle))
        self.stream = stream
        self._workspace = cupy.empty((workspace_bytes,), dtype=cupy.uint8)
        check(self._lib, "cublasSetStream_v2", self.handle, stream)
        check(self._lib, "cublasSetPointerMode_v2", self.handle, CUBLAS_POINTER_MODE_HOST)
        check(self._lib, "cublasSetWorkspace_v2", self.handle, self._workspace.data.ptr, workspace_bytes)

    def gemm(self, op_a, op_b, m, n, k, alpha: float, a, a_type, lda, b, b_type, ldb, beta: float, c, c_type,
             ldc, compute) -> None:
        """C = alpha op(A) op(B) + beta C (m x n), queued on this handle's stream."""
        check(self._lib, "cublasGemmEx", self.handle, op_a, op_b, m, n, k, ctypes.byref(ctypes.c_float(alpha)),
              a, a_type, lda, b, b_type, ldb, ctypes.byref(ctypes.c_float(beta)), c, c_type, ldc, compute,
              CUBLAS_GEMM_DEFAULT)

    def gemm_strided_batched(self, op_a, op_b, m, n, k, alpha: float, a, a_type, lda, stride_a, b, b_type, ldb,
                             stride_b, beta: float, c, c_type, ldc, stride_c, batch, compute) -> None:
        """C[i] = alpha op(A[i]) op(B[i]) + beta C[i] for i < batch, each X[i] stride_x elements after X[i-1]."""
        check(self._lib, "cublasGemmStridedBatchedEx", self.handle, op_a, op_b, m, n, k,
              ctypes.byref(ctypes.c_float(alpha)), a, a_type, lda, stride_a, b, b_type, ldb, stride_b,
              ctypes.byref(ctypes.c_float(beta)), c, c_type, ldc, stride_c, batch, compute, CUBLAS_GEMM_DEFAULT)

    def destroy(self) -> None:
        if self.handle:
            check(self._lib, "cublasDestroy_v2", self.handle)
            self.handle = _P()

