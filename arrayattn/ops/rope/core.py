"""Rotary position embeddings (RoPE) built from complex arrays, with backward.

``rope_frequencies`` gives ``exp(i * pos * theta_j)``; ``apply_rope`` multiplies pairs of
features by it as complex numbers. Two pairings exist in the wild: ``"interleaved"``
pairs ``(2j, 2j+1)`` (Meta LLaMA, ``view_as_complex``), ``"half"`` pairs ``(j, j + D/2)``
(GPT-NeoX, Hugging Face ``rotate_half``). The backward of a rotation is the rotation by
the conjugate.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from ..._autodiff import Pullback, register_vjp
from ..._backend import (
    Array,
    broadcast_shapes,
    device_of,
    is_real_floating,
    namespace_of,
    require_arrays,
    resolve_namespace,
)
from .scaling import inv_freq_list, real_dtype

__all__ = ["rope_frequencies", "apply_rope", "ROPE_LAYOUTS"]

ROPE_LAYOUTS = ("interleaved", "half")


def rope_frequencies(
    head_dim: int,
    positions: Array | int,
    *,
    theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    partial_rotary_factor: float | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    apply_attention_factor: bool = True,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Array:
    """Complex RoPE factors ``exp(i * pos * theta_j)``, ``theta_j = theta ** (-2j / head_dim)``
    for ``j < head_dim // 2``, or the scaled ladder of a Hugging Face RoPE config.

    Shapes: ``positions`` ``(L,)`` (or any shape ``P``; an int ``n`` means ``arange(n)``)
    -> ``(L, R // 2)`` (``P + (R // 2,)``), ``R = head_dim`` unless a partial rotary
    factor makes it ``int(head_dim * partial_rotary_factor)``. Offsets for a KV cache are
    just positions that start later, e.g. ``arange(past, past + new)``.

    ``rope_scaling`` is the ``rope_scaling`` / ``rope_parameters`` dict of a model's
    ``config.json`` (``default``, ``linear``, ``dynamic``, ``llama3``, ``yarn``,
    ``longrope``); the inverse frequencies are :func:`rope_inv_freq`'s, equal to Hugging
    Face's ``ROPE_INIT_FUNCTIONS``. With ``apply_attention_factor`` (the default) the
    result is multiplied by the config's attention factor (``yarn``, ``longrope``), as HF
    multiplies ``cos`` and ``sin``: ``apply_rope`` then gives HF's rotated q and k. Pass
    ``False`` to get unit factors and scale the scores yourself (by the factor squared).
    ``dynamic`` and ``longrope`` depend on the sequence length: ``seq_len`` is HF's
    ``max(position_ids) + 1``; it defaults to ``n`` for int positions and must be given
    for array positions (it is never read from the data, so the call stays traceable).
    ``partial_rotary_factor`` and ``max_position_embeddings`` are the config's fields of
    those names (see :func:`rope_inv_freq`).

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
        >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        ...         "partial_rotary_factor": 0.5}
        >>> g = aa.rope_frequencies(16, 5, rope_scaling=yarn, xp=np)
        >>> g.shape, round(float(abs(g[0, 0])), 4)       # 4 pairs rotated, |f| = attention factor
        ((5, 4), 1.1386)
    """
    if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"positions must be >= 0 when an int, got {positions}")
        ns = resolve_namespace(xp)
        pos = None
        if seq_len is None:
            seq_len = int(positions)
    else:
        ns = namespace_of(positions=positions)
        device = device_of(positions)
        pos = positions
    if rope_scaling is None and partial_rotary_factor is None:
        # The plain ladder keeps its historical argument checks and messages.
        if (
            isinstance(head_dim, bool)
            or not isinstance(head_dim, numbers.Integral)
            or head_dim < 2
            or head_dim % 2
        ):
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not float(theta) > 0:
            raise ValueError(f"theta must be a positive number, got {theta!r}")
    elif pos is not None and seq_len is None and _needs_seq_len(rope_scaling):
        raise ValueError(
            "rope_scaling of rope_type 'dynamic' or 'longrope' depends on the sequence "
            "length: pass seq_len= (Hugging Face uses max(position_ids) + 1) with array "
            "positions"
        )
    inv_freq, attention_factor = inv_freq_list(
        head_dim,
        rope_scaling,
        theta=theta,
        partial_rotary_factor=partial_rotary_factor,
        max_position_embeddings=max_position_embeddings,
        seq_len=seq_len,
    )
    real = real_dtype(ns, dtype)
    if pos is None:
        pos = ns.arange(int(positions), dtype=real, device=device)
    else:
        pos = ns.astype(pos, real)
    angles = ns.expand_dims(pos, axis=-1) * ns.asarray(inv_freq, dtype=real, device=device)
    scale = attention_factor if apply_attention_factor else 1.0
    return polar(ns, angles, scale)


def _needs_seq_len(rope_scaling: Mapping[str, Any] | None) -> bool:
    if not isinstance(rope_scaling, Mapping):
        return False
    return rope_scaling.get("rope_type", rope_scaling.get("type")) in ("dynamic", "longrope")


def polar(xp: Any, angles: Array, scale: float = 1.0) -> Array:
    """``scale * exp(i * angles)`` as complex64 (complex128 for float64 angles); cos and
    sin are scaled in the real dtype first, as Hugging Face scales its cos/sin."""
    cdt = xp.complex128 if angles.dtype == xp.float64 else xp.complex64
    cos, sin = xp.cos(angles), xp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return xp.astype(cos, cdt) + 1j * xp.astype(sin, cdt)


def _check_apply(x: Array, freqs: Array, layout: str) -> tuple[Any, int]:
    require_arrays(x=x, freqs=freqs)
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
    xr = xp.astype(x, rdt, copy=False)  # (read only: no copy in the compute dtype)
    if layout == "interleaved":
        re, im = xr[..., 0 : 2 * F : 2], xr[..., 1 : 2 * F : 2]
    else:
        re, im = xr[..., :F], xr[..., F : 2 * F]
    z = xp.astype(re, cdt) + 1j * xp.astype(im, cdt)
    w = z * xp.astype(freqs, cdt, copy=False)
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
    return xp.astype(rotated, x.dtype, copy=False)  # (rotated is this call's own)


def apply_rope(x: Array, freqs: Array, *, layout: str = "interleaved") -> Array:
    """Rotate ``x``'s features by the complex RoPE factors ``freqs``.

    Shapes: ``x`` ``(..., L, D)`` real; ``freqs`` complex ``(..., L, F)`` broadcastable to
    ``x``'s ``(..., L, F)`` with ``2F <= D`` (``2F < D`` rotates the first ``2F`` features
    and passes the rest through, GPT-NeoX's partial rotary). Returns ``x``'s shape and
    dtype; the rotation runs in float32 (float64 for float64 ``x``).

    ``layout="interleaved"`` pairs features ``(2j, 2j+1)`` (Meta LLaMA);
    ``layout="half"`` pairs ``(j, j + F)`` (Hugging Face ``rotate_half``).

    ``freqs`` need not have magnitude 1: the factors of ``rope_frequencies(...,
    rope_scaling=yarn)`` carry the attention factor, as Hugging Face's scaled ``cos`` and
    ``sin`` do, and the multi-axis builders (``multi_axis_rope_frequencies``,
    ``mrope_frequencies``) give factors of the same shape, so every variant goes through
    here. The backward multiplies by ``conj(freqs)`` in every case.

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
def _apply_rope_vjp(
    x: Array, freqs: Array, *, layout: str = "interleaved"
) -> tuple[Array, Pullback]:
    xp, F = _check_apply(x, freqs, layout)
    out = _rotate(xp, x, freqs, F, layout)

    def pullback(dy: Array) -> tuple[Array, None]:
        if tuple(dy.shape) != tuple(out.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(out.shape)}")
        dx = _rotate(xp, dy, xp.conj(freqs), F, layout)
        # freqs broadcast over leading dims of x: no reduction needed for dx.
        return dx, None

    return out, pullback
