// Fused AdamW and SGD kernels (f32, bf16, f16) of accelerate_rs::optim, compiled at run time with
// NVRTC for the GPU's architecture (see src/optim/fused_cuda.rs), with --fmad=false so that the
// f32 arithmetic equals the CPU kernels' in src/optim/fused.rs.
// The element types bf16_t/f16_t and the conversions to_f/from_f come from src/cuda_prelude.cu,
// put in front of this source before it is compiled.

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

// Sets *flag to 1 when one of x's n elements is not finite (an infinity or a NaN): v - v is 0 for
// every finite v and NaN otherwise, so the test needs no math library. A trial kernel
// (ACCELERATE_RS_CUDA_TRIAL=1): the gradients' finiteness check before an optimizer step, one
// launch per gradient into one flag, read once (src/optim/fused_cuda.rs).
template <typename T>
__device__ void nonfinite(const T* x, unsigned long long n, unsigned int* flag) {
    unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    bool bad = false;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
            i += stride) {
        float v = to_f(x[i]);
        bad = bad || !(v - v == 0.0f);
    }
    if (bad) atomicExch(flag, 1u);
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
}                                                                                               \
extern "C" __global__ void nonfinite_##NAME(const T* x, unsigned long long n,                   \
        unsigned int* flag) {                                                                   \
    nonfinite<T>(x, n, flag);                                                                   \
}

ENTRY(float, f32)
ENTRY(bf16_t, bf16)
ENTRY(f16_t, f16)
