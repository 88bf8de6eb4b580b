"""Block masks (``arrayattn.flex``) in the backward kernels, on the CPU: the ``FLEX``
instantiations of v4 (``aa_bwd_dkdv_mma4`` beside v2's dQ kernel), of v2
(``aa_bwd_dkdv_mma2`` / ``aa_bwd_dq_mma2``) and of the CUDA-core
kernels (``aa_bwd_*_simt``) run on the host emulator (``backward_emulator.h``) with the
block table of ``cuda/flex_table.py`` (the dQ kernels walk the forward's lists, the dK/dV
kernels the transposed ones), against the float64 dense reference; the host glue
(``ARRAYATTN_FLEX_BWD_KERNELS``, ``backward.declines``, ``fused.FusedAttention.backward``);
v4 FLEX bit for bit against v2 FLEX in deterministic mode; and ThreadSanitizer runs of
the v2 and v4 FLEX kernels. Nothing here has run on a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _backward_emu as emu  # noqa: E402
from _backward_reference import reference  # noqa: E402

from arrayattn.attention import block_mask as bmod  # noqa: E402
from arrayattn.attention.cuda import backward as kb  # noqa: E402
from arrayattn.attention.cuda import flex_table  # noqa: E402
from arrayattn.attention.cuda.backward import (  # noqa: E402
    SOURCE_V4,
    flex_plan,
    flex_plan_for,
    run_kernels,
)
from arrayattn.flex import create_block_mask  # noqa: E402

TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-2, "bfloat16": 5e-2}


def _to_kernel(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float16":
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint16)
    if kind == "bfloat16":  # round to nearest even on the top 16 bits
        u = np.ascontiguousarray(x.astype(np.float32)).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.ascontiguousarray(x.astype(np.float64 if kind == "float64" else np.float32))


def _from_kernel(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float16":
        return x.view(np.float16).astype(np.float64)
    if kind == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _dense(bm, B: int, Hq: int, L: int, S: int) -> np.ndarray:
    """The mask_mod on every pair: (B, Hq, L, S) bool."""
    b = np.arange(B, dtype=np.int32).reshape(B, 1, 1, 1)
    h = np.arange(Hq, dtype=np.int32).reshape(1, Hq, 1, 1)
    i = np.arange(L, dtype=np.int32).reshape(L, 1)
    j = np.arange(S, dtype=np.int32)
    return np.broadcast_to(bm.mask_mod(b, h, i, j), (B, Hq, L, S))


def _doc_ids(n: int, lengths: list[int]) -> np.ndarray:
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return np.concatenate([ids, np.full(max(0, n - ids.size), len(lengths), np.int32)])[:n]


# -- block masks of the cases ----------------------------------------------------------------
def _document_causal(B: int, L: int, block, lengths=([70, 60, 62], [130, 62])):
    ids = np.stack([_doc_ids(L, list(n)) for n in lengths])[:B]

    def mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(mod, B, None, L, L, block_size=block)


def _prefix_lm(B: int, L: int, S: int, block):
    prefix = np.array([40, 90], np.int32)[:B]

    def mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])

    return create_block_mask(mod, B, None, L, S, block_size=block)


def _window_global(Hq: int, L: int, S: int, block):
    widths = np.array([24, 50, 10, 70], np.int32)[:Hq]  # per head: a size-H table

    def mod(b, h, q_idx, kv_idx):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx < widths[h])
        # global keys, and global queries on the odd heads only (so a key block far past
        # the diagonal is listed for heads 1 and 3, empty for heads 0 and 2)
        return near | (kv_idx < 4) | ((q_idx < 3) & (h % 2 == 1))

    return create_block_mask(mod, None, Hq, L, S, block_size=block)


def run_flex(lib, kind, bm, *, B, Hq, Hkv, L, S, E, Ev, deterministic, variant="v2",
             q_lens=None, k_lens=None, sinks=False, causal=False, seed=0):  # fmt: skip
    """The backward kernels' FLEX plan on the emulator with ``bm``'s table, vs the float64
    dense reference (the mask_mod dense as its boolean mask): (got, ref, launcher)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, L, E)) * 1.5
    k = rng.standard_normal((B, Hkv, S, E)) * 1.5
    v = rng.standard_normal((B, Hkv, S, Ev))
    d_out = rng.standard_normal((B, Hq, L, Ev))
    q, k, v, d_out = (_from_kernel(_to_kernel(x, kind), kind) for x in (q, k, v, d_out))
    acc = np.float64 if kind == "float64" else np.float32
    sk = rng.standard_normal((B, Hq)).astype(acc) if sinks else None
    ql = None if q_lens is None else np.asarray(q_lens, np.int32)
    kl = None if k_lens is None else np.asarray(k_lens, np.int32)
    scale = 1.0 / math.sqrt(E)
    opts = dict(scale=scale, softcap=None, causal=causal, align="top_left", window=(-1, -1),
                q_lens=ql, k_lens=kl, dropout_p=0.0, seed=0, mask=_dense(bm, B, Hq, L, S),
                sinks=sk)  # fmt: skip
    out, lse, dq_ref, dk_ref, dv_ref = reference(q, k, v, d_out, None, **opts)
    plan = flex_plan(kind, E, Ev, variant=variant)
    assert plan is not None
    tiles = ((plan.dkdv_block_m, plan.dkdv_block_n), (plan.dq_block_m, plan.dq_block_n))
    assert flex_table.backward_tiles_fit(bm, tiles) is None
    import array_api_compat.numpy as xnp

    table = np.ascontiguousarray(np.asarray(flex_table.build(bm, xnp)), dtype=np.int32)
    launch = emu.Launcher(lib)
    dq, dk, dv = run_kernels(
        emu.PoisonXp, launch, plan,
        *(_to_kernel(x, kind) for x in (q, k, v, out, d_out)),
        np.ascontiguousarray(lse, dtype=acc), None,
        scale=scale, window=(-1, 0 if causal else -1), q_lens=ql, kv_lens=kl,
        deterministic=deterministic, flex=table,
    )  # fmt: skip
    got = tuple(_from_kernel(x, kind) for x in (dq, dk, dv))
    return got, (dq_ref, dk_ref, dv_ref), launch


