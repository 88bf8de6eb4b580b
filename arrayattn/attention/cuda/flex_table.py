"""Block masks (``arrayattn.flex``) as the forward kernels read them: one int32 table per
:class:`~arrayattn.attention.block_mask.BlockMask` and device, built once and cached on
the block mask (reused across calls and layers).

Layout (``attn_fwd.cu``, "Block masks"; ``AA_FLEX_*``): a header of
:data:`HEADER` int32 values, then

* ``counts``: per (batch, head, query mask block) the number of non-empty key mask
  blocks (``(B or 1, H or 1, nq)``);
* ``lists``: per (batch, head, query mask block) those key blocks in ascending order as
  ``(key block, partial id)`` pairs, partial id ``-1`` for a full block, ended by the pair
  ``(nk, -1)`` (``(B or 1, H or 1, nq, nk + 1, 2)``; entries past the end are unused; the
  kernels walk a list with one pointer and stop at the end pair, whose first tile lies
  at or past every key range);
* ``tcounts``/``tlists`` (for the backward kernels' dK/dV, FlexAttention's
  ``q_num_blocks``/``q_indices``): the transpose, per (batch, head, key mask block) the
  non-empty query blocks as ``(query block, partial id)`` pairs ended by ``(nq, -1)``
  (``(B or 1, H or 1, nk)`` and ``(B or 1, H or 1, nk, nq + 1, 2)``; header slots 10 and
  11 hold their offsets). A partial block has the same id in both directions, so both
  read the same bits;
* ``bits``: the elementwise mask of every partial block, ``(P, Q_BLOCK, wpr)`` 32-bit
  words (bit ``c`` of a row's words is key ``c`` of the block; 1 = takes part), from
  one evaluation of the mask_mod on the partial blocks only (index arrays in the block
  mask's library, ``(n, Q_BLOCK, KV_BLOCK)`` at a time, global positions; pairs past
  ``L``/``S`` are 0 and never read as allowed: the kernels' key length test excludes
  them).

With a predicate (``flex_pred.py``: the mask_mod is a tree of built-ins, unless
``ARRAYATTN_FLEX_PREDICATE=0``) there are no bits: a partial block's pair holds the
table's batch index ``b`` instead of a partial id (still ``>= 0``: partial), header
slot 12 the offset of the int32 parameter area, slots 13 and 14 ``L`` and ``S`` (pairs
past them are excluded, as with the bits), and the per-token ids / per-batch prefix
lengths follow the parameters; the kernels are compiled with :func:`prelude`'s
``AA_FLEX_PRED_EXPR``.

A size-1 batch or head axis of ``kinds`` (``B=None``/``H=None``) is one table for every
batch/head (stride 0 in the header). Nothing here depends on the kernels' tile sizes;
the kernels need ``Q_BLOCK % BM == 0`` and ``KV_BLOCK % BN == 0`` (:func:`tiles_fit`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..block_mask import EMPTY, PARTIAL, BlockMask, mod_allowed
from .flex_pred import Predicate, generate, predicate_enabled

__all__ = [
    "HEADER",
    "MASK_FLEX",
    "tiles_fit",
    "backward_tiles_fit",
    "host_layout",
    "build",
    "table",
    "predicate",
    "prelude",
]

HEADER = 16
"""int32 values before the counts (``AA_FLEX_HEADER``)."""

MASK_FLEX = 4
"""The kernels' ``MASK`` bit for a block mask (``AA_MASK_FLEX``), ORed with the dense mask
kind (0 none, 1 bool, 2 float)."""

_EVAL_PAIRS = 1 << 24
"""Pairs the mask_mod is evaluated on at once (about 16 MiB of booleans)."""


def tiles_fit(bm: BlockMask, block_m: int, block_n: int) -> str | None:
    """``None`` when a kernel with ``block_m`` x ``block_n`` tiles can read ``bm`` (each
    query tile inside one query mask block, each key tile inside one key mask block),
    else why not."""
    if bm.Q_BLOCK % block_m or bm.KV_BLOCK % block_n:
        return (
            f"the block mask's block size ({bm.Q_BLOCK}, {bm.KV_BLOCK}) is not a multiple of "
            f"the kernel's {block_m} x {block_n} tiles (Q_BLOCK % {block_m} == 0 and "
            f"KV_BLOCK % {block_n} == 0 are needed; the default 128 fits every kernel)"
        )
    return None


def _lists(nonempty: np.ndarray, pid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of the last axis: the count of non-empty blocks and their ascending
    ``(block, partial id)`` pairs ended by ``(n, -1)``."""
    n = nonempty.shape[-1]
    counts = nonempty.sum(axis=-1).astype(np.int32)
    order = np.argsort(~nonempty, axis=-1, kind="stable").astype(np.int32)
    lists = np.empty(nonempty.shape[:-1] + (n + 1, 2), np.int32)
    lists[..., :n, 0] = order
    lists[..., :n, 1] = np.take_along_axis(pid, order, axis=-1)
    end = counts[..., None].astype(np.int64)  # the end pair right after the listed blocks
    np.put_along_axis(lists[..., 0], end, n, axis=-1)
    np.put_along_axis(lists[..., 1], end, -1, axis=-1)
    return counts, lists


