// CUDA kernels of accelerate_rs::nn::flash_attention (src/nn/flash.rs), compiled at run time
// with NVRTC behind src/cuda_prelude.cu (element types, to_f/from_f) as a module of its own (see
// src/nn/flash_cuda.rs). Memory-efficient attention: nothing of size T_q x T_k is stored.
//
// - flash_fwd: one warp per query row; the keys it sees 32 at a time (a lane per key: its score),
//   an online softmax over them, the output row accumulated in registers (a lane per 32nd
//   column), then normalized; writes the row's log-sum-exp (-inf for a row that sees no key:
//   zeros out).
// - flash_bwd_dq: one warp per query row: delta = dO . O, then dQ from recomputed weights
//   P = exp(s - lse) and dS = P (dP - delta), dP = dO . v.
// - flash_bwd_dkv: one warp per key row of a key/value head: dK and dV over the query heads that
//   share it and the query rows that see it (a lane per query row), from the same recomputation.
//
// Masks as the CPU op's Visibility: per query row a key range [lo, hi) (causal, sliding window,
// its document's span), then key by key the document id and the padding. Every element type is
// computed in f32. Widths (D, D_v) up to 256. tests/cuda_emulation/check_flash.cpp runs these on
// the CPU against double-precision references written from the formulas.

#define FLASH_NEG_INF __int_as_float(0xff800000)
#define FLASH_NAN __int_as_float(0x7fc00000)
// Warps (query or key rows) per block, and columns per lane: widths up to 32 * FLASH_COLS.
#define FLASH_WARPS 4
#define FLASH_COLS 8

// The sizes, strides and switches of one call; the same layout as `FlashParams` in
// src/nn/flash_cuda.rs (#[repr(C)]).
struct FlashParams {
    long long qs[3], ks[3], vs[3];  // strides of batch, head, token (elements); columns contiguous
    int b, h, rep, tq, tk, d, dv, off;  // rep = H / H_kv; off = T_k - T_q (0 when unmasked)
    int ranges_per_batch, has_ids, has_pad;
    float scale;
};

