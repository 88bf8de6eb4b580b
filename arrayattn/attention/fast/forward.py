"""The NumPy fast path's forward: GQA-stacked tiles, split-KV and an LSE merge.

A tile is ``(batch, KV head, the query heads of its group, a block of query rows)``: the
rows of every query head that reads the same KV head are stacked into one
``(heads * rows, E)`` operand, so one BLAS product ``(G*L, E) @ (E, S)`` reads K (and
one reads V) once per group instead of once per query head. Decode (a few query rows
over a long KV cache) is memory-bound, and this is what makes it run at the speed K and
V stream from memory.

When there are fewer tiles than worker threads (``B * Hkv`` small, decode), each tile's
key range is cut into contiguous splits run on different threads; every split gives a
partial output and LSE over its keys (an empty split: output 0, LSE ``-inf``), and the
splits merge exactly through their LSEs (``SEMANTICS.md``: partial results over
disjoint key sets).

Within a tile the work per key block is a fixed handful of NumPy calls (scores product,
``exp`` in place, row sums as a product with ones, the value product); the row maximum
is skipped when a bound shows ``exp`` cannot overflow (see ``_numpy_fast``). For few
query rows (``L <= 16``) a tile takes all of its keys in one block when they fit
:data:`DECODE_BLOCK_ELEMENTS`, so the Python work per call does not grow with ``S``.
"""

from __future__ import annotations

import numpy as np

from .. import stacked as _stacked
from .. import threads as _fast_threads
from ..dropout import dropout_keep
from ..spec import AttentionSpec
from ..threads import _fork_safe, _run_units, checkpoint
from . import layout as _nf
from .flex import FlexPlan

__all__ = ["forward", "tile_plan", "DECODE_BLOCK_ELEMENTS", "MIN_SPLIT_KEYS"]

DECODE_BLOCK_ELEMENTS = 1 << 20
"""Largest ``rows x keys`` block (4 MiB in float32) of a tile with at most
:data:`DECODE_ROWS` stacked rows: few rows over a long cache take their keys in one
block, so the per-call Python work does not scale with ``S``."""
DECODE_ROWS = 128
"""Stacked rows (query heads of a group times query rows) up to which a tile is
treated as decode-like (see :data:`DECODE_BLOCK_ELEMENTS`)."""
STATIC_MIN_ROWS = 128
"""Stacked rows per tile from which the forward computes the static score bound."""
MIN_SPLIT_KEYS = 1024
"""Fewest keys a split-KV part gets: below that, a thread's dispatch costs more than the
keys' reading saves."""


def _head_groups(spec: AttentionSpec, heads: int) -> list[tuple[int, int, int]]:
    """``(kv_head, first query head, stop)`` for each set of query heads sharing one KV
    head (the GQA group; all heads when K/V have a single head, or when a tile takes
    every head: ``heads == Hq``, see :func:`all_heads`)."""
    if spec.Hkv == 1 or heads == spec.Hq:
        return [(0, 0, spec.Hq)]
    return [(hk, hk * spec.G, (hk + 1) * spec.G) for hk in range(spec.Hkv)]


