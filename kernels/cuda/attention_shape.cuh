// attention_shape.cuh: what the attention kernels share with their host code: the launch
// parameters, the tile geometry of each instantiation and the dispatch from (dtype, head_dim, GQA
// group) to an instantiation. Kernels: attention_kernel.cuh; host: attention.cu, attention_stats.cu.
#pragma once

#include "rope.cuh"

namespace conduit::kernels::cuda {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnStages = 2;

struct AttentionParams {
    const void *pool;
    const int32_t *block_table; // [ceil(n_tokens / block_size)]
    const int32_t *positions;   // [n_tokens], or null: every slot is visible (decode steps)
    const int32_t *seq_n_tokens; // [n_q] or null. Set for a decode step over a batch of sequences:
                                 // query i reads seq_n_tokens[i] slots through the block table at
                                 // block_table + i * table_stride, and n_tokens is only the capacity
    int64_t table_stride;
    int64_t block_elems;
    int64_t v_delta;     // elements from a K row to its V row
    int64_t block_bytes; // bytes of one block (read by the fp8 decode kernel: LayerView::block_bytes)
    int32_t n_tokens, n_kv_heads, head_dim, block_shift;
    int32_t n_q, n_heads, group, head_tiles;
    const void *q;          // [n_q, n_heads, head_dim]
    const int32_t *q_pos;   // [n_q], or null with positions null
    bool q_vector;          // q is 16-byte aligned
    float scale_log2;       // scale * log2(e)
    void *out;              // [n_q, n_heads, head_dim], written when n_splits == 1
    float *lse;             // [n_q, n_heads] or null, written when n_splits == 1
    float *partial_out;     // [n_q, n_heads, n_splits, head_dim] float32, when n_splits > 1
    float *partial_lse;     // [n_q, n_heads, n_splits] float32: attention's, when n_splits > 1, natural
                            // log; attention_stats pass 1's, base 2 (of scores * log2 e)
    float *partial_max;     // [n_q, n_heads, n_splits] float32, base-2 score max (attention_stats pass 1)
    uint32_t *split_counters; // [n_q * gridDim.y] or null: the split kernels that take them
                              // (attention_merge.cuh) merge in the last CTA of each row group; zero
                              // before the launch, zero after it. Null: the caller merges (attention.cu)
    int32_t n_splits;
    int32_t split_tokens;   // slots per split, a multiple of the tile rows (with seq_n_tokens: derived per
                            // query from its length by split_tokens_for)
    bool trim_to_visible;   // scan positions first and stream only [first, last] visible slot
    bool tiles_before_wait; // a decode step over a batch (seq_n_tokens set, positions null): only each
                            // sequence's last slot is the previous kernels' (the step's K/V write), so
                            // the first tiles below it may stream before wait_for_prior_grids()
    // A decode step's new rows, written by the attention itself (batch_write_attention), or null:
    // K, V [n_q, n_kv_heads, head_dim] into each sequence's last slot, K rotated at new_rope_pos
    // (int32 [n_q] or [3, n_q]; null: not rotated) with `rope` (write_new_row).
    const void *new_k;
    const void *new_v;
    const int32_t *new_rope_pos;
    Rope rope;
};

constexpr int32_t kMinSplitTokens = 128; // below this a split's fixed cost outweighs the parallelism

// Slots per split when a query's n_tokens slots are shared by n_splits splits: a multiple of
// tile_rows, at least kMinSplitTokens (rounded up), so short sequences leave the last splits empty.
__host__ __device__ inline int32_t split_tokens_for(int32_t n_tokens, int32_t n_splits, int32_t tile_rows) {
    const int32_t per_split = (n_tokens + n_splits - 1) / n_splits;
    const int32_t floor = (kMinSplitTokens + tile_rows - 1) / tile_rows * tile_rows;
    const int32_t rounded = (per_split + tile_rows - 1) / tile_rows * tile_rows;
    return rounded > floor ? rounded : floor;
}

// Tiles of a CTA's split [begin, ...) that it may load before wait_for_prior_grids(), at most
// `ahead` (its pipeline depth) and n_tiles: with p.tiles_before_wait, those wholly below the last slot
// (n_tokens - 1), which the step writes just before (the K/V write kernel, or the attention kernel
// itself after its wait: write_new_row). Everything else they read
// (the lengths, the block tables, older K/V) was written before the step's first kernel: by
// conduit_step_prepare and earlier steps. Loading them early overlaps the pipeline's cold start with
// the kernels before it. Never with
// positions: the early tiles are loaded before q's position is read, so nothing may mask them.
__device__ __forceinline__ int32_t tiles_before_wait(const AttentionParams &p, int32_t begin, int32_t n_tokens,
                                                     int32_t tile_rows, int32_t n_tiles, int32_t ahead) {
    if (!p.tiles_before_wait || p.positions || n_tokens - 1 <= begin) return 0;
    return min(min((n_tokens - 1 - begin) / tile_rows, n_tiles), ahead);
}

// The first and the last slot of [begin, end) visible at q_position (positions[slot] <= q_position;
// last = -1 when none is): one scan of the positions, 4 bytes a slot, coalesced, against the K and V
// rows a slot outside them would stream. Both many-query kernels narrow their key range with it
// (trim_to_visible, visible_tile_end). Call from all threads of a CTA of kWarps warps; kOneCallSite
// false where they call it from more than one place in the code (the warp-specialized loop: the
// producer's branch and the consumers'), which takes the unaligned CTA barrier. (Not everywhere: for
// sm_80 ptxas wraps the unaligned one in a reconvergence, BSSY / BSYNC, and two more barriers a kernel
// in attention_mma.cu; for sm_90a the code is the same.)
struct SlotBounds {
    int32_t first, last;
};

template <int kWarps, bool kOneCallSite = true>
__device__ __forceinline__ SlotBounds visible_slot_bounds(const int32_t *positions, int32_t q_position, int32_t begin,
                                                          int32_t end) {
    __shared__ int32_t warp_bounds[2][kWarps];
    int32_t first = INT32_MAX, last = -1;
#pragma unroll 4
    for (int32_t slot = begin + int32_t(threadIdx.x); slot < end; slot += 32 * kWarps)
        if (positions[slot] <= q_position) {
            first = min(first, slot);
            last = slot;
        }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        first = min(first, __shfl_xor_sync(0xffffffffu, first, offset));
        last = max(last, __shfl_xor_sync(0xffffffffu, last, offset));
    }
    if (threadIdx.x % 32 == 0) {
        warp_bounds[0][threadIdx.x / 32] = first;
        warp_bounds[1][threadIdx.x / 32] = last;
    }
    if constexpr (kOneCallSite)
        __syncthreads();
    else
        cta_barrier_any_site(); // (common.cuh: why __syncthreads will not do)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        first = min(first, warp_bounds[0][w]);
        last = max(last, warp_bounds[1][w]);
    }
    return {first, last};
}

