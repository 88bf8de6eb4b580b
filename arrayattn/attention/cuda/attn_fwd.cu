// arrayattn/attention/cuda/attn_fwd.cu -- FlashAttention-2 forward kernels.
//
// Three kernels with one argument list (see AA_FWD_ARGS below):
//   aa_fwd_tc<DT, D, MT, SOFTCAP, DROPOUT, MASK>   float16 (DT=0) / bfloat16 (DT=1), tensor
//       cores, MT row tiles of 16 per warp (AaTcDefaultMT):
//       mma.sync.m16n8k16 (row.col, f32 accumulators), ldmatrix, cp.async double buffering,
//       probabilities repacked in registers as the A operand of P @ V. sm_80 or newer.
//   aa_fwd_simt<T, D, SOFTCAP, DROPOUT, MASK>   float / double on CUDA cores, register tiles,
//       accumulation (and softmax, and LSE) in T.
//   aa_fwd_tc2<DT, D, SOFTCAP, MASK, ALIBI>   the tensor-core kernel's variant 2 (128 x 64
//       tiles, one barrier per key tile; ARRAYATTN_FWD_VARIANT=v2, see its section).
//   aa_fwd_tf32<D, SOFTCAP, MASK, ALIBI>   float on tensor cores, each product as three
//       TF32 products (float accuracy; ARRAYATTN_FWD_VARIANT=v3, see its section).
// D (head dim of Q, K and V) is one of 32, 64, 96, 128, 256; the host pads other sizes.
// Runtime options (null pointers when absent; contiguous (batch, Hq) in the accumulation
// type, indexed blockIdx.z * gridDim.y + head): sinks, gpt-oss logits folded into each
// row's denominator at the end (aa_fold_sink), and alibi slopes, -slope * |i + offset - j|
// added to every score after the softcap.
// MASK: 0 none, 1 dense bool (uint8, nonzero = takes part), 2 dense float bias (float32 for
// the tc and float kernels, float64 for double), read through four int64 element strides so
// any broadcast works; plus AA_MASK_FLEX (4: 4, 5, 6) for a block mask (arrayattn.flex), read
// from the `flex` table (see "Block masks" below; null otherwise).
//
// Grid: (query blocks, Hq, batch or sequence). A block keeps its Q tile (in registers for
// D <= 128) while K/V tiles stream through shared memory; online softmax in the log2
// domain with a running max and a per-thread partial sum; one normalisation at the end.
// Key tiles outside the block's structural key range are never visited; element masking
// runs only on tiles that are not entirely allowed (the diagonal and ragged tails).
//
// Sequences (AaSeq): with cu_q/cu_k (packed varlen) blockIdx.z is a sequence, the arrays
// have a single batch, rows are cu_q[z] + i and keys cu_k[z] + j. Otherwise blockIdx.z is
// the flat batch index, and optional q_lens/kv_lens limit each batch's rows and keys:
// rows at or past q_len are empty (output 0, LSE -inf). Bottom-right alignment uses the
// per-sequence offset kv_len - q_len. Dropout indices (as ops/varlen.py defines them):
// batch = blockIdx.z (flat batch index, or sequence index for varlen), head = query head,
// row/col = positions within the sequence (so packed varlen equals the padded call).
//
// Strides are int64 element strides; the innermost (head-dim) stride is 1. For 16-bit
// types every row start must be 16-byte aligned (the host guarantees it or copies).

#include "common.cuh"

#define AA_DEV __device__ __forceinline__

// AA_FWD_EMULATION: tests/kernels/forward_emulator.h compiles this file as host C++ and
// supplies aa_smem, the thread/warp primitives and the PTX wrappers below, so the CPU
// tests run these very kernels.
#ifndef AA_FWD_EMULATION
extern __shared__ __align__(16) unsigned char aa_smem[];
#endif

// ---------------------------------------------------------------------------------------
// Sequence geometry
// ---------------------------------------------------------------------------------------
struct AaSeq {
    int tb;          // batch index into the arrays (0 for packed varlen)
    int row_base;    // first row of the sequence along L
    int col_base;    // first key of the sequence along S
    int q_len;       // valid query rows
    int kv_len;      // valid keys
    int rows_store;  // rows this sequence owns in the output (L padded, q_len varlen)
    int offset;      // diagonal offset: query i sits on key i + offset (common.cuh)
};

AA_DEV int aa_clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

AA_DEV AaSeq aa_sequence(int b, const int* q_lens, const int* kv_lens, const int* cu_q,
                         const int* cu_k, int L, int S, int diag) {
    AaSeq s;
    if (cu_q != nullptr) {
        s.tb = 0;
        s.row_base = cu_q[b];
        s.col_base = cu_k[b];
        s.q_len = cu_q[b + 1] - s.row_base;
        s.kv_len = cu_k[b + 1] - s.col_base;
        s.rows_store = s.q_len;
    } else {
        s.tb = b;
        s.row_base = 0;
        s.col_base = 0;
        s.q_len = q_lens != nullptr ? aa_clamp(q_lens[b], 0, L) : L;
        s.kv_len = kv_lens != nullptr ? aa_clamp(kv_lens[b], 0, S) : S;
        s.rows_store = L;
    }
    s.offset = diag == AA_DIAG_FROM_LENGTHS ? s.kv_len - s.q_len : diag;
    return s;
}

// The argument list every forward kernel takes (the host builds it once).
#define AA_FWD_ARGS(TIO, TACC)                                                               \
    const TIO *__restrict__ q, const TIO *__restrict__ k, const TIO *__restrict__ v,         \
        TIO *__restrict__ o, TACC *__restrict__ lse, const void *__restrict__ mask,          \
        const int *__restrict__ q_lens, const int *__restrict__ kv_lens,                     \
        const int *__restrict__ cu_q, const int *__restrict__ cu_k, long long q_sb,          \
        long long q_sh, long long q_sr, long long k_sb, long long k_sh, long long k_sr,      \
        long long v_sb, long long v_sh, long long v_sr, long long o_sb, long long o_sh,      \
        long long o_sr, long long lse_sb, long long lse_sh, long long m_sb, long long m_sh, \
        long long m_sr, long long m_sc, int L, int S, int G, int diag, int left,            \
        int right, TACC scale_log2, TACC scale, TACC softcap, TACC inv_softcap,             \
        aa_u32 seed, aa_u32 threshold, TACC inv_keep, const TACC *__restrict__ sinks,       \
        const TACC *__restrict__ alibi, const int *__restrict__ flex

// Sinks (gpt-oss): fold one more logit sink2 (log2 domain) with no value into a row's
// running max m and sum l at the end; returns the factor the row's accumulator takes
// (exp2(m_old - m_new), 0 for a row that saw no key). A -inf sink changes nothing.
template <typename A>
AA_DEV A aa_fold_sink(A sink2, A& m, A& l) {
    if (sink2 == aa_neg_inf<A>()) return A(1);
    const A mx = m > sink2 ? m : sink2;
    const A o_scale = m == aa_neg_inf<A>() ? A(0) : aa_exp2(m - mx);
    l = l * o_scale + aa_exp2(sink2 - mx);
    m = mx;
    return o_scale;
}

// Score (raw q.k) -> log2-domain score after scale, softcap and float bias; -inf where
// the dense mask says no. The structural mask is applied by the caller.
template <typename A, bool SOFTCAP, int MASK>
AA_DEV A aa_score(A raw, A scale_log2, A scale, A cap, A inv_cap, const void* mask,
                  long long m_off) {
    A x;
    if constexpr (SOFTCAP) {
        x = aa_softcap(raw * scale, cap, inv_cap) * (A)AA_LOG2E;
    } else {
        x = raw * scale_log2;
    }
    if constexpr ((MASK & 3) == 1) {
        if (static_cast<const unsigned char*>(mask)[m_off] == 0) x = aa_neg_inf<A>();
    } else if constexpr ((MASK & 3) == 2) {
        x += static_cast<const A*>(mask)[m_off] * (A)AA_LOG2E;
    }
    return x;
}

// ---------------------------------------------------------------------------------------
// Block masks (MASK & AA_MASK_FLEX; arrayattn.flex, host side cuda/flex_table.py)
// ---------------------------------------------------------------------------------------
// `flex` is one int32 buffer built once per BlockMask and device: a header, then per
// (batch, head, query mask block) the number of non-empty key mask blocks and their list
// in ascending order as (key block, partial id) pairs (partial id -1 for a full block)
// ended by the pair (nk, -1), then the bits of every partial block (row-major, wpr 32-bit words per row, bit c of a
// row's words = key c of the block; 1 = takes part). The kernel's query tile lies in one
// query mask block and each key tile in one key mask block (the host checks
// Q_BLOCK % BM == 0 and KV_BLOCK % BN == 0), so a block of the grid reads one list, visits
// the tiles of the listed blocks inside its structural key range [n_begin, n_end) (empty
// blocks cost nothing; the cp.async prefetch fetches the next listed tile), and on tiles
// of partial blocks sets the scores the bits exclude to -inf, where a dense bool mask
// would (so every other mask is ANDed, and empty rows stay output 0, LSE -inf or the sink).
#define AA_MASK_FLEX 4
enum {
    AA_FLEX_NQ = 0,       // query mask blocks per (batch, head) table
    AA_FLEX_NK = 1,       // key mask blocks (each list holds nk + 1 pairs)
    AA_FLEX_TSB = 2,      // table stride per batch index (0: one table for every batch)
    AA_FLEX_TSH = 3,      // table stride per query head (0: one for every head)
    AA_FLEX_QBLOCK = 4,   // Q_BLOCK
    AA_FLEX_KVBLOCK = 5,  // KV_BLOCK
    AA_FLEX_WPR = 6,      // 32-bit words per row of a partial block's bits
    AA_FLEX_CNT = 7,      // int32 offset of the counts (tables x nq)
    AA_FLEX_LIST = 8,     // ... of the lists (tables x nq x (nk + 1) pairs)
    AA_FLEX_BITS = 9,     // ... of the bits (partial id x Q_BLOCK x wpr words)
    AA_FLEX_HEADER = 16
};

// A grid block walks its list with one int32 offset into `flex`, `cur`, at the (key
// block, partial id) pair of its current tile's block; each list ends with the pair
// (nk, -1), whose first tile nk * tpb is at or past every n_end. tpb: kernel key tiles per
// key mask block (KV_BLOCK / BN), reloaded where needed, like the mask block's first row:
// one register stays live across the main loop (the offset), which the tensor-core
// kernels need (they run at the 255-register cap).
template <int BN>
AA_DEV int aa_flex_tpb(const int* flex) {
    return flex[AA_FLEX_KVBLOCK] / BN;
}

