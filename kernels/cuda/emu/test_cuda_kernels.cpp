// test_cuda_kernels.cpp: the CUDA kernels against the CPU backend on random layers: every dtype,
// head_dim 8..256, block sizes 1..256, GQA groups 1..12, masked and unwritten slots, unaligned dense
// pointers, split and unsplit attention (the tensor-core one too), causal chunks, scattered queries.
// Exit status 0 when all pass.
// Built by run_emu.py either for the CPU emulator (emu.h) or, with --gpu, for a real GPU (buffers
// in managed memory, so that both backends read the same allocations).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "kernels.h"

namespace kc = conduit::kernels;

#ifdef CONDUIT_TEST_ON_GPU
#include <cuda_runtime.h>
#include <cstdlib>

// Managed memory: kernels read it on the device, the CPU backend and the checks on the host.
template <typename T> struct ManagedAllocator {
    using value_type = T;
    ManagedAllocator() = default;
    template <typename U> ManagedAllocator(const ManagedAllocator<U> &) {}
    T *allocate(size_t n) {
        void *p = nullptr;
        if (cudaMallocManaged(&p, n * sizeof(T) + 16) != cudaSuccess) {
            std::printf("cudaMallocManaged failed: no usable CUDA device?\n");
            std::exit(2);
        }
        return static_cast<T *>(p);
    }
    void deallocate(T *p, size_t) { cudaFree(p); }
    template <typename U> bool operator==(const ManagedAllocator<U> &) const { return true; }
    template <typename U> bool operator!=(const ManagedAllocator<U> &) const { return false; }
};
template <typename T> using Buf = std::vector<T, ManagedAllocator<T>>;
void device_sync() {
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
        std::printf("CUDA error: %s\n", cudaGetErrorString(err));
        std::exit(2);
    }
}
#else
template <typename T> using Buf = std::vector<T>;
void device_sync() {}
namespace emu {
extern size_t g_malloc_limit;        // emu.cpp: a cudaMalloc of more bytes fails
extern int g_sm_count;               // SMs the emulated device reports
extern uint32_t g_block_order_seed;  // 0: CTAs in grid order; else shuffled
}
#endif

namespace {

std::mt19937 rng(1234);
int failures = 0, checks = 0;

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); } // inclusive

const char *dtype_name(kc::DType t) { return t == kc::DType::F32 ? "f32" : t == kc::DType::F16 ? "f16" : "bf16"; }

// A block pool and one layer in it: random blocks, random K/V for written slots, NaN elsewhere.
struct Layer {
    Buf<unsigned char> pool;
    Buf<int32_t> table, positions;
    kc::LayerView view;
};

Layer make_layer(kc::DType dtype, int hk, int d, int bs, int n_tokens, int max_pos) {
    Layer l;
    const int n_blocks = (n_tokens + bs - 1) / bs;
    const int total_blocks = n_blocks + 3;
    l.view.n_kv_heads = hk;
    l.view.head_dim = d;
    l.view.block_size = bs;
    l.view.dtype = dtype;
    l.view.n_tokens = n_tokens;
    const int64_t elems = l.view.block_elems() * total_blocks;
    l.pool.assign(size_t(elems) * kc::dtype_size(dtype) + 64, 0xff); // NaN everywhere first
    Buf<int32_t> ids(static_cast<size_t>(total_blocks));
    for (int i = 0; i < total_blocks; ++i) ids[size_t(i)] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    l.table.assign(ids.begin(), ids.begin() + n_blocks);
    for (int s = 0; s < n_tokens; ++s) l.positions.push_back(randint(0, max_pos));
    l.view.pool = l.pool.data();
    l.view.block_table = l.table.data();
    l.view.positions = l.positions.data();
    for (int s = 0; s < n_tokens; ++s)
        for (int h = 0; h < hk; ++h) {
            const int64_t off = kc::cpu::k_offset(l.view, s, h);
            for (int e = 0; e < d; ++e) {
                kc::cpu::store(l.pool.data(), off + e, uniform(-1, 1), dtype);
                kc::cpu::store(l.pool.data(), off + kc::cpu::v_delta(l.view) + e, uniform(-1, 1), dtype);
            }
        }
    return l;
}

// Moves slot s to position `pos` (past every query) and fills its K and V with NaN.
void hide_slot(Layer &l, int s, int pos) {
    l.positions[size_t(s)] = pos;
    for (int h = 0; h < l.view.n_kv_heads; ++h) {
        const int64_t off = kc::cpu::k_offset(l.view, s, h);
        for (int e = 0; e < l.view.head_dim; ++e) {
            kc::cpu::store(l.pool.data(), off + e, NAN, l.view.dtype);
            kc::cpu::store(l.pool.data(), off + kc::cpu::v_delta(l.view) + e, NAN, l.view.dtype);
        }
    }
}

// Hides every slot of the 64-slot key tiles (the tensor-core kernels' tile) whose bit is set in
// `tiles`: positions past every query, K/V NaN, so that those tiles are skipped whole.
void hide_tiles(Layer &l, uint64_t tiles) {
    for (int s = 0; s < l.view.n_tokens && s / 64 < 64; ++s)
        if ((tiles >> (s / 64)) & 1u) hide_slot(l, s, 1 << 30);
}

Buf<unsigned char> random_dense(kc::DType dtype, int64_t n, float scale = 1.0f) {
    Buf<unsigned char> out(size_t(n) * kc::dtype_size(dtype) + 64);
    for (int64_t i = 0; i < n; ++i) kc::cpu::store(out.data(), i, uniform(-scale, scale), dtype);
    return out;
}

void expect(bool ok, const std::string &what) {
    ++checks;
    if (!ok) {
        ++failures;
        if (failures <= 30) std::printf("FAIL %s\n", what.c_str());
    }
}

// The order the emulator runs the CTAs of the next launches in (0: grid order; else shuffled from
// the seed). A real GPU picks its own.
void set_block_order(uint32_t seed) {
#ifndef CONDUIT_TEST_ON_GPU
    emu::g_block_order_seed = seed;
#else
    (void)seed;
#endif
}

