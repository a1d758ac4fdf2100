// attention.cu: host side of the CUDA attention: picks the kernel instantiation for the dtype,
// head_dim and GQA group, the number of KV splits, and the workspace that holds split partials.
//
// Workspace: partial outputs of a split launch live in a grow-only device buffer cached per
// (device, stream) and reused by every later call on that stream. Reuse is safe because work on one
// stream runs in order; when the buffer must grow, the stream is synchronized before the old buffer
// is freed. Consequences: (1) the first call with a larger split workload allocates and synchronizes,
// so warm up before capturing a CUDA graph; (2) the buffers live until the process exits (they are
// never freed, on purpose: freeing at exit would race the CUDA runtime's own teardown). If the
// allocation fails for lack of memory, the call falls back to a single split (slower, same result).
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "attention_kernel.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int32_t kMinSplitTokens = 128; // below this a split's fixed cost outweighs the parallelism
constexpr int32_t kMaxSplits = 128;
constexpr int32_t kTargetCtasPerSm = 4;  // ~2 resident CTAs per SM, two waves

struct Workspace {
    void *ptr = nullptr;
    size_t bytes = 0;
};

// Returns a device buffer of at least `bytes` for (current device, stream), or null when the device
// is out of memory.
void *workspace(size_t bytes, cudaStream_t stream) {
    static std::mutex mutex;
    static auto *cache = new std::map<std::pair<int, cudaStream_t>, Workspace>(); // never freed, see above
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    Workspace &ws = (*cache)[{device, stream}];
    if (ws.bytes >= bytes) return ws.ptr;
    if (ws.ptr) {
        CUDA_CHECK(cudaStreamSynchronize(stream)); // earlier kernels on this stream may still read it
        CUDA_CHECK(cudaFree(ws.ptr));
        ws = Workspace{};
    }
    const size_t want = bytes + bytes / 2;
    void *ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, want);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return nullptr;
    }
    CUDA_CHECK(err);
    ws = Workspace{ptr, want};
    return ptr;
}

int32_t sm_count() {
    int device = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms > 0 ? sms : 1;
}

// Slots per split (a multiple of the tile rows) for `base_ctas` CTAs before splitting.
int32_t choose_split_tokens(int32_t n_tokens, int64_t base_ctas, int32_t tile_rows) {
    const int64_t target = int64_t(kTargetCtasPerSm) * sm_count();
    int64_t splits = 1;
    if (base_ctas < target) {
        const int64_t by_length = (int64_t(n_tokens) + kMinSplitTokens - 1) / kMinSplitTokens;
        splits = std::min<int64_t>({(target + base_ctas - 1) / base_ctas, by_length, int64_t(kMaxSplits)});
        splits = std::max<int64_t>(splits, 1);
    }
    const int64_t per_split = (int64_t(n_tokens) + splits - 1) / splits;
    const int64_t rounded = (per_split + tile_rows - 1) / tile_rows * tile_rows;
    return int32_t(std::max<int64_t>(rounded, tile_rows));
}

template <typename T, int kLanes, int kPerLane, int kGroupTile>
void launch(AttentionParams p, cudaStream_t stream) {
    using S = AttnShape<T, kLanes, kPerLane, kGroupTile>;
    const int64_t base_ctas = int64_t(p.n_q) * p.n_kv_heads * p.head_tiles;
    p.split_tokens = choose_split_tokens(p.n_tokens, base_ctas, S::kTileRows);
    p.n_splits = p.n_tokens > 0 ? (p.n_tokens + p.split_tokens - 1) / p.split_tokens : 1;
    if (p.n_splits > 1) {
        const size_t partials = size_t(p.n_q) * p.n_heads * p.n_splits;
        const size_t out_bytes = (partials * p.head_dim * sizeof(float) + 255) / 256 * 256;
        char *ws = static_cast<char *>(workspace(out_bytes + partials * sizeof(float), stream));
        if (ws) {
            p.partial_out = reinterpret_cast<float *>(ws);
            p.partial_lse = reinterpret_cast<float *>(ws + out_bytes);
        } else { // out of memory: one split per CTA still gives the exact answer
            p.split_tokens = std::max(p.n_tokens, 1);
            p.n_splits = 1;
        }
    }
    const dim3 grid(unsigned(p.n_q), unsigned(p.n_kv_heads * p.head_tiles), unsigned(p.n_splits));
    split_kv_attention_kernel<T, kLanes, kPerLane, kGroupTile><<<grid, kAttnThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH("split_kv_attention_kernel");
    if (p.n_splits > 1) {
        const size_t smem = size_t(p.n_splits) * sizeof(float);
        merge_splits_kernel<T><<<unsigned(p.n_q * p.n_heads), 128, smem, stream>>>(p);
        CUDA_CHECK_LAUNCH("merge_splits_kernel");
    }
}

