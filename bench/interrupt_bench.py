"""Interrupts during attention calls: a real SIGINT sent while a call runs, on each path.

For each scenario the process sends itself ``SIGINT`` ``--delay`` seconds into a long
call and measures: the time until ``KeyboardInterrupt`` reaches the caller, the CPU time
the process burns in the half second after it (the pool's threads still computing
abandoned work would show here), the threads still running then (``/proc``), and whether
the next call gives bit-for-bit the result of a call made before the interrupt.

    python bench/interrupt_bench.py [--repeat 5] [--scenarios fast-forward,chunked]
    python bench/interrupt_bench.py --repeat 1 --json     # what the tests run

Also ``worker-error``: a ``MemoryError`` raised inside one of the pool's workers (no
signal) must reach the caller with its type while the other workers stop.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import arrayattn as aa

SDPA = aa.scaled_dot_product_attention
SETTLE_S = 0.5
"""How long after the interrupt the process's CPU time and threads are watched."""
_CLUSTER: list[Any] = []
"""The in-process ``LocalCluster`` and its ``Client`` of the dask-distributed scenario."""


def _running_threads() -> list[str]:
    """The names of this process's threads in state R (running) other than the caller,
    from /proc (``["?"]`` where /proc is not there)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return ["?"]
    running = []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "R":
            running.append(stat[stat.index("(") + 1 : stat.rindex(")")])
    return running


def _interrupt(call: Callable[[], Any], delay: float) -> dict[str, Any]:
    """Run ``call`` with a SIGINT sent to this process after ``delay`` seconds."""
    sent: list[float] = []

    def send() -> None:
        time.sleep(delay)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        call()
    except KeyboardInterrupt as exc:
        caught = time.perf_counter()
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = "?" if tb is None else f"{tb.tb_frame.f_code.co_name}:{tb.tb_lineno}"
    else:  # finished first: the signal may still arrive
        try:
            sender.join()
            time.sleep(0.1)
        except KeyboardInterrupt:
            pass
        return {"completed_first": True}
    sender.join()
    return {
        "completed_first": False,
        "surface_s": caught - sent[0],
        "raised_in": where,
        **_settle(),
    }


def _pool_cpu() -> float:
    """CPU seconds the fast path's pool threads have used so far (/proc; 0 without)."""
    from arrayattn.attention import threads as fast_threads

    pool = fast_threads._POOL
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for t in list(getattr(pool, "_threads", ())):
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def _settle() -> dict[str, Any]:
    """CPU time this process burns over the next :data:`SETTLE_S` seconds (all of it, and
    its second half: OpenBLAS's own threads spin for a while after any product before
    they sleep, which the first half shows), and the threads running half way."""
    cpu0, pool0 = time.process_time(), _pool_cpu()
    time.sleep(SETTLE_S / 2)
    running = _running_threads()
    cpu_mid = time.process_time()
    time.sleep(SETTLE_S / 2)
    cpu_end = time.process_time()
    return {
        "cpu_after_s": cpu_end - cpu0,
        "cpu_late_s": cpu_end - cpu_mid,
        "pool_cpu_after_s": _pool_cpu() - pool0,
        "running_threads": running,
    }


def _inputs(b: int, h: int, n: int, e: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, h, n, e)).astype(np.float32) for _ in range(3))


def _vjp(q, k, v, implementation: str) -> tuple[np.ndarray, ...]:
    out, pullback = aa.vjp(SDPA, q, k, v, implementation=implementation)
    return (out,) + tuple(pullback(np.ones_like(out)))


