// emu.cpp: the thread model of emu.h and fake CUDA runtime calls over host memory.
//
// The threads of a block are fibers (ucontext) on the calling OS thread: a fiber runs until it
// reaches a barrier, then the next one runs. A barrier opens when every thread it counts has
// arrived; if every unfinished fiber waits and none can open, the emulator reports a deadlock.
#include "emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>

namespace emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber;

// Counts arrivals; the last one makes every waiter runnable again.
struct Barrier {
    int count = 0;
    int arrived = 0;
    std::vector<Fiber *> waiting;
};

struct Fiber {
    ucontext_t context{};
    std::unique_ptr<char[]> stack;
    ThreadContext thread;
    std::vector<std::vector<PendingCopy>> groups; // committed cp.async groups, oldest first
    std::vector<PendingCopy> open;                // copies not yet committed
    bool finished = false;
    bool waiting = false;
    const char *waiting_at = "";
};

struct Warp {
    Barrier barrier;
    uint64_t slots[32] = {};
    unsigned char wide[32][kWarpGatherBytes] = {};
};

ucontext_t g_scheduler;
Fiber *g_current = nullptr;
void (*g_run)(void *) = nullptr;
void *g_body = nullptr;

void perform(const PendingCopy &c) {
    if (c.pred) std::memcpy(c.dst, c.src, size_t(c.bytes));
    else std::memset(c.dst, 0, size_t(c.bytes));
}

void arrive(Barrier &b, const char *what) {
    Fiber *self = g_current;
    if (++b.arrived == b.count) {
        b.arrived = 0;
        for (Fiber *f : b.waiting) f->waiting = false;
        b.waiting.clear();
        return;
    }
    self->waiting = true;
    self->waiting_at = what;
    b.waiting.push_back(self);
    swapcontext(&self->context, &g_scheduler);
}

void fiber_main() {
    Fiber *self = g_current;
    g_run(g_body);
    if (!self->open.empty() || !self->groups.empty()) { // hardware would complete them
        cp_commit();
        cp_wait(0);
    }
    self->finished = true;
    swapcontext(&self->context, &g_scheduler);
}

} // namespace

// A launch's dynamic shared memory, starting right after an inaccessible page and followed by another:
// a read or write before it (or past the page it ends in) faults, where a GPU would report an
// out-of-bounds shared access under compute-sanitizer, instead of reading another object of this
// process (an out-of-bounds table read in kv_copy.cu passed the emulator that way).
class GuardedShared {
  public:
    explicit GuardedShared(size_t bytes) : page_(size_t(sysconf(_SC_PAGESIZE))) {
        data_pages_ = (std::max<size_t>(bytes, 1) + page_ - 1) / page_;
        void *base = mmap(nullptr, (data_pages_ + 2) * page_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) {
            std::perror("emu: mmap of dynamic shared memory");
            std::abort();
        }
        base_ = static_cast<unsigned char *>(base);
        if (mprotect(base_ + page_, data_pages_ * page_, PROT_READ | PROT_WRITE) != 0) {
            std::perror("emu: mprotect of dynamic shared memory");
            std::abort();
        }
    }
    ~GuardedShared() { munmap(base_, (data_pages_ + 2) * page_); }
    GuardedShared(const GuardedShared &) = delete;
    GuardedShared &operator=(const GuardedShared &) = delete;
    unsigned char *data() const { return base_ + page_; }

  private:
    size_t page_, data_pages_ = 0;
    unsigned char *base_ = nullptr;
};

// A warpgroup's collective state (wgmma): its barrier and each thread's A fragment.
struct Warpgroup {
    Barrier barrier;
    uint32_t a[128][4] = {};
};

// A shared-memory barrier (mbarrier): arrivals of the phase in progress, completed phases, the copies
// that land when the phase completes, and the fibers waiting for it.
struct MBarrier {
    uint32_t count = 0, arrived = 0, completed = 0;
    std::vector<PendingCopy> landing;
    std::vector<Fiber *> waiting;
};