// The first tile of the schedule inside [n_begin, n_end) (n_end when there is none), and
// `cur` at its block; the list scan is uniform across the grid block.
template <int BN>
AA_DEV int aa_flex_first(const int* flex, int b, int h, int r0, int n_begin, int n_end,
                         int& cur) {
    const int tpb = aa_flex_tpb<BN>(flex);
    const long long row = ((long long)b * flex[AA_FLEX_TSB] + (long long)h * flex[AA_FLEX_TSH]) *
                              flex[AA_FLEX_NQ] + r0 / flex[AA_FLEX_QBLOCK];
    cur = (int)(flex[AA_FLEX_LIST] + row * 2 * (flex[AA_FLEX_NK] + 1));
    while ((flex[cur] + 1) * tpb <= n_begin) cur += 2;  // (stops at the end pair at the latest)
    const int t0 = flex[cur] * tpb;
    const int n = t0 > n_begin ? t0 : n_begin;
    return n < n_end ? n : n_end;
}

// The tile after tile n: the next one of the same key mask block, else the first of the
// next listed block; n_end when none is left. (aa_flex_advance then moves `cur` on by one
// pair when that tile is at or past the current block's end.)
template <int BN>
AA_DEV int aa_flex_next(const int* flex, int cur, int n, int n_end) {
    const int tpb = aa_flex_tpb<BN>(flex);
    int nx = n + 1;
    if (nx >= (flex[cur] + 1) * tpb) nx = flex[cur + 2] * tpb;
    return nx < n_end ? nx : n_end;
}
template <int BN>
AA_DEV void aa_flex_advance(const int* flex, int& cur, int n_next) {
    if (n_next >= (flex[cur] + 1) * aa_flex_tpb<BN>(flex)) cur += 2;
}

// The bit words of the current block (partial) at `row` (of the grid block starting at
// row r0) and key tile c0: the word holding key c0 of the tile (KV_BLOCK % BN == 0 and
// BN % 32 == 0 start the tensor-core kernels' tiles on a word).
template <int BN>
AA_DEV const aa_u32* aa_flex_words(const int* flex, int cur, int r0, int row, int c0) {
    const int qb = flex[AA_FLEX_QBLOCK];
    const int wpr = flex[AA_FLEX_WPR];
    const int kcol = c0 - flex[cur] * flex[AA_FLEX_KVBLOCK];  // key of the block at c0
    const long long w = ((long long)flex[cur + 1] * qb + (row - r0 + r0 % qb)) * wpr;
    return reinterpret_cast<const aa_u32*>(flex + flex[AA_FLEX_BITS]) + w + (kcol >> 5);
}

// Tensor-core fragments (aa_fwd_tc, aa_fwd_tc2): element e of n-tile nt of row tile mt
// sits at row row_w + 16 mt + 8 (e >> 1), key c0 + 8 nt + 2 t + (e & 1); w: the words of
// row row_w at key c0 (aa_flex_words), wpr words per row.
template <int MT, int NS>
AA_DEV void aa_flex_mask_frag(float (&s)[MT][NS][4], const aa_u32* w, int wpr, int t) {
    static_assert(NS % 4 == 0, "key tiles of whole 32-bit words");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const aa_u32* wr = w + (16 * mt + 8 * half) * wpr;
            aa_u32 wd[NS / 4];
#pragma unroll
            for (int i = 0; i < NS / 4; ++i) wd[i] = wr[i];
#pragma unroll
            for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool ok = (wd[nt >> 2] >> ((nt & 3) * 8 + 2 * t + e)) & 1u;
                    float& x = s[mt][nt][2 * half + e];
                    x = ok ? x : aa_neg_inf_f();
                }
        }
}

// The tensor-core fragments of a partial mask block's tile (rows row_w + ..., keys
// c0 + ...; the layout of aa_flex_mask_frag): the scores the block mask excludes set to
// -inf. Bits path: the block's bit words. AA_FLEX_PRED (a built-in mask_mod): the
// predicate on each element the thread holds (fewer evaluations than building the 32-key
// words; the pair's second value is the table's batch index).
template <int BN, int MT, int NS>
AA_DEV void aa_flex_mask_tile(float (&s)[MT][NS][4], const int* flex, int cur, int r0,
                              int row_w, int c0, int t) {
#ifdef AA_FLEX_PRED
    // The predicate into one bit per element, then the bits path's select. Its loads are
    // unconditional (aa_flex_pred): the table's header and parameters are read once and
    // each row's and key's id once per tile (2 + 2 NS loads a thread at MT = 1), all in
    // flight together. (On the H100, 2026-11-26 17:03 and 17:16 UTC, the first form,
    // with a chain of dependent loads behind a branch per element, ran this forward
    // 1.8-2.0x slower than the bits path, unrolled or rolled; this form has not run on a
    // GPU yet.)
    static_assert(MT * NS * 4 <= 64, "one bit per fragment element");
    const int b = flex[cur + 1];
    unsigned long long keep = 0ull;
#pragma unroll
    for (int k = 0; k < MT * NS * 4; ++k) {
        const int mt = k / (NS * 4), nt = (k / 4) % NS, e = k % 4;
        const int i = row_w + 16 * mt + 8 * (e >> 1);
        const int j = c0 + 8 * nt + 2 * t + (e & 1);
        keep |= (unsigned long long)aa_flex_pred(flex, b, i, j) << k;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float& x = s[mt][nt][e];
                x = (keep >> ((mt * NS + nt) * 4 + e)) & 1ull ? x : aa_neg_inf_f();
            }
#else
    aa_flex_mask_frag<MT, NS>(s, aa_flex_words<BN>(flex, cur, r0, row_w, c0), flex[AA_FLEX_WPR], t);
#endif
}

// The CUDA-core kernel's view of a partial block for the rows of one thread: from the
// first row `row` at key tile c0 (aa_flex_rows), whether row row + r sees key c0 + dc
// (query i, key j; aa_flex_rows_ok); aa_flex_rows_none() on other tiles. Bits path: the
// words and the bit of c0 in its word (BN = 16 tiles may start mid-word), exactly the
// state the kernel kept before; AA_FLEX_PRED: the table's batch index for the predicate.
#ifdef AA_FLEX_PRED
struct AaFlexRows {
    int b;  // -1: not a partial block
};
AA_DEV AaFlexRows aa_flex_rows_none() { return AaFlexRows{-1}; }
AA_DEV bool aa_flex_rows_on(const AaFlexRows& f) { return f.b >= 0; }
template <int BN>
AA_DEV AaFlexRows aa_flex_rows(const int* flex, int cur, int r0, int row, int c0) {
    return AaFlexRows{flex[cur + 1]};
}
AA_DEV bool aa_flex_rows_ok(const int* flex, const AaFlexRows& f, int r, int dc, int i, int j) {
    return aa_flex_pred(flex, f.b, i, j);
}
#else
struct AaFlexRows {
    const aa_u32* w;  // nullptr: not a partial block
    int bit, wpr;
};
AA_DEV AaFlexRows aa_flex_rows_none() { return AaFlexRows{nullptr, 0, 0}; }
AA_DEV bool aa_flex_rows_on(const AaFlexRows& f) { return f.w != nullptr; }
template <int BN>
AA_DEV AaFlexRows aa_flex_rows(const int* flex, int cur, int r0, int row, int c0) {
    return AaFlexRows{aa_flex_words<BN>(flex, cur, r0, row, c0),
                      (c0 - flex[cur] * flex[AA_FLEX_KVBLOCK]) & 31, flex[AA_FLEX_WPR]};
}
AA_DEV bool aa_flex_rows_ok(const int* flex, const AaFlexRows& f, int r, int dc, int i, int j) {
    const int cb = f.bit + dc;
    return (f.w[r * f.wpr + (cb >> 5)] >> (cb & 31)) & 1u;
}
#endif

// ---------------------------------------------------------------------------------------
// PTX wrappers (sm_80+)
// ---------------------------------------------------------------------------------------
#ifndef AA_FWD_EMULATION
AA_DEV aa_u32 aa_smem_u32(const void* p) {
    aa_u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// BYTES = 4, 8 (.ca) or 16 (.cg, L2 only). src-size 0 zero-fills (ragged tails), so no
// NaN garbage reaches the MMAs.
template <int BYTES>
AA_DEV void aa_cp_async(aa_u32 dst, const void* src, bool valid) {
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(valid ? 16 : 0)
                     : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src),
                     "n"(BYTES), "r"(valid ? BYTES : 0)
                     : "memory");
    }
}
AA_DEV void aa_cp_async16(aa_u32 dst, const void* src, bool valid) {
    aa_cp_async<16>(dst, src, valid);
}
AA_DEV void aa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
AA_DEV void aa_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

