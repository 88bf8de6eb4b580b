"""scaled_dot_product_attention and attention_weights against the float64 reference, on
every backend and dtype."""

from __future__ import annotations

import _reference as ref
import numpy as np
import pytest
from _helpers import (
    assert_same_device,
    attention_inputs,
    backend_dtype,
    lse_dtype_name,
    name_of_dtype,
    thin,
    xp_assert_close,
)

import arrayattn as aa

# (id, query shape, key shape, value shape or None (= key), mask (kind, shape) or None, kwargs)
CASES = [
    ("plain", (2, 3, 5, 8), (2, 3, 7, 8), None, None, {}),
    ("scale", (1, 2, 4, 8), (1, 2, 6, 8), None, None, {"scale": 0.37}),
    ("value_dim", (1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 5), None, {}),
    ("bool_LS", (2, 2, 5, 4), (2, 2, 6, 4), None, ("bool", (5, 6)), {}),
    ("bool_padding", (2, 2, 5, 4), (2, 2, 6, 4), None, ("bool", (2, 1, 1, 6)), {}),
    ("bool_per_head", (2, 3, 5, 4), (2, 3, 6, 4), None, ("bool", (3, 5, 6)), {}),
    ("bool_full", (2, 3, 5, 4), (2, 3, 6, 4), None, ("bool", (2, 3, 5, 6)), {}),
    ("float_LS", (2, 2, 5, 4), (2, 2, 6, 4), None, ("float", (5, 6)), {}),
    ("float_full", (2, 3, 5, 4), (2, 3, 6, 4), None, ("float", (2, 3, 5, 6)), {}),
    ("float_row", (2, 3, 5, 4), (2, 3, 6, 4), None, ("float", (2, 1, 5, 1)), {}),
    ("causal_tl_square", (1, 2, 6, 4), (1, 2, 6, 4), None, None, {"is_causal": True}),
    ("causal_tl_L<S", (1, 2, 4, 4), (1, 2, 7, 4), None, None, {"is_causal": True}),
    ("causal_tl_L>S", (1, 2, 7, 4), (1, 2, 4, 4), None, None, {"is_causal": True}),
    (
        "causal_br_L<S",
        (1, 2, 4, 4),
        (1, 2, 7, 4),
        None,
        None,
        {"is_causal": True, "causal_align": "bottom_right"},
    ),
    (
        "causal_br_L>S",
        (1, 2, 7, 4),
        (1, 2, 4, 4),
        None,
        None,
        {"is_causal": True, "causal_align": "bottom_right"},
    ),
    ("window_2_0", (1, 2, 6, 4), (1, 2, 6, 4), None, None, {"window": (2, 0)}),
    ("window_1_1", (1, 2, 6, 4), (1, 2, 8, 4), None, None, {"window": (1, 1)}),
    ("window_-1_1", (1, 2, 6, 4), (1, 2, 6, 4), None, None, {"window": (-1, 1)}),
    ("window_2_-1", (1, 2, 6, 4), (1, 2, 6, 4), None, None, {"window": (2, -1)}),
    (
        "window_br_causal",
        (1, 2, 4, 4),
        (1, 2, 9, 4),
        None,
        None,
        {"window": (3, 2), "is_causal": True, "causal_align": "bottom_right"},
    ),
    ("softcap", (1, 2, 5, 4), (1, 2, 6, 4), None, None, {"softcap": 2.0, "scale": 1.5}),
    (
        "softcap_mask_causal",
        (1, 2, 5, 4),
        (1, 2, 6, 4),
        None,
        ("float", (5, 6)),
        {"softcap": 1.5, "is_causal": True},
    ),
    ("gqa", (2, 4, 5, 4), (2, 2, 6, 4), None, None, {"enable_gqa": True}),
    ("mqa", (2, 3, 5, 4), (2, 1, 6, 4), None, None, {"enable_gqa": True}),
    (
        "gqa_mask_causal",
        (1, 6, 5, 4),
        (1, 2, 7, 4),
        None,
        ("bool", (1, 6, 5, 7)),
        {"enable_gqa": True, "is_causal": True, "causal_align": "bottom_right"},
    ),
    (
        "bool_and_causal",
        (2, 2, 5, 4),
        (2, 2, 5, 4),
        None,
        ("bool", (2, 1, 5, 5)),
        {"is_causal": True},
    ),
    ("lead_broadcast", (2, 1, 3, 4, 4), (1, 3, 3, 5, 4), None, None, {}),
    ("query_3d_kv_4d", (3, 4, 4), (2, 3, 5, 4), None, None, {}),
    ("heads_broadcast", (2, 3, 4, 4), (2, 1, 5, 4), None, None, {}),
    ("2d", (5, 4), (6, 4), (6, 3), ("float", (5, 6)), {"is_causal": True}),
    ("3d", (3, 5, 4), (3, 6, 4), None, ("bool", (5, 6)), {}),
]


