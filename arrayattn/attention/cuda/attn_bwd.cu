// arrayattn/attention/cuda/attn_bwd.cu -- FlashAttention-2 backward kernels.
//
// Math (SEMANTICS.md "Backward", ops/_composed.py backward is the reference):
//   P  = exp(S - LSE)                 recomputed tile by tile from Q, K and the saved LSE
//   dV = sum over the group's query heads of (drop(P))^T dO
//   dP = drop(dO V^T)                 drop(x) = keep ? x / (1 - p) : 0, mask regenerated
//   dS = P * (dP - D),  D = rowsum(dO * O) - dLSE      (the LSE cotangent folds into D)
//   dS <- dS * (1 - tanh^2) * scale  (softcap chain rule, then the score scale)
//   dK = sum over the group of dS^T Q,   dQ = dS K
//
// Kernels (all arrays contiguous, q/dq/out/dout (B, Hq, L, *), k/v/dk/dv (B, Hkv, S, *),
// lse2/delta (B, Hq, L)):
//   aa_bwd_preprocess<T, Acc>      delta = rowsum(dO * O) - dLSE, lse2 = LSE * log2(e)
//                                  (+inf for empty rows, so exp2(s2 - lse2) = 0 there)
//   aa_bwd_dkdv_simt<T, Acc, HD, BN, BM, NT>   CUDA cores (float32, float64; any dtype)
//   aa_bwd_dq_simt<T, Acc, HD, BN, BM, NT>     deterministic dQ, parallel over query blocks
//   aa_bwd_dkdv_mma<T, HD, NW, BM>             float16/bfloat16, mma.sync m16n8k16
//   aa_bwd_dq_mma<T, HD, NW, BN>               deterministic dQ on tensor cores
//   aa_bwd_convert<T, Acc>                     float dQ accumulator -> the query dtype
// T is float, double or the 16-bit tags AaF16 / AaBF16 (storage unsigned short).
//
// The dK/dV kernels run one thread block per (key block, KV head, batch). A block keeps
// its dK/dV tile in registers, loops over the G query heads of its KV head (GQA without
// repeated K/V) and over the query blocks that can see its keys (block skipping from the
// causal/window structure), and, unless deterministic, adds dQ = dS K into a float
// accumulator with atomics. Deterministic mode instead runs the dQ kernel: one block per
// (query block, query head, batch) that owns its dQ rows and visits key blocks in a fixed
// order, so every gradient is bit-identical run after run.
//
// Head dims: HD is a compile-time tile width >= max(E, Ev); E and Ev are runtime values
// and the tiles are zero-padded, so e.g. E = 80 runs in the HD = 128 variant.
//
// Per-sequence lengths: q_lens / k_lens (int32, one per batch, may be null) give the
// valid rows and keys of each sequence; offset (causal alignment) per sequence is
// 0 (top-left) or k_len - q_len (bottom-right), as in common.cuh. A dense boolean
// attn_mask (uint8, may be null) is read through four element strides like the forward
// kernels read it (batch, query head, row, col; 0 on broadcast dims). A float bias mask
// is not handled here (the host falls back: its gradient is dense).
//
// The file also compiles as host C++ under tests/kernels/backward_emulator.h, which
// supplies the thread/warp primitives used here (AA_BWD_EMULATION), so the CPU tests run
// these very kernels.

#include "common.cuh"
#include "elem16.cuh"

#ifndef AA_BWD_EMULATION
#define AA_BWD_DEV __device__ __forceinline__
#define AA_BWD_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#define AA_BWD_DEV inline
#define AA_BWD_SMEM(name) unsigned char* name = aa_emu_smem()
#endif

template <typename Acc> AA_BWD_DEV Acc aa_bwd_inf();
template <> AA_BWD_DEV float aa_bwd_inf<float>() { return __int_as_float(0x7f800000); }
template <> AA_BWD_DEV double aa_bwd_inf<double>() {
    return __longlong_as_double(0x7ff0000000000000LL);
}
AA_BWD_DEV float aa_bwd_tanh(float x) { return tanhf(x); }
AA_BWD_DEV double aa_bwd_tanh(double x) { return tanh(x); }

// ---------------------------------------------------------------------------------------
// Geometry of one sequence and the rows that can see a key block.
// ---------------------------------------------------------------------------------------
struct AaBwdSeq {
    int q_len;   // valid query rows (<= L)
    int k_len;   // valid keys (<= S)
    int offset;  // causal alignment: query i sits on key i + offset
};

AA_BWD_DEV AaBwdSeq aa_bwd_seq(int b, int L, int S, int diag, const int* q_lens,
                               const int* k_lens) {
    AaBwdSeq s;
    s.q_len = q_lens ? min(q_lens[b], L) : L;
    s.k_len = k_lens ? min(k_lens[b], S) : S;
    s.offset = diag == AA_DIAG_FROM_LENGTHS ? s.k_len - s.q_len : diag;
    return s;
}

// Rows that may see some key of [c0, c1): [lo, hi). The inverse of aa_key_range:
// j >= i + offset - left  <=>  i <= j - offset + left;  j <= i + offset + right  <=>
// i >= j - offset - right.
AA_HD void aa_row_range(int c0, int c1, int offset, int left, int right, int q_len,
                        int& lo, int& hi) {
    lo = 0;
    hi = q_len;
    if (c1 <= c0) { hi = 0; return; }
    if (right >= 0) { const int v = c0 - offset - right; lo = v > 0 ? v : 0; }
    if (left >= 0) { const int v = c1 - 1 - offset + left + 1; hi = v < q_len ? v : q_len; }
    if (hi < lo) hi = lo;
}

// The dense boolean attn_mask (uint8, nonzero = takes part; null when absent) at (i, j),
// m_base = batch * m_sb + head * m_sh. Rows past L (tile padding) are never read.
AA_BWD_DEV bool aa_bwd_mask_ok(const unsigned char* mask, long long m_base, long long m_sr,
                               long long m_sc, int i, int j, int L) {
    return mask == nullptr || i >= L ||
           mask[m_base + (long long)i * m_sr + (long long)j * m_sc] != 0;
}

// ---------------------------------------------------------------------------------------
// Block masks (arrayattn.flex; host side cuda/flex_table.py, layout as attn_fwd.cu's "Block
// masks"): instantiations with FLEX = true read the `flex` table (null otherwise). The dQ
// kernels walk, per (batch, head, query mask block), the forward's list of non-empty key
// blocks; the dK/dV kernels walk, per (batch, head, key mask block), the transposed list
// of non-empty query blocks ((query block, partial id) pairs ended by (nq, -1), at
// header[AA_BF_TLIST]). Both name a partial block by the same id, so both read the same
// bits. A list is walked with one int32 offset `cur` at the pair of the current tile's
// block; the host checks that the kernels' tiles lie inside one mask block.
// ---------------------------------------------------------------------------------------
enum {
    AA_BF_NQ = 0, AA_BF_NK = 1, AA_BF_TSB = 2, AA_BF_TSH = 3, AA_BF_QB = 4, AA_BF_KB = 5,
    AA_BF_WPR = 6, AA_BF_LIST = 8, AA_BF_BITS = 9, AA_BF_TLIST = 11
};

// The list of query mask block r0 / Q_BLOCK of (b, h): its non-empty key blocks.
AA_BWD_DEV int aa_bflex_qrow(const int* flex, int b, int h, int r0) {
    const long long t = (long long)b * flex[AA_BF_TSB] + (long long)h * flex[AA_BF_TSH];
    return (int)(flex[AA_BF_LIST] +
                 (t * flex[AA_BF_NQ] + r0 / flex[AA_BF_QB]) * 2 * (flex[AA_BF_NK] + 1));
}
// The transposed list of key mask block c0 / KV_BLOCK of (b, h): its non-empty query blocks.
AA_BWD_DEV int aa_bflex_krow(const int* flex, int b, int h, int c0) {
    const long long t = (long long)b * flex[AA_BF_TSB] + (long long)h * flex[AA_BF_TSH];
    return (int)(flex[AA_BF_TLIST] +
                 (t * flex[AA_BF_NK] + c0 / flex[AA_BF_KB]) * 2 * (flex[AA_BF_NQ] + 1));
}
// The first tile start at or after `begin` (a multiple of the tile step) inside a listed
// block of `blk` positions, `cur` moved to its pair; `end` when none is before it. The end
// pair's block starts at or past every end (nq * Q_BLOCK >= L, nk * KV_BLOCK >= S).
AA_BWD_DEV int aa_bflex_first(const int* flex, int& cur, int blk, int begin, int end) {
    while ((flex[cur] + 1) * blk <= begin) cur += 2;
    const int p0 = flex[cur] * blk;
    const int p = p0 > begin ? p0 : begin;
    return p < end ? p : end;
}
// The tile start after p (`step` positions on, else the next listed block's first).
AA_BWD_DEV int aa_bflex_peek(const int* flex, int cur, int blk, int p, int step, int end) {
    int nx = p + step;
    if (nx >= (flex[cur] + 1) * blk) nx = flex[cur + 2] * blk;
    return nx < end ? nx : end;
}
// Move `cur` on to the pair of p_next (the value aa_bflex_peek gave).
AA_BWD_DEV void aa_bflex_advance(const int* flex, int& cur, int blk, int p_next) {
    if (p_next >= (flex[cur] + 1) * blk) cur += 2;
}
// aa_bflex_peek then aa_bflex_advance.
AA_BWD_DEV int aa_bflex_step(const int* flex, int& cur, int blk, int p, int step, int end) {
    const int nx = aa_bflex_peek(flex, cur, blk, p, step, end);
    aa_bflex_advance(flex, cur, blk, nx);
    return nx;
}
// Whether the block mask lets query i see key j, (i, j) inside the block of the pair at
// `cur` (a full block: always; a partial one: its bit, or with AA_FLEX_PRED, a built-in
// mask_mod, the predicate at the table's batch index the pair holds; common.cuh).
AA_BWD_DEV bool aa_bflex_ok(const int* flex, int cur, int i, int j) {
    const int pid = flex[cur + 1];
    if (pid < 0) return true;
#ifdef AA_FLEX_PRED
    return aa_flex_pred(flex, pid, i, j);
#else
    const int qb = flex[AA_BF_QB];
    const int wpr = flex[AA_BF_WPR];
    const int col = j % flex[AA_BF_KB];
    const aa_u32* bits = reinterpret_cast<const aa_u32*>(flex + flex[AA_BF_BITS]);
    const aa_u32 w = bits[((long long)pid * qb + i % qb) * wpr + (col >> 5)];
    return ((w >> (col & 31)) & 1u) != 0u;
#endif
}
// aa_bflex_ok for the 32 keys j0 .. j0 + 31 of query i at once (bit c: key j0 + c), j0 at a
// 32-key boundary of its block (KV_BLOCK % 32 == 0): all ones for a full block. For kernels
// whose thread tests several keys of one row (v4: one load per row instead of per element);
// like aa_bflex_ok, the only reader of a partial block's bits. With AA_FLEX_PRED (a
// built-in mask_mod) the word is built from 32 evaluations of the predicate.
AA_BWD_DEV aa_u32 aa_bflex_word(const int* flex, int cur, int i, int j0) {
    const int pid = flex[cur + 1];
    if (pid < 0) return ~0u;
#ifdef AA_FLEX_PRED
    // (a rolled loop: 32 inlined copies of the predicate made v4's D = 128 kernel spill)
    aa_u32 w = 0u;
#pragma unroll 1
    for (int c = 0; c < 32; ++c) w |= (aa_flex_pred(flex, pid, i, j0 + c) ? 1u : 0u) << c;
    return w;
#else
    const int qb = flex[AA_BF_QB];
    const int col = j0 % flex[AA_BF_KB];
    const aa_u32* bits = reinterpret_cast<const aa_u32*>(flex + flex[AA_BF_BITS]);
    return bits[((long long)pid * qb + i % qb) * flex[AA_BF_WPR] + (col >> 5)];
#endif
}
// Whether the block of the pair at `cur` is a full one (every pair allowed: no bits to read).
AA_BWD_DEV bool aa_bflex_full(const int* flex, int cur) { return flex[cur + 1] < 0; }
// The first (head g >= the given g, query tile) step of a dK/dV block of key block c0 in
// its group's flattened sequence: the first tile of [begin, hi) listed for head hk * G + g;
// g = G and hi when no head has one.
AA_BWD_DEV int aa_bflex_seek(const int* flex, int b, int hk, int G, int c0, int begin, int hi,
                             int& g) {
    for (; g < G; ++g) {
        int cur = aa_bflex_krow(flex, b, hk * G + g, c0);
        const int m = aa_bflex_first(flex, cur, flex[AA_BF_QB], begin, hi);
        if (m < hi) return m;
    }
    return hi;
}

