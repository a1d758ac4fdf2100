/*
 * conduit.h: the C ABI of conduit-rt's native runtime.
 *
 * The native library owns the KV cache of a vision-language model: a fixed pool of blocks (the
 * arena), sequences that map their tokens onto blocks through per-layer block tables, and an
 * image-KV store that keeps pre-RoPE K and V of images under an LRU byte budget. It runs the
 * kernels that read and write that memory on a CPU backend (always built) or a CUDA backend.
 *
 * Conventions, once for the whole header:
 *  - Every name starts with conduit_ / CONDUIT_; handles are opaque; objects are named first
 *    (conduit_arena_*, conduit_seq_*, conduit_image_*).
 *  - Functions that can fail return conduit_status. On failure the thread-local message from
 *    conduit_last_error() says why, and, unless a function says otherwise, the objects it was
 *    given are left exactly as they were. No C++ exception and no abort ever crosses this ABI.
 *  - Recoverable statuses are > 0 (the call failed, nothing changed, carry on); fatal statuses are
 *    < 0 (the device is in an unknown state: free the arena and start again). ARENA_FULL is
 *    decided before anything is evicted: a call that fails with it keeps every image entry.
 *  - An enum argument (or field) outside its enumerators is INVALID_ARGUMENT, never undefined
 *    behaviour: the library reads it as an integer before it uses it.
 *  - A handle must not be used after it was freed (or its arena was): the library cannot tell a
 *    freed pointer from a live one. conduit_rt's Python objects refuse such use themselves.
 *  - "Device memory" means memory on the arena's backend: host memory for the CPU backend, CUDA
 *    device memory (of params.device) for the CUDA backend. Metadata (positions given to
 *    conduit_seq_append, slot lists given to compaction, keys) is always host memory.
 *  - Tensors are raw pointers to contiguous row-major data. Shapes are written [dim0, dim1, ...].
 *    K, V, Q and attention outputs have the arena's dtype; log-sum-exp outputs are float32;
 *    positions and slots are int32.
 *  - Slot lists are host memory (checked before any work is enqueued); RoPE positions and query
 *    positions are device memory (they come from the model's forward pass).
 *  - `stream` is a cudaStream_t for the CUDA backend (NULL: the legacy default stream) and is
 *    ignored by the CPU backend. Kernels are enqueued on it; the caller synchronizes. Use one stream
 *    for all calls on one arena: the arena reuses its scratch and table memory in stream order.
 *  - A "slot" is the index of a token within one layer of a sequence, in [0, n_tokens(layer)).
 *    Slots are dense and ordered by insertion; compaction renumbers them. A token's "position" is
 *    its causal position, stored per slot: a key is visible to a query when key_pos <= query_pos.
 *    RoPE positions are separate (M-RoPE gives image tokens 3-D positions that are not causal).
 *  - Ranges are half-open: positions in [p0, p1).
 *  - An arena and everything made from it must be used from one thread at a time.
 */
#ifndef CONDUIT_H
#define CONDUIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CONDUIT_API __declspec(dllexport)
#else
#define CONDUIT_API __attribute__((visibility("default")))
#endif

/* ============================================================================================ */
/* Types                                                                                        */
/* ============================================================================================ */

typedef int32_t conduit_pos;    /* a causal position */
typedef int32_t conduit_status; /* one of conduit_status_code */

enum conduit_status_code {
    CONDUIT_OK = 0,
    /* recoverable: nothing changed */
    CONDUIT_ERR_INVALID_ARGUMENT = 1, /* null handle, bad shape, out-of-range slot or layer, ... */
    CONDUIT_ERR_ARENA_FULL = 2,       /* no free block left after evicting unused image entries */
    CONDUIT_ERR_NOT_FOUND = 3,        /* no committed image entry under that key */
    CONDUIT_ERR_EXISTS = 4,           /* an image entry under that key already exists */
    CONDUIT_ERR_UNSUPPORTED = 5,      /* backend not compiled in, or no device present */
    CONDUIT_ERR_OUT_OF_MEMORY = 6,    /* a host or device allocation failed */
    CONDUIT_ERR_IN_USE = 7,           /* the object is referenced and cannot be removed */
    /* fatal: the backend is in an unknown state */
    CONDUIT_ERR_DEVICE = -1,          /* a CUDA call failed (the message names it) */
    CONDUIT_ERR_INTERNAL = -2,        /* a broken invariant: a bug, please report it */
};

