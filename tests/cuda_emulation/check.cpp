// Runs every kernel of src/nn/kernels.cu on the CPU (tests/cuda_emulation/emu.hpp) with the
// launch shapes src/nn/cuda.rs uses, and compares it with a double-precision reference written
// here from the formulas (not from the kernels). Prints one PASS/FAIL line per check and exits 1
// on a failure. Built and run by tests/it/cuda_emulation.rs:
//
//     c++ -std=c++20 -O1 -pthread tests/cuda_emulation/check.cpp -o check && ./check
#include "emu.hpp"

#include "../../src/cuda_prelude.cu"
#include "../../src/nn/kernels.cu"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

static int failures = 0;

static void report(const std::string& name, double err, double tol) {
    bool ok = err <= tol;  // NaN fails
    std::printf("%s %s: max relative error %.3g (tolerance %.1g)\n", ok ? "PASS" : "FAIL",
                name.c_str(), err, tol);
    if (!ok) ++failures;
}

static std::vector<float> data(size_t n, unsigned seed, float scale = 2.0f) {
    std::vector<float> v(n);
    unsigned s = seed * 2654435761u + 12345u;
    for (auto& x : v) {
        s = s * 1664525u + 1013904223u;
        x = ((float)(s >> 8) / (float)(1u << 24) - 0.5f) * 2.0f * scale;
    }
    return v;
}

// max |a - b| / max(1, |b|) over the elements (b the reference).
static double rel(const std::vector<float>& a, const std::vector<double>& b) {
    double worst = 0.0;
    for (size_t i = 0; i < b.size(); ++i) {
        double d = std::fabs((double)a[i] - b[i]) / std::max(1.0, std::fabs(b[i]));
        if (!(d <= worst)) worst = d;  // keeps NaN
    }
    return worst;
}

// The launch shapes of src/nn/cuda.rs.
static dim3 row_block(int d) {
    unsigned t = (unsigned)(((d + 31) / 32) * 32);
    t = std::min(1024u, std::max(32u, t));
    return dim3{t, 1, 1};
}
static dim3 elems_grid(long long n) {
    long long b = (n + 255) / 256;
    return dim3{(unsigned)std::min<long long>(std::max<long long>(b, 1), 8192), 1, 1};
}

// ---- LayerNorm / RMSNorm ---------------------------------------------------------------------