// The ALiBi bias of (i, j) for a head of slope `slope` (slope 0 when alibi is absent).
template <typename Acc>
AA_BWD_DEV Acc aa_bwd_alibi(Acc slope, int i, int j, int offset) {
    return -slope * Acc(aa_alibi_dist(i, j, offset));
}

// One score -> (dropped probability for dV, dS for dK/dQ). acc_s = q.k, acc_dp = dO.v.
// lse2 = LSE * log2(e) (+inf on empty or invalid rows), delta = D - dLSE. bias: the
// ALiBi term -slope * |i + offset - j| added after the softcap (0 without ALiBi). Sinks
// need nothing here: the saved LSE includes them, so P = exp(S - LSE) is already right.
template <typename Acc>
AA_BWD_DEV void aa_bwd_element(Acc acc_s, Acc acc_dp, Acc lse2, Acc delta, bool allowed,
                               bool dropout, bool keep, Acc scale, Acc softcap,
                               Acc inv_softcap, Acc inv_keep, Acc bias, Acc& p_out,
                               Acc& ds_out) {
    Acc s = acc_s * scale;
    Acc chain = Acc(1);
    if (softcap > Acc(0)) {
        const Acc t = aa_bwd_tanh(s * inv_softcap);
        s = softcap * t;
        chain = Acc(1) - t * t;
    }
    s += bias;
    const Acc p = allowed ? aa_exp2(s * Acc(AA_LOG2E) - lse2) : Acc(0);
    Acc dp = acc_dp;
    Acc pd = p;
    if (dropout) {
        pd = keep ? p * inv_keep : Acc(0);
        dp = keep ? dp * inv_keep : Acc(0);
    }
    p_out = pd;
    ds_out = p * (dp - delta) * chain * scale;
}

// Kernel arguments shared by every main kernel, in this order (see backward.py):
#define AA_BWD_ARGS(TIO, Acc)                                                                \
    const TIO *__restrict__ q, const TIO *__restrict__ k, const TIO *__restrict__ v,       \
        const TIO *__restrict__ dout, const Acc *__restrict__ lse2,                           \
        const Acc *__restrict__ delta, int Hq, int Hkv, int L, int S, int E, int Ev,        \
        Acc scale, Acc softcap, int diag, int left, int right,                              \
        const int *__restrict__ q_lens, const int *__restrict__ k_lens, aa_u32 seed,        \
        aa_u32 drop_threshold, Acc inv_keep, const unsigned char *__restrict__ mask,         \
        long long m_sb, long long m_sh, long long m_sr, long long m_sc,                       \
        const Acc *__restrict__ alibi, const int *__restrict__ flex

// ---------------------------------------------------------------------------------------
// Preprocessing: one warp per row. delta = rowsum(dO * O) - dLSE; lse2 = LSE * log2(e).
// ---------------------------------------------------------------------------------------
template <typename T, typename Acc>
__global__ void __launch_bounds__(256)
aa_bwd_preprocess(const typename AaIO<T>::type* __restrict__ out,
                  const typename AaIO<T>::type* __restrict__ dout,
                  const Acc* __restrict__ lse, const Acc* __restrict__ dlse,
                  Acc* __restrict__ delta, Acc* __restrict__ lse2, long long rows, int Ev) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const bool live = row < rows;
    Acc sum = Acc(0);
    if (live) {
        const typename AaIO<T>::type* o = out + row * Ev;
        const typename AaIO<T>::type* g = dout + row * Ev;
        for (int e = lane; e < Ev; e += 32)
            sum += AaIO<T>::to_f(o[e]) * AaIO<T>::to_f(g[e]);
    }
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
    if (live && lane == 0) {
        const Acc l = lse[row];
        delta[row] = sum - (dlse ? dlse[row] : Acc(0));
        // -inf (empty row) -> +inf: exp2(s2 - inf) = 0 for every key of the row.
        lse2[row] = (l == -aa_bwd_inf<Acc>()) ? aa_bwd_inf<Acc>() : l * Acc(AA_LOG2E);
    }
}

// ---------------------------------------------------------------------------------------
// CUDA-core kernels (float32, float64, and any dtype/head dim the tensor-core ones skip).
// Shared memory holds Acc values with rows padded by one element (no bank conflicts on
// the column walks below).
// ---------------------------------------------------------------------------------------
template <typename T, typename Acc, int HD, int ROWS, int NT>
AA_BWD_DEV void aa_bwd_load_rows(Acc* dst, const typename AaIO<T>::type* src, int row0, int nrows,
                                 int ncols) {
    constexpr int LD = HD + 1;
    for (int idx = threadIdx.x; idx < ROWS * HD; idx += NT) {
        const int r = idx / HD;
        const int c = idx % HD;
        Acc x = Acc(0);
        if (row0 + r < nrows && c < ncols)
            x = AaIO<T>::to_f(src[(long long)(row0 + r) * ncols + c]);
        dst[r * LD + c] = x;
    }
}

// Row statistics of a query block: lse2 (+inf past q_len) and delta (0 past q_len).
template <typename Acc, int BM, int NT>
AA_BWD_DEV void aa_bwd_load_stats(Acc* sL, Acc* sD, const Acc* lse2, const Acc* delta,
                                  int row0, int q_len) {
    for (int m = threadIdx.x; m < BM; m += NT) {
        const bool ok = row0 + m < q_len;
        sL[m] = ok ? lse2[row0 + m] : aa_bwd_inf<Acc>();
        sD[m] = ok ? delta[row0 + m] : Acc(0);
    }
}

// P (dropped) and dS for a BM x BN tile from the resident sQ, sK, sV, sdO tiles.
template <typename Acc, int HD, int BN, int BM, int NT, bool FLEX = false>
AA_BWD_DEV void aa_bwd_tile_simt(const Acc* sQ, const Acc* sK, const Acc* sV, const Acc* sdO,
                                 const Acc* sL, const Acc* sD, Acc* sP, Acc* sdS, int m0,
                                 int c0, bool full, const AaBwdSeq& seq, int left, int right,
                                 AaDropState drop, bool dropout, aa_u32 drop_threshold,
                                 Acc scale, Acc softcap, Acc inv_softcap, Acc inv_keep,
                                 const unsigned char* mask, long long m_base, long long m_sr,
                                 long long m_sc, int L, const Acc* alibi, long long qh,
                                 const int* flex = nullptr, int fcur = 0) {
    constexpr int LD = HD + 1;
    constexpr int LDP = BN + 1;
    constexpr int MSTRIDE = NT / BN;    // threads sharing one key take rows mb, mb + MSTRIDE..
    constexpr int MPT = BM / MSTRIDE;   // rows per thread
    static_assert(NT % BN == 0 && BM % MSTRIDE == 0, "threads must tile the score block");
    const int n = threadIdx.x % BN;
    const int mb = threadIdx.x / BN;
    Acc s[MPT], dp[MPT];
#pragma unroll
    for (int t = 0; t < MPT; ++t) s[t] = dp[t] = Acc(0);
    const Acc* kr = sK + n * LD;
    const Acc* vr = sV + n * LD;
    // Each K/V element read once per thread serves MPT rows (register blocking).
#pragma unroll 4
    for (int d = 0; d < HD; ++d) {
        const Acc kd = kr[d];
        const Acc vd = vr[d];
#pragma unroll
        for (int t = 0; t < MPT; ++t) {
            const int m = mb + t * MSTRIDE;
            s[t] += sQ[m * LD + d] * kd;
            dp[t] += sdO[m * LD + d] * vd;
        }
    }
    // Read the slope only now: kept live across the loop above, it made the float64
    // HD = 32 variant spill under its 128-register launch bound.
    const Acc slope = alibi ? alibi[qh] : Acc(0);
#pragma unroll
    for (int t = 0; t < MPT; ++t) {
        const int m = mb + t * MSTRIDE;
        const int i = m0 + m;
        const int j = c0 + n;
        bool allowed = (full || aa_allowed(i, j, seq.offset, left, right, seq.k_len)) &&
                       aa_bwd_mask_ok(mask, m_base, m_sr, m_sc, i, j, L);
        if constexpr (FLEX) allowed = allowed && aa_bflex_ok(flex, fcur, i, j);
        bool keep = true;
        if (dropout) keep = aa_drop_keep(aa_drop_bits_rc(aa_drop_row(drop, i), j), drop_threshold);
        Acc p, ds;
        aa_bwd_element<Acc>(s[t], dp[t], sL[m], sD[m], allowed, dropout, keep, scale, softcap,
                            inv_softcap, inv_keep, aa_bwd_alibi(slope, i, j, seq.offset), p, ds);
        sP[m * LDP + n] = p;
        sdS[m * LDP + n] = ds;
    }
}

