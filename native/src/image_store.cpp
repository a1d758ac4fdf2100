// image_store.cpp: image entries live in blocks of the arena's pool; unreferenced committed entries
// are evicted least recently used first, when the store's byte budget or the pool runs short.
#include "image_store.h"

#include <cstring>
#include <numeric>

#include "error.h"

namespace conduit {
namespace {

std::array<uint8_t, 32> to_key(const uint8_t *key) {
    std::array<uint8_t, 32> out{};
    std::memcpy(out.data(), key, out.size());
    return out;
}

conduit_image *new_handle(conduit_arena *arena, ImageEntry *entry) {
    auto *h = new conduit_image{entry, arena};
    arena->image_handles.insert(h);
    ++entry->refs;
    return h;
}

} // namespace

LayerTable &image_layer(const conduit_image *image, int32_t layer) {
    const ImageEntry *e = image->entry;
    CONDUIT_REQUIRE(layer >= 0 && layer < int32_t(e->layers.size()), "layer %d out of range [0, %zu)", layer,
                    e->layers.size());
    return *e->layers[size_t(layer)];
}

conduit_image *image_create(conduit_arena *arena, const uint8_t *key, int32_t n_tokens) {
    CONDUIT_REQUIRE(key, "key is NULL");
    CONDUIT_REQUIRE(n_tokens > 0, "an image entry needs at least one token (got %d)", n_tokens);
    const size_t budget = arena->params.image_cache_bytes;
    CONDUIT_REQUIRE(budget > 0, "this arena has no image store (image_cache_bytes = 0)");
    const auto k = to_key(key);
    if (arena->images.count(k)) fail(CONDUIT_ERR_EXISTS, "an image entry under this key already exists");

    const int32_t bs = arena->params.block_size;
    const int64_t per_layer = (int64_t(n_tokens) + bs - 1) / bs; // int64: n_tokens may be near INT32_MAX
    const int64_t n_blocks = per_layer * arena->params.n_layers;
    const size_t bytes = size_t(n_blocks) * arena->block_bytes;
    if (bytes > budget)
        fail(CONDUIT_ERR_ARENA_FULL, "an image entry of %d tokens needs %zu bytes, over image_cache_bytes = %zu",
             n_tokens, bytes, budget);
    // Both limits are checked before anything is evicted: a call that fails keeps every entry. The
    // evictions for the budget free blocks too, so the pool check below them holds after them.
    const conduit_arena::Evictable spare = arena->evictable();
    if (arena->image_bytes - spare.bytes + bytes > budget)
        fail(CONDUIT_ERR_ARENA_FULL, "image store full: %zu of %zu bytes held by entries in use",
             arena->image_bytes - spare.bytes, budget);
    arena->reserve_blocks(n_blocks);
    while (arena->image_bytes + bytes > budget) arena->evict_one_image();
    std::vector<int32_t> blocks = arena->take_blocks(n_blocks);

    auto entry = std::make_unique<ImageEntry>();
    entry->key = k;
    entry->n_tokens = n_tokens;
    entry->n_blocks = n_blocks;
    for (int32_t l = 0; l < arena->params.n_layers; ++l) {
        auto table = std::make_unique<LayerTable>();
        table->blocks.host().assign(blocks.begin() + l * per_layer, blocks.begin() + (l + 1) * per_layer);
        table->positions.host().resize(size_t(n_tokens));
        std::iota(table->positions.host().begin(), table->positions.host().end(), 0);
        entry->layers.push_back(std::move(table));
    }
    arena->image_bytes += bytes;
    ImageEntry *raw = entry.get();
    arena->images.emplace(k, std::move(entry));
    return new_handle(arena, raw);
}

void image_write(conduit_image *image, int32_t layer, const void *k, const void *v, void *stream) {
    LayerTable &t = image_layer(image, layer);
    CONDUIT_REQUIRE(k && v, "k and v must not be NULL");
    conduit_arena *arena = image->arena;
    arena->device.write_dense(arena->view(t, stream), kernels::Slots{}, t.n_tokens(), k, v, kernels::Rope{}, nullptr,
                              stream);
}

void image_commit(conduit_image *image) {
    image->entry->committed = true;
    image->entry->last_used = ++image->arena->clock;
}

conduit_image *image_acquire(conduit_arena *arena, const uint8_t *key) {
    CONDUIT_REQUIRE(key, "key is NULL");
    auto it = arena->images.find(to_key(key));
    if (it == arena->images.end() || !it->second->committed) return nullptr;
    it->second->last_used = ++arena->clock;
    return new_handle(arena, it->second.get());
}

void image_release(conduit_image *image) {
    conduit_arena *arena = image->arena;
    ImageEntry *entry = image->entry;
    arena->image_handles.erase(image);
    delete image;
    if (--entry->refs == 0 && !entry->committed) arena->free_image_entry(entry);
}

void image_evict(conduit_arena *arena, const uint8_t *key) {
    CONDUIT_REQUIRE(key, "key is NULL");
    auto it = arena->images.find(to_key(key));
    if (it == arena->images.end() || !it->second->committed) fail(CONDUIT_ERR_NOT_FOUND, "no image entry under this key");
    if (it->second->refs > 0) fail(CONDUIT_ERR_IN_USE, "the image entry is referenced %d times", it->second->refs);
    arena->free_image_entry(it->second.get());
}

void image_read(const conduit_image *image, int32_t layer, void *k_out, void *v_out, void *stream) {
    LayerTable &t = image_layer(image, layer);
    if (!k_out && !v_out) return;
    image->arena->device.read_dense(image->arena->view(t, stream), k_out, v_out, stream);
}

} // namespace conduit