AA_DEV void aa_ldsm_x4(aa_u32 addr, aa_u32& r0, aa_u32& r1, aa_u32& r2, aa_u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
AA_DEV void aa_ldsm_x4_t(aa_u32 addr, aa_u32& r0, aa_u32& r1, aa_u32& r2, aa_u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// c += a (16x16, row) * b (16x8, col); DT 0 = float16, 1 = bfloat16.
template <int DT>
AA_DEV void aa_mma(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
    if (DT == 0) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats -> one register of two 16-bit values, lo in the low half (element order).
template <int DT>
AA_DEV aa_u32 aa_pack2(float lo, float hi) {
    aa_u32 r;
    if (DT == 0) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// aa_fwd_tf32's operands: x rounded to TF32 (10 mantissa bits, to nearest, ties away from
// zero, the low 13 bits cleared; infinities and NaN stay what they are) by integer
// arithmetic, so the value is exact in a float and x - big is exact too; big + small is x
// to about 2^-22 relative.
AA_DEV aa_u32 aa_tf32_round(float x) { return (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u; }
AA_DEV void aa_split_tf32(float x, aa_u32& big, aa_u32& small) {
    big = aa_tf32_round(x);
    small = aa_tf32_round(x - __uint_as_float(big));
}
// c += a (16x8, row) * b (8x8, col) in TF32, f32 accumulators.
AA_DEV void aa_mma_tf32(float (&c)[4], const aa_u32 (&a)[4], aa_u32 b0, aa_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // AA_FWD_EMULATION

// ---------------------------------------------------------------------------------------
// Tensor-core kernel (float16 / bfloat16)
// ---------------------------------------------------------------------------------------
// MT: m16 row tiles per warp. MT = 2 (32 rows per warp, Q re-read from shared memory)
// reuses every K/V fragment for two row tiles, FlashAttention-2's choice on sm80/sm90;
// MT = 1 (16 rows per warp) keeps the Q fragments in registers instead.
template <int D>
struct AaTcDefaultMT {
    static constexpr int value = D == 256 ? 1 : 2;
};

template <int D, int MT>
struct AaTcCfg {
    static constexpr int BM = D == 256 ? 64 : 128;  // query rows per block
    static constexpr int BN = (D == 256 || (MT == 2 && D >= 96)) ? 32 : 64;  // keys per tile
    static constexpr int WARPS = BM / (16 * MT);
    static constexpr int NT = WARPS * 32;
    static constexpr bool Q_IN_REGS = MT == 1 && D <= 128;  // else Q fragments from smem
    static constexpr int DP = D + 8;  // smem row pitch (halves): ldmatrix conflict-free
    static constexpr int MIN_BLOCKS = 1;
    static constexpr int SMEM = (BM + 4 * BN) * DP * 2;  // Q + 2 stages of K and V
};

// Async copy of an R x D tile of 16-bit values (row stride rs elements) into smem rows of
// pitch DP; rows >= nvalid are zero-filled.
template <int R, int D, int DP, int NT>
AA_DEV void aa_tile_async(aa_u32 sbase, const unsigned short* g, long long rs, int nvalid,
                          const unsigned short* safe, int tid) {
    constexpr int CPR = D / 8;
    constexpr int TOTAL = R * CPR;
#pragma unroll
    for (int it = 0; it < (TOTAL + NT - 1) / NT; ++it) {
        const int c = tid + it * NT;
        if (TOTAL % NT == 0 || c < TOTAL) {
            const int r = c / CPR;
            const int kc = c - r * CPR;
            const bool valid = r < nvalid;
            const unsigned short* src = valid ? g + r * rs + kc * 8 : safe;
            aa_cp_async16(sbase + (aa_u32)((r * DP + kc * 8) * 2), src, valid);
        }
    }
}

template <int DT, int D, int MT, bool SOFTCAP, bool DROPOUT, int MASK>
__global__ void __launch_bounds__(AaTcCfg<D, MT>::NT, AaTcCfg<D, MT>::MIN_BLOCKS)
    aa_fwd_tc(AA_FWD_ARGS(unsigned short, float)) {
    using C = AaTcCfg<D, MT>;
    constexpr int BM = C::BM, BN = C::BN, DP = C::DP, NT = C::NT;
    constexpr int NS = BN / 8;   // S n-tiles per row tile
    constexpr int NO = D / 8;    // O n-tiles per row tile
    constexpr int KS = D / 16;   // k-steps of Q K^T
    constexpr int WR = 16 * MT;  // rows per warp

    const int b = blockIdx.z, h = blockIdx.y;
    const AaSeq sq = aa_sequence(b, q_lens, kv_lens, cu_q, cu_k, L, S, diag);
    const long long bh = (long long)b * gridDim.y + h;
    const float slope2 = alibi != nullptr ? alibi[bh] * (float)AA_LOG2E : 0.f;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BM;  // late (causally heavy) blocks first
    if (r0 >= sq.rows_store) return;
    const int rows_valid = sq.q_len - r0;  // may be <= 0 (padding rows only)

    int lo, hi;
    aa_key_range(r0, r0 + (rows_valid < BM ? rows_valid : BM), sq.offset, left, right,
                 sq.kv_len, lo, hi);
    const int n_begin = lo / BN;
    const int n_end = hi > lo ? (hi + BN - 1) / BN : n_begin;
    // Block masks: the listed key blocks' tiles inside [n_begin, n_end) only.
    constexpr bool FLEX = (MASK & AA_MASK_FLEX) != 0;
    int fcur = 0;  // flex[fcur]: the current tile's (key block, partial id) pair
    int n = n_begin;
    if constexpr (FLEX) n = aa_flex_first<BN>(flex, b, h, r0, n_begin, n_end, fcur);
    const int n_first = n;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    unsigned short* sQ = reinterpret_cast<unsigned short*>(aa_smem);
    const aa_u32 sQa = aa_smem_u32(sQ);
    const aa_u32 sKa = sQa + BM * DP * 2;
    const aa_u32 sVa = sKa + 2 * BN * DP * 2;
    constexpr aa_u32 STAGE = BN * DP * 2;  // bytes per K or V stage

    const unsigned short* qg = q + sq.tb * q_sb + h * q_sh + (long long)(sq.row_base + r0) * q_sr;
    const int kvh = h / G;
    const unsigned short* kg = k + sq.tb * k_sb + kvh * k_sh + (long long)sq.col_base * k_sr;
    const unsigned short* vg = v + sq.tb * v_sb + kvh * v_sh + (long long)sq.col_base * v_sr;

    // Prologue: Q, K[n_begin], V[n_begin] as three commit groups.
    aa_tile_async<BM, D, DP, NT>(sQa, qg, q_sr, rows_valid, q, tid);
    aa_cp_commit();
    if (n_first < n_end) {
        const int c0 = n_first * BN;
        aa_tile_async<BN, D, DP, NT>(sKa, kg + c0 * k_sr, k_sr, sq.kv_len - c0, k, tid);
        aa_cp_commit();
        aa_tile_async<BN, D, DP, NT>(sVa, vg + c0 * v_sr, v_sr, sq.kv_len - c0, v, tid);
        aa_cp_commit();
    }

    float acc_o[MT][NO][4];
    float m_r[MT][2], l_r[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < NO; ++i)
            acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
        m_r[mt][0] = m_r[mt][1] = aa_neg_inf_f();
        l_r[mt][0] = l_r[mt][1] = 0.f;
    }
    aa_u32 qf[C::Q_IN_REGS ? KS : 1][4];

    // This thread's rows: row_w + 16 * mt + 8 * half.
    const int row_w = r0 + warp * WR + g;
    AaDropState drop_rows[MT][2];
    if constexpr (DROPOUT) {
        const AaDropState pre = aa_drop_prefix(seed, b, h);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            drop_rows[mt][0] = aa_drop_row(pre, row_w + 16 * mt);
            drop_rows[mt][1] = aa_drop_row(pre, row_w + 16 * mt + 8);
        }
    }

    // ldmatrix lane addresses (byte offsets inside a tile)
    const aa_u32 q_lane = (aa_u32)(((warp * WR + (lane & 15)) * DP + (lane >> 4) * 8) * 2);
    const aa_u32 k_lane = (aa_u32)((((lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8) * 2);
    const aa_u32 v_lane = (aa_u32)((((lane & 7) + (((lane >> 3) & 1) << 3)) * DP + (lane >> 4) * 8) * 2);

    for (int it = 0; n < n_end; ++it) {
        const int n_next = FLEX ? aa_flex_next<BN>(flex, fcur, n, n_end) : n + 1;
        const aa_u32 stage = (aa_u32)((FLEX ? it : n - n_begin) & 1) * STAGE;
        aa_cp_wait<1>();  // Q and K[n] have landed (V[n] may still be in flight)
        __syncthreads();
        if constexpr (C::Q_IN_REGS) {
            if (n == n_first) {
#pragma unroll
                for (int ks = 0; ks < KS; ++ks)
                    aa_ldsm_x4(sQa + q_lane + ks * 32, qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
            }
        }
        if (n_next < n_end) {
            const int c1 = n_next * BN;
            aa_tile_async<BN, D, DP, NT>(sKa + (STAGE ^ stage), kg + c1 * k_sr, k_sr,
                                         sq.kv_len - c1, k, tid);
        }
        aa_cp_commit();

        // S = Q K^T for this warp's rows and the tile's BN keys; each K fragment feeds
        // all MT row tiles.
        float s[MT][NS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NS; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            aa_u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (C::Q_IN_REGS) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[mt][e] = qf[ks][e];
                } else {
                    aa_ldsm_x4(sQa + q_lane + (mt * 16 * DP + ks * 16) * 2, a[mt][0], a[mt][1],
                               a[mt][2], a[mt][3]);
                }
            }
#pragma unroll
            for (int jp = 0; jp < NS / 2; ++jp) {
                aa_u32 b0, b1, b2, b3;
                aa_ldsm_x4(sKa + stage + k_lane + (jp * 16 * DP + ks * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    aa_mma<DT>(s[mt][2 * jp], a[mt], b0, b1);
                    aa_mma<DT>(s[mt][2 * jp + 1], a[mt], b2, b3);
                }
            }
        }

        // Scores to the log2 domain; masks. Element e of n-tile nt of row tile mt sits at
        // row row_w + 16 * mt + 8 * (e >> 1), key c0 + nt * 8 + 2 * t + (e & 1).
        const int c0 = n * BN;
        const bool full = r0 + BM <= sq.q_len &&
                          aa_block_full(r0, r0 + BM, c0, c0 + BN, sq.offset, left, right, sq.kv_len);
        const long long m_base = sq.tb * m_sb + h * m_sh;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row_w + 16 * mt + 8 * (e >> 1);
                    const int j = c0 + nt * 8 + 2 * t + (e & 1);
                    const bool ok =
                        full || (i < sq.q_len && aa_allowed(i, j, sq.offset, left, right, sq.kv_len));
                    float x = aa_neg_inf_f();
                    if (ok) {
                        const long long m_off = m_base + (long long)(sq.row_base + i) * m_sr +
                                                (long long)(sq.col_base + j) * m_sc;
                        x = aa_score<float, SOFTCAP, MASK>(s[mt][nt][e], scale_log2, scale,
                                                           softcap, inv_softcap, mask, m_off);
                        if (alibi != nullptr) x -= slope2 * (float)aa_alibi_dist(i, j, sq.offset);
                    }
                    s[mt][nt][e] = x;
                }
            }
        }
        if constexpr (FLEX) {  // a partial mask block: its bits
            if (flex[fcur + 1] >= 0) aa_flex_mask_tile<BN, MT, NS>(s, flex, fcur, r0, row_w, c0, t);
        }

        // Online softmax: running max over the row (4 threads share a row), rescale.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx[2] = {m_r[mt][0], m_r[mt][1]};
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
                mx[0] = fmaxf(mx[0], fmaxf(s[mt][nt][0], s[mt][nt][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[mt][nt][2], s[mt][nt][3]));
            }
            float m_use[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float alpha =
                    m_r[mt][r] == aa_neg_inf_f() ? 0.f : aa_exp2(m_r[mt][r] - mx[r]);
                m_r[mt][r] = mx[r];
                m_use[r] = mx[r] == aa_neg_inf_f() ? 0.f : mx[r];  // empty so far: exp2(-inf) = 0
                l_r[mt][r] *= alpha;
#pragma unroll
                for (int i = 0; i < NO; ++i) {
                    acc_o[mt][i][2 * r] *= alpha;
                    acc_o[mt][i][2 * r + 1] *= alpha;
                }
            }
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = aa_exp2(s[mt][nt][e] - m_use[e >> 1]);
                    l_r[mt][e >> 1] += p;
                    if constexpr (DROPOUT) {
                        const int j = c0 + nt * 8 + 2 * t + (e & 1);
                        s[mt][nt][e] =
                            aa_drop_keep(aa_drop_bits_rc(drop_rows[mt][e >> 1], j), threshold) ? p : 0.f;
                    } else {
                        s[mt][nt][e] = p;
                    }
                }
            }
        }

        aa_cp_wait<1>();  // V[n] has landed (K[n+1] may still be in flight)
        __syncthreads();
        if (n_next < n_end) {
            const int c1 = n_next * BN;
            aa_tile_async<BN, D, DP, NT>(sVa + (STAGE ^ stage), vg + c1 * v_sr, v_sr,
                                         sq.kv_len - c1, v, tid);
        }
        aa_cp_commit();

        // O += P V with P repacked from the S accumulators as A fragments; each V
        // fragment feeds all MT row tiles.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            aa_u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = aa_pack2<DT>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = aa_pack2<DT>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = aa_pack2<DT>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = aa_pack2<DT>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                aa_u32 b0, b1, b2, b3;
                aa_ldsm_x4_t(sVa + stage + v_lane + (kk * 16 * DP + dp * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    aa_mma<DT>(acc_o[mt][2 * dp], a[mt], b0, b1);
                    aa_mma<DT>(acc_o[mt][2 * dp + 1], a[mt], b2, b3);
                }
            }
        }
        if constexpr (FLEX) aa_flex_advance<BN>(flex, fcur, n_next);
        n = n_next;
    }

    // Epilogue: normalise once, stage the warp's rows through its own part of sQ, write
    // 16-byte vectors; LSE = ln(2) * (m + log2(l)), -inf for empty rows.
    aa_cp_wait<0>();
    __syncthreads();
    unsigned short* sO = sQ + warp * WR * DP;
    float* lg = lse + sq.tb * lse_sb + h * lse_sh + sq.row_base;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv_l[2], lse_v[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_r[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float m = m_r[mt][r];
            float o_scale = 1.f;
            if (sinks != nullptr) o_scale = aa_fold_sink(sinks[bh] * (float)AA_LOG2E, m, l);
            inv_l[r] = l > 0.f ? inv_keep * o_scale / l : 0.f;
            lse_v[r] = l > 0.f ? (m + log2f(l)) * (float)AA_LN2 : aa_neg_inf_f();
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            const int col = i * 8 + 2 * t;
            *reinterpret_cast<aa_u32*>(sO + (16 * mt + g) * DP + col) =
                aa_pack2<DT>(acc_o[mt][i][0] * inv_l[0], acc_o[mt][i][1] * inv_l[0]);
            *reinterpret_cast<aa_u32*>(sO + (16 * mt + g + 8) * DP + col) =
                aa_pack2<DT>(acc_o[mt][i][2] * inv_l[1], acc_o[mt][i][3] * inv_l[1]);
        }
        if (t == 0) {
            const int row = row_w + 16 * mt;
            if (row < sq.rows_store) lg[row] = lse_v[0];
            if (row + 8 < sq.rows_store) lg[row + 8] = lse_v[1];
        }
    }
    __syncwarp();
    unsigned short* og = o + sq.tb * o_sb + h * o_sh;
    constexpr int CPR = D / 8;
