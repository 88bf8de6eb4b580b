"""Activations used by transformer MLPs (GELU, SiLU), with backwards.

The array API standard has no ``erf``; :func:`erf` builds one from standard operations
(a float32 rational approximation for float16/float32, a series and continued fraction
accurate to about 1e-13 for float64), which is what exact (``"none"``) GELU needs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._autodiff import Pullback, register_vjp
from .._backend import Array, compute_dtype, device_of, full_scalar, is_real_floating, namespace_of

__all__ = ["erf", "gelu", "silu"]

GELU_APPROXIMATIONS = ("none", "tanh")

# Odd numerator / even denominator monomial coefficients (highest power first) of the
# rational float32 erf approximation used by Eigen and XLA on [-4, 4].
_ERF_NUM = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_DEN = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
_SERIES_TERMS = 80  # Taylor series of erf on |x| < 3 (terms peak near n = 9)
_FRACTION_DEPTH = 60  # continued fraction of erfc on |x| >= 3


def _check(x: Array) -> Any:
    xp = namespace_of(x=x)
    if not is_real_floating(xp, x.dtype):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    return xp


def _erf32(xp: Any, x: Array) -> Array:
    dev = device_of(x)
    x = xp.clip(x, -4.0, 4.0)
    x2 = x * x
    num = full_scalar(xp, _ERF_NUM[0], x.dtype, dev)
    for c in _ERF_NUM[1:]:
        num = num * x2 + c
    den = full_scalar(xp, _ERF_DEN[0], x.dtype, dev)
    for c in _ERF_DEN[1:]:
        den = den * x2 + c
    return x * num / den


def _erf64(xp: Any, x: Array) -> Array:
    ax = xp.abs(x)
    s = xp.clip(ax, 0.0, 3.0)
    s2 = s * s
    term, series = s, s
    for n in range(1, _SERIES_TERMS):
        term = term * (-s2) / n
        series = series + term / (2 * n + 1)
    series = series * (2.0 / math.sqrt(math.pi))
    # erfc(t) = exp(-t^2) / sqrt(pi) / (t + (1/2) / (t + 1 / (t + (3/2) / (t + ...))))
    t = xp.clip(ax, 3.0, None)
    f = t
    for k in range(_FRACTION_DEPTH, 0, -1):
        f = t + (k / 2.0) / f
    fraction = 1.0 - xp.exp(-t * t) / (math.sqrt(math.pi) * f)
    return xp.sign(x) * xp.where(ax < 3.0, series, fraction)


def erf(x: Array) -> Array:
    """The error function, elementwise, from array-API operations only.

    Shapes: any ``x``; result has ``x``'s shape and dtype. Absolute error about 4e-7
    in float32 (computed in float32 for float16) and 1e-13 in float64.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> np.round(aa.nn.erf(np.array([0.0, 0.5, 3.0])), 6)
        array([0.      , 0.5205  , 0.999978])
    """
    xp = _check(x)
    cd = compute_dtype(xp, x.dtype)
    xc = xp.astype(x, cd)
    y = _erf64(xp, xc) if cd == xp.float64 else _erf32(xp, xc)
    return xp.astype(y, x.dtype)


def _gelu_parts(xp: Any, x: Array, approximate: str) -> tuple[Array, Array]:
    """GELU(x) and its derivative, in x's (compute) dtype."""
    if approximate == "none":
        cdf = 0.5 * (
            1.0
            + (
                _erf64(xp, x / math.sqrt(2.0))
                if x.dtype == xp.float64
                else _erf32(xp, x / math.sqrt(2.0))
            )
        )
        pdf = xp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return x * cdf, cdf + x * pdf
    c = math.sqrt(2.0 / math.pi)
    inner = c * (x + 0.044715 * x * x * x)
    t = xp.tanh(inner)
    y = 0.5 * x * (1.0 + t)
    dinner = c * (1.0 + 3.0 * 0.044715 * x * x)
    return y, 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner


def _check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def gelu(x: Array, approximate: str = "none") -> Array:
    """GELU, PyTorch's ``nn.functional.gelu``: ``x * Phi(x)`` with the exact normal CDF
    (``approximate="none"``, BERT's ``"gelu"``) or the tanh approximation
    (``approximate="tanh"``, GPT-2's ``"gelu_new"``).

    Shapes: any ``x``; result has ``x``'s shape and dtype (computed in float32 or float64).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> np.round(aa.nn.gelu(np.array([-1.0, 0.0, 1.0])), 4)
        array([-0.1587,  0.    ,  0.8413])
    """
    xp = _check(x)
    _check_approximate(approximate)
    xc = xp.astype(x, compute_dtype(xp, x.dtype))
    return xp.astype(_gelu_parts(xp, xc, approximate)[0], x.dtype)


@register_vjp(gelu)
def _gelu_vjp(x: Array, approximate: str = "none") -> tuple[Array, Pullback]:
    xp = _check(x)
    _check_approximate(approximate)
    xc = xp.astype(x, compute_dtype(xp, x.dtype))
    y, dy_dx = _gelu_parts(xp, xc, approximate)

    def pullback(dy: Array) -> tuple[Array, None]:
        _check_cotangent(dy, tuple(x.shape))
        return xp.astype(xp.astype(dy, dy_dx.dtype) * dy_dx, x.dtype), None

    return xp.astype(y, x.dtype), pullback


def _sigmoid(xp: Any, x: Array) -> Array:
    # exp of a non-positive number only: no overflow for large |x|.
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x: Array) -> Array:
    """SiLU (swish): ``x * sigmoid(x)``, the gate of LLaMA's SwiGLU MLP.

    Shapes: any ``x``; result has ``x``'s shape and dtype (computed in float32 or float64).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> np.round(aa.nn.silu(np.array([-1.0, 0.0, 1.0])), 4)
        array([-0.2689,  0.    ,  0.7311])
    """
    xp = _check(x)
    xc = xp.astype(x, compute_dtype(xp, x.dtype), copy=False)
    # x / (1 + exp(-x)), as PyTorch computes it: three passes. exp(-x) overflows to inf
    # for very negative x, and x / inf is the limit, -0 (NumPy's warning silenced).
    with np.errstate(over="ignore"):
        y = xc / (1.0 + xp.exp(-xc))
    return xp.astype(y, x.dtype, copy=False)


@register_vjp(silu)
def _silu_vjp(x: Array) -> tuple[Array, Pullback]:
    xp = _check(x)
    xc = xp.astype(x, compute_dtype(xp, x.dtype))
    s = _sigmoid(xp, xc)

    def pullback(dy: Array) -> tuple[Array]:
        _check_cotangent(dy, tuple(x.shape))
        g = xp.astype(dy, s.dtype) * (s * (1.0 + xc * (1.0 - s)))
        return (xp.astype(g, x.dtype),)

    with np.errstate(over="ignore"):  # the forward's own formula: the same values
        y = xc / (1.0 + xp.exp(-xc))
    return xp.astype(y, x.dtype), pullback


def _check_cotangent(dy: Array, shape: tuple[int, ...]) -> None:
    if tuple(dy.shape) != tuple(shape):
        raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(shape)}")
