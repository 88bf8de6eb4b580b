"""``arrayattn.flex`` (block masks, mask_mods, score_mods) on the NumPy fast path, against
a plain float64 dense reference written here and against the composed path.

The fast path's tiles are shrunk (sizes that do not divide L and S, nor the block mask's
blocks) and its thread pool forced on, so that row groups, key runs cut by the block
mask, split-KV and the threaded backward are all exercised on small shapes. NumPy only
(plus one PyTorch declining check when torch is installed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.attention import threads as _fast_threads
from arrayattn.attention.fast import forward as fast_forward
from arrayattn.attention.fast import layout as fast
from arrayattn.attention.spec import make_spec
from arrayattn.attention.structure import Structure
from arrayattn.flex import (
    ScoreMod,
    alibi_score_mod,
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    global_tokens_mask,
    noop_mask,
    or_masks,
    prefix_lm_mask,
    relative_position_bias,
    relative_position_bias_2d,
    sliding_window_mask,
    softcap_score_mod,
)

TOL = 1e-12


@contextlib.contextmanager
def tiles(fwd_rows=24, block_elements=24 * 40, bwd_rows=20, bwd_keys=36):
    """Shrink the fast path's tiles and force its thread pool for one example."""
    names = ("FWD_ROWS", "BLOCK_ELEMENTS", "BWD_ROWS", "BWD_KEYS", "_SERIAL_WORK")
    saved = {n: getattr(fast, n) for n in names}
    saved_threads = _fast_threads.num_threads
    try:
        for n, value in zip(names, (fwd_rows, block_elements, bwd_rows, bwd_keys, 0), strict=True):
            setattr(fast, n, value)
        _fast_threads.num_threads = lambda: 2  # noqa: E731  (also on a 1-CPU machine)
        yield
    finally:
        for n, value in saved.items():
            setattr(fast, n, value)
        _fast_threads.num_threads = saved_threads


# ---------------------------------------------------------------------------------------
# Plain float64 dense reference
# ---------------------------------------------------------------------------------------
def reference(q, k, v, d_out, *, mod=None, smod=None, is_causal=False, window=None,
              softcap=None, sinks=None, kv_lengths=None, q_lengths=None,
              alibi=None):  # fmt: skip
    """``out, lse, (dq, dk, dv), d_table`` in float64 for ``(B, H, L, E)`` inputs (K/V
    with ``H / G`` heads: GQA), the mods evaluated on the dense index grid."""
    B, H, L, E = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = H // Hk
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    scale = 1.0 / math.sqrt(E)
    s = scale * (q @ np.swapaxes(kk, -1, -2))
    chain = np.ones_like(s)
    if softcap is not None:
        t = np.tanh(s / softcap)
        s, chain = softcap * t, 1.0 - t * t
    b = np.arange(B, dtype=np.int32).reshape(B, 1, 1, 1)
    h = np.arange(H, dtype=np.int32).reshape(1, H, 1, 1)
    qi = np.arange(L, dtype=np.int32).reshape(L, 1)
    ki = np.arange(S, dtype=np.int32)
    if alibi is not None:
        s = s - alibi.reshape(1, H, 1, 1) * np.abs(qi - ki)
    if smod is not None:
        d = smod.grad(s, b, h, qi, ki)
        s = np.broadcast_to(smod(s, b, h, qi, ki), s.shape)
        if d is not None:
            chain = chain * d
    allowed = np.ones(s.shape, bool)
    if mod is not None:
        allowed &= np.asarray(mod(b, h, qi, ki))
    if is_causal:
        allowed &= ki <= qi
    if window is not None:
        allowed &= (ki >= qi - window[0]) & (ki <= qi + window[1])
    if kv_lengths is not None:
        allowed &= ki < kv_lengths.reshape(B, 1, 1, 1)
    if q_lengths is not None:
        allowed &= qi < q_lengths.reshape(B, 1, 1, 1)
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks.reshape(1, H, 1, 1))
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.reshape(1, H, 1, 1) - m)
    lse = np.where(total > 0, m + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    out = p @ vv
    dp = d_out @ np.swapaxes(vv, -1, -2)
    delta = (d_out * out).sum(axis=-1, keepdims=True)
    ds_final = p * (dp - delta)  # gradient of the final (masked, modified) scores
    ds = ds_final * chain
    dq = scale * (ds @ kk)
    dkk = scale * (np.swapaxes(ds, -1, -2) @ q)
    dvv = np.swapaxes(p, -1, -2) @ d_out
    dk = dkk.reshape(B, Hk, G, S, E).sum(axis=2)
    dv = dvv.reshape(B, Hk, G, S, -1).sum(axis=2)
    return out, lse[..., 0], (dq, dk, dv), ds_final


def run(impl, q, k, v, d_out, **kw):
    """``out, lse, (dq, dk, dv), extra`` of ``vjp`` on ``impl``."""
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, return_lse=True, implementation=impl,
        enable_gqa=q.shape[1] != k.shape[1], **kw,
    )  # fmt: skip
    grads = pullback((d_out, np.zeros_like(lse)))
    extra = grads[-1] if isinstance(grads[-1], dict) else {}
    return out, lse, tuple(grads[:3]), extra


