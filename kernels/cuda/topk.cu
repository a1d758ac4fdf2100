// topk.cu: top-k selection of float32 scores by radix select, indices written in ascending order.
//
// Scores map to order-preserving uint32 keys (topk_order_key, kernels.h), so "the k largest scores" is "the k
// largest keys", ties going to the lowest index. Five launches, none of them allocating:
//   3 x radix_pass    11, 11 and 10 bits of the k-th largest key T, most significant first. Each
//                     block histograms the digit of the keys that match the bits found so far
//                     (shared memory), adds its non-zero bins to a global histogram, and the last
//                     block to finish (a ticket counter) picks the digit of T, updates the state
//                     and zeroes the histogram and the ticket for the next call.
//   count_pass        per block: how many keys are > T and == T (block_counts).
//   write_pass        each block sums its predecessors' counts, then writes, in index order, every
//                     index whose key is > T and the first `take_equal` ones == T (ties: lowest
//                     index first). Output is therefore sorted ascending without a sort.
// When a digit's bucket holds exactly as many keys as are still needed, T's lower bits do not
// matter: the state is marked resolved and later radix passes return at once.
//
// Workspace layout: TopkState, then block_counts [max_blocks][2] uint32. The state's histograms and
// tickets must be zero before the first call; every call leaves them zero again.
#include <cstdint>

#include "common.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItemsPerBlock = 4 * kThreads; // the tile one block covers at small n
constexpr int kMaxBlocks = 1024;
constexpr int kPasses = 3;
constexpr int kMaxBins = 2048;
// Digits of the key, most significant first: bits [21, 32), [10, 21), [0, 10).
__host__ __device__ constexpr int digit_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__host__ __device__ constexpr int digit_width(int pass) { return pass == 2 ? 10 : 11; }

struct TopkState {
    uint32_t hist[kPasses][kMaxBins]; // global digit histograms (zero between calls)
    uint32_t tickets[kPasses];        // blocks finished per radix pass (zero between calls)
    uint32_t prefix;                  // bits of T found so far (the bits under `mask`)
    uint32_t mask;                    // which bits of T are known
    uint32_t needed;                  // keys still to take from those matching `prefix`
    uint32_t resolved;                // 1: every key matching `prefix` is taken; stop refining
};

size_t state_bytes() { return (sizeof(TopkState) + 255) / 256 * 256; }

int32_t grid_for(int32_t n) {
    const int32_t blocks = (n + kItemsPerBlock - 1) / kItemsPerBlock;
    return blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks);
}

// The contiguous range of indices block `b` of `grid` covers.
__device__ __forceinline__ void block_range(int32_t n, int32_t &begin, int32_t &end) {
    const int64_t per_block = (int64_t(n) + gridDim.x - 1) / gridDim.x;
    begin = int32_t(min(int64_t(n), per_block * blockIdx.x));
    end = int32_t(min(int64_t(n), per_block * (blockIdx.x + 1)));
}

// Sum over the block of one value per thread; every thread gets the total. `scratch`: kWarps words.
__device__ __forceinline__ uint32_t block_sum(uint32_t value, uint32_t *scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); // scratch may still be read from an earlier call
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    uint32_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += scratch[w];
    return total;
}

