// emu.h: a CPU emulator for this folder's CUDA kernels, for checking their indexing on machines
// without a GPU (it says nothing about speed, and nothing about races that only real concurrency
// shows). run_emu.py rewrites the kernel launches and dynamic shared memory of the .cu files, then
// compiles them with g++ against this header.
//
// Model: the blocks of a grid run one after another (in grid order, or shuffled: g_block_order_seed);
// the threads of a block are fibers on one OS
// thread (emu.cpp). __syncthreads and warp operations (__shfl_sync, __shfl_xor_sync, __any_sync, __all_sync,
// __ballot_sync) are barriers, so a thread that skips one makes the emulator report a deadlock instead of hanging. `__shared__` becomes `static`
// (one copy shared by the threads of the running block), dynamic shared memory is filled with
// 0xff bytes (NaN as float) to expose reads of unwritten data and lies between inaccessible pages
// (an access before it faults), and cp.async copies are deferred
// until the issuing thread waits for their group.
#pragma once

#define __host__
#define __device__
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define CONDUIT_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

// Device intrinsics the kernels use.
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
// prmt's default mode: byte i of the result is byte (selector nibble i) of the 8 bytes y:x.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned selector) {
    const uint64_t bytes = (uint64_t(y) << 32) | x;
    unsigned out = 0;
    for (int i = 0; i < 4; ++i) out |= unsigned((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return out;
}
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
using std::max;
using std::min;

#include <math_constants.h>

namespace emu {

struct Block;

// What a CUDA thread sees: its indices and its block.
struct ThreadContext {
    dim3 thread_idx, block_idx, block_dim, grid_dim;
    Block *block = nullptr;
    int linear = 0; // thread index within the block
};
ThreadContext &ctx();

void *dynamic_smem();
void sync_block();
// Exchanges 8 bytes with the other lanes of the warp; returns the value lane `src_lane` gave.
uint64_t warp_exchange(uint64_t mine, int src_lane);
bool warp_any(bool mine);
// __ballot_sync: bit l set when lane l passed true (absent lanes of a partial warp give 0).
uint32_t warp_ballot(bool mine);
// Copies `bytes` (at most kWarpGatherBytes) from every lane of the warp into all[lane * bytes].
constexpr int kWarpGatherBytes = 64;
void warp_gather(const void *mine, int bytes, void *all);
// __syncthreads_or: a block barrier that returns whether any thread passed true.
bool block_any(bool mine);
// Scalar models of the warp-wide tensor-core instructions (fragment layouts of the PTX ISA).
void ldmatrix_x4(uint32_t *r, const void *smem, bool trans);
void mma_m16n8k16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1, bool bf16);
// The offset of p in the block's dynamic shared memory: what the kernels' shared-window addresses
// (__cvta_generic_to_shared) stand for here; the wgmma descriptors hold such offsets.
size_t shared_offset(const void *p);
// wgmma.mma_async.m64nNk16 with A in registers, run synchronously by the warpgroup (128 threads, a
// collective like the warp ones): d (this thread's n / 2 floats) = [d +] A (64 x 16: each warp's 16
// rows as mma.m16n8k16's A fragments) * B (16 x n, read through `desc`: 128-byte swizzle, K-major
// or, with trans_b, MN-major, as the PTX ISA's canonical layouts).
void wgmma_rs(float *d, int n, const uint32_t *a, uint64_t desc, bool accumulate, bool trans_b, bool bf16);
void sync_warp(); // __syncwarp: the warp's lanes meet
// Shared-memory barriers (mbarrier). A phase completes at its count-th arrival. cp.async copies that a
// thread ties to one (cp_async_mbarrier_arrive) land only when that phase completes, so a reader that
// skips the wait sees the stage's old bytes. A waiter sleeps until the phase of its parity is over.
void mbarrier_init(uint64_t *bar, uint32_t count);
void mbarrier_arrive(uint64_t *bar);
void cp_async_mbarrier_arrive(uint64_t *bar);
void mbarrier_wait(uint64_t *bar, uint32_t parity);

extern int g_smem_limit; // dynamic shared memory above 48 KiB that cudaFuncSetAttribute allowed
// cudaMalloc of more bytes than this fails with cudaErrorMemoryAllocation: lets the tests take the
// fallbacks of a workspace that cannot be allocated. No limit by default.
extern size_t g_malloc_limit;
// SMs that cudaDeviceGetAttribute reports (4 by default: with 4 CTAs per SM, small problems split).
extern int g_sm_count;
// 0: the blocks of a grid run in grid order (x fastest). Otherwise in an order shuffled from this
// seed, a new one every launch: CTAs that communicate (arrival counters) must not rely on an order.
extern uint32_t g_block_order_seed;

// Runs `body` once per thread of every block.
void launch_blocks(dim3 grid, dim3 block, size_t smem, void (*run)(void *), void *body);
template <typename F> void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, F &&body) {
    auto call = [](void *f) { (*static_cast<F *>(f))(); };
    launch_blocks(grid, block, smem, call, &body);
}

