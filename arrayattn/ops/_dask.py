"""``implementation="dask"``: attention over Dask arrays as a graph of a few large tasks.

``implementation="auto"`` picks this path for Dask arrays. It never computes while it
builds the graph, and the graph has one task per block, not per element:

- The output is cut like the query: its batch (leading) chunks, its head chunks (rounded
  up to whole GQA groups, so each KV head stays with its query heads) and its sequence
  chunks (query blocks). The key's sequence chunks are the key blocks.
- One task per (batch chunk, head chunk, query block, key block) that the causal
  alignment or window does not leave empty. It runs arrayattn's own attention on its
  NumPy (or CuPy, ...) chunks with ``implementation="auto"``, so the chunk's library gets
  its best path (the NumPy fast path, the CuPy fused kernels), and returns the block's
  partial output and LSE.
- With several key blocks the partials of a query block are merged by
  :func:`~arrayattn.ops.merge.merge_attention_states` in a tree (fan-in
  :data:`MERGE_FAN_IN`); with one key block there is nothing to merge.
- The backward (FlashAttention-2 split) runs one task per scheduled block pair from the
  saved output and LSE (``P = exp(S - LSE)``, ``D = rowsum(dO * O)``), and sums each
  input block's gradient over the tasks that read it (dK/dV over query blocks, dQ over
  key blocks, over batch chunks for broadcast keys) in a tree. No task holds ``L x S``.
  With several query blocks, a (batch chunk, head chunk)'s backward tasks start once its
  whole forward has run (a tiny task on every row's LSE), so that Dask places them all
  by the workers' load rather than row by row.
- Each task runs its chunk's path on one thread (``_fast_threads.one_thread``): Dask
  supplies the parallelism, one task per worker thread.
- ``sinks`` join each row once, merged into the row block's state after the key blocks;
  ``alibi_slopes`` are cut per head chunk and each block applies them on its own diagonal.
- Rows whose LSE swallowed ``log(rowsum)`` (Hugging Face ``finfo.min`` float masks on a
  fully masked row) are re-weighted by exact per-block totals, forward and backward, as
  the one-process call's whole-row softmax does; this extra pass runs only for float
  masks split over several key blocks.

Every block is an :class:`~arrayattn.ops._attention_spec.AttentionSpec` of its own, made
with :meth:`~arrayattn.ops._attention_spec.AttentionSpec.as_block`: its diagonal is the
global one moved by ``row0 - col0``, per-sequence lengths are moved likewise, and dropout
hashes global ``(batch, head, row, col)``, so the result is the one-process call's.

Rechunk rule (one ``rechunk`` per input, only where needed): the query's chunks define the
batch axes (the key's or value's where the query broadcasts there), the head axis (the
key's when the query has one broadcast head) and the query blocks; head chunks are rounded
up to multiples of the GQA group size; the key's sequence chunks define the key blocks;
the value, the mask and the lengths are rechunked to match; the head-dim axes become one
chunk. Gradients come back in these chunks.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

import numpy as np

from .._backend import Array, is_dask
from ._attention_spec import AttentionSpec, make_spec
from .masks import Structure

__all__ = ["forward", "backward", "declines", "MERGE_FAN_IN", "SUM_FAN_IN"]

MERGE_FAN_IN = 4
"""Partial results merged per task in the forward's tree reduction."""
SUM_FAN_IN = 8
"""Gradient parts summed per task in the backward's tree reduction."""


def declines(spec: AttentionSpec) -> str | None:
    """``None`` when this path takes the call (Dask arrays), else the reason.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.ops._attention_spec import make_spec
        >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
        >>> make = lambda a: make_spec(a, a, a, None, 0.0, False, None, False,
        ...                            "top_left", None, None, None)
        >>> declines(make(q))
        'implementation="dask" needs Dask arrays, got numpy arrays'
    """
    if not is_dask(spec.xp):
        from .._backend import library_name

        return f'implementation="dask" needs Dask arrays, got {library_name(spec.xp)} arrays'
    return None


# ---------------------------------------------------------------------------------------
# The static description of one block (pickled into its task)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Call:
    """The call's options, resolved once for every block."""

    dropout_p: float
    scale: float
    enable_gqa: bool
    window: tuple[int, int] | None  # the structure's (left, right): causal is (-1, 0)
    softcap: float | None
    seed: int | None
    L: int
    S: int
    diagonal: int  # the global structure offset
    per_sequence_diagonal: bool  # bottom-right with lengths: kv_len - q_len per sequence
    offset_bounds: tuple[int, int] | None


