"""Score modifiers (``score_mod``) with their derivatives, so every backward stays
hand-written.

A score_mod acts elementwise on the scaled score of each (query, key) pair after the
softcap and ALiBi, before a float mask (``SEMANTICS.md``):
``score_mod(score, b, h, q_idx, kv_idx) -> score`` on broadcasting int32 index arrays
(FlexAttention's convention). For the backward it comes with its derivative with respect
to the score (:meth:`ScoreMod.grad`) and, when it captures parameters (a learned bias
table), their gradients (:meth:`ScoreMod.param_grads`), accumulated deterministically
(:func:`arrayattn._backend.scatter_add`): :func:`arrayattn.vjp` returns them in its
trailing dict, ``pullback(g)[-1]["score_mod"]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .._backend import Array, array_namespace, scatter_add

__all__ = [
    "ScoreMod",
    "as_score_mod",
    "relative_position_bias",
    "t5_relative_position_bucket",
    "relative_position_bias_2d",
    "alibi_score_mod",
    "softcap_score_mod",
]

ScoreModFn = Callable[[Array, Array, Array, Array, Array], Array]


class ScoreMod:
    """A score_mod and its derivative(s).

    Args:
        fn: ``fn(score, b, h, q_idx, kv_idx) -> score``, elementwise.
        grad: ``grad(score, b, h, q_idx, kv_idx) -> d fn / d score`` (same broadcasting);
            ``None`` means the derivative is 1 (an additive bias). Without it a
            ``ScoreMod`` still runs forward; :func:`arrayattn.vjp` refuses it.
        params: arrays the function captures whose gradients :func:`arrayattn.vjp`
            returns (then ``param_grads`` is required).
        param_grads: ``param_grads(d_score, b, h, q_idx, kv_idx) -> tuple`` of one block's
            contributions to each parameter's gradient, given the gradient ``d_score``
            of the modified scores (shaped like the block).
        name: shown in errors and reprs.
        rebuild: ``rebuild(params) -> ScoreMod``: the same score_mod over other arrays
            for its ``params`` (a tuple like :attr:`params`). The framework bridges
            (:mod:`arrayattn.torch`, :mod:`arrayattn.jax`) call it to run the score_mod
            on the arrays their path computes with (NumPy views of torch tensors, the
            arrays a ``jax.custom_vjp`` receives) and to hand the parameters' gradients
            to autograd; the built-ins have it.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> from arrayattn.flex import ScoreMod
        >>> square = ScoreMod(lambda s, b, h, q, kv: s * s, grad=lambda s, b, h, q, kv: 2 * s)
        >>> q = np.ones((1, 1, 3, 4))
        >>> aa.scaled_dot_product_attention(q, q, q, score_mod=square).shape
        (1, 1, 3, 4)
    """

    differentiable = True

    def __init__(
        self,
        fn: ScoreModFn,
        grad: ScoreModFn | None = None,
        *,
        params: tuple[Array, ...] = (),
        param_grads: Callable[..., tuple[Array, ...]] | None = None,
        name: str | None = None,
        differentiable: bool = True,
        rebuild: Callable[[tuple[Array, ...]], ScoreMod] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"score_mod must be callable, got {type(fn).__name__}")
        if params and param_grads is None:
            raise ValueError("a ScoreMod with params needs param_grads")
        self.fn = fn
        self._grad = grad
        self.params = tuple(params)
        self._param_grads = param_grads
        self.name = str(name or getattr(fn, "__name__", "score_mod"))
        self.differentiable = differentiable
        self._rebuild = rebuild
        # Heads of a per-head table (the built-ins set it; checked against the call's
        # query heads, 1 meaning shared), else None.
        self.heads: int | None = None

    def __call__(self, score: Array, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return self.fn(score, b, h, q_idx, kv_idx)

    def grad(self, score: Array, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array | None:
        """``d score_mod / d score`` at ``score`` (``None``: 1 everywhere)."""
        return None if self._grad is None else self._grad(score, b, h, q_idx, kv_idx)

    def param_grads(
        self, d_score: Array, b: Array, h: Array, q_idx: Array, kv_idx: Array
    ) -> tuple[Array, ...]:
        """One block's contributions to the gradients of :attr:`params`."""
        if not self.params:
            return ()
        assert self._param_grads is not None
        return tuple(self._param_grads(d_score, b, h, q_idx, kv_idx))

    @property
    def rebindable(self) -> bool:
        """True when :meth:`with_params` can run this score_mod over other arrays (no
        params, or a ``rebuild`` function)."""
        return not self.params or self._rebuild is not None

    def with_params(self, params: tuple[Array, ...]) -> ScoreMod:
        """The same score_mod over ``params`` instead of :attr:`params` (as many, of
        the same shapes): what the framework bridges run. ``TypeError`` when it has
        params but was built without ``rebuild=``.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.flex import relative_position_bias
            >>> m = relative_position_bias(np.zeros((32, 2)))
            >>> m.with_params((np.ones((32, 2)),)).params[0].sum()
            np.float64(64.0)
        """
        params = tuple(params)
        if len(params) != len(self.params):
            raise ValueError(f"score_mod {self!r} has {len(self.params)} params, got {len(params)}")
        if all(a is b for a, b in zip(params, self.params, strict=True)):
            return self
        for i, (new, old) in enumerate(zip(params, self.params, strict=True)):
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(
                    f"score_mod {self!r} params[{i}] has shape {tuple(old.shape)}, "
                    f"got {tuple(new.shape)}"
                )
        if self._rebuild is None:
            raise TypeError(
                f"score_mod {self!r} has params but no rebuild= function, so it cannot run "
                "over other arrays: build it as ScoreMod(fn, grad, params=..., "
                "param_grads=..., rebuild=lambda params: <the same ScoreMod over params>)"
            )
        return self._rebuild(params)

    def __repr__(self) -> str:
        return self.name


