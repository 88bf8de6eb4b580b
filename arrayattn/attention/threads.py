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
- Interrupts and errors: each call's units share a cancel flag that the workers check
  between units (and long units at :func:`checkpoint`). The caller waits in short
  slices, so ``KeyboardInterrupt`` reaches it at once; it then sets the flag, drops the
  units not started and waits for the running ones to reach their next check (a few
  milliseconds) before re-raising. An exception in a worker (``MemoryError``) stops the
  call's other workers the same way and reaches the caller with its own type. No
  thread keeps computing for a call that has ended, and the pool serves the next call.
- :func:`one_thread` runs a caller's fast-path calls on its own thread (a Dask task).
- Units run with subnormal floats flushed to zero on their thread
  (:mod:`arrayattn.attention.denormals`: an x86 CPU takes ~10x longer over tiles whose
  exponentials are subnormal), the thread's previous state restored after.
- ``fork``: a forked child builds its own pool (``os.register_at_fork``), and a fork
  waits for fast-path calls running in other threads (:class:`_ForkGate`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .denormals import flushed

__all__ = ["checkpoint", "num_threads", "one_thread"]

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


class _Cancelled(Exception):
    """Raised by :func:`checkpoint` in a worker whose call was abandoned; the worker
    catches it and returns (it never reaches a caller)."""


def checkpoint() -> None:
    """Stop this unit of work if its call was abandoned: the caller was interrupted
    (``KeyboardInterrupt``) or another unit of the same call failed.

    The pool's workers check between units; a unit that runs long (the fast backward's
    unit is all the rows of a (batch, KV head) pair) calls this between its blocks, so
    abandoned work stops within one block. On the caller's own thread (serial runs) it
    does nothing: there the exception itself already stops the work.

    Examples:
        >>> checkpoint()  # outside the pool: nothing to stop
    """
    cancel = getattr(_LOCAL, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise _Cancelled


WAIT_POLL_S = 0.05
"""The caller waits for its units in slices of this many seconds, so that a signal
(``KeyboardInterrupt``) reaches it on every platform, not only where lock waits are
interruptible."""
DRAIN_S = 10.0
"""After an interrupt or an error, the caller waits at most this long for the workers to
leave the unit they are in (one block of work: milliseconds) before it re-raises; a
second interrupt ends the wait at once."""


def _wait_all(futures: Sequence[Future[None]], cancel: threading.Event) -> None:
    """Wait until every future is done or one has failed (then cancel the rest)."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=WAIT_POLL_S, return_when=FIRST_EXCEPTION)
        if any(not f.cancelled() and f.exception() is not None for f in done):
            cancel.set()
            return


def _drain(futures: Sequence[Future[None]], cancel: threading.Event) -> None:
    """Stop a call's work: drop the units not started, and wait (bounded, interruptible)
    for the running workers to reach their next check and return, so that no thread is
    left computing for a caller that has gone."""
    cancel.set()
    for f in futures:
        f.cancel()  # queued behind another call's work: never starts
    deadline = time.monotonic() + DRAIN_S
    pending = [f for f in futures if not f.done()]
    # A second interrupt ends the wait (it propagates; the workers still stop).
    while pending and time.monotonic() < deadline:
        wait(pending, timeout=WAIT_POLL_S)
        pending = [f for f in pending if not f.done()]


def _run_units(
    units: Sequence[Any],
    make_state: Callable[[], Any],
    work: Callable[[Any, Any], None],
    serial: bool,
) -> None:
    """Run ``work(state, unit)`` for every unit, on the pool unless ``serial``; each worker
    thread builds its own ``state`` (its buffers) once and takes units in order.

    An exception in a worker (``MemoryError`` included) reaches the caller with its own
    type, once the other workers have stopped at their next unit (or
    :func:`checkpoint`); an exception in the waiting caller (``KeyboardInterrupt``)
    stops the workers the same way before it propagates. Either way no unit of the call
    runs after it returns, and the pool serves the next call."""
    n_env = num_threads()
    n = n_env
    if serial or n == 1 or len(units) <= 1:
        with flushed():  # subnormals: see denormals.py (this thread, restored after)
            state = make_state()
            for u in units:
                work(state, u)
        return
    n = min(n, len(units))
    counter = itertools.count()
    total = len(units)
    errors = np.geterr()  # np.errstate is per thread: carry the caller's into the workers
    cancel = threading.Event()  # this call's: set when it is abandoned

    def worker() -> None:
        if cancel.is_set():
            return
        _LOCAL.cancel = cancel
        try:
            with np.errstate(**errors), flushed():  # subnormals: see denormals.py
                state = make_state()
                while not cancel.is_set():
                    i = next(counter)  # atomic under the GIL
                    if i >= total:
                        return
                    work(state, units[i])
        except _Cancelled:
            return
        except BaseException:
            cancel.set()  # the other workers stop at their next unit
            raise
        finally:
            _LOCAL.cancel = None

    with _BLAS_ONE_THREAD:
        # One pool for the whole call, read once: the environment may change meanwhile.
        pool = _pool(n_env)
        futures: list[Future[None]] = []
        try:
            for _ in range(n):
                futures.append(pool.submit(worker))
            _wait_all(futures, cancel)
        except BaseException:
            _drain(futures, cancel)
            raise
        if cancel.is_set():  # a worker failed: the others stop, then its error is raised
            _drain(futures, cancel)
            for f in futures:
                exc = f.exception() if f.done() and not f.cancelled() else None
                if exc is not None:
                    raise exc


def _fork_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` inside the fork gate (see :class:`_ForkGate`)."""

    @functools.wraps(fn)
    def gated(*args: Any, **kwargs: Any) -> Any:
        with _FORK_GATE:
            return fn(*args, **kwargs)

    return gated
