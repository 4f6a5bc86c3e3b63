// The C ABI between the kernels (rms_norm.cpp, plain C++ without torch) and the torch
// operator that calls them (rms_norm_op.cpp). Included by both, so the compiler checks
// that the two sides agree.
#pragma once
#include <cstdint>

// X(name, input dtype, weight dtype) for each pair with a kernel, dtypes as at::k<dtype>
// names them. The output has the weight's dtype: Meta's type promotion of the two, for
// every pair listed.
#define RMS_NORM_DTYPES(X)                  \
    X(float32_float32, Float, Float)        \
    X(float64_float64, Double, Double)      \
    X(bfloat16_bfloat16, BFloat16, BFloat16) \
    X(float16_float16, Half, Half)          \
    X(bfloat16_float32, BFloat16, Float)    \
    X(float16_float32, Half, Float)

// Rows of contiguous memory: x, y, dy and dx are (rows, dim); w and dw are (dim); rstd is
// (rows) of float32 (float64 for float64 input). The statistic reads the first n_rms
// elements of each row; lanes is the vector width of its sum (see sum_squares).
#define RMS_NORM_DECLARE(NAME, X_DTYPE, W_DTYPE)                                                  \
    extern "C" void rms_norm_fwd_##NAME(const void* x, const void* w, void* y, void* rstd,        \
                                        int64_t rows, int64_t dim, int64_t n_rms, double eps,     \
                                        int lanes, int threads);                                  \
    extern "C" void rms_norm_bwd_##NAME(const void* dy, const void* x, const void* w,            \
                                        const void* rstd, void* dx, void* dw, int64_t rows,       \
                                        int64_t dim, int64_t n_rms, int threads);

RMS_NORM_DTYPES(RMS_NORM_DECLARE)