def inputs(B=2, H=4, Hk=2, L=101, S=101, E=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, E))
    k = rng.standard_normal((B, Hk, S, E))
    v = rng.standard_normal((B, Hk, S, E))
    d_out = rng.standard_normal((B, H, L, E))
    return q, k, v, d_out


def close(a, b, tol=TOL):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    same_inf = np.array_equal(np.isneginf(a), np.isneginf(b))
    assert same_inf, "-inf (empty rows) differ"
    fa, fb = np.where(np.isneginf(a), 0, a), np.where(np.isneginf(b), 0, b)
    err = float(np.max(np.abs(fa - fb), initial=0.0))
    assert err <= tol * max(1.0, float(np.max(np.abs(fb), initial=0.0))), err


def check(mod=None, smod=None, *, block_size=(16, 24), B=2, H=4, Hk=2, L=101, S=101,
          per_head=False, ref=True, **kw):  # fmt: skip
    """The fast path against the composed path (and the dense reference), forward and
    backward, with the block mask given (or the mask_mod alone when ``block_size`` is
    None)."""
    q, k, v, d_out = inputs(B, H, Hk, L, S)
    flex = {}
    if mod is not None and block_size is not None:
        flex["block_mask"] = create_block_mask(
            mod, B, H if per_head else None, L, S, block_size=block_size
        )
    elif mod is not None:
        flex["mask_mod"] = mod
    if smod is not None:
        flex["score_mod"] = smod
    with tiles():
        fast_res = run("fast", q, k, v, d_out, **flex, **kw)
    comp_res = run("composed", q, k, v, d_out, **flex, **kw)
    for a, b in zip(fast_res[:2], comp_res[:2], strict=True):
        close(a, b)
    for a, b in zip(fast_res[2], comp_res[2], strict=True):
        close(a, b)
    if smod is not None and smod.params:
        close(fast_res[3]["score_mod"][0], comp_res[3]["score_mod"][0])
    if ref:
        names = ("is_causal", "window", "softcap", "sinks", "kv_lengths", "q_lengths")
        rkw = {n: kw[n] for n in names if n in kw}
        if "alibi_slopes" in kw:
            rkw["alibi"] = kw["alibi_slopes"]
        out, lse, grads, ds_final = reference(q, k, v, d_out, mod=mod, smod=smod, **rkw)
        close(fast_res[0], out)
        close(fast_res[1], lse)
        for a, b in zip(fast_res[2], grads, strict=True):
            close(a, b, 1e-11)
    return fast_res, q


