// common.cuh: the types and building blocks every kernel file shares.
//
// How these sources are compiled. backend/cuda/compile.py reads kernels/<op>.cu, pastes this header in
// place of its #include line (so that CuPy's on-disk cache, which hashes the source text, sees a change
// here), and compiles it with NVRTC through cupy.RawModule. tests/test_kernels_compile.py compiles the
// same files with nvcc, both with and without -DXTRAIN_BF16. Nothing here may include a host header:
// NVRTC has none. The host reads a kernel's launch geometry from the `constexpr int` constants beside
// it (compile.py's kernel_constant), so a block size lives in one place: where the kernel is.
//
// Precision. Activations, activation gradients and the copy of the weights that forward reads are
// `floatX`; parameter gradients, master weights, optimizer state, layernorm statistics, attention
// scores and losses are always float, and all arithmetic is float. The backend loads the variant the run
// asks for (--dtype): floatX = float, or with -DXTRAIN_BF16 floatX = __nv_bfloat16. The kernels read
// through to_float and write through from_float (round to nearest even) so both variants are the same
// code; every from_float<floatX> is a rounding that numpy_ops' bf16 emulation makes too (its store()).
//
// Determinism. No kernel here adds floats with atomics. Reductions across threads are fixed trees
// (xor butterflies inside a warp, then a fixed walk over the warps) and reductions across blocks are
// two kernels: per-block partials in a scratch buffer, then one pass that adds them in index order.
// Grid shapes that affect summation order are functions of the tensor shapes only, never of the
// device, so the same inputs give the same bits on every run and every GPU of the same model.
#pragma once

#if defined(XTRAIN_BF16)
#include <cuda_bf16.h>
typedef __nv_bfloat16 floatX;
#else
typedef float floatX;
#endif

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

// Elements of T in one 16-byte access: the widest load a thread issues (LDG.128). 4 floats, 8 bf16s.
template <typename T>
constexpr int VEC_OF = 16 / (int)sizeof(T);
constexpr int VEC_X = VEC_OF<floatX>;
constexpr int VEC_F = VEC_OF<float>;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// ------------------------------------------------------------------------------------ conversions

__device__ __forceinline__ float to_float(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
#if defined(XTRAIN_BF16)
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
#endif

// ------------------------------------------------------------------------------------ vectors

// N consecutive elements moved as one access. alignas makes the compiler emit a single 16-byte
// load/store for Vec<float, 4> and Vec<bf16, 8> (two for Vec<float, 8>), and a plain scalar access
// for N = 1, so a kernel written once over Vec<T, N> serves both its vector and its scalar variant.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
    __device__ __forceinline__ T& operator[](int i) { return v[i]; }
    __device__ __forceinline__ const T& operator[](int i) const { return v[i]; }
};

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& x) {
    *reinterpret_cast<Vec<T, N>*>(p) = x;
}

template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// ------------------------------------------------------------------------------------ reductions

// Butterfly (xor) reductions: IEEE addition and fmaxf are commutative bit for bit, so every lane
// ends with the same bits, and the tree is fixed, so the result does not vary from run to run.
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(FULL_MASK, x, offset);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, offset));
    return x;
}

// A warp reduction over a 1-D block whose size is a multiple of 32 (at most 1024): every warp reduces,
// lane 0 of each parks its result in `scratch` (32 T in shared memory), and each warp reduces those again
// (`identity` past the last warp). Every thread gets the result. The leading __syncthreads lets a caller
// reuse `scratch` for consecutive reductions.
template <typename T, typename WarpReduce>
__device__ T block_reduce(T x, T* scratch, T identity, WarpReduce warp_reduce) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    x = warp_reduce(x);
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : identity;
    return warp_reduce(x);
}

template <typename T>
__device__ T block_sum(T x, T* scratch) {
    return block_reduce(x, scratch, T(0), [](T v) { return warp_sum(v); });
}

// A running softmax denominator: sum of exp(x - max) over the values seen, with the max seen.
// Merging two is exact up to rounding, so each thread folds its own elements in one pass and the
// partial states are combined by a tree, which is how the classifier reads logits only once before
// writing the gradient.
struct SoftmaxState {
    float max;
    float sum;
};

__device__ __forceinline__ SoftmaxState softmax_init() { return {neg_inf(), 0.0f}; }

__device__ __forceinline__ void softmax_add(SoftmaxState& s, float x) {
    // one exp per element: rescale the sum only when the max moves
    if (x > s.max) {
        s.sum = s.sum * expf(s.max - x) + 1.0f;
        s.max = x;
    } else {
        s.sum += expf(x - s.max);
    }
}

// Not symmetric bit for bit: the compiler contracts a.sum * ea + b.sum * eb into one fma, which rounds
// differently with a and b swapped. warp_softmax_merge therefore hands every lane lane 0's result.
__device__ __forceinline__ SoftmaxState softmax_merge(SoftmaxState a, SoftmaxState b) {
    const float m = fmaxf(a.max, b.max);
    if (m == neg_inf()) return {m, 0.0f};  // both empty: avoid exp(-inf - -inf) = NaN
    return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ SoftmaxState warp_softmax_merge(SoftmaxState s) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        SoftmaxState o = {__shfl_xor_sync(FULL_MASK, s.max, offset), __shfl_xor_sync(FULL_MASK, s.sum, offset)};
        s = softmax_merge(s, o);
    }
    // the lanes of a butterfly can end 1 ulp apart (see softmax_merge): one row, one normaliser
    return {__shfl_sync(FULL_MASK, s.max, 0), __shfl_sync(FULL_MASK, s.sum, 0)};
}

