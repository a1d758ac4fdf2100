// attention_mma.cu: FlashAttention-2-style attention on tensor cores for bf16/f16 layers with
// head_dim 64 or 128 and many queries (prefill chunks, CONDUIT's recompute): mma.sync m16n8k16 on
// sm_80+, and on sm_90a (Hopper built as 90a) the two products of a key tile as warpgroup MMAs
// (wgmma.cuh: each 4-warp group of the CTA is one 64-row wgmma tile; K and V read from shared memory
// by the tensor core, Q and P from registers; a tile's P V runs during the next tile's softmax, as in
// FlashAttention-3). With wgmma, CTAs of 8 warps add a producer warpgroup that gathers the key tiles
// (warp specialization: for_each_key_tile_specialized, kMmaProducerWarps). Everything else (rows,
// tiles, softmax, masks, splits) is the same code on both.
//
// Rows are (query, head) pairs of one KV head: row r = query r / group, head r % group of the
// group, so each K/V tile in shared memory serves every query head of the group. Grid: x = tile of
// kRows rows (heaviest first: later queries usually see more keys), y = KV head, z = split of the
// keys (whole kKeys tiles, p.split_tokens slots each). Splits: with few rows per KV head (a CONDUIT
// text pass: ~100 queries over thousands of keys) the x-y grid is far smaller than the device, and
// each CTA would stream every key tile alone. So attention.cu splits the keys until one wave of CTAs
// is full (flash-decoding); each split writes its rows' normalised float partial and natural-log lse,
// and merge_splits (attention.cu) combines them. With one split a CTA writes out and lse itself. Per
// CTA:
//   1. Each warp keeps its 16 rows of Q as mma A fragments in registers (unscaled).
//   2. Key tiles of kKeys slots are gathered from the paged pool with cp.async through a ring of
//      kStages shared-memory stages, kStages - 1 tiles ahead of the compute (kStages - 2 with
//      wgmma, whose P V of a tile runs during the next tile's softmax), with one CTA barrier
//      per tile (the 8 warps of a CTA drift apart instead of all doing Q K^T, then all the softmax,
//      with the tensor pipe idle in between); each warp decides from the tile's positions, with warp
//      votes, what the tile shows the CTA: a tile none of its rows can see is skipped, and a slot no
//      row can see is zero-filled (its K/V may be garbage or NaN and must not reach the arithmetic).
//      With wgmma, a CTA of 8 warps has a third warpgroup that does the gathering and the votes
//      alone, handing each tile over with its view through shared-memory barriers (no CTA barrier a
//      tile); CTAs of 4 warps keep the loop above (kMmaProducerWarps).
//   3. S = Q K^T (ldmatrix from the swizzled K tile, or one wgmma per 16 dims), masked per element by position
//      (positions[slot] <= q_pos) unless every slot of the tile is visible to every row of the CTA
//      (most tiles of a causal prefill: the mask's shared-memory reads and selects are skipped),
//      online softmax in fp32, base 2; O += P V with P re-packed from the S accumulators into A
//      fragments and V read with ldmatrix.trans (or by a wgmma per 16 keys, V transposed).
// A row that sees no key (of its split) writes zeros and lse = -inf. The key-tile loop, the Q
// fragments and S = Q K^T live in attention_mma_tile.cuh, shared with the first pass of
// attention_stats_mma.cu.
#include <math_constants.h>

#include <algorithm>
#include <atomic>
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

// The CTA's warps besides its kWarps of rows: with wgmma and 8 warps, the producer warpgroup that
// gathers the key tiles (for_each_key_tile_specialized): the computing warps then neither copy
// (about a third of their instructions a tile) nor meet at a CTA barrier every tile. Device code
// built for sm_90a has it, the rest not; the host learns which from the launch bound of the kernel it
// would run (MmaKernel::threads). CTAs of 4 warps keep the CTA-barrier loop: two of them share an SM,
// which the producer's registers would not leave room for.
template <int kWarps> constexpr int kMmaProducerWarps = CONDUIT_WGMMA && kWarps == 8 ? 4 : 0;

