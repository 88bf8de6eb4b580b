"""Per-sequence and paged KV caches: ragged batches (right- and left-padded prompts,
rows that idle, sequences that finish and are replaced) equal each sequence recomputed
alone without a cache; paged caches with pages out of order, freed and reused; overflow
and dtype errors name the sequence and the capacity; a rejected call changes nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import thin
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayattn.nn import KVCache, MultiHeadAttention, PagedKVCache

TOL = dict(rtol=1e-9, atol=1e-11)
CFG = dict(
    embed_dim=16,
    num_heads=4,
    num_kv_heads=2,
    rope="half",
    qk_norm="rms",
    causal=True,
    softcap=3.0,
    v_head_dim=3,
)
N, LP, STEPS = [5, 2, 3], 5, 3  # prompt lengths, padded prompt length, decode steps


def params(mha, seed=0):
    p = mha.init(seed=seed, xp=np, dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    return {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in p.items()}


def alone(mha, p, seq):
    """Full recomputation of one sequence ``(T, E)`` without a cache: ``(T, E)``."""
    return mha(p, seq[None])[0]


def padded(tokens, n, side, rng):
    x = rng.standard_normal((len(n), LP, tokens.shape[-1])) * 100  # garbage in the padding
    for b, nb in enumerate(n):
        if side == "right":
            x[b, :nb] = tokens[b, :nb]
        else:
            x[b, LP - nb :] = tokens[b, :nb]
    return x


def make_cache(mha, kind, backend, B=3, tight=True, rng=None):
    if kind == "contiguous":
        return mha.new_cache(B, LP + STEPS, xp=backend.xp, device=backend.device)
    need = sum(math.ceil((nb + STEPS) / 2) for nb in N)
    cache = mha.new_paged_cache(B, num_pages=need if tight else need + 6, page_size=2)
    if rng is not None:  # pages out of order: sequences get scattered, non-adjacent pages
        rng.shuffle(cache.free_pages)
    return cache


def run_ragged(backend, mha, p, cache, side, rng, steps=STEPS):
    """Prefill padded prompts of lengths N, decode STEPS tokens (one step with an idle
    row), comparing every real output row with the sequence computed alone."""
    E = mha.embed_dim
    tokens = rng.standard_normal((3, LP + STEPS, E))
    pb = {k: backend.asarray(v) for k, v in p.items()}
    x = padded(tokens, N, side, rng)
    y = backend.to_numpy(mha(pb, backend.asarray(x), cache=cache, lengths=N, padding_side=side))
    for b, nb in enumerate(N):
        rows = y[b, :nb] if side == "right" else y[b, LP - nb :]
        np.testing.assert_allclose(rows, alone(mha, p, tokens[b, :nb]), **TOL)
    held = list(N)
    for t in range(steps):
        step = np.stack([tokens[b, held[b]] for b in range(3)])[:, None, :]
        idle = t == 1  # row 1 sits this step out
        lengths = [1, 0, 1] if idle else None
        y = backend.to_numpy(mha(pb, backend.asarray(step), cache=cache, lengths=lengths))
        for b in range(3):
            if idle and b == 1:
                continue
            held[b] += 1
            want = alone(mha, p, tokens[b, : held[b]])[-1]
            np.testing.assert_allclose(y[b, 0], want, **TOL)
        assert cache.lengths.tolist() == held
    return tokens, held


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_ragged_batch_decoding_equals_recomputation(backend, kind):
    # JAX compiles every new shape (~0.1 s per op): there only the ragged prefill runs.
    thin(backend, kind == "contiguous")
    mha = MultiHeadAttention(**CFG)
    rng = np.random.default_rng(1)
    cache = make_cache(mha, kind, backend, rng=rng)
    steps = 0 if backend.compiles_per_shape else STEPS
    run_ragged(backend, mha, params(mha), cache, "right", rng, steps)
    if kind == "contiguous":
        assert cache.in_place == (backend.name != "jax")
        assert cache.dtype == backend.xp.float64  # followed the parameters


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_left_padded_prompts(backend, kind):
    thin(backend, False)
    mha = MultiHeadAttention(**{**CFG, "window": (2, 0)})
    rng = np.random.default_rng(2)
    run_ragged(backend, mha, params(mha, 3), make_cache(mha, kind, backend, rng=rng), "left", rng)


def test_paged_pages_freed_and_reused_by_a_new_sequence():
    mha = MultiHeadAttention(**CFG)
    rng = np.random.default_rng(4)
    p = params(mha, 5)
    cache = make_cache(mha, "paged", None, rng=rng)  # a pool with no page to spare
    tokens, held = run_ragged(_NP, mha, p, cache, "right", rng)
    P = cache.page_size
    in_use = sum(math.ceil(n / P) for n in held)
    assert cache.pages_in_use == in_use  # memory follows the tokens held
    assert sorted(sum(cache.block_tables, [])) == sorted(set(sum(cache.block_tables, [])))
    assert any(np.diff(t).tolist() != [1] * (len(t) - 1) for t in cache.block_tables)
    old = set(cache.block_tables[0])
    cache.free(0)  # sequence 0 finished: its pages go back to the pool
    assert cache.lengths.tolist() == [0] + held[1:]
    assert cache.pages_in_use == in_use - len(old)
    new = rng.standard_normal((6, mha.embed_dim))
    x = np.zeros((3, 5, mha.embed_dim))
    x[0] = new[:5]
    y = mha(p, x, cache=cache, lengths=[5, 0, 0])
    np.testing.assert_allclose(y[0], alone(mha, p, new[:5]), **TOL)
    assert set(cache.block_tables[0]) & old  # freed pages, reused
    # Every sequence, old and new, goes on exactly.
    step = np.stack([new[5], tokens[1, held[1]], tokens[2, held[2]]])[:, None]
    y = mha(p, step, cache=cache)
    np.testing.assert_allclose(y[0, 0], alone(mha, p, new)[-1], **TOL)
    for b in (1, 2):
        want = alone(mha, p, tokens[b, : held[b] + 1])[-1]
        np.testing.assert_allclose(y[b, 0], want, **TOL)
    with pytest.raises(ValueError, match="sequence 0.*capacity"):
        mha(p, np.zeros((3, 2, 16)), cache=cache, lengths=[2, 0, 0])  # no page left


def test_contiguous_row_reset_starts_a_new_sequence():
    mha = MultiHeadAttention(**CFG)
    rng = np.random.default_rng(6)
    p = params(mha, 7)
    cache = make_cache(mha, "contiguous", _NP)
    tokens, held = run_ragged(_NP, mha, p, cache, "right", rng)
    cache.reset(2)
    new = rng.standard_normal((4, mha.embed_dim))
    x = np.zeros((3, 4, mha.embed_dim))
    x[2] = new
    y = mha(p, x, cache=cache, lengths=[0, 0, 4])
    np.testing.assert_allclose(y[2], alone(mha, p, new), **TOL)
    assert cache.lengths.tolist() == [held[0], held[1], 4]


def test_overflow_names_the_sequence_and_capacity_and_changes_nothing():
    mha = MultiHeadAttention(**CFG)
    p = params(mha)
    x = np.random.default_rng(8).standard_normal((3, 5, 16))
    cache = mha.new_cache(3, 6)
    mha(p, x, cache=cache, lengths=N)
    mha(p, x[:, :1], cache=cache)
    before = cache.lengths.tolist()
    match = r"sequence 0: 6 cached \+ 1 new tokens > its capacity max_length=6"
    with pytest.raises(ValueError, match=match):
        mha(p, x[:, :1], cache=cache)
    assert cache.lengths.tolist() == before


def test_paged_overflow_message():
    mha = MultiHeadAttention(**CFG)
    p = params(mha)
    x = np.random.default_rng(8).standard_normal((3, 5, 16))
    cache = mha.new_paged_cache(3, num_pages=5, page_size=2)
    with pytest.raises(ValueError, match=r"sequence 2.*only 1 of 5 pages.*capacity 10 tokens"):
        mha(p, x, cache=cache, lengths=N)  # pages: 3 + 1 + 2 = 6 > 5
    assert cache.lengths.tolist() == [0, 0, 0] and cache.pages_in_use == 0


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_wrong_dtype_is_a_clear_error(kind):
    mha = MultiHeadAttention(**CFG)
    p = params(mha)  # float64
    if kind == "contiguous":
        cache = mha.new_cache(3, 8, xp=np, dtype=np.float32)
        match = r"float64 but the KV cache \(capacity 3 sequences x 8 positions\) holds float32"
    else:
        cache = mha.new_paged_cache(3, num_pages=8, page_size=2, xp=np, dtype=np.float32)
        match = r"float64 but the paged KV cache \(capacity 16 tokens in 8 pages\) holds float32"
    with pytest.raises(TypeError, match=match):
        mha(p, np.zeros((3, 2, 16)), cache=cache)
    assert cache.lengths.tolist() == [0, 0, 0]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(attn_mask=np.ones((3, 1, 1, 6), np.int32)), TypeError),
        (dict(attn_mask=np.ones((3, 1, 1, 99), bool)), ValueError),
        (dict(positions=2.5), TypeError),
        (dict(lengths=[1, 1, 2]), ValueError),
        (dict(seed="x", training=True), TypeError),
    ],
)
def test_rejected_call_changes_nothing(kind, bad, error):
    """Issue 12 item 2: a call that raises must not append its tokens."""
    mha = MultiHeadAttention(**CFG)
    p = params(mha, 9)
    rng = np.random.default_rng(10)
    tokens = rng.standard_normal((3, 6, 16))
    cache = make_cache(mha, kind, _NP, tight=False)
    mha(p, tokens[:, :5], cache=cache)
    snapshot = cache.lengths.tolist()
    pages = None if kind == "contiguous" else [list(t) for t in cache.block_tables]
    with pytest.raises(error):
        mha(p, tokens[:, 5:6], cache=cache, **bad)
    assert cache.lengths.tolist() == snapshot
    if pages is not None:
        assert cache.block_tables == pages
    y = mha(p, tokens[:, 5:6], cache=cache)  # the next step is exact
    for b in range(3):
        np.testing.assert_allclose(y[b, 0], alone(mha, p, tokens[b])[-1], **TOL)


def test_paged_attention_reads_one_page_per_sequence_per_step(monkeypatch):
    mha = MultiHeadAttention(**CFG)
    p = params(mha, 11)
    cache = mha.new_paged_cache(3, num_pages=20, page_size=2)
    blocks = []
    real = PagedKVCache._page_block

    def spy(self, xp, pages):
        k, v = real(self, xp, pages)
        blocks.append(tuple(k.shape))
        return k, v

    monkeypatch.setattr(PagedKVCache, "_page_block", spy)
    monkeypatch.setattr(PagedKVCache, "keys_per_step", 2)  # one page per step
    x = np.random.default_rng(12).standard_normal((3, 5, 16))
    want = mha(p, x, lengths=N)
    got = mha(p, x, cache=cache, lengths=N)
    assert blocks and all(s == (3, 2, 2, 4) for s in blocks)  # B pages of (Hkv, P, D)
    assert len(blocks) == 3  # ceil(max length 5 / page size 2) steps
    monkeypatch.setattr(PagedKVCache, "keys_per_step", 4)  # two pages per step
    blocks.clear()
    cache.free()
    np.testing.assert_allclose(mha(p, x, cache=cache, lengths=N), got, **TOL)
    assert blocks == [(3, 2, 4, 4), (3, 2, 4, 4)]
    for b, n in enumerate(N):
        np.testing.assert_allclose(got[b, :n], want[b, :n], **TOL)


def plain_attention(q, k, v, nq, *, scale, causal, window, softcap, sinks, slopes, mask):
    """One sequence, float64: q (Hq, L, D) whose first nq rows are the newest nq of the
    sequence's kv tokens; k (Hkv, S, D), v (Hkv, S, Dv)."""
    Hq, L, _ = q.shape
    G = Hq // k.shape[0]
    k, v = np.repeat(k, G, axis=0), np.repeat(v, G, axis=0)
    S = k.shape[1]
    s = q @ k.transpose(0, 2, 1) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    diag = i + S - nq
    ok = np.broadcast_to(i < nq, (L, S)).copy()
    if causal:
        ok &= j <= diag
    if window is not None:
        ok &= (j >= diag - window[0]) & (j <= diag + window[1])
    if slopes is not None:
        s = s - slopes[:, None, None] * np.abs(diag - j)
    if mask is not None:
        s = s + mask
    s = np.where(ok, s, -np.inf)
    m = np.maximum(
        s.max(-1, keepdims=True, initial=-np.inf),
        -np.inf if sinks is None else sinks[:, None, None],
    )
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[:, None, None] - m))
    return (e / np.where(tot > 0, tot, 1)) @ v


