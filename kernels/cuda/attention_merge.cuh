// attention_merge.cuh: the log-sum-exp merge of split-KV partials, for the kernels that split a
// query's keys (attention.cu plans the splits; attention_kernel.cuh, attention_mma.cu and
// attention_mma_decode.cu write the partials). A head row's output is
//   out = sum_s exp(lse_s - lse) * partial_s,  lse = logsumexp_s(lse_s),
// computed by merge_split_rows in one fixed order of additions, whichever CTA runs it:
//   - merge_splits_kernel (attention.cu): a second launch, one CTA per head row;
//   - merge_if_last_split: inside the CUDA-core split kernel itself (attention.cu says why the
//     tensor-core ones keep the second launch). Each CTA writes its partials, then arrives on the
//     arrival counter of its row group (p.split_counters, one per (blockIdx.x, blockIdx.y)); the CTA
//     that arrives last merges the group's rows and sets the counter back to 0, so counters that
//     start at zero are zero again after every launch (and graph replay). This saves the second
//     launch, a fixed cost that is a large part of a short decode call.
// Both give the same bits: the weights' sum is the butterfly-then-warps order of a 128-thread CTA
// over splits 0..127, and each output column sums its splits by team (team g: splits g, g + teams,
// ... in order), then the teams in order.
#pragma once

#include <math_constants.h>

#include "attention_shape.cuh"

namespace conduit::kernels::cuda {

// Threads that run merge_split_rows: the merge kernel's CTA, and the CTAs of the split kernels that
// merge in their last CTA (kAttnThreads, DecodeShape::kThreads). Splits per row are at most this.
constexpr int kMergeThreads = 128;
static_assert(kAttnThreads == kMergeThreads, "the CUDA-core split kernel merges with its own threads");

// Floats of shared memory merge_split_rows takes per row it merges at once: the teams' column sums
// (teams x head_dim, at most 512), the splits' weights (padded to 4), the row's max and sum (padded
// to 4). A multiple of 4, so every row's part stays 16-byte aligned.
__host__ __device__ inline int32_t merge_row_floats(int32_t n_splits, int32_t head_dim) {
    const int32_t teams = kMergeThreads / (head_dim / 4);
    return teams * head_dim + (n_splits + 3) / 4 * 4 + 4;
}

// Merges the splits of head rows [first_row, first_row + n_rows) of p (p.partial_out, p.partial_lse;
// n_splits <= kMergeThreads) into p.out and p.lse. Call from all kMergeThreads threads of a CTA, with
// `smem` at least merge_row_floats(p.n_splits, p.head_dim) floats (16-byte aligned): rows are merged
// as many at a time as smem_floats holds. The partials are read through L2 (__ldcg): other CTAs wrote
// them. Empty splits (weight 0) are not read.
template <typename T>
__device__ __forceinline__ void merge_split_rows(const AttentionParams &p, int64_t first_row, int32_t n_rows,
                                                 float *smem, int32_t smem_floats) {
    const int32_t n_splits = p.n_splits, head_dim = p.head_dim;
    const int32_t columns = head_dim / 4, teams = kMergeThreads / columns;
    const int32_t column = threadIdx.x % columns, team = threadIdx.x / columns;
    const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int32_t row_floats = merge_row_floats(n_splits, head_dim);
    const int32_t per_pass = max(1, min(n_rows, smem_floats / row_floats));
    for (int32_t pass = 0; pass < n_rows; pass += per_pass) {
        const int32_t rows = min(per_pass, n_rows - pass);
        __syncthreads(); // the previous pass (or the caller) may still read smem

        // Weights: warp w takes rows w, w + 4, ...; lane l holds splits l, l + 32, l + 64, l + 96,
        // which are thread 32 k + l's split in a one-row CTA, and sums them in that CTA's order: a
        // butterfly within each group of 32, then the 4 groups in order.
        for (int32_t r = warp; r < rows; r += kMergeThreads / 32) {
            const int64_t head_row = first_row + pass + r;
            float *row_smem = smem + r * row_floats;
            float *weight = row_smem + teams * head_dim;
            float lse[kMergeThreads / 32];
            float max_lse = -CUDART_INF_F;
#pragma unroll
            for (int k = 0; k < kMergeThreads / 32; ++k) {
                const int32_t s = 32 * k + lane;
                lse[k] = s < n_splits ? __ldcg(p.partial_lse + head_row * n_splits + s) : -CUDART_INF_F;
                max_lse = fmaxf(max_lse, lse[k]);
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2)
                max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
            const float ref = max_lse == -CUDART_INF_F ? 0.0f : max_lse;
            float total = 0.0f;
#pragma unroll
            for (int k = 0; k < kMergeThreads / 32; ++k) {
                const int32_t s = 32 * k + lane;
                float x = 0.0f;
                if (s < n_splits) {
                    x = expf(lse[k] - ref);
                    weight[s] = x;
                }
#pragma unroll
                for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
                total = k == 0 ? x : total + x;
            }
            if (lane == 0) {
                row_smem[row_floats - 4] = max_lse;
                row_smem[row_floats - 3] = total;
            }
        }
        __syncthreads();

        // Team sums: thread (team, column) folds float4 column `column` of splits team, team + teams,
        // ... of every row (independent loads, many in flight: a long decode has ~66 splits a row,
        // which one thread per column would read one after another); 4 splits loaded ahead, then
        // added in split order.
        for (int32_t r = 0; team < teams && r < rows; ++r) {
            const int64_t head_row = first_row + pass + r;
            float *row_smem = smem + r * row_floats;
            const float *weight = row_smem + teams * head_dim;
            const float4 *src = reinterpret_cast<const float4 *>(p.partial_out + head_row * n_splits * head_dim);
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int32_t s0 = team; s0 < n_splits; s0 += 4 * teams) {
                float w[4];
                float4 v[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int32_t s = s0 + i * teams;
                    w[i] = s < n_splits ? weight[s] : 0.0f;
                    v[i] = w[i] != 0.0f ? __ldcg(src + int64_t(s) * columns + column) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (w[i] == 0.0f) continue;
                    acc.x = fmaf(w[i], v[i].x, acc.x);
                    acc.y = fmaf(w[i], v[i].y, acc.y);
                    acc.z = fmaf(w[i], v[i].z, acc.z);
                    acc.w = fmaf(w[i], v[i].w, acc.w);
                }
            }
            reinterpret_cast<float4 *>(row_smem + team * head_dim)[column] = acc;
        }
        __syncthreads();

        for (int32_t idx = threadIdx.x; idx < rows * head_dim; idx += kMergeThreads) {
            const int32_t r = idx / head_dim, d = idx % head_dim;
            const int64_t head_row = first_row + pass + r;
            const float *row_smem = smem + r * row_floats;
            const float max_lse = row_smem[row_floats - 4], total = row_smem[row_floats - 3];
            const bool empty = total == 0.0f;
            const float inv = empty ? 0.0f : 1.0f / total;
            float value = 0.0f;
            for (int32_t g = 0; g < teams; ++g) value += row_smem[g * head_dim + d];
            static_cast<T *>(p.out)[head_row * head_dim + d] = from_float<T>(value * inv);
            if (d == 0 && p.lse) p.lse[head_row] = empty ? -CUDART_INF_F : max_lse + logf(total);
        }
    }
}

