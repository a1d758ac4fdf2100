// attention_mma.cu: FlashAttention-2-style attention on tensor cores (mma.sync m16n8k16, sm_80+)
// for bf16/f16 layers with head_dim 64 or 128 and many queries (prefill chunks, CONDUIT recompute).
//
// Rows are (query, head) pairs of one KV head: row r = query r / group, head r % group of the
// group, so each K/V tile in shared memory serves every query head of the group. Grid: x = tile of
// kRows rows (heaviest first: later queries usually see more keys), y = KV head, z = split of the
// keys (whole kKeys tiles, p.split_tokens slots each). Splits: with few rows per KV head the x-y grid
// is far smaller than the device, and each CTA streams every key tile alone. A CONDUIT text pass on
// LLaVA-7B (104 queries over ~4700 keys, 32 heads, MHA) is 64 CTAs of 4 warps on an H200 that holds
// 264, each walking 74 key tiles: 6.3 ms of the pass's 10.9 ms device time (32 layers). So
// attention.cu splits the keys until one wave of CTAs is full (flash-decoding); each split writes its
// rows' normalised float partial and natural-log lse, and merge_splits (attention.cu) combines them.
// With one split a CTA writes out and lse itself. A warp takes 16 rows (one m16 tile; 4 or 8 warps a
// CTA) or, with kRowTiles = 2, 32 (FlashAttention-2's split: 4 warps, 128 rows a CTA; every K and V
// fragment a warp loads feeds two mmas). Per CTA:
//   1. Each warp keeps its rows of Q as mma A fragments (unscaled): in registers, or for 32 rows at
//      head_dim 128 parked in shared memory and reloaded per k-step (MmaShape::kQInSmem).
//   2. Key tiles of kKeys slots are gathered from the paged pool with cp.async through a ring of
//      kStages shared-memory stages, kStages - 1 tiles ahead of the compute, with one CTA barrier
//      per tile (the 8 warps of a CTA drift apart instead of all doing Q K^T, then all the softmax,
//      with the tensor pipe idle in between); each warp decides from the tile's positions, with warp
//      votes, what the tile shows the CTA: a tile none of its rows can see is skipped, and a slot no
//      row can see is zero-filled (its K/V may be garbage or NaN and must not reach the arithmetic).
//   3. S = Q K^T (ldmatrix from the swizzled K tile), masked per element by position
//      (positions[slot] <= q_pos) unless every slot of the tile is visible to every row of the CTA
//      (most tiles of a causal prefill: the mask's shared-memory reads and selects are skipped),
//      online softmax in fp32, base 2; O += P V with P re-packed from the S accumulators into A
//      fragments and V read with ldmatrix.trans.
// A row that sees no key (of its split) writes zeros and lse = -inf. The key-tile loop, the Q
// fragments and S = Q K^T live in attention_mma_tile.cuh, shared with the first pass of
// attention_stats_mma.cu.
#include <math_constants.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "attention_mma_tile.cuh"