template <typename T, int kHeadDim, int kWarps>
__global__ void __launch_bounds__(MmaShape<kHeadDim, kWarps>::kThreads + 32 * kMmaProducerWarps<kWarps>,
                                  kMmaProducerWarps<kWarps> ? 1 : 0) // (setmaxnreg needs the count at entry)
    mma_attention_kernel(const AttentionParams p) {
    using S = MmaShape<kHeadDim, kWarps>;
    extern __shared__ uint4 mma_smem_raw[];
    // (offset from the array, not a rebuilt address: the compiler keeps knowing it is shared memory)
    const uint32_t misalign = static_cast<uint32_t>(__cvta_generic_to_shared(mma_smem_raw)) % kWgmmaTileAlign;
    uint4 *mma_smem = mma_smem_raw + (misalign ? (kWgmmaTileAlign - misalign) / 16 : 0);
    const int32_t kv_head = blockIdx.y, split = blockIdx.z;
    const int32_t first_row = (gridDim.x - 1 - blockIdx.x) * S::kRows;
    const bool producer = kMmaProducerWarps<kWarps> > 0 && threadIdx.x >= S::kThreads; // it has no rows
    if constexpr (kMmaProducerWarps<kWarps> > 0) // without its producer the CTA would wait for tiles forever
        if (blockDim.x != S::kThreads + 32 * kMmaProducerWarps<kWarps>) __trap(); // MmaKernel::threads() misread it

    WarpRows rows = warp_rows<kHeadDim>(p, kv_head, first_row);
    if (producer) rows.valid[0] = rows.valid[1] = false;
    uint32_t q_frag[S::kDimSteps][4];
    load_q<kHeadDim>(p, rows, q_frag);
    int32_t min_q_pos, max_q_pos;
    cta_q_pos_range<kWarps + kMmaProducerWarps<kWarps>>(rows, min_q_pos, max_q_pos);
    // Rows past the end of the queries hold q = 0 and are never stored: they need no mask either.
    const bool all_rows_valid = __syncthreads_and(producer || (rows.valid[0] && rows.valid[1]));
    if (!all_rows_valid) min_q_pos = INT32_MIN; // keep every tile masked: simpler than reasoning about them

    float acc[S::kDimTiles][4];
#pragma unroll
    for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[n][j] = 0.0f;
    float run_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, run_sum[2] = {0.0f, 0.0f}; // base 2; sums lane-partial

    // Split z of several takes the key tiles [z * tiles_per_split, +tiles_per_split); one split takes all.
    const int32_t n_tiles = (p.n_tokens + S::kKeys - 1) / S::kKeys;
    const int32_t tiles_per_split = p.n_splits > 1 ? p.split_tokens / S::kKeys : n_tiles;
    const int32_t tile_begin = min(n_tiles, split * tiles_per_split);
    const int32_t tile_end = min(n_tiles, tile_begin + tiles_per_split);
    // Masks a tile's raw scores S = Q K^T (unless every slot is visible to every row) and moves the
    // rows' running maxima and sums to it: ref, the maxima P is taken against; alpha, the factor the
    // accumulators take. Base-2 scores are s * scale_log2 (positive: attention.cu sends no other
    // here): the maxima are taken on the raw scores (the same bits as the maxima of the products:
    // rounding a product by a positive factor is monotonic) and the scale goes into the exponent's
    // FFMA, 32 multiplies a lane and tile fewer.
    const auto tile_softmax = [&](float(&s)[S::kKeyTiles][4], TileView view, const int32_t *tile_pos, int32_t tile,
                                  float(&ref)[2], float(&alpha)[2]) {
        float tile_max[2];
        mask_tile<S::kKeyTiles, false>(s, view, rows, tile_pos, min(S::kKeys, p.n_tokens - tile * S::kKeys), 0.0f,
                                       tile_max);
        tile_max[0] *= p.scale_log2;
        tile_max[1] *= p.scale_log2;
        rescale_running(tile_max, run_max, run_sum, ref, alpha);
    };
    // P of one n-tile of S, in place: 2^(s scale_log2 - ref), added to the running sums (masked: 2^-inf = 0).
    const auto exponentiate = [&](float(&sv)[4], const float(&ref)[2]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sv[j] = fast_exp2(fmaf(sv[j], p.scale_log2, -ref[j / 2]));
            run_sum[j / 2] += sv[j];
        }
    };
    // P's A fragment of keys 16 k..: S n-tiles 2k (cols 0..7) and 2k + 1, exponentiated.
    const auto pack_p = [](const float(&s)[S::kKeyTiles][4], int k, uint32_t(&a)[4]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a[2 * h] = pack2<T>(s[2 * k + h][0], s[2 * k + h][1]);
            a[2 * h + 1] = pack2<T>(s[2 * k + h][2], s[2 * k + h][3]);
        }
    };
    // Once the rows' maxima settle, most tiles move none of them (alpha = 1 exactly): the
    // accumulator's 64 multiplies a lane are skipped when the whole warp agrees.
    const auto rescale_acc = [&](const float(&alpha)[2]) {
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[n][j] *= alpha[j / 2];
        }
    };
