"""The CUDA kernel path of ``PagedKVCache.attend`` on CuPy: the split-KV decode kernels of
``arrayattn/attention/cuda/decode_attn.cu`` read each sequence's pages in place through the
block table (no page is copied or gathered), the keys of a sequence split across thread
blocks and merged by LSE (``arrayattn/attention/cuda/decode.py``).

:func:`attend_with_kernel` takes a ``launch`` and an allocating namespace, so the CPU
tests run the kernels' own source under the host emulator with the very arguments the
GPU gets (``tests/nn/test_paged_kernel.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._backend import Array
from ..attention.cuda import decode
from ..attention.cuda.tiles import DIAG_FROM_LENGTHS

__all__ = ["kernel_supports", "attend_with_kernel"]


def kernel_supports(cache_dtype: str, query_dtype: str, D: int, Dv: int, attn_mask: Any) -> bool:
    """Whether the kernels take the call: the query in the cache's dtype (float16,
    bfloat16, float32 or float64), head dims multiples of 8 up to 256, no ``attn_mask``."""
    return (
        attn_mask is None
        and cache_dtype == query_dtype
        and cache_dtype in ("float16", "bfloat16", "float32", "float64")
        and decode.decode_plan(cache_dtype, D, Dv) is not None
    )


def attend_with_kernel(
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
    launch: decode.Launch | None = None,
    alloc: Any = None,
) -> Array:
    """``(B, Hq, L, Dv)`` in ``query``'s dtype: query row ``i < q_lengths[b]`` is the
    token at ``lengths[b] - q_lengths[b] + i`` (bottom-right), padding rows are 0.

    ``launch``/``alloc``: the launcher and the allocating namespace of
    :func:`arrayattn.attention.cuda.decode.run_decode` (default: CuPy's; the CPU tests pass the
    host emulator's with NumPy arrays).
    """
    B, Hq, L, D = (int(d) for d in query.shape)
    Hkv, P, Dv = cache.num_kv_heads, cache.page_size, cache.value_dim
    kind = str(query.dtype)
    f64 = kind == "float64"
    acc = np.float64 if f64 else np.float32
    if launch is None:
        import cupy

        def put(a: np.ndarray) -> Any:
            return cupy.asarray(np.ascontiguousarray(a))

        def host(a: Any) -> np.ndarray:
            return cupy.asnumpy(a)

        launch, alloc = decode._cupy_launch, cupy
        sm_count = decode._sm_count(cupy.cuda.runtime.getDevice())
        q = cupy.ascontiguousarray(query)
    else:
        put, host, sm_count = np.ascontiguousarray, np.asarray, 132
        q = np.ascontiguousarray(query)
    lengths = [int(n) for n in np.asarray(cache.lengths).tolist()]
    max_pages = max(1, max(len(t) for t in cache.block_tables))
    tables = np.zeros((B, max_pages), dtype=np.int32)
    for b, t in enumerate(cache.block_tables):
        tables[b, : len(t)] = t
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0 if right < 0 else min(right, 0)

    def per_head(a: Any) -> Any:  # (Hq,) or (B, Hq) -> contiguous (B * Hq,)
        if a is None:
            return None
        h = host(a).astype(acc)
        h = np.broadcast_to(h.reshape((1,) * (2 - h.ndim) + h.shape), (B, Hq))
        return put(np.ascontiguousarray(h).reshape(B * Hq))

    plan = decode.decode_plan(kind, D, Dv, Hq // Hkv * L)
    assert plan is not None
    out, _ = decode.run_decode(
        alloc, launch, plan,
        q, (Hq * L * D, L * D, D),
        cache.keys, (Hkv * P * D, P * D, D),
        cache.values, (Hkv * P * Dv, P * Dv, Dv),
        batch=B, heads=Hq, kv_heads=Hkv, rows=L, keys=max([1, *lengths]), e=D, ev=Dv,
        scale=scale, out_dtype=q.dtype, diag=DIAG_FROM_LENGTHS, window=(left, right),
        tables=put(tables), page_size=P,
        q_lens=put(np.asarray(q_lengths, dtype=np.int32)),
        kv_lens=put(np.asarray(lengths, dtype=np.int32)),
        softcap=softcap, alibi=per_head(alibi_slopes), sinks=per_head(sinks),
        sm_count=sm_count,
    )  # fmt: skip
    return out
