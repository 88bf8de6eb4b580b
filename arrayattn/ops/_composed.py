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

__all__ = ["forward", "backward", "probabilities", "masked_scores", "dropout_mask"]


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
    spec: AttentionSpec, mask_g: Array | None, rows: Array, cols: Array
) -> Array | None:
    """The boolean "may attend" array for a block: structure AND a boolean user mask
    (already sliced to the block), or ``None`` when nothing is masked."""
    xp = spec.xp
    allowed = structural_allowed(xp, spec.structure, rows, cols)
    if spec.mask_kind == "bool":
        allowed = mask_g if allowed is None else xp.logical_and(allowed, mask_g)
    return allowed


def scores_block(
    spec: AttentionSpec,
    qg: Array,
    kg: Array,
    mask_g: Array | None,
    rows: Array,
    cols: Array,
) -> tuple[Array, Array | None]:
    """Final masked scores ``(..., l, s)`` in the compute dtype for a block, and the
    softcap ``tanh`` (kept for the backward) or ``None``.

    ``qg``/``kg`` are in the compute dtype; ``mask_g`` is the user's mask for the block
    in the grouped layout (bool or float), ``rows``/``cols`` the block's int32 indices.
    """
    xp = spec.xp
    s = xp.matmul(qg, xp.matrix_transpose(kg))
    if spec.scale != 1.0:
        s = s * spec.scale
    tanh = None
    if spec.softcap is not None:
        tanh = xp.tanh(s / spec.softcap)
        s = tanh * spec.softcap
    if spec.mask_kind == "float":
        s = s + xp.astype(mask_g, spec.cdtype)
    allowed = allowed_block(spec, mask_g, rows, cols)
    if allowed is not None:
        s = xp.where(allowed, s, full_scalar(xp, -float("inf"), spec.cdtype, spec.device))
    return s, tanh


def dropout_block(spec: AttentionSpec, rows: Array, cols: Array) -> Array:
    """The keep-mask for a block in the grouped layout ``(*lead, Hq/G, G, l, s)``."""
    batch, head = spec.index_arrays()
    return dropout_keep(spec.xp, spec.seed, spec.dropout_p, batch, head, rows, cols)


def _prepare(spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None):
    xp = spec.xp
    qg = xp.astype(spec.group_query(query), spec.cdtype)
    kg = xp.astype(spec.group_kv(key, spec.k_shape), spec.cdtype)
    vg = xp.astype(spec.group_kv(value, spec.v_shape), spec.cdtype)
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
    m = xp.max(s, axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, zero)  # empty rows: exp(-inf - 0) = 0
    e = xp.exp(s - m)
    total = xp.sum(e, axis=-1, keepdims=True)
    nonempty = total > 0
    total_safe = xp.where(nonempty, total, one)
    p = e / total_safe
    lse = xp.where(nonempty, m + xp.log(total_safe), neg_inf)
    return p, lse[..., 0]


def probabilities_from_lse(spec: AttentionSpec, s: Array, lse: Array) -> Array:
    """``P = exp(S - LSE)`` with empty rows (LSE ``-inf``) giving zeros, not NaN.
    ``lse`` has a trailing axis of 1 that broadcasts over keys."""
    xp = spec.xp
    zero = full_scalar(xp, 0.0, spec.cdtype, spec.device)
    return xp.exp(s - xp.where(xp.isfinite(lse), lse, zero))


def _group_lse(spec: AttentionSpec, x: Array) -> Array:
    """User-layout ``(*lead, Hq, L)`` row statistic -> grouped ``(..., G, L, 1)``."""
    shape = spec.lse_shape + (1,)
    return spec.group_rows(spec.xp.reshape(x, shape), shape)


def probabilities(spec: AttentionSpec, query: Array, key: Array, attn_mask: Array | None) -> Array:
    """Attention probabilities after dropout (grouped layout, compute dtype)."""
    s, _, _, _ = masked_scores(spec, query, key, attn_mask)
    p, _ = softmax_with_lse(spec, s)
    if spec.dropout_p > 0:
        p = apply_dropout(spec, p, *index_block(spec, 0, spec.L, 0, spec.S))
    return p


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
    out = xp.matmul(p, vg)
    out = spec.ungroup_out(xp.astype(out, spec.dtype))
    return out, xp.reshape(lse, spec.lse_shape)


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

    grouped_rows = spec.lead + (spec.Hq // spec.G, spec.G, spec.L)
    ds = None
    dv_g = None
    if d_out is not None:
        do_g = xp.astype(spec.group_rows(d_out, spec.out_shape), cd)
        o_g = xp.astype(spec.group_rows(out, spec.out_shape), cd)
        if spec.dropout_p > 0:
            keep = dropout_block(spec, rows, cols)
            inv_keep = 1.0 / (1.0 - spec.dropout_p)
            zero = full_scalar(xp, 0.0, cd, spec.device)
            p_drop = xp.where(keep, p * inv_keep, zero)
        else:
            p_drop = p
        dv_g = xp.matmul(xp.matrix_transpose(p_drop), do_g)
        dp = xp.matmul(do_g, xp.matrix_transpose(vg))
        if spec.dropout_p > 0:
            dp = xp.where(keep, dp * inv_keep, zero)
        delta = xp.sum(do_g * o_g, axis=-1, keepdims=True)
        ds = p * (dp - delta)
    if d_lse is not None:
        dl = xp.astype(_group_lse(spec, d_lse), cd)
        ds = p * dl if ds is None else ds + p * dl
    if ds is None:
        ds = xp.zeros(grouped_rows + (spec.S,), dtype=cd, device=spec.device)
    dq, dk, d_mask = scores_pullback(spec, qg, kg, ds, tanh, attn_mask)
    if dv_g is None:
        dv = xp.zeros(spec.v_shape, dtype=spec.dtype, device=spec.device)
    else:
        dv = _reduce_kv(spec, dv_g, spec.v_shape, spec.dtype)
    return dq, dk, dv, d_mask


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
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    if spec.scale != 1.0:
        ds = ds * spec.scale
    dq = _reduce_to(spec, spec.ungroup_rows(xp.matmul(ds, kg)), spec.q_shape, spec.dtype)
    dk = _reduce_kv(spec, xp.matmul(xp.matrix_transpose(ds), qg), spec.k_shape, spec.dtype)
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
