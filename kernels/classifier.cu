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
