// Runs the flash-attention kernels of src/nn/flash.cu on the CPU (tests/cuda_emulation/emu.hpp)
// with the launch shape src/nn/flash_cuda.rs uses (4 warps a block, a warp per row), and compares
// the output, the log-sum-exp and the three gradients with a double-precision reference written
// here from the formulas: P = softmax(scale q k^T + mask), y = P v, and
// dS = P (dO v^T - rowsum(dO y)), dq = scale dS k, dk = scale dS^T q, dv = P^T dO.
// Prints one PASS/FAIL line per check and exits 1 on a failure. Built and run by
// tests/it/cuda_emulation.rs.
#include "emu.hpp"

#include "../../src/cuda_prelude.cu"
#include "../../src/nn/flash.cu"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

static int failures = 0;

static void report(const std::string& name, double err, double tol) {
    bool ok = err <= tol;  // NaN fails
    std::printf("%s %s: max error %.3g (tolerance %.1g)\n", ok ? "PASS" : "FAIL", name.c_str(),
                err, tol);
    if (!ok) ++failures;
}

static std::vector<float> data(size_t n, unsigned seed) {
    std::vector<float> v(n);
    unsigned s = seed * 2654435761u + 12345u;
    for (auto& x : v) {
        s = s * 1664525u + 1013904223u;
        x = ((float)(s >> 8) / (float)(1u << 24) - 0.5f) * 3.0f;
    }
    return v;
}

// max |a - b| / max(1, |b|), NaN kept.
static double rel(const std::vector<float>& a, const std::vector<double>& b) {
    double worst = 0.0;
    for (size_t i = 0; i < b.size(); ++i) {
        double d = std::fabs((double)a[i] - b[i]) / std::max(1.0, std::fabs(b[i]));
        if (!(d <= worst)) worst = d;
    }
    return worst;
}

struct Case {
    std::string name;
    int b, h, hkv, tq, tk, d, dv;
    bool causal;
    int window;                  // 0: none
    std::vector<int> docs;       // document lengths of every row (summing to tk); empty: none
    std::vector<int> pad;        // padding keys at the end of each row; empty: none
};

template <typename T>
static std::vector<T> as(const std::vector<float>& x) {
    std::vector<T> r;
    for (float v : x) r.push_back(from_f<T>(v));
    return r;
}
template <typename T>
static std::vector<float> widen(const std::vector<T>& x) {
    std::vector<float> r;
    for (auto v : x) r.push_back(to_f(v));
    return r;
}

