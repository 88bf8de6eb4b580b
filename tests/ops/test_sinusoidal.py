"""sinusoidal_embedding against Wan2.1's sinusoidal_embedding_1d (reproduced below in
torch), on every backend, with its backward by finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import backend_dtype, check_vjp_fd, thin, xp_assert_close

import arrayattn as aa


def _wan_sinusoidal_embedding_1d(torch, dim: int, position):
    # Wan2.1 (wan/modules/model.py): float64, cos half first, theta 10000
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


@pytest.mark.parametrize("dim", [2, 8, 256])
def test_equals_wan(dim):
    torch = pytest.importorskip("torch")
    t = np.array([0, 1, 37, 500, 999], dtype=np.int64)
    expected = _wan_sinusoidal_embedding_1d(torch, dim, torch.from_numpy(t)).numpy()
    got = aa.sinusoidal_embedding(dim, t, dtype=np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)
    # Wan then casts with .float(): the float32 result is the rounded float64 one
    np.testing.assert_array_equal(aa.sinusoidal_embedding(dim, t), expected.astype(np.float32))


def test_int_positions_and_shapes():
    e = aa.sinusoidal_embedding(6, 4, xp=np, dtype=np.float64)
    np.testing.assert_allclose(e, aa.sinusoidal_embedding(6, np.arange(4), dtype=np.float64))
    t = np.array([[1.5, 2.0], [3.0, 900.25]])
    assert aa.sinusoidal_embedding(6, t).shape == (2, 2, 6)


def test_on_backend(backend, dtype_name):
    thin(backend, dtype_name == "float32")
    dtype = backend_dtype(backend, dtype_name)
    t = np.array([0, 3, 250, 999], dtype=np.int64)
    expected = aa.sinusoidal_embedding(16, t, dtype=np.float64)
    got = backend.call(aa.sinusoidal_embedding, 16, backend.asarray(t), dtype=dtype)
    xp_assert_close(backend, got, expected, dtype=dtype_name)
    made = aa.sinusoidal_embedding(16, 5, xp=backend.xp, device=backend.device, dtype=dtype)
    xp_assert_close(
        backend, made, aa.sinusoidal_embedding(16, 5, dtype=np.float64), dtype=dtype_name
    )


def test_backward_finite_differences(rng):
    t = rng.uniform(0, 20, size=(2, 3))
    check_vjp_fd(aa.sinusoidal_embedding, [8, t], {"dtype": np.float64}, wrt=[1])
    _, pullback = aa.vjp(aa.sinusoidal_embedding, 8, np.arange(3))
    assert pullback(np.ones((3, 8), dtype=np.float32)) == (None, None)  # integer positions


def test_vjp_on_backend(backend, rng):
    thin(backend, True)
    t = rng.uniform(0, 50, size=(5,))
    cot = rng.standard_normal((5, 6))
    out, pullback = aa.vjp(aa.sinusoidal_embedding, 6, t, dtype=np.float64)
    expected = pullback(cot)[1]
    got, grads = backend.vjp(
        aa.sinusoidal_embedding,
        (6, backend.asarray(t)),
        backend.asarray(cot),
        dtype=backend.xp.float64,
    )
    xp_assert_close(backend, got, out, dtype="float64")
    assert grads[0] is None
    xp_assert_close(backend, grads[1], expected, dtype="float64")


def test_errors():
    with pytest.raises(ValueError, match="dim"):
        aa.sinusoidal_embedding(7, np.arange(3))
    with pytest.raises(ValueError, match="theta"):
        aa.sinusoidal_embedding(8, np.arange(3), theta=0)
    with pytest.raises(TypeError, match="positions"):
        aa.sinusoidal_embedding(8, np.ones(3, dtype=bool))
    with pytest.raises(TypeError, match="dtype"):
        aa.sinusoidal_embedding(8, np.arange(3), dtype=np.int32)
