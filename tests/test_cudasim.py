"""The CUDA simulator (tests/cudasim): that it catches what it claims to, and the GPU tests run on it.

First, the instrument is held to its claims on small kernels written to be wrong: a race that only
shows in another thread order, a barrier not every thread reaches, a shuffle with a lane that has left,
accesses outside an array or to unmapped memory, unpoisoned shared memory, an argument of the wrong
type, a trap, two streams with nothing ordering them, an array freed under another stream's use; the
training loop with each of its cross-stream fences taken out; the WMMA, tensor-core PTX (mma.sync,
ldmatrix, cp.async), cuBLAS and NCCL stand-ins against plain arithmetic. Then the GPU test
modules run on it in subprocesses (tests/test_cuda_ops.py and tests/test_cuda_bf16.py in forward,
reverse and a shuffled order, tests/test_cuda_flash_variants.py forward and reversed; tests/test_nccl.py
with two simulated GPUs), and the scripts a GPU session
runs (train_ddp --backend cuda, bench_gpu, bench_attention, kernel_errors, bench_collectives --comm nccl,
the session's summary) are dry-run, so none of them meets a GPU for the first time in its session.
"""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the simulator compiles kernels with g++")

sys.path.insert(0, str(Path(__file__).resolve().parent / "cudasim"))
import fake_cupy as sim  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def module(body: str, options=()):
    return sim.RawModule(code='#include <mma.h>\n#include <cuda_bf16.h>\n' + body, options=options)


def upload(host):
    return sim.asarray(np.ascontiguousarray(host))


def run_in_order(kernel, order: str, grid, block, make_args):
    old = os.environ.get("XTRAIN_CUDASIM_ORDER")
    os.environ["XTRAIN_CUDASIM_ORDER"] = order
    try:
        args = make_args()
        kernel(grid, block, args)
        return args
    finally:
        if old is None:
            del os.environ["XTRAIN_CUDASIM_ORDER"]
        else:
            os.environ["XTRAIN_CUDASIM_ORDER"] = old


BLOCK_SUM = r'''
__device__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
// out[block] = sum of in over the block's 256 elements: warp sums, then warp 0 adds the 8 partials
extern "C" __global__ void block_sum(float* out, const float* in) {
    __shared__ float partial[8];
    const float x = warp_sum(in[blockIdx.x * blockDim.x + threadIdx.x]);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
    __syncthreads();
    if (threadIdx.x < 32) {
        const float total = warp_sum(threadIdx.x < 8 ? partial[threadIdx.x] : 0.0f);
        if (threadIdx.x == 0) out[blockIdx.x] = total;
    }
}
// the same without the __syncthreads: warp 0 may read partials the other warps have not written
extern "C" __global__ void racy_block_sum(float* out, const float* in) {
    __shared__ float partial[8];
    const float x = warp_sum(in[blockIdx.x * blockDim.x + threadIdx.x]);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
    if (threadIdx.x < 32) {
        const float total = warp_sum(threadIdx.x < 8 ? partial[threadIdx.x] : 0.0f);
        if (threadIdx.x == 0) out[blockIdx.x] = total;
    }
}
'''


@pytest.mark.parametrize("order", ["forward", "reverse", "12345"])
def test_a_correct_reduction_gives_the_sum_in_every_order(order):
    host = np.arange(3 * 256, dtype=np.float32).reshape(3, 256) % 7 - 3  # small integers: exact sums
    kernel = module(BLOCK_SUM).get_function("block_sum")
    out, _ = run_in_order(kernel, order, (3,), (256,), lambda: (sim.empty(3, np.float32), upload(host)))
    np.testing.assert_array_equal(out.get(), host.sum(axis=1))


def test_a_missing_syncthreads_shows_as_a_wrong_sum_in_some_order():
    host = np.ones((2, 256), np.float32)
    kernel = module(BLOCK_SUM).get_function("racy_block_sum")
    results = {}
    for order in ("forward", "reverse"):
        out, _ = run_in_order(kernel, order, (2,), (256,), lambda: (sim.zeros(2, np.float32), upload(host)))
        results[order] = out.get()
    # forward: warps 1-7 have not run yet when warp 0 reads their partials, so a block misses them
    assert not np.array_equal(results["forward"], [256, 256]), results
    assert not np.array_equal(results["forward"], results["reverse"]), results


def test_shared_memory_is_poisoned_for_every_block():
    """A block that reads shared memory it did not write gets NaN, not what the previous block left."""
    kernel = module(r'''
extern "C" __global__ void first_block_writes(float* out) {
    __shared__ float value;
    if (blockIdx.x == 0 && threadIdx.x == 0) value = 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = value;
}''').get_function("first_block_writes")
    out = sim.zeros(3, np.float32)
    kernel((3,), (32,), (out,))
    assert out.get()[0] == 1.0 and np.isnan(out.get()[1:]).all(), out.get()


def test_a_warp_split_between_two_barriers_is_a_deadlock():
    kernel = module(r'''
extern "C" __global__ void split_warp(float* out) {
    if (threadIdx.x < 16) __syncthreads();  // half the warp waits for the block,
    else __syncwarp();                      // the other half for the whole warp: neither can go on
    out[threadIdx.x] = 1.0f;
}''').get_function("split_warp")
    with pytest.raises(sim.CUDARuntimeError, match=r"split_warp: deadlock in block \(0,0,0\): 16 at __syncthreads, "
                                                   r"16 at a warp synchronisation, 0 exited"):
        kernel((1,), (32,), (sim.empty(32, np.float32),))


def test_a_shuffle_waiting_for_a_lane_that_has_left_is_an_error():
    kernel = module(r'''
extern "C" __global__ void early_exit(float* out, int n) {
    if (threadIdx.x >= n) return;  // leaves lanes n..31 out of the full-mask shuffle below
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}''').get_function("early_exit")
    with pytest.raises(sim.CUDARuntimeError, match=r"warp synchronisation waits for thread \(20,0,0\) of block "
                                                   r"\(0,0,0\), which has exited"):
        kernel((1,), (32,), (sim.empty(32, np.float32), np.int32(20)))


def test_writes_past_either_end_are_caught():
    kernel = module(r'''
extern "C" __global__ void write_at(float* out, long long i) { out[i] = 1.0f; }''').get_function("write_at")
    kernel((1,), (1,), (sim.empty(10, np.float32), np.int64(9)))  # the last element: fine
    with pytest.raises(sim.CUDARuntimeError, match="write_at wrote past its end of the allocation behind argument 0"):
        kernel((1,), (1,), (sim.empty(10, np.float32), np.int64(10)))
    with pytest.raises(sim.CUDARuntimeError, match="write_at wrote before its start"):
        kernel((1,), (1,), (sim.empty(10, np.float32), np.int64(-1)))


def test_reads_just_outside_an_array_give_nan():
    """A row kernel that reads one element too many (the classic tail bug) returns NaN, not a plausible sum."""
    kernel = module(r'''
extern "C" __global__ void row_sum(float* out, const float* x, int n, int extra) {
    float total = 0.0f;
    for (int i = 0; i < n + extra; ++i) total += x[i];
    out[0] = total;
}''').get_function("row_sum")
    out, x = sim.empty(1, np.float32), upload(np.ones(7, np.float32))
    kernel((1,), (1,), (out, x, np.int32(7), np.int32(0)))
    assert out.get()[0] == 7
    kernel((1,), (1,), (out, x, np.int32(7), np.int32(1)))
    assert np.isnan(out.get()[0])


def test_a_wild_read_is_an_error_naming_the_thread_not_a_crash():
    kernel = module(r'''
extern "C" __global__ void wild_read(float* out, const float* x, long long i) { out[threadIdx.x] = x[i]; }
''').get_function("wild_read")
    out, x = sim.empty(32, np.float32), upload(np.ones(4, np.float32))
    # 4 TiB past x: mapped by nobody. Where x lies high in the address space (a busy process maps it there),
    # that is past 2^47, a non-canonical address, whose fault reaches the handler without an address.
    with pytest.raises(sim.CUDARuntimeError, match=r"wild_read: thread \(0,0,0\) of block \(0,0,0\): invalid memory "
                                                   r"access at (0x[0-9a-f]+|an address the CPU refuses outright)$"):
        kernel((1,), (32,), (out, x, np.int64(1) << 40))
    kernel((1,), (32,), (out, x, np.int64(3)))  # the process goes on, and so do launches
    np.testing.assert_array_equal(out.get(), np.ones(32))


def test_arguments_are_checked_against_the_parameters():
    kernel = module(r'''
extern "C" __global__ void axpy(float* y, const float* x, float a, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}''').get_function("axpy")
    y, x = sim.zeros(5, np.float32), upload(np.arange(5, dtype=np.float32))
    kernel((1,), (32,), (y, x, np.float32(2), np.int64(5)))
    np.testing.assert_array_equal(y.get(), 2 * np.arange(5))
    with pytest.raises(TypeError, match=r"axpy argument 3 is i4 \(int32\), the kernel's parameter is i8"):
        kernel((1,), (32,), (y, x, np.float32(2), np.int32(5)))
    with pytest.raises(TypeError, match=r"axpy argument 2 is f8 \(float\), the kernel's parameter is f4"):
        kernel((1,), (32,), (y, x, 2.0, np.int64(5)))
    with pytest.raises(TypeError, match="axpy takes 4 arguments, got 3"):
        kernel((1,), (32,), (y, x, np.float32(2)))
    with pytest.raises(TypeError, match="a host numpy array passed to a kernel"):
        kernel((1,), (32,), (y, np.arange(5, dtype=np.float32), np.float32(2), np.int64(5)))
    with pytest.raises(sim.CUDARuntimeError, match="cudaErrorInvalidConfiguration"):
        kernel((1,), (2048,), (y, x, np.float32(2), np.int64(5)))


def test_a_trap_ends_the_launch_with_the_thread_that_trapped():
    kernel = module(r'''
extern "C" __global__ void trap_at(int bad) { if (blockIdx.x * blockDim.x + threadIdx.x == bad) __trap(); }
''').get_function("trap_at")
    kernel((2,), (64,), (np.int32(-1),))
    with pytest.raises(sim.CUDARuntimeError, match=r"thread \(6,0,0\) of block \(1,0,0\) called __trap\(\)"):
        kernel((2,), (64,), (np.int32(70),))


