"""The NumPy fast path's backward (FlashAttention-2 from the saved LSE), tile by tile.

Work units are ``(batch, KV head, key chunk)``: a unit owns its keys' ``dK``/``dV``
(summed over the KV head's query-head group, so K/V are never repeated) and accumulates
``dQ`` of the group's rows. ``P = exp(S - LSE)`` is written as ``diag(a) exp(S)`` with
``a = exp(-LSE)`` when the static bound allows, so the factor goes on the small
``(rows, head_dim)`` operands instead of the ``rows x keys`` block. Layout, scratch and
tunables (:data:`~arrayattn.attention.fast.layout.BWD_ROWS`, ``BWD_KEYS``) come from
:mod:`arrayattn.attention.fast.layout`, threads from :mod:`arrayattn.attention.threads`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._backend import rowwise_dot
from .. import stacked as _stacked
from .. import threads as _fast_threads
from ..dropout import dropout_keep
from ..spec import AttentionSpec
from ..threads import _fork_safe, _run_units, checkpoint
from . import layout as _nf
from .flex import FlexPlan
from .layout import (
    _add_alibi,
    _blocked_out,
    _Layout,
    _max_norm,
    _row_range,
    _Scratch,
    _spans,
    _static_bounds,
    blas_ready,
)

# Backward static path: |scores| bound and -LSE bound, so exp(S) and exp(-LSE) stay finite
# and their products stay far from overflow.
_BWD_STATIC_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 340.0}


class _FwdState:
    def __init__(self, rows: int, keys: int, E: int, Ev: int, cd: np.dtype):
        self.s = _Scratch(rows, keys, cd)
        self.q = np.empty((rows, E), cd)
        self.acc_tmp = np.empty((rows, Ev), cd)
        self.l_tmp = np.empty((rows,), cd)
        self.ones = np.ones((keys,), cd)
        self.bool = _Scratch(rows, keys, np.bool_)


def _scores(
    spec, lay, st, structure, b, h, hk, r0, r1, c0, c1, q_t, s, tanh=None, bi=0, masked=True,
    grad=False,
):  # fmt: skip
    """Final masked scores of rows ``[r0, r1)`` x keys ``[c0, c1)`` into ``s`` (in place);
    with a softcap, ``tanh(S / softcap)`` is kept in ``tanh`` when given (the backward's
    chain rule needs it). With ``arrayattn.flex`` (``lay.flex``): the score_mod after the
    softcap and ALiBi, and the mask_mod where ``masked`` (a partial block); returns the
    score_mod's derivative ``(rows, keys)`` (``None``: 1 or no score_mod)."""
    k_blk = lay.k[b + (hk, slice(c0, c1))]
    if spec.softcap is None:
        np.matmul(q_t, k_blk.T, out=s)
    else:
        t = s if tanh is None else tanh
        np.matmul(q_t, k_blk.T, out=t)
        np.tanh(t, out=t)
        np.multiply(t, spec.softcap, out=s)
    _add_alibi(lay, structure, b, h, r0, r1, c0, c1, s)
    plan = lay.flex
    chain = None
    s3 = s[None]  # (1 head, rows, keys): the flex index arrays' layout
    if plan is not None and plan.smod is not None:
        chain = plan.score(s3, bi, h, h + 1, r0, r1, c0, c1, grad=grad)
        if chain is not None:
            chain = np.broadcast_to(chain, s3.shape)[0]
    if lay.mask is not None:
        m = lay.mask[b + (h, slice(r0, r1), slice(c0, c1))]
        if spec.mask_kind == "float":
            np.add(s, m, out=s)
            if lay.qk_garbage:  # garbage score + (-inf) is NaN: -inf still excludes
                np.copyto(s, -np.inf, where=np.isneginf(m))
        else:
            excluded = np.logical_not(m, out=st.bool[: r1 - r0, : c1 - c0])
            np.copyto(s, -np.inf, where=excluded)
    blocked = _blocked_out(structure, r0, r1, c0, c1)
    if blocked is not None:
        np.copyto(s, -np.inf, where=blocked)
    if plan is not None and plan.mod is not None and masked:
        plan.mask(s3, st.bool[: r1 - r0, : c1 - c0][None], bi, h, h + 1, r0, r1, c0, c1, masked)
    return chain


