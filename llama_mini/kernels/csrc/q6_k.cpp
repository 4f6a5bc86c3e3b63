// Q6_K blocks where a GGUF file maps them: y = x W^T with W = d s (q - 32), read in place.
//
// Why in place: converting a file's Q6_K matrices into another layout writes them once more into
// memory the process has never touched, and that first write of each page takes several times
// llama.cpp's whole load. Row i is the file's: k / 256 blocks of 210 bytes, 128 of low four bits,
// 64 of high two bits, 16 int8 sub-block scales s and a float16 d.
//
// Why activations in blocks of 256 (llama.cpp's Q8_K): a block of weights is then one float step,
// not eight. Its total, sum over its sixteen sub-blocks of s (sum q x - 32 sum x), is exact in
// int32 however it is summed; each output then takes y += float(total) * (d xd), one fma per
// block in block order. So every way of computing it gives the same bits: a decoding step reads
// each row in place (q6_k_tile), a prompt widens each set of eight rows once into bytes and
// multiplies them as the int8 kernel does (set_tile), and a row's result does not depend on the
// rows beside it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

constexpr int64_t SUPER = 256, Q6_K_BYTES = 210;  // inputs and bytes of a block
constexpr int MR = 4;  // rows of x per tile
// Rows of x in a prompt's tile of a widened set. Measured at 256 rows, 2048 x 2048: 150-190 GMAC/s on
// two cores either way; more sets a tile spill on AVX2 (three rows and two sets: 115-125).
#ifdef SIMD_WIDE
constexpr int SET_MR = 8;
#define UNROLL_SUB_BLOCKS _Pragma("GCC unroll 16")  // 1.1-1.7x with AVX-512's 32 registers; it spills AVX2's 16
#else
constexpr int SET_MR = 4;
#define UNROLL_SUB_BLOCKS
#endif
constexpr int64_t CHUNK = 128;  // rows of x per pass over the weights (they stay in cache)
constexpr int64_t WIDENED_ROWS = 16;  // from this many rows of x on, sets of eight rows are widened (a prompt)

// The activations as the tiles read them: int8 codes in blocks of 256 with a float32 scale each,
// and the sums of each 16 codes.
struct Rows {
    const int8_t* codes;  // (rows, k)
    const float* scales;  // (rows, k / 256)
    const int16_t* sums;  // (rows, k / 16)
};

// Sub-block scales of the 32 inputs of run V (0..3) of half a block, from its eight scales s, as
// int16: s[2V] eight times, then s[2V + 1] (vpmaddwd's pairs after vpmaddubsw: the first eight
// are the run's first sixteen inputs).
template <int V> inline __m256i run_scales(__m128i s) {
    const __m128i pick = _mm_setr_epi8(2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V, 2 * V + 1, 2 * V + 1, 2 * V + 1,
                                       2 * V + 1, 2 * V + 1, 2 * V + 1, 2 * V + 1, 2 * V + 1);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s, pick));
}

// Codes 0..63 of inputs 128h + 32V .. 128h + 32V + 31 of a block, from its low nibbles (ql0, ql1:
// its bytes 64h .., 64h + 32 ..) and high bits (qh: bytes 128 + 32h ..), as the file packs them.
template <int V> inline __m256i run_codes(__m256i ql0, __m256i ql1, __m256i qh) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
    const __m256i ql = V % 2 == 0 ? ql0 : ql1;
    const __m256i nibbles = _mm256_and_si256(V < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    return _mm256_or_si256(nibbles, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * V), low2), 4));
}

// Calls run(c, q, scales) for each of a block's eight runs of 32 inputs (run c: inputs 32c ..
// 32c + 31), with its codes 0..63 (q) and their sub-block scales as run_scales gives them.
template <typename Run> inline void block_runs(const uint8_t* block, const Run& run) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const auto half = [&]<int H>() {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * H));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * H + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * H));
        const __m128i sh = H == 0 ? s : _mm_srli_si128(s, 8);
        const auto one = [&]<int V>() { run(4 * H + V, run_codes<V>(ql0, ql1, qh), run_scales<V>(sh)); };
        one.template operator()<0>(), one.template operator()<1>(), one.template operator()<2>(), one.template operator()<3>();
    };
    half.template operator()<0>(), half.template operator()<1>();
}

