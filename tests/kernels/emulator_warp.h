// What both host emulators (forward_emulator.h, backward_emulator.h) share: CUDA's thread
// and block indices, a block's barrier, shared memory and per-warp exchange areas, the
// warp collectives the kernels use (shuffles, ldmatrix, mma.sync m16n8k16) following the
// PTX ISA's fragment layouts, 16-bit float bits, two device intrinsics, the block-by-block
// launch and the unpacking of CUDA-style kernel parameters.
//
// One OS thread per CUDA thread; blocks run one after another, each with shared memory
// filled with 0xFF bytes (NaN as float, half and bfloat16) so that a read of shared memory
// nothing wrote shows up. Warp collectives exchange values through the warp's scratch area
// between two barriers of its 32 threads. Floating-point results differ from the GPU only
// by rounding order (exp2 and the mma accumulation are computed in higher precision here).
// No CUDA header is included: the forward emulator declares its own vector types.
#pragma once

#include "emulator_barrier.h"

#include <atomic>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// CUDA's function and variable qualifiers mean nothing on the host (undefined first: a
// CUDA header included before this one defines them).
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

typedef unsigned int aa_u32;

struct AaEmuDim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local AaEmuDim3 threadIdx, blockIdx, blockDim, gridDim;

struct AaEmuWarp {
    AaEmuBarrier bar{32};
    const unsigned char* addr[32];
    aa_u32 a[32][4];
    aa_u32 b[32][2];
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
inline void __syncwarp() { aa_emu_warp().bar.arrive_and_wait(); }

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

inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline float aa_exp2(float x) { return static_cast<float>(std::exp2(static_cast<double>(x))); }
inline double aa_exp2(double x) { return std::exp2(x); }

// ---- 16-bit floats -------------------------------------------------------------------
inline float aa_emu_bits_to_float(uint16_t bits, bool bf16) {
    if (bf16) {
        const uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
// Round to nearest even, as cvt.rn.{f16,bf16}.f32 (a NaN stays a quiet NaN).
inline uint16_t aa_emu_float_to_bits(float x, bool bf16) {
    if (bf16) {
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
// Two values in one register, the first in the low half (what the mma operands hold).
inline aa_u32 aa_emu_pack2(float lo, float hi, bool bf16) {
    return static_cast<aa_u32>(aa_emu_float_to_bits(lo, bf16)) |
           (static_cast<aa_u32>(aa_emu_float_to_bits(hi, bf16)) << 16);
}

// ---- warp collectives ----------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16; `row` is this lane's row address.
// Lanes 8i..8i+7 give the 8 row addresses of matrix i. Without .trans, register i of lane
// l holds matrix i's (row l/4, cols 2(l%4), 2(l%4)+1); with .trans, (rows 2(l%4),
// 2(l%4)+1; col l/4). The first element goes in the low half.
inline void aa_emu_ldsm(aa_u32 (&r)[4], const void* row, bool trans) {
    AaEmuWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    w.addr[l] = static_cast<const unsigned char*>(row);
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!trans) {
            const unsigned char* p = w.addr[8 * i + l / 4];
            std::memcpy(&lo, p + 2 * (2 * (l % 4)), 2);
            std::memcpy(&hi, p + 2 * (2 * (l % 4) + 1), 2);
        } else {
            std::memcpy(&lo, w.addr[8 * i + 2 * (l % 4)] + 2 * (l / 4), 2);
            std::memcpy(&hi, w.addr[8 * i + 2 * (l % 4) + 1] + 2 * (l / 4), 2);
        }
        r[i] = static_cast<aa_u32>(lo) | (static_cast<aa_u32>(hi) << 16);
    }
    w.bar.arrive_and_wait();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}, f32 accumulators; g = lane/4,
// c = lane%4:
// A 16x16: a0 (g, 2c..2c+1), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
// B 16x8:  b0 (k = 2c..2c+1, n = g), b1 (k = 2c+8.., n = g)
// C 16x8:  c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)
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

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (aa_fwd_tf32); registers hold float
// bit patterns, of which the tensor cores read the top 19 bits (the low 13 are dropped
// here; the kernel clears them before the product anyway). g = lane/4, c = lane%4:
// A 16x8: a0 (g, c), a1 (g+8, c), a2 (g, c+4), a3 (g+8, c+4)
// B 8x8:  b0 (k = c, n = g), b1 (k = c+4, n = g)
// C 16x8: as m16n8k16
inline void aa_emu_mma_tf32(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
    AaEmuWarp& w = aa_emu_warp();
    const int l = aa_emu_lane();
    for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
    w.b[l][0] = b0;
    w.b[l][1] = b1;
    w.bar.arrive_and_wait();
    auto val = [](aa_u32 bits) {
        bits &= 0xFFFFE000u;
        float f;
        std::memcpy(&f, &bits, 4);
        return static_cast<double>(f);
    };
    auto A = [&](int row, int k) { return val(w.a[(row % 8) * 4 + k % 4][(row >= 8) + 2 * (k >= 4)]); };
    auto B = [&](int k, int n) { return val(w.b[n * 4 + k % 4][k >= 4]); };
    float out[4];
    for (int r = 0; r < 4; ++r) {
        const int row = l / 4 + 8 * (r / 2);
        const int col = 2 * (l % 4) + (r % 2);
        double sum = c[r];
        for (int k = 0; k < 8; ++k) sum += A(row, k) * B(k, col);
        out[r] = static_cast<float>(sum);
    }
    w.bar.arrive_and_wait();
    for (int r = 0; r < 4; ++r) c[r] = out[r];
}

// ---- launch --------------------------------------------------------------------------
// Wait until `word` reaches `target` (an acquire load, so the waiter sees everything the
// thread that stored it did before); futex waits, which order nothing by themselves.
inline void aa_emu_wait_for(std::atomic<unsigned>& word, unsigned target) {
    for (int spin = 0;; ++spin) {
        const unsigned seen = word.load(std::memory_order_acquire);
        if (seen >= target) return;
        if (spin < 64) continue;
        syscall(SYS_futex, reinterpret_cast<unsigned*>(&word), FUTEX_WAIT_PRIVATE, seen,
                nullptr, nullptr, 0);
    }
}

inline void aa_emu_wake_all(std::atomic<unsigned>& word) {
    syscall(SYS_futex, reinterpret_cast<unsigned*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX,
            nullptr, nullptr, 0);
}

// Run `body` (the kernel body for the current thread) on `nthreads` threads per block, for
// every block of `grid`, one block after another (x fastest, then y, then z).
//
// The launch's `nthreads` OS threads serve every block in turn (creating threads is most
// of a ThreadSanitizer run's time otherwise), and each block still starts as if on fresh
// threads: a new AaEmuBlock (barriers, 0xFF shared memory), fresh thread-locals set here
// (the emulators clear their own cp.async queues in their launch bodies), and the same
// happens-before edges as creating and joining the threads, and no others: the launching
// thread publishes block n with a release store of `started` that each thread acquires
// (as a thread's creation), and each thread's release add to `finished` is acquired by the
// launching thread before it builds block n + 1 (as a join). Release-only adds never make
// one CUDA thread acquire another's work, so inside a block only the kernel's own barriers
// order its threads, as before.
template <typename F>
void aa_emu_run_blocks(AaEmuDim3 grid, int nthreads, size_t smem_bytes, F body) {
    const unsigned nblocks = grid.x * grid.y * grid.z;
    if (nblocks == 0 || nthreads <= 0) return;
    std::unique_ptr<AaEmuBlock> blk;
    std::atomic<unsigned> started{0};   // blocks published so far
    std::atomic<unsigned> finished{0};  // threads done with the current block
    auto serve = [&](int t) {
        for (unsigned n = 0; n < nblocks; ++n) {
            aa_emu_wait_for(started, n + 1);
            threadIdx = {static_cast<unsigned>(t), 0, 0};
            blockIdx = {n % grid.x, n / grid.x % grid.y, n / grid.x / grid.y};
            blockDim = {static_cast<unsigned>(nthreads), 1, 1};
            gridDim = grid;
            aa_emu_block = blk.get();
            aa_emu_tid = t;
            body();
            aa_emu_block = nullptr;
            const unsigned done = finished.fetch_add(1, std::memory_order_release) + 1;
            if (done == static_cast<unsigned>(nthreads)) aa_emu_wake_all(finished);
        }
    };
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (int t = 0; t < nthreads; ++t) threads.emplace_back(serve, t);
    for (unsigned n = 0; n < nblocks; ++n) {
        blk.reset();  // block n - 1's memory goes before block n's is allocated, as before
        blk = std::make_unique<AaEmuBlock>();
        blk->bar = std::make_unique<AaEmuBarrier>(nthreads);
        blk->smem.assign(smem_bytes + 64, 0xFF);
        for (int w = 0; w < (nthreads + 31) / 32; ++w)
            blk->warps.push_back(std::make_unique<AaEmuWarp>());
        finished.store(0, std::memory_order_relaxed);
        started.store(n + 1, std::memory_order_release);
        aa_emu_wake_all(started);
        aa_emu_wait_for(finished, static_cast<unsigned>(nthreads));
    }
    for (auto& th : threads) th.join();
}

// Call `f` with CUDA-style kernel parameters (an array of pointers to each argument).
template <typename... A, std::size_t... I>
void aa_emu_call_impl(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(params[I])...);
}
template <typename... A>
void aa_emu_call(void (*f)(A...), void** params) {
    aa_emu_call_impl(f, params, std::index_sequence_for<A...>{});
}
