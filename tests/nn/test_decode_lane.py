"""The NumPy decoding step (``arrayattn/nn/attention/decode.py``): a cached
``MultiHeadAttention`` call with one new token per row equals the same call run by the
general path (``implementation="composed"``, which the lane never takes) for every
option it covers (GQA, windows, softcap, sinks, qk-norm, rows of different lengths,
float32/float64), ignores garbage past each row's length, and leaves non-finite inputs
to the general path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from arrayattn.nn import MultiHeadAttention
from arrayattn.nn.attention import decode

BASE = dict(embed_dim=32, num_heads=4, num_kv_heads=2, rope="half", causal=True)
VARIANTS = {
    "gqa": {},
    "mha": dict(num_kv_heads=4),
    "mqa": dict(num_kv_heads=1, qk_norm="rms"),
    "window": dict(window=(3, 0)),
    "window_right": dict(causal=False, window=(2, 1)),
    "non_causal": dict(causal=False),
    "softcap_sinks": dict(softcap=2.0, sinks=True, scale=0.3),
    "values": dict(v_head_dim=5, window=(4, 0), sinks=True),
}
PROMPTS = [5, 1, 8]


def run_steps(mha, p, dtype, steps=4, garbage=False, spy=None):
    rng = np.random.default_rng(7)
    B, E, L = len(PROMPTS), mha.embed_dim, max(PROMPTS)
    cache = mha.new_cache(B, L + steps, xp=np, dtype=dtype)
    if garbage:  # stale entries past every row's length: never read
        cache.keys[...] = np.nan
        cache.values[...] = np.inf
    x = rng.standard_normal((B, L, E)).astype(dtype)
    outs = [mha(p, x, cache=cache, lengths=PROMPTS, padding_side="left")]
    for _ in range(steps):
        outs.append(mha(p, rng.standard_normal((B, 1, E)).astype(dtype), cache=cache))
    return outs


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoding_steps_equal_the_general_path(variant, dtype, monkeypatch):
    mha = MultiHeadAttention(**{**BASE, **VARIANTS[variant]})
    general = dataclasses.replace(mha, implementation="composed")
    p = mha.init(seed=1, xp=np, dtype=dtype)
    p = {k: v + 0.3 * np.random.default_rng(2).standard_normal(v.shape).astype(dtype)
         for k, v in p.items()}  # fmt: skip
    taken = []
    real = decode.decode_attention
    monkeypatch.setattr(
        decode, "decode_attention", lambda *a: taken.append(1) or real(*a)
    )
    for garbage in (False, True):
        taken.clear()
        got = run_steps(mha, p, dtype, garbage=garbage)
        assert len(taken) == 4  # every decoding step, not the prefill
        want = run_steps(general, p, dtype, garbage=garbage)
        assert len(taken) == 4
        tol = 1e-12 if dtype == np.float64 else 2e-5
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def test_non_finite_results_are_left_to_the_general_path(monkeypatch):
    mha = MultiHeadAttention(**BASE)
    p = mha.init(seed=0, xp=np, dtype=np.float64)
    cache = mha.new_cache(2, 4, xp=np, dtype=np.float64)
    x = np.ones((2, 1, 32))
    mha(p, x, cache=cache)
    cache.values[0, :, 0] = np.inf  # a value that takes part
    general = []
    from arrayattn.nn.attention import cache as cache_mod

    real = cache_mod.scaled_dot_product_attention
    def spy(*a, **k):
        general.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cache_mod, "scaled_dot_product_attention", spy)
    snap = cache._snapshot()
    out = mha(p, x, cache=cache)
    assert general == [1]
    cache._restore(snap)
    ref = dataclasses.replace(mha, implementation="composed")(p, x, cache=cache)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_the_lane_declines_what_it_does_not_cover():
    mha = MultiHeadAttention(**BASE)
    p = mha.init(seed=0, xp=np, dtype=np.float16)
    cache = mha.new_cache(1, 4, xp=np, dtype=np.float16)
    x = np.ones((1, 1, 32), np.float16)
    calls = []
    real = decode.decode_attention
    decode_attention = decode.decode_attention
    try:
        decode.decode_attention = lambda *a: calls.append(1) or real(*a)
        mha(p, x, cache=cache)  # float16 computes in float32: the general path
        alibi = MultiHeadAttention(**{**BASE, "rope": None, "alibi": True})
        pa = alibi.init(seed=0, xp=np)
        alibi(pa, np.ones((1, 1, 32), np.float32), cache=alibi.new_cache(1, 4, xp=np))
    finally:
        decode.decode_attention = decode_attention
    assert calls == []
