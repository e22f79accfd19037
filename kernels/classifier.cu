// classifier.cu: softmax + cross-entropy over the vocabulary, fused with its backward.
// Oracles: numpy_ops.fused_classifier (training), numpy_ops.crossentropy_forward (evaluation).
//
// One block per (b, t) row of logits (V is 4096 to 50257: 16 to 200 KB per row). Pass 1 folds each
// thread's share of the row into a running softmax state (max, sum of exp(x - max)), one exp per
// element, and merges the states over the block, so max and sum take one read of the row instead of
// two. Pass 2 (training only) reads the row again and overwrites it with dlogits. A row holds Vp
// logits, the model's padded vocabulary (50257 -> 50304, as llm.c pads it, model.py): the softmax reads
// the first V, which are tokens, and pass 2 writes dlogits 0 to the padded V..Vp-1, so wte's padded rows
// get exactly zero gradient from the product after this kernel. Rows start ld >= Vp elements apart (a
// strided view works too), and are read with 16-byte loads whatever their alignment (block_row_read in
// common.cuh).
#include "common.cuh"

// Threads of a row's block (the host reads it from here): 25 vectors per thread at V = 50257.
constexpr int CLASSIFIER_BLOCK = 512;
// block_softmax_merge parks a state per warp in a scratch of WARP_SIZE states
static_assert(CLASSIFIER_BLOCK % WARP_SIZE == 0 && CLASSIFIER_BLOCK <= WARP_SIZE * WARP_SIZE,
              "CLASSIFIER_BLOCK: whole warps, at most WARP_SIZE of them");

// losses[r] = log(sum_j exp(x_j - max)) - (x_target - max), and the row becomes
// dlogits = softmax(x) * dloss - dloss * onehot(target) over the first V, 0 over V..Vp-1
// (numpy_ops.fused_classifier). A target outside [0, V) gives a NaN loss (numpy would raise IndexError)
// and no onehot term.
extern "C" __global__ void fused_classifier(floatX* logits, float* losses, const int* targets, int V, int Vp,
                                            long long ld, float dloss) {
    __shared__ SoftmaxState scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    floatX* x = logits + row * ld;
    const int target = targets[row];
    const bool valid = 0 <= target && target < V;
    // read before the merge: its __syncthreads orders this read before pass 2 overwrites x[target]
    const float x_target = (threadIdx.x == 0 && valid) ? to_float(x[target]) : 0.0f;

    SoftmaxState st = softmax_init();
    block_row_read(x, V, [&](int, float v) { softmax_add(st, v); });
    st = block_softmax_merge(st, scratch);

    if (threadIdx.x == 0) losses[row] = valid ? logf(st.sum) - (x_target - st.max) : quiet_nan();

    const float scale = dloss / st.sum;  // numpy: probabilities * (d / total), then -= d at the target
    block_row_update(x, Vp, [&](int j, float v) {
        const float p = expf(v - st.max) * scale;
        return j >= V ? 0.0f : j == target ? p - dloss : p;
    });
}

// losses[r] = log(sum_j exp(x_j - max)) + max - x_target, logits unchanged
// (numpy_ops.crossentropy_forward). Pass 1 of the kernel above, nothing written to the row; the padded
// columns past V are not read.
extern "C" __global__ void crossentropy_forward(float* losses, const floatX* logits, const int* targets, int V,
                                                long long ld) {
    __shared__ SoftmaxState scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    const floatX* x = logits + row * ld;
    const int target = targets[row];
    const bool valid = 0 <= target && target < V;

    SoftmaxState st = softmax_init();
    block_row_read(x, V, [&](int, float v) { softmax_add(st, v); });
    st = block_softmax_merge(st, scratch);

    if (threadIdx.x == 0) losses[row] = valid ? (logf(st.sum) + st.max) - to_float(x[target]) : quiet_nan();
}

// ---------------------------------------------------------------------------------------- vocabulary-parallel
// --tp-classifier vocab: a rank holds the logit columns col0 .. col0 + Vs - 1 of the padded vocabulary (its
// shard of wte, model.py), of which the first n are tokens' (n = max(0, min(Vs, V - col0)), the host's; 0 on
// a shard of padded columns only). The softmax over the whole vocabulary comes from three steps with the
// group's collectives between them (model.py): vocab_max (all-gathered, the largest taken), vocab_sums
// (all-reduced), vocab_classifier. Like the kernels above, one block of CLASSIFIER_BLOCK threads per (b, t)
// row, rows ld >= Vs elements apart; maxes, sums and losses are float32 in every precision.

// maxes[r] = the largest of the row's n token logits, -inf if n is 0 (numpy_ops.vocab_max). A maximum has no
// rounding: the same bits as numpy's whatever the order.
extern "C" __global__ void vocab_max(float* maxes, const floatX* logits, int n, long long ld) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    float m = neg_inf();
    block_row_read(logits + row * ld, n, [&](int, float v) { m = fmaxf(m, v); });
    m = block_reduce(m, scratch, neg_inf(), [](float v) { return warp_max(v); });
    if (threadIdx.x == 0) maxes[row] = m;
}

// sums[0][r] = sum over the row's n token logits of exp(x - maxes[r]); sums[1][r] = x[target - col0] -
// maxes[r] where the shard holds the target's column (0 <= target - col0 < n), else 0
// (numpy_ops.vocab_sums; `rows` rows, sums[1] starts `rows` floats after sums[0]). Each thread adds its
// share of the row, then the block's fixed tree (block_sum): the same bits every run, numpy's sum to
// rounding (numpy adds pairwise). The target's term is one subtraction, numpy's bits.
extern "C" __global__ void vocab_sums(float* sums, const floatX* logits, const int* targets, const float* maxes,
                                      int n, int col0, long long rows, long long ld) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    const floatX* x = logits + row * ld;
    const float m = maxes[row];
    float s = 0.0f;
    block_row_read(x, n, [&](int, float v) { s += expf(v - m); });
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) {
        const long long local = (long long)targets[row] - col0;
        sums[row] = s;
        sums[rows + row] = (0 <= local && local < n) ? to_float(x[local]) - m : 0.0f;
    }
}

// losses[r] = log(sums[0][r]) - sums[1][r], from the group's summed vocab_sums (numpy_ops.vocab_classifier).
// With `train`, the row (Vs wide) becomes the shard's dlogits: exp(x - maxes[r]) * (dloss / sums[0][r]) over
// the n token columns, minus dloss at the target's column where the shard holds it, 0 over the padded
// columns: numpy's operations in numpy's order (exp, times the scale, minus dloss). Each element is read and
// written by one thread only, so no synchronisation is needed.
extern "C" __global__ void vocab_classifier(float* losses, floatX* logits, const int* targets,
                                            const float* maxes, const float* sums, float dloss, int n, int Vs,
                                            int col0, long long rows, long long ld, int train) {
    const long long row = blockIdx.x;
    const float total = sums[row];
    if (threadIdx.x == 0) losses[row] = logf(total) - sums[rows + row];
    if (!train) return;
    const float m = maxes[row];
    const float scale = dloss / total;
    const long long local = (long long)targets[row] - col0;
    block_row_update(logits + row * ld, Vs, [&](int j, float v) {
        const float p = expf(v - m) * scale;
        return j >= n ? 0.0f : j == local ? p - dloss : p;
    });
}
