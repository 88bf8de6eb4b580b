"""linear, embedding, erf, gelu, silu: forward against plain NumPy float64, backward against
finite differences, on every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

import arrayattn as aa
from arrayattn import nn


def fd_grad(f, x, dy, eps=1e-6):
    """Central differences of <f(x), dy> w.r.t. every element of x (float64)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp_, xm = x.copy(), x.copy()
        xp_[idx] += eps
        xm[idx] -= eps
        g[idx] = (np.sum(f(xp_) * dy) - np.sum(f(xm) * dy)) / (2 * eps)
    return g


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_forward_and_backward_match_numpy(backend, with_bias):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal((4, 5))
    b = rng.standard_normal(4) if with_bias else None
    dy = rng.standard_normal((2, 3, 4))
    ref = x @ w.T + (0 if b is None else b)
    args = [backend.asarray(a) for a in (x, w)] + ([backend.asarray(b)] if with_bias else [])
    y, pullback = aa.vjp(nn.linear, *args)
    np.testing.assert_allclose(backend.to_numpy(y), ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(nn.linear(*args)), ref, rtol=1e-12)
    grads = pullback(backend.asarray(dy))
    np.testing.assert_allclose(backend.to_numpy(grads[0]), dy @ w, rtol=1e-12)
    np.testing.assert_allclose(
        backend.to_numpy(grads[1]), np.einsum("blo,bli->oi", dy, x), rtol=1e-12
    )
    if with_bias:
        np.testing.assert_allclose(backend.to_numpy(grads[2]), dy.sum(axis=(0, 1)), rtol=1e-12)


def test_linear_gradients_against_finite_differences():
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((3, 4)), rng.standard_normal((2, 4)), rng.standard_normal(2)
    dy = rng.standard_normal((3, 2))
    _, pullback = aa.vjp(nn.linear, x, w, b)
    dx, dw, db = pullback(dy)
    np.testing.assert_allclose(dx, fd_grad(lambda t: nn.linear(t, w, b), x, dy), rtol=1e-7)
    np.testing.assert_allclose(dw, fd_grad(lambda t: nn.linear(x, t, b), w, dy), rtol=1e-7)
    np.testing.assert_allclose(db, fd_grad(lambda t: nn.linear(x, w, t), b, dy), rtol=1e-7)


def test_linear_float32_keeps_dtype_and_errors_name_arguments():
    x = np.ones((2, 3), np.float32)
    assert nn.linear(x, np.ones((4, 3), np.float32)).dtype == np.float32
    with pytest.raises(ValueError, match="in_features"):
        nn.linear(x, np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="bias"):
        nn.linear(x, np.ones((4, 3), np.float32), np.ones(3, np.float32))
    with pytest.raises(TypeError, match="dtype"):
        nn.linear(x, np.ones((4, 3), np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_few_rows_blocks_equal_one_product(dtype, monkeypatch):
    """2 to 8 rows on NumPy run over blocks of the weight's rows (a decoding step):
    the same values as one product, for block steps that do and do not divide the rows,
    leading dims, a bias, and a non-contiguous weight (one product then)."""
    import importlib

    linear_module = importlib.import_module("arrayattn.nn.linear")

    rng = np.random.default_rng(5)
    blocked = []
    real = linear_module._few_rows
    monkeypatch.setattr(linear_module, "_few_rows", lambda *a: blocked.append(1) or real(*a))
    for rows, out_f, in_f in ((2, 3000, 64), (4, 5, 7), (8, 1000, 300), (3, 70000, 2)):
        x = rng.standard_normal((rows, 1, in_f)).astype(dtype)
        w = rng.standard_normal((out_f, in_f)).astype(dtype)
        b = rng.standard_normal(out_f).astype(dtype)
        want = (x.astype(np.float64) @ w.T.astype(np.float64)) + b
        got = nn.linear(x, w, b)
        assert got.shape == (rows, 1, out_f) and got.dtype == dtype
        assert got.flags.c_contiguous
        tol = 1e-12 if dtype == np.float64 else 2e-5 * math.sqrt(in_f)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert len(blocked) == 4
    w_t = np.asarray(rng.standard_normal((9, 400)).astype(dtype).T.copy().T)  # F-ordered
    x = rng.standard_normal((4, 400)).astype(dtype)
    np.testing.assert_allclose(nn.linear(x, w_t), x @ w_t.T, rtol=1e-5)
    assert len(blocked) == 4  # not blocked: one product


def test_embedding_lookup_and_gradient(backend):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((7, 3))
    ids = np.array([[1, 6, 1], [0, 3, 1]])
    dy = rng.standard_normal((2, 3, 3))
    out, pullback = aa.vjp(nn.embedding, backend.asarray(ids), backend.asarray(w))
    np.testing.assert_array_equal(backend.to_numpy(out), w[ids])
    dids, dw = pullback(backend.asarray(dy))
    expected = np.zeros_like(w)
    np.add.at(expected, ids.reshape(-1), dy.reshape(-1, 3))
    assert dids is None
    np.testing.assert_allclose(backend.to_numpy(dw), expected, rtol=1e-12, atol=1e-14)


def test_erf_matches_math_erf():
    x = np.linspace(-7, 7, 2001)
    ref = np.array([math.erf(t) for t in x])
    np.testing.assert_allclose(nn.erf(x), ref, rtol=0, atol=2e-13)
    np.testing.assert_allclose(nn.erf(x.astype(np.float32)), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forward_and_backward(backend, approximate):
    x = np.linspace(-5, 5, 41)
    if approximate == "none":
        ref = np.array([0.5 * t * (1 + math.erf(t / math.sqrt(2))) for t in x])
    else:
        ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    y, pullback = aa.vjp(nn.gelu, backend.asarray(x), approximate=approximate)
    np.testing.assert_allclose(backend.to_numpy(y), ref, rtol=1e-12, atol=1e-12)
    dy = np.random.default_rng(3).standard_normal(x.shape)
    (dx,) = pullback(backend.asarray(dy))[:1]
    num = fd_grad(lambda t: nn.gelu(t, approximate), x, dy)
    # erf's 1e-13 approximation error over the 2e-6 step makes the differences noisy.
    np.testing.assert_allclose(backend.to_numpy(dx), num, rtol=1e-7, atol=1e-7)


def test_silu_forward_and_backward(backend):
    x = np.linspace(-30, 30, 61)
    ref = x / (1 + np.exp(-x))
    y, pullback = aa.vjp(nn.silu, backend.asarray(x))
    np.testing.assert_allclose(backend.to_numpy(y), ref, rtol=1e-12, atol=1e-14)
    dy = np.random.default_rng(4).standard_normal(x.shape)
    (dx,) = pullback(backend.asarray(dy))
    np.testing.assert_allclose(backend.to_numpy(dx), fd_grad(nn.silu, x, dy), rtol=1e-7, atol=1e-8)
    assert np.all(np.isfinite(nn.silu(np.array([-1e4, 1e4], np.float32))))