// Dynamic shared memory of the CUDA-core backward kernels (the layout backward.py sizes),
// for their launch bounds' minimum blocks per SM.
template <typename Acc, int HD, int BN, int BM>
struct AaBwdSimtSmem {
    static constexpr int value =
        (2 * BN * (HD + 1) + 2 * BM * (HD + 1) + 2 * BM * (BN + 1) + 2 * BM) * (int)sizeof(Acc);
};

// dK, dV (and dQ by atomics unless dq_acc is null) for one key block.
// (FLEX: one block per SM as the launch bound's minimum: the list walk's state made the
// float32 D = 64 kernel spill under the 128 registers of two 256-thread blocks.)
template <typename T, typename Acc, int HD, int BN, int BM, int NT, bool FLEX = false>
__global__ void __launch_bounds__(
    NT, FLEX ? 1 : AaMinBlocks<AaBwdSimtSmem<Acc, HD, BN, BM>::value, NT>::value)
aa_bwd_dkdv_simt(AA_BWD_ARGS(typename AaIO<T>::type, Acc), typename AaIO<T>::type* __restrict__ dk,
                 typename AaIO<T>::type* __restrict__ dv,
                 Acc* __restrict__ dq_acc) {
    constexpr int LD = HD + 1;
    constexpr int LDP = BN + 1;
    constexpr int DSTRIDE = NT / BN;   // threads sharing one key, striding the dims
    constexpr int PER = HD / DSTRIDE;  // dims per thread
    static_assert(HD % DSTRIDE == 0, "head dim must split over the threads of a key");
    AA_BWD_SMEM(aa_smem);
    Acc* sK = reinterpret_cast<Acc*>(aa_smem);
    Acc* sV = sK + BN * LD;
    Acc* sQ = sV + BN * LD;
    Acc* sdO = sQ + BM * LD;
    Acc* sP = sdO + BM * LD;
    Acc* sdS = sP + BM * LDP;
    Acc* sL = sdS + BM * LDP;
    Acc* sD = sL + BM;

    const int tid = threadIdx.x;
    const int c0 = blockIdx.x * BN;
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int G = Hq / Hkv;
    const AaBwdSeq seq = aa_bwd_seq(b, L, S, diag, q_lens, k_lens);
    const Acc inv_softcap = softcap > Acc(0) ? Acc(1) / softcap : Acc(0);
    const bool dropout = drop_threshold != 0u;

    const long long kv_head = (long long)b * Hkv + hk;
    aa_bwd_load_rows<T, Acc, HD, BN, NT>(sK, k + kv_head * S * E, c0, S, E);
    aa_bwd_load_rows<T, Acc, HD, BN, NT>(sV, v + kv_head * S * Ev, c0, S, Ev);

    Acc acc_k[PER], acc_v[PER];
#pragma unroll
    for (int t = 0; t < PER; ++t) acc_k[t] = acc_v[t] = Acc(0);
    const int n = tid % BN;
    const int dgrp = tid / BN;

    int lo, hi;
    aa_row_range(c0, min(c0 + BN, seq.k_len), seq.offset, left, right, seq.q_len, lo, hi);
    for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        const long long qh = (long long)b * Hq + h;
        const AaDropState drop = aa_drop_prefix(seed, b, h);
        const long long m_base = (long long)b * m_sb + (long long)h * m_sh;
        int m0 = hi > lo ? (lo / BM) * BM : hi;
        int fcur = 0;  // FLEX: the transposed list's pair of m0's query block
        if constexpr (FLEX) {
            fcur = aa_bflex_krow(flex, b, h, c0);
            m0 = aa_bflex_first(flex, fcur, flex[AA_BF_QB], m0, hi);
        }
        for (; m0 < hi; m0 = FLEX ? aa_bflex_step(flex, fcur, flex[AA_BF_QB], m0, BM, hi)
                                  : m0 + BM) {
            __syncthreads();  // the previous step's readers of sQ/sdO/sP/sdS are done
            aa_bwd_load_rows<T, Acc, HD, BM, NT>(sQ, q + qh * L * E, m0, L, E);
            aa_bwd_load_rows<T, Acc, HD, BM, NT>(sdO, dout + qh * L * Ev, m0, L, Ev);
            aa_bwd_load_stats<Acc, BM, NT>(sL, sD, lse2 + qh * L, delta + qh * L, m0, seq.q_len);
            __syncthreads();
            const bool full = aa_block_full(m0, m0 + BM, c0, c0 + BN, seq.offset, left, right,
                                            seq.k_len);
            aa_bwd_tile_simt<Acc, HD, BN, BM, NT, FLEX>(sQ, sK, sV, sdO, sL, sD, sP, sdS, m0,
                                                        c0, full, seq, left, right, drop,
                                                        dropout, drop_threshold, scale, softcap,
                                                        inv_softcap, inv_keep, mask, m_base,
                                                        m_sr, m_sc, L, alibi, qh, flex, fcur);
            __syncthreads();
            // dV += P^T dO, dK += dS^T Q for this thread's key and dims.
            for (int m = 0; m < BM; ++m) {
                const Acc pv = sP[m * LDP + n];
                const Acc ps = sdS[m * LDP + n];
#pragma unroll
                for (int t = 0; t < PER; ++t) {
                    const int d = dgrp + t * DSTRIDE;
                    acc_v[t] += pv * sdO[m * LD + d];
                    acc_k[t] += ps * sQ[m * LD + d];
                }
            }
            if (dq_acc) {
                // dQ += dS K; consecutive threads take consecutive dims of one row.
                Acc* dq_head = dq_acc + qh * L * E;
                for (int idx = tid; idx < BM * HD; idx += NT) {
                    const int m = idx / HD;
                    const int d = idx % HD;
                    if (m0 + m >= seq.q_len || d >= E) continue;
                    Acc sum = Acc(0);
#pragma unroll 8
                    for (int nn = 0; nn < BN; ++nn) sum += sdS[m * LDP + nn] * sK[nn * LD + d];
                    atomicAdd(dq_head + (long long)(m0 + m) * E + d, sum);
                }
            }
        }
    }
    // Every key row of the block is written, zeros included (no output is left unset).
    const int j = c0 + n;
    if (j < S) {
#pragma unroll
        for (int t = 0; t < PER; ++t) {
            const int d = dgrp + t * DSTRIDE;
            if (d < E) dk[kv_head * S * E + (long long)j * E + d] = AaIO<T>::from_f(acc_k[t]);
            if (d < Ev) dv[kv_head * S * Ev + (long long)j * Ev + d] = AaIO<T>::from_f(acc_v[t]);
        }
    }
}

