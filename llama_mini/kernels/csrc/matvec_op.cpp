// The torch operators llama_mini::linear_dense, linear_int8 and linear_int4 over the kernels of
// matvec.cpp (y = x W^T for any number of rows of x, in x's dtype), attention over
// attention.cpp's, swiglu over swiglu.cpp's and rope over rope.cpp's. Inference only (no
// autograd), but for swiglu and rope, which training runs too (kernels/fused_swiglu.py,
// fused_rope.py), with their autograd nodes in C++ as rms_norm's (rms_norm_op.cpp says why C++);
// the Python side calls the others without gradients and runs the layers' own code otherwise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "matvec.h"
#include "ops.h"

namespace llama_mini {

namespace {

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_float(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || is_bf16(t), "llama_mini::linear: ", what,
                " must be float32 or bfloat16, not ", t.scalar_type());
}

// Below this many multiply-adds one thread does the work: waking the others costs more
// (a tiny model's layers; a real model's are hundreds of times larger).
constexpr int64_t PARALLEL_MIN_WORK = 1 << 17;

int threads_for(int64_t rows, int64_t n, int64_t k) {
    return rows * n * k >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1;
}

// The rows of x (..., k): the product of its leading sizes (not numel / k, which divides by
// zero for a layer without inputs).
int64_t rows_of(const at::Tensor& x) {
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < x.dim(); d++) rows *= x.size(d);
    return rows;
}

// Checks x (..., k) against the weight's k, and allocates y (..., n) in x's dtype.
at::Tensor output_for(const at::Tensor& x, int64_t n, int64_t k) {
    TORCH_CHECK(matvec_available(), "llama_mini::linear: this build has no vector kernels (it needs AVX2 and FMA)");
    TORCH_CHECK(x.device().is_cpu(), "llama_mini::linear: CPU tensors only");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "llama_mini::linear: input of shape ", x.sizes(),
                " for a weight with ", k, " inputs");
    check_float(x, "the input");
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    return at::empty(sizes, x.options());
}

// x rounded to int8 in blocks of 32 (quantize_activations), in per-thread buffers.
struct Activations {
    std::vector<int8_t> codes;
    std::vector<float> scales;
    std::vector<int32_t> sums;
};

const Activations& quantized(const at::Tensor& x, int64_t rows, int64_t k) {
    TORCH_CHECK(k % 32 == 0, "llama_mini::linear: integer weights need a multiple of 32 inputs, not ", k);
    thread_local Activations a;
    a.codes.resize(rows * k), a.scales.resize(rows * k / 32), a.sums.resize(rows * k / 32);
    const int threads = rows * k >= PARALLEL_MIN_WORK / 8 ? at::get_num_threads() : 1;  // a few operations per input
    quantize_activations(x.const_data_ptr(), is_bf16(x), a.codes.data(), a.scales.data(), a.sums.data(), rows, k, threads);
    return a;
}

// An integer kernel's call: y (..., n) for x, and x's rows rounded to int8.
struct IntegerCall {
    at::Tensor y;
    int64_t rows;
    const Activations& x;
};

IntegerCall integer_call(const at::Tensor& x, const at::Tensor& scales, int64_t n, int64_t k) {
    check_float(scales, "the scales");
    at::Tensor y = output_for(x, n, k);
    const at::Tensor xc = x.contiguous();
    const int64_t rows = rows_of(xc);
    return {y, rows, quantized(xc, rows, k)};
}

// A float32 weight held in panels (n / 16, k, 16) (matvec.h's linear_panels).
at::Tensor panels_op(const at::Tensor& x, const at::Tensor& panels) {
    TORCH_CHECK(panels.is_contiguous() && panels.size(2) == 16 && panels.scalar_type() == at::kFloat,
                "llama_mini::linear_dense: panels (outputs / 16, inputs, 16), contiguous float32");
    const int64_t n = panels.size(0) * 16, k = panels.size(1);
    at::Tensor y = output_for(x, n, k);
    const at::Tensor xc = x.contiguous();
    const int64_t rows = rows_of(xc);
    ::linear_panels(xc.const_data_ptr(), panels.const_data_ptr<float>(), y.mutable_data_ptr(), rows, n, k, is_bf16(x),
                    threads_for(rows, n, k));
    return y;
}

}  // namespace

