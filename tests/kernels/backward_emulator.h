// Host emulation of the CUDA features arrayattn/attention/cuda/attn_bwd.cu uses, so the CPU
// tests run the backward kernels' own code (not a transliteration). The threads, blocks,
// shared memory and warp collectives are emulator_warp.h's (shared with the forward's
// emulator); this file adds what the backward kernels call beyond those.
#pragma once

#include <vector_types.h>      // uint4, make_uint4 (the kernels' 16-byte copies)
#include <vector_functions.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "emulator_warp.h"

#define AA_BWD_EMULATION 1
#define AA_HOST_EMULATION 1  // elem16.cuh: the tags and conversions below

using std::max;
using std::min;

inline float atomicAdd(float* p, float v) {
    return std::atomic_ref<float>(*p).fetch_add(v, std::memory_order_relaxed);
}
inline double atomicAdd(double* p, double v) {
    return std::atomic_ref<double>(*p).fetch_add(v, std::memory_order_relaxed);
}

inline double __longlong_as_double(long long x) {
    double f;
    std::memcpy(&f, &x, 8);
    return f;
}

inline void aa_ldsm_x4(aa_u32 (&r)[4], const void* p) { aa_emu_ldsm(r, p, false); }
inline void aa_ldsm_x4_t(aa_u32 (&r)[4], const void* p) { aa_emu_ldsm(r, p, true); }

struct AaF16 {};   // elem16.cuh's 16-bit type tags
struct AaBF16 {};

inline float aa_f16_to_f(unsigned short x) { return aa_emu_bits_to_float(x, false); }
inline unsigned short aa_f_to_f16(float x) { return aa_emu_float_to_bits(x, false); }
inline float aa_bf16_to_f(unsigned short x) { return aa_emu_bits_to_float(x, true); }
inline unsigned short aa_f_to_bf16(float x) { return aa_emu_float_to_bits(x, true); }

template <typename T> struct AaMma;
template <> struct AaMma<AaF16> {
    static void run(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
        aa_emu_mma(c, a, b0, b1, false);
    }
    static aa_u32 pack(float lo, float hi) { return aa_emu_pack2(lo, hi, false); }
};
template <> struct AaMma<AaBF16> {
    static void run(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
        aa_emu_mma(c, a, b0, b1, true);
    }
    static aa_u32 pack(float lo, float hi) { return aa_emu_pack2(lo, hi, true); }
};

// cp.async of the v2 kernels (aa_bwd_cp16 / aa_bwd_cp4 / commit / wait_group 0), emulated
// as forward_emulator.h does it: copies queue per thread, commit closes a group and
// wait_group 0 performs this thread's groups, so data read before its wait and barrier is
// stale (0xFF: NaN) and shows up. AA_EMU_EAGER=1: copies land at issue instead, which
// exposes a copy into a buffer other threads still read.
struct AaBwdCopy {
    unsigned char* dst;
    const unsigned char* src;  // nullptr: zero-fill
    int bytes;
};
inline thread_local std::vector<std::vector<AaBwdCopy>> aa_bwd_emu_groups;
inline thread_local std::vector<AaBwdCopy> aa_bwd_emu_open;
inline const bool aa_bwd_emu_eager = std::getenv("AA_EMU_EAGER") != nullptr;

inline void aa_bwd_emu_copy(void* dst, const void* src, int bytes) {
    if (reinterpret_cast<std::uintptr_t>(dst) % bytes) std::abort();  // size-aligned dst
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    if (aa_bwd_emu_eager) {
        if (s) std::memcpy(d, s, bytes);
        else std::memset(d, 0, bytes);
        return;
    }
    aa_bwd_emu_open.push_back({d, s, bytes});
}
inline void aa_bwd_cp16(void* dst, const void* src, bool valid) {
    if (valid && reinterpret_cast<std::uintptr_t>(src) % 16) std::abort();  // aligned rows
    aa_bwd_emu_copy(dst, valid ? src : nullptr, 16);
}
inline void aa_bwd_cp4(void* dst, const void* src) { aa_bwd_emu_copy(dst, src, 4); }
inline void aa_bwd_cp_commit() {
    aa_bwd_emu_groups.push_back(std::move(aa_bwd_emu_open));
    aa_bwd_emu_open.clear();
}
inline void aa_bwd_cp_wait_all() {
    if (!aa_bwd_emu_open.empty()) std::abort();  // an uncommitted copy would never land
    for (const auto& grp : aa_bwd_emu_groups)
        for (const AaBwdCopy& c : grp) {
            if (c.src) std::memcpy(c.dst, c.src, c.bytes);
            else std::memset(c.dst, 0, c.bytes);
        }
    aa_bwd_emu_groups.clear();
}

// Launch `call` (which runs the kernel body for the current thread) over a grid. Each
// block starts with empty cp.async queues, as on a fresh thread (aa_emu_run_blocks reuses
// the launch's threads block after block).
template <typename F>
void aa_emu_launch(AaEmuDim3 grid, int nthreads, size_t smem_bytes, F call) {
    aa_emu_run_blocks(grid, nthreads, smem_bytes, [&] {
        aa_bwd_emu_groups.clear();
        aa_bwd_emu_open.clear();
        call();
    });
}

// red.global.add.v2.f32 of the v2 kernels: two relaxed float atomics.
inline void aa_bwd_red2(float* p, float a, float b) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}
