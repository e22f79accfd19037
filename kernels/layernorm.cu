// layernorm.cu: LayerNorm over the channels of each (b, t) row, forward and backward.
// Oracles: numpy_ops.layernorm_forward, numpy_ops.residual_layernorm_forward, numpy_ops.layernorm_backward.
//
// Row kernels use one warp per row, LAYERNORM_ROWS_PER_BLOCK rows per block. A GPT-2 row is 768 to 1600
// floats (3 to 6 KB): one warp streams it with 16-byte loads, the statistics are warp shuffles with
// no shared memory or __syncthreads, and the second and third passes over the row hit L1. A block
// per row would leave most of its threads idle at these widths.
#include "common.cuh"

// The row kernels' blocks: 256 threads, a warp per row, so 8 rows a block. The host reads both from
// here: LAYERNORM_BLOCK threads a block, and a grid of rows / LAYERNORM_ROWS_PER_BLOCK blocks rounded up.
constexpr int LAYERNORM_BLOCK = 256;
constexpr int LAYERNORM_ROWS_PER_BLOCK = LAYERNORM_BLOCK / WARP_SIZE;

// The row of the calling warp.
__device__ __forceinline__ long long warp_row() {
    return (long long)blockIdx.x * LAYERNORM_ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
}

// ---------------------------------------------------------------------------------------- forward

// out = (x - mean) * rstd * weight + bias, mean = sum(x)/C, rstd = 1/sqrt(sum((x - mean)^2)/C + eps)
// (numpy_ops.layernorm_forward), given this lane's part of sum(x). The variance is taken around the mean
// in a second pass, as numpy does, rather than as E[x^2] - mean^2, which loses digits when |mean| >> std.
template <int N>
__device__ void layernorm_row_from_sum(floatX* out, float* mean, float* rstd, const floatX* x, const floatX* weight,
                                       const floatX* bias, int C, float eps, long long row, float sum) {
    const int lane = threadIdx.x % WARP_SIZE;
    const float m = warp_sum(sum) / C;

    float sq = 0.0f;
    for (int c = lane * N; c < C; c += WARP_SIZE * N) {
        const Vec<floatX, N> v = load_vec<N>(x + c);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float d = to_float(v[k]) - m;
            sq += d * d;
        }
    }
    const float r = 1.0f / sqrtf(warp_sum(sq) / C + eps);

    floatX* o = out + row * C;
    for (int c = lane * N; c < C; c += WARP_SIZE * N) {
        const Vec<floatX, N> v = load_vec<N>(x + c);
        const Vec<floatX, N> w = load_vec<N>(weight + c);
        const Vec<floatX, N> b = load_vec<N>(bias + c);
        Vec<floatX, N> res;
#pragma unroll
        for (int k = 0; k < N; ++k) res[k] = from_float<floatX>((to_float(v[k]) - m) * r * to_float(w[k]) + to_float(b[k]));
        store_vec<N>(o + c, res);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

template <int N>
__device__ void layernorm_forward_row(floatX* out, float* mean, float* rstd, const floatX* inp,
                                      const floatX* weight, const floatX* bias, int C, float eps, long long row) {
    const int lane = threadIdx.x % WARP_SIZE;
    const floatX* x = inp + row * C;
    float sum = 0.0f;
    for (int c = lane * N; c < C; c += WARP_SIZE * N) {
        const Vec<floatX, N> v = load_vec<N>(x + c);
#pragma unroll
        for (int k = 0; k < N; ++k) sum += to_float(v[k]);
    }
    layernorm_row_from_sum<N>(out, mean, rstd, x, weight, bias, C, eps, row, sum);
}

extern "C" __global__ void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp,
                                             const floatX* weight, const floatX* bias, long long rows, int C,
                                             float eps, int vec) {
    const long long row = warp_row();
    if (row >= rows) return;  // whole warps leave together, so the shuffles stay full-warp
    if (vec) layernorm_forward_row<VEC_X>(out, mean, rstd, inp, weight, bias, C, eps, row);
    else layernorm_forward_row<1>(out, mean, rstd, inp, weight, bias, C, eps, row);
}

