"""The backward kernels' block schedule and reduction order, modelled in NumPy.

``arrayattn/attention/cuda/backward.py`` mirrors the loops of ``attn_bwd.cu``
(:func:`row_range`, :func:`dkdv_schedule`, :func:`dq_schedule`). These tests check, on the
CPU and without a GPU:

1. coverage: for every key block the visited query blocks hold every allowed (i, j) of
   the block, and blocks declared "full" (element mask skipped) are entirely allowed;
   the same for the deterministic dQ kernel's key blocks;
2. the Python mirrors equal the C++ helpers (compiled through the host emulator);
3. a float64 NumPy model that follows exactly the kernels' schedule and reduction order
   (key block -> query heads of the GQA group -> query blocks; dQ by accumulation over
   key blocks, or per query block in key order for deterministic mode) gives the same
   gradients as the composed backward (``implementation="composed"``).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention.cuda.backward import dkdv_schedule, dq_schedule, row_range
from arrayattn.attention.cuda.tiles import allowed as allowed_one
from arrayattn.attention.cuda.tiles import block_full, key_range
from arrayattn.attention.dropout import dropout_keep


def structure_mask(L, S, q_len, kv_len, offset, left, right, rows_valid=True) -> np.ndarray:
    """SEMANTICS.md's rule over the whole grid (rows past q_len excluded unless asked)."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ok = j < kv_len
    if rows_valid:
        ok = ok & (i < q_len)
    if left >= 0:
        ok = ok & (j >= i + offset - left)
    if right >= 0:
        ok = ok & (j <= i + offset + right)
    return np.broadcast_to(ok, (L, S))


geometry = st.tuples(
    st.integers(1, 70),  # L
    st.integers(1, 70),  # S
    st.integers(0, 70),  # q_len (clipped to L)
    st.integers(0, 70),  # kv_len (clipped to S)
    st.booleans(),  # bottom-right
    st.integers(-1, 20),  # left
    st.integers(-1, 20),  # right
    st.sampled_from([8, 16, 32]),  # BN
    st.sampled_from([8, 16, 32]),  # BM
)


@settings(max_examples=400, deadline=None)
@given(geometry)
def test_dkdv_schedule_covers_allowed_pairs(g):
    L, S, q_len, kv_len, br, left, right, bn, bm = g
    q_len, kv_len = min(q_len, L), min(kv_len, S)
    offset = kv_len - q_len if br else 0
    ref = structure_mask(L, S, q_len, kv_len, offset, left, right)
    struct = structure_mask(L + 64, S, q_len, kv_len, offset, left, right, rows_valid=False)
    for c0 in range(0, S, bn):
        c1 = min(c0 + bn, S)
        visited = np.zeros(L, dtype=bool)
        blocks = dkdv_schedule(c0, bn, bm, q_len, kv_len, offset, left, right)
        starts = [m0 for m0, _ in blocks]
        assert starts == sorted(set(starts))
        for m0, full in blocks:
            assert 0 <= m0 < max(q_len, 1)
            visited[m0 : m0 + bm] = True
            if full:  # rows past q_len are zeroed by LSE = +inf, not by the mask
                assert struct[m0 : m0 + bm, c0 : c0 + bn].all()
                assert c0 + bn <= kv_len
        needed = ref[:, c0:c1].any(axis=1)
        assert not (needed & ~visited[:L]).any(), f"rows missed for key block {c0}"


@settings(max_examples=400, deadline=None)
@given(geometry)
def test_dq_schedule_covers_allowed_pairs(g):
    L, S, q_len, kv_len, br, left, right, bn, bm = g
    q_len, kv_len = min(q_len, L), min(kv_len, S)
    offset = kv_len - q_len if br else 0
    ref = structure_mask(L, S, q_len, kv_len, offset, left, right)
    struct = structure_mask(L + 64, S + 64, q_len, kv_len, offset, left, right, False)
    for m0 in range(0, L, bm):
        visited = np.zeros(S + bn, dtype=bool)
        for c0, full in dq_schedule(m0, bm, bn, q_len, kv_len, offset, left, right):
            assert 0 <= c0 < max(kv_len, 1)
            visited[c0 : c0 + bn] = True
            if full:
                assert struct[m0 : m0 + bm, c0 : c0 + bn].all() and c0 + bn <= kv_len
        needed = ref[m0 : m0 + bm].any(axis=0)
        assert not (needed & ~visited[:S]).any(), f"keys missed for query block {m0}"


