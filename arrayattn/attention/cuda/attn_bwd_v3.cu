// arrayattn/attention/cuda/attn_bwd_v3.cu -- backward variant v3's dK/dV kernel.
//
// A file of its own beside attn_bwd.cu (whose helpers, argument list and v2 kernels it
// includes), so that v3's barriers are checked by its own race tests
// (tests/kernels/test_backward_emulated_v3.py) and attn_bwd.cu's barrier list stays v1's
// and v2's. backward.py launches aa_bwd_dkdv_mma3 from this file and everything else of
// the v3 plan (preprocess, v2's deterministic dQ, convert) from attn_bwd.cu. Like
// attn_bwd.cu it compiles as host C++ under tests/kernels/backward_emulator.h.

#include "attn_bwd.cu"

// =======================================================================================
// Variant v3 (ARRAYATTN_BWD_VARIANT=v3, backward.py): v2's dK/dV kernel reshaped for the
// head dims where registers allow it (D = 64). v2 spends, per warp and 64-row query step,
// 8 of its 96 ldmatrix on the warp's own K and V fragments, which never change over the
// whole block, runs the S^T/dP^T loop over the head dim without unrolling (so each
// iteration waits on its own ldmatrix), and two block-wide barriers (the step's, dS^T's).
// v3:
//   * K and V A-fragments (16 keys x HD per warp) are loaded from shared memory once, after
//     the prologue, and stay in registers across every query step and GQA head (32
//     registers at D = 64): the S^T/dP^T products read only Q and dO from shared memory.
//   * that loop is fully unrolled (the fragments must be indexed by constants), so the
//     compiler can issue the ldmatrix of the next head-dim slice ahead of the MMAs.
//   * query steps of BM = 128 rows (one pipeline stage): 2 barriers per 128 rows, half of
//     v2's per row, and half the fixed per-step costs (prefetch issue, waits). The register
//     sub-steps shrink to BMS = 32 rows to make room for the fragments.
//   * the atomic dQ part: 8 row tiles x 1 column slice (v2: 4 x 2), each warp 16 rows x
//     HD: 5 ldmatrix per 8 MMAs (v2: 3 per 4).
// Every MMA accumulates in v2's order (dK/dV by 16-row query chunks ascending, S^T/dP^T
// over the head dim ascending, dQ over the block's keys ascending), and a larger step only
// adds zero-probability rows at the edges, so deterministic gradients are v2's bits
// (tests/kernels/test_backward_emulated_v3.py). The deterministic dQ kernel is v2's.
// =======================================================================================
template <typename T, int HD, int NW, int BM, int BMS>
__global__ void __launch_bounds__(NW * 32)
aa_bwd_dkdv_mma3(AA_BWD_ARGS(typename AaIO<T>::type, float),
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

    // Prologue: K, V and the first step's Q, dO, stats in one commit group.
    aa_bwd_async_tile16<HD, BN, NT>(sK, k + kv_head * S * E, c0, S, E);
    aa_bwd_async_tile16<HD, BN, NT>(sV, v + kv_head * S * Ev, c0, S, Ev);
    if (mfirst < hi) {
        const long long qh = (long long)b * Hq + hk * G;
        aa_bwd_async_tile16<HD, BM, NT>(sQ0, q + qh * L * E, mfirst, L, E);
        aa_bwd_async_tile16<HD, BM, NT>(sdO0, dout + qh * L * Ev, mfirst, L, Ev);
        aa_bwd_async_stats<BM, NT>(sL0, sD0, lse2 + qh * L, delta + qh * L, mfirst, seq.q_len);
    }
    aa_bwd_cp_commit();

    float acc_k[HD / 8][4], acc_v[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc_k[t][r] = acc_v[t][r] = 0.f;

    // The warp's K and V as MMA A operands (16 keys x HD), once for the whole block.
    aa_u32 fk[HD / 16][4], fv[HD / 16][4];
    if (mfirst < hi) {  // uniform over the block
        aa_bwd_cp_wait_all();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            aa_ldsm_x4(fk[kk], sK + (kw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
            aa_ldsm_x4(fv[kk], sV + (kw0 + lane % 16) * LDH + kk * 16 + 8 * (lane / 16));
        }
    }

    int stage = 0;
    for (int g = 0; g < G && mfirst < hi; ++g) {
        const int h = hk * G + g;
        const long long qh = (long long)b * Hq + h;
        const float slope = alibi ? alibi[qh] : 0.f;
        const AaDropState drop = aa_drop_prefix(seed, b, h);
        const long long m_base = (long long)b * m_sb + (long long)h * m_sh;
        for (int m0 = mfirst; m0 < hi; m0 += BM, stage ^= 1) {
            // As v2: this thread's copies landed; the barrier publishes everyone's and
            // frees the other stage and dS^T of the previous step.
            aa_bwd_cp_wait_all();
            __syncthreads();
            {
                int nm0 = m0 + BM;
                int ng = g;
                if (nm0 >= hi) { nm0 = mfirst; ++ng; }
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
                float acc_s[BMS / 8][4], acc_p[BMS / 8][4];
#pragma unroll
                for (int t = 0; t < BMS / 8; ++t)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc_s[t][r] = acc_p[t][r] = 0.f;
#pragma unroll
                for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
                    for (int j = 0; j < BMS / 16; ++j) {
                        const int row = ms + j * 16 + lane % 8 + 8 * (lane / 16);
                        const int col = kk * 16 + 8 * ((lane / 8) % 2);
                        aa_u32 bq[4], bo[4];
                        aa_ldsm_x4(bq, sQ + row * LDH + col);
                        aa_ldsm_x4(bo, sdO + row * LDH + col);
                        AaMma<T>::run(acc_s[2 * j], fk[kk], bq[0], bq[1]);
                        AaMma<T>::run(acc_s[2 * j + 1], fk[kk], bq[2], bq[3]);
                        AaMma<T>::run(acc_p[2 * j], fv[kk], bo[0], bo[1]);
                        AaMma<T>::run(acc_p[2 * j + 1], fv[kk], bo[2], bo[3]);
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

                // dV += P^T dO, dK += dS^T Q (as v2).
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
                        // (r, r + 1): columns d, d + 1 of one row (E % 8 == 0, as v2).
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
    aa_bwd_cp_wait_all();  // no copy outlives the block

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
