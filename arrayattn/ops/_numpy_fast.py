"""The NumPy fast path: tiled attention with BLAS products, in-place ufuncs and threads.

This is the one attention module that is NumPy-specific (everything else is written
against the array API). ``implementation="auto"`` picks it for NumPy arrays; it declines
every other library, and calls it does not support, which then fall to the chunked or
composed paths.

How it works (see ``SEMANTICS.md`` for what it computes):

- Forward tiles are ``(batch, query head, block of query rows)``. A tile multiplies its
  scaled queries into the keys it can see (``Structure.col_range`` skips the keys a
  causal or windowed block never touches) with BLAS, exponentiates in place and
  multiplies into the values, one key block at a time with an online softmax when the
  row block does not fit the cache budget. Only blocks cut by the causal/window edge
  build a structural mask; user masks are sliced per tile from a broadcast view.
- Softmax stabilisation: when a bound on every score of the tile (``|q_i| * max|k_j|``
  times the scale, or the softcap) shows that ``exp`` cannot overflow, the row maximum is
  not needed at all (a pass and a rescale fewer); rows whose sum underflows are recomputed
  on the exact running-max path, which is also used whenever the bound is too loose or a
  float mask adds arbitrary scores.
- Backward follows FlashAttention-2 from the saved LSE. Work units are
  ``(batch, KV head, key chunk)``: a unit owns its keys' ``dK``/``dV`` (summed over the
  KV head's query-head group, so K/V are never repeated) and accumulates ``dQ`` of the
  group's rows. ``P = exp(S - LSE)`` is written as ``diag(a) exp(S)`` with
  ``a = exp(-LSE)`` when the same bound allows, so the factor goes on the small
  ``(rows, head_dim)`` operands instead of the ``rows x keys`` block.
- A thread pool runs the units (NumPy and BLAS release the GIL). While it does, BLAS is
  limited to one thread through ``threadpoolctl`` when that package is installed, so the
  pool's threads and BLAS's threads do not oversubscribe the cores. Without
  ``threadpoolctl`` the pool still runs; OpenBLAS then decides its own threading per
  product (``pip install threadpoolctl`` is recommended). ``ARRAYATTN_NUM_THREADS`` sets
  the number of worker threads (default: the CPUs this process may use), read at each
  call; changing it at run time is safe (the pool only grows, and is never shut down
  under a caller).
- ``fork``: a forked child builds its own pool (``os.register_at_fork``), and a fork
  waits for fast-path calls running in other threads (:class:`_ForkGate`).
- Garbage (NaN/Inf) in excluded keys, values and query rows is checked for once per call
  (only when the call excludes something) and kept out of every product
  (:meth:`_Layout.prepare_garbage`).

No buffer of ``L x S`` elements is ever allocated: per worker the largest buffers hold
``rows x key-block`` elements (:data:`BLOCK_ELEMENTS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._backend import is_numpy, numpy_bridge
from ._attention_spec import AttentionSpec
from .dropout import dropout_keep
from .masks import Structure, structural_allowed

__all__ = ["forward", "backward", "declines", "num_threads", "one_thread", "BLOCK_ELEMENTS"]

# Tunables (measured on a 2-core AMD EPYC with 1 MiB L2 per core; see bench/RESULTS.md).
FWD_ROWS = 256
"""Query rows per forward tile."""
BLOCK_ELEMENTS = 1 << 17
"""Largest ``rows x keys`` block a worker holds (512 KiB in float32)."""
BWD_ROWS = 256
"""Query rows per backward block."""
BWD_KEYS = 512
"""Keys per backward block (512 beat 256 by 8-10% at L=2048..4096, D=64; at D=128 and at
L<=1024 the two were within noise: interleaved A/B, 2026-11-22)."""
_SERIAL_WORK = 1 << 20
"""Calls with fewer ``L x S x heads`` score elements than this run on the calling thread."""

# exp(x) of float32 overflows above ~88.7 (float64: ~709.8); the static-shift path is
# used only when scores, row sums and value sums stay well below that.
_STATIC_LIMIT = {np.dtype(np.float32): 80.0, np.dtype(np.float64): 690.0}
# A row sum below this (on the static path) may have lost precision to underflow.
_TINY_SUM = {np.dtype(np.float32): 1e-25, np.dtype(np.float64): 1e-280}
# Backward static path: |scores| bound and -LSE bound, so exp(S) and exp(-LSE) stay finite
# and their products stay far from overflow.
_BWD_STATIC_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 340.0}

_SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# ---------------------------------------------------------------------------------------
# Registration and declining
# ---------------------------------------------------------------------------------------
def declines(spec: AttentionSpec) -> str | None:
    """``None`` when the fast path can run ``spec``, else the reason it cannot (then
    ``"auto"`` moves on to the chunked/composed paths, and ``implementation="fast"``
    raises a ``ValueError`` with the reason).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.ops._attention_spec import make_spec
        >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None,
        ...                  None, None)
        >>> declines(spec) is None
        True
    """
    dtype = spec.dtype
    if not is_numpy(spec.xp):
        bridge = numpy_bridge(spec.xp, spec.device)
        if bridge is None:
            return "the NumPy fast path runs on NumPy arrays and PyTorch CPU tensors only"
        if spec.autograd:
            return (
                "inputs that require grad: PyTorch's autograd cannot follow the NumPy fast "
                "path (use arrayattn.vjp on detached tensors, or torch.no_grad())"
            )
        dtype = bridge.dtype(spec.dtype)  # None: NumPy has no such dtype (bfloat16)
    if dtype is None or np.dtype(dtype) not in _SUPPORTED_DTYPES:
        return f"the NumPy fast path supports float16/float32/float64, got {spec.dtype}"
    if min(spec.L, spec.S, spec.E, spec.Ev) == 0:
        return "the NumPy fast path needs non-empty L, S and head dims"
    return None


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
        self.__init__()


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


# ---------------------------------------------------------------------------------------
# Layout: broadcast views, indices, structural helpers
# ---------------------------------------------------------------------------------------
class _Layout:
    """Broadcast views of the inputs in ``(*lead, heads, seq, dim)`` and index helpers."""

    def __init__(self, spec: AttentionSpec, query, key, value, attn_mask):
        self.spec = spec
        cd = np.dtype(spec.cdtype)
        self.cd = cd
        nd = len(spec.lead) + 3
        self.lead_index = list(np.ndindex(*spec.lead)) if spec.lead else [()]
        self._raw: dict[str, np.ndarray] = {}
        self.q = self._view("q", query, spec.q_shape, nd, (spec.Hq, spec.L, spec.E), cd)
        self.k = self._view("k", key, spec.k_shape, nd, (spec.Hkv, spec.S, spec.E), cd)
        self.v = self._view("v", value, spec.v_shape, nd, (spec.Hkv, spec.S, spec.Ev), cd)
        self.mask = None
        if attn_mask is not None:
            m = np.asarray(attn_mask)
            m = m.reshape((1,) * (nd - m.ndim) + m.shape)
            self.mask_padded_shape = m.shape
            self.mask = np.broadcast_to(m, spec.lead + (spec.Hq, spec.L, spec.S))
        self.scale = spec.scale
        # Per-sequence lengths: rows >= q_len are empty, keys >= kv_len excluded, and
        # bottom-right alignment puts each sequence's diagonal at its own offset.
        nb = len(self.lead_index)
        self.q_len = _per_batch(getattr(spec, "q_len_g", None), nb, spec.L)
        self.kv_len = _per_batch(getattr(spec, "kv_len_g", None), nb, spec.S)
        offsets = getattr(spec, "offset_g", None)
        st = spec.structure
        if offsets is None:
            self.structs = [st] * nb
        else:
            flat = np.asarray(offsets).reshape(-1)
            self.structs = [dataclasses.replace(st, offset=int(flat[i])) for i in range(nb)]
        self.limit = _STATIC_LIMIT[cd]
        self.tiny = _TINY_SUM[cd]
        # Per-(batch, query head) sinks and ALiBi slopes, ``(*lead, Hq)`` views.
        self.sinks = self._per_head(spec.sinks, cd)
        self.alibi = self._per_head(spec.alibi_slopes, cd)
        self._garbage_ready = False

    def _per_head(self, x, cd):
        if x is None:
            return None
        a = np.asarray(x).astype(cd, copy=False)
        a = a.reshape((1,) * (len(self.spec.lead) + 1 - a.ndim) + a.shape)
        return np.broadcast_to(a, self.spec.lead + (self.spec.Hq,))

    def _view(self, name, x, shape, nd, tail, cd):
        a = np.asarray(x)
        if a.dtype != cd:
            a = a.astype(cd)
        a = a.reshape((1,) * (nd - a.ndim) + a.shape)
        self._raw[name] = a  # unbroadcast: data checks read each element once
        return np.broadcast_to(a, self.spec.lead + tail)

    def prepare_garbage(self, backward: bool = False) -> None:
        """Set up what keeps garbage (NaN, Inf, or values so huge that products overflow)
        in excluded pairs out of every result (SEMANTICS, "Garbage in masked
        positions"), decided on the data once per call, only when the call excludes
        something. One norm pass per input: a finite norm proves the entries finite.

        - ``v_op`` (and ``q_op``/``k_op`` for the backward): the operands that meet
          excluded pairs' zero weights in products (``P V``, ``dS K``, ``dS^T Q``,
          ``dO V^T``), with non-finite entries zeroed; the inputs themselves when finite;
        - ``v_bad``: ``(*lead, Hkv, S)`` indicator of value rows holding NaN/Inf (rows
          that attend to one become NaN), or ``None``;
        - ``qk_garbage``: scores may be non-finite, so a float mask's ``-inf`` must be
          re-applied after the addition (``inf + -inf`` is NaN);
        - ``v_norm``: the largest value-row norm (bounds ``dO V^T`` in the backward)."""
        spec = self.spec
        if not self._garbage_ready:
            self._garbage_ready = True
            self.q_op, self.k_op, self.v_op = self.q, self.k, self.v
            self.v_bad = None
            self.qk_garbage = False
            self.v_norm = 0.0
            self._qk_checked = False
            if spec.may_mask:
                raw = self._raw["v"]
                self.v_norm = _max_norm(raw)
                if not math.isfinite(self.v_norm) and not np.isfinite(raw).all():
                    self.v_op = np.broadcast_to(_finite_or_zero(raw), self.v.shape)
                    bad = np.logical_not(np.isfinite(raw).all(axis=-1)).astype(self.cd)
                    self.v_bad = np.broadcast_to(bad, spec.lead + (spec.Hkv, spec.S))
                    self.v_norm = _max_norm(_finite_or_zero(raw))
        if spec.may_mask and not self._qk_checked and (backward or spec.mask_kind == "float"):
            self._qk_checked = True
            big = float(np.finfo(self.cd).max) / 4
            norms = {}
            for name in ("q", "k"):
                raw = self._raw[name]
                norms[name] = _max_norm(raw)
                if not math.isfinite(norms[name]) and not np.isfinite(raw).all():
                    op = np.broadcast_to(_finite_or_zero(raw), getattr(self, name).shape)
                    setattr(self, f"{name}_op", op)
            bound = norms["q"] * norms["k"] * abs(spec.scale)
            self.qk_garbage = spec.mask_kind == "float" and not bound < big

    def kv_head(self, h: int) -> int:
        spec = self.spec
        if spec.Hkv == 1:
            return 0
        return h // spec.G

    def heads_of(self, hk: int) -> list[int]:
        return [h for h in range(self.spec.Hq) if self.kv_head(h) == hk]


def _finite_or_zero(a: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(a), a, a.dtype.type(0))


def _max_norm(a: np.ndarray) -> float:
    """The largest row norm of ``a`` (``inf``/``nan`` when an entry is non-finite or the
    squares overflow; 0 for an empty array)."""
    return float(_norms(a).max()) if a.size else 0.0


def _per_batch(lengths: Any, nb: int, default: int) -> list[int]:
    if lengths is None:
        return [default] * nb
    return [int(x) for x in np.asarray(lengths).reshape(-1)]


def _row_range(st: Structure, c0: int, c1: int, L: int) -> tuple[int, int]:
    """Half-open range of query rows that can see at least one key of ``[c0, c1)``."""
    lo = 0 if st.right < 0 else max(0, c0 - st.offset - st.right)
    hi = L if st.left < 0 else min(L, c1 - 1 - st.offset + st.left + 1)
    return lo, max(lo, hi)


def _fully_visible(st: Structure, r0: int, r1: int, c0: int, c1: int) -> bool:
    """True when every row of ``[r0, r1)`` sees every key of ``[c0, c1)``."""
    if st.right >= 0 and r0 + st.offset + st.right < c1 - 1:
        return False
    if st.left >= 0 and r1 - 1 + st.offset - st.left > c0:
        return False
    return True


_EXCLUDED_CACHE: dict[tuple[int, ...], np.ndarray] = {}


def _blocked_out(st: Structure, r0: int, r1: int, c0: int, c1: int) -> np.ndarray | None:
    """Boolean ``(r1-r0, c1-c0)`` array of structurally *excluded* pairs, or ``None``.

    The pattern depends only on the block's shape and its diagonal's position, so it is
    cached (blocks along the causal diagonal repeat it)."""
    if _fully_visible(st, r0, r1, c0, c1):
        return None
    key = (r1 - r0, c1 - c0, r0 + st.offset - c0, st.left, st.right)
    excluded = _EXCLUDED_CACHE.get(key)
    if excluded is None:
        rows = np.arange(r0, r1, dtype=np.int32).reshape(-1, 1)
        cols = np.arange(c0, c1, dtype=np.int32)
        excluded = np.logical_not(structural_allowed(np, st, rows, cols))
        if len(_EXCLUDED_CACHE) > 512:
            _EXCLUDED_CACHE.clear()
        _EXCLUDED_CACHE[key] = excluded
    return excluded


_ALIBI_CACHE: dict[tuple[int, ...], np.ndarray] = {}


def _alibi_distance(st: Structure, r0: int, r1: int, c0: int, c1: int, cd) -> np.ndarray:
    """``|i + offset - j|`` for rows ``[r0, r1)`` x keys ``[c0, c1)`` in ``cd``: ALiBi's
    distance from the aligned diagonal. It depends only on the block's shape and the
    diagonal's position, so it is cached like the structural masks."""
    key = (r1 - r0, c1 - c0, r0 + st.offset - c0, np.dtype(cd).num)
    dist = _ALIBI_CACHE.get(key)
    if dist is None:
        rows = np.arange(r0, r1, dtype=np.int64).reshape(-1, 1) + st.offset
        dist = np.abs(rows - np.arange(c0, c1, dtype=np.int64)).astype(cd)
        dist.flags.writeable = False
        if len(_ALIBI_CACHE) > 512:
            _ALIBI_CACHE.clear()
        _ALIBI_CACHE[key] = dist
    return dist


