"""``block_mask=``, ``mask_mod=`` and ``score_mod=`` through ``arrayattn.jax``'s
``custom_vjp`` (float64).

Oracle: ``jax.grad`` through a plain dense ``jax.numpy`` attention with the same mask and
score_mod written in jnp (outputs, LSE and the gradients of q, k, v and a T5 bias table,
1e-12), on both paths (the host callback and the traced path, run by the composed
implementation: the chunked one traces the same code in more, smaller blocks), under
``jax.jit``; ``jax.vmap`` (the table vmapped or not) against each slice run alone; and
the errors for masks built
for another library, arrays of the wrong library, shapes and score_mods without
what ``jax.grad`` needs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np
import pytest

jnp = pytest.importorskip("jax.numpy")
import jax  # noqa: E402

import arrayattn as aa  # noqa: E402
import arrayattn.jax as aaj  # noqa: E402
from arrayattn import flex  # noqa: E402

SDPA = aaj.scaled_dot_product_attention
TOL = {"rtol": 1e-12, "atol": 1e-12}
B, HQ, HKV, E = 2, 4, 2, 8
L, S = 12, 20
BLOCK = 4
IDS = np.repeat([[0, 1, 2], [0, 0, 1]], [5, 7, 8], axis=1)  # (B, S) documents


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def t5_bucket(rel, num_buckets=32, max_distance=128):
    """T5's bucket in jnp (Hugging Face's ``_relative_position_bucket``, bidirectional)."""
    n = num_buckets // 2
    buckets = (rel > 0).astype(jnp.int64) * n
    rel = jnp.abs(rel)
    exact = n // 2
    large = exact + (
        jnp.log(jnp.maximum(rel, exact).astype(jnp.float32) / exact)
        / np.log(max_distance / exact) * (n - exact)
    ).astype(jnp.int64)  # fmt: skip
    return buckets + jnp.where(rel < exact, rel, jnp.minimum(large, n - 1))


def dense(q, k, v, table, causal_doc=True):
    """Dense jnp attention with the document-causal mask and the T5 bias: (out, lse)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    s = q @ jnp.swapaxes(kk, -1, -2) / np.sqrt(q.shape[-1])
    qi, ki = jnp.arange(L)[:, None], jnp.arange(S)[None, :]
    s = s + jnp.moveaxis(table[t5_bucket(ki - qi, max_distance=20)], -1, 0)
    ids = jnp.asarray(IDS)
    keep = (ids[:, :L][:, :, None] == ids[:, None, :]) & (ki <= qi + S - L)
    s = jnp.where(keep[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m)
    total = e.sum(-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0)
    return (e / safe) @ vv, jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)[..., 0]


def inputs(seed=0, lead=()):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*lead, B, HQ, L, E))
    k, v = (rng.standard_normal((*lead, B, HKV, S, E)) for _ in range(2))
    table = rng.standard_normal((32, HQ))
    return (*(jnp.asarray(x) for x in (q, k, v, table)), rng)


def doc_mask(ids):
    return flex.and_masks(flex.document_mask(ids[:, :L], ids), flex.causal(S - L))


def loss_of(f, cot, cot_lse):
    def loss(q, k, v, t):
        out, lse = f(q, k, v, t)
        return (out * cot).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse).sum()

    return loss


@functools.cache
def reference(seed: int):
    """Inputs, cotangents and what jax.grad through the dense jnp attention gives
    (computed once for the parametrizations)."""
    jax.config.update("jax_enable_x64", True)
    q, k, v, table, rng = inputs(seed)
    out, lse = jax.jit(dense)(q, k, v, table)
    cot = jnp.asarray(rng.standard_normal(out.shape))
    cot_lse = jnp.where(jnp.isfinite(lse), jnp.asarray(rng.standard_normal(lse.shape)), 0.0)
    grads = jax.jit(jax.grad(loss_of(dense, cot, cot_lse), argnums=(0, 1, 2, 3)))(q, k, v, table)
    return (q, k, v, table), (cot, cot_lse), (out, lse), grads