// The larger of two values, NaN if either is (a NaN score must never pass for a masked one).
__device__ __forceinline__ float flash_max(float a, float b) {
    return (a != a || b != b) ? FLASH_NAN : fmaxf(a, b);
}
__device__ __forceinline__ float flash_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = flash_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float flash_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Whether key j (inside the row's range) is seen by a query of document `own` in batch entry b.
__device__ __forceinline__ bool flash_keyed(const long long* ids, const unsigned char* pad,
                                            const FlashParams& p, int b, long long j,
                                            long long own) {
    long long at = (long long)b * p.tk + j;
    return (!p.has_ids || ids[at] == own) && (!p.has_pad || pad[at] == 0);
}

// Query row `row` of [B, H, T_q]: its batch entry, head, index and key range; false past the end.
struct FlashRow {
    int b, h, g, i;
    long long lo, hi, own;
};
__device__ __forceinline__ bool flash_row(long long row, const long long* ranges,
                                          const long long* ids, const FlashParams& p,
                                          FlashRow* r) {
    if (row >= (long long)p.b * p.h * p.tq) return false;
    r->i = (int)(row % p.tq);
    r->h = (int)((row / p.tq) % p.h);
    r->b = (int)(row / ((long long)p.tq * p.h));
    r->g = r->h / p.rep;
    long long ri = (p.ranges_per_batch ? (long long)r->b * p.tq : 0) + r->i;
    r->lo = ranges[2 * ri];
    r->hi = ranges[2 * ri + 1];
    r->own = p.has_ids ? ids[(long long)r->b * p.tk + r->i + p.off] : 0;
    return true;
}

// A row of width w (columns contiguous) into this warp's shared row, in f32.
template <typename T>
__device__ __forceinline__ void flash_load(const T* src, float* dst, int w) {
    for (int c = threadIdx.x & 31; c < w; c += 32) dst[c] = to_f(src[c]);
    __syncwarp();
}

// This lane's dot product of a shared f32 row with a row of T, over w columns.
template <typename T>
__device__ __forceinline__ float flash_dot(const float* a, const T* b, int w) {
    float s = 0.0f;
    for (int c = 0; c < w; ++c) s += a[c] * to_f(b[c]);
    return s;
}

template <typename T>
__device__ void flash_fwd(const T* q, const T* k, const T* v, T* y, float* lse,
                          const long long* ranges, const long long* ids, const unsigned char* pad,
                          FlashParams p) {
    __shared__ float qrow[FLASH_WARPS][32 * FLASH_COLS];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long long row = (long long)blockIdx.x * FLASH_WARPS + w;
    FlashRow r;
    if (!flash_row(row, ranges, ids, p, &r)) return;
    flash_load(q + r.b * p.qs[0] + r.h * p.qs[1] + r.i * p.qs[2], qrow[w], p.d);
    const T* kb = k + r.b * p.ks[0] + r.g * p.ks[1];
    const T* vb = v + r.b * p.vs[0] + r.g * p.vs[1];
    float m = FLASH_NEG_INF, l = 0.0f, acc[FLASH_COLS];
    for (int c = 0; c < FLASH_COLS; ++c) acc[c] = 0.0f;
    for (long long j0 = r.lo; j0 < r.hi; j0 += 32) {
        long long j = j0 + lane;
        float s = FLASH_NEG_INF;
        if (j < r.hi && flash_keyed(ids, pad, p, r.b, j, r.own))
            s = p.scale * flash_dot(qrow[w], kb + j * p.ks[2], p.d);
        float mn = flash_max(m, flash_warp_max(s));
        if (mn == FLASH_NEG_INF) continue;  // nothing seen yet (the same on every lane)
        float e = expf(s - mn), corr = expf(m - mn);
        l = l * corr + flash_warp_sum(e);
        for (int c = 0; c < FLASH_COLS; ++c) acc[c] *= corr;
        int n = (int)(r.hi - j0 < 32 ? r.hi - j0 : 32);
        for (int jj = 0; jj < n; ++jj) {
            float pj = __shfl_sync(0xffffffffu, e, jj);
            const T* vr = vb + (j0 + jj) * p.vs[2];
            for (int c = 0; c < FLASH_COLS; ++c) {
                int col = lane + 32 * c;
                if (col < p.dv) acc[c] += pj * to_f(vr[col]);
            }
        }
        m = mn;
    }
    T* yr = y + row * p.dv;
    // A row that saw no key: zeros (a NaN row has l = NaN and stays NaN).
    bool empty = l == 0.0f;
    float inv = empty ? 0.0f : 1.0f / l;
    for (int c = 0; c < FLASH_COLS; ++c) {
        int col = lane + 32 * c;
        if (col < p.dv) yr[col] = from_f<T>(empty ? 0.0f : acc[c] * inv);
    }
    if (lane == 0) lse[row] = empty ? FLASH_NEG_INF : m + logf(l);
}

template <typename T>
__device__ void flash_bwd_dq(const T* q, const T* k, const T* v, const T* y, const T* dy,
                             const float* lse, float* delta, T* dq, const long long* ranges,
                             const long long* ids, const unsigned char* pad, FlashParams p) {
    __shared__ float qrow[FLASH_WARPS][32 * FLASH_COLS];
    __shared__ float grow[FLASH_WARPS][32 * FLASH_COLS];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long long row = (long long)blockIdx.x * FLASH_WARPS + w;
    FlashRow r;
    if (!flash_row(row, ranges, ids, p, &r)) return;
    flash_load(q + r.b * p.qs[0] + r.h * p.qs[1] + r.i * p.qs[2], qrow[w], p.d);
    flash_load(dy + row * p.dv, grow[w], p.dv);
    float part = 0.0f;
    for (int c = lane; c < p.dv; c += 32) part += grow[w][c] * to_f(y[row * p.dv + c]);
    float dl = flash_warp_sum(part), L = lse[row];
    if (lane == 0) delta[row] = dl;
    const T* kb = k + r.b * p.ks[0] + r.g * p.ks[1];
    const T* vb = v + r.b * p.vs[0] + r.g * p.vs[1];
    float acc[FLASH_COLS];
    for (int c = 0; c < FLASH_COLS; ++c) acc[c] = 0.0f;
    // A row that sees no key (lse = -inf) passes no gradient.
    long long hi = L == FLASH_NEG_INF ? r.lo : r.hi;
    for (long long j0 = r.lo; j0 < hi; j0 += 32) {
        long long j = j0 + lane;
        float ds = 0.0f;
        if (j < hi && flash_keyed(ids, pad, p, r.b, j, r.own)) {
            float pj = expf(p.scale * flash_dot(qrow[w], kb + j * p.ks[2], p.d) - L);
            ds = pj * (flash_dot(grow[w], vb + j * p.vs[2], p.dv) - dl);
        }
        int n = (int)(hi - j0 < 32 ? hi - j0 : 32);
        for (int jj = 0; jj < n; ++jj) {
            float dsj = __shfl_sync(0xffffffffu, ds, jj);
            const T* kr = kb + (j0 + jj) * p.ks[2];
            for (int c = 0; c < FLASH_COLS; ++c) {
                int col = lane + 32 * c;
                if (col < p.d) acc[c] += dsj * to_f(kr[col]);
            }
        }
    }
    for (int c = 0; c < FLASH_COLS; ++c) {
        int col = lane + 32 * c;
        if (col < p.d) dq[row * p.d + col] = from_f<T>(p.scale * acc[c]);
    }
}

// key_ranges: per key (per batch entry when ranges_per_batch) the query rows [ilo, ihi) that may
// see it (a superset: every row is checked).
template <typename T>
__device__ void flash_bwd_dkv(const T* q, const T* k, const T* v, const T* dy, const float* lse,
                              const float* delta, T* dk, T* dv, const long long* ranges,
                              const long long* key_ranges, const long long* ids,
                              const unsigned char* pad, FlashParams p) {
    __shared__ float krow[FLASH_WARPS][32 * FLASH_COLS];
    __shared__ float vrow[FLASH_WARPS][32 * FLASH_COLS];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long long key = (long long)blockIdx.x * FLASH_WARPS + w;
    int hkv = p.h / p.rep;
    if (key >= (long long)p.b * hkv * p.tk) return;
    long long j = key % p.tk;
    int g = (int)((key / p.tk) % hkv), b = (int)(key / ((long long)p.tk * hkv));
    flash_load(k + b * p.ks[0] + g * p.ks[1] + j * p.ks[2], krow[w], p.d);
    flash_load(v + b * p.vs[0] + g * p.vs[1] + j * p.vs[2], vrow[w], p.dv);
    long long kr = (p.ranges_per_batch ? (long long)b * p.tk : 0) + j;
    long long ilo = key_ranges[2 * kr], ihi = key_ranges[2 * kr + 1];
    long long kid = p.has_ids ? ids[(long long)b * p.tk + j] : 0;
    // A padding key is seen by no query.
    if (p.has_pad && pad[(long long)b * p.tk + j] != 0) ihi = ilo;
    float ak[FLASH_COLS], av[FLASH_COLS];
    for (int c = 0; c < FLASH_COLS; ++c) ak[c] = av[c] = 0.0f;
    for (int hh = g * p.rep; hh < (g + 1) * p.rep; ++hh) {
        long long base = ((long long)b * p.h + hh) * p.tq;
        const T* qb = q + b * p.qs[0] + hh * p.qs[1];
        for (long long i0 = ilo; i0 < ihi; i0 += 32) {
            long long i = i0 + lane;
            float pi = 0.0f, ds = 0.0f;
            if (i < ihi) {
                long long ri = (p.ranges_per_batch ? (long long)b * p.tq : 0) + i;
                bool seen = ranges[2 * ri] <= j && j < ranges[2 * ri + 1] &&
                            (!p.has_ids || ids[(long long)b * p.tk + i + p.off] == kid);
                if (seen) {
                    float s = p.scale * flash_dot(krow[w], qb + i * p.qs[2], p.d);
                    pi = expf(s - lse[base + i]);
                    ds = pi * (flash_dot(vrow[w], dy + (base + i) * p.dv, p.dv) - delta[base + i]);
                }
            }
            int n = (int)(ihi - i0 < 32 ? ihi - i0 : 32);
            for (int ii = 0; ii < n; ++ii) {
                float pj = __shfl_sync(0xffffffffu, pi, ii), dsj = __shfl_sync(0xffffffffu, ds, ii);
                const T* qr = qb + (i0 + ii) * p.qs[2];
                const T* gr = dy + (base + i0 + ii) * p.dv;
                for (int c = 0; c < FLASH_COLS; ++c) {
                    int col = lane + 32 * c;
                    if (col < p.dv) av[c] += pj * to_f(gr[col]);
                    if (col < p.d) ak[c] += dsj * to_f(qr[col]);
                }
            }
        }
    }
    for (int c = 0; c < FLASH_COLS; ++c) {
        int col = lane + 32 * c;
        if (col < p.d) dk[key * p.d + col] = from_f<T>(p.scale * ak[c]);
        if (col < p.dv) dv[key * p.dv + col] = from_f<T>(av[c]);
    }
}

#define FLASH_ENTRIES(T, S)                                                                       \
extern "C" __global__ void flash_fwd_##S(const T* q, const T* k, const T* v, T* y, float* lse,   \
        const long long* ranges, const long long* ids, const unsigned char* pad, FlashParams p) { \
    flash_fwd<T>(q, k, v, y, lse, ranges, ids, pad, p);                                          \
}                                                                                                 \
extern "C" __global__ void flash_bwd_dq_##S(const T* q, const T* k, const T* v, const T* y,      \
        const T* dy, const float* lse, float* delta, T* dq, const long long* ranges,              \
        const long long* ids, const unsigned char* pad, FlashParams p) {                          \
    flash_bwd_dq<T>(q, k, v, y, dy, lse, delta, dq, ranges, ids, pad, p);                        \
}                                                                                                 \
extern "C" __global__ void flash_bwd_dkv_##S(const T* q, const T* k, const T* v, const T* dy,    \
        const float* lse, const float* delta, T* dk, T* dv, const long long* ranges,              \
        const long long* key_ranges, const long long* ids, const unsigned char* pad,              \
        FlashParams p) {                                                                          \
    flash_bwd_dkv<T>(q, k, v, dy, lse, delta, dk, dv, ranges, key_ranges, ids, pad, p);          \
}

FLASH_ENTRIES(float, f32)
FLASH_ENTRIES(bf16_t, bf16)
FLASH_ENTRIES(f16_t, f16)
