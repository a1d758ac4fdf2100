// attention_mma.cu: FlashAttention-2-style attention on tensor cores (mma.sync m16n8k16, sm_80+)
// for bf16/f16 layers with head_dim 64 or 128 and many queries (prefill chunks, CONDUIT recompute).
//
// Rows are (query, head) pairs of one KV head: row r = query r / group, head r % group of the
// group, so each K/V tile in shared memory serves every query head of the group. Grid: x = tile of
// kRows rows (heaviest first: later queries usually see more keys), y = KV head. Per CTA:
//   1. Each warp keeps its 16 rows of Q as mma A fragments in registers (unscaled).
//   2. Key tiles of kKeys slots are gathered from the paged pool with cp.async (double-buffered);
//      a tile none of the CTA's rows can see is skipped, and a slot no row can see is zero-filled
//      (its K/V may be garbage or NaN and must not reach the arithmetic).
//   3. S = Q K^T (ldmatrix from the swizzled K tile), masked per element by position
//      (positions[slot] <= q_pos) unless every slot of the tile is visible to every row of the CTA
//      (most tiles of a causal prefill: the mask's shared-memory reads and selects are skipped),
//      online softmax in fp32, base 2; O += P V with P re-packed from the S accumulators into A
//      fragments and V read with ldmatrix.trans.
// A row that sees no key writes zeros and lse = -inf.
#include <math_constants.h>

#include <cstdlib>
#include <type_traits>

#include "attention_mma.cuh"

