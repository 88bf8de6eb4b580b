// arrayattn/attention/cuda/decode_attn.cu -- split-KV decode: a few query rows of each sequence
// against a long key/value cache, contiguous or paged (arrayattn/attention/cuda/decode.py).
//
// Two launches:
// 1. aa_decode_split<T, D, ROWS>: grid (splits, Hkv * row_chunks, B), AA_DEC_WARPS warps.
//    A block takes ROWS query rows of one GQA group (the G query heads of KV head kvh times
//    the L rows, flattened r = head_in_group * L + i) and the keys of its split, and reads
//    each key and value row once for all of those rows. A key row is shared by LG lanes of
//    a warp (EPL = D / LG elements each, in 16-byte vectors), so a warp takes KPW = 32 / LG
//    keys per step; every lane group keeps its own online softmax (log2 domain) over its
//    keys; the groups of a warp (shuffles), then the warps (shared memory) are merged by
//    their maxima, and the split's normalised output and log2-LSE go to the workspace.
// 2. aa_decode_merge<T, D>: one warp per query row merges the splits by LSE, exactly as
//    merge_attention_states does, folds in the sink, and writes the output (in T) and the
//    natural-log LSE. An empty split (no key, or a row that sees none of its keys) has
//    LSE -inf and weight 0; a row with no key at all gets output 0 and LSE -inf (or the
//    sink).
//
// Structure as everywhere (common.cuh): query i sees key j iff j < kv_len and j lies in the
// window [i + offset - left, i + offset + right] (-1: unbounded), offset = diag or, when
// diag is AA_DIAG_FROM_LENGTHS, kv_len - q_len of the sequence. Scores: scale * q.k, then
// softcap (cap * tanh(s / cap)) when cap > 0, then the ALiBi bias -slope * |i + offset - j|.
// Element (b, h, j, e) of the keys lies at
//   k[page * k_pg + h * k_sh + row * k_sr + e],   page, row = tables[b][j / P], j % P
// (paged), or page = b, row = j (no table: a contiguous cache, k_pg its batch stride).
// Dims at or past E (keys, queries) and Ev (values) are read as 0, so D is a bucket
// (32, 64, 128, 256) and E, Ev any multiples of the vector width up to it. Base pointers
// and strides keep every 16-byte vector aligned (the host checks).
//
// Variant v2 (aa_decode_split_v2 / aa_decode_merge_v2, after v1 below; chosen by
// ARRAYATTN_DECODE_VARIANT in decode.py) computes the same with more loads in flight.
//
// The file also compiles as host C++ under tests/kernels/backward_emulator.h
// (AA_HOST_EMULATION), so the CPU tests run these very kernels.

#include "common.cuh"
#include "elem16.cuh"

#ifndef AA_HOST_EMULATION
#define AA_DEC_DEV __device__ __forceinline__
#define AA_DEC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#define AA_DEC_DEV inline
#define AA_DEC_SMEM(name) unsigned char* name = aa_emu_smem()
#endif

#define AA_DEC_WARPS 4

template <typename T> struct AaDecAcc { typedef float type; };
template <> struct AaDecAcc<double> { typedef double type; };

template <typename Acc> AA_DEC_DEV Acc aa_dec_inf();
template <> AA_DEC_DEV float aa_dec_inf<float>() { return __int_as_float(0x7f800000); }
template <> AA_DEC_DEV double aa_dec_inf<double>() {
    return __longlong_as_double(0x7ff0000000000000LL);
}
AA_DEC_DEV float aa_dec_tanh(float x) { return tanhf(x); }
AA_DEC_DEV double aa_dec_tanh(double x) { return tanh(x); }
AA_DEC_DEV float aa_dec_log2(float x) { return log2f(x); }
AA_DEC_DEV double aa_dec_log2(double x) { return log2(x); }

// The lane layout of a D-wide row for storage type S: VEC elements per 16-byte vector, LG
// lanes per row (a power of two, at most 32), EPL elements per lane, KPW rows per warp.
template <typename S, int D> struct AaDecLayout {
    static constexpr int VEC = 16 / (int)sizeof(S);
    static constexpr int LG = D / VEC < 32 ? D / VEC : 32;
    static constexpr int EPL = D / LG;
    static constexpr int KPW = 32 / LG;
};

