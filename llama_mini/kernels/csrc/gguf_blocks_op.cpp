// The torch operator llama_mini::gguf_blocks(blocks, kind, outputs): a GGUF file's quantized
// matrix written into an integer layer's buffers, as quant/gguf_blocks.py converts it.
//
// Why in C++: the conversion is byte shuffling, a few passes over the file. torch's converter
// makes them one operation at a time over chunks of rows, each a pass over memory; here each
// set of eight rows is decoded and packed while it sits in cache, one set per task on every
// thread: a file loads in a fraction of the time.
//
// blocks: the matrix's blocks as the file holds them, uint8 (rows, bytes per row), rows a
// multiple of eight. kind: the GGML type (Q5_0 6, Q4_0 2, Q4_1 3, Q4_K 12). outputs: the
// layer's buffers in its order (weight first), in quant/layout.py's sets of eight rows. What each type's codes and factors are is quant/gguf_blocks.py's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace llama_mini {

namespace {

constexpr int64_t ROWS = 8, BLOCK = 32;

// What a type's rows decode to: codes of `bits` bits (8: int8) and factors per group of inputs,
// each of `size` bytes.
struct Factor {
    int64_t inputs, size;
};

struct Kind {
    int64_t block_inputs, block_bytes, bits;
    std::vector<Factor> factors;
};

Kind kind_of(int64_t kind) {
    switch (kind) {
        case 6: return {32, 22, 8, {{32, 2}}};                                  // Q5_0: d, codes - 16
        case 2: return {32, 18, 4, {{32, 2}}};                                  // Q4_0: d
        case 3: return {32, 20, 4, {{32, 2}, {32, 2}}};                         // Q4_1: d, m
        case 12: return {256, 144, 4, {{32, 1}, {32, 1}, {256, 2}, {256, 2}}};  // Q4_K: sc, m, d, -dmin
    }
    TORCH_CHECK(false, "llama_mini::gguf_blocks: no converter for GGML type ", kind);
}

// The float16 at p, negated (its sign bit flipped, as torch negates it), written to `to`.
void put_negated_half(uint8_t* to, const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    h ^= 0x8000;
    std::memcpy(to, &h, 2);
}

// Four bytes as one word, and back: masks and shifts within each byte then take four codes at once.
uint32_t word(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return w;
}
void put_word(uint8_t* p, uint32_t w) { std::memcpy(p, &w, 4); }
constexpr uint32_t LOW_NIBBLES = 0x0F0F0F0F;

// Q4_K's twelve bytes of 6-bit sub-block scales and mins (llama.cpp's get_scale_min_k4).
void scales_and_mins(const uint8_t* q, uint8_t* sc, uint8_t* m) {
    for (int j = 0; j < 4; j++) sc[j] = q[j] & 63, m[j] = q[j + 4] & 63;
    for (int j = 4; j < 8; j++) sc[j] = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

// One block of one row: its codes (block_inputs of them) and its factors, each at factor[f] +
// the block's first group's index times the factor's size.
void decode_block(int64_t kind, const uint8_t* b, uint8_t* codes, uint8_t* const* factor) {
    switch (kind) {
        case 6: {
            uint32_t high;
            std::memcpy(factor[0], b, 2), std::memcpy(&high, b + 2, 4);
            for (int j = 0; j < 16; j++) {
                codes[j] = uint8_t(((b[6 + j] & 0x0F) | (((high >> j) & 1) << 4)) - 16);
                codes[j + 16] = uint8_t(((b[6 + j] >> 4) | (((high >> (j + 16)) & 1) << 4)) - 16);
            }
            return;
        }
        case 2:
        case 3: {
            const uint8_t* qs = b + (kind == 2 ? 2 : 4);
            std::memcpy(factor[0], b, 2);
            if (kind == 3) std::memcpy(factor[1], b + 2, 2);
            for (int j = 0; j < 16; j += 4) put_word(codes + j, word(qs + j) & LOW_NIBBLES), put_word(codes + j + 16, (word(qs + j) >> 4) & LOW_NIBBLES);
            return;
        }
        case 12: {
            const uint8_t* qs = b + 16;
            scales_and_mins(b + 4, factor[0], factor[1]);
            std::memcpy(factor[2], b, 2), put_negated_half(factor[3], b + 2);
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 32; i += 4)
                    put_word(codes + 64 * c + i, word(qs + 32 * c + i) & LOW_NIBBLES), put_word(codes + 64 * c + 32 + i, (word(qs + 32 * c + i) >> 4) & LOW_NIBBLES);
            return;
        }
    }
}

// A set's eight rows of codes (row j at codes + j k) into the set's bytes of layout.py's int8 or
// int4. A run holds four inputs of each row, so each row's four bytes of a run are one word:
// inputs i .. i + 3 in its low nibbles, i + 4 .. i + 7 in its high.
template <int bits>
void pack_set(const uint8_t* codes, int64_t k, uint8_t* out) {
    if constexpr (bits == 8) {
        for (int64_t c = 0; c < k / 4; c++)
            for (int64_t j = 0; j < ROWS; j++) std::memcpy(out + 32 * c + 4 * j, codes + j * k + 4 * c, 4);
        return;
    }
    for (int64_t b = 0; b < k / BLOCK; b++)
        for (int64_t j = 0; j < ROWS; j++) {
            const uint8_t* row = codes + j * k + BLOCK * b;
            const auto nibbles = [&](int64_t i) { return (word(row + i) & LOW_NIBBLES) | ((word(row + i + 4) & LOW_NIBBLES) << 4); };
            for (int64_t c = 0; c < 4; c++) put_word(out + 128 * b + 32 * c + 4 * j, nibbles(8 * c));
        }
}

void gguf_blocks_op(const at::Tensor& blocks, int64_t kind, at::TensorList outputs) {
    const Kind form = kind_of(kind);
    TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
                "llama_mini::gguf_blocks: blocks must be contiguous uint8 (rows, bytes per row) on the CPU");
    const int64_t n = blocks.size(0), row_blocks = blocks.size(1) / form.block_bytes, k = row_blocks * form.block_inputs;
    TORCH_CHECK(n % ROWS == 0 && blocks.size(1) % form.block_bytes == 0, "llama_mini::gguf_blocks: ", n, " rows of ",
                blocks.size(1), " bytes are not sets of eight rows of whole blocks");
    TORCH_CHECK(outputs.size() == form.factors.size() + 1, "llama_mini::gguf_blocks: ", outputs.size(), " buffers for ",
                form.factors.size() + 1);
    const int64_t sets = n / ROWS, code_bytes = k * form.bits / 8 * ROWS;
    auto check = [&](const at::Tensor& t, int64_t bytes) {
        TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() * t.element_size() == sets * bytes,
                    "llama_mini::gguf_blocks: a buffer of ", t.sizes(), " for ", sets, " sets of ", bytes, " bytes");
    };
    check(outputs[0], code_bytes);
    for (size_t f = 0; f < form.factors.size(); f++)
        check(outputs[f + 1], k / form.factors[f].inputs * form.factors[f].size * ROWS);
    const uint8_t* in = blocks.const_data_ptr<uint8_t>();
    at::parallel_for(0, sets, 1, [&](int64_t first, int64_t last) {
        std::vector<uint8_t> codes(ROWS * k);
        std::vector<std::vector<uint8_t>> factors;  // the set's rows, one after another
        for (const Factor& f : form.factors) factors.emplace_back(ROWS * k / f.inputs * f.size);
        std::vector<uint8_t*> at(form.factors.size());  // each factor's place for the block
        std::vector<int64_t> step;  // and its bytes a block
        for (const Factor& f : form.factors) step.push_back(form.block_inputs / f.inputs * f.size);
        for (int64_t s = first; s < last; s++) {
            for (int64_t j = 0; j < ROWS; j++) {  // the set's rows, one after another
                for (size_t f = 0; f < at.size(); f++) at[f] = factors[f].data() + j * k / form.factors[f].inputs * form.factors[f].size;
                for (int64_t b = 0; b < row_blocks; b++) {
                    decode_block(kind, in + (ROWS * s + j) * blocks.size(1) + b * form.block_bytes,
                                 codes.data() + j * k + b * form.block_inputs, at.data());
                    for (size_t f = 0; f < at.size(); f++) at[f] += step[f];
                }
            }
            uint8_t* packed = static_cast<uint8_t*>(outputs[0].data_ptr()) + s * code_bytes;
            if (form.bits == 8)
                pack_set<8>(codes.data(), k, packed);
            else
                pack_set<4>(codes.data(), k, packed);
            for (size_t f = 0; f < at.size(); f++) {  // row j's group g to the set's place g * 8 + j (interleave_rows)
                const int64_t groups = k / form.factors[f].inputs, size = form.factors[f].size;
                uint8_t* out = static_cast<uint8_t*>(outputs[f + 1].data_ptr()) + s * groups * size * ROWS;
                for (int64_t j = 0; j < ROWS; j++)
                    for (int64_t g = 0; g < groups; g++) {  // a byte or a float16: copies of a known size, inlined
                        uint8_t* to = out + (g * ROWS + j) * size;
                        const uint8_t* from = factors[f].data() + (j * groups + g) * size;
                        if (size == 1)
                            *to = *from;
                        else
                            std::memcpy(to, from, 2);
                    }
            }
        }
    });
}

}  // namespace

}  // namespace llama_mini

TORCH_LIBRARY_FRAGMENT(llama_mini, m) { m.def("gguf_blocks(Tensor blocks, int kind, Tensor(a!)[] outputs) -> ()"); }
TORCH_LIBRARY_IMPL(llama_mini, CPU, m) { m.impl("gguf_blocks", llama_mini::gguf_blocks_op); }
