// CUDA kernels of accelerate_rs::nn (the `nn-cuda` feature), compiled at run time with NVRTC
// for the GPU's architecture (see src/nn/cuda.rs). Each mirrors the CPU kernel of the same op in
// src/nn/*.rs: f32 arithmetic for f32, bf16 and f16 (widened on load, rounded to nearest-even on
// store), the same formulas in the same order where the order is not a reduction's.
//
// Layout conventions: every input is contiguous; a "row" is the last dimension. Row kernels run
// one block per row; reductions go through warp shuffles and one shared array per block.
// Element types: float, and bf16_t/f16_t with the conversions to_f/from_f of
// src/cuda_prelude.cu, put in front of this source before it is compiled.
//
// tests/cuda_emulation compiles this file for the CPU (ACCEL_HOST_EMULATION: one thread per CUDA
// thread, barriers for __syncthreads and the warp shuffles) and checks every kernel against
// double-precision references: the kernels' logic is tested without a GPU.

// No math.h under NVRTC: the special values by their bits.
#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum (max) of `v` over the block, returned to every thread. blockDim.x is a multiple of
// 32, at most 1024. Safe to call several times in a row.
__device__ float block_sum(float v) {
    __shared__ float s[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) s[w] = v;
    __syncthreads();
    v = (threadIdx.x < nw) ? s[threadIdx.x] : 0.0f;
    if (w == 0) v = warp_sum(v);
    if (threadIdx.x == 0) s[0] = v;
    __syncthreads();
    return s[0];
}
__device__ float block_max(float v) {
    __shared__ float s[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) s[w] = v;
    __syncthreads();
    v = (threadIdx.x < nw) ? s[threadIdx.x] : NEG_INF;
    if (w == 0) v = warp_max(v);
    if (threadIdx.x == 0) s[0] = v;
    __syncthreads();
    return s[0];
}
__device__ double block_sum_d(double v) {
    __shared__ double s[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) s[w] = v;
    __syncthreads();
    v = (threadIdx.x < nw) ? s[threadIdx.x] : 0.0;
    if (w == 0) v = warp_sum_d(v);
    if (threadIdx.x == 0) s[0] = v;
    __syncthreads();
    return s[0];
}

// ---- LayerNorm / RMSNorm ------------------------------------------------------------------

// Mean (0 without remove_mean) and 1/sqrt(var + eps) of one row, as the CPU's `stats`.
template <typename T>
__device__ void row_stats(const T* xr, int d, int remove_mean, float eps, float* mean, float* rstd) {
    float m = 0.0f;
    if (remove_mean) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) s += to_f(xr[i]);
        m = block_sum(s) / (float)d;
    }
    float s2 = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f(xr[i]) - m;
        s2 += v * v;
    }
    float var = block_sum(s2) / (float)d;
    *mean = m;
    *rstd = 1.0f / sqrtf(var + eps);
}

// y = (x - mean) * rstd * w (+ b), one block per row.
template <typename T>
__device__ void norm_fwd(const T* x, const T* w, const T* b, T* y, int d, int remove_mean,
        int has_bias, float eps) {
    long long row = blockIdx.x;
    const T* xr = x + row * d;
    T* yr = y + row * d;
    float mean, rstd;
    row_stats(xr, d, remove_mean, eps, &mean, &rstd);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = (to_f(xr[i]) - mean) * rstd * to_f(w[i]);
        if (has_bias) v += to_f(b[i]);
        yr[i] = from_f<T>(v);
    }
}