@pytest.mark.parametrize(
    "impl, ids_lib, given",
    [("auto", "numpy", "block_mask"), ("composed", "jax", "block_mask"),
     ("fast", "numpy", "mask_mod")],
)  # fmt: skip
def test_matches_dense_jnp_under_grad_and_jit(impl, ids_lib, given) -> None:
    (q, k, v, table), (cot, cot_lse), (want_out, want_lse), want = reference(1)
    ids = IDS if ids_lib == "numpy" else jnp.asarray(IDS)
    mod = doc_mask(ids)
    opts = {"mask_mod": mod}
    if given == "block_mask":
        # (the traced path unrolls its blocks into the XLA program: fewer, larger blocks
        # compile faster)
        size = BLOCK if impl != "composed" else 16
        opts = {"block_mask": flex.create_block_mask(mod, B, None, L, S, block_size=size)}

    def ours(q, k, v, t):
        return SDPA(q, k, v, enable_gqa=True, score_mod=flex.relative_position_bias(
            t, max_distance=20), return_lse=True, implementation=impl, **opts)  # fmt: skip

    out, lse = ours(q, k, v, table)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    got = jax.jit(jax.grad(loss_of(ours, cot, cot_lse), argnums=(0, 1, 2, 3)))(q, k, v, table)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), got, want, strict=True):
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)


@pytest.mark.parametrize(
    "impl, table_mapped", [("auto", False), ("auto", True), ("composed", True)]
)
def test_vmap_gives_each_slice_what_it_gives_alone(impl, table_mapped) -> None:
    """``vmap`` over a leading axis (the table vmapped too, or shared) equals each slice
    run alone: arrayattn.vjp on NumPy, whose gradients the test above ties to jnp's."""
    q, k, v, table, rng = inputs(2, lead=(3,))
    t = jnp.asarray(rng.standard_normal((3, 32, HQ))) if table_mapped else table
    mod = doc_mask(jnp.asarray(IDS) if impl == "composed" else IDS)
    bm = flex.create_block_mask(mod, B, None, L, S, block_size=BLOCK if impl == "auto" else 16)
    axes = 0 if table_mapped else (0, 0, 0, None)

    def f(q, k, v, t):
        return SDPA(q, k, v, enable_gqa=True, block_mask=bm, implementation=impl,
                    score_mod=flex.relative_position_bias(t, max_distance=20))  # fmt: skip

    def loss(q, k, v, t):
        return (jax.vmap(f, in_axes=axes)(q, k, v, t) ** 2).sum()

    got_q, got_t = jax.jit(jax.grad(loss, argnums=(0, 3)))(q, k, v, t)
    bm_np = flex.create_block_mask(doc_mask(IDS), B, None, L, S, block_size=BLOCK)
    want_t = np.zeros(t.shape)
    for i in range(3):
        ti = np.asarray(t[i] if table_mapped else t)
        qi, ki, vi = (np.asarray(x[i]) for x in (q, k, v))
        sm = flex.relative_position_bias(ti, max_distance=20)
        out, pullback = aa.vjp(
            aa.scaled_dot_product_attention,
            qi,
            ki,
            vi,
            enable_gqa=True,
            block_mask=bm_np,
            score_mod=sm,
        )
        grads = pullback(2 * out)
        dq, extra = grads[0], grads[-1]
        np.testing.assert_allclose(got_q[i], dq, **TOL)
        if table_mapped:
            want_t[i] = extra["score_mod"][0]
        else:
            want_t += extra["score_mod"][0]
    np.testing.assert_allclose(got_t, want_t, **TOL)


