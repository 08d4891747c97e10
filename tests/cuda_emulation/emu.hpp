// Just enough of CUDA to run src/nn/kernels.cu (and flash.cu) on the CPU: every CUDA thread of a block is an OS
// thread, `__syncthreads` is a barrier of the block, a warp shuffle exchanges values through a
// per-warp buffer between two barriers of the warp, `__shared__` arrays are statics (blocks run one
// after another), and the PTX half-precision conversions are done in software (round to nearest
// even, like `cvt.rn.f16.f32`). Used by tests/cuda_emulation/check.cpp.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define ACCEL_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

struct Warp {
    explicit Warp(int n) : bar(n) {}
    std::barrier<> bar;
    float f[32] = {};
    double d[32] = {};
};

inline thread_local std::barrier<>* emu_block_barrier = nullptr;
inline thread_local Warp* emu_warp = nullptr;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int o) {
    int lane = threadIdx.x & 31;
    emu_warp->bar.arrive_and_wait();
    emu_warp->f[lane] = v;
    emu_warp->bar.arrive_and_wait();
    return emu_warp->f[lane ^ o];
}

inline double __shfl_xor_sync(unsigned, double v, int o) {
    int lane = threadIdx.x & 31;
    emu_warp->bar.arrive_and_wait();
    emu_warp->d[lane] = v;
    emu_warp->bar.arrive_and_wait();
    return emu_warp->d[lane ^ o];
}

inline float __shfl_sync(unsigned, float v, int src) {
    int lane = threadIdx.x & 31;
    emu_warp->bar.arrive_and_wait();
    emu_warp->f[lane] = v;
    emu_warp->bar.arrive_and_wait();
    return emu_warp->f[src & 31];
}

inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar.arrive_and_wait(); }

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}

// IEEE half <-> float.
inline float emu_half_to_float(unsigned short h) {
    unsigned sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) {
        v = std::ldexp((float)man, -24);
    } else if (exp == 31) {
        v = man ? NAN : INFINITY;
    } else {
        v = std::ldexp((float)(man | 0x400), (int)exp - 25);
    }
    return sign ? -v : v;
}

inline unsigned short emu_float_to_half(float f) {
    unsigned int u = __float_as_uint(f);
    unsigned short sign = (unsigned short)((u >> 16) & 0x8000);
    if ((u & 0x7fffffff) > 0x7f800000) return (unsigned short)(sign | 0x7e00);  // NaN
    double a = std::fabs((double)f);
    if (a == 0.0) return sign;
    if (a >= 65520.0) return (unsigned short)(sign | 0x7c00);  // rounds to infinity
    // Scale to units of the last place of the result, round to nearest even.
    int e;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int exp = e - 1;  // a in [2^exp, 2^(exp+1))
    if (exp < -14) exp = -14;  // subnormal range shares the smallest exponent
    double ulp = std::ldexp(1.0, exp - 10);
    double q = std::nearbyint(a / ulp);  // default rounding mode: to nearest even
    unsigned int bits;
    if (exp == -14 && q < 1024.0) {
        bits = (unsigned int)q;  // subnormal (or zero)
    } else {
        if (q >= 2048.0) {  // rounding carried into the next binade
            q /= 2.0;
            exp += 1;
        }
        if (exp > 15) return (unsigned short)(sign | 0x7c00);
        bits = (unsigned int)((exp + 15) << 10) | ((unsigned int)q & 0x3ff);
    }
    return (unsigned short)(sign | bits);
}

// CUDA's atomic exchange of an unsigned int: every emulated thread is an OS thread.
inline unsigned int atomicExch(unsigned int* a, unsigned int v) {
    return std::atomic_ref<unsigned int>(*a).exchange(v);
}

// Runs `kernel` (a callable with no arguments reading threadIdx/blockIdx) over `grid` x `block`.
template <typename F>
void emu_launch(dim3 grid, dim3 block, F kernel) {
    gridDim = grid;
    blockDim = block;
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            std::barrier<> bar((std::ptrdiff_t)block.x);
            unsigned nwarps = (block.x + 31) / 32;
            std::vector<std::unique_ptr<Warp>> warps;
            for (unsigned w = 0; w < nwarps; ++w) {
                unsigned n = block.x - w * 32 < 32 ? block.x - w * 32 : 32;
                warps.push_back(std::make_unique<Warp>((int)n));
            }
            std::vector<std::thread> threads;
            threads.reserve(block.x);
            for (unsigned t = 0; t < block.x; ++t) {
                threads.emplace_back([&, t, bx, by] {
                    threadIdx = dim3{t, 0, 0};
                    blockIdx = dim3{bx, by, 0};
                    emu_block_barrier = &bar;
                    emu_warp = warps[t / 32].get();
                    kernel();
                });
            }
            for (auto& th : threads) th.join();
        }
    }
}