#pragma unroll
    for (int it = 0; it < (WR * CPR + 31) / 32; ++it) {
        const int c = lane + it * 32;
        if ((WR * CPR) % 32 == 0 || c < WR * CPR) {
            const int rr = c / CPR, kc = c - rr * CPR;
            const int row = r0 + warp * WR + rr;
            if (row < sq.rows_store) {
                *reinterpret_cast<uint4*>(og + (long long)(sq.row_base + row) * o_sr + kc * 8) =
                    *reinterpret_cast<const uint4*>(sO + rr * DP + kc * 8);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tensor-core kernel, variant 2 (float16 / bfloat16): ARRAYATTN_FWD_VARIANT=v2 (tiles.py)
// ---------------------------------------------------------------------------------------
// The same algorithm and argument list as aa_fwd_tc, reshaped for issue rate:
// - 128 x 64 tiles (4 warps x 32 query rows, MT = 2; 64 keys per tile at D = 64, 96 and
//   128): the row-max shuffles, the O rescale and the barrier are paid every 64 keys
//   instead of every 32 (aa_fwd_tc at D >= 96).
// - K/V copy addresses advance by a fixed stride per thread (aa_tile_async_rows), not a
//   64-bit multiply per 16-byte chunk.
// - One barrier per key tile: at the top of tile n each thread waits for all its copies
//   (K[n] and V[n], issued one whole tile earlier), the barrier publishes them and
//   retires every read of tile n - 1, and the copies of K[n+1] and V[n+1] go into the
//   other stage right away, before the scores and the softmax of tile n.
// - RAW (no softcap, no dense mask, no ALiBi): scores stay raw q.k; the row max is taken
//   on raw scores and scaled once per row, and p = exp2(s * scale_log2 - m) is one FFMA
//   feeding MUFU.EX2. Needs scale_log2 > 0 (the host declines v2 otherwise). Masked
//   elements are -inf raw scores, which stay -inf after the FFMA.
// - The O rescale runs only when some row of the warp raised its max in this tile (a warp
//   vote); rows whose max did not change take alpha = 1 exactly, so skipping the multiply
//   changes no bit and correctness does not depend on the vote.
// - ALiBi is a template flag (the alibi pointer must be non-null exactly when it is set),
//   like softcap and the mask kind, so none of their code exists in the plain variant.
// Dropout is not supported here (register budget at MT = 2 with 64-key tiles); the host
// runs aa_fwd_tc for dropout, for D other than 64, 96 and 128 (96 only behind
// ARRAYATTN_FWD_TC2_D96=1 until measured), and for softcap, dense masks and ALiBi at
// D = 96 and 128, which spill here (tiles.v2_declines). D = 96 is 6 k-steps of 16 and 12
// O n-tiles; its smem pitch (104 halves, 13 16-byte chunks, odd) keeps ldmatrix
// conflict-free, and K/V rows are copied by 96 of the 128 threads (aa_tile_async_rows).
// The keys row i may see, [jlo, jhi] (i < q_len and aa_allowed; every key j >= 0), as an
// unsigned range test: key j0 + k is allowed <=> base + k <= span (unsigned), with
// base = j0 - jlo and span = jhi - jlo. For 0 <= jlo <= jhi < 2**31 and 0 <= j < 2**31 the
// wrapped difference j - jlo is <= span exactly when jlo <= j <= jhi; an empty row takes
// jlo = INT_MAX and span = 0, which only j = INT_MAX (never a key) would pass.
AA_DEV void aa_row_keys(int i, int q_len, int offset, int left, int right, int kv_len, int j0,
                        aa_u32& base, aa_u32& span) {
    const int diag = i + offset;
    int jlo = left >= 0 ? diag - left : 0;
    if (jlo < 0) jlo = 0;
    int jhi = kv_len - 1;
    if (right >= 0 && diag + right < jhi) jhi = diag + right;
    if (i >= q_len || jhi < jlo) {
        jlo = 2147483647;
        jhi = jlo;
    }
    base = (aa_u32)j0 - (aa_u32)jlo;
    span = (aa_u32)jhi - (aa_u32)jlo;
}

// aa_tile_async for v2's K/V tiles with the thread's chunk geometry hoisted: the first
// CT = RSTEP * (D / 8) threads copy whole rows, RSTEP (the largest power of two <=
// NT / (D / 8), so that it divides R) per pass: thread tid copies column chunk
// tid % (D / 8) of rows tid / (D / 8) + it * RSTEP, and the source pointer advances by a
// fixed stride (no 64-bit multiply per chunk, which made address arithmetic about a
// quarter of v1's main loop). CT = NT at D = 64 and 128. At D = 96 (12 chunks a row) 96
// threads (warps 0-2, so the test is warp-uniform) copy 8 rows a pass and warp 3 none: the alternative, every thread with a geometry that repeats every 3 passes, held
// three source pointers per operand and spilled the block-mask variant at 255 registers.
// Rows >= nvalid are zero-filled from `safe`, as in aa_tile_async.
template <int R, int D, int DP, int NT>
AA_DEV void aa_tile_async_rows(aa_u32 sbase, const unsigned short* g, long long rs, int nvalid,
                               const unsigned short* safe, int tid) {
    constexpr int CPR = D / 8;
    constexpr int RMAX = NT / CPR;
    constexpr int RSTEP = RMAX >= 32 ? 32 : RMAX >= 16 ? 16 : RMAX >= 8 ? 8 : RMAX >= 4 ? 4 : RMAX;
    constexpr int CT = RSTEP * CPR, ITERS = R / RSTEP;
    static_assert(RSTEP > 0 && R % RSTEP == 0, "whole rows per pass");
    if (CT < NT && tid >= CT) return;
    const int row0 = tid / CPR, kc = tid - row0 * CPR;
    const unsigned short* p = g + row0 * rs + kc * 8;
    const long long step = RSTEP * rs;
    const aa_u32 sdst = sbase + (aa_u32)((row0 * DP + kc * 8) * 2);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const bool valid = row0 + it * RSTEP < nvalid;
        aa_cp_async16(sdst + (aa_u32)(it * RSTEP * DP * 2), valid ? p : safe, valid);
        p += step;
    }
}

template <int D>
struct AaTc2Cfg {
    static constexpr int BM = 128;  // query rows per block
    static constexpr int BN = 64;   // keys per tile
    static constexpr int MT = 2;    // m16 row tiles per warp
    static constexpr int WARPS = BM / (16 * MT);
    static constexpr int NT = WARPS * 32;
    static constexpr int DP = D + 8;  // smem row pitch (halves): ldmatrix conflict-free
    // Two blocks (8 warps) per SM: 255 registers per thread at most, and 2 x SMEM fits in
    // 228 KB for D <= 128 (D = 128: 104448 bytes per block).
    static constexpr int MIN_BLOCKS = 2;
    static constexpr int SMEM = (BM + 4 * BN) * DP * 2;  // Q + 2 stages of K and V
};

template <int DT, int D, bool SOFTCAP, int MASK, bool ALIBI>
__global__ void __launch_bounds__(AaTc2Cfg<D>::NT, AaTc2Cfg<D>::MIN_BLOCKS)
    aa_fwd_tc2(AA_FWD_ARGS(unsigned short, float)) {
    using C = AaTc2Cfg<D>;
    constexpr int BM = C::BM, BN = C::BN, DP = C::DP, NT = C::NT, MT = C::MT;
    constexpr int NS = BN / 8;   // S n-tiles per row tile
    constexpr int NO = D / 8;    // O n-tiles per row tile
    constexpr int KS = D / 16;   // k-steps of Q K^T
    constexpr int WR = 16 * MT;  // rows per warp
    constexpr bool RAW = !SOFTCAP && (MASK & 3) == 0 && !ALIBI;

    const int b = blockIdx.z, h = blockIdx.y;
    const AaSeq sq = aa_sequence(b, q_lens, kv_lens, cu_q, cu_k, L, S, diag);
    const long long bh = (long long)b * gridDim.y + h;
    float slope2 = 0.f;
    if constexpr (ALIBI) slope2 = alibi[bh] * (float)AA_LOG2E;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BM;  // late (causally heavy) blocks first
    if (r0 >= sq.rows_store) return;
    const int rows_valid = sq.q_len - r0;  // may be <= 0 (padding rows only)

    int lo, hi;
    aa_key_range(r0, r0 + (rows_valid < BM ? rows_valid : BM), sq.offset, left, right,
                 sq.kv_len, lo, hi);
    const int n_begin = lo / BN;
    const int n_end = hi > lo ? (hi + BN - 1) / BN : n_begin;
    // Block masks: the listed key blocks' tiles inside [n_begin, n_end) only.
    constexpr bool FLEX = (MASK & AA_MASK_FLEX) != 0;
    int fcur = 0;  // flex[fcur]: the current tile's (key block, partial id) pair
    int n = n_begin;
    if constexpr (FLEX) n = aa_flex_first<BN>(flex, b, h, r0, n_begin, n_end, fcur);
    const int n_first = n;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    unsigned short* sQ = reinterpret_cast<unsigned short*>(aa_smem);
    const aa_u32 sQa = aa_smem_u32(sQ);
    const aa_u32 sKa = sQa + BM * DP * 2;
    const aa_u32 sVa = sKa + 2 * BN * DP * 2;
    constexpr aa_u32 STAGE = BN * DP * 2;  // bytes per K or V stage

    const unsigned short* qg = q + sq.tb * q_sb + h * q_sh + (long long)(sq.row_base + r0) * q_sr;
    const int kvh = h / G;
    const unsigned short* kg = k + sq.tb * k_sb + kvh * k_sh + (long long)sq.col_base * k_sr;
    const unsigned short* vg = v + sq.tb * v_sb + kvh * v_sh + (long long)sq.col_base * v_sr;

    // Prologue: Q, K[n_begin] and V[n_begin] as one commit group (the first tile waits
    // for all three anyway).
    aa_tile_async<BM, D, DP, NT>(sQa, qg, q_sr, rows_valid, q, tid);
    if (n_first < n_end) {
        const int c0 = n_first * BN;
        aa_tile_async_rows<BN, D, DP, NT>(sKa, kg + c0 * k_sr, k_sr, sq.kv_len - c0, k, tid);
        aa_tile_async_rows<BN, D, DP, NT>(sVa, vg + c0 * v_sr, v_sr, sq.kv_len - c0, v, tid);
    }
    aa_cp_commit();

    float acc_o[MT][NO][4];
    float m_r[MT][2], l_r[MT][2];  // m_r: running row max, log2 domain, scaled
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < NO; ++i)
            acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
        m_r[mt][0] = m_r[mt][1] = aa_neg_inf_f();
        l_r[mt][0] = l_r[mt][1] = 0.f;
    }
    // Scores -> log2 domain inside the exp2's FFMA (RAW), or already there.
    const float mul = RAW ? scale_log2 : 1.f;

    // This thread's rows: row_w + 16 * mt + 8 * half.
    const int row_w = r0 + warp * WR + g;

    // ldmatrix lane addresses (byte offsets inside a tile)
    const aa_u32 q_lane = (aa_u32)(((warp * WR + (lane & 15)) * DP + (lane >> 4) * 8) * 2);
    const aa_u32 k_lane = (aa_u32)((((lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8) * 2);
    const aa_u32 v_lane = (aa_u32)((((lane & 7) + (((lane >> 3) & 1) << 3)) * DP + (lane >> 4) * 8) * 2);

    for (int it = 0; n < n_end; ++it) {
        const int n_next = FLEX ? aa_flex_next<BN>(flex, fcur, n, n_end) : n + 1;
        const aa_u32 stage = (aa_u32)((FLEX ? it : n - n_begin) & 1) * STAGE;
        aa_cp_wait<0>();  // this thread's copies of K[n] and V[n] (and Q) have landed
        __syncthreads();  // ... every thread's; and tile n - 1's stage is no longer read
        if (n_next < n_end) {
            const int c1 = n_next * BN;
            aa_tile_async_rows<BN, D, DP, NT>(sKa + (STAGE ^ stage), kg + c1 * k_sr, k_sr,
                                         sq.kv_len - c1, k, tid);
            aa_tile_async_rows<BN, D, DP, NT>(sVa + (STAGE ^ stage), vg + c1 * v_sr, v_sr,
                                         sq.kv_len - c1, v, tid);
        }
        aa_cp_commit();

        // S = Q K^T for this warp's rows and the tile's BN keys; each K fragment feeds
        // both row tiles.
        float s[MT][NS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NS; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            aa_u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                aa_ldsm_x4(sQa + q_lane + (mt * 16 * DP + ks * 16) * 2, a[mt][0], a[mt][1],
                           a[mt][2], a[mt][3]);
#pragma unroll
            for (int jp = 0; jp < NS / 2; ++jp) {
                aa_u32 b0, b1, b2, b3;
                aa_ldsm_x4(sKa + stage + k_lane + (jp * 16 * DP + ks * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    aa_mma<DT>(s[mt][2 * jp], a[mt], b0, b1);
                    aa_mma<DT>(s[mt][2 * jp + 1], a[mt], b2, b3);
                }
            }
        }

        // Element e of n-tile nt of row tile mt sits at row row_w + 16 * mt + 8 * (e >> 1),
        // key c0 + nt * 8 + 2 * t + (e & 1).
        const int c0 = n * BN;
        const bool full = r0 + BM <= sq.q_len &&
                          aa_block_full(r0, r0 + BM, c0, c0 + BN, sq.offset, left, right, sq.kv_len);
        if constexpr (RAW) {
            // Raw scores; only the structure can mask, and only on tiles not entirely
            // allowed. aa_allowed as one key interval per row (aa_row_keys), so the
            // element test is one unsigned compare and a select, no branch.
            if (!full) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        aa_u32 base, span;
                        aa_row_keys(row_w + 16 * mt + 8 * half, sq.q_len, sq.offset, left, right,
                                    sq.kv_len, c0 + 2 * t, base, span);
#pragma unroll
                        for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const bool ok = base + (aa_u32)(nt * 8 + e) <= span;
                                float& x = s[mt][nt][2 * half + e];
                                x = ok ? x : aa_neg_inf_f();
                            }
                    }
            }
        } else {
            // Scores to the log2 domain (scale, softcap, float bias, ALiBi); masks.
            const long long m_base = sq.tb * m_sb + h * m_sh;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = row_w + 16 * mt + 8 * (e >> 1);
                        const int j = c0 + nt * 8 + 2 * t + (e & 1);
                        const bool ok =
                            full || (i < sq.q_len && aa_allowed(i, j, sq.offset, left, right, sq.kv_len));
                        float x = aa_neg_inf_f();
                        if (ok) {
                            const long long m_off = m_base + (long long)(sq.row_base + i) * m_sr +
                                                    (long long)(sq.col_base + j) * m_sc;
                            x = aa_score<float, SOFTCAP, MASK>(s[mt][nt][e], scale_log2, scale,
                                                               softcap, inv_softcap, mask, m_off);
                            if constexpr (ALIBI) x -= slope2 * (float)aa_alibi_dist(i, j, sq.offset);
                        }
                        s[mt][nt][e] = x;
                    }
        }
        if constexpr (FLEX) {  // a partial mask block: its bits (-inf stays -inf raw)
            if (flex[fcur + 1] >= 0) aa_flex_mask_tile<BN, MT, NS>(s, flex, fcur, r0, row_w, c0, t);
        }

        // Online softmax: the tile's row max (4 threads share a row), scaled once per row.
        float m_use[MT][2], alpha[MT][2];
        bool grew = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx[2] = {aa_neg_inf_f(), aa_neg_inf_f()};
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
                mx[0] = fmaxf(mx[0], fmaxf(s[mt][nt][0], s[mt][nt][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[mt][nt][2], s[mt][nt][3]));
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_old = m_r[mt][r];
                const float m_new = fmaxf(m_old, mx[r] * mul);  // mul > 0: max commutes
                const bool up = m_new > m_old;  // false while the row has seen no key
                grew = grew || up;
                m_use[mt][r] = m_new == aa_neg_inf_f() ? 0.f : m_new;  // exp2(-inf) = 0
                alpha[mt][r] = up ? aa_exp2(m_old - m_use[mt][r]) : 1.f;
                m_r[mt][r] = m_new;
                l_r[mt][r] *= alpha[mt][r];
            }
        }
        // Rescale O only when a row of this warp raised its max (alpha is exactly 1 for
        // every other row, so skipping the multiply changes nothing).
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < NO; ++i) {
                    acc_o[mt][i][0] *= alpha[mt][0];
                    acc_o[mt][i][1] *= alpha[mt][0];
                    acc_o[mt][i][2] *= alpha[mt][1];
                    acc_o[mt][i][3] *= alpha[mt][1];
                }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = aa_exp2(fmaf(s[mt][nt][e], mul, -m_use[mt][e >> 1]));
                    l_r[mt][e >> 1] += p;
                    s[mt][nt][e] = p;
                }

        // O += P V with P repacked from the S accumulators as A fragments; each V
        // fragment feeds both row tiles. V[n] landed before this tile's barrier.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            aa_u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = aa_pack2<DT>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = aa_pack2<DT>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = aa_pack2<DT>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = aa_pack2<DT>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                aa_u32 b0, b1, b2, b3;
                aa_ldsm_x4_t(sVa + stage + v_lane + (kk * 16 * DP + dp * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    aa_mma<DT>(acc_o[mt][2 * dp], a[mt], b0, b1);
                    aa_mma<DT>(acc_o[mt][2 * dp + 1], a[mt], b2, b3);
                }
            }
        }
        if constexpr (FLEX) aa_flex_advance<BN>(flex, fcur, n_next);
        n = n_next;
    }

    // Epilogue (as aa_fwd_tc): normalise once, stage the warp's rows through its own part
    // of sQ, write 16-byte vectors; LSE = ln(2) * (m + log2(l)), -inf for empty rows. The
    // barrier is for blocks with no key tile, whose Q copies (other threads') are in flight.
    aa_cp_wait<0>();
    __syncthreads();
    unsigned short* sO = sQ + warp * WR * DP;
    float* lg = lse + sq.tb * lse_sb + h * lse_sh + sq.row_base;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv_l[2], lse_v[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_r[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float m = m_r[mt][r];
            float o_scale = 1.f;
            if (sinks != nullptr) o_scale = aa_fold_sink(sinks[bh] * (float)AA_LOG2E, m, l);
            inv_l[r] = l > 0.f ? inv_keep * o_scale / l : 0.f;
            lse_v[r] = l > 0.f ? (m + log2f(l)) * (float)AA_LN2 : aa_neg_inf_f();
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            const int col = i * 8 + 2 * t;
            *reinterpret_cast<aa_u32*>(sO + (16 * mt + g) * DP + col) =
                aa_pack2<DT>(acc_o[mt][i][0] * inv_l[0], acc_o[mt][i][1] * inv_l[0]);
            *reinterpret_cast<aa_u32*>(sO + (16 * mt + g + 8) * DP + col) =
                aa_pack2<DT>(acc_o[mt][i][2] * inv_l[1], acc_o[mt][i][3] * inv_l[1]);
        }
        if (t == 0) {
            const int row = row_w + 16 * mt;
            if (row < sq.rows_store) lg[row] = lse_v[0];
            if (row + 8 < sq.rows_store) lg[row + 8] = lse_v[1];
        }
    }
    __syncwarp();
    unsigned short* og = o + sq.tb * o_sb + h * o_sh;
    constexpr int CPR = D / 8;
