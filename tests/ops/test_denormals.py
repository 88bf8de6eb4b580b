"""Subnormals flushed to zero on the NumPy fast path's threads
(``arrayattn.attention.denormals``): the flag is set inside the block and on the pool's
workers only, the caller's floating-point state comes back unchanged, and on scores whose
exponentials fall in float32's subnormal range (rows spread by more than ~87) the fast
path still matches the float64 reference, forward and backward.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.attention import denormals
from arrayattn.attention import threads as _fast_threads
from arrayattn.testing import reference_attention, reference_vjp

TINY = np.array([1e-38], np.float32)


def _flushes() -> bool:
    """Whether this thread flushes a subnormal product to zero now."""
    return float((TINY * np.float32(0.5))[0]) == 0.0


needs_flush = pytest.mark.skipif(
    not denormals.available(), reason="flushing needs x86-64 Linux with glibc"
)


@needs_flush
def test_flushed_sets_the_flag_inside_and_restores_it_after():
    assert not _flushes()
    with denormals.flushed():
        assert _flushes()
        with denormals.flushed():  # nested: the outer state comes back
            assert _flushes()
        assert _flushes()
    assert not _flushes()


@needs_flush
def test_flushed_restores_after_an_exception():
    with pytest.raises(RuntimeError), denormals.flushed():
        raise RuntimeError("inside")
    assert not _flushes()


@needs_flush
def test_other_threads_are_not_touched():
    seen: list[bool] = []
    ready, done = threading.Event(), threading.Event()

    def other() -> None:
        ready.wait()
        seen.append(_flushes())
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with denormals.flushed():
        ready.set()
        done.wait(10)
    t.join()
    assert seen == [False]


def test_opt_out_by_environment(monkeypatch):
    monkeypatch.setenv("ARRAYATTN_FLUSH_DENORMALS", "0")
    assert not denormals.available()
    with denormals.flushed():
        assert not _flushes()


@needs_flush
@pytest.mark.parametrize("serial", [True, False])
def test_units_run_flushed_and_the_caller_is_restored(serial, monkeypatch):
    monkeypatch.setattr(_fast_threads, "num_threads", lambda: 2)
    seen: list[bool] = []

    def work(state: None, unit: int) -> None:
        seen.append(_flushes())

    _fast_threads._run_units([0, 1, 2, 3], lambda: None, work, serial)
    assert seen == [True] * 4
    assert not _flushes()


@pytest.mark.parametrize("flush", ["1", "0"])
def test_fast_path_on_subnormal_exponentials_matches_float64(flush, monkeypatch):
    # Scores with standard deviation ~36: a row spreads by hundreds, so many exponentials
    # of the exact (running-maximum) path fall in float32's subnormal range, where the
    # flush gives 0 instead of a value under 1.2e-38. Both agree with float64.
    monkeypatch.setenv("ARRAYATTN_FLUSH_DENORMALS", flush)
    rng = np.random.default_rng(7)
    q, k, v, d_out = (rng.standard_normal((1, 2, 256, 64)).astype(np.float32) for _ in range(4))
    q, k = q * 6, k * 6
    scores = (q[0, 0].astype(np.float64) @ k[0, 0].T.astype(np.float64)) / 8
    shifted = scores - scores.max(-1, keepdims=True)
    assert ((shifted < -87.4) & (shifted > -103)).mean() > 0.05  # subnormal exp(shifted)
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="fast")
    grads = pullback(d_out)
    want, _ = reference_attention(q, k, v)
    ref = reference_vjp(d_out, q, k, v)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5 * np.abs(want).max())
    for name, g, w in zip("qkv", grads, (ref.query, ref.key, ref.value), strict=True):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-4, (name, err)
