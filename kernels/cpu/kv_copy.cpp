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
    std::vector<float> head(d), value(d);
    const int64_t vd = v_delta(dst);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t slot = slot_at(dst_slots, i);
        for (int32_t h = 0; h < dst.n_kv_heads; ++h) {
            for (int32_t e = 0; e < d; ++e) head[e] = read_k(i, h, e);
            for (int32_t e = 0; e < d; ++e) value[e] = read_v(i, h, e);
            if (rope.type != 0 && rope_pos) apply_rope(head.data(), rope, rope_pos, n, i);
            if (dst.fp8) {
                quantize_fp8_row(dst, slot, h, false, head.data());
                quantize_fp8_row(dst, slot, h, true, value.data());
                continue;
            }
            const int64_t out = k_offset(dst, slot, h);
            for (int32_t e = 0; e < d; ++e) store(dst.pool, out + e, head[e], dst.dtype);
            for (int32_t e = 0; e < d; ++e) store(dst.pool, out + vd + e, value[e], dst.dtype);
        }
    }
}

// The rows of a paged layer as float32, one (token, head) row at a time (fp8 rows dequantized).
class PagedReader {
  public:
    PagedReader(const LayerView &view, Slots slots) : view_(view), slots_(slots), row_(size_t(view.head_dim)) {}
    float k(int32_t i, int32_t h, int32_t e) { return at(i, h, false, e); }
    float v(int32_t i, int32_t h, int32_t e) { return at(i, h, true, e); }

  private:
    float at(int32_t i, int32_t h, bool value, int32_t e) {
        const int32_t slot = slot_at(slots_, i);
        if (!view_.fp8) return load(view_.pool, k_offset(view_, slot, h) + (value ? v_delta(view_) : 0) + e, view_.dtype);
        if (i != token_ || h != head_ || value != value_) {
            dequantize_fp8_row(view_, slot, h, value, row_.data());
            token_ = i, head_ = h, value_ = value;
        }
        return row_[size_t(e)];
    }
    LayerView view_;
    Slots slots_;
    std::vector<float> row_;
    int32_t token_ = -1, head_ = -1;
    bool value_ = false;
};

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
    PagedReader rows(src, src_slots);
    write_tokens(
        dst, dst_slots, n, [&](int32_t i, int32_t h, int32_t e) { return rows.k(i, h, e); },
        [&](int32_t i, int32_t h, int32_t e) { return rows.v(i, h, e); }, rope, rope_pos);
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
    const int64_t row = int64_t(dst.n_kv_heads) * dst.head_dim * dtype_size(dst.dtype); // bytes of one dense token
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

const LayerView &DenseStaging::of(const LayerView &kv) {
    if (!kv.fp8) return kv;
    view_ = kv;
    view_.fp8 = false;
    const int32_t n_blocks = (kv.n_tokens + kv.block_size - 1) / kv.block_size;
    table_.resize(size_t(n_blocks));
    for (int32_t b = 0; b < n_blocks; ++b) table_[size_t(b)] = b;
    pool_.assign(size_t(n_blocks) * size_t(view_.block_bytes()), 0);
    view_.pool = pool_.data();
    view_.block_table = table_.data();
    copy_paged(kv, Slots{}, view_, Slots{}, kv.n_tokens, Rope{}, nullptr, nullptr);
    return view_;
}

void scatter_ints(int32_t *dst, const int32_t *pairs, int32_t n_pairs, void *) {
    for (int32_t j = 0; j < n_pairs; ++j) dst[pairs[2 * j]] = pairs[2 * j + 1];
}

void read_dense(const LayerView &src, void *k_out, void *v_out, void *) {
    const int32_t d = src.head_dim, hk = src.n_kv_heads;
    if (src.fp8) {
        std::vector<float> row(static_cast<size_t>(d));
        for (int32_t s = 0; s < src.n_tokens; ++s) {
            for (int32_t h = 0; h < hk; ++h) {
                const int64_t out = (int64_t(s) * hk + h) * d;
                for (int32_t value = 0; value < 2; ++value) {
                    void *dst = value ? v_out : k_out;
                    if (!dst) continue;
                    dequantize_fp8_row(src, s, h, value, row.data());
                    for (int32_t e = 0; e < d; ++e) store(dst, out + e, row[size_t(e)], src.dtype);
                }
            }
        }
        return;
    }
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