IDS = np.repeat(np.arange(6), [10, 23, 7, 30, 1, 30]).astype(np.int32)  # L = 101
IDS_2D = np.stack([IDS, np.repeat(np.arange(4), [40, 20, 21, 20]).astype(np.int32)])


def _stripes(b, h, q, kv):  # a plain function: classified by evaluation, head-dependent
    return ((q + 2 * kv + h) % 5 != 0) & (kv <= q + 3 * b)


MASKS = {
    "causal": causal_mask,
    "window": sliding_window_mask(17, 4),
    "document_causal": document_mask(IDS, causal=True),
    "document_per_batch": document_mask(IDS_2D),
    "prefix_lm": prefix_lm_mask(np.array([9, 40])),
    "global_or_window": or_masks(sliding_window_mask(8), global_tokens_mask(5)),
    "and_causal_document": and_masks(causal_mask, document_mask(IDS)),
    "noop": noop_mask,
    "plain_function": _stripes,
}


@pytest.mark.parametrize("name", list(MASKS))
def test_every_mask_matches_reference_and_composed(name):
    check(MASKS[name], per_head=name == "plain_function")


@pytest.mark.parametrize(
    "name,options",
    [
        ("document_causal", dict(is_causal=True)),
        ("window", dict(is_causal=True, window=(30, 0))),
        ("document_per_batch", dict(kv_lengths=np.array([101, 63]))),
        ("document_causal", dict(q_lengths=np.array([77, 101]), kv_lengths=np.array([90, 101]))),
        ("prefix_lm", dict(sinks=np.array([0.5, -1.0, 2.0, 0.0]))),
        ("global_or_window", dict(softcap=3.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]))),
    ],
)
def test_masks_combined_with_other_options(name, options):
    check(MASKS[name], **options)


def test_gqa_one_kv_head_and_mask_mod_without_block_mask():
    check(MASKS["document_causal"], H=6, Hk=1)
    check(MASKS["plain_function"], block_size=None)  # evaluated on every block


def test_cross_attention_shapes_and_ragged_blocks():
    check(sliding_window_mask(20, 20, offset=30), L=57, S=131, block_size=(13, 50))


def test_cross_attention_documents_missing_and_split_documents():
    q_ids = np.repeat([0, 1, 2, 3], [10, 20, 15, 12]).astype(np.int32)  # L = 57
    kv_ids = np.repeat([0, 2, 3, 4], [40, 30, 31, 30]).astype(np.int32)  # S = 131
    (out, lse, _, _), _ = check(document_mask(q_ids, kv_ids), L=57, S=131)
    assert np.all(out[:, :, 10:30] == 0) and np.all(np.isneginf(lse[:, :, 10:30]))  # no keys
    split = np.repeat([0, 2, 0, 3, 4], [20, 30, 20, 31, 30]).astype(np.int32)  # doc 0 twice
    check(document_mask(q_ids, split, causal=True), L=57, S=131)
    again = np.repeat([0, 1, 0, 2], [30, 20, 30, 21]).astype(np.int32)  # self-attention
    check(document_mask(again, causal=True))


def test_dropout_matches_composed():
    check(MASKS["document_causal"], ref=False, dropout_p=0.3, seed=7)


def test_empty_rows_give_zero_output_and_minus_inf_lse():
    def first_rows(b, h, q, kv):
        return (q < 40) & (kv <= q)

    (out, lse, grads, _), _ = check(first_rows)
    assert np.all(out[:, :, 40:] == 0) and np.all(np.isneginf(lse[:, :, 40:]))
    assert np.all(grads[0][:, :, 40:] == 0)
    # Every block empty for some batch: rows skipped entirely still come out empty.
    (out, lse, _, _), _ = check(_none_for_batch_1, per_head=True)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


def _none_for_batch_1(b, h, q, kv):
    return (b == 0) & (kv >= q - 10) & (kv <= q)


