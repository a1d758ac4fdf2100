// attention_decode_fp8.cu: split-KV decode attention over an fp8 pool (kernels.h's layout: e4m3 K and
// V rows, a float32 power-of-two scale per row) on tensor cores (mma.sync m16n8k16, sm_80+), for
// bf16/f16 queries with head_dim 64 or 128 and GQA groups of 1..16: one query per sequence, every
// stored key of its split range.
//
// Why not the dense decode kernel on tiles expanded in shared memory: a convert, a multiply by the
// scale, a pack and a store per pair of values, then a barrier between the warps that expand and the
// warps that read, cost the SM about as many instructions as half the bytes leave time for. Here the
// e4m3 bytes go from shared memory straight into f16 mma fragments (e4m3 is exact in f16, one convert
// per pair), and the row scales ride on the scores:
//   - S = Q K^T. A lane's B fragment pair of a k-step is 4 consecutive bytes of a K row: the head dims
//     are permuted, Q's in the same way (load_scaled_q), which leaves Q K^T unchanged. Q is scaled by
//     a power of two into f16's range (its bf16 values stay exact) and the scores by that power, the
//     K row's scale and the softmax scale.
//   - O += P V. V's row scale is folded into P in the log domain: the accumulator sums
//     exp2(s + log2 v_scale - m_v) V with a running maximum m_v of its own beside the softmax's m, so
//     that the f16 weights stay at most 1 whatever the scales, and O = acc 2^m_v / (sum 2^m) at the
//     end. Lane group g takes the dims [g * head_dim / 8, +head_dim / 8): one 16-byte (8-byte) read
//     per key, two keys' bytes paired per dim by byte_perm, and O's columns come out permuted in the
//     same way (merge_and_store puts them back).
//   - Each warp streams its own 16-key units (unit u of the split goes to warp u % kWarps) through a
//     ring of kStages stages (cp.async, one __syncwarp per unit, no CTA barrier in the loop), rows
//     XOR-swizzled by 16-byte chunk so that both fragment reads are free of bank conflicts.
// Multi-head attention (group 1) uses one row of the sixteen, as the dense kernel does not (the
// CUDA-core kernel is cheaper there on 16-bit tiles): here the alternative is a dequantized copy of
// the layer, three times the bytes. The result is the dense decode kernel's on the dequantized rows
// up to f32 rounding; f16 P keeps 3 bits more than the dense kernel's bf16 P.
//
// Grid (x = query, y = KV head, z = split), split plan, partials and merge: those of the dense decode
// kernel (attention_mma_decode.cu, attention.cu).
//
// Fragment layouts (g = lane / 4, t = lane % 4; PTX ISA, m16n8k16):
//   A (Q or P, 16 x 16): a[0] = row g, cols 2t, 2t+1; a[1] = row g+8; a[2], a[3] = cols 8+2t, 8+2t+1.
//   B (16 x 8): b[0] = rows 2t, 2t+1 of col g; b[1] = rows 8+2t, 8+2t+1.
//   C (16 x 8): c[0], c[1] = row g, cols 2t, 2t+1; c[2], c[3] = row g+8.
//   Rows are the group's query heads (rows at or past the group are zero); with group <= 8 (kTall
//   false) rows g+8 are skipped.
#include <cuda_fp8.h>
#include <math_constants.h>

#include <type_traits>

#include "attention_mma_tile.cuh" // the mma primitives, quad_max/quad_sum
#include "decode_dispatch.cuh"

