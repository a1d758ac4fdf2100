// attention_mma_tile.cuh: the pieces of a tensor-core key-tile loop that the attention kernel
// (attention_mma.cu) and the first pass of the attention statistics (attention_stats_mma.cu) share:
// gathering a key tile from the paged pool, the warp's rows and Q fragments, and S = Q K^T of one
// tile (mma.sync) with its causal mask. The statistics' two passes both use tile_scores, which keeps
// their scores bit-identical; the attention's scores may differ from them in the last bits (on
// sm_90a its S is a wgmma, and it scales inside the exponent).
//
// The key-tile loop (for_each_key_tile) is a ring of kStages shared-memory stages with ONE CTA
// barrier per tile. After the first tiles start, the CTA scans the keys' positions once and stops at
// the last tile its latest query sees (visible_tile_end). Per tile t:
//   wait for t's copies (cp.async.wait_group kStages - 2), __syncthreads, issue the copies of tile
//   t + kStages - 1 into the stage tile t - 1 used, commit, compute t.
// The barrier does two jobs at once: it publishes t's stage (every thread's copies of it are done)
// and proves that every warp has finished t - 1, whose stage the new copies overwrite. With wgmma
// the copies run one tile less ahead (t + kStages - 2, into t - 2's stage): the attention's P V of
// tile t - 1 still reads t - 1's stage while t's softmax runs. Whether a
// tile is visible at all, which of its slots to zero-fill and whether it needs the mask are decided
// by each warp on its own, with warp votes over the tile's 64 positions (two per lane, loaded one
// iteration early): every warp reads the same positions against the same CTA range
// [min_q_pos, max_q_pos], so all reach the same decision without a CTA-wide vote.
// Why one barrier: with a barrier for each of those jobs the warps of a CTA stay in lock step, all in
// Q K^T, then all in the softmax, with the tensor pipe idle in between. One barrier lets warps drift
// apart by up to a tile, and two tiles in flight give the copies a whole tile's compute to land.
// A tile's copies take their pool block ids from registers loaded a tile early (TileBlocks), so that
// no table read stalls the copies after the barrier (read per chunk, each behind a branch, they would
// cost several cache round trips a tile).
#pragma once

#include <math_constants.h>

#include "attention_mma.cuh"
#include "wgmma.cuh"

namespace conduit::kernels::cuda {

// What a key tile holds for the CTA's rows: nothing visible (skipped), some slots visible (masked
// per element), or every slot visible to every row (no mask: most tiles of a causal prefill).
enum TileView : int { kTileHidden = 0, kTileMasked = 1, kTileOpen = 2 };

// The 16-byte chunk `chunk` of the K row of (slot, kv_head) in the paged pool, through block table
// `table` (p.block_table, or a decode step's per-sequence row); its V row is p.v_delta
// elements further.
template <typename T, int kHeadDim>
__device__ __forceinline__ const T *paged_key_chunk(const AttentionParams &p, const int32_t *table, int32_t kv_head,
                                                    int32_t slot, int32_t chunk) {
    const int64_t block = table[slot >> p.block_shift];
    const int32_t block_mask = (1 << p.block_shift) - 1;
    return static_cast<const T *>(p.pool) + block * p.block_elems +
           ((int64_t(kv_head) << p.block_shift) + (slot & block_mask)) * kHeadDim + chunk * 8;
}

// The positions of a key tile's kKeys = 64 slots as one warp holds them: lane l has slot l (lo) and
// slot 32 + l (hi); 0 for slots past the keys, and for tiles at or past tile_end (never loaded).
struct LanePositions {
    int32_t lo, hi;
};

template <int kKeys>
__device__ __forceinline__ LanePositions lane_positions(const AttentionParams &p, int32_t tile, int32_t tile_end) {
    static_assert(kKeys == 64, "two slots per lane");
    const int32_t slot = tile * kKeys + int32_t(threadIdx.x % 32);
    LanePositions pos{0, 0};
    if (tile < tile_end) {
        if (slot < p.n_tokens) pos.lo = p.positions[slot];
        if (slot + 32 < p.n_tokens) pos.hi = p.positions[slot + 32];
    }
    return pos;
}

// What the CTA's rows see of the tile at tile_start, as every warp works it out for itself: bit l of
// seen[h] is set when slot 32 h + l exists and the CTA's latest query (max_q_pos) sees it (the rest
// are zero-filled); view is kTileHidden when no bit is set and kTileOpen when every slot exists and
// the earliest query (min_q_pos) sees it too. Warp-uniform; call from all lanes. The two ballots
// also give each copying thread its rows' zero-fill decision, without a shuffle or a shared read.
struct TileSlots {
    uint32_t seen[2];
    TileView view;