def _add_alibi(lay, structure, b, h, r0, r1, c0, c1, s) -> None:
    """``s -= slope_(b,h) * |i + offset - j|`` in place (ALiBi, after the softcap)."""
    if lay.alibi is None:
        return
    slope = lay.alibi[b + (h,)]
    dist = _alibi_distance(structure, r0, r1, c0, c1, s.dtype)
    np.subtract(s, dist * slope, out=s)


def _merge_sinks(lay, out: np.ndarray, lse: np.ndarray) -> None:
    """Fold the sinks into the whole normalised output and its LSE, in place:
    ``LSE' = logaddexp(LSE, sink)``, ``out *= exp(LSE - LSE')`` (rows with no key get
    output 0 and ``LSE' = sink``), as ``_composed.merge_sinks``."""
    if lay.sinks is None:
        return
    sink = lay.sinks[..., None]
    new = np.logaddexp(lse, sink)
    # lse -inf (no key): factor 0; a NaN LSE (NaN scores) keeps its NaN row.
    factor = np.where(lse == -np.inf, 0.0, np.exp(lse - np.where(np.isfinite(new), new, 0.0)))
    np.multiply(out, factor[..., None].astype(out.dtype, copy=False), out=out)
    lse[...] = new


def _key_spans(st: Structure, r0: int, r1: int, c_lo: int, c_hi: int, width: int):
    """Key blocks of at most ``width`` covering ``[c_lo, c_hi)`` for rows ``[r0, r1)``,
    cut so that the keys every row sees form whole blocks and only the (narrow) window
    edges need a structural mask."""
    full_lo = c_lo if st.left < 0 else max(c_lo, r1 - 1 + st.offset - st.left)
    full_hi = c_hi if st.right < 0 else min(c_hi, r0 + st.offset + st.right + 1)
    if full_lo >= full_hi:
        return _spans(c_lo, c_hi, width)
    return (
        _spans(c_lo, full_lo, width)
        + _spans(full_lo, full_hi, width)
        + _spans(full_hi, c_hi, width)
    )


