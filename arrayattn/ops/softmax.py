"""Numerically safe softmax with its backward."""

from __future__ import annotations

from typing import Any

from .._autodiff import Pullback, register_vjp
from .._backend import (
    Array,
    compute_dtype,
    device_of,
    full_scalar,
    is_real_floating,
    namespace_of,
)

__all__ = ["softmax"]


def _check(x: Array, axis: int) -> Any:
    xp = namespace_of(x=x)
    if not is_real_floating(xp, x.dtype):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -x.ndim <= axis < max(x.ndim, 1):
        raise ValueError(f"axis must be an int in [-{x.ndim}, {x.ndim}), got {axis!r}")
    return xp


def _softmax(xp: Any, x: Array, axis: int) -> Array:
    cd = compute_dtype(xp, x.dtype)
    dev = device_of(x)
    xc = xp.astype(x, cd)
    if x.shape[axis] == 0:  # nothing to normalise (and max has no identity)
        return xc
    m = xp.max(xc, axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, full_scalar(xp, 0.0, cd, dev))
    e = xp.exp(xc - m)
    total = xp.sum(e, axis=axis, keepdims=True)
    total = xp.where(total > 0, total, full_scalar(xp, 1.0, cd, dev))
    return e / total


def softmax(x: Array, axis: int = -1) -> Array:
    """Softmax along ``axis``, computed in at least float32 with a running max, returned
    in ``x``'s dtype. A slice that is all ``-inf`` (nothing to attend) gives zeros, not
    NaN, as attention's empty rows do.

    Shapes: any ``x``; the result has ``x``'s shape.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.softmax(np.array([0.0, np.log(3.0)]))
        array([0.25, 0.75])
    """
    xp = _check(x, axis)
    return xp.astype(_softmax(xp, x, axis), x.dtype)


@register_vjp(softmax)
def _softmax_vjp(x: Array, axis: int = -1) -> tuple[Array, Pullback]:
    xp = _check(x, axis)
    y = _softmax(xp, x, axis)

    def pullback(dy: Array) -> tuple[Array]:
        if tuple(dy.shape) != tuple(x.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(x.shape)}")
        g = xp.astype(dy, y.dtype)
        # d softmax: y * (dy - <dy, y>) along the axis
        dx = y * (g - xp.sum(g * y, axis=axis, keepdims=True))
        return (xp.astype(dx, x.dtype),)

    return xp.astype(y, x.dtype), pullback
