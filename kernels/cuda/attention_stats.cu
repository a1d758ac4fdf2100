// attention_stats.cu: per-key attention mass and per-head sparsity counts on the GPU, without
// materialising the [n_q, n_tokens] probabilities (the scoring pass of CONDUIT and VL-Cache): the
// launches both paths share (attention_stats.cuh), the CUDA-core path, and the dispatch between it and
// the tensor-core path (attention_stats_mma.cu: bf16/f16, head_dim 64 or 128).
//
// The CUDA-core passes over the keys are key-major: a CTA holds key rows of one KV head in registers
// (a row group of kLanes lanes per row, every lane holding kLanes-interleaved 16-byte chunks of
// head_dim, as in attention_kernel.cuh) and walks a chunk of the queries, so each K byte is read once
// per pass instead of once per query. Four launches on the stream:
//   1. score_max_lse_kernel: a CTA walks a split of consecutive key tiles; per (query, head) and warp
//      it keeps a running base-2 (max, sum) in shared memory, merges its warps at the end and writes
//      the split's max and log-sum-exp (base 2).
//   2. merge_score_stats_kernel: splits -> max2, lse2 per (query, head); writes lse if asked.
//   3. key_stats_kernel: a CTA holds one key tile and walks a chunk of the queries, recomputing each
//      score with the same code as pass 1 (load_scaled_query, row_score: same lanes, same order of
//      operations, so the max is bit-identical) and turning it into p = 2^(s - lse2). Sums of p go to
//      a partial per (query chunk, KV head, head tile) and key; counts of p below threshold * p_max go
//      to one 64-bit integer counter per head (integer atomics: exact).
//   4. reduce_key_stats_kernel: mass = the partials summed in a fixed order (deterministic),
//      n_below = the counters as float.
// attention_mass (the rows' log-sum-exp given, as the attention kernels return it) skips launch 1 and
// replaces launch 2 with given_score_stats_kernel, which only changes the lse's base.
#include <algorithm>
#include <cmath>

#include "attention_kernel.cuh"
#include "attention_stats.cuh"
#include "kv_fp8.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int32_t kMinQueriesPerChunk = 16;  // pass 3: queries a CTA walks at least
constexpr int32_t kTargetCtasPerSm = 4;      // pass 3: query chunks are added below this many CTAs
constexpr int32_t kScoreQueries = 64;        // pass 1: queries per CTA (its running state is in smem)
constexpr int32_t kScoreCtasPerSm = 16;      // pass 1: key tiles are split until this many CTAs
constexpr int32_t kMaxScoreSplits = 256;     // pass 1: bounds the partials per (query, head)

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

// One thread per (query, head): a given natural-log lse as the key pass reads it (base 2). max2 is
// only the counts' cut, and attention_mass asks for none: lse2 stands in (finite or -inf, never NaN).
__global__ void given_score_stats_kernel(const float *lse, int64_t head_rows, float *max2, float *lse2) {
    const int64_t head_row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (head_row >= head_rows) return;
    const float base2 = lse[head_row] * CUDART_L2E_F;
    lse2[head_row] = base2;
    max2[head_row] = base2;
}

// The key rows one row group holds of one key tile, as float32 in registers, with their slots and
// positions (INT32_MAX past the layer's end: no query sees them). Row r of the group is tile row
// (r * kAttnWarps + warp) * kGroupsPerWarp + row_group, so a warp reads adjacent rows.
template <typename S> struct KeyRows {
    int32_t slot[S::kRowsPerGroup], pos[S::kRowsPerGroup];
    float k[S::kRowsPerGroup][S::kFloats];
};

template <typename S, typename T>
__device__ __forceinline__ void load_key_rows(const AttentionParams &p, int32_t kv_head, int32_t tile, KeyRows<S> &rows) {
    constexpr int kLanes = S::kLanesPerRow, kVec = S::kVec;
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t row_group = lane / kLanes, j = lane % kLanes;
    const int32_t n_chunks = p.head_dim / kVec;
    const T *pool = static_cast<const T *>(p.pool);
#pragma unroll
    for (int r = 0; r < S::kRowsPerGroup; ++r) {
        const int32_t slot = tile * S::kTileRows + (r * kAttnWarps + warp) * S::kGroupsPerWarp + row_group;
        const bool in_range = slot < p.n_tokens;
        rows.slot[r] = slot;
        rows.pos[r] = in_range ? p.positions[slot] : INT32_MAX;
        const T *row = pool;
        if (in_range) {
            const int64_t block = p.block_table[slot >> p.block_shift];
            const int32_t t = slot & ((1 << p.block_shift) - 1);
            row = pool + block * p.block_elems + ((int64_t(kv_head) << p.block_shift) + t) * p.head_dim;
        }
#pragma unroll
        for (int c = 0; c < S::kChunksPerLane; ++c) {
            const int32_t chunk = c * kLanes + j;
            if (in_range && chunk < n_chunks) {
                chunk_to_float<T>(load16(row + chunk * kVec), &rows.k[r][c * kVec]);
            } else {
#pragma unroll
                for (int e = 0; e < kVec; ++e) rows.k[r][c * kVec + e] = 0.0f;
            }
        }
    }
}

