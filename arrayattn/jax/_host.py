"""The host path: the call's forward and backward run by NumPy (the multi-threaded fast
path) inside ``jax.pure_callback``, so that ``jax.jit`` compiles around them.

Under ``jax.vmap`` the callbacks receive every array with the vmapped axes in front
(``vmap_method="expand_dims"``: size 1 where an array is not mapped). arrayattn
broadcasts batch dims from the right, so each array's own dims are first padded with
ones to its full rank (``(*lead, Hq, L, E)`` for the query, ``(*lead,)`` for lengths,
``(*lead, Hq)`` for sinks), then the vmapped axes are broadcast to their common shape
(views, no copies): the vmapped axes become leading batch dims of one larger call. The
dropout hash still sees each slice's own batch index (``batch_ids``), so that
``vmap(f)(x)[i] == f(x[i])`` with dropout too. A structured call (block mask, mask_mod,
score_mod) runs one vmapped slice at a time instead (:func:`per_slice`): its block mask
is built for one slice's batch, its mask_mod sees that slice's batch indices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._backend import Array
from ..attention.spec import AttentionSpec
from . import _rule
from ._rule import Arrays, Call

__all__ = ["forward", "backward", "Layout", "per_slice"]

# Each argument's rank, as an offset from the per-slice batch rank len(lead).
_EXTRA_RANK = {
    "query": 3,
    "key": 3,
    "value": 3,
    "attn_mask": 3,
    "out": 3,
    "d_out": 3,
    "lse": 2,
    "d_lse": 2,
    "q_lengths": 0,
    "kv_lengths": 0,
    "sinks": 1,
    "alibi_slopes": 1,
}


class Layout:
    """The per-slice shapes of a call's arrays (as traced: without vmapped axes) and the
    conversion of the arrays a callback receives into arrays of one larger call.

    Examples:
        >>> import numpy as np
        >>> lay = Layout(lead_rank=1, shapes={"query": (2, 4, 8), "sinks": (2,)})
        >>> xs, batch = lay.to_host({"query": np.ones((5, 2, 4, 8)), "sinks": np.ones((1, 2))})
        >>> batch, xs["query"].shape, xs["sinks"].shape
        ((5,), (5, 1, 2, 4, 8), (5, 1, 2))
        >>> lay.from_host(np.ones((5, 1, 2, 4, 8)), (2, 4, 8), batch, np.float32).shape
        (5, 2, 4, 8)
    """

    def __init__(self, lead_rank: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.lead_rank = lead_rank
        self.shapes = shapes

    def _padded(self, name: str) -> tuple[int, ...]:
        shape = self.shapes[name]
        rank = self.lead_rank + _EXTRA_RANK[name]
        return (1,) * (rank - len(shape)) + shape

    def to_host(
        self, arrays: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
        """``(arrays of one larger call, the vmapped shape)``: each array padded to its
        full rank and its vmapped axes broadcast to the common vmapped shape (views)."""
        extra = {len(np.shape(x)) - len(self.shapes[n]) for n, x in arrays.items()}
        if len(extra) != 1:  # (vmap_method="expand_dims" gives every argument the axes)
            raise AssertionError(f"callback arguments with unequal vmapped ranks: {extra}")
        k = extra.pop()
        batch = tuple(np.broadcast_shapes(*(np.shape(x)[:k] for x in arrays.values())))
        out = {}
        for name, x in arrays.items():
            x = np.asarray(x)
            own = self._padded(name)
            out[name] = np.broadcast_to(np.reshape(x, x.shape[:k] + own), batch + own)
        return out, batch

    @staticmethod
    def from_host(x: Any, shape: tuple[int, ...], batch: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A result of the larger call back in the callback's shape ``batch + shape``."""
        return np.asarray(np.reshape(x, batch + shape), dtype=dtype)


def _batch_ids(call: Call, spec: AttentionSpec, batch: tuple[int, ...]) -> tuple[int, ...] | None:
    """With dropout under ``vmap``: each flat batch entry's index within its slice."""
    if call.dropout_p == 0.0 or not batch:
        return None
    per_slice = math.prod(spec.lead)
    return tuple(i % per_slice for i in range(math.prod(batch) * per_slice))


def _layout(spec: AttentionSpec, named: dict[str, Any]) -> Layout:
    return Layout(len(spec.lead), {n: tuple(x.shape) for n, x in named.items()})


def _given(arrays: Arrays) -> dict[str, Any]:
    return {n: x for n, x in arrays._asdict().items() if x is not None}


def _callback(
    run: Callable[..., Sequence[Any]],
    results: Sequence[jax.ShapeDtypeStruct],
    named: dict[str, Any],
) -> list[Array]:
    names = list(named)

    def host(*xs: Any) -> tuple[np.ndarray, ...]:
        return tuple(run(dict(zip(names, xs, strict=True))))

    return list(jax.pure_callback(host, tuple(results), *named.values(), vmap_method="expand_dims"))


def _param_names(params: tuple[Any, ...]) -> dict[str, Any]:
    return {f"score_param_{i}": p for i, p in enumerate(params)}


def _split(host: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, ...]]:
    params = tuple(x for n, x in host.items() if n.startswith("score_param_"))
    return {n: x for n, x in host.items() if not n.startswith("score_param_")}, params