namespace conduit::kernels::cuda {
namespace {

template <int kHeadDim> struct Fp8DecodeShape {
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kUnitKeys = 16;                    // keys of a warp's unit (one mma k-step of P V)
    // Units in a warp's ring: 3 in flight while one is read, 66 KiB a CTA at head_dim 128, so that
    // three CTAs fit an SM and keep about 150 KiB of the stream in flight on it.
    static constexpr int kStages = 4;
    static constexpr int kRowChunks = kHeadDim / 16;        // 16-byte chunks of an e4m3 row
    static constexpr int kUnitChunks = kUnitKeys * kRowChunks; // a unit's K (or V) bytes
    static constexpr int kDimSteps = kHeadDim / 16;         // k-steps of Q K^T
    static constexpr int kDimTiles = kHeadDim / 8;          // n-tiles of O = P V
    static constexpr int kLaneChunks = kHeadDim / 64;       // chunks of a K row one lane reads (4 dims a k-step)
    static constexpr int kValueBytes = kHeadDim / 8;        // bytes of a V row one lane reads (a dim per n-tile)
    static constexpr size_t kStageBytes = size_t(2 * kUnitChunks) * 16 + 2 * kUnitKeys * sizeof(float);
    static constexpr size_t kStageVecs = kStageBytes / 16;
    static constexpr size_t kRingBytes = size_t(kWarps) * kStages * kStageBytes;
    // The warps' O rows at the end, padded by 8 floats so that the 8 rows of a store phase fall in
    // different banks.
    static constexpr int kMergeStride = kHeadDim + 8;
    static constexpr size_t kMergeBytes = size_t(kWarps) * 16 * kMergeStride * 4;
    static constexpr size_t kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
    static_assert(kStageBytes % 16 == 0, "stages of whole 16-byte chunks");
    static_assert(kDecodeMmaTileKeys % (kUnitKeys * kWarps) == 0, "splits hold whole rounds of units");
};

// Where chunk `chunk` of row `key` of a unit's K (or V) bytes lies: XOR-swizzled by the row, so that
// the 8 rows a fragment read touches at one chunk fall in different banks.
template <int kHeadDim> __device__ __forceinline__ int unit_chunk(int key, int chunk) {
    constexpr int kRowChunks = Fp8DecodeShape<kHeadDim>::kRowChunks;
    return key * kRowChunks + (chunk ^ (key % kRowChunks));
}

// A stage's row scales, after its K and V bytes: K's of the unit's 16 keys, then V's (0 for a slot the
// query does not see).
template <int kHeadDim, typename Chunk> __device__ __forceinline__ auto unit_scales(Chunk *stage) {
    using Float = std::conditional_t<std::is_const_v<Chunk>, const float, float>;
    return reinterpret_cast<Float *>(stage + 2 * Fp8DecodeShape<kHeadDim>::kUnitChunks);
}

// Issues one warp's cp.async copies of the unit at unit_start (the e4m3 K and V rows of kv_head and
// their scales) into `stage`. Slots the query does not see (at or past `end`, or whose position is
// after q_position) are zero-filled, scales included: a zero K scale marks them for the softmax, and
// their bytes (maybe garbage or NaN) are never read. Lane k % 16 looks up key k's block.
template <int kHeadDim>
__device__ __forceinline__ void load_unit(const AttentionParams &p, const int32_t *table, int32_t kv_head,
                                          int32_t unit_start, int32_t end, int32_t q_position, uint4 *stage) {
    using S = Fp8DecodeShape<kHeadDim>;
    const int32_t lane = threadIdx.x % 32, my_key = lane % S::kUnitKeys, my_slot = unit_start + my_key;
    const bool my_seen = my_slot < end && (!p.positions || p.positions[my_slot] <= q_position);
    const int32_t my_block = my_seen ? table[my_slot >> p.block_shift] : -1;
    const uint8_t *pool = static_cast<const uint8_t *>(p.pool);
    const int32_t head_row = kv_head << p.block_shift, slot_mask = (1 << p.block_shift) - 1;
    const int64_t rows = int64_t(p.n_kv_heads) << p.block_shift; // K rows of a block, then as many V rows
#pragma unroll
    for (int i = 0; i < S::kUnitChunks / 32; ++i) {
        const int32_t idx = lane + 32 * i, key = idx / S::kRowChunks, chunk = idx % S::kRowChunks;
        const int32_t block = __shfl_sync(0xffffffffu, my_block, key);
        const bool seen = block >= 0;
        const int64_t row = head_row + ((unit_start + key) & slot_mask);
        const uint8_t *k_bytes = pool + (seen ? block : 0) * p.block_bytes + row * kHeadDim + chunk * 16;
        const int dst = unit_chunk<kHeadDim>(key, chunk);
        cp_async16(stage + dst, k_bytes, seen);
        cp_async16(stage + S::kUnitChunks + dst, k_bytes + rows * kHeadDim, seen);
    }
    // lane k < 16: key k's K scale; lane 16 + k: its V scale (after the block's bytes, a float a row)
    const int64_t row = head_row + (my_slot & slot_mask) + (lane / S::kUnitKeys) * rows;
    const uint8_t *scale = pool + (my_seen ? my_block : 0) * p.block_bytes + 2 * rows * kHeadDim + row * 4;
    cp_async4(unit_scales<kHeadDim>(stage) + lane, scale, my_seen);
}

// The CTA's Q rows (row r = head r of the group, zero at or past the group) as f16 A fragments in the
// K fragments' dim order: k-step k of lane t holds dims t * head_dim / 4 + 4k + (0, 1) in a[0], a[1]
// and + (2, 3) in a[2], a[3]. The values are scaled by a power of two that puts the largest into
// [2^14, 2^15), which keeps bf16 values exact in f16; returns that power's inverse, the scores' factor.
template <typename T, int kHeadDim>
__device__ __forceinline__ float load_scaled_q(const AttentionParams &p, int32_t qi, int32_t kv_head,
                                               uint32_t (&q_frag)[kHeadDim / 16][4]) {
    using S = Fp8DecodeShape<kHeadDim>;
    const int32_t lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const T *q = static_cast<const T *>(p.q) + (int64_t(qi) * p.n_heads + kv_head * p.group) * kHeadDim +
                 t * (kHeadDim / 4);
    const auto value = [&](int r, int k, int e) { // row g + 8r, k-step k, element e of 4
        const int32_t row = g + 8 * r;
        return row < p.group ? to_float(q[row * kHeadDim + 4 * k + e]) : 0.0f;
    };
    float amax = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < S::kDimSteps; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(value(r, k, e)));
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
    int exponent = 15; // amax < 2^exponent; NaN, inf and zero rows keep the scale 1
    if (amax > 0.0f && amax <= 3.402823466e38f) frexpf(amax, &exponent);
    const int shift = min(max(exponent - 15, -100), 100);
    const float scale = ldexpf(1.0f, -shift);
#pragma unroll
    for (int k = 0; k < S::kDimSteps; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = j % 2, e = 2 * (j / 2);
            q_frag[k][j] = pack2<__half>(value(r, k, e) * scale, value(r, k, e + 1) * scale);
        }
    return ldexpf(1.0f, shift);
}

// Two e4m3 values (the low and the high byte) as an f16 pair, the low byte in the low half.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t bytes) {
    const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bytes & 0xffffu), __NV_E4M3);
    return uint32_t(pair.x) | (uint32_t(pair.y) << 16);
}

