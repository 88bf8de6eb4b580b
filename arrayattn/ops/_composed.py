"""The composed attention path: whole ``L x S`` score matrices, array-API operations only.

This is the reference implementation every other path (chunked, NumPy fast path, CuPy
kernel) is tested against, and the one that runs on any array-API library.
All arrays here are in the grouped layout of :class:`AttentionSpec`.
"""

from __future__ import annotations

from .._backend import Array, full_scalar, sum_to_shape
from ._attention_spec import AttentionSpec
from .dropout import dropout_keep
from .masks import structural_allowed

__all__ = [
    "forward",
    "backward",
    "masked_scores",
    "dropout_mask",
    "alibi_bias",
    "merge_sinks",
    "sink_probability",
    "sinks_gradient",
    "reduce_sinks",
]

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


def allowed_block(
    spec: AttentionSpec,
    mask_g: Array | None,
    rows: Array,
    cols: Array,
    check_structure: bool = True,
) -> Array | None:
    """The boolean "may attend" array for a block: structure (with per-sequence diagonals
    when lengths are given) AND per-sequence lengths AND a boolean user mask (already
    sliced to the block), or ``None`` when nothing is masked. ``check_structure=False``
    skips the causal/window test for blocks known to lie inside it."""
    xp = spec.xp
    allowed = None
    if check_structure:
        allowed = structural_allowed(xp, spec.structure, rows, cols, offset=spec.offset_g)
    for extra in (
        None if spec.kv_len_g is None else cols < spec.kv_len_g,
        None if spec.q_len_g is None else rows < spec.q_len_g,
        mask_g if spec.mask_kind == "bool" else None,
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
) -> tuple[Array, Array | None]:
    """Final masked scores ``(..., l, s)`` in the compute dtype for a block, and the
    softcap ``tanh`` (kept for the backward) or ``None``.

    ``qg``/``kg`` are in the compute dtype; ``mask_g`` is the user's mask for the block
    in the grouped layout (bool or float), ``rows``/``cols`` the block's int32 indices;
    ``check_structure=False`` for blocks that lie wholly inside the causal/window band.
    """
    xp = spec.xp
    s = xp.matmul(qg, xp.matrix_transpose(kg))
    if spec.scale != 1.0:
        s = s * spec.scale
    tanh = None
    if spec.softcap is not None:
        tanh = xp.tanh(s / spec.softcap)
        s = tanh * spec.softcap
    if spec.alibi_g is not None:
        s = s + alibi_bias(spec, rows, cols)
    allowed = allowed_block(spec, mask_g, rows, cols, check_structure)
    if spec.mask_kind == "float":
        bias = xp.astype(mask_g, spec.cdtype)
        s = s + bias
        # A -inf bias removes the key even when its score is garbage (NaN + -inf = NaN).
        kept = bias != full_scalar(xp, -float("inf"), spec.cdtype, spec.device)
        allowed = kept if allowed is None else xp.logical_and(allowed, kept)
    if allowed is not None:
        s = xp.where(allowed, s, full_scalar(xp, -float("inf"), spec.cdtype, spec.device))
        if tanh is not None:  # tanh of a garbage score must not reach the chain rule
            tanh = xp.where(allowed, tanh, full_scalar(xp, 0.0, spec.cdtype, spec.device))
    return s, tanh


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
    if not spec.may_mask:
        return vg, None
    xp = spec.xp
    finite = xp.isfinite(vg)
    clean = xp.where(finite, vg, full_scalar(xp, 0.0, vg.dtype, spec.device))
    bad = xp.astype(xp.logical_not(xp.all(finite, axis=-1, keepdims=True)), spec.cdtype)
    return clean, bad


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
    return dropout_keep(spec.xp, spec.seed, spec.dropout_p, batch, head, rows, cols)


def _prepare(spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None):
    xp = spec.xp
    # copy=False: inputs already in the compute dtype are used as they are (never written).
    qg = xp.astype(spec.group_query(query), spec.cdtype, copy=False)
    kg = xp.astype(spec.group_kv(key, spec.k_shape), spec.cdtype, copy=False)
    vg = xp.astype(spec.group_kv(value, spec.v_shape), spec.cdtype, copy=False)
    mask_g = None if attn_mask is None else spec.group_rows(attn_mask, spec.mask_shape)
    return qg, kg, vg, mask_g


def masked_scores(spec: AttentionSpec, query: Array, key: Array, attn_mask: Array | None):
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


def probabilities_from_lse(spec: AttentionSpec, s: Array, lse: Array) -> Array:
    """``P = exp(S - LSE)`` with empty rows (LSE ``-inf``) giving zeros, not NaN, rows
    with a NaN/+inf LSE (non-finite scores) giving NaN where they take part, and
    excluded pairs (score ``-inf``) giving exactly 0 on every row.
    ``lse`` has a trailing axis of 1 that broadcasts over keys."""
    xp = spec.xp
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    neg_inf = full_scalar(xp, -float("inf"), spec.cdtype, spec.device)
    p = xp.exp(s - xp.where(lse == neg_inf, zero, lse))
    if spec.may_mask:  # exp(-inf - NaN) is NaN: excluded pairs stay 0 on NaN rows too
        p = xp.where(s == neg_inf, zero, p)
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


