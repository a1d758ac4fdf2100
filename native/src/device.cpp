// device.cpp: dispatch of memory operations and kernels to the CPU or CUDA backend.
#include "device.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "error.h"

namespace kc = conduit::kernels;

#ifdef CONDUIT_WITH_CUDA
#define CONDUIT_DISPATCH(call)                                                                       \
    do {                                                                                             \
        if (is_cuda()) {                                                                             \
            activate();                                                                              \
            kc::cuda::call;                                                                          \
        } else {                                                                                     \
            kc::cpu::call;                                                                           \
        }                                                                                            \
    } while (0)
#else
#define CONDUIT_DISPATCH(call) kc::cpu::call
#endif

namespace conduit {

bool backend_compiled(conduit_backend backend) {
    if (backend == CONDUIT_BACKEND_CPU) return true;
#ifdef CONDUIT_WITH_CUDA
    return backend == CONDUIT_BACKEND_CUDA;
#else
    return false;
#endif
}

bool backend_available(conduit_backend backend) {
    if (!backend_compiled(backend)) return false;
#ifdef CONDUIT_WITH_CUDA
    if (backend == CONDUIT_BACKEND_CUDA) return kc::cuda::device_count() > 0;
#endif
    return true;
}

Device::Device(conduit_backend backend, int32_t ordinal, const kc::Tuning &tuning)
    : backend_(backend), ordinal_(ordinal), tuning_(tuning) {
    if (!backend_compiled(backend)) fail(CONDUIT_ERR_UNSUPPORTED, "the CUDA backend was not compiled into this library");
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) {
        const int32_t count = kc::cuda::device_count();
        if (count == 0) fail(CONDUIT_ERR_UNSUPPORTED, "no CUDA device is available (no GPU or no driver)");
        if (ordinal < 0 || ordinal >= count)
            fail(CONDUIT_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist (%d devices)", ordinal, count);
    }
#endif
}

Device::~Device() {
    for (auto &entry : spare_ints_)
        for (int32_t *ptr : entry.second) free(ptr);
}

int32_t *Device::take_ints(size_t &capacity) const {
    size_t rounded = 64;
    while (rounded < capacity) rounded *= 2;
    capacity = rounded;
    auto spare = spare_ints_.find(rounded);
    if (spare != spare_ints_.end() && !spare->second.empty()) {
        int32_t *ptr = spare->second.back();
        spare->second.pop_back();
        return ptr;
    }
    return static_cast<int32_t *>(alloc(rounded * sizeof(int32_t)));
}

void Device::give_ints(int32_t *ptr, size_t capacity) const {
    if (ptr) spare_ints_[capacity].push_back(ptr);
}

void Device::activate() const {
#ifdef CONDUIT_WITH_CUDA
    kc::cuda::set_device(ordinal_);
#endif
}

void *Device::alloc(size_t bytes) const {
    if (bytes == 0) bytes = 1;
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) return kc::cuda::device_alloc(bytes, ordinal_);
#endif
    // 64-byte alignment keeps CPU rows cache-line aligned; size rounded up as aligned_alloc needs.
    void *p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) fail(CONDUIT_ERR_OUT_OF_MEMORY, "host allocation of %zu bytes failed", bytes);
    return p;
}

void Device::free(void *ptr) const {
    if (!ptr) return;
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) return kc::cuda::device_free(ptr, ordinal_);
#endif
    std::free(ptr);
}

void Device::copy(void *dst, const void *src, size_t bytes, void *stream) const {
    if (bytes == 0) return;
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) return kc::cuda::memcpy_d2d(dst, src, bytes, stream);
#endif
    (void)stream;
    std::memmove(dst, src, bytes);
}

void Device::upload(void *dst, const void *src, size_t bytes, void *stream) const {
    if (bytes == 0) return;
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) return kc::cuda::memcpy_h2d(dst, src, bytes, stream);
#endif
    (void)stream;
    std::memcpy(dst, src, bytes);
}

void Device::zero(void *dst, size_t bytes, void *stream) const {
    if (bytes == 0) return;
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) return kc::cuda::memset_zero(dst, bytes, stream);
#endif
    (void)stream;
    std::memset(dst, 0, bytes);
}

void Device::write_dense(const kc::LayerView &dst, kc::Slots slots, int32_t n, const void *k, const void *v,
                         const kc::Rope &rope, const int32_t *rope_pos, void *stream) const {
    CONDUIT_DISPATCH(write_dense(dst, slots, n, k, v, rope, rope_pos, stream));
}

void Device::copy_paged(const kc::LayerView &src, kc::Slots src_slots, const kc::LayerView &dst, kc::Slots dst_slots,
                        int32_t n, const kc::Rope &rope, const int32_t *rope_pos, void *stream) const {
    CONDUIT_DISPATCH(copy_paged(src, src_slots, dst, dst_slots, n, rope, rope_pos, stream));
}

