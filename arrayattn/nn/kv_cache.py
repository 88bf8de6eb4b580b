"""``KVCache``: preallocated key/value buffers for incremental decoding, one row per
sequence, each row with its own length.

Keys and values of every generated token are written once into buffers of the maximum
length, in place where the library's arrays are writable (NumPy, CuPy, PyTorch,
array-api-strict) and by building new buffers where they are not (JAX): decoding never
grows arrays by concatenation on writable backends. Row ``b`` appends at its own position
``lengths[b]``, so prompts of different lengths decode together; attention over the cache
masks each row's unfilled tail through ``kv_lengths`` (no dense mask).
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from .._backend import (
    Array,
    Namespace,
    device_of,
    is_cupy,
    is_numpy,
    namespace_of,
    require_arrays,
    resolve_namespace,
)
from ._capacity import check_buffer_size
from ._shared import SharedState, locked

__all__ = ["KVCache", "check_count", "host_lengths", "check_rows"]


def check_count(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` as a Python int (any integral type: ``int``, ``np.int64``); a
    ``TypeError`` for non-integers (``2.5``, ``True``) and a ``ValueError`` below
    ``minimum``, each naming ``name``, the value seen and what is expected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def host_lengths(name: str, lengths: Any, batch_size: int, maximum: int) -> tuple[int, ...]:
    """Per-sequence counts as a tuple of Python ints, from a sequence of ints or a 1-D
    integer array of any library, checked to be ``batch_size`` values in ``[0, maximum]``."""
    if isinstance(lengths, (numbers.Number, str, bytes)) or lengths is None:
        raise TypeError(
            f"{name} must be a sequence or 1-D integer array of {batch_size} counts, got "
            f"{type(lengths).__name__} {lengths!r}"
        )
    dtype = getattr(lengths, "dtype", None)
    if dtype is not None:
        xp = array_api_compat.array_namespace(lengths)
        if not xp.isdtype(dtype, "integral"):
            raise TypeError(f"{name} must have an integer dtype, got {dtype}")
        if lengths.ndim != 1:
            raise ValueError(
                f"{name} must be 1-D ({batch_size},), got shape {tuple(lengths.shape)}"
            )
    values = list(lengths)
    for v in values:
        if dtype is None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise TypeError(f"{name} must hold ints, got {type(v).__name__} {v!r}")
    out = tuple(int(v) for v in values)
    if len(out) != batch_size:
        raise ValueError(
            f"{name} must have {batch_size} entries (one per sequence), got {len(out)}"
        )
    bad = [(b, n) for b, n in enumerate(out) if not 0 <= n <= maximum]
    if bad:
        b, n = bad[0]
        raise ValueError(f"{name}[{b}] = {n} is outside [0, {maximum}]")
    return out


def check_rows(rows: Any, batch_size: int) -> list[int]:
    """The sequence rows a ``reset``/``free`` names (one int, a sequence of ints or a 1-D
    integer array) as Python ints, every one checked to be in ``[0, batch_size)`` before
    the caller changes anything.

    Examples:
        >>> check_rows(1, 3), check_rows([0, 2], 3)
        ([1], [0, 2])
    """
    # int named beside Integral only so that type checkers narrow it away below.
    listed = [rows] if isinstance(rows, (int, numbers.Integral)) else rows
    if isinstance(listed, (str, bytes)) or not hasattr(listed, "__iter__"):
        raise TypeError(
            f"rows must be an int, a sequence of ints or None, got {type(rows).__name__} {rows!r}"
        )
    out = []
    for b in listed:
        b = check_count("rows", b, minimum=0)
        if b >= batch_size:
            raise ValueError(f"rows must be in [0, {batch_size}), got {b}")
        out.append(b)
    return out


def check_new_entries(
    key: Array,
    value: Array,
    lengths: Any,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    value_dim: int,
) -> tuple[Namespace, int, tuple[int, ...]]:
    """Validate the ``key``/``value`` entries given to a cache's ``append``: shapes
    ``(B, Hkv, l, D)`` and ``(B, Hkv, l, Dv)``, one dtype, and the per-row counts
    (``lengths``, default ``l`` for every row). Returns the namespace, ``l`` and the counts."""
    require_arrays(key=key, value=value)
    xp = namespace_of(key=key, value=value)
    ks, vs = tuple(int(d) for d in key.shape), tuple(int(d) for d in value.shape)
    head = (batch_size, num_kv_heads)
    if key.ndim != 4 or ks[:2] != head or ks[3] != head_dim:
        raise ValueError(f"key must have shape (B, Hkv, l, D) = {head} + (l, {head_dim}), got {ks}")
    if value.ndim != 4 or vs[:3] != ks[:3] or vs[3] != value_dim:
        raise ValueError(f"value must have shape {ks[:3] + (value_dim,)}, got {vs}")
    if key.dtype != value.dtype:
        raise TypeError(f"key ({key.dtype}) and value ({value.dtype}) must share a dtype")
    n = (ks[2],) * batch_size if lengths is None else lengths
    return xp, ks[2], host_lengths("lengths", n, batch_size, ks[2])


class KVCache(SharedState):
    """Keys ``(B, Hkv, max_length, D)`` and values ``(B, Hkv, max_length, Dv)``; row ``b``
    holds one sequence whose first ``lengths[b]`` positions are filled.

    Create one with :meth:`allocate` (or ``MultiHeadAttention.new_cache``); a module call
    with ``cache=`` appends the new tokens' keys and values (after qk-norm and RoPE) of
    each row at that row's own position and attends over everything the row holds.

    One cache may be shared by threads: every method runs under the cache's re-entrant
    :attr:`lock`, so concurrent appends serialise (the cache ends as some sequential order
    of them leaves it) and a read sees the state before or after an append, never half
    (the arrays :meth:`filled` returns are views of the buffers, which later appends
    write to: copy them, or hold ``cache.lock``, while other threads write). A cache
    pickles (and deep-copies) with its contents, to move it to another process.

    Args:
        keys: ``(B, Hkv, max_length, D)`` buffer.
        values: ``(B, Hkv, max_length, Dv)`` buffer of the same library, device and dtype.
        length: filled positions: one int for every row, or one int per row.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import KVCache
        >>> cache = KVCache.allocate(2, 2, 16, 8, xp=np)  # dtype follows the first append
        >>> new = np.ones((2, 2, 3, 8), np.float32)
        >>> k, v = cache.append(new, new)                 # 3 tokens for both rows
        >>> cache.length, k.shape, cache.dtype
        (3, (2, 2, 3, 8), dtype('float32'))
        >>> k, v = cache.append(new, new, lengths=[1, 3])  # row 0 takes 1 token, row 1 takes 3
        >>> cache.lengths.tolist(), k.shape
        ([4, 6], (2, 2, 6, 8))
    """

    def __init__(self, keys: Array, values: Array, length: int | Sequence[int] = 0) -> None:
        self._init_lock()
        xp = namespace_of(keys=keys, values=values)
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys and values must be 4-D (B, Hkv, max_length, D), got shapes "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if tuple(keys.shape[:3]) != tuple(values.shape[:3]):
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must agree on "
                f"(B, Hkv, max_length)"
            )
        if keys.dtype != values.dtype:
            raise TypeError(f"keys ({keys.dtype}) and values ({values.dtype}) must share a dtype")
        B, H, S, D = (int(d) for d in keys.shape)
        self._init_shape(B, H, S, D, int(values.shape[3]), xp, device_of(keys), keys.dtype)
        self.keys: Array | None = keys
        self.values: Array | None = values
        if isinstance(length, numbers.Number) and not isinstance(length, bool):
            n = check_count("length", length, minimum=0)
            if n > S:
                raise ValueError(f"length must be in [0, {S}] (max_length), got {n}")
            self._lengths = np.full(B, n, dtype=np.int64)
        else:
            self._lengths = np.array(host_lengths("length", length, B, S), dtype=np.int64)

    def _init_shape(
        self, B: int, H: int, S: int, D: int, Dv: int, xp: Any, device: Any, dtype: Any
    ) -> None:
        self.batch_size, self.num_kv_heads, self._max_length = B, H, S
        self.head_dim, self.value_dim = D, Dv
        self.xp, self.device, self._dtype = xp, device, dtype
        self._follows_keys = False

    @classmethod
    def allocate(
        cls,
        batch_size: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> KVCache:
        """Zero-filled buffers for ``batch_size`` sequences of up to ``max_length``
        positions. With ``dtype=None`` the buffers follow the first keys appended (which
        follow the layer's parameters): their dtype and, when ``xp`` is ``None``, their
        library and device. With ``xp`` given and ``dtype=None``, float32 buffers are made
        at once and replaced by buffers of the keys' dtype at the first append if that
        differs (nothing is cached yet then).

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import KVCache
            >>> KVCache.allocate(1, 2, 16, 8, xp=np, dtype=np.float64).keys.shape
            (1, 2, 16, 8)
        """
        B = check_count("batch_size", batch_size)
        H = check_count("num_kv_heads", num_kv_heads)
        S = check_count("max_length", max_length)
        D = check_count("head_dim", head_dim)
        Dv = D if value_dim is None else check_count("value_dim", value_dim)
        self = cls.__new__(cls)
        self._init_lock()
        self._lengths = np.zeros(B, dtype=np.int64)
        self.keys = self.values = None
        if dtype is None:
            ns = None if xp is None else resolve_namespace(xp)
            self._init_shape(B, H, S, D, Dv, ns, device, None)
            self._follows_keys = True
            if ns is not None:  # provisional buffers (callers may hold them already)
                self._dtype = ns.float32
                self._materialise()
        else:
            ns = resolve_namespace(xp)
            self._init_shape(B, H, S, D, Dv, ns, device, dtype)
            self._materialise()
        return self

    def _materialise(self) -> None:
        xp, dev, dt = self.xp, self.device, self._dtype
        B, H, S = self.batch_size, self.num_kv_heads, self._max_length
        what = (
            f"KV cache (batch_size={B}, num_kv_heads={H}, max_length={S}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim})"
        )
        check_buffer_size(what, (B, H, S, self.head_dim + self.value_dim), xp, dev, dt)
        self.keys = xp.zeros((B, H, S, self.head_dim), dtype=dt, device=dev)
        self.values = xp.zeros((B, H, S, self.value_dim), dtype=dt, device=dev)
        self.device = device_of(self.keys)
        self._dtype = self.keys.dtype  # the library's dtype object (np.float32 -> dtype)

    # -- state ------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        """Positions per sequence (the capacity of each row)."""
        return self._max_length

    @property
    def dtype(self) -> Any:
        """The buffers' dtype (``None`` until the first append when allocated without one)."""
        return self._dtype

    @property
    @locked
    def lengths(self) -> np.ndarray:
        """Filled positions per sequence, a NumPy int64 array ``(B,)`` (a copy)."""
        return self._lengths.copy()

    @property
    @locked
    def length(self) -> int:
        """The filled positions when every row holds the same number (a ``ValueError``
        otherwise: read :attr:`lengths`)."""
        n = int(self._lengths[0])
        if np.any(self._lengths != n):
            raise ValueError(
                f"the sequences hold different numbers of positions {self._lengths.tolist()}; "
                f"read cache.lengths"
            )
        return n

    @property
    @locked
    def in_place(self) -> bool:
        """True when appends write into the buffers (the library's arrays are writable)."""
        if self.keys is None:
            return self.xp is None or not array_api_compat.is_jax_namespace(self.xp)
        return bool(array_api_compat.is_writeable_array(self.keys))

    @locked
    def filled(self) -> tuple[Array, Array]:
        """The cached keys and values up to the longest row: ``(B, Hkv, max(lengths), D)``
        and ``(B, Hkv, max(lengths), Dv)`` (views where the library has them; positions
        past a row's own length hold stale data).

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import KVCache
            >>> cache = KVCache.allocate(2, 1, 8, 4, xp=np, dtype=np.float32)
            >>> new = np.ones((2, 1, 3, 4), np.float32)
            >>> _ = cache.append(new, new, lengths=[3, 1])
            >>> [a.shape for a in cache.filled()]
            [(2, 1, 3, 4), (2, 1, 3, 4)]
        """
        if self.keys is None or self.values is None:  # both or neither
            raise ValueError("the cache is empty and has no buffers yet (nothing appended)")
        n = int(self._lengths.max())
        return self.keys[:, :, :n, :], self.values[:, :, :n, :]

    @locked
    def reset(self, rows: int | Sequence[int] | None = None) -> None:
        """Forget the cached tokens of ``rows`` (default: every row), e.g. a sequence that
        finished, so its row takes a new sequence. Buffers are kept and overwritten.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import KVCache
            >>> cache = KVCache(np.zeros((2, 1, 8, 4)), np.zeros((2, 1, 8, 4)), length=[5, 2])
            >>> cache.reset(0)
            >>> cache.lengths.tolist()
            [0, 2]
        """
        if rows is None:
            self._lengths[:] = 0
            return
        for b in check_rows(rows, self.batch_size):  # all checked before any changes
            self._lengths[b] = 0

    # -- writing ----------------------------------------------------------------------
    @locked
    def check_append(self, new_lengths: Sequence[int], dtype: Any = None) -> None:
        """Raise, changing nothing, when appending ``new_lengths[b]`` tokens to each row
        would overflow a row, or when ``dtype`` differs from the buffers' dtype.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import KVCache
            >>> cache = KVCache(np.zeros((2, 1, 8, 4)), np.zeros((2, 1, 8, 4)), length=[7, 2])
            >>> cache.check_append([2, 2])  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: KV cache overflow in sequence 0: 7 cached + 2 new tokens > its ...
        """
        # Counts past the capacity are reported below, naming the cache (the caller may
        # never have passed "lengths": a prompt longer than the cache, say).
        n = host_lengths("lengths", new_lengths, self.batch_size, sys.maxsize)
        for b, (held, new) in enumerate(zip(self._lengths.tolist(), n, strict=True)):
            if held + new > self._max_length:
                raise ValueError(
                    f"KV cache overflow in sequence {b}: {held} cached + {new} new tokens > "
                    f"its capacity max_length={self._max_length}; allocate a longer cache or "
                    f"reset(rows={b}) when the sequence has finished"
                )
        if self._rebinds(dtype):
            return
        if dtype is not None and self._dtype is not None and dtype != self._dtype:
            raise TypeError(
                f"the new keys/values have dtype {dtype} but the KV cache (capacity "
                f"{self.batch_size} sequences x {self._max_length} positions) holds "
                f"{self._dtype}; allocate it with dtype={dtype} or dtype=None, which follows "
                f"the layer's parameters"
            )

    @locked
    def append(
        self, key: Array, value: Array, lengths: Sequence[int] | None = None
    ) -> tuple[Array, Array]:
        """Write ``key (B, Hkv, l, D)`` and ``value (B, Hkv, l, Dv)``: row ``b`` takes its
        first ``lengths[b]`` new tokens (default all ``l``; the rest is right padding) at
        positions ``[self.lengths[b], self.lengths[b] + lengths[b])``. Returns the filled
        buffers up to the longest row, ``(B, Hkv, max(self.lengths), D)`` and ``(..., Dv)``
        (lengths already advanced). A rejected append changes nothing, and one interrupted
        part way (``KeyboardInterrupt``, ``MemoryError``) is undone. Atomic under
        :attr:`lock`.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import KVCache
            >>> cache = KVCache.allocate(2, 1, 8, 4)
            >>> new = np.ones((2, 1, 2, 4))
            >>> k, v = cache.append(new, new, lengths=[2, 1])
            >>> k.shape, cache.lengths.tolist(), cache.dtype
            ((2, 1, 2, 4), [2, 1], dtype('float64'))
        """
        xp, l_new, n = check_new_entries(
            key, value, lengths, self.batch_size, self.num_kv_heads, self.head_dim, self.value_dim
        )
        self.check_append(n, key.dtype)
        snap = self._snapshot()
        try:
            self._append(xp, key, value, l_new, n)
        except BaseException:
            self._restore(snap)
            raise
        return self.filled()

    def _append(self, xp: Any, key: Array, value: Array, l_new: int, n: tuple[int, ...]) -> None:
        if self.keys is None or self._rebinds(key.dtype):
            self._bind(xp, key)
        namespace_of(cache=self.keys, key=key)
        starts = self._lengths.tolist()
        uniform = len(set(starts)) == 1 and all(m == l_new for m in n)
        if uniform:  # one slice for the whole batch: the common decoding step
            s = starts[0]
            self.keys = self._write(xp, self.keys, key, (slice(None), s, s + l_new))
            self.values = self._write(xp, self.values, value, (slice(None), s, s + l_new))
        elif (
            l_new == 1
            and all(m == 1 for m in n)
            and (is_numpy(xp) or is_cupy(xp))
            and self.in_place
        ):
            # one token per row at the rows' own positions (decoding prompts of different
            # lengths): one indexed write per buffer instead of one per row
            rows = xp.arange(self.batch_size, device=self.device)
            pos = xp.asarray(starts, dtype=rows.dtype, device=self.device)
            assert self.keys is not None and self.values is not None  # bound above
            self.keys[rows, :, pos, :] = key[:, :, 0, :]
            self.values[rows, :, pos, :] = value[:, :, 0, :]
        else:
            for b, (s, m) in enumerate(zip(starts, n, strict=True)):
                if m:
                    kb, vb = key[b : b + 1, :, :m, :], value[b : b + 1, :, :m, :]
                    self.keys = self._write(xp, self.keys, kb, (slice(b, b + 1), s, s + m))
                    self.values = self._write(xp, self.values, vb, (slice(b, b + 1), s, s + m))
        # A new array, not += in place: a snapshot taken before shares no memory with it.
        self._lengths = self._lengths + np.asarray(n, dtype=np.int64)

    def _rebinds(self, dtype: Any) -> bool:
        """True when provisional buffers (``dtype=None``) must be remade for keys of
        ``dtype``: nothing is cached yet and the dtypes differ."""
        return (
            self._follows_keys
            and self.keys is not None
            and dtype is not None
            and dtype != self._dtype
            and not self._lengths.any()
        )

    def _bind(self, xp: Any, key: Array) -> None:
        # A cache allocated without a dtype takes the first keys' dtype (and their
        # library and device when none was given).
        if self.xp is None:
            self.xp, self.device = xp, device_of(key)
        self._dtype = key.dtype
        self._materialise()

    def _write(self, xp: Any, buffer: Array, new: Array, where: tuple[slice, int, int]) -> Array:
        rows, start, stop = where
        if self.in_place:
            buffer[rows, :, start:stop, :] = new
            return buffer
        # Immutable arrays (JAX): a new buffer with the rows' positions replaced.
        b0 = 0 if rows.start is None else rows.start
        b1 = buffer.shape[0] if rows.stop is None else rows.stop
        part = buffer[b0:b1, ...]
        part = xp.concat((part[:, :, :start, :], new, part[:, :, stop:, :]), axis=2)
        return xp.concat((buffer[:b0, ...], part, buffer[b1:, ...]), axis=0)

    @locked
    def kv_lengths(self, xp: Any = None) -> Array:
        """The filled lengths as an int64 array of the cache's library and device, the
        ``kv_lengths`` of an attention call over :meth:`filled`.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import KVCache
            >>> cache = KVCache(np.zeros((2, 1, 8, 4)), np.zeros((2, 1, 8, 4)), length=[5, 2])
            >>> cache.kv_lengths()
            array([5, 2])
        """
        ns = self.xp if xp is None else xp
        return ns.asarray(self._lengths.tolist(), dtype=ns.int64, device=self.device)

    # -- rollback of a failed call ------------------------------------------------------
    @locked
    def _snapshot(self) -> tuple[Any, ...]:
        # Writes land past the filled lengths; restoring the lengths (and, on immutable
        # backends, the buffer objects) undoes an append completely.
        return (self._lengths.copy(), self.keys, self.values, self._dtype, self.xp, self.device)

    @locked
    def _restore(self, snap: tuple[Any, ...]) -> None:
        lengths, self.keys, self.values, self._dtype, self.xp, self.device = snap
        self._lengths = lengths

    @locked
    def __repr__(self) -> str:
        return (
            f"KVCache(lengths={self._lengths.tolist()}, max_length={self._max_length}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, dtype={self._dtype}, device={self.device!r})"
        )
