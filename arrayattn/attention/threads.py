"""The NumPy fast path's worker threads: one pool per process, BLAS kept to one thread
while the pool runs, and ``fork`` safety.

- A thread pool runs the fast path's work units (NumPy and BLAS release the GIL). While it
  does, BLAS is limited to one thread through ``threadpoolctl`` when that package is
  installed, so the pool's threads and BLAS's threads do not oversubscribe the cores.
  Without ``threadpoolctl`` the pool still runs; OpenBLAS then decides its own threading
  per product (``pip install threadpoolctl`` is recommended). ``ARRAYATTN_NUM_THREADS``
  sets the number of worker threads (default: the CPUs this process may use), read at
  each call; changing it at run time is safe (the pool only grows, and is never shut down
  under a caller).
- :func:`one_thread` runs a caller's fast-path calls on its own thread (a Dask task).
- ``fork``: a forked child builds its own pool (``os.register_at_fork``), and a fork
  waits for fast-path calls running in other threads (:class:`_ForkGate`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["num_threads", "one_thread"]

_LOCAL = threading.local()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run fast-path calls made on this thread on this thread alone, BLAS included.

    For callers that supply the parallelism themselves: a Dask task (Dask runs one task
    per core, so a task's own pool would oversubscribe them).

    Examples:
        >>> with one_thread():
        ...     num_threads()
        1
    """
    previous = getattr(_LOCAL, "threads", None)
    _LOCAL.threads = 1
    try:
        with _LINGERING_BLAS_LIMIT:
            yield
    finally:
        _LOCAL.threads = previous


def num_threads() -> int:
    """Worker threads the fast path uses: 1 inside :func:`one_thread`, else
    ``ARRAYATTN_NUM_THREADS`` or the usable CPUs.

    Examples:
        >>> num_threads() >= 1
        True
    """
    if getattr(_LOCAL, "threads", None):
        return _LOCAL.threads
    env = os.environ.get("ARRAYATTN_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(
                f"ARRAYATTN_NUM_THREADS must be a positive integer, got {env!r}"
            ) from None
        if n < 1:
            raise ValueError(f"ARRAYATTN_NUM_THREADS must be a positive integer, got {n}")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A pool with at least ``n`` worker threads.

    A pool is never shut down here: another thread may be submitting to it right now (a
    run-time change of ``ARRAYATTN_NUM_THREADS`` used to shut it under that thread's
    feet). A pool that has to grow is replaced and the old one is dropped; its idle
    threads exit once the last caller holding it lets go (the executor is collected).
    A pool larger than ``n`` is kept: callers submit only ``n`` workers to it."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < n:
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="arrayattn-fast")
            _POOL_SIZE = n
        return _POOL


def _after_fork_in_child() -> None:
    """A child made by ``fork`` inherits the pool object but none of its threads (and
    possibly a lock some parent thread held): work submitted there would wait forever.
    Forget both; the child builds its own pool on first use."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL = None
    _POOL_SIZE = 0
    _POOL_LOCK = threading.Lock()
    _BLAS_ONE_THREAD.reset_after_fork()
    _LINGERING_BLAS_LIMIT.reset()
    _FORK_GATE.after_fork_in_child()


class _SingleThreadedBlas:
    """Limits BLAS to one thread while any fast-path call runs its pool (threadpoolctl).

    threadpoolctl's limit is process-wide, so concurrent calls share one limit: the first
    to enter sets it, the last to leave restores the user's setting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._limiter: Any = None
        self._controller: Any = None
        self._ready = False

    def reset_after_fork(self) -> None:
        """In a forked child no fast-path call is running: a fresh lock, no limit held."""
        self._lock = threading.Lock()
        self._depth = 0
        self._limiter = None

    def _get_controller(self) -> Any:
        if not self._ready:
            try:
                from threadpoolctl import ThreadpoolController

                self._controller = ThreadpoolController()
            except Exception:  # not installed (optional), or it failed to inspect
                self._controller = None
            self._ready = True
        return self._controller

    def __enter__(self) -> None:
        with self._lock:
            controller = self._get_controller()
            if controller is not None and self._depth == 0:
                self._limiter = controller.limit(limits=1, user_api="blas")
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._limiter is not None:
                self._limiter.restore_original_limits()
                self._limiter = None


