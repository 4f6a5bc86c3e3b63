// Causal attention over a KV cache on the CPU, in one call: RoPE on the new positions, their
// keys and values written into the cache, and each query attending to every position up to its
// own.
//
// A decoding step's attention is a few microseconds of work, for which eager torch runs some
// thirty operations and SDPA's kernel alone spends a hundred or more on bf16 tensors of a CPU.
// A prompt's is a small share of its time beside the linear layers. Each query is computed
// alone, in one order that depends only on its position (attend_head): a prompt read in one
// call or in pieces, or decoded token by token, gets the same numbers, bit for bit.
// Rotation and rounding as model.py's; attention in float32, as SDPA computes it, the output
// rounded once to the input dtype.
//
// Plain C++ over raw pointers behind a C ABI (matvec.h), without torch; matvec_op.cpp makes
// the torch operator. x86-64 with AVX2 and FMA only; elsewhere the entry point is empty.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "matvec.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

// exp of eight floats <= 0 (softmax's scores less their maximum): 2^n exp(r) with |r| <= ln2 / 2,
// exp(r) by Cephes' degree-6 polynomial, within 2 ulp of expf. Below -88 the result is 0.
__m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts, exact first
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// The sums of eight vectors, as the eight lanes of one.
__m256 hsum8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// One query head; D = head_dim (a compile-time constant, so that the accumulators stay in registers).
template <int D, typename T>
void attend_head(const T* q, const T* k, const T* v, T* out, int64_t positions, float scale,
                 std::vector<float>& scores, std::vector<float>& q_float) {
    constexpr int64_t head_dim = D;
    q_float.resize(head_dim), scores.resize((positions + 7) / 8 * 8);
    for (int64_t d = 0; d < head_dim; d++) q_float[d] = load1(q + d) * scale;
    for (int64_t s0 = 0; s0 < positions; s0 += 8) {  // eight positions at a time, the last run padded
        __m256 acc[8];
        for (int t = 0; t < 8; t++) {
            acc[t] = _mm256_setzero_ps();
            if (s0 + t < positions)
                for (int64_t d = 0; d < head_dim; d += 8)
                    acc[t] = _mm256_fmadd_ps(load8(k + (s0 + t) * head_dim + d), _mm256_loadu_ps(q_float.data() + d), acc[t]);
        }
        _mm256_storeu_ps(scores.data() + s0, hsum8(acc));
    }
    for (int64_t s = positions; s < static_cast<int64_t>(scores.size()); s++) scores[s] = -INFINITY;
    float highest = -INFINITY;
    for (int64_t s = 0; s < positions; s++) highest = std::max(highest, scores[s]);
    __m256 total = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < static_cast<int64_t>(scores.size()); s0 += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + s0), _mm256_set1_ps(highest)));
        _mm256_storeu_ps(scores.data() + s0, e);
        total = _mm256_add_ps(total, e);
    }
    __m256 acc[D / 8];
    for (int64_t d = 0; d < head_dim; d += 8) acc[d / 8] = _mm256_setzero_ps();
    for (int64_t s = 0; s < positions; s++) {
        const __m256 p = _mm256_set1_ps(scores[s]);
        for (int64_t d = 0; d < head_dim; d += 8) acc[d / 8] = _mm256_fmadd_ps(load8(v + s * head_dim + d), p, acc[d / 8]);
    }
    const __m256 inverse = _mm256_set1_ps(1.0f / hsum(total));
    alignas(32) float result[8];
    for (int64_t d = 0; d < head_dim; d += 8) {
        _mm256_store_ps(result, _mm256_mul_ps(acc[d / 8], inverse));
        for (int t = 0; t < 8; t++) store1(out + d + t, result[t]);
    }
}


// x rotated as apply_rotary_emb does: y[j] = x[j] cos[j] + x[j ^ 1] sin[j], each product and
// the sum rounded to float32 (this file is built without FMA contraction), then to T.
template <typename T> void rotate(const T* x, T* y, const float* cos, const float* sin, int64_t head_dim) {
    for (int64_t j = 0; j < head_dim; j++) {
        const float a = load1(x + j) * cos[j], b = load1(x + (j ^ 1)) * sin[j];
        store1(y + j, a + b);
    }
}

template <typename T>
void attend(const T* q, const T* k, const T* v, T* k_cache, T* v_cache, T* out, const float* cos, const float* sin,
            int64_t batch, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t start,
            int64_t cache_batch_stride, int64_t cache_head_stride, float scale, int threads) {
    // The new positions' keys (rotated) and values into the cache, as KVCache.update stores them.
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t from = ((b * rows + i) * kv_heads + g) * head_dim;
                const int64_t at = b * cache_batch_stride + g * cache_head_stride + (start + i) * head_dim;
                rotate(k + from, k_cache + at, cos + i * head_dim, sin + i * head_dim, head_dim);
                std::memcpy(v_cache + at, v + from, head_dim * sizeof(T));
            }
    const int64_t group = heads / kv_heads, queries = batch * heads * rows;
    const int workers = static_cast<int>(std::clamp<int64_t>(threads, 1, queries));
#pragma omp parallel num_threads(workers)
    {
        std::vector<float> scores, q_float;
        std::vector<T> q_rotated(head_dim);
#pragma omp for schedule(static)
        for (int64_t query = 0; query < queries; query++) {  // a head's rows one after another: they read one cache
            const int64_t i = query % rows, h = query / rows % heads, b = query / rows / heads;
            const int64_t at = b * cache_batch_stride + h / group * cache_head_stride, positions = start + i + 1;
            const int64_t row = (b * rows + i) * heads + h;
            rotate(q + row * head_dim, q_rotated.data(), cos + i * head_dim, sin + i * head_dim, head_dim);
            const T* kc = k_cache + at;
            const T* vc = v_cache + at;
            T* o = out + row * head_dim;
            switch (head_dim) {  // the head sizes of Llama models; the op checks for one of these
                case 64: attend_head<64>(q_rotated.data(), kc, vc, o, positions, scale, scores, q_float); break;
                case 128: attend_head<128>(q_rotated.data(), kc, vc, o, positions, scale, scores, q_float); break;
                case 32: attend_head<32>(q_rotated.data(), kc, vc, o, positions, scale, scores, q_float); break;
                case 16: attend_head<16>(q_rotated.data(), kc, vc, o, positions, scale, scores, q_float); break;
                default: attend_head<8>(q_rotated.data(), kc, vc, o, positions, scale, scores, q_float);
            }
        }
    }
}

}  // namespace

extern "C" void attention(const void* q, const void* k, const void* v, void* k_cache, void* v_cache, void* out,
                          const float* cos, const float* sin, int64_t batch, int64_t rows, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, int64_t start, int64_t cache_batch_stride,
                          int64_t cache_head_stride, int bf16, int threads) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const auto run = [&]<typename T>(const T*) {
        attend(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(k_cache),
               static_cast<T*>(v_cache), static_cast<T*>(out), cos, sin, batch, rows, heads, kv_heads, head_dim, start,
               cache_batch_stride, cache_head_stride, scale, threads);
    };
    if (bf16) run(static_cast<const uint16_t*>(nullptr));
    else run(static_cast<const float*>(nullptr));
}

#else  // no AVX2: nothing here runs (matvec_available() says so).

extern "C" void attention(const void*, const void*, const void*, void*, void*, void*, const float*, const float*,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int) {}

#endif
