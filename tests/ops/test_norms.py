"""rms_norm and layer_norm against the float64 reference, with finite-difference backwards."""

from __future__ import annotations

import _reference as ref
import numpy as np
import pytest
from _helpers import (
    backend_dtype,
    check_vjp_fd,
    check_vjp_matches_numpy,
    thin,
    xp_assert_close,
)

import arrayattn as aa


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_rms_norm_matches_reference(backend, dtype_name, rng, with_weight, cast_before_weight):
    thin(backend, (dtype_name, with_weight, cast_before_weight) == ("float16", True, True))
    dtype = backend_dtype(backend, dtype_name)
    x = (3 * rng.standard_normal((2, 3, 8))).astype(dtype_name)
    w = (1 + 0.5 * rng.standard_normal(8)).astype(dtype_name) if with_weight else None
    y = backend.call(
        aa.rms_norm,
        backend.asarray(x),
        None if w is None else backend.asarray(w),
        1e-5,
        cast_before_weight=cast_before_weight,
    )
    assert y.dtype == dtype
    # float16 with the weight applied after the cast rounds twice
    rtol = 8e-3 if dtype_name == "float16" else None
    xp_assert_close(backend, y, ref.rms_norm(x, w, 1e-5), dtype=dtype_name, rtol=rtol)


def test_rms_norm_cast_order_is_observable():
    """LLaMA order (default) rounds the normalised value to float16 before the weight."""
    x = np.array([[1.0, 2.0, 3.0, 4.1]], dtype=np.float16)
    w = np.array([1.001, 3.0, 0.7, 1.3], dtype=np.float16)
    normed16 = ref.rms_norm(x, None).astype(np.float16)
    np.testing.assert_array_equal(aa.rms_norm(x, w), normed16 * w)
    after = (ref.rms_norm(x, None) * w.astype(np.float64)).astype(np.float16)
    np.testing.assert_allclose(
        aa.rms_norm(x, w, cast_before_weight=False).astype(np.float64), after, rtol=1e-3
    )


def test_rms_norm_weight_dtype_promotes():
    x = np.ones((2, 4), dtype=np.float16)
    w = np.full(4, 2.0, dtype=np.float32)
    assert aa.rms_norm(x, w).dtype == np.float32
    assert aa.rms_norm(x, w, cast_before_weight=False).dtype == np.float32


@pytest.mark.parametrize(
    "weight, bias", [(True, True), (True, False), (False, True), (False, False)]
)
def test_layer_norm_matches_reference(backend, dtype_name, rng, weight, bias):
    thin(backend, (dtype_name, weight, bias) == ("float32", True, True))
    dtype = backend_dtype(backend, dtype_name)
    x = (2 + 3 * rng.standard_normal((2, 3, 8))).astype(dtype_name)
    w = (1 + 0.5 * rng.standard_normal(8)).astype(dtype_name) if weight else None
    b = rng.standard_normal(8).astype(dtype_name) if bias else None
    y = backend.call(
        aa.layer_norm,
        backend.asarray(x),
        None if w is None else backend.asarray(w),
        None if b is None else backend.asarray(b),
        1e-5,
    )
    assert y.dtype == dtype
    xp_assert_close(backend, y, ref.layer_norm(x, w, b, 1e-5), dtype=dtype_name)


def test_layer_norm_biased_variance():
    x = np.array([[1.0, 3.0]])
    np.testing.assert_allclose(aa.layer_norm(x, None, None, eps=0.0), [[-1.0, 1.0]])


def test_norms_of_large_float16_values_stay_finite(backend):
    thin(backend, False)
    backend_dtype(backend, "float16")
    x = np.array([[6e4, -6e4, 3e4, 1.0]], dtype=np.float16)  # x*x overflows float16
    for y in (aa.rms_norm(backend.asarray(x), None), aa.layer_norm(backend.asarray(x), None, None)):
        assert np.all(np.isfinite(backend.to_numpy(y)))
    xp_assert_close(
        backend, aa.rms_norm(backend.asarray(x), None), ref.rms_norm(x, None), dtype="float16"
    )


@pytest.mark.parametrize("cast_before_weight", [True, False])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_rms_norm_backward_finite_differences(rng, cast_before_weight, with_weight):
    x = rng.standard_normal((2, 3, 4))
    w = rng.standard_normal(4) if with_weight else None
    _, grads = check_vjp_fd(aa.rms_norm, [x, w, 1e-3], {"cast_before_weight": cast_before_weight})
    assert (grads[1] is None) == (w is None)
    assert grads[2] is None  # eps


@pytest.mark.parametrize(
    "weight, bias", [(True, True), (True, False), (False, True), (False, False)]
)
def test_layer_norm_backward_finite_differences(rng, weight, bias):
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal(5) if weight else None
    b = rng.standard_normal(5) if bias else None
    _, grads = check_vjp_fd(aa.layer_norm, [x, w, b, 1e-3])
    assert (grads[1] is None) == (w is None) and (grads[2] is None) == (b is None)


def test_norm_over_two_trailing_axes(rng):
    """A 2-D weight normalises over the last two axes."""
    x = rng.standard_normal((2, 3, 4))
    w = rng.standard_normal((3, 4))
    b = rng.standard_normal((3, 4))
    flat = ref.layer_norm(x.reshape(2, 12), w.reshape(12), b.reshape(12)).reshape(2, 3, 4)
    np.testing.assert_allclose(aa.layer_norm(x, w, b), flat, rtol=1e-12, atol=1e-12)
    check_vjp_fd(aa.layer_norm, [x[:1], w, b, 1e-3])
    check_vjp_fd(aa.rms_norm, [x[:1], w, 1e-3])


@pytest.mark.parametrize("op", ["rms", "rms_after", "layer"])
def test_vjp_matches_numpy_on_backend(backend, rng, op):
    thin(backend, op == "layer")
    x = rng.standard_normal((2, 3, 6))
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    if op == "layer":
        check_vjp_matches_numpy(backend, aa.layer_norm, [x, w, b, 1e-5])
    else:
        check_vjp_matches_numpy(
            backend, aa.rms_norm, [x, w, 1e-6], {"cast_before_weight": op == "rms"}
        )


def test_errors():
    x = np.zeros((2, 4))
    with pytest.raises(ValueError, match="weight"):
        aa.rms_norm(x, np.ones(3))
    with pytest.raises(ValueError, match="bias"):
        aa.layer_norm(x, np.ones(4), np.ones(5))
    with pytest.raises(ValueError, match="eps"):
        aa.rms_norm(x, None, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        aa.layer_norm(x, None, None, eps=float("nan"))
    with pytest.raises(TypeError, match="x"):
        aa.rms_norm(np.zeros((2, 4), dtype=np.int64), None)
    with pytest.raises(TypeError, match="weight"):
        aa.layer_norm(x, np.ones(4, dtype=np.int32), None)