// log2 of a row scale (a power of two): its exponent bits; -inf for 0 (a slot not seen), and log2f's
// answer for what has no normal exponent (subnormal, inf, NaN).
__device__ __forceinline__ float scale_log2(float scale) {
    const uint32_t exponent = (__float_as_uint(scale) >> 23) & 0xffu;
    return exponent - 1u < 254u ? float(int32_t(exponent) - 127) : log2f(scale);
}

// One warp's softmax state over the keys it has seen, per fragment row half (g, g+8): the scores'
// running max m (base 2) and lane-partial sum relative to it; value_max, the largest
// (s - m) + log2 v_scale of a key (the log2 of its term in O over 2^m, kept relative to m so that large
// scores do not round the scale's exponent away); and the accumulator acc (O for rows g, g+8 at
// permuted cols 2t, 2t+1 of each n-tile) in units of 2^(m + value_max).
template <int kHeadDim> struct Fp8Softmax {
    float acc[kHeadDim / 8][4];
    float run_max[2];
    float run_sum[2];
    float value_max[2];
};

// The new running max of a row half given its lane-partial tile max: the max itself and the reference
// the tile is taken relative to (0 while nothing is seen, so that its weights are 0), and the factor
// that rescales what was summed before.
__device__ __forceinline__ float advance_max(float &run_max, float tile_max, float &alpha) {
    const float new_max = fmaxf(run_max, quad_max(tile_max));
    const float ref = new_max == -CUDART_INF_F ? 0.0f : new_max;
    alpha = fast_exp2(run_max - ref);
    run_max = new_max;
    return ref;
}