def _check(kind, got, ref, launch, want: str, deterministic: bool) -> None:
    names = [n for n, *_ in launch.launches]
    assert any(n.startswith(f"aa_bwd_dkdv_{want}") and n.endswith(", true>") for n in names)
    dq_want = "mma2" if want == "mma4" else want  # v4 runs v2's deterministic dQ kernel
    assert deterministic == any(n.startswith(f"aa_bwd_dq_{dq_want}") for n in names), names
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        err = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-300))
        assert err <= TOL[kind], f"{name}: relative error {err:.3g}"


def _names(kinds_dims, variant: str = "v2") -> list[str]:
    out: list[str] = []
    for kind, d in kinds_dims:
        p = flex_plan(kind, d, d, variant=variant)
        assert p is not None
        out += [n for n in (p.preprocess, p.dkdv, p.dq, p.convert) if n]
    return sorted(set(out))


LIB_PLANS = (("float16", 64), ("bfloat16", 64), ("float32", 32), ("float64", 32))


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if emu.compiler() is None or emu.cuda_include() is None:
        pytest.skip("g++ and the CUDA headers are needed for the host emulator")
    return emu.build(_names(LIB_PLANS), tmp_path_factory.mktemp("bwd_flex_emu"))


# -- the table's transposed lists -------------------------------------------------------------
def test_transposed_lists_match_kinds() -> None:
    bm = _window_global(2, 200, 170, (64, 48))
    import array_api_compat.numpy as xnp

    t = np.asarray(flex_table.build(bm, xnp))
    nq, nk, oc, ol, ob, otc, otl = (int(t[i]) for i in (0, 1, 7, 8, 9, 10, 11))
    Bt, Ht = bm.kinds.shape[:2]
    counts = t[oc:ol].reshape(Bt, Ht, nq)
    lists = t[ol:otc].reshape(Bt, Ht, nq, nk + 1, 2)
    tcounts = t[otc:otl].reshape(Bt, Ht, nk)
    tlists = t[otl:ob].reshape(Bt, Ht, nk, nq + 1, 2)
    for h in range(Ht):
        for kj in range(nk):
            col = bm.kinds[0, h, :, kj]
            listed = tlists[0, h, kj, : tcounts[0, h, kj]]
            np.testing.assert_array_equal(listed[:, 0], np.nonzero(col != bmod.EMPTY)[0])
            assert tuple(tlists[0, h, kj, tcounts[0, h, kj]]) == (nq, -1)
            for qi, pid in listed:  # the same partial id as the forward list's
                fwd = {int(a): int(p) for a, p in lists[0, h, qi, : counts[0, h, qi]]}
                assert fwd[kj] == pid and (pid >= 0) == (col[qi] == bmod.PARTIAL)


