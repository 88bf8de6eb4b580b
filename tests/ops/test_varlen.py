"""Packed variable-length attention equals per-sequence attention run one by one."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import check_vjp_fd, xp_assert_close
from _reference import attention as reference_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention import chunked

SETTINGS = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def skip_slow(backend) -> None:
    if backend.name == "jax":
        pytest.skip("jax: property tests too slow op by op; see the fixed case")


def cumulative(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def per_sequence_reference(q, k, v, lq, lk, **opts):
    """Plain float64 attention of each sequence on its own, packed back together."""
    cq, ck = cumulative(lq), cumulative(lk)
    Hq, Ev = q.shape[0], v.shape[-1]
    outs, lses = [], []
    for b in range(len(lq)):
        qs = q[:, cq[b] : cq[b + 1]]
        if lk[b] == 0:  # no key: empty rows
            outs.append(np.zeros((Hq, lq[b], Ev)))
            lses.append(np.full((Hq, lq[b]), -np.inf))
            continue
        o, lse, _ = reference_attention(
            qs,
            k[:, ck[b] : ck[b + 1]],
            v[:, ck[b] : ck[b + 1]],
            enable_gqa=q.shape[0] != k.shape[0],
            **opts,
        )
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs, axis=1), np.concatenate(lses, axis=1)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 3))
    return dict(
        lq=draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)),
        lk=draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)),
        Hkv=draw(st.integers(1, 2)),
        G=draw(st.integers(1, 2)),
        is_causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(("top_left", "bottom_right"))),
        window=draw(st.none() | st.tuples(st.integers(-1, 2), st.integers(-1, 2))),
        softcap=draw(st.sampled_from((None, 2.0))),
        implementation=draw(st.sampled_from(("composed", "chunked"))),
        give_max=draw(st.booleans()),
        seed=draw(st.integers(0, 1000)),
    )


def _arrays(c, rng):
    Hkv = c["Hkv"]
    Hq = Hkv * c["G"]
    q = rng.standard_normal((Hq, sum(c["lq"]), 3))
    k = rng.standard_normal((Hkv, sum(c["lk"]), 3))
    v = rng.standard_normal((Hkv, sum(c["lk"]), 2))
    return q, k, v


def _run(backend, c):
    rng = np.random.default_rng(c["seed"])
    q, k, v = _arrays(c, rng)
    structure = dict(
        is_causal=c["is_causal"],
        causal_align=c["causal_align"],
        window=c["window"],
        softcap=c["softcap"],
    )
    exp_out, exp_lse = per_sequence_reference(q, k, v, c["lq"], c["lk"], **structure)
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    cq, ck = (backend.asarray(cumulative(x)) for x in (c["lq"], c["lk"]))
    extra = {}
    if c["give_max"]:
        extra = dict(max_seqlen_q=max(c["lq"]), max_seqlen_k=max(c["lk"]))
    (out, lse), pullback = aa.vjp(
        aa.varlen_attention,
        qb,
        kb,
        vb,
        cq,
        ck,
        return_lse=True,
        implementation=c["implementation"],
        **structure,
        **extra,
    )
    xp_assert_close(backend, out, exp_out, dtype="float64")
    xp_assert_close(backend, lse, exp_lse, dtype="float64")

    # Backward: the per-sequence calls' gradients, sequence by sequence.
    d_out = rng.standard_normal(exp_out.shape)
    d_lse = rng.standard_normal(exp_lse.shape)
    dq, dk, dv, d_cq, d_ck = pullback((backend.asarray(d_out), backend.asarray(d_lse)))
    assert d_cq is None and d_ck is None
    want = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    cqn, ckn = cumulative(c["lq"]), cumulative(c["lk"])
    for b in range(len(c["lq"])):
        rq, rk = slice(cqn[b], cqn[b + 1]), slice(ckn[b], ckn[b + 1])
        if c["lq"][b] == 0 or c["lk"][b] == 0:
            continue  # nothing flows: zero gradients
        _, pb = aa.vjp(
            aa.scaled_dot_product_attention,
            q[:, rq],
            k[:, rk],
            v[:, rk],
            enable_gqa=c["G"] > 1,
            return_lse=True,
            implementation="composed",
            **structure,
        )
        g = pb((d_out[:, rq], d_lse[:, rq]))
        want[0][:, rq], want[1][:, rk], want[2][:, rk] = g
    for got, w in zip((dq, dk, dv), want, strict=True):
        xp_assert_close(backend, got, w, dtype="float64")


@SETTINGS
@given(c=cases())
def test_varlen_equals_sequences_one_by_one(backend, c):
    skip_slow(backend)
    _run(backend, c)


def test_fixed_case_every_backend(backend, monkeypatch):
    monkeypatch.setattr(chunked, "BLOCK_Q", 2)
    monkeypatch.setattr(chunked, "BLOCK_K", 3)
    c = dict(
        lq=[3, 0, 4],
        lk=[5, 2, 3],
        Hkv=1,
        G=2,
        is_causal=True,
        causal_align="bottom_right",
        window=(3, -1),
        softcap=2.0,
        implementation="chunked",
        give_max=False,
        seed=3,
    )
    _run(backend, c)


@pytest.mark.parametrize("implementation", ["composed", "chunked"])
def test_dropout_equals_the_padded_call(implementation):
    """Batch index = sequence index, positions within the sequence."""
    rng = np.random.default_rng(0)
    lq, lk = [2, 4, 1], [3, 1, 4]
    q = rng.standard_normal((2, sum(lq), 3))
    k = rng.standard_normal((2, sum(lk), 3))
    v = rng.standard_normal((2, sum(lk), 3))
    opts = dict(dropout_p=0.4, seed=99, is_causal=True, causal_align="bottom_right")
    out = aa.varlen_attention(
        q, k, v, cumulative(lq), cumulative(lk), implementation=implementation, **opts
    )
    # The padded batch, built plainly.
    n, mq, mk = 3, max(lq), max(lk)
    qp, kp, vp = np.zeros((n, 2, mq, 3)), np.zeros((n, 2, mk, 3)), np.zeros((n, 2, mk, 3))
    cq, ck = cumulative(lq), cumulative(lk)
    for b in range(n):
        qp[b, :, : lq[b]] = q[:, cq[b] : cq[b + 1]]
        kp[b, :, : lk[b]] = k[:, ck[b] : ck[b + 1]]
        vp[b, :, : lk[b]] = v[:, ck[b] : ck[b + 1]]
    padded = aa.scaled_dot_product_attention(
        qp,
        kp,
        vp,
        q_lengths=np.array(lq),
        kv_lengths=np.array(lk),
        implementation=implementation,
        **opts,
    )
    for b in range(n):
        np.testing.assert_allclose(out[:, cq[b] : cq[b + 1]], padded[b, :, : lq[b]], atol=1e-12)
    # Dropout really acted: the call without it differs.
    plain = aa.varlen_attention(q, k, v, cq, ck, is_causal=True, causal_align="bottom_right")
    assert not np.allclose(out, plain)


def test_finite_differences():
    rng = np.random.default_rng(1)
    lq, lk = [2, 3], [3, 2]
    args = [
        rng.standard_normal((2, 5, 2)),
        rng.standard_normal((1, 5, 2)),
        rng.standard_normal((1, 5, 2)),
        cumulative(lq),
        cumulative(lk),
    ]
    kwargs = dict(is_causal=True, causal_align="bottom_right", return_lse=True, dropout_p=0.2)
    kwargs["seed"] = 5
    check_vjp_fd(aa.varlen_attention, args, kwargs, wrt=[0, 1, 2], rtol=1e-5, atol=1e-7)


def test_all_sequences_empty():
    q = np.ones((2, 0, 3))
    cu = np.zeros(3, dtype=np.int64)
    out, lse = aa.varlen_attention(q, q, q, cu, cu, return_lse=True)
    assert out.shape == (2, 0, 3) and lse.shape == (2, 0)
    k = np.ones((2, 4, 3))
    out, pullback = aa.vjp(aa.varlen_attention, k, q, q, np.array([0, 4]), np.array([0, 0]))
    assert np.all(out == 0)
    dq, dk, dv, _, _ = pullback(np.ones_like(out))
    assert np.all(dq == 0) and dk.shape == (2, 0, 3)


def test_bad_inputs():
    q = np.zeros((2, 5, 3))
    cu = np.array([0, 2, 5])
    with pytest.raises(ValueError, match="query must be packed"):
        aa.varlen_attention(np.zeros((1, 2, 5, 3)), q, q, cu, cu)
    with pytest.raises(TypeError, match="cu_seqlens_q.*integer"):
        aa.varlen_attention(q, q, q, cu.astype(float), cu)
    with pytest.raises(ValueError, match="same number of sequences"):
        aa.varlen_attention(q, q, q, cu, np.array([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        aa.varlen_attention(q, q, q, cu, np.array([1, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens_q.*end at the packed length 5"):
        aa.varlen_attention(q, q, q, np.array([0, 2, 4]), cu)
    with pytest.raises(ValueError, match="non-decreasing"):
        aa.varlen_attention(q, q, q, np.array([0, 3, 2, 5]), np.array([0, 1, 2, 5]))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        aa.varlen_attention(q, q, q, cu, cu, max_seqlen_q=-1)
    with pytest.raises(ValueError, match="multiple"):
        aa.varlen_attention(np.zeros((3, 5, 3)), q, q, cu, cu)
    with pytest.raises(ValueError, match="dropout_p"):
        aa.varlen_attention(q, q, q, cu, cu, dropout_p=1.5)
    with pytest.raises(ValueError, match="implementation"):
        aa.varlen_attention(q, q, q, cu, cu, implementation="nope")
