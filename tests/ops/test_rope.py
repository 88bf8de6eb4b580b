"""RoPE: frequencies and both pairings against real cos/sin rotations, with backward."""

from __future__ import annotations

import _reference as ref
import numpy as np
import pytest
from _helpers import (
    backend_dtype,
    check_vjp_fd,
    check_vjp_matches_numpy,
    name_of_dtype,
    thin,
    xp_assert_close,
)

import arrayattn as aa

LAYOUTS = ("interleaved", "half")


def _freqs(backend, head_dim, positions, dtype_name, theta=10000.0):
    real = "float64" if dtype_name == "float64" else "float32"
    pos = backend.asarray(np.asarray(positions, dtype=np.int32))
    return aa.rope_frequencies(head_dim, pos, theta=theta, dtype=getattr(backend.xp, real))


def test_frequencies_match_reference(backend):
    thin(backend, True)
    xp = backend.xp
    f = aa.rope_frequencies(8, 6, xp=xp, device=backend.device)
    assert tuple(f.shape) == (6, 4)
    assert name_of_dtype(f.dtype) == "complex64"
    expected = np.exp(1j * ref.rope_angles(8, np.arange(6)))
    got = backend.to_numpy(f)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # offsets (KV cache): positions that start later, float64 angles, another base
    pos = backend.asarray(np.arange(5, 12, dtype=np.int64))
    f64 = aa.rope_frequencies(6, pos, theta=500.0, dtype=xp.float64)
    assert name_of_dtype(f64.dtype) == "complex128"
    np.testing.assert_allclose(
        backend.to_numpy(f64), np.exp(1j * ref.rope_angles(6, np.arange(5, 12), 500.0)), rtol=1e-12
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "x_shape, rotary_dim", [((2, 3, 5, 8), 8), ((3, 5, 6), 6), ((1, 2, 5, 10), 6), ((5, 4), 4)]
)
def test_apply_matches_reference(backend, dtype_name, rng, layout, x_shape, rotary_dim):
    thin(
        backend,
        (dtype_name, x_shape, layout)
        in {("float32", (1, 2, 5, 10), "half"), ("float64", (2, 3, 5, 8), "interleaved")},
    )
    dtype = backend_dtype(backend, dtype_name)
    L = x_shape[-2]
    x = rng.standard_normal(x_shape).astype(dtype_name)
    positions = np.arange(3, 3 + L)  # an offset, as after a KV cache
    f = _freqs(backend, rotary_dim, positions, dtype_name)
    y = backend.call(aa.apply_rope, backend.asarray(x), f, layout=layout)
    assert y.dtype == dtype
    expected = ref.apply_rope(x, ref.rope_angles(rotary_dim, positions), layout)
    xp_assert_close(
        backend, y, expected, dtype=dtype_name, atol=1e-5 if dtype_name == "float32" else None
    )
    # untouched features pass through exactly (partial rotary, GPT-NeoX)
    got = backend.to_numpy(y)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_layouts_differ_by_a_feature_permutation(rng):
    """half == interleaved applied to features reordered (0, F, 1, F+1, ...)."""
    x = rng.standard_normal((2, 5, 8))
    f = aa.rope_frequencies(8, 5, xp=np, dtype=np.float64)
    perm = np.ravel(np.stack([np.arange(4), np.arange(4) + 4], axis=-1))
    inter = aa.apply_rope(x[..., perm], f, layout="interleaved")
    half = aa.apply_rope(x, f, layout="half")
    np.testing.assert_allclose(half[..., perm], inter, rtol=1e-12, atol=1e-12)


def test_per_batch_frequencies(rng):
    """freqs with batch dims (different offsets per sequence) broadcast against x."""
    x = rng.standard_normal((2, 3, 4, 6))  # (B, H, L, D)
    pos = np.array([[0, 1, 2, 3], [7, 8, 9, 10]])
    f = aa.rope_frequencies(6, pos, dtype=np.float64)[:, None]  # (B, 1, L, 3)
    y = aa.apply_rope(x, f, layout="half")
    expected = ref.apply_rope(x, ref.rope_angles(6, pos)[:, None], "half")
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("x_shape, rotary_dim", [((1, 2, 3, 4), 4), ((2, 3, 6), 4)])
def test_backward_finite_differences(rng, layout, x_shape, rotary_dim):
    x = rng.standard_normal(x_shape)
    f = aa.rope_frequencies(rotary_dim, np.arange(2, 2 + x_shape[-2]), dtype=np.float64)
    _, grads = check_vjp_fd(aa.apply_rope, [x, f], {"layout": layout}, wrt=[0])
    assert grads[1] is None  # complex frequencies are not differentiated


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vjp_matches_numpy_on_backend(backend, rng, layout):
    thin(backend, layout == "half")
    x = rng.standard_normal((2, 2, 5, 6))
    f = np.exp(1j * ref.rope_angles(4, np.arange(5)))
    check_vjp_matches_numpy(backend, aa.apply_rope, [x, f], {"layout": layout})


def test_float16_input_rotates_in_float32(backend, rng):
    thin(backend, False)
    backend_dtype(backend, "float16")
    x = (100 * rng.standard_normal((2, 5, 8))).astype(np.float16)
    f = _freqs(backend, 8, np.arange(5), "float16")
    y = aa.apply_rope(backend.asarray(x), f)
    got = backend.to_numpy(y)
    assert got.dtype == np.float16 and np.all(np.isfinite(got))
    np.testing.assert_allclose(
        got.astype(np.float64),
        ref.apply_rope(x, ref.rope_angles(8, np.arange(5))),
        rtol=4e-3,
        atol=0.1,
    )


def test_errors():
    x = np.zeros((2, 4, 8))
    f = aa.rope_frequencies(8, 4, xp=np)
    with pytest.raises(ValueError, match="layout"):
        aa.apply_rope(x, f, layout="neox")
    with pytest.raises(TypeError, match="freqs"):
        aa.apply_rope(x, np.ones((4, 4)))
    with pytest.raises(ValueError, match="freqs"):
        aa.apply_rope(np.zeros((2, 4, 6)), f)  # 2F = 8 > D = 6
    with pytest.raises(ValueError, match="freqs"):
        aa.apply_rope(np.zeros((2, 5, 8)), f)  # L = 5 vs 4 positions
    with pytest.raises(TypeError, match="x"):
        aa.apply_rope(np.zeros((2, 4, 8), dtype=np.int32), f)
    with pytest.raises(ValueError, match="head_dim"):
        aa.rope_frequencies(7, 4, xp=np)
    with pytest.raises(ValueError, match="theta"):
        aa.rope_frequencies(8, 4, xp=np, theta=-1.0)
