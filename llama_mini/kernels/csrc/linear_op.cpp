// The torch operators llama_mini::linear_dense, linear_int8, linear_int4, linear_q8_0 and linear_k_quant over
// the kernels of linear.cpp and k_quants.cpp (y = x W^T for any number of rows of x, in x's dtype), and matvec_available, which
// tells the Python side whether this build has the vector kernels at all. Inference only (no
// autograd): the Python side calls them without gradients and runs the layers' own code otherwise.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"
#include "activations.h"
#include "ops.h"

namespace llama_mini {

namespace {

int threads_for(int64_t rows, int64_t n, int64_t k) { return threads_for_work(rows * n * k); }

// The rows of x (..., k): the product of its leading sizes (not numel / k, which divides by
// zero for a layer without inputs).
int64_t rows_of(const at::Tensor& x) {
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < x.dim(); d++) rows *= x.size(d);
    return rows;
}

// Checks x (..., k) against the weight's k, and allocates y (..., n) in x's dtype.
at::Tensor output_for(const at::Tensor& x, int64_t n, int64_t k) {
    TORCH_CHECK(vector_kernels_available(), "llama_mini::linear: this build has no vector kernels (it needs AVX2 and FMA)");
    TORCH_CHECK(x.device().is_cpu(), "llama_mini::linear: CPU tensors only");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "llama_mini::linear: input of shape ", x.sizes(),
                " for a weight with ", k, " inputs");
    float_type(x, "the input");
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    return activation(sizes, x.options());
}

// x rounded to int8 in blocks of 32 or 256 (quantize_activations), in per-thread buffers.
struct Activations {
    std::vector<int8_t> codes;
    std::vector<float> scales;
    std::vector<int32_t> sums;
};

const Activations& quantized(const at::Tensor& x, int64_t rows, int64_t k, int64_t block) {
    TORCH_CHECK(k % block == 0, "llama_mini::linear: integer weights need a multiple of ", block, " inputs, not ", k);
    thread_local Activations a;
    a.codes.resize(rows * k), a.scales.resize(rows * k / block), a.sums.resize(rows * k / 32);
    quantize_activations(x.const_data_ptr(), float_type(x, "the input"), a.codes.data(), a.scales.data(), a.sums.data(), rows, k,
                         block, threads_for_work(8 * rows * k));  // a few operations per input
    return a;
}

// An integer kernel's call: y (..., n) for x, and x's rows rounded to int8.
struct IntegerCall {
    at::Tensor y;
    int64_t rows;
    const Activations& x;
};

IntegerCall integer_call(const at::Tensor& x, int64_t n, int64_t k, int64_t block = 32) {
    at::Tensor y = output_for(x, n, k);
    const at::Tensor xc = x.contiguous();
    const int64_t rows = rows_of(xc);
    return {y, rows, quantized(xc, rows, k, block)};
}

// A weight held in panels (n / 16, k, 16) (kernels.h's linear_panels).
at::Tensor panels_op(const at::Tensor& x, const at::Tensor& panels) {
    TORCH_CHECK(panels.is_contiguous() && panels.size(2) == 16,
                "llama_mini::linear_dense: panels (outputs / 16, inputs, 16), contiguous");
    const int w_type = float_type(panels, "the weight");
    const int64_t n = panels.size(0) * 16, k = panels.size(1);
    at::Tensor y = output_for(x, n, k);
    const at::Tensor xc = x.contiguous();
    const int64_t rows = rows_of(xc);
    ::linear_panels(xc.const_data_ptr(), panels.const_data_ptr(), y.mutable_data_ptr(), rows, n, k,
                    float_type(x, "the input"), w_type, threads_for(rows, n, k));
    return y;
}

}  // namespace

at::Tensor dense_op(const at::Tensor& x, const at::Tensor& weight) {
    if (weight.dim() == 3) return panels_op(x, weight);
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "llama_mini::linear_dense: a contiguous 2-D weight, or 3-D panels");
    const int w_type = float_type(weight, "the weight");
    const int64_t n = weight.size(0), k = weight.size(1);
    at::Tensor y = output_for(x, n, k);
    const at::Tensor xc = x.contiguous();
    const int64_t rows = rows_of(xc);
    ::linear_dense(xc.const_data_ptr(), weight.const_data_ptr(), y.mutable_data_ptr(), rows, n, k,
                   float_type(x, "the input"), w_type, threads_for(rows, n, k));
    return y;
}

at::Tensor int8_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kChar && weight.size(1) % 256 == 0,
                "llama_mini::linear_int8: a contiguous int8 weight (rows / 8, 8 * inputs), inputs a multiple of 32");
    const int64_t n = weight.size(0) * 8, k = weight.size(1) / 8;
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == weight.size(0) && scales.size(1) == k / 32 * 8 && scales.is_contiguous(),
                "llama_mini::linear_int8: scales (rows / 8, inputs / 32 * 8), one per row and block of 32 inputs");
    const int dtype = float_type(scales, "the scales");
    const IntegerCall call = integer_call(x, n, k);
    ::linear_int8(call.x.codes.data(), call.x.scales.data(), call.x.sums.data(), weight.const_data_ptr<int8_t>(),
                  scales.const_data_ptr(), call.y.mutable_data_ptr(), call.rows, n, k, dtype, float_type(call.y, "the input"),
                  threads_for(call.rows, n, k));
    return call.y;
}

