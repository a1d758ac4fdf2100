// wgmma.cuh: Hopper warpgroup MMA (wgmma.mma_async, sm_90a) for the many-query attention: the
// shared-memory layout of its K/V tiles, their matrix descriptors, and the two products of a key
// tile (S = Q K^T and O += P V) with Q and P as register operands.
//
// Why: with mma.sync m16n8k16 the attention issues ~7 instructions per tensor-core instruction (the
// ldmatrix of every K and V fragment by every warp, the address arithmetic, the softmax), and with
// two warps a scheduler it stays latency-bound, the tensor pipe mostly idle. A warpgroup's wgmma
// reads K and V from shared memory itself: one instruction per 64 x N x 16 product, no ldmatrix, and
// the tensor core runs it asynchronously while the warp goes on.
//
// Layout of a K or V tile of kKeys key rows x kHeadDim dims (T = bf16/f16), as the 128-byte swizzle
// of the PTX ISA ("Shared Memory Matrix Layout", 128B swizzling): the dims are cut into blocks of 64
// (128 bytes a key row); block b holds kKeys rows of 128 bytes, and 16-byte chunk c of key row r lies
// at chunk position c ^ (r % 8) of its row. Every block starts on a 1024-byte boundary (the swizzle's
// period: 8 rows), so the descriptors' base offset is 0.
//   - K as operand B of S = Q K^T (N = keys, K = dims; dims contiguous: "K-major"): 8-row groups are
//     1024 bytes apart (the stride byte offset); the k-step of dims 16 kk.. starts at block kk / 4,
//     32 bytes into its rows for each kk % 4 (the swizzle is applied to the computed addresses, so
//     a start inside the period is allowed).
//   - V as operand B of O += P V (K = keys, N = dims; dims contiguous: "MN-major", transposed): the
//     16 keys of a k-step are two 8-row groups 1024 bytes apart (stride byte offset), and the next
//     64 dims are the next block (leading byte offset kKeys * 128).
// Register fragments (per warp of the warpgroup: rows 16 w .. 16 w + 15 of the 64) are those of
// mma.sync m16n8k16: A (Q or P) a[0] = row g, cols 2t, 2t + 1; a[1] = row g + 8; a[2], a[3] the same
// rows at cols 8 + 2t; the accumulator holds, for each 8 columns j, d[4j], d[4j + 1] = row g, cols
// 8j + 2t, +1 and d[4j + 2], d[4j + 3] = row g + 8. So the softmax of attention_mma.cu reads S and
// writes P exactly as it does for mma.sync.
#pragma once

#include <cstdint>

// The wgmma path exists in device code built for sm_90a (CMAKE_CUDA_ARCHITECTURES 90a). The CPU
// emulator (emu/) runs it with CONDUIT_EMU_WGMMA=1 (`run_emu.py -D CONDUIT_EMU_WGMMA=1`), on its
// scalar model of the instruction, synchronously: it checks the layouts and the indexing, not the
// async ordering.
#if defined(CONDUIT_CUDA_EMULATION) && defined(CONDUIT_EMU_WGMMA) && CONDUIT_EMU_WGMMA
#define CONDUIT_WGMMA 1
#elif defined(CONDUIT_CUDA_EMULATION)
#define CONDUIT_WGMMA 0
#elif defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CONDUIT_WGMMA 1
#else
#define CONDUIT_WGMMA 0
#endif