struct Block {
    Barrier barrier;
    std::map<const uint64_t *, MBarrier> mbarriers; // by address
    std::vector<Warp> warps;
    std::vector<Warpgroup> warpgroups;
    std::vector<unsigned char> flags; // one per thread, for block_any
    unsigned char *dynamic = nullptr; // the launch's GuardedShared, refilled for each block
};

ThreadContext &ctx() { return g_current->thread; }
void *dynamic_smem() { return g_current->thread.block->dynamic; }
void sync_block() { arrive(g_current->thread.block->barrier, "__syncthreads"); }

void sync_warp() {
    Warp &w = g_current->thread.block->warps[size_t(g_current->thread.linear / 32)];
    arrive(w.barrier, "__syncwarp");
}

uint64_t warp_exchange(uint64_t mine, int src_lane) {
    Warp &w = g_current->thread.block->warps[size_t(g_current->thread.linear / 32)];
    w.slots[g_current->thread.linear % 32] = mine;
    arrive(w.barrier, "warp shuffle");
    const uint64_t out = w.slots[src_lane];
    arrive(w.barrier, "warp shuffle");
    return out;
}

bool warp_any(bool mine) {
    Warp &w = g_current->thread.block->warps[size_t(g_current->thread.linear / 32)];
    w.slots[g_current->thread.linear % 32] = mine;
    arrive(w.barrier, "__any_sync");
    bool any = false;
    for (int i = 0; i < 32; ++i) any |= w.slots[i] != 0; // absent lanes of a partial warp stay 0
    arrive(w.barrier, "__any_sync");
    return any;
}

uint32_t warp_ballot(bool mine) {
    Warp &w = g_current->thread.block->warps[size_t(g_current->thread.linear / 32)];
    w.slots[g_current->thread.linear % 32] = mine;
    arrive(w.barrier, "__ballot_sync");
    uint32_t bits = 0;
    for (int i = 0; i < 32; ++i) bits |= (w.slots[i] != 0 ? 1u : 0u) << i;
    arrive(w.barrier, "__ballot_sync");
    return bits;
}

void warp_gather(const void *mine, int bytes, void *all) {
    if (bytes > kWarpGatherBytes) std::abort();
    Warp &w = g_current->thread.block->warps[size_t(g_current->thread.linear / 32)];
    std::memcpy(w.wide[g_current->thread.linear % 32], mine, size_t(bytes));
    arrive(w.barrier, "warp gather");
    for (int l = 0; l < 32; ++l) std::memcpy(static_cast<unsigned char *>(all) + l * bytes, w.wide[l], size_t(bytes));
    arrive(w.barrier, "warp gather");
}

bool block_any(bool mine) {
    Block &b = *g_current->thread.block;
    b.flags[size_t(g_current->thread.linear)] = mine;
    arrive(b.barrier, "__syncthreads_or");
    bool any = false;
    for (unsigned char f : b.flags) any |= f != 0;
    arrive(b.barrier, "__syncthreads_or");
    return any;
}

// ldmatrix .m8n8.x4.b16: lane l gives the address of row l % 8 of matrix l / 8; register j of lane
// l gets (row l / 4, columns 2 (l % 4), +1) of matrix j, or with .trans (rows 2 (l % 4), +1,
// column l / 4), the lower index in the low half.
void ldmatrix_x4(uint32_t *r, const void *smem, bool trans) {
    const void *rows[32];
    warp_gather(&smem, sizeof(smem), rows);
    const int lane = g_current->thread.linear % 32;
    auto element = [&](int matrix, int row, int col) {
        uint16_t v;
        std::memcpy(&v, static_cast<const unsigned char *>(rows[matrix * 8 + row]) + 2 * col, 2);
        return uint32_t(v);
    };
    for (int j = 0; j < 4; ++j) {
        if (trans) r[j] = element(j, 2 * (lane % 4), lane / 4) | (element(j, 2 * (lane % 4) + 1, lane / 4) << 16);
        else r[j] = element(j, lane / 4, 2 * (lane % 4)) | (element(j, lane / 4, 2 * (lane % 4) + 1) << 16);
    }
}

