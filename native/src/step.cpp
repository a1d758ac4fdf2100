// step.cpp: decode steps over a batch of sequences, with their device state at fixed addresses.
#include "step.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "error.h"
#include "sequence.h"

using namespace conduit;

int64_t conduit_step::tables_ints() const {
    return int64_t(arena->params.n_layers) * max_seqs * table_stride;
}

kernels::BatchView conduit_step::layer_view(int32_t layer) const {
    const conduit_arena_params &p = arena->params;
    kernels::BatchView v;
    v.pool = arena->pool_memory;
    v.block_tables = state + int64_t(layer) * max_seqs * table_stride;
    v.n_tokens = state + tables_ints() + int64_t(layer) * max_seqs;
    v.table_stride = table_stride;
    v.n_seqs = n_seqs;
    v.max_tokens = max_tokens;
    v.n_kv_heads = p.n_kv_heads;
    v.head_dim = p.head_dim;
    v.block_size = p.block_size;
    v.dtype = kernels::DType(p.dtype);
    v.fp8 = p.kv_format == CONDUIT_KV_FP8_E4M3;
    return v;
}

namespace conduit {
namespace {

// Appends to `pairs` an (index, value) patch for each entry of `want` that differs from the mirror at
// `offset`. Rows are compared with memcmp first: most are unchanged.
void diff_into(const std::vector<int32_t> &mirror, int64_t offset, const int32_t *want, size_t n,
               std::vector<int32_t> &pairs) {
    const int32_t *have = mirror.data() + offset;
    if (n == 0 || std::memcmp(have, want, n * sizeof(int32_t)) == 0) return;
    for (size_t j = size_t(std::mismatch(have, have + n, want).first - have); j < n; ++j) {
        if (have[j] == want[j]) continue;
        pairs.push_back(int32_t(offset + int64_t(j)));
        pairs.push_back(want[j]);
    }
}

// The checks every step kernel shares: a layer of the arena, and a prepared step whose sequences are
// alive and unchanged since (a freed sequence's blocks may belong to another one by now). A freed
// sequence is found by its absence from the arena: the pointer is compared, never read.
void require_prepared(const conduit_step *step, int32_t layer) {
    const conduit_arena *arena = step->arena;
    const int32_t n_layers = arena->params.n_layers;
    CONDUIT_REQUIRE(layer >= 0 && layer < n_layers, "layer %d out of range [0, %d)", layer, n_layers);
    CONDUIT_REQUIRE(step->n_seqs > 0, "the step was not prepared (call conduit_step_prepare first)");
    for (size_t i = 0; i < step->prepared.size(); ++i) {
        const conduit_seq *seq = step->prepared[i].first;
        const bool alive = arena->seqs.count(const_cast<conduit_seq *>(seq)) != 0;
        const bool unchanged = alive && seq->version == step->prepared[i].second;
        CONDUIT_REQUIRE(unchanged,
                        "sequence %zu of the step was freed or changed since conduit_step_prepare (call it again)", i);
    }
}

} // namespace

conduit_step *step_create(conduit_arena *arena, int32_t max_seqs, int32_t max_tokens, int32_t n_heads, void *stream) {
    const conduit_arena_params &p = arena->params;
    CONDUIT_REQUIRE(max_seqs >= 1 && max_seqs <= 4096, "max_seqs = %d out of range [1, 4096]", max_seqs);
    CONDUIT_REQUIRE(max_tokens >= 1, "max_tokens = %d must be >= 1", max_tokens);
    arena->require_query_heads(n_heads);
    auto step = std::make_unique<conduit_step>();
    step->arena = arena;
    step->max_seqs = max_seqs;
    step->max_tokens = max_tokens;
    step->n_heads = n_heads;
    step->table_stride = int32_t((int64_t(max_tokens) + p.block_size - 1) / p.block_size); // no int32 overflow
    const int64_t total = step->tables_ints() + int64_t(p.n_layers) * max_seqs;
    CONDUIT_REQUIRE(total < INT32_MAX, "a step of %d sequences x %d tokens x %d layers is too large", max_seqs,
                    max_tokens, p.n_layers);
    step->mirror.assign(size_t(total), 0);
    step->prepared.reserve(size_t(max_seqs)); // a prepare allocates nothing once its sequences changed
    // The split plan of fewer sequences has more splits: size the workspace for the largest need.
    kernels::BatchView shape = step->layer_view(0);
    for (int32_t n = 1; n <= max_seqs; ++n) {
        shape.n_seqs = n;
        step->workspace_bytes = std::max(step->workspace_bytes, arena->device.batch_attention_workspace_bytes(shape, n_heads));
    }
    step->state = static_cast<int32_t *>(arena->device.alloc(size_t(total) * sizeof(int32_t)));
    try {
        step->workspace = step->workspace_bytes ? arena->device.alloc(step->workspace_bytes) : nullptr;
        arena->device.zero(step->workspace, step->workspace_bytes, stream); // its counters: every launch leaves them zero
        arena->device.upload(step->state, step->mirror.data(), size_t(total) * sizeof(int32_t), stream);
    } catch (...) {
        arena->device.free(step->workspace);
        arena->device.free(step->state);
        throw;
    }
    conduit_step *raw = step.release();
    arena->steps.insert(raw);
    return raw;
}

void step_free(conduit_step *step) {
    conduit_arena *arena = step->arena;
    arena->device.free(step->workspace);
    arena->device.free(step->state);
    arena->steps.erase(step);
    delete step;
}

void step_prepare(conduit_step *step, int32_t n_seqs, conduit_seq *const *seqs, const conduit_pos *positions,
                  void *stream) {
    CONDUIT_REQUIRE(n_seqs >= 1 && n_seqs <= step->max_seqs, "n_seqs = %d out of range [1, %d]", n_seqs,
                    step->max_seqs);
    CONDUIT_REQUIRE(seqs && positions, "seqs and positions must not be NULL");
    std::set<const conduit_seq *> distinct;
    for (int32_t i = 0; i < n_seqs; ++i) {
        CONDUIT_REQUIRE(seqs[i] != nullptr, "sequence %d is NULL", i);
        CONDUIT_REQUIRE(seqs[i]->arena == step->arena, "sequence %d belongs to another arena", i);
        CONDUIT_REQUIRE(distinct.insert(seqs[i]).second, "sequence %d is given twice", i);
    }
    // Nothing may fail once the sequences changed: reserve the upload of the largest patch list first
    // (every block of every table, one more for this token, and every length).
    const int32_t n_layers = step->arena->params.n_layers;
    size_t most_pairs = 0;
    for (int32_t i = 0; i < n_seqs; ++i)
        for (const auto &layer : seqs[i]->layers) most_pairs += layer->blocks.host().size() + 2;
    step->arena->reserve_upload({int64_t(2 * most_pairs)});
    seqs_append_step(seqs, positions, n_seqs, step->max_tokens, stream);

    // Patch the device mirror: the rows that changed (a new block, a copy-on-write, a compaction
    // between steps) and every length.
    std::vector<int32_t> pairs;
    for (int32_t l = 0; l < n_layers; ++l) {
        for (int32_t i = 0; i < n_seqs; ++i) {
            const LayerTable &t = *seqs[i]->layers[size_t(l)];
            const int64_t row = (int64_t(l) * step->max_seqs + i) * step->table_stride;
            diff_into(step->mirror, row, t.blocks.host().data(), t.blocks.host().size(), pairs);
            const int32_t length = t.n_tokens();
            diff_into(step->mirror, step->tables_ints() + int64_t(l) * step->max_seqs + i, &length, 1, pairs);
        }
    }
    if (!pairs.empty()) {
        const int32_t n_pairs = int32_t(pairs.size() / 2);
        const int32_t *device_pairs = step->arena->upload_ints({{pairs.data(), int32_t(pairs.size())}}, 0, nullptr,
                                                               stream)[0];
        step->arena->device.scatter_ints(step->state, device_pairs, n_pairs, stream);
        for (size_t j = 0; j < pairs.size(); j += 2) step->mirror[size_t(pairs[j])] = pairs[j + 1];
    }
    step->n_seqs = n_seqs;
    step->prepared.clear();
    for (int32_t i = 0; i < n_seqs; ++i) step->prepared.emplace_back(seqs[i], seqs[i]->version);
}

void step_write_kv(conduit_step *step, int32_t layer, const void *k, const void *v, const int32_t *rope_pos,
                   void *stream) {
    conduit_arena *arena = step->arena;
    require_prepared(step, layer);
    CONDUIT_REQUIRE(k && v, "k and v must not be NULL");
    arena->device.write_last(step->layer_view(layer), k, v, arena->rope_for(rope_pos), rope_pos, stream);
}

void step_attention(conduit_step *step, int32_t layer, const void *q, float scale, void *out, float *lse,
                    void *stream) {
    conduit_arena *arena = step->arena;
    require_prepared(step, layer);
    CONDUIT_REQUIRE(q && out, "q and out must not be NULL");
    arena->device.batch_attention(step->layer_view(layer), step->n_heads, q, scale, out, lse, step->workspace,
                                  step->workspace_bytes, stream);
}

void step_write_kv_attention(conduit_step *step, int32_t layer, const void *k, const void *v, const int32_t *rope_pos,
                             const void *q, float scale, void *out, float *lse, void *stream) {
    conduit_arena *arena = step->arena;
    require_prepared(step, layer);
    CONDUIT_REQUIRE(k && v, "k and v must not be NULL");
    CONDUIT_REQUIRE(q && out, "q and out must not be NULL");
    arena->device.batch_write_attention(step->layer_view(layer), k, v, arena->rope_for(rope_pos), rope_pos,
                                        step->n_heads, q, scale, out, lse, step->workspace, step->workspace_bytes,
                                        stream);
}

} // namespace conduit