namespace conduit::kernels::cuda {

// Alignment of a wgmma tile (the 128-byte swizzle's period).
constexpr int kWgmmaTileAlign = 1024;

// The 16-byte chunk index of (row, chunk) in a tile of kKeys rows and kRowChunks chunks a row, laid
// out for wgmma (see above).
template <int kKeys, int kRowChunks> __device__ __forceinline__ int wgmma_tile_chunk(int row, int chunk) {
    static_assert(kRowChunks % 8 == 0, "rows of whole 128-byte blocks");
    return (chunk >> 3) * (kKeys * 8) + row * 8 + ((chunk & 7) ^ (row & 7));
}

#if CONDUIT_WGMMA
// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and stride
// byte offsets (each encoded as bits 4..17 of the byte value).
__device__ __forceinline__ uint64_t wgmma_descriptor(const void *smem, uint32_t leading_bytes, uint32_t stride_bytes) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((leading_bytes & 0x3FFFF) >> 4) << 16) |
           (uint64_t((stride_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}

#ifndef CONDUIT_CUDA_EMULATION
// Orders this thread's earlier register writes (accumulators, A fragments) before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending of this warpgroup's committed groups are still running (groups end in order).
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// After a wait: tells the compiler that the accumulators change here, so that no read of them is
// scheduled before the wait (the wait's asm names no registers; ptxas alone orders them otherwise).
template <int kN> __device__ __forceinline__ void wgmma_fence_operands(float (&d)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, stores) visible to the async
// proxy that wgmma reads through; then a barrier publishes them to the warpgroup.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Moves this warpgroup's register budget to kRegisters a thread (a multiple of 8 in 24..256), for the
// code that follows: a producer warpgroup that only copies gives registers back (dec), and the
// warpgroups of the products take them (inc; it waits until the CTA's pool has them). All threads of
// the warpgroup execute it.
template <int kRegisters> __device__ __forceinline__ void registers_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters> __device__ __forceinline__ void registers_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Shared-memory barriers (mbarrier) of the specialized key-tile loop (attention_mma_tile.cuh): a phase
// completes when `count` arrivals have come; waiters ask for the phase of a given parity.
__device__ __forceinline__ uint32_t smem_address(const void *p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// Arrives on bar once every cp.async this thread issued so far has landed (no wait here; the
// barrier's count includes this arrival: .noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// Waits until the phase of parity `parity` of bar has completed (acquire: its arrivals' writes are visible).
__device__ __forceinline__ void mbarrier_wait(uint64_t *bar, uint32_t parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n" // (a label in braces is local to them)
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(smem_address(bar)),
                 "r"(parity)
                 : "memory");
}

#define CONDUIT_WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                            "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CONDUIT_WGMMA_D32(i) CONDUIT_WGMMA_D8(i), CONDUIT_WGMMA_D8(i + 8), CONDUIT_WGMMA_D8(i + 16), CONDUIT_WGMMA_D8(i + 24)

// d (64 x N, this thread's N / 2 floats) = [d +] a (64 x 16, registers) * B (16 x N, descriptor);
// kTransB: B is MN-major (N contiguous). kAccumulate false ignores d's input.
template <typename T, int kN, bool kTransB, bool kAccumulate> struct WgmmaRS;

// One specialization per (type, N): the asm's operand numbers follow the N / 2 accumulators.
#define CONDUIT_WGMMA_RS(TYPE, PTX_TYPE, N, SETP, D_REGS, TAIL, ...)                                              \
    template <bool kTransB, bool kAccumulate> struct WgmmaRS<TYPE, N, kTransB, kAccumulate> {                    \
        static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {      \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SETP ", 0;\n"                                        \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " {" D_REGS "}, " \
                         TAIL ";\n}\n"                                                                            \
                         : __VA_ARGS__                                                                            \
                         : "n"(int(kAccumulate)), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b),              \
                           "n"(int(kTransB)));                                                                    \
        }                                                                                                         \
    };
#define CONDUIT_WGMMA_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CONDUIT_WGMMA_REGS64 CONDUIT_WGMMA_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
                             "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CONDUIT_WGMMA_TAIL32 "{%33, %34, %35, %36}, %37, p, 1, 1, %38"
#define CONDUIT_WGMMA_TAIL64 "{%65, %66, %67, %68}, %69, p, 1, 1, %70"
CONDUIT_WGMMA_RS(__nv_bfloat16, "bf16", 64, "%32", CONDUIT_WGMMA_REGS32, CONDUIT_WGMMA_TAIL32, CONDUIT_WGMMA_D32(0))
CONDUIT_WGMMA_RS(__half, "f16", 64, "%32", CONDUIT_WGMMA_REGS32, CONDUIT_WGMMA_TAIL32, CONDUIT_WGMMA_D32(0))
CONDUIT_WGMMA_RS(__nv_bfloat16, "bf16", 128, "%64", CONDUIT_WGMMA_REGS64, CONDUIT_WGMMA_TAIL64, CONDUIT_WGMMA_D32(0),
                 CONDUIT_WGMMA_D32(32))
CONDUIT_WGMMA_RS(__half, "f16", 128, "%64", CONDUIT_WGMMA_REGS64, CONDUIT_WGMMA_TAIL64, CONDUIT_WGMMA_D32(0),
                 CONDUIT_WGMMA_D32(32))
