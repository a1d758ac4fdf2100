// kv_copy.cpp: moving K and V between dense tensors and paged blocks on the CPU, with RoPE.
#include <cmath>
#include <vector>

#include "dtype.h"

namespace conduit::kernels::cpu {
namespace {

// Rotates one head in place (float32 scratch), exactly as transformers' rotate-half RoPE: the angle
// is computed in float32 as float(pos) * inv_freq[i].
void apply_rope(float *x, const Rope &rope, const int32_t *rope_pos, int32_t n, int32_t token) {
    const int32_t half = rope.n_freq;
    for (int32_t i = 0; i < half; ++i) {
        int32_t row = 0;
        if (rope.type == 2) row = i < rope.sections[0] ? 0 : (i < rope.sections[0] + rope.sections[1] ? 1 : 2);
        const float pos = float(rope_pos[int64_t(row) * n + token]);
        const float angle = pos * rope.inv_freq[i];
        const float c = std::cos(angle) * rope.scaling;
        const float s = std::sin(angle) * rope.scaling;
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
    }
}

// Copies token i from `read_k/read_v` element offsets to the destination slot, rotating K.
template <typename ReadK, typename ReadV>
void write_tokens(const LayerView &dst, Slots dst_slots, int32_t n, ReadK read_k, ReadV read_v, const Rope &rope,
                  const int32_t *rope_pos) {
    const int32_t d = dst.head_dim;
    std::vector<float> head(d);
    const int64_t vd = v_delta(dst);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t slot = slot_at(dst_slots, i);
        for (int32_t h = 0; h < dst.n_kv_heads; ++h) {
            const int64_t out = k_offset(dst, slot, h);
            for (int32_t e = 0; e < d; ++e) head[e] = read_k(i, h, e);
            if (rope.type != 0 && rope_pos) apply_rope(head.data(), rope, rope_pos, n, i);
            for (int32_t e = 0; e < d; ++e) store(dst.pool, out + e, head[e], dst.dtype);
            for (int32_t e = 0; e < d; ++e) store(dst.pool, out + vd + e, read_v(i, h, e), dst.dtype);
        }
    }
}

} // namespace

void write_dense(const LayerView &dst, Slots dst_slots, int32_t n, const void *k, const void *v, const Rope &rope,
                 const int32_t *rope_pos, void *) {
    const int64_t d = dst.head_dim, hk = dst.n_kv_heads;
    auto at = [&](int32_t i, int32_t h, int32_t e) { return (int64_t(i) * hk + h) * d + e; };
    write_tokens(
        dst, dst_slots, n, [&](int32_t i, int32_t h, int32_t e) { return load(k, at(i, h, e), dst.dtype); },
        [&](int32_t i, int32_t h, int32_t e) { return load(v, at(i, h, e), dst.dtype); }, rope, rope_pos);
}

void copy_paged(const LayerView &src, Slots src_slots, const LayerView &dst, Slots dst_slots, int32_t n,
                const Rope &rope, const int32_t *rope_pos, void *) {
    const int64_t vd = v_delta(src);
    auto k_at = [&](int32_t i, int32_t h) { return k_offset(src, slot_at(src_slots, i), h); };
    write_tokens(
        dst, dst_slots, n, [&](int32_t i, int32_t h, int32_t e) { return load(src.pool, k_at(i, h) + e, src.dtype); },
        [&](int32_t i, int32_t h, int32_t e) { return load(src.pool, k_at(i, h) + vd + e, src.dtype); }, rope,
        rope_pos);
}

void copy_paged_layers(const LayerView &src, Slots src_slots, int64_t src_table_stride, const LayerView &dst,
                       Slots dst_slots, int64_t dst_table_stride, int32_t n_layers, int32_t n, const Rope &rope,
                       const int32_t *rope_pos, void *stream) {
    for (int32_t j = 0; j < n_layers; ++j) {
        LayerView src_j = src, dst_j = dst;
        src_j.block_table = src.block_table + j * src_table_stride;
        dst_j.block_table = dst.block_table + j * dst_table_stride;
        copy_paged(src_j, src_slots, dst_j, dst_slots, n, rope, rope_pos, stream);
    }
}

void write_last(const BatchView &dst, const void *k, const void *v, const Rope &rope, const int32_t *rope_pos,
                void *stream) {
    const int64_t row = int64_t(dst.n_kv_heads) * dst.head_dim * dtype_size(dst.dtype); // bytes of one token
    const int32_t rope_rows = rope.type == 2 ? 3 : 1;
    for (int32_t i = 0; i < dst.n_seqs; ++i) {
        LayerView layer = dst.layout();
        layer.block_table = dst.block_tables + i * dst.table_stride;
        layer.n_tokens = dst.n_tokens[i];
        // This token's RoPE positions as a one-token [rows, 1] list.
        int32_t pos[3] = {0, 0, 0};
        for (int32_t r = 0; rope_pos && r < rope_rows; ++r) pos[r] = rope_pos[int64_t(r) * dst.n_seqs + i];
        write_dense(layer, Slots{nullptr, layer.n_tokens - 1}, 1, static_cast<const char *>(k) + i * row,
                    static_cast<const char *>(v) + i * row, rope, rope_pos ? pos : nullptr, stream);
    }
}

void scatter_ints(int32_t *dst, const int32_t *pairs, int32_t n_pairs, void *) {
    for (int32_t j = 0; j < n_pairs; ++j) dst[pairs[2 * j]] = pairs[2 * j + 1];
}

void read_dense(const LayerView &src, void *k_out, void *v_out, void *) {
    const int32_t d = src.head_dim, hk = src.n_kv_heads;
    const int64_t vd = v_delta(src);
    const size_t row_bytes = size_t(d) * dtype_size(src.dtype);
    auto *pool = static_cast<const char *>(src.pool);
    for (int32_t s = 0; s < src.n_tokens; ++s) {
        for (int32_t h = 0; h < hk; ++h) {
            const int64_t off = k_offset(src, s, h);
            const int64_t dst = (int64_t(s) * hk + h) * row_bytes;
            if (k_out) std::memcpy(static_cast<char *>(k_out) + dst, pool + off * dtype_size(src.dtype), row_bytes);
            if (v_out)
                std::memcpy(static_cast<char *>(v_out) + dst, pool + (off + vd) * dtype_size(src.dtype), row_bytes);
        }
    }
}

} // namespace conduit::kernels::cpu
