// dtype.h: scalar conversions between the arena's storage types and float32 on the CPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "../kernels.h"

namespace conduit::kernels::cpu {

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

inline float f16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13); // inf or nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign; // signed zero
    } else {
        // subnormal: normalise
        exp = 113;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even with overflow to inf and gradual underflow, as torch's half() does.
inline uint16_t float_to_f16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    const uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // nan
    if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (abs < 0x38800000u) {                                   // below the smallest normal half
        if (abs < 0x33000000u) return sign;                    // below half the smallest subnormal
        const uint32_t exp = abs >> 23;
        const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - exp;                      // 14 + (113 - exp) - 1 ... bring to 10 bits
        uint32_t half_mant = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1);
        const uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
        return uint16_t(sign | half_mant);
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

inline float load(const void *base, int64_t i, DType t) {
    switch (t) {
    case DType::F32: return static_cast<const float *>(base)[i];
    case DType::F16: return f16_to_float(static_cast<const uint16_t *>(base)[i]);
    default: return bf16_to_float(static_cast<const uint16_t *>(base)[i]);
    }
}

inline void store(void *base, int64_t i, float x, DType t) {
    switch (t) {
    case DType::F32: static_cast<float *>(base)[i] = x; break;
    case DType::F16: static_cast<uint16_t *>(base)[i] = float_to_f16(x); break;
    default: static_cast<uint16_t *>(base)[i] = float_to_bf16(x); break;
    }
}

// Element offset of (slot, head) of K in the pool; V is at + n_kv_heads * block_size * head_dim.
inline int64_t k_offset(const LayerView &v, int32_t slot, int32_t head) {
    const int64_t block = v.block_table[slot / v.block_size];
    const int32_t t = slot % v.block_size;
    return block * v.block_elems() + (int64_t(head) * v.block_size + t) * v.head_dim;
}

inline int64_t v_delta(const LayerView &v) { return int64_t(v.n_kv_heads) * v.block_size * v.head_dim; }

inline int32_t slot_at(Slots s, int32_t i) { return s.slots ? s.slots[i] : s.base + i; }

} // namespace conduit::kernels::cpu