// Runs one case in element type T (inputs rounded to T, the reference from the rounded values).
template <typename T>
static void check(const Case& c, const char* type, double tol) {
    int off = (c.causal || !c.docs.empty()) ? c.tk - c.tq : 0;
    size_t nq = (size_t)c.b * c.h * c.tq * c.d, nk = (size_t)c.b * c.hkv * c.tk * c.d;
    size_t nv = (size_t)c.b * c.hkv * c.tk * c.dv, ny = (size_t)c.b * c.h * c.tq * c.dv;
    auto q = widen(as<T>(data(nq, 1))), k = widen(as<T>(data(nk, 2)));
    auto v = widen(as<T>(data(nv, 3))), g = widen(as<T>(data(ny, 4)));
    std::vector<long long> ids((size_t)c.b * c.tk, 0);
    for (int bi = 0; bi < c.b && !c.docs.empty(); ++bi) {
        int at = 0;
        for (size_t di = 0; di < c.docs.size(); ++di)
            for (int t = 0; t < c.docs[di]; ++t) ids[(size_t)bi * c.tk + at++] = 7 * (long long)di + bi;
    }
    std::vector<unsigned char> pad((size_t)c.b * c.tk, 0);
    for (int bi = 0; bi < c.b && !c.pad.empty(); ++bi)
        for (int t = c.tk - c.pad[bi]; t < c.tk; ++t) pad[(size_t)bi * c.tk + t] = 1;
    int rep = c.h / c.hkv;
    double scale = 1.0 / std::sqrt((double)c.d);
    auto sees = [&](int bi, int i, int j) {
        int p = i + off;
        if (c.causal && j > p) return false;
        if (c.window && j <= p - c.window) return false;
        if (!c.docs.empty() && ids[(size_t)bi * c.tk + j] != ids[(size_t)bi * c.tk + p]) return false;
        return pad[(size_t)bi * c.tk + j] == 0;
    };
    // The reference, head by head.
    std::vector<double> ry(ny, 0.0), rl((size_t)c.b * c.h * c.tq), rdq(nq, 0.0), rdk(nk, 0.0), rdv(nv, 0.0);
    for (int bi = 0; bi < c.b; ++bi)
        for (int hi = 0; hi < c.h; ++hi) {
            int gi = hi / rep;
            auto Q = [&](int i, int e) { return (double)q[(((size_t)bi * c.h + hi) * c.tq + i) * c.d + e]; };
            auto K = [&](int j, int e) { return (double)k[(((size_t)bi * c.hkv + gi) * c.tk + j) * c.d + e]; };
            auto V = [&](int j, int e) { return (double)v[(((size_t)bi * c.hkv + gi) * c.tk + j) * c.dv + e]; };
            auto G = [&](int i, int e) { return (double)g[(((size_t)bi * c.h + hi) * c.tq + i) * c.dv + e]; };
            for (int i = 0; i < c.tq; ++i) {
                size_t row = ((size_t)bi * c.h + hi) * c.tq + i;
                std::vector<double> s(c.tk, -INFINITY), P(c.tk, 0.0), dp(c.tk, 0.0);
                double m = -INFINITY;
                for (int j = 0; j < c.tk; ++j)
                    if (sees(bi, i, j)) {
                        double dot = 0.0;
                        for (int e = 0; e < c.d; ++e) dot += Q(i, e) * K(j, e);
                        s[j] = dot * scale;
                        m = std::max(m, s[j]);
                    }
                if (m == -INFINITY) {
                    rl[row] = -INFINITY;  // sees nothing: zeros, no gradient
                    continue;
                }
                double z = 0.0;
                for (int j = 0; j < c.tk; ++j) z += s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m);
                rl[row] = m + std::log(z);
                double delta = 0.0;
                for (int j = 0; j < c.tk; ++j) {
                    P[j] = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m) / z;
                    for (int e = 0; e < c.dv; ++e) {
                        ry[row * c.dv + e] += P[j] * V(j, e);
                        dp[j] += G(i, e) * V(j, e);
                    }
                    delta += P[j] * dp[j];
                }
                for (int j = 0; j < c.tk; ++j) {
                    double ds = P[j] * (dp[j] - delta);
                    for (int e = 0; e < c.d; ++e) {
                        rdq[row * c.d + e] += scale * ds * K(j, e);
                        rdk[(((size_t)bi * c.hkv + gi) * c.tk + j) * c.d + e] += scale * ds * Q(i, e);
                    }
                    for (int e = 0; e < c.dv; ++e)
                        rdv[(((size_t)bi * c.hkv + gi) * c.tk + j) * c.dv + e] += P[j] * G(i, e);
                }
            }
        }
    // The key range of every query row as the host side computes it (causality, the window, the
    // document's span; padding is left to the kernel), and for the rows of every key a superset,
    // [0, T_q).
    std::vector<long long> ranges, key_ranges;
    for (int bi = 0; bi < c.b; ++bi) {
        for (int i = 0; i < c.tq; ++i) {
            long long pos = i + off, lo = c.window ? std::max(0LL, pos + 1 - c.window) : 0;
            long long hi = c.causal ? pos + 1 : c.tk;
            if (!c.docs.empty()) {
                long long own = ids[(size_t)bi * c.tk + pos], first = c.tk, last = -1;
                for (int j = 0; j < c.tk; ++j)
                    if (ids[(size_t)bi * c.tk + j] == own) { first = std::min<long long>(first, j); last = j; }
                lo = std::max(lo, first);
                hi = std::min(hi, last + 1);
            }
            ranges.push_back(lo);
            ranges.push_back(hi);
        }
        for (int j = 0; j < c.tk; ++j) {
            key_ranges.push_back(0);
            key_ranges.push_back(c.tq);
        }
    }
    FlashParams p{};
    long long qs[3] = {(long long)c.h * c.tq * c.d, (long long)c.tq * c.d, c.d};
    long long ks[3] = {(long long)c.hkv * c.tk * c.d, (long long)c.tk * c.d, c.d};
    long long vs[3] = {(long long)c.hkv * c.tk * c.dv, (long long)c.tk * c.dv, c.dv};
    for (int i = 0; i < 3; ++i) { p.qs[i] = qs[i]; p.ks[i] = ks[i]; p.vs[i] = vs[i]; }
    p.b = c.b; p.h = c.h; p.rep = rep; p.tq = c.tq; p.tk = c.tk; p.d = c.d; p.dv = c.dv;
    p.off = off; p.ranges_per_batch = 1; p.has_ids = !c.docs.empty(); p.has_pad = !c.pad.empty();
    p.scale = (float)scale;
    auto tq_ = as<T>(q), tk_ = as<T>(k), tv_ = as<T>(v), tg_ = as<T>(g);
    std::vector<T> y(ny), dq(nq), dk(nk), dv(nv);
    std::vector<float> lse((size_t)c.b * c.h * c.tq), delta(lse.size());
    auto blocks = [](long long rows) { return dim3{(unsigned)((rows + FLASH_WARPS - 1) / FLASH_WARPS), 1, 1}; };
    dim3 block{32 * FLASH_WARPS, 1, 1};
    long long rows = (long long)c.b * c.h * c.tq, keys = (long long)c.b * c.hkv * c.tk;
    emu_launch(blocks(rows), block, [&] {
        flash_fwd<T>(tq_.data(), tk_.data(), tv_.data(), y.data(), lse.data(), ranges.data(),
                     ids.data(), pad.data(), p);
    });
    emu_launch(blocks(rows), block, [&] {
        flash_bwd_dq<T>(tq_.data(), tk_.data(), tv_.data(), y.data(), tg_.data(), lse.data(),
                        delta.data(), dq.data(), ranges.data(), ids.data(), pad.data(), p);
    });
    emu_launch(blocks(keys), block, [&] {
        flash_bwd_dkv<T>(tq_.data(), tk_.data(), tv_.data(), tg_.data(), lse.data(), delta.data(),
                         dk.data(), dv.data(), ranges.data(), key_ranges.data(), ids.data(),
                         pad.data(), p);
    });
    // The log-sum-exp: -inf exactly where the reference's is.
    double lse_err = 0.0;
    for (size_t i = 0; i < rl.size(); ++i) {
        double e = std::isinf(rl[i]) ? (std::isinf(lse[i]) && lse[i] < 0 ? 0.0 : 1.0)
                                     : std::fabs(lse[i] - rl[i]) / std::max(1.0, std::fabs(rl[i]));
        if (!(e <= lse_err)) lse_err = e;
    }
    std::string name = "flash " + c.name + " " + type;
    report(name + " forward", rel(widen(y), ry), tol);
    report(name + " log-sum-exp", lse_err, 1e-5);
    report(name + " dq", rel(widen(dq), rdq), 4 * tol);
    report(name + " dk", rel(widen(dk), rdk), 4 * tol);
    report(name + " dv", rel(widen(dv), rdv), 4 * tol);
}

