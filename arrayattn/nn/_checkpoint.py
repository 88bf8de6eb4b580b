"""Moving checkpoint tensors (NumPy, torch, CuPy, JAX, ...) into a target library with
their own dtypes kept, or an explicit one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import array_api_compat

from .._backend import Array, resolve_namespace

__all__ = ["_to_namespace"]

Params = dict[str, Array]


def _to_namespace(arrays: Mapping[str, Any], xp: Any, device: Any, dtype: Any) -> Params:
    ns = resolve_namespace(xp)
    out: Params = {}
    for name, a in arrays.items():
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(
                f"state_dict[{name!r}] must be an array (NumPy, torch, ...), got {type(a).__name__}"
            )
        dt = _same_dtype(ns, a.dtype, name) if dtype is None else dtype
        out[name] = ns.asarray(_portable(a, ns), dtype=dt, device=device)
    return out


def _dtype_name(dtype: Any) -> str:
    # numpy/cupy/jax dtypes print as "float64", torch's as "torch.float64".
    return str(getattr(dtype, "name", None) or dtype).rsplit(".", 1)[-1]


def _same_dtype(ns: Any, dtype: Any, name: str) -> Any:
    """The target namespace's dtype with the same name as a checkpoint tensor's dtype
    (torch, NumPy, CuPy, JAX dtypes alike), so a float16 or float64 checkpoint keeps it."""
    dname = _dtype_name(dtype)
    target = getattr(ns, dname, None)
    if target is None or not ns.isdtype(target, "real floating"):
        raise TypeError(
            f"state_dict[{name!r}] has dtype {dtype}, which has no real floating counterpart "
            f"in the target library; pass dtype= to load() (e.g. float32)"
        )
    return target


def _portable(a: Any, ns: Any) -> Any:
    """``a`` in a form ``ns.asarray`` accepts: torch and CuPy tensors bound for another
    library go through host NumPy (torch's bfloat16 via float32)."""
    if array_api_compat.is_torch_array(a):
        a = a.detach()
        if array_api_compat.is_torch_namespace(ns):
            return a
        a = a.cpu()
        if _dtype_name(a.dtype) == "bfloat16":
            a = a.float()
        return a.numpy()
    if array_api_compat.is_cupy_array(a) and not array_api_compat.is_cupy_namespace(ns):
        return a.get()
    return a