at::Tensor dense_op(const at::Tensor& x, const at::Tensor& weight) {
    if (weight.dim() == 3) return panels_op(x, weight);
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "llama_mini::linear_dense: a contiguous 2-D weight, or 3-D panels");
    check_float(weight, "the weight");
    const int64_t n = weight.size(0), k = weight.size(1);
    at::Tensor y = output_for(x, n, k);
    const at::Tensor xc = x.contiguous();
    const int64_t rows = rows_of(xc);
    ::linear_dense(xc.const_data_ptr(), weight.const_data_ptr(), y.mutable_data_ptr(), rows, n, k, is_bf16(x),
                   is_bf16(weight), threads_for(rows, n, k));
    return y;
}

at::Tensor int8_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kChar && weight.size(1) % 256 == 0,
                "llama_mini::linear_int8: a contiguous int8 weight (rows / 8, 8 * inputs), inputs a multiple of 32");
    const int64_t n = weight.size(0) * 8, k = weight.size(1) / 8;
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == weight.size(0) && scales.size(1) == k / 32 * 8 && scales.is_contiguous(),
                "llama_mini::linear_int8: scales (rows / 8, inputs / 32 * 8), one per row and block of 32 inputs");
    const IntegerCall call = integer_call(x, scales, n, k);
    ::linear_int8(call.x.codes.data(), call.x.scales.data(), call.x.sums.data(), weight.const_data_ptr<int8_t>(),
                  scales.const_data_ptr(), call.y.mutable_data_ptr(), call.rows, n, k, is_bf16(scales), is_bf16(call.y),
                  threads_for(call.rows, n, k));
    return call.y;
}

at::Tensor int4_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros) {
    TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(1) % 128 == 0,
                "llama_mini::linear_int4: contiguous uint8 codes (rows / 8, 4 * inputs), inputs a multiple of 32");
    const int64_t n = codes.size(0) * 8, k = codes.size(1) / 4;
    const int64_t width = scales.dim() == 2 ? scales.size(1) : 0;  // groups * 8
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && (k == 0 || width >= 8) && width % 8 == 0 &&
                    (k == 0 || (k % (width / 8) == 0 && (k / (width / 8)) % 32 == 0)) && scales.sizes() == zeros.sizes() &&
                    scales.is_contiguous() && zeros.is_contiguous() && scales.scalar_type() == zeros.scalar_type(),
                "llama_mini::linear_int4: scales and zeros (rows / 8, groups * 8), groups a multiple of 32 inputs");
    const IntegerCall call = integer_call(x, scales, n, k);
    ::linear_int4(call.x.codes.data(), call.x.scales.data(), call.x.sums.data(), codes.const_data_ptr<uint8_t>(),
                  scales.const_data_ptr(), zeros.const_data_ptr(), call.y.mutable_data_ptr(), call.rows, n, k,
                  k == 0 ? 32 : k / (width / 8), is_bf16(scales), is_bf16(call.y), threads_for(call.rows, n, k));
    return call.y;
}

// silu(a) * b, elementwise, for a and b of one shape and dtype.
at::Tensor swiglu_op(const at::Tensor& a, const at::Tensor& b) {
    TORCH_CHECK(matvec_available(), "llama_mini::swiglu: this build has no vector kernels");
    TORCH_CHECK(a.device().is_cpu() && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
                "llama_mini::swiglu: a and b of one shape and dtype, on the CPU");
    check_float(a, "a");
    const at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor out = at::empty_like(ac);
    ::swiglu(ac.const_data_ptr(), bc.const_data_ptr(), out.mutable_data_ptr(), ac.numel(), is_bf16(ac),
             ac.numel() * 16 >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1);
    return out;
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
                          db.mutable_data_ptr(), a.numel(), is_bf16(a),
                          a.numel() * 16 >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1);
        return {da, db};
    }
};

at::Tensor swiglu_autograd(const at::Tensor& a, const at::Tensor& b) { return SwiGLUFunction::apply(a, b); }