// The residual connection and the layernorm after it in one pass over the row
// (numpy_ops.residual_layernorm_forward, as llm.c's fused_residual_forward): residual = floatX(a + b) is
// written and summed for the mean as it is made, and the layernorm's two other passes read it back from
// L1 (each lane reads the chunks it wrote itself), instead of residual_forward writing the stream and
// layernorm_forward reading it again from memory. The layernorm sees the rounded residual, as numpy does.
template <int N>
__device__ void residual_layernorm_forward_row(floatX* residual, floatX* out, float* mean, float* rstd,
                                               const floatX* a, const floatX* b, const floatX* weight,
                                               const floatX* bias, int C, float eps, long long row) {
    const int lane = threadIdx.x % WARP_SIZE;
    floatX* x = residual + row * C;
    float sum = 0.0f;
    for (int c = lane * N; c < C; c += WARP_SIZE * N) {
        const Vec<floatX, N> u = load_vec<N>(a + row * C + c);
        const Vec<floatX, N> v = load_vec<N>(b + row * C + c);
        Vec<floatX, N> s;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            s[k] = from_float<floatX>(to_float(u[k]) + to_float(v[k]));
            sum += to_float(s[k]);
        }
        store_vec<N>(x + c, s);
    }
    layernorm_row_from_sum<N>(out, mean, rstd, x, weight, bias, C, eps, row, sum);
}

extern "C" __global__ void residual_layernorm_forward(floatX* residual, floatX* out, float* mean, float* rstd,
                                                      const floatX* a, const floatX* b, const floatX* weight,
                                                      const floatX* bias, long long rows, int C, float eps,
                                                      int vec) {
    const long long row = warp_row();
    if (row >= rows) return;
    if (vec) residual_layernorm_forward_row<VEC_X>(residual, out, mean, rstd, a, b, weight, bias, C, eps, row);
    else residual_layernorm_forward_row<1>(residual, out, mean, rstd, a, b, weight, bias, C, eps, row);
}

// ---------------------------------------------------------------------------------------- backward

// The input gradient, accumulated into the residual stream's gradient (numpy_ops.layernorm_backward):
//   n = (x - mean) * rstd,  g = dout * weight,
//   dinp += rstd * (g - mean_C(g) - n * mean_C(g * n)).
// One warp per row: a first pass for the two row means, a second that writes. The weight and bias
// gradients are column sums over all rows and live in the two kernels below (or all three in one pass:
// layernorm_backward_fused).
template <int N>
__device__ void layernorm_backward_input_row(floatX* dinp, const floatX* dout, const floatX* inp,
                                             const floatX* weight, const float* mean, const float* rstd, int C,
                                             long long row) {
    const int lane = threadIdx.x % WARP_SIZE;
    const floatX* x = inp + row * C;
    const floatX* dy = dout + row * C;
    const float m = mean[row], r = rstd[row];

    float sum_g = 0.0f, sum_gn = 0.0f;
    for (int c = lane * N; c < C; c += WARP_SIZE * N) {
        const Vec<floatX, N> xv = load_vec<N>(x + c);
        const Vec<floatX, N> dv = load_vec<N>(dy + c);
        const Vec<floatX, N> wv = load_vec<N>(weight + c);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float n = (to_float(xv[k]) - m) * r;
            const float g = to_float(dv[k]) * to_float(wv[k]);
            sum_g += g;
            sum_gn += g * n;
        }
    }
    const float mean_g = warp_sum(sum_g) / C;
    const float mean_gn = warp_sum(sum_gn) / C;

    floatX* dx = dinp + row * C;
    for (int c = lane * N; c < C; c += WARP_SIZE * N) {
        const Vec<floatX, N> xv = load_vec<N>(x + c);
        const Vec<floatX, N> dv = load_vec<N>(dy + c);
        const Vec<floatX, N> wv = load_vec<N>(weight + c);
        Vec<floatX, N> acc = load_vec<N>(dx + c);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float n = (to_float(xv[k]) - m) * r;
            const float g = to_float(dv[k]) * to_float(wv[k]);
            acc[k] = from_float<floatX>(to_float(acc[k]) + (g - mean_g - n * mean_gn) * r);
        }
        store_vec<N>(dx + c, acc);
    }
}

extern "C" __global__ void layernorm_backward_input(floatX* dinp, const floatX* dout, const floatX* inp,
                                                    const floatX* weight, const float* mean, const float* rstd,
                                                    long long rows, int C, int vec) {
    const long long row = warp_row();
    if (row >= rows) return;
    if (vec) layernorm_backward_input_row<VEC_X>(dinp, dout, inp, weight, mean, rstd, C, row);
    else layernorm_backward_input_row<1>(dinp, dout, inp, weight, mean, rstd, C, row);
}

// ---------------------------------------------------------------------------------------- backward, one pass