class _Plain(ScoreMod):
    """A bare function: forward only (``vjp`` refuses it, naming what is missing)."""

    def __init__(self, fn: ScoreModFn) -> None:
        super().__init__(fn, differentiable=False)


def as_score_mod(fn: Any) -> ScoreMod:
    """``fn`` as a :class:`ScoreMod` (a bare function gets no derivative)."""
    if isinstance(fn, ScoreMod):
        return fn
    if not callable(fn):
        raise TypeError(
            "score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx), got "
            f"{type(fn).__name__}"
        )
    return _Plain(fn)


def _heads_table(table: Array, name: str) -> Array:
    if not hasattr(table, "shape") or table.ndim != 2:
        shape = getattr(table, "shape", None)
        raise ValueError(f"{name} must be a 2-D array (entries, heads), got shape {shape}")
    return table


def _lookup(table: Array, index: Array, h: Array) -> Array:
    """``table[index, h]`` for a ``(K, H)`` table (``H`` may be 1: shared by all heads)
    and broadcasting int index arrays, by a flat ``take``."""
    xp = array_namespace(table)
    K, H = table.shape
    if H == 1:
        flat = index
    else:
        flat = index * H + xp.astype(h, index.dtype)
    shape = flat.shape
    out = xp.take(xp.reshape(table, (-1,)), xp.reshape(flat, (-1,)), axis=0)
    return xp.reshape(out, shape)


def _table_grad(table: Array, index: Array, h: Array, d_score: Array) -> Array:
    """The gradient of ``table[index, h]`` summed over a block: ``d_score`` (the block,
    ``(*batch, ..., l, s)``) summed over what the index does not depend on, then
    scattered into the table deterministically."""
    xp = array_namespace(table)
    K, H = table.shape
    flat = index if H == 1 else index * H + xp.astype(h, index.dtype)
    # Leading (batch) axes the index is constant along: summed first, in a fixed order.
    extra = d_score.ndim - flat.ndim
    if extra > 0:
        d_score = xp.sum(d_score, axis=tuple(range(extra)))
    flat = xp.broadcast_to(flat, d_score.shape)
    return scatter_add(
        xp,
        xp.reshape(flat, (-1,)),
        xp.reshape(xp.astype(d_score, table.dtype), (-1,)),
        K * H,
        shape=(K, H),
    )


