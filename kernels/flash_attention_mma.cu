// flash_attention_mma.cu: fused causal self-attention as FlashAttention-2 computes it, forward and
// backward, bf16 with 64-channel heads, on tensor cores through mma.sync m16n8k16 (kernels/ptx.cuh).
// The same function, rounded at the same places, as flash_attention.cu (the WMMA kernels, kept as the
// baseline bin/bench_attention races), so the same oracle: numpy_ops.flash_attention_forward /
// _backward, whose online softmax takes the keys FLASH_TILE = 64 at a time as these kernels do. This
// describes the default tiles; the variants (the XTRAIN_MMA_* knobs below) change the numbers, not the
// scheme, and the oracle takes a variant's key tile as its own.
//
// What makes it faster than flash_attention.cu: scores, probabilities and outputs never leave registers
// (an accumulator fragment, rounded and packed in pairs, is the next product's A fragment: ptx.cuh);
// operands reach the tensor cores through ldmatrix; K and V tiles stream into shared memory with
// cp.async, the next tile's copy in flight while the current one is used (two buffers); a block takes
// 128 queries (8 warps of 16 rows), so each K and V tile loaded serves twice as many rows.
//
// Forward (grid: query blocks of 128, heads, batch; heavy blocks first). Q's 16 rows of each warp are
// loaded once into A fragments. For each key tile of 64 at or left of the diagonal: S = Q K^T
// (16 x 64 per warp: 8 accumulators of 16 x 8), scaled and masked; the running row max m and sum l
// (online softmax, in base 2: exp2 of scores times log2(e) / sqrt(64), one multiply-add and one
// MUFU.EX2 per score); O rescaled by exp2(m_old - m_new); P = exp2(S - m) rounded to bf16 (the sum l
// adds the rounded values, so that l normalises what O holds, as the oracle does); O += P V. At the end
// out = O / l and lse = (m + log2 l) ln 2 (natural log, what the oracle and backward read). A warp skips
// the key tiles wholly right of its rows (the block's last tile for warps 0-3).
//
// Backward, deterministic (no float atomics, so the same bits every run and on every rank): three
// kernels. D = rowsum(dout * out) per query row (flash_mma_backward_dot). Then flash_mma_backward_dkdv:
// a block owns 128 keys (8 warps of 16) and walks the query tiles of 64 at or below them, recomputing
// S^T = K Q^T and P^T = exp(S^T - lse), dP^T = V dout^T, dS^T = P^T (dP^T - D) / 8, and accumulating
// dV += P^T dout and dK += dS^T Q in registers. dQ = dS K needs, for each query, a sum over every key
// block: FlashAttention-2 adds each block's share into dQ with float atomics, whose order changes run to
// run. Here flash_mma_backward_dq owns 128 queries and walks the key tiles left of them instead,
// recomputing S and dP to form dS and accumulating dQ += dS K in registers: the price of determinism is
// the two recomputed products, 7 tile products where FlashAttention-2 does 5 (40% more tensor-core work
// in backward), and a second pass over K and V. P and dS are rounded to bf16 where they enter a
// product, as the oracle rounds them.
//
// Shared memory: bf16 tiles of 64 channels in rows of 72 (144 bytes), so that the 8 rows an ldmatrix
// reads at once start on 8 different 16-byte bank groups (a 128-byte stride puts them all on one; heads
// of 128 take rows of 136). The rows a block keeps in registers (Q, or Q and dout, or K and V) have bytes
// of their own beside the buffers of the tiles it streams: 54 KB forward, 72 KB backward, dynamic shared
// memory past the 48 KB a launch takes without opting in (backend/cuda/flash_variants.py opts in).
//
// The float32 build and GPUs before sm_80 have no bf16 mma.sync: the entry points trap there, and the
// backend refuses --attention flash without --dtype bf16 before anything runs.
#include "common.cuh"

