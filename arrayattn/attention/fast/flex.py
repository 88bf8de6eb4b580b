"""The NumPy fast path's structured masks and score modifiers (``arrayattn.flex``).

One :class:`FlexPlan` per call answers, for a tile of rows and heads of one batch, which
key runs it must visit (empty key blocks skipped), which of them need the mask_mod
(partial blocks) and which need no test at all (full blocks); and it evaluates the
mask_mod and the score_mod on a tile's NumPy index arrays, always in global positions
(a block of a larger call adds ``spec.row0``/``col0``, ``head0`` and its batch ids), so
the results do not depend on how a call is cut.

The block mask's table is reduced once per (batch, head range) to two boolean
``(nq, nk)`` tables (some pair of the block takes part / every pair does); row groups
are then planned from those tables with a handful of NumPy operations, never pair by
pair.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from .. import mask_mods as mm
from ..block_mask import FULL, create_block_mask, mod_allowed
from ..spec import AttentionSpec
from ..structure import Structure
from .layout import _blocked_out

__all__ = ["FlexPlan", "Run", "MERGE_SLACK"]

Run = tuple[int, int, int]
"""``(a, b, masked)``: keys ``[a, b)`` to visit; ``masked``: 0 (False) no test (full
blocks), 1 (True) the mask_mod is evaluated, :data:`BAND` only the causal band
``kv_idx <= q_idx`` excludes (a causal document mask within one document)."""

BAND = 2
"""A run's ``masked`` value: the cached causal band pattern, nothing evaluated."""
_CAUSAL = Structure(0, -1, 0)

MERGE_SLACK = 1.5
"""Consecutive query blocks share a tile while the keys their union visits cost at most
this much more than visiting each block's own keys (a tile that crosses a document
boundary would otherwise compute the previous document's keys for the next one's rows)."""


