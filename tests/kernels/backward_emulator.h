// Host emulation of the CUDA features arrayattn/kernels/attn_bwd.cu uses, so the CPU
// tests run the backward kernels' own code (not a transliteration).
//
// One OS thread per CUDA thread, blocks run one after another. __syncthreads is a barrier
// over the block's threads; warp-collective operations (ldmatrix, mma.sync m16n8k16,
// __shfl_xor_sync) exchange through a per-warp scratch area between two barriers of the
// warp's 32 threads, following the PTX ISA's fragment layouts. Shared memory starts
// filled with 0xFF bytes (NaN as floats) so reads of unwritten shared memory show up.
// Floating-point results differ from the GPU only by rounding order (exp2 and the mma
// accumulation are computed in higher precision here).
#pragma once

#include "emulator_barrier.h"

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <vector_functions.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n)
#define AA_BWD_EMULATION 1

using std::max;
using std::min;

struct AaEmuDim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local AaEmuDim3 threadIdx, blockIdx, blockDim, gridDim;

struct AaEmuWarp {
    AaEmuBarrier bar{32};
    const void* addr[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    double val[32];
};

struct AaEmuBlock {
    std::unique_ptr<AaEmuBarrier> bar;
    std::vector<unsigned char> smem;
    std::vector<std::unique_ptr<AaEmuWarp>> warps;
};

inline thread_local AaEmuBlock* aa_emu_block = nullptr;
inline thread_local int aa_emu_tid = 0;

inline unsigned char* aa_emu_smem() { return aa_emu_block->smem.data(); }
inline void __syncthreads() { aa_emu_block->bar->arrive_and_wait(); }
inline AaEmuWarp& aa_emu_warp() { return *aa_emu_block->warps[aa_emu_tid / 32]; }
inline int aa_emu_lane() { return aa_emu_tid % 32; }

template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int mask) {
    AaEmuWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    w.val[l] = static_cast<double>(v);
    w.bar.arrive_and_wait();
    const V r = static_cast<V>(w.val[l ^ mask]);
    w.bar.arrive_and_wait();
    return r;
}

inline float atomicAdd(float* p, float v) {
    return std::atomic_ref<float>(*p).fetch_add(v, std::memory_order_relaxed);
}
inline double atomicAdd(double* p, double v) {
    return std::atomic_ref<double>(*p).fetch_add(v, std::memory_order_relaxed);
}

inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline double __longlong_as_double(long long x) {
    double f;
    std::memcpy(&f, &x, 8);
    return f;
}

inline float aa_exp2(float x) { return static_cast<float>(std::exp2(static_cast<double>(x))); }
inline double aa_exp2(double x) { return std::exp2(x); }

typedef unsigned int aa_u32;

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8i..8i+7 give the row addresses
// of matrix i; register i of lane l holds (row l/4, cols 2(l%4), 2(l%4)+1), or with
// .trans (rows 2(l%4), 2(l%4)+1, col l/4); the lower column/row in the low half.
inline void aa_emu_ldsm(aa_u32 (&r)[4], const void* p, bool trans) {
    AaEmuWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    w.addr[l] = p;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!trans) {
            const uint16_t* row = static_cast<const uint16_t*>(w.addr[8 * i + l / 4]);
            lo = row[2 * (l % 4)];
            hi = row[2 * (l % 4) + 1];
        } else {
            lo = static_cast<const uint16_t*>(w.addr[8 * i + 2 * (l % 4)])[l / 4];
            hi = static_cast<const uint16_t*>(w.addr[8 * i + 2 * (l % 4) + 1])[l / 4];
        }
        r[i] = static_cast<aa_u32>(lo) | (static_cast<aa_u32>(hi) << 16);
    }
    w.bar.arrive_and_wait();
}
inline void aa_ldsm_x4(aa_u32 (&r)[4], const void* p) { aa_emu_ldsm(r, p, false); }
inline void aa_ldsm_x4_t(aa_u32 (&r)[4], const void* p) { aa_emu_ldsm(r, p, true); }

