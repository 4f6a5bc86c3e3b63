// llama.cpp's K-quants Q5_K and Q6_K where a GGUF file maps them: y = x W^T, read in place.
//
// Why in place: converting a file's matrices into another layout writes them once more into
// memory the process has never touched, and that first write of each page takes several times
// llama.cpp's whole load. Row i is the file's: k / 256 blocks (kernels.h has each type's bytes).
//
// Why activations in blocks of 256 (llama.cpp's Q8_K): a block of weights then meets one scale
// of x, so its sub-blocks' integer sums add up exactly in int32 before its float steps, one or two
// per block: Q6_K's y += float(sum s (q - 32) x) (d xd), Q5_K's y += float(sum sc q x) (d xd), then
// y += float(sum m sum x) (-dmin xd), fmas in block order. So every way of computing them gives the
// same bits: a decoding step reads each row in place (Format::row_tile), a prompt widens each set
// of eight rows once into bytes and multiplies them as the int8 kernel does (Format::set_tile), and
// a row's result does not depend on the rows beside it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

constexpr int64_t SUPER = 256;  // inputs of a block
constexpr int MR = 4;  // rows of x per tile read in place

// A prompt's tiles hold one lane per widened row of weights: with AVX-512, a pair of sets of eight
// rows in one 512-bit register (each broadcast of x feeds 64 products, not 32); else one set in a
// 256-bit one. SET_MR: rows of x per tile. Measured at 256 rows, 2048 x 2048, two cores: with
// AVX-512, pairs and eight rows 293-318 GMAC/s for Q5_K and 238-269 for Q6_K, where one set took
// 232 and 202 (four or six rows: slower); AVX2's one set and four rows 150-190 (three rows and two
// sets spill: 115-125).
#ifdef SIMD_WIDE
struct Lanes {
    static constexpr int N = 16;
    using I = __m512i;
    using F = __m512;
    static I load(const void* p) { return _mm512_loadu_si512(p); }
    static I all32(int32_t v) { return _mm512_set1_epi32(v); }
    static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
    static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
    static I dot(I acc, I u8, I s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
    static F zero() { return _mm512_setzero_ps(); }
    static F loadf(const void* p) { return _mm512_loadu_ps(p); }
    // acc + float(total) (scale xd), each lane rounded as a scalar fma would round it
    static F step(F acc, I total, F scale, float xd) {
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(scale, _mm512_set1_ps(xd)), acc);
    }
    template <typename Y> static void store(Y* y, F v, bool both) {
        store8(y, _mm512_castps512_ps256(v));
        if (both) store8(y + 8, _mm512_extractf32x8_ps(v, 1));
    }
};
constexpr int SET_MR = 8;
// Eight sub-blocks unrolled (Q5_K's all, Q6_K's half): 1.1-1.7x with AVX-512's 32 registers; all sixteen of
// Q6_K's spill its sums to the stack (1.13-1.24x slower at 1B's shapes); it spills AVX2's 16.
#define UNROLL_SUB_BLOCKS _Pragma("GCC unroll 8")
#else
struct Lanes {
    static constexpr int N = 8;
    using I = __m256i;
    using F = __m256;
    static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
    static I all32(int32_t v) { return _mm256_set1_epi32(v); }
    static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
    static F zero() { return _mm256_setzero_ps(); }
    static F loadf(const void* p) { return _mm256_loadu_ps(static_cast<const float*>(p)); }
    static F step(F acc, I total, F scale, float xd) {
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(scale, _mm256_set1_ps(xd)), acc);
    }
    template <typename Y> static void store(Y* y, F v, bool) { store8(y, v); }
};
constexpr int SET_MR = 4;
#define UNROLL_SUB_BLOCKS
#endif
constexpr int64_t LANE_BYTES = 4 * Lanes::N;  // a widened field: four bytes a lane
constexpr int SETS_PER_TILE = Lanes::N / 8;
constexpr int64_t CHUNK = 128;  // rows of x per pass over the weights (they stay in cache)
constexpr int64_t WIDENED_ROWS = 16;  // from this many rows of x on, sets of eight rows are widened (a prompt)
constexpr int64_t WIDE_TILES = 32 / SETS_PER_TILE;  // tiles widened at a time: 32 sets, under 1 MB at k = 2048, in the second-level cache

