"""The NumPy fast path (``implementation="fast"``, what ``"auto"`` runs on NumPy) against a
plain float64 reference written here and against the composed path.

Tile sizes are shrunk per example (values that do and do not divide L and S) and the
thread pool is forced on, so that block edges, the online softmax over several key
blocks, causal/window block skipping and the threaded dK/dV/dQ accumulation are all
exercised on small shapes. NumPy only.
"""

from __future__ import annotations

import contextlib
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention import registry
from arrayattn.attention import threads as _fast_threads
from arrayattn.attention.fast import layout as fast
from arrayattn.attention.spec import make_spec
from arrayattn.ops import attention as attention_mod

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# Plain float64 reference (dense L x S, explicit repeat of K/V for GQA)
# ---------------------------------------------------------------------------------------
def _allowed(L, S, causal, align, window, q_len=None, kv_len=None):
    """``(L, S)`` "may attend" for one sequence; ``q_len``/``kv_len`` are its lengths."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ql = L if q_len is None else q_len
    kl = S if kv_len is None else kv_len
    lengths = q_len is not None or kv_len is not None
    offset = S - L if not lengths else kl - ql
    diag = i + (0 if align == "top_left" else offset)
    ok = (i < ql) & (j < kl)
    if causal:
        ok &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
    return ok


def _sum_to(x, shape):
    shape = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(a for a, (d, t) in enumerate(zip(shape, x.shape, strict=True)) if d != t)
    return x.sum(axis=axes, keepdims=True)


def reference(
    q,
    k,
    v,
    mask,
    d_out,
    d_lse,
    *,
    causal,
    align,
    window,
    softcap,
    p,
    keep,
    gqa,
    q_lengths=None,
    kv_lengths=None,
):
    """Output, LSE and (dq, dk, dv, dmask) in float64 for 4-D ``(B, H, L, E)`` inputs."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv if gqa else 1
    kk = np.repeat(k, G, axis=1) if gqa else np.broadcast_to(k, (B, Hq, S, E))
    vv = np.repeat(v, G, axis=1) if gqa else np.broadcast_to(v, (B, Hq, S, v.shape[-1]))
    scale = 1.0 / math.sqrt(E)
    raw = scale * (q @ np.swapaxes(kk, -1, -2))
    if softcap is not None:
        t = np.tanh(raw / softcap)
        s = softcap * t
    else:
        s = raw
    allowed = np.stack(
        [
            _allowed(
                L,
                S,
                causal,
                align,
                window,
                None if q_lengths is None else min(int(q_lengths[b]), L),
                None if kv_lengths is None else min(int(kv_lengths[b]), S),
            )
            for b in range(B)
        ]
    )[:, None]
    allowed = np.broadcast_to(allowed, s.shape)
    if mask is not None and mask.dtype == bool:
        allowed = allowed & mask
    elif mask is not None:
        s = s + np.asarray(mask, np.float64)
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    prob = e / np.where(total > 0, total, 1.0)
    lse = np.where(
        total[..., 0] > 0, m[..., 0] + np.log(np.where(total > 0, total, 1))[..., 0], -np.inf
    )
    drop = keep / (1 - p) if p > 0 else 1.0
    pd = prob * drop
    out = pd @ vv
    d_out = np.asarray(d_out, np.float64)
    dvv = np.swapaxes(pd, -1, -2) @ d_out
    dp = (d_out @ np.swapaxes(vv, -1, -2)) * drop
    ds = prob * (dp - (dp * prob).sum(axis=-1, keepdims=True))
    ds = ds + prob * np.asarray(d_lse, np.float64)[..., None]
    dmask = None
    if mask is not None and mask.dtype != bool:
        dmask = _sum_to(ds, mask.shape).reshape(mask.shape)
    if softcap is not None:
        ds = ds * (1 - t * t)
    ds = ds * scale
    dq = ds @ kk
    dkk = np.swapaxes(ds, -1, -2) @ q
    if gqa:
        dk = dkk.reshape(B, Hkv, G, S, E).sum(axis=2)
        dv = dvv.reshape(B, Hkv, G, S, -1).sum(axis=2)
    else:
        dk = _sum_to(dkk, k.shape)
        dv = _sum_to(dvv, v.shape)
    return out, lse, (dq, dk, dv, dmask)


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def tiles(fwd_rows, block_elements, bwd_rows, bwd_keys, threaded=True):
    """Shrink the fast path's tiles and force its thread pool for one example."""
    names = ("FWD_ROWS", "BLOCK_ELEMENTS", "BWD_ROWS", "BWD_KEYS", "_SERIAL_WORK")
    saved = {n: getattr(fast, n) for n in names}
    new = (fwd_rows, block_elements, bwd_rows, bwd_keys, 0 if threaded else saved["_SERIAL_WORK"])
    saved_threads = _fast_threads.num_threads
    try:
        for n, value in zip(names, new, strict=True):
            setattr(fast, n, value)
        if threaded:
            _fast_threads.num_threads = lambda: 2  # noqa: E731  (also on a 1-CPU machine)
        yield
    finally:
        for n, value in saved.items():
            setattr(fast, n, value)
        _fast_threads.num_threads = saved_threads