at::Tensor int4_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                   const std::optional<at::Tensor>& super_scales, const std::optional<at::Tensor>& super_offsets) {
    TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(1) % 128 == 0,
                "llama_mini::linear_int4: contiguous uint8 codes (rows / 8, 4 * inputs), inputs a multiple of 32");
    const int64_t n = codes.size(0) * 8, k = codes.size(1) / 4;
    const int64_t width = scales.dim() == 2 ? scales.size(1) : 0;  // groups * 8
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && (k == 0 || width >= 8) && width % 8 == 0 &&
                    (k == 0 || (k % (width / 8) == 0 && (k / (width / 8)) % 32 == 0)) && scales.is_contiguous() &&
                    (!offsets || (scales.sizes() == offsets->sizes() && offsets->is_contiguous() &&
                                  scales.scalar_type() == offsets->scalar_type())),
                "llama_mini::linear_int4: scales and offsets (rows / 8, groups * 8), groups a multiple of 32 inputs");
    const int64_t group = k == 0 ? 32 : k / (width / 8);
    const void* supers[2] = {nullptr, nullptr};
    int64_t super_group = 0;
    if (super_scales || super_offsets) {
        TORCH_CHECK(super_scales && super_offsets && offsets && scales.scalar_type() == at::kByte, "llama_mini::linear_int4: factored "
                    "scales and offsets are uint8, with both super_scales and super_offsets");
        const at::Tensor& s = *super_scales;
        const int64_t super_width = s.dim() == 2 ? s.size(1) : 0;
        TORCH_CHECK(s.dim() == 2 && s.size(0) == codes.size(0) && super_width >= 8 && super_width % 8 == 0 &&
                        width % super_width == 0 && s.sizes() == super_offsets->sizes() && s.is_contiguous() &&
                        super_offsets->is_contiguous() && s.scalar_type() == super_offsets->scalar_type(),
                    "llama_mini::linear_int4: super_scales and super_offsets (rows / 8, super-groups * 8), of one dtype, "
                    "each super-group a whole number of groups");
        supers[0] = s.const_data_ptr(), supers[1] = super_offsets->const_data_ptr();
        super_group = k / (super_width / 8);
    }
    const int dtype = float_type(supers[0] ? *super_scales : scales, "the scales");
    const IntegerCall call = integer_call(x, n, k, super_group ? super_group : 32);  // factored: activations per super-group
    thread_local std::vector<float> per_block;  // each block of 32's activation scale, the kernel's operand
    const float* xd = call.x.scales.data();
    if (super_group) {
        per_block.resize(call.rows * k / 32);
        for (size_t i = 0; i < per_block.size(); i++) per_block[i] = xd[i / (super_group / 32)];
        xd = per_block.data();
    }
    ::linear_int4(call.x.codes.data(), xd, call.x.sums.data(), codes.const_data_ptr<uint8_t>(),
                  scales.const_data_ptr(), offsets ? offsets->const_data_ptr() : nullptr, supers[0], supers[1], super_group,
                  call.y.mutable_data_ptr(), call.rows, n, k, group, dtype, float_type(call.y, "the input"),
                  threads_for(call.rows, n, k));
    return call.y;
}

at::Tensor q8_0_op(const at::Tensor& x, const at::Tensor& blocks) {
    TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte && blocks.size(0) % 8 == 0 &&
                    blocks.size(1) % 34 == 0,
                "llama_mini::linear_q8_0: a GGUF file's Q8_0 rows, contiguous uint8 (rows, inputs / 32 * 34), rows a multiple of 8");
    const int64_t n = blocks.size(0), k = blocks.size(1) / 34 * 32;
    const IntegerCall call = integer_call(x, n, k);
    ::linear_q8_0(call.x.codes.data(), call.x.scales.data(), call.x.sums.data(), blocks.const_data_ptr<uint8_t>(),
                  call.y.mutable_data_ptr(), call.rows, n, k, float_type(call.y, "the input"), threads_for(call.rows, n, k));
    return call.y;
}

at::Tensor k_quant_op(const at::Tensor& x, const at::Tensor& blocks) {
    TORCH_CHECK(blocks.dim() == 3 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte &&
                    (blocks.size(2) == 176 || blocks.size(2) == 210),
                "llama_mini::linear_k_quant: a GGUF file's Q5_K or Q6_K rows, contiguous uint8 (rows, inputs / 256, 176 or 210)");
    const int64_t n = blocks.size(0), k = blocks.size(1) * 256;
    const IntegerCall call = integer_call(x, n, k, 256);
    const auto kernel = blocks.size(2) == 176 ? ::linear_q5_k : ::linear_q6_k;
    kernel(call.x.codes.data(), call.x.scales.data(), blocks.const_data_ptr<uint8_t>(), call.y.mutable_data_ptr(), call.rows, n, k,
           float_type(call.y, "the input"), threads_for(call.rows, n, k));
    return call.y;
}

bool available() { return vector_kernels_available() != 0; }

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) {
    m.def("matvec_available() -> bool", &llama_mini::available);
    m.def("linear_dense(Tensor x, Tensor weight) -> Tensor");
    m.def("linear_int8(Tensor x, Tensor weight, Tensor scales) -> Tensor");
    m.def("linear_int4(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? super_scales=None, "
          "Tensor? super_offsets=None) -> Tensor");
    m.def("linear_q8_0(Tensor x, Tensor blocks) -> Tensor");
    m.def("linear_k_quant(Tensor x, Tensor blocks) -> Tensor");
}
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) {
    m.impl("linear_dense", llama_mini::dense_op);
    m.impl("linear_int8", llama_mini::int8_op);
    m.impl("linear_int4", llama_mini::int4_op);
    m.impl("linear_q8_0", llama_mini::q8_0_op);
    m.impl("linear_k_quant", llama_mini::k_quant_op);
}
