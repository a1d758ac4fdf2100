// attention_stats.cpp: per-key attention mass and per-head sparsity counts, on the CPU.
//
// Two passes per (query, KV head): the first finds each query head's max score and log-sum-exp, the
// second turns every visible score into a probability and accumulates it. The [n_q, n_tokens]
// probability matrix never exists. attention_mass is the second pass alone, the log-sum-exp given.
#include <cmath>
#include <limits>
#include <vector>

#include "dtype.h"

namespace conduit::kernels::cpu {

void attention_stats(const LayerView &fp8_or_dense, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                     float scale, float threshold, float *mass, float *n_below, float *lse, void *) {
    DenseStaging staging;
    const LayerView &kv = staging.of(fp8_or_dense);
    const int32_t d = kv.head_dim, hk = kv.n_kv_heads, group = n_heads / hk;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    // p < threshold * p_max  <=>  score < max_score + log(threshold)
    const float log_threshold = threshold > 0 ? std::log(threshold) : neg_inf;
    std::vector<float> qf(size_t(group) * d), krow(d), scores;
    std::vector<double> below(size_t(n_heads), 0.0);
    std::vector<double> acc(size_t(kv.n_tokens), 0.0);

    for (int32_t i = 0; i < n_q; ++i) {
        for (int32_t g = 0; g < hk; ++g) {
            const int64_t q_base = (int64_t(i) * n_heads + int64_t(g) * group) * d;
            for (int64_t e = 0; e < int64_t(group) * d; ++e) qf[e] = load(q, q_base + e, kv.dtype);
            scores.assign(size_t(group) * kv.n_tokens, neg_inf);
            for (int32_t s = 0; s < kv.n_tokens; ++s) {
                if (kv.positions[s] > q_pos[i]) continue;
                const int64_t off = k_offset(kv, s, g);
                for (int32_t e = 0; e < d; ++e) krow[e] = load(kv.pool, off + e, kv.dtype);
                for (int32_t h = 0; h < group; ++h) {
                    float dot = 0.0f;
                    for (int32_t e = 0; e < d; ++e) dot += qf[size_t(h) * d + e] * krow[e];
                    scores[size_t(h) * kv.n_tokens + s] = dot * scale;
                }
            }
            for (int32_t h = 0; h < group; ++h) {
                const float *row = &scores[size_t(h) * kv.n_tokens];
                float mx = neg_inf;
                for (int32_t s = 0; s < kv.n_tokens; ++s) mx = row[s] > mx ? row[s] : mx;
                float row_lse = neg_inf;
                if (mx != neg_inf) {
                    double sum = 0.0;
                    for (int32_t s = 0; s < kv.n_tokens; ++s) sum += std::exp(double(row[s]) - mx);
                    row_lse = mx + float(std::log(sum));
                    const float cut = mx + log_threshold;
                    for (int32_t s = 0; s < kv.n_tokens; ++s) {
                        if (row[s] == neg_inf) continue;
                        acc[size_t(s)] += std::exp(double(row[s]) - row_lse);
                        below[size_t(g) * group + h] += row[s] < cut;
                    }
                }
                if (lse) lse[int64_t(i) * n_heads + int64_t(g) * group + h] = row_lse;
            }
        }
    }
    for (int32_t s = 0; s < kv.n_tokens; ++s) mass[s] = float(acc[size_t(s)]);
    if (n_below)
        for (int32_t h = 0; h < n_heads; ++h) n_below[h] = float(below[size_t(h)]);
}

void attention_mass(const LayerView &fp8_or_dense, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                    float scale, const float *lse, float *mass, void *) {
    DenseStaging staging;
    const LayerView &kv = staging.of(fp8_or_dense);
    const int32_t d = kv.head_dim, group = n_heads / kv.n_kv_heads;
    std::vector<float> qf(d), krow(d);
    std::vector<double> acc(size_t(kv.n_tokens), 0.0);
    for (int32_t i = 0; i < n_q; ++i) {
        for (int32_t h = 0; h < n_heads; ++h) {
            const double row_lse = lse[int64_t(i) * n_heads + h];
            if (std::isinf(row_lse)) continue; // -inf: the row sees no key
            for (int32_t e = 0; e < d; ++e) qf[e] = load(q, (int64_t(i) * n_heads + h) * d + e, kv.dtype);
            for (int32_t s = 0; s < kv.n_tokens; ++s) {
                if (kv.positions[s] > q_pos[i]) continue;
                const int64_t off = k_offset(kv, s, h / group);
                float dot = 0.0f;
                for (int32_t e = 0; e < d; ++e) dot += qf[e] * load(kv.pool, off + e, kv.dtype);
                acc[size_t(s)] += std::exp(double(dot * scale) - row_lse);
            }
        }
    }
    for (int32_t s = 0; s < kv.n_tokens; ++s) mass[s] = float(acc[size_t(s)]);
}

} // namespace conduit::kernels::cpu