// The input gradient and the weight and bias gradients in one pass over dout and inp (llm.c's
// layernorm_backward does the same): the two kernels above and below read both twice, once per row for
// dinp and once per column for the parameters, a layernorm backward's whole traffic again. Block b owns
// the rows [b * rows_per_split, +rows_per_split) (the column sums' splits, so stage 2 below finishes it);
// warp w walks rows r0 + w, r0 + w + LAYERNORM_ROWS_PER_BLOCK, ..., and while it reads a row for the two
// row means it adds dout * n and dout into per-lane registers for the lane's channels, chunk j being
// channels (j * WARP_SIZE + lane) * N + [0, N). The warps' partials are then added in shared memory in
// warp order and written as partial_dw[b, c], partial_db[b, c]: the order of the two-kernel path's
// column sums (thread row y of COL_ROWS adds rows y, y + COL_ROWS, ..., then the rows' sums in order), so
// the bits are that path's, and the same every run. The registers bound the width: C at most
// LAYERNORM_FUSED_CHUNKS * WARP_SIZE * N (1024 channels in bf16, 512 in fp32 on the vector path), which
// the host checks (CudaBackend.layernorm_backward), taking the two-kernel path beyond it.
constexpr int LAYERNORM_FUSED_CHUNKS = 4;
static_assert(LAYERNORM_ROWS_PER_BLOCK == COL_ROWS, "the one-pass backward sums columns in the column sums' order");
constexpr int LAYERNORM_FUSED_MAX_C = LAYERNORM_FUSED_CHUNKS * WARP_SIZE * VEC_X;

template <int N>
__device__ void layernorm_backward_fused_impl(float* block_dw, float* block_db, floatX* dinp, float* partial_dw,
                                              float* partial_db, const floatX* dout, const floatX* inp,
                                              const floatX* weight, const float* mean, const float* rstd,
                                              long long rows, int C, int rows_per_split) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const long long r0 = (long long)blockIdx.x * rows_per_split;
    const long long r1 = min(rows, r0 + rows_per_split);
    float dw[LAYERNORM_FUSED_CHUNKS][N], db[LAYERNORM_FUSED_CHUNKS][N];
#pragma unroll
    for (int j = 0; j < LAYERNORM_FUSED_CHUNKS; ++j)
#pragma unroll
        for (int k = 0; k < N; ++k) dw[j][k] = db[j][k] = 0.0f;

    for (long long row = r0 + warp; row < r1; row += LAYERNORM_ROWS_PER_BLOCK) {
        const floatX* x = inp + row * C;
        const floatX* dy = dout + row * C;
        const float m = mean[row], r = rstd[row];
        float sum_g = 0.0f, sum_gn = 0.0f;
#pragma unroll
        for (int j = 0; j < LAYERNORM_FUSED_CHUNKS; ++j) {
            const int c = (j * WARP_SIZE + lane) * N;
            if (c >= C) continue;
            const Vec<floatX, N> xv = load_vec<N>(x + c);
            const Vec<floatX, N> dv = load_vec<N>(dy + c);
            const Vec<floatX, N> wv = load_vec<N>(weight + c);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float n = (to_float(xv[k]) - m) * r;
                const float d = to_float(dv[k]);
                const float g = d * to_float(wv[k]);
                sum_g += g;
                sum_gn += g * n;
                db[j][k] += d;
                dw[j][k] += d * n;
            }
        }
        const float mean_g = warp_sum(sum_g) / C;
        const float mean_gn = warp_sum(sum_gn) / C;
        floatX* dx = dinp + row * C;
#pragma unroll
        for (int j = 0; j < LAYERNORM_FUSED_CHUNKS; ++j) {
            const int c = (j * WARP_SIZE + lane) * N;
            if (c >= C) continue;
            const Vec<floatX, N> xv = load_vec<N>(x + c);
            const Vec<floatX, N> dv = load_vec<N>(dy + c);
            const Vec<floatX, N> wv = load_vec<N>(weight + c);
            Vec<floatX, N> acc = load_vec<N>(dx + c);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float n = (to_float(xv[k]) - m) * r;
                const float g = to_float(dv[k]) * to_float(wv[k]);
                acc[k] = from_float<floatX>(to_float(acc[k]) + (g - mean_g - n * mean_gn) * r);
            }
            store_vec<N>(dx + c, acc);
        }
    }

    // the warps' partials, added in warp order (a barrier between warps: no two add at once)
    for (int w = 0; w < LAYERNORM_ROWS_PER_BLOCK; ++w) {
        if (warp == w) {
#pragma unroll
            for (int j = 0; j < LAYERNORM_FUSED_CHUNKS; ++j) {
                const int c = (j * WARP_SIZE + lane) * N;
                if (c >= C) continue;
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    block_dw[c + k] = w == 0 ? dw[j][k] : block_dw[c + k] + dw[j][k];
                    block_db[c + k] = w == 0 ? db[j][k] : block_db[c + k] + db[j][k];
                }
            }
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        partial_dw[(long long)blockIdx.x * C + c] = block_dw[c];
        partial_db[(long long)blockIdx.x * C + c] = block_db[c];
    }
}