def _scenarios(scale: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """name -> (a long call to interrupt, a short call to compare before and after)."""
    n = 1024 * scale
    big = _inputs(1, 8, n, 64)
    small = _inputs(2, 4, 384, 16, seed=1)  # above the fast path's serial threshold
    scenarios: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    # The fast path's forward alone finished L = 4096 at H = 8 in under the 0.2 s the
    # test waits on a quiet 2-core machine: it gets four times the heads.
    wide = _inputs(1, 32, n, 64)
    for impl in ("fast", "chunked", "composed"):
        scenarios[f"{impl}-forward"] = (
            lambda impl=impl: SDPA(*(wide if impl == "fast" else big), implementation=impl),
            lambda impl=impl: SDPA(*small, implementation=impl),
        )
        scenarios[f"{impl}-forward+backward"] = (
            lambda impl=impl: _vjp(*big, impl),
            lambda impl=impl: _vjp(*small, impl),
        )
    try:
        import dask
        import dask.array as da
    except ImportError:
        return scenarios

    def lazy(xs, chunk):
        return [da.from_array(x, chunks=(1, 2, chunk, x.shape[-1])) for x in xs]

    def dask_call(xs, chunk, scheduler):
        out, pullback = aa.vjp(SDPA, *lazy(xs, chunk))
        return dask.compute(out, *pullback(da.ones_like(out)), scheduler=scheduler)

    scenarios["dask-threads"] = (
        lambda: dask_call(big, 512, "threads"),
        lambda: dask_call(small, 128, "threads"),
    )
    try:
        import distributed
    except ImportError:
        return scenarios
    cluster = _CLUSTER

    def client() -> Any:
        """A 2-worker cluster in this process (threads), started on first use."""
        if not cluster:
            lc = distributed.LocalCluster(
                n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
            )
            cluster.extend([lc, distributed.Client(lc, set_as_default=False)])
        return cluster[1]

    scenarios["dask-distributed"] = (
        lambda: dask_call(big, 512, client()),
        lambda: dask_call(small, 128, client()),
    )
    return scenarios


def _worker_error() -> dict[str, Any]:
    """A MemoryError raised in one pool worker: its type reaches the caller, the other
    workers stop early, the next call is equal."""
    from arrayattn.attention.fast import forward as fast_forward

    q, k, v = _inputs(2, 8, 1024, 32)
    want = SDPA(q, k, v, implementation="fast")
    real = fast_forward._tile
    calls = [0]
    lock = threading.Lock()

    def failing(*args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[0] += 1
            mine = calls[0]
        if mine == 3:
            raise MemoryError("planted: a tile could not allocate")
        time.sleep(0.02)  # the other workers are mid-call when it fails
        return real(*args, **kwargs)

    def counting(*args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[0] += 1
        return real(*args, **kwargs)

    fast_forward._tile = counting
    try:
        SDPA(q, k, v, implementation="fast")
    finally:
        fast_forward._tile = real
    total, calls[0] = calls[0], 0
    fast_forward._tile = failing
    t0 = time.perf_counter()
    try:
        SDPA(q, k, v, implementation="fast")
    except MemoryError as exc:
        raised = type(exc).__name__
    else:
        raised = "nothing"
    finally:
        fast_forward._tile = real
    surface = time.perf_counter() - t0
    ran = calls[0]
    settled = _settle()
    again = SDPA(q, k, v, implementation="fast")
    return {
        "completed_first": False,
        "raised": raised,
        "tiles_started": ran,
        "tiles_total": total,
        "surface_s": surface,
        **settled,
        "next_equal": bool(np.array_equal(again, want)),
    }


def run(names: list[str] | None, delay: float, scale: int) -> dict[str, dict[str, Any]]:
    """Each scenario once: ``{name: measurements}``."""
    results: dict[str, dict[str, Any]] = {}
    scenarios = _scenarios(scale)
    for name, (long_call, short_call) in scenarios.items():
        if names and name not in names:
            continue
        before = short_call()
        r = _interrupt(long_call, delay)
        after = short_call()
        flat = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
        r["next_equal"] = all(
            np.array_equal(a, b) for a, b in zip(flat(before), flat(after), strict=True)
        )
        results[name] = r
    if not names or "worker-error" in names:
        results["worker-error"] = _worker_error()
    return results


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0] * 1000:.0f}"
    return f"{statistics.median(xs) * 1000:.0f} ({min(xs) * 1000:.0f}-{max(xs) * 1000:.0f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--delay", type=float, default=0.3, help="seconds into the call")
    ap.add_argument("--scale", type=int, default=4, help="L = S = 1024 * scale")
    ap.add_argument("--scenarios", default="", help="comma-separated names (default all)")
    ap.add_argument("--json", action="store_true", help="print the runs as JSON")
    ap.add_argument("--names", action="store_true", help="name the threads found running")
    args = ap.parse_args(argv)
    # A process started in the background by a non-interactive shell (`cmd &`) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler: every call
    # would "finish before the signal". The runs measure the handler, so install it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    names = [s for s in args.scenarios.split(",") if s] or None
    try:
        runs = [run(names, args.delay, args.scale) for _ in range(args.repeat)]
    finally:
        for x in reversed(_CLUSTER):
            x.close()
    if args.json:
        print(json.dumps(runs))
        return 0
    print(f"SIGINT {args.delay} s into each call; L = S = {1024 * args.scale}, "
          f"{args.repeat} runs: median (min-max)")
    print(
        "| scenario | surfaces after (ms) | process CPU in the 0.5 s after (ms) | of which "
        "in 0.25-0.5 s (ms) | pool threads' CPU after (ms) | threads running at 0.25 s "
        "| next call equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in runs[0]:
        rs = [r[name] for r in runs if not r[name]["completed_first"]]
        if args.names:
            print(name, [(r.get("running_threads"), r.get("raised_in"), round(r["surface_s"], 3))
                         for r in rs], file=sys.stderr)
        if not rs:
            print(f"| {name} | finished before the signal | | | | | |")
            continue
        print(
            f"| {name} | {_spread([r['surface_s'] for r in rs])} | "
            f"{_spread([r['cpu_after_s'] for r in rs])} | "
            f"{_spread([r['cpu_late_s'] for r in rs])} | "
            f"{_spread([r['pool_cpu_after_s'] for r in rs])} | "
            f"{max(len(r['running_threads']) for r in rs)} | "
            f"{all(r['next_equal'] for r in rs)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
