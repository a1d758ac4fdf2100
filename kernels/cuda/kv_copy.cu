// kv_copy.cu: moving K and V between dense tensors and paged blocks on the GPU, with RoPE on K.
//
// One kernel serves every operation on dense pools (writes, restores, reads, the decode step's write_last): a "row"
// is one (token, KV head) pair of head_dim elements; a thread block moves kRowsPerBlock rows with
// one thread per 16-byte chunk of a row (element-wise when a dense pointer is not 16-byte aligned).
// K is rotated as it moves: a rotate-half pair (i, i + n_freq) spans two chunks held by different
// threads, which trade them by warp shuffles where the pairs fall on whole chunks (rotate_chunk),
// else through K rows staged in shared memory as float32. V is copied bit for bit.
//
// Where either side is an fp8 pool (kernels.h), fp8_rows_kernel moves the rows instead: one warp a
// row, read as float32 (dequantized), K rotated through shared memory, written back as the
// destination stores it (a warp-wide max picks an fp8 row's scale). fp8 rows are a byte an element, so
// the row's warp reads and writes it in coalesced 32-byte runs.
#include <cuda_fp8.h>

#include "kv_fp8.cuh"
#include "rope.cuh"

namespace conduit::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// Rows of a dense tensor [n, n_kv_heads, head_dim]; a null pointer skips that tensor.
template <typename T> struct DenseRows {
    static constexpr bool kFp8 = false;
    T *k;
    T *v;
    int32_t n_kv_heads;
    int32_t head_dim;

    __device__ int64_t offset(int32_t token, int32_t head) const {
        return (int64_t(token) * n_kv_heads + head) * head_dim;
    }
    __device__ T *k_row(int32_t token, int32_t head) const { return k ? k + offset(token, head) : nullptr; }
    __device__ T *v_row(int32_t token, int32_t head) const { return v ? v + offset(token, head) : nullptr; }
    __device__ DenseRows at_layer(int32_t) const { return *this; } // dense tensors hold one layer
    __device__ bool dependents_first() const { return false; }
};

// Rows of one paged layer (layout in kernels.h): token i lives in slot slots[i] (or base + i).
template <typename T> struct PagedRows {
    static constexpr bool kFp8 = false;
    T *pool;
    const int32_t *block_table;
    Slots slots;
    int64_t block_elems; // elements of one block (K and V)
    int64_t v_delta;     // elements from a K row to its V row
    int32_t block_shift; // log2(block_size)
    int32_t head_dim;
    int64_t table_stride; // elements between the block tables of consecutive layers (batched copies)

    __device__ int64_t offset(int32_t token, int32_t head) const {
        const int32_t slot = slots.slots ? slots.slots[token] : slots.base + token;
        const int64_t block = block_table[slot >> block_shift];
        const int32_t t = slot & ((1 << block_shift) - 1);
        return block * block_elems + ((int64_t(head) << block_shift) + t) * head_dim;
    }
    __device__ T *k_row(int32_t token, int32_t head) const { return pool + offset(token, head); }
    __device__ T *v_row(int32_t token, int32_t head) const { return pool + offset(token, head) + v_delta; }
    __device__ PagedRows at_layer(int32_t layer) const {
        PagedRows out = *this;
        out.block_table += layer * table_stride;
        return out;
    }
    __device__ bool dependents_first() const { return false; }
};

// Rows of a decode step's destination: token i is sequence i's new token, in its last slot
// (n_tokens[i] - 1), through row i of the block tables. Lengths and tables are read on the device.
template <typename T> struct LastSlotRows {
    T *pool;
    const int32_t *block_tables;
    const int32_t *n_tokens;
    int64_t table_stride;
    int64_t block_elems;
    int64_t v_delta;
    int32_t block_shift;
    int32_t head_dim;

    __device__ int64_t offset(int32_t token, int32_t head) const {
        const int32_t slot = n_tokens[token] - 1;
        const int64_t block = block_tables[token * table_stride + (slot >> block_shift)];
        const int32_t t = slot & ((1 << block_shift) - 1);
        return block * block_elems + ((int64_t(head) << block_shift) + t) * head_dim;
    }
    __device__ T *k_row(int32_t token, int32_t head) const { return pool + offset(token, head); }
    __device__ T *v_row(int32_t token, int32_t head) const { return pool + offset(token, head) + v_delta; }
    __device__ LastSlotRows at_layer(int32_t) const { return *this; }
    // The decode step's attention after this write may be scheduled at once (move_rows_kernel).
    __device__ bool dependents_first() const { return true; }
};

