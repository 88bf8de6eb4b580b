"""The Dask implementation (``arrayattn.attention.dask``): block graphs over batch, heads and
sequence equal the one-process NumPy call, stay lazy, have O(blocks) tasks, and run on a
``dask.distributed`` cluster of worker processes."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import numpy as np
import pytest

import arrayattn as aa

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")


def _no_compute(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the Dask graph was computed while it was being built")


rng = np.random.default_rng(13)
B, HQ, HKV, L, S, E = 2, 4, 2, 23, 19, 8
Q = rng.standard_normal((B, HQ, L, E))
K = rng.standard_normal((B, HKV, S, E))
V = rng.standard_normal((B, HKV, S, 6))
D_OUT = rng.standard_normal((B, HQ, L, 6))
D_LSE = rng.standard_normal((B, HQ, L))
BOOL_MASK = rng.random((B, 1, L, S)) > 0.25
FLOAT_MASK = rng.standard_normal((1, HQ, L, S))
# Hugging Face style: finfo.min on excluded pairs, query row 3 excluded everywhere (its
# huge LSE swallows log(rowsum); the backward renormalises such rows over the whole row).
HF_MASK = np.where(BOOL_MASK, 0.0, np.finfo(np.float64).min)
HF_MASK[:, :, 3, :] = np.finfo(np.float64).min
Q_LEN = np.array([17, 23])
KV_LEN = np.array([19, 4])

# (query chunks, key chunks, value chunks): uneven last chunks, chunks of 1, misaligned.
CHUNKINGS = {
    "seq uneven": ((2, 4, 7, 8), (2, 2, 5, 8), (2, 2, 5, 6)),
    "seq of 1": ((1, 4, 1, 8), (1, 2, 4, 8), (1, 2, 4, 6)),
    "batch heads": ((1, 2, L, 8), (1, 1, S, 8), (1, 1, S, 6)),
    "misaligned": ((1, 1, 9, 3), (2, 2, 6, 8), (1, 1, 4, 6)),
}
OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal bottom-right": {"is_causal": True, "causal_align": "bottom_right"},
    "window skips blocks": {"window": (3, 1)},
    # Bounds beyond a block's own L + S must stay bounds (they cut other blocks' rows).
    "wide window": {"window": (12, 0)},
    "bool mask": {"attn_mask": BOOL_MASK},
    "float mask softcap": {"attn_mask": FLOAT_MASK, "softcap": 3.0},
    "finfo.min mask": {"attn_mask": HF_MASK},
    "dropout": {"dropout_p": 0.3, "seed": 11, "is_causal": True},
    "lengths bottom-right": {
        "q_lengths": Q_LEN,
        "kv_lengths": KV_LEN,
        "is_causal": True,
        "causal_align": "bottom_right",
    },
    "lengths window dropout": {
        "kv_lengths": KV_LEN,
        "window": (4, 2),
        "dropout_p": 0.2,
        "seed": 5,
    },
}


def _dask(a: np.ndarray | None, chunks: Any) -> Any:
    return None if a is None else da.from_array(a, chunks=chunks)


def _mask_chunks(m: np.ndarray, qc: tuple, kc: tuple) -> tuple:
    return tuple(1 if n == 1 else c for n, c in zip(m.shape, qc[:3] + (kc[2],), strict=True))


def _call(q, k, v, d_out, d_lse, options):
    out, pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, enable_gqa=True, return_lse=True, **options
    )
    return out + tuple(g for g in pullback((d_out, d_lse)) if g is not None)


def _lazy_options(options: dict, qc: tuple, kc: tuple) -> dict:
    lazy = dict(options)
    for name in ("attn_mask",):
        if name in lazy:
            lazy[name] = _dask(lazy[name], _mask_chunks(lazy[name], qc, kc))
    for name in ("q_lengths", "kv_lengths"):
        if name in lazy:
            lazy[name] = _dask(lazy[name], (1,))
    return lazy


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_dask_equals_numpy_forward_and_backward(chunking, option):
    qc, kc, vc = CHUNKINGS[chunking]
    options = OPTIONS[option]
    want = _call(Q, K, V, D_OUT, D_LSE, options)
    with dask.config.set(scheduler=_no_compute):
        lazy = _call(
            _dask(Q, qc),
            _dask(K, kc),
            _dask(V, vc),
            _dask(D_OUT, qc[:3] + (6,)),
            _dask(D_LSE, qc[:3]),
            _lazy_options(options, qc, kc),
        )
    assert all(isinstance(x, da.Array) for x in lazy)
    got = dask.compute(*lazy, scheduler="sync")
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_output_alone_equals_numpy(chunking, option):
    # Without return_lse (outside vjp) the caller drops the LSE, and rows with one key
    # block make their output chunk in the block's own task; the LSE graph returned
    # beside it (not reachable through the public call) must still be right.
    from arrayattn.attention import dask as dask_path
    from arrayattn.attention.spec import make_spec

    qc, kc, vc = CHUNKINGS[chunking]
    options = OPTIONS[option]
    want = aa.scaled_dot_product_attention(Q, K, V, enable_gqa=True, **options)
    want_lse = aa.scaled_dot_product_attention(
        Q, K, V, enable_gqa=True, return_lse=True, **options
    )[1]
    lazy_options = _lazy_options(options, qc, kc)
    with dask.config.set(scheduler=_no_compute):
        q, k, v = _dask(Q, qc), _dask(K, kc), _dask(V, vc)
        got = aa.scaled_dot_product_attention(q, k, v, enable_gqa=True, **lazy_options)
        spec = make_spec(
            q,
            k,
            v,
            lazy_options.get("attn_mask"),
            lazy_options.get("dropout_p", 0.0),
            lazy_options.get("is_causal", False),
            None,
            True,
            lazy_options.get("causal_align", "top_left"),
            lazy_options.get("window"),
            lazy_options.get("softcap"),
            lazy_options.get("seed"),
            q_lengths=lazy_options.get("q_lengths"),
            kv_lengths=lazy_options.get("kv_lengths"),
            lse_wanted=False,
        )
        _, lse = dask_path.forward(spec, q, k, v, lazy_options.get("attn_mask"))
    got, lse = dask.compute(got, lse, scheduler="sync")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_output_alone_and_with_lse_have_keys_of_their_own():
    # Their single-block rows' output chunks are different tasks: under one key, a
    # cluster given both graphs would hold two run specs for it.
    x = da.zeros((1, 2, 64, 8), chunks=(1, 2, 16, 8), dtype=np.float32)
    alone = aa.scaled_dot_product_attention(x, x, x, is_causal=True)
    with_lse = aa.scaled_dot_product_attention(x, x, x, is_causal=True, return_lse=True)
    assert not set(dict(alone.__dask_graph__())) & {
        k for k in dict(with_lse[0].__dask_graph__()) if str(k[0]).startswith("attn")
    }


def test_dask_picks_the_dask_path_and_names_it():
    q = da.from_array(Q, chunks=(1, 2, 8, 8))
    k, v = da.from_array(K, chunks=(1, 1, 8, 8)), da.from_array(V, chunks=(1, 1, 8, 6))
    auto = aa.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    named = aa.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, is_causal=True, implementation="dask"
    )
    assert "dask" in aa.implementations()
    assert auto.name == named.name  # the same graph, by the same deterministic token
    assert any(k_[0].startswith("attn-blocks-") for k_ in dict(auto.__dask_graph__()))
    with pytest.raises(ValueError, match="needs Dask arrays"):
        aa.scaled_dot_product_attention(Q, K, V, enable_gqa=True, implementation="dask")


def test_two_pullbacks_of_one_forward_do_not_share_graph_keys():
    q, k, v = (da.from_array(x, chunks=(1, 2, 8, -1)) for x in (Q, K, V))
    _, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    d1 = da.from_array(D_OUT, chunks=(1, 2, 8, 6))
    g1, g2 = pullback(d1)[0], pullback(2 * d1)[0]
    assert g1.name != g2.name
    a, b = dask.compute(g1, g2, scheduler="sync")
    np.testing.assert_allclose(b, 2 * a, rtol=1e-12, atol=1e-12)


def test_float32_equals_numpy_within_rounding():
    q32, k32, v32 = (x.astype(np.float32) for x in (Q, K, V))
    want = aa.scaled_dot_product_attention(q32, k32, v32, enable_gqa=True, is_causal=True)
    got = aa.scaled_dot_product_attention(
        da.from_array(q32, chunks=(1, 2, 5, 8)),
        da.from_array(k32, chunks=(1, 1, 6, 8)),
        da.from_array(v32, chunks=(1, 1, 6, 6)),
        enable_gqa=True,
        is_causal=True,
    ).compute(scheduler="sync")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_broadcast_keys_three_dim_and_mqa():
    # Keys shared by the batch (gradients summed over batch chunks), one KV head (MQA).
    q = rng.standard_normal((3, 4, 10, 8))
    k = rng.standard_normal((1, 10, 8))
    v = rng.standard_normal((1, 10, 8))
    d = rng.standard_normal((3, 4, 10, 8))
    want = _call(q, k, v, d, None, {"is_causal": True})
    got = dask.compute(
        *_call(
            da.from_array(q, chunks=(1, 2, 4, 8)),
            da.from_array(k, chunks=(1, 3, 8)),
            da.from_array(v, chunks=(1, 5, 8)),
            da.from_array(d, chunks=(1, 2, 4, 8)),
            None,
            {"is_causal": True},
        ),
        scheduler="sync",
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_backward_matches_finite_differences():
    q, k, v = (x[:1, :2, :7] for x in (Q, K[:, :1], V[:, :1]))
    d = rng.standard_normal((1, 2, 7, 6))
    chunks = (1, 1, 3, 8)

    def f(q_):
        out = aa.scaled_dot_product_attention(
            da.from_array(q_, chunks=chunks),
            da.from_array(k, chunks=chunks),
            da.from_array(v, chunks=(1, 1, 3, 6)),
            is_causal=True,
        )
        return float((out.compute(scheduler="sync") * d).sum())

    _, pullback = aa.vjp(
        aa.scaled_dot_product_attention,
        da.from_array(q, chunks=chunks),
        da.from_array(k, chunks=chunks),
        da.from_array(v, chunks=(1, 1, 3, 6)),
        is_causal=True,
    )
    dq = np.asarray(pullback(da.from_array(d))[0].compute(scheduler="sync"))
    h = 1e-6
    for idx in [(0, 0, 0, 0), (0, 1, 4, 3), (0, 0, 6, 7)]:
        e = np.zeros_like(q)
        e[idx] = h
        fd = (f(q + e) - f(q - e)) / (2 * h)
        assert abs(fd - dq[idx]) < 1e-6 * max(1.0, abs(fd))


def _tasks(*arrays: Any) -> int:
    graph = {}
    for a in arrays:
        graph.update(dict(a.__dask_graph__()))
    return len(graph)


def test_task_count_is_per_block_not_per_element():
    # L = S = 8192 in 2048-long chunks, causal, 4 heads: 4 query x 4 key blocks, 10 of them
    # under the causal band; the graph must stay O(blocks), built in far below a second.
    n, chunk = 8192, 2048
    x = da.zeros((1, 4, n, 64), chunks=(1, 4, chunk, 64), dtype=np.float32)
    with dask.config.set(scheduler=_no_compute):
        t0 = time.perf_counter()
        out, pullback = aa.vjp(aa.scaled_dot_product_attention, x, x, x, is_causal=True)
        grads = pullback(da.ones_like(out))
        elapsed = time.perf_counter() - t0
    inputs = _tasks(x) + _tasks(da.ones_like(out))
    blocks = [
        k
        for k in dict(out.__dask_graph__())
        if k[0].startswith(("attn-blocks-", "attn-edge-blocks-"))
    ]
    assert len(blocks) == 10  # causal: 4 + 3 + 2 + 1 block pairs, the 6 above never built
    # the 4 diagonal blocks are cut by the causal band: named apart from the full ones
    assert sum(k[0].startswith("attn-edge-blocks-") for k in blocks) == 4
    assert _tasks(out) - inputs <= 30
    # A row with several key blocks ends in its output chunk's own merge task: nothing for
    # Dask's fusion to rename and alias (one more task and scheduler round trip per row).
    # Only row 0, a single block, still ends in a fused block and an alias.
    # Without return_lse (the caller drops the LSE) row 0's block makes its output chunk
    # itself too: no alias at all.
    for call in (out, aa.scaled_dot_product_attention(x, x, x, is_causal=True)):
        (optimized,) = dask.optimize(call)
        graph = dict(optimized.__dask_graph__())
        aliases = [t for t in graph.values() if type(t).__name__ == "Alias"]
        assert len(aliases) <= (1 if call is out else 0)
    assert _tasks(*grads) - inputs <= 80
    assert elapsed < 5.0  # milliseconds normally; generous for a loaded CI machine
    # Heads in 4 chunks, sequence unchunked: one task per head chunk, nothing to merge.
    y = da.zeros((1, 4, n, 64), chunks=(1, 1, n, 64), dtype=np.float32)
    out = aa.scaled_dot_product_attention(y, y, y, is_causal=True)
    assert _tasks(out) - _tasks(y) <= 3 * 4
    (optimized,) = dask.optimize(out)
    graph = dict(optimized.__dask_graph__())
    assert not [t for t in graph.values() if type(t).__name__ == "Alias"]


def test_backward_starts_once_its_cells_forward_has_run():
    # Several query blocks: every backward block task of a (batch, head) cell depends on
    # one task that depends on every row's LSE of that cell, and on nothing of another
    # cell's. One query block: no such task (a head's backward follows its own forward).
    x = da.zeros((2, 2, 64, 8), chunks=(1, 2, 16, 8), dtype=np.float32)
    graph, deps = _causal_backward_graph(x)
    gates = [k for k in graph if str(k[0]).endswith("-forward-done")]
    assert sorted(k[1:] for k in gates) == [(0, 0), (1, 0)]  # one per batch chunk
    for g in gates:
        assert {k[0].split("-")[1] for k in deps[g]} == {"lse"}
        assert sorted(k[1:] for k in deps[g]) == [(g[1], 0, i) for i in range(4)]
    bwd = [k for k in graph if str(k[0]).startswith("attn-bwd-") and len(k) == 5]
    assert len(bwd) == 2 * 10
    for k in bwd:
        assert [d for d in deps[k] if d in gates] == [(gates[0][0], k[1], k[2])]
    y = da.zeros((1, 2, 64, 8), chunks=(1, 1, 64, 8), dtype=np.float32)
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, y, y, y, is_causal=True)
    keys = set()
    for g in pullback(da.ones_like(out)):
        keys.update(dict(g.__dask_graph__()))
    assert not any(str(k[0]).endswith("-forward-done") for k in keys)


def test_backward_blocks_take_their_rows_d_not_the_output():
    # A query block with several key blocks gets one task for D = rowsum(dO * O), on its
    # output and cotangent chunks; its backward block tasks read that D and not the output
    # chunk (no transfer of it to every block's worker). A query block with one key block
    # (row 0 under causal masking) keeps reading the output itself.
    x = da.zeros((1, 2, 64, 8), chunks=(1, 2, 16, 8), dtype=np.float32)
    graph, deps = _causal_backward_graph(x)
    deltas = {k[-1]: k for k in graph if str(k[0]).endswith("-delta")}
    assert sorted(deltas) == [1, 2, 3]
    for i, d in deltas.items():
        names = sorted(str(k[0]).rsplit("-", 1)[0] for k in deps[d])
        assert names == ["attn-out", "ones_like"], names
        assert all(k[-2] == i for k in deps[d])
    bwd = [k for k in graph if str(k[0]).startswith("attn-bwd-") and len(k) == 5]
    for k in bwd:
        i = k[3]
        reads_out = any(str(d[0]).startswith("attn-out-") for d in deps[k])
        assert reads_out == (i == 0), k
        assert (deltas.get(i) in deps[k]) == (i > 0), k


def test_backward_with_rows_d_equals_numpy_on_fast_path_blocks():
    # The per-row D is the one the blocks computed themselves (the same rowwise_dot on the
    # same rows); checked against the one-process call on blocks big enough for the NumPy
    # fast path (the small blocks of the matrix above run the array-API path).
    r = np.random.default_rng(11)
    q, k, v, d = (r.standard_normal((1, 2, 512, 32)).astype(np.float32) for _ in range(4))
    want = aa.vjp(aa.scaled_dot_product_attention, q, k, v)[1](d)
    lazy = [da.from_array(a, chunks=(1, 2, 256, 32)) for a in (q, k, v)]
    got_out, pb = aa.vjp(aa.scaled_dot_product_attention, *lazy)
    got = pb(da.from_array(d, chunks=(1, 2, 256, 32)))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("dtype", "rows", "with_d_lse", "causal"),
    [
        (np.float32, 512, False, True),  # NumPy fast path blocks
        (np.float32, 512, True, False),
        (np.float64, 256, True, True),
        (np.float16, 256, False, True),
        (np.float64, 8, True, True),  # array-API path blocks
        (np.float32, 8, False, False),
    ],
)
def test_rows_d_gives_the_blocks_own_gradients_bit_for_bit(dtype, rows, with_d_lse, causal):
    # A block task given its row's D (and no output) returns exactly what it returns when
    # it reads the output and computes D itself: every path forms D - dLSE first.
    from arrayattn.attention.dask import plan as _dask_plan
    from arrayattn.attention.dask import tasks as _dask_tasks
    from arrayattn.attention.spec import make_spec

    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((1, 2, 2 * rows, 16)).astype(dtype) for _ in range(3))
    lazy = [da.from_array(x, chunks=(1, 2, rows, 16)) for x in (q, k, v)]
    spec = make_spec(*lazy, None, 0.0, causal, None, False, "top_left", None, None, None)
    blk = _dask_plan._plan(spec, *lazy, None, "test").block((0,), 0, 1, 0)
    out, lse = aa.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
    out_i, lse_i = out[:, :, rows:], lse[:, :, rows:]
    d_out = r.standard_normal(out_i.shape).astype(dtype)
    d_lse = r.standard_normal(lse_i.shape).astype(lse_i.dtype) if with_d_lse else None
    operands = (q[:, :, rows:], k[:, :, :rows], v[:, :, :rows], None)
    own = _dask_tasks._backward_block(None, blk, *operands, out_i, lse_i, d_out, d_lse, None, None)
    delta = _dask_tasks._row_delta(out_i, d_out)
    given = _dask_tasks._backward_block(
        None, blk, *operands, None, lse_i, d_out, d_lse, None, None, None, None, delta
    )
    for a, b in zip(own[:3], given[:3], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def _causal_backward_graph(x: Any) -> tuple[dict, dict]:
    """The unoptimised graph of a causal self-attention's gradients, and each task's
    dependencies within it."""
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, x, x, x, is_causal=True)
    graph: dict = {}
    for g in pullback(da.ones_like(out)):
        graph.update(dict(g.__dask_graph__()))
    return graph, {k: _dependencies(k, v, set(graph)) for k, v in graph.items()}


def _dependencies(key: Any, task: Any, keys: set) -> set:
    from dask._task_spec import convert_legacy_task

    return set(convert_legacy_task(key, task, keys).dependencies)


def test_gqa_head_chunks_keep_groups_together():
    q = da.from_array(Q, chunks=(2, 1, L, 8))  # one query head per chunk, groups of 2
    k = da.from_array(K, chunks=(2, 1, S, 8))
    out = aa.scaled_dot_product_attention(q, k, da.from_array(V), enable_gqa=True)
    assert out.chunks[1] == (2, 2)
    want = aa.scaled_dot_product_attention(Q, K, V, enable_gqa=True)
    np.testing.assert_allclose(out.compute(scheduler="sync"), want, rtol=1e-12, atol=1e-12)


def test_varlen_and_multi_head_attention_reuse_the_dask_path():
    from arrayattn.nn import MultiHeadAttention

    x = rng.standard_normal((2, 12, 16))
    mha = MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2, causal=True)
    params = mha.init(seed=0, xp=np, dtype=np.float64)
    want = mha(params, x)
    xd = da.from_array(x, chunks=(1, 6, 16))
    with dask.config.set(scheduler=_no_compute):
        lazy = mha({k: da.from_array(v) for k, v in params.items()}, xd)
    assert any(str(k[0]).startswith("attn-blocks-") for k in dict(lazy.__dask_graph__()))
    np.testing.assert_allclose(lazy.compute(scheduler="sync"), want, rtol=1e-12, atol=1e-12)

    cu = np.array([0, 5, 12, 20])
    qv, kv = rng.standard_normal((2, 20, 8)), rng.standard_normal((2, 20, 8))
    want = aa.varlen_attention(qv, kv, kv, cu, cu, max_seqlen_q=8, max_seqlen_k=8, is_causal=True)
    got = aa.varlen_attention(
        da.from_array(qv, chunks=(1, 10, 8)),
        da.from_array(kv, chunks=(1, 10, 8)),
        da.from_array(kv, chunks=(1, 10, 8)),
        da.from_array(cu),
        da.from_array(cu),
        max_seqlen_q=8,
        max_seqlen_k=8,
        is_causal=True,
    )
    np.testing.assert_allclose(got.compute(scheduler="sync"), want, rtol=1e-12, atol=1e-12)


def test_runs_on_a_local_cluster_of_worker_processes():
    distributed = pytest.importorskip("distributed")
    q32, k32, v32 = (x.astype(np.float32) for x in (Q, K, V))
    want, pullback = aa.vjp(
        aa.scaled_dot_product_attention, q32, k32, v32, enable_gqa=True, is_causal=True
    )
    dq_want = pullback(np.ones_like(want))[0]
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        q = da.from_array(q32, chunks=(1, 2, 8, 8))
        k = da.from_array(k32, chunks=(1, 1, 8, 8))
        v = da.from_array(v32, chunks=(1, 1, 8, 6))
        out, pb = aa.vjp(aa.scaled_dot_product_attention, q, k, v, enable_gqa=True, is_causal=True)
        got, dq = client.compute([out, pb(da.ones_like(out))[0]], sync=True)
        tuned = client.run(lambda: sys.modules["arrayattn.attention.dask.tasks"]._HEAP_TUNED)
    if sys.platform.startswith("linux"):  # workers keep freed memory for the next task
        assert set(tuned.values()) == {True}, tuned
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(dq, dq_want, rtol=1e-5, atol=1e-5)


def test_local_schedulers_leave_the_allocator_alone(monkeypatch):
    from arrayattn.attention.dask import tasks as _dask_tasks

    monkeypatch.setattr(_dask_tasks, "_HEAP_TUNED", None)
    q = da.from_array(Q, chunks=(1, 2, 8, 8))
    k = da.from_array(K, chunks=(1, 1, 8, 8))
    v = da.from_array(V, chunks=(1, 1, 8, 6))
    aa.scaled_dot_product_attention(q, k, v, enable_gqa=True).compute(scheduler="threads")
    assert _dask_tasks._HEAP_TUNED is False  # a user's process is not a distributed worker


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "independent"])
def test_dask_bench_quick_run(tmp_path, capsys, placement):
    pytest.importorskip("distributed")
    from _scripts import load_script

    bench = load_script("bench/dask_bench.py")
    results = tmp_path / "RESULTS.md"
    argv = ["--quick", "--cases", "heads", "--passes", "fwd", "--placement", placement]
    assert bench.main([*argv, "--append-results", str(results)]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| heads | fwd |"))
    peak_mib = float(row.split("|")[-2].split()[0])
    assert 0 < peak_mib < 2048  # a worker's own peak, not the client's inherited one
    text = results.read_text()
    assert "Dask scale-out run" in text and f"inputs {placement}" in text


def test_dask_bench_colocated_inputs_share_a_worker():
    pytest.importorskip("distributed")
    from _scripts import load_script
    from distributed import Client, LocalCluster

    bench = load_script("bench/dask_bench.py")
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        qkv = np.ones((3, 1, 2, 8, 4), np.float32)
        xs = bench.persist_inputs(client, qkv, (1, 2, 2, 4), "colocated", "t")
        who = client.who_has(xs)
        for i in range(4):
            homes = [set(who[(x.name, 0, 0, i, 0)]) for x in xs]
            assert homes[0] == homes[1] == homes[2], homes


_HAS_SINKS = "sinks" in __import__("inspect").signature(aa.scaled_dot_product_attention).parameters


@pytest.mark.skipif(not _HAS_SINKS, reason="sinks=/alibi_slopes= not in this version")
@pytest.mark.parametrize("chunking", ["seq uneven", "batch heads"])
@pytest.mark.parametrize(
    "option",
    [
        {"sinks": rng.standard_normal(HQ)},
        {"alibi_slopes": 2.0 ** -np.arange(1, HQ + 1), "is_causal": True},
        {
            "alibi_slopes": rng.random((B, HQ)),
            "sinks": rng.standard_normal(HQ),
            "is_causal": True,
            "causal_align": "bottom_right",
            "q_lengths": Q_LEN,
            "kv_lengths": KV_LEN,
        },
    ],
    ids=["sinks", "alibi causal", "alibi per batch + sinks + lengths"],
)
def test_sinks_and_alibi_equal_numpy(chunking, option):
    qc, kc, vc = CHUNKINGS[chunking]

    def run(q, k, v, d, dl, options):
        out, pullback = aa.vjp(
            aa.scaled_dot_product_attention, q, k, v, enable_gqa=True, return_lse=True, **options
        )
        grads = pullback((d, dl))
        extra = [grads[-1]["sinks"]] if isinstance(grads[-1], dict) else []
        return [*out, *grads[:3], *extra]

    want = run(Q, K, V, D_OUT, D_LSE, option)
    lazy_options = {
        name: da.from_array(x) if isinstance(x, np.ndarray) else x for name, x in option.items()
    }
    with dask.config.set(scheduler=_no_compute):
        lazy = run(
            _dask(Q, qc),
            _dask(K, kc),
            _dask(V, vc),
            _dask(D_OUT, qc[:3] + (6,)),
            _dask(D_LSE, qc[:3]),
            lazy_options,
        )
    got = dask.compute(*lazy, scheduler="sync")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def _random_chunks(draw, st, n: int) -> tuple[int, ...]:
    """Chunk sizes summing to ``n``, uneven and possibly 1 (``(0,)`` for an empty axis)."""
    chunks, left = [], n
    while left > 0:
        c = draw(st.integers(1, left))
        chunks.append(c)
        left -= c
    return tuple(chunks) or (0,)


def test_random_calls_chunked_at_random_equal_numpy() -> None:
    """Hypothesis: whole attention calls drawn by ``arrayattn.testing.attention_calls``
    (every feature: masks with fully masked rows, both alignments, windows, softcap,
    GQA, broadcast leading dims, lengths, dropout, sinks, ALiBi, L or S of 0 and 1,
    adversarial values), every array chunked at random along every axis independently of
    the others (so the rechunking rule runs); outputs, LSE and gradients equal the
    one-process NumPy call."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    from arrayattn.testing import attention_calls, library_features

    features = set(library_features()) - {"low_precision"}  # float64 only: tight tolerances
    calls = attention_calls(xp="numpy", dtypes=("float64",), max_len=12, features=features)

    # 30 examples in CI (~4 s); ARRAYATTN_WIDE_SWEEP=1 draws 400 (~1 min).
    examples = 400 if os.environ.get("ARRAYATTN_WIDE_SWEEP") else 30

    @hypothesis.settings(max_examples=examples, deadline=None, database=None)
    @hypothesis.given(calls, st.data())
    def check(call, data) -> None:
        def lazy(x: Any) -> Any:
            if not isinstance(x, np.ndarray):
                return x
            chunks = tuple(_random_chunks(data.draw, st, n) for n in x.shape)
            return da.from_array(x, chunks=chunks)

        q, k, v, mask = call.arrays("numpy")
        options = call.kwargs("numpy")
        r = np.random.default_rng(0)
        (out, lse), pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, mask,
                                      return_lse=True, **options)  # fmt: skip
        d_out, d_lse = r.standard_normal(out.shape), r.standard_normal(lse.shape)
        want = [out, lse, *pullback((d_out, d_lse))]
        lazy_options = {name: lazy(value) for name, value in options.items()}
        (out_d, lse_d), pullback_d = aa.vjp(aa.scaled_dot_product_attention, lazy(q), lazy(k),
                                            lazy(v), lazy(mask), return_lse=True,
                                            **lazy_options)  # fmt: skip
        got = [out_d, lse_d, *pullback_d((da.from_array(d_out), da.from_array(d_lse)))]
        assert len(got) == len(want), call.describe()
        for w, x in zip(want, got, strict=True):
            if isinstance(w, dict):  # the keyword gradients (sinks)
                assert set(w) == set(x), call.describe()
                pairs = [(w[name], x[name]) for name in w]
            elif w is None:
                assert x is None, call.describe()
                continue
            else:
                pairs = [(w, x)]
            for a, b in pairs:
                np.testing.assert_allclose(np.asarray(b), a, rtol=1e-9, atol=1e-10,
                                           err_msg=call.describe())  # fmt: skip

    check()


