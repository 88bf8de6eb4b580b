"""Left padding <-> right padding: a rotation of each row (a permutation, so its
pullback is the inverse rotation)."""

from __future__ import annotations

from .._backend import Array, namespace_of

__all__ = ["_roll_rows"]


def _roll_rows(x: Array, shifts: tuple[int, ...], axis: int = -2) -> Array:
    """Row ``b`` of ``x`` rotated left by ``shifts[b]`` along ``axis`` (a permutation per
    row: left padding <-> right padding)."""
    xp = namespace_of(x=x)
    n = int(x.shape[axis])
    ax = axis % x.ndim
    rows = []
    for b, s in enumerate(shifts):
        row = x[b : b + 1, ...]
        s = s % n if n else 0
        if s:
            head = tuple(slice(None) if d != ax else slice(s, None) for d in range(x.ndim))
            tail = tuple(slice(None) if d != ax else slice(0, s) for d in range(x.ndim))
            row = xp.concat((row[head], row[tail]), axis=ax)
        rows.append(row)
    return xp.concat(rows, axis=0)