@dataclass(frozen=True)
class _Block:
    """Where one task's chunks sit in the whole call."""

    call: _Call
    batch_ids: tuple[int, ...]
    head0: int
    row0: int
    col0: int
    partial_keys: bool

    def spec(self, q, k, v, mask, q_len, kv_len, alibi=None) -> AttentionSpec:
        c = self.call
        # Per-head options only when given (older specs have no such keywords).
        per_head = {} if alibi is None else {"alibi_slopes": alibi}
        xp_lengths = None
        if q_len is not None or kv_len is not None:
            xp_lengths = _namespace(q)
        # Lengths in block coordinates (make_spec clips them to the block's rows/keys).
        q_loc = None if q_len is None else xp_lengths.astype(q_len, xp_lengths.int64) - self.row0
        kv_loc = None if kv_len is None else xp_lengths.astype(kv_len, xp_lengths.int64) - self.col0
        spec = make_spec(
            q,
            k,
            v,
            mask,
            c.dropout_p,
            False,  # the structure comes whole as a window; as_block sets its diagonal
            c.scale,
            c.enable_gqa,
            "top_left",
            c.window,
            c.softcap,
            c.seed,
            q_lengths=q_loc,
            kv_lengths=kv_loc,
            **per_head,
        )
        shift = self.row0 - self.col0
        offset_g = offset_range = None
        if c.per_sequence_diagonal:
            # The global per-sequence diagonal (kv_len - q_len, clipped lengths), moved.
            xp = spec.xp
            kv = c.S if kv_len is None else xp.clip(xp.astype(kv_len, xp.int64), 0, c.S)
            ql = c.L if q_len is None else xp.clip(xp.astype(q_len, xp.int64), 0, c.L)
            offset_g = xp.reshape(xp.astype(kv - ql + shift, xp.int32), spec.lead + (1,) * 4)
            lo, hi = c.offset_bounds
            offset_range = (lo + shift, hi + shift)
        return spec.as_block(
            batch_ids=self.batch_ids,
            head0=self.head0,
            row0=self.row0,
            col0=self.col0,
            structure=Structure(c.diagonal + shift, *(c.window or (-1, -1))),
            offset_g=offset_g,
            offset_range=offset_range,
            partial_keys=self.partial_keys,
        )


def _namespace(x: Array) -> Any:
    from array_api_compat import array_namespace

    return array_namespace(x)


# ---------------------------------------------------------------------------------------
# Task functions (run on the workers; module-level so that they pickle)
# ---------------------------------------------------------------------------------------
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


def _in_compute_dtype(*arrays):
    """float16/bfloat16 operands in their compute dtype (float32), exactly: a block whose
    results are partial (merged over key blocks, or summed into a gradient) then returns
    them in float32, and the input dtype's rounding happens once, in the final merge or
    sum, as in the one-process call (FlashAttention keeps its split-KV partial outputs and
    its dQ accumulator in float32 too). Other arrays (float32/float64, bool masks, None)
    are returned as they are."""
    from .._backend import compute_dtype, is_real_floating

    out = []
    for x in arrays:
        if x is not None:
            xp = _namespace(x)
            if is_real_floating(xp, x.dtype):
                cd = compute_dtype(xp, x.dtype)
                x = x if cd == x.dtype else xp.astype(x, cd)
        out.append(x)
    return out


def _forward_block(blk: _Block, q, k, v, mask, q_len, kv_len, alibi=None):
    from ._fast_threads import one_thread
    from .attention import _select

    _keep_freed_memory()
    if blk.partial_keys:  # partial results: kept in the compute dtype until the merge
        q, k, v, mask = _in_compute_dtype(q, k, v, mask)
    spec = blk.spec(q, k, v, mask, q_len, kv_len, alibi)
    with one_thread():  # Dask runs a task per core: no pool inside a task
        return _select(spec, "auto").forward(spec, q, k, v, mask)


def _empty_state(shapes: _Shapes, q):
    """Output 0 and LSE -inf for query rows no key block reaches."""
    xp = _namespace(q)
    from .._backend import compute_dtype, device_of

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
    from .merge import merge_attention_states

    return merge_attention_states([s[0] for s in states], [s[1] for s in states])


def _merge_task(level: int, group: list) -> tuple:
    return (_merge, *group)


def _merged_output(dtype, *states):
    """The output chunk of a query block: its parts' states merged, in the call's dtype."""
    return _output(_merge(*states), dtype)