namespace conduit::kernels::cuda {
namespace {

// Normalises the warp's two fragment rows (lane: rows g, g + 8 at dims 8n + 2t, +1) and stores them:
// with one split, out (as T) and lse; with several, split `split`'s float partial and natural-log
// lse at partial row out_row * n_splits + split, which merge_splits (attention.cu) combines. A row
// that saw no key (of its split) gets zeros and lse = -inf. Call from all lanes (quad sums).
template <typename T, int kHeadDim>
__device__ __forceinline__ void store_rows(const AttentionParams &p, const WarpRows &rows,
                                           const float (&acc)[kHeadDim / 8][4], const float (&run_max)[2],
                                           const float (&run_sum)[2], int32_t split) {
    const int32_t t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float total = quad_sum(run_sum[r]);
        if (!rows.valid[r]) continue;
        const bool empty = total == 0.0f;
        const float inv = empty ? 0.0f : 1.0f / total;
        const float lse = empty ? -CUDART_INF_F : run_max[r] * CUDART_LN2_F + logf(total);
        if (p.n_splits > 1) {
            const int64_t part = rows.out_row[r] * p.n_splits + split;
            float *dst = p.partial_out + part * kHeadDim + 2 * t;
#pragma unroll
            for (int n = 0; n < kHeadDim / 8; ++n)
                *reinterpret_cast<float2 *>(dst + 8 * n) = make_float2(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
            if (t == 0) p.partial_lse[part] = lse;
        } else {
            T *dst = static_cast<T *>(p.out) + rows.out_row[r] * kHeadDim + 2 * t;
#pragma unroll
            for (int n = 0; n < kHeadDim / 8; ++n) {
                dst[8 * n] = from_float<T>(acc[n][2 * r] * inv);
                dst[8 * n + 1] = from_float<T>(acc[n][2 * r + 1] * inv);
            }
            if (p.lse && t == 0) p.lse[rows.out_row[r]] = lse;
        }
    }
}

template <typename T, int kHeadDim, int kWarps, int kRowTiles>
__global__ void __launch_bounds__(MmaShape<kHeadDim, kWarps, kRowTiles>::kThreads)
    mma_attention_kernel(const AttentionParams p) {
    using S = MmaShape<kHeadDim, kWarps, kRowTiles>;
    using QFrags = std::conditional_t<S::kQInSmem, QShared<kHeadDim, kRowTiles>, QRegisters<kHeadDim, kRowTiles>>;
    extern __shared__ uint4 mma_smem[];
    int32_t *pos_smem = reinterpret_cast<int32_t *>(mma_smem + S::kStages * S::kStageChunks);
    const int32_t lane = threadIdx.x % 32;
    const int32_t kv_head = blockIdx.y, split = blockIdx.z;
    const int32_t first_row = (gridDim.x - 1 - blockIdx.x) * S::kRows;

    WarpRows rows[kRowTiles];
    QFrags q_frag;
    if constexpr (S::kQInSmem) // after the stages' positions: this warp's kRowTiles * kDimSteps * 32 chunks
        q_frag.warp_frags = reinterpret_cast<uint4 *>(pos_smem + S::kStages * S::kKeys) +
                            (threadIdx.x / 32) * kRowTiles * S::kDimSteps * 32;
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i) {
        rows[i] = warp_rows<kHeadDim, kRowTiles>(p, kv_head, first_row, i);
        q_frag.load(p, rows[i], i);
    }
    int32_t min_q_pos, max_q_pos;
    cta_q_pos_range<kWarps, kRowTiles>(rows, min_q_pos, max_q_pos);
    // Rows past the end of the queries hold q = 0 and are never stored: they need no mask either.
    bool all_valid = true;
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i) all_valid = all_valid && rows[i].valid[0] && rows[i].valid[1];
    const bool all_rows_valid = __syncthreads_and(all_valid);
    if (!all_rows_valid) min_q_pos = INT32_MIN; // keep every tile masked: simpler than reasoning about them

