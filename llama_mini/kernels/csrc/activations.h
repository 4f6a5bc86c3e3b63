// Activations that a layer's forward (block_op.cpp) takes from the buffers the layer before it
// let go, so that a prompt's chunk reuses one set of buffers through every layer.
#pragma once
#include <ATen/core/Tensor.h>

namespace llama_mini {

// An uninitialized tensor for an activation: while a ReusedActivations lives on this thread, a
// large one comes from the buffers earlier activations let go; otherwise at::empty's.
at::Tensor activation(at::IntArrayRef sizes, const at::TensorOptions& options);

// While one lives, this thread's large activations are reused buffers.
class ReusedActivations {
   public:
    ReusedActivations();
    ~ReusedActivations();

   private:
    bool outer_;
};

}  // namespace llama_mini