#undef CONDUIT_WGMMA_TAIL64
#undef CONDUIT_WGMMA_TAIL32
#undef CONDUIT_WGMMA_REGS64
#undef CONDUIT_WGMMA_REGS32
#undef CONDUIT_WGMMA_RS
#undef CONDUIT_WGMMA_D32
#undef CONDUIT_WGMMA_D8
#else  // the emulator: one synchronous model (emu::wgmma_rs), nothing to order
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int kPending> void wgmma_wait() {}
inline void fence_async_shared() {}
template <int kRegisters> void registers_decrease() {}
template <int kRegisters> void registers_increase() {}
inline void mbarrier_init(uint64_t *bar, uint32_t count) { emu::mbarrier_init(bar, count); }
inline void mbarrier_arrive(uint64_t *bar) { emu::mbarrier_arrive(bar); }
inline void cp_async_mbarrier_arrive(uint64_t *bar) { emu::cp_async_mbarrier_arrive(bar); }
inline void mbarrier_wait(uint64_t *bar, uint32_t parity) { emu::mbarrier_wait(bar, parity); }
template <int kN> void wgmma_fence_operands(float (&)[kN]) {}
template <typename T, int kN, bool kTransB, bool kAccumulate> struct WgmmaRS {
    static void run(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b) {
        emu::wgmma_rs(d, kN, a, b, kAccumulate, kTransB, std::is_same_v<T, __nv_bfloat16>);
    }
};
#endif // CONDUIT_CUDA_EMULATION

// S (this thread's 32 floats of the 64 x 64 tile, as s[n][j]: keys 8n + 2t + j % 2, row g + 8 (j / 2))
// = Q K^T over kHeadDim dims: q_frag[kk] are Q's A fragments of dims 16 kk.., k_tile the K tile in
// the wgmma layout (1024-byte aligned). Issues and commits one group; s is ready after the caller's
// wgmma_wait for it (then wgmma_fence_operands(s)), and k_tile is in use until then.
template <typename T, int kHeadDim, int kKeys>
__device__ __forceinline__ void wgmma_issue_scores(const uint32_t (&q_frag)[kHeadDim / 16][4], const uint4 *k_tile,
                                                   float (&s)[kKeys / 8][4]) {
    static_assert(kKeys == 64, "S tiles of 64 keys");
    float(&d)[kKeys / 2] = reinterpret_cast<float(&)[kKeys / 2]>(s);
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) d[i] = 0.0f; // (the first product ignores them: not read indeterminate)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const uint64_t b = wgmma_descriptor(k_tile + (kk / 4) * (kKeys * 8) + (kk % 4) * 2, 16, 1024);
        if (kk == 0) WgmmaRS<T, kKeys, false, false>::run(d, q_frag[kk], b);
        else WgmmaRS<T, kKeys, false, true>::run(d, q_frag[kk], b);
    }
    wgmma_commit();
}

// O (this thread's kHeadDim / 2 floats, acc[n][j] as S's) += P V over kKeys keys: p_frag[k] are P's
// A fragments of keys 16 k.., v_tile the V tile in the wgmma layout. Issues and commits one group;
// acc, p_frag and v_tile are in use until the caller's wgmma_wait for it (then
// wgmma_fence_operands(acc)). Write nothing into p_frag's registers before that wait, not even
// through new variables: ptxas may give a value computed before the wait the registers of p_frag,
// and the product then reads it (wrong outputs that the synchronous emulator cannot show);
// tools/check_wgmma_sass.py checks the SASS.
template <typename T, int kHeadDim, int kKeys>
__device__ __forceinline__ void wgmma_accumulate_pv(const uint32_t (&p_frag)[kKeys / 16][4], const uint4 *v_tile,
                                                    float (&acc)[kHeadDim / 8][4]) {
    float(&d)[kHeadDim / 2] = reinterpret_cast<float(&)[kHeadDim / 2]>(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k) {
        const uint64_t b = wgmma_descriptor(v_tile + k * 16 * 8, kKeys * 128, 1024);
        WgmmaRS<T, kHeadDim, true, true>::run(d, p_frag[k], b);
    }
    wgmma_commit();
}
#endif // CONDUIT_WGMMA

} // namespace conduit::kernels::cuda
