"""The CUDA kernel path of ``PagedKVCache.attend`` on CuPy (``kernels/paged_attn.cu``): one
thread per query row reads its sequence's pages in place through the block table.

:func:`kernel_arguments` builds the launch's arguments in the kernel's order from the
cache and the call; the CPU tests launch the kernel's own source (compiled with g++) with
the very same arguments on NumPy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._backend import Array, device_of

__all__ = ["kernel_supports", "kernel_arguments", "kernel_name", "attend_with_kernel"]

KERNEL_FILE = "paged_attn.cu"
DIMS = (64, 128, 256)  # the per-thread register arrays of the instantiations
BLOCK = 128


def kernel_name(dtype_name: str, D: int, Dv: int) -> str:
    """The template instantiation for ``dtype_name`` and head dims ``D``, ``Dv``."""
    ctype = {"float32": "float", "float64": "double"}[dtype_name]
    dmax = next(n for n in DIMS if n >= D)
    dvmax = next(n for n in DIMS if n >= Dv)
    return f"aa_paged_attn<{ctype}, {dmax}, {dvmax}>"


def kernel_supports(dtype_name: str, D: int, Dv: int, attn_mask: Any) -> bool:
    """Whether the kernel takes the call: float32/float64, head dims <= 256, no mask."""
    return dtype_name in ("float32", "float64") and max(D, Dv) <= DIMS[-1] and attn_mask is None


def kernel_arguments(
    cache: Any,
    query: Array,
    q_lengths: Sequence[int],
    *,
    scale: float,
    causal: bool,
    window: tuple[int, int] | None,
    softcap: float | None,
    sinks: Array | None,
    alibi_slopes: Array | None,
) -> tuple[list[Any], Array, int]:
    """``(args, out, rows)``: the kernel's arguments in order (arrays of the cache's
    library, typed NumPy scalars), the output array they write and the number of rows
    (threads)."""
    xp = cache.xp
    dev = device_of(query)
    B, Hq, L, D = (int(d) for d in query.shape)
    real = np.float64 if query.dtype == xp.float64 else np.float32
    dt = xp.float64 if real is np.float64 else xp.float32
    max_pages = max(1, max(len(t) for t in cache.block_tables))
    tables = np.zeros((B, max_pages), dtype=np.int64)
    for b, t in enumerate(cache.block_tables):
        tables[b, : len(t)] = t

    def ints(a: Any) -> Array:
        return xp.asarray(np.asarray(a, dtype=np.int64).tolist(), dtype=xp.int64, device=dev)

    dummy = xp.zeros((1,), dtype=dt, device=dev)
    if alibi_slopes is None:
        slopes, bstride = dummy, 0
    else:
        slopes = xp.astype(alibi_slopes, dt)
        bstride = Hq if slopes.ndim == 2 else 0
    out = xp.empty((B, Hq, L, cache.value_dim), dtype=dt, device=dev)
    left, right = (-1, -1) if window is None else window
    args = [
        xp.astype(query, dt),
        cache.keys,
        cache.values,
        ints(tables),
        ints(cache.lengths),
        ints(q_lengths),
        dummy if sinks is None else xp.astype(sinks, dt),
        slopes,
        out,
        *(np.int32(n) for n in (B, Hq, cache.num_kv_heads, L, D, cache.value_dim)),
        np.int32(cache.page_size),
        np.int32(max_pages),
        real(scale),
        real(0.0 if softcap is None else softcap),
        np.int32(bool(causal)),
        np.int32(left),
        np.int32(right),
        np.int32(bstride),
        np.int32(sinks is not None),
        np.int32(alibi_slopes is not None),
    ]
    return args, out, B * Hq * L


def attend_with_kernel(cache: Any, query: Array, q_lengths: Sequence[int], **options: Any) -> Array:
    """Launch the kernel on CuPy arrays; returns ``(B, Hq, L, Dv)`` in ``query``'s dtype."""
    import cupy

    from ..kernels._loader import get_kernel

    args, out, rows = kernel_arguments(cache, query, q_lengths, **options)
    args = [cupy.ascontiguousarray(a) if isinstance(a, cupy.ndarray) else a for a in args]
    name = kernel_name(str(out.dtype), int(query.shape[-1]), cache.value_dim)
    kern = get_kernel(KERNEL_FILE, name)
    kern((max(1, math.ceil(rows / BLOCK)),), (BLOCK,), tuple(args))
    return out if out.dtype == query.dtype else out.astype(query.dtype)
