// attention_kernel.cuh: the split-KV ("flash-decoding") attention kernel over one paged layer.
// Host-side dispatch lives in attention.cu.
//
// Grid: x = query, y = KV head x head tile, z = split of the layer's slots. A CTA owns one query,
// one KV head and up to kGroupTile of the query heads that share it (GQA), so every K and V byte of
// its slot range is read once per query. Work per CTA:
//   1. cp.async streams tiles of K, V (16-byte chunks of the contiguous [block_size, head_dim] runs
//      of the head) and the slots' positions into shared memory, double-buffered.
//   2. Each warp splits into row groups of kLanes lanes; a row group takes one key row at a time,
//      every lane holding kLanes-interleaved 16-byte chunks of head_dim. A lane keeps the matching
//      chunks of q (pre-scaled by scale * log2 e) and of the output accumulator for each head, so a
//      score is a lane-local dot product plus a butterfly sum over the row group.
//   3. fp32 online softmax in base 2 per row group; row groups, then warps, are merged at the end
//      by their (max, sum) pairs.
// A key is visible when positions[slot] <= q_pos (every key when positions is null: a decode step);
// a query seeing nothing gets out = 0, lse = -inf. With several splits a CTA writes its partials,
// and with p.split_counters the last split of each (query, head tile) merges them
// (attention_merge.cuh). For a decode step over a batch of sequences
// (p.seq_n_tokens set), query x reads its own sequence: its length, block table and split size are
// read on the device, so the grid depends only on the batch and its capacity.
#pragma once

#include <math_constants.h>

#include "attention_merge.cuh"
#include "attention_shape.cuh"

namespace conduit::kernels::cuda {

// Sum over the kLanes consecutive lanes of a row group (all 32 lanes take part).
template <int kLanes> __device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Issues the cp.async copies of one tile (K, V, and positions of kTileRows slots from
// tile_start, through block table `table`); rows past `end` and padding chunks past head_dim are
// zero-filled. Positions are not loaded when p.positions is null.
template <typename S, typename T>
__device__ __forceinline__ void load_tile(const AttentionParams &p, const int32_t *table, int32_t kv_head,
                                          int32_t tile_start, int32_t end, uint4 *stage, int32_t *stage_pos) {
    const T *pool = static_cast<const T *>(p.pool);
    const int32_t n_chunks = p.head_dim / S::kVec;
    const int32_t block_mask = (1 << p.block_shift) - 1;
#pragma unroll
    for (int i = 0; i < S::kTileChunks / kAttnThreads; ++i) {
        const int32_t idx = threadIdx.x + i * kAttnThreads;
        const int32_t row = idx / S::kRowChunks, chunk = idx % S::kRowChunks;
        const int32_t slot = tile_start + row;
        const bool ok = slot < end && chunk < n_chunks;
        const T *k_src = pool;
        if (ok) {
            const int64_t block = table[slot >> p.block_shift];
            k_src = pool + block * p.block_elems + ((int64_t(kv_head) << p.block_shift) + (slot & block_mask)) * p.head_dim +
                    chunk * S::kVec;
        }
        cp_async16(stage + idx, k_src, ok);
        cp_async16(stage + S::kTileChunks + idx, ok ? k_src + p.v_delta : pool, ok);
    }
    for (int32_t row = threadIdx.x; p.positions && row < S::kTileRows; row += kAttnThreads) {
        const int32_t slot = tile_start + row;
        cp_async4(stage_pos + row, p.positions + (slot < end ? slot : 0), slot < end);
    }
}

// Narrows [begin, end) to [first, last + 1) of the slots visible at q_position (empty if none). It
// reads 4 bytes per slot against the 4 * head_dim (and more) of K and V per slot that it can save:
// in a causal prefill chunk most queries see only a prefix. Call from all threads of the CTA.
__device__ __forceinline__ void trim_to_visible(const int32_t *positions, int32_t q_position, int32_t &begin,
                                                int32_t &end) {
    const SlotBounds bounds = visible_slot_bounds<kAttnWarps>(positions, q_position, begin, end);
    begin = bounds.last < 0 ? begin : bounds.first;
    end = bounds.last + 1 > begin ? bounds.last + 1 : begin;
}

template <typename T, int kLanes, int kPerLane, int kGroupTile>
__global__ void __launch_bounds__(kAttnThreads) split_kv_attention_kernel(const AttentionParams p) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    constexpr int kVec = S::kVec, kF = S::kFloats, kRows = S::kRowsPerGroup;
    __shared__ uint4 smem[S::kSmemChunks];
    __shared__ int32_t pos_smem[kAttnStages][S::kTileRows];
    __shared__ float max_smem[kAttnWarps][kGroupTile], sum_smem[kAttnWarps][kGroupTile];

    const int32_t qi = blockIdx.x;
    const int32_t kv_head = blockIdx.y / p.head_tiles, head_tile = blockIdx.y % p.head_tiles;
    const int32_t split = blockIdx.z;
    const int32_t *table = p.block_table;
    int32_t n_tokens = p.n_tokens, split_tokens = p.split_tokens;
    if (p.seq_n_tokens) { // a decode step: this query's own sequence
        n_tokens = p.seq_n_tokens[qi];
        table += qi * p.table_stride;
        split_tokens = split_tokens_for(n_tokens, p.n_splits, S::kTileRows);
    }
    int32_t begin = min(n_tokens, split * split_tokens);
    int32_t end = min(n_tokens, begin + split_tokens);
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t row_group = lane / kLanes, j = lane % kLanes;
    const int32_t n_chunks = p.head_dim / kVec;
    const int32_t first_head = kv_head * p.group + head_tile * kGroupTile; // of this CTA
    const int32_t n_my_heads = min(kGroupTile, p.group - head_tile * kGroupTile);

    // Launched chained (common.cuh): q and the new K/V are the previous kernels'. The first tiles that
    // hold neither stream before the wait (tiles_before_wait), the rest of the first stages after it.
    const int32_t early = p.trim_to_visible ? 0 : tiles_before_wait(p, begin, n_tokens, S::kTileRows,
                                                                    (end - begin + S::kTileRows - 1) / S::kTileRows,
                                                                    kAttnStages - 1);
    for (int t = 0; t < early; ++t) {
        load_tile<S, T>(p, table, kv_head, begin + t * S::kTileRows, end, smem + t * S::kStageChunks, pos_smem[t]);
        cp_async_commit();
    }
    const int32_t q_position = finish_prologue<T>(p, table, qi, kv_head, n_tokens, begin, end);

    // q chunks of this lane, pre-scaled; heads past the group and padding chunks are zero.
    float q[kGroupTile][kF];
#pragma unroll
    for (int h = 0; h < kGroupTile; ++h) {
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
            const int32_t chunk = c * kLanes + j;
            float *dst = &q[h][c * kVec];
            if (h < n_my_heads && chunk < n_chunks) {
                const T *src = static_cast<const T *>(p.q) +
                               (int64_t(qi) * p.n_heads + first_head + h) * p.head_dim + chunk * kVec;
                load_chunk<T>(src, p.q_vector, dst);
#pragma unroll
                for (int e = 0; e < kVec; ++e) dst[e] *= p.scale_log2;
            } else {
#pragma unroll
                for (int e = 0; e < kVec; ++e) dst[e] = 0.0f;
            }
        }
    }
    float run_max[kGroupTile], run_sum[kGroupTile], acc[kGroupTile][kF];
#pragma unroll
    for (int h = 0; h < kGroupTile; ++h) {
        run_max[h] = -CUDART_INF_F;
        run_sum[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < kF; ++e) acc[h][e] = 0.0f;
    }

