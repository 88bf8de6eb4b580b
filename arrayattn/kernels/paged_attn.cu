// Attention over a paged KV cache, reading the pages where they are (CuPy path of
// arrayattn.nn.PagedKVCache.attend).
//
// One thread per query row (b, h, i): the row walks its sequence's keys in order through
// the block table (token j lives at offset j % P of page tables[b][j / P]) with an online
// softmax kept in registers, so no page is ever copied or gathered. Rows past q_len[b]
// are padding and get 0. Query i of sequence b is token kv_len[b] - q_len[b] + i
// (bottom-right alignment), which bounds the causal and windowed key range directly.
//
// Scores: scale * q.k, then softcap (if > 0), then the ALiBi bias -slope * |qpos - j|;
// a sink logit joins the denominator at the end (gpt-oss). Arithmetic in T (float or
// double). Written without warp collectives or shared memory so the same source runs on
// the CPU in tests (tests/nn/test_paged_kernel.py compiles it with g++).

#ifndef AA_PAGED_HOST
#define AA_INF (__int_as_float(0x7f800000))
#else
#define AA_INF INFINITY
#endif

template <typename T, int DMAX, int DVMAX>
__global__ void aa_paged_attn(const T* __restrict__ q,             // (B, Hq, L, D)
                              const T* __restrict__ kpages,        // (pages, Hkv, P, D)
                              const T* __restrict__ vpages,        // (pages, Hkv, P, Dv)
                              const long long* __restrict__ tables,  // (B, max_pages)
                              const long long* __restrict__ kv_len,  // (B,)
                              const long long* __restrict__ q_len,   // (B,)
                              const T* __restrict__ sinks,         // (Hq,) or null
                              const T* __restrict__ slopes,        // (B or 1, Hq) or null
                              T* __restrict__ out,                 // (B, Hq, L, Dv)
                              int B, int Hq, int Hkv, int L, int D, int Dv, int P,
                              int max_pages, T scale, T softcap, int causal, int win_left,
                              int win_right, int slope_bstride, int has_sinks,
                              int has_slopes) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = (long long)B * Hq * L;
    if (row >= total) return;
    const int i = (int)(row % L);
    const int h = (int)((row / L) % Hq);
    const int b = (int)(row / ((long long)L * Hq));
    const int g = h / (Hq / Hkv);  // GQA: query head h reads KV head h / group
    T* o = out + row * Dv;
    const long long kvn = kv_len[b], qn = q_len[b];
    if (i >= qn) {
        for (int d = 0; d < Dv; ++d) o[d] = T(0);
        return;
    }
    const long long qpos = kvn - qn + i;
    T qv[DMAX];
    for (int d = 0; d < D; ++d) qv[d] = q[row * D + d];
    T acc[DVMAX];
    for (int d = 0; d < Dv; ++d) acc[d] = T(0);
    T m = -AA_INF, l = T(0);
    const T slope = has_slopes ? slopes[(long long)b * slope_bstride + h] : T(0);
    long long j0 = 0, j1 = kvn;  // keys [j0, j1) of this row
    if (win_left >= 0 && qpos - win_left > j0) j0 = qpos - win_left;
    if (causal && qpos + 1 < j1) j1 = qpos + 1;
    if (win_right >= 0 && qpos + win_right + 1 < j1) j1 = qpos + win_right + 1;
    for (long long j = j0; j < j1; ++j) {
        const long long page = tables[(long long)b * max_pages + j / P];
        const long long at = (page * Hkv + g) * P + j % P;
        const T* kr = kpages + at * D;
        T s = T(0);
        for (int d = 0; d < D; ++d) s += qv[d] * kr[d];
        s *= scale;
        if (softcap > T(0)) s = softcap * tanh(s / softcap);
        if (has_slopes) s -= slope * (T)(qpos > j ? qpos - j : j - qpos);
        const T m_new = s > m ? s : m;
        const T corr = exp(m - m_new);  // 0 while m is -inf
        const T p = exp(s - m_new);
        l = l * corr + p;
        const T* vr = vpages + at * Dv;
        for (int d = 0; d < Dv; ++d) acc[d] = acc[d] * corr + p * vr[d];
        m = m_new;
    }
    if (has_sinks) {
        const T sk = sinks[h];
        const T mf = sk > m ? sk : m;
        const T c = exp(m - mf);
        l = l * c + exp(sk - mf);
        for (int d = 0; d < Dv; ++d) acc[d] *= c;
    }
    for (int d = 0; d < Dv; ++d) o[d] = l > T(0) ? acc[d] / l : T(0);
}