static void check_norm(int rows, int d, bool remove_mean, bool has_bias) {
    float eps = 1e-5f;
    auto x = data((size_t)rows * d, 1), w = data(d, 2), b = data(d, 3), dy = data((size_t)rows * d, 4);
    std::vector<double> ry((size_t)rows * d), rdx((size_t)rows * d), rdw(d, 0.0), rdb(d, 0.0);
    for (int r = 0; r < rows; ++r) {
        const float* xr = &x[(size_t)r * d];
        double mean = 0.0, var = 0.0;
        if (remove_mean) {
            for (int i = 0; i < d; ++i) mean += xr[i];
            mean /= d;
        }
        for (int i = 0; i < d; ++i) var += (xr[i] - mean) * (xr[i] - mean);
        var /= d;
        double rstd = 1.0 / std::sqrt(var + eps);
        double mg = 0.0, mgx = 0.0;
        for (int i = 0; i < d; ++i) {
            double xhat = (xr[i] - mean) * rstd;
            ry[(size_t)r * d + i] = xhat * w[i] + (has_bias ? b[i] : 0.0);
            double g = dy[(size_t)r * d + i] * w[i];
            mg += g;
            mgx += g * xhat;
            rdw[i] += dy[(size_t)r * d + i] * xhat;
            rdb[i] += dy[(size_t)r * d + i];
        }
        mg /= d;
        mgx /= d;
        for (int i = 0; i < d; ++i) {
            double xhat = (xr[i] - mean) * rstd;
            double g = dy[(size_t)r * d + i] * w[i];
            rdx[(size_t)r * d + i] = rstd * (g - (remove_mean ? mg : 0.0) - xhat * mgx);
        }
    }
    std::string name = std::string(remove_mean ? "layer_norm" : "rms_norm") +
                       (has_bias ? "" : " (no bias)") + " " + std::to_string(rows) + "x" +
                       std::to_string(d);
    std::vector<float> y((size_t)rows * d);
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(d), [&] {
        norm_fwd_f32(x.data(), w.data(), b.data(), y.data(), d, remove_mean, has_bias, eps);
    });
    report(name + " forward", rel(y, ry), 1e-5);

    // The backward: rows, then column chunks, then the sums of the chunks (as norm_bwd does).
    size_t n = (size_t)rows * d;
    std::vector<float> out(n + 2 * (size_t)d), stats(2 * (size_t)rows);
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(d), [&] {
        norm_bwd_rows_f32(x.data(), w.data(), dy.data(), out.data(), stats.data(), d, remove_mean, eps);
    });
    int chunk = 64;  // NORM_CHUNK_ROWS (rows here are far below 64 * 65535)
    int chunks = (rows + chunk - 1) / chunk;
    std::vector<float> partial(2 * (size_t)d * chunks);
    unsigned col_blocks = (unsigned)((d + 255) / 256);
    emu_launch(dim3{col_blocks, (unsigned)chunks, 1}, dim3{256, 1, 1}, [&] {
        norm_bwd_cols_f32(x.data(), dy.data(), stats.data(), partial.data(), rows, d, chunk);
    });
    emu_launch(dim3{col_blocks, 1, 1}, dim3{256, 1, 1}, [&] {
        norm_bwd_finish_f32(partial.data(), out.data() + n, chunks, d);
    });
    std::vector<float> dx(out.begin(), out.begin() + n), dw(out.begin() + n, out.begin() + n + d),
        db(out.begin() + n + d, out.end());
    report(name + " backward dx", rel(dx, rdx), 1e-5);
    report(name + " backward dweight", rel(dw, rdw), 1e-5);
    report(name + " backward dbias", rel(db, rdb), 1e-5);
}

// ---- softmax ---------------------------------------------------------------------------------

static void check_softmax(int rows, int d, float scale, int tq, int tk) {
    bool causal = tq > 0;
    auto x = data((size_t)rows * d, 5, 3.0f), dy = data((size_t)rows * d, 6);
    std::vector<double> ry((size_t)rows * d), rdx((size_t)rows * d);
    std::vector<float> y((size_t)rows * d), dx((size_t)rows * d);
    for (int r = 0; r < rows; ++r) {
        int seen = causal ? std::min(d, r % tq + tk - tq + 1) : d;
        double m = -INFINITY, s = 0.0;
        for (int i = 0; i < seen; ++i) m = std::max(m, (double)scale * x[(size_t)r * d + i]);
        for (int i = 0; i < seen; ++i) s += std::exp(scale * x[(size_t)r * d + i] - m);
        for (int i = 0; i < d; ++i)
            ry[(size_t)r * d + i] = i < seen ? std::exp(scale * x[(size_t)r * d + i] - m) / s : 0.0;
    }
    std::string name = std::string(causal ? "causal_softmax " : "softmax ") + std::to_string(rows) +
                       "x" + std::to_string(d);
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(d), [&] {
        softmax_fwd_f32(x.data(), y.data(), d, scale, causal, causal ? tq : 1, causal ? tk : d);
    });
    report(name + " forward", rel(y, ry), 1e-5);
    for (int r = 0; r < rows; ++r) {
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += (double)y[(size_t)r * d + i] * dy[(size_t)r * d + i];
        for (int i = 0; i < d; ++i)
            rdx[(size_t)r * d + i] = scale * y[(size_t)r * d + i] * (dy[(size_t)r * d + i] - dot);
    }
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(d), [&] {
        softmax_bwd_f32(y.data(), dy.data(), dx.data(), d, scale);
    });
    report(name + " backward", rel(dx, rdx), 1e-5);
}