// The last block of a radix pass: finds the digit d of T from the global histogram (bins scanned
// from the top: the largest d whose bucket and every bucket above hold >= needed keys), updates the
// state and zeroes the histogram for the next call.
__device__ void choose_digit(TopkState *state, int pass, uint32_t prefix, uint32_t mask, uint32_t needed) {
    __shared__ uint32_t sums[kThreads];
    __shared__ uint32_t chosen[3]; // digit, count above it, count in it
    const int bins = 1 << digit_width(pass);
    const int per_thread = bins / kThreads;
    volatile uint32_t *hist = state->hist[pass];
    // Thread t owns bins [bins - per_thread * (t + 1), bins - per_thread * t): descending order.
    const int top = bins - per_thread * int(threadIdx.x);
    uint32_t own = 0;
    for (int i = 1; i <= per_thread; ++i) own += hist[top - i];
    sums[threadIdx.x] = own;
    __syncthreads();
    for (int offset = 1; offset < kThreads; offset <<= 1) { // inclusive scan (Hillis-Steele)
        const uint32_t add = threadIdx.x >= unsigned(offset) ? sums[threadIdx.x - offset] : 0u;
        __syncthreads();
        sums[threadIdx.x] += add;
        __syncthreads();
    }
    const uint32_t before = sums[threadIdx.x] - own; // keys in the bins above this thread's
    if (before < needed && needed <= sums[threadIdx.x]) {
        uint32_t above = before;
        for (int i = 1; i <= per_thread; ++i) {
            const uint32_t count = hist[top - i];
            if (above + count >= needed) {
                chosen[0] = uint32_t(top - i);
                chosen[1] = above;
                chosen[2] = count;
                break;
            }
            above += count;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += kThreads) hist[i] = 0;
    if (threadIdx.x == 0) {
        const uint32_t still_needed = needed - chosen[1];
        state->prefix = prefix | (chosen[0] << digit_shift(pass));
        state->mask = mask | (uint32_t(bins - 1) << digit_shift(pass));
        state->needed = still_needed;
        state->resolved = still_needed == chosen[2] ? 1u : 0u;
        state->tickets[pass] = 0;
    }
}

// One radix pass: pass 0 starts from (prefix 0, mask 0, needed k); later passes read the state.
__global__ void __launch_bounds__(kThreads) radix_pass(const float *scores, int32_t n, int32_t k, int pass,
                                                       TopkState *state) {
    __shared__ uint32_t local[kMaxBins];
    __shared__ bool is_last;
    if (pass > 0 && state->resolved) return;
    const uint32_t prefix = pass == 0 ? 0u : state->prefix;
    const uint32_t mask = pass == 0 ? 0u : state->mask;
    const uint32_t needed = pass == 0 ? uint32_t(k) : state->needed;
    const int bins = 1 << digit_width(pass);
    const int shift = digit_shift(pass);
    for (int i = threadIdx.x; i < bins; i += kThreads) local[i] = 0;
    __syncthreads();
    int32_t begin, end;
    block_range(n, begin, end);
    for (int32_t i = begin + int32_t(threadIdx.x); i < end; i += kThreads) {
        const uint32_t key = topk_order_key(scores[i]);
        if ((key & mask) == prefix) atomicAdd(&local[(key >> shift) & uint32_t(bins - 1)], 1u);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += kThreads)
        if (local[i]) atomicAdd(&state->hist[pass][i], local[i]);
    __threadfence(); // the histogram additions are visible before the ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&state->tickets[pass], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    choose_digit(state, pass, prefix, mask, needed);
}

// Per block: keys above T and keys equal to T (under the known mask) -> block_counts[block].
__global__ void __launch_bounds__(kThreads) count_pass(const float *scores, int32_t n, const TopkState *state,
                                                       uint32_t *block_counts) {
    __shared__ uint32_t scratch[kWarps];
    const uint32_t prefix = state->prefix, mask = state->mask;
    int32_t begin, end;
    block_range(n, begin, end);
    uint32_t greater = 0, equal = 0;
    for (int32_t i = begin + int32_t(threadIdx.x); i < end; i += kThreads) {
        const uint32_t key = topk_order_key(scores[i]) & mask;
        greater += key > prefix;
        equal += key == prefix;
    }
    greater = block_sum(greater, scratch);
    equal = block_sum(equal, scratch);
    if (threadIdx.x == 0) {
        block_counts[2 * blockIdx.x] = greater;
        block_counts[2 * blockIdx.x + 1] = equal;
    }
}

__device__ __forceinline__ void store_index(int32_t *out, int64_t pos, int32_t i) { out[pos] = i; }
__device__ __forceinline__ void store_index(int64_t *out, int64_t pos, int32_t i) { out[pos] = i; }

// Writes the selected indices in ascending order: the output position of a selected index is the
// number of keys > T before it plus the number of keys == T before it (all of which are taken).
template <typename Index>
__global__ void __launch_bounds__(kThreads) write_pass(const float *scores, int32_t n, const TopkState *state,
                                                       const uint32_t *block_counts, Index *out) {
    __shared__ uint32_t scratch[kWarps];
    __shared__ uint32_t warp_greater[kWarps], warp_equal[kWarps];
    const uint32_t prefix = state->prefix, mask = state->mask, take_equal = state->needed;
    uint32_t greater_before = 0, equal_before = 0;
    for (uint32_t b = threadIdx.x; b < blockIdx.x; b += kThreads) {
        greater_before += block_counts[2 * b];
        equal_before += block_counts[2 * b + 1];
    }
    greater_before = block_sum(greater_before, scratch);
    equal_before = block_sum(equal_before, scratch);
    if (equal_before >= take_equal && block_counts[2 * blockIdx.x] == 0) return; // nothing to write here
    int32_t begin, end;
    block_range(n, begin, end);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t lanes_below = (1u << lane) - 1u;
    for (int32_t base = begin; base < end; base += kThreads) { // one element per thread per round
        const int32_t i = base + int32_t(threadIdx.x);
        const uint32_t key = i < end ? topk_order_key(scores[i]) & mask : 0u;
        const bool is_greater = i < end && key > prefix, is_equal = i < end && key == prefix;
        const uint32_t greater_bits = __ballot_sync(0xffffffffu, is_greater);
        const uint32_t equal_bits = __ballot_sync(0xffffffffu, is_equal);
        if (lane == 0) {
            warp_greater[warp] = __popc(greater_bits);
            warp_equal[warp] = __popc(equal_bits);
        }
        __syncthreads();
        uint32_t greater_rank = greater_before + __popc(greater_bits & lanes_below);
        uint32_t equal_rank = equal_before + __popc(equal_bits & lanes_below);
        uint32_t round_greater = 0, round_equal = 0;
        for (int w = 0; w < kWarps; ++w) {
            if (w < warp) {
                greater_rank += warp_greater[w];
                equal_rank += warp_equal[w];
            }
            round_greater += warp_greater[w];
            round_equal += warp_equal[w];
        }
        const uint32_t equal_taken = equal_rank < take_equal ? equal_rank : take_equal;
        if (is_greater || (is_equal && equal_rank < take_equal))
            store_index(out, int64_t(greater_rank) + equal_taken, i);
        greater_before += round_greater;
        equal_before += round_equal;
        __syncthreads(); // warp_* are rewritten next round
    }
}

} // namespace

