// Fused AdamW and SGD kernels (f32, bf16, f16) of accelerate_rs::optim, compiled at run time with
// NVRTC for the GPU's architecture (see src/optim/fused_cuda.rs), with --fmad=false so that the
// f32 arithmetic equals the CPU kernels' in src/optim/fused.rs.
// bf16 and f16 as their bits: no header needed (NVRTC has no cuda_bf16.h of its own).
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

template <typename T>
__device__ void adamw(T* p, T* m, T* v, const T* g, unsigned long long n, float b1, float c1,
        float b2, float c2, float sm, float sv, float eps, float decay, float lr) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
            i += stride) {
        float gi = to_f(g[i]);
        float mi = to_f(m[i]) * b1 + gi * c1;
        float vi = to_f(v[i]) * b2 + (gi * gi) * c2;
        float adjusted = (mi * sm) / (sqrtf(vi * sv) + eps);
        p[i] = from_f<T>(to_f(p[i]) * decay - adjusted * lr);
        m[i] = from_f<T>(mi);
        v[i] = from_f<T>(vi);
    }
}

template <typename T>
__device__ void sgd(T* p, T* buf, const T* g, unsigned long long n, float lr, float wd, int decay,
        float mu, float c, int use_buf, int first, int nesterov) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
            i += stride) {
        float d = decay ? to_f(p[i]) * wd + to_f(g[i]) : to_f(g[i]);
        float step = d;
        if (use_buf) {
            // The buffer is rounded to its storage type before it is used (as on the CPU).
            T bi = from_f<T>(first ? d : to_f(buf[i]) * mu + d * c);
            buf[i] = bi;
            float b = to_f(bi);
            step = nesterov ? d + b * mu : b;
        }
        p[i] = from_f<T>(to_f(p[i]) - step * lr);
    }
}

#define ENTRY(T, NAME)                                                                          \
extern "C" __global__ void adamw_##NAME(T* p, T* m, T* v, const T* g, unsigned long long n,    \
        float b1, float c1, float b2, float c2, float sm, float sv, float eps, float decay,     \
        float lr) {                                                                             \
    adamw<T>(p, m, v, g, n, b1, c1, b2, c2, sm, sv, eps, decay, lr);                            \
}                                                                                               \
extern "C" __global__ void sgd_##NAME(T* p, T* buf, const T* g, unsigned long long n, float lr, \
        float wd, int decay, float mu, float c, int use_buf, int first, int nesterov) {         \
    sgd<T>(p, buf, g, n, lr, wd, decay, mu, c, use_buf, first, nesterov);                       \
}

ENTRY(float, f32)
ENTRY(bf16_t, bf16)
ENTRY(f16_t, f16)
