"""Caches after a failure (issue 35): a paged pool that runs out part way through a batch,
a contiguous cache full in one row of a batch, every other misuse of every mutating
method, and appends interrupted part way (``KeyboardInterrupt``, ``MemoryError``) leave
the cache exactly as it was (all of its state compared before and after); sizes and
lengths near integer limits are clear errors, computed without wrapping or rounding."""

from __future__ import annotations

import numpy as np
import pytest

import arrayattn.nn.attention.cache as cache_module
import arrayattn.nn.attention.decode as decode_module
import arrayattn.nn.paged_kv_cache as paged_module
from arrayattn.nn import KVCache, MultiHeadAttention, PagedKVCache

H, D = 2, 4
MHA = MultiHeadAttention(8, 2, rope="half", causal=True)
P = MHA.init(seed=0, xp=np, dtype=np.float64)


def snapshot(cache) -> tuple:
    """All of a cache's state: lengths, whole buffers (stale parts too), and for a paged
    cache its block tables and the free list in order."""
    keys = None if cache.keys is None else cache.keys.copy()
    values = None if cache.values is None else cache.values.copy()
    extra = ()
    if isinstance(cache, PagedKVCache):
        extra = ([list(t) for t in cache.block_tables], list(cache.free_pages))
    return (cache.lengths.tolist(), str(cache.dtype), keys, values) + extra


def held(cache) -> tuple:
    """The state a reader can see: lengths, tables, free list and the held tokens only
    (an interrupted write may leave stale positions changed, which nothing reads)."""
    lengths = cache.lengths.tolist()
    if isinstance(cache, KVCache):
        toks = [(cache.keys[b, :, :n].copy(), cache.values[b, :, :n].copy()) for b, n in
                enumerate(lengths)]  # fmt: skip
        return lengths, toks
    toks = []
    for b, n in enumerate(lengths):
        for t in range(n):
            page, off = cache.block_tables[b][t // cache.page_size], t % cache.page_size
            toks.append((cache.keys[page, :, off].copy(), cache.values[page, :, off].copy()))
    return lengths, [list(t) for t in cache.block_tables], list(cache.free_pages), toks


def assert_equal_states(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            np.testing.assert_array_equal(x, y)
        elif isinstance(x, list) and x and isinstance(x[0], tuple):
            for (k1, v1), (k2, v2) in zip(x, y, strict=True):
                np.testing.assert_array_equal(k1, k2)
                np.testing.assert_array_equal(v1, v2)
        else:
            assert x == y


def entries(B, l, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, H, l, D)).astype(dtype), rng.standard_normal(
        (B, H, l, D)
    ).astype(dtype)


def paged(B=3, num_pages=6, page_size=4, shuffle=True):
    cache = PagedKVCache(
        batch_size=B, num_pages=num_pages, page_size=page_size, num_kv_heads=H, head_dim=D,
        xp=np, dtype=np.float64,
    )  # fmt: skip
    if shuffle:
        np.random.default_rng(0).shuffle(cache.free_pages)
    return cache


def test_a_pool_exhausted_mid_batch_names_the_pool_and_changes_nothing():
    cache = paged()
    k, v = entries(3, 5)
    cache.append(k, v, lengths=[3, 5, 0])  # 1 + 2 pages held, 3 free
    before = snapshot(cache)
    k, v = entries(3, 8, seed=1)
    # Rows 0 and 1 need one more page each and fit; row 2 needs 2 of the 1 left.
    with pytest.raises(ValueError) as err:
        cache.append(k, v, lengths=[2, 4, 8])
    msg = str(err.value)
    for part in ("sequence 2", "need 2 more pages", "only 1 of 6 pages are free",
                 "sequences 0..1 take 2", "num_pages=6", "3 free before this batch, which "
                 "needs 4", "nothing was written"):  # fmt: skip
        assert part in msg, (part, msg)
    assert_equal_states(snapshot(cache), before)
    # The same through a module call (the pool runs out in the batch's last row).
    cache = MHA.new_paged_cache(3, num_pages=4, page_size=2, xp=np, dtype=np.float64)
    x = np.random.default_rng(2).standard_normal((3, 3, 8))
    MHA(P, x, cache=cache, lengths=[3, 1, 0])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="sequence 2.*num_pages=4"):
        MHA(P, x, cache=cache, lengths=[1, 1, 3])
    assert_equal_states(snapshot(cache), before)
    MHA(P, x, cache=cache, lengths=[1, 1, 0])  # what fits still works
    assert cache.lengths.tolist() == [4, 2, 0]