bool close(float got, float want, float atol, float rtol) {
    if (std::isinf(want) || std::isinf(got)) return got == want;
    if (std::isnan(got) || std::isnan(want)) return false;
    return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

float out_rtol(kc::DType t) { return t == kc::DType::F32 ? 1e-4f : t == kc::DType::F16 ? 2e-3f : 1.6e-2f; }

// Where the keys and queries of test_attention sit.
enum class Layout {
    kRandom,      // random key and query positions in [0, 60]; every 5th slot hidden (NaN), query 1 sees nothing
    kCausalChunk, // keys at positions 0..n_tokens-1 in slot order, the queries the last n_q of them (a
                  // prefill chunk, CONDUIT's text pass)
    kRecompute,   // keys in slot order, the queries scattered over them in order (CONDUIT's recompute:
                  // early rows see only the first splits); query 1 sees nothing, every 7th slot and the
                  // slots after the last query are seen by no query (NaN)
};

// The CUDA attention against the CPU backend on a random layer (out and lse), then again without lse:
// the same out, bit for bit. hidden_tiles: 64-slot key tiles no query sees (hide_tiles). `stream`:
// the stream to run on (a fresh one gets a fresh workspace). `tuning`: the launch choices of the
// many-query tensor-core path (the CPU ignores them).
void test_attention(kc::DType dtype, int hk, int group, int d, int bs, int n_tokens, int n_q, bool unaligned_q,
                    Layout layout = Layout::kRandom, uint64_t hidden_tiles = 0, void *stream = nullptr,
                    kc::Tuning tuning = {}) {
    const int n_heads = hk * group, max_pos = 60;
    Layer l = make_layer(dtype, hk, d, bs, n_tokens, max_pos);
    const size_t es = kc::dtype_size(dtype);
    Buf<unsigned char> q_buf = random_dense(dtype, int64_t(n_q) * n_heads * d + 8, 2.0f);
    const void *q = q_buf.data() + (unaligned_q ? es : 0);
    Buf<int32_t> q_pos;
    for (int i = 0; i < n_q; ++i) q_pos.push_back(i == 1 ? -1 : randint(0, max_pos)); // query 1 sees nothing
    if (layout == Layout::kRandom) {
        // Keys no query can see hold NaN: they must never reach the arithmetic.
        for (int s = 0; s < n_tokens; ++s)
            if (s % 5 == 0) l.positions[size_t(s)] = max_pos + 10;
        for (int s = 0; s < n_tokens; ++s)
            if (l.positions[size_t(s)] > max_pos) hide_slot(l, s, l.positions[size_t(s)]);
    } else {
        for (int s = 0; s < n_tokens; ++s) l.positions[size_t(s)] = s;
    }
    if (layout == Layout::kCausalChunk) {
        for (int i = 0; i < n_q; ++i) q_pos[size_t(i)] = n_tokens - n_q + i;
    } else if (layout == Layout::kRecompute) {
        for (int i = 0; i < n_q; ++i) q_pos[size_t(i)] = randint(0, std::max(n_tokens - 1, 0));
        std::sort(q_pos.begin(), q_pos.end());
        const int last_query = q_pos.back();
        if (n_q > 1) q_pos[1] = -1;
        for (int s = 0; s < n_tokens; ++s) {
            if (s % 7 == 3) hide_slot(l, s, n_tokens + 10);
            else if (s > last_query) hide_slot(l, s, s);
        }
    }
    hide_tiles(l, hidden_tiles);
    const size_t out_elems = size_t(n_q) * n_heads * d;
    Buf<unsigned char> out_cpu(out_elems * es), out_gpu(out_elems * es, 0xff), out_again(out_elems * es, 0xff);
    Buf<float> lse_cpu(size_t(n_q) * n_heads), lse_gpu(size_t(n_q) * n_heads, 123.0f);
    const float scale = 1.0f / std::sqrt(float(d));
    kc::cpu::attention(l.view, n_q, n_heads, q, q_pos.data(), scale, out_cpu.data(), lse_cpu.data(), tuning, nullptr);
    kc::cuda::attention(l.view, n_q, n_heads, q, q_pos.data(), scale, out_gpu.data(), lse_gpu.data(), tuning, stream);
    device_sync();
    char name[240];
    std::snprintf(name, sizeof name,
                  "attention %s hk=%d group=%d d=%d bs=%d n=%d n_q=%d unaligned=%d layout=%d hidden=%llx warps=%d waves=%d",
                  dtype_name(dtype), hk, group, d, bs, n_tokens, n_q, int(unaligned_q), int(layout),
                  (unsigned long long)hidden_tiles, tuning.mma_warps, tuning.mma_split_waves);
    int bad = 0;
    for (size_t i = 0; i < out_elems; ++i) {
        const float a = kc::cpu::load(out_gpu.data(), int64_t(i), dtype), b = kc::cpu::load(out_cpu.data(), int64_t(i), dtype);
        bad += !close(a, b, 2e-3f, out_rtol(dtype));
    }
    for (size_t i = 0; i < lse_cpu.size(); ++i) bad += !close(lse_gpu[i], lse_cpu[i], 1e-4f, 1e-5f);
    expect(bad == 0, std::string(name) + " mismatches=" + std::to_string(bad));
    kc::cuda::attention(l.view, n_q, n_heads, q, q_pos.data(), scale, out_again.data(), nullptr, tuning, stream); // lse optional
    device_sync();
    expect(std::memcmp(out_gpu.data(), out_again.data(), out_elems * es) == 0, std::string(name) + " without lse");
}

// causal_chunk: positions 0..n_tokens-1 in slot order and the queries are the last n_q of them (a
// prefill chunk, as CONDUIT's text queries); otherwise random positions, query 1 sees nothing.
// The CUDA result must match the CPU and be bit-identical when run again (deterministic). With
// threshold 1 every visible score but the max counts as below: an exact count that only holds when
// pass 3 recomputes the max of pass 1 bit for bit. hidden_tiles: 64-slot key tiles no query sees.
void test_stats(kc::DType dtype, int hk, int group, int d, int bs, int n_tokens, int n_q, float threshold,
                bool causal_chunk = false, uint64_t hidden_tiles = 0) {
    const int n_heads = hk * group;
    Layer l = make_layer(dtype, hk, d, bs, n_tokens, 80);
    Buf<unsigned char> q_buf = random_dense(dtype, int64_t(n_q) * n_heads * d, 2.0f);
    Buf<int32_t> q_pos;
    for (int i = 0; i < n_q; ++i) q_pos.push_back(i == 1 ? -1 : randint(20, 80));
    if (causal_chunk) {
        for (int s = 0; s < n_tokens; ++s) l.positions[size_t(s)] = s;
        for (int i = 0; i < n_q; ++i) q_pos[size_t(i)] = n_tokens - n_q + i;
    } else {
        for (int s = 3; s < n_tokens; s += 7) hide_slot(l, s, 90); // seen by no query: NaN must not leak
    }
    hide_tiles(l, hidden_tiles);
    Buf<float> mass_cpu(size_t(n_tokens) + 1), mass_gpu(size_t(n_tokens) + 1, NAN), mass_again(size_t(n_tokens) + 1, NAN);
    Buf<float> below_cpu(static_cast<size_t>(n_heads)), below_gpu(static_cast<size_t>(n_heads), NAN);
    Buf<float> below_again(static_cast<size_t>(n_heads), NAN);
    Buf<float> lse_cpu(size_t(n_q) * n_heads), lse_gpu(size_t(n_q) * n_heads, NAN), lse_again(size_t(n_q) * n_heads, NAN);
    const float scale = 1.0f / std::sqrt(float(d));
    kc::cpu::attention_stats(l.view, n_q, n_heads, q_buf.data(), q_pos.data(), scale, threshold, mass_cpu.data(),
                             below_cpu.data(), lse_cpu.data(), nullptr);
    kc::cuda::attention_stats(l.view, n_q, n_heads, q_buf.data(), q_pos.data(), scale, threshold, mass_gpu.data(),
                              below_gpu.data(), lse_gpu.data(), nullptr);
    kc::cuda::attention_stats(l.view, n_q, n_heads, q_buf.data(), q_pos.data(), scale, threshold, mass_again.data(),
                              below_again.data(), lse_again.data(), nullptr);
    device_sync();
    char name[200];
    std::snprintf(name, sizeof name, "stats %s hk=%d group=%d d=%d bs=%d n=%d n_q=%d thr=%g causal=%d hidden=%llx",
                  dtype_name(dtype), hk, group, d, bs, n_tokens, n_q, double(threshold), int(causal_chunk),
                  (unsigned long long)hidden_tiles);
    int bad = 0;
    for (int s = 0; s < n_tokens; ++s) bad += !close(mass_gpu[size_t(s)], mass_cpu[size_t(s)], 1e-5f, 1e-4f);
    for (int h = 0; h < n_heads; ++h) bad += std::fabs(below_gpu[size_t(h)] - below_cpu[size_t(h)]) > 1.0f;
    for (size_t i = 0; i < lse_cpu.size(); ++i) bad += !close(lse_gpu[i], lse_cpu[i], 1e-4f, 1e-5f);
    expect(bad == 0, std::string(name) + " mismatches=" + std::to_string(bad));
    const bool same = std::memcmp(mass_gpu.data(), mass_again.data(), size_t(n_tokens) * sizeof(float)) == 0 &&
                      std::memcmp(below_gpu.data(), below_again.data(), size_t(n_heads) * sizeof(float)) == 0 &&
                      std::memcmp(lse_gpu.data(), lse_again.data(), lse_gpu.size() * sizeof(float)) == 0;
    expect(same, std::string(name) + " not deterministic");
    // attention_mass: the same mass in one pass over the keys, each row's lse given (the CPU's)
    Buf<float> mass_given_cpu(size_t(n_tokens) + 1, NAN), mass_given_gpu(size_t(n_tokens) + 1, NAN);
    kc::cpu::attention_mass(l.view, n_q, n_heads, q_buf.data(), q_pos.data(), scale, lse_cpu.data(),
                            mass_given_cpu.data(), nullptr);
    kc::cuda::attention_mass(l.view, n_q, n_heads, q_buf.data(), q_pos.data(), scale, lse_cpu.data(),
                             mass_given_gpu.data(), nullptr);
    device_sync();
    int bad_given = 0;
    for (int s = 0; s < n_tokens; ++s)
        bad_given += !close(mass_given_cpu[size_t(s)], mass_cpu[size_t(s)], 1e-5f, 1e-4f) +
                     !close(mass_given_gpu[size_t(s)], mass_cpu[size_t(s)], 1e-5f, 1e-4f);
    expect(bad_given == 0, std::string(name) + " attention_mass mismatches=" + std::to_string(bad_given));
    if (threshold == 1.0f) {
        int64_t visible_pairs = 0, seeing = 0;
        for (int i = 0; i < n_q; ++i) {
            int64_t n_visible = 0;
            for (int s = 0; s < n_tokens; ++s) n_visible += l.positions[size_t(s)] <= q_pos[size_t(i)];
            visible_pairs += n_visible;
            seeing += n_visible > 0;
        }
        int wrong = 0; // random scores: no ties at the max
        for (int h = 0; h < n_heads; ++h) wrong += below_gpu[size_t(h)] != float(visible_pairs - seeing);
        expect(wrong == 0, std::string(name) + " below-max counts off in " + std::to_string(wrong) + " heads");
    }
}

// attention_stats over every dtype and head_dim: the tensor-core path for bf16/f16 at head_dim 64/128,
// the CUDA-core path for the rest.
void test_stats_grid() {
    const kc::DType dtypes[] = {kc::DType::F32, kc::DType::F16, kc::DType::BF16};
    const int blocks[] = {1, 4, 16, 64, 256};
    const int groups[] = {1, 2, 3, 7, 8, 12};
    for (kc::DType t : dtypes)
        for (int d : {8, 80, 128, 256}) {
            test_stats(t, randint(1, 2), groups[randint(0, 5)], d, blocks[randint(0, 4)], randint(1, 150), randint(1, 4), 0.01f);
        }
    test_stats(kc::DType::F32, 1, 8, 64, 16, 300, 40, 0.5f); // query chunks in the key pass
    test_stats(kc::DType::F16, 2, 3, 64, 4, 50, 3, 0.0f);
    test_stats(kc::DType::BF16, 1, 2, 64, 4, 50, 3, 1.0f);
    // The key-major CUDA-core first pass (score_max_lse_kernel) with the bench shape's traits (bf16,
    // GQA groups 1 and 4, up to 64 text queries) at head_dim 96, where bf16 takes that path with the
    // row layout of head_dim 128 (16 lanes a key row): key counts off the 32-row tile, splits of
    // several key tiles (the emulator reports 4 SMs), more than 64 queries (two query chunks), causal
    // and scattered positions, thresholds 0 and 0.01; threshold 1 checks the max bit for bit. The same
    // cases at head_dim 128 (and f16 at 64) take the tensor-core path.
    for (int d : {96, 128})
        for (float thr : {0.0f, 0.01f}) {
            test_stats(kc::DType::BF16, 8, 1, d, 16, 300, randint(8, 24), thr, true); // 10 tiles, 2 per split
            test_stats(kc::DType::BF16, 2, 4, d, 16, randint(150, 180), randint(65, 70), thr, false);
            test_stats(kc::DType::BF16, 1, 4, d, 16, 2100 + randint(1, 31), 4, thr, true); // 66 tiles
            test_stats(kc::DType::F16, 1, 1, d == 96 ? 56 : 64, 1, 97, 1, thr, randint(0, 1));
        }
    test_stats(kc::DType::BF16, 8, 1, 96, 16, 301, 12, 1.0f, true);
    test_stats(kc::DType::BF16, 8, 1, 128, 16, 301, 12, 1.0f, true);
    test_stats(kc::DType::F32, 2, 3, 80, 4, 300, 67, 1.0f, false);
    // The tensor-core path at its edges: key counts off pass 1's 64-key tiles and pass 2's 128-key
    // blocks, GQA groups 1, 3, 4 and 8 (head-major rows, each head's queries padded to 16), 1 to 80
    // queries (several 64-row stages; row chunks where key blocks are few: the emulator has 4 SMs),
    // scattered positions (keys no query sees, query 1 sees nothing) and causal chunks; threshold 1
    // checks that pass 2 recomputes the max of pass 1 bit for bit.
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128}) {
            test_stats(t, 2, 4, d, 16, 129 + randint(0, 60), 1, 0.01f);
            test_stats(t, 1, 8, d, 4, 200 + randint(1, 63), 17, 1.0f);
            test_stats(t, 2, 1, d, 64, 250, 70, 0.01f, true);
            test_stats(t, 1, 3, d, 1, 97, 33, randint(0, 1) ? 0.0f : 1.0f, randint(0, 1));
        }
    test_stats(kc::DType::BF16, 8, 4, 128, 16, 130 + randint(1, 63), 64, 0.01f, true); // the bench's heads and queries
    test_stats(kc::DType::BF16, 2, 4, 128, 16, 300 + randint(1, 20), 80, 1.0f, true);
    // Pass 1's ring of key-tile stages (attention_mma_tile.cuh): a split of one tile (fewer than the
    // stages), hidden tiles inside splits of 3 tiles (2100 keys over 16 CTAs), every tile hidden.
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128}) {
            test_stats(t, 1, 2, d, 16, 40, 20, 0.01f);
            test_stats(t, 2, 4, d, 16, 330, 9, 1.0f, false, 0b01010);
            test_stats(t, 1, 4, d, 16, 200, 9, 0.01f, randint(0, 1), ~0ull);
        }
    test_stats(kc::DType::BF16, 1, 4, 128, 16, 2100, 4, 1.0f, true, (1ull << 4) | (1ull << 5) | (1ull << 6) | (1ull << 20));
}