def _case_ids(cases):
    return [c[0] for c in cases]


def run_case(backend, dt, rng, q_shape, k_shape, v_shape, mask, kwargs):
    dtype = backend_dtype(backend, dt)
    q, k, v, m = attention_inputs(rng, q_shape, k_shape, v_shape, mask, dtype=dt)
    exp_out, exp_lse, exp_p = ref.attention(q, k, v, m, **kwargs)
    args = [backend.asarray(a) for a in (q, k, v)]
    m_b = None if m is None else backend.asarray(m)
    out, lse = backend.call(aa.scaled_dot_product_attention, *args, m_b, return_lse=True, **kwargs)
    assert out.dtype == dtype
    xp_assert_close(backend, out, exp_out, dtype=dt)
    # LSE in float32 (float64 for float64), exact -inf on empty rows.
    xp_assert_close(
        backend, lse, exp_lse, dtype=lse_dtype_name(dt), rtol=TOL_LSE[dt], atol=TOL_LSE[dt]
    )
    return q, k, v, m, exp_p


JAX_FORWARD = {
    (name, "float32")
    for name in (
        "plain",
        "bool_padding",
        "float_full",
        "causal_tl_L<S",
        "causal_br_L>S",
        "window_-1_1",
        "softcap_mask_causal",
        "gqa",
        "mqa",
        "lead_broadcast",
        "2d",
    )
} | {("gqa_mask_causal", "float16"), ("window_br_causal", "float64"), ("plain", "float64")}

# LSE is computed in float32 from inputs rounded to the dtype: float32-level error.
TOL_LSE = {"float16": 1e-4, "float32": 1e-5, "float64": 1e-10}


@pytest.mark.parametrize(
    "name, q_shape, k_shape, v_shape, mask, kwargs", CASES, ids=_case_ids(CASES)
)
def test_forward_matches_reference(
    backend, dtype_name, rng, name, q_shape, k_shape, v_shape, mask, kwargs
):
    thin(backend, (name, dtype_name) in JAX_FORWARD)
    run_case(backend, dtype_name, rng, q_shape, k_shape, v_shape, mask, kwargs)


def test_default_returns_only_output(backend, rng):
    thin(backend, False)
    q, k, v, _ = attention_inputs(rng, (1, 2, 3, 4), (1, 2, 5, 4), dtype="float32")
    out = aa.scaled_dot_product_attention(*(backend.asarray(a) for a in (q, k, v)))
    assert not isinstance(out, tuple)
    assert tuple(out.shape) == (1, 2, 3, 4)
    assert_same_device(backend, out)


@pytest.mark.parametrize("p", [0.25, 0.6])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_dropout_matches_reference(backend, dtype_name, rng, p, gqa):
    """The reference takes its keep-mask from ``dropout_mask``: the mask is defined by the
    hash (tested separately), this checks it is applied after softmax with 1/(1-p)."""
    thin(backend, (dtype_name, gqa, p) == ("float32", True, 0.25))
    dtype = backend_dtype(backend, dtype_name)
    Hkv = 2 if gqa else 4
    q, k, v, m = attention_inputs(
        rng, (2, 4, 5, 4), (2, Hkv, 6, 4), mask=("bool", (5, 6)), dtype=dtype_name
    )
    kwargs = dict(dropout_p=p, seed=1234, enable_gqa=gqa, is_causal=True)
    keep = np.asarray(aa.dropout_mask(q, k, p, seed=1234, enable_gqa=gqa))
    assert keep.shape == (2, 4, 5, 6) and keep.dtype == np.bool_
    exp_out, exp_lse, exp_p = ref.attention(q, k, v, m, keep=keep, **kwargs)
    qb, kb, vb, mb = (backend.asarray(a) for a in (q, k, v, m))
    out, lse = backend.call(
        aa.scaled_dot_product_attention, qb, kb, vb, mb, return_lse=True, **kwargs
    )
    assert out.dtype == dtype
    xp_assert_close(backend, out, exp_out, dtype=dtype_name)
    # The LSE is that of the scores, before dropout.
    xp_assert_close(
        backend,
        lse,
        exp_lse,
        dtype=lse_dtype_name(dtype_name),
        rtol=TOL_LSE[dtype_name],
        atol=TOL_LSE[dtype_name],
    )
    w = backend.call(aa.attention_weights, qb, kb, mb, **kwargs)
    xp_assert_close(backend, w, exp_p, dtype=dtype_name)