def test_row_range_is_tight_inverse_of_key_range():
    """Exhaustive small grid: row_range gives exactly the rows whose key_range meets the
    key block (no block visited that key_range would not visit)."""
    for off in (-3, 0, 4):
        for left in (-1, 0, 2):
            for right in (-1, 0, 3):
                for c0 in range(0, 12):
                    for c1 in range(c0, 13):
                        lo, hi = row_range(c0, c1, off, left, right, 12)
                        rows = [
                            i for i in range(12)
                            if any(allowed_one(i, j, off, left, right, 10**6)
                                   for j in range(c0, c1))
                        ]  # fmt: skip
                        want = (rows[0], rows[-1] + 1) if rows else None
                        got = (lo, hi) if hi > lo else None
                        assert got == want, (off, left, right, c0, c1)


# -- the mirrors against the C++ helpers ---------------------------------------------------
@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    emu = pytest.importorskip("_backward_emu")
    if emu.compiler() is None or emu.cuda_include() is None:
        pytest.skip("needs g++ and the CUDA headers for the host emulator")
    return emu.build([], tmp_path_factory.mktemp("bwd_sched"))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(-5, 40), st.integers(-5, 40), st.integers(-30, 30), st.integers(-1, 9),
    st.integers(-1, 9), st.integers(0, 40),
)  # fmt: skip
def test_mirrors_equal_cpp_helpers(cpp, a, b, off, left, right, n):
    out = (ctypes.c_int * 2)()
    cpp.aa_emu_row_range(a, b, off, left, right, n, out)
    assert tuple(out) == row_range(a, b, off, left, right, n)
    cpp.aa_emu_key_range(a, b, off, left, right, n, out)
    assert tuple(out) == key_range(a, b, off, left, right, n)
    for c0 in (0, 5, 17):
        assert bool(cpp.aa_emu_block_full(a, b, c0, c0 + 8, off, left, right, n)) == block_full(
            a, b, c0, c0 + 8, off, left, right, n
        )


# -- a float64 model of the kernels' algorithm ---------------------------------------------
LOG2E = 1.4426950408889634


def _tile_grads(qt, kt, vt, dot, lse2, delta, rows, cols, full, seq, opts, b, h):
    """One (query block x key block) tile as aa_bwd_element computes it: returns the
    dropped probabilities (for dV) and dS (scale and softcap chain applied)."""
    q_len, kv_len, offset = seq
    left, right = opts["window"]
    s = (qt @ kt.T) * opts["scale"]
    chain = 1.0
    if opts["softcap"]:
        t = np.tanh(s / opts["softcap"])
        s = opts["softcap"] * t
        chain = 1.0 - t * t
    i, j = rows[:, None], cols[None, :]
    if full:
        ok = np.ones(s.shape, dtype=bool)
    else:
        ok = (j < kv_len) & np.ones(s.shape, dtype=bool)
        if left >= 0:
            ok &= j >= i + offset - left
        if right >= 0:
            ok &= j <= i + offset + right
    with np.errstate(invalid="ignore"):
        p = np.where(ok, np.exp2(s * LOG2E - lse2[:, None]), 0.0)
    dp = dot @ vt.T
    if opts["dropout_p"] > 0:
        keep = dropout_keep(
            np, opts["seed"], opts["dropout_p"], np.int32(b), np.int32(h),
            rows.astype(np.int32)[:, None], cols.astype(np.int32),
        )  # fmt: skip
        inv = 1.0 / (1.0 - opts["dropout_p"])
        pd = np.where(keep, p * inv, 0.0)
        dp = np.where(keep, dp * inv, 0.0)
    else:
        pd = p
    ds = p * (dp - delta[:, None]) * chain * opts["scale"]
    return pd, ds