def _dropout_keep(spec, bi, h, r0, r1, c0, c1):
    """Keep-mask of a tile at global positions (a block of a larger call adds its
    origins, see ``AttentionSpec.as_block``)."""
    b, h_id = spec.original_ids(bi, h)
    rows_i = np.arange(r0 + spec.row0, r1 + spec.row0, dtype=np.int32).reshape(-1, 1)
    cols_i = np.arange(c0 + spec.col0, c1 + spec.col0, dtype=np.int32)
    return dropout_keep(
        np, spec.seed, spec.dropout_p, np.int32(b), np.int32(h_id), rows_i, cols_i
    )


def _scaled_query(spec, lay, b, h, r0, r1, out):
    """Queries of the rows times the scale (divided by the softcap when there is one,
    so that ``tanh`` reads the matmul's output directly)."""
    factor = spec.scale if spec.softcap is None else spec.scale / spec.softcap
    np.multiply(lay.q[b + (h, slice(r0, r1))], factor, out=out)
    return out


# ---------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------
class _BwdState:
    def __init__(
        self, rows: int, keys: int, E: int, Ev: int, cd: np.dtype, spec: AttentionSpec
    ) -> None:
        self.e = _Scratch(rows, keys, cd)
        self.dp = _Scratch(rows, keys, cd)
        self.t = _Scratch(rows, keys, cd) if spec.softcap is not None else None
        self.ed = _Scratch(rows, keys, cd) if spec.dropout_p > 0 else None
        self.bool = _Scratch(rows, keys, np.bool_)
        self.q = np.empty((rows, E), cd)
        self.qa = np.empty((rows, E), cd)
        self.do = np.empty((rows, Ev), cd)
        self.doa = np.empty((rows, Ev), cd)
        self.tmp_q = np.empty((rows, E), cd)
        self.tmp_k = np.empty((keys, E), cd)
        self.tmp_v = np.empty((keys, Ev), cd)
        self.dk = np.empty((keys, E), cd)
        self.dv = np.empty((keys, Ev), cd)