def backward_tiles_fit(bm: BlockMask, tiles: tuple[tuple[int, int], ...]) -> str | None:
    """:func:`tiles_fit` for the backward kernels: every ``(query rows, keys)`` tile of
    ``tiles`` (the dK/dV kernel's query step x key block, the dQ kernel's query block x key
    step) inside one mask block; ``None``, else why not."""
    for bm_rows, bn_keys in tiles:
        reason = tiles_fit(bm, bm_rows, bn_keys)
        if reason is not None:
            return reason.replace("the kernel's", "the backward kernels'")
    return None


def host_layout(
    kinds: np.ndarray, q_block: int, kv_block: int, pred: Predicate | None = None,
    L: int = 0, S: int = 0,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The table without its bits: ``(head_counts_lists, partial)`` where the first is the
    int32 header + counts + lists + transposed counts + lists (+ with ``pred``, the
    parameters and their arrays, and no bits follow) and ``partial`` the ``(P, 4)`` int64
    ``(b, h, qi, ki)`` of the partial blocks in partial-id order."""
    kinds = np.asarray(kinds)
    Bt, Ht, nq, nk = kinds.shape
    wpr = -(-kv_block // 32)
    nonempty = kinds != EMPTY
    is_partial = kinds == PARTIAL
    if pred is None:
        pid = np.where(is_partial, np.cumsum(is_partial.reshape(-1)).reshape(kinds.shape) - 1, -1)
    else:  # the kernels evaluate the predicate at the table's batch index
        pid = np.where(is_partial, np.arange(Bt).reshape(Bt, 1, 1, 1), -1)
    counts, lists = _lists(nonempty, pid)
    tcounts, tlists = _lists(np.swapaxes(nonempty, -1, -2), np.swapaxes(pid, -1, -2))
    off_cnt = HEADER
    off_list = off_cnt + counts.size
    off_tcnt = off_list + lists.size
    off_tlist = off_tcnt + tcounts.size
    off_bits = off_tlist + tlists.size
    tail: list[np.ndarray] = []
    if pred is not None:
        tail = _param_area(pred, off_bits)
        off_bits += sum(a.size for a in tail)
    n_bits = 0 if pred is not None else int(is_partial.sum()) * q_block * wpr
    if off_bits + n_bits >= 2**31:
        raise ValueError("block mask table exceeds 2**31 int32 words")
    header = np.zeros(HEADER, np.int32)
    header[:12] = (
        nq, nk, Ht if Bt > 1 else 0, 1 if Ht > 1 else 0, q_block, kv_block, wpr,
        off_cnt, off_list, off_bits, off_tcnt, off_tlist,
    )  # fmt: skip
    if pred is not None:
        header[12:15] = (off_tlist + tlists.size, L, S)
    parts = [header, counts.reshape(-1), lists.reshape(-1), tcounts.reshape(-1)]
    host = np.concatenate(parts + [tlists.reshape(-1)] + tail).astype(np.int32)
    partial = np.argwhere(is_partial).astype(np.int64)
    return host, partial


def _param_area(pred: Predicate, start: int) -> list[np.ndarray]:
    """The predicate's parameters (array slots set to their arrays' table offsets) and
    the arrays, laid out from int32 offset ``start``."""
    params = np.asarray(pred.params, np.int64)
    at = start + params.size
    for slot, arr in pred.arrays:
        params[slot] = at
        at += arr.size
    return [params.astype(np.int32)] + [a.reshape(-1) for _, a in pred.arrays]


def predicate(bm: BlockMask) -> Predicate | None:
    """The kernels' predicate for ``bm`` (``flex_pred.generate``, cached on the block
    mask), or ``None`` for the bits path (also whenever ``ARRAYATTN_FLEX_PREDICATE=0``)."""
    if not predicate_enabled():
        return None
    key = ("cuda_flex_predicate",)
    if key not in bm._tables:
        bm._tables[key] = generate(bm.mask_mod, int(bm.kinds.shape[0]))
    got: Predicate | None = bm._tables[key]
    return got


def prelude(bm: BlockMask) -> str:
    """The source the kernels reading ``bm``'s table are compiled with in front of theirs:
    the predicate's (:func:`predicate`), or ``""`` for the bits path."""
    pred = predicate(bm)
    return "" if pred is None else pred.source