// Block-wide merge (block_reduce); `scratch` holds 32 states.
__device__ SoftmaxState block_softmax_merge(SoftmaxState s, SoftmaxState* scratch) {
    return block_reduce(s, scratch, softmax_init(), [](SoftmaxState v) { return warp_softmax_merge(v); });
}

// ------------------------------------------------------------------------------------ row visits

// Visit the n elements of one row with all threads of a block, reading 16 bytes at a time even when
// the row does not start on a 16-byte boundary (a vocabulary of 50257 makes every logits row start
// somewhere else): a scalar head up to the first boundary, aligned vectors, then a scalar tail.
// f(j, x) gets each element once; which thread sees which element depends only on n and the row's
// alignment, so per-thread partial results are reproducible.
template <typename T, typename F>
__device__ __forceinline__ void block_row_read(const T* row, int n, F&& f) {
    constexpr int N = VEC_OF<T>;
    const int off = (int)((reinterpret_cast<unsigned long long>(row) / sizeof(T)) % N);
    const int head = min(off ? N - off : 0, n);
    const int n_vec = (n - head) / N;
    const int tail = head + n_vec * N;
    for (int j = threadIdx.x; j < head; j += blockDim.x) f(j, to_float(row[j]));
#pragma unroll 4
    for (int k = threadIdx.x; k < n_vec; k += blockDim.x) {
        const int j0 = head + k * N;
        const Vec<T, N> v = load_vec<N>(row + j0);
#pragma unroll
        for (int i = 0; i < N; ++i) f(j0 + i, to_float(v[i]));
    }
    for (int j = tail + threadIdx.x; j < n; j += blockDim.x) f(j, to_float(row[j]));
}

// The same walk, replacing each element by f(j, x).
template <typename T, typename F>
__device__ __forceinline__ void block_row_update(T* row, int n, F&& f) {
    constexpr int N = VEC_OF<T>;
    const int off = (int)((reinterpret_cast<unsigned long long>(row) / sizeof(T)) % N);
    const int head = min(off ? N - off : 0, n);
    const int n_vec = (n - head) / N;
    const int tail = head + n_vec * N;
    for (int j = threadIdx.x; j < head; j += blockDim.x) row[j] = from_float<T>(f(j, to_float(row[j])));
#pragma unroll 4
    for (int k = threadIdx.x; k < n_vec; k += blockDim.x) {
        const int j0 = head + k * N;
        Vec<T, N> v = load_vec<N>(row + j0);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = from_float<T>(f(j0 + i, to_float(v[i])));
        store_vec<N>(row + j0, v);
    }
    for (int j = tail + threadIdx.x; j < n; j += blockDim.x) row[j] = from_float<T>(f(j, to_float(row[j])));
}

// ------------------------------------------------------------------------------------ column sums

// Deterministic column sums of a (rows, n) matrix happen in two launches (bias gradients, layernorm
// weight and bias gradients). Stage 1, per op: block (WARP_SIZE, COL_ROWS) covers 32*N columns and one
// contiguous split of the rows; thread (x, y) adds rows y, y + COL_ROWS, ... of its split for its N
// columns, then the COL_ROWS row lanes are added in order y = 0, 1, ... and written to
// partial[split, column]. Stage 2, below: one thread per column adds the splits in order.
// Compared with one kernel that atomically adds into the gradient this costs a small extra pass
// over partial (splits x n floats) and gives the same bits every run.
// The host launches stage 1 with blocks of (WARP_SIZE, COL_ROWS) threads, reading both from here.
constexpr int COL_ROWS = 8;

// Adds the COL_ROWS per-row-lane partials of a stage-1 block in a fixed order and stores them.
// tile is shared memory of COL_ROWS * 32 * N floats aligned like Vec<float, N> (32 bytes when N = 8, the
// bf16 width); `valid` is whether this thread's columns exist.
template <int N>
__device__ __forceinline__ void column_tile_store(float* tile, const float (&acc)[N], float* partial_row,
                                                  int col, bool valid) {
    Vec<float, N> mine;
#pragma unroll
    for (int i = 0; i < N; ++i) mine[i] = acc[i];
    store_vec<N>(tile + (threadIdx.y * WARP_SIZE + threadIdx.x) * N, mine);
    __syncthreads();
    if (threadIdx.y == 0 && valid) {
        Vec<float, N> total = load_vec<N>(tile + threadIdx.x * N);
        for (int y = 1; y < COL_ROWS; ++y) {
            const Vec<float, N> more = load_vec<N>(tile + (y * WARP_SIZE + threadIdx.x) * N);
#pragma unroll
            for (int i = 0; i < N; ++i) total[i] += more[i];
        }
#pragma unroll
        for (int i = 0; i < N; ++i) partial_row[col + i] = total[i];
    }
}

// Stage 2: dst[c] += sum over s of partial[s, c], s in increasing order. One thread per column.
__device__ __forceinline__ void column_sums_finish_one(float* dst, const float* partial, int splits, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) total += partial[(long long)s * n + c];
    dst[c] += total;
}

// ------------------------------------------------------------------------------------ elementwise

// The elementwise kernels give each thread one chunk of N consecutive elements (N = 16 bytes' worth
// when the host found every pointer 16-byte aligned, else 1); the last chunk may be short and is
// done one element at a time. The host sizes the grid as ceil(n / N) threads.
template <int N>
__device__ __forceinline__ long long chunk_start() {
    return ((long long)blockIdx.x * blockDim.x + threadIdx.x) * N;
}
