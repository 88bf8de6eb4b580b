"""Broadcast K/V (batch dims 1 against queries with B rows) read once: the fast, chunked
and composed paths stack the rows into each KV-head group (``AttentionSpec.stack_kv``).

References: the float64 reference (``arrayattn.testing``), and the same call with K/V
explicitly repeated over the batch (which takes the per-row route)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention import stacked
from arrayattn.attention.spec import make_spec
from arrayattn.testing import reference_attention, reference_vjp

PATHS = ("fast", "chunked", "composed")


def _options(draw, rng, lead, hq):
    opts: dict = {}
    if draw(st.booleans()):
        opts["is_causal"] = True
        opts["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([2.0, 30.0]))
    extra = draw(st.sampled_from(["none", "sinks", "alibi", "dropout"]))
    if extra == "sinks":
        opts["sinks"] = rng.standard_normal(lead + (hq,))
    elif extra == "alibi":
        opts["alibi_slopes"] = np.abs(rng.standard_normal((hq,)))
    elif extra == "dropout":
        opts["dropout_p"], opts["seed"] = 0.25, int(draw(st.integers(0, 2**31 - 1)))
    return opts


@st.composite
def calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lead = draw(st.sampled_from([(3,), (2, 2)]))
    hk = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2]))
    hq = hk * g
    L, S, E = draw(st.integers(1, 5)), draw(st.integers(1, 9)), 8
    q = rng.standard_normal(lead + (hq, L, E))
    kv_lead = (1,) * len(lead) if draw(st.booleans()) else ()
    k = rng.standard_normal(kv_lead + (hk, S, E))
    v = rng.standard_normal(kv_lead + (hk, S, E))
    mask_kind = draw(st.sampled_from([None, "float_row", "float_shared", "bool"]))
    mask = None
    if mask_kind == "float_row":  # per (row, head): indexed per stacked row
        mask = rng.standard_normal(lead + (hq, L, S))
    elif mask_kind == "float_shared":  # one pattern for all rows: used without a copy
        mask = rng.standard_normal((L, S))
    elif mask_kind == "bool":
        mask = rng.random(lead + (1, L, S)) < 0.7
        mask[..., 0] = True
    opts = _options(draw, rng, lead, hq)
    return q, k, v, mask, opts, dict(enable_gqa=g > 1)


def _repeated(x, lead):
    x = x.reshape((1,) * (len(lead) + 3 - x.ndim) + x.shape)
    return np.ascontiguousarray(np.broadcast_to(x, lead + x.shape[len(lead) :]))


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=12, deadline=None)
@given(call=calls())
def test_broadcast_kv_matches_reference_and_repeated(path, call):
    q, k, v, mask, opts, gqa = call
    lead = q.shape[:-3]
    spec = make_spec(q, k, v, mask, opts.get("dropout_p", 0.0), opts.get("is_causal", False),
                     None, gqa["enable_gqa"], opts.get("causal_align", "top_left"), None,
                     opts.get("softcap"), opts.get("seed"), sinks=opts.get("sinks"),
                     alibi_slopes=opts.get("alibi_slopes"))  # fmt: skip
    assert spec.stack_kv
    kw = {**opts, **gqa}
    (out, lse), pb = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, mask, return_lse=True, implementation=path, **kw
    )
    kr, vr = _repeated(k, lead), _repeated(v, lead)
    (out_r, lse_r), pb_r = aa.vjp(
        aa.scaled_dot_product_attention, q, kr, vr, mask, return_lse=True, implementation=path,
        **kw,
    )  # fmt: skip
    ref_out, ref_lse = reference_attention(q, k, v, mask, **kw)
    np.testing.assert_allclose(out, ref_out, atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12, rtol=1e-10)
    # Dropout hashes each row's own batch index: the repeated call drops the same pairs.
    np.testing.assert_allclose(out, out_r, atol=1e-13, rtol=0)

    rng = np.random.default_rng(1)
    d_out, d_lse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads = pb((d_out, d_lse))
    grads_r = pb_r((d_out, d_lse))
    ref = reference_vjp(d_out, q, k, v, mask, d_lse=d_lse, **kw)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    for got, want in ((grads[0], ref.query), (grads[1], ref.key), (grads[2], ref.value)):
        np.testing.assert_allclose(got, want, atol=1e-11, rtol=1e-9)
    # dK/dV of the broadcast K/V: the sums over the rows of the repeated call's.
    for i in (1, 2):
        summed = grads_r[i].sum(axis=tuple(range(len(lead)))).reshape(k.shape)
        np.testing.assert_allclose(grads[i], summed, atol=1e-11, rtol=1e-9)
    if mask is not None and mask.dtype != np.bool_:
        np.testing.assert_allclose(grads[3], ref.attn_mask, atol=1e-11, rtol=1e-9)
        assert grads[3].shape == mask.shape
    if "sinks" in opts:
        np.testing.assert_allclose(grads[4]["sinks"], ref.sinks, atol=1e-11, rtol=1e-9)


def test_float32_broadcast_kv_close_to_repeated():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((16, 32, 1, 128)).astype(np.float32)
    k = rng.standard_normal((1, 8, 300, 128)).astype(np.float32)
    v = rng.standard_normal((1, 8, 300, 128)).astype(np.float32)
    out = aa.scaled_dot_product_attention(q, k, v, enable_gqa=True, implementation="fast")
    kr, vr = np.repeat(k, 16, 0), np.repeat(v, 16, 0)
    ref = aa.scaled_dot_product_attention(q, kr, vr, enable_gqa=True, implementation="fast")
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_stacked_plan_reads_kv_once_without_a_copy():
    """The stacked call has one batch row, the rows folded into the groups, and K/V
    reach the path as views of the caller's arrays; the fast forward allocates far less
    than one per-row copy of K/V."""
    rng = np.random.default_rng(0)
    B, hq, hk, S, D = 16, 8, 2, 2048, 64
    q = rng.standard_normal((B, hq, 1, D)).astype(np.float32)
    k = rng.standard_normal((1, hk, S, D)).astype(np.float32)
    spec = make_spec(q, k, k, None, 0.0, False, None, True, "top_left", None, None, None)
    sp = stacked.stacked_spec(spec)
    assert (sp.lead, sp.Hq, sp.Hkv, sp.G) == ((1,), B * hq, hk, B * hq // hk)
    seen = []

    def impl(s, qq, kk, vv, m):
        seen.append((kk, vv))
        return aa.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True, return_lse=True)

    stacked.forward(impl, spec, q, k, k, None)
    assert np.shares_memory(seen[0][0], k) and np.shares_memory(seen[0][1], k)
    aa.scaled_dot_product_attention(q, k, k, enable_gqa=True, implementation="fast")  # warm
    tracemalloc.start()
    aa.scaled_dot_product_attention(q, k, k, enable_gqa=True, implementation="fast")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # Per-row copies of K and V would be 2 * B * k.nbytes (32 MiB); the tiles' scratch is
    # a few MiB.
    assert peak < B * k.nbytes // 4, peak


def test_lengths_take_the_per_row_route():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 2, 2, 8))
    k = rng.standard_normal((1, 2, 6, 8))
    kv_lengths = np.array([6, 3, 1])
    spec = make_spec(q, k, k, None, 0.0, False, None, False, "top_left", None, None, None,
                     kv_lengths=kv_lengths)  # fmt: skip
    assert not spec.stack_kv
    for path in PATHS:
        out = aa.scaled_dot_product_attention(q, k, k, kv_lengths=kv_lengths, implementation=path)
        ref, _ = reference_attention(q, k, k, kv_lengths=kv_lengths)
        np.testing.assert_allclose(out, ref, atol=1e-12)
