// Fused RMSNorm for CPU: one pass over memory forward, one pass backward.
//
// Meta's eager RMSNorm runs a kernel per operation (float, pow, mean, add, rsqrt, mul,
// type_as, mul), each reading and writing the whole activation. Here each row is read
// once into cache, its statistic computed in float32 (float64 for float64 inputs), and
// the output written once.
//
// The forward pass gives Meta's result bit for bit on the CPU it was built for: it sums
// the squares in the order torch's CPU sum kernel does (see sum_squares), and rounds
// where Meta's code rounds: x * rstd to the input dtype (type_as), then the product with
// the weight to the output dtype. Built with -ffp-contract=off so that no multiply-add is
// fused behind our back: torch rounds x*x before adding it.
//
// Plain C++ over raw pointers behind a C ABI (rms_norm.h), without torch: the arithmetic
// reads on its own, and rms_norm_op.cpp makes it a torch operator. OpenMP threads come
// from the libgomp torch already loaded, so there is one thread pool.
//
// Backward, with g = dy * w, r = rstd and k = n_rms (the partial-RMSNorm prefix):
//   dx_j = r * g_j - [j < k] * x_j * r^3 / k * sum_i g_i x_i
//   dw_j = sum over rows of dy_j * round(x_j * r)
// dw is accumulated per thread in blocks of rows (float32 sums of 32 rows, then of the
// blocks), which keeps its rounding error near that of torch's cascade sums.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "bf16.h"
#include "rms_norm.h"

namespace {

struct bf16 {
    uint16_t bits;
};
using f16 = _Float16;

// Storage type <-> compute type. bf16 rounds to nearest even, NaN stays NaN, as torch does.
template <typename T> struct io {
    static T load(T v) { return v; }
    template <typename A> static T store(A v) { return static_cast<T>(v); }
};
template <> struct io<f16> {
    static float load(f16 v) { return static_cast<float>(v); }
    static f16 store(float v) { return static_cast<f16>(v); }
};
template <> struct io<bf16> {
    static float load(bf16 v) { return bf16_to_float(v.bits); }
    static bf16 store(float f) { return bf16{float_to_bf16(f)}; }
};

template <typename T> using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T> inline acc_t<T> square(const T* x, int64_t i) {
    acc_t<T> v = io<T>::load(x[i]);
    return v * v;
}

// --- Writing large outputs ----------------------------------------------------------------
//
// An output larger than the caches is written with non-temporal (streaming) stores: a
// plain store first reads the line it writes into cache, a third stream of memory traffic
// beside the read of x and the write of y. But a fresh allocation that large is a fresh
// mapping from the OS, whose pages fault on first touch and are zeroed by the kernel, and
// streaming into such pages is slower than plain stores. So each thread first maps its part
// of the output in one call (MADV_POPULATE_WRITE, Linux 5.14+), which costs less than the
// page faults, then streams; where that call fails (an older kernel) it stores plainly.
// Rows are computed into a buffer in L1 and copied out unchanged, so results never depend
// on any of this.
//
// Streaming pays only for outputs well past the last-level cache; below the threshold it
// loses to plain stores (measurements in docs/norm_speed.md). Elsewhere (not x86, not
// Linux) outputs are written with plain stores.
constexpr int64_t LARGE_OUTPUT_BYTES = int64_t(32) << 20;
#if defined(__SSE2__) && defined(__linux__)
constexpr bool CAN_STREAM = true;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

uintptr_t page_start(const void* p) {
    return reinterpret_cast<uintptr_t>(p) & ~(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)) - 1);
}

bool page_mapped(const void* p) {
    unsigned char in_core = 0;
    return mincore(reinterpret_cast<void*>(page_start(p)), 1, &in_core) == 0 && (in_core & 1);
}

