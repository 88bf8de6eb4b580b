"""A cache's buffers checked against what can exist before they are allocated: no more
elements than an int64 counts, and on the host no more bytes than the machine's memory.
A capacity near ``2**31`` or ``2**63`` (``max_length=np.int64(2**62)``) is then a clear
``ValueError`` naming the arguments, not a library's ``MemoryError``, an overflowing
size, or a lazily committed buffer that fails at its first write."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._backend import in_host_memory, physical_memory

__all__ = ["check_buffer_size"]

INT64_MAX = 2**63 - 1


def _itemsize(xp: Any, dtype: Any) -> int:
    """Bytes per element of ``dtype`` (1 when not known yet: ``dtype=None``)."""
    if dtype is None:
        return 1
    try:
        return int(xp.finfo(dtype).bits) // 8
    except Exception:  # not a floating dtype, or a library without finfo for it
        pass
    try:
        return int(np.dtype(dtype).itemsize)
    except Exception:  # a dtype object NumPy does not know
        return 8


def check_buffer_size(
    what: str,
    shape: tuple[int, ...],
    xp: Any,
    device: Any,
    dtype: Any,
    *,
    itemsize: int | None = None,
) -> None:
    """Raise a ``ValueError`` naming ``what`` (the cache and its sizing arguments), the
    shape, the bytes needed and the limit, when buffers of ``shape`` and ``dtype`` cannot
    exist: more elements than ``2**63 - 1``, or (host arrays) more bytes than the
    machine's physical memory. ``dtype=None`` (not known yet) counts one byte per
    element, ``itemsize`` overrides the dtype's, and ``xp=None`` (library not known yet)
    checks the element count only. Nothing is allocated.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn._capacity import check_buffer_size
        >>> check_buffer_size("keys", (2, 2, 8, 4), np, "cpu", np.float32)  # fits: None
        >>> check_buffer_size("keys", (1, 1, 2**62, 4), np, "cpu", np.float32)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: keys: buffers of shape (1, 1, 4611686018427387904, 4) ...
    """
    elements = math.prod(shape)
    need = elements * (_itemsize(xp, dtype) if itemsize is None else itemsize)
    limit = physical_memory() if xp is not None and in_host_memory(xp, device) else None
    if elements > INT64_MAX:
        reason = f"{elements} elements, more than an int64 counts ({INT64_MAX})"
    elif limit is not None and need > limit:
        reason = f"{need / 2**30:.4g} GiB, more than this machine's {limit / 2**30:.4g} GiB"
    else:
        return
    raise ValueError(
        f"{what}: buffers of shape {tuple(shape)}{'' if dtype is None else f' ({dtype})'} "
        f"would need {reason}; nothing was allocated. Use a smaller capacity."
    )
