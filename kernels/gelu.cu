// gelu.cu: GELU with the tanh approximation (GPT-2's "gelu_new"), forward and backward.
// Oracles: numpy_ops.gelu_forward, numpy_ops.gelu_backward, and the bias + GELU of numpy_ops.matmul_gelu_forward.
//
// Both are elementwise: one thread per chunk of N elements (16 bytes when every pointer is aligned,
// else 1; see chunk_start in common.cuh), a short last chunk done one element at a time.
// tanhf is the accurate libdevice tanh; tanh.approx.f32 (sm_75+) would be cheaper but is off from
// numpy by up to ~5e-4 relative, more than the fp32 tests allow, and these kernels are memory-bound anyway.
#include "common.cuh"

constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2 / pi), numpy_ops.GELU_SCALE
constexpr float GELU_CUBIC = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
    const float u = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

// d gelu / dx = 0.5 (1 + tanh u) + 0.5 x s (1 + 3 c x^2) (1 - tanh^2 u), with u = s x (1 + c x^2):
// the same grouping of operations as numpy_ops.gelu_backward; the compiler still fuses some multiply-adds
// into FMAs (one rounding where numpy has two), so they agree to float32 rounding, not bit for bit.
__device__ __forceinline__ float gelu_grad(float x) {
    const float x2 = x * x;
    const float th = tanhf(GELU_SCALE * x * (1.0f + GELU_CUBIC * x2));
    const float slope = 0.5f * GELU_SCALE * x * (1.0f + 3.0f * GELU_CUBIC * x2) * (1.0f - th * th);
    return (th + 1.0f) * 0.5f + slope;
}

// out = gelu(inp)   (numpy_ops.gelu_forward)
template <int N>
__device__ void gelu_forward_impl(floatX* out, const floatX* inp, long long n) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        const Vec<floatX, N> x = load_vec<N>(inp + i);
        Vec<floatX, N> y;
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = from_float<floatX>(gelu(to_float(x[k])));
        store_vec<N>(out + i, y);
    } else {
        for (long long j = i; j < n; ++j) out[j] = from_float<floatX>(gelu(to_float(inp[j])));
    }
}

extern "C" __global__ void gelu_forward(floatX* out, const floatX* inp, long long n, int vec) {
    if (vec) gelu_forward_impl<VEC_X>(out, inp, n);
    else gelu_forward_impl<1>(out, inp, n);
}

// dinp = dout * gelu'(inp)   (numpy_ops.gelu_backward). May run in place (dinp == dout).
template <int N>
__device__ void gelu_backward_impl(floatX* dinp, const floatX* dout, const floatX* inp, long long n) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        const Vec<floatX, N> x = load_vec<N>(inp + i);
        const Vec<floatX, N> d = load_vec<N>(dout + i);
        Vec<floatX, N> y;
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = from_float<floatX>(to_float(d[k]) * gelu_grad(to_float(x[k])));
        store_vec<N>(dinp + i, y);
    } else {
        for (long long j = i; j < n; ++j)
            dinp[j] = from_float<floatX>(to_float(dout[j]) * gelu_grad(to_float(inp[j])));
    }
}

extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* dout, const floatX* inp, long long n, int vec) {
    if (vec) gelu_backward_impl<VEC_X>(dinp, dout, inp, n);
    else gelu_backward_impl<1>(dinp, dout, inp, n);
}

// The c_fc layer's bias and GELU after its product (numpy_ops.matmul_gelu_forward on the cuBLAS path):
// pre = floatX(product + bias), out = floatX(gelu(pre)), GELU reading the pre-activation as stored, so
// that backward's --recompute, which runs gelu_forward on the stored pre, makes the same bits. One pass
// where add_bias and gelu_forward made two. product is float32 (the product's accumulator) and may be pre
// itself when floatX is float: each thread reads its chunk before it writes it. A chunk never crosses a
// row: N = VEC_X only when OC is a multiple of it (and the pointers are aligned).
template <int N>
__device__ void bias_gelu_forward_impl(floatX* pre, floatX* out, const float* product, const floatX* bias,
                                       long long n, int OC) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    const Vec<float, N> p = load_vec<N>(product + i);
    const Vec<floatX, N> b = load_vec<N>(bias + (int)(i % OC));
    Vec<floatX, N> h, y;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        h[k] = from_float<floatX>(p[k] + to_float(b[k]));
        y[k] = from_float<floatX>(gelu(to_float(h[k])));
    }
    store_vec<N>(pre + i, h);
    store_vec<N>(out + i, y);
}

extern "C" __global__ void bias_gelu_forward(floatX* pre, floatX* out, const float* product, const floatX* bias,
                                             long long n, int OC, int vec) {
    if (vec) bias_gelu_forward_impl<VEC_X>(pre, out, product, bias, n, OC);
    else bias_gelu_forward_impl<1>(pre, out, product, bias, n, OC);
}
