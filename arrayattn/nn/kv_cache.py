"""``KVCache``: preallocated key/value buffers for incremental decoding.

Keys and values of every generated token are written once into buffers of the maximum
length, in place where the library's arrays are writable (NumPy, CuPy, PyTorch,
array-api-strict) and by building new buffers where they are not (JAX): decoding never
grows arrays by concatenation on writable backends.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._backend import Array, device_of, namespace_of, resolve_namespace

__all__ = ["KVCache"]


class KVCache:
    """Keys ``(B, Hkv, max_length, D)`` and values ``(B, Hkv, max_length, Dv)`` of which
    the first ``length`` positions are filled.

    Create one with :meth:`allocate` (or ``MultiHeadAttention.new_cache``); a module call
    with ``cache=`` appends the new tokens' keys and values (after qk-norm and RoPE) and
    attends over everything cached so far.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import KVCache
        >>> cache = KVCache.allocate(1, 2, 16, 8, xp=np)
        >>> new = np.ones((1, 2, 3, 8), np.float32)
        >>> k, v = cache.append(new, new)
        >>> cache.length, k.shape
        (3, (1, 2, 3, 8))
    """

    def __init__(self, keys: Array, values: Array, length: int = 0) -> None:
        self.xp = namespace_of(keys=keys, values=values)
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
        if not 0 <= length <= keys.shape[2]:
            raise ValueError(f"length must be in [0, {keys.shape[2]}], got {length}")
        self.keys = keys
        self.values = values
        self.length = int(length)

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
        """Zero-filled buffers for ``max_length`` positions (``dtype`` default float32)."""
        for name, n in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_length", max_length),
            ("head_dim", head_dim),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        ns = resolve_namespace(xp)
        dt = ns.float32 if dtype is None else dtype
        dv = head_dim if value_dim is None else value_dim
        keys = ns.zeros((batch_size, num_kv_heads, max_length, head_dim), dtype=dt, device=device)
        values = ns.zeros((batch_size, num_kv_heads, max_length, dv), dtype=dt, device=device)
        return cls(keys, values)

    @property
    def max_length(self) -> int:
        return int(self.keys.shape[2])

    @property
    def in_place(self) -> bool:
        """True when appends write into the buffers (the library's arrays are writable)."""
        return bool(array_api_compat.is_writeable_array(self.keys))

    def filled(self) -> tuple[Array, Array]:
        """The cached keys and values: prefixes ``(B, Hkv, length, D)`` and
        ``(B, Hkv, length, Dv)`` of the buffers (views where the library has them)."""
        n = self.length
        return self.keys[:, :, :n, :], self.values[:, :, :n, :]

    def reset(self) -> None:
        """Forget the cached tokens (buffers are kept and overwritten later)."""
        self.length = 0

    def append(self, key: Array, value: Array) -> tuple[Array, Array]:
        """Write ``key (B, Hkv, l, D)`` and ``value (B, Hkv, l, Dv)`` at positions
        ``[length, length + l)`` and return the filled prefixes ``(B, Hkv, length, ...)``
        (``length`` already advanced)."""
        xp = namespace_of(keys=self.keys, key=key, value=value)
        ks, vs = tuple(key.shape), tuple(value.shape)
        if key.ndim != 4 or ks[:2] != tuple(self.keys.shape[:2]) or ks[3] != self.keys.shape[3]:
            raise ValueError(
                f"key must have shape (B, Hkv, l, D) = {tuple(self.keys.shape[:2])} + (l, "
                f"{self.keys.shape[3]}), got {ks}"
            )
        if value.ndim != 4 or vs[:3] != ks[:3] or vs[3] != self.values.shape[3]:
            raise ValueError(
                f"value must have shape {ks[:3] + (int(self.values.shape[3]),)}, got {vs}"
            )
        if key.dtype != self.keys.dtype or value.dtype != self.values.dtype:
            raise TypeError(
                f"key/value dtypes {key.dtype}/{value.dtype} differ from the cache's "
                f"{self.keys.dtype}"
            )
        start, stop = self.length, self.length + int(ks[2])
        if stop > self.max_length:
            raise ValueError(
                f"cache overflow: {self.length} cached + {ks[2]} new > max_length {self.max_length}"
            )
        if self.in_place:
            self.keys[:, :, start:stop, :] = key
            self.values[:, :, start:stop, :] = value
        else:
            self.keys = _spliced(xp, self.keys, key, start, stop)
            self.values = _spliced(xp, self.values, value, start, stop)
        self.length = stop
        return self.keys[:, :, :stop, :], self.values[:, :, :stop, :]

    def __repr__(self) -> str:
        return (
            f"KVCache(length={self.length}, max_length={self.max_length}, "
            f"shape={tuple(self.keys.shape)}, dtype={self.keys.dtype}, "
            f"device={device_of(self.keys)!r})"
        )


def _spliced(xp: Any, buffer: Array, new: Array, start: int, stop: int) -> Array:
    """``buffer`` with positions ``[start, stop)`` replaced by ``new`` (immutable arrays)."""
    return xp.concat((buffer[:, :, :start, :], new, buffer[:, :, stop:, :]), axis=2)