// ---- cross-entropy ---------------------------------------------------------------------------

static void check_cross_entropy(int rows, int c, float eps, bool ignore) {
    auto x = data((size_t)rows * c, 7, 4.0f);
    std::vector<long long> t(rows);
    for (int r = 0; r < rows; ++r) t[r] = (r * 37 + 11) % c;
    long long ignored = t[1];  // rows with this target are ignored when `ignore`
    int counted = 0;
    double total = 0.0;
    std::vector<double> rdx((size_t)rows * c, 0.0);
    float g = 0.75f;  // the upstream gradient
    for (int r = 0; r < rows; ++r) {
        if (ignore && t[r] == ignored) continue;
        ++counted;
    }
    for (int r = 0; r < rows; ++r) {
        if (ignore && t[r] == ignored) continue;
        const float* xr = &x[(size_t)r * c];
        double m = -INFINITY, s = 0.0, sum = 0.0;
        for (int i = 0; i < c; ++i) m = std::max(m, (double)xr[i]);
        for (int i = 0; i < c; ++i) {
            s += std::exp(xr[i] - m);
            sum += xr[i];
        }
        double lse = m + std::log(s);
        total += lse - (1.0 - eps) * xr[t[r]] - eps * sum / c;
        double scale = g / (double)counted;
        for (int i = 0; i < c; ++i) {
            double v = std::exp(xr[i] - lse) - eps / c;
            if (i == t[r]) v -= (1.0 - eps);
            rdx[(size_t)r * c + i] = v * scale;
        }
    }
    std::vector<double> rloss{total / counted};
    std::string name = "cross_entropy " + std::to_string(rows) + "x" + std::to_string(c) +
                       " eps " + std::to_string(eps).substr(0, 4) + (ignore ? " ignore" : "");
    std::vector<float> losses(rows), out(1), dx((size_t)rows * c);
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(c), [&] {
        ce_rows_f32(x.data(), t.data(), losses.data(), c, eps, ignore, ignored);
    });
    emu_launch(dim3{1, 1, 1}, dim3{1024, 1, 1}, [&] {
        ce_mean_f32(losses.data(), out.data(), rows, (float)counted);
    });
    report(name + " loss", rel(out, rloss), 1e-5);
    std::vector<float> gv{g};
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(c), [&] {
        ce_bwd_f32(x.data(), t.data(), gv.data(), dx.data(), c, eps, ignore, ignored,
                   1.0f / (float)counted);
    });
    report(name + " gradient", rel(dx, rdx), 1e-5);
}

// ---- GELU / ReLU -----------------------------------------------------------------------------

static void check_elementwise(long long n) {
    auto x = data((size_t)n, 8, 5.0f), dy = data((size_t)n, 9);
    x[0] = 0.0f;
    x[1] = -0.0f;
    std::vector<float> y((size_t)n), dx((size_t)n);
    std::vector<double> ry((size_t)n), rdx((size_t)n);
    const double k = std::sqrt(2.0 / M_PI), c = 0.044715;
    for (long long i = 0; i < n; ++i) {
        double v = x[i], t = std::tanh(k * (v + c * v * v * v));
        ry[i] = 0.5 * v * (1.0 + t);
        rdx[i] = dy[i] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * c * v * v));
    }
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { gelu_fwd_f32(x.data(), y.data(), n); });
    report("gelu forward " + std::to_string(n), rel(y, ry), 1e-5);
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { gelu_bwd_f32(x.data(), dy.data(), dx.data(), n); });
    report("gelu backward " + std::to_string(n), rel(dx, rdx), 1e-5);
    for (long long i = 0; i < n; ++i) {
        ry[i] = x[i] > 0 ? x[i] : 0.0;
    }
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { relu_fwd_f32(x.data(), y.data(), n); });
    report("relu forward " + std::to_string(n), rel(y, ry), 0.0);
    for (long long i = 0; i < n; ++i) rdx[i] = y[i] > 0 ? dy[i] : 0.0;
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { relu_bwd_f32(y.data(), dy.data(), dx.data(), n); });
    report("relu backward " + std::to_string(n), rel(dx, rdx), 0.0);
    // NaN stays NaN.
    std::vector<float> nan_in{NAN, -1.0f}, nan_out(2);
    emu_launch(dim3{1, 1, 1}, dim3{32, 1, 1}, [&] { relu_fwd_f32(nan_in.data(), nan_out.data(), 2); });
    report("relu keeps NaN", std::isnan(nan_out[0]) && nan_out[1] == 0.0f ? 0.0 : 1.0, 0.0);
}

