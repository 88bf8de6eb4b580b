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

__all__ = ["vjp", "register_vjp", "differentiable_ops", "check_cotangent"]

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
        check_cotangent(out, cotangent)
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


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"a {type(x).__name__} of shape {tuple(shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


def check_cotangent(out: Any, cotangent: Any, name: str = "cotangent") -> None:
    """Check that ``cotangent`` has the structure of ``out``: one array (or ``None``,
    meaning zero) per output array, of the output's library and device, with a real
    floating dtype for a real output (a complex cotangent would silently lose its
    imaginary part). Raises ``TypeError`` naming what was seen and what was expected.
    Shapes are each rule's own check (with the names of its outputs); outputs that are
    neither arrays nor tuples/lists of them are left to the rule.

    Examples:
        >>> import numpy as np
        >>> check_cotangent(np.zeros(3), np.ones(3))
        >>> try:
        ...     check_cotangent(np.zeros(3), (np.ones(3), None))
        ... except TypeError as e:
        ...     print(str(e)[:48])
        cotangent must be one array shaped like the outp
    """
    import array_api_compat

    from ._backend import device_of, is_real_floating, library_name, namespace_of

    if isinstance(out, (tuple, list)):
        if not all(o is None or array_api_compat.is_array_api_obj(o) for o in out):
            return
        if not isinstance(cotangent, (tuple, list)) or len(cotangent) != len(out):
            raise TypeError(
                f"{name} must be a tuple of {len(out)} (one array or None per output, "
                f"like the output), got {_describe(cotangent)}"
            )
        for i, (o, c) in enumerate(zip(out, cotangent, strict=True)):
            if o is not None:
                check_cotangent(o, c, f"{name}[{i}]")
        return
    if not array_api_compat.is_array_api_obj(out) or cotangent is None:
        return
    shape = tuple(out.shape)
    if isinstance(cotangent, (tuple, list)):
        raise TypeError(
            f"{name} must be one array shaped like the output {shape}, got "
            f"{_describe(cotangent)} (a pair (d_out, d_lse) is for an output pair such as "
            "return_lse=True)"
        )
    xp = namespace_of(output=out)
    cxp = namespace_of(**{name: cotangent})
    if cxp is not xp:
        raise TypeError(
            f"{name} is a {library_name(cxp)} array but the output is a {library_name(xp)} "
            "array; the cotangent must come from the output's library"
        )
    out_dev, dev = device_of(out), device_of(cotangent)
    # A traced output (jax.jit) may report no device; only two known devices can differ.
    if out_dev is not None and dev is not None and dev != out_dev:
        raise TypeError(f"{name} is on device {dev!r} but the output is on device {out_dev!r}")
    if is_real_floating(xp, out.dtype) and not is_real_floating(xp, cotangent.dtype):
        raise TypeError(
            f"{name} must have a real floating dtype like the output ({out.dtype}), got "
            f"{cotangent.dtype}"
        )
