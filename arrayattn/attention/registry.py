"""The registry of attention implementations, and ``implementation="auto"``'s choice.

This module imports no implementation. Each one registers itself when its module is
imported (:mod:`arrayattn.attention.implementations` imports them all), with:

* ``declines(spec)``: ``None`` when it can run the call, else a short reason (the error
  when the implementation is named and cannot);
* ``auto_rank``: its place in ``"auto"``'s order (lower first; ``None``: only when named);
* ``auto_declines(spec)``: an extra condition ``"auto"`` alone applies (the composed path
  above a size, the CuPy kernels on other libraries' arrays);
* ``cost``: its own :class:`~arrayattn.attention.cost.CostModel` (estimated seconds for a
  call), or ``None``.

``"auto"`` walks the ranked implementations that take the call: one without a cost model
(the CuPy kernels, the Dask path) runs when it ranks first; otherwise the one with the
lowest estimate runs (ties: the earlier rank). No central table knows an implementation's
internals: adding one is registering it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .._backend import Array
from .spec import AttentionSpec

__all__ = [
    "Implementation",
    "register_implementation",
    "implementations",
    "registered",
    "auto_choice",
    "select",
    "cost_model",
    "modelled",
]


class Implementation(Protocol):
    """What an attention implementation provides (all arrays in the user's layout)."""

    def forward(
        self, spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
    ) -> tuple[Array, Array]: ...

    def backward(
        self,
        spec: AttentionSpec,
        query: Array,
        key: Array,
        value: Array,
        attn_mask: Array | None,
        out: Array,
        lse: Array,
        d_out: Array | None,
        d_lse: Array | None,
    ) -> tuple[Array, Array, Array, Array | None]: ...


@dataclass(frozen=True)
class Registered:
    """One registered implementation (see :func:`register_implementation`)."""

    impl: Any
    declines: Callable[[AttentionSpec], str | None]
    auto_rank: int | None
    auto_declines: Callable[[AttentionSpec], str | None] | None = None
    cost: Any = None  # a CostModel (estimate(spec) -> seconds), or None


_REGISTRY: dict[str, Registered] = {}


def register_implementation(
    name: str,
    impl: Any,
    declines: Callable[[AttentionSpec], str | None] = lambda spec: None,
    auto_rank: int | None = None,
    auto_declines: Callable[[AttentionSpec], str | None] | None = None,
    cost: Any = None,
) -> None:
    """Register an attention implementation under ``name``.

    ``impl`` provides ``forward(spec, query, key, value, attn_mask) -> (out, lse)`` and
    ``backward(spec, query, key, value, attn_mask, out, lse, d_out, d_lse) -> (dq, dk,
    dv, d_mask)`` (:class:`Implementation`). ``declines(spec)`` returns ``None`` when it
    can run the call, else a short reason (used for the error when the implementation is
    forced). ``auto_rank`` places it in ``implementation="auto"``'s order (lower first).
    ``auto_declines(spec)``, when given, is consulted only by ``"auto"``: a call it
    declines still runs when the implementation is named. ``cost``: an object whose
    ``estimate(spec)`` gives the call's estimated seconds (``"auto"`` runs the cheapest);
    without one, the implementation runs under ``"auto"`` only when it ranks first.

    Examples:
        >>> import arrayattn as aa
        >>> from arrayattn.attention import composed, registry
        >>> class Mine:
        ...     forward, backward = staticmethod(composed.forward), staticmethod(composed.backward)
        >>> aa.ops.register_implementation("mine", Mine())
        >>> "mine" in aa.implementations()
        True
        >>> del registry._REGISTRY["mine"]
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name must be a non-empty str other than 'auto', got {name!r}")
    missing = [m for m in ("forward", "backward") if not callable(getattr(impl, m, None))]
    if missing:
        raise TypeError(
            f"impl must provide forward and backward (see Implementation), got "
            f"{type(impl).__name__} without {', '.join(missing)}"
        )
    if cost is not None and not callable(getattr(cost, "estimate", None)):
        raise TypeError(f"cost must have an estimate(spec) method, got {type(cost).__name__}")
    _REGISTRY[name] = Registered(impl, declines, auto_rank, auto_declines, cost)


def implementations() -> tuple[str, ...]:
    """Names accepted by ``implementation=``: ``"auto"`` and every registered path
    (``"fused"`` is among them when CuPy is installed).

    Examples:
        >>> import arrayattn as aa
        >>> {"auto", "composed", "chunked"} <= set(aa.implementations())
        True
    """
    return ("auto",) + tuple(_REGISTRY)


def registered(name: str) -> Registered | None:
    """The registration of ``name``, or ``None``."""
    return _REGISTRY.get(name)


def cost_model(name: str) -> Any:
    """The cost model ``name`` registered (``None`` when it has none or is unknown)."""
    reg = _REGISTRY.get(name)
    return None if reg is None else reg.cost


def modelled() -> tuple[str, ...]:
    """The registered implementations with a cost model, in ``"auto"``'s order."""
    return tuple(n for n, _ in _ranked() if _REGISTRY[n].cost is not None)


def _ranked() -> list[tuple[str, Registered]]:
    return sorted(
        ((n, r) for n, r in _REGISTRY.items() if r.auto_rank is not None),
        key=lambda nr: nr[1].auto_rank,  # type: ignore[arg-type, return-value]
    )


def auto_choice(spec: AttentionSpec) -> str:
    """The name of the implementation ``"auto"`` runs for ``spec``: a registered path
    without a cost model (the CuPy kernels, the Dask path) when it ranks first and takes
    the call, else the cheapest by its own estimate among those with one that take it.
    When ``auto_declines`` leaves nothing, it is set aside (the last resort)."""
    for use_auto_declines in (True, False):
        candidates: list[str] = []
        for name, r in _ranked():
            if r.declines(spec) is not None:
                continue
            if use_auto_declines and r.auto_declines is not None:
                if r.auto_declines(spec) is not None:
                    continue
            if r.cost is None:
                if not candidates:
                    return name
                continue
            candidates.append(name)
        if candidates:
            return min(candidates, key=lambda n: _REGISTRY[n].cost.estimate(spec))
    raise ValueError("no registered attention implementation takes this call")


def select(spec: AttentionSpec, implementation: str) -> Any:
    """The implementation object that runs ``spec``: ``"auto"``'s choice, or the one
    named (``ValueError`` with its reason when it declines)."""
    if implementation == "auto":
        return _REGISTRY[auto_choice(spec)].impl
    reg = _REGISTRY.get(implementation)
    if reg is None:
        raise ValueError(
            f"implementation must be one of {implementations()}, got {implementation!r}"
        )
    reason = reg.declines(spec)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    return reg.impl