// Folds one unit (a landed stage) into the warp's state.
template <int kHeadDim, bool kTall>
__device__ __forceinline__ void attend_unit(const uint32_t (&q_frag)[kHeadDim / 16][4], const uint4 *stage,
                                            float qk_scale, Fp8Softmax<kHeadDim> &state) {
    using S = Fp8DecodeShape<kHeadDim>;
    constexpr int kHalves = kTall ? 2 : 1; // fragment row halves that hold query heads
    const int32_t lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float *scales = unit_scales<kHeadDim>(stage);
    // This lane's score columns are keys 8n + 2t + c of the unit.
    float k_scale[2][2], v_log2[2][2];
    bool any_seen = false;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const float2 ks = *reinterpret_cast<const float2 *>(scales + 8 * n + 2 * t);
        k_scale[n][0] = ks.x;
        k_scale[n][1] = ks.y;
        any_seen |= ks.x != 0.0f || ks.y != 0.0f;
    }
    if (!__any_sync(0xffffffffu, any_seen)) return; // warp-uniform: a tail unit past the keys costs no math
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const float2 vs = *reinterpret_cast<const float2 *>(scales + S::kUnitKeys + 8 * n + 2 * t);
        v_log2[n][0] = scale_log2(vs.x);
        v_log2[n][1] = scale_log2(vs.y);
    }

    // S = Q K^T over e4m3 K: n-tile n is keys 8n..8n+7, key 8n + g's bytes [t * head_dim / 4, +head_dim / 4)
    // in this lane, word k its k-step's 4 dims (b[0]: the low two bytes, b[1]: the high two).
    float s[2][4] = {};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const int key = 8 * n + g;
        uint32_t words[S::kDimSteps];
#pragma unroll
        for (int c = 0; c < S::kLaneChunks; ++c) {
            const uint4 chunk = stage[unit_chunk<kHeadDim>(key, t * S::kLaneChunks + c)];
            words[4 * c] = chunk.x;
            words[4 * c + 1] = chunk.y;
            words[4 * c + 2] = chunk.z;
            words[4 * c + 3] = chunk.w;
        }