def test_wmma_product_is_the_matrix_product():
    """Each block (one warp) multiplies its own tiles; a second product adds to the first. mma.h keeps
    the last product for the next lane whose inputs are the same: blocks run one after another, so
    block w's product comes right after block w-1's, and must not be taken for it when only the A
    tile, only the B tile, or only the accumulator differs."""
    kernel = module(r'''
using namespace nvcuda;
// block w: c[w] = products * a[w] @ b[w] for 16x16 bf16 a (row-major) and b (column-major), float c
extern "C" __global__ void tile_product(float* c, const __nv_bfloat16* a, const __nv_bfloat16* b, int products) {
    const int w = blockIdx.x;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a + 256 * w, 16);
    wmma::load_matrix_sync(fb, b + 256 * w, 16);
    for (int i = 0; i < products; ++i) wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c + 256 * w, acc, 16, wmma::mem_row_major);
}''').get_function("tile_product")
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-8, 8, (3, 16, 16)).astype(np.float32) for _ in range(2))  # exact in bf16 and in sums
    bits = lambda x: upload((x.view(np.uint32) >> 16).astype(np.uint16))  # noqa: E731
    for a_tiles, b_tiles, products in ((a, b[[0, 0, 0]], 1), (a[[0, 0, 0]], b, 1), (a[:1], b[:1], 2)):
        c = sim.empty(a_tiles.shape, np.float32)
        kernel((len(a_tiles),), (32,), (c, bits(a_tiles), bits(np.ascontiguousarray(b_tiles.transpose(0, 2, 1))),
                                        np.int32(products)))
        np.testing.assert_array_equal(c.get(), products * (a_tiles @ b_tiles))


@pytest.mark.parametrize("offset, ld, words", [
    (8, 16, r"load_matrix_sync pointer is not 256-bit aligned"),   # 16 bytes in: aligned for a vector, not WMMA
    (0, 20, r"load_matrix_sync leading dimension 20 is not a multiple of 16 bytes"),
])
def test_wmma_tiles_must_be_where_the_hardware_can_load_them(offset, ld, words):
    """A GPU does not check WMMA's alignment rules (what breaks them is undefined); the simulator does."""
    kernel = module(r'''
using namespace nvcuda;
extern "C" __global__ void tile_load(float* c, const __nv_bfloat16* a, int offset, int ld) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + offset, ld);
}''').get_function("tile_load")
    a = sim.empty((16 * 32,), np.uint16)
    with pytest.raises(sim.CUDARuntimeError, match=r"thread \(0,0,0\) of block \(0,0,0\): " + words):
        kernel((1,), (32,), (sim.empty((1,), np.float32), a, np.int32(offset), np.int32(ld)))


PTX = (ROOT / "kernels" / "ptx.cuh").read_text()


def ptx_module(body: str):
    return module(PTX + body)