typedef enum conduit_dtype {
    CONDUIT_DTYPE_F32 = 0,
    CONDUIT_DTYPE_F16 = 1,
    CONDUIT_DTYPE_BF16 = 2,
} conduit_dtype;

/* How the pool stores K and V (conduit_arena_params.kv_format). */
typedef enum conduit_kv_format {
    CONDUIT_KV_DENSE = 0,    /* elements of the arena dtype */
    CONDUIT_KV_FP8_E4M3 = 1, /* e4m3 bytes with a float32 scale per (token, KV head) row of K and of V:
                                about half the bytes of bf16; values are byte * scale (see the block
                                layout at conduit_arena_params) */
} conduit_kv_format;

typedef enum conduit_backend {
    CONDUIT_BACKEND_CPU = 0,
    CONDUIT_BACKEND_CUDA = 1,
} conduit_backend;

typedef enum conduit_rope_type {
    CONDUIT_ROPE_NONE = 0,  /* K is written as given */
    CONDUIT_ROPE_NEOX = 1,  /* rotate-half RoPE (Llama, Qwen): pairs (i, i + rot_dim/2) */
    CONDUIT_ROPE_MROPE = 2, /* rotate-half with 3 position sections (Qwen2-VL): t, h, w */
} conduit_rope_type;

typedef enum conduit_log_level {
    CONDUIT_LOG_DEBUG = 0,
    CONDUIT_LOG_INFO = 1,
    CONDUIT_LOG_WARN = 2,
    CONDUIT_LOG_ERROR = 3,
} conduit_log_level;

typedef struct conduit_arena conduit_arena; /* the block pool, its sequences and image store */
typedef struct conduit_seq conduit_seq;     /* one sequence: per-layer block tables */
typedef struct conduit_image conduit_image; /* a reference to one image-KV entry */
typedef struct conduit_step conduit_step;   /* a decode step over a batch of sequences */

/* Called for every log line. `msg` is valid during the call only. May be called from any thread
 * that calls into the library. */
typedef void (*conduit_log_fn)(int32_t level, const char *msg, void *user_data);

/* ============================================================================================ */
/* Library                                                                                      */
/* ============================================================================================ */

/* The library's version as "MAJOR.MINOR.PATCH". Static storage; never free it. */
CONDUIT_API const char *conduit_version(void);

/* 1 if the backend was compiled into this library, else 0. */
CONDUIT_API int32_t conduit_backend_compiled(conduit_backend backend);

/* 1 if the backend is compiled in and usable now (for CUDA: a driver and at least one device),
 * else 0. Never fails; a library built with CUDA answers 0 for CUDA on a machine without a GPU
 * and keeps serving the CPU backend. */
CONDUIT_API int32_t conduit_backend_available(conduit_backend backend);

/* The message of the last failed call on this thread ("" if none). Thread-local storage, valid
 * until this thread's next call into the library. */
CONDUIT_API const char *conduit_last_error(void);

/* A constant name for a status ("CONDUIT_ERR_ARENA_FULL"). Never NULL. */
CONDUIT_API const char *conduit_status_name(conduit_status status);

/* 1 if the status is fatal (< 0), else 0. */
CONDUIT_API int32_t conduit_status_is_fatal(conduit_status status);

/* Bytes of one element of the dtype, 0 for an unknown dtype. */
CONDUIT_API size_t conduit_dtype_size(conduit_dtype dtype);

/* Installs the log callback for the whole process (NULL restores the default: WARN and above to
 * stderr). Lines below `min_level` are not formatted. */
CONDUIT_API void conduit_set_log_callback(conduit_log_fn fn, void *user_data, int32_t min_level);

/* ============================================================================================ */
/* Arena                                                                                        */
/* ============================================================================================ */

/* Launch choices of the CUDA kernels, carried by the arena (conduit_arena_params.tuning), for a GPU
 * where a default is not the fastest (the defaults follow the device's SM count and occupancy;
 * measure before changing one). A field's 0 selects its default; the CPU backend ignores them. Any
 * value gives the same results up to float rounding (another key split sums its partials in another
 * order). Both fields shape conduit_seq_attention's many-query tensor-core path: bf16/f16 layers,
 * head_dim 64 or 128, 16 or more queries (or 64 or more query rows counting GQA heads). */
