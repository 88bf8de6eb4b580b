"""Structural attention masks (causal alignments and sliding windows) built from indices.

No ``L x S`` mask is ever passed around for these: every implementation asks
:func:`structural_allowed` for the block of rows and columns it is working on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._backend import Array, Namespace

__all__ = ["Structure", "structural_allowed", "parse_window", "CAUSAL_ALIGNMENTS"]

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def parse_window(window: object) -> tuple[int, int] | None:
    """Validate ``window=(left, right)``: two ints ``>= -1``; ``-1`` means unbounded."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right) of ints >= -1, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window, strict=True):
        if isinstance(w, bool):  # operator.index(True) would pass as 1
            raise TypeError(f"window {side} must be an int >= -1, got bool")
        if not isinstance(w, int):
            try:
                import operator

                w = operator.index(w)
            except TypeError:
                raise TypeError(
                    f"window {side} must be an int >= -1, got {type(w).__name__}"
                ) from None
        if w < -1:
            raise ValueError(f"window {side} must be >= -1 (-1 = unbounded), got {w}")
        out.append(int(w))
    return out[0], out[1]


@dataclass(frozen=True)
class Structure:
    """Which keys each query may see, before any user mask.

    Query ``i`` sits on the aligned diagonal at key ``i + offset`` where ``offset`` is 0
    for top-left alignment and ``S - L`` for bottom-right. It sees key ``j`` when
    ``i + offset - left <= j <= i + offset + right``, a bound of ``-1`` being absent.
    ``is_causal`` contributes ``right = 0``; a window contributes its own bounds; both
    together intersect.
    """

    offset: int
    left: int  # -1: unbounded
    right: int  # -1: unbounded

    @staticmethod
    def build(
        L: int, S: int, is_causal: bool, causal_align: str, window: tuple[int, int] | None
    ) -> Structure:
        offset = 0 if causal_align == "top_left" else S - L
        left, right = -1, -1
        if window is not None:
            # A bound of L + S or more excludes no key for any diagonal offset in
            # [-L, S] (per-sequence offsets included): it is unbounded, and must not
            # reach int32 index arithmetic (2**31 overflowed there).
            left, right = (-1 if w >= L + S else w for w in window)
        if is_causal:
            right = 0 if right == -1 else min(right, 0)
        return Structure(offset, left, right)

    @property
    def is_trivial(self) -> bool:
        """True when every query sees every key."""
        return self.left < 0 and self.right < 0

    def excludes_nothing(self, L: int, S: int) -> bool:
        """True when every query of ``L`` sees every key of ``S`` (no key is excluded,
        e.g. bottom-right causal decoding with ``L = 1``)."""
        left_ok = self.left < 0 or (L - 1) + self.offset - self.left <= 0
        right_ok = self.right < 0 or self.offset + self.right >= S - 1
        return left_ok and right_ok

    def col_range(
        self,
        row_start: int,
        row_stop: int,
        S: int,
        offset_bounds: tuple[int, int] | None = None,
    ) -> tuple[int, int]:
        """The half-open range of keys that rows ``[row_start, row_stop)`` can touch.

        Used by blocked implementations to skip key blocks nobody in a query block sees.
        The range may be empty (``start >= stop``). ``offset_bounds=(lo, hi)`` replaces
        the diagonal offset by any value in ``[lo, hi]`` (per-sequence offsets that are
        data, see ``q_lengths``/``kv_lengths``): the range then covers all of them."""
        off_lo, off_hi = (self.offset, self.offset) if offset_bounds is None else offset_bounds
        lo = 0 if self.left < 0 else max(0, row_start + off_lo - self.left)
        hi = S if self.right < 0 else min(S, row_stop - 1 + off_hi + self.right + 1)
        return lo, max(lo, hi)


def structural_allowed(
    xp: Namespace,
    structure: Structure,
    rows: Array,
    cols: Array,
    offset: Array | None = None,
) -> Array | None:
    """Boolean ``rows x cols`` "may attend" array for int index arrays ``rows`` (shape
    ``(l, 1)``) and ``cols`` (shape ``(s,)``), or ``None`` when nothing is masked.

    ``offset``, when given, is an int array replacing ``structure.offset`` (per-sequence
    diagonals, shaped to broadcast against ``rows``, e.g. ``(*batch, 1, 1, 1, 1)``)."""
    if structure.is_trivial:
        return None
    diag = rows + (structure.offset if offset is None else offset)
    allowed = None
    if structure.left >= 0:
        allowed = cols >= diag - structure.left
    if structure.right >= 0:
        upper = cols <= diag + structure.right
        allowed = upper if allowed is None else xp.logical_and(allowed, upper)
    return allowed