// The variant knobs, compile-time (NVRTC -D options; xtrain_dist/backend/cuda/flash_variants.py lists the
// valid combinations, compiles each as a file of its own and picks one per shape from the GPU's tuning
// table). The defaults are the tiles described above. A block has XTRAIN_MMA_WARPS warps of 16 rows each;
// XTRAIN_MMA_TILE rows stream per step (keys in forward and dq, queries in dkdv); XTRAIN_MMA_STAGES tiles
// are in shared memory at once (the one in use, and the copies of the next STAGES - 1 in flight);
// XTRAIN_MMA_HS is the head size.
#ifndef XTRAIN_MMA_WARPS
#define XTRAIN_MMA_WARPS 8
#endif
#ifndef XTRAIN_MMA_TILE
#define XTRAIN_MMA_TILE 64
#endif
#ifndef XTRAIN_MMA_STAGES
#define XTRAIN_MMA_STAGES 2
#endif
#ifndef XTRAIN_MMA_HS
#define XTRAIN_MMA_HS 64
#endif

// The block every kernel of this file is written for (also in the float32 build, whose entry points trap).
constexpr int MMA_WARPS = XTRAIN_MMA_WARPS;
constexpr int MMA_THREADS = MMA_WARPS * WARP_SIZE;

// bf16 mma.sync, ldmatrix and cp.async exist from sm_80 on
#if defined(XTRAIN_BF16) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#include "ptx.cuh"

// The geometry the host launches with: MMA_BLOCK_ROWS queries (forward, dq) or keys (dkdv) a block,
// MMA_DOT_ROWS rows a block for the dot kernel; MMA_HS is the head size it checks; MMA_FORWARD_SHARED and
// MMA_BACKWARD_SHARED the bytes of dynamic shared memory the launches give (over 48 KB: opted into).
constexpr int MMA_HS = XTRAIN_MMA_HS;
constexpr int MMA_TILE = XTRAIN_MMA_TILE;
constexpr int MMA_STAGES = XTRAIN_MMA_STAGES;
constexpr int MMA_BLOCK_ROWS = MMA_WARPS * 16;  // 16 rows a warp
constexpr int MMA_DOT_ROWS = MMA_THREADS / 8;   // 8 lanes a row, 8 channels a lane
constexpr int MMA_LD = MMA_HS + 8;              // shared-memory row stride, bf16 elements (see above)
// forward: Q (a block's rows), then STAGES buffers of a K and a V tile; backward: the block's two tensors
// kept in registers (K and V, or Q and dout), then STAGES buffers of two streamed tiles
constexpr int MMA_FORWARD_SHARED = 2 * MMA_LD * (MMA_BLOCK_ROWS + 2 * MMA_STAGES * MMA_TILE);
constexpr int MMA_BACKWARD_SHARED = 2 * MMA_LD * (2 * MMA_BLOCK_ROWS + 2 * MMA_STAGES * MMA_TILE);
static_assert(MMA_FORWARD_SHARED <= 227 * 1024 && MMA_BACKWARD_SHARED <= 227 * 1024,
              "more shared memory than a Hopper block may have");
static_assert(MMA_HS % 16 == 0 && MMA_TILE % 16 == 0 && MMA_STAGES >= 2, "tiles of whole 16 x 16 fragments");

// A kernel's shared memory: dynamic on a GPU (more than the 48 KB a static array may have, given at launch);
// the simulator's shared memory is static and has no such limit.
#if defined(XTRAIN_CUDASIM)
#define MMA_SHARED_MEMORY(name, bytes) __shared__ __align__(128) __nv_bfloat16 name[(bytes) / 2]
#else
#define MMA_SHARED_MEMORY(name, bytes) extern __shared__ __align__(128) __nv_bfloat16 name[]
#endif