namespace {
float half_bits_to_float(uint32_t bits, bool bf16) {
    if (bf16) return __uint_as_float(bits << 16);
    __half_raw raw;
    raw.x = uint16_t(bits);
    return __half2float(__half(raw));
}
} // namespace

// mma.m16n8k16.row.col f32 += {bf16|f16}: A 16x16 (lane (r % 8) * 4 + (k % 8) / 2, register
// r / 8 + 2 (k / 8), half k % 2), B 16x8 (lane n * 4 + (k % 8) / 2, register k / 8, half k % 2),
// C/D 16x8 (lane (r % 8) * 4 + n / 2, element 2 (r / 8) + n % 2).
void mma_m16n8k16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1, bool bf16) {
    uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1}, all[32][6];
    warp_gather(mine, sizeof(mine), all);
    auto a_at = [&](int r, int k) {
        const uint32_t reg = all[(r % 8) * 4 + (k % 8) / 2][r / 8 + 2 * (k / 8)];
        return half_bits_to_float(k % 2 ? reg >> 16 : reg & 0xffffu, bf16);
    };
    auto b_at = [&](int k, int n) {
        const uint32_t reg = all[n * 4 + (k % 8) / 2][4 + k / 8];
        return half_bits_to_float(k % 2 ? reg >> 16 : reg & 0xffffu, bf16);
    };
    const int lane = g_current->thread.linear % 32;
    for (int j = 0; j < 4; ++j) {
        const int r = lane / 4 + 8 * (j / 2), n = 2 * (lane % 4) + j % 2;
        double sum = 0.0;
        for (int k = 0; k < 16; ++k) sum += double(a_at(r, k)) * double(b_at(k, n));
        d[j] = float(double(d[j]) + sum);
    }
}

size_t shared_offset(const void *p) {
    return size_t(static_cast<const unsigned char *>(p) - g_current->thread.block->dynamic);
}

// wgmma.m64nNk16, A from registers. The warpgroup's A fragments are gathered (warp w holds rows
// 16 w.., laid out as mma.m16n8k16's A); B element (k, n) is read at its canonical offset from the
// descriptor's start (K-major: 8-row groups of n SBO apart, 128-byte rows of k; MN-major: 8-row
// groups of k SBO apart, 128-byte rows of n, 64-column blocks of n LBO apart), then the 128-byte
// swizzle: bits 4-6 of the offset XOR bits 7-9.
void wgmma_rs(float *d, int n, const uint32_t *a, uint64_t desc, bool accumulate, bool trans_b, bool bf16) {
    Block &block = *g_current->thread.block;
    const int linear = g_current->thread.linear;
    Warpgroup &group = block.warpgroups[size_t(linear / 128)];
    if (group.barrier.count != 128 || (desc >> 62) != 1) {
        std::fprintf(stderr, "emu: wgmma needs a whole warpgroup and the 128-byte swizzle\n");
        std::abort();
    }
    std::memcpy(group.a[linear % 128], a, sizeof(group.a[0]));
    arrive(group.barrier, "wgmma");
    const size_t start = size_t(desc & 0x3FFF) << 4, lbo = size_t((desc >> 16) & 0x3FFF) << 4,
                 sbo = size_t((desc >> 32) & 0x3FFF) << 4;
    auto a_at = [&](int r, int k) {
        const uint32_t reg = group.a[(r / 16) * 32 + (r % 8) * 4 + (k % 8) / 2][(r % 16) / 8 + 2 * (k / 8)];
        return half_bits_to_float(k % 2 ? reg >> 16 : reg & 0xffffu, bf16);
    };
    auto b_at = [&](int k, int col) {
        size_t offset = trans_b ? start + size_t(k / 8) * sbo + size_t(k % 8) * 128 + size_t(col / 64) * lbo + size_t(col % 64) * 2
                                : start + size_t(col / 8) * sbo + size_t(col % 8) * 128 + size_t(k) * 2;
        offset ^= ((offset >> 7) & 7) << 4;
        uint16_t v;
        std::memcpy(&v, block.dynamic + offset, 2);
        return half_bits_to_float(v, bf16);
    };
    const int warp = (linear / 32) % 4, lane = linear % 32;
    for (int j = 0; j < n / 2; ++j) {
        const int r = 16 * warp + lane / 4 + 8 * ((j % 4) / 2), col = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
        double sum = 0.0;
        for (int k = 0; k < 16; ++k) sum += double(a_at(r, k)) * double(b_at(k, col));
        d[j] = accumulate ? float(double(d[j]) + sum) : float(sum);
    }
    arrive(group.barrier, "wgmma"); // every thread has read the fragments before the next call writes them
}

