// attention_stats.cuh: what the two implementations of attention_stats share: the parameters of the
// key pass, the workspace and the launches around the score passes (merge of the first pass's splits,
// reduction of the key pass's partial mass; attention_stats.cu), and the entry of the tensor-core
// path (attention_stats_mma.cu). Every path runs four launches on the stream:
//   1. scores -> per (query, head, split) base-2 max and log-sum-exp,
//   2. merge_score_stats: splits -> max2, lse2 (and lse),
//   3. key pass: p = 2^(s - lse2) summed per key into partial mass rows; counts of s < max2 + log2(threshold),
//   4. reduce_key_stats: mass = the partial rows summed in a fixed order; n_below as float.
#pragma once

#include "attention_shape.cuh"

namespace conduit::kernels::cuda {

struct StatsParams {
    AttentionParams a;         // with n_splits, partial_max, partial_lse of the first pass
    float *max2;               // [n_q, n_heads] base-2 score max
    float *lse2;               // [n_q, n_heads] base-2 log-sum-exp
    float log2_threshold;      // log2(threshold); -inf for threshold 0
    int32_t queries_per_chunk; // CUDA-core key pass: grid z walks the queries in chunks of this size
    int32_t padded_queries;    // tensor-core key pass: queries per head rounded up to a row tile
    int32_t rows_per_chunk;    // tensor-core key pass: grid z walks the (head, query) rows in chunks of this size
    int32_t n_mass_partials;   // rows of partial_mass
    float *partial_mass;       // [n_mass_partials, n_tokens]
    unsigned long long *below; // [n_heads], zeroed
};

// Takes the stream workspace for n_splits first-pass splits and n_mass_partials partial mass rows and
// returns the parameters pointing into it (below zeroed on the stream when the counts are asked for:
// otherwise nothing reads them); p gets n_splits and its partials.
StatsParams prepare_stats(AttentionParams p, int32_t n_splits, int32_t n_mass_partials, float threshold,
                          bool counts, cudaStream_t stream);
// Launch 2: sp.a's partials -> sp.max2, sp.lse2 and lse (natural log; may be null).
void merge_score_stats(const StatsParams &sp, float *lse, cudaStream_t stream);
// Launch 2 of attention_mass: the given natural-log lse [n_q, n_heads] -> sp.lse2 (and sp.max2).
void given_score_stats(const StatsParams &sp, const float *lse, cudaStream_t stream);
// Launch 4: sp.partial_mass -> mass, sp.below -> n_below (may be null).
void reduce_key_stats(const StatsParams &sp, float *mass, float *n_below, cudaStream_t stream);

// Whether the tensor-core path (bf16/f16, head_dim 64 or 128, q 16-byte aligned) serves these
// statistics; the CUDA-core path (attention_stats.cu) serves the rest.
bool mma_stats_applies(DType dtype, int32_t head_dim, const void *q);

// Runs the four launches on tensor cores for p (from attention_params); with lse_in (natural log,
// [n_q, n_heads]) the first is skipped and the second is given_score_stats (attention_mass).
void launch_mma_stats(const AttentionParams &p, DType dtype, float threshold, float *mass, float *n_below, float *lse,
                      const float *lse_in, cudaStream_t stream);

} // namespace conduit::kernels::cuda