def test_dropout_zero_p_ignores_seed(backend, rng):
    thin(backend, False)
    q, k, v, _ = attention_inputs(rng, (1, 2, 3, 4), (1, 2, 5, 4))
    args = [backend.asarray(a) for a in (q, k, v)]
    a = aa.scaled_dot_product_attention(*args, dropout_p=0.0, seed=5)
    xp_assert_close(backend, a, ref.attention(q, k, v)[0], dtype="float64")


def test_dropout_same_seed_same_output_other_seed_differs(rng):
    q, k, v, _ = attention_inputs(rng, (1, 2, 8, 4), (1, 2, 8, 4))
    a = aa.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=3)
    b = aa.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=3)
    c = aa.scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


EMPTY_CASES = [
    # (id, q shape, k shape, mask, kwargs, rows that are empty (index into L))
    ("bool_row", (1, 2, 4, 4), (1, 2, 5, 4), "bool", {}, [1, 3]),
    ("float_-inf_row", (1, 2, 4, 4), (1, 2, 5, 4), "float", {}, [0, 2]),
    (
        "causal_br_L>S",
        (1, 2, 6, 4),
        (1, 2, 3, 4),
        None,
        {"is_causal": True, "causal_align": "bottom_right"},
        [0, 1, 2],
    ),
    ("window_past_end", (1, 2, 5, 4), (1, 2, 3, 4), None, {"window": (0, 0)}, [3, 4]),
    ("all_masked", (1, 1, 3, 4), (1, 1, 4, 4), "bool", {}, [0, 1, 2]),
]


def _empty_mask(kind, L, S, empty_rows, rng):
    allowed = rng.random((L, S)) < 0.8
    allowed[:, 0] = True
    allowed[empty_rows, :] = False
    if kind == "bool":
        return allowed
    bias = rng.standard_normal((L, S))
    return np.where(allowed, bias, -np.inf)


@pytest.mark.parametrize(
    "name, q_shape, k_shape, mask_kind, kwargs, empty", EMPTY_CASES, ids=[c[0] for c in EMPTY_CASES]
)
def test_empty_rows_zero_output_neg_inf_lse_zero_grads(
    backend, dtype_name, rng, name, q_shape, k_shape, mask_kind, kwargs, empty
):
    thin(backend, (name, dtype_name) in {("bool_row", "float32"), ("causal_br_L>S", "float16")})
    dtype = backend_dtype(backend, dtype_name)
    L, S = q_shape[-2], k_shape[-2]
    q, k, v, _ = attention_inputs(rng, q_shape, k_shape, dtype=dtype_name)
    m = None if mask_kind is None else _empty_mask(mask_kind, L, S, empty, rng)
    if m is not None and m.dtype != np.bool_:
        m = m.astype(dtype_name)
    exp_out, exp_lse, _ = ref.attention(q, k, v, m, **kwargs)
    assert np.all(np.isneginf(exp_lse[..., empty]))
    qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
    mb = None if m is None else backend.asarray(m)
    d_out = rng.standard_normal(exp_out.shape).astype(dtype_name)
    d_lse = rng.standard_normal(exp_lse.shape).astype(lse_dtype_name(dtype_name))
    (out, lse), grads = backend.vjp(
        aa.scaled_dot_product_attention,
        (qb, kb, vb, mb),
        (backend.asarray(d_out), backend.asarray(d_lse)),
        return_lse=True,
        **kwargs,
    )
    assert out.dtype == dtype
    xp_assert_close(backend, out, exp_out, dtype=dtype_name)
    out_np, lse_np = backend.to_numpy(out), backend.to_numpy(lse)
    assert np.all(out_np[..., empty, :] == 0)
    assert np.all(np.isneginf(lse_np[..., empty]))
    dq = backend.to_numpy(grads[0])
    for g in grads[:3]:
        assert g.dtype == dtype
        assert np.all(np.isfinite(backend.to_numpy(g))), "non-finite gradient"
    assert np.all(dq[..., empty, :] == 0), "empty rows must have zero d_query"
    if mask_kind == "float":
        dm = backend.to_numpy(grads[3])
        assert np.all(np.isfinite(dm)) and np.all(dm[..., empty, :] == 0)
    if len(empty) == L:
        assert np.all(backend.to_numpy(grads[1]) == 0) and np.all(backend.to_numpy(grads[2]) == 0)


