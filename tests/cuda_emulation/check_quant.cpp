// Runs the 4-bit dequantization kernel of src/quant/dequant4.cu on the CPU (emu.hpp), a few
// blocks of 256 threads striding over the weight, and compares it bit for bit with the values
// written here from the format's definition (src/quant/mod.rs): element e is
// `code4[nibble(e)] * scale(e / blocksize)` in f32, the first element of a byte in its high
// nibble, the scale `nested_code[codes[b]] * absmax[b / 256] + offset` with double quantization,
// rounded to the weight's dtype and then to the output's. Odd lengths, partial blocks, more than
// one nested block, f32/bf16/f16 weights and outputs. Built and run by
// tests/it/cuda_emulation.rs (with -ffp-contract=off, as the kernel is compiled with
// --fmad=false).
#include "emu.hpp"

#include "../../src/cuda_prelude.cu"
#include "../../src/quant/dequant4.cu"

#include <cstdio>
#include <string>

static int failures = 0;

static unsigned hash(unsigned i, unsigned salt) {
    unsigned s = (i + 1) * 2654435761u + salt * 40503u;
    s ^= s >> 13;
    s *= 1274126177u;
    return s ^ (s >> 16);
}

static float unit(unsigned i, unsigned salt) {
    return (float)(hash(i, salt) >> 8) / (float)(1u << 24);
}

// The value of element e, from the definition.
static float reference(const std::vector<unsigned char>& packed, const unsigned char* codes,
                       const std::vector<float>& absmax, const std::vector<float>& nested_code,
                       const float* code4, float offset, long long e, long long bs, int w_round) {
    unsigned byte = packed[(size_t)(e / 2)];
    unsigned nibble = e % 2 == 0 ? byte >> 4 : byte & 15u;
    long long b = e / bs;
    float scale = codes ? nested_code[codes[b]] * absmax[(size_t)(b / 256)] + offset : absmax[(size_t)b];
    float v = code4[nibble] * scale;
    if (w_round == 1) v = to_f(from_f<bf16_t>(v));
    if (w_round == 2) v = to_f(from_f<f16_t>(v));
    return v;
}

template <typename T>
static void check(const char* type, long long n, long long bs, bool nested, int w_round) {
    long long blocks = (n + bs - 1) / bs;
    std::vector<unsigned char> packed((size_t)((n + 1) / 2));
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = (unsigned char)(hash((unsigned)i, 1) & 255u);
    float code4[16];
    for (int i = 0; i < 16; ++i) code4[i] = (float)(i - 7) / 8.0f + 0.01f * (float)i;
    std::vector<unsigned char> codes((size_t)blocks);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = (unsigned char)(hash((unsigned)i, 2) & 255u);
    std::vector<float> nested_code(256);
    for (int i = 0; i < 256; ++i) nested_code[(size_t)i] = (float)(i - 127) / 128.0f + unit((unsigned)i, 3) * 1e-3f;
    // Plain: one scale a block; nested: one absmax a nested block of 256.
    std::vector<float> absmax((size_t)(nested ? (blocks + 255) / 256 : blocks));
    for (size_t i = 0; i < absmax.size(); ++i) absmax[i] = 0.01f + unit((unsigned)i, 4);
    float offset = nested ? 0.123456789f : 0.0f;
    const unsigned char* cp = nested ? codes.data() : nullptr;
    std::vector<T> out((size_t)n);
    long long pairs = (n + 1) / 2;
    unsigned grid = (unsigned)std::min<long long>((pairs + 255) / 256, 4);
    emu_launch(dim3{grid, 1, 1}, dim3{256, 1, 1}, [&] {
        dequant4<T>(packed.data(), cp, absmax.data(), nested_code.data(), code4, offset, n, bs, 256,
                    w_round, out.data());
    });
    long long bad = -1;
    for (long long e = 0; e < n && bad < 0; ++e) {
        T want = from_f<T>(reference(packed, cp, absmax, nested_code, code4, offset, e, bs, w_round));
        if (std::memcmp(&want, &out[(size_t)e], sizeof(T)) != 0) bad = e;
    }
    bool ok = bad < 0;
    std::printf("%s dequant4 %s n=%lld blocksize=%lld nested=%d w_round=%d: %s\n", ok ? "PASS" : "FAIL",
                type, n, bs, (int)nested, w_round,
                ok ? "bit for bit" : ("differs at " + std::to_string(bad)).c_str());
    failures += !ok;
}

int main() {
    // (n, blocksize): odd, a partial block, more than 256 blocks (two nested blocks).
    for (auto [n, bs] : {std::pair<long long, long long>{1, 64}, {231, 64}, {1024, 32}, {16510, 64}}) {
        for (bool nested : {false, true}) {
            check<float>("f32", n, bs, nested, 0);
            check<float>("f32", n, bs, nested, 1);
            check<bf16_t>("bf16", n, bs, nested, 0);
            check<bf16_t>("bf16", n, bs, nested, 1);
            check<f16_t>("f16", n, bs, nested, 2);
        }
    }
    std::printf("cuda_emulation (quant): %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
