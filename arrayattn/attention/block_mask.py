"""Block-sparse attention masks: ``create_block_mask`` and :class:`BlockMask`.

A :class:`BlockMask` caches a ``mask_mod`` at block granularity for one call shape
``(B, H, L, S)``: for each (query block, key block) whether it is *empty* (no pair takes
part: skipped), *full* (every pair takes part: no mask test) or *partial* (the mask_mod
is evaluated on the block's indices when the block is computed). It is built without
ever forming the dense ``L x S`` mask: the built-in mask_mods classify blocks from their
index ranges (:mod:`.mask_mods`); any other function is evaluated a bounded number of
blocks at a time. The implementations ask it which key ranges a row block must visit
(:func:`key_runs`) and evaluate the mask_mod with :func:`mod_allowed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._backend import Array, Namespace, array_namespace, library_name, resolve_namespace
from .mask_mods import BlockRanges, MaskMod, as_mask_mod, classifiable

__all__ = ["BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL", "key_runs"]

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK_SIZE = 128
"""FlexAttention's default block size (both sides)."""

_EVAL_ELEMENTS = 1 << 22
"""Pairs evaluated at once when a plain mask_mod function is classified by evaluation
(bounds create_block_mask's memory: about 4 MiB of booleans)."""


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask_mod at block granularity for calls of shape ``(B, H, L, S)``
    (:func:`create_block_mask` builds it; reuse it across calls and layers).

    Attributes:
        kinds: int8 NumPy array ``(B or 1, H or 1, ceil(L / Q_BLOCK), ceil(S / KV_BLOCK))``
            of :data:`EMPTY` (0), :data:`PARTIAL` (1) and :data:`FULL` (2); a size-1
            batch or head axis broadcasts (created with ``B=None``/``H=None``).
        mask_mod: the elementwise mask, evaluated on partial blocks.
        shape: ``(B, H, L, S)`` with ``None`` for a broadcast axis.
        Q_BLOCK, KV_BLOCK: the block sizes (the last block of each axis may be shorter).
        library, device: where the mask_mod's arrays live (checked against each call).

    FlexAttention's accessors are provided for porting: :attr:`kv_num_blocks`,
    :attr:`kv_indices` (the partial blocks of each query block row),
    :attr:`full_kv_num_blocks`, :attr:`full_kv_indices` (the full ones), and
    :meth:`sparsity`.
    """

    kinds: np.ndarray
    mask_mod: MaskMod
    shape: tuple[int | None, int | None, int, int]
    Q_BLOCK: int
    KV_BLOCK: int
    library: str
    device: Any
    _runs: dict[tuple[Any, ...], list[tuple[int, int, bool]]] = field(
        default_factory=dict, repr=False
    )
    # Per-device derived tables (the CUDA kernels' block table and partial-block bits,
    # arrayattn/attention/cuda/flex_table.py), built on first use and reused.
    _tables: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]:  # noqa: N802 (FlexAttention's name)
        return self.Q_BLOCK, self.KV_BLOCK

    @property
    def L(self) -> int:  # noqa: N802
        return self.shape[2]

    @property
    def S(self) -> int:  # noqa: N802
        return self.shape[3]

    def _indices(self, kind: int) -> tuple[np.ndarray, np.ndarray]:
        sel = self.kinds == kind
        num = sel.sum(axis=-1).astype(np.int32)
        # Indices of the selected key blocks first (in order), then the others: the
        # layout of FlexAttention's kv_indices (only the first num entries are meaningful).
        order = np.argsort(~sel, axis=-1, kind="stable").astype(np.int32)
        return num, order

    @property
    def kv_num_blocks(self) -> np.ndarray:
        """``(B, H, nq)``: partial key blocks per query block (FlexAttention's name)."""
        return self._indices(PARTIAL)[0]

    @property
    def kv_indices(self) -> np.ndarray:
        """``(B, H, nq, nk)``: the partial key blocks of each query block first."""
        return self._indices(PARTIAL)[1]

    @property
    def full_kv_num_blocks(self) -> np.ndarray:
        """``(B, H, nq)``: full key blocks per query block."""
        return self._indices(FULL)[0]

    @property
    def full_kv_indices(self) -> np.ndarray:
        """``(B, H, nq, nk)``: the full key blocks of each query block first."""
        return self._indices(FULL)[1]

    def sparsity(self) -> float:
        """Percentage of blocks that are empty (skipped), as FlexAttention reports it."""
        return 100.0 * float(np.mean(self.kinds == EMPTY))

    def to_string(self, batch: int = 0, head: int = 0, max_blocks: int = 64) -> str:
        """A picture of one (batch, head): ``#`` full, ``+`` partial, ``.`` empty; one
        character per block (every ``k``-th block when there are more than
        ``max_blocks``).

        Examples:
            >>> from arrayattn.attention.mask_mods import causal_mask
            >>> print(create_block_mask(causal_mask, None, None, 4, 4, block_size=1).to_string())
            #...
            ##..
            ###.
            ####
        """
        k = self.kinds[min(batch, self.kinds.shape[0] - 1), min(head, self.kinds.shape[1] - 1)]
        step = max(1, math.ceil(max(k.shape) / max_blocks))
        k = k[::step, ::step]
        chars = np.array([".", "+", "#"])
        return "\n".join("".join(row) for row in chars[k])

    def __str__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block_size=({self.Q_BLOCK}, {self.KV_BLOCK}), "
            f"sparsity={self.sparsity():.1f}%, mask_mod={self.mask_mod!r})\n{self.to_string()}"
        )

    # -- checks and lookups used by the implementations ---------------------------------
    def check_call(
        self, xp: Namespace, device: Any, batch: int, heads: int, L: int, S: int
    ) -> None:
        """Raise ``ValueError`` unless this mask was built for a call of this shape on
        this library and device."""
        B, H, L0, S0 = self.shape
        bad = []
        if L0 != L or S0 != S:
            bad.append(f"L = {L}, S = {S} (it has L = {L0}, S = {S0})")
        if B is not None and B != batch:
            bad.append(f"batch {batch} (it has B = {B}; B=None broadcasts)")
        if H is not None and H != heads:
            bad.append(f"{heads} query heads (it has H = {H}; H=None broadcasts)")
        lib = library_name(xp)
        if lib != self.library and lib != "dask":  # (Dask's blocks run on its chunks' library)
            bad.append(f"library {lib} (it was built for {self.library}: pass xp=)")
        elif self.device is not None and str(device) != str(self.device):
            bad.append(f"device {device} (it was built for {self.device})")
        if bad:
            raise ValueError(
                "block_mask was built for other calls: the call has "
                + "; ".join(bad)
                + ". Build one with create_block_mask(mask_mod, B, H, L, S) for this call."
            )

    def blocks(self, batches: Any, heads: Any, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """The kinds of the blocks that rows ``[r0, r1)`` and keys ``[c0, c1)`` touch,
        for batch indices ``batches`` and head indices ``heads`` (ints, slices or
        ``None`` for all): ``(b, h, nq, nk)``."""
        k = self.kinds
        b = _axis_index(batches, k.shape[0])
        h = _axis_index(heads, k.shape[1])
        q0, q1 = r0 // self.Q_BLOCK, -(-r1 // self.Q_BLOCK)
        k0, k1 = c0 // self.KV_BLOCK, -(-c1 // self.KV_BLOCK)
        return k[b][:, h][:, :, q0:q1, k0:k1]

    def tile_kind(self, batches: Any, heads: Any, r0: int, r1: int, c0: int, c1: int) -> int:
        """:data:`EMPTY`, :data:`FULL` or :data:`PARTIAL` for a tile over those batches
        and heads (empty only if empty for all of them; full only if full for all)."""
        if r1 <= r0 or c1 <= c0:
            return EMPTY
        blk = self.blocks(batches, heads, r0, r1, c0, c1)
        if not blk.any():
            return EMPTY
        if (blk == FULL).all():
            return FULL
        return PARTIAL


def _axis_index(sel: Any, n: int) -> Any:
    if n == 1 or sel is None:
        return slice(None)
    if isinstance(sel, slice):
        return sel
    if isinstance(sel, (tuple, list)):
        return list(sel)
    return slice(int(sel), int(sel) + 1)


def key_runs(
    bm: BlockMask, batches: Any, heads: Any, r0: int, r1: int, c0: int, c1: int
) -> list[tuple[int, int, bool]]:
    """The keys ``[c0, c1)`` that rows ``[r0, r1)`` must visit, as runs ``(a, b, masked)``
    of contiguous non-empty key blocks (clipped to ``[c0, c1)``); ``masked`` is False for
    a run whose blocks are all full (no mask test needed). Empty blocks (for every one of
    the given batches and heads) are left out.

    Examples:
        >>> from arrayattn.attention.mask_mods import causal_mask
        >>> bm = create_block_mask(causal_mask, None, None, 8, 8, block_size=2)
        >>> key_runs(bm, None, None, 4, 6, 0, 8)
        [(0, 4, False), (4, 6, True)]
    """
    if r1 <= r0 or c1 <= c0:
        return []
    key = (_hashable(batches), _hashable(heads), r0, r1, c0, c1)
    cached = bm._runs.get(key)
    if cached is not None:
        return cached
    blk = bm.blocks(batches, heads, r0, r1, c0, c1)
    nonempty = np.asarray(blk.reshape(-1, blk.shape[-2], blk.shape[-1]).any(axis=(0, 1)))
    full = np.asarray((blk == FULL).reshape(-1, blk.shape[-2], blk.shape[-1]).all(axis=(0, 1)))
    first = c0 // bm.KV_BLOCK
    runs: list[tuple[int, int, bool]] = []
    for i in range(nonempty.shape[0]):
        if not nonempty[i]:
            continue
        a = max(c0, (first + i) * bm.KV_BLOCK)
        b = min(c1, (first + i + 1) * bm.KV_BLOCK)
        masked = not bool(full[i])
        if runs and runs[-1][1] == a and runs[-1][2] == masked:
            runs[-1] = (runs[-1][0], b, masked)
        else:
            runs.append((a, b, masked))
    if len(bm._runs) < 4096:
        bm._runs[key] = runs
    return runs


def _hashable(x: Any) -> Any:
    if isinstance(x, slice):
        return (x.start, x.stop, x.step)
    if isinstance(x, list):
        return tuple(x)
    return x


def mod_allowed(mod: MaskMod, batch: Array, head: Array, rows: Array, cols: Array) -> Array:
    """Evaluate ``mod`` on a block's index arrays and check what it returned: a boolean
    array (``TypeError`` otherwise) broadcastable to the block (``ValueError``
    otherwise)."""
    out = mod(batch, head, rows, cols)
    if not hasattr(out, "dtype") or not hasattr(out, "shape"):
        raise TypeError(f"mask_mod {mod!r} must return a boolean array, got {type(out).__name__}")
    xp = array_namespace(out)
    if out.dtype != xp.bool:
        raise TypeError(f"mask_mod {mod!r} must return a boolean array, got dtype {out.dtype}")
    want = np.broadcast_shapes(
        tuple(batch.shape), tuple(head.shape), tuple(rows.shape), tuple(cols.shape)
    )
    try:
        got = np.broadcast_shapes(tuple(out.shape), want)
    except ValueError:
        got = None
    if got != want:
        raise ValueError(
            f"mask_mod {mod!r} returned shape {tuple(out.shape)}, which does not broadcast "
            f"to the block's (batch, head, q_idx, kv_idx) shape {want}"
        )
    return out


def create_block_mask(
    mask_mod: Any,
    B: int | None,
    H: int | None,
    L: int,
    S: int,
    *,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    xp: Any = None,
    device: Any = None,
) -> BlockMask:
    """Classify every ``(query block, key block)`` of ``mask_mod`` for calls with ``B``
    sequences, ``H`` query heads, ``L`` queries and ``S`` keys (FlexAttention's
    ``create_block_mask``). ``B=None``/``H=None`` build one for every batch/head (the
    mask_mod must not depend on ``b``/``h`` then).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on broadcasting int32 index
            arrays (a built-in of :mod:`arrayattn.flex` or any such function).
        B, H, L, S: the call's batch (flat, over all leading dims), query heads, queries
            and keys.
        block_size: ``Q_BLOCK`` and ``KV_BLOCK`` (one int for both); they need not divide
            ``L`` or ``S``.
        xp, device: the library and device the mask_mod's index arrays are made in
            (default: NumPy on the CPU); calls on other libraries are refused.

    Built-in mask_mods are classified from index ranges (no pair is evaluated); any other
    function is evaluated on at most about 4M pairs at a time, never on the dense
    ``L x S`` mask.

    Examples:
        >>> from arrayattn.flex import create_block_mask, causal_mask
        >>> bm = create_block_mask(causal_mask, None, None, 1024, 1024)
        >>> bm.kinds.shape, round(bm.sparsity(), 1)
        ((1, 1, 8, 8), 43.8)
    """
    mod = as_mask_mod(mask_mod)
    for name, v in (("L", L), ("S", S)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    for name, bh in (("B", B), ("H", H)):
        if bh is not None and (
            isinstance(bh, bool) or not isinstance(bh, (int, np.integer)) or bh < 1
        ):
            raise ValueError(f"{name} must be an int >= 1 or None (broadcast), got {bh!r}")
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a pair of ints, got {block_size!r}")
        qb, kb = (int(x) for x in block_size)
    else:
        qb = kb = int(block_size)
    if qb < 1 or kb < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    xp_ = resolve_namespace(xp if xp is not None else np)
    Bm, Hm = B or 1, H or 1
    q_edges = np.minimum(np.arange(0, L + qb, qb, dtype=np.int64), L)[: -(-L // qb) + 1]
    k_edges = np.minimum(np.arange(0, S + kb, kb, dtype=np.int64), S)[: -(-S // kb) + 1]
    if L == 0 or S == 0:
        kinds = np.zeros((Bm, Hm, max(len(q_edges) - 1, 0), max(len(k_edges) - 1, 0)), np.int8)
    elif classifiable(mod):
        r = BlockRanges(Bm, Hm, q_edges, k_edges)
        any_, all_ = mod.block_kinds(r)
        try:
            any_ = np.broadcast_to(any_, r.shape)
            all_ = np.broadcast_to(all_, r.shape)
        except ValueError:
            raise ValueError(
                f"mask_mod {mod!r} depends on the batch or head axis beyond B = {B}, "
                f"H = {H}: pass the call's B (and H)"
            ) from None
        kinds = np.where(any_, np.where(all_, FULL, PARTIAL), EMPTY).astype(np.int8)
    else:
        kinds = _evaluate(mod, xp_, device, Bm, Hm, q_edges, k_edges)
    return BlockMask(
        kinds=np.ascontiguousarray(kinds),
        mask_mod=mod,
        shape=(B, H, int(L), int(S)),
        Q_BLOCK=qb,
        KV_BLOCK=kb,
        library=library_name(xp_),
        device=device,
    )


def _evaluate(
    mod: MaskMod,
    xp: Namespace,
    device: Any,
    B: int,
    H: int,
    q_edges: np.ndarray,
    k_edges: np.ndarray,
) -> np.ndarray:
    """Block kinds by evaluating ``mod`` on bounded groups of whole blocks."""
    from .._backend import to_host_numpy

    L, S = int(q_edges[-1]), int(k_edges[-1])
    qb = int(q_edges[1] - q_edges[0])
    kb = int(k_edges[1] - k_edges[0])
    nq, nk = len(q_edges) - 1, len(k_edges) - 1
    kinds = np.empty((B, H, nq, nk), np.int8)
    kw = {} if device is None else {"device": device}
    b = xp.reshape(xp.arange(B, dtype=xp.int32, **kw), (B, 1, 1, 1))
    h = xp.reshape(xp.arange(H, dtype=xp.int32, **kw), (H, 1, 1))
    # Groups of query blocks x key blocks of at most _EVAL_ELEMENTS pairs per (b, h).
    per_pair = B * H
    kblocks = max(1, min(nk, _EVAL_ELEMENTS // max(1, per_pair * qb * kb)))
    qblocks = max(1, min(nq, _EVAL_ELEMENTS // max(1, per_pair * qb * kblocks * kb)))
    for i0 in range(0, nq, qblocks):
        i1 = min(nq, i0 + qblocks)
        r0 = int(q_edges[i0])
        # Indices past L or S (the ragged last blocks, padded to whole blocks here) are
        # clipped to the last query/key: the mask_mod only ever sees indices of the call
        # (it may index per-token arrays with them); their results are discarded below.
        r_host = np.minimum(np.arange(r0, r0 + (i1 - i0) * qb), L - 1)
        rows = xp.reshape(xp.asarray(r_host, dtype=xp.int32, **kw), (-1, 1))
        for j0 in range(0, nk, kblocks):
            j1 = min(nk, j0 + kblocks)
            c0 = int(k_edges[j0])
            c_host = np.minimum(np.arange(c0, c0 + (j1 - j0) * kb), S - 1)
            cols = xp.asarray(c_host, dtype=xp.int32, **kw)
            got = to_host_numpy(mod_allowed(mod, b, h, rows, cols))
            got = np.broadcast_to(got, (B, H, rows.shape[0], cols.shape[0]))
            # Pairs past L or S count as neither taking part nor not: they cannot make a
            # block non-empty or non-full.
            valid_r = (np.arange(r0, r0 + rows.shape[0]) < L)[:, None]
            valid_c = np.arange(c0, c0 + cols.shape[0]) < S
            valid = valid_r & valid_c
            g = got.reshape(B, H, i1 - i0, qb, j1 - j0, kb)
            v = valid.reshape(1, 1, i1 - i0, qb, j1 - j0, kb)
            any_ = (g & v).any(axis=(3, 5))
            all_ = (g | ~v).all(axis=(3, 5))
            kinds[:, :, i0:i1, j0:j1] = np.where(any_, np.where(all_, FULL, PARTIAL), EMPTY)
    return kinds
