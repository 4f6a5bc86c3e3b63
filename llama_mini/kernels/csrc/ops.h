// The torch operators' side of the kernels: the operators' C++ functions (rms_norm_op.cpp,
// linear_op.cpp, swiglu_op.cpp, attention_op.cpp), declared for block_op.cpp, which runs a
// whole layer's forward through them without returning to Python between them; and the checks
// and the thread count that every operator over kernels.h shares.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace llama_mini {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t n_rms, int64_t vector_bytes);
at::Tensor dense_op(const at::Tensor& x, const at::Tensor& weight);
at::Tensor int8_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales);
at::Tensor int4_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                   const std::optional<at::Tensor>& super_scales, const std::optional<at::Tensor>& super_offsets);
at::Tensor q8_0_op(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor k_quant_op(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor swiglu_op(const at::Tensor& a, const at::Tensor& b);
void swiglu_in_place(at::Tensor& a, const at::Tensor& b);
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, int64_t start);

// A kernel's float operand (kernels.h): float32, bfloat16 or float16, numbered 0, 1 and 2.
inline int float_type(const at::Tensor& t, const char* what) {
    const at::ScalarType type = t.scalar_type();
    TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, "llama_mini: ", what,
                " must be float32, bfloat16 or float16, not ", type);
    return type == at::kFloat ? 0 : type == at::kBFloat16 ? 1 : 2;
}

// Below this many multiply-adds (or a few operations an element) one thread does the work:
// waking the others costs more (a tiny model's layers; a real model's are hundreds of times larger).
constexpr int64_t PARALLEL_MIN_WORK = 1 << 17;

inline int threads_for_work(int64_t work) { return work >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1; }

}  // namespace llama_mini
