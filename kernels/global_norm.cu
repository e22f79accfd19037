// global_norm.cu: the squared L2 norm of a flat fp32 buffer, and gradient clipping's coefficient.
// Oracles: numpy_ops.global_norm_squared, numpy_ops.clip_coefficient.
//
// The norm is a deterministic two-stage reduction: sum_squares_partial gives each of a fixed number
// of blocks a grid-stride share of the buffer and writes one partial per block; sum_squares_finish
// adds the partials with one block. The grid size is a function of n alone (host) and which elements a
// thread takes depends on n and on whether the buffer is 16-byte aligned (vector or scalar path), both
// fixed for a given buffer, so the summation order, and the bits, are the same on every run and device. Squares are rounded to
// float32 first and then accumulated in float64, as numpy's np.sum(np.square(buf), dtype=float64)
// does: ranks holding equal gradients agree exactly, and 100M+ terms lose nothing to the sum.
// Float64 adds cost nothing here: one per 4 bytes read, far under any GPU's float64 rate.
#include "common.cuh"

// The launch (the host reads these from here): sum_squares_partial runs blocks of NORM_BLOCK threads,
// as many as n / (4 NORM_BLOCK) rounded up but at most NORM_MAX_BLOCKS; sum_squares_finish one block of
// NORM_MAX_BLOCKS threads, a partial each at most.
constexpr int NORM_BLOCK = 512;
constexpr int NORM_MAX_BLOCKS = 1024;
// block_sum parks a value per warp in a scratch of WARP_SIZE values
static_assert(NORM_BLOCK % WARP_SIZE == 0 && NORM_BLOCK <= WARP_SIZE * WARP_SIZE,
              "NORM_BLOCK: whole warps, at most WARP_SIZE of them");
static_assert(NORM_MAX_BLOCKS % WARP_SIZE == 0 && NORM_MAX_BLOCKS <= WARP_SIZE * WARP_SIZE,
              "NORM_MAX_BLOCKS: whole warps, at most WARP_SIZE of them");

template <int N>
__device__ double sum_squares_thread(const float* buf, long long n) {
    double acc = 0.0;
    const long long stride = (long long)gridDim.x * blockDim.x * N;
    for (long long i = chunk_start<N>(); i < n; i += stride) {
        if (i + N <= n) {
            const Vec<float, N> x = load_vec<N>(buf + i);
#pragma unroll
            for (int k = 0; k < N; ++k) acc += (double)__fmul_rn(x[k], x[k]);
        } else {
            for (long long j = i; j < n; ++j) acc += (double)__fmul_rn(buf[j], buf[j]);
        }
    }
    return acc;
}

// Stage 1: partial[block] = sum of squares of this block's grid-stride share. Blocks of NORM_BLOCK
// threads; chunks of 4 floats when `buf` is 16-byte aligned, else 1.
extern "C" __global__ void sum_squares_partial(double* partial, const float* buf, long long n, int vec) {
    __shared__ double scratch[WARP_SIZE];
    double acc = vec ? sum_squares_thread<VEC_F>(buf, n) : sum_squares_thread<1>(buf, n);
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Stage 2: out[0] = float(sum of partial[0 .. n_partial)), one block of NORM_MAX_BLOCKS threads.
extern "C" __global__ void sum_squares_finish(float* out, const double* partial, int n_partial) {
    __shared__ double scratch[WARP_SIZE];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n_partial; i += blockDim.x) acc += partial[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[0] = (float)acc;
}

// out[0] = min(1, max_norm / (sqrt(norm_squared[0]) + 1e-6)), or 1 when max_norm <= 0; in float64
// like numpy. One thread: it keeps the optimizer step free of a device-to-host read of the norm.
// A NaN norm gives a NaN coefficient (np.minimum propagates NaN; fmin would hide it as 1).
extern "C" __global__ void clip_coefficient(float* out, const float* norm_squared, double max_norm) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (max_norm <= 0.0) {
        out[0] = 1.0f;
        return;
    }
    const double c = max_norm / (sqrt((double)norm_squared[0]) + 1e-6);
    out[0] = (float)(c >= 1.0 ? 1.0 : c);
}