    if (p.trim_to_visible) trim_to_visible(p.positions, q_position, begin, end);
    const int32_t n_tiles = end > begin ? (end - begin + S::kTileRows - 1) / S::kTileRows : 0;
    for (int t = early; t < kAttnStages - 1; ++t) { // one commit group per stage, as the loop counts them
        if (t < n_tiles)
            load_tile<S, T>(p, table, kv_head, begin + t * S::kTileRows, end, smem + t * S::kStageChunks, pos_smem[t]);
        cp_async_commit();
    }
    for (int32_t tile = 0; tile < n_tiles; ++tile) {
        const int32_t ahead = tile + kAttnStages - 1;
        if (ahead < n_tiles)
            load_tile<S, T>(p, table, kv_head, begin + ahead * S::kTileRows, end,
                            smem + (ahead % kAttnStages) * S::kStageChunks, pos_smem[ahead % kAttnStages]);
        cp_async_commit();
        cp_async_wait<kAttnStages - 1>();
        __syncthreads();

        const int32_t stage = tile % kAttnStages;
        const uint4 *k_tile = smem + stage * S::kStageChunks;
        const uint4 *v_tile = k_tile + S::kTileChunks;
        const int32_t tile_start = begin + tile * S::kTileRows;
        int32_t rows[kRows];
        bool visible[kRows];
        bool any_visible = false;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            rows[r] = (r * kAttnWarps + warp) * S::kGroupsPerWarp + row_group; // a warp reads adjacent rows
            visible[r] = tile_start + rows[r] < end && (!p.positions || pos_smem[stage][rows[r]] <= q_position);
            any_visible |= visible[r];
        }
        if (__any_sync(0xffffffffu, any_visible)) { // warp-uniform: masked tails cost no math
            float score[kRows][kGroupTile];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float k[kF];
#pragma unroll
                for (int c = 0; c < kPerLane; ++c)
                    chunk_to_float<T>(k_tile[rows[r] * S::kRowChunks + c * kLanes + j], &k[c * kVec]);
#pragma unroll
                for (int h = 0; h < kGroupTile; ++h) {
                    float dot = 0.0f;
#pragma unroll
                    for (int e = 0; e < kF; ++e) dot = fmaf(q[h][e], k[e], dot);
                    dot = group_sum<kLanes>(dot);
                    score[r][h] = visible[r] ? dot : -CUDART_INF_F;
                }
            }
#pragma unroll
            for (int h = 0; h < kGroupTile; ++h) {
                float tile_max = score[0][h];
#pragma unroll
                for (int r = 1; r < kRows; ++r) tile_max = fmaxf(tile_max, score[r][h]);
                if (tile_max > run_max[h]) { // rescale only when the running max grows
                    const float correction = exp2f(run_max[h] - tile_max);
                    run_sum[h] *= correction;
#pragma unroll
                    for (int e = 0; e < kF; ++e) acc[h][e] *= correction;
                    run_max[h] = tile_max;
                }
                const float ref = run_max[h] == -CUDART_INF_F ? 0.0f : run_max[h];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    score[r][h] = exp2f(score[r][h] - ref); // masked: exp2(-inf) = 0
                    run_sum[h] += score[r][h];
                }
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float v[kF];
#pragma unroll
                for (int c = 0; c < kPerLane; ++c)
                    chunk_to_float<T>(v_tile[rows[r] * S::kRowChunks + c * kLanes + j], &v[c * kVec]);
#pragma unroll
                for (int e = 0; e < kF; ++e) v[e] = visible[r] ? v[e] : 0.0f; // never 0 * NaN from unused slots
#pragma unroll
                for (int h = 0; h < kGroupTile; ++h) {
#pragma unroll
                    for (int e = 0; e < kF; ++e) acc[h][e] = fmaf(score[r][h], v[e], acc[h][e]);
                }
            }
        }
        __syncthreads(); // the stage is overwritten by the next iteration's prefetch
    }
    cp_async_wait<0>();

    // Merge the row groups of each warp (butterfly over lanes with the same j).
