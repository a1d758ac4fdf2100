// attention_stats_mma.cu: the score passes of attention_stats on tensor cores (mma.sync m16n8k16,
// bf16/f16, head_dim 64 or 128): CONDUIT's and VL-Cache's scoring, a few hundred (query, head) rows
// per KV head against thousands of keys. Launches 2 and 4 are attention_stats.cu's.
//
// Both passes compute S = Q K^T with Q as the A operand and K as the B operand and the k-steps in the
// same order, so every score pass 2 recomputes is bit-identical to the one pass 1 took the max of
// (the exact count at threshold 1 depends on it). They differ in which operand stays in registers:
//   Pass 1 (mma_score_max_lse_kernel): FlashAttention-2's forward without P V. A warp keeps 16 rows
//     of Q as A fragments (rows query-major, as attention_mma.cu) and streams a split of 64-key
//     tiles through shared memory (for_each_key_tile); online base-2 max and sum per row; the
//     split's (max, log-sum-exp) go to the partials merge_score_stats reads.
//   Pass 2 (mma_key_stats_kernel): a warp keeps 32 keys of K as B fragments and streams the rows of
//     its KV head's row chunk through shared memory, 64 rows a stage. Rows are head-major (every
//     query of head 0 of the group, padded to 16, then head 1, ...). A lane owns 8 key columns and
//     two rows of each 16-row tile, so its share of each key's mass accumulates in registers over
//     all row tiles and the 8 lanes of a column are summed once, at the end; every row tile has one
//     head, so the count of scores below the cut is a register flushed when the head changes.
#include <algorithm>

#include "attention_mma_tile.cuh"
#include "attention_stats.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int32_t kScoreCtasPerSm = 4;   // pass 1: key tiles are split until this many CTAs per SM
constexpr int32_t kMaxScoreSplits = 256; // pass 1: bounds the partials per (query, head)
constexpr int32_t kKeyCtasPerSm = 4;     // pass 2: rows are chunked until this many CTAs per SM
constexpr int32_t kRowTile = 16;         // rows of an mma tile; pass 2 pads each head's queries to it

// Pass 2 geometry: kWarps warps of kWarpKeys keys each hold a key block; Q streams through kStages
// stages of kStageRows (query, head) rows (16-byte chunks, XOR-swizzled as attention_mma.cuh).
template <int kHeadDim> struct KeyPassShape {
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpKeys = 32;
    static constexpr int kWarpKeyTiles = kWarpKeys / 8; // n-tiles of S a warp owns
    static constexpr int kBlockKeys = kWarps * kWarpKeys;
    static constexpr int kStageRows = 64;
    static constexpr int kStages = 2;
    static constexpr int kRowChunks = kHeadDim / 8;
    static constexpr int kDimSteps = kHeadDim / 16;
    static constexpr int kKeyChunks = kBlockKeys * kRowChunks;
    static constexpr int kStageChunks = kStageRows * kRowChunks;
    static constexpr size_t kSmemBytes = size_t(kKeyChunks + kStages * kStageChunks) * 16;
};

// ---------------------------------------------------------------------------------------------
// Pass 1
// ---------------------------------------------------------------------------------------------

// Grid: x = tile of kRows query-major rows, y = KV head, z = split of tiles_per_split key tiles.
// Writes p.partial_max / p.partial_lse [n_q, n_heads, n_splits] (base 2; -inf where the split holds
// no key the row sees).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(MmaShape<kHeadDim>::kThreads)
    mma_score_max_lse_kernel(const AttentionParams p, int32_t tiles_per_split) {
    using S = MmaShape<kHeadDim>;
    extern __shared__ uint4 score_smem[];
    int32_t *pos_smem = reinterpret_cast<int32_t *>(score_smem + S::kStages * S::kTileChunks);
    const int32_t kv_head = blockIdx.y, split = blockIdx.z;

    const WarpRows rows = warp_rows<kHeadDim>(p, kv_head, blockIdx.x * S::kRows);
    uint32_t q_frag[S::kDimSteps][4];
    load_q<kHeadDim>(p, rows, q_frag);
    int32_t min_q_pos, max_q_pos;
    cta_q_pos_range<S::kWarps>(rows, min_q_pos, max_q_pos);
    if (!__syncthreads_and(rows.valid[0] && rows.valid[1])) min_q_pos = INT32_MIN; // padding rows: mask every tile

    float run_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, run_sum[2] = {0.0f, 0.0f}; // sums lane-partial
    const auto on_tile = [&](TileView view, const uint4 *k_tile, const int32_t *tile_pos, int32_t tile) {
        if (view == kTileHidden) return;
        float s[S::kKeyTiles][4], tile_max[2], ref[2], alpha[2];
        tile_scores<T, kHeadDim, S::kWarps>(q_frag, k_tile, s);
        mask_tile<S::kKeyTiles, true>(s, view, rows, tile_pos, min(S::kKeys, p.n_tokens - tile * S::kKeys),
                                     p.scale_log2, tile_max);
        rescale_running(tile_max, run_max, run_sum, ref, alpha);
#pragma unroll
        for (int n = 0; n < S::kKeyTiles; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) run_sum[j / 2] += fast_exp2(s[n][j] - ref[j / 2]); // masked: 2^-inf = 0
    };
    const int32_t n_tiles = (p.n_tokens + S::kKeys - 1) / S::kKeys;
    const int32_t tile_begin = split * tiles_per_split, tile_end = min(n_tiles, tile_begin + tiles_per_split);
    for_each_key_tile<T, kHeadDim, S::kWarps, false>(p, kv_head, tile_begin, tile_end, max_q_pos, min_q_pos,
                                                     score_smem, pos_smem, on_tile);

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float total = quad_sum(run_sum[r]);
        if (!rows.valid[r] || threadIdx.x % 4 != 0) continue;
        const int64_t part = rows.out_row[r] * p.n_splits + split;
        p.partial_max[part] = run_max[r];
        p.partial_lse[part] = total == 0.0f ? -CUDART_INF_F : run_max[r] + log2f(total);
    }
}

