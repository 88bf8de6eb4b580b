"""``vjp``: hand-written reverse-mode rules for the public ops (no autograd engine).

Each differentiable op registers a *rule*: a function with the op's own signature that
returns ``(out, pullback)``, where ``pullback(cotangent)`` gives one cotangent per
positional parameter of the op, in order (``None`` where that parameter is not
differentiable). :func:`vjp` trims that tuple to the positional arguments the caller
actually passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["vjp", "register_vjp", "differentiable_ops"]

Pullback = Callable[[Any], tuple[Any, ...]]
Rule = Callable[..., tuple[Any, Pullback]]

_RULES: dict[Callable[..., Any], Rule] = {}


def register_vjp(op: Callable[..., Any]) -> Callable[[Rule], Rule]:
    """Decorator: register ``rule`` as the reverse-mode rule of ``op``."""

    def decorate(rule: Rule) -> Rule:
        _RULES[op] = rule
        return rule

    return decorate


def differentiable_ops() -> tuple[Callable[..., Any], ...]:
    """The public ops that :func:`vjp` can differentiate.

    Examples:
        >>> import arrayattn as aa
        >>> aa.scaled_dot_product_attention in aa.differentiable_ops()
        True
    """
    return tuple(_RULES)


def vjp(fn: Callable[..., Any], *arrays: Any, **options: Any) -> tuple[Any, Pullback]:
    """Run ``fn(*arrays, **options)`` and return ``(out, pullback)``.

    ``pullback(cotangent)`` returns a tuple with one entry per positional argument given
    here: the cotangent (gradient of a scalar loss) for that argument, or ``None`` where
    it is not differentiable (a boolean mask, complex RoPE frequencies, an int). The
    cotangent has the structure of ``out``: an array, or a tuple such as
    ``(d_out, d_lse)`` for ``scaled_dot_product_attention(..., return_lse=True)``, where
    ``None`` entries mean zero.

    Keyword arrays that are differentiable (``sinks=`` of the attention ops) get their
    cotangents in one more entry after the positional ones: a dict from the keyword's
    name to its cotangent, e.g. ``dq, dk, dv, kw = pullback(g)`` and ``kw["sinks"]``.
    It is present only when such a keyword array was passed.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> q = k = v = np.ones((1, 2, 4, 8), dtype=np.float32)
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, is_causal=True)
        >>> dq, dk, dv = pullback(np.ones_like(out))
        >>> dq.shape, dk.shape, dv.shape
        ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    """
    rule = _RULES.get(fn)
    if rule is None:
        names = ", ".join(sorted(getattr(f, "__name__", repr(f)) for f in _RULES))
        raise TypeError(
            f"fn={getattr(fn, '__name__', fn)!r} has no registered backward; "
            f"differentiable ops are: {names}"
        )
    out, pullback = rule(*arrays, **options)
    n = len(arrays)

    def trimmed_pullback(cotangent: Any) -> tuple[Any, ...]:
        grads = tuple(pullback(cotangent))
        # A rule may end its tuple with a dict of keyword-argument cotangents
        # (``{"sinks": ...}``); it follows the positional ones, after trimming.
        keywords = grads[-1] if grads and isinstance(grads[-1], dict) else None
        if keywords is not None:
            grads = grads[:-1]
        grads = grads[:n] + (None,) * max(0, n - len(grads))
        if keywords:
            grads = grads + (dict(keywords),)
        return grads

    return out, trimmed_pullback
