// residual.cu: the residual connection's forward, out = a + b.   Oracle: numpy_ops.residual_forward.
// Its backward needs no kernel: layernorm_backward accumulates into the residual stream's gradient.
//
// One thread per chunk of N elements (16 bytes when every pointer is aligned, else 1), a short last
// chunk done one element at a time. The model does not call it: every residual sum of GPT-2 is followed
// by a layernorm, and layernorm.cu's residual_layernorm_forward makes both in one pass over the row.
#include "common.cuh"

template <int N>
__device__ void residual_forward_impl(floatX* out, const floatX* a, const floatX* b, long long n) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        const Vec<floatX, N> x = load_vec<N>(a + i);
        const Vec<floatX, N> y = load_vec<N>(b + i);
        Vec<floatX, N> s;
#pragma unroll
        for (int k = 0; k < N; ++k) s[k] = from_float<floatX>(to_float(x[k]) + to_float(y[k]));
        store_vec<N>(out + i, s);
    } else {
        for (long long j = i; j < n; ++j) out[j] = from_float<floatX>(to_float(a[j]) + to_float(b[j]));
    }
}

extern "C" __global__ void residual_forward(floatX* out, const floatX* a, const floatX* b, long long n, int vec) {
    if (vec) residual_forward_impl<VEC_X>(out, a, b, n);
    else residual_forward_impl<1>(out, a, b, n);
}
