"""Chunked attention: online softmax over key blocks, written once against the array API.

Memory is ``O(L x block)``: the loops over query blocks and key blocks run in Python and
no ``L x S`` array is ever built (except a float ``attn_mask``'s own gradient, which has
the mask's shape).

Forward, for each query block: a running row max ``m`` and sum ``l`` in float32/float64
and an accumulator rescaled by ``exp(m_old - m_new)`` whenever the max grows; one
normalisation at the end, and the LSE ``m + log(l)`` is kept for the backward. On eager
libraries, when a bound on the scores shows ``exp`` cannot overflow (``_static_shift``),
the running max goes: per key block the scores product, ``exp`` in place, the product
with ``[V | 1]`` and the accumulation; rows whose sums then underflow are redone with
it. Scores and value products land in buffers reused block after block where the
library's ``matmul`` takes ``out=`` (``_backend.workspace``).

Backward (FlashAttention-2): the probabilities are recomputed block by block from the
saved LSE, ``P = exp(S - LSE)``; with ``D = rowsum(dO * O)``, ``dS = P * (dP - D)``
(+ ``P * dLSE``); ``dQ`` accumulates over the key blocks of a query block, ``dK``/``dV``
per key block over the query blocks.

Causal and windowed attention skip the key blocks no query of a block sees
(:meth:`~arrayattn.attention.structure.Structure.col_range`), so causal costs about half; blocks
wholly inside the band skip the mask test. Every block computation (scores, masks,
dropout, the score gradient) is the one the composed path uses (``_composed``), so the
two paths share a single definition of the semantics.

``implementation="auto"`` uses this path when the cost model (``_cost``) finds it the
cheapest, and always instead of the composed path when one of the composed path's row
blocks would exceed :data:`AUTO_CHUNK_BYTES`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple, overload

from .._backend import (
    Array,
    exp_shifted,
    full_scalar,
    is_lazy,
    sum_to_shape,
    where_allowed,
    workspace,
    writes_in_place,
)
from . import composed, stacked, static_shift
from .composed import AUTO_CHUNK_BYTES
from .cost import CostModel, Features, PathCost
from .registry import register_implementation
from .spec import AttentionSpec
from .structure import structural_allowed

__all__ = [
    "forward",
    "backward",
    "ChunkedAttention",
    "BLOCK_Q",
    "BLOCK_K",
    "AUTO_CHUNK_BYTES",
    "score_matrix_bytes",
    "COST",
]

BLOCK_Q: int | None = None
"""Query rows per block; ``None`` (the default): chosen per call by :func:`block_sizes`
(a keyword ``block_q=`` overrides it per call)."""

BLOCK_K: int | None = None
"""Keys per block; ``None`` (the default): chosen per call by :func:`block_sizes`
(a keyword ``block_k=`` overrides it per call)."""

BLOCK_BYTES = 16 * 2**20
"""Target size of one forward block's score matrix over all batches and heads (compute
dtype): large enough that each array-API call does a lot of work, small enough to bound
memory (at most 1/8 of the whole score matrix). The scores live in a buffer reused block
after block where the library's ``matmul`` takes ``out=``, and are masked and
exponentiated in place, so a block costs one score-sized array and no page faults. Each
array-API call may also wake the library's threads (PyTorch under
``OMP_WAIT_POLICY=PASSIVE``: ~50 us for a ``log`` of 2,048 numbers, against 3 us with
spinning threads), so fewer, larger blocks win. Measured on PyTorch CPU tensors (float32,
2 threads, quiet machine, ratio to SDPA, medians of 9-11 interleaved rounds, 2026-11-23):
B1 H8 L2048 D64 256 x 1024 (8 MiB) 1.31, 512 x 1024 (16 MiB) 1.24, 512 x 2048 1.46; B1
H16 L2048 256 x 512 1.31, 256 x 1024 1.23; causal, rows stacked over all keys (see
:func:`block_sizes`): B1 H8 L4096 256 x 1024 1.48, 128 x 4096 1.34; B1 H16 L2048 256 x
1024 1.38, 128 x 2048 1.27, 256 x 2048 1.58."""
BACKWARD_BLOCK_BYTES = 2 * 2**20
"""Target size of one backward block's score matrix (at most 1/64 of the whole): the
backward holds several block-sized temporaries at once."""
MIN_BLOCK_ROWS = 16
STACKED_ROWS = 128
"""Fewest query rows a causal/windowed forward block stacks (see :func:`block_sizes`)."""
MIN_BLOCK_KEYS = 128
STRUCTURED_ROW_BLOCKS = 8


def score_matrix_bytes(spec: AttentionSpec) -> int:
    """Bytes of one ``L x S`` score matrix per (batch, head) in the compute dtype: what
    the composed path allocates (several times, for scores, probabilities, gradients)."""
    return spec.batch_size * spec.Hq * spec.L * spec.S * spec.itemsize


def block_sizes(spec: AttentionSpec, backward: bool = False) -> tuple[int, int]:
    """``(block_q, block_k)`` for a call, from ``L``, ``S``, the batch and heads and the
    compute dtype: forward blocks of :data:`BLOCK_BYTES` (at most 1/8 of the whole score
    matrix, at least 1 MiB) about twice as wide as tall or more (``512 x 1024`` at 16 MiB
    over 8 heads), backward blocks of :data:`BACKWARD_BLOCK_BYTES` (at most 1/64), or the
    whole matrix in one block when it fits.
    Causal and windowed prefill gets at least 8 row blocks. Its forward trims each row
    block's keys to the band, so it stacks as many rows (a power of two) as fit the
    budget with one band's width of keys (all ``S`` for causal): each row block is then
    one product with one masked edge (``256 x 2048`` for B1 H8 L2048, ``128 x 4096`` for
    L4096). Its backward keeps key blocks at most four row blocks wide. A few query rows
    (decode) take all keys in one block up to :data:`BLOCK_BYTES` (32 heads over 16384
    keys: one block, where 128-key blocks made 128 and took twice the composed path's
    time). ``E``/``Ev`` only add
    ``(block_q + block_k) x E`` operands.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 8, 2048, 64), np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None,
        ...                  None, None)
        >>> block_sizes(spec)
        (512, 1024)
        >>> block_sizes(spec, backward=True)
        (128, 512)
    """
    per_pair = max(1, spec.batch_size * spec.Hq) * spec.itemsize
    # A fraction of the whole score matrix (this path exists to bound memory), but never
    # below 1 MiB (256 KiB in the backward): smaller blocks only add Python-level steps.
    # A few query rows (decode) take the whole cap: their scores are small at any S, and
    # the Python work per call should not grow with S.
    if backward:  # (the backward holds several block-sized temporaries at once)
        cap, fraction, floor = BACKWARD_BLOCK_BYTES, 64, 2**18
    else:
        cap, fraction, floor = BLOCK_BYTES, 8, 2**20
    whole = score_matrix_bytes(spec)
    budget = cap if spec.L <= MIN_BLOCK_ROWS else min(cap, max(floor, whole // fraction))
    elements = max(1, budget // per_pair)  # scores per (batch, head) in one block
    L, S = max(1, spec.L), max(1, spec.S)
    if L * S <= elements:  # the whole matrix in one block
        bq, bk = L, S
    else:
        # Powers of two for the rows, multiples of 128 for the keys: BLAS-friendly sizes.
        bq = min(L, max(MIN_BLOCK_ROWS, 1 << (max(1, math.isqrt(elements // 2)).bit_length() - 1)))
        bk = min(S, max(MIN_BLOCK_KEYS, elements // bq // MIN_BLOCK_KEYS * MIN_BLOCK_KEYS))
    st = spec.structure
    if not st.is_trivial and L > MIN_BLOCK_ROWS:
        # Skipping works per block: causal/windowed calls use at least 8 row blocks.
        rows_cap = max(MIN_BLOCK_ROWS, -(-L // STRUCTURED_ROW_BLOCKS))
        if backward:  # the backward's key grid stays within a few row blocks' width
            bq = min(bq, rows_cap)
            bk = min(bk, max(MIN_BLOCK_KEYS, 4 * bq))
        else:
            # The forward trims each row block's keys to those its rows see: rows are
            # stacked until the block holds all the keys of one band's width (S for
            # causal), so each row block is one product with one masked edge; but at
            # least 128 rows (thinner products run slower than a few key blocks do:
            # B1 H4 L16384 causal on PyTorch, 64 x 16384 1.47x SDPA, 128 x 8192 1.45x,
            # 256 x 4096 1.39x).
            span = S if st.left < 0 or st.right < 0 else min(S, st.left + st.right + 1)
            fit = max(STACKED_ROWS, elements // span)
            bq = min(rows_cap, L, 1 << (fit.bit_length() - 1))
            bk = min(S, max(MIN_BLOCK_KEYS, elements // bq // MIN_BLOCK_KEYS * MIN_BLOCK_KEYS))
    return bq, bk


@overload
def _block_sizes(
    block_q: int | None, block_k: int | None, spec: AttentionSpec, backward: bool = False
) -> tuple[int, int]: ...
@overload
def _block_sizes(
    block_q: int | None, block_k: int | None, spec: None = None, backward: bool = False
) -> tuple[int | None, int | None]: ...
def _block_sizes(
    block_q: int | None,
    block_k: int | None,
    spec: AttentionSpec | None = None,
    backward: bool = False,
) -> tuple[int | None, int | None]:
    bq = BLOCK_Q if block_q is None else block_q
    bk = BLOCK_K if block_k is None else block_k
    if (bq is None or bk is None) and spec is not None:
        auto_q, auto_k = block_sizes(spec, backward)
        bq = auto_q if bq is None else bq
        bk = auto_k if bk is None else bk
    for name, b in (("block_q", bq), ("block_k", bk)):
        if b is None and spec is None:  # ChunkedAttention() without sizes: chosen per call
            continue
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    return bq, bk


def _key_blocks(
    spec: AttentionSpec, r0: int, r1: int, bk: int, clip: bool = False
) -> Iterator[tuple[int, int, int, bool, bool]]:
    """``(index, c0, c1, inside, check_mod)`` for the key blocks (on the fixed grid of
    size ``bk``) that rows ``[r0, r1)`` may see; ``inside`` is True when the whole block
    lies inside the causal/window band, so the structural mask test can be skipped;
    blocks a block mask says are empty are left out, and ``check_mod`` is False on those
    it says are full. ``clip=True`` (the forward, which needs no grid) trims the blocks
    to the keys the rows can see."""
    st = spec.structure
    lo, hi = st.col_range(r0, r1, spec.S, offset_bounds=spec.offset_bounds)
    if lo >= hi:  # (lo may even exceed S for a window past the last key)
        return
    for c0 in range((lo // bk) * bk, hi, bk):
        c1 = min(c0 + bk, spec.S)
        j = c0 // bk
        if clip:
            c0, c1 = max(c0, lo), min(c1, hi)
        visit, check_mod = composed.flex_tile(spec, r0, r1, c0, c1)
        if visit:
            yield j, c0, c1, composed.inside_band(spec, r0, r1, c0, c1), check_mod


def _mask_block(mask_g: Array | None, r0: int, r1: int, c0: int, c1: int) -> Array | None:
    """The user's grouped mask for a block; axes of size 1 (broadcast over L or S) stay."""
    if mask_g is None:
        return None
    if mask_g.shape[-2] != 1:
        mask_g = mask_g[..., r0:r1, :]
    if mask_g.shape[-1] != 1:
        mask_g = mask_g[..., c0:c1]
    return mask_g


