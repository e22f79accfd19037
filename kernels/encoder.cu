// encoder.cu: token + position embedding, forward and backward.
// Oracles: numpy_ops.encoder_forward, numpy_ops.encoder_backward.
#include "common.cuh"

// ---------------------------------------------------------------------------------------- forward

// out[b, t, :] = wte[ids[b, t] - row0, :] + wpe[t, :]   (numpy_ops.encoder_forward, vocab_encoder_forward)
// One thread per chunk of N channels of one (b, t) row; consecutive threads take consecutive chunks,
// so a warp reads whole 512-byte stretches of a wte row and a wpe row. N = VEC_X when C is a multiple
// of it and the pointers are 16-byte aligned (`vec`), else 1. wte holds rows row0 .. row0 + V - 1 of the
// embedding (row0 0: all of it); a token whose row is not among them gets a row of `outside`: NaN for
// the whole embedding (a bad batch is visible in the loss, and nothing is read out of bounds), 0 for a
// vocabulary-parallel shard (another rank of the group holds that row).
template <int N>
__device__ void encoder_forward_impl(floatX* out, const int* ids, const floatX* wte, const floatX* wpe,
                                     long long BT, int T, int C, int V, int row0, float outside) {
    const long long i = chunk_start<N>();
    if (i >= BT * C) return;
    const long long bt = i / C;
    const int c = (int)(i % C);
    const int t = (int)(bt % T);
    const long long id = (long long)ids[bt] - row0;  // 64-bit: no wrap for any int id and row0
    Vec<floatX, N> o;
    if (id < 0 || id >= V) {
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = from_float<floatX>(outside);
    } else {
        const Vec<floatX, N> tok = load_vec<N>(wte + id * C + c);
        const Vec<floatX, N> pos = load_vec<N>(wpe + (long long)t * C + c);
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = from_float<floatX>(to_float(tok[k]) + to_float(pos[k]));
    }
    store_vec<N>(out + i, o);
}

extern "C" __global__ void encoder_forward(floatX* out, const int* ids, const floatX* wte, const floatX* wpe,
                                           long long BT, int T, int C, int V, int vec) {
    if (vec) encoder_forward_impl<VEC_X>(out, ids, wte, wpe, BT, T, C, V, 0, quiet_nan());
    else encoder_forward_impl<1>(out, ids, wte, wpe, BT, T, C, V, 0, quiet_nan());
}

// The same on a vocabulary-parallel shard of wte, its R rows starting at row0: the token's embedding where
// the shard holds its row, 0 elsewhere (numpy_ops.vocab_encoder_forward). One rank of the group holds each
// token, so the group's all-reduce adds zeros to encoder_forward's value, which keeps its bits.
extern "C" __global__ void vocab_encoder_forward(floatX* out, const int* ids, const floatX* wte,
                                                 const floatX* wpe, long long BT, int T, int C, int R, int row0,
                                                 int vec) {
    if (vec) encoder_forward_impl<VEC_X>(out, ids, wte, wpe, BT, T, C, R, row0, 0.0f);
    else encoder_forward_impl<1>(out, ids, wte, wpe, BT, T, C, R, row0, 0.0f);
}

// ---------------------------------------------------------------------------------------- backward

// dwpe[t, c] += sum_b dout[b, t, c]   (the wpe half of numpy_ops.encoder_backward)
// One thread per chunk of N channels of one position t, looping over b in order. numpy computes
// dout.sum(axis=0) by adding the b rows one after another and then adds that to dwpe; the same two
// steps here give the same bits. No two threads touch the same element, so no atomics are needed.
template <int N>
__device__ void encoder_backward_wpe_impl(float* dwpe, const floatX* dout, int B, int T, int C) {
    const long long i = chunk_start<N>();  // index into (T, C)
    if (i >= (long long)T * C) return;
    const long long stride = (long long)T * C;  // from (b, t, c) to (b + 1, t, c)
    float acc[N];
    const Vec<floatX, N> first = load_vec<N>(dout + i);
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = to_float(first[k]);
    for (int b = 1; b < B; ++b) {
        const Vec<floatX, N> d = load_vec<N>(dout + b * stride + i);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += to_float(d[k]);
    }
    Vec<float, N> w = load_vec<N>(dwpe + i);
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] += acc[k];
    store_vec<N>(dwpe + i, w);
}

extern "C" __global__ void encoder_backward_wpe(float* dwpe, const floatX* dout, int B, int T, int C, int vec) {
    if (vec) encoder_backward_wpe_impl<VEC_X>(dwpe, dout, B, T, C);
    else encoder_backward_wpe_impl<1>(dwpe, dout, B, T, C);
}

// dwte[ids[p], c] += dout[p, c] for every position p = b*T + t   (the wte half of encoder_backward)
// A token can occur many times in a batch, so a thread per position would race on its wte row. The
// host first sorts the positions by token id with a stable sort (`order`, so positions of one token
// stay in (b, t) order). Block x then looks at sorted slot x: if the slot before it holds the same
// token it returns at once; otherwise it owns that token's run and its threads (one per chunk of N
// channels, blockIdx.y for the channels past one block) add the run's dout rows into dwte in order,
// starting from dwte's old value. That is np.add.at's order (one row at a time into dwte), so the
// result matches numpy bit for bit, and no two blocks write the same row.
// A vocabulary-parallel shard (vocab_encoder_backward) launches this kernel on ids - row0 with V = R, its
// rows: the tokens of other shards fall outside [0, R) and add nothing, the rest add in the same order.
// Most blocks exit after two loads; the work is one read of dout and one read-modify-write of the
// touched wte rows. A very frequent token makes its one block long, which is acceptable at the few
// thousand positions of a micro-batch; splitting long runs into fixed segments would balance it.
template <int N>
__device__ void encoder_backward_wte_impl(float* dwte, const floatX* dout, const int* ids,
                                          const long long* order, long long BT, int C, int V) {
    const long long slot = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * N;
    const int id = ids[order[slot]];
    if (slot > 0 && ids[order[slot - 1]] == id) return;  // not the first of its run
    if (id < 0 || id >= V || c >= C) return;
    float* row = dwte + (long long)id * C + c;
    Vec<float, N> acc = load_vec<N>(row);
    for (long long s = slot; s < BT; ++s) {
        const long long p = order[s];
        if (ids[p] != id) break;
        const Vec<floatX, N> d = load_vec<N>(dout + p * C + c);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += to_float(d[k]);
    }
    store_vec<N>(row, acc);
}

extern "C" __global__ void encoder_backward_wte(float* dwte, const floatX* dout, const int* ids,
                                                const long long* order, long long BT, int C, int V, int vec) {
    if (vec) encoder_backward_wte_impl<VEC_X>(dwte, dout, ids, order, BT, C, V);
    else encoder_backward_wte_impl<1>(dwte, dout, ids, order, BT, C, V);
}
