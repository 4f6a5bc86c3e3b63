// The torch operator llama_mini::rope, RoPE over rope.cpp's kernel, for training
// (kernels/fused_rope.py), with its autograd node in C++ as rms_norm's (rms_norm_op.cpp says why
// C++): backward rotates the gradient back through the same kernel.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels.h"
#include "ops.h"

namespace llama_mini {

// RoPE (rope.cpp) of x (B, T, heads, d) at T positions, or its gradient (backward): cos and sin
// the model's float32 tables, T x d values each.
at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
    TORCH_CHECK(vector_kernels_available(), "llama_mini::rope: this build has no vector kernels");
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.size(3) % 8 == 0, "llama_mini::rope: x (B, T, heads, d) on the CPU, d a multiple of 8");
    const int type = float_type(x, "x");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == x.size(1) * x.size(3) &&
                    sin.numel() == cos.numel(),
                "llama_mini::rope: float32 cos and sin, d values per position");
    const at::Tensor xc = x.contiguous(), cosc = cos.contiguous(), sinc = sin.contiguous();
    at::Tensor out = at::empty_like(xc);
    const int64_t rows = xc.numel() / std::max<int64_t>(xc.size(3), 1);
    ::rope(xc.const_data_ptr(), out.mutable_data_ptr(), cosc.const_data_ptr<float>(), sinc.const_data_ptr<float>(), rows,
           xc.size(2), xc.size(1), xc.size(3), backward, type, threads_for_work(xc.numel() * 4));
    return out;
}

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { return rope_op(x, cos, sin, false); }

// Saves the tables for backward, which rotates the gradient back: the same pass.
struct RoPEFunction : public torch::autograd::Function<RoPEFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                              const at::Tensor& sin) {
        ctx->save_for_backward({cos, sin});
        return rope_op(x, cos, sin, false);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        TORCH_CHECK(!at::GradMode::is_enabled(), "llama_mini::rope: the fused backward cannot be "
                    "differentiated again; leave use_fused_rope out for higher-order gradients");
        const torch::autograd::variable_list saved = ctx->get_saved_variables();
        return {rope_op(grads[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
    }
};

at::Tensor rope_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    return RoPEFunction::apply(x, cos, sin);
}

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) { m.impl("rope", llama_mini::rope_forward); }
TORCH_LIBRARY_IMPL(llama_mini, AutogradCPU, m) { m.impl("rope", llama_mini::rope_autograd); }