// The activations as the tiles read them: int8 codes in blocks of 256 with a float32 scale each,
// the sums of each Format::SUM_SPAN codes, and the codes + 128 (Q6_K's widened sets).
struct Rows {
    const int8_t* codes;  // (rows, k)
    const float* scales;  // (rows, k / 256)
    const int16_t* sums;  // (rows, k / SUM_SPAN)
    const uint8_t* unsigned_codes;  // (rows, k)
};

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// The sum of v's lanes, exact in int32, as a float: converted where it is summed (through a general
// register, a decoding step's matrices read 1.01-1.06x slower).
inline float float_sum(__m256i v) { return _mm_cvtss_f32(_mm_cvtepi32_ps(lanes_total(v))); }

inline float half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// Four bytes of x, as a vector's every four bytes.
inline Lanes::I four_of(const void* x) {
    int32_t four;
    std::memcpy(&four, x, 4);
    return Lanes::all32(four);
}

// Lane `lane`'s four bytes of a widened field.
template <typename T> inline T* lane_slot(uint8_t* field, int lane) { return reinterpret_cast<T*>(field + 4 * lane); }

// Eight rows' codes of a block, one byte each (codes[j]: row j's 256), into int8's run layout at
// `to`: 64 runs, run c at to + c LANE_BYTES holding inputs 4c .. 4c + 3 of row j at bytes 4j ..;
// an 8 x 8 transpose of four-byte words.
void store_runs(const int8_t (*codes)[SUPER], uint8_t* to) {
    for (int c = 0; c < 64; c += 8) {  // runs c .. c + 7
        __m256i v[8], u[8];
        for (int j = 0; j < 8; j++) v[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j] + 4 * c));
        for (int j = 0; j < 8; j += 2) u[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]), u[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
        for (int j = 0; j < 8; j += 4)
            for (int h = 0; h < 2; h++)
                v[j + h] = _mm256_unpacklo_epi64(u[j + h], u[j + 2 + h]), v[j + 2 + h] = _mm256_unpackhi_epi64(u[j + h], u[j + 2 + h]);
        // v[0]: runs c, c + 4 of rows 0-3; v[1]: c + 2, c + 6; v[2]: c + 1, c + 5; v[3]: c + 3, c + 7; v[4..7]: rows 4-7
        static constexpr int order[4] = {0, 2, 1, 3};
        for (int q = 0; q < 4; q++) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + LANE_BYTES * (c + order[q])), _mm256_permute2x128_si256(v[q], v[q + 4], 0x20));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + LANE_BYTES * (c + order[q] + 4)), _mm256_permute2x128_si256(v[q], v[q + 4], 0x31));
        }
    }
}

// Calls each<V>() for V = 0 .. N - 1.
template <int N, typename Each> inline void unrolled(const Each& each) {
    [&]<int... V>(std::integer_sequence<int, V...>) { (each.template operator()<V>(), ...); }(std::make_integer_sequence<int, N>{});
}

// --- Q6_K: w = d s (q - 32), 6-bit codes q, an int8 s per sub-block of 16 -------------------------
//
// A block: 128 bytes of low four bits, 64 of high two bits, 16 scales s and a float16 d.
struct Q6_K {
    static constexpr int64_t BYTES = 210, SUM_SPAN = 16;
    static constexpr bool WIDE_SUMS = false, UNSIGNED_X = true;  // what a prompt's widened sets read

