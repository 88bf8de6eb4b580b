// arrayattn/attention/cuda/common.cuh -- device helpers shared by the attention kernels.
//
// STABLE INTERFACE (the forward and backward kernels both include this file; change a
// signature only together with every caller):
//
//   Dropout (bit-identical to arrayattn/attention/dropout.py; pure integer code, so
//   __host__ __device__ and testable from a host program):
//     aa_u32 aa_drop_round(aa_u32 x, aa_u32 key)
//     void   aa_drop_permute(aa_u32& a, aa_u32& b)
//     void   aa_drop_absorb(aa_u32& a, aa_u32& b, aa_u32 v)      v: a non-negative index
//     AaDropState aa_drop_prefix(aa_u32 seed, int batch, int head)  state after seed,batch,head
//     AaDropState aa_drop_row(AaDropState s, int row)               ... and the row
//     aa_u32 aa_drop_bits_rc(AaDropState row_state, int col)         24 bits for one element
//     aa_u32 aa_drop_bits(aa_u32 seed, int batch, int head, int row, int col)
//     bool   aa_drop_keep(aa_u32 bits24, aa_u32 threshold)     keep <=> bits >= threshold
//   threshold is round(p * 2**24) computed on the host (dropout.dropout_threshold).
//   Indices: batch = flat index over the broadcast leading dims (the sequence index for
//   packed varlen), head = query head, row/col = positions within the sequence.
//
//   Structure (causal alignment + sliding window; SEMANTICS.md, ops/masks.py):
//     query i sees key j  <=>  j < kv_len  and  (left  < 0 or j >= i + offset - left)
//                                          and  (right < 0 or j <= i + offset + right)
//     offset = the kernels' `diag` argument: a constant (0 top-left, S - L bottom-right,
//     any value for a block of a larger call), or kv_len - q_len per sequence when diag
//     is AA_DIAG_FROM_LENGTHS (bottom-right with per-sequence lengths).
//     bool aa_allowed(int i, int j, int offset, int left, int right, int kv_len)
//     void aa_key_range(int r0, int r1, int offset, int left, int right, int kv_len,
//                       int& lo, int& hi)        keys any row in [r0, r1) may see: [lo, hi)
//     bool aa_block_full(int r0, int r1, int c0, int c1, int offset, int left, int right,
//                        int kv_len)             every (i, j) in the block is allowed
//   Rows with r0 >= r1 or an empty key range give lo >= hi.
//     int  aa_alibi_dist(int i, int j, int offset)   |i + offset - j|: ALiBi's distance
//          from the aligned diagonal (FlashAttention's definition); the bias is
//          -slope * dist, added after the softcap.
//
//   Numerics (device only):
//     float  aa_exp2(float x)     ex2.approx.ftz (x = -inf -> +0)
//     double aa_exp2(double x)    exp2
//     float  aa_softcap(float s, float cap, float inv_cap)   cap * tanh(s / cap)
//     double aa_softcap(double s, double cap, double inv_cap)
//   Scores are kept in the log2 domain: s2 = score * log2(e), with the log2(e) folded
//   into the scale on the host (AA_LOG2E), so the softmax needs one exp2 per element.
//
// No CUDA headers are included: the file compiles under nvcc, NVRTC (cupy.RawModule)
// and plain g++ (the integer parts, for the host-side bit-exactness test).

#pragma once

// The kernels' `diag` argument meaning "offset = kv_len - q_len of each sequence"
// (INT_MIN; arrayattn.attention.cuda.tiles.DIAG_FROM_LENGTHS on the host).
#define AA_DIAG_FROM_LENGTHS (-2147483647 - 1)

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define AA_HD __host__ __device__ __forceinline__
#define AA_DEVICE_CODE 1
#else
#define AA_HD inline
#endif

typedef unsigned int aa_u32;

#define AA_LOG2E 1.4426950408889634
#define AA_LN2 0.6931471805599453

