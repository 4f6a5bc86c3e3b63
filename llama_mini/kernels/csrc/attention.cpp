// Causal attention over a KV cache on the CPU, in one call: RoPE on the new positions, their
// keys and values written into the cache, and each query attending to every position up to its
// own.
//
// A decoding step's attention is a few microseconds of work, for which eager torch runs some
// thirty operations and SDPA's kernel alone spends a hundred or more on bf16 tensors of a CPU.
// A prompt's is a small share of its time beside the linear layers. Each query is computed
// alone, in one order that depends only on its position (attend_group): a prompt read in one
// call or in pieces, or decoded token by token, gets the same numbers, bit for bit. Queries that
// read one key/value head are computed together, each key and value row read once for all.
// Rotation and rounding as model.py's; attention in float32, as SDPA computes it, the output
// rounded once to the input dtype. The cache may be held in another float type (KVCache's
// dtype, float16 for a long context): keys and values are stored rounded to it, as
// KVCache.update stores them, and read back exactly.
//
// Plain C++ over raw pointers behind a C ABI (kernels.h), without torch; attention_op.cpp makes
// the torch operator. x86-64 with AVX2 and FMA only; elsewhere the entry point is empty.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace simd;

// The sums of eight vectors, as the eight lanes of one.
__m256 hsum8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Queries computed together: those that read one key/value head (the heads of a GQA group, or
// successive positions of one head), so that each key and value row is read once for all.
constexpr int GROUP = 4;
constexpr int64_t MAX_HEAD_DIM = 256;  // Gemma's; Llama's are 64 and 128, llama2.c's 48 and 64
// Chunks of sixteen outputs a pass over the value rows adds up: all of them with 32 registers
// (a row is read once); one with 16, which hold a chunk's sums for the four queries.
#ifdef SIMD_WIDE
constexpr int64_t PV_CHUNKS = MAX_HEAD_DIM / 16;
#else
constexpr int64_t PV_CHUNKS = 1;
#endif


struct Query {
    const float* q;  // rotated, times 1 / sqrt(head_dim)
    int64_t positions;  // it attends to positions 0 .. positions - 1
    float* scores;  // room for positions rounded up to 8
};

// A head size: D where the compiler knows it (FIXED, the common sizes, whose loops it unrolls),
// else d, any multiple of 8 up to MAX_HEAD_DIM. Both run the same code in the same order.
template <int FIXED> struct HeadSize {
    static constexpr int64_t MAX_CHUNKS = FIXED ? (FIXED + 15) / 16 : MAX_HEAD_DIM / 16;
    int64_t d;
    int64_t dim() const { return FIXED ? FIXED : d; }
    int64_t chunks() const { return (dim() + 15) / 16; }
};

// Chunk c of sixteen lanes of a row of a key or value head; a last chunk of 8 is half filled, with zeros.
template <int FIXED, typename T> Floats16 load_chunk(HeadSize<FIXED> size, const T* p, int64_t c) {
    return 16 * c + 16 <= size.dim() ? Floats16::load(p + 16 * c) : Floats16::join(load8(p + 16 * c), _mm256_setzero_ps());
}

// A row of a key or value head as sixteen-lane chunks.
template <int FIXED, typename T> void load_row(HeadSize<FIXED> size, const T* p, Floats16* chunks) {
    for (int64_t c = 0; c < size.chunks(); c++) chunks[c] = load_chunk(size, p, c);
}

// The G queries of `group` (positions ascending), each computed as it would be alone: a score
// is its key row times q in sixteen lanes, folded to eight and summed pairwise (hsum8, eight
// positions at a time); the softmax in float32 with exp8 (a NaN score makes every weight NaN,
// as softmax does); the output sums each position's value row times its weight in order, then
// divides by the weights' sum, rounded once to T. Keys and values of type Cache, the cache's.
template <int G, int FIXED, typename T, typename Cache>
void attend_group(HeadSize<FIXED> size, const Query* group, const Cache* k, const Cache* v, T* const* out) {
    constexpr int64_t MC = HeadSize<FIXED>::MAX_CHUNKS;
    const int64_t D = size.dim(), C = size.chunks(), most = group[G - 1].positions;
    Floats16 q[G][MC];
    for (int g = 0; g < G; g++) load_row(size, group[g].q, q[g]);
    for (int64_t s0 = 0; s0 < most; s0 += 8) {  // eight positions at a time
        __m256 folded[G][8];
        for (int t = 0; t < 8; t++) {
            // Each chunk of the key row, loaded once, meets every query's lanes. A query past
            // its own positions gets a score too, which the padding below overwrites.
            Floats16 acc[G], chunk[MC];
            for (int g = 0; g < G; g++) acc[g] = Floats16::zero();
            if (s0 + t < most) {
                load_row(size, k + (s0 + t) * D, chunk);
                for (int64_t c = 0; c < C; c++)
                    for (int g = 0; g < G; g++) acc[g] = fma(chunk[c], q[g][c], acc[g]);
            }
            for (int g = 0; g < G; g++) folded[g][t] = _mm256_add_ps(acc[g].low(), acc[g].high());
        }
        for (int g = 0; g < G; g++)
            if (s0 < group[g].positions) _mm256_storeu_ps(group[g].scores + s0, hsum8(folded[g]));
    }
    float inverse[G];
    for (int g = 0; g < G; g++) {
        const int64_t positions = group[g].positions, padded = (positions + 7) / 8 * 8;
        float* scores = group[g].scores;
        for (int64_t s = positions; s < padded; s++) scores[s] = -INFINITY;
        float highest = -INFINITY;
        bool nan = false;
        for (int64_t s = 0; s < positions; s++) highest = std::max(highest, scores[s]), nan |= std::isnan(scores[s]);
        const __m256 shift = _mm256_set1_ps(nan ? NAN : highest);  // std::max passes over a NaN
        __m256 total = _mm256_setzero_ps();
        for (int64_t s0 = 0; s0 < padded; s0 += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s0), shift));
            _mm256_storeu_ps(scores + s0, e);
            total = _mm256_add_ps(total, e);
        }
        inverse[g] = 1.0f / hsum(total);
    }
    // The output PV_CHUNKS chunks of sixteen at a time: each chunk of a value row, loaded once,
    // meets every query's weight for its position.
    constexpr int64_t CB = std::min<int64_t>(PV_CHUNKS, MC);
    Floats16 acc[G][MC];
    for (int64_t c0 = 0; c0 < C; c0 += CB) {
        const int64_t cb = std::min(CB, C - c0);
        Floats16 sums[G][CB];
        for (int g = 0; g < G; g++)
            for (int64_t c = 0; c < CB; c++) sums[g][c] = Floats16::zero();
        for (int64_t s = 0; s < most; s++) {
            Floats16 row[CB];
            if constexpr (CB == 1)
                row[0] = load_chunk(size, v + s * D, c0);
            else
                load_row(size, v + s * D, row);
            for (int g = 0; g < G; g++)
                if (s < group[g].positions) {
                    const Floats16 p = Floats16::all(group[g].scores[s]);
                    for (int64_t c = 0; c < cb; c++) sums[g][c] = fma(row[c], p, sums[g][c]);
                }
        }
        for (int g = 0; g < G; g++)
            for (int64_t c = 0; c < cb; c++) acc[g][c0 + c] = sums[g][c];
    }
    alignas(64) float result[MC * 16];
    for (int g = 0; g < G; g++) {
        for (int64_t c = 0; c < C; c++) {
            const Floats16 scaled = mul(acc[g][c], Floats16::all(inverse[g]));
            _mm256_store_ps(result + 16 * c, scaled.low());
            _mm256_store_ps(result + 16 * c + 8, scaled.high());
        }
        for (int64_t d = 0; d < D; d++) store1(out[g] + d, result[d]);
    }
}