# Relative slack on norms summed in the compute dtype: their rounding error is at most
# about head_dim * eps (1.5e-5 for float32 at head_dim 128), far below this.
_NORM_SLACK = 1.0 + 1e-3


def _norms(x: np.ndarray) -> np.ndarray:
    """Upper bounds on the Euclidean norms over the last axis. Summed in the array's own
    dtype (a float64 copy of Q and K cost 5% of a D=128 forward); an overflow gives
    ``inf``, which only sends the tile to the exact path."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(np.einsum("...d,...d->...", x, x)) * _NORM_SLACK


def _spans(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


# ---------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------
class _Scratch:
    """A ``rows x keys`` scratch buffer whose ``[:n, :w]`` blocks are contiguous (the
    first ``n * w`` elements), so that ufuncs over a block narrower than the buffer run
    as one loop rather than one short loop per row (causal edges and last key blocks:
    a strided 256 x 256 block cost ~30% more per element in ``exp``)."""

    def __init__(self, rows: int, keys: int, dtype: Any):
        self._flat = np.empty(rows * keys, dtype)

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        rows, keys = index
        assert rows.start is None and keys.start is None and rows.stop is not None
        return self._flat[: rows.stop * keys.stop].reshape(rows.stop, keys.stop)


class _FwdState:
    def __init__(self, rows: int, keys: int, E: int, Ev: int, cd: np.dtype):
        self.s = _Scratch(rows, keys, cd)
        self.q = np.empty((rows, E), cd)
        self.acc_tmp = np.empty((rows, Ev), cd)
        self.l_tmp = np.empty((rows,), cd)
        self.ones = np.ones((keys,), cd)
        self.bool = _Scratch(rows, keys, np.bool_)


def _fork_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` inside the fork gate (see :class:`_ForkGate`)."""

    @functools.wraps(fn)
    def gated(*args: Any, **kwargs: Any) -> Any:
        with _FORK_GATE:
            return fn(*args, **kwargs)

    return gated