def _padded(spec: AttentionSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * (len(spec.lead) + 3 - len(shape)) + tuple(shape)


def forward(
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Array, Array]:
    """Attention output (user layout, input dtype) and LSE (user layout, float32/64),
    computed block by block with an online softmax.

    Same contract as ``composed.forward``; ``block_q``/``block_k`` default to
    :data:`BLOCK_Q`/:data:`BLOCK_K` and need not divide ``L``/``S``.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 2, 5, 4), dtype=np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, True, None, False, "top_left", None, None, None)
        >>> out, lse = forward(spec, q, q, q, None, block_q=2, block_k=3)
        >>> out.shape, lse.shape
        ((1, 2, 5, 4), (1, 2, 5))
    """
    if spec.stack_kv:  # K/V broadcast over the batch: read once for all rows
        impl = functools.partial(forward, block_q=block_q, block_k=block_k)
        return stacked.forward(impl, spec, query, key, value, attn_mask)
    bq, bk = _block_sizes(block_q, block_k, spec)
    if spec.L == 0:
        return composed.forward(spec, query, key, value, attn_mask)
    xp = spec.xp
    qg, kg, vg, mask_g = composed._prepare(spec, query, key, value, attn_mask)
    # Garbage in excluded value rows must not meet P's zeros (0 * NaN is NaN).
    vc, bad, v_range = composed.value_operands_and_range(spec, vg)
    if spec.scale != 1.0:
        qg = qg * spec.scale  # on the l x E queries, not on every l x s block
    bound = static_shift.bounded(spec, qg, kg, vc, v_range)  # (V read once, not twice)
    rows = _Rows(spec, qg, kg, vc, bad, mask_g, bq, bk, bound.finite)
    static = bound.static
    starts = range(0, spec.L, bq)
    parts = [rows.block(r0, min(r0 + bq, spec.L), static) for r0 in starts]
    flagged = [xp.any(p.suspect) for p in parts if p.suspect is not None]
    if flagged and bool(xp.any(xp.stack(flagged))):  # one decision per call
        # Rows whose sums underflowed on the static shift: their blocks again, exactly.
        for n, r0 in enumerate(starts):
            if parts[n].suspect is not None and bool(xp.any(parts[n].suspect)):
                parts[n] = rows.block(r0, min(r0 + bq, spec.L), False)
    out, lse = rows.finish(parts)
    out = spec.ungroup_out(xp.astype(out, spec.dtype, copy=False))
    return out, composed.reshape_lse(spec, lse)


class _Rows:
    """The forward of one block of query rows over its key blocks (an online softmax),
    for one call's prepared operands."""

    def __init__(
        self,
        spec: AttentionSpec,
        qg: Array,
        kg: Array,
        vc: Array,
        bad: Array | None,
        mask_g: Array | None,
        bq: int,
        bk: int,
        finite: bool,
    ) -> None:
        xp, cd, dev = spec.xp, spec.cdtype, spec.device
        self.spec, self.qg, self.kg, self.mask_g, self.bk = spec, qg, kg, mask_g, bk
        self.v_ext, self.cols_ext = composed.value_columns(spec, vc, bad)
        # Each block's scores and value product land in buffers reused block after block
        # (see _backend.workspace): no allocation, and no page faults, per block.
        rows = spec.batch_size * spec.Hq * min(bq, spec.L)
        on = not spec.autograd
        self.s_scratch = workspace(xp, rows * min(bk, spec.S), cd, dev, on)
        self.pv_scratch = workspace(xp, rows * int(self.v_ext.shape[-1]), cd, dev, on)
        self.neg_inf = full_scalar(xp, -math.inf, cd, dev)
        self.zero = full_scalar(xp, 0.0, cd, dev)
        self.one = full_scalar(xp, 1.0, cd, dev)
        self.tiny = full_scalar(xp, static_shift.limit_and_tiny(xp, cd)[1], cd, dev)
        self.rows_shape = spec.lead + (spec.Hq // spec.G, spec.G)
        # Index arrays only when a block needs them (structure edge, lengths, dropout).
        self.need_index = (
            spec.has_lengths or spec.dropout_p > 0 or spec.alibi_g is not None or spec.flex
        )
        # A block that crosses the causal/window band's edge is masked only on the key
        # columns the edge crosses, in place (a 256-row causal block: 256 of up to 2048
        # columns), where the library writes through views; per-sequence diagonals
        # (lengths) and other libraries test the whole block. When every score is
        # finite (`finite`) the edge gets a 0/-inf bias added instead of a masked fill:
        # 0.075 against 0.22 ms on PyTorch for 8 heads x 256 x 256.
        self.edges_in_place = (
            spec.offset_g is None
            and not spec.structure.is_trivial
            and not spec.autograd
            and writes_in_place(xp, cd, dev)
        )
        self.finite = finite
        self.edge_masks: dict[tuple[int, int, int], Array] = {}

    def _mask_edges(self, s: Array, r0: int, r1: int, c0: int, c1: int) -> None:
        """Mask, in ``s``'s own memory, the key columns of ``[c0, c1)`` where the band's
        edge crosses rows ``[r0, r1)``; the columns every row sees are left alone."""
        spec, xp = self.spec, self.spec.xp
        for p0, p1 in composed.key_parts(spec, r0, r1, c0, c1):
            if composed.inside_band(spec, r0, r1, p0, p1):
                continue
            # The mask depends on the columns' places relative to the rows only: causal
            # row blocks of one size share it.
            where = (p0 - r0, p1 - r0, r1 - r0)
            mask = self.edge_masks.get(where)
            if mask is None:
                rows, cols = composed.index_block(spec, r0, r1, p0, p1)
                mask = structural_allowed(xp, spec.structure, rows, cols)
                if self.finite:  # as a bias: 0 where allowed, -inf elsewhere
                    mask = xp.where(mask, self.zero, self.neg_inf)
                self.edge_masks[where] = mask
            edge = s[..., p0 - c0 : p1 - c0]
            if self.finite:
                edge += mask  # (a view: written through to s)
            else:
                where_allowed(xp, edge, mask, self.neg_inf)

    def block(self, r0: int, r1: int, static: bool) -> _Part:
        """The unnormalised output, row sums and shift of rows ``[r0, r1)`` (see
        :class:`_Part`; :meth:`finish` normalises all row blocks at once), and with
        ``static`` the rows whose sums may have underflowed: the running maximum is kept
        only when ``static`` is False."""
        spec, xp = self.spec, self.spec.xp
        q_blk = self.qg if (r0, r1) == (0, spec.L) else self.qg[..., r0:r1, :]
        m = total = acc = None
        for _, c0, c1, inside, check_mod in _key_blocks(spec, r0, r1, self.bk, clip=True):
            rows = cols = None
            edges = not inside and self.edges_in_place
            if self.need_index or (not inside and not edges):
                rows, cols = composed.index_block(spec, r0, r1, c0, c1)
            k_blk, v_blk = (
                x if (c0, c1) == (0, spec.S) else x[..., c0:c1, :] for x in (self.kg, self.v_ext)
            )
            s, _ = composed.scores_block(
                spec,
                q_blk,
                k_blk,
                _mask_block(self.mask_g, r0, r1, c0, c1),
                rows,
                cols,
                check_structure=not (inside or edges),
                q_scaled=True,
                scratch=self.s_scratch,
                check_mod=check_mod,
                need_chain=False,
            )
            if edges:
                self._mask_edges(s, r0, r1, c0, c1)
            m_safe = None
            if not static:
                m_blk = xp.max(s, axis=-1, keepdims=True)
                m_new = m_blk if m is None else xp.maximum(m, m_blk)
                # A row that has seen no key yet keeps m = -inf; shift it by 0 instead, so
                # exp gives 0 and never NaN.
                m_safe = xp.where(xp.isfinite(m_new), m_new, self.zero)
            p = exp_shifted(xp, s, m_safe)  # (s is this block's own: overwritten)
            t = None
            if self.cols_ext.total is None:  # (with dropout: the sum of the undropped p)
                t = xp.sum(p, axis=-1, keepdims=True)
            if spec.dropout_p > 0:
                p = composed.apply_dropout(spec, p, rows, cols)
            # [P V | P 1 | P bad]: the output, the row sums and the rows that give weight
            # to a non-finite value, in one product (and one rescale).
            # (The first block's product becomes the accumulator: an array of its own.)
            scratch: Array | None = None if acc is None else self.pv_scratch
            pv = composed.group_matmul(xp, p, composed.kv_rows(xp, v_blk), scratch)
            if acc is None:  # first block: nothing to rescale
                acc, total = pv, t
            elif static and not spec.autograd:  # one shift (0) for all: no rescale either
                acc += pv  # (acc is this row block's own)
                if t is not None:
                    total += t
            elif static:
                acc = acc + pv
                if t is not None:
                    total = total + t
            else:
                assert m is not None  # not static: every block sets m, the first included
                alpha = xp.exp(m - m_safe)
                acc = acc * alpha + pv
                if t is not None:
                    total = total * alpha + t
            if not static:
                m = m_new
        shape = self.rows_shape + (r1 - r0,)
        if acc is None:  # no key block for these rows (a sink still gives them an LSE)
            zeros = xp.zeros(shape + (1,), dtype=spec.cdtype, device=spec.device)
            acc = xp.zeros(shape + (spec.Ev,), dtype=spec.cdtype, device=spec.device)
            return _Part(acc, zeros, None, None, None)
        out_b, total_g, touched = self.cols_ext.split(acc)
        total = total_g if total is None else total
        suspect = None
        if static:
            # Without ALiBi an unmasked key adds at least exp(-LIMIT): 0 is an empty row.
            suspect = total < self.tiny
            if spec.alibi_g is None:
                suspect = xp.logical_and(suspect, xp.logical_not(total == self.zero))
        shift = None if static else xp.where(xp.isfinite(m), m, self.zero)
        return _Part(out_b, total, shift, touched, suspect)

    def finish(self, parts: list[_Part]) -> tuple[Array, Array]:
        """Output and LSE (grouped, compute dtype; LSE without its trailing axis) of all
        rows from their blocks' parts: one normalisation for the whole call, not one per
        row block (each array-API call may wake the library's threads)."""
        spec, xp = self.spec, self.spec.xp
        full = self.rows_shape + (spec.L,)

        def rows_of(name: str, width: int) -> Array | None:
            got = [getattr(p, name) for p in parts]
            if all(x is None for x in got):
                return None
            blocks = []
            for p, x in zip(parts, got, strict=True):
                shape = self.rows_shape + (int(p.total.shape[-2]), width)
                if x is None:  # (a static block's shift, a block without keys' P @ bad)
                    x = xp.zeros(shape, dtype=spec.cdtype, device=spec.device)
                blocks.append(xp.broadcast_to(x, shape))
            return blocks[0] if len(blocks) == 1 else xp.concat(blocks, axis=-2)

        acc = rows_of("acc", spec.Ev)
        total = rows_of("total", 1)
        shift = rows_of("shift", 1)  # (0 for the rows of static blocks)
        touched = rows_of("touched", 1)
        # Empty means a total of exactly 0; a NaN total (a NaN score) keeps LSE NaN.
        empty = total == self.zero
        total_safe = xp.where(empty, self.one, total)
        log_total = xp.log(total_safe)
        if shift is not None:
            log_total = shift + log_total
        out, lse = composed.merge_sinks(
            spec,
            composed.poison_rows(spec, acc / total_safe, touched),
            xp.where(empty, self.neg_inf, log_total),
        )
        out = xp.broadcast_to(out, full + (spec.Ev,))
        lse = xp.broadcast_to(lse, full + (1,))
        return out, lse[..., 0]


class _Part(NamedTuple):
    """One row block's share of the forward, before normalisation (grouped layout,
    compute dtype, trailing axis of 1 on the row vectors)."""

    acc: Array  # the unnormalised P @ V
    total: Array  # the row sums of P
    shift: Array | None  # the running maximum where kept (0 on rows without keys)
    touched: Array | None  # P @ bad: non-zero on rows given weight by a non-finite value
    suspect: Array | None  # with the static shift: rows whose sums may have underflowed


def backward(
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Array, Array, Array, Array | None]:
    """FlashAttention-2 backward, block by block from the saved LSE.

    Same contract as ``composed.backward``: returns ``(d_query, d_key, d_value,
    d_mask)`` in the user's shapes and dtypes, ``d_mask`` ``None`` unless the mask is a
    float bias.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 2, 5, 4), dtype=np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, True, None, False, "top_left", None, None, None)
        >>> out, lse = forward(spec, q, q, q, None)
        >>> dq, dk, dv, dm = backward(spec, q, q, q, None, out, lse, np.ones_like(out), None)
        >>> dq.shape, dk.shape, dv.shape, dm
        ((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4), None)
    """
    if spec.stack_kv:  # K/V broadcast over the batch: dK/dV summed over the rows
        impl = functools.partial(backward, block_q=block_q, block_k=block_k)
        args = (query, key, value, attn_mask, out, lse, d_out, d_lse)
        return stacked.backward(impl, spec, *args)
    bq, bk = _block_sizes(block_q, block_k, spec, backward=True)
    if spec.L == 0:
        return composed.backward(spec, query, key, value, attn_mask, out, lse, d_out, d_lse)
    xp = spec.xp
    cd = spec.cdtype
    dev = spec.device
    qg, kg, vg, mask_g = composed._prepare(spec, query, key, value, attn_mask)
    # Operands that meet excluded pairs' zero weights, with garbage (NaN/Inf) zeroed.
    qc, kc = composed.finite_or_zero(spec, qg), composed.finite_or_zero(spec, kg)
    vc, _ = composed.value_operands(spec, vg)
    do_g, delta, dl = composed.backward_rows(spec, out, d_out, d_lse)
    lse_g = xp.astype(composed._group_lse(spec, lse), cd)
    rows_shape = spec.lead + (spec.Hq // spec.G, spec.G)
    q_pad, k_pad, v_pad = (_padded(spec, s) for s in (spec.q_shape, spec.k_shape, spec.v_shape))

    n_kb = -(-spec.S // bk)
    dk_blocks: list[Array | None] = [None] * n_kb
    dv_blocks: list[Array | None] = [None] * n_kb
    dq_blocks = []
    dmask = _MaskGradient(spec, mask_g, bq, bk)

    def rows_of(x: Array | None, r0: int, r1: int) -> Array | None:
        return None if x is None else x[..., r0:r1, :]

    for r0 in range(0, spec.L, bq):
        r1 = min(r0 + bq, spec.L)
        q_blk = qg[..., r0:r1, :]
        lse_blk = lse_g[..., r0:r1, :]
        do_blk, delta_blk, dl_blk = (rows_of(x, r0, r1) for x in (do_g, delta, dl))
        dq_acc = None
        # A block of a larger call (partial_keys) does not see whole rows: no totals.
        row_total = (
            None if spec.partial_keys else _row_totals(spec, q_blk, kg, mask_g, lse_blk, r0, r1, bk)
        )
        for j, c0, c1, inside, check_mod in _key_blocks(spec, r0, r1, bk):
            rows, cols = composed.index_block(spec, r0, r1, c0, c1)
            k_blk = kg[..., c0:c1, :]
            s, tanh = composed.scores_block(
                spec,
                q_blk,
                k_blk,
                _mask_block(mask_g, r0, r1, c0, c1),
                rows,
                cols,
                check_structure=not inside,
                check_mod=check_mod,
            )
            p = composed.probabilities_from_lse(spec, s, lse_blk, overwrite=True)
            if row_total is not None:
                p = p / row_total
            ds, dv_g = composed.backward_block(
                spec, p, vc[..., c0:c1, :], do_blk, delta_blk, dl_blk, rows, cols
            )
            if ds is None:  # neither d_out nor d_lse: every gradient is zero
                continue
            dmask.add(ds, r0 // bq, j, r1 - r0, c1 - c0)
            dq_g, dk_g = composed.scores_grad_block(
                spec, qc[..., r0:r1, :], kc[..., c0:c1, :], ds, tanh
            )
            dq_acc = dq_g if dq_acc is None else dq_acc + dq_g
            dk_b = sum_to_shape(xp, xp.sum(dk_g, axis=-3), k_pad[:-2] + (c1 - c0, spec.E))
            dk_blocks[j] = dk_b if dk_blocks[j] is None else dk_blocks[j] + dk_b
            if dv_g is not None:
                dv_b = sum_to_shape(xp, xp.sum(dv_g, axis=-3), v_pad[:-2] + (c1 - c0, spec.Ev))
                dv_blocks[j] = dv_b if dv_blocks[j] is None else dv_blocks[j] + dv_b
        if dq_acc is None:
            dq_blocks.append(xp.zeros(q_pad[:-2] + (r1 - r0, spec.E), dtype=cd, device=dev))
        else:
            dq_full = xp.broadcast_to(dq_acc, rows_shape + (r1 - r0, spec.E))
            dq_blocks.append(
                sum_to_shape(xp, spec.ungroup_rows(dq_full), q_pad[:-2] + (r1 - r0, spec.E))
            )

    dq = _assemble(spec, dq_blocks, spec.q_shape)
    dk = _assemble(spec, _fill(spec, dk_blocks, k_pad, spec.E, bk), spec.k_shape)
    dv = _assemble(spec, _fill(spec, dv_blocks, v_pad, spec.Ev, bk), spec.v_shape)
    d_mask = None
    if spec.mask_kind == "float":
        assert attn_mask is not None  # a float mask_kind comes from a mask
        d_mask = dmask.result(attn_mask.dtype)
    return dq, dk, dv, d_mask


def _row_totals(
    spec: AttentionSpec,
    q_blk: Array,
    kg: Array,
    mask_g: Array | None,
    lse_blk: Array,
    r0: int,
    r1: int,
    bk: int,
) -> Array | None:
    """Row totals ``sum_j exp(S_ij - LSE_i)`` to divide ``P`` by on the rows of a query
    block whose huge ``|LSE|`` swallowed ``log(rowsum)`` (see
    ``composed.RENORMALISE_LSE_ERROR``; 1 on the other rows), or ``None`` when no row
    needs it. Costs one more pass over the keys, taken only when a row needs it; where a
    Python decision on data is impossible (JAX tracing, Dask) the pass always runs."""
    xp = spec.xp
    cd = spec.cdtype
    eps = float(xp.finfo(cd).eps)
    need = xp.logical_and(
        xp.isfinite(lse_blk), xp.abs(lse_blk) * eps > composed.RENORMALISE_LSE_ERROR
    )
    if not is_lazy(xp) and not bool(xp.any(need)):
        return None
    total = None
    for _, c0, c1, inside, check_mod in _key_blocks(spec, r0, r1, bk):
        rows, cols = composed.index_block(spec, r0, r1, c0, c1)
        s, _ = composed.scores_block(
            spec,
            q_blk,
            kg[..., c0:c1, :],
            _mask_block(mask_g, r0, r1, c0, c1),
            rows,
            cols,
            check_structure=not inside,
            check_mod=check_mod,
            need_chain=False,
        )
        p = composed.probabilities_from_lse(spec, s, lse_blk, overwrite=True)
        part = xp.sum(p, axis=-1, keepdims=True)
        total = part if total is None else total + part
    if total is None:
        return None
    p_sink = composed.sink_probability(spec, lse_blk)
    if p_sink is not None:  # the sink's share is part of the row's total
        total = total + p_sink
    one = full_scalar(xp, 1.0, cd, spec.device)
    return xp.where(xp.logical_and(need, total > 0), total, one)


def _fill(
    spec: AttentionSpec, blocks: list[Array | None], pad: tuple[int, ...], width: int, bk: int
) -> list[Array]:
    """Key blocks no query touched get zeros."""
    xp = spec.xp
    out = []
    for j, b in enumerate(blocks):
        if b is None:
            n = min(bk, spec.S - j * bk)
            b = xp.zeros(pad[:-2] + (n, width), dtype=spec.cdtype, device=spec.device)
        out.append(b)
    return out


def _assemble(spec: AttentionSpec, blocks: list[Array], shape: tuple[int, ...]) -> Array:
    xp = spec.xp
    if not blocks:
        return xp.zeros(shape, dtype=spec.dtype, device=spec.device)
    x = blocks[0] if len(blocks) == 1 else xp.concat(blocks, axis=-2)
    return xp.astype(xp.reshape(x, shape), spec.dtype, copy=False)


class _MaskGradient:
    """Accumulates a float mask's gradient block by block, in the mask's own grouped
    shape: blocks are concatenated along an axis the mask spans and summed along an axis
    it broadcasts over (size 1)."""

    def __init__(self, spec: AttentionSpec, mask_g: Array | None, bq: int, bk: int):
        self.spec = spec
        self.active = spec.mask_kind == "float"
        self.parts: dict[tuple[int, int], Array] = {}
        if self.active:
            assert mask_g is not None  # a float mask_kind comes from a mask
            self.shape = tuple(int(d) for d in mask_g.shape)
            self.span_rows = self.shape[-2] != 1
            self.span_cols = self.shape[-1] != 1
            self.bq, self.bk = bq, bk

    def add(self, ds: Array, i: int, j: int, nq: int, nk: int) -> None:
        if not self.active:
            return
        spec, xp = self.spec, self.spec.xp
        full = spec.lead + (spec.Hq // spec.G, spec.G, nq, nk)
        target = self.shape[:-2] + (nq if self.span_rows else 1, nk if self.span_cols else 1)
        part = sum_to_shape(xp, xp.broadcast_to(ds, full), target)
        key = (i if self.span_rows else 0, j if self.span_cols else 0)
        self.parts[key] = part if key not in self.parts else self.parts[key] + part

    def result(self, dtype: Any) -> Array:
        spec, xp = self.spec, self.spec.xp
        n_rows = -(-spec.L // self.bq) if self.span_rows else 1
        n_cols = -(-spec.S // self.bk) if self.span_cols else 1
        if n_rows == 0 or n_cols == 0:  # S = 0 (or L = 0): no block, nothing to concat
            return xp.zeros(spec.mask_shape, dtype=dtype, device=spec.device)
        row_parts = []
        for i in range(n_rows):
            nq = min(self.bq, spec.L - i * self.bq) if self.span_rows else 1
            cols = []
            for j in range(n_cols):
                nk = min(self.bk, spec.S - j * self.bk) if self.span_cols else 1
                part = self.parts.get((i, j))
                if part is None:
                    part = xp.zeros(
                        self.shape[:-2] + (nq, nk), dtype=spec.cdtype, device=spec.device
                    )
                cols.append(part)
            row_parts.append(cols[0] if len(cols) == 1 else xp.concat(cols, axis=-1))
        g = row_parts[0] if len(row_parts) == 1 else xp.concat(row_parts, axis=-2)
        g = spec.ungroup_rows(g)
        return xp.astype(xp.reshape(g, spec.mask_shape), dtype, copy=False)


class ChunkedAttention:
    """The chunked path with fixed block sizes, usable as a registered implementation::

    register_implementation("chunked-64", ChunkedAttention(block_q=64, block_k=64))
    """

    def __init__(self, block_q: int | None = None, block_k: int | None = None):
        _block_sizes(1 if block_q is None else block_q, 1 if block_k is None else block_k)
        self.block_q, self.block_k = block_q, block_k

    def forward(self, spec, query, key, value, attn_mask):
        return forward(
            spec, query, key, value, attn_mask, block_q=self.block_q, block_k=self.block_k
        )

    def backward(self, spec, query, key, value, attn_mask, out, lse, d_out, d_lse):
        return backward(
            spec,
            query,
            key,
            value,
            attn_mask,
            out,
            lse,
            d_out,
            d_lse,
            block_q=self.block_q,
            block_k=self.block_k,
        )

    def __repr__(self) -> str:
        return f"ChunkedAttention(block_q={self.block_q}, block_k={self.block_k})"


class _DefaultChunked:
    """The module's functions with the module-level defaults read at call time."""

    forward = staticmethod(forward)
    backward = staticmethod(backward)


def _features(spec: AttentionSpec, threads: int) -> Features:
    """One step per key block of each row block; the forward trims each row block's keys
    to those its rows see (``col_range``): its scores are each row block's rows times
    that range; two small products per step and KV head (the GQA rows stacked)."""
    bq, bk = block_sizes(spec)
    st = spec.structure
    L = max(1, spec.L)
    steps = elements = 0
    for r0 in range(0, L, bq):
        r1 = min(r0 + bq, L)
        lo, hi = st.col_range(r0, r1, spec.S)
        keys = hi - lo
        steps += max(1, -(-keys // bk))
        elements += (r1 - r0) * keys
    elements *= spec.batch_size * spec.Hq
    groups = spec.batch_size * (spec.Hq // spec.G)
    return steps, 2 * steps * groups, elements, elements * (spec.E + spec.Ev)


COST = CostModel(
    "chunked",
    {
        "numpy": PathCost(
            call=80e-6,
            step=100e-6,
            mat=4.0e-6,
            elem=9.0e-9,
            mac=0.03e-9,
            elem_threaded=False,
            skinny=0.09e-9,
        ),
        # Chunked's elements cost less than composed's since its blocks mask only the
        # band's edges and write into reused buffers: 58 vs 71 ms (B1 H8 L2048 D64), 13.6
        # vs 20.1 (L1024 causal) on PyTorch CPU tensors, calibrate_auto.py, 2026-11-23.
        "array": PathCost(
            call=0.8e-3,
            step=140e-6,
            mat=0.13e-6,
            elem=1.3e-9,
            mac=0.06e-9,
            elem_threaded=True,
            skinny=0.15e-9,
        ),
    },
    _features,
)
"""The chunked path's cost model (:class:`~arrayattn.attention.cost.CostModel`)."""

# After a faster registered path (the NumPy fast path ranks lower), before composed.
AUTO_RANK = 50
register_implementation("chunked", _DefaultChunked(), auto_rank=AUTO_RANK, cost=COST)
