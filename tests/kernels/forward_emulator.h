// Host emulation of what arrayattn/kernels/attn_fwd.cu uses, so the CPU tests run the
// forward kernels' own code (not a transliteration). Include this, then attn_fwd.cu.
//
// One OS thread per CUDA thread; blocks run one after another and share one shared-memory
// buffer, refilled with 0xFF bytes (NaN as float/half) before each block so a read of
// shared memory nothing wrote shows up as NaN. Warp collectives (ldmatrix, mma.sync,
// shuffles) exchange values through a per-warp scratch area between barriers of the
// warp's 32 threads, following the PTX ISA fragment layouts written out below.
// cp.async is emulated faithfully enough to test the pipeline's bookkeeping: copies are
// queued per thread, commit closes a group, and wait_group N performs every group but
// the N most recent; so data read before its wait shows up as stale or NaN. With
// AA_EMU_EAGER=1 copies land at issue instead (write-after-read hazards).
#pragma once

#include "emulator_barrier.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n)
#define AA_FWD_EMULATION 1

#include "common.cuh"  // (from arrayattn/kernels, on the include path)

using std::fma;
using std::log2;
using std::max;
using std::min;

struct AaDim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local AaDim3 threadIdx, blockIdx, gridDim;

struct uint4 {
    unsigned x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};
struct double2 {
    double x, y;
};

// ---- numerics (common.cuh leaves them to the device) ----------------------------------
inline float aa_exp2(float x) { return static_cast<float>(std::exp2(static_cast<double>(x))); }
inline double aa_exp2(double x) { return std::exp2(x); }
inline float aa_softcap(float s, float cap, float inv_cap) { return cap * std::tanh(s * inv_cap); }
inline double aa_softcap(double s, double cap, double inv_cap) {
    return cap * std::tanh(s * inv_cap);
}
inline float aa_neg_inf_f() { return -INFINITY; }
inline double aa_neg_inf_d() { return -static_cast<double>(INFINITY); }
template <typename A>
inline A aa_neg_inf() {
    return -std::numeric_limits<A>::infinity();
}
inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

// ---- blocks, warps, shared memory ----------------------------------------------------
struct AaWarp {
    AaEmuBarrier bar{32};
    const unsigned char* addr[32];
    aa_u32 a[32][4];
    aa_u32 b[32][2];
    double val[32];
};

struct AaCopy {
    unsigned char* dst;
    const unsigned char* src;  // nullptr: zero-fill
    int bytes;
};

struct AaBlock {
    std::unique_ptr<AaEmuBarrier> bar;
    std::vector<std::unique_ptr<AaWarp>> warps;
};

inline std::vector<unsigned char> aa_emu_smem_buf;
inline thread_local AaBlock* aa_emu_blk = nullptr;
inline thread_local int aa_emu_tid = 0;
inline thread_local std::vector<std::vector<AaCopy>> aa_emu_groups;  // committed groups
inline thread_local std::vector<AaCopy> aa_emu_open;                  // not yet committed

inline unsigned char* aa_emu_smem() { return aa_emu_smem_buf.data(); }
#define aa_smem (aa_emu_smem())

inline void __syncthreads() { aa_emu_blk->bar->arrive_and_wait(); }
inline AaWarp& aa_emu_warp() { return *aa_emu_blk->warps[aa_emu_tid / 32]; }
inline int aa_emu_lane() { return aa_emu_tid % 32; }
inline void __syncwarp() { aa_emu_warp().bar.arrive_and_wait(); }

template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int mask) {
    AaWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    w.val[l] = static_cast<double>(v);
    w.bar.arrive_and_wait();
    const V r = static_cast<V>(w.val[l ^ mask]);
    w.bar.arrive_and_wait();
    return r;
}

// ---- PTX wrappers --------------------------------------------------------------------
inline aa_u32 aa_smem_u32(const void* p) {
    return static_cast<aa_u32>(static_cast<const unsigned char*>(p) - aa_emu_smem());
}
// AA_EMU_EAGER=1 in the environment: copies land at issue instead (the other extreme of
// real hardware), which exposes a copy into a buffer other threads still read.
inline const bool aa_emu_eager = std::getenv("AA_EMU_EAGER") != nullptr;

template <int BYTES>
inline void aa_cp_async(aa_u32 dst, const void* src, bool valid) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    if (dst % BYTES) std::abort();  // cp.async needs a size-aligned shared address
    if (aa_emu_eager) {
        if (valid) std::memcpy(aa_emu_smem() + dst, src, BYTES);
        else std::memset(aa_emu_smem() + dst, 0, BYTES);
        return;
    }
    aa_emu_open.push_back(
        {aa_emu_smem() + dst, valid ? static_cast<const unsigned char*>(src) : nullptr, BYTES});
}
inline void aa_cp_async16(aa_u32 dst, const void* src, bool valid) {
    aa_cp_async<16>(dst, src, valid);
}
inline void aa_cp_commit() {
    aa_emu_groups.push_back(std::move(aa_emu_open));
    aa_emu_open.clear();
}
template <int N>
inline void aa_cp_wait() {
    while (static_cast<int>(aa_emu_groups.size()) > N) {
        for (const AaCopy& c : aa_emu_groups.front()) {
            if (c.src) std::memcpy(c.dst, c.src, c.bytes);
            else std::memset(c.dst, 0, c.bytes);
        }
        aa_emu_groups.erase(aa_emu_groups.begin());
    }
}

// ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the 8 row addresses of matrix i. Without
// .trans, register i of lane l holds matrix i's (row l/4, cols 2(l%4), 2(l%4)+1); with
// .trans, (rows 2(l%4), 2(l%4)+1; col l/4). The first element goes in the low half.
inline void aa_emu_ldsm(aa_u32 addr, aa_u32 (&r)[4], bool trans) {
    AaWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    w.addr[l] = aa_emu_smem() + addr;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!trans) {
            const unsigned char* row = w.addr[8 * i + l / 4];
            std::memcpy(&lo, row + 2 * (2 * (l % 4)), 2);
            std::memcpy(&hi, row + 2 * (2 * (l % 4) + 1), 2);
        } else {
            std::memcpy(&lo, w.addr[8 * i + 2 * (l % 4)] + 2 * (l / 4), 2);
            std::memcpy(&hi, w.addr[8 * i + 2 * (l % 4) + 1] + 2 * (l / 4), 2);
        }
        r[i] = static_cast<aa_u32>(lo) | (static_cast<aa_u32>(hi) << 16);
    }
    w.bar.arrive_and_wait();
}
inline void aa_ldsm_x4(aa_u32 addr, aa_u32& r0, aa_u32& r1, aa_u32& r2, aa_u32& r3) {
    aa_u32 r[4];
    aa_emu_ldsm(addr, r, false);
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void aa_ldsm_x4_t(aa_u32 addr, aa_u32& r0, aa_u32& r1, aa_u32& r2, aa_u32& r3) {
    aa_u32 r[4];
    aa_emu_ldsm(addr, r, true);
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}

inline float aa_emu_half_to_float(uint16_t bits, int dt) {
    if (dt == 1) {
        const uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
inline uint16_t aa_emu_float_to_half(float x, int dt) {
    if (dt == 1) {  // bfloat16, round to nearest even (NaN kept quiet)
        uint32_t u;
        std::memcpy(&u, &x, 4);
        if (std::isnan(x)) return 0x7FC0;
        u += 0x7FFFu + ((u >> 16) & 1u);
        return static_cast<uint16_t>(u >> 16);
    }
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

// mma.m16n8k16.row.col, f32 accumulators. g = lane/4, c = lane%4:
// A 16x16: a0 (g, 2c..2c+1), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
// B 16x8:  b0 (k = 2c..2c+1, n = g), b1 (k = 2c+8.., n = g)
// C 16x8:  c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)
template <int DT>
inline void aa_mma(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
    AaWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
    w.b[l][0] = b0;
    w.b[l][1] = b1;
    w.bar.arrive_and_wait();
    auto A = [&](int row, int k) {
        const int lane = (row % 8) * 4 + (k % 8) / 2;
        const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return aa_emu_half_to_float(static_cast<uint16_t>(w.a[lane][reg] >> (16 * (k % 2))), DT);
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2;
        const int reg = k >= 8 ? 1 : 0;
        return aa_emu_half_to_float(static_cast<uint16_t>(w.b[lane][reg] >> (16 * (k % 2))), DT);
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

template <int DT>
inline aa_u32 aa_pack2(float lo, float hi) {
    return static_cast<aa_u32>(aa_emu_float_to_half(lo, DT)) |
           (static_cast<aa_u32>(aa_emu_float_to_half(hi, DT)) << 16);
}

// ---- launch --------------------------------------------------------------------------
inline void aa_emu_launch(AaDim3 grid, int nthreads, size_t smem_bytes,
                          const std::function<void()>& body) {
    aa_emu_smem_buf.assign(smem_bytes + 64, 0xFF);
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::fill(aa_emu_smem_buf.begin(), aa_emu_smem_buf.end(), 0xFF);
                AaBlock blk;
                blk.bar = std::make_unique<AaEmuBarrier>(nthreads);
                for (int w = 0; w < (nthreads + 31) / 32; ++w)
                    blk.warps.push_back(std::make_unique<AaWarp>());
                std::vector<std::thread> threads;
                threads.reserve(nthreads);
                for (int t = 0; t < nthreads; ++t)
                    threads.emplace_back([&, t, x, y, z] {
                        threadIdx = {static_cast<unsigned>(t), 0, 0};
                        blockIdx = {x, y, z};
                        gridDim = grid;
                        aa_emu_blk = &blk;
                        aa_emu_tid = t;
                        aa_emu_groups.clear();
                        aa_emu_open.clear();
                        body();
                        // A kernel must not exit with copies in flight into smem that a
                        // later block reuses; the emulator flags it.
                        if (!aa_emu_groups.empty() || !aa_emu_open.empty()) std::abort();
                    });
                for (auto& th : threads) th.join();
            }
}
