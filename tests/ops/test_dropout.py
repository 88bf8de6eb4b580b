"""The seed-defined dropout hash: matches its documented algorithm, keeps ``1 - p`` of the
entries, looks uniform, and gives the same mask on every backend."""

from __future__ import annotations

import _reference as ref
import array_api_compat
import numpy as np
import pytest
from _helpers import attention_inputs, thin

import arrayattn as aa
from arrayattn.attention.dropout import (
    dropout_bits,
    dropout_keep,
    dropout_threshold,
    normalize_seed,
)


def _index_arrays(xp, device, B, H, L, S):
    def idx(n, shape):
        return xp.reshape(xp.arange(n, dtype=xp.int32, device=device), shape)

    return idx(B, (B, 1, 1, 1)), idx(H, (1, H, 1, 1)), idx(L, (1, 1, L, 1)), idx(S, (1, 1, 1, S))


def test_hash_matches_documented_algorithm(backend):
    """Scalar Python from the docstring's algorithm, at small and very large indices."""
    thin(backend, False)
    xp = backend.xp
    rng = np.random.default_rng(1)
    n = 64
    cols = np.concatenate([np.arange(8), rng.integers(0, 2**31 - 1, n - 9), [2**31 - 1]]).astype(
        np.int32
    )
    rows = rng.integers(0, 2**31 - 1, n).astype(np.int32)
    for seed in (0, 1, 2**31 + 12345, 2**32 - 1):
        got = dropout_bits(
            xp,
            seed,
            backend.asarray(np.int32(3)),
            backend.asarray(np.int32(70000)),
            backend.asarray(rows),
            backend.asarray(cols),
        )
        got = backend.to_numpy(got)
        expected = [
            ref.dropout_bits(seed, 3, 70000, int(r), int(c))
            for r, c in zip(rows, cols, strict=True)
        ]
        np.testing.assert_array_equal(got.astype(np.int64), np.array(expected, dtype=np.int64))
        assert got.min() >= 0 and got.max() < 2**24


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_matches_p(p):
    xp = array_api_compat.array_namespace(np.zeros(1))
    b, h, i, j = _index_arrays(xp, "cpu", 2, 4, 64, 64)
    keep = np.asarray(dropout_keep(xp, 42, p, b, h, i, j))
    n = keep.size
    rate = keep.mean()
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma, (rate, 1 - p)
    # every head and every row keeps about 1 - p (no structure along any axis)
    per_row = keep.mean(axis=-1)
    assert abs(per_row.mean() - (1 - p)) < 5 * sigma
    assert per_row.std() < 4 * np.sqrt(p * (1 - p) / 64)


def test_bits_uniform_and_decorrelated():
    xp = array_api_compat.array_namespace(np.zeros(1))
    b, h, i, j = _index_arrays(xp, "cpu", 1, 2, 128, 128)
    u = np.asarray(dropout_bits(xp, 7, b, h, i, j)).astype(np.float64) / 2**24
    n = u.size
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    hist, _ = np.histogram(u, bins=16, range=(0, 1))
    expected = n / 16
    chi2 = np.sum((hist - expected) ** 2 / expected)
    assert chi2 < 50, chi2  # 15 dof: p(chi2 > 50) ~ 1e-5
    for axis in (-1, -2, -3):  # neighbouring cols, rows, heads
        a = np.moveaxis(u, axis, -1)
        c = np.corrcoef(a[..., :-1].ravel(), a[..., 1:].ravel())[0, 1]
        assert abs(c) < 0.03, (axis, c)
    other = np.asarray(dropout_bits(xp, 8, b, h, i, j)).astype(np.float64) / 2**24
    assert abs(np.corrcoef(u.ravel(), other.ravel())[0, 1]) < 0.03  # seeds decorrelate


def test_threshold_extremes():
    assert dropout_threshold(0.0) == 0
    assert dropout_threshold(0.5) == 2**23


def test_seed_is_reduced_to_32_bits():
    assert normalize_seed(5) == normalize_seed(5 + 2**32)
    assert normalize_seed(np.int64(9)) == 9
    with pytest.raises(TypeError, match="seed"):
        normalize_seed(1.5)
    with pytest.raises(TypeError, match="seed"):
        normalize_seed(True)
    q = np.zeros((1, 2, 5, 4))
    np.testing.assert_array_equal(
        aa.dropout_mask(q, q, 0.3, seed=11), aa.dropout_mask(q, q, 0.3, seed=11 + 2**32)
    )


@pytest.mark.parametrize(
    "q_shape, k_shape, gqa",
    [
        ((2, 4, 5, 6), (2, 4, 7, 6), False),
        ((2, 4, 5, 6), (2, 2, 7, 6), True),
        ((3, 5, 6), (3, 9, 6), False),
    ],
    ids=["mha", "gqa", "3d"],
)
def test_masks_identical_across_backends(backend, rng, q_shape, k_shape, gqa):
    thin(backend, gqa)
    q, k, _, _ = attention_inputs(rng, q_shape, k_shape, dtype="float32")
    expected = aa.dropout_mask(q, k, 0.4, seed=2024, enable_gqa=gqa)
    got = backend.call(
        aa.dropout_mask,
        backend.asarray(q),
        backend.asarray(k),
        dropout_p=0.4,
        seed=2024,
        enable_gqa=gqa,
    )
    got = backend.to_numpy(got)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, expected)
    # the mask is the documented hash at (batch, head, row, col)
    B = int(np.prod(expected.shape[:-3]))
    e = expected.reshape((B,) + expected.shape[-3:])
    t = dropout_threshold(0.4)
    for bb, hh, ii, jj in [
        (0, 0, 0, 0),
        (B - 1, e.shape[1] - 1, e.shape[2] - 1, e.shape[3] - 1),
        (B // 2, 1, 2, 3),
    ]:
        assert e[bb, hh, ii, jj] == (ref.dropout_bits(2024, bb, hh, ii, jj) >= t)


def test_dropout_mask_requires_seed():
    q = np.zeros((1, 1, 2, 4))
    with pytest.raises(ValueError, match="seed"):
        aa.dropout_mask(q, q, 0.5, seed=None)


def test_dropout_without_seed_backward_uses_forward_mask(rng):
    """seed=None draws a seed per call; vjp must reuse it in the backward. Output is linear
    in value, so <d_out, out> == <d_value, value> only if both used one mask."""
    q, k, v, _ = attention_inputs(rng, (1, 2, 6, 4), (1, 2, 6, 4))
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, dropout_p=0.5)
    d_out = rng.standard_normal(out.shape)
    _, _, dv = pullback(d_out)
    np.testing.assert_allclose(np.sum(d_out * out), np.sum(dv * v), rtol=1e-12)
    # and two calls without a seed give different masks
    a = aa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b = aa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not np.array_equal(a, b)


def test_dropout_keeps_expectation(rng):
    """Averaged over seeds, dropout's output is the plain output (scaled by 1/(1-p))."""
    q, k, v, _ = attention_inputs(rng, (1, 1, 4, 4), (1, 1, 16, 4))
    plain = aa.scaled_dot_product_attention(q, k, v)
    mean = np.mean(
        [aa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=s) for s in range(400)],
        axis=0,
    )
    np.testing.assert_allclose(mean, plain, atol=0.15)