// Whether [p, p + n) is mapped (its first and last pages say so) or could be mapped now.
bool map_pages(void* p, int64_t n) {
    if (n <= 0) return false;
    const char* last = static_cast<char*>(p) + n - 1;
    if (page_mapped(p) && page_mapped(last)) return true;
    const uintptr_t begin = page_start(p), size = reinterpret_cast<uintptr_t>(last) + 1 - begin;
    return madvise(reinterpret_cast<void*>(begin), size, MADV_POPULATE_WRITE) == 0;
}

void stream_bytes(char* dst, const char* src, int64_t n) {
#if defined(__AVX512F__)
    using V = __m512i;
#elif defined(__AVX__)
    using V = __m256i;
#else
    using V = __m128i;
#endif
    constexpr int64_t W = sizeof(V);
    const int64_t head = std::min<int64_t>(n, (W - reinterpret_cast<uintptr_t>(dst) % W) % W);
    std::memcpy(dst, src, head);
    int64_t i = head;
    for (; i + W <= n; i += W) {
        V v;
        std::memcpy(&v, src + i, W);
#if defined(__AVX512F__)
        _mm512_stream_si512(reinterpret_cast<V*>(dst + i), v);
#elif defined(__AVX__)
        _mm256_stream_si256(reinterpret_cast<V*>(dst + i), v);
#else
        _mm_stream_si128(reinterpret_cast<V*>(dst + i), v);
#endif
    }
    std::memcpy(dst + i, src + i, n - i);
}
#else
constexpr bool CAN_STREAM = false;
bool map_pages(void*, int64_t) { return false; }
void stream_bytes(char* dst, const char* src, int64_t n) { std::memcpy(dst, src, n); }
#endif

// One thread's rows [begin, end) of a (rows, dim) output: row(r) is where to compute row r,
// done(r) puts it in place.
template <typename O> class RowWriter {
  public:
    RowWriter(O* out, int64_t rows, int64_t dim, int64_t begin, int64_t end)
        : out_(out), dim_(dim),
          stream_(CAN_STREAM && rows * dim * int64_t(sizeof(O)) >= LARGE_OUTPUT_BYTES &&
                  map_pages(out + begin * dim, (end - begin) * dim * int64_t(sizeof(O)))),
          buffer_(stream_ ? dim : 0) {}
    ~RowWriter() {
#if defined(__SSE2__)
        if (stream_) _mm_sfence();  // streamed lines are visible before the caller reads y
#endif
    }
    O* row(int64_t r) { return stream_ ? buffer_.data() : out_ + r * dim_; }
    void done(int64_t r) {
        if (!stream_) return;
        stream_bytes(reinterpret_cast<char*>(out_ + r * dim_), reinterpret_cast<const char*>(buffer_.data()),
                     dim_ * int64_t(sizeof(O)));
    }

  private:
    O* out_;
    int64_t dim_;
    bool stream_;
    std::vector<O> buffer_;
};

// The calling thread's contiguous share [begin, end) of the rows, as static scheduling gives.
struct ThreadRows {
    int64_t begin, end, tid, threads;
};

ThreadRows thread_rows(int64_t rows) {
    int64_t tid = 0, threads = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    threads = omp_get_num_threads();
#endif
    const int64_t chunk = (rows + threads - 1) / threads;
    const int64_t begin = std::min(rows, tid * chunk);
    return {begin, std::min(rows, begin + chunk), tid, threads};
}

int64_t ceil_log2(int64_t n) {  // c10's CeilLog2: 1 for n <= 2
    int64_t p = 1;
    while ((int64_t(1) << p) < n) ++p;
    return p;
}

// sum(x[i]^2 for i < n) added in the order of torch's CPU cascade_sum for a contiguous
// row (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum ->
// multi_row_sum): L-lane vectors, four of them in flight, partial sums cascaded over four
// levels, then the scalar tail, then the lanes. L is torch's Vectorized width (16 floats
// with AVX-512, 8 with AVX2); rows shorter than a vector are summed with L = 1, as torch
// does. Any order would be as accurate; this one reproduces torch.mean exactly.
template <int L, typename T> acc_t<T> sum_squares(const T* x, int64_t n) {
    using A = acc_t<T>;
    constexpr int levels = 4, ilp = 4;
    const int64_t vectors = n / L, groups = vectors / ilp;
    const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / levels);
    const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
    A acc[levels][ilp][L] = {};
    int64_t i = 0;
    while (i + level_step <= groups) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ilp; ++k)