typedef struct conduit_tuning {
    int32_t mma_warps;       /* warps per CTA, 4 or 8 (0: 8 while 8-warp CTAs fill every SM twice, else 4) */
    int32_t mma_split_waves; /* waves of resident CTAs that its key splits fill when its unsplit CTAs
                                leave SMs idle, 1..8 (0: 1) */
} conduit_tuning;

/* Block layout, per block and per layer-slot of it: K [n_kv_heads, block_size, head_dim] then V of
 * the same shape, in the arena dtype. One block holds block_size tokens of ONE layer of one
 * sequence or image entry, so a layer's keys of one KV head lie in contiguous runs of
 * block_size * head_dim elements: a decode kernel streams them with 16-byte loads.
 *
 * With kv_format CONDUIT_KV_FP8_E4M3, K and V are e4m3 bytes in the same order, followed in the block
 * by float32 scales [n_kv_heads, block_size] for K, then for V. A row's scale is the smallest power
 * of two s with max |row| <= 448 s (NaN for a row holding NaN or inf), so dequantized values are exact
 * in the arena dtype. Every function keeps its dense arguments in the arena dtype: K and V are
 * quantized as they are written (after RoPE) and dequantized where they are read; a restore with
 * RoPE dequantizes, rotates and quantizes again, a copy without RoPE keeps the values exactly. */
typedef struct conduit_arena_params {
    conduit_backend backend;  /* CPU or CUDA */
    int32_t device;           /* CUDA device ordinal (ignored for CPU) */
    conduit_dtype dtype;      /* element type of K and V as every function takes and returns them, of
                                 queries and outputs, and of the pool unless kv_format says otherwise */
    int32_t n_layers;         /* decoder layers, >= 1 */
    int32_t n_kv_heads;       /* KV heads per layer, >= 1 */
    int32_t head_dim;         /* elements per head, a multiple of 8 in [8, 256] */
    int32_t block_size;       /* tokens per block, a power of two in [1, 256] */
    size_t kv_bytes;          /* bytes of the block pool; rounded down to whole blocks, >= 1 block */
    size_t image_cache_bytes; /* LRU budget of the image store (0: no image store) */
    conduit_tuning tuning;    /* CUDA launch choices (all 0: the defaults) */
    conduit_kv_format kv_format; /* how the pool stores K and V (CONDUIT_KV_DENSE or FP8_E4M3) */
} conduit_arena_params;

/* Defaults: CPU, device 0, F32, 1 layer, 1 KV head, head_dim 128, block_size 16, kv_bytes 64 MiB,
 * image_cache_bytes 0, tuning all 0, kv_format DENSE. */
CONDUIT_API conduit_arena_params conduit_arena_default_params(void);

/* Bytes of one block of an arena with these params (K, V and, for fp8, their scales); 0 for NULL.
 * The fields are not checked: use it on params that conduit_arena_create accepts. */
CONDUIT_API size_t conduit_block_bytes(const conduit_arena_params *params);

/* Creates an arena and allocates its whole pool at once. On success *out owns it; free it with
 * conduit_arena_free. Errors: INVALID_ARGUMENT (a field out of range, tuning's too), UNSUPPORTED (backend not
 * compiled or no device), OUT_OF_MEMORY. On error *out is set to NULL. */
CONDUIT_API conduit_status conduit_arena_create(const conduit_arena_params *params, conduit_arena **out);

/* Frees the arena, all of its sequences and image entries, and every handle made from it (those
 * handles must not be used afterwards). NULL is a no-op. */
CONDUIT_API void conduit_arena_free(conduit_arena *arena);

/* RoPE of the model, used by conduit_seq_write_kv and conduit_seq_restore_image when they are
 * given RoPE positions. inv_freq holds n_freq inverse frequencies (host float32, copied); the
 * first 2 * n_freq elements of each head are rotated as pairs (i, i + n_freq), the rest pass
 * through. For MROPE, sections[0..2] (summing to n_freq) say how many consecutive frequencies take
 * the t, h and w position. cos and sin are multiplied by attention_scaling (1 for plain RoPE). */
typedef struct conduit_rope_params {
    conduit_rope_type type;
    int32_t n_freq;          /* rotary pairs per head, in [1, head_dim / 2] */
    const float *inv_freq;   /* host, [n_freq] */
    int32_t sections[3];     /* MROPE only */
    float attention_scaling; /* multiplies cos and sin */
} conduit_rope_params;

/* Sets the arena's RoPE (replacing any earlier one). Errors: INVALID_ARGUMENT; the arena keeps
 * its previous RoPE on error. */
