// flash_attention.cu: fused causal self-attention on tensor cores, forward and backward, bf16 with
// 64-channel heads (every GPT-2 size), on WMMA. --attention flash runs flash_attention_mma.cu, which
// computes the same function with the same roundings faster; this file stays as bin/bench_attention's
// baseline (CudaBackend(flash_kernels="wmma")). Oracles: numpy_ops.flash_attention_forward / _backward, which
// compute the same function as attention.cu's path (itself checked against numpy_ops.attention_*) the
// way this file does: forward's online softmax key tile by key tile, rounding where this file rounds.
//
// Why: attention.cu's path writes the (B, NH, T, T) float scores, reads them back for the softmax,
// stores the probabilities for backward and computes the masked upper triangle in 256-row chunks. Here
// the scores of a 64 x 64 tile live in shared memory only, the upper triangle is skipped tile by tile,
// and forward keeps one float per query row (its log-sum-exp, lse) instead of T of them; backward
// recomputes the probabilities from q, k and lse.
//
// Forward (one block per (query tile of 64 rows, head, batch), 4 warps, 16 query rows per warp): for
// each key tile at or left of the diagonal, S = Q K^T on tensor cores (WMMA 16x16x16, bf16 in, float
// out), then each warp updates its rows' running max m and denominator l (the online softmax),
// rescales its float output rows by exp(m_old - m_new), rounds P = exp(S / sqrt(hs) - m) to bf16 and
// adds P V. At the end out = O / l and lse = m + log(l).
//
// Backward, without atomics (so without order-dependent sums): D = rowsum(dout * out) per query row
// (flash_attention_backward_dot), then one kernel that owns a key tile and walks the query tiles below
// it, accumulating dK and dV in registers (flash_attention_backward_dkdv), and one that owns a query
// tile and walks the key tiles left of it, accumulating dQ (flash_attention_backward_dq). Both
// recompute P = exp(S / sqrt(hs) - lse) and dS = P (dP - D) / sqrt(hs), rounding P and dS to bf16
// where they enter a product, as the oracle does.
//
// Thread mapping for the elementwise work on a warp's 16 x 64 tile (scores, probabilities, gradients):
// lane l owns row l % 16 and the 32 columns starting at (l / 16) * 32, read and written 16 bytes at a
// time; the two lanes of a row (l and l ^ 16) combine their maxima and sums with one shuffle. Shared
// memory per block stays under the 48 KB that needs no opt-in: tiles are 64 x 64 bf16 (9 KB with
// padded rows), and each warp has a scratch of 4.5 KB that holds a 16 x 64 float result, or, once every
// lane has read that (a __syncwarp), the one or two bf16 operands made from it.
//
// The float32 build (floatX = float) has no bf16 tensor-core product, nor has a GPU before sm_80: their
// entry points trap, and the backend refuses --attention flash without --dtype bf16 before anything runs.
#include "common.cuh"

// bf16 tensor-core fragments exist from sm_80 on (the backend's bf16 cuBLAS path needs sm_80 as well)
#if defined(XTRAIN_BF16) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#include <mma.h>

// The tiles and blocks, which the host reads from here: the head size it checks, the grid of tiles,
// FLASH_THREADS threads a block, and FLASH_WARPS rows a block for the dot kernel (a row per warp).
constexpr int FLASH_HS = 64;     // channels per head
constexpr int FLASH_TILE = 64;   // query rows and key columns per tile
constexpr int FLASH_WARPS = 4;   // 16 rows of a tile each
constexpr int FLASH_THREADS = FLASH_WARPS * WARP_SIZE;
// Row strides in shared memory, padded so that the 16 rows a warp touches at once start on different
// banks (a stride of 64 puts them all on one): bf16 tiles and operands 72 (144 bytes), float scratch
// and output rows 68 (272 bytes); WMMA takes any ld that is a multiple of 16 bytes.
constexpr int TILE_LD = 72;
constexpr int ACC_LD = 68;
constexpr int SCRATCH_FLOATS = 16 * TILE_LD;  // a 16 x ACC_LD float view, or two 16 x TILE_LD bf16 operands