// ---- SiLU / SwiGLU ---------------------------------------------------------------------------

static void check_silu_swiglu(long long n) {
    auto x = data((size_t)n, 13, 8.0f), u = data((size_t)n, 14), dy = data((size_t)n, 15);
    x[0] = 0.0f;
    std::vector<float> y((size_t)n), dx((size_t)n), out((size_t)(2 * n));
    std::vector<double> ry((size_t)n), rdx((size_t)n), rout((size_t)(2 * n));
    for (long long i = 0; i < n; ++i) {
        double v = x[i], s = 1.0 / (1.0 + std::exp(-v));
        ry[i] = v * s;
        rdx[i] = dy[i] * s * (1.0 + v * (1.0 - s));
    }
    std::string tag = " " + std::to_string(n);
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { silu_fwd_f32(x.data(), y.data(), n); });
    report("silu forward" + tag, rel(y, ry), 1e-5);
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { silu_bwd_f32(x.data(), dy.data(), dx.data(), n); });
    report("silu backward" + tag, rel(dx, rdx), 1e-5);
    for (long long i = 0; i < n; ++i) {
        double g = x[i], s = 1.0 / (1.0 + std::exp(-g));
        ry[i] = g * s * u[i];
        rout[(size_t)i] = dy[i] * u[i] * s * (1.0 + g * (1.0 - s));
        rout[(size_t)(n + i)] = dy[i] * g * s;
    }
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] { swiglu_fwd_f32(x.data(), u.data(), y.data(), n); });
    report("swiglu forward" + tag, rel(y, ry), 1e-5);
    emu_launch(elems_grid(n), dim3{256, 1, 1}, [&] {
        swiglu_bwd_f32(x.data(), u.data(), dy.data(), out.data(), n);
    });
    report("swiglu backward (d gate, then d up)" + tag, rel(out, rout), 1e-5);
}

// ---- rotary embeddings ------------------------------------------------------------------------