def tile_plan(spec: AttentionSpec) -> tuple[int, int, int]:
    """``(rows per head, heads per tile, key-block width)`` of the forward's tiles:
    about :data:`~arrayattn.attention.fast.layout.FWD_ROWS` stacked rows per tile (all the
    heads of a GQA group when the query rows are few; every head of the row, all its KV
    heads, for decode, see :func:`all_heads`), and a key block of ``BLOCK_ELEMENTS / rows``
    keys (:data:`DECODE_BLOCK_ELEMENTS` for decode-like tiles).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 32, 1, 128), np.float32); kv = np.ones((1, 8, 4096, 128), np.float32)
        >>> spec = make_spec(q, kv, kv, None, 0.0, False, None, True, "top_left", None,
        ...                  None, None)
        >>> tile_plan(spec)  # 32 heads (8 KV heads) x 1 row, all 4096 keys in one block
        (1, 32, 4096)
    """
    group = spec.Hq if spec.Hkv == 1 else spec.G
    n = min(spec.L, max(1, _nf.FWD_ROWS // group))
    heads = min(group, max(1, _nf.FWD_ROWS // n))
    if all_heads(spec, n, heads):
        heads = spec.Hq
    rows = heads * n
    budget = DECODE_BLOCK_ELEMENTS if spec.L <= 16 and rows <= DECODE_ROWS else _nf.BLOCK_ELEMENTS
    budget = max(budget, _nf.BLOCK_ELEMENTS)
    width = max(1, min(spec.S, budget // rows))
    return n, heads, width


def all_heads(spec: AttentionSpec, n: int, heads: int) -> bool:
    """True when a tile takes every query head of its row, over all KV heads at once
    (batched products, one per KV head in one NumPy call): decode (``L <= 16``) whose
    tiles already take whole GQA groups and whose row's heads stay within
    :data:`DECODE_ROWS` stacked rows. The Python work per call then scales with the
    batch, not with batch x KV heads (a ragged batch of 8 rows x 8 KV heads: 8 tiles,
    not 64)."""
    group = spec.Hq if spec.Hkv == 1 else spec.G
    return (
        spec.Hkv > 1
        and spec.L <= 16
        and heads == group
        and spec.Hq * n <= DECODE_ROWS
    )


class _State:
    """One worker's buffers for tiles of at most ``rows`` stacked rows."""

    def __init__(self, rows: int, keys: int, E: int, Ev: int, cd: np.dtype):
        self.s = _nf._Scratch(rows, keys, cd)
        self.bool = _nf._Scratch(rows, keys, np.bool_)
        self.q = np.empty((rows, E), cd)
        self.acc = np.empty((rows, Ev), cd)
        self.acc_tmp = np.empty((rows, Ev), cd)
        self.l_tmp = np.empty((rows,), cd)
        self.ones = np.ones((keys,), cd)


@_fork_safe
def forward(
    spec: AttentionSpec,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention output ``(..., Hq, L, Ev)`` in the input dtype and LSE ``(..., Hq, L)``
    in float32 (float64 for float64 inputs), as :func:`arrayattn.attention.composed.forward`,
    computed tile by tile. Users reach it through ``scaled_dot_product_attention``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> q = np.ones((1, 8, 1, 4), dtype=np.float32)
        >>> kv = np.ones((1, 2, 64, 4), dtype=np.float32)
        >>> aa.scaled_dot_product_attention(q, kv, kv, enable_gqa=True,
        ...                                 implementation="fast").shape
        (1, 8, 1, 4)
    """
    if spec.stack_kv:  # K/V broadcast over the batch: all rows in each group's tiles
        return _stacked.forward(forward, spec, query, key, value, attn_mask)
    lay = _nf._Layout(spec, query, key, value, attn_mask)
    cd = lay.cd
    nb = len(lay.lead_index)
    n, heads, width = tile_plan(spec)
    lay.prepare_garbage(lazy_values=True)
    # The static bound needs a pass over all of K (its row norms): worth it when the
    # passes it saves over each tile's scores (the row max and the shift) cost more,
    # i.e. with many stacked rows; decode tiles read K once, in the product, instead.
    # Non-finite values: the exact path, which tracks the rows that attend to them.
    use_static = heads * n >= STATIC_MIN_ROWS and lay.v_bad is None
    static_bound = _nf._static_bounds(spec, lay) if use_static else None

    # mask_mod/score_mod (arrayattn.flex): rows grouped by the key blocks they visit.
    plan = FlexPlan(spec) if spec.flex else None
    lay.flex = plan

    # Tiles: (batch, KV head, head chunk of its group, row block) with their key range.
    tiles = []
    for bi in range(nb):
        st_b = lay.structs[bi]
        for hk, g0, g1 in _head_groups(spec, heads):
            for h0 in range(g0, g1, heads):
                h1 = min(h0 + heads, g1)
                for r0, r1 in _row_spans(plan, bi, h0, h1, spec.L, lay.kv_len[bi], n):
                    rv = min(r1, lay.q_len[bi])
                    lo, hi = st_b.col_range(r0, rv, lay.kv_len[bi]) if rv > r0 else (0, 0)
                    if plan is not None and plan.bm is not None and hi > lo:
                        runs = plan.runs(bi, h0, h1, r0, rv, lo, hi)
                        lo, hi = (runs[0][0], runs[-1][1]) if runs else (lo, lo)
                    tiles.append((bi, hk, h0, h1, r0, r1, lo, max(lo, hi)))

    work = nb * spec.Hq * spec.L * spec.S * (spec.E + spec.Ev)
    serial = work < _nf._SERIAL_WORK * 4  # about 0.2 ms of products: the pool costs more
    threads = _fast_threads.num_threads()
    splits = 1
    if not serial and threads > 1 and len(tiles) < threads:
        longest = max(hi - lo for *_, lo, hi in tiles)
        splits = max(1, min(-(-threads // len(tiles)), longest // MIN_SPLIT_KEYS))

    out_shape = spec.lead + (spec.Hq, spec.L, spec.Ev)
    lse_shape = spec.lead + (spec.Hq, spec.L)
    if splits == 1:
        out = np.empty(out_shape, cd)
        lse = np.empty(lse_shape, cd)
        outs, lses = out[None], lse[None]
    else:
        outs = np.empty((splits,) + out_shape, cd)
        lses = np.empty((splits,) + lse_shape, cd)

    units = []
    for t in tiles:
        bi, hk, h0, h1, r0, r1, lo, hi = t
        step = -(-(hi - lo) // splits) if hi > lo else 0
        for part in range(splits):
            c0 = min(hi, lo + part * step)
            c1 = min(hi, c0 + step) if splits > 1 else hi
            units.append((c1 - c0, part, bi, hk, h0, h1, r0, r1, c0, c1))
    units.sort(key=lambda u: -u[0])  # longest first balances causal work

    def make_state():
        return _State(heads * n, width, spec.E, spec.Ev, cd)

    def run(state, unit):
        _, part, bi, hk, h0, h1, r0, r1, c0, c1 = unit
        b = lay.lead_index[bi]
        rows = b + (slice(h0, h1), slice(r0, r1))
        _tile(
            spec,
            lay,
            state,
            static_bound,
            bi,
            hk,
            h0,
            h1,
            r0,
            r1,
            c0,
            c1,
            width,
            outs[(part,) + rows],
            lses[(part,) + rows],
        )

    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        _run_units(units, make_state, run, serial)
        if splits == 1:
            out, lse = outs[0], lses[0]
        else:
            out, lse = merge_splits(outs, lses)
        _nf._merge_sinks(lay, out, lse)  # gpt-oss sinks: once, after the splits merge

    out_user = out.astype(spec.dtype, copy=False).reshape(spec.out_shape)
    return out_user, lse.reshape(spec.lse_shape)


def _row_spans(
    plan: FlexPlan | None, bi: int, h0: int, h1: int, L: int, S: int, n: int
) -> list[tuple[int, int]]:
    """Row blocks of at most ``n`` rows covering ``[0, L)``: plain spans, or with a block
    mask the planned groups of query blocks (:meth:`FlexPlan.row_groups`), with the rows
    that see no key in spans of their own (written as empty rows)."""
    if plan is None or plan.bm is None:
        return _nf._spans(0, L, n)
    out: list[tuple[int, int]] = []
    at = 0
    for ra, rb, _ in plan.row_groups(bi, h0, h1, 0, L, 0, S, n):
        if ra > at:
            out.extend(_nf._spans(at, ra, n))
        out.append((ra, rb))
        at = rb
    if at < L:
        out.extend(_nf._spans(at, L, n))
    return out


def merge_splits(outs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact merge of partial results over disjoint key sets (axis 0): weights
    ``exp(lse_i - lse)``, ``lse = logsumexp_i lse_i``; parts with LSE ``-inf`` (no key)
    weigh nothing and a row empty in every part stays output 0, LSE ``-inf``."""
    m = np.max(lses, axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0).astype(lses.dtype, copy=False)
    w = np.exp(lses - m_safe)
    total = np.sum(w, axis=0)
    nonempty = total > 0
    safe = np.where(nonempty, total, 1.0).astype(lses.dtype, copy=False)
    out = np.einsum("p...,p...d->...d", w, outs) / safe[..., None]
    lse = np.where(nonempty, m_safe + np.log(safe), -np.inf).astype(lses.dtype, copy=False)
    return out, lse


def _tile(spec, lay, st, static_bound, bi, hk, h0, h1, r0, r1, c0, c1, width, out_t, lse_t):
    """One tile's (or split's) output ``(heads, rows, Ev)`` and LSE ``(heads, rows)``
    into the views ``out_t``/``lse_t``; keys ``[c0, c1)`` only."""
    b = lay.lead_index[bi]
    valid = min(r1, lay.q_len[bi])  # rows from q_len on are empty
    if valid < r1:
        cut = max(valid, r0) - r0
        out_t[:, cut:] = 0
        lse_t[:, cut:] = -np.inf
        if valid <= r0:
            return
        out_t, lse_t, r1 = out_t[:, :cut], lse_t[:, :cut], valid
    if c1 <= c0:
        out_t[...] = 0
        lse_t[...] = -np.inf
        return
    checked = lay.values_checked  # before the products read lay.v_op / lay.v_bad
    static = False
    if static_bound is not None:
        bound, room = static_bound
        static = float(bound[b + (slice(h0, h1), slice(r0, r1))].max()) + room <= lay.limit
    args = (spec, lay, st, bi, hk, h0, h1, r0, r1, c0, c1, width, out_t, lse_t)
    if not (static and _rows(*args, static=True)):
        _rows(*args, static=False)
    if checked:
        return
    # Garbage in V may have met a zero weight: check V (once), then redo the tile on the
    # exact path, which keeps excluded garbage out and poisons rows that use it. A check
    # that another tile ran meanwhile may have changed the operands mid-tile: redo too.
    if lay.values_checked_now() or not np.isfinite(out_t).all():
        lay.check_values()
        _rows(*args, static=False)


def _rows(spec, lay, st, bi, hk, h0, h1, r0, r1, c_lo, c_hi, width, out_t, lse_t, static):
    """The stacked rows of one tile over keys ``[c_lo, c_hi)``. Returns ``False`` (having
    written nothing) when the static path's row sums underflowed and the exact path must
    redo the tile."""
    b = lay.lead_index[bi]
    nh, n = h1 - h0, r1 - r0
    R = nh * n
    # KV heads of the tile: one, or all of them (decode, all_heads) as batched products.
    nkv = 1 if spec.Hkv == 1 or nh <= spec.G else nh // spec.G
    kv_heads = hk if nkv == 1 else slice(hk, hk + nkv)
    cd = lay.cd
    factor = spec.scale if spec.softcap is None else spec.scale / spec.softcap
    q_t = st.q[:R]
    np.multiply(lay.q[b + (slice(h0, h1), slice(r0, r1))], factor, out=q_t.reshape(nh, n, -1))
    acc = st.acc[:R]
    l_sum = np.zeros((R,), cd)
    m = None if static else np.full((R,), -np.inf, cd)
    dropout = spec.dropout_p > 0
    structure = lay.structs[bi]
    first = True
    # P @ bad: non-zero on rows giving weight to a non-finite value row (made NaN).
    touched = None if lay.v_bad is None else np.zeros((R,), cd)
    plan = lay.flex
    for c0, c1, masked in _key_spans(plan, structure, bi, h0, h1, r0, r1, c_lo, c_hi, width):
        checkpoint()  # an abandoned call (interrupt, a failed unit) stops here
        w = c1 - c0
        s = st.s[:R, :w]
        k_blk = lay.k[b + (kv_heads, slice(c0, c1))]
        if nkv == 1:
            np.matmul(q_t, k_blk.T, out=s)
        else:  # (nkv, rows of a group, E) @ (nkv, E, w)
            np.matmul(q_t.reshape(nkv, -1, q_t.shape[-1]), k_blk.transpose(0, 2, 1),
                      out=s.reshape(nkv, -1, w))  # fmt: skip
        if spec.softcap is not None:
            np.tanh(s, out=s)
            np.multiply(s, spec.softcap, out=s)
        s3 = s.reshape(nh, n, w)  # the stacked rows, head by head
        if lay.alibi is not None:  # ALiBi after the softcap: -slope_h * |i + offset - j|
            dist = _nf._alibi_distance(structure, r0, r1, c0, c1, cd)
            slopes = lay.alibi[b + (slice(h0, h1),)].reshape(nh, 1, 1)
            np.subtract(s3, slopes * dist, out=s3)
        if plan is not None and plan.smod is not None:  # score_mod: after softcap and ALiBi
            plan.score(s3, bi, h0, h1, r0, r1, c0, c1)
        if lay.mask is not None:
            um = lay.mask[b + (slice(h0, h1), slice(r0, r1), slice(c0, c1))]
            if spec.mask_kind == "float":
                np.add(s3, um, out=s3)
                if lay.qk_garbage:  # garbage score + (-inf) is NaN: -inf still excludes
                    np.copyto(s3, -np.inf, where=np.isneginf(um))
            else:
                excluded = np.logical_not(um, out=st.bool[:R, :w].reshape(nh, n, w))
                np.copyto(s3, -np.inf, where=excluded)
        blocked = _nf._blocked_out(structure, r0, r1, c0, c1)
        if blocked is not None:
            np.copyto(s3, -np.inf, where=blocked)  # (n, w): the same for every head
        if masked:  # a partial block of the block mask: the mask_mod, pair by pair
            assert plan is not None
            plan.mask(s3, st.bool[:R, :w].reshape(nh, n, w), bi, h0, h1, r0, r1, c0, c1, masked)
        if static:
            np.exp(s, out=s)
        else:
            assert m is not None  # set when not static
            m_new = np.maximum(m, np.max(s, axis=1))
            shift = np.where(np.isfinite(m_new), m_new, 0.0).astype(cd, copy=False)
            if not first:
                alpha = np.exp(m - shift)  # m = -inf gives 0: nothing accumulated yet
                np.multiply(acc, alpha[:, None], out=acc)
                np.multiply(l_sum, alpha, out=l_sum)
                if touched is not None:
                    np.multiply(touched, alpha, out=touched)
            m = m_new
            np.subtract(s, shift[:, None], out=s)
            np.exp(s, out=s)
        np.add(l_sum, np.matmul(s, st.ones[:w], out=st.l_tmp[:R]), out=l_sum)
        if dropout:
            # Global positions: a block of a larger call adds its origins (as_block).
            # (Stacked rows: the original row and head, AttentionSpec.original_ids.)
            b_id, heads_id = spec.original_ids(bi, np.arange(h0, h1, dtype=np.int32))
            keep = dropout_keep(
                np,
                spec.seed,
                spec.dropout_p,
                np.asarray(b_id, dtype=np.int32).reshape(-1, 1, 1),
                np.asarray(heads_id, dtype=np.int32).reshape(-1, 1, 1),
                np.arange(r0 + spec.row0, r1 + spec.row0, dtype=np.int32).reshape(-1, 1),
                np.arange(c0 + spec.col0, c1 + spec.col0, dtype=np.int32),
            )
            np.multiply(s3, keep, out=s3)
        v_blk = lay.v_op[b + (kv_heads, slice(c0, c1))]
        if nkv == 1:
            if touched is not None:
                touched += s @ lay.v_bad[b + (hk, slice(c0, c1))]
            if first:
                np.matmul(s, v_blk, out=acc)
            else:
                np.add(acc, np.matmul(s, v_blk, out=st.acc_tmp[:R]), out=acc)
        else:  # (nkv, rows of a group, w) @ (nkv, w, Ev)
            s_kv = s.reshape(nkv, -1, w)
            if touched is not None:
                bad = lay.v_bad[b + (kv_heads, slice(c0, c1))][..., None]
                touched += np.matmul(s_kv, bad).reshape(R)
            ev = acc.shape[-1]
            if first:
                np.matmul(s_kv, v_blk, out=acc.reshape(nkv, -1, ev))
            else:
                part = np.matmul(s_kv, v_blk, out=st.acc_tmp[:R].reshape(nkv, -1, ev))
                np.add(acc, part.reshape(R, ev), out=acc)
        first = False
    if first:  # no key to visit (the block mask's empty blocks): empty rows
        out_t[...] = 0
        lse_t[...] = -np.inf
        return True
    lse_r = np.empty((R,), cd)
    if static:
        if np.any(l_sum < lay.tiny):  # underflowed (or empty) rows: the exact path knows
            return False
        np.log(l_sum, out=lse_r)
    else:
        assert m is not None  # set when not static
        shift = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            np.add(shift, np.log(l_sum), out=lse_r)
        lse_r[l_sum <= 0] = -np.inf
    inv = np.where(l_sum > 0, 1.0 / np.where(l_sum > 0, l_sum, 1.0), 0.0).astype(cd)
    if dropout:
        inv *= 1.0 / (1.0 - spec.dropout_p)
    np.multiply(acc.reshape(nh, n, -1), inv.reshape(nh, n, 1), out=out_t)
    if touched is not None:
        out_t[touched.reshape(nh, n) != 0] = np.nan
    lse_t[...] = lse_r.reshape(nh, n)
    return True


def _key_spans(plan, structure, bi, h0, h1, r0, r1, c_lo, c_hi, width):
    """``(c0, c1, masked)``: the key blocks of a tile (``_nf._key_spans``) within the
    block mask's runs, ``masked`` where the mask_mod must be evaluated."""
    if plan is None:
        return [(a, b, False) for a, b in _nf._key_spans(structure, r0, r1, c_lo, c_hi, width)]
    return [
        (a, b, masked)
        for ra, rb, masked in plan.runs(bi, h0, h1, r0, r1, c_lo, c_hi)
        for a, b in _nf._key_spans(structure, r0, r1, ra, rb, width)
    ]