// ---------------------------------------------------------------------------------------------
// Pass 2
// ---------------------------------------------------------------------------------------------

// What pass 2 needs of each row of a Q stage besides its Q: its query's position, its base-2
// log-sum-exp and its cut (max2 + log2 threshold). Padding rows see nothing and add nothing.
template <int kRows> struct StageRows {
    int32_t q_pos[kRows];
    float lse2[kRows], cut[kRows];
};

// The (query, head) row q * n_heads + h of head-major row `row` of a KV head, or -1 for padding
// (a query index past n_q) and rows at or past row_end.
__device__ __forceinline__ int64_t head_major_row(const StatsParams &sp, int32_t kv_head, int32_t row, int32_t row_end) {
    const int32_t query = row % sp.padded_queries, head = kv_head * sp.a.group + row / sp.padded_queries;
    return row < row_end && query < sp.a.n_q ? int64_t(query) * sp.a.n_heads + head : -1;
}

// Issues the cp.async copies of the CTA's kBlockKeys K rows from block_start (zero rows past the end).
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_key_block(const AttentionParams &p, int32_t kv_head, int32_t block_start,
                                               uint4 *keys) {
    using S = KeyPassShape<kHeadDim>;
#pragma unroll
    for (int i = 0; i < S::kKeyChunks / S::kThreads; ++i) {
        const int32_t idx = int32_t(threadIdx.x) + i * S::kThreads;
        const int32_t row = idx / S::kRowChunks, chunk = idx % S::kRowChunks, slot = block_start + row;
        const bool ok = slot < p.n_tokens;
        cp_async16(keys + swizzled<S::kRowChunks>(row, chunk), ok ? paged_key_chunk<T, kHeadDim>(p, p.block_table, kv_head, slot, chunk) : p.pool, ok);
    }
}

// Issues the cp.async copies of rows [row0, row0 + kStageRows) (zero rows for padding) into a Q stage
// and stores their StageRows entries (plain stores: visible after the barrier that follows the wait).
template <int kHeadDim>
__device__ __forceinline__ void load_query_stage(const StatsParams &sp, int32_t kv_head, int32_t row0, int32_t row_end,
                                                 uint4 *stage, StageRows<KeyPassShape<kHeadDim>::kStageRows> &meta) {
    using S = KeyPassShape<kHeadDim>;
    const uint16_t *q = static_cast<const uint16_t *>(sp.a.q);
#pragma unroll
    for (int i = 0; i < S::kStageChunks / S::kThreads; ++i) {
        const int32_t idx = int32_t(threadIdx.x) + i * S::kThreads;
        const int32_t row = idx / S::kRowChunks, chunk = idx % S::kRowChunks;
        const int64_t head_row = head_major_row(sp, kv_head, row0 + row, row_end);
        cp_async16(stage + swizzled<S::kRowChunks>(row, chunk), head_row >= 0 ? q + head_row * kHeadDim + chunk * 8 : q,
                   head_row >= 0);
    }
    if (threadIdx.x < S::kStageRows) {
        const int64_t head_row = head_major_row(sp, kv_head, row0 + int32_t(threadIdx.x), row_end);
        const bool real = head_row >= 0;
        meta.q_pos[threadIdx.x] = real ? sp.a.q_pos[head_row / sp.a.n_heads] : INT32_MIN;
        meta.lse2[threadIdx.x] = real ? sp.lse2[head_row] : CUDART_INF_F;
        meta.cut[threadIdx.x] = real ? sp.max2[head_row] + sp.log2_threshold : -CUDART_INF_F;
    }
}