// variant 0: [B, H, T, D] halves; 1: [B, H, T, D] interleaved; 2: [B, T, H, D] halves. Tables
// [T, D/2], or [B, T, D/2] when batched. The reference walks the 4-d index directly.
static void check_rope(int variant, int B, int H, int T, int D, bool batched) {
    int half = D / 2;
    size_t n = (size_t)B * H * T * D;
    size_t tn = (size_t)(batched ? B * T : T) * half;
    auto x = data(n, 16), g = data(n, 17), c = data(tn, 18, 1.0f), sn = data(tn, 19, 1.0f);
    std::string name = "rope variant " + std::to_string(variant) + (batched ? " batched" : "") +
                       " [" + std::to_string(B) + "," + std::to_string(H) + "," +
                       std::to_string(T) + "," + std::to_string(D) + "]";
    auto off = [&](int bi, int hi, int ti, int e) -> size_t {
        return variant == 2 ? (((size_t)bi * T + ti) * H + hi) * D + e
                            : (((size_t)bi * H + hi) * T + ti) * D + e;
    };
    auto tab = [&](int bi, int ti, int i) -> size_t {
        return ((size_t)(batched ? bi * T + ti : ti)) * half + i;
    };
    auto pair = [&](int i, int* ia, int* ib) {
        if (variant == 1) { *ia = 2 * i; *ib = 2 * i + 1; } else { *ia = i; *ib = i + half; }
    };
    for (float sign : {1.0f, -1.0f}) {
        std::vector<double> ry(n);
        for (int bi = 0; bi < B; ++bi)
            for (int hi = 0; hi < H; ++hi)
                for (int ti = 0; ti < T; ++ti)
                    for (int i = 0; i < half; ++i) {
                        int ia, ib;
                        pair(i, &ia, &ib);
                        double a = x[off(bi, hi, ti, ia)], b = x[off(bi, hi, ti, ib)];
                        double cc = c[tab(bi, ti, i)], ss = sign * sn[tab(bi, ti, i)];
                        ry[off(bi, hi, ti, ia)] = a * cc - b * ss;
                        ry[off(bi, hi, ti, ib)] = a * ss + b * cc;
                    }
        std::vector<float> y(n);
        long long pairs = (long long)n / 2;
        emu_launch(elems_grid(pairs), dim3{256, 1, 1}, [&] {
            rope_fwd_f32(x.data(), c.data(), sn.data(), y.data(), pairs, D, variant, H, T,
                         batched ? 1 : 0, sign);
        });
        report(name + (sign > 0 ? " forward" : " backward of xs"), rel(y, ry), 1e-5);
    }
    std::vector<double> rt(2 * tn, 0.0);
    for (int bi = 0; bi < B; ++bi)
        for (int hi = 0; hi < H; ++hi)
            for (int ti = 0; ti < T; ++ti)
                for (int i = 0; i < half; ++i) {
                    int ia, ib;
                    pair(i, &ia, &ib);
                    double a = x[off(bi, hi, ti, ia)], b = x[off(bi, hi, ti, ib)];
                    double ga = g[off(bi, hi, ti, ia)], gb = g[off(bi, hi, ti, ib)];
                    rt[tab(bi, ti, i)] += ga * a + gb * b;
                    rt[tn + tab(bi, ti, i)] += gb * a - ga * b;
                }
    std::vector<float> out(2 * tn);
    emu_launch(elems_grid((long long)tn), dim3{256, 1, 1}, [&] {
        rope_tables_f32(x.data(), g.data(), out.data(), (long long)tn, B, H, T, D, variant,
                        batched ? 1 : 0, 1.0f);
    });
    report(name + " tables' gradients (d cos, then d sin)", rel(out, rt), 1e-5);
}

// ---- embedding -------------------------------------------------------------------------------