@_fork_safe
def backward(
    spec: AttentionSpec,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None,
    out: np.ndarray,
    lse: np.ndarray,
    d_out: np.ndarray | None,
    d_lse: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(d_query, d_key, d_value, d_mask)`` in the arguments' own shapes and dtypes, as
    :func:`arrayattn.attention.composed.backward`: FlashAttention-2 from the saved LSE, block
    by block (``d_mask`` only for a float mask). Users reach it through ``arrayattn.vjp``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, q, q,
        ...                        implementation="fast")
        >>> [g.shape for g in pullback(np.ones_like(out))]
        [(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)]
    """
    if spec.stack_kv:  # K/V broadcast over the batch: dK/dV summed over the rows
        args = (query, key, value, attn_mask, out, lse, d_out, d_lse)
        return _stacked.backward(backward, spec, *args)
    lay = _Layout(spec, query, key, value, attn_mask)
    lay.flex = FlexPlan(spec) if spec.flex else None
    cd = lay.cd
    nb = len(lay.lead_index)
    lead = spec.lead
    rows_shape = lead + (spec.Hq, spec.L)
    lse_f = np.broadcast_to(np.asarray(lse, dtype=cd).reshape(spec.lse_shape), rows_shape)
    finite = np.isfinite(lse_f)
    # Shift of exp(S - shift): 0 for empty rows (LSE -inf, every P 0); +inf stays (P 0
    # but NaN where a score is +inf, as the composed path); a NaN LSE (NaN scores) shifts
    # by -max so that every pair that takes part gives exp != 0, then made NaN
    # (``nan_rows``), while excluded pairs stay exactly 0.
    nan_rows = np.isnan(lse_f)
    lse_safe = np.where(finite, lse_f, np.where(lse_f > 0, lse_f, 0.0))
    lse_safe = np.where(nan_rows, -np.finfo(cd).max, lse_safe).astype(cd)
    lay.prepare_garbage(backward=True)
    limit = _BWD_STATIC_LIMIT[cd]
    with np.errstate(over="ignore"):
        a_static = np.where(finite, np.exp(-lse_safe), 0.0).astype(cd)

    # delta_eff = rowsum(dO * O) - dLSE, so that dS = P * (dP - delta_eff).
    if d_out is not None:
        do_f = _broadcast_rows(spec, d_out, cd, spec.Ev)
        o_f = _broadcast_rows(spec, out, cd, spec.Ev)
        delta = rowwise_dot(np, do_f, o_f)
    else:
        do_f = None
        delta = np.zeros(rows_shape, cd)
    if d_lse is not None:
        dl = np.broadcast_to(np.asarray(d_lse, dtype=cd).reshape(spec.lse_shape), rows_shape)
        delta = delta - dl
    delta = delta.astype(cd, copy=False)
    # Rows where dP - D may be non-finite: their excluded pairs need dS = 0 explicitly
    # (0 * NaN is NaN), as do the rows of a NaN LSE; all rows when dO V^T may overflow
    # (huge finite garbage in an excluded value row).
    rows_bad = np.logical_or(nan_rows, np.logical_not(np.isfinite(delta)))
    if spec.may_mask and d_out is not None:
        do_norm = _max_norm(np.asarray(d_out, dtype=cd))
        if not do_norm * lay.v_norm < float(np.finfo(cd).max) / 4:
            rows_bad = np.ones_like(rows_bad)

    inv_total = _row_totals(spec, lay, lse_f, finite)
    bound = None
    sb = _static_bounds(spec, lay)
    if sb is not None:
        bound = sb[0]

    Hkv = spec.Hkv
    n_key_blocks = -(-spec.S // _nf.BWD_KEYS)
    n_threads = _fast_threads.num_threads()
    # (batch, KV head) pairs whose float-mask gradients land on the same mask elements
    # (the mask broadcasts over batch or heads) form one group, run in one unit in a
    # fixed order: an accumulation order that followed thread timing made the mask
    # gradient differ run to run. Each group owns its mask elements, so no lock either.
    groups = _mask_groups(spec, lay, nb)
    chunks = 1
    key_width = _nf.BWD_KEYS
    if n_threads > 1 and len(groups) < 2 * n_threads:
        want = -(-2 * n_threads // len(groups))
        if spec.mask_kind == "float" and n_key_blocks < want:
            # A broadcast float mask leaves few groups: narrower key chunks keep the
            # pool busy (each chunk owns its mask columns).
            key_width = min(_nf.BWD_KEYS, max(64, -(-spec.S // want)))
            n_key_blocks = -(-spec.S // key_width)
        chunks = max(1, min(n_key_blocks, want))
    dq_parts = np.zeros((chunks,) + lead + (spec.Hq, spec.L, spec.E), cd)
    dk_f = np.zeros(lead + (Hkv, spec.S, spec.E), cd)
    dv_f = np.zeros(lead + (Hkv, spec.S, spec.Ev), cd)
    d_mask_acc = None
    if spec.mask_kind == "float":
        d_mask_acc = np.zeros(lay.mask_padded_shape, cd)

    key_spans = _spans(0, spec.S, key_width)
    per_chunk = -(-len(key_spans) // chunks)
    units = []
    for members in groups:
        for c in range(chunks):
            spans = key_spans[c * per_chunk : (c + 1) * per_chunk]
            if spans:
                units.append((members, c, spans))
    serial = spec.Hq * nb * spec.L * spec.S < _nf._SERIAL_WORK
    rows = min(_nf.BWD_ROWS, spec.L)
    keys = min(_nf.BWD_KEYS, spec.S)
    ctx = dict(
        lay=lay,
        lse_safe=lse_safe,
        inv_total=inv_total,
        a_static=a_static,
        delta=delta,
        nan_rows=nan_rows if nan_rows.any() else None,
        rows_bad=rows_bad if rows_bad.any() else None,
        do_f=do_f,
        bound=bound,
        limit=limit,
        dq_parts=dq_parts,
        dk_f=dk_f,
        dv_f=dv_f,
        d_mask_acc=d_mask_acc,
        rows=rows,
    )

    def make_state():
        return _BwdState(rows, keys, spec.E, spec.Ev, cd, spec)

    def work(state, unit):
        _backward_unit(spec, ctx, state, unit)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        _run_units(units, make_state, work, serial)

    dq = dq_parts[0] if chunks == 1 else dq_parts.sum(axis=0)
    d_query = _reduce(spec, dq, spec.q_shape, spec.dtype)
    d_key = _reduce(spec, dk_f, spec.k_shape, spec.dtype)
    d_value = _reduce(spec, dv_f, spec.v_shape, spec.dtype)
    d_mask = None
    if d_mask_acc is not None:
        # (a float mask's gradient: there is a mask, with its shape)
        assert attn_mask is not None and spec.mask_shape is not None
        d_mask = _reduce(spec, d_mask_acc, spec.mask_shape, attn_mask.dtype)
    return d_query, d_key, d_value, d_mask


# Rows whose |LSE| * eps exceeds this are renormalised in the backward (see _row_totals).
_RENORMALISE_LSE_ERROR = 1e-4


def _row_totals(spec, lay, lse_f, finite):
    """``1 / sum_j exp(S_ij - LSE_i)`` for rows whose LSE is so large that rounding
    swallowed ``log(rowsum)`` (Hugging Face's ``finfo.min`` bias rows: ``m + log S == m``),
    else ``None``. ``exp(S - LSE)`` then sums to far more than 1 on those rows; the
    composed and chunked paths renormalise, and so does this one. Ordinary rows (error
    ``|LSE| * eps`` below ``_RENORMALISE_LSE_ERROR``) are left alone, so the extra pass
    over the keys runs only for such rows."""
    if spec.partial_keys:  # a block's keys are not the whole row: nothing to renormalise
        return None
    eps = float(np.finfo(lay.cd).eps)
    need = finite & (np.abs(lse_f) * eps > _RENORMALISE_LSE_ERROR)
    if not need.any():
        return None
    inv = np.ones(need.shape, lay.cd)
    rows = min(_nf.BWD_ROWS, spec.L)
    width = max(1, min(spec.S, _nf.BLOCK_ELEMENTS // rows))
    st = _FwdState(rows, width, spec.E, spec.Ev, lay.cd)
    for bi, b in enumerate(lay.lead_index):
        structure = lay.structs[bi]
        for h in range(spec.Hq):
            hk = lay.kv_head(h)
            for r0, r1 in _spans(0, min(spec.L, lay.q_len[bi]), rows):
                if not need[b + (h, slice(r0, r1))].any():
                    continue
                n = r1 - r0
                lse_r = lse_f[b + (h, slice(r0, r1))]
                lse_r = np.where(np.isfinite(lse_r), lse_r, 0.0)
                q_t = _scaled_query(spec, lay, b, h, r0, r1, st.q[:n])
                total = np.zeros((n,), lay.cd)
                c_lo, c_hi = structure.col_range(r0, r1, lay.kv_len[bi])
                for c0, c1 in _spans(c_lo, c_hi, width):
                    sc = st.s[:n, : c1 - c0]
                    _scores(spec, lay, st, structure, b, h, hk, r0, r1, c0, c1, q_t, sc, bi=bi)
                    np.subtract(sc, lse_r[:, None], out=sc)
                    np.exp(sc, out=sc)
                    total += sc.sum(axis=1)
                if lay.sinks is not None:  # the sink's share is part of the row's total
                    total += np.exp(lay.sinks[b + (h,)] - lse_r)
                fix = need[b + (h, slice(r0, r1))] & (total > 0)
                view = inv[b + (h, slice(r0, r1))]
                view[fix] = 1.0 / total[fix]
    return inv


def _broadcast_rows(spec, x, cd, width):
    a = blas_ready(np.asarray(x, dtype=cd)).reshape(spec.out_shape[:-1] + (width,))
    nd = len(spec.lead) + 3
    a = a.reshape((1,) * (nd - a.ndim) + a.shape)
    return np.broadcast_to(a, spec.lead + (spec.Hq, spec.L, width))


def _reduce(spec, x, shape, dtype):
    """Sum a full-lead gradient over broadcast dims to the argument's own shape."""
    nd = len(spec.lead) + 3
    padded = (1,) * (nd - len(shape)) + tuple(shape)
    axes = tuple(i for i, (d, t) in enumerate(zip(padded, x.shape, strict=True)) if d != t)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape).astype(dtype, copy=False)