// The lane's key columns of the warp's kWarpKeys keys: 8n + 2t + c for n-tile n and c in {0, 1}.
template <int kWarpKeyTiles> struct LaneKeys {
    int32_t pos[kWarpKeyTiles][2];
    bool exists[kWarpKeyTiles][2];
};

template <int kWarpKeyTiles>
__device__ __forceinline__ LaneKeys<kWarpKeyTiles> lane_keys(const AttentionParams &p, int32_t warp_start) {
    LaneKeys<kWarpKeyTiles> keys;
    const int32_t t = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < kWarpKeyTiles; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int32_t slot = warp_start + 8 * n + 2 * t + c;
            keys.exists[n][c] = slot < p.n_tokens;
            keys.pos[n][c] = keys.exists[n][c] ? p.positions[slot] : INT32_MAX;
        }
    return keys;
}

// S = Q K^T of the 16 rows of row tile `tile` of a Q stage and the warp's keys (B fragments in k_frag):
// s[n] is n-tile n, lane holding rows g, g + 8 at keys 8n + 2t, +1.
template <typename T, int kHeadDim>
__device__ __forceinline__ void row_tile_scores(
    const uint4 *stage, int tile,
    const uint32_t (&k_frag)[KeyPassShape<kHeadDim>::kWarpKeyTiles][KeyPassShape<kHeadDim>::kDimSteps][2],
    float (&s)[KeyPassShape<kHeadDim>::kWarpKeyTiles][4]) {
    using S = KeyPassShape<kHeadDim>;
    const int lane = threadIdx.x % 32;
    const int row = kRowTile * tile + ((lane / 8) % 2) * 8 + lane % 8; // ldmatrix: matrices (rows 0-7 | 8-15) x (dims lo | hi)
#pragma unroll
    for (int n = 0; n < S::kWarpKeyTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[n][j] = 0.0f;
#pragma unroll
    for (int k = 0; k < S::kDimSteps; ++k) {
        uint32_t a[4];
        ldmatrix_x4(a, stage + swizzled<S::kRowChunks>(row, 2 * k + lane / 16));
#pragma unroll
        for (int n = 0; n < S::kWarpKeyTiles; ++n) mma_m16n8k16<T>(s[n], a, k_frag[n][k][0], k_frag[n][k][1]);
    }
}

// Folds one row tile's scores into the lane's key masses and its count of scores below the cut.
// `row`: the lane's first row (g) within the stage.
template <int kWarpKeyTiles, int kStageRows>
__device__ __forceinline__ void accumulate_row_tile(const float (&s)[kWarpKeyTiles][4], const StageRows<kStageRows> &meta,
                                                    int row, const LaneKeys<kWarpKeyTiles> &keys, float scale_log2,
                                                    float (&mass)[kWarpKeyTiles][2], unsigned &below) {
    int32_t q_pos[2];
    float lse2[2], cut[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        q_pos[r] = meta.q_pos[row + 8 * r];
        lse2[r] = meta.lse2[row + 8 * r];
        cut[r] = meta.cut[row + 8 * r];
    }
#pragma unroll
    for (int n = 0; n < kWarpKeyTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = j / 2, c = j % 2;
            const float score = s[n][j] * scale_log2; // as pass 1 scaled it: the same bits
            const bool seen = keys.exists[n][c] && keys.pos[n][c] <= q_pos[r];
            mass[n][c] += seen ? fast_exp2(score - lse2[r]) : 0.0f;
            below += seen && score < cut[r] ? 1u : 0u;
        }
}

// Adds the warp's count for head `head` of the group to the head's counter.
__device__ __forceinline__ void flush_below(const StatsParams &sp, int32_t kv_head, int32_t head, unsigned count) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) count += __shfl_xor_sync(0xffffffffu, count, offset);
    if (threadIdx.x % 32 == 0 && count > 0)
        atomicAdd(sp.below + kv_head * sp.a.group + head, (unsigned long long)count);
}

