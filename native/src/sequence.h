// sequence.h: operations on sequences (see conduit.h for their contracts). Each throws
// conduit::Error before changing anything when an argument is bad or the arena is full.
#pragma once

#include "arena.h"

namespace conduit {

// Gives the sequence a new version (conduit_seq::version): called by every operation that changes
// one of its block tables or lengths.
void mark_changed(conduit_seq *seq);
conduit_seq *seq_create(conduit_arena *arena);
void seq_free(conduit_seq *seq);
conduit_seq *seq_fork(conduit_seq *seq, void *stream);
void seq_append(conduit_seq *seq, const conduit_pos *positions, int32_t n);
// Appends one token to each of n sequences (positions[i] to seqs[i], every layer), each new slot in a
// block the sequence owns alone, so that a decode step can write it without copy-on-write. Checks
// that every layer stays within max_tokens and that each position comes after every stored one.
// All or nothing: on error no sequence changed.
void seqs_append_step(conduit_seq *const *seqs, const conduit_pos *positions, int32_t n, int32_t max_tokens,
                      void *stream);
void seq_truncate(conduit_seq *seq, conduit_pos p0, conduit_pos p1, void *stream);
void seq_compact(conduit_seq *seq, int32_t layer, const int32_t *keep, int32_t n_keep, void *stream);
void seq_write_kv(conduit_seq *seq, int32_t layer, int32_t n, const void *k, const void *v, const int32_t *slots,
                  const int32_t *rope_pos, void *stream);
// Restores layers [first_layer, first_layer + n_layers) of the entries, concatenated, in one launch.
void seq_restore_images(conduit_seq *seq, int32_t first_layer, int32_t n_layers,
                        const std::vector<const ImageEntry *> &images, const int32_t *slots, const int32_t *rope_pos,
                        void *stream);
void seq_attention(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos,
                   float scale, void *out, float *lse, void *stream);
void seq_attention_stats(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads, const void *q,
                         const int32_t *q_pos, float scale, float threshold, float *mass, float *n_below, float *lse,
                         void *stream);
// Checks every layer before the first launch: an error leaves the mass table untouched.
void seq_attention_mass(conduit_seq *seq, int32_t n_layers, const int32_t *layers, int32_t n_q, int32_t n_heads,
                        const void *q, const int32_t *q_pos, float scale, const float *lse, float *mass, void *stream);
void seq_read_kv(conduit_seq *seq, int32_t layer, void *k_out, void *v_out, void *stream);
size_t seq_bytes(const conduit_seq *seq);

} // namespace conduit