__global__ void scatter_ints_kernel(int32_t *dst, const int32_t *pairs, int32_t n_pairs) {
    const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n_pairs) dst[pairs[2 * j]] = pairs[2 * j + 1];
}

// kVec elements of T moved as one access (16 bytes when kVec = kChunk<T>).
template <typename T, int kVec> struct alignas(sizeof(T) * kVec) Pack {
    T x[kVec];
};

// cos and sin, times the scaling, of every frequency at the RoPE positions of tokens first ..
// first + count - 1, into table[2 (t nf + f)] and table[2 (t nf + f) + 1] (t = token - first). A
// CTA's rows are heads of a few consecutive tokens: computing each (token, frequency) pair once,
// not once per head and element, keeps the precise cosf/sinf out of the copy's critical path (a
// restore of several images rotates hundreds of millions of elements).
__device__ void fill_rope_table(float *table, const Rope &rope, const int32_t *rope_pos, int32_t n, int32_t first,
                                int32_t count) {
    const int32_t nf = rope.n_freq;
    const int32_t threads = int32_t(blockDim.x * blockDim.y), tid = int32_t(threadIdx.y * blockDim.x + threadIdx.x);
    for (int32_t i = tid; i < count * nf; i += threads)
        rope_cos_sin(rope, rope_pos, n, first + i / nf, i % nf, table[2 * i], table[2 * i + 1]);
}

// The cos/sin table of a block's tokens (fill_rope_table) at `table`: the block's rows are rows
// blockIdx.x * blockDim.y and on, a token's heads consecutive. Returns the block's first token.
__device__ int32_t fill_block_rope_table(float *table, const Rope &rope, const int32_t *rope_pos, int32_t n,
                                         int32_t n_kv_heads) {
    const int64_t first_row = int64_t(blockIdx.x) * blockDim.y;
    const int64_t rows = int64_t(n) * n_kv_heads;
    const int64_t last_row = (first_row + blockDim.y < rows ? first_row + blockDim.y : rows) - 1;
    const int32_t first_token = int32_t(first_row / n_kv_heads);
    fill_rope_table(table, rope, rope_pos, n, first_token, int32_t(last_row / n_kv_heads) - first_token + 1);
    return first_token;
}

// Rotated value of element e of a head whose float32 copy is `row` (rope.cuh), with the token's
// cos/sin pairs `cs` (fill_rope_table).
__device__ float rotated(const float *row, int32_t e, int32_t nf, const float *cs) {
    if (e >= 2 * nf) return row[e];
    const int32_t freq = e < nf ? e : e - nf;
    const float c = cs[2 * freq], s = cs[2 * freq + 1];
    if (e < nf) return rotated_low(row[e], row[e + nf], c, s);
    return rotated_high(row[e - nf], row[e], c, s);
}

// A K chunk of kVec elements rotated in registers (rotate_in_registers): the thread holding chunk p of a
// row trades its chunk with the thread holding the rotate-half partner chunk (p +- n_freq / kVec, a
// lane of the same warp) and reads its frequencies' cos/sin from the token's table `cs`. The same
// arithmetic as `rotated`, so the same bits as the staged path; chunks past 2 n_freq pass through.
// Every lane of the warp must call it (the shuffles); only an `active` one (a row and chunk that
// exist: the others' `cs` points nowhere) reads the table and rotates.
template <typename T, int kVec>
__device__ void rotate_chunk(Pack<T, kVec> &chunk, bool active, int32_t p, int32_t nf, const float *cs) {
    const int32_t pair_chunks = nf / kVec; // rotate_in_registers: nf is a multiple of kVec
    const bool low = p < pair_chunks, high = !low && p < 2 * pair_chunks;
    const int32_t lane = int32_t(threadIdx.y * blockDim.x + threadIdx.x) % 32;
    const int32_t partner = low ? lane + pair_chunks : (high ? lane - pair_chunks : lane);
    float mine[kVec], theirs[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
        mine[i] = to_float(chunk.x[i]);
        theirs[i] = __shfl_sync(0xffffffffu, mine[i], partner);
    }
    if (!active || (!low && !high)) return;
    const int32_t first_freq = (low ? p : p - pair_chunks) * kVec;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
        const float2 cos_sin = reinterpret_cast<const float2 *>(cs)[first_freq + i]; // one 8-byte read
        chunk.x[i] = from_float<T>(low ? rotated_low(mine[i], theirs[i], cos_sin.x, cos_sin.y)
                                       : rotated_high(theirs[i], mine[i], cos_sin.x, cos_sin.y));
    }
}