namespace flash {
using namespace nvcuda;
typedef __nv_bfloat16 bf16;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;     // B[k][n] at p[k * ld + n]
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;    // B[k][n] at p[n * ld + k]
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

constexpr float SCALE = 0.125f;  // 1 / sqrt(64), exact

// Rows [row0, row0 + 64) of one head's 64 channels of a token-major tensor whose row t starts at
// src + t * ld, into a 64 x 64 tile; rows at or past T are zero. 16-byte accesses, 4 per thread.
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, long long ld, int row0, int T) {
    for (int v = threadIdx.x; v < FLASH_TILE * FLASH_HS / 8; v += FLASH_THREADS) {
        const int row = v / (FLASH_HS / 8), col = (v % (FLASH_HS / 8)) * 8;
        Vec<bf16, 8> x;
        if (row0 + row < T) {
            x = load_vec<8>(src + (long long)(row0 + row) * ld + col);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] = __float2bfloat16_rn(0.0f);
        }
        store_vec<8>(tile + row * TILE_LD + col, x);
    }
}

// 64 float values of rows [row0, row0 + 64) of a per-row vector (lse or D), 0 past T.
__device__ __forceinline__ void load_rows(float* dst, const float* src, int row0, int T) {
    for (int r = threadIdx.x; r < FLASH_TILE; r += FLASH_THREADS) dst[r] = row0 + r < T ? src[row0 + r] : 0.0f;
}

// acc[n] (16 x 16 blocks of a 16 x 64 result) = A (16 x 64, as 4 fragments along k) times the 64 x 64
// operand b: b[k][n] at b_ptr[k * 64 + n] (FragB) or at b_ptr[n * 64 + k] (FragBt: the transpose of a
// row-major tile, e.g. K for Q K^T).
template <typename FragBType, bool TRANSPOSED>
__device__ __forceinline__ void product_16x64(FragC (&acc)[4], const FragA (&a)[4], const bf16* b_ptr,
                                              bool accumulate) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        if (!accumulate) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            FragBType b;
            const bf16* p = TRANSPOSED ? b_ptr + (n * 16) * TILE_LD + kk * 16 : b_ptr + (kk * 16) * TILE_LD + n * 16;
            wmma::load_matrix_sync(b, p, TILE_LD);
            wmma::mma_sync(acc[n], a[kk], b, acc[n]);
        }
    }
}

__device__ __forceinline__ void load_a(FragA (&a)[4], const bf16* tile_rows) {  // 16 x 64, row-major, ld TILE_LD
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wmma::load_matrix_sync(a[kk], tile_rows + kk * 16, TILE_LD);
}

__device__ __forceinline__ void store_acc(float* scratch, FragC (&acc)[4]) {  // 16 x 64 float, ld ACC_LD
#pragma unroll
    for (int n = 0; n < 4; ++n) wmma::store_matrix_sync(scratch + n * 16, acc[n], ACC_LD, wmma::mem_row_major);
}

// The lane's 32 values of its row of a warp's 16 x 64 float scratch.
__device__ __forceinline__ void read_row(float (&x)[32], const float* scratch, int r, int c0) {
#pragma unroll
    for (int c = 0; c < 32; c += 4) {
        const Vec<float, 4> v = load_vec<4>(scratch + r * ACC_LD + c0 + c);
#pragma unroll
        for (int k = 0; k < 4; ++k) x[c + k] = v[k];
    }
}

// The start of a warp's float scratch, as a 16 x 64 bf16 operand (ld TILE_LD); a second one follows it.
__device__ __forceinline__ bf16* operand_in(float* scratch) { return reinterpret_cast<bf16*>(scratch); }

// Round the lane's 32 values to bf16 into its row of a 16 x 64 bf16 operand (ld TILE_LD), 8 to a store.
// Every lane of the warp must have read the scratch first (the caller's __syncwarp): they overlap.
__device__ __forceinline__ void write_operand(bf16* operand, const float (&x)[32], int r, int c0) {
#pragma unroll
    for (int c = 0; c < 32; c += 8) {
        Vec<bf16, 8> v;
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __float2bfloat16_rn(x[c + k]);
        store_vec<8>(operand + r * TILE_LD + c0 + c, v);
    }
}

