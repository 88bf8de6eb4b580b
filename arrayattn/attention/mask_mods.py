"""Built-in ``mask_mod`` functions (FlexAttention's vocabulary) and their combinators.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says which (query, key) pairs take part
(``True``), written with array-API operations on broadcasting int32 index arrays: ``b``
(flat batch index), ``h`` (query head), ``q_idx`` (query rows, a column) and ``kv_idx``
(keys, a row). Any function of that form is a mask_mod; the built-ins here are also
objects that classify whole blocks from their index ranges
(:meth:`MaskMod.block_kinds`), so that :func:`~arrayattn.attention.block_mask.create_block_mask`
builds a block mask without evaluating them pair by pair. A plain function is classified
by evaluation, block by block.

Query and key indices are positions within the call (``0..L-1``, ``0..S-1``): the
``causal_align`` option does not shift them (``SEMANTICS.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._backend import Array, array_namespace, device, is_numpy

__all__ = [
    "MaskMod",
    "MaskModFn",
    "and_masks",
    "or_masks",
    "noop_mask",
    "causal_mask",
    "causal",
    "sliding_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "global_tokens_mask",
]

MaskModFn = Callable[[Array, Array, Array, Array], Array]
"""``mask_mod(b, h, q_idx, kv_idx) -> bool array`` broadcasting over its arguments."""


class BlockRanges:
    """Index ranges of a grid of blocks, as NumPy int64 arrays shaped to broadcast to
    ``(B, H, nq, nk)``: query blocks ``[q0, q1)`` (shape ``(nq, 1)``), key blocks
    ``[k0, k1)`` (shape ``(nk,)``), batches ``b`` (shape ``(B, 1, 1, 1)``) and heads ``h``
    (shape ``(H, 1, 1)``)."""

    def __init__(self, B: int, H: int, q_edges: np.ndarray, k_edges: np.ndarray) -> None:
        self.B, self.H = B, H
        self.q0 = q_edges[:-1, None]
        self.q1 = q_edges[1:, None]
        self.k0 = k_edges[:-1]
        self.k1 = k_edges[1:]
        self.b = np.arange(B).reshape(B, 1, 1, 1)
        self.h = np.arange(H).reshape(H, 1, 1)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.H, self.q0.shape[0], self.k0.shape[0])


class MaskMod:
    """A mask_mod that also knows, from index ranges alone, which blocks it leaves empty
    and which it leaves full. Subclasses define ``__call__`` (the elementwise mask) and
    :meth:`block_kinds`; a block said to be neither is evaluated pair by pair, so a
    conservative answer is always correct (only slower)."""

    name = "mask_mod"

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        raise NotImplementedError

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        """``(any, all)``: bool NumPy arrays broadcastable to ``r.shape``; ``any`` False
        means no pair of the block takes part (may be True when unsure), ``all`` True
        means every pair does (may be False when unsure)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class _Fn(MaskMod):
    """A plain function, classified by evaluation (``block_kinds`` is never asked)."""

    def __init__(self, fn: MaskModFn) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "mask_mod")

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return self.fn(b, h, q_idx, kv_idx)


def as_mask_mod(fn: Any) -> MaskMod:
    """``fn`` as a :class:`MaskMod` (built-ins as they are, functions wrapped)."""
    if isinstance(fn, MaskMod):
        return fn
    if not callable(fn):
        raise TypeError(
            f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got {type(fn).__name__}"
        )
    return _Fn(fn)


def classifiable(mod: MaskMod) -> bool:
    """True when ``mod`` classifies blocks from ranges alone (no evaluation needed)."""
    if isinstance(mod, _Combined):
        return all(classifiable(m) for m in mod.mods)
    return not isinstance(mod, _Fn)


class _Combined(MaskMod):
    def __init__(self, mods: tuple[Any, ...], op: str) -> None:
        if not mods:
            raise ValueError(f"{op}_masks needs at least one mask_mod, got none")
        self.mods = tuple(as_mask_mod(m) for m in mods)
        self.op = op
        self.name = f"{op}_masks({', '.join(m.name for m in self.mods)})"

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        out = None
        for m in self.mods:
            r = m(b, h, q_idx, kv_idx)
            if out is None:
                out = r
            else:
                xp = array_namespace(out, r)
                out = xp.logical_and(out, r) if self.op == "and" else xp.logical_or(out, r)
        return out

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        # AND: empty if any part is empty (exact for "all", an upper bound for "any");
        # OR: full if any part is full (exact for "any", a lower bound for "all").
        kinds = [m.block_kinds(r) for m in self.mods]
        any_, all_ = kinds[0]
        for a, f in kinds[1:]:
            if self.op == "and":
                any_, all_ = any_ & a, all_ & f
            else:
                any_, all_ = any_ | a, all_ | f
        return any_, all_


