// ptx.cuh: the few PTX instructions flash_attention_mma.cu needs that CUDA C++ has no function for:
// the tensor cores' mma.sync, ldmatrix (shared memory to fragments) and cp.async (global to shared
// memory without passing through registers). sm_80 and later.
//
// Fragments. A warp of 32 lanes holds a matrix tile spread over its registers; lane l is in group
// g = l / 4 (0..7) at position t = l % 4 (0..3). A register of a bf16 operand holds two elements, the
// lower-numbered column (or row, said where) in its low 16 bits. For m16n8k16 (PTX ISA, "Matrix
// Fragments for mma.m16n8k16"):
//   A (16 x 16, row-major), 4 registers: a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//                                        a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, k by n), 2 registers:     b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]  (two rows k, one column)
//   C and D (16 x 8, float), 4 values:   c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]
// So an accumulator's two 16 x 8 halves of a 16 x 16 tile, rounded to bf16 and packed in pairs, are an A
// fragment: how P and dS go from one product into the next without leaving registers.
//
// On the CPU simulator (tests/cudasim, which defines XTRAIN_CUDASIM) each function is the C++ of
// tests/cudasim/include/cudasim_ptx.h: the same fragments, gathered across the warp.
#pragma once

#if defined(XTRAIN_CUDASIM)
#include <cudasim_ptx.h>
#else

// D = A B + C on tensor cores, m16n8k16: bf16 products (exact in float), float accumulation. d may be c.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                               const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 bf16 matrices from shared memory. Lanes 8i..8i+7 give the addresses of matrix i's rows 0..7
// (16 bytes each, 16-byte aligned); then r[i] of lane l = matrix i's row g, columns 2t, 2t+1. That is an A
// fragment when the four matrices are a 16 x 16 tile's quarters in the order (rows 0-7, cols 0-7),
// (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15), and B fragments of two n8
// tiles when they are an n x k row-major tile's (n is the row: K for Q K^T, Q for K Q^T).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

// The same four matrices transposed: r[i] of lane l = matrix i's rows 2t and 2t+1 (low, high) of column g.
// B fragments of a k x n row-major tile (k is the row: V for P V, dO and Q for the backward's products).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

// 16 bytes from global memory (16-byte aligned) to shared memory, asynchronously: the copy belongs to the
// next cp_async_commit's group and is there once a cp_async_wait covers that group. `valid` false writes
// 16 zero bytes and reads nothing (rows past the sequence's end).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// Closes a group of this thread's cp.async copies (those issued since the last commit).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight (N = 0: all of them). Other
// threads' copies are theirs to wait for: a __syncthreads after the wait makes a whole tile visible.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// Two floats rounded to bf16 (to nearest even) in one register: lo in the low half, as fragments hold
// them. One cvt.rn.bf16x2.f32.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x = lo, the low half
    return *reinterpret_cast<const unsigned*>(&pair);
}

#endif  // XTRAIN_CUDASIM
