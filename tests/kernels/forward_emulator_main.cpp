// Driver: runs one forward kernel variant under the host emulator on inputs from a file.
// Compile with -DAA_KERNEL='aa_fwd_tc<0, 64, 2, false, false, 0>' -DAA_TIO=... -DAA_TACC=...
// -DAA_CFG='AaTcCfg<64, 2>' (the kernel's tile struct); see test_forward_emulated.py.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "forward_emulator.h"
#include "attn_fwd.cu"

template <typename X>
static std::vector<X> read_vec(std::FILE* f, size_t n) {
    std::vector<X> v(n);
    if (n && std::fread(v.data(), sizeof(X), n, f) != n) std::exit(3);
    return v;
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    std::FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 2;
    auto hi = read_vec<long long>(f, 22);
    auto hd = read_vec<double>(f, 4);
    const long long B = hi[0], Hq = hi[1], Hkv = hi[2], L = hi[3], S = hi[4], D = hi[5],
                    G = hi[6], br = hi[7], left = hi[8], right = hi[9], mask_kind = hi[10],
                    mask_b = hi[11], mask_h = hi[12], has_ql = hi[13], has_kl = hi[14],
                    seed = hi[15], thr = hi[16], bshd = hi[17], has_sinks = hi[20],
                    has_alibi = hi[21];
    const double scale = hd[0], cap = hd[1], inv_keep = hd[2];
    auto q = read_vec<AA_TIO>(f, B * Hq * L * D);
    auto k = read_vec<AA_TIO>(f, B * Hkv * S * D);
    auto v = read_vec<AA_TIO>(f, B * Hkv * S * D);
    const long long mb = mask_b ? B : 1, mh = mask_h ? Hq : 1;
    std::vector<unsigned char> mask_u8;
    std::vector<AA_TACC> mask_f;
    const void* mask = nullptr;
    if (mask_kind == 1) { mask_u8 = read_vec<unsigned char>(f, mb * mh * L * S); mask = mask_u8.data(); }
    if (mask_kind == 2) { mask_f = read_vec<AA_TACC>(f, mb * mh * L * S); mask = mask_f.data(); }
    std::vector<int> ql, kl;
    if (has_ql) ql = read_vec<int>(f, B);
    if (has_kl) kl = read_vec<int>(f, B);
    std::vector<AA_TACC> sinks, alibi;  // (B, Hq) each, in the accumulation type
    if (has_sinks) sinks = read_vec<AA_TACC>(f, B * Hq);
    if (has_alibi) alibi = read_vec<AA_TACC>(f, B * Hq);
    std::fclose(f);

    using Cfg = AA_CFG;
    if (Cfg::SMEM != hi[18] || Cfg::BM != hi[19]) {
        std::fprintf(stderr, "tile config mismatch: kernel SMEM %d BM %d, host %lld %lld\n",
                     (int)Cfg::SMEM, (int)Cfg::BM, hi[18], hi[19]);
        return 4;
    }
    std::vector<AA_TIO> out(B * Hq * L * D);
    std::vector<AA_TACC> lse(B * Hq * L);
    std::memset(out.data(), 0xFF, out.size() * sizeof(AA_TIO));  // poison: NaN
    std::memset(lse.data(), 0xFF, lse.size() * sizeof(AA_TACC));

    // q/k/v either (B, H, L, D) or (B, L, H, D): the kernel takes element strides.
    const long long q_sb = Hq * L * D, k_sb = Hkv * S * D;
    const long long q_sh = bshd ? D : L * D, q_sr = bshd ? Hq * D : D;
    const long long k_sh = bshd ? D : S * D, k_sr = bshd ? Hkv * D : D;
    const long long m_sb = mask_b ? mh * L * S : 0, m_sh = mask_h ? L * S : 0;
    const AA_TACC log2e = (AA_TACC)AA_LOG2E;
    const AA_TACC capv = cap > 0 ? (AA_TACC)cap : (AA_TACC)1;
    AaDim3 grid{(unsigned)((L + Cfg::BM - 1) / Cfg::BM), (unsigned)Hq, (unsigned)B};
    aa_emu_launch(grid, Cfg::NT, Cfg::SMEM, [&] {
        AA_KERNEL(q.data(), k.data(), v.data(), out.data(), lse.data(), mask,
                  has_ql ? ql.data() : nullptr, has_kl ? kl.data() : nullptr, nullptr, nullptr,
                  q_sb, q_sh, q_sr, k_sb, k_sh, k_sr, k_sb, k_sh, k_sr, Hq * L * D, L * D, D,
                  Hq * L, L, m_sb, m_sh, S, 1, (int)L, (int)S, (int)G, (int)br, (int)left,
                  (int)right, (AA_TACC)(scale * AA_LOG2E), (AA_TACC)scale, capv,
                  (AA_TACC)(1.0 / capv), (aa_u32)seed, (aa_u32)thr, (AA_TACC)inv_keep,
                  has_sinks ? sinks.data() : nullptr, has_alibi ? alibi.data() : nullptr,
                  nullptr);  // flex: block masks run through test_forward_flex_emulated.py
    });
    (void)log2e;
    std::FILE* g = std::fopen(argv[2], "wb");
    if (!g) return 2;
    std::fwrite(out.data(), sizeof(AA_TIO), out.size(), g);
    std::fwrite(lse.data(), sizeof(AA_TACC), lse.size(), g);
    std::fclose(g);
    return 0;
}
