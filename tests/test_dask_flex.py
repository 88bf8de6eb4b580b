"""The Dask path with ``arrayattn.flex``: block masks, mask_mods and score_mods over Dask
arrays cut along the query and key axes (chunks not aligned to the block mask's blocks)
equal the one-process NumPy composed call, forward (output, LSE) and backward (inputs
and the score_mod's bias table), and the graph has no task for a (query chunk, key
chunk) pair whose blocks the block mask says are all empty."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.flex import (
    create_block_mask,
    document_mask,
    global_tokens_mask,
    or_masks,
    prefix_lm_mask,
    relative_position_bias,
    sliding_window_mask,
)

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

TOL = 1e-12
rng = np.random.default_rng(29)
B, HQ, HKV, L, E, EV = 2, 4, 2, 45, 8, 6
# Query and key chunks that cross the block mask's 8-wide blocks.
Q_CHUNKS, KV_CHUNKS = (13, 9, 16, 7), (10, 17, 11, 7)
TABLE = rng.standard_normal((32, HQ))

# Packed documents, different per batch row (so batch chunks reach different pairs).
DOC_IDS = np.stack([np.repeat(np.arange(4), [11, 6, 20, 8]), np.repeat(np.arange(3), [19, 19, 7])])


def _case(name: str) -> tuple[Any, dict[str, Any]]:
    """``(mask_mod, extra options)`` of a named case."""
    if name == "document causal":
        return document_mask(DOC_IDS, causal=True), {}
    if name == "prefix-LM":
        return prefix_lm_mask(np.array([12, 3])), {}
    if name == "window + global":
        return or_masks(sliding_window_mask(6, 0), global_tokens_mask(3)), {}
    raise AssertionError(name)


def _operands(s: int = L) -> tuple[np.ndarray, ...]:
    q = rng.standard_normal((B, HQ, L, E))
    k = rng.standard_normal((B, HKV, s, E))
    v = rng.standard_normal((B, HKV, s, EV))
    d_out = rng.standard_normal((B, HQ, L, EV))
    d_lse = rng.standard_normal((B, HQ, L))
    return q, k, v, d_out, d_lse


def _dask(a: np.ndarray, seq: tuple[int, ...]) -> Any:
    return da.from_array(a, chunks=(1, 2) + (seq,) + a.shape[3:])


def _vjp(q, k, v, d_out, d_lse, **options):
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, return_lse=True, **options
    )
    grads = pullback((d_out, d_lse))
    return out, lse, grads[0], grads[1], grads[2], grads[-1]["score_mod"][0]


def _close(got: Any, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape, what
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), what
    assert np.array_equal(want[~fin], got[~fin]), what
    np.testing.assert_allclose(got[fin], want[fin], rtol=TOL, atol=TOL, err_msg=what)


@pytest.mark.parametrize(
    "name, alone",
    [
        ("document causal", False),
        ("prefix-LM", False),
        ("window + global", False),
        ("window + global", True),  # the mask_mod alone: the call classifies it
    ],
)
def test_flex_matches_numpy_composed(name: str, alone: bool) -> None:
    mod, extra = _case(name)
    given = (
        {"mask_mod": mod}
        if alone
        else {"block_mask": create_block_mask(mod, B, None, L, L, block_size=8)}
    )
    q, k, v, d_out, d_lse = _operands()
    options = dict(given, score_mod=relative_position_bias(TABLE), enable_gqa=True)
    options.update(extra)
    want = _vjp(q, k, v, d_out, d_lse, implementation="composed", **options)
    dq, dk, dv = _dask(q, Q_CHUNKS), _dask(k, KV_CHUNKS), _dask(v, KV_CHUNKS)
    with dask.config.set(scheduler="sync"):
        got = _vjp(dq, dk, dv, _dask(d_out, Q_CHUNKS), _dask(d_lse, Q_CHUNKS), **options)
        assert all(isinstance(g, da.Array) for g in got)  # lazy, the table's too
        got = dask.compute(*got)
    for w, g, what in zip(want, got, ["out", "lse", "dq", "dk", "dv", "table"], strict=True):
        _close(g, w, f"{name}: {what}")


def test_rows_without_any_task_are_empty_or_sink() -> None:
    """Cross-attention documents where the last queries' document has no keys: their query
    chunk gets no block task at all, and still comes out as output 0 and the sink's LSE
    (-inf without sinks)."""
    s = 34
    q_ids = np.concatenate([np.repeat([0, 1], [12, 18]), np.full(L - 30, 7)])
    kv_ids = np.repeat([0, 1], [15, s - 15])
    bm = create_block_mask(document_mask(q_ids, kv_ids), B, None, L, s, block_size=(5, 8))
    q, k, v, d_out, d_lse = _operands(s)
    sinks = rng.standard_normal(HQ)
    q_chunks, kv_chunks = (13, 17, 15), (10, 17, 7)
    for extra in ({}, {"sinks": sinks}):
        options = dict(block_mask=bm, score_mod=relative_position_bias(TABLE), enable_gqa=True)
        options.update(extra)
        want = _vjp(q, k, v, d_out, d_lse, implementation="composed", **options)
        dq, dk, dv = _dask(q, q_chunks), _dask(k, kv_chunks), _dask(v, kv_chunks)
        with dask.config.set(scheduler="sync"):
            if "sinks" in options:
                options["sinks"] = da.from_array(sinks, chunks=2)
            got = _vjp(dq, dk, dv, _dask(d_out, q_chunks), _dask(d_lse, q_chunks), **options)
            graph = dict(got[0].__dask_graph__())
            got = dask.compute(*got)
        blocks = _block_keys(graph, ("attn-blocks-", "attn-edge-blocks-"))
        assert blocks and not any(k_[-2] == 2 for k_ in blocks)  # last query chunk: none
        assert np.all(got[0][:, :, 30:] == 0)
        for w, g, what in zip(want, got, ["out", "lse", "dq", "dk", "dv", "table"], strict=True):
            _close(g, w, f"{sorted(extra)}: {what}")


def _block_keys(graph: dict, prefixes: tuple[str, ...]) -> list[tuple]:
    """The per-pair block tasks ``(name, batch chunk, head chunk, i, j)`` of ``prefixes``."""
    return [
        k
        for k in graph
        if isinstance(k, tuple)
        and len(k) == 5
        and str(k[0]).startswith(prefixes)
        and not str(k[0]).endswith("-total")
    ]


def test_packed_documents_build_no_task_for_empty_pairs() -> None:
    """Packed batch of 6 documents in L = 96, chunks of 16 (block mask blocks of 8): the
    forward, the backward and the score_mod's gradient each have one task per pair the
    block mask leaves non-empty, none for the others, and fewer than the same call
    without it (causal, or no mask)."""
    n, chunk = 96, 16
    ids = np.repeat(np.arange(6), [10, 22, 14, 20, 12, 18])
    mod = document_mask(ids, causal=True)
    bm = create_block_mask(mod, None, None, n, n, block_size=8)
    x = da.from_array(rng.standard_normal((1, 2, n, E)), chunks=(1, 1, chunk, E))
    table = relative_position_bias(TABLE[:, :2])

    def graphs(**options):
        (out, lse), pullback = aa.vjp(
            aa.scaled_dot_product_attention, x, x, x, return_lse=True, **options
        )
        grads = pullback((da.ones_like(out), da.zeros_like(lse)))
        fwd = dict(out.__dask_graph__())
        bwd = {}
        for g in grads[:3]:
            bwd.update(dict(g.__dask_graph__()))
        smod = dict(grads[-1]["score_mod"][0].__dask_graph__()) if "score_mod" in options else {}
        return fwd, bwd, smod

    fwd, bwd, smod = graphs(block_mask=bm, score_mod=table)
    fwd_blocks = _block_keys(fwd, ("attn-blocks-", "attn-edge-blocks-"))
    bwd_blocks = _block_keys(bwd, ("attn-bwd-",))
    smod_blocks = _block_keys(smod, ("attn-smod-",))
    nonempty = {
        (i, j)
        for i in range(n // chunk)
        for j in range(n // chunk)
        if bm.tile_kind(None, None, i * chunk, (i + 1) * chunk, j * chunk, (j + 1) * chunk)
    }
    for keys in (fwd_blocks, bwd_blocks, smod_blocks):
        pairs = [k[-2:] for k in keys]
        assert len(pairs) == 2 * len(nonempty)  # two head chunks
        assert set(pairs) == nonempty
    assert len(nonempty) < (n // chunk) * (n // chunk + 1) // 2  # fewer than causal's
    causal_fwd, causal_bwd, _ = graphs(is_causal=True)
    plain_fwd, plain_bwd, _ = graphs()
    assert len(fwd) < len(causal_fwd) < len(plain_fwd)
    assert len(bwd) < len(causal_bwd) < len(plain_bwd)
    causal_blocks = _block_keys(causal_fwd, ("attn-blocks-", "attn-edge-blocks-"))
    assert len(fwd_blocks) < len(causal_blocks)
    # The graphs of different masks (or none) never share a block task's key.
    assert not set(fwd_blocks) & set(causal_blocks)


def test_full_pairs_run_without_the_mask_mod() -> None:
    """A pair whose blocks are all full (and no score_mod) hands its chunk a spec without
    the mask_mod, so the chunk's fastest path takes it; the result is unchanged."""
    n, chunk = 64, 16
    ids = np.repeat(np.arange(3), [32, 16, 16])  # documents on chunk boundaries
    bm = create_block_mask(document_mask(ids), None, None, n, n, block_size=8)
    x = rng.standard_normal((1, 2, n, E))
    want = aa.scaled_dot_product_attention(x, x, x, block_mask=bm, implementation="composed")
    dx = da.from_array(x, chunks=(1, 1, chunk, E))
    out = aa.scaled_dot_product_attention(dx, dx, dx, block_mask=bm)
    blocks = _block_keys(dict(out.__dask_graph__()), ("attn-blocks-", "attn-edge-blocks-"))
    graph = dict(out.__dask_graph__())
    flex_of = {k[-2:]: graph[k][1].call.flex for k in blocks}
    assert sorted(flex_of) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (3, 3)]
    assert all(f is None for f in flex_of.values())  # every pair is full here
    with dask.config.set(scheduler="sync"):
        _close(out.compute(), want, "out")


def test_dask_score_mod_table_is_refused() -> None:
    """Each block applies the score_mod to its chunk: a Dask table cannot be read there."""
    from arrayattn.attention.dask import declines
    from arrayattn.attention.spec import make_spec

    x = da.ones((1, 2, 8, 4), chunks=(1, 1, 4, 4))
    smod = relative_position_bias(da.zeros((32, 2)))
    spec = make_spec(
        x, x, x, None, 0.0, False, None, False, "top_left", None, None, None, score_mod=smod
    )
    assert "score_mod" in (declines(spec) or "")
