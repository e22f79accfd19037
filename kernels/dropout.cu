// dropout.cu: inverted dropout with Philox-4x32-10 masks, forward and backward.   Oracle: numpy_ops.dropout
// (the generator and the mask's key: backend/dropout.py, line for line).
//
// out[i] = keep(i) ? inp[i] * scale : 0, where keep(i) compares 32 bits of Philox-4x32-10 with `threshold`.
// Backward is the same map applied to the gradient: the mask is drawn again from the same counters rather
// than stored, so the model launches this kernel in both directions. An element's counter is what the element
// is, not where it sits on this GPU: the tensor is read as (B, groups, L), row b is global sequence
// seq0 + b * seq_stride, group g is global group group0 + g (a head), and e = (group0 + g) * L + l, so
//     counter = (e >> 2, sequence, *step, layer_site), key = (key0, key1), bits = word e & 3 of the four.
// The step is read from device memory, so a step captured in a CUDA graph draws each replay's masks.
//
// One thread per element, each running the ten rounds for its own counter: four neighbours share a counter
// and so repeat each other's rounds, but dropout is a pass over memory and the rounds are integer products
// on registers. out may be inp (in place).
#include "common.cuh"

constexpr unsigned PHILOX_M0 = 0xD2511F53u;
constexpr unsigned PHILOX_M1 = 0xCD9E8D57u;
constexpr unsigned PHILOX_W0 = 0x9E3779B9u;
constexpr unsigned PHILOX_W1 = 0xBB67AE85u;
constexpr int PHILOX_ROUNDS = 10;
constexpr int DROPOUT_BLOCK = 256;

// Word `lane` of Philox-4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1). The key is bumped before every
// round but the first; (hi, lo) of each 32 x 32-bit product from a 64-bit product (what __umulhi computes).
__device__ __forceinline__ unsigned philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0,
                                                  unsigned k1, int lane) {
#pragma unroll
    for (int round = 0; round < PHILOX_ROUNDS; ++round) {
        if (round > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const unsigned long long p0 = (unsigned long long)PHILOX_M0 * c0;
        const unsigned long long p1 = (unsigned long long)PHILOX_M1 * c2;
        const unsigned n0 = (unsigned)(p1 >> 32) ^ c1 ^ k0;
        const unsigned n2 = (unsigned)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0;
        c1 = (unsigned)p1;
        c2 = n2;
        c3 = (unsigned)p0;
    }
    return lane == 0 ? c0 : lane == 1 ? c1 : lane == 2 ? c2 : c3;
}

template <typename T>
__device__ void dropout_impl(T* out, const T* inp, long long n, long long L, int groups, int group0, long long seq0,
                             long long seq_stride, unsigned key0, unsigned key1, const unsigned* step,
                             unsigned layer_site, unsigned threshold, float scale) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long per_row = L * groups;
    const long long b = i / per_row;
    const long long in_row = i - b * per_row;
    const long long g = in_row / L;
    const unsigned long long e = (unsigned long long)(group0 + g) * L + (in_row - g * L);
    const unsigned sequence = (unsigned)(seq0 + b * seq_stride);
    const unsigned bits = philox4x32_10((unsigned)(e >> 2), sequence, *step, layer_site, key0, key1, (int)(e & 3));
    out[i] = bits >= threshold ? from_float<T>(to_float(inp[i]) * scale) : from_float<T>(0.0f);
}

// activations and their gradients (floatX)
extern "C" __global__ void __launch_bounds__(DROPOUT_BLOCK)
dropout_act(floatX* out, const floatX* inp, long long n, long long L, int groups, int group0, long long seq0,
            long long seq_stride, unsigned key0, unsigned key1, const unsigned* step, unsigned layer_site,
            unsigned threshold, float scale) {
    dropout_impl<floatX>(out, inp, n, L, groups, group0, seq0, seq_stride, key0, key1, step, layer_site, threshold,
                         scale);
}

// float32 buffers in every precision: attention's probability gradient, which the softmax's backward reads
extern "C" __global__ void __launch_bounds__(DROPOUT_BLOCK)
dropout_f32(float* out, const float* inp, long long n, long long L, int groups, int group0, long long seq0,
            long long seq_stride, unsigned key0, unsigned key1, const unsigned* step, unsigned layer_site,
            unsigned threshold, float scale) {
    dropout_impl<float>(out, inp, n, L, groups, group0, seq0, seq_stride, key0, key1, step, layer_site, threshold,
                        scale);
}
