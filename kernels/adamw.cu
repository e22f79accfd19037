// adamw.cu: one AdamW step over flat fp32 buffers, in place, the floatX copy of the parameters that
// forward reads, and floatX widened back to float32.   Oracles: numpy_ops.adamw_update, numpy_ops.lowp_copy, numpy_ops.widen_copy.
//
//   g = grad * grad_scale[0]                (grad_scale: the clip coefficient, read on the device)
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr * (m / bc1 / (sqrt(v / bc2) + eps) + weight_decay * mask * p)
// with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step computed on the host in float64 and rounded to
// float32, as numpy does. lr, bc1 and bc2 come either as arguments or, when `schedule` is not null, from
// device memory (schedule = [lr, bc1, bc2], numpy_ops.adamw_schedule): a captured step (CUDA graph) keeps
// its launch arguments from the capture, so the values that change every step are read where the host
// can rewrite them before each replay. The same float32 values either way, so the same bits. Each float operation is written with an explicit round-to-nearest
// intrinsic (__fmul_rn, __fadd_rn, ...) so that the compiler cannot contract a multiply and an add
// into one FMA: every step follows numpy's float32 sequence of operations, and agrees with it bit for
// bit except where a value is subnormal (CuPy compiles with -ftz=true, which flushes those to zero;
// numpy keeps them), which is why the test allows 1e-6. It costs nothing measurable: the kernel moves
// 4 x 4 bytes in and 3 x 4 bytes out per parameter and is bound by memory.
//
// One thread per chunk of N = 4 parameters (16-byte loads of p, g, m, v and a 4-byte load of the
// uint8 decay mask) when every pointer is aligned, else 1; a short last chunk one at a time. ZeRO
// shards start at arbitrary offsets, so the host checks alignment per call.
//
// Mixed precision: params_lowp (nullable) receives the updated parameters as floatX, rounded to
// nearest even: the copy forward reads (model.params_lowp), written from the registers that already
// hold p, so it costs 2 bytes of writes per parameter and no second read of params.
#include "common.cuh"

// The step's scalars, filled by the kernel entry from its arguments.
struct AdamWArgs {
    float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, eps, weight_decay;
};

__device__ __forceinline__ void adamw_one(float& p, float grad, float& m, float& v, unsigned char mask,
                                          float grad_scale, const AdamWArgs& a) {
    const float g = __fmul_rn(grad, grad_scale);
    m = __fadd_rn(__fmul_rn(m, a.beta1), __fmul_rn(a.one_minus_beta1, g));
    v = __fadd_rn(__fmul_rn(v, a.beta2), __fmul_rn(a.one_minus_beta2, __fmul_rn(g, g)));
    const float m_hat = __fdiv_rn(m, a.bc1);
    const float v_hat = __fdiv_rn(v, a.bc2);
    float update = __fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), a.eps));
    // numpy: update += (weight_decay * decay_mask) * params
    update = __fadd_rn(update, __fmul_rn(__fmul_rn(a.weight_decay, (float)mask), p));
    p = __fsub_rn(p, __fmul_rn(a.lr, update));
}

template <int N>
__device__ void adamw_impl(float* params, floatX* params_lowp, const float* grads, float* m, float* v,
                           const unsigned char* mask, long long n, const float* grad_scale, const AdamWArgs& a) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    const float gs = *grad_scale;
    if (i + N <= n) {
        Vec<float, N> p = load_vec<N>(params + i);
        const Vec<float, N> g = load_vec<N>(grads + i);
        Vec<float, N> mv = load_vec<N>(m + i);
        Vec<float, N> vv = load_vec<N>(v + i);
        const Vec<unsigned char, N> mk = load_vec<N>(mask + i);
#pragma unroll
        for (int k = 0; k < N; ++k) adamw_one(p[k], g[k], mv[k], vv[k], mk[k], gs, a);
        store_vec<N>(params + i, p);
        store_vec<N>(m + i, mv);
        store_vec<N>(v + i, vv);
        if (params_lowp != nullptr) {
            Vec<floatX, N> low;
#pragma unroll
            for (int k = 0; k < N; ++k) low[k] = from_float<floatX>(p[k]);
            store_vec<N>(params_lowp + i, low);
        }
    } else {
        for (long long j = i; j < n; ++j) {
            adamw_one(params[j], grads[j], m[j], v[j], mask[j], gs, a);
            if (params_lowp != nullptr) params_lowp[j] = from_float<floatX>(params[j]);
        }
    }
}

extern "C" __global__ void adamw_update(float* params, floatX* params_lowp, const float* grads, float* m, float* v,
                                        const unsigned char* mask, long long n, const float* grad_scale,
                                        const float* schedule, float lr, float beta1, float beta2, float one_minus_beta1,
                                        float one_minus_beta2, float bc1, float bc2, float eps,
                                        float weight_decay, int vec) {
    if (schedule != nullptr) {
        lr = schedule[0];
        bc1 = schedule[1];
        bc2 = schedule[2];
    }
    const AdamWArgs args = {lr, beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, eps, weight_decay};
    if (vec) adamw_impl<VEC_F>(params, params_lowp, grads, m, v, mask, n, grad_scale, args);
    else adamw_impl<1>(params, params_lowp, grads, m, v, mask, n, grad_scale, args);
}

// dst = src as floatX, rounded to nearest even   (numpy_ops.lowp_copy)
// The copy of the parameters that forward reads, rewritten from the float32 masters where they
// changed without an AdamW step: after a checkpoint load and after ZeRO-1's all-gather. One thread
// per chunk of N = 4 elements when both pointers are aligned, else 1.
template <int N>
__device__ void lowp_copy_impl(floatX* dst, const float* src, long long n) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        const Vec<float, N> x = load_vec<N>(src + i);
        Vec<floatX, N> y;
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = from_float<floatX>(x[k]);
        store_vec<N>(dst + i, y);
    } else {
        for (long long j = i; j < n; ++j) dst[j] = from_float<floatX>(src[j]);
    }
}

extern "C" __global__ void lowp_copy(floatX* dst, const float* src, long long n, int vec) {
    if (vec) lowp_copy_impl<VEC_F>(dst, src, n);
    else lowp_copy_impl<1>(dst, src, n);
}

// dst = src as float32, exactly   (numpy_ops.widen_copy)
// lowp_copy's way back: a tensor-parallel group sums the partial outputs of its row-parallel products in
// float32 (model.py), whatever the activation dtype, and lowp_copy rounds the sum once. One thread per
// chunk of N = 4 elements when both pointers are aligned, else 1.
template <int N>
__device__ void widen_copy_impl(float* dst, const floatX* src, long long n) {
    const long long i = chunk_start<N>();
    if (i >= n) return;
    if (i + N <= n) {
        const Vec<floatX, N> x = load_vec<N>(src + i);
        Vec<float, N> y;
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = to_float(x[k]);
        store_vec<N>(dst + i, y);
    } else {
        for (long long j = i; j < n; ++j) dst[j] = to_float(src[j]);
    }
}

extern "C" __global__ void widen_copy(float* dst, const floatX* src, long long n, int vec) {
    if (vec) widen_copy_impl<VEC_F>(dst, src, n);
    else widen_copy_impl<1>(dst, src, n);
}
