"""The numpy reference backend: every op of a GPT-2 training step, forward and backward, by hand.

This file is the oracle. `cuda/ops.py` has a method of the same name and signature for each op
below, implemented by the kernel in `kernels/<op>.cu` named in its docstring, and the GPU tests
compare the two op by op.

Conventions, shared with the CUDA backend:
- Activations are (B, T, C) arrays, row-major. B = sequences on this rank, T = sequence length,
  C = channels. Weights use Hugging Face's Conv1D layout (in, out), so a linear layer is x @ w + b.
- Forward ops return new arrays. Backward ops *accumulate* (+=) into the parameter gradients they
  are given, because the flat gradient buffer is zeroed once per optimizer step and every micro-step
  (and both uses of the tied embedding) adds into it. An input gradient is returned, except for
  layernorm_backward, which adds into the residual-stream gradient it is given: that is how the
  residual connection's backward is done without a separate op.
- Every op keeps the dtype of its inputs: training runs float32, the gradient checks run float64.

Precision. A backend has an activation dtype (precision.py): activations, activation gradients and
the parameter copy that forward reads are stored in it; parameter gradients, layernorm statistics,
attention scores and losses are always float32. numpy has no bfloat16, so `NumpyBackend("bf16")`
emulates it: every value the CUDA backend writes into a bfloat16 buffer passes through
`self.store`, which rounds it to the nearest bfloat16 and keeps it in float32 storage. That is the
one rule; the `self.store(...)` calls below mark, op by op, exactly the values a kernel or a cuBLAS
product writes in the activation dtype (and nothing else), so the emulation and the GPU differ only
in float32 summation order and in the roundings inside one kernel. With "fp32", store does nothing
and the ops are plain float32 (or float64) arithmetic.

The module itself is the float32 backend: `numpy_ops.layernorm_forward(...)` is the fp32 oracle and
`GPT2(config, numpy_ops)` trains in float32, exactly as `NumpyBackend("fp32")` does.
"""

import ctypes
import functools
import os
import threading
import time

import numpy as np

from ..precision import check_dtype
from .dropout import keep_mask

LN_EPS = 1e-5
# Elementwise ops over large arrays run a chunk of CHUNK elements at a time: numpy evaluates a formula one
# operation at a time, each a pass over whole arrays, so a formula of ten operations on arrays larger than
# the cache is ten trips to memory; on a chunk, its temporaries stay in cache. The arithmetic of each
# element is unchanged, so the bits are the same (a test checks it). The CUDA kernels do the same: one
# thread per chunk, every operation on registers.
CHUNK = 1 << 16
CLASSIFIER_BLOCK = 1 << 19  # elements of logits fused_classifier takes at a time: 2 MiB, in L3, of whole rows
GELU_SCALE = float(np.sqrt(2.0 / np.pi))
FLASH_TILE = 64  # kernels/flash_attention_mma.cu and flash_attention.cu: the keys a step of the online softmax takes


def _chunks(*arrays):
    """Matching CHUNK-element pieces of same-shaped arrays, in C order, for elementwise ops. Each piece is
    a view of a flat view, so what is written into a piece of a C-contiguous output lands in it; any
    other input is copied to C order first."""
    flat = [a.reshape(-1) for a in arrays]
    for lo in range(0, flat[0].size, CHUNK):
        yield tuple(a[lo:lo + CHUNK] for a in flat)


# ------------------------------------------------------------------ the threads of an op

# --cpu-threads N gives each rank N threads for its BLAS products and, through op_threads, N - 1 more threads of
# its own that run the row and element blocks of the other ops beside it (numpy's ufuncs and reductions release
# the GIL on arrays this large). Each block's arithmetic depends only on its own elements or rows, never on how
# the blocks are split between threads, so a step is the same bits at every thread count (a test checks it). At
# the default of one thread no pool exists and the blocks run in a plain loop, as before.
_op_threads = 1
_pools = {}  # calling thread's ident -> its ThreadPoolExecutor of _op_threads - 1 workers
_pools_lock = threading.Lock()
_worker = threading.local()  # .busy: this thread is running blocks of an op


class op_threads:
    """with op_threads(n): the non-BLAS ops of each thread that calls them (a rank) use n threads: its own and n - 1
    workers of a pool of its own, created on its first op and shut down when the block ends."""

    def __init__(self, n: int | None):
        self.n = max(1, int(n or 1))

    def __enter__(self):
        global _op_threads
        self.before, _op_threads = _op_threads, self.n
        return self

    def __exit__(self, *exc):
        global _op_threads
        _op_threads = self.before
        with _pools_lock:
            pools = list(_pools.values())
            _pools.clear()
        for pool in pools:
            pool.shutdown(wait=True)
        return False


def _pool(workers: int):
    key = threading.get_ident()
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool._max_workers != workers:
            from concurrent.futures import ThreadPoolExecutor
            pool = _pools[key] = ThreadPoolExecutor(workers, thread_name_prefix="numpy-op")
    return pool


# The fewest elements an op hands to each of its threads: below this the hand-off costs what the second core saves
# (on the 2-core EPYC of docs/performance.md, the mini model's layernorm, B*T*C = 131k elements, and the residual
# add ran 1.3-4x slower on 2 threads, while its GELU, 4x as large, ran 0.76x).
PARALLEL_MIN = 1 << 17