def _mask_groups(spec: AttentionSpec, lay: _Layout, nb: int) -> list[list[tuple[int, int]]]:
    """``(batch index, KV head)`` pairs grouped by the float-mask elements their
    gradients reach (one pair per group without a float mask), in a fixed order."""
    pairs = [(bi, hk) for bi in range(nb) for hk in range(spec.Hkv)]
    if spec.mask_kind != "float":
        return [[p] for p in pairs]
    shape = lay.mask_padded_shape
    lead_shape = shape[:-3]
    heads_shared = shape[-3] == 1

    def owner(pair: tuple[int, int]) -> tuple[Any, ...]:
        b = lay.lead_index[pair[0]]
        mb = tuple(0 if d == 1 else i for i, d in zip(b, lead_shape, strict=True))
        return mb + ((0,) if heads_shared else (pair[1],))

    groups: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for p in pairs:
        groups.setdefault(owner(p), []).append(p)
    return list(groups.values())


def _backward_unit(spec, ctx, st, unit):
    members, chunk, spans = unit
    for bi, hk in members:
        _backward_pair(spec, ctx, st, bi, hk, chunk, spans)


def _backward_pair(spec, ctx, st, bi, hk, chunk, spans):
    lay = ctx["lay"]
    b = lay.lead_index[bi]
    heads = lay.heads_of(hk)
    dq = ctx["dq_parts"][chunk]
    structure = lay.structs[bi]
    for c0, c1 in spans:
        c1 = min(c1, lay.kv_len[bi])  # keys from kv_len on take no part: zero gradients
        if c1 <= c0:
            break
        w = c1 - c0
        r_lo, r_hi = _row_range(structure, c0, c1, lay.q_len[bi])
        dk = st.dk[:w]
        dv = st.dv[:w]
        dk[...] = 0
        dv[...] = 0
        plan = lay.flex
        if r_hi > r_lo and plan is not None:
            # arrayattn.flex: only the rows and key runs the block mask leaves non-empty.
            for h in heads:
                for r0, r1, runs in plan.row_groups(bi, h, h + 1, r_lo, r_hi, c0, c1, ctx["rows"]):
                    for a, z, masked in runs:
                        checkpoint()
                        _backward_block(
                            spec, ctx, st, structure, bi, b, h, hk, r0, r1, a, z, dq,
                            dk[a - c0 : z - c0], dv[a - c0 : z - c0], masked,
                        )  # fmt: skip
        elif r_hi > r_lo:
            for h in heads:
                for r0, r1 in _spans(r_lo, r_hi, ctx["rows"]):
                    checkpoint()  # an abandoned call (interrupt, a failed unit) stops here
                    _backward_block(
                        spec, ctx, st, structure, bi, b, h, hk, r0, r1, c0, c1, dq, dk, dv
                    )
        ctx["dk_f"][b + (hk, slice(c0, c1))] = dk
        ctx["dv_f"][b + (hk, slice(c0, c1))] = dv