namespace flash_mma {
typedef __nv_bfloat16 bf16;

constexpr int KS = MMA_HS / 16;     // k-steps of 16 channels (A fragments of a row block of Q, K, V or dout)
constexpr int CN = MMA_HS / 8;      // n-tiles of 8 channels (accumulators of O, dQ, dK, dV)
constexpr int TN = MMA_TILE / 8;    // n-tiles of 8 tile rows (accumulators of S, dP)
constexpr int TK = MMA_TILE / 16;   // k-steps of 16 tile rows (P, dS as A fragments)

// 1 / sqrt(head size): exact for 64, float32's nearest for 128 (the oracle's float32 scale)
constexpr float SCALE = MMA_HS == 64 ? 0.125f : MMA_HS == 128 ? 0.08838834764831845f : 0.0f;
static_assert(SCALE > 0.0f, "head sizes 64 and 128");
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float SCALE_LOG2E = SCALE * LOG2E;       // scores to base-2 exponents

// Rows [row0, row0 + ROWS) of one head's channels of a token-major tensor (row t at src + t * ld) into a
// tile with rows of MMA_LD, by cp.async in the caller's current group; rows at or past T are zeros.
template <int ROWS>
__device__ __forceinline__ void load_tile_async(bf16* tile, const bf16* src, long long ld, int row0, int T) {
#pragma unroll
    for (int v = threadIdx.x; v < ROWS * MMA_HS / 8; v += MMA_THREADS) {
        const int row = v / (MMA_HS / 8), col = (v % (MMA_HS / 8)) * 8;
        const bool valid = row0 + row < T;
        cp_async_16(tile + row * MMA_LD + col, src + (valid ? (long long)(row0 + row) * ld : 0) + col, valid);
    }
}

// A fragments (KS k-steps of 16 channels) of the 16 rows of a tile starting at `rows`: ldmatrix's four
// matrices are the (rows 0-7, 8-15) x (channels 0-7, 8-15) quarters, rows first (ptx.cuh).
__device__ __forceinline__ void load_a(unsigned (&a)[KS][4], const bf16* rows, int lane) {
    const int mi = lane / 8, row = lane % 8 + 8 * (mi % 2), col = 8 * (mi / 2);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) ldmatrix_x4(a[kk], rows + row * MMA_LD + kk * 16 + col);
}

// acc (16 x TILE: TN accumulators of 16 x 8) = A (16 x HS channels, fragments) times the transpose of a
// TILE-row tile: acc[j] column n = A row . tile row 8j + n. The tile's rows are the product's columns (K
// for Q K^T), read by plain ldmatrix: matrices (rows 0-7, ch 0-7), (rows 0-7, ch 8-15), (rows 8-15, ch
// 0-7), (rows 8-15, ch 8-15) of each 16 x 16 block are b[0], b[1] of n-tile 2p and of n-tile 2p + 1.
__device__ __forceinline__ void product_a_tile_t(float (&acc)[TN][4], const unsigned (&a)[KS][4], const bf16* tile,
                                                 int lane) {
    const int mi = lane / 8, row = lane % 8 + 8 * (mi / 2), col = 8 * (mi % 2);
#pragma unroll
    for (int j = 0; j < TN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
    for (int p = 0; p < TK; ++p) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            unsigned b[4];
            ldmatrix_x4(b, tile + (16 * p + row) * MMA_LD + kk * 16 + col);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_bf16_16816(acc[2 * p], a[kk], b0, acc[2 * p]);
            mma_bf16_16816(acc[2 * p + 1], a[kk], b1, acc[2 * p + 1]);
        }
    }
}

// acc (16 x HS channels) += P (16 x TILE rows of the tile, as A fragments: p[kk] covers tile rows
// 16kk..16kk+15) times a TILE-row tile (V for P V, dout and Q in backward). The tile is k by n, read by
// ldmatrix.trans: matrices (rows 0-7, ch 0-7), (rows 8-15, ch 0-7), (rows 0-7, ch 8-15), (rows 8-15,
// ch 8-15) of each 16 x 16 block are b[0], b[1] of channel n-tile 2q and of 2q + 1.
__device__ __forceinline__ void product_p_tile(float (&acc)[CN][4], const unsigned (&p)[TK][4], const bf16* tile,
                                               int lane) {
    const int mi = lane / 8, row = lane % 8 + 8 * (mi % 2), col = 8 * (mi / 2);
#pragma unroll
    for (int kk = 0; kk < TK; ++kk) {
#pragma unroll
        for (int q = 0; q < KS; ++q) {
            unsigned b[4];
            ldmatrix_x4_trans(b, tile + (16 * kk + row) * MMA_LD + 16 * q + col);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_bf16_16816(acc[2 * q], p[kk], b0, acc[2 * q]);
            mma_bf16_16816(acc[2 * q + 1], p[kk], b1, acc[2 * q + 1]);
        }
    }
}

