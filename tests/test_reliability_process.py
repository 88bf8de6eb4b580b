"""Reliability of the process-level machinery (issue 12): fork, spawn and forkserver
children, threads calling concurrently, ``ARRAYATTN_NUM_THREADS`` changed at run time,
bit-reproducibility of the threaded fast path, leaks over many calls, and inputs never
modified.

Anything that could hang runs in a subprocess with a timeout, so a deadlock fails the
test instead of blocking CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.attention import threads as _fast_threads

# The wide sweeps (hundreds of random examples, 1000-call loops) run only when asked for:
# ARRAYATTN_WIDE_SWEEP=1. The default run (CI) keeps the fixed-seed subset.
WIDE = pytest.mark.skipif(
    not os.environ.get("ARRAYATTN_WIDE_SWEEP"),
    reason="wide sweep: set ARRAYATTN_WIDE_SWEEP=1",
)

SDPA = aa.scaled_dot_product_attention
ROOT = Path(__file__).resolve().parent.parent


def _run_script(code: str, timeout: float = 120.0, threads: int = 2) -> str:
    """Run ``code`` in a fresh interpreter importing this checkout's arrayattn; fail on a
    non-zero exit or a timeout (a hang)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["ARRAYATTN_NUM_THREADS"] = str(threads)  # the pool runs even on one core
    # A file, not ``-c``: spawn and forkserver children import the main module.
    script = Path(tempfile.mkdtemp()) / "reliability_child.py"
    script.write_text(textwrap.dedent(code))
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=str(ROOT),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout} s (a hang): {exc.stdout} {exc.stderr}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


_CHILD = """
import multiprocessing as mp
import sys
import numpy as np
import arrayattn as aa

Q = np.random.default_rng(0).standard_normal((1, 4, 512, 32)).astype(np.float32)

def child(out):
    o = aa.scaled_dot_product_attention(Q, Q, Q)
    _, pb = aa.vjp(aa.scaled_dot_product_attention, Q, Q, Q, is_causal=True)
    out.put(float(o.sum()) + float(pb(np.ones_like(o))[0].sum()))

def run(method, expected):
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue,))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        sys.exit(f"{method} child hung")
    if p.exitcode != 0:
        sys.exit(f"{method} child failed: {p.exitcode}")
    got = queue.get(timeout=10)
    assert abs(got - expected) <= 1e-3 * max(1.0, abs(expected)), (method, got, expected)
"""


def test_fork_after_the_pool_ran():
    """Item 1: a forked child (multiprocessing's default on Linux, Dask and DataLoader
    workers) works after the parent used the fast path's pool."""
    _run_script(
        _CHILD
        + """
if __name__ == "__main__":
    o = aa.scaled_dot_product_attention(Q, Q, Q)  # the pool now has threads
    _, pb = aa.vjp(aa.scaled_dot_product_attention, Q, Q, Q, is_causal=True)
    expected = float(o.sum()) + float(pb(np.ones_like(o))[0].sum())
    run("fork", expected)
    print("ok")
"""
    )


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_other_start_methods(method):
    """Item 1: no deadlock with spawn or forkserver either (children start fresh)."""
    _run_script(
        _CHILD
        + f"""
if __name__ == "__main__":
    o = aa.scaled_dot_product_attention(Q, Q, Q)
    _, pb = aa.vjp(aa.scaled_dot_product_attention, Q, Q, Q, is_causal=True)
    run({method!r}, float(o.sum()) + float(pb(np.ones_like(o))[0].sum()))
"""
    )


def test_fork_while_another_thread_runs_the_pool():
    """Item 1: fork while a second thread is inside a fast-path call (its locks may be
    held at that moment): the children still work."""
    _run_script(
        _CHILD
        + """
import threading
if __name__ == "__main__":
    o = aa.scaled_dot_product_attention(Q, Q, Q)
    _, pb = aa.vjp(aa.scaled_dot_product_attention, Q, Q, Q, is_causal=True)
    expected = float(o.sum()) + float(pb(np.ones_like(o))[0].sum())
    stop = threading.Event()
    def busy():
        while not stop.is_set():
            aa.scaled_dot_product_attention(Q, Q, Q)
    t = threading.Thread(target=busy)
    t.start()
    try:
        for _ in range(3):
            run("fork", expected)
    finally:
        stop.set()
        t.join()
"""
    )


