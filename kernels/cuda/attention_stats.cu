// attention_stats.cu: per-key attention mass and per-head sparsity counts on the GPU, without
// materialising the [n_q, n_tokens] probabilities (the scoring pass of CONDUIT and VL-Cache).
//
// Four launches on the stream:
//   1. split_kv_attention_kernel<kValues = false> (attention_kernel.cuh): per (query, head, split)
//      the base-2 max and log-sum-exp of the scores, K only.
//   2. merge_score_stats_kernel: splits -> max2, lse2 per (query, head); writes lse if asked.
//   3. key_stats_kernel: key-major. A CTA holds a tile of key rows of one KV head in registers and
//      walks a chunk of the queries, recomputing each score exactly as pass 1 did (same lanes, same
//      order of operations, so the max is bit-identical) and turning it into p = 2^(s - lse2). Sums
//      of p go to a partial per (query chunk, KV head, head tile) and key; counts of p below
//      threshold * p_max go to one 64-bit integer counter per head (integer atomics: exact).
//   4. reduce_key_stats_kernel: mass = the partials summed in a fixed order (deterministic),
//      n_below = the counters as float.
#include <algorithm>
#include <cmath>

#include "attention_kernel.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int32_t kMinSplitTokens = 128;
constexpr int32_t kMinQueriesPerChunk = 16;
constexpr int32_t kTargetCtasPerSm = 4;

struct StatsParams {
    AttentionParams a;
    const float *max2;                  // [n_q, n_heads] base-2 score max
    const float *lse2;                  // [n_q, n_heads] base-2 log-sum-exp
    float log2_threshold;               // log2(threshold); -inf for threshold 0
    int32_t queries_per_chunk;          // grid z walks the queries in chunks of this size
    float *partial_mass;                // [n_query_chunks * n_kv_heads * head_tiles, n_tokens]
    unsigned long long *below;          // [n_heads]
};

// One thread per (query, head).
__global__ void merge_score_stats_kernel(const AttentionParams p, float *max2, float *lse2, float *lse) {
    const int64_t head_row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (head_row >= int64_t(p.n_q) * p.n_heads) return;
    const float *part_max = p.partial_max + head_row * p.n_splits;
    const float *part_lse = p.partial_lse + head_row * p.n_splits;
    float best = -CUDART_INF_F, ref = -CUDART_INF_F;
    for (int32_t s = 0; s < p.n_splits; ++s) {
        best = fmaxf(best, part_max[s]);
        ref = fmaxf(ref, part_lse[s]);
    }
    float total = 0.0f;
    if (ref != -CUDART_INF_F)
        for (int32_t s = 0; s < p.n_splits; ++s) total += exp2f(part_lse[s] - ref);
    const float merged = total > 0.0f ? ref + log2f(total) : -CUDART_INF_F;
    max2[head_row] = best;
    lse2[head_row] = merged;
    if (lse) lse[head_row] = merged * CUDART_LN2_F;
}

template <typename T, int kLanes, int kPerLane, int kGroupTile>
__global__ void __launch_bounds__(kAttnThreads) key_stats_kernel(const StatsParams sp) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    constexpr int kVec = S::kVec, kF = S::kFloats, kRows = S::kRowsPerGroup;
    const AttentionParams &p = sp.a;
    const int32_t kv_head = blockIdx.y / p.head_tiles, head_tile = blockIdx.y % p.head_tiles;
    const int32_t q_begin = blockIdx.z * sp.queries_per_chunk;
    const int32_t q_end = min(p.n_q, q_begin + sp.queries_per_chunk);
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t row_group = lane / kLanes, j = lane % kLanes;
    const int32_t n_chunks = p.head_dim / kVec;
    const int32_t first_head = kv_head * p.group + head_tile * kGroupTile;
    const int32_t n_my_heads = min(kGroupTile, p.group - head_tile * kGroupTile);
    const T *pool = static_cast<const T *>(p.pool);

    // This row group's keys, as float32, and their positions (INT32_MAX: past the layer's end).
    int32_t slot[kRows], key_pos[kRows];
    float k[kRows][kF];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        slot[r] = blockIdx.x * S::kTileRows + (r * kAttnWarps + warp) * S::kGroupsPerWarp + row_group;
        const bool in_range = slot[r] < p.n_tokens;
        key_pos[r] = in_range ? p.positions[slot[r]] : INT32_MAX;
        const T *row = pool;
        if (in_range) {
            const int64_t block = p.block_table[slot[r] >> p.block_shift];
            const int32_t t = slot[r] & ((1 << p.block_shift) - 1);
            row = pool + block * p.block_elems + ((int64_t(kv_head) << p.block_shift) + t) * p.head_dim;
        }
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
            const int32_t chunk = c * kLanes + j;
            if (in_range && chunk < n_chunks) {
                chunk_to_float<T>(load16(row + chunk * kVec), &k[r][c * kVec]);
            } else {
#pragma unroll
                for (int e = 0; e < kVec; ++e) k[r][c * kVec + e] = 0.0f;
            }
        }
    }

    float mass[kRows];
    unsigned below[kGroupTile];