#if CONDUIT_WGMMA
    // FlashAttention-3's pipeline within a warpgroup: tile t's O += P V runs on the tensor core while
    // the warps take tile t + 1's softmax. Each tile issues its S = Q K^T, then the previous tile's
    // pending P V; waits for S alone (wgmma groups end in order), takes the softmax; then waits for
    // P V, rescales O and leaves its own P pending. The loop keeps a tile's stage until tile + 1's
    // on_tile has returned (for_each_key_tile); a hidden tile finishes the pending product at once.
    // P is packed into p_frag only after the P V wait: p_frag is that product's A operand until then,
    // and ptxas keeps no other value out of its registers (wgmma_accumulate_pv; the SASS test).
    uint32_t p_frag[S::kKeyTiles / 2][4];
    const uint4 *pending_v = nullptr; // the V tile of the P in p_frag, whose product is not issued yet
    const auto finish_pending = [&] {
        if (!pending_v) return;
        wgmma_accumulate_pv<T, kHeadDim, S::kKeys>(p_frag, pending_v, acc);
        wgmma_wait<0>();
        wgmma_fence_operands(reinterpret_cast<float(&)[kHeadDim / 2]>(acc));
        pending_v = nullptr;
    };
    const auto on_tile = [&](TileView view, const uint4 *k_tile, const int32_t *tile_pos, int32_t tile) {
        if (view == kTileHidden) return finish_pending();
        float s[S::kKeyTiles][4], ref[2], alpha[2];
        wgmma_issue_scores<T, kHeadDim, S::kKeys>(q_frag, k_tile, s);
        if (pending_v) {
            wgmma_accumulate_pv<T, kHeadDim, S::kKeys>(p_frag, pending_v, acc);
            wgmma_wait<1>(); // S; P V runs on
        } else {
            wgmma_wait<0>();
        }
        wgmma_fence_operands(reinterpret_cast<float(&)[S::kKeys / 2]>(s));
        tile_softmax(s, view, tile_pos, tile, ref, alpha);
#pragma unroll
        for (int n = 0; n < S::kKeyTiles; ++n) exponentiate(s[n], ref);
        wgmma_wait<0>(); // P V: acc and p_frag are free
        wgmma_fence_operands(reinterpret_cast<float(&)[kHeadDim / 2]>(acc));
        rescale_acc(alpha);
#pragma unroll
        for (int k = 0; k < S::kKeyTiles / 2; ++k) pack_p(s, k, p_frag[k]);
        pending_v = k_tile + S::kTileChunks;
    };