void cp_async(void *dst, const void *src, int bytes, bool pred) { g_current->open.push_back({dst, src, bytes, pred}); }
void cp_commit() {
    g_current->groups.push_back(std::move(g_current->open));
    g_current->open.clear();
}
void cp_wait(int pending) {
    auto &groups = g_current->groups;
    while (int(groups.size()) > pending) {
        for (const PendingCopy &c : groups.front()) perform(c);
        groups.erase(groups.begin());
    }
}

MBarrier &mbarrier_at(const uint64_t *bar) {
    auto &all = g_current->thread.block->mbarriers;
    auto it = all.find(bar);
    if (it == all.end()) {
        std::fprintf(stderr, "emu: mbarrier used before mbarrier_init\n");
        std::abort();
    }
    return it->second;
}

void mbarrier_init(uint64_t *bar, uint32_t count) {
    MBarrier &m = g_current->thread.block->mbarriers[bar];
    m = MBarrier{};
    m.count = count;
}

void mbarrier_arrive(uint64_t *bar) {
    MBarrier &m = mbarrier_at(bar);
    if (++m.arrived < m.count) return;
    for (const PendingCopy &c : m.landing) perform(c);
    m.landing.clear();
    m.arrived = 0;
    ++m.completed;
    for (Fiber *f : m.waiting) f->waiting = false;
    m.waiting.clear();
}

void cp_async_mbarrier_arrive(uint64_t *bar) {
    MBarrier &m = mbarrier_at(bar);
    Fiber *self = g_current;
    for (auto &group : self->groups) m.landing.insert(m.landing.end(), group.begin(), group.end());
    m.landing.insert(m.landing.end(), self->open.begin(), self->open.end());
    self->groups.clear();
    self->open.clear();
    mbarrier_arrive(bar);
}

void mbarrier_wait(uint64_t *bar, uint32_t parity) {
    // The phase in progress has the parity of the phases completed so far; the one asked for is over
    // when that differs from it.
    for (;;) {
        MBarrier &m = mbarrier_at(bar);
        if ((m.completed & 1u) != (parity & 1u)) return;
        Fiber *self = g_current;
        self->waiting = true;
        self->waiting_at = "mbarrier";
        m.waiting.push_back(self);
        swapcontext(&self->context, &g_scheduler);
    }
}

int g_smem_limit = 0; // the largest dynamic shared memory a kernel opted into (cudaFuncSetAttribute)
size_t g_malloc_limit = SIZE_MAX;
int g_sm_count = 4;
uint32_t g_block_order_seed = 0;

