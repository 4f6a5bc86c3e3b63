// Matrix-vector products for decoding on a CPU, at the speed memory delivers the weights.
//
// A decoding step multiplies every weight matrix by one activation row (a few, for a short
// prompt), so its time is the time to stream the weights from memory. torch's CPU kernels are
// matrix-matrix kernels run at one row, and on two cores they read the weights well below the
// copy bandwidth (docs/generate_speed.md). Here each thread streams one contiguous band of
// weight rows, four rows at a time (four streams for the prefetchers, each activation load
// shared by four rows), into float32 vector accumulators.
//
// Integer weights are multiplied as integers, as llama.cpp does: the activations are rounded
// to int8 in blocks of 32 (Q8_0), so that one vpmaddubsw multiplies 32 weights by 32
// activations and adds them in pairs; the block's sum then gets its scale in float32.
// Converting each weight to float instead would need three times the instructions per weight,
// more than two cores issue at the bandwidth bound.
//
// Plain C++ over raw pointers behind a C ABI (matvec.h), without torch; matvec_op.cpp makes
// the torch operators. x86-64 with AVX2 and FMA only; elsewhere the entry points are empty,
// matvec_available() says 0, and the Python side runs torch's kernels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MATVEC_AVX2 1
#endif

#include "matvec.h"

#ifdef MATVEC_AVX2
namespace {

constexpr int64_t ROWS = 4;  // weight rows per pass
constexpr int64_t BLOCK = 32;  // activations per int8 block

float bf16_to_float(uint16_t bits) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Round to nearest even, NaN stays NaN: what torch's .to(torch.bfloat16) does.
uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return f != f ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float scalar_at(const void* p, int64_t i, bool bf16) {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

__m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__m256 load8(const uint16_t* p) {
    const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}
float load1(const float* p) { return *p; }
float load1(const uint16_t* p) { return bf16_to_float(*p); }
void store1(float* p, float v) { *p = v; }
void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }

float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// Sum of the products of 32 unsigned bytes u with 32 signed bytes s, as 8 int32 lanes.
__m256i dot_u8_s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Runs body(begin, end) on `threads` bands of [0, n), each a run of whole `unit`-row blocks.
template <typename Body> void for_row_bands(int64_t n, int threads, const Body& body, int64_t unit = ROWS) {
    const int64_t blocks = (n + unit - 1) / unit;
    const int bands = static_cast<int>(std::clamp<int64_t>(threads, 1, std::max<int64_t>(blocks, 1)));
#pragma omp parallel for num_threads(bands) schedule(static, 1)
    for (int t = 0; t < bands; t++)
        body(std::min(n, blocks * t / bands * unit), std::min(n, blocks * (t + 1) / bands * unit));
}

// Calls block<R>(i) for rows i of [begin, end): R = ROWS while a whole block fits, then R = 1.
template <typename Block> void by_blocks(int64_t begin, int64_t end, const Block& block) {
    int64_t i = begin;
    for (; i + ROWS <= end; i += ROWS) block.template operator()<ROWS>(i);
    for (; i < end; i++) block.template operator()<1>(i);
}

// Calls body<S>(sets) for the sets of rows [first, last): two at a time, one from each half of
// the range, then the one left over. Each thread then reads two streams of weights side by
// side, which keeps more reads in flight than one stream does (docs/generate_speed.md).
template <typename Body> void in_two_streams(int64_t first, int64_t last, const Body& body) {
    const int64_t half = (last - first) / 2;
    for (int64_t set = first; set < first + half; set++) {
        const int64_t pair[2] = {set, set + half};
        body.template operator()<2>(pair);
    }
    if ((last - first) % 2) {
        const int64_t one[1] = {last - 1};
        body.template operator()<1>(one);
    }
}

// The kernels prefetch the weights of the next pass while computing this one: the hardware
// prefetchers lose track of the short rows of a small model's matrices and stop at 4 KB pages,
// and without help two cores read them at two thirds of the bandwidth.
void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// --- Dense weights -----------------------------------------------------------------------------

template <int R, typename W>
void dense_rows(const float* x, const W* w, float* y, int64_t rows, int64_t n, int64_t k, int64_t i) {
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * k;
        const W* next = r == 0 && i + 2 * R <= n ? w + (i + R) * k : nullptr;  // the next pass's rows
        __m256 acc[R][2];
        for (int q = 0; q < R; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= k; j += 16) {
            const __m256 x0 = _mm256_loadu_ps(xr + j), x1 = _mm256_loadu_ps(xr + j + 8);
            for (int q = 0; q < R; q++) {
                if (next) prefetch(next + q * k + j);
                const W* wq = w + (i + q) * k + j;
                acc[q][0] = _mm256_fmadd_ps(load8(wq), x0, acc[q][0]);
                acc[q][1] = _mm256_fmadd_ps(load8(wq + 8), x1, acc[q][1]);
            }
        }
        for (int q = 0; q < R; q++) {
            float sum = hsum(_mm256_add_ps(acc[q][0], acc[q][1]));
            for (int64_t t = j; t < k; t++) sum += load1(w + (i + q) * k + t) * xr[t];
            y[r * n + i + q] = sum;
        }
    }
}

