"""The Dask path's block grid: how the inputs are cut into blocks, and what each block's
task knows about its place in the whole call (pickled into the task).

Rechunk rule (one ``rechunk`` per input, only where needed): the query's chunks define the
batch axes (the key's or value's where the query broadcasts there), the head axis (the
key's when the query has one broadcast head) and the query blocks; head chunks are rounded
up to multiples of the GQA group size; the key's sequence chunks define the key blocks;
the value, the mask and the lengths are rechunked to match; the head-dim axes become one
chunk. Gradients come back in these chunks.
"""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from ..._backend import Array
from ..spec import AttentionSpec, make_spec
from ..structure import Structure

_OBJECT_TOKENS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _object_token(obj: Any) -> str | None:
    """A token for ``obj`` that stays the same while it lives and is never another live
    object's (mask_mods and score_mods hold closures and arrays: Dask could hash them
    only by pickling, or not at all)."""
    if obj is None:
        return None
    try:
        tok = _OBJECT_TOKENS.get(obj)
        if tok is None:
            tok = _OBJECT_TOKENS[obj] = uuid.uuid4().hex
        return tok
    except TypeError:  # not weakly referenceable (or unhashable): a token of its own
        return uuid.uuid4().hex


@dataclass(frozen=True, eq=False)
class _Flex:
    """The call's structured mask and score modifier (``arrayattn.flex``), handed whole to
    every block: the block mask's table and the mask_mod work in global indices, and a
    block spec carries its origins (:meth:`AttentionSpec.as_block`)."""

    block_mask: Any
    mask_mod: Any
    score_mod: Any

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        return (
            "arrayattn-flex",
            _object_token(self.block_mask),
            _object_token(self.mask_mod),
            _object_token(self.score_mod),
        )


@dataclass(frozen=True)
class _Call:
    """The call's options, resolved once for every block."""

    dropout_p: float
    scale: float
    enable_gqa: bool
    window: tuple[int, int] | None  # the structure's (left, right): causal is (-1, 0)
    softcap: float | None
    seed: int | None
    L: int
    S: int
    diagonal: int  # the global structure offset
    per_sequence_diagonal: bool  # bottom-right with lengths: kv_len - q_len per sequence
    offset_bounds: tuple[int, int] | None
    flex: _Flex | None = None


@dataclass(frozen=True)
class _Block:
    """Where one task's chunks sit in the whole call."""

    call: _Call
    batch_ids: tuple[int, ...]
    head0: int
    row0: int
    col0: int
    partial_keys: bool

    def spec(
        self,
        q: Array,
        k: Array,
        v: Array,
        mask: Array | None,
        q_len: Array | None,
        kv_len: Array | None,
        alibi: Array | None = None,
    ) -> AttentionSpec:
        c = self.call
        # Per-head options only when given (older specs have no such keywords).
        per_head = {} if alibi is None else {"alibi_slopes": alibi}
        # Lengths in block coordinates (make_spec clips them to the block's rows/keys).
        q_loc = kv_loc = None
        if q_len is not None or kv_len is not None:
            xp_lengths = _namespace(q)
            if q_len is not None:
                q_loc = xp_lengths.astype(q_len, xp_lengths.int64) - self.row0
            if kv_len is not None:
                kv_loc = xp_lengths.astype(kv_len, xp_lengths.int64) - self.col0
        spec = make_spec(
            q,
            k,
            v,
            mask,
            c.dropout_p,
            False,  # the structure comes whole as a window; as_block sets its diagonal
            c.scale,
            c.enable_gqa,
            "top_left",
            c.window,
            c.softcap,
            c.seed,
            q_lengths=q_loc,
            kv_lengths=kv_loc,
            **per_head,
        )
        if c.flex is not None:
            # (not through make_spec: its check is against the whole call's shapes)
            spec = dataclasses.replace(
                spec,
                block_mask=c.flex.block_mask,
                mask_mod=c.flex.mask_mod,
                score_mod=c.flex.score_mod,
            )
        shift = self.row0 - self.col0
        offset_g = offset_range = None
        if c.per_sequence_diagonal:
            # The global per-sequence diagonal (kv_len - q_len, clipped lengths), moved.
            xp = spec.xp
            kv = c.S if kv_len is None else xp.clip(xp.astype(kv_len, xp.int64), 0, c.S)
            ql = c.L if q_len is None else xp.clip(xp.astype(q_len, xp.int64), 0, c.L)
            offset_g = xp.reshape(xp.astype(kv - ql + shift, xp.int32), spec.lead + (1,) * 4)
            assert c.offset_bounds is not None  # a spec with per-sequence diagonals has them
            lo, hi = c.offset_bounds
            offset_range = (lo + shift, hi + shift)
        return spec.as_block(
            batch_ids=self.batch_ids,
            head0=self.head0,
            row0=self.row0,
            col0=self.col0,
            structure=Structure(c.diagonal + shift, *(c.window or (-1, -1))),
            offset_g=offset_g,
            offset_range=offset_range,
            partial_keys=self.partial_keys,
        )