def bf16_upload(x):
    return upload((np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def test_mma_sync_fed_by_ldmatrix_is_the_matrix_product():
    """kernels/ptx.cuh's mma.sync on the simulator: one warp moves a (16 x 16) and b (16 x 8) into shared
    memory by cp.async, loads A by ldmatrix and B both ways (its transpose by ldmatrix, itself by
    ldmatrix.trans), and computes A B + C twice, the second time onto the first: each lane's
    registers must hold the elements the fragment layouts say, or the product comes out scrambled."""
    kernel = ptx_module(r"""
extern "C" __global__ void ptx_product(float* d, const __nv_bfloat16* a, const __nv_bfloat16* bt,
                                       const __nv_bfloat16* b) {
    __shared__ __align__(16) __nv_bfloat16 sa[16 * 16], sbt[8 * 16], sb[16 * 8];
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4, mi = lane / 8;
    cp_async_16(sa + 8 * lane, a + 8 * lane, true);  // 32 pieces of 16 bytes, two per row
    if (lane < 16) cp_async_16(sbt + 8 * lane, bt + 8 * lane, true);
    if (lane < 16) cp_async_16(sb + 8 * lane, b + 8 * lane, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    unsigned fa[4], fbt[4], fb[4];
    ldmatrix_x4(fa, sa + (lane % 8 + 8 * (mi % 2)) * 16 + 8 * (mi / 2));
    ldmatrix_x4(fbt, sbt + (lane % 8) * 16 + 8 * (mi % 2));    // matrices 2 and 3 repeat 0 and 1
    ldmatrix_x4_trans(fb, sb + (lane % 8 + 8 * (mi % 2)) * 8);  // so do these
    const unsigned from_bt[2] = {fbt[0], fbt[1]}, from_b[2] = {fb[0], fb[1]};
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float acc[4];
    mma_bf16_16816(acc, fa, from_bt, zero);
    mma_bf16_16816(acc, fa, from_b, acc);
    for (int e = 0; e < 4; ++e) d[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = acc[e];
}""").get_function("ptx_product")
    rng = np.random.default_rng(0)
    a = rng.integers(-8, 8, (16, 16)).astype(np.float32)  # exact in bf16 and in the sums
    b = rng.integers(-8, 8, (16, 8)).astype(np.float32)
    d = sim.empty((16, 8), np.float32)
    kernel((1,), (32,), (d, bf16_upload(a), bf16_upload(b.T), bf16_upload(b)))
    np.testing.assert_array_equal(d.get(), 2 * (a @ b))


CP_ASYNC = r"""
// Two groups of copies (in[0:8] then in[8:16]) into shared memory, then out[] = what lane 0 sees after
// waiting with `wait` groups still allowed in flight (2: no wait at all), or no wait for the second group
// ever when `leak`.
extern "C" __global__ void staged(float* out, const __nv_bfloat16* in, int wait, int leak) {
    __shared__ __align__(16) __nv_bfloat16 tile[16];
    if (threadIdx.x == 0) {
        cp_async_16(tile, in, true);
        cp_async_commit();
        cp_async_16(tile + 8, in + 8, true);
        cp_async_commit();
        if (wait == 0) cp_async_wait<0>();
        if (wait == 1) cp_async_wait<1>();
        for (int i = 0; i < 16; ++i) out[i] = __bfloat162float(tile[i]);
        if (wait != 0 && !leak) cp_async_wait<0>();
    }
}
"""


@pytest.mark.parametrize("wait, landed", [(0, 16), (1, 8), (2, 0)])
def test_cp_async_lands_at_the_wait_that_covers_its_group(wait, landed):
    """cp.async is deferred on the simulator: a read before the wait for its group sees the poisoned
    shared memory (NaN), so a kernel that forgets a wait, or waits for too little, gets NaN."""
    kernel = ptx_module(CP_ASYNC).get_function("staged")
    host = np.arange(16, dtype=np.float32)
    out = sim.empty((16,), np.float32)
    kernel((1,), (32,), (out, bf16_upload(host), np.int32(wait), np.int32(0)))
    got = out.get()
    np.testing.assert_array_equal(got[:landed], host[:landed])
    assert np.isnan(got[landed:]).all(), got


def test_a_cp_async_copy_into_a_buffer_another_warp_still_reads_is_seen():
    """Double buffering's hazard: a warp starts the next copy into a buffer while another warp still reads
    the tile there. In flight the destination is NaN on the simulator, so without the __syncthreads that
    orders the copy after every warp's reads, the reading warp gets NaN in some order."""
    kernel = ptx_module(r"""
extern "C" __global__ void reuse(float* out, const __nv_bfloat16* in, int barrier) {
    __shared__ __align__(16) __nv_bfloat16 tile[8];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) cp_async_16(tile, in, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const float first = __bfloat162float(tile[lane % 8]);  // every warp reads the first tile
    if (barrier) __syncthreads();
    if (threadIdx.x == 0) cp_async_16(tile, in + 8, true);  // the next tile into the same buffer
    cp_async_commit();
    __syncthreads();  // work on another buffer would go here while the copy flies
    cp_async_wait<0>();
    __syncthreads();
    out[warp * 32 + lane] = first + __bfloat162float(tile[lane % 8]);
}""").get_function("reuse")
    host = np.arange(16, dtype=np.float32)
    want = np.tile(host[:8] + host[8:], 8)
    for barrier in (1, 0):
        results = []
        for order in ("forward", "reverse"):
            out, *_ = run_in_order(kernel, order, (1,), (64,), lambda b=barrier: (
                sim.empty((64,), np.float32), bf16_upload(host), np.int32(b)))
            results.append(out.get())
        if barrier:
            assert all(np.array_equal(r, want) for r in results), results
        else:
            assert any(np.isnan(r).any() for r in results), results


def test_a_cp_async_copy_never_waited_for_is_an_error():
    kernel = ptx_module(CP_ASYNC).get_function("staged")
    with pytest.raises(sim.CUDARuntimeError,
                       match=r"thread \(0,0,0\) of block \(0,0,0\) exited with 1 cp.async copies it never waited for"):
        kernel((1,), (32,), (sim.empty((16,), np.float32), bf16_upload(np.zeros(16)), np.int32(1), np.int32(1)))


def test_ldmatrix_reads_shared_memory_only():
    """ldmatrix and cp.async's destination are shared-memory addresses; a global pointer is an error."""
    kernel = ptx_module(r"""
extern "C" __global__ void global_ldmatrix(unsigned* out, const __nv_bfloat16* in) {
    unsigned r[4];
    ldmatrix_x4(r, in + 8 * threadIdx.x);
    out[threadIdx.x] = r[0];
}""").get_function("global_ldmatrix")
    with pytest.raises(sim.CUDARuntimeError, match=r"ldmatrix row address is not in shared memory"):
        kernel((1,), (32,), (sim.empty((32,), np.uint32), bf16_upload(np.zeros(256))))


@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cublas_stand_in_follows_column_major_conventions(ta, tb):
    """C (m x n, column-major, ldc) = op(A) op(B) + beta C, with padded leading dimensions."""
    rng = np.random.default_rng(1)
    m, n, k, pad = 5, 3, 4, 2
    opa, opb = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    # column-major storage with leading dimension ld = rows + pad: element (i, j) at i + j * ld
    def stored(x):
        ld = x.shape[0] + pad
        buf = np.full((x.shape[1], ld), np.nan, np.float32)
        buf[:, :x.shape[0]] = x.T
        return upload(buf), ld
    A, lda = stored(opa.T if ta else opa)
    B, ldb = stored(opb.T if tb else opb)
    c0 = rng.standard_normal((m, n))
    C, ldc = stored(c0)
    alpha, beta = np.array(1.5, np.float32), np.array(0.5, np.float32)
    cublas = sim._cublas_module()
    handle = cublas.create()  # its stream: the null stream
    cublas.gemmEx(handle, ta, tb, m, n, k, alpha.ctypes.data, A.data.ptr, 0, lda, B.data.ptr, 0, ldb, beta.ctypes.data,
                  C.data.ptr, 0, ldc, cublas.CUBLAS_COMPUTE_32F, -1)
    got = C.get()[:, :m].T
    want = 1.5 * opa.astype(np.float32).astype(np.float64) @ opb.astype(np.float32) + 0.5 * c0.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.isnan(C.get()[:, m:]).all()  # the padding is not touched
    with pytest.raises(sim.CUBLASError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        cublas.gemmEx(handle, ta, tb, m, n, k, alpha.ctypes.data, A.data.ptr, 14, lda, B.data.ptr, 0, ldb,
                      beta.ctypes.data, C.data.ptr, 0, ldc, cublas.CUBLAS_COMPUTE_32F, -1)


def test_cupys_cublas_refuses_a_capturing_stream_and_the_ctypes_binding_captures(monkeypatch):
    """CuPy 14.2's cuBLAS wrappers point the handle at the current stream before every product and refused
    to while the trainer captured its step on an H200 (NotImplementedError, these words); the stand-in does
    the same. The backend's ctypes binding (cuda/cublas.py, on fake_cublas's stand-in library here) points
    its handle once, before the capture, and its product goes into the graph and runs at each launch."""
    import fake_cublas

    from xtrain_dist.backend.cuda import cublas as ctypes_cublas

    fake_cupy, cupy_cublas = _install_stand_in(monkeypatch)
    monkeypatch.setattr(ctypes_cublas, "_library", fake_cublas.FakeCublas())
    stream = sim.Stream(non_blocking=True)
    cupys = cupy_cublas.create()
    cupy_cublas.setStream(cupys, stream.ptr)
    with stream:
        ours = ctypes_cublas.Cublas(fake_cupy, stream.ptr)
    A = upload(np.array([[2.0]], np.float32))
    C = sim.empty((1, 1), np.float32)
    sim.Stream.null.synchronize()  # the upload, on the null stream, before the non-blocking stream reads it
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    with stream:
        stream.begin_capture()
        with pytest.raises(NotImplementedError) as refused:
            sim.get_cublas_handle()
        assert str(refused.value) == "calling cuBLAS API during stream capture is currently unsupported"
        with pytest.raises(NotImplementedError, match=r"^calling cuBLAS API during stream capture"):
            cupy_cublas.gemmEx(cupys, 0, 0, 1, 1, 1, one.ctypes.data, A.data.ptr, 0, 1, A.data.ptr, 0, 1,
                               zero.ctypes.data, C.data.ptr, 0, 1, cupy_cublas.CUBLAS_COMPUTE_32F, -1)
        ours.gemm(0, 0, 1, 1, 1, 3.0, A.data.ptr, 0, 1, A.data.ptr, 0, 1, 0.0, C.data.ptr, 0, 1,
                  ctypes_cublas.CUBLAS_COMPUTE_32F)
        graph = stream.end_capture()
    assert np.isnan(C.get()[0, 0])  # captured, not run
    graph.launch(stream)
    stream.synchronize()
    assert C.get()[0, 0] == 12.0
    ours.destroy()
    cupy_cublas.destroy(cupys)


def test_cublas_stand_in_rounds_a_bf16_product_before_adding_a_bf16_c():
    """As cuBLAS did on an H100 (kernels/matmul.cu). (1 + 2^-7)(1 + 2^-6) - 1 = 2^-6 + 2^-7 + 2^-13 is a
    bf16 (8 significant bits), so one rounding keeps it; rounding the product first loses the 2^-13."""
    cublas = sim._cublas_module()
    def bf16(x):
        return upload(np.array([np.float32(x).view(np.uint32) >> 16], np.uint16))
    A, B = bf16(1 + 2.0 ** -7), bf16(1 + 2.0 ** -6)
    alpha, beta = np.array(1.0, np.float32), np.array(1.0, np.float32)
    got = {}
    for name, C, ctype in (("bf16", bf16(-1.0), sim.CUDA_R_16BF), ("f32", upload(np.array([-1.0], np.float32)),
                                                                  sim.CUDA_R_32F)):
        cublas.gemmEx(cublas.create(), 0, 0, 1, 1, 1, alpha.ctypes.data, A.data.ptr, sim.CUDA_R_16BF, 1, B.data.ptr,
                      sim.CUDA_R_16BF, 1, beta.ctypes.data, C.data.ptr, ctype, 1, cublas.CUBLAS_COMPUTE_32F, -1)
        host = C.get()
        got[name] = float((host.astype(np.uint32) << 16).view(np.float32)[0]) if name == "bf16" else float(host[0])
    assert got == {"bf16": 2.0 ** -6 + 2.0 ** -7, "f32": 2.0 ** -6 + 2.0 ** -7 + 2.0 ** -13}


# ---------------------------------------------------------------------------- the GPU tests, on the simulator

# The reverse-order run repeats the op tests only: the training tests (marked `training`) compose the
# same kernels. NCCL's tests run with two simulated GPUs (rank threads of one process on one GPU each,
# through fake_nccl).
OP_TESTS = ["-m", "not training"]
TRAINING_TESTS = ["-m", "training"]
CUDA_MODULES = ["tests/test_cuda_ops.py", "tests/test_cuda_bf16.py", "tests/test_cudnn_attention.py"]
# every variant of the flash MMA kernels (backend/cuda/flash_variants.py) against the oracle: forward and
# reverse order (their pipelines of 2 and 3 stages hand buffers between warps), not a third time shuffled
VARIANT_MODULES = ["tests/test_cuda_flash_variants.py"]


# These runs are the slow part of the suite (minutes each on 2 cores), and the outer pytest's dots do not move
# while one runs. The inner pytest runs verbose, a line per test ending in its progress ("[ 40%]"), and every
# PROGRESS_EVERY seconds the latest of those is written to the terminal: `python -m pytest -q` then shows
# where the simulator is, rather than what looks like a hang.
PROGRESS = re.compile(r"^(\S+::\S+) ([A-Z]+)\s.*\[\s*(\d+)%\]\s*$")
PROGRESS_EVERY = 30.0
_REPORTING = threading.Lock()  # one line at a time on the terminal


def run_showing_progress(command, env, label, request, tmp_path, timeout=1200):
    """Run COMMAND (a verbose pytest) and return (returncode, stdout, stderr), writing its progress to the
    outer pytest's terminal past output capture (nothing where there is no terminal reporter, as under
    xdist's workers)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    start = last_report = time.monotonic()
    lines = []
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        # a run that hangs writes nothing, so the limit cannot wait for its next line: a timer kills it
        watchdog = threading.Timer(timeout, process.kill)
        watchdog.start()
        try:
            for line in process.stdout:
                lines.append(line)
                now = time.monotonic()
                mark = PROGRESS.search(line)
                if mark and reporter is not None and capture is not None and (
                        now - last_report >= PROGRESS_EVERY or mark.group(3) == "100"):
                    last_report = now
                    with _REPORTING, capture.global_and_fixture_disabled():
                        reporter.write_line(f"  [{label}: {mark.group(3)}% after {now - start:.0f} s; "
                                            f"{mark.group(1)} {mark.group(2)}]")
            process.wait()
        finally:
            watchdog.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
        if time.monotonic() - start >= timeout:
            raise subprocess.TimeoutExpired(command, timeout, output="".join(lines))
        stderr.seek(0)
        return process.returncode, "".join(lines), stderr.read()


NCCL_MODULES = ["tests/test_nccl.py", "tests/test_nccl_groups.py"]
# A shuffled order drawn from the clock each run (printed on failure; XTRAIN_CUDASIM_ORDER=<it> replays it).
SHUFFLED = str(2 + time.time_ns() % 2**31)


# One test per module and order, each a process of its own: the simulator runs a launch on one core, the modules
# are independent (kernels compile once into a shared cache, under a lock), and pytest-xdist's workers take them
# side by side with the rest of the suite.
# The forward order's run is in two, its training tests and the rest: test_cuda_ops.py whole is the longest run
# (minutes), and a parallel run cannot end before its longest test.
# Its training tests are in two as well: those that write checkpoints (resume, evaluate and sample from them,
# the stop request, --init-from; test_cuda_ops.py's only) apart from the rest.
CHECKPOINTS = ("resumes_bitwise or checkpoint_evaluates or bitwise_reproducible_and or stop_request or "
               "starts_from_init_from")
RUNS = [("forward", [*TRAINING_TESTS, "-k", f"not ({CHECKPOINTS})", *CUDA_MODULES], "1"),
        ("forward", [*TRAINING_TESTS, "-k", CHECKPOINTS, "tests/test_cuda_ops.py"], "1"),
        ("forward", OP_TESTS + CUDA_MODULES + VARIANT_MODULES, "1"),
        ("forward", NCCL_MODULES, "2"), ("reverse", OP_TESTS + CUDA_MODULES + VARIANT_MODULES, "1"),
        (SHUFFLED, OP_TESTS + CUDA_MODULES, "1")]
RUN_IDS = ["cuda-training-forward", "cuda-checkpoints-forward", "cuda-ops-forward", "nccl-2-gpus", "cuda-ops-reverse",
           "cuda-ops-shuffled"]


@pytest.mark.long
@pytest.mark.parametrize("order, options, module, devices", [
    (order, [s for s in select if not s.endswith(".py")], module, devices)
    for order, select, devices in RUNS for module in select if module.endswith(".py")],
    ids=[f"{run}-{Path(module).stem}" for run, (_, select, _) in zip(RUN_IDS, RUNS, strict=True)
         for module in select if module.endswith(".py")])
def test_the_gpu_test_modules_pass_on_the_simulator(order, options, module, devices, request, tmp_path):
    """Every kernel against its numpy oracle (fp32 and bf16, flash attention included), the whole tiny
    model, two virtual ranks training with every DDP option, and NCCL in one process (world 1 bits, rank
    threads on two GPUs, training over it): the GPU tests, run on the CPU. Those marked real_gpu (timing
    across streams, commands and NCCL worlds in processes of their own) skip. -rps lists every passed and
    skipped test by name, so a module that skipped whole (no GPU stand-in, an import gone wrong) is seen, not
    hidden behind a "N passed" closing line."""
    env = dict(os.environ, XTRAIN_CUDASIM="1", XTRAIN_CUDASIM_ORDER=order, XTRAIN_CUDASIM_DEVICES=devices,
               PYTHONUNBUFFERED="1")
    returncode, stdout, stderr = run_showing_progress(
        [sys.executable, "-m", "pytest", "-v", "-rps", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "no:xdist",
         *options, module],
        env, f"simulator, {request.node.callspec.id}", request, tmp_path)
    replay = f"XTRAIN_CUDASIM_ORDER={order} XTRAIN_CUDASIM_DEVICES={devices}"
    tail = "\n".join(stdout.splitlines()[-30:])
    assert returncode == 0, f"{module} on the simulator ({replay}) failed:\n{_failures(stdout)}{tail}\n{stderr[-2000:]}"
    assert " passed" in tail.splitlines()[-1], tail
    passed = [line for line in stdout.splitlines() if line.startswith(f"PASSED {module}::")]
    assert passed, f"{module} passed no test on the simulator ({replay}):\n{tail}"


def _failures(stdout: str) -> str:
    """The failed tests of a verbose pytest's output, by name, and the start of its FAILURES section: the tail of
    the output is -rps's list of what passed and skipped, which leaves them out."""
    lines = stdout.splitlines()
    names = [line.split(" ")[0] for line in lines
             if (progress := PROGRESS.search(line)) and progress.group(2) in ("FAILED", "ERROR")]
    start = next((i for i, line in enumerate(lines) if " FAILURES " in line or " ERRORS " in line), None)
    section = "\n".join(lines[start:start + 60]) if start is not None else ""
    return "".join(f"{name} FAILED\n" for name in names) + (section[:4000] + "\n" if section else "")


def test_fake_nccl_moves_data_and_refuses_mismatched_collectives():
    """The NCCL stand-in sums in rank order across rank threads, and two ranks calling different
    collectives fail in words instead of hanging."""
    import threading

    import fake_nccl

    uid = fake_nccl.UniqueId.from_bytes(fake_nccl.get_unique_id().as_bytes)
    comms = [fake_nccl.Communicator.init(2, r, uid) for r in range(2)]
    raw = fake_nccl._bindings()
    bufs = [upload(np.arange(6, dtype=np.float32) * (r + 1)) for r in range(2)]
    errors = []

    def rank(r, count):
        try:
            raw.all_reduce(bufs[r].data.ptr, bufs[r].data.ptr, count, fake_nccl.FLOAT32, fake_nccl.SUM,
                           comms[r].ptr, 0)
        except fake_nccl.NCCLError as e:
            errors.append(str(e))

    for counts in ((6, 6), (6, 5)):
        threads = [threading.Thread(target=rank, args=(r, counts[r])) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    np.testing.assert_array_equal(bufs[0].get(), 3 * np.arange(6))
    np.testing.assert_array_equal(bufs[1].get(), 3 * np.arange(6))
    assert len(errors) == 2 and all("ranks called different collectives" in e for e in errors), errors


def _nccl4py_parameters(function) -> list[inspect.Parameter]:
    """nccl4py's parameters of a function or method: from its signature, or (a Cython class such as
    bindings.nccl.Comm) from the 'Name(type arg=default, ...)' line Cython embeds in the docstring."""
    try:
        return [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        first = function.__doc__.splitlines()[0]
        return [inspect.Parameter(p.split("=")[0].split()[-1], inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  default=p.split("=")[1] if "=" in p else inspect.Parameter.empty)
                for p in first[first.index("(") + 1:first.rindex(")")].split(",") if p.strip()]


def _takes_what_nccl4py_takes(fake, real, what: str) -> None:
    """The stand-in's parameters are nccl4py's first ones, same names and kinds; those it leaves out have defaults."""
    ours = [p for p in inspect.signature(fake).parameters.values() if p.name != "self"]
    theirs = _nccl4py_parameters(real)
    assert [(p.name, p.kind) for p in ours] == [(p.name, p.kind) for p in theirs[:len(ours)]], (what, ours, theirs)
    assert all(p.default is not inspect.Parameter.empty for p in theirs[len(ours):]), (what, ours, theirs)


def test_the_nccl_stand_in_has_nccl4pys_names_values_and_parameters():
    """fake_nccl held to the real nccl4py (the [test] extra installs it; it imports without a GPU), as
    fake_cupy is held to CuPy: every name of its nccl.core and nccl.bindings.nccl exists in nccl4py, every
    enum has nccl4py's value, every function and method takes nccl4py's parameters in nccl4py's order, a
    property is a property there, and its errors are nccl4py's NCCLError (a status, 'RemoteError (6): ...')."""
    real_core = pytest.importorskip("nccl.core", reason="nccl4py is not installed")
    import fake_nccl
    from nccl.bindings import nccl as real_raw

    fake_raw = fake_nccl._bindings()
    pairs = [(name, value, getattr(real_core, name, None)) for name, value in vars(fake_nccl.core_module()).items()
             if not name.startswith("_")]
    pairs += [(f"bindings.nccl.{name}", value, getattr(real_raw, name, None)) for name, value in vars(fake_raw).items()
              if not name.startswith("_")]
    assert len(pairs) == 14 + 10  # nothing left out of the check (send and recv among the bindings)
    for name, value, real in pairs:
        assert real is not None, f"nccl4py has no {name}"
        if isinstance(value, int):
            assert int(real) == value, name
        elif isinstance(value, types.SimpleNamespace):  # Result: the members nccl.py reads
            assert {k: int(getattr(real, k)) for k in vars(value)} == vars(value), name
        elif isinstance(value, type) and not issubclass(value, BaseException):
            for attribute, member in vars(value).items():
                if attribute.startswith("_"):
                    continue
                theirs = inspect.getattr_static(real, attribute, None)
                assert theirs is not None, f"nccl4py's {name} has no {attribute}"
                assert isinstance(member, property) == isinstance(theirs, property), f"{name}.{attribute}"
                if not isinstance(member, property):
                    _takes_what_nccl4py_takes(getattr(value, attribute), getattr(real, attribute),
                                              f"{name}.{attribute}")
        elif not isinstance(value, type):
            _takes_what_nccl4py_takes(value, real, name)
    # the instance attribute nccl.py reads of a communicator, a property in nccl4py
    assert isinstance(inspect.getattr_static(real_core.Communicator, "ptr"), property)
    assert issubclass(fake_nccl.NCCLError, Exception) and issubclass(real_raw.NCCLError, Exception)
    _takes_what_nccl4py_takes(fake_nccl.NCCLError.__init__, real_raw.NCCLError.__init__, "NCCLError")
    for status in (4, 5, 6):
        assert str(fake_nccl.NCCLError(status)) == str(real_raw.NCCLError(status))
        assert fake_nccl.NCCLError(status).status == real_raw.NCCLError(status).status == status
        assert fake_nccl.get_error_string(status) == real_core.get_error_string(status)


# ---------------------------------------------------------------------------- stream order (streams.py)

COPY = r'''
extern "C" __global__ void copy(float* out, const float* in, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i];
}
'''


@pytest.fixture(scope="module")
def copy_kernel():
    return module(COPY).get_function("copy")


def _streams_and_source():
    a, b = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    with a:
        src = sim.asarray(np.arange(64, dtype=np.float32))  # written on a
    return a, b, src


def test_a_read_on_another_stream_needs_an_event_or_the_host(copy_kernel):
    """A kernel on stream b reading what stream a wrote is a stream race, named with both operations,
    until a's event is waited for by b or the host has synchronised a."""
    a, b, src = _streams_and_source()
    out = sim.empty(64, np.float32)
    with pytest.raises(sim.StreamRace, match=r"kernel copy on stream .* reads bytes 0\.\.256 of a 256-byte "
                                            r"allocation that a copy to the device on stream .* wrote"):
        copy_kernel((1,), (64,), (out, src, np.int32(64)), stream=b)
    b.wait_event(a.record())
    copy_kernel((1,), (64,), (out, src, np.int32(64)), stream=b)
    np.testing.assert_array_equal(out.get(stream=b), np.arange(64))

    a, b, src = _streams_and_source()
    a.synchronize()
    copy_kernel((1,), (64,), (out, src, np.int32(64)), stream=b)
    b.synchronize()  # before src goes: b's read must be known finished (see the use-after-free test)


def test_a_stream_capture_records_replays_and_refuses_what_a_gpu_refuses(copy_kernel):
    """Work queued on a capturing stream, and on a stream that joins it by waiting for an event recorded in
    it, is recorded, not run; each launch of the graph runs it in order. A host read, a copy from pageable
    memory, synchronizing, waiting on the host for a captured event and an allocation the graph's pool has
    not handed out before are errors during the capture, as on a GPU."""
    main, side = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    pool = sim.MemoryPool()
    with main, sim.using_allocator(pool.malloc):
        src, out, later = sim.zeros(64, np.float32), sim.zeros(64, np.float32), sim.zeros(64, np.float32)
        sim.empty(64, np.float32)  # the warm-up: the pool has handed out a block of this size
        main.begin_capture()
        copy_kernel((1,), (64,), (out, src, np.int32(64)), stream=main)
        scratch = sim.empty(64, np.float32)  # a size the pool knows: no cudaMalloc
        joined = main.record()
        side.wait_event(joined)  # side joins the capture
        copy_kernel((1,), (64,), (later, out, np.int32(64)), stream=side)
        main.wait_event(side.record())
        out += 1  # an array method: recorded too
        refused = {"a copy to the host": [out.get, lambda: float(out.sum())],
                   "pageable host memory": [lambda: out.set(np.ones(64, np.float32))],
                   "a stream synchronize": [main.synchronize, side.synchronize],
                   "an event recorded in a stream capture": [joined.synchronize],
                   "an allocation of 400 bytes during stream capture": [lambda: sim.empty(100, np.float32)],
                   "a device synchronize": [sim.Device().synchronize]}
        for what, call in ((what, call) for what, calls in refused.items() for call in calls):
            with pytest.raises(sim.CUDARuntimeError, match=rf"^cudaErrorStreamCaptureUnsupported: cudasim: .*{what}"):
                call()
        graph = main.end_capture()
        assert not main.is_capturing() and not side.is_capturing() and scratch.shape == (64,)
        main.synchronize()
        assert not out.get().any() and not later.get().any()  # nothing ran in the capture
        for launch in (1, 2):
            src[...] = sim.full(64, 10.0 * launch, np.float32)
            graph.launch(main)
            np.testing.assert_array_equal(out.get(), 10.0 * launch + 1)
            np.testing.assert_array_equal(later.get(), 10.0 * launch)
    with main:
        main.begin_capture()
        with pytest.raises(sim.CUDARuntimeError, match=r"^cudaErrorStreamCaptureUnsupported: cudasim: an allocation"):
            sim.empty(64, np.float32)  # the pool is not this thread's allocator here: a cudaMalloc
        main.end_capture()


def test_a_write_after_another_streams_read_needs_an_order_too(copy_kernel):
    """Write after read: stream a overwriting what stream b still reads is a race; reads on two streams
    are not (the kernel's `const` parameter says it only reads)."""
    a, b, src = _streams_and_source()
    b.wait_event(a.record())
    out_b, out_c = sim.empty(64, np.float32), sim.empty(64, np.float32)
    c = sim.Stream(non_blocking=True)
    c.wait_event(a.record())
    copy_kernel((1,), (64,), (out_b, src, np.int32(64)), stream=b)
    copy_kernel((1,), (64,), (out_c, src, np.int32(64)), stream=c)  # two readers: fine
    with a:
        ones = sim.ones(64, np.float32)
    with pytest.raises(sim.StreamRace, match=r"kernel copy on stream .* writes .* that kernel copy on stream .* read"):
        copy_kernel((1,), (64,), (src, ones, np.int32(64)), stream=a)
    sim.Device().synchronize()


def test_an_array_freed_while_another_stream_uses_it_is_reported(copy_kernel):
    """CuPy's pool hands a freed block to the allocating stream's next allocation, so dropping an
    array that another stream may still read is a use after free, reported at the next operation;
    once the allocating stream waits for that stream it is not."""
    for wait_first in (True, False):
        a, b, src = _streams_and_source()
        b.wait_event(a.record())
        with b:
            out = sim.empty(64, np.float32)
        copy_kernel((1,), (64,), (out, src, np.int32(64)), stream=b)
        if wait_first:
            a.wait_event(b.record())
        del src
        with a:
            if wait_first:
                sim.zeros(4, np.float32)
            else:
                with pytest.raises(sim.StreamRace, match=r"use after free: an array allocated on stream .* was "
                                                         r"freed while kernel copy on stream .* may still read it"):
                    sim.zeros(4, np.float32)


@pytest.mark.parametrize("fence,comm,expected", [
    ("none", "local", "trained"),
    ("none", "nccl", "trained"),
    ("bucket", "local", r"cupy\.add on stream .* \(made by thread rank\d-comm\) reads .* that .* on stream .* "
                        r"\(made by thread rank\d\) wrote"),
    ("bucket", "nccl", r"nccl all_reduce on stream .* \(made by thread rank\d-comm\) reads .* that .* "
                       r"\(made by thread rank\d\) wrote"),
    ("finish", "nccl", r"kernel \w+ on stream .* \(made by thread rank\d\) reads .* that nccl all_reduce on "
                       r"stream .* \(made by thread rank\d-comm\) wrote"),
    ("post", "local", r"cupy\.add on stream .* \(made by thread rank(\d)-comm\) reads .* that .* \(made by thread "
                      r"rank(?!\1)\d\) wrote"),
])
def test_training_without_one_of_its_fences_is_a_stream_race(fence, comm, expected):
    """The training loop's orderings across streams, each taken out in turn (tests/cudasim/drop_fence.py):
    the bucket fence (comm thread waits for backward), finish's (AdamW waits for the reductions) and the
    in-process communicator's wait before peers read a posted buffer. Each missing one is found,
    although the simulator ran everything in an order where the results came out right. (finish's
    fence is not needed with the in-process communicator, whose comm thread waits for its own stream
    on the host before finish() returns.)"""
    result = subprocess.run([*RUN, str(ROOT / "tests" / "cudasim" / "drop_fence.py"), fence, comm],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert re.search(expected, last), last


@pytest.mark.parametrize("fence,comm,zero,expected", [
    ("none", "nccl", 3, "trained"),
    ("bucket", "local", 3, r"on stream .* \(made by thread rank\d-zero\) reads .* that .* on stream .* \(made by "
                           r"thread rank\d\) wrote"),
    ("finish", "nccl", 2, r"use after free: an array allocated on stream .* \(made by thread rank\d\) was freed while "
                          r"nccl reduce on stream .* \(made by thread rank\d-zero\) may still (read|write) it"),
    ("finish", "nccl", 3, r"kernel \w+ on stream .* \(made by thread rank\d\) reads .* that nccl \w+ on stream .* "
                          r"\(made by thread rank\d-zero\) wrote"),
])
def test_zero_2_and_3_without_one_of_their_fences_is_a_stream_race(fence, comm, zero, expected):
    """ZeRO-2 and -3's communication thread (parallel/zero.py) on the GPU, each ordering taken out in turn: the
    thread's stream waiting for the compute fence a call carries (bucket: a gather reads the shard AdamW
    wrote, a reduce-scatter the gradient backward wrote), and the compute stream waiting for the thread's fence
    before it reads a gathered unit or drops a reduced gradient buffer (finish: with NCCL, whose calls return
    before the GPU is done)."""
    result = subprocess.run([*RUN, str(ROOT / "tests" / "cudasim" / "drop_fence.py"), fence, comm, str(zero)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert re.search(expected, last), last


# ---------------------------------------------------------------------------- scripts, on the simulator

RUN = [sys.executable, str(ROOT / "tests" / "cudasim" / "run.py")]


def _losses(stdout: str) -> list[float]:
    return [float(line.split("| loss ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("step ")]


def refusal_of(command, env) -> str:
    """The one line a command refused with (exit 2, nothing on stdout but the defaults' line)."""
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # stdout: at most the line saying what the GPU defaults chose (the run's first), nothing of a run
    assert run.returncode == 2 and all(line.startswith("cuda: attention ") for line in run.stdout.splitlines()), \
        run.stdout + run.stderr[-2000:]
    [line] = run.stderr.splitlines()
    return line


@pytest.mark.long
def test_the_command_line_trains_on_cuda_like_numpy():
    """train_ddp's --backend cuda path end to end (device choice, two virtual ranks, bf16, with --matmul
    cublas and with the default, cublaslt), before a GPU session spends time on it: the same command on
    numpy's bf16 emulation gives the same losses. The first line says what the defaults chose (tiny's
    16-channel heads: standard attention). Two held-out batches, not the command's 20: evaluation runs, at a
    tenth of its cost on the simulator."""
    command = ["-m", "xtrain_dist.train_ddp", "3", "4", "32", "--model", "tiny", "--world-size", "2", "--dtype", "bf16",
               "--eval-batches", "2"]
    cuda = subprocess.run([*RUN, *command, "--backend", "cuda", "--matmul", "cublas"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert cuda.returncode == 0, cuda.stderr[-2000:]
    assert cuda.stdout.splitlines()[0] == ("cuda: attention standard (default on a GPU), matmul cublas (given), "
                                           "graphs on")
    assert "cuda backend, bf16, 2 rank(s) on GPUs [0, 0]" in cuda.stdout
    numpy_run = subprocess.run([sys.executable, *command, "--backend", "numpy"], cwd=ROOT, capture_output=True,
                               text=True, timeout=600)
    assert numpy_run.returncode == 0, numpy_run.stderr[-2000:]
    got, want = _losses(cuda.stdout), _losses(numpy_run.stdout)
    assert len(got) == 3 and got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=1e-3)
    lt = subprocess.run([*RUN, *command, "--backend", "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert lt.returncode == 0, lt.stderr[-2000:]
    assert lt.stdout.splitlines()[0] == ("cuda: attention standard (default on a GPU), matmul cublaslt (default on a "
                                         "GPU), graphs on")
    assert "cuda backend, bf16, biases in cuBLASLt's epilogue, 2 rank(s) on GPUs [0, 0]" in lt.stdout
    np.testing.assert_allclose(_losses(lt.stdout), want, rtol=1e-3)


def test_the_report_says_what_the_gpu_held_and_the_preflight_bound_is_below_it(tmp_path):
    """Two virtual ranks on GPU 0: the report's gpu_pool_bytes (what CuPy's pool held: the simulator's pool
    keeps the high-water mark of live arrays, as CuPy's keeps its freed blocks) is at least the memory
    check's bound for them (both ranks' state, one rank's activations) and below twice their state and
    activations together; the last line says it."""
    from xtrain_dist.train import memory

    report = tmp_path / "r.json"
    run = subprocess.run([*RUN, "-m", "xtrain_dist.train_ddp", "2", "8", "64", "--model", "tiny", "--world-size",
                          "2", "--eval-batches", "0", "--backend", "cuda", "--report", str(report)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(report.read_text())["memory"]
    rank = memory.RankMemory(**figures["rank0_bytes_at_least"])  # the two ranks get 4 sequences each
    [held] = figures["gpu_pool_bytes"].values()
    assert list(figures["gpu_pool_bytes"]) == ["0"]
    assert memory.least_bytes([rank, rank]) <= held <= 2 * 2 * (rank.persistent + rank.activations), (rank, held)
    assert run.stdout.splitlines()[-1].endswith(f", GPU memory held {memory.gib(held)}, report {report}")


def test_virtual_ranks_too_large_for_their_gpu_are_refused_before_they_start():
    """The pre-flight memory check on --backend cuda reads each GPU's free memory (cudaMemGetInfo; the
    simulator's is XTRAIN_CUDASIM_MEMORY) and counts the virtual ranks sharing it: 42 MiB holds one tiny
    rank with its 32 MiB cuBLAS workspace but not two, nor one with --matmul cublaslt's 32 MiB more (no
    evaluation: the check is the point, and the simulator's time)."""
    command = [*RUN, "-m", "xtrain_dist.train_ddp", "1", "4", "32", "--model", "tiny", "--backend", "cuda",
               "--eval-batches", "0"]
    env = dict(os.environ, XTRAIN_CUDASIM_MEMORY=str(42 << 20))
    # the default --matmul on a GPU is cublaslt (backend/cuda/defaults.py), which does not fit: cublas asked for
    line = refusal_of(command, env)
    assert " of AdamW state and 64.0 MiB of cuBLAS workspace, and " in line, line
    command = [*command, "--matmul", "cublas"]
    one = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]

    def refusal(*extra) -> str:
        return refusal_of([*command, *extra], env)

    line = refusal("--world-size", "2")
    assert line.startswith("train_ddp: error: not enough memory for this run: its 2 ranks need at least "), line
    assert "and GPU 0 has 42.0 MiB available" in line, line
    line = refusal("--matmul", "cublaslt")
    assert line.startswith("train_ddp: error: not enough memory for this run: it needs at least "), line
    assert " of AdamW state and 64.0 MiB of cuBLAS workspace, and " in line, line


@pytest.mark.long
def test_bench_gpu_runs_our_rows_on_the_simulator(tmp_path):
    """bin/bench_gpu's side of ours (fp32, bf16, flash, cuDNN's attention through its stand-in, each
    --matmul, with and without a CUDA graph, the per-op profile and attention's share, the results files)
    runs; the first losses agree (the same weights and batch), a graph row's replayed step ends with the loss
    of the same row without it, to the bit, and the profile names the step's ops. The tiny model takes the
    rows of standard attention; flash attention's rows need heads of 64 channels, the small model's (each
    small row costs the simulator about ten tiny ones), and so do cuDNN's."""
    plain = {"tiny": [("fp32", "ours"), ("fp32", "ours lt"), ("bf16", "ours"), ("bf16", "ours lt")],
             "small": [("bf16", "ours flash"), ("bf16", "ours cudnn"), ("bf16", "ours flash lt"),
                       ("bf16", "ours cudnn lt")]}
    # the graph rows of the tiny model only: the small model's would replay the same graph code at ten times the cost
    for preset, precisions, attentions, graphs in (("tiny", "fp32,bf16", "standard", "off,on"),
                                                   ("small", "bf16", "flash,cudnn", "off")):
        out = tmp_path / preset
        result = subprocess.run([*RUN, "bin/bench_gpu", "--presets", preset, "--shapes", "1x64", "--precisions",
                                 precisions, "--attentions", attentions, "--torch-modes", "", "--steps", "1",
                                 "--warmup", "1" if "on" in graphs else "0", "--cuda-graphs", graphs, "--vocab", "512",
                                 "--out", str(out)], cwd=ROOT, capture_output=True,
                                text=True, timeout=600, env=dict(os.environ, XTRAIN_CUDASIM_CUDNN="1"))
        assert result.returncode == 0, result.stderr[-2000:]
        [report] = out.glob("*.json")
        rows = json.loads(report.read_text())["rows"]
        graphed = "on" in graphs
        assert [(r["precision"], r["impl"]) for r in rows] == [
            row for precision in precisions.split(",") for row in
            [*[r for r in plain[preset] if r[0] == precision],
             *[(p, f"{impl} graph") for p, impl in plain[preset] if p == precision and graphed]]]
        by_impl = {(r["precision"], r["impl"]): r for r in rows}
        for precision, impl in plain[preset] if graphed else []:
            graph = by_impl[precision, f"{impl} graph"]
            assert graph["graph_launches"] == 1  # the timed step, after the warm one
            assert graph["last_loss"] == by_impl[precision, impl]["last_loss"], (precision, impl)
        for row in rows:
            assert "error" not in row, row
            assert abs(row["first_loss"] - rows[0]["first_loss"]) < 1e-3 * rows[0]["first_loss"], row
            ops = {p["op"] for p in row["profile"]}
            assert {"matmul_forward", "fused_classifier", "adamw_update"} <= ops, ops
            assert ("flash_attention_forward" in ops) == ("flash" in row["impl"] or "cudnn" in row["impl"]), ops
            assert row.get("flash_kernels") == ("kernels/flash_attention_mma.cu" if "flash" in row["impl"] else
                                                "cuDNN's fused attention (backend/cuda/cudnn_sdpa.py)"
                                                if "cudnn" in row["impl"] else None)
            assert 0 < row["attention_share"] < 1
        assert len(list(out.glob("*.md"))) == 1
    assert "### Where our step's time goes: small, 1 x 64, bf16, ours flash lt (flash attention: " \
        "kernels/flash_attention_mma.cu)" in report.with_suffix(".md").read_text()
    assert "Attention alone: " in report.with_suffix(".md").read_text()


def test_bench_gpu_records_an_attention_path_the_model_lacks_as_a_row_and_goes_on(tmp_path):
    """The GPU script asks for every attention path by name, cuDNN's too: where this version's model lacks one,
    its row records the model's refusal and the next row runs (the run exits 0, its file written)."""
    from xtrain_dist.model import ATTENTIONS

    result = subprocess.run([*RUN, "bin/bench_gpu", "--presets", "small", "--shapes", "1x64", "--precisions", "bf16",
                             "--attentions", "cudnn,standard", "--matmuls", "cublas", "--cuda-graphs", "off",
                             "--torch-modes", "", "--steps", "1", "--warmup", "0", "--vocab", "512", "--no-profile",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    [report] = tmp_path.glob("*.json")
    cudnn, standard = json.loads(report.read_text())["rows"]
    assert (cudnn["impl"], standard["impl"]) == ("ours cudnn", "ours") and standard["ms"] > 0
    if "cudnn" not in ATTENTIONS:  # where the model has it, its row is timed like any other
        assert cudnn["error"] == f"XtrainError: --attention must be one of {', '.join(ATTENTIONS)}, got 'cudnn'"
        assert "| ours cudnn | 512 | XtrainError: --attention must be one of" in report.with_suffix(".md").read_text()


def test_bench_gemm_runs_our_rows_on_the_simulator(tmp_path):
    """bin/bench_gemm's side of ours: every layer, pass and precision gets a row, the classifier twice (its
    vocabulary and that padded to 128), the layers with a bias "lt" rows (--matmul cublaslt), the MLP's
    layers their GELU rows (both libraries), the results files are written, and the cuBLASLt call's host
    cost is timed through ctypes (nvmath-python, not installed here, is said to be not measured)."""
    result = subprocess.run([*RUN, "bin/bench_gemm", "--preset", "tiny", "--tokens", "32", "--vocab", "1001",
                             "--precisions", "fp32,bf16", "--no-torch", "--reps", "1", "--warmup", "1", "--out",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    [report] = tmp_path.glob("*.json")
    results = json.loads(report.read_text())
    rows = results["rows"]
    layers = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head V=1001", "lm_head V=1024"]
    gelu = {"mlp.c_fc": ("forward gelu",), "mlp.c_proj": ("backward gelu",)}
    assert [(r["precision"], r["layer"], r["pass"]) for r in rows] == [
        (p, layer, pass_) for p in ("fp32", "bf16") for layer in layers
        for pass_ in ("forward", "product", "product tn", "backward", *gelu.get(layer, ()))
        + (("forward lt", "backward lt", "backward bgrad lt", *(f"{g} lt" for g in gelu.get(layer, ())))
           if "lm_head" not in layer else ())]
    assert all(r["ours_ms"] > 0 and "torch_ms" not in r for r in rows)
    assert len(list(tmp_path.glob("*.md"))) == 1
    costs = results["header"]["lt_call_us"]
    assert costs["ctypes"] > 0 and costs["nvmath"].startswith("not measured: ModuleNotFoundError"), costs


def test_bench_gemm_search_writes_the_tuning_table_the_rows_then_read(tmp_path):
    """bin/bench_gemm --search on the simulator: every product the step runs under --matmul cublaslt (each
    epilogue, and the plain forward, input- and weight-gradient products in the operand orders they have) gets
    the fastest of the stand-in's algorithms by wall time in the GPU's table, the other sections of the table
    kept; the results name them; a damaged table is one line and is left as it was."""
    tables = tmp_path / "tuned"
    tables.mkdir()
    (tables / "cudasim-cpu.json").write_text('{"attention": {"1024": "q64"}}')
    command = [*RUN, "bin/bench_gemm", "--preset", "tiny", "--tokens", "32", "--precisions", "bf16", "--no-torch",
               "--reps", "1", "--warmup", "0", "--lt-bindings", "", "--search", "--tuned-dir", str(tables)]
    result = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    table = json.loads((tables / "cudasim-cpu.json").read_text())
    assert table["attention"] == {"1024": "q64"}
    products = table["products"]
    kinds = {(key[:2], key.split(" compute ")[1].split()[1]) for key in products}
    assert kinds == {("NN", "BIAS"), ("NN", "GELU_AUX_BIAS"), ("TN", "DGELU"), ("NT", "BGRADA"), ("NN", "DEFAULT"),
                     ("TN", "DEFAULT"), ("NT", "DEFAULT")}, kinds
    for key, entry in products.items():
        assert 0 <= entry["rank"] < entry["tried"] == 4 and entry["ms"] <= entry["first_ms"], (key, entry)
        assert len(entry["algo"]) == 8 and int(entry["algo"][6], 16) == entry["rank"], (key, entry)
    assert table["measured"]["products"]["failures"] == {}
    assert "--search" in table["measured"]["products"]["command"]
    [report] = tmp_path.glob("bench_gemm-*.json")
    search = json.loads(report.read_text())["header"]["search"]
    assert sorted(r["key"] for r in search["rows"]) == sorted(products)
    assert "### Algorithm search: the heuristic's top 8 timed" in report.with_suffix(".md").read_text()

    (tables / "cudasim-cpu.json").write_text("{damaged")
    damaged = subprocess.run([*command, "--out", str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert damaged.returncode == 2 and damaged.stderr.startswith(
        f"bench_gemm: error: tuning table '{tables / 'cudasim-cpu.json'}' cannot be read ("), damaged.stderr
    assert len(damaged.stderr.splitlines()) == 1 and (tables / "cudasim-cpu.json").read_text() == "{damaged"


def test_bench_attention_runs_our_rows_on_the_simulator(tmp_path):
    """bin/bench_attention's side of ours, as the GPU machine runs it but at tiny shapes: both our kernel
    files and cuDNN's (its stand-in), forward and backward, a row each with its causal TFLOP/s and its error
    against numpy's emulation (none for the stand-in, which computes it), and the results files written;
    without cuDNN its rows record the one line and the next rows run."""
    impls = ("ours-cudnn", "ours", "ours-wmma", "ours-cudnn-nondet")
    command = [*RUN, "bin/bench_attention", "--shapes", "1x2x130x64,2x1x64x64", "--no-torch", "--reps", "1",
               "--warmup", "0", "--impls", ",".join(impls)]
    for cudnn, out in (("1", tmp_path / "with"), ("0", tmp_path / "without")):
        out.mkdir()
        result = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                                env=dict(os.environ, XTRAIN_CUDASIM_CUDNN=cudnn))
        assert result.returncode == 0, result.stderr[-2000:]
        [report] = out.glob("bench_attention-*.json")
        rows = json.loads(report.read_text())["rows"]
        assert [(r["shape"], r["impl"], r["pass"]) for r in rows] == [
            (shape, impl, pass_) for shape in ("1 x 2 x 130 x 64", "2 x 1 x 64 x 64") for impl in impls
            for pass_ in ("forward", "backward")]
        for r in rows:
            if cudnn == "0" and r["impl"].startswith("ours-cudnn"):
                assert r["error"] == ("XtrainError: --attention cudnn needs the nvidia-cudnn-frontend package "
                                      "(module cudnn): pip install 'xtrain-dist[cuda]'"), r
                continue
            work = 4 * r["B"] * r["NH"] * r["T"] ** 2 * r["hs"] / 2 * (2.5 if r["pass"] == "backward" else 1)
            assert r["ms"] > 0 and r["tflops"] == pytest.approx(work / r["ms"] / 1e9)
            for output, (most, norm) in r["errors"].items():  # ulps of out and dqkv, lse absolute; and norm-wise
                # the stand-in computes the emulation; our kernels round alike but sum in another order (ulps
                # count large where a value cancels to near 0, so the bound is norm-wise)
                assert (most, norm) == (0, 0) if r["impl"].startswith("ours-cudnn") else \
                    (0 <= most < np.inf and norm < 1e-3), (r["impl"], output, most, norm)
        assert len(list(out.glob("bench_attention-*.md"))) == 1


def test_bench_attention_sweep_times_every_variant_and_writes_the_table_on_the_simulator(tmp_path):
    """bin/bench_attention --sweep as the GPU machine runs it, at two tiny shapes (head sizes 64 and 128): a
    row for every variant of each pass that serves the head size, each compared with the first and timed,
    the fastest per shape and pass in the table the backend reads, and the sweep's results files."""
    from xtrain_dist.backend.cuda import flash_variants

    shapes = {"1 x 2 x 40 x 64": 64, "1 x 1 x 24 x 128": 128}
    result = subprocess.run([*RUN, "bin/bench_attention", "--sweep", "--shapes", "1x2x40x64,1x1x24x128", "--no-torch",
                             "--reps", "1", "--warmup", "0", "--out", str(tmp_path), "--tuned-dir",
                             str(tmp_path / "tuned")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    [report] = tmp_path.glob("bench_attention-sweep-*.json")
    rows = json.loads(report.read_text())["rows"]
    assert [(r["shape"], r["pass"], r["variant"]) for r in rows] == [
        (shape, pass_, v.name) for shape, hs in shapes.items() for pass_ in ("forward", "backward")
        for v in sorted(flash_variants.variants(pass_, hs), key=lambda v: v != flash_variants.DEFAULT)]
    assert all(r["ms"] > 0 for r in rows), [r for r in rows if "ms" not in r]
    table = json.loads((tmp_path / "tuned" / "cudasim-cpu.json").read_text())
    fastest = {}
    for r in rows:
        key = (r["pass"], f"{r['B']}x{r['NH']}x{r['T']}x{r['hs']}")
        fastest[key] = min(fastest.get(key, (float("inf"), "")), (r["ms"], r["variant"]))
    assert table["attention"] == {"forward": {"1x1x24x128": fastest[("forward", "1x1x24x128")][1],
                                              "1x2x40x64": fastest[("forward", "1x2x40x64")][1]},
                                  "backward": {"1x2x40x64": fastest[("backward", "1x2x40x64")][1]}}
    assert table["measured"]["attention"]["device"] == "cudasim (CPU)"
    assert "| 1 x 2 x 40 x 64 |" in next(tmp_path.glob("bench_attention-sweep-*.md")).read_text()


# The global norm's and AdamW's rows: 15.5 million elements by default (an eighth of GPT-2 124M), 7 of a run's 8
# CPU-seconds on the simulator. fp32's run takes enough for the norm's grid to reach its cap (NORM_MAX_BLOCKS
# blocks of NORM_BLOCK threads, 4 elements each: 2,097,152), so its threads loop; the others a few blocks' worth.
@pytest.mark.parametrize("options, params", [([], 2_100_001), (["--dtype", "bf16"], 100_003),
                                             (["--dtype", "bf16", "--channels", "128"], 100_003),
                                             (["--tf32"], 100_003),
                                             (["--dtype", "bf16", "--matmul", "cublaslt"], 100_003)])
@pytest.mark.long
def test_kernel_errors_tables_on_the_simulator(tmp_path, options, params):
    """bin/kernel_errors (the GPU session's error tables) runs every op, flash attention too where its kernel
    applies (bf16, 64-channel heads); in fp32 every error is float32-sized."""
    out = tmp_path / "errors.json"
    result = subprocess.run([*RUN, "bin/kernel_errors", "--batch", "2", "--seq", "32", "--channels", "64", "--heads",
                             "2", "--vocab", "500", "--params", str(params), "--json", str(out), *options], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["shape"]["params"] == params
    assert report["adamw_bitwise_equal"] is True
    worst = max(row["norm_rel"] for row in report["rows"])
    bound = 1e-5 if not options else 5e-3
    assert 0 <= worst <= bound, [r for r in report["rows"] if r["norm_rel"] > bound]
    flash = [(r["op"], r["output"]) for r in report["rows"] if r["op"].startswith("flash")]
    assert flash == ([("flash_attention_forward", "out"), ("flash_attention_forward", "lse"),
                      ("flash_attention_backward", "dqkv")] if "128" in options else [])


def test_gpu_session_summary_reads_what_the_steps_leave(tmp_path):
    """bin/gpu_session/summary (the end of bin/gpu_session/cuda.sh) on a results folder like a session's:
    a real training report, an error table, a test summary and a skipped step; the summary lists them all."""
    report = tmp_path / "curve_numpy_fp32_w2.json"
    run = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "3", "4", "32", "--model", "tiny",
                          "--world-size", "2", "--report", str(report)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    (tmp_path / "environment.txt").write_text("## device\nNVIDIA H100 80GB HBM3, 81559 MiB, 580.00\n")
    (tmp_path / "pytest_cuda.txt").write_text("....\nSKIPPED [1] tests/x.py:3: why\n120 passed, 1 skipped in 90.00s\n")
    (tmp_path / "skipped.txt").write_text("## compute-sanitizer racecheck: skipped, the time budget is spent\n")
    (tmp_path / "kernel_errors.md").write_text("| op | output |\n| --- | --- |\n| gelu_forward | out |\n")
    (tmp_path / "sanitizer_memcheck.txt").write_text("........\n========= ERROR SUMMARY: 0 errors\n")
    result = subprocess.run([sys.executable, "bin/gpu_session/summary", str(tmp_path), "0", "0", "1", "124", "512"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "cuda_results.md").read_text()
    losses = json.loads(report.read_text())["losses"]
    for expected in ("NVIDIA H100 80GB HBM3", "512 s in all", "- tests: exit 0", "  - 120 passed, 1 skipped",
                     "- kernel_errors: exit 1", "- compute-sanitizer memcheck + racecheck: exit 124",
                     "- compute-sanitizer racecheck: skipped, the time budget is spent", "| gelu_forward | out |",
                     "  - memcheck: ERROR SUMMARY: 0 errors", "  - racecheck: did not run",
                     f"| 1 | {losses[0]:.4f} |", "| numpy_fp32_w2 | ", " | True |"):
        assert expected in summary, (expected, summary)


@pytest.mark.long
def test_the_gpu_session_scripts_run_to_their_summaries_on_the_simulator(tmp_path):
    """bin/gpu_session.sh (gpu_session/cuda.sh, then gpu_session/bench.sh) and bin/gpu_session/nccl.sh,
    unchanged, with every Python process they start on the simulator (tests/cudasim/site): each step runs
    or is skipped by the time budget, each script ends in its summary, and what a device call brings back
    (8 files at most) is the summaries, the benchmark tables and the packed rest. What it checks is the
    scripts' own flow, which otherwise would first run on a GPU: every step is given the smallest work that
    shows it runs (one op test, two steps of the tiny model, 16-token rows), as what each step measures is
    checked on the simulator by the tests of its own tool."""
    # PY: this test's python, not whichever python3 PATH finds (a venv's python run without activating it)
    env = dict(os.environ, XTRAIN_CUDASIM="1", PYTHONPATH=str(ROOT / "tests" / "cudasim" / "site"),
               XTRAIN_CUDASIM_NCCL_TIMEOUT="5", PYTHONDONTWRITEBYTECODE="1", PY=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    small = "--precisions bf16 --torch-modes= --steps 1 --warmup 0 --vocab 512"
    # run 1 first, before the sweeps: it pays for the simulator's first kernel builds; run 2 one row
    run2 = f"--presets tiny --shapes 1x16 {small} --attentions standard --matmuls cublas --cuda-graphs off"
    runs = {"BENCH_GPU_RUNS": f"60 --presets tiny --shapes 1x32 {small} --no-profile;60 {run2}",
            "BENCH_GEMM_ARGS": f"--preset tiny --tokens 16 --no-torch --reps 1 --precisions bf16 "
            f"--search --tuned-dir {tmp_path / 'tuned'}", "TUNED_DIR": str(tmp_path / "tuned"),
            "BENCH_ATTENTION_ARGS": "--shapes 1x1x64x64 --no-torch --reps 1 --warmup 0"}
    # the cuda half's steps: one op test for the tests, two steps of the tiny model for the curves; the budgets
    # are only bounds here (each step's work takes seconds, unless the machine is busy with much else)
    cuda_half = {"TESTS": "tests/test_cuda_ops.py::test_causal_softmax_and_backward", "TEST_WORKERS": "1",
                 "CURVE": "2 2 16 --eval-batches 0", "GELU_ROWS": "4",
                 "KERNEL_ERRORS_ARGS": "--batch 1 --seq 16 --channels 64 --heads 1 --vocab 64 --params 4099"}
    # PACK_RESULTS=1, as the device call sets it
    out = tmp_path / "session"
    session = subprocess.run(["bash", "bin/gpu_session.sh"], cwd=ROOT, env=dict(
        env, OUT=str(out), PACK_RESULTS="1", BUDGET="400", CUDA_BUDGET="200", **runs, **cuda_half),
        capture_output=True, text=True, timeout=600)
    back = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert back == ["bench/bench_results.md", "cuda/cuda_results.md", "results.tar.gz", "session.txt"], back
    summary = (out / "cuda" / "cuda_results.md").read_text()
    for expected in ("## versions", "- tests: exit 0", "passed", "- curves: exit 0", "- kernel_errors: exit 0",
                     "- compute-sanitizer memcheck + racecheck: exit", "  - memcheck: ", "| cuda_bf16_w2 | "):
        assert expected in summary, (expected, summary)
    with tarfile.open(out / "results.tar.gz") as packed:
        names = set(packed.getnames())
        tables = sorted(n for n in names if re.fullmatch(r"\./bench/run\d/bench_gpu-.*\.(md|json)", n))
        assert [t[:13] for t in tables] == ["./bench/run1/"] * 2 + ["./bench/run2/"] * 2, names
        assert {"./cuda/environment.txt", "./cuda/pytest_cuda.txt",
                "./bench/run1/bench_gpu.txt"} <= names and any(n.startswith("./bench/bench_gemm-") for n in names)
        assert any(n.startswith("./bench/bench_attention-") for n in names), names
        assert "./bench/tuned/cudasim-cpu.json" in names, names  # the search's table comes back
        environment = packed.extractfile("./cuda/environment.txt").read().decode()
    assert "## cuBLASLt (--matmul cublaslt)\ntests/cudasim/fake_cublaslt.py (the simulator's stand-in), version 0" \
        in environment, environment
    summary = (out / "bench" / "bench_results.md").read_text()
    # run 2 may meet its cap on a loaded machine: a run cut short (124) keeps the rows it finished
    assert re.search(rf"- run 2: `bin/bench_gpu {re.escape(run2)}`: exit (0|124) \(run2/bench_gpu-", summary), summary
    assert "- run 1: `bin/bench_gpu --presets tiny --shapes 1x32" in summary and "`: exit 0 (run1/bench_gpu-" in summary
    # first, the best row of each side over both runs (here ours only: the dry run races no PyTorch)
    assert summary.index("## Our best row against PyTorch's best") < summary.index("- run 1:"), summary
    assert re.search(r"\| tiny \| 1 x 32 \| bf16 \| ours[^|]* \| 512 \| [\d,]+ \| n/a / n/a \| no row \| \| \| \| \|\n"
                     r"\| tiny \| 1 x 16 \| bf16 \| ours", summary), summary
    assert "- `bin/bench_gemm --preset tiny" in summary and "`: exit 0 (bench_gemm-" in summary, summary
    assert "tuned/cudasim-cpu.json" in summary, summary
    assert "- compute-sanitizer racecheck: exit " in summary, summary
    assert "- `bin/bench_attention --shapes 1x1x64x64 --no-torch --reps 1 --warmup 0`: exit 0 (bench_attention-" \
        in summary, summary
    assert re.search(r"## bench_attention-\S+\.md\n\n\| B x NH x T x hs \| impl \| pass \|.*\n\|---.*\n"
                     r"\| 1 x 1 x 64 x 64 \| ours \| forward \|", summary), summary
    # each run's table of rows, for a first look without the archive
    assert re.search(r"## run2/bench_gpu-\S+\.md\n\n(?:\*\*Incomplete[^\n]*\n)?\| preset \| B x T \|.*\n\|---.*\n"
                     r"\| tiny \| 1 x 16 \| bf16 \| ours \|", summary), summary
    assert "| tiny | 1 x 32 | bf16 | ours flash lt |" not in summary  # tiny's heads are not 64 channels
    assert "| tiny | 1 x 32 | bf16 | ours lt |" in summary and "### Where our step" not in summary, summary
    verdict = (out / "session.txt").read_text()
    assert re.fullmatch(r"## gpu_session.sh: cuda exit 0, bench exit \d+, \d+ s in all\n", verdict), verdict
    if shutil.which("compute-sanitizer") is None:  # a step that could not run fails the call
        assert "racecheck: exit 127 (last line: compute-sanitizer not on this machine)" in summary, summary
        assert "bench exit 1," in verdict and session.returncode == 1, session.stderr[-2000:]
    # the script's own flow: one test of tests/test_nccl.py stands in for the module, which runs whole on the
    # simulator in test_the_gpu_test_modules_pass_on_the_simulator[nccl-2-gpus-test_nccl]
    nccl = subprocess.run(["bash", "bin/gpu_session/nccl.sh"], cwd=ROOT, env=dict(
        env, OUT=str(tmp_path / "nccl"), PYTEST_ADDOPTS="-k test_world1_collectives_keep_the_bits"),
                          capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "nccl" / "nccl_results.md").read_text()
    # one process's fake NCCL cannot reach another process: the probe fails there, the summary says so, and
    # the script's exit status is the probe's
    assert nccl.returncode == 1, nccl.stderr[-2000:]
    for expected in ("- tests/test_nccl.py: exit 0", "passed", "two processes on one GPU with distinct NCCL_HOSTID: "
                     "FAILED", "No bandwidth table"):
        assert expected in summary, (expected, summary)


def test_a_step_runs_within_what_is_left_of_the_budget_or_is_listed_as_skipped(tmp_path):
    """bin/gpu_session/common.sh's step: a command runs under `timeout` with min(its cap, the budget left less
    15 s); with under 20 s left it does not start, exits 124 and is listed in skipped.txt for the summary.
    (The GPU scripts' dry run above finishes its steps well within its budget.)"""
    script = ('. bin/gpu_session/common.sh; session_setup; timeout() { echo "timeout $*"; }; '
              'step first 60 true; echo "first $?"; BUDGET=100; step tight 120 true; '
              'BUDGET=34; step late 60 true; echo "late $?"')
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path), BUDGET="600"),
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    # the budget's seconds are whole: a second may tick between two steps
    assert lines[2] in ("timeout -k 10 85 true", "timeout -k 10 84 true"), out.stdout + out.stderr
    assert lines[:2] + lines[3:] == ["timeout -k 10 60 true", "first 0", "## late: skipped, the time budget is spent",
                                     "late 124"], out.stdout + out.stderr
    assert (tmp_path / "skipped.txt").read_text() == "## late: skipped, the time budget is spent\n"


def test_the_bench_half_goes_on_from_the_run_it_is_told(tmp_path):
    """A second run of the bench half goes on where the first one's budget stopped (BENCH_GPU_FROM=2): the
    runs before it are not run, nor bench_attention and bench_gemm, which came before run 1, and the one it
    starts at keeps its number, so the two runs' folders sit side by side."""
    env = dict(os.environ, XTRAIN_CUDASIM="1", PYTHONPATH=str(ROOT / "tests" / "cudasim" / "site"),
               PYTHONDONTWRITEBYTECODE="1", PY=sys.executable, OUT=str(tmp_path), BUDGET="120", BENCH_GPU_FROM="2",
               BENCH_GPU_RUNS="60 --presets tiny --shapes 1x16 --bogus;60 --presets tiny --shapes 1x16 --precisions "
               "fp32 --torch-modes= --steps 1 --warmup 0 --vocab 256 --no-profile --matmuls cublas",
               BENCH_GEMM_ARGS="--preset tiny --tokens 16 --no-torch --reps 1",
               BENCH_ATTENTION_ARGS="--shapes 1x1x64x64 --no-torch --reps 1 --warmup 0")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    subprocess.run(["bash", "bin/gpu_session/bench.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                   timeout=300)
    summary = (tmp_path / "bench_results.md").read_text()
    assert "run 1:" not in summary and not (tmp_path / "run1").exists(), summary
    assert not list(tmp_path.glob("bench_attention-*")) and not list(tmp_path.glob("bench_gemm-*"))  # ran first
    assert "- bench_attention and bench_gemm: not run (BENCH_GPU_FROM=2: the first run ran them)" in summary
    assert "- run 2: `bin/bench_gpu --presets tiny --shapes 1x16 --precisions fp32" in summary, summary
    assert "| tiny | 1 x 16 | fp32 | ours | 256 |" in summary, summary


@pytest.mark.long
def test_bench_collectives_over_nccl_on_two_simulated_gpus(tmp_path):
    """bin/bench_collectives --comm nccl (rank threads on two GPUs through nccl4py) runs every op and
    writes its table: the path the GPU session's bandwidth sweep takes, before it has a GPU."""
    env = dict(os.environ, XTRAIN_CUDASIM_DEVICES="2")
    result = subprocess.run([*RUN, "bin/bench_collectives", "--comm", "nccl", "--worlds", "2", "--sizes", "4K,64K",
                             "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    assert sorted({(r["op"], r["world"], r["bytes"]) for r in rows}) == sorted(
        (op, 2, size) for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "ring_all_reduce")
        for size in (4096, 65536))


# ---------------------------------------------------------------------------------------- against CuPy itself

def _documented_parameters(function) -> list[str]:
    """A Cython function's parameter names, from the signature line CuPy embeds in its docstring."""
    return _parameter_names(function.__doc__.splitlines()[0])


def _parameter_names(signature: str) -> list[str]:
    inside = signature[signature.index("(") + 1:signature.rindex(")")]
    return [p.split("=")[0].split()[-1] for p in inside.split(",") if p.strip() and p.strip() != "self"]


def _parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def _install_stand_in(monkeypatch):
    """The simulator's stand-in for CuPy and its cuBLAS binding, in sys.modules for this test only; and the
    libraries it sets as cublas.py's and cublaslt.py's loaded ones (or the import hooks that would), put back
    after it too, so no later test in this process finds a stand-in where it loads the real library."""
    for name in ("cupy", "cupy.cuda", "cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs",
                 "cupy_backends.cuda.libs.cublas"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))  # put back (or removed) after the test
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("xtrain_dist.backend.cuda.cublas", "xtrain_dist.backend.cuda.cublaslt"):
        if name in sys.modules:
            monkeypatch.setattr(sys.modules[name], "_library", sys.modules[name]._library)
    return sim.install(), sys.modules["cupy_backends.cuda.libs.cublas"]


def test_the_stand_in_has_real_cupys_names_values_and_parameters(monkeypatch, real_cupy):
    """What the simulator puts in place of CuPy, held to CuPy itself where it is installed (the [test]
    extra installs it; it imports without a GPU): every name the stand-in defines exists there, every
    constant has CuPy's value (the stand-in interprets them), and every function takes CuPy's parameters in
    CuPy's order, cuBLAS's read from the signatures compiled into CuPy's binding (loading the binding needs
    libcublas, a 444 MB wheel; the next test does that where it is installed). So code that runs on the
    simulator calls nothing that the real library lacks or orders otherwise."""
    import importlib.util

    from xtrain_dist.backend.cuda import gemm

    real = real_cupy
    binding = Path(importlib.util.find_spec("cupy_backends.cuda.libs.cublas").origin).read_bytes()
    fake, fake_cublas = _install_stand_in(monkeypatch)
    for name in ("ndarray", "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "asarray", "array",
                 "argsort", "concatenate", "matmul", "RawModule", "get_default_memory_pool"):
        assert hasattr(real, name), name
    assert "kind" in inspect.signature(real.argsort).parameters  # the backend sorts token ids with kind="stable"

    for name, value in vars(fake_cublas).items():
        if callable(value) and not name.startswith("_") and not isinstance(value, type):
            signature = re.search(rb"\b" + name.encode() + rb"\((intptr_t handle[^)]*)?\)", binding)  # create()
            assert signature, name
            assert _parameters(value) == _parameter_names(signature.group(0).decode()), name

    for name, value in vars(fake.cuda.runtime).items():
        real_value = getattr(real.cuda.runtime, name)
        if name.startswith("CUDA_R_"):
            assert real_value == value, name
        elif callable(value) and not isinstance(value, type):
            assert _parameters(value) == _documented_parameters(real_value), name
    assert real.cuda.runtime.CUDA_R_16BF == gemm.CUDA_R_16BF

    for name in ("Device", "Stream", "Event", "get_current_stream", "get_elapsed_time", "set_allocator",
                 "MemoryPool", "using_allocator", "alloc_pinned_memory", "Graph"):
        assert hasattr(real.cuda, name), name
    for method in ("begin_capture", "end_capture", "is_capturing"):
        assert hasattr(real.cuda.Stream, method), method
    assert _parameters(fake.cuda.Graph.launch) == _documented_parameters(real.cuda.Graph.launch)
    assert hasattr(real.cuda.device, "get_cublas_handle")
    assert _parameters(fake.cuda.Event.__init__) == _documented_parameters(real.cuda.Event.__init__)
    real_stream = _documented_parameters(real.cuda.Stream.__init__)
    assert set(_parameters(fake.cuda.Stream.__init__)) <= set(real_stream), real_stream
    for method in ("use", "synchronize", "wait_event", "record"):
        assert hasattr(real.cuda.Stream, method), method
    for method in ("record", "synchronize", "done"):
        assert hasattr(real.cuda.Event, method), method


def test_the_stand_in_cublas_constants_are_cupys(monkeypatch, real_cupy):
    """The cuBLAS enum values the stand-in interprets (a wrong CUBLAS_OP_T would transpose on the simulator
    and not on the GPU) against CuPy's binding, where libcublas is installed (a GPU machine)."""
    try:
        from cupy_backends.cuda.libs import cublas as real_cublas
    except ImportError as e:
        pytest.skip(f"CuPy's cuBLAS binding does not load here: {e}")
    _, fake_cublas = _install_stand_in(monkeypatch)
    constants = {name: value for name, value in vars(fake_cublas).items() if name.startswith("CUBLAS_")}
    assert constants
    for name, value in constants.items():
        assert getattr(real_cublas, name) == value, name


def test_gelu_epilogue_errors_tells_the_simulators_one_rounding_from_two(tmp_path):
    """bin/gelu_epilogue_errors, which measured cuBLASLt's GELU epilogues on an H200, on the simulator, whose
    stand-in rounds once after the epilogue: each output equals its one-rounding candidate and differs from the
    candidates that round twice or apply the erf form, so the table can tell the orders apart."""
    env = dict(os.environ, XTRAIN_CUDASIM="1", PYTHONPATH=str(ROOT / "tests" / "cudasim" / "site"),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run([sys.executable, "bin/gelu_epilogue_errors", "--rows", "16", "--json",
                             str(tmp_path / "gelu.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    equal = {(row["dtype"], row["output"], row["candidate"]): row["equal"]
             for row in json.loads((tmp_path / "gelu.json").read_text())}
    for output, once in (("pre", "rnd(p + b)"), ("out", "rnd(gelu_tanh(p + b))"), ("dpre", "rnd(g * dgelu_tanh(pre))")):
        assert equal["bf16", output, once] > 0.99, output
        others = [value for (dtype, name, _), value in equal.items() if dtype == "bf16" and name == output]
        assert sorted(others)[-2] < 0.95, (output, others)  # every other candidate is told apart
    assert "| bf16 | dpre | rnd(rnd(g) * dgelu_tanh(pre)) |" in result.stdout