def run(impl, q, k, v, mask, d_out, d_lse, **kw):
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention,
        q,
        k,
        v,
        mask,
        return_lse=True,
        implementation=impl,
        **kw,
    )
    return out, lse, pullback((d_out, d_lse))


def assert_close(name, got, want, tol):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), f"{name}: non-finite entries differ"
    assert np.array_equal(got[~fin], want[~fin]), f"{name}: infinities differ"
    scale = max(1.0, float(np.max(np.abs(want[fin]), initial=0.0)))
    err = float(np.max(np.abs(got[fin] - want[fin]), initial=0.0))
    assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


TOL = {np.float64: 1e-9, np.float32: 2e-4, np.float16: 2e-2}


@st.composite
def cases(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 1, 2, 3]))
    L = draw(st.integers(1, 40))
    S = draw(st.integers(1, 48))
    E = draw(st.sampled_from([4, 8]))
    Ev = draw(st.sampled_from([4, 8]))
    mask_kind = draw(st.sampled_from([None, None, "bool", "float"]))
    mask_shape = draw(
        st.sampled_from([(L, S), (B, 1, L, S), (1, Hkv * G, L, S), (S,), (B, Hkv * G, L, 1)])
    )
    causal = draw(st.booleans())
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    window = draw(
        st.none()
        | st.tuples(st.integers(-1, 12), st.integers(-1, 12)).filter(lambda w: w != (-1, -1))
    )
    softcap = draw(st.sampled_from([None, None, 1.5]))
    p = draw(st.sampled_from([0.0, 0.0, 0.3]))
    dtype = draw(st.sampled_from([np.float64, np.float64, np.float32]))
    # Tiles: 1..17 rows, key blocks 1..33 (divisors of L/S and not).
    fwd_rows = draw(st.integers(1, 17))
    width = draw(st.integers(1, 33))
    tiling = (fwd_rows, fwd_rows * width, draw(st.integers(1, 17)), draw(st.integers(1, 33)))
    seed = draw(st.integers(0, 2**32 - 1))
    magnitude = draw(st.sampled_from([1.0, 1.0, 30.0]))  # 30: loose bound -> exact path
    lengths = draw(st.sampled_from([None, None, "q", "kv", "both"]))
    q_lengths = kv_lengths = None
    if lengths in ("q", "both"):
        q_lengths = np.array(draw(st.lists(st.integers(0, L + 2), min_size=B, max_size=B)))
    if lengths in ("kv", "both"):
        kv_lengths = np.array(draw(st.lists(st.integers(0, S + 2), min_size=B, max_size=B)))
    return dict(
        B=B,
        Hkv=Hkv,
        G=G,
        L=L,
        S=S,
        E=E,
        Ev=Ev,
        mask_kind=mask_kind,
        mask_shape=mask_shape,
        causal=causal,
        align=align,
        window=window,
        softcap=softcap,
        p=p,
        dtype=dtype,
        tiling=tiling,
        seed=seed,
        magnitude=magnitude,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
    )


def make_inputs(c):
    rng = np.random.default_rng(c["seed"])
    Hq = c["Hkv"] * c["G"]
    dt = c["dtype"]
    q = (rng.standard_normal((c["B"], Hq, c["L"], c["E"])) * c["magnitude"]).astype(dt)
    k = rng.standard_normal((c["B"], c["Hkv"], c["S"], c["E"])).astype(dt)
    v = rng.standard_normal((c["B"], c["Hkv"], c["S"], c["Ev"])).astype(dt)
    mask = None
    if c["mask_kind"] == "bool":
        mask = rng.random(c["mask_shape"]) > 0.3
    elif c["mask_kind"] == "float":
        mask = (rng.standard_normal(c["mask_shape"]) * 2).astype(dt)
        mask[rng.random(c["mask_shape"]) < 0.1] = -np.inf
    d_out = rng.standard_normal((c["B"], Hq, c["L"], c["Ev"])).astype(dt)
    d_lse = rng.standard_normal((c["B"], Hq, c["L"])).astype(
        np.float64 if dt == np.float64 else np.float32
    )
    return q, k, v, mask, d_out, d_lse


