"""``Cotangents``: what a ``MultiHeadAttention.vjp`` pullback returns."""

from __future__ import annotations

from typing import Any

from .._backend import Array

__all__ = ["Cotangents"]

Params = dict[str, Array]


class Cotangents(tuple):
    """What a :meth:`MultiHeadAttention.vjp` pullback returns: the tuple
    ``(dx, dcontext, dparams)`` (so ``dx, dcontext, dparams = pullback(d_out)`` works),
    with the cotangents of the other inputs as attributes: :attr:`value` (the separate
    ``value`` input, else ``None``), :attr:`attn_mask` (a float mask, else ``None``) and
    :attr:`score_mod` (a score_mod's parameters, else ``None``).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(embed_dim=8, num_heads=2)
        >>> params = mha.init(seed=0, xp=np, dtype=np.float64)
        >>> x, bias = np.ones((1, 3, 8)), np.zeros((1, 2, 3, 3))
        >>> y, pullback = mha.vjp(params, x, attn_mask=bias)
        >>> grads = pullback(np.ones_like(y))
        >>> grads.x.shape, grads.context, grads.attn_mask.shape
        ((1, 3, 8), None, (1, 2, 3, 3))
    """

    _value: Array | None
    _attn_mask: Array | None
    _score_mod: tuple[Array, ...] | None

    def __new__(
        cls,
        dx: Array,
        dcontext: Array | None,
        dparams: Params,
        dvalue: Any,
        dmask: Any,
        dscore: tuple[Array, ...] | None = None,
    ) -> Cotangents:
        self = super().__new__(cls, (dx, dcontext, dparams))
        self._value, self._attn_mask, self._score_mod = dvalue, dmask, dscore
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A tuple subclass with a six-argument __new__ and three attributes: pickle (and
        # copy.deepcopy) rebuild it from all six, e.g. gradients sent back from a worker.
        return (
            type(self),
            (self[0], self[1], self[2], self._value, self._attn_mask, self._score_mod),
        )

    @property
    def x(self) -> Array:
        """Cotangent of ``x``."""
        return self[0]

    @property
    def context(self) -> Array | None:
        """Cotangent of ``context`` (keys' input; also values' without ``value``)."""
        return self[1]

    @property
    def params(self) -> Params:
        """One cotangent per parameter name."""
        return self[2]

    @property
    def value(self) -> Array | None:
        """Cotangent of the separate ``value`` input (``None`` without one)."""
        return self._value

    @property
    def attn_mask(self) -> Array | None:
        """Cotangent of a float ``attn_mask`` (a learned bias), in its shape; ``None`` for
        a bool mask or none."""
        return self._attn_mask

    @property
    def score_mod(self) -> tuple[Array, ...] | None:
        """Cotangents of the call's ``score_mod`` parameters (a bias table), one per
        ``score_mod.params`` in order; ``None`` without a score_mod that has some."""
        return self._score_mod