// Pools or dense tensors: bit for bit in the emulator (same cosf/sinf as the CPU); on a GPU, whose
// cosf/sinf may differ by an ulp, rotated values may differ by one ulp of the dtype.
template <typename A, typename B> bool same_values(const A &a, const B &b, size_t bytes, kc::DType dtype) {
    if (std::memcmp(&a[0], &b[0], bytes) == 0) return true;
#ifdef CONDUIT_TEST_ON_GPU
    for (size_t i = 0; i < bytes / kc::dtype_size(dtype); ++i) {
        const float x = kc::cpu::load(&a[0], int64_t(i), dtype), y = kc::cpu::load(&b[0], int64_t(i), dtype);
        if (!(std::isnan(x) && std::isnan(y)) && !close(x, y, 1e-6f, dtype == kc::DType::F32 ? 1e-6f : 1e-2f)) return false;
    }
    return true;
#else
    (void)dtype;
    return false;
#endif
}

// A RoPE of the given type (0 none, 1 rotate-half, 2 M-RoPE with uneven sections) over a random number
// of frequencies of head_dim d (or n_freq of them); inv_freq receives the frequencies the returned
// Rope points at.
kc::Rope random_rope(int rope_type, int d, float scaling, Buf<float> &inv_freq, int n_freq = -1) {
    n_freq = rope_type ? (n_freq > 0 ? n_freq : randint(1, d / 2)) : 0;
    inv_freq.clear();
    for (int i = 0; i < n_freq; ++i) inv_freq.push_back(std::pow(10000.0f, -float(i) / float(std::max(n_freq, 1))));
    kc::Rope rope;
    rope.type = rope_type;
    rope.n_freq = n_freq;
    rope.inv_freq = inv_freq.data();
    rope.scaling = scaling;
    if (rope_type == 2) {
        rope.sections[0] = n_freq / 4;
        rope.sections[1] = (n_freq - rope.sections[0]) / 2;
        rope.sections[2] = n_freq - rope.sections[0] - rope.sections[1];
    }
    return rope;
}

