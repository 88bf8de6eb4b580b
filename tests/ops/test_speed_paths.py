"""The speed work of issue 18 against float64 oracles: GQA heads stacked as rows of one
product (composed, chunked, fast), the composed path's row blocks that skip keys outside
the causal/window band, the fast path's split-KV with its LSE merge (empty splits
included), and the cost model behind ``implementation="auto"`` (its choices on a table of
shapes; no timing here)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from _helpers import xp_assert_close
from _reference import attention as reference_attention
from _reference import structural_mask

import arrayattn as aa
from arrayattn.attention import composed as _composed
from arrayattn.attention import cost as _cost
from arrayattn.attention import registry
from arrayattn.attention import threads as _fast_threads
from arrayattn.attention.fast import forward as _fast_forward
from arrayattn.attention.fast import layout as fast
from arrayattn.attention.spec import make_spec
from arrayattn.ops.attention import auto_choice

MASKS = (None, "bool", "float", "bool_2d", "float_over_heads")
STRUCTURES = {
    "none": dict(),
    "causal_tl": dict(is_causal=True),
    "causal_br": dict(is_causal=True, causal_align="bottom_right"),
    "window": dict(window=(3, 1)),
    "window_causal_br": dict(window=(2, -1), is_causal=True, causal_align="bottom_right"),
}


def _mask(kind, rng, B, Hq, L, S):
    if kind is None:
        return None
    shape = {
        "bool": (B, Hq, L, S),
        "float": (B, Hq, L, S),
        "bool_2d": (L, S),
        "float_over_heads": (B, 1, L, S),
    }[kind]
    if kind.startswith("bool"):
        return rng.random(shape) < 0.7
    return rng.standard_normal(shape)


def _reference(q, k, v, m, kw, dropout=None):
    keep = None
    if dropout is not None:
        p, seed = dropout
        keep = aa.dropout_mask(q, k, p, seed, enable_gqa=True)
    opts = {n: kw[n] for n in ("is_causal", "causal_align", "window") if n in kw}
    out, lse, _ = reference_attention(
        q,
        k,
        v,
        m,
        enable_gqa=True,
        dropout_p=0.0 if dropout is None else dropout[0],
        keep=keep,
        **opts,
    )
    return out, lse


@contextlib.contextmanager
def _small_composed_blocks(block_bytes=256):
    """Many row blocks in the composed path (as for long sequences) on small inputs."""
    saved = (_composed.ROW_BLOCK_BYTES, _composed.MIN_BLOCK_ROWS)
    _composed.ROW_BLOCK_BYTES, _composed.MIN_BLOCK_ROWS = block_bytes, 1
    try:
        yield
    finally:
        _composed.ROW_BLOCK_BYTES, _composed.MIN_BLOCK_ROWS = saved


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("mask", MASKS)
def test_gqa_stacking_every_mask_kind_every_path(backend, mask, structure):
    """Hq = 6 over Hkv = 2 (groups of 3 stacked as rows), forward and backward of the
    composed (many row blocks) and chunked paths against the float64 oracle / the
    composed path, on every backend; the NumPy fast path too."""
    if backend.compiles_per_shape and (mask, structure) != ("float", "causal_br"):
        pytest.skip("jax: one representative case (every block shape compiles)")
    if backend.name != "numpy" and MASKS.index(mask) != list(STRUCTURES).index(structure):
        pytest.skip("the full grid runs on NumPy; each mask kind and structure once here")
    rng = np.random.default_rng(7)
    B, Hq, Hkv, L, S, E = 2, 6, 2, 7, 9, 3
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, 2))
    m = _mask(mask, rng, B, Hq, L, S)
    kw = STRUCTURES[structure]
    exp_out, exp_lse = _reference(q, k, v, m, kw)
    qb, kb, vb = (backend.asarray(x) for x in (q, k, v))
    mb = None if m is None else backend.asarray(m)
    d_out = rng.standard_normal((B, Hq, L, 2))
    d_lse = rng.standard_normal((B, Hq, L))
    grads = {}
    impls = ["composed", "chunked"] + (["fast"] if backend.name == "numpy" else [])
    block_bytes = 256
    if backend.compiles_per_shape:  # two row blocks; the chunked path has its own JAX case
        impls, block_bytes = ["composed"], B * Hq * S * 8 * 4
    with _small_composed_blocks(block_bytes):
        for impl in impls:
            (out, lse), pullback = aa.vjp(
                aa.scaled_dot_product_attention,
                qb,
                kb,
                vb,
                mb,
                enable_gqa=True,
                return_lse=True,
                implementation=impl,
                **kw,
            )
            xp_assert_close(backend, out, exp_out, dtype="float64", err_msg=impl)
            xp_assert_close(backend, lse, exp_lse, dtype="float64", err_msg=impl)
            grads[impl] = pullback((backend.asarray(d_out), backend.asarray(d_lse)))
        # The composed path in one block (the whole L x S matrix) is the reference.
        _composed.ROW_BLOCK_BYTES, _composed.MIN_BLOCK_ROWS = 2**40, 2**20
        _, pullback = aa.vjp(
            aa.scaled_dot_product_attention,
            qb,
            kb,
            vb,
            mb,
            enable_gqa=True,
            return_lse=True,
            implementation="composed",
            **kw,
        )
        want = pullback((backend.asarray(d_out), backend.asarray(d_lse)))
    for impl, got in grads.items():
        for name, g, w in zip(("dq", "dk", "dv", "dmask"), got, want, strict=True):
            if w is None:
                assert g is None, (impl, name)
                continue
            xp_assert_close(
                backend, g, backend.to_numpy(w), dtype="float64", err_msg=f"{impl} {name}"
            )


@pytest.mark.parametrize("impl", ["composed", "chunked", "fast"])
def test_dropout_identical_on_every_path_with_blocks_and_gqa(backend, impl):
    """The same seed drops the same probabilities whatever the path's blocking (many
    composed row blocks, trimmed chunked blocks, GQA-stacked fast tiles)."""
    if impl == "fast" and backend.name != "numpy":
        pytest.skip("the fast path runs on NumPy")
    if backend.compiles_per_shape and impl != "composed":
        pytest.skip("jax: one representative case")
    rng = np.random.default_rng(5)
    B, Hq, Hkv, L, S, E = 2, 4, 2, 6, 10, 3
    q, k, v = (rng.standard_normal(sh) for sh in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))
    kw = dict(is_causal=True, causal_align="bottom_right")
    exp_out, exp_lse = _reference(q, k, v, None, kw, (0.25, 1234))
    args = [backend.asarray(x) for x in (q, k, v)]
    block_bytes = B * Hq * S * 8 * 2 if backend.compiles_per_shape else 256
    with _small_composed_blocks(block_bytes):
        out, lse = aa.scaled_dot_product_attention(
            *args,
            enable_gqa=True,
            dropout_p=0.25,
            seed=1234,
            return_lse=True,
            implementation=impl,
            **kw,
        )
    xp_assert_close(backend, out, exp_out, dtype="float64")
    xp_assert_close(backend, lse, exp_lse, dtype="float64")


def test_composed_row_blocks_skip_keys_outside_the_band():
    q = np.ones((1, 2, 512, 8), np.float32)
    causal = make_spec(q, q, q, None, 0.0, True, None, False, "top_left", None, None, None)
    blocks = _composed.row_blocks(causal)
    assert len(blocks) == _composed.STRUCTURED_ROW_BLOCKS
    assert [c1 for _, r1, _, c1 in blocks] == [r1 for _, r1, _, _ in blocks]
    visited = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks)
    assert visited <= 0.57 * 512 * 512  # (n + 1) / 2n of the full matrix for n = 8
    window = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", (16, 0), None, None)
    assert all(c1 - c0 <= (r1 - r0) + 16 for r0, r1, c0, c1 in _composed.row_blocks(window))
    full = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None)
    assert _composed.row_blocks(full) == [(0, 512, 0, 512)]


@pytest.mark.parametrize("lengths", ["q", "kv", "both"])
def test_composed_row_blocks_with_lengths(backend, lengths):
    """Per-sequence lengths (top-left causal, so the band does not move) with many row
    blocks: empty rows give 0 / -inf, keys past kv_lengths take no part."""
    if backend.compiles_per_shape and lengths != "both":
        pytest.skip("jax: one representative case")
    rng = np.random.default_rng(3)
    B, H, L, S, E = 3, 2, 6, 8, 4
    q, k, v = (rng.standard_normal(s) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, E)))
    q_len = np.array([6, 2, 0]) if lengths in ("q", "both") else None
    kv_len = np.array([8, 3, 0]) if lengths in ("kv", "both") else None
    allowed = np.broadcast_to(structural_mask(L, S, is_causal=True), (B, 1, L, S)).copy()
    for b in range(B):
        if q_len is not None:
            allowed[b, :, q_len[b] :, :] = False
        if kv_len is not None:
            allowed[b, :, :, kv_len[b] :] = False
    exp_out, exp_lse, _ = reference_attention(q, k, v, allowed)
    args = [backend.asarray(x) for x in (q, k, v)]
    kw = dict(
        is_causal=True,
        return_lse=True,
        q_lengths=None if q_len is None else backend.asarray(q_len),
        kv_lengths=None if kv_len is None else backend.asarray(kv_len),
    )
    impls = ("composed",) if backend.compiles_per_shape else ("composed", "chunked")
    with _small_composed_blocks(B * H * S * 8 * 2 if backend.compiles_per_shape else 256):
        for impl in impls:
            out, lse = aa.scaled_dot_product_attention(*args, implementation=impl, **kw)
            xp_assert_close(backend, out, exp_out, dtype="float64", err_msg=impl)
            xp_assert_close(backend, lse, exp_lse, dtype="float64", err_msg=impl)


@contextlib.contextmanager
def _forced_splits(threads=4):
    """Split-KV on small inputs: several threads, no serial shortcut, tiny splits."""
    saved = (_fast_threads.num_threads, fast._SERIAL_WORK, _fast_forward.MIN_SPLIT_KEYS)
    _fast_threads.num_threads = lambda: threads  # noqa: E731
    fast._SERIAL_WORK, _fast_forward.MIN_SPLIT_KEYS = 0, 1
    try:
        yield
    finally:
        _fast_threads.num_threads, fast._SERIAL_WORK, _fast_forward.MIN_SPLIT_KEYS = saved


SPLIT_CASES = {
    "decode_mqa": dict(Hkv=1, G=8, L=1, S=37, kw={}),
    "decode_gqa_causal_br": dict(
        Hkv=2, G=4, L=3, S=23, kw=dict(is_causal=True, causal_align="bottom_right")
    ),
    "empty_splits": dict(Hkv=1, G=2, L=1, S=2, kw={}),  # 4 splits over 2 keys
    "window": dict(
        Hkv=1, G=3, L=2, S=40, kw=dict(window=(5, 0), is_causal=True, causal_align="bottom_right")
    ),
    "bool_mask_empty_split": dict(Hkv=1, G=2, L=2, S=16, kw={}, mask="first_half_out"),
    "float_mask": dict(Hkv=1, G=2, L=2, S=16, kw={}, mask="float"),
    "dropout": dict(Hkv=1, G=4, L=1, S=30, kw={}, dropout=(0.3, 77)),
    "kv_lengths": dict(Hkv=2, G=2, L=2, S=24, kw={}, kv_lengths=(5, 0)),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_fast_split_kv_merge_matches_the_oracle(name, dtype):
    c = SPLIT_CASES[name]
    rng = np.random.default_rng(11)
    Hq = c["Hkv"] * c["G"]
    B = 2 if "kv_lengths" in c else 1
    q = rng.standard_normal((B, Hq, c["L"], 8)).astype(dtype)
    k = rng.standard_normal((B, c["Hkv"], c["S"], 8)).astype(dtype)
    v = rng.standard_normal((B, c["Hkv"], c["S"], 8)).astype(dtype)
    m = None
    if c.get("mask") == "first_half_out":  # the first splits have no key at all
        m = np.arange(c["S"]) >= c["S"] // 2
    elif c.get("mask") == "float":
        m = rng.standard_normal((c["L"], c["S"])).astype(dtype)
    kw = dict(c["kw"], enable_gqa=True, return_lse=True)
    if "dropout" in c:
        kw.update(dropout_p=c["dropout"][0], seed=c["dropout"][1])
    ref_mask = m
    if "kv_lengths" in c:
        lengths = np.array(c["kv_lengths"])
        kw.update(kv_lengths=lengths)
        ref_mask = np.arange(c["S"])[None, None, None, :] < lengths[:, None, None, None]
    exp_out, exp_lse = _reference(q, k, v, ref_mask, c["kw"], c.get("dropout"))
    if "kv_lengths" in c:  # keys past each sequence's length may hold garbage
        for b, n in enumerate(lengths):
            k[b, :, n:] = np.nan
            v[b, :, n:] = np.inf
    with _forced_splits():
        spec = make_spec(
            q,
            k,
            v,
            m,
            kw.get("dropout_p", 0.0),
            kw.get("is_causal", False),
            None,
            True,
            kw.get("causal_align", "top_left"),
            kw.get("window"),
            None,
            kw.get("seed"),
        )
        out, lse = aa.scaled_dot_product_attention(q, k, v, m, implementation="fast", **kw)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, exp_out, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(exp_lse))
    np.testing.assert_allclose(lse, exp_lse, rtol=tol, atol=tol)
    # The same call through the composed path (dropout: the same mask everywhere).
    out_c = aa.scaled_dot_product_attention(q, k, v, m, implementation="composed", **kw)[0]
    np.testing.assert_allclose(out, out_c, rtol=tol, atol=tol)
    assert not np.isnan(out).any()
    assert spec.Hq == Hq


def test_split_kv_merge_of_empty_parts():
    outs = np.zeros((3, 2, 4))
    lses = np.full((3, 2), -np.inf)
    outs[1, 0], lses[1, 0] = 1.0, 0.5  # row 0: one non-empty part; row 1: none
    out, lse = _fast_forward.merge_splits(outs, lses)
    np.testing.assert_array_equal(out[0], 1.0)
    assert lse[0] == 0.5 and np.isneginf(lse[1]) and np.all(out[1] == 0)
    assert not np.isnan(out).any()


def test_decode_tiles_stack_the_group_and_take_all_keys_in_one_block():
    q = np.ones((1, 32, 1, 128), np.float32)
    kv = np.ones((1, 8, 32768, 128), np.float32)
    spec = make_spec(q, kv, kv, None, 0.0, True, None, True, "bottom_right", None, None, None)
    n, heads, width = _fast_forward.tile_plan(spec)
    # Decode: a tile takes every head of its row (all 8 KV heads as batched products).
    assert (n, heads) == (1, 32) and width >= 32768 // 4


# ---------------------------------------------------------------------------------------
# The cost model: which path "auto" takes (no timing: the fitted constants decide)
# ---------------------------------------------------------------------------------------
# (B, Hq, Hkv, L, S, D, causal, library) -> expected path, with 2 threads.
AUTO_TABLE = [
    ((256, 8, 8, 1, 128, 64, False, "numpy"), "composed"),  # issue 12 item 6
    ((2048, 1, 1, 4, 4, 64, False, "numpy"), "composed"),  # issue 12 item 6
    ((2048, 8, 8, 4, 4, 64, False, "numpy"), "composed"),
    ((1, 16, 16, 2048, 2048, 64, False, "numpy"), "fast"),  # prefill
    ((1, 8, 8, 4096, 4096, 64, True, "numpy"), "fast"),
    ((1, 32, 8, 1, 4096, 128, True, "numpy"), "fast"),  # decode
    ((1, 32, 8, 1, 32768, 128, True, "numpy"), "fast"),
    ((4, 32, 8, 1, 8192, 128, True, "numpy"), "fast"),
    ((1, 32, 8, 16, 32768, 128, True, "numpy"), "fast"),
    # batched decode over short caches: K/V beyond the cache make composed's skinny
    # products memory-bound (measured 18.1 ms composed vs 9.8 ms fast on NumPy)
    ((16, 32, 8, 1, 1024, 128, True, "numpy"), "fast"),
    ((16, 32, 8, 1, 1024, 128, True, "torch"), "fast"),
    ((1, 32, 8, 1, 256, 128, True, "numpy"), "composed"),  # K/V in cache: 0.23 vs 0.38 ms
    ((2, 4, 4, 8, 8, 16, False, "torch"), "composed"),
    ((4, 8, 8, 128, 128, 64, False, "torch"), "composed"),  # below the fast path's crossover
    ((1, 8, 8, 2048, 2048, 64, False, "torch"), "fast"),  # CPU tensors: NumPy views
    ((1, 8, 8, 2048, 2048, 64, True, "torch"), "fast"),
    ((1, 32, 8, 1, 4096, 128, True, "torch"), "fast"),  # decode
    ((1, 32, 1, 1, 2**22, 128, False, "torch"), "fast"),
    # bfloat16 (no NumPy view): a row block > AUTO_CHUNK_BYTES goes chunked
    ((1, 32, 1, 1, 2**22, 128, False, "torch-bfloat16"), "chunked"),
    # prefill without a NumPy view: chunked (bfloat16, 2 threads: 75 ms against 89 for
    # composed, 2026-11-23); small calls stay composed
    ((1, 8, 8, 2048, 2048, 64, False, "torch-bfloat16"), "chunked"),
    ((8, 8, 8, 128, 128, 32, False, "torch-bfloat16"), "composed"),
]


@pytest.mark.parametrize("case,expected", AUTO_TABLE, ids=[str(c) for c, _ in AUTO_TABLE])
def test_auto_choice_table(case, expected, monkeypatch):
    B, Hq, Hkv, L, S, D, causal, lib = case
    monkeypatch.setattr(_cost, "threads", lambda: 2)
    if lib.startswith("torch"):
        torch = pytest.importorskip("torch")
        dtype = torch.bfloat16 if lib == "torch-bfloat16" else torch.float32
        # Shapes only: broadcast views of one element stand in for the arrays.
        q = torch.zeros((), dtype=dtype).expand(B, Hq, L, D)
        kv = torch.zeros((), dtype=dtype).expand(B, Hkv, S, D)
    else:
        q = np.broadcast_to(np.float32(0), (B, Hq, L, D))
        kv = np.broadcast_to(np.float32(0), (B, Hkv, S, D))
    spec = make_spec(
        q, kv, kv, None, 0.0, causal, None, Hq != Hkv, "bottom_right", None, None, None
    )
    assert auto_choice(spec) == expected


def test_cost_model_estimates_are_positive_and_grow_with_work():
    q1 = np.broadcast_to(np.float32(0), (1, 8, 512, 64))
    q2 = np.broadcast_to(np.float32(0), (1, 8, 1024, 64))
    s1, s2 = (
        make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None)
        for q in (q1, q2)
    )
    for name in registry.modelled():
        model = registry.cost_model(name)
        assert 0 < model.estimate(s1, 2) < model.estimate(s2, 2)
    causal = make_spec(q2, q2, q2, None, 0.0, True, None, False, "top_left", None, None, None)
    fast_cost, composed_cost = registry.cost_model("fast"), registry.cost_model("composed")
    assert fast_cost.estimate(causal, 2) < fast_cost.estimate(s2, 2)
    assert composed_cost.estimate(causal, 2) < composed_cost.estimate(s2, 2)


def test_fast_split_kv_with_sinks_and_alibi_matches_composed():
    """Sinks join once, after the splits merge; ALiBi rides on the stacked rows."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 8, 3, 8))
    k, v = (rng.standard_normal((1, 2, 50, 8)) for _ in range(2))
    kw = dict(
        enable_gqa=True,
        return_lse=True,
        sinks=rng.standard_normal(8),
        alibi_slopes=np.abs(rng.standard_normal(8)) * 0.1,
        is_causal=True,
        causal_align="bottom_right",
        window=(5, 0),
    )
    want = aa.scaled_dot_product_attention(q, k, v, implementation="composed", **kw)
    with _forced_splits():
        got = aa.scaled_dot_product_attention(q, k, v, implementation="fast", **kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (0, 0), (3, -1), (-1, 2), (2, 5), (40, 40)])
@pytest.mark.parametrize(("L", "S"), [(1, 1), (1, 9), (7, 3), (9, 9), (13, 30), (30, 13)])
def test_cost_model_counts_the_band_exactly(causal, align, window, L, S):
    """The cost model's count of scores inside the band (closed form, no per-row work)
    equals the dense mask's, and chunked's trimmed row blocks hold at least that many."""
    q = np.broadcast_to(np.float32(0), (1, 1, L, 4))
    kv = np.broadcast_to(np.float32(0), (1, 1, S, 4))
    spec = make_spec(q, kv, kv, None, 0.0, causal, None, False, align, window, None, None)
    dense = int(structural_mask(L, S, is_causal=causal, causal_align=align, window=window).sum())
    assert _cost.visited_per_head(spec) == dense
    _, _, elements, _ = registry.cost_model("chunked").features(spec, 2)
    assert dense <= elements <= L * S
