"""One ``KVCache`` / ``PagedKVCache`` shared by threads (issue 35): concurrent appends
serialise under the cache's lock, so the cache ends as some sequential order of the
appends leaves it: every append's rows contiguous and whole, each key row beside its own
value row, lengths the total. Module calls sharing a cache are atomic too (the positions
a call reads are the ones it appends at), and reads or pickles during appends see whole
appends. Without the lock every one of these failed (lost rows, keys paired with another
append's values, ``IndexError`` in the paged cache)."""

from __future__ import annotations

import pickle
import sys
import threading

import numpy as np
import pytest

from arrayattn.nn import KVCache, MultiHeadAttention, PagedKVCache

THREADS, APPENDS, ROUNDS = 4, 40, 10
B, H, D = 2, 1, 3


@pytest.fixture(autouse=True)
def fast_switching():
    """Switch threads every microsecond (the default is 5 ms): interleavings that a
    cache without a lock gets wrong happen in every round."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def tagged(tag: int, lengths: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Keys ``(B, H, l, D)`` whose every entry of row ``b`` is ``tag + b / 10`` (position
    ``i`` adds ``i / 1000``), values its negation: each token says which append wrote it
    and where in that append it stood."""
    l = max(lengths)
    k = np.zeros((B, H, l, D))
    for b in range(B):
        k[b, :, :, :] = tag + b / 10 + np.arange(l)[None, :, None] / 1000
    return k, -k, lengths


def hammer(cache, seed: int) -> list[tuple[int, list[int]]]:
    """THREADS threads append APPENDS tagged blocks each (ragged lengths), started
    together; returns every (tag, lengths) appended."""
    rng = np.random.default_rng(seed)
    plans = [
        [(1000 * (t + 1) + i, [int(rng.integers(1, 4)), int(rng.integers(0, 4))]) for i in
         range(APPENDS)]
        for t in range(THREADS)
    ]  # fmt: skip
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def work(plan):
        try:
            barrier.wait()
            for tag, n in plan:
                k, v, n = tagged(tag, n)
                cache.append(k, v, lengths=n)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in plans]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    return [entry for plan in plans for entry in plan]


