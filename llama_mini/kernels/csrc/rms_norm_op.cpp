// The torch operator llama_mini::rms_norm(x, weight, eps, n_rms, vector_bytes): the kernels
// of rms_norm.cpp with their autograd node, all in C++.
//
// Why not a torch.autograd.Function in Python around a ctypes call: inside a model the
// interpreter's work per norm and per direction (its data cold in cache after the matmuls)
// made a small RMSNorm model's training step measurably slower than nn.LayerNorm's, whose
// dispatch and autograd node are C++ (docs/norm_step_speed.md). Registered through the
// dispatcher, the fused norm pays what LayerNorm pays: one operator call forward, one C++
// node backward.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <tuple>

#include "activations.h"
#include "ops.h"
#include "rms_norm.h"

namespace llama_mini {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Below this many elements one thread does the work: waking the others costs more (torch's
// own GRAIN_SIZE). One decoded token per row is the common case.
constexpr int64_t PARALLEL_MIN_ELEMENTS = 32768;

struct Kernel {
    at::ScalarType input, weight;
    decltype(&rms_norm_fwd_float32_float32) forward;
    decltype(&rms_norm_bwd_float32_float32) backward;
};

#define RMS_NORM_ENTRY(NAME, X_DTYPE, W_DTYPE) \
    {at::k##X_DTYPE, at::k##W_DTYPE, rms_norm_fwd_##NAME, rms_norm_bwd_##NAME},
constexpr Kernel KERNELS[] = {RMS_NORM_DTYPES(RMS_NORM_ENTRY)};

const Kernel& kernel_for(const at::Tensor& x, const at::Tensor& weight) {
    for (const Kernel& k : KERNELS)
        if (k.input == x.scalar_type() && k.weight == weight.scalar_type()) return k;
    TORCH_CHECK(false, "llama_mini::rms_norm: no CPU kernel for ", x.scalar_type(), " input with ",
                weight.scalar_type(), " weight");
}

int threads_for(const at::Tensor& x) {
    return x.numel() >= PARALLEL_MIN_ELEMENTS ? at::get_num_threads() : 1;
}

// The sum's vector width in elements of the statistic's type (float32, float64 for float64).
int lanes(const at::Tensor& x, int64_t vector_bytes) {
    return static_cast<int>(vector_bytes / (x.scalar_type() == at::kDouble ? 8 : 4));
}

// Contiguous x (..., dim) -> output (weight's dtype) and per-row 1/rms.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& weight, double eps,
                                           int64_t n_rms, int64_t vector_bytes) {
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "llama_mini::rms_norm: CPU tensors only");
    TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
                "llama_mini::rms_norm: weight of shape ", weight.sizes(), " for input of shape ", x.sizes(),
                "; the weight needs the input's last dimension");
    const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
    TORCH_CHECK(n_rms >= 1 && n_rms <= dim || rows == 0, "llama_mini::rms_norm: n_rms ", n_rms,
                " outside 1..", dim);
    const Kernel& k = kernel_for(x, weight);
    at::Tensor y = activation(x.sizes(), x.options().dtype(weight.scalar_type()));
    at::Tensor rstd = at::empty({rows}, x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
    k.forward(x.const_data_ptr(), weight.const_data_ptr(), y.mutable_data_ptr(), rstd.mutable_data_ptr(), rows,
              dim, n_rms, eps, lanes(x, vector_bytes), threads_for(x));
    return {y, rstd};
}

// Saves x and the per-row 1/rms (one float per row) for backward, which recomputes the rest.
struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                              int64_t n_rms, int64_t vector_bytes) {
        const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
        auto [y, rstd] = llama_mini::forward(xc, wc, eps, n_rms, vector_bytes);
        ctx->save_for_backward({xc, wc, rstd});
        ctx->saved_data["n_rms"] = n_rms;
        return y;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        // The gradients are written by the kernel, outside autograd: differentiating them
        // again (create_graph=True) would silently give zero.
        TORCH_CHECK(!at::GradMode::is_enabled(), "llama_mini::rms_norm: the fused backward cannot be "
                    "differentiated again; leave use_fused_rmsnorm out for higher-order gradients");
        const variable_list saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
        const at::Tensor dy = grads[0].contiguous();
        at::Tensor dx = at::empty_like(x), dw = at::empty_like(weight);
        kernel_for(x, weight).backward(dy.const_data_ptr(), x.const_data_ptr(), weight.const_data_ptr(),
                                       rstd.const_data_ptr(), dx.mutable_data_ptr(), dw.mutable_data_ptr(),
                                       rstd.size(0), x.size(-1), ctx->saved_data["n_rms"].toInt(), threads_for(x));
        return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t n_rms, int64_t vector_bytes) {
    return std::get<0>(forward(x.contiguous(), weight.contiguous(), eps, n_rms, vector_bytes));
}

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t n_rms,
                             int64_t vector_bytes) {
    return RMSNormFunction::apply(x, weight, eps, n_rms, vector_bytes);
}

}  // namespace llama_mini

TORCH_LIBRARY(llama_mini, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps, int n_rms, int vector_bytes) -> Tensor");
}
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) { m.impl("rms_norm", llama_mini::rms_norm); }
TORCH_LIBRARY_IMPL(llama_mini, AutogradCPU, m) { m.impl("rms_norm", llama_mini::rms_norm_autograd); }