// out[b, i, h, :] <- the lane's 32 values of a finished 16 x 64 float row, rounded to bf16.
__device__ __forceinline__ void write_row(bf16* dst, const float (&x)[32]) {
#pragma unroll
    for (int c = 0; c < 32; c += 8) {
        Vec<bf16, 8> v;
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __float2bfloat16_rn(x[c + k]);
        store_vec<8>(dst + c, v);
    }
}

// A warp's finished 16 x 64 accumulator, rounded to bf16, into the lane's 32 entries at dst (its row of
// a token-major tensor) when `valid` (the row exists); the scratch carries it from fragments to lanes.
__device__ __forceinline__ void store_rows(bf16* dst, FragC (&acc)[4], float* scratch, int r, int c0, bool valid) {
    __syncwarp();  // every lane is done with what the scratch held
    store_acc(scratch, acc);
    __syncwarp();
    if (valid) {
        float x[32];
        read_row(x, scratch, r, c0);
        write_row(dst, x);
    }
}

// Who this thread is and where its head starts, as every tile kernel begins: warp and lane, the lane's row
// r and first column c0 of the warp's 16 x 64 tile, head h and batch b (grid y and z), C = NH * 64, the
// row length ld = 3C of qkv and dqkv, and qkv's row t = 0 at head h (part q).
struct Place {
    int warp, lane, r, c0, h, b, C;
    long long ld;
    const bf16* base;
};

__device__ __forceinline__ Place this_place(const bf16* qkv, int T, int NH) {
    const int lane = threadIdx.x % WARP_SIZE, h = blockIdx.y, b = blockIdx.z, C = NH * FLASH_HS;
    const long long ld = 3LL * C;
    return {(int)(threadIdx.x / WARP_SIZE), lane, lane % 16, (lane / 16) * 32, h, b, C, ld,
            qkv + (long long)b * T * ld + (long long)h * FLASH_HS};
}

// Heavy tiles first: the query tile with the most key tiles to its left starts first.
__device__ __forceinline__ int tile_from_the_end() { return gridDim.x - 1 - blockIdx.x; }

// --------------------------------------------------------------------------------------- forward

__device__ void forward(bf16* out, float* lse, const bf16* qkv, int T, int NH) {
    __shared__ __align__(128) bf16 kv[FLASH_TILE * TILE_LD];                 // Q, then K, then V
    __shared__ __align__(128) float scratch_all[FLASH_WARPS][SCRATCH_FLOATS];  // S, then P
    __shared__ __align__(128) float o_all[FLASH_WARPS][16 * ACC_LD];          // the running output

    const auto [warp, lane, r, c0, h, b, C, ld, base] = this_place(qkv, T, NH);
    const int qt = tile_from_the_end();
    const int q0 = qt * FLASH_TILE;
    float* scratch = scratch_all[warp];
    float* o = o_all[warp];
    const int i = q0 + warp * 16 + r;  // this lane's query

    FragA q[4];
    load_tile(kv, base, ld, q0, T);
    __syncthreads();
    load_a(q, kv + warp * 16 * TILE_LD);
#pragma unroll
    for (int c = 0; c < 32; ++c) o[r * ACC_LD + c0 + c] = 0.0f;
    float m = neg_inf(), l = 0.0f;

    for (int kt = 0; kt <= qt; ++kt) {
        const int k0 = kt * FLASH_TILE;
        __syncthreads();  // every warp is done with the previous V (and with Q on the first tile)
        load_tile(kv, base + C, ld, k0, T);
        __syncthreads();
        FragC acc[4];
        product_16x64<FragBt, true>(acc, q, kv, false);  // S = Q K^T
        store_acc(scratch, acc);
        __syncthreads();  // every warp has read K: V may replace it
        load_tile(kv, base + 2 * C, ld, k0, T);

        __syncwarp();
        float s[32];
        read_row(s, scratch, r, c0);
        float tile_max = neg_inf();
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const int j = k0 + c0 + c;
            s[c] = (j <= i && i < T) ? s[c] * SCALE : neg_inf();
            tile_max = fmaxf(tile_max, s[c]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 16));
        const float m_new = fmaxf(m, tile_max);
        // rows past T (or, never, a row without a key yet) keep m = -inf: their p and alpha are 0
        const float alpha = m_new == neg_inf() ? 0.0f : expf(m - m_new);
        float row_sum = 0.0f;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const float p = m_new == neg_inf() ? 0.0f : __bfloat162float(__float2bfloat16_rn(expf(s[c] - m_new)));
            s[c] = p;  // rounded as it enters P V, and summed as rounded, so l normalises what O holds
            row_sum += p;
        }
        row_sum += __shfl_xor_sync(FULL_MASK, row_sum, 16);
        l = l * alpha + row_sum;
        m = m_new;
        __syncwarp();
        write_operand(operand_in(scratch), s, r, c0);
