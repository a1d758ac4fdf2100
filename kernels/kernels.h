// kernels.h: stateless compute kernels over raw pointers, one implementation per backend.
//
// The native runtime (native/) owns memory and state; these functions only read and write the
// buffers they are given. Every function exists twice with the same signature: in namespace
// conduit::kernels::cpu (kernels/cpu/, portable C++) and conduit::kernels::cuda (kernels/cuda/,
// enqueued on `stream`). All pointers are device pointers of the backend that runs the kernel.
//
// Block pool layout (see conduit.h): block b holds, for ONE layer, K then V:
//   K: pool + b * block_elems + h * block_size * head_dim + t * head_dim + i
//   V: the same + n_kv_heads * block_size * head_dim
// with block_elems = 2 * n_kv_heads * block_size * head_dim. A layer's token in slot s lives in
// block block_table[s / block_size] at offset t = s % block_size.
//
// An fp8 pool (LayerView::fp8) stores K and V as e4m3 bytes in the same [head][slot][dim] order, and
// after them, in the same block, one float32 scale per (head, slot) row of K and then of V:
//   K: pool + b * block_bytes + (h * block_size + t) * head_dim + i           (1 byte)
//   V: the same + n_kv_heads * block_size * head_dim
//   K scale: float at pool + b * block_bytes + 2 * n_kv_heads * block_size * head_dim
//            + 4 * (h * block_size + t);  V scale: the same + 4 * n_kv_heads * block_size
// A row's value is byte * scale, the scale a power of two (fp8_row_scale): the dequantized row is
// exact in bf16 and f16, and quantizing it again gives back the same bytes.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace conduit::kernels {

enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2 };

// Thrown by the CUDA side for a failed CUDA call; the runtime maps it to CONDUIT_ERR_DEVICE.
struct CudaError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
// Thrown when a device allocation fails; mapped to CONDUIT_ERR_OUT_OF_MEMORY.
struct DeviceOutOfMemory : std::runtime_error {
    using std::runtime_error::runtime_error;
};

inline size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

// One layer of a sequence (or of an image entry) as the kernels see it.
struct LayerView {
    void *pool = nullptr;                 // device: base of the block pool
    const int32_t *block_table = nullptr; // device int32 [ceil(n_tokens / block_size)]
    const int32_t *positions = nullptr;   // device int32 [n_tokens], causal positions (may be null
                                          // where a kernel does not read them)
    int32_t n_tokens = 0;
    int32_t n_kv_heads = 0;
    int32_t head_dim = 0;
    int32_t block_size = 0;
    DType dtype = DType::F32; // of dense K, V, queries and outputs; of the pool too unless fp8
    bool fp8 = false;         // the pool holds e4m3 K and V with row scales (the layout above)

    int64_t block_elems() const { return int64_t(2) * n_kv_heads * block_size * head_dim; }
    // Bytes of one block of the pool.
    int64_t block_bytes() const {
        return fp8 ? block_elems() + 2 * int64_t(n_kv_heads) * block_size * int64_t(sizeof(float))
                   : block_elems() * int64_t(dtype_size(dtype));
    }
};

// One layer of a batch of sequences, as a decode step sees it (conduit_step in conduit.h). Unlike a
// LayerView, the lengths and block tables are device memory owned by the step and updated in place
// between steps, so a launch over a BatchView stays valid when the sequences grow (a CUDA graph can
// replay it). Sequence i holds n_tokens[i] tokens; its block table is row i of block_tables.
struct BatchView {
    void *pool = nullptr;                  // device: base of the block pool
    const int32_t *block_tables = nullptr; // device int32 [n_seqs, table_stride]
    const int32_t *n_tokens = nullptr;     // device int32 [n_seqs]
    int64_t table_stride = 0;              // ints per block-table row
    int32_t n_seqs = 0;
    int32_t max_tokens = 0; // capacity: every n_tokens[i] <= max_tokens (the launch is planned on it)
    int32_t n_kv_heads = 0;
    int32_t head_dim = 0;
    int32_t block_size = 0;
    DType dtype = DType::F32;
    bool fp8 = false; // as LayerView::fp8

    // The shape fields as a LayerView (no table, no tokens), for code shared with layer kernels.
    LayerView layout() const {
        LayerView v;
        v.pool = pool;
        v.n_kv_heads = n_kv_heads;
        v.head_dim = head_dim;
        v.block_size = block_size;
        v.dtype = dtype;
        v.fp8 = fp8;
        return v;
    }
};