    // Sub-block scales of the 32 inputs of run V (0..3) of half a block, from its eight scales s, as
    // int16: s[2V] eight times, then s[2V + 1] (vpmaddwd's pairs after vpmaddubsw: the first eight
    // are the run's first sixteen inputs).
    template <int V> static __m256i run_scales(__m128i s) {
        const __m128i pick = _mm_setr_epi8(2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V + 1, 2 * V + 1, 2 * V + 1,
                                           2 * V + 1, 2 * V + 1, 2 * V + 1, 2 * V + 1, 2 * V + 1);
        return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s, pick));
    }

    // Codes 0..63 of inputs 128h + 32V .. 128h + 32V + 31 of a block, from its low nibbles (ql0, ql1:
    // its bytes 64h .., 64h + 32 ..) and high bits (qh: bytes 128 + 32h ..), as the file packs them.
    template <int V> static __m256i run_codes(__m256i ql0, __m256i ql1, __m256i qh) {
        const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
        const __m256i ql = V % 2 == 0 ? ql0 : ql1;
        const __m256i nibbles = _mm256_and_si256(V < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        return _mm256_or_si256(nibbles, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * V), low2), 4));
    }

    // Calls run(c, q, scales) for each of a block's eight runs of 32 inputs (run c: inputs 32c ..
    // 32c + 31), with its codes 0..63 (q) and their sub-block scales as run_scales gives them.
    template <typename Run> static void block_runs(const uint8_t* block, const Run& run) {
        const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
        unrolled<2>([&]<int H>() {
            const __m256i ql0 = load32(block + 64 * H), ql1 = load32(block + 64 * H + 32), qh = load32(block + 128 + 32 * H);
            const __m128i sh = H == 0 ? s : _mm_srli_si128(s, 8);
            unrolled<4>([&]<int V>() { run(4 * H + V, run_codes<V>(ql0, ql1, qh), run_scales<V>(sh)); });
        });
    }

    // Outputs (m0 .. m0 + R - 1, i) of row i (`w`, its blocks), read in place: each block's total
    // sum s (sum q x - 32 sum x) for each row of x. Each thread reads its band of rows in file order,
    // which the hardware prefetchers follow (fetching the next row ahead measured no faster).
    template <int R, typename Y> static void row_tile(const Rows& x, const uint8_t* w, Y* y, int64_t n, int64_t k, int64_t m0, int64_t i) {
        const int64_t supers = k / SUPER;
        float acc[R] = {};
        for (int64_t b = 0; b < supers; b++) {
            const uint8_t* block = w + b * BYTES;
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
            __m256i totals[R];
            for (int r = 0; r < R; r++) {  // -32 sum s x: each sub-block's sum of x times its s
                const __m256i xs = load32(x.sums + ((m0 + r) * supers + b) * 16);
                totals[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(xs, s16), 5));
            }
            block_runs(block, [&](int c, __m256i q, __m256i scales) {
                for (int r = 0; r < R; r++) {
                    const __m256i xv = load32(x.codes + (m0 + r) * k + b * SUPER + 32 * c);
                    totals[r] = _mm256_add_epi32(totals[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scales));
                }
            });
            const float d = half_at(block + 208);
            for (int r = 0; r < R; r++)
                acc[r] = std::fma(float_sum(totals[r]), d * x.scales[(m0 + r) * supers + b], acc[r]);
        }
        for (int r = 0; r < R; r++) store1(y + (m0 + r) * n + i, acc[r]);
    }

    // A widened tile of Lanes::N rows (a set of eight, or with AVX-512 a pair), per block: 64 runs of
    // q - 32 (store_runs), then per sub-block the rows' s (SCALES: int32 for VNNI's vpmulld, else int16
    // pairs for vpmaddwd), then each row's -128 sum s (q - 32) as int32 and its d as float32, four
    // bytes a lane each. The tiles multiply q - 32 by x + 128 (the unsigned operand of vpmaddubsw and
    // vpdpbusd), which adds 128 sum s (q - 32).
    static constexpr int64_t RUNS_BYTES = 64 * LANE_BYTES, SCALES_BYTES = 16 * LANE_BYTES;
    static constexpr int64_t WIDE_BLOCK = RUNS_BYTES + SCALES_BYTES + 2 * LANE_BYTES;

    // The eight rows from `set` (`row_bytes` apart) widened into lanes 8 half .. 8 half + 7 of `to`.
    static void widen_set(const uint8_t* set, int64_t row_bytes, int64_t supers, uint8_t* to, int half) {
        alignas(32) int8_t codes[8][SUPER];
        const __m256i minus32 = _mm256_set1_epi8(32);
        for (int64_t b = 0; b < supers; b++, to += WIDE_BLOCK) {
            uint8_t* scales = to + RUNS_BYTES;
            uint8_t* starts = scales + SCALES_BYTES;
            for (int j = 0; j < 8; j++) {
                const uint8_t* block = set + j * row_bytes + b * BYTES;
                const int lane = 8 * half + j;
                __m256i start = _mm256_setzero_si256();  // sum s (q - 32), each run's pairs by vpmaddubsw with ones, then s
                block_runs(block, [&](int c, __m256i q, __m256i run_scales) {
                    q = _mm256_sub_epi8(q, minus32);
                    _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j] + 32 * c), q);
                    start = _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), run_scales));
                });
                for (int t = 0; t < 16; t++) {
                    const int16_t scale = static_cast<int8_t>(block[192 + t]);
#ifdef SIMD_WIDE
                    *lane_slot<int32_t>(scales + t * LANE_BYTES, lane) = scale;
#else
                    int16_t* pair = lane_slot<int16_t>(scales + t * LANE_BYTES, lane);
                    pair[0] = pair[1] = scale;
#endif
                }
                *lane_slot<int32_t>(starts, lane) = -128 * hsum(start);
                *lane_slot<float>(starts + LANE_BYTES, lane) = half_at(block + 208);
            }
            store_runs(codes, to + 32 * half);
        }
    }

    // acc + sub-block t of the tile's rows with one row of x + 128 (x, its 16 inputs): sum s (q - 32)
    // (x + 128), exact in int32. With VNNI each run is one vpdpbusd and the sub-block's sums take s
    // by vpmulld; without, two runs' vpmaddubsw pairs are added in int16 (at most 2 x 2 x 255 x 32,
    // which fits) and take s by vpmaddwd.
    static Lanes::I sub_block(Lanes::I acc, const uint8_t* runs, Lanes::I scales, const uint8_t* x) {
#ifdef SIMD_WIDE
        Lanes::I sum = Lanes::dot(Lanes::all32(0), four_of(x), Lanes::load(runs));
        for (int c = 1; c < 4; c++) sum = Lanes::dot(sum, four_of(x + 4 * c), Lanes::load(runs + LANE_BYTES * c));
        return Lanes::add(acc, Lanes::mullo(sum, scales));
#else
        for (int c = 0; c < 4; c += 2) {
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(four_of(x + 4 * c), Lanes::load(runs + LANE_BYTES * c)),
                                                  _mm256_maddubs_epi16(four_of(x + 4 * c + 4), Lanes::load(runs + LANE_BYTES * (c + 1))));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pair, scales));
        }
        return acc;