__m256 load8_scales(const void* p, int64_t i, bool bf16) {
    return bf16 ? load8(static_cast<const uint16_t*>(p) + i) : load8(static_cast<const float*>(p) + i);
}

// --- int8 weights, one scale per row ---------------------------------------------------------
//
// Rows come in sets of eight, interleaved (matvec.h), as int4's do: one 32-byte load holds four
// inputs of each of the eight rows, multiplied by the same four activations (broadcast), so the
// sums land one row per lane and each set is one stream from memory. vpmaddubsw multiplies
// unsigned by signed bytes, so each product is taken as |w| times x with w's sign. It streams the
// weights faster than four rows read side by side (docs/generate_speed.md).

constexpr int64_t INT8_PREFETCH = 1024;  // bytes ahead in each stream

// Rows 8 set[i] .. 8 set[i] + 7 of y, for the S sets read side by side.
template <int S>
void int8_sets(const int8_t* xq, const float* xd, const int8_t* codes, const void* scales, bool scales_bf16, float* y,
               int64_t rows, int64_t n, int64_t k, const int64_t* set) {
    const int64_t blocks = k / BLOCK;
    const int8_t* end = codes + n / 8 * blocks * 256;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* w[S];
    __m256 row_scales[S];
    for (int i = 0; i < S; i++) w[i] = codes + set[i] * blocks * 256, row_scales[i] = load8_scales(scales, set[i] * 8, scales_bf16);
    for (int64_t r = 0; r < rows; r++) {
        __m256 acc[S];
        for (int i = 0; i < S; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            for (int i = 0; i < S; i++)
                if (r == 0 && w[i] + b * 256 + INT8_PREFETCH + 256 <= end)
                    for (int line = 0; line < 256; line += 64) prefetch(w[i] + b * 256 + INT8_PREFETCH + line);
            const int8_t* x = xq + r * k + b * BLOCK;
            __m256i sum[S];
            for (int i = 0; i < S; i++) sum[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                int32_t x4;  // inputs 4c..4c+3 of the block
                std::memcpy(&x4, x + 4 * c, 4);
                const __m256i xb = _mm256_set1_epi32(x4);
                for (int i = 0; i < S; i++) {
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + b * 256 + 32 * c));
                    const __m256i products = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(xb, v));
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(products, ones));
                }
            }
            const __m256 d = _mm256_set1_ps(xd[r * blocks + b]);
            for (int i = 0; i < S; i++) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), d, acc[i]);
        }
        for (int i = 0; i < S; i++) _mm256_storeu_ps(y + r * n + set[i] * 8, _mm256_mul_ps(acc[i], row_scales[i]));
    }
}