// Called by all threads of a split CTA once they have written its partials for head rows
// [first_row, first_row + n_rows) (p.n_splits > 1, p.split_counters set): the CTA arrives on its row
// group's counter, and the last of the group's n_splits CTAs merges the group's rows
// (merge_split_rows, with smem_floats floats of `smem` that the caller no longer needs) and sets the
// counter back to 0. Every CTA of the grid must call it: the count is of arrivals.
template <typename T>
__device__ __forceinline__ void merge_if_last_split(const AttentionParams &p, int64_t first_row, int32_t n_rows,
                                                    float *smem, int32_t smem_floats) {
    // The pattern of a cooperative-groups grid sync: the barrier orders the CTA's partials before
    // thread 0's fence, whose release covers them; after its arrival the last CTA's fence acquires
    // the other CTAs' partials for every thread behind the second barrier. That barrier is a
    // __syncthreads_or, which also broadcasts thread 0's verdict. A __shared__ flag would add static
    // shared memory, and a few bytes of it can slow a kernel's key loop even where the merge never
    // runs (same SASS loop, registers and occupancy: check ptxas -v when a change moves a kernel's
    // speed without touching its loop).
    __syncthreads();
    int last = 0;
    if (threadIdx.x == 0) {
        uint32_t *counter = p.split_counters + int64_t(blockIdx.x) * gridDim.y + blockIdx.y;
        __threadfence();
        last = atomicAdd(counter, 1u) == uint32_t(p.n_splits - 1);
        if (last) {
            *counter = 0; // every split arrived: zero for the next launch
            __threadfence();
        }
    }
    if (__syncthreads_or(last)) merge_split_rows<T>(p, first_row, n_rows, smem, smem_floats);
}

} // namespace conduit::kernels::cuda
