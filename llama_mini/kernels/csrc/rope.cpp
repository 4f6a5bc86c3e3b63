// RoPE for training on the CPU: model.py's apply_rotary_emb, out[j] = x[j] cos[j] + x[j ^ 1] sin[j]
// in float32 (sin holding -sin, sin for each pair), and its gradient, each in one pass.
//
// The eager function is four operations (two products, the pairs' swap, the sum) over q and k,
// and autograd replays five in backward: on a CPU a small model's step spends more on them than
// their arithmetic. Here each element takes the same float32 steps in the same order as the
// eager operations (two products, then their sum, no fused multiply-add), so the forward and the
// gradient are theirs bit for bit:
//   forward:  out = x * cos + swap(x) * sin
//   backward: dx = dout * cos + swap(dout * sin)        (the gradient of each term, summed)
// each rounded to the dtype once at the end, as the eager .float() and .type_as(x) do.
//
// Plain C++ over raw pointers behind a C ABI (kernels.h); rope_op.cpp makes the operator.
// x86-64 with AVX2 and FMA only; elsewhere the entry points are empty.

#include <cstdint>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

// Each adjacent pair's two values exchanged: (v0, v1, v2, v3, ...) -> (v1, v0, v3, v2, ...).
inline __m256 swap_pairs(__m256 v) { return _mm256_permute_ps(v, 0xB1); }

// rows of head_dim values, row r at position (r / heads) % positions of the tables (cos, sin:
// positions x head_dim float32); step(x, cos, sin) -> the eight outputs.
template <typename T, typename Step>
void over_rows(const T* in, T* out, const float* cos, const float* sin, int64_t rows, int64_t heads,
               int64_t positions, int64_t head_dim, int threads, const Step& step) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = (r / heads) % positions;
        for (int64_t j = 0; j < head_dim; j += 8)
            store8(out + r * head_dim + j, step(load8(in + r * head_dim + j), load8(cos + t * head_dim + j),
                                                load8(sin + t * head_dim + j)));
    }
}

template <typename T>
void rope_rows(const T* x, T* out, const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t positions,
               int64_t head_dim, bool backward, int threads) {
    if (backward)
        over_rows(x, out, cos, sin, rows, heads, positions, head_dim, threads, [](__m256 d, __m256 c, __m256 s) {
            return _mm256_add_ps(_mm256_mul_ps(d, c), swap_pairs(_mm256_mul_ps(d, s)));
        });
    else
        over_rows(x, out, cos, sin, rows, heads, positions, head_dim, threads, [](__m256 v, __m256 c, __m256 s) {
            return _mm256_add_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(swap_pairs(v), s));
        });
}

}  // namespace

extern "C" void rope(const void* x, void* out, const float* cos, const float* sin, int64_t rows, int64_t heads,
                     int64_t positions, int64_t head_dim, int backward, int type, int threads) {
    as_float_type(x, type, [&]<typename T>(const T* xt) {
        rope_rows(xt, static_cast<T*>(out), cos, sin, rows, heads, positions, head_dim, backward, threads);
    });
}

#else  // no AVX2: nothing here runs (vector_kernels_available() says so).

extern "C" void rope(const void*, void*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int, int, int) {}

#endif