def build(bm: BlockMask, xp: Any, device: Any = None) -> Any:
    """The whole table as one int32 array of ``xp`` (CuPy on a GPU): the host part of
    :func:`host_layout` and, without a :func:`predicate`, the partial blocks' bits, the
    mask_mod evaluated on index arrays of ``xp`` over the partial blocks only."""
    _, _, L, S = bm.shape
    qb, kb = bm.Q_BLOCK, bm.KV_BLOCK
    wpr = -(-kb // 32)
    pred = predicate(bm)
    host, partial = host_layout(bm.kinds, qb, kb, pred, L, S)
    kw = {} if device is None else {"device": device}
    parts = [xp.asarray(host, **kw)]
    if pred is not None:  # the kernels evaluate the predicate: no bits
        return parts[0]
    chunk = max(1, _EVAL_PAIRS // (qb * wpr * 32))
    weights = xp.asarray((np.uint32(1) << np.arange(32, dtype=np.uint32)), **kw)
    r = xp.reshape(xp.arange(qb, dtype=xp.int32, **kw), (1, qb, 1))
    c = xp.reshape(xp.arange(kb, dtype=xp.int32, **kw), (1, 1, kb))
    for p0 in range(0, partial.shape[0], chunk):
        blk = partial[p0 : p0 + chunk]
        n = blk.shape[0]
        b = xp.reshape(xp.asarray(blk[:, 0].astype(np.int32), **kw), (n, 1, 1))
        h = xp.reshape(xp.asarray(blk[:, 1].astype(np.int32), **kw), (n, 1, 1))
        rows = xp.reshape(xp.asarray((blk[:, 2] * qb).astype(np.int32), **kw), (n, 1, 1)) + r
        cols = xp.reshape(xp.asarray((blk[:, 3] * kb).astype(np.int32), **kw), (n, 1, 1)) + c
        valid = xp.logical_and(rows < L, cols < S)
        # Pairs past L or S are clamped for the mask_mod (per-token ids stay in range) and
        # cleared after it.
        ok = mod_allowed(bm.mask_mod, b, h, xp.minimum(rows, L - 1), xp.minimum(cols, S - 1))
        ok = xp.logical_and(xp.broadcast_to(ok, valid.shape), valid)
        if wpr * 32 != kb:
            pad = xp.zeros((n, qb, wpr * 32 - kb), dtype=xp.bool, **kw)
            ok = xp.concatenate([ok, pad], axis=-1)
        bits = xp.reshape(xp.astype(ok, xp.uint32), (n, qb, wpr, 32))
        words = xp.sum(bits * weights, axis=-1, dtype=xp.uint32)  # distinct powers: OR
        parts.append(xp.reshape(words, (-1,)).view(xp.int32))
    return xp.concatenate(parts) if len(parts) > 1 else parts[0]


def table(bm: BlockMask, xp: Any, device_key: Any, device: Any = None) -> Any:
    """:func:`build`'s table for ``bm`` on one device, cached on the block mask."""
    cache = bm._tables
    # (the predicate switch is part of the key: A/B runs flip it between calls)
    key = ("cuda_flex_table", str(device_key), predicate(bm) is not None)
    got = cache.get(key)
    if got is None:
        got = build(bm, xp, device)
        cache[key] = got
    return got
