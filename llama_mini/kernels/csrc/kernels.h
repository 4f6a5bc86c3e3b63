// The C ABI of the CPU kernels but the norm's (rms_norm.h): every entry point of the plain C++
// kernels, without torch (linear.cpp: linear layers; attention.cpp: attention over a KV cache;
// swiglu.cpp: SwiGLU's gate; rope.cpp: RoPE for training), for the torch operators that call
// them (linear_op.cpp, attention_op.cpp, swiglu_op.cpp, rope_op.cpp). Included by both sides,
// so the compiler checks that they agree.
//
// Every linear kernel computes y (rows, n) = x (rows, k) W^T for any number of rows of x, in
// float32 arithmetic. Its float operands (x, y in x's type, dense weights, an integer layer's
// scales) are each float32, bfloat16 or float16: x_type, w_type, scales_type 0, 1 or 2.
#pragma once
#include <cstdint>

// Whether this build has the vector kernels (x86-64 with AVX2 and FMA); without them every
// entry point below does nothing and the Python side keeps the layers' own code.
extern "C" int vector_kernels_available();

// W dense, rows of inputs.
extern "C" void linear_dense(const void* x, const void* w, void* y, int64_t rows, int64_t n, int64_t k, int x_type,
                             int w_type, int threads);

// W held in panels of sixteen outputs, input-major: panels (n / 16, k, 16), panel p's input j
// of output q at panels[p][j][q] = W[16p + q, j]. Each output summed input after input, from
// zero, in float32 (linear.cpp).
extern "C" void linear_panels(const void* x, const void* panels, void* y, int64_t rows, int64_t n, int64_t k,
                              int x_type, int w_type, int threads);

// Activations for the integer kernels: each row of x cut into blocks of `block` inputs (32, as
// llama.cpp's Q8_0 does, or 256, its Q8_K for the K-quants that read in place), each block rounded
// to int8 with its own scale (absmax / 127). xq is (rows, k), xd (rows, k / block), and xsum the
// sums of each 32 codes, (rows, k / 32). k % block == 0.
extern "C" void quantize_activations(const void* x, int x_type, int8_t* xq, float* xd, int32_t* xsum, int64_t rows,
                                     int64_t k, int64_t block, int threads);

// W int8 with a scale per row and block of 32 inputs: W[i, j] = w[i, j] * scales[i, j / 32].
// n % 8 == 0: rows come in sets of eight, interleaved. For set p and block b, w[p, b] is 256
// bytes: eight runs c of 32 bytes, in which bytes 4j..4j+3 are inputs 4c..4c+3 of the block in
// row 8p + j. scales are (n / 8, k / 32, 8): the eight rows of a set side by side.
extern "C" void linear_int8(const int8_t* xq, const float* xd, const int32_t* xsum, const int8_t* w,
                            const void* scales, void* y, int64_t rows, int64_t n, int64_t k, int scales_type,
                            int y_type, int threads);

// W int4 in groups of `group` (a multiple of 32) along k: W[i, j] = q * scale + offset, the
// scale and offset of j's group. n % 8 == 0: rows come in sets of eight, interleaved. For set p
// and block b of 32 inputs, codes[p, b] is 128 bytes: four runs c of 32 bytes, in which bytes
// 4j..4j+3 belong to row 8p + j, byte 4j + u holding input 8c + u of the block in its low
// nibble and input 8c + 4 + u in its high nibble. scales and offsets are (n / 8, groups, 8):
// the eight rows of a set side by side. Factored (super_scales not null, llama.cpp's K-quants):
// scales and offsets are uint8 factors, and a group's scale is its factor times super_scales'
// value for its super-group of `super_group` inputs (offsets likewise), in float32;
// super_scales and super_offsets are (n / 8, k / super_group, 8), of scales_type. Symmetric
// (offsets null, llama.cpp's Q4_0): each group's offset is -8 times its scale.
extern "C" void linear_int4(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* codes,
                            const void* scales, const void* offsets, const void* super_scales,
                            const void* super_offsets, int64_t super_group, void* y, int64_t rows, int64_t n,
                            int64_t k, int64_t group, int scales_type, int y_type, int threads);

// W as a GGUF file holds Q8_0 (llama.cpp): row i is k / 32 blocks of 34 bytes, a float16 scale d
// and 32 int8 codes q, W[i, j] = d q, read where the file maps them. n % 8 == 0. The same
// integer sums and float32 steps as linear_int8 on those codes and scales, so the same bits.
extern "C" void linear_q8_0(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* blocks, void* y,
                            int64_t rows, int64_t n, int64_t k, int y_type, int threads);

// W as a GGUF file holds Q6_K or Q5_K (llama.cpp), read where the file maps them; xq and xd are
// activations in blocks of 256 (k_quants.cpp). Row i is k / 256 blocks. Q6_K's are 210 bytes and
// W[i, j] = d s (q - 32): 128 bytes of low four bits, 64 of high two bits, 16 int8 s (one per 16
// inputs), float16 d. Q5_K's are 176 bytes and W[i, j] = d sc q - dmin m: float16 d and dmin,
// 12 bytes of 6-bit sc and m (one each per 32 inputs), 32 bytes of fifth bits, 128 of low nibbles.
extern "C" void linear_q6_k(const int8_t* xq, const float* xd, const uint8_t* blocks, void* y, int64_t rows, int64_t n,
                            int64_t k, int y_type, int threads);
extern "C" void linear_q5_k(const int8_t* xq, const float* xd, const uint8_t* blocks, void* y, int64_t rows, int64_t n,
                            int64_t k, int y_type, int threads);

// Causal attention of `rows` new positions start .. start + rows - 1: q (batch, rows, heads,
// head_dim) and k, v (batch, rows, kv_heads, head_dim), contiguous; k is rotated and stored
// with v into the caches (batch, kv_heads, positions, head_dim), contiguous within a head,
// heads and batch rows at the strides given; each row of q is rotated and attends to positions
// 0 .. its own; out (batch, rows, heads, head_dim). Query head h reads key/value head
// h / (heads / kv_heads). The rotation of row i: x[j] cos[i, j] + x[j ^ 1] sin[i, j], cos and
// sin (rows, head_dim) (model.py's tables). q, k, v and out of one float type (type), the
// caches of any (cache_type); head_dim a multiple of 8 up to 256.
extern "C" void attention(const void* q, const void* k, const void* v, void* k_cache, void* v_cache, void* out,
                          const float* cos, const float* sin, int64_t batch, int64_t rows, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, int64_t start, int64_t cache_batch_stride,
                          int64_t cache_head_stride, int type, int cache_type, int threads);

// SwiGLU's gate: out = silu(a) * b for n elements of float type `type`, each element
// computed alike wherever it sits.
extern "C" void swiglu(const void* a, const void* b, void* out, int64_t n, int type, int threads);
// Its gradients: da, db from dout (each of n elements, a's dtype).
extern "C" void swiglu_backward(const void* a, const void* b, const void* dout, void* da, void* db, int64_t n, int type,
                                int threads);

// RoPE as model.py's apply_rotary_emb computes it, for training: x (rows, head_dim),
// row r at position (r / heads) % positions of cos and sin (positions, head_dim, float32);
// out[j] = x[j] cos[j] + x[j ^ 1] sin[j], or with backward, x being the output's gradient, the
// input's: x[j] cos[j] + x[j ^ 1] sin[j ^ 1]. x of float type `type`; head_dim % 8 == 0.
extern "C" void rope(const void* x, void* out, const float* cos, const float* sin, int64_t rows, int64_t heads,
                     int64_t positions, int64_t head_dim, int backward, int type, int threads);
