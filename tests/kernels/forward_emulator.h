// Host emulation of what arrayattn/attention/cuda/attn_fwd.cu uses, so the CPU tests run the
// forward kernels' own code (not a transliteration). Include this, then attn_fwd.cu.
//
// The threads, blocks, shared memory (0xFF-filled before each block) and warp collectives
// are emulator_warp.h's (shared with the backward's emulator); this file adds the forward
// kernels' own wrappers (shared-memory addresses as 32-bit offsets) and cp.async.
// cp.async is emulated faithfully enough to test the pipeline's bookkeeping: copies are
// queued per thread, commit closes a group, and wait_group N performs every group but
// the N most recent; so data read before its wait shows up as stale or NaN. With
// AA_EMU_EAGER=1 copies land at issue instead (write-after-read hazards).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>

#include "emulator_warp.h"

#define AA_FWD_EMULATION 1

#include "common.cuh"  // (from arrayattn/attention/cuda, on the include path)

using std::fma;
using std::log2;
using std::max;
using std::min;

using AaDim3 = AaEmuDim3;

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

// ---- shared memory and cp.async queues -------------------------------------------------
struct AaCopy {
    unsigned char* dst;
    const unsigned char* src;  // nullptr: zero-fill
    int bytes;
};

inline thread_local std::vector<std::vector<AaCopy>> aa_emu_groups;  // committed groups
inline thread_local std::vector<AaCopy> aa_emu_open;                  // not yet committed

#define aa_smem (aa_emu_smem())

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

// ldmatrix (emulator_warp.h) from a shared-memory offset.
inline void aa_emu_ldsm(aa_u32 addr, aa_u32 (&r)[4], bool trans) {
    aa_emu_ldsm(r, aa_emu_smem() + addr, trans);
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

// mma.sync m16n8k16 and operand packing (emulator_warp.h) for the kernels' dtype tag
// (0: float16, 1: bfloat16).
template <int DT>
inline void aa_mma(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
    aa_emu_mma(c, a, b0, b1, DT == 1);
}

template <int DT>
inline aa_u32 aa_pack2(float lo, float hi) {
    return aa_emu_pack2(lo, hi, DT == 1);
}

// aa_fwd_tf32's operand split (the kernel's own bit arithmetic) and its mma.
inline aa_u32 aa_tf32_round(float x) {
    aa_u32 u;
    std::memcpy(&u, &x, 4);
    return (u + 0x1000u) & 0xFFFFE000u;
}
inline void aa_split_tf32(float x, aa_u32& big, aa_u32& small) {
    big = aa_tf32_round(x);
    float b;
    std::memcpy(&b, &big, 4);
    small = aa_tf32_round(x - b);
}
inline void aa_mma_tf32(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
    aa_emu_mma_tf32(c, a, b0, b1);
}

// __any_sync (aa_fwd_tc2's rescale vote): every lane of the warp takes part, as the
// kernels call it with the full mask; the two warp barriers order the exchange.
inline int __any_sync(unsigned, int pred) {
    AaEmuWarp& w = aa_emu_warp();
    w.val[aa_emu_lane()] = pred ? 1.0 : 0.0;
    w.bar.arrive_and_wait();
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= w.val[l] != 0.0;
    w.bar.arrive_and_wait();
    return any;
}

// ---- launch --------------------------------------------------------------------------
inline void aa_emu_launch(AaDim3 grid, int nthreads, size_t smem_bytes,
                          const std::function<void()>& body) {
    aa_emu_run_blocks(grid, nthreads, smem_bytes, [&] {
        aa_emu_groups.clear();
        aa_emu_open.clear();
        body();
        // A kernel must not exit with copies in flight into smem that a later block
        // reuses; the emulator flags it.
        if (!aa_emu_groups.empty() || !aa_emu_open.empty()) std::abort();
    });
}
