"""Pickling and deep-copying what moves to Dask workers and subprocesses (issue 35):
``KVCache`` and ``PagedKVCache`` with their contents (they failed with "cannot pickle
'module'": they hold the array namespace), ``MultiHeadAttention`` and the other layers,
their parameters, and the testing kit's ``Backend``. After the round trip the copy
decodes bit-identically to the original, has its own lock and shares no buffer with it."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import array_api_compat
import numpy as np
import pytest

from arrayattn.nn import (
    MLP,
    Embedding,
    KVCache,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    PagedKVCache,
    RMSNorm,
)
from arrayattn.nn.attention import AttentionConfig
from arrayattn.testing import make_backend

ROOT = Path(__file__).resolve().parents[2]
MHA = MultiHeadAttention(
    16, 4, num_kv_heads=2, rope="half", causal=True, qk_norm="rms", rope_scaling=None
)
ROUND_TRIPS = {
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
    "deepcopy": copy.deepcopy,
}


def to_numpy(a):
    if array_api_compat.is_torch_array(a):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def state(cache) -> dict:
    """Everything a cache holds, as NumPy arrays and lists."""
    out = {"lengths": cache.lengths.tolist(), "dtype": str(cache.dtype)}
    out["keys"], out["values"] = to_numpy(cache.keys), to_numpy(cache.values)
    if isinstance(cache, PagedKVCache):
        out["tables"] = [list(t) for t in cache.block_tables]
        out["free"] = list(cache.free_pages)
    return out


def assert_same_state(a, b) -> None:
    sa, sb = state(a), state(b)
    for k in sa:
        if isinstance(sa[k], np.ndarray):
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
            assert sa[k].dtype == sb[k].dtype
        else:
            assert sa[k] == sb[k], k


def filled_cache(backend, kind):
    """A cache holding a ragged prefill and two decode steps, pages out of order."""
    xp = backend.xp
    p = {k: backend.asarray(v) for k, v in MHA.init(seed=0, xp=np, dtype=np.float64).items()}
    if kind == "contiguous":
        cache = MHA.new_cache(2, 12, xp=xp, device=backend.device)
    else:
        cache = MHA.new_paged_cache(2, num_pages=12, page_size=2, xp=xp, device=backend.device)
        np.random.default_rng(0).shuffle(cache.free_pages)
    rng = np.random.default_rng(1)
    MHA(p, backend.asarray(rng.standard_normal((2, 5, 16))), cache=cache, lengths=[5, 3])
    for _ in range(2):
        MHA(p, backend.asarray(rng.standard_normal((2, 1, 16))), cache=cache)
    return p, cache


def continue_decoding(backend, p, cache, steps=3):
    rng = np.random.default_rng(2)
    return [
        backend.to_numpy(MHA(p, backend.asarray(rng.standard_normal((2, 1, 16))), cache=cache))
        for _ in range(steps)
    ]


def check_round_trip(backend, kind, how):
    p, cache = filled_cache(backend, kind)
    twin = ROUND_TRIPS[how](cache)
    assert type(twin) is type(cache)
    assert twin.lock is not cache.lock
    assert twin.xp is cache.xp
    assert_same_state(twin, cache)
    p2 = ROUND_TRIPS[how](p)
    got, want = continue_decoding(backend, p2, twin), continue_decoding(backend, p, cache)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert_same_state(twin, cache)
    twin.reset()  # its own buffers and lengths: the original keeps its tokens
    assert cache.lengths.tolist() == [10, 8]


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_numpy_caches_round_trip_with_contents(kind, how):
    check_round_trip(make_backend("numpy"), kind, how)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_torch_caches_round_trip_with_contents(kind):
    pytest.importorskip("torch")
    check_round_trip(make_backend("torch"), kind, "pickle")


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_dask_caches_round_trip_with_contents(kind):
    pytest.importorskip("dask")
    check_round_trip(make_backend("dask"), kind, "pickle")


def test_jax_caches_round_trip_with_contents():
    """JAX arrays are immutable (appends build new buffers) and a JAX device object does
    not pickle: the copy takes its device from its buffers. (Appends only: a JAX module
    call compiles for seconds.)"""
    pytest.importorskip("jax")
    b = make_backend("jax")
    k = b.asarray(np.random.default_rng(0).standard_normal((2, 2, 3, 4)))
    caches = [
        KVCache.allocate(2, 2, 6, 4, xp=b.xp, dtype=b.xp.float64),
        PagedKVCache(batch_size=2, num_pages=4, page_size=2, num_kv_heads=2, head_dim=4,
                     xp=b.xp, dtype=b.xp.float64),
    ]  # fmt: skip
    for cache in caches:
        cache.append(k, -k, lengths=[3, 1])
        twin = pickle.loads(pickle.dumps(cache))
        assert twin.xp is cache.xp and twin.device == cache.device
        assert_same_state(twin, cache)
        for c in (twin, cache):
            c.append(k[:, :, :1], k[:, :, :1])
        assert_same_state(twin, cache)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_empty_caches_without_dtype_round_trip(kind):
    """A cache made without a dtype (buffers come with the first append) and one with no
    library yet (``xp=None``) pickle too, and fill as the original does."""
    for xp in (None, np):
        cache = MHA.new_cache(1, 4, xp=xp) if kind == "contiguous" else (
            MHA.new_paged_cache(1, 2, 2, xp=xp)
        )  # fmt: skip
        twin = pickle.loads(pickle.dumps(cache))
        p = MHA.init(seed=0, xp=np)
        x = np.ones((1, 2, 16), np.float32)
        np.testing.assert_array_equal(MHA(p, x, cache=twin), MHA(p, x, cache=cache))
        assert twin.dtype == cache.dtype == np.float32


def test_a_namespace_that_is_no_module_is_a_clear_pickling_error():
    fake = types.ModuleType("made_up_namespace")  # built at run time: not importable
    fake.asarray, fake.matmul = np.asarray, np.matmul
    cache = PagedKVCache(
        batch_size=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2, xp=fake
    )
    with pytest.raises(TypeError, match="not an importable module"):
        pickle.dumps(cache)


def test_layers_configurations_and_parameters_round_trip():
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    cfg = AttentionConfig(16, 4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    layers = [
        MHA,
        MultiHeadAttention(16, 4, rope="half", rope_scaling={"rope_type": "linear", "factor": 2.0}),
        Linear(16, 8),
        LayerNorm(16),
        RMSNorm(16),
        MLP(16, 32, activation="silu", gated=True),
    ]
    for layer in layers:
        p = layer.init(seed=0, xp=np)
        for how, trip in ROUND_TRIPS.items():
            layer2, p2 = trip(layer), trip(p)
            assert layer2 == layer and type(layer2) is type(layer), how
            np.testing.assert_array_equal(layer2(p2, x), layer(p, x))
    emb = Embedding(10, 4)
    pe = emb.init(seed=0, xp=np)
    ids = np.array([[1, 2, 3]])
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(emb))(pe, ids), emb(pe, ids))


def test_xp_that_is_no_namespace_is_a_clear_error():
    for bad in (types.SimpleNamespace(asarray=np.asarray, matmul=np.matmul), {"a": 1}, 3):
        with pytest.raises(TypeError, match="xp must be an array-API namespace"):
            KVCache.allocate(1, 1, 2, 2, xp=bad)


def test_cotangents_round_trip():
    """Gradients come back from workers: ``Cotangents`` (a tuple with attributes) pickles
    with all of them."""
    mha = MultiHeadAttention(8, 2, context_dim=6, value_context_dim=5)
    p = mha.init(seed=0, xp=np, dtype=np.float64)
    rng = np.random.default_rng(0)
    x, c, v = (
        rng.standard_normal((1, 2, 8)),
        rng.standard_normal((1, 3, 6)),
        rng.standard_normal((1, 3, 5)),
    )
    bias = rng.standard_normal((1, 2, 2, 3))
    y, pullback = mha.vjp(p, x, c, value=v, attn_mask=bias)
    g = pullback(np.ones_like(y))
    for trip in ROUND_TRIPS.values():
        g2 = trip(g)
        assert type(g2) is type(g) and len(g2) == 3
        for a, b in ((g2.x, g.x), (g2.context, g.context), (g2.value, g.value),
                     (g2.attn_mask, g.attn_mask)):  # fmt: skip
            np.testing.assert_array_equal(a, b)
        assert sorted(g2.params) == sorted(g.params)
        for k in g.params:
            np.testing.assert_array_equal(g2.params[k], g.params[k])


def test_testing_backend_pickles_by_name():
    for name in ("numpy", "array_api_strict"):
        if name == "array_api_strict":
            pytest.importorskip("array_api_strict")
        b = make_backend(name)
        b2 = pickle.loads(pickle.dumps(b))
        assert b2 == b and b2.xp is b.xp


def test_a_cache_decodes_on_in_a_subprocess():
    """Layer, parameters and a filled cache sent to a fresh interpreter by pickle: the
    step it decodes there, and the cache it sends back, equal this process's bit for
    bit."""
    backend = make_backend("numpy")
    for kind in ("contiguous", "paged"):
        p, cache = filled_cache(backend, kind)
        x = np.random.default_rng(3).standard_normal((2, 1, 16))
        child = (
            "import pickle, sys\n"
            "mha, p, cache, x = pickle.loads(sys.stdin.buffer.read())\n"
            "y = mha(p, x, cache=cache)\n"
            "sys.stdout.buffer.write(pickle.dumps((y, cache)))\n"
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        done = subprocess.run(
            [sys.executable, "-c", child],
            input=pickle.dumps((MHA, p, cache, x)),
            capture_output=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        y_child, cache_child = pickle.loads(done.stdout)
        np.testing.assert_array_equal(y_child, MHA(p, x, cache=cache))
        assert_same_state(cache_child, cache)
        assert isinstance(cache_child, KVCache if kind == "contiguous" else PagedKVCache)