def _merged_lse(out, *states):
    """The LSE chunk of a query block, from the LSEs of the parts merged into ``out``
    (taken only so that this task runs where the parts are)."""
    from .merge import merged_lse

    return merged_lse([s[1] for s in states])


def _block_output(dtype, *block_args):
    """A query block's output chunk computed by its only block, in the call's dtype."""
    return _output(_forward_block(*block_args), dtype)


def _pick(i: int, state):
    return state[i]


def _output(state, dtype):
    """The merged state's output in the call's dtype (partials merge in float32)."""
    out = state[0]
    return out if out.dtype == dtype else _namespace(out).astype(out, dtype)


def _row_total_block(blk: _Block, q, k, mask, lse, q_len, kv_len, alibi=None):
    """``sum_j exp(S_ij - LSE_i)`` over this block's keys, shaped like the LSE block, or
    ``None`` when no row's ``|LSE|`` is so large that it swallowed ``log(rowsum)`` (see
    ``_composed.RENORMALISE_LSE_ERROR``): rows of Hugging Face ``finfo.min`` biases, which
    the one-process backward renormalises over the whole row. Runs only for float masks."""
    from . import _composed

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
    from ._composed import RENORMALISE_LSE_ERROR

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


def _fix_state(n: int, state, *parts):
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
    fix = xp.logical_and(_needs_total(xp, cd, lse), total > 0)
    one = xp.ones_like(total)
    fixed = num / xp.where(fix, total, one)[..., None]
    out = xp.where(fix[..., None], xp.astype(fixed, out.dtype), out)
    return out, lse


def _renormalise_forward(plan, dsk, blk_name, li, hi, i, root, leaves):
    """Tasks that correct the merge of query block ``i`` on huge-LSE rows (float masks)."""
    totals = []
    for leaf in leaves:
        j = leaf[-1]
        t_key = (blk_name + "-total", *li, hi, i, j)
        dsk[t_key] = (
            _row_total_block,
            plan.block(li, hi, i, j),
            plan.q_key(li, hi, i),
            plan.kv_key(plan.k, li, hi, j),
            plan.mask_key(li, hi, i, j),
            root,
            plan.len_key(plan.q_len, li),
            plan.len_key(plan.kv_len, li),
            plan.head_key(plan.alibi, li, hi),
        )
        totals.append(t_key)
    key = (blk_name + "-fixed", *li, hi, i)
    dsk[key] = (_fix_state, len(leaves), root, *leaves, *totals)
    return key


def _forward_done(*lse_blocks) -> None:
    """Nothing, once every LSE block it is given exists: the backward block tasks of a
    (batch chunk, head chunk) with several query blocks take it as their first argument,
    so that they start once that cell's whole forward has run (see :func:`backward`)."""
    return None


def _backward_block(
    forward_done: None,
    blk: _Block,
    q,
    k,
    v,
    mask,
    out,
    lse,
    d_out,
    d_lse,
    q_len,
    kv_len,
    factor=None,
    alibi=None,
):
    from ._fast_threads import one_thread
    from .attention import _select

    _keep_freed_memory()
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
    spec = blk.spec(q, k, v, mask, q_len, kv_len, alibi)
    lse = _namespace(lse).reshape(lse, spec.lse_shape)
    with one_thread():
        return _select(spec, "auto").backward(spec, q, k, v, mask, out, lse, d_out, d_lse)


@dataclass(frozen=True)
class _Picks:
    """Which element of each part to sum (``None``: the part is an array already), and the
    dtype of the result (``None``: the parts' own; the final sum of a gradient chunk casts
    its float32 partials to the input's dtype)."""

    index: tuple[int | None, ...]
    dtype: Any = None


@dataclass(frozen=True)
class _Shapes:
    out: tuple[int, ...]
    lse: tuple[int, ...]


def _sum_parts(picks: _Picks, *parts):
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


# ---------------------------------------------------------------------------------------
# Planning the block grid
# ---------------------------------------------------------------------------------------
def _pad(x: Array | None, nd: int) -> Array | None:
    if x is None or x.ndim == nd:
        return x
    return x[(None,) * (nd - x.ndim) + (Ellipsis,)]


def _own(size: int, chunks: tuple[int, ...]) -> tuple[int, ...]:
    """An operand axis's chunks: ``(1,)`` where it broadcasts (size 1), else the call's
    ``chunks`` for that axis (``(0,)`` for an empty one)."""
    return (1,) if size == 1 else tuple(chunks)


