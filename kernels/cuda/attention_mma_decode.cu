// attention_mma_decode.cu: split-KV decode attention on tensor cores (mma.sync m16n8k16, sm_80+) for
// bf16/f16 layers with head_dim 64 or 128 and GQA groups of 2..16: one query per sequence, every
// stored key of its split range.
//
// Why: the CUDA-core kernel (attention_kernel.cuh) spends 2 * group * head_dim FMAs per key plus
// conversions and shuffles, which for a group of 4 leaves it issue-bound well below copy bandwidth.
// Here the `group` query heads that share a KV head are the rows of one m16n8k16 A tile (rows past
// the group are zero), so 16 keys cost 2 * head_dim / 16 * 2 mma instructions per warp, whatever the
// group, and the kernel is left bound by the K/V stream. Multi-head attention (group 1) stays on the
// CUDA-core kernel: with one row of sixteen used, the tile's padding costs more than the 2 * head_dim
// FMAs per key it replaces, so decode_mma_applies keeps group 1 off this kernel.
//
// Grid: x = query (sequence), y = KV head, z = split of its keys; the split plan, the partials
// layout and the merge are those of the CUDA-core kernel (attention.cu). Per CTA (4 warps):
//   1. All threads stream tiles of kTileKeys slots (K, V: 16-byte chunks, XOR-swizzled as in
//      attention_mma.cu) from the paged pool by cp.async through kStages stages. Slots past the end
//      or hidden by position are zero-filled and flagged invisible.
//   2. Warp w takes keys [16 w, 16 w + 16) of every tile: S = Q K^T (16 rows x 16 keys), masked,
//      online softmax in fp32 base 2, then O += P V with P re-packed into an A fragment. Each warp
//      so streams a quarter of the CTA's keys with its own (max, sum, O).
//   3. The warps' (max, sum, O) are merged through shared memory and the CTA writes out/lse (one
//      split) or its partial and natural-log lse (several splits).
//
// Over an fp8 pool the decode runs in attention_decode_fp8.cu.
//
// Fragment layouts (g = lane / 4, t = lane % 4; PTX ISA, m16n8k16):
//   A (Q or P, 16 x 16): a[0] = row g, cols 2t, 2t+1; a[1] = row g+8, same cols; a[2], a[3] = the
//   same rows at cols 8+2t, 8+2t+1. Q's cols are dims 16k.., P's cols are the warp's 16 keys.
//   C (S or O, 16 x 8): c[0], c[1] = row g, cols 2t, 2t+1; c[2], c[3] = row g+8, same cols.
//   Rows are query heads: row r = head kv_head * group + r. With group <= 8 (kTall false) rows
//   g+8 are padding and their softmax is skipped (a[1] = a[3] = 0).
#include <math_constants.h>

#include "attention_mma_tile.cuh" // the mma primitives, quad_max/quad_sum
#include "decode_dispatch.cuh"

