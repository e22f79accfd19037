"""A stand-in for libcublasLt: the functions xtrain_dist/backend/cuda/cublaslt.py calls, on fake_cupy's memory.

`install()` makes `xtrain_dist.backend.cuda.cublaslt` find this object as its loaded library (when that module
is imported, not now: the checkout's xtrain_dist may not be on the path yet). Then:

- Descriptors are Python dicts behind integer handles written through the caller's pointer, as the
  library writes its opaque pointers.
- Attributes are read from the bytes the caller passes, and a size other than the one cublasLt.h gives
  the attribute is CUBLAS_STATUS_INVALID_VALUE, as the real library answers (tests/test_cublaslt.py
  checks the sizes against it).
- The heuristic refuses an A of one row or column, as the library has.
- cublasLtMatmul checks that the layouts agree with the operation (op(A) rows x k, op(B) k x cols, D rows
  x cols), that the algorithm came from the heuristic, that the pointers are as aligned as the preference
  promised (the bias as D), the workspace as large, and that it runs on the current stream; then computes
  through fake_cupy's gemm with the bias added to the float32 product before the one rounding to D's type.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import itertools
import sys

import numpy as np
from fake_cupy import _ELEMENT, _gemm, _gemm_operation, _memory, _queue, _to_float, get_current_stream, raw_operation

SUCCESS, INVALID_VALUE, NOT_SUPPORTED = 0, 7, 15
DESC_SIZES = {0: 4, 1: 4, 3: 4, 4: 4, 7: 4, 8: 8, 26: 4}  # cublasLt.h's types of the attributes we know
PREF_SIZES = {1: 8, 5: 4, 6: 4, 7: 4, 8: 4}
ALGO_MARK = 0x5EED


class FakeCublasLt:
    _name = "tests/cudasim/fake_cublaslt.py (the simulator's stand-in)"

    def __init__(self):
        self._objects: dict[int, dict] = {}
        self._handles = itertools.count(0x1000, 0x10)

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

    def cublasLtCreate(self, out_ref):
        return self._new(out_ref, kind="handle")

    def cublasLtMatmulDescCreate(self, out_ref, compute, scale_type):
        return self._new(out_ref, kind="desc", compute=compute, scale_type=scale_type,
                         attributes={3: 0, 4: 0, 7: 1, 8: None, 26: -1})

    def cublasLtMatmulDescSetAttribute(self, desc, attribute, ref, size):
        if not self._sized(ref, size, DESC_SIZES, attribute):
            return INVALID_VALUE
        self._get(desc)["attributes"][attribute] = ref._obj.value
        return SUCCESS

    def cublasLtMatrixLayoutCreate(self, out_ref, kind, rows, cols, ld):  # ld is checked by the product
        return self._new(out_ref, kind="layout", type=kind, rows=rows, cols=cols, ld=ld)

    def cublasLtMatmulPreferenceCreate(self, out_ref):
        return self._new(out_ref, kind="preference", attributes={1: 0, 5: 256, 6: 256, 7: 256, 8: 256})

    def cublasLtMatmulPreferenceSetAttribute(self, preference, attribute, ref, size):
        if not self._sized(ref, size, PREF_SIZES, attribute):
            return INVALID_VALUE
        self._get(preference)["attributes"][attribute] = ref._obj.value
        return SUCCESS

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, preference, count, result_ref, found_ref):
        if count < 1:
            return INVALID_VALUE
        # the library has answered INVALID_VALUE for an A of one row or column (PyTorch's addmm keeps such
        # products off cuBLASLt for it); the backend must not ask
        layout_a = self._get(a)
        if 1 in (layout_a["rows"], layout_a["cols"]):
            return INVALID_VALUE
        result = result_ref._obj
        result.algo.data[0], result.algo.data[1] = ALGO_MARK, self._get(preference)["attributes"][1]
        result.algo.data[2:6] = [self._get(preference)["attributes"][i] for i in (5, 6, 7, 8)]
        result.workspaceSize, result.state = 0, SUCCESS
        found_ref._obj.value = 1
        return SUCCESS

    def cublasLtMatmul(self, handle, desc, alpha_ref, A, a_layout, B, b_layout, beta_ref, C, c_layout, D, d_layout,
                       algo_ref, workspace, workspace_bytes, stream):
        op = self._get(desc)
        attrs = op["attributes"]
        la, lb, lc, ld = (self._get(x) for x in (a_layout, b_layout, c_layout, d_layout))
        algo = algo_ref._obj
        transa, transb = attrs[3], attrs[4]
        m, n = ld["rows"], ld["cols"]
        k = la["cols"] if transa == 0 else la["rows"]
        if (la["rows"] if transa == 0 else la["cols"]) != m or (lb["rows"], lb["cols"]) != ((k, n) if transb == 0
                                                                                           else (n, k)):
            return INVALID_VALUE
        if lc != ld or C != D or la["type"] != lb["type"]:
            return NOT_SUPPORTED
        if algo.data[0] != ALGO_MARK or workspace_bytes < algo.data[1]:
            return INVALID_VALUE
        for pointer, promised in zip((A, B, C, D), algo.data[2:6], strict=True):
            if pointer % promised:
                return NOT_SUPPORTED  # the algorithm was chosen for an alignment this pointer lacks
        if stream != get_current_stream().ptr:
            raise AssertionError(f"cublasLtMatmul on stream {stream:#x}, the thread's current one is "
                                 f"{get_current_stream().ptr:#x}")
        bias_type = bias_ptr = None
        if attrs[7] == 4:  # CUBLASLT_EPILOGUE_BIAS
            bias_type, bias_ptr = ld["type"] if attrs[26] == -1 else attrs[26], attrs[8]
            if not bias_ptr:
                return INVALID_VALUE
            if bias_type != ld["type"]:
                return NOT_SUPPORTED  # the bias has D's type (the only combination this module asks for)
            if bias_ptr % algo.data[5]:
                return NOT_SUPPORTED  # the bias is read like D: as aligned as D's promise (cublaslt.py says why)
        elif attrs[7] != 1:
            return NOT_SUPPORTED
        if not (isinstance(alpha_ref._obj, ctypes.c_float) and isinstance(beta_ref._obj, ctypes.c_float)):
            return INVALID_VALUE  # the scale type is float32 (cublasLtMatmulDescCreate's scaleType)
        alpha, beta = alpha_ref._obj.value, beta_ref._obj.value

        def run():  # now, or at each launch of the graph a capture records it into
            bias = None
            if bias_ptr is not None:
                item = np.dtype(_ELEMENT[bias_type]).itemsize
                raw_operation(get_current_stream(), "cublasLtMatmul (bias)", [(bias_ptr, bias_ptr + m * item, False)])
                bias = _to_float(_memory(bias_ptr, _ELEMENT[bias_type], m), bias_type)
            _gemm_operation("cublasLtMatmul", transa, transb, m, n, k, A, la["type"], la["ld"], B, lb["type"],
                            lb["ld"], D, ld["type"], ld["ld"])
            raw_operation(get_current_stream(), "cublasLtMatmul (workspace)",
                          [(workspace, workspace + workspace_bytes, True)])
            _gemm(transa, transb, m, n, k, alpha, A, la["type"], la["ld"], B, lb["type"], lb["ld"], beta, D,
                  ld["type"], ld["ld"], op["compute"], bias=bias)

        _queue(stream, run)
        return SUCCESS


class _SetLibraryOnImport(importlib.abc.MetaPathFinder):
    """Loads xtrain_dist.backend.cuda.cublaslt as usual, then sets its library to the fake."""

    NAME = "xtrain_dist.backend.cuda.cublaslt"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._library = FakeCublasLt()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if _SetLibraryOnImport.NAME in sys.modules:
        sys.modules[_SetLibraryOnImport.NAME]._library = FakeCublasLt()
    elif not any(isinstance(f, _SetLibraryOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _SetLibraryOnImport())
