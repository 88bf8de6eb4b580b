"""Dask: every op builds a lazy graph (no computation while it is called), on inputs
split into several chunks, and the graph computes what NumPy computes.

The backend matrix (``tests/conftest.py``) already runs every backend test on Dask with
single-chunk arrays; this module adds what that cannot see: a data-dependent Python value
(``float(x)``, ``bool(x)``, ``int(x)``) in an op would compute the graph eagerly, which
the scheduler below turns into an error, and chunk boundaries inside the head, sequence
and batch axes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from array_api_compat import array_namespace

import arrayattn as aa
from arrayattn.nn import MultiHeadAttention

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")


def _no_compute(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the op computed its Dask graph while being called (not lazy)")


def _chunked(a: np.ndarray) -> Any:
    """A Dask array cut into two chunks along every axis longer than 1."""
    return da.from_array(a, chunks=tuple(max(1, (n + 1) // 2) for n in a.shape))


rng = np.random.default_rng(7)
Q = rng.standard_normal((2, 4, 12, 8))
K = rng.standard_normal((2, 2, 10, 8))
V = rng.standard_normal((2, 2, 10, 8))
D_OUT = rng.standard_normal((2, 4, 12, 8))
BOOL_MASK = rng.random((2, 1, 12, 10)) > 0.3
FLOAT_MASK = rng.standard_normal((1, 4, 12, 10))
X = rng.standard_normal((2, 12, 16))
SINKS = rng.standard_normal(4)
SLOPES = rng.uniform(0.1, 1.0, (2, 4))


def _sdpa_vjp(q, k, v, d_out, **options):
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, **options)
    return (out,) + tuple(pullback(d_out))


def _mha_vjp(x, d_out):
    mha = MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2, rope="half", causal=True)
    params = mha.init(seed=0, xp=np, dtype=np.float64)
    xp = array_namespace(x)
    y, pullback = mha.vjp({k: xp.asarray(v) for k, v in params.items()}, x)
    dx, _, dparams = pullback(d_out)
    return y, dx, dparams


def _rope(q):
    xp = array_namespace(q)
    freqs = aa.rope_frequencies(8, 12, xp=xp, dtype=xp.float64)
    return aa.apply_rope(q, freqs, layout="half")


def _elementwise_and_layout(q, x):
    xp = array_namespace(x)
    ones, zeros = xp.ones(16, dtype=xp.float64), xp.zeros(16, dtype=xp.float64)
    return (
        aa.softmax(q, axis=-1),
        aa.rms_norm(x, ones),
        aa.layer_norm(x, ones, zeros),
        aa.merge_heads(aa.split_heads(x, 4)),
        aa.repeat_kv(q, 2),
    )


CASES: dict[str, tuple[Callable[..., Any], tuple[np.ndarray, ...]]] = {
    "sdpa gqa causal": (
        lambda q, k, v: aa.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, causal_align="bottom_right"
        ),
        (Q, K, V),
    ),
    "sdpa chunked bool mask + lse": (
        lambda q, k, v, m: aa.scaled_dot_product_attention(
            q, k, v, m, enable_gqa=True, return_lse=True, implementation="chunked"
        ),
        (Q, K, V, BOOL_MASK),
    ),
    "sdpa float mask softcap window dropout": (
        lambda q, k, v, m: aa.scaled_dot_product_attention(
            q, k, v, m, 0.25, enable_gqa=True, softcap=4.0, window=(3, 1), seed=11
        ),
        (Q, K, V, FLOAT_MASK),
    ),
    "vjp sdpa gqa causal": (
        lambda q, k, v, d: _sdpa_vjp(q, k, v, d, is_causal=True, enable_gqa=True),
        (Q, K, V, D_OUT),
    ),
    "vjp sdpa float mask dropout": (
        lambda q, k, v, m, d: _sdpa_vjp(
            q, k, v, d, attn_mask=m, dropout_p=0.2, enable_gqa=True, seed=5
        ),
        (Q, K, V, FLOAT_MASK, D_OUT),
    ),
    "vjp sdpa sinks alibi chunked": (
        lambda q, k, v, s, m, d: _sdpa_vjp(
            q,
            k,
            v,
            d,
            sinks=s,
            alibi_slopes=m,
            is_causal=True,
            enable_gqa=True,
            causal_align="bottom_right",
            implementation="chunked",
        ),
        (Q, K, V, SINKS, SLOPES, D_OUT),
    ),  # fmt: skip
    "attention_weights": (
        lambda q, k: aa.attention_weights(q, k, is_causal=True, enable_gqa=True),
        (Q, K),
    ),
    "merge_attention_states": (
        lambda q, k, v: aa.merge_attention_states(
            *zip(
                aa.scaled_dot_product_attention(
                    q, k[:, :, :4], v[:, :, :4], enable_gqa=True, return_lse=True
                ),
                aa.scaled_dot_product_attention(
                    q, k[:, :, 4:], v[:, :, 4:], enable_gqa=True, return_lse=True
                ),
                strict=True,
            )
        ),
        (Q, K, V),
    ),
    "softmax, norms, heads, repeat_kv": (_elementwise_and_layout, (Q, X)),
    "rope": (_rope, (Q,)),
    "MultiHeadAttention vjp": (_mha_vjp, (X, X)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_is_lazy_on_chunked_dask_arrays_and_equals_numpy(name):
    fn, arrays = CASES[name]
    with dask.config.set(scheduler=_no_compute):
        lazy = fn(*(_chunked(a) for a in arrays))
    got, want = _leaves(lazy), _leaves(fn(*arrays))  # the same call on NumPy
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, da.Array), f"expected a Dask array, got {type(g).__name__}"
        g = np.asarray(g.compute())
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def _leaves(tree: Any) -> list[Any]:
    """The arrays of a nested result (tuples, lists, dicts by key; ``None`` dropped)."""
    if isinstance(tree, tuple | list):
        return [a for t in tree for a in _leaves(t)]
    if isinstance(tree, dict):
        return [a for k in sorted(tree) for a in _leaves(tree[k])]
    return [] if tree is None else [tree]