def _static_bounds(spec: AttentionSpec, lay: _Layout):
    """Per-(batch, query head, row) upper bound on ``|score|`` (or ``None`` when a float
    mask rules the static shift out), and the extra log-room the sums need.

    ALiBi with slopes >= 0 keeps the bound: its bias is <= 0, so it only lowers scores,
    and rows whose sums then underflow are redone on the exact path (forward), while
    ``exp(S)`` underflowing in the backward means ``P <= exp(-87 + 40)``, far below
    rounding. A negative slope can raise scores without bound: exact path."""
    if spec.mask_kind == "float":  # arbitrary additive scores: exact path
        return None
    if lay.alibi is not None and not (lay.alibi.size == 0 or float(np.min(lay.alibi)) >= 0.0):
        return None
    q_norm = _norms(lay.q) * abs(spec.scale)  # (*lead, Hq, L)
    k_max = _norms(lay.k).max(axis=-1)  # (*lead, Hkv)
    # max |v| from two reductions (no |v| temporary); NaN propagates into ``room``.
    v_max = float(np.maximum(np.abs(np.max(lay.v)), np.abs(np.min(lay.v)))) if lay.v.size else 0.0
    room = math.log(max(spec.S, 1)) + math.log(max(v_max, 1.0))
    if not math.isfinite(room):
        return None
    # Bound per (lead, Hq, L): |q_i| * max_j |k_j| for the KV head of each query head.
    kv_of = np.array([lay.kv_head(h) for h in range(spec.Hq)])
    bound = q_norm * k_max[..., kv_of][..., None]
    if spec.softcap is not None:
        bound = np.minimum(bound, spec.softcap)
    return bound, room


def _scores(spec, lay, st, structure, b, h, hk, r0, r1, c0, c1, q_t, s):
    """Final masked scores of rows ``[r0, r1)`` x keys ``[c0, c1)`` into ``s`` (in place)."""
    np.matmul(q_t, lay.k[b + (hk, slice(c0, c1))].T, out=s)
    if spec.softcap is not None:
        np.tanh(s, out=s)
        np.multiply(s, spec.softcap, out=s)
    _add_alibi(lay, structure, b, h, r0, r1, c0, c1, s)
    if lay.mask is not None:
        m = lay.mask[b + (h, slice(r0, r1), slice(c0, c1))]
        if spec.mask_kind == "float":
            np.add(s, m, out=s)
            if lay.qk_garbage:  # garbage score + (-inf) is NaN: -inf still excludes
                np.copyto(s, -np.inf, where=np.isneginf(m))
        else:
            excluded = np.logical_not(m, out=st.bool[: r1 - r0, : c1 - c0])
            np.copyto(s, -np.inf, where=excluded)
    blocked = _blocked_out(structure, r0, r1, c0, c1)
    if blocked is not None:
        np.copyto(s, -np.inf, where=blocked)


