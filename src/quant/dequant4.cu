// Dequantization of a 4-bit weight (bitsandbytes' NF4/FP4 format, src/quant) on a GPU: the
// values src/quant/weight.rs's `dequantize_into` computes on the CPU, bit for bit. Compiled at
// run time by NVRTC behind src/cuda_prelude.cu with `--fmad=false` (the scale `code · absmax +
// offset` is a product and a sum, each rounded, as on the CPU; a fused multiply-add would round
// once). NOT launched yet: no GPU has run it. tests/cuda_emulation/check_quant.cpp runs it on the
// CPU against the formulas, scripts/nvrtc_check.py compiles it with the real NVRTC.
//
// `packed`: two 4-bit codes a byte, the first element in the high nibble, `ceil(n / 2)` bytes.
// Block `b` (`blocksize` elements) has the scale `absmax[b]`, or with double quantization
// (`codes` not null) `nested_code[codes[b]] · absmax[b / nested_blocksize] + offset`. Element `e`
// is `code4[nibble] · scale(e / blocksize)` in f32, rounded to the weight's dtype (`w_round`: 0
// f32, 1 bf16, 2 f16), then to the output's `T`.

__device__ __forceinline__ float round_to(float v, int w_round) {
    if (w_round == 1) return to_f(from_f<bf16_t>(v));
    if (w_round == 2) return to_f(from_f<f16_t>(v));
    return v;
}

template <typename T>
__device__ void dequant4(const unsigned char* packed, const unsigned char* codes,
                         const float* absmax, const float* nested_code, const float* code4,
                         float offset, long long n, long long blocksize,
                         long long nested_blocksize, int w_round, T* out) {
    long long pairs = (n + 1) / 2;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += stride) {
        unsigned int byte = packed[p];
        for (int h = 0; h < 2; ++h) {
            long long e = 2 * p + h;
            if (e >= n) break;
            long long b = e / blocksize;
            float s = codes != nullptr
                          ? nested_code[codes[b]] * absmax[b / nested_blocksize] + offset
                          : absmax[b];
            unsigned int nibble = h == 0 ? (byte >> 4) : (byte & 15u);
            out[e] = from_f<T>(round_to(code4[nibble] * s, w_round));
        }
    }
}

#define DEQUANT4_ENTRY(T, S)                                                                     \
extern "C" __global__ void dequant4_##S(const unsigned char* packed, const unsigned char* codes,  \
        const float* absmax, const float* nested_code, const float* code4, float offset,         \
        long long n, long long blocksize, long long nested_blocksize, int w_round, T* out) {     \
    dequant4<T>(packed, codes, absmax, nested_code, code4, offset, n, blocksize,                 \
                nested_blocksize, w_round, out);                                                 \
}

DEQUANT4_ENTRY(float, f32)
DEQUANT4_ENTRY(bf16_t, bf16)
DEQUANT4_ENTRY(f16_t, f16)
