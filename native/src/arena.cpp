// arena.cpp: the block pool, block allocation with image eviction, and kernel views.
#include "arena.h"

#include <algorithm>

#include "error.h"
#include "step.h"

namespace conduit {

BlockPool::BlockPool(int64_t n_blocks) : refcount_(size_t(n_blocks), 0) {
    free_.reserve(size_t(n_blocks));
    // Hand out low block ids first: neighbouring blocks of a sequence then sit close in memory.
    for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));
}

int64_t BlockPool::n_shared() const {
    return std::count_if(refcount_.begin(), refcount_.end(), [](int32_t r) { return r > 1; });
}

std::vector<int32_t> BlockPool::take(int64_t n) {
    if (n > n_free()) fail(CONDUIT_ERR_INTERNAL, "block pool asked for %lld blocks with %lld free", (long long)n,
                           (long long)n_free());
    std::vector<int32_t> out(free_.end() - n, free_.end());
    free_.resize(free_.size() - size_t(n));
    std::reverse(out.begin(), out.end());
    for (int32_t b : out) refcount_[b] = 1;
    return out;
}

void BlockPool::release(int32_t block) {
    if (refcount_[block] <= 0) fail(CONDUIT_ERR_INTERNAL, "block %d released more often than taken", block);
    if (--refcount_[block] == 0) free_.push_back(block);
}

} // namespace conduit

using namespace conduit;

namespace {

size_t compute_block_bytes(const conduit_arena_params &p) { return conduit_block_bytes(&p); }

int64_t compute_n_blocks(const conduit_arena_params &p) {
    const size_t bb = compute_block_bytes(p);
    return bb ? int64_t(p.kv_bytes / bb) : 0;
}

kernels::Tuning kernel_tuning(const conduit_tuning &t) {
    kernels::Tuning out;
    out.mma_warps = t.mma_warps;
    out.mma_split_waves = t.mma_split_waves;
    return out;
}

} // namespace

conduit_arena::conduit_arena(const conduit_arena_params &p)
    : params(p), device(p.backend, p.device, kernel_tuning(p.tuning)), block_bytes(compute_block_bytes(p)), pool(compute_n_blocks(p)) {
    params.kv_bytes = size_t(pool.n_blocks()) * block_bytes;
    pool_memory = device.alloc(params.kv_bytes);
    log(CONDUIT_LOG_INFO, "arena: %lld blocks of %zu bytes (%s)", (long long)pool.n_blocks(), block_bytes,
        device.is_cuda() ? "cuda" : "cpu");
}

conduit_arena::~conduit_arena() {
    for (conduit_image *h : image_handles) delete h;
    image_handles.clear();
    while (!steps.empty()) step_free(*steps.begin());
    for (conduit_seq *s : seqs) {
        for (auto &layer : s->layers) {
            layer->blocks.release(device);
            layer->positions.release(device);
        }
        delete s;
    }
    seqs.clear();
    for (auto &kv : images)
        for (auto &layer : kv.second->layers) {
            layer->blocks.release(device);
            layer->positions.release(device);
        }
    images.clear();
    scratch.release(device);
    device.free(rope_inv_freq);
    device.free(pool_memory);
}

conduit_arena::Evictable conduit_arena::evictable() const {
    Evictable out;
    for (const auto &kv : images) {
        const ImageEntry &e = *kv.second;
        if (e.refs == 0 && e.committed) {
            out.blocks += e.n_blocks;
            out.bytes += size_t(e.n_blocks) * block_bytes;
        }
    }
    return out;
}

void conduit_arena::reserve_blocks(int64_t n) {
    if (pool.n_free() >= n) return;
    // Checked before evicting: a call that fails keeps the image entries it could not use.
    const int64_t spare = evictable().blocks;
    if (pool.n_free() + spare < n)
        fail(CONDUIT_ERR_ARENA_FULL,
             "KV arena full: %lld blocks needed, %lld free of %lld (%zu bytes each) and %lld in unused image entries",
             (long long)n, (long long)pool.n_free(), (long long)pool.n_blocks(), block_bytes, (long long)spare);
    while (pool.n_free() < n && evict_one_image()) {
    }
}