# -- v2 (float16/bfloat16, D = 64): 64-row query steps, 128-key blocks -----------------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_v2_document_causal_gqa(library, deterministic) -> None:
    """Documents with causal inside, B = 2 (a per-batch table), GQA 2:1 (the dK/dV block's
    flattened head sequence), Q_BLOCK 64 x KV_BLOCK 128 (the v2 dK/dV tile), L = S = 192
    (a ragged last key block)."""
    B, Hq, Hkv, L = 2, 2, 1, 192
    bm = _document_causal(B, L, (64, 128))
    assert (bm.kinds == bmod.EMPTY).any() and (bm.kinds == bmod.PARTIAL).any()
    kind = "bfloat16" if deterministic else "float16"
    got, ref, launch = run_flex(library, kind, bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=L, E=56, Ev=64,
                                deterministic=deterministic)  # fmt: skip
    _check(kind, got, ref, launch, "mma2", deterministic)


def test_v2_window_global_per_head_empty_head(library) -> None:
    """A per-head table (sliding windows of different widths, global keys, global queries
    on odd heads) where heads 0 and 2 of a 4:1 GQA group see none of key block 2: the
    prologue skips head 0, the prefetch skips head 2 to head 3's first listed step; sinks
    in the saved LSE."""
    B, Hq, Hkv, L, S = 1, 4, 1, 128, 384
    bm = _window_global(Hq, L, S, (64, 128))
    col = bm.kinds[0, :, :, 2] != bmod.EMPTY  # (heads, query blocks) of key block 2
    assert col.any(axis=1).tolist() == [False, True, False, True]
    got, ref, launch = run_flex(library, "float16", bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=64,
                                Ev=64, deterministic=False, sinks=True)  # fmt: skip
    _check("float16", got, ref, launch, "mma2", False)