// kGroupTile: query heads per CTA, the smallest of 1, 2, 4, 8 that holds the group (larger groups
// take several head tiles, each reading the KV again).
template <typename T, int kLanes, int kPerLane> void launch_for_group(AttentionParams p, cudaStream_t stream) {
    const int32_t tile = p.group <= 1 ? 1 : p.group <= 2 ? 2 : p.group <= 4 ? 4 : 8;
    p.head_tiles = (p.group + tile - 1) / tile;
    switch (tile) {
    case 1: return launch<T, kLanes, kPerLane, 1>(p, stream);
    case 2: return launch<T, kLanes, kPerLane, 2>(p, stream);
    case 4: return launch<T, kLanes, kPerLane, 4>(p, stream);
    default: return launch<T, kLanes, kPerLane, 8>(p, stream);
    }
}

// Lanes per key row: the power of two (>= 4) covering head_dim in 16-byte chunks; float32 rows of
// more than 32 chunks (head_dim > 128) give each lane two chunks.
template <typename T> void launch_for_head_dim(AttentionParams p, cudaStream_t stream) {
    const int32_t chunks = p.head_dim / kChunk<T>;
    if (chunks <= 4) return launch_for_group<T, 4, 1>(p, stream);
    if (chunks <= 8) return launch_for_group<T, 8, 1>(p, stream);
    if (chunks <= 16) return launch_for_group<T, 16, 1>(p, stream);
    if (chunks <= 32) return launch_for_group<T, 32, 1>(p, stream);
    if constexpr (sizeof(T) == 4) return launch_for_group<T, 32, 2>(p, stream);
    require(false, "head_dim too large");
}

} // namespace

void attention(const LayerView &kv, int32_t n_q, int32_t n_heads, const void *q, const int32_t *q_pos, float scale,
               void *out, float *lse, void *stream) {
    if (n_q <= 0) return;
    require(kv.head_dim >= 8 && kv.head_dim <= 256 && kv.head_dim % 8 == 0,
            "head_dim must be a multiple of 8 in [8, 256]");
    require(kv.n_kv_heads >= 1 && n_heads >= kv.n_kv_heads && n_heads % kv.n_kv_heads == 0,
            "n_heads must be a multiple of n_kv_heads");
    require(kv.block_size >= 1 && kv.block_size <= 256 && (kv.block_size & (kv.block_size - 1)) == 0,
            "block_size must be a power of two in [1, 256]");
    require(aligned16(kv.pool), "the block pool must be 16-byte aligned");
    require(kv.n_tokens == 0 || (kv.block_table && kv.positions), "attention needs block_table and positions");
    require(n_heads < 65536 && int64_t(n_q) * n_heads < (int64_t(1) << 31), "too many queries or heads for one launch");

    AttentionParams p{};
    p.pool = kv.pool;
    p.block_table = kv.block_table;
    p.positions = kv.positions;
    p.block_elems = kv.block_elems();
    p.v_delta = int64_t(kv.n_kv_heads) * kv.block_size * kv.head_dim;
    p.n_tokens = kv.n_tokens;
    p.n_kv_heads = kv.n_kv_heads;
    p.head_dim = kv.head_dim;
    while ((1 << p.block_shift) < kv.block_size) ++p.block_shift;
    p.n_q = n_q;
    p.n_heads = n_heads;
    p.group = n_heads / kv.n_kv_heads;
    p.q = q;
    p.q_pos = q_pos;
    p.q_vector = aligned16(q);
    p.scale_log2 = scale * 1.4426950408889634f; // log2(e): scores are kept in base 2
    p.out = out;
    p.lse = lse;
    dispatch_dtype(kv.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        launch_for_head_dim<T>(p, as_stream(stream));
    });
}

} // namespace conduit::kernels::cuda