#pragma unroll
    for (int it = 0; it < (WR * CPR + 31) / 32; ++it) {
        const int c = lane + it * 32;
        if ((WR * CPR) % 32 == 0 || c < WR * CPR) {
            const int rr = c / CPR, kc = c - rr * CPR;
            const int row = r0 + warp * WR + rr;
            if (row < sq.rows_store) {
                *reinterpret_cast<uint4*>(og + (long long)(sq.row_base + row) * o_sr + kc * 8) =
                    *reinterpret_cast<const uint4*>(sO + rr * DP + kc * 8);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// CUDA-core kernel (float32 / float64)
// ---------------------------------------------------------------------------------------
template <typename T, int D>
struct AaSimtCfg {
    static constexpr bool F64 = sizeof(T) == 8;
    static constexpr int BM = F64 ? 32 : 64;
    // Keys per tile: small enough for two stages of K and V (cp.async double buffering)
    // and, for float up to D = 128, two blocks per SM.
    static constexpr int BN = F64 ? (D == 256 ? 16 : 32) : (D <= 64 ? 64 : 32);
    static constexpr int NT = 128;   // 8 row groups (ty) x 16 column lanes (tx)
    static constexpr int RM = BM / 8;  // rows per thread
    static constexpr int CN = BN / 16; // score columns per thread
    static constexpr int VC = D / 16;  // output columns per thread
    static constexpr int QP = BM + 4;  // Q^T and P^T pitch: 16-byte aligned row groups
    static constexpr int KP = D + 1;   // K pitch: conflict-free column reads
    static constexpr int SMEM = (D * QP + 2 * BN * KP + 2 * BN * D + BN * QP) * (int)sizeof(T);
    static constexpr int MIN_BLOCKS = AaMinBlocks<SMEM, NT>::value;
};

// RM consecutive values from 16-byte aligned shared memory.
template <typename T, int RM>
AA_DEV void aa_load_run(const T* p, T (&out)[RM]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < RM; i += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + i);
            out[i] = f.x; out[i + 1] = f.y; out[i + 2] = f.z; out[i + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < RM; i += 2) {
            const double2 f = *reinterpret_cast<const double2*>(p + i);
            out[i] = f.x; out[i + 1] = f.y;
        }
    }
}

template <typename T, int D, bool SOFTCAP, bool DROPOUT, int MASK>
__global__ void __launch_bounds__(AaSimtCfg<T, D>::NT, AaSimtCfg<T, D>::MIN_BLOCKS)
    aa_fwd_simt(AA_FWD_ARGS(T, T)) {
    using C = AaSimtCfg<T, D>;
    constexpr int BM = C::BM, BN = C::BN, NT = C::NT, RM = C::RM, CN = C::CN, VC = C::VC;
    constexpr int QP = C::QP, KP = C::KP;

    const int b = blockIdx.z, h = blockIdx.y;
    const AaSeq sq = aa_sequence(b, q_lens, kv_lens, cu_q, cu_k, L, S, diag);
    const long long bh = (long long)b * gridDim.y + h;
    const T slope2 = alibi != nullptr ? alibi[bh] * (T)AA_LOG2E : (T)0;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BM;
    if (r0 >= sq.rows_store) return;
    const int rows_valid = sq.q_len - r0;

    int lo, hi;
    aa_key_range(r0, r0 + (rows_valid < BM ? rows_valid : BM), sq.offset, left, right,
                 sq.kv_len, lo, hi);
    const int n_begin = lo / BN;
    const int n_end = hi > lo ? (hi + BN - 1) / BN : n_begin;
    // Block masks: the listed key blocks' tiles inside [n_begin, n_end) only.
    constexpr bool FLEX = (MASK & AA_MASK_FLEX) != 0;
    int fcur = 0;  // flex[fcur]: the current tile's (key block, partial id) pair
    int n = n_begin;
    if constexpr (FLEX) n = aa_flex_first<BN>(flex, b, h, r0, n_begin, n_end, fcur);
    const int n_first = n;

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    T* sQt = reinterpret_cast<T*>(aa_smem);  // [D][QP]
    T* sK0 = sQt + D * QP;                    // 2 stages of [BN][KP]
    T* sV0 = sK0 + 2 * BN * KP;               // 2 stages of [BN][D]
    T* sPt = sV0 + 2 * BN * D;                // [BN][QP]

    const T* qg = q + sq.tb * q_sb + h * q_sh + (long long)(sq.row_base + r0) * q_sr;
    const int kvh = h / G;
    const T* kg = k + sq.tb * k_sb + kvh * k_sh + (long long)sq.col_base * k_sr;
    const T* vg = v + sq.tb * v_sb + kvh * v_sh + (long long)sq.col_base * v_sr;

    // K/V tiles stream through two stages with element-wise cp.async (K's odd pitch rules
    // out 16-byte copies), in commit groups K[n], V[n], K[n+1], V[n+1], ...
    auto load_kv = [&](T* dst, const T* src, long long rs, int pitch, int c0) {
        const int valid_rows = sq.kv_len - c0;
        for (int idx = tid; idx < BN * D; idx += NT) {
            const int r = idx / D, d = idx - r * D;
            const bool valid = r < valid_rows;
            aa_cp_async<(int)sizeof(T)>(aa_smem_u32(dst + r * pitch + d),
                                        valid ? src + (long long)(c0 + r) * rs + d : src, valid);
        }
    };
    if (n_first < n_end) {
        load_kv(sK0, kg, k_sr, KP, n_first * BN);
        aa_cp_commit();
        load_kv(sV0, vg, v_sr, D, n_first * BN);
        aa_cp_commit();
    }
    for (int idx = tid; idx < BM * D; idx += NT) {
        const int r = idx / D, d = idx - r * D;
        sQt[d * QP + r] = r < rows_valid ? qg[r * q_sr + d] : (T)0;
    }

    T acc[RM][VC];
    T m_r[RM], l_r[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        m_r[r] = aa_neg_inf<T>();
        l_r[r] = 0;
#pragma unroll
        for (int c = 0; c < VC; ++c) acc[r][c] = 0;
    }
    AaDropState drop_pre;
    if (DROPOUT) drop_pre = aa_drop_prefix(seed, b, h);
    const long long m_base = sq.tb * m_sb + h * m_sh;

    for (int it = 0; n < n_end; ++it) {
        const int n_next = FLEX ? aa_flex_next<BN>(flex, fcur, n, n_end) : n + 1;
        const int c0 = n * BN;
        const int st = (FLEX ? it : n - n_begin) & 1;
        const T* sK = sK0 + st * BN * KP;
        const T* sV = sV0 + st * BN * D;
        aa_cp_wait<1>();  // K[n] has landed (V[n] may still be in flight)
        __syncthreads();  // ... for every thread; Q^T stored; tile n-1 fully used
        if (n_next < n_end) load_kv(sK0 + (st ^ 1) * BN * KP, kg, k_sr, KP, n_next * BN);
        aa_cp_commit();

        T s[RM][CN];
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < CN; ++c) s[r][c] = 0;
#pragma unroll 4
        for (int d = 0; d < D; ++d) {
            T qv[RM], kv[CN];
            aa_load_run<T, RM>(sQt + d * QP + ty * RM, qv);
#pragma unroll
            for (int c = 0; c < CN; ++c) kv[c] = sK[(tx + 16 * c) * KP + d];
#pragma unroll
            for (int r = 0; r < RM; ++r)
#pragma unroll
                for (int c = 0; c < CN; ++c) s[r][c] = fma(qv[r], kv[c], s[r][c]);
        }

        const bool full = r0 + BM <= sq.q_len &&
                          aa_block_full(r0, r0 + BM, c0, c0 + BN, sq.offset, left, right, sq.kv_len);
        // A partial mask block: this thread's rows of it at key c0 (aa_flex_rows).
        AaFlexRows frows = aa_flex_rows_none();
        if constexpr (FLEX) {
            if (flex[fcur + 1] >= 0) frows = aa_flex_rows<BN>(flex, fcur, r0, r0 + ty * RM, c0);
        }
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            const int i = r0 + ty * RM + r;
            T mx = m_r[r];
#pragma unroll
            for (int c = 0; c < CN; ++c) {
                const int j = c0 + tx + 16 * c;
                bool ok =
                    full || (i < sq.q_len && aa_allowed(i, j, sq.offset, left, right, sq.kv_len));
                if constexpr (FLEX) {
                    if (aa_flex_rows_on(frows)) {
                        ok = ok && aa_flex_rows_ok(flex, frows, r, tx + 16 * c, i, j);
                    }
                }
                T x = aa_neg_inf<T>();
                if (ok) {
                    const long long m_off =
                        m_base + (long long)(sq.row_base + i) * m_sr + (long long)(sq.col_base + j) * m_sc;
                    x = aa_score<T, SOFTCAP, MASK>(s[r][c], scale_log2, scale, softcap,
                                                   inv_softcap, mask, m_off);
                    if (alibi != nullptr) x -= slope2 * (T)aa_alibi_dist(i, j, sq.offset);
                }
                s[r][c] = x;
                mx = mx > x ? mx : x;
            }
#pragma unroll
            for (int off = 1; off < 16; off <<= 1) {
                const T other = __shfl_xor_sync(0xffffffffu, mx, off);
                mx = mx > other ? mx : other;
            }
            const T alpha = m_r[r] == aa_neg_inf<T>() ? (T)0 : aa_exp2(m_r[r] - mx);
            m_r[r] = mx;
            const T m_use = mx == aa_neg_inf<T>() ? (T)0 : mx;
            l_r[r] *= alpha;
#pragma unroll
            for (int c = 0; c < VC; ++c) acc[r][c] *= alpha;
            AaDropState drow;
            if (DROPOUT) drow = aa_drop_row(drop_pre, i);
#pragma unroll
            for (int c = 0; c < CN; ++c) {
                T p = aa_exp2(s[r][c] - m_use);
                l_r[r] += p;
                if (DROPOUT) {
                    const int j = c0 + tx + 16 * c;
                    if (!aa_drop_keep(aa_drop_bits_rc(drow, j), threshold)) p = 0;
                }
                sPt[(tx + 16 * c) * QP + ty * RM + r] = p;
            }
        }
        aa_cp_wait<1>();  // V[n] has landed (K[n+1] may still be in flight)
        __syncthreads();  // ... for every thread, and P^T is complete
        if (n_next < n_end) load_kv(sV0 + (st ^ 1) * BN * D, vg, v_sr, D, n_next * BN);
        aa_cp_commit();

#pragma unroll 4
        for (int kk = 0; kk < BN; ++kk) {
            T pv[RM], vv[VC];
            aa_load_run<T, RM>(sPt + kk * QP + ty * RM, pv);
#pragma unroll
            for (int c = 0; c < VC; ++c) vv[c] = sV[kk * D + tx + 16 * c];
#pragma unroll
            for (int r = 0; r < RM; ++r)
#pragma unroll
                for (int c = 0; c < VC; ++c) acc[r][c] = fma(pv[r], vv[c], acc[r][c]);
        }
        if constexpr (FLEX) aa_flex_advance<BN>(flex, fcur, n_next);
        n = n_next;
    }

    aa_cp_wait<0>();
    T* og = o + sq.tb * o_sb + h * o_sh;
    T* lg = lse + sq.tb * lse_sb + h * lse_sh + sq.row_base;
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        T l = l_r[r];
#pragma unroll
        for (int off = 1; off < 16; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        const int row = r0 + ty * RM + r;
        if (row < sq.rows_store) {
            T m = m_r[r];
            T o_scale = (T)1;
            if (sinks != nullptr) o_scale = aa_fold_sink(sinks[bh] * (T)AA_LOG2E, m, l);
            const T inv = l > (T)0 ? inv_keep * o_scale / l : (T)0;
#pragma unroll
            for (int c = 0; c < VC; ++c)
                og[(long long)(sq.row_base + row) * o_sr + tx + 16 * c] = acc[r][c] * inv;
            if (tx == 0)
                lg[row] = l > (T)0 ? (m + log2(l)) * (T)AA_LN2 : aa_neg_inf<T>();
        }
    }
}