extern "C" __global__ void layernorm_backward_fused(floatX* dinp, float* partial_dw, float* partial_db,
                                                    const floatX* dout, const floatX* inp, const floatX* weight,
                                                    const float* mean, const float* rstd, long long rows, int C,
                                                    int rows_per_split, int vec) {
    // the block's sums of its warps' partials (declared here, once for both paths)
    __shared__ float block_dw[LAYERNORM_FUSED_MAX_C];
    __shared__ float block_db[LAYERNORM_FUSED_MAX_C];
    if (vec) layernorm_backward_fused_impl<VEC_X>(block_dw, block_db, dinp, partial_dw, partial_db, dout, inp, weight,
                                                  mean, rstd, rows, C, rows_per_split);
    else layernorm_backward_fused_impl<1>(block_dw, block_db, dinp, partial_dw, partial_db, dout, inp, weight, mean,
                                          rstd, rows, C, rows_per_split);
}

// Stage 1 of dweight += sum_rows dout * n and dbias += sum_rows dout (column sums, see common.cuh):
// block (32, COL_ROWS) owns 32*N channels and rows [split * rows_per_split, +rows_per_split);
// the normalised input n is recomputed from inp, mean and rstd rather than stored by forward.
// Writes partial_dw[split, c] and partial_db[split, c].
// layernorm_backward_fused does this inside the input-gradient pass where the width fits its registers;
// this is the path beyond that width.
template <int N>
__device__ void layernorm_backward_params_impl(float* partial_dw, float* partial_db, const floatX* dout,
                                               const floatX* inp, const float* mean, const float* rstd,
                                               long long rows, int C, int rows_per_split) {
    __shared__ __align__(sizeof(Vec<float, N>)) float tile_dw[COL_ROWS * WARP_SIZE * N];
    __shared__ __align__(sizeof(Vec<float, N>)) float tile_db[COL_ROWS * WARP_SIZE * N];
    const int c = (blockIdx.x * WARP_SIZE + threadIdx.x) * N;
    const bool valid = c < C;
    const long long r0 = (long long)blockIdx.y * rows_per_split;
    const long long r1 = min(rows, r0 + rows_per_split);
    float dw[N], db[N];
#pragma unroll
    for (int k = 0; k < N; ++k) dw[k] = db[k] = 0.0f;
    if (valid) {
        for (long long r = r0 + threadIdx.y; r < r1; r += COL_ROWS) {
            const Vec<floatX, N> dv = load_vec<N>(dout + r * C + c);
            const Vec<floatX, N> xv = load_vec<N>(inp + r * C + c);
            const float m = mean[r], rs = rstd[r];
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float d = to_float(dv[k]);
                db[k] += d;
                dw[k] += d * ((to_float(xv[k]) - m) * rs);
            }
        }
    }
    column_tile_store<N>(tile_dw, dw, partial_dw + (long long)blockIdx.y * C, c, valid);
    column_tile_store<N>(tile_db, db, partial_db + (long long)blockIdx.y * C, c, valid);
}

extern "C" __global__ void layernorm_backward_params(float* partial_dw, float* partial_db, const floatX* dout,
                                                     const floatX* inp, const float* mean, const float* rstd,
                                                     long long rows, int C, int rows_per_split, int vec) {
    if (vec) layernorm_backward_params_impl<VEC_X>(partial_dw, partial_db, dout, inp, mean, rstd, rows, C,
                                                   rows_per_split);
    else layernorm_backward_params_impl<1>(partial_dw, partial_db, dout, inp, mean, rstd, rows, C,
                                           rows_per_split);
}

// Stage 2: dweight[c] += sum_s partial_dw[s, c] (blockIdx.y == 0) and dbias likewise (blockIdx.y == 1).
extern "C" __global__ void layernorm_backward_params_finish(float* dweight, const float* partial_dw, float* dbias,
                                                            const float* partial_db, int splits, int C) {
    if (blockIdx.y == 0) column_sums_finish_one(dweight, partial_dw, splits, C);
    else column_sums_finish_one(dbias, partial_db, splits, C);
}
