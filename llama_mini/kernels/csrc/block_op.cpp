// The torch operator llama_mini::block: a TransformerBlock's forward (model.py) over a KV cache,
// in one call, for a decoding step or a prompt.
//
// Decoding a small model on a CPU, a layer's arithmetic takes a few hundred microseconds, and
// the eager block's thirty-odd calls from Python (modules, norms, products, residual adds) cost
// about as much again. Here the same operators run in the same order from C++: the result is
// the block's on the kernels, bit for bit, without the interpreter between them. SwiGLU's gate
// is the kernels' own (swiglu.cpp), which computes every element alike wherever it sits.
//
// It mirrors these functions of model.py: TransformerBlock.forward, RMSNorm.forward and _norm,
// Attention.forward and rotate, apply_rotary_emb, KVCache.__init__ and update, FeedForward.forward
// and gate (KernelBlock.computes in block.py). Where one of them is edited, fingerprints.py finds it
// and the block runs model.py's code instead: change one, and this file with it, then record it.

#include <ATen/core/List.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <optional>

#include "activations.h"
#include "ops.h"

namespace llama_mini {

namespace {

// y = x W^T for a linear layer as the block holds it: a float weight (nn.Linear), int8 codes
// with their scales (Int8Linear), int4 codes with scales and offsets, factored, or symmetric without
// offsets (Int4Linear), or a GGUF file's Q8_0 rows where it maps them (MappedQ8_0Linear), or its
// Q5_K or Q6_K blocks, (rows, blocks, 176 or 210) (quant/k_quants.py).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                  const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& super_scales,
                  const std::optional<at::Tensor>& super_offsets) {
    if (!scales && weight.scalar_type() == at::kByte) return weight.dim() == 3 ? k_quant_op(x, weight) : q8_0_op(x, weight);
    if (!scales) return dense_op(x, weight);
    if (weight.scalar_type() == at::kChar) return int8_op(x, weight, *scales);
    return int4_op(x, weight, *scales, offsets, super_scales, super_offsets);
}

}  // namespace

// x (B, T, dim): the residual stream at positions start .. start + T - 1. The seven weights, in
// the order wq, wk, wv, wo, w1, w2, w3, each with its scales and offsets where quantized, and
// their super-groups' where factored. The
// norms are RMSNorms over the whole row (rms_norm's eps and summation width); head_dim and
// kv_heads are the cache's.
at::Tensor block_op(const at::Tensor& x, const at::Tensor& attention_norm, const at::Tensor& ffn_norm, double eps,
                    int64_t vector_bytes, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
                    const c10::List<std::optional<at::Tensor>>& offsets,
                    const c10::List<std::optional<at::Tensor>>& super_scales,
                    const c10::List<std::optional<at::Tensor>>& super_offsets, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& cos, const at::Tensor& sin, int64_t start) {
    TORCH_CHECK(weights.size() == 7 && scales.size() == 7 && offsets.size() == 7 && super_scales.size() == 7 &&
                    super_offsets.size() == 7,
                "llama_mini::block: seven weights (wq, wk, wv, wo, w1, w2, w3), each with scales, offsets, super_scales "
                "and super_offsets or None");
    TORCH_CHECK(x.dim() == 3 && k_cache.dim() == 4,
                "llama_mini::block: x (B, T, dim) and a cache (batch, kv_heads, positions, head_dim)");
    const auto project = [&](const at::Tensor& input, size_t i) {
        return linear(input, weights[i], scales[i], offsets[i], super_scales[i], super_offsets[i]);
    };
    const int64_t batch = x.size(0), rows = x.size(1), dim = x.size(2), head_dim = k_cache.size(3);
    const ReusedActivations reused;  // each activation in the buffer of the layer before's
    const auto residual = [](const at::Tensor& a, const at::Tensor& b) {
        at::Tensor sum = activation(a.sizes(), a.options());
        return at::add_out(sum, a, b);
    };

    // Each activation is let go as soon as it is read (reset), and the gate takes SwiGLU's result:
    // a prompt's chunk then holds about five of them at once, not thirteen.
    at::Tensor h = rms_norm(x, attention_norm, eps, dim, vector_bytes);
    at::Tensor q = project(h, 0).view({batch, rows, -1, head_dim});
    at::Tensor k = project(h, 1).view({batch, rows, -1, head_dim});
    at::Tensor v = project(h, 2).view({batch, rows, -1, head_dim});
    h.reset();
    at::Tensor attended = attention_op(q, k, v, k_cache, v_cache, cos, sin, start);
    q.reset(), k.reset(), v.reset();
    const at::Tensor after_attention = residual(x, project(attended.view({batch, rows, -1}), 3));
    attended.reset();

    at::Tensor g = rms_norm(after_attention, ffn_norm, eps, dim, vector_bytes);
    at::Tensor gate = project(g, 4);
    swiglu_in_place(gate, project(g, 6));
    g.reset();
    return residual(after_attention, project(gate, 5));
}

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) {
    m.def("block(Tensor x, Tensor attention_norm, Tensor ffn_norm, float eps, int vector_bytes, "
          "Tensor[] weights, Tensor?[] scales, Tensor?[] offsets, Tensor?[] super_scales, Tensor?[] super_offsets, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, "
          "Tensor sin, int start) -> Tensor");
}
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) { m.impl("block", llama_mini::block_op); }
