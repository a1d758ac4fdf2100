// kv_fp8.cuh: dense staging copies of fp8 layers (kernels.h's fp8 pool layout), defined in kv_copy.cu.
//
// The attention and statistics kernels read K and V tiles of the pool's dtype. Over an fp8 layer
// they run on a staging copy: the layer's rows dequantized into a stream-ordered allocation of
// dense blocks (its slots in order), which lives as long as the staging object. The copy reads the
// fp8 bytes once and writes the dense ones once, against the kernels' reads of them; it also keeps
// the memory the fp8 pool saves out of the arena only while one layer's kernel runs.
#pragma once

#include "../kernels.h"

namespace conduit::kernels::cuda {

class DenseStaging {
  public:
    // Stages kv on the stream when it is fp8; view() is then the copy, else kv itself.
    DenseStaging(const LayerView &kv, void *stream);
    ~DenseStaging();
    DenseStaging(const DenseStaging &) = delete;
    DenseStaging &operator=(const DenseStaging &) = delete;
    const LayerView &view() const { return view_; }

  private:
    LayerView view_;
    void *stream_;
    void *memory_ = nullptr;
};

// The same for a decode step's batch: each sequence's first n_tokens[i] rows (read on the device, so
// it can be graph-captured) into max_tokens slots of its own; view() keeps the lengths.
class BatchStaging {
  public:
    BatchStaging(const BatchView &kv, void *stream);
    ~BatchStaging();
    BatchStaging(const BatchStaging &) = delete;
    BatchStaging &operator=(const BatchStaging &) = delete;
    const BatchView &view() const { return view_; }

  private:
    BatchView view_;
    void *stream_;
    void *memory_ = nullptr;
};

} // namespace conduit::kernels::cuda
