// matmul.cu: the bias halves of a linear layer. The products themselves go through cuBLAS
// (backend/cuda/gemm.py); these kernels supply the bias to the forward product and reduce the bias gradient.
// Oracles: the bias terms of numpy_ops.matmul_forward and numpy_ops.matmul_backward.
//
// Forward: cuBLAS writes the product inp @ weight in float32 (into out itself when floatX is float),
// then add_bias adds the bias and rounds to floatX once. Why not let the GEMM add the bias (bias
// broadcast into a bf16 out, beta = 1)? cuBLAS rounds the product to bf16 before adding C, a second
// rounding that numpy_ops does not make (docs/cuda_backend.md, "Products", has what it cost on a GPU).
// The float32 product costs a bf16 output 4 more bytes per element of traffic than that did (10
// against 6); float32 costs the same (12).
// --matmul cublaslt skips add_bias: cuBLASLt's BIAS epilogue adds the bias to the float32 accumulator
// and rounds once (backend/cuda/cublaslt.py, bound with ctypes since CuPy does not expose cuBLASLt). Its
// BGRADA epilogue computes the bias gradient in the weight-gradient product, which writes it: then only
// bias_backward_finish runs, with one split, to add it to the gradient buffer.
#include "common.cuh"

// out[r, c] = floatX(product[r, c] + bias[c]) for a (rows, OC) output (the "+ bias" of
// out = inp @ weight + bias); out may be product itself (float32). One thread per chunk of N
// consecutive elements; N = VEC_X when OC is a multiple of it and the pointers are aligned (then a
// chunk never crosses a row), else 1.
template <int N>
__device__ void add_bias_impl(floatX* out, const float* product, const floatX* bias, long long n, int OC) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    const Vec<float, N> p = load_vec<N>(product + i);
    const Vec<floatX, N> b = load_vec<N>(bias + (int)(i % OC));
    Vec<floatX, N> o;
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = from_float<floatX>(p[k] + to_float(b[k]));
    store_vec<N>(out + i, o);
}

extern "C" __global__ void add_bias(floatX* out, const float* product, const floatX* bias, long long n, int OC,
                                    int vec) {
    if (vec) add_bias_impl<VEC_X>(out, product, bias, n, OC);
    else add_bias_impl<1>(out, product, bias, n, OC);
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