class FlexPlan:
    """What the fast path needs of ``spec``'s mask_mod, block mask and score_mod."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.mod = spec.mask_mod
        bm = spec.block_mask if spec.mask_mod is not None else None
        # Planning reads a finer table than the user's where the mask_mod classifies
        # blocks from index ranges (the built-ins): fewer pairs computed outside the
        # mask (a query block that crosses a document boundary) and fewer evaluated.
        self.bm: Any = None if bm is None else _fine(bm)
        self.smod = spec.score_mod
        self.rows = np.arange(spec.row0, spec.row0 + spec.L, dtype=np.int32).reshape(-1, 1)
        self.cols = np.arange(spec.col0, spec.col0 + spec.S, dtype=np.int32)
        self._tables: dict[tuple[Any, Any], tuple[np.ndarray, np.ndarray]] = {}
        self._heads: dict[tuple[int, int], np.ndarray] = {}
        self._batch: dict[int, np.ndarray] = {}
        self._docs: dict[int, dict[int, tuple[int, int] | None]] = {}
        self._starts: dict[int, np.ndarray] = {}
        self._q_contiguous: dict[int, bool] = {}

    # -- indices ---------------------------------------------------------------------
    def batch_id(self, bi: int) -> int:
        return int(self.spec.original_ids(bi, 0)[0])

    def indices(
        self, bi: int, h0: int, h1: int, r0: int, r1: int, c0: int, c1: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(b, h, q_idx, kv_idx)`` int32 global indices of a tile, shaped ``(1, 1, 1)``,
        ``(heads, 1, 1)``, ``(rows, 1)`` and ``(keys,)``."""
        b = self._batch.get(bi)
        if b is None:
            b = np.full((1, 1, 1), self.batch_id(bi), np.int32)
            self._batch[bi] = b
        h = self._heads.get((h0, h1))
        if h is None:
            h0g = self.spec.head0 + h0
            h = np.arange(h0g, h0g + (h1 - h0), dtype=np.int32).reshape(-1, 1, 1)
            self._heads[(h0, h1)] = h
        return b, h, self.rows[r0:r1], self.cols[c0:c1]

    def allowed(self, bi: int, h0: int, h1: int, r0: int, r1: int, c0: int, c1: int) -> Any:
        """The mask_mod on a tile (NumPy bool, broadcastable to ``(heads, rows, keys)``)."""
        out = mod_allowed(self.mod, *self.indices(bi, h0, h1, r0, r1, c0, c1))
        if not isinstance(out, np.ndarray):
            raise TypeError(
                f"mask_mod {self.mod!r} returned a {type(out).__name__} on NumPy index "
                "arrays: the NumPy fast path needs NumPy results"
            )
        return out

    def mask(self, s3: np.ndarray, scratch: np.ndarray, bi: int, h0: int, h1: int,
             r0: int, r1: int, c0: int, c1: int, masked: int = 1) -> None:  # fmt: skip
        """``s3`` (``(heads, rows, keys)``) set to ``-inf`` where the mask_mod excludes
        (``scratch``: a bool buffer shaped like ``s3``; ``masked``: the run's)."""
        spec = self.spec
        if masked == BAND:
            band = _blocked_out(
                _CAUSAL, r0 + spec.row0, r1 + spec.row0, c0 + spec.col0, c1 + spec.col0
            )
            if band is not None:
                np.copyto(s3, -np.inf, where=band)
            return
        excluded = _excluded(
            self.mod, self, bi, r0 + spec.row0, r1 + spec.row0, c0 + spec.col0,
            c1 + spec.col0, scratch[0],
        )  # fmt: skip
        if excluded is _GENERIC:
            allowed = self.allowed(bi, h0, h1, r0, r1, c0, c1)
            excluded = np.logical_not(allowed, out=scratch)
        if excluded is not None:
            np.copyto(s3, -np.inf, where=excluded)

    def score(self, s3: np.ndarray, bi: int, h0: int, h1: int, r0: int, r1: int,
              c0: int, c1: int, grad: bool = False) -> np.ndarray | None:  # fmt: skip
        """Apply the score_mod to ``s3`` (``(heads, rows, keys)``) in place; with
        ``grad``, return its derivative at the old scores (``None``: 1 everywhere)."""
        smod = self.smod
        idx = self.indices(bi, h0, h1, r0, r1, c0, c1)
        d = None
        if grad and smod.differentiable:
            g = smod.grad(s3, *idx)
            if g is not None:
                d = np.asarray(g)
                if d.dtype != s3.dtype or np.may_share_memory(d, s3):  # (s3 changes next)
                    d = d.astype(s3.dtype)
        res = smod(s3, *idx)
        if res is not s3:
            if not isinstance(res, (np.ndarray, np.generic)):
                raise TypeError(
                    f"score_mod {smod!r} returned a {type(res).__name__} on NumPy arrays: "
                    "the NumPy fast path needs NumPy results"
                )
            np.copyto(s3, res, casting="unsafe")
        return d

    # -- block lookups ---------------------------------------------------------------
    def _one_document(self, bi: int, r0: int, r1: int, c0: int, c1: int) -> list[Run] | None:
        """Exact runs for rows ``[r0, r1)`` that all belong to one document of a
        built-in document mask whose keys of that document are one contiguous run:
        those keys only, full up to the diagonal of the first row when causal, the
        diagonal band partial (its mask is then the cached causal pattern). ``None``
        when that does not apply (other mask_mods, rows of several documents)."""
        mod = self.mod
        if not isinstance(mod, mm._Document):
            return None
        spec = self.spec
        g0, g1 = r0 + spec.row0, r1 + spec.row0
        qh, kh = mod._host
        bid = self.batch_id(bi)
        qrow = qh if qh.ndim == 1 else qh[bid if qh.shape[0] > 1 else 0]
        d = int(qrow[g0])
        if qrow[g1 - 1] != d:
            return None
        if not self._contiguous(qrow, 0 if qh.ndim == 1 or qh.shape[0] == 1 else bid):
            qd = qrow[g0:g1]
            if qd.min() != d or qd.max() != d:
                return None
        span = self._doc_keys(mod, kh if kh.ndim == 1 else kh[bid if kh.shape[0] > 1 else 0],
                              0 if kh.ndim == 1 or kh.shape[0] == 1 else bid, d)  # fmt: skip
        if span is None:
            return None
        if span == (0, 0):  # the document has no key
            return []
        lo, hi = max(c0, span[0] - spec.col0), min(c1, span[1] - spec.col0)
        if not mod.causal:
            return [(lo, hi, False)] if hi > lo else []
        full_hi = min(hi, g0 + 1 - spec.col0)  # keys <= the first row's position
        band_hi = min(hi, g1 - spec.col0)  # keys <= the last row's position
        runs: list[Run] = []
        if full_hi > lo:
            runs.append((lo, full_hi, False))
        if band_hi > max(lo, full_hi):
            runs.append((max(lo, full_hi), band_hi, BAND))
        return runs

    def _contiguous(self, ids: np.ndarray, key: int) -> bool:
        """True when every id of ``ids`` is one contiguous run (packed documents): then
        rows whose first and last ids agree are all of that document (cached)."""
        got = self._q_contiguous.get(key)
        if got is None:
            starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
            got = len(set(ids[starts].tolist())) == len(starts)
            self._q_contiguous[key] = got
        return got

    def _doc_keys(self, mod: Any, kh: np.ndarray, key: int, d: int) -> tuple[int, int] | None:
        """``[first, last + 1)`` of document ``d`` in the key ids ``kh`` when its keys are
        contiguous there, ``(0, 0)`` when it has none, else ``None`` (cached per call)."""
        cache = self._docs.get(key)
        if cache is None:
            # Run starts and ids of the packed sequence: one pass, then dict lookups.
            starts = np.flatnonzero(np.concatenate(([True], kh[1:] != kh[:-1])))
            ids = kh[starts].tolist()
            stops = [*starts[1:].tolist(), int(kh.shape[0])]
            cache = {}
            for i, a, b in zip(ids, starts.tolist(), stops, strict=True):
                cache[i] = None if i in cache else (a, b)  # a second run: not contiguous
            self._docs[key] = cache
        return cache.get(d, (0, 0))

    def _table(self, bi: int, h0: int, h1: int) -> tuple[np.ndarray, np.ndarray]:
        """``(nonempty, full)`` bool ``(nq, nk)`` for batch ``bi`` and heads ``[h0, h1)``
        (nonempty for any of the heads, full for all of them)."""
        bm = self.bm
        assert bm is not None
        kinds = bm.kinds
        bkey = None if kinds.shape[0] == 1 else self.batch_id(bi)
        hkey = None if kinds.shape[1] == 1 else (self.spec.head0 + h0, self.spec.head0 + h1)
        key = (bkey, hkey)
        got = self._tables.get(key)
        if got is None:
            k = kinds[0 if bkey is None else bkey]
            k = k[:1] if hkey is None else k[hkey[0] : hkey[1]]
            got = ((k != 0).any(axis=0), (k == FULL).all(axis=0))
            self._tables[key] = got
        return got

    def row_groups(
        self, bi: int, h0: int, h1: int, r0: int, r1: int, c0: int, c1: int, max_rows: int
    ) -> list[tuple[int, int, list[Run]]]:
        """Rows ``[r0, r1)`` and keys ``[c0, c1)`` of a tile as groups
        ``(ra, rb, runs)`` of at most ``max_rows`` rows: rows that see no key are left
        out; consecutive query blocks share a group while that costs little
        (:data:`MERGE_SLACK`)."""
        if r1 <= r0 or c1 <= c0:
            return []
        if self.bm is None:
            every: list[Run] = [(c0, c1, int(self.mod is not None))]
            return [(a, b, every) for a, b in _spans(r0, r1, max_rows)]
        cuts = self._document_starts(bi, r0, r1)
        if cuts is None:
            return self._table_groups(bi, h0, h1, r0, r1, c0, c1, max_rows)
        # A document mask: each document's rows on their own, in spans from its first
        # row (as one call per document would), each visiting exactly its document's
        # keys (_one_document); the table only where a document's keys are not one run.
        out: list[tuple[int, int, list[Run]]] = []
        inner = cuts[(cuts > r0) & (cuts < r1)].tolist()
        for sa, sb in zip([r0, *inner], [*inner, r1], strict=True):
            if self._one_document(bi, sa, sb, c0, c1) is None:
                out.extend(self._table_groups(bi, h0, h1, sa, sb, c0, c1, max_rows))
                continue
            if self.mod.causal:  # rows before the first key see none of these keys
                sa = max(sa, c0 + self.spec.col0 - self.spec.row0)
            for a, b in _spans(sa, sb, max_rows):
                own = self._one_document(bi, a, b, c0, c1)
                if own:
                    out.append((a, b, own))
        return out

    def _table_groups(
        self, bi: int, h0: int, h1: int, r0: int, r1: int, c0: int, c1: int, max_rows: int
    ) -> list[tuple[int, int, list[Run]]]:
        """:meth:`row_groups` from the block table."""
        spec, bm = self.spec, self.bm
        qb, kb = bm.Q_BLOCK, bm.KV_BLOCK
        g0, g1 = r0 + spec.row0, r1 + spec.row0
        qa, qz = g0 // qb, -(-g1 // qb)
        ka, kz = (c0 + spec.col0) // kb, -(-(c1 + spec.col0) // kb)
        ne_t, fu_t = self._table(bi, h0, h1)
        ne = ne_t[qa:qz, ka:kz]
        fu = fu_t[qa:qz, ka:kz]
        # Widths of the key blocks, clipped to [c0, c1) (the first and last may be cut).
        edges = np.clip(np.arange(ka, kz + 1) * kb - spec.col0, c0, c1)
        widths = np.diff(edges)
        cost = ne @ widths  # keys each query block visits
        # Segments of consecutive query blocks with the same blocks (below a causal
        # diagonal: all of them), so the loop below runs per segment, not per block.
        code = ne.astype(np.int8) + fu.astype(np.int8)
        change = np.ones(code.shape[0], bool)
        change[1:] = (code[1:] != code[:-1]).any(axis=1)
        starts = np.flatnonzero(change).tolist()
        stops = [*starts[1:], code.shape[0]]
        groups: list[tuple[int, int, np.ndarray, np.ndarray, float]] = []
        for i, stop in zip(starts, stops, strict=True):
            if not cost[i]:
                continue
            ra = max(r0, (qa + i) * qb - spec.row0)
            rb = min(r1, (qa + stop) * qb - spec.row0)
            own = float(cost[i]) * (rb - ra)
            if groups:
                pa, pb, pne, pfu, pcost = groups[-1]
                if pb == ra and rb - pa <= max_rows:
                    une = pne | ne[i]
                    if float(une @ widths) * (rb - pa) <= MERGE_SLACK * (pcost + own):
                        groups[-1] = (pa, rb, une, pfu & fu[i], pcost + own)
                        continue
            groups.append((ra, rb, ne[i], fu[i], own))
        out: list[tuple[int, int, list[Run]]] = []
        for ra, rb, gne, gfu, _ in groups:
            runs = _runs(gne, gfu, edges)
            out.extend((a, b, runs) for a, b in _spans(ra, rb, max_rows))
        return out

    def _document_starts(self, bi: int, r0: int, r1: int) -> np.ndarray | None:
        """Local rows of ``[r0, r1)`` where a new document starts (a built-in document
        mask), else ``None``."""
        mod = self.mod
        if not isinstance(mod, mm._Document):
            return None
        qh = mod._host[0]
        key = 0 if qh.ndim == 1 or qh.shape[0] == 1 else self.batch_id(bi)
        starts = self._starts.get(key)
        if starts is None:
            row = qh if qh.ndim == 1 else qh[key]
            starts = np.flatnonzero(row[1:] != row[:-1]) + 1 - self.spec.row0
            self._starts[key] = starts
        return starts

    def runs(self, bi: int, h0: int, h1: int, r0: int, r1: int, c0: int, c1: int) -> list[Run]:
        """The key runs rows ``[r0, r1)`` visit within ``[c0, c1)`` (all of them as one
        group)."""
        if r1 <= r0 or c1 <= c0:
            return []
        if self.bm is None:
            return [(c0, c1, self.mod is not None)]
        trimmed = self._one_document(bi, r0, r1, c0, c1)
        if trimmed is not None:
            return trimmed
        spec, bm = self.spec, self.bm
        qb, kb = bm.Q_BLOCK, bm.KV_BLOCK
        qa, qz = (r0 + spec.row0) // qb, -(-(r1 + spec.row0) // qb)
        ka, kz = (c0 + spec.col0) // kb, -(-(c1 + spec.col0) // kb)
        ne_t, fu_t = self._table(bi, h0, h1)
        ne = np.asarray(ne_t[qa:qz, ka:kz].any(axis=0))
        fu = np.asarray(fu_t[qa:qz, ka:kz].all(axis=0))
        edges = np.clip(np.arange(ka, kz + 1) * kb - spec.col0, c0, c1)
        return _runs(ne, fu, edges)