// write_dense, copy_paged (with and without RoPE) and read_dense must match the CPU (same_values).
// n_freq: the RoPE's frequencies (default: random; d / 2, full rotary, takes the CUDA kernels' path
// that rotates K in registers whenever the chunks allow).
void test_copies(kc::DType dtype, int hk, int d, int bs, int n, int rope_type, bool use_slots, bool unaligned,
                 int n_freq = -1) {
    const size_t es = kc::dtype_size(dtype);
    Layer cpu_l = make_layer(dtype, hk, d, bs, n + 7, 100);
    Layer gpu_l = cpu_l;
    gpu_l.view.pool = gpu_l.pool.data();
    gpu_l.view.block_table = gpu_l.table.data();
    gpu_l.view.positions = gpu_l.positions.data();
    Buf<unsigned char> k = random_dense(dtype, int64_t(n) * hk * d + 8), v = random_dense(dtype, int64_t(n) * hk * d + 8);
    const void *kp = k.data() + (unaligned ? es : 0), *vp = v.data() + (unaligned ? es : 0);
    Buf<int32_t> slots(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) slots[size_t(i)] = i;
    std::shuffle(slots.begin(), slots.end(), rng);
    for (auto &s : slots) s += 7;
    const kc::Slots dst_slots = use_slots ? kc::Slots{slots.data(), 0} : kc::Slots{nullptr, 7};
    Buf<float> inv_freq;
    const kc::Rope rope = random_rope(rope_type, d, rope_type == 2 ? 1.0f : 0.9f, inv_freq, n_freq);
    Buf<int32_t> rope_pos;
    for (int i = 0; i < 3 * n; ++i) rope_pos.push_back(randint(0, 5000));
    const int32_t *rp = rope_type ? rope_pos.data() : nullptr;
    char name[200];
    std::snprintf(name, sizeof name, "copies %s hk=%d d=%d bs=%d n=%d rope=%d slots=%d unaligned=%d", dtype_name(dtype), hk,
                  d, bs, n, rope_type, int(use_slots), int(unaligned));

    kc::cpu::write_dense(cpu_l.view, dst_slots, n, kp, vp, rope, rp, nullptr);
    kc::cuda::write_dense(gpu_l.view, dst_slots, n, kp, vp, rope, rp, nullptr);
    device_sync();
    expect(same_values(cpu_l.pool, gpu_l.pool, cpu_l.pool.size(), dtype), std::string(name) + " write_dense");

    // Paged -> paged: half of the written slots, in shuffled order, into the same layout of a fresh
    // pool at slots 1.. (RoPE again when set: the restore path).
    Buf<int32_t> src_slots(slots.begin(), slots.begin() + n / 2);
    Buf<unsigned char> cpu_stage(cpu_l.pool.size(), 0xff), gpu_stage(gpu_l.pool.size(), 0xff);
    kc::LayerView cpu_dst = cpu_l.view, gpu_dst = gpu_l.view;
    cpu_dst.pool = cpu_stage.data();
    gpu_dst.pool = gpu_stage.data();
    const int m = n / 2;
    kc::cpu::copy_paged(cpu_l.view, kc::Slots{src_slots.data(), 0}, cpu_dst, kc::Slots{nullptr, 1}, m, rope, rp, nullptr);
    kc::cuda::copy_paged(gpu_l.view, kc::Slots{src_slots.data(), 0}, gpu_dst, kc::Slots{nullptr, 1}, m, rope, rp, nullptr);
    device_sync();
    expect(same_values(cpu_stage, gpu_stage, cpu_stage.size(), dtype), std::string(name) + " copy_paged");

    // The batched restore: two layers in one launch, each with its own source and destination block
    // tables (rows of a [2, n_blocks] table; layer 1 reads the blocks in reverse order and writes to
    // a second copy of the pool's blocks, so that the layers never write the same block).
    const size_t nb = cpu_l.table.size();
    const int32_t pool_blocks = int32_t(int64_t(cpu_l.pool.size() - 64) / (cpu_l.view.block_elems() * int64_t(es)));
    Buf<int32_t> src_tables(cpu_l.table.begin(), cpu_l.table.end());
    src_tables.insert(src_tables.end(), cpu_l.table.rbegin(), cpu_l.table.rend());
    Buf<int32_t> dst_tables(cpu_l.table.begin(), cpu_l.table.end());
    for (size_t i = 0; i < nb; ++i) dst_tables.push_back(src_tables[nb + i] + pool_blocks);
    Buf<unsigned char> cpu_multi(2 * cpu_l.pool.size(), 0xff), gpu_multi(2 * gpu_l.pool.size(), 0xff);
    // A fully written source pool: layer 1 reads slots that layer 0's layout left unwritten (NaN,
    // whose bits the two backends need not agree on).
    Buf<unsigned char> full_pool = random_dense(dtype, cpu_l.view.block_elems() * pool_blocks);
    kc::LayerView cpu_src2 = cpu_l.view, gpu_src2 = gpu_l.view;
    cpu_src2.pool = gpu_src2.pool = full_pool.data();
    cpu_src2.block_table = gpu_src2.block_table = src_tables.data();
    kc::LayerView cpu_dst2 = cpu_l.view, gpu_dst2 = gpu_l.view;
    cpu_dst2.block_table = gpu_dst2.block_table = dst_tables.data();
    cpu_dst2.pool = cpu_multi.data();
    gpu_dst2.pool = gpu_multi.data();
    kc::cpu::copy_paged_layers(cpu_src2, kc::Slots{src_slots.data(), 0}, int64_t(nb), cpu_dst2, kc::Slots{nullptr, 1},
                               int64_t(nb), 2, m, rope, rp, nullptr);
    kc::cuda::copy_paged_layers(gpu_src2, kc::Slots{src_slots.data(), 0}, int64_t(nb), gpu_dst2, kc::Slots{nullptr, 1},
                                int64_t(nb), 2, m, rope, rp, nullptr);
    device_sync();
    expect(same_values(cpu_multi, gpu_multi, cpu_multi.size(), dtype), std::string(name) + " copy_paged_layers");

    const size_t dense = size_t(cpu_l.view.n_tokens) * hk * d * es;
    Buf<unsigned char> kc_out(dense + 16, 0), vc_out(dense + 16, 0), kg_out(dense + 16, 1), vg_out(dense + 16, 1);
    const size_t off = unaligned ? es : 0;
    kc::cpu::read_dense(cpu_l.view, kc_out.data() + off, vc_out.data() + off, nullptr);
    kc::cuda::read_dense(gpu_l.view, kg_out.data() + off, vg_out.data() + off, nullptr);
    device_sync();
    // The layer read back holds what write_dense wrote: RoPE'd K may differ in the last bits on a real
    // GPU (its sin/cos), so the same tolerance as write_dense; V is never rotated.
    Buf<unsigned char> kc_read(kc_out.begin() + off, kc_out.begin() + off + dense);
    Buf<unsigned char> kg_read(kg_out.begin() + off, kg_out.begin() + off + dense);
    expect(same_values(kc_read, kg_read, dense, dtype) &&
               std::memcmp(vc_out.data() + off, vg_out.data() + off, dense) == 0,
           std::string(name) + " read_dense");
    Buf<unsigned char> v_only(dense + 16, 2);
    kc::cuda::read_dense(gpu_l.view, nullptr, v_only.data() + off, nullptr);
    device_sync();
    expect(std::memcmp(vc_out.data() + off, v_only.data() + off, dense) == 0, std::string(name) + " read_dense v only");
}

// Sequences of a decode step that share one pool. Sequence i's block table is row i of a [n_seqs,
// stride] table of shuffled blocks and it holds lengths[i] tokens (the first up to max_tokens, the
// others up to 300), random K and V in all of them but the last (write_last's); every other slot
// holds NaN. view points at them (pool, tables, lengths).
struct Batch {
    Buf<unsigned char> pool;
    Buf<int32_t> lengths, tables;
    kc::BatchView view;
};

Batch make_batch(kc::DType dtype, int hk, int d, int bs, int n_seqs, int max_tokens) {
    const int stride = (max_tokens + bs - 1) / bs;
    const size_t es = kc::dtype_size(dtype);
    Batch batch;
    kc::BatchView &view = batch.view;
    view.n_seqs = n_seqs;
    view.max_tokens = max_tokens;
    view.n_kv_heads = hk;
    view.head_dim = d;
    view.block_size = bs;
    view.dtype = dtype;
    view.table_stride = stride;
    Buf<int32_t> &lengths = batch.lengths, &tables = batch.tables;
    tables.assign(size_t(n_seqs) * stride, 0);
    int total_blocks = 1;
    for (int i = 0; i < n_seqs; ++i) {
        lengths.push_back(randint(1, i == 0 ? max_tokens : std::min(max_tokens, 300))); // the new token included
        total_blocks += (lengths.back() + bs - 1) / bs;
    }
    Buf<int32_t> ids(static_cast<size_t>(total_blocks));
    for (int b = 0; b < total_blocks; ++b) ids[size_t(b)] = b;
    std::shuffle(ids.begin(), ids.end(), rng);
    const int64_t block_elems = int64_t(2) * hk * bs * d;
    batch.pool.assign(size_t(block_elems * total_blocks) * es + 64, 0xff);
    for (int i = 0, next = 0; i < n_seqs; ++i) {
        kc::LayerView layer = view.layout();
        layer.pool = batch.pool.data();
        layer.block_table = tables.data() + size_t(i) * stride;
        for (int b = 0; b < (lengths[size_t(i)] + bs - 1) / bs; ++b) tables[size_t(i) * stride + b] = ids[size_t(next++)];
        for (int s = 0; s < lengths[size_t(i)] - 1; ++s) // all but the new token, which write_last writes
            for (int h = 0; h < hk; ++h)
                for (int e = 0; e < d; ++e) {
                    kc::cpu::store(batch.pool.data(), kc::cpu::k_offset(layer, s, h) + e, uniform(-1, 1), dtype);
                    kc::cpu::store(batch.pool.data(), kc::cpu::k_offset(layer, s, h) + kc::cpu::v_delta(layer) + e,
                                   uniform(-1, 1), dtype);
                }
    }
    view.pool = batch.pool.data();
    view.block_tables = tables.data();
    view.n_tokens = lengths.data();
    return batch;
}

// batch_attention on the CUDA side against the CPU's, for a random q: out and lse compared into
// `bad`; out_gpu and lse_gpu receive the CUDA result.
void check_batch_attention(const kc::BatchView &cpu_view, const kc::BatchView &gpu_view, int n_heads,
                           Buf<unsigned char> &q, Buf<unsigned char> &workspace, Buf<unsigned char> &out_gpu,
                           Buf<float> &lse_gpu, int &bad) {
    const kc::DType dtype = cpu_view.dtype;
    const size_t out_elems = size_t(cpu_view.n_seqs) * n_heads * cpu_view.head_dim;
    Buf<unsigned char> out_cpu(out_elems * kc::dtype_size(dtype));
    Buf<float> lse_cpu(size_t(cpu_view.n_seqs) * n_heads);
    out_gpu.assign(out_elems * kc::dtype_size(dtype), 0xff);
    lse_gpu.assign(lse_cpu.size(), 123.0f);
    const float scale = 1.0f / std::sqrt(float(cpu_view.head_dim));
    kc::cpu::batch_attention(cpu_view, n_heads, q.data(), scale, out_cpu.data(), lse_cpu.data(), nullptr, 0, nullptr);
    kc::cuda::batch_attention(gpu_view, n_heads, q.data(), scale, out_gpu.data(), lse_gpu.data(), workspace.data(),
                              workspace.size(), nullptr);
    device_sync();
    for (size_t i = 0; i < out_elems; ++i)
        bad += !close(kc::cpu::load(out_gpu.data(), int64_t(i), dtype), kc::cpu::load(out_cpu.data(), int64_t(i), dtype),
                      2e-3f, out_rtol(dtype));
    for (size_t i = 0; i < lse_cpu.size(); ++i) bad += !close(lse_gpu[i], lse_cpu[i], 1e-4f, 1e-5f);
}