def _dropout_keep(spec, bi, h, r0, r1, c0, c1):
    """Keep-mask of a tile at global positions (a block of a larger call adds its
    origins, see ``AttentionSpec.as_block``)."""
    b = bi if spec.batch_ids is None else spec.batch_ids[bi]
    rows_i = np.arange(r0 + spec.row0, r1 + spec.row0, dtype=np.int32).reshape(-1, 1)
    cols_i = np.arange(c0 + spec.col0, c1 + spec.col0, dtype=np.int32)
    return dropout_keep(
        np, spec.seed, spec.dropout_p, np.int32(b), np.int32(h + spec.head0), rows_i, cols_i
    )


def _scaled_query(spec, lay, b, h, r0, r1, out):
    """Queries of the rows times the scale (divided by the softcap when there is one,
    so that ``tanh`` reads the matmul's output directly)."""
    factor = spec.scale if spec.softcap is None else spec.scale / spec.softcap
    np.multiply(lay.q[b + (h, slice(r0, r1))], factor, out=out)
    return out


# ---------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------
class _BwdState:
    def __init__(self, rows: int, keys: int, E: int, Ev: int, cd: np.dtype, spec):
        self.e = _Scratch(rows, keys, cd)
        self.dp = _Scratch(rows, keys, cd)
        self.t = _Scratch(rows, keys, cd) if spec.softcap is not None else None
        self.ed = _Scratch(rows, keys, cd) if spec.dropout_p > 0 else None
        self.bool = _Scratch(rows, keys, np.bool_)
        self.q = np.empty((rows, E), cd)
        self.qa = np.empty((rows, E), cd)
        self.do = np.empty((rows, Ev), cd)
        self.doa = np.empty((rows, Ev), cd)
        self.tmp_q = np.empty((rows, E), cd)
        self.tmp_k = np.empty((keys, E), cd)
        self.tmp_v = np.empty((keys, Ev), cd)
        self.dk = np.empty((keys, E), cd)
        self.dv = np.empty((keys, Ev), cd)


