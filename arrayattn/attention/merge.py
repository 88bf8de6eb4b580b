"""Exact merge of attention results computed over disjoint key sets.

If ``out_i, lse_i`` is attention of the same queries over key set ``K_i`` (and the
``K_i`` are disjoint), attention over their union is::

    lse = logsumexp_i lse_i
    out = sum_i exp(lse_i - lse) * out_i

This is the building block of split-KV decoding and of sequence/ring parallelism. Rows
empty in every part (all ``lse_i = -inf``) give ``out = 0`` and ``lse = -inf``, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._autodiff import Pullback, register_vjp
from .._backend import (
    Array,
    device_of,
    full_scalar,
    is_lazy,
    is_real_floating,
    known_shape,
    namespace_of,
    records_gradients,
)

__all__ = ["merge_attention_states"]


def _check(outs: Sequence[Array], lses: Sequence[Array]) -> tuple[Any, Any]:
    for name, seq in (("outs", outs), ("lses", lses)):
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a list or tuple of arrays, got {type(seq).__name__}")
    if len(outs) == 0:
        raise ValueError("outs must hold at least one attention result, got an empty list")
    if len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must have one entry per key set; got {len(outs)} outs and "
            f"{len(lses)} lses"
        )
    named = {f"outs[{i}]": o for i, o in enumerate(outs)}
    named.update({f"lses[{i}]": x for i, x in enumerate(lses)})
    xp = namespace_of(**named)
    shape = known_shape("outs[0]", outs[0])
    if len(shape) < 1:
        raise ValueError(f"outs[0] must have shape (..., L, Ev), got {shape}")
    for i, (o, x) in enumerate(zip(outs, lses, strict=True)):
        if not is_real_floating(xp, o.dtype) or o.dtype != outs[0].dtype:
            raise TypeError(
                f"outs[{i}] has dtype {o.dtype}; expected the real floating dtype of outs[0] "
                f"({outs[0].dtype})"
            )
        if not is_real_floating(xp, x.dtype) or x.dtype != lses[0].dtype:
            raise TypeError(
                f"lses[{i}] has dtype {x.dtype}; expected the real floating dtype of lses[0] "
                f"({lses[0].dtype})"
            )
        if known_shape(f"outs[{i}]", o) != shape:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)}, expected {shape} (outs[0])")
        if known_shape(f"lses[{i}]", x) != shape[:-1]:
            raise ValueError(
                f"lses[{i}] has shape {tuple(x.shape)}, expected {shape[:-1]} "
                "(the outs' shape without the feature axis)"
            )
    return xp, _merge_dtype(xp, lses[0], outs[0])


def _merge_dtype(xp: Any, *arrays: Array) -> Any:
    """The dtype weights and sums are computed in: float64 when any of ``arrays`` is."""
    return xp.float64 if any(x.dtype == xp.float64 for x in arrays) else xp.float32


def merged_lse(lses: Sequence[Array]) -> Array:
    """``logsumexp_i lse_i``: the LSE :func:`merge_attention_states` returns, from the
    LSEs alone (-inf on rows empty in every part). ``lses``: one ``(..., L)`` array per
    part; returns ``(..., L)`` in float32 (float64 when the LSEs are float64).

    Examples:
        >>> import numpy as np
        >>> merged_lse([np.array([0.0, -np.inf]), np.array([0.0, -np.inf])])
        array([0.69314718,       -inf])
    """
    xp = namespace_of(**{f"lses[{i}]": x for i, x in enumerate(lses)})
    return _weights(xp, _merge_dtype(xp, lses[0]), lses)[1]


def _weights(xp: Any, cd: Any, lses: Sequence[Array]) -> tuple[list[Array], Array]:
    """Weights ``a_i = exp(lse_i - lse)`` (0 on rows empty everywhere) and ``lse``."""
    dev = device_of(lses[0])
    zero = full_scalar(xp, 0.0, cd, dev)
    one = full_scalar(xp, 1.0, cd, dev)
    neg_inf = full_scalar(xp, -math.inf, cd, dev)
    ls = [xp.astype(x, cd) for x in lses]
    m = ls[0]
    for x in ls[1:]:
        m = xp.maximum(m, x)
    m_safe = xp.where(xp.isfinite(m), m, zero)
    e = [xp.exp(x - m_safe) for x in ls]
    total = e[0]
    for x in e[1:]:
        total = total + x
    nonempty = total > 0
    total_safe = xp.where(nonempty, total, one)
    lse = xp.where(nonempty, m_safe + xp.log(total_safe), neg_inf)
    return [x / total_safe for x in e], lse


def merge_attention_states(outs: Sequence[Array], lses: Sequence[Array]) -> tuple[Array, Array]:
    """Merge attention results over disjoint key sets into the result over their union.

    Args:
        outs: list of ``n >= 1`` outputs ``(..., L, Ev)`` of one dtype.
        lses: the matching LSEs ``(..., L)`` (as returned by
            ``scaled_dot_product_attention(..., return_lse=True)``), one float dtype.

    Returns:
        ``(out, lse)``: ``out = sum_i exp(lse_i - lse) * out_i`` in the outs' dtype,
        ``lse = logsumexp_i lse_i`` in float32 (float64 when the lses or outs are
        float64). Rows empty in every part give ``0`` and ``-inf``. The weights are
        computed in float32/float64 whatever the outs' dtype.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((1, 2, 4, 8)); k = rng.standard_normal((1, 2, 10, 8))
        >>> whole = aa.scaled_dot_product_attention(q, k, k)
        >>> a = aa.scaled_dot_product_attention(q, k[..., :3, :], k[..., :3, :], return_lse=True)
        >>> b = aa.scaled_dot_product_attention(q, k[..., 3:, :], k[..., 3:, :], return_lse=True)
        >>> out, lse = aa.merge_attention_states([a[0], b[0]], [a[1], b[1]])
        >>> bool(np.allclose(out, whole))
        True
    """
    xp, cd = _check(outs, lses)
    weights, lse = _weights(xp, cd, lses)
    out = _weighted_sum(xp, cd, weights, outs)
    return _as_dtype(xp, out, outs[0].dtype), lse


def _as_dtype(xp: Any, x: Array, dtype: Any) -> Array:
    """``x`` in ``dtype``, copied only when the dtype changes."""
    return x if x.dtype == dtype else xp.astype(x, dtype)


def _weighted_sum(xp: Any, cd: Any, weights: list[Array], outs: Sequence[Array]) -> Array:
    """``sum_i a_i * out_i`` in ``cd``, 0 wherever a part's weight is 0.

    Cost matters (the Dask path merges every query block's partial results with this): no
    copy of a part already in ``cd``; the zeroing ``where`` only where a weight is 0
    (libraries that may branch on values check, the others always apply it); the sum
    accumulated in place where the library allows it. Merging 4 parts of (1, 4, 2048, 64)
    float32 took 5.8 ms and now takes 2.6 ms in a plain process, and 2.3 and 0.7 ms under
    a Dask worker's allocator settings (NumPy, 2-core VM, 2026-11-23). The result is
    bit-identical: the ``where`` only turns the ``-0.0`` of a zero weight times a negative
    value into ``0.0``, and it is kept wherever a weight is 0.
    """
    eager = not is_lazy(xp)
    # ``out`` is always a fresh product of ours, so adding into it changes no input; not
    # under PyTorch autograd, which records the parts.
    in_place = eager and not records_gradients(*outs, *weights)
    out = None
    for a, o in zip(weights, outs, strict=True):
        a_col, x = a[..., None], _as_dtype(xp, o, cd)
        some_zero = not eager or bool(xp.any(a == 0))
        term = _times(xp, a_col, x) if some_zero else a_col * x
        if out is None:
            out = term
        elif in_place:
            out += term
        else:
            out = out + term
    return out


def _times(xp: Any, a: Array, x: Array) -> Array:
    """``a * x`` that is 0 where the weight ``a`` is 0: a part with no key (LSE ``-inf``)
    may carry garbage (an uninitialised split) that must not reach the merge, and
    ``0 * NaN`` is NaN."""
    zero = full_scalar(xp, 0.0, x.dtype, device_of(x))
    return xp.where(a == zero, zero, a * x)


@register_vjp(merge_attention_states)
def _merge_vjp(
    outs: Sequence[Array], lses: Sequence[Array]
) -> tuple[tuple[Array, Array], Pullback]:
    """With ``a_i = exp(lse_i - lse)``: ``d out_i = a_i dOut`` and
    ``d lse_i = a_i (dLse + rowsum(dOut * (out_i - out)))``."""
    xp, cd = _check(outs, lses)
    weights, lse = _weights(xp, cd, lses)
    out_c = _weighted_sum(xp, cd, weights, outs)
    out = _as_dtype(xp, out_c, outs[0].dtype)

    def pullback(cotangent: Any) -> tuple[list[Array], list[Array]]:
        if not isinstance(cotangent, (tuple, list)) or len(cotangent) != 2:
            raise TypeError(
                "cotangent must be a pair (d_out, d_lse) for merge_attention_states, got "
                f"{type(cotangent).__name__}"
            )
        d_out, d_lse = cotangent
        for name, x, shape in (("d_out", d_out, out.shape), ("d_lse", d_lse, lse.shape)):
            if x is not None and tuple(x.shape) != tuple(shape):
                raise ValueError(
                    f"cotangent {name} has shape {tuple(x.shape)}, expected {tuple(shape)}"
                )
        g = None if d_out is None else xp.astype(d_out, cd)
        gl = None if d_lse is None else xp.astype(d_lse, cd)
        d_outs, d_lses = [], []
        for a, o in zip(weights, outs, strict=True):
            if g is None:
                d_outs.append(xp.zeros(tuple(o.shape), dtype=o.dtype, device=device_of(o)))
                d_l = xp.zeros(tuple(a.shape), dtype=cd, device=device_of(o))
            else:
                d_outs.append(xp.astype(a[..., None] * g, o.dtype))
                d_l = _times(xp, a, xp.sum(g * (xp.astype(o, cd) - out_c), axis=-1))
            if gl is not None:
                d_l = d_l + a * gl
            d_lses.append(d_l)
        d_lses = [xp.astype(d, x.dtype) for d, x in zip(d_lses, lses, strict=True)]
        return d_outs, d_lses

    return (out, lse), pullback