@pytest.mark.parametrize(
    "opts",
    [
        dict(causal=True),
        dict(causal=True, window=(3, 0), softcap=1.5),
        dict(causal=False, sinks=True, alibi=True, mask=True),
    ],
)
@pytest.mark.parametrize("keys_per_step", [1, 6, 128])  # 1 or 2 pages per step, or all
def test_paged_attend_equals_plain_attention(backend, opts, keys_per_step, monkeypatch):
    thin(backend, False)
    monkeypatch.setattr(PagedKVCache, "keys_per_step", keys_per_step)
    rng = np.random.default_rng(13)
    B, Hq, Hkv, D, Dv, P = 3, 4, 2, 5, 3, 3
    kv_len, nq = [7, 2, 0], [2, 1, 0]
    cache = PagedKVCache(
        batch_size=B,
        num_pages=9,
        page_size=P,
        num_kv_heads=Hkv,
        head_dim=D,
        value_dim=Dv,
        xp=backend.xp,
        device=backend.device,
        dtype=backend.xp.float64,
    )
    rng.shuffle(cache.free_pages)
    k = rng.standard_normal((B, Hkv, 7, D))
    v = rng.standard_normal((B, Hkv, 7, Dv))
    cache.append(backend.asarray(k[:, :, :4]), backend.asarray(v[:, :, :4]), [4, 2, 0])
    cache.append(backend.asarray(k[:, :, 4:]), backend.asarray(v[:, :, 4:]), [3, 0, 0])
    q = rng.standard_normal((B, Hq, 2, D))
    sinks = rng.standard_normal(Hq) if opts.get("sinks") else None
    slopes = np.array([0.5, 0.25, 0.125, 0.0625]) if opts.get("alibi") else None
    mask = rng.standard_normal((B, 1, 2, 7)) if opts.get("mask") else None
    kw = dict(
        scale=0.4, causal=opts["causal"], window=opts.get("window"), softcap=opts.get("softcap")
    )
    out = cache.attend(
        backend.asarray(q),
        nq,
        **kw,
        attn_mask=None if mask is None else backend.asarray(mask),
        sinks=None if sinks is None else backend.asarray(sinks),
        alibi_slopes=None if slopes is None else backend.asarray(slopes),
    )
    out = backend.to_numpy(out)
    for b in range(B):
        want = plain_attention(
            q[b],
            k[b, :, : kv_len[b]],
            v[b, :, : kv_len[b]],
            nq[b],
            **kw,
            sinks=sinks,
            slopes=slopes,
            mask=None if mask is None else mask[b, :, :, : kv_len[b]],
        )
        np.testing.assert_allclose(out[b, :, : nq[b]], want[:, : nq[b]], **TOL)
        assert not np.any(out[b, :, nq[b] :])  # padded query rows are 0


