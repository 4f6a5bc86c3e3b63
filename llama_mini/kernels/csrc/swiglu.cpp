// SwiGLU's gate on the CPU: out = silu(a) * b, elementwise, as FeedForward computes
// F.silu(w1 x) * w3 x (model.py): silu(a) = a / (1 + exp(-a)) in float32, rounded to the
// dtype, then the product, rounded again.
//
// torch's own silu computes a tensor's elements (and each thread's share of them) in vectors of
// sixteen, but the last few with a scalar exp, which rounds differently: an element's result
// then depends on where it sits, so a row's activations differ with the hidden size, the rows
// beside it and the thread count. Here every element goes through the same eight-lane code,
// the last few padded into a vector of their own, so each row of a layer is computed as if alone.
//
// Plain C++ over raw pointers behind a C ABI (matvec.h); block_op.cpp calls it. x86-64 with
// AVX2 and FMA only; elsewhere the entry point is empty.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "matvec.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

template <typename T> __m256 gate8(const T* a, const T* b) {
    const __m256 x = load8(a);
    __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    if constexpr (sizeof(T) == 2) silu = round_bf16(silu);
    return _mm256_mul_ps(silu, load8(b));
}

template <typename T> void gate(const T* a, const T* b, T* out, int64_t n, int threads) {
    const int64_t whole = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < whole; i++) store8(out + 8 * i, gate8(a + 8 * i, b + 8 * i));
    if (const int64_t rest = n - 8 * whole) {  // the last elements, in a vector of their own
        T pa[8] = {}, pb[8] = {}, po[8];
        std::memcpy(pa, a + 8 * whole, rest * sizeof(T));
        std::memcpy(pb, b + 8 * whole, rest * sizeof(T));
        store8(po, gate8(pa, pb));
        std::memcpy(out + 8 * whole, po, rest * sizeof(T));
    }
}

}  // namespace

extern "C" void swiglu(const void* a, const void* b, void* out, int64_t n, int bf16, int threads) {
    if (bf16)
        gate(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), static_cast<uint16_t*>(out), n, threads);
    else
        gate(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(out), n, threads);
}

#else  // no AVX2: nothing here runs (matvec_available() says so).

extern "C" void swiglu(const void*, const void*, void*, int64_t, int, int) {}

#endif
