// api.cpp: the exported C functions. Each checks its handles, runs the operation inside a guard that
// turns every C++ exception into a status plus the thread-local message, and never lets one escape.
#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <type_traits>

#include "arena.h"
#include "error.h"
#include "image_store.h"
#include "sequence.h"
#include "step.h"

using namespace conduit;

#ifndef CONDUIT_VERSION_STRING
#define CONDUIT_VERSION_STRING "0.0.0"
#endif

namespace {

template <typename F> conduit_status guard(F &&body) {
    clear_last_error();
    try {
        body();
        return CONDUIT_OK;
    } catch (const Error &e) {
        set_last_error(e.what());
        return e.status();
    } catch (const kernels::DeviceOutOfMemory &e) {
        set_last_error(e.what());
        return CONDUIT_ERR_OUT_OF_MEMORY;
    } catch (const kernels::CudaError &e) {
        set_last_error(e.what());
        log(CONDUIT_LOG_ERROR, "%s", e.what());
        return CONDUIT_ERR_DEVICE;
    } catch (const std::invalid_argument &e) { // a kernel's own precondition check
        set_last_error(e.what());
        return CONDUIT_ERR_INVALID_ARGUMENT;
    } catch (const std::bad_alloc &) {
        set_last_error("host allocation failed");
        return CONDUIT_ERR_OUT_OF_MEMORY;
    } catch (const std::exception &e) {
        set_last_error(std::string("internal error: ") + e.what());
        return CONDUIT_ERR_INTERNAL;
    } catch (...) {
        set_last_error("internal error: unknown exception");
        return CONDUIT_ERR_INTERNAL;
    }
}

// The value a C caller passed for an enum, read as its underlying integer. A C caller may pass any
// int, and in C++ reading a value outside an enum's range as the enum type is undefined: every enum
// that comes through the ABI is read here and checked as an integer before it is used as the enum.
template <typename E> int64_t enum_value(const E &e) {
    static_assert(std::is_enum_v<E>);
    std::underlying_type_t<E> raw;
    std::memcpy(&raw, &e, sizeof(raw));
    return int64_t(raw);
}

bool is_backend(int64_t b) { return b == CONDUIT_BACKEND_CPU || b == CONDUIT_BACKEND_CUDA; }

#define REQUIRE_HANDLE(h) CONDUIT_REQUIRE((h) != nullptr, "%s is NULL", #h)

void check_params(const conduit_arena_params &p) {
    CONDUIT_REQUIRE(is_backend(enum_value(p.backend)), "unknown backend %lld", (long long)enum_value(p.backend));
    const int64_t dtype = enum_value(p.dtype);
    CONDUIT_REQUIRE(dtype == CONDUIT_DTYPE_F32 || dtype == CONDUIT_DTYPE_F16 || dtype == CONDUIT_DTYPE_BF16,
                    "unknown dtype %lld", (long long)dtype);
    const int64_t format = enum_value(p.kv_format);
    CONDUIT_REQUIRE(format == CONDUIT_KV_DENSE || format == CONDUIT_KV_FP8_E4M3, "unknown kv_format %lld",
                    (long long)format);
    CONDUIT_REQUIRE(p.n_layers >= 1 && p.n_layers <= 4096, "n_layers = %d out of range [1, 4096]", p.n_layers);
    CONDUIT_REQUIRE(p.n_kv_heads >= 1 && p.n_kv_heads <= 1024, "n_kv_heads = %d out of range [1, 1024]", p.n_kv_heads);
    CONDUIT_REQUIRE(p.head_dim >= 8 && p.head_dim <= 256 && p.head_dim % 8 == 0,
                    "head_dim = %d must be a multiple of 8 in [8, 256]", p.head_dim);
    CONDUIT_REQUIRE(p.block_size >= 1 && p.block_size <= 256 && (p.block_size & (p.block_size - 1)) == 0,
                    "block_size = %d must be a power of two in [1, 256]", p.block_size);
    const size_t block_bytes = conduit_block_bytes(&p);
    CONDUIT_REQUIRE(p.kv_bytes >= block_bytes, "kv_bytes = %zu is less than one block (%zu bytes)", p.kv_bytes,
                    block_bytes);
    CONDUIT_REQUIRE(p.kv_bytes / block_bytes <= size_t(INT32_MAX), "kv_bytes = %zu gives more than 2^31 blocks",
                    p.kv_bytes);
    CONDUIT_REQUIRE(p.tuning.mma_warps == 0 || p.tuning.mma_warps == 4 || p.tuning.mma_warps == 8,
                    "tuning.mma_warps = %d must be 0 (the default), 4 or 8", p.tuning.mma_warps);
    CONDUIT_REQUIRE(p.tuning.mma_split_waves >= 0 && p.tuning.mma_split_waves <= 8,
                    "tuning.mma_split_waves = %d out of range [0, 8] (0: the default)", p.tuning.mma_split_waves);
}

} // namespace

