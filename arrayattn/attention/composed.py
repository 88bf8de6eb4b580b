"""The composed attention path: exact softmax over whole score rows, array-API operations only.

This is the reference implementation every other path (chunked, NumPy fast path, CuPy
kernel) is tested against, and the one that runs on any array-API library.
All arrays here are in the grouped layout of :class:`AttentionSpec`.

Query rows go in blocks (:func:`row_blocks`) that see only the keys their rows can
attend to, so causal and windowed calls skip what they would otherwise compute and
discard, and each block's scores stay small enough to reuse allocator memory. The query
heads of a GQA group are stacked as rows of one product per KV head
(:func:`group_matmul`): K and V are read once per group.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from .._backend import (
    Array,
    Namespace,
    exp_shifted,
    full_scalar,
    is_lazy,
    matmul_into,
    row_sums_by_product,
    rowwise_dot,
    sum_to_shape,
    to_floats,
    where_allowed,
)
from . import stacked
from .block_mask import key_runs, mod_allowed
from .cost import CostModel, Features, PathCost
from .dropout import dropout_keep
from .fits import require_memory
from .registry import register_implementation
from .spec import AttentionSpec
from .structure import structural_allowed

__all__ = [
    "forward",
    "backward",
    "COST",
    "AUTO_CHUNK_BYTES",
    "block_bytes",
    "check_memory",
    "masked_scores",
    "dropout_mask",
    "row_blocks",
    "alibi_bias",
    "merge_sinks",
    "sink_probability",
    "sinks_gradient",
    "reduce_sinks",
]


def stack_rows(xp: Namespace, x: Array) -> Array:
    """Grouped ``(..., A, G, l, X)`` -> ``(..., A, G*l, X)``: the query heads of one GQA
    group stacked as rows of one operand, so one product reads their shared K/V once
    (a free reshape of a contiguous array)."""
    shape = tuple(x.shape)
    return xp.reshape(x, shape[:-3] + (shape[-3] * shape[-2], shape[-1]))


def kv_rows(xp: Namespace, x: Array) -> Array:
    """Grouped key-side ``(..., Hk, 1, s, X)`` -> ``(..., Hk, s, X)``."""
    shape = tuple(x.shape)
    return xp.reshape(x, shape[:-3] + shape[-2:])


def group_matmul(xp: Namespace, rows_g: Array, right: Array, scratch: Array | None = None) -> Array:
    """``rows_g @ right`` for grouped rows ``(..., A, G, l, X)`` and a per-KV-head right
    operand ``(..., Hk, X, Y)``, as one product per KV head on the stacked
    ``(G*l, X)`` rows; returns grouped ``(..., H, G, l, Y)`` (in ``scratch``, a
    ``_backend.workspace``, when given)."""
    g, n = int(rows_g.shape[-3]), int(rows_g.shape[-2])
    out = matmul_into(xp, stack_rows(xp, rows_g), right, scratch)
    shape = tuple(out.shape)
    return xp.reshape(out, shape[:-2] + (g, n, shape[-1]))


def _with_group(x: Array, g: int) -> tuple[int, ...]:
    return tuple(x.shape[:-3]) + (g,) + tuple(x.shape[-2:])


def group_matmul_t(xp: Namespace, left_g: Array, right_g: Array) -> Array:
    """``sum_G left_g^T @ right_g`` over the group axis for grouped ``(..., A, G, l, s)``
    and ``(..., A, G, l, Y)``: one ``(s, G*l) @ (G*l, Y)`` product per KV head (the GQA
    sum of dK/dV is the product's own reduction); returns ``(..., H, 1, s, Y)``."""
    g = max(int(left_g.shape[-3]), int(right_g.shape[-3]))
    left_g, right_g = (
        x
        if int(x.shape[-3]) == g
        else xp.broadcast_to(x, tuple(x.shape[:-3]) + (g,) + tuple(x.shape[-2:]))
        for x in (left_g, right_g)
    )
    out = xp.matmul(xp.matrix_transpose(stack_rows(xp, left_g)), stack_rows(xp, right_g))
    return xp.expand_dims(out, axis=-3)


RENORMALISE_LSE_ERROR = 1e-4
"""Backward passes renormalise ``exp(S - LSE)`` on rows whose ``|LSE| * eps`` exceeds this:
there rounding swallowed ``log(rowsum)`` in the saved LSE (huge scores, or Hugging Face's
``finfo.min`` bias rows), so ``exp(S - LSE)`` no longer sums to 1. Every path uses this
rule (the composed path, having whole rows, renormalises every row: a no-op up to
rounding on the others)."""


def index_block(
    spec: AttentionSpec, row_start: int, row_stop: int, col_start: int, col_stop: int
) -> tuple[Array, Array]:
    xp = spec.xp
    rows = xp.reshape(
        xp.arange(row_start, row_stop, dtype=xp.int32, device=spec.device),
        (row_stop - row_start, 1),
    )
    cols = xp.arange(col_start, col_stop, dtype=xp.int32, device=spec.device)
    return rows, cols


def flex_indices(
    spec: AttentionSpec, rows: Array, cols: Array
) -> tuple[Array, Array, Array, Array]:
    """``(b, h, q_idx, kv_idx)`` for a mask_mod or score_mod on a block: the grouped
    layout's batch and head indices and the block's rows and keys, all global (a block of
    a larger call adds its origins)."""
    batch, head = spec.index_arrays()
    if spec.row0 or spec.col0:
        rows, cols = rows + spec.row0, cols + spec.col0
    return batch, head, rows, cols


def flex_runs(
    spec: AttentionSpec, r0: int, r1: int, c0: int, c1: int
) -> list[tuple[int, int, bool]]:
    """The keys of ``[c0, c1)`` that rows ``[r0, r1)`` visit, as ``(a, b, check_mod)``
    runs: all of them (tested when a mask_mod is given) without a block mask; with one,
    its non-empty key blocks, ``check_mod`` False on runs of full blocks
    (:func:`~arrayattn.attention.block_mask.key_runs`)."""
    if spec.mask_mod is None or c1 <= c0:
        return [(c0, c1, False)] if c1 > c0 else []
    bm = spec.block_mask
    if bm is None:
        return [(c0, c1, True)]
    batches = None if spec.batch_ids is None else list(spec.batch_ids)
    heads = slice(spec.head0, spec.head0 + spec.Hq)  # (a broadcast head axis ignores it)
    runs = key_runs(
        bm, batches, heads, r0 + spec.row0, r1 + spec.row0, c0 + spec.col0, c1 + spec.col0
    )
    return [(a - spec.col0, b - spec.col0, m) for a, b, m in runs]


def flex_tile(spec: AttentionSpec, r0: int, r1: int, c0: int, c1: int) -> tuple[bool, bool]:
    """``(visit, check_mod)`` for the block of rows ``[r0, r1)`` and keys ``[c0, c1)``:
    ``visit`` False when the block mask says it is empty (for every batch and head of
    the call), ``check_mod`` False when it is full (or without a mask_mod). A tile whose
    visited runs are all full but leave out empty keys is tested: the mask_mod excludes
    those keys (they are computed with the tile, which is not cut at its runs)."""
    if spec.mask_mod is None:
        return True, False
    runs = flex_runs(spec, r0, r1, c0, c1)
    if not runs:
        return False, False
    covered = sum(b - a for a, b, _ in runs) == c1 - c0
    return True, not covered or any(m for *_, m in runs)


def flex_parts(
    spec: AttentionSpec, r0: int, r1: int, c0: int, c1: int
) -> list[tuple[int, int, bool, bool]]:
    """``(p0, p1, check_structure, check_mod)``: the keys of ``[c0, c1)`` rows
    ``[r0, r1)`` visit, cut into the band's inside and edges (:func:`key_parts`) and the
    block mask's runs (:func:`flex_runs`)."""
    out = []
    for a, b, check_mod in flex_runs(spec, r0, r1, c0, c1):
        for p0, p1 in key_parts(spec, r0, r1, a, b):
            out.append((p0, p1, not inside_band(spec, r0, r1, p0, p1), check_mod))
    return out


def allowed_block(
    spec: AttentionSpec,
    mask_g: Array | None,
    rows: Array,
    cols: Array,
    check_structure: bool = True,
    check_mod: bool = True,
) -> Array | None:
    """The boolean "may attend" array for a block: structure (with per-sequence diagonals
    when lengths are given) AND per-sequence lengths AND a boolean user mask (already
    sliced to the block) AND the mask_mod, or ``None`` when nothing is masked.
    ``check_structure=False`` skips the causal/window test for blocks known to lie inside
    it, ``check_mod=False`` the mask_mod for blocks the block mask says are full."""
    xp = spec.xp
    allowed = None
    if check_structure:
        allowed = structural_allowed(xp, spec.structure, rows, cols, offset=spec.offset_g)
    mod_allowed_ = None
    if spec.mask_mod is not None and check_mod:
        mod_allowed_ = mod_allowed(spec.mask_mod, *flex_indices(spec, rows, cols))
    for extra in (
        None if spec.kv_len_g is None else cols < spec.kv_len_g,
        None if spec.q_len_g is None else rows < spec.q_len_g,
        mask_g if spec.mask_kind == "bool" else None,
        mod_allowed_,
    ):
        if extra is not None:
            allowed = extra if allowed is None else xp.logical_and(allowed, extra)
    return allowed


def scores_block(
    spec: AttentionSpec,
    qg: Array,
    kg: Array,
    mask_g: Array | None,
    rows: Array,
    cols: Array,
    check_structure: bool = True,
    q_scaled: bool = False,
    scratch: Array | None = None,
    check_mod: bool = True,
    need_chain: bool = True,
) -> tuple[Array, Array | None]:
    """Final masked scores ``(..., l, s)`` in the compute dtype for a block, and the
    derivative of the final scores with respect to the scaled scores where it is not 1
    (the softcap's ``1 - tanh^2`` times a score_mod's derivative; kept for the backward),
    or ``None``. With ``scratch`` (a ``_backend.workspace``) the scores may live in it:
    valid until its next use. ``need_chain=False`` (a forward) skips the derivative.

    ``qg``/``kg`` are in the compute dtype; ``mask_g`` is the user's mask for the block
    in the grouped layout (bool or float), ``rows``/``cols`` the block's int32 indices;
    ``check_structure=False`` for blocks that lie wholly inside the causal/window band;
    ``q_scaled=True`` when ``qg`` already carries the scale (an ``l x E`` product
    instead of an ``l x s`` one).
    """
    xp = spec.xp
    s = group_matmul(xp, qg, xp.matrix_transpose(kv_rows(xp, kg)), scratch)
    if spec.scale != 1.0 and not q_scaled:
        s = s * spec.scale
    chain = None
    if spec.softcap is not None:
        tanh = xp.tanh(s / spec.softcap)
        s = tanh * spec.softcap
        if need_chain:
            chain = 1.0 - tanh * tanh
    if spec.alibi_g is not None:
        s = s + alibi_bias(spec, rows, cols)
    if spec.score_mod is not None:
        idx = flex_indices(spec, rows, cols)
        d_mod = None
        if need_chain and spec.score_mod.differentiable:
            d_mod = spec.score_mod.grad(s, *idx)
        s = xp.astype(spec.score_mod(s, *idx), spec.cdtype, copy=False)
        if d_mod is not None:
            chain = d_mod if chain is None else chain * d_mod
    allowed = allowed_block(spec, mask_g, rows, cols, check_structure, check_mod)
    if spec.mask_kind == "float":
        bias = xp.astype(mask_g, spec.cdtype)
        s = s + bias
        # A -inf bias removes the key even when its score is garbage (NaN + -inf = NaN).
        kept = bias != full_scalar(xp, -float("inf"), spec.cdtype, spec.device)
        allowed = kept if allowed is None else xp.logical_and(allowed, kept)
    if allowed is not None:  # (s is this block's own: masked in place where possible)
        s = where_allowed(xp, s, allowed, full_scalar(xp, -float("inf"), spec.cdtype, spec.device))
        if chain is not None:  # the derivative at a garbage score must not reach dS
            chain = xp.where(allowed, chain, full_scalar(xp, 0.0, spec.cdtype, spec.device))
    return s, chain


def alibi_bias(spec: AttentionSpec, rows: Array, cols: Array) -> Array:
    """ALiBi bias ``-slope_h * |i + offset - j|`` of a block (FlashAttention's definition,
    measured from the aligned diagonal: ``offset`` is ``causal_align``'s, or each
    sequence's own with lengths), in the grouped layout and compute dtype. Built from the
    block's indices only: never an ``L x S`` array unless the block is the whole matrix."""
    xp = spec.xp
    diag = rows + (spec.structure.offset if spec.offset_g is None else spec.offset_g)
    dist = xp.astype(xp.abs(diag - cols), spec.cdtype)
    return -(spec.alibi_g * dist)


def finite_or_zero(spec: AttentionSpec, x: Array) -> Array:
    """``x`` with NaN/Inf entries replaced by 0 when the call may exclude keys or rows
    (``spec.may_mask``): the matmul operand wherever a zero weight (an excluded pair) meets
    an array that may hold garbage there, since ``0 * NaN`` is NaN. Entries that take
    part are dealt with by :func:`value_operands` / the NaN rows of the scores."""
    if not spec.may_mask:
        return x
    xp = spec.xp
    return xp.where(xp.isfinite(x), x, full_scalar(xp, 0.0, x.dtype, spec.device))


def value_operands(spec: AttentionSpec, vg: Array) -> tuple[Array, Array | None]:
    """The values for ``P @ V``: ``vg`` with non-finite entries zeroed, and a
    ``(..., S, 1)`` float indicator of the value rows that held any, or ``(vg, None)``
    when nothing can be excluded. ``P @ bad`` is then non-zero exactly on the rows that
    give a non-zero weight to such a row: :func:`poison_rows` makes those NaN, so garbage
    in excluded rows never reaches the output and garbage that takes part still shows."""
    vc, bad, _ = value_operands_and_range(spec, vg)
    return vc, bad


def value_operands_and_range(
    spec: AttentionSpec, vg: Array
) -> tuple[Array, Array | None, tuple[float, float] | None]:
    """:func:`value_operands`, and the ``(max, min)`` of the returned values when it
    had to read them (``None`` otherwise), for a caller that needs them too (the static
    shift's bound) and should not read V again."""
    if not spec.may_mask:
        return vg, None, None
    xp = spec.xp
    if not is_lazy(xp) and 0 not in tuple(vg.shape):
        v_range = value_range(xp, vg)
        if all(math.isfinite(e) for e in v_range):
            return vg, None, v_range  # (two reductions instead of a cleaned copy of V)
    finite = xp.isfinite(vg)
    clean = xp.where(finite, vg, full_scalar(xp, 0.0, vg.dtype, spec.device))
    bad = xp.astype(xp.logical_not(xp.all(finite, axis=-1, keepdims=True)), spec.cdtype)
    return clean, bad, None


def value_range(xp: Namespace, x: Array) -> tuple[float, float]:
    """``(max, min)`` of a non-empty array as Python floats, in one transfer and without
    an ``x``-sized temporary (NaN propagates through both: the array API standard's
    rule). Takes a Python decision on values: eager libraries only."""
    hi, lo = to_floats(xp.stack([xp.max(x), xp.min(x)]))
    return hi, lo


@dataclass(frozen=True)
class ValueColumns:
    """Where the extra columns of :func:`value_columns` sit in ``P @ [V | 1 | bad]``."""

    ev: int
    total: int | None  # column of the row sums, or None (computed apart)
    bad: int | None  # column of P @ bad, or None

    def split(self, acc: Array) -> tuple[Array, Array | None, Array | None]:
        """``(P @ V, row sums or None, P @ bad or None)`` from the extended product."""
        if self.total is None and self.bad is None:
            return acc, None, None
        out = acc[..., : self.ev]
        total = None if self.total is None else acc[..., self.total : self.total + 1]
        bad = None if self.bad is None else acc[..., self.bad : self.bad + 1]
        return out, total, bad


def value_columns(spec: AttentionSpec, vc: Array, bad: Array | None) -> tuple[Array, ValueColumns]:
    """Values extended by a column of ones (the row sums of ``P`` come out of the ``P V``
    product: a pass over the scores fewer) and the :func:`value_operands` indicator of
    non-finite value rows, so one product gives all three. The ones only without
    dropout (there the sums are of the undropped probabilities) and where
    :func:`~arrayattn._backend.row_sums_by_product` says the product is the cheaper way;
    otherwise ``total`` is ``None`` and callers sum ``P`` themselves."""
    xp = spec.xp
    cols = [vc]
    total = None
    if spec.dropout_p == 0 and row_sums_by_product(xp):
        total = spec.Ev
        cols.append(xp.ones(tuple(vc.shape[:-1]) + (1,), dtype=vc.dtype, device=spec.device))
    at_bad = None
    if bad is not None:
        at_bad = spec.Ev + len(cols) - 1
        cols.append(xp.broadcast_to(bad, tuple(vc.shape[:-1]) + (1,)))
    ext = cols[0] if len(cols) == 1 else xp.concat(cols, axis=-1)
    return ext, ValueColumns(spec.Ev, total, at_bad)


def poison_rows(spec: AttentionSpec, out: Array, touched: Array | None) -> Array:
    """``out`` with NaN on the rows whose ``touched`` (``P @ bad``, trailing axis 1) is
    non-zero: rows that attend to a non-finite value."""
    if touched is None:
        return out
    xp = spec.xp
    nan = full_scalar(xp, float("nan"), out.dtype, spec.device)
    return xp.where(touched != full_scalar(xp, 0.0, touched.dtype, spec.device), nan, out)


def dropout_block(spec: AttentionSpec, rows: Array, cols: Array) -> Array:
    """The keep-mask for a block in the grouped layout ``(*lead, Hq/G, G, l, s)``."""
    batch, head = spec.index_arrays()
    if spec.row0 or spec.col0:  # a block of a larger call: hash global positions
        rows, cols = rows + spec.row0, cols + spec.col0
    assert spec.seed is not None  # make_spec draws a seed whenever dropout_p > 0
    return dropout_keep(spec.xp, spec.seed, spec.dropout_p, batch, head, rows, cols)


def _prepare(
    spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
) -> tuple[Array, Array, Array, Array | None]:
    xp = spec.xp
    # copy=False: inputs already in the compute dtype are used as they are (never written).
    qg = xp.astype(spec.group_query(query), spec.cdtype, copy=False)
    kg = xp.astype(spec.group_kv(key, spec.k_shape), spec.cdtype, copy=False)
    vg = xp.astype(spec.group_kv(value, spec.v_shape), spec.cdtype, copy=False)
    mask_g = None
    if attn_mask is not None:
        assert spec.mask_shape is not None  # set with the mask
        mask_g = spec.group_rows(attn_mask, spec.mask_shape)
    return qg, kg, vg, mask_g


def masked_scores(
    spec: AttentionSpec, query: Array, key: Array, attn_mask: Array | None
) -> tuple[Array, Array | None, Array, Array]:
    """Whole masked score matrix (grouped layout), softcap tanh, and the grouped
    compute-dtype query and key it came from."""
    qg, kg, _, mask_g = _prepare(spec, query, key, key, attn_mask)
    rows, cols = index_block(spec, 0, spec.L, 0, spec.S)
    s, tanh = scores_block(spec, qg, kg, mask_g, rows, cols)
    return s, tanh, qg, kg


def softmax_with_lse(spec: AttentionSpec, s: Array) -> tuple[Array, Array]:
    """Row softmax of masked scores and its natural-log LSE (``-inf`` on empty rows,
    whose probabilities are all zero)."""
    xp = spec.xp
    neg_inf = full_scalar(xp, -float("inf"), spec.cdtype, spec.device)
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    one = full_scalar(xp, 1.0, spec.cdtype, spec.device)
    # No keys (S = 0): every row is empty and max has no identity. No queries (L = 0):
    # nothing to reduce, but Dask's blockwise max still fails on the empty blocks.
    if 0 in tuple(s.shape):
        shape = tuple(s.shape[:-1]) + (1,)
        if spec.sinks_g is None:
            lse = xp.full(shape, -float("inf"), dtype=spec.cdtype, device=spec.device)
        else:  # the sink alone: LSE = sink, no probabilities
            lse = spec.sinks_g + xp.zeros(shape, dtype=spec.cdtype, device=spec.device)
        return s, lse[..., 0]
    m = xp.max(s, axis=-1, keepdims=True)  # NaN when a score is NaN (max propagates it)
    if spec.sinks_g is not None:
        m = xp.maximum(m, spec.sinks_g)
    m = xp.where(xp.isfinite(m), m, zero)  # empty rows: exp(-inf - 0) = 0
    e = xp.exp(s - m)
    total = xp.sum(e, axis=-1, keepdims=True)
    if spec.sinks_g is not None:
        # gpt-oss: the sink joins the denominator as one more logit with no value.
        total = total + xp.exp(spec.sinks_g - m)
    # Empty means a total of exactly 0; a NaN total (a NaN score) keeps LSE NaN, not -inf.
    empty = total == zero
    total_safe = xp.where(empty, one, total)
    p = e / total_safe
    lse = xp.where(empty, neg_inf, m + xp.log(total_safe))
    return p, lse[..., 0]


def probabilities_from_lse(
    spec: AttentionSpec, s: Array, lse: Array, overwrite: bool = False
) -> Array:
    """``P = exp(S - LSE)`` with empty rows (LSE ``-inf``) giving zeros, not NaN, rows
    with a NaN/+inf LSE (non-finite scores) giving NaN where they take part, and
    excluded pairs (score ``-inf``) giving exactly 0 on every row.
    ``lse`` has a trailing axis of 1 that broadcasts over keys. ``overwrite=True`` lets
    ``P`` take ``s``'s memory (``s`` must be the caller's own temporary)."""
    xp = spec.xp
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    neg_inf = full_scalar(xp, -float("inf"), spec.cdtype, spec.device)
    # exp(-inf - NaN) is NaN: excluded pairs stay 0 on NaN rows too
    excluded = (s == neg_inf) if spec.may_mask else None
    shift = xp.where(lse == neg_inf, zero, lse)
    p = exp_shifted(xp, s, shift) if overwrite else xp.exp(s - shift)
    if excluded is not None:
        p = xp.where(excluded, zero, p)
    return p


def merge_sinks(spec: AttentionSpec, out: Array, lse: Array) -> tuple[Array, Array]:
    """Fold the sinks into a normalised output and its LSE (grouped layout, compute dtype,
    ``lse`` with a trailing axis of 1): ``LSE' = logaddexp(LSE, sink)`` and
    ``out' = out * exp(LSE - LSE')``. A row with no key (LSE ``-inf``) gets output 0 and
    ``LSE' = sink``. Identity without sinks."""
    if spec.sinks_g is None:
        return out, lse
    xp = spec.xp
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    neg_inf = full_scalar(xp, -float("inf"), spec.cdtype, spec.device)
    sink = spec.sinks_g
    m = xp.maximum(lse, sink)
    m = xp.where(xp.isfinite(m), m, zero)
    total = xp.exp(lse - m) + xp.exp(sink - m)
    empty = total == zero  # no key and a -inf sink; a NaN LSE stays NaN
    new = xp.where(
        empty,
        neg_inf,
        m + xp.log(xp.where(empty, full_scalar(xp, 1.0, spec.cdtype, spec.device), total)),
    )
    factor = xp.where(lse == neg_inf, zero, xp.exp(lse - xp.where(xp.isfinite(new), new, zero)))
    return out * factor, new


def sink_probability(spec: AttentionSpec, lse_g: Array) -> Array | None:
    """``p_sink = exp(sink - LSE)`` per row (grouped, trailing axis 1), 0 where the LSE is
    ``-inf`` (no sink, no key); ``None`` without sinks."""
    if spec.sinks_g is None:
        return None
    xp = spec.xp
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    finite = xp.isfinite(lse_g)
    return xp.where(finite, xp.exp(spec.sinks_g - xp.where(finite, lse_g, zero)), zero)


def sinks_gradient(
    spec: AttentionSpec, out: Array, lse: Array, d_out: Array | None, d_lse: Array | None
) -> Array | None:
    """Gradient of the sinks, in their own shape and dtype, from the row statistics of any
    implementation: ``d sink_h = sum_i p_sink_i * (dLSE_i - D_i)`` over the rows of head
    ``h`` (and the batch dims the sinks broadcast over), with ``D_i = dO_i . O_i`` and
    ``p_sink_i = exp(sink_h - LSE_i)``. (The sink has no value, so its column of ``dP`` is
    0 and ``dS_sink = p_sink * (0 - D)``; the LSE includes the sink, hence ``+ p_sink dLSE``.)
    ``None`` without sinks."""
    if spec.sinks is None:
        return None
    xp = spec.xp
    cd = spec.cdtype
    lse_g = xp.astype(_group_lse(spec, lse), cd)
    p_sink = sink_probability(spec, lse_g)
    do_g, delta, dl = backward_rows(spec, out, d_out, d_lse)
    coef = None
    if delta is not None:
        coef = -delta
    if dl is not None:
        coef = dl if coef is None else coef + dl
    if coef is None:
        return xp.zeros(tuple(spec.sinks.shape), dtype=spec.sinks.dtype, device=spec.device)
    return reduce_sinks(spec, p_sink * coef)


def reduce_sinks(spec: AttentionSpec, g: Array) -> Array:
    """Per-row sink gradients in the grouped layout ``(..., G, L, 1)`` -> summed over the
    rows (and over what the sinks broadcast over) into the sinks' shape and dtype."""
    xp = spec.xp
    full = spec.lead + (spec.Hq // spec.G, spec.G, spec.L, 1)
    g = xp.sum(spec.ungroup_rows(xp.broadcast_to(g, full)), axis=(-2, -1))  # (*lead, Hq)
    assert spec.sinks is not None  # only calls with sinks have their gradient
    shape = tuple(int(d) for d in spec.sinks.shape)
    padded = (1,) * (len(spec.lead) + 1 - len(shape)) + shape
    g = sum_to_shape(xp, g, padded)
    return xp.astype(xp.reshape(g, shape), spec.sinks.dtype)


def _group_lse(spec: AttentionSpec, x: Array) -> Array:
    """User-layout ``(*lead, Hq, L)`` row statistic -> grouped ``(..., G, L, 1)``."""
    shape = spec.lse_shape + (1,)
    return spec.group_rows(spec.xp.reshape(x, shape), shape)


def apply_dropout(spec: AttentionSpec, p: Array, rows: Array, cols: Array) -> Array:
    xp = spec.xp
    keep = dropout_block(spec, rows, cols)
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    return xp.where(keep, p * (1.0 / (1.0 - spec.dropout_p)), zero)


def dropout_mask(spec: AttentionSpec) -> Array:
    """The whole keep-mask in the user's layout ``(*lead, Hq, L, S)``."""
    rows, cols = index_block(spec, 0, spec.L, 0, spec.S)
    keep = dropout_block(spec, rows, cols)
    xp = spec.xp
    keep = xp.broadcast_to(keep, spec.lead + (spec.Hq // spec.G, spec.G, spec.L, spec.S))
    return spec.ungroup_rows(keep)


ROW_BLOCK_BYTES = 8 * 2**20
"""The composed path processes query rows in blocks whose score matrix (all batches and
heads, compute dtype) stays under this many bytes: fresh arrays of that size come from
the allocator's reused memory instead of new pages on every call (2-3x faster than
32 MiB blocks on PyTorch CPU tensors at B=1 H=8 L=2048 D=64, measured here), and each
block sees only the keys its rows can attend to."""
STRUCTURED_ROW_BLOCKS = 8
"""Causal/windowed calls use at least this many row blocks (of at least
:data:`MIN_BLOCK_ROWS` rows), so that the keys no row of a block sees are skipped, not
computed and masked: causal costs about ``(n + 1) / 2n`` of the full call."""
MIN_BLOCK_ROWS = 32


def mask_block(mask_g: Array | None, r0: int, r1: int, c0: int, c1: int) -> Array | None:
    """The user's grouped mask for a block; axes of size 1 (broadcast over L or S) stay."""
    if mask_g is None:
        return None
    if mask_g.shape[-2] != 1 and (r0, r1) != (0, mask_g.shape[-2]):
        mask_g = mask_g[..., r0:r1, :]
    if mask_g.shape[-1] != 1 and (c0, c1) != (0, mask_g.shape[-1]):
        mask_g = mask_g[..., c0:c1]
    return mask_g


def inside_band(spec: AttentionSpec, r0: int, r1: int, c0: int, c1: int) -> bool:
    """True when every row of ``[r0, r1)`` may see every key of ``[c0, c1)`` as far as
    causality and the window go (the block skips the structural mask test)."""
    st = spec.structure
    if st.is_trivial:
        return True
    if spec.offset_g is not None:  # per-sequence diagonals are data: always test
        return False
    # Row i sees [i + off - left, i + off + right]; the block is inside when the last row's
    # lower bound and the first row's upper bound enclose [c0, c1).
    low_ok = st.left < 0 or c0 >= r1 - 1 + st.offset - st.left
    high_ok = st.right < 0 or c1 - 1 <= r0 + st.offset + st.right
    return low_ok and high_ok


def key_parts(spec: AttentionSpec, r0: int, r1: int, c0: int, c1: int) -> list[tuple[int, int]]:
    """The keys ``[c0, c1)`` of rows ``[r0, r1)`` cut into the part every row sees
    (no mask test) and the band's edges before and after it (masked)."""
    st = spec.structure
    if st.is_trivial or spec.offset_g is not None:
        return [(c0, c1)]
    a = c0 if st.left < 0 else min(c1, max(c0, r1 - 1 + st.offset - st.left))
    b = c1 if st.right < 0 else max(a, min(c1, r0 + st.offset + st.right + 1))
    return [(x, y) for x, y in ((c0, a), (a, b), (b, c1)) if y > x]


def row_blocks(spec: AttentionSpec) -> list[tuple[int, int, int, int]]:
    """``(r0, r1, c0, c1)``: the query row blocks of the composed path and the key range
    each can see (``c0 == c1`` when none). One block for small calls; more when the
    score matrix exceeds :data:`ROW_BLOCK_BYTES`, and at least
    :data:`STRUCTURED_ROW_BLOCKS` for causal/windowed calls, whose blocks then skip the
    keys outside the band.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 1, 256, 8), np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, True, None, False, "top_left", None,
        ...                  None, None)
        >>> row_blocks(spec)[:2]
        [(0, 32, 0, 32), (32, 64, 0, 64)]
    """
    L, S = spec.L, spec.S
    if L == 0:  # nothing to compute (and dask cannot reduce a zero-size block)
        return [(0, 0, 0, 0)]
    per_row = spec.batch_size * spec.Hq * max(S, 1) * spec.itemsize
    n = max(1, -(-(L * per_row) // ROW_BLOCK_BYTES))
    if not spec.structure.is_trivial:
        n = max(n, min(STRUCTURED_ROW_BLOCKS, L // MIN_BLOCK_ROWS))
    n = min(n, L)
    size = -(-L // n)
    blocks = []
    for r0 in range(0, L, size):
        r1 = min(r0 + size, L)
        lo, hi = spec.structure.col_range(r0, r1, S, offset_bounds=spec.offset_bounds)
        lo = min(lo, S)
        blocks.append((r0, r1, lo, max(lo, hi)))
    return blocks


def _block_rows(spec: AttentionSpec, n: int) -> tuple[int, ...]:
    return spec.lead + (spec.Hq // spec.G, spec.G, n)


def _concat_rows(xp: Namespace, parts: list[Array]) -> Array:
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-2)


def check_memory(spec: AttentionSpec, backward: bool = False) -> None:
    """Raise ``MemoryError`` before allocating when the composed path's working set (its
    largest row block's scores and temporaries, the output, and for the backward the
    gradients) exceeds the memory free for the call's arrays
    (:func:`~arrayattn.attention.fits.require_memory`). A call whose full ``L x S``
    scores exceed memory still runs while one row block fits (the blocks bound it); a
    single query row over too many keys, or an output larger than memory, does not.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 1, 8, 4), np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None,
        ...                  None, None)
        >>> check_memory(spec)  # a few bytes: fits
    """
    heads = spec.batch_size * spec.Hq
    size = spec.itemsize
    block = block_bytes(spec)
    parts = {
        # the block's scores, exp'd in place, and a same-sized mask or dropout temporary;
        # the backward's probabilities, dP and dS besides
        "row-block temporaries": (4 if backward else 2) * block,
        # the blocks' outputs and their concatenation in the input dtype
        "output": 2 * heads * spec.L * spec.Ev * size,
    }
    if backward:
        parts["gradients"] = 2 * heads * (spec.L * spec.E + spec.S * (spec.E + spec.Ev)) * size
    big = parts["output"] + parts.get("gradients", 0)
    if big > block:
        advice = (
            "the output (and gradients) alone are that large: split the call over batch, "
            "heads or query rows, or pass Dask arrays (implementation='dask') to compute "
            "it chunk by chunk"
        )
    else:
        advice = (
            "implementation='chunked' (or 'fast' on NumPy) works in blocks of bounded "
            "size over the keys; or split the call over batch or heads"
        )
    require_memory(spec.xp, spec.device, parts, "implementation='composed'", advice)


def forward(
    spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
) -> tuple[Array, Array]:
    """Attention output (user layout, input dtype) and LSE (user layout, float32/64).

    Row block by row block (:func:`row_blocks`), each an exact softmax over the keys its
    rows can see; the normalisation goes on the ``l x Ev`` output, not the scores.
    Raises ``MemoryError`` before allocating when a row block or the output cannot fit
    (:func:`check_memory`)."""
    if spec.stack_kv:  # K/V broadcast over the batch: read once for all rows
        return stacked.forward(forward, spec, query, key, value, attn_mask)
    check_memory(spec)
    xp = spec.xp
    cd = spec.cdtype
    qg, kg, vg, mask_g = _prepare(spec, query, key, value, attn_mask)
    if spec.scale != 1.0:
        qg = qg * spec.scale  # l x E, not l x S
    zero = full_scalar(xp, 0.0, cd, spec.device)
    one = full_scalar(xp, 1.0, cd, spec.device)
    neg_inf = full_scalar(xp, -float("inf"), cd, spec.device)
    # Garbage (NaN/Inf) in values a pair excludes must not reach the output: cleaned
    # values, and rows that give weight to a non-finite value made NaN (poison_rows).
    vc, bad = value_operands(spec, vg)
    v_ext, cols_ext = value_columns(spec, vc, bad)
    outs, lses = [], []
    for r0, r1, c0, c1 in row_blocks(spec):
        rows_shape = _block_rows(spec, r1 - r0)
        # The block's keys in parts: the band's inside needs no mask test, only the
        # (narrow) edges do; a block mask's empty blocks are skipped, its full ones
        # need no mask_mod test.
        flex = flex_parts(spec, r0, r1, c0, c1)
        if not flex:  # no key for these rows (S = 0, outside every window, empty blocks)
            out, lse = merge_sinks(  # (a sink still gives them an LSE)
                spec,
                xp.zeros(rows_shape + (spec.Ev,), dtype=cd, device=spec.device),
                xp.full(rows_shape + (1,), -float("inf"), dtype=cd, device=spec.device),
            )
            outs.append(xp.broadcast_to(out, rows_shape + (spec.Ev,)))
            lses.append(xp.broadcast_to(lse, rows_shape + (1,)))
            continue
        q_b = qg if (r0, r1) == (0, spec.L) else qg[..., r0:r1, :]
        # One exact softmax over all parts (max first, then sums).
        parts = []
        for p0, p1, check_structure, check_mod in flex:
            rows, cols = index_block(spec, r0, r1, p0, p1)
            k_b = kg if (p0, p1) == (0, spec.S) else kg[..., p0:p1, :]
            s, _ = scores_block(
                spec,
                q_b,
                k_b,
                mask_block(mask_g, r0, r1, p0, p1),
                rows,
                cols,
                check_structure=check_structure,
                q_scaled=True,
                check_mod=check_mod,
                need_chain=False,
            )
            parts.append((p0, p1, rows, cols, s))
        m = None
        for *_, s in parts:
            m_p = xp.max(s, axis=-1, keepdims=True)
            m = m_p if m is None else xp.maximum(m, m_p)
        m = xp.where(xp.isfinite(m), m, zero)  # empty rows: exp(-inf - 0) = 0
        total = acc = None
        for p0, p1, rows, cols, s in parts:
            e = exp_shifted(xp, s, m)  # (s is this part's own: overwritten)
            if cols_ext.total is None:  # (with dropout: the sum of the undropped e)
                t = xp.sum(e, axis=-1, keepdims=True)
                total = t if total is None else total + t
            if spec.dropout_p > 0:
                e = apply_dropout(spec, e, rows, cols)
            v_b = v_ext if (p0, p1) == (0, spec.S) else v_ext[..., p0:p1, :]
            o = group_matmul(xp, e, kv_rows(xp, v_b))
            acc = o if acc is None else acc + o
        out, total_g, touched = cols_ext.split(acc)
        total = total_g if total is None else total
        # Empty means a total of exactly 0; a NaN total (a NaN score) keeps LSE NaN.
        empty = total == zero
        total_safe = xp.where(empty, one, total)
        out, lse = merge_sinks(  # gpt-oss sinks join each row's denominator (no value)
            spec,
            poison_rows(spec, out / total_safe, touched),
            xp.where(empty, neg_inf, m + xp.log(total_safe)),
        )
        outs.append(xp.broadcast_to(out, rows_shape + (spec.Ev,)))
        lses.append(xp.broadcast_to(lse, rows_shape + (1,)))
    out = spec.ungroup_out(xp.astype(_concat_rows(xp, outs), spec.dtype))
    return out, xp.reshape(_concat_rows(xp, lses), spec.lse_shape)


def reshape_lse(spec: AttentionSpec, lse: Array) -> Array:
    """Grouped ``(..., G, L)`` LSE -> the user's ``(..., Hq, L)``. The LSE does not depend
    on the values, so when only ``value`` carries batch or head dims it is broadcast to
    them first."""
    xp = spec.xp
    full = spec.lead + (spec.Hq // spec.G, spec.G, spec.L)
    if tuple(lse.shape) != full:
        lse = xp.broadcast_to(lse, full)
    return xp.reshape(lse, spec.lse_shape)


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
    """FlashAttention-2 backward from the saved LSE: ``P = exp(S - LSE)``,
    ``D = rowsum(dO * O)``, ``dS = P * (dP - D)`` (+ ``P * dLSE``), row block by row block
    over the keys each block sees (:func:`row_blocks`).

    Returns ``(d_query, d_key, d_value, d_mask)`` in the user's shapes and dtypes;
    ``d_mask`` is ``None`` unless the mask is a float bias. Raises ``MemoryError``
    before allocating when a row block or the gradients cannot fit (:func:`check_memory`).
    """
    if spec.stack_kv:  # K/V broadcast over the batch: dK/dV summed over the rows
        args = (query, key, value, attn_mask, out, lse, d_out, d_lse)
        return stacked.backward(backward, spec, *args)
    check_memory(spec, backward=True)
    xp = spec.xp
    cd = spec.cdtype
    dev = spec.device
    qg, kg, vg, mask_g = _prepare(spec, query, key, value, attn_mask)
    lse_g = xp.astype(_group_lse(spec, lse), cd)
    do_g, delta, dl = backward_rows(spec, out, d_out, d_lse)
    one = full_scalar(xp, 1.0, cd, dev)
    float_mask = spec.mask_kind == "float"
    dq_parts, ds_parts = [], []
    dk_acc = dv_acc = None
    # Operands cleaned of garbage that excluded pairs (zero weights) would turn into NaN.
    vc, _ = value_operands(spec, vg)
    qc, kc = finite_or_zero(spec, qg), finite_or_zero(spec, kg)

    def rows_of(x: Array | None, r0: int, r1: int) -> Array | None:
        return x if x is None or (r0, r1) == (0, spec.L) else x[..., r0:r1, :]

    def pad_keys(x: Array, c0: int, c1: int) -> Array:
        """A key-side block ``(..., c1 - c0, X)`` zero-padded to all ``S`` keys."""
        if (c0, c1) == (0, spec.S):
            return x
        shape = tuple(x.shape)
        parts = []
        if c0 > 0:
            parts.append(xp.zeros(shape[:-2] + (c0, shape[-1]), dtype=cd, device=dev))
        parts.append(x)
        if c1 < spec.S:
            parts.append(xp.zeros(shape[:-2] + (spec.S - c1, shape[-1]), dtype=cd, device=dev))
        return xp.concat(parts, axis=-2)

    for r0, r1, c0, c1 in row_blocks(spec):
        n = r1 - r0
        rows_shape = _block_rows(spec, n)
        if spec.block_mask is not None:  # from the first to the last non-empty key block
            runs = flex_runs(spec, r0, r1, c0, c1)
            c0, c1 = (runs[0][0], runs[-1][1]) if runs else (c0, c0)
        if c1 <= c0 or (do_g is None and dl is None):
            dq_parts.append(xp.zeros(rows_shape + (spec.E,), dtype=cd, device=dev))
            if float_mask:
                ds_parts.append(xp.zeros(rows_shape + (spec.S,), dtype=cd, device=dev))
            continue
        rows, cols = index_block(spec, r0, r1, c0, c1)
        q_b = rows_of(qg, r0, r1)
        k_b, v_b = (x if (c0, c1) == (0, spec.S) else x[..., c0:c1, :] for x in (kg, vg))
        s, tanh = scores_block(
            spec,
            q_b,
            k_b,
            mask_block(mask_g, r0, r1, c0, c1),
            rows,
            cols,
            check_structure=not inside_band(spec, r0, r1, c0, c1),
        )
        p = probabilities_from_lse(spec, s, rows_of(lse_g, r0, r1), overwrite=True)
        # A huge finite bias (Hugging Face's finfo.min masks) can absorb log(rowsum) into
        # the LSE (m + log S == m in floating point): exp(S - LSE) then sums to S, not 1.
        # A block holds all the keys its rows see, so renormalise (a no-op up to rounding
        # for ordinary rows); not in a block of a larger call (partial_keys), whose keys
        # are only part of each row.
        if not spec.partial_keys:
            total = xp.sum(p, axis=-1, keepdims=True)
            p_sink = sink_probability(spec, rows_of(lse_g, r0, r1))
            if p_sink is not None:  # the sink's share belongs to the row's total too
                total = total + p_sink
            p = p / xp.where(total > 0, total, one)
        do_b, delta_b, dl_b = (rows_of(x, r0, r1) for x in (do_g, delta, dl))
        vc_b = vc if (c0, c1) == (0, spec.S) else vc[..., c0:c1, :]
        ds, dv_b = backward_block(spec, p, vc_b, do_b, delta_b, dl_b, rows, cols)
        if float_mask:
            full = xp.broadcast_to(ds, rows_shape + (c1 - c0,))
            ds_parts.append(xp.matrix_transpose(pad_keys(xp.matrix_transpose(full), c0, c1)))
        qc_b = rows_of(qc, r0, r1)
        kc_b = kc if (c0, c1) == (0, spec.S) else kc[..., c0:c1, :]
        dq_b, dk_b = scores_grad_block(spec, qc_b, kc_b, ds, tanh)
        dq_parts.append(xp.broadcast_to(dq_b, rows_shape + (spec.E,)))
        dk_b = pad_keys(dk_b, c0, c1)
        dk_acc = dk_b if dk_acc is None else dk_acc + dk_b
        if dv_b is not None:
            dv_b = pad_keys(dv_b, c0, c1)
            dv_acc = dv_b if dv_acc is None else dv_acc + dv_b

    dq = _reduce_to(spec, spec.ungroup_rows(_concat_rows(xp, dq_parts)), spec.q_shape, spec.dtype)
    if dk_acc is None:
        dk = xp.zeros(spec.k_shape, dtype=spec.dtype, device=dev)
    else:
        dk = _reduce_kv(spec, dk_acc, spec.k_shape, spec.dtype)
    if dv_acc is None:
        dv = xp.zeros(spec.v_shape, dtype=spec.dtype, device=dev)
    else:
        dv = _reduce_kv(spec, dv_acc, spec.v_shape, spec.dtype)
    d_mask = None
    if float_mask:
        d_mask = _reduce_mask(spec, spec.ungroup_rows(_concat_rows(xp, ds_parts)), attn_mask)
    return dq, dk, dv, d_mask


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
    """Gradients of the score_mod's parameters (a bias table): ``dS`` of every block a
    row block visits (empty blocks skipped), recomputed from the saved LSE as in
    :func:`backward`, handed to the score_mod's ``param_grads`` and summed block after
    block in a fixed order (deterministic). One pass over the scores, the same on every
    implementation, so it runs once beside whichever backward ran."""
    smod = spec.score_mod
    xp = spec.xp
    if smod is None or not smod.params:
        return ()
    qg, kg, vg, mask_g = _prepare(spec, query, key, value, attn_mask)
    lse_g = xp.astype(_group_lse(spec, lse), spec.cdtype)
    do_g, delta, dl = backward_rows(spec, out, d_out, d_lse)
    vc, _ = value_operands(spec, vg)
    totals: list[Array | None] = [None] * len(smod.params)
    if do_g is not None or dl is not None:
        for r0, r1, c0, c1 in row_blocks(spec):
            q_b = qg[..., r0:r1, :]
            lse_b = lse_g[..., r0:r1, :]
            do_b, delta_b, dl_b = (
                None if x is None else x[..., r0:r1, :] for x in (do_g, delta, dl)
            )
            for p0, p1, check_structure, check_mod in flex_parts(spec, r0, r1, c0, c1):
                rows, cols = index_block(spec, r0, r1, p0, p1)
                s, _ = scores_block(
                    spec, q_b, kg[..., p0:p1, :], mask_block(mask_g, r0, r1, p0, p1), rows,
                    cols, check_structure=check_structure, check_mod=check_mod,
                    need_chain=False,
                )  # fmt: skip
                p = probabilities_from_lse(spec, s, lse_b, overwrite=True)
                ds, _ = backward_block(spec, p, vc[..., p0:p1, :], do_b, delta_b, dl_b, rows, cols)
                if ds is None:
                    continue
                grads = smod.param_grads(ds, *flex_indices(spec, rows, cols))
                totals = [g if t is None else t + g for t, g in zip(totals, grads, strict=True)]
    return tuple(
        xp.zeros(prm.shape, dtype=prm.dtype, device=prm.device) if t is None
        else xp.astype(t, prm.dtype, copy=False)
        for t, prm in zip(totals, smod.params, strict=True)
    )  # fmt: skip


def backward_rows(
    spec: AttentionSpec, out: Array, d_out: Array | None, d_lse: Array | None
) -> tuple[Array | None, Array | None, Array | None]:
    """Per-row inputs of the backward in the grouped layout and compute dtype:
    ``dO``, ``D = rowsum(dO * O)`` (trailing axis 1) and ``dLSE`` (trailing axis 1),
    each ``None`` when its cotangent is absent."""
    xp = spec.xp
    cd = spec.cdtype
    do_g = delta = dl = None
    if d_out is not None:
        do_g = xp.astype(spec.group_rows(d_out, spec.out_shape), cd, copy=False)
        o_g = xp.astype(spec.group_rows(out, spec.out_shape), cd, copy=False)
        delta = rowwise_dot(xp, do_g, o_g)[..., None]
    if d_lse is not None:
        dl = xp.astype(_group_lse(spec, d_lse), cd)
    return do_g, delta, dl


def backward_block(
    spec: AttentionSpec,
    p: Array,
    vg: Array,
    do_g: Array | None,
    delta: Array | None,
    dl: Array | None,
    rows: Array,
    cols: Array,
) -> tuple[Array | None, Array | None]:
    """Gradient of the final masked scores ``dS = P * (dP - D) + P * dLSE`` for one block
    and the block's grouped value gradient ``P_dropped^T dO``, from the probabilities
    ``p = exp(S - LSE)`` of the block (grouped layout, compute dtype). ``do_g``/``delta``/
    ``dl`` are the block's rows from :func:`backward_rows`; ``vg`` the block's values
    (from :func:`value_operands`). Either result is ``None`` when no cotangent feeds it.
    Pairs with ``p == 0`` (excluded) get ``dS = 0`` even where ``dP - D`` is NaN."""
    xp = spec.xp
    ds = None
    dv_g = None
    if do_g is not None:
        if spec.dropout_p > 0:
            keep = dropout_block(spec, rows, cols)
            inv_keep = 1.0 / (1.0 - spec.dropout_p)
            zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
            p_drop = xp.where(keep, p * inv_keep, zero)
        else:
            p_drop = p
        dv_g = group_matmul_t(xp, p_drop, do_g)
        dp = group_matmul(xp, do_g, xp.matrix_transpose(kv_rows(xp, vg)))
        if spec.dropout_p > 0:
            dp = xp.where(keep, dp * inv_keep, zero)
        # dS = P (dP - D) + P dLSE, with D - dLSE formed first (as the NumPy fast path and
        # the CUDA kernels do): a caller that moved D into dLSE (the Dask path's blocks,
        # which take D - dLSE through a zero output) gets the same result.
        ds = p * (dp - (delta if dl is None else delta - dl))
    elif dl is not None:
        ds = p * dl
    if ds is not None and spec.may_mask:
        zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
        ds = xp.where(p == zero, zero, ds)
    return ds, dv_g


def scores_grad_block(
    spec: AttentionSpec, qg: Array, kg: Array, ds: Array, chain: Array | None
) -> tuple[Array, Array]:
    """Grouped ``(dQ, dK)`` of a block from the gradient ``ds`` of its final masked
    scores: through the softcap and score_mod (``chain``, from :func:`scores_block`),
    then ``dS K`` and ``dS^T Q`` (one product per KV head on the group's stacked rows, so
    ``dK`` comes summed over the group: shape ``(..., Hk, 1, s, E)``), and the scale on
    those small results."""
    xp = spec.xp
    if chain is not None:
        ds = ds * chain
    dq = group_matmul(xp, ds, kv_rows(xp, kg))
    dk = group_matmul_t(xp, ds, qg)
    if spec.scale != 1.0:
        dq, dk = dq * spec.scale, dk * spec.scale
    return dq, dk


def scores_pullback(
    spec: AttentionSpec,
    qg: Array,
    kg: Array,
    ds: Array,
    tanh: Array | None,
    attn_mask: Array | None,
) -> tuple[Array, Array, Array | None]:
    """Gradients of (query, key, float mask) in the user's shapes from the gradient
    ``ds`` of the final masked scores (grouped layout, compute dtype)."""
    xp = spec.xp
    ds = xp.broadcast_to(ds, spec.lead + (spec.Hq // spec.G, spec.G, spec.L, spec.S))
    d_mask = None
    if spec.mask_kind == "float":
        d_mask = _reduce_mask(spec, spec.ungroup_rows(ds), attn_mask)
    dq_g, dk_g = scores_grad_block(spec, qg, kg, ds, tanh)
    dq = _reduce_to(spec, spec.ungroup_rows(dq_g), spec.q_shape, spec.dtype)
    dk = _reduce_kv(spec, dk_g, spec.k_shape, spec.dtype)
    return dq, dk, d_mask


def _padded(spec: AttentionSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    full = len(spec.lead) + 3
    return (1,) * (full - len(shape)) + tuple(shape)


def _reduce_to(spec: AttentionSpec, x: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    xp = spec.xp
    x = sum_to_shape(xp, x, _padded(spec, shape))
    return xp.astype(xp.reshape(x, shape), dtype)


def _reduce_mask(spec: AttentionSpec, ds: Array, attn_mask: Array | None) -> Array:
    """A float mask's gradient (``ds`` in the user's layout) in the mask's shape and dtype."""
    assert attn_mask is not None and spec.mask_shape is not None  # mask_kind == "float"
    return _reduce_to(spec, ds, spec.mask_shape, attn_mask.dtype)


def _reduce_kv(spec: AttentionSpec, x_g: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    """Grouped ``(*lead, Hq/G, G, S, D)`` key-side gradient -> the key's own shape,
    summing over each KV head's group of query heads (and over broadcast dims)."""
    xp = spec.xp
    x = xp.sum(x_g, axis=-3)
    return _reduce_to(spec, x, shape, dtype)


# -- its cost and its registration ----------------------------------------------------------
AUTO_CHUNK_BYTES = 256 * 2**20
"""``implementation="auto"`` never runs the composed path when one of its row blocks'
score matrices, ``batch * Hq * rows * keys * itemsize`` bytes in the compute dtype (4 for
float16/float32 inputs, 8 for float64), would exceed this many bytes (256 MiB): a
single query row over a very long key range, for example (the chunked path runs it)."""


def block_bytes(spec: AttentionSpec) -> int:
    """Bytes of the composed path's largest row-block score matrix (compute dtype)."""
    rows_keys = max(((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in row_blocks(spec)), default=0)
    return rows_keys * spec.batch_size * spec.Hq * spec.itemsize


def _features(spec: AttentionSpec, threads: int) -> Features:
    """One step per row block; two small products per block and KV head (the GQA group's
    rows stacked); every score of the blocks computed."""
    blocks = row_blocks(spec)
    heads = spec.batch_size * spec.Hq
    groups = spec.batch_size * (spec.Hq // spec.G)
    elements = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks) * heads
    return len(blocks), 2 * len(blocks) * groups, elements, elements * (spec.E + spec.Ev)


COST = CostModel(
    "composed",
    {
        # NumPy's batched matmul calls (multi-threaded) OpenBLAS once per small product:
        # ``mat`` is that call's cost (cost.py says where the constants come from).
        "numpy": PathCost(
            call=50e-6,
            step=50e-6,
            mat=4.0e-6,
            elem=8.0e-9,
            mac=0.03e-9,
            elem_threaded=False,
            skinny=0.09e-9,
        ),
        "array": PathCost(
            call=0.8e-3,
            step=110e-6,
            mat=0.05e-6,
            elem=1.5e-9,
            mac=0.06e-9,
            elem_threaded=True,
            skinny=0.15e-9,
        ),
    },
    _features,
)
"""The composed path's cost model (:class:`~arrayattn.attention.cost.CostModel`)."""


def _auto_declines(spec: AttentionSpec) -> str | None:
    if block_bytes(spec) > AUTO_CHUNK_BYTES:
        return f"a row block's scores would take {block_bytes(spec)} bytes"
    return None


AUTO_RANK = 100  # last: every other path that takes a call is tried first
register_implementation(
    "composed", sys.modules[__name__], auto_rank=AUTO_RANK, auto_declines=_auto_declines,
    cost=COST,
)  # fmt: skip
