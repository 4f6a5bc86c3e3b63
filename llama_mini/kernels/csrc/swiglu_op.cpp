// The torch operator llama_mini::swiglu, silu(a) * b over swiglu.cpp's kernels, with its
// autograd node in C++ as rms_norm's (rms_norm_op.cpp says why C++): training runs it too
// (kernels/fused_swiglu.py), and block_op.cpp calls it for a layer's feed-forward.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "kernels.h"
#include "ops.h"

namespace llama_mini {

namespace {

// silu(a) * b into out, elementwise, for a, b and out of one shape and dtype (out may be a:
// each element is read before it is written).
void gate_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
    TORCH_CHECK(vector_kernels_available(), "llama_mini::swiglu: this build has no vector kernels");
    TORCH_CHECK(a.device().is_cpu() && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
                "llama_mini::swiglu: a and b of one shape and dtype, on the CPU");
    const int type = float_type(a, "a");
    const at::Tensor bc = b.contiguous();
    ::swiglu(a.const_data_ptr(), bc.const_data_ptr(), out.mutable_data_ptr(), a.numel(), type,
             threads_for_work(a.numel() * 16));
}

}  // namespace

// silu(a) * b, elementwise, for a and b of one shape and dtype.
at::Tensor swiglu_op(const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor ac = a.contiguous();
    at::Tensor out = at::empty_like(ac);
    gate_into(ac, b, out);
    return out;
}

// silu(a) * b written over a (contiguous, read by no one else): block_op.cpp's feed-forward,
// whose prompt chunk then needs no third tensor of hidden activations.
void swiglu_in_place(at::Tensor& a, const at::Tensor& b) {
    TORCH_CHECK(a.is_contiguous(), "llama_mini::swiglu: in place needs a contiguous tensor");
    gate_into(a, b, a);
}

// Saves a and b for backward, which recomputes silu(a) from them.
struct SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
        const at::Tensor ac = a.contiguous(), bc = b.contiguous();
        ctx->save_for_backward({ac, bc});
        return swiglu_op(ac, bc);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        // Written by the kernel, outside autograd: differentiating them again would give zero.
        TORCH_CHECK(!at::GradMode::is_enabled(), "llama_mini::swiglu: the fused backward cannot be "
                    "differentiated again; leave use_fused_swiglu out for higher-order gradients");
        const torch::autograd::variable_list saved = ctx->get_saved_variables();
        const at::Tensor &a = saved[0], &b = saved[1], dout = grads[0].contiguous();
        at::Tensor da = at::empty_like(a), db = at::empty_like(b);
        ::swiglu_backward(a.const_data_ptr(), b.const_data_ptr(), dout.const_data_ptr(), da.mutable_data_ptr(),
                          db.mutable_data_ptr(), a.numel(), float_type(a, "a"),
                          threads_for_work(a.numel() * 16));
        return {da, db};
    }
};

at::Tensor swiglu_autograd(const at::Tensor& a, const at::Tensor& b) { return SwiGLUFunction::apply(a, b); }

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) { m.def("swiglu(Tensor a, Tensor b) -> Tensor"); }
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) { m.impl("swiglu", llama_mini::swiglu_op); }
TORCH_LIBRARY_IMPL(llama_mini, AutogradCPU, m) { m.impl("swiglu", llama_mini::swiglu_autograd); }