@pytest.mark.parametrize("mod", ["document", "prefix_lm"])
def test_builtin_numpy_ids_run_traced(mod) -> None:
    """Built-in mask_mods holding NumPy ids run on the traced path (on a GPU, 'auto' is
    traced) with the same results and gradients as built on JAX arrays."""
    q, k, v, _, _ = inputs(4)
    prefix = np.array([3, 9])

    def build(lib):
        if mod == "document":
            return doc_mask(lib(IDS))
        return flex.prefix_lm_mask(lib(prefix))

    def grads(m):
        def loss(q, k, v):
            out = SDPA(q, k, v, enable_gqa=True, mask_mod=m, implementation="chunked")
            return (out**2).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got, want = grads(build(np.asarray)), grads(build(jnp.asarray))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_errors_name_what_is_wrong() -> None:
    q, k, v, table, _ = inputs(3)
    bm = flex.create_block_mask(flex.causal_mask, None, None, L, S)
    with pytest.raises(ValueError, match=r"block_mask was built for torch.*NumPy.*jax.numpy"):
        SDPA(q, k, v, enable_gqa=True, block_mask=dataclasses.replace(bm, library="torch"))
    with pytest.raises(ValueError, match=r"block_mask was built for other calls.*L = 12, S = 20"):
        SDPA(q, k, v, enable_gqa=True,
             block_mask=flex.create_block_mask(flex.causal_mask, None, None, L, L))  # fmt: skip
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        SDPA(q, k, v, enable_gqa=True, block_mask=np.ones((L, S), bool))
    with pytest.raises(ValueError, match=r"table has 3 heads.*Hq = 4"):
        SDPA(q, k, v, enable_gqa=True, score_mod=flex.relative_position_bias(jnp.zeros((32, 3))))
    # A user's function indexing NumPy ids cannot take traced indices: the traced path
    # refuses it (the built-ins move their ids to JAX: test_builtin_numpy_ids_run_traced).
    def by_numpy_ids(b, h, q_idx, kv_idx):
        return IDS[b, q_idx] == IDS[b, kv_idx]

    with pytest.raises(ValueError, match=r"holds NumPy arrays.*traced path.*jnp.asarray"):
        SDPA(q, k, v, enable_gqa=True, mask_mod=by_numpy_ids, implementation="chunked")
    with pytest.raises(TypeError, match=r"holds NumPy arrays but .* holds JAX arrays"):
        SDPA(q, k, v, enable_gqa=True, mask_mod=by_numpy_ids,
             score_mod=flex.alibi_score_mod(jnp.ones(HQ)))  # fmt: skip
    with pytest.raises(ValueError, match=r"implementation='fast'.*holds JAX arrays"):
        SDPA(q, k, v, enable_gqa=True, mask_mod=flex.document_mask(jnp.asarray(IDS)),
             implementation="fast")  # fmt: skip

    # Traced arrays a mask_mod captures (not params) are refused, params are not.
    def traced_ids(ids):
        return SDPA(q, k, v, enable_gqa=True, mask_mod=lambda b, h, qi, ki: ids[ki] >= 0)

    with pytest.raises(TypeError, match="holds a traced JAX array"):
        jax.jit(traced_ids)(jnp.asarray(IDS[0]))
    # A ScoreMod with params must be rebuildable; one without a derivative: forward only.
    own = flex.ScoreMod(lambda s, b, h, qi, ki: s + table[h][..., None, None], params=(table,),
                        param_grads=lambda ds, *_: (ds,))  # fmt: skip
    with pytest.raises(TypeError, match="no rebuild= function.*custom_vjp"):
        SDPA(q, k, v, enable_gqa=True, score_mod=own)
    bare = lambda s, b, h, qi, ki: 2 * s  # noqa: E731
    assert SDPA(q, k, v, enable_gqa=True, score_mod=bare).shape == (B, HQ, L, E)
    with pytest.raises(TypeError, match="has no derivative.*ScoreMod"):
        jax.grad(lambda q: SDPA(q, k, v, enable_gqa=True, score_mod=bare).sum())(q)
    with pytest.raises(TypeError, match=r"params\[0\] must be a jax.Array"):
        import torch

        SDPA(q, k, v, enable_gqa=True, score_mod=flex.relative_position_bias(torch.zeros(32, HQ)))