extern "C" {

const char *conduit_version(void) { return CONDUIT_VERSION_STRING; }
int32_t conduit_backend_compiled(conduit_backend backend) {
    return is_backend(enum_value(backend)) && backend_compiled(backend) ? 1 : 0;
}

int32_t conduit_backend_available(conduit_backend backend) {
    try {
        return is_backend(enum_value(backend)) && backend_available(backend) ? 1 : 0;
    } catch (...) {
        return 0;
    }
}

const char *conduit_last_error(void) { return last_error(); }
int32_t conduit_status_is_fatal(conduit_status status) { return status < 0 ? 1 : 0; }

const char *conduit_status_name(conduit_status status) {
    switch (status) {
    case CONDUIT_OK: return "CONDUIT_OK";
    case CONDUIT_ERR_INVALID_ARGUMENT: return "CONDUIT_ERR_INVALID_ARGUMENT";
    case CONDUIT_ERR_ARENA_FULL: return "CONDUIT_ERR_ARENA_FULL";
    case CONDUIT_ERR_NOT_FOUND: return "CONDUIT_ERR_NOT_FOUND";
    case CONDUIT_ERR_EXISTS: return "CONDUIT_ERR_EXISTS";
    case CONDUIT_ERR_UNSUPPORTED: return "CONDUIT_ERR_UNSUPPORTED";
    case CONDUIT_ERR_OUT_OF_MEMORY: return "CONDUIT_ERR_OUT_OF_MEMORY";
    case CONDUIT_ERR_IN_USE: return "CONDUIT_ERR_IN_USE";
    case CONDUIT_ERR_DEVICE: return "CONDUIT_ERR_DEVICE";
    case CONDUIT_ERR_INTERNAL: return "CONDUIT_ERR_INTERNAL";
    default: return "CONDUIT_ERR_UNKNOWN";
    }
}

size_t conduit_dtype_size(conduit_dtype dtype) {
    switch (enum_value(dtype)) {
    case CONDUIT_DTYPE_F32: return 4;
    case CONDUIT_DTYPE_F16:
    case CONDUIT_DTYPE_BF16: return 2;
    default: return 0;
    }
}

size_t conduit_block_bytes(const conduit_arena_params *params) {
    if (!params) return 0;
    const size_t rows = size_t(2) * size_t(params->n_kv_heads) * size_t(params->block_size);
    if (enum_value(params->kv_format) == CONDUIT_KV_FP8_E4M3) return rows * (size_t(params->head_dim) + sizeof(float));
    return rows * size_t(params->head_dim) * conduit_dtype_size(params->dtype);
}

conduit_arena_params conduit_arena_default_params(void) {
    conduit_arena_params p;
    std::memset(&p, 0, sizeof(p));
    p.backend = CONDUIT_BACKEND_CPU;
    p.device = 0;
    p.dtype = CONDUIT_DTYPE_F32;
    p.n_layers = 1;
    p.n_kv_heads = 1;
    p.head_dim = 128;
    p.block_size = 16;
    p.kv_bytes = size_t(64) << 20;
    p.image_cache_bytes = 0;
    return p;
}

conduit_status conduit_arena_create(const conduit_arena_params *params, conduit_arena **out) {
    if (out) *out = nullptr;
    return guard([&] {
        CONDUIT_REQUIRE(params && out, "params and out must not be NULL");
        check_params(*params);
        *out = new conduit_arena(*params);
    });
}

void conduit_arena_free(conduit_arena *arena) {
    guard([&] { delete arena; });
}

conduit_status conduit_arena_set_rope(conduit_arena *arena, const conduit_rope_params *rope) {
    return guard([&] {
        REQUIRE_HANDLE(arena);
        REQUIRE_HANDLE(rope);
        const int32_t half = arena->params.head_dim / 2;
        const int64_t type = enum_value(rope->type);
        CONDUIT_REQUIRE(type >= CONDUIT_ROPE_NONE && type <= CONDUIT_ROPE_MROPE, "unknown RoPE type %lld",
                        (long long)type);
        if (rope->type != CONDUIT_ROPE_NONE) {
            CONDUIT_REQUIRE(rope->n_freq >= 1 && rope->n_freq <= half, "n_freq = %d out of range [1, %d]", rope->n_freq,
                            half);
            CONDUIT_REQUIRE(rope->inv_freq, "inv_freq is NULL");
        }
        if (rope->type == CONDUIT_ROPE_MROPE) {
            const int32_t *s = rope->sections;
            CONDUIT_REQUIRE(s[0] >= 0 && s[1] >= 0 && s[2] >= 0 && s[0] + s[1] + s[2] == rope->n_freq,
                            "M-RoPE sections %d + %d + %d must sum to n_freq = %d", s[0], s[1], s[2], rope->n_freq);
        }
        float *inv_freq = nullptr;
        if (rope->type != CONDUIT_ROPE_NONE) {
            inv_freq = static_cast<float *>(arena->device.alloc(sizeof(float) * size_t(rope->n_freq)));
            arena->device.upload(inv_freq, rope->inv_freq, sizeof(float) * size_t(rope->n_freq), nullptr);
        }
        arena->device.free(arena->rope_inv_freq);
        arena->rope_inv_freq = inv_freq;
        arena->rope = kernels::Rope{};
        arena->rope.type = rope->type;
        arena->rope.n_freq = rope->type == CONDUIT_ROPE_NONE ? 0 : rope->n_freq;
        arena->rope.inv_freq = inv_freq;
        for (int i = 0; i < 3; ++i) arena->rope.sections[i] = rope->sections[i];
        arena->rope.scaling = rope->attention_scaling;
    });
}

conduit_status conduit_arena_get_stats(const conduit_arena *arena, conduit_arena_stats *out) {
    return guard([&] {
        REQUIRE_HANDLE(arena);
        REQUIRE_HANDLE(out);
        conduit_arena_stats s;
        std::memset(&s, 0, sizeof(s));
        s.n_blocks_total = arena->pool.n_blocks();
        s.n_blocks_free = arena->pool.n_free();
        s.n_blocks_used = s.n_blocks_total - s.n_blocks_free;
        s.n_blocks_shared = arena->pool.n_shared();
        for (auto &kv : arena->images) s.n_blocks_image += kv.second->n_blocks;
        s.n_seqs = int64_t(arena->seqs.size());
        s.n_image_entries = int64_t(arena->images.size());
        s.n_image_evictions = arena->image_evictions;
        s.block_bytes = arena->block_bytes;
        s.bytes_total = size_t(s.n_blocks_total) * arena->block_bytes;
        s.bytes_used = size_t(s.n_blocks_used) * arena->block_bytes;
        s.image_bytes = arena->image_bytes;
        *out = s;
    });
}

conduit_arena_params conduit_arena_get_params(const conduit_arena *arena) {
    return arena ? arena->params : conduit_arena_default_params();
}

conduit_status conduit_seq_create(conduit_arena *arena, conduit_seq **out) {
    if (out) *out = nullptr;
    return guard([&] {
        REQUIRE_HANDLE(arena);
        REQUIRE_HANDLE(out);
        *out = seq_create(arena);
    });
}

void conduit_seq_free(conduit_seq *seq) {
    if (seq) guard([&] { seq_free(seq); });
}

conduit_status conduit_seq_fork(conduit_seq *seq, void *stream, conduit_seq **out) {
    if (out) *out = nullptr;
    return guard([&] {
        REQUIRE_HANDLE(seq);
        REQUIRE_HANDLE(out);
        *out = seq_fork(seq, stream);
    });
}

conduit_status conduit_seq_append(conduit_seq *seq, const conduit_pos *positions, int32_t n) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_append(seq, positions, n);
    });
}