#pragma unroll
        for (int k = 0; k < S::kDimSteps; ++k)
            mma_m16n8k16<__half>(s[n], q_frag[k], e4m3x2_to_f16x2(words[k]), e4m3x2_to_f16x2(words[k] >> 16));
    }

    // Scores in base 2 (-inf where the slot is not seen), and the value weights' exponents beside them.
    float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int half = j / 2, c = j % 2;
            if (half >= kHalves) continue;
            s[n][j] = k_scale[n][c] != 0.0f ? s[n][j] * (qk_scale * k_scale[n][c]) : -CUDART_INF_F;
            tile_max[half] = fmaxf(tile_max[half], s[n][j]);
        }
    // The softmax's new max (ref: the reference of this unit's weights), then each key's term exponent
    // u = (s - ref) + log2 v_scale and the new value_max, relative to ref.
    float ref[2] = {0.0f, 0.0f}, value_ref[2] = {0.0f, 0.0f}, value_alpha[2] = {1.0f, 1.0f};
    float u[2][4], tile_value_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, shifted_value_max[2];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
        const float old_max = state.run_max[h];
        float alpha;
        ref[h] = advance_max(state.run_max[h], tile_max[h], alpha);
        state.run_sum[h] *= alpha;
        shifted_value_max[h] = state.value_max[h] + (old_max - ref[h]); // -inf while nothing was seen
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int half = j / 2;
            if (half >= kHalves) continue;
            u[n][j] = (s[n][j] - ref[half]) + v_log2[n][j % 2];
            tile_value_max[half] = fmaxf(tile_value_max[half], u[n][j]);
        }
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
        state.value_max[h] = shifted_value_max[h];
        value_ref[h] = advance_max(state.value_max[h], tile_value_max[h], value_alpha[h]);
    }
    if (__any_sync(0xffffffffu, value_alpha[0] != 1.0f || value_alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j / 2 < kHalves) state.acc[n][j] *= value_alpha[j / 2];
    }

    // The value weights as P V's A fragment over the unit's 16 keys (cols 0..7 from n-tile 0, 8..15
    // from n-tile 1); the softmax weights only into the sums.
    uint32_t a[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
            state.run_sum[h] += fast_exp2(s[n][2 * h] - ref[h]) + fast_exp2(s[n][2 * h + 1] - ref[h]);
            a[2 * n + h] = pack2<__half>(fast_exp2(u[n][2 * h] - value_ref[h]), fast_exp2(u[n][2 * h + 1] - value_ref[h]));
        }

    // acc += W V over e4m3 V: this lane's bytes [g * head_dim / 8, +head_dim / 8) of keys 2t, 2t+1 (b[0])
    // and 8+2t, 8+2t+1 (b[1]); byte i of them is col g of n-tile i.
    constexpr int kWords = S::kValueBytes / 4;
    uint32_t rows[4][kWords];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int key = 2 * t + (r % 2) + 8 * (r / 2);
        const uint4 *v_bytes = stage + S::kUnitChunks;
        if constexpr (kWords == 4) {
            const uint4 chunk = v_bytes[unit_chunk<kHeadDim>(key, g)];
            rows[r][0] = chunk.x;
            rows[r][1] = chunk.y;
            rows[r][2] = chunk.z;
            rows[r][3] = chunk.w;
        } else {
            const uint2 half_chunk = reinterpret_cast<const uint2 *>(v_bytes + unit_chunk<kHeadDim>(key, g / 2))[g % 2];
            rows[r][0] = half_chunk.x;
            rows[r][1] = half_chunk.y;
        }
    }
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
        // bytes (b of key 2t, b of key 2t+1) paired per n-tile 4w + b
        const uint32_t low01 = __byte_perm(rows[0][w], rows[1][w], 0x5140), low23 = __byte_perm(rows[0][w], rows[1][w], 0x7362);
        const uint32_t high01 = __byte_perm(rows[2][w], rows[3][w], 0x5140), high23 = __byte_perm(rows[2][w], rows[3][w], 0x7362);
        mma_m16n8k16<__half>(state.acc[4 * w], a, e4m3x2_to_f16x2(low01), e4m3x2_to_f16x2(high01));
        mma_m16n8k16<__half>(state.acc[4 * w + 1], a, e4m3x2_to_f16x2(low01 >> 16), e4m3x2_to_f16x2(high01 >> 16));
        mma_m16n8k16<__half>(state.acc[4 * w + 2], a, e4m3x2_to_f16x2(low23), e4m3x2_to_f16x2(high23));
        mma_m16n8k16<__half>(state.acc[4 * w + 3], a, e4m3x2_to_f16x2(low23 >> 16), e4m3x2_to_f16x2(high23 >> 16));
    }
}