#pragma unroll
    for (int r = 0; r < kRows; ++r) mass[r] = 0.0f;
#pragma unroll
    for (int h = 0; h < kGroupTile; ++h) below[h] = 0;

    for (int32_t qi = q_begin; qi < q_end; ++qi) {
        const int32_t q_position = p.q_pos[qi];
        bool visible[kRows], any_visible = false;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            visible[r] = key_pos[r] <= q_position;
            any_visible |= visible[r];
        }
        if (!__any_sync(0xffffffffu, any_visible)) continue; // warp-uniform
#pragma unroll
        for (int h = 0; h < kGroupTile; ++h) {
            if (h >= n_my_heads) break; // CTA-uniform
            const int64_t head_row = int64_t(qi) * p.n_heads + first_head + h;
            float q[kF];
#pragma unroll
            for (int c = 0; c < kPerLane; ++c) {
                const int32_t chunk = c * kLanes + j;
                float *dst = &q[c * kVec];
                if (chunk < n_chunks) {
                    load_chunk<T>(static_cast<const T *>(p.q) + head_row * p.head_dim + chunk * kVec, p.q_vector, dst);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) dst[e] *= p.scale_log2; // exactly as pass 1
                } else {
#pragma unroll
                    for (int e = 0; e < kVec; ++e) dst[e] = 0.0f;
                }
            }
            const float lse2 = sp.lse2[head_row];
            const float cut = sp.max2[head_row] + sp.log2_threshold;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < kF; ++e) dot = fmaf(q[e], k[r][e], dot);
                dot = group_sum<kLanes>(dot);
                if (visible[r]) {
                    mass[r] += exp2f(dot - lse2);
                    below[h] += dot < cut ? 1u : 0u;
                }
            }
        }
    }

    if (j == 0) {
        const int64_t partial_row = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * p.n_tokens;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
            if (slot[r] < p.n_tokens) sp.partial_mass[partial_row + slot[r]] = mass[r];
    }
    // Counts: every lane of a row group holds its group's count; sum the groups of the warp.
#pragma unroll
    for (int h = 0; h < kGroupTile; ++h) {
        unsigned count = below[h];
#pragma unroll
        for (int offset = kLanes; offset < 32; offset *= 2) count += __shfl_xor_sync(0xffffffffu, count, offset);
        if (lane == 0 && h < n_my_heads && count > 0) atomicAdd(sp.below + first_head + h, (unsigned long long)count);
    }
}

// mass[s] = sum of the partial rows (fixed order); n_below[h] = float(below[h]).
__global__ void reduce_key_stats_kernel(const float *partial_mass, int32_t n_partials, int32_t n_tokens,
                                        const unsigned long long *below, int32_t n_heads, float *mass,
                                        float *n_below) {
    const int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (s < n_tokens) {
        float total = 0.0f;
        for (int32_t i = 0; i < n_partials; ++i) total += partial_mass[int64_t(i) * n_tokens + s];
        mass[s] = total;
    }
    if (n_below && s < n_heads) n_below[s] = float(below[s]);
}

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