// dx of one row (one block per row), and the row's mean and rstd into stats[2 * row ..]:
// g = dy * w; dx = rstd * (g - mean(g) [LayerNorm only] - xhat * mean(g * xhat)).
template <typename T>
__device__ void norm_bwd_rows(const T* x, const T* w, const T* dy, T* dx, float* stats, int d,
        int remove_mean, float eps) {
    long long row = blockIdx.x;
    const T* xr = x + row * d;
    const T* gr = dy + row * d;
    T* dxr = dx + row * d;
    float mean, rstd;
    row_stats(xr, d, remove_mean, eps, &mean, &rstd);
    float sg = 0.0f, sgx = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float g = to_f(gr[i]) * to_f(w[i]);
        sg += g;
        sgx += g * ((to_f(xr[i]) - mean) * rstd);
    }
    float mg = block_sum(sg) / (float)d;
    float mgx = block_sum(sgx) / (float)d;
    float shift = remove_mean ? mg : 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float g = to_f(gr[i]) * to_f(w[i]);
        float xhat = (to_f(xr[i]) - mean) * rstd;
        dxr[i] = from_f<T>(rstd * (g - shift - xhat * mgx));
    }
    if (threadIdx.x == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = rstd;
    }
}

// Partial dweight and dbias over a chunk of `chunk` rows (blockIdx.y), one thread per column:
// partial[(2 * blockIdx.y) * d + j] = sum dy * xhat, partial[(2 * blockIdx.y + 1) * d + j] = sum dy.
template <typename T>
__device__ void norm_bwd_cols(const T* x, const T* dy, const float* stats, float* partial,
        long long rows, int d, int chunk) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    long long r0 = (long long)blockIdx.y * chunk;
    long long r1 = r0 + chunk < rows ? r0 + chunk : rows;
    float sw = 0.0f, sb = 0.0f;
    for (long long r = r0; r < r1; ++r) {
        float g = to_f(dy[r * d + j]);
        float xhat = (to_f(x[r * d + j]) - stats[2 * r]) * stats[2 * r + 1];
        sw += g * xhat;
        sb += g;
    }
    partial[(2 * (long long)blockIdx.y) * d + j] = sw;
    partial[(2 * (long long)blockIdx.y + 1) * d + j] = sb;
}

// dweight and dbias (out[0..d], out[d..2d]) from the chunks' partial sums.
template <typename T>
__device__ void norm_bwd_finish(const float* partial, T* out, int chunks, int d) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float sw = 0.0f, sb = 0.0f;
    for (int c = 0; c < chunks; ++c) {
        sw += partial[(2 * (long long)c) * d + j];
        sb += partial[(2 * (long long)c + 1) * d + j];
    }
    out[j] = from_f<T>(sw);
    out[d + j] = from_f<T>(sb);
}

// ---- softmax / causal softmax -------------------------------------------------------------

// y = softmax(scale * x) per row; with `causal`, row r is query r % tq and sees keys
// 0..=r % tq + tk - tq only (the rest get 0).
template <typename T>
__device__ void softmax_fwd(const T* x, T* y, int d, float scale, int causal, int tq, int tk) {
    long long row = blockIdx.x;
    const T* xr = x + row * d;
    T* yr = y + row * d;
    int seen = d;
    if (causal) {
        int s = (int)(row % tq) + tk - tq + 1;
        seen = s < d ? s : d;
    }
    float m = NEG_INF;
    for (int i = threadIdx.x; i < seen; i += blockDim.x) m = fmaxf(m, scale * to_f(xr[i]));
    m = block_max(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < seen; i += blockDim.x) s += expf(scale * to_f(xr[i]) - m);
    float inv = 1.0f / block_sum(s);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        yr[i] = from_f<T>(i < seen ? expf(scale * to_f(xr[i]) - m) * inv : 0.0f);
    }
}

// dx = scale * y * (dy - sum(y * dy)) per row.
template <typename T>
__device__ void softmax_bwd(const T* y, const T* dy, T* dx, int d, float scale) {
    long long row = blockIdx.x;
    const T* yr = y + row * d;
    const T* gr = dy + row * d;
    T* dxr = dx + row * d;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dot += to_f(yr[i]) * to_f(gr[i]);
    dot = block_sum(dot);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        dxr[i] = from_f<T>(scale * to_f(yr[i]) * (to_f(gr[i]) - dot));
    }
}

