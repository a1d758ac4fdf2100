// sequence.cpp: sequences and their per-layer block tables: append, fork (copy-on-write),
// truncate, compaction, and the kernels that read and write a sequence's KV.
#include "sequence.h"

#include <algorithm>
#include <climits>
#include <numeric>

#include "error.h"

namespace conduit {

void mark_changed(conduit_seq *seq) { seq->version = ++seq->arena->seq_versions; }

namespace {

int64_t blocks_for(int64_t n_tokens, int32_t block_size) { return (n_tokens + block_size - 1) / block_size; }

LayerTable &layer_of(conduit_seq *seq, int32_t layer) {
    CONDUIT_REQUIRE(layer >= 0 && layer < int32_t(seq->layers.size()), "layer %d out of range [0, %zu)", layer,
                    seq->layers.size());
    return *seq->layers[size_t(layer)];
}

using BlockIndices = std::vector<int64_t>; // indices into a layer's block table, sorted, distinct

// Block indices [first, last].
BlockIndices block_range(int64_t first, int64_t last) {
    BlockIndices out(size_t(std::max<int64_t>(0, last - first + 1)));
    std::iota(out.begin(), out.end(), first);
    return out;
}

// Checks a write's slots (each in [0, n_tokens), none twice) and returns the blocks it touches (slots
// NULL: the last n). A pass hands every layer the same few hundred or thousand slots, usually in
// increasing order: that case is one linear scan; any other order is sorted first.
BlockIndices touched_blocks(const LayerTable &t, const int32_t *slots, int32_t n, int32_t block_size) {
    if (n == 0) return {};
    if (!slots) return block_range((t.n_tokens() - n) / block_size, (t.n_tokens() - 1) / block_size);
    bool increasing = true;
    for (int32_t i = 1; i < n && increasing; ++i) increasing = slots[i] > slots[i - 1];
    std::vector<int32_t> sorted;
    const int32_t *ordered = slots;
    if (!increasing) {
        sorted.assign(slots, slots + n);
        std::sort(sorted.begin(), sorted.end());
        ordered = sorted.data();
    }
    CONDUIT_REQUIRE(ordered[0] >= 0 && ordered[n - 1] < t.n_tokens(), "slot %d out of range [0, %d)",
                    ordered[0] < 0 ? ordered[0] : ordered[n - 1], t.n_tokens());
    BlockIndices out;
    for (int32_t i = 0; i < n; ++i) {
        CONDUIT_REQUIRE(i == 0 || ordered[i] != ordered[i - 1], "slot %d given twice", ordered[i]);
        const int64_t block = ordered[i] / block_size;
        if (out.empty() || out.back() != block) out.push_back(block);
    }
    return out;
}

int64_t count_shared(conduit_arena *arena, const LayerTable &t, const BlockIndices &block_indices) {
    int64_t n = 0;
    for (int64_t bi : block_indices) n += arena->pool.refcount(t.blocks.host()[size_t(bi)]) > 1;
    return n;
}

// Gives the layer its own copy of each shared block among `block_indices`, taking the new blocks from
// `fresh` (enough of them were reserved by the caller). With copy=false the old content is not copied
// (the caller overwrites the whole block).
void make_exclusive(conduit_arena *arena, LayerTable &t, const BlockIndices &block_indices,
                    std::vector<int32_t> &fresh, bool copy, void *stream) {
    auto &blocks = t.blocks.host();
    for (int64_t bi : block_indices) {
        const int32_t old = blocks[size_t(bi)];
        if (arena->pool.refcount(old) <= 1) continue;
        const int32_t replacement = fresh.back();
        fresh.pop_back();
        if (copy) {
            char *pool = static_cast<char *>(arena->pool_memory);
            arena->device.copy(pool + size_t(replacement) * arena->block_bytes, pool + size_t(old) * arena->block_bytes,
                               arena->block_bytes, stream);
        }
        arena->pool.release(old);
        blocks[size_t(bi)] = replacement;
        t.blocks.touched_from(size_t(bi));
    }
}

// Prepares the destination of a write of n tokens into layers [first, first + count), the same slots in
// each (host, or NULL: the last n, which needs every layer of the range to hold as many tokens):
// checks the layer range and the slots, then gives each layer its own copy of every shared block the
// write touches. Throws before changing anything. Returns the token count of the range's layers
// (each, when slots is NULL), from which the last-n base follows.
int32_t prepare_write(conduit_seq *seq, int32_t first, int32_t count, int32_t n, const int32_t *slots, void *stream) {
    conduit_arena *arena = seq->arena;
    const int32_t total = int32_t(seq->layers.size());
    CONDUIT_REQUIRE(first >= 0 && count >= 1 && first <= total - count, "layers [%d, %d + %d) out of range [0, %d)",
                    first, first, count, total);
    // The slot list is shared by the layers: checking it against the one with the fewest tokens
    // covers them all.
    const LayerTable *fewest = seq->layers[size_t(first)].get();
    for (int32_t j = 0; j < count; ++j) {
        const LayerTable &t = *seq->layers[size_t(first + j)];
        CONDUIT_REQUIRE(n >= 0 && n <= t.n_tokens(), "cannot write %d tokens into layer %d of %d", n, first + j,
                        t.n_tokens());
        CONDUIT_REQUIRE(slots || t.n_tokens() == fewest->n_tokens(),
                        "slots is NULL but the layers hold different numbers of tokens (%d and %d)", t.n_tokens(),
                        fewest->n_tokens());
        if (t.n_tokens() < fewest->n_tokens()) fewest = &t;
    }
    const BlockIndices touched = touched_blocks(*fewest, slots, n, arena->params.block_size); // same in every layer
    int64_t n_shared = 0;
    for (int32_t j = 0; j < count; ++j) n_shared += count_shared(arena, *seq->layers[size_t(first + j)], touched);
    std::vector<int32_t> fresh = arena->take_blocks(n_shared); // the last step that can fail
    for (int32_t j = 0; j < count; ++j) make_exclusive(arena, *seq->layers[size_t(first + j)], touched, fresh, true, stream);
    if (n_shared > 0) mark_changed(seq);
    return fewest->n_tokens();
}

// Keeps the given (validated, strictly increasing) slots of a layer. `fresh` holds enough reserved
// blocks for the shared blocks among the first ceil(m / block_size).
void compact_layer(conduit_seq *seq, LayerTable &t, const int32_t *keep, int32_t m, std::vector<int32_t> &fresh,
                   void *stream) {
    conduit_arena *arena = seq->arena;
    const int32_t bs = arena->params.block_size;
    const int64_t new_nb = blocks_for(m, bs);
    auto &blocks = t.blocks.host();
    auto &positions = t.positions.host();
    bool is_prefix = true;
    for (int32_t i = 0; i < m && is_prefix; ++i) is_prefix = keep[i] == i;
    if (!is_prefix && m > 0) {
        // Stage the kept tokens in scratch (gathered densely as blocks 0..new_nb-1), then write them back
        // to the front of the layer: reads and writes never overlap, whatever the order of `keep`.
        std::vector<int32_t> identity(static_cast<size_t>(new_nb));
        std::iota(identity.begin(), identity.end(), 0);
        void *staging = nullptr;
        auto lists = arena->upload_ints({{keep, m}, {identity.data(), int32_t(new_nb)}},
                                        size_t(new_nb) * arena->block_bytes, &staging, stream);
        kernels::LayerView src = arena->view(t, stream);
        kernels::LayerView stage = src;
        stage.pool = staging;
        stage.block_table = lists[1];
        stage.positions = nullptr;
        arena->device.copy_paged(src, kernels::Slots{lists[0], 0}, stage, kernels::Slots{}, m, kernels::Rope{},
                                 nullptr, stream);
        make_exclusive(arena, t, block_range(0, new_nb - 1), fresh, false, stream);
        kernels::LayerView dst = arena->view(t, stream);
        arena->device.copy_paged(stage, kernels::Slots{}, dst, kernels::Slots{}, m, kernels::Rope{}, nullptr, stream);
        std::vector<int32_t> kept_positions(static_cast<size_t>(m));
        for (int32_t i = 0; i < m; ++i) kept_positions[size_t(i)] = positions[size_t(keep[i])];
        positions.swap(kept_positions);
        t.positions.touched_from(0);
    } else {
        t.positions.truncate(size_t(m));
    }
    t.refresh_max_position();
    std::vector<int32_t> tail(blocks.begin() + new_nb, blocks.end());
    t.blocks.truncate(size_t(new_nb));
    arena->release_blocks(tail);
    mark_changed(seq);
}

// The blocks a compaction of a layer to the (validated) slots `keep` takes, with the scratch its
// staging needs grown now (compact_layer's upload), so that it cannot fail on allocation once it has
// taken blocks or compacted another layer.
int64_t compact_need(conduit_arena *arena, const LayerTable &t, const int32_t *keep, int32_t m) {
    bool is_prefix = true;
    for (int32_t i = 0; i < m && is_prefix; ++i) is_prefix = keep[i] == i;
    if (is_prefix) return 0;
    const int64_t new_nb = blocks_for(m, arena->params.block_size);
    arena->reserve_upload({m, new_nb}, size_t(new_nb) * arena->block_bytes);
    return count_shared(arena, t, block_range(0, new_nb - 1));
}

} // namespace

conduit_seq *seq_create(conduit_arena *arena) {
    auto seq = std::make_unique<conduit_seq>();
    seq->arena = arena;
    for (int32_t l = 0; l < arena->params.n_layers; ++l) seq->layers.push_back(std::make_unique<LayerTable>());
    conduit_seq *raw = seq.release();
    arena->seqs.insert(raw);
    mark_changed(raw);
    return raw;
}

void seq_free(conduit_seq *seq) {
    conduit_arena *arena = seq->arena;
    for (auto &layer : seq->layers) {
        arena->release_blocks(layer->blocks.host());
        layer->blocks.release(arena->device);
        layer->positions.release(arena->device);
    }
    arena->seqs.erase(seq);
    delete seq;
}

conduit_seq *seq_fork(conduit_seq *seq, void *stream) {
    conduit_arena *arena = seq->arena;
    const int32_t bs = arena->params.block_size;
    int64_t partial = 0;
    for (auto &layer : seq->layers) partial += layer->n_tokens() % bs != 0;
    std::vector<int32_t> fresh = arena->take_blocks(partial);
    conduit_seq *child = seq_create(arena);
    mark_changed(seq); // its full blocks are shared from now on: a write must copy them first
    char *pool = static_cast<char *>(arena->pool_memory);
    for (size_t l = 0; l < seq->layers.size(); ++l) {
        const LayerTable &src = *seq->layers[l];
        LayerTable &dst = *child->layers[l];
        dst.positions.host() = src.positions.host();
        dst.max_position = src.max_position;
        dst.blocks.host() = src.blocks.host();
        const int64_t n_full = src.n_tokens() / bs;
        for (int64_t bi = 0; bi < n_full; ++bi) arena->pool.retain(src.blocks.host()[size_t(bi)]);
        if (src.n_tokens() % bs != 0) {
            const int32_t old = src.blocks.host()[size_t(n_full)];
            const int32_t copy = fresh.back();
            fresh.pop_back();
            arena->device.copy(pool + size_t(copy) * arena->block_bytes, pool + size_t(old) * arena->block_bytes,
                               arena->block_bytes, stream);
            dst.blocks.host()[size_t(n_full)] = copy;
        }
    }
    return child;
}

void seq_append(conduit_seq *seq, const conduit_pos *positions, int32_t n) {
    conduit_arena *arena = seq->arena;
    const int32_t bs = arena->params.block_size;
    CONDUIT_REQUIRE(n >= 0, "cannot append %d tokens", n);
    CONDUIT_REQUIRE(n == 0 || positions, "positions is NULL");
    int64_t need = 0;
    for (auto &layer : seq->layers)
        need += blocks_for(int64_t(layer->n_tokens()) + n, bs) - int64_t(layer->blocks.host().size());
    std::vector<int32_t> fresh = arena->take_blocks(need);
    for (auto &layer : seq->layers) {
        auto &blocks = layer->blocks.host();
        const int64_t want = blocks_for(int64_t(layer->n_tokens()) + n, bs);
        while (int64_t(blocks.size()) < want) {
            blocks.push_back(fresh.back());
            fresh.pop_back();
        }
        layer->append_positions(positions, n);
    }
    if (n > 0) mark_changed(seq);
}

void seqs_append_step(conduit_seq *const *seqs, const conduit_pos *positions, int32_t n, int32_t max_tokens,
                      void *stream) {
    conduit_arena *arena = seqs[0]->arena;
    const int32_t bs = arena->params.block_size;
    // A layer needs a block when its new token starts one, or when the partial block it lands in is
    // shared (a fork's or a truncated tail's): that block is copied first.
    auto needs_block = [&](const LayerTable &t) {
        return t.n_tokens() % bs == 0 || arena->pool.refcount(t.blocks.host().back()) > 1;
    };
    int64_t need = 0;
    for (int32_t i = 0; i < n; ++i) {
        for (size_t l = 0; l < seqs[i]->layers.size(); ++l) {
            const LayerTable &t = *seqs[i]->layers[l];
            CONDUIT_REQUIRE(t.n_tokens() < max_tokens, "sequence %d: layer %zu holds %d tokens, the step's capacity is %d",
                            i, l, t.n_tokens(), max_tokens);
            CONDUIT_REQUIRE(positions[i] > t.max_position,
                            "sequence %d: position %d is not after every stored token (layer %zu holds position %d)", i,
                            positions[i], l, t.max_position);
            need += needs_block(t);
        }
    }
    std::vector<int32_t> fresh = arena->take_blocks(need); // the last step that can fail
    for (int32_t i = 0; i < n; ++i) {
        for (auto &layer : seqs[i]->layers) {
            LayerTable &t = *layer;
            if (t.n_tokens() % bs == 0) {
                t.blocks.host().push_back(fresh.back());
                fresh.pop_back();
            } else {
                make_exclusive(arena, t, {int64_t(t.blocks.host().size()) - 1}, fresh, true, stream);
            }
            t.append_positions(&positions[i], 1);
        }
        mark_changed(seqs[i]);
    }
    // Two sequences of the batch may share one partial block: the first one's copy leaves the second
    // its sole owner, and the block counted for the second is not needed.
    arena->release_blocks(fresh);
}

void seq_truncate(conduit_seq *seq, conduit_pos p0, conduit_pos p1, void *stream) {
    CONDUIT_REQUIRE(p0 <= p1, "reversed position range [%d, %d)", p0, p1);
    conduit_arena *arena = seq->arena;
    std::vector<std::vector<int32_t>> keeps;
    int64_t need = 0;
    for (auto &layer : seq->layers) {
        std::vector<int32_t> keep;
        const auto &pos = layer->positions.host();
        for (int32_t s = 0; s < layer->n_tokens(); ++s)
            if (pos[size_t(s)] < p0 || pos[size_t(s)] >= p1) keep.push_back(s);
        need += compact_need(arena, *layer, keep.data(), int32_t(keep.size()));
        keeps.push_back(std::move(keep));
    }
    std::vector<int32_t> fresh = arena->take_blocks(need);
    for (size_t l = 0; l < seq->layers.size(); ++l) {
        if (int32_t(keeps[l].size()) == seq->layers[l]->n_tokens()) continue;
        compact_layer(seq, *seq->layers[l], keeps[l].data(), int32_t(keeps[l].size()), fresh, stream);
    }
}

void seq_compact(conduit_seq *seq, int32_t layer, const int32_t *keep, int32_t m, void *stream) {
    LayerTable &t = layer_of(seq, layer);
    CONDUIT_REQUIRE(m >= 0 && m <= t.n_tokens(), "cannot keep %d of %d tokens", m, t.n_tokens());
    CONDUIT_REQUIRE(m == 0 || keep, "keep_slots is NULL");
    for (int32_t i = 0; i < m; ++i) {
        CONDUIT_REQUIRE(keep[i] >= 0 && keep[i] < t.n_tokens(), "slot %d out of range [0, %d)", keep[i], t.n_tokens());
        CONDUIT_REQUIRE(i == 0 || keep[i] > keep[i - 1], "keep_slots must be strictly increasing (slot %d after %d)",
                        keep[i], keep[i - 1]);
    }
    if (m == t.n_tokens()) return;
    std::vector<int32_t> fresh = seq->arena->take_blocks(compact_need(seq->arena, t, keep, m));
    compact_layer(seq, t, keep, m, fresh, stream);
}

void seq_write_kv(conduit_seq *seq, int32_t layer, int32_t n, const void *k, const void *v, const int32_t *slots,
                  const int32_t *rope_pos, void *stream) {
    LayerTable &t = layer_of(seq, layer);
    if (n == 0) return;
    CONDUIT_REQUIRE(k && v, "k and v must not be NULL");
    conduit_arena *arena = seq->arena;
    const kernels::Rope rope = arena->rope_for(rope_pos);
    const int32_t n_tokens = prepare_write(seq, layer, 1, n, slots, stream);
    const kernels::Slots dst_slots = slots ? kernels::Slots{arena->upload_ints({{slots, n}}, 0, nullptr, stream)[0], 0}
                                           : kernels::Slots{nullptr, n_tokens - n};
    arena->device.write_dense(arena->view(t, stream), dst_slots, n, k, v, rope, rope_pos, stream);
}

void seq_restore_images(conduit_seq *seq, int32_t first_layer, int32_t n_layers,
                        const std::vector<const ImageEntry *> &images, const int32_t *slots, const int32_t *rope_pos,
                        void *stream) {
    conduit_arena *arena = seq->arena;
    const int32_t bs = arena->params.block_size;
    const int32_t total_layers = int32_t(seq->layers.size());
    CONDUIT_REQUIRE(first_layer >= 0 && n_layers >= 0 && first_layer <= total_layers - n_layers,
                    "layers [%d, %d + %d) out of range [0, %d)", first_layer, first_layer, n_layers, total_layers);
    int64_t n_total = 0;
    for (const ImageEntry *image : images) {
        CONDUIT_REQUIRE(image != nullptr, "an image entry is NULL");
        n_total += image->n_tokens;
    }
    CONDUIT_REQUIRE(n_total <= INT32_MAX, "%lld tokens in one restore", (long long)n_total);
    const int32_t n = int32_t(n_total);
    if (n == 0 || n_layers == 0) return;
    const kernels::Rope rope = arena->rope_for(rope_pos);
    const int32_t n_tokens = prepare_write(seq, first_layer, n_layers, n, slots, stream); // checks, copy-on-write

    // Source: the entries' block tables side by side, one row per layer. Entry m starts at a block
    // boundary (block offset first_block[m]), so token i of it is "virtual slot" first_block[m] * bs + i.
    std::vector<int32_t> virtual_slots;
    virtual_slots.reserve(size_t(n));
    int64_t src_stride = 0;
    for (const ImageEntry *image : images) {
        for (int32_t i = 0; i < image->n_tokens; ++i) virtual_slots.push_back(int32_t(src_stride * bs + i));
        src_stride += blocks_for(image->n_tokens, bs);
    }
    std::vector<int32_t> src_tables(size_t(n_layers * src_stride));
    int64_t dst_stride = 0;
    for (int32_t j = 0; j < n_layers; ++j) {
        auto out = src_tables.begin() + j * src_stride;
        for (const ImageEntry *image : images) {
            const auto &blocks = image->layers[size_t(first_layer + j)]->blocks.host();
            out = std::copy(blocks.begin(), blocks.begin() + blocks_for(image->n_tokens, bs), out);
        }
        dst_stride = std::max<int64_t>(dst_stride, int64_t(seq->layers[size_t(first_layer + j)]->blocks.host().size()));
    }
    // Destination: the layers' block tables, one row per layer (padding is never read).
    std::vector<int32_t> dst_tables(size_t(n_layers * dst_stride), 0);
    for (int32_t j = 0; j < n_layers; ++j) {
        const auto &blocks = seq->layers[size_t(first_layer + j)]->blocks.host();
        std::copy(blocks.begin(), blocks.end(), dst_tables.begin() + j * dst_stride);
    }
    const auto lists = arena->upload_ints({{src_tables.data(), int32_t(src_tables.size())},
                                           {virtual_slots.data(), n},
                                           {dst_tables.data(), int32_t(dst_tables.size())},
                                           {slots, n}},
                                          0, nullptr, stream);
    kernels::LayerView src;
    src.pool = arena->pool_memory;
    src.n_tokens = n;
    src.n_kv_heads = arena->params.n_kv_heads;
    src.head_dim = arena->params.head_dim;
    src.block_size = bs;
    src.dtype = kernels::DType(arena->params.dtype);
    src.fp8 = arena->params.kv_format == CONDUIT_KV_FP8_E4M3;
    kernels::LayerView dst = src;
    src.block_table = lists[0];
    dst.block_table = lists[2];
    const kernels::Slots dst_slots = slots ? kernels::Slots{lists[3], 0} : kernels::Slots{nullptr, n_tokens - n};
    arena->device.copy_paged_layers(src, kernels::Slots{lists[1], 0}, src_stride, dst, dst_slots, dst_stride, n_layers,
                                    n, rope, rope_pos, stream);
}

void seq_attention(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                   float scale, void *out, float *lse, void *stream) {
    LayerTable &t = layer_of(seq, layer);
    CONDUIT_REQUIRE(n_q >= 0, "n_q = %d", n_q);
    seq->arena->require_query_heads(n_heads);
    if (n_q == 0) return;
    CONDUIT_REQUIRE(q && q_pos && out, "q, q_pos and out must not be NULL");
    seq->arena->device.attention(seq->arena->view(t, stream), n_q, n_heads, q, q_pos, scale, out, lse, stream);
}

void seq_attention_stats(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads, const void *q,
                         const int32_t *q_pos, float scale, float threshold, float *mass, float *n_below, float *lse,
                         void *stream) {
    LayerTable &t = layer_of(seq, layer);
    CONDUIT_REQUIRE(n_q >= 0, "n_q = %d", n_q);
    seq->arena->require_query_heads(n_heads);
    CONDUIT_REQUIRE(threshold >= 0.0f && threshold <= 1.0f, "threshold = %g outside [0, 1]", double(threshold));
    CONDUIT_REQUIRE(mass || t.n_tokens() == 0, "mass must not be NULL");
    CONDUIT_REQUIRE(n_q == 0 || (q && q_pos), "q and q_pos must not be NULL");
    seq->arena->device.attention_stats(seq->arena->view(t, stream), n_q, n_heads, q, q_pos, scale, threshold, mass,
                                       n_below, lse, stream);
}

void seq_attention_mass(conduit_seq *seq, int32_t n_layers, const int32_t *layers, int32_t n_q, int32_t n_heads,
                        const void *q, const int32_t *q_pos, float scale, const float *lse, float *mass, void *stream) {
    const conduit_arena_params &params = seq->arena->params;
    CONDUIT_REQUIRE(n_layers >= 0 && n_q >= 0, "n_layers = %d, n_q = %d", n_layers, n_q);
    seq->arena->require_query_heads(n_heads);
    if (n_layers == 0) return;
    CONDUIT_REQUIRE(layers, "layers must not be NULL");
    const int32_t n_tokens = layer_of(seq, layers[0]).n_tokens();
    for (int32_t i = 1; i < n_layers; ++i) {  // one table of n_layers rows: every row as long
        const int32_t n = layer_of(seq, layers[i]).n_tokens();
        CONDUIT_REQUIRE(n == n_tokens, "layer %d holds %d tokens and layer %d holds %d: the mass table needs equal lengths",
                        layers[i], n, layers[0], n_tokens);
    }
    CONDUIT_REQUIRE(mass || n_tokens == 0, "mass must not be NULL");
    CONDUIT_REQUIRE(n_q == 0 || (q && q_pos && lse), "q, q_pos and lse must not be NULL");
    const int64_t rows = int64_t(n_q) * n_heads;
    const size_t q_bytes = size_t(rows) * size_t(params.head_dim) * conduit_dtype_size(params.dtype);
    for (int32_t i = 0; i < n_layers; ++i)
        seq->arena->device.attention_mass(seq->arena->view(layer_of(seq, layers[i]), stream), n_q, n_heads,
                                          static_cast<const char *>(q) + size_t(i) * q_bytes, q_pos, scale,
                                          lse + i * rows, mass + int64_t(i) * n_tokens, stream);
}

void seq_read_kv(conduit_seq *seq, int32_t layer, void *k_out, void *v_out, void *stream) {
    LayerTable &t = layer_of(seq, layer);
    if (t.n_tokens() == 0 || (!k_out && !v_out)) return;
    seq->arena->device.read_dense(seq->arena->view(t, stream), k_out, v_out, stream);
}

size_t seq_bytes(const conduit_seq *seq) {
    size_t n = 0;
    for (auto &layer : seq->layers) n += layer->blocks.host().size();
    return n * seq->arena->block_bytes;
}

} // namespace conduit
