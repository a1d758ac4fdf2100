// attention_mma.cuh: the tensor-core attention path for many queries: the warp primitives it uses
// (ldmatrix, mma.sync m16n8k16, bf16/f16 packing; on sm_90a the two products are wgmma instead:
// wgmma.cuh), its tile geometry and the host entry point attention.cu dispatches to. Kernel:
// attention_mma.cu.
//
// The emulator (emu/emu.h) supplies scalar models of ldmatrix_x4, ldmatrix_x4_trans and
// mma_m16n8k16 with the same fragment layouts, so the kernel can be checked on a CPU; and of wgmma
// (emu::wgmma_rs) for the sm_90a path, built with -D CONDUIT_EMU_WGMMA=1.
#pragma once

#include <cstdlib>

#include "attention_shape.cuh"

namespace conduit::kernels::cuda {

// Slots of a key tile of the tensor-core attention (MmaShape::kKeys): its key splits are whole tiles.
constexpr int32_t kMmaTileKeys = 64;

// Shared-memory stages of the tensor-core key-tile loop (attention_mma_tile.cuh): two tiles in flight
// behind the one computed (one with wgmma, where the previous tile's stage is still read); fewer
// leave the copies too little compute to land behind, more cost occupancy.
constexpr int kMmaStages = 3;

// Tile geometry for head dimension kHeadDim (64 or 128). A CTA takes kRows (query, head) rows of one
// KV head, kWarps warps of 16 rows each, and streams key tiles of kKeys slots through kStages
// shared-memory stages (K tile, V tile; 16-byte chunks, XOR-swizzled) plus their positions. More
// warps share each key tile among more rows (fewer loads per FLOP) at the cost of occupancy. Three
// stages at head_dim 128 take 97 KiB: two CTAs of 4 warps per SM on sm_90 (228 KiB; registers allow
// no more), one on sm_80/sm_87 (164 KiB).
template <int kHeadDim, int kWarpCount = 4> struct MmaShape {
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static_assert(kWarpCount == 4 || kWarpCount == 8, "4 or 8 warps");
    static constexpr int kWarps = kWarpCount;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kRows = 16 * kWarps;
    static constexpr int kKeys = kMmaTileKeys;
    static constexpr int kStages = kMmaStages;
    static constexpr int kRowChunks = kHeadDim / 8;            // 16-byte chunks per K or V row
    static constexpr int kTileChunks = kKeys * kRowChunks;     // one K (or V) tile
    static constexpr int kStageChunks = 2 * kTileChunks;       // K then V
    static constexpr int kDimSteps = kHeadDim / 16;            // k-steps of Q K^T
    static constexpr int kKeyTiles = kKeys / 8;                // n-tiles of S = Q K^T
    static constexpr int kDimTiles = kHeadDim / 8;             // n-tiles of O = P V
    static constexpr size_t kSmemBytes = size_t(kStages) * kStageChunks * 16 + size_t(kStages) * kKeys * 4;
    static constexpr size_t kKeySmemBytes = size_t(kStages) * kTileChunks * 16 + size_t(kStages) * kKeys * 4; // K only
};

// Shared-memory chunk index of (row, 16-byte chunk) in a K or V tile: the chunk is XORed with the
// row's low 3 bits so that the 8 rows one ldmatrix phase reads fall in 8 different bank groups.
template <int kRowChunks> __device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * kRowChunks + (chunk ^ (row & 7));
}

// The swizzled chunk indices a lane's ldmatrix reads over a tile: row 16 m + row_lane, chunk 2 c + bit,
// for every m and c of an unrolled loop, from four lane constants and immediates. The row's low
// three bits (the swizzle's XOR) are row_lane's for every m, so chunk ^ (row & 7) splits into
// 2 ((c % 4) ^ q) + 8 (c / 4) + ((bit ^ row_lane) & 1) with q = bits 1-2 of row_lane: the four
// values of the first term are the constants (computed once, before the tile loop, in place of an
// XOR and multiply-adds at every ldmatrix).
template <int kRowChunks> struct LaneChunks {
    int32_t base[4];

    __device__ __forceinline__ LaneChunks(int32_t row_lane, int32_t bit) {
        const int32_t q = (row_lane >> 1) & 3, low = (bit ^ row_lane) & 1;
#pragma unroll
        for (int j = 0; j < 4; ++j) base[j] = row_lane * kRowChunks + 2 * (j ^ q) + low;
    }
    // The lane's four base pointers into a tile (once per tile); then at(ptrs, m, c) ==
    // tile + swizzled<kRowChunks>(16 * m + row_lane, 2 * c + bit), a base plus a constant.
    __device__ __forceinline__ void pointers(const uint4 *tile, const uint4 *(&ptrs)[4]) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) ptrs[j] = tile + base[j];
    }
    static __device__ __forceinline__ const uint4 *at(const uint4 *const (&ptrs)[4], int m, int c) {
        return ptrs[c & 3] + (m * 16 * kRowChunks + 8 * (c >> 2));
    }
};

