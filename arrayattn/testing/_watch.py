"""The input-mutation check: every array the kit hands a function (query, key, value,
mask, lengths, sinks, slopes) is copied when handed out and compared after the call, so
a function that writes into its inputs fails, naming the argument it changed.

Adapters build their arrays through :meth:`AttentionCall.arrays` and
:meth:`AttentionCall.kwargs`; a :class:`WatchedCall` records what those return, whatever
the adapter then does with them (transposed views share the memory, so a write through
one is seen too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._calls import AttentionCall
from .oracles import to_numpy

__all__ = ["WatchedCall", "watch"]

ARRAY_NAMES = ("query", "key", "value", "attn_mask")
ARRAY_OPTIONS = ("q_lengths", "kv_lengths", "sinks", "alibi_slopes")


@dataclass(frozen=True)
class HandedOut:
    """One array given to the function: its argument name, the array, and a copy of its
    values when it was handed out."""

    name: str
    array: Any
    before: np.ndarray


@dataclass(frozen=True, eq=False)
class WatchedCall(AttentionCall):
    """An :class:`AttentionCall` that remembers the arrays it hands out, so that
    :meth:`assert_unchanged` can compare them with their values at the time.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing._calls import AttentionCall
        >>> from arrayattn.testing._watch import watch
        >>> call = watch(AttentionCall(np.ones((1, 1, 2, 4)), np.ones((1, 1, 3, 4)),
        ...                            np.ones((1, 1, 3, 4))))
        >>> q, k, v, mask = call.arrays()
        >>> q[0, 0, 0, 0] = 5.0  # a function writing into its query
        >>> call.assert_unchanged()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: inputs: the function wrote into its query argument ...
    """

    handed_out: list[HandedOut] = field(default_factory=list, repr=False)

    def arrays(self, backend: Any = None) -> tuple[Any, Any, Any, Any]:
        arrays = super().arrays(backend)
        self._remember(zip(ARRAY_NAMES, arrays, strict=True))
        return arrays

    def kwargs(self, backend: Any = None) -> dict[str, Any]:
        out = super().kwargs(backend)
        self._remember((name, out.get(name)) for name in ARRAY_OPTIONS)
        return out

    def _remember(self, named: Iterable[tuple[str, Any]]) -> None:
        for name, array in named:
            if array is not None:
                # np.array copies: to_numpy may return a view of the array itself.
                self.handed_out.append(HandedOut(name, array, np.array(to_numpy(array))))

    def assert_unchanged(self) -> None:
        """Raise ``AssertionError`` naming the first argument whose values (or shape)
        differ from when it was handed out; inputs must never be modified."""
        for item in self.handed_out:
            change = _first_change(item.before, np.asarray(to_numpy(item.array)))
            if change:
                raise AssertionError(
                    f"inputs: the function wrote into its {item.name} argument ({change}); "
                    "inputs must be left unchanged"
                )


def watch(call: AttentionCall) -> WatchedCall:
    """A :class:`WatchedCall` with ``call``'s data (``call`` itself is left as it is).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing._calls import AttentionCall
        >>> from arrayattn.testing._watch import watch
        >>> call = watch(AttentionCall(np.ones((1, 1, 2, 4)), np.ones((1, 1, 3, 4)),
        ...                            np.ones((1, 1, 3, 4))))
        >>> q, k, v, mask = call.arrays()
        >>> call.assert_unchanged()  # nothing written: nothing raised
        >>> [h.name for h in call.handed_out]
        ['query', 'key', 'value']
    """
    fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(AttentionCall)}
    return WatchedCall(**fields)


def _first_change(before: np.ndarray, after: np.ndarray) -> str:
    """How ``after`` differs from ``before`` (``""`` when it does not): the shape, or
    the count of changed entries and the first one."""
    if before.shape != after.shape:
        return f"shape {before.shape} became {after.shape}"
    same = before == after
    if before.dtype.kind in "fc":  # NaN where NaN was is unchanged
        same |= np.isnan(before) & np.isnan(after)
    if same.all():
        return ""
    changed = ~same
    idx = tuple(int(i) for i in np.argwhere(changed)[0])
    return (
        f"{int(changed.sum())} of {changed.size} entries changed, first at index {idx}: "
        f"{before[idx].item()!r} became {after[idx].item()!r}"
    )