_GENERIC: Any = object()
"""Returned by :func:`_excluded` for a mask_mod it has no NumPy shortcut for."""


def _excluded(
    mod: Any, plan: FlexPlan, bi: int, g0: int, g1: int, k0: int, k1: int, scratch: Any
) -> Any:
    """The pairs a built-in mask_mod excludes from global rows ``[g0, g1)`` and keys
    ``[k0, k1)``, as a bool array broadcastable to ``(rows, keys)`` (in ``scratch`` when
    given, else new or a cached read-only pattern), ``None`` when it excludes nothing, or
    :data:`_GENERIC` when ``mod`` has no shortcut (then it is called on index arrays).

    The shortcuts read what the built-ins hold on the host (document ids, bounds) and
    slice them (indices are contiguous), and reuse the fast path's cached band patterns:
    a block that lies within one document of a causal document mask is just the causal
    pattern, with no document id compared."""
    if isinstance(mod, mm._Noop):
        return None
    if isinstance(mod, mm._Window):
        return _blocked_out(Structure(mod.offset, mod.left, mod.right), g0, g1, k0, k1)
    if isinstance(mod, mm._Global):
        rows = plan.rows[g0 - plan.spec.row0 : g1 - plan.spec.row0] >= mod.n
        cols = plan.cols[k0 - plan.spec.col0 : k1 - plan.spec.col0] >= mod.n
        return np.logical_and(rows, cols, out=scratch)
    if isinstance(mod, mm._Document):
        qh, kh = mod._host
        if qh.ndim == 2:
            qh = qh[plan.batch_id(bi) if qh.shape[0] > 1 else 0]
        if kh.ndim == 2:
            kh = kh[plan.batch_id(bi) if kh.shape[0] > 1 else 0]
        qd, kd = qh[g0:g1], kh[k0:k1]
        band = _blocked_out(Structure(0, -1, 0), g0, g1, k0, k1) if mod.causal else None
        q_lo, q_hi, k_lo, k_hi = qd.min(), qd.max(), kd.min(), kd.max()
        if q_lo == q_hi == k_lo == k_hi:  # one document: the causal band (or nothing)
            return band
        out = np.not_equal(qd[:, None], kd[None, :], out=scratch)
        if band is not None:
            np.logical_or(out, band, out=out)
        return out
    if isinstance(mod, mm._Combined):
        parts = [_excluded(m, plan, bi, g0, g1, k0, k1, None) for m in mod.mods]
        if any(p is _GENERIC for p in parts):
            return _GENERIC
        out = None
        for p in parts:
            if mod.op == "and":  # excluded by any part
                if p is None:
                    continue
                out = p if out is None else np.logical_or(out, p)
            else:  # excluded by every part
                if p is None:
                    return None
                out = p if out is None else np.logical_and(out, p)
        if out is not None and scratch is not None:
            np.copyto(scratch, out)  # (cached patterns stay read-only)
            return scratch
        return out
    return _GENERIC


