// attention.cu: the memory-bound parts of causal multi-head self-attention, forward and backward.
// Oracles: numpy_ops.attention_forward / attention_backward (the permutes), numpy_ops.causal_softmax,
// numpy_ops.causal_softmax_backward.
//
// The step, as CudaBackend.attention_forward (backend/cuda/ops.py) runs it:
//   split_heads:  qkv (B, T, 3, NH, hs) -> q, k, v (B, NH, T, hs)
//   cuBLAS:       scores = q @ k^T * (1/sqrt(hs))            batched over B*NH, (T, T) each, float32
//   causal_softmax_forward: att = softmax over keys j <= i, 0 above the diagonal (floatX; in place
//                 over the scores when floatX is float)
//   cuBLAS:       y = att @ v
//   merge_heads:  y (B, NH, T, hs) -> (B, T, C)
// and backward runs the mirror image (split dout, four products, softmax backward, merge into dqkv).
//
// The backend runs each product in chunks of query rows (_causal_chunks: 256 rows against the keys they may
// see), so of the T x T blocks the mask would zero only the diagonal chunks' upper halves are computed
// (at T = 1024, 10/16 of the full products). What is faster still is flash_attention.cu: the scores never
// reach memory and att is not stored but recomputed in backward. Here att is kept because the model's
// contract returns it; the softmax kernels read only keys j <= i, so the scores right of a chunk's
// diagonal block, which no product writes, are never used.
#include "common.cuh"

// ---------------------------------------------------------------------------------------- head layout

// The two layouts: token-major, row (b, t) of `ld` elements holding `parts` blocks of C = NH * hs
// channels (parts = 3 with ld = 3C for the fused q|k|v, parts = 1 with ld = C for a plain (B, T, C)),
// and head-major (B, NH, T, hs), one array per part. One thread per chunk of N elements of a
// head-major array (N = VEC_X when hs is a multiple of it and everything is aligned, else 1), doing
// all `parts` arrays, so a warp walks whole hs-long runs on both sides.
struct HeadIndex {
    long long token;  // element offset of this chunk in the token-major array, for part 0
    bool valid;
};

template <int N>
__device__ __forceinline__ HeadIndex head_index(int B, int NH, int T, int hs, int ld) {
    const long long i = chunk_start<N>();
    const long long total = (long long)B * NH * T * hs;
    if (i >= total) return {0, false};
    const int d = (int)(i % hs);
    long long rest = i / hs;
    const int t = (int)(rest % T);
    rest /= T;
    const int h = (int)(rest % NH);
    const long long b = rest / NH;
    return {(b * T + t) * ld + (long long)h * hs + d, true};
}

// head-major part s <- token-major part s   (the permute in attention_forward; its backward's dout split)
template <int N>
__device__ void split_heads_impl(floatX* out0, floatX* out1, floatX* out2, const floatX* in, int parts,
                                 int B, int NH, int T, int hs, int ld) {
    const HeadIndex ix = head_index<N>(B, NH, T, hs, ld);
    if (!ix.valid) return;
    const long long i = chunk_start<N>();
    const long long C = (long long)NH * hs;
    store_vec<N>(out0 + i, load_vec<N>(in + ix.token));
    if (parts > 1) store_vec<N>(out1 + i, load_vec<N>(in + ix.token + C));
    if (parts > 2) store_vec<N>(out2 + i, load_vec<N>(in + ix.token + 2 * C));
}

extern "C" __global__ void split_heads(floatX* out0, floatX* out1, floatX* out2, const floatX* in, int parts,
                                       int B, int NH, int T, int hs, int ld, int vec) {
    if (vec) split_heads_impl<VEC_X>(out0, out1, out2, in, parts, B, NH, T, hs, ld);
    else split_heads_impl<1>(out0, out1, out2, in, parts, B, NH, T, hs, ld);
}

// token-major part s <- head-major part s   (the unpermute of y; backward's stacking of dq, dk, dv)
template <int N>
__device__ void merge_heads_impl(floatX* out, const floatX* in0, const floatX* in1, const floatX* in2, int parts,
                                 int B, int NH, int T, int hs, int ld) {
    const HeadIndex ix = head_index<N>(B, NH, T, hs, ld);
    if (!ix.valid) return;
    const long long i = chunk_start<N>();
    const long long C = (long long)NH * hs;
    store_vec<N>(out + ix.token, load_vec<N>(in0 + i));
    if (parts > 1) store_vec<N>(out + ix.token + C, load_vec<N>(in1 + i));
    if (parts > 2) store_vec<N>(out + ix.token + 2 * C, load_vec<N>(in2 + i));
}

extern "C" __global__ void merge_heads(floatX* out, const floatX* in0, const floatX* in1, const floatX* in2,
                                       int parts, int B, int NH, int T, int hs, int ld, int vec) {
    if (vec) merge_heads_impl<VEC_X>(out, in0, in1, in2, parts, B, NH, T, hs, ld);
    else merge_heads_impl<1>(out, in0, in1, in2, parts, B, NH, T, hs, ld);
}

// ---------------------------------------------------------------------------------------- softmax