// --- int4 weights, a scale and a zero per group ----------------------------------------------
//
// Rows come in sets of eight, interleaved (matvec.h), so one 32-byte load holds four inputs of
// each of the eight rows and one vpmaddubsw multiplies all eight by the same four activations
// (broadcast): the sums land one row per lane, with no horizontal sums, and each set is one
// stream from memory (two sets are read side by side). Codes are 0..15 and activations within +-127, so eight vpmaddubsw
// results (a block of 32 inputs) still fit int16 before one vpmaddwd widens them.
//
// Within a block, w = (q - 8) s + z, so with x ~ d xq over the same inputs:
//   sum x w = s d sum(xq q) + d sum(xq) (z - 8 s)
// The first term is the integer product; the second needs only the block's sum of activation
// codes. Both are computed for the eight rows at once.

constexpr int64_t INT4_PREFETCH = 1024;  // bytes ahead in each stream

// Rows 8 set[i] .. 8 set[i] + 7 of y, for the S sets read side by side.
template <int S>
void int4_sets(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* codes, const void* scales,
               const void* zeros, bool scales_bf16, float* y, int64_t rows, int64_t n, int64_t k, int64_t group,
               const int64_t* set) {
    const int64_t blocks = k / BLOCK, groups = k / group, per_group = group / BLOCK;
    const uint8_t* end = codes + n / 8 * blocks * 128;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t* w[S];
    for (int i = 0; i < S; i++) w[i] = codes + set[i] * blocks * 128;
    for (int64_t r = 0; r < rows; r++) {
        __m256 acc[S], offset[S];
        for (int i = 0; i < S; i++) acc[i] = offset[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            for (int i = 0; i < S; i++)
                if (r == 0 && w[i] + b * 128 + INT4_PREFETCH + 128 <= end)
                    prefetch(w[i] + b * 128 + INT4_PREFETCH), prefetch(w[i] + b * 128 + INT4_PREFETCH + 64);
            const int8_t* x = xq + r * k + b * BLOCK;
            __m256i sum16[S];
            for (int i = 0; i < S; i++) sum16[i] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                int32_t x_low, x_high;  // inputs 8c..8c+3 and 8c+4..8c+7 of the block
                std::memcpy(&x_low, x + 8 * c, 4), std::memcpy(&x_high, x + 8 * c + 4, 4);
                const __m256i low_x = _mm256_set1_epi32(x_low), high_x = _mm256_set1_epi32(x_high);
                for (int i = 0; i < S; i++) {
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + b * 128) + c);
                    const __m256i low = _mm256_and_si256(v, low_nibbles);
                    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
                    sum16[i] = _mm256_add_epi16(sum16[i], _mm256_maddubs_epi16(low, low_x));
                    sum16[i] = _mm256_add_epi16(sum16[i], _mm256_maddubs_epi16(high, high_x));
                }
            }
            const float d = xd[r * blocks + b];
            const __m256 block_sum = _mm256_set1_ps(d * static_cast<float>(xsum[r * blocks + b]));
            for (int i = 0; i < S; i++) {
                const int64_t g = (set[i] * groups + b / per_group) * 8;
                const __m256 s = load8_scales(scales, g, scales_bf16), z = load8_scales(zeros, g, scales_bf16);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[i], ones));
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(d)), acc[i]);
                offset[i] = _mm256_fmadd_ps(block_sum, _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z), offset[i]);
            }
        }
        for (int i = 0; i < S; i++) _mm256_storeu_ps(y + r * n + set[i] * 8, _mm256_add_ps(acc[i], offset[i]));
    }
}

// --- Attention of a decoding step -------------------------------------------------------------
//
// A decoding step's attention is RoPE on one position, a write into the cache, and two
// matrix-vector products per head (the scores K q, the output V^T p) with a softmax between
// them: a few microseconds of work, for which eager torch runs some thirty operations and
// SDPA's kernel alone spends a hundred or more on bf16 tensors of a CPU. Here it is one call.
// Rotation and rounding as model.py's; attention in float32, as SDPA computes it, the output
// rounded once to the input dtype.

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

