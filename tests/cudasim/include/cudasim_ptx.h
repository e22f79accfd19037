// cudasim_ptx.h: kernels/ptx.cuh's instructions for the CPU (see ../cudasim.h), included by ptx.cuh in
// place of its asm statements when XTRAIN_CUDASIM is defined.
//
// mma.sync and ldmatrix are warp-wide: every lane parks what it holds (its fragment registers, its row
// address), they meet (cudasim::gather, a warp barrier of all 32 lanes, as .aligned requires), and each
// lane computes its own registers from the gathered ones by the fragment layouts ptx.cuh states. So a
// fragment is spread over lanes exactly as on the GPU, and code that misplaces an element gets it wrong
// here too. The product adds its 16 terms in k order in float after the bf16 products (exact): a tensor
// core's order differs within float32 noise.
//
// cp.async is deferred: the copy is recorded and made only when a cp.async.wait_group covers its commit
// group, and until then its destination holds 0xFF bytes (NaN). So a kernel that reads a tile before
// waiting for it reads NaN, not the tile, and so does one whose copy overwrites a buffer that another
// warp is still reading (a missing __syncthreads before the copy: the scheduler runs one warp ahead). A
// copy issued and never waited for is an error when the thread exits.
#pragma once
#include <array>
#include <cstring>

#include "cuda_bf16.h"

namespace cudasim_ptx {

inline float bf16_at(unsigned reg, int half) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(half ? reg >> 16 : reg & 0xffffu)));
}

inline void check_shared_row(const char* call, const void* p) {
    const char* c = static_cast<const char*>(p);
    if (__start_cudasim_shared == nullptr || c < __start_cudasim_shared || c + 16 > __stop_cudasim_shared)
        cudasim::fail(cudasim::thread_name(threadIdx) + ": " + call + " row address is not in shared memory");
    if (reinterpret_cast<unsigned long long>(p) % 16 != 0)
        cudasim::fail(cudasim::thread_name(threadIdx) + ": " + call + " row address is not 16-byte aligned");
}

// The 8 x 8 matrices' rows as ldmatrix reads them: lane 8i + r gives matrix i's row r.
inline std::array<const void*, 32> row_addresses(const char* call, const void* row) {
    check_shared_row(call, row);
    return cudasim::gather(row);
}

inline unsigned element_pair(const void* row, int column) {  // two bf16 at row[column], row[column + 1]
    unsigned v;
    std::memcpy(&v, static_cast<const unsigned short*>(row) + column, 4);
    return v;
}

inline unsigned short element(const void* row, int column) {
    unsigned short v;
    std::memcpy(&v, static_cast<const unsigned short*>(row) + column, 2);
    return v;
}

}  // namespace cudasim_ptx

inline void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    struct Fragments { unsigned a[4], b[2]; };
    Fragments mine;
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    const cudasim::Slots slots = cudasim::gather_slots(mine);
    const int lane = cudasim::linear_thread() % 32, g = lane / 4, t = lane % 4;
    // A[r][k] is in lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2;
    // B[k][n] in lane n * 4 + (k % 8) / 2, register k >= 8, half k % 2.
    // This lane's d holds rows g and g + 8 of columns 2t and 2t + 1: the two rows of A and two columns of B,
    // each from the 4 lanes q of its group of 4, k = 2q + half below 8 and 8 + 2q + half above.
    float rows[2][16], columns[2][16];
    for (int q = 0; q < 4; ++q) {
        Fragments row, column[2];
        std::memcpy(&row, slots[g * 4 + q], sizeof row);
        std::memcpy(&column[0], slots[2 * t * 4 + q], sizeof column[0]);
        std::memcpy(&column[1], slots[(2 * t + 1) * 4 + q], sizeof column[1]);
        for (int half = 0; half < 2; ++half) {
            const int k = 2 * q + half;
            for (int i = 0; i < 2; ++i) {
                rows[i][k] = cudasim_ptx::bf16_at(row.a[i], half);
                rows[i][8 + k] = cudasim_ptx::bf16_at(row.a[i + 2], half);
                columns[i][k] = cudasim_ptx::bf16_at(column[i].b[0], half);
                columns[i][8 + k] = cudasim_ptx::bf16_at(column[i].b[1], half);
            }
        }
    }
    for (int e = 0; e < 4; ++e) {  // e: row g + 8 (e / 2), column 2t + e % 2
        float acc = c[e];
        for (int k = 0; k < 16; ++k) acc += rows[e / 2][k] * columns[e % 2][k];
        d[e] = acc;
    }
}

inline void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    const std::array<const void*, 32> rows = cudasim_ptx::row_addresses("ldmatrix", row);
    const int lane = cudasim::linear_thread() % 32, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) r[i] = cudasim_ptx::element_pair(rows[8 * i + g], 2 * t);
}

inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    const std::array<const void*, 32> rows = cudasim_ptx::row_addresses("ldmatrix.trans", row);
    const int lane = cudasim::linear_thread() % 32, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i)
        r[i] = (unsigned)cudasim_ptx::element(rows[8 * i + 2 * t], g) |
               ((unsigned)cudasim_ptx::element(rows[8 * i + 2 * t + 1], g) << 16);
}

inline void cp_async_16(void* dst, const void* src, bool valid) {
    cudasim_ptx::check_shared_row("cp.async", dst);
    if (valid && reinterpret_cast<unsigned long long>(src) % 16 != 0)
        cudasim::fail(cudasim::thread_name(threadIdx) + ": cp.async source is not 16-byte aligned");
    cudasim::Fiber& f = cudasim::launch_state().fibers[cudasim::linear_thread()];
    f.async_copies.push_back({dst, src, 16, valid ? 16 : 0, f.async_groups});
    // In flight, the destination holds neither the old bytes nor the new ones for sure: poisoned (NaN)
    // until the wait, so that another warp still reading the buffer's previous tile reads NaN too.
    std::memset(dst, 0xFF, 16);
}

inline void cp_async_commit() { cudasim::launch_state().fibers[cudasim::linear_thread()].async_groups++; }

// The copies of every committed group but the newest N land now, in the order they were issued.
template <int N>
inline void cp_async_wait() {
    cudasim::Fiber& f = cudasim::launch_state().fibers[cudasim::linear_thread()];
    std::vector<cudasim::AsyncCopy> pending;
    for (const cudasim::AsyncCopy& c : f.async_copies) {
        if (c.group + N < f.async_groups) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
        } else {
            pending.push_back(c);
        }
    }
    f.async_copies.swap(pending);
}

// Two floats rounded to bf16 (to nearest even) in one register, lo in the low half (cvt.rn.bf16x2.f32).
inline unsigned pack_bf16(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