#endif
    }

    // What set_tile reads: SUB_BLOCKS sub-blocks of SUB_BLOCK inputs a block, each of SUB_BLOCK / 4 runs;
    // the totals start from the rows' -128 sum s (q - 32); x + 128; one float step a block.
    static constexpr int SUB_BLOCKS = 16, SUB_BLOCK = 16;
    static Lanes::I start(const uint8_t* wide) { return Lanes::load(wide + RUNS_BYTES + SCALES_BYTES); }
    static const uint8_t* inputs(const Rows& x) { return x.unsigned_codes; }
    static Lanes::F step(Lanes::F acc, Lanes::I totals, const uint8_t* wide, const Rows& x, int64_t m, int64_t b, int64_t supers) {
        return Lanes::step(acc, totals, Lanes::loadf(wide + RUNS_BYTES + SCALES_BYTES + LANE_BYTES), x.scales[m * supers + b]);
    }
};

// --- Q5_K: w = d sc q - dmin m, 5-bit codes q, 6-bit sc and m per sub-block of 32 ---------------
//
// A block: float16 d and dmin, twelve bytes of 6-bit sc and m, 32 bytes of fifth bits (byte i:
// input 32t + i's in bit t) and 128 of low nibbles (bytes 32h + i: input 64h + i in the low nibble,
// 64h + 32 + i in the high one). Codes 0..31 are unsigned and x is signed, as vpmaddubsw and
// vpdpbusd take them, and each sub-block's m meets the sum of its 32 activations.
struct Q5_K {
    static constexpr int64_t BYTES = 176, SUM_SPAN = 32;
    static constexpr bool WIDE_SUMS = true, UNSIGNED_X = false;