def model_backward(q, k, v, out, d_out, lse, d_lse, q_lens, kv_lens, opts, tiles,
                   deterministic):  # fmt: skip
    """The kernels' algorithm in float64, block by block in their order."""
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    bn, bm, qbm, qbn = tiles
    delta = (d_out * out).sum(-1) - (0.0 if d_lse is None else d_lse)
    lse2 = np.where(np.isneginf(lse), np.inf, lse * LOG2E)
    pad = max(bm, qbm)
    qp = np.concatenate([q, np.zeros((B, Hq, pad, E))], axis=2)
    dop = np.concatenate([d_out, np.zeros((B, Hq, pad, Ev))], axis=2)
    kp = np.concatenate([k, np.zeros((B, Hkv, max(bn, qbn), E))], axis=2)
    vp = np.concatenate([v, np.zeros((B, Hkv, max(bn, qbn), Ev))], axis=2)
    dq = np.zeros((B, Hq, L + pad, E))
    dk = np.zeros((B, Hkv, S, E))
    dv = np.zeros((B, Hkv, S, Ev))
    for b in range(B):
        q_len = L if q_lens is None else min(int(q_lens[b]), L)
        kv_len = S if kv_lens is None else min(int(kv_lens[b]), S)
        offset = kv_len - q_len if opts["bottom_right"] else 0
        seq = (q_len, kv_len, offset)
        left, right = opts["window"]

        def stats(h, rows, b=b, q_len=q_len):
            """Rows' lse2 and delta as aa_bwd_load_stats loads them (+inf / 0 past q_len)."""
            valid = rows < q_len
            lse_r = np.where(valid, lse2[b, h, np.minimum(rows, L - 1)], np.inf)
            return lse_r, np.where(valid, delta[b, h, np.minimum(rows, L - 1)], 0.0)

        for hk in range(Hkv):
            for c0 in range(0, S, bn):
                cols = np.arange(c0, c0 + bn)
                kt, vt = kp[b, hk, c0 : c0 + bn], vp[b, hk, c0 : c0 + bn]
                acc_k = np.zeros((bn, E))
                acc_v = np.zeros((bn, Ev))
                for h in range(hk * G, hk * G + G):
                    for m0, full in dkdv_schedule(c0, bn, bm, q_len, kv_len, offset, left, right):
                        rows = np.arange(m0, m0 + bm)
                        qt, dot = qp[b, h, m0 : m0 + bm], dop[b, h, m0 : m0 + bm]
                        lse_r, delta_r = stats(h, rows)
                        pd, ds = _tile_grads(qt, kt, vt, dot, lse_r, delta_r, rows, cols, full,
                                             seq, opts, b, h)  # fmt: skip
                        acc_v += pd.T @ dot
                        acc_k += ds.T @ qt
                        if not deterministic:
                            valid = (rows < q_len)[:, None]
                            dq[b, h, m0 : m0 + bm] += np.where(valid, ds @ kt, 0.0)
                n = min(bn, S - c0)
                dk[b, hk, c0 : c0 + n] = acc_k[:n]
                dv[b, hk, c0 : c0 + n] = acc_v[:n]
        if deterministic:
            for h in range(Hq):
                hk = h // G
                for m0 in range(0, L, qbm):
                    rows = np.arange(m0, m0 + qbm)
                    qt, dot = qp[b, h, m0 : m0 + qbm], dop[b, h, m0 : m0 + qbm]
                    lse_r, delta_r = stats(h, rows)
                    acc = np.zeros((qbm, E))
                    for c0, full in dq_schedule(m0, qbm, qbn, q_len, kv_len, offset, left, right):
                        cols = np.arange(c0, c0 + qbn)
                        kt, vt = kp[b, hk, c0 : c0 + qbn], vp[b, hk, c0 : c0 + qbn]
                        _, ds = _tile_grads(qt, kt, vt, dot, lse_r, delta_r, rows, cols, full,
                                            seq, opts, b, h)  # fmt: skip
                        acc += ds @ kt
                    dq[b, h, m0 : m0 + qbm] = acc
    return dq[:, :, :L], dk, dv


