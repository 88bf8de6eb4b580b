"""``MultiHeadAttention``'s parameters: fresh ones, a checkpoint's, and the check that a
dict fits the configuration."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import array_api_compat

from ..._backend import Array, resolve_namespace
from .._checkpoint import _dtype_name, _to_namespace
from .._validate import _flag
from .config import AttentionConfig

__all__ = ["Params", "init_params", "load_params", "check_params"]

Params = dict[str, Array]


class _HasParamShapes(Protocol):
    """What loading and checking read of a configuration: the nn layers pass themselves."""

    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...


def init_params(
    cfg: AttentionConfig, *, seed: int, xp: Any = None, device: Any = None, dtype: Any = None
) -> Params:
    """Fresh parameters (:meth:`MultiHeadAttention.init`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    host: dict[str, Any] = {}
    shapes = cfg.param_shapes()
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            host[name] = np.ones(shape)
        elif name.endswith("norm.bias") or name == "sinks":
            host[name] = np.zeros(shape)
        else:
            fan_in = shapes[name.rsplit(".", 1)[0] + ".weight"][1]
            bound = 1.0 / math.sqrt(fan_in)
            host[name] = rng.uniform(-bound, bound, size=shape)
    ns = resolve_namespace(xp)
    return _to_namespace(host, ns, device, ns.float32 if dtype is None else dtype)


def load_params(
    cfg: _HasParamShapes,
    state_dict: Mapping[str, Any],
    *,
    prefix: str = "",
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
    strict: bool = True,
    check_finite: bool = True,
) -> Params:
    """This layer's tensors from a checkpoint dict (:meth:`MultiHeadAttention.load`):
    names matched, each tensor's dtype a real floating one, shapes checked, and (with
    ``check_finite``) no NaN or Inf in what is loaded."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to arrays, got {type(state_dict).__name__}"
        )
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__} {prefix!r}")
    if rename is not None and not (isinstance(rename, Mapping) or callable(rename)):
        raise TypeError(
            f"rename must be a mapping, a callable or None, got {type(rename).__name__}"
        )
    _flag("strict", strict)
    _flag("check_finite", check_finite)
    expected = cfg.param_shapes()
    found: dict[str, tuple[str, Any]] = {}
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if rename is not None:
            renamed = rename.get(name, name) if isinstance(rename, Mapping) else rename(name)
            if renamed is None:
                continue
            name = renamed
        if name in found:
            raise ValueError(
                f"state_dict names {found[name][0]!r} and {key!r} both map to {name!r}"
            )
        found[name] = (key, tensor)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(found[n][0] for n in set(found) - set(expected))
    if missing or (strict and unexpected):
        raise KeyError(
            f"state_dict does not fit this configuration: missing {missing} (names after "
            f"prefix {prefix!r} and rename), unexpected {unexpected}"
            + (" (strict=False ignores unexpected names)" if unexpected else "")
        )
    for name in expected:
        key, tensor = found[name]
        kind = _dtype_name(getattr(tensor, "dtype", None))
        if hasattr(tensor, "shape") and kind not in _FLOAT_NAMES:
            raise TypeError(
                f"state_dict[{key!r}] (parameter {name!r}) has dtype {kind}, expected a real "
                f"floating dtype ({', '.join(_FLOAT_NAMES)}): a parameter is never an "
                f"integer, bool or complex tensor"
            )
    params = _to_namespace({n: found[n][1] for n in expected}, xp, device, dtype)
    check_params(cfg, params)
    if check_finite:
        ns = resolve_namespace(xp)
        for name, a in params.items():
            if not bool(ns.all(ns.isfinite(a))):
                cast = "" if dtype is None else f" after the cast to {_dtype_name(a.dtype)}"
                raise ValueError(
                    f"state_dict[{found[name][0]!r}] (parameter {name!r}) holds non-finite "
                    f"values (NaN or Inf){cast}: the checkpoint is corrupt or its training "
                    f"diverged (check_finite=False loads it anyway)"
                )
    return params


_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def check_params(cfg: _HasParamShapes, params: Mapping[str, Array]) -> None:
    """Raise when ``params`` does not fit (:meth:`MultiHeadAttention.check_params`)."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping of parameter names to arrays (see param_shapes()), "
            f"got {type(params).__name__} {params!r:.60}"
        )
    expected = cfg.param_shapes()
    if set(params) != set(expected):
        missing = sorted(set(expected) - set(params))
        extra = sorted(set(params) - set(expected), key=str)
        raise KeyError(
            f"params must have exactly the names {sorted(expected)}; missing {missing}, "
            f"unexpected {extra}"
        )
    for name, shape in expected.items():
        a = params[name]
        if not array_api_compat.is_array_api_obj(a):
            raise TypeError(
                f"params[{name!r}] must be an array, got {type(a).__name__}; convert it "
                f"with xp.asarray"
            )
        got = tuple(int(d) for d in a.shape)
        if got != shape:
            raise ValueError(f"params[{name!r}] has shape {got}, expected {shape}")
