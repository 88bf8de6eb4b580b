"""Rotary position embeddings (RoPE) built from complex arrays, with backward.

``rope_frequencies`` gives ``exp(i * pos * theta_j)``; ``apply_rope`` multiplies pairs of
features by it as complex numbers. Two pairings exist in the wild: ``"interleaved"``
pairs ``(2j, 2j+1)`` (Meta LLaMA, ``view_as_complex``), ``"half"`` pairs ``(j, j + D/2)``
(GPT-NeoX, Hugging Face ``rotate_half``). The backward of a rotation is the rotation by
the conjugate.
"""

from __future__ import annotations

import numbers
from typing import Any

from .._autodiff import register_vjp
from .._backend import (
    Array,
    broadcast_shapes,
    device_of,
    is_real_floating,
    namespace_of,
    resolve_namespace,
)

__all__ = ["rope_frequencies", "apply_rope", "ROPE_LAYOUTS"]

ROPE_LAYOUTS = ("interleaved", "half")


def rope_frequencies(
    head_dim: int,
    positions: Array | int,
    *,
    theta: float = 10000.0,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Array:
    """Complex RoPE factors ``exp(i * pos * theta_j)``, ``theta_j = theta ** (-2j / head_dim)``
    for ``j < head_dim // 2``.

    Shapes: ``positions`` ``(L,)`` (or any shape ``P``; an int ``n`` means ``arange(n)``)
    -> ``(L, head_dim // 2)`` (``P + (head_dim // 2,)``). Offsets for a KV cache are just
    positions that start later, e.g. ``arange(past, past + new)``.

    ``dtype`` is the real dtype the angles are computed in, as the reference
    implementations do (float32 -> complex64, the default; float64 -> complex128); a
    complex dtype picks its real counterpart. ``xp``/``device`` say where to build the
    array when ``positions`` is an int (default NumPy, CPU); otherwise they follow it.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> f = aa.rope_frequencies(8, 5, xp=np)
        >>> f.shape, f.dtype
        ((5, 4), dtype('complex64'))
    """
    if (
        isinstance(head_dim, bool)
        or not isinstance(head_dim, numbers.Integral)
        or head_dim < 2
        or head_dim % 2
    ):
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not float(theta) > 0:
        raise ValueError(f"theta must be a positive number, got {theta!r}")
    if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"positions must be >= 0 when an int, got {positions}")
        ns = resolve_namespace(xp)
        pos = None
    else:
        ns = namespace_of(positions=positions)
        device = device_of(positions)
        pos = positions
    real = _real_dtype(ns, dtype)
    if pos is None:
        pos = ns.arange(int(positions), dtype=real, device=device)
    else:
        pos = ns.astype(pos, real)
    half = int(head_dim) // 2
    exponents = ns.arange(half, dtype=real, device=device) * (-2.0 / int(head_dim))
    inv_freq = float(theta) ** exponents
    angles = ns.expand_dims(pos, axis=-1) * inv_freq
    cdt = ns.complex128 if real == ns.float64 else ns.complex64
    return ns.astype(ns.cos(angles), cdt) + 1j * ns.astype(ns.sin(angles), cdt)


def _real_dtype(xp: Any, dtype: Any) -> Any:
    if dtype is None:
        return xp.float32
    if dtype in (xp.complex128, xp.float64):
        return xp.float64
    # float16/bfloat16 exist only in some namespaces (array-api-strict has neither).
    low = tuple(getattr(xp, name) for name in ("float16", "bfloat16") if hasattr(xp, name))
    if dtype in (xp.complex64, xp.float32) + low:
        return xp.float32
    raise TypeError(f"dtype must be a float or complex dtype, got {dtype!r}")