// The softmax kernels' blocks: 256 threads, a warp per row, so 8 rows a block. The host reads both from
// here: SOFTMAX_BLOCK threads a block, and a grid of rows / SOFTMAX_ROWS_PER_BLOCK blocks rounded up.
constexpr int SOFTMAX_BLOCK = 256;
constexpr int SOFTMAX_ROWS_PER_BLOCK = SOFTMAX_BLOCK / WARP_SIZE;

// att[r, j] = exp(s[r, j] - max) / sum_{j' <= i} exp(s[r, j'] - max) for j <= i, and 0 for j > i,
// where row r of the (rows, T) scores is query i = r % T   (numpy_ops.causal_softmax).
// The scores are float in both precisions: the product q k^T writes them in float32 (cuBLAS with a
// float output), so exp() sees unrounded scores; a bf16 score of magnitude 8 would already be off by
// up to 0.03, i.e. 3% in its probability. Only att, which backward keeps, is floatX.
// One warp per row, SOFTMAX_ROWS_PER_BLOCK rows a block (rows are at most a few KB). Pass 1 folds the
// row's unmasked entries into a running (max, sum) per lane and merges the lanes; pass 2 writes the
// whole row, zeros included, so att is complete without a separate memset. May run in place when
// floatX is float (att == scores): each lane reads a chunk before writing it, and pass 1 ends in a
// warp-wide shuffle.
template <int N>
__device__ void causal_softmax_row(floatX* att, const float* scores, int T, long long row) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n_valid = (int)(row % T) + 1;
    const float* s = scores + row * T;
    floatX* a = att + row * T;

    SoftmaxState st = softmax_init();
    for (int j0 = lane * N; j0 < n_valid; j0 += WARP_SIZE * N) {
        const Vec<float, N> v = load_vec<N>(s + j0);
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (j0 + k < n_valid) softmax_add(st, v[k]);
    }
    st = warp_softmax_merge(st);

    for (int j0 = lane * N; j0 < T; j0 += WARP_SIZE * N) {
        Vec<floatX, N> out;
        if (j0 < n_valid) {
            const Vec<float, N> v = load_vec<N>(s + j0);
#pragma unroll
            for (int k = 0; k < N; ++k)
                out[k] = from_float<floatX>(j0 + k < n_valid ? expf(v[k] - st.max) / st.sum : 0.0f);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) out[k] = from_float<floatX>(0.0f);
        }
        store_vec<N>(a + j0, out);
    }
}

extern "C" __global__ void causal_softmax_forward(floatX* att, const float* scores, long long rows, int T,
                                                  int vec) {
    const long long row = (long long)blockIdx.x * SOFTMAX_ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= rows) return;  // whole warps leave together
    if (vec) causal_softmax_row<VEC_X>(att, scores, T, row);
    else causal_softmax_row<1>(att, scores, T, row);
}

// dscores[r, j] = att[r, j] * (datt[r, j] - sum_j' datt[r, j'] * att[r, j']) * scale
// (numpy_ops.causal_softmax_backward, times the 1/sqrt(hs) that attention_backward applies before
// rounding; scale = 1 for the plain op). datt is float like the forward scores (the product dy v^T
// writes it in float32); dscores is floatX because the two products after it read it as an operand.
// Only j <= i can be non-zero because att is zero above the diagonal, so both passes stop there and
// the rest of the row is written as 0. Same warp-per-row layout as forward; may run in place when
// floatX is float (dscores == datt).
template <int N>
__device__ void causal_softmax_backward_row(floatX* dscores, const float* datt, const floatX* att, int T,
                                            float scale, long long row) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n_valid = (int)(row % T) + 1;
    const float* da = datt + row * T;
    const floatX* a = att + row * T;
    floatX* ds = dscores + row * T;

    float dot = 0.0f;
    for (int j0 = lane * N; j0 < n_valid; j0 += WARP_SIZE * N) {
        const Vec<float, N> dv = load_vec<N>(da + j0);
        const Vec<floatX, N> av = load_vec<N>(a + j0);
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (j0 + k < n_valid) dot += dv[k] * to_float(av[k]);
    }
    dot = warp_sum(dot);

    for (int j0 = lane * N; j0 < T; j0 += WARP_SIZE * N) {
        Vec<floatX, N> out;
        if (j0 < n_valid) {
            const Vec<float, N> dv = load_vec<N>(da + j0);
            const Vec<floatX, N> av = load_vec<N>(a + j0);
#pragma unroll
            for (int k = 0; k < N; ++k)
                out[k] = from_float<floatX>(j0 + k < n_valid ? to_float(av[k]) * (dv[k] - dot) * scale : 0.0f);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) out[k] = from_float<floatX>(0.0f);
        }
        store_vec<N>(ds + j0, out);
    }
}

extern "C" __global__ void causal_softmax_backward(floatX* dscores, const float* datt, const floatX* att,
                                                   long long rows, int T, float scale, int vec) {
    const long long row = (long long)blockIdx.x * SOFTMAX_ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (row >= rows) return;
    if (vec) causal_softmax_backward_row<VEC_X>(dscores, datt, att, T, scale, row);
    else causal_softmax_backward_row<1>(dscores, datt, att, T, scale, row);
}