// Grid: x = block of kBlockKeys keys, y = KV head, z = chunk of sp.rows_per_chunk head-major rows.
// Writes partial mass row z * n_kv_heads + y for the block's keys and adds to sp.below.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(KeyPassShape<kHeadDim>::kThreads) mma_key_stats_kernel(const StatsParams sp) {
    using S = KeyPassShape<kHeadDim>;
    const AttentionParams &p = sp.a;
    extern __shared__ uint4 key_pass_smem[];
    __shared__ StageRows<S::kStageRows> stage_rows[S::kStages];
    uint4 *keys = key_pass_smem, *q_stages = key_pass_smem + S::kKeyChunks;
    const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int32_t kv_head = blockIdx.y, block_start = blockIdx.x * S::kBlockKeys;
    const int32_t warp_start = block_start + warp * S::kWarpKeys;
    const int32_t row_begin = blockIdx.z * sp.rows_per_chunk;
    const int32_t row_end = min(p.group * sp.padded_queries, row_begin + sp.rows_per_chunk);
    const int32_t n_stages = (row_end - row_begin + S::kStageRows - 1) / S::kStageRows;

    load_key_block<T, kHeadDim>(p, kv_head, block_start, keys);
    cp_async_commit();
    if (n_stages > 0) load_query_stage<kHeadDim>(sp, kv_head, row_begin, row_end, q_stages, stage_rows[0]);
    cp_async_commit();
    const LaneKeys<S::kWarpKeyTiles> lane_key = lane_keys<S::kWarpKeyTiles>(p, warp_start);
    cp_async_wait<1>(); // the keys
    __syncthreads();
    uint32_t k_frag[S::kWarpKeyTiles][S::kDimSteps][2];
#pragma unroll
    for (int k = 0; k < S::kDimSteps; ++k)
#pragma unroll
        for (int n = 0; n < S::kWarpKeyTiles / 2; ++n) {
            uint32_t b[4];
            load_key_pair<S::kRowChunks>(b, keys + warp * S::kWarpKeys * S::kRowChunks, n, k);
            k_frag[2 * n][k][0] = b[0];
            k_frag[2 * n][k][1] = b[1];
            k_frag[2 * n + 1][k][0] = b[2];
            k_frag[2 * n + 1][k][1] = b[3];
        }

    float mass[S::kWarpKeyTiles][2];