#pragma omp simd
                for (int l = 0; l < L; ++l) acc[0][k][l] += square(x, (i * ilp + k) * L + l);
        for (int j = 1; j < levels; ++j) {
            for (int k = 0; k < ilp; ++k)
                for (int l = 0; l < L; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < groups; ++i)
        for (int k = 0; k < ilp; ++k)
            for (int l = 0; l < L; ++l) acc[0][k][l] += square(x, (i * ilp + k) * L + l);
    for (int j = 1; j < levels; ++j)
        for (int k = 0; k < ilp; ++k)
            for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = groups * ilp; v < vectors; ++v)  // vectors left over from the groups
        for (int l = 0; l < L; ++l) acc[0][0][l] += square(x, v * L + l);
    for (int k = 1; k < ilp; ++k)
        for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
    A total = 0;
    for (int64_t e = vectors * L; e < n; ++e) total += square(x, e);  // the scalar tail
    for (int l = 0; l < L; ++l) total += acc[0][0][l];
    return total;
}

template <typename T> acc_t<T> sum_squares(const T* x, int64_t n, int lanes) {
    if (n < lanes) lanes = 1;
    switch (lanes) {
        case 16: return sum_squares<16>(x, n);
        case 8: return sum_squares<8>(x, n);
        case 4: return sum_squares<4>(x, n);
        case 2: return sum_squares<2>(x, n);
        default: return sum_squares<1>(x, n);
    }
}

// x: input dtype T; w: weight dtype W; y: output dtype O (Meta's type promotion of T and W).
template <typename T, typename W, typename O>
void forward(const T* x, const W* w, O* y, void* rstd_out, int64_t rows, int64_t dim,
             int64_t n_rms, double eps, int lanes, int threads) {
    using A = acc_t<T>;
    A* rstd = static_cast<A*>(rstd_out);
    const A eps_a = static_cast<A>(eps);
#pragma omp parallel num_threads(threads)
    {
        const ThreadRows mine = thread_rows(rows);
        RowWriter<O> out(y, rows, dim, mine.begin, mine.end);
        for (int64_t r = mine.begin; r < mine.end; ++r) {
            const T* xr = x + r * dim;
            O* yr = out.row(r);
            // Meta: torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps); torch's mean is sum / n.
            const A s = A(1) / std::sqrt(sum_squares(xr, n_rms, lanes) / static_cast<A>(n_rms) + eps_a);
            rstd[r] = s;
#pragma omp simd
            for (int64_t j = 0; j < dim; ++j) {
                A normed = io<T>::load(io<T>::store(io<T>::load(xr[j]) * s));  // Meta's type_as(x)
                yr[j] = io<O>::store(normed * static_cast<A>(io<W>::load(w[j])));
            }
            out.done(r);
        }
    }
}

constexpr int64_t DW_BLOCK = 32;  // rows summed before joining the thread's running dw

// dx and the row's dw contribution for elements [from, to) of one row.
template <bool IN_RMS, typename T, typename W, typename O, typename A>
inline void backward_span(const O* dy, const T* x, const W* w, T* dx, A* dw, A s, A c, int64_t from, int64_t to) {
#pragma omp simd
    for (int64_t j = from; j < to; ++j) {
        A xv = io<T>::load(x[j]);
        A dyv = io<O>::load(dy[j]);
        A d = s * (dyv * A(io<W>::load(w[j])));
        if constexpr (IN_RMS) d -= c * xv;
        dx[j] = io<T>::store(d);
        dw[j] += dyv * io<T>::load(io<T>::store(xv * s));
    }
}