// One block's exact totals with R rows of x (its 256 codes at x[r], their sums of 16 at sums[r]):
// totals[r] lanes add up to sum s (sum q x - 32 sum x).
template <int R> inline void block_totals(const uint8_t* block, const int8_t* const x[R], const int16_t* const sums[R], __m256i totals[R]) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    for (int r = 0; r < R; r++) {  // -32 sum s x: each sub-block's sum of x times its s
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums[r]));
        totals[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(xs, s16), 5));
    }
    block_runs(block, [&](int c, __m256i q, __m256i scales) {
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 32 * c));
            totals[r] = _mm256_add_epi32(totals[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scales));
        }
    });
}

inline float half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// Outputs (m0 .. m0 + R - 1, i) of row i (`w`, its blocks), read in place. Each thread reads its
// band of rows in file order, which the hardware prefetchers follow (fetching the next row ahead
// measured no faster).
template <int R, typename Y>
void q6_k_tile(const Rows& x, const uint8_t* w, Y* y, int64_t n, int64_t k, int64_t m0, int64_t i) {
    const int64_t supers = k / SUPER;
    float acc[R] = {};
    for (int64_t b = 0; b < supers; b++) {
        const uint8_t* block = w + b * Q6_K_BYTES;
        const int8_t* xs[R];
        const int16_t* sums[R];
        for (int r = 0; r < R; r++) xs[r] = x.codes + (m0 + r) * k + b * SUPER, sums[r] = x.sums + ((m0 + r) * supers + b) * 16;
        __m256i totals[R];
        block_totals<R>(block, xs, sums, totals);
        const float d = half_at(block + 208);
        for (int r = 0; r < R; r++)
            acc[r] = std::fma(static_cast<float>(hsum(totals[r])), d * x.scales[(m0 + r) * supers + b], acc[r]);
    }
    for (int r = 0; r < R; r++) store1(y + (m0 + r) * n + i, acc[r]);
}

// A set of eight rows widened for a prompt, per block: 64 runs of 32 bytes (run c: q - 32 of inputs
// 4c .. 4c + 3 of row j at bytes 4j ..), then per sub-block the eight rows' s (SCALES: as int32 for
// VNNI's vpmulld, else as int16 pairs, s_j at 2j and 2j + 1, for vpmaddwd), then each row's
// -128 sum s (q - 32) as int32 and its d as float32. The tiles multiply q - 32 by x + 128 (the
// unsigned operand of vpmaddubsw and vpdpbusd), which adds 128 sum s (q - 32).
constexpr int64_t RUNS_BYTES = 64 * 32, SCALES_BYTES = 16 * 32, WIDE_BLOCK = RUNS_BYTES + SCALES_BYTES + 32 + 32;
constexpr int64_t WIDE_SETS = 32;  // sets widened at a time: about 700 KB at k = 2048, in the second-level cache

