// runtime.cu: device memory, copies and device selection for the CUDA backend.
//
// Copies are cudaMemcpyAsync on the caller's stream. Host-to-device uploads are staged through a
// pinned ring (see PinnedRing), so the host buffer may be reused as soon as the call returns and the
// host never waits for the stream; device-to-host copies go to pageable memory and are synchronous.
//
// Kernel workspace (stream_workspace) and arrival counters (stream_counters, zero-filled when made;
// the kernels leave them zero): grow-only device buffers cached per (device, stream) and reused by
// every later call on that stream. Reuse is safe because work on one stream runs in order; when a
// buffer must grow, the stream is synchronized before the old buffer is freed.
// Consequences: (1) the first call with a larger workload allocates and synchronizes, so warm up
// before capturing a CUDA graph; (2) two threads must not enqueue on the same stream at once (the
// arena's one-thread rule already says so); (3) the buffers live until the process exits, on
// purpose: freeing them from a static destructor would race the CUDA runtime's own teardown.
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "common.cuh"

namespace conduit::kernels::cuda {
namespace {

// Makes `device` current for the guard's lifetime and restores the caller's device after, so that
// allocating for an arena does not move other libraries (torch) to another device.
class DeviceGuard {
  public:
    explicit DeviceGuard(int32_t device) {
        CUDA_CHECK(cudaGetDevice(&previous_));
        if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
    }
    ~DeviceGuard() {
        int current = previous_;
        if (cudaGetDevice(&current) == cudaSuccess && current != previous_) (void)cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;

  private:
    int previous_ = 0;
};

void copy_async(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, void *stream) {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, as_stream(stream)));
}

} // namespace

void *device_alloc(size_t bytes, int32_t device) {
    DeviceGuard guard(device);
    void *ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes == 0 ? 1 : bytes);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); // not sticky: clear it so later checks do not report it
        throw DeviceOutOfMemory("cudaMalloc of " + std::to_string(bytes) + " bytes on CUDA device " +
                                std::to_string(device) + " failed: out of memory");
    }
    CUDA_CHECK(err);
    return ptr;
}

void device_free(void *ptr, int32_t device) {
    if (!ptr) return;
    DeviceGuard guard(device);
    CUDA_CHECK(cudaFree(ptr));
}

void memcpy_d2d(void *dst, const void *src, size_t bytes, void *stream) {
    copy_async(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

void memset_zero(void *dst, size_t bytes, void *stream) {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, as_stream(stream)));
}

namespace {

// Host-to-device uploads go through a ring of pinned memory: a cudaMemcpyAsync from pageable memory
// first waits for the whole stream (the runtime's staging is synchronous), which would stall the host
// behind the GPU on every decode step (a block-table and position update per layer). Each upload is
// copied into the ring, the DMA is enqueued, and an event marks when that region may be reused.
class PinnedRing {
  public:
    static constexpr size_t kBytes = size_t(8) << 20;

    const void *stage(const void *src, size_t bytes, cudaStream_t stream, void **event_slot) {
        if (!base_) CUDA_CHECK(cudaMallocHost(&base_, kBytes));
        const size_t size = (bytes + 255) / 256 * 256;
        if (head_ + size > kBytes) head_ = 0; // wrap: the tail of the ring stays unused this lap
        wait_for(head_, head_ + size);
        char *out = static_cast<char *>(base_) + head_;
        std::memcpy(out, src, bytes);
        inflight_.push_back({head_, head_ + size, take_event()});
        *event_slot = inflight_.back().event;
        head_ += size;
        (void)stream;
        return out;
    }

  private:
    struct Region {
        size_t begin, end;
        cudaEvent_t event;
    };

    // Regions are handed out in ring order, so the ones that may overlap a new region are the oldest.
    void wait_for(size_t begin, size_t end) {
        while (!inflight_.empty()) {
            const Region &r = inflight_.front();
            const bool overlaps = r.begin < end && begin < r.end;
            if (!overlaps && inflight_.size() < 4096) break;
            CUDA_CHECK(cudaEventSynchronize(r.event));
            free_events_.push_back(r.event);
            inflight_.pop_front();
        }
    }

