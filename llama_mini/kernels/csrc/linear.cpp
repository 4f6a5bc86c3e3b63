// Linear layers on the CPU, y = x W^T, for any number of rows of x: float32, bfloat16 or
// float16 weights, int8 and int4 weights, and a GGUF file's Q8_0 blocks where it maps them
// (its Q5_K and Q6_K blocks: k_quants.cpp).
//
// A decoding step multiplies every weight matrix by one row (a few, for a batch): its time is
// the time to stream the weights from memory. A prompt multiplies them by hundreds of rows: its
// time is arithmetic. One kernel per weight type serves both. It computes a tile, MR rows of x
// against a few weight rows, with the tile's outputs in registers over all of k:
//
// - A decoding step is a tile of its rows against each few weight rows in turn; the weights
//   are read once, prefetched ahead (the hardware prefetchers lose track of a small model's
//   short rows and stop at 4 KB pages), each thread streaming a band of them.
// - A prompt is cut into chunks of CHUNK rows, small enough to stay in cache. Each thread
//   streams its band of weights once per chunk, and every weight, once in registers or L1,
//   meets MR rows of x.
//
// Each output is summed in the same order whatever the tile, chunk or thread (simd.h), so a
// row's result does not depend on the rows beside it: batched equals alone, bit for bit.
// Float weights are held in panels of sixteen outputs instead (linear_panels), each output
// summed input after input, for the same reason.
//
// Integer weights are multiplied as integers, as llama.cpp does: the activations are rounded
// to int8 in blocks of 32 (Q8_0), vpmaddubsw or VNNI's vpdpbusd multiply four weights of a row
// by four activations at once, and each block's exact sum gets its scales in float32.
// Converting each weight to float instead would need several times the instructions.
//
// Plain C++ over raw pointers behind a C ABI (kernels.h), without torch; linear_op.cpp makes
// the torch operators. x86-64 with AVX2 and FMA only; elsewhere the entry points are empty,
// vector_kernels_available() says 0, and the Python side runs the layers' own code.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

// Tile sizes: as many accumulators as the registers hold (32 with AVX-512, 16 with AVX2),
// with room for the operands.
#ifdef SIMD_WIDE
constexpr int DENSE_MR = 4, DENSE_NR = 6;  // rows of x, rows of W
constexpr int INT_MR = 4, INT_NZ = 3;  // rows of x, pairs of sets of eight rows of W
#else
constexpr int DENSE_MR = 3, DENSE_NR = 4;
constexpr int INT_MR = 4, INT_NZ = 1;  // the sums of four rows spill to the stack once a block: 1.15-1.25x two rows' speed
#endif
constexpr int64_t CHUNK = 128;  // rows of x per pass over the weights
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead each stream of integer weights is fetched

// The cache lines of `rows` runs of `bytes` bytes, `stride` apart from `first`, fetched in `shares`
// equal shares: share(s) fetches the s-th, so that memory is read while arithmetic runs.
class Prefetches {
  public:
    Prefetches(const void* first, int64_t rows, int64_t stride, int64_t bytes, int64_t shares)
        : first_(static_cast<const char*>(first)), stride_(stride), lines_((bytes + 63) / 64),
          per_share_((rows * lines_ + shares - 1) / std::max<int64_t>(shares, 1)), total_(rows * lines_) {}
    void share(int64_t s) const {
        for (int64_t line = s * per_share_, until = std::min(total_, line + per_share_); line < until; line++)
            prefetch(first_ + line / lines_ * stride_ + line % lines_ * 64);
    }

  private:
    const char* first_;
    int64_t stride_, lines_, per_share_, total_;
};

// Calls tile<R>(m) for rows [begin, end) in tiles of MR rows, then one tile of the rows left.
template <int MR, typename Tile> void by_row_tiles(int64_t begin, int64_t end, const Tile& tile) {
    int64_t m = begin;
    for (; m + MR <= end; m += MR) tile.template operator()<MR>(m);
    if constexpr (MR > 1)
        if (m < end) by_row_tiles<MR - 1>(m, end, tile);
}

// Calls pass(chunk_begin, chunk_end) for each chunk of rows, then, within it, tiles over the
// chunk: tile<R>(m, first) with first true for the chunk's first tile (the one that streams the
// weights from memory, and so prefetches).
template <int MR, typename Tile> void over_chunks(int64_t rows, const Tile& tile, int64_t begin_w, int64_t end_w,
                                                 int64_t step_w) {
    for (int64_t c = 0; c < rows; c += CHUNK) {
        const int64_t c_end = std::min(rows, c + CHUNK);
        for (int64_t i = begin_w; i < end_w; i += step_w)
            by_row_tiles<MR>(c, c_end, [&]<int R>(int64_t m) { tile.template operator()<R>(m, i, m == c); });
    }
}

// --- Dense weights -----------------------------------------------------------------------------
//
// A tile reads its weights and its rows of x as they are (a decoding step: the weights stream
// from memory once), or packed (a prompt): a block of a chunk of x, and of a tile of W, copied
// into buffers laid out so that each step of the tile reads one run of memory, converted to
// the kernel's float type. The values and their order of sums are the rows' own (simd.h), so
// a row's result does not depend on which way it was read.

// Whether x W^T multiplies bfloat16 pairs with AVX-512 BF16 (simd.h): its packed operands stay bf16.
template <typename X, typename W> constexpr bool BF16_PAIRS = DenseStep<X, W>::inputs == 32;
// The type a packed operand holds.
template <typename X, typename W> using Packed = std::conditional_t<BF16_PAIRS<X, W>, uint16_t, float>;