@_fork_safe
def backward(
    spec: AttentionSpec,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None,
    out: np.ndarray,
    lse: np.ndarray,
    d_out: np.ndarray | None,
    d_lse: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(d_query, d_key, d_value, d_mask)`` in the arguments' own shapes and dtypes, as
    :func:`arrayattn.ops._composed.backward`: FlashAttention-2 from the saved LSE, block
    by block (``d_mask`` only for a float mask). Users reach it through ``arrayattn.vjp``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, q, q,
        ...                        implementation="fast")
        >>> [g.shape for g in pullback(np.ones_like(out))]
        [(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)]
    """
    lay = _Layout(spec, query, key, value, attn_mask)
    cd = lay.cd
    nb = len(lay.lead_index)
    lead = spec.lead
    rows_shape = lead + (spec.Hq, spec.L)
    lse_f = np.broadcast_to(np.asarray(lse, dtype=cd).reshape(spec.lse_shape), rows_shape)
    finite = np.isfinite(lse_f)
    # Shift of exp(S - shift): 0 for empty rows (LSE -inf, every P 0); +inf stays (P 0
    # but NaN where a score is +inf, as the composed path); a NaN LSE (NaN scores) shifts
    # by -max so that every pair that takes part gives exp != 0, then made NaN
    # (``nan_rows``), while excluded pairs stay exactly 0.
    nan_rows = np.isnan(lse_f)
    lse_safe = np.where(finite, lse_f, np.where(lse_f > 0, lse_f, 0.0))
    lse_safe = np.where(nan_rows, -np.finfo(cd).max, lse_safe).astype(cd)
    lay.prepare_garbage(backward=True)
    limit = _BWD_STATIC_LIMIT[cd]
    with np.errstate(over="ignore"):
        a_static = np.where(finite, np.exp(-lse_safe), 0.0).astype(cd)

    # delta_eff = rowsum(dO * O) - dLSE, so that dS = P * (dP - delta_eff).
    if d_out is not None:
        do_f = _broadcast_rows(spec, d_out, cd, spec.Ev)
        o_f = _broadcast_rows(spec, out, cd, spec.Ev)
        delta = np.einsum("...d,...d->...", do_f, o_f)
    else:
        do_f = None
        delta = np.zeros(rows_shape, cd)
    if d_lse is not None:
        dl = np.broadcast_to(np.asarray(d_lse, dtype=cd).reshape(spec.lse_shape), rows_shape)
        delta = delta - dl
    delta = delta.astype(cd, copy=False)
    # Rows where dP - D may be non-finite: their excluded pairs need dS = 0 explicitly
    # (0 * NaN is NaN), as do the rows of a NaN LSE; all rows when dO V^T may overflow
    # (huge finite garbage in an excluded value row).
    rows_bad = np.logical_or(nan_rows, np.logical_not(np.isfinite(delta)))
    if spec.may_mask and d_out is not None:
        do_norm = _max_norm(np.asarray(d_out, dtype=cd))
        if not do_norm * lay.v_norm < float(np.finfo(cd).max) / 4:
            rows_bad = np.ones_like(rows_bad)

    inv_total = _row_totals(spec, lay, lse_f, finite)
    bound = None
    sb = _static_bounds(spec, lay)
    if sb is not None:
        bound = sb[0]

    Hkv = spec.Hkv
    n_key_blocks = -(-spec.S // BWD_KEYS)
    n_threads = num_threads()
    # (batch, KV head) pairs whose float-mask gradients land on the same mask elements
    # (the mask broadcasts over batch or heads) form one group, run in one unit in a
    # fixed order: an accumulation order that followed thread timing made the mask
    # gradient differ run to run. Each group owns its mask elements, so no lock either.
    groups = _mask_groups(spec, lay, nb)
    chunks = 1
    key_width = BWD_KEYS
    if n_threads > 1 and len(groups) < 2 * n_threads:
        want = -(-2 * n_threads // len(groups))
        if spec.mask_kind == "float" and n_key_blocks < want:
            # A broadcast float mask leaves few groups: narrower key chunks keep the
            # pool busy (each chunk owns its mask columns).
            key_width = min(BWD_KEYS, max(64, -(-spec.S // want)))
            n_key_blocks = -(-spec.S // key_width)
        chunks = max(1, min(n_key_blocks, want))
    dq_parts = np.zeros((chunks,) + lead + (spec.Hq, spec.L, spec.E), cd)
    dk_f = np.zeros(lead + (Hkv, spec.S, spec.E), cd)
    dv_f = np.zeros(lead + (Hkv, spec.S, spec.Ev), cd)
    d_mask_acc = None
    if spec.mask_kind == "float":
        d_mask_acc = np.zeros(lay.mask_padded_shape, cd)

    key_spans = _spans(0, spec.S, key_width)
    per_chunk = -(-len(key_spans) // chunks)
    units = []
    for members in groups:
        for c in range(chunks):
            spans = key_spans[c * per_chunk : (c + 1) * per_chunk]
            if spans:
                units.append((members, c, spans))
    serial = spec.Hq * nb * spec.L * spec.S < _SERIAL_WORK
    rows = min(BWD_ROWS, spec.L)
    keys = min(BWD_KEYS, spec.S)
    ctx = dict(
        lay=lay,
        lse_safe=lse_safe,
        inv_total=inv_total,
        a_static=a_static,
        delta=delta,
        nan_rows=nan_rows if nan_rows.any() else None,
        rows_bad=rows_bad if rows_bad.any() else None,
        do_f=do_f,
        bound=bound,
        limit=limit,
        dq_parts=dq_parts,
        dk_f=dk_f,
        dv_f=dv_f,
        d_mask_acc=d_mask_acc,
        rows=rows,
    )

    def make_state():
        return _BwdState(rows, keys, spec.E, spec.Ev, cd, spec)

    def work(state, unit):
        _backward_unit(spec, ctx, state, unit)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        _run_units(units, make_state, work, serial)

    dq = dq_parts[0] if chunks == 1 else dq_parts.sum(axis=0)
    d_query = _reduce(spec, dq, spec.q_shape, spec.dtype)
    d_key = _reduce(spec, dk_f, spec.k_shape, spec.dtype)
    d_value = _reduce(spec, dv_f, spec.v_shape, spec.dtype)
    d_mask = None
    if d_mask_acc is not None:
        d_mask = _reduce(spec, d_mask_acc, spec.mask_shape, attn_mask.dtype)
    return d_query, d_key, d_value, d_mask


# Rows whose |LSE| * eps exceeds this are renormalised in the backward (see _row_totals).
_RENORMALISE_LSE_ERROR = 1e-4


def _row_totals(spec, lay, lse_f, finite):
    """``1 / sum_j exp(S_ij - LSE_i)`` for rows whose LSE is so large that rounding
    swallowed ``log(rowsum)`` (Hugging Face's ``finfo.min`` bias rows: ``m + log S == m``),
    else ``None``. ``exp(S - LSE)`` then sums to far more than 1 on those rows; the
    composed and chunked paths renormalise, and so does this one. Ordinary rows (error
    ``|LSE| * eps`` below ``_RENORMALISE_LSE_ERROR``) are left alone, so the extra pass
    over the keys runs only for such rows."""
    if spec.partial_keys:  # a block's keys are not the whole row: nothing to renormalise
        return None
    eps = float(np.finfo(lay.cd).eps)
    need = finite & (np.abs(lse_f) * eps > _RENORMALISE_LSE_ERROR)
    if not need.any():
        return None
    inv = np.ones(need.shape, lay.cd)
    rows = min(BWD_ROWS, spec.L)
    width = max(1, min(spec.S, BLOCK_ELEMENTS // rows))
    st = _FwdState(rows, width, spec.E, spec.Ev, lay.cd)
    for bi, b in enumerate(lay.lead_index):
        structure = lay.structs[bi]
        for h in range(spec.Hq):
            hk = lay.kv_head(h)
            for r0, r1 in _spans(0, min(spec.L, lay.q_len[bi]), rows):
                if not need[b + (h, slice(r0, r1))].any():
                    continue
                n = r1 - r0
                lse_r = lse_f[b + (h, slice(r0, r1))]
                lse_r = np.where(np.isfinite(lse_r), lse_r, 0.0)
                q_t = _scaled_query(spec, lay, b, h, r0, r1, st.q[:n])
                total = np.zeros((n,), lay.cd)
                c_lo, c_hi = structure.col_range(r0, r1, lay.kv_len[bi])
                for c0, c1 in _spans(c_lo, c_hi, width):
                    sc = st.s[:n, : c1 - c0]
                    _scores(spec, lay, st, structure, b, h, hk, r0, r1, c0, c1, q_t, sc)
                    np.subtract(sc, lse_r[:, None], out=sc)
                    np.exp(sc, out=sc)
                    total += sc.sum(axis=1)
                if lay.sinks is not None:  # the sink's share is part of the row's total
                    total += np.exp(lay.sinks[b + (h,)] - lse_r)
                fix = need[b + (h, slice(r0, r1))] & (total > 0)
                view = inv[b + (h, slice(r0, r1))]
                view[fix] = 1.0 / total[fix]
    return inv


def _broadcast_rows(spec, x, cd, width):
    a = np.asarray(x, dtype=cd).reshape(spec.out_shape[:-1] + (width,))
    nd = len(spec.lead) + 3
    a = a.reshape((1,) * (nd - a.ndim) + a.shape)
    return np.broadcast_to(a, spec.lead + (spec.Hq, spec.L, width))


def _reduce(spec, x, shape, dtype):
    """Sum a full-lead gradient over broadcast dims to the argument's own shape."""
    nd = len(spec.lead) + 3
    padded = (1,) * (nd - len(shape)) + tuple(shape)
    axes = tuple(i for i, (d, t) in enumerate(zip(padded, x.shape, strict=True)) if d != t)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape).astype(dtype, copy=False)