def _backward_block(
    spec, ctx, st, structure, bi, b, h, hk, r0, r1, c0, c1, dq, dk, dv, masked=True
):
    lay = ctx["lay"]
    cd = lay.cd
    n, w = r1 - r0, c1 - c0
    row = b + (h, slice(r0, r1))
    lse_r = ctx["lse_safe"][row]
    static = False
    if ctx["bound"] is not None:
        # A large sink can lift the LSE far above the scores: exp(-LSE) must stay normal.
        static = (
            float(ctx["bound"][row].max()) <= ctx["limit"]
            and float(lse_r.min()) >= -ctx["limit"]
            and float(lse_r.max()) <= 2 * ctx["limit"]
        )
    # Row factor on P: exp(-LSE) on the static path, else the renormalisation of rows
    # whose huge LSE swallowed log(rowsum) (see _row_totals), else none.
    if static:
        a = ctx["a_static"][row]
    else:
        a = None if ctx["inv_total"] is None else ctx["inv_total"][row]
    v_blk = lay.v_op[b + (hk, slice(c0, c1))]

    # Scores (softcap keeps tanh in st.t for the chain rule).
    q_t = _scaled_query(spec, lay, b, h, r0, r1, st.q[:n])
    e = st.e[:n, :w]
    tanh = None if spec.softcap is None else st.t[:n, :w]
    chain = _scores(
        spec, lay, st, structure, b, h, hk, r0, r1, c0, c1, q_t, e, tanh, bi=bi, masked=masked,
        grad=True,
    )  # fmt: skip
    if spec.softcap is not None and (lay.k_op is not lay.k or lay.q_op is not lay.q):
        np.copyto(st.t[:n, :w], 0.0, where=np.isneginf(e))  # tanh of a garbage score
    if chain is not None and not np.isfinite(chain).all():
        # The score_mod's derivative at an excluded (garbage) score must not reach dS.
        chain = np.where(np.isneginf(e), 0.0, chain).astype(cd, copy=False)
    if not static:
        np.subtract(e, lse_r[:, None], out=e)
    np.exp(e, out=e)  # P (exact path) or exp(S) with P = diag(a) exp(S) (static path)
    if ctx["nan_rows"] is not None:  # NaN LSE: NaN wherever the row takes part
        for i in np.flatnonzero(ctx["nan_rows"][row]):
            np.copyto(e[i], np.nan, where=e[i] != 0)

    keep = None
    inv_keep = 1.0
    if spec.dropout_p > 0:
        inv_keep = 1.0 / (1.0 - spec.dropout_p)
        keep = _dropout_keep(spec, bi, h, r0, r1, c0, c1)

    delta = ctx["delta"][row]
    tmat = st.dp[:n, :w]
    do_f = ctx["do_f"]
    if do_f is not None:
        do_r = do_f[row]
        # dV += P_drop^T dO: the row factors a_i and 1/(1-p) go on dO's rows.
        doa = st.doa[:n]
        if a is not None:
            np.multiply(do_r, (a * inv_keep)[:, None], out=doa)
        else:
            np.multiply(do_r, inv_keep, out=doa)
        if keep is not None:
            e_drop = np.multiply(e, keep, out=st.ed[:n, :w])
        else:
            e_drop = e
        np.add(dv, np.matmul(e_drop.T, doa, out=st.tmp_v[:w]), out=dv)
        # dP = dO V^T (times the keep mask / (1-p)), then dS = P * (dP - delta).
        dos = st.do[:n]
        np.multiply(do_r, inv_keep, out=dos)
        np.matmul(dos, v_blk.T, out=tmat)
        if keep is not None:
            np.multiply(tmat, keep, out=tmat)
        np.subtract(tmat, delta[:, None], out=tmat)
    else:
        np.negative(np.broadcast_to(delta[:, None], (n, w)), out=tmat)
    np.multiply(tmat, e, out=tmat)  # dS, up to the row factor a_i on the static path
    if ctx["rows_bad"] is not None and ctx["rows_bad"][row].any():
        np.copyto(tmat, 0.0, where=e == 0)  # excluded pairs: dS = 0, even if dP - D is NaN

    coef = (a * spec.scale) if a is not None else np.full((n,), spec.scale, cd)
    if ctx["d_mask_acc"] is not None:
        g = tmat * a[:, None] if a is not None else tmat.copy()
        _add_mask_grad(spec, ctx, b, h, r0, r1, c0, c1, g)
    if spec.softcap is not None:
        t = st.t[:n, :w]
        np.multiply(t, t, out=t)
        np.subtract(1.0, t, out=t)
        np.multiply(tmat, t, out=tmat)
    if chain is not None:  # the score_mod's derivative (d score_mod / d score)
        np.multiply(tmat, chain, out=tmat)
    # dQ rows += coef * (dS K);  dK += dS^T (coef * Q).
    tq = np.matmul(tmat, lay.k_op[b + (hk, slice(c0, c1))], out=st.tmp_q[:n])
    np.multiply(tq, coef[:, None], out=tq)
    dq_rows = dq[row]
    np.add(dq_rows, tq, out=dq_rows)
    qa = np.multiply(lay.q_op[row], coef[:, None], out=st.qa[:n])
    np.add(dk, np.matmul(tmat.T, qa, out=st.tmp_k[:w]), out=dk)


def _add_mask_grad(spec, ctx, b, h, r0, r1, c0, c1, g):
    """Accumulate the gradient of a float mask block into the mask's own (broadcast)
    shape. The units that share mask elements are one unit (``_mask_groups``), so this
    runs without a lock and always in the same order."""
    acc = ctx["d_mask_acc"]
    nd = acc.ndim
    idx = []
    full = b + (h,)
    for axis in range(nd - 2):
        idx.append(0 if acc.shape[axis] == 1 else full[axis])
    if acc.shape[-2] == 1:
        g = g.sum(axis=0, keepdims=True)
        idx.append(slice(0, 1))
    else:
        idx.append(slice(r0, r1))
    if acc.shape[-1] == 1:
        g = g.sum(axis=1, keepdims=True)
        idx.append(slice(0, 1))
    else:
        idx.append(slice(c0, c1))
    view = acc[tuple(idx)]
    np.add(view, g, out=view)