    __device__ __forceinline__ bool sees(int32_t row) const { return ((row < 32 ? seen[0] : seen[1]) >> (row % 32)) & 1u; }
};

__device__ __forceinline__ TileSlots tile_slots(const AttentionParams &p, int32_t tile_start, LanePositions pos,
                                                int32_t max_q_pos, int32_t min_q_pos) {
    const int32_t lane = threadIdx.x % 32;
    const bool exists_lo = tile_start + lane < p.n_tokens, exists_hi = tile_start + 32 + lane < p.n_tokens;
    TileSlots slots;
    slots.seen[0] = __ballot_sync(0xffffffffu, exists_lo && pos.lo <= max_q_pos);
    slots.seen[1] = __ballot_sync(0xffffffffu, exists_hi && pos.hi <= max_q_pos);
    const bool seen_by_all = exists_lo && pos.lo <= min_q_pos && exists_hi && pos.hi <= min_q_pos;
    slots.view = (slots.seen[0] | slots.seen[1]) == 0u ? kTileHidden
                 : __all_sync(0xffffffffu, seen_by_all) ? kTileOpen
                                                        : kTileMasked;
    return slots;
}

// The rows of a key tile of kKeys slots that one of kThreads threads copies (kHeadDim / 8 16-byte
// chunks a row of K or V, shared out in order): rows first_row + i * kRowStride for i < kChunks, the
// same chunk of each. The copying threads are kFirstThread .. kFirstThread + kThreads - 1 of the CTA
// (the attention's producer warpgroup starts past the warps that compute).
template <int kHeadDim, int kThreads, int kKeys, int kFirstThread = 0> struct TileRowsOfThread {
    static constexpr int kRowChunks = kHeadDim / 8;
    static_assert(kThreads % kRowChunks == 0 && kFirstThread % kRowChunks == 0,
                  "a thread copies the same chunk of every row it takes");
    static constexpr int kRowStride = kThreads / kRowChunks;
    static constexpr int kChunks = kKeys * kRowChunks / kThreads;
    static __device__ __forceinline__ int32_t first_row() { return (int32_t(threadIdx.x) - kFirstThread) / kRowChunks; }
    static __device__ __forceinline__ int32_t chunk() { return int32_t(threadIdx.x) % kRowChunks; }
};

// The pool blocks of those rows of the tile at tile_start: block[i] holds row first_row + i * kRowStride
// (table[slot >> block_shift]; 0 for slots at or past n_slots, which are never read). Loaded apart
// from the copies so that a loop can read them a tile early, and so that all of a thread's table
// reads are in flight at once (predicated, not branched around).
template <int kHeadDim, int kThreads, int kKeys, int kFirstThread = 0> struct TileBlocks {
    using Rows = TileRowsOfThread<kHeadDim, kThreads, kKeys, kFirstThread>;
    int32_t block[Rows::kChunks];

    __device__ __forceinline__ TileBlocks(const AttentionParams &p, const int32_t *table, int32_t tile_start,
                                          int32_t n_slots) {
#pragma unroll
        for (int i = 0; i < Rows::kChunks; ++i) {
            const int32_t slot = tile_start + Rows::first_row() + i * Rows::kRowStride;
            block[i] = slot < n_slots ? table[slot >> p.block_shift] : 0;
        }
    }
};

// Issues the cp.async copies of one key tile of kKeys slots from tile_start (K rows of kv_head in
// the pool blocks `blocks` holds, and its V rows kKeys * kHeadDim / 8 chunks further when
// kWithValues; 16-byte chunks, swizzled) into `stage`, kThreads threads sharing the chunks. Rows with
// seen_row(row) false are zero-filled (past the end, or seen by no query: their K/V may be garbage or
// NaN, and 0 * NaN would poison P V); their addresses stay inside the pool (block 0 or a real block)
// and are not read. on_row(row, seen) is called once per row, by the thread copying its first chunk.
// The offset inside a block is 32-bit (block_elems < 2^31: attention_params checks). Shared by the
// tensor-core attention, its statistics and the tensor-core decode.
template <typename T, int kHeadDim, int kThreads, int kKeys, bool kWithValues, bool kWgmmaLayout = false,
          typename SeenRow, typename OnRow>
__device__ __forceinline__ void copy_key_tile(const AttentionParams &p, const TileBlocks<kHeadDim, kThreads, kKeys> &blocks,
                                              int32_t kv_head, int32_t tile_start, uint4 *stage, SeenRow &&seen_row,
                                              OnRow &&on_row) {
    using Rows = TileRowsOfThread<kHeadDim, kThreads, kKeys>;
    constexpr int kTileChunks = kKeys * Rows::kRowChunks;
    const T *pool = static_cast<const T *>(p.pool);
    const int32_t head_row = kv_head << p.block_shift, slot_mask = (1 << p.block_shift) - 1;
    const uint32_t block_elems = uint32_t(p.block_elems);
    const int32_t chunk = Rows::chunk();
#pragma unroll
    for (int i = 0; i < Rows::kChunks; ++i) {
        const int32_t row = Rows::first_row() + i * Rows::kRowStride;
        const bool seen = seen_row(row);
        const int32_t in_block = (head_row + ((tile_start + row) & slot_mask)) * kHeadDim + chunk * 8;
        // block ids are non-negative: one unsigned 32 x 32 -> 64-bit multiply-add
        const T *k_src = pool + (uint64_t(uint32_t(blocks.block[i])) * block_elems + uint32_t(in_block));
        const int dst = kWgmmaLayout ? wgmma_tile_chunk<kKeys, Rows::kRowChunks>(row, chunk)
                                     : swizzled<Rows::kRowChunks>(row, chunk);
        cp_async16(stage + dst, k_src, seen);
        if constexpr (kWithValues) cp_async16(stage + kTileChunks + dst, k_src + p.v_delta, seen);
        if (chunk == 0) on_row(row, seen);
    }
}

// The copies of a tile of the tensor-core attention or statistics: the rows slots.seen marks.
template <typename T, int kHeadDim, int kWarps, bool kWithValues, bool kWgmmaLayout>
__device__ __forceinline__ void issue_tile_copies(const AttentionParams &p,
                                                  const TileBlocks<kHeadDim, 32 * kWarps, kMmaTileKeys> &blocks,
                                                  int32_t kv_head, int32_t tile_start, const TileSlots &slots,
                                                  uint4 *stage) {
    using S = MmaShape<kHeadDim, kWarps>;
    copy_key_tile<T, kHeadDim, S::kThreads, S::kKeys, kWithValues, kWgmmaLayout>(
        p, blocks, kv_head, tile_start, stage,
        [&](int32_t row) { return slots.sees(row); }, [](int32_t, bool) {});
}

// The end of the key tiles [tile_begin, tile_end) that the CTA needs: one past the last tile holding
// a slot its latest query (max_q_pos) sees (tile_begin when none does). Why: in a causal prefill
// chunk, and in CONDUIT's recompute, a CTA's queries see only a prefix of the keys, and every tile
// past it would still cost the loop a barrier, the positions' round trip and the votes (half the
// loop's iterations on a long causal chunk). The scan (visible_slot_bounds) runs while the loop's
// first tiles load. Call from all threads (kWarps warps); kOneCallSite as
// visible_slot_bounds's.
template <int kWarps, int kKeys, bool kOneCallSite = true>
__device__ __forceinline__ int32_t visible_tile_end(const AttentionParams &p, int32_t max_q_pos, int32_t tile_begin,
                                                    int32_t tile_end) {
    const int32_t begin = tile_begin * kKeys, end = min(tile_end * kKeys, p.n_tokens);
    if (end <= begin) return tile_begin; // no slot in the range
    // The range's last slot visible: the scan could only return tile_end (one broadcast load; the
    // common case of queries after every key of their split, as CONDUIT's text pass).
    if (p.positions[end - 1] <= max_q_pos) return tile_end;
    const int32_t last = visible_slot_bounds<kWarps, kOneCallSite>(p.positions, max_q_pos, begin, end).last;
    return last < 0 ? tile_begin : last / kKeys + 1;
}

// Streams the key tiles [tile_begin, tile_end) of one KV head through a ring of MmaShape::kStages
// shared-memory stages (cp.async, kAhead tiles ahead of the compute, one CTA barrier per tile: see
// the top of this file) and calls on_tile(view, k_tile, tile_pos, tile) for every tile up to the
// last one the CTA's rows see (k_tile: its swizzled K rows, followed by the V rows when kWithValues;
// tile_pos: its kKeys positions). A tile no row sees comes with view kTileHidden and no copies in
// its stage (on_tile returns, after finishing what reads an earlier stage). max_q_pos / min_q_pos:
// the latest and the earliest query of the CTA's rows (min_q_pos = INT32_MIN keeps every tile
// masked). smem: kStages stages of one K (and V) tile, in the wgmma layout (wgmma.cuh; smem then
// 1024-byte aligned) when kWgmmaLayout, else swizzled for ldmatrix; pos_smem: kStages * kKeys
// positions. Call from all threads.
template <typename T, int kHeadDim, int kWarps, bool kWithValues, bool kWgmmaLayout = false, typename OnTile>
__device__ __forceinline__ void for_each_key_tile(const AttentionParams &p, int32_t kv_head, int32_t tile_begin,
                                                  int32_t tile_end, int32_t max_q_pos, int32_t min_q_pos, uint4 *smem,
                                                  int32_t *pos_smem, OnTile &&on_tile) {
    using S = MmaShape<kHeadDim, kWarps>;
    constexpr int kStageChunks = kWithValues ? S::kStageChunks : S::kTileChunks;
    const int32_t lane = threadIdx.x % 32;
    // Decides what the tile shows the CTA, stores its positions in the stage's slot (warp 0: the
    // mask reads them) and, unless it is hidden, issues its copies into the stage.
    //
    // Ordering of the positions (plain shared-memory stores, ordered by the loop's one barrier):
    // tile u's are stored by warp 0 right after the barrier of iteration u - kAhead (the first
    // kAhead tiles: before the first barrier) and read by mask_tile in iteration u, after that
    // iteration's barrier, which warp 0 reaches only after its stores: every warp reads them
    // written. The slot they overwrite held tile u - kStages's, read last in the compute of
    // iteration u - kStages <= u - kAhead - 1, which every warp finished before arriving at the
    // barrier warp 0 had just passed. The K/V copies reuse their stage by the same argument, with
    // each thread's cp.async.wait_group before the barrier in place of program order (and, with
    // wgmma, the wait of every product reading the stage inside the on_tile that issued it or the
    // next one: tile u - kStages = u - 3's last reader, its P V, is waited in on_tile(u - 2)).
    using Blocks = TileBlocks<kHeadDim, S::kThreads, S::kKeys>;
    const auto blocks_of = [&](int32_t tile) { // none for tiles past the split
        return Blocks(p, p.block_table, tile * S::kKeys, tile < tile_end ? p.n_tokens : 0);
    };
    const auto start_tile = [&](int32_t tile, LanePositions pos, const Blocks &blocks, int stage) {
        const TileSlots slots = tile_slots(p, tile * S::kKeys, pos, max_q_pos, min_q_pos);
        if (threadIdx.x < 32) {
            pos_smem[stage * S::kKeys + lane] = pos.lo;
            pos_smem[stage * S::kKeys + 32 + lane] = pos.hi;
        }
        if (slots.view != kTileHidden)
            issue_tile_copies<T, kHeadDim, kWarps, kWithValues, kWgmmaLayout>(p, blocks, kv_head, tile * S::kKeys, slots,
                                                                smem + stage * kStageChunks);
        return slots.view;
    };
    // Tiles loaded ahead of the compute: kStages - 1, or kStages - 2 with wgmma, where tile t's stage
    // stays untouched until the barrier of iteration t + 2: on_tile(t + 1) may still read it (the
    // attention's P V product of tile t runs during tile t + 1's softmax).
    constexpr int kAhead = kWgmmaLayout ? S::kStages - 2 : S::kStages - 1;
    static_assert(kAhead >= 1, "at least one tile ahead: the wgmma loop needs kMmaStages >= 3");
    // The views of the tiles in flight, 2 bits each: bits 2k, 2k + 1 are tile + k's (0: hidden, also
    // for tiles past the end).
    uint32_t views = 0;
#pragma unroll
    for (int ahead = 0; ahead < kAhead; ++ahead) {
        const int32_t tile = tile_begin + ahead;
        if (tile < tile_end)
            views |= uint32_t(start_tile(tile, lane_positions<S::kKeys>(p, tile, tile_end), blocks_of(tile), ahead))
                     << (2 * ahead);
        cp_async_commit(); // one group per tile, empty or not: wait_group counts them
    }
    tile_end = visible_tile_end<kWarps, S::kKeys>(p, max_q_pos, tile_begin, tile_end);
    // The positions and pool blocks of the next tile to start are read a tile early: they land during
    // a tile's compute instead of stalling the copies after the barrier.
    LanePositions pos_ahead = lane_positions<S::kKeys>(p, tile_begin + kAhead, tile_end);
    Blocks blocks_ahead = blocks_of(tile_begin + kAhead);
    int stage = 0, ahead_stage = kAhead; // tile's stage; tile + kAhead's
    for (int32_t tile = tile_begin; tile < tile_end; ++tile) {
        cp_async_wait<kAhead - 1>(); // this thread's copies of tile are done
#if CONDUIT_WGMMA
        if constexpr (kWgmmaLayout) fence_async_shared(); // and visible to wgmma's reads
#endif
        __syncthreads();                 // everyone's are; and every warp is done with tile - 1
        const int32_t ahead = tile + kAhead;
        if (ahead < tile_end) {
            views |= uint32_t(start_tile(ahead, pos_ahead, blocks_ahead, ahead_stage)) << (2 * kAhead);
            pos_ahead = lane_positions<S::kKeys>(p, ahead + 1, tile_end); // land during this tile's compute
            blocks_ahead = blocks_of(ahead + 1);
        }
        cp_async_commit();
        const TileView view = TileView(views & 3u);
        views >>= 2;
        on_tile(view, smem + stage * kStageChunks, pos_smem + stage * S::kKeys, tile);
        stage = stage + 1 == S::kStages ? 0 : stage + 1;
        ahead_stage = ahead_stage + 1 == S::kStages ? 0 : ahead_stage + 1;
    }
    cp_async_wait<0>(); // nothing is in flight here (tiles past the trimmed end hold no visible slot,
                        // so they issued no copies): a guard should that change
}


// The shape of for_each_key_tile_specialized's CTA (below; sm_90a only): its threads, their register
// budgets and its shared memory, which the host sizes launches with.
template <int kHeadDim, int kWarps> struct SpecializedRing {
    using S = MmaShape<kHeadDim, kWarps>;
    // 4 stages: the producer runs two tiles ahead of the one computed (a third stage is still read
    // by its P V); a fifth leaves the loop no faster and costs occupancy.
    static constexpr int kStages = 4;
    static_assert(kStages >= 3, "on_tile(t) still reads tile t - 1's stage: 3 stages or more");
    static constexpr int kProducerThreads = 128;
    static constexpr int kThreads = S::kThreads + kProducerThreads;
    static constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
    static_assert(kWarps != 8 || S::kThreads * kConsumerRegisters + kProducerThreads * kProducerRegisters <=
                                     kThreads * (65536 / kThreads / 8 * 8),
                  "the register budgets fit the CTA's");
    // Rows a producer thread copies at once: 8 keep enough copies in flight for the consumers within
    // the producer's small register budget.
    static constexpr int kCopyUnroll = 8;
    // The barriers' counts: every producer thread's copies and the view's writer (full); lane 0 of
    // every consumer warp (empty).
    static constexpr int kFullArrivals = kProducerThreads + 1;
    static constexpr int kEmptyArrivals = kWarps;
    // Bytes: the K/V stages, then each consumer warp's copy of a masked tile's positions, each
    // stage's view, then the full and the empty barriers of every stage.
    static constexpr size_t kPositionOffset = size_t(kStages) * S::kStageChunks * 16;
    static constexpr size_t kViewOffset = kPositionOffset + size_t(kWarps) * S::kKeys * 4;
    static constexpr size_t kBarrierOffset = (kViewOffset + size_t(kStages) * 4 + 7) / 8 * 8;
    static constexpr size_t kBytes = kBarrierOffset + 2 * size_t(kStages) * sizeof(uint64_t);
};

#if CONDUIT_WGMMA
// The key-tile loop of the wgmma attention with a producer warpgroup (warp specialization, as in
// FlashAttention-3). In for_each_key_tile the warps that compute also copy their tiles (about a third
// of a warp's instructions a 64-key tile) and meet at a CTA barrier every tile; here a third
// warpgroup (threads S::kThreads .. S::kThreads + 127) gathers the tiles, and the kWarps consumer
// warps only wait for them and compute. Shared-memory barriers carry what the CTA barrier proved:
//   full[s]: stage s holds its tile: each producer thread arrives with cp.async.mbarrier.arrive.noinc,
//     which fires when the thread's copies have landed, and the producer's thread 0, which stores
//     the tile's view (hidden, open or masked), arrives once more after it: count kFullArrivals.
//   empty[s]: every consumer warp is done with the tile stage s held: after on_tile(t) has returned
//     (on_tile(t) waits for tile t - 1's P V; tile t's own reads are behind its S wait) and a
//     __syncwarp, its lane 0 arrives for tile t - 1, and the producer waits for all kWarps arrivals
//     before refilling the stage.
// Every shared-memory read of a stage is by wgmma or by the lane that arrives for it: lane 0 of a
// consumer warp reads the view and shuffles it to the others. The positions that mask a tile do not
// travel through the ring: each consumer warp reads them from global memory a tile ahead, into
// registers, and stores those of a masked tile into shared memory of its own. (Positions published
// with each stage would need every consumer thread that reads them to arrive on the empty barrier,
// or one lane's release after __syncwarp, which racecheck reports; either costs more than each warp
// reading its own.)
// Ring tile m = tile - tile_begin uses stage m % kStages in phase m / kStages of both barriers. The
// producer fills every stage before the positions scan (visible_tile_end, all threads), then runs as
// far ahead as the empty barriers let it: kStages - 2 tiles ahead of the tile being computed. The
// producer is on the consumers' critical path whenever it falls behind (its table reads one row at a
// time would leave the consumers waiting on full), so a tile's positions are read before the wait
// that precedes its copies, and its pool blocks all at once after it (with them read early too, the
// producer would need more registers than kProducerRegisters). Tiles
// past the scan's end hold no visible slot, so they got no copies (their stages' full barriers
// complete with nobody waiting); the producer waits for its last copies before it leaves. Registers:
// the CTA's 384 threads start at 168 (the launch bound); the producer gives all but
// kProducerRegisters back and the consumers take them (SpecializedRing). Arguments as
// for_each_key_tile's (K and V in the wgmma layout; smem holds SpecializedRing::kBytes; no pos_smem),
// except on_tile's tile_pos: the calling warp's own copy of the tile's positions, written only for a
// masked tile (on_tile may read it only when view is kTileMasked, as mask_tile does). Call from all
// threads; only the consumers call on_tile, and only they return true.
template <typename T, int kHeadDim, int kWarps, typename OnTile>
__device__ __forceinline__ bool for_each_key_tile_specialized(const AttentionParams &p, int32_t kv_head,
                                                              int32_t tile_begin, int32_t tile_end, int32_t max_q_pos,
                                                              int32_t min_q_pos, uint4 *smem, OnTile &&on_tile) {
    using S = MmaShape<kHeadDim, kWarps>;
    using Ring = SpecializedRing<kHeadDim, kWarps>;
    unsigned char *bytes = reinterpret_cast<unsigned char *>(smem);
    int32_t *pos_smem = reinterpret_cast<int32_t *>(bytes + Ring::kPositionOffset);
    int32_t *view_smem = reinterpret_cast<int32_t *>(bytes + Ring::kViewOffset);
    uint64_t *full = reinterpret_cast<uint64_t *>(bytes + Ring::kBarrierOffset), *empty = full + Ring::kStages;
    const int32_t lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < Ring::kStages; ++s) {
            mbarrier_init(full + s, Ring::kFullArrivals);
            mbarrier_init(empty + s, Ring::kEmptyArrivals);
        }
    }
    __syncthreads(); // the barriers exist before anyone arrives

    // The two roles part here for good: each calls the scan's CTA barrier from its own branch (the
    // branches are warp-uniform; the barrier is the unaligned one), so that no code the consumers
    // run with their registers live is also the producer's, whose budget is small.
    if (threadIdx.x >= S::kThreads) {
        registers_decrease<Ring::kProducerRegisters>();
        using Blocks = TileBlocks<kHeadDim, Ring::kProducerThreads, S::kKeys, S::kThreads>;
        using Rows = TileRowsOfThread<kHeadDim, Ring::kProducerThreads, S::kKeys, S::kThreads>;
        // What the tile shows the CTA (each warp works it out for its copies), then its copies (unless
        // hidden): the rows and layout of copy_key_tile, the pool blocks of all of a thread's rows read
        // at once, then kCopyUnroll rows' copies at a time (registers for all of them would come out of
        // the consumers'). (Not copy_key_tile itself: given the first thread and the unroll, it folds
        // the V copies' addresses less well, 8 more instructions a head-dim-128 kernel.)
        const auto fill_stage = [&](int32_t tile, LanePositions pos, int stage) {
            const TileSlots slots = tile_slots(p, tile * S::kKeys, pos, max_q_pos, min_q_pos);
            if (threadIdx.x == S::kThreads) {
                view_smem[stage] = int32_t(slots.view);
                mbarrier_arrive(full + stage); // releases the view
            }
            if (slots.view != kTileHidden) {
                const Blocks blocks(p, p.block_table, tile * S::kKeys, tile < tile_end ? p.n_tokens : 0);
                const T *pool = static_cast<const T *>(p.pool);
                const int32_t head_row = kv_head << p.block_shift, slot_mask = (1 << p.block_shift) - 1;
                const int32_t chunk = Rows::chunk();
                uint4 *dst_k = smem + stage * S::kStageChunks;
#pragma unroll Ring::kCopyUnroll
                for (int i = 0; i < Rows::kChunks; ++i) {
                    const int32_t row = Rows::first_row() + i * Rows::kRowStride;
                    const bool seen = slots.sees(row);
                    const uint32_t in_block =
                        uint32_t((head_row + ((tile * S::kKeys + row) & slot_mask)) * kHeadDim + chunk * 8);
                    const T *k_src =
                        pool + (uint64_t(uint32_t(blocks.block[i])) * uint32_t(p.block_elems) + in_block);
                    const int dst = wgmma_tile_chunk<S::kKeys, S::kRowChunks>(row, chunk);
                    cp_async16(dst_k + dst, k_src, seen);
                    cp_async16(dst_k + S::kTileChunks + dst, k_src + p.v_delta, seen);
                }
            }
            cp_async_mbarrier_arrive(full + stage);
        };
#pragma unroll 1
        for (int m = 0; m < Ring::kStages && tile_begin + m < tile_end; ++m) // every stage is free: fill them
            fill_stage(tile_begin + m, lane_positions<S::kKeys>(p, tile_begin + m, tile_end), m);
        tile_end = visible_tile_end<Ring::kThreads / 32, S::kKeys, false>(p, max_q_pos, tile_begin, tile_end);
        LanePositions next_pos = lane_positions<S::kKeys>(p, tile_begin + Ring::kStages, tile_end);
        int stage = 0;
#pragma unroll 1
        for (int32_t tile = tile_begin + Ring::kStages; tile < tile_end; ++tile) {
            const LanePositions pos = next_pos;
            mbarrier_wait(empty + stage, uint32_t((tile - tile_begin) / Ring::kStages - 1) & 1u);
            fill_stage(tile, pos, stage);
            next_pos = lane_positions<S::kKeys>(p, tile + 1, tile_end); // lands during the next wait
            stage = stage + 1 == Ring::kStages ? 0 : stage + 1;
        }
        cp_async_commit(); // (the copies are in no group: commit them, so that the wait covers them)
        cp_async_wait<0>(); // no copy may land in a stage after the CTA has left
        return false;
    }
    registers_increase<Ring::kConsumerRegisters>();
    tile_end = visible_tile_end<Ring::kThreads / 32, S::kKeys, false>(p, max_q_pos, tile_begin, tile_end);
    int32_t *warp_pos = pos_smem + (threadIdx.x / 32) * S::kKeys; // this warp's copy of a masked tile's positions
    LanePositions next_pos = lane_positions<S::kKeys>(p, tile_begin, tile_end);
    int stage = 0, previous_stage = Ring::kStages - 1; // tile's and tile - 1's
    for (int32_t tile = tile_begin; tile < tile_end; ++tile) {
        const LanePositions pos = next_pos;
        next_pos = lane_positions<S::kKeys>(p, tile + 1, tile_end); // lands during this tile
        mbarrier_wait(full + stage, uint32_t((tile - tile_begin) / Ring::kStages) & 1u);
        fence_async_shared(); // the copies' generic-proxy writes, before wgmma's async-proxy reads
        int32_t view_of_lane0 = 0; // (lane 0 alone reads it: its arrival below then orders the read)
        if (lane == 0) view_of_lane0 = view_smem[stage];
        const TileView view = TileView(__shfl_sync(0xffffffffu, view_of_lane0, 0));
        if (view == kTileMasked) { // (tile - 1's reads of warp_pos are behind the __syncwarp after its on_tile)
            warp_pos[lane] = pos.lo;
            warp_pos[32 + lane] = pos.hi;
            __syncwarp(); // every lane's stores before any lane's mask
        }
        on_tile(view, smem + stage * S::kStageChunks, warp_pos, tile);
        __syncwarp(); // every lane is done with tile - 1's stage and with warp_pos
        if (tile > tile_begin && lane == 0) mbarrier_arrive(empty + previous_stage);
        previous_stage = stage;
        stage = stage + 1 == Ring::kStages ? 0 : stage + 1;
    }
    return true;
}
#endif // CONDUIT_WGMMA