// sums[r * stride + q] += the block of inputs [0, length) of outputs (r < MR, q < NR) of a tile,
// read from lx and lw: rows of x and W as they are (rows k apart; `next` prefetched, NR rows k
// apart, where PREFETCH), or PACKED (each step's MR, then NR runs side by side). The loops are
// unrolled by hand (pragmas), so that the compiler keeps the accumulators in registers.
template <int MR, int NR, bool PACKED, bool PREFETCH, typename LX, typename LW>
void dense_block(const LX* lx, const LW* lw, int64_t k, int64_t length, const void* next, float* sums,
                 int64_t stride) {
    using Step = DenseStep<LX, LW>;
    constexpr int64_t L = Step::inputs;
    const int64_t x_row = PACKED ? L : k, w_row = PACKED ? L : k;
    const int64_t x_step = PACKED ? MR * L : L, w_step = PACKED ? NR * L : L;
    DenseLanes acc[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int q = 0; q < NR; q++) acc[r][q] = DenseLanes::zero();
    for (int64_t j = 0; j < length; j += L, lx += x_step, lw += w_step) {
        typename Step::Vector xv[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) xv[r] = Step::load(lx + r * x_row);
#pragma GCC unroll 8
        for (int q = 0; q < NR; q++) {
            if constexpr (PREFETCH) prefetch(static_cast<const LW*>(next) + q * k + j);
            typename Step::Vector wv = Step::load_w(lw + q * w_row);
            in_register(wv);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r][q] = Step::madd(acc[r][q], wv, xv[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int q = 0; q < NR; q++) sums[r * stride + q] += lanes_sum(acc[r][q]);
}

// Outputs (m0 .. m0 + MR - 1, i0 .. i0 + NR - 1) of x W^T, reading the rows as they are.
template <int MR, int NR, typename X, typename W, typename Y>
void dense_tile(const X* x, const W* w, Y* y, int64_t n, int64_t k, int64_t m0, int64_t i0, bool prefetch_next) {
    constexpr int64_t L = DenseStep<X, W>::inputs;
    const int64_t end = k / L * L;
    const X* xt = x + m0 * k;
    const W* wt = w + i0 * k;
    float sums[MR * NR] = {};
    for (int64_t b = 0; b < end; b += DENSE_KC) {
        const int64_t length = std::min(DENSE_KC, end - b);
        if (prefetch_next && i0 + 2 * NR <= n)  // the next tile's rows
            dense_block<MR, NR, false, true>(xt + b, wt + b, k, length, wt + NR * k + b, sums, NR);
        else
            dense_block<MR, NR, false, false>(xt + b, wt + b, k, length, nullptr, sums, NR);
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NR; q++) store1(y + (m0 + r) * n + i0 + q, dense_tail(sums[r * NR + q], xt + r * k, wt + q * k, end, k));
}

// Inputs [b, b + length) of rows [0, count) of `from` (k values each), packed for dense_block:
// for each step of L inputs, the rows' runs side by side, converted to P.
template <int64_t L, typename P, typename T>
void pack(P* to, const T* from, int64_t count, int64_t k, int64_t b, int64_t length) {
    for (int64_t j = b; j < b + length; j += L)
        for (int64_t r = 0; r < count; r++, to += L) {
            if constexpr (std::is_same_v<P, T>)
                std::memcpy(to, from + r * k + j, L * sizeof(P));
            else
                for (int64_t t = 0; t < L; t += 8) store8(to + t, load8(from + r * k + j + t));
        }
}

// Calls body.template operator()<C>() for the count C (1 .. N) given at run time.
template <int N, typename Body> void with_count(int64_t count, const Body& body) {
    if constexpr (N > 1)
        if (count < N) return with_count<N - 1>(count, body);
    body.template operator()<N>();
}

// Rows of W in tiles of NR, read as they are, threads taking bands of them: a few rows of x
// (a decoding step) are bound by memory, and four streams of weights per thread read fastest.
template <int NR, typename X, typename W, typename Y>
void dense_in_tiles(const X* x, const W* w, Y* y, int64_t rows, int64_t n, int64_t k, int threads) {
    for_row_bands(n, threads, [&](int64_t begin, int64_t end) {
        const int64_t whole = begin + (end - begin) / NR * NR;
        over_chunks<DENSE_MR>(rows, [&]<int R>(int64_t m, int64_t i, bool first) {
            dense_tile<R, NR>(x, w, y, n, k, m, i, first);
        }, begin, whole, NR);
        over_chunks<DENSE_MR>(rows, [&]<int R>(int64_t m, int64_t i, bool) {
            dense_tile<R, 1>(x, w, y, n, k, m, i, false);
        }, whole, end, 1);
    }, NR);
}

// More rows (a prompt) are bound by arithmetic. Chunks of CHUNK rows of x, block by block of
// inputs, packed (in the second-level cache); for each tile of DENSE_NR rows of W, its block
// packed (in the first), while the next tile's block is fetched from memory, a share before each
// tile of x; the tiles of x then meet it, each step a load per DENSE_MR or DENSE_NR
// multiply-adds. Each thread sums its band's outputs of a chunk in `sums`.
template <typename X, typename W, typename Y>
void dense_packed(const X* x, const W* w, Y* y, int64_t rows, int64_t n, int64_t k, int threads) {
    using P = Packed<X, W>;
    constexpr int64_t L = DenseStep<P, P>::inputs;
    const int64_t end = k / L * L;
    for_row_bands(n, threads, [&](int64_t begin, int64_t band_end) {
        const int64_t band = band_end - begin, chunk = std::min(rows, CHUNK);
        thread_local std::vector<P> xp, wp;
        thread_local std::vector<float> sums;
        xp.resize(chunk * DENSE_KC), wp.resize(DENSE_NR * DENSE_KC), sums.resize(chunk * band);
        for (int64_t c = 0; c < rows; c += CHUNK) {
            const int64_t c_end = std::min(rows, c + CHUNK);
            std::fill(sums.begin(), sums.end(), 0.0f);
            for (int64_t b = 0; b < end; b += DENSE_KC) {
                const int64_t length = std::min(DENSE_KC, end - b);
                by_row_tiles<DENSE_MR>(c, c_end, [&]<int R>(int64_t m) { pack<L>(xp.data() + (m - c) * length, x + m * k, R, k, b, length); });
                for (int64_t i = begin; i < band_end; i += DENSE_NR) {
                    const int64_t count = std::min<int64_t>(DENSE_NR, band_end - i);
                    pack<L>(wp.data(), w + i * k, count, k, b, length);
                    const Prefetches next(w + (i + DENSE_NR) * k + b, i + 2 * DENSE_NR <= band_end ? DENSE_NR : 0,
                                          k * int64_t(sizeof(W)), length * int64_t(sizeof(W)), (c_end - c + DENSE_MR - 1) / DENSE_MR);
                    int64_t tile = 0;
                    with_count<DENSE_NR>(count, [&]<int NR>() {
                        by_row_tiles<DENSE_MR>(c, c_end, [&]<int R>(int64_t m) {
                            next.share(tile++);
                            dense_block<R, NR, true, false>(xp.data() + (m - c) * length, wp.data(), k, length, nullptr,
                                                            sums.data() + (m - c) * band + (i - begin), band);
                        });
                    });
                }
            }
            for (int64_t m = c; m < c_end; m++)
                for (int64_t i = begin; i < band_end; i++)
                    store1(y + m * n + i, dense_tail(sums[(m - c) * band + i - begin], x + m * k, w + i * k, end, k));
        }
    }, DENSE_NR);
}

template <typename X, typename W, typename Y>
void dense(const X* x, const W* w, Y* y, int64_t rows, int64_t n, int64_t k, int threads) {
    if (rows < DENSE_MR)
        dense_in_tiles<4>(x, w, y, rows, n, k, threads);
    else
        dense_packed(x, w, y, rows, n, k, threads);
}

// --- Dense float weights in panels --------------------------------------------------------------
//
// A tile of rows of x against rows of W reads a vector of each for every few multiply-adds, and
// a prompt is bound by loads: 0.6-0.75x torch's sgemm with AVX2's eight lanes, 0.61-0.85x with
// AVX-512's sixteen. Held in panels of sixteen outputs, input-major (kernels.h), the weights meet
// each input of a row broadcast to all lanes: a tile of PANEL_MR rows against PANEL_NP panels
// does 6 x PANEL_NP sixteen-lane multiply-adds per PANEL_NP loads of weights, as BLAS kernels
// do; a decoding step streams a few panels in order. Each output is then summed input after
// input, from zero, by fused multiply-adds, whatever the tile, chunk or thread: a row's result
// does not depend on the rows beside it. bfloat16 and float16 panels are the same, each weight
// made float32 as it is loaded (exact): half the bytes to stream, the same arithmetic.

constexpr int PANEL = 16;  // outputs per panel
constexpr int PANEL_MR = 6;  // rows of x in a prompt's tile
#ifdef SIMD_WIDE
constexpr int PANEL_NP = 4;  // panels in a prompt's tile: 24 accumulators of AVX-512's 32 registers
#else
constexpr int PANEL_NP = 1;  // 12 of AVX2's 16 (two registers a panel)
#endif
constexpr int64_t PANEL_STREAMED = 3;  // rows up to which a product streams the panels (a decoding step)

// y[r * y_row + 16 p + q] (r < R, p < NP, q < 16): inputs [0, k) of R rows of x (x_row apart)
// times NP panels (panel_stride apart, sixteen outputs an input), summed input after input from
// zero. A whole row of inputs per call: each operand is read in one long run, which the
// hardware prefetchers follow, and no sum leaves the registers before it is done.
template <int R, int NP, typename X, typename W, typename Y>
void panel_tile(const X* x, int64_t x_row, const W* w, int64_t panel_stride, int64_t k, Y* y, int64_t y_row,
                bool prefetch_ahead) {
    Floats16 acc[R][NP];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) acc[r][p] = Floats16::zero();
#pragma GCC unroll 4
    for (int64_t j = 0; j < k; j++, w += PANEL) {
        Floats16 wv[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) {
            if (prefetch_ahead) prefetch(w + p * panel_stride + PREFETCH_BYTES / sizeof(W));
            wv[p] = Floats16::load(w + p * panel_stride);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const Floats16 xb = Floats16::all(load1(x + r * x_row + j));
#pragma GCC unroll 8
            for (int p = 0; p < NP; p++) acc[r][p] = fma(wv[p], xb, acc[r][p]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) {
            store8(y + r * y_row + PANEL * p, acc[r][p].low());
            store8(y + r * y_row + PANEL * p + 8, acc[r][p].high());
        }
}

// Rows [m, m + R) against panels [from, to): NP panels a tile, then the rest one by one.
template <int R, int NP, typename X, typename W, typename Y>
void across_panels(const X* x, const W* panels, Y* y, int64_t m, int64_t from, int64_t to, int64_t n, int64_t k,
                   bool prefetch_ahead) {
    int64_t p = from;
    for (; p + NP <= to; p += NP)
        panel_tile<R, NP>(x + m * k, k, panels + p * k * PANEL, k * PANEL, k, y + m * n + p * PANEL, n, prefetch_ahead);
    for (; p < to; p++) panel_tile<R, 1>(x + m * k, k, panels + p * k * PANEL, 0, k, y + m * n + p * PANEL, n, prefetch_ahead);
}

// A few rows (a decoding step): bound by memory. Each thread streams its band of panels, a few
// side by side (as many as leave the accumulators in registers), in one pass over all inputs.
template <typename X, typename W, typename Y>
void panels_streamed(const X* x, const W* panels, Y* y, int64_t rows, int64_t n, int64_t k, int threads) {
    for_row_bands(n / PANEL, threads, [&](int64_t begin, int64_t end) {
        by_row_tiles<PANEL_STREAMED>(0, rows, [&]<int R>(int64_t m) {
            across_panels<R, R == 1 ? 4 : R == 2 ? 3 : 2>(x, panels, y, m, begin, end, n, k, true);
        });
    }, 1);
}

// More rows (a prompt): bound by arithmetic. Chunks of up to PANEL_CHUNK rows, then groups of
// panels that fill a quarter of the second-level cache: each tile of PANEL_MR rows meets the
// group's panels in turn, PANEL_NP at a time, so the group is read from there, x once per group.
// Half-precision operands are made float32 first, a chunk of x and a group of panels at a time,
// so that the tiles run float32's loop: converted in the tiles, each load would need registers
// the accumulators hold (AVX2 has sixteen), and a prompt would read at half the speed.
constexpr int64_t PANEL_CHUNK = 171 * PANEL_MR;  // 1,026 rows: fewer chunks stream the weights fewer times

// Panels per group for k inputs: a quarter of this CPU's second-level cache (1 MB where the C
// library does not say), and a tile's at least.
inline int64_t panel_group(int64_t k) {
#ifdef _SC_LEVEL2_CACHE_SIZE
    static const int64_t l2 = sysconf(_SC_LEVEL2_CACHE_SIZE) > 0 ? sysconf(_SC_LEVEL2_CACHE_SIZE) : 1 << 20;
#else
    constexpr int64_t l2 = 1 << 20;
#endif
    return std::max<int64_t>(PANEL_NP, l2 / 4 / (k * PANEL * int64_t(sizeof(float))));
}

// count values from `from`, as float32: `from` itself where it holds float32, else a copy in `buffer`.
template <typename T> const float* as_float32(const T* from, int64_t count, std::vector<float>& buffer) {
    if constexpr (std::is_same_v<T, float>) {
        return from;
    } else {
        buffer.resize(count);
        int64_t i = 0;
        for (; i + 8 <= count; i += 8) store8(buffer.data() + i, load8(from + i));
        for (; i < count; i++) buffer[i] = load1(from + i);
        return buffer.data();
    }
}

template <typename X, typename W, typename Y>
void panels_in_chunks(const X* x, const W* panels, Y* y, int64_t rows, int64_t n, int64_t k, int threads) {
    const int64_t chunks = (rows + PANEL_CHUNK - 1) / PANEL_CHUNK, group = panel_group(k);
    const int64_t chunk = ((rows + chunks - 1) / chunks + PANEL_MR - 1) / PANEL_MR * PANEL_MR;  // a tile of fewer rows is last
    for_row_bands(n / PANEL, threads, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> x_floats, w_floats;
        for (int64_t c = 0; c < rows; c += chunk) {
            const int64_t c_end = std::min(rows, c + chunk);
            const float* xc = as_float32(x + c * k, (c_end - c) * k, x_floats);
            for (int64_t g = begin; g < end; g += group) {
                const int64_t count = std::min(end, g + group) - g;
                const float* wg = as_float32(panels + g * k * PANEL, count * k * PANEL, w_floats);
                by_row_tiles<PANEL_MR>(c, c_end, [&]<int R>(int64_t m) {  // the chunk's rows and the group's panels, from 0
                    across_panels<R, PANEL_NP>(xc, wg, y + c * n + g * PANEL, m - c, 0, count, n, k, false);
                });
            }
        }
    }, 1);
}

// --- Integer weights -----------------------------------------------------------------------------
//
// Rows come in sets of eight, interleaved (kernels.h): a tile takes NZ pairs of sets side by
// side, sixteen rows each (a set alone where the count is odd), one int32 lane per row, so
// there are no sums across lanes.

struct Activations {
    const int8_t* codes;  // (rows, k)
    const float* scales;  // (rows, k / 32)
    const int32_t* sums;  // (rows, k / 32)
};

// The sets of a tile's NZ pairs: first[z] and second[z] (equal where a set is alone).
template <int NZ> struct SetPairs {
    int64_t first[NZ], second[NZ];
};

template <typename Y> void store16(Y* y, int64_t first, int64_t second, Floats16 v) {
    store8(y + 8 * first, v.low());
    if (second != first) store8(y + 8 * second, v.high());
}

// Prefetches PREFETCH_BYTES ahead of `at` in a stream of weights, within [.., end).
inline void prefetch_ahead(const void* at, int64_t bytes, const void* end) {
    const char* p = static_cast<const char*>(at) + PREFETCH_BYTES;
    for (int64_t line = 0; line < bytes && p + line < static_cast<const char*>(end); line += 64) prefetch(p + line);
}

// The two formats of integer weights, as integer_tile reads them. Per set of eight rows and block
// of 32 inputs, RUNS runs of 32 bytes (kernels.h): a run is loaded once (load), meets each row of
// x's activations for its inputs (inputs, dot), and a block's exact sums then get the weights'
// scales, the same for every row of x (scales_of), in float32 (add; simd.h says in which order).
// scales_of is called for a tile's blocks in order and may keep what a run of them shares (Kept).
// Each step is inline: the tile's code is the one loop, with the format's steps in it.

// int8, a scale per row and block: a run holds inputs 4c .. 4c + 3 of each of the sixteen rows.
struct Int8Format {
    static constexpr int RUNS = 8, RUN_BYTES = 32, BLOCK_BYTES = 256;
    using Sum = Ints16;
    using Run = Int8Run;
    using Inputs = int32_t;  // four activations
    struct Scales {
        Floats16 s;
    };
    struct Kept {};
    const void* scales;
    int scale_type;
    int64_t blocks;

    static Ints16 start(int32_t activation_sum) { return int8_block_start(activation_sum); }
    static Run load(const char* first, const char* second, int64_t, int64_t, int64_t, int) {
        return int8_run(Ints16::load(first, second));
    }
    static Inputs inputs(const int8_t* x, int64_t, int64_t, int c) { return four_bytes(x + 4 * c); }
    static Ints16 dot(Ints16 acc, const Run& w, Inputs x) { return int8_dot(acc, w, x); }
    Scales scales_of(int64_t first, int64_t second, int64_t b, Kept&) const {
        return {set_pair_scales(scales, scale_type, first, second, blocks, b)};
    }
    static Floats16 add(Floats16 acc, Ints16 isum, const Scales& s, float d, int32_t) { return int8_block(acc, isum, s.s, d); }
};

// int4, a scale and an offset per row and group of `group` inputs: run c holds inputs 8c .. 8c + 3
// in its low nibbles, 8c + 4 .. 8c + 7 in its high.
struct Int4Format {
    static constexpr int RUNS = 4, RUN_BYTES = 32, BLOCK_BYTES = 128;
    using Sum = U4Sums;
    struct Run {
        Codes16 low, high;
    };
    struct Inputs {
        int32_t low, high;  // four activations each
    };
    struct Scales {
        Floats16 s, offsets;
    };
    struct Kept {};
    const void* scales;
    const void* offsets;
    int scale_type;  // the offsets' too
    int64_t groups, per_group;  // blocks per group

    static Sum start(int32_t) { return u4_sums_zero(); }
    static Run load(const char* first, const char* second, int64_t, int64_t, int64_t, int) {
        Run run;
        nibbles(Ints16::load(first, second), run.low, run.high);
        return run;
    }
    static Inputs inputs(const int8_t* x, int64_t, int64_t, int c) { return {four_bytes(x + 8 * c), four_bytes(x + 8 * c + 4)}; }
    static Sum dot(Sum acc, const Run& w, Inputs x) { return u4_add(u4_add(acc, w.low, x.low), w.high, x.high); }
    Scales scales_of(int64_t first, int64_t second, int64_t b, Kept&) const {
        const int64_t g = b / per_group;
        return {set_pair_scales(scales, scale_type, first, second, groups, g), set_pair_scales(offsets, scale_type, first, second, groups, g)};
    }
    static Floats16 add(Floats16 acc, Sum isum, const Scales& s, float d, int32_t activation_sum) {
        return int4_block(acc, u4_total(isum), s.s, s.offsets, d, activation_sum);
    }
};

// Symmetric int4 (llama.cpp's Q4_0): no offsets held, each group's is -8 times its scale, exact in float32.
struct SymmetricInt4Format : Int4Format {
    Scales scales_of(int64_t first, int64_t second, int64_t b, Kept&) const {
        const Floats16 s = set_pair_scales(scales, scale_type, first, second, groups, b / per_group);
        return {s, mul(s, Floats16::all(-8.0f))};
    }
};

// int4 with factored scales and offsets (llama.cpp's K-quants): a group's are its uint8
// factors times its super-group's floats (of scale_type), multiplied in float32 as quant/layers.py does.
// At each super-group its floats are converted once for its groups, and the four arrays are fetched
// GROUPS_AHEAD groups ahead: they advance a few bytes a group, too slowly for the hardware's
// prefetchers to keep up with the codes (both: decoding a 1B Q4_K_M file 1.02-1.04x faster with
// AVX-512, 1.01x with AVX2).
constexpr int64_t GROUPS_AHEAD = 64;

struct FactoredInt4Format : Int4Format {
    struct Kept {
        Floats16 super_scales, super_offsets;
    };
    const void* super_scales;
    const void* super_offsets;
    int64_t supers, groups_per_super;

    Scales scales_of(int64_t first, int64_t second, int64_t b, Kept& kept) const {
        const int64_t g = b / per_group, s = g / groups_per_super;
        if (b % (per_group * groups_per_super) == 0) {
            kept = {set_pair_scales(super_scales, scale_type, first, second, supers, s),
                    set_pair_scales(super_offsets, scale_type, first, second, supers, s)};
            const int64_t float_bytes = scale_type == F32 ? 4 : 2;
            for (const int64_t set : {first, second}) {
                for (const void* factors : {scales, offsets})
                    prefetch(static_cast<const uint8_t*>(factors) + (set * groups + g + GROUPS_AHEAD) * 8);
                for (const void* floats : {super_scales, super_offsets})
                    prefetch(static_cast<const uint8_t*>(floats) + (set * supers + s + GROUPS_AHEAD / groups_per_super) * 8 * float_bytes);
            }
        }
        return {mul(set_pair_factors(scales, first, second, groups, g), kept.super_scales),
                mul(set_pair_factors(offsets, first, second, groups, g), kept.super_offsets)};
    }
};

// A prompt's tiles meet each pair of sets' scales again every few rows: from FACTORED_ROWS rows
// on, factored scales and offsets are multiplied out once for the call, in one pass over them
// (a sixteenth of the weights' count), and the tiles read the products; fewer rows (a decoding
// step) multiply them in the tiles, reading the weights' bytes as held. The same float32
// products either way.
constexpr int64_t FACTORED_ROWS = 16;

// out (sets, groups, 8) = the uint8 factors (sets, groups, 8) times their super-groups' values
// (sets, groups / per_super, 8, of scale type `type`), as FactoredInt4Format multiplies them.
void multiply_out(const void* factors, const void* supers, int type, float* out, int64_t sets, int64_t groups,
                  int64_t per_super, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < sets; p++)
        for (int64_t g = 0; g < groups; g++) {
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(factors) + (p * groups + g) * 8));
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
            _mm256_storeu_ps(out + (p * groups + g) * 8, _mm256_mul_ps(f, load8(supers, (p * (groups / per_super) + g / per_super) * 8, type)));
        }
}

