"""CudaBackend's dropout (kernels/dropout.cu), a mixin as the products are (gemm.py): numpy_ops.dropout on the GPU,
the same Philox-4x32-10 bits (backend/dropout.py keys the masks)."""

from __future__ import annotations

import numpy as np

from ..dropout import check_elements
from .compile import kernel_constant
from .device import cupy

DROPOUT_BLOCK = kernel_constant("dropout", "DROPOUT_BLOCK")


class DropoutOps:
    """The class that mixes it in provides _launch, _act and _k (the kernels of its precision)."""

    def dropout(self, x, site, wide: bool = False):
        """numpy_ops.dropout: a new array. wide: x is a float32 buffer in every precision (dropout_f32)."""
        out = cupy.empty_like(x)
        self._dropout_into(out, x, site, wide)
        return out

    def _dropout_into(self, out, x, site, wide: bool = False) -> None:
        """out = dropout(x) at `site`; out may be x (in place: attention's probability gradient)."""
        for a in (out, x):
            if not a.flags.c_contiguous:
                raise ValueError(f"cuda_ops dropout: expected a C-contiguous array, got strides {a.strides}")
        if wide:
            if x.dtype != np.float32 or out.dtype != np.float32:
                raise TypeError(f"cuda_ops dropout: a wide buffer is float32, got {x.dtype}")
        else:
            self._act(out, x)
        if site.step.dtype != np.uint32 or site.step.size != 1:
            raise TypeError("cuda_ops dropout: the step is a (1,) uint32 array on the device")
        L = check_elements(site, x.shape)
        key0, key1 = site.key
        kernel = self._k.dropout_f32 if wide else self._k.dropout_act
        self._launch(kernel, (-(-x.size // DROPOUT_BLOCK),), (DROPOUT_BLOCK,), out, x, np.int64(x.size), np.int64(L),
                     np.int32(site.groups), np.int32(site.group0), np.int64(site.seq0), np.int64(site.seq_stride),
                     np.uint32(key0), np.uint32(key1), site.step, np.uint32(site.layer_site),
                     np.uint32(site.threshold), np.float32(site.scale))