def and_masks(*mask_mods: Any) -> MaskMod:
    """A mask_mod that keeps a pair when every one of ``mask_mods`` keeps it
    (FlexAttention's ``and_masks``).

    Examples:
        >>> import numpy as np
        >>> m = and_masks(causal_mask, sliding_window_mask(2))
        >>> q, kv = np.arange(5).reshape(5, 1), np.arange(5)
        >>> m(0, 0, q, kv).astype(int)[4]
        array([0, 0, 1, 1, 1])
    """
    return _Combined(mask_mods, "and")


def or_masks(*mask_mods: Any) -> MaskMod:
    """A mask_mod that keeps a pair when any one of ``mask_mods`` keeps it
    (FlexAttention's ``or_masks``).

    Examples:
        >>> import numpy as np
        >>> m = or_masks(sliding_window_mask(1), global_tokens_mask(1))
        >>> q, kv = np.arange(4).reshape(4, 1), np.arange(4)
        >>> m(0, 0, q, kv).astype(int)[3]
        array([1, 0, 1, 1])
    """
    return _Combined(mask_mods, "or")


def _ones_like_pairs(q_idx: Array, kv_idx: Array) -> Array:
    xp = array_namespace(q_idx, kv_idx)
    return xp.logical_and(q_idx >= 0, kv_idx >= 0)


class _Noop(MaskMod):
    name = "noop_mask"

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return _ones_like_pairs(q_idx, kv_idx)

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        ones = np.ones((1, 1, 1, 1), bool)
        return ones, ones


noop_mask: MaskMod = _Noop()
"""Every pair takes part (FlexAttention's ``noop_mask``)."""