def options(c):
    return dict(
        is_causal=c["causal"],
        causal_align=c["align"],
        window=c["window"],
        softcap=c["softcap"],
        dropout_p=c["p"],
        seed=c["seed"] % 1000,
        enable_gqa=c["G"] > 1,
        q_lengths=c["q_lengths"],
        kv_lengths=c["kv_lengths"],
    )


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------
@SETTINGS
@given(cases())
def test_fast_matches_reference_and_composed_forward_and_backward(c):
    q, k, v, mask, d_out, d_lse = make_inputs(c)
    kw = options(c)
    with tiles(*c["tiling"]):
        out, lse, grads = run("fast", q, k, v, mask, d_out, d_lse, **kw)
    assert out.dtype == q.dtype and lse.dtype == d_lse.dtype
    keep = None
    if c["p"] > 0:
        keep = aa.dropout_mask(q, k, c["p"], kw["seed"], enable_gqa=kw["enable_gqa"])
    r_out, r_lse, r_grads = reference(
        q,
        k,
        v,
        mask,
        d_out,
        d_lse,
        causal=c["causal"],
        align=c["align"],
        window=c["window"],
        softcap=c["softcap"],
        p=c["p"],
        keep=keep,
        gqa=c["G"] > 1,
        q_lengths=c["q_lengths"],
        kv_lengths=c["kv_lengths"],
    )
    tol = TOL[c["dtype"]]
    assert_close("out", out, r_out, tol)
    assert_close("lse", lse, r_lse, tol)
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3], strict=True):
        assert_close(name, g, r, tol * 5)
    if r_grads[3] is None:
        assert grads[3] is None
    else:
        assert_close("dmask", grads[3], r_grads[3], tol * 5)

    c_out, c_lse, c_grads = run("composed", q, k, v, mask, d_out, d_lse, **kw)
    assert_close("out vs composed", out, c_out, tol)
    assert_close("lse vs composed", lse, c_lse, tol)
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], c_grads[:3], strict=True):
        assert_close(f"{name} vs composed", g, r, tol * 5)


@pytest.mark.parametrize("tiling", [(4, 4 * 8, 4, 8), (7, 7 * 5, 6, 9)])
def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_gradients(tiling):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 12, 8))
    k = rng.standard_normal((1, 2, 9, 8))
    v = rng.standard_normal((1, 2, 9, 8))
    mask = np.ones((12, 9), dtype=bool)
    mask[5] = False  # a row with no key
    d_out = np.ones_like(q)
    d_lse = np.zeros((1, 2, 12))
    # bottom_right with L > S: rows 0..2 see nothing either.
    with tiles(*tiling):
        out, lse, (dq, dk, dv, _) = run(
            "fast", q, k, v, mask, d_out, d_lse, is_causal=True, causal_align="bottom_right"
        )
    empty = [0, 1, 2, 5]
    assert np.all(out[:, :, empty] == 0)
    assert np.all(lse[:, :, empty] == -np.inf)
    assert np.all(dq[:, :, empty] == 0)
    assert np.isfinite(out).all() and np.isfinite(dq).all() and np.isfinite(dk).all()
    assert np.isfinite(dv).all()
    assert np.isfinite(lse[:, :, [3, 4, 6]]).all()


def test_broadcast_leading_dims_and_shared_kv_head():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, 1, 4, 10, 8))  # 5-D, broadcast against key's lead
    k = rng.standard_normal((1, 2, 1, 13, 8))  # one KV head, no GQA: plain broadcasting
    v = rng.standard_normal((1, 2, 1, 13, 6))
    mask = rng.standard_normal((2, 1, 10, 13))
    d_out = rng.standard_normal((3, 2, 4, 10, 6))
    d_lse = rng.standard_normal((3, 2, 4, 10))
    with tiles(3, 3 * 4, 4, 5):
        got = run("fast", q, k, v, mask, d_out, d_lse, is_causal=True)
    want = run("composed", q, k, v, mask, d_out, d_lse, is_causal=True)
    for name, a, b in zip(("out", "lse"), got[:2], want[:2], strict=True):
        assert_close(name, a, b, 1e-10)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), got[2], want[2], strict=True):
        assert a.shape == b.shape, name
        assert_close(name, a, b, 1e-10)


