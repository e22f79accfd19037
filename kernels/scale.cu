// scale.cu: buf *= factor, in place.   Oracle: numpy_ops.scale.
//
// The factor is either a number passed by value or the first element of a device array
// (factor_ptr != nullptr), such as a clip coefficient, which is read on the device so that scaling
// by a computed value never waits on the host. One thread per chunk of 4 floats when `buf` is
// 16-byte aligned, else 1; a short last chunk one element at a time.
#include "common.cuh"

template <int N>
__device__ void scale_impl(float* buf, long long n, float f) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        Vec<float, N> x = load_vec<N>(buf + i);
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] *= f;
        store_vec<N>(buf + i, x);
    } else {
        for (long long j = i; j < n; ++j) buf[j] *= f;
    }
}

extern "C" __global__ void scale_inplace(float* buf, long long n, const float* factor_ptr, float factor, int vec) {
    const float f = factor_ptr != nullptr ? *factor_ptr : factor;
    if (vec) scale_impl<VEC_F>(buf, n, f);
    else scale_impl<1>(buf, n, f);
}