#pragma unroll
        for (int c = 0; c < 32; ++c) o[r * ACC_LD + c0 + c] *= alpha;
        __syncwarp();
        __syncthreads();  // V is in

        FragA p[4];
        load_a(p, operand_in(scratch));
#pragma unroll
        for (int n = 0; n < 4; ++n) wmma::load_matrix_sync(acc[n], o + n * 16, ACC_LD, wmma::mem_row_major);
        product_16x64<FragB, false>(acc, p, kv, true);  // O += P V
        store_acc(o, acc);
    }
    __syncwarp();
    if (i < T) {
        float y[32];
        read_row(y, o, r, c0);
#pragma unroll
        for (int c = 0; c < 32; ++c) y[c] /= l;
        write_row(out + ((long long)b * T + i) * C + (long long)h * FLASH_HS + c0, y);
        if (c0 == 0) lse[((long long)b * NH + h) * T + i] = m + logf(l);
    }
}

// --------------------------------------------------------------------------------------- backward

// D[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]: one warp per row, 2 channels per lane.
__device__ void backward_dot(float* D, const bf16* dout, const bf16* out, int B, int T, int NH) {
    const long long row = (long long)blockIdx.x * FLASH_WARPS + threadIdx.x / WARP_SIZE;  // (b, h, i)
    if (row >= (long long)B * NH * T) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int i = (int)(row % T), h = (int)((row / T) % NH);
    const long long b = row / ((long long)T * NH);
    const long long at = (b * T + i) * NH * FLASH_HS + (long long)h * FLASH_HS + 2 * lane;
    float d = __bfloat162float(dout[at]) * __bfloat162float(out[at])
              + __bfloat162float(dout[at + 1]) * __bfloat162float(out[at + 1]);
    d = warp_sum(d);
    if (lane == 0) D[row] = d;
}

// The probabilities and score gradients of one warp's 16 x 64 tile, in the lane's 32 entries:
// rows are keys j and columns queries i (dK/dV kernel) or the other way round (dQ kernel); `keys_are_rows`
// says which, for the causal mask. lse and D are indexed by query.
__device__ __forceinline__ void recompute_p(float (&p)[32], const float* scratch, int r, int c0, int row_index0,
                                            int col_index0, bool keys_are_rows, const float* lse_tile,
                                            float lse_row, int T) {
    read_row(p, scratch, r, c0);
#pragma unroll
    for (int c = 0; c < 32; ++c) {
        const int row_idx = row_index0 + r, col_idx = col_index0 + c0 + c;
        const int key = keys_are_rows ? row_idx : col_idx, query = keys_are_rows ? col_idx : row_idx;
        const float l = keys_are_rows ? lse_tile[c0 + c] : lse_row;
        p[c] = (key <= query && query < T && key < T)
                   ? __bfloat162float(__float2bfloat16_rn(expf(p[c] * SCALE - l))) : 0.0f;
    }
}

