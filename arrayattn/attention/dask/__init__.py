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
  :func:`~arrayattn.attention.merge.merge_attention_states` in a tree (fan-in
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
- ``block_mask`` / ``mask_mod`` / ``score_mod`` (:mod:`arrayattn.flex`): a (query block,
  key block) pair whose block-mask blocks are all empty for its batch and head chunk gets
  no task, forward or backward (rows no task reaches are output 0, LSE -inf, or the
  sink); the other blocks' specs carry the mask and the score_mod with the block's
  origins, so the chunk's path evaluates partial blocks on global indices. A score_mod's
  parameter gradients are one more task per scheduled pair and a tree sum
  (:func:`score_mod_param_grads`).
- ``sinks`` join each row once, merged into the row block's state after the key blocks;
  ``alibi_slopes`` are cut per head chunk and each block applies them on its own diagonal.
- Rows whose LSE swallowed ``log(rowsum)`` (Hugging Face ``finfo.min`` float masks on a
  fully masked row) are re-weighted by exact per-block totals, forward and backward, as
  the one-process call's whole-row softmax does; this extra pass runs only for float
  masks split over several key blocks.

Every block is an :class:`~arrayattn.attention.spec.AttentionSpec` of its own, made
with :meth:`~arrayattn.attention.spec.AttentionSpec.as_block`: its diagonal is the
global one moved by ``row0 - col0``, per-sequence lengths are moved likewise, and dropout
hashes global ``(batch, head, row, col)``, so the result is the one-process call's.

The block grid and its rechunk rule are in :mod:`arrayattn.attention.dask.plan`; the functions
the workers run, one call per task, in :mod:`arrayattn.attention.dask.tasks`. This module
builds the graphs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from itertools import product
from typing import Any

from ..._backend import Array, is_dask
from ..registry import register_implementation
from ..spec import AttentionSpec
from .plan import _pad, _Plan, _plan
from .tasks import (
    _backward_block,
    _block_output,
    _empty_state,
    _fix_state,
    _forward_block,
    _forward_done,
    _merge,
    _merged_lse,
    _merged_output,
    _output,
    _param_grad,
    _pick,
    _Picks,
    _row_delta,
    _row_factor,
    _row_total_block,
    _score_mod_block,
    _sink_state,
    _sum_parts,
    _sum_tuples,
    _zeros_like,
)

__all__ = ["forward", "backward", "declines", "MERGE_FAN_IN", "SUM_FAN_IN"]

MERGE_FAN_IN = 4
"""Partial results merged per task in the forward's tree reduction."""
SUM_FAN_IN = 8
"""Gradient parts summed per task in the backward's tree reduction."""


def declines(spec: AttentionSpec) -> str | None:
    """``None`` when this path takes the call (Dask arrays), else the reason.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
        >>> make = lambda a: make_spec(a, a, a, None, 0.0, False, None, False,
        ...                            "top_left", None, None, None)
        >>> declines(make(q))
        'implementation="dask" needs Dask arrays, got numpy arrays'
    """
    if not is_dask(spec.xp):
        from ..._backend import library_name

        return f'implementation="dask" needs Dask arrays, got {library_name(spec.xp)} arrays'
    if spec.score_mod is not None and any(is_dask_array(p) for p in spec.score_mod.params):
        # (each block applies the score_mod to its chunk's scores: its table must be an
        # array of the chunks' library, NumPy or CuPy, not a Dask array)
        return (
            'implementation="dask" needs the score_mod\'s parameters as arrays of the '
            "chunks' library (e.g. NumPy), not Dask arrays"
        )
    return None


def is_dask_array(x: Any) -> bool:
    return type(x).__module__.startswith("dask.")


def _merge_task(level: int, group: list) -> tuple:
    return (_merge, *group)


def _row_totals(
    plan: _Plan,
    dsk: dict,
    blk_name: str,
    li: tuple[int, ...],
    hi: int,
    i: int,
    cols: list[int],
    state: Any,
) -> list:
    """One task per key block ``j`` in ``cols`` of query block ``i``: its exact share of
    each row's softmax total, given the row's merged ``state`` (or LSE); returns their
    keys. Rows a ``finfo.min`` float mask leaves without keys need these totals."""
    totals = []
    for j in cols:
        t_key = (blk_name + "-total", *li, hi, i, j)
        dsk[t_key] = (
            _row_total_block,
            plan.block(li, hi, i, j),
            plan.q_key(li, hi, i),
            plan.kv_key(plan.k, li, hi, j),
            plan.mask_key(li, hi, i, j),
            state,
            plan.len_key(plan.q_len, li),
            plan.len_key(plan.kv_len, li),
            plan.head_key(plan.alibi, li, hi),
        )
        totals.append(t_key)
    return totals


def _renormalise_forward(plan, dsk, blk_name, li, hi, i, root, leaves):
    """Tasks that correct the merge of query block ``i`` on huge-LSE rows (float masks)."""
    totals = _row_totals(plan, dsk, blk_name, li, hi, i, [leaf[-1] for leaf in leaves], root)
    key = (blk_name + "-fixed", *li, hi, i)
    dsk[key] = (_fix_state, len(leaves), root, *leaves, *totals)
    return key


# ---------------------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------------------
def _tree(
    dsk: dict,
    name: str,
    leaves: list,
    fan_in: int,
    make: Callable[[int, list], Any],
    until: int = 1,
) -> list:
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
    for li, hi in plan.grid():
        reach = plan.reach(li, hi)  # (a block mask leaves out the pairs it says are empty)
        for i in range(len(plan.row_chunks)):
            qk = plan.q_key(li, hi, i)
            leaves = []
            for j in reach[i]:
                key_ = (edge_name if plan.light(li, hi, i, j) else blk_name, *li, hi, i, j)
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
    from ..._backend import compute_dtype

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
    out_r, lse_r, do_r, dl_r = _row_arrays(plan, out, lse, d_out, d_lse)

    from dask.base import tokenize

    # The cotangents are part of the graph's identity: two pullbacks must not share keys.
    names_in = [None if a is None else a.name for a in (out_r, lse_r, do_r, dl_r)]
    token = tokenize(plan.token, names_in)
    blk_name = "attn-bwd-" + token
    dsk: dict = {}
    factors = _row_factors(plan, dsk, blk_name, lse_r.name)
    readers = _backward_blocks(plan, dsk, blk_name, (out_r, lse_r, do_r, dl_r), factors)
    names = _gradient_layers(plan, dsk, blk_name, readers, token)

    row_inputs = [a for a in (out_r, lse_r, do_r, dl_r) if a is not None]
    layers, deps = _collect(plan.inputs() + row_inputs)
    from dask.highlevelgraph import MaterializedLayer

    layers[blk_name] = MaterializedLayer(dsk)
    deps[blk_name] = {a.name for a in plan.inputs() + row_inputs}
    results: list[Array | None] = [None] * 4
    for n, g_name, g_dsk, x in names:
        g = _array(layers, deps, g_name, g_dsk, {blk_name, x.name}, x.chunks, x._meta, x.dtype)
        results[n] = g
    user: tuple[Array, ...] = (query, key, value, attn_mask)  # a gradient: its input exists
    for n in range(4):
        if results[n] is not None:
            results[n] = xp.reshape(results[n], tuple(user[n].shape))
    return results[0], results[1], results[2], results[3]


def _row_arrays(plan: _Plan, out: Array, lse: Array, d_out: Any, d_lse: Any) -> tuple:
    """The output, LSE and their cotangents (``None`` stays ``None``) in the plan's row
    chunks: ``(*lead, Hq, L[, Ev])`` cut like the output."""
    spec, xp, nd = plan.spec, plan.spec.xp, plan.nd
    rows = plan.lead_chunks + (plan.head_chunks, plan.row_chunks)
    full_rows = spec.lead + (spec.Hq, spec.L)

    def rows_of(x, width):
        if x is None:
            return None
        shape = full_rows + (() if width is None else (width,))
        x = xp.reshape(_pad(x, nd - (width is None)), shape)
        chunks = rows + (() if width is None else ((width,),))
        return x if tuple(x.chunks) == chunks else x.rechunk(chunks)

    return rows_of(out, spec.Ev), rows_of(lse, None), rows_of(d_out, spec.Ev), rows_of(d_lse, None)


def score_mod_param_grads(
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
) -> tuple[Array, ...]:
    """The gradients of a score_mod's parameters (a bias table) on Dask arrays, lazily:
    one task per scheduled block pair (the pairs the forward and backward run; a block
    mask's empty pairs have none) runs
    :func:`~arrayattn.attention.composed.score_mod_param_grads` on its chunks, with the
    block's origins, and a tree sums the parts in a fixed order (deterministic). Each
    gradient is a one-chunk Dask array shaped like its parameter."""
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    smod = spec.score_mod
    if smod is None or not smod.params:
        return ()
    plan = _plan(spec, query, key, value, attn_mask, "smod")
    row_arrays = _row_arrays(plan, out, lse, d_out, d_lse)
    out_r, lse_r, do_r, dl_r = row_arrays
    names_in = [None if a is None else a.name for a in row_arrays]
    token = tokenize(plan.token, names_in)
    name = "attn-smod-" + token
    dsk: dict = {}
    leaves = []
    if do_r is not None or dl_r is not None:
        for li, hi in plan.grid():
            reach = plan.reach(li, hi)
            for i in range(len(plan.row_chunks)):
                rk = (*li, hi, i)
                for j in reach[i]:
                    key_ = (name, *li, hi, i, j)
                    dsk[key_] = (
                        _score_mod_block,
                        plan.block(li, hi, i, j),
                        plan.q_key(li, hi, i),
                        plan.kv_key(plan.k, li, hi, j),
                        plan.kv_key(plan.v, li, hi, j),
                        plan.mask_key(li, hi, i, j),
                        (out_r.name, *rk, 0),
                        (lse_r.name, *rk),
                        None if do_r is None else (do_r.name, *rk, 0),
                        None if dl_r is None else (dl_r.name, *rk),
                        plan.len_key(plan.q_len, li),
                        plan.len_key(plan.kv_len, li),
                        plan.head_key(plan.alibi, li, hi),
                    )
                    leaves.append(key_)
    root = None
    if leaves:
        root = _tree(
            dsk, name + "-sum", leaves, SUM_FAN_IN, lambda level, group: (_sum_tuples, *group)
        )[0]
    inputs = plan.inputs() + [a for a in row_arrays if a is not None]
    layers, deps = _collect(inputs)
    layers[name] = MaterializedLayer(dsk)
    deps[name] = {a.name for a in inputs}
    results = []
    for n, prm in enumerate(smod.params):
        g_name = f"{name}-grad{n}"
        g_key = (g_name,) + (0,) * len(prm.shape)
        layers[g_name] = MaterializedLayer({g_key: (_param_grad, n, prm, root)})
        deps[g_name] = {name}
        graph = HighLevelGraph(dict(layers), dict(deps))
        chunks = tuple((int(d),) for d in prm.shape)
        results.append(da.Array(graph, g_name, chunks, meta=prm[(slice(0, 0),) * prm.ndim]))
    return tuple(results)


def _row_factors(plan: _Plan, dsk: dict, blk_name: str, lse_name: str) -> dict:
    """Float masks may carry huge biases whose rows the one-process backward renormalises
    over the whole row; with several key blocks, a first pass sums those totals. Returns
    the factor task of each row ``(*lead, head chunk, query block)`` that has one."""
    factors: dict = {}
    if plan.spec.mask_kind != "float" or len(plan.col_chunks) <= 1:
        return factors
    for li, hi in plan.grid():
        reach = plan.reach(li, hi)
        for i in range(len(plan.row_chunks)):
            rk = (*li, hi, i)
            totals = _row_totals(plan, dsk, blk_name, li, hi, i, reach[i], (lse_name, *rk))
            if totals:
                f_key = (blk_name + "-factor", *rk)
                dsk[f_key] = (_row_factor, (lse_name, *rk), *totals)
                factors[rk] = f_key
    return factors


def _backward_blocks(
    plan: _Plan, dsk: dict, blk_name: str, row_arrays: tuple, factors: dict
) -> dict:
    """One task per scheduled block pair (and each multi-block row's ``D`` task) into
    ``dsk``; ``row_arrays`` are the output, LSE, output cotangent and LSE cotangent in
    the rows' chunks (the cotangents may be ``None``). Returns, for each of the four
    inputs (query, key, value, mask), the block tasks that read each of its chunks."""
    out_r, lse_r, do_r, dl_r = row_arrays
    readers: dict[int, dict[tuple, list]] = {0: {}, 1: {}, 2: {}, 3: {}}
    for li, hi in plan.grid():
        reach = plan.reach(li, hi)
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
            out_arg: tuple[Any, ...] | None = (out_r.name, *rk, 0)
            delta = None
            if do_r is not None and len(reach[i]) > 1:
                # D = rowsum(dO * O) once per query block: its block tasks then need
                # neither the output chunk nor its transfer (they follow the rows' data
                # less, and each computed D again).
                delta = (blk_name + "-delta", *rk)
                dsk[delta] = (_row_delta, (out_r.name, *rk, 0), (do_r.name, *rk, 0))
                out_arg = None
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
                    out_arg,
                    (lse_r.name, *rk),
                    None if do_r is None else (do_r.name, *rk, 0),
                    None if dl_r is None else (dl_r.name, *rk),
                    plan.len_key(plan.q_len, li),
                    plan.len_key(plan.kv_len, li),
                    factors.get(rk),
                    plan.head_key(plan.alibi, li, hi),
                    delta,
                )
                for n, ik in enumerate(in_keys):
                    if ik is not None:
                        readers[n].setdefault(ik[1:], []).append(key_)
    return readers


