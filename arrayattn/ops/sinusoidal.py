"""The sinusoidal timestep/position embedding of diffusion models (Wan2.1's
``sinusoidal_embedding_1d``), with backward.

``[cos(p * w_j), sin(p * w_j)]`` with ``w_j = theta ** (-j / half)``: the cosine half
first. It is computed in float64 whatever the output dtype, as Wan2.1 does, because
timesteps reach 1000 and a float32 angle of that size has lost three digits.
"""

from __future__ import annotations

import numbers
from typing import Any

from .._autodiff import Pullback, register_vjp
from .._backend import Array, device_of, is_real_floating, namespace_of, resolve_namespace

__all__ = ["sinusoidal_embedding"]


def _prepare(
    dim: int, positions: Array | int, theta: float, xp: Any, device: Any, dtype: Any
) -> tuple[Any, Array, Array, Any]:
    """``(ns, pos64, w64, out_dtype)``."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2 or dim % 2:
        raise ValueError(f"dim must be a positive even int, got {dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not float(theta) > 0:
        raise ValueError(f"theta must be a positive number, got {theta!r}")
    if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"positions must be >= 0 when an int, got {positions}")
        ns = resolve_namespace(xp)
        pos = ns.arange(int(positions), dtype=ns.float64, device=device)
    else:
        ns = namespace_of(positions=positions)
        device = device_of(positions)
        if ns.isdtype(positions.dtype, "bool") or ns.isdtype(positions.dtype, "complex floating"):
            raise TypeError(f"positions must be integer or real, got dtype {positions.dtype}")
        pos = ns.astype(positions, ns.float64)
    out = ns.float32 if dtype is None else dtype
    if not is_real_floating(ns, out):
        raise TypeError(f"dtype must be a real floating dtype, got {dtype!r}")
    half = int(dim) // 2
    w = [float(theta) ** (-j / half) for j in range(half)]
    return ns, pos, ns.asarray(w, dtype=ns.float64, device=device), out


def sinusoidal_embedding(
    dim: int,
    positions: Array | int,
    *,
    theta: float = 10000.0,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Array:
    """Sinusoidal embedding ``[cos(p * w_j), sin(p * w_j)]``, ``w_j = theta ** (-j / (dim/2))``.

    Wan2.1's ``sinusoidal_embedding_1d`` (the diffusion timestep embedding that sits
    beside RoPE): the angles are computed in float64, the cosine half comes first, and the
    result is cast to ``dtype``.

    Shapes: ``positions`` of any shape ``P`` (an int ``n`` means ``arange(n)``) ->
    ``P + (dim,)``.

    Args:
        dim: the embedding width, even.
        positions: timesteps or positions, integer or real.
        theta: the base (10000, as Wan2.1 and the Transformer).
        xp, device: where to build the result when ``positions`` is an int (default
            NumPy, CPU); otherwise they follow ``positions``.
        dtype: the real dtype of the result (default float32).

    Backward (``vjp``): the cotangent of real ``positions``
    (``sum_j w_j (cos_j d_sin_j - sin_j d_cos_j)``); ``None`` for integer positions.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> e = aa.sinusoidal_embedding(8, np.array([0, 999]))
        >>> e.shape, e.dtype, e[0].tolist()
        ((2, 8), dtype('float32'), [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    """
    ns, pos, w, out = _prepare(dim, positions, theta, xp, device, dtype)
    angles = ns.expand_dims(pos, axis=-1) * w
    return ns.astype(ns.concat((ns.cos(angles), ns.sin(angles)), axis=-1), out)


@register_vjp(sinusoidal_embedding)
def _sinusoidal_embedding_vjp(
    dim: int,
    positions: Array | int,
    *,
    theta: float = 10000.0,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> tuple[Array, Pullback]:
    ns, pos, w, out_dtype = _prepare(dim, positions, theta, xp, device, dtype)
    angles = ns.expand_dims(pos, axis=-1) * w
    cos, sin = ns.cos(angles), ns.sin(angles)
    out = ns.astype(ns.concat((cos, sin), axis=-1), out_dtype)
    half = int(dim) // 2
    # An int position (int named beside Integral for type checkers) has no dtype, no cotangent.
    pos_dtype = None if isinstance(positions, (int, numbers.Integral)) else positions.dtype
    differentiable = pos_dtype is not None and is_real_floating(ns, pos_dtype)

    def pullback(dy: Array) -> tuple[None, Array | None]:
        if tuple(dy.shape) != tuple(out.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(out.shape)}")
        if not differentiable:
            return None, None
        d = ns.astype(dy, ns.float64)
        d_cos, d_sin = d[..., :half], d[..., half:]
        dpos = ns.sum((cos * d_sin - sin * d_cos) * w, axis=-1)
        return None, ns.astype(dpos, pos_dtype)

    return out, pullback