// blockDim = (threads per row, rows per block); blockIdx.y: the layer of a batched copy (src and dst
// are moved to it with at_layer). With rope_pos, K is rotated one of two ways: kInRegisters (a row's
// threads in one warp and rotate-half pairs falling on whole chunks, launch_rows decides) trades
// chunks between lanes (rotate_chunk), shared memory holding only the cos/sin table of the block's
// tokens (rows per block * head_dim floats); otherwise the block stages its K rows in shared memory
// as float32 first (2 * rows per block * head_dim floats: the rows, then the table). Registers are
// preferred: staging saturates the SM's L1/shared-memory pipe and leaves a large restore (several
// images into every layer) well below the copy bandwidth that the same copy without RoPE reaches.
template <typename T, int kVec, bool kInRegisters, typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    move_rows_kernel(Src all_src, Dst all_dst, int32_t n, int32_t n_kv_heads, int32_t head_dim, Rope rope,
                     const int32_t *rope_pos) {
    extern __shared__ float k_staged[];
    // A decode step's K/V write lets the attention after it be scheduled at once, while the projection
    // before this kernel drains: before its own wait, that kernel reads nothing the step's kernels
    // write (attention_shape.cuh, tiles_before_wait). Only here: a kernel scheduled early holds SM
    // slots while it waits, which pays only where the next kernel is one wave of small CTAs; early
    // GEMV CTAs would take the slots the running GEMV's last wave needs.
    if (all_dst.dependents_first()) allow_dependent_launch();
    wait_for_prior_grids(); // launched chained: the rows and positions may be the previous kernel's
    allow_dependent_launch();
    const Src src = all_src.at_layer(int32_t(blockIdx.y));
    const Dst dst = all_dst.at_layer(int32_t(blockIdx.y));
    using P = Pack<T, kVec>;
    const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
    const bool live = row < int64_t(n) * n_kv_heads;
    const int32_t token = live ? int32_t(row / n_kv_heads) : 0;
    const int32_t head = live ? int32_t(row % n_kv_heads) : 0;
    const int32_t n_packs = head_dim / kVec;

    if (rope_pos) {
        // [tokens of the block][n_freq][cos, sin], after the staged K rows when K is staged
        float *table = k_staged + (kInRegisters ? 0 : blockDim.y * head_dim);
        const int32_t first_token = fill_block_rope_table(table, rope, rope_pos, n, n_kv_heads);
        const float *cs = table + 2 * (live ? token - first_token : 0) * rope.n_freq; // this row's token's
        T *k_out = live ? dst.k_row(token, head) : nullptr;
        if (kInRegisters) {
            // rotate_in_registers guarantees one chunk a thread; every lane takes part in the shuffles
            const int32_t p = int32_t(threadIdx.x);
            const bool mine = live && p < n_packs;
            P chunk{};
            if (mine) chunk = reinterpret_cast<const P *>(src.k_row(token, head))[p];
            __syncthreads(); // the table
            rotate_chunk<T, kVec>(chunk, mine, p, rope.n_freq, cs);
            if (mine && k_out) reinterpret_cast<P *>(k_out)[p] = chunk;
        } else {
            float *staged = k_staged + threadIdx.y * head_dim;
            if (live) {
                const T *k_in = src.k_row(token, head);
                for (int32_t p = threadIdx.x; p < n_packs; p += blockDim.x) {
                    const P pack = reinterpret_cast<const P *>(k_in)[p];
#pragma unroll
                    for (int i = 0; i < kVec; ++i) staged[p * kVec + i] = to_float(pack.x[i]);
                }
            }
            __syncthreads(); // every thread reaches this: `live` only guards the work
            if (live && k_out) {
                for (int32_t p = threadIdx.x; p < n_packs; p += blockDim.x) {
                    P pack;
#pragma unroll
                    for (int i = 0; i < kVec; ++i)
                        pack.x[i] = from_float<T>(rotated(staged, p * kVec + i, rope.n_freq, cs));
                    reinterpret_cast<P *>(k_out)[p] = pack;
                }
            }
        }
    } else if (live) {
        T *k_out = dst.k_row(token, head);
        if (k_out) {
            const P *k_in = reinterpret_cast<const P *>(src.k_row(token, head));
            for (int32_t p = threadIdx.x; p < n_packs; p += blockDim.x) reinterpret_cast<P *>(k_out)[p] = k_in[p];
        }
    }
    if (!live) return;
    T *v_out = dst.v_row(token, head);
    if (v_out) {
        const P *v_in = reinterpret_cast<const P *>(src.v_row(token, head));
        for (int32_t p = threadIdx.x; p < n_packs; p += blockDim.x) reinterpret_cast<P *>(v_out)[p] = v_in[p];
    }
}

