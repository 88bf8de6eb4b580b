"""Ragged decode on the fast path: rows of different cache lengths, each tile taking
every head of its row (all KV heads as batched products), so that the Python-level tile
calls scale with the batch, not batch x KV heads; equal to the float64 reference and
to the per-KV-head tiles (1e-12). Garbage (NaN) past each row's length, which the
forward no longer scans for up front, stays out of the results."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention.fast import forward as fwd
from arrayattn.attention.spec import make_spec
from arrayattn.testing import reference_attention


@st.composite
def ragged_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B = draw(st.integers(1, 4))
    hk = draw(st.sampled_from([2, 4]))
    g = draw(st.sampled_from([1, 2, 4]))
    L, S, E = draw(st.integers(1, 3)), draw(st.integers(3, 40)), 16
    q = rng.standard_normal((B, hk * g, L, E))
    k = rng.standard_normal((B, hk, S, E))
    v = rng.standard_normal((B, hk, S, E))
    kv_len = rng.integers(0, S + 1, size=B)
    for b in range(B):  # garbage past each row's length
        k[b, :, kv_len[b] :] = np.nan
        v[b, :, kv_len[b] :] = np.inf if b % 2 else np.nan
    opts: dict = dict(enable_gqa=g > 1, kv_lengths=kv_len)
    if draw(st.booleans()):
        opts.update(is_causal=True, causal_align="bottom_right")
    extra = draw(st.sampled_from(["none", "softcap", "alibi", "sinks", "dropout", "mask"]))
    if extra == "softcap":
        opts["softcap"] = 5.0
    elif extra == "alibi":
        opts["alibi_slopes"] = np.abs(rng.standard_normal(hk * g))
    elif extra == "sinks":
        opts["sinks"] = rng.standard_normal(hk * g)
    elif extra == "dropout":
        opts.update(dropout_p=0.3, seed=int(rng.integers(0, 2**31)))
    mask = rng.standard_normal((B, hk * g, L, S)) if extra == "mask" else None
    # A NaN value a row does attend to: those rows are NaN (not with dropout, where the
    # reference's dense product also poisons rows that drop the pair, or see no key).
    if kv_len[0] >= L and extra != "dropout" and draw(st.booleans()):
        v[0, hk - 1, 0, 0] = np.nan
    return q, k, v, mask, opts


@contextlib.contextmanager
def all_heads_forced(value):
    original = fwd.all_heads
    fwd.all_heads = lambda spec, n, heads: value
    try:
        yield
    finally:
        fwd.all_heads = original


@settings(max_examples=40, deadline=None)
@given(call=ragged_calls())
def test_ragged_decode_matches_reference_and_per_kv_head_tiles(call):
    q, k, v, mask, opts = call
    out, lse = aa.scaled_dot_product_attention(
        q, k, v, mask, return_lse=True, implementation="fast", **opts
    )
    ref_out, ref_lse = reference_attention(q, k, v, mask, **opts)
    # Rows giving weight to a NaN value are NaN (the path: the whole row; the reference:
    # the NaN's columns); every other row equals the reference.
    poisoned = np.isnan(ref_out).any(axis=-1)
    assert (np.isnan(out).any(axis=-1) == poisoned).all()
    np.testing.assert_allclose(out[~poisoned], ref_out[~poisoned], atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12, rtol=1e-10)
    with all_heads_forced(False):  # the per-(row, KV head) tiles
        out_old, lse_old = aa.scaled_dot_product_attention(
            q, k, v, mask, return_lse=True, implementation="fast", **opts
        )
    # Batched products round like the per-head ones up to the last bit (BLAS kernels).
    np.testing.assert_allclose(out, out_old, atol=1e-12, rtol=1e-12)
    np.testing.assert_allclose(lse, lse_old, atol=1e-12, rtol=1e-12)


def test_decode_tile_calls_scale_with_the_batch(monkeypatch):
    rng = np.random.default_rng(0)
    B, hq, hk, S, D = 8, 32, 8, 64, 32
    q = rng.standard_normal((B, hq, 1, D)).astype(np.float32)
    k = rng.standard_normal((B, hk, S, D)).astype(np.float32)
    lengths = np.arange(1, B + 1) * 7
    spec = make_spec(q, k, k, None, 0.0, True, None, True, "bottom_right", None, None, None,
                     kv_lengths=lengths)  # fmt: skip
    assert fwd.tile_plan(spec)[1] == hq  # every head of a row in one tile
    calls = []
    original = fwd._rows

    def counting(*args, **kw):
        calls.append(args[4])  # the row
        return original(*args, **kw)

    monkeypatch.setattr(fwd, "_rows", counting)
    out = aa.scaled_dot_product_attention(q, k, k, is_causal=True, causal_align="bottom_right",
                                          enable_gqa=True, kv_lengths=lengths,
                                          implementation="fast")  # fmt: skip
    assert len(calls) == B, calls  # not B x Hkv = 64
    ref, _ = reference_attention(q, k, k, is_causal=True, causal_align="bottom_right",
                                 enable_gqa=True, kv_lengths=lengths)  # fmt: skip
    np.testing.assert_allclose(out, ref, atol=1e-5)