# -- the CUDA-core kernels (float32/float64, D = 32: 64-key blocks, 32-row steps) -------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_simt_prefix_lm_lengths(library, deterministic) -> None:
    """Prefix-LM per batch with q_lengths/kv_lengths (ragged last blocks, rows past the
    length), Q_BLOCK 32 x KV_BLOCK 64."""
    B, Hq, Hkv, L, S = 2, 2, 2, 100, 150
    bm = _prefix_lm(B, L, S, (32, 64))
    got, ref, launch = run_flex(library, "float32", bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=24,
                                Ev=32, deterministic=deterministic, q_lens=(100, 61),
                                k_lens=(150, 97))  # fmt: skip
    _check("float32", got, ref, launch, "simt", deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
def test_simt_f64_window_global_sinks(library, deterministic) -> None:
    """Sliding windows per head + global tokens, causal on top, sinks, GQA 3:1, float64
    (bits at a block size that is not a multiple of 32 keys: KV_BLOCK 64, Q_BLOCK 32)."""
    B, Hq, Hkv, L, S = 1, 3, 1, 90, 120
    bm = _window_global(Hq, L, S, (32, 64))
    got, ref, launch = run_flex(library, "float64", bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=32,
                                Ev=24, deterministic=deterministic, sinks=True,
                                causal=True)  # fmt: skip
    _check("float64", got, ref, launch, "simt", deterministic)


# -- built-in mask_mods evaluated in the kernels (flex_pred.py) -------------------------------
def _builtin_cases() -> dict[str, tuple]:
    """name -> (mask_mod, B of the block mask, block size, kind, run_flex keywords, want):
    the built-ins (documents self and q/kv, causal or not; prefix-LM; window + global;
    and/or) with GQA, lengths and ragged last blocks."""
    from arrayattn.flex import (
        and_masks,
        document_mask,
        global_tokens_mask,
        or_masks,
        prefix_lm_mask,
        sliding_window_mask,
    )

    L = 192
    ids = np.stack([_doc_ids(L, [70, 60, 62]), _doc_ids(L, [130, 62])])
    q2 = np.stack([_doc_ids(100, [30, 70]), _doc_ids(100, [55, 45])])
    k2 = np.stack([_doc_ids(150, [60, 90]), _doc_ids(150, [20, 130])])
    wg = or_masks(sliding_window_mask(30, 0), global_tokens_mask(5))
    return {
        "document_causal_v2": (document_mask(ids, causal=True), 2, (64, 128), "float16",
                               dict(B=2, Hq=2, Hkv=1, L=L, S=L, E=56, Ev=64), "mma2"),
        "document_qkv_simt": (document_mask(q2, k2), 2, (32, 64), "float32",
                              dict(B=2, Hq=2, Hkv=1, L=100, S=150, E=24, Ev=32,
                                   q_lens=(100, 61), k_lens=(150, 97)), "simt"),
        "prefix_lm_simt_f64": (prefix_lm_mask(np.array([40, 90], np.int32)), 2, (32, 64),
                               "float64", dict(B=2, Hq=2, Hkv=2, L=100, S=150, E=32, Ev=24,
                                               q_lens=(100, 61), k_lens=(150, 97)), "simt"),
        "window_global_v2": (wg, None, (64, 128), "float16",
                             dict(B=1, Hq=4, Hkv=1, L=128, S=384, E=64, Ev=64, sinks=True),
                             "mma2"),
        "and_or_simt": (and_masks(wg, document_mask(_doc_ids(120, [50, 70]))), None, (32, 64),
                        "float32", dict(B=1, Hq=3, Hkv=1, L=120, S=120, E=32, Ev=32), "simt"),
    }  # fmt: skip


# (case, deterministic): the causal documents in both dQ modes, the others in one each
# (every build of a new predicate costs the emulator a compile: CI time)
_BUILTIN_RUNS = [
    ("document_causal_v2", False),
    ("document_causal_v2", True),
    ("document_qkv_simt", False),
    ("prefix_lm_simt_f64", True),
    ("window_global_v2", True),
    ("and_or_simt", False),
]


@pytest.mark.parametrize("name,deterministic", _BUILTIN_RUNS)
def test_predicate_equals_bits_and_reference(
    library, tmp_path_factory, monkeypatch, name, deterministic
) -> None:
    """A built-in mask_mod compiled into the FLEX kernels (no bits in the table) and the
    bits path (ARRAYATTN_FLEX_PREDICATE=0) each against the float64 reference, and equal
    to each other bit for bit (dQ accumulated atomically aside: its order may differ)."""
    from arrayattn.attention.cuda import flex_pred

    mod, Bm, block, kind, kw, want = _builtin_cases()[name]
    bm = create_block_mask(mod, Bm, None, kw["L"], kw["S"], block_size=block)
    assert (bm.kinds == bmod.PARTIAL).any()
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "1")
    prelude = flex_table.prelude(bm)
    assert "AA_FLEX_PRED_EXPR" in prelude
    d = {"float16": 64, "float32": 32, "float64": 32}[kind]
    lib = emu.build(_names(((kind, d),)), emu.shared_work(tmp_path_factory), prelude=prelude)
    got_p, ref, launch = run_flex(lib, kind, bm, deterministic=deterministic, **kw)
    _check(kind, got_p, ref, launch, want, deterministic)
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "0")
    got_b, ref, launch = run_flex(library, kind, bm, deterministic=deterministic, **kw)
    _check(kind, got_b, ref, launch, want, deterministic)
    for i, (p, b) in enumerate(zip(got_p, got_b, strict=True)):
        if i > 0 or deterministic:  # (atomic dQ: the order of the adds may differ)
            np.testing.assert_array_equal(p, b)


# -- host glue --------------------------------------------------------------------------------
def test_flex_plan_and_variants() -> None:
    assert flex_plan("float16", 64, 64, "v1").dkdv.startswith("aa_bwd_dkdv_mma2<")  # v1 -> v2
    assert flex_plan("float16", 64, 64, "v3").dkdv.startswith("aa_bwd_dkdv_mma2<")  # v3 -> v2
    v4 = flex_plan("float16", 128, 128, "v4")
    assert v4.dkdv == "aa_bwd_dkdv_mma4<AaF16, 128, 64, 128, 4, 16, true>"
    assert v4.dq == flex_plan("float16", 128, 128, "v2").dq  # v2's FLEX dQ kernel
    assert flex_plan("float16", 96, 96, "v4") is None  # v1's tensor-core kernels: none
    assert flex_plan("float32", 64, 64, "v4").dkdv.startswith("aa_bwd_dkdv_simt<")
    assert flex_plan("float16", 60, 60, "v2") is None  # E not a multiple of 8: v1's tc only
    assert flex_plan("bfloat16", 200, 200).dq.startswith("aa_bwd_dq_simt<AaBF16,")
    names = kb.COMPILE_VARIANTS[kb.SOURCE]
    for kind, d in (("float16", 64), ("float16", 128), ("float32", 256), ("float64", 128)):
        for variant in ("v2", "v4"):
            p = flex_plan(kind, d, d, variant)
            assert p.dkdv in kb.COMPILE_VARIANTS[kb.kernel_file(p.dkdv)] and p.dq in names
    assert not any(n.endswith("true>") for n in kb.COMPILE_VARIANTS[kb.SOURCE_V3])
    v4_flex = [n for n in kb.COMPILE_VARIANTS[kb.SOURCE_V4] if n.endswith("true>")]
    assert len(v4_flex) == 4 and set(v4_flex) <= set(kb.HOT_VARIANTS)  # 2 dtypes x D 64/128