int32_t log2_exact(int32_t x) {
    int32_t s = 0;
    while ((1 << s) < x) ++s;
    return s;
}

template <typename T> PagedRows<T> paged_rows(const LayerView &view, Slots slots, int64_t table_stride = 0) {
    require(view.block_size >= 1 && view.block_size <= 256 && (view.block_size & (view.block_size - 1)) == 0,
            "block_size must be a power of two in [1, 256]");
    return PagedRows<T>{static_cast<T *>(view.pool), view.block_table, slots, view.block_elems(),
                        int64_t(view.n_kv_heads) * view.block_size * view.head_dim,
                        log2_exact(view.block_size), view.head_dim, table_stride};
}

// Whether K can be rotated in registers (rotate_chunk): one chunk a thread, a row's threads within one
// warp, and every rotate-half pair (i, i + n_freq) on whole chunks.
bool rotate_in_registers(const Rope &rope, int32_t vec, int32_t n_packs, int32_t per_row) {
    return n_packs <= per_row && per_row <= 32 && rope.n_freq % vec == 0;
}

template <typename T, int kVec, typename Src, typename Dst>
void launch_rows(Src src, Dst dst, int32_t n, int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                 const Rope &rope, const int32_t *rope_pos, cudaStream_t stream) {
    const int32_t n_packs = head_dim / kVec;
    int32_t per_row = 1;
    while (per_row < n_packs && per_row < kThreads) per_row *= 2;
    const int32_t rows_per_block = kThreads / per_row;
    const int64_t rows = int64_t(n) * n_kv_heads;
    const dim3 grid{unsigned((rows + rows_per_block - 1) / rows_per_block), unsigned(n_layers)};
    const dim3 block{unsigned(per_row), unsigned(rows_per_block)};
    if (rope_pos && rotate_in_registers(rope, kVec, n_packs, per_row)) {
        const size_t smem = size_t(rows_per_block) * head_dim * sizeof(float); // the table: <= one float an element
        launch_chained(move_rows_kernel<T, kVec, true, Src, Dst>, grid, block, smem, stream, src, dst, n, n_kv_heads,
                       head_dim, rope, rope_pos);
        return;
    }
    const size_t smem = rope_pos ? 2 * size_t(rows_per_block) * head_dim * sizeof(float) : 0;
    launch_chained(move_rows_kernel<T, kVec, false, Src, Dst>, grid, block, smem, stream, src, dst, n, n_kv_heads,
                   head_dim, rope, rope_pos);
}

// Checks the shared preconditions, then launches with 16-byte accesses when every pointer allows.
template <typename T, typename Src, typename Dst>
void move_rows(Src src, Dst dst, int32_t n, const LayerView &layout, const Rope &rope, const int32_t *rope_pos,
               bool all_aligned, void *stream, int32_t n_layers = 1) {
    if (n <= 0 || n_layers <= 0 || layout.n_kv_heads <= 0) return;
    require(n_layers <= 65535, "at most 65535 layers per batched copy");
    require(layout.head_dim >= 8 && layout.head_dim <= 256 && layout.head_dim % 8 == 0,
            "head_dim must be a multiple of 8 in [8, 256]");
    rope_pos = checked_rope_pos(rope, rope_pos, layout.head_dim);
    if (all_aligned) {
        launch_rows<T, kChunk<T>>(src, dst, n, n_layers, layout.n_kv_heads, layout.head_dim, rope, rope_pos,
                                  as_stream(stream));
    } else {
        launch_rows<T, 1>(src, dst, n, n_layers, layout.n_kv_heads, layout.head_dim, rope, rope_pos,
                          as_stream(stream));
    }
}


// ---------------------------------------------------------------------------------------------
// fp8 pools
// ---------------------------------------------------------------------------------------------

// Rows of one fp8 paged layer (the fp8 layout of kernels.h), as PagedRows for dense pools.
struct Fp8PagedRows {
    static constexpr bool kFp8 = true;
    uint8_t *pool;
    const int32_t *block_table;
    Slots slots;
    int64_t block_bytes;
    int32_t rows;        // K rows of a block: n_kv_heads * block_size (V's follow, then the scales)
    int32_t block_shift; // log2(block_size)
    int32_t head_dim;
    int64_t table_stride;

