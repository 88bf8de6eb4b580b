// Generic driver: replays one kernel launch recorded by the fake CuPy of
// test_fused_glue.py (grid, block, shared memory, every argument with its type tag and
// the memory behind every pointer) on the host emulator, then writes the memory back.
// The argument tags must match the kernel's C++ signature exactly, so an argument list
// that disagrees with AA_FWD_ARGS (order, count or width) fails here.
// Compile with -DAA_KERNEL='aa_fwd_tc<0, 64, 2, false, false, 0>' -DAA_CFG='AaTcCfg<64, 2>'.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "forward_emulator.h"
#include "attn_fwd.cu"

template <typename A>
constexpr char aa_tag() {
    using T = std::remove_cv_t<A>;
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, long long>) return 'q';
    else if constexpr (std::is_same_v<T, int>) return 'i';
    else if constexpr (std::is_same_v<T, unsigned int>) return 'I';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_same_v<T, double>) return 'd';
    else return '?';
}

template <typename... A>
std::string aa_signature(void (*)(A...)) {
    return std::string{aa_tag<A>()...};
}

static long long rd_i64(std::FILE* f) {
    long long x;
    if (std::fread(&x, 8, 1, f) != 1) std::exit(3);
    return x;
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    std::FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 2;
    AaDim3 grid;
    grid.x = (unsigned)rd_i64(f);
    grid.y = (unsigned)rd_i64(f);
    grid.z = (unsigned)rd_i64(f);
    const int threads = (int)rd_i64(f);
    const long long smem = rd_i64(f);
    const long long nbuf = rd_i64(f);
    std::vector<std::vector<unsigned char>> bufs(nbuf);
    for (auto& b : bufs) {
        b.resize(rd_i64(f));
        if (!b.empty() && std::fread(b.data(), 1, b.size(), f) != b.size()) return 3;
    }
    const long long nargs = rd_i64(f);
    std::string tags;
    struct Slot { alignas(8) unsigned char bytes[8]; };
    std::vector<Slot> slots(nargs);
    std::vector<void*> params(nargs);
    for (long long a = 0; a < nargs; ++a) {
        char tag;
        if (std::fread(&tag, 1, 1, f) != 1) return 3;
        const long long v0 = rd_i64(f), v1 = rd_i64(f);
        double dv;
        std::memcpy(&dv, &v1, 8);
        unsigned char* s = slots[a].bytes;
        if (tag == 'p') {
            void* p = bufs.at(v0).data() + v1;
            std::memcpy(s, &p, sizeof p);
        } else if (tag == 'n') {
            void* p = nullptr;
            std::memcpy(s, &p, sizeof p);
            tag = 'p';
        } else if (tag == 'q') {
            std::memcpy(s, &v0, 8);
        } else if (tag == 'i') {
            const int x = (int)v0;
            std::memcpy(s, &x, 4);
        } else if (tag == 'I') {
            const unsigned x = (unsigned)v0;
            std::memcpy(s, &x, 4);
        } else if (tag == 'f') {
            const float x = (float)dv;
            std::memcpy(s, &x, 4);
        } else if (tag == 'd') {
            std::memcpy(s, &dv, 8);
        } else {
            return 5;
        }
        tags.push_back(tag);
        params[a] = s;
    }
    std::fclose(f);

    auto* fn = &AA_KERNEL;
    const std::string want = aa_signature(fn);
    if (want != tags) {
        std::fprintf(stderr, "argument tags %s do not match the kernel signature %s\n",
                     tags.c_str(), want.c_str());
        return 6;
    }
    using Cfg = AA_CFG;
    if (threads != Cfg::NT || smem < Cfg::SMEM) {
        std::fprintf(stderr, "launch %d threads / %lld smem, kernel needs %d / %d\n", threads,
                     smem, (int)Cfg::NT, (int)Cfg::SMEM);
        return 7;
    }
    aa_emu_launch(grid, threads, (size_t)smem, [&] { aa_emu_call(fn, params.data()); });

    std::FILE* g = std::fopen(argv[2], "wb");
    if (!g) return 2;
    for (auto& b : bufs) std::fwrite(b.data(), 1, b.size(), g);
    std::fclose(g);
    return 0;
}