    // sc of sub-blocks 0..7 in bytes 0..7, m in bytes 8..15: sub-block t < 4 in the low six bits of
    // bytes t (sc) and 4 + t (m); t >= 4 in byte 8 + t's low (sc) and high (m) nibbles, with the top
    // two bits of bytes t - 4 (sc) and t (m).
    // Unpacked in a vector register, words q0, q1, q2 of the twelve bytes as lanes: through general
    // registers, a decoding step's matrices read up to 1.05x slower.
    static __m128i scales_and_mins(const uint8_t* block) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));  // q0, q1, q2 and the block's next word
        const __m128i words = _mm_srlv_epi32(_mm_shuffle_epi32(q, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));  // q0, q2, q1, q2 >> 4
        const __m128i low = _mm_and_si128(words, _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
        const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(q, _MM_SHUFFLE(1, 1, 0, 0)), 6), _mm_set1_epi32(0x03030303));
        return _mm_or_si128(low, _mm_and_si128(_mm_slli_epi32(top, 4), _mm_setr_epi32(0, -1, 0, -1)));  // top two bits of q0, q1 into lanes 1, 3
    }

    // Codes 0..31 of sub-block T (inputs 32T .. 32T + 31), from the block's fifth bits (qh).
    template <int T> static __m256i run_codes(const uint8_t* block, __m256i qh) {
        const __m256i ql = load32(block + 48 + 32 * (T / 2));
        const __m256i low = _mm256_and_si256(T % 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
        const __m256i fifth = T <= 4 ? _mm256_slli_epi16(qh, 4 - T) : _mm256_srli_epi16(qh, T - 4);
        return _mm256_or_si256(low, _mm256_and_si256(fifth, _mm256_set1_epi8(0x10)));
    }

    // Calls run(t, q) for each of a block's eight sub-blocks t with its codes q.
    template <typename Run> static void block_runs(const uint8_t* block, const Run& run) {
        const __m256i qh = load32(block + 16);
        unrolled<8>([&]<int T>() { run(T, run_codes<T>(block, qh)); });
    }

    // Outputs (m0 .. m0 + R - 1, i) of row i (`w`, its blocks), read in place: each block's totals
    // sum sc (sum q x) and sum m (sum x) for each row of x.
    template <int R, typename Y> static void row_tile(const Rows& x, const uint8_t* w, Y* y, int64_t n, int64_t k, int64_t m0, int64_t i) {
        const int64_t supers = k / SUPER;
        float acc[R] = {};
        for (int64_t b = 0; b < supers; b++) {
            const uint8_t* block = w + b * BYTES;
            const __m128i sm = scales_and_mins(block);
            const __m256i sm2 = _mm256_broadcastsi128_si256(sm);
            const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
            __m256i totals[R];
            __m128i min_products[R];  // m sum x, in pairs of sub-blocks
            for (int r = 0; r < R; r++) {
                totals[r] = _mm256_setzero_si256();
                const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.sums + ((m0 + r) * supers + b) * 8));
                min_products[r] = _mm_madd_epi16(sums, mins);
            }
            block_runs(block, [&](int t, __m256i q) {
                const __m256i scale = _mm256_shuffle_epi8(sm2, _mm256_set1_epi16(static_cast<int16_t>(0x8000 | t)));  // sc[t] as int16
                for (int r = 0; r < R; r++) {
                    const __m256i xv = load32(x.codes + (m0 + r) * k + b * SUPER + 32 * t);
                    totals[r] = _mm256_add_epi32(totals[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
                }
            });
            const float d = half_at(block), dmin = half_at(block + 2);
            for (int r = 0; r < R; r++) {
                const float xd = x.scales[(m0 + r) * supers + b];
                // both totals in one reduction: (sum of totals' lanes, sum of min_products' lanes, the same again),
                // converted together where they are summed (one by one through a general register: 1.03-1.08x slower)
                const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(totals[r]), _mm256_extracti128_si256(totals[r], 1));
                const __m128 both = _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(half, min_products[r]), _mm_setzero_si128()));
                acc[r] = std::fma(_mm_cvtss_f32(both), d * xd, acc[r]);
                acc[r] = std::fma(_mm_cvtss_f32(_mm_movehdup_ps(both)), -dmin * xd, acc[r]);
            }
        }
        for (int r = 0; r < R; r++) store1(y + (m0 + r) * n + i, acc[r]);
    }

    // A widened tile of Lanes::N rows (a set of eight, or with AVX-512 a pair), per block: 64 runs of
    // q (store_runs), then per sub-block the rows' sc (SCALES: int32 for VNNI's vpmulld, else int16
    // pairs for vpmaddwd), per pair of sub-blocks the rows' m as int16 pairs (MINS, for vpmaddwd with
    // two sums of x), then each row's d and -dmin as float32, four bytes a lane each.
    static constexpr int64_t RUNS_BYTES = 64 * LANE_BYTES, SCALES_BYTES = 8 * LANE_BYTES, MINS_BYTES = 4 * LANE_BYTES;
    static constexpr int64_t WIDE_BLOCK = RUNS_BYTES + SCALES_BYTES + MINS_BYTES + 2 * LANE_BYTES;

    // The eight rows from `set` (`row_bytes` apart) widened into lanes 8 half .. 8 half + 7 of `to`.
    static void widen_set(const uint8_t* set, int64_t row_bytes, int64_t supers, uint8_t* to, int half) {
        alignas(32) int8_t codes[8][SUPER];
        for (int64_t b = 0; b < supers; b++, to += WIDE_BLOCK) {
            uint8_t* scales = to + RUNS_BYTES;
            uint8_t* mins = scales + SCALES_BYTES;
            uint8_t* d = mins + MINS_BYTES;
            for (int j = 0; j < 8; j++) {
                const uint8_t* block = set + j * row_bytes + b * BYTES;
                const int lane = 8 * half + j;
                block_runs(block, [&](int t, __m256i q) { _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j] + 32 * t), q); });
                alignas(16) uint8_t sm[16];
                _mm_store_si128(reinterpret_cast<__m128i*>(sm), scales_and_mins(block));
                for (int t = 0; t < 8; t++) {
#ifdef SIMD_WIDE
                    *lane_slot<int32_t>(scales + t * LANE_BYTES, lane) = sm[t];
#else
                    int16_t* pair = lane_slot<int16_t>(scales + t * LANE_BYTES, lane);
                    pair[0] = pair[1] = sm[t];
#endif
                    lane_slot<int16_t>(mins + t / 2 * LANE_BYTES, lane)[t % 2] = sm[8 + t];
                }
                *lane_slot<float>(d, lane) = half_at(block), *lane_slot<float>(d + LANE_BYTES, lane) = -half_at(block + 2);
            }
            store_runs(codes, to + 32 * half);
        }
    }

    // acc + sub-block t of the tile's rows with one row of x (its 32 inputs): sum q x, exact in int32,
    // times sc. With VNNI each run is one vpdpbusd and the sub-block's sums take sc by vpmulld;
    // without, four runs' vpmaddubsw pairs are added in int16 (at most 4 x 2 x 31 x 128, which fits)
    // and take sc by vpmaddwd.
    static Lanes::I sub_block(Lanes::I acc, const uint8_t* runs, Lanes::I scales, const uint8_t* x) {
#ifdef SIMD_WIDE
        Lanes::I sum = Lanes::dot(Lanes::all32(0), Lanes::load(runs), four_of(x));
        for (int c = 1; c < 8; c++) sum = Lanes::dot(sum, Lanes::load(runs + LANE_BYTES * c), four_of(x + 4 * c));
        return Lanes::add(acc, Lanes::mullo(sum, scales));
#else
        for (int c = 0; c < 8; c += 4) {
            __m256i four = _mm256_maddubs_epi16(Lanes::load(runs + LANE_BYTES * c), four_of(x + 4 * c));
            for (int u = 1; u < 4; u++)
                four = _mm256_add_epi16(four, _mm256_maddubs_epi16(Lanes::load(runs + LANE_BYTES * (c + u)), four_of(x + 4 * (c + u))));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(four, scales));
        }
        return acc;