#else
    // The V rows' ldmatrix.trans addresses: key 16 k + ((lane / 8) % 2) * 8 + lane % 8, chunk 2 n + lane / 16.
    const int32_t lane = threadIdx.x % 32;
    const LaneChunks<S::kRowChunks> v_chunks(((lane / 8) % 2) * 8 + lane % 8, lane / 16);
    const auto on_tile = [&](TileView view, const uint4 *k_tile, const int32_t *tile_pos, int32_t tile) {
        if (view == kTileHidden) return;
        float s[S::kKeyTiles][4], ref[2], alpha[2];
        tile_scores<T, kHeadDim, kWarps>(q_frag, k_tile, s);
        tile_softmax(s, view, tile_pos, tile, ref, alpha);
        rescale_acc(alpha);
        // O += P V, 16 keys per step.
        const uint4 *v_ptrs[4];
        v_chunks.pointers(k_tile + S::kTileChunks, v_ptrs);
#pragma unroll
        for (int k = 0; k < S::kKeyTiles / 2; ++k) {
            uint32_t a[4];
            exponentiate(s[2 * k], ref);
            exponentiate(s[2 * k + 1], ref);
            pack_p(s, k, a);
#pragma unroll
            for (int n = 0; n < S::kDimTiles / 2; ++n) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, LaneChunks<S::kRowChunks>::at(v_ptrs, k, n));
                mma_m16n8k16<T>(acc[2 * n], a, b[0], b[1]);
                mma_m16n8k16<T>(acc[2 * n + 1], a, b[2], b[3]);
            }
        }
    };
#endif
#if CONDUIT_WGMMA
    if constexpr (kMmaProducerWarps<kWarps> > 0) {
        if (!for_each_key_tile_specialized<T, kHeadDim, kWarps>(p, kv_head, tile_begin, tile_end, max_q_pos,
                                                                min_q_pos, mma_smem, on_tile))
            return; // the producer
    } else
#endif
    {
        int32_t *pos_smem = reinterpret_cast<int32_t *>(mma_smem + S::kStages * S::kStageChunks);
        for_each_key_tile<T, kHeadDim, kWarps, true, bool(CONDUIT_WGMMA)>(p, kv_head, tile_begin, tile_end, max_q_pos,
                                                                          min_q_pos, mma_smem, pos_smem, on_tile);
    }
#if CONDUIT_WGMMA
    finish_pending(); // the last tile's P V
#endif
    store_rows<T, kHeadDim>(p, rows, acc, run_max, run_sum, split);
}

// The kernel instantiation for (T, kHeadDim, kWarps) as seen from the host: its launch and occupancy.
template <typename T, int kHeadDim, int kWarps> struct MmaKernel {
    using S = MmaShape<kHeadDim, kWarps>;
    static constexpr auto kernel = &mma_attention_kernel<T, kHeadDim, kWarps>;

    // Launches it for p: row tiles x KV heads x p.n_splits (at least one) CTAs.
    static void launch(const AttentionParams &p, cudaStream_t stream) {
        const unsigned n_threads = threads(); // (once a launch: each asks the runtime for the device)
        const size_t smem = smem_bytes(n_threads);
        allow_dynamic_smem<kernel>(smem);
        const dim3 grid{unsigned(mma_attention_base_ctas(p, kWarps) / p.n_kv_heads), unsigned(p.n_kv_heads),
                        unsigned(std::max(p.n_splits, 1))};
        mma_attention_kernel<T, kHeadDim, kWarps><<<grid, n_threads, smem, stream>>>(p);
        CUDA_CHECK_LAUNCH("mma_attention_kernel");
    }

    // Its CTAs one SM holds at once (registers, dynamic shared memory): queried once a device.
    static int resident_per_sm() {
        static std::atomic<int> cache[64];
        return once_per_device(cache, [] {
            int n = 0;
            const unsigned n_threads = threads();
            allow_dynamic_smem<kernel>(smem_bytes(n_threads)); // the occupancy counts only the smem it is allowed
            CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reinterpret_cast<const void *>(kernel),
                                                                     int(n_threads), smem_bytes(n_threads)));
            return std::max(n, 1);
        });
    }

    // Dynamic shared memory for a CTA of n_threads (threads()): the stages of the path the device runs
    // (MmaShape, or the producer's SpecializedRing), and room to align them to the wgmma tile (on
    // sm_90a the K/V tiles are wgmma operands; elsewhere the slack is unused).
    static size_t smem_bytes(unsigned n_threads) {
        const bool producer = n_threads > S::kThreads;
        return (producer ? SpecializedRing<kHeadDim, kWarps>::kBytes : S::kSmemBytes) + kWgmmaTileAlign;
    }

    // Threads a CTA: kThreads, and the producer warpgroup where the device runs code built for sm_90a
    // with it (kMmaProducerWarps), which the kernel's launch bound tells: queried once a device.
    static unsigned threads() {
#ifdef CONDUIT_CUDA_EMULATION
        return S::kThreads + 32 * kMmaProducerWarps<kWarps>; // one build, host and device
#else
        static std::atomic<int> cache[64];
        return unsigned(once_per_device(cache, [] {
            cudaFuncAttributes attributes{};
            CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void *>(kernel)));
            constexpr int kWithProducer = SpecializedRing<kHeadDim, kWarps>::kThreads; // such a build's
            return kWarps == 8 && attributes.maxThreadsPerBlock == kWithProducer ? kWithProducer : S::kThreads;
        }));