// Deferred cp.async: copies queued per thread, grouped by commit.
struct PendingCopy {
    void *dst;
    const void *src;
    int bytes;
    bool pred;
};
void cp_async(void *dst, const void *src, int bytes, bool pred);
void cp_commit();
void cp_wait(int pending);

} // namespace emu

#define threadIdx (::emu::ctx().thread_idx)
#define blockIdx (::emu::ctx().block_idx)
#define blockDim (::emu::ctx().block_dim)
#define gridDim (::emu::ctx().grid_dim)

inline void __syncthreads() { emu::sync_block(); }

template <typename T> T __shfl_xor_sync(unsigned, T value, int lane_mask, int = 32) {
    static_assert(sizeof(T) <= 8, "8-byte values at most");
    uint64_t raw = 0;
    std::memcpy(&raw, &value, sizeof(T));
    const int lane = emu::ctx().linear % 32;
    raw = emu::warp_exchange(raw, lane ^ lane_mask);
    T out;
    std::memcpy(&out, &raw, sizeof(T));
    return out;
}

template <typename T> T __shfl_sync(unsigned, T value, int src_lane, int = 32) {
    static_assert(sizeof(T) <= 8, "8-byte values at most");
    uint64_t raw = 0;
    std::memcpy(&raw, &value, sizeof(T));
    raw = emu::warp_exchange(raw, src_lane & 31);
    T out;
    std::memcpy(&out, &raw, sizeof(T));
    return out;
}

inline int __syncthreads_or(int pred) { return emu::block_any(pred != 0) ? 1 : 0; }
inline int __syncthreads_and(int pred) { return emu::block_any(pred == 0) ? 0 : 1; } // all true = none false

inline void __syncwarp(unsigned = 0xffffffffu) { emu::sync_warp(); }
inline void __trap() { // a kernel's assertion failed: stop here, as the device would
    std::fprintf(stderr, "emu: __trap\n");
    std::abort();
}
inline int __any_sync(unsigned, int pred) { return emu::warp_any(pred != 0) ? 1 : 0; }
inline int __all_sync(unsigned, int pred) { return emu::warp_any(pred == 0) ? 0 : 1; } // all true = none false

inline unsigned __ballot_sync(unsigned, int pred) { return emu::warp_ballot(pred != 0); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }

inline unsigned long long atomicAdd(unsigned long long *address, unsigned long long value) {
    return std::atomic_ref<unsigned long long>(*address).fetch_add(value);
}

inline unsigned atomicAdd(unsigned *address, unsigned value) {
    return std::atomic_ref<unsigned>(*address).fetch_add(value);
}

// Blocks run one after another, so every earlier write is already visible.
inline void __threadfence() {}
inline size_t __cvta_generic_to_shared(const void *p) { return emu::shared_offset(p); }
template <typename T> T __ldcg(const T *address) { return *address; }

namespace conduit::kernels::cuda {
inline void cp_async16(void *smem, const void *gmem, bool pred) { emu::cp_async(smem, gmem, 16, pred); }
inline void cp_async4(void *smem, const void *gmem, bool pred) { emu::cp_async(smem, gmem, 4, pred); }
inline void cp_async_commit() { emu::cp_commit(); }
template <int kPending> void cp_async_wait() { emu::cp_wait(kPending); }
inline void ldmatrix_x4(uint32_t (&r)[4], const void *smem) { emu::ldmatrix_x4(r, smem, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void *smem) { emu::ldmatrix_x4(r, smem, true); }
template <typename T> void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or f16");
    emu::mma_m16n8k16(d, a, b0, b1, std::is_same_v<T, __nv_bfloat16>);
}
} // namespace conduit::kernels::cuda