CONDUIT_API conduit_status conduit_arena_set_rope(conduit_arena *arena, const conduit_rope_params *rope);

/* Exact counts of an arena's pool, sequences and image store (conduit_arena_get_stats). */
typedef struct conduit_arena_stats {
    int64_t n_blocks_total;    /* blocks in the pool */
    int64_t n_blocks_free;     /* blocks on the free list */
    int64_t n_blocks_used;     /* n_blocks_total - n_blocks_free */
    int64_t n_blocks_shared;   /* used blocks referenced more than once (copy-on-write) */
    int64_t n_blocks_image;    /* blocks owned by image entries */
    int64_t n_seqs;            /* live sequences */
    int64_t n_image_entries;   /* committed and pending image entries */
    int64_t n_image_evictions; /* entries evicted since creation */
    size_t block_bytes;        /* bytes of one block (K and V of one layer) */
    size_t bytes_total;        /* n_blocks_total * block_bytes */
    size_t bytes_used;         /* n_blocks_used * block_bytes */
    size_t image_bytes;        /* bytes held by image entries */
} conduit_arena_stats;

/* Fills *out with exact counts. Errors: INVALID_ARGUMENT (null pointer). */
CONDUIT_API conduit_status conduit_arena_get_stats(const conduit_arena *arena, conduit_arena_stats *out);

/* Returns the params the arena was created with (kv_bytes rounded to whole blocks), or the defaults
 * for a NULL arena. */
CONDUIT_API conduit_arena_params conduit_arena_get_params(const conduit_arena *arena);

/* ============================================================================================ */
/* Sequences                                                                                    */
/* ============================================================================================ */

/* Creates an empty sequence (no tokens in any layer). Free it with conduit_seq_free. */
CONDUIT_API conduit_status conduit_seq_create(conduit_arena *arena, conduit_seq **out);

/* Frees the sequence and returns its unshared blocks to the pool. NULL is a no-op. */
CONDUIT_API void conduit_seq_free(conduit_seq *seq);

/* Creates *out as a copy of `seq` that shares its full blocks (copy-on-write): writing either
 * sequence later copies a shared block first, so the other never sees the write. Each layer's
 * last, partial block is copied at once. Errors: ARENA_FULL (not enough blocks for the partial
 * copies; *out is NULL and `seq` unchanged). */
CONDUIT_API conduit_status conduit_seq_fork(conduit_seq *seq, void *stream, conduit_seq **out);

/* Appends n tokens with the given causal positions (host int32 [n]) to EVERY layer: they take
 * slots [n_tokens(l), n_tokens(l) + n) of each layer l, with K and V not yet written (write them
 * with conduit_seq_write_kv or conduit_seq_restore_image before attending). Blocks are taken from
 * the pool, after evicting unreferenced image entries if needed. Errors: ARENA_FULL (then no layer
 * changed), INVALID_ARGUMENT. */
CONDUIT_API conduit_status conduit_seq_append(conduit_seq *seq, const conduit_pos *positions, int32_t n);

/* Tokens held by a layer, or -1 for a bad handle or layer. */
CONDUIT_API int32_t conduit_seq_n_tokens(const conduit_seq *seq, int32_t layer);

/* Tokens held by the sequence's longest layer (layers differ after compaction), or -1 for a bad
 * handle: one call where a decode loop would otherwise ask every layer. */
CONDUIT_API int32_t conduit_seq_max_tokens(const conduit_seq *seq);

/* Copies the causal positions of a layer's tokens, in slot order, into out (host int32 [cap]).
 * Errors: INVALID_ARGUMENT (cap < n_tokens(layer)). */
CONDUIT_API conduit_status conduit_seq_get_positions(const conduit_seq *seq, int32_t layer, conduit_pos *out, int32_t cap);

/* Removes from every layer the tokens whose position is in [p0, p1), keeps the others in order
 * and returns emptied blocks to the pool. Removing a tail never copies; removing from the middle
 * moves the later tokens down (on `stream`). A range that holds no stored position changes
 * nothing. Errors: INVALID_ARGUMENT (p0 > p1), ARENA_FULL (a shared block had to be copied and no
 * block was free); the sequence is unchanged on error. */
CONDUIT_API conduit_status conduit_seq_truncate(conduit_seq *seq, conduit_pos p0, conduit_pos p1, void *stream);