// The step's new K and V rows (AttentionParams::new_k) of sequence qi and KV head kv_head into its
// last slot (n_tokens - 1, through its block table `table`), K rotated as write_last rotates it
// (rope.cuh: the same bits), V as is. Every CTA whose split holds that slot writes the row before it
// loads it (the head tiles of one KV head write the same bytes), so no other kernel has to run
// between the projection and the attention. Call from every thread; the __syncthreads() after it
// makes the row visible to the CTA's own loads.
template <typename T>
__device__ void write_new_row(const AttentionParams &p, const int32_t *table, int32_t qi, int32_t kv_head,
                              int32_t n_tokens) {
    const int32_t slot = n_tokens - 1;
    T *k_out = static_cast<T *>(const_cast<void *>(p.pool)) + table[slot >> p.block_shift] * p.block_elems +
               ((int64_t(kv_head) << p.block_shift) + (slot & ((1 << p.block_shift) - 1))) * p.head_dim;
    T *v_out = k_out + p.v_delta;
    const int64_t row = (int64_t(qi) * p.n_kv_heads + kv_head) * p.head_dim;
    const T *k_in = static_cast<const T *>(p.new_k) + row, *v_in = static_cast<const T *>(p.new_v) + row;
    const int32_t nf = p.new_rope_pos ? p.rope.n_freq : 0;
    for (int32_t e = threadIdx.x; e < p.head_dim; e += blockDim.x) {
        v_out[e] = v_in[e];
        if (e < nf) { // the pair (e, e + nf)
            float c, s;
            rope_cos_sin(p.rope, p.new_rope_pos, p.n_q, qi, e, c, s);
            const float low = to_float(k_in[e]), high = to_float(k_in[e + nf]);
            k_out[e] = from_float<T>(rotated_low(low, high, c, s));
            k_out[e + nf] = from_float<T>(rotated_high(low, high, c, s));
        } else if (e >= 2 * nf) {
            k_out[e] = k_in[e];
        }
    }
}

