// arena.h: the block pool and the objects that live in it (sequences, image entries).
//
// Ownership: conduit_arena owns the pool memory, every sequence and image entry and every image
// handle it gave out. A block is owned by whoever holds a reference to it (refcount); a block with
// refcount > 1 is shared copy-on-write between sequences and is copied before it is written.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "conduit.h"
#include "device.h"
#include "kernels.h"

namespace conduit {

// One layer of a sequence or image entry: its blocks and, per slot, the causal position.
struct LayerTable {
    MirroredInts blocks;    // block ids, ceil(n_tokens / block_size) of them
    MirroredInts positions; // causal position of each slot (unused by image entries)
    // The largest stored position (INT32_MIN when empty): a decode step checks that its token comes
    // after every stored one. Kept by append_positions; rewrites of positions call refresh_max_position.
    conduit_pos max_position = INT32_MIN;

    int32_t n_tokens() const { return int32_t(positions.host().size()); }
    void append_positions(const conduit_pos *p, int32_t n) {
        positions.host().insert(positions.host().end(), p, p + n);
        for (int32_t i = 0; i < n; ++i) max_position = p[i] > max_position ? p[i] : max_position;
    }
    void refresh_max_position() {
        max_position = INT32_MIN;
        for (conduit_pos p : positions.host()) max_position = p > max_position ? p : max_position;
    }
};

class BlockPool {
  public:
    explicit BlockPool(int64_t n_blocks);
    int64_t n_blocks() const { return int64_t(refcount_.size()); }
    int64_t n_free() const { return int64_t(free_.size()); }
    int64_t n_shared() const;
    // Takes n blocks (refcount 1); the caller checked n <= n_free().
    std::vector<int32_t> take(int64_t n);
    void retain(int32_t block) { ++refcount_[block]; }
    void release(int32_t block);
    int32_t refcount(int32_t block) const { return refcount_[block]; }

  private:
    std::vector<int32_t> refcount_;
    std::vector<int32_t> free_;
};

struct ImageEntry;

} // namespace conduit

struct conduit_image {
    conduit::ImageEntry *entry;
    conduit_arena *arena;
};

namespace conduit {

struct ImageEntry {
    std::array<uint8_t, 32> key{};
    int32_t n_tokens = 0;
    std::vector<std::unique_ptr<LayerTable>> layers;
    int32_t refs = 0;
    bool committed = false;
    uint64_t last_used = 0;
    int64_t n_blocks = 0;
};

} // namespace conduit

struct conduit_seq {
    conduit_arena *arena;
    std::vector<std::unique_ptr<conduit::LayerTable>> layers;
    // Changes whenever a block table or a length of the sequence changes (conduit::mark_changed): a
    // decode step checks it to refuse kernels over tables that moved since its prepare.
    uint64_t version = 0;
};

struct conduit_arena {
    conduit_arena(const conduit_arena_params &params);
    ~conduit_arena();

    conduit_arena_params params;
    conduit::Device device;
    size_t block_bytes = 0;
    void *pool_memory = nullptr;
    conduit::BlockPool pool;
    conduit::Scratch scratch;

    conduit::kernels::Rope rope;        // inv_freq points into rope_inv_freq
    float *rope_inv_freq = nullptr;     // device copy

    std::set<conduit_seq *> seqs;
    std::map<std::array<uint8_t, 32>, std::unique_ptr<conduit::ImageEntry>> images;
    std::set<conduit_image *> image_handles;
    std::set<conduit_step *> steps;
    size_t image_bytes = 0;
    int64_t image_evictions = 0;
    uint64_t clock = 0;
    uint64_t seq_versions = 0; // the last version given to a sequence (conduit_seq::version)

    // Takes n blocks, evicting unreferenced image entries (LRU) if the pool is short.
    // Throws Error(ARENA_FULL) having changed nothing, evicting nothing, when even evicting every
    // unreferenced entry would leave fewer than n blocks free.
    std::vector<int32_t> take_blocks(int64_t n);
    // Ensures n blocks are free (evicting as above) without taking them.
    void reserve_blocks(int64_t n);
    // Blocks and bytes that evicting every unreferenced committed image entry would free.
    struct Evictable {
        int64_t blocks = 0;
        size_t bytes = 0;
    };
    Evictable evictable() const;
    void release_blocks(std::vector<int32_t> &blocks);

    conduit::kernels::LayerView view(conduit::LayerTable &table, void *stream);
    // The RoPE a kernel applies for these positions: none for null, else the arena's (which must be
    // set: throws INVALID_ARGUMENT otherwise).
    conduit::kernels::Rope rope_for(const int32_t *rope_pos) const;
    // Throws INVALID_ARGUMENT unless n_heads query heads can share the arena's KV heads (a positive
    // multiple of n_kv_heads: GQA).
    void require_query_heads(int32_t n_heads) const;
    // Uploads host int32 lists into one scratch allocation; returns their device addresses in order
    // (null for a null list). Valid until the next call that uses the scratch.
    std::vector<const int32_t *> upload_ints(const std::vector<std::pair<const int32_t *, int32_t>> &lists,
                                             size_t extra_bytes, void **extra, void *stream);
    // Grows the scratch now so that a later upload_ints of lists of these lengths (and extra_bytes)
    // cannot fail on allocation (for operations that must not fail after they changed something).
    void reserve_upload(std::initializer_list<int64_t> list_lengths, size_t extra_bytes = 0);

    bool evict_one_image(); // false when nothing is evictable
    void free_image_entry(conduit::ImageEntry *entry);
};