/* Keeps only the given slots of one layer (host int32 [n_keep], strictly increasing), in that
 * order, at their stored positions and with their K and V unchanged (RoPE already applied); frees
 * the blocks left empty. Needs ceil(n_keep / block_size) free blocks while it copies. Errors:
 * INVALID_ARGUMENT (unsorted, repeated or out-of-range slots), ARENA_FULL; the layer is unchanged
 * on error. */
CONDUIT_API conduit_status conduit_seq_compact(conduit_seq *seq, int32_t layer, const int32_t *keep_slots, int32_t n_keep, void *stream);

/* Bytes of the blocks this sequence references (shared blocks counted fully). */
CONDUIT_API size_t conduit_seq_bytes(const conduit_seq *seq);

/* ============================================================================================ */
/* Kernels over sequences                                                                       */
/* ============================================================================================ */

/* Writes K and V of n tokens into one layer. k, v: device [n, n_kv_heads, head_dim], arena dtype.
 * slots: HOST int32 [n], the destination slots (distinct, in range), or NULL for the layer's last n
 * slots (host so that the runtime can check them and resolve copy-on-write before launching).
 * rope_pos: device int32 RoPE positions, [n] for NEOX or [3, n] for MROPE (row 0: t, 1: h, 2: w),
 * or NULL to store K as given (no RoPE). A slot in a block shared with another sequence is copied
 * first. Errors: INVALID_ARGUMENT (bad layer or n > n_tokens, rope_pos given but no RoPE set),
 * ARENA_FULL (copy-on-write needed a block; nothing written). */
CONDUIT_API conduit_status conduit_seq_write_kv(conduit_seq *seq, int32_t layer, int32_t n, const void *k, const void *v,
                                                const int32_t *slots, const int32_t *rope_pos, void *stream);

/* Attention of n_q queries over every token of one layer, causal by position: query i sees the
 * keys whose stored position is <= q_pos[i]. q: device [n_q, n_heads, head_dim], arena dtype;
 * q_pos: device int32 [n_q]; n_heads a multiple of n_kv_heads (GQA: query head h reads KV head
 * h / (n_heads / n_kv_heads)); out: device [n_q, n_heads, head_dim], arena dtype; lse: device
 * float32 [n_q, n_heads], the natural-log log-sum-exp of the scaled scores, or NULL. A query that
 * sees no key gets out = 0 and lse = -inf. One entry point serves prefill chunks, scattered
 * recompute queries and single-token decode; the arena's tuning shapes the CUDA launch for many
 * queries (conduit_tuning). Errors: INVALID_ARGUMENT. */
CONDUIT_API conduit_status conduit_seq_attention(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads,
                                                 const void *q, const int32_t *q_pos, float scale, void *out, float *lse,
                                                 void *stream);

/* Attention statistics of n_q queries over one layer, without materialising the [n_q, n_tokens]
 * probabilities (the scoring pass of CONDUIT and VL-Cache). With p(q, h, s) the softmax probability
 * of slot s for query q and head h (causal by position, as conduit_seq_attention):
 *   mass[s]     = sum over q and h of p(q, h, s)                  device float32 [n_tokens(layer)]
 *   n_below[h]  = number of visible (q, s) with p(q, h, s) < threshold * max_s' p(q, h, s')
 *                                                                 device float32 [n_heads] (or NULL)
 *   lse[q, h]   = log-sum-exp of the scaled scores                device float32 [n_q, n_heads] (or NULL)
 * q: device [n_q, n_heads, head_dim], arena dtype; q_pos: device int32 [n_q]; threshold in [0, 1]
 * (VL-Cache uses 0.01). Outputs are overwritten, not accumulated. Errors: INVALID_ARGUMENT. */
CONDUIT_API conduit_status conduit_seq_attention_stats(conduit_seq *seq, int32_t layer, int32_t n_q, int32_t n_heads,
                                                       const void *q, const int32_t *q_pos, float scale, float threshold,
                                                       float *mass, float *n_below, float *lse, void *stream);