def per_slice(
    run_one: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
    xs: dict[str, np.ndarray],
    shapes: dict[str, tuple[int, ...]],
    results: Sequence[jax.ShapeDtypeStruct],
) -> list[np.ndarray]:
    """A callback's arrays with vmapped axes in front (``vmap_method="expand_dims"``),
    run one vmapped slice at a time: what a structured call needs, whose mask_mod sees
    each slice's own batch indices and whose score_mod's table may differ per slice.
    Results stacked back to ``batch + shape``.

    Examples:
        >>> import jax, numpy as np
        >>> got = per_slice(lambda one: [one["x"] * 2], {"x": np.ones((3, 2))},
        ...                 {"x": (2,)}, [jax.ShapeDtypeStruct((2,), np.float32)])
        >>> got[0].shape
        (3, 2)
    """
    k = {len(np.shape(x)) - len(shapes[n]) for n, x in xs.items()}
    if len(k) != 1:  # (vmap_method="expand_dims" gives every argument the axes)
        raise AssertionError(f"callback arguments with unequal vmapped ranks: {k}")
    rank = k.pop()
    batch = tuple(np.broadcast_shapes(*(np.shape(x)[:rank] for x in xs.values())))
    full = {n: np.broadcast_to(np.asarray(x), batch + shapes[n]) for n, x in xs.items()}
    outs = [np.empty(batch + tuple(r.shape), r.dtype) for r in results]
    for idx in np.ndindex(*batch):
        got = run_one({n: x[idx] for n, x in full.items()})
        for o, g, r in zip(outs, got, results, strict=True):
            o[idx] = np.asarray(g, dtype=r.dtype)
    return outs


def forward(call: Call, arrays: Arrays, params: tuple[Array, ...] = ()) -> tuple[Array, Array]:
    """``(out, lse)`` of the call, computed by NumPy on the host (see the module)."""
    # validation and shapes, on the traced arrays
    spec = _rule.call_spec(call, arrays, params=params)
    named = _given(arrays) | _param_names(params)
    results = (
        jax.ShapeDtypeStruct(spec.out_shape, spec.dtype),
        jax.ShapeDtypeStruct(spec.lse_shape, spec.cdtype),
    )
    if call.flex:
        shapes = {n: tuple(x.shape) for n, x in named.items()}

        def one(xs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            host, ps = _split(xs)
            return _rule.forward(call, Arrays(**host), params=ps)

        def run_flex(xs: dict[str, np.ndarray]) -> list[np.ndarray]:
            return per_slice(one, xs, shapes, results)

        out, lse = _callback(run_flex, results, named)
        return out, lse
    layout = _layout(spec, named)

    def run(xs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        host, batch = layout.to_host(xs)
        out, lse = _rule.forward(call, Arrays(**host), _batch_ids(call, spec, batch))
        return (
            layout.from_host(out, spec.out_shape, batch, results[0].dtype),
            layout.from_host(lse, spec.lse_shape, batch, results[1].dtype),
        )

    out, lse = _callback(run, results, named)
    return out, lse


def backward(
    call: Call,
    arrays: Arrays,
    out: Array,
    lse: Array,
    d_out: Array,
    d_lse: Array | None,
    params: tuple[Array, ...] = (),
) -> tuple[Arrays, tuple[Array, ...]]:
    """The cotangents of ``arrays`` and of the score_mod's ``params``
    (:func:`arrayattn.jax._rule.backward`), computed by NumPy on the host."""
    spec = _rule.call_spec(call, arrays, params=params)
    grads_of = ["query", "key", "value"]
    if spec.mask_kind == "float":
        grads_of.append("attn_mask")
    if arrays.sinks is not None:
        grads_of.append("sinks")
    pnames = _param_names(params)
    grads_of += list(pnames)
    named = _given(arrays) | pnames | {"out": out, "lse": lse, "d_out": d_out}
    if d_lse is not None:
        named["d_lse"] = d_lse
    results = [jax.ShapeDtypeStruct(tuple(named[n].shape), named[n].dtype) for n in grads_of]
    if call.flex:
        shapes = {n: tuple(x.shape) for n, x in named.items()}

        def one(xs: dict[str, np.ndarray]) -> list[np.ndarray]:
            host, ps = _split(xs)
            inputs = Arrays(**{n: x for n, x in host.items() if n in Arrays._fields})
            grads, d_params = _rule.backward(
                call, inputs, host["out"], host["lse"], host["d_out"], host.get("d_lse"),
                params=ps,
            )  # fmt: skip
            by_name = grads._asdict() | _param_names(d_params)
            return [by_name[n] for n in grads_of]

        def run_flex(xs: dict[str, np.ndarray]) -> list[np.ndarray]:
            return per_slice(one, xs, shapes, results)

        got = dict(zip(grads_of, _callback(run_flex, results, named), strict=True))
        return _collect(got), tuple(got[n] for n in pnames)
    layout = _layout(spec, named)

    def run(xs: dict[str, np.ndarray]) -> list[np.ndarray]:
        host, batch = layout.to_host(xs)
        inputs = Arrays(**{n: x for n, x in host.items() if n in Arrays._fields})
        grads, _ = _rule.backward(
            call,
            inputs,
            host["out"],
            host["lse"],
            host["d_out"],
            host.get("d_lse"),
            _batch_ids(call, spec, batch),
        )
        return [
            layout.from_host(getattr(grads, n), layout.shapes[n], batch, r.dtype)
            for n, r in zip(grads_of, results, strict=True)
        ]

    got = dict(zip(grads_of, _callback(run, results, named), strict=True))
    return _collect(got), ()


def _collect(got: dict[str, Any]) -> Arrays:
    return Arrays(
        got["query"], got["key"], got["value"], got.get("attn_mask"), None, None,
        got.get("sinks"), None,
    )  # fmt: skip
