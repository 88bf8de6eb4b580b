"""Requests that cannot fit: a path that would allocate more memory than the machine has
says so before it allocates.

With Linux's default overcommit an allocation larger than the free memory often
succeeds, and the process is killed (no exception, no message) when it touches the
pages. So a path that knows its working set compares it with
:func:`arrayattn._backend.available_memory` first and raises a ``MemoryError`` naming
what takes the memory and what to do instead. Small requests skip the check (reading the
free memory costs a file read).
"""

from __future__ import annotations

from typing import Any

from .._backend import Namespace, available_memory

__all__ = ["require_memory", "CHECK_FROM_BYTES"]

CHECK_FROM_BYTES = 64 * 2**20
"""Working sets below this many bytes are not checked against the free memory."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB ({n} bytes)"


def require_memory(
    xp: Namespace, device: Any, parts: dict[str, int], what: str, advice: str
) -> None:
    """Raise ``MemoryError`` when the working set ``parts`` (name -> bytes) exceeds the
    memory that arrays of ``xp`` on ``device`` can still allocate; nothing when it fits
    or when the free memory is unknown (GPU memory, Dask). ``what`` names the path,
    ``advice`` says what to use instead.

    Examples:
        >>> import numpy as np
        >>> require_memory(np, "cpu", {"scores": 1024}, "the composed path", "")  # fits
    """
    need = sum(parts.values())
    if need < CHECK_FROM_BYTES:
        return
    free = available_memory(xp, device)
    if free is None or need <= free:
        return
    detail = ", ".join(f"{name} {_gib(n)}" for name, n in parts.items())
    raise MemoryError(
        f"{what} needs about {_gib(need)} for this call ({detail}) but only {_gib(free)} "
        f"of memory is available (checked before allocating); {advice}"
    )