def test_a_contiguous_cache_full_in_one_row_changes_nothing():
    cache = KVCache.allocate(2, H, 8, D, xp=np, dtype=np.float64)
    k, v = entries(2, 6)
    cache.append(k, v, lengths=[6, 2])
    before = snapshot(cache)
    k, v = entries(2, 7, seed=1)
    with pytest.raises(ValueError, match="overflow in sequence 1: 2 cached \\+ 7 new"):
        cache.append(k, v, lengths=[1, 7])
    assert_equal_states(snapshot(cache), before)


def misuses(kind):
    """(method name, args, kwargs) that must each raise and change nothing."""
    good_k, good_v = entries(2, 2)
    out = [
        ("append", (good_k[0], good_v[0]), {}),  # 3-D
        ("append", (good_k[:, :1], good_v[:, :1]), {}),  # heads
        ("append", (good_k[..., :3], good_v[..., :3]), {}),  # head_dim
        ("append", (good_k, good_v[:, :, :1]), {}),  # value length
        ("append", (good_k, good_v.astype(np.float32)), {}),  # key/value dtypes
        ("append", (good_k.astype(np.float32), good_v.astype(np.float32)), {}),  # cache dtype
        ("append", (good_k, good_v), {"lengths": [1]}),  # rows
        ("append", (good_k, good_v), {"lengths": [1, 1, 1]}),  # rows beyond the batch
        ("append", (good_k, good_v), {"lengths": [3, 0]}),  # more than given
        ("append", (good_k, good_v), {"lengths": [-1, 1]}),
        ("append", (good_k, good_v), {"lengths": [1.0, 1]}),
        ("append", (good_k, good_v), {"lengths": np.array([1, 1], np.float32)}),
        ("append", (good_k, good_v), {"lengths": np.array([2**64 - 1, 0], np.uint64)}),
        ("append", (good_k, None), {}),
        ("append", ([[1.0]], good_v), {}),
        ("check_append", ([1, 2**62],), {}),
        ("reset", ([0, 5],), {}),  # the valid row 0 is not reset before row 5 is refused
        ("reset", ([1, -1],), {}),
        ("reset", ([0, True],), {}),
        ("reset", ("ab",), {}),
        ("reset", (2.5,), {}),
        ("reset", (np.int64(2),), {}),
    ]
    if kind == "paged":
        out += [
            ("free", ([1, 2],), {}),
            ("attend", (np.ones((2, 2, 1, 3)),), {}),
            ("attend", (np.ones((2, 2, 1, D)),), {"q_lengths": [5, 0]}),
        ]
    return out


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_every_misuse_of_every_method_changes_nothing(kind):
    if kind == "contiguous":
        cache = KVCache.allocate(2, H, 8, D, xp=np, dtype=np.float64)
    else:
        cache = paged(B=2, num_pages=5, page_size=2)
    k, v = entries(2, 3)
    cache.append(k, v, lengths=[3, 1])
    before = snapshot(cache)
    for name, args, kwargs in misuses(kind):
        with pytest.raises((TypeError, ValueError)):
            getattr(cache, name)(*args, **kwargs)
        assert_equal_states(snapshot(cache), before)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="torch"):
        cache.append(torch.asarray(k), torch.asarray(v))
    assert_equal_states(snapshot(cache), before)