/* CONDUIT's scoring pass over several layers in one call, each query row's log-sum-exp given: per
 * chosen layer, the attention mass of n_q queries with the score pass that finds the normaliser
 * skipped (the keys are read once). For row i of the table, layer l = layers[i]:
 *   mass[i, s] = sum over q and h of exp(scale * q[i, q, h] . k_l(s) - lse[i, q, h])
 * over the slots s visible to q (position <= q_pos[q]; GQA as conduit_seq_attention). With the lse
 * that conduit_seq_attention returned for the same queries over the same KV (the text pass of a
 * CONDUIT request), every row's probabilities sum to 1 and the table equals conduit_seq_attention_stats'
 * mass to rounding. layers: host int32 [n_layers], every one holding the same number of tokens n; q:
 * device [n_layers, n_q, n_heads, head_dim], arena dtype; q_pos: device int32 [n_q], shared by the
 * layers; lse: device float32 [n_layers, n_q, n_heads], natural log; mass: device float32 [n_layers,
 * n], overwritten. Errors (before anything is launched): INVALID_ARGUMENT. */
CONDUIT_API conduit_status conduit_seq_attention_mass(conduit_seq *seq, int32_t n_layers, const int32_t *layers,
                                                      int32_t n_q, int32_t n_heads, const void *q,
                                                      const int32_t *q_pos, float scale, const float *lse, float *mass,
                                                      void *stream);

/* Copies one layer's K and V out, densely and in slot order: k_out, v_out: device
 * [n_tokens(layer), n_kv_heads, head_dim], arena dtype (either may be NULL). */
CONDUIT_API conduit_status conduit_seq_read_kv(const conduit_seq *seq, int32_t layer, void *k_out, void *v_out, void *stream);

/* ============================================================================================ */
/* Image-KV store                                                                               */
/* ============================================================================================ */

/* Entries hold pre-RoPE K and V of n_tokens image tokens for every layer, in blocks of the same
 * pool, under the arena's image_cache_bytes LRU budget. A conduit_image handle is a reference:
 * while any is held the entry is never evicted. Keys are 32 bytes (a sha256 digest). */

/* Creates a pending entry under `key` (host [32] bytes) for n_tokens tokens and returns a
 * reference to it. Evicts unreferenced entries, least recently used first, until the budget and
 * the pool allow it. The entry is invisible to conduit_image_acquire until committed.
 * Errors: EXISTS (an entry under the key exists), ARENA_FULL (the entry does not fit in the budget
 * or the pool even after eviction), INVALID_ARGUMENT. */
CONDUIT_API conduit_status conduit_image_create(conduit_arena *arena, const uint8_t *key, int32_t n_tokens, conduit_image **out);

/* Writes one layer of the entry: k, v device [n_tokens, n_kv_heads, head_dim], arena dtype, K
 * before RoPE. */
CONDUIT_API conduit_status conduit_image_write(conduit_image *image, int32_t layer, const void *k, const void *v, void *stream);

/* Makes a pending entry visible to conduit_image_acquire. Call after writing every layer. */
CONDUIT_API conduit_status conduit_image_commit(conduit_image *image);

/* Looks up a committed entry, marks it most recently used and returns a new reference.
 * Errors: NOT_FOUND (*out is NULL). */
CONDUIT_API conduit_status conduit_image_acquire(conduit_arena *arena, const uint8_t *key, conduit_image **out);

/* 1 if a committed entry exists under `key` (host [32] bytes), else 0 (also for NULL arguments).
 * Does not count as a use for the LRU order. */
CONDUIT_API int32_t conduit_image_contains(const conduit_arena *arena, const uint8_t *key);

/* Drops a reference. A pending entry whose last reference is dropped is discarded. NULL: no-op. */
CONDUIT_API void conduit_image_release(conduit_image *image);

/* Removes an unreferenced committed entry now. Errors: NOT_FOUND, IN_USE. */
CONDUIT_API conduit_status conduit_image_evict(conduit_arena *arena, const uint8_t *key);

/* Tokens of the entry, or -1 for a NULL handle. */
CONDUIT_API int32_t conduit_image_n_tokens(const conduit_image *image);

/* Copies one layer of the entry out: k_out, v_out device [n_tokens, n_kv_heads, head_dim] (either
 * may be NULL), K before RoPE. */
CONDUIT_API conduit_status conduit_image_read(const conduit_image *image, int32_t layer, void *k_out, void *v_out, void *stream);

/* Restores one layer of the entry into a sequence: token i of the entry goes to slots[i] (host
 * int32 [n_tokens], or NULL: the layer's last n_tokens slots), K rotated at rope_pos (device int32
 * [n_tokens] or [3, n_tokens], NULL: no RoPE) and V as is. Same errors as conduit_seq_write_kv;
 * the entry and the sequence must belong to the same arena. */
CONDUIT_API conduit_status conduit_seq_restore_image(conduit_seq *seq, int32_t layer, const conduit_image *image,
                                                     const int32_t *slots, const int32_t *rope_pos, void *stream);

