// bfloat16 <-> float32 for one value, as torch converts: the top 16 bits of a float32, rounded
// to nearest even, NaN kept NaN. Shared by the norm (rms_norm.cpp) and the SIMD kernels (simd.h),
// so that both round alike.
#pragma once

#include <cstdint>
#include <cstring>

inline float bf16_to_float(uint16_t bits) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return f != f ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