// ---------------------------------------------------------------------------------------
// float32 on tensor cores: three TF32 products per product (ARRAYATTN_FWD_VARIANT=v3)
// ---------------------------------------------------------------------------------------
// aa_fwd_tc2's algorithm and argument list for float inputs. Each float operand x is split
// into big = tf32(x) and small = tf32(x - big) (aa_split_tf32), and a * b is summed as
// small_a big_b + big_a small_b + big_a big_b by mma.sync.m16n8k8.tf32 with float
// accumulators; the dropped small_a small_b term is below 2^-22 of the product, so the
// result has float accuracy (the tests hold it to the CUDA-core kernel's 1e-5) at tensor
// core rates. Fragments (m16n8k8 .tf32, g = lane / 4, t = lane % 4):
//   A 16x8: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B 8x8:  b0 (k = t, n = g), b1 (k = t+4, n = g)
//   C 16x8: c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1) (as m16n8k16)
// P @ V takes P straight from the S accumulators: inside each 8-key n-tile the product's
// k index is permuted (k = t is key 2t, k = t + 4 is key 2t + 1), and the V fragment
// follows it (b0 = V[key 2t][n], b1 = V[key 2t + 1][n]); a sum over keys does not care.
// 64 query rows per block (4 warps x 16), BN keys per tile (64 at D = 64, 32 at D = 128),
// Q plus two stages of K and V in shared memory with a row pitch of D + 4 floats (every
// fragment load is free of bank conflicts), two blocks per SM; one barrier per key tile
// with K[n+1]/V[n+1] copied right after it (as aa_fwd_tc2). Masks, windows, both causal
// alignments, lengths, GQA, sinks, ALiBi, softcap and block masks as aa_fwd_tc2; no
// dropout (aa_fwd_simt runs it). An infinite Q, K or V value that takes part gives NaN
// here (x - big is inf - inf), where the CUDA-core kernel gives +-inf.
template <int D>
struct AaTf32Cfg {
    static constexpr int BM = 64;                  // query rows per block
    static constexpr int BN = D <= 64 ? 64 : 32;   // keys per tile
    static constexpr int NT = 128;                 // 4 warps x 16 rows
    static constexpr int DP = D + 4;               // smem row pitch (floats)
    static constexpr int MIN_BLOCKS = 2;
    static constexpr int SMEM = (BM + 4 * BN) * DP * 4;  // Q + 2 stages of K and V
};

