"""The CUDA backend: numpy_ops' ops, one for one, on one GPU, through kernels/*.cu and cuBLAS.

How it works (streams, kernels and their compilation, products, bf16 storage): docs/cuda_backend.md.
This module owns CudaBackend and its ops: checking their arguments, each kernel's launch (geometry,
vector or scalar path) and the order of the calls; attention's ops are in attention.py. Call a backend's
ops only from the thread that made it.
"""

from __future__ import annotations

import numpy as np

from ...errors import XtrainError
from ...precision import check_dtype, check_matmul
from .. import numpy_ops
from . import cublas, cublaslt
from .attention import FLASH_KERNELS, AttentionOps
from .compile import Kernels, kernel_constant
from .cudnn_sdpa import SdpaGraphs
from .device import check_stream, cupy, device_count, on_stream
from .dropout import DropoutOps
from .gemm import CublasProducts, _matrix_layout
from .launch import BLOCK, _cdiv, _chunk_grid, _contiguous, _f32, _vec

# --dtype -> how activations are stored: bf16 as uint16 arrays holding the bits (docs/cuda_backend.md)
ACT_DTYPES: dict[str, np.dtype] = {"fp32": np.dtype(np.float32), "bf16": np.dtype(np.uint16)}

# ---------------------------------------------------------------------------- launch geometry

# The block shapes the kernels are written for, read from beside them in their files, so that a kernel
# and its launch cannot disagree: warp-per-row kernels (a row per warp, so rows per block and threads),
# block-per-row classifier, the norm's two stages, the column sums' (32, COL_ROWS) blocks (attention's
# are in attention.py).
LAYERNORM_ROWS_PER_BLOCK = kernel_constant("layernorm", "LAYERNORM_ROWS_PER_BLOCK")
LAYERNORM_BLOCK = kernel_constant("layernorm", "LAYERNORM_BLOCK")
LAYERNORM_FUSED_CHUNKS = kernel_constant("layernorm", "LAYERNORM_FUSED_CHUNKS")
CLASSIFIER_BLOCK = kernel_constant("classifier", "CLASSIFIER_BLOCK")
NORM_BLOCK = kernel_constant("global_norm", "NORM_BLOCK")
NORM_MAX_BLOCKS = kernel_constant("global_norm", "NORM_MAX_BLOCKS")
COLUMN_BLOCK = (kernel_constant("matmul", "WARP_SIZE"), kernel_constant("matmul", "COL_ROWS"))

# Host choices, which no kernel assumes (BLOCK, the chunked kernels' threads, is in launch.py).
ROW_ALIGN = 64         # unbiased products' rows (the logits) start this many elements apart at least


def _column_splits(rows: int) -> tuple[int, int]:
    """(splits, rows_per_split) for the deterministic column sums: at most 128 splits of at least 32
    rows. A function of the row count only, so the summation order never depends on the device."""
    rows_per_split = max(32, _cdiv(rows, 128))
    return _cdiv(rows, rows_per_split), rows_per_split


# ---------------------------------------------------------------------------- the backend