// Load EPL elements of one row from p (this lane's first element), as Acc; elements at or
// past `valid` (the row's E or Ev, counted from this lane's first) are 0 and not read.
template <typename T, int EPL>
AA_DEC_DEV void aa_dec_load(const typename AaIO<T>::type* p, int valid,
                            typename AaDecAcc<T>::type (&out)[EPL]) {
    typedef typename AaIO<T>::type S;
    constexpr int VEC = 16 / (int)sizeof(S);
#pragma unroll
    for (int t = 0; t < EPL / VEC; ++t) {
        union {
            uint4 u;
            S s[VEC];
        } w;
        if (t * VEC < valid) {
            w.u = *reinterpret_cast<const uint4*>(p + t * VEC);
        } else {
            w.u = make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[t * VEC + e] = AaIO<T>::to_f(w.s[e]);
    }
}

template <typename T, int D, int ROWS>
__global__ void __launch_bounds__(AA_DEC_WARPS * 32, 1) aa_decode_split(
    const typename AaIO<T>::type* __restrict__ q, long long q_sb, long long q_sh,
    long long q_sr, const typename AaIO<T>::type* __restrict__ k, long long k_pg,
    long long k_sh, long long k_sr, const typename AaIO<T>::type* __restrict__ v,
    long long v_pg, long long v_sh, long long v_sr, const int* __restrict__ tables,
    int max_pages, int page_size, const int* __restrict__ q_lens,
    const int* __restrict__ kv_lens, int L, int S, int Hq, int Hkv, int E, int Ev, int diag,
    int left, int right, typename AaDecAcc<T>::type scale, typename AaDecAcc<T>::type softcap,
    const typename AaDecAcc<T>::type* __restrict__ alibi, int keys_per_split,
    typename AaDecAcc<T>::type* __restrict__ part_o,
    typename AaDecAcc<T>::type* __restrict__ part_lse) {
    typedef typename AaIO<T>::type Sto;
    typedef typename AaDecAcc<T>::type Acc;
    typedef AaDecLayout<Sto, D> Lay;
    constexpr int LG = Lay::LG, EPL = Lay::EPL, KPW = Lay::KPW, NW = AA_DEC_WARPS;
    const Acc NEG_INF = -aa_dec_inf<Acc>();
    const Acc LOG2E = (Acc)AA_LOG2E;

    const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.z;
    const int G = Hq / Hkv, chunks = (G * L + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = lane / LG, gl = lane % LG;

    const int q_len = q_lens != nullptr ? min(max(q_lens[b], 0), L) : L;
    const int kv_len = kv_lens != nullptr ? min(max(kv_lens[b], 0), S) : S;
    const int offset = diag == AA_DIAG_FROM_LENGTHS ? kv_len - q_len : diag;
    int lo, hi;
    aa_key_range(0, q_len, offset, left, right, kv_len, lo, hi);
    const int j0 = lo + split * keys_per_split;
    const int j1 = min(hi, j0 + keys_per_split);

    // This block's rows: query head h and row i of each, and the query (scaled) per lane.
    int row_h[ROWS], row_i[ROWS];
    bool row_ok[ROWS];
    Acc slope[ROWS], qf[ROWS][EPL], m[ROWS], l[ROWS], acc[ROWS][EPL];
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
        const int r = chunk * ROWS + rr;
        row_h[rr] = kvh * G + (r < G * L ? r / L : 0);
        row_i[rr] = r % L;
        row_ok[rr] = r < G * L && row_i[rr] < q_len;
        slope[rr] = (alibi != nullptr && row_ok[rr]) ? alibi[(long long)b * Hq + row_h[rr]] : (Acc)0;
        if (row_ok[rr]) {
            const Sto* qp = q + b * q_sb + row_h[rr] * q_sh + row_i[rr] * q_sr + gl * EPL;
            aa_dec_load<T, EPL>(qp, E - gl * EPL, qf[rr]);
        } else {
#pragma unroll
            for (int e = 0; e < EPL; ++e) qf[rr][e] = (Acc)0;
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            qf[rr][e] *= scale;
            acc[rr][e] = (Acc)0;
        }
        m[rr] = NEG_INF;
        l[rr] = (Acc)0;
    }

    // Keys: the warps interleave steps of KPW keys, two steps per iteration so that four
    // 16-byte loads per lane are in flight before the first is used. The loop bound is
    // warp-uniform, so every lane takes part in the shuffles (lanes past the split's end
    // read nothing and change nothing).
    auto address = [&](int j, long long& kb, long long& vb) {
        long long page = b, row = j;
        if (tables != nullptr) {
            page = tables[(long long)b * max_pages + j / page_size];
            row = j % page_size;
        }
        kb = page * k_pg + kvh * k_sh + row * k_sr + gl * EPL;
        vb = page * v_pg + kvh * v_sh + row * v_sr + gl * EPL;
    };
    auto consume = [&](int j, bool key_in, const Acc (&kf)[EPL], const Acc (&vf)[EPL]) {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
            Acc s = (Acc)0;
#pragma unroll
            for (int e = 0; e < EPL; ++e) s += qf[rr][e] * kf[e];
#pragma unroll
            for (int o = LG / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (!(key_in && row_ok[rr] &&
                  aa_allowed(row_i[rr], j, offset, left, right, kv_len)))
                continue;
            if (softcap > (Acc)0) s = softcap * aa_dec_tanh(s / softcap);
            if (alibi != nullptr) s -= slope[rr] * (Acc)aa_alibi_dist(row_i[rr], j, offset);
            const Acc s2 = s * LOG2E;
            const Acc mn = s2 > m[rr] ? s2 : m[rr];
            const Acc c = aa_exp2(m[rr] - mn);  // 0 while m is -inf
            const Acc p = aa_exp2(s2 - mn);
            l[rr] = l[rr] * c + p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[rr][e] = acc[rr][e] * c + p * vf[e];
            m[rr] = mn;
        }
    };
    constexpr int STEP = NW * KPW;
    for (int base = j0 + warp * KPW; base < j1; base += 2 * STEP) {
        const int ja = base + grp, jb = base + STEP + grp;
        const bool ina = ja < j1, inb = jb < j1;
        long long kba = 0, vba = 0, kbb = 0, vbb = 0;
        if (ina) address(ja, kba, vba);
        if (inb) address(jb, kbb, vbb);
        Acc kfa[EPL], vfa[EPL], kfb[EPL], vfb[EPL];
        aa_dec_load<T, EPL>(k + kba, ina ? E - gl * EPL : 0, kfa);
        aa_dec_load<T, EPL>(v + vba, ina ? Ev - gl * EPL : 0, vfa);
        aa_dec_load<T, EPL>(k + kbb, inb ? E - gl * EPL : 0, kfb);
        aa_dec_load<T, EPL>(v + vbb, inb ? Ev - gl * EPL : 0, vfb);
        consume(ja, ina, kfa, vfa);
        consume(jb, inb, kfb, vfb);
    }

    // Merge the lane groups of the warp (same dims, other keys).
#pragma unroll
    for (int o = LG; o < 32; o <<= 1) {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
            const Acc m2 = __shfl_xor_sync(0xffffffffu, m[rr], o);
            const Acc l2 = __shfl_xor_sync(0xffffffffu, l[rr], o);
            const Acc mn = m2 > m[rr] ? m2 : m[rr];
            const Acc ms = mn == NEG_INF ? (Acc)0 : mn;
            const Acc c1 = aa_exp2(m[rr] - ms), c2 = aa_exp2(m2 - ms);
            l[rr] = l[rr] * c1 + l2 * c2;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                const Acc a2 = __shfl_xor_sync(0xffffffffu, acc[rr][e], o);
                acc[rr][e] = acc[rr][e] * c1 + a2 * c2;
            }
            m[rr] = mn;
        }
    }

    // Merge the warps through shared memory: acc (NW, ROWS, D), then m and l (NW, ROWS).
    AA_DEC_SMEM(smem_raw);
    Acc* sm_acc = reinterpret_cast<Acc*>(smem_raw);
    Acc* sm_m = sm_acc + NW * ROWS * D;
    Acc* sm_l = sm_m + NW * ROWS;
    if (grp == 0) {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) sm_acc[(warp * ROWS + rr) * D + gl * EPL + e] = acc[rr][e];
            if (gl == 0) {
                sm_m[warp * ROWS + rr] = m[rr];
                sm_l[warp * ROWS + rr] = l[rr];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ROWS * D; idx += NW * 32) {
        const int rr = idx / D, d = idx % D;
        const int r = chunk * ROWS + rr;
        if (r >= G * L) continue;
        Acc mx = NEG_INF;
        for (int w = 0; w < NW; ++w) mx = sm_m[w * ROWS + rr] > mx ? sm_m[w * ROWS + rr] : mx;
        const Acc ms = mx == NEG_INF ? (Acc)0 : mx;
        Acc tot = (Acc)0, a = (Acc)0;
        for (int w = 0; w < NW; ++w) {
            const Acc c = aa_exp2(sm_m[w * ROWS + rr] - ms);
            tot += sm_l[w * ROWS + rr] * c;
            a += sm_acc[(w * ROWS + rr) * D + d] * c;
        }
        const long long row = ((long long)b * Hq + kvh * G + r / L) * L + r % L;
        part_o[(row * splits + split) * D + d] = tot > (Acc)0 ? a / tot : (Acc)0;
        if (d == 0) part_lse[row * splits + split] = tot > (Acc)0 ? mx + aa_dec_log2(tot) : NEG_INF;
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(AA_DEC_WARPS * 32, 4) aa_decode_merge(
    const typename AaDecAcc<T>::type* __restrict__ part_o,
    const typename AaDecAcc<T>::type* __restrict__ part_lse, int splits, long long rows,
    int L, const typename AaDecAcc<T>::type* __restrict__ sinks, int Dout,
    typename AaIO<T>::type* __restrict__ out, typename AaDecAcc<T>::type* __restrict__ lse) {
    typedef typename AaDecAcc<T>::type Acc;
    const Acc NEG_INF = -aa_dec_inf<Acc>();
    const Acc LOG2E = (Acc)AA_LOG2E;
    const long long row = (long long)blockIdx.x * AA_DEC_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;  // whole warps leave together
    const Acc* pl = part_lse + row * splits;
    Acc mx = NEG_INF;
    for (int s = lane; s < splits; s += 32) mx = pl[s] > mx ? pl[s] : mx;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const Acc m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = m2 > mx ? m2 : mx;
    }
    // row = (b * Hq + h) * L + i; sinks are per (b, h): (B * Hq,), natural log.
    const Acc sink2 = sinks != nullptr ? sinks[row / L] * LOG2E : NEG_INF;
    const Acc top = sink2 > mx ? sink2 : mx;
    const Acc ts = top == NEG_INF ? (Acc)0 : top;
    Acc sum = (Acc)0;
    for (int s = lane; s < splits; s += 32) sum += aa_exp2(pl[s] - ts);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sinks != nullptr) sum += aa_exp2(sink2 - ts);
    const Acc total = sum > (Acc)0 ? ts + aa_dec_log2(sum) : NEG_INF;
    const Acc* po = part_o + row * splits * D;
    for (int d = lane; d < Dout; d += 32) {
        Acc o = (Acc)0;
        if (total != NEG_INF) {
            for (int s = 0; s < splits; ++s) o += aa_exp2(pl[s] - total) * po[s * D + d];
        }
        out[row * Dout + d] = AaIO<T>::from_f(o);
    }
    if (lane == 0) lse[row] = total == NEG_INF ? NEG_INF : total * (Acc)AA_LN2;
}