/* Restores n_images entries into a sequence for layers [first_layer, first_layer + n_layers), with
 * one kernel launch for all of them (what conduit_seq_restore_image does for one entry and one layer,
 * batched: a request restoring 8 images into 32 layers makes one call instead of 256).
 * The entries' tokens are taken concatenated in the order of `images` (host array [n_images] of
 * handles; n = the sum of their n_tokens): token i of that concatenation goes to slots[i] (host
 * int32 [n], distinct, or NULL: the last n slots, which needs every layer of the range to hold the
 * same number of tokens) in EVERY layer of the range; K is rotated at rope_pos (device int32 [n]
 * or [3, n], concatenated in the same order; NULL: no RoPE), V is copied as is. The same entry may
 * appear twice (to different slots). A slot in a block shared with another sequence is copied
 * first. Every argument is checked and the blocks for copy-on-write are taken before anything is
 * written: on error the sequence is unchanged. n_images = 0 or n_layers = 0 is a no-op.
 * Errors: INVALID_ARGUMENT (null sequence or entry, an entry of another arena, layer range out of
 * [0, n_layers of the arena), n > n_tokens of a layer, bad or repeated slots, rope_pos given but no
 * RoPE set), ARENA_FULL (copy-on-write needed blocks). */
CONDUIT_API conduit_status conduit_seq_restore_images(conduit_seq *seq, int32_t first_layer, int32_t n_layers,
                                                      int32_t n_images, const conduit_image *const *images,
                                                      const int32_t *slots, const int32_t *rope_pos, void *stream);

/* ============================================================================================ */
/* Decode steps                                                                                 */
/* ============================================================================================ */

/* A decode step feeds one new token per sequence through the model, for a batch of up to max_seqs
 * sequences at once. What its kernels need to know about the sequences (per layer, each one's length
 * and block table) lives in device memory at fixed addresses, with the attention's split workspace:
 * conduit_step_prepare updates it in place on the host side, and conduit_step_write_kv,
 * conduit_step_attention and conduit_step_write_kv_attention only enqueue kernels that read it. A
 * CUDA graph that captured them (for every layer) therefore replays correctly at every later step,
 * as long as each replay follows a prepare with the same number of sequences. Between a prepare and
 * the kernels of its step, its sequences must not change: once one of them was freed or one of its
 * block tables or lengths changed (append, truncate, compact, fork, a write that copied a shared
 * block), the step's kernels refuse to run with INVALID_ARGUMENT, since the blocks they would write
 * may belong to another sequence by then (a replayed graph runs unchecked). One step:
 *   conduit_step_prepare(step, n, seqs, positions, stream);          host work, not captured
 *   for each layer: conduit_step_write_kv_attention(...);             capturable
 *     (or conduit_step_write_kv(...); conduit_step_attention(...);)
 * A step is owned by its arena: conduit_arena_free frees it too. */

/* Creates a step for batches of up to max_seqs sequences that hold up to max_tokens tokens per layer
 * (including the new token), with queries of n_heads heads. Allocates its device state (about
 * 4 * n_layers * max_seqs * max_tokens / block_size bytes, plus the split workspace) now, so that
 * the step kernels allocate nothing. Errors: INVALID_ARGUMENT (max_seqs outside [1, 4096],
 * max_tokens < 1, n_heads not a positive multiple of n_kv_heads), OUT_OF_MEMORY. *out is NULL on
 * error. */
CONDUIT_API conduit_status conduit_step_create(conduit_arena *arena, int32_t max_seqs, int32_t max_tokens,
                                               int32_t n_heads, void *stream, conduit_step **out);

/* Frees the step (not its sequences). NULL is a no-op. */
CONDUIT_API void conduit_step_free(conduit_step *step);

/* The host side of one step: appends a token at positions[i] (host int32 [n_seqs]) to every layer of
 * seqs[i] (host array [n_seqs] of distinct sequences of the step's arena), as conduit_seq_append
 * does, copying first any shared block the new slot lands in; then updates the step's device state
 * on `stream` (one small upload and one kernel). Each position must come after every position stored
 * in its sequence (the step's attention masks nothing), and every layer must stay within max_tokens.
 * Errors: INVALID_ARGUMENT (n_seqs outside [1, max_seqs], a NULL, repeated or foreign sequence, a
 * position not after the stored ones, capacity exceeded), ARENA_FULL; on error no sequence changed. */