@pytest.mark.parametrize(
    "smod_name",
    ["t5", "swin", "alibi", "softcap", "square"],
)
def test_score_mods_forward_backward_and_table_gradient(smod_name):
    rng = np.random.default_rng(3)
    smods = {
        "t5": relative_position_bias(rng.standard_normal((32, 4))),
        "swin": relative_position_bias_2d(rng.standard_normal((15 * 25, 1)), (8, 13)),
        "alibi": alibi_score_mod(np.array([0.5, 0.25, 0.125, 0.0625])),
        "softcap": softcap_score_mod(2.5),
        "square": ScoreMod(lambda s, b, h, q, kv: s * s * 0.5, grad=lambda s, b, h, q, kv: s),
    }
    smod = smods[smod_name]
    mod = MASKS["document_causal"] if smod_name in ("t5", "softcap") else None
    (res, q) = check(mod, smod, softcap=4.0 if smod_name == "square" else None)
    if smod.params:  # the table's gradient against the dense reference's dS
        q, k, v, d_out = inputs()
        *_, ds_final = reference(q, k, v, d_out, mod=mod, smod=smod)
        B, H, L, S = ds_final.shape
        b = np.arange(B).reshape(B, 1, 1, 1)
        h = np.arange(H).reshape(1, H, 1, 1)
        want = smod.param_grads(ds_final, b, h, np.arange(L).reshape(L, 1), np.arange(S))[0]
        close(res[3]["score_mod"][0], want, 1e-11)


def test_static_bound_is_off_with_a_score_mod():
    q, k, v, _ = inputs(L=300, S=300)
    spec = make_spec(q, k, v, None, 0.0, False, None, True, "top_left", None, None, None,
                     score_mod=softcap_score_mod(5.0))  # fmt: skip
    lay = fast._Layout(spec, q, k, v, None)
    assert fast._static_bounds(spec, lay) is None
    # A score_mod that raises scores far beyond |q| |k|: still exact (no overflow).
    big = ScoreMod(lambda s, b, h, qi, kv: s + 500.0 * (kv == qi), grad=None)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    with tiles(fwd_rows=256, block_elements=1 << 18):
        out = aa.scaled_dot_product_attention(q32, k32, v32, score_mod=big, enable_gqa=True,
                                              implementation="fast")  # fmt: skip
    ref = aa.scaled_dot_product_attention(q, k, v, score_mod=big, enable_gqa=True,
                                          implementation="composed")  # fmt: skip
    np.testing.assert_allclose(out, ref, atol=1e-5)


class _Spy:
    """A document mask as a plain function, counting the pairs it is evaluated on."""

    def __init__(self, ids):
        self.ids = ids
        self.pairs = 0

    def __call__(self, b, h, q, kv):
        out = (self.ids[q] == self.ids[kv]) & (kv <= q)
        self.pairs += int(np.broadcast_to(out, np.broadcast_shapes(np.shape(b), np.shape(h),
                                          np.shape(q), np.shape(kv))).size)  # fmt: skip
        return out


def test_only_partial_blocks_are_evaluated():
    L = 512
    ids = np.repeat(np.arange(5), [100, 150, 62, 120, 80]).astype(np.int32)
    spy = _Spy(ids)
    bm = create_block_mask(spy, 1, None, L, L, block_size=32)
    full = int((bm.kinds == 2).sum())
    partial = int((bm.kinds == 1).sum())
    assert full > 0 and partial > 0 and (bm.kinds == 0).sum() > full
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, L, 16)) for _ in range(3))
    d_out = rng.standard_normal(q.shape)
    spy.pairs = 0
    with tiles(fwd_rows=64, block_elements=64 * 96, bwd_rows=64, bwd_keys=96):
        (out, lse), pb = aa.vjp(aa.scaled_dot_product_attention, q, k, v, block_mask=bm,
                                return_lse=True, implementation="fast")  # fmt: skip
        fwd_pairs = spy.pairs
        grads = pb((d_out, np.zeros_like(lse)))
    bwd_pairs = spy.pairs - fwd_pairs
    # Each pass evaluates each partial block's pairs, per head, about once (row groups
    # may merge a few neighbours): far below L * S per head.
    for pairs in (fwd_pairs, bwd_pairs):
        assert 0 < pairs <= 2 * 2 * partial * 32 * 32
        assert pairs < 0.35 * 2 * L * L
    ref = reference(q, k, v, d_out, mod=spy)
    close(out, ref[0])
    close(lse, ref[1])
    for a, b in zip(grads[:3], ref[2], strict=True):
        close(a, b, 1e-11)