// batch_write_attention from the pool before write_last (`unwritten`) against write_last then
// batch_attention on the CUDA side (`written`, the pool after write_last): the same pool bits, the
// same output and lse bits.
void check_write_attention(const kc::BatchView &written, const Buf<unsigned char> &unwritten, const Buf<unsigned char> &k,
                           const Buf<unsigned char> &v, const kc::Rope &rope, const int32_t *rope_pos, int n_heads,
                           const char *name) {
    const kc::DType dtype = written.dtype;
    const size_t out_bytes = size_t(written.n_seqs) * n_heads * written.head_dim * kc::dtype_size(dtype);
    Buf<unsigned char> fused_pool = unwritten, q = random_dense(dtype, int64_t(written.n_seqs) * n_heads * written.head_dim, 2.0f);
    kc::BatchView fused = written;
    fused.pool = fused_pool.data();
    const size_t ws_bytes = kc::cuda::batch_attention_workspace_bytes(written, n_heads) + 16;
    Buf<unsigned char> ws_two(ws_bytes), ws_one(ws_bytes), out_two(out_bytes), out_one(out_bytes);
    Buf<float> lse_two(size_t(written.n_seqs) * n_heads), lse_one(lse_two.size());
    const float scale = 1.0f / std::sqrt(float(written.head_dim));
    kc::cuda::batch_attention(written, n_heads, q.data(), scale, out_two.data(), lse_two.data(), ws_two.data(),
                              ws_bytes, nullptr);
    kc::cuda::batch_write_attention(fused, k.data(), v.data(), rope, rope_pos, n_heads, q.data(), scale, out_one.data(),
                                    lse_one.data(), ws_one.data(), ws_bytes, nullptr);
    device_sync();
    const size_t pool_bytes = unwritten.size();
    const bool same = std::memcmp(fused_pool.data(), written.pool, pool_bytes) == 0 &&
                      std::memcmp(out_one.data(), out_two.data(), out_bytes) == 0 &&
                      std::memcmp(lse_one.data(), lse_two.data(), lse_one.size() * sizeof(float)) == 0;
    expect(same, std::string(name) + " batch_write_attention: other bits than write_last + batch_attention");
}

// A decode step over a batch of sequences (make_batch): write_last (with and without RoPE) then
// batch_attention, CUDA against the CPU. The split plan depends on the capacity only, so a capacity
// far above the lengths checks the empty splits too. empty_seqs: after write_last, the odd-numbered
// sequences are cut to length 0 (they must give out = 0, lse = -inf). replays: the attention again on
// the same workspace (a graph replay: the splits' arrival counters must be back at zero), each time
// with a new q (against the CPU) and then the first q (the first result, bit for bit); in the
// emulator each replay runs the CTAs in another shuffled order.
void test_step(kc::DType dtype, int hk, int group, int d, int bs, int n_seqs, int max_tokens, int rope_type,
               bool empty_seqs = false, int replays = 0) {
    const int n_heads = hk * group;
    Batch batch = make_batch(dtype, hk, d, bs, n_seqs, max_tokens);
    Buf<unsigned char> &cpu_pool = batch.pool;
    Buf<int32_t> &lengths = batch.lengths;
    Buf<unsigned char> gpu_pool = cpu_pool;
    kc::BatchView cpu_view = batch.view, gpu_view = batch.view;
    gpu_view.pool = gpu_pool.data();

    Buf<float> inv_freq;
    const kc::Rope rope = random_rope(rope_type, d, 1.0f, inv_freq);
    Buf<int32_t> rope_pos;
    for (int i = 0; i < 3 * n_seqs; ++i) rope_pos.push_back(randint(0, 5000));
    const int32_t *rp = rope_type ? rope_pos.data() : nullptr;
    Buf<unsigned char> k = random_dense(dtype, int64_t(n_seqs) * hk * d), v = random_dense(dtype, int64_t(n_seqs) * hk * d);
    char name[200];
    std::snprintf(name, sizeof name, "step %s hk=%d group=%d d=%d bs=%d n_seqs=%d max_tokens=%d rope=%d empty=%d",
                  dtype_name(dtype), hk, group, d, bs, n_seqs, max_tokens, rope_type, int(empty_seqs));
    const Buf<unsigned char> unwritten = cpu_pool;
    kc::cpu::write_last(cpu_view, k.data(), v.data(), rope, rp, nullptr);
    kc::cuda::write_last(gpu_view, k.data(), v.data(), rope, rp, nullptr);
    device_sync();
    expect(same_values(cpu_pool, gpu_pool, cpu_pool.size(), dtype), std::string(name) + " write_last");
    check_write_attention(gpu_view, unwritten, k, v, rope, rp, n_heads, name);

    gpu_pool = cpu_pool; // attention over the same bits on both sides
    for (int i = 1; empty_seqs && i < n_seqs; i += 2) lengths[size_t(i)] = 0;
    Buf<unsigned char> q = random_dense(dtype, int64_t(n_seqs) * n_heads * d, 2.0f);
    Buf<unsigned char> workspace(kc::cuda::batch_attention_workspace_bytes(gpu_view, n_heads) + 16); // zero-filled
    Buf<unsigned char> out_gpu, out_again;
    Buf<float> lse_gpu, lse_again;
    int bad = 0;
    check_batch_attention(cpu_view, gpu_view, n_heads, q, workspace, out_gpu, lse_gpu, bad);
    expect(bad == 0, std::string(name) + " batch_attention mismatches=" + std::to_string(bad));
    for (int replay = 1; replay <= replays; ++replay) {
        set_block_order(uint32_t(replay));
        Buf<unsigned char> q_new = random_dense(dtype, int64_t(n_seqs) * n_heads * d, 2.0f);
        bad = 0;
        check_batch_attention(cpu_view, gpu_view, n_heads, q_new, workspace, out_again, lse_again, bad);
        expect(bad == 0, std::string(name) + " replay " + std::to_string(replay) + " mismatches=" + std::to_string(bad));
        check_batch_attention(cpu_view, gpu_view, n_heads, q, workspace, out_again, lse_again, bad);
        const bool same = std::memcmp(out_again.data(), out_gpu.data(), out_gpu.size()) == 0 &&
                          std::memcmp(lse_again.data(), lse_gpu.data(), lse_gpu.size() * sizeof(float)) == 0;
        expect(same, std::string(name) + " replay " + std::to_string(replay) + " of the first q: other bits");
    }
    set_block_order(0);
}

