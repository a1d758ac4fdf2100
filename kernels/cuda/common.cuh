// common.cuh: shared pieces of the CUDA backend: error checking, dtype conversion to and from
// float32, 16-byte vector access and the cp.async primitives (sm_80+).
//
// Every kernel computes in float32 and rounds once on store (round-to-nearest-even, as torch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../kernels.h"

namespace conduit::kernels::cuda {

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

// Throws DeviceOutOfMemory for an allocation failure (after clearing it, so that later checks do
// not see it again) and CudaError for anything else, naming the failing call, file and line.
inline void check_cuda(cudaError_t err, const char *call, const char *file, int line) {
    if (err == cudaSuccess) return;
    std::string message = std::string(call) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                          ") at " + file + ":" + std::to_string(line);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        throw DeviceOutOfMemory(message);
    }
    throw CudaError(message);
}

#define CUDA_CHECK(call) ::conduit::kernels::cuda::check_cuda((call), #call, __FILE__, __LINE__)
// After a kernel launch: reports a bad launch configuration (or an earlier asynchronous error).
#define CUDA_CHECK_LAUNCH(kernel_name) ::conduit::kernels::cuda::check_cuda(cudaGetLastError(), kernel_name, __FILE__, __LINE__)

// A property of the current device, computed by compute() (a positive int) once per device and kept
// in cache (devices past 64: computed on every call): launch shapes, occupancy and settings differ
// between devices of different architectures in one process.
template <typename Compute> int once_per_device(std::atomic<int> (&cache)[64], Compute &&compute) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    if (device < 0 || device >= 64) return compute();
    int value = cache[device].load();
    if (value == 0) {
        value = compute();
        cache[device].store(value);
    }
    return value;
}

// Arguments that break the kernels' preconditions (the runtime checks them first; this is a guard).
inline void require(bool ok, const char *what) {
    if (!ok) throw std::invalid_argument(std::string("conduit cuda kernels: ") + what);
}

inline cudaStream_t as_stream(void *stream) { return static_cast<cudaStream_t>(stream); }

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Calls f(T{}) with T the storage type of `dtype` (float, __half or __nv_bfloat16).
template <typename T> struct TypeTag { using type = T; };
template <typename F> void dispatch_dtype(DType dtype, F &&f) {
    switch (dtype) {
    case DType::F32: f(TypeTag<float>{}); break;
    case DType::F16: f(TypeTag<__half>{}); break;
    case DType::BF16: f(TypeTag<__nv_bfloat16>{}); break;
    default: require(false, "unknown dtype");
    }
}

// Streaming multiprocessors of the current device (runtime.cu).
int32_t sm_count();

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (PDL, sm_90+)
// ---------------------------------------------------------------------------------------------
// A decode step runs ~11 kernels a layer, most of them a few microseconds long; launched back to
// back, a kernel's CTAs are scheduled only once the kernel before it has finished. A kernel
// launched by launch_chained may be scheduled while the one before it drains, so its launch and
// prologue overlap that kernel's tail. It must call wait_for_prior_grids() before it reads anything
// an earlier kernel wrote and before it writes anything: past it, every earlier kernel on the stream
// has completed and its writes are visible. allow_dependent_launch() then lets the next chained
// kernel (or Triton kernel, models/fused_triton.py) be scheduled; that one's own wait still waits
// for this kernel to complete, so the order of the whole chain holds. Both are no-ops before sm_90
// and in the emulator; a kernel not launched chained passes the wait at once.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launch_chained launches with PDL on the current device: compute capability >= 9.0
// (runtime.cu; asked once per device).
bool chained_launch_enabled();

// kernel<<<grid, block, smem, stream>>>(args...), with PDL where chained_launch_enabled(). The
// kernel must begin with wait_for_prior_grids() (see above).
template <typename... Params, typename... Args>
void launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                    Args... args) {
#ifdef CONDUIT_CUDA_EMULATION
    ::emu::launch(grid, block, smem, stream, [&]() { kernel(args...); });
#else
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = chained_launch_enabled() ? 1 : 0;
    CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
#endif
}

// A grow-only device scratch buffer of at least `bytes` for (current device, stream), or null when
// the device is out of memory (runtime.cu). Valid until the next call for the same stream; work
// enqueued on that stream may use it without further synchronisation.
void *stream_workspace(size_t bytes, cudaStream_t stream);

// At least `count` arrival counters for (current device, stream), all zero before the first kernel
// that uses them, or null when the device is out of memory (runtime.cu). Grow-only and zero-filled
// (on the stream) when made: kernels that take counters must leave them zero. Valid until the next
// call for the same stream.
uint32_t *stream_counters(size_t count, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Scalar conversions
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// ---------------------------------------------------------------------------------------------
// 16-byte chunks: kChunk<T> elements of T in one uint4
// ---------------------------------------------------------------------------------------------

template <typename T> constexpr int kChunk = 16 / int(sizeof(T));

__device__ __forceinline__ uint4 load16(const void *p) { return *static_cast<const uint4 *>(p); }
__device__ __forceinline__ void store16(void *p, uint4 v) { *static_cast<uint4 *>(p) = v; }

template <typename T> __device__ __forceinline__ void chunk_to_float(const uint4 &raw, float *out);

template <> __device__ __forceinline__ void chunk_to_float<float>(const uint4 &raw, float *out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}

template <> __device__ __forceinline__ void chunk_to_float<__half>(const uint4 &raw, float *out) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

template <> __device__ __forceinline__ void chunk_to_float<__nv_bfloat16>(const uint4 &raw, float *out) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Loads kChunk<T> elements at p as float32: one 16-byte load when `vector` (p 16-byte aligned),
// else element by element.
template <typename T> __device__ __forceinline__ void load_chunk(const T *p, bool vector, float *out) {
    if (vector) {
        chunk_to_float<T>(load16(p), out);
    } else {
#pragma unroll
        for (int i = 0; i < kChunk<T>; ++i) out[i] = to_float(p[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// A CTA barrier that threads reach from different places in the code
// ---------------------------------------------------------------------------------------------
// __syncthreads compiles to `bar.sync`, the .aligned barrier: it promises that every thread of the
// CTA runs this one instruction, and threads arriving from two branches (warp-uniform, not
// CTA-uniform: the warp-specialized loop's producer and consumers) break that promise (undefined;
// compute-sanitizer synccheck reports "Divergent thread(s) in block"). The unaligned form counts
// the CTA's arrivals wherever they come from.
#ifndef CONDUIT_CUDA_EMULATION
__device__ __forceinline__ void cta_barrier_any_site() { asm volatile("barrier.sync 0;\n" ::: "memory"); }
#else
inline void cta_barrier_any_site() { __syncthreads(); } // the emulator's barrier counts threads, not sites
#endif

// ---------------------------------------------------------------------------------------------
// cp.async (sm_80+): global -> shared copies that bypass registers
// ---------------------------------------------------------------------------------------------
#ifndef CONDUIT_CUDA_EMULATION // emu/emu.h supplies host versions to run these kernels on a CPU

// Copies 16 bytes, or writes 16 zero bytes when !pred (src is then not read but must be a valid
// address expression).
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool pred) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_size) : "memory");
}

__device__ __forceinline__ void cp_async4(void *smem, const void *gmem, bool pred) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int src_size = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_size) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
#endif // CONDUIT_CUDA_EMULATION

} // namespace conduit::kernels::cuda
