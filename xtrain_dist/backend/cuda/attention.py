"""Attention on the CUDA backend: the standard path (cuBLAS products around kernels/attention.cu's softmax),
flash attention's fused kernels (kernels/flash_attention_mma.cu, and flash_attention.cu's WMMA ones that
bin/bench_attention still races) or cuDNN's (cudnn_sdpa.py, --attention cudnn), each numpy_ops' op of the
same name, one for one.

CudaBackend (ops.py) takes these ops from AttentionOps; they launch through its _launch, its products
(gemm.py) and its activation checks, on the rank's stream.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import XtrainError
from . import flash_variants
from .compile import kernel_constant
from .cudnn_sdpa import check_cudnn_attention
from .device import cupy
from .launch import BLOCK, _cdiv, _chunk_grid, _contiguous, _f32, _vec

# The block shapes the kernels are written for, read from beside them in their files, so that a kernel
# and its launch cannot disagree: the softmax's rows per block and threads, flash attention's tiles (the MMA
# kernels' launches are flash_variants.py's, per variant).
SOFTMAX_ROWS_PER_BLOCK = kernel_constant("attention", "SOFTMAX_ROWS_PER_BLOCK")
SOFTMAX_BLOCK = kernel_constant("attention", "SOFTMAX_BLOCK")
FLASH_HS = kernel_constant("flash_attention", "FLASH_HS")
FLASH_TILE = kernel_constant("flash_attention", "FLASH_TILE")
FLASH_WARPS = kernel_constant("flash_attention", "FLASH_WARPS")
FLASH_THREADS = kernel_constant("flash_attention", "FLASH_THREADS")
MMA_HS = kernel_constant("flash_attention_mma", "MMA_HS")
MMA_BLOCK_ROWS = kernel_constant("flash_attention_mma", "MMA_BLOCK_ROWS")
MMA_TILE = kernel_constant("flash_attention_mma", "MMA_TILE")
# The kernels of the flash attention ops (CudaBackend(flash_kernels=)): --attention flash's
# flash_attention_mma.cu (FlashAttention-2's scheme on mma.sync), or the WMMA kernels of flash_attention.cu it
# replaced, which bin/bench_attention still races; both compute numpy_ops' flash attention, key tiles of
# numpy_ops.FLASH_TILE, rounded at the same places. cudnn: --attention cudnn, cuDNN's fused attention
# (cudnn_sdpa.py), the same function rounded where cuDNN rounds.
FLASH_KERNELS = ("mma", "wmma", "cudnn")
# Standard attention's products in chunks of this many query rows, each against only the keys it may see
# (_causal_chunks): at T = 1024, 4 chunks compute 10/16 of the T x T products the mask would otherwise halve
CAUSAL_CHUNK = 256


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


class AttentionOps:
    """Attention's ops of CudaBackend: standard (the T x T probabilities kept) and flash (one log-sum-exp
    per row kept, the probabilities recomputed in backward)."""

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
        self._check_flash(C // n_head)
        self._flash_aligned(qkv)
        out = cupy.empty((B, T, C), dtype=self.act_dtype)
        lse = cupy.empty((B, n_head, T), dtype=cupy.float32)
        if self.flash_kernels == "cudnn":
            self._check_stream()
            self._cudnn.forward(out, lse, qkv, B, T, n_head, C // n_head)
        elif self.flash_kernels == "mma":  # the variant the GPU's tuning table names for the shape
            flash_variants.forward(self, out, lse, qkv, B, T, n_head)
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
        self._check_flash(C3 // 3 // n_head)
        self._flash_aligned(qkv, dout, out)
        dqkv = cupy.empty((B, T, C3), dtype=self.act_dtype)  # every element written: q by dq, k and v by dkdv
        if self.flash_kernels == "cudnn":
            self._check_stream()
            self._cudnn.backward(dqkv, dout, qkv, out, lse, B, T, n_head, C3 // 3 // n_head)
            return dqkv
        D = cupy.empty((B, n_head, T), dtype=cupy.float32)
        rows = B * n_head * T
        args = (dqkv, dout, qkv, lse, D, np.int32(T), np.int32(n_head))
        if self.flash_kernels == "mma":
            flash_variants.backward(self, dqkv, D, dout, qkv, out, lse, B, T, n_head)
        else:
            self._launch(self._k.flash_attention_backward_dot, (_cdiv(rows, FLASH_WARPS),), (FLASH_THREADS,),
                         D, dout, out, np.int32(B), np.int32(T), np.int32(n_head))
            grid = (_cdiv(T, FLASH_TILE), n_head, B)
            self._launch(self._k.flash_attention_backward_dkdv, grid, (FLASH_THREADS,), *args)
            self._launch(self._k.flash_attention_backward_dq, grid, (FLASH_THREADS,), *args)
        return dqkv

    def _check_flash(self, head_size: int) -> None:
        """What the chosen flash kernels take (CudaBackend(flash_kernels=)): ours, or cuDNN's (cudnn_sdpa.py)."""
        if self.flash_kernels == "cudnn":
            check_cudnn_attention(self.dtype, head_size)
        else:
            check_flash_attention(self.dtype, head_size)

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


def _causal_chunks(T: int) -> list[tuple[int, int]]:
    """[r0, r1) row ranges of CAUSAL_CHUNK rows covering [0, T). Query rows [r0, r1) see keys [0, r1) only,
    and keys [r0, r1) are seen by query rows [r0, T) only: each product of causal attention runs per chunk
    over that part, and skips the blocks right of the diagonal that the mask would zero. The diagonal
    blocks are still computed whole (att and dscores are 0 above the diagonal, which the softmax kernels
    write)."""
    return [(r0, min(r0 + CAUSAL_CHUNK, T)) for r0 in range(0, T, CAUSAL_CHUNK)]


def _attention_scale(hs: int) -> float:
    """1/sqrt(hs) rounded to float32, as numpy_ops applies it to the scores."""
    return float(np.float32(1.0 / math.sqrt(hs)))