// attend_group for the first `count` queries of group (1 <= count <= G).
template <int G = GROUP, int FIXED, typename T, typename Cache>
void attend_run(HeadSize<FIXED> size, int64_t count, const Query* group, const Cache* k, const Cache* v, T* const* out) {
    if constexpr (G > 1)
        if (count < G) return attend_run<G - 1>(size, count, group, k, v, out);
    attend_group<G>(size, group, k, v, out);
}

// x rotated as apply_rotary_emb does: y[j] = x[j] cos[j] + x[j ^ 1] sin[j], each product and
// the sum rounded to float32 (this file is built without FMA contraction), then to T.
template <typename T> void rotate(const T* x, T* y, const float* cos, const float* sin, int64_t head_dim) {
    for (int64_t j = 0; j < head_dim; j++) {
        const float a = load1(x + j) * cos[j], b = load1(x + (j ^ 1)) * sin[j];
        store1(y + j, a + b);
    }
}

// n values of type T stored as Cache: a copy where they are one type, else each rounded.
template <typename T, typename Cache> void store_as(const T* x, Cache* y, int64_t n) {
    if constexpr (std::is_same_v<T, Cache>)
        std::memcpy(y, x, n * sizeof(T));
    else
        for (int64_t j = 0; j < n; j++) store1(y + j, load1(x + j));
}