// ---------------------------------------------------------------------------------------------
// Variant v2 (ARRAYATTN_DECODE_VARIANT=v2, decode.py): the same split / merge contract and
// the same online softmax (another rounding: see consume), built to keep far more bytes of
// K and V in flight and to issue fewer instructions per key.
//
// v1 issues two key steps (four 16-byte loads per lane), waits for them, consumes them and
// only then issues the next two: a warp's loads drain to zero every iteration, and with
// about two 4-warp blocks per SM (num_splits) an SM holds 8 warps x 2 KB = 16 KB at the
// peak, ~8 KB on average. Streaming HBM at ~4 TB/s with ~1-2 us of loaded latency needs
// ~30-60 KB in flight per SM. v2:
// * a ring of P key steps per warp in registers (raw 16-byte vectors, converted only when
//   consumed): step t is consumed while steps t+1 .. t+P-1 are in flight, and its slot is
//   refilled with step t+P before the arithmetic on step t starts, so the ring never drains
//   (P = 4 for 16-byte rows per lane: 4 x (K + V) x 16 B = 128 B per lane, 4 KB per warp);
// * loads as ld.global.nc.L1::no_allocate (each byte is read once: no L1 pollution) with
//   an L2 256-byte prefetch hint (a warp reads 2 x 256 contiguous bytes per step);
// * __launch_bounds__ asks for 2-4 blocks per SM by the rows' register needs (AaDec2Occ)
//   and the host aims num_splits at that many blocks per SM (DecodePlan.blocks_per_sm):
//   float16 D = 128 with 4 rows (GQA 32/8, one token): 3 blocks x 4 warps x 4 KB = 48 KB
//   per SM in flight, 64 KB with 1-2 rows;
// * the merge takes one 4-warp block per query row: the warps share the splits, each lane
//   holds D / 32 dims (coalesced 128-byte rows, D / 32 independent loads per split), and
//   the warps' partial sums meet in shared memory in a fixed order (deterministic). v1's
//   merge walks all splits serially in one warp per row, which at 60+ splits is a chain of
//   dependent-latency round trips.
// ---------------------------------------------------------------------------------------------