#endif
    }

    // What set_tile reads: SUB_BLOCKS sub-blocks of SUB_BLOCK inputs a block, each of SUB_BLOCK / 4 runs;
    // the totals start from zero; x itself; two float steps a block, the second sum m (sum x) (-dmin xd).
    static constexpr int SUB_BLOCKS = 8, SUB_BLOCK = 32;
    static Lanes::I start(const uint8_t*) { return Lanes::all32(0); }
    static const uint8_t* inputs(const Rows& x) { return reinterpret_cast<const uint8_t*>(x.codes); }
    static Lanes::F step(Lanes::F acc, Lanes::I totals, const uint8_t* wide, const Rows& x, int64_t m, int64_t b, int64_t supers) {
        const uint8_t* mins = wide + RUNS_BYTES + SCALES_BYTES;
        const int16_t* sums = x.sums + (m * supers + b) * 8;
        Lanes::I min_totals = Lanes::madd16(Lanes::load(mins), four_of(sums));
        for (int u = 1; u < 4; u++) min_totals = Lanes::add(min_totals, Lanes::madd16(Lanes::load(mins + LANE_BYTES * u), four_of(sums + 2 * u)));
        const float xd = x.scales[m * supers + b];
        acc = Lanes::step(acc, totals, Lanes::loadf(mins + MINS_BYTES), xd);
        return Lanes::step(acc, min_totals, Lanes::loadf(mins + MINS_BYTES + LANE_BYTES), xd);
    }
};