CONDUIT_API conduit_status conduit_step_prepare(conduit_step *step, int32_t n_seqs, conduit_seq *const *seqs,
                                                const conduit_pos *positions, void *stream);

/* Writes the new tokens' K and V into one layer: k, v device [n_seqs, n_kv_heads, head_dim] (row i:
 * sequence i of the last prepare), arena dtype; K rotated at rope_pos (device int32 [n_seqs] for
 * NEOX, [3, n_seqs] for MROPE, or NULL: no RoPE). Enqueues one kernel; capturable. Errors:
 * INVALID_ARGUMENT (bad layer, not prepared, a sequence of the prepare freed or changed since, NULL
 * k or v, rope_pos without a RoPE set). */
CONDUIT_API conduit_status conduit_step_write_kv(conduit_step *step, int32_t layer, const void *k, const void *v,
                                                 const int32_t *rope_pos, void *stream);

/* Attention of the new tokens over one layer: q device [n_seqs, n_heads, head_dim], arena dtype (row
 * i: sequence i's query); each query sees every stored token of its own sequence, the new one
 * included. out: device [n_seqs, n_heads, head_dim], arena dtype; lse: device float32 [n_seqs,
 * n_heads] (natural log) or NULL. The kernel grid depends on the batch size and max_tokens only.
 * Enqueues one or two kernels (the second merges the key splits); capturable. Errors:
 * INVALID_ARGUMENT (bad layer, not prepared, a sequence of the prepare freed or changed since, NULL
 * q or out). */
CONDUIT_API conduit_status conduit_step_attention(conduit_step *step, int32_t layer, const void *q, float scale,
                                                  void *out, float *lse, void *stream);

/* conduit_step_write_kv(step, layer, k, v, rope_pos) then conduit_step_attention(step, layer, q, scale,
 * out, lse), with the same arguments and the same results to the bit, in fewer kernels: on CUDA the
 * attention writes the new rows itself before it reads them, one kernel less per layer on the step's
 * critical path. Capturable. Errors: those of the two. */
CONDUIT_API conduit_status conduit_step_write_kv_attention(conduit_step *step, int32_t layer, const void *k,
                                                           const void *v, const int32_t *rope_pos, const void *q,
                                                           float scale, void *out, float *lse, void *stream);

/* ============================================================================================ */
/* Stateless kernels                                                                            */
/* ============================================================================================ */

/* These take no arena: `backend` and `device` say where the pointers live (host memory for the
 * CPU backend, memory of CUDA device `device` for the CUDA backend) and which backend runs. */

typedef enum conduit_index_type {
    CONDUIT_INDEX_I32 = 0, /* int32_t indices */
    CONDUIT_INDEX_I64 = 1, /* int64_t indices (torch's index dtype) */
} conduit_index_type;

/* Bytes of workspace conduit_topk needs for n scores on the backend: 8 * n for CPU, a few KiB for
 * CUDA (independent of k). 0 for an unknown backend or n < 0. */
CONDUIT_API size_t conduit_topk_workspace_bytes(conduit_backend backend, int32_t n);

/* Indices of the k largest of n scores (float32 [n]), written in ASCENDING index order into
 * `indices` ([k], int32 or int64 per index_type). Order: NaN (any sign) ranks above +inf, all NaNs
 * alike; -0.0 equals +0.0; among equal scores the lower index is taken first, so the result is
 * deterministic. Runs radix select on CUDA (five kernel launches on `stream`, no allocation, no host
 * synchronisation) and nth_element on the CPU.
 * workspace: backend memory of at least conduit_topk_workspace_bytes(backend, n) bytes, owned by the
 * caller. For CUDA it must be zero-filled before its first use; every call that returns OK leaves it
 * zero-filled again, so one workspace serves any number of calls ordered on one stream (never two
 * calls at once). The CPU backend needs no zero-filling.
 * Errors: INVALID_ARGUMENT (n < 0, k < 0, k > n, a NULL pointer with k > 0, a workspace too small, an
 * unknown index_type; nothing is written), UNSUPPORTED (backend not compiled in, or no such device).
 * k = 0 writes nothing. */
CONDUIT_API conduit_status conduit_topk(conduit_backend backend, int32_t device, const float *scores, int32_t n,
                                        int32_t k, conduit_index_type index_type, void *indices, void *workspace,
                                        size_t workspace_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* CONDUIT_H */