def _mask_groups(spec, lay, nb: int) -> list[list[tuple[int, int]]]:
    """``(batch index, KV head)`` pairs grouped by the float-mask elements their
    gradients reach (one pair per group without a float mask), in a fixed order."""
    pairs = [(bi, hk) for bi in range(nb) for hk in range(spec.Hkv)]
    if spec.mask_kind != "float":
        return [[p] for p in pairs]
    shape = lay.mask_padded_shape
    lead_shape = shape[:-3]
    heads_shared = shape[-3] == 1

    def owner(pair: tuple[int, int]) -> tuple[Any, ...]:
        b = lay.lead_index[pair[0]]
        mb = tuple(0 if d == 1 else i for i, d in zip(b, lead_shape, strict=True))
        return mb + ((0,) if heads_shared else (pair[1],))

    groups: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for p in pairs:
        groups.setdefault(owner(p), []).append(p)
    return list(groups.values())


def _backward_unit(spec, ctx, st, unit):
    members, chunk, spans = unit
    for bi, hk in members:
        _backward_pair(spec, ctx, st, bi, hk, chunk, spans)


def _backward_pair(spec, ctx, st, bi, hk, chunk, spans):
    lay = ctx["lay"]
    b = lay.lead_index[bi]
    heads = lay.heads_of(hk)
    dq = ctx["dq_parts"][chunk]
    structure = lay.structs[bi]
    for c0, c1 in spans:
        c1 = min(c1, lay.kv_len[bi])  # keys from kv_len on take no part: zero gradients
        if c1 <= c0:
            break
        w = c1 - c0
        r_lo, r_hi = _row_range(structure, c0, c1, lay.q_len[bi])
        dk = st.dk[:w]
        dv = st.dv[:w]
        dk[...] = 0
        dv[...] = 0
        if r_hi > r_lo:
            for h in heads:
                for r0, r1 in _spans(r_lo, r_hi, ctx["rows"]):
                    _backward_block(
                        spec, ctx, st, structure, bi, b, h, hk, r0, r1, c0, c1, dq, dk, dv
                    )
        ctx["dk_f"][b + (hk, slice(c0, c1))] = dk
        ctx["dv_f"][b + (hk, slice(c0, c1))] = dv