// The A fragments of a 16 x TILE float accumulator, rounded to bf16: k-step kk is n-tiles 2kk and 2kk + 1.
__device__ __forceinline__ void to_a(unsigned (&a)[TK][4], const float (&acc)[TN][4]) {
#pragma unroll
    for (int kk = 0; kk < TK; ++kk) {
        a[kk][0] = pack_bf16(acc[2 * kk][0], acc[2 * kk][1]);
        a[kk][1] = pack_bf16(acc[2 * kk][2], acc[2 * kk][3]);
        a[kk][2] = pack_bf16(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
        a[kk][3] = pack_bf16(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
    }
}

// Rows g and g + 8 of a warp's 16 x HS accumulator (lane l holds columns 8j + 2t, 8j + 2t + 1 of both),
// scaled by inv[0] and inv[1] and rounded, into dst0 and dst1 (a row's HS channels), when the row exists.
__device__ __forceinline__ void store_rows(bf16* dst0, bf16* dst1, const float (&acc)[CN][4], const float (&inv)[2],
                                           bool valid0, bool valid1, int t) {
#pragma unroll
    for (int j = 0; j < CN; ++j) {
        const int c = 8 * j + 2 * t;
        if (valid0) *reinterpret_cast<unsigned*>(dst0 + c) = pack_bf16(acc[j][0] * inv[0], acc[j][1] * inv[0]);
        if (valid1) *reinterpret_cast<unsigned*>(dst1 + c) = pack_bf16(acc[j][2] * inv[1], acc[j][3] * inv[1]);
    }
}

// The sum (or max) of a row's values over the 4 lanes of a group, which hold its columns between them.
__device__ __forceinline__ float group_sum(float x) {
    x += __shfl_xor_sync(FULL_MASK, x, 1);
    return x + __shfl_xor_sync(FULL_MASK, x, 2);
}
__device__ __forceinline__ float group_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 2));
}

// Heavy blocks first: the query block with the most key tiles to its left starts first.
__device__ __forceinline__ int block_from_the_end() { return gridDim.x - 1 - blockIdx.x; }

