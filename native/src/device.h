// device.h: the backend an arena runs on. Allocation, copies and kernel dispatch go through here so
// that the rest of the runtime never branches on CPU vs CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "conduit.h"
#include "kernels.h"

namespace conduit {

class Device {
  public:
    // `tuning` (conduit_tuning, checked by the caller) goes to the kernels whose launch it shapes.
    Device(conduit_backend backend, int32_t ordinal, const kernels::Tuning &tuning);
    ~Device(); // frees the recycled int arrays
    Device(const Device &) = delete;
    Device &operator=(const Device &) = delete;

    conduit_backend backend() const { return backend_; }
    bool is_cuda() const { return backend_ == CONDUIT_BACKEND_CUDA; }

    void *alloc(size_t bytes) const; // throws Error(OUT_OF_MEMORY)
    void free(void *ptr) const;
    // Device int arrays for block tables and positions, recycled by capacity instead of freed:
    // sequences come and go with every request, and a cudaFree waits for the whole device. A
    // recycled array is reused without waiting: safe because an arena's work is ordered on one
    // stream (conduit.h), so kernels that read the old table run before the new one is uploaded.
    // take_ints rounds `capacity` up to a power of two (at least 64) and returns that many ints.
    int32_t *take_ints(size_t &capacity) const;
    void give_ints(int32_t *ptr, size_t capacity) const;
    void copy(void *dst, const void *src, size_t bytes, void *stream) const;   // device -> device
    void upload(void *dst, const void *src, size_t bytes, void *stream) const; // host -> device
    void zero(void *dst, size_t bytes, void *stream) const;                    // device bytes set to 0

    void write_dense(const kernels::LayerView &dst, kernels::Slots slots, int32_t n, const void *k, const void *v,
                     const kernels::Rope &rope, const int32_t *rope_pos, void *stream) const;
    void copy_paged(const kernels::LayerView &src, kernels::Slots src_slots, const kernels::LayerView &dst,
                    kernels::Slots dst_slots, int32_t n, const kernels::Rope &rope, const int32_t *rope_pos,
                    void *stream) const;
    void copy_paged_layers(const kernels::LayerView &src, kernels::Slots src_slots, int64_t src_table_stride,
                           const kernels::LayerView &dst, kernels::Slots dst_slots, int64_t dst_table_stride,
                           int32_t n_layers, int32_t n, const kernels::Rope &rope, const int32_t *rope_pos,
                           void *stream) const;
    void read_dense(const kernels::LayerView &src, void *k_out, void *v_out, void *stream) const;
    void attention(const kernels::LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                   float scale, void *out, float *lse, void *stream) const;
    void attention_stats(const kernels::LayerView &kv, int32_t n_q, int32_t n_heads, const void *q,
                         const int32_t *q_pos, float scale, float threshold, float *mass, float *n_below, float *lse,
                         void *stream) const;
    void attention_mass(const kernels::LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                        float scale, const float *lse, float *mass, void *stream) const;
    void write_last(const kernels::BatchView &dst, const void *k, const void *v, const kernels::Rope &rope,
                    const int32_t *rope_pos, void *stream) const;
    void batch_attention(const kernels::BatchView &kv, int32_t n_heads, const void *q, float scale, void *out,
                         float *lse, void *workspace, size_t workspace_bytes, void *stream) const;
    size_t batch_attention_workspace_bytes(const kernels::BatchView &kv, int32_t n_heads) const;
    void batch_write_attention(const kernels::BatchView &kv, const void *k, const void *v, const kernels::Rope &rope,
                               const int32_t *rope_pos, int32_t n_heads, const void *q, float scale, void *out,
                               float *lse, void *workspace, size_t workspace_bytes, void *stream) const;
    void scatter_ints(int32_t *dst, const int32_t *pairs, int32_t n_pairs, void *stream) const;
    size_t topk_workspace_bytes(int32_t n) const;
    void topk(const float *scores, int32_t n, int32_t k, void *indices, bool indices_i64, void *workspace,
              size_t workspace_bytes, void *stream) const;

  private:
    void activate() const; // makes the CUDA device current
    conduit_backend backend_;
    int32_t ordinal_;
    kernels::Tuning tuning_;
    mutable std::map<size_t, std::vector<int32_t *>> spare_ints_; // capacity -> recycled arrays
};

bool backend_compiled(conduit_backend backend);
bool backend_available(conduit_backend backend);

// A host int32 array with a device copy that is refreshed lazily: only the entries changed since the
// last sync are uploaded. For the CPU backend the host array is the device array.
class MirroredInts {
  public:
    MirroredInts() = default;
    MirroredInts(const MirroredInts &) = delete;
    MirroredInts &operator=(const MirroredInts &) = delete;
    ~MirroredInts();

    std::vector<int32_t> &host() { return host_; }
    const std::vector<int32_t> &host() const { return host_; }
    // Call after changing host()[i:]: the device copy is refreshed from i on at the next sync.
    void touched_from(size_t i) { synced_ = synced_ < i ? synced_ : i; }
    // Shrinks to n entries. (Shrinking through host() would leave the sync mark past the end, and a
    // later regrowth would not be uploaded.)
    void truncate(size_t n) {
        if (n < host_.size()) host_.resize(n);
        touched_from(n);
    }
    const int32_t *sync(const Device &device, void *stream);
    void release(const Device &device);

  private:
    std::vector<int32_t> host_;
    int32_t *device_ = nullptr;
    size_t capacity_ = 0;
    size_t synced_ = 0;
    const Device *owner_ = nullptr;
};

// A grow-only device buffer for per-call temporaries (uploaded slot lists, compaction staging).
// Reuse is ordered by the stream: callers use one stream per arena.
class Scratch {
  public:
    Scratch() = default;
    Scratch(const Scratch &) = delete;
    Scratch &operator=(const Scratch &) = delete;
    void *get(const Device &device, size_t bytes);
    void release(const Device &device);

  private:
    void *ptr_ = nullptr;
    size_t bytes_ = 0;
};

} // namespace conduit