def interrupt_after(monkeypatch, target, name, calls, exc):
    """Make ``target.name`` raise ``exc`` on its ``calls + 1``-th call."""
    real = getattr(target, name)
    count = [0]

    def fake(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fake)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_an_append_interrupted_part_way_is_undone(monkeypatch, kind, exc):
    """The interrupt lands after some rows (and pages) were written: lengths, tables,
    free list and held tokens are as before, and the next append equals the cache that
    never saw the interrupted one."""

    def fresh():
        if kind == "contiguous":
            return KVCache.allocate(3, H, 8, D, xp=np, dtype=np.float64)
        return paged(B=3, num_pages=8, page_size=2)

    cache, ref = fresh(), fresh()
    k, v = entries(3, 3)
    for c in (cache, ref):
        c.append(k, v, lengths=[3, 1, 2])
    before = held(cache)
    k2, v2 = entries(3, 3, seed=1)
    with monkeypatch.context() as m:
        if kind == "contiguous":  # row 0's keys and values written, row 1's keys not
            interrupt_after(m, KVCache, "_write", 2, exc)
        else:  # row 0's pages taken and written, row 1 part way
            interrupt_after(m, paged_module, "_put", 3, exc)
        with pytest.raises(exc):
            cache.append(k2, v2, lengths=[2, 3, 1])
    assert_equal_states(held(cache), before)
    k3, v3 = entries(3, 2, seed=2)
    for c in (cache, ref):
        c.append(k3, v3, lengths=[1, 2, 2])
    assert_equal_states(held(cache), held(ref))


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_module_call_interrupted_in_attention_leaves_the_cache_as_it_was(monkeypatch, kind):
    """The keys are appended, then attention raises (MemoryError in a worker, an
    interrupt): the call restores the cache, and the next call gives what it would have."""
    new = (lambda: MHA.new_cache(2, 8)) if kind == "contiguous" else (
        lambda: MHA.new_paged_cache(2, num_pages=8, page_size=2)
    )  # fmt: skip
    cache, ref = new(), new()
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    for c in (cache, ref):
        MHA(P, x, cache=c, lengths=[3, 2])
    before = held(cache)
    # (a decoding step over a contiguous cache on NumPy runs decode.decode_attention;
    # the general path, scaled_dot_product_attention, for the rest)
    targets = [(cache_module, "scaled_dot_product_attention"), (decode_module, "decode_attention")]
    if kind == "paged":
        targets = [(PagedKVCache, "attend")]
    for exc in (MemoryError, KeyboardInterrupt):
        with monkeypatch.context() as m:
            for target in targets:
                interrupt_after(m, *target, 0, exc)
            with pytest.raises(exc):
                MHA(P, x[:, :1], cache=cache)
        assert_equal_states(held(cache), before)
    np.testing.assert_array_equal(MHA(P, x[:, :1], cache=cache), MHA(P, x[:, :1], cache=ref))


def test_capacities_near_integer_limits_are_clear_errors_before_allocating():
    big = [np.int64(2**62), np.int32(2**31 - 1), 2**63 - 1]
    for S in big:
        with pytest.raises(ValueError, match=f"max_length={int(S)}.*nothing was allocated"):
            KVCache.allocate(1, 1, S, 256, xp=np, dtype=np.float32)
    # Without a dtype the buffers come with the first append: refused then, unchanged.
    cache = KVCache.allocate(1, H, np.int64(2**62), D)
    with pytest.raises(ValueError, match="max_length=4611686018427387904"):
        cache.append(*entries(1, 1))
    assert cache.keys is None and cache.lengths.tolist() == [0] and cache.dtype is None
    for pages, size in ((np.int64(2**40), np.int32(2**31 - 1)), (2**62, 2**62)):
        with pytest.raises(ValueError, match=f"num_pages={int(pages)}, page_size={int(size)}"):
            PagedKVCache(
                batch_size=1, num_pages=pages, page_size=size, num_kv_heads=1, head_dim=4,
                xp=np, dtype=np.float32,
            )  # fmt: skip
    for bad in (-1, np.int32(-1), np.int64(-(2**63)), 0):
        with pytest.raises(ValueError, match="max_length"):
            KVCache.allocate(1, 1, bad, 4, xp=np)
        with pytest.raises(ValueError, match="num_pages"):
            PagedKVCache(batch_size=1, num_pages=bad, page_size=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="length"):
        KVCache(np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2)), length=np.int64(-1))


def test_lengths_near_integer_limits_are_exact():
    """Page counts use integer arithmetic (a float ceil of ``2**62 + 1`` tokens rounds
    the page count down); huge or wrapping counts are refused, never wrapped."""
    cache = paged(B=1, num_pages=4, page_size=4, shuffle=False)
    with pytest.raises(ValueError, match=f"need {2**60 + 1} more pages"):
        cache.check_append([2**62 + 1])
    kv = KVCache.allocate(2, 1, 8, 2, xp=np, dtype=np.float64)
    with pytest.raises(ValueError, match=f"0 cached \\+ {2**63 - 1} new tokens"):
        kv.check_append(np.array([2**63 - 1, 0], np.int64))
    for c in (cache, kv):
        for n in (np.array([-1], np.int32), np.array([2**64 - 1], np.uint64)):
            with pytest.raises(ValueError):
                c.check_append(np.resize(n, c.batch_size))
    assert cache.lengths.tolist() == [0] and kv.lengths.tolist() == [0, 0]