def t5_relative_position_bucket(
    relative_position: Array, *, bidirectional: bool = True, num_buckets: int = 32,
    max_distance: int = 128,
) -> Array:  # fmt: skip
    """T5's bucket of ``relative_position = kv_idx - q_idx`` (Hugging Face's
    ``T5Attention._relative_position_bucket``, its float32 logarithm included, so the
    buckets agree exactly).

    Examples:
        >>> import numpy as np
        >>> t5_relative_position_bucket(np.array([-200, -3, 0, 3, 200])).tolist()
        [15, 3, 0, 19, 31]
    """
    xp = array_namespace(relative_position)
    rp = xp.astype(relative_position, xp.int64)
    buckets = xp.zeros_like(rp)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets = buckets + xp.astype(rp > 0, xp.int64) * n
        rp = xp.abs(rp)
    else:
        rp = -xp.minimum(rp, xp.zeros_like(rp))
    max_exact = n // 2
    is_small = rp < max_exact
    safe = xp.astype(xp.maximum(rp, xp.ones_like(rp) * max_exact), xp.float32)
    large = max_exact + xp.astype(
        xp.log(safe / max_exact) / math.log(max_distance / max_exact) * (n - max_exact),
        xp.int64,
    )
    large = xp.minimum(large, xp.full_like(large, n - 1))
    return buckets + xp.where(is_small, rp, large)


def relative_position_bias(
    table: Array, *, bidirectional: bool = True, num_buckets: int | None = None,
    max_distance: int = 128,
) -> ScoreMod:  # fmt: skip
    """T5's learned relative-position bias: ``score + table[bucket(kv_idx - q_idx), h]``
    with ``table`` shaped ``(num_buckets, H)`` (Hugging Face's
    ``relative_attention_bias.weight``; ``H = 1`` shares it over heads). The table gets
    its gradient (deterministically) through :func:`arrayattn.vjp`.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> from arrayattn.flex import relative_position_bias
        >>> table = np.zeros((32, 2))
        >>> q = np.ones((1, 2, 5, 4))
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, q, q,
        ...                        score_mod=relative_position_bias(table))
        >>> pullback(np.ones_like(out))[-1]["score_mod"][0].shape
        (32, 2)
    """
    table = _heads_table(table, "table")
    nb = table.shape[0] if num_buckets is None else int(num_buckets)
    if nb != table.shape[0]:
        raise ValueError(f"table has {table.shape[0]} buckets, num_buckets is {nb}")

    def index(q_idx: Array, kv_idx: Array) -> Array:
        return t5_relative_position_bucket(
            kv_idx - q_idx, bidirectional=bidirectional, num_buckets=nb,
            max_distance=max_distance,
        )  # fmt: skip

    def fn(s: Array, b: Array, h: Array, q: Array, kv: Array) -> Array:
        xp = array_namespace(s)
        return s + xp.astype(_lookup(table, index(q, kv), h), s.dtype)

    def pgrad(ds: Array, b: Array, h: Array, q: Array, kv: Array) -> tuple[Array, ...]:
        return (_table_grad(table, index(q, kv), h, ds),)

    def rebuild(params: tuple[Array, ...]) -> ScoreMod:
        return relative_position_bias(
            params[0], bidirectional=bidirectional, num_buckets=nb, max_distance=max_distance
        )

    smod = ScoreMod(
        fn, None, params=(table,), param_grads=pgrad, name="relative_position_bias",
        rebuild=rebuild,
    )  # fmt: skip
    smod.heads = int(table.shape[1])
    return smod