    // The bytes and the scale of the row of `slot` through block table `table`.
    __device__ uint8_t *bytes_at(const int32_t *table, int32_t slot, int32_t head, int value) const {
        const int32_t row = (head << block_shift) + (slot & ((1 << block_shift) - 1));
        return pool + table[slot >> block_shift] * block_bytes + int64_t(row + value * rows) * head_dim;
    }
    __device__ float *scale_at(const int32_t *table, int32_t slot, int32_t head, int value) const {
        const int32_t row = (head << block_shift) + (slot & ((1 << block_shift) - 1));
        uint8_t *scales = pool + table[slot >> block_shift] * block_bytes + int64_t(2) * rows * head_dim;
        return reinterpret_cast<float *>(scales) + row + value * rows;
    }
    __device__ int32_t slot_of(int32_t token) const { return slots.slots ? slots.slots[token] : slots.base + token; }
    __device__ uint8_t *bytes(int32_t token, int32_t head, int value) const {
        return bytes_at(block_table, slot_of(token), head, value);
    }
    __device__ float *scale(int32_t token, int32_t head, int value) const {
        return scale_at(block_table, slot_of(token), head, value);
    }
    __device__ Fp8PagedRows at_layer(int32_t layer) const {
        Fp8PagedRows out = *this;
        out.block_table += layer * table_stride;
        return out;
    }
    __device__ bool dependents_first() const { return false; }
};

// A decode step's destination in an fp8 pool (LastSlotRows for dense pools): the rows of token i
// are in slot n_tokens[i] - 1 of sequence i, through row i of the block tables.
struct Fp8LastSlotRows {
    Fp8PagedRows layout; // block_table, slots and table_stride unused
    const int32_t *block_tables;
    const int32_t *n_tokens;
    int64_t table_stride;

    static constexpr bool kFp8 = true;
    __device__ uint8_t *bytes(int32_t token, int32_t head, int value) const {
        return layout.bytes_at(block_tables + token * table_stride, n_tokens[token] - 1, head, value);
    }
    __device__ float *scale(int32_t token, int32_t head, int value) const {
        return layout.scale_at(block_tables + token * table_stride, n_tokens[token] - 1, head, value);
    }
    __device__ Fp8LastSlotRows at_layer(int32_t) const { return *this; }
    __device__ bool dependents_first() const { return true; }
};

// Where a warp's row exists: a dense tensor given as null skips it.
template <typename Rows> __device__ bool has_row(const Rows &rows, int32_t token, int32_t head, int value) {
    if constexpr (Rows::kFp8) return true;
    else return (value ? rows.v_row(token, head) : rows.k_row(token, head)) != nullptr;
}

// Elements lane + 32 j of a row as float32 (0 past head_dim).
template <int kPerLane, typename Rows>
__device__ void load_row(const Rows &rows, int32_t token, int32_t head, int value, int32_t head_dim,
                         float (&x)[kPerLane]) {
    const int32_t lane = threadIdx.x;
    if constexpr (Rows::kFp8) {
        const uint8_t *bytes = rows.bytes(token, head, value);
        const float scale = *rows.scale(token, head, value);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int32_t e = lane + 32 * j;
            const __half h(__nv_cvt_fp8_to_halfraw(e < head_dim ? bytes[e] : 0, __NV_E4M3));
            x[j] = __half2float(h) * scale; // exact: scale is a power of two
        }
    } else {
        const auto *row = value ? rows.v_row(token, head) : rows.k_row(token, head);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int32_t e = lane + 32 * j;
            x[j] = e < head_dim ? to_float(row[e]) : 0.0f;
        }
    }
}

// The largest |x| of the warp's row; NaN when any element is NaN (fmaxf would drop it).
template <int kPerLane> __device__ float row_amax(const float (&x)[kPerLane]) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const float a = fabsf(x[j]);
        m = (a > m || a != a) ? a : m;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, m, offset);
        m = (o > m || o != o) ? o : m;
    }
    return m;
}

// Writes the warp's row: quantized with fp8_row_scale for an fp8 destination, rounded to T otherwise.
template <typename T, int kPerLane, typename Rows>
__device__ void store_row(const Rows &rows, int32_t token, int32_t head, int value, int32_t head_dim,
                          const float (&x)[kPerLane]) {
    const int32_t lane = threadIdx.x;
    if constexpr (Rows::kFp8) {
        const float scale = fp8_row_scale(row_amax(x));
        uint8_t *bytes = rows.bytes(token, head, value);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int32_t e = lane + 32 * j;
            if (e < head_dim) bytes[e] = __nv_cvt_float_to_fp8(__fdiv_rn(x[j], scale), __NV_SATFINITE, __NV_E4M3);
        }
        if (lane == 0) *rows.scale(token, head, value) = scale;
    } else {
        T *row = value ? rows.v_row(token, head) : rows.k_row(token, head);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int32_t e = lane + 32 * j;
            if (e < head_dim) row[e] = from_float<T>(x[j]);
        }
    }
}