#define AA_DEC2_WARPS 4

// The ring depth: key steps in flight per warp, by the bytes a lane holds of one row.
template <typename S, int D> struct AaDec2Pipe {
    typedef AaDecLayout<S, D> Lay;
    static constexpr int NV = Lay::EPL / Lay::VEC;  // 16-byte vectors per lane per row
    static constexpr int P = NV == 1 ? 4 : (NV == 2 ? 2 : 1);
};

// Blocks per SM the split kernel is built for (its register cap: 65536 / (128 * blocks)),
// by STATE, the 32-bit registers of a lane's accumulator rows (the query rows take as
// many); the ring takes 32 registers at every kind and D. The thresholds are the largest
// that compile without spills with nvcc 13 for sm_90 (bench/RESULTS.md, 2026-11-26):
// 16-bit storage 4 blocks (128 registers) up to STATE 16, 3 (168) up to 32; float32 4 up
// to 8, 3 up to 32 while a lane holds at most 4 dims; float64 4 up to 4; else 2 (255).
// decode.py's plan mirrors it (num_splits aims at that many blocks per SM).
template <typename T, int D, int ROWS> struct AaDec2Occ {
    typedef typename AaIO<T>::type S;
    typedef typename AaDecAcc<T>::type A;
    static constexpr int EPL = AaDecLayout<S, D>::EPL;
    static constexpr int STATE = ROWS * EPL * (int)(sizeof(A) / 4);
    static constexpr int MIN_BLOCKS =
        sizeof(S) == 2   ? (STATE <= 16 ? 4 : (STATE <= 32 ? 3 : 2))
        : sizeof(S) == 4 ? (STATE <= 8 ? 4 : (STATE <= 32 && EPL <= 4 ? 3 : 2))
                         : (STATE <= 4 ? 4 : 2);
};