// RoPE (rope.cpp) of x (B, T, heads, d) at T positions, or its gradient (backward): cos and sin
// the model's float32 tables, T x d values each.
at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
    TORCH_CHECK(matvec_available(), "llama_mini::rope: this build has no vector kernels");
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.size(3) % 8 == 0, "llama_mini::rope: x (B, T, heads, d) on the CPU, d a multiple of 8");
    check_float(x, "x");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == x.size(1) * x.size(3) &&
                    sin.numel() == cos.numel(),
                "llama_mini::rope: float32 cos and sin, d values per position");
    const at::Tensor xc = x.contiguous(), cosc = cos.contiguous(), sinc = sin.contiguous();
    at::Tensor out = at::empty_like(xc);
    const int64_t rows = xc.numel() / std::max<int64_t>(xc.size(3), 1);
    ::rope(xc.const_data_ptr(), out.mutable_data_ptr(), cosc.const_data_ptr<float>(), sinc.const_data_ptr<float>(), rows,
           xc.size(2), xc.size(1), xc.size(3), backward, is_bf16(xc), xc.numel() * 4 >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1);
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

// q (B, T, heads, d), k and v (B, T, kv_heads, d): the new positions', as the linear layers
// give them; k_cache, v_cache (B', kv_heads, positions, d) with B <= B'; cos, sin (T, d) float32.
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, int64_t start) {
    TORCH_CHECK(matvec_available(), "llama_mini::attention: this build has no vector kernels");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                    q.size(1) == k.size(1) && q.size(3) == k.size(3) && k.size(2) >= 1 && q.size(2) % k.size(2) == 0,
                "llama_mini::attention: q (B, T, heads, d), k and v (B, T, kv_heads, d)");
    const int64_t batch = q.size(0), rows = q.size(1), heads = q.size(2), kv_heads = k.size(2), head_dim = q.size(3);
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                    k_cache.size(0) >= batch && k_cache.size(1) == kv_heads && k_cache.size(3) == head_dim &&
                    start >= 0 && start + rows <= k_cache.size(2) && k_cache.stride(3) == 1 &&
                    k_cache.stride(2) == head_dim,
                "llama_mini::attention: a cache (batch, kv_heads, positions, d) holding the positions");
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &k_cache, &v_cache})
        TORCH_CHECK(t->scalar_type() == q.scalar_type(), "llama_mini::attention: one dtype for q, k, v and the cache");
    check_float(q, "q");
    TORCH_CHECK(head_dim % 8 == 0 && head_dim >= 8 && head_dim <= 256,
                "llama_mini::attention: head_dim ", head_dim, " is not a multiple of 8 up to 256");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == rows * head_dim &&
                    sin.numel() == rows * head_dim,
                "llama_mini::attention: float32 cos and sin, head_dim values per position");
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    const at::Tensor cosc = cos.contiguous(), sinc = sin.contiguous();
    at::Tensor out = at::empty({batch, rows, heads, head_dim}, q.options());
    const int64_t work = batch * heads * rows * (start + rows) * 2 * head_dim;
    ::attention(qc.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(), k_cache.mutable_data_ptr(),
                v_cache.mutable_data_ptr(), out.mutable_data_ptr(), cosc.const_data_ptr<float>(),
                sinc.const_data_ptr<float>(), batch, rows, heads, kv_heads, head_dim, start, k_cache.stride(0),
                k_cache.stride(1), is_bf16(q), work >= PARALLEL_MIN_WORK ? at::get_num_threads() : 1);
    return out;
}

bool available() { return matvec_available() != 0; }

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) {
    m.def("matvec_available() -> bool", &llama_mini::available);
    m.def("linear_dense(Tensor x, Tensor weight) -> Tensor");
    m.def("linear_int8(Tensor x, Tensor weight, Tensor scales) -> Tensor");
    m.def("linear_int4(Tensor x, Tensor codes, Tensor scales, Tensor zeros) -> Tensor");
    m.def("swiglu(Tensor a, Tensor b) -> Tensor");
    m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
    m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, "
          "Tensor sin, int start) -> Tensor");
}
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) {
    m.impl("linear_dense", llama_mini::dense_op);
    m.impl("linear_int8", llama_mini::int8_op);
    m.impl("linear_int4", llama_mini::int4_op);
    m.impl("swiglu", llama_mini::swiglu_op);
    m.impl("rope", llama_mini::rope_forward);
    m.impl("attention", llama_mini::attention_op);
}
TORCH_LIBRARY_IMPL(llama_mini, AutogradCPU, m) {
    m.impl("swiglu", llama_mini::swiglu_autograd);
    m.impl("rope", llama_mini::rope_autograd);
}