def test_flex_default_variant_is_v2_until_measured(monkeypatch) -> None:
    """ARRAYATTN_BWD_VARIANT unset: block masks keep v2's FLEX kernels (v4's FLEX kernel is
    not the default before a GPU measurement), although v4 is the unmasked default; set,
    it picks the block-mask variant (the A/B)."""
    monkeypatch.delenv("ARRAYATTN_BWD_VARIANT", raising=False)
    assert kb.FLEX_DEFAULT_VARIANT == "v2" and kb.flex_bwd_variant() == "v2"
    assert kb.backward_plan("float16", 128, 128).variant == "v4"
    assert flex_plan("float16", 128, 128).dkdv.startswith("aa_bwd_dkdv_mma2<")
    monkeypatch.setenv("ARRAYATTN_BWD_VARIANT", "v4")
    assert flex_plan("float16", 128, 128).dkdv.startswith("aa_bwd_dkdv_mma4<")
    monkeypatch.setenv("ARRAYATTN_BWD_VARIANT", "v2")
    assert flex_plan("float16", 128, 128).dkdv.startswith("aa_bwd_dkdv_mma2<")


def test_flex_plan_for_falls_back_to_v2_tiles() -> None:
    """v4's 128-row query steps (D = 64) need Q_BLOCK % 128 == 0: a 64-row block mask runs
    v2's FLEX kernels under v4 (not the array-API backward); ARRAYATTN_BWD_VARIANT=v2's A/B
    plan is v2's; a mask neither variant fits is declined with the reason."""
    from arrayattn.flex import causal_mask

    big = create_block_mask(causal_mask, None, None, 256, 256)  # (128, 128)
    small = create_block_mask(causal_mask, None, None, 256, 256, block_size=(64, 128))
    narrow = create_block_mask(causal_mask, None, None, 256, 256, block_size=(128, 64))
    assert flex_plan_for("float16", 64, 64, big, "v4")[0].variant == "v4"
    assert flex_plan_for("float16", 64, 64, big, "v2")[0].variant == "v2"
    assert flex_plan_for("float16", 64, 64, small, "v4")[0].variant == "v2"
    assert flex_plan_for("float16", 128, 128, small, "v4")[0].variant == "v4"  # BM = 64
    plan, why = flex_plan_for("float16", 64, 64, narrow, "v4")
    assert plan is None and "multiple of the backward kernels'" in why