def _namespace(x: Array) -> Any:
    from array_api_compat import array_namespace

    return array_namespace(x)


@dataclass(frozen=True)
class _Shapes:
    out: tuple[int, ...]
    lse: tuple[int, ...]


def _pad(x: Array, nd: int) -> Array:
    if x.ndim == nd:
        return x
    return x[(None,) * (nd - x.ndim) + (Ellipsis,)]


def _own(size: int, chunks: tuple[int, ...]) -> tuple[int, ...]:
    """An operand axis's chunks: ``(1,)`` where it broadcasts (size 1), else the call's
    ``chunks`` for that axis (``(0,)`` for an empty one)."""
    return (1,) if size == 1 else tuple(chunks)


def _round_to_groups(chunks: tuple[int, ...], g: int) -> tuple[int, ...]:
    """Head chunks whose boundaries are moved up to multiples of ``g`` (GQA groups)."""
    bounds: list[int] = []
    total = 0
    for c in chunks:
        total += c
        b = min(-(-total // g) * g, sum(chunks))
        if not bounds or b > bounds[-1]:
            bounds.append(b)
    return tuple(b - a for a, b in zip([0] + bounds[:-1], bounds, strict=True))


def _starts(chunks: tuple[int, ...]) -> list[int]:
    out, s = [], 0
    for c in chunks:
        out.append(s)
        s += c
    return out


@dataclass
class _Plan:
    spec: AttentionSpec
    nd: int
    q: Array
    k: Array
    v: Array
    mask: Array | None
    q_len: Array | None
    kv_len: Array | None
    lead_chunks: tuple[tuple[int, ...], ...]
    head_chunks: tuple[int, ...]
    row_chunks: tuple[int, ...]
    col_chunks: tuple[int, ...]
    call: _Call
    token: str
    sinks: Array | None = None  # (*lead or 1s, Hq or 1), rechunked like the output
    alibi: Array | None = None
    _reach: dict[int, list[int]] | None = None
    _cell_reach: dict[tuple[Any, ...], dict[int, list[int]]] = dataclasses.field(
        default_factory=dict
    )

    # -- block keys of the (rechunked, padded) inputs ---------------------------------
    def _lead_idx(self, x: Array, li: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(0 if x.shape[a] == 1 else li[a] for a in range(len(li)))

    def q_key(self, li, hi, i):
        q = self.q
        return (q.name,) + self._lead_idx(q, li) + (0 if q.shape[-3] == 1 else hi, i, 0)

    def kv_key(self, x, li, hi, j):
        return (x.name,) + self._lead_idx(x, li) + (0 if x.shape[-3] == 1 else hi, j, 0)

    def mask_key(self, li, hi, i, j):
        m = self.mask
        if m is None:
            return None
        h = 0 if m.shape[-3] == 1 else hi
        return (
            (m.name,)
            + self._lead_idx(m, li)
            + (h, 0 if m.shape[-2] == 1 else i, 0 if m.shape[-1] == 1 else j)
        )

    def head_key(self, x, li, hi):
        if x is None:
            return None
        return (x.name,) + self._lead_idx(x, li) + (0 if x.shape[-1] == 1 else hi,)

    def len_key(self, x, li):
        if x is None:
            return None
        return (x.name,) + tuple(li)

    def blocks(self):
        """``(lead index, head index, i, j)`` of every scheduled block, and the key blocks
        of each query block."""
        spec = self.spec
        row_starts, col_starts = _starts(self.row_chunks), _starts(self.col_chunks)
        reach: dict[int, list[int]] = {}
        for i, (r0, n) in enumerate(zip(row_starts, self.row_chunks, strict=True)):
            if n == 0:  # no rows: the empty state has the right (zero-row) shape
                reach[i] = []
                continue
            lo, hi = spec.structure.col_range(r0, r0 + n, spec.S, spec.offset_bounds)
            reach[i] = [
                j
                for j, (c0, m) in enumerate(zip(col_starts, self.col_chunks, strict=True))
                if m > 0 and c0 < hi and c0 + m > lo
            ]
        return reach

    def reach(self, li: tuple[int, ...], hi: int) -> dict[int, list[int]]:
        """:meth:`blocks` for the batch chunk ``li`` and head chunk ``hi``, less the key
        blocks whose block-mask blocks are all empty for those batches and heads: such a
        pair gets no task at all (rows no task reaches come out as output 0, LSE -inf)."""
        if self._reach is None:
            self._reach = self.blocks()
        bm = self.spec.block_mask
        if bm is None:
            return self._reach
        cached = self._cell_reach.get((li, hi))
        if cached is not None:
            return cached
        from ..block_mask import EMPTY

        batches, heads = self.cell_ids(li, hi)
        row_starts, col_starts = _starts(self.row_chunks), _starts(self.col_chunks)
        out = {}
        for i, js in self._reach.items():
            r0, r1 = row_starts[i], row_starts[i] + self.row_chunks[i]
            out[i] = [
                j
                for j in js
                if bm.tile_kind(
                    batches, heads, r0, r1, col_starts[j], col_starts[j] + self.col_chunks[j]
                )
                != EMPTY
            ]
        self._cell_reach[(li, hi)] = out
        return out

    def cell_ids(self, li: tuple[int, ...], hi: int) -> tuple[list[int], slice]:
        """The global flat batch indices and the query-head slice of a cell."""
        h0 = _starts(self.head_chunks)[hi]
        return list(self.batch_ids(li)), slice(h0, h0 + self.head_chunks[hi])

    def light(self, li: tuple[int, ...], hi: int, i: int, j: int) -> bool:
        """True when block ``(i, j)`` of the cell does less work than a full one: the
        causal/window band crosses it (:meth:`cut_by_band`) or some of its block-mask
        blocks are empty for every batch and head of the cell."""
        if self.cut_by_band(i, j):
            return True
        bm = self.spec.block_mask
        if bm is None:
            return False
        r0, c0 = _starts(self.row_chunks)[i], _starts(self.col_chunks)[j]
        kinds = bm.blocks(
            *self.cell_ids(li, hi), r0, r0 + self.row_chunks[i], c0, c0 + self.col_chunks[j]
        )
        return not bool(kinds.reshape((-1,) + kinds.shape[-2:]).any(axis=0).all())

    def full(self, li: tuple[int, ...], hi: int, i: int, j: int) -> bool:
        """True when the block mask says every block of pair ``(i, j)`` is full for every
        batch and head of the cell."""
        from ..block_mask import FULL

        bm = self.spec.block_mask
        if bm is None:
            return False
        r0, c0 = _starts(self.row_chunks)[i], _starts(self.col_chunks)[j]
        kind = bm.tile_kind(
            *self.cell_ids(li, hi), r0, r0 + self.row_chunks[i], c0, c0 + self.col_chunks[j]
        )
        return bool(kind == FULL)

    def cut_by_band(self, i: int, j: int) -> bool:
        """True when the causal/window band's edge crosses block ``(i, j)`` (or may: with
        per-sequence diagonals the band is data), so the block does less work than a full
        one. Such blocks get their own task name, so that the scheduler learns their
        duration apart from the full blocks'."""
        from .. import composed as _composed

        r0, c0 = _starts(self.row_chunks)[i], _starts(self.col_chunks)[j]
        r1, c1 = r0 + self.row_chunks[i], c0 + self.col_chunks[j]
        return not _composed.inside_band(self.spec, r0, r1, c0, c1)

    def batch_ids(self, li: tuple[int, ...]) -> tuple[int, ...]:
        """The global flat batch indices of batch chunk ``li``."""
        lead = self.spec.lead
        if not lead:
            return (0,)
        ranges = []
        for a in range(len(lead)):
            start = _starts(self.lead_chunks[a])[li[a]]
            ranges.append(np.arange(start, start + self.lead_chunks[a][li[a]]))
        grids = np.meshgrid(*ranges, indexing="ij")
        ids = np.ravel_multi_index(tuple(g.ravel() for g in grids), lead)
        return tuple(int(x) for x in ids)

    def block(self, li: tuple[int, ...], hi: int, i: int, j: int) -> _Block:
        call = self.call
        if call.flex is not None and call.flex.score_mod is None and self.full(li, hi, i, j):
            # Every pair of the block takes part: the mask_mod would test nothing, and
            # without it the chunk's fastest path (not only chunked/composed) takes it.
            call = dataclasses.replace(call, flex=None)
        return _Block(
            call=call,
            batch_ids=self.batch_ids(li),
            head0=_starts(self.head_chunks)[hi],
            row0=_starts(self.row_chunks)[i],
            col0=_starts(self.col_chunks)[j],
            # With sinks the blocks run without them (the sink joins each row once, after
            # the merge), so no block's rows are whole rows.
            partial_keys=len(self.col_chunks) > 1 or self.sinks is not None,
        )

    def grid(self):
        return product(
            product(*[range(len(c)) for c in self.lead_chunks]), range(len(self.head_chunks))
        )

    def shapes(self, li: tuple[int, ...], hi: int, i: int) -> _Shapes:
        lead = tuple(self.lead_chunks[a][li[a]] for a in range(len(li)))
        rows = lead + (self.head_chunks[hi], self.row_chunks[i])
        return _Shapes(rows + (self.spec.Ev,), rows)

    def inputs(self) -> list[Array]:
        xs = (self.q, self.k, self.v, self.mask, self.q_len, self.kv_len, self.sinks, self.alibi)
        return [x for x in xs if x is not None]


def _plan(
    spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None, tag: str
) -> _Plan:
    from dask.base import tokenize

    nd = len(spec.lead) + 3
    q, k, v = (_pad(x, nd) for x in (query, key, value))
    mask = None if attn_mask is None else _pad(attn_mask, nd)
    lead = spec.lead
    lead_chunks = []
    for a, n in enumerate(lead):
        src = next((x for x in (q, k, v) if x.shape[a] == n and n > 1), None)
        lead_chunks.append((n,) if src is None else tuple(src.chunks[a]))
    Hq, Hkv, G = spec.Hq, spec.Hkv, spec.G
    if q.shape[-3] == Hq and Hq > 1:
        head_chunks = tuple(q.chunks[-3])
    elif k.shape[-3] == Hq and Hq > 1:
        head_chunks = tuple(k.chunks[-3])
    else:
        head_chunks = (Hq,)
    if G > 1 and Hkv > 1:
        head_chunks = _round_to_groups(head_chunks, G)
    kv_head_chunks = tuple(c // G for c in head_chunks) if Hkv > 1 else (Hkv,)
    row_chunks = tuple(q.chunks[-2])
    col_chunks = tuple(k.chunks[-2])

    def target(x, heads, seq, width):
        chunks = [_own(x.shape[a], lead_chunks[a]) for a in range(len(lead))]
        chunks.append(_own(x.shape[-3], heads))
        chunks.append(seq)
        chunks.append(width if width is not None else (int(x.shape[-1]),))
        return tuple(chunks)

    def rechunk(x, chunks):
        chunks = tuple(chunks)
        return x if tuple(x.chunks) == chunks else x.rechunk(chunks)

    q = rechunk(q, target(q, head_chunks, row_chunks, None))
    k = rechunk(k, target(k, kv_head_chunks, col_chunks, None))
    v = rechunk(v, target(v, kv_head_chunks, col_chunks, None))
    if mask is not None:
        mc = [_own(mask.shape[a], lead_chunks[a]) for a in range(len(lead))]
        mc.append(_own(mask.shape[-3], head_chunks))
        mc.append(_own(mask.shape[-2], row_chunks))
        mc.append(_own(mask.shape[-1], col_chunks))
        mask = rechunk(mask, mc)
    q_len = kv_len = None
    if spec.q_lengths is not None:
        q_len = rechunk(spec.q_lengths, lead_chunks)
    if spec.kv_lengths is not None:
        kv_len = rechunk(spec.kv_lengths, lead_chunks)
    per_head = []
    for x in (getattr(spec, "sinks", None), getattr(spec, "alibi_slopes", None)):
        if x is not None:
            x = _pad(x, len(lead) + 1)
            hc = [_own(x.shape[a], lead_chunks[a]) for a in range(len(lead))]
            x = rechunk(x, hc + [_own(x.shape[-1], head_chunks)])
        per_head.append(x)
    st = spec.structure
    call = _Call(
        dropout_p=spec.dropout_p,
        scale=spec.scale,
        enable_gqa=G > 1,
        window=None if st.is_trivial else (st.left, st.right),
        softcap=spec.softcap,
        seed=spec.seed,
        L=spec.L,
        S=spec.S,
        diagonal=st.offset,
        per_sequence_diagonal=spec.offset_g is not None,
        offset_bounds=spec.offset_bounds,
        flex=_Flex(spec.block_mask, spec.mask_mod, spec.score_mod) if spec.flex else None,
    )
    names = [x.name for x in (q, k, v, mask, q_len, kv_len, *per_head) if x is not None]
    token = tokenize(tag, names, call, lead_chunks, head_chunks)
    return _Plan(
        spec,
        nd,
        q,
        k,
        v,
        mask,
        q_len,
        kv_len,
        tuple(lead_chunks),
        head_chunks,
        row_chunks,
        col_chunks,
        call,
        token,
        sinks=per_head[0],
        alibi=per_head[1],
    )