def _threads_for(elements: int) -> int:
    """How many threads an op of this many elements runs on: 1 inside another op's block, else op_threads'
    count, fewer where a share would be under PARALLEL_MIN elements."""
    if getattr(_worker, "busy", False):
        return 1
    return max(1, min(_op_threads, elements // PARALLEL_MIN))


def _in_blocks(fn, n: int, step: int, elements: int) -> None:
    """fn(lo, hi) for the blocks [lo, hi) of range(n), step items each, of an op of `elements` elements in all: in
    a loop on one thread, or spread over _threads_for's threads. fn must write only its own block's outputs."""
    starts = range(0, n, step)
    threads = min(_threads_for(elements), len(starts))
    if threads < 2:
        for lo in starts:
            fn(lo, min(lo + step, n))
        return

    def run(part):
        _worker.busy = True  # an op inside a block (store's bf16_round) runs its blocks on this thread alone
        try:
            for lo in part:
                fn(lo, min(lo + step, n))
        finally:
            _worker.busy = False

    parts = [starts[i::threads] for i in range(threads)]  # every threads-th block: as many each, give or take one
    futures = [_pool(threads - 1).submit(run, part) for part in parts[1:]]
    run(parts[0])
    for f in futures:
        f.result()  # an error in a worker is raised here, in the op's caller


def _row_blocks(rows: int, elements: int) -> int:
    """Rows a block for an op whose rows are independent (layernorm): all of them on one thread, as one
    whole-array pass per step is fastest there (measured: blocks of CHUNK elements were 5-15% slower at 1
    thread), and an even share each over _threads_for's threads."""
    return max(1, -(-rows // _threads_for(elements)))


def _add_rows(table, rows, values) -> None:
    """table[rows[i]] += values[i] for each i in order, a row listed twice getting both (np.add.at's meaning).
    Done as np.add.at over the elements' flat indices, numpy's fast path for 1-D indices (4x faster than
    indexing rows, measured at 1024 rows of 128): each element still takes its rows' values in i order, so the
    same bits."""
    if not table.flags.c_contiguous:
        np.add.at(table, rows, values)
        return
    C = table.shape[-1]
    elements = (np.asarray(rows, np.intp).reshape(-1, 1) * C + np.arange(C)).reshape(-1)
    np.add.at(table.reshape(-1), elements, np.asarray(values).reshape(-1))


def _attention_blocks(B: int, n_head: int, T: int, dropout) -> tuple[int, int]:
    """(sequences a block, elements) for _in_blocks over attention's batch: about CHUNK scores a block, so that
    the softmax's passes find them in cache. The heads' T x T products are too small for BLAS to split them
    between its threads, so the blocks are what gives attention the rank's other threads. With dropout, one
    block: its mask is drawn over the whole (B, NH, T, T)."""
    if dropout is not None:
        return B, 0
    return max(1, CHUNK // (n_head * T * T)), B * n_head * T * T


def _elementwise(fn, *arrays) -> None:
    """fn(*pieces) for matching CHUNK-element pieces of same-shaped arrays (as _chunks), through _in_blocks."""
    flat = [a.reshape(-1) for a in arrays]
    _in_blocks(lambda lo, hi: fn(*(a[lo:hi] for a in flat)), flat[0].size, CHUNK, flat[0].size)


# ------------------------------------------------------------------ the heap the arrays live in

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_heap_lock = threading.Lock()
_heap_set = False


def keep_freed_arrays(mmap_above: int = 32 << 20, trim_above: int = 64 << 20) -> bool:
    """Let glibc's malloc keep the memory of freed arrays for the next ones. Returns whether it did.

    Every op returns new arrays, so a step frees and allocates the same few megabytes hundreds of times.
    By default glibc serves blocks that large with mmap (its threshold starts at 128 KiB and only grows
    after such a block is freed) and gives freed memory at the top of the heap back to the kernel, so
    each array faulted in fresh pages that the kernel zeroed first. With blocks up to 32 MiB served from
    the heap and up to 64 MiB of free heap kept, the pages are reused, with the same bits (what that
    saved: docs/ddp.md, "Page faults"). get_backend("numpy") calls it (importing this module does
    not change the process's malloc); it acts once per process, leaves it to the user when
    MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set, and is a no-op where there is no glibc mallopt."""
    global _heap_set
    with _heap_lock:
        if _heap_set:
            return True
        if any(v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
            return False
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        # the two go together: setting either one turns off glibc's adaptive threshold, and either alone
        # is slower than the default
        if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, mmap_above):
            return False
        _heap_set = bool(mallopt(_M_TRIM_THRESHOLD, trim_above))
        return _heap_set


# ------------------------------------------------------------------ the cores, and the BLAS threads of a rank

def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The BLAS threads of each rank unless --cpu-threads says otherwise: one, whatever the cores and the ranks.
# A rank's products are small (the mini model's take about a millisecond), and a product split over threads
# waits for the slowest: with anything else running on the machine one of them is often off its core, and
# `--model mini` at world 1 with 2 threads on 2 cores took 750-760 ms a step beside other work against 148 ms with
# 1 (docs/options.md, --cpu-threads). Nor is a count taken from the load at start-up an answer: OpenBLAS's
# products are not the same bits at every thread count on every CPU (on an AMD EPYC, 1 and 2 threads differ),
# so a run's bits would follow what else ran beside it. The cores are used by ranks (--world-size), one each.
CPU_THREADS_PER_RANK = 1


# ------------------------------------------------------------------ bf16 rounding (kernels/bf16_round.cu)

def bf16_round(buf) -> None:
    """Round a float32 buffer to the nearest bfloat16, ties to even, in place; the result stays float32.

    bfloat16 is float32's upper 16 bits (sign, 8 exponent bits, 7 mantissa bits), so rounding is
    integer arithmetic on the bits: add 0x7FFF plus the lowest kept bit (bit 16), then clear the low
    16 bits. A carry out of the mantissa bumps the exponent, which is exactly rounding up (to inf past
    bfloat16's largest finite value). NaNs become the quiet NaN 0x7FC00000 (the carry could otherwise
    turn a NaN into an inf or flip its sign). The same rule as torch's float32 -> bfloat16 conversion;
    widening back is free: the low 16 bits are already zero."""
    if buf.dtype != np.float32:
        raise TypeError(f"bf16_round needs float32, got {buf.dtype}")
    flat = buf.reshape(-1)
    bits = flat.view(np.uint32)
    nan = np.isnan(flat)
    # in cache-sized chunks: five passes over the data cost about one when the chunk stays in L2
    lowest_kept = np.empty(min(flat.size, CHUNK), np.uint32)
    for (block,) in _chunks(bits):
        lk = lowest_kept[: block.size]
        np.right_shift(block, 16, out=lk)
        lk &= 1
        lk += 0x7FFF
        block += lk  # uint32 arithmetic; only a NaN can carry out of bit 31
        block &= 0xFFFF0000
    if nan.any():
        bits[nan] = 0x7FC00000


def bf16_bits(x) -> np.ndarray:
    """The uint16 bits of the bfloat16 nearest to each float32 value (ties to even; NaN stays NaN)."""
    rounded = np.array(x, dtype=np.float32)  # a copy: bf16_round works in place
    bf16_round(rounded)
    return (rounded.view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits) -> np.ndarray:
    """float32 values of bfloat16 bits: exact, widening only appends 16 zero bits."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _split_qkv(qkv, n_head: int):
    """The fused projection (B, T, 3C) as q, k, v, each (B, NH, T, hs): views through (B, T, 3, NH, hs),
    what attention.cu's split_heads kernel copies out."""
    B, T, C3 = qkv.shape
    return qkv.reshape(B, T, 3, n_head, C3 // 3 // n_head).transpose(2, 0, 3, 1, 4)


@functools.lru_cache(maxsize=8)
def _future(T: int) -> np.ndarray:
    """(T, T), True where key j > query i: what a causal softmax leaves out. Read-only: one per T is shared."""
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    mask.flags.writeable = False
    return mask


def _mask_future(scores, in_place: bool = False):
    """(..., T, T) scores with -inf where key j > query i: a new array, or scores itself, written over."""
    future = _future(scores.shape[-1])
    if not in_place:
        return np.where(future, -np.inf, scores)
    np.copyto(scores, -np.inf, where=future)
    return scores


def _softmax_rows(e):
    """exp(e - rowmax) / rowsum, in place over a new, C-contiguous (..., T, T) array of masked scores, and
    returned. A block of whole matrices at a time, so that its four passes find it in cache; each row's
    arithmetic, and so its bits, is that of the formula over the whole array."""
    T = e.shape[-1]
    flat = e.reshape(-1, T, T)

    def block(lo, hi):
        b = flat[lo:hi]
        b -= b.max(axis=-1, keepdims=True)
        np.exp(b, out=b)
        b /= b.sum(axis=-1, keepdims=True)

    _in_blocks(block, flat.shape[0], max(1, CHUNK // (T * T)), flat.size)
    return e


def adamw_schedule(step: int, lr: float, beta1: float, beta2: float) -> np.ndarray:
    """[lr, 1 - beta1^step, 1 - beta2^step] as float32, each computed in float64 and then rounded: AdamW's
    per-step values (adamw_update's `schedule`), the roundings the kernel and the update above both use."""
    return np.array([lr, 1 - beta1 ** step, 1 - beta2 ** step], dtype=np.float32)


class Ready:
    """A host value that to_host_later has already: result() returns it."""

    def __init__(self, value: np.ndarray):
        self.value = value

    def result(self) -> np.ndarray:
        return self.value


class NumpyBackend:
    """The ops on the CPU, with activations stored in `dtype` ("fp32", or "bf16" emulated in float32)."""

    xp = np  # the array module the model allocates with
    name = "numpy"

    def __init__(self, dtype: str = "fp32", epilogues: bool = False):
        self.dtype = check_dtype(dtype)
        # the twin of --matmul cublaslt: GELU and its derivative inside the MLP's products, applied to the
        # float32 result before its one rounding (matmul_gelu_forward, matmul_backward_gelu)
        self.epilogues = epilogues
        self.act_dtype = np.dtype(np.float32)  # storage; bf16 values are float32 with 16 zero low bits

    def store(self, x):
        """x as the CUDA backend stores it in the activation dtype: rounded to the nearest bfloat16 (ties
        to even) under "bf16", in place, and returned; unchanged under "fp32". Float64 inputs (the
        tolerance tests' other summation order) are rounded to float32 first, as a float32 accumulator is."""
        if self.dtype == "bf16":
            if x.dtype == np.float32:
                bf16_round(x)
            else:
                narrow = x.astype(np.float32)
                bf16_round(narrow)
                x[...] = narrow
        return x

    # ------------------------------------------------------------------ host/device plumbing

    @staticmethod
    def to_host(a) -> np.ndarray:
        """The array as numpy (a no-op here; a device-to-host copy on CUDA)."""
        return np.asarray(a)

    @staticmethod
    def from_host(a: np.ndarray) -> np.ndarray:
        return np.asarray(a)

    @staticmethod
    def to_host_later(a):
        """A host copy of `a` as it is once the work queued so far has run, without waiting for it now: the
        returned object's result() gives it (a device-to-host copy queued on the rank's stream and an event
        on CUDA; here the copy is made at once). How the loop reads a step's loss after queuing the next."""
        return Ready(np.array(a))

    @staticmethod
    def upload(dst, a) -> None:
        """dst[...] = a, host data into an array the backend already holds (an asynchronous copy on CUDA, queued
        on the rank's stream: what a captured step reads is written this way before each replay)."""
        dst[...] = a

    def from_host_act(self, a) -> np.ndarray:
        """A float32 copy of `a` in the activation dtype: how tests and tools feed activations and weights."""
        return self.store(np.array(a, dtype=np.float32))

    @staticmethod
    def synchronize() -> None:
        """Wait for queued work (nothing is queued on the CPU)."""

    # Ordering work across a rank's threads (gradient sync's communication thread). On the CPU an op has
    # finished when it returns, so there is nothing to order; the CUDA backend records and waits on CUDA events.

    @staticmethod
    def bind_side_thread() -> None:
        """Prepare a helper thread of the rank (the CUDA backend gives it the rank's device and a stream)."""

    @staticmethod
    def fence() -> None:
        """A marker of the work queued so far by the calling thread (None: it is all done)."""

    @staticmethod
    def wait(event) -> None:
        """Make the calling thread's later work wait for a fence."""

    # Timing communication (comm/timed.py): a timestamp where the calling thread's work has got to. On the
    # CPU that is now; the CUDA backend records a timing event on the thread's stream, since a GPU
    # collective has only been queued when its call returns.

    @staticmethod
    def timestamp() -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed(start: float, end: float) -> float:
        """Seconds from one timestamp to a later one."""
        return end - start

    # ------------------------------------------------------------------ encoder (kernels/encoder.cu)

    def encoder_forward(self, ids, wte, wpe):
        """out[b, t, :] = wte[ids[b, t], :] + wpe[t, :]  -> (B, T, C)"""
        T = ids.shape[1]
        return self.store(wte[ids] + wpe[:T])

    @staticmethod
    def encoder_backward(dwte, dwpe, dout, ids) -> None:
        """dwte[ids[b, t]] += dout[b, t]; dwpe[t] += sum_b dout[b, t].

        A token that occurs several times gets its rows added in (b, t) order, which is the order the
        deterministic CUDA kernel uses too."""
        C = dout.shape[-1]
        _add_rows(dwte, ids.reshape(-1), dout.reshape(-1, C))
        dwpe[: ids.shape[1]] += dout.sum(axis=0)

    # ------------------------------------------------------------------ layernorm (kernels/layernorm.cu)

    def layernorm_forward(self, inp, weight, bias):
        """Normalise each (b, t) row over C, then scale and shift.  -> (out, mean, rstd); mean, rstd are (B, T)
        and stay float32 in every precision.

        Over op_threads' threads, an even share of the rows each (_row_blocks), every step written with out=
        into the block's output: mean = rowsum(x) / C, n = x - mean, var = rowsum(n * n) / C,
        rstd = 1 / sqrt(var + eps), out = ((n rstd) weight) + bias; each row's bits are those of the formula
        over whole arrays (np.mean is that row sum divided by C; a test compares the two)."""
        C = inp.shape[-1]
        f = inp.dtype.type
        rows = inp.reshape(-1, C)
        out = np.empty(rows.shape, inp.dtype)
        mean = np.empty(rows.shape[0], inp.dtype)
        rstd = np.empty(rows.shape[0], inp.dtype)
        n_c, eps = f(C), f(LN_EPS)

        def block(lo, hi):
            x, o, mu, r = rows[lo:hi], out[lo:hi], mean[lo:hi], rstd[lo:hi]
            np.add.reduce(x, axis=-1, out=mu)
            mu /= n_c
            np.subtract(x, mu[:, None], out=o)                # centred; scaled and shifted in place below
            sq = np.multiply(o, o)
            np.add.reduce(sq, axis=-1, out=r)
            r /= n_c                                          # the variance
            r += eps
            np.sqrt(r, out=r)
            np.divide(f(1), r, out=r)
            o *= r[:, None]
            o *= weight
            o += bias
            self.store(o)

        _in_blocks(block, rows.shape[0], _row_blocks(rows.shape[0], rows.size), rows.size)
        shape = inp.shape[:-1]
        return out.reshape(inp.shape), mean.reshape(shape), rstd.reshape(shape)

    def residual_layernorm_forward(self, a, b, weight, bias):
        """The residual connection and the layernorm that follows it, in one op (one kernel on the GPU):
        residual = a + b, stored in the activation dtype, then layernorm_forward of that stored value.
        -> (residual, out, mean, rstd)"""
        residual = self.residual_forward(a, b)
        return (residual, *self.layernorm_forward(residual, weight, bias))

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
        """Accumulate into dinp (the residual stream's gradient), dweight and dbias.

        With n = (x - mean) * rstd and g = dout * weight:
        dx = rstd * (g - mean_C(g) - n * mean_C(g * n)).

        dx a block of rows at a time (as layernorm_forward), n and g recomputed in the block's scratch; the
        block writes dout * n into a whole-size array whose column sums, like dout's, are then taken over all
        rows at once (numpy adds the rows in order, so blocks would change the sum's bits)."""
        C = inp.shape[-1]
        f = inp.dtype.type
        target = dinp if dinp.flags.c_contiguous else np.ascontiguousarray(dinp)  # blocks are views of its rows
        x_rows, d_rows, dx_rows = inp.reshape(-1, C), dout.reshape(-1, C), target.reshape(-1, C)
        mean_rows, rstd_rows = mean.reshape(-1, 1), rstd.reshape(-1, 1)
        product = np.empty(x_rows.shape, inp.dtype)          # dout * n, for dweight
        n_c = f(C)
        per_block = _row_blocks(x_rows.shape[0], x_rows.size)
        one_block = per_block >= x_rows.shape[0]  # one thread: dout * n is summed in the block and its memory reused

        def block(lo, hi):
            x, d, r, p = x_rows[lo:hi], d_rows[lo:hi], rstd_rows[lo:hi], product[lo:hi]
            norm = np.subtract(x, mean_rows[lo:hi])
            norm *= r
            np.multiply(d, norm, out=p)
            dnorm = np.multiply(d, weight)
            dnorm_mean = np.add.reduce(dnorm, axis=-1, keepdims=True)
            dnorm_mean /= n_c
            if one_block:
                np.add(dweight, product.sum(axis=0), out=dweight)
                gn = np.multiply(dnorm, norm, out=p)
            else:
                gn = np.multiply(dnorm, norm)
            dnorm_norm_mean = np.add.reduce(gn, axis=-1, keepdims=True)
            dnorm_norm_mean /= n_c
            dnorm -= dnorm_mean                  # (dnorm - dnorm_mean - norm dnorm_norm_mean) rstd, in place
            norm *= dnorm_norm_mean
            dnorm -= norm
            dnorm *= r
            dx = dx_rows[lo:hi]
            dx += dnorm
            self.store(dx)

        _in_blocks(block, x_rows.shape[0], per_block, x_rows.size)
        if target is not dinp:
            dinp[...] = target
        dbias += d_rows.sum(axis=0)
        if not one_block:
            dweight += product.sum(axis=0)

    # ------------------------------------------------------------------ matmul (cuBLAS; bias: kernels/matmul.cu)

    def matmul_forward(self, inp, weight, bias=None):
        """out = inp @ weight + bias, weight (in, out). (B, T, in) -> (B, T, out).

        Rounded to the activation dtype once, after the bias: the GPU's cuBLAS product is float32 and
        kernels/matmul.cu's add_bias rounds the sum."""
        IC, OC = weight.shape
        out = inp.reshape(-1, IC) @ weight  # one 2-D GEMM: numpy's stacked-matrix path is slower
        if bias is not None:
            out += bias
        return self.store(out.reshape(*inp.shape[:-1], OC))

    def matmul_backward(self, dweight, dbias, dout, inp, weight):
        """dweight += inp^T @ dout; dbias += sum over rows of dout; returns dinp = dout @ weight^T.

        dweight and dbias are float32 gradients (the product of two bf16 operands accumulates into them in
        float32); dweight may be a transposed view (the tied classifier passes wte's gradient as dwte.T).
        dweight None: dinp alone; weight None: the gradients alone, dinp None (ZeRO-2 and -3 take the tied
        classifier's weight gradient at the end of backward, model.WholeBuffers.wte_grad_at_end)."""
        IC, OC = inp.shape[-1], dout.shape[-1]
        dout2 = dout.reshape(-1, OC)
        if dweight is not None:
            dweight += inp.reshape(-1, IC).T @ dout2
        if dbias is not None:
            dbias += dout2.sum(axis=0)
        return None if weight is None else self.store((dout2 @ weight.T).reshape(inp.shape))

    def matmul_gelu_forward(self, inp, weight, bias):
        """The MLP's first layer and its GELU: pre = matmul_forward(inp, weight, bias), out = gelu_forward(pre).
        -> (pre, out); backward needs pre (matmul_backward_gelu). One kernel after the product on the GPU
        (kernels/gelu.cu's bias_gelu_forward), or none: --matmul cublaslt's GELU_AUX_BIAS epilogue, which
        applies GELU to the float32 sum before pre's rounding, so under bf16 it is a rounding away from
        this (cuda/ops.py); with epilogues=True this backend computes it that way too."""
        if self.epilogues:
            exact = NumpyBackend("fp32")
            pre = exact.matmul_forward(inp, weight, bias)
            out = self.store(exact.gelu_forward(pre))
            return self.store(pre), out
        pre = self.matmul_forward(inp, weight, bias)
        return pre, self.gelu_forward(pre)

    def matmul_backward_gelu(self, dweight, dbias, dout, inp, weight, pre):
        """The MLP's second layer's backward and the GELU's before it: matmul_backward, then gelu_backward of
        its input gradient at pre (the GELU's input). -> the gradient of pre. On the GPU with --matmul cublaslt
        the GELU's derivative is the product's DGELU epilogue, applied before the one rounding (cuda/ops.py),
        as this backend does with epilogues=True."""
        if self.epilogues:
            exact = NumpyBackend("fp32")
            return self.store(exact.gelu_backward(exact.matmul_backward(dweight, dbias, dout, inp, weight), pre))
        return self.gelu_backward(self.matmul_backward(dweight, dbias, dout, inp, weight), pre)

    # ------------------------------------------------------------------ attention (kernels/attention.cu)

    def attention_forward(self, qkv, n_head: int, dropout=None):
        """Causal multi-head self-attention over the fused q|k|v projection.

        qkv (B, T, 3C) -> (out (B, T, C), att (B, NH, T, T)); att holds the softmax probabilities, zero
        above the diagonal, and is kept for the backward pass. The scores are float32 in every precision
        (the product writes them in float32 and the softmax reads them), so exp() never sees a
        bf16-rounded score. dropout: a DropoutSite (backend/dropout.py) whose mask the probabilities pass
        through before the product with v; att is kept without it, and backward draws the mask again."""
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // n_head
        q, k, v = _split_qkv(qkv, n_head)
        scale = qkv.dtype.type(1.0 / np.sqrt(hs))
        att = np.empty((B, n_head, T, T), qkv.dtype)
        out = np.empty((B, T, n_head, hs), qkv.dtype)             # y (B, NH, T, hs) written unpermuted
        y = out.transpose(0, 2, 1, 3)

        def sequences(lo, hi):
            scores = att[lo:hi]
            np.matmul(q[lo:hi], k[lo:hi].transpose(0, 1, 3, 2), out=scores)
            scores *= scale
            self._softmax_masked(_mask_future(scores, in_place=True))
            if dropout is None:
                np.matmul(scores, v[lo:hi], out=y[lo:hi])

        _in_blocks(sequences, B, *_attention_blocks(B, n_head, T, dropout))
        if dropout is not None:  # its mask is drawn over the whole (B, NH, T, T): one block above, the product here
            np.matmul(self.dropout(att, dropout), v, out=y)
        return self.store(out.reshape(B, T, C)), att

    def causal_softmax(self, scores):
        """Row-wise softmax of (..., T, T) scores over keys j <= query i; entries j > i become 0."""
        return self._softmax_masked(_mask_future(scores))

    def _softmax_masked(self, e):
        """The softmax of C-contiguous masked scores (-inf above the diagonal), in place over them: the step
        causal_softmax and attention_forward's blocks share."""
        return self.store(_softmax_rows(e))

    def attention_backward(self, dout, qkv, att, n_head: int, dropout=None):
        """Gradient of attention_forward (with the same `dropout`) with respect to qkv. -> dqkv (B, T, 3C)"""
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // n_head
        q, k, v = _split_qkv(qkv, n_head)
        scale = qkv.dtype.type(1.0 / np.sqrt(hs))
        dy = dout.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # permute like the forward's y
        # the products write straight into the fused (B, T, 3, NH, hs) layout, rounded together at the end
        dqkv = np.empty((B, T, 3, n_head, hs), qkv.dtype)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)

        def sequences(lo, hi):
            datt = dy[lo:hi] @ v[lo:hi].transpose(0, 1, 3, 2)      # float32, like the scores
            probs = att[lo:hi]
            if dropout is not None:  # y = dropout(att) v: dv from the dropped probabilities, datt through the mask
                probs = self.dropout(att, dropout)                 # (one block: the mask spans the whole batch)
                datt = self.dropout(datt, dropout, wide=True)
            dscores = self._softmax_backward(datt, att[lo:hi], scale)
            np.matmul(dscores, k[lo:hi], out=dq[lo:hi])
            np.matmul(dscores.transpose(0, 1, 3, 2), q[lo:hi], out=dk[lo:hi])
            np.matmul(probs.transpose(0, 1, 3, 2), dy[lo:hi], out=dv[lo:hi])

        _in_blocks(sequences, B, *_attention_blocks(B, n_head, T, dropout))
        return self.store(dqkv.reshape(B, T, C3))

    # ----------------------------------------------------------- flash attention (kernels/flash_attention_mma.cu)
    # The same function as attention_forward/backward, computed the way a fused kernel does: forward
    # keeps each query row's log-sum-exp instead of the (B, NH, T, T) probabilities, and backward
    # recomputes the probabilities from q, k and it. The model picks one pair (GPT2(attention=...)).

    def flash_attention_forward(self, qkv, n_head: int, tile: int = FLASH_TILE):
        """qkv (B, T, 3C) -> (out (B, T, C), lse (B, NH, T)), lse[b, h, i] = log sum_{j <= i} exp(score[i, j])
        over the scores, float32 in every precision (float64 for the gradient checks' float64 inputs).

        Computed as the kernel's online softmax: key tile by key tile (`tile` columns: FLASH_TILE, or the
        tile of a variant of kernels/flash_attention_mma.cu, backend/cuda/flash_variants.py), each tile's
        scores raise the running row maximum m, the running denominator l and output O are rescaled by
        exp(m_old - m_new), and P = exp(S - m_new) is rounded to the activation dtype as it enters P V and
        summed as rounded, so that l normalises what O holds. In float32 that is the softmax, up to
        summation order; in bf16 it rounds where the kernel does (the unnormalised P), not where the
        standard path does (the normalised att). Tiles right of a row's diagonal, which the kernel skips,
        change nothing here: their P is 0 and m stays."""
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // n_head
        q, k, v = _split_qkv(qkv, n_head)
        scores = self._causal_scores(q, k, hs)
        m = np.full((B, n_head, T, 1), -np.inf, scores.dtype)  # finite after the first tile: key 0 is every row's
        l = np.zeros_like(m)
        o = np.zeros((B, n_head, T, hs), scores.dtype)
        for k0 in range(0, T, tile):
            s = scores[..., k0:k0 + tile]
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            alpha = np.exp(m - m_new)
            p = self.store(np.exp(s - m_new))
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            o = o * alpha + p @ v[:, :, k0:k0 + tile]
            m = m_new
        y = self.store(o / l)
        lse = (m + np.log(l))[..., 0]
        return y.transpose(0, 2, 1, 3).reshape(B, T, C), lse

    def flash_attention_backward(self, dout, qkv, out, lse, n_head: int):
        """Gradient of flash_attention_forward with respect to qkv, from the forward's out and lse.

        With P = exp(scores - lse) (recomputed) and D = rowsum(dout * out) (= rowsum(P * dP), which
        the kernel reads from out instead of from P): dv = P^T dy, dscores = P (dy v^T - D) / sqrt(hs),
        dq = dscores k, dk = dscores^T q. P and dscores are rounded to the activation dtype where the
        kernel feeds them to a product, as attention_backward rounds att and dscores."""
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // n_head
        q, k, v = _split_qkv(qkv, n_head)
        att = self.store(np.exp(self._causal_scores(q, k, hs) - lse[..., None]))
        dy = dout.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
        y = out.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
        D = (dy * y).sum(axis=-1, keepdims=True)
        dv = self.store(att.transpose(0, 1, 3, 2) @ dy)
        scale = qkv.dtype.type(1.0 / np.sqrt(hs))
        dscores = self.store(att * (dy @ v.transpose(0, 1, 3, 2) - D) * scale)
        dq = self.store(dscores @ k)
        dk = self.store(dscores.transpose(0, 1, 3, 2) @ q)
        return np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, C3)

    @staticmethod
    def _causal_scores(q, k, hs):
        """q k^T / sqrt(hs), -inf above the diagonal: the scores the softmax sees."""
        return _mask_future((q @ k.transpose(0, 1, 3, 2)) * q.dtype.type(1.0 / np.sqrt(hs)))

    def causal_softmax_backward(self, datt, att):
        """d scores = att * (datt - sum_j datt * att); zero above the diagonal because att is."""
        return self._softmax_backward(datt, att, 1)

    def _softmax_backward(self, datt, att, scale):
        # attention_backward's 1/sqrt(hs) is applied before the one rounding, as the kernel does
        d = datt * att
        np.subtract(datt, d.sum(axis=-1, keepdims=True), out=d)
        np.multiply(att, d, out=d)
        d *= scale                           # (att (datt - sum)) scale, one temporary
        return self.store(d)

    # ------------------------------------------------------------------ gelu (kernels/gelu.cu)

    def gelu_forward(self, inp):
        """GELU, tanh approximation (GPT-2's "gelu_new"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

        Each chunk's steps write into one scratch chunk (out=) rather than a new temporary apiece: the same
        operations in the same order, so the same bits as the formula over whole arrays (a test checks it)."""
        s = inp.dtype.type(GELU_SCALE)
        c = inp.dtype.type(0.044715)
        half = inp.dtype.type(0.5)
        out = np.empty(inp.shape, inp.dtype)

        def chunk(x, y):
            u = np.multiply(c, x)
            u *= x
            u *= x                   # c x^3, as ((c x) x) x
            np.add(x, u, out=u)
            np.multiply(s, u, out=u)
            np.tanh(u, out=u)
            u += 1
            np.multiply(half, x, out=y)
            y *= u                   # (0.5 x) (1 + tanh u)
            self.store(y)

        _elementwise(chunk, inp, out)
        return out

    def gelu_backward(self, dout, inp):
        """dinp = dout * gelu'(x), with u = s (x + c x^3):
        gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) s (1 + 3 c x^2).
        Three scratch chunks and out= throughout: this is the largest elementwise op of the step (B*T*4C)."""
        f = inp.dtype.type
        s, c = f(GELU_SCALE), f(0.044715)
        half_s, three_c = f(0.5) * s, f(3) * c
        dinp = np.empty(inp.shape, inp.dtype)

        def chunk(x, d, out):
            x2 = np.multiply(x, x)
            th = np.multiply(c, x2)
            th += 1
            slope = np.multiply(s, x)
            th *= slope                   # (s x) (1 + c x^2)
            np.tanh(th, out=th)
            np.multiply(three_c, x2, out=x2)
            x2 += 1                       # 1 + 3 c x^2
            np.multiply(half_s, x, out=slope)
            slope *= x2                   # 0.5 s x (1 + 3 c x^2)
            np.multiply(th, th, out=x2)
            np.subtract(1, x2, out=x2)
            slope *= x2                   # ... (1 - tanh^2 u)
            th += 1
            th *= f(0.5)
            th += slope
            np.multiply(th, d, out=out)
            self.store(out)

        _elementwise(chunk, inp, dout, dinp)
        return dinp

    # ------------------------------------------------------------------ residual (kernels/residual.cu)

    def residual_forward(self, a, b):
        """out = a + b. Its backward needs no op: the gradient passes unchanged to both inputs, which the
        model gets by letting layernorm_backward accumulate into the residual stream's gradient."""
        if _threads_for(a.size) == 1 or a.shape != b.shape or a.dtype != b.dtype:  # a + b is fastest alone
            return self.store(a + b)
        out = np.empty(a.shape, a.dtype)
        _elementwise(lambda x, y, o: self.store(np.add(x, y, out=o)), a, b, out)  # over op_threads' threads
        return out

    # ------------------------------------------------------------------ dropout (kernels/dropout.cu)

    def dropout(self, x, site, wide: bool = False):
        """Inverted dropout of x at `site` (a backend/dropout.py DropoutSite): x * site.scale where the
        element's Philox bits keep it, 0 where they drop it; a new array. Its backward is this same op on the
        gradient (the mask drawn again from the same counters). wide: x is a float32 buffer (attention's
        probability gradient) rather than an activation, so the product is not rounded to the activation
        dtype."""
        keep = keep_mask(x.shape, site, int(site.step[0]))
        out = np.where(keep, x * x.dtype.type(site.scale), x.dtype.type(0))
        return out if wide else self.store(out)

    # ------------------------------------------------------------------ classifier (kernels/classifier.cu)

    @staticmethod
    def crossentropy_forward(logits, targets, vocab_size: int | None = None):
        """losses[b, t] = -log softmax(logits[b, t, :V])[targets[b, t]]  (evaluation: no gradient; float32).

        logits (B, T, Vp): only the first V = vocab_size columns (default all) are read; the rest are the
        padded vocabulary's, no token's (model.py)."""
        logits = logits[..., :vocab_size]
        m = logits.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(logits - m).sum(axis=-1)) + m[..., 0]
        picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return lse - picked

    def fused_classifier(self, logits, targets, dloss: float, vocab_size: int | None = None):
        """Softmax + cross-entropy and its backward in one pass over the logits.

        Returns losses (B, T), float32, and overwrites `logits` with dlogits = (softmax(logits) -
        onehot(targets)) * dloss, the gradient of dloss * sum(losses): the logits are the largest
        activation and are not needed again. logits (B, T, Vp): the softmax is over the first V =
        vocab_size columns (default all); the padded ones past V are read by nothing and get dlogits
        exactly 0, so the padded rows of wte get exactly zero gradient."""
        if not logits.flags.c_contiguous:  # the blocks below are views of a C-contiguous array's rows
            work = np.ascontiguousarray(logits)
            losses = self.fused_classifier(work, targets, dloss, vocab_size)
            logits[...] = work
            return losses
        Vp = logits.shape[-1]
        V = Vp if vocab_size is None else min(vocab_size, Vp)
        rows = logits.reshape(-1, Vp)  # a view: the gradient is written over the logits
        targets = targets.reshape(-1)
        d = logits.dtype.type(dloss)
        losses = np.empty(rows.shape[0], logits.dtype)
        # a block of rows at a time, so that the passes below find it in cache: the logits are the largest
        # activation (B*T*V); each row's arithmetic, and so its bits, is that over the whole array. Blocks of
        # CLASSIFIER_BLOCK elements, not CHUNK: each block is a dozen numpy calls, and at CHUNK (16 rows of
        # 4096, 1 of GPT-2's 50304) the calls' own cost, and on 2 threads their turns at the GIL, were a third
        # of the op (docs/performance.md)
        def rows_block(lo, hi):
            block = rows[lo:hi]
            block[:, V:] = 0
            real = block[:, :V]
            m = real.max(axis=-1, keepdims=True)
            np.subtract(real, m, out=real)  # shifted logits: the largest is 0, so exp cannot overflow
            picked = np.take_along_axis(real, targets[lo:hi, None], axis=-1)[:, 0]
            np.exp(real, out=real)
            total = real.sum(axis=-1, keepdims=True)
            losses[lo:hi] = np.log(total[:, 0]) - picked
            np.multiply(real, d / total, out=real)  # probabilities * dloss
            block[np.arange(block.shape[0]), targets[lo:hi]] -= d  # targets < V: take_along_axis raised
            self.store(block)

        _in_blocks(rows_block, rows.shape[0], max(1, CLASSIFIER_BLOCK // Vp), rows.size)
        return losses.reshape(logits.shape[:-1])

    # ------------------------------------------------------------------ vocabulary-parallel classifier (--tp)
    # A tensor-parallel rank of --tp-classifier vocab holds rows row0 .. row0 + len(wte) - 1 of wte (model.py): these
    # ops are the embedding's and the classifier's part on such a shard; the collectives between them are the
    # model's. The cuda backend's are kernels/encoder.cu's and kernels/classifier.cu's vocab_* kernels.

    def vocab_encoder_forward(self, ids, wte, wpe, row0: int):
        """encoder_forward on a shard of wte: out[b, t] = wte[ids[b, t] - row0] + wpe[t] where the shard holds the
        token's row, 0 where it does not. One rank of the group holds each token, so the group's all-reduce sums
        one encoder_forward value with zeros, which leaves its bits as they are."""
        local = ids - row0
        mine = (local >= 0) & (local < wte.shape[0])
        rows = wte[np.where(mine, local, 0)] + wpe[:ids.shape[1]]
        return self.store(np.where(mine[..., None], rows, rows.dtype.type(0)))

    @staticmethod
    def vocab_encoder_backward(dwte, dwpe, dout, ids, row0: int) -> None:
        """encoder_backward on a shard of wte: dwte[ids[b, t] - row0] += dout[b, t] for the tokens whose rows it
        holds (in (b, t) order, as encoder_backward); dwpe as encoder_backward (wpe and dout are whole on every
        rank of the group)."""
        C = dout.shape[-1]
        local = ids.reshape(-1) - row0
        mine = (local >= 0) & (local < dwte.shape[0])
        _add_rows(dwte, local[mine], dout.reshape(-1, C)[mine])
        dwpe[: ids.shape[1]] += dout.sum(axis=0)

    @staticmethod
    def _token_columns(logits, vocab_size: int, col0: int) -> int:
        """How many of a shard's logit columns (global ids col0, col0 + 1, ...) are tokens': those below
        vocab_size; the rest are the padded vocabulary's."""
        return max(0, min(logits.shape[-1], vocab_size - col0))

    def vocab_max(self, logits, vocab_size: int, col0: int):
        """Each row's largest logit over the shard's token columns, (B, T) (-inf on a shard of padded columns
        only): the group's largest of them is the softmax's shift, fused_classifier's max."""
        n = self._token_columns(logits, vocab_size, col0)
        if n == 0:
            return np.full(logits.shape[:-1], -np.inf, dtype=logits.dtype)
        return logits[..., :n].max(axis=-1)

    def vocab_sums(self, logits, targets, maxes, vocab_size: int, col0: int):
        """(2, B, T): the sum of exp(logit - maxes) over the shard's token columns, and the target's logit -
        maxes where the shard holds the target's column (0 elsewhere). Summed over the group (one all-reduce):
        the softmax's denominator and the target's shifted logit, as fused_classifier computes them whole."""
        n = self._token_columns(logits, vocab_size, col0)
        out = np.zeros((2, *targets.shape), dtype=logits.dtype)
        if n == 0:
            return out
        shifted = logits[..., :n] - maxes[..., None]
        out[0] = np.exp(shifted).sum(axis=-1)
        local = targets - col0
        mine = (local >= 0) & (local < n)
        picked = np.take_along_axis(shifted, np.where(mine, local, 0)[..., None], axis=-1)[..., 0]
        out[1] = np.where(mine, picked, out.dtype.type(0))
        return out

    def vocab_classifier(self, logits, targets, maxes, sums, dloss: float | None, vocab_size: int, col0: int):
        """losses (B, T) = log(sums[0]) - sums[1], from vocab_sums summed over the group (evaluation: dloss None).
        With dloss, also the shard's part of fused_classifier's backward: logits overwritten with their gradient
        (softmax - onehot(targets)) * dloss, 0 in the padded columns, from the group's maxes and sums: no rank
        ever holds another's logits."""
        losses = np.log(sums[0]) - sums[1]
        if dloss is None:
            return losses
        n = self._token_columns(logits, vocab_size, col0)
        padded = logits
        tokens = logits[..., :n]
        padded[..., n:] = 0
        np.subtract(tokens, maxes[..., None], out=tokens)
        np.exp(tokens, out=tokens)
        d = logits.dtype.type(dloss)
        np.multiply(tokens, (d / sums[0])[..., None], out=tokens)  # probabilities * dloss
        rows = padded.reshape(-1, padded.shape[-1])
        local = targets.reshape(-1) - col0
        mine = (local >= 0) & (local < n)
        rows[np.flatnonzero(mine), local[mine]] -= d
        self.store(padded)
        return losses

    # ------------------------------------------------------------------ optimizer (kernels/adamw.cu, global_norm.cu)

    @staticmethod
    def global_norm_squared(buf):
        """sum(buf ** 2) as a (1,) float32 array. numpy's pairwise summation (not BLAS, whose threading can
        change the order) keeps it bitwise reproducible, so ranks holding equal gradients agree exactly.

        For float32 that sum is np.sum(np.square(buf), dtype=np.float64), computed as numpy computes it (a
        test holds the two bit for bit): numpy casts a float32 array to float64 a buffer of np.getbufsize()
        elements at a time, sums each buffer pairwise and adds the buffers' sums in order. Done here a CHUNK
        at a time through scratch, rather than with a gradient-sized array of squares (49 MB for the small
        model, fresh pages every step) and numpy's buffered cast."""
        flat = buf.reshape(-1)
        block = np.getbufsize()
        if flat.dtype != np.float32 or CHUNK % block:
            return np.sum(np.square(buf), dtype=np.float64).reshape(1).astype(buf.dtype)
        n = min(flat.size, CHUNK)
        squares, wide = np.empty(n, np.float32), np.empty(n, np.float64)
        total = np.float64(0)
        for (x,) in _chunks(flat):
            sq, w = squares[: x.size], wide[: x.size]
            np.square(x, out=sq)
            w[...] = sq
            whole = x.size - x.size % block
            sums = w[:whole].reshape(-1, block).sum(axis=1)  # each buffer's pairwise sum
            for partial in (*sums, *([w[whole:].sum()] if whole < x.size else [])):
                total = total + partial
        return total.reshape(1).astype(np.float32)

    @staticmethod
    def clip_coefficient(norm_squared, max_norm: float):
        """min(1, max_norm / (norm + 1e-6)) as a (1,) array, computed where the norm lives so the step needs
        no device-to-host read; max_norm <= 0 disables clipping."""
        if max_norm <= 0:
            return np.ones(1, dtype=norm_squared.dtype)
        norm = np.sqrt(norm_squared.astype(np.float64))
        return np.minimum(1.0, max_norm / (norm + 1e-6)).astype(norm_squared.dtype)

    @staticmethod
    def scale(buf, factor) -> None:
        """buf *= factor, in place (factor: a scalar or a (1,) array)."""
        buf *= np.asarray(factor, dtype=buf.dtype).reshape(())

    def adamw_update(self, params, grads, m, v, decay_mask, step: int | None, lr: float | None, beta1: float,
                     beta2: float, eps: float, weight_decay: float, grad_scale, params_lowp=None,
                     schedule=None) -> None:
        """One AdamW step (decoupled weight decay, as torch.optim.AdamW), in place over flat buffers.

        g = grads * grad_scale (the clipping coefficient, a (1,) array); step counts from 1;
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
        p -= lr * (m / (1 - b1^step) / (sqrt(v / (1 - b2^step)) + eps) + weight_decay * decay_mask * p).
        decay_mask is 1 for matrices (matmul weights and embeddings) and 0 for biases and layernorm.
        params_lowp, if given, receives the updated parameters in the activation dtype: the copy forward
        reads, written in the same pass on the GPU. schedule, if given (then step and lr are None), is a (3,)
        float32 array on the backend holding adamw_schedule(step, lr, beta1, beta2): the values that change
        every step, in memory the host rewrites before a captured step is replayed."""
        f = params.dtype.type
        if schedule is None:
            schedule = adamw_schedule(step, lr, beta1, beta2)
        elif step is not None or lr is not None:
            raise ValueError("adamw_update: step and lr are in the schedule; pass them as None")
        lr_, bc1, bc2 = (f(x) for x in schedule)
        scale = np.asarray(grad_scale, dtype=params.dtype).reshape(())
        # a chunk at a time (see CHUNK; spread over op_threads' threads), into three scratch chunks (out=): the
        # formula's dozen temporaries stay in cache, instead of a dozen passes over parameter-sized arrays (and, for
        # GPT-2 124M, 4 GB of them allocated per step). The same operations in the same order as the formula.
        b1, one_b1, b2, one_b2, eps_, wd = f(beta1), f(1 - beta1), f(beta2), f(1 - beta2), f(eps), f(weight_decay)

        def chunk(p, m_, v_, grad, decay):
            g, t, u = np.empty((3, p.size), p.dtype)
            np.multiply(grad, scale, out=g)
            m_ *= b1
            np.multiply(one_b1, g, out=t)
            m_ += t
            v_ *= b2
            np.multiply(g, g, out=t)
            t *= one_b2
            v_ += t
            np.divide(m_, bc1, out=t)     # m_hat
            np.divide(v_, bc2, out=u)     # v_hat
            np.sqrt(u, out=u)
            u += eps_
            t /= u                        # the update
            np.multiply(wd, decay, out=u)
            u *= p
            t += u                        # + weight_decay * decay * p
            t *= lr_
            p -= t

        _elementwise(chunk, params, m, v, grads, decay_mask)
        if params_lowp is not None:
            self.lowp_copy(params_lowp, params)

    def lowp_copy(self, dst, src) -> None:
        """dst = src in the activation dtype (kernels/adamw.cu): the parameter copy that forward reads,
        refreshed after a load or a ZeRO-1 all-gather."""
        dst[...] = src
        self.store(dst)

    def widen_copy(self, dst, src) -> None:
        """dst (float32) = src (the activation dtype), exactly (kernels/adamw.cu): a tensor-parallel group
        sums its row-parallel partial outputs in float32 (model.py)."""
        dst[...] = src

    # ------------------------------------------------------------------ gradient compression (kernels/bf16_round.cu)

    bf16_round = staticmethod(bf16_round)  # the module function above the class



# ------------------------------------------------------------------ the module as the float32 backend

# Every op and plumbing function a backend has; cuda/ops.py's CudaBackend has the same (a test checks it).
OPS = ("to_host", "to_host_later", "from_host", "upload", "from_host_act", "synchronize", "bind_side_thread",
       "fence", "wait", "timestamp", "elapsed",
       "encoder_forward", "encoder_backward", "layernorm_forward", "residual_layernorm_forward",
       "layernorm_backward", "matmul_forward", "matmul_backward", "matmul_gelu_forward", "matmul_backward_gelu",
       "attention_forward", "causal_softmax", "attention_backward", "causal_softmax_backward",
       "flash_attention_forward", "flash_attention_backward",
       "gelu_forward", "gelu_backward", "residual_forward", "dropout", "crossentropy_forward", "fused_classifier",
       "vocab_encoder_forward", "vocab_encoder_backward", "vocab_max", "vocab_sums", "vocab_classifier",
       "global_norm_squared", "clip_coefficient", "scale", "adamw_update", "lowp_copy", "widen_copy", "bf16_round")

_fp32 = NumpyBackend("fp32")
xp, name, dtype, act_dtype, store = np, _fp32.name, _fp32.dtype, _fp32.act_dtype, _fp32.store
globals().update({op: getattr(_fp32, op) for op in OPS})  # numpy_ops.layernorm_forward is _fp32's