def test_float16_inputs_compute_in_float32():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 33, 16)).astype(np.float16) for _ in range(3))
    out, lse = aa.scaled_dot_product_attention(q, k, v, return_lse=True, implementation="fast")
    assert out.dtype == np.float16 and lse.dtype == np.float32
    r_out, r_lse, _ = reference(
        q,
        k,
        v,
        None,
        np.zeros_like(q),
        np.zeros((1, 2, 33)),
        causal=False,
        align="top_left",
        window=None,
        softcap=None,
        p=0.0,
        keep=None,
        gqa=False,
    )
    assert_close("out", out, r_out, 3e-3)
    assert_close("lse", lse, r_lse, 1e-5)


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 5, 4))
    k = rng.standard_normal((1, 1, 7, 4))
    v = rng.standard_normal((1, 1, 7, 3))
    d_out = rng.standard_normal((1, 2, 5, 3))
    kw = dict(is_causal=True, causal_align="bottom_right", softcap=2.0, enable_gqa=True)

    def loss(q_, k_, v_):
        out = aa.scaled_dot_product_attention(q_, k_, v_, implementation="fast", **kw)
        return float(np.sum(out * d_out))

    _, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="fast", **kw)
    grads = pullback(d_out)
    eps = 1e-6
    for i, x in enumerate((q, k, v)):
        num = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[i][idx] += eps
            up = loss(*args)
            args[i][idx] -= 2 * eps
            num[idx] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(grads[i], num, atol=1e-7, rtol=1e-6)


def test_auto_uses_fast_on_numpy_and_fast_declines_other_libraries():
    # A prefill-sized call: the cost model picks the fast path (tiny ones go composed).
    q = np.broadcast_to(np.float32(0), (1, 8, 1024, 64))
    spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None)
    assert registry.select(spec, "auto") is registry.registered("fast").impl
    assert attention_mod.auto_choice(spec) == "fast"
    q = np.zeros((1, 1, 4, 8), dtype=np.float32)
    strict = pytest.importorskip("array_api_strict")
    qs = strict.asarray(q)
    with pytest.raises(ValueError, match="NumPy arrays and PyTorch CPU tensors only"):
        aa.scaled_dot_product_attention(qs, qs, qs, implementation="fast")
    spec_s = make_spec(qs, qs, qs, None, 0.0, False, None, False, "top_left", None, None, None)
    assert attention_mod.auto_choice(spec_s) != "fast"


def test_fast_path_never_allocates_an_l_by_s_buffer(monkeypatch):
    # Each worker thread holds its own score tile (rows x S), so the workspace grows with
    # the threads: pinned to 2 here, or a 16-core machine's 16 tiles (13.4 MiB, seen on
    # the H200 machine's CPU, 2026-11-26) pass for an L x S buffer (16 MiB).
    monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
    L = S = 2048
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 1, L, 16), dtype=np.float32) for _ in range(3))
    d_out = np.ones_like(q)
    # A first call imports lazily loaded modules (threadpoolctl and what it pulls in),
    # megabytes that are not buffers; measure a second call.
    _, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="fast")
    pullback(d_out)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        _, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="fast")
        pullback(d_out)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < L * S * 4 / 4, f"peak {peak / 2**20:.1f} MiB looks like an L x S buffer"


def test_static_and_exact_softmax_paths_agree_on_large_scores():
    # Scores far beyond exp's float32 range force the exact (running max) path; a
    # mildly scaled copy takes the static path; both must match the reference.
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 50, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    for factor in (1.0, 200.0):
        qq = q * factor
        with tiles(8, 8 * 16, 8, 16):
            out, lse = aa.scaled_dot_product_attention(
                qq, k, v, return_lse=True, implementation="fast"
            )
        r_out, r_lse, _ = reference(
            qq,
            k,
            v,
            None,
            np.zeros_like(qq),
            np.zeros((1, 2, 50)),
            causal=False,
            align="top_left",
            window=None,
            softcap=None,
            p=0.0,
            keep=None,
            gqa=False,
        )
        assert np.isfinite(out).all()
        assert_close(f"out x{factor}", out, r_out, 2e-4)
        assert_close(f"lse x{factor}", lse, r_lse, 2e-5 * factor)