void launch_blocks(dim3 grid, dim3 block, size_t smem, void (*run)(void *), void *body) {
    const int threads = int(block.x * block.y * block.z);
    if (threads < 1 || threads > 1024 || grid.y > 65535 || grid.z > 65535 || smem > size_t(std::max(48 * 1024, g_smem_limit))) {
        std::fprintf(stderr, "emu: bad launch grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n", grid.x, grid.y, grid.z,
                     block.x, block.y, block.z, smem);
        std::abort();
    }
    static std::vector<Fiber> fibers(1024);
    g_run = run;
    g_body = body;
    std::vector<dim3> order;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) order.push_back(dim3(x, y, z));
    if (g_block_order_seed) {
        static uint32_t launches = 0;
        std::mt19937 shuffle_rng(g_block_order_seed * 7919u + launches++);
        std::shuffle(order.begin(), order.end(), shuffle_rng);
    }
    GuardedShared shared(smem);
    for (const dim3 &index : order) {
        const unsigned x = index.x, y = index.y, z = index.z;
        Block state;
        state.barrier.count = threads;
        std::memset(shared.data(), 0xff, smem);
        state.dynamic = shared.data();
        state.flags.assign(size_t(threads), 0);
        state.warps.resize(size_t((threads + 31) / 32));
        for (size_t w = 0; w < state.warps.size(); ++w) state.warps[w].barrier.count = std::min(32, threads - 32 * int(w));
        state.warpgroups.resize(size_t((threads + 127) / 128));
        for (size_t g = 0; g < state.warpgroups.size(); ++g)
            state.warpgroups[g].barrier.count = std::min(128, threads - 128 * int(g));
        for (int t = 0; t < threads; ++t) {
            Fiber &f = fibers[size_t(t)];
            if (!f.stack) f.stack.reset(new char[kStackBytes]);
            f.thread.thread_idx = dim3(unsigned(t) % block.x, unsigned(t) / block.x % block.y,
                                       unsigned(t) / (block.x * block.y));
            f.thread.block_idx = dim3(x, y, z);
            f.thread.block_dim = block;
            f.thread.grid_dim = grid;
            f.thread.block = &state;
            f.thread.linear = t;
            f.groups.clear();
            f.open.clear();
            f.finished = false;
            f.waiting = false;
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = f.stack.get();
            f.context.uc_stack.ss_size = kStackBytes;
            f.context.uc_link = nullptr;
            makecontext(&f.context, fiber_main, 0);
        }
        for (;;) {
            bool progressed = false, unfinished = false;
            for (int t = 0; t < threads; ++t) {
                Fiber &f = fibers[size_t(t)];
                if (f.finished) continue;
                unfinished = true;
                if (f.waiting) continue;
                g_current = &f;
                swapcontext(&g_scheduler, &f.context);
                progressed = true;
            }
            if (!unfinished) break;
            if (!progressed) {
                for (int t = 0; t < threads; ++t)
                    if (!fibers[size_t(t)].finished)
                        std::fprintf(stderr, "emu: deadlock: thread %d waits at %s\n", t, fibers[size_t(t)].waiting_at);
                std::abort();
            }
        }
        g_current = nullptr;
    }
}

} // namespace emu

// ---- fake CUDA runtime over host memory ----
namespace {
thread_local cudaError_t t_last = cudaSuccess;
int g_device = 0;
} // namespace

extern "C" {
cudaError_t cudaGetDevice(int *device) { *device = g_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int device) { g_device = device; return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *count) { *count = 1; return cudaSuccess; }
cudaError_t cudaMalloc(void **ptr, size_t size) {
    *ptr = size > emu::g_malloc_limit ? nullptr : std::aligned_alloc(256, (size + 255) / 256 * 256);
    return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *ptr) { std::free(ptr); return cudaSuccess; }
cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t) { return cudaMalloc(ptr, size); }
cudaError_t cudaFreeAsync(void *ptr, cudaStream_t) { return cudaFree(ptr); }
cudaError_t cudaMallocHost(void **ptr, size_t size) { return cudaMalloc(ptr, size); }
// Events: every emulated operation completes before its call returns, so an event is always done.
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int) {
    static char token;
    *event = reinterpret_cast<cudaEvent_t>(&token);
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind, cudaStream_t) {
    std::memmove(dst, src, count);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t) {
    std::memset(ptr, value, count);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int) {
    *value = attr == cudaDevAttrMultiProcessorCount ? emu::g_sm_count : 0; // few SMs: small problems still split
    return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, const void *, int, size_t) {
    *blocks = 4; // with the 4 emulated SMs: 16 resident CTAs, so that small problems still split
    return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void *, enum cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value > 227 * 1024) return cudaErrorInvalidValue;
        emu::g_smem_limit = std::max(emu::g_smem_limit, value);
    }
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { const cudaError_t e = t_last; t_last = cudaSuccess; return e; }
const char *cudaGetErrorName(cudaError_t) { return "cudaErrorEmulated"; }
const char *cudaGetErrorString(cudaError_t) { return "emulated error"; }
}
