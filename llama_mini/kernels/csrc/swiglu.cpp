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
// Training differentiates it in one pass too (swiglu_backward): autograd's chain for the two
// eager operations reads and writes the hidden activations five times more.
//
// Plain C++ over raw pointers behind a C ABI (kernels.h); swiglu_op.cpp makes the operator,
// which block_op.cpp calls too. x86-64 with AVX2 and FMA only; elsewhere the entry points are empty.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

// 1 + exp(-x): silu(x) = x / it, sigmoid(x) = 1 / it.
inline __m256 one_plus_exp_neg(__m256 x) { return _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))); }

// silu(a) as the forward multiplies it: rounded to the dtype.
template <typename T> __m256 silu8(__m256 x, __m256 denominator) { return rounded<T>(_mm256_div_ps(x, denominator)); }

template <typename T> void gate8(const T* a, const T* b, T* out) {
    const __m256 x = load8(a);
    store8(out, _mm256_mul_ps(silu8<T>(x, one_plus_exp_neg(x)), load8(b)));
}

// da = (dout b) silu'(a), silu'(a) = s (1 + a (1 - s)) with s = sigmoid(a), as torch's
// silu_backward; db = dout silu(a), silu(a) = a s. In float32, each rounded once to the dtype.
template <typename T> void gate_grad8(const T* a, const T* b, const T* dout, T* da, T* db) {
    const __m256 x = load8(a), d = load8(dout), one = _mm256_set1_ps(1.0f);
    const __m256 s = _mm256_div_ps(one, one_plus_exp_neg(x));
    const __m256 slope = _mm256_mul_ps(s, _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, s))));
    const __m256 silu = rounded<T>(_mm256_mul_ps(x, s));
    store8(da, _mm256_mul_ps(_mm256_mul_ps(d, load8(b)), slope));
    store8(db, _mm256_mul_ps(d, silu));
}

// step(i) for each run of eight of n elements, threads sharing them; the last few elements go
// through the same code padded into eight of their own (tail(rest) copies them in and out).
template <typename Step, typename Tail> void in_eights(int64_t n, int threads, const Step& step, const Tail& tail) {
    const int64_t whole = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < whole; i++) step(8 * i);
    if (const int64_t rest = n - 8 * whole) tail(8 * whole, rest);
}

template <typename T> void gate(const T* a, const T* b, T* out, int64_t n, int threads) {
    in_eights(n, threads, [&](int64_t i) { gate8(a + i, b + i, out + i); }, [&](int64_t at, int64_t rest) {
        T pa[8] = {}, pb[8] = {}, po[8];
        std::memcpy(pa, a + at, rest * sizeof(T));
        std::memcpy(pb, b + at, rest * sizeof(T));
        gate8(pa, pb, po);
        std::memcpy(out + at, po, rest * sizeof(T));
    });
}

template <typename T> void gate_grad(const T* a, const T* b, const T* dout, T* da, T* db, int64_t n, int threads) {
    in_eights(n, threads, [&](int64_t i) { gate_grad8(a + i, b + i, dout + i, da + i, db + i); }, [&](int64_t at, int64_t rest) {
        T pa[8] = {}, pb[8] = {}, pd[8] = {}, pda[8], pdb[8];
        std::memcpy(pa, a + at, rest * sizeof(T));
        std::memcpy(pb, b + at, rest * sizeof(T));
        std::memcpy(pd, dout + at, rest * sizeof(T));
        gate_grad8(pa, pb, pd, pda, pdb);
        std::memcpy(da + at, pda, rest * sizeof(T));
        std::memcpy(db + at, pdb, rest * sizeof(T));
    });
}

}  // namespace

extern "C" void swiglu(const void* a, const void* b, void* out, int64_t n, int type, int threads) {
    as_float_type(a, type, [&]<typename T>(const T* at) { gate(at, static_cast<const T*>(b), static_cast<T*>(out), n, threads); });
}

extern "C" void swiglu_backward(const void* a, const void* b, const void* dout, void* da, void* db, int64_t n, int type,
                                int threads) {
    as_float_type(a, type, [&]<typename T>(const T* at) {
        gate_grad(at, static_cast<const T*>(b), static_cast<const T*>(dout), static_cast<T*>(da), static_cast<T*>(db), n, threads);
    });
}

#else  // no AVX2: nothing here runs (vector_kernels_available() says so).

extern "C" void swiglu(const void*, const void*, void*, int64_t, int, int) {}
extern "C" void swiglu_backward(const void*, const void*, const void*, void*, void*, int64_t, int, int) {}

#endif
