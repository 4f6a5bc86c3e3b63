// The torch operator llama_mini::attention over attention.cpp's kernel: causal attention of the
// new positions over a KV cache, which it writes their keys and values into. Inference only (no
// autograd); block_op.cpp calls it for a layer's attention.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <initializer_list>

#include "kernels.h"
#include "activations.h"
#include "ops.h"

namespace llama_mini {

// q (B, T, heads, d), k and v (B, T, kv_heads, d): the new positions', as the linear layers
// give them; k_cache, v_cache (B', kv_heads, positions, d) with B <= B', of one float dtype
// (KVCache's); cos, sin (T, d) float32.
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, int64_t start) {
    TORCH_CHECK(vector_kernels_available(), "llama_mini::attention: this build has no vector kernels");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                    q.size(1) == k.size(1) && q.size(3) == k.size(3) && k.size(2) >= 1 && q.size(2) % k.size(2) == 0,
                "llama_mini::attention: q (B, T, heads, d), k and v (B, T, kv_heads, d)");
    const int64_t batch = q.size(0), rows = q.size(1), heads = q.size(2), kv_heads = k.size(2), head_dim = q.size(3);
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                    k_cache.size(0) >= batch && k_cache.size(1) == kv_heads && k_cache.size(3) == head_dim &&
                    start >= 0 && start + rows <= k_cache.size(2) && k_cache.stride(3) == 1 &&
                    k_cache.stride(2) == head_dim,
                "llama_mini::attention: a cache (batch, kv_heads, positions, d) holding the positions");
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v})
        TORCH_CHECK(t->scalar_type() == q.scalar_type(), "llama_mini::attention: one dtype for q, k and v");
    TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "llama_mini::attention: one dtype for the two caches");
    const int type = float_type(q, "q"), cache_type = float_type(k_cache, "the cache");
    TORCH_CHECK(head_dim % 8 == 0 && head_dim >= 8 && head_dim <= 256,
                "llama_mini::attention: head_dim ", head_dim, " is not a multiple of 8 up to 256");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == rows * head_dim &&
                    sin.numel() == rows * head_dim,
                "llama_mini::attention: float32 cos and sin, head_dim values per position");
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    const at::Tensor cosc = cos.contiguous(), sinc = sin.contiguous();
    at::Tensor out = activation({batch, rows, heads, head_dim}, q.options());
    const int64_t work = batch * heads * rows * (start + rows) * 2 * head_dim;
    ::attention(qc.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(), k_cache.mutable_data_ptr(),
                v_cache.mutable_data_ptr(), out.mutable_data_ptr(), cosc.const_data_ptr<float>(),
                sinc.const_data_ptr<float>(), batch, rows, heads, kv_heads, head_dim, start, k_cache.stride(0),
                k_cache.stride(1), type, cache_type, threads_for_work(work));
    return out;
}

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) {
    m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, "
          "Tensor sin, int start) -> Tensor");
}
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) { m.impl("attention", llama_mini::attention_op); }