// Minimum blocks per SM for __launch_bounds__ of a kernel with NT threads and SMEM bytes of
// dynamic shared memory: as many as shared memory lets reside on sm_90 (228 KB per SM,
// 1 KB reserved per block), but never so many that a thread gets under 128 registers.
// Without it ptxas picks its own register target, which held some CUDA-core kernels to
// 128 or 168 registers and made them spill while shared memory capped occupancy anyway.
// (A class template, not a constexpr function: NVRTC rejects unannotated host functions.)
template <int SMEM, int NT>
struct AaMinBlocks {
    static constexpr int by_smem = (228 * 1024) / (SMEM + 1024);
    static constexpr int by_regs = 65536 / (NT * 128);
    static constexpr int n = by_smem < by_regs ? by_smem : by_regs;
    static constexpr int value = n < 1 ? 1 : n;
};

// ---------------------------------------------------------------------------------------
// Dropout hash: a 32-bit Feistel permutation on two 16-bit halves (ops/dropout.py).
// All intermediates stay below 2**31, exactly as in the int32 array-API version.
// ---------------------------------------------------------------------------------------
#define AA_DROP_MULT 0x6F4Bu

struct AaDropState {
    aa_u32 a;
    aa_u32 b;
};

AA_HD aa_u32 aa_drop_round(aa_u32 x, aa_u32 key) {
    return ((((x ^ key) * AA_DROP_MULT) >> 7) & 0xFFFFu) ^ (x >> 5);
}

AA_HD void aa_drop_permute(aa_u32& a, aa_u32& b) {
    // Four Feistel rounds with ROUND_KEYS = (0x3C6E, 0xB7E1, 0x9E37, 0x5851).
    aa_u32 t;
    t = a ^ aa_drop_round(b, 0x3C6Eu); a = b; b = t;
    t = a ^ aa_drop_round(b, 0xB7E1u); a = b; b = t;
    t = a ^ aa_drop_round(b, 0x9E37u); a = b; b = t;
    t = a ^ aa_drop_round(b, 0x5851u); a = b; b = t;
}

AA_HD void aa_drop_absorb(aa_u32& a, aa_u32& b, aa_u32 v) {
    a ^= v & 0xFFFFu;
    b ^= (v >> 16) & 0x7FFFu;
    aa_drop_permute(a, b);
}

AA_HD AaDropState aa_drop_prefix(aa_u32 seed, int batch, int head) {
    AaDropState s;
    s.a = seed & 0xFFFFu;
    s.b = (seed >> 16) & 0xFFFFu;
    aa_drop_permute(s.a, s.b);
    aa_drop_absorb(s.a, s.b, (aa_u32)batch);
    aa_drop_absorb(s.a, s.b, (aa_u32)head);
    return s;
}

AA_HD AaDropState aa_drop_row(AaDropState s, int row) {
    aa_drop_absorb(s.a, s.b, (aa_u32)row);
    return s;
}

AA_HD aa_u32 aa_drop_bits_rc(AaDropState s, int col) {
    aa_drop_absorb(s.a, s.b, (aa_u32)col);
    aa_drop_permute(s.a, s.b);  // finaliser
    return (s.a << 8) | (s.b >> 8);
}

AA_HD aa_u32 aa_drop_bits(aa_u32 seed, int batch, int head, int row, int col) {
    return aa_drop_bits_rc(aa_drop_row(aa_drop_prefix(seed, batch, head), row), col);
}

AA_HD bool aa_drop_keep(aa_u32 bits24, aa_u32 threshold) { return bits24 >= threshold; }