// This lane's chunks of q for one (query, head) row [head_dim] of p.q, pre-scaled by scale * log2 e
// (scores are in base 2); padding chunks past head_dim are zero.
template <typename S, typename T>
__device__ __forceinline__ void load_scaled_query(const AttentionParams &p, int64_t head_row, float (&q)[S::kFloats]) {
    constexpr int kLanes = S::kLanesPerRow, kVec = S::kVec;
    const int32_t j = (threadIdx.x % 32) % kLanes;
    const int32_t n_chunks = p.head_dim / kVec;
#pragma unroll
    for (int c = 0; c < S::kChunksPerLane; ++c) {
        const int32_t chunk = c * kLanes + j;
        float *dst = &q[c * kVec];
        if (chunk < n_chunks) {
            load_chunk<T>(static_cast<const T *>(p.q) + head_row * p.head_dim + chunk * kVec, p.q_vector, dst);
#pragma unroll
            for (int e = 0; e < kVec; ++e) dst[e] *= p.scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < kVec; ++e) dst[e] = 0.0f;
        }
    }
}

// The base-2 score of one key row: the lane's dot product, summed over the row group. The butterfly
// leaves the same bits on every lane of the group. Passes 1 and 3 both score with this function (and
// load_key_rows, load_scaled_query), which is what keeps the max of pass 1 bit-identical to the
// scores pass 3 recomputes. Call from all 32 lanes.
template <typename S>
__device__ __forceinline__ float row_score(const float (&q)[S::kFloats], const float (&k)[S::kFloats]) {
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < S::kFloats; ++e) dot = fmaf(q[e], k[e], dot);
    return group_sum<S::kLanesPerRow>(dot);
}