// Outputs (m0 .. m0 + R - 1) of a widened tile's rows (`wide`) in format F, sets p and, where both, p + 1:
// each block's totals over its sub-blocks, exact in int32, then its float steps.
template <typename F, int R, typename Y>
void set_tile(const Rows& x, const uint8_t* wide, Y* y, int64_t n, int64_t k, int64_t m0, int64_t p, bool both) {
    const int64_t supers = k / SUPER;
    const uint8_t* inputs = F::inputs(x);
    Lanes::F acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = Lanes::zero();
    for (int64_t b = 0; b < supers; b++, wide += F::WIDE_BLOCK) {
        const Lanes::I start = F::start(wide);
        Lanes::I totals[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) totals[r] = start;
        UNROLL_SUB_BLOCKS
        for (int t = 0; t < F::SUB_BLOCKS; t++) {
            const Lanes::I scales = Lanes::load(wide + F::RUNS_BYTES + LANE_BYTES * t);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                totals[r] = F::sub_block(totals[r], wide + F::SUB_BLOCK / 4 * LANE_BYTES * t, scales,
                                         inputs + (m0 + r) * k + b * SUPER + F::SUB_BLOCK * t);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] = F::step(acc[r], totals[r], wide, x, m0 + r, b, supers);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) Lanes::store(y + (m0 + r) * n + 8 * p, acc[r], both);
}

// Calls tile<R>(m) for rows [begin, end) in tiles of TR rows, then one tile of the rows left.
template <int TR, typename Tile> void in_tiles(int64_t begin, int64_t end, const Tile& tile) {
    int64_t m = begin;
    for (; m + TR <= end; m += TR) tile.template operator()<TR>(m);
    if constexpr (TR > 1)
        if (m < end) in_tiles<TR - 1>(m, end, tile);
}