// Merges the warps' states through shared memory (the rings, free by now) and writes the CTA's rows:
// out and lse for a single split, else the split's partial and natural-log lse. O's col 2t + c of
// n-tile n is dim (2t + c) * head_dim / 8 + n.
template <typename T, int kHeadDim, bool kTall>
__device__ __forceinline__ void merge_and_store(const AttentionParams &p, int32_t qi, int32_t kv_head, int32_t split,
                                                Fp8Softmax<kHeadDim> &state, float *merge) {
    using S = Fp8DecodeShape<kHeadDim>;
    constexpr int kHalves = kTall ? 2 : 1;
    __shared__ float warp_max[S::kWarps][16], warp_sum[S::kWarps][16], warp_value_max[S::kWarps][16];
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
        const float total = quad_sum(state.run_sum[h]);
        const int32_t row = g + 8 * h;
        if (row >= p.group) continue;
        float *dst = merge + (warp * 16 + row) * S::kMergeStride + 2 * t; // in fragment order: col 8n + 2t + c
#pragma unroll
        for (int n = 0; n < S::kDimTiles; ++n)
            *reinterpret_cast<float2 *>(dst + 8 * n) = make_float2(state.acc[n][2 * h], state.acc[n][2 * h + 1]);
        if (t == 0) {
            warp_max[warp][row] = state.run_max[h];
            warp_sum[warp][row] = total;
            warp_value_max[warp][row] = state.value_max[h];
        }
    }
    __syncthreads();

    for (int32_t idx = threadIdx.x; idx < p.group * kHeadDim; idx += S::kThreads) {
        const int32_t row = idx / kHeadDim, col = idx % kHeadDim; // col = 8n + (2t + c)
        const int32_t d = (col % 8) * S::kValueBytes + col / 8;
        float total_max = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < S::kWarps; ++w) total_max = fmaxf(total_max, warp_max[w][row]);
        const float ref = total_max == -CUDART_INF_F ? 0.0f : total_max;
        // warp w's acc is in units of 2^(its max + its value_max): 2^shift[w] over 2^ref
        float shift[S::kWarps], total_shift = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < S::kWarps; ++w) {
            shift[w] = (warp_max[w][row] - ref) + warp_value_max[w][row];
            total_shift = fmaxf(total_shift, shift[w]);
        }
        const float value_ref = total_shift == -CUDART_INF_F ? 0.0f : total_shift;
        float total_sum = 0.0f, total_acc = 0.0f;