// RoPE as the kernels apply it: rotate-half over the first 2 * n_freq elements of each head,
// pairs (i, i + n_freq), angle = pos * inv_freq[i]; cos and sin scaled by `scaling`.
// type 0: none, 1: NEOX (rope_pos int32 [n]), 2: MROPE (rope_pos int32 [3, n]; frequency i takes
// row 0 for i < sections[0], row 1 for i < sections[0] + sections[1], else row 2).
struct Rope {
    int32_t type = 0;
    int32_t n_freq = 0;
    const float *inv_freq = nullptr; // device float32 [n_freq]
    int32_t sections[3] = {0, 0, 0};
    float scaling = 1.0f;
};

// Destination or source slots of n tokens: slots[i] when `slots` is set, else base + i.
struct Slots {
    const int32_t *slots = nullptr; // device int32 [n] or null (the runtime uploads host lists)
    int32_t base = 0;
};

// Launch choices of the many-query tensor-core attention that a caller may set for its GPU
// (conduit_tuning in conduit.h, carried by the arena); 0 keeps a field's default. The CPU backend
// ignores them.
struct Tuning {
    int32_t mma_warps = 0;       // warps per CTA: 4 or 8; 0: 8 while 8-warp CTAs fill the device twice, else 4
    int32_t mma_split_waves = 0; // waves of resident CTAs the key splits fill, 1..8; 0: 1
};

#if defined(__CUDACC__) || defined(CONDUIT_CUDA_EMULATION)
#define CONDUIT_HOST_DEVICE __host__ __device__
#else
#define CONDUIT_HOST_DEVICE
#endif

// The order of top-k, shared by both backends: a uint32 key per float32 score such that a larger
// score has a larger key. NaN (any sign or payload) ranks above +inf, all NaNs alike; -0.0 and +0.0
// are equal. Ties between equal keys go to the lower index.
CONDUIT_HOST_DEVICE inline uint32_t topk_order_key(float score) {
    uint32_t bits;
    std::memcpy(&bits, &score, sizeof(bits));
    if (score != score) return 0xffffffffu; // NaN
    if (bits == 0x80000000u) bits = 0;      // -0.0 -> +0.0
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The largest finite e4m3 value (fp8 KV, the layout at the top of this file).
constexpr float kFp8Max = 448.0f;

// The scale of an fp8 row whose largest magnitude is amax: the smallest power of two s with
// amax <= 448 s, so the row's largest element lands in (224, 448] and no element saturates. A power
// of two loses nothing against amax / 448 (e4m3's relative precision is the same across its normal
// range) and makes byte * s exact in bf16, f16 and float32. 1 for an all-zero row; NaN when the row
// holds a NaN or an infinity, so that its dequantized values are NaN and never quietly wrong.
CONDUIT_HOST_DEVICE inline float fp8_row_scale(float amax) {
    if (!(amax <= 3.402823466e38f)) return amax - amax; // NaN or +inf: NaN
    if (amax == 0.0f) return 1.0f;
    int exponent = 0;
    frexpf(amax / kFp8Max, &exponent); // amax / 448 < 2^exponent (the division may round down)
    float s = ldexpf(1.0f, exponent - 1);
    if (amax > kFp8Max * s) s *= 2.0f;
    if (amax > kFp8Max * s) s *= 2.0f; // the rounded division was a power of two too low
    return s;
}

#define CONDUIT_KERNEL_DECLS                                                                              \
    /* Dense K, V [n, n_kv_heads, head_dim] -> dst slots, K rotated at rope_pos when rope.type != 0. */  \
    void write_dense(const LayerView &dst, Slots dst_slots, int32_t n, const void *k, const void *v,     \
                     const Rope &rope, const int32_t *rope_pos, void *stream);                            \
    /* Paged -> paged copy of n tokens (src and dst may share the pool but not the slots), K rotated   \
       at rope_pos when rope.type != 0 (restore of pre-RoPE image KV). */                                 \
    void copy_paged(const LayerView &src, Slots src_slots, const LayerView &dst, Slots dst_slots,        \
                    int32_t n, const Rope &rope, const int32_t *rope_pos, void *stream);                  \
    /* copy_paged for n_layers layers in one launch: layer j reads src with block table               \
       src.block_table + j * src_table_stride and writes dst with dst.block_table + j *                \
       dst_table_stride; the slots and rope_pos are the same for every layer (batched restore). */     \
    void copy_paged_layers(const LayerView &src, Slots src_slots, int64_t src_table_stride,             \
                           const LayerView &dst, Slots dst_slots, int64_t dst_table_stride,             \
                           int32_t n_layers, int32_t n, const Rope &rope, const int32_t *rope_pos,      \
                           void *stream);                                                               \
    /* All tokens of a layer, in slot order, into dense k_out, v_out [n_tokens, n_kv_heads, head_dim]  \
       (either may be null). */                                                                           \
    void read_dense(const LayerView &src, void *k_out, void *v_out, void *stream);                       \
    /* Causal-by-position GQA attention: q [n_q, n_heads, head_dim] (kv dtype), q_pos int32 [n_q],     \
       out [n_q, n_heads, head_dim] (kv dtype), lse float32 [n_q, n_heads] or null. A query seeing no  \
       key writes zeros and lse = -inf. `tuning` shapes the launch of the many-query tensor-core path. */ \
    void attention(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos, \
                   float scale, void *out, float *lse, const Tuning &tuning, void *stream);              \
    /* Attention statistics (see conduit_seq_attention_stats): mass float32 [n_tokens] (overwritten),  \
       n_below float32 [n_heads] or null, lse float32 [n_q, n_heads] or null. */                          \
    void attention_stats(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos, \
                         float scale, float threshold, float *mass, float *n_below, float *lse, void *stream);     \
    /* The mass of attention_stats alone, each row's natural-log log-sum-exp given (lse float32 [n_q,   \
       n_heads], as attention returns it for these queries over this layer): the score pass that finds \
       it is skipped, so the keys are read once. mass float32 [n_tokens] (overwritten). */               \
    void attention_mass(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos, \
                        float scale, const float *lse, float *mass, void *stream);                           \
    /* Decode-step write: k, v [n_seqs, n_kv_heads, head_dim], one new token per sequence, into slot   \
       n_tokens[i] - 1 of sequence i; K rotated at rope_pos ([n_seqs] or [3, n_seqs]) when rope.type   \
       != 0. Reads the lengths and tables on the device, so it can be graph-captured. */                 \
    void write_last(const BatchView &dst, const void *k, const void *v, const Rope &rope,               \
                    const int32_t *rope_pos, void *stream);                                               \
    /* Decode-step attention: q [n_seqs, n_heads, head_dim], one query per sequence, over EVERY stored  \
       token of its sequence (no position mask: a decode query comes after all of them); out like q,   \
       lse float32 [n_seqs, n_heads] or null. workspace: batch_attention_workspace_bytes(kv, n_heads)   \
       bytes of device memory for split partials and arrival counters; on CUDA zero-filled before its   \
       first use (each call leaves the counters zero; one workspace serves every n_seqs whose size it   \
       holds). The launch depends on n_seqs and max_tokens only, not on the lengths, so one captured    \
       launch serves every step. */                                                                       \
    void batch_attention(const BatchView &kv, int32_t n_heads, const void *q, float scale, void *out,     \
                         float *lse, void *workspace, size_t workspace_bytes, void *stream);              \
    size_t batch_attention_workspace_bytes(const BatchView &kv, int32_t n_heads);                        \
    /* write_last(kv, k, v, rope, rope_pos) then batch_attention(kv, ...): the same bits, and on CUDA   \
       one launch fewer (the attention writes the rows it then reads, attention_shape.cuh). */          \
    void batch_write_attention(const BatchView &kv, const void *k, const void *v, const Rope &rope,      \
                               const int32_t *rope_pos, int32_t n_heads, const void *q, float scale,     \
                               void *out, float *lse, void *workspace, size_t workspace_bytes,           \
                               void *stream);                                                             \
    /* dst[pairs[2j]] = pairs[2j + 1] for j < n_pairs (device int32 pairs): patches a step's tables. */   \
    void scatter_ints(int32_t *dst, const int32_t *pairs, int32_t n_pairs, void *stream);                \
    /* Bytes of device workspace topk needs for n scores. */                                              \
    size_t topk_workspace_bytes(int32_t n);                                                               \
    /* Indices of the k largest of scores float32 [n] in the order of topk_order_key (ties: lower index \
       first), written ascending into indices: int64 [k] when indices_i64, else int32 [k]. workspace:   \
       topk_workspace_bytes(n) bytes; on CUDA zero-filled before its first use (each call leaves it     \
       so). Needs 0 <= k <= n (else std::invalid_argument). */                                            \
    void topk(const float *scores, int32_t n, int32_t k, void *indices, bool indices_i64, void *workspace,   \
              size_t workspace_bytes, void *stream);

namespace cpu {
CONDUIT_KERNEL_DECLS
} // namespace cpu

namespace cuda {
CONDUIT_KERNEL_DECLS
// Device-to-device and host-to-device copies, allocation; errors throw conduit::kernels::CudaError.
void *device_alloc(size_t bytes, int32_t device);
void device_free(void *ptr, int32_t device);
void memcpy_d2d(void *dst, const void *src, size_t bytes, void *stream);
void memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream);
void memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream);
void memset_zero(void *dst, size_t bytes, void *stream); // bytes of device memory set to 0 on the stream
void set_device(int32_t device);
int32_t device_count(); // 0 when there is no driver or no device; never throws
void synchronize(void *stream);
} // namespace cuda

#undef CONDUIT_KERNEL_DECLS

} // namespace conduit::kernels
