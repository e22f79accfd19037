"""A stand-in for libcublas: the functions xtrain_dist/backend/cuda/cublas.py calls through ctypes, on fake_cupy's
memory.

`install()` makes `xtrain_dist.backend.cuda.cublas` find this object as its loaded library (as fake_cublaslt
does for cuBLASLt). A handle has a stream, a pointer mode and a workspace, and its products run on its
stream, whatever the current stream is, a capturing one included (the library's behaviour, which CuPy's
binding does not allow: fake_cupy.py). Each product also writes the handle's workspace on that stream, so
two streams sharing one would be a race here. Status codes are returned, as the C library does: an
unknown handle is CUBLAS_STATUS_NOT_INITIALIZED, a type combination cuBLAS lacks CUBLAS_STATUS_NOT_SUPPORTED.
Parameter names are cublas_api.h's (tests/test_cublaslt.py holds them to it).
"""

from __future__ import annotations

import ctypes
import itertools

from fake_cublaslt import install_library
from fake_cupy import CUBLASError, _stream_of, gemm_ex, gemm_strided_batched_ex

SUCCESS, NOT_INITIALIZED, INVALID_VALUE, NOT_SUPPORTED = 0, 1, 7, 15
POINTER_MODE_HOST = 0


def _value(x):
    """An integer argument as ctypes passes it: a c_void_p (a handle), a byref() of one, or an int."""
    if isinstance(x, ctypes.c_void_p):
        return x.value
    return x


def _float(pointer) -> float:
    return float(pointer._obj.value)  # byref(c_float): host pointer mode, read when the call is made


class FakeCublas:
    _name = "tests/cudasim/fake_cublas.py (the simulator's stand-in)"

    def __init__(self):
        self._handles: dict[int, dict] = {}
        self._ids = itertools.count(0x2000, 0x10)

    def _handle(self, handle) -> dict | None:
        return self._handles.get(_value(handle))

    def cublasCreate_v2(self, handle):
        key = next(self._ids)
        self._handles[key] = {"stream": 0, "mode": POINTER_MODE_HOST, "workspace": None}
        handle._obj.value = key
        return SUCCESS

    def cublasDestroy_v2(self, handle):
        return SUCCESS if self._handles.pop(_value(handle), None) is not None else NOT_INITIALIZED

    def cublasSetStream_v2(self, handle, streamId):
        state = self._handle(handle)
        if state is None:
            return NOT_INITIALIZED
        state["stream"] = int(_value(streamId) or 0)
        return SUCCESS

    def cublasSetPointerMode_v2(self, handle, mode):
        state = self._handle(handle)
        if state is None:
            return NOT_INITIALIZED
        if mode != POINTER_MODE_HOST:
            return NOT_SUPPORTED  # not what the backend asks for, so not what this stand-in models
        return SUCCESS

    def cublasSetWorkspace_v2(self, handle, workspace, workspaceSizeInBytes):
        state = self._handle(handle)
        if state is None:
            return NOT_INITIALIZED
        state["workspace"] = (int(_value(workspace)), int(workspaceSizeInBytes))
        return SUCCESS

    def cublasGetVersion_v2(self, handle, version):
        version._obj.value = 130000
        return SUCCESS

    def _run(self, handle, product) -> int:
        state = self._handle(handle)
        if state is None:
            return NOT_INITIALIZED
        try:
            product(_stream_of(state["stream"]), state["workspace"])
        except CUBLASError:
            return NOT_SUPPORTED
        return SUCCESS

    def cublasGemmEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
                     ldc, computeType, algo):
        a, b = _float(alpha), _float(beta)
        return self._run(handle, lambda stream, workspace: gemm_ex(
            stream, transa, transb, m, n, k, a, A, Atype, lda, B, Btype, ldb, b, C, Ctype, ldc, computeType,
            workspace))

    def cublasGemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype,
                                   ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        a, b = _float(alpha), _float(beta)
        return self._run(handle, lambda stream, workspace: gemm_strided_batched_ex(
            stream, transa, transb, m, n, k, a, A, Atype, lda, strideA, B, Btype, ldb, strideB, b, C, Ctype, ldc,
            strideC, batchCount, computeType, workspace))


def install() -> None:
    install_library("xtrain_dist.backend.cuda.cublas", FakeCublas)