    float acc[kRowTiles][S::kDimTiles][4];
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
        for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][n][j] = 0.0f;
    float run_max[kRowTiles][2], run_sum[kRowTiles][2]; // base 2; sums lane-partial
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            run_max[i][r] = -CUDART_INF_F;
            run_sum[i][r] = 0.0f;
        }

    // Split z of several takes the key tiles [z * tiles_per_split, +tiles_per_split); one split takes all.
    const int32_t n_tiles = (p.n_tokens + S::kKeys - 1) / S::kKeys;
    const int32_t tiles_per_split = p.n_splits > 1 ? p.split_tokens / S::kKeys : n_tiles;
    const int32_t tile_begin = min(n_tiles, split * tiles_per_split);
    const int32_t tile_end = min(n_tiles, tile_begin + tiles_per_split);
    const auto on_tile = [&](TileView view, const uint4 *k_tile, const int32_t *tile_pos, int32_t tile) {
        const int32_t tile_keys = min(S::kKeys, p.n_tokens - tile * S::kKeys);
        // S of kScoreKeys keys at a time (the whole tile, or its halves at 32 rows and head_dim 128).
#pragma unroll 1
        for (int part = 0; part < S::kKeys / S::kScoreKeys; ++part) {
            const int32_t part_key = part * S::kScoreKeys;
            const uint4 *k_part = k_tile + part_key * S::kRowChunks; // the swizzle repeats every 8 rows
            const uint4 *v_part = k_part + S::kTileChunks;

            // S = Q K^T; masked (unless every slot is visible to every row) and scaled to base 2.
            float s[kRowTiles][S::kScoreTiles][4], ref[kRowTiles][2];
            tile_scores<T, kHeadDim, kRowTiles, S::kScoreTiles>(q_frag, k_part, s);
#pragma unroll
            for (int i = 0; i < kRowTiles; ++i) {
                float tile_max[2], alpha[2];
                scale_and_mask<S::kScoreTiles>(s[i], view, rows[i], tile_pos + part_key, tile_keys - part_key,
                                               p.scale_log2, tile_max);
                rescale_running(tile_max, run_max[i], run_sum[i], ref[i], alpha);
#pragma unroll
                for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][n][j] *= alpha[j / 2];
            }

            // O += P V, 16 keys per step: P's A fragment is S n-tiles 2k (cols 0..7) and 2k + 1; each V
            // fragment feeds every row tile.
#pragma unroll
            for (int k = 0; k < S::kScoreTiles / 2; ++k) {
                uint32_t a[kRowTiles][4];
#pragma unroll
                for (int i = 0; i < kRowTiles; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float *sv = s[i][2 * k + h];
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            sv[j] = fast_exp2(sv[j] - ref[i][j / 2]);
                            run_sum[i][j / 2] += sv[j];
                        }
                        a[i][2 * h] = pack2<T>(sv[0], sv[1]);
                        a[i][2 * h + 1] = pack2<T>(sv[2], sv[3]);
                    }
#pragma unroll
                for (int n = 0; n < S::kDimTiles / 2; ++n) {
                    uint32_t b[4];
                    const int key = 16 * k + ((lane / 8) % 2) * 8 + lane % 8;
                    ldmatrix_x4_trans(b, v_part + swizzled<S::kRowChunks>(key, 2 * n + lane / 16));
#pragma unroll
                    for (int i = 0; i < kRowTiles; ++i) {
                        mma_m16n8k16<T>(acc[i][2 * n], a[i], b[0], b[1]);
                        mma_m16n8k16<T>(acc[i][2 * n + 1], a[i], b[2], b[3]);
                    }
                }
            }
        }
    };
    for_each_key_tile<T, kHeadDim, kWarps, true, kRowTiles>(p, kv_head, tile_begin, tile_end, max_q_pos, min_q_pos,
                                                             mma_smem, pos_smem, on_tile);
#pragma unroll
    for (int i = 0; i < kRowTiles; ++i) {
        // Two row tiles: their output rows are worked out again rather than held through the loop
        // (four 64-bit registers, which ptxas spilled at head_dim 128).
        const WarpRows out_rows = kRowTiles == 1 ? rows[i] : warp_rows<kHeadDim, kRowTiles>(p, kv_head, first_row, i);
        store_rows<T, kHeadDim>(p, out_rows, acc[i], run_max[i], run_sum[i], split);
    }
}

// The kernel instantiation for (T, kHeadDim, kWarps, kRowTiles) as seen from the host: its launch and
// occupancy.
template <typename T, int kHeadDim, int kWarps, int kRowTiles> struct MmaKernel {
    using S = MmaShape<kHeadDim, kWarps, kRowTiles>;
    static constexpr auto kernel = &mma_attention_kernel<T, kHeadDim, kWarps, kRowTiles>;
    static constexpr MmaVariant variant{kWarps, kRowTiles};

    // Launches it for p: row tiles x KV heads x p.n_splits (at least one) CTAs.
    static void launch(const AttentionParams &p, cudaStream_t stream) {
        allow_dynamic_smem<kernel>(S::kSmemBytes);
        const dim3 grid{unsigned(mma_attention_base_ctas(p, variant) / p.n_kv_heads), unsigned(p.n_kv_heads),
                        unsigned(std::max(p.n_splits, 1))};
        mma_attention_kernel<T, kHeadDim, kWarps, kRowTiles><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
        CUDA_CHECK_LAUNCH("mma_attention_kernel");
    }

    // Its CTAs one SM holds at once (registers, dynamic shared memory): queried once, the same on
    // every launch.
    static int resident_per_sm() {
        static std::atomic<int> cached{0};
        int n = cached.load();
        if (n == 0) {
            allow_dynamic_smem<kernel>(S::kSmemBytes); // the occupancy counts only the smem it is allowed
            CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reinterpret_cast<const void *>(kernel),
                                                                     S::kThreads, S::kSmemBytes));
            n = std::max(n, 1);
            cached.store(n);
        }
        return n;
    }
};

