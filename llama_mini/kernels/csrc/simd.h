// Vector helpers shared by the linear layers (linear.cpp) and attention (attention.cpp): sums
// across lanes, sixteen-lane float and integer vectors, and the split of a matrix's rows among
// threads.
//
// A tile of any size, a prompt's chunk and a decoding step sum each output through these
// helpers in the same order, so a prompt's logits do not depend on how it was cut into forward
// calls or on the other rows of its batch.
//
// Floats16 and Ints16 are sixteen lanes: one 512-bit register on CPUs with AVX-512 (VNNI and
// the BW/DQ/VL subsets: WIDE), two 256-bit ones with AVX2. The lanes' sums are the same either
// way; only the instruction count differs.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SIMD_WIDE 1
#endif

namespace simd {

constexpr int64_t BLOCK = 32;  // activations per int8 block (quant/layers.py's quantized_activations)

// The three float types (kernels.h numbers them): float32 as float, bfloat16 as its bits
// (uint16_t), float16 as Half (F16C converts it: part of x86-64-v3 with AVX2).
enum FloatType : int { F32 = 0, BF16 = 1, F16 = 2 };
struct Half {
    uint16_t bits;
};

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }
inline float load1(const Half* p) { return _cvtsh_ss(p->bits); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }
inline void store1(Half* p, float v) { p->bits = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }  // as torch rounds

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}
inline __m256 load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Eight values of float type `type` from p + i, as float32.
inline __m256 load8(const void* p, int64_t i, int type) {
    if (type == F16) return load8(static_cast<const Half*>(p) + i);
    return type == BF16 ? load8(static_cast<const uint16_t*>(p) + i) : load8(static_cast<const float*>(p) + i);
}