// Outputs (m0 .. m0 + MR - 1) of the sets of pairs, for weights in format F.
template <int MR, int NZ, typename F, typename Y>
void integer_tile(const Activations& a, const F& format, const void* codes, Y* y, int64_t n, int64_t k, int64_t m0,
                  const SetPairs<NZ>& pairs, bool prefetch_next) {
    constexpr int64_t BLOCK_BYTES = F::BLOCK_BYTES;
    const int64_t blocks = k / BLOCK, set_bytes = blocks * BLOCK_BYTES;
    const char* w = static_cast<const char*>(codes);
    const char* end = w + n / 8 * set_bytes;
    Floats16 acc[MR][NZ];
    for (int r = 0; r < MR; r++)
        for (int z = 0; z < NZ; z++) acc[r][z] = Floats16::zero();
    typename F::Kept kept[NZ];
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * BLOCK_BYTES;
        if (prefetch_next)
            for (int z = 0; z < NZ; z++) {
                prefetch_ahead(w + pairs.first[z] * set_bytes + at, BLOCK_BYTES, end);
                prefetch_ahead(w + pairs.second[z] * set_bytes + at, BLOCK_BYTES, end);
            }
        typename F::Sum isum[MR][NZ];
        for (int r = 0; r < MR; r++) {
            const typename F::Sum start = F::start(a.sums[(m0 + r) * blocks + b]);
            for (int z = 0; z < NZ; z++) isum[r][z] = start;
        }
        for (int c = 0; c < F::RUNS; c++) {
            typename F::Run run[NZ];
            const int64_t run_at = at + F::RUN_BYTES * c;
            for (int z = 0; z < NZ; z++)
                run[z] = format.load(w + pairs.first[z] * set_bytes + run_at, w + pairs.second[z] * set_bytes + run_at,
                                     pairs.first[z], pairs.second[z], b, c);
            for (int r = 0; r < MR; r++) {
                const typename F::Inputs x = format.inputs(a.codes + (m0 + r) * k + b * BLOCK, m0 + r, b, c);
                for (int z = 0; z < NZ; z++) isum[r][z] = F::dot(isum[r][z], run[z], x);
            }
        }
        for (int z = 0; z < NZ; z++) {
            const typename F::Scales s = format.scales_of(pairs.first[z], pairs.second[z], b, kept[z]);
            for (int r = 0; r < MR; r++) {
                const int64_t ab = (m0 + r) * blocks + b;
                acc[r][z] = F::add(acc[r][z], isum[r][z], s, a.scales[ab], a.sums[ab]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int z = 0; z < NZ; z++) store16(y + (m0 + r) * n, pairs.first[z], pairs.second[z], acc[r][z]);
}

// Runs tile<R, NZ>(m, pairs, prefetch?) over the rows and the sets [begin, end) read as 2 NZ
// streams: the band cut into 2 NZ runs of sets, a tile taking one set of each run, the next tile
// the next sets. Each stream runs forward through memory, which keeps the prefetchers (and ours)
// ahead of it; adjacent sets paired would jump back at every pair. The sets left over (fewer
// than 2 NZ) go in pairs of their own.
template <int MR, int NZ, typename Tile> void in_streams(int64_t rows, int64_t begin, int64_t end, const Tile& tile) {
    const int64_t length = (end - begin) / (2 * NZ), rest = begin + 2 * NZ * length;
    over_chunks<MR>(rows, [&]<int R>(int64_t m, int64_t i, bool first) {
        SetPairs<NZ> pairs;
        for (int z = 0; z < NZ; z++) pairs.first[z] = begin + 2 * z * length + i, pairs.second[z] = pairs.first[z] + length;
        tile.template operator()<R, NZ>(m, pairs, first);
    }, 0, length, 1);
    over_chunks<MR>(rows, [&]<int R>(int64_t m, int64_t p, bool first) {
        tile.template operator()<R, 1>(m, SetPairs<1>{{p}, {std::min(p + 1, end - 1)}}, first);
    }, rest, end, 2);
}

// Every row and set, threads taking bands of sets. A few rows (a decoding step) are bound by
// memory, and read two streams per thread; more are bound by arithmetic, and take NZ pairs
// per tile, for more accumulators.
template <int MR, typename Tile> void over_sets(int64_t rows, int64_t n, int threads, const Tile& tile) {
    for_row_bands(n / 8, threads, [&](int64_t begin, int64_t end) {
        if (rows < MR)
            in_streams<MR, 1>(rows, begin, end, tile);
        else
            in_streams<MR, INT_NZ>(rows, begin, end, tile);
    }, 2 * INT_NZ);
}

// y = x W^T for integer weights in format F, y of float type y_type.
template <typename F>
void integer_linear(const Activations& a, const F& format, const void* codes, void* y, int64_t rows, int64_t n,
                    int64_t k, int y_type, int threads) {
    as_float_type(y, y_type, [&]<typename Y>(const Y*) {
        over_sets<INT_MR>(rows, n, threads, [&]<int R, int NZ>(int64_t m, const SetPairs<NZ>& pairs, bool first) {
            integer_tile<R, NZ>(a, format, codes, static_cast<Y*>(y), n, k, m, pairs, first);
        });
    });
}

}  // namespace

extern "C" int vector_kernels_available() { return 1; }

extern "C" void linear_dense(const void* x, const void* w, void* y, int64_t rows, int64_t n, int64_t k, int x_type,
                             int w_type, int threads) {
    as_float_type(x, x_type, [&]<typename T>(const T* xt) {
        as_float_type(w, w_type, [&](const auto* wt) { dense(xt, wt, static_cast<T*>(y), rows, n, k, threads); });
    });
}

extern "C" void linear_panels(const void* x, const void* panels, void* y, int64_t rows, int64_t n, int64_t k,
                              int x_type, int w_type, int threads) {
    as_float_type(x, x_type, [&]<typename T>(const T* xt) {
        T* yt = static_cast<T*>(y);
        if (k == 0) {
            for (int64_t i = 0; i < rows * n; i++) store1(yt + i, 0.0f);
            return;
        }
        as_float_type(panels, w_type, [&](const auto* wt) {
            if (rows <= PANEL_STREAMED)
                panels_streamed(xt, wt, yt, rows, n, k, threads);
            else
                panels_in_chunks(xt, wt, yt, rows, n, k, threads);
        });
    });
}

extern "C" void quantize_activations(const void* x, int x_type, int8_t* xq, float* xd, int32_t* xsum, int64_t rows,
                                     int64_t k, int64_t block, int threads) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    // vpackssdw/vpacksswb interleave the two 128-bit lanes; this puts the 32 bytes back in order.
    const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int64_t blocks = rows * k / block;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t first = i * block;
        __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
        for (int64_t j = 0; j < block; j += 8) {
            const __m256 part = load8(x, first + j, x_type);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, part));  // max drops a NaN: counted apart
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(part, part, _CMP_UNORD_Q));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float absmax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        // A NaN or an infinity makes the whole block NaN, as the definition's arithmetic does
        // (quantized_activations: inf * 0 and NaN * anything); its codes are then zeros, and its
        // scale, NaN, carries NaN to every output.
        const bool finite = _mm256_movemask_ps(unordered) == 0 && absmax <= FLT_MAX;
        const __m256 inverse = _mm256_set1_ps(finite && absmax > 0.0f ? 127.0f / absmax : 0.0f);
        xd[i] = finite ? absmax / 127.0f : NAN;
        for (int64_t b = first; b < first + block; b += BLOCK) {
            __m256i code[4];
            for (int j = 0; j < 4; j++) code[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, b + 8 * j, x_type), inverse));  // nearest, ties to even
            if (!finite)
                for (int j = 0; j < 4; j++) code[j] = _mm256_setzero_si256();
            xsum[b / BLOCK] = hsum(_mm256_add_epi32(_mm256_add_epi32(code[0], code[1]), _mm256_add_epi32(code[2], code[3])));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(code[0], code[1]), _mm256_packs_epi32(code[2], code[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b), _mm256_permutevar8x32_epi32(bytes, lane_order));
        }
    }
}