// Pass 1. Grid: x = split of tiles_per_split consecutive key tiles, y = KV head x head tile, z = chunk
// of at most kScoreQueries queries. Per (query, head) every warp folds each tile's visible scores into
// a running base-2 (max, sum) in shared memory (lane 0 owns the warp's entries, so no barrier until
// the end); then the warps are merged and the split's max and log-sum-exp written to
// p.partial_max / p.partial_lse [n_q, n_heads, n_splits].
template <typename T, int kLanes, int kPerLane, int kGroupTile>
__global__ void __launch_bounds__(kAttnThreads)
    score_max_lse_kernel(const AttentionParams p, int32_t tiles_per_split, int32_t queries_per_chunk) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    constexpr int kF = S::kFloats, kRows = S::kRowsPerGroup;
    __shared__ float run_max[kScoreQueries][kGroupTile][kAttnWarps], run_sum[kScoreQueries][kGroupTile][kAttnWarps];
    const int32_t split = blockIdx.x;
    const int32_t kv_head = blockIdx.y / p.head_tiles, head_tile = blockIdx.y % p.head_tiles;
    const int32_t q_begin = blockIdx.z * queries_per_chunk;
    const int32_t n_my_queries = min(p.n_q - q_begin, queries_per_chunk);
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t first_head = kv_head * p.group + head_tile * kGroupTile;
    const int32_t n_my_heads = min(kGroupTile, p.group - head_tile * kGroupTile);
    const int32_t n_key_tiles = (p.n_tokens + S::kTileRows - 1) / S::kTileRows;
    const int32_t tile_begin = split * tiles_per_split, tile_end = min(n_key_tiles, tile_begin + tiles_per_split);

    if (lane == 0)
        for (int32_t qi = 0; qi < n_my_queries; ++qi)
            for (int h = 0; h < kGroupTile; ++h) {
                run_max[qi][h][warp] = -CUDART_INF_F;
                run_sum[qi][h][warp] = 0.0f;
            }

    for (int32_t tile = tile_begin; tile < tile_end; ++tile) {
        KeyRows<S> rows;
        load_key_rows<S, T>(p, kv_head, tile, rows);
        for (int32_t qi = 0; qi < n_my_queries; ++qi) {
            const int32_t q_position = p.q_pos[q_begin + qi];
            bool visible[kRows], any_visible = false;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                visible[r] = rows.pos[r] <= q_position;
                any_visible |= visible[r];
            }
            if (!__any_sync(0xffffffffu, any_visible)) continue; // warp-uniform: nothing to fold in
#pragma unroll
            for (int h = 0; h < kGroupTile; ++h) {
                if (h >= n_my_heads) break; // CTA-uniform
                float q[kF];
                load_scaled_query<S, T>(p, int64_t(q_begin + qi) * p.n_heads + first_head + h, q);
                float score[kRows], tile_max = -CUDART_INF_F;
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const float s = row_score<S>(q, rows.k[r]);
                    score[r] = visible[r] ? s : -CUDART_INF_F;
                    tile_max = fmaxf(tile_max, score[r]);
                }
#pragma unroll
                for (int offset = kLanes; offset < 32; offset *= 2)
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
                const float ref = tile_max == -CUDART_INF_F ? 0.0f : tile_max;
                float tile_sum = 0.0f;
#pragma unroll
                for (int r = 0; r < kRows; ++r) tile_sum += exp2f(score[r] - ref); // masked: exp2(-inf) = 0
#pragma unroll
                for (int offset = kLanes; offset < 32; offset *= 2)
                    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, offset);
                if (lane == 0) {
                    const float old_max = run_max[qi][h][warp];
                    const float new_max = fmaxf(old_max, tile_max);
                    const float new_ref = new_max == -CUDART_INF_F ? 0.0f : new_max;
                    run_sum[qi][h][warp] =
                        run_sum[qi][h][warp] * exp2f(old_max - new_ref) + tile_sum * exp2f(tile_max - new_ref);
                    run_max[qi][h][warp] = new_max;
                }
            }
        }
    }
    __syncthreads();

    for (int32_t idx = threadIdx.x; idx < n_my_queries * n_my_heads; idx += kAttnThreads) {
        const int32_t qi = idx / n_my_heads, h = idx % n_my_heads;
        float total_max = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) total_max = fmaxf(total_max, run_max[qi][h][w]);
        const float ref = total_max == -CUDART_INF_F ? 0.0f : total_max;
        float total_sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) total_sum += run_sum[qi][h][w] * exp2f(run_max[qi][h][w] - ref);
        const int64_t part = (int64_t(q_begin + qi) * p.n_heads + first_head + h) * p.n_splits + split;
        p.partial_max[part] = total_max;
        p.partial_lse[part] = total_sum == 0.0f ? -CUDART_INF_F : total_max + log2f(total_sum);
    }
}

// Pass 3. Grid: x = key tile, y = KV head x head tile, z = chunk of sp.queries_per_chunk queries.
template <typename T, int kLanes, int kPerLane, int kGroupTile>
__global__ void __launch_bounds__(kAttnThreads) key_stats_kernel(const StatsParams sp) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    constexpr int kF = S::kFloats, kRows = S::kRowsPerGroup;
    const AttentionParams &p = sp.a;
    const int32_t kv_head = blockIdx.y / p.head_tiles, head_tile = blockIdx.y % p.head_tiles;
    const int32_t q_begin = blockIdx.z * sp.queries_per_chunk;
    const int32_t q_end = min(p.n_q, q_begin + sp.queries_per_chunk);
    const int32_t lane = threadIdx.x % 32, j = lane % kLanes;
    const int32_t first_head = kv_head * p.group + head_tile * kGroupTile;
    const int32_t n_my_heads = min(kGroupTile, p.group - head_tile * kGroupTile);

    KeyRows<S> rows;
    load_key_rows<S, T>(p, kv_head, blockIdx.x, rows);
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
            visible[r] = rows.pos[r] <= q_position;
            any_visible |= visible[r];
        }
        if (!__any_sync(0xffffffffu, any_visible)) continue; // warp-uniform