// One 16-byte read-only vector, not cached in L1 (read once), with an L2 prefetch hint.
AA_DEC_DEV uint4 aa_dec2_ldg(const void* p) {
#ifndef AA_HOST_EMULATION
    uint4 r;
#if __CUDA_ARCH__ >= 800  // the L2 prefetch-size qualifier needs sm_80
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
#else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
#endif
    return r;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// The raw vectors of one row from p (this lane's first element); vectors at or past `valid`
// elements are 0 and not read (so valid <= 0 reads nothing).
template <typename S, int NV>
AA_DEC_DEV void aa_dec2_fetch(const S* p, int valid, uint4 (&r)[NV]) {
    constexpr int VEC = 16 / (int)sizeof(S);
#pragma unroll
    for (int t = 0; t < NV; ++t)
        r[t] = t * VEC < valid ? aa_dec2_ldg(p + t * VEC) : make_uint4(0u, 0u, 0u, 0u);
}

template <typename T, int NV, int EPL>
AA_DEC_DEV void aa_dec2_convert(const uint4 (&r)[NV], typename AaDecAcc<T>::type (&out)[EPL]) {
    typedef typename AaIO<T>::type S;
    constexpr int VEC = 16 / (int)sizeof(S);
#pragma unroll
    for (int t = 0; t < NV; ++t) {
        union {
            uint4 u;
            S s[VEC];
        } w;
        w.u = r[t];
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[t * VEC + e] = AaIO<T>::to_f(w.s[e]);
    }
}

template <typename T, int D, int ROWS>
__global__ void __launch_bounds__(AA_DEC2_WARPS * 32, AaDec2Occ<T, D, ROWS>::MIN_BLOCKS)
    aa_decode_split_v2(
    const typename AaIO<T>::type* __restrict__ q, long long q_sb, long long q_sh,
    long long q_sr, const typename AaIO<T>::type* __restrict__ k, long long k_pg,
    long long k_sh, long long k_sr, const typename AaIO<T>::type* __restrict__ v,
    long long v_pg, long long v_sh, long long v_sr, const int* __restrict__ tables,
    int max_pages, int page_size, const int* __restrict__ q_lens,
    const int* __restrict__ kv_lens, int L, int S, int Hq, int Hkv, int E, int Ev, int diag,
    int left, int right, typename AaDecAcc<T>::type scale, typename AaDecAcc<T>::type softcap,
    const typename AaDecAcc<T>::type* __restrict__ alibi, int keys_per_split,
    typename AaDecAcc<T>::type* __restrict__ part_o,
    typename AaDecAcc<T>::type* __restrict__ part_lse) {
    typedef typename AaIO<T>::type Sto;
    typedef typename AaDecAcc<T>::type Acc;
    typedef AaDecLayout<Sto, D> Lay;
    constexpr int LG = Lay::LG, EPL = Lay::EPL, KPW = Lay::KPW, NW = AA_DEC2_WARPS;
    constexpr int NV = AaDec2Pipe<Sto, D>::NV, P = AaDec2Pipe<Sto, D>::P;
    const Acc NEG_INF = -aa_dec_inf<Acc>();
    const Acc LOG2E = (Acc)AA_LOG2E;

    const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.z;
    const int G = Hq / Hkv, chunks = (G * L + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = lane / LG, gl = lane % LG;

    const int q_len = q_lens != nullptr ? min(max(q_lens[b], 0), L) : L;
    const int kv_len = kv_lens != nullptr ? min(max(kv_lens[b], 0), S) : S;
    const int offset = diag == AA_DIAG_FROM_LENGTHS ? kv_len - q_len : diag;
    int lo, hi;
    aa_key_range(0, q_len, offset, left, right, kv_len, lo, hi);
    const int j0 = lo + split * keys_per_split;
    const int j1 = min(hi, j0 + keys_per_split);

    // Issue the ring's first loads before anything else, so they overlap the query setup.
    // Step t of this warp covers keys wb + t * STEP .. + KPW; this lane group's is jl + t * STEP.
    constexpr int STEP = NW * KPW;
    const int wb = j0 + warp * KPW, jl = wb + grp;
    auto address = [&](int j, long long& kb, long long& vb) {
        long long page = b, row = j;
        if (tables != nullptr) {
            page = tables[(long long)b * max_pages + j / page_size];
            row = j % page_size;
        }
        kb = page * k_pg + kvh * k_sh + row * k_sr + gl * EPL;
        vb = page * v_pg + kvh * v_sh + row * v_sr + gl * EPL;
    };
    // Keys at or past j1 (the ring running ahead of the split's end) read nothing.
    auto fetch = [&](int j, uint4 (&kr)[NV], uint4 (&vr)[NV]) {
        const bool in = j < j1;
        long long kb = 0, vb = 0;
        if (in) address(j, kb, vb);
        aa_dec2_fetch<Sto, NV>(k + kb, in ? E - gl * EPL : 0, kr);
        aa_dec2_fetch<Sto, NV>(v + vb, in ? Ev - gl * EPL : 0, vr);
    };
    uint4 kr[P][NV], vr[P][NV];
#pragma unroll
    for (int s = 0; s < P; ++s) fetch(jl + s * STEP, kr[s], vr[s]);

    // This block's rows: query head h and row i of each, and the query (scaled) per lane.
    int row_h[ROWS], row_i[ROWS];
    bool row_ok[ROWS];
    Acc slope[ROWS], qf[ROWS][EPL], m[ROWS], l[ROWS], acc[ROWS][EPL];
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
        const int r = chunk * ROWS + rr;
        row_h[rr] = kvh * G + (r < G * L ? r / L : 0);
        row_i[rr] = r % L;
        row_ok[rr] = r < G * L && row_i[rr] < q_len;
        slope[rr] = (alibi != nullptr && row_ok[rr]) ? alibi[(long long)b * Hq + row_h[rr]] : (Acc)0;
        if (row_ok[rr]) {
            const Sto* qp = q + b * q_sb + row_h[rr] * q_sh + row_i[rr] * q_sr + gl * EPL;
            aa_dec_load<T, EPL>(qp, E - gl * EPL, qf[rr]);
        } else {
#pragma unroll
            for (int e = 0; e < EPL; ++e) qf[rr][e] = (Acc)0;
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            qf[rr][e] *= scale;
            acc[rr][e] = (Acc)0;
        }
        m[rr] = NEG_INF;
        l[rr] = (Acc)0;
    }

    // Each row's keys inside this split, [jlo, jhi): aa_allowed's window and kv_len bound
    // and the split's end folded into two compares per key (empty for padding rows).
    int jlo[ROWS], jhi[ROWS];
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
        const long long c = (long long)row_i[rr] + offset;
        long long a = j0, z = j1;
        if (left >= 0 && c - left > a) a = c - left;
        if (right >= 0 && c + right + 1 < z) z = c + right + 1;
        if (kv_len < z) z = kv_len;
        jlo[rr] = row_ok[rr] ? (int)a : 1;
        jhi[rr] = row_ok[rr] ? (int)(z > a ? z : a) : 0;
    }

    // The per-key update. Against v1: every row's dot product and shuffle level is issued
    // before any row's update (v1 runs a row's whole chain -- dot, 4 dependent shuffles,
    // exp2s -- before the next row's starts), and the running maximum is rescaled only
    // when it grows (rarely after the first keys: one exp2 and LG-lane FFMAs per key and
    // row instead of two exp2s, a multiply and an FFMA per element). Same online softmax,
    // other rounding.
    auto consume = [&](int j, const Acc (&kf)[EPL], const Acc (&vf)[EPL]) {
        Acc sc[ROWS];
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
            Acc s = (Acc)0;
#pragma unroll
            for (int e = 0; e < EPL; ++e) s += qf[rr][e] * kf[e];
            sc[rr] = s;
        }
#pragma unroll
        for (int o = LG / 2; o > 0; o >>= 1) {
#pragma unroll
            for (int rr = 0; rr < ROWS; ++rr) sc[rr] += __shfl_xor_sync(0xffffffffu, sc[rr], o);
        }
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
            if (j < jlo[rr] || j >= jhi[rr]) continue;
            Acc s = sc[rr];
            if (softcap > (Acc)0) s = softcap * aa_dec_tanh(s / softcap);
            if (alibi != nullptr) s -= slope[rr] * (Acc)aa_alibi_dist(row_i[rr], j, offset);
            const Acc s2 = s * LOG2E;
            if (s2 > m[rr]) {  // a new maximum: rescale the sums (exp2(-inf) = 0 at first)
                const Acc c = aa_exp2(m[rr] - s2);
                l[rr] *= c;
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[rr][e] *= c;
                m[rr] = s2;
            }
            const Acc p = aa_exp2(s2 - m[rr]);
            l[rr] += p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[rr][e] += p * vf[e];
        }
    };

    // The ring: P steps per iteration, slot s always holding step t + s. The bounds are
    // warp-uniform (wb), so every lane takes part in the shuffles; a lane group past j1
    // consumes nothing (jhi <= j1).
    for (int t = 0; wb + t * STEP < j1; t += P) {
#pragma unroll
        for (int s = 0; s < P; ++s) {
            if (wb + (t + s) * STEP >= j1) break;  // warp-uniform
            Acc kf[EPL], vf[EPL];
            aa_dec2_convert<T, NV, EPL>(kr[s], kf);
            aa_dec2_convert<T, NV, EPL>(vr[s], vf);
            fetch(jl + (t + s + P) * STEP, kr[s], vr[s]);  // refill before the arithmetic
            consume(jl + (t + s) * STEP, kf, vf);
        }
    }

    // Merge the lane groups of the warp (same dims, other keys).