#pragma unroll
    for (int offset = kLanes; offset < 32; offset *= 2) {
#pragma unroll
        for (int h = 0; h < kGroupTile; ++h) {
            const float other_max = __shfl_xor_sync(0xffffffffu, run_max[h], offset);
            const float other_sum = __shfl_xor_sync(0xffffffffu, run_sum[h], offset);
            const float new_max = fmaxf(run_max[h], other_max);
            const float ref = new_max == -CUDART_INF_F ? 0.0f : new_max;
            const float mine = exp2f(run_max[h] - ref), theirs = exp2f(other_max - ref);
            run_sum[h] = run_sum[h] * mine + other_sum * theirs;
#pragma unroll
            for (int e = 0; e < kF; ++e) {
                const float other = __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
                acc[h][e] = acc[h][e] * mine + other * theirs;
            }
            run_max[h] = new_max;
        }
    }

    // Then the warps, through shared memory (the tile buffers are free now).
    constexpr int kPadded = S::kRowChunks * kVec; // floats of a padded head row
    float *merge = reinterpret_cast<float *>(smem);
    __syncthreads();
    if (row_group == 0) {
#pragma unroll
        for (int h = 0; h < kGroupTile; ++h) {
#pragma unroll
            for (int c = 0; c < kPerLane; ++c) {
#pragma unroll
                for (int e = 0; e < kVec; e += 4) { // float4 stores: 2-way bank conflicts instead of 8-way
                    const float *a = &acc[h][c * kVec + e];
                    *reinterpret_cast<float4 *>(&merge[(warp * kGroupTile + h) * kPadded + (c * kLanes + j) * kVec + e]) =
                        make_float4(a[0], a[1], a[2], a[3]);
                }
            }
            if (j == 0) {
                max_smem[warp][h] = run_max[h];
                sum_smem[warp][h] = run_sum[h];
            }
        }
    }
    __syncthreads();

    const int32_t n_outputs = n_my_heads * p.head_dim;
    for (int32_t idx = threadIdx.x; idx < n_outputs; idx += kAttnThreads) {
        const int32_t h = idx / p.head_dim, d = idx % p.head_dim;
        float total_max = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) total_max = fmaxf(total_max, max_smem[w][h]);
        const float ref = total_max == -CUDART_INF_F ? 0.0f : total_max;
        float total_sum = 0.0f, total_acc = 0.0f;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) {
            const float weight = exp2f(max_smem[w][h] - ref);
            total_sum += sum_smem[w][h] * weight;
            total_acc += merge[(w * kGroupTile + h) * kPadded + d] * weight;
        }
        const bool empty = total_sum == 0.0f;
        const int64_t head_row = int64_t(qi) * p.n_heads + first_head + h;
        const int64_t part = head_row * p.n_splits + split;
        const float value = empty ? 0.0f : total_acc / total_sum;
        const float lse = empty ? -CUDART_INF_F : total_max * CUDART_LN2_F + logf(total_sum);
        if (p.n_splits == 1) {
            static_cast<T *>(p.out)[head_row * p.head_dim + d] = from_float<T>(value);
            if (d == 0 && p.lse) p.lse[head_row] = lse;
        } else {
            p.partial_out[part * p.head_dim + d] = value;
            if (d == 0) p.partial_lse[part] = lse;
        }
    }
    if (p.n_splits > 1 && p.split_counters) // the tile buffers are free again
        merge_if_last_split<T>(p, int64_t(qi) * p.n_heads + first_head, n_my_heads, reinterpret_cast<float *>(smem),
                               S::kSmemChunks * 4); // floats of the uint4 chunks
}

} // namespace conduit::kernels::cuda
