// The operators' C++ functions (rms_norm_op.cpp, matvec_op.cpp), declared for block_op.cpp,
// which runs a whole layer's forward through them without returning to Python between them.
#pragma once
#include <ATen/core/Tensor.h>

namespace llama_mini {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t n_rms, int64_t vector_bytes);
at::Tensor dense_op(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int8_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales);
at::Tensor int4_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros);
at::Tensor swiglu_op(const at::Tensor& a, const at::Tensor& b);
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, int64_t start);

}  // namespace llama_mini