class _Window(MaskMod):
    """``q_idx + offset - left <= kv_idx <= q_idx + offset + right`` (``-1``: unbounded)."""

    def __init__(self, left: int, right: int, offset: int, name: str) -> None:
        for nm, v in (("left", left), ("right", right), ("offset", offset)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{nm} must be an int, got {type(v).__name__}")
        if left < -1 or right < -1:
            raise ValueError(f"window bounds must be >= -1 (-1 = unbounded), got ({left}, {right})")
        self.left, self.right, self.offset = int(left), int(right), int(offset)
        self.name = name

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        xp = array_namespace(q_idx, kv_idx)
        diag = q_idx + self.offset
        out = None
        if self.left >= 0:
            out = kv_idx >= diag - self.left
        if self.right >= 0:
            upper = kv_idx <= diag + self.right
            out = upper if out is None else xp.logical_and(out, upper)
        return _ones_like_pairs(q_idx, kv_idx) if out is None else out

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        big = np.iinfo(np.int64).max // 4
        left = big if self.left < 0 else self.left
        right = big if self.right < 0 else self.right
        d0, d1 = r.q0 + self.offset, r.q1 - 1 + self.offset  # first and last diagonal
        any_ = (r.k0 <= d1 + right) & (r.k1 - 1 >= d0 - left)
        all_ = (r.k0 >= d1 - left) & (r.k1 - 1 <= d0 + right)
        return any_[None, None], all_[None, None]


def causal(offset: int = 0) -> MaskMod:
    """Causal mask_mod ``kv_idx <= q_idx + offset``: ``offset=0`` is PyTorch's top-left
    causal, ``offset=S - L`` the bottom-right (KV cache) one.

    Examples:
        >>> import numpy as np
        >>> causal(1)(0, 0, np.arange(3).reshape(3, 1), np.arange(3)).astype(int)
        array([[1, 1, 0],
               [1, 1, 1],
               [1, 1, 1]])
    """
    return _Window(-1, 0, offset, "causal_mask" if offset == 0 else f"causal({offset})")


causal_mask: MaskMod = causal(0)
"""``q_idx >= kv_idx`` (FlexAttention's ``causal_mask``, PyTorch's top-left causal)."""


def sliding_window_mask(left: int, right: int = 0, *, offset: int = 0) -> MaskMod:
    """Sliding window ``q_idx + offset - left <= kv_idx <= q_idx + offset + right``,
    inclusive, ``-1`` unbounded (FlashAttention's ``window_size`` convention; the default
    ``right=0`` is causal). Hugging Face's "W keys including itself" is ``left=W - 1``.

    Examples:
        >>> import numpy as np
        >>> sliding_window_mask(1)(0, 0, np.arange(4).reshape(4, 1), np.arange(4)).astype(int)
        array([[1, 0, 0, 0],
               [1, 1, 0, 0],
               [0, 1, 1, 0],
               [0, 0, 1, 1]])
    """
    return _Window(left, right, offset, f"sliding_window_mask({left}, {right})")


def _like_index(ids: Array, idx: Any) -> Array:
    """``ids`` in the library of the index arrays ``idx``: NumPy ids a built-in holds
    move to the library the indices come from (JAX's traced indices on a GPU, PyTorch's),
    so a built-in mask built on NumPy runs on every path; ids of any other library stay
    as they are (a mismatch there is the caller's, reported by the bridges)."""
    if not hasattr(idx, "shape") or not is_numpy(array_namespace(ids)):
        return ids
    xi = array_namespace(idx)
    return ids if is_numpy(xi) else xi.asarray(ids, device=device(idx))


def _take_rows(ids: Array, b: Any, idx: Any) -> Array:
    """``ids[b, idx]`` for per-token ids ``(B, N)`` (or ``(N,)``, shared by the batch)
    and broadcasting int index arrays, with array-API operations only (a flat ``take``)."""
    ids = _like_index(ids, idx)
    xp = array_namespace(ids)
    n = ids.shape[-1]
    idx = xp.asarray(idx, dtype=xp.int64, device=device(ids))
    if ids.ndim == 1:
        flat_idx = idx
    else:
        bb = xp.asarray(b, dtype=xp.int64, device=device(ids))
        flat_idx = bb * n + idx
    shape = flat_idx.shape
    out = xp.take(xp.reshape(ids, (-1,)), xp.reshape(flat_idx, (-1,)), axis=0)
    return xp.reshape(out, shape)


def _host_ints(x: Array) -> np.ndarray:
    from .._backend import to_host_numpy

    return to_host_numpy(x).astype(np.int64, copy=False)


def _check_ids(name: str, ids: Any) -> Array:
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
        raise TypeError(
            f"{name} must be an integer array of shape (B, N) or (N,), got {type(ids).__name__}"
        )
    xp = array_namespace(ids)
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
    if ids.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape (B, N) or (N,), got {tuple(ids.shape)}")
    return ids


def _block_minmax(host: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block ``[edges[i], edges[i+1])`` min and max of ``host`` (..., N) -> (..., n)."""
    starts = edges[:-1]
    lo = np.minimum.reduceat(host, starts, axis=-1)
    hi = np.maximum.reduceat(host, starts, axis=-1)
    return lo, hi


class _Document(MaskMod):
    def __init__(self, q_ids: Array, kv_ids: Array | None, causal_: bool) -> None:
        self.q_ids = _check_ids("document_ids", q_ids)
        self.kv_ids = self.q_ids if kv_ids is None else _check_ids("kv_document_ids", kv_ids)
        self.causal = bool(causal_)
        self._host = (_host_ints(self.q_ids), _host_ints(self.kv_ids))
        self.name = f"document_mask(causal={self.causal})"

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        xp = array_namespace(self.q_ids)
        same = _take_rows(self.q_ids, b, q_idx) == _take_rows(self.kv_ids, b, kv_idx)
        if self.causal:
            same = xp.logical_and(same, xp.asarray(kv_idx <= q_idx))
        return same

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        qh, kh = self._host
        qe = np.concatenate([r.q0[:, 0], r.q1[-1:, 0]])
        ke = np.concatenate([r.k0, r.k1[-1:]])
        if qe[-1] > qh.shape[-1] or ke[-1] > kh.shape[-1]:
            raise ValueError(
                f"document ids cover {qh.shape[-1]} queries and {kh.shape[-1]} keys, "
                f"the call has L = {qe[-1]} and S = {ke[-1]}"
            )
        qlo, qhi = _block_minmax(qh, qe)  # (B?, nq)
        klo, khi = _block_minmax(kh, ke)  # (B?, nk)
        qlo, qhi = qlo[..., :, None], qhi[..., :, None]
        klo, khi = klo[..., None, :], khi[..., None, :]
        # Documents are contiguous runs in packed batches; for other layouts this is a
        # bound ("maybe"), which stays correct.
        any_ = (qlo <= khi) & (klo <= qhi)
        all_ = (qlo == qhi) & (klo == khi) & (qlo == klo)
        any_ = any_.reshape((-1, 1) + any_.shape[-2:])
        all_ = all_.reshape((-1, 1) + all_.shape[-2:])
        if self.causal:
            c_any, c_all = causal_mask.block_kinds(r)
            any_, all_ = any_ & c_any, all_ & c_all
        return any_, all_


def document_mask(
    document_ids: Array, kv_document_ids: Array | None = None, *, causal: bool = False
) -> MaskMod:
    """Document masking for packed batches: query ``i`` sees key ``j`` when they belong to
    the same document, ``document_ids[b, i] == kv_document_ids[b, j]`` (ids shaped
    ``(B, L)``/``(B, S)``, or ``(L,)``/``(S,)`` shared by the batch; ``kv_document_ids``
    defaults to ``document_ids`` for self-attention), and with ``causal=True`` also
    ``j <= i``. Documents should be contiguous runs of tokens (then empty and full
    blocks are found exactly from each block's smallest and largest id).

    Examples:
        >>> import numpy as np
        >>> ids = np.array([0, 0, 1, 1, 1])
        >>> m = document_mask(ids, causal=True)
        >>> m(0, 0, np.arange(5).reshape(5, 1), np.arange(5)).astype(int)[3]
        array([0, 0, 1, 1, 0])
    """
    return _Document(document_ids, kv_document_ids, causal)


class _PrefixLM(MaskMod):
    def __init__(self, prefix_lengths: Any) -> None:
        if isinstance(prefix_lengths, (int, np.integer)) and not isinstance(prefix_lengths, bool):
            self.per_batch = None
            self.value: int | None = int(prefix_lengths)
            self._host = np.asarray([self.value], np.int64)
        else:
            ids = _check_ids("prefix_lengths", prefix_lengths)
            if ids.ndim != 1:
                raise ValueError(
                    f"prefix_lengths must be an int or an integer array of shape (B,), got "
                    f"{tuple(ids.shape)}"
                )
            self.per_batch = ids
            self.value = None
            self._host = _host_ints(ids)
        self.name = "prefix_lm_mask"

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        xp = array_namespace(q_idx, kv_idx)
        if self.per_batch is None:
            prefix = kv_idx < self.value
        else:
            bb = xp.asarray(b, dtype=xp.int64)
            per_batch = _like_index(self.per_batch, kv_idx)
            p = xp.take(xp.astype(per_batch, xp.int64), xp.reshape(bb, (-1,)), axis=0)
            prefix = kv_idx < xp.reshape(p, bb.shape)
        return xp.logical_or(prefix, kv_idx <= q_idx)

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        p = self._host.reshape(-1, 1, 1, 1)
        any_ = (r.k0 < p) | (r.k0 <= r.q1 - 1)
        all_ = (r.k1 - 1 < p) | (r.k1 - 1 <= r.q0)
        return any_, all_


def prefix_lm_mask(prefix_lengths: Any) -> MaskMod:
    """Prefix-LM: every query sees the first ``prefix_lengths[b]`` keys (bidirectional)
    and, after them, keys ``j <= i`` (causal). ``prefix_lengths`` is an int or an
    integer array ``(B,)``.

    Examples:
        >>> import numpy as np
        >>> prefix_lm_mask(2)(0, 0, np.arange(4).reshape(4, 1), np.arange(4)).astype(int)
        array([[1, 1, 0, 0],
               [1, 1, 0, 0],
               [1, 1, 1, 0],
               [1, 1, 1, 1]])
    """
    return _PrefixLM(prefix_lengths)


class _Global(MaskMod):
    def __init__(self, num_global: int) -> None:
        if isinstance(num_global, bool) or not isinstance(num_global, (int, np.integer)):
            raise TypeError(f"num_global must be an int >= 0, got {type(num_global).__name__}")
        if num_global < 0:
            raise ValueError(f"num_global must be >= 0, got {num_global}")
        self.n = int(num_global)
        self.name = f"global_tokens_mask({self.n})"

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        xp = array_namespace(q_idx, kv_idx)
        return xp.logical_or(q_idx < self.n, kv_idx < self.n)

    def block_kinds(self, r: BlockRanges) -> tuple[np.ndarray, np.ndarray]:
        any_ = (r.q0 < self.n) | (r.k0 < self.n)
        all_ = (r.q1 - 1 < self.n) | (r.k1 - 1 < self.n)
        return any_[None, None], all_[None, None]


def global_tokens_mask(num_global: int) -> MaskMod:
    """The first ``num_global`` tokens are global (Longformer/BigBird): they see every
    key and every query sees them. Combine with a window: ``or_masks(sliding_window_mask
    (w), global_tokens_mask(g))``.

    Examples:
        >>> import numpy as np
        >>> global_tokens_mask(1)(0, 0, np.arange(3).reshape(3, 1), np.arange(3)).astype(int)
        array([[1, 1, 1],
               [1, 0, 0],
               [1, 0, 0]])
    """
    return _Global(num_global)
