// cudasim's cuda_bf16.h: the part of CUDA's header that kernels/*.cu use, for the CPU (see ../cudasim.h).
// __nv_bfloat16 holds the 16 bits; conversions round to nearest even as __float2bfloat16_rn does.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    unsigned short bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
    const unsigned u = (unsigned)h.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40u)};  // NaN stays NaN (quiet)
    u += 0x7fffu + ((u >> 16) & 1u);
    return {(unsigned short)(u >> 16)};
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }
