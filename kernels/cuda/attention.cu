// attention.cu: the host side of the CUDA attention: picks the kernel for the shape, plans the key
// splits and places their partials, and merges the splits by their log-sum-exp (attention_merge.cuh).
//
// Kernels: many queries (prefill chunks, CONDUIT's passes) of bf16/f16 layers with head_dim 64 or 128
// take the tensor-core attention (attention_mma.cu); one query per sequence with a GQA group of
// 2..16, same dtypes and head dims, the tensor-core decode kernel (attention_mma_decode.cu); every
// other shape the CUDA-core split-KV kernel (attention_kernel.cuh). Over an fp8 pool one query per
// sequence (groups 1..16) takes the fp8 decode kernel (attention_decode_fp8.cu), which reads the e4m3
// rows; every other shape runs on a dequantized copy of the layer (kv_fp8.cuh).
// Splits: a kernel splits the keys only while its unsplit grid (queries or row tiles x KV heads) is
// smaller than one wave of resident CTAs, into splits that fill about one wave (flash-decoding). That
// is a decode step, or a many-query pass with few rows per KV head over thousands of keys (a CONDUIT
// text pass); a prefill chunk of many queries fills the device as it is and keeps one split.
// Merge: the CUDA-core kernel merges its splits in the last CTA of each row group, on arrival counters
// (the stream's counters of runtime.cu), which saves the merge launch, most of a short decode call.
// The tensor-core kernels merge in a second launch: their CTA holds a whole GQA group, and one CTA
// merging the group's rows alone is slower on long contexts than the merge kernel's CTA per row.
// Fallbacks: without workspace for the partials, one split; without counters, the second launch
// (slower, the same result). batch_attention (a decode step over a batch of sequences) plans its
// splits from the batch's shape alone and takes its counters and partials from the caller's
// workspace, so that it allocates nothing and can be graph-captured.
#include <algorithm>
#include <atomic>

#include "attention_kernel.cuh"
#include "attention_mma.cuh"
#include "kv_fp8.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int32_t kMaxSplits = 128;
static_assert(kMaxSplits <= kMergeThreads, "merge_split_rows takes one split per thread");

// Slots a key split of the tensor-core attention should stream at least (4 of its 64-slot tiles): a
// split pays for its Q fragments, a pipeline that starts cold, a float partial per row and its share
// of the merge, which stay small beside 4 or more tiles of Q K^T and P V.
constexpr int32_t kMinMmaSplitKeys = 256;

// One CTA per (query, head) row: merge_split_rows (attention_merge.cuh) over its splits. Dynamic
// shared memory: merge_row_floats(n_splits, head_dim) floats.
template <typename T> __global__ void __launch_bounds__(kMergeThreads) merge_splits_kernel(const AttentionParams p) {
    extern __shared__ float4 merge_smem[];
    wait_for_prior_grids(); // launched chained (common.cuh): the partials are the kernel before's
    allow_dependent_launch();
    merge_split_rows<T>(p, blockIdx.x, 1, reinterpret_cast<float *>(merge_smem), merge_row_floats(p.n_splits, p.head_dim));
}

// Merges p's split partials into out and lse, unless the split kernel did (p.split_counters) or a
// single split wrote them itself.
template <typename T> void merge_splits(const AttentionParams &p, cudaStream_t stream) {
    if (p.n_splits <= 1 || p.split_counters) return;
    const size_t smem = size_t(merge_row_floats(p.n_splits, p.head_dim)) * sizeof(float);
    launch_chained(merge_splits_kernel<T>, dim3(unsigned(p.n_q * p.n_heads)), dim3(kMergeThreads), smem, stream, p);
}

// Runs the split-KV kernel with p's split plan (p.n_splits, p.split_tokens, and partial buffers when
// n_splits > 1), then merges the splits.
template <typename T, int kLanes, int kPerLane, int kGroupTile>
void launch_split_kv(const AttentionParams &p, cudaStream_t stream) {
    const dim3 grid{unsigned(p.n_q), unsigned(p.n_kv_heads * p.head_tiles), unsigned(p.n_splits)};
    launch_chained(split_kv_attention_kernel<T, kLanes, kPerLane, kGroupTile>, grid, dim3(kAttnThreads), 0, stream, p);
    merge_splits<T>(p, stream);
}

// The tensor-core attention (attention_mma.cu) with `warps` warps and p's split plan, then the merge.
void launch_mma_attention_and_merge(const AttentionParams &p, DType dtype, int warps, cudaStream_t stream) {
    launch_mma_attention(p, dtype, warps, stream);
    dispatch_dtype(dtype, [&](auto tag) { merge_splits<typename decltype(tag)::type>(p, stream); });
}

// The tensor-core decode kernel (attention_mma_decode.cu) with p's split plan, then the merge.
void launch_decode_mma_and_merge(const AttentionParams &p, DType dtype, cudaStream_t stream, bool fp8 = false) {
    if (fp8) launch_decode_fp8(p, dtype, stream);
    else launch_decode_mma(p, dtype, stream);
    dispatch_dtype(dtype, [&](auto tag) { merge_splits<typename decltype(tag)::type>(p, stream); });
}

// Bytes of split partials for n_q queries of n_heads heads in n_splits splits (0 for one split).
size_t partials_bytes(int64_t n_q, int32_t n_heads, int32_t head_dim, int32_t n_splits) {
    if (n_splits <= 1) return 0;
    const size_t partials = size_t(n_q) * n_heads * n_splits;
    return (partials * head_dim * sizeof(float) + 255) / 256 * 256 + partials * sizeof(float);
}

// Points p's partial buffers into `ws` (partials_bytes of them).
void place_partials(AttentionParams &p, char *ws) {
    const size_t partials = size_t(p.n_q) * p.n_heads * p.n_splits;
    p.partial_out = reinterpret_cast<float *>(ws);
    p.partial_lse = reinterpret_cast<float *>(ws + (partials * p.head_dim * sizeof(float) + 255) / 256 * 256);
}

// Bytes of arrival counters for n_groups row groups (the CTAs of one split), 256-byte aligned.
size_t counters_bytes(int64_t n_groups) { return (size_t(n_groups) * sizeof(uint32_t) + 255) / 256 * 256; }

// Points p's partials (when it has several splits) into the stream's workspace, and with
// `last_cta_merge` (a kernel that merges in its last CTA) its arrival counters, one per CTA of a
// split, into the stream's counters. If the partials cannot be allocated, falls back to one split
// per CTA; if the counters cannot, to the merge kernel: slower, the same answer.
void place_stream_partials(AttentionParams &p, cudaStream_t stream, bool last_cta_merge) {
    if (p.n_splits <= 1) return;
    const size_t bytes = partials_bytes(p.n_q, p.n_heads, p.head_dim, p.n_splits);
    char *ws = static_cast<char *>(stream_workspace(bytes, stream));
    if (!ws) {
        p.split_tokens = std::max(p.n_tokens, 1);
        p.n_splits = 1;
        return;
    }
    place_partials(p, ws);
    // Made on every split path, so that a warm-up that splits at all makes them before a CUDA graph
    // is captured (then they grow no more: a split's CTAs are fewer than one wave, far below the
    // 16K counters of the first allocation).
    uint32_t *counters = stream_counters(last_cta_merge ? size_t(p.n_q) * p.n_kv_heads * p.head_tiles : 1, stream);
    if (last_cta_merge) p.split_counters = counters;
}

// CTAs of one split-KV instantiation resident on the device at once: its occupancy per SM (registers,
// shared memory) times the SMs. Splitting the keys into one full wave of them keeps every SM busy to
// the end; a fixed CTAs-per-SM guess leaves a partial second wave whenever fewer fit.
template <typename T, int kLanes, int kPerLane, int kGroupTile> int64_t resident_ctas() {
    static std::atomic<int> per_sm{0}; // the same instantiation has the same occupancy on every launch
    int n = per_sm.load();
    if (n == 0) {
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &n, reinterpret_cast<const void *>(&split_kv_attention_kernel<T, kLanes, kPerLane, kGroupTile>),
            kAttnThreads, 0));
        n = std::max(n, 1);
        per_sm.store(n);
    }
    return int64_t(n) * sm_count();
}

int64_t resident_ctas_for(DType dtype, int32_t head_dim, int32_t group) {
    int64_t out = 1;
    dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        dispatch_shape<T>(head_dim, group, [&](auto shape) {
            using Sh = decltype(shape);
            out = resident_ctas<T, Sh::lanes, Sh::per_lane, Sh::group_tile>();
        });
    });
    return out;
}

// Splits of base_ctas CTAs' keys: as many as `resident` CTAs hold (one wave, or the waves the caller
// asks for), at least one, at most kMaxSplits and no more than give each split min_split_tokens of
// n_tokens.
int32_t splits_for(int64_t base_ctas, int64_t resident, int64_t n_tokens, int32_t min_split_tokens) {
    const int64_t by_length = std::max<int64_t>((n_tokens + min_split_tokens - 1) / min_split_tokens, 1);
    return int32_t(std::clamp<int64_t>(resident / base_ctas, 1, std::min<int64_t>(by_length, kMaxSplits)));
}

// The split plan of a decode step over a batch: planned on the capacity (max_tokens), not the
// lengths, so that a captured launch stays right as the sequences grow.
struct BatchPlan {
    int64_t base_ctas;     // CTAs of one split: sequences x KV heads (x head tiles), one counter each
    int64_t resident_ctas; // one wave of the kernel's CTAs
    int32_t n_splits;
};

BatchPlan batch_plan(const BatchView &kv, int32_t n_heads) {
    const int32_t group = n_heads / kv.n_kv_heads;
    BatchPlan plan{};
    if (kv.fp8 && decode_fp8_applies(kv.dtype, kv.head_dim, group)) { // as the tensor-core decode
        plan.base_ctas = int64_t(kv.n_seqs) * kv.n_kv_heads;
        plan.resident_ctas = decode_fp8_resident_ctas(kv.dtype, kv.head_dim, group);
    } else if (decode_mma_applies(kv.dtype, kv.head_dim, group)) { // one CTA holds the whole group of a KV head
        plan.base_ctas = int64_t(kv.n_seqs) * kv.n_kv_heads;
        plan.resident_ctas = decode_mma_resident_ctas(kv.dtype, kv.head_dim, group);
    } else {
        const int32_t head_tiles = (group + group_tile_for(group) - 1) / group_tile_for(group);
        plan.base_ctas = int64_t(kv.n_seqs) * kv.n_kv_heads * head_tiles;
        plan.resident_ctas = resident_ctas_for(kv.dtype, kv.head_dim, group);
    }
    plan.n_splits = splits_for(plan.base_ctas, plan.resident_ctas, kv.max_tokens, kMinSplitTokens);
    return plan;
}

// A batch step's workspace: arrival counters for one wave of CTAs, then the partials. The keys split
// only while a split's CTAs (one counter each) are fewer than one wave (splits_for), so the counters
// fit, and they sit at the same place for every batch size a step plans: the partials of one size
// never overwrite the counters of another. Zero for one split.
size_t batch_workspace_bytes(const BatchView &kv, const BatchPlan &plan, int32_t n_heads) {
    if (plan.n_splits <= 1) return 0;
    return counters_bytes(plan.resident_ctas) + partials_bytes(kv.n_seqs, n_heads, kv.head_dim, plan.n_splits);
}

// Sets p.split_tokens and p.n_splits for a kernel that launches base_ctas CTAs per split (see
// plan_splits): the splits of splits_for, each rounded up to whole tiles of tile_rows slots.
void plan_splits_of(AttentionParams &p, int64_t base_ctas, int32_t tile_rows, int32_t min_split_tokens,
                    int64_t resident_ctas) {
    const int64_t splits = splits_for(base_ctas, resident_ctas, p.n_tokens, min_split_tokens);
    const int64_t per_split = (int64_t(p.n_tokens) + splits - 1) / splits;
    const int64_t rounded = std::max<int64_t>((per_split + tile_rows - 1) / tile_rows * tile_rows, tile_rows);
    p.split_tokens = int32_t(rounded);
    p.n_splits = p.n_tokens > 0 ? int32_t((p.n_tokens + rounded - 1) / rounded) : 1;
}

} // namespace

void plan_splits(AttentionParams &p, int32_t tile_rows, int32_t min_split_tokens, int64_t resident_ctas) {
    plan_splits_of(p, int64_t(p.n_q) * p.n_kv_heads * p.head_tiles, tile_rows, min_split_tokens, resident_ctas);
}

AttentionParams attention_params(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q,
                                 const int32_t *q_pos, float scale) {
    require(kv.head_dim >= 8 && kv.head_dim <= 256 && kv.head_dim % 8 == 0,
            "head_dim must be a multiple of 8 in [8, 256]");
    require(kv.n_kv_heads >= 1 && n_heads >= kv.n_kv_heads && n_heads % kv.n_kv_heads == 0,
            "n_heads must be a multiple of n_kv_heads");
    require(kv.block_size >= 1 && kv.block_size <= 256 && (kv.block_size & (kv.block_size - 1)) == 0,
            "block_size must be a power of two in [1, 256]");
    require(aligned16(kv.pool), "the block pool must be 16-byte aligned");
    require(kv.n_tokens == 0 || (kv.block_table && kv.positions), "attention needs block_table and positions");
    require(n_heads < 65536 && int64_t(n_q) * n_heads < (int64_t(1) << 31), "too many queries or heads for one launch");
    require(kv.block_elems() < (int64_t(1) << 31), "a block of the pool must hold fewer than 2^31 elements");

    AttentionParams p{};
    p.pool = kv.pool;
    p.block_table = kv.block_table;
    p.positions = kv.positions;
    p.block_elems = kv.block_elems();
    p.v_delta = int64_t(kv.n_kv_heads) * kv.block_size * kv.head_dim;
    p.block_bytes = kv.block_bytes();
    p.n_tokens = kv.n_tokens;
    p.n_kv_heads = kv.n_kv_heads;
    p.head_dim = kv.head_dim;
    while ((1 << p.block_shift) < kv.block_size) ++p.block_shift;
    p.n_q = n_q;
    p.n_heads = n_heads;
    p.group = n_heads / kv.n_kv_heads;
    const int32_t tile = group_tile_for(p.group);
    p.head_tiles = (p.group + tile - 1) / tile;
    p.q = q;
    p.q_pos = q_pos;
    p.q_vector = aligned16(q);
    p.scale_log2 = scale * 1.4426950408889634f; // log2(e): scores are kept in base 2
    p.trim_to_visible = n_q > 1; // several queries: a causal chunk or scattered recompute, not decode
    return p;
}

void attention(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos, float scale,
               void *out, float *lse, const Tuning &tuning, void *stream) {
    if (n_q <= 0) return;
    if (kv.fp8 && n_q == 1 && decode_fp8_applies(kv.dtype, kv.head_dim, n_heads / kv.n_kv_heads)) {
        AttentionParams p = attention_params(kv, n_q, n_heads, q, q_pos, scale);
        p.out = out;
        p.lse = lse;
        p.head_tiles = 1;
        plan_splits(p, kDecodeMmaTileKeys, kMinSplitTokens, decode_fp8_resident_ctas(kv.dtype, p.head_dim, p.group));
        place_stream_partials(p, as_stream(stream), false);
        launch_decode_mma_and_merge(p, kv.dtype, as_stream(stream), true);
        return;
    }
    if (kv.fp8) { // the kernels below read dense tiles: run them on a dequantized copy (kv_fp8.cuh)
        const DenseStaging staged(kv, stream);
        attention(staged.view(), n_q, n_heads, q, q_pos, scale, out, lse, tuning, stream);
        return;
    }
    AttentionParams p = attention_params(kv, n_q, n_heads, q, q_pos, scale);
    p.out = out;
    p.lse = lse;
    // many queries: tensor cores (whose softmax folds a positive scale into its exponent: a zero or
    // negative one, which no model uses, takes the CUDA-core kernels below)
    if (mma_attention_applies(kv.dtype, p.head_dim, n_q, p.group) && p.scale_log2 > 0.0f) {
        // Few rows per KV head give fewer CTAs than the device holds (a CONDUIT text pass), each
        // streaming every key alone: split the keys until the wave (or tuning's waves) is full.
        const int warps = mma_warps_for(p, tuning.mma_warps);
        const int64_t waves = tuning.mma_split_waves > 0 ? tuning.mma_split_waves : 1;
        plan_splits_of(p, mma_attention_base_ctas(p, warps), kMmaTileKeys, kMinMmaSplitKeys,
                       mma_attention_resident_ctas(kv.dtype, p.head_dim, warps) * waves);
        place_stream_partials(p, as_stream(stream), false);
        launch_mma_attention_and_merge(p, kv.dtype, warps, as_stream(stream));
        return;
    }
    // One query (a decode step, or one recomputed row: the kernel applies the position mask too)
    // with a GQA group: tensor cores, one CTA per KV head and split.
    if (n_q == 1 && decode_mma_applies(kv.dtype, p.head_dim, p.group)) {
        p.head_tiles = 1;
        plan_splits(p, kDecodeMmaTileKeys, kMinSplitTokens, decode_mma_resident_ctas(kv.dtype, p.head_dim, p.group));
        place_stream_partials(p, as_stream(stream), false);
        launch_decode_mma_and_merge(p, kv.dtype, as_stream(stream));
        return;
    }
    dispatch_dtype(kv.dtype, [&](auto dtype) {
        using T = typename decltype(dtype)::type;
        dispatch_shape<T>(p.head_dim, p.group, [&](auto shape) {
            using Sh = decltype(shape);
            plan_splits(p, AttnShape<T, Sh::lanes, Sh::per_lane, Sh::group_tile>::kTileRows, kMinSplitTokens,
                        resident_ctas<T, Sh::lanes, Sh::per_lane, Sh::group_tile>());
            place_stream_partials(p, as_stream(stream), true);
            launch_split_kv<T, Sh::lanes, Sh::per_lane, Sh::group_tile>(p, as_stream(stream));
        });
    });
}

