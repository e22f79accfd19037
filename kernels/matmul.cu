// matmul.cu: the bias halves of a linear layer. The products themselves go through cuBLAS
// (cuda_ops.py); these kernels supply the bias to the forward product and reduce the bias gradient.
// Oracles: the bias terms of numpy_ops.matmul_forward and numpy_ops.matmul_backward.
//
// Forward writes the bias into every row of the output first and lets the GEMM add the product to it
// (beta = 1): out = inp @ weight + bias is then formed in float32 inside cuBLAS and rounded to floatX
// once, where adding the bias in a second kernel would round a bf16 output twice. Memory traffic is
// the same either way (one write here, the GEMM's read and write of out).
// What would be faster: cuBLASLt's BIAS / BGRADB epilogues fold both into the GEMM and save one pass
// over the output each; CuPy does not expose cuBLASLt, and the extra pass is small next to the product.
#include "common.cuh"

// out[r, c] = bias[c] for a (rows, OC) output   (the "+ bias" of out = inp @ weight + bias)
// One thread per chunk of N consecutive elements of out; N = VEC_X when OC is a multiple of it and
// the pointers are aligned (then a chunk never crosses a row), else 1.
template <int N>
__device__ void bias_broadcast_impl(floatX* out, const floatX* bias, long long n, int OC) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    store_vec<N>(out + i, load_vec<N>(bias + (int)(i % OC)));
}

extern "C" __global__ void bias_broadcast(floatX* out, const floatX* bias, long long n, int OC, int vec) {
    if (vec) bias_broadcast_impl<VEC_X>(out, bias, n, OC);
    else bias_broadcast_impl<1>(out, bias, n, OC);
}

// Stage 1 of dbias += sum over rows of dout (column sums, see common.cuh): block (32, COL_ROWS) owns
// 32*N output channels and rows [split * rows_per_split, +rows_per_split); writes partial[split, c].
template <int N>
__device__ void bias_backward_impl(float* partial, const floatX* dout, long long rows, int OC, int rows_per_split) {
    __shared__ __align__(sizeof(Vec<float, N>)) float tile[COL_ROWS * WARP_SIZE * N];
    const int c = (blockIdx.x * WARP_SIZE + threadIdx.x) * N;
    const bool valid = c < OC;
    const long long r0 = (long long)blockIdx.y * rows_per_split;
    const long long r1 = min(rows, r0 + rows_per_split);
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.0f;
    if (valid) {
        for (long long r = r0 + threadIdx.y; r < r1; r += COL_ROWS) {
            const Vec<floatX, N> d = load_vec<N>(dout + r * OC + c);
#pragma unroll
            for (int k = 0; k < N; ++k) acc[k] += to_float(d[k]);
        }
    }
    column_tile_store<N>(tile, acc, partial + (long long)blockIdx.y * OC, c, valid);
}

extern "C" __global__ void bias_backward(float* partial, const floatX* dout, long long rows, int OC,
                                         int rows_per_split, int vec) {
    if (vec) bias_backward_impl<VEC_X>(partial, dout, rows, OC, rows_per_split);
    else bias_backward_impl<1>(partial, dout, rows, OC, rows_per_split);
}

// Stage 2: dbias[c] += sum_s partial[s, c], splits in order. One thread per channel.
extern "C" __global__ void bias_backward_finish(float* dbias, const float* partial, int splits, int OC) {
    column_sums_finish_one(dbias, partial, splits, OC);
}