_BLAS_ONE_THREAD = _SingleThreadedBlas()


class _LingeringBlasLimit:
    """``_BLAS_ONE_THREAD`` held across back-to-back :func:`one_thread` blocks (Dask
    tasks), released :data:`LINGER_S` seconds after the last one ends. Handing OpenBLAS
    its threads back between two tasks and taking them again made two concurrent tasks
    30x slower than one after the other on a loaded 2-core machine (measured 2026-11-22;
    with the limit held they run at the serial speed)."""

    LINGER_S = 0.2

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._held = False
        self._generation = 0

    def __enter__(self) -> None:
        with self._lock:
            self._active += 1
            self._generation += 1
            if not self._held:
                _BLAS_ONE_THREAD.__enter__()
                self._held = True

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                timer = threading.Timer(self.LINGER_S, self._release, (self._generation,))
                timer.daemon = True
                timer.start()

    def _release(self, generation: int) -> None:
        with self._lock:
            if self._held and self._active == 0 and self._generation == generation:
                _BLAS_ONE_THREAD.__exit__(None, None, None)
                self._held = False


_LINGERING_BLAS_LIMIT = _LingeringBlasLimit()


class _ForkGate:
    """Keeps ``fork`` from happening while a fast-path call runs in another thread.

    OpenBLAS's own fork handler waits for its threads; forked in the middle of a BLAS
    product (or while the one-thread limit is applied), the parent hung inside ``fork``.
    Calls enter the gate shared; ``os.fork`` (multiprocessing's "fork", Dask and
    DataLoader workers) waits until running calls leave, holds new ones back, and the
    child starts with the gate open. A fork therefore waits for running calls instead of
    deadlocking."""

    def __init__(self) -> None:
        self._open()

    def _open(self) -> None:
        """A fresh, open gate (also the forked child's: the parent's callers are gone)."""
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._forking = 0

    def __enter__(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def before_fork(self) -> None:
        # The lock stays held across fork: no thread is inside the gate's bookkeeping.
        self._cond.acquire()
        self._forking += 1
        while self._active:
            self._cond.wait()

    def after_fork_in_parent(self) -> None:
        self._forking -= 1
        self._cond.notify_all()
        self._cond.release()

    def after_fork_in_child(self) -> None:
        self._open()


_FORK_GATE = _ForkGate()

if hasattr(os, "register_at_fork"):  # POSIX; spawn and forkserver children start fresh
    os.register_at_fork(
        before=_FORK_GATE.before_fork,
        after_in_parent=_FORK_GATE.after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _run_units(
    units: Sequence[Any],
    make_state: Callable[[], Any],
    work: Callable[[Any, Any], None],
    serial: bool,
) -> None:
    """Run ``work(state, unit)`` for every unit, on the pool unless ``serial``; each worker
    thread builds its own ``state`` (its buffers) once and takes units in order."""
    n_env = num_threads()
    n = n_env
    if serial or n == 1 or len(units) <= 1:
        state = make_state()
        for u in units:
            work(state, u)
        return
    n = min(n, len(units))
    counter = itertools.count()
    total = len(units)
    errors = np.geterr()  # np.errstate is per thread: carry the caller's into the workers

    def worker() -> None:
        with np.errstate(**errors):
            state = make_state()
            while True:
                i = next(counter)  # atomic under the GIL
                if i >= total:
                    return
                work(state, units[i])

    with _BLAS_ONE_THREAD:
        # One pool for the whole call, read once: the environment may change meanwhile.
        pool = _pool(n_env)
        futures = [pool.submit(worker) for _ in range(n)]
        for f in futures:
            f.result()


def _fork_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` inside the fork gate (see :class:`_ForkGate`)."""

    @functools.wraps(fn)
    def gated(*args: Any, **kwargs: Any) -> Any:
        with _FORK_GATE:
            return fn(*args, **kwargs)

    return gated