// The lookups of `count` ids into a table of `n` rows of `d`: the rows (embedding_rows) and the
// table's gradient (embedding_grad, one block per looked-up row, launched on a zero-filled
// table, the packed plan built as src/nn/embedding.rs's Plan does: positions stably sorted by
// id, the distinct ids ascending, each one's range of positions).
static void check_embedding(int n, int d, int count, unsigned seed) {
    std::vector<unsigned> ids(count);
    unsigned s = seed;
    for (auto& id : ids) {
        s = s * 1664525u + 1013904223u;
        id = (s >> 8) % (unsigned)n;
    }
    if (count > 2) ids[count - 1] = ids[0];  // a repeat at least
    std::vector<unsigned> order(count), starts, uniq;
    for (int i = 0; i < count; ++i) order[i] = (unsigned)i;
    std::stable_sort(order.begin(), order.end(), [&](unsigned a, unsigned b) { return ids[a] < ids[b]; });
    for (int i = 0; i < count; ++i) {
        if (uniq.empty() || uniq.back() != ids[order[i]]) {
            uniq.push_back(ids[order[i]]);
            starts.push_back((unsigned)i);
        }
    }
    starts.push_back((unsigned)count);
    auto table = data((size_t)n * d, seed + 1), g = data((size_t)count * d, seed + 2);
    std::string name = "embedding [" + std::to_string(n) + "," + std::to_string(d) + "] x " +
                       std::to_string(count) + " ids";
    std::vector<double> ry((size_t)count * d), rg((size_t)n * d, 0.0);
    for (int r = 0; r < count; ++r)
        for (int c = 0; c < d; ++c) {
            ry[(size_t)r * d + c] = table[(size_t)ids[r] * d + c];
            rg[(size_t)ids[r] * d + c] += g[(size_t)r * d + c];
        }
    std::vector<float> y((size_t)count * d), dt((size_t)n * d, 0.0f);
    long long total = (long long)count * d;
    emu_launch(elems_grid(total), dim3{256, 1, 1}, [&] {
        embedding_rows_f32(table.data(), ids.data(), y.data(), total, d);
    });
    report(name + " rows", rel(y, ry), 0.0);
    emu_launch(dim3{(unsigned)uniq.size(), 1, 1}, row_block(d), [&] {
        embedding_grad_f32(g.data(), order.data(), starts.data(), uniq.data(), dt.data(), d);
    });
    report(name + " table's gradient", rel(dt, rg), 1e-6);
    // bf16: the sums in f32, rounded once.
    std::vector<bf16_t> gb, db((size_t)n * d, from_f<bf16_t>(0.0f));
    for (float v : g) gb.push_back(from_f<bf16_t>(v));
    std::vector<double> rgb((size_t)n * d, 0.0);
    for (int r = 0; r < count; ++r)
        for (int c = 0; c < d; ++c) rgb[(size_t)ids[r] * d + c] += to_f(gb[(size_t)r * d + c]);
    emu_launch(dim3{(unsigned)uniq.size(), 1, 1}, row_block(d), [&] {
        embedding_grad_bf16(gb.data(), order.data(), starts.data(), uniq.data(), db.data(), d);
    });
    std::vector<float> db32;
    for (auto v : db) db32.push_back(to_f(v));
    report(name + " table's gradient bf16", rel(db32, rgb), 8e-3);
}

// ---- bf16 / f16 ------------------------------------------------------------------------------