void Device::copy_paged_layers(const kc::LayerView &src, kc::Slots src_slots, int64_t src_table_stride,
                               const kc::LayerView &dst, kc::Slots dst_slots, int64_t dst_table_stride,
                               int32_t n_layers, int32_t n, const kc::Rope &rope, const int32_t *rope_pos,
                               void *stream) const {
    CONDUIT_DISPATCH(copy_paged_layers(src, src_slots, src_table_stride, dst, dst_slots, dst_table_stride, n_layers, n,
                                       rope, rope_pos, stream));
}

void Device::read_dense(const kc::LayerView &src, void *k_out, void *v_out, void *stream) const {
    CONDUIT_DISPATCH(read_dense(src, k_out, v_out, stream));
}

void Device::attention(const kc::LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                       float scale, void *out, float *lse, void *stream) const {
    CONDUIT_DISPATCH(attention(kv, n_q, n_heads, q, q_pos, scale, out, lse, tuning_, stream));
}

void Device::attention_stats(const kc::LayerView &kv, int32_t n_q, int32_t n_heads, const void *q,
                             const int32_t *q_pos, float scale, float threshold, float *mass, float *n_below,
                             float *lse, void *stream) const {
    CONDUIT_DISPATCH(attention_stats(kv, n_q, n_heads, q, q_pos, scale, threshold, mass, n_below, lse, stream));
}

void Device::attention_mass(const kc::LayerView &kv, int32_t n_q, int32_t n_heads, const void *q,
                            const int32_t *q_pos, float scale, const float *lse, float *mass, void *stream) const {
    CONDUIT_DISPATCH(attention_mass(kv, n_q, n_heads, q, q_pos, scale, lse, mass, stream));
}

void Device::write_last(const kc::BatchView &dst, const void *k, const void *v, const kc::Rope &rope,
                        const int32_t *rope_pos, void *stream) const {
    CONDUIT_DISPATCH(write_last(dst, k, v, rope, rope_pos, stream));
}

void Device::batch_attention(const kc::BatchView &kv, int32_t n_heads, const void *q, float scale, void *out,
                             float *lse, void *workspace, size_t workspace_bytes, void *stream) const {
    CONDUIT_DISPATCH(batch_attention(kv, n_heads, q, scale, out, lse, workspace, workspace_bytes, stream));
}

void Device::batch_write_attention(const kc::BatchView &kv, const void *k, const void *v, const kc::Rope &rope,
                                   const int32_t *rope_pos, int32_t n_heads, const void *q, float scale, void *out,
                                   float *lse, void *workspace, size_t workspace_bytes, void *stream) const {
    CONDUIT_DISPATCH(batch_write_attention(kv, k, v, rope, rope_pos, n_heads, q, scale, out, lse, workspace,
                                           workspace_bytes, stream));
}

size_t Device::batch_attention_workspace_bytes(const kc::BatchView &kv, int32_t n_heads) const {
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) {
        activate(); // the split plan reads the device's SM count
        return kc::cuda::batch_attention_workspace_bytes(kv, n_heads);
    }
#endif
    return kc::cpu::batch_attention_workspace_bytes(kv, n_heads);
}

void Device::scatter_ints(int32_t *dst, const int32_t *pairs, int32_t n_pairs, void *stream) const {
    CONDUIT_DISPATCH(scatter_ints(dst, pairs, n_pairs, stream));
}

size_t Device::topk_workspace_bytes(int32_t n) const {
#ifdef CONDUIT_WITH_CUDA
    if (is_cuda()) return kc::cuda::topk_workspace_bytes(n);
#endif
    return kc::cpu::topk_workspace_bytes(n);
}

void Device::topk(const float *scores, int32_t n, int32_t k, void *indices, bool indices_i64, void *workspace,
                  size_t workspace_bytes, void *stream) const {
    CONDUIT_DISPATCH(topk(scores, n, k, indices, indices_i64, workspace, workspace_bytes, stream));
}

MirroredInts::~MirroredInts() {
    if (owner_) release(*owner_);
}

const int32_t *MirroredInts::sync(const Device &device, void *stream) {
    if (!device.is_cuda()) return host_.data();
    if (capacity_ < host_.size() || !device_) {
        release(device);
        size_t capacity = host_.size() * 2;
        device_ = device.take_ints(capacity);
        capacity_ = capacity;
        owner_ = &device;
        synced_ = 0;
    }
    if (synced_ < host_.size())
        device.upload(device_ + synced_, host_.data() + synced_, (host_.size() - synced_) * sizeof(int32_t), stream);
    synced_ = host_.size();
    return device_;
}

void MirroredInts::release(const Device &device) {
    if (device_) device.give_ints(device_, capacity_);
    device_ = nullptr;
    capacity_ = 0;
    synced_ = 0;
}

void *Scratch::get(const Device &device, size_t bytes) {
    if (bytes > bytes_) {
        release(device);
        const size_t want = bytes < 4096 ? 4096 : bytes + bytes / 2;
        ptr_ = device.alloc(want);
        bytes_ = want;
    }
    return ptr_;
}

void Scratch::release(const Device &device) {
    if (ptr_) device.free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
}

} // namespace conduit