// Deterministic dQ: one block per (query block, query head, batch), key blocks in order.
template <typename T, typename Acc, int HD, int BN, int BM, int NT, bool FLEX = false>
__global__ void __launch_bounds__(NT, AaMinBlocks<AaBwdSimtSmem<Acc, HD, BN, BM>::value, NT>::value)
aa_bwd_dq_simt(AA_BWD_ARGS(typename AaIO<T>::type, Acc), typename AaIO<T>::type* __restrict__ dq) {
    constexpr int LD = HD + 1;
    constexpr int LDP = BN + 1;
    static_assert(NT % HD == 0 && (BM * HD) % NT == 0, "threads must tile the dQ block");
    constexpr int PER = (BM * HD) / NT;
    AA_BWD_SMEM(aa_smem);
    Acc* sK = reinterpret_cast<Acc*>(aa_smem);
    Acc* sV = sK + BN * LD;
    Acc* sQ = sV + BN * LD;
    Acc* sdO = sQ + BM * LD;
    Acc* sP = sdO + BM * LD;
    Acc* sdS = sP + BM * LDP;
    Acc* sL = sdS + BM * LDP;
    Acc* sD = sL + BM;

    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * BM;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int G = Hq / Hkv;
    const int hk = h / G;
    const AaBwdSeq seq = aa_bwd_seq(b, L, S, diag, q_lens, k_lens);
    const Acc inv_softcap = softcap > Acc(0) ? Acc(1) / softcap : Acc(0);
    const bool dropout = drop_threshold != 0u;
    const long long qh = (long long)b * Hq + h;
    const long long kv_head = (long long)b * Hkv + hk;
    const AaDropState drop = aa_drop_prefix(seed, b, h);
    const long long m_base = (long long)b * m_sb + (long long)h * m_sh;

    aa_bwd_load_rows<T, Acc, HD, BM, NT>(sQ, q + qh * L * E, m0, L, E);
    aa_bwd_load_rows<T, Acc, HD, BM, NT>(sdO, dout + qh * L * Ev, m0, L, Ev);
    aa_bwd_load_stats<Acc, BM, NT>(sL, sD, lse2 + qh * L, delta + qh * L, m0, seq.q_len);

    Acc acc[PER];
#pragma unroll
    for (int t = 0; t < PER; ++t) acc[t] = Acc(0);
    const int dq_d = tid % HD;
    const int mq = tid / HD;

    int lo, hi;
    aa_key_range(m0, min(m0 + BM, seq.q_len), seq.offset, left, right, seq.k_len, lo, hi);
    int c0 = hi > lo ? (lo / BN) * BN : hi;
    int fcur = 0;  // FLEX: the list's pair of c0's key block
    if constexpr (FLEX) {
        fcur = aa_bflex_qrow(flex, b, h, m0);
        c0 = aa_bflex_first(flex, fcur, flex[AA_BF_KB], c0, hi);
    }
    for (; c0 < hi; c0 = FLEX ? aa_bflex_step(flex, fcur, flex[AA_BF_KB], c0, BN, hi) : c0 + BN) {
        __syncthreads();
        aa_bwd_load_rows<T, Acc, HD, BN, NT>(sK, k + kv_head * S * E, c0, S, E);
        aa_bwd_load_rows<T, Acc, HD, BN, NT>(sV, v + kv_head * S * Ev, c0, S, Ev);
        __syncthreads();
        const bool full =
            aa_block_full(m0, m0 + BM, c0, c0 + BN, seq.offset, left, right, seq.k_len);
        aa_bwd_tile_simt<Acc, HD, BN, BM, NT, FLEX>(sQ, sK, sV, sdO, sL, sD, sP, sdS, m0, c0,
                                                    full, seq, left, right, drop, dropout,
                                                    drop_threshold, scale, softcap, inv_softcap,
                                                    inv_keep, mask, m_base, m_sr, m_sc, L, alibi,
                                                    qh, flex, fcur);
        __syncthreads();
        // dQ rows mq, mq + NT/HD, ... at dim dq_d: each K element read serves PER rows.
#pragma unroll 4
        for (int nn = 0; nn < BN; ++nn) {
            const Acc kv = sK[nn * LD + dq_d];
#pragma unroll
            for (int t = 0; t < PER; ++t) acc[t] += sdS[(mq + t * (NT / HD)) * LDP + nn] * kv;
        }
    }
#pragma unroll
    for (int t = 0; t < PER; ++t) {
        const int m = mq + t * (NT / HD);
        if (m0 + m < L && dq_d < E)
            dq[qh * L * E + (long long)(m0 + m) * E + dq_d] = AaIO<T>::from_f(acc[t]);
    }
}

