// The element types and conversions shared by the run-time compiled CUDA sources
// (src/nn/kernels.cu, src/optim/fused_optim.cu), put in front of each source at compile time
// (`concat!` of both files in src/nn/cuda.rs and src/optim/fused_cuda.rs) before NVRTC compiles
// it; scripts/nvrtc_check.py and the CPU emulation in tests/cuda_emulation do the same.
//
// bf16 and f16 as their 16-bit patterns (no cuda_fp16.h / cuda_bf16.h: NVRTC does not ship them
// everywhere); `to_f` widens an element to f32, `from_f<T>` rounds an f32 to T to nearest-even.

struct bf16_t { unsigned short x; };
struct f16_t { unsigned short x; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16_t v) { return __uint_as_float(((unsigned int)v.x) << 16); }
#ifndef ACCEL_HOST_EMULATION
__device__ __forceinline__ float to_f(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}
#else
// tests/cuda_emulation runs these kernels on the CPU: the PTX conversions in software.
__device__ __forceinline__ float to_f(f16_t v) { return emu_half_to_float(v.x); }
#endif

template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
// Round to nearest even; a NaN stays a (quiet) NaN.
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float f) {
    unsigned int u = __float_as_uint(f);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.x = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.x = (unsigned short)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float f) {
    f16_t r;
#ifndef ACCEL_HOST_EMULATION
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
#else
    r.x = emu_float_to_half(f);
#endif
    return r;
}