CASES = [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_align="bottom_right"),
    dict(window=(7, 2)),
    dict(window=(5, -1), is_causal=True, causal_align="bottom_right", lengths=True),
    dict(softcap=3.0, lengths=True),
    dict(dropout_p=0.25, seed=99, is_causal=True),
    dict(is_causal=True, d_lse=True, lengths=True),
]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_model_matches_composed_backward(case, deterministic):
    c = dict(CASES[case])
    rng = np.random.default_rng(case)
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 29, 41, 8, 6
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    lengths = c.pop("lengths", False)
    use_dlse = c.pop("d_lse", False)
    q_lens = np.array([L, 11], dtype=np.int32) if lengths else None
    kv_lens = np.array([S - 9, 30], dtype=np.int32) if lengths else None
    extra = dict(q_lengths=q_lens, kv_lengths=kv_lens) if lengths else {}
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, enable_gqa=True, return_lse=True,
        implementation="composed", **c, **extra,
    )  # fmt: skip
    d_out = rng.standard_normal(out.shape)
    d_lse = rng.standard_normal(lse.shape) if use_dlse else None
    want = pullback((d_out, d_lse))

    right = (c.get("window") or (-1, -1))[1]
    if c.get("is_causal"):
        right = 0 if right < 0 else min(right, 0)
    opts = dict(
        scale=1.0 / math.sqrt(E),
        softcap=c.get("softcap"),
        window=((c.get("window") or (-1, -1))[0], right),
        bottom_right=c.get("causal_align") == "bottom_right" and (S != L or lengths),
        dropout_p=c.get("dropout_p", 0.0),
        seed=c.get("seed", 0),
    )
    got = model_backward(q, k, v, out, d_out, lse, d_lse, q_lens, kv_lens, opts,
                         tiles=(16, 8, 8, 16), deterministic=deterministic)  # fmt: skip
    for name, g, w in zip(("dq", "dk", "dv"), got, want[:3], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)


# -- the kernel variant switch (ARRAYATTN_BWD_VARIANT) --------------------------------------
def test_variant_switch_reads_the_environment(monkeypatch):
    from arrayattn.attention.cuda import backward as bwd

    monkeypatch.delenv("ARRAYATTN_BWD_VARIANT", raising=False)
    assert bwd.bwd_variant() == bwd.DEFAULT_VARIANT == "v4"  # measured faster on an H100
    assert bwd.backward_plan("float16", 128, 128).variant == "v4"
    for raw, want in (("", "v4"), ("v1", "v1"), ("v2", "v2"), (" V2 ", "v2"), ("V1", "v1"),
                      ("v3", "v3"), ("V3 ", "v3"), ("v4", "v4"), (" V4", "v4")):  # fmt: skip
        monkeypatch.setenv("ARRAYATTN_BWD_VARIANT", raw)
        assert bwd.bwd_variant() == want
        assert bwd.backward_plan("bfloat16", 64, 64).variant == want
    monkeypatch.setenv("ARRAYATTN_BWD_VARIANT", "v5")
    with pytest.raises(ValueError, match="ARRAYATTN_BWD_VARIANT must be one of"):
        bwd.bwd_variant()
    with pytest.raises(ValueError, match="ARRAYATTN_BWD_VARIANT"):
        bwd.backward_plan("float16", 64, 64)
    with pytest.raises(ValueError, match="variant must be one of"):
        bwd.backward_plan("float16", 64, 64, variant="fast")