def test_built_in_document_mask_takes_the_shortcut():
    calls = []

    class Counting(type(document_mask(IDS, causal=True))):
        def __call__(self, *args):
            calls.append(1)
            return super().__call__(*args)

    mod = Counting(IDS, None, True)
    q, k, v, d_out = inputs()
    bm = create_block_mask(mod, 2, None, 101, 101, block_size=(16, 24))
    with tiles():
        fast_res = run("fast", q, k, v, d_out, block_mask=bm)
    assert not calls
    ref = reference(q, k, v, d_out, mod=document_mask(IDS, causal=True))
    close(fast_res[0], ref[0])
    close(fast_res[2][1], ref[2][1], 1e-11)


def test_a_block_of_a_larger_call_uses_global_positions():
    """A spec made a block of a larger call (``as_block``: rows, heads and batches with
    origins) gives the larger call's rows: the mods see global indices."""
    q, k, v, _ = inputs(B=3, H=4, Hk=4, L=101, S=101)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((32, 4))
    mod, smod = document_mask(np.stack([IDS, IDS[::-1], IDS]), causal=True), \
        relative_position_bias(table)  # fmt: skip
    bm = create_block_mask(mod, 3, None, 101, 101, block_size=(16, 24))
    full = aa.scaled_dot_product_attention(q, k, v, block_mask=bm, score_mod=smod,
                                           implementation="composed")  # fmt: skip
    rows, heads, batch = slice(37, 90), slice(1, 3), [1]
    qb = q[batch][:, heads, rows]
    kb, vb = k[batch][:, heads], v[batch][:, heads]
    spec = make_spec(qb, kb, vb, None, 0.0, False, None, False, "top_left", None, None, None)
    spec = dataclasses.replace(spec, block_mask=bm, mask_mod=mod, score_mod=smod)
    spec = spec.as_block(batch_ids=(1,), head0=1, row0=37, col0=0,
                         structure=Structure(0, -1, -1))  # fmt: skip
    assert fast.declines(spec) is None
    out, _ = fast_forward.forward(spec, qb, kb, vb, None)
    close(out, full[batch][:, heads, rows])


def test_pytorch_tensors_decline_mods_that_capture_tensors():
    torch = pytest.importorskip("torch")
    q = torch.ones((1, 2, 16, 8))
    ids = torch.zeros(16, dtype=torch.int64)
    reason = None
    with pytest.raises(ValueError, match="NumPy index arrays") as err:
        aa.scaled_dot_product_attention(q, q, q, mask_mod=document_mask(ids),
                                         implementation="fast")  # fmt: skip
    reason = str(err.value)
    assert "chunked and composed" in reason
    with pytest.raises(ValueError, match="score_mod"):
        aa.scaled_dot_product_attention(q, q, q, score_mod=softcap_score_mod(2.0),
                                         implementation="fast")  # fmt: skip
    # Index-only built-ins run on the tensors' NumPy views.
    x = torch.randn((1, 2, 40, 8), dtype=torch.float64)
    fast_out = aa.scaled_dot_product_attention(x, x, x, mask_mod=sliding_window_mask(5),
                                               implementation="fast")  # fmt: skip
    comp_out = aa.scaled_dot_product_attention(x, x, x, mask_mod=sliding_window_mask(5),
                                               implementation="composed")  # fmt: skip
    close(fast_out.numpy(), comp_out.numpy())