def test_cache_constructor_and_allocate_arguments():
    with pytest.raises(TypeError, match=r"length must be an int >= 0, got float 2.5"):
        KVCache(np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2)), length=2.5)
    assert KVCache.allocate(1, 1, 4, np.int64(2), xp=np).head_dim == 2
    with pytest.raises(TypeError, match="head_dim must be an int >= 1, got float 2.0"):
        KVCache.allocate(1, 1, 4, 2.0)
    with pytest.raises(ValueError, match="max_length must be an int >= 1, got 0"):
        KVCache.allocate(1, 1, 0, 2)
    with pytest.raises(TypeError, match="page_size must be an int"):
        PagedKVCache(batch_size=1, num_pages=2, page_size=1.5, num_kv_heads=1, head_dim=2)
    cache = KVCache(np.zeros((2, 1, 4, 2)), np.zeros((2, 1, 4, 2)), length=[1, 3])
    with pytest.raises(ValueError, match="cache.lengths"):
        _ = cache.length


class _NumpyBackend:
    name = "numpy"
    xp = np
    device = "cpu"

    @staticmethod
    def asarray(a):
        return np.asarray(a)

    @staticmethod
    def to_numpy(a):
        return np.asarray(a)


_NP = _NumpyBackend()


def test_cache_dtype_follows_the_parameters_with_or_without_xp(backend):
    thin(backend, False)
    mha = MultiHeadAttention(**CFG)
    p = {k: backend.asarray(v) for k, v in params(mha).items()}  # float64
    x = backend.asarray(np.random.default_rng(20).standard_normal((3, 2, 16)))
    for cache in (
        mha.new_cache(3, 4),
        mha.new_cache(3, 4, xp=backend.xp, device=backend.device),  # provisional float32
        mha.new_paged_cache(3, num_pages=6, page_size=2),
    ):
        mha(p, x, cache=cache)
        assert cache.dtype == backend.xp.float64, cache
        assert cache.lengths.tolist() == [2, 2, 2]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    page_size=st.integers(1, 4),
    schedule=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=1, max_size=5),
    finish=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_any_schedule_of_ragged_appends_equals_recomputation(page_size, schedule, finish, seed):
    """Two sequences, each call adding 0-3 tokens per row (right-padded), the first
    sequence replaced by a new one after ``finish`` calls: the contiguous and the paged
    cache (pages shuffled) give each sequence's uncached result at every real row."""
    mha = MultiHeadAttention(
        embed_dim=8, num_heads=2, num_kv_heads=1, rope="interleaved", causal=True, softcap=4.0
    )
    p = params(mha, seed % 97)
    rng = np.random.default_rng(seed)
    caches = [
        mha.new_cache(2, 16),
        mha.new_paged_cache(2, num_pages=32 // page_size + 2, page_size=page_size),
    ]
    rng.shuffle(caches[1].free_pages)
    seqs = [[], []]  # the tokens of each row's current sequence
    for call, n in enumerate(schedule):
        if call == finish:
            for c in caches:
                c.reset(0)
            seqs[0] = []
        x = rng.standard_normal((2, max(max(n), 1), 8))
        outs = [mha(p, x, cache=c, lengths=n) for c in caches]
        for b in range(2):
            seqs[b].extend(x[b, : n[b]])
            if n[b]:
                want = alone(mha, p, np.array(seqs[b]))[-n[b] :]
                for out in outs:
                    np.testing.assert_allclose(out[b, : n[b]], want, **TOL)
        for c in caches:
            assert c.lengths.tolist() == [len(s) for s in seqs]


def test_need_weights_with_a_per_sequence_cache_equal_recomputation():
    mha = MultiHeadAttention(**CFG)
    p = params(mha, 21)
    x = np.random.default_rng(22).standard_normal((3, 5, 16))
    cache = mha.new_cache(3, 8)
    _, w = mha(p, x, cache=cache, lengths=N, need_weights=True, average_attn_weights=False)
    step = np.random.default_rng(23).standard_normal((3, 1, 16))
    _, w_step = mha(p, step, cache=cache, need_weights=True, average_attn_weights=False)
    for b, n in enumerate(N):
        seq = np.concatenate([x[b, :n], step[b]])[None]
        _, want = mha(p, seq, need_weights=True, average_attn_weights=False)
        np.testing.assert_allclose(w[b, :, :n, :n], want[0, :, :n, :n], **TOL)
        np.testing.assert_allclose(w_step[b, :, 0, : n + 1], want[0, :, n], **TOL)
        assert not np.any(w_step[b, :, 0, n + 1 :])  # other rows' positions: no weight