#pragma unroll
    for (int o = LG; o < 32; o <<= 1) {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
            const Acc m2 = __shfl_xor_sync(0xffffffffu, m[rr], o);
            const Acc l2 = __shfl_xor_sync(0xffffffffu, l[rr], o);
            const Acc mn = m2 > m[rr] ? m2 : m[rr];
            const Acc ms = mn == NEG_INF ? (Acc)0 : mn;
            const Acc c1 = aa_exp2(m[rr] - ms), c2 = aa_exp2(m2 - ms);
            l[rr] = l[rr] * c1 + l2 * c2;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                const Acc a2 = __shfl_xor_sync(0xffffffffu, acc[rr][e], o);
                acc[rr][e] = acc[rr][e] * c1 + a2 * c2;
            }
            m[rr] = mn;
        }
    }

    // Merge the warps through shared memory: acc (NW, ROWS, D), then m and l (NW, ROWS).
    AA_DEC_SMEM(smem_raw);
    Acc* sm_acc = reinterpret_cast<Acc*>(smem_raw);
    Acc* sm_m = sm_acc + NW * ROWS * D;
    Acc* sm_l = sm_m + NW * ROWS;
    if (grp == 0) {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) sm_acc[(warp * ROWS + rr) * D + gl * EPL + e] = acc[rr][e];
            if (gl == 0) {
                sm_m[warp * ROWS + rr] = m[rr];
                sm_l[warp * ROWS + rr] = l[rr];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ROWS * D; idx += NW * 32) {
        const int rr = idx / D, d = idx % D;
        const int r = chunk * ROWS + rr;
        if (r >= G * L) continue;
        Acc mx = NEG_INF;
        for (int w = 0; w < NW; ++w) mx = sm_m[w * ROWS + rr] > mx ? sm_m[w * ROWS + rr] : mx;
        const Acc ms = mx == NEG_INF ? (Acc)0 : mx;
        Acc tot = (Acc)0, a = (Acc)0;
        for (int w = 0; w < NW; ++w) {
            const Acc c = aa_exp2(sm_m[w * ROWS + rr] - ms);
            tot += sm_l[w * ROWS + rr] * c;
            a += sm_acc[(w * ROWS + rr) * D + d] * c;
        }
        const long long row = ((long long)b * Hq + kvh * G + r / L) * L + r % L;
        part_o[(row * splits + split) * D + d] = tot > (Acc)0 ? a / tot : (Acc)0;
        if (d == 0) part_lse[row * splits + split] = tot > (Acc)0 ? mx + aa_dec_log2(tot) : NEG_INF;
    }
}