namespace conduit::kernels::cuda {
namespace {

// The position of slot tile * kKeys + threadIdx.x (threads below kKeys; 0 elsewhere or past the
// end). Read one tile ahead of load_tile, so that the load is in flight during a tile's compute.
template <int kHeadDim> __device__ __forceinline__ int32_t slot_position(const AttentionParams &p, int32_t tile) {
    const int32_t slot = tile * MmaShape<kHeadDim>::kKeys + int32_t(threadIdx.x);
    return threadIdx.x < MmaShape<kHeadDim>::kKeys && slot < p.n_tokens ? p.positions[slot] : 0;
}

// What a key tile holds for the CTA's rows: nothing visible (skipped), some slots visible (masked
// per element), or every slot visible to every row (no mask: most tiles of a causal prefill).
enum TileView : int { kTileHidden = 0, kTileMasked = 1, kTileOpen = 2 };

// Stores the positions of the tile at tile_start (`pos`, from slot_position) in stage_pos and, when
// some slot of the tile is visible to the CTA's latest query (max_q_pos), issues the cp.async
// copies of its K and V rows (zero-filled rows for slots past the end or visible to no row).
// min_q_pos is the CTA's earliest query. Call from all threads (it contains barriers).
template <typename T, int kHeadDim, int kWarps>
__device__ __forceinline__ TileView load_tile(const AttentionParams &p, int32_t kv_head, int32_t tile_start,
                                              int32_t pos, int32_t max_q_pos, int32_t min_q_pos, uint4 *stage,
                                              int32_t *stage_pos) {
    using S = MmaShape<kHeadDim, kWarps>;
    bool visible = false, seen_by_all = true;
    if (threadIdx.x < S::kKeys) {
        const bool exists = tile_start + int32_t(threadIdx.x) < p.n_tokens;
        visible = exists && pos <= max_q_pos;
        seen_by_all = exists && pos <= min_q_pos;
        stage_pos[threadIdx.x] = pos;
    }
    if (!__syncthreads_or(visible)) return kTileHidden;
    const TileView view = __syncthreads_and(seen_by_all) ? kTileOpen : kTileMasked;
    const T *pool = static_cast<const T *>(p.pool);
    const int32_t block_mask = (1 << p.block_shift) - 1;
#pragma unroll
    for (int i = 0; i < S::kTileChunks / S::kThreads; ++i) {
        const int32_t idx = int32_t(threadIdx.x) + i * S::kThreads;
        const int32_t row = idx / S::kRowChunks, chunk = idx % S::kRowChunks;
        const int32_t slot = tile_start + row;
        const bool ok = slot < p.n_tokens && stage_pos[row] <= max_q_pos;
        const T *k_src = pool;
        if (ok) {
            const int64_t block = p.block_table[slot >> p.block_shift];
            k_src = pool + block * p.block_elems +
                    ((int64_t(kv_head) << p.block_shift) + (slot & block_mask)) * kHeadDim + chunk * 8;
        }
        const int dst = swizzled<S::kRowChunks>(row, chunk);
        cp_async16(stage + dst, k_src, ok);
        cp_async16(stage + S::kTileChunks + dst, ok ? k_src + p.v_delta : pool, ok);
    }
    return view;
}

// One warp's rows: which (query, head) each of its two fragment rows (g and g + 8) is.
struct WarpRows {
    int64_t out_row[2]; // query * n_heads + head, the row of q, out and lse
    int32_t q_pos[2];
    bool valid[2];
};

template <int kHeadDim>
__device__ __forceinline__ WarpRows warp_rows(const AttentionParams &p, int32_t kv_head, int32_t first_row) {
    const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    WarpRows rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int64_t row = int64_t(first_row) + warp * 16 + lane / 4 + r * 8;
        rows.valid[r] = row < int64_t(p.n_q) * p.group;
        const int32_t query = rows.valid[r] ? int32_t(row / p.group) : 0;
        const int32_t head = kv_head * p.group + int32_t(row % p.group);
        rows.out_row[r] = int64_t(query) * p.n_heads + head;
        rows.q_pos[r] = rows.valid[r] ? p.q_pos[query] : 0;
    }
    return rows;
}

// Rounds the warp's Q rows to A fragments: q_frag[k][0..3] = (row g, dims 16k + 2t, +1),
// (row g + 8, same), (row g, +8), (row g + 8, +8) with g = lane / 4, t = lane % 4. Invalid rows are 0.
template <int kHeadDim>
__device__ __forceinline__ void load_q(const AttentionParams &p, const WarpRows &rows,
                                       uint32_t (&q_frag)[kHeadDim / 16][4]) {
    const uint16_t *q = static_cast<const uint16_t *>(p.q);
    const int32_t t = threadIdx.x % 4;
#pragma unroll
    for (int k = 0; k < kHeadDim / 16; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = j % 2;
            const int32_t dim = 16 * k + 2 * t + 8 * (j / 2);
            const uint16_t *src = q + rows.out_row[r] * kHeadDim + dim;
            q_frag[k][j] = rows.valid[r] ? uint32_t(src[0]) | (uint32_t(src[1]) << 16) : 0u;
        }
}

// The latest and the earliest query position among the CTA's valid rows (all threads get them).
template <int kWarps> __device__ __forceinline__ void cta_q_pos_range(const WarpRows &rows, int32_t &lo, int32_t &hi) {
    __shared__ int32_t warp_lo[kWarps], warp_hi[kWarps];
    lo = INT32_MAX;
    hi = INT32_MIN;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (rows.valid[r]) {
            lo = min(lo, rows.q_pos[r]);
            hi = max(hi, rows.q_pos[r]);
        }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    }
    if (threadIdx.x % 32 == 0) {
        warp_lo[threadIdx.x / 32] = lo;
        warp_hi[threadIdx.x / 32] = hi;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        lo = min(lo, warp_lo[w]);
        hi = max(hi, warp_hi[w]);
    }
}