template <typename T>
__device__ __forceinline__ void zero(T (&acc)[CN][4]) {
#pragma unroll
    for (int j = 0; j < CN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
}

// The pipeline over a block's streamed tiles, STAGES buffers deep: tiles 0 .. STAGES - 2 are requested
// first; step i (tile i in buffer s = i % STAGES) requests tile i + STAGES - 1 into the buffer step i - 1
// used, which the barrier ending that step freed, then waits for tile i's group and makes it visible.
// Each step commits one group, empty past the last tile, so that "all but the newest STAGES - 1 groups"
// is always tile i's. Buffers are counted round, not taken modulo 3 (which costs ptxas registers).
template <typename Load>
__device__ __forceinline__ void pipeline_start(Load load, int n_tiles) {
#pragma unroll
    for (int i = 0; i < MMA_STAGES - 1; ++i) {
        if (i < n_tiles) load(i, i);
        cp_async_commit();
    }
}
template <typename Load>
__device__ __forceinline__ void pipeline_step(Load load, int i, int s, int n_tiles) {
    if (i + MMA_STAGES - 1 < n_tiles) load(i + MMA_STAGES - 1, s == 0 ? MMA_STAGES - 1 : s - 1);
    cp_async_commit();
    cp_async_wait<MMA_STAGES - 1>();
    __syncthreads();  // tile i is in, every thread's part of it
}
__device__ __forceinline__ int next_buffer(int s) { return s + 1 == MMA_STAGES ? 0 : s + 1; }

// --------------------------------------------------------------------------------------- forward

__device__ void forward(bf16* out, float* lse, const bf16* qkv, int T, int NH) {
    MMA_SHARED_MEMORY(smem, MMA_FORWARD_SHARED);  // Q (a block's rows), then STAGES buffers of a K and a V tile
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int h = blockIdx.y, b = blockIdx.z, C = NH * MMA_HS;
    const long long ld = 3LL * C;
    const bf16* base = qkv + (long long)b * T * ld + (long long)h * MMA_HS;  // q of row 0, head h
    const int q0 = block_from_the_end() * MMA_BLOCK_ROWS;
    const int w0 = q0 + 16 * warp;  // the warp's first query; the lane's are w0 + g and w0 + g + 8
    bf16* tiles = smem + MMA_BLOCK_ROWS * MMA_LD;
    auto k_tile = [&](int s) { return tiles + (2 * s) * MMA_TILE * MMA_LD; };
    auto v_tile = [&](int s) { return tiles + (2 * s + 1) * MMA_TILE * MMA_LD; };

    load_tile_async<MMA_BLOCK_ROWS>(smem, base, ld, q0, T);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned q[KS][4];
    load_a(q, smem + 16 * warp * MMA_LD, lane);

    const int n_tiles = (min(q0 + MMA_BLOCK_ROWS, T) - 1) / MMA_TILE + 1;  // key tiles left of the last query
    float o[CN][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sum
    zero(o);

    auto load_kv = [&](int kt, int s) {
        load_tile_async<MMA_TILE>(k_tile(s), base + C, ld, kt * MMA_TILE, T);
        load_tile_async<MMA_TILE>(v_tile(s), base + 2 * C, ld, kt * MMA_TILE, T);
    };
    pipeline_start(load_kv, n_tiles);
    for (int kt = 0, s = 0; kt < n_tiles; ++kt, s = next_buffer(s)) {
        const int k0 = kt * MMA_TILE;
        pipeline_step(load_kv, kt, s, n_tiles);  // the next tiles' copies fly while this one is used

        if (k0 <= w0 + 15) {  // else every key of the tile is right of the warp's rows
            float sc[TN][4];
            product_a_tile_t(sc, q, k_tile(s), lane);  // S = Q K^T
            const bool diagonal = k0 + MMA_TILE - 1 > w0;
            float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (int j = 0; j < TN; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * j + 2 * t + e % 2, query = w0 + g + 8 * (e / 2);
                    sc[j][e] = diagonal && key > query ? neg_inf() : sc[j][e] * SCALE_LOG2E;
                    tile_max[e / 2] = fmaxf(tile_max[e / 2], sc[j][e]);
                }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // key 0 is in every row's first tile, so m is finite from then on: no -inf - -inf
                const float m_new = fmaxf(m[r], group_max(tile_max[r]));
                alpha[r] = exp2f(m[r] - m_new);
                m[r] = m_new;
                l[r] *= alpha[r];
            }
#pragma unroll
            for (int j = 0; j < CN; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[j][e] *= alpha[e / 2];
#pragma unroll
            for (int j = 0; j < TN; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // rounded as it enters P V, and summed as rounded
                    const float p = __bfloat162float(__float2bfloat16_rn(exp2f(sc[j][e] - m[e / 2])));
                    sc[j][e] = p;
                    l[e / 2] += p;
                }
            unsigned pa[TK][4];
            to_a(pa, sc);
            product_p_tile(o, pa, v_tile(s), lane);  // O += P V
        }
        __syncthreads();  // every warp is done with buffer s before a later copy into it
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = group_sum(l[r]);
        inv[r] = 1.0f / l[r];
    }
    const int i0 = w0 + g, i1 = w0 + g + 8;
    bf16* out0 = out + ((long long)b * T + i0) * C + (long long)h * MMA_HS;
    store_rows(out0, out0 + 8LL * C, o, inv, i0 < T, i1 < T, t);
    float* lse_row = lse + ((long long)b * NH + h) * T;
    if (t == 0 && i0 < T) lse_row[i0] = (m[0] + log2f(l[0])) * LN2;
    if (t == 0 && i1 < T) lse_row[i1] = (m[1] + log2f(l[1])) * LN2;
}

// --------------------------------------------------------------------------------------- backward

// D[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]: 8 lanes a row, HS / 8 channels (16 bytes each) a lane.
__device__ void backward_dot(float* D, const bf16* dout, const bf16* out, int B, int T, int NH) {
    const long long row = (long long)blockIdx.x * MMA_DOT_ROWS + threadIdx.x / 8;  // (b, h, i)
    const bool valid = row < (long long)B * NH * T;
    const int part = threadIdx.x % 8;
    float d = 0.0f;
    if (valid) {
        const int i = (int)(row % T), h = (int)((row / T) % NH);
        const long long b = row / ((long long)T * NH);
        const long long at = (b * T + i) * NH * MMA_HS + (long long)h * MMA_HS + 8 * part;
#pragma unroll
        for (int c = 0; c < MMA_HS; c += 64) {
            const Vec<bf16, 8> x = load_vec<8>(dout + at + c), y = load_vec<8>(out + at + c);
#pragma unroll
            for (int k = 0; k < 8; ++k) d += __bfloat162float(x[k]) * __bfloat162float(y[k]);
        }
    }
    d += __shfl_xor_sync(FULL_MASK, d, 1);
    d += __shfl_xor_sync(FULL_MASK, d, 2);
    d += __shfl_xor_sync(FULL_MASK, d, 4);
    if (valid && part == 0) D[row] = d;
}

// The recomputed probabilities and score gradients of a warp's 16 x TILE tile, in place: s holds the
// scores on entry and P (rounded) on exit, dp holds dP on entry and dS (rounded values, as floats) on
// exit. Element (j, e) of the lane is tile row `row0 + g + 8 (e / 2)` and column `col0 + 8j + 2t + e % 2`;
// `keys_are_rows` says which of the two is the key (dkdv: rows are keys). lse2 (lse in base 2) and D of
// the element's query: per row (dq) or per column (dkdv) from lse_of / d_of. Masked (when `mask`, on the
// diagonal's tiles): a key right of its query. Queries and keys past T need no mask: their rows of Q,
// dout, K and V are zero-filled and their lse and D are 0, so S and dP are 0 there and so is dS, and a
// P of 1 meets only zero rows of dout in dV; dq's rows past T are never stored.
template <bool KEYS_ARE_ROWS, typename LseOf, typename DOf>
__device__ __forceinline__ void probabilities(float (&s)[TN][4], float (&dp)[TN][4], int row0, int col0, int g, int t,
                                              bool mask, LseOf lse_of, DOf d_of) {
#pragma unroll
    for (int j = 0; j < TN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + 8 * (e / 2), col = col0 + 8 * j + 2 * t + e % 2;
            const int key = KEYS_ARE_ROWS ? row : col, query = KEYS_ARE_ROWS ? col : row;
            const int at = KEYS_ARE_ROWS ? 8 * j + 2 * t + e % 2 : e / 2;  // the query's index in lse_of / d_of
            const bool masked = mask && key > query;
            const float p = masked ? 0.0f : __bfloat162float(__float2bfloat16_rn(exp2f(s[j][e] * SCALE_LOG2E - lse_of(at))));
            s[j][e] = p;
            dp[j][e] = __bfloat162float(__float2bfloat16_rn(p * (dp[j][e] - d_of(at)) * SCALE));
        }
}

// dK and dV of a block's keys: warp w owns keys k0 + 16w .. + 15 and walks the query tiles at or below them.
__device__ void backward_dkdv(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                              int T, int NH) {
    MMA_SHARED_MEMORY(smem, MMA_BACKWARD_SHARED);  // K and V (a block's rows each), then STAGES Q and dout tiles
    __shared__ float lse2_all[MMA_STAGES][MMA_TILE], d_all[MMA_STAGES][MMA_TILE];  // each query tile's lse (base 2), D
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int h = blockIdx.y, b = blockIdx.z, C = NH * MMA_HS;
    const long long ld = 3LL * C;
    const bf16* base = qkv + (long long)b * T * ld + (long long)h * MMA_HS;
    const bf16* dout_base = dout + (long long)b * T * C + (long long)h * MMA_HS;
    const float* lse_row = lse + ((long long)b * NH + h) * T;
    const float* d_row = D + ((long long)b * NH + h) * T;
    const int k0 = blockIdx.x * MMA_BLOCK_ROWS;  // low blocks are the heavy ones: no reversal needed
    const int w0 = k0 + 16 * warp;               // the warp's first key
    bf16* tiles = smem + 2 * MMA_BLOCK_ROWS * MMA_LD;
    auto q_tile = [&](int s) { return tiles + (2 * s) * MMA_TILE * MMA_LD; };
    auto do_tile = [&](int s) { return tiles + (2 * s + 1) * MMA_TILE * MMA_LD; };

    load_tile_async<MMA_BLOCK_ROWS>(smem, base + C, ld, k0, T);
    load_tile_async<MMA_BLOCK_ROWS>(smem + MMA_BLOCK_ROWS * MMA_LD, base + 2 * C, ld, k0, T);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned k[KS][4], v[KS][4];  // the warp's 16 keys' K and V rows, as A fragments, for the whole loop
    load_a(k, smem + 16 * warp * MMA_LD, lane);
    load_a(v, smem + (MMA_BLOCK_ROWS + 16 * warp) * MMA_LD, lane);

    float dk[CN][4], dv[CN][4];
    zero(dk);
    zero(dv);

    const int first = k0 / MMA_TILE, n_tiles = (T + MMA_TILE - 1) / MMA_TILE - first;  // query tiles from `first`
    auto load_query_tile = [&](int i, int s) {
        const int q0 = (first + i) * MMA_TILE;
        load_tile_async<MMA_TILE>(q_tile(s), base, ld, q0, T);
        load_tile_async<MMA_TILE>(do_tile(s), dout_base, C, q0, T);
        // lse and D are not 16-byte aligned at every q0: plain loads, into the buffer no warp reads now
        for (int r = threadIdx.x; r < MMA_TILE; r += MMA_THREADS) {
            lse2_all[s][r] = q0 + r < T ? lse_row[q0 + r] * LOG2E : 0.0f;
            d_all[s][r] = q0 + r < T ? d_row[q0 + r] : 0.0f;
        }
    };
    pipeline_start(load_query_tile, n_tiles);
    for (int i = 0, s = 0; i < n_tiles; ++i, s = next_buffer(s)) {
        const int q0 = (first + i) * MMA_TILE;
        pipeline_step(load_query_tile, i, s, n_tiles);

        if (q0 + MMA_TILE - 1 >= w0) {  // else every query of the tile is left of the warp's keys
            const float* lse2 = lse2_all[s];
            const float* dd = d_all[s];
            float st[TN][4], dpt[TN][4];
            product_a_tile_t(st, k, q_tile(s), lane);    // S^T = K Q^T: rows keys, columns queries
            product_a_tile_t(dpt, v, do_tile(s), lane);  // dP^T = V dout^T
            probabilities<true>(st, dpt, w0, q0, g, t, q0 < w0 + 15,
                                [&](int c) { return lse2[c]; }, [&](int c) { return dd[c]; });
            unsigned a[TK][4];
            to_a(a, st);
            product_p_tile(dv, a, do_tile(s), lane);  // dV += P^T dout
            to_a(a, dpt);
            product_p_tile(dk, a, q_tile(s), lane);   // dK += dS^T Q
        }
        __syncthreads();  // every warp is done with buffer s before a later copy into it
    }

    const float one[2] = {1.0f, 1.0f};
    const int j0 = w0 + g, j1 = w0 + g + 8;
    bf16* row0 = dqkv + ((long long)b * T + j0) * ld + (long long)h * MMA_HS;
    store_rows(row0 + C, row0 + 8 * ld + C, dk, one, j0 < T, j1 < T, t);
    store_rows(row0 + 2 * C, row0 + 8 * ld + 2 * C, dv, one, j0 < T, j1 < T, t);
}

// dQ of a block's queries: warp w owns queries q0 + 16w .. + 15 and walks the key tiles left of them.
__device__ void backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                            int T, int NH) {
    MMA_SHARED_MEMORY(smem, MMA_BACKWARD_SHARED);  // Q and dout (a block's rows each), then STAGES K and V tiles
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int h = blockIdx.y, b = blockIdx.z, C = NH * MMA_HS;
    const long long ld = 3LL * C;
    const bf16* base = qkv + (long long)b * T * ld + (long long)h * MMA_HS;
    const int q0 = block_from_the_end() * MMA_BLOCK_ROWS;
    const int w0 = q0 + 16 * warp;
    const int i0 = w0 + g, i1 = w0 + g + 8;
    const float* lse_row = lse + ((long long)b * NH + h) * T;
    const float* d_row = D + ((long long)b * NH + h) * T;
    const float lse2[2] = {i0 < T ? lse_row[i0] * LOG2E : 0.0f, i1 < T ? lse_row[i1] * LOG2E : 0.0f};
    const float d[2] = {i0 < T ? d_row[i0] : 0.0f, i1 < T ? d_row[i1] : 0.0f};
    bf16* tiles = smem + 2 * MMA_BLOCK_ROWS * MMA_LD;
    auto k_tile = [&](int s) { return tiles + (2 * s) * MMA_TILE * MMA_LD; };
    auto v_tile = [&](int s) { return tiles + (2 * s + 1) * MMA_TILE * MMA_LD; };

    load_tile_async<MMA_BLOCK_ROWS>(smem, base, ld, q0, T);
    load_tile_async<MMA_BLOCK_ROWS>(smem + MMA_BLOCK_ROWS * MMA_LD, dout + (long long)b * T * C + (long long)h * MMA_HS,
                                    C, q0, T);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned q[KS][4], dy[KS][4];
    load_a(q, smem + 16 * warp * MMA_LD, lane);
    load_a(dy, smem + (MMA_BLOCK_ROWS + 16 * warp) * MMA_LD, lane);

    float dq[CN][4];
    zero(dq);

    const int n_tiles = (min(q0 + MMA_BLOCK_ROWS, T) - 1) / MMA_TILE + 1;
    auto load_kv = [&](int kt, int s) {
        load_tile_async<MMA_TILE>(k_tile(s), base + C, ld, kt * MMA_TILE, T);
        load_tile_async<MMA_TILE>(v_tile(s), base + 2 * C, ld, kt * MMA_TILE, T);
    };
    pipeline_start(load_kv, n_tiles);
    for (int kt = 0, s = 0; kt < n_tiles; ++kt, s = next_buffer(s)) {
        const int k0 = kt * MMA_TILE;
        pipeline_step(load_kv, kt, s, n_tiles);

        if (k0 <= w0 + 15) {
            float sc[TN][4], dp[TN][4];
            product_a_tile_t(sc, q, k_tile(s), lane);   // S = Q K^T
            product_a_tile_t(dp, dy, v_tile(s), lane);  // dP = dout V^T
            probabilities<false>(sc, dp, w0, k0, g, t, k0 + MMA_TILE - 1 > w0,
                                 [&](int r) { return lse2[r]; }, [&](int r) { return d[r]; });
            unsigned a[TK][4];
            to_a(a, dp);
            product_p_tile(dq, a, k_tile(s), lane);  // dQ += dS K
        }
        __syncthreads();
    }

    const float one[2] = {1.0f, 1.0f};
    bf16* row0 = dqkv + ((long long)b * T + i0) * ld + (long long)h * MMA_HS;
    store_rows(row0, row0 + 8 * ld, dq, one, i0 < T, i1 < T, t);
}
}  // namespace flash_mma
#define FLASH_MMA_CALL(call) flash_mma::call
#else
#define FLASH_MMA_CALL(call) __trap()  // the backend never launches these in float32 (check_flash_attention)
#endif