size_t topk_workspace_bytes(int32_t n) { return state_bytes() + sizeof(uint32_t) * 2 * size_t(grid_for(n)); }

void topk(const float *scores, int32_t n, int32_t k, void *indices, bool indices_i64, void *workspace,
          size_t workspace_bytes, void *stream) {
    require(n >= 0 && k >= 0 && k <= n, "top-k needs 0 <= k <= n");
    require(workspace_bytes >= topk_workspace_bytes(n), "top-k workspace too small");
    if (k == 0) return;
    require(scores && indices && workspace, "top-k pointers must not be null");
    auto *state = static_cast<TopkState *>(workspace);
    auto *block_counts = reinterpret_cast<uint32_t *>(static_cast<char *>(workspace) + state_bytes());
    const int32_t grid = grid_for(n);
    cudaStream_t s = as_stream(stream);
    for (int pass = 0; pass < kPasses; ++pass) {
        radix_pass<<<grid, kThreads, 0, s>>>(scores, n, k, pass, state);
        CUDA_CHECK_LAUNCH("radix_pass");
    }
    count_pass<<<grid, kThreads, 0, s>>>(scores, n, state, block_counts);
    CUDA_CHECK_LAUNCH("count_pass");
    if (indices_i64) {
        write_pass<int64_t><<<grid, kThreads, 0, s>>>(scores, n, state, block_counts, static_cast<int64_t *>(indices));
    } else {
        write_pass<int32_t><<<grid, kThreads, 0, s>>>(scores, n, state, block_counts, static_cast<int32_t *>(indices));
    }
    CUDA_CHECK_LAUNCH("write_pass");
}

} // namespace conduit::kernels::cuda