extern "C" void linear_int8(const int8_t* xq, const float* xd, const int32_t* xsum, const int8_t* codes,
                            const void* scales, void* y, int64_t rows, int64_t n, int64_t k, int scales_type,
                            int y_type, int threads) {
    integer_linear({xq, xd, xsum}, Int8Format{scales, scales_type, k / BLOCK}, codes, y, rows, n, k, y_type, threads);
}

extern "C" void linear_int4(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* codes,
                            const void* scales, const void* offsets, const void* super_scales,
                            const void* super_offsets, int64_t super_group, void* y, int64_t rows, int64_t n,
                            int64_t k, int64_t group, int scales_type, int y_type, int threads) {
    const Int4Format format{scales, offsets, scales_type, k / group, group / BLOCK};
    if (!offsets) {
        integer_linear({xq, xd, xsum}, SymmetricInt4Format{format}, codes, y, rows, n, k, y_type, threads);
    } else if (!super_scales) {
        integer_linear({xq, xd, xsum}, format, codes, y, rows, n, k, y_type, threads);
    } else if (rows < FACTORED_ROWS) {
        integer_linear({xq, xd, xsum}, FactoredInt4Format{format, super_scales, super_offsets, k / super_group, super_group / group},
                       codes, y, rows, n, k, y_type, threads);
    } else {
        thread_local std::vector<float> products;  // the largest matrix's, kept: 1/16 of its weights' count
        const int64_t sets = n / 8, groups = k / group, count = sets * groups * 8;
        products.resize(2 * count);
        multiply_out(scales, super_scales, scales_type, products.data(), sets, groups, super_group / group, threads);
        multiply_out(offsets, super_offsets, scales_type, products.data() + count, sets, groups, super_group / group, threads);
        integer_linear({xq, xd, xsum}, Int4Format{products.data(), products.data() + count, F32, groups, group / BLOCK},
                       codes, y, rows, n, k, y_type, threads);
    }
}