// Max over the 4 lanes of a quad (the lanes that share a fragment row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <typename T, int kHeadDim, int kWarps>
__global__ void __launch_bounds__(MmaShape<kHeadDim, kWarps>::kThreads) mma_attention_kernel(const AttentionParams p) {
    using S = MmaShape<kHeadDim, kWarps>;
    extern __shared__ uint4 mma_smem[];
    int32_t *pos_smem = reinterpret_cast<int32_t *>(mma_smem + S::kStages * S::kStageChunks);
    const int32_t lane = threadIdx.x % 32, t = lane % 4;
    const int32_t kv_head = blockIdx.y;
    const int32_t first_row = (gridDim.x - 1 - blockIdx.x) * S::kRows;

    const WarpRows rows = warp_rows<kHeadDim>(p, kv_head, first_row);
    uint32_t q_frag[S::kDimSteps][4];
    load_q<kHeadDim>(p, rows, q_frag);
    int32_t min_q_pos, max_q_pos;
    cta_q_pos_range<kWarps>(rows, min_q_pos, max_q_pos);
    // Rows past the end of the queries hold q = 0 and are never stored: they need no mask either.
    const bool all_rows_valid = __syncthreads_and(rows.valid[0] && rows.valid[1]);
    if (!all_rows_valid) min_q_pos = INT32_MIN; // keep every tile masked: simpler than reasoning about them

    float acc[S::kDimTiles][4];
#pragma unroll
    for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[n][j] = 0.0f;
    float run_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, run_sum[2] = {0.0f, 0.0f}; // base 2; sums lane-partial

    const int32_t n_tiles = (p.n_tokens + S::kKeys - 1) / S::kKeys;
    int32_t pos_ahead = slot_position<kHeadDim>(p, 0);
    TileView view = n_tiles > 0 ? load_tile<T, kHeadDim, kWarps>(p, kv_head, 0, pos_ahead, max_q_pos, min_q_pos, mma_smem,
                                                         pos_smem)
                                : kTileHidden;
    pos_ahead = slot_position<kHeadDim>(p, 1);
    cp_async_commit();
    for (int32_t tile = 0; tile < n_tiles; ++tile) {
        TileView next_view = kTileHidden;
        if (tile + 1 < n_tiles) {
            const int next = (tile + 1) % S::kStages;
            next_view = load_tile<T, kHeadDim, kWarps>(p, kv_head, (tile + 1) * S::kKeys, pos_ahead, max_q_pos, min_q_pos,
                                               mma_smem + next * S::kStageChunks, pos_smem + next * S::kKeys);
            pos_ahead = slot_position<kHeadDim>(p, tile + 2);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (view != kTileHidden) {
            const int stage = tile % S::kStages;
            const uint4 *k_tile = mma_smem + stage * S::kStageChunks;
            const uint4 *v_tile = k_tile + S::kTileChunks;
            const int32_t *tile_pos = pos_smem + stage * S::kKeys;
            const int32_t tile_keys = min(S::kKeys, p.n_tokens - tile * S::kKeys);

            // S = Q K^T: ldmatrix matrices (keys 16n + 0..7 | 8..15) x (dim chunks 2k | 2k + 1).
            float s[S::kKeyTiles][4];
#pragma unroll
            for (int n = 0; n < S::kKeyTiles; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[n][j] = 0.0f;
#pragma unroll
            for (int k = 0; k < S::kDimSteps; ++k)
#pragma unroll
                for (int n = 0; n < S::kKeyTiles / 2; ++n) {
                    uint32_t b[4];
                    const int key = 16 * n + (lane / 16) * 8 + lane % 8;
                    ldmatrix_x4(b, k_tile + swizzled<S::kRowChunks>(key, 2 * k + (lane / 8) % 2));
                    mma_m16n8k16<T>(s[2 * n], q_frag[k], b[0], b[1]);
                    mma_m16n8k16<T>(s[2 * n + 1], q_frag[k], b[2], b[3]);
                }

            // Mask (unless every slot is visible to every row), scale to base 2 and update the running
            // max of both rows.
            float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
            if (view == kTileMasked) {
#pragma unroll
                for (int n = 0; n < S::kKeyTiles; ++n)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int r = j / 2, key = 8 * n + 2 * t + j % 2;
                        const bool seen = rows.valid[r] && key < tile_keys && tile_pos[key] <= rows.q_pos[r];
                        s[n][j] = seen ? s[n][j] * p.scale_log2 : -CUDART_INF_F;
                        tile_max[r] = fmaxf(tile_max[r], s[n][j]);
                    }
            } else {
#pragma unroll
                for (int n = 0; n < S::kKeyTiles; ++n)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        s[n][j] *= p.scale_log2;
                        tile_max[j / 2] = fmaxf(tile_max[j / 2], s[n][j]);
                    }
            }
            float ref[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float new_max = fmaxf(run_max[r], quad_max(tile_max[r]));
                ref[r] = new_max == -CUDART_INF_F ? 0.0f : new_max; // nothing seen yet: p = 0
                alpha[r] = fast_exp2(run_max[r] - ref[r]);
                run_max[r] = new_max;
                run_sum[r] *= alpha[r];
            }
#pragma unroll
            for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[n][j] *= alpha[j / 2];

            // O += P V, 16 keys per step: P's A fragment is S n-tiles 2k (cols 0..7) and 2k + 1.
#pragma unroll
            for (int k = 0; k < S::kKeyTiles / 2; ++k) {
                uint32_t a[4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float *sv = s[2 * k + h];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        sv[j] = fast_exp2(sv[j] - ref[j / 2]);
                        run_sum[j / 2] += sv[j];
                    }
                    a[2 * h] = pack2<T>(sv[0], sv[1]);
                    a[2 * h + 1] = pack2<T>(sv[2], sv[3]);
                }
#pragma unroll
                for (int n = 0; n < S::kDimTiles / 2; ++n) {
                    uint32_t b[4];
                    const int key = 16 * k + ((lane / 8) % 2) * 8 + lane % 8;
                    ldmatrix_x4_trans(b, v_tile + swizzled<S::kRowChunks>(key, 2 * n + lane / 16));
                    mma_m16n8k16<T>(acc[2 * n], a, b[0], b[1]);
                    mma_m16n8k16<T>(acc[2 * n + 1], a, b[2], b[3]);
                }
            }
        }
        view = next_view;
        __syncthreads(); // the next iteration's copies overwrite this stage
    }

    // Normalise and store: lane holds rows g, g + 8 at dims 8n + 2t, +1.
    T *out = static_cast<T *>(p.out);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float total = quad_sum(run_sum[r]);
        if (!rows.valid[r]) continue;
        const bool empty = total == 0.0f;
        const float inv = empty ? 0.0f : 1.0f / total;
        T *dst = out + rows.out_row[r] * kHeadDim + 2 * t;