@pytest.mark.parametrize(
    "kind,e,ev,want",
    [
        ("float16", 128, 128, "v2"),
        ("bfloat16", 64, 64, "v2"),
        ("float16", 120, 112, "v2"),  # padded into D = 128
        ("float16", 80, 80, "v1"),  # D = 96
        ("float16", 56, 64, "v2"),  # E != Ev
        ("float16", 60, 64, "v1"),  # E not a multiple of 8: no 16-byte copies
        ("float16", 32, 32, "v1"),  # head dims without v2 kernels
        ("float16", 96, 96, "v1"),
        ("bfloat16", 256, 256, "v1"),
        ("float32", 64, 64, "v1"),  # CUDA-core kinds
        ("float64", 128, 128, "v1"),
    ],
)
def test_v2_plan_and_what_it_leaves_to_v1(kind, e, ev, want):
    from arrayattn.attention.cuda import backward as bwd

    plan = bwd.backward_plan(kind, e, ev, variant="v2")
    assert plan.variant == want
    if want == "v1":  # exactly v1's plan, nothing of v2's
        assert plan == bwd.backward_plan(kind, e, ev, variant="v1")
    else:
        assert "_mma2<" in plan.dkdv and "_mma2<" in plan.dq
        assert plan.dkdv in bwd.COMPILE_VARIANTS["attn_bwd.cu"]
        assert plan.dq in bwd.COMPILE_VARIANTS["attn_bwd.cu"]
        assert plan.dkdv in bwd.HOT_VARIANTS and plan.dq in bwd.HOT_VARIANTS
        assert plan.dkdv_smem <= 227 * 1024 and plan.dq_smem <= 227 * 1024


@pytest.mark.parametrize(
    "kind,e,ev,want",
    [
        ("float16", 64, 64, "v3"),
        ("bfloat16", 56, 64, "v3"),  # padded into D = 64
        ("float16", 48, 40, "v3"),
        ("float16", 128, 128, "v2"),  # D = 128: v2's kernels
        ("bfloat16", 120, 112, "v2"),
        ("float16", 60, 64, "v1"),  # E % 8 != 0: no 16-byte copies
        ("float16", 32, 32, "v1"),  # D = 32
        ("float16", 80, 80, "v1"),  # D = 96
        ("bfloat16", 256, 256, "v1"),
        ("float32", 64, 64, "v1"),  # CUDA-core kinds
    ],
)
def test_v3_plan_and_what_it_declines_to(kind, e, ev, want):
    """v3 has its own dK/dV kernel at head dim 64 (16-bit kinds, E and Ev multiples of 8)
    with v2's deterministic dQ; anything else gets exactly v2's plan (or v1's, as v2)."""
    from arrayattn.attention.cuda import backward as bwd

    plan = bwd.backward_plan(kind, e, ev, variant="v3")
    assert plan.variant == want
    if want != "v3":
        assert plan == bwd.backward_plan(kind, e, ev, variant="v2")
        return
    v2 = bwd.backward_plan(kind, e, ev, variant="v2")
    assert plan.dkdv.startswith("aa_bwd_dkdv_mma3<") and plan.dq == v2.dq
    assert (plan.preprocess, plan.convert, plan.dq_smem) == (v2.preprocess, v2.convert, v2.dq_smem)
    assert plan.dkdv_block_n == 128 and plan.dkdv_block_m == 128
    assert bwd.kernel_file(plan.dkdv) == "attn_bwd_v3.cu" == bwd.SOURCE_V3
    assert plan.dkdv in bwd.COMPILE_VARIANTS["attn_bwd_v3.cu"]
    assert plan.dkdv not in bwd.COMPILE_VARIANTS["attn_bwd.cu"]
    assert plan.dkdv in bwd.HOT_VARIANTS
    # K, V; two stages of 128-row Q, dO; dS^T (128 x 136); two stages of lse2, delta
    assert plan.dkdv_smem == (2 * 128 * 72 + 4 * 128 * 72 + 128 * 136) * 2 + 4 * 128 * 4
    assert plan.dkdv_smem <= 227 * 1024