template <int FIXED, typename T, typename Cache>
void attend(HeadSize<FIXED> size, const T* q, const T* k, const T* v, Cache* k_cache, Cache* v_cache, T* out, const float* cos, const float* sin,
            int64_t batch, int64_t rows, int64_t heads, int64_t kv_heads, int64_t start, int64_t cache_batch_stride,
            int64_t cache_head_stride, int threads) {
    const int64_t D = size.dim();
    // The new positions' keys (rotated, rounded to T) and values into the cache, as
    // KVCache.update stores them.
    std::vector<T> rotated(D);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t from = ((b * rows + i) * kv_heads + g) * D;
                const int64_t at = b * cache_batch_stride + g * cache_head_stride + (start + i) * D;
                rotate(k + from, rotated.data(), cos + i * D, sin + i * D, D);
                store_as(rotated.data(), k_cache + at, D);
                store_as(v + from, v_cache + at, D);
            }
    // The queries of each key/value head, row by row, then head by head within its group, in
    // runs of GROUP: the work items, spread over the threads.
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t per_head = heads / kv_heads, queries = rows * per_head, runs = (queries + GROUP - 1) / GROUP;
    const int64_t items = batch * kv_heads * runs;
    const int workers = static_cast<int>(std::clamp<int64_t>(threads, 1, items));
#pragma omp parallel num_threads(workers)
    {
        std::vector<float> q_float(GROUP * D), scores(GROUP * ((start + rows + 7) / 8 * 8));
        std::vector<T> q_rotated(D);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t run = item % runs, g = item / runs % kv_heads, b = item / runs / kv_heads;
            const int64_t first = run * GROUP, count = std::min<int64_t>(GROUP, queries - first);
            Query group[GROUP];
            T* outs[GROUP];
            for (int64_t j = 0; j < count; j++) {
                const int64_t i = (first + j) / per_head, h = g * per_head + (first + j) % per_head;
                const int64_t row = (b * rows + i) * heads + h;
                rotate(q + row * D, q_rotated.data(), cos + i * D, sin + i * D, D);
                for (int64_t d = 0; d < D; d++) q_float[j * D + d] = load1(q_rotated.data() + d) * scale;
                group[j] = {q_float.data() + j * D, start + i + 1, scores.data() + j * (scores.size() / GROUP)};
                outs[j] = out + row * D;
            }
            const int64_t at = b * cache_batch_stride + g * cache_head_stride;
            attend_run(size, count, group, k_cache + at, v_cache + at, outs);
        }
    }
}

}  // namespace

extern "C" void attention(const void* q, const void* k, const void* v, void* k_cache, void* v_cache, void* out,
                          const float* cos, const float* sin, int64_t batch, int64_t rows, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, int64_t start, int64_t cache_batch_stride,
                          int64_t cache_head_stride, int type, int cache_type, int threads) {
    const auto run_cached = [&]<int FIXED, typename T, typename Cache>(const T*, const Cache*) {
        attend(HeadSize<FIXED>{head_dim}, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
               static_cast<Cache*>(k_cache), static_cast<Cache*>(v_cache), static_cast<T*>(out), cos, sin, batch, rows, heads,
               kv_heads, start, cache_batch_stride, cache_head_stride, threads);
    };
    const auto run = [&]<int FIXED, typename T>(const T* of_type) {
        as_float_type(nullptr, cache_type,
                      [&](const auto* of_cache_type) { run_cached.template operator()<FIXED>(of_type, of_cache_type); });
    };
    const auto of_size = [&]<typename T>(const T* type) {
        switch (head_dim) {  // Llama's head sizes, unrolled; others (a multiple of 8, the op checks) as they come
            case 64: return run.template operator()<64>(type);
            case 128: return run.template operator()<128>(type);
            default: return run.template operator()<0>(type);
        }
    };
    as_float_type(nullptr, type, of_size);
}

#else  // no AVX2: nothing here runs (vector_kernels_available() says so).

extern "C" void attention(const void*, const void*, const void*, void*, void*, void*, const float*, const float*,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int) {}

#endif