std::vector<int32_t> conduit_arena::take_blocks(int64_t n) {
    reserve_blocks(n);
    return pool.take(n);
}

void conduit_arena::release_blocks(std::vector<int32_t> &blocks) {
    for (int32_t b : blocks) pool.release(b);
    blocks.clear();
}

bool conduit_arena::evict_one_image() {
    ImageEntry *victim = nullptr;
    for (auto &kv : images) {
        ImageEntry *e = kv.second.get();
        if (e->refs == 0 && e->committed && (!victim || e->last_used < victim->last_used)) victim = e;
    }
    if (!victim) return false;
    log(CONDUIT_LOG_DEBUG, "image store: evicting an entry of %d tokens", victim->n_tokens);
    free_image_entry(victim);
    ++image_evictions;
    return true;
}

void conduit_arena::free_image_entry(ImageEntry *entry) {
    for (auto &layer : entry->layers) {
        release_blocks(layer->blocks.host());
        layer->blocks.release(device);
    }
    image_bytes -= size_t(entry->n_blocks) * block_bytes;
    const std::array<uint8_t, 32> key = entry->key; // erase destroys the entry that holds the key
    images.erase(key);
}

kernels::LayerView conduit_arena::view(LayerTable &table, void *stream) {
    kernels::LayerView v;
    v.pool = pool_memory;
    v.block_table = table.blocks.sync(device, stream);
    v.positions = table.positions.sync(device, stream);
    v.n_tokens = table.n_tokens();
    v.n_kv_heads = params.n_kv_heads;
    v.head_dim = params.head_dim;
    v.block_size = params.block_size;
    v.dtype = kernels::DType(params.dtype);
    v.fp8 = params.kv_format == CONDUIT_KV_FP8_E4M3;
    return v;
}

namespace {

size_t align_upload(size_t bytes) { return (bytes + 255) / 256 * 256; } // each list of upload_ints starts aligned

} // namespace

void conduit_arena::reserve_upload(std::initializer_list<int64_t> list_lengths, size_t extra_bytes) {
    size_t total = extra_bytes;
    for (int64_t n : list_lengths) total += align_upload(size_t(n) * sizeof(int32_t));
    scratch.get(device, total);
}

void conduit_arena::require_query_heads(int32_t n_heads) const {
    CONDUIT_REQUIRE(n_heads > 0 && n_heads % params.n_kv_heads == 0,
                    "n_heads = %d is not a positive multiple of n_kv_heads = %d", n_heads, params.n_kv_heads);
}

kernels::Rope conduit_arena::rope_for(const int32_t *rope_pos) const {
    if (!rope_pos) return kernels::Rope{};
    CONDUIT_REQUIRE(rope.type != CONDUIT_ROPE_NONE,
                    "RoPE positions were given but the arena has no RoPE (call conduit_arena_set_rope)");
    return rope;
}

std::vector<const int32_t *> conduit_arena::upload_ints(const std::vector<std::pair<const int32_t *, int32_t>> &lists,
                                                        size_t extra_bytes, void **extra, void *stream) {
    // Each list starts on a 256-byte boundary so that kernels may use vector loads on it.
    const auto align = align_upload;
    size_t total = 0;
    for (auto &l : lists) total += align(size_t(l.second) * sizeof(int32_t));
    char *base = static_cast<char *>(scratch.get(device, total + extra_bytes));
    std::vector<const int32_t *> out;
    size_t offset = 0;
    for (auto &l : lists) {
        if (!l.first) {
            out.push_back(nullptr);
            continue;
        }
        device.upload(base + offset, l.first, size_t(l.second) * sizeof(int32_t), stream);
        out.push_back(reinterpret_cast<const int32_t *>(base + offset));
        offset += align(size_t(l.second) * sizeof(int32_t));
    }
    if (extra) *extra = base + align(total);
    return out;
}
