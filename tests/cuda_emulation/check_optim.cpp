// Runs the fused optimizer kernels of src/optim/fused_optim.cu on the CPU (emu.hpp) with the launch
// shape src/optim/fused_cuda.rs uses, and compares them with the update written here from
// src/optim/fused.rs's formulas (f32 arithmetic, the stored state rounded to its type, the momentum
// buffer before it is used). f32 must match bit for bit; bf16/f16 too (the same operations).
// Built and run by tests/it/cuda_emulation.rs.
#include "emu.hpp"

#include "../../src/cuda_prelude.cu"
#include "../../src/optim/fused_optim.cu"

#include <cstdio>
#include <string>

static int failures = 0;

static dim3 grid_for(unsigned long long n) {
    unsigned long long b = (n + 255) / 256;
    if (b < 1) b = 1;
    if (b > 4096) b = 4096;
    return dim3{(unsigned)b, 1, 1};
}

static float val(unsigned i, unsigned salt) {
    unsigned s = (i + 1) * 2654435761u + salt * 40503u;
    s ^= s >> 13;
    s *= 1274126177u;
    return ((float)(s >> 8) / (float)(1u << 24) - 0.5f) * 2.0f;
}

template <typename T>
static void check(const char* type, unsigned long long n) {
    std::vector<T> p(n), m(n), v(n), g(n), buf(n);
    for (unsigned i = 0; i < n; ++i) {
        p[i] = from_f<T>(val(i, 1));
        m[i] = from_f<T>(val(i, 2) * 0.1f);
        v[i] = from_f<T>(std::fabs(val(i, 3)) * 0.01f);
        g[i] = from_f<T>(val(i, 4));
        buf[i] = from_f<T>(val(i, 5));
    }
    // AdamW, one step with the scalars of step 3.
    float b1 = 0.9f, c1 = 1.0f - 0.9f, b2 = 0.999f, c2 = 1.0f - 0.999f;
    float sm = (float)(1.0 / (1.0 - std::pow(0.9, 3))), sv = (float)(1.0 / (1.0 - std::pow(0.999, 3)));
    float eps = 1e-8f, lr = 1e-3f, decay = 1.0f - 1e-3f * 0.01f;
    std::vector<T> rp = p, rm = m, rv = v;
    for (unsigned i = 0; i < n; ++i) {
        float gi = to_f(g[i]);
        float mi = to_f(rm[i]) * b1 + gi * c1;
        float vi = to_f(rv[i]) * b2 + (gi * gi) * c2;
        float adjusted = (mi * sm) / (std::sqrt(vi * sv) + eps);
        rp[i] = from_f<T>(to_f(rp[i]) * decay - adjusted * lr);
        rm[i] = from_f<T>(mi);
        rv[i] = from_f<T>(vi);
    }
    std::vector<T> kp = p, km = m, kv = v;
    emu_launch(grid_for(n), dim3{256, 1, 1}, [&] {
        adamw<T>(kp.data(), km.data(), kv.data(), g.data(), n, b1, c1, b2, c2, sm, sv, eps, decay, lr);
    });
    auto same = [&](const std::vector<T>& a, const std::vector<T>& b) {
        return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
    };
    bool ok = same(kp, rp) && same(km, rm) && same(kv, rv);
    std::printf("%s adamw %s n=%llu: %s\n", ok ? "PASS" : "FAIL", type, n, ok ? "bit for bit" : "differs");
    failures += !ok;
    // SGD: momentum, Nesterov, weight decay; a first step and a later one.
    for (int first = 1; first >= 0; --first) {
        float slr = 0.05f, wd = 1e-3f, mu = 0.9f, c = 1.0f;
        std::vector<T> sp = p, sb = buf;
        for (unsigned i = 0; i < n; ++i) {
            float d = to_f(sp[i]) * wd + to_f(g[i]);
            T bi = from_f<T>(first ? d : to_f(sb[i]) * mu + d * c);
            sb[i] = bi;
            float step = d + to_f(bi) * mu;
            sp[i] = from_f<T>(to_f(sp[i]) - step * slr);
        }
        std::vector<T> qp = p, qb = buf;
        emu_launch(grid_for(n), dim3{256, 1, 1}, [&] {
            sgd<T>(qp.data(), qb.data(), g.data(), n, slr, wd, 1, mu, c, 1, first, 1);
        });
        bool ok2 = same(qp, sp) && same(qb, sb);
        std::printf("%s sgd %s n=%llu first=%d: %s\n", ok2 ? "PASS" : "FAIL", type, n, first,
                    ok2 ? "bit for bit" : "differs");
        failures += !ok2;
    }
}

// The finiteness flag: set by one infinity or NaN anywhere (the last element included), left
// alone by finite values (the largest and smallest too).
template <typename T>
static void check_nonfinite(const char* type, unsigned long long n) {
    std::vector<T> x(n);
    for (unsigned i = 0; i < n; ++i) x[i] = from_f<T>(val(i, 6));
    auto flag_of = [&](const std::vector<T>& v) {
        unsigned int flag = 0;
        emu_launch(grid_for(n), dim3{256, 1, 1}, [&] { nonfinite<T>(v.data(), n, &flag); });
        return flag;
    };
    bool ok = flag_of(x) == 0;
    std::vector<T> big = x;
    big[0] = from_f<T>(-65504.0f);  // the largest f16; finite in every type
    ok = ok && flag_of(big) == 0;
    float bad[] = {INFINITY, -INFINITY, NAN};
    for (float b : bad) {
        for (unsigned long long at : {0ull, n / 2, n - 1}) {
            std::vector<T> y = x;
            y[at] = from_f<T>(b);
            ok = ok && flag_of(y) == 1;
        }
    }
    std::printf("%s nonfinite %s n=%llu: %s\n", ok ? "PASS" : "FAIL", type, n,
                ok ? "flags infinities and NaNs only" : "wrong flag");
    failures += !ok;
}

int main() {
    for (unsigned long long n : {1ull, 300ull, 2000ull}) {
        check_nonfinite<float>("f32", n);
        check_nonfinite<bf16_t>("bf16", n);
        check_nonfinite<f16_t>("f16", n);
    }
    for (unsigned long long n : {1ull, 255ull, 1000ull}) {
        check<float>("f32", n);
        check<bf16_t>("bf16", n);
        check<f16_t>("f16", n);
    }
    std::printf("cuda_emulation (optim): %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