// Raises kKernel's dynamic shared-memory limit to `bytes`, once per device.
template <auto kKernel> void allow_dynamic_smem(size_t bytes) {
    static std::atomic<int> done[64];
    once_per_device(done, [bytes] {
        CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void *>(kKernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
        return 1;
    });
}

// One warp's rows: which (query, head) each of its two fragment rows (g and g + 8) is. Rows are
// (query, head) pairs of one KV head, query-major: row r = query r / group, head r % group.
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

// Max and sum over the 4 lanes of a quad (the lanes that share a fragment row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Online softmax, base 2: folds a tile's row maxima (lane-partial tile_max of rows g, g + 8) into the
// running max, rescales the lane-partial running sums to it, and returns the reference each score of
// the tile is taken relative to (ref: the new max, 0 while nothing is seen, so that p = 0) and the
// factor alpha the row's earlier accumulations were scaled by.
__device__ __forceinline__ void rescale_running(const float (&tile_max)[2], float (&run_max)[2], float (&run_sum)[2],
                                                float (&ref)[2], float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float new_max = fmaxf(run_max[r], quad_max(tile_max[r]));
        ref[r] = new_max == -CUDART_INF_F ? 0.0f : new_max;
        alpha[r] = fast_exp2(run_max[r] - ref[r]);
        run_max[r] = new_max;
        run_sum[r] *= alpha[r];
    }
}

