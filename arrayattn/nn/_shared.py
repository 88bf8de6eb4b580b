"""Caches shared across threads and processes: one re-entrant lock per cache around every
method that reads or changes its state, and pickling that carries the array namespace by
module name (a module cannot be pickled) and gives the copy a lock of its own.

Every mutating method of :class:`~arrayattn.nn.KVCache` and
:class:`~arrayattn.nn.PagedKVCache` runs whole under the cache's lock, so appends from
several threads serialise: the cache ends as some sequential order of them would leave
it. Reads (``lengths``, ``filled``, ``attend``, pickling) take the lock too and see the
state before or after an append, never half of one. A module call with a cache holds the
lock from its checks to its last write (the positions it reads are the ones it appends
at). The lock is re-entrant and public as ``cache.lock``, so ``with cache.lock:`` makes
several calls one atomic step.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import array_api_compat

from .._backend import device_of, namespace_from_name, namespace_name

__all__ = ["SharedState", "locked"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="SharedState")


def locked(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """``method`` run whole under its object's lock (see :class:`SharedState`)."""

    @functools.wraps(method)
    def run(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class SharedState:
    """Base of the caches: the lock, and ``__getstate__``/``__setstate__`` for ``pickle``
    and ``copy.deepcopy``.

    The state pickled is the instance's ``__dict__`` without the lock and with the
    namespace ``xp`` replaced by its module name (re-imported through the backend layer
    on unpickling). Writable buffers and lists are copied under the lock first, so
    pickling while another thread appends sees the state before or after that append
    (at the cost of one copy of the cache while it pickles). The device is taken again
    from the unpickled buffers when there are any (a device object of some libraries
    cannot be pickled), else kept as given.

    Examples:
        >>> import pickle
        >>> import numpy as np
        >>> from arrayattn.nn import KVCache
        >>> cache = KVCache.allocate(1, 1, 4, 2, xp=np, dtype=np.float32)
        >>> new = np.ones((1, 1, 3, 2), np.float32)
        >>> _ = cache.append(new, new)
        >>> copy = pickle.loads(pickle.dumps(cache))
        >>> copy.lengths.tolist(), bool((copy.keys == cache.keys).all())
        ([3], True)
    """

    _lock: threading.RLock

    def _init_lock(self) -> None:
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """The cache's re-entrant lock: every method holds it; hold it yourself
        (``with cache.lock:``) to make several calls one atomic step."""
        return self._lock

    def __getstate__(self) -> dict[str, Any]:
        # Writable arrays and lists are copied under the lock: the pickler reads the state
        # after this returns, when another thread's append may be writing.
        with self._lock:
            state = {k: _frozen(v) for k, v in self.__dict__.items() if k != "_lock"}
        xp = state.get("xp")
        state["xp"] = None if xp is None else namespace_name(xp)
        if state.get("keys") is not None:
            state["device"] = None  # read again from the buffers
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if state.get("xp") is not None:
            state["xp"] = namespace_from_name(state["xp"])
        if state.get("keys") is not None:
            state["device"] = device_of(state["keys"])
        self.__dict__.update(state)
        self._init_lock()


def _frozen(value: Any) -> Any:
    """A copy of ``value`` that later writes to the original cannot reach: lists (of
    lists) and writable arrays are copied, everything else is returned as it is."""
    if isinstance(value, list):
        return [_frozen(v) for v in value]
    if array_api_compat.is_array_api_obj(value) and array_api_compat.is_writeable_array(value):
        xp = array_api_compat.array_namespace(value)
        return xp.asarray(value, copy=True)
    return value