#endif
    }
};

// Calls f(MmaKernel<T, head_dim, warps>{}) for bf16 or f16, head_dim 64 or 128, and 4 or 8 warps.
template <typename F> void dispatch_mma(DType dtype, int32_t head_dim, int warps, F &&f) {
    const auto with_warps = [&](auto type_tag, auto dim) {
        using T = typename decltype(type_tag)::type;
        constexpr int kHeadDim = decltype(dim)::value;
        if (warps == 8) f(MmaKernel<T, kHeadDim, 8>{});
        else f(MmaKernel<T, kHeadDim, 4>{});
    };
    const auto with_dim = [&](auto type_tag) {
        if (head_dim == 64) with_warps(type_tag, std::integral_constant<int, 64>{});
        else with_warps(type_tag, std::integral_constant<int, 128>{});
    };
    if (dtype == DType::BF16) with_dim(TypeTag<__nv_bfloat16>{});
    else with_dim(TypeTag<__half>{});
}

} // namespace

int64_t mma_attention_base_ctas(const AttentionParams &p, int warps) {
    const int64_t rows_per_cta = 16 * warps;
    return (int64_t(p.n_q) * p.group + rows_per_cta - 1) / rows_per_cta * p.n_kv_heads;
}

int64_t mma_attention_resident_ctas(DType dtype, int32_t head_dim, int warps) {
    int per_sm = 1;
    dispatch_mma(dtype, head_dim, warps, [&](auto kernel) { per_sm = decltype(kernel)::resident_per_sm(); });
    return int64_t(per_sm) * sm_count();
}

void launch_mma_attention(const AttentionParams &p, DType dtype, int warps, cudaStream_t stream) {
    require(mma_attention_applies(dtype, p.head_dim, p.n_q, p.group) && p.scale_log2 > 0.0f,
            "shape or scale not supported by the mma attention");
    require(p.n_splits <= 1 || (p.partial_out && p.partial_lse && p.split_tokens % kMmaTileKeys == 0),
            "mma attention: splits need partials and whole key tiles");
    dispatch_mma(dtype, p.head_dim, warps, [&](auto kernel) { decltype(kernel)::launch(p, stream); });
}

// 8 warps (128 rows a CTA) share each key tile among twice the rows, which pays while their CTAs
// still fill the device twice over (a long prefill chunk); on fewer rows (CONDUIT's recompute: a few
// hundred queries) 4-warp CTAs balance the SMs better. `forced` (Tuning::mma_warps), 4 or 8, overrides
// the choice.
int mma_warps_for(const AttentionParams &p, int32_t forced) {
    if (forced == 4 || forced == 8) return forced;
    return mma_attention_base_ctas(p, 8) >= 2 * int64_t(sm_count()) ? 8 : 4;
}

} // namespace conduit::kernels::cuda