// Two values rounded to T and packed as one 32-bit register, `lo` in the low half (the lower
// column of an mma fragment pair).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const T a = from_float<T>(lo), b = from_float<T>(hi);
    uint16_t a_bits, b_bits;
    memcpy(&a_bits, &a, 2);
    memcpy(&b_bits, &b, 2);
    return uint32_t(a_bits) | (uint32_t(b_bits) << 16);
}

#ifndef CONDUIT_CUDA_EMULATION
// Four 8x8 b16 matrices: lane l gives the address of row l % 8 of matrix l / 8; register j of lane
// l receives row l / 4, columns 2 (l % 4), +1 of matrix j (.trans: rows and columns swapped).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *smem) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *smem) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a (16x16, row-major fragments) * b (16x8, column-major fragments), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 2^x on the special-function unit (ex2.approx, about 2 ulp; -inf gives +0): the softmax weights are
// rounded to 16 bits for the P V product anyway, and exp2f's exact path costs several instructions
// per score in a kernel whose non-tensor-core work is the softmax.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#else
inline float fast_exp2(float x) { return exp2f(x); }
#endif // CONDUIT_CUDA_EMULATION

// Warps per CTA of the tensor-core attention for p: `forced` (Tuning::mma_warps) when it is 4 or 8,
// else chosen by CTA count (attention_mma.cu).
int mma_warps_for(const AttentionParams &p, int32_t forced);

// Whether the tensor-core kernels (mma.sync m16n8k16 on 16-bit operands, tiles for head_dim 64 and
// 128) can take a layer of this dtype and head_dim.
inline bool mma_tiles_fit(DType dtype, int32_t head_dim) {
    return (dtype == DType::BF16 || dtype == DType::F16) && (head_dim == 64 || head_dim == 128);
}

// Whether attention.cu should take the tensor-core path for these shapes.
inline bool mma_attention_applies(DType dtype, int32_t head_dim, int32_t n_q, int32_t group) {
    return mma_tiles_fit(dtype, head_dim) && (n_q >= 16 || int64_t(n_q) * group >= 64);
}

// CTAs of the tensor-core attention for p with `warps` warps before any key split: tiles of 16 * warps
// (query, head) rows times KV heads.
int64_t mma_attention_base_ctas(const AttentionParams &p, int warps);

// CTAs of its (dtype, head_dim, warps) instantiation resident on the device at once (occupancy x SMs).
int64_t mma_attention_resident_ctas(DType dtype, int32_t head_dim, int warps);

// Launches the tensor-core attention for p (from attention_params, with out and lse set) with `warps`
// warps (mma_warps_for). With p.n_splits > 1, split z takes the slots [z * p.split_tokens, +split_tokens)
// (whole kMmaTileKeys tiles) and writes its partials (p.partial_out, p.partial_lse) for the caller to
// merge; with one split it writes out and lse itself.
void launch_mma_attention(const AttentionParams &p, DType dtype, int warps, cudaStream_t stream);

// Tensor-core split-KV decode (attention_mma_decode.cu): one query per sequence over every key it
// sees, the query heads of a GQA group as the rows of one mma tile. Same split plan, partials and
// merge as the CUDA-core decode kernel; splits are rounded to kDecodeMmaTileKeys slots.
constexpr int32_t kDecodeMmaTileKeys = 64;

// Whether the tensor-core decode kernel handles (dtype, head_dim, group): bf16/f16, head_dim 64 or
// 128, groups 2..16 (multi-head attention stays on the CUDA-core kernel: attention_mma_decode.cu).
bool decode_mma_applies(DType dtype, int32_t head_dim, int32_t group);

// CTAs of the decode kernel for this shape resident on the device at once (occupancy x SMs).
int64_t decode_mma_resident_ctas(DType dtype, int32_t head_dim, int32_t group);

// Launches it for p (attention_params with p.n_splits and, for several splits, the partials set;
// either n_q == 1 or a batch step with p.seq_n_tokens). The caller merges the splits.
void launch_decode_mma(const AttentionParams &p, DType dtype, cudaStream_t stream);
// Decode over an fp8 pool (attention_decode_fp8.cu; kernels.h's fp8 layout, p.block_bytes set): the
// same grid, split plan (kDecodeMmaTileKeys) and partials as launch_decode_mma, dtype the queries' and
// outputs'. Takes bf16/f16 queries with head_dim 64 or 128 and groups 1..16; p.new_k must be null (the
// step's rows are written by write_last first).
bool decode_fp8_applies(DType dtype, int32_t head_dim, int32_t group);
int64_t decode_fp8_resident_ctas(DType dtype, int32_t head_dim, int32_t group);
void launch_decode_fp8(const AttentionParams &p, DType dtype, cudaStream_t stream);

} // namespace conduit::kernels::cuda