inline float aa_emu_bits_to_float(uint16_t bits, bool bf16) {
    if (bf16) {
        const uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    __half h;
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: A 16x16 (a0:(g,2c..) a1:(g+8,2c..)
// a2:(g,2c+8..) a3:(g+8,2c+8..)), B 16x8 (b0:(k=2c..,n=g) b1:(k=2c+8..,n=g)),
// C 16x8 (c0,c1:(g,2c..) c2,c3:(g+8,2c..)), g = lane/4, c = lane%4.
inline void aa_emu_mma(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1, bool bf16) {
    AaEmuWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
    w.b[l][0] = b0;
    w.b[l][1] = b1;
    w.bar.arrive_and_wait();
    auto A = [&](int row, int k) {
        const int lane = (row % 8) * 4 + (k % 8) / 2;
        const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return aa_emu_bits_to_float(static_cast<uint16_t>(w.a[lane][reg] >> (16 * (k % 2))), bf16);
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2;
        const int reg = k >= 8 ? 1 : 0;
        return aa_emu_bits_to_float(static_cast<uint16_t>(w.b[lane][reg] >> (16 * (k % 2))), bf16);
    };
    float out[4];
    for (int r = 0; r < 4; ++r) {
        const int row = l / 4 + 8 * (r / 2);
        const int col = 2 * (l % 4) + (r % 2);
        double sum = c[r];
        for (int k = 0; k < 16; ++k) sum += static_cast<double>(A(row, k)) * B(k, col);
        out[r] = static_cast<float>(sum);
    }
    w.bar.arrive_and_wait();
    for (int r = 0; r < 4; ++r) c[r] = out[r];
}

struct AaF16;   // the kernel file's 16-bit type tags
struct AaBF16;

inline float aa_bwd_f16_to_f(unsigned short x) {
    __half h;
    std::memcpy(&h, &x, 2);
    return __half2float(h);
}
inline unsigned short aa_bwd_f_to_f16(float x) {
    __half h = __float2half_rn(x);
    unsigned short r;
    std::memcpy(&r, &h, 2);
    return r;
}
inline float aa_bwd_bf16_to_f(unsigned short x) { return aa_emu_bits_to_float(x, true); }
inline unsigned short aa_bwd_f_to_bf16(float x) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    unsigned short r;
    std::memcpy(&r, &h, 2);
    return r;
}

template <typename T> struct AaMma;
template <> struct AaMma<AaF16> {
    static void run(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
        aa_emu_mma(c, a, b0, b1, false);
    }
    static aa_u32 pack(float lo, float hi) {
        return static_cast<aa_u32>(aa_bwd_f_to_f16(lo)) |
               (static_cast<aa_u32>(aa_bwd_f_to_f16(hi)) << 16);
    }
};
template <> struct AaMma<AaBF16> {
    static void run(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
        aa_emu_mma(c, a, b0, b1, true);
    }
    static aa_u32 pack(float lo, float hi) {
        return static_cast<aa_u32>(aa_bwd_f_to_bf16(lo)) |
               (static_cast<aa_u32>(aa_bwd_f_to_bf16(hi)) << 16);
    }
};

// Launch `call` (which runs the kernel body for the current thread) over a grid.
template <typename F>
void aa_emu_launch(AaEmuDim3 grid, int nthreads, size_t smem_bytes, F call) {
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                AaEmuBlock blk;
                blk.bar = std::make_unique<AaEmuBarrier>(nthreads);
                blk.smem.assign(smem_bytes + 16, 0xFF);
                for (int w = 0; w < (nthreads + 31) / 32; ++w)
                    blk.warps.push_back(std::make_unique<AaEmuWarp>());
                std::vector<std::thread> threads;
                threads.reserve(nthreads);
                for (int t = 0; t < nthreads; ++t)
                    threads.emplace_back([&, t, x, y, z] {
                        threadIdx = {static_cast<unsigned>(t), 0, 0};
                        blockIdx = {x, y, z};
                        blockDim = {static_cast<unsigned>(nthreads), 1, 1};
                        gridDim = grid;
                        aa_emu_block = &blk;
                        aa_emu_tid = t;
                        call();
                    });
                for (auto& th : threads) th.join();
            }
}

// Unpack CUDA-style kernel parameters (an array of pointers to each argument's value).
template <typename... A, std::size_t... I>
void aa_emu_call_impl(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(params[I])...);
}
template <typename... A>
void aa_emu_call(void (*f)(A...), void** params) {
    aa_emu_call_impl(f, params, std::index_sequence_for<A...>{});
}