// ---- cross-entropy (and linear_cross_entropy's row pass) ----------------------------------

// Max and log-sum-exp of one row.
template <typename T>
__device__ float row_lse(const T* xr, int c) {
    float m = NEG_INF;
    for (int i = threadIdx.x; i < c; i += blockDim.x) m = fmaxf(m, to_f(xr[i]));
    m = block_max(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) s += expf(to_f(xr[i]) - m);
    return m + logf(block_sum(s));
}

// Each row's loss into losses[row] (0 for an ignored row): lse - (1 - eps) * x[t]
// - eps * mean(x).
template <typename T>
__device__ void ce_rows(const T* x, const long long* targets, float* losses, int c, float eps,
        int has_ignore, long long ignore) {
    long long row = blockIdx.x;
    long long t = targets[row];
    if (has_ignore && t == ignore) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        return;
    }
    const T* xr = x + row * c;
    float lse = row_lse(xr, c);
    float smooth = 0.0f;
    if (eps > 0.0f) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < c; i += blockDim.x) s += to_f(xr[i]);
        smooth = eps * block_sum(s) / (float)c;
    }
    if (threadIdx.x == 0) {
        float xt = (t >= 0 && t < c) ? to_f(xr[t]) : QNAN;
        losses[row] = lse - (1.0f - eps) * xt - smooth;
    }
}

// out[0] = sum(losses) / counted, the sum in f64 as on the CPU (one block).
template <typename T>
__device__ void ce_mean(const float* losses, T* out, long long rows, float counted) {
    double s = 0.0;
    for (long long i = threadIdx.x; i < rows; i += blockDim.x) s += (double)losses[i];
    s = block_sum_d(s);
    if (threadIdx.x == 0) out[0] = from_f<T>((float)(s / (double)counted));
}

// The logits' gradient, one block per row: (softmax - eps / C) * scale, less (1 - eps) * scale
// at the target; zeros for an ignored row. scale = g[0] * inv_counted (g: the upstream gradient,
// read on the device: no host round trip).
template <typename T>
__device__ void ce_bwd(const T* x, const long long* targets, const T* g, T* dx, int c, float eps,
        int has_ignore, long long ignore, float inv_counted) {
    long long row = blockIdx.x;
    long long t = targets[row];
    const T* xr = x + row * c;
    T* dxr = dx + row * c;
    if (has_ignore && t == ignore) {
        for (int i = threadIdx.x; i < c; i += blockDim.x) dxr[i] = from_f<T>(0.0f);
        return;
    }
    float scale = to_f(g[0]) * inv_counted;
    float uniform = eps / (float)c;
    float lse = row_lse(xr, c);
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float v = (expf(to_f(xr[i]) - lse) - uniform);
        if (i == t) v -= (1.0f - eps);
        dxr[i] = from_f<T>(v * scale);
    }
}

// ---- GELU (tanh approximation) and ReLU ----------------------------------------------------

#define GELU_K 0.7978846f
#define GELU_C 0.044715f

template <typename T>
__device__ void gelu_fwd(const T* x, T* y, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = to_f(x[i]);
        float t = tanhf(GELU_K * (v + GELU_C * v * v * v));
        y[i] = from_f<T>(0.5f * v * (1.0f + t));
    }
}

template <typename T>
__device__ void gelu_bwd(const T* x, const T* dy, T* dx, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = to_f(x[i]);
        float t = tanhf(GELU_K * (v + GELU_C * v * v * v));
        float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * v * v);
        dx[i] = from_f<T>(to_f(dy[i]) * d);
    }
}

// max(x, 0); NaN stays NaN (as Candle and PyTorch).
template <typename T>
__device__ void relu_fwd(const T* x, T* y, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = to_f(x[i]);
        y[i] = (v > 0.0f || v != v) ? x[i] : from_f<T>(0.0f);
    }
}

