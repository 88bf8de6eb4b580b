"""Which arrays a ``mask_mod`` or ``score_mod`` holds: the framework bridges ask, so that
a call runs on the library those arrays live in (or says clearly that it cannot).

A mask_mod or score_mod captures arrays (document ids, a bias table, ALiBi slopes) as
attributes of the built-ins, in a function's closure or in the module-level names it
reads; the search looks at all three, a few
levels deep (functions calling functions, combinations of masks), never calling
anything.
"""

from __future__ import annotations

import types
from typing import Any

import array_api_compat

from .._backend import library_name

__all__ = ["held_arrays", "held_libraries"]

_DEPTH = 5
_SKIP = frozenset({"_host"})


def held_arrays(obj: Any, exclude: tuple[Any, ...] = ()) -> list[Any]:
    """The arrays ``obj`` (a mask_mod, a score_mod, a function) holds in its attributes
    and closures, each once, in the order found; ``exclude``: arrays left out (a
    score_mod's own params, which the bridges rebind).

    Examples:
        >>> import numpy as np
        >>> ids = np.zeros(4, np.int64)
        >>> len(held_arrays(lambda b, h, q, kv: ids[q] == ids[kv]))
        1
    """
    found: list[Any] = []
    seen: set[int] = {id(x) for x in exclude}
    _walk(obj, found, seen, _DEPTH)
    return found


def held_libraries(obj: Any, exclude: tuple[Any, ...] = ()) -> set[str]:
    """The libraries (``"numpy"``, ``"torch"``, ``"jax"``, ...) of :func:`held_arrays`.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.flex import document_mask
        >>> held_libraries(document_mask(np.zeros(4, np.int64)))
        {'numpy'}
    """
    libs = set()
    for x in held_arrays(obj, exclude):
        try:
            libs.add(library_name(array_api_compat.array_namespace(x)))
        except TypeError:
            libs.add(type(x).__module__.split(".")[0])
    return libs


def _walk(obj: Any, found: list[Any], seen: set[int], depth: int) -> None:
    if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, type)):
        return
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if array_api_compat.is_array_api_obj(obj) and hasattr(obj, "shape"):
        found.append(obj)
        return
    children: list[Any] = []
    if isinstance(obj, (tuple, list, set, frozenset)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, types.FunctionType):
        children = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        children += list(obj.__defaults__ or ())
        # Module-level names it reads (a FlexAttention habit: a global doc_ids tensor).
        glob = obj.__globals__
        children += [glob[n] for n in obj.__code__.co_names if n in glob]
    elif isinstance(obj, types.MethodType):
        children = [obj.__self__, obj.__func__]
    elif isinstance(obj, types.ModuleType):
        return
    elif hasattr(obj, "__dict__") and callable(obj):
        # (``_host``: the built-in masks' NumPy copies of what they hold, for the fast path)
        children = [v for k, v in vars(obj).items() if k not in _SKIP and not k.startswith("__")]
    for child in children:
        _walk(child, found, seen, depth - 1)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a name not yet bound)
        return False
    return True