// Calls body(pointer) with p as a pointer to the float type `type` names.
template <typename Body> void as_float_type(const void* p, int type, const Body& body) {
    if (type == F16) body(static_cast<const Half*>(p));
    else if (type == BF16) body(static_cast<const uint16_t*>(p));
    else body(static_cast<const float*>(p));
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The sum of v's lanes, exact in int32, in every lane of the result (kept in a vector register for
// whoever converts it there: k_quants.cpp's float_sum).
inline __m128i lanes_total(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
}

inline int32_t hsum(__m256i v) { return _mm_cvtsi128_si32(lanes_total(v)); }

// Eight floats stored as float32, or rounded to bfloat16 as float_to_bf16 does, or to float16.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i bits = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(Half* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T as store8 rounds it, as float32.
template <typename T> __m256 rounded(__m256 v) {
    if constexpr (std::is_same_v<T, float>) {
        return v;
    } else {
        alignas(16) T bits[8];
        store8(bits, v);
        return load8(bits);
    }
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// exp of eight floats: 2^n exp(r) with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial,
// within 2 ulp of expf on [-88, 88]; below, 0, above, exp(88); NaN stays NaN (maxps and minps
// return their second operand where either is NaN). Every lane is computed alike, wherever it
// sits: an element's result does not depend on its neighbours.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-88.0f), x));
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

// --- Sixteen float lanes ----------------------------------------------------------------------

#ifdef SIMD_WIDE
struct Floats16 {
    __m512 v;
    static Floats16 zero() { return {_mm512_setzero_ps()}; }
    static Floats16 all(float f) { return {_mm512_set1_ps(f)}; }
    static Floats16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static Floats16 load(const uint16_t* p) {
        const __m512i widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return {_mm512_castsi512_ps(_mm512_slli_epi32(widened, 16))};
    }
    static Floats16 load(const Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
    static Floats16 join(__m256 low, __m256 high) { return {_mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1)}; }
    __m256 low() const { return _mm512_castps512_ps256(v); }
    __m256 high() const { return _mm512_extractf32x8_ps(v, 1); }
};
inline Floats16 fma(Floats16 a, Floats16 b, Floats16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Floats16 mul(Floats16 a, Floats16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
// Keeps v in a register: a value used by several multiply-adds is otherwise read from memory
// by each of them, and loads, not arithmetic, then bound the loop.
inline void in_register(Floats16& v) { asm volatile("" : "+v"(v.v)); }
inline Floats16 add(Floats16 a, Floats16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Floats16 fnma(Floats16 a, Floats16 b, Floats16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
#else
struct Floats16 {
    __m256 lo, hi;
    static Floats16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Floats16 all(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
    template <typename T> static Floats16 load(const T* p) { return {load8(p), load8(p + 8)}; }
    static Floats16 join(__m256 low, __m256 high) { return {low, high}; }
    __m256 low() const { return lo; }
    __m256 high() const { return hi; }
};
inline Floats16 fma(Floats16 a, Floats16 b, Floats16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline void in_register(Floats16& v) { asm volatile("" : "+x"(v.lo), "+x"(v.hi)); }
inline Floats16 mul(Floats16 a, Floats16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats16 add(Floats16 a, Floats16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Floats16 fnma(Floats16 a, Floats16 b, Floats16 c) {
    return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
#endif

// --- A dense layer's output ---------------------------------------------------------------------
//
// Each output of x W^T is summed in one order, whatever the tile, chunk or thread (linear.cpp):
// the inputs in blocks of DENSE_KC, each block in float32 lanes (DenseLanes) that add the
// products of their inputs in order, folded and summed pairwise (hsum) and added to the output's
// sum; then the last inputs (k mod the lanes) one by one. With AVX-512, sixteen lanes, inputs
// j = i (mod 16) in lane i, by fused multiply-adds; or, where both are bfloat16 and the CPU has
// AVX-512 BF16, the pairs j = 2i, 2i + 1 (mod 32), by vdpbf16ps (exact products, two float32
// roundings per pair, subnormals flushed), which does twice the work per instruction. With
// AVX2, eight lanes, j = i (mod 8): an accumulator is one register, so a tile holds twelve of
// them, where sixteen lanes would leave room for six. Blocks keep a tile's weights in the
// first-level cache while every row of a prompt's chunk meets them.

struct Floats8 {
    __m256 v;
    static Floats8 zero() { return {_mm256_setzero_ps()}; }
    template <typename T> static Floats8 load(const T* p) { return {load8(p)}; }
};
inline Floats8 fma(Floats8 a, Floats8 b, Floats8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline void in_register(Floats8&) {}  // sixteen registers: the compiler places the operands best
inline float lanes_sum(Floats8 v) { return hsum(v.v); }
inline float lanes_sum(Floats16 v) { return hsum(_mm256_add_ps(v.low(), v.high())); }

#ifdef SIMD_WIDE
using DenseLanes = Floats16;
constexpr int64_t DENSE_KC = 1024;
#else
using DenseLanes = Floats8;
constexpr int64_t DENSE_KC = 1024;
#endif

template <typename X, typename W> struct DenseStep {
    static constexpr int64_t inputs = sizeof(DenseLanes) / sizeof(float);
    using Vector = DenseLanes;
    static DenseLanes load(const X* p) { return DenseLanes::load(p); }
    static DenseLanes load_w(const W* p) { return DenseLanes::load(p); }
    static DenseLanes madd(DenseLanes acc, DenseLanes w, DenseLanes x) { return fma(w, x, acc); }
};

#if defined(SIMD_WIDE) && defined(__AVX512BF16__)
template <> struct DenseStep<uint16_t, uint16_t> {
    static constexpr int64_t inputs = 32;
    using Vector = __m512bh;
    static __m512bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static __m512bh load_w(const uint16_t* p) { return load(p); }
    static Floats16 madd(Floats16 acc, __m512bh w, __m512bh x) { return {_mm512_dpbf16_ps(acc.v, x, w)}; }
};
inline void in_register(__m512bh& v) { asm volatile("" : "+v"(v)); }
#endif

// An output's sum after its blocks, plus its last inputs [from, k).
template <typename X, typename W> float dense_tail(float sum, const X* x, const W* w, int64_t from, int64_t k) {
    for (int64_t t = from; t < k; t++) sum += load1(w + t) * load1(x + t);
    return sum;
}

// --- Sixteen integer lanes: the rows of two sets of eight -----------------------------------------
//
// int8 and int4 weights are held in sets of eight rows, interleaved (quant/layout.py): one
// 32-byte run holds four inputs of each of the set's eight rows. Two sets side by side fill
// sixteen int32 lanes, one per row; four activations, broadcast to every lane, multiply them.

#ifdef SIMD_WIDE
struct Ints16 {
    __m512i v;
    static Ints16 all(int32_t i) { return {_mm512_set1_epi32(i)}; }
    static Ints16 load(const void* first, const void* second) {
        const __m256i a = _mm256_loadu_si256(static_cast<const __m256i*>(first));
        const __m256i b = _mm256_loadu_si256(static_cast<const __m256i*>(second));
        return {_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)};
    }
};
inline Floats16 to_float(Ints16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
#else
struct Ints16 {
    __m256i lo, hi;
    static Ints16 all(int32_t i) { return {_mm256_set1_epi32(i), _mm256_set1_epi32(i)}; }
    static Ints16 load(const void* first, const void* second) {
        return {_mm256_loadu_si256(static_cast<const __m256i*>(first)), _mm256_loadu_si256(static_cast<const __m256i*>(second))};
    }
};
inline Floats16 to_float(Ints16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
#endif

// Integer products of weights (one run of two sets) with four activations x4 (broadcast).
//
// int8: each lane gains the sum of its row's four signed weights times the four activations.
// With VNNI (vpdpbusd multiplies unsigned by signed bytes) the weights are read as unsigned
// w + 128, which adds 128 times the activations' sum: a block's sums start from -128 times
// its activations' sum (int8_block_start) to cancel it. Without, |w| times x with w's sign.
// Exact either way: a block's sum stays far within int32.
#ifdef SIMD_WIDE
inline Ints16 int8_block_start(int32_t activation_sum) { return Ints16::all(-128 * activation_sum); }
struct Int8Run {  // a run of int8 weights, as int8_dot reads it
    __m512i unsigned_w;
};
inline Int8Run int8_run(Ints16 w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8(static_cast<char>(0x80)))}; }
inline Ints16 int8_dot(Ints16 acc, const Int8Run& w, int32_t x4) {
    return {_mm512_dpbusd_epi32(acc.v, w.unsigned_w, _mm512_set1_epi32(x4))};
}
// int4: codes 0..15 (unsigned). vpdpbusd sums them in int32 at once, so the int16 sums of
// U4Sums (below, without VNNI) are int32 sums here.
using Codes16 = __m512i;
using U4Sums = Ints16;
inline U4Sums u4_sums_zero() { return Ints16::all(0); }
inline U4Sums u4_add(U4Sums acc, Codes16 codes, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, codes, _mm512_set1_epi32(x4))}; }
inline Ints16 u4_total(U4Sums sums) { return sums; }
// The low and the high nibbles of a run of int4 codes.
inline void nibbles(Ints16 w, Codes16& low, Codes16& high) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    low = _mm512_and_si512(w.v, mask);
    high = _mm512_and_si512(_mm512_srli_epi16(w.v, 4), mask);
}
#else
inline Ints16 int8_block_start(int32_t) { return Ints16::all(0); }
struct Int8Run {  // a run of int8 weights, as int8_dot reads it: |w| and w (for its sign)
    __m256i abs_lo, abs_hi, lo, hi;
};
inline Int8Run int8_run(Ints16 w) { return {_mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(w.hi, w.hi), w.lo, w.hi}; }
inline __m256i int8_dot8(__m256i acc, __m256i abs_w, __m256i w, __m256i x) {
    const __m256i products = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
inline Ints16 int8_dot(Ints16 acc, const Int8Run& w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    return {int8_dot8(acc.lo, w.abs_lo, w.lo, x), int8_dot8(acc.hi, w.abs_hi, w.hi, x)};
}
struct Codes16 {
    __m256i lo, hi;
};
// int4's sums over a whole block, in the int16 pairs: its four runs of codes <= 15, low nibbles and
// high, make sixteen products a lane, 16 15 127 = 30480, within an int16. One widening a block
// (u4_total) instead of two a run: a prompt's int4 tiles are bound by these instructions.
struct U4Sums {
    __m256i lo, hi;  // int16
};
inline U4Sums u4_sums_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline U4Sums u4_add(U4Sums acc, Codes16 codes, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(codes.lo, x)), _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(codes.hi, x))};
}
inline Ints16 u4_total(U4Sums sums) {
    const __m256i ones = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(sums.lo, ones), _mm256_madd_epi16(sums.hi, ones)};
}
inline void nibbles(Ints16 w, Codes16& low, Codes16& high) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    low = {_mm256_and_si256(w.lo, mask), _mm256_and_si256(w.hi, mask)};
    high = {_mm256_and_si256(_mm256_srli_epi16(w.lo, 4), mask), _mm256_and_si256(_mm256_srli_epi16(w.hi, 4), mask)};
}
#endif

inline int32_t four_bytes(const int8_t* p) {
    int32_t x4;
    std::memcpy(&x4, p, 4);
    return x4;
}

// --- An integer layer's output -------------------------------------------------------------------
//
// Per block b of 32 inputs, with d the activations' scale and isum the exact integer sum:
//   int8:  acc += isum * (s_b * d)                           s_b the weight's scale for the block
//   int4:  acc += isum * (s_g * d);  acc += (d * xsum) * o_g            group g's scale and offset
// in this order, blocks in order, each step one rounding of float32 (fused multiply-adds).

inline Floats16 int8_block(Floats16 acc, Ints16 isum, Floats16 scales, float d) {
    return fma(to_float(isum), mul(scales, Floats16::all(d)), acc);
}

inline Floats16 int4_block(Floats16 acc, Ints16 isum, Floats16 scales, Floats16 offsets, float d, int32_t xsum) {
    acc = fma(to_float(isum), mul(scales, Floats16::all(d)), acc);
    return fma(Floats16::all(d * static_cast<float>(xsum)), offsets, acc);
}

// The scales (or offsets) of sets `first` and `second` for group g: (sets, groups, 8) interleaved.
inline Floats16 set_pair_scales(const void* scales, int type, int64_t first, int64_t second, int64_t groups, int64_t g) {
    return Floats16::join(load8(scales, (first * groups + g) * 8, type), load8(scales, (second * groups + g) * 8, type));
}

// The uint8 factors of sets `first` and `second` for group g, as floats: (sets, groups, 8).
inline Floats16 set_pair_factors(const void* factors, int64_t first, int64_t second, int64_t groups, int64_t g) {
    const auto eight = [&](int64_t set) {
        return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(factors) + (set * groups + g) * 8));
    };
#ifdef SIMD_WIDE
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(eight(first), eight(second))))};  // both sets at once
#else
    return Floats16::join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight(first))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight(second))));