__device__ void backward_dkdv(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                              int T, int NH) {
    __shared__ __align__(128) bf16 q_tile[FLASH_TILE * TILE_LD];    // K, then each Q tile
    __shared__ __align__(128) bf16 do_tile[FLASH_TILE * TILE_LD];   // V, then each dout tile
    __shared__ __align__(128) float scratch_all[FLASH_WARPS][SCRATCH_FLOATS];  // S^T, then dP^T, then P^T and dS^T
    __shared__ __align__(128) bf16 v_all[FLASH_WARPS][16 * TILE_LD];          // each warp's 16 rows of V
    __shared__ float lse_tile[FLASH_TILE], d_tile[FLASH_TILE];

    const auto [warp, lane, r, c0, h, b, C, ld, base] = this_place(qkv, T, NH);
    const int kt = blockIdx.x;  // light tiles are the high kt: no reversal needed
    const int k0 = kt * FLASH_TILE;
    const bf16* dout_base = dout + (long long)b * T * C + (long long)h * FLASH_HS;
    const float* lse_row = lse + ((long long)b * NH + h) * T;
    const float* d_row = D + ((long long)b * NH + h) * T;
    float* scratch = scratch_all[warp];
    bf16* v_rows = v_all[warp];

    // K's fragments stay in registers through the loop, with the dK and dV accumulators; V's rows wait
    // in shared memory (all three in registers would spill)
    FragA k[4];
    load_tile(q_tile, base + C, ld, k0, T);
    load_tile(do_tile, base + 2 * C, ld, k0, T);
    __syncthreads();
    load_a(k, q_tile + warp * 16 * TILE_LD);
    for (int e = lane; e < 16 * TILE_LD; e += WARP_SIZE) v_rows[e] = do_tile[warp * 16 * TILE_LD + e];
    FragC dk[4], dv[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        wmma::fill_fragment(dk[n], 0.0f);
        wmma::fill_fragment(dv[n], 0.0f);
    }
    const int n_tiles = (T + FLASH_TILE - 1) / FLASH_TILE;

    for (int qt = kt; qt < n_tiles; ++qt) {
        const int q0 = qt * FLASH_TILE;
        __syncthreads();  // every warp is done with the previous tiles (and with K and V on the first)
        load_tile(q_tile, base, ld, q0, T);
        load_tile(do_tile, dout_base, C, q0, T);
        load_rows(lse_tile, lse_row, q0, T);
        load_rows(d_tile, d_row, q0, T);
        __syncthreads();

        FragC acc[4];
        product_16x64<FragBt, true>(acc, k, q_tile, false);  // S^T = K Q^T: rows keys, columns queries
        store_acc(scratch, acc);
        __syncwarp();
        float p[32];  // P^T, rounded to bf16 as it enters dV's product
        recompute_p(p, scratch, r, c0, k0 + warp * 16, q0, true, lse_tile, 0.0f, T);
        FragA a[4];
        load_a(a, v_rows);
        product_16x64<FragBt, true>(acc, a, do_tile, false);  // dP^T = V dout^T
        __syncwarp();  // every lane has read S^T
        store_acc(scratch, acc);
        __syncwarp();
        float ds[32];
        read_row(ds, scratch, r, c0);
#pragma unroll
        for (int c = 0; c < 32; ++c) ds[c] = p[c] * (ds[c] - d_tile[c0 + c]) * SCALE;
        __syncwarp();  // every lane has read dP^T: the two bf16 operands take its place
        write_operand(operand_in(scratch), p, r, c0);
        write_operand(operand_in(scratch) + 16 * TILE_LD, ds, r, c0);
        __syncwarp();
        load_a(a, operand_in(scratch));
        product_16x64<FragB, false>(dv, a, do_tile, true);  // dV += P^T dout
        load_a(a, operand_in(scratch) + 16 * TILE_LD);
        product_16x64<FragB, false>(dk, a, q_tile, true);  // dK += dS^T Q
    }

    // dK and dV rows of this warp's 16 keys, into dqkv's k and v parts
    const int j = k0 + warp * 16 + r;
    bf16* row = dqkv + ((long long)b * T + j) * ld + (long long)h * FLASH_HS + c0;
    store_rows(row + C, dk, scratch, r, c0, j < T);
    store_rows(row + 2 * C, dv, scratch, r, c0, j < T);
}

