// image_store.h: the image-KV store (pre-RoPE K and V of image tokens, LRU under a byte budget).
#pragma once

#include "arena.h"

namespace conduit {

conduit_image *image_create(conduit_arena *arena, const uint8_t *key, int32_t n_tokens);
void image_write(conduit_image *image, int32_t layer, const void *k, const void *v, void *stream);
void image_commit(conduit_image *image);
conduit_image *image_acquire(conduit_arena *arena, const uint8_t *key); // null when absent
void image_release(conduit_image *image);
void image_evict(conduit_arena *arena, const uint8_t *key);
void image_read(const conduit_image *image, int32_t layer, void *k_out, void *v_out, void *stream);
LayerTable &image_layer(const conduit_image *image, int32_t layer);

} // namespace conduit
