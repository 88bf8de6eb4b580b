"""softmax: forward against the reference on every backend and dtype, empty slices, and
its backward by finite differences."""

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


@pytest.mark.parametrize("shape, axis", [((3, 7), -1), ((2, 3, 5), 1), ((4,), 0), ((2, 5, 3), -3)])
def test_forward_matches_reference(backend, dtype_name, rng, shape, axis):
    thin(backend, (dtype_name, axis) == ("float32", 1))
    dtype = backend_dtype(backend, dtype_name)
    x = (3 * rng.standard_normal(shape)).astype(dtype_name)
    y = backend.call(aa.softmax, backend.asarray(x), axis=axis)
    assert y.dtype == dtype
    xp_assert_close(backend, y, ref.softmax(x, axis=axis), dtype=dtype_name)


def test_all_neg_inf_slice_gives_zeros(backend, dtype_name):
    thin(backend, dtype_name == "float32")
    backend_dtype(backend, dtype_name)
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]], dtype=dtype_name)
    y = backend.to_numpy(backend.call(aa.softmax, backend.asarray(x)))
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[1], 0.0)
    np.testing.assert_allclose(y[0].astype(np.float64), ref.softmax(x)[0], rtol=4e-3)


def test_large_values_stay_finite(backend, dtype_name):
    thin(backend, dtype_name == "float16")
    backend_dtype(backend, dtype_name)
    big = 6e4 if dtype_name == "float16" else 1e4
    x = np.array([[big, big - 1.0, -big], [0.0, 1.0, 2.0]], dtype=dtype_name)
    y = backend.call(aa.softmax, backend.asarray(x))
    xp_assert_close(backend, y, ref.softmax(x), dtype=dtype_name)


@pytest.mark.parametrize("shape, axis", [((2, 5), -1), ((3, 4, 2), 1), ((3, 4, 2), 0)])
def test_backward_finite_differences(rng, shape, axis):
    x = rng.standard_normal(shape)
    check_vjp_fd(aa.softmax, [x], {"axis": axis})


def test_backward_with_neg_inf_entries(rng):
    x = rng.standard_normal((3, 4))
    x[0, 1] = -np.inf
    x[2, :] = -np.inf
    out, pullback = aa.vjp(aa.softmax, x)
    (dx,) = pullback(rng.standard_normal(x.shape))
    assert np.all(np.isfinite(dx))
    np.testing.assert_array_equal(dx[2], 0.0)
    assert dx[0, 1] == 0.0
    # finite part against finite differences on the finite entries of row 0
    check_vjp_fd(aa.softmax, [x[:2, [0, 2, 3]]])


def test_vjp_matches_numpy_on_backend(backend, rng):
    thin(backend, True)
    x = rng.standard_normal((2, 3, 5))
    check_vjp_matches_numpy(backend, aa.softmax, [x], {"axis": -2})


def test_empty_axis():
    y = aa.softmax(np.zeros((3, 0)))
    assert y.shape == (3, 0)
    out, pullback = aa.vjp(aa.softmax, np.zeros((0, 4)), axis=0)
    assert out.shape == (0, 4) and pullback(np.zeros((0, 4)))[0].shape == (0, 4)
