"""Attention's hand-written backward (and attention_weights') against float64 finite
differences, and against NumPy's pullback on every other backend."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import attention_inputs, check_vjp_fd, check_vjp_matches_numpy, thin

import arrayattn as aa

# (id, q shape, k shape, v shape or None, mask (kind, shape) or None, kwargs)
FD_CASES = [
    ("plain", (1, 2, 3, 4), (1, 2, 5, 4), None, None, {}),
    ("scale_value_dim", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), None, {"scale": 0.7}),
    ("bool_mask", (1, 2, 3, 4), (1, 2, 5, 4), None, ("bool", (1, 2, 3, 5)), {}),
    ("float_mask_full", (1, 2, 3, 4), (1, 2, 5, 4), None, ("float", (1, 2, 3, 5)), {}),
    ("float_mask_bcast", (2, 2, 3, 4), (2, 2, 5, 4), None, ("float", (1, 1, 3, 5)), {}),
    ("float_mask_keys", (2, 2, 3, 4), (2, 2, 5, 4), None, ("float", (2, 1, 1, 5)), {}),
    ("causal_tl_L<S", (1, 2, 3, 4), (1, 2, 5, 4), None, None, {"is_causal": True}),
    ("causal_tl_L>S", (1, 2, 5, 4), (1, 2, 3, 4), None, None, {"is_causal": True}),
    (
        "causal_br_L<S",
        (1, 2, 3, 4),
        (1, 2, 5, 4),
        None,
        None,
        {"is_causal": True, "causal_align": "bottom_right"},
    ),
    (
        "causal_br_L>S",
        (1, 2, 5, 4),
        (1, 2, 3, 4),
        None,
        None,
        {"is_causal": True, "causal_align": "bottom_right"},
    ),
    ("window", (1, 2, 4, 4), (1, 2, 6, 4), None, None, {"window": (1, 1)}),
    (
        "window_br_causal",
        (1, 2, 3, 4),
        (1, 2, 6, 4),
        None,
        None,
        {"window": (2, 0), "causal_align": "bottom_right", "is_causal": True},
    ),
    ("window_-1", (1, 2, 4, 4), (1, 2, 4, 4), None, None, {"window": (-1, 1)}),
    ("softcap", (1, 2, 3, 4), (1, 2, 5, 4), None, None, {"softcap": 1.3, "scale": 2.0}),
    ("gqa", (1, 4, 3, 4), (1, 2, 5, 4), None, None, {"enable_gqa": True}),
    ("mqa", (1, 3, 3, 4), (1, 1, 5, 4), None, None, {"enable_gqa": True}),
    ("dropout", (1, 2, 3, 4), (1, 2, 5, 4), None, None, {"dropout_p": 0.3, "seed": 17}),
    (
        "all_together",
        (1, 2, 3, 4),
        (1, 1, 5, 4),
        None,
        ("float", (1, 1, 3, 5)),
        {
            "enable_gqa": True,
            "is_causal": True,
            "causal_align": "bottom_right",
            "softcap": 2.0,
            "dropout_p": 0.2,
            "seed": 5,
            "window": (3, -1),
        },
    ),
    ("lead_broadcast", (2, 1, 2, 3, 4), (1, 2, 2, 4, 4), None, None, {}),
    ("2d", (3, 4), (5, 4), None, ("bool", (3, 5)), {"is_causal": True}),
]


# "auto" is the NumPy fast path on NumPy arrays; "composed" is the array-API reference
# path that every other backend runs.
@pytest.mark.parametrize("implementation", ["auto", "composed"])
@pytest.mark.parametrize("lse", [False, True], ids=["out", "out_lse"])
@pytest.mark.parametrize(
    "name, q_shape, k_shape, v_shape, mask, kwargs", FD_CASES, ids=[c[0] for c in FD_CASES]
)
def test_attention_finite_differences(
    rng, name, q_shape, k_shape, v_shape, mask, kwargs, lse, implementation
):
    q, k, v, m = attention_inputs(rng, q_shape, k_shape, v_shape, mask)
    args = [q, k, v] if m is None else [q, k, v, m]
    _, grads = check_vjp_fd(
        aa.scaled_dot_product_attention,
        args,
        dict(kwargs, return_lse=lse, implementation=implementation),
        rtol=1e-6,
        atol=1e-8,
    )
    if m is not None and m.dtype == np.bool_:
        assert grads[3] is None
    if m is not None and m.dtype != np.bool_:
        assert grads[3].shape == m.shape


def test_lse_only_cotangent(rng):
    """(None, d_lse) and (d_out, None) cotangents: None means zero."""
    q, k, v, m = attention_inputs(rng, (1, 2, 3, 4), (1, 2, 5, 4), mask=("float", (3, 5)))
    kwargs = {"return_lse": True, "is_causal": True, "causal_align": "bottom_right"}
    (out, lse), _ = aa.vjp(aa.scaled_dot_product_attention, q, k, v, m, **kwargs)
    d_lse = rng.standard_normal(lse.shape)
    check_vjp_fd(aa.scaled_dot_product_attention, [q, k, v, m], kwargs, cotangent=(None, d_lse))
    d_out = rng.standard_normal(out.shape)
    check_vjp_fd(aa.scaled_dot_product_attention, [q, k, v, m], kwargs, cotangent=(d_out, None))


def test_lse_gradient_is_softmax():
    """d LSE / d scores = P: with d_lse = 1 and scale 1, dq = P @ k."""
    rng = np.random.default_rng(3)
    q, k, v, _ = attention_inputs(rng, (1, 1, 2, 3), (1, 1, 4, 3))
    (_, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, scale=1.0, return_lse=True
    )
    dq, dk, dv = pullback((None, np.ones_like(lse)))
    p = aa.attention_weights(q, k, scale=1.0)
    np.testing.assert_allclose(dq, p @ k, rtol=1e-12)
    np.testing.assert_allclose(dk, np.swapaxes(p, -1, -2) @ q, rtol=1e-12)
    np.testing.assert_array_equal(dv, 0.0)


WEIGHT_CASES = [
    ("plain", (1, 2, 3, 4), (1, 2, 5, 4), None, {}),
    ("bool_mask", (1, 2, 3, 4), (1, 2, 5, 4), ("bool", (3, 5)), {}),
    ("float_mask", (1, 2, 3, 4), (1, 2, 5, 4), ("float", (1, 1, 3, 5)), {}),
    (
        "causal_br",
        (1, 2, 4, 4),
        (1, 2, 3, 4),
        None,
        {"is_causal": True, "causal_align": "bottom_right"},
    ),
    ("window_softcap", (1, 2, 4, 4), (1, 2, 5, 4), None, {"window": (1, 0), "softcap": 1.5}),
    ("gqa", (1, 4, 3, 4), (1, 2, 5, 4), None, {"enable_gqa": True}),
    ("dropout", (1, 2, 3, 4), (1, 2, 5, 4), None, {"dropout_p": 0.4, "seed": 99}),
]


@pytest.mark.parametrize(
    "name, q_shape, k_shape, mask, kwargs", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES]
)
def test_attention_weights_finite_differences(rng, name, q_shape, k_shape, mask, kwargs):
    q, k, _, m = attention_inputs(rng, q_shape, k_shape, mask=mask)
    args = [q, k] if m is None else [q, k, m]
    check_vjp_fd(aa.attention_weights, args, kwargs)


@pytest.mark.parametrize(
    "case",
    ["mask_gqa_lse", "dropout_window_softcap", "weights", "lead_2d"],
)
def test_vjp_matches_numpy_on_backend(backend, rng, case):
    thin(backend, case == "mask_gqa_lse")
    if case == "mask_gqa_lse":
        q, k, v, m = attention_inputs(rng, (2, 4, 3, 4), (2, 2, 5, 4), mask=("float", (4, 3, 5)))
        check_vjp_matches_numpy(
            backend,
            aa.scaled_dot_product_attention,
            [q, k, v, m],
            {
                "enable_gqa": True,
                "is_causal": True,
                "causal_align": "bottom_right",
                "return_lse": True,
            },
        )
    elif case == "dropout_window_softcap":
        q, k, v, m = attention_inputs(rng, (2, 2, 4, 4), (2, 2, 5, 4), mask=("bool", (2, 1, 4, 5)))
        check_vjp_matches_numpy(
            backend,
            aa.scaled_dot_product_attention,
            [q, k, v, m],
            {"dropout_p": 0.25, "seed": 3, "window": (1, 2), "softcap": 3.0},
        )
    elif case == "weights":
        q, k, _, m = attention_inputs(rng, (1, 4, 3, 4), (1, 1, 5, 4), mask=("float", (3, 5)))
        check_vjp_matches_numpy(
            backend, aa.attention_weights, [q, k, m], {"enable_gqa": True, "is_causal": True}
        )
    else:
        q, k, v, _ = attention_inputs(rng, (2, 1, 2, 3, 4), (1, 3, 2, 5, 4))
        check_vjp_matches_numpy(backend, aa.scaled_dot_product_attention, [q, k, v])
        q, k, v, _ = attention_inputs(rng, (3, 4), (5, 4), (5, 2))
        check_vjp_matches_numpy(
            backend, aa.scaled_dot_product_attention, [q, k, v], {"is_causal": True}
        )


def test_vjp_float16_and_float32_grads_keep_dtype(backend, rng, dtype_name):
    thin(backend, dtype_name == "float16")
    from _helpers import backend_dtype, xp_assert_close

    dtype = backend_dtype(backend, dtype_name)
    q, k, v, m = attention_inputs(rng, (1, 4, 3, 4), (1, 2, 5, 4), mask=("float", (3, 5)))
    kwargs = {"enable_gqa": True, "is_causal": True, "causal_align": "bottom_right"}
    q, k, v, m = (a.astype(dtype_name) for a in (q, k, v, m))
    out64, pullback = aa.vjp(
        aa.scaled_dot_product_attention, *(a.astype(np.float64) for a in (q, k, v, m)), **kwargs
    )
    d_out = rng.standard_normal(out64.shape).astype(dtype_name)
    expected = pullback(d_out.astype(np.float64))
    out, grads = backend.vjp(
        aa.scaled_dot_product_attention,
        tuple(backend.asarray(a) for a in (q, k, v, m)),
        backend.asarray(d_out),
        **kwargs,
    )
    assert out.dtype == dtype
    for g, e in zip(grads, expected, strict=True):
        assert g.dtype == dtype
        scale = np.max(np.abs(e))
        xp_assert_close(
            backend,
            g,
            e,
            dtype=dtype_name,
            atol=(1e-2 if dtype_name == "float16" else 1e-5) * scale,
        )


def test_vjp_errors(rng):
    q, k, v, _ = attention_inputs(rng, (1, 2, 3, 4), (1, 2, 5, 4))
    with pytest.raises(TypeError, match="fn"):
        aa.vjp(np.tanh, q)
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v)
    with pytest.raises(ValueError, match="d_out"):
        pullback(np.ones((1, 2, 3, 5)))
    _, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="cotangent"):
        pullback(np.ones_like(out))
    with pytest.raises(ValueError, match="d_lse"):
        pullback((np.ones_like(out), np.ones((1, 2, 4))))


def test_every_public_op_is_differentiable():
    ops = set(aa.differentiable_ops())
    for fn in (
        aa.scaled_dot_product_attention,
        aa.attention_weights,
        aa.softmax,
        aa.split_heads,
        aa.merge_heads,
        aa.repeat_kv,
        aa.apply_rope,
        aa.sinusoidal_embedding,
        aa.rms_norm,
        aa.layer_norm,
    ):
        assert fn in ops, fn.__name__


# NumPy inputs: the paths for other libraries' arrays (CuPy's fused, Dask's) are left out.
@pytest.mark.parametrize(
    "implementation", [n for n in aa.implementations() if n not in ("fused", "dask")]
)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_backward_with_finfo_min_bias_rows(rng, dtype, implementation):
    """Hugging Face masks with finfo(dtype).min: a fully masked row's LSE absorbs log(S)
    (m + log S == m), yet the backward's probabilities must still sum to 1, as the
    forward's do (torch autograd agrees: see test_torch_conformance)."""
    q, k, v, _ = attention_inputs(rng, (1, 1, 2, 4), (1, 1, 5, 4), dtype=dtype)
    bias = np.zeros((2, 5), dtype=dtype)
    bias[0] = np.finfo(dtype).min
    out, pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, bias, implementation=implementation
    )
    np.testing.assert_allclose(out[0, 0, 0], v[0, 0].mean(axis=0), rtol=1e-5)  # uniform
    _, _, dv, _ = pullback(np.ones_like(out))
    # d_value = P^T @ 1: its column sums are the row sums of P, 1 per query row
    np.testing.assert_allclose(dv[0, 0].sum(axis=0), 2.0, rtol=1e-5)
