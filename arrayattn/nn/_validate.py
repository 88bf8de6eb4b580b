"""Checks of scalar configuration and call arguments: each error names the argument,
the value seen (with its type) and what is expected."""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, overload

__all__ = ["_count", "_real", "_flag"]


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


@overload
def _real(name: str, value: Any, *, optional: Literal[False] = False) -> float: ...
@overload
def _real(name: str, value: Any, *, optional: bool) -> float | None: ...
def _real(name: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        want = "a real number" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _flag(name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        want = "a bool" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