#pragma unroll
        for (int n = 0; n < S::kDimTiles; ++n) {
            dst[8 * n] = from_float<T>(acc[n][2 * r] * inv);
            dst[8 * n + 1] = from_float<T>(acc[n][2 * r + 1] * inv);
        }
        if (p.lse && t == 0) p.lse[rows.out_row[r]] = empty ? -CUDART_INF_F : run_max[r] * CUDART_LN2_F + logf(total);
    }
}

// Raises the kernel's dynamic shared-memory limit once per device.
template <typename T, int kHeadDim, int kWarps> void allow_smem() {
    static bool done[64] = {};
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    if (device >= 0 && device < 64 && done[device]) return;
    CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void *>(&mma_attention_kernel<T, kHeadDim, kWarps>),
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(MmaShape<kHeadDim, kWarps>::kSmemBytes)));
    if (device >= 0 && device < 64) done[device] = true;
}

template <typename T, int kHeadDim, int kWarps> void launch_typed(const AttentionParams &p, cudaStream_t stream) {
    using S = MmaShape<kHeadDim, kWarps>;
    allow_smem<T, kHeadDim, kWarps>();
    const int64_t n_rows = int64_t(p.n_q) * p.group;
    const dim3 grid{unsigned((n_rows + S::kRows - 1) / S::kRows), unsigned(p.n_kv_heads), 1};
    mma_attention_kernel<T, kHeadDim, kWarps><<<grid, S::kThreads, S::kSmemBytes, stream>>>(p);
    CUDA_CHECK_LAUNCH("mma_attention_kernel");
}

} // namespace

void launch_mma_attention(const AttentionParams &p, DType dtype, cudaStream_t stream) {
    require(mma_attention_applies(dtype, p.head_dim, p.n_q, p.group), "shape not supported by the mma attention");
    const bool bf16 = dtype == DType::BF16;
    const auto launch = [&](auto warps) {
        constexpr int kWarps = decltype(warps)::value;
        if (p.head_dim == 64) {
            if (bf16) launch_typed<__nv_bfloat16, 64, kWarps>(p, stream);
            else launch_typed<__half, 64, kWarps>(p, stream);
        } else {
            if (bf16) launch_typed<__nv_bfloat16, 128, kWarps>(p, stream);
            else launch_typed<__half, 128, kWarps>(p, stream);
        }
    };
    if (mma_warps_for(p) == 8) launch(std::integral_constant<int, 8>{});
    else launch(std::integral_constant<int, 4>{});
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
    const int64_t rows = int64_t(p.n_q) * p.group;
    const int64_t ctas_of_8 = (rows + MmaShape<64, 8>::kRows - 1) / MmaShape<64, 8>::kRows * p.n_kv_heads;
    return ctas_of_8 >= 2 * int64_t(sm_count()) ? 8 : 4;
}

} // namespace conduit::kernels::cuda
