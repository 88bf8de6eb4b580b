"""RMSNorm and LayerNorm with hand-written backwards.

Both normalise over the trailing ``weight.ndim`` axes (the last axis when ``weight`` is
``None``), computing statistics in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .._autodiff import register_vjp
from .._backend import (
    Array,
    compute_dtype,
    is_real_floating,
    namespace_of,
    require_arrays,
    sum_to_shape,
)

__all__ = ["rms_norm", "layer_norm"]


def _check(x: Array, eps: float, **params: Array | None) -> tuple[Any, tuple[int, ...]]:
    require_arrays(x=x)
    xp = namespace_of(x=x, **params)
    if not is_real_floating(xp, x.dtype):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a finite number >= 0, got {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    nd = 1
    for p in params.values():
        if p is not None:
            nd = max(nd, p.ndim)
    if x.ndim < nd:
        raise ValueError(f"x of shape {tuple(x.shape)} has fewer dims than the normalised shape")
    normalized = tuple(int(d) for d in x.shape[x.ndim - nd :])
    for name, p in params.items():
        if p is None:
            continue
        if not is_real_floating(xp, p.dtype):
            raise TypeError(f"{name} must have a real floating dtype, got {p.dtype}")
        if tuple(int(d) for d in p.shape) != normalized[nd - p.ndim :] or p.ndim != nd:
            raise ValueError(
                f"{name} has shape {tuple(p.shape)}, expected the normalised shape "
                f"{normalized} (x's trailing dims; x shape {tuple(x.shape)})"
            )
    return xp, tuple(range(-nd, 0))


def _check_cotangent(dy: Array, shape: tuple[int, ...]) -> None:
    if tuple(dy.shape) != tuple(shape):
        raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(shape)}")


def _rms_forward(xp, x, weight, eps, axes, cast_before_weight):
    cd = compute_dtype(xp, x.dtype)
    xf = xp.astype(x, cd, copy=False)  # (never written: no copy in the compute dtype)
    rstd = 1.0 / xp.sqrt(xp.mean(xf * xf, axis=axes, keepdims=True) + eps)
    normed = xf * rstd
    if weight is None:
        y = xp.astype(normed, x.dtype)
    elif cast_before_weight:
        y = xp.astype(normed, x.dtype, copy=False) * weight
    else:
        y = xp.astype(normed * xp.astype(weight, cd), xp.result_type(x.dtype, weight.dtype))
    return y, normed, rstd


def rms_norm(
    x: Array, weight: Array | None, eps: float = 1e-6, *, cast_before_weight: bool = True
) -> Array:
    """RMSNorm: ``x / sqrt(mean(x**2) + eps) * weight``.

    Shapes: ``x`` ``(..., D)``, ``weight`` ``(D,)`` or ``None`` -> ``x``'s shape (a
    ``weight`` with more dims normalises over that many trailing axes).

    The statistics run in float32 (float64 for float64 input). LLaMA's order is the
    default: normalise, cast back to ``x.dtype``, then multiply by ``weight``
    (``cast_before_weight=True``); ``False`` multiplies in float32 and casts last (T5,
    Gemma). The result dtype is the promotion of ``x`` and ``weight``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> y = aa.rms_norm(np.array([[3.0, 4.0]]), np.ones(2))
        >>> np.round(y, 4)
        array([[0.8485, 1.1314]])
    """
    xp, axes = _check(x, eps, weight=weight)
    return _rms_forward(xp, x, weight, eps, axes, cast_before_weight)[0]


@register_vjp(rms_norm)
def _rms_norm_vjp(x, weight, eps=1e-6, *, cast_before_weight=True):
    xp, axes = _check(x, eps, weight=weight)
    y, normed, rstd = _rms_forward(xp, x, weight, eps, axes, cast_before_weight)
    cd = normed.dtype

    def pullback(dy: Array) -> tuple[Array, Array | None, None]:
        _check_cotangent(dy, tuple(y.shape))
        g = xp.astype(dy, cd)
        dweight = None
        if weight is not None:
            dweight = xp.astype(sum_to_shape(xp, g * normed, tuple(weight.shape)), weight.dtype)
            g = g * xp.astype(weight, cd)
        dx = rstd * (g - normed * xp.mean(g * normed, axis=axes, keepdims=True))
        return xp.astype(dx, x.dtype), dweight, None

    return y, pullback


def _ln_forward(xp, x, weight, bias, eps, axes):
    cd = compute_dtype(xp, x.dtype)
    xf = xp.astype(x, cd)
    mean = xp.mean(xf, axis=axes, keepdims=True)
    centered = xf - mean
    rstd = 1.0 / xp.sqrt(xp.mean(centered * centered, axis=axes, keepdims=True) + eps)
    xhat = centered * rstd
    y = xhat
    if weight is not None:
        y = y * xp.astype(weight, cd)
    if bias is not None:
        y = y + xp.astype(bias, cd)
    return xp.astype(y, x.dtype), xhat, rstd


def layer_norm(x: Array, weight: Array | None, bias: Array | None, eps: float = 1e-5) -> Array:
    """LayerNorm over the last axis (or ``weight.ndim`` trailing axes), biased variance
    as PyTorch: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Shapes: ``x`` ``(..., D)``, ``weight``/``bias`` ``(D,)`` or ``None`` -> ``x``'s shape
    and dtype (statistics and affine in float32, or float64).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.layer_norm(np.array([[1.0, 3.0]]), np.ones(2), np.zeros(2), eps=0.0)
        array([[-1.,  1.]])
    """
    xp, axes = _check(x, eps, weight=weight, bias=bias)
    return _ln_forward(xp, x, weight, bias, eps, axes)[0]


@register_vjp(layer_norm)
def _layer_norm_vjp(x, weight, bias, eps=1e-5):
    xp, axes = _check(x, eps, weight=weight, bias=bias)
    y, xhat, rstd = _ln_forward(xp, x, weight, bias, eps, axes)
    cd = xhat.dtype

    def pullback(dy: Array) -> tuple[Array, Array | None, Array | None, None]:
        _check_cotangent(dy, tuple(y.shape))
        g = xp.astype(dy, cd)
        dbias = (
            None if bias is None else xp.astype(sum_to_shape(xp, g, tuple(bias.shape)), bias.dtype)
        )
        dweight = None
        if weight is not None:
            dweight = xp.astype(sum_to_shape(xp, g * xhat, tuple(weight.shape)), weight.dtype)
            g = g * xp.astype(weight, cd)
        dx = rstd * (
            g
            - xp.mean(g, axis=axes, keepdims=True)
            - xhat * xp.mean(g * xhat, axis=axes, keepdims=True)
        )
        return xp.astype(dx, x.dtype), dweight, dbias, None

    return y, pullback