// A prompt's product for weights whose codes the tiles would unpack (Q8_0's rows): each thread
// widens its sets a few at a time into bytes and float32 scales (about WIDE_BYTES, which stay in
// cache: widen(from, count, codes, floats)), and every row's tiles read those as int8's read
// theirs (tile<R, NZ>(row, pairs, codes, floats, y of the sets)): the unpacking and the scales'
// products are done once per call, not once per tile of rows. A widened set takes 8 bytes and
// half a float per input.
constexpr int64_t WIDE_BYTES = 1 << 19;

template <int MR, typename Y, typename Widen, typename Tile>
void widened(Y* y, int64_t rows, int64_t n, int64_t k, int threads, const Widen& widen, const Tile& tile) {
    const int64_t count = std::max<int64_t>(2 * INT_NZ, WIDE_BYTES / (10 * k) / 2 * 2);
    for_row_bands(n / 8, threads, [&](int64_t begin, int64_t end) {
        thread_local std::vector<uint8_t> codes;
        thread_local std::vector<float> floats;
        const int64_t most = std::min(count, end - begin);  // a small matrix's band is all it needs
        codes.resize(std::max<size_t>(codes.size(), most * 8 * k)), floats.resize(std::max<size_t>(floats.size(), most * k / 2));
        for (int64_t from = begin; from < end; from += count) {
            const int64_t sets = std::min(count, end - from);
            widen(from, sets, codes.data(), floats.data());
            in_streams<MR, INT_NZ>(rows, 0, sets, [&]<int R, int NZ>(int64_t m, const SetPairs<NZ>& pairs, bool) {
                tile.template operator()<R, NZ>(m, pairs, codes.data(), floats.data(), y + 8 * from);
            });
        }
    }, 2 * INT_NZ);
}