def _backward_block(spec, ctx, st, structure, bi, b, h, hk, r0, r1, c0, c1, dq, dk, dv):
    lay = ctx["lay"]
    cd = lay.cd
    n, w = r1 - r0, c1 - c0
    row = b + (h, slice(r0, r1))
    lse_r = ctx["lse_safe"][row]
    static = False
    if ctx["bound"] is not None:
        # A large sink can lift the LSE far above the scores: exp(-LSE) must stay normal.
        static = (
            float(ctx["bound"][row].max()) <= ctx["limit"]
            and float(lse_r.min()) >= -ctx["limit"]
            and float(lse_r.max()) <= 2 * ctx["limit"]
        )
    # Row factor on P: exp(-LSE) on the static path, else the renormalisation of rows
    # whose huge LSE swallowed log(rowsum) (see _row_totals), else none.
    if static:
        a = ctx["a_static"][row]
    else:
        a = None if ctx["inv_total"] is None else ctx["inv_total"][row]
    k_blk = lay.k[b + (hk, slice(c0, c1))]
    v_blk = lay.v_op[b + (hk, slice(c0, c1))]

    # Scores (softcap keeps tanh in st.t for the chain rule).
    q_t = _scaled_query(spec, lay, b, h, r0, r1, st.q[:n])
    e = st.e[:n, :w]
    if spec.softcap is not None:
        t = st.t[:n, :w]
        np.matmul(q_t, k_blk.T, out=t)
        np.tanh(t, out=t)
        np.multiply(t, spec.softcap, out=e)
    else:
        np.matmul(q_t, k_blk.T, out=e)
    _add_alibi(lay, structure, b, h, r0, r1, c0, c1, e)
    if lay.mask is not None:
        m = lay.mask[b + (h, slice(r0, r1), slice(c0, c1))]
        if spec.mask_kind == "float":
            np.add(e, m, out=e)
        else:
            np.copyto(e, -np.inf, where=np.logical_not(m, out=st.bool[:n, :w]))
        if lay.qk_garbage:  # garbage score + (-inf) is NaN: -inf still excludes
            np.copyto(e, -np.inf, where=np.isneginf(m))
    blocked = _blocked_out(structure, r0, r1, c0, c1)
    if blocked is not None:
        np.copyto(e, -np.inf, where=blocked)
    if spec.softcap is not None and (lay.k_op is not lay.k or lay.q_op is not lay.q):
        np.copyto(st.t[:n, :w], 0.0, where=np.isneginf(e))  # tanh of a garbage score
    if not static:
        np.subtract(e, lse_r[:, None], out=e)
    np.exp(e, out=e)  # P (exact path) or exp(S) with P = diag(a) exp(S) (static path)
    if ctx["nan_rows"] is not None:  # NaN LSE: NaN wherever the row takes part
        for i in np.flatnonzero(ctx["nan_rows"][row]):
            np.copyto(e[i], np.nan, where=e[i] != 0)

    keep = None
    inv_keep = 1.0
    if spec.dropout_p > 0:
        inv_keep = 1.0 / (1.0 - spec.dropout_p)
        keep = _dropout_keep(spec, bi, h, r0, r1, c0, c1)

    delta = ctx["delta"][row]
    tmat = st.dp[:n, :w]
    do_f = ctx["do_f"]
    if do_f is not None:
        do_r = do_f[row]
        # dV += P_drop^T dO: the row factors a_i and 1/(1-p) go on dO's rows.
        doa = st.doa[:n]
        if a is not None:
            np.multiply(do_r, (a * inv_keep)[:, None], out=doa)
        else:
            np.multiply(do_r, inv_keep, out=doa)
        if keep is not None:
            e_drop = np.multiply(e, keep, out=st.ed[:n, :w])
        else:
            e_drop = e
        np.add(dv, np.matmul(e_drop.T, doa, out=st.tmp_v[:w]), out=dv)
        # dP = dO V^T (times the keep mask / (1-p)), then dS = P * (dP - delta).
        dos = st.do[:n]
        np.multiply(do_r, inv_keep, out=dos)
        np.matmul(dos, v_blk.T, out=tmat)
        if keep is not None:
            np.multiply(tmat, keep, out=tmat)
        np.subtract(tmat, delta[:, None], out=tmat)
    else:
        np.negative(np.broadcast_to(delta[:, None], (n, w)), out=tmat)
    np.multiply(tmat, e, out=tmat)  # dS, up to the row factor a_i on the static path
    if ctx["rows_bad"] is not None and ctx["rows_bad"][row].any():
        np.copyto(tmat, 0.0, where=e == 0)  # excluded pairs: dS = 0, even if dP - D is NaN

    coef = (a * spec.scale) if a is not None else np.full((n,), spec.scale, cd)
    if ctx["d_mask_acc"] is not None:
        g = tmat * a[:, None] if a is not None else tmat.copy()
        _add_mask_grad(spec, ctx, b, h, r0, r1, c0, c1, g)
    if spec.softcap is not None:
        t = st.t[:n, :w]
        np.multiply(t, t, out=t)
        np.subtract(1.0, t, out=t)
        np.multiply(tmat, t, out=tmat)
    # dQ rows += coef * (dS K);  dK += dS^T (coef * Q).
    tq = np.matmul(tmat, lay.k_op[b + (hk, slice(c0, c1))], out=st.tmp_q[:n])
    np.multiply(tq, coef[:, None], out=tq)
    dq_rows = dq[row]
    np.add(dq_rows, tq, out=dq_rows)
    qa = np.multiply(lay.q_op[row], coef[:, None], out=st.qa[:n])
    np.add(dk, np.matmul(tmat.T, qa, out=st.tmp_k[:w]), out=dk)


def _add_mask_grad(spec, ctx, b, h, r0, r1, c0, c1, g):
    """Accumulate the gradient of a float mask block into the mask's own (broadcast)
    shape. The units that share mask elements are one unit (``_mask_groups``), so this
    runs without a lock and always in the same order."""
    acc = ctx["d_mask_acc"]
    nd = acc.ndim
    idx = []
    full = b + (h,)
    for axis in range(nd - 2):
        idx.append(0 if acc.shape[axis] == 1 else full[axis])
    if acc.shape[-2] == 1:
        g = g.sum(axis=0, keepdims=True)
        idx.append(slice(0, 1))
    else:
        idx.append(slice(r0, r1))
    if acc.shape[-1] == 1:
        g = g.sum(axis=1, keepdims=True)
        idx.append(slice(0, 1))
    else:
        idx.append(slice(c0, c1))
    view = acc[tuple(idx)]
    np.add(view, g, out=view)


# The forward lives in its own module (GQA-stacked tiles, split-KV); it uses the layout,
# scratch and pool helpers above.
from ._fast_forward import forward  # noqa: E402


def _register() -> None:
    from ._fast_path import FastPath
    from .attention import register_implementation

    register_implementation("fast", FastPath(), declines=declines, auto_rank=0)


_register()
