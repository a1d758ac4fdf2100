// attention.cpp: causal-by-position GQA attention over one paged layer, on the CPU.
//
// For each query and KV head, the G query heads of the group are processed together so that each
// key and value row is converted to float32 once per query. Online softmax in float32.
#include <cmath>
#include <limits>
#include <vector>

#include "dtype.h"

namespace conduit::kernels::cpu {

void attention(const LayerView &fp8_or_dense, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
               float scale, void *out, float *lse, const Tuning &, void *) {
    DenseStaging staging;
    const LayerView &kv = staging.of(fp8_or_dense);
    const int32_t d = kv.head_dim, hk = kv.n_kv_heads, group = n_heads / hk;
    const int64_t vd = v_delta(kv);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::vector<float> qf(size_t(group) * d), acc(size_t(group) * d), krow(d), vrow(d);
    std::vector<float> row_max(group), row_sum(group);

    for (int32_t i = 0; i < n_q; ++i) {
        const int32_t pos = q_pos[i];
        for (int32_t g = 0; g < hk; ++g) {
            const int64_t q_base = (int64_t(i) * n_heads + int64_t(g) * group) * d;
            for (int64_t e = 0; e < int64_t(group) * d; ++e) qf[e] = load(q, q_base + e, kv.dtype);
            std::fill(acc.begin(), acc.end(), 0.0f);
            std::fill(row_max.begin(), row_max.end(), neg_inf);
            std::fill(row_sum.begin(), row_sum.end(), 0.0f);

            for (int32_t s = 0; s < kv.n_tokens; ++s) {
                if (kv.positions && kv.positions[s] > pos) continue; // no positions: every key is visible
                const int64_t off = k_offset(kv, s, g);
                for (int32_t e = 0; e < d; ++e) krow[e] = load(kv.pool, off + e, kv.dtype);
                for (int32_t e = 0; e < d; ++e) vrow[e] = load(kv.pool, off + vd + e, kv.dtype);
                for (int32_t h = 0; h < group; ++h) {
                    const float *qh = &qf[size_t(h) * d];
                    float dot = 0.0f;
                    for (int32_t e = 0; e < d; ++e) dot += qh[e] * krow[e];
                    const float score = dot * scale;
                    float *ah = &acc[size_t(h) * d];
                    if (score > row_max[h]) { // rescale what was accumulated under the old max
                        const float correction = std::exp(row_max[h] - score);
                        row_sum[h] *= correction;
                        for (int32_t e = 0; e < d; ++e) ah[e] *= correction;
                        row_max[h] = score;
                    }
                    const float p = std::exp(score - row_max[h]);
                    row_sum[h] += p;
                    for (int32_t e = 0; e < d; ++e) ah[e] += p * vrow[e];
                }
            }
            for (int32_t h = 0; h < group; ++h) {
                const int64_t head = int64_t(i) * n_heads + int64_t(g) * group + h;
                const bool empty = row_sum[h] == 0.0f;
                const float inv = empty ? 0.0f : 1.0f / row_sum[h];
                for (int32_t e = 0; e < d; ++e) store(out, head * d + e, acc[size_t(h) * d + e] * inv, kv.dtype);
                if (lse) lse[head] = empty ? neg_inf : row_max[h] + std::log(row_sum[h]);
            }
        }
    }
}

void batch_attention(const BatchView &kv, int32_t n_heads, const void *q, float scale, void *out, float *lse, void *,
                     size_t, void *stream) {
    const int64_t row = int64_t(n_heads) * kv.head_dim * dtype_size(kv.dtype); // bytes of one query
    const int32_t any_position = 0; // unused: without positions every key is visible
    for (int32_t i = 0; i < kv.n_seqs; ++i) {
        LayerView layer = kv.layout();
        layer.block_table = kv.block_tables + i * kv.table_stride;
        layer.n_tokens = kv.n_tokens[i];
        attention(layer, 1, n_heads, static_cast<const char *>(q) + i * row, &any_position, scale,
                  static_cast<char *>(out) + i * row, lse ? lse + int64_t(i) * n_heads : nullptr, Tuning{}, stream);
    }
}

size_t batch_attention_workspace_bytes(const BatchView &, int32_t) { return 0; }

void batch_write_attention(const BatchView &kv, const void *k, const void *v, const Rope &rope, const int32_t *rope_pos,
                           int32_t n_heads, const void *q, float scale, void *out, float *lse, void *workspace,
                           size_t workspace_bytes, void *stream) {
    write_last(kv, k, v, rope, rope_pos, stream);
    batch_attention(kv, n_heads, q, scale, out, lse, workspace, workspace_bytes, stream);
}

} // namespace conduit::kernels::cpu