def forward(
    spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
) -> tuple[Array, Array]:
    """Attention output (user layout, input dtype) and LSE (user layout, float32/64)."""
    xp = spec.xp
    qg, kg, vg, mask_g = _prepare(spec, query, key, value, attn_mask)
    rows, cols = index_block(spec, 0, spec.L, 0, spec.S)
    s, _ = scores_block(spec, qg, kg, mask_g, rows, cols)
    p, lse = softmax_with_lse(spec, s)
    if spec.dropout_p > 0:
        p = apply_dropout(spec, p, rows, cols)
    vc, bad = value_operands(spec, vg)
    out = xp.matmul(p, vc)
    out = poison_rows(spec, out, None if bad is None else xp.matmul(p, bad))
    out = spec.ungroup_out(xp.astype(out, spec.dtype))
    return out, reshape_lse(spec, lse)


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
    ``D = rowsum(dO * O)``, ``dS = P * (dP - D)`` (+ ``P * dLSE``).

    Returns ``(d_query, d_key, d_value, d_mask)`` in the user's shapes and dtypes;
    ``d_mask`` is ``None`` unless the mask is a float bias.
    """
    xp = spec.xp
    cd = spec.cdtype
    qg, kg, vg, mask_g = _prepare(spec, query, key, value, attn_mask)
    rows, cols = index_block(spec, 0, spec.L, 0, spec.S)
    s, tanh = scores_block(spec, qg, kg, mask_g, rows, cols)
    p = probabilities_from_lse(spec, s, xp.astype(_group_lse(spec, lse), cd))
    # A huge finite bias (Hugging Face's finfo.min masks) can absorb log(rowsum) into the
    # LSE (m + log S == m in floating point): exp(S - LSE) then sums to S, not 1. The whole
    # row is at hand here, so renormalise (a no-op up to rounding for ordinary rows).
    total = xp.sum(p, axis=-1, keepdims=True)
    p_sink = sink_probability(spec, xp.astype(_group_lse(spec, lse), cd))
    if p_sink is not None:  # the sink's share belongs to the row's total too
        total = total + p_sink
    nonempty = total > 0
    p = p / xp.where(nonempty, total, full_scalar(xp, 1.0, cd, spec.device))

    grouped_rows = spec.lead + (spec.Hq // spec.G, spec.G, spec.L)
    do_g, delta, dl = backward_rows(spec, out, d_out, d_lse)
    vc, _ = value_operands(spec, vg)
    ds, dv_g = backward_block(spec, p, vc, do_g, delta, dl, rows, cols)
    if ds is None:
        ds = xp.zeros(grouped_rows + (spec.S,), dtype=cd, device=spec.device)
    qc, kc = finite_or_zero(spec, qg), finite_or_zero(spec, kg)
    dq, dk, d_mask = scores_pullback(spec, qc, kc, ds, tanh, attn_mask)
    if dv_g is None:
        dv = xp.zeros(spec.v_shape, dtype=spec.dtype, device=spec.device)
    else:
        dv = _reduce_kv(spec, dv_g, spec.v_shape, spec.dtype)
    return dq, dk, dv, d_mask


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
        delta = xp.sum(do_g * o_g, axis=-1, keepdims=True)
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
        dv_g = xp.matmul(xp.matrix_transpose(p_drop), do_g)
        dp = xp.matmul(do_g, xp.matrix_transpose(vg))
        if spec.dropout_p > 0:
            dp = xp.where(keep, dp * inv_keep, zero)
        ds = p * (dp - delta)
    if dl is not None:
        ds = p * dl if ds is None else ds + p * dl
    if ds is not None and spec.may_mask:
        zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
        ds = xp.where(p == zero, zero, ds)
    return ds, dv_g


def scores_grad_block(
    spec: AttentionSpec, qg: Array, kg: Array, ds: Array, tanh: Array | None
) -> tuple[Array, Array]:
    """Grouped, unreduced ``(dQ, dK)`` of a block from the gradient ``ds`` of its final
    masked scores: through the softcap (``1 - tanh^2``) and the scale, then
    ``dS K`` and ``dS^T Q``."""
    xp = spec.xp
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    if spec.scale != 1.0:
        ds = ds * spec.scale
    return xp.matmul(ds, kg), xp.matmul(xp.matrix_transpose(ds), qg)


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
        d_mask = _reduce_to(spec, spec.ungroup_rows(ds), spec.mask_shape, attn_mask.dtype)
    dq_g, dk_g = scores_grad_block(spec, qg, kg, ds, tanh)
    dq = _reduce_to(spec, spec.ungroup_rows(dq_g), spec.q_shape, spec.dtype)
    dk = _reduce_kv(spec, dk_g, spec.k_shape, spec.dtype)
    return dq, dk, d_mask


def _padded(spec: AttentionSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    full = len(spec.lead) + 3
    return (1,) * (full - len(shape)) + tuple(shape)


def _reduce_to(spec: AttentionSpec, x: Array, shape: tuple[int, ...], dtype) -> Array:
    xp = spec.xp
    x = sum_to_shape(xp, x, _padded(spec, shape))
    return xp.astype(xp.reshape(x, shape), dtype)


def _reduce_kv(spec: AttentionSpec, x_g: Array, shape: tuple[int, ...], dtype) -> Array:
    """Grouped ``(*lead, Hq/G, G, S, D)`` key-side gradient -> the key's own shape,
    summing over each KV head's group of query heads (and over broadcast dims)."""
    xp = spec.xp
    x = xp.sum(x_g, axis=-3)
    return _reduce_to(spec, x, shape, dtype)
