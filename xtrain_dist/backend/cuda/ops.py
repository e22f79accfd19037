"""The CUDA backend: numpy_ops' ops, one for one, on one GPU, through kernels/*.cu and cuBLAS.

How it works (streams, kernels and their compilation, products, bf16 storage): docs/cuda_backend.md.
This module owns CudaBackend and its ops: checking their arguments, each kernel's launch (geometry,
vector or scalar path) and the order of the calls. Call a backend's ops only from the thread that made it.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import XtrainError
from ...precision import check_dtype, check_matmul
from .. import numpy_ops
from . import cublas, cublaslt
from .compile import Kernels, kernel_constant
from .device import check_stream, cupy, device_count, on_stream
from .dropout import DropoutOps
from .gemm import CublasProducts, _matrix_layout

# --dtype -> how activations are stored: bf16 as uint16 arrays holding the bits (docs/cuda_backend.md)
ACT_DTYPES: dict[str, np.dtype] = {"fp32": np.dtype(np.float32), "bf16": np.dtype(np.uint16)}

# ---------------------------------------------------------------------------- launch geometry

# The block shapes the kernels are written for, read from beside them in their files, so that a kernel
# and its launch cannot disagree: warp-per-row kernels (a row per warp, so rows per block and threads),
# block-per-row classifier, the norm's two stages, the column sums' (32, COL_ROWS) blocks, flash
# attention's tiles.
LAYERNORM_ROWS_PER_BLOCK = kernel_constant("layernorm", "LAYERNORM_ROWS_PER_BLOCK")
LAYERNORM_BLOCK = kernel_constant("layernorm", "LAYERNORM_BLOCK")
SOFTMAX_ROWS_PER_BLOCK = kernel_constant("attention", "SOFTMAX_ROWS_PER_BLOCK")
SOFTMAX_BLOCK = kernel_constant("attention", "SOFTMAX_BLOCK")
CLASSIFIER_BLOCK = kernel_constant("classifier", "CLASSIFIER_BLOCK")
NORM_BLOCK = kernel_constant("global_norm", "NORM_BLOCK")
NORM_MAX_BLOCKS = kernel_constant("global_norm", "NORM_MAX_BLOCKS")
COLUMN_BLOCK = (kernel_constant("matmul", "WARP_SIZE"), kernel_constant("matmul", "COL_ROWS"))
FLASH_HS = kernel_constant("flash_attention", "FLASH_HS")
FLASH_TILE = kernel_constant("flash_attention", "FLASH_TILE")
FLASH_WARPS = kernel_constant("flash_attention", "FLASH_WARPS")
FLASH_THREADS = kernel_constant("flash_attention", "FLASH_THREADS")
MMA_HS = kernel_constant("flash_attention_mma", "MMA_HS")
MMA_THREADS = kernel_constant("flash_attention_mma", "MMA_THREADS")
MMA_BLOCK_ROWS = kernel_constant("flash_attention_mma", "MMA_BLOCK_ROWS")
MMA_DOT_ROWS = kernel_constant("flash_attention_mma", "MMA_DOT_ROWS")
MMA_TILE = kernel_constant("flash_attention_mma", "MMA_TILE")
# --attention flash's kernels: flash_attention_mma.cu (FlashAttention-2's scheme on mma.sync), or the WMMA
# kernels of flash_attention.cu it replaced, which bin/bench_attention still races (CudaBackend(flash_kernels=)).
# Both compute numpy_ops' flash attention, key tiles of numpy_ops.FLASH_TILE, rounded at the same places.
FLASH_KERNELS = ("mma", "wmma")

# Host choices, which no kernel assumes. The chunked kernels (elementwise, split and merge heads), the
# column sums' second stage and encoder_backward_wte index by blockDim, so any multiple of 32 serves:
# 256 threads, 8 warps.
BLOCK = 256
ROW_ALIGN = 64         # unbiased products' rows (the logits) start this many elements apart at least
# Standard attention's products in chunks of this many query rows, each against only the keys it may see
# (_causal_chunks): at T = 1024, 4 chunks compute 10/16 of the T x T products the mask would otherwise halve
CAUSAL_CHUNK = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chunk_grid(n: int, width: int, vec: int) -> tuple[int]:
    """The 1-D grid of a chunked kernel (common.cuh's chunk_start): a thread per `width` elements when
    `vec`, else per element, BLOCK threads a block. Empty when n = 0: _launch then launches nothing."""
    return (_cdiv(_cdiv(n, width if vec else 1), BLOCK),)


def _column_splits(rows: int) -> tuple[int, int]:
    """(splits, rows_per_split) for the deterministic column sums: at most 128 splits of at least 32
    rows. A function of the row count only, so the summation order never depends on the device."""
    rows_per_split = max(32, _cdiv(rows, 128))
    return _cdiv(rows, rows_per_split), rows_per_split


def _vec(width: int, *arrays, row: int | None = None) -> int:
    """1 if every array (None: absent) starts on a boundary of `width` of its own elements (16 bytes
    for width = 16 / itemsize; 32 for a float32 array read 8 at a time beside bf16) and `row`, the
    length that chunks must not cross, is a multiple of width; else 0 (scalar kernels)."""
    if row is not None and row % width:
        return 0
    return int(all(a.data.ptr % (a.itemsize * width) == 0 for a in arrays if a is not None))


def _causal_chunks(T: int) -> list[tuple[int, int]]:
    """[r0, r1) row ranges of CAUSAL_CHUNK rows covering [0, T). Query rows [r0, r1) see keys [0, r1) only,
    and keys [r0, r1) are seen by query rows [r0, T) only: each product of causal attention runs per chunk
    over that part, and skips the blocks right of the diagonal that the mask would zero. The diagonal
    blocks are still computed whole (att and dscores are 0 above the diagonal, which the softmax kernels
    write)."""
    return [(r0, min(r0 + CAUSAL_CHUNK, T)) for r0 in range(0, T, CAUSAL_CHUNK)]


def _contiguous(a):
    if not a.flags.c_contiguous:
        raise ValueError(f"cuda_ops: expected a C-contiguous array, got shape {a.shape} strides {a.strides}")
    return a


def _f32(*arrays) -> None:
    """Buffers that are float32 in every precision: gradients, statistics, scores, optimizer state."""
    for a in arrays:
        if a.dtype != np.float32:
            raise TypeError(f"cuda_ops: expected a float32 array, got {a.dtype}")


# ---------------------------------------------------------------------------- the backend

def check_flash_attention(dtype: str, head_size: int, preset: str = "") -> None:
    """What kernels/flash_attention_mma.cu and flash_attention.cu compute: bf16 on tensor cores, 64-channel
    heads (every GPT-2 size)."""
    if dtype != "bf16":
        raise XtrainError("--attention flash on --backend cuda needs --dtype bf16 (its products run on bf16 "
                          "tensor cores; float32 runs use the standard attention)")
    if head_size != FLASH_HS:
        model = f"model '{preset}' has" if preset else "this model has"
        raise XtrainError(f"--attention flash on --backend cuda needs {FLASH_HS}-channel heads (GPT-2's); "
                          f"{model} {head_size}")


class CudaBackend(CublasProducts, DropoutOps):
    """numpy_ops on one CUDA device, on one stream owned by the calling (rank) thread."""

    name = "cuda"
    LN_EPS = numpy_ops.LN_EPS
    GELU_SCALE = numpy_ops.GELU_SCALE

    def __init__(self, device: int, allow_tf32: bool = False, dtype: str = "fp32", matmul: str = "cublas",
                 flash_kernels: str = "mma"):
        check_dtype(dtype)
        check_matmul(matmul)
        if flash_kernels not in FLASH_KERNELS:
            raise ValueError(f"cuda_ops: flash_kernels must be one of {FLASH_KERNELS}, got {flash_kernels!r}")
        count = device_count()
        if not 0 <= device < count:
            raise XtrainError(f"--backend cuda: device {device} does not exist ({count} visible)")

        self.xp = cupy
        self.device = device
        cupy.cuda.Device(device).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.allow_tf32 = allow_tf32
        self.dtype = dtype
        self.act_dtype = ACT_DTYPES[dtype]
        self.flash_kernels = flash_kernels
        self._k = Kernels(dtype)
        self._side_streams: set[int] = set()
        self._keep_alive: list = []
        self._vec_x = 16 // self.act_dtype.itemsize  # elements of floatX per 16 bytes: 4 (fp32) or 8 (bf16)
        self._init_products(allow_tf32, matmul)  # cuBLAS, and cuBLASLt's handle and workspace if asked
        # the bias gradient in the weight gradient's product (cuBLASLt's BGRADA) under --matmul cublaslt: off,
        # since on an H200 (bin/bench_gemm, 2026-11-26) it saved nothing in bf16 and fp32, and c_attn's came to
        # 5.0 ms against 0.13 ms without it; bench_gemm's "backward bgrad lt" rows time it with this set
        self.bias_grad_epilogue = False

    # ------------------------------------------------------------------ host/device plumbing
    def to_host(self, a) -> np.ndarray:
        """A host copy (waits for this stream's queued work). bf16 activations come back as float32,
        which holds every bf16 value exactly: the values numpy_ops' bf16 emulation holds."""
        if isinstance(a, cupy.ndarray):
            if not a.flags.c_contiguous:  # the classifier's padded logits rows, a transposed view
                a = on_stream(self.stream, a.copy)
            host = a.get(stream=self.stream)
            return numpy_ops.from_bf16_bits(host) if host.dtype == np.uint16 else host
        return np.asarray(a)

    def from_host(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        out = cupy.empty(a.shape, dtype=a.dtype)
        out.set(a, stream=self.stream)
        return out

    def to_host_later(self, a):
        a = _contiguous(a)
        # page-locked memory: the copy runs on the stream like a kernel, and the host waits only in result()
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(a.nbytes), dtype=a.dtype, count=a.size).reshape(a.shape)
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, a.nbytes, 2, self.stream.ptr)  # 2: to the host
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(self.stream)
        return _Copied(copied, host)

    def upload(self, dst, a) -> None:
        a = np.ascontiguousarray(a, dtype=dst.dtype)
        if a.shape != dst.shape:
            raise ValueError(f"upload: {a.shape} into {dst.shape}")
        _contiguous(dst).set(a, stream=self.stream)  # from pageable memory: staged at once, no wait for the GPU

    def from_host_act(self, a):
        """Host float32 data as an activation (or weight copy) of this backend: bf16 rounds to nearest even."""
        if self.act_dtype == np.uint16:
            return self.from_host(numpy_ops.bf16_bits(a))
        return self.from_host(np.asarray(a, dtype=np.float32))

    def synchronize(self) -> None:
        self.stream.synchronize()

    def _act(self, *arrays) -> None:
        """Activations and the weights forward reads: in this backend's activation dtype."""
        for a in arrays:
            if a.dtype != self.act_dtype:
                raise TypeError(f"cuda_ops ({self.dtype}): expected an activation of dtype {self.act_dtype}, "
                                f"got {a.dtype}")

    def _launch(self, kernel, grid, block, *args) -> None:
        """Queue a kernel on the calling thread's stream: the rank's, or a side thread's own (the products
        likewise take the cuBLAS handle of that stream: gemm.py)."""
        self._check_stream()
        if 0 in tuple(grid):  # an empty tensor: nothing to do, and CUDA refuses a grid of size 0
            return
        kernel(tuple(grid), tuple(block), args, stream=cupy.cuda.get_current_stream())

    def _check_stream(self) -> None:
        """RuntimeError unless the calling thread's current stream is this backend's or a side thread's
        (bind_side_thread): kernels, products and allocations go to the current stream (check_stream)."""
        check_stream(self.stream, self._side_streams)

    # ------------------------------------------------------------------ ordering across a rank's threads
    def bind_side_thread(self):
        """Called first in a helper thread of this rank (gradient sync's communication thread): bind the
        rank's device and give the thread a stream of its own, so its work (a bucket's reduction)
        runs beside the compute stream instead of behind it."""
        cupy.cuda.Device(self.device).use()
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.use()
        self._side_streams.add(stream.ptr)
        self._keep_alive.append(stream)
        # products on the side thread (PowerSGD's) run on its stream, with a handle and workspace of its own
        self._new_cublas_handle(stream, cublas.SIDE_WORKSPACE_BYTES)
        return stream

    def fence(self):
        """An event marking the work queued so far on the calling thread's stream."""
        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy.cuda.get_current_stream())
        return event

    def wait(self, event) -> None:
        """Make the calling thread's stream wait (on the device, the host does not block) for a fence."""
        if event is not None:
            cupy.cuda.get_current_stream().wait_event(event)

    @staticmethod
    def timestamp():
        """A timing event on the calling thread's stream: it takes its time when the GPU gets there."""
        event = cupy.cuda.Event()
        event.record(cupy.cuda.get_current_stream())
        return event

    @staticmethod
    def elapsed(start, end) -> float:
        """Seconds between two timestamps on the GPU (waits on the host for the later one)."""
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    # ------------------------------------------------------------------ encoder (kernels/encoder.cu)
    def encoder_forward(self, ids, wte, wpe):
        ids = _ids(ids)
        B, T = ids.shape
        V, C = wte.shape
        if wpe.shape[0] < T:
            raise ValueError(f"sequence length {T} exceeds the {wpe.shape[0]} learned positions")
        self._act(wte, wpe)
        out = cupy.empty((B, T, C), dtype=wte.dtype)
        vec = _vec(self._vec_x, out, _contiguous(wte), _contiguous(wpe), row=C)
        self._launch(self._k.encoder_forward, _chunk_grid(B * T * C, self._vec_x, vec), (BLOCK,),
                     out, ids, wte, wpe, np.int64(B * T), np.int32(T), np.int32(C), np.int32(V), np.int32(vec))
        return out

    def encoder_backward(self, dwte, dwpe, dout, ids) -> None:
        ids = _ids(ids)
        B, T = ids.shape
        V, C = dwte.shape
        _f32(dwte, dwpe)
        self._act(dout)
        dout = _contiguous(dout)
        # wpe: one thread per (t, channel chunk), summing over b in order
        vec = _vec(self._vec_x, _contiguous(dwpe), dout, row=C)
        self._launch(self._k.encoder_backward_wpe, _chunk_grid(T * C, self._vec_x, vec), (BLOCK,),
                     dwpe, dout, np.int32(B), np.int32(T), np.int32(C), np.int32(vec))
        # wte: positions sorted by token, stably (CuPy's argsort is always stable: thrust's
        # stable_sort_by_key, queued on the current stream without a host sync), then one block per
        # run of equal tokens adds that token's rows in (b, t) order
        flat = ids.reshape(-1)
        order = cupy.argsort(flat, kind="stable").astype(cupy.int64, copy=False)
        vec = _vec(self._vec_x, _contiguous(dwte), dout, row=C)
        width = self._vec_x if vec else 1
        threads = min(BLOCK, _cdiv(_cdiv(C, width), 32) * 32)
        grid = (B * T, _cdiv(_cdiv(C, width), threads))
        self._launch(self._k.encoder_backward_wte, grid, (threads,),
                     dwte, dout, flat, order, np.int64(B * T), np.int32(C), np.int32(V), np.int32(vec))

    # ------------------------------------------------------------------ layernorm (kernels/layernorm.cu)
    def layernorm_forward(self, inp, weight, bias):
        inp = _contiguous(inp)
        self._act(inp, weight, bias)
        C = inp.shape[-1]
        rows = inp.size // C
        out = cupy.empty_like(inp)
        mean = cupy.empty(inp.shape[:-1], dtype=cupy.float32)
        rstd = cupy.empty(inp.shape[:-1], dtype=cupy.float32)
        vec = _vec(self._vec_x, out, inp, weight, bias, row=C)
        self._launch(self._k.layernorm_forward, (_cdiv(rows, LAYERNORM_ROWS_PER_BLOCK),), (LAYERNORM_BLOCK,),
                     out, mean, rstd, inp, weight, bias, np.int64(rows), np.int32(C), np.float32(self.LN_EPS),
                     np.int32(vec))
        return out, mean, rstd

    def residual_layernorm_forward(self, a, b, weight, bias):
        a, b = _contiguous(a), _contiguous(b)
        self._act(a, b, weight, bias)
        if a.shape != b.shape:
            raise ValueError(f"residual_layernorm_forward: shapes {a.shape} and {b.shape} differ")
        C = a.shape[-1]
        rows = a.size // C
        residual, out = cupy.empty_like(a), cupy.empty_like(a)
        mean = cupy.empty(a.shape[:-1], dtype=cupy.float32)
        rstd = cupy.empty(a.shape[:-1], dtype=cupy.float32)
        vec = _vec(self._vec_x, residual, out, a, b, weight, bias, row=C)
        self._launch(self._k.residual_layernorm_forward, (_cdiv(rows, LAYERNORM_ROWS_PER_BLOCK),),
                     (LAYERNORM_BLOCK,), residual, out, mean, rstd, a, b, weight, bias, np.int64(rows), np.int32(C),
                     np.float32(self.LN_EPS), np.int32(vec))
        return residual, out, mean, rstd

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
        for a in (dinp, dout, inp, mean, rstd):
            _contiguous(a)
        _f32(dweight, dbias, mean, rstd)
        self._act(dinp, dout, inp, weight)
        C = inp.shape[-1]
        rows = inp.size // C
        vec = _vec(self._vec_x, dinp, dout, inp, weight, row=C)
        self._launch(self._k.layernorm_backward_input, (_cdiv(rows, LAYERNORM_ROWS_PER_BLOCK),), (LAYERNORM_BLOCK,),
                     dinp, dout, inp, weight, mean, rstd, np.int64(rows), np.int32(C), np.int32(vec))
        splits, rows_per_split = _column_splits(rows)
        partial_dw = cupy.empty((splits, C), dtype=cupy.float32)
        partial_db = cupy.empty((splits, C), dtype=cupy.float32)
        vec = _vec(self._vec_x, dout, inp, partial_dw, partial_db, row=C)
        width = self._vec_x if vec else 1
        self._launch(self._k.layernorm_backward_params, (_cdiv(C, COLUMN_BLOCK[0] * width), splits), COLUMN_BLOCK,
                     partial_dw, partial_db, dout, inp, mean, rstd, np.int64(rows), np.int32(C),
                     np.int32(rows_per_split), np.int32(vec))
        self._launch(self._k.layernorm_backward_params_finish, (_cdiv(C, BLOCK), 2), (BLOCK,),
                     _contiguous(dweight), partial_dw, _contiguous(dbias), partial_db, np.int32(splits), np.int32(C))

    # ------------------------------------------------------------------ matmul (cuBLAS; bias in kernels/matmul.cu)
    # --matmul cublaslt folds what follows or precedes a product into the product's epilogue (cublaslt.py):
    # the bias of every forward product, the c_fc layer's GELU (GELU_AUX_BIAS, which also writes the
    # pre-GELU sum backward needs), GELU's derivative into the c_proj layer's input gradient (DGELU), and,
    # where bias_grad_epilogue is set, every bias gradient into its weight-gradient product (BGRADA). Each
    # epilogue acts on the float32 accumulator before the output's one rounding: in fp32 the same values as
    # the kernels, in bf16 the two GELU epilogues skip the rounding of the product the kernels' path makes
    # between the product and GELU.
    # cuBLASLt's heuristic has refused an A of one row or column: such products stay on the kernels' path.

    def _lt_takes(self, *dims: int) -> bool:
        """Whether --matmul cublaslt runs a product whose cuBLASLt A has these sizes."""
        return self._lt is not None and min(dims) > 1

    def _linear_inputs(self, inp, weight):
        self._act(inp, weight)
        IC, OC = weight.shape
        return IC, OC, _contiguous(inp).reshape(-1, IC)

    def matmul_forward(self, inp, weight, bias=None):
        IC, OC, inp2 = self._linear_inputs(inp, weight)
        if bias is None:
            # rows padded to ROW_ALIGN elements: an odd width (bin/bench_gemm's unpadded V = 50257) makes every
            # row but the first start off cuBLAS's aligned paths, in this product and both of its backward
            # ones; the padding is never read. The model's logits are Vp wide, a multiple of VOCAB_ALIGN
            # (config.py) and so of ROW_ALIGN: their rows come back contiguous
            out = cupy.empty((inp2.shape[0], _round_up(OC, ROW_ALIGN)), dtype=self.act_dtype)[:, :OC]
            self._gemm(inp2, weight, out)
        elif self._lt_takes(IC, OC):  # product + bias rounded once, in one cuBLASLt call
            self._act(bias)
            out = cupy.empty((inp2.shape[0], OC), dtype=self.act_dtype)
            self._gemm_bias(inp2, weight, bias, out)
        else:  # the float32 product, then + bias rounded to floatX once (matmul.cu says why not beta = 1)
            self._act(bias)
            out = cupy.empty((inp2.shape[0], OC), dtype=self.act_dtype)
            product = out if out.dtype == np.float32 else cupy.empty(out.shape, dtype=cupy.float32)
            self._gemm(inp2, weight, product)
            vec = _vec(self._vec_x, out, product, _contiguous(bias), row=OC)
            self._launch(self._k.add_bias, _chunk_grid(out.size, self._vec_x, vec), (BLOCK,),
                         out, product, bias, np.int64(out.size), np.int32(OC), np.int32(vec))
        return out.reshape(*inp.shape[:-1], OC)

    def matmul_gelu_forward(self, inp, weight, bias):
        IC, OC, inp2 = self._linear_inputs(inp, weight)
        self._act(bias)
        pre = cupy.empty((inp2.shape[0], OC), dtype=self.act_dtype)
        out = cupy.empty_like(pre)
        if self._lt_takes(IC, OC) and OC % cublaslt.AUX_LD_MULTIPLE == 0:
            self._gemm_lt(inp2, weight, out, cublaslt.CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias=bias, aux=pre)
        else:  # the float32 product, then bias and GELU in one kernel (gelu.cu)
            product = pre if pre.dtype == np.float32 else cupy.empty(pre.shape, dtype=cupy.float32)
            self._gemm(inp2, weight, product)
            vec = _vec(self._vec_x, pre, out, product, _contiguous(bias), row=OC)
            self._launch(self._k.bias_gelu_forward, _chunk_grid(out.size, self._vec_x, vec), (BLOCK,),
                         pre, out, product, bias, np.int64(out.size), np.int32(OC), np.int32(vec))
        shape = (*inp.shape[:-1], OC)
        return pre.reshape(shape), out.reshape(shape)

    def _weight_gradients(self, dweight, dbias, dout2, inp2) -> None:
        """dweight += inp2^T dout2 (in place, dwte.T too); dbias += the column sums of dout2."""
        OC = dout2.shape[1]
        if dbias is not None:
            _f32(dbias)
        if dbias is not None and self.bias_grad_epilogue and self._lt_takes(OC, dout2.shape[0]):
            # the bias gradient in the weight gradient's product; cuBLASLt writes it, so into a scratch vector
            # that a one-split column sum then adds to dbias
            column_sums = cupy.empty(OC, dtype=cupy.float32)
            self._gemm_lt(inp2.T, dout2, dweight, cublaslt.CUBLASLT_EPILOGUE_BGRADA, bias=column_sums,
                          accumulate=True)
            self._launch(self._k.bias_backward_finish, (_cdiv(OC, BLOCK),), (BLOCK,),
                         _contiguous(dbias), column_sums, np.int32(1), np.int32(OC))
            return
        self._gemm(inp2.T, dout2, dweight, beta=1.0)
        if dbias is not None:
            dout2 = _contiguous(dout2)
            rows = dout2.shape[0]
            splits, rows_per_split = _column_splits(rows)
            partial = cupy.empty((splits, OC), dtype=cupy.float32)
            vec = _vec(self._vec_x, dout2, partial, row=OC)
            width = self._vec_x if vec else 1
            self._launch(self._k.bias_backward, (_cdiv(OC, COLUMN_BLOCK[0] * width), splits), COLUMN_BLOCK,
                         partial, dout2, np.int64(rows), np.int32(OC), np.int32(rows_per_split), np.int32(vec))
            self._launch(self._k.bias_backward_finish, (_cdiv(OC, BLOCK),), (BLOCK,),
                         _contiguous(dbias), partial, np.int32(splits), np.int32(OC))

    def matmul_backward(self, dweight, dbias, dout, inp, weight):
        _f32(dweight)
        self._act(dout)
        IC, OC, inp2 = self._linear_inputs(inp, weight)
        dout2, _ = _rows(dout, OC)  # the classifier's rows are padded (matmul_forward)
        self._weight_gradients(dweight, dbias, dout2, inp2)
        dinp = cupy.empty((dout2.shape[0], IC), dtype=self.act_dtype)
        self._gemm(dout2, weight.T, dinp)
        return dinp.reshape(inp.shape)

    def matmul_backward_gelu(self, dweight, dbias, dout, inp, weight, pre):
        _f32(dweight)
        self._act(dout, pre)
        IC, OC, inp2 = self._linear_inputs(inp, weight)
        dout2, _ = _rows(dout, OC)
        pre2 = _contiguous(pre).reshape(-1, IC)
        if pre2.shape[0] != dout2.shape[0]:
            raise ValueError(f"matmul_backward_gelu: pre {pre.shape} for an input {inp.shape}")
        self._weight_gradients(dweight, dbias, dout2, inp2)
        dpre = cupy.empty((dout2.shape[0], IC), dtype=self.act_dtype)
        if self._lt_takes(IC, OC) and IC % cublaslt.AUX_LD_MULTIPLE == 0:
            self._gemm_lt(dout2, weight.T, dpre, cublaslt.CUBLASLT_EPILOGUE_DGELU, aux=pre2)
        else:  # the input gradient, then GELU's derivative in place (gelu.cu)
            self._gemm(dout2, weight.T, dpre)
            self._elementwise(self._k.gelu_backward, dpre, dpre, pre2)
        return dpre.reshape(pre.shape)

    # ------------------------------------------------------------------ attention (kernels/attention.cu)
    def _head_launch(self, token_major, head_major: tuple, B: int, NH: int, T: int, hs: int):
        """Geometry shared by split_heads and merge_heads: one thread per chunk of the head-major arrays."""
        vec = _vec(self._vec_x, token_major, *head_major, row=hs)
        return _chunk_grid(B * NH * T * hs, self._vec_x, vec), (BLOCK,), vec

    def _split_heads(self, token_major, head_major: tuple, ld: int, B: int, NH: int, T: int, hs: int) -> None:
        """head_major[s] (B, NH, T, hs) <- part s of each (b, t) row of token_major (B, T, ld)."""
        grid, block, vec = self._head_launch(token_major, head_major, B, NH, T, hs)
        outs = (*head_major, *(None,) * (3 - len(head_major)))
        self._launch(self._k.split_heads, grid, block, *outs, token_major, np.int32(len(head_major)),
                     np.int32(B), np.int32(NH), np.int32(T), np.int32(hs), np.int32(ld), np.int32(vec))

    def _merge_heads(self, token_major, head_major: tuple, ld: int, B: int, NH: int, T: int, hs: int) -> None:
        """Part s of each (b, t) row of token_major (B, T, ld) <- head_major[s] (B, NH, T, hs)."""
        grid, block, vec = self._head_launch(token_major, head_major, B, NH, T, hs)
        ins = (*head_major, *(None,) * (3 - len(head_major)))
        self._launch(self._k.merge_heads, grid, block, token_major, *ins, np.int32(len(head_major)),
                     np.int32(B), np.int32(NH), np.int32(T), np.int32(hs), np.int32(ld), np.int32(vec))

    def _softmax(self, att, scores, T: int) -> None:
        rows = scores.size // T
        vec = _vec(self._vec_x, att, scores, row=T)
        self._launch(self._k.causal_softmax_forward, (_cdiv(rows, SOFTMAX_ROWS_PER_BLOCK),), (SOFTMAX_BLOCK,),
                     att, scores, np.int64(rows), np.int32(T), np.int32(vec))

    def _softmax_backward(self, dscores, datt, att, T: int, scale: float) -> None:
        rows = att.size // T
        vec = _vec(self._vec_x, dscores, datt, att, row=T)
        self._launch(self._k.causal_softmax_backward, (_cdiv(rows, SOFTMAX_ROWS_PER_BLOCK),), (SOFTMAX_BLOCK,),
                     dscores, datt, att, np.int64(rows), np.int32(T), np.float32(scale), np.int32(vec))

    def _split_qkv(self, qkv, n_head: int):
        """(B, T, C, hs), and q, k and v with their heads apart: (B * n_head, T, hs) each."""
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // n_head
        q, k, v = (cupy.empty((B * n_head, T, hs), dtype=self.act_dtype) for _ in range(3))
        self._split_heads(qkv, (q, k, v), C3, B, n_head, T, hs)
        return (B, T, C, hs), (q, k, v)

    def _act_or_in_place(self, buffer_f32):
        """The floatX output of a softmax kernel over a float32 buffer: the buffer itself when floatX is
        float (the kernels may run in place), else a new array of the activation dtype."""
        if self.act_dtype == np.float32:
            return buffer_f32
        return cupy.empty(buffer_f32.shape, dtype=self.act_dtype)

    def attention_forward(self, qkv, n_head: int, dropout=None):
        qkv = _contiguous(qkv)
        self._act(qkv)
        (B, T, C, hs), (q, k, v) = self._split_qkv(qkv, n_head)
        BH = B * n_head
        # float32 in every precision; right of each chunk's diagonal block never written, and never used
        scores = cupy.empty((B, n_head, T, T), dtype=cupy.float32)
        scores3 = scores.reshape(BH, T, T)
        for r0, r1 in _causal_chunks(T):  # query rows [r0, r1) against keys [0, r1)
            self._gemm_batched(q[:, r0:r1], k[:, :r1], scores3[:, r0:r1, :r1], trans_b=True,
                               alpha=_attention_scale(hs))
        att = self._act_or_in_place(scores)
        self._softmax(att, scores, T)
        probs = att if dropout is None else self.dropout(att, dropout)  # att is kept undropped for backward
        y = cupy.empty((B, n_head, T, hs), dtype=self.act_dtype)
        att3, y3 = probs.reshape(BH, T, T), y.reshape(BH, T, hs)
        for r0, r1 in _causal_chunks(T):
            self._gemm_batched(att3[:, r0:r1, :r1], v[:, :r1], y3[:, r0:r1])
        out = cupy.empty((B, T, C), dtype=self.act_dtype)
        self._merge_heads(out, (y,), C, B, n_head, T, hs)
        return out, att

    def flash_attention_forward(self, qkv, n_head: int):
        qkv = _contiguous(qkv)
        self._act(qkv)
        B, T, C3 = qkv.shape
        C = C3 // 3
        check_flash_attention(self.dtype, C // n_head)
        self._flash_aligned(qkv)
        out = cupy.empty((B, T, C), dtype=self.act_dtype)
        lse = cupy.empty((B, n_head, T), dtype=cupy.float32)
        if self.flash_kernels == "mma":
            self._launch(self._k.flash_mma_forward, (_cdiv(T, MMA_BLOCK_ROWS), n_head, B), (MMA_THREADS,),
                         out, lse, qkv, np.int32(T), np.int32(n_head))
        else:
            self._launch(self._k.flash_attention_forward, (_cdiv(T, FLASH_TILE), n_head, B), (FLASH_THREADS,),
                         out, lse, qkv, np.int32(T), np.int32(n_head))
        return out, lse

    def flash_attention_backward(self, dout, qkv, out, lse, n_head: int):
        for a in (dout, qkv, out, lse):
            _contiguous(a)
        self._act(dout, qkv, out)
        _f32(lse)
        B, T, C3 = qkv.shape
        check_flash_attention(self.dtype, C3 // 3 // n_head)
        self._flash_aligned(qkv, dout, out)
        D = cupy.empty((B, n_head, T), dtype=cupy.float32)
        rows = B * n_head * T
        dqkv = cupy.empty((B, T, C3), dtype=self.act_dtype)  # every element written: q by dq, k and v by dkdv
        args = (dqkv, dout, qkv, lse, D, np.int32(T), np.int32(n_head))
        if self.flash_kernels == "mma":
            self._launch(self._k.flash_mma_backward_dot, (_cdiv(rows, MMA_DOT_ROWS),), (MMA_THREADS,),
                         D, dout, out, np.int32(B), np.int32(T), np.int32(n_head))
            grid = (_cdiv(T, MMA_BLOCK_ROWS), n_head, B)
            self._launch(self._k.flash_mma_backward_dkdv, grid, (MMA_THREADS,), *args)
            self._launch(self._k.flash_mma_backward_dq, grid, (MMA_THREADS,), *args)
        else:
            self._launch(self._k.flash_attention_backward_dot, (_cdiv(rows, FLASH_WARPS),), (FLASH_THREADS,),
                         D, dout, out, np.int32(B), np.int32(T), np.int32(n_head))
            grid = (_cdiv(T, FLASH_TILE), n_head, B)
            self._launch(self._k.flash_attention_backward_dkdv, grid, (FLASH_THREADS,), *args)
            self._launch(self._k.flash_attention_backward_dq, grid, (FLASH_THREADS,), *args)
        return dqkv

    def _flash_aligned(self, *arrays) -> None:
        """The flash kernels read and write whole 64-channel head rows with 16-byte accesses: no scalar
        fallback, so a misaligned array is an error (_vec says which the vector kernels may take)."""
        if not _vec(self._vec_x, *arrays):
            raise ValueError("cuda_ops flash attention: arrays must start on a 16-byte boundary")

    def causal_softmax(self, scores):
        scores = _contiguous(scores)
        _f32(scores)
        att = cupy.empty(scores.shape, dtype=self.act_dtype)
        self._softmax(att, scores, scores.shape[-1])
        return att

    def attention_backward(self, dout, qkv, att, n_head: int, dropout=None):
        for a in (dout, qkv, att):
            _contiguous(a)
        self._act(dout, qkv, att)
        (B, T, C, hs), (q, k, v) = self._split_qkv(qkv, n_head)
        BH = B * n_head
        dy = cupy.empty((B, n_head, T, hs), dtype=self.act_dtype)
        self._split_heads(dout, (dy,), C, B, n_head, T, hs)
        dy = dy.reshape(BH, T, hs)
        probs = (att if dropout is None else self.dropout(att, dropout)).reshape(BH, T, T)  # what forward's y read
        att = att.reshape(BH, T, T)
        # chunk by chunk (_causal_chunks): query rows [r0, r1) against keys [0, r1), and keys [r0, r1) against
        # query rows [r0, T), the only ones whose att and dscores are not 0 there
        datt = cupy.empty((BH, T, T), dtype=cupy.float32)  # float32 like the scores; read where j <= i only
        dv, dq, dk = (cupy.empty((B, n_head, T, hs), dtype=self.act_dtype) for _ in range(3))
        dv3, dq3, dk3 = (x.reshape(BH, T, hs) for x in (dv, dq, dk))
        for r0, r1 in _causal_chunks(T):
            self._gemm_batched(dy[:, r0:r1], v[:, :r1], datt[:, r0:r1, :r1], trans_b=True)         # dy v^T
            self._gemm_batched(probs[:, r0:, r0:r1], dy[:, r0:], dv3[:, r0:r1], trans_a=True)      # probs^T dy
        if dropout is not None:  # the probabilities' gradient through the mask, in place
            self._dropout_into(datt.reshape(B, n_head, T, T), datt.reshape(B, n_head, T, T), dropout, wide=True)
        dscores = self._act_or_in_place(datt)
        self._softmax_backward(dscores, datt, att, T, _attention_scale(hs))
        for r0, r1 in _causal_chunks(T):
            self._gemm_batched(dscores[:, r0:r1, :r1], k[:, :r1], dq3[:, r0:r1])                   # dscores k
            self._gemm_batched(dscores[:, r0:, r0:r1], q[:, r0:], dk3[:, r0:r1], trans_a=True)     # dscores^T q
        dqkv = cupy.empty(qkv.shape, dtype=self.act_dtype)
        self._merge_heads(dqkv, (dq, dk, dv), 3 * C, B, n_head, T, hs)
        return dqkv

    def causal_softmax_backward(self, datt, att):
        datt, att = _contiguous(datt), _contiguous(att)
        _f32(datt)
        self._act(att)
        out = cupy.empty_like(att)
        self._softmax_backward(out, datt, att, att.shape[-1], 1.0)
        return out

    # ------------------------------------------------------------------ gelu, residual
    def _elementwise(self, kernel, out, *inputs) -> None:
        n = out.size
        vec = _vec(self._vec_x, out, *inputs)
        self._launch(kernel, _chunk_grid(n, self._vec_x, vec), (BLOCK,), out, *inputs, np.int64(n), np.int32(vec))

    def gelu_forward(self, inp):
        inp = _contiguous(inp)
        self._act(inp)
        out = cupy.empty_like(inp)
        self._elementwise(self._k.gelu_forward, out, inp)
        return out

    def gelu_backward(self, dout, inp):
        dout, inp = _contiguous(dout), _contiguous(inp)
        self._act(dout, inp)
        dinp = cupy.empty_like(inp)
        self._elementwise(self._k.gelu_backward, dinp, dout, inp)
        return dinp

    def residual_forward(self, a, b):
        a, b = _contiguous(a), _contiguous(b)
        self._act(a, b)
        if a.shape != b.shape:
            raise ValueError(f"residual_forward: shapes {a.shape} and {b.shape} differ")
        out = cupy.empty_like(a)
        self._elementwise(self._k.residual_forward, out, a, b)
        return out

    # ------------------------------------------------------------------ classifier (kernels/classifier.cu)
    def _classifier_rows(self, logits, targets, vocab_size: int | None):
        """What both classifier kernels take: the targets as ids, the tokens' width V, the logits' width Vp,
        the logits as rows with their stride, and the (B, T) float32 losses they write."""
        self._act(logits)
        targets = _ids(targets)
        Vp = logits.shape[-1]
        V = _vocab(vocab_size, Vp)
        rows, ld = _rows(logits, Vp)
        return targets, V, Vp, rows, ld, cupy.empty(targets.shape, dtype=cupy.float32)

    def crossentropy_forward(self, logits, targets, vocab_size: int | None = None):
        targets, V, _, rows, ld, losses = self._classifier_rows(logits, targets, vocab_size)
        self._launch(self._k.crossentropy_forward, (targets.size,), (CLASSIFIER_BLOCK,),
                     losses, rows, targets, np.int32(V), np.int64(ld))
        return losses

    def fused_classifier(self, logits, targets, dloss: float, vocab_size: int | None = None):
        targets, V, Vp, rows, ld, losses = self._classifier_rows(logits, targets, vocab_size)
        self._launch(self._k.fused_classifier, (targets.size,), (CLASSIFIER_BLOCK,),
                     rows, losses, targets, np.int32(V), np.int32(Vp), np.int64(ld), np.float32(dloss))
        return losses

    # ------------------------------------------------------------------ optimizer (adamw.cu, global_norm.cu, scale.cu)
    def global_norm_squared(self, buf):
        buf = _contiguous(buf)
        _f32(buf)
        n = buf.size
        vec = _vec(4, buf)
        # a function of n only: the summation order is fixed (see global_norm.cu)
        blocks = max(1, min(NORM_MAX_BLOCKS, _cdiv(n, NORM_BLOCK * 4)))
        partial = cupy.empty(blocks, dtype=cupy.float64)
        out = cupy.empty(1, dtype=cupy.float32)
        self._launch(self._k.sum_squares_partial, (blocks,), (NORM_BLOCK,), partial, buf, np.int64(n), np.int32(vec))
        self._launch(self._k.sum_squares_finish, (1,), (NORM_MAX_BLOCKS,), out, partial, np.int32(blocks))
        return out

    def clip_coefficient(self, norm_squared, max_norm: float):
        _f32(norm_squared)
        out = cupy.empty(1, dtype=cupy.float32)
        self._launch(self._k.clip_coefficient, (1,), (32,), out, _contiguous(norm_squared), np.float64(max_norm))
        return out

    def scale(self, buf, factor) -> None:
        buf = _contiguous(buf)
        _f32(buf)
        if isinstance(factor, cupy.ndarray):
            factor_ptr, factor_value = _contiguous(factor.astype(cupy.float32, copy=False)), np.float32(0)
        else:
            factor_ptr, factor_value = None, np.float32(factor)
        n = buf.size
        vec = _vec(4, buf)
        self._launch(self._k.scale_inplace, _chunk_grid(n, 4, vec), (BLOCK,),
                     buf, np.int64(n), factor_ptr, factor_value, np.int32(vec))

    def bf16_round(self, buf) -> None:
        buf = _contiguous(buf)
        _f32(buf)
        n = buf.size
        vec = _vec(4, buf)
        self._launch(self._k.bf16_round_inplace, _chunk_grid(n, 4, vec), (BLOCK,), buf, np.int64(n),
                     np.int32(vec))

    def adamw_update(self, params, grads, m, v, decay_mask, step: int | None, lr: float | None, beta1: float,
                     beta2: float, eps: float, weight_decay: float, grad_scale, params_lowp=None,
                     schedule=None) -> None:
        for a in (params, grads, m, v, decay_mask):
            _contiguous(a)
        _f32(params, grads, m, v)
        if params_lowp is not None:
            self._act(_contiguous(params_lowp))
            if params_lowp.size != params.size:
                raise ValueError(f"adamw_update: params_lowp has {params_lowp.size} elements, params {params.size}")
        if decay_mask.dtype != np.uint8:
            raise TypeError(f"adamw_update: decay_mask must be uint8, got {decay_mask.dtype}")
        if not isinstance(grad_scale, cupy.ndarray):
            grad_scale = cupy.full(1, grad_scale, dtype=cupy.float32)  # a fill kernel, no host copy
        grad_scale = _contiguous(grad_scale.astype(cupy.float32, copy=False))
        if schedule is None:
            lr, bc1, bc2 = numpy_ops.adamw_schedule(step, lr, beta1, beta2)
        elif step is not None or lr is not None:
            raise ValueError("adamw_update: step and lr are in the schedule; pass them as None")
        else:
            if schedule.dtype != np.float32 or schedule.shape != (3,):
                raise TypeError(f"adamw_update: schedule must be (3,) float32, got {schedule.shape} {schedule.dtype}")
            lr = bc1 = bc2 = 0.0  # read from schedule by the kernel
        n = params.size
        vec = _vec(4, params, grads, m, v, decay_mask, params_lowp)
        f32 = np.float32
        # the float32 roundings of numpy_ops.adamw_update: f(1 - beta1), f(1 - beta1 ** step), ...
        self._launch(self._k.adamw_update, _chunk_grid(n, 4, vec), (BLOCK,),
                     params, params_lowp, grads, m, v, decay_mask, np.int64(n), grad_scale,
                     None if schedule is None else _contiguous(schedule),
                     f32(lr), f32(beta1), f32(beta2), f32(1 - beta1), f32(1 - beta2),
                     f32(bc1), f32(bc2), f32(eps), f32(weight_decay), np.int32(vec))

    def lowp_copy(self, dst, src) -> None:
        _f32(src)
        self._act(_contiguous(dst))
        if dst.size != src.size:
            raise ValueError(f"lowp_copy: {dst.size} elements into {src.size}")
        n = src.size
        vec = _vec(4, dst, _contiguous(src))
        self._launch(self._k.lowp_copy, _chunk_grid(n, 4, vec), (BLOCK,), dst, src, np.int64(n), np.int32(vec))

    def widen_copy(self, dst, src) -> None:
        _f32(dst)
        self._act(src)
        if dst.size != src.size:
            raise ValueError(f"widen_copy: {src.size} elements into {dst.size}")
        n = src.size
        vec = _vec(4, _contiguous(dst), _contiguous(src))
        self._launch(self._k.widen_copy, _chunk_grid(n, 4, vec), (BLOCK,), dst, src, np.int64(n), np.int32(vec))


# ---------------------------------------------------------------------------- helpers

class _Copied:
    """to_host_later's answer: the host array, once the event after its copy has passed."""

    def __init__(self, copied, host: np.ndarray):
        self.copied, self.host = copied, host

    def result(self) -> np.ndarray:
        self.copied.synchronize()
        return numpy_ops.from_bf16_bits(self.host) if self.host.dtype == np.uint16 else self.host

def _rows(a, cols: int):
    """(view, ld): a (..., cols) as a 2-D (rows, cols) view whose rows are ld >= cols elements apart (the
    padded logits), never a copy: the step must not copy behind the caller's back."""
    rows2 = a.reshape(-1, cols)
    order, ld = _matrix_layout(rows2) if rows2.size else ("C", cols)
    if rows2.size and (rows2.data.ptr != a.data.ptr or order != "C"):
        raise ValueError(f"cuda_ops: shape {a.shape} strides {a.strides} is not rows of {cols} elements")
    return rows2, ld


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _vocab(vocab_size: int | None, padded: int) -> int:
    """The classifier's token columns: vocab_size of the logits' `padded` (numpy_ops: all by default)."""
    V = padded if vocab_size is None else vocab_size
    if not 1 <= V <= padded:
        raise ValueError(f"cuda_ops classifier: vocab_size {vocab_size} of {padded} logit columns")
    return V


def _ids(ids):
    """Token ids or targets as a C-contiguous int32 device array (the kernels index with int)."""
    if ids.dtype != np.int32:
        ids = ids.astype(cupy.int32)
    return _contiguous(ids)


def _attention_scale(hs: int) -> float:
    """1/sqrt(hs) rounded to float32, as numpy_ops applies it to the scores."""
    return float(np.float32(1.0 / math.sqrt(hs)))