int32_t conduit_seq_n_tokens(const conduit_seq *seq, int32_t layer) {
    if (!seq || layer < 0 || layer >= int32_t(seq->layers.size())) return -1;
    return seq->layers[size_t(layer)]->n_tokens();
}

int32_t conduit_seq_max_tokens(const conduit_seq *seq) {
    if (!seq) return -1;
    int32_t longest = 0;
    for (const auto &layer : seq->layers) longest = std::max(longest, layer->n_tokens());
    return longest;
}

conduit_status conduit_seq_get_positions(const conduit_seq *seq, int32_t layer, conduit_pos *out, int32_t cap) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        const int32_t n = conduit_seq_n_tokens(seq, layer);
        CONDUIT_REQUIRE(n >= 0, "layer %d out of range [0, %zu)", layer, seq->layers.size());
        CONDUIT_REQUIRE(cap >= n, "cap = %d is less than the layer's %d tokens", cap, n);
        CONDUIT_REQUIRE(n == 0 || out, "out is NULL");
        if (n) std::memcpy(out, seq->layers[size_t(layer)]->positions.host().data(), sizeof(conduit_pos) * size_t(n));
    });
}

conduit_status conduit_seq_truncate(conduit_seq *seq, conduit_pos p0, conduit_pos p1, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_truncate(seq, p0, p1, stream);
    });
}