// An R x D float tile (row stride rs) into smem rows of pitch DP as 16-byte copies; rows
// >= nvalid are zero-filled from `safe`. NT is a multiple of D / 4 (whole rows per pass),
// so a thread's source pointer advances by a fixed stride.
template <int R, int D, int DP, int NT>
AA_DEV void aa_tile_async_f32(aa_u32 sbase, const float* g, long long rs, int nvalid,
                              const float* safe, int tid) {
    constexpr int CPR = D / 4;
    static_assert(NT % CPR == 0 && (R * CPR) % NT == 0, "whole rows per pass");
    constexpr int RSTEP = NT / CPR, ITERS = R * CPR / NT;
    const int row0 = tid / CPR, kc = tid - row0 * CPR;
    const float* p = g + row0 * rs + kc * 4;
    const long long step = RSTEP * rs;
    const aa_u32 sdst = sbase + (aa_u32)((row0 * DP + kc * 4) * 4);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const bool valid = row0 + it * RSTEP < nvalid;
        aa_cp_async16(sdst + (aa_u32)(it * RSTEP * DP * 4), valid ? p : safe, valid);
        p += step;
    }
}

template <int D, bool SOFTCAP, int MASK, bool ALIBI>
__global__ void __launch_bounds__(AaTf32Cfg<D>::NT, AaTf32Cfg<D>::MIN_BLOCKS)
    aa_fwd_tf32(AA_FWD_ARGS(float, float)) {
    using C = AaTf32Cfg<D>;
    constexpr int BM = C::BM, BN = C::BN, DP = C::DP, NT = C::NT;
    constexpr int NS = BN / 8;  // S n-tiles
    constexpr int NO = D / 8;   // O n-tiles
    constexpr int KS = D / 8;   // k-steps of Q K^T
    constexpr bool RAW = !SOFTCAP && (MASK & 3) == 0 && !ALIBI;
    constexpr int STAGE = BN * DP;  // floats per K or V stage

    const int b = blockIdx.z, h = blockIdx.y;
    const AaSeq sq = aa_sequence(b, q_lens, kv_lens, cu_q, cu_k, L, S, diag);
    const long long bh = (long long)b * gridDim.y + h;
    float slope2 = 0.f;
    if constexpr (ALIBI) slope2 = alibi[bh] * (float)AA_LOG2E;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BM;  // late (causally heavy) blocks first
    if (r0 >= sq.rows_store) return;
    const int rows_valid = sq.q_len - r0;  // may be <= 0 (padding rows only)

    int lo, hi;
    aa_key_range(r0, r0 + (rows_valid < BM ? rows_valid : BM), sq.offset, left, right,
                 sq.kv_len, lo, hi);
    const int n_begin = lo / BN;
    const int n_end = hi > lo ? (hi + BN - 1) / BN : n_begin;
    constexpr bool FLEX = (MASK & AA_MASK_FLEX) != 0;
    int fcur = 0;
    int n = n_begin;
    if constexpr (FLEX) n = aa_flex_first<BN>(flex, b, h, r0, n_begin, n_end, fcur);
    const int n_first = n;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    float* sQ = reinterpret_cast<float*>(aa_smem);
    float* sK = sQ + BM * DP;       // 2 stages
    float* sV = sK + 2 * STAGE;     // 2 stages
    const aa_u32 sQa = aa_smem_u32(sQ);
    const aa_u32 sKa = aa_smem_u32(sK);
    const aa_u32 sVa = aa_smem_u32(sV);

    const float* qg = q + sq.tb * q_sb + h * q_sh + (long long)(sq.row_base + r0) * q_sr;
    const int kvh = h / G;
    const float* kg = k + sq.tb * k_sb + kvh * k_sh + (long long)sq.col_base * k_sr;
    const float* vg = v + sq.tb * v_sb + kvh * v_sh + (long long)sq.col_base * v_sr;

    aa_tile_async_f32<BM, D, DP, NT>(sQa, qg, q_sr, rows_valid, q, tid);
    if (n_first < n_end) {
        const int c0 = n_first * BN;
        aa_tile_async_f32<BN, D, DP, NT>(sKa, kg + c0 * k_sr, k_sr, sq.kv_len - c0, k, tid);
        aa_tile_async_f32<BN, D, DP, NT>(sVa, vg + c0 * v_sr, v_sr, sq.kv_len - c0, v, tid);
    }
    aa_cp_commit();

    float acc_o[NO][4];
    float m_r[2], l_r[2];  // running row max (log2 domain, scaled) and partial sums
#pragma unroll
    for (int i = 0; i < NO; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
    m_r[0] = m_r[1] = aa_neg_inf_f();
    l_r[0] = l_r[1] = 0.f;
    const float mul = RAW ? scale_log2 : 1.f;
    const int row_w = r0 + warp * 16 + g;  // this thread's rows: row_w and row_w + 8
    const float* qw = sQ + (warp * 16 + g) * DP + t;  // A elements (g, t) of k-step 0

    for (int it = 0; n < n_end; ++it) {
        const int n_next = FLEX ? aa_flex_next<BN>(flex, fcur, n, n_end) : n + 1;
        const int stage = ((FLEX ? it : n - n_begin) & 1) * STAGE;
        aa_cp_wait<0>();  // this thread's copies of K[n] and V[n] (and Q) have landed
        __syncthreads();  // ... every thread's; and tile n - 1's stage is no longer read
        if (n_next < n_end) {
            const int c1 = n_next * BN;
            const aa_u32 other = (aa_u32)((STAGE - stage) * 4);
            aa_tile_async_f32<BN, D, DP, NT>(sKa + other, kg + c1 * k_sr, k_sr, sq.kv_len - c1,
                                             k, tid);
            aa_tile_async_f32<BN, D, DP, NT>(sVa + other, vg + c1 * v_sr, v_sr, sq.kv_len - c1,
                                             v, tid);
        }
        aa_cp_commit();

        // S = Q K^T: per k-step the warp's A fragment (split once) against each n-tile's
        // K fragment, three TF32 products each (the small terms first).
        float s[1][NS][4];
#pragma unroll
        for (int i = 0; i < NS; ++i) s[0][i][0] = s[0][i][1] = s[0][i][2] = s[0][i][3] = 0.f;
        const float* kw = sK + stage + g * DP + t;  // B elements (k = t, n = g)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            aa_u32 ab[4], as[4];
            aa_split_tf32(qw[ks * 8], ab[0], as[0]);
            aa_split_tf32(qw[8 * DP + ks * 8], ab[1], as[1]);
            aa_split_tf32(qw[ks * 8 + 4], ab[2], as[2]);
            aa_split_tf32(qw[8 * DP + ks * 8 + 4], ab[3], as[3]);
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
                aa_u32 bb0, bs0, bb1, bs1;
                aa_split_tf32(kw[nt * 8 * DP + ks * 8], bb0, bs0);
                aa_split_tf32(kw[nt * 8 * DP + ks * 8 + 4], bb1, bs1);
                aa_mma_tf32(s[0][nt], as, bb0, bb1);
                aa_mma_tf32(s[0][nt], ab, bs0, bs1);
                aa_mma_tf32(s[0][nt], ab, bb0, bb1);
            }
        }

        // Element e of n-tile nt: row row_w + 8 (e >> 1), key c0 + nt * 8 + 2 t + (e & 1).
        const int c0 = n * BN;
        const bool full = r0 + BM <= sq.q_len &&
                          aa_block_full(r0, r0 + BM, c0, c0 + BN, sq.offset, left, right, sq.kv_len);
        if constexpr (RAW) {
            if (!full) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    aa_u32 base, span;
                    aa_row_keys(row_w + 8 * half, sq.q_len, sq.offset, left, right, sq.kv_len,
                                c0 + 2 * t, base, span);
#pragma unroll
                    for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const bool ok = base + (aa_u32)(nt * 8 + e) <= span;
                            float& x = s[0][nt][2 * half + e];
                            x = ok ? x : aa_neg_inf_f();
                        }
                }
            }
        } else {
            const long long m_base = sq.tb * m_sb + h * m_sh;
#pragma unroll
            for (int nt = 0; nt < NS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row_w + 8 * (e >> 1);
                    const int j = c0 + nt * 8 + 2 * t + (e & 1);
                    const bool ok =
                        full || (i < sq.q_len && aa_allowed(i, j, sq.offset, left, right, sq.kv_len));
                    float x = aa_neg_inf_f();
                    if (ok) {
                        const long long m_off = m_base + (long long)(sq.row_base + i) * m_sr +
                                                (long long)(sq.col_base + j) * m_sc;
                        x = aa_score<float, SOFTCAP, MASK>(s[0][nt][e], scale_log2, scale,
                                                           softcap, inv_softcap, mask, m_off);
                        if constexpr (ALIBI) x -= slope2 * (float)aa_alibi_dist(i, j, sq.offset);
                    }
                    s[0][nt][e] = x;
                }
        }
        if constexpr (FLEX) {  // a partial mask block: its bits (-inf stays -inf raw)
            if (flex[fcur + 1] >= 0) aa_flex_mask_tile<BN, 1, NS>(s, flex, fcur, r0, row_w, c0, t);
        }

        // Online softmax (4 threads share a row), as aa_fwd_tc2.
        float m_use[2], alpha[2];
        bool grew = false;
        {
            float mx[2] = {aa_neg_inf_f(), aa_neg_inf_f()};
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
                mx[0] = fmaxf(mx[0], fmaxf(s[0][nt][0], s[0][nt][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[0][nt][2], s[0][nt][3]));
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_old = m_r[r];
                const float m_new = fmaxf(m_old, mx[r] * mul);  // mul > 0: max commutes
                const bool up = m_new > m_old;
                grew = grew || up;
                m_use[r] = m_new == aa_neg_inf_f() ? 0.f : m_new;
                alpha[r] = up ? aa_exp2(m_old - m_use[r]) : 1.f;
                m_r[r] = m_new;
                l_r[r] *= alpha[r];
            }
        }
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int i = 0; i < NO; ++i) {
                acc_o[i][0] *= alpha[0];
                acc_o[i][1] *= alpha[0];
                acc_o[i][2] *= alpha[1];
                acc_o[i][3] *= alpha[1];
            }
        }