// The eight rows from `set` (`row_bytes` apart) widened into `to`, block by block.
void widen_set(const uint8_t* set, int64_t row_bytes, int64_t supers, uint8_t* to) {
    alignas(32) int8_t codes[8][SUPER];
    const __m256i minus32 = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < supers; b++, to += WIDE_BLOCK) {
#ifdef SIMD_WIDE
        int32_t* scales = reinterpret_cast<int32_t*>(to + RUNS_BYTES);
#else
        int16_t* scales = reinterpret_cast<int16_t*>(to + RUNS_BYTES);
#endif
        int32_t* starts = reinterpret_cast<int32_t*>(to + RUNS_BYTES + SCALES_BYTES);
        for (int j = 0; j < 8; j++) {
            const uint8_t* block = set + j * row_bytes + b * Q6_K_BYTES;
            __m256i start = _mm256_setzero_si256();  // sum s (q - 32), each run's pairs by vpmaddubsw with ones, then s
            block_runs(block, [&](int c, __m256i q, __m256i run_scales) {
                q = _mm256_sub_epi8(q, minus32);
                _mm256_store_si256(reinterpret_cast<__m256i*>(codes[j] + 32 * c), q);
                start = _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), run_scales));
            });
            for (int t = 0; t < 16; t++) {
                const int16_t scale = static_cast<int8_t>(block[192 + t]);
#ifdef SIMD_WIDE
                scales[8 * t + j] = scale;
#else
                scales[16 * t + 2 * j] = scales[16 * t + 2 * j + 1] = scale;
#endif
            }
            starts[j] = -128 * hsum(start);
            reinterpret_cast<float*>(to + RUNS_BYTES + SCALES_BYTES + 32)[j] = half_at(block + 208);
        }
        for (int c = 0; c < 64; c += 8) {  // runs c .. c + 7: an 8 x 8 transpose of four-byte words
            __m256i v[8], u[8];
            for (int j = 0; j < 8; j++) v[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j] + 4 * c));
            for (int j = 0; j < 8; j += 2) u[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]), u[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
            for (int j = 0; j < 8; j += 4)
                for (int h = 0; h < 2; h++)
                    v[j + h] = _mm256_unpacklo_epi64(u[j + h], u[j + 2 + h]), v[j + 2 + h] = _mm256_unpackhi_epi64(u[j + h], u[j + 2 + h]);
            // v[0]: runs c, c + 4 of rows 0-3; v[1]: c + 2, c + 6; v[2]: c + 1, c + 5; v[3]: c + 3, c + 7; v[4..7]: rows 4-7
            static constexpr int order[4] = {0, 2, 1, 3};
            for (int q = 0; q < 4; q++) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * (c + order[q])), _mm256_permute2x128_si256(v[q], v[q + 4], 0x20));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * (c + order[q] + 4)), _mm256_permute2x128_si256(v[q], v[q + 4], 0x31));
            }
        }
    }
}

// Four activations + 128, as a vector's every four bytes.
inline __m256i four_of(const uint8_t* x) {
    int32_t four;
    std::memcpy(&four, x, 4);
    return _mm256_set1_epi32(four);
}

// acc + sub-block t of the eight rows with one row of x + 128 (x, its 16 inputs): sum s (q - 32) (x
// + 128), exact in int32. With VNNI each run is one vpdpbusd and the sub-block's sums take s by
// vpmulld; without, two runs' vpmaddubsw pairs are added in int16 (at most 2 x 2 x 255 x 32, which
// fits) and take s by vpmaddwd.
inline __m256i sub_block(__m256i acc, const uint8_t* runs, __m256i scales, const uint8_t* x) {
    const auto codes = [&](int c) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(runs + 32 * c)); };
#ifdef SIMD_WIDE
    __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), four_of(x), codes(0));
    for (int c = 1; c < 4; c++) sum = _mm256_dpbusd_epi32(sum, four_of(x + 4 * c), codes(c));
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(sum, scales));
#else
    for (int c = 0; c < 4; c += 2) {
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(four_of(x + 4 * c), codes(c)),
                                              _mm256_maddubs_epi16(four_of(x + 4 * c + 4), codes(c + 1)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pair, scales));
    }
    return acc;
#endif
}

// Outputs (m0 .. m0 + R - 1) of the eight rows of widened set p (`wide`).
template <int R, typename Y>
void set_tile(const Rows& x, const uint8_t* unsigned_x, const uint8_t* wide, Y* y, int64_t n, int64_t k, int64_t m0, int64_t p) {
    const int64_t supers = k / SUPER;
    __m256 acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < supers; b++, wide += WIDE_BLOCK) {
        const __m256i start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wide + RUNS_BYTES + SCALES_BYTES));
        __m256i totals[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) totals[r] = start;
        UNROLL_SUB_BLOCKS
        for (int t = 0; t < 16; t++) {
            const __m256i scales = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wide + RUNS_BYTES + 32 * t));
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) totals[r] = sub_block(totals[r], wide + 128 * t, scales, unsigned_x + (m0 + r) * k + b * SUPER + 16 * t);
        }
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(wide + RUNS_BYTES + SCALES_BYTES + 32));
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[(m0 + r) * supers + b])), acc[r]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) store8(y + (m0 + r) * n + 8 * p, acc[r]);
}