__device__ void backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                            int T, int NH) {
    __shared__ __align__(128) bf16 k_tile[FLASH_TILE * TILE_LD];   // Q, then each K tile
    __shared__ __align__(128) bf16 v_tile[FLASH_TILE * TILE_LD];   // dout, then each V tile
    __shared__ __align__(128) float scratch_all[FLASH_WARPS][SCRATCH_FLOATS];

    const auto [warp, lane, r, c0, h, b, C, ld, base] = this_place(qkv, T, NH);
    const int qt = tile_from_the_end();
    const int q0 = qt * FLASH_TILE;
    const int i = q0 + warp * 16 + r;
    const float lse_i = i < T ? lse[((long long)b * NH + h) * T + i] : 0.0f;
    const float d_i = i < T ? D[((long long)b * NH + h) * T + i] : 0.0f;
    float* scratch = scratch_all[warp];

    FragA q[4], dy[4];
    load_tile(k_tile, base, ld, q0, T);
    load_tile(v_tile, dout + (long long)b * T * C + (long long)h * FLASH_HS, C, q0, T);
    __syncthreads();
    load_a(q, k_tile + warp * 16 * TILE_LD);
    load_a(dy, v_tile + warp * 16 * TILE_LD);
    FragC dq[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) wmma::fill_fragment(dq[n], 0.0f);

    for (int kt = 0; kt <= qt; ++kt) {
        const int k0 = kt * FLASH_TILE;
        __syncthreads();
        load_tile(k_tile, base + C, ld, k0, T);
        load_tile(v_tile, base + 2 * C, ld, k0, T);
        __syncthreads();

        FragC acc[4];
        product_16x64<FragBt, true>(acc, q, k_tile, false);  // S = Q K^T
        store_acc(scratch, acc);
        __syncwarp();
        float p[32];
        recompute_p(p, scratch, r, c0, q0 + warp * 16, k0, false, nullptr, lse_i, T);
        product_16x64<FragBt, true>(acc, dy, v_tile, false);  // dP = dout V^T
        __syncwarp();  // every lane has read S
        store_acc(scratch, acc);
        __syncwarp();
        float ds[32];
        read_row(ds, scratch, r, c0);
#pragma unroll
        for (int c = 0; c < 32; ++c) ds[c] = p[c] * (ds[c] - d_i) * SCALE;
        __syncwarp();
        write_operand(operand_in(scratch), ds, r, c0);
        __syncwarp();
        FragA a[4];
        load_a(a, operand_in(scratch));
        product_16x64<FragB, false>(dq, a, k_tile, true);  // dQ += dS K
    }

    store_rows(dqkv + ((long long)b * T + i) * ld + (long long)h * FLASH_HS + c0, dq, scratch, r, c0, i < T);
}
}  // namespace flash
#define FLASH_CALL(call) flash::call
#else
#define FLASH_CALL(call) __trap()  // the backend never launches these in float32 (check_flash_attention)
#endif

// Entry points. Grids: forward and dq (T / FLASH_TILE rounded up, NH, B); dkdv the same; dot
// (B * NH * T / FLASH_WARPS rounded up). All take FLASH_THREADS threads. qkv and dqkv are (B, T, 3C),
// out and dout (B, T, C), lse and D (B, NH, T) float; C = NH * 64, and every row of qkv, out and dout
// starts on a 16-byte boundary.
extern "C" __global__ void flash_attention_forward(floatX* out, float* lse, const floatX* qkv, int T, int NH) {
    FLASH_CALL(forward(out, lse, qkv, T, NH));
}

extern "C" __global__ void flash_attention_backward_dot(float* D, const floatX* dout, const floatX* out, int B, int T, int NH) {
    FLASH_CALL(backward_dot(D, dout, out, B, T, NH));
}

extern "C" __global__ void flash_attention_backward_dkdv(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                              const float* D, int T, int NH) {
    FLASH_CALL(backward_dkdv(dqkv, dout, qkv, lse, D, T, NH));
}

extern "C" __global__ void flash_attention_backward_dq(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                            const float* D, int T, int NH) {
    FLASH_CALL(backward_dq(dqkv, dout, qkv, lse, D, T, NH));
}