// Per-call scratch: activations as float32, outputs before rounding to bfloat16.
thread_local std::vector<float> x_float, y_float;

const float* as_float(const void* x, int x_bf16, int64_t count) {
    if (!x_bf16) return static_cast<const float*>(x);
    x_float.resize(count);
    const uint16_t* bits = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < count; i++) x_float[i] = bf16_to_float(bits[i]);
    return x_float.data();
}

float* output_buffer(void* y, int y_bf16, int64_t count) {
    if (!y_bf16) return static_cast<float*>(y);
    y_float.resize(count);
    return y_float.data();
}

void finish_output(void* y, int y_bf16, int64_t count) {
    if (!y_bf16) return;
    uint16_t* bits = static_cast<uint16_t*>(y);
    for (int64_t i = 0; i < count; i++) bits[i] = float_to_bf16(y_float[i]);
}

}  // namespace

extern "C" int matvec_available() { return 1; }

extern "C" void matvec_dense(const void* x, const void* w, void* y, int64_t rows, int64_t n, int64_t k, int x_bf16,
                             int w_bf16, int y_bf16, int threads) {
    const float* xf = as_float(x, x_bf16, rows * k);
    float* yf = output_buffer(y, y_bf16, rows * n);
    for_row_bands(n, threads, [&](int64_t begin, int64_t end) {
        by_blocks(begin, end, [&]<int R>(int64_t i) {
            if (w_bf16)
                dense_rows<R>(xf, static_cast<const uint16_t*>(w), yf, rows, n, k, i);
            else
                dense_rows<R>(xf, static_cast<const float*>(w), yf, rows, n, k, i);
        });
    });
    finish_output(y, y_bf16, rows * n);
}