constexpr int kFp8Warps = 4; // rows (warps) per CTA of fp8_rows_kernel

// blockDim = (32, kFp8Warps): warp y of CTA x moves row x * kFp8Warps + y, K then V. blockIdx.y: the
// layer of a batched copy (or, with layer_n_tokens, the sequence of a batch whose rows past
// layer_n_tokens[blockIdx.y] are skipped). T: the dense side's dtype.
template <typename T, int kPerLane, typename Src, typename Dst>
__global__ void __launch_bounds__(32 * kFp8Warps)
    fp8_rows_kernel(Src all_src, Dst all_dst, int32_t n, int32_t n_kv_heads, int32_t head_dim, Rope rope,
                    const int32_t *rope_pos, const int32_t *layer_n_tokens) {
    __shared__ float staged[kFp8Warps][32 * kPerLane];
    if (all_dst.dependents_first()) allow_dependent_launch(); // as move_rows_kernel
    wait_for_prior_grids();
    allow_dependent_launch();
    const Src src = all_src.at_layer(int32_t(blockIdx.y));
    const Dst dst = all_dst.at_layer(int32_t(blockIdx.y));
    const int64_t row = int64_t(blockIdx.x) * kFp8Warps + threadIdx.y;
    if (row >= int64_t(n) * n_kv_heads) return; // the whole warp: it shares one row
    const int32_t token = int32_t(row / n_kv_heads), head = int32_t(row % n_kv_heads);
    if (layer_n_tokens && token >= layer_n_tokens[blockIdx.y]) return;
    float *mine = staged[threadIdx.y];
    for (int value = 0; value < 2; ++value) {
        if (!has_row(src, token, head, value) || !has_row(dst, token, head, value)) continue;
        float x[kPerLane];
        load_row<kPerLane>(src, token, head, value, head_dim, x);
        if (value == 0 && rope_pos) {
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) mine[threadIdx.x + 32 * j] = x[j];
            __syncwarp();
            const int32_t nf = rope.n_freq;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) {
                const int32_t e = threadIdx.x + 32 * j;
                if (e >= 2 * nf) continue;
                float c, s;
                rope_cos_sin(rope, rope_pos, n, token, e < nf ? e : e - nf, c, s);
                x[j] = e < nf ? rotated_low(mine[e], mine[e + nf], c, s) : rotated_high(mine[e - nf], mine[e], c, s);
            }
        }
        store_row<T, kPerLane>(dst, token, head, value, head_dim, x);
    }
}

Fp8PagedRows fp8_paged_rows(const LayerView &view, Slots slots, int64_t table_stride = 0) {
    require(view.block_size >= 1 && view.block_size <= 256 && (view.block_size & (view.block_size - 1)) == 0,
            "block_size must be a power of two in [1, 256]");
    return Fp8PagedRows{static_cast<uint8_t *>(view.pool), view.block_table, slots, view.block_bytes(),
                        view.n_kv_heads * view.block_size, log2_exact(view.block_size), view.head_dim, table_stride};
}

// fp8_rows_kernel over n rows of n_layers layers (see there for layer_n_tokens).
template <typename T, typename Src, typename Dst>
void move_fp8_rows(Src src, Dst dst, int32_t n, const LayerView &layout, const Rope &rope, const int32_t *rope_pos,
                   void *stream, int32_t n_layers = 1, const int32_t *layer_n_tokens = nullptr) {
    if (n <= 0 || n_layers <= 0 || layout.n_kv_heads <= 0) return;
    require(n_layers <= 65535, "at most 65535 layers per batched copy");
    require(layout.head_dim >= 8 && layout.head_dim <= 256 && layout.head_dim % 8 == 0,
            "head_dim must be a multiple of 8 in [8, 256]");
    rope_pos = checked_rope_pos(rope, rope_pos, layout.head_dim);
    const int64_t rows = int64_t(n) * layout.n_kv_heads;
    const dim3 grid{unsigned((rows + kFp8Warps - 1) / kFp8Warps), unsigned(n_layers)};
    const dim3 block{32u, unsigned(kFp8Warps)};
    const auto launch = [&](auto per_lane) {
        launch_chained(fp8_rows_kernel<T, decltype(per_lane)::value, Src, Dst>, grid, block, 0, as_stream(stream), src,
                       dst, n, layout.n_kv_heads, layout.head_dim, rope, rope_pos, layer_n_tokens);
    };
    const int32_t d = layout.head_dim;
    if (d <= 32) launch(std::integral_constant<int, 1>{});
    else if (d <= 64) launch(std::integral_constant<int, 2>{});
    else if (d <= 128) launch(std::integral_constant<int, 4>{});
    else launch(std::integral_constant<int, 8>{});
}