// --- Q8_0 blocks where a GGUF file maps them -----------------------------------------------------
//
// Loading would otherwise write the whole matrix once more into memory the process has never
// touched, which takes longer than mapping the file. Row i is the file's: k / 32 blocks of 34
// bytes, a float16 scale and 32 int8 codes. A decoding step reads a set of eight rows in place:
// each row's block meets the activations' 32 codes in one product, the eight rows' sums are
// gathered into the eight lanes int8's set would hold, and the block's scales follow as
// int8_block adds them. The same exact sums and float32 steps as linear_int8 on the same codes
// and scales, so the same bits; a prompt widens its sets into int8's layout and runs int8's tiles.

constexpr int64_t Q8_0_BYTES = 34;  // a block: its float16 scale, then 32 codes

// A row's block of 32 codes, loaded once for every row of x it meets (Q8_0Codes), times the
// activations' 32 (x): eight int32 sums of four products, as int8's runs are multiplied
// (int8_dot): with VNNI, q + 128 (unsigned) times x, which adds 128 times the activations' sum
// (Q8_0_START takes it away); without, |q| times x with q's sign. Exact either way.
#ifdef SIMD_WIDE
struct Q8_0Codes {
    __m256i unsigned_q;
    explicit Q8_0Codes(const uint8_t* codes)
        : unsigned_q(_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)), _mm256_set1_epi8(static_cast<char>(0x80)))) {}
    __m256i times(__m256i x) const { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned_q, x); }
};
constexpr int32_t Q8_0_START = -128;
#else
struct Q8_0Codes {
    __m256i q, magnitude;
    explicit Q8_0Codes(const uint8_t* codes)
        : q(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))), magnitude(_mm256_sign_epi8(q, q)) {}
    __m256i times(__m256i x) const {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1));
    }
};
constexpr int32_t Q8_0_START = 0;
#endif