@pytest.mark.parametrize(
    "kind,e,ev,want",
    [
        ("float16", 64, 64, "v4"),
        ("bfloat16", 56, 64, "v4"),  # padded into D = 64
        ("float16", 128, 128, "v4"),
        ("bfloat16", 120, 112, "v4"),  # padded into D = 128
        ("float16", 60, 64, "v1"),  # E % 8 != 0: no 16-byte copies
        ("float16", 32, 32, "v1"),  # D = 32
        ("float16", 80, 80, "v1"),  # D = 96
        ("bfloat16", 256, 256, "v1"),
        ("float32", 64, 64, "v1"),  # CUDA-core kinds
        ("float64", 128, 128, "v1"),
    ],
)
def test_v4_plan_and_what_it_declines_to(kind, e, ev, want, monkeypatch):
    """v4 has its own dK/dV kernel at head dims 64 and 128 (16-bit kinds, E and Ev multiples
    of 8) with v2's deterministic dQ; anything else gets exactly v2's plan (or v1's, as v2);
    block masks get v4's FLEX dK/dV kernel beside v2's FLEX dQ kernel. (Head dim 256's
    tensor-core plan, the default: test_backward_emulated_d256.py; off here.)"""
    from arrayattn.attention.cuda import backward as bwd

    monkeypatch.setenv(bwd.D256_TC_ENV, "0")

    plan = bwd.backward_plan(kind, e, ev, variant="v4")
    assert plan.variant == want
    if want != "v4":
        assert plan == bwd.backward_plan(kind, e, ev, variant="v2")
        assert bwd.flex_plan(kind, e, ev, variant="v4") == bwd.flex_plan(kind, e, ev, "v2")
        return
    v2 = bwd.backward_plan(kind, e, ev, variant="v2")
    assert plan.dkdv.startswith("aa_bwd_dkdv_mma4<") and plan.dq == v2.dq
    assert (plan.preprocess, plan.convert, plan.dq_smem) == (v2.preprocess, v2.convert, v2.dq_smem)
    assert plan.dkdv_block_n == 128 and plan.dkdv_threads == 256
    assert bwd.kernel_file(plan.dkdv) == "attn_bwd_v4.cu" == bwd.SOURCE_V4
    assert plan.dkdv in bwd.COMPILE_VARIANTS["attn_bwd_v4.cu"]
    assert plan.dkdv not in bwd.COMPILE_VARIANTS["attn_bwd.cu"]
    assert plan.dkdv in bwd.HOT_VARIANTS
    d, bm, bn = plan.head_dim, plan.dkdv_block_m, plan.dkdv_block_n
    # K, V; two stages of Q, dO; P^T and dS^T (bn x (bm + 8)); two stages of lse2, delta
    assert plan.dkdv_smem == (2 * bn * (d + 8) + 4 * bm * (d + 8) + 2 * bn * (bm + 8)) * 2 + (
        4 * bm * 4
    )
    assert plan.dkdv_smem <= 227 * 1024
    flex, flex2 = bwd.flex_plan(kind, e, ev, variant="v4"), bwd.flex_plan(kind, e, ev, "v2")
    assert flex.dkdv == plan.dkdv[:-1] + ", true>" and flex.dq == flex2.dq
    assert flex.dkdv in bwd.COMPILE_VARIANTS["attn_bwd_v4.cu"] and flex.dkdv in bwd.HOT_VARIANTS
    assert (flex.dkdv_block_m, flex.dkdv_block_n, flex.dkdv_smem) == (bm, bn, plan.dkdv_smem)


@pytest.mark.parametrize("d,variant", [(64, "v2"), (128, "v2"), (64, "v4"), (128, "v4")])
def test_v2_tiles_cover_allowed_pairs(d, variant):
    """v2's and v4's tiles (128 keys per block; 64-row query steps, v4 128 at D = 64)
    through the same schedule mirrors, at sizes where several of each meet
    causal/window/length edges."""
    from arrayattn.attention.cuda import backward as bwd

    plan = bwd.backward_plan("float16", d, d, variant=variant)
    bn, bm = plan.dkdv_block_n, plan.dkdv_block_m
    rng = np.random.default_rng(d)
    for _ in range(60):
        L, S = (int(x) for x in rng.integers(1, 400, 2))
        q_len, kv_len = int(rng.integers(0, L + 1)), int(rng.integers(0, S + 1))
        left, right = (int(x) for x in rng.integers(-1, 150, 2))
        offset = kv_len - q_len if rng.random() < 0.5 else 0
        ref = structure_mask(L, S, q_len, kv_len, offset, left, right)
        for c0 in range(0, S, bn):
            visited = np.zeros(L + bm, dtype=bool)
            for m0, _ in dkdv_schedule(c0, bn, bm, q_len, kv_len, offset, left, right):
                visited[m0 : m0 + bm] = True
            needed = ref[:, c0 : c0 + bn].any(axis=1)
            assert not (needed & ~visited[:L]).any()