// ---------------------------------------------------------------------------------------
// Structural mask: causal alignment offset, window (left, right) with -1 unbounded,
// and the key length of the sequence (ragged tails, per-sequence lengths).
// ---------------------------------------------------------------------------------------
AA_HD bool aa_allowed(int i, int j, int offset, int left, int right, int kv_len) {
    const int diag = i + offset;
    return j < kv_len && (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
}

AA_HD void aa_key_range(int r0, int r1, int offset, int left, int right, int kv_len,
                        int& lo, int& hi) {
    lo = 0;
    hi = kv_len;
    if (r1 <= r0) { hi = 0; return; }
    if (left >= 0) { const int v = r0 + offset - left; lo = v > 0 ? v : 0; }
    if (right >= 0) { const int v = r1 - 1 + offset + right + 1; hi = v < kv_len ? v : kv_len; }
    if (hi < lo) hi = lo;
}

AA_HD bool aa_block_full(int r0, int r1, int c0, int c1, int offset, int left, int right,
                         int kv_len) {
    // The binding rows are the last (for the left bound) and the first (for the right).
    if (c1 > kv_len) return false;
    if (left >= 0 && c0 < r1 - 1 + offset - left) return false;
    if (right >= 0 && c1 - 1 > r0 + offset + right) return false;
    return true;
}

AA_HD int aa_alibi_dist(int i, int j, int offset) {
    const int d = i + offset - j;
    return d < 0 ? -d : d;
}

// ---------------------------------------------------------------------------------------
// Block masks of built-in mask_mods (cuda/flex_pred.py): with AA_FLEX_PRED defined, the
// loader put `#define AA_FLEX_PRED_EXPR (...)` in front of the source, an expression of
// the block table F, its parameter area P, the table's batch index b, query row q and
// key kv generated from the mask_mod's structure; every value it needs is in the table.
// Pairs past the block mask's L x S are excluded (as the bits path's zero bits): the
// per-token ids are never read out of range.
// ---------------------------------------------------------------------------------------
#define AA_FLEX_PARAM 12  // table header: int32 offset of the parameter area
#define AA_FLEX_L 13      // ... the block mask's L
#define AA_FLEX_S 14      // ... and S
//
// Every load is unconditional (q and kv clamped into the mask's range, the expression
// built from the non-short-circuit & and |): the table's header and parameters are then
// loop invariants the compiler hoists out of the kernels' element loops, and the id
// loads issue together. (With early returns and &&, each element paid a chain of
// dependent L2 loads: on an H100 the forward ran 1.8-2.0x slower than the bits path.)
#ifdef AA_FLEX_PRED
AA_HD bool aa_flex_pred(const int* __restrict__ F, int b, int q, int kv) {
    const int lq = F[AA_FLEX_L], sk = F[AA_FLEX_S];
    const bool inside = (q < lq) & (kv < sk);
    q = q < lq ? q : lq - 1;
    kv = kv < sk ? kv : sk - 1;
    const int* __restrict__ P = F + F[AA_FLEX_PARAM];
    (void)P;  // (a structure without run-time values does not read it)
    return inside & (bool)(AA_FLEX_PRED_EXPR);
}
#endif

// ---------------------------------------------------------------------------------------
// Numerics (device only).
// ---------------------------------------------------------------------------------------
// (A host emulator of the kernels defines AA_NO_DEVICE_NUMERICS and supplies its own.)
#if defined(AA_DEVICE_CODE) && !defined(AA_NO_DEVICE_NUMERICS)
__device__ __forceinline__ float aa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ double aa_exp2(double x) { return exp2(x); }

__device__ __forceinline__ float aa_softcap(float s, float cap, float inv_cap) {
    return cap * tanhf(s * inv_cap);
}
__device__ __forceinline__ double aa_softcap(double s, double cap, double inv_cap) {
    return cap * tanh(s * inv_cap);
}

__device__ __forceinline__ float aa_neg_inf_f() { return __int_as_float(0xff800000); }
__device__ __forceinline__ double aa_neg_inf_d() { return __longlong_as_double(0xfff0000000000000ULL); }
template <typename A> __device__ __forceinline__ A aa_neg_inf();
template <> __device__ __forceinline__ float aa_neg_inf<float>() { return aa_neg_inf_f(); }
template <> __device__ __forceinline__ double aa_neg_inf<double>() { return aa_neg_inf_d(); }
#endif