def test_declines_and_fused_routing(monkeypatch) -> None:
    """ARRAYATTN_FLEX_BWD_KERNELS=0 opts out: the kernels decline flex calls and
    FusedAttention.backward runs the array-API backward; by default (unset) and with 1, the
    kernels take block masks (not score_mod, not block sizes their tiles do not divide)."""
    from arrayattn.attention.cuda import fused
    from arrayattn.attention.spec import make_spec
    from arrayattn.flex import causal_mask, softcap_score_mod

    def spec(bm=None, score_mod=None, d=64, dtype=np.float16):
        q = np.zeros((1, 2, 256, d), dtype)
        return make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None,
                         block_mask=bm, score_mod=score_mod)  # fmt: skip

    monkeypatch.setattr(kb, "is_cupy", lambda xp: True)
    monkeypatch.setattr(kb, "compute_capability", lambda spec: 90)
    bm = create_block_mask(causal_mask, None, None, 256, 256)
    monkeypatch.setenv(kb.FLEX_ENV, "0")
    assert kb.FLEX_ENV in kb.declines(spec(bm))
    monkeypatch.delenv(kb.FLEX_ENV, raising=False)  # the default: the kernels take them
    assert kb.declines(spec(bm)) is None
    monkeypatch.setenv(kb.FLEX_ENV, "1")
    assert kb.declines(spec(bm)) is None
    assert kb.declines(spec(bm, dtype=np.float32, d=32)) is None
    assert "score_mod" in kb.declines(spec(bm, score_mod=softcap_score_mod(5.0)))
    small = create_block_mask(causal_mask, None, None, 256, 256, block_size=(128, 64))
    assert "multiple of the backward kernels'" in kb.declines(spec(small))  # v2: 128 keys
    assert kb.declines(spec(small, dtype=np.float32, d=32)) is None  # SIMT: 64 keys
    assert "no backward kernel" in kb.declines(spec(bm, d=96))  # v1's tensor-core kernels

    calls: list[str] = []
    monkeypatch.setattr(kb, "backward", lambda *a: calls.append("kernel") or (None,) * 4)
    monkeypatch.setattr(fused.composed, "backward", lambda *a: calls.append("api") or (None,) * 4)
    fused.FUSED.backward(spec(bm), *(None,) * 8)
    monkeypatch.setenv(kb.FLEX_ENV, "0")
    fused.FUSED.backward(spec(bm), *(None,) * 8)
    monkeypatch.setenv(kb.FLEX_ENV, "1")
    fused.FUSED.backward(spec(bm, score_mod=softcap_score_mod(5.0)), *(None,) * 8)
    assert calls == ["kernel", "api", "api"]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_backward_hook_end_to_end(library, monkeypatch, dtype) -> None:
    """``backward.backward`` itself (the hook FusedAttention.backward calls) on NumPy arrays
    standing in for CuPy's, kernels on the emulator: the opt-in, the FLEX plan, the table
    built and cached on the block mask, a dense bool attn_mask ANDed; vs NumPy float64."""
    import types

    from arrayattn import scaled_dot_product_attention, vjp
    from arrayattn.attention.spec import make_spec

    fake = types.ModuleType("cupy")
    for name in ("zeros", "zeros_like", "empty", "broadcast_to", "ascontiguousarray",
                 "asarray", "float32", "float64", "uint8", "bool_", "int32"):  # fmt: skip
        setattr(fake, name, getattr(np, name))
    fake.ndarray = type("ndarray", (), {})  # (no NumPy array is one: NumPy paths serve them)
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kb, "is_cupy", lambda xp: True)
    monkeypatch.setattr(kb, "compute_capability", lambda spec: 90)
    launch = emu.Launcher(library)
    monkeypatch.setattr(kb, "_cupy_launch", launch)
    monkeypatch.setenv(kb.FLEX_ENV, "1")
    B, Hq, Hkv, L, S = 2, 2, 1, 128, 256
    d = 64 if dtype == np.float16 else 32
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(sh).astype(dtype) for sh in
               ((B, Hq, L, d), (B, Hkv, S, d), (B, Hkv, S, d)))  # fmt: skip
    g = rng.standard_normal((B, Hq, L, d)).astype(dtype)
    mask = rng.random((L, S)) < 0.8
    bm = _prefix_lm(B, L, S, (64, 128))
    x64 = [a.astype(np.float64) for a in (q, k, v)]
    out, pb = vjp(scaled_dot_product_attention, *x64, mask, enable_gqa=True, block_mask=bm,
                  implementation="composed")  # fmt: skip
    want = pb(g.astype(np.float64))[:3]
    lse = scaled_dot_product_attention(
        *x64, mask, enable_gqa=True, block_mask=bm, implementation="composed", return_lse=True
    )[1]
    spec = make_spec(q, k, v, mask, 0.0, False, None, True, "top_left", None, None, None,
                     block_mask=bm)  # fmt: skip
    assert kb.declines(spec) is None, kb.declines(spec)
    acc = np.float32
    got = kb.backward(spec, q, k, v, mask, out.astype(dtype), lse.astype(acc), g, None)
    names = [n for n, *_ in launch.launches]
    assert any(n.startswith("aa_bwd_dkdv_") and n.endswith(", true>") for n in names), names
    assert len([key for key in bm._tables if key[0] == "cuda_flex_table"]) == 1
    tol = 2e-2 if dtype == np.float16 else 2e-5
    for name, a, r in zip(("dq", "dk", "dv"), got[:3], want, strict=True):
        err = float(np.linalg.norm(a.astype(np.float64) - r) / np.linalg.norm(r))
        assert err <= tol, (name, err)


# -- v4 (float16/bfloat16, D = 64: 128-row steps; D = 128: 64-row steps; 128-key blocks) ------
V4_DIMS = {64: (56, 64), 128: (120, 128)}  # padded head dim -> (E, Ev): padded columns, E != Ev
V4_LIB = (("float16", 64), ("float16", 128), ("bfloat16", 64), ("bfloat16", 128))
V4_DOCS = ([256], [128, 128])  # document lengths per batch (L = 256): full and empty blocks