conduit_status conduit_seq_compact(conduit_seq *seq, int32_t layer, const int32_t *keep_slots, int32_t n_keep,
                                   void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_compact(seq, layer, keep_slots, n_keep, stream);
    });
}

size_t conduit_seq_bytes(const conduit_seq *seq) { return seq ? seq_bytes(seq) : 0; }

conduit_status conduit_seq_write_kv(conduit_seq *seq, int32_t layer, int32_t n, const void *k, const void *v,
                                    const int32_t *slots, const int32_t *rope_pos, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_write_kv(seq, layer, n, k, v, slots, rope_pos, stream);
    });
}

conduit_status conduit_seq_attention(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads, const void *q,
                                     const int32_t *q_pos, float scale, void *out, float *lse, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_attention(seq, layer, n_q, n_heads, q, q_pos, scale, out, lse, stream);
    });
}

conduit_status conduit_seq_attention_stats(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads,
                                           const void *q, const int32_t *q_pos, float scale, float threshold,
                                           float *mass, float *n_below, float *lse, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_attention_stats(seq, layer, n_q, n_heads, q, q_pos, scale, threshold, mass, n_below, lse, stream);
    });
}

conduit_status conduit_seq_attention_mass(conduit_seq *seq, int32_t n_layers, const int32_t *layers, int32_t n_q,
                                          int32_t n_heads, const void *q, const int32_t *q_pos, float scale,
                                          const float *lse, float *mass, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_attention_mass(seq, n_layers, layers, n_q, n_heads, q, q_pos, scale, lse, mass, stream);
    });
}

conduit_status conduit_seq_read_kv(const conduit_seq *seq, int32_t layer, void *k_out, void *v_out, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        seq_read_kv(const_cast<conduit_seq *>(seq), layer, k_out, v_out, stream);
    });
}

conduit_status conduit_image_create(conduit_arena *arena, const uint8_t *key, int32_t n_tokens, conduit_image **out) {
    if (out) *out = nullptr;
    return guard([&] {
        REQUIRE_HANDLE(arena);
        REQUIRE_HANDLE(out);
        *out = image_create(arena, key, n_tokens);
    });
}

conduit_status conduit_image_write(conduit_image *image, int32_t layer, const void *k, const void *v, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(image);
        CONDUIT_REQUIRE(!image->entry->committed, "the image entry is committed and can no longer be written");
        image_write(image, layer, k, v, stream);
    });
}

conduit_status conduit_image_commit(conduit_image *image) {
    return guard([&] {
        REQUIRE_HANDLE(image);
        image_commit(image);
    });
}

conduit_status conduit_image_acquire(conduit_arena *arena, const uint8_t *key, conduit_image **out) {
    if (out) *out = nullptr;
    return guard([&] {
        REQUIRE_HANDLE(arena);
        REQUIRE_HANDLE(out);
        *out = image_acquire(arena, key);
        if (!*out) fail(CONDUIT_ERR_NOT_FOUND, "no cached image entry under this key");
    });
}

int32_t conduit_image_contains(const conduit_arena *arena, const uint8_t *key) {
    if (!arena || !key) return 0;
    std::array<uint8_t, 32> k{};
    std::memcpy(k.data(), key, k.size());
    auto it = arena->images.find(k);
    return it != arena->images.end() && it->second->committed ? 1 : 0;
}

void conduit_image_release(conduit_image *image) {
    if (image) guard([&] { image_release(image); });
}

conduit_status conduit_image_evict(conduit_arena *arena, const uint8_t *key) {
    return guard([&] {
        REQUIRE_HANDLE(arena);
        image_evict(arena, key);
    });
}

conduit_status conduit_step_create(conduit_arena *arena, int32_t max_seqs, int32_t max_tokens, int32_t n_heads,
                                   void *stream, conduit_step **out) {
    if (out) *out = nullptr;
    return guard([&] {
        REQUIRE_HANDLE(arena);
        REQUIRE_HANDLE(out);
        *out = step_create(arena, max_seqs, max_tokens, n_heads, stream);
    });
}

void conduit_step_free(conduit_step *step) {
    if (step) guard([&] { step_free(step); });
}

conduit_status conduit_step_prepare(conduit_step *step, int32_t n_seqs, conduit_seq *const *seqs,
                                    const conduit_pos *positions, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(step);
        step_prepare(step, n_seqs, seqs, positions, stream);
    });
}