// Ldmatrix of the B fragments of keys 16 n .. 16 n + 15 for k-step k from a swizzled K tile:
// b[0], b[1] serve n-tile 2 n (keys 16 n + 0..7), b[2], b[3] n-tile 2 n + 1.
template <int kRowChunks> __device__ __forceinline__ void load_key_pair(uint32_t (&b)[4], const uint4 *k_tile, int n, int k) {
    const int lane = threadIdx.x % 32;
    const int key = 16 * n + (lane / 16) * 8 + lane % 8;
    ldmatrix_x4(b, k_tile + swizzled<kRowChunks>(key, 2 * k + (lane / 8) % 2));
}

// S = Q K^T of the warp's 16 rows and one kKeys tile, unscaled: s[n] is n-tile n (keys 8n .. 8n + 7),
// lane holding rows g, g + 8 at keys 8n + 2t, +1.
template <typename T, int kHeadDim, int kWarps>
__device__ __forceinline__ void tile_scores(const uint32_t (&q_frag)[kHeadDim / 16][4], const uint4 *k_tile,
                                            float (&s)[MmaShape<kHeadDim, kWarps>::kKeyTiles][4]) {
    using S = MmaShape<kHeadDim, kWarps>;
    const int lane = threadIdx.x % 32;
    // load_key_pair's addresses: key 16 n + (lane / 16) * 8 + lane % 8, chunk 2 k + (lane / 8) % 2
    const LaneChunks<S::kRowChunks> k_chunks((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const uint4 *k_ptrs[4];
    k_chunks.pointers(k_tile, k_ptrs);
#pragma unroll
    for (int n = 0; n < S::kKeyTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[n][j] = 0.0f;
#pragma unroll
    for (int k = 0; k < S::kDimSteps; ++k)
#pragma unroll
        for (int n = 0; n < S::kKeyTiles / 2; ++n) {
            uint32_t b[4];
            ldmatrix_x4(b, LaneChunks<S::kRowChunks>::at(k_ptrs, n, k)); // = load_key_pair(b, k_tile, n, k)
            mma_m16n8k16<T>(s[2 * n], q_frag[k], b[0], b[1]);
            mma_m16n8k16<T>(s[2 * n + 1], q_frag[k], b[2], b[3]);
        }
}

// Unless the tile is open (every slot visible to every row), sets the scores of slots a row cannot
// see to -inf; with kScale, first scales the others to base 2 (times scale_log2). Returns the lane's
// max of each row (g, g + 8) in tile_max. Without kScale the maxima are those of the raw scores: the
// attention folds the scale into its exponent (a positive factor keeps the maxima's order and bits).
template <int kKeyTiles, bool kScale>
__device__ __forceinline__ void mask_tile(float (&s)[kKeyTiles][4], TileView view, const WarpRows &rows,
                                          const int32_t *tile_pos, int32_t tile_keys, float scale_log2,
                                          float (&tile_max)[2]) {
    const int32_t t = threadIdx.x % 4;
    tile_max[0] = tile_max[1] = -CUDART_INF_F;
    if (view == kTileMasked) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = j / 2, key = 8 * n + 2 * t + j % 2;
                const bool seen = rows.valid[r] && key < tile_keys && tile_pos[key] <= rows.q_pos[r];
                s[n][j] = seen ? (kScale ? s[n][j] * scale_log2 : s[n][j]) : -CUDART_INF_F;
                tile_max[r] = fmaxf(tile_max[r], s[n][j]);
            }
    } else {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (kScale) s[n][j] *= scale_log2;
                tile_max[j / 2] = fmaxf(tile_max[j / 2], s[n][j]);
            }
    }
}

} // namespace conduit::kernels::cuda