@pytest.mark.parametrize("L_, S_", [(0, 0), (0, 3), (3, 0)])
def test_empty_sequences_with_a_mask_equal_numpy(L_: int, S_: int) -> None:
    """Regression: an empty query or key axis with a mask broadcast over batch and heads
    (the mask's empty axis kept its own ``(0,)`` chunks, not ``(1,)``)."""
    r = np.random.default_rng(3)
    q, k, v = (
        r.standard_normal((1, 2, L_, 4)),
        r.standard_normal((1, 1, S_, 4)),
        r.standard_normal((1, 1, S_, 4)),
    )
    mask = r.random((L_, S_)) > 0.5
    want = aa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, return_lse=True)
    got = aa.scaled_dot_product_attention(
        *(da.from_array(x) for x in (q, k, v, mask)), enable_gqa=True, return_lse=True
    )
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), w)


def _ulps(got: Any, want: np.ndarray) -> float:
    """Largest difference in units of the last place of ``want``'s dtype."""
    ulp = np.spacing(np.abs(want)).astype(np.float64)
    return float(np.max(np.abs(np.asarray(got).astype(np.float64) - want) / ulp))


def test_float16_partials_are_merged_and_summed_in_float32() -> None:
    """float16 calls over several key and query blocks equal the one-process NumPy call
    to within two units in the last place of each element, forward and gradients:
    partial outputs and partial gradients stay in float32 until the final merge or sum
    (as FlashAttention's split-KV and dQ accumulators do). Rounding each block's results
    to float16 first was 8 (output) to 174 (dV) units off on these values (large |V|,
    sums that cancel), with twice the one-process call's error against float64."""
    r = np.random.default_rng(5)
    q = (r.standard_normal((1, 2, 16, 8)) * 0.1).astype(np.float16)
    k = r.standard_normal((1, 2, 64, 8)).astype(np.float16)
    v = (r.standard_normal((1, 2, 64, 8)) * 1e4).astype(np.float16)
    d_out = r.standard_normal((1, 2, 16, 8)).astype(np.float16)
    want_out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v)
    want = [want_out, *pullback(d_out)]
    # Over the sequence (partials merged and summed), and over heads (one part each).
    for q_chunks, kv_chunks in (((1, 2, 8, 8), (1, 2, 8, 8)), ((1, 1, 16, 8), (1, 1, 64, 8))):
        lazy = [
            da.from_array(x, chunks=c) for x, c in ((q, q_chunks), (k, kv_chunks), (v, kv_chunks))
        ]
        got_out, pullback_d = aa.vjp(aa.scaled_dot_product_attention, *lazy)
        got = [got_out, *pullback_d(da.from_array(d_out, chunks=q_chunks))]
        for w, g in zip(want, got, strict=True):
            computed = np.asarray(g)  # the chunks' own dtype, not only the graph's
            assert g.dtype == computed.dtype == w.dtype == np.float16
            assert _ulps(computed, w) <= 2.0