// ---------------------------------------------------------------------------------------
// Tensor-core kernels (float16, bfloat16): mma.sync m16n8k16, float32 accumulators.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4,
// c = lane % 4:  A (16x16, row):  a0:(g, 2c..2c+1) a1:(g+8, ..) a2:(g, 2c+8..) a3:(g+8, 2c+8..)
//                B (16x8, col):   b0:(k=2c..2c+1, n=g)  b1:(k=2c+8.., n=g)
//                C (16x8 f32):    c0,c1:(g, 2c..2c+1)   c2,c3:(g+8, 2c..2c+1)
// ldmatrix.x4 gives register i from the 8x8 matrix whose row addresses come from lanes
// 8i..8i+7; without .trans lane l gets (row l/4, cols 2(l%4)..+1), with .trans
// (rows 2(l%4)..+1, col l/4).
// ---------------------------------------------------------------------------------------
#ifndef AA_BWD_EMULATION
AA_BWD_DEV aa_u32 aa_bwd_smem_u32(const void* p) {
    aa_u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
AA_BWD_DEV void aa_ldsm_x4(aa_u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(aa_bwd_smem_u32(p))
                 : "memory");
}
AA_BWD_DEV void aa_ldsm_x4_t(aa_u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(aa_bwd_smem_u32(p))
                 : "memory");
}
template <typename T> struct AaMma;
template <> struct AaMma<AaF16> {
    AA_BWD_DEV static void run(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats -> two 16-bit values in one register, lo in the low half.
    AA_BWD_DEV static aa_u32 pack(float lo, float hi) {
        aa_u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <> struct AaMma<AaBF16> {
    AA_BWD_DEV static void run(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    AA_BWD_DEV static aa_u32 pack(float lo, float hi) {
        aa_u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
#endif

// Copy rows [row0, row0 + ROWS) x [0, HD) of a (nrows, ncols) matrix into shared memory
// (leading dim LDH), zero-filled outside. 16-byte accesses when the rows allow it.
template <int HD, int ROWS, int NT>
AA_BWD_DEV void aa_bwd_load_tile16(unsigned short* dst, const unsigned short* src, int row0,
                                   int nrows, int ncols) {
    constexpr int LDH = HD + 8;
    constexpr int CH = HD / 8;  // 16-byte chunks per row
    const bool vec = (ncols % 8) == 0;
    for (int idx = threadIdx.x; idx < ROWS * CH; idx += NT) {
        const int r = idx / CH;
        const int c = (idx % CH) * 8;
        unsigned short* out = dst + r * LDH + c;
        const long long grow = row0 + r;
        if (vec) {
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (grow < nrows && c < ncols)
                x = *reinterpret_cast<const uint4*>(src + grow * ncols + c);
            *reinterpret_cast<uint4*>(out) = x;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                unsigned short x = 0;  // +0.0 in both 16-bit formats
                if (grow < nrows && c + e < ncols) x = src[grow * ncols + c + e];
                out[e] = x;
            }
        }
    }
}

// One thread block: BN = 16 * NW keys; warp w owns keys [16w, 16w + 16) of the block and
// keeps their dK/dV rows (16 x HD each) in mma accumulators. Per query block of BM rows
// it computes S^T = K Q^T and dP^T = V dO^T (keys as the mma's rows), so P^T and dS^T
// are already A-operand fragments for dV += P^T dO and dK += dS^T Q.
template <typename T, int HD, int NW, int BM>
__global__ void __launch_bounds__(NW * 32)
aa_bwd_dkdv_mma(AA_BWD_ARGS(typename AaIO<T>::type, float), typename AaIO<T>::type* __restrict__ dk,
                typename AaIO<T>::type* __restrict__ dv,
                float* __restrict__ dq_acc) {
    constexpr int BN = 16 * NW;
    constexpr int NT = 32 * NW;
    constexpr int LDH = HD + 8;   // +16 bytes per row: conflict-free ldmatrix
    constexpr int LDS = BM + 8;
    constexpr int RT = BM / 16;   // dQ: row tiles of 16 queries
    constexpr int CS = NW / RT;   // dQ: column slices per row tile
    constexpr int QCOLS = HD / CS;
    static_assert(HD % 16 == 0 && BM % 16 == 0, "tiles are multiples of 16");
    static_assert(NW % RT == 0 && QCOLS % 16 == 0, "dQ warp tiling");
    AA_BWD_SMEM(aa_smem);
    typedef unsigned short H;  // 16-bit storage
    H* sK = reinterpret_cast<H*>(aa_smem);
    H* sV = sK + BN * LDH;
    H* sQ = sV + BN * LDH;
    H* sdO = sQ + BM * LDH;
    H* sdS = sdO + BM * LDH;  // dS^T: [key][query]
    float* sL = reinterpret_cast<float*>(sdS + BN * LDS);
    float* sD = sL + BM;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int kw0 = warp * 16;
    const int c0 = blockIdx.x * BN;
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int G = Hq / Hkv;
    const AaBwdSeq seq = aa_bwd_seq(b, L, S, diag, q_lens, k_lens);
    const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
    const bool dropout = drop_threshold != 0u;
    const long long kv_head = (long long)b * Hkv + hk;

    aa_bwd_load_tile16<HD, BN, NT>(sK, k + kv_head * S * E, c0, S, E);
    aa_bwd_load_tile16<HD, BN, NT>(sV, v + kv_head * S * Ev, c0, S, Ev);

    float acc_k[HD / 8][4], acc_v[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_k[t][r] = acc_v[t][r] = 0.f;

    int lo, hi;
    aa_row_range(c0, min(c0 + BN, seq.k_len), seq.offset, left, right, seq.q_len, lo, hi);
    for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        const long long qh = (long long)b * Hq + h;
        const float slope = alibi ? alibi[qh] : 0.f;
        const AaDropState drop = aa_drop_prefix(seed, b, h);
        const long long m_base = (long long)b * m_sb + (long long)h * m_sh;
        for (int m0 = hi > lo ? (lo / BM) * BM : hi; m0 < hi; m0 += BM) {
            __syncthreads();
            aa_bwd_load_tile16<HD, BM, NT>(sQ, q + qh * L * E, m0, L, E);
            aa_bwd_load_tile16<HD, BM, NT>(sdO, dout + qh * L * Ev, m0, L, Ev);
            aa_bwd_load_stats<float, BM, NT>(sL, sD, lse2 + qh * L, delta + qh * L, m0,
                                             seq.q_len);
            __syncthreads();

            // S^T (16 keys x BM queries) and dP^T for this warp's keys. (The head-dim loop
            // stays rolled: unrolled, the compiler hoists its loads past the register file.)
            float acc_s[BM / 8][4], acc_p[BM / 8][4];
#pragma unroll
            for (int t = 0; t < BM / 8; ++t)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc_s[t][r] = acc_p[t][r] = 0.f;
#pragma unroll 1
            for (int kk = 0; kk < HD / 16; ++kk) {
                aa_u32 ak[4], av[4];
                aa_ldsm_x4(ak, sK + (kw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
                aa_ldsm_x4(av, sV + (kw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
#pragma unroll
                for (int j = 0; j < BM / 16; ++j) {
                    const int row = j * 16 + lane % 8 + 8 * (lane / 16);
                    const int col = kk * 16 + 8 * ((lane / 8) % 2);
                    aa_u32 bq[4], bo[4];
                    aa_ldsm_x4(bq, sQ + row * LDH + col);
                    aa_ldsm_x4(bo, sdO + row * LDH + col);
                    AaMma<T>::run(acc_s[2 * j], ak, bq[0], bq[1]);
                    AaMma<T>::run(acc_s[2 * j + 1], ak, bq[2], bq[3]);
                    AaMma<T>::run(acc_p[2 * j], av, bo[0], bo[1]);
                    AaMma<T>::run(acc_p[2 * j + 1], av, bo[2], bo[3]);
                }
            }

            const bool full =
                aa_block_full(m0, m0 + BM, c0, c0 + BN, seq.offset, left, right, seq.k_len);
#pragma unroll
            for (int t = 0; t < BM / 8; ++t) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int key = kw0 + lane / 4 + 8 * (r / 2);
                    const int qi = t * 8 + 2 * (lane % 4) + (r % 2);
                    const int i = m0 + qi;
                    const int j = c0 + key;
                    const bool allowed =
                        (full || aa_allowed(i, j, seq.offset, left, right, seq.k_len)) &&
                        aa_bwd_mask_ok(mask, m_base, m_sr, m_sc, i, j, L);
                    bool keep = true;
                    if (dropout)
                        keep = aa_drop_keep(aa_drop_bits_rc(aa_drop_row(drop, i), j),
                                            drop_threshold);
                    float p, ds;
                    aa_bwd_element<float>(acc_s[t][r], acc_p[t][r], sL[qi], sD[qi], allowed,
                                          dropout, keep, scale, softcap, inv_softcap, inv_keep,
                                          aa_bwd_alibi(slope, i, j, seq.offset), p, ds);
                    acc_s[t][r] = p;
                    acc_p[t][r] = ds;
                }
            }

            // dV += P^T dO and dK += dS^T Q: A from registers, B = dO / Q by ldmatrix.trans.
#pragma unroll
            for (int kq = 0; kq < BM / 16; ++kq) {
                aa_u32 ap[4], as[4];
                ap[0] = AaMma<T>::pack(acc_s[2 * kq][0], acc_s[2 * kq][1]);
                ap[1] = AaMma<T>::pack(acc_s[2 * kq][2], acc_s[2 * kq][3]);
                ap[2] = AaMma<T>::pack(acc_s[2 * kq + 1][0], acc_s[2 * kq + 1][1]);
                ap[3] = AaMma<T>::pack(acc_s[2 * kq + 1][2], acc_s[2 * kq + 1][3]);
                as[0] = AaMma<T>::pack(acc_p[2 * kq][0], acc_p[2 * kq][1]);
                as[1] = AaMma<T>::pack(acc_p[2 * kq][2], acc_p[2 * kq][3]);
                as[2] = AaMma<T>::pack(acc_p[2 * kq + 1][0], acc_p[2 * kq + 1][1]);
                as[3] = AaMma<T>::pack(acc_p[2 * kq + 1][2], acc_p[2 * kq + 1][3]);
                const int row = kq * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
                for (int dt = 0; dt < HD / 16; ++dt) {
                    const int col = dt * 16 + 8 * (lane / 16);
                    aa_u32 bo[4], bq[4];
                    aa_ldsm_x4_t(bo, sdO + row * LDH + col);
                    aa_ldsm_x4_t(bq, sQ + row * LDH + col);
                    AaMma<T>::run(acc_v[2 * dt], ap, bo[0], bo[1]);
                    AaMma<T>::run(acc_v[2 * dt + 1], ap, bo[2], bo[3]);
                    AaMma<T>::run(acc_k[2 * dt], as, bq[0], bq[1]);
                    AaMma<T>::run(acc_k[2 * dt + 1], as, bq[2], bq[3]);
                }
                if (dq_acc) {
                    // dS^T rows of this warp -> shared memory for dQ = dS K.
                    const int key = kw0 + lane / 4;
                    const int qc = kq * 16 + 2 * (lane % 4);
                    *reinterpret_cast<aa_u32*>(sdS + key * LDS + qc) = as[0];
                    *reinterpret_cast<aa_u32*>(sdS + (key + 8) * LDS + qc) = as[1];
                    *reinterpret_cast<aa_u32*>(sdS + key * LDS + qc + 8) = as[2];
                    *reinterpret_cast<aa_u32*>(sdS + (key + 8) * LDS + qc + 8) = as[3];
                }
            }

            if (dq_acc) {
                __syncthreads();
                // dQ (BM x HD) = dS (BM x BN) K (BN x HD); warp -> (row tile, column slice).
                const int rt = warp % RT;
                const int cs = warp / RT;
                float acc_q[QCOLS / 8][4];
#pragma unroll
                for (int t = 0; t < QCOLS / 8; ++t)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc_q[t][r] = 0.f;
#pragma unroll 1
                for (int kc = 0; kc < BN / 16; ++kc) {
                    aa_u32 a[4];
                    aa_ldsm_x4_t(a, sdS + (kc * 16 + lane % 8 + 8 * (lane / 16)) * LDS + rt * 16 +
                                        8 * ((lane / 8) % 2));
                    const int krow = kc * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
                    for (int nt = 0; nt < QCOLS / 16; ++nt) {
                        aa_u32 bk[4];
                        aa_ldsm_x4_t(bk, sK + krow * LDH + cs * QCOLS + nt * 16 + 8 * (lane / 16));
                        AaMma<T>::run(acc_q[2 * nt], a, bk[0], bk[1]);
                        AaMma<T>::run(acc_q[2 * nt + 1], a, bk[2], bk[3]);
                    }
                }
                float* dq_head = dq_acc + qh * L * E;
#pragma unroll
                for (int t = 0; t < QCOLS / 8; ++t) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = m0 + rt * 16 + lane / 4 + 8 * (r / 2);
                        const int d = cs * QCOLS + t * 8 + 2 * (lane % 4) + (r % 2);
                        if (i < seq.q_len && d < E)
                            atomicAdd(dq_head + (long long)i * E + d, acc_q[t][r]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int t = 0; t < HD / 8; ++t) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int j = c0 + kw0 + lane / 4 + 8 * (r / 2);
            const int d = t * 8 + 2 * (lane % 4) + (r % 2);
            if (j < S) {
                if (d < E) dk[kv_head * S * E + (long long)j * E + d] = AaIO<T>::from_f(acc_k[t][r]);
                if (d < Ev) dv[kv_head * S * Ev + (long long)j * Ev + d] = AaIO<T>::from_f(acc_v[t][r]);
            }
        }
    }
}

// Deterministic dQ on tensor cores: BM = 16 * NW query rows per block, warp w owns rows
// [16w, 16w + 16) and their dQ (16 x HD) in accumulators; key blocks of BN in order.
template <typename T, int HD, int NW, int BN>
__global__ void __launch_bounds__(NW * 32)
aa_bwd_dq_mma(AA_BWD_ARGS(typename AaIO<T>::type, float), typename AaIO<T>::type* __restrict__ dq) {
    constexpr int BM = 16 * NW;
    constexpr int NT = 32 * NW;
    constexpr int LDH = HD + 8;
    static_assert(HD % 16 == 0 && BN % 16 == 0, "tiles are multiples of 16");
    AA_BWD_SMEM(aa_smem);
    typedef unsigned short H;  // 16-bit storage
    H* sQ = reinterpret_cast<H*>(aa_smem);
    H* sdO = sQ + BM * LDH;
    H* sK = sdO + BM * LDH;
    H* sV = sK + BN * LDH;
    float* sL = reinterpret_cast<float*>(sV + BN * LDH);
    float* sD = sL + BM;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int qw0 = warp * 16;
    const int m0 = blockIdx.x * BM;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int G = Hq / Hkv;
    const int hk = h / G;
    const AaBwdSeq seq = aa_bwd_seq(b, L, S, diag, q_lens, k_lens);
    const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
    const bool dropout = drop_threshold != 0u;
    const long long qh = (long long)b * Hq + h;
    const float slope = alibi ? alibi[qh] : 0.f;
    const long long kv_head = (long long)b * Hkv + hk;
    const AaDropState drop = aa_drop_prefix(seed, b, h);
    const long long m_base = (long long)b * m_sb + (long long)h * m_sh;

    aa_bwd_load_tile16<HD, BM, NT>(sQ, q + qh * L * E, m0, L, E);
    aa_bwd_load_tile16<HD, BM, NT>(sdO, dout + qh * L * Ev, m0, L, Ev);
    aa_bwd_load_stats<float, BM, NT>(sL, sD, lse2 + qh * L, delta + qh * L, m0, seq.q_len);

    float acc_q[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_q[t][r] = 0.f;

    int lo, hi;
    aa_key_range(m0, min(m0 + BM, seq.q_len), seq.offset, left, right, seq.k_len, lo, hi);
    for (int c0 = hi > lo ? (lo / BN) * BN : hi; c0 < hi; c0 += BN) {
        __syncthreads();
        aa_bwd_load_tile16<HD, BN, NT>(sK, k + kv_head * S * E, c0, S, E);
        aa_bwd_load_tile16<HD, BN, NT>(sV, v + kv_head * S * Ev, c0, S, Ev);
        __syncthreads();

        float acc_s[BN / 8][4], acc_p[BN / 8][4];
#pragma unroll
        for (int t = 0; t < BN / 8; ++t)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc_s[t][r] = acc_p[t][r] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            aa_u32 aq[4], ao[4];
            aa_ldsm_x4(aq, sQ + (qw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
            aa_ldsm_x4(ao, sdO + (qw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
#pragma unroll
            for (int j = 0; j < BN / 16; ++j) {
                const int row = j * 16 + lane % 8 + 8 * (lane / 16);
                const int col = kk * 16 + 8 * ((lane / 8) % 2);
                aa_u32 bk[4], bv[4];
                aa_ldsm_x4(bk, sK + row * LDH + col);
                aa_ldsm_x4(bv, sV + row * LDH + col);
                AaMma<T>::run(acc_s[2 * j], aq, bk[0], bk[1]);
                AaMma<T>::run(acc_s[2 * j + 1], aq, bk[2], bk[3]);
                AaMma<T>::run(acc_p[2 * j], ao, bv[0], bv[1]);
                AaMma<T>::run(acc_p[2 * j + 1], ao, bv[2], bv[3]);
            }
        }

        const bool full =
            aa_block_full(m0, m0 + BM, c0, c0 + BN, seq.offset, left, right, seq.k_len);
#pragma unroll
        for (int t = 0; t < BN / 8; ++t) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int qi = qw0 + lane / 4 + 8 * (r / 2);
                const int key = t * 8 + 2 * (lane % 4) + (r % 2);
                const int i = m0 + qi;
                const int j = c0 + key;
                const bool allowed =
                    (full || aa_allowed(i, j, seq.offset, left, right, seq.k_len)) &&
                    aa_bwd_mask_ok(mask, m_base, m_sr, m_sc, i, j, L);
                bool keep = true;
                if (dropout)
                    keep = aa_drop_keep(aa_drop_bits_rc(aa_drop_row(drop, i), j), drop_threshold);
                float p, ds;
                aa_bwd_element<float>(acc_s[t][r], acc_p[t][r], sL[qi], sD[qi], allowed, dropout,
                                      keep, scale, softcap, inv_softcap, inv_keep,
                                      aa_bwd_alibi(slope, i, j, seq.offset), p, ds);
                acc_s[t][r] = ds;
            }
        }

        // dQ += dS K: A = dS from registers (queries x keys), B = K by ldmatrix.trans.
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            aa_u32 a[4];
            a[0] = AaMma<T>::pack(acc_s[2 * kc][0], acc_s[2 * kc][1]);
            a[1] = AaMma<T>::pack(acc_s[2 * kc][2], acc_s[2 * kc][3]);
            a[2] = AaMma<T>::pack(acc_s[2 * kc + 1][0], acc_s[2 * kc + 1][1]);
            a[3] = AaMma<T>::pack(acc_s[2 * kc + 1][2], acc_s[2 * kc + 1][3]);
            const int krow = kc * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
            for (int dt = 0; dt < HD / 16; ++dt) {
                aa_u32 bk[4];
                aa_ldsm_x4_t(bk, sK + krow * LDH + dt * 16 + 8 * (lane / 16));
                AaMma<T>::run(acc_q[2 * dt], a, bk[0], bk[1]);
                AaMma<T>::run(acc_q[2 * dt + 1], a, bk[2], bk[3]);
            }
        }
    }

#pragma unroll
    for (int t = 0; t < HD / 8; ++t) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = m0 + qw0 + lane / 4 + 8 * (r / 2);
            const int d = t * 8 + 2 * (lane % 4) + (r % 2);
            if (i < L && d < E) dq[qh * L * E + (long long)i * E + d] = AaIO<T>::from_f(acc_q[t][r]);
        }
    }
}

// dQ accumulator (float) -> the query dtype.
template <typename T, typename Acc>
__global__ void __launch_bounds__(256)
aa_bwd_convert(const Acc* __restrict__ src, typename AaIO<T>::type* __restrict__ dst,
               long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = AaIO<T>::from_f(src[i]);
}

// =======================================================================================
// Variant v2 (ARRAYATTN_BWD_VARIANT=v2, backward.py): the tensor-core kernels above with a
// cp.async pipeline. What v1 loses per query step, and v2 changes:
//   * v1 loads Q/dO/LSE/D synchronously between two barriers, so every step waits a full
//     global-memory latency with the tensor cores idle (one block per SM: nothing else
//     runs). v2 double-buffers them: while step s computes from buffer s % 2, the copies
//     of step s + 1 (the next query block, or the first one of the next head of the GQA
//     group) land in the other buffer. The main loop has no synchronous global load.
//   * one barrier per step opens it (the step's copies landed for every thread AND every
//     thread left the previous step, so the other buffer may be refilled); the atomic
//     dQ part adds the one barrier that publishes dS^T. v1: 3 (atomic) / 2 barriers.
//   * larger query steps where registers allow (BM, backward.py's plan), fewer barriers
//     and fixed costs per MMA.
//   * dQ atomics two adjacent floats per instruction (red.global.add.v2.f32, sm_90).
// The arithmetic per element and every fragment layout are v1's, so results match v1's
// up to the dQ atomics' order.
// =======================================================================================
#ifndef AA_BWD_EMULATION
// 16 bytes global -> shared without a register round trip; src-size 0 zero-fills.
AA_BWD_DEV void aa_bwd_cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(aa_bwd_smem_u32(dst)),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
AA_BWD_DEV void aa_bwd_cp4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(aa_bwd_smem_u32(dst)),
                 "l"(src)
                 : "memory");
}
AA_BWD_DEV void aa_bwd_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
AA_BWD_DEV void aa_bwd_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// p[0] += a, p[1] += b as float atomics (p 8-byte aligned): one REDG.ADD.F32x2 on sm_90,
// half the atomic instructions of two atomicAdd calls; each element is added exactly as
// atomicAdd adds it (round to nearest, subnormals flushed, relaxed order).
AA_BWD_DEV void aa_bwd_red2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
#endif

// Issue the copies of rows [row0, row0 + ROWS) x [0, HD) of a (nrows, ncols) matrix into
// shared memory (leading dim HD + 8), zero-filled outside, as 16-byte cp.async. Needs
// ncols % 8 == 0 and 16-byte aligned rows: backward.py runs v2 only for E, Ev multiples
// of 8 (its operands start 16-byte aligned).
template <int HD, int ROWS, int NT>
AA_BWD_DEV void aa_bwd_async_tile16(unsigned short* dst, const unsigned short* src, int row0,
                                    int nrows, int ncols) {
    constexpr int LDH = HD + 8;
    constexpr int CH = HD / 8;
    for (int idx = threadIdx.x; idx < ROWS * CH; idx += NT) {
        const int r = idx / CH;
        const int c = (idx % CH) * 8;
        const long long grow = row0 + r;
        const bool valid = grow < nrows && c < ncols;
        // An invalid copy reads nothing (zero-fill); its address stays a valid one anyway.
        aa_bwd_cp16(dst + r * LDH + c, valid ? src + grow * ncols + c : src, valid);
    }
}

// Issue the row statistics of a query block: lse2 / delta by 4-byte cp.async for rows
// below q_len, +inf / 0 stored directly past it (as aa_bwd_load_stats).
template <int BM, int NT>
AA_BWD_DEV void aa_bwd_async_stats(float* sL, float* sD, const float* lse2, const float* delta,
                                   int row0, int q_len) {
    for (int m = threadIdx.x; m < BM; m += NT) {
        if (row0 + m < q_len) {
            aa_bwd_cp4(sL + m, lse2 + row0 + m);
            aa_bwd_cp4(sD + m, delta + row0 + m);
        } else {
            sL[m] = aa_bwd_inf<float>();
            sD[m] = 0.f;
        }
    }
}

// Dynamic shared memory of aa_bwd_dkdv_mma2 (backward.py sizes the launch from the same
// formula): K, V; two stages of Q, dO; dS^T; two stages of lse2, delta.
template <int HD, int NW, int BM>
struct AaBwdMma2Smem {
    static constexpr int value =
        (2 * 16 * NW * (HD + 8) + 4 * BM * (HD + 8) + 16 * NW * (BM + 8)) * 2 + 4 * BM * 4;
};

// dK/dV for BN = 16 * NW keys (warp w owns keys [16w, 16w + 16), as v1), the query steps
// of all G heads of the group flattened into one pipelined sequence. A step of BM rows
// (one pipeline stage, one barrier) runs as BM / BMS register sub-steps of BMS rows: S^T,
// dP^T, P, dS live in registers for BMS rows only, so BM can grow past what the register
// file holds (at D = 128 the dK/dV accumulators alone take 128 of 255 registers).
template <typename T, int HD, int NW, int BM, int BMS, bool FLEX = false>
__global__ void __launch_bounds__(NW * 32)
aa_bwd_dkdv_mma2(AA_BWD_ARGS(typename AaIO<T>::type, float),
                 typename AaIO<T>::type* __restrict__ dk, typename AaIO<T>::type* __restrict__ dv,
                 float* __restrict__ dq_acc) {
    constexpr int BN = 16 * NW;
    constexpr int NT = 32 * NW;
    constexpr int LDH = HD + 8;
    constexpr int LDS = BM + 8;
    constexpr int RT = BM / 16;
    constexpr int CS = NW / RT;
    constexpr int QCOLS = HD / CS;
    static_assert(HD % 16 == 0 && BM % 16 == 0 && BMS % 16 == 0, "tiles are multiples of 16");
    static_assert(BM % BMS == 0, "register sub-steps tile the query step");
    static_assert(NW % RT == 0 && QCOLS % 16 == 0, "dQ warp tiling");
    AA_BWD_SMEM(aa_smem);
    typedef unsigned short H;
    H* sK = reinterpret_cast<H*>(aa_smem);
    H* sV = sK + BN * LDH;
    H* sQ0 = sV + BN * LDH;        // stage s: sQ0 + s * 2 * BM * LDH
    H* sdO0 = sQ0 + BM * LDH;      //          sdO0 + s * 2 * BM * LDH
    H* sdS = sQ0 + 4 * BM * LDH;   // dS^T: [key][query]
    float* sL0 = reinterpret_cast<float*>(sdS + BN * LDS);  // stage s: sL0 + 2 * s * BM
    float* sD0 = sL0 + BM;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int kw0 = warp * 16;
    const int c0 = blockIdx.x * BN;
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int G = Hq / Hkv;
    const AaBwdSeq seq = aa_bwd_seq(b, L, S, diag, q_lens, k_lens);
    const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
    const bool dropout = drop_threshold != 0u;
    const long long kv_head = (long long)b * Hkv + hk;

    int lo, hi;
    aa_row_range(c0, min(c0 + BN, seq.k_len), seq.offset, left, right, seq.q_len, lo, hi);
    const int mfirst = hi > lo ? (lo / BM) * BM : hi;

    // Prologue: K, V and the first step's Q, dO, stats in one commit group. (FLEX: the
    // first step is the first listed query tile of the first head that has one.)
    aa_bwd_async_tile16<HD, BN, NT>(sK, k + kv_head * S * E, c0, S, E);
    aa_bwd_async_tile16<HD, BN, NT>(sV, v + kv_head * S * Ev, c0, S, Ev);
    {
        int g1 = 0;
        int m1 = mfirst;
        if constexpr (FLEX) m1 = aa_bflex_seek(flex, b, hk, G, c0, mfirst, hi, g1);
        if (m1 < hi) {
            const long long qh = (long long)b * Hq + hk * G + g1;
            aa_bwd_async_tile16<HD, BM, NT>(sQ0, q + qh * L * E, m1, L, E);
            aa_bwd_async_tile16<HD, BM, NT>(sdO0, dout + qh * L * Ev, m1, L, Ev);
            aa_bwd_async_stats<BM, NT>(sL0, sD0, lse2 + qh * L, delta + qh * L, m1, seq.q_len);
        }
    }
    aa_bwd_cp_commit();

    float acc_k[HD / 8][4], acc_v[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_k[t][r] = acc_v[t][r] = 0.f;

    int stage = 0;
    for (int g = 0; g < G && mfirst < hi; ++g) {
        const int h = hk * G + g;
        const long long qh = (long long)b * Hq + h;
        const float slope = alibi ? alibi[qh] : 0.f;
        const AaDropState drop = aa_drop_prefix(seed, b, h);
        const long long m_base = (long long)b * m_sb + (long long)h * m_sh;
        int m0 = mfirst;
        int fcur = 0;  // FLEX: the transposed list's pair of m0's query block
        if constexpr (FLEX) {
            fcur = aa_bflex_krow(flex, b, h, c0);
            m0 = aa_bflex_first(flex, fcur, flex[AA_BF_QB], mfirst, hi);
        }
        for (; m0 < hi; m0 = FLEX ? aa_bflex_step(flex, fcur, flex[AA_BF_QB], m0, BM, hi)
                                  : m0 + BM,
                        stage ^= 1) {
            // This thread's copies of this step landed; the barrier makes everyone's
            // visible and tells that every thread left the previous step, whose buffers
            // (the other stage, dS^T) may now be overwritten.
            aa_bwd_cp_wait_all();
            __syncthreads();
            {
                // Prefetch the next step (next query block, or the next head's first;
                // FLEX: the next listed one, or the next head's first listed one).
                int nm0 = FLEX ? aa_bflex_peek(flex, fcur, flex[AA_BF_QB], m0, BM, hi) : m0 + BM;
                int ng = g;
                if (nm0 >= hi) {
                    nm0 = mfirst;
                    ++ng;
                    if constexpr (FLEX) nm0 = aa_bflex_seek(flex, b, hk, G, c0, mfirst, hi, ng);
                }
                if (ng < G) {
                    const long long nqh = (long long)b * Hq + hk * G + ng;
                    const int ns = stage ^ 1;
                    aa_bwd_async_tile16<HD, BM, NT>(sQ0 + ns * 2 * BM * LDH, q + nqh * L * E,
                                                    nm0, L, E);
                    aa_bwd_async_tile16<HD, BM, NT>(sdO0 + ns * 2 * BM * LDH,
                                                    dout + nqh * L * Ev, nm0, L, Ev);
                    aa_bwd_async_stats<BM, NT>(sL0 + ns * 2 * BM, sD0 + ns * 2 * BM,
                                               lse2 + nqh * L, delta + nqh * L, nm0, seq.q_len);
                }
                aa_bwd_cp_commit();
            }
            const H* sQ = sQ0 + stage * 2 * BM * LDH;
            const H* sdO = sdO0 + stage * 2 * BM * LDH;
            const float* sL = sL0 + stage * 2 * BM;
            const float* sD = sD0 + stage * 2 * BM;

            const bool full =
                aa_block_full(m0, m0 + BM, c0, c0 + BN, seq.offset, left, right, seq.k_len);
#pragma unroll 1
            for (int ms = 0; ms < BM; ms += BMS) {
                // S^T (16 keys x BMS queries) and dP^T for this warp's keys (v1's products).
                float acc_s[BMS / 8][4], acc_p[BMS / 8][4];
#pragma unroll
                for (int t = 0; t < BMS / 8; ++t)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc_s[t][r] = acc_p[t][r] = 0.f;
#pragma unroll 1
                for (int kk = 0; kk < HD / 16; ++kk) {
                    aa_u32 ak[4], av[4];
                    aa_ldsm_x4(ak, sK + (kw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
                    aa_ldsm_x4(av, sV + (kw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
#pragma unroll
                    for (int j = 0; j < BMS / 16; ++j) {
                        const int row = ms + j * 16 + lane % 8 + 8 * (lane / 16);
                        const int col = kk * 16 + 8 * ((lane / 8) % 2);
                        aa_u32 bq[4], bo[4];
                        aa_ldsm_x4(bq, sQ + row * LDH + col);
                        aa_ldsm_x4(bo, sdO + row * LDH + col);
                        AaMma<T>::run(acc_s[2 * j], ak, bq[0], bq[1]);
                        AaMma<T>::run(acc_s[2 * j + 1], ak, bq[2], bq[3]);
                        AaMma<T>::run(acc_p[2 * j], av, bo[0], bo[1]);
                        AaMma<T>::run(acc_p[2 * j + 1], av, bo[2], bo[3]);
                    }
                }

#pragma unroll
                for (int t = 0; t < BMS / 8; ++t) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int key = kw0 + lane / 4 + 8 * (r / 2);
                        const int qi = ms + t * 8 + 2 * (lane % 4) + (r % 2);
                        const int i = m0 + qi;
                        const int j = c0 + key;
                        bool allowed =
                            (full || aa_allowed(i, j, seq.offset, left, right, seq.k_len)) &&
                            aa_bwd_mask_ok(mask, m_base, m_sr, m_sc, i, j, L);
                        if constexpr (FLEX) allowed = allowed && aa_bflex_ok(flex, fcur, i, j);
                        bool keep = true;
                        if (dropout)
                            keep = aa_drop_keep(aa_drop_bits_rc(aa_drop_row(drop, i), j),
                                                drop_threshold);
                        float p, ds;
                        aa_bwd_element<float>(acc_s[t][r], acc_p[t][r], sL[qi], sD[qi], allowed,
                                              dropout, keep, scale, softcap, inv_softcap, inv_keep,
                                              aa_bwd_alibi(slope, i, j, seq.offset), p, ds);
                        acc_s[t][r] = p;
                        acc_p[t][r] = ds;
                    }
                }

                // dV += P^T dO, dK += dS^T Q (A from registers, B by ldmatrix.trans).
#pragma unroll
                for (int kq = 0; kq < BMS / 16; ++kq) {
                    aa_u32 ap[4], as[4];
                    ap[0] = AaMma<T>::pack(acc_s[2 * kq][0], acc_s[2 * kq][1]);
                    ap[1] = AaMma<T>::pack(acc_s[2 * kq][2], acc_s[2 * kq][3]);
                    ap[2] = AaMma<T>::pack(acc_s[2 * kq + 1][0], acc_s[2 * kq + 1][1]);
                    ap[3] = AaMma<T>::pack(acc_s[2 * kq + 1][2], acc_s[2 * kq + 1][3]);
                    as[0] = AaMma<T>::pack(acc_p[2 * kq][0], acc_p[2 * kq][1]);
                    as[1] = AaMma<T>::pack(acc_p[2 * kq][2], acc_p[2 * kq][3]);
                    as[2] = AaMma<T>::pack(acc_p[2 * kq + 1][0], acc_p[2 * kq + 1][1]);
                    as[3] = AaMma<T>::pack(acc_p[2 * kq + 1][2], acc_p[2 * kq + 1][3]);
                    const int row = ms + kq * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
                    for (int dt = 0; dt < HD / 16; ++dt) {
                        const int col = dt * 16 + 8 * (lane / 16);
                        aa_u32 bo[4], bq[4];
                        aa_ldsm_x4_t(bo, sdO + row * LDH + col);
                        aa_ldsm_x4_t(bq, sQ + row * LDH + col);
                        AaMma<T>::run(acc_v[2 * dt], ap, bo[0], bo[1]);
                        AaMma<T>::run(acc_v[2 * dt + 1], ap, bo[2], bo[3]);
                        AaMma<T>::run(acc_k[2 * dt], as, bq[0], bq[1]);
                        AaMma<T>::run(acc_k[2 * dt + 1], as, bq[2], bq[3]);
                    }
                    if (dq_acc) {
                        const int key = kw0 + lane / 4;
                        const int qc = ms + kq * 16 + 2 * (lane % 4);
                        *reinterpret_cast<aa_u32*>(sdS + key * LDS + qc) = as[0];
                        *reinterpret_cast<aa_u32*>(sdS + (key + 8) * LDS + qc) = as[1];
                        *reinterpret_cast<aa_u32*>(sdS + key * LDS + qc + 8) = as[2];
                        *reinterpret_cast<aa_u32*>(sdS + (key + 8) * LDS + qc + 8) = as[3];
                    }
                }

            }

            if (dq_acc) {
                __syncthreads();  // dS^T complete; its next writers wait at the next step's barrier
                const int rt = warp % RT;
                const int cs = warp / RT;
                float acc_q[QCOLS / 8][4];
#pragma unroll
                for (int t = 0; t < QCOLS / 8; ++t)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc_q[t][r] = 0.f;
#pragma unroll 1
                for (int kc = 0; kc < BN / 16; ++kc) {
                    aa_u32 a[4];
                    aa_ldsm_x4_t(a, sdS + (kc * 16 + lane % 8 + 8 * (lane / 16)) * LDS + rt * 16 +
                                        8 * ((lane / 8) % 2));
                    const int krow = kc * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
                    for (int nt = 0; nt < QCOLS / 16; ++nt) {
                        aa_u32 bk[4];
                        aa_ldsm_x4_t(bk, sK + krow * LDH + cs * QCOLS + nt * 16 + 8 * (lane / 16));
                        AaMma<T>::run(acc_q[2 * nt], a, bk[0], bk[1]);
                        AaMma<T>::run(acc_q[2 * nt + 1], a, bk[2], bk[3]);
                    }
                }
                float* dq_head = dq_acc + qh * L * E;
#pragma unroll
                for (int t = 0; t < QCOLS / 8; ++t) {
#pragma unroll
                    for (int r = 0; r < 4; r += 2) {
                        // (r, r + 1): columns d, d + 1 of one row; d even and E % 8 == 0
                        // (v2's host condition), so both are inside or both outside.
                        const int i = m0 + rt * 16 + lane / 4 + 8 * (r / 2);
                        const int d = cs * QCOLS + t * 8 + 2 * (lane % 4);
                        if (i < seq.q_len && d < E)
                            aa_bwd_red2(dq_head + (long long)i * E + d, acc_q[t][r],
                                        acc_q[t][r + 1]);
                    }
                }
            }
        }
    }
    aa_bwd_cp_wait_all();  // no copy outlives the block (none is pending here anyway)

#pragma unroll
    for (int t = 0; t < HD / 8; ++t) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int j = c0 + kw0 + lane / 4 + 8 * (r / 2);
            const int d = t * 8 + 2 * (lane % 4) + (r % 2);
            if (j < S) {
                if (d < E) dk[kv_head * S * E + (long long)j * E + d] = AaIO<T>::from_f(acc_k[t][r]);
                if (d < Ev) dv[kv_head * S * Ev + (long long)j * Ev + d] = AaIO<T>::from_f(acc_v[t][r]);
            }
        }
    }
}

// Dynamic shared memory of aa_bwd_dq_mma2: Q, dO; two stages of K, V; lse2, delta.
template <int HD, int NW, int BN>
struct AaBwdDqMma2Smem {
    static constexpr int value = (2 * 16 * NW * (HD + 8) + 4 * BN * (HD + 8)) * 2 + 2 * 16 * NW * 4;
};

// Deterministic dQ (v1's aa_bwd_dq_mma) with K/V double-buffered by cp.async: the key
// blocks still come in the same fixed order, so dQ stays bit-identical run to run.
template <typename T, int HD, int NW, int BN, bool FLEX = false>
__global__ void __launch_bounds__(NW * 32)
aa_bwd_dq_mma2(AA_BWD_ARGS(typename AaIO<T>::type, float), typename AaIO<T>::type* __restrict__ dq) {
    constexpr int BM = 16 * NW;
    constexpr int NT = 32 * NW;
    constexpr int LDH = HD + 8;
    static_assert(HD % 16 == 0 && BN % 16 == 0, "tiles are multiples of 16");
    AA_BWD_SMEM(aa_smem);
    typedef unsigned short H;
    H* sQ = reinterpret_cast<H*>(aa_smem);
    H* sdO = sQ + BM * LDH;
    H* sK0 = sdO + BM * LDH;   // stage s: sK0 + s * 2 * BN * LDH
    H* sV0 = sK0 + BN * LDH;   //          sV0 + s * 2 * BN * LDH
    float* sL = reinterpret_cast<float*>(sK0 + 4 * BN * LDH);
    float* sD = sL + BM;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int qw0 = warp * 16;
    const int m0 = blockIdx.x * BM;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int G = Hq / Hkv;
    const int hk = h / G;
    const AaBwdSeq seq = aa_bwd_seq(b, L, S, diag, q_lens, k_lens);
    const float inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
    const bool dropout = drop_threshold != 0u;
    const long long qh = (long long)b * Hq + h;
    const float slope = alibi ? alibi[qh] : 0.f;
    const long long kv_head = (long long)b * Hkv + hk;
    const AaDropState drop = aa_drop_prefix(seed, b, h);
    const long long m_base = (long long)b * m_sb + (long long)h * m_sh;

    int lo, hi;
    aa_key_range(m0, min(m0 + BM, seq.q_len), seq.offset, left, right, seq.k_len, lo, hi);
    int cfirst = hi > lo ? (lo / BN) * BN : hi;
    int fcur = 0;  // FLEX: the list's pair of c0's key block
    if constexpr (FLEX) {
        fcur = aa_bflex_qrow(flex, b, h, m0);
        cfirst = aa_bflex_first(flex, fcur, flex[AA_BF_KB], cfirst, hi);
    }

    // Prologue: Q, dO, stats and the first K/V block in one commit group.
    aa_bwd_async_tile16<HD, BM, NT>(sQ, q + qh * L * E, m0, L, E);
    aa_bwd_async_tile16<HD, BM, NT>(sdO, dout + qh * L * Ev, m0, L, Ev);
    aa_bwd_async_stats<BM, NT>(sL, sD, lse2 + qh * L, delta + qh * L, m0, seq.q_len);
    if (cfirst < hi) {
        aa_bwd_async_tile16<HD, BN, NT>(sK0, k + kv_head * S * E, cfirst, S, E);
        aa_bwd_async_tile16<HD, BN, NT>(sV0, v + kv_head * S * Ev, cfirst, S, Ev);
    }
    aa_bwd_cp_commit();

    float acc_q[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_q[t][r] = 0.f;

    int stage = 0;
    for (int c0 = cfirst; c0 < hi;
         c0 = FLEX ? aa_bflex_step(flex, fcur, flex[AA_BF_KB], c0, BN, hi) : c0 + BN,
             stage ^= 1) {
        aa_bwd_cp_wait_all();
        __syncthreads();  // this block's K/V visible; the other stage is free again
        const int cn = FLEX ? aa_bflex_peek(flex, fcur, flex[AA_BF_KB], c0, BN, hi) : c0 + BN;
        if (cn < hi) {
            aa_bwd_async_tile16<HD, BN, NT>(sK0 + (stage ^ 1) * 2 * BN * LDH, k + kv_head * S * E,
                                            cn, S, E);
            aa_bwd_async_tile16<HD, BN, NT>(sV0 + (stage ^ 1) * 2 * BN * LDH,
                                            v + kv_head * S * Ev, cn, S, Ev);
        }
        aa_bwd_cp_commit();
        const H* sK = sK0 + stage * 2 * BN * LDH;
        const H* sV = sV0 + stage * 2 * BN * LDH;

        float acc_s[BN / 8][4], acc_p[BN / 8][4];
#pragma unroll
        for (int t = 0; t < BN / 8; ++t)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc_s[t][r] = acc_p[t][r] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            aa_u32 aq[4], ao[4];
            aa_ldsm_x4(aq, sQ + (qw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
            aa_ldsm_x4(ao, sdO + (qw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
#pragma unroll
            for (int j = 0; j < BN / 16; ++j) {
                const int row = j * 16 + lane % 8 + 8 * (lane / 16);
                const int col = kk * 16 + 8 * ((lane / 8) % 2);
                aa_u32 bk[4], bv[4];
                aa_ldsm_x4(bk, sK + row * LDH + col);
                aa_ldsm_x4(bv, sV + row * LDH + col);
                AaMma<T>::run(acc_s[2 * j], aq, bk[0], bk[1]);
                AaMma<T>::run(acc_s[2 * j + 1], aq, bk[2], bk[3]);
                AaMma<T>::run(acc_p[2 * j], ao, bv[0], bv[1]);
                AaMma<T>::run(acc_p[2 * j + 1], ao, bv[2], bv[3]);
            }
        }

        const bool full =
            aa_block_full(m0, m0 + BM, c0, c0 + BN, seq.offset, left, right, seq.k_len);
#pragma unroll
        for (int t = 0; t < BN / 8; ++t) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int qi = qw0 + lane / 4 + 8 * (r / 2);
                const int key = t * 8 + 2 * (lane % 4) + (r % 2);
                const int i = m0 + qi;
                const int j = c0 + key;
                bool allowed =
                    (full || aa_allowed(i, j, seq.offset, left, right, seq.k_len)) &&
                    aa_bwd_mask_ok(mask, m_base, m_sr, m_sc, i, j, L);
                if constexpr (FLEX) allowed = allowed && aa_bflex_ok(flex, fcur, i, j);
                bool keep = true;
                if (dropout)
                    keep = aa_drop_keep(aa_drop_bits_rc(aa_drop_row(drop, i), j), drop_threshold);
                float p, ds;
                aa_bwd_element<float>(acc_s[t][r], acc_p[t][r], sL[qi], sD[qi], allowed, dropout,
                                      keep, scale, softcap, inv_softcap, inv_keep,
                                      aa_bwd_alibi(slope, i, j, seq.offset), p, ds);
                acc_s[t][r] = ds;
            }
        }

#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            aa_u32 a[4];
            a[0] = AaMma<T>::pack(acc_s[2 * kc][0], acc_s[2 * kc][1]);
            a[1] = AaMma<T>::pack(acc_s[2 * kc][2], acc_s[2 * kc][3]);
            a[2] = AaMma<T>::pack(acc_s[2 * kc + 1][0], acc_s[2 * kc + 1][1]);
            a[3] = AaMma<T>::pack(acc_s[2 * kc + 1][2], acc_s[2 * kc + 1][3]);
            const int krow = kc * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
            for (int dt = 0; dt < HD / 16; ++dt) {
                aa_u32 bk[4];
                aa_ldsm_x4_t(bk, sK + krow * LDH + dt * 16 + 8 * (lane / 16));
                AaMma<T>::run(acc_q[2 * dt], a, bk[0], bk[1]);
                AaMma<T>::run(acc_q[2 * dt + 1], a, bk[2], bk[3]);
            }
        }
    }
    aa_bwd_cp_wait_all();

#pragma unroll
    for (int t = 0; t < HD / 8; ++t) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = m0 + qw0 + lane / 4 + 8 * (r / 2);
            const int d = t * 8 + 2 * (lane % 4) + (r % 2);
            if (i < L && d < E) dq[qh * L * E + (long long)i * E + d] = AaIO<T>::from_f(acc_q[t][r]);
        }
    }
}