conduit_status conduit_step_write_kv(conduit_step *step, int32_t layer, const void *k, const void *v,
                                     const int32_t *rope_pos, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(step);
        step_write_kv(step, layer, k, v, rope_pos, stream);
    });
}

conduit_status conduit_step_attention(conduit_step *step, int32_t layer, const void *q, float scale, void *out,
                                      float *lse, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(step);
        step_attention(step, layer, q, scale, out, lse, stream);
    });
}

conduit_status conduit_step_write_kv_attention(conduit_step *step, int32_t layer, const void *k, const void *v,
                                               const int32_t *rope_pos, const void *q, float scale, void *out,
                                               float *lse, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(step);
        step_write_kv_attention(step, layer, k, v, rope_pos, q, scale, out, lse, stream);
    });
}

int32_t conduit_image_n_tokens(const conduit_image *image) { return image ? image->entry->n_tokens : -1; }

conduit_status conduit_image_read(const conduit_image *image, int32_t layer, void *k_out, void *v_out, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(image);
        image_read(image, layer, k_out, v_out, stream);
    });
}

conduit_status conduit_seq_restore_image(conduit_seq *seq, int32_t layer, const conduit_image *image,
                                         const int32_t *slots, const int32_t *rope_pos, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        REQUIRE_HANDLE(image);
        CONDUIT_REQUIRE(seq->arena == image->arena, "the sequence and the image entry belong to different arenas");
        seq_restore_images(seq, layer, 1, {image->entry}, slots, rope_pos, stream);
    });
}

conduit_status conduit_seq_restore_images(conduit_seq *seq, int32_t first_layer, int32_t n_layers, int32_t n_images,
                                          const conduit_image *const *images, const int32_t *slots,
                                          const int32_t *rope_pos, void *stream) {
    return guard([&] {
        REQUIRE_HANDLE(seq);
        CONDUIT_REQUIRE(n_images >= 0, "n_images = %d", n_images);
        CONDUIT_REQUIRE(n_images == 0 || images, "images is NULL");
        std::vector<const ImageEntry *> entries;
        entries.reserve(size_t(n_images));
        for (int32_t m = 0; m < n_images; ++m) {
            CONDUIT_REQUIRE(images[m] != nullptr, "images[%d] is NULL", m);
            CONDUIT_REQUIRE(seq->arena == images[m]->arena,
                            "the sequence and images[%d] belong to different arenas", m);
            entries.push_back(images[m]->entry);
        }
        seq_restore_images(seq, first_layer, n_layers, entries, slots, rope_pos, stream);
    });
}

size_t conduit_topk_workspace_bytes(conduit_backend backend, int32_t n) {
    if (n < 0 || !is_backend(enum_value(backend)) || !backend_compiled(backend)) return 0;
#ifdef CONDUIT_WITH_CUDA
    if (backend == CONDUIT_BACKEND_CUDA) return kernels::cuda::topk_workspace_bytes(n);
#endif
    return kernels::cpu::topk_workspace_bytes(n);
}

conduit_status conduit_topk(conduit_backend backend, int32_t device, const float *scores, int32_t n, int32_t k,
                            conduit_index_type index_type, void *indices, void *workspace, size_t workspace_bytes,
                            void *stream) {
    return guard([&] {
        CONDUIT_REQUIRE(is_backend(enum_value(backend)), "unknown backend %lld", (long long)enum_value(backend));
        CONDUIT_REQUIRE(n >= 0, "n = %d must be >= 0", n);
        CONDUIT_REQUIRE(k >= 0 && k <= n, "k = %d out of range [0, n = %d]", k, n);
        const int64_t index = enum_value(index_type);
        CONDUIT_REQUIRE(index == CONDUIT_INDEX_I32 || index == CONDUIT_INDEX_I64, "unknown index_type %lld",
                        (long long)index);
        const Device dev(backend, device, kernels::Tuning{}); // top-k has no launch choices to tune
        const size_t needed = dev.topk_workspace_bytes(n);
        CONDUIT_REQUIRE(workspace_bytes >= needed, "workspace_bytes = %zu, top-k of %d scores needs %zu",
                        workspace_bytes, n, needed);
        if (k == 0) return;
        CONDUIT_REQUIRE(scores && indices && (workspace || needed == 0), "scores, indices and workspace must not be NULL");
        dev.topk(scores, n, k, indices, index_type == CONDUIT_INDEX_I64, workspace, workspace_bytes, stream);
    });
}

} // extern "C"