#pragma unroll
        for (int w = 0; w < S::kWarps; ++w) {
            total_sum += warp_sum[w][row] * exp2f(warp_max[w][row] - ref);
            total_acc += merge[(w * 16 + row) * S::kMergeStride + col] * exp2f(shift[w] - value_ref);
        }
        const bool empty = total_sum == 0.0f;
        const float value = empty ? 0.0f : total_acc / total_sum * exp2f(value_ref);
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
__global__ void __launch_bounds__(Fp8DecodeShape<kHeadDim>::kThreads) decode_fp8_kernel(const AttentionParams p) {
    using S = Fp8DecodeShape<kHeadDim>;
    extern __shared__ uint4 fp8_smem[];
    const int32_t qi = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const int32_t warp = threadIdx.x / 32;

    const int32_t *table = p.block_table;
    int32_t n_tokens = p.n_tokens, split_tokens = p.split_tokens;
    if (p.seq_n_tokens) { // a decode step over a batch: this query's own sequence
        n_tokens = p.seq_n_tokens[qi];
        table += qi * p.table_stride;
        split_tokens = split_tokens_for(n_tokens, p.n_splits, kDecodeMmaTileKeys);
    }
    const int32_t begin = min(n_tokens, split * split_tokens);
    const int32_t end = min(n_tokens, begin + split_tokens);
    const int32_t n_units = (end - begin + S::kUnitKeys - 1) / S::kUnitKeys;
    const int32_t my_units = n_units > warp ? (n_units - warp + S::kWarps - 1) / S::kWarps : 0;
    uint4 *ring = fp8_smem + warp * S::kStages * S::kStageVecs;
    const auto stage = [&](int32_t i) { return ring + (i % S::kStages) * S::kStageVecs; };
    const auto unit_start = [&](int32_t i) { return begin + (warp + i * S::kWarps) * S::kUnitKeys; };

    // Launched chained (common.cuh): q (and, in a batch step, each sequence's last row) are the
    // previous kernels'. In a step the units wholly below the last slot stream before the wait.
    int32_t early = 0;
    if (p.tiles_before_wait && !p.positions)
        while (early < min(my_units, S::kStages - 1) && unit_start(early) + S::kUnitKeys <= n_tokens - 1) ++early;
    for (int32_t i = 0; i < early; ++i) {
        load_unit<kHeadDim>(p, table, kv_head, unit_start(i), end, INT32_MAX, stage(i));
        cp_async_commit();
    }
    const int32_t q_position = finish_prologue<T>(p, table, qi, kv_head, n_tokens, begin, end); // p.new_k is null
    for (int32_t i = early; i < S::kStages - 1; ++i) { // one commit group per stage, as the loop counts them
        if (i < my_units) load_unit<kHeadDim>(p, table, kv_head, unit_start(i), end, q_position, stage(i));
        cp_async_commit();
    }

    uint32_t q_frag[S::kDimSteps][4];
    const float qk_scale = load_scaled_q<T, kHeadDim>(p, qi, kv_head, q_frag) * p.scale_log2;
    Fp8Softmax<kHeadDim> state;
#pragma unroll
    for (int n = 0; n < S::kDimTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) state.acc[n][j] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        state.run_max[h] = state.value_max[h] = -CUDART_INF_F;
        state.run_sum[h] = 0.0f;
    }

    for (int32_t i = 0; i < my_units; ++i) {
        const int32_t ahead = i + S::kStages - 1;
        if (ahead < my_units) load_unit<kHeadDim>(p, table, kv_head, unit_start(ahead), end, q_position, stage(ahead));
        cp_async_commit();
        cp_async_wait<S::kStages - 1>();
        __syncwarp(); // every lane's copies of unit i have landed
        attend_unit<kHeadDim, kTall>(q_frag, stage(i), qk_scale, state);
        __syncwarp(); // every lane is done with the stage before the next iteration refills it
    }
    cp_async_wait<0>();
    __syncthreads();
    merge_and_store<T, kHeadDim, kTall>(p, qi, kv_head, split, state, reinterpret_cast<float *>(fp8_smem));
}

template <typename T, int kHeadDim, bool kTall> struct Fp8DecodeKernel { // decode_dispatch.cuh
    static constexpr void (*kernel)(AttentionParams) = &decode_fp8_kernel<T, kHeadDim, kTall>;
    static constexpr int threads = Fp8DecodeShape<kHeadDim>::kThreads;
    static constexpr size_t smem_bytes = Fp8DecodeShape<kHeadDim>::kSmemBytes;
};

} // namespace

bool decode_fp8_applies(DType dtype, int32_t head_dim, int32_t group) {
    return mma_tiles_fit(dtype, head_dim) && group >= 1 && group <= 16;
}

int64_t decode_fp8_resident_ctas(DType dtype, int32_t head_dim, int32_t group) {
    int64_t out = 1;
    dispatch_decode_kernel<Fp8DecodeKernel>(dtype, head_dim, group,
                                            [&](auto kernel) { out = decode_kernel_resident_ctas<decltype(kernel)>(); });
    return out;
}

void launch_decode_fp8(const AttentionParams &p, DType dtype, cudaStream_t stream) {
    require(decode_fp8_applies(dtype, p.head_dim, p.group) && (p.seq_n_tokens || p.n_q == 1) && !p.new_k,
            "shape not supported by the fp8 decode attention");
    dispatch_decode_kernel<Fp8DecodeKernel>(dtype, p.head_dim, p.group,
                                            [&](auto kernel) { launch_decode_kernel<decltype(kernel)>(p, stream); });
}

} // namespace conduit::kernels::cuda