class CudaBackend(AttentionOps, CublasProducts, DropoutOps):
    """numpy_ops on one CUDA device, on one stream owned by the calling (rank) thread; attention's ops are
    AttentionOps' (attention.py), the products' plumbing CublasProducts' (gemm.py)."""

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
        # --attention cudnn: the rank's cuDNN handle on this stream and its graphs (one line if cuDNN is missing)
        self._cudnn = SdpaGraphs(self.stream) if flash_kernels == "cudnn" else None
        self._k = Kernels(dtype)
        self._side_streams: set[int] = set()
        self._keep_alive: list = []
        self._vec_x = 16 // self.act_dtype.itemsize  # elements of floatX per 16 bytes: 4 (fp32) or 8 (bf16)
        self._init_products(allow_tf32, matmul)  # cuBLAS, and cuBLASLt's handle and workspace if asked
        # the bias gradient in the weight gradient's product (cuBLASLt's BGRADA) under --matmul cublaslt: off,
        # since on an H200 (bin/bench_gemm, 2026-11-26) it saved nothing in bf16 and fp32, and c_attn's came to
        # 5.0 ms against 0.13 ms without it; bench_gemm's "backward bgrad lt" rows time it with this set
        self.bias_grad_epilogue = False
        # layernorm's three gradients in one pass (layernorm_backward_fused) where the width allows; off: the
        # input gradient and the parameters' column sums in kernels of their own, as before (not yet timed
        # on a GPU against each other: bin/bench_gpu's profile, layernorm_backward's row, says which is faster)
        self.fused_layernorm_backward = True

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
        return self._embed(self._k.encoder_forward, ids, wte, wpe)

    def _embed(self, kernel, ids, wte, wpe, *row0):
        """encoder_forward's launch, or with row0 vocab_encoder_forward's (wte the shard's rows from row0 on)."""
        ids = _ids(ids)
        B, T = ids.shape
        V, C = wte.shape
        if wpe.shape[0] < T:
            raise ValueError(f"sequence length {T} exceeds the {wpe.shape[0]} learned positions")
        self._act(wte, wpe)
        out = cupy.empty((B, T, C), dtype=wte.dtype)
        vec = _vec(self._vec_x, out, _contiguous(wte), _contiguous(wpe), row=C)
        self._launch(kernel, _chunk_grid(B * T * C, self._vec_x, vec), (BLOCK,),
                     out, ids, wte, wpe, np.int64(B * T), np.int32(T), np.int32(C), np.int32(V),
                     *(np.int32(r) for r in row0), np.int32(vec))
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

    # ------------------------------------------------------------------ vocabulary-parallel embedding (encoder.cu)
    def vocab_encoder_forward(self, ids, wte, wpe, row0: int):
        return self._embed(self._k.vocab_encoder_forward, ids, wte, wpe, row0)

    def vocab_encoder_backward(self, dwte, dwpe, dout, ids, row0: int) -> None:
        # encoder_backward on the shard's own ids, ids - row0: the kernel skips an id outside [0, R), so the
        # tokens of the other shards add nothing, and the shard's add in (b, t) order as encoder_backward's
        # (shifting every id keeps the stable sort's order)
        self.encoder_backward(dwte, dwpe, dout, _ids(ids) - np.int32(row0))

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
        splits, rows_per_split = _column_splits(rows)
        partial_dw = cupy.empty((splits, C), dtype=cupy.float32)
        partial_db = cupy.empty((splits, C), dtype=cupy.float32)
        widest = LAYERNORM_FUSED_CHUNKS * COLUMN_BLOCK[0] * (self._vec_x if vec else 1)  # a warp's registers
        if self.fused_layernorm_backward and widest >= C:
            # one pass over dout and inp for all three gradients (layernorm.cu says how wide it goes)
            self._launch(self._k.layernorm_backward_fused, (splits,), (LAYERNORM_BLOCK,), dinp, partial_dw, partial_db,
                         dout, inp, weight, mean, rstd, np.int64(rows), np.int32(C), np.int32(rows_per_split),
                         np.int32(vec))
        else:
            self._launch(self._k.layernorm_backward_input, (_cdiv(rows, LAYERNORM_ROWS_PER_BLOCK),),
                         (LAYERNORM_BLOCK,), dinp, dout, inp, weight, mean, rstd, np.int64(rows), np.int32(C),
                         np.int32(vec))
            vec = _vec(self._vec_x, dout, inp, partial_dw, partial_db, row=C)
            width = self._vec_x if vec else 1
            self._launch(self._k.layernorm_backward_params, (_cdiv(C, COLUMN_BLOCK[0] * width), splits),
                         COLUMN_BLOCK, partial_dw, partial_db, dout, inp, mean, rstd, np.int64(rows), np.int32(C),
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
        """numpy_ops.matmul_backward: dweight None gives dinp alone, weight None the weight gradients alone
        (ZeRO-2 and -3's tied classifier, whose weight gradient comes at the end of backward)."""
        if weight is None:
            self._act(inp)
            IC, OC = inp.shape[-1], dout.shape[-1]
            inp2 = _contiguous(inp).reshape(-1, IC)
        else:
            IC, OC, inp2 = self._linear_inputs(inp, weight)
        self._act(dout)
        dout2, _ = _rows(dout, OC)  # the classifier's rows are padded (matmul_forward)
        if dweight is not None:
            _f32(dweight)
            self._weight_gradients(dweight, dbias, dout2, inp2)
        if weight is None:
            return None
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

    # ------------------------------------------------------------------ vocabulary-parallel classifier (classifier.cu)
    def _shard_rows(self, logits, vocab_size: int, col0: int):
        """What the vocabulary-parallel kernels take: the shard's logits as rows with their stride, its width
        Vs and its token columns n (numpy_ops._token_columns)."""
        self._act(logits)
        Vs = logits.shape[-1]
        rows, ld = _rows(logits, Vs)
        return rows, ld, Vs, numpy_ops.NumpyBackend._token_columns(logits, vocab_size, col0)

    def vocab_max(self, logits, vocab_size: int, col0: int):
        rows, ld, _, n = self._shard_rows(logits, vocab_size, col0)
        maxes = cupy.empty(logits.shape[:-1], dtype=cupy.float32)
        self._launch(self._k.vocab_max, (maxes.size,), (CLASSIFIER_BLOCK,), maxes, rows, np.int32(n), np.int64(ld))
        return maxes

    def vocab_sums(self, logits, targets, maxes, vocab_size: int, col0: int):
        rows, ld, _, n = self._shard_rows(logits, vocab_size, col0)
        targets = _ids(targets)
        _f32(maxes)
        sums = cupy.empty((2, *targets.shape), dtype=cupy.float32)
        self._launch(self._k.vocab_sums, (targets.size,), (CLASSIFIER_BLOCK,), sums, rows, targets,
                     _contiguous(maxes), np.int32(n), np.int32(col0), np.int64(targets.size), np.int64(ld))
        return sums

    def vocab_classifier(self, logits, targets, maxes, sums, dloss: float | None, vocab_size: int, col0: int):
        rows, ld, Vs, n = self._shard_rows(logits, vocab_size, col0)
        targets = _ids(targets)
        _f32(maxes, sums)
        losses = cupy.empty(targets.shape, dtype=cupy.float32)
        train = dloss is not None
        self._launch(self._k.vocab_classifier, (targets.size,), (CLASSIFIER_BLOCK,),
                     losses, rows, targets, _contiguous(maxes), _contiguous(sums),
                     np.float32(dloss if train else 0.0), np.int32(n), np.int32(Vs), np.int32(col0),
                     np.int64(targets.size), np.int64(ld), np.int32(train))
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