// The exact sums of block b of the eight rows from `set` with each of R rows of activations (x):
// sums[r] lane j, row j's with x[r]. Each row's codes are loaded once for all R, and the rows'
// products gathered pairwise by vphaddd as soon as they are made, so that few stay in registers.
template <int R>
inline void q8_0_block_sums(const uint8_t* set, int64_t row_bytes, int64_t b, const __m256i x[R], __m256i sums[R]) {
    __m256i quad[2][R];
    for (int g = 0; g < 2; g++) {  // rows 4g .. 4g + 3
        __m256i pair[2][R];
        for (int h = 0; h < 2; h++) {  // rows 4g + 2h, 4g + 2h + 1
            const Q8_0Codes first(set + (4 * g + 2 * h) * row_bytes + b * Q8_0_BYTES + 2);
            const Q8_0Codes second(set + (4 * g + 2 * h + 1) * row_bytes + b * Q8_0_BYTES + 2);
            for (int r = 0; r < R; r++) pair[h][r] = _mm256_hadd_epi32(first.times(x[r]), second.times(x[r]));
        }
        for (int r = 0; r < R; r++) quad[g][r] = _mm256_hadd_epi32(pair[0][r], pair[1][r]);
    }
    for (int r = 0; r < R; r++)  // quad[g]: its rows' sums of lanes 0-3, then of lanes 4-7
        sums[r] = _mm256_add_epi32(_mm256_permute2x128_si256(quad[0][r], quad[1][r], 0x20),
                                   _mm256_permute2x128_si256(quad[0][r], quad[1][r], 0x31));
}

