// decode_dispatch.cuh: the host side the two tensor-core decode kernels share (attention_mma_decode.cu
// over dense pools, attention_decode_fp8.cu over fp8 ones): the dispatch from (dtype, head_dim, group)
// to an instantiation, its occupancy, and its launch over the decode grid.
#pragma once

#include <atomic>
#include <type_traits>

#include "attention_mma_tile.cuh" // allow_dynamic_smem, TypeTag, launch_chained

namespace conduit::kernels::cuda {

// A decode kernel instantiation is a type K with static constexpr members kernel (a
// void (*)(AttentionParams)), threads (per CTA) and smem_bytes (its dynamic shared memory).

// Calls f(Kernel<T, head_dim, group > 8>{}) for T bf16 or f16 (dtype) and head_dim 64 or 128.
template <template <typename, int, bool> class Kernel, typename F>
void dispatch_decode_kernel(DType dtype, int32_t head_dim, int32_t group, F &&f) {
    const auto with_dim = [&](auto type_tag, auto tall) {
        using T = typename decltype(type_tag)::type;
        constexpr bool kTall = decltype(tall)::value;
        if (head_dim == 64) f(Kernel<T, 64, kTall>{});
        else f(Kernel<T, 128, kTall>{});
    };
    const auto with_type = [&](auto tall) {
        if (dtype == DType::BF16) with_dim(TypeTag<__nv_bfloat16>{}, tall);
        else with_dim(TypeTag<__half>{}, tall);
    };
    if (group > 8) with_type(std::true_type{});
    else with_type(std::false_type{});
}

// CTAs of instantiation K resident on the device at once: its occupancy per SM (asked once: one
// instantiation has one occupancy) times the SMs.
template <typename K> int64_t decode_kernel_resident_ctas() {
    static std::atomic<int> cached{0};
    int n = cached.load();
    if (n == 0) {
        allow_dynamic_smem<K::kernel>(K::smem_bytes);
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reinterpret_cast<const void *>(K::kernel),
                                                                 K::threads, K::smem_bytes));
        n = n > 1 ? n : 1;
        cached.store(n);
    }
    return int64_t(n) * sm_count();
}

// Launches K over the decode grid of p: x = query, y = KV head, z = split.
template <typename K> void launch_decode_kernel(const AttentionParams &p, cudaStream_t stream) {
    allow_dynamic_smem<K::kernel>(K::smem_bytes); // above the 48 KiB default, once per device
    const dim3 grid{unsigned(p.n_q), unsigned(p.n_kv_heads), unsigned(p.n_splits)};
    launch_chained(K::kernel, grid, dim3(K::threads), K::smem_bytes, stream, p);
}

} // namespace conduit::kernels::cuda