// The fp8 pool (kernels.h): write_dense with and without RoPE, read_dense, copy_paged, attention over
// the layer and a decode step (write_last, batch_attention) of two sequences, CUDA against the CPU.
// Without RoPE the pools must hold the same bytes; with it the read-back rows the same values up to
// the rotation's last bits (a rounding of K to e4m3 may then differ by one step). q_scale: the
// queries' magnitude; with `spread`, each K and V row is scaled by its own power of two in
// [2^-20, 2^10], so that the row scales (which the fp8 decode kernel folds into its scores and
// weights) span the range real layers give them.
void test_fp8(kc::DType dtype, int hk, int group, int d, int bs, int n, int rope_type, float q_scale = 2.0f,
              bool spread = false) {
    char name[160];
    std::snprintf(name, sizeof name, "fp8 %s hk=%d group=%d d=%d bs=%d n=%d rope=%d q=%g spread=%d", dtype_name(dtype),
                  hk, group, d, bs, n, rope_type, double(q_scale), int(spread));
    kc::LayerView view;
    view.n_kv_heads = hk;
    view.head_dim = d;
    view.block_size = bs;
    view.dtype = dtype;
    view.fp8 = true;
    view.n_tokens = n;
    const int n_blocks = (n + bs - 1) / bs, total = 2 * n_blocks + 2; // room for a second sequence's copy
    Buf<unsigned char> cpu_pool(size_t(total) * size_t(view.block_bytes()), 0), gpu_pool;
    Buf<int32_t> ids(static_cast<size_t>(total));
    for (int i = 0; i < total; ++i) ids[size_t(i)] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    Buf<int32_t> table(ids.begin(), ids.begin() + n_blocks), table2(ids.begin() + n_blocks, ids.begin() + 2 * n_blocks);
    Buf<int32_t> positions;
    for (int s = 0; s < n; ++s) positions.push_back(s);
    view.block_table = table.data();
    view.positions = positions.data();
    Buf<float> inv_freq;
    const kc::Rope rope = random_rope(rope_type, d, 1.0f, inv_freq);
    Buf<int32_t> rope_pos;
    for (int i = 0; i < 3 * n; ++i) rope_pos.push_back(randint(0, 5000));
    const int32_t *rp = rope_type ? rope_pos.data() : nullptr;
    Buf<unsigned char> k = random_dense(dtype, int64_t(n) * hk * d, 4.0f), v = random_dense(dtype, int64_t(n) * hk * d);
    if (spread)
        for (int64_t row = 0; row < int64_t(n) * hk; ++row)
            for (Buf<unsigned char> *kv : {&k, &v}) {
                const float factor = std::ldexp(1.0f, randint(-20, 10));
                for (int64_t i = row * d; i < (row + 1) * d; ++i)
                    kc::cpu::store(kv->data(), i, kc::cpu::load(kv->data(), i, dtype) * factor, dtype);
            }
    gpu_pool = cpu_pool;
    kc::LayerView cpu_view = view, gpu_view = view;
    cpu_view.pool = cpu_pool.data();
    gpu_view.pool = gpu_pool.data();
    kc::cpu::write_dense(cpu_view, kc::Slots{}, n, k.data(), v.data(), rope, rp, nullptr);
    kc::cuda::write_dense(gpu_view, kc::Slots{}, n, k.data(), v.data(), rope, rp, nullptr);
    device_sync();
    if (!rope_type) expect(cpu_pool == gpu_pool, std::string(name) + " write_dense bytes");
    const size_t dense = size_t(n) * hk * d * kc::dtype_size(dtype);
    Buf<unsigned char> kc_out(dense), vc_out(dense), kg_out(dense, 1), vg_out(dense, 1);
    kc::cpu::read_dense(cpu_view, kc_out.data(), vc_out.data(), nullptr);
    kc::cuda::read_dense(gpu_view, kg_out.data(), vg_out.data(), nullptr);
    device_sync();
    int bad = 0;
    for (size_t i = 0; i < size_t(n) * hk * d; ++i) {
        const float kc_x = kc::cpu::load(kc_out.data(), int64_t(i), dtype), kg_x = kc::cpu::load(kg_out.data(), int64_t(i), dtype);
        bad += !close(kg_x, kc_x, 1e-6f, rope_type ? 0.07f : 0.0f);
    }
    expect(bad == 0 && vc_out == vg_out, std::string(name) + " read_dense mismatches=" + std::to_string(bad));

    gpu_pool = cpu_pool; // the same bits on both sides from here
    kc::LayerView cpu_copy = cpu_view, gpu_copy = gpu_view;
    cpu_copy.block_table = gpu_copy.block_table = table2.data();
    kc::cpu::copy_paged(cpu_view, kc::Slots{}, cpu_copy, kc::Slots{}, n, kc::Rope{}, nullptr, nullptr);
    kc::cuda::copy_paged(gpu_view, kc::Slots{}, gpu_copy, kc::Slots{}, n, kc::Rope{}, nullptr, nullptr);
    device_sync();
    expect(cpu_pool == gpu_pool, std::string(name) + " copy_paged bytes");

    const int n_heads = hk * group, n_q = randint(0, 1) ? 1 : randint(2, 20); // one query: the fp8 decode kernel
    Buf<unsigned char> q = random_dense(dtype, int64_t(n_q) * n_heads * d, q_scale);
    Buf<int32_t> q_pos;
    for (int i = 0; i < n_q; ++i) q_pos.push_back(randint(0, n));
    const size_t out_elems = size_t(n_q) * n_heads * d;
    Buf<unsigned char> out_c(out_elems * kc::dtype_size(dtype)), out_g(out_elems * kc::dtype_size(dtype), 0xff);
    Buf<float> lse_c(size_t(n_q) * n_heads), lse_g(size_t(n_q) * n_heads, 123.0f);
    const float scale = 1.0f / std::sqrt(float(d));
    kc::cpu::attention(cpu_view, n_q, n_heads, q.data(), q_pos.data(), scale, out_c.data(), lse_c.data(), {}, nullptr);
    kc::cuda::attention(gpu_view, n_q, n_heads, q.data(), q_pos.data(), scale, out_g.data(), lse_g.data(), {}, nullptr);
    device_sync();
    bad = 0;
    for (size_t i = 0; i < out_elems; ++i)
        bad += !close(kc::cpu::load(out_g.data(), int64_t(i), dtype), kc::cpu::load(out_c.data(), int64_t(i), dtype), 2e-3f,
                      out_rtol(dtype));
    for (size_t i = 0; i < lse_c.size(); ++i) bad += !close(lse_g[i], lse_c[i], 1e-4f, 1e-5f);
    expect(bad == 0, std::string(name) + " attention mismatches=" + std::to_string(bad));

    // A decode step over the layer and its copy, one token appended to each.
    if (n >= n_blocks * bs) return; // no free slot in the last block
    Buf<int32_t> tables(table.begin(), table.end());
    tables.insert(tables.end(), table2.begin(), table2.end());
    Buf<int32_t> lengths{n + 1, n + 1};
    kc::BatchView batch;
    batch.pool = gpu_pool.data();
    batch.block_tables = tables.data();
    batch.n_tokens = lengths.data();
    batch.table_stride = n_blocks;
    batch.n_seqs = 2;
    batch.max_tokens = n_blocks * bs;
    batch.n_kv_heads = hk;
    batch.head_dim = d;
    batch.block_size = bs;
    batch.dtype = dtype;
    batch.fp8 = true;
    kc::BatchView cpu_batch = batch;
    cpu_batch.pool = cpu_pool.data();
    Buf<unsigned char> k1 = random_dense(dtype, int64_t(2) * hk * d), v1 = random_dense(dtype, int64_t(2) * hk * d);
    kc::cpu::write_last(cpu_batch, k1.data(), v1.data(), kc::Rope{}, nullptr, nullptr);
    kc::cuda::write_last(batch, k1.data(), v1.data(), kc::Rope{}, nullptr, nullptr);
    device_sync();
    expect(cpu_pool == gpu_pool, std::string(name) + " write_last bytes");
    Buf<unsigned char> qs = random_dense(dtype, int64_t(2) * n_heads * d, q_scale);
    Buf<unsigned char> workspace(kc::cuda::batch_attention_workspace_bytes(batch, n_heads) + 16);
    Buf<unsigned char> out_step;
    Buf<float> lse_step;
    bad = 0;
    check_batch_attention(cpu_batch, batch, n_heads, qs, workspace, out_step, lse_step, bad);
    expect(bad == 0, std::string(name) + " batch_attention mismatches=" + std::to_string(bad));
}

void test_fp8_grid() {
    const int blocks[] = {1, 4, 16}, groups[] = {1, 2, 3, 7, 8, 12};
    for (kc::DType t : {kc::DType::F32, kc::DType::F16, kc::DType::BF16})
        for (int d : {8, 64, 128, 256}) {
            test_fp8(t, randint(1, 3), groups[randint(0, 5)], d, blocks[randint(0, 2)], randint(1, 70), 0);
            test_fp8(t, randint(1, 3), groups[randint(0, 5)], d, blocks[randint(0, 2)], randint(1, 70), randint(1, 2));
        }
    // The tensor-core paths: many queries over a staged copy; the fp8 decode kernel for the step (and
    // for one query, when n_q comes out 1), with splits over long sequences.
    test_fp8(kc::DType::BF16, 2, 4, 128, 16, 300, 1);
    test_fp8(kc::DType::F16, 1, 7, 64, 16, 1500, 0);
    test_fp8(kc::DType::BF16, 2, 12, 128, 4, 2047, 0);
    // The fp8 decode kernel's ranges: multi-head attention, row scales from 2^-20 to 2^10, bf16 queries
    // past f16's range (it scales them into it), partial units at a sequence's end.
    test_fp8(kc::DType::BF16, 3, 1, 128, 16, 1000, 0, 2.0f, true);
    test_fp8(kc::DType::F16, 2, 1, 64, 4, 333, 1, 2.0f, true);
    test_fp8(kc::DType::BF16, 1, 16, 128, 16, 777, 0, 3e5f, true);
    test_fp8(kc::DType::BF16, 2, 5, 64, 1, 90, 0, 1e-3f, true);
}

// One workspace for every batch size of a step (sized as step_create does: the largest over 1..
// max_seqs, zero-filled once), used by batch sizes that change between calls, with the CTAs in a new
// shuffled order each time (emulator): the counters sit where the partials of no size reach.
void test_step_sizes(kc::DType dtype, int hk, int group, int d, int bs, int max_seqs, int max_tokens) {
    const int n_heads = hk * group;
    Batch batch = make_batch(dtype, hk, d, bs, max_seqs, max_tokens);
    Buf<unsigned char> k = random_dense(dtype, int64_t(max_seqs) * hk * d), v = random_dense(dtype, int64_t(max_seqs) * hk * d);
    kc::cpu::write_last(batch.view, k.data(), v.data(), kc::Rope{}, nullptr, nullptr);
    kc::BatchView view = batch.view;
    size_t bytes = 0;
    for (view.n_seqs = 1; view.n_seqs <= max_seqs; ++view.n_seqs)
        bytes = std::max(bytes, kc::cuda::batch_attention_workspace_bytes(view, n_heads));
    Buf<unsigned char> workspace(bytes, 0), out_gpu;
    Buf<float> lse_gpu;
    const int sizes[] = {max_seqs, 1, 2, max_seqs, 1, 3};
    for (int i = 0; i < 6; ++i) {
        view.n_seqs = std::min(sizes[i], max_seqs);
        set_block_order(uint32_t(i + 1));
        Buf<unsigned char> q = random_dense(dtype, int64_t(view.n_seqs) * n_heads * d, 2.0f);
        int bad = 0;
        check_batch_attention(view, view, n_heads, q, workspace, out_gpu, lse_gpu, bad);
        char name[200];
        std::snprintf(name, sizeof name, "step sizes %s hk=%d group=%d d=%d max_seqs=%d max_tokens=%d: n_seqs=%d (call %d)",
                      dtype_name(dtype), hk, group, d, max_seqs, max_tokens, view.n_seqs, i);
        expect(bad == 0, std::string(name) + " mismatches=" + std::to_string(bad));
    }
    set_block_order(0);
}