def test_concurrent_calls_restore_the_blas_thread_count():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import threading

    def blas_threads():
        return [
            i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"
        ]

    before = blas_threads()
    q = np.ones((1, 4, 300, 8), dtype=np.float32)
    results = []

    def call():
        results.append(aa.scaled_dot_product_attention(q, q, q, implementation="fast"))

    with tiles(16, 16 * 32, 16, 32):  # many tiles: the pool (and the BLAS limit) is used
        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 4
    assert blas_threads() == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finfo_min_bias_rows_backward_is_renormalised(dtype):
    # Hugging Face masks fully masked rows with finfo.min: the saved LSE swallows
    # log(rowsum), so exp(S - LSE) alone would sum to S on those rows, not 1.
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 9, 4)).astype(dtype)
    k = rng.standard_normal((1, 2, 23, 4)).astype(dtype)
    v = rng.standard_normal((1, 2, 23, 4)).astype(dtype)
    bias = np.zeros((9, 23), dtype=dtype)
    bias[[0, 4]] = np.finfo(dtype).min
    with tiles(4, 4 * 5, 4, 5):
        out, pullback = aa.vjp(
            aa.scaled_dot_product_attention, q, k, v, bias, implementation="fast"
        )
        dq, dk, dv, dbias = pullback(np.ones_like(out))
    # d_value = P^T @ 1: its column sums are P's row sums, 1 per query row.
    np.testing.assert_allclose(dv.sum(axis=(0, 2))[:, 0], [9.0, 9.0], rtol=1e-5)
    np.testing.assert_allclose(out[0, :, 0], v[0].mean(axis=1), rtol=1e-5)
    want = run("composed", q, k, v, bias, np.ones_like(out), np.zeros((1, 2, 9), dtype))[2]
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want, strict=True):
        assert_close(name, a, b, TOL[dtype] * 5)


def _off_by_one_byte(x: np.ndarray) -> np.ndarray:
    """A copy of ``x`` whose data starts one byte past an aligned address (as Dask hands
    out the chunks of an array embedded in its graph)."""
    raw = np.zeros(x.nbytes + 1, dtype=np.uint8)
    y = raw[1:].view(x.dtype).reshape(x.shape)
    y[...] = x
    assert not y.flags.aligned
    return y


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_unaligned_inputs_give_the_aligned_results_bit_for_bit(dtype):
    rng = np.random.default_rng(11)
    q, k, v, d_out = (rng.standard_normal((2, 2, 37, 8)).astype(dtype) for _ in range(4))
    odd = [_off_by_one_byte(x) for x in (q, k, v, d_out)]
    kept = [x.copy() for x in odd]

    def call(q, k, v, d_out):
        with tiles(8, 8 * 16, 8, 16):
            (out, lse), pullback = aa.vjp(
                aa.scaled_dot_product_attention,
                q,
                k,
                v,
                is_causal=True,
                return_lse=True,
                implementation="fast",
            )
            return out, lse, *pullback((d_out, np.zeros_like(lse)))

    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, call(*odd), call(q, k, v, d_out), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    for x, y in zip(odd, kept, strict=True):  # inputs never modified
        np.testing.assert_array_equal(x, y)
    spec = make_spec(*odd[:3], None, 0.0, True, None, False, "top_left", None, None, None)
    lay = fast._Layout(spec, *odd[:3], None)
    assert all(a.flags.aligned for a in lay._raw.values())


@pytest.mark.parametrize("causal", [False, True])
def test_operand_layout_does_not_change_the_bits(causal):
    """Broadcast (stride-0) and strided views give the bits of their contiguous copies,
    forward and backward. NumPy runs a product with a stride-0 operand outside BLAS and
    rounds differently; on Dask a ``da.ones_like`` cotangent chunk is such a view where it
    is made and contiguous where it is received, which made dQ/dK vary run to run."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 96, 32)).astype(np.float32) for _ in range(3))
    ones = np.broadcast_to(np.float32(1), q.shape)  # what da.ones_like hands a task
    row = np.broadcast_to(q[:, :, :1], q.shape)  # every query row the same, stride 0
    wide = np.zeros((1, 2, 96, 64), np.float32)
    wide[..., ::2] = k  # a view with feature stride 2
    k_strided = wide[..., ::2]

    def run(q_, k_, d_out):
        out, pullback = aa.vjp(
            aa.scaled_dot_product_attention, q_, k_, v, is_causal=causal, implementation="fast"
        )
        return [out, *pullback(d_out)[:3]]

    for args in ((q, k, ones), (row, k, ones), (q, k_strided, ones)):
        got = run(*args)
        want = run(*(np.ascontiguousarray(a) for a in args))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