// dy where y > 0, else 0 (the output is positive exactly where the input is).
template <typename T>
__device__ void relu_bwd(const T* y, const T* dy, T* dx, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dx[i] = to_f(y[i]) > 0.0f ? dy[i] : from_f<T>(0.0f);
    }
}

// ---- SiLU and the SwiGLU gate --------------------------------------------------------------

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// x * sigmoid(x)
template <typename T>
__device__ void silu_fwd(const T* x, T* y, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = to_f(x[i]);
        y[i] = from_f<T>(v * sigmoid_f(v));
    }
}

// dy * sigmoid(x) * (1 + x * (1 - sigmoid(x)))
template <typename T>
__device__ void silu_bwd(const T* x, const T* dy, T* dx, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = to_f(x[i]);
        float s = sigmoid_f(v);
        dx[i] = from_f<T>(to_f(dy[i]) * (s * (1.0f + v * (1.0f - s))));
    }
}

// silu(gate) * up
template <typename T>
__device__ void swiglu_fwd(const T* gate, const T* up, T* y, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = to_f(gate[i]);
        y[i] = from_f<T>(g * sigmoid_f(g) * to_f(up[i]));
    }
}

// out[0, n): d gate = dy * up * silu'(gate); out[n, 2n): d up = dy * silu(gate).
template <typename T>
__device__ void swiglu_bwd(const T* gate, const T* up, const T* dy, T* out, long long n) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = to_f(gate[i]), d = to_f(dy[i]);
        float s = sigmoid_f(g);
        out[n + i] = from_f<T>(d * g * s);
        out[i] = from_f<T>(d * to_f(up[i]) * s * (1.0f + g * (1.0f - s)));
    }
}

// ---- rotary embeddings ---------------------------------------------------------------------
// variant 0: xs [B, H, T, D], pairs of halves (i, i + D/2); 1: [B, H, T, D], interleaved pairs
// (2i, 2i + 1); 2: [B, T, H, D], pairs of halves. Tables [T, D/2], or [B, T, D/2] when batched.

// The table row that row r of xs uses.
__device__ __forceinline__ long long rope_table_row(long long r, int variant, long long h,
                                                    long long t, int batched) {
    long long bi, ti;
    if (variant == 2) {
        bi = r / (t * h);
        ti = (r / h) % t;
    } else {
        bi = r / (h * t);
        ti = r % t;
    }
    return batched ? bi * t + ti : ti;
}

// The element offsets (within a row of d) of pair i.
__device__ __forceinline__ void rope_pair(int variant, int d, int i, int* ia, int* ib) {
    if (variant == 1) {
        *ia = 2 * i;
        *ib = 2 * i + 1;
    } else {
        *ia = i;
        *ib = i + d / 2;
    }
}

// One thread per pair: (a, b) at angle (c, sign * s) -> (a c - b s, a s + b c).
template <typename T>
__device__ void rope_fwd(const T* x, const T* cos, const T* sin, T* y, long long pairs, int d,
                         int variant, int h, int t, int batched, float sign) {
    long long stride = (long long)blockDim.x * gridDim.x;
    int half = d / 2;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < pairs; k += stride) {
        long long r = k / half;
        int i = (int)(k % half);
        long long p = rope_table_row(r, variant, h, t, batched) * half + i;
        float c = to_f(cos[p]), sn = sign * to_f(sin[p]);
        int ia, ib;
        rope_pair(variant, d, i, &ia, &ib);
        float a = to_f(x[r * d + ia]), b = to_f(x[r * d + ib]);
        y[r * d + ia] = from_f<T>(a * c - b * sn);
        y[r * d + ib] = from_f<T>(a * sn + b * c);
    }
}

