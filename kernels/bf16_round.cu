// bf16_round.cu: round a float32 buffer to the nearest bfloat16, ties to even, in place.
// Oracle: numpy_ops.bf16_round. Used by --grad-compress bf16 on each gradient piece before and after
// its reduction: the values a bf16 wire would carry, kept in float32 storage.
//
// bfloat16 is float32's upper 16 bits, so rounding is integer arithmetic on the bits: add 0x7FFF plus
// the lowest kept bit (bit 16), then clear the low 16 bits; a carry out of the mantissa bumps the
// exponent, which is exactly rounding up. NaNs become the quiet NaN 0x7FC00000, as in the oracle.
// One thread per chunk of 4 floats when `buf` is 16-byte aligned, else 1 (the Vec helpers of
// common.cuh); a short last chunk one element at a time.
#include "common.cuh"

__device__ __forceinline__ float bf16_round_one(float x) {
    const unsigned bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return quiet_nan();  // NaN (not inf): exponent all ones, mantissa != 0
    const unsigned rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return __uint_as_float(rounded);
}

template <int N>
__device__ void bf16_round_impl(float* buf, long long n) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        Vec<float, N> x = load_vec<N>(buf + i);
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] = bf16_round_one(x[k]);
        store_vec<N>(buf + i, x);
    } else {
        for (long long j = i; j < n; ++j) buf[j] = bf16_round_one(buf[j]);
    }
}

extern "C" __global__ void bf16_round_inplace(float* buf, long long n, int vec) {
    if (vec) bf16_round_impl<VEC_F>(buf, n);
    else bf16_round_impl<1>(buf, n);
}