#pragma unroll
        for (int h = 0; h < kGroupTile; ++h) {
            if (h >= n_my_heads) break; // CTA-uniform
            const int64_t head_row = int64_t(qi) * p.n_heads + first_head + h;
            float q[kF];
            load_scaled_query<S, T>(p, head_row, q);
            const float lse2 = sp.lse2[head_row];
            const float cut = sp.max2[head_row] + sp.log2_threshold;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const float score = row_score<S>(q, rows.k[r]);
                if (visible[r]) {
                    mass[r] += exp2f(score - lse2);
                    below[h] += score < cut ? 1u : 0u;
                }
            }
        }
    }

    if (j == 0) {
        const int64_t partial_row = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * p.n_tokens;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
            if (rows.slot[r] < p.n_tokens) sp.partial_mass[partial_row + rows.slot[r]] = mass[r];
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

template <typename T, int kLanes, int kPerLane, int kGroupTile>
void launch_stats(const AttentionParams &p, float threshold, float *mass, float *n_below, float *lse,
                  const float *lse_in, cudaStream_t stream) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    const int64_t key_tiles = (int64_t(p.n_tokens) + S::kTileRows - 1) / S::kTileRows;
    const int64_t head_blocks = int64_t(p.n_kv_heads) * p.head_tiles;

    // Pass 1: query chunks of at most kScoreQueries; key tiles split until the grid fills the GPU.
    const int64_t score_chunks = (int64_t(p.n_q) + kScoreQueries - 1) / kScoreQueries;
    require(score_chunks <= 65535, "attention_stats: too many queries for one launch");
    const int32_t score_per_chunk = int32_t((p.n_q + score_chunks - 1) / score_chunks);
    const int64_t score_target = int64_t(kScoreCtasPerSm) * sm_count();
    int64_t splits = (score_target + head_blocks * score_chunks - 1) / (head_blocks * score_chunks);
    splits = std::max<int64_t>(std::min<int64_t>({splits, key_tiles, int64_t(kMaxScoreSplits)}), 1);
    const int64_t tiles_per_split = std::max<int64_t>((key_tiles + splits - 1) / splits, 1);

    // Pass 3: query chunks only where the key tiles alone leave SMs idle.
    const int64_t target = int64_t(kTargetCtasPerSm) * sm_count();
    int64_t q_chunks = 1;
    if (key_tiles * head_blocks < target)
        q_chunks = std::min<int64_t>((target + key_tiles * head_blocks - 1) / (key_tiles * head_blocks),
                                     (p.n_q + kMinQueriesPerChunk - 1) / kMinQueriesPerChunk);
    q_chunks = std::max<int64_t>(std::min<int64_t>(q_chunks, 65535), 1);
    const int32_t per_chunk = int32_t((p.n_q + q_chunks - 1) / q_chunks);
    q_chunks = (p.n_q + per_chunk - 1) / per_chunk;

    const int32_t n_splits = lse_in ? 0 : int32_t((key_tiles + tiles_per_split - 1) / tiles_per_split);
    StatsParams sp = prepare_stats(p, n_splits, int32_t(q_chunks * head_blocks), threshold, n_below != nullptr,
                                   stream); // 0 splits without keys
    sp.queries_per_chunk = per_chunk;
    if (sp.a.n_splits > 0) {
        const dim3 pass1{unsigned(sp.a.n_splits), unsigned(head_blocks), unsigned(score_chunks)};
        score_max_lse_kernel<T, kLanes, kPerLane, kGroupTile><<<pass1, kAttnThreads, 0, stream>>>(
            sp.a, int32_t(tiles_per_split), score_per_chunk);
        CUDA_CHECK_LAUNCH("score_max_lse_kernel");
    }
    if (lse_in) given_score_stats(sp, lse_in, stream);
    else merge_score_stats(sp, lse, stream);
    if (key_tiles > 0) {
        const dim3 pass3{unsigned(key_tiles), unsigned(head_blocks), unsigned(q_chunks)};
        key_stats_kernel<T, kLanes, kPerLane, kGroupTile><<<pass3, kAttnThreads, 0, stream>>>(sp);
        CUDA_CHECK_LAUNCH("key_stats_kernel");
    }
    reduce_key_stats(sp, mass, n_below, stream);
}

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

} // namespace

StatsParams prepare_stats(AttentionParams p, int32_t n_splits, int32_t n_mass_partials, float threshold,
                          bool counts, cudaStream_t stream) {
    const size_t head_rows = size_t(p.n_q) * p.n_heads;
    const size_t partial_bytes = round_up(head_rows * size_t(n_splits) * sizeof(float));
    const size_t row_bytes = round_up(head_rows * sizeof(float));
    const size_t mass_bytes = round_up(size_t(n_mass_partials) * size_t(p.n_tokens) * sizeof(float));
    const size_t below_bytes = round_up(size_t(p.n_heads) * sizeof(unsigned long long));
    const size_t total = 2 * partial_bytes + 2 * row_bytes + mass_bytes + below_bytes;
    char *ws = static_cast<char *>(stream_workspace(total, stream));
    if (!ws) throw DeviceOutOfMemory("attention_stats: no device memory for a workspace of " + std::to_string(total) + " bytes");

    p.n_splits = n_splits;
    p.partial_max = reinterpret_cast<float *>(ws);
    p.partial_lse = reinterpret_cast<float *>(ws + partial_bytes);
    StatsParams sp{};
    sp.a = p;
    sp.max2 = reinterpret_cast<float *>(ws + 2 * partial_bytes);
    sp.lse2 = reinterpret_cast<float *>(ws + 2 * partial_bytes + row_bytes);
    sp.log2_threshold = threshold > 0.0f ? std::log2(threshold) : -INFINITY;
    sp.n_mass_partials = n_mass_partials;
    sp.partial_mass = reinterpret_cast<float *>(ws + 2 * partial_bytes + 2 * row_bytes);
    sp.below = reinterpret_cast<unsigned long long *>(ws + 2 * partial_bytes + 2 * row_bytes + mass_bytes);
    if (counts) CUDA_CHECK(cudaMemsetAsync(sp.below, 0, size_t(p.n_heads) * sizeof(unsigned long long), stream));
    return sp;
}

