"""``CascadeKVCache``: a shared prefix held once plus per-row suffixes equals the per-row
cache with the prefix copied into every row (attention on the composed float64 path),
for both suffix kinds, prefixes of length 0, 1 and longer than a page, empty suffixes,
rows that stop at different steps and multi-token appends; through
``MultiHeadAttention`` too. Bad inputs raise and leave the cache unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.nn import CascadeKVCache, KVCache, MultiHeadAttention

B, HKV, HQ, D = 3, 2, 4, 8
PAGE = 3


def make(kind, prefix_cap=16, suffix_cap=12, dtype=np.float64):
    if kind == "paged":
        return CascadeKVCache(batch_size=B, num_kv_heads=HKV, head_dim=D, prefix_length=prefix_cap,
                              num_pages=B * (suffix_cap // PAGE + 1), page_size=PAGE, xp=np,
                              dtype=dtype)  # fmt: skip
    return CascadeKVCache(batch_size=B, num_kv_heads=HKV, head_dim=D, prefix_length=prefix_cap,
                          max_suffix_length=suffix_cap, xp=np, dtype=dtype)  # fmt: skip


def copied_attention(pk, pv, suffix_k, suffix_v, q, n, causal, **kw):
    """The reference: each row's K/V = prefix copy + its own suffix, one call on the
    composed path with per-row lengths (bottom-right causal)."""
    P = pk.shape[2]
    lens = [P + sum(x.shape[1] for x in s) for s in suffix_k]
    S = max(max(lens), 1)
    k = np.zeros((B, HKV, S, D), pk.dtype)
    v = np.zeros((B, HKV, S, D), pk.dtype)
    for b in range(B):
        k[b, :, :P], v[b, :, :P] = pk[0], pv[0]
        if suffix_k[b]:
            k[b, :, P : lens[b]] = np.concatenate(suffix_k[b], axis=1)
            v[b, :, P : lens[b]] = np.concatenate(suffix_v[b], axis=1)
    return aa.scaled_dot_product_attention(
        q, k, v, is_causal=causal, causal_align="bottom_right", enable_gqa=True,
        kv_lengths=np.array(lens), q_lengths=np.array(n), implementation="composed", **kw,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    prefix=st.sampled_from([0, 1, 7]),  # 7 > PAGE, and ends mid-page
    causal=st.booleans(),
    softcap=st.sampled_from([None, 4.0]),
    with_sinks=st.booleans(),
    window=st.sampled_from([None, (2, 0), (6, 1)]),
)
def test_cascade_equals_copied_prefix(kind, seed, prefix, causal, softcap, with_sinks, window):
    rng = np.random.default_rng(seed)
    sinks = rng.standard_normal(HQ) if with_sinks else None
    cache = make(kind)
    pk, pv = rng.standard_normal((2, 1, HKV, prefix, D))
    if prefix:
        cache.fill_prefix(pk, pv)
    assert cache.prefix_length == prefix
    suffix_k: list[list[np.ndarray]] = [[] for _ in range(B)]
    suffix_v: list[list[np.ndarray]] = [[] for _ in range(B)]
    for step in range(4):
        L = int(rng.integers(1, 3))
        # Rows idle (0 new tokens: finished, or not started: empty suffix) at random steps.
        n = [int(rng.integers(0, L + 1)) if b != 0 else L for b in range(B)]
        if step == 0:
            n[2] = 0  # row 2 starts late: an empty suffix at the first step
        k, v = rng.standard_normal((2, B, HKV, L, D))
        cache.append(k, v, n)
        for b in range(B):
            if n[b]:
                suffix_k[b].append(k[b, :, : n[b]])
                suffix_v[b].append(v[b, :, : n[b]])
        q = rng.standard_normal((B, HQ, L, D))
        out, lse = cache.attend(q, n, causal=causal, softcap=softcap, sinks=sinks,
                                window=window, return_lse=True)  # fmt: skip
        ref, ref_lse = copied_attention(pk, pv, suffix_k, suffix_v, q, n, causal,
                                        softcap=softcap, sinks=sinks, window=window,
                                        return_lse=True)  # fmt: skip
        np.testing.assert_allclose(out, ref, atol=1e-12, rtol=0)
        # LSE of the real query rows (padding rows: -inf here, the sink in the reference).
        real = np.arange(L)[None, None, :] < np.array(n)[:, None, None]
        real = np.broadcast_to(real, lse.shape)
        if window is None:  # (a window may leave a real row no key: LSE -inf, output 0)
            assert (np.isfinite(lse) == real).all()
        np.testing.assert_allclose(lse[real], ref_lse[real], atol=1e-12, rtol=0)
        assert cache.lengths.tolist() == [prefix + sum(x.shape[1] for x in s) for s in suffix_k]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_cascade_float32_and_prefix_held_once(kind):
    rng = np.random.default_rng(0)
    cache = make(kind, prefix_cap=300, dtype=np.float32)
    pk, pv = rng.standard_normal((2, 1, HKV, 300, D)).astype(np.float32)
    cache.fill_prefix(pk, pv)
    assert cache.prefix.keys.shape[0] == 1  # one copy of the prefix, not one per row
    k, v = rng.standard_normal((2, B, HKV, 2, D)).astype(np.float32)
    cache.append(k, v)
    q = rng.standard_normal((B, HQ, 1, D)).astype(np.float32)
    out = cache.attend(q, causal=True)
    assert out.dtype == np.float32
    sk = [[k[b]] for b in range(B)]
    sv = [[v[b]] for b in range(B)]
    ref = copied_attention(pk.astype(np.float64), pv.astype(np.float64),
                           [[x.astype(np.float64) for x in s] for s in sk],
                           [[x.astype(np.float64) for x in s] for s in sv],
                           q.astype(np.float64), [1] * B, True)  # fmt: skip
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


CFG = dict(embed_dim=16, num_heads=4, num_kv_heads=2, rope="half", qk_norm="rms",
           causal=True, softcap=3.0)  # fmt: skip


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_mha_cascade_equals_prompt_copied_per_row(kind):
    """Prefill the shared prompt once into ``cascade.prefix``, decode with per-row
    suffix prompts and steps (one row idles at one step): equal to a per-row KVCache
    whose every row was prefilled with the whole shared prompt."""
    mha = MultiHeadAttention(**CFG)
    rng = np.random.default_rng(0)
    p = {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in
         mha.init(seed=0, xp=np, dtype=np.float64).items()}  # fmt: skip
    P = 5
    prompt = rng.standard_normal((1, P, 16))
    if kind == "paged":
        cascade = CascadeKVCache(batch_size=B, num_kv_heads=2, head_dim=4, prefix_length=8,
                                 num_pages=12, page_size=2, xp=np)  # fmt: skip
    else:
        cascade = CascadeKVCache(batch_size=B, num_kv_heads=2, head_dim=4, prefix_length=8,
                                 max_suffix_length=8, xp=np)  # fmt: skip
    plain = mha.new_cache(B, P + 8, xp=np)
    out_prefix = mha(p, prompt, cache=cascade.prefix)
    out_plain = mha(p, np.repeat(prompt, B, 0), cache=plain)
    np.testing.assert_allclose(out_prefix[0], out_plain[1], atol=1e-12)
    steps = [(3, [3, 1, 2]), (1, [1, 1, 1]), (1, [1, 0, 1]), (2, [2, 2, 1])]
    for L, n in steps:
        x = rng.standard_normal((B, L, 16))
        got = mha(p, x, cache=cascade, lengths=n)
        want = mha(p, x, cache=plain, lengths=n)
        for b in range(B):
            np.testing.assert_allclose(got[b, : n[b]], want[b, : n[b]], atol=1e-12, rtol=0)
    assert cascade.lengths.tolist() == plain.lengths.tolist()


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_bad_inputs_raise_and_leave_the_cache_unchanged(kind):
    rng = np.random.default_rng(0)
    cache = make(kind, prefix_cap=4, suffix_cap=6)
    pk, pv = rng.standard_normal((2, 1, HKV, 3, D))
    cache.fill_prefix(pk, pv)
    k, v = rng.standard_normal((2, B, HKV, 3, D))
    cache.append(k, v)
    q = rng.standard_normal((B, HQ, 1, D))
    before = cache.attend(q)
    state = (cache.lengths.tolist(), cache.prefix_length, repr(cache))
    with pytest.raises(ValueError, match="prefix cannot change once suffixes exist"):
        cache.fill_prefix(pk[:, :, :1], pv[:, :, :1])
    with pytest.raises(ValueError, match="overflow|cannot hold|pages"):
        big = rng.standard_normal((B, HKV, 7, D))
        cache.append(big, big)  # 3 + 7 > 6 suffix positions (> 9 pages of 3)
    with pytest.raises(ValueError, match="rows must be in"):
        cache.reset([0, B])
    with pytest.raises(ValueError, match="rows"):
        cache.append(k[:2], v[:2])  # 2 rows for a batch of 3
    with pytest.raises(ValueError, match="query must be"):
        cache.attend(rng.standard_normal((B + 1, HQ, 1, D)))
    assert (cache.lengths.tolist(), cache.prefix_length, repr(cache)) == state
    np.testing.assert_array_equal(cache.attend(q), before)
    # Through the layer: a full suffix raises, the cache is unchanged.
    mha = MultiHeadAttention(embed_dim=16, num_heads=HQ, num_kv_heads=HKV, causal=True)
    p = mha.init(seed=0, xp=np, dtype=np.float64)
    layer_cache = CascadeKVCache(batch_size=B, num_kv_heads=HKV, head_dim=4, prefix_length=4,
                                 max_suffix_length=2, xp=np)  # fmt: skip
    mha(p, rng.standard_normal((1, 2, 16)), cache=layer_cache.prefix)
    mha(p, rng.standard_normal((B, 2, 16)), cache=layer_cache)
    with pytest.raises(ValueError, match="overflow"):
        mha(p, rng.standard_normal((B, 1, 16)), cache=layer_cache)
    with pytest.raises(ValueError, match="prefix cannot change"):
        mha(p, rng.standard_normal((1, 1, 16)), cache=layer_cache.prefix)
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        mha(p, rng.standard_normal((B, 1, 16)), cache=layer_cache,
            attn_mask=np.ones((1, 1), bool))  # fmt: skip
    assert layer_cache.lengths.tolist() == [4] * B and layer_cache.prefix_length == 2
    # Resetting every suffix lets the prefix be refilled.
    layer_cache.reset()
    mha(p, rng.standard_normal((1, 1, 16)), cache=layer_cache.prefix)
    assert layer_cache.prefix_length == 3


def test_needs_exactly_one_suffix_kind():
    with pytest.raises(ValueError, match="exactly one of max_suffix_length"):
        CascadeKVCache(batch_size=2, num_kv_heads=1, head_dim=4, prefix_length=4)
    assert isinstance(make("contiguous").suffix, KVCache)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_cascade_pickles_with_contents_and_appends_atomically_from_threads(kind):
    """The cascade is shared like the other caches: one lock around prefix and suffixes
    (appends from several threads serialise, each key row beside its own value row), and
    a pickled copy (to a Dask worker, a subprocess) attends bit-identically."""
    import pickle
    import threading

    cache = make(kind)
    rng = np.random.default_rng(5)
    pk, pv = rng.standard_normal((2, 1, HKV, 5, D))
    cache.fill_prefix(pk, pv)

    def worker(tag: float) -> None:
        for _ in range(3):
            k = np.full((B, HKV, 1, D), tag)
            cache.append(k, k + 0.5)  # value = key + 0.5 marks the pair

    threads = [threading.Thread(target=worker, args=(float(t),)) for t in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.suffix_lengths.tolist() == [9] * B
    q = rng.standard_normal((B, HQ, 1, D))
    out = cache.attend(q)
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.lock is not cache.lock
    np.testing.assert_array_equal(copy.attend(q), out)
    # every suffix position pairs a key with the value appended beside it
    suffix = cache.suffix
    if kind == "contiguous":
        keys, values = suffix.filled()
        keys, values = np.asarray(keys), np.asarray(values)
        np.testing.assert_array_equal(values, keys + 0.5)
