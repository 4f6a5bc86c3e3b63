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
at::Tensor int4_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                   const std::optional<at::Tensor>& super_scales, const std::optional<at::Tensor>& super_offsets);
at::Tensor swiglu_op(const at::Tensor& a, const at::Tensor& b);
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, int64_t start);

inline bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// An integer layer's scales: float32, bfloat16 or float16, as kernels.h's scales_dtype numbers them.
inline int scales_dtype(const at::Tensor& scales) {
    TORCH_CHECK(scales.scalar_type() == at::kFloat || is_bf16(scales) || scales.scalar_type() == at::kHalf,
                "llama_mini::linear: the scales must be float32, bfloat16 or float16, not ", scales.scalar_type());
    return scales.scalar_type() == at::kFloat ? 0 : is_bf16(scales) ? 1 : 2;
}

// The kernels of kernels.h take float32 or bfloat16 tensors.
inline void check_float(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || is_bf16(t), "llama_mini::linear: ", what,
                " must be float32 or bfloat16, not ", t.scalar_type());
}

// Below this many multiply-adds (or a few operations an element) one thread does the work:
// waking the others costs more (a tiny model's layers; a real model's are hundreds of times larger).
constexpr int64_t PARALLEL_MIN_WORK = 1 << 17;

inline int threads_for_work(int64_t work) { return work >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1; }

}  // namespace llama_mini