// One decode query through attention() (random positions: masked and NaN slots; one split or
// several) and batch steps (one long sequence and short ones, some empty), lengths off the 64-slot
// tile, at the shapes of the tensor-core decode (attention_mma_decode.cu): bf16/f16, head_dim 64/128,
// GQA groups 2..16 (8 and below: half the mma rows are padding; 12: both halves) and multi-head
// attention (group 1: the CUDA-core kernel, which decode_mma_applies keeps it on); then the CUDA-core
// kernel with GQA groups, at head_dim 96 (bf16: the row layout of head_dim 128).
void test_decode_grid() {
    const int blocks[] = {1, 4, 16, 64};
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128})
            for (int group : {1, 2, 4, 8, 12}) {
                test_attention(t, randint(1, 2), group, d, blocks[randint(0, 3)], randint(1, 130), 1, randint(0, 1));
                test_attention(t, 1, group, d, blocks[randint(0, 3)], randint(700, 1500), 1, false);
                test_step(t, 2, group, d, blocks[randint(0, 3)], randint(2, 4), randint(65, 600), 0, true);
            }
    test_step(kc::DType::BF16, 1, 4, 128, 16, 4, 2500, 0, true); // many splits, short and empty sequences
    test_step(kc::DType::F16, 2, 8, 64, 64, 3, 64, 0);           // exactly one tile of capacity
    test_attention(kc::DType::BF16, 2, 4, 128, 16, 0, 1, false);  // no keys at all
    test_attention(kc::DType::F16, 1, 16, 64, 4, 64, 1, true);     // a full 16-row tile, one key tile
    for (int group : {2, 4, 8, 12}) {
        test_attention(kc::DType::BF16, 1, group, 96, blocks[randint(0, 3)], randint(700, 1500), 1, false);
        test_step(kc::DType::BF16, 2, group, 96, blocks[randint(0, 3)], randint(2, 4), randint(65, 600), 0, true);
    }
}

// Splits merged in the last CTA of each row group (attention_merge.cuh) on the CUDA-core kernel (MHA;
// an f32 layer with two queries; GQA 12 in two head tiles), and by the merge kernel after the
// tensor-core decode (GQA 4; GQA 16 at head_dim 64), through attention() and batch steps: the
// emulator's CTAs in shuffled orders (the last to arrive is any split, the merging CTA any of them),
// replays on one workspace (the counters back at zero), batch sizes that change under one workspace,
// and, told of 40 SMs (160 resident CTAs), up to the 128 splits a row may have.
void test_split_merge_grid() {
    for (uint32_t seed = 1; seed <= 3; ++seed) {
        set_block_order(seed);
        test_attention(kc::DType::BF16, 1, 1, 128, 16, randint(700, 1500), 1, false);
        test_attention(kc::DType::F32, 2, 3, 80, 8, randint(300, 700), 2, false);
        test_attention(kc::DType::F32, 1, 12, 64, 4, randint(300, 700), 1, true);
        test_attention(kc::DType::F16, 1, 4, 128, 16, randint(700, 1500), 1, false);
        test_attention(kc::DType::BF16, 1, 16, 64, 4, randint(700, 1500), 1, false);
    }
    set_block_order(0);
    test_step(kc::DType::BF16, 2, 4, 128, 16, 3, 900, 0, true, 3);
    test_step(kc::DType::F16, 1, 16, 64, 4, 2, 700, 0, false, 2);
    test_step(kc::DType::F32, 2, 1, 64, 16, 2, 800, 0, true, 2);
    test_step(kc::DType::BF16, 1, 1, 128, 16, 1, 1500, 0, false, 2);
    test_step_sizes(kc::DType::BF16, 1, 4, 128, 16, 4, 2100);
    test_step_sizes(kc::DType::F16, 2, 1, 64, 8, 3, 1000);
#ifndef CONDUIT_TEST_ON_GPU
    emu::g_sm_count = 40;
    set_block_order(4);
    test_attention(kc::DType::BF16, 1, 4, 64, 16, 16384, 1, false); // 128 splits of 128 slots
    test_attention(kc::DType::F16, 1, 1, 64, 16, 16384, 1, false);  // the CUDA-core kernel: 128 splits too
    test_attention(kc::DType::F32, 1, 2, 64, 16, 5000, 1, false);   // 40 splits
    set_block_order(0);
    test_step(kc::DType::BF16, 1, 4, 64, 16, 1, 16384, 0, false, 1);
    emu::g_sm_count = 4;
#endif
}

// The tensor-core attention (attention_mma.cu) with its keys split: the emulator's 4 SMs hold 16 CTAs,
// so a few row tiles over more than 256 keys split (whole 64-slot tiles, about 256 slots or more a
// split). The plans in the comments are the emulator's. Causal chunks at the end of the keys (CONDUIT's
// text pass; a row's keys end inside the last split), scattered queries in order (a recompute: early
// rows see nothing in the later splits, partial 0 and lse -inf; whole CTAs skip them), NaN in every
// slot no row sees, query 1 seeing no key at all, splits that do not divide the tiles evenly, many
// splits, 8 warps, and partials that cannot be allocated (one split).
void test_mma_split_grid() {
    const int blocks[] = {1, 4, 16, 64};
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128}) {
            // MHA: 2 CTAs, 7 splits of 4, 4, 4, 4, 4, 4 and 1 tiles (the last tile holds 4 keys).
            test_attention(t, 2, 1, d, blocks[randint(0, 3)], 1540, 40, false, Layout::kCausalChunk);
            // GQA 4: 4 CTAs, 3 splits of 4, 4 and 3 tiles.
            test_attention(t, 2, 4, d, blocks[randint(0, 3)], 700, 20, randint(0, 1), Layout::kRecompute);
        }
    test_attention(kc::DType::BF16, 1, 7, 128, 16, 1800, 20, false, Layout::kCausalChunk); // 3 CTAs, 5 splits: 6 .. 5 tiles
    test_attention(kc::DType::F16, 1, 8, 64, 4, 3000, 16, false, Layout::kRecompute);      // 2 CTAs, 8 splits: 6 .. 5 tiles
    test_attention(kc::DType::BF16, 1, 1, 128, 16, 4100, 30, false, Layout::kCausalChunk); // 1 CTA, 13 splits of 5 tiles
    test_attention(kc::DType::F16, 1, 2, 64, 64, 3500, 24, false, Layout::kRecompute);     // 1 CTA, 14 splits: 4 .. 3 tiles
    // 8 warps (the emulator takes them from 8 CTAs of 128 rows): 8 CTAs, 2 splits of 5 tiles.
    test_attention(kc::DType::BF16, 2, 1, 64, 16, 600, 512, false, Layout::kCausalChunk);
    test_attention(kc::DType::F16, 2, 1, 128, 16, 600, 512, false, Layout::kRecompute);
    // Launch choices (kc::Tuning): 8 warps where 4 would be chosen (2 CTAs, 7 splits), 4 warps where 8
    // would be (16 CTAs, one split), three waves of splits (1 CTA: 32 splits of 4 tiles, not 16 of 8).
    test_attention(kc::DType::BF16, 2, 1, 64, 16, 1540, 40, false, Layout::kCausalChunk, 0, nullptr, {8, 0});
    test_attention(kc::DType::F16, 2, 1, 128, 16, 600, 512, false, Layout::kRecompute, 0, nullptr, {4, 0});
    test_attention(kc::DType::BF16, 1, 1, 64, 16, 8000, 20, false, Layout::kCausalChunk, 0, nullptr, {0, 3});
#ifndef CONDUIT_TEST_ON_GPU
    // A fresh stream whose workspace cannot be allocated: one split, the same answer.
    emu::g_malloc_limit = 0;
    test_attention(kc::DType::BF16, 2, 1, 128, 16, 1540, 40, false, Layout::kCausalChunk, 0, reinterpret_cast<void *>(0x5eed));
    emu::g_malloc_limit = SIZE_MAX;
#endif
}