// Calls tile<R>(m) for rows [begin, end) in tiles of MR rows, then one tile of the rows left.
template <int TR, typename Tile> void in_tiles(int64_t begin, int64_t end, const Tile& tile) {
    int64_t m = begin;
    for (; m + TR <= end; m += TR) tile.template operator()<TR>(m);
    if constexpr (TR > 1)
        if (m < end) in_tiles<TR - 1>(m, end, tile);
}

}  // namespace

extern "C" void linear_q6_k(const int8_t* xq, const float* xd, const uint8_t* blocks, void* y, int64_t rows, int64_t n,
                            int64_t k, int y_type, int threads) {
    thread_local std::vector<int16_t> sums;  // each 16 codes' sum (at most 16 x 128), for the rows read in place
    const bool in_place = rows < WIDENED_ROWS || n % 8;  // a prompt's widened sets do not read them
    sums.resize(in_place ? rows * k / 16 : 0);
    for (int64_t j = 0; j < (in_place ? rows * k / 16 : 0); j++) {
        int32_t sum = 0;
        for (int t = 0; t < 16; t++) sum += xq[16 * j + t];
        sums[j] = static_cast<int16_t>(sum);
    }
    const Rows x{xq, xd, sums.data()};
    thread_local std::vector<uint8_t> unsigned_x;  // x + 128, for a prompt's widened sets
    if (rows >= WIDENED_ROWS) {
        unsigned_x.resize(rows * k);
        for (int64_t j = 0; j < rows * k; j++) unsigned_x[j] = static_cast<uint8_t>(xq[j] ^ 0x80);
    }
    const uint8_t* ux = unsigned_x.data();
    const int64_t supers = k / SUPER, row_bytes = supers * Q6_K_BYTES;
    as_float_type(y, y_type, [&]<typename Y>(const Y*) {
        Y* out = static_cast<Y*>(y);
        const int64_t sets = rows >= WIDENED_ROWS ? n / 8 : 0;  // rows from 8 * sets on are read in place
        for_row_bands(n, threads, [&](int64_t begin, int64_t end) {
            const int64_t first_set = begin / 8, end_set = std::min(sets, end / 8);
            thread_local std::vector<uint8_t> wide;
            wide.resize(std::min(WIDE_SETS, std::max<int64_t>(end_set - first_set, 0)) * supers * WIDE_BLOCK);
            for (int64_t from = first_set; from < end_set; from += WIDE_SETS) {  // a few sets widened, then every row's tiles
                const int64_t to = std::min(end_set, from + WIDE_SETS), stride = supers * WIDE_BLOCK;
                for (int64_t p = from; p < to; p++) widen_set(blocks + 8 * p * row_bytes, row_bytes, supers, wide.data() + (p - from) * stride);
                for (int64_t c = 0; c < rows; c += CHUNK)
                    for (int64_t p = from; p < to; p++)
                        in_tiles<SET_MR>(c, std::min(rows, c + CHUNK), [&]<int R>(int64_t m) {
                            set_tile<R>(x, ux, wide.data() + (p - from) * stride, out, n, k, m, p);
                        });
            }
            for (int64_t c = 0; c < rows; c += CHUNK)  // rows not in a widened set: a decoding step's, or a last few
                for (int64_t i = std::max(begin, 8 * end_set); i < end; i++) {
                    const uint8_t* w = blocks + i * row_bytes;
                    in_tiles<MR>(c, std::min(rows, c + CHUNK), [&]<int R>(int64_t m) { q6_k_tile<R>(x, w, out, n, k, m, i); });
                }
        }, 8);
    });
}

#else  // no AVX2: nothing here runs; the Python side keeps the layer's own code.

extern "C" void linear_q6_k(const int8_t*, const float*, const uint8_t*, void*, int64_t, int64_t, int64_t, int, int) {}

#endif