// The tables' gradients, one thread per table entry (row p, pair i), summing over the rows of xs
// that use table row p: out[0, n) d cos = sum(g_a a + g_b b), out[n, 2n) d sin =
// sign * sum(g_b a - g_a b).
template <typename T>
__device__ void rope_tables(const T* x, const T* g, T* out, long long n, int bsz, int h, int t,
                            int d, int variant, int batched, float sign) {
    long long stride = (long long)blockDim.x * gridDim.x;
    int half = d / 2;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        long long p = k / half;
        int i = (int)(k % half);
        long long ti = batched ? p % t : p;
        long long b0 = batched ? p / t : 0, b1 = batched ? p / t + 1 : bsz;
        int ia, ib;
        rope_pair(variant, d, i, &ia, &ib);
        float acc_c = 0.0f, acc_s = 0.0f;
        for (long long bi = b0; bi < b1; ++bi) {
            for (long long hi = 0; hi < h; ++hi) {
                long long r = variant == 2 ? (bi * t + ti) * h + hi : (bi * h + hi) * t + ti;
                float a = to_f(x[r * d + ia]), b = to_f(x[r * d + ib]);
                float ga = to_f(g[r * d + ia]), gb = to_f(g[r * d + ib]);
                acc_c += ga * a + gb * b;
                acc_s += gb * a - ga * b;
            }
        }
        out[k] = from_f<T>(acc_c);
        out[n + k] = from_f<T>(sign * acc_s);
    }
}

// Embedding lookup: out[r, c] = table[ids[r], c], one thread per output element (`n` = rows *
// dim); the ids were checked to lie in the table.
template <typename T>
__device__ void embedding_rows(const T* table, const unsigned* ids, T* out, long long n, int dim) {
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        long long r = k / dim;
        int c = (int)(k % dim);
        out[k] = table[(long long)ids[r] * dim + c];
    }
}

// The table's gradient, one block per table row that was looked up (`uniq[u]`): the sum, in f32
// and in the order of the lookups, of the rows `order[starts[u] .. starts[u + 1])` of g (the
// lookups of that table row, by position). Rows nobody looked up stay as they are (zero-filled
// by the caller). No atomics: every output element is written by one thread, the same sum in
// the same order on every run.
template <typename T>
__device__ void embedding_grad(const T* g, const unsigned* order, const unsigned* starts,
                               const unsigned* uniq, T* out, int dim) {
    unsigned u = blockIdx.x;
    unsigned a = starts[u], b = starts[u + 1];
    long long row = (long long)uniq[u] * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = 0.0f;
        for (unsigned p = a; p < b; ++p) acc += to_f(g[(long long)order[p] * dim + c]);
        out[row + c] = from_f<T>(acc);
    }
}

// ---- entry points, one per op and element type --------------------------------------------