// Calls f(MmaKernel<T, head_dim, warps, row tiles>{}) for bf16 or f16, head_dim 64 or 128, and the
// variants 4 or 8 warps of one row tile, 4 warps of two.
template <typename F> void dispatch_mma(DType dtype, int32_t head_dim, MmaVariant v, F &&f) {
    const auto with_variant = [&](auto type_tag, auto dim) {
        using T = typename decltype(type_tag)::type;
        constexpr int kHeadDim = decltype(dim)::value;
        if (v.row_tiles == 2) f(MmaKernel<T, kHeadDim, 4, 2>{});
        else if (v.warps == 8) f(MmaKernel<T, kHeadDim, 8, 1>{});
        else f(MmaKernel<T, kHeadDim, 4, 1>{});
    };
    const auto with_dim = [&](auto type_tag) {
        if (head_dim == 64) with_variant(type_tag, std::integral_constant<int, 64>{});
        else with_variant(type_tag, std::integral_constant<int, 128>{});
    };
    if (dtype == DType::BF16) with_dim(TypeTag<__nv_bfloat16>{});
    else with_dim(TypeTag<__half>{});
}

// The one variant dispatch_mma runs for v: 2 row tiles only with 4 warps.
MmaVariant normalized(MmaVariant v) {
    return v.row_tiles == 2 ? MmaVariant{4, 2} : MmaVariant{v.warps == 8 ? 8 : 4, 1};
}

// 8 warps (128 rows a CTA) share each key tile among twice the rows, which pays while their CTAs
// still fill the device twice over: on an H200 a 4K-query prefill chunk ran at 185 TFLOP/s with 8
// against 173 with 4, while CONDUIT's recompute (884 queries, 224 CTAs of 8 warps) ran at 111
// against 115 (docs/benchmarks/runs.md, run I).
int mma_warps_for(const AttentionParams &p) {
    static const int forced = [] {
        const char *env = std::getenv("CONDUIT_MMA_WARPS");
        const int asked = env ? std::atoi(env) : 0;
        return asked == 4 || asked == 8 ? asked : 0;
    }();
    if (forced) return forced;
    return mma_attention_base_ctas(p, MmaVariant{8, 1}) >= 2 * int64_t(sm_count()) ? 8 : 4;
}

// Where 32 rows a warp should pay (not measured yet, so only CONDUIT_MMA_ROWS=auto takes it): where
// 128-row CTAs still fill the device twice over (the 8-warp rule above: a prefill chunk, not a text
// pass or short recompute, whose few rows per KV head would be mostly padding in 128-row tiles and
// whose key splits would double). It takes the 8-warp variant's row tiles with half the warps.
bool mma_rows32_suits(const AttentionParams &p) {
    return mma_attention_base_ctas(p, MmaVariant{4, 2}) >= 2 * int64_t(sm_count());
}

} // namespace

int64_t mma_attention_base_ctas(const AttentionParams &p, MmaVariant v) {
    const int64_t rows_per_cta = normalized(v).rows();
    return (int64_t(p.n_q) * p.group + rows_per_cta - 1) / rows_per_cta * p.n_kv_heads;
}

int64_t mma_attention_resident_ctas(DType dtype, int32_t head_dim, MmaVariant v) {
    int per_sm = 1;
    dispatch_mma(dtype, head_dim, v, [&](auto kernel) { per_sm = decltype(kernel)::resident_per_sm(); });
    return int64_t(per_sm) * sm_count();
}

void launch_mma_attention(const AttentionParams &p, DType dtype, MmaVariant v, cudaStream_t stream) {
    require(mma_attention_applies(dtype, p.head_dim, p.n_q, p.group), "shape not supported by the mma attention");
    require(p.n_splits <= 1 || (p.partial_out && p.partial_lse && p.split_tokens % kMmaTileKeys == 0),
            "mma attention: splits need partials and whole key tiles");
    dispatch_mma(dtype, p.head_dim, v, [&](auto kernel) { decltype(kernel)::launch(p, stream); });
}

MmaVariant mma_variant_for(const AttentionParams &p) {
    enum Rows { kRows16, kRows32, kRowsAuto };
    static const Rows rows = [] {
        const char *env = std::getenv("CONDUIT_MMA_ROWS");
        const std::string asked = env ? env : "";
        return asked == "32" ? kRows32 : asked == "auto" ? kRowsAuto : kRows16;
    }();
    if (rows == kRows32 || (rows == kRowsAuto && mma_rows32_suits(p))) return MmaVariant{4, 2};
    return MmaVariant{mma_warps_for(p), 1};
}

} // namespace conduit::kernels::cuda