void merge_score_stats(const StatsParams &sp, float *lse, cudaStream_t stream) {
    const int64_t head_rows = int64_t(sp.a.n_q) * sp.a.n_heads;
    merge_score_stats_kernel<<<unsigned((head_rows + 127) / 128), 128, 0, stream>>>(sp.a, sp.max2, sp.lse2, lse);
    CUDA_CHECK_LAUNCH("merge_score_stats_kernel");
}

void given_score_stats(const StatsParams &sp, const float *lse, cudaStream_t stream) {
    const int64_t head_rows = int64_t(sp.a.n_q) * sp.a.n_heads;
    given_score_stats_kernel<<<unsigned((head_rows + 127) / 128), 128, 0, stream>>>(lse, head_rows, sp.max2, sp.lse2);
    CUDA_CHECK_LAUNCH("given_score_stats_kernel");
}

void reduce_key_stats(const StatsParams &sp, float *mass, float *n_below, cudaStream_t stream) {
    const int64_t items = std::max<int64_t>(sp.a.n_tokens, sp.a.n_heads);
    reduce_key_stats_kernel<<<unsigned((items + 255) / 256), 256, 0, stream>>>(
        sp.partial_mass, sp.n_mass_partials, sp.a.n_tokens, sp.below, sp.a.n_heads, mass, n_below);
    CUDA_CHECK_LAUNCH("reduce_key_stats_kernel");
}

namespace {

// attention_stats and attention_mass: lse_in given, the score pass is skipped (threshold 0, no counts).
void run_stats(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos, float scale,
               float threshold, float *mass, float *n_below, float *lse, const float *lse_in, void *stream) {
    if (kv.fp8) { // the kernels below read dense tiles: run them on a dequantized copy (kv_fp8.cuh)
        const DenseStaging staged(kv, stream);
        run_stats(staged.view(), n_q, n_heads, q, q_pos, scale, threshold, mass, n_below, lse, lse_in, stream);
        return;
    }
    cudaStream_t s = as_stream(stream);
    if (n_q <= 0) { // no query: zero mass and counts
        if (kv.n_tokens > 0) CUDA_CHECK(cudaMemsetAsync(mass, 0, size_t(kv.n_tokens) * sizeof(float), s));
        if (n_below && n_heads > 0) CUDA_CHECK(cudaMemsetAsync(n_below, 0, size_t(n_heads) * sizeof(float), s));
        return;
    }
    const AttentionParams p = attention_params(kv, n_q, n_heads, q, q_pos, scale);
    if (mma_stats_applies(kv.dtype, p.head_dim, q)) {
        launch_mma_stats(p, kv.dtype, threshold, mass, n_below, lse, lse_in, s);
        return;
    }
    dispatch_dtype(kv.dtype, [&](auto dtype) {
        using T = typename decltype(dtype)::type;
        dispatch_shape<T>(p.head_dim, p.group, [&](auto shape) {
            using Sh = decltype(shape);
            launch_stats<T, Sh::lanes, Sh::per_lane, Sh::group_tile>(p, threshold, mass, n_below, lse, lse_in, s);
        });
    });
}

} // namespace

void attention_stats(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                     float scale, float threshold, float *mass, float *n_below, float *lse, void *stream) {
    run_stats(kv, n_q, n_heads, q, q_pos, scale, threshold, mass, n_below, lse, nullptr, stream);
}

void attention_mass(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                    float scale, const float *lse, float *mass, void *stream) {
    run_stats(kv, n_q, n_heads, q, q_pos, scale, 0.0f, mass, nullptr, nullptr, lse, stream);
}

} // namespace conduit::kernels::cuda