@pytest.mark.parametrize("arg", ["query", "key", "attn_mask"])
def test_unknown_chunk_sizes_are_named_with_the_fix(arg: str) -> None:
    # Boolean indexing (or dask.dataframe's to_dask_array) leaves NaN sizes: the plan needs
    # sizes, so the error names the argument and Dask's own remedy, before any graph.
    rng = np.random.default_rng(0)
    x = da.from_array(rng.standard_normal((2, 2, 8, 4)), chunks=(1, 1, 4, 4))
    mask = da.ones((2, 2, 8, 8), dtype=bool, chunks=(1, 1, 4, 4))
    args = {"query": x, "key": x, "value": x, "attn_mask": mask}
    unknown = args[arg][args[arg].sum(axis=(1, 2, 3)) > -np.inf]
    assert math.isnan(unknown.shape[0])
    args[arg] = unknown
    with pytest.raises(
        ValueError,
        match=rf"{arg} has unknown size along axis 0.*"
        rf"{arg}\.compute_chunk_sizes\(\)",
    ):
        aa.scaled_dot_product_attention(**args)
    # ... and the remedy works.
    args[arg] = unknown.compute_chunk_sizes()
    out = aa.scaled_dot_product_attention(**args)
    ref = aa.scaled_dot_product_attention(
        x.compute(), x.compute(), x.compute(), attn_mask=mask.compute()
    )
    np.testing.assert_allclose(out.compute(), ref, rtol=0, atol=1e-12)