namespace conduit::kernels::cuda {
namespace {

template <int kHeadDim> struct DecodeShape {
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpKeys = 16;                       // keys of each tile one warp takes
    static constexpr int kTileKeys = kWarps * kWarpKeys;       // slots per pipeline stage
    static_assert(kTileKeys == kDecodeMmaTileKeys, "the split plan rounds to this tile");
    // cp.async stages of K/V tiles: 2 (64 KiB at head_dim 128) fit three CTAs on an SM of 228 KiB,
    // and more CTAs in flight stream the keys faster than deeper pipelines in fewer CTAs.
    static constexpr int kStages = 2;
    static constexpr int kRowChunks = kHeadDim / 8;            // 16-byte chunks of a K or V row
    static constexpr int kTileChunks = kTileKeys * kRowChunks; // one K (or V) tile
    static constexpr int kStageChunks = 2 * kTileChunks;       // K then V
    static constexpr int kDimSteps = kHeadDim / 16;            // k-steps of Q K^T
    static constexpr int kDimTiles = kHeadDim / 8;             // n-tiles of O = P V
    // The warps' O rows at the end, padded by 8 floats so that the 8 rows of a store phase fall in
    // different banks.
    static constexpr int kMergeStride = kHeadDim + 8;
    static constexpr size_t kStageBytes = size_t(kStages) * kStageChunks * 16;
    static constexpr size_t kMergeBytes = size_t(kWarps) * 16 * kMergeStride * 4;
    static constexpr size_t kSmemBytes = kStageBytes > kMergeBytes ? kStageBytes : kMergeBytes;
};

// Issues the cp.async copies of the tile at tile_start (K and V rows of kv_head through `table`)
// into `stage`, and records in `visible` which of its slots the query sees: slots before `end`
// whose position (when the layer has positions) is at most q_position. Invisible slots are
// zero-filled: their K/V may be garbage or NaN, and 0 * NaN in P V would poison the output.
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_decode_tile(const AttentionParams &p, const int32_t *table, int32_t kv_head,
                                                 int32_t tile_start, int32_t end, int32_t q_position, uint4 *stage,
                                                 bool *visible) {
    using S = DecodeShape<kHeadDim>;
    copy_key_tile<T, kHeadDim, S::kThreads, S::kTileKeys, true>(
        p, TileBlocks<kHeadDim, S::kThreads, S::kTileKeys>(p, table, tile_start, end), kv_head, tile_start, stage,
        [&](int32_t row) {
            const int32_t slot = tile_start + row;
            return slot < end && (!p.positions || p.positions[slot] <= q_position);
        },
        [&](int32_t row, bool seen) { visible[row] = seen; }); // read after the barrier that publishes the stage
}

// Q rows of the CTA as A fragments (load_q): fragment row r is head r of the group, rows at or past
// the group are zero.
template <int kHeadDim>
__device__ __forceinline__ void load_group_q(const AttentionParams &p, int32_t qi, int32_t kv_head,
                                             uint32_t (&q_frag)[kHeadDim / 16][4]) {
    const int32_t g = threadIdx.x % 32 / 4;
    WarpRows rows{};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        rows.out_row[r] = int64_t(qi) * p.n_heads + kv_head * p.group + g + 8 * r;
        rows.valid[r] = g + 8 * r < p.group;
    }
    load_q<kHeadDim>(p, rows, q_frag);
}

// One warp's softmax state over the keys it has seen: per fragment row half (g, g+8) the running
// max and lane-partial sum (base 2), and O for rows g, g+8 at dims 8n + 2t, +1 (C layout).
template <int kHeadDim> struct WarpSoftmax {
    float acc[kHeadDim / 8][4];
    float run_max[2];
    float run_sum[2];
};

// Folds the warp's 16 keys of the current tile (rows first_key.. of k_tile/v_tile) into `state`.
template <typename T, int kHeadDim, bool kTall>
__device__ __forceinline__ void attend_warp_keys(const AttentionParams &p, const uint32_t (&q_frag)[kHeadDim / 16][4],
                                                 const uint4 *k_tile, const uint4 *v_tile, const bool *visible,
                                                 int32_t first_key, WarpSoftmax<kHeadDim> &state) {
    using S = DecodeShape<kHeadDim>;
    constexpr int kHalves = kTall ? 2 : 1; // fragment row halves that hold query heads
    const int32_t lane = threadIdx.x % 32, t = lane % 4;
    // This lane's score columns: keys 8n + 2t + c of the warp's slice.
    bool seen[2][2];
    bool any_seen = false;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            seen[n][c] = visible[first_key + 8 * n + 2 * t + c];
            any_seen |= seen[n][c];
        }
    if (!__any_sync(0xffffffffu, any_seen)) return; // warp-uniform: a tail or hidden slice costs no math

    // S = Q K^T. ldmatrix matrices: (keys 0..7 | 8..15) x (dim chunk 2k | 2k+1); registers b[0], b[1]
    // are the B fragment of keys 0..7, b[2], b[3] of keys 8..15.
    float s[2][4] = {};
#pragma unroll
    for (int k = 0; k < S::kDimSteps; ++k) {
        uint32_t b[4];
        const int key = first_key + (lane / 16) * 8 + lane % 8;
        ldmatrix_x4(b, k_tile + swizzled<S::kRowChunks>(key, 2 * k + (lane / 8) % 2));
        mma_m16n8k16<T>(s[0], q_frag[k], b[0], b[1]);
        mma_m16n8k16<T>(s[1], q_frag[k], b[2], b[3]);
    }