// Top-k: the CUDA radix select against the CPU nth_element (same order key, same tie rule), both
// writing int32 and int64, with one workspace reused across calls (it must come back zeroed).
void test_topk(int n, int k, const std::string &kind, Buf<unsigned char> &workspace) {
    Buf<float> scores(size_t(n) + 1);
    const float special[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e38f, -1e38f, 1.0f};
    for (int i = 0; i < n; ++i) {
        if (kind == "ties") scores[i] = float(randint(0, 3));
        else if (kind == "special") scores[i] = special[randint(0, 8)];
        else if (kind == "equal") scores[i] = 2.5f;
        else scores[i] = uniform(-1e3f, 1e3f);
    }
    std::vector<unsigned char> cpu_ws(kc::cpu::topk_workspace_bytes(n) + 8);
    Buf<int32_t> expected(size_t(k) + 1, -1), got32(size_t(k) + 1, -2);
    Buf<int64_t> got64(size_t(k) + 1, -3);
    kc::cpu::topk(scores.data(), n, k, expected.data(), false, cpu_ws.data(), cpu_ws.size(), nullptr);
    kc::cuda::topk(scores.data(), n, k, got32.data(), false, workspace.data(), workspace.size(), nullptr);
    kc::cuda::topk(scores.data(), n, k, got64.data(), true, workspace.data(), workspace.size(), nullptr);
    device_sync();
    bool same = true, sorted = true;
    for (int i = 0; i < k; ++i) {
        same = same && got32[i] == expected[i] && got64[i] == expected[i];
        sorted = sorted && (i == 0 || expected[i - 1] < expected[i]);
    }
    // The CPU result itself: no unselected score ranks above a selected one.
    std::vector<bool> chosen(size_t(n), false);
    for (int i = 0; i < k; ++i) chosen[size_t(expected[i])] = true;
    uint32_t min_in = 0xffffffffu, max_out = 0;
    for (int i = 0; i < n; ++i) {
        const uint32_t key = kc::topk_order_key(scores[i]);
        if (chosen[size_t(i)]) min_in = std::min(min_in, key);
        else max_out = std::max(max_out, key);
    }
    const bool split = k == 0 || k == n || min_in >= max_out;
    bool zeroed = true;
    for (size_t i = 0; i < 3 * 2048 * 4 + 12; ++i) zeroed = zeroed && workspace[i] == 0; // histograms, tickets
    expect(same && sorted && split && zeroed && got32[size_t(k)] == -2 && got64[size_t(k)] == -3,
           "topk n=" + std::to_string(n) + " k=" + std::to_string(k) + " " + kind);
}

void test_topk_grid() {
    const int n_max = 300000;
    Buf<unsigned char> workspace(kc::cuda::topk_workspace_bytes(n_max), 0);
    for (int n : {1, 2, 31, 257, 1024, 1025, 5000, 100000, n_max})
        for (int k : {1, n / 10, n - 1, n})
            for (const char *kind : {"random", "ties", "special", "equal"})
                if (k >= 0 && (n <= 5000 || k == n / 10)) test_topk(n, k, kind, workspace);
}

} // namespace

int main(int argc, char **argv) {
    // One grid alone, by name (for iterating on one kernel): stats, split, fp8, decode (the decode and
    // split-merge grids) or merge.
    if (argc > 1) {
        const std::string grid = argv[1];
        if (grid == "stats") test_stats_grid();
        else if (grid == "fp8") test_fp8_grid();
        else if (grid == "split") test_mma_split_grid();
        else if (grid == "decode") test_decode_grid();
        if (grid == "decode" || grid == "merge") test_split_merge_grid();
        std::printf("%s: %d checks, %d failures\n", grid.c_str(), checks, failures);
        return failures == 0 && checks > 0 ? 0 : 1;
    }
    const kc::DType dtypes[] = {kc::DType::F32, kc::DType::F16, kc::DType::BF16};
    const int dims[] = {8, 64, 80, 96, 128, 256};
    const int blocks[] = {1, 4, 16, 64, 256};
    const int groups[] = {1, 2, 3, 7, 8, 12};
    for (kc::DType t : dtypes)
        for (int d : dims) {
            test_copies(t, randint(1, 3), d, blocks[randint(0, 4)], randint(1, 40), randint(0, 2), randint(0, 1), false);
            test_copies(t, randint(1, 3), d, blocks[randint(0, 4)], randint(1, 40), randint(0, 2), randint(0, 1), true);
            for (int rope_type : {1, 2}) // full and half rotary: K rotated in registers where the chunks allow
                for (int n_freq : {d / 2, d / 4})
                    test_copies(t, randint(1, 3), d, blocks[randint(0, 4)], randint(1, 40), rope_type, randint(0, 1),
                                false, std::max(n_freq, 1));
        }
    std::printf("copies: %d checks, %d failures\n", checks, failures);
    test_fp8_grid();
    std::printf("fp8: %d checks, %d failures\n", checks, failures);
    std::fflush(stdout);
    for (kc::DType t : dtypes)
        for (int d : dims) {
            test_attention(t, randint(1, 2), groups[randint(0, 5)], d, blocks[randint(0, 4)], randint(0, 40), randint(1, 3), false);
            test_attention(t, 1, groups[randint(0, 5)], d, blocks[randint(0, 2)], randint(300, 700), randint(1, 2), randint(0, 1));
        }
    test_attention(kc::DType::F16, 2, 12, 128, 16, 0, 2, false); // no keys at all
    test_attention(kc::DType::BF16, 2, 4, 128, 16, 200, 24, false, Layout::kCausalChunk);
    test_attention(kc::DType::F32, 1, 7, 64, 4, 90, 90, false, Layout::kCausalChunk);
    // Many queries, bf16/f16, head_dim 64/128: the tensor-core path (attention_mma.cu); key counts
    // around the 64-slot tile, rows around the 64-row CTA tile.
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128}) {
            test_attention(t, 2, 4, d, blocks[randint(0, 2)], 300, 65, false);
            test_attention(t, 1, groups[randint(0, 5)], d, 32, 63, 16, randint(0, 1));
            test_attention(t, 2, 1, d, 1, 130, 70, false, Layout::kCausalChunk);
            test_attention(t, 1, 8, d, 256, 65, 24, false, Layout::kCausalChunk);
        }
    test_attention(kc::DType::BF16, 2, 4, 128, 16, 0, 20, false); // no keys at all
    test_attention(kc::DType::F16, 1, 3, 64, 2, 1, 17, false);
    test_attention(kc::DType::BF16, 1, 2, 64, 8, 300, 300, false, Layout::kCausalChunk);  // early CTAs skip whole key tiles
    test_attention(kc::DType::F16, 2, 1, 128, 64, 260, 200, true, Layout::kCausalChunk); // 2 splits of 3 and 2 tiles
    test_mma_split_grid();
    // The ring of key-tile stages (attention_mma_tile.cuh, 3 stages): one and two tiles (fewer than
    // the stages), hidden tiles between seen ones (the ring's stage of a skipped tile stays stale),
    // every tile hidden; then CTAs of 8 warps (8 or more of them: the emulator reports 4 SMs).
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128}) {
            test_attention(t, 1, 4, d, 16, 40, 20, false);
            test_attention(t, 2, 2, d, 4, 100, 40, false, Layout::kCausalChunk);
            test_attention(t, 1, 2, d, 16, 320, 40, false, Layout::kRandom, 0b00100);
            test_attention(t, 1, 1, d, 8, 450, 70, false, Layout::kCausalChunk, 0b0100110);
            test_attention(t, 1, 4, d, 16, 200, 20, false, randint(0, 1) ? Layout::kCausalChunk : Layout::kRandom,
                           ~0ull);
        }
    test_attention(kc::DType::BF16, 4, 2, 128, 16, 200, 128, false, Layout::kCausalChunk);
    test_attention(kc::DType::F16, 4, 2, 64, 16, 330, 128, false, Layout::kRandom, 0b01010);
    // CTAs of 8 warps, with wgmma and a producer warpgroup (-D CONDUIT_EMU_WGMMA=1:
    // for_each_key_tile_specialized, a ring of 4 stages): one tile and three (fewer than the stages),
    // hidden tiles inside the ring's first fill and after it, every tile hidden; without wgmma, the
    // CTA-barrier loop on the same cases.
    for (kc::DType t : {kc::DType::BF16, kc::DType::F16})
        for (int d : {64, 128}) {
            test_attention(t, 4, 2, d, 16, 40, 128, false, Layout::kCausalChunk);
            test_attention(t, 4, 2, d, 8, 150, 128, false, Layout::kRandom, 0b010);
            test_attention(t, 4, 2, d, 16, 700, 128, false, Layout::kRandom, 0b10010100001);
            test_attention(t, 4, 2, d, 16, 300, 128, false, Layout::kRandom, ~0ull);
        }
    std::printf("attention: %d checks, %d failures\n", checks, failures);
    std::fflush(stdout);
    test_stats_grid();
    std::printf("stats: %d checks, %d failures\n", checks, failures);
    std::fflush(stdout);
    for (kc::DType t : dtypes)
        for (int d : {64, 128}) {
            test_step(t, 2, groups[randint(0, 5)], d, blocks[randint(0, 2)], randint(1, 5), randint(1, 700), randint(0, 2));
            test_step(t, 1, 4, d, 16, 1, 2048 + randint(0, 100), randint(0, 1)); // one long sequence, many splits
        }
    test_step(kc::DType::BF16, 8, 4, 128, 16, 16, 400, 1); // the bench's batch shape, small
    test_decode_grid();
    test_split_merge_grid();
    test_step(kc::DType::F32, 1, 1, 8, 1, 3, 5, 2);
    std::printf("step: %d checks, %d failures\n", checks, failures);
    test_topk_grid();
    std::printf("topk: %d checks, %d failures\n", checks, failures);
    std::printf("total: %d checks, %d failures\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
