// step.h: decode steps over a batch of sequences (see conduit.h, "Decode steps").
//
// A step mirrors, at fixed device addresses, what its kernels need to know about the sequences:
// per layer, each sequence's length and block table. prepare() appends the new tokens on the host
// and patches the mirror in place (one upload and one scatter launch); write_kv() and attention()
// then launch kernels that read only the mirror, so a CUDA graph that captured them stays valid.
#pragma once

#include <vector>

#include "arena.h"

struct conduit_step {
    conduit_arena *arena = nullptr;
    int32_t max_seqs = 0, max_tokens = 0, n_heads = 0;
    int32_t table_stride = 0; // ints per block-table row: ceil(max_tokens / block_size)
    int32_t n_seqs = 0;       // sequences of the last prepare (0: not prepared yet)
    // The sequences of the last prepare and their versions then (conduit_seq::version): the kernels
    // read block tables uploaded by that prepare, so they refuse to run once one of those sequences
    // was freed or its tables changed.
    std::vector<std::pair<const conduit_seq *, uint64_t>> prepared;
    // Device: block tables [n_layers, max_seqs, table_stride], then lengths [n_layers, max_seqs].
    int32_t *state = nullptr;
    std::vector<int32_t> mirror; // what `state` holds on the device, to upload only what changed
    void *workspace = nullptr;   // device: split partials and arrival counters of batch attention (zeroed once)
    size_t workspace_bytes = 0;

    int64_t tables_ints() const;
    conduit::kernels::BatchView layer_view(int32_t layer) const;
};

namespace conduit {

conduit_step *step_create(conduit_arena *arena, int32_t max_seqs, int32_t max_tokens, int32_t n_heads, void *stream);
void step_free(conduit_step *step);
void step_prepare(conduit_step *step, int32_t n_seqs, conduit_seq *const *seqs, const conduit_pos *positions,
                  void *stream);
void step_write_kv(conduit_step *step, int32_t layer, const void *k, const void *v, const int32_t *rope_pos,
                   void *stream);
void step_attention(conduit_step *step, int32_t layer, const void *q, float scale, void *out, float *lse, void *stream);
void step_write_kv_attention(conduit_step *step, int32_t layer, const void *k, const void *v, const int32_t *rope_pos,
                             const void *q, float scale, void *out, float *lse, void *stream);

} // namespace conduit