def test_empty_rows_do_not_leak_into_key_grads(rng):
    """Zeroing the cotangent of the non-empty rows leaves only empty rows: all grads 0."""
    q, k, v, _ = attention_inputs(rng, (1, 2, 5, 4), (1, 2, 3, 4))
    kwargs = {"is_causal": True, "causal_align": "bottom_right"}
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, return_lse=True, **kwargs
    )
    d_out = np.zeros_like(out)
    d_out[..., :2, :] = 1.0  # rows 0, 1 see no key (L - S = 2)
    d_lse = np.zeros_like(lse)
    d_lse[..., :2] = 1.0
    dq, dk, dv = pullback((d_out, d_lse))
    for g in (dq, dk, dv):
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize(
    "name, q_shape, k_shape, v_shape, mask, kwargs",
    [
        c
        for c in CASES
        if c[0]
        in (
            "plain",
            "bool_padding",
            "float_full",
            "causal_br_L>S",
            "window_1_1",
            "softcap",
            "gqa",
            "lead_broadcast",
            "2d",
        )
    ],
    ids=[
        "plain",
        "bool_padding",
        "float_full",
        "causal_br_L>S",
        "window_1_1",
        "softcap",
        "gqa",
        "lead_broadcast",
        "2d",
    ],
)
def test_attention_weights_match_reference(
    backend, dtype_name, rng, name, q_shape, k_shape, v_shape, mask, kwargs
):
    thin(backend, (name, dtype_name) in {("gqa", "float32"), ("float_full", "float64")})
    dtype = backend_dtype(backend, dtype_name)
    q, k, v, m = attention_inputs(rng, q_shape, k_shape, v_shape, mask, dtype=dtype_name)
    exp_out, _, exp_p = ref.attention(q, k, v, m, **kwargs)
    mb = None if m is None else backend.asarray(m)
    w = backend.call(aa.attention_weights, backend.asarray(q), backend.asarray(k), mb, **kwargs)
    assert w.dtype == dtype
    xp_assert_close(backend, w, exp_p, dtype=dtype_name)
    # and they are what attention multiplies into the values
    out = backend.call(
        aa.scaled_dot_product_attention, *(backend.asarray(a) for a in (q, k, v)), mb, **kwargs
    )
    xp_assert_close(backend, out, exp_out, dtype=dtype_name)
    rows = backend.to_numpy(w).astype(np.float64).sum(axis=-1)
    np.testing.assert_allclose(rows, exp_p.sum(axis=-1), rtol=0, atol=4e-3)


def test_output_shapes_leading_dims(backend, rng):
    thin(backend, False)
    q, k, v, _ = attention_inputs(rng, (2, 1, 3, 4, 6), (1, 5, 3, 7, 6), (1, 5, 3, 7, 2))
    out, lse = aa.scaled_dot_product_attention(
        *(backend.asarray(a) for a in (q, k, v)), return_lse=True
    )
    assert tuple(out.shape) == (2, 5, 3, 4, 2)
    assert tuple(lse.shape) == (2, 5, 3, 4)
    exp_out, exp_lse, _ = ref.attention(q, k, v)
    xp_assert_close(backend, out, exp_out, dtype="float64")
    xp_assert_close(backend, lse, exp_lse, dtype="float64")


@pytest.mark.parametrize("big", [1e2, 1e4])
def test_large_logits_stay_finite(backend, dtype_name, rng, big):
    """Scores of order 1e4 (and float16 inputs whose products overflow float16) stay
    finite: the softmax runs in float32 with a running max."""
    thin(backend, (dtype_name, big) == ("float16", 1e4))
    backend_dtype(backend, dtype_name)
    q, k, v, _ = attention_inputs(rng, (1, 2, 4, 4), (1, 2, 5, 4))
    q = (q * np.sqrt(big)).astype(dtype_name)
    k = (k * np.sqrt(big)).astype(dtype_name)
    v = v.astype(dtype_name)
    exp_out, exp_lse, _ = ref.attention(q, k, v, scale=1.0)
    out, lse = backend.call(
        aa.scaled_dot_product_attention,
        *(backend.asarray(a) for a in (q, k, v)),
        scale=1.0,
        return_lse=True,
    )
    assert np.all(np.isfinite(backend.to_numpy(out)))
    assert np.all(np.isfinite(backend.to_numpy(lse)))
    xp_assert_close(backend, out, exp_out, dtype=dtype_name)
    xp_assert_close(backend, lse, exp_lse, rtol=1e-6 if dtype_name != "float64" else 1e-12, atol=0)