template <typename T, int kLanes, int kPerLane, int kGroupTile>
void launch_stats(AttentionParams p, float threshold, float *mass, float *n_below, float *lse, cudaStream_t stream) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    plan_splits(p, S::kTileRows, kMinSplitTokens);
    const int64_t key_tiles = (int64_t(p.n_tokens) + S::kTileRows - 1) / S::kTileRows;
    const int64_t head_blocks = int64_t(p.n_kv_heads) * p.head_tiles;
    const int64_t target = int64_t(kTargetCtasPerSm) * sm_count();
    int64_t q_chunks = 1;
    if (key_tiles * head_blocks < target)
        q_chunks = std::min<int64_t>((target + key_tiles * head_blocks - 1) / (key_tiles * head_blocks),
                                     (p.n_q + kMinQueriesPerChunk - 1) / kMinQueriesPerChunk);
    q_chunks = std::max<int64_t>(std::min<int64_t>(q_chunks, 65535), 1);
    const int32_t per_chunk = int32_t((p.n_q + q_chunks - 1) / q_chunks);
    q_chunks = (p.n_q + per_chunk - 1) / per_chunk;

    const size_t head_rows = size_t(p.n_q) * p.n_heads;
    const size_t partial_bytes = round_up(head_rows * p.n_splits * sizeof(float));
    const size_t row_bytes = round_up(head_rows * sizeof(float));
    const size_t mass_bytes = round_up(size_t(q_chunks * head_blocks) * p.n_tokens * sizeof(float));
    const size_t below_bytes = round_up(size_t(p.n_heads) * sizeof(unsigned long long));
    const size_t total = 2 * partial_bytes + 2 * row_bytes + mass_bytes + below_bytes;
    char *ws = static_cast<char *>(stream_workspace(total, stream));
    if (!ws) throw DeviceOutOfMemory("attention_stats: no device memory for a workspace of " + std::to_string(total) + " bytes");

    p.partial_max = reinterpret_cast<float *>(ws);
    p.partial_lse = reinterpret_cast<float *>(ws + partial_bytes);
    StatsParams sp{};
    sp.a = p;
    float *max2 = reinterpret_cast<float *>(ws + 2 * partial_bytes);
    float *lse2 = reinterpret_cast<float *>(ws + 2 * partial_bytes + row_bytes);
    sp.max2 = max2;
    sp.lse2 = lse2;
    sp.log2_threshold = threshold > 0.0f ? std::log2(threshold) : -INFINITY;
    sp.queries_per_chunk = per_chunk;
    sp.partial_mass = reinterpret_cast<float *>(ws + 2 * partial_bytes + 2 * row_bytes);
    sp.below = reinterpret_cast<unsigned long long *>(ws + 2 * partial_bytes + 2 * row_bytes + mass_bytes);
    CUDA_CHECK(cudaMemsetAsync(sp.below, 0, size_t(p.n_heads) * sizeof(unsigned long long), stream));

    const dim3 pass1{unsigned(p.n_q), unsigned(head_blocks), unsigned(p.n_splits)};
    split_kv_attention_kernel<T, kLanes, kPerLane, kGroupTile, false><<<pass1, kAttnThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH("split_kv_attention_kernel (stats)");
    merge_score_stats_kernel<<<unsigned((head_rows + 127) / 128), 128, 0, stream>>>(p, max2, lse2, lse);
    CUDA_CHECK_LAUNCH("merge_score_stats_kernel");
    if (key_tiles > 0) {
        const dim3 pass2{unsigned(key_tiles), unsigned(head_blocks), unsigned(q_chunks)};
        key_stats_kernel<T, kLanes, kPerLane, kGroupTile><<<pass2, kAttnThreads, 0, stream>>>(sp);
        CUDA_CHECK_LAUNCH("key_stats_kernel");
    }
    const int64_t reduce_items = std::max<int64_t>(p.n_tokens, p.n_heads);
    reduce_key_stats_kernel<<<unsigned((reduce_items + 255) / 256), 256, 0, stream>>>(
        sp.partial_mass, int32_t(q_chunks * head_blocks), p.n_tokens, sp.below, p.n_heads, mass, n_below);
    CUDA_CHECK_LAUNCH("reduce_key_stats_kernel");
}

} // namespace

void attention_stats(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                     float scale, float threshold, float *mass, float *n_below, float *lse, void *stream) {
    cudaStream_t s = as_stream(stream);
    if (n_q <= 0) { // no query: zero mass and counts
        if (kv.n_tokens > 0) CUDA_CHECK(cudaMemsetAsync(mass, 0, size_t(kv.n_tokens) * sizeof(float), s));
        if (n_below && n_heads > 0) CUDA_CHECK(cudaMemsetAsync(n_below, 0, size_t(n_heads) * sizeof(float), s));
        return;
    }
    const AttentionParams p = attention_params(kv, n_q, n_heads, q, q_pos, scale);
    dispatch_dtype(kv.dtype, [&](auto dtype) {
        using T = typename decltype(dtype)::type;
        dispatch_shape<T>(p.head_dim, p.group, [&](auto shape) {
            using Sh = decltype(shape);
            launch_stats<T, Sh::lanes, Sh::per_lane, Sh::group_tile>(p, threshold, mass, n_below, lse, s);
        });
    });
}

} // namespace conduit::kernels::cuda