    // Mask, scale to base 2, and move the running max; O and the sums are rescaled only when some
    // row's max grew (after the first tiles, rarely).
    float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int half = j / 2;
            if (half >= kHalves) continue;
            s[n][j] = seen[n][j % 2] ? s[n][j] * p.scale_log2 : -CUDART_INF_F;
            tile_max[half] = fmaxf(tile_max[half], s[n][j]);
        }
    float ref[2] = {0.0f, 0.0f}, alpha[2] = {1.0f, 1.0f};
    bool grew = false;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
        const float new_max = fmaxf(state.run_max[h], quad_max(tile_max[h]));
        ref[h] = new_max == -CUDART_INF_F ? 0.0f : new_max; // nothing seen yet: p = 0
        grew |= new_max > state.run_max[h];
        alpha[h] = fast_exp2(state.run_max[h] - ref[h]);
        state.run_max[h] = new_max;
    }
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) state.run_sum[h] *= alpha[h];
#pragma unroll
        for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j / 2 < kHalves) state.acc[n][j] *= alpha[j / 2];
    }

    // P as the A fragment over the warp's 16 keys: cols 0..7 from s[0], 8..15 from s[1].
    uint32_t a[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
            const float p0 = fast_exp2(s[n][2 * h] - ref[h]), p1 = fast_exp2(s[n][2 * h + 1] - ref[h]);
            state.run_sum[h] += p0 + p1;
            a[2 * n + h] = pack2<T>(p0, p1);
        }

    // O += P V. ldmatrix.trans matrices: (keys 0..7 | 8..15) x (dim chunk 2n | 2n+1), transposed into
    // B fragments: b[0], b[1] for dims 16n..16n+7, b[2], b[3] for 16n+8...
#pragma unroll
    for (int n = 0; n < S::kDimTiles / 2; ++n) {
        uint32_t b[4];
        const int key = first_key + ((lane / 8) % 2) * 8 + lane % 8;
        ldmatrix_x4_trans(b, v_tile + swizzled<S::kRowChunks>(key, 2 * n + lane / 16));
        mma_m16n8k16<T>(state.acc[2 * n], a, b[0], b[1]);
        mma_m16n8k16<T>(state.acc[2 * n + 1], a, b[2], b[3]);
    }
}

// Merges the warps' states through shared memory (the stage buffers, free by now) and writes the
// CTA's rows: out and lse for a single split, else the split's partial and natural-log lse.
template <typename T, int kHeadDim, bool kTall>
__device__ __forceinline__ void merge_and_store(const AttentionParams &p, int32_t qi, int32_t kv_head, int32_t split,
                                                WarpSoftmax<kHeadDim> &state, float *merge) {
    using S = DecodeShape<kHeadDim>;
    constexpr int kHalves = kTall ? 2 : 1;
    __shared__ float warp_max[S::kWarps][16], warp_sum[S::kWarps][16];
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
        const float total = quad_sum(state.run_sum[h]);
        const int32_t row = g + 8 * h;
        if (row >= p.group) continue;
        float *dst = merge + (warp * 16 + row) * S::kMergeStride + 2 * t;
#pragma unroll
        for (int n = 0; n < S::kDimTiles; ++n)
            *reinterpret_cast<float2 *>(dst + 8 * n) = make_float2(state.acc[n][2 * h], state.acc[n][2 * h + 1]);
        if (t == 0) {
            warp_max[warp][row] = state.run_max[h];
            warp_sum[warp][row] = total;
        }
    }
    __syncthreads();

    for (int32_t idx = threadIdx.x; idx < p.group * kHeadDim; idx += S::kThreads) {
        const int32_t row = idx / kHeadDim, d = idx % kHeadDim;
        float total_max = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < S::kWarps; ++w) total_max = fmaxf(total_max, warp_max[w][row]);
        const float ref = total_max == -CUDART_INF_F ? 0.0f : total_max;
        float total_sum = 0.0f, total_acc = 0.0f;
#pragma unroll
        for (int w = 0; w < S::kWarps; ++w) {
            const float weight = exp2f(warp_max[w][row] - ref);
            total_sum += warp_sum[w][row] * weight;
            total_acc += merge[(w * 16 + row) * S::kMergeStride + d] * weight;
        }
        const bool empty = total_sum == 0.0f;
        const float value = empty ? 0.0f : total_acc / total_sum;
        const float lse = empty ? -CUDART_INF_F : total_max * CUDART_LN2_F + logf(total_sum);
        const int64_t head_row = int64_t(qi) * p.n_heads + kv_head * p.group + row;
        if (p.n_splits == 1) {
            static_cast<T *>(p.out)[head_row * kHeadDim + d] = from_float<T>(value);
            if (d == 0 && p.lse) p.lse[head_row] = lse;
        } else {
            const int64_t part = head_row * p.n_splits + split;
            p.partial_out[part * kHeadDim + d] = value;
            if (d == 0) p.partial_lse[part] = lse;
        }
    }
}

