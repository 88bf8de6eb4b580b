"""The split-KV decode kernels (``arrayattn/attention/cuda/decode_attn.cu``) on the CPU: their own
source under the host emulator (``backward_emulator.h``: one OS thread per CUDA thread,
barriers, warp shuffles), launched by :func:`arrayattn.attention.cuda.decode.run_decode` exactly
as on a GPU, against a float64 reference written plainly here.

Covered: every dtype (float16/bfloat16 as their 16-bit storage), each head-dim bucket,
E != Ev, contiguous and paged caches (shuffled pages, page sizes that do not divide the
lengths), GQA up to MQA with several row chunks, ragged q/kv lengths with empty
sequences and padding rows, causal in both alignments, two-sided windows, softcap, ALiBi,
sinks, strided and batch-broadcast operands, and enough splits that some are empty. Every
output element starts as NaN, so an unwritten one fails. Each case runs on both kernel
variants (``decode.VARIANTS``: ``v1`` and ``v2``, ``ARRAYATTN_DECODE_VARIANT``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn.attention.cuda import decode
from arrayattn.attention.cuda.tiles import DIAG_FROM_LENGTHS

emu = pytest.importorskip("_backward_emu")
tsan = pytest.importorskip("_tsan")

pytestmark = pytest.mark.skipif(
    emu.compiler() is None or emu.cuda_include() is None,
    reason="needs g++ (C++20) and the CUDA headers (vector types) for the host emulator",
)

CASES = {
    "f32_causal_br_lengths": dict(kind="float32", B=2, Hq=4, Hkv=2, L=1, S=300, E=64,
                                  causal=True, align="bottom_right", kv_lens=(300, 77)),
    "f16_paged_window_softcap_sinks_alibi": dict(
        kind="float16", B=3, Hq=8, Hkv=2, L=3, S=200, E=64, page=16, q_lens=(3, 1, 0),
        kv_lens=(200, 5, 0), causal=True, align="bottom_right", window=(50, -1),
        softcap=3.0, sinks=True, alibi=True),
    "bf16_mqa_chunks_e_ne_ev_kv_broadcast": dict(
        kind="bfloat16", B=2, Hq=8, Hkv=1, L=2, S=140, E=96, Ev=64, kv_broadcast=True,
        causal=True, align="bottom_right"),
    "f64_paged_p5_two_sided_top_left": dict(
        kind="float64", B=2, Hq=4, Hkv=2, L=4, S=150, E=32, page=5, q_lens=(4, 2),
        kv_lens=(150, 33), window=(3, 2)),
    "f32_d256_empty_splits": dict(kind="float32", B=2, Hq=2, Hkv=1, L=16, S=1000, E=256,
                                  kv_lens=(1000, 10), causal=True, align="bottom_right"),
    "f16_d32_top_left_causal": dict(kind="float16", B=1, Hq=2, Hkv=2, L=1, S=130, E=32,
                                    causal=True, align="top_left"),
    "f32_strided_query_sinks": dict(kind="float32", B=2, Hq=4, Hkv=4, L=3, S=257, E=128,
                                    bshd=True, sinks=True),
    "f16_paged_ev_gt_e": dict(kind="float16", B=2, Hq=4, Hkv=2, L=1, S=90, E=64, Ev=128,
                              page=7, kv_lens=(90, 64)),
    # float64 at D = 128 and 256: two and four 16-byte vectors per lane and row (v2's ring
    # of 2 and of 1 key step)
    "f64_d128_window_softcap_lengths": dict(
        kind="float64", B=2, Hq=4, Hkv=2, L=1, S=300, E=128, kv_lens=(300, 150),
        causal=True, align="bottom_right", window=(100, -1), softcap=2.0),
    "f64_d256_alibi_e_ne_ev": dict(kind="float64", B=1, Hq=2, Hkv=1, L=2, S=160, E=256,
                                   Ev=136, causal=True, align="bottom_right", alibi=True),
}  # fmt: skip


def _round16(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(storage uint16, the float64 values it holds) of float32 ``x`` in ``kind``."""
    if kind == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return r, (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _store(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    if kind in ("float16", "bfloat16"):
        return _round16(x, kind)
    a = x.astype(kind)
    return a, a.astype(np.float64)


def _from_storage(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float16":
        return a.view(np.float16).astype(np.float64)
    if kind == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def reference(q, k, v, *, q_lens, kv_lens, diag, left, right, scale, softcap, slopes, sinks):
    """float64: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) -> out, lse (natural)."""
    B, Hq, L, _ = q.shape
    Hkv, Ev = k.shape[1], v.shape[3]
    G = Hq // Hkv
    out = np.zeros((B, Hq, L, Ev))
    lse = np.full((B, Hq, L), -np.inf)
    for b in range(B):
        ql, kl = q_lens[b], kv_lens[b]
        off = kl - ql if diag == DIAG_FROM_LENGTHS else diag
        for h in range(Hq):
            for i in range(ql):
                j = np.arange(kl)
                ok = np.ones(kl, bool)
                if left >= 0:
                    ok &= j >= i + off - left
                if right >= 0:
                    ok &= j <= i + off + right
                s = scale * (k[b, h // G, :kl] @ q[b, h, i])
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                if slopes is not None:
                    s = s - slopes[b, h] * np.abs(i + off - j)
                s = s[ok]
                logits = s if sinks is None else np.append(s, sinks[b, h])
                if logits.size == 0:
                    continue
                mx = logits.max()
                tot = np.exp(logits - mx).sum()
                lse[b, h, i] = mx + math.log(tot)
                if s.size:
                    out[b, h, i] = (np.exp(s - lse[b, h, i])) @ v[b, h // G, :kl][ok]
            if sinks is not None:
                lse[b, h, ql:] = sinks[b, h]
    return out, lse


def _plan(case: str, variant: str) -> decode.DecodePlan:
    c = {**CASES, **RACE_CASES}[case]
    rows = c["Hq"] // c["Hkv"] * c["L"]
    plan = decode.decode_plan(c["kind"], c["E"], c.get("Ev", c["E"]), rows, variant=variant)
    assert plan is not None and plan.variant == variant
    return plan


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    names = set()
    for case in CASES:
        for variant in decode.VARIANTS:
            plan = _plan(case, variant)
            names |= {plan.split, plan.merge}
    return emu.build(sorted(names), tmp_path_factory.mktemp("decode"), kernel_file=decode.SOURCE)


# v2 (the default) on every case; v1 on every case but the two slowest to emulate (CI
# time: about half a minute each), which v1 ran on an H200 in the GPU tests.
_V1_SKIPPED = ("f32_d256_empty_splits", "f16_paged_window_softcap_sinks_alibi")


@pytest.mark.parametrize(
    "case,variant",
    [(c, "v2") for c in CASES] + [(c, "v1") for c in CASES if c not in _V1_SKIPPED],
)
def test_decode_kernels_match_float64(library, case, variant):
    run_case(library, case, variant)


def run_case(library, case: str, variant: str = "v1") -> None:
    """Run ``CASES[case]`` with kernel ``variant`` on the emulator ``library`` and check it
    against float64 (``case`` may also be one of ``RACE_CASES``)."""
    c = {**CASES, **RACE_CASES}[case]
    kind, B, Hq, Hkv, L, S, E = (c[n] for n in ("kind", "B", "Hq", "Hkv", "L", "S", "E"))
    Ev = c.get("Ev", E)
    rng = np.random.default_rng(sum(map(ord, case)))
    q_lens = np.array(c.get("q_lens", (L,) * B), np.int32)
    kv_lens = np.array(c.get("kv_lens", (S,) * B), np.int32)
    left, right = c.get("window", (-1, -1))
    if c.get("causal"):
        right = 0 if right < 0 else min(right, 0)
    diag = DIAG_FROM_LENGTHS if c.get("align") == "bottom_right" else 0
    scale = 1.0 / math.sqrt(E)

    qx = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    kb = 1 if c.get("kv_broadcast") else B
    kx = rng.standard_normal((kb, Hkv, S, E)).astype(np.float32)
    vx = rng.standard_normal((kb, Hkv, S, Ev)).astype(np.float32)
    q_st, q64 = _store(qx, kind)
    k_st, k64 = _store(kx, kind)
    v_st, v64 = _store(vx, kind)
    q_strides = (Hq * L * E, L * E, E)
    if c.get("bshd"):  # query stored (B, L, Hq, E)
        q_st = np.ascontiguousarray(q_st.transpose(0, 2, 1, 3))
        q_strides = (L * Hq * E, E, Hq * E)
    tables, page = None, c.get("page", 1)
    k_strides = (0 if kb == 1 and B > 1 else Hkv * S * E, S * E, E)
    v_strides = (0 if kb == 1 and B > 1 else Hkv * S * Ev, S * Ev, Ev)
    k_arg, v_arg = k_st, v_st
    if "page" in c:  # scatter each sequence's rows over shuffled pages
        per_seq = -(-S // page)
        n_pages = B * per_seq + 3
        order = rng.permutation(n_pages)[: B * per_seq].reshape(B, per_seq)
        tables = order.astype(np.int32)
        kp = np.full((n_pages, Hkv, page, E), 0xFFFF if k_st.dtype == np.uint16 else np.nan,
                     dtype=k_st.dtype)  # fmt: skip
        vp = np.full((n_pages, Hkv, page, Ev), 0xFFFF if v_st.dtype == np.uint16 else np.nan,
                     dtype=v_st.dtype)  # fmt: skip
        for b in range(B):
            for j in range(int(kv_lens[b])):  # only the cached rows exist
                kp[tables[b, j // page], :, j % page] = k_st[b, :, j]
                vp[tables[b, j // page], :, j % page] = v_st[b, :, j]
        k_arg, v_arg = kp, vp
        k_strides = (Hkv * page * E, page * E, E)
        v_strides = (Hkv * page * Ev, page * Ev, Ev)
    acc = np.float64 if kind == "float64" else np.float32
    slopes = rng.uniform(0.05, 0.5, (B, Hq)) if c.get("alibi") else None
    sinks = rng.standard_normal((B, Hq)) if c.get("sinks") else None

    plan = _plan(case, variant)
    launcher = emu.Launcher(library)
    out, lse = decode.run_decode(
        emu.PoisonXp, launcher, plan,
        q_st, q_strides, k_arg, k_strides, v_arg, v_strides,
        batch=B, heads=Hq, kv_heads=Hkv, rows=L, keys=S, e=E, ev=Ev, scale=scale,
        out_dtype=q_st.dtype, diag=diag, window=(left, right), tables=tables,
        page_size=page, q_lens=q_lens, kv_lens=kv_lens, softcap=c.get("softcap"),
        alibi=None if slopes is None else slopes.astype(acc).reshape(-1),
        sinks=None if sinks is None else sinks.astype(acc).reshape(-1),
        # many short splits (some empty for the short sequences), but one case as on a GPU
        min_keys_per_split=decode.MIN_KEYS_PER_SPLIT if c.get("bshd") else 24,
    )  # fmt: skip
    assert [name for name, *_ in launcher.launches] == [plan.split, plan.merge]
    splits = launcher.launches[0][1][0]
    want_out, want_lse = reference(
        q64, np.broadcast_to(k64, (B, Hkv, S, E)), np.broadcast_to(v64, (B, Hkv, S, Ev)),
        q_lens=q_lens, kv_lens=kv_lens, diag=diag, left=left, right=right, scale=scale,
        softcap=c.get("softcap"), slopes=slopes, sinks=sinks,
    )  # fmt: skip
    got = _from_storage(out, kind)
    assert not np.isnan(got).any() and not np.isnan(lse).any(), "unwritten or NaN output"
    tol = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[kind]
    np.testing.assert_allclose(got, want_out, rtol=0, atol=tol * max(1.0, np.abs(want_out).max()))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    lse_tol = 1e-12 if kind == "float64" else 2e-6
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=lse_tol, atol=lse_tol)
    if not c.get("bshd"):
        assert splits >= 3, splits


@pytest.mark.parametrize("one_wave", [False, True])
@pytest.mark.parametrize("blocks", [2, 3, 4])
def test_split_counts(blocks, one_wave):
    """Enough splits to fill the GPU, none under MIN_KEYS_PER_SPLIT keys, whole steps;
    one_wave (v2): never more blocks than the SMs hold at once (unless one split each)."""
    for units, span in ((1, 10), (8, 4096), (8, 131072), (64, 300), (2000, 50000), (24, 9999)):
        splits, per = decode.num_splits(units, span, 132, 8, blocks_per_sm=blocks,
                                        one_wave=one_wave)  # fmt: skip
        assert per % 8 == 0 and splits * per >= span > (splits - 1) * per
        assert splits == 1 or per >= decode.MIN_KEYS_PER_SPLIT
        assert units * splits <= blocks * 132 + units or splits == 1
        if one_wave:
            assert units * splits <= blocks * 132 or splits == 1
    # the long cache of the benchmark (8 KV heads): within a block per SM of the target
    splits, _ = decode.num_splits(8, 131072, 132, 8, blocks_per_sm=blocks, one_wave=one_wave)
    assert blocks * 132 - 8 < 8 * splits <= blocks * 132 + 8


def test_plans_and_declines():
    assert decode.decode_plan("float16", 80, 64).head_dim == 128
    assert decode.decode_plan("float32", 60, 64) is None  # not a multiple of 8
    assert decode.decode_plan("float64", 264, 8) is None
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in decode.HEAD_DIMS:
            p = decode.decode_plan(kind, d, d)
            assert p.smem <= 48 * 1024  # no opt-in needed
            p2 = decode.decode_plan(kind, d, d, 8, variant="v2")
            assert p2.smem <= 48 * 1024 and p2.merge_smem <= 48 * 1024
    names = decode.COMPILE_VARIANTS[decode.SOURCE]
    v1 = [n for n in names if "_v2<" not in n]
    assert len(v1) == len(set(v1)) == 75  # rows 1/2/4/8 (float64 up to 4, 2 at 256)
    # v2: 16-bit kinds at every D (16 splits + 4 merges each), float32/64 at D = 128 only
    assert len(names) == len(set(names)) == 75 + 2 * 20 + (4 + 1) + (3 + 1)
    assert set(decode.HOT_VARIANTS) <= set(names)
    for variant in decode.VARIANTS:
        assert decode.decode_plan("float16", 64, 64, 3, variant=variant).rows == 4
        assert decode.decode_plan("float64", 64, 64, 32, variant=variant).rows == 4
        assert decode.decode_plan("float64", 256, 256, 32, variant=variant).rows == 2


def test_variant_switch(monkeypatch):
    """ARRAYATTN_DECODE_VARIANT picks the kernels; unset is v2 (measured faster on an
    H200), anything else but v1/v2 is a clear error."""
    monkeypatch.delenv("ARRAYATTN_DECODE_VARIANT", raising=False)
    assert decode.decode_variant() == decode.DEFAULT_VARIANT == "v2"
    assert decode.decode_plan("float16", 128, 128, 4).variant == "v2"
    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", "v1")
    v1 = decode.decode_plan("float16", 128, 128, 4)
    assert decode.decode_variant() == "v1" and v1.variant == "v1"
    assert (v1.split, v1.merge) == ("aa_decode_split<AaF16, 128, 4>", "aa_decode_merge<AaF16, 128>")
    assert (v1.blocks_per_sm, v1.merge_rows, v1.merge_smem) == (2, decode.WARPS, 0)
    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", "v2")
    v2 = decode.decode_plan("float16", 128, 128, 4)
    assert v2.variant == "v2" and v2.split == "aa_decode_split_v2<AaF16, 128, 4>"
    assert v2.merge == "aa_decode_merge_v2<AaF16, 128>" and v2.merge_rows == 1
    assert (v2.threads, v2.smem, v2.keys_per_step) == (v1.threads, v1.smem, v1.keys_per_step)
    assert v2.blocks_per_sm == 3  # AaDec2Occ: 4 rows x 8 dims of float state per lane
    assert decode.decode_plan("float16", 128, 128, 4, variant="v1") == v1
    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", "v3")
    with pytest.raises(ValueError, match="ARRAYATTN_DECODE_VARIANT"):
        decode.decode_plan("float16", 128, 128, 4)
    with pytest.raises(ValueError, match="variant"):
        decode.decode_plan("float16", 128, 128, 4, variant="v9")


# -- data races: the emulator built with ThreadSanitizer, run in a child process that
# preloads libtsan (as test_backward_emulated.py does); the kernels' barriers order the
# warps' shared-memory partials before the block merges them (v1: the split kernel's one;
# v2: its split kernel's and its merge kernel's). The no-race check runs the case on every
# variant; a missing-barrier check runs it on the variant whose kernel holds the barrier.
# The race case is f16_paged_window_softcap_sinks_alibi at half the keys (every one of its
# options, fewer split blocks: each CUDA thread is an OS thread under ThreadSanitizer).
RACE_CASE = "tsan_f16_paged_window_softcap_sinks_alibi"
RACE_CASES = {
    RACE_CASE: dict(CASES["f16_paged_window_softcap_sinks_alibi"], S=100, kv_lens=(100, 5, 0)),
}


def _race_names() -> list[str]:
    names = []
    for variant in decode.VARIANTS:
        plan = _plan(RACE_CASE, variant)
        names += [plan.split, plan.merge]
    return names


def _barrier_variant(site: int) -> str:
    """The kernel variant whose kernels hold barrier ``site`` of decode_attn.cu (the v1
    kernels come first in the file, then v2's, from ``aa_decode_split_v2``)."""
    text = (tsan.KERNELS / decode.SOURCE).read_text()
    return (
        "v2"
        if tsan.barrier_offsets(decode.SOURCE)[site] > text.index("aa_decode_split_v2(")
        else "v1"
    )


def _run_under_tsan(lib, skip_barrier: int | None = None):
    """``_decode_tsan_run.py`` in a child with libtsan preloaded, on every variant;
    ``skip_barrier``: run a switchable build without that barrier, on the barrier's variant
    only, stopping at the first report."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, LD_PRELOAD=tsan.libtsan(emu.compiler() or "g++") or "")
    env.pop(tsan.SKIP_BARRIER, None)
    if skip_barrier is not None:
        env = tsan.skip_barrier_env(skip_barrier, env)
    script = Path(__file__).resolve().parent / "_decode_tsan_run.py"
    variants = ",".join(
        decode.VARIANTS if skip_barrier is None else [_barrier_variant(skip_barrier)]
    )
    return subprocess.run([sys.executable, str(script), str(lib), RACE_CASE, variants],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def tsan_work(tmp_path_factory):
    tsan.require_python_tsan(emu.compiler() or "g++")
    return tmp_path_factory.mktemp("decode_tsan")


def test_decode_kernels_have_no_data_race(tsan_work):
    lib = emu.compile_library(_race_names(), tsan_work, tsan.FLAGS, kernel_file=decode.SOURCE)
    res = _run_under_tsan(lib)
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


@pytest.fixture(scope="module")
def switchable_library(tsan_work):
    """The race case's ThreadSanitizer build from a copy of the kernels whose barriers
    ``AA_EMU_SKIP_BARRIER`` switches off one at a time: one compile for every site."""
    kdir = tsan.kernels_with_switchable_barriers(decode.SOURCE, tsan_work / "switchable")
    return emu.compile_library(_race_names(), tsan_work, tsan.FLAGS, kernels_dir=kdir,
                               kernel_file=decode.SOURCE)  # fmt: skip


@pytest.mark.parametrize("site", range(len(tsan.barrier_offsets(decode.SOURCE))))
def test_race_check_catches_every_missing_barrier(switchable_library, site):
    """Deleting any one ``__syncthreads()`` of decode_attn.cu makes the race check fail;
    every site in a run of its own (``AA_EMU_SKIP_BARRIER=site``, see ``_tsan.py``)."""
    res = _run_under_tsan(switchable_library, skip_barrier=site)
    assert tsan.REPORT in res.stderr, f"barrier {site} removed, yet no race was reported"


# -- the fused implementation's decode: fused.py -> decode.forward, "cupy" played by NumPy --
def _fake_cupy():
    import types

    m = types.ModuleType("cupy")
    m.ndarray = type("NotACupyArray", (), {})
    for name in ("zeros", "full", "concatenate", "ascontiguousarray", "broadcast_to", "asarray"):
        setattr(m, name, getattr(np, name))
    m.empty = emu.PoisonXp.empty
    for name in ("float16", "float32", "float64", "int32", "uint8", "bool_"):
        setattr(m, name, getattr(np, name))
    m.int16, m.dtype, m.from_dlpack = np.int16, np.dtype, np.from_dlpack  # the bridge's
    device = types.SimpleNamespace(id=0, compute_capability="90", __enter__=None)
    m.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0), Device=lambda i=0: device
    )
    return m


GLUE = {
    # name: (dtype, q shape, k shape, v shape, options)
    "gqa_decode_bottom_right_lengths": ("float16", (2, 8, 1, 64), (2, 2, 300, 64),
                                        (2, 2, 300, 64),
                                        dict(is_causal=True, causal_align="bottom_right",
                                             kv_lengths=np.array([300, 131]))),
    "speculative_rows_sinks_alibi_softcap": ("float32", (1, 4, 5, 128), (1, 4, 200, 128),
                                             (1, 4, 200, 128),
                                             dict(is_causal=True, causal_align="bottom_right",
                                                  sinks=True, alibi=True, softcap=4.0)),
    "strided_query_kv_broadcast_e_ne_ev": ("float64", (2, 3, 2, 40), (1, 3, 150, 40),
                                          (1, 3, 150, 24), dict(window=(20, -1),
                                                                q_bshd=True)),
    "top_left_causal_mqa": ("float32", (1, 8, 2, 32), (1, 1, 129, 32), (1, 1, 129, 32),
                            dict(is_causal=True)),
}  # fmt: skip


_TORCH_PLAN = ("bfloat16", 64, 64, 4)  # test_torch_bfloat16_decode_through_the_dlpack_bridge


@pytest.fixture(scope="module")
def glue_library(tmp_path_factory):
    """One emulator library with the split and merge kernels of every GLUE case on every
    variant (as decode_plan picks them from the spec's E, Ev, G * L) and of the torch test,
    one compile for those tests; each test still checks the plan it launched."""
    names = set()
    for kind, qs, ks, vs, _ in GLUE.values():
        for variant in decode.VARIANTS:
            plan = decode.decode_plan(kind, qs[3], vs[3], qs[1] // ks[1] * qs[2],
                                      variant=variant)  # fmt: skip
            names |= {plan.split, plan.merge}
    for variant in decode.VARIANTS:
        plan = decode.decode_plan(*_TORCH_PLAN, variant=variant)
        names |= {plan.split, plan.merge}
    return emu.build(sorted(names), tmp_path_factory.mktemp("glue"), kernel_file=decode.SOURCE)


@pytest.mark.parametrize("variant", decode.VARIANTS)
@pytest.mark.parametrize("case", list(GLUE))
def test_fused_forward_runs_decode_kernels(monkeypatch, glue_library, case, variant):
    import sys

    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", variant)  # read by decode.forward's plan

    from arrayattn.attention import composed as _composed
    from arrayattn.attention.cuda import fused
    from arrayattn.attention.spec import make_spec

    kind, qs, ks, vs, opts = GLUE[case]
    opts = dict(opts)
    rng = np.random.default_rng(3)
    dt = np.dtype(kind)
    q = rng.standard_normal(qs).astype(dt)
    if opts.pop("q_bshd", False):  # a (B, L, H, E) buffer seen as (B, H, L, E)
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    k, v = rng.standard_normal(ks).astype(dt), rng.standard_normal(vs).astype(dt)
    extra = {}
    if opts.pop("sinks", False):
        extra["sinks"] = rng.standard_normal(qs[1]).astype(dt)
    if opts.pop("alibi", False):
        extra["alibi_slopes"] = rng.uniform(0.1, 0.5, qs[1]).astype(dt)
    if "kv_lengths" in opts:
        extra["kv_lengths"] = opts.pop("kv_lengths")
    spec = make_spec(q, k, v, None, 0.0, opts.pop("is_causal", False), None, True,
                     opts.pop("causal_align", "top_left"), opts.pop("window", None),
                     opts.pop("softcap", None), None, **extra)  # fmt: skip
    assert not opts and decode.declines(spec, False) is None
    plan = decode.decode_plan(kind, spec.E, spec.Ev, spec.G * spec.L)
    assert plan.variant == variant
    launcher = emu.Launcher(glue_library, strided=True)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(decode, "_cupy_launch", launcher)
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    out, lse = fused.FUSED.forward(spec, q, k, v, None)
    assert [name for name, *_ in launcher.launches] == [plan.split, plan.merge]
    ref_out, ref_lse = _composed.forward(spec, q, k, v, None)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == ref_lse.dtype
    tol = {"float16": 3e-3, "float32": 2e-6, "float64": 1e-12}[kind]
    np.testing.assert_allclose(out.astype(np.float64), ref_out.astype(np.float64),
                               rtol=tol, atol=tol)  # fmt: skip
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5 if kind != "float64" else 1e-12)


def test_torch_bfloat16_decode_through_the_dlpack_bridge(monkeypatch, glue_library):
    """A decode-shaped call on PyTorch bfloat16 tensors: int16 storage into the decode
    kernels, a bfloat16 tensor back (CPU tensors play CUDA ones, NumPy plays CuPy)."""
    import contextlib
    import sys
    import types

    torch = pytest.importorskip("torch")
    import array_api_compat

    from arrayattn._backend import CupyBridge
    from arrayattn.attention import composed as _composed
    from arrayattn.attention.cuda import _bridge, fused
    from arrayattn.attention.spec import make_spec

    plan = decode.decode_plan(*_TORCH_PLAN)
    launcher = emu.Launcher(glue_library, strided=True)
    cp = _fake_cupy()
    cp.cuda.Device = lambda i=0: contextlib.nullcontext(types.SimpleNamespace(id=i))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    fake_cxp = types.ModuleType("array_api_compat.cupy")  # is_cupy_namespace: by name
    monkeypatch.setitem(sys.modules, "array_api_compat.cupy", fake_cxp)
    monkeypatch.setattr(decode, "_cupy_launch", launcher)
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    monkeypatch.setattr(
        _bridge, "cupy_bridge",
        lambda xp, device, *a: CupyBridge("torch") if array_api_compat.is_torch_namespace(xp)
        else None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 1, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 2, 400, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 400, 64, generator=g).to(torch.bfloat16)
    args = (None, 0.0, True, None, True, "bottom_right", None, None, None)
    spec = make_spec(q, k, v, *args)
    out, lse = fused.FUSED.forward(spec, q, k, v, None)
    assert [name for name, *_ in launcher.launches] == [plan.split, plan.merge]
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    f32 = [x.float() for x in (q, k, v)]
    ref, ref_lse = _composed.forward(make_spec(*f32, *args), *f32, None)
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert float((lse - ref_lse).abs().max()) <= 1e-4