#pragma unroll
    for (int n = 0; n < S::kWarpKeyTiles; ++n) mass[n][0] = mass[n][1] = 0.0f;
    unsigned below = 0;
    int32_t below_head = row_begin / sp.padded_queries;
    for (int32_t stage = 0; stage < n_stages; ++stage) {
        if (stage + 1 < n_stages) {
            const int next = (stage + 1) % S::kStages;
            load_query_stage<kHeadDim>(sp, kv_head, row_begin + (stage + 1) * S::kStageRows, row_end,
                                       q_stages + next * S::kStageChunks, stage_rows[next]);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const uint4 *q_stage = q_stages + (stage % S::kStages) * S::kStageChunks;
        const int32_t stage_row0 = row_begin + stage * S::kStageRows;
#pragma unroll
        for (int tile = 0; tile < S::kStageRows / kRowTile; ++tile) {
            const int32_t tile_row0 = stage_row0 + tile * kRowTile;
            if (tile_row0 >= row_end) break; // warp-uniform
            const int32_t head = tile_row0 / sp.padded_queries;
            if (head != below_head) { // warp-uniform
                flush_below(sp, kv_head, below_head, below);
                below = 0;
                below_head = head;
            }
            float s[S::kWarpKeyTiles][4];
            row_tile_scores<T, kHeadDim>(q_stage, tile, k_frag, s);
            accumulate_row_tile(s, stage_rows[stage % S::kStages], kRowTile * tile + lane / 4, lane_key, p.scale_log2,
                                mass, below);
        }
        __syncthreads(); // the next iteration's copies overwrite this stage
    }
    flush_below(sp, kv_head, below_head, below);

    // Each key column is spread over the 8 lanes of equal t (rows g = 0..7): sum them, fixed order.
    float *partial = sp.partial_mass + (int64_t(blockIdx.z) * gridDim.y + kv_head) * p.n_tokens;
#pragma unroll
    for (int n = 0; n < S::kWarpKeyTiles; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float total = mass[n][c];
#pragma unroll
            for (int offset = 4; offset < 32; offset *= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
            if (lane < 4 && lane_key.exists[n][c]) partial[warp_start + 8 * n + 2 * lane + c] = total;
        }
}

// ---------------------------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------------------------

template <typename T, int kHeadDim>
void launch_typed(const AttentionParams &p, float threshold, float *mass, float *n_below, float *lse,
                  const float *lse_in, cudaStream_t stream) {
    using Score = MmaShape<kHeadDim>;
    using Key = KeyPassShape<kHeadDim>;
    const int64_t sms = sm_count();

    // Pass 1: key tiles split until the grid fills the GPU.
    const int64_t row_tiles = (int64_t(p.n_q) * p.group + Score::kRows - 1) / Score::kRows;
    const int64_t key_tiles = (int64_t(p.n_tokens) + Score::kKeys - 1) / Score::kKeys;
    int64_t splits = (kScoreCtasPerSm * sms + row_tiles * p.n_kv_heads - 1) / (row_tiles * p.n_kv_heads);
    splits = std::max<int64_t>(std::min<int64_t>({splits, key_tiles, int64_t(kMaxScoreSplits)}), 1);
    const int64_t tiles_per_split = std::max<int64_t>((key_tiles + splits - 1) / splits, 1);
    // 0 without keys, or with the lse given (no score pass)
    const int32_t n_splits = lse_in ? 0 : int32_t((key_tiles + tiles_per_split - 1) / tiles_per_split);

    // Pass 2: the head-major rows chunked (whole stages) only where the key blocks leave SMs idle.
    const int32_t padded_queries = (p.n_q + kRowTile - 1) / kRowTile * kRowTile;
    const int64_t n_stages = (int64_t(p.group) * padded_queries + Key::kStageRows - 1) / Key::kStageRows;
    const int64_t key_ctas = (int64_t(p.n_tokens) + Key::kBlockKeys - 1) / Key::kBlockKeys * p.n_kv_heads;
    int64_t row_chunks = 1;
    if (key_ctas > 0 && key_ctas < kKeyCtasPerSm * sms)
        row_chunks = std::min<int64_t>((kKeyCtasPerSm * sms + key_ctas - 1) / key_ctas, n_stages);
    row_chunks = std::max<int64_t>(std::min<int64_t>(row_chunks, 65535), 1);
    const int64_t stages_per_chunk = (n_stages + row_chunks - 1) / row_chunks;
    row_chunks = (n_stages + stages_per_chunk - 1) / stages_per_chunk;

    StatsParams sp = prepare_stats(p, n_splits, int32_t(row_chunks * p.n_kv_heads), threshold, n_below != nullptr, stream);
    sp.padded_queries = padded_queries;
    sp.rows_per_chunk = int32_t(stages_per_chunk * Key::kStageRows);
    if (n_splits > 0) {
        allow_dynamic_smem<&mma_score_max_lse_kernel<T, kHeadDim>>(Score::kKeySmemBytes); // 3 stages: 49 KiB at 128
        const dim3 grid{unsigned(row_tiles), unsigned(p.n_kv_heads), unsigned(n_splits)};
        mma_score_max_lse_kernel<T, kHeadDim><<<grid, Score::kThreads, Score::kKeySmemBytes, stream>>>(
            sp.a, int32_t(tiles_per_split));
        CUDA_CHECK_LAUNCH("mma_score_max_lse_kernel");
    }
    if (lse_in) given_score_stats(sp, lse_in, stream);
    else merge_score_stats(sp, lse, stream);
    if (key_ctas > 0) {
        allow_dynamic_smem<&mma_key_stats_kernel<T, kHeadDim>>(Key::kSmemBytes);
        const dim3 grid{unsigned(key_ctas / p.n_kv_heads), unsigned(p.n_kv_heads), unsigned(row_chunks)};
        mma_key_stats_kernel<T, kHeadDim><<<grid, Key::kThreads, Key::kSmemBytes, stream>>>(sp);
        CUDA_CHECK_LAUNCH("mma_key_stats_kernel");
    }
    reduce_key_stats(sp, mass, n_below, stream);
}

} // namespace

bool mma_stats_applies(DType dtype, int32_t head_dim, const void *q) {
    return mma_tiles_fit(dtype, head_dim) && aligned16(q);
}

void launch_mma_stats(const AttentionParams &p, DType dtype, float threshold, float *mass, float *n_below, float *lse,
                      const float *lse_in, cudaStream_t stream) {
    require(mma_stats_applies(dtype, p.head_dim, p.q), "shape not supported by the mma attention_stats");
    const bool bf16 = dtype == DType::BF16;
    if (p.head_dim == 64) {
        if (bf16) launch_typed<__nv_bfloat16, 64>(p, threshold, mass, n_below, lse, lse_in, stream);
        else launch_typed<__half, 64>(p, threshold, mass, n_below, lse, lse_in, stream);
    } else {
        if (bf16) launch_typed<__nv_bfloat16, 128>(p, threshold, mass, n_below, lse, lse_in, stream);
        else launch_typed<__half, 128>(p, threshold, mass, n_below, lse, lse_in, stream);
    }
}

} // namespace conduit::kernels::cuda
