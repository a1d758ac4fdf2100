// rope.cuh: rotate-half RoPE as every CUDA kernel that stores K applies it (the K/V copies of
// kv_copy.cu, the decode attention that writes the step's new row): one definition, so that a K row
// has the same bits whichever kernel rotated it. Explicit _rn operations keep nvcc from fusing them,
// so that float32 results match torch's separate multiplies and adds.
#pragma once

#include "common.cuh"

namespace conduit::kernels::cuda {

// The rope_pos that a K writer applies: null without RoPE (type 0), else rope_pos after checking
// that `rope` can rotate heads of head_dim elements (throws std::invalid_argument, common.cuh).
inline const int32_t *checked_rope_pos(const Rope &rope, const int32_t *rope_pos, int32_t head_dim) {
    if (rope.type == 0 || !rope_pos) return nullptr;
    require(rope.inv_freq != nullptr && rope.n_freq >= 1 && 2 * rope.n_freq <= head_dim,
            "RoPE needs inv_freq and 1 <= n_freq <= head_dim / 2");
    require(rope.type == 1 || rope.type == 2, "unknown RoPE type");
    return rope_pos;
}

// cos and sin, times the scaling, of frequency `freq` at the RoPE position of `token` (rope_pos
// int32 [n] for NEOX, [3, n] for MROPE: the frequency's section picks the row).
__device__ __forceinline__ void rope_cos_sin(const Rope &rope, const int32_t *rope_pos, int32_t n, int32_t token,
                                             int32_t freq, float &c, float &s) {
    int32_t pos_row = 0;
    if (rope.type == 2)
        pos_row = freq < rope.sections[0] ? 0 : (freq < rope.sections[0] + rope.sections[1] ? 1 : 2);
    const float angle = __fmul_rn(float(rope_pos[int64_t(pos_row) * n + token]), rope.inv_freq[freq]);
    c = __fmul_rn(cosf(angle), rope.scaling);
    s = __fmul_rn(sinf(angle), rope.scaling);
}

// The rotated pair (x[i], x[i + n_freq]) of a head (transformers' rotate-half: out[i] = x[i] c -
// x[i+n] s, out[i+n] = x[i+n] c + x[i] s).
__device__ __forceinline__ float rotated_low(float low, float high, float c, float s) {
    return __fsub_rn(__fmul_rn(low, c), __fmul_rn(high, s));
}
__device__ __forceinline__ float rotated_high(float low, float high, float c, float s) {
    return __fadd_rn(__fmul_rn(high, c), __fmul_rn(low, s));
}

} // namespace conduit::kernels::cuda
