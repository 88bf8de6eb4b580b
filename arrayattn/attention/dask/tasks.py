"""The Dask path's task functions: what runs on the workers, one call per task.

Module-level, so that they pickle by reference (workers need only arrayattn installed).
Block tasks run arrayattn's own attention on their chunks with ``implementation="auto"``
on one thread (``_fast_threads.one_thread``): Dask supplies the parallelism.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from ..._backend import Array
from .plan import _Block, _namespace, _Shapes

_HEAP_TUNED: bool | None = None
"""Whether this process's allocator was tuned by :func:`_keep_freed_memory` (``None``:
no task ran here yet)."""
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free heap a worker keeps for the next task (glibc ``M_TRIM_THRESHOLD``)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from the reusable heap (glibc ``M_MMAP_THRESHOLD``)."""


def _keep_freed_memory() -> None:
    """Let this ``dask.distributed`` worker process reuse freed memory across tasks
    (glibc only, once; nothing in other processes).

    Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also fixes
    glibc's mmap threshold at 128 KiB: every array a task allocates is fresh, zero-filled
    pages that fault in, and the first task of each compute page-faulted ~64 MiB (16k
    faults, +50% on a 0.1 s causal 8192-row head; measured 2026-11-22). Bounded: at most
    :data:`TRIM_THRESHOLD_BYTES` of free heap is kept. ``ARRAYATTN_DASK_KEEP_MEMORY=0``
    leaves the allocator alone."""
    global _HEAP_TUNED
    if _HEAP_TUNED is not None:
        return
    _HEAP_TUNED = False
    import os

    if os.environ.get("ARRAYATTN_DASK_KEEP_MEMORY", "1").strip() == "0":
        return
    if not sys.platform.startswith("linux") or not _in_distributed_worker():
        return  # a user's own process (Dask's local schedulers) keeps its allocator
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        # mallopt returns 1 on success (M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3).
        ok = libc.mallopt(-1, TRIM_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(-3, MMAP_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return
    _HEAP_TUNED = ok


def _in_distributed_worker() -> bool:
    distributed = sys.modules.get("distributed")  # a worker process has it imported
    if distributed is None:
        return False
    try:
        distributed.get_worker()
    except (ValueError, AttributeError):  # not inside a worker's task
        return False
    return True


def _worker_memory_limit() -> int | None:
    """The bytes a ``dask.distributed`` worker's nanny lets this process hold before it
    kills it (``memory_limit`` times the ``terminate`` fraction); ``None`` outside a
    worker or without a limit."""
    if not _in_distributed_worker():
        return None
    import dask

    worker = sys.modules["distributed"].get_worker()
    manager = getattr(worker, "memory_manager", worker)
    limit = getattr(manager, "memory_limit", None)
    if not limit:
        return None
    fraction = dask.config.get("distributed.worker.memory.terminate", 0.95) or 1.0
    return int(limit * float(fraction))


def _nbytes(*arrays: Any) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in arrays if x is not None)


def _widened(*arrays: Any) -> int:
    """Bytes of the float32 copies :func:`_in_compute_dtype` makes of 16-bit arrays."""
    return sum(2 * _nbytes(x) for x in arrays if x is not None and x.dtype.itemsize == 2)


def _require_worker_memory(kind: str, blk: _Block, held: tuple[Any, ...], made: int) -> None:
    """``MemoryError`` naming the block, its chunks and the chunk size to choose, before
    a task allocates, when the chunks it holds (``held``) and the arrays it makes
    (``made`` bytes: its results, float32 copies of 16-bit chunks) exceed the worker's
    memory limit. Without this the worker's nanny kills the process mid-task, Dask
    retries the task on other workers (each killed in turn) and the caller gets
    ``KilledWorker`` naming neither the sizes nor what to change."""
    limit = _worker_memory_limit()
    if limit is None:
        return
    need = _nbytes(*held) + made
    if need <= limit:
        return
    rows = int(held[0].shape[-2])
    fit = max(1, int(rows * limit / need / 2))  # half the limit: room for the rest
    shapes = ", ".join(str(tuple(x.shape)) for x in held[:3])
    raise MemoryError(
        f"arrayattn's Dask {kind} task for query rows {blk.row0}..{blk.row0 + rows} "
        f"needs about {need} bytes (query, key, value chunks {shapes}, and the arrays the "
        f"task makes) but the worker's memory limit allows {limit} bytes (memory_limit x "
        f"the 'terminate' fraction); rechunk the sequence axis (-2) of query and "
        f"key/value to about {fit} rows or fewer (e.g. x.rechunk({{-2: {fit}}})), or give "
        f"the workers more memory"
    )


def _in_compute_dtype(*arrays):
    """float16/bfloat16 operands in their compute dtype (float32), exactly: a block whose
    results are partial (merged over key blocks, or summed into a gradient) then returns
    them in float32, and the input dtype's rounding happens once, in the final merge or
    sum, as in the one-process call (FlashAttention keeps its split-KV partial outputs and
    its dQ accumulator in float32 too). Other arrays (float32/float64, bool masks, None)
    are returned as they are."""
    from ..._backend import compute_dtype, is_real_floating

    out = []
    for x in arrays:
        if x is not None:
            xp = _namespace(x)
            if is_real_floating(xp, x.dtype):
                cd = compute_dtype(xp, x.dtype)
                x = x if cd == x.dtype else xp.astype(x, cd)
        out.append(x)
    return out


def _forward_block(
    blk: _Block,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    q_len: Array | None,
    kv_len: Array | None,
    alibi: Array | None = None,
) -> tuple[Array, Array]:
    from ..registry import select as _select
    from ..threads import one_thread

    _keep_freed_memory()
    # Made: the output (query-sized, value's width) and LSE in the compute dtype.
    e = max(1, int(q.shape[-1]))
    made = _nbytes(q) * int(v.shape[-1]) // e + _nbytes(q) // e
    _require_worker_memory("forward", blk, (q, k, v, mask), made + _widened(q, k, v, mask))
    if blk.partial_keys:  # partial results: kept in the compute dtype until the merge
        q, k, v, mask = _in_compute_dtype(q, k, v, mask)
    spec = blk.spec(q, k, v, mask, q_len, kv_len, alibi)
    with one_thread():  # Dask runs a task per core: no pool inside a task
        return _select(spec, "auto").forward(spec, q, k, v, mask)


def _empty_state(shapes: _Shapes, q: Array) -> tuple[Array, Array]:
    """Output 0 and LSE -inf for query rows no key block reaches."""
    xp = _namespace(q)
    from ..._backend import compute_dtype, device_of

    dev = device_of(q)
    out = xp.zeros(shapes.out, dtype=q.dtype, device=dev)
    lse = xp.full(shapes.lse, -math.inf, dtype=compute_dtype(xp, q.dtype), device=dev)
    return out, lse


def _sink_state(state, sink):
    """Merge the sink (a logit with no value, gpt-oss) into a row block's ``(out, lse)``:
    the state over all keys, merged with ``(0, sink_h)``."""
    out, lse = state
    xp = _namespace(lse)
    s = xp.astype(sink, lse.dtype)[..., None]  # (*lead or 1, heads or 1, 1) over rows
    new = xp.logaddexp(lse, s)
    w = xp.where(xp.isfinite(lse), xp.exp(lse - new), xp.zeros_like(lse))
    return xp.astype(out * xp.astype(w[..., None], out.dtype), out.dtype), new


def _merge(*states):
    from ..merge import merge_attention_states

    return merge_attention_states([s[0] for s in states], [s[1] for s in states])


def _merged_output(dtype, *states):
    """The output chunk of a query block: its parts' states merged, in the call's dtype."""
    return _output(_merge(*states), dtype)


def _merged_lse(out, *states):
    """The LSE chunk of a query block, from the LSEs of the parts merged into ``out``
    (taken only so that this task runs where the parts are)."""
    from ..merge import merged_lse

    return merged_lse([s[1] for s in states])


def _block_output(dtype, *block_args):
    """A query block's output chunk computed by its only block, in the call's dtype."""
    return _output(_forward_block(*block_args), dtype)


def _pick(i: int, state: tuple[Any, ...]) -> Any:
    return state[i]


def _output(state, dtype):
    """The merged state's output in the call's dtype (partials merge in float32)."""
    out = state[0]
    return out if out.dtype == dtype else _namespace(out).astype(out, dtype)


def _row_total_block(
    blk: _Block,
    q: Array,
    k: Array,
    mask: Array | None,
    lse: Array | tuple[Array, Array],
    q_len: Array | None,
    kv_len: Array | None,
    alibi: Array | None = None,
) -> Array | None:
    """``sum_j exp(S_ij - LSE_i)`` over this block's keys, shaped like the LSE block, or
    ``None`` when no row's ``|LSE|`` is so large that it swallowed ``log(rowsum)`` (see
    ``_composed.RENORMALISE_LSE_ERROR``): rows of Hugging Face ``finfo.min`` biases, which
    the one-process backward renormalises over the whole row. Runs only for float masks."""
    from .. import composed as _composed

    if isinstance(lse, tuple):  # a merged (out, lse) state
        lse = lse[1]
    spec = blk.spec(q, k, k, mask, q_len, kv_len, alibi)
    xp, cd = spec.xp, spec.cdtype
    lse_f = xp.astype(xp.reshape(lse, spec.lse_shape), cd)
    if not bool(xp.any(_needs_total(xp, cd, lse_f))):
        return None
    s, _, _, _ = _composed.masked_scores(spec, q, k, mask)
    p = _composed.probabilities_from_lse(spec, s, _composed._group_lse(spec, lse_f))
    rows = spec.lead + (spec.Hq // spec.G, spec.G, spec.L)
    total = xp.broadcast_to(xp.sum(p, axis=-1), rows)
    return xp.reshape(total, spec.lead + (spec.Hq, spec.L))


def _needs_total(xp, cd, lse):
    from ..composed import RENORMALISE_LSE_ERROR

    eps = float(xp.finfo(cd).eps)
    return xp.logical_and(xp.isfinite(lse), xp.abs(lse) * eps > RENORMALISE_LSE_ERROR)


def _row_factor(lse, *totals):
    """``1 / total`` on the rows that need renormalising (1 elsewhere), or ``None``."""
    parts = [t for t in totals if t is not None]
    if not parts:
        return None
    xp = _namespace(parts[0])
    total = parts[0]
    for t in parts[1:]:
        total = total + t
    lse_f = xp.astype(xp.reshape(lse, tuple(total.shape)), total.dtype)
    fix = xp.logical_and(_needs_total(xp, total.dtype, lse_f), total > 0)
    one = xp.ones_like(total)
    return xp.where(fix, one / xp.where(fix, total, one), one)


def _fix_state(n: int, state: tuple[Array, Array], *parts: Any) -> tuple[Array, Array]:
    """The merged ``(out, lse)`` with rows whose huge LSE swallowed the blocks' sizes
    (``finfo.min`` bias rows: every ``lse_j`` rounds to the same value, so the LSE merge
    weighs blocks equally) re-weighted by each block's exact total ``sum exp(S - LSE)``,
    as the one-process call's whole-row softmax does. ``parts``: ``n`` block states, then
    their totals (``None`` when no row needs it)."""
    out, lse = state
    states, totals = parts[:n], parts[n:]
    if all(t is None for t in totals):
        return state
    xp = _namespace(lse)
    cd = lse.dtype
    total = num = None
    for (o, _), t in zip(states, totals, strict=True):
        term = xp.astype(t, cd)[..., None] * xp.astype(o, cd)
        total = t if total is None else total + t
        num = term if num is None else num + term
    assert total is not None  # the parts have totals: all None returned above
    fix = xp.logical_and(_needs_total(xp, cd, lse), total > 0)
    one = xp.ones_like(total)
    fixed = num / xp.where(fix, total, one)[..., None]
    out = xp.where(fix[..., None], xp.astype(fixed, out.dtype), out)
    return out, lse


def _forward_done(*lse_blocks: Any) -> None:
    """Nothing, once every LSE block it is given exists: the backward block tasks of a
    (batch chunk, head chunk) with several query blocks take it as their first argument,
    so that they start once that cell's whole forward has run (see :func:`backward`)."""
    return None


def _backward_block(
    forward_done: None,
    blk: _Block,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
    q_len: Array | None,
    kv_len: Array | None,
    factor: Array | None = None,
    alibi: Array | None = None,
    delta: Array | None = None,
) -> tuple[Array | None, ...]:
    from ..registry import select as _select
    from ..threads import one_thread

    _keep_freed_memory()
    # Made: the gradients of query, key, value (and a float mask) in the compute dtype,
    # and their reduction to the chunks' shapes.
    held = (q, k, v, mask, out, d_out)
    made = 2 * _nbytes(q, k, v, mask) + _widened(*held)
    _require_worker_memory("backward", blk, held, made)
    if delta is not None:
        # The row's D = rowsum(dO * O), made once per query block by `_row_delta` (so the
        # block does not need the output chunk): every implementation computes
        # rowsum(dO * O) - dLSE, so a zero output with dLSE - D in place of dLSE gives
        # the same D - dLSE.
        xp = _namespace(delta)
        d_lse = -delta if d_lse is None else xp.reshape(d_lse, tuple(delta.shape)) - delta
    if factor is not None:
        # P_ij / T_i on renormalised rows: dS = c P (dP - D) and dV = P^T (c dO), so the
        # row factor c goes on dO and dLSE (D = rowsum(dO * O) scales with dO).
        xp = _namespace(factor)
        if d_out is not None:
            d_out = d_out * xp.astype(factor[..., None], d_out.dtype)
        if d_lse is not None:
            d_lse = d_lse * xp.astype(xp.reshape(factor, tuple(d_lse.shape)), d_lse.dtype)

    # Gradients are summed over blocks: kept in the compute dtype until the final sum.
    q, k, v, mask, out, d_out = _in_compute_dtype(q, k, v, mask, out, d_out)
    if delta is not None:
        out = _namespace(d_out).zeros_like(d_out)
    spec = blk.spec(q, k, v, mask, q_len, kv_len, alibi)
    lse = _namespace(lse).reshape(lse, spec.lse_shape)
    with one_thread():
        return _select(spec, "auto").backward(spec, q, k, v, mask, out, lse, d_out, d_lse)


def _row_delta(out, d_out):
    """``D = rowsum(dO * O)`` of one query block, in the compute dtype, shaped like its
    LSE chunk: the per-row term of the backward (FlashAttention-2's preprocessing step),
    computed once for the block tasks of that row instead of once in each."""
    from ..._backend import rowwise_dot

    out, d_out = _in_compute_dtype(out, d_out)
    return rowwise_dot(_namespace(out), d_out, out)  # as every path on the block does


@dataclass(frozen=True)
class _Picks:
    """Which element of each part to sum (``None``: the part is an array already), and the
    dtype of the result (``None``: the parts' own; the final sum of a gradient chunk casts
    its float32 partials to the input's dtype)."""

    index: tuple[int | None, ...]
    dtype: Any = None


def _sum_parts(picks: _Picks, *parts: Any) -> Array:
    """The sum of the picked parts, in ``picks.dtype`` when given. The parts are in the
    compute dtype already (float32/float64: ``_backward_block`` runs on operands in it),
    so they add up without copies and the input dtype's rounding happens once, here."""
    arrays = [p if i is None else p[i] for i, p in zip(picks.index, parts, strict=True)]
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    if picks.dtype is None or total.dtype == picks.dtype:
        return total
    return _namespace(total).astype(total, picks.dtype)


def _zeros_like(x):
    xp = _namespace(x)
    return xp.zeros_like(x)


def _score_mod_block(
    blk: _Block,
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
    q_len: Array | None,
    kv_len: Array | None,
    alibi: Array | None = None,
) -> tuple[Array, ...]:
    """One block pair's share of a score_mod's parameter gradients: ``dS`` of the block
    recomputed from the saved row LSE (the whole row's) and the row's ``D = rowsum(dO *
    O)``, handed to the score_mod (global indices through the block's origins)."""
    from .. import composed as _composed
    from ..threads import one_thread

    _keep_freed_memory()
    q, k, v, mask, out, d_out = _in_compute_dtype(q, k, v, mask, out, d_out)
    spec = blk.spec(q, k, v, mask, q_len, kv_len, alibi)
    lse = _namespace(lse).reshape(lse, spec.lse_shape)
    with one_thread():
        return _composed.score_mod_param_grads(spec, q, k, v, mask, out, lse, d_out, d_lse)


def _sum_tuples(*parts: tuple[Array, ...]) -> tuple[Array, ...]:
    """Elementwise sums of tuples of arrays, in the order given."""
    totals = list(parts[0])
    for p in parts[1:]:
        totals = [t + x for t, x in zip(totals, p, strict=True)]
    return tuple(totals)


def _param_grad(n: int, param: Array, total: tuple[Array, ...] | None) -> Array:
    """Parameter ``n``'s gradient from the summed parts (zeros when no block ran)."""
    xp = _namespace(param)
    if total is None:
        return xp.zeros(param.shape, dtype=param.dtype)
    return xp.astype(total[n], param.dtype)
