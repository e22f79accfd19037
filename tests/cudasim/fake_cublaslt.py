"""A stand-in for libcublasLt: the functions xtrain_dist/backend/cuda/cublaslt.py calls, on fake_cupy's memory.

`install()` makes `xtrain_dist.backend.cuda.cublaslt` find this object as its loaded library (when that module
is imported, not now: the checkout's xtrain_dist may not be on the path yet). Then:

- Descriptors are Python dicts behind integer handles written through the caller's pointer, as the
  library writes its opaque pointers.
- Attributes are read from the bytes the caller passes, and a size other than the one cublasLt.h gives
  the attribute is CUBLAS_STATUS_INVALID_VALUE, as the real library answers (tests/test_cublaslt.py
  checks the sizes against it).
- The heuristic refuses an A of one row or column, as the library has; otherwise it offers ALGORITHMS
  algorithms (or as many as asked for), their rank in word 6, and each product records the rank it ran
  (`ranks_run`), so that a test sees which one a tuning table chose.
- cublasLtMatmul checks that the layouts agree with the operation (op(A) rows x k, op(B) k x cols, D rows
  x cols), that the algorithm came from the heuristic, that the pointers are as aligned as the preference
  promised (the bias and the aux matrix as D), the workspace as large, and that it runs on the current
  stream; then computes through fake_cupy's gemm, the epilogue acting on the float32 product before the one
  rounding to D's type: BIAS adds the bias; GELU_AUX_BIAS adds it, writes the sum to the aux matrix (D's type,
  its own leading dimension, a multiple of 8 as cublasLt.h requires) and applies GELU, the tanh approximation
  in float32; DGELU multiplies by GELU's derivative at the aux matrix; BGRADA writes the sum of op(A) over k
  to the bias pointer (in D's type, as cublasLt.h says of a bias gradient). beta is D's own (C is D).
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import itertools
import sys

import numpy as np
from fake_cupy import (
    _ELEMENT,
    CUDA_R_16BF,
    _bf16_bits,
    _gemm,
    _gemm_operation,
    _memory,
    _queue,
    _to_float,
    get_current_stream,
    raw_operation,
)

SUCCESS, INVALID_VALUE, NOT_SUPPORTED = 0, 7, 15
# cublasLtEpilogue_t and cublasLtMatmulDescAttributes_t, cublasLt.h's values (tests/test_cublaslt.py checks them)
DEFAULT, BIAS, GELU_AUX_BIAS, DGELU, BGRADA = 1, 4, 164, 192, 256
TRANSA, TRANSB, EPILOGUE, BIAS_POINTER, AUX_POINTER, AUX_LD, AUX_DATA_TYPE, BIAS_DATA_TYPE = 3, 4, 7, 8, 11, 12, 22, 26
GELU_SCALE, GELU_CUBIC = np.float32(np.sqrt(2.0 / np.pi)), np.float32(0.044715)
# cublasLt.h's sizes of the attributes we know (tests/test_cublaslt.py reads them from the header)
DESC_SIZES = {0: 4, 1: 4, 3: 4, 4: 4, 7: 4, 8: 8, 11: 8, 12: 8, 22: 4, 26: 4}
PREF_SIZES = {1: 8, 5: 4, 6: 4, 7: 4, 8: 4}
ALGO_MARK = 0x5EED
ALGORITHMS = 4  # how many algorithms the heuristic offers for any product (at most as many as asked for)


class FakeCublasLt:
    _name = "tests/cudasim/fake_cublaslt.py (the simulator's stand-in)"

    def __init__(self):
        self._objects: dict[int, dict] = {}
        self._handles = itertools.count(0x1000, 0x10)
        self.ranks_run: list[int] = []  # the heuristic rank of each product's algorithm, in call order

    def _new(self, out_ref, **fields) -> int:
        handle = next(self._handles)
        self._objects[handle] = fields
        out_ref._obj.value = handle
        return SUCCESS

    def _get(self, handle) -> dict:
        return self._objects[handle.value if isinstance(handle, ctypes.c_void_p) else handle]

    @staticmethod
    def _sized(ref, size: int, sizes: dict, attribute: int) -> bool:
        return sizes.get(attribute) == size == ctypes.sizeof(ref._obj)

    @staticmethod
    def cublasLtGetVersion():
        return 0

    def cublasLtCreate(self, lightHandle):
        return self._new(lightHandle, kind="handle")

    def cublasLtMatmulDescCreate(self, matmulDesc, computeType, scaleType):
        return self._new(matmulDesc, kind="desc", compute=computeType, scale_type=scaleType,
                         attributes={TRANSA: 0, TRANSB: 0, EPILOGUE: DEFAULT, BIAS_POINTER: None, AUX_POINTER: None,
                                     AUX_LD: 0, AUX_DATA_TYPE: -1, BIAS_DATA_TYPE: -1})

    def cublasLtMatmulDescSetAttribute(self, matmulDesc, attr, buf, sizeInBytes):
        if not self._sized(buf, sizeInBytes, DESC_SIZES, attr):
            return INVALID_VALUE
        self._get(matmulDesc)["attributes"][attr] = buf._obj.value
        return SUCCESS

    def cublasLtMatrixLayoutCreate(self, matLayout, type, rows, cols, ld):  # the header's names
        return self._new(matLayout, kind="layout", type=type, rows=rows, cols=cols, ld=ld)  # ld: the product checks

    def cublasLtMatmulPreferenceCreate(self, pref):
        return self._new(pref, kind="preference", attributes={1: 0, 5: 256, 6: 256, 7: 256, 8: 256})

    def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, buf, sizeInBytes):
        if not self._sized(buf, sizeInBytes, PREF_SIZES, attr):
            return INVALID_VALUE
        self._get(pref)["attributes"][attr] = buf._obj.value
        return SUCCESS

    def cublasLtMatmulAlgoGetHeuristic(self, lightHandle, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, preference,
                                       requestedAlgoCount, heuristicResultsArray, returnAlgoCount):
        if requestedAlgoCount < 1:
            return INVALID_VALUE
        # the library has answered INVALID_VALUE for an A of one row or column (PyTorch's addmm keeps such
        # products off cuBLASLt for it); the backend must not ask
        layout_a = self._get(Adesc)
        if 1 in (layout_a["rows"], layout_a["cols"]):
            return INVALID_VALUE
        # ALGORITHMS of them, best-estimated first, each marked with its rank (word 6)
        offered = min(requestedAlgoCount, ALGORITHMS)
        for rank in range(offered):
            result = heuristicResultsArray[rank]
            result.algo.data[0], result.algo.data[1] = ALGO_MARK, self._get(preference)["attributes"][1]
            result.algo.data[2:6] = [self._get(preference)["attributes"][i] for i in (5, 6, 7, 8)]
            result.algo.data[6] = rank
            result.workspaceSize, result.state = 0, SUCCESS
        returnAlgoCount._obj.value = offered
        return SUCCESS

    def cublasLtMatmul(self, lightHandle, computeDesc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo,
                       workspace, workspaceSizeInBytes, stream):
        op = self._get(computeDesc)
        attrs = op["attributes"]
        la, lb, lc, ld = (self._get(x) for x in (Adesc, Bdesc, Cdesc, Ddesc))
        chosen = algo._obj
        transa, transb = attrs[TRANSA], attrs[TRANSB]
        m, n = ld["rows"], ld["cols"]
        k = la["cols"] if transa == 0 else la["rows"]
        if (la["rows"] if transa == 0 else la["cols"]) != m or (lb["rows"], lb["cols"]) != ((k, n) if transb == 0
                                                                                           else (n, k)):
            return INVALID_VALUE
        if lc != ld or C != D or la["type"] != lb["type"]:
            return NOT_SUPPORTED
        if chosen.data[0] != ALGO_MARK or chosen.data[6] >= ALGORITHMS or workspaceSizeInBytes < chosen.data[1]:
            return INVALID_VALUE
        self.ranks_run.append(chosen.data[6])
        for pointer, promised in zip((A, B, C, D), chosen.data[2:6], strict=True):
            if pointer % promised:
                return NOT_SUPPORTED  # the algorithm was chosen for an alignment this pointer lacks
        if stream != get_current_stream().ptr:
            raise AssertionError(f"cublasLtMatmul on stream {stream:#x}, the thread's current one is "
                                 f"{get_current_stream().ptr:#x}")
        epilogue = attrs[EPILOGUE]
        if epilogue not in (DEFAULT, BIAS, GELU_AUX_BIAS, DGELU, BGRADA):
            return NOT_SUPPORTED
        d_item = np.dtype(_ELEMENT[ld["type"]]).itemsize
        bias_ptr = aux_ptr = None
        if epilogue in (BIAS, GELU_AUX_BIAS, BGRADA):
            bias_type = ld["type"] if attrs[BIAS_DATA_TYPE] == -1 else attrs[BIAS_DATA_TYPE]
            bias_ptr = attrs[BIAS_POINTER]
            if not bias_ptr:
                return INVALID_VALUE
            if bias_type != ld["type"]:
                return NOT_SUPPORTED  # the bias (or its gradient) has D's type: all the backend asks for
            if bias_ptr % chosen.data[5]:
                return NOT_SUPPORTED  # the bias is read like D: as aligned as D's promise (cublaslt.py says why)
        if epilogue in (GELU_AUX_BIAS, DGELU):
            aux_ptr, aux_ld = attrs[AUX_POINTER], attrs[AUX_LD]
            aux_type = ld["type"] if attrs[AUX_DATA_TYPE] == -1 else attrs[AUX_DATA_TYPE]
            if not aux_ptr or aux_ld < m or aux_ld % 8:
                return INVALID_VALUE  # cublasLt.h: "divisible by 8 and no less than the number of rows"
            if aux_type != ld["type"]:
                return NOT_SUPPORTED
            if aux_ptr % chosen.data[5]:
                return NOT_SUPPORTED  # as aligned as D's promise, like the bias
        if not (isinstance(alpha._obj, ctypes.c_float) and isinstance(beta._obj, ctypes.c_float)):
            return INVALID_VALUE  # the scale type is float32 (cublasLtMatmulDescCreate's scaleType)
        alpha_value, beta_value = alpha._obj.value, beta._obj.value
        if beta_value != 0.0 and epilogue != BGRADA and epilogue != DEFAULT:
            return NOT_SUPPORTED  # not a combination the backend asks for, so not one this stand-in models
        d_type = ld["type"]

        def run():  # now, or at each launch of the graph a capture records it into
            stream_now = get_current_stream()
            bias = None
            if epilogue in (BIAS, GELU_AUX_BIAS):
                raw_operation(stream_now, "cublasLtMatmul (bias)", [(bias_ptr, bias_ptr + m * d_item, False)])
                bias = _to_float(_memory(bias_ptr, _ELEMENT[d_type], m), d_type)
            aux = None
            if aux_ptr is not None:
                end = aux_ptr + (aux_ld * (n - 1) + m) * d_item
                raw_operation(stream_now, "cublasLtMatmul (aux)", [(aux_ptr, end, epilogue == GELU_AUX_BIAS)])
                flat = _memory(aux_ptr, _ELEMENT[d_type], aux_ld * (n - 1) + m)
                aux = np.lib.stride_tricks.as_strided(flat, (m, n), (flat.itemsize, aux_ld * flat.itemsize),
                                                      writeable=True)
            if epilogue == BGRADA:
                raw_operation(stream_now, "cublasLtMatmul (bias gradient)", [(bias_ptr, bias_ptr + m * d_item, True)])

            def finish(result, op_a):
                if epilogue == GELU_AUX_BIAS:
                    aux[...] = _bf16_bits(result) if d_type == CUDA_R_16BF else result
                    return _gelu(result)
                if epilogue == DGELU:
                    return result * _gelu_derivative(_to_float(aux, d_type))
                if epilogue == BGRADA:
                    sums = op_a.sum(axis=1, dtype=np.float32)
                    _memory(bias_ptr, _ELEMENT[d_type], m)[...] = _bf16_bits(sums) if d_type == CUDA_R_16BF else sums
                return result

            _gemm_operation(stream_now, "cublasLtMatmul", transa, transb, m, n, k, A, la["type"], la["ld"], B,
                            lb["type"], lb["ld"], D, ld["type"], ld["ld"])
            raw_operation(stream_now, "cublasLtMatmul (workspace)",
                          [(workspace, workspace + workspaceSizeInBytes, True)])
            _gemm(transa, transb, m, n, k, alpha_value, A, la["type"], la["ld"], B, lb["type"], lb["ld"], beta_value,
                  D, ld["type"], ld["ld"], op["compute"], bias=bias,
                  epilogue=None if epilogue in (DEFAULT, BIAS) else finish)

        _queue(stream, run)
        return SUCCESS


def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation in float32, as cuBLASLt's GELU epilogues compute it (and numpy_ops' gelu_forward)."""
    return np.float32(0.5) * x * (1 + np.tanh(GELU_SCALE * (x + GELU_CUBIC * x * x * x)))


def _gelu_derivative(x: np.ndarray) -> np.ndarray:
    """d gelu / dx, numpy_ops.gelu_backward's grouping, in float32."""
    x2 = x * x
    th = np.tanh(GELU_SCALE * x * (1 + GELU_CUBIC * x2))
    slope = np.float32(0.5) * GELU_SCALE * x * (1 + np.float32(3) * GELU_CUBIC * x2) * (1 - th * th)
    return (th + 1) * np.float32(0.5) + slope


class SetLibraryOnImport(importlib.abc.MetaPathFinder):
    """Loads module `name` (xtrain_dist.backend.cuda.cublaslt, or .cublas) as usual, then sets its library to
    `make()`, a stand-in."""

    def __init__(self, name: str, make):
        self.name, self.make = name, make

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._library = self.make()

        spec.loader.exec_module = exec_module
        return spec


def install_library(name: str, make) -> None:
    """Make module `name` find `make()` as its loaded library, now if it is imported, else when it is."""
    if name in sys.modules:
        sys.modules[name]._library = make()
    elif not any(isinstance(f, SetLibraryOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, SetLibraryOnImport(name, make))


def install() -> None:
    install_library("xtrain_dist.backend.cuda.cublaslt", FakeCublasLt)
