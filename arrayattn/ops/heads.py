"""Multi-head layout changes: split/merge heads and ``repeat_kv`` (with backwards)."""

from __future__ import annotations

import numbers

from .._autodiff import Pullback, register_vjp
from .._backend import Array, namespace_of

__all__ = ["split_heads", "merge_heads", "repeat_kv"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def split_heads(x: Array, num_heads: int) -> Array:
    """``(..., L, H*D) -> (..., H, L, D)``: view the feature axis as ``num_heads`` heads.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.split_heads(np.zeros((2, 5, 12)), 3).shape
        (2, 3, 5, 4)
    """
    xp = namespace_of(x=x)
    h = _positive_int("num_heads", num_heads)
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., L, H*D), got shape {tuple(x.shape)}")
    L, F = x.shape[-2], x.shape[-1]
    if F % h != 0:
        raise ValueError(
            f"x's last dim {F} (shape {tuple(x.shape)}) is not divisible by num_heads={h}"
        )
    lead = tuple(x.shape[:-2])
    y = xp.reshape(x, lead + (L, h, F // h))
    n = len(lead)
    return xp.permute_dims(y, tuple(range(n)) + (n + 1, n, n + 2))


def merge_heads(x: Array) -> Array:
    """``(..., H, L, D) -> (..., L, H*D)``: the inverse of :func:`split_heads`.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.merge_heads(np.zeros((2, 3, 5, 4))).shape
        (2, 5, 12)
    """
    xp = namespace_of(x=x)
    if x.ndim < 3:
        raise ValueError(f"x must have at least 3 dims (..., H, L, D), got shape {tuple(x.shape)}")
    n = x.ndim - 3
    lead = tuple(x.shape[:n])
    H, L, D = x.shape[-3:]
    y = xp.permute_dims(x, tuple(range(n)) + (n + 1, n, n + 2))
    return xp.reshape(y, lead + (L, H * D))


def repeat_kv(x: Array, n_rep: int) -> Array:
    """``(..., Hkv, S, D) -> (..., Hkv * n_rep, S, D)``, each KV head repeated ``n_rep``
    times in place (Hugging Face ``repeat_kv``, PyTorch ``repeat_interleave(dim=-3)``):
    output head ``h`` is input head ``h // n_rep``.

    Attention itself never needs this (``enable_gqa=True`` broadcasts instead); it is
    here for code that wants explicit heads.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.repeat_kv(np.zeros((1, 2, 7, 4)), 3).shape
        (1, 6, 7, 4)
    """
    xp = namespace_of(x=x)
    r = _positive_int("n_rep", n_rep)
    if x.ndim < 3:
        raise ValueError(
            f"x must have at least 3 dims (..., Hkv, S, D), got shape {tuple(x.shape)}"
        )
    if r == 1:
        return x
    lead = tuple(x.shape[:-3])
    H, S, D = x.shape[-3:]
    y = xp.broadcast_to(xp.expand_dims(x, axis=-3), lead + (H, r, S, D))
    return xp.reshape(y, lead + (H * r, S, D))


def _check_cotangent(dy: Array, shape: tuple[int, ...]) -> None:
    if tuple(dy.shape) != tuple(shape):
        raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(shape)}")


@register_vjp(split_heads)
def _split_heads_vjp(x: Array, num_heads: int) -> tuple[Array, Pullback]:
    out = split_heads(x, num_heads)

    def pullback(dy: Array) -> tuple[Array, None]:
        _check_cotangent(dy, tuple(out.shape))
        return merge_heads(dy), None

    return out, pullback


@register_vjp(merge_heads)
def _merge_heads_vjp(x: Array) -> tuple[Array, Pullback]:
    out = merge_heads(x)

    def pullback(dy: Array) -> tuple[Array]:
        _check_cotangent(dy, tuple(out.shape))
        return (split_heads(dy, x.shape[-3]),)

    return out, pullback


@register_vjp(repeat_kv)
def _repeat_kv_vjp(x: Array, n_rep: int) -> tuple[Array, Pullback]:
    out = repeat_kv(x, n_rep)
    xp = namespace_of(x=x)

    def pullback(dy: Array) -> tuple[Array, None]:
        _check_cotangent(dy, tuple(out.shape))
        lead = tuple(x.shape[:-3])
        H, S, D = x.shape[-3:]
        g = xp.reshape(dy, lead + (H, int(n_rep), S, D))
        return xp.sum(g, axis=-3), None

    return out, pullback
