// topk.cpp: top-k selection on the CPU: nth_element over (key, index) pairs, then one pass in index
// order, so the indices come out ascending without a sort.
//
// A pair packs the order key (topk_order_key) above the complemented index: pairs are distinct and
// "larger pair" means "larger score, or the same score at a lower index", the tie rule of both
// backends. The k-th largest pair P_k splits the scores exactly: index i is selected iff pair(i) >= P_k.
#include <algorithm>
#include <functional>
#include <stdexcept>

#include "../kernels.h"

namespace conduit::kernels::cpu {
namespace {

uint64_t ranked_pair(const float *scores, int32_t i) {
    return (uint64_t(topk_order_key(scores[i])) << 32) | uint64_t(~uint32_t(i));
}

template <typename Index> void write_selected(const float *scores, int32_t n, uint64_t kth, Index *out) {
    int64_t pos = 0;
    for (int32_t i = 0; i < n; ++i)
        if (ranked_pair(scores, i) >= kth) out[pos++] = Index(i);
}

} // namespace

size_t topk_workspace_bytes(int32_t n) { return sizeof(uint64_t) * size_t(n > 0 ? n : 0); }

void topk(const float *scores, int32_t n, int32_t k, void *indices, bool indices_i64, void *workspace,
          size_t workspace_bytes, void *) {
    if (n < 0 || k < 0 || k > n) throw std::invalid_argument("top-k needs 0 <= k <= n");
    if (workspace_bytes < topk_workspace_bytes(n)) throw std::invalid_argument("top-k workspace too small");
    if (k == 0) return;
    if (!scores || !indices || !workspace) throw std::invalid_argument("top-k pointers must not be null");
    auto *pairs = static_cast<uint64_t *>(workspace);
    for (int32_t i = 0; i < n; ++i) pairs[i] = ranked_pair(scores, i);
    std::nth_element(pairs, pairs + (k - 1), pairs + n, std::greater<uint64_t>());
    const uint64_t kth = pairs[k - 1];
    if (indices_i64) write_selected(scores, n, kth, static_cast<int64_t *>(indices));
    else write_selected(scores, n, kth, static_cast<int32_t *>(indices));
}

} // namespace conduit::kernels::cpu