def _pooled_inputs(L: int = 384):
    # 2 * 4 * 384**2 score elements: above the fast path's serial threshold, so the
    # pool runs.
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, L, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, L, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, L, 16)).astype(np.float32)
    return q, k, v


def test_num_threads_changed_at_run_time(monkeypatch):
    """Item 11: ``ARRAYATTN_NUM_THREADS`` changed while other threads call the fast path
    (it used to shut the pool under them: "cannot schedule new futures after
    shutdown"); every call succeeds and gives the same result."""
    q, k, v = _pooled_inputs()
    monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
    expected = SDPA(q, k, v, enable_gqa=True)
    errors: list[str] = []
    stop = threading.Event()

    def flip() -> None:
        i = 0
        while not stop.is_set():
            os.environ["ARRAYATTN_NUM_THREADS"] = str(1 + i % 4)
            i += 1
            time.sleep(0.001)  # flip often, without starving the callers of the GIL

    def call() -> None:
        for _ in range(3):
            try:
                out = SDPA(q, k, v, enable_gqa=True)
                if not np.allclose(out, expected, rtol=1e-5, atol=1e-6):
                    errors.append("wrong result")
            except Exception as exc:  # the defect raised RuntimeError here
                errors.append(repr(exc))

    flipper = threading.Thread(target=flip)
    callers = [threading.Thread(target=call) for _ in range(3)]
    flipper.start()
    for t in callers:
        t.start()
    for t in callers:
        t.join(120)
    stop.set()
    flipper.join()
    assert not errors, errors[:3]


def test_concurrent_calls_agree(monkeypatch):
    """Threads calling the fast path (and its backward) at once get what one call gets,
    to rounding: overlapping calls share OpenBLAS's process-wide threading, which may
    change the last bits (sequential calls are bit-identical, see below)."""
    monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
    q, k, v = _pooled_inputs()

    def one():
        (out, lse), pb = aa.vjp(SDPA, q, k, v, enable_gqa=True, is_causal=True, return_lse=True)
        return (out, lse) + pb((np.ones_like(out), None))

    expected = one()
    results: list = [None] * 3

    def call(i: int) -> None:
        results[i] = one()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        for a, b in zip(r, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    again = one()
    for a, b in zip(again, expected, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mask_shape", [(1, 1, 384, 384), (2, 1, 384, 384), (1, 4, 1, 384)])
def test_float_mask_gradient_bit_reproducible(monkeypatch, mask_shape):
    """Item 10: on the threaded fast path the gradient of a float mask that broadcasts
    over heads or batch is bit-identical run to run (as are the other outputs)."""
    monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "4")
    q, k, v = _pooled_inputs()
    mask = np.random.default_rng(1).standard_normal(mask_shape).astype(np.float32)
    runs = []
    for _ in range(3):
        out, pb = aa.vjp(SDPA, q, k, v, mask, enable_gqa=True, implementation="fast")
        runs.append((out,) + pb(np.ones_like(out)))
    for r in runs[1:]:
        for a, b in zip(r, runs[0], strict=True):
            np.testing.assert_array_equal(a, b)
    composed = aa.vjp(SDPA, q, k, v, mask, enable_gqa=True, implementation="composed")[1](
        np.ones_like(runs[0][0])
    )
    np.testing.assert_allclose(runs[0][4], composed[3], rtol=2e-4, atol=2e-4)


def _leak_loop(n: int) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 64, 16)).astype(np.float32)
    m = rng.standard_normal((1, 1, 64, 64)).astype(np.float32)
    lens = np.array([50])

    def once() -> None:
        for impl in ("fast", "composed", "chunked"):
            (out, lse), pb = aa.vjp(
                SDPA,
                q,
                q,
                q,
                m,
                kv_lengths=lens,
                is_causal=True,
                return_lse=True,
                implementation=impl,
            )
            pb((np.ones_like(out), np.ones_like(lse)))

    for _ in range(20):  # warm caches (structure masks, pools)
        once()
    threads_before = threading.active_count()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(n):
            once()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < 2**20, f"memory grew by {end - start} bytes over {n} calls"
    assert threading.active_count() <= threads_before


