"""split_heads / merge_heads / repeat_kv against NumPy reshapes, with their backwards."""

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


@pytest.mark.parametrize(
    "shape, heads", [((5, 12), 3), ((2, 5, 12), 4), ((2, 3, 4, 6), 1), ((1, 7, 10), 10)]
)
def test_split_merge_match_reference(backend, dtype_name, rng, shape, heads):
    thin(backend, (dtype_name, heads) == ("float32", 4))
    dtype = backend_dtype(backend, dtype_name)
    x = rng.standard_normal(shape).astype(dtype_name)
    y = backend.call(aa.split_heads, backend.asarray(x), heads)
    assert y.dtype == dtype
    xp_assert_close(backend, y, ref.split_heads(x, heads), dtype=dtype_name, rtol=0, atol=0)
    z = backend.call(aa.merge_heads, y)
    xp_assert_close(backend, z, x, dtype=dtype_name, rtol=0, atol=0)


def test_split_heads_layout_is_head_major():
    """Feature f of token l goes to head f // D, position f % D (HF ``view(..., H, D)``)."""
    x = np.arange(2 * 6, dtype=np.float64).reshape(2, 6)  # L=2, H*D=6
    y = aa.split_heads(x, 3)
    assert y.shape == (3, 2, 2)
    np.testing.assert_array_equal(y[1, 0], [2.0, 3.0])
    np.testing.assert_array_equal(y[2, 1], [10.0, 11.0])


@pytest.mark.parametrize(
    "shape, n_rep", [((2, 2, 5, 3), 3), ((3, 4, 2), 2), ((1, 1, 4, 2), 4), ((2, 3, 4, 2), 1)]
)
def test_repeat_kv_matches_reference(backend, dtype_name, rng, shape, n_rep):
    thin(backend, (dtype_name, n_rep) == ("float64", 3))
    dtype = backend_dtype(backend, dtype_name)
    x = rng.standard_normal(shape).astype(dtype_name)
    y = backend.call(aa.repeat_kv, backend.asarray(x), n_rep)
    assert y.dtype == dtype
    xp_assert_close(backend, y, ref.repeat_kv(x, n_rep), dtype=dtype_name, rtol=0, atol=0)


def test_backward_finite_differences(rng):
    x = rng.standard_normal((2, 3, 6))
    check_vjp_fd(aa.split_heads, [x, 3])
    check_vjp_fd(aa.merge_heads, [rng.standard_normal((2, 3, 2, 2))])
    check_vjp_fd(aa.repeat_kv, [rng.standard_normal((1, 2, 3, 2)), 3])
    check_vjp_fd(aa.repeat_kv, [rng.standard_normal((2, 3, 2)), 1])


def test_non_array_arguments_get_none(rng):
    _, pullback = aa.vjp(aa.split_heads, rng.standard_normal((2, 6)), 2)
    dx, dh = pullback(rng.standard_normal((2, 2, 3)))
    assert dh is None and dx.shape == (2, 6)
    _, pullback = aa.vjp(aa.repeat_kv, rng.standard_normal((2, 3, 2)), 2)
    dx, dn = pullback(rng.standard_normal((4, 3, 2)))
    assert dn is None and dx.shape == (2, 3, 2)


@pytest.mark.parametrize("op", ["split", "merge", "repeat"])
def test_vjp_matches_numpy_on_backend(backend, rng, op):
    thin(backend, op == "repeat")
    if op == "split":
        check_vjp_matches_numpy(backend, aa.split_heads, [rng.standard_normal((2, 4, 6)), 3])
    elif op == "merge":
        check_vjp_matches_numpy(backend, aa.merge_heads, [rng.standard_normal((2, 3, 4, 2))])
    else:
        check_vjp_matches_numpy(backend, aa.repeat_kv, [rng.standard_normal((2, 2, 4, 3)), 2])


@pytest.mark.parametrize("bad", [0, -2, 5, 2.0, True, None])
def test_bad_num_heads(bad):
    x = np.zeros((3, 12))
    with pytest.raises((ValueError, TypeError), match="num_heads"):
        aa.split_heads(x, bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_n_rep(bad):
    with pytest.raises((ValueError, TypeError), match="n_rep"):
        aa.repeat_kv(np.zeros((1, 2, 3, 4)), bad)


def test_too_few_dims():
    with pytest.raises(ValueError, match="x"):
        aa.split_heads(np.zeros(12), 3)
    with pytest.raises(ValueError, match="x"):
        aa.merge_heads(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="x"):
        aa.repeat_kv(np.zeros((3, 4)), 2)