extern "C" void quantize_activations(const void* x, int x_bf16, int8_t* xq, float* xd, int32_t* xsum, int64_t rows,
                                     int64_t k) {
    const float* xf = as_float(x, x_bf16, rows * k);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    // vpackssdw/vpacksswb interleave the two 128-bit lanes; this puts the 32 bytes back in order.
    const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t block = 0; block < rows * k / BLOCK; block++) {
        const float* v = xf + block * BLOCK;
        __m256 part[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            part[j] = _mm256_loadu_ps(v + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, part[j]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float absmax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        const __m256 inverse = _mm256_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
        __m256i code[4];
        for (int j = 0; j < 4; j++) code[j] = _mm256_cvtps_epi32(_mm256_mul_ps(part[j], inverse));  // nearest, ties to even
        xd[block] = absmax / 127.0f;
        xsum[block] = hsum(_mm256_add_epi32(_mm256_add_epi32(code[0], code[1]), _mm256_add_epi32(code[2], code[3])));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(code[0], code[1]), _mm256_packs_epi32(code[2], code[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + block * BLOCK), _mm256_permutevar8x32_epi32(bytes, lane_order));
    }
}

extern "C" void matvec_int8(const int8_t* xq, const float* xd, const int8_t* w, const void* scales, void* y,
                            int64_t rows, int64_t n, int64_t k, int scales_bf16, int y_bf16, int threads) {
    float* yf = output_buffer(y, y_bf16, rows * n);
    for_row_bands(n, threads, [&](int64_t begin, int64_t end) {
        in_two_streams(begin / 8, end / 8, [&]<int S>(const int64_t* sets) {
            int8_sets<S>(xq, xd, w, scales, scales_bf16, yf, rows, n, k, sets);
        });
    }, 8);
    finish_output(y, y_bf16, rows * n);
}

extern "C" void matvec_int4(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* codes,
                            const void* scales, const void* zeros, void* y, int64_t rows, int64_t n, int64_t k,
                            int64_t group, int scales_bf16, int y_bf16, int threads) {
    float* yf = output_buffer(y, y_bf16, rows * n);
    for_row_bands(n, threads, [&](int64_t begin, int64_t end) {
        in_two_streams(begin / 8, end / 8, [&]<int S>(const int64_t* sets) {
            int4_sets<S>(xq, xd, xsum, codes, scales, zeros, scales_bf16, yf, rows, n, k, group, sets);
        });
    }, 8);
    finish_output(y, y_bf16, rows * n);
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
void decode_step(const T* q, const T* k, const T* v, T* k_cache, T* v_cache, T* out, const float* cos,
                 const float* sin, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t position,
                 int64_t cache_batch_stride, int64_t cache_head_stride, float scale, int threads) {
    // The new position's keys (rotated) and values into the cache, as KVCache.update stores them.
    for (int64_t bg = 0; bg < batch * kv_heads; bg++) {
        const int64_t at = bg / kv_heads * cache_batch_stride + bg % kv_heads * cache_head_stride + position * head_dim;
        rotate(k + bg * head_dim, k_cache + at, cos, sin, head_dim);
        std::memcpy(v_cache + at, v + bg * head_dim, head_dim * sizeof(T));
    }
    const int64_t group = heads / kv_heads;
    const int workers = static_cast<int>(std::clamp<int64_t>(threads, 1, batch * heads));
#pragma omp parallel num_threads(workers)
    {
        std::vector<float> scores, q_float;
        std::vector<T> q_rotated(head_dim);
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            const int64_t at = bh / heads * cache_batch_stride + bh % heads / group * cache_head_stride;
            rotate(q + bh * head_dim, q_rotated.data(), cos, sin, head_dim);
            const T* kc = k_cache + at;
            const T* vc = v_cache + at;
            T* o = out + bh * head_dim;
            switch (head_dim) {  // the head sizes of Llama models; the op checks for one of these
                case 64: attend_head<64>(q_rotated.data(), kc, vc, o, position + 1, scale, scores, q_float); break;
                case 128: attend_head<128>(q_rotated.data(), kc, vc, o, position + 1, scale, scores, q_float); break;
                case 32: attend_head<32>(q_rotated.data(), kc, vc, o, position + 1, scale, scores, q_float); break;
                case 16: attend_head<16>(q_rotated.data(), kc, vc, o, position + 1, scale, scores, q_float); break;
                default: attend_head<8>(q_rotated.data(), kc, vc, o, position + 1, scale, scores, q_float);
            }
        }
    }
}

extern "C" void decode_attention(const void* q, const void* k, const void* v, void* k_cache, void* v_cache, void* out,
                                 const float* cos, const float* sin, int64_t batch, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t position, int64_t cache_batch_stride,
                                 int64_t cache_head_stride, int bf16, int threads) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    if (bf16)
        decode_step(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
                    static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), static_cast<uint16_t*>(out), cos,
                    sin, batch, heads, kv_heads, head_dim, position, cache_batch_stride, cache_head_stride, scale,
                    threads);
    else
        decode_step(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
                    static_cast<float*>(k_cache), static_cast<float*>(v_cache), static_cast<float*>(out), cos, sin,
                    batch, heads, kv_heads, head_dim, position, cache_batch_stride, cache_head_stride, scale, threads);
}

#else  // no AVX2: nothing here runs; the Python side keeps torch's kernels.

extern "C" int matvec_available() { return 0; }
extern "C" void matvec_dense(const void*, const void*, void*, int64_t, int64_t, int64_t, int, int, int, int) {}
extern "C" void quantize_activations(const void*, int, int8_t*, float*, int32_t*, int64_t, int64_t) {}
extern "C" void matvec_int8(const int8_t*, const float*, const int8_t*, const void*, void*, int64_t, int64_t, int64_t,
                            int, int, int) {}
extern "C" void matvec_int4(const int8_t*, const float*, const int32_t*, const uint8_t*, const void*, const void*,
                            void*, int64_t, int64_t, int64_t, int64_t, int, int, int) {}
extern "C" void decode_attention(const void*, const void*, const void*, void*, void*, void*, const float*,
                                 const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int) {}

#endif