size_t batch_attention_workspace_bytes(const BatchView &kv, int32_t n_heads) {
    // (an fp8 batch that the fp8 decode kernel cannot take runs on a dense staging copy, whose plan is
    // this one: the plan reads no bytes)
    if (kv.n_seqs <= 0 || kv.n_kv_heads <= 0 || n_heads < kv.n_kv_heads) return 0;
    return batch_workspace_bytes(kv, batch_plan(kv, n_heads), n_heads);
}

namespace {

// batch_attention, and with new_k set the write of the step's new rows (batch_write_attention).
void batch_attention_writing(const BatchView &kv, int32_t n_heads, const void *q, float scale, void *out, float *lse,
                             void *workspace, size_t workspace_bytes, void *stream, const void *new_k,
                             const void *new_v, const Rope &rope, const int32_t *rope_pos) {
    if (kv.n_seqs <= 0) return;
    if (kv.fp8) { // the step's rows quantized into the pool first; the fp8 decode kernel reads them
        if (new_k) write_last(kv, new_k, new_v, rope, rope_pos, stream);
        new_k = new_v = nullptr;
        if (!decode_fp8_applies(kv.dtype, kv.head_dim, n_heads / kv.n_kv_heads)) { // on a dense copy
            const BatchStaging staged(kv, stream);
            batch_attention_writing(staged.view(), n_heads, q, scale, out, lse, workspace, workspace_bytes, stream,
                                    nullptr, nullptr, Rope{}, nullptr);
            return;
        }
    }
    // A LayerView without tokens: attention_params checks the shape; the lengths come from the device.
    AttentionParams p = attention_params(kv.layout(), kv.n_seqs, n_heads, q, nullptr, scale);
    require(kv.block_tables && kv.n_tokens, "a batch needs its block tables and lengths");
    p.block_table = kv.block_tables;
    p.seq_n_tokens = kv.n_tokens;
    p.table_stride = kv.table_stride;
    p.n_tokens = kv.max_tokens;
    p.trim_to_visible = false;
    p.tiles_before_wait = true;
    p.out = out;
    p.lse = lse;
    p.new_k = new_k;
    p.new_v = new_v;
    p.new_rope_pos = new_k ? checked_rope_pos(rope, rope_pos, p.head_dim) : nullptr;
    p.rope = rope;
    const BatchPlan plan = batch_plan(kv, n_heads);
    const bool tensor_cores = kv.fp8 || decode_mma_applies(kv.dtype, p.head_dim, p.group); // (fp8: see above)
    p.n_splits = plan.n_splits;
    if (p.n_splits > 1) {
        require(workspace && workspace_bytes >= batch_workspace_bytes(kv, plan, n_heads),
                "batch attention: workspace too small");
        require(plan.base_ctas <= plan.resident_ctas, "batch attention: more row groups than counters");
        char *ws = static_cast<char *>(workspace);
        place_partials(p, ws + counters_bytes(plan.resident_ctas));
        if (!tensor_cores) p.split_counters = reinterpret_cast<uint32_t *>(ws);
    }
    if (tensor_cores) {
        launch_decode_mma_and_merge(p, kv.dtype, as_stream(stream), kv.fp8);
        return;
    }
    dispatch_dtype(kv.dtype, [&](auto dtype) {
        using T = typename decltype(dtype)::type;
        dispatch_shape<T>(p.head_dim, p.group, [&](auto shape) {
            using Sh = decltype(shape);
            launch_split_kv<T, Sh::lanes, Sh::per_lane, Sh::group_tile>(p, as_stream(stream));
        });
    });
}

} // namespace

void batch_attention(const BatchView &kv, int32_t n_heads, const void *q, float scale, void *out, float *lse,
                     void *workspace, size_t workspace_bytes, void *stream) {
    batch_attention_writing(kv, n_heads, q, scale, out, lse, workspace, workspace_bytes, stream, nullptr, nullptr,
                            Rope{}, nullptr);
}

void batch_write_attention(const BatchView &kv, const void *k, const void *v, const Rope &rope,
                           const int32_t *rope_pos, int32_t n_heads, const void *q, float scale, void *out, float *lse,
                           void *workspace, size_t workspace_bytes, void *stream) {
    require(k && v, "batch_write_attention needs the new K and V rows");
    batch_attention_writing(kv, n_heads, q, scale, out, lse, workspace, workspace_bytes, stream, k, v, rope, rope_pos);
}

} // namespace conduit::kernels::cuda
