"""Per-sequence lengths (``q_lengths``/``kv_lengths``) equal a dense boolean mask, on the
composed and chunked paths, forward and backward."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import xp_assert_close
from _reference import attention as reference_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention import chunked

SETTINGS = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def skip_slow(backend) -> None:
    if backend.name == "jax":
        pytest.skip("jax: property tests too slow op by op; see the fixed case")


def dense_mask(L, S, q_len, kv_len, *, is_causal, causal_align, window) -> np.ndarray:
    """The ``(B, 1, L, S)`` mask the lengths stand for, built row by row."""
    B = len(q_len)
    mask = np.zeros((B, 1, L, S), dtype=bool)
    for b in range(B):
        ql = min(max(int(q_len[b]), 0), L)
        kl = min(max(int(kv_len[b]), 0), S)
        offset = 0 if causal_align == "top_left" else kl - ql
        for i in range(ql):
            for j in range(kl):
                ok = True
                if is_causal:
                    ok &= j <= i + offset
                if window is not None:
                    left, right = window
                    ok &= left < 0 or j >= i + offset - left
                    ok &= right < 0 or j <= i + offset + right
                mask[b, 0, i, j] = ok
    return mask


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    L = draw(st.integers(1, 7))
    S = draw(st.integers(1, 8))
    given_q = draw(st.booleans())
    given_kv = draw(st.booleans() if given_q else st.just(True))
    return dict(
        B=B,
        L=L,
        S=S,
        Hkv=draw(st.integers(1, 2)),
        G=draw(st.integers(1, 2)),
        q_len=draw(st.lists(st.integers(0, L + 1), min_size=B, max_size=B)) if given_q else None,
        kv_len=draw(st.lists(st.integers(0, S + 1), min_size=B, max_size=B)) if given_kv else None,
        is_causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(("top_left", "bottom_right"))),
        window=draw(st.none() | st.tuples(st.integers(-1, 2), st.integers(-1, 2))),
        implementation=draw(st.sampled_from(("composed", "chunked"))),
        seed=draw(st.integers(0, 1000)),
    )


def _run(backend, c, monkeypatch):
    monkeypatch.setattr(chunked, "BLOCK_Q", 2)
    monkeypatch.setattr(chunked, "BLOCK_K", 3)
    rng = np.random.default_rng(c["seed"])
    B, L, S, Hkv = c["B"], c["L"], c["S"], c["Hkv"]
    Hq = Hkv * c["G"]
    q = rng.standard_normal((B, Hq, L, 3))
    k = rng.standard_normal((B, Hkv, S, 3))
    v = rng.standard_normal((B, Hkv, S, 2))
    q_len = np.full(B, L) if c["q_len"] is None else np.asarray(c["q_len"])
    kv_len = np.full(B, S) if c["kv_len"] is None else np.asarray(c["kv_len"])
    structure = dict(is_causal=c["is_causal"], causal_align=c["causal_align"], window=c["window"])
    mask = dense_mask(L, S, q_len, kv_len, **structure)
    exp_out, exp_lse, _ = reference_attention(q, k, v, mask, enable_gqa=c["G"] > 1)

    qb, kb, vb, mb = (backend.asarray(a) for a in (q, k, v, mask))
    lengths = {}
    if c["q_len"] is not None:
        lengths["q_lengths"] = backend.asarray(np.asarray(c["q_len"], dtype=np.int32))
    if c["kv_len"] is not None:
        lengths["kv_lengths"] = backend.asarray(np.asarray(c["kv_len"], dtype=np.int64))
    opts = dict(enable_gqa=c["G"] > 1, return_lse=True, implementation=c["implementation"])
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, qb, kb, vb, **opts, **structure, **lengths
    )
    xp_assert_close(backend, out, exp_out, dtype="float64")
    xp_assert_close(backend, lse, exp_lse, dtype="float64")

    # Gradients equal those of the dense-mask call.
    (_, _), dense_pullback = aa.vjp(aa.scaled_dot_product_attention, qb, kb, vb, mb, **opts)
    cot = tuple(backend.asarray(rng.standard_normal(np.shape(a))) for a in (exp_out, exp_lse))
    got = pullback(cot)
    want = dense_pullback(cot)[:3]
    for g, w in zip(got, want, strict=True):
        xp_assert_close(backend, g, backend.to_numpy(w), dtype="float64")
    dq = backend.to_numpy(got[0])
    for b in range(B):  # rows past a sequence's length get exactly zero gradient
        assert np.all(dq[b, :, int(min(max(q_len[b], 0), L)) :] == 0)


@SETTINGS
@given(c=cases())
def test_lengths_equal_dense_mask(backend, c):
    skip_slow(backend)
    with pytest.MonkeyPatch.context() as mp:
        _run(backend, c, mp)


def test_fixed_case_every_backend(backend, monkeypatch):
    c = dict(
        B=3,
        L=5,
        S=6,
        Hkv=1,
        G=2,
        q_len=[5, 2, 0],
        kv_len=[6, 3, 4],
        is_causal=True,
        causal_align="bottom_right",
        window=(2, -1),
        implementation="chunked",
        seed=1,
    )
    _run(backend, c, monkeypatch)


def test_attention_weights_with_lengths():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 3))
    k = rng.standard_normal((2, 1, 5, 3))
    q_len, kv_len = np.array([4, 1]), np.array([2, 5])
    opts = dict(is_causal=True, causal_align="bottom_right")
    w = aa.attention_weights(q, k, q_lengths=q_len, kv_lengths=kv_len, **opts)
    mask = dense_mask(4, 5, q_len, kv_len, **opts, window=None)
    _, _, exp_w = reference_attention(q, k, k, mask)
    np.testing.assert_allclose(w, exp_w, atol=1e-12)
    # and its vjp accepts them too
    w2, pullback = aa.vjp(aa.attention_weights, q, k, q_lengths=q_len, kv_lengths=kv_len, **opts)
    dq, dk = pullback(np.ones_like(w2))
    assert np.all(dq[1, :, 1:] == 0)


def test_top_left_keeps_offset_zero():
    """Top-left alignment ignores the lengths for the diagonal: query i sees keys j <= i."""
    q = np.zeros((1, 1, 3, 2))
    k = np.zeros((1, 1, 6, 2))
    w = aa.attention_weights(q, k, is_causal=True, kv_lengths=np.array([5]))
    np.testing.assert_allclose(w[0, 0, 2], [1 / 3, 1 / 3, 1 / 3, 0, 0, 0])
    w = aa.attention_weights(
        q, k, is_causal=True, causal_align="bottom_right", kv_lengths=np.array([5])
    )
    np.testing.assert_allclose(w[0, 0, 2], [0.2] * 5 + [0])


def test_bad_lengths():
    q = np.zeros((2, 1, 3, 2))
    with pytest.raises(TypeError, match="q_lengths.*integer"):
        aa.scaled_dot_product_attention(q, q, q, q_lengths=np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="kv_lengths.*integer"):
        aa.scaled_dot_product_attention(q, q, q, kv_lengths=np.array([True, False]))
    with pytest.raises(ValueError, match=r"kv_lengths.*\(2,\)"):
        aa.scaled_dot_product_attention(q, q, q, kv_lengths=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="q_lengths"):
        aa.scaled_dot_product_attention(q, q, q, q_lengths=np.array([[1, 2]]))
    xps = pytest.importorskip("array_api_strict")  # not on the GPU machines
    qs = xps.asarray(q)
    with pytest.raises(TypeError, match="kv_lengths"):
        aa.scaled_dot_product_attention(qs, qs, qs, kv_lengths=np.array([1, 2]))
    other = xps.asarray([1, 2], device=xps.Device("device1"))
    with pytest.raises(TypeError, match="device"):
        aa.scaled_dot_product_attention(qs, qs, qs, kv_lengths=other)


def test_inputs_not_modified():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 3, 2))
    ql, kl = np.array([3, 1]), np.array([2, 3])
    saved = [a.copy() for a in (q, ql, kl)]
    for impl in ("composed", "chunked"):
        aa.scaled_dot_product_attention(q, q, q, q_lengths=ql, kv_lengths=kl, implementation=impl)
    for a, b in zip((q, ql, kl), saved, strict=True):
        np.testing.assert_array_equal(a, b)