// y = x W^T for W in Format F (the file's blocks), any number of rows of x.
template <typename F>
void k_quant_linear(const int8_t* xq, const float* xd, const uint8_t* blocks, void* y, int64_t rows, int64_t n, int64_t k, int y_type,
                    int threads) {
    const bool widened = rows >= WIDENED_ROWS, in_place = !widened || n % 8;  // rows from 8 * (n / 8) on are read in place
    thread_local std::vector<int16_t> sums;  // each SUM_SPAN codes' sum (at most 32 x 128)
    const int64_t spans = in_place || F::WIDE_SUMS ? rows * k / F::SUM_SPAN : 0;
    sums.resize(spans);
    for (int64_t j = 0; j < spans; j++) {
        int32_t sum = 0;
        for (int t = 0; t < F::SUM_SPAN; t++) sum += xq[F::SUM_SPAN * j + t];
        sums[j] = static_cast<int16_t>(sum);
    }
    thread_local std::vector<uint8_t> unsigned_x;  // x + 128
    unsigned_x.resize(widened && F::UNSIGNED_X ? rows * k : 0);
    for (size_t j = 0; j < unsigned_x.size(); j++) unsigned_x[j] = static_cast<uint8_t>(xq[j] ^ 0x80);
    const Rows x{xq, xd, sums.data(), unsigned_x.data()};
    const int64_t supers = k / SUPER, row_bytes = supers * F::BYTES, sets = widened ? n / 8 : 0;
    as_float_type(y, y_type, [&]<typename Y>(const Y*) {
        Y* out = static_cast<Y*>(y);
        for_row_bands(n, threads, [&](int64_t begin, int64_t end) {
            const int64_t first_set = begin / 8, end_set = std::min(sets, end / 8), tile_bytes = supers * F::WIDE_BLOCK;
            const int64_t band_tiles = (std::max<int64_t>(end_set - first_set, 0) + SETS_PER_TILE - 1) / SETS_PER_TILE;
            thread_local std::vector<uint8_t> wide;
            wide.resize(std::min(WIDE_TILES, band_tiles) * tile_bytes);
            for (int64_t from = first_set; from < end_set; from += WIDE_TILES * SETS_PER_TILE) {  // a few tiles widened, then every row's
                const int64_t to = std::min(end_set, from + WIDE_TILES * SETS_PER_TILE);
                const auto tile_of = [&](int64_t p) { return wide.data() + (p - from) / SETS_PER_TILE * tile_bytes; };
                for (int64_t p = from; p < to; p += SETS_PER_TILE)
                    for (int h = 0; h < SETS_PER_TILE; h++)  // a pair's second set is its first again where the band has no other
                        F::widen_set(blocks + 8 * std::min(p + h, to - 1) * row_bytes, row_bytes, supers, tile_of(p), h);
                for (int64_t c = 0; c < rows; c += CHUNK)
                    for (int64_t p = from; p < to; p += SETS_PER_TILE)
                        in_tiles<SET_MR>(c, std::min(rows, c + CHUNK), [&]<int R>(int64_t m) {
                            set_tile<F, R>(x, tile_of(p), out, n, k, m, p, p + 1 < to);
                        });
            }
            for (int64_t c = 0; c < rows; c += CHUNK)  // rows not in a widened set: a decoding step's, or a last few
                for (int64_t i = std::max(begin, 8 * end_set); i < end; i++) {
                    const uint8_t* w = blocks + i * row_bytes;
                    in_tiles<MR>(c, std::min(rows, c + CHUNK), [&]<int R>(int64_t m) { F::template row_tile<R>(x, w, out, n, k, m, i); });
                }
        }, 8 * SETS_PER_TILE);
    });
}

}  // namespace

extern "C" void linear_q6_k(const int8_t* xq, const float* xd, const uint8_t* blocks, void* y, int64_t rows, int64_t n, int64_t k,
                            int y_type, int threads) {
    k_quant_linear<Q6_K>(xq, xd, blocks, y, rows, n, k, y_type, threads);
}

extern "C" void linear_q5_k(const int8_t* xq, const float* xd, const uint8_t* blocks, void* y, int64_t rows, int64_t n, int64_t k,
                            int y_type, int threads) {
    k_quant_linear<Q5_K>(xq, xd, blocks, y, rows, n, k, y_type, threads);
}

#else  // no AVX2: nothing here runs; the Python side keeps the layers' own code.

extern "C" void linear_q6_k(const int8_t*, const float*, const uint8_t*, void*, int64_t, int64_t, int64_t, int, int) {}
extern "C" void linear_q5_k(const int8_t*, const float*, const uint8_t*, void*, int64_t, int64_t, int64_t, int, int) {}

#endif