template <typename T, typename W, typename O>
void backward(const O* dy, const T* x, const W* w, const void* rstd_in, T* dx, W* dw,
              int64_t rows, int64_t dim, int64_t n_rms, int threads) {
    using A = acc_t<T>;
    const A* rstd = static_cast<const A*>(rstd_in);
    std::vector<A> partial(static_cast<size_t>(threads) * 2 * dim);  // per thread: running dw, block dw
    int64_t used = 1;  // how many threads the runtime gave us
#pragma omp parallel num_threads(threads)
    {
        const ThreadRows mine = thread_rows(rows);
        RowWriter<T> out(dx, rows, dim, mine.begin, mine.end);
        if (mine.tid == 0) used = mine.threads;
        A* dw_total = partial.data() + mine.tid * 2 * dim;
        A* dw_block = dw_total + dim;
        std::fill(dw_total, dw_total + dim, A(0));
        for (int64_t b = mine.begin; b < mine.end; b += DW_BLOCK) {
            std::fill(dw_block, dw_block + dim, A(0));
            for (int64_t r = b; r < std::min(mine.end, b + DW_BLOCK); ++r) {
                const O* dyr = dy + r * dim;
                const T* xr = x + r * dim;
                T* dxr = out.row(r);
                const A s = rstd[r];
                A gx = 0;
#pragma omp simd reduction(+ : gx)
                for (int64_t j = 0; j < dim; ++j)
                    gx += A(io<O>::load(dyr[j])) * A(io<W>::load(w[j])) * A(io<T>::load(xr[j]));
                const A c = s * s * s * gx / static_cast<A>(n_rms);
                // Two loops rather than a test per element: only the prefix the RMS reads
                // gets the statistic's term.
                backward_span<true>(dyr, xr, w, dxr, dw_block, s, c, 0, n_rms);
                backward_span<false>(dyr, xr, w, dxr, dw_block, s, c, n_rms, dim);
                out.done(r);
            }
#pragma omp simd
            for (int64_t j = 0; j < dim; ++j) dw_total[j] += dw_block[j];
        }
    }
    // After the join (the only synchronisation): the threads' sums, in thread order.
    for (int64_t j = 0; j < dim; ++j) {
        A total = 0;
        for (int64_t t = 0; t < used; ++t) total += partial[t * 2 * dim + j];
        dw[j] = io<W>::store(total);
    }
}

}  // namespace

// One exported pair per dtype pair of rms_norm.h.
namespace storage {  // at::k<dtype> name -> the type the kernels read and write
using Float = float;
using Double = double;
using BFloat16 = bf16;
using Half = f16;
}  // namespace storage

#define RMS_NORM_DEFINE(NAME, X_DTYPE, W_DTYPE)                                                    \
    extern "C" void rms_norm_fwd_##NAME(const void* x, const void* w, void* y, void* rstd,        \
                                        int64_t rows, int64_t dim, int64_t n_rms, double eps,     \
                                        int lanes, int threads) {                                 \
        using T = storage::X_DTYPE;                                                               \
        using W = storage::W_DTYPE;                                                               \
        forward<T, W, W>(static_cast<const T*>(x), static_cast<const W*>(w), static_cast<W*>(y),  \
                         rstd, rows, dim, n_rms, eps, lanes, threads);                            \
    }                                                                                             \
    extern "C" void rms_norm_bwd_##NAME(const void* dy, const void* x, const void* w,            \
                                        const void* rstd, void* dx, void* dw, int64_t rows,       \
                                        int64_t dim, int64_t n_rms, int threads) {                \
        using T = storage::X_DTYPE;                                                               \
        using W = storage::W_DTYPE;                                                               \
        backward<T, W, W>(static_cast<const W*>(dy), static_cast<const T*>(x),                    \
                          static_cast<const W*>(w), rstd, static_cast<T*>(dx),                    \
                          static_cast<W*>(dw), rows, dim, n_rms, threads);                        \
    }

RMS_NORM_DTYPES(RMS_NORM_DEFINE)