static void check_half_types() {
    struct Case {
        float f;
        unsigned short bf, h;
    };
    // Reference bit patterns (round to nearest even; IEEE binary16 and bfloat16).
    const Case cases[] = {
        {1.0f, 0x3f80, 0x3c00},
        {-2.0f, 0xc000, 0xc000},
        {0.1f, 0x3dcd, 0x2e66},
        {65504.0f, 0x4780, 0x7bff},            // bf16: 0x477fe000 rounds up
        {65520.0f, 0x4780, 0x7c00},            // f16: rounds to infinity
        {1.00390625f, 0x3f80, 0x3c04},          // bf16: halfway, to even (down)
        {1.01171875f, 0x3f82, 0x3c0c},          // bf16: halfway, to even (up)
        {5.9604645e-08f, 0x3380, 0x0001},       // f16: smallest subnormal
        {0.0f, 0x0000, 0x0000},
        {-0.0f, 0x8000, 0x8000},
        {1e-9f, 0x3089, 0x0000},                // f16: below half the smallest subnormal
    };
    double bad = 0.0;
    for (const auto& c : cases) {
        bf16_t b = from_f<bf16_t>(c.f);
        f16_t h = from_f<f16_t>(c.f);
        if (b.x != c.bf || h.x != c.h) {
            std::printf("  %g: bf16 %04x (want %04x), f16 %04x (want %04x)\n", c.f, b.x, c.bf, h.x, c.h);
            bad = 1.0;
        }
    }
    // Every finite f16 and bf16 survives widening and rounding back.
    for (unsigned u = 0; u < 65536; ++u) {
        f16_t h{(unsigned short)u};
        bf16_t b{(unsigned short)u};
        float fh = to_f(h), fb = to_f(b);
        if (std::isfinite(fh) && from_f<f16_t>(fh).x != u) bad = 1.0;
        if (std::isfinite(fb) && from_f<bf16_t>(fb).x != u) bad = 1.0;
    }
    report("bf16/f16 conversions (known values, all round trips)", bad, 0.0);
    // One row kernel in each half type against the f32 reference of the rounded inputs.
    int rows = 3, d = 100;
    auto x = data((size_t)rows * d, 10), w = data(d, 11), b = data(d, 12);
    std::vector<bf16_t> xb, wb, bb, yb((size_t)rows * d);
    std::vector<f16_t> xh, wh, bh, yh((size_t)rows * d);
    for (float v : x) { xb.push_back(from_f<bf16_t>(v)); xh.push_back(from_f<f16_t>(v)); }
    for (float v : w) { wb.push_back(from_f<bf16_t>(v)); wh.push_back(from_f<f16_t>(v)); }
    for (float v : b) { bb.push_back(from_f<bf16_t>(v)); bh.push_back(from_f<f16_t>(v)); }
    auto reference = [&](auto widen, const auto& xs, const auto& ws, const auto& bs) {
        std::vector<double> r((size_t)rows * d);
        for (int row = 0; row < rows; ++row) {
            double mean = 0.0, var = 0.0;
            for (int i = 0; i < d; ++i) mean += widen(xs[(size_t)row * d + i]);
            mean /= d;
            for (int i = 0; i < d; ++i) {
                double v = widen(xs[(size_t)row * d + i]) - mean;
                var += v * v;
            }
            double rstd = 1.0 / std::sqrt(var / d + 1e-5);
            for (int i = 0; i < d; ++i)
                r[(size_t)row * d + i] = (widen(xs[(size_t)row * d + i]) - mean) * rstd * widen(ws[i]) + widen(bs[i]);
        }
        return r;
    };
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(d), [&] {
        norm_fwd_bf16(xb.data(), wb.data(), bb.data(), yb.data(), d, 1, 1, 1e-5f);
    });
    emu_launch(dim3{(unsigned)rows, 1, 1}, row_block(d), [&] {
        norm_fwd_f16(xh.data(), wh.data(), bh.data(), yh.data(), d, 1, 1, 1e-5f);
    });
    std::vector<float> yb32, yh32;
    for (auto v : yb) yb32.push_back(to_f(v));
    for (auto v : yh) yh32.push_back(to_f(v));
    report("layer_norm forward bf16",
           rel(yb32, reference([](bf16_t v) { return (double)to_f(v); }, xb, wb, bb)), 1e-2);
    report("layer_norm forward f16",
           rel(yh32, reference([](f16_t v) { return (double)to_f(v); }, xh, wh, bh)), 2e-3);
}

int main() {
    // Widths below, at and above one warp and one block, rows of one and several.
    for (int d : {1, 31, 32, 100, 256, 1100}) check_norm(3, d, true, true);
    check_norm(70, 64, true, false);  // two column chunks
    check_norm(5, 300, false, false);
    check_norm(2, 40, false, true);
    check_softmax(4, 300, 1.0f, 0, 0);
    check_softmax(1, 1, 1.0f, 0, 0);
    check_softmax(2 * 3 * 5, 9, 0.3f, 5, 9);  // causal, T_q < T_k
    check_softmax(2 * 7, 7, 0.5f, 7, 7);       // causal, square
    check_cross_entropy(6, 300, 0.0f, false);
    check_cross_entropy(3, 1030, 0.1f, true);
    check_cross_entropy(1, 2, 0.0f, false);
    check_elementwise(1000);
    check_elementwise(3);
    check_silu_swiglu(1000);
    check_silu_swiglu(3);
    for (int variant : {0, 1, 2}) {
        check_rope(variant, 2, 3, 5, 8, false);
        check_rope(variant, 2, 3, 5, 8, true);
    }
    check_rope(0, 1, 1, 1, 2, false);
    check_rope(2, 3, 4, 7, 64, true);
    check_embedding(50, 16, 120, 3);    // repeats, rows never looked up
    check_embedding(7, 1100, 9, 4);     // wider than a block
    check_embedding(3, 1, 1, 5);        // one id
    check_half_types();
    std::printf("cuda_emulation: %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
