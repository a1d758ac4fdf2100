// dtype.h: scalar conversions between the arena's storage types and float32 on the CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// e4m3 (no infinities; 0x7f is NaN; largest finite 448) to float32: exact.
inline float e4m3_to_float(uint8_t b) {
    const float sign = (b & 0x80u) ? -1.0f : 1.0f;
    const int32_t exp = (b >> 3) & 0xf, mant = b & 0x7;
    if ((b & 0x7fu) == 0x7fu) return std::nanf("");
    if (exp == 0) return sign * std::ldexp(float(mant), -9); // subnormal: mant * 2^-9
    return sign * std::ldexp(float(8 + mant), exp - 10);      // (1 + mant / 8) * 2^(exp - 7)
}

// float32 to e4m3, round to nearest even, saturating at +-448 (as CUDA's __NV_SATFINITE); NaN to 0x7f.
inline uint8_t float_to_e4m3(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint8_t(sign | 0x7fu);
    const float a = std::fabs(f);
    if (a >= kFp8Max) return uint8_t(sign | 0x7eu);
    if (a < 0.015625f) return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f))); // below 2^-6: 2^-9 steps
    uint32_t abits;
    std::memcpy(&abits, &a, 4);
    int32_t exp = int32_t(abits >> 23) - 127;    // in [-6, 8]
    uint32_t keep = (abits >> 20) & 0x7u;        // the top 3 mantissa bits
    const uint32_t rest = abits & 0xfffffu, half = 0x80000u;
    if (rest > half || (rest == half && (keep & 1u))) ++keep;
    if (keep == 8) {
        keep = 0;
        ++exp;
    }
    const uint32_t out = (uint32_t(exp + 7) << 3) | keep;
    return uint8_t(sign | (out > 0x7eu ? 0x7eu : out));
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

// An fp8 pool's rows (the layout in kernels.h): the bytes of (slot, head) of K (of V with `value`)
// and their scale.
inline uint8_t *fp8_row(const LayerView &v, int32_t slot, int32_t head, bool value) {
    const int64_t block = v.block_table[slot / v.block_size];
    const int64_t row = int64_t(head) * v.block_size + slot % v.block_size;
    const int64_t rows = int64_t(v.n_kv_heads) * v.block_size;
    return static_cast<uint8_t *>(v.pool) + block * v.block_bytes() + (row + (value ? rows : 0)) * v.head_dim;
}
inline float *fp8_scale(const LayerView &v, int32_t slot, int32_t head, bool value) {
    const int64_t block = v.block_table[slot / v.block_size];
    const int64_t row = int64_t(head) * v.block_size + slot % v.block_size;
    const int64_t rows = int64_t(v.n_kv_heads) * v.block_size;
    char *scales = static_cast<char *>(v.pool) + block * v.block_bytes() + v.block_elems();
    return reinterpret_cast<float *>(scales) + row + (value ? rows : 0);
}

// One fp8 row from float32 x [head_dim] (scale by fp8_row_scale) / back to float32.
inline void quantize_fp8_row(const LayerView &v, int32_t slot, int32_t head, bool value, const float *x) {
    float amax = 0.0f;
    for (int32_t e = 0; e < v.head_dim; ++e) amax = std::fabs(x[e]) > amax || x[e] != x[e] ? std::fabs(x[e]) : amax;
    const float scale = fp8_row_scale(amax);
    uint8_t *bytes = fp8_row(v, slot, head, value);
    for (int32_t e = 0; e < v.head_dim; ++e) bytes[e] = float_to_e4m3(x[e] / scale);
    *fp8_scale(v, slot, head, value) = scale;
}
inline void dequantize_fp8_row(const LayerView &v, int32_t slot, int32_t head, bool value, float *x) {
    const uint8_t *bytes = fp8_row(v, slot, head, value);
    const float scale = *fp8_scale(v, slot, head, value);
    for (int32_t e = 0; e < v.head_dim; ++e) x[e] = e4m3_to_float(bytes[e]) * scale;
}

inline int64_t v_delta(const LayerView &v) { return int64_t(v.n_kv_heads) * v.block_size * v.head_dim; }

// An fp8 layer dequantized into a pool of its dense dtype (its blocks in slot order), for the
// kernels that read K and V many times over: they then run as on a dense layer.
class DenseStaging {
  public:
    // The staged copy of kv (kv itself when it is not fp8); valid while this object lives.
    const LayerView &of(const LayerView &kv);

  private:
    std::vector<unsigned char> pool_;
    std::vector<int32_t> table_;
    LayerView view_;
};

inline int32_t slot_at(Slots s, int32_t i) { return s.slots ? s.slots[i] : s.base + i; }

} // namespace conduit::kernels::cpu