// The end of a decode kernel's prologue, after the tiles it loaded early (tiles_before_wait): waits
// for the kernels before (common.cuh), lets the next be scheduled, writes the step's new row when
// this CTA's split [begin, end) holds it (write_new_row, then a barrier that publishes it to the
// CTA's loads) and returns the query's position (INT32_MAX without positions). All threads call it.
template <typename T>
__device__ __forceinline__ int32_t finish_prologue(const AttentionParams &p, const int32_t *table, int32_t qi,
                                                   int32_t kv_head, int32_t n_tokens, int32_t begin, int32_t end) {
    wait_for_prior_grids();
    allow_dependent_launch();
    if (p.new_k && begin <= n_tokens - 1 && n_tokens - 1 < end) { // CTA-uniform
        write_new_row<T>(p, table, qi, kv_head, n_tokens);
        __syncthreads();
    }
    return p.q_pos ? p.q_pos[qi] : INT32_MAX;
}

// Fills AttentionParams from a layer and the queries, checking the kernels' preconditions
// (attention.cu).
AttentionParams attention_params(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q,
                                 const int32_t *q_pos, float scale);
// Sets p.split_tokens (a multiple of tile_rows, at least min_split_tokens unless one split covers
// everything) and p.n_splits: the keys split until the CTAs fill one wave of resident_ctas (attention.cu).
void plan_splits(AttentionParams &p, int32_t tile_rows, int32_t min_split_tokens, int64_t resident_ctas);

// Tile geometry of one instantiation: T storage type, kLanes lanes per key row, kPerLane 16-byte
// chunks per lane (kLanes * kPerLane * kChunk<T> >= head_dim), kGroupTile query heads per CTA.
template <typename T, int kLanes, int kPerLane, int kGroupTile> struct AttnShape {
    static constexpr int kVec = kChunk<T>;
    static constexpr int kLanesPerRow = kLanes, kChunksPerLane = kPerLane;
    static constexpr int kRowChunks = kLanes * kPerLane;           // 16-byte chunks of a padded row
    static constexpr int kFloats = kPerLane * kVec;                // floats per lane per head
    static constexpr int kGroupsPerWarp = 32 / kLanes;
    static constexpr int kRowsPerGroup = 4 / kPerLane;             // rows a group takes per tile
    static constexpr int kTileRows = kAttnWarps * kGroupsPerWarp * kRowsPerGroup; // 512 / kRowChunks
    static constexpr int kTileChunks = kTileRows * kRowChunks;     // 512 (8 KiB) per tensor
    static constexpr int kStageChunks = 2 * kTileChunks;           // K then V
    static constexpr int kMergeFloats = kAttnWarps * kGroupTile * kRowChunks * kVec;
    static constexpr int kSmemChunks =
        kAttnStages * kStageChunks > kMergeFloats / 4 ? kAttnStages * kStageChunks : kMergeFloats / 4;
};

// Query heads per CTA: the smallest of 1, 2, 4, 8 that holds the GQA group (larger groups take
// several head tiles, each reading the KV again).
inline int32_t group_tile_for(int32_t group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

template <typename T, int kLanes, int kPerLane, int kGroupTile> struct ShapeTag {
    using type = T;
    static constexpr int lanes = kLanes, per_lane = kPerLane, group_tile = kGroupTile;
};

template <typename T, int kLanes, int kPerLane, typename F> void dispatch_group_tile(int32_t group, F &&f) {
    switch (group_tile_for(group)) {
    case 1: return f(ShapeTag<T, kLanes, kPerLane, 1>{});
    case 2: return f(ShapeTag<T, kLanes, kPerLane, 2>{});
    case 4: return f(ShapeTag<T, kLanes, kPerLane, 4>{});
    default: return f(ShapeTag<T, kLanes, kPerLane, 8>{});
    }
}

// Calls f(ShapeTag<T, lanes, per_lane, group_tile>{}) for a head_dim (a multiple of 8 in [8, 256])
// and GQA group. Lanes per key row: the power of two (>= 4) covering head_dim in 16-byte chunks;
// float32 rows of more than 32 chunks (head_dim > 128) give each lane two chunks.
template <typename T, typename F> void dispatch_shape(int32_t head_dim, int32_t group, F &&f) {
    const int32_t chunks = head_dim / kChunk<T>;
    if (chunks <= 4) return dispatch_group_tile<T, 4, 1>(group, f);
    if (chunks <= 8) return dispatch_group_tile<T, 8, 1>(group, f);
    if (chunks <= 16) return dispatch_group_tile<T, 16, 1>(group, f);
    if (chunks <= 32) return dispatch_group_tile<T, 32, 1>(group, f);
    if constexpr (sizeof(T) == 4) return dispatch_group_tile<T, 32, 2>(group, f);
    require(false, "head_dim too large");
}

} // namespace conduit::kernels::cuda