template <typename T, int kHeadDim, bool kTall>
__global__ void __launch_bounds__(DecodeShape<kHeadDim>::kThreads) decode_mma_kernel(const AttentionParams p) {
    using S = DecodeShape<kHeadDim>;
    extern __shared__ uint4 decode_smem[];
    __shared__ bool visible_smem[S::kStages][S::kTileKeys];
    const int32_t qi = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const int32_t warp = threadIdx.x / 32;

    const int32_t *table = p.block_table;
    int32_t n_tokens = p.n_tokens, split_tokens = p.split_tokens;
    if (p.seq_n_tokens) { // a decode step over a batch: this query's own sequence
        n_tokens = p.seq_n_tokens[qi];
        table += qi * p.table_stride;
        split_tokens = split_tokens_for(n_tokens, p.n_splits, S::kTileKeys);
    }
    const int32_t begin = min(n_tokens, split * split_tokens);
    const int32_t end = min(n_tokens, begin + split_tokens);
    const int32_t n_tiles = (end - begin + S::kTileKeys - 1) / S::kTileKeys;

    // Launched chained (common.cuh): q and the new K/V are the previous kernels'. The first tiles that
    // hold neither stream before the wait (tiles_before_wait), the rest of the first stages after it.
    const int32_t early = tiles_before_wait(p, begin, n_tokens, S::kTileKeys, n_tiles, S::kStages - 1);
    for (int tile = 0; tile < early; ++tile) {
        load_decode_tile<T, kHeadDim>(p, table, kv_head, begin + tile * S::kTileKeys, end, INT32_MAX, // no positions
                                      decode_smem + tile * S::kStageChunks, visible_smem[tile]);
        cp_async_commit();
    }
    const int32_t q_position = finish_prologue<T>(p, table, qi, kv_head, n_tokens, begin, end);

    uint32_t q_frag[S::kDimSteps][4];
    load_group_q<kHeadDim>(p, qi, kv_head, q_frag);
    WarpSoftmax<kHeadDim> state;
#pragma unroll
    for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) state.acc[n][j] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        state.run_max[h] = -CUDART_INF_F;
        state.run_sum[h] = 0.0f;
    }

    for (int tile = early; tile < S::kStages - 1; ++tile) { // one commit group per stage, as the loop counts them
        if (tile < n_tiles)
            load_decode_tile<T, kHeadDim>(p, table, kv_head, begin + tile * S::kTileKeys, end, q_position,
                                          decode_smem + tile * S::kStageChunks, visible_smem[tile]);
        cp_async_commit();
    }
    for (int32_t tile = 0; tile < n_tiles; ++tile) {
        const int32_t ahead = tile + S::kStages - 1;
        if (ahead < n_tiles)
            load_decode_tile<T, kHeadDim>(p, table, kv_head, begin + ahead * S::kTileKeys, end, q_position,
                                          decode_smem + (ahead % S::kStages) * S::kStageChunks,
                                          visible_smem[ahead % S::kStages]);
        cp_async_commit();
        cp_async_wait<S::kStages - 1>();
        __syncthreads();
        const int32_t stage = tile % S::kStages;
        const uint4 *k_tile = decode_smem + stage * S::kStageChunks;
        attend_warp_keys<T, kHeadDim, kTall>(p, q_frag, k_tile, k_tile + S::kTileChunks, visible_smem[stage],
                                             warp * S::kWarpKeys, state);
        __syncthreads(); // the stage is refilled by the next iteration's prefetch
    }
    cp_async_wait<0>();
    __syncthreads();
    merge_and_store<T, kHeadDim, kTall>(p, qi, kv_head, split, state, reinterpret_cast<float *>(decode_smem));
}

template <typename T, int kHeadDim, bool kTall> struct DecodeKernel { // decode_dispatch.cuh
    static constexpr void (*kernel)(AttentionParams) = &decode_mma_kernel<T, kHeadDim, kTall>;
    static constexpr int threads = DecodeShape<kHeadDim>::kThreads;
    static constexpr size_t smem_bytes = DecodeShape<kHeadDim>::kSmemBytes;
};

} // namespace

bool decode_mma_applies(DType dtype, int32_t head_dim, int32_t group) {
    return mma_tiles_fit(dtype, head_dim) && group >= 2 && group <= 16;
}

int64_t decode_mma_resident_ctas(DType dtype, int32_t head_dim, int32_t group) {
    int64_t out = 1;
    dispatch_decode_kernel<DecodeKernel>(dtype, head_dim, group,
                                         [&](auto kernel) { out = decode_kernel_resident_ctas<decltype(kernel)>(); });
    return out;
}

void launch_decode_mma(const AttentionParams &p, DType dtype, cudaStream_t stream) {
    require(decode_mma_applies(dtype, p.head_dim, p.group) && (p.seq_n_tokens || p.n_q == 1),
            "shape not supported by the mma decode attention");
    dispatch_decode_kernel<DecodeKernel>(dtype, p.head_dim, p.group,
                                         [&](auto kernel) { launch_decode_kernel<decltype(kernel)>(p, stream); });
}

} // namespace conduit::kernels::cuda