FINE_BLOCKS = (64, 32)
"""Query and key block sizes of the finer table the fast path plans with, for mask_mods
classified from index ranges (at most the block mask's own sizes)."""
_FINE_ENTRIES = 1 << 24
"""Largest finer table (entries, int8); above it the block mask's own table is used."""
_FINE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_FINE_LOCK = threading.Lock()


def _fine(bm: Any) -> Any:
    """``bm``, or a finer block mask of the same mask_mod (cached with ``bm``) when its
    mask_mod classifies blocks from ranges alone (no pair is evaluated to build it)."""
    qb, kb = min(bm.Q_BLOCK, FINE_BLOCKS[0]), min(bm.KV_BLOCK, FINE_BLOCKS[1])
    if (qb, kb) == (bm.Q_BLOCK, bm.KV_BLOCK) or not mm.classifiable(bm.mask_mod):
        return bm
    B, H, L, S = bm.shape
    if bm.kinds.shape[0] * bm.kinds.shape[1] * -(-L // qb) * -(-S // kb) > _FINE_ENTRIES:
        return bm
    with _FINE_LOCK:
        fine = _FINE.get(bm)
        if fine is None:
            fine = create_block_mask(bm.mask_mod, B, H, L, S, block_size=(qb, kb), xp=np)
            _FINE[bm] = fine
    return fine


def _runs(ne: np.ndarray, fu: np.ndarray, edges: np.ndarray) -> list[Run]:
    """Runs of consecutive non-empty key blocks of one kind (full, or not) from per-block
    flags and the blocks' (clipped) edges."""
    code = np.where(ne, np.where(fu, 2, 1), 0)
    if code.size == 0:
        return []
    change = np.flatnonzero(code[1:] != code[:-1]) + 1
    starts = [0, *change.tolist()]
    stops = [*change.tolist(), code.size]
    out: list[Run] = []
    for s, e in zip(starts, stops, strict=True):
        c = int(code[s])
        a, b = int(edges[s]), int(edges[e])
        if c and b > a:
            out.append((a, b, c == 1))
    return out


def _spans(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]