def _round_to_groups(chunks: tuple[int, ...], g: int) -> tuple[int, ...]:
    """Head chunks whose boundaries are moved up to multiples of ``g`` (GQA groups)."""
    bounds, total = [], 0
    for c in chunks:
        total += c
        b = min(-(-total // g) * g, sum(chunks))
        if not bounds or b > bounds[-1]:
            bounds.append(b)
    return tuple(b - a for a, b in zip([0] + bounds[:-1], bounds, strict=True))


def _starts(chunks: tuple[int, ...]) -> list[int]:
    out, s = [], 0
    for c in chunks:
        out.append(s)
        s += c
    return out


@dataclass
class _Plan:
    spec: AttentionSpec
    nd: int
    q: Array
    k: Array
    v: Array
    mask: Array | None
    q_len: Array | None
    kv_len: Array | None
    lead_chunks: tuple[tuple[int, ...], ...]
    head_chunks: tuple[int, ...]
    row_chunks: tuple[int, ...]
    col_chunks: tuple[int, ...]
    call: _Call
    token: str
    sinks: Array | None = None  # (*lead or 1s, Hq or 1), rechunked like the output
    alibi: Array | None = None

    # -- block keys of the (rechunked, padded) inputs ---------------------------------
    def _lead_idx(self, x: Array, li: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(0 if x.shape[a] == 1 else li[a] for a in range(len(li)))

    def q_key(self, li, hi, i):
        q = self.q
        return (q.name,) + self._lead_idx(q, li) + (0 if q.shape[-3] == 1 else hi, i, 0)

    def kv_key(self, x, li, hi, j):
        return (x.name,) + self._lead_idx(x, li) + (0 if x.shape[-3] == 1 else hi, j, 0)

    def mask_key(self, li, hi, i, j):
        m = self.mask
        if m is None:
            return None
        h = 0 if m.shape[-3] == 1 else hi
        return (
            (m.name,)
            + self._lead_idx(m, li)
            + (h, 0 if m.shape[-2] == 1 else i, 0 if m.shape[-1] == 1 else j)
        )

    def head_key(self, x, li, hi):
        if x is None:
            return None
        return (x.name,) + self._lead_idx(x, li) + (0 if x.shape[-1] == 1 else hi,)

    def len_key(self, x, li):
        if x is None:
            return None
        return (x.name,) + tuple(li)

    def blocks(self):
        """``(lead index, head index, i, j)`` of every scheduled block, and the key blocks
        of each query block."""
        spec = self.spec
        row_starts, col_starts = _starts(self.row_chunks), _starts(self.col_chunks)
        reach = {}
        for i, (r0, n) in enumerate(zip(row_starts, self.row_chunks, strict=True)):
            if n == 0:  # no rows: the empty state has the right (zero-row) shape
                reach[i] = []
                continue
            lo, hi = spec.structure.col_range(r0, r0 + n, spec.S, spec.offset_bounds)
            reach[i] = [
                j
                for j, (c0, m) in enumerate(zip(col_starts, self.col_chunks, strict=True))
                if m > 0 and c0 < hi and c0 + m > lo
            ]
        return reach

    def cut_by_band(self, i: int, j: int) -> bool:
        """True when the causal/window band's edge crosses block ``(i, j)`` (or may: with
        per-sequence diagonals the band is data), so the block does less work than a full
        one. Such blocks get their own task name, so that the scheduler learns their
        duration apart from the full blocks'."""
        from . import _composed

        r0, c0 = _starts(self.row_chunks)[i], _starts(self.col_chunks)[j]
        r1, c1 = r0 + self.row_chunks[i], c0 + self.col_chunks[j]
        return not _composed.inside_band(self.spec, r0, r1, c0, c1)

    def block(self, li, hi, i, j) -> _Block:
        lead = self.spec.lead
        ranges = []
        for a in range(len(lead)):
            start = _starts(self.lead_chunks[a])[li[a]]
            ranges.append(np.arange(start, start + self.lead_chunks[a][li[a]]))
        if lead:
            grids = np.meshgrid(*ranges, indexing="ij")
            ids = np.ravel_multi_index(tuple(g.ravel() for g in grids), lead)
            batch_ids = tuple(int(x) for x in ids)
        else:
            batch_ids = (0,)
        return _Block(
            call=self.call,
            batch_ids=batch_ids,
            head0=_starts(self.head_chunks)[hi],
            row0=_starts(self.row_chunks)[i],
            col0=_starts(self.col_chunks)[j],
            # With sinks the blocks run without them (the sink joins each row once, after
            # the merge), so no block's rows are whole rows.
            partial_keys=len(self.col_chunks) > 1 or self.sinks is not None,
        )

    def grid(self):
        return product(
            product(*[range(len(c)) for c in self.lead_chunks]), range(len(self.head_chunks))
        )

    def shapes(self, li, hi, i) -> _Shapes:
        lead = tuple(self.lead_chunks[a][li[a]] for a in range(len(li)))
        rows = lead + (self.head_chunks[hi], self.row_chunks[i])
        return _Shapes(rows + (self.spec.Ev,), rows)

    def inputs(self) -> list[Array]:
        xs = (self.q, self.k, self.v, self.mask, self.q_len, self.kv_len, self.sinks, self.alibi)
        return [x for x in xs if x is not None]


def _plan(spec: AttentionSpec, query, key, value, attn_mask, tag: str) -> _Plan:
    from dask.base import tokenize

    nd = len(spec.lead) + 3
    q, k, v, mask = (_pad(x, nd) for x in (query, key, value, attn_mask))
    lead = spec.lead
    lead_chunks = []
    for a, n in enumerate(lead):
        src = next((x for x in (q, k, v) if x.shape[a] == n and n > 1), None)
        lead_chunks.append((n,) if src is None else tuple(src.chunks[a]))
    Hq, Hkv, G = spec.Hq, spec.Hkv, spec.G
    if q.shape[-3] == Hq and Hq > 1:
        head_chunks = tuple(q.chunks[-3])
    elif k.shape[-3] == Hq and Hq > 1:
        head_chunks = tuple(k.chunks[-3])
    else:
        head_chunks = (Hq,)
    if G > 1 and Hkv > 1:
        head_chunks = _round_to_groups(head_chunks, G)
    kv_head_chunks = tuple(c // G for c in head_chunks) if Hkv > 1 else (Hkv,)
    row_chunks = tuple(q.chunks[-2])
    col_chunks = tuple(k.chunks[-2])

    def target(x, heads, seq, width):
        chunks = [_own(x.shape[a], lead_chunks[a]) for a in range(len(lead))]
        chunks.append(_own(x.shape[-3], heads))
        chunks.append(seq)
        chunks.append(width if width is not None else (int(x.shape[-1]),))
        return tuple(chunks)

    def rechunk(x, chunks):
        chunks = tuple(chunks)
        return x if tuple(x.chunks) == chunks else x.rechunk(chunks)

    q = rechunk(q, target(q, head_chunks, row_chunks, None))
    k = rechunk(k, target(k, kv_head_chunks, col_chunks, None))
    v = rechunk(v, target(v, kv_head_chunks, col_chunks, None))
    if mask is not None:
        mc = [_own(mask.shape[a], lead_chunks[a]) for a in range(len(lead))]
        mc.append(_own(mask.shape[-3], head_chunks))
        mc.append(_own(mask.shape[-2], row_chunks))
        mc.append(_own(mask.shape[-1], col_chunks))
        mask = rechunk(mask, mc)
    q_len = kv_len = None
    if spec.q_lengths is not None:
        q_len = rechunk(spec.q_lengths, lead_chunks)
    if spec.kv_lengths is not None:
        kv_len = rechunk(spec.kv_lengths, lead_chunks)
    per_head = []
    for x in (getattr(spec, "sinks", None), getattr(spec, "alibi_slopes", None)):
        if x is not None:
            x = _pad(x, len(lead) + 1)
            hc = [_own(x.shape[a], lead_chunks[a]) for a in range(len(lead))]
            x = rechunk(x, hc + [_own(x.shape[-1], head_chunks)])
        per_head.append(x)
    st = spec.structure
    call = _Call(
        dropout_p=spec.dropout_p,
        scale=spec.scale,
        enable_gqa=G > 1,
        window=None if st.is_trivial else (st.left, st.right),
        softcap=spec.softcap,
        seed=spec.seed,
        L=spec.L,
        S=spec.S,
        diagonal=st.offset,
        per_sequence_diagonal=spec.offset_g is not None,
        offset_bounds=spec.offset_bounds,
    )
    names = [x.name for x in (q, k, v, mask, q_len, kv_len, *per_head) if x is not None]
    token = tokenize(tag, names, call, lead_chunks, head_chunks)
    return _Plan(
        spec,
        nd,
        q,
        k,
        v,
        mask,
        q_len,
        kv_len,
        tuple(lead_chunks),
        head_chunks,
        row_chunks,
        col_chunks,
        call,
        token,
        *per_head,
    )


# ---------------------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------------------
def _tree(dsk: dict, name: str, leaves: list, fan_in: int, make, until: int = 1) -> list:
    """Reduce ``leaves`` (keys) in a tree of tasks ``make(*keys)`` until at most ``until``
    keys are left; returns them (the root alone with ``until=1``)."""
    level = 0
    while len(leaves) > until:
        nxt = []
        for n, at in enumerate(range(0, len(leaves), fan_in)):
            group = leaves[at : at + fan_in]
            if len(group) == 1:
                nxt.append(group[0])
                continue
            key = (name, level, n)
            dsk[key] = make(level, group)
            nxt.append(key)
        leaves = nxt
        level += 1
    return leaves


def _array(graph_layers, deps, name, dsk, parents, chunks, meta, dtype):
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    graph_layers[name] = MaterializedLayer(dsk)
    deps[name] = set(parents)
    return da.Array(
        HighLevelGraph(dict(graph_layers), dict(deps)), name, chunks, meta=meta, dtype=dtype
    )


def _collect(arrays: list[Array]) -> tuple[dict, dict]:
    layers, deps = {}, {}
    for x in arrays:
        g = x.__dask_graph__()
        layers.update(g.layers)
        deps.update(g.dependencies)
    return layers, deps


def forward(
    spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
) -> tuple[Array, Array]:
    """Output ``(..., Hq, L, Ev)`` and LSE ``(..., Hq, L)`` as Dask arrays whose graph has
    one task per scheduled (batch chunk, head chunk, query block, key block) plus the LSE
    merges; nothing is computed here.

    Examples:
        >>> import numpy as np, dask.array as da
        >>> import arrayattn as aa
        >>> x = da.ones((1, 2, 8, 4), chunks=(1, 1, 4, 4))
        >>> out = aa.scaled_dot_product_attention(x, x, x, is_causal=True)
        >>> out.shape, out.chunks[1:3]
        ((1, 2, 8, 4), ((1, 1), (4, 4)))
    """
    # Graphs built for the output alone name their keys apart: their output chunks of
    # single-block rows are other tasks, with the same keys Dask would see two run specs.
    plan = _plan(spec, query, key, value, attn_mask, "fwd" if spec.lse_wanted else "fwd-out")
    dsk: dict = {}
    # Distinct names (Dask keeps per-name duration estimates): full blocks, blocks cut by
    # the causal/window band (about half the work), and merges (a few milliseconds).
    blk_name = "attn-blocks-" + plan.token
    edge_name = "attn-edge-blocks-" + plan.token
    out_name, lse_name = "attn-out-" + plan.token, "attn-lse-" + plan.token
    out_dsk, lse_dsk = {}, {}
    reach = plan.blocks()
    for li, hi in plan.grid():
        for i in range(len(plan.row_chunks)):
            qk = plan.q_key(li, hi, i)
            leaves = []
            for j in reach[i]:
                key_ = (edge_name if plan.cut_by_band(i, j) else blk_name, *li, hi, i, j)
                dsk[key_] = (
                    _forward_block,
                    plan.block(li, hi, i, j),
                    qk,
                    plan.kv_key(plan.k, li, hi, j),
                    plan.kv_key(plan.v, li, hi, j),
                    plan.mask_key(li, hi, i, j),
                    plan.len_key(plan.q_len, li),
                    plan.len_key(plan.kv_len, li),
                    plan.head_key(plan.alibi, li, hi),
                )
                leaves.append(key_)
            out_key, lse_key = (out_name, *li, hi, i, 0), (lse_name, *li, hi, i)
            merge_name = "attn-merge-" + plan.token + "-" + "-".join(map(str, (*li, hi, i)))
            if len(leaves) > 1 and spec.mask_kind != "float" and plan.sinks is None:
                # The last merge is the output chunk's own task (and the LSE's): a merge
                # task followed by one that picks its output would be fused by Dask into
                # a renamed task plus an alias, one more task and one more round trip
                # through the scheduler at the end of every row. The LSE task depends on
                # the output's too, so that both run where the parts already are.
                last = _tree(dsk, merge_name, leaves, MERGE_FAN_IN, _merge_task, MERGE_FAN_IN)
                out_dsk[out_key] = (_merged_output, spec.dtype, *last)
                lse_dsk[lse_key] = (_merged_lse, out_key, *last)
                continue
            if len(leaves) == 1 and not spec.lse_wanted and plan.sinks is None:
                # The caller drops the LSE: the block's own task makes the output chunk.
                # A block task followed by one that picks its output would again be
                # fused by Dask into a renamed task plus an alias. The LSE chunk keeps a
                # block task of its own, which runs only if that LSE is computed after all.
                _, *block_args = dsk[leaves[0]]
                out_dsk[out_key] = (_block_output, spec.dtype, *block_args)
                lse_dsk[lse_key] = (_pick, 1, leaves[0])
                continue
            if not leaves:
                root = (blk_name + "-empty", *li, hi, i)
                dsk[root] = (_empty_state, plan.shapes(li, hi, i), qk)
            else:
                root = _tree(dsk, merge_name, leaves, MERGE_FAN_IN, _merge_task)[0]
                if spec.mask_kind == "float" and len(leaves) > 1:
                    root = _renormalise_forward(plan, dsk, blk_name, li, hi, i, root, leaves)
            if plan.sinks is not None:
                sunk = (blk_name + "-sink", *li, hi, i)
                dsk[sunk] = (_sink_state, root, plan.head_key(plan.sinks, li, hi))
                root = sunk
            out_dsk[out_key] = (_output, root, spec.dtype)
            lse_dsk[lse_key] = (_pick, 1, root)

    layers, deps = _collect(plan.inputs())
    from dask.highlevelgraph import MaterializedLayer

    layers[blk_name] = MaterializedLayer(dsk)
    deps[blk_name] = {x.name for x in plan.inputs()}
    rows = plan.lead_chunks + (plan.head_chunks, plan.row_chunks)
    from .._backend import compute_dtype

    xp = spec.xp
    out = _array(
        layers, deps, out_name, out_dsk, {blk_name}, rows + ((spec.Ev,),), plan.q._meta, spec.dtype
    )
    lse = _array(
        layers,
        deps,
        lse_name,
        lse_dsk,
        {blk_name, out_name},
        rows,
        plan.q._meta,
        compute_dtype(xp, spec.dtype),
    )
    return xp.reshape(out, spec.out_shape), xp.reshape(lse, spec.lse_shape)


def backward(
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
) -> tuple[Array, Array, Array, Array | None]:
    """``(d_query, d_key, d_value, d_mask)`` as Dask arrays: one task per scheduled block
    pair recomputes its probabilities from the saved LSE (FlashAttention-2), and each input
    block's gradient is the tree sum of the tasks that read it. ``d_mask`` is ``None``
    unless the mask is a float bias. Users reach it through ``arrayattn.vjp``.

    Examples:
        >>> import numpy as np, dask.array as da
        >>> import arrayattn as aa
        >>> x = da.ones((1, 2, 8, 4), chunks=(1, 1, 4, 4))
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, x, x, x, is_causal=True)
        >>> [g.shape for g in pullback(da.ones_like(out))]
        [(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)]
    """
    xp = spec.xp
    plan = _plan(spec, query, key, value, attn_mask, "bwd")
    nd = plan.nd
    rows = plan.lead_chunks + (plan.head_chunks, plan.row_chunks)
    full_rows = spec.lead + (spec.Hq, spec.L)

    def rows_of(x, width):
        if x is None:
            return None
        shape = full_rows + (() if width is None else (width,))
        x = xp.reshape(_pad(x, nd - (width is None)), shape)
        chunks = rows + (() if width is None else ((width,),))
        return x if tuple(x.chunks) == chunks else x.rechunk(chunks)

    out_r, do_r = rows_of(out, spec.Ev), rows_of(d_out, spec.Ev)
    lse_r, dl_r = rows_of(lse, None), rows_of(d_lse, None)

    from dask.base import tokenize

    # The cotangents are part of the graph's identity: two pullbacks must not share keys.
    names_in = [None if a is None else a.name for a in (out_r, lse_r, do_r, dl_r)]
    token = tokenize(plan.token, names_in)
    blk_name = "attn-bwd-" + token
    dsk: dict = {}
    reach = plan.blocks()
    # Float masks may carry huge biases whose rows the one-process backward renormalises
    # over the whole row; with several key blocks, a first pass sums those totals.
    factors = {}
    if spec.mask_kind == "float" and len(plan.col_chunks) > 1:
        for li, hi in plan.grid():
            for i in range(len(plan.row_chunks)):
                rk = (*li, hi, i)
                totals = []
                for j in reach[i]:
                    t_key = (blk_name + "-total", *li, hi, i, j)
                    dsk[t_key] = (
                        _row_total_block,
                        plan.block(li, hi, i, j),
                        plan.q_key(li, hi, i),
                        plan.kv_key(plan.k, li, hi, j),
                        plan.mask_key(li, hi, i, j),
                        (lse_r.name, *rk),
                        plan.len_key(plan.q_len, li),
                        plan.len_key(plan.kv_len, li),
                        plan.head_key(plan.alibi, li, hi),
                    )
                    totals.append(t_key)
                if totals:
                    f_key = (blk_name + "-factor", *rk)
                    dsk[f_key] = (_row_factor, (lse_r.name, *rk), *totals)
                    factors[rk] = f_key
    # For each input block: the block tasks that read it.
    readers: dict[int, dict[tuple, list]] = {0: {}, 1: {}, 2: {}, 3: {}}
    inputs = (plan.q, plan.k, plan.v, plan.mask)
    for li, hi in plan.grid():
        # With several query blocks, a cell's backward starts once its whole forward has
        # (every row's LSE exists). Dask's static order otherwise interleaves the rows
        # (forward of row 0, its backward, forward of row 1, ...), so under causal
        # masking the largest rows' backward tasks became ready last, queued behind the
        # earlier rows' on the worker holding their rows, and the other worker idled
        # (busy 724 vs 919 ms in one 0.98 s call). Started together, they are placed by
        # the workers' load. See docs/scaling.md.
        done = None
        if len(plan.row_chunks) > 1:
            done = (blk_name + "-forward-done", *li, hi)
            rows_lse = [(lse_r.name, *li, hi, i) for i in range(len(plan.row_chunks))]
            dsk[done] = (_forward_done, *rows_lse)
        for i in range(len(plan.row_chunks)):
            rk = (*li, hi, i)
            for j in reach[i]:
                key_ = (blk_name, *li, hi, i, j)
                in_keys = (
                    plan.q_key(li, hi, i),
                    plan.kv_key(plan.k, li, hi, j),
                    plan.kv_key(plan.v, li, hi, j),
                    plan.mask_key(li, hi, i, j),
                )
                dsk[key_] = (
                    _backward_block,
                    done,
                    plan.block(li, hi, i, j),
                    *in_keys,
                    (out_r.name, *rk, 0),
                    (lse_r.name, *rk),
                    None if do_r is None else (do_r.name, *rk, 0),
                    None if dl_r is None else (dl_r.name, *rk),
                    plan.len_key(plan.q_len, li),
                    plan.len_key(plan.kv_len, li),
                    factors.get(rk),
                    plan.head_key(plan.alibi, li, hi),
                )
                for n, ik in enumerate(in_keys):
                    if ik is not None:
                        readers[n].setdefault(ik[1:], []).append(key_)

    grads = []
    names = []
    for n, x in enumerate(inputs):
        if x is None or (n == 3 and spec.mask_kind != "float"):
            grads.append(None)
            continue
        g_name = f"attn-grad{n}-{token}"
        g_dsk = {}
        for idx in product(*[range(len(c)) for c in x.chunks]):
            parts = readers[n].get(idx, [])
            if not parts:
                g_dsk[(g_name, *idx)] = (_zeros_like, (x.name, *idx))
                continue

            def make(level, group, n=n):
                # Block tasks return all four gradients; tree nodes return one array.
                picks = _Picks(tuple(n if k[0] == blk_name else None for k in group))
                return (_sum_parts, picks, *group)

            if len(parts) == 1:
                task = make(0, parts)
            else:
                sum_name = g_name + "-sum-" + "-".join(map(str, idx))
                task = dsk.pop(_tree(dsk, sum_name, parts, SUM_FAN_IN, make)[0])
            _, picks, *group = task
            g_dsk[(g_name, *idx)] = (_sum_parts, replace(picks, dtype=x.dtype), *group)
        names.append((n, g_name, g_dsk, x))

    row_inputs = [a for a in (out_r, lse_r, do_r, dl_r) if a is not None]
    layers, deps = _collect(plan.inputs() + row_inputs)
    from dask.highlevelgraph import MaterializedLayer

    layers[blk_name] = MaterializedLayer(dsk)
    deps[blk_name] = {a.name for a in plan.inputs() + row_inputs}
    results: list[Array | None] = [None] * 4
    for n, g_name, g_dsk, x in names:
        g = _array(layers, deps, g_name, g_dsk, {blk_name, x.name}, x.chunks, x._meta, x.dtype)
        results[n] = g
    user = (query, key, value, attn_mask)
    for n in range(4):
        if results[n] is not None:
            results[n] = xp.reshape(results[n], tuple(user[n].shape))
    return results[0], results[1], results[2], results[3]


def _register() -> None:
    import importlib.util

    from .attention import register_implementation

    if importlib.util.find_spec("dask") is None:  # no Dask arrays can reach this path
        return
    register_implementation("dask", sys.modules[__name__], declines=declines, auto_rank=1)


_register()