#define ENTRIES(T, S)                                                                            \
extern "C" __global__ void norm_fwd_##S(const T* x, const T* w, const T* b, T* y, int d,         \
        int remove_mean, int has_bias, float eps) {                                              \
    norm_fwd<T>(x, w, b, y, d, remove_mean, has_bias, eps);                                      \
}                                                                                                \
extern "C" __global__ void norm_bwd_rows_##S(const T* x, const T* w, const T* dy, T* dx,         \
        float* stats, int d, int remove_mean, float eps) {                                       \
    norm_bwd_rows<T>(x, w, dy, dx, stats, d, remove_mean, eps);                                  \
}                                                                                                \
extern "C" __global__ void norm_bwd_cols_##S(const T* x, const T* dy, const float* stats,        \
        float* partial, long long rows, int d, int chunk) {                                      \
    norm_bwd_cols<T>(x, dy, stats, partial, rows, d, chunk);                                     \
}                                                                                                \
extern "C" __global__ void norm_bwd_finish_##S(const float* partial, T* out, int chunks, int d) {\
    norm_bwd_finish<T>(partial, out, chunks, d);                                                 \
}                                                                                                \
extern "C" __global__ void softmax_fwd_##S(const T* x, T* y, int d, float scale, int causal,     \
        int tq, int tk) {                                                                        \
    softmax_fwd<T>(x, y, d, scale, causal, tq, tk);                                              \
}                                                                                                \
extern "C" __global__ void softmax_bwd_##S(const T* y, const T* dy, T* dx, int d, float scale) { \
    softmax_bwd<T>(y, dy, dx, d, scale);                                                         \
}                                                                                                \
extern "C" __global__ void ce_rows_##S(const T* x, const long long* targets, float* losses,      \
        int c, float eps, int has_ignore, long long ignore) {                                    \
    ce_rows<T>(x, targets, losses, c, eps, has_ignore, ignore);                                  \
}                                                                                                \
extern "C" __global__ void ce_mean_##S(const float* losses, T* out, long long rows,              \
        float counted) {                                                                         \
    ce_mean<T>(losses, out, rows, counted);                                                      \
}                                                                                                \
extern "C" __global__ void ce_bwd_##S(const T* x, const long long* targets, const T* g, T* dx,   \
        int c, float eps, int has_ignore, long long ignore, float inv_counted) {                 \
    ce_bwd<T>(x, targets, g, dx, c, eps, has_ignore, ignore, inv_counted);                       \
}                                                                                                \
extern "C" __global__ void gelu_fwd_##S(const T* x, T* y, long long n) { gelu_fwd<T>(x, y, n); } \
extern "C" __global__ void gelu_bwd_##S(const T* x, const T* dy, T* dx, long long n) {           \
    gelu_bwd<T>(x, dy, dx, n);                                                                   \
}                                                                                                \
extern "C" __global__ void relu_fwd_##S(const T* x, T* y, long long n) { relu_fwd<T>(x, y, n); } \
extern "C" __global__ void relu_bwd_##S(const T* y, const T* dy, T* dx, long long n) {           \
    relu_bwd<T>(y, dy, dx, n);                                                                   \
}                                                                                                \
extern "C" __global__ void silu_fwd_##S(const T* x, T* y, long long n) { silu_fwd<T>(x, y, n); } \
extern "C" __global__ void silu_bwd_##S(const T* x, const T* dy, T* dx, long long n) {           \
    silu_bwd<T>(x, dy, dx, n);                                                                   \
}                                                                                                \
extern "C" __global__ void swiglu_fwd_##S(const T* g, const T* u, T* y, long long n) {           \
    swiglu_fwd<T>(g, u, y, n);                                                                   \
}                                                                                                \
extern "C" __global__ void swiglu_bwd_##S(const T* g, const T* u, const T* dy, T* out,           \
        long long n) {                                                                           \
    swiglu_bwd<T>(g, u, dy, out, n);                                                             \
}                                                                                                \
extern "C" __global__ void rope_fwd_##S(const T* x, const T* c, const T* s, T* y,                \
        long long pairs, int d, int variant, int h, int t, int batched, float sign) {            \
    rope_fwd<T>(x, c, s, y, pairs, d, variant, h, t, batched, sign);                             \
}                                                                                                \
extern "C" __global__ void rope_tables_##S(const T* x, const T* g, T* out, long long n, int b,   \
        int h, int t, int d, int variant, int batched, float sign) {                             \
    rope_tables<T>(x, g, out, n, b, h, t, d, variant, batched, sign);                            \
}                                                                                                \
extern "C" __global__ void embedding_rows_##S(const T* table, const unsigned* ids, T* out,       \
        long long n, int dim) {                                                                  \
    embedding_rows<T>(table, ids, out, n, dim);                                                  \
}                                                                                                \
extern "C" __global__ void embedding_grad_##S(const T* g, const unsigned* order,                 \
        const unsigned* starts, const unsigned* uniq, T* out, int dim) {                         \
    embedding_grad<T>(g, order, starts, uniq, out, dim);                                         \
}

ENTRIES(float, f32)
ENTRIES(bf16_t, bf16)
ENTRIES(f16_t, f16)