// A NaN in a query gives NaN in that row's output, never the zeros of a masked row.
static void check_nan() {
    auto q = data(24, 1), k = data(24, 2), v = data(24, 3);
    q[8 + 2] = NAN;  // row 1
    std::vector<long long> ranges = {0, 1, 0, 2, 0, 3}, none(3, 0);
    std::vector<unsigned char> pad(3, 0);
    FlashParams p{};
    long long s[3] = {24, 24, 8};
    for (int i = 0; i < 3; ++i) { p.qs[i] = s[i]; p.ks[i] = s[i]; p.vs[i] = s[i]; }
    p.b = 1; p.h = 1; p.rep = 1; p.tq = 3; p.tk = 3; p.d = 8; p.dv = 8; p.scale = 0.35f;
    std::vector<float> y(24), lse(3);
    emu_launch(dim3{1, 1, 1}, dim3{128, 1, 1}, [&] {
        flash_fwd<float>(q.data(), k.data(), v.data(), y.data(), lse.data(), ranges.data(),
                         none.data(), pad.data(), p);
    });
    bool ok = true;
    for (int i = 0; i < 24; ++i) ok = ok && (std::isnan(y[i]) == (i / 8 == 1));
    ok = ok && std::isnan(lse[1]) && !std::isnan(lse[0]) && !std::isnan(lse[2]);
    report("flash NaN query row gives NaN (only there)", ok ? 0.0 : 1.0, 0.0);
}

int main() {
    std::vector<Case> cases = {
        {"causal [1,2,40,40,16]", 1, 2, 2, 40, 40, 16, 16, true, 0, {}, {}},
        {"not causal, D_v != D, wide [1,1,33,70,72/40]", 1, 1, 1, 33, 70, 72, 40, false, 0, {}, {}},
        {"causal T_q < T_k [1,1,5,37,8]", 1, 1, 1, 5, 37, 8, 8, true, 0, {}, {}},
        {"window 6, GQA 4/2 [1,4,30,30,8]", 1, 4, 2, 30, 30, 8, 8, true, 6, {}, {}},
        {"documents 10+1+13 causal, padding [2,2,24,24,8]", 2, 2, 1, 24, 24, 8, 8, true, 0, {10, 1, 13}, {0, 5}},
        {"documents, not causal [1,2,20,20,8]", 1, 2, 2, 20, 20, 8, 8, false, 0, {7, 13}, {}},
        {"every key of a row padded [2,1,9,9,8]", 2, 1, 1, 9, 9, 8, 8, false, 0, {}, {9, 2}},
        {"head width 256 [1,1,6,6,256]", 1, 1, 1, 6, 6, 256, 256, true, 0, {}, {}},
    };
    for (const auto& c : cases) check<float>(c, "f32", 2e-5);
    check<bf16_t>(cases[3], "bf16", 2e-2);
    check<f16_t>(cases[4], "f16", 3e-3);
    check_nan();
    std::printf("cuda_emulation (flash): %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