def test_float16_large_values_finite(backend, rng):
    backend_dtype(backend, "float16")
    q, k, v, _ = attention_inputs(rng, (1, 2, 6, 64), (1, 2, 6, 64))
    q16 = (q * 30).astype(np.float16)  # |q.k| ~ 30*30*8 overflows float16's 65504
    k16 = (k * 30).astype(np.float16)
    v16 = (v * 1000).astype(np.float16)
    out = backend.call(
        aa.scaled_dot_product_attention, *(backend.asarray(a) for a in (q16, k16, v16))
    )
    got = backend.to_numpy(out)
    assert got.dtype == np.float16 and np.all(np.isfinite(got))
    xp_assert_close(
        backend, out, ref.attention(q16, k16, v16)[0], dtype="float16", rtol=4e-3, atol=2.0
    )


def test_implementations_agree(rng):
    """Every registered implementation that accepts a call gives the reference's answer."""
    q, k, v, m = attention_inputs(rng, (2, 4, 9, 8), (2, 2, 11, 8), mask=("float", (9, 11)))
    kwargs = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True, window=(4, -1))
    exp_out, exp_lse, _ = ref.attention(q, k, v, m, **kwargs)
    for name in aa.implementations():
        try:
            out, lse = aa.scaled_dot_product_attention(
                q, k, v, m, return_lse=True, implementation=name, **kwargs
            )
        except ValueError as exc:  # the implementation declines this call
            assert name != "composed" and "cannot run" in str(exc)
            continue
        np.testing.assert_allclose(out, exp_out, rtol=1e-10, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(lse, exp_lse, rtol=1e-10, atol=1e-12, err_msg=name)


def test_result_dtypes(backend, dtype_name, rng):
    thin(backend, dtype_name == "float64")
    dtype = backend_dtype(backend, dtype_name)
    q, k, v, _ = attention_inputs(rng, (1, 1, 2, 4), (1, 1, 3, 4), dtype=dtype_name)
    out, lse = aa.scaled_dot_product_attention(
        *(backend.asarray(a) for a in (q, k, v)), return_lse=True
    )
    assert out.dtype == dtype
    assert name_of_dtype(lse.dtype) == lse_dtype_name(dtype_name)
    assert_same_device(backend, out)
    assert_same_device(backend, lse)


def test_no_keys_at_all(backend, rng):
    """S = 0: every row is empty, so output 0, LSE -inf and zero gradients."""
    thin(backend, False)
    q = rng.standard_normal((1, 4, 3, 4))
    k = np.zeros((1, 2, 0, 4))
    v = np.zeros((1, 2, 0, 5))
    d_out = rng.standard_normal((1, 4, 3, 5))
    d_lse = rng.standard_normal((1, 4, 3))
    (out, lse), grads = backend.vjp(
        aa.scaled_dot_product_attention,
        tuple(backend.asarray(a) for a in (q, k, v)),
        (backend.asarray(d_out), backend.asarray(d_lse)),
        enable_gqa=True,
        is_causal=True,
        return_lse=True,
    )
    xp_assert_close(backend, out, np.zeros((1, 4, 3, 5)), dtype="float64", rtol=0, atol=0)
    assert np.all(np.isneginf(backend.to_numpy(lse)))
    assert [tuple(g.shape) for g in grads] == [q.shape, k.shape, v.shape]
    assert np.all(backend.to_numpy(grads[0]) == 0)
    w = aa.attention_weights(backend.asarray(q), backend.asarray(k), enable_gqa=True)
    assert tuple(w.shape) == (1, 4, 3, 0)


def test_numpy_bool_is_causal(rng):
    q, k, v, _ = attention_inputs(rng, (1, 2, 3, 4), (1, 2, 5, 4))
    a = aa.scaled_dot_product_attention(q, k, v, is_causal=np.bool_(True))
    np.testing.assert_allclose(a, ref.attention(q, k, v, is_causal=True)[0], rtol=1e-12)