// The float16 scales of block b of the eight rows from `set`, `row_bytes` apart, as float32.
inline __m256 q8_0_scales(const uint8_t* set, int64_t row_bytes, int64_t b) {
    alignas(16) uint16_t half[8];
    for (int j = 0; j < 8; j++) std::memcpy(half + j, set + j * row_bytes + b * Q8_0_BYTES, 2);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(half)));
}

// Outputs (m0 .. m0 + R - 1) of set p, read in place; the next set's bytes (`next`, or null) are
// fetched a block's share at a time, in file order, into the second-level cache.
template <int R, typename Y>
void q8_0_tile(const Activations& a, const uint8_t* w, Y* y, int64_t n, int64_t k, int64_t m0, int64_t p, bool fetch_next) {
    const int64_t blocks = k / BLOCK, row_bytes = blocks * Q8_0_BYTES;
    const uint8_t* set = w + p * 8 * row_bytes;
    const int64_t share = (8 * row_bytes / blocks + 63) / 64 * 64;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (fetch_next)
            for (int64_t line = 0; line < share; line += 64) _mm_prefetch(reinterpret_cast<const char*>(set + 8 * row_bytes + b * share + line), _MM_HINT_T1);
        const __m256 scales = q8_0_scales(set, row_bytes, b);
        __m256i x[R], sums[R];
        for (int r = 0; r < R; r++) x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.codes + ((m0 + r) * blocks + b) * BLOCK));
        q8_0_block_sums<R>(set, row_bytes, b, x, sums);
        for (int r = 0; r < R; r++) {
            const int64_t ab = (m0 + r) * blocks + b;
            const __m256i exact = _mm256_add_epi32(sums[r], _mm256_set1_epi32(Q8_0_START * a.sums[ab]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(scales, _mm256_set1_ps(a.scales[ab])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store8(y + (m0 + r) * n + 8 * p, acc[r]);
}

// Sets [from, from + count) of Q8_0 rows widened into int8's layout (kernels.h) and float32 scales
// (sets, k / 32, 8): each row's four codes of run c to bytes 4j .. 4j + 3 of the run.
void widen_q8_0(const uint8_t* w, int64_t from, int64_t count, int64_t k, uint8_t* codes, float* scales) {
    const int64_t blocks = k / BLOCK, row_bytes = blocks * Q8_0_BYTES;
    for (int64_t p = 0; p < count; p++) {
        const uint8_t* set = w + (from + p) * 8 * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t* to = codes + (p * blocks + b) * 256;
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 8; c++) std::memcpy(to + 32 * c + 4 * j, set + j * row_bytes + b * Q8_0_BYTES + 2 + 4 * c, 4);
            _mm256_storeu_ps(scales + (p * blocks + b) * 8, q8_0_scales(set, row_bytes, b));
        }
    }
}

extern "C" void linear_q8_0(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* blocks, void* y,
                            int64_t rows, int64_t n, int64_t k, int y_type, int threads) {
    const Activations a{xq, xd, xsum};
    as_float_type(y, y_type, [&]<typename Y>(const Y*) {
        Y* out = static_cast<Y*>(y);
        if (rows < FACTORED_ROWS) {  // a decoding step: each thread reads its band of sets in file order
            for_row_bands(n / 8, threads, [&](int64_t begin, int64_t end) {
                for (int64_t p = begin; p < end; p++)
                    by_row_tiles<INT_MR>(0, rows, [&]<int R>(int64_t m) { q8_0_tile<R>(a, blocks, out, n, k, m, p, m == 0 && p + 1 < end); });
            }, 1);
            return;
        }
        widened<INT_MR>(out, rows, n, k, threads, [&](int64_t from, int64_t sets, uint8_t* wide, float* floats) {
            widen_q8_0(blocks, from, sets, k, wide, floats);
        }, [&]<int R, int NZ>(int64_t m, const SetPairs<NZ>& pairs, const uint8_t* wide, const float* floats, Y* y_sets) {
            integer_tile<R, NZ>(a, Int8Format{floats, F32, k / BLOCK}, wide, y_sets, n, k, m, pairs, false);
        });
    });
}

#else  // no AVX2: nothing here runs; the Python side keeps the layers' own code.

extern "C" int vector_kernels_available() { return 0; }
extern "C" void linear_dense(const void*, const void*, void*, int64_t, int64_t, int64_t, int, int, int) {}
extern "C" void linear_panels(const void*, const void*, void*, int64_t, int64_t, int64_t, int, int, int) {}
extern "C" void quantize_activations(const void*, int, int8_t*, float*, int32_t*, int64_t, int64_t, int64_t, int) {}
extern "C" void linear_int8(const int8_t*, const float*, const int32_t*, const int8_t*, const void*, void*, int64_t,
                            int64_t, int64_t, int, int, int) {}
extern "C" void linear_int4(const int8_t*, const float*, const int32_t*, const uint8_t*, const void*, const void*,
                            const void*, const void*, int64_t, void*, int64_t, int64_t, int64_t, int64_t, int, int, int) {}
extern "C" void linear_q8_0(const int8_t*, const float*, const int32_t*, const uint8_t*, void*, int64_t, int64_t, int64_t, int,
                            int) {}

#endif