def _gradient_layers(plan: _Plan, dsk: dict, blk_name: str, readers: dict, token: str) -> list:
    """For each input that gets a gradient (a mask only when it is a float bias): its
    gradient chunks, each the tree sum (fan-in :data:`SUM_FAN_IN`, inner nodes into
    ``dsk``) of the block tasks that read the input chunk, or zeros where none does.
    Returns ``(input index, gradient name, its chunks' tasks, the input)`` per input."""
    names = []
    for n, x in enumerate((plan.q, plan.k, plan.v, plan.mask)):
        if x is None or (n == 3 and plan.spec.mask_kind != "float"):
            continue
        g_name = f"attn-grad{n}-{token}"
        g_dsk = {}
        for idx in product(*[range(len(c)) for c in x.chunks]):
            parts = readers[n].get(idx, [])
            if not parts:
                # (keys built apart: mypy reads d[(a, *b)] as 3.11's d[a, *b])
                g_key = (g_name, *idx)
                g_dsk[g_key] = (_zeros_like, (x.name, *idx))
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
            g_key = (g_name, *idx)
            g_dsk[g_key] = (_sum_parts, replace(picks, dtype=x.dtype), *group)
        names.append((n, g_name, g_dsk, x))
    return names


def _register() -> None:
    import importlib.util

    if importlib.util.find_spec("dask") is None:  # no Dask arrays can reach this path
        return
    register_implementation("dask", sys.modules[__name__], declines=declines, auto_rank=1)


_register()