#endif
}

// --- Threads ------------------------------------------------------------------------

// Runs body(begin, end) over [0, n) in runs of whole `unit`-row blocks, on `threads` threads.
// Each thread has a band of its own: it reads the first three quarters in one run (one stream
// through memory, as the prefetchers like) and the rest a sixteenth of the band at a time, and
// once done takes the pieces still left of the others' bands. The cores of a machine shared
// with other work do not run at one speed (on a 2-core cloud machine one thread took 18% longer
// than the other over a decoding run), and an equal split would wait for the slower. Every
// kernel computes each output the same whatever rows it is given beside it, so who takes which
// piece changes no number.
template <typename Body> void for_row_bands(int64_t n, int threads, const Body& body, int64_t unit) {
    const int64_t blocks = (n + unit - 1) / unit;
    const int bands = static_cast<int>(std::clamp<int64_t>(threads, 1, std::max<int64_t>(blocks, 1)));
    if (bands == 1) return body(0, n);
    struct alignas(64) Front { std::atomic<int64_t> block; };  // a band's first block not yet taken
    std::vector<Front> fronts(bands);
    for (int t = 0; t < bands; t++) fronts[t].block.store(blocks * t / bands, std::memory_order_relaxed);
#pragma omp parallel num_threads(bands)
    {
        const int own = omp_get_thread_num();
        for (int i = 0; i < bands; i++) {  // its own band, then the others'
            const int t = (own + i) % bands;
            const int64_t end = blocks * (t + 1) / bands, band = end - blocks * t / bands;
            const int64_t piece = std::max<int64_t>(1, band / 16);
            int64_t take = t == own ? std::max<int64_t>(1, band - band / 4) : piece;
            for (int64_t b; (b = fronts[t].block.fetch_add(take, std::memory_order_relaxed)) < end; take = piece)
                body(b * unit, std::min(n, std::min(b + take, end) * unit));
        }
    }
}

}  // namespace simd

#endif  // AVX2 and FMA
