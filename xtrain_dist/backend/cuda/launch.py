"""What every op of the CUDA backend shares in launching its kernels: the chunked kernels' block, grid
arithmetic, the vector-path test and the checks of an argument's layout and dtype (ops.py, attention.py).
"""

import numpy as np

# A host choice, which no kernel assumes: the chunked kernels (elementwise, split and merge heads), the
# column sums' second stage and encoder_backward_wte index by blockDim, so any multiple of 32 serves:
# 256 threads, 8 warps.
BLOCK = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chunk_grid(n: int, width: int, vec: int) -> tuple[int]:
    """The 1-D grid of a chunked kernel (common.cuh's chunk_start): a thread per `width` elements when
    `vec`, else per element, BLOCK threads a block. Empty when n = 0: _launch then launches nothing."""
    return (_cdiv(_cdiv(n, width if vec else 1), BLOCK),)


def _vec(width: int, *arrays, row: int | None = None) -> int:
    """1 if every array (None: absent) starts on a boundary of `width` of its own elements (16 bytes
    for width = 16 / itemsize; 32 for a float32 array read 8 at a time beside bf16) and `row`, the
    length that chunks must not cross, is a multiple of width; else 0 (scalar kernels)."""
    if row is not None and row % width:
        return 0
    return int(all(a.data.ptr % (a.itemsize * width) == 0 for a in arrays if a is not None))


def _contiguous(a):
    if not a.flags.c_contiguous:
        raise ValueError(f"cuda_ops: expected a C-contiguous array, got shape {a.shape} strides {a.strides}")
    return a


def _f32(*arrays) -> None:
    """Buffers that are float32 in every precision: gradients, statistics, scores, optimizer state."""
    for a in arrays:
        if a.dtype != np.float32:
            raise TypeError(f"cuda_ops: expected a float32 array, got {a.dtype}")
