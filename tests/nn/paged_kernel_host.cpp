// Host build of arrayattn/kernels/paged_attn.cu for the CPU tests: the kernel's own source
// with CUDA's qualifiers defined away, launched by looping over blocks and threads (the
// kernel uses no barriers, shared memory or warp collectives, so the order is free).
#define AA_PAGED_HOST 1
#include <cmath>

using std::exp;
using std::tanh;

#define __global__
#define __restrict__

struct AaDim {
    unsigned x = 0;
};
static AaDim threadIdx, blockIdx, blockDim;

#include "paged_attn.cu"

#define AA_PAGED_HOST_ENTRY(NAME, T)                                                         \
    extern "C" void NAME(const T* q, const T* kp, const T* vp, const long long* tables,     \
                         const long long* kv_len, const long long* q_len, const T* sinks,   \
                         const T* slopes, T* out, int B, int Hq, int Hkv, int L, int D,     \
                         int Dv, int P, int max_pages, T scale, T softcap, int causal,      \
                         int win_left, int win_right, int slope_bstride, int has_sinks,     \
                         int has_slopes, int grid, int block) {                             \
        blockDim.x = block;                                                                 \
        for (int bx = 0; bx < grid; ++bx)                                                   \
            for (int tx = 0; tx < block; ++tx) {                                            \
                blockIdx.x = bx;                                                            \
                threadIdx.x = tx;                                                           \
                aa_paged_attn<T, 256, 256>(q, kp, vp, tables, kv_len, q_len, sinks,         \
                                           slopes, out, B, Hq, Hkv, L, D, Dv, P, max_pages, \
                                           scale, softcap, causal, win_left, win_right,     \
                                           slope_bstride, has_sinks, has_slopes);           \
            }                                                                               \
    }

AA_PAGED_HOST_ENTRY(aa_paged_attn_f32, float)
AA_PAGED_HOST_ENTRY(aa_paged_attn_f64, double)