def test_no_leak_over_many_calls():
    """Repeated forward+backward calls on every path hold no growing memory and start
    no new threads (a fixed 150 calls; the slow variant runs 1000)."""
    _leak_loop(150)


@pytest.mark.slow
@WIDE
def test_no_leak_over_1000_calls():
    _leak_loop(1000)


def test_fast_path_pool_is_reused():
    """The pool is created once and kept (a smaller thread count reuses it)."""
    q, k, v = _pooled_inputs()
    SDPA(q, k, v, enable_gqa=True)
    pool = _fast_threads._POOL
    SDPA(q, k, v, enable_gqa=True)
    assert _fast_threads._POOL is pool or pool is None


def _all_calls(rng):
    """(name, fn, args, kwargs) for every public op, with garbage in padding."""
    q = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    k = rng.standard_normal((2, 1, 6, 4)).astype(np.float32)
    k[0, :, 4:] = np.nan
    v = k.copy()
    fm = rng.standard_normal((2, 1, 5, 6)).astype(np.float32)
    lens = np.array([4, 6])
    calls = []
    for impl in ("fast", "composed", "chunked"):
        calls.append(
            (
                f"sdpa-{impl}",
                SDPA,
                (q, k, v, fm),
                dict(enable_gqa=True, kv_lengths=lens, is_causal=True, implementation=impl),
            )
        )
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w = rng.standard_normal((8,)).astype(np.float32)
    freqs = aa.rope_frequencies(4, 5)
    calls += [
        ("attention_weights", aa.attention_weights, (q, k), dict(kv_lengths=lens, enable_gqa=True)),
        ("softmax", aa.softmax, (x,), {}),
        ("split_heads", aa.split_heads, (x, 2), {}),
        ("merge_heads", aa.merge_heads, (q,), {}),
        ("repeat_kv", aa.repeat_kv, (k, 2), {}),
        ("rms_norm", aa.rms_norm, (x, w), {}),
        ("layer_norm", aa.layer_norm, (x, w, w), {}),
        ("apply_rope", aa.apply_rope, (q, freqs), {}),
        (
            "varlen",
            aa.varlen_attention,
            (q[0], k[0], k[0], np.array([0, 2, 5]), np.array([0, 3, 6])),
            dict(is_causal=True),
        ),
        ("merge", aa.merge_attention_states, ([q, q], [q[..., 0], q[..., 1]]), {}),
    ]
    return calls


def test_inputs_are_never_modified():
    """No public op writes into its inputs (forward or backward), on any path, also with
    garbage in padding and with cotangents."""
    rng = np.random.default_rng(0)
    for name, fn, args, kwargs in _all_calls(rng):
        flat = [a for a in args if isinstance(a, np.ndarray)]
        flat += [a for x in args if isinstance(x, list) for a in x]
        flat += [a for a in kwargs.values() if isinstance(a, np.ndarray)]
        before = [a.copy() for a in flat]
        with np.errstate(all="ignore"):
            out = fn(*args, **kwargs)
            if fn in aa.differentiable_ops():
                out, pb = aa.vjp(fn, *args, **kwargs)
                cot = (
                    tuple(np.ones_like(o) for o in out)
                    if isinstance(out, tuple)
                    else np.ones_like(out)
                )
                cot_copy = cot if not isinstance(cot, tuple) else tuple(c.copy() for c in cot)
                pb(cot)
                if isinstance(cot, tuple):
                    for c, c0 in zip(cot, cot_copy, strict=True):
                        np.testing.assert_array_equal(c, c0, err_msg=f"{name}: cotangent")
        for a, b in zip(flat, before, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} modified an input")