// A copy between paged layers where either is fp8: the rows struct of each side, then the kernel.
template <typename T>
void copy_paged_fp8(const LayerView &src, Slots src_slots, int64_t src_stride, const LayerView &dst, Slots dst_slots,
                    int64_t dst_stride, int32_t n_layers, int32_t n, const Rope &rope, const int32_t *rope_pos,
                    void *stream, const int32_t *layer_n_tokens = nullptr) {
    const auto to = [&](auto from) {
        if (dst.fp8)
            move_fp8_rows<T>(from, fp8_paged_rows(dst, dst_slots, dst_stride), n, dst, rope, rope_pos, stream, n_layers,
                             layer_n_tokens);
        else
            move_fp8_rows<T>(from, paged_rows<T>(dst, dst_slots, dst_stride), n, dst, rope, rope_pos, stream, n_layers,
                             layer_n_tokens);
    };
    if (src.fp8) to(fp8_paged_rows(src, src_slots, src_stride));
    else to(paged_rows<T>(src, src_slots, src_stride));
}

__global__ void iota_kernel(int32_t *out, int32_t n) {
    const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i;
}

// Device memory of `bytes` bytes, stream-ordered (freed by free_staging on the same stream).
void *alloc_staging(size_t bytes, cudaStream_t stream) {
    void *ptr = nullptr;
    CUDA_CHECK(cudaMallocAsync(&ptr, bytes, stream));
    return ptr;
}

// The dense pool of `blocks` blocks of `dense` (fp8 false) and, after it, an int32 table 0..blocks-1.
void *staged_pool(LayerView &dense, int64_t blocks, int32_t *&table, cudaStream_t stream) {
    const size_t pool_bytes = size_t(blocks) * size_t(dense.block_bytes());
    void *memory = alloc_staging(pool_bytes + size_t(blocks) * sizeof(int32_t), stream);
    dense.pool = memory;
    table = reinterpret_cast<int32_t *>(static_cast<char *>(memory) + pool_bytes);
    iota_kernel<<<unsigned((blocks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(table, int32_t(blocks));
    CUDA_CHECK_LAUNCH("iota_kernel");
    return memory;
}

} // namespace

DenseStaging::DenseStaging(const LayerView &kv, void *stream) : view_(kv), stream_(stream) {
    if (!kv.fp8) return;
    view_.fp8 = false;
    if (kv.n_tokens <= 0) return;
    int32_t *table = nullptr;
    memory_ = staged_pool(view_, (kv.n_tokens + kv.block_size - 1) / kv.block_size, table, as_stream(stream));
    view_.block_table = table;
    copy_paged(kv, Slots{}, view_, Slots{}, kv.n_tokens, Rope{}, nullptr, stream);
}

BatchStaging::BatchStaging(const BatchView &kv, void *stream) : view_(kv), stream_(stream) {
    if (!kv.fp8) return;
    view_.fp8 = false;
    if (kv.n_seqs <= 0 || kv.max_tokens <= 0) return;
    const int64_t per_seq = (kv.max_tokens + kv.block_size - 1) / kv.block_size;
    LayerView dense = view_.layout();
    int32_t *tables = nullptr;
    memory_ = staged_pool(dense, per_seq * kv.n_seqs, tables, as_stream(stream));
    view_.pool = dense.pool;
    view_.block_tables = tables; // row i: blocks i * per_seq ..
    view_.table_stride = per_seq;
    LayerView src = kv.layout();
    src.block_table = kv.block_tables;
    dense.block_table = tables;
    dispatch_dtype(kv.dtype, [&](auto tag) {
        copy_paged_fp8<typename decltype(tag)::type>(src, Slots{}, kv.table_stride, dense, Slots{}, per_seq, kv.n_seqs,
                                                     kv.max_tokens, Rope{}, nullptr, stream, kv.n_tokens);
    });
}

namespace {
void free_staging(void *memory, void *stream) {
    if (memory) (void)cudaFreeAsync(memory, as_stream(stream)); // a destructor: an error shows at the next check
}
} // namespace

DenseStaging::~DenseStaging() { free_staging(memory_, stream_); }
BatchStaging::~BatchStaging() { free_staging(memory_, stream_); }

void write_dense(const LayerView &dst, Slots dst_slots, int32_t n, const void *k, const void *v, const Rope &rope,
                 const int32_t *rope_pos, void *stream) {
    dispatch_dtype(dst.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        const DenseRows<T> in{static_cast<T *>(const_cast<void *>(k)), static_cast<T *>(const_cast<void *>(v)),
                              dst.n_kv_heads, dst.head_dim};
        if (dst.fp8) {
            move_fp8_rows<T>(in, fp8_paged_rows(dst, dst_slots), n, dst, rope, rope_pos, stream);
            return;
        }
        const bool aligned = aligned16(k) && aligned16(v) && aligned16(dst.pool);
        move_rows<T>(in, paged_rows<T>(dst, dst_slots), n, dst, rope, rope_pos, aligned, stream);
    });
}