def relative_position_bias_2d(table: Array, window: tuple[int, int]) -> ScoreMod:
    """Swin's learned 2-D relative-position bias over a ``(Wh, Ww)`` window of tokens in
    row-major order: ``score + table[(yq - yk + Wh - 1) * (2 Ww - 1) + xq - xk + Ww - 1, h]``
    with ``table`` shaped ``((2 Wh - 1) * (2 Ww - 1), H)`` (Swin's
    ``relative_position_bias_table``). The table gets its gradient through
    :func:`arrayattn.vjp`.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> from arrayattn.flex import relative_position_bias_2d
        >>> table = np.zeros((9, 1))
        >>> x = np.ones((1, 1, 4, 8))
        >>> aa.scaled_dot_product_attention(x, x, x,
        ...     score_mod=relative_position_bias_2d(table, (2, 2))).shape
        (1, 1, 4, 8)
    """
    table = _heads_table(table, "table")
    wh, ww = (int(w) for w in window)
    if table.shape[0] != (2 * wh - 1) * (2 * ww - 1):
        raise ValueError(
            f"table must have (2 Wh - 1) * (2 Ww - 1) = {(2 * wh - 1) * (2 * ww - 1)} rows "
            f"for window {(wh, ww)}, got {table.shape[0]}"
        )

    def index(q_idx: Array, kv_idx: Array) -> Array:
        dy = q_idx // ww - kv_idx // ww
        dx = q_idx % ww - kv_idx % ww
        return (dy + wh - 1) * (2 * ww - 1) + dx + ww - 1

    def fn(s: Array, b: Array, h: Array, q: Array, kv: Array) -> Array:
        xp = array_namespace(s)
        return s + xp.astype(_lookup(table, index(q, kv), h), s.dtype)

    def pgrad(ds: Array, b: Array, h: Array, q: Array, kv: Array) -> tuple[Array, ...]:
        return (_table_grad(table, index(q, kv), h, ds),)

    def rebuild(params: tuple[Array, ...]) -> ScoreMod:
        return relative_position_bias_2d(params[0], (wh, ww))

    smod = ScoreMod(
        fn, None, params=(table,), param_grads=pgrad, name="relative_position_bias_2d",
        rebuild=rebuild,
    )  # fmt: skip
    smod.heads = int(table.shape[1])
    return smod


def alibi_score_mod(slopes: Array, *, offset: int = 0) -> ScoreMod:
    """ALiBi as a score_mod: ``score - slopes[h] * |q_idx + offset - kv_idx|`` (the same
    as ``alibi_slopes=`` with the diagonal offset of ``causal_align``: 0 top-left,
    ``S - L`` bottom-right). The slopes are constants (no gradient), as with the option.

    Examples:
        >>> import numpy as np
        >>> m = alibi_score_mod(np.array([0.5]))
        >>> m(np.zeros((1, 1, 2, 2)), 0, np.zeros((1, 1, 1)), np.arange(2).reshape(2, 1),
        ...   np.arange(2)).tolist()
        [[[[0.0, -0.5], [-0.5, 0.0]]]]
    """

    def fn(s: Array, b: Array, h: Array, q: Array, kv: Array) -> Array:
        xp = array_namespace(s)
        hh = xp.asarray(h, dtype=xp.int64)
        sl = xp.reshape(xp.take(slopes, xp.reshape(hh, (-1,)), axis=0), hh.shape)
        dist = xp.abs(xp.astype(q + offset - kv, s.dtype))
        return s - xp.astype(sl, s.dtype) * dist

    return ScoreMod(fn, None, name="alibi_score_mod")


def softcap_score_mod(softcap: float) -> ScoreMod:
    """Softcapping as a score_mod: ``softcap * tanh(score / softcap)`` (Gemma 2), with its
    derivative ``1 - tanh^2``; the same as the ``softcap=`` option.

    Examples:
        >>> import numpy as np
        >>> float(softcap_score_mod(10.0)(np.asarray(100.0), 0, 0, 0, 0)) < 10.0
        True
    """
    cap = float(softcap)
    if not cap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap!r}")

    def fn(s: Array, b: Array, h: Array, q: Array, kv: Array) -> Array:
        xp = array_namespace(s)
        return cap * xp.tanh(s / cap)

    def grad(s: Array, b: Array, h: Array, q: Array, kv: Array) -> Array:
        xp = array_namespace(s)
        t = xp.tanh(s / cap)
        return 1.0 - t * t

    return ScoreMod(fn, grad, name=f"softcap_score_mod({cap:g})")