def rows_of(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sequence's held keys and values ``(n, H, D)``, read through the cache's own
    layout (a contiguous row, or pages through the block table)."""
    out = []
    for b, n in enumerate(cache.lengths.tolist()):
        if isinstance(cache, KVCache) or n == 0:
            k, v = cache.keys[b, :, :n], cache.values[b, :, :n]
            if n == 0:
                k = v = np.zeros((H, 0, D))
        else:
            P = cache.page_size
            pages = cache.block_tables[b]
            k = np.concatenate([cache.keys[p] for p in pages], axis=1)[:, :n]
            v = np.concatenate([cache.values[p] for p in pages], axis=1)[:, :n]
            assert len(pages) == -(-n // P)
        out.append((np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1)))
    return out


def check_sequential(cache, appended) -> None:
    """The cache holds, per row, whole appends one after another (each append's tokens
    contiguous and in order), every key beside its own value, nothing lost."""
    expect = {tag: n for tag, n in appended}
    total = np.sum([n for _, n in appended], axis=0)
    assert cache.lengths.tolist() == total.tolist()
    for b, (k, v) in enumerate(rows_of(cache)):
        np.testing.assert_array_equal(v, -k)  # each key row with its own value row
        pos, seen = 0, []
        while pos < len(k):
            tag = int(round(float(k[pos, 0, 0]) - b / 10))
            m = expect.get(tag, [0] * B)[b]
            assert m > 0, f"row {b} position {pos} holds {k[pos, 0, 0]}, written by no append"
            want = tag + b / 10 + np.arange(m) / 1000
            got = k[pos : pos + m, 0, 0]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)  # whole and contiguous
            seen.append(tag)
            pos += m
        assert sorted(seen) == sorted(tag for tag, n in appended if n[b])  # none lost, once


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_concurrent_appends_equal_some_sequential_order(kind):
    need = THREADS * APPENDS * 3
    for r in range(ROUNDS):
        if kind == "contiguous":
            cache = KVCache.allocate(B, H, need, D, xp=np, dtype=np.float64)
        else:
            cache = PagedKVCache(
                batch_size=B, num_pages=2 * need // 4 + 4, page_size=4, num_kv_heads=H,
                head_dim=D, xp=np, dtype=np.float64,
            )  # fmt: skip
        appended = hammer(cache, seed=r)
        check_sequential(cache, appended)
        if kind == "paged":
            used = [p for t in cache.block_tables for p in t]
            assert len(used) == len(set(used)) == cache.pages_in_use
            assert sorted(used + cache.free_pages) == list(range(cache.num_pages))


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_concurrent_resets_and_appends_keep_the_cache_consistent(kind):
    """Appends racing with resets/frees: whatever the order, lengths match what the rows
    hold and (paged) no page is lost or held twice."""
    if kind == "contiguous":
        cache = KVCache.allocate(B, H, 64, D, xp=np, dtype=np.float64)
    else:
        cache = PagedKVCache(
            batch_size=B, num_pages=32, page_size=4, num_kv_heads=H, head_dim=D, xp=np,
            dtype=np.float64,
        )  # fmt: skip
    stop = threading.Event()
    errors: list[BaseException] = []

    def appender(tag0):
        try:
            for i in range(300):
                k, v, n = tagged(tag0 + i, [1, 2])
                try:
                    cache.append(k, v, lengths=n)
                except ValueError as e:  # full: a clear overflow error, nothing written
                    assert "overflow" in str(e)
        except BaseException as e:
            errors.append(e)

    def resetter():
        try:
            while not stop.is_set():
                cache.reset(0)
                cache.reset()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=appender, args=(1000 * (i + 1),)) for i in range(2)]
    threads.append(threading.Thread(target=resetter))
    for th in threads:
        th.start()
    for th in threads[:2]:
        th.join(timeout=60)
    stop.set()
    threads[2].join(timeout=60)
    assert not errors, errors
    for k, v in rows_of(cache):
        np.testing.assert_array_equal(v, -k)
    if kind == "paged":
        used = [p for t in cache.block_tables for p in t]
        assert sorted(used + cache.free_pages) == list(range(cache.num_pages))


def test_module_calls_sharing_a_cache_are_atomic():
    """Two threads decoding the same token into one cache: each call reads the lengths
    it appends at, so the outputs are exactly those of the sequential run (positions
    0..2N-1 once each), bit for bit, and the cache equals the sequential run's."""
    mha = MultiHeadAttention(16, 2, rope="half", causal=True)
    p = mha.init(seed=0, xp=np, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((1, 1, 16))
    N = 30

    def new(kind):
        if kind == "contiguous":
            return mha.new_cache(1, 2 * N, xp=np, dtype=np.float64)
        return mha.new_paged_cache(1, num_pages=2 * N // 4 + 1, page_size=4)

    for kind in ("contiguous", "paged"):
        seq_cache = new(kind)
        sequential = sorted(mha(p, x, cache=seq_cache).tobytes() for _ in range(2 * N))
        cache = new(kind)
        outs: list[bytes] = []
        barrier = threading.Barrier(2)

        def work(cache=cache, outs=outs, barrier=barrier):
            barrier.wait()
            for _ in range(N):
                outs.append(mha(p, x, cache=cache).tobytes())

        threads = [threading.Thread(target=work) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert cache.lengths.tolist() == [2 * N]
        np.testing.assert_array_equal(cache.keys, seq_cache.keys)  # bit for bit
        np.testing.assert_array_equal(cache.values, seq_cache.values)
        assert sorted(outs) == sequential, kind


def test_reads_and_pickles_during_appends_see_whole_appends():
    """``lengths``, ``filled`` and pickling while another thread appends blocks of 3:
    every state read holds whole blocks (lengths multiples of 3, filled keys consistent
    with their values)."""
    cache = KVCache.allocate(1, 1, 3 * 400, 2, xp=np, dtype=np.float64)
    done = threading.Event()

    def writer():
        for i in range(400):
            k = np.full((1, 1, 3, 2), float(i + 1))
            cache.append(k, -k)
        done.set()

    th = threading.Thread(target=writer)
    th.start()
    reads = 0
    while not done.is_set() or reads < 5:
        with cache.lock:  # lengths and filled from one state
            n = int(cache.lengths[0])
            k, v = (a.copy() for a in cache.filled())
        assert n % 3 == 0
        np.testing.assert_array_equal(v[:, :, :n], -k[:, :, :n])
        copy = pickle.loads(pickle.dumps(cache))
        m = int(copy.lengths[0])
        assert m % 3 == 0
        np.testing.assert_array_equal(copy.values[:, :, :m], -copy.keys[:, :, :m])
        assert (copy.keys[0, 0, :m, 0] == np.repeat(np.arange(1, m // 3 + 1), 3)).all()
        reads += 1
    th.join(timeout=60)
    assert not th.is_alive()