@pytest.fixture(scope="module")
def library_v4(tmp_path_factory):
    """v4's FLEX dK/dV kernels and, from the same file (attn_bwd_v4.cu includes
    attn_bwd.cu), v2's FLEX kernels for the bit comparison."""
    if emu.compiler() is None or emu.cuda_include() is None:
        pytest.skip("g++ and the CUDA headers are needed for the host emulator")
    names = sorted(set(_names(V4_LIB, "v4") + _names((("float16", 128),), "v2")))
    return emu.build(names, tmp_path_factory.mktemp("bwd_flex_emu_v4"), kernel_file=SOURCE_V4)


@pytest.mark.parametrize(
    "kind,d,deterministic",
    [("float16", 64, False), ("bfloat16", 64, True)],
)
def test_v4_document_causal_gqa(library_v4, kind, d, deterministic) -> None:
    """Documents with causal inside, B = 2, GQA 2:1, blocks (128, 128), L = S = 256: empty,
    full (the plain path) and partial blocks in key block 0's lists (empty ones skipped)."""
    B, Hq, Hkv, L = 2, 2, 1, 256
    bm = _document_causal(B, L, (128, 128), V4_DOCS)
    col = bm.kinds[:, 0, :, 0].tolist()  # (batch, query blocks) of key block 0
    assert col == [[bmod.PARTIAL, bmod.FULL], [bmod.PARTIAL, bmod.EMPTY]]
    got, ref, launch = run_flex(library_v4, kind, bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=L,
                                E=V4_DIMS[d][0], Ev=V4_DIMS[d][1], deterministic=deterministic,
                                variant="v4")  # fmt: skip
    _check(kind, got, ref, launch, "mma4", deterministic)


def test_v4_window_global_empty_heads_sinks(library_v4) -> None:
    """Per-head sliding windows + global tokens, GQA 4:1 with heads 0 and 2 seeing none of
    key block 2 (the prologue and prefetch skip them), sinks, a Q_BLOCK of 256 (two of v4's
    128-row steps per mask block at D = 64), atomic dQ."""
    B, Hq, Hkv, L, S = 1, 4, 1, 256, 384
    bm = _window_global(Hq, L, S, (256, 128))
    col = bm.kinds[0, :, :, 2] != bmod.EMPTY
    assert col.any(axis=1).tolist() == [False, True, False, True]
    got, ref, launch = run_flex(library_v4, "float16", bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S,
                                E=56, Ev=64, deterministic=False, sinks=True,
                                variant="v4")  # fmt: skip
    _check("float16", got, ref, launch, "mma4", False)


def test_v4_prefix_lm_lengths_wide_blocks(library_v4) -> None:
    """Prefix-LM per batch with q_lengths/kv_lengths (rows and keys past the lengths),
    KV_BLOCK 256 (two of v4's 128-key blocks per mask block: words at column 128 + 32 w),
    bfloat16 at D = 128; one head (CI time: GQA runs in the other cases)."""
    B, Hq, Hkv, L, S = 2, 1, 1, 200, 300
    bm = _prefix_lm(B, L, S, (128, 256))
    got, ref, launch = run_flex(library_v4, "bfloat16", bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S,
                                E=120, Ev=128, deterministic=False, q_lens=(200, 131),
                                k_lens=(300, 170), variant="v4")  # fmt: skip
    _check("bfloat16", got, ref, launch, "mma4", False)


@pytest.mark.parametrize("deterministic", [True])  # (atomic dQ: the v2 runs above)
def test_v4_predicate_equals_bits(library_v4, tmp_path_factory, monkeypatch, deterministic):
    """v4's FLEX dK/dV kernel reads partial blocks through aa_bflex_word: a built-in causal
    document mask compiled in (AA_FLEX_PRED, the word built from 32 evaluations) against
    its bits (ARRAYATTN_FLEX_PREDICATE=0), both against float64, bit for bit equal (dQ
    accumulated atomically aside)."""
    from arrayattn.attention.cuda import flex_pred
    from arrayattn.flex import document_mask

    B, Hq, Hkv, L = 2, 2, 1, 256
    ids = np.stack([_doc_ids(L, [100, 156]), _doc_ids(L, [128, 40, 88])])
    bm = create_block_mask(document_mask(ids, causal=True), B, None, L, L,
                           block_size=(128, 128))  # fmt: skip
    assert (bm.kinds == bmod.PARTIAL).any() and (bm.kinds == bmod.EMPTY).any()
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "1")
    prelude = flex_table.prelude(bm)
    assert "AA_FLEX_PRED_EXPR" in prelude
    lib = emu.build(_names((("float16", 64),), "v4"), emu.shared_work(tmp_path_factory),
                    kernel_file=SOURCE_V4, prelude=prelude)  # fmt: skip
    kw = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, S=L, E=56, Ev=64, deterministic=deterministic,
              variant="v4")  # fmt: skip
    got_p, ref, launch = run_flex(lib, "float16", bm, **kw)
    _check("float16", got_p, ref, launch, "mma4", deterministic)
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "0")
    got_b, ref, launch = run_flex(library_v4, "float16", bm, **kw)
    _check("float16", got_b, ref, launch, "mma4", deterministic)
    for i, (p, b) in enumerate(zip(got_p, got_b, strict=True)):
        if i > 0 or deterministic:
            np.testing.assert_array_equal(p, b)