def _check_apply(x: Array, freqs: Array, layout: str) -> tuple[Any, int]:
    xp = namespace_of(x=x, freqs=freqs)
    if not is_real_floating(xp, x.dtype):
        raise TypeError(f"x must have a real floating dtype, got {x.dtype}")
    if not xp.isdtype(freqs.dtype, "complex floating"):
        raise TypeError(f"freqs must be complex (from rope_frequencies), got dtype {freqs.dtype}")
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    if x.ndim < 1 or freqs.ndim < 1:
        raise ValueError(
            f"x and freqs need a feature axis; got shapes {tuple(x.shape)}, {tuple(freqs.shape)}"
        )
    F = int(freqs.shape[-1])
    D = int(x.shape[-1])
    if 2 * F > D:
        raise ValueError(
            f"freqs has {F} frequencies (shape {tuple(freqs.shape)}), which rotate {2 * F} "
            f"features, but x has only {D} (shape {tuple(x.shape)})"
        )
    target = tuple(int(d) for d in x.shape[:-1]) + (F,)
    try:
        ok = broadcast_shapes(tuple(freqs.shape), target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"freqs of shape {tuple(freqs.shape)} does not broadcast to x's positions "
            f"{target} (x shape {tuple(x.shape)}); expected (..., L, {F})"
        )
    return xp, F


def _rotate(xp: Any, x: Array, freqs: Array, F: int, layout: str) -> Array:
    """Multiply the first ``2F`` features of ``x``, paired per ``layout``, by ``freqs``."""
    D = int(x.shape[-1])
    cdt = xp.complex128 if x.dtype == xp.float64 else xp.complex64
    rdt = xp.float64 if x.dtype == xp.float64 else xp.float32
    xr = xp.astype(x, rdt)
    if layout == "interleaved":
        re, im = xr[..., 0 : 2 * F : 2], xr[..., 1 : 2 * F : 2]
    else:
        re, im = xr[..., :F], xr[..., F : 2 * F]
    z = xp.astype(re, cdt) + 1j * xp.astype(im, cdt)
    w = z * xp.astype(freqs, cdt)
    out_re, out_im = xp.real(w), xp.imag(w)
    if layout == "interleaved":
        rotated = xp.reshape(
            xp.stack((out_re, out_im), axis=-1), tuple(out_re.shape[:-1]) + (2 * F,)
        )
    else:
        rotated = xp.concat((out_re, out_im), axis=-1)
    if 2 * F < D:
        rest = xr[..., 2 * F :]
        rotated = xp.concat(
            (rotated, xp.broadcast_to(rest, tuple(rotated.shape[:-1]) + (D - 2 * F,))), axis=-1
        )
    return xp.astype(rotated, x.dtype)


def apply_rope(x: Array, freqs: Array, *, layout: str = "interleaved") -> Array:
    """Rotate ``x``'s features by the complex RoPE factors ``freqs``.

    Shapes: ``x`` ``(..., L, D)`` real; ``freqs`` complex ``(..., L, F)`` broadcastable to
    ``x``'s ``(..., L, F)`` with ``2F <= D`` (``2F < D`` rotates the first ``2F`` features
    and passes the rest through, GPT-NeoX's partial rotary). Returns ``x``'s shape and
    dtype; the rotation runs in float32 (float64 for float64 ``x``).

    ``layout="interleaved"`` pairs features ``(2j, 2j+1)`` (Meta LLaMA);
    ``layout="half"`` pairs ``(j, j + F)`` (Hugging Face ``rotate_half``).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> x = np.ones((2, 4, 6, 8), dtype=np.float32)       # (B, H, L, D)
        >>> f = aa.rope_frequencies(8, 6, xp=np)             # (L, D/2)
        >>> y = aa.apply_rope(x, f, layout="half")
        >>> y.shape, bool(np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1)))
        ((2, 4, 6, 8), True)
    """
    xp, F = _check_apply(x, freqs, layout)
    return _rotate(xp, x, freqs, F, layout)


@register_vjp(apply_rope)
def _apply_rope_vjp(x: Array, freqs: Array, *, layout: str = "interleaved"):
    xp, F = _check_apply(x, freqs, layout)
    out = _rotate(xp, x, freqs, F, layout)

    def pullback(dy: Array):
        if tuple(dy.shape) != tuple(out.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(out.shape)}")
        dx = _rotate(xp, dy, xp.conj(freqs), F, layout)
        # freqs broadcast over leading dims of x: no reduction needed for dx.
        return dx, None

    return out, pullback