    cudaEvent_t take_event() {
        if (!free_events_.empty()) {
            cudaEvent_t e = free_events_.back();
            free_events_.pop_back();
            return e;
        }
        cudaEvent_t e;
        CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        return e;
    }

    void *base_ = nullptr;
    size_t head_ = 0;
    std::deque<Region> inflight_;
    std::vector<cudaEvent_t> free_events_;
};

} // namespace

void memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream) {
    if (bytes == 0) return;
    if (bytes > PinnedRing::kBytes / 4) return copy_async(dst, src, bytes, cudaMemcpyHostToDevice, stream);
    static std::mutex mutex;
    static auto *rings = new std::map<int, PinnedRing>(); // one per device; lives until exit, as above
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    void *event = nullptr;
    const void *staged = (*rings)[device].stage(src, bytes, as_stream(stream), &event);
    copy_async(dst, staged, bytes, cudaMemcpyHostToDevice, stream);
    CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)));
}

void memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream) {
    copy_async(dst, src, bytes, cudaMemcpyDeviceToHost, stream);
}

void set_device(int32_t device) {
    int current = -1;
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) CUDA_CHECK(cudaSetDevice(device));
}

int32_t device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); // no driver or no device: not an error for the caller
        return 0;
    }
    return count;
}

void synchronize(void *stream) { CUDA_CHECK(cudaStreamSynchronize(as_stream(stream))); }

int32_t sm_count() {
    int device = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms > 0 ? sms : 1;
}

bool chained_launch_enabled() {
    static std::atomic<int> decided[64]; // 1: off, 2: on
    return once_per_device(decided, [] {
        int device = 0, major = 0;
        CUDA_CHECK(cudaGetDevice(&device));
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        return major >= 9 ? 2 : 1;
    }) == 2;
}

namespace {

struct StreamBuffer {
    void *ptr = nullptr;
    size_t bytes = 0;
};

// The buffer of (current device, stream) in `cache`, grown to at least `bytes` (and zero-filled on
// the stream when `zeroed` and made), or null when the device is out of memory.
void *stream_buffer(std::map<std::pair<int, cudaStream_t>, StreamBuffer> &cache, size_t bytes, cudaStream_t stream,
                    bool zeroed) {
    static std::mutex mutex;
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    StreamBuffer &buffer = cache[{device, stream}];
    if (buffer.bytes >= bytes) return buffer.ptr;
    if (buffer.ptr) {
        CUDA_CHECK(cudaStreamSynchronize(stream)); // earlier kernels on this stream may still use it
        CUDA_CHECK(cudaFree(buffer.ptr));
        buffer = StreamBuffer{};
    }
    const size_t want = bytes < 65536 ? 65536 : bytes + bytes / 2;
    void *ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, want);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return nullptr;
    }
    CUDA_CHECK(err);
    if (zeroed) {
        const cudaError_t set = cudaMemsetAsync(ptr, 0, want, stream);
        if (set != cudaSuccess) (void)cudaFree(ptr);
        CUDA_CHECK(set);
    }
    buffer = StreamBuffer{ptr, want};
    return ptr;
}

} // namespace

void *stream_workspace(size_t bytes, cudaStream_t stream) {
    static auto *cache = new std::map<std::pair<int, cudaStream_t>, StreamBuffer>(); // never freed, see above
    return stream_buffer(*cache, bytes, stream, false);
}

uint32_t *stream_counters(size_t count, cudaStream_t stream) {
    static auto *cache = new std::map<std::pair<int, cudaStream_t>, StreamBuffer>(); // never freed, see above
    return static_cast<uint32_t *>(stream_buffer(*cache, count * sizeof(uint32_t), stream, true));
}

} // namespace conduit::kernels::cuda