// One block of AA_DEC2_WARPS warps per query row (grid (rows, 1, 1)); dynamic shared
// memory AA_DEC2_WARPS * D accumulators. Same result as aa_decode_merge up to the order of
// the sum over splits (here: per warp over its splits s = warp mod NW, then over warps).
template <typename T, int D>
__global__ void __launch_bounds__(AA_DEC2_WARPS * 32) aa_decode_merge_v2(
    const typename AaDecAcc<T>::type* __restrict__ part_o,
    const typename AaDecAcc<T>::type* __restrict__ part_lse, int splits, long long rows,
    int L, const typename AaDecAcc<T>::type* __restrict__ sinks, int Dout,
    typename AaIO<T>::type* __restrict__ out, typename AaDecAcc<T>::type* __restrict__ lse) {
    typedef typename AaDecAcc<T>::type Acc;
    constexpr int NW = AA_DEC2_WARPS, DPL = D / 32;  // dims per lane
    const Acc NEG_INF = -aa_dec_inf<Acc>();
    const Acc LOG2E = (Acc)AA_LOG2E;
    const long long row = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;  // the whole block leaves together
    // Every warp finds the row's LSE itself (a few split LSEs: cheaper than a barrier).
    const Acc* pl = part_lse + row * splits;
    Acc mx = NEG_INF;
    for (int s = lane; s < splits; s += 32) mx = pl[s] > mx ? pl[s] : mx;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const Acc m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = m2 > mx ? m2 : mx;
    }
    // row = (b * Hq + h) * L + i; sinks are per (b, h): (B * Hq,), natural log.
    const Acc sink2 = sinks != nullptr ? sinks[row / L] * LOG2E : NEG_INF;
    const Acc top = sink2 > mx ? sink2 : mx;
    const Acc ts = top == NEG_INF ? (Acc)0 : top;
    Acc sum = (Acc)0;
    for (int s = lane; s < splits; s += 32) sum += aa_exp2(pl[s] - ts);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sinks != nullptr) sum += aa_exp2(sink2 - ts);
    const Acc total = sum > (Acc)0 ? ts + aa_dec_log2(sum) : NEG_INF;

    Acc o[DPL];
#pragma unroll
    for (int u = 0; u < DPL; ++u) o[u] = (Acc)0;
    if (total != NEG_INF) {
        const Acc* po = part_o + row * splits * D + lane;
#pragma unroll 2
        for (int s = warp; s < splits; s += NW) {
            const Acc w = aa_exp2(pl[s] - total);
#pragma unroll
            for (int u = 0; u < DPL; ++u) o[u] += w * po[s * D + 32 * u];
        }
    }
    AA_DEC_SMEM(smem_raw);
    Acc* red = reinterpret_cast<Acc*>(smem_raw);  // (NW, D)
#pragma unroll
    for (int u = 0; u < DPL; ++u) red[warp * D + 32 * u + lane] = o[u];
    __syncthreads();
    for (int d = threadIdx.x; d < Dout; d += NW * 32) {
        Acc a = (Acc)0;
        for (int w = 0; w < NW; ++w) a += red[w * D + d];
        out[row * Dout + d] = AaIO<T>::from_f(a);
    }
    if (threadIdx.x == 0) lse[row] = total == NEG_INF ? NEG_INF : total * (Acc)AA_LN2;
}