#pragma unroll
        for (int nt = 0; nt < NS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = aa_exp2(fmaf(s[0][nt][e], mul, -m_use[e >> 1]));
                l_r[e >> 1] += p;
                s[0][nt][e] = p;
            }

        // O += P V, P from the accumulators in the permuted k order. The tile's products
        // go into a zeroed accumulator per 8 output columns, added to O with a float add:
        // the tensor cores' own accumulation rounds toward zero, and summed into O over
        // every key tile that bias grew with L (5.8e-5 relative at L = 8192 on an H100);
        // per tile it stays about 2^-21 and the adds round to nearest.
        aa_u32 pb[NS][4], ps[NS][4];
#pragma unroll
        for (int kk = 0; kk < NS; ++kk) {
            aa_split_tf32(s[0][kk][0], pb[kk][0], ps[kk][0]);  // (g, key 2t)
            aa_split_tf32(s[0][kk][2], pb[kk][1], ps[kk][1]);  // (g + 8, key 2t)
            aa_split_tf32(s[0][kk][1], pb[kk][2], ps[kk][2]);  // (g, key 2t + 1)
            aa_split_tf32(s[0][kk][3], pb[kk][3], ps[kk][3]);  // (g + 8, key 2t + 1)
        }
        const float* vw = sV + stage + 2 * t * DP + g;
#pragma unroll
        for (int dn = 0; dn < NO; ++dn) {
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < NS; ++kk) {
                aa_u32 vb0, vs0, vb1, vs1;
                aa_split_tf32(vw[kk * 8 * DP + dn * 8], vb0, vs0);
                aa_split_tf32(vw[(kk * 8 + 1) * DP + dn * 8], vb1, vs1);
                aa_mma_tf32(part, ps[kk], vb0, vb1);
                aa_mma_tf32(part, pb[kk], vs0, vs1);
                aa_mma_tf32(part, pb[kk], vb0, vb1);
            }
            acc_o[dn][0] += part[0];
            acc_o[dn][1] += part[1];
            acc_o[dn][2] += part[2];
            acc_o[dn][3] += part[3];
        }
        if constexpr (FLEX) aa_flex_advance<BN>(flex, fcur, n_next);
        n = n_next;
    }

    // Epilogue: normalise once and write each thread's elements straight from registers
    // (rows row_w and row_w + 8, columns 8 dn + 2 t and + 1); LSE = ln(2) (m + log2(l)),
    // -inf for empty rows.
    aa_cp_wait<0>();
    float* og = o + sq.tb * o_sb + h * o_sh;
    float* lg = lse + sq.tb * lse_sb + h * lse_sh + sq.row_base;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_r[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        float m = m_r[r];
        float o_scale = 1.f;
        if (sinks != nullptr) o_scale = aa_fold_sink(sinks[bh] * (float)AA_LOG2E, m, l);
        const float inv_l = l > 0.f ? inv_keep * o_scale / l : 0.f;
        const int row = row_w + 8 * r;
        if (row < sq.rows_store) {
            float* orow = og + (long long)(sq.row_base + row) * o_sr + 2 * t;
#pragma unroll
            for (int dn = 0; dn < NO; ++dn) {
                orow[dn * 8] = acc_o[dn][2 * r] * inv_l;
                orow[dn * 8 + 1] = acc_o[dn][2 * r + 1] * inv_l;
            }
            if (t == 0) lg[row] = l > 0.f ? (m + log2f(l)) * (float)AA_LN2 : aa_neg_inf_f();
        }
    }
}