void copy_paged_layers(const LayerView &src, Slots src_slots, int64_t src_table_stride, const LayerView &dst,
                       Slots dst_slots, int64_t dst_table_stride, int32_t n_layers, int32_t n, const Rope &rope,
                       const int32_t *rope_pos, void *stream) {
    require(src.dtype == dst.dtype && src.head_dim == dst.head_dim && src.n_kv_heads == dst.n_kv_heads,
            "copy_paged: source and destination layouts differ");
    dispatch_dtype(dst.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (src.fp8 || dst.fp8) {
            copy_paged_fp8<T>(src, src_slots, src_table_stride, dst, dst_slots, dst_table_stride, n_layers, n, rope,
                              rope_pos, stream);
            return;
        }
        const bool aligned = aligned16(src.pool) && aligned16(dst.pool);
        move_rows<T>(paged_rows<T>(src, src_slots, src_table_stride), paged_rows<T>(dst, dst_slots, dst_table_stride),
                     n, dst, rope, rope_pos, aligned, stream, n_layers);
    });
}

void copy_paged(const LayerView &src, Slots src_slots, const LayerView &dst, Slots dst_slots, int32_t n,
                const Rope &rope, const int32_t *rope_pos, void *stream) {
    copy_paged_layers(src, src_slots, 0, dst, dst_slots, 0, 1, n, rope, rope_pos, stream);
}

void write_last(const BatchView &dst, const void *k, const void *v, const Rope &rope, const int32_t *rope_pos,
                void *stream) {
    if (dst.n_seqs <= 0) return;
    require(dst.block_tables && dst.n_tokens, "a batch needs its block tables and lengths");
    const LayerView layout = dst.layout();
    dispatch_dtype(dst.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        const DenseRows<T> in_rows{static_cast<T *>(const_cast<void *>(k)), static_cast<T *>(const_cast<void *>(v)),
                                   dst.n_kv_heads, dst.head_dim};
        if (dst.fp8) {
            const Fp8LastSlotRows out{fp8_paged_rows(layout, Slots{}), dst.block_tables, dst.n_tokens, dst.table_stride};
            move_fp8_rows<T>(in_rows, out, dst.n_seqs, layout, rope, rope_pos, stream);
            return;
        }
        const PagedRows<T> shape = paged_rows<T>(layout, Slots{}); // checks block_size; gives the geometry
        const LastSlotRows<T> out{shape.pool,    dst.block_tables, dst.n_tokens, dst.table_stride, shape.block_elems,
                                  shape.v_delta, shape.block_shift, dst.head_dim};
        const DenseRows<T> in{static_cast<T *>(const_cast<void *>(k)), static_cast<T *>(const_cast<void *>(v)),
                              dst.n_kv_heads, dst.head_dim};
        const bool aligned = aligned16(k) && aligned16(v) && aligned16(dst.pool);
        move_rows<T>(in, out, dst.n_seqs, layout, rope, rope_pos, aligned, stream);
    });
}

void scatter_ints(int32_t *dst, const int32_t *pairs, int32_t n_pairs, void *stream) {
    if (n_pairs <= 0) return;
    scatter_ints_kernel<<<unsigned((n_pairs + kThreads - 1) / kThreads), kThreads, 0, as_stream(stream)>>>(dst, pairs,
                                                                                                          n_pairs);
    CUDA_CHECK_LAUNCH("scatter_ints_kernel");
}

void read_dense(const LayerView &src, void *k_out, void *v_out, void *stream) {
    if (!k_out && !v_out) return;
    dispatch_dtype(src.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        const DenseRows<T> out{static_cast<T *>(k_out), static_cast<T *>(v_out), src.n_kv_heads, src.head_dim};
        if (src.fp8) {
            move_fp8_rows<T>(fp8_paged_rows(src, Slots{}), out, src.n_tokens, src, Rope{}, nullptr, stream);
            return;
        }
        const bool aligned = aligned16(k_out) && aligned16(v_out) && aligned16(src.pool);
        move_rows<T>(paged_rows<T>(src, Slots{}), out, src.n_tokens, src, Rope{}, nullptr, aligned, stream);
    });
}

} // namespace conduit::kernels::cuda