def test_v4_flex_is_bitwise_v2_flex_in_deterministic_mode(library_v4) -> None:
    """Deterministic mode: v4's FLEX dK/dV kernel walks v2's steps in v2's order with v2's
    sums (its full blocks' plain path: the element code's bits), beside v2's FLEX dQ
    kernel: the gradients are v2 FLEX's very bits."""
    B, Hq, Hkv, L = 1, 2, 1, 192
    bm = _document_causal(B, L, (64, 128), ([192],))
    assert (bm.kinds == bmod.FULL).any() and (bm.kinds == bmod.EMPTY).any()
    kw = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, S=L, E=120, Ev=128, deterministic=True, sinks=True)
    v4, ref, l4 = run_flex(library_v4, "float16", bm, variant="v4", **kw)
    v2, _, l2 = run_flex(library_v4, "float16", bm, variant="v2", **kw)
    _check("float16", v4, ref, l4, "mma4", True)
    assert not any("_mma4<" in n for n, *_ in l2.launches)
    for name, a, b in zip(("dq", "dk", "dv"), v4, v2, strict=True):
        assert np.array_equal(a, b), name


# -- ThreadSanitizer: the v2 and v4 FLEX kernels' list walk and prefetch ----------------------
def _tsan_case(lib: Path, variant: str = "v2") -> int:
    """The child's work: the GQA window case (a head skipped by the prefetch); v2 with its
    deterministic dQ, v4 with the atomic dQ (both of its barriers, partial and full blocks,
    two 128-row steps of one mask block); exit 1 when a gradient is off."""
    if variant == "v4":
        B, Hq, Hkv, L, S = 1, 2, 1, 256, 256  # key block 1: head 0 empty, head 1 listed
        bm = _window_global(Hq, L, S, (256, 128))
        got, ref, launch = run_flex(emu.load(lib), "float16", bm, B=B, Hq=Hq, Hkv=Hkv, L=L,
                                    S=S, E=64, Ev=64, deterministic=False,
                                    variant="v4")  # fmt: skip
        _check("float16", got, ref, launch, "mma4", False)
        return 0
    B, Hq, Hkv, L, S = 1, 2, 1, 128, 256  # key block 1: head 0 empty, head 1 listed
    bm = _window_global(Hq, L, S, (64, 128))
    got, ref, launch = run_flex(emu.load(lib), "float16", bm, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S,
                                E=64, Ev=64, deterministic=True)  # fmt: skip
    _check("float16", got, ref, launch, "mma2", True)
    return 0


@pytest.mark.parametrize("variant", ["v2", "v4"])
def test_flex_has_no_data_race(tmp_path: Path, variant: str) -> None:
    tsan = pytest.importorskip("_tsan")
    if emu.compiler() is None or emu.cuda_include() is None:
        pytest.skip("g++ and the CUDA headers are needed for the host emulator")
    libtsan = tsan.libtsan(emu.compiler() or "g++")
    if libtsan is None:
        pytest.skip("no libtsan for this compiler")
    error = tsan.python_fails_with(libtsan)
    if error is not None:
        pytest.skip(f"ThreadSanitizer does not run here: {error}")
    source = SOURCE_V4 if variant == "v4" else kb.SOURCE
    lib = emu.compile_library(_names((("float16", 64),), variant), tmp_path, tsan.FLAGS,
                              kernel_file=source)  # fmt: skip
    env = dict(os.environ, LD_PRELOAD=libtsan, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("AA_EMU_EAGER", None)
    env.pop(tsan.SKIP_BARRIER, None)
    res = subprocess.run([sys.executable, __file__, str(lib), variant], capture_output=True,
                         text=True, env=env, timeout=600)  # fmt: skip
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(_tsan_case(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "v2"))