// Entry points. Grids: forward, dkdv and dq (T / MMA_BLOCK_ROWS rounded up, NH, B); dot (B * NH * T /
// MMA_DOT_ROWS rounded up). All take MMA_THREADS threads; forward, dkdv and dq MMA_FORWARD_SHARED or
// MMA_BACKWARD_SHARED bytes of dynamic shared memory. qkv and dqkv are (B, T, 3C), out and dout (B, T, C),
// lse and D (B, NH, T) float; C = NH * MMA_HS, and qkv, out and dout start on 16-byte boundaries.
// Forward asks for one block an SM at least, which leaves ptxas all 255 registers a thread: left to
// itself it aims at two blocks of 8 warps (128 registers) and spills a few bytes at some tiles.
extern "C" __global__ void __launch_bounds__(MMA_THREADS, 1)
flash_mma_forward(floatX* out, float* lse, const floatX* qkv, int T, int NH) {
    FLASH_MMA_CALL(forward(out, lse, qkv, T, NH));
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
flash_mma_backward_dot(float* D, const floatX* dout, const floatX* out, int B, int T, int NH) {
    FLASH_MMA_CALL(backward_dot(D, dout, out, B, T, NH));
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
flash_mma_backward_dkdv(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* D, int T,
                        int NH) {
    FLASH_MMA_CALL(backward_dkdv(dqkv, dout, qkv, lse, D, T, NH));
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
flash_mma_backward_dq(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse, const float* D, int T,
                      int NH) {
    FLASH_MMA_CALL(backward_dq(dqkv, dout, qkv, lse, D, T, NH));
}
