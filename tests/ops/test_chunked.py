"""The chunked path (online softmax over key blocks) against the composed path and the
float64 reference, forward and backward, on every backend."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from _helpers import check_vjp_fd, xp_assert_close
from _reference import attention as reference_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention import chunked
from arrayattn.attention import composed as _composed
from arrayattn.attention import static_shift as _static_shift
from arrayattn.attention.registry import _REGISTRY, auto_choice
from arrayattn.attention.registry import select as _select
from arrayattn.attention.spec import make_spec

SETTINGS = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# JAX runs each new block shape through its compiler op by op: far too slow for property
# tests; it runs the fixed case (test_fixed_case_every_backend) instead.
SLOW_BACKENDS = ("jax",)


def skip_slow(backend) -> None:
    if backend.name in SLOW_BACKENDS:
        pytest.skip(f"{backend.name}: property tests too slow op by op; see the fixed case")


# Mask layouts: full, broadcast over L, broadcast over S, 2-D.
MASK_LAYOUTS = ("full", "over_L", "over_S", "2d")


def _mask_shape(layout: str, B: int, Hq: int, L: int, S: int) -> tuple[int, ...]:
    return {
        "full": (B, Hq, L, S),
        "over_L": (B, 1, 1, S),
        "over_S": (Hq, L, 1),
        "2d": (L, S),
    }[layout]


@st.composite
def cases(draw):
    """Shapes, options and block sizes (dividing L and S or not)."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    L = draw(st.integers(1, 9))
    S = draw(st.integers(1, 10))
    window = draw(
        st.none()
        | st.tuples(st.integers(-1, 3), st.integers(-1, 3)).filter(lambda w: w != (-1, -1))
    )
    return dict(
        B=B,
        Hkv=Hkv,
        Hq=Hkv * G,
        L=L,
        S=S,
        E=draw(st.integers(1, 4)),
        Ev=draw(st.integers(1, 3)),
        mask=draw(st.sampled_from((None, "bool", "float"))),
        layout=draw(st.sampled_from(MASK_LAYOUTS)),
        is_causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(("top_left", "bottom_right"))),
        window=window,
        softcap=draw(st.sampled_from((None, 1.5))),
        dropout_p=draw(st.sampled_from((0.0, 0.0, 0.3))),
        block_q=draw(st.integers(1, 6)),
        block_k=draw(st.integers(1, 7)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _inputs(c: dict, rng: np.random.Generator):
    B, Hq, Hkv, L, S = c["B"], c["Hq"], c["Hkv"], c["L"], c["S"]
    q = rng.standard_normal((B, Hq, L, c["E"]))
    k = rng.standard_normal((B, Hkv, S, c["E"]))
    v = rng.standard_normal((B, Hkv, S, c["Ev"]))
    m = None
    shape = _mask_shape(c["layout"], B, Hq, L, S)
    if c["mask"] == "bool":
        m = rng.random(shape) < 0.6  # often leaves rows with no key: empty rows
    elif c["mask"] == "float":
        m = rng.standard_normal(shape)
    return q, k, v, m


def _spec(c: dict, q, k, v, m):
    return make_spec(
        q,
        k,
        v,
        m,
        c["dropout_p"],
        c["is_causal"],
        None,
        c["Hq"] != c["Hkv"],
        c["causal_align"],
        c["window"],
        c["softcap"],
        c["seed"],
    )


def _reference(c: dict, q, k, v, m):
    keep = None
    if c["dropout_p"] > 0:
        keep = aa.dropout_mask(q, k, c["dropout_p"], c["seed"], enable_gqa=c["Hq"] != c["Hkv"])
    out, lse, _ = reference_attention(
        q,
        k,
        v,
        m,
        is_causal=c["is_causal"],
        causal_align=c["causal_align"],
        window=c["window"],
        softcap=c["softcap"],
        enable_gqa=c["Hq"] != c["Hkv"],
        dropout_p=c["dropout_p"],
        keep=keep,
    )
    return out, lse


@pytest.mark.parametrize("static_min_rows", [None, 1])
@SETTINGS
@given(c=cases())
def test_forward_matches_composed_and_reference(backend, c, static_min_rows, monkeypatch):
    # static_min_rows=1: these small calls take the static shift where the bound allows.
    skip_slow(backend)
    if static_min_rows is not None:
        monkeypatch.setattr(_static_shift, "MIN_ROWS", static_min_rows)
    rng = np.random.default_rng(c["seed"] % 1000)
    arrays = _inputs(c, rng)
    exp_out, exp_lse = _reference(c, *arrays)
    q, k, v, m = (None if a is None else backend.asarray(a) for a in arrays)
    spec = _spec(c, q, k, v, m)
    out, lse = chunked.forward(spec, q, k, v, m, block_q=c["block_q"], block_k=c["block_k"])
    xp_assert_close(backend, out, exp_out, dtype="float64")
    xp_assert_close(backend, lse, exp_lse, dtype="float64")
    c_out, c_lse = _composed.forward(spec, q, k, v, m)
    xp_assert_close(backend, out, backend.to_numpy(c_out), dtype="float64")
    xp_assert_close(backend, lse, backend.to_numpy(c_lse), dtype="float64")


@SETTINGS
@given(c=cases())
def test_backward_matches_composed(backend, c):
    skip_slow(backend)
    rng = np.random.default_rng(c["seed"] % 1000)
    arrays = _inputs(c, rng)
    q, k, v, m = (None if a is None else backend.asarray(a) for a in arrays)
    spec = _spec(c, q, k, v, m)
    blocks = dict(block_q=c["block_q"], block_k=c["block_k"])
    out, lse = chunked.forward(spec, q, k, v, m, **blocks)
    d_out = backend.asarray(rng.standard_normal(spec.out_shape))
    d_lse = backend.asarray(rng.standard_normal(spec.lse_shape))
    got = chunked.backward(spec, q, k, v, m, out, lse, d_out, d_lse, **blocks)
    want = _composed.backward(spec, q, k, v, m, out, lse, d_out, d_lse)
    for name, g, w in zip(("dq", "dk", "dv", "dmask"), got, want, strict=True):
        if w is None:
            assert g is None, name
            continue
        xp_assert_close(backend, g, backend.to_numpy(w), dtype="float64", err_msg=name)
    # Only the output's cotangent, then only the LSE's: each path on its own.
    for d_o, d_l in ((d_out, None), (None, d_lse)):
        got = chunked.backward(spec, q, k, v, m, out, lse, d_o, d_l, **blocks)
        want = _composed.backward(spec, q, k, v, m, out, lse, d_o, d_l)
        for g, w in zip(got[:3], want[:3], strict=True):
            xp_assert_close(backend, g, backend.to_numpy(w), dtype="float64")


FIXED_CASE = dict(
    B=2,
    Hkv=1,
    Hq=2,
    L=7,
    S=9,
    E=3,
    Ev=2,
    mask="float",
    layout="over_L",
    is_causal=True,
    causal_align="bottom_right",
    window=(4, -1),
    softcap=1.5,
    dropout_p=0.3,
    block_q=3,
    block_k=4,
    seed=12345,
)


def test_fixed_case_every_backend(backend):
    """One case with every option at once (and blocks not dividing L or S), forward and
    backward, on every backend including the slow ones."""
    c = FIXED_CASE
    if backend.name in SLOW_BACKENDS:  # each new block shape compiles every op: one block
        c = dict(c, block_q=c["L"], block_k=c["S"])
    rng = np.random.default_rng(0)
    arrays = _inputs(c, rng)
    exp_out, exp_lse = _reference(c, *arrays)
    q, k, v, m = (backend.asarray(a) for a in arrays)
    spec = _spec(c, q, k, v, m)
    blocks = dict(block_q=c["block_q"], block_k=c["block_k"])
    out, lse = chunked.forward(spec, q, k, v, m, **blocks)
    xp_assert_close(backend, out, exp_out, dtype="float64")
    xp_assert_close(backend, lse, exp_lse, dtype="float64")
    d_out = backend.asarray(rng.standard_normal(spec.out_shape))
    d_lse = backend.asarray(rng.standard_normal(spec.lse_shape))
    got = chunked.backward(spec, q, k, v, m, out, lse, d_out, d_lse, **blocks)
    want = _composed.backward(spec, q, k, v, m, out, lse, d_out, d_lse)
    for g, w in zip(got, want, strict=True):
        xp_assert_close(backend, g, backend.to_numpy(w), dtype="float64")


FD_CASES = {
    "plain": dict(),
    "causal_top_left": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_align="bottom_right"),
    "window": dict(window=(1, 1)),
    "softcap": dict(softcap=1.5, is_causal=True),
    "float_mask": dict(mask="float"),
    "bool_mask_empty_row": dict(mask="bool"),
    "gqa": dict(gqa=True, is_causal=True),
    "dropout": dict(dropout_p=0.3, seed=11),
}


@pytest.mark.parametrize("name", list(FD_CASES))
def test_backward_finite_differences(name, monkeypatch):
    """float64 NumPy, blocks smaller than L and S (and not dividing them)."""
    monkeypatch.setattr(chunked, "BLOCK_Q", 2)
    monkeypatch.setattr(chunked, "BLOCK_K", 3)
    opts = dict(FD_CASES[name])
    rng = np.random.default_rng(3)
    L, S = 5, 7
    gqa = opts.pop("gqa", False)
    Hq, Hkv = (2, 1) if gqa else (1, 1)
    q = rng.standard_normal((1, Hq, L, 3))
    k = rng.standard_normal((1, Hkv, S, 3))
    v = rng.standard_normal((1, Hkv, S, 2))
    args = [q, k, v]
    kind = opts.pop("mask", None)
    if kind == "float":
        args.append(rng.standard_normal((L, S)))
    elif kind == "bool":
        m = rng.random((L, S)) < 0.7
        m[2] = False  # an empty row: zero gradients, never NaN
        args.append(m)
    kwargs = dict(opts, enable_gqa=gqa, return_lse=True, implementation="chunked")
    out, grads = check_vjp_fd(aa.scaled_dot_product_attention, args, kwargs, rtol=1e-5, atol=1e-7)
    if kind == "bool":
        assert np.all(out[0][..., 2, :] == 0) and np.all(np.isneginf(out[1][..., 2]))
        assert np.all(grads[0][..., 2, :] == 0)


def test_public_api_and_vjp_match_composed(backend):
    skip_slow(backend)
    rng = np.random.default_rng(5)
    q = backend.asarray(rng.standard_normal((2, 4, 9, 3)))
    k = backend.asarray(rng.standard_normal((2, 2, 11, 3)))
    v = backend.asarray(rng.standard_normal((2, 2, 11, 5)))
    m = backend.asarray(rng.standard_normal((2, 1, 9, 11)))
    opts = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True)
    res = {}
    for impl in ("chunked", "composed"):
        (out, lse), pullback = aa.vjp(
            aa.scaled_dot_product_attention, q, k, v, m, implementation=impl, **opts
        )
        d_out = backend.asarray(np.ones((2, 4, 9, 5)))
        d_lse = backend.asarray(np.full((2, 4, 9), 0.5))
        res[impl] = (out, lse) + tuple(pullback((d_out, d_lse)))
    for a, b in zip(res["chunked"], res["composed"], strict=True):
        xp_assert_close(backend, a, backend.to_numpy(b), dtype="float64")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_low_precision_accumulates_in_float32(dtype):
    rng = np.random.default_rng(2)
    q = (rng.standard_normal((1, 2, 37, 8)) * 4).astype(dtype)
    k = (rng.standard_normal((1, 2, 53, 8)) * 4).astype(dtype)
    v = rng.standard_normal((1, 2, 53, 8)).astype(dtype)
    spec = make_spec(q, k, v, None, 0.0, True, None, False, "bottom_right", None, None, None)
    out, lse = chunked.forward(spec, q, k, v, None, block_q=8, block_k=16)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    exp_out, exp_lse, _ = reference_attention(q, k, v, is_causal=True, causal_align="bottom_right")
    tol = 4e-3 if dtype == "float16" else 3e-5
    np.testing.assert_allclose(out.astype(np.float64), exp_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, exp_lse, rtol=tol, atol=tol)


def test_large_logits_stay_finite():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 20, 4)).astype(np.float32) * 100.0
    k = rng.standard_normal((1, 1, 30, 4)).astype(np.float32) * 100.0
    v = rng.standard_normal((1, 1, 30, 4)).astype(np.float32)
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="chunked")
    grads = pullback(np.ones_like(out))
    assert all(np.all(np.isfinite(x)) for x in (out,) + tuple(grads))
    exp_out, _, _ = reference_attention(q, k, v)
    np.testing.assert_allclose(out, exp_out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("opts", "expected"),
    [
        (dict(), 64),
        (dict(is_causal=True), 36),  # 8 query blocks see 1..8 key blocks: about half
        (dict(window=(127, 0)), 15),  # a 128-key band touches at most 2 blocks per row block
    ],
)
def test_structure_skips_key_blocks(opts, expected):
    q = np.zeros((1, 1, 1024, 4), dtype=np.float32)
    spec = make_spec(
        q,
        q,
        q,
        None,
        0.0,
        opts.get("is_causal", False),
        None,
        False,
        "top_left",
        opts.get("window"),
        None,
        None,
    )
    visited = sum(
        len(list(chunked._key_blocks(spec, r, r + 128, 128))) for r in range(0, 1024, 128)
    )
    assert visited == expected


@pytest.mark.parametrize("static_min_rows", [None, 1])  # masked fill / -inf bias
@pytest.mark.parametrize(
    ("opts", "widest"),
    [
        (dict(is_causal=True), 16),  # each row block's diagonal: 16 columns (15 masked)
        (dict(is_causal=True, causal_align="bottom_right"), 16),
        (dict(window=(20, 3)), 16),  # both edges of a band, each at most a row block wide
    ],
)
def test_band_edges_are_masked_alone_and_in_place(
    backend, opts, widest, static_min_rows, monkeypatch
):
    """Where the library writes through views, a block that crosses the band's edge is
    masked on the crossed columns only (its inside is never tested) and the result is
    the composed path's. Elsewhere (JAX, Dask, array-api-strict) whole blocks are tested."""
    skip_slow(backend)
    if static_min_rows is not None:
        monkeypatch.setattr(_static_shift, "MIN_ROWS", static_min_rows)
    edge_widths, whole_blocks = [], []

    def spy(found, test):
        def structural_allowed(xp, structure, rows, cols, offset=None):
            found.append(int(cols.shape[-1]))
            return test(xp, structure, rows, cols, offset)

        return structural_allowed

    monkeypatch.setattr(chunked, "structural_allowed", spy(edge_widths, chunked.structural_allowed))
    monkeypatch.setattr(
        _composed, "structural_allowed", spy(whole_blocks, _composed.structural_allowed)
    )
    rng = np.random.default_rng(3)
    q = backend.asarray(rng.standard_normal((2, 2, 64, 8)))
    k = backend.asarray(rng.standard_normal((2, 2, 80, 8)))
    v = backend.asarray(rng.standard_normal((2, 2, 80, 8)))
    a = opts.get("causal_align", "top_left")
    spec = make_spec(
        q, k, v, None, 0.0, opts.get("is_causal", False), None, False, a,
        opts.get("window"), None, None,
    )  # fmt: skip
    out, lse = chunked.forward(spec, q, k, v, None, block_q=16, block_k=80)
    n_whole = len(whole_blocks)
    c_out, c_lse = _composed.forward(spec, q, k, v, None)
    xp_assert_close(backend, out, backend.to_numpy(c_out), dtype="float64")
    xp_assert_close(backend, lse, backend.to_numpy(c_lse), dtype="float64")
    if backend.name in ("numpy", "torch", "cupy"):
        assert edge_widths and max(edge_widths) <= widest and n_whole == 0
    else:
        assert edge_widths == [] and n_whole > 0


def test_memory_is_blockwise():
    """Forward + backward never hold an L x S array (16 MiB here)."""
    L = 2048
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, L, 16), dtype=np.float32) for _ in range(3))
    score_bytes = L * L * 4
    # Warm up: a first call imports lazily loaded modules (megabytes that are not buffers).
    out, pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, is_causal=True, implementation="chunked"
    )
    pullback(out)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out, pullback = aa.vjp(
            aa.scaled_dot_product_attention, q, k, v, is_causal=True, implementation="chunked"
        )
        pullback(out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < score_bytes / 4, f"peak growth {peak - base} bytes"


def test_auto_never_runs_composed_blocks_above_the_documented_size(backend, monkeypatch):
    if backend.name in ("numpy", "cupy", "dask"):
        pytest.skip("a backend-specific fast path may rank before the array-API paths")
    q = backend.asarray(np.zeros((2, 3, 5, 4)))
    spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None)
    assert chunked.score_matrix_bytes(spec) == 2 * 3 * 5 * 5 * 8
    assert _select(spec, "auto") is _composed  # small: the cost model's choice
    monkeypatch.setattr(_composed, "AUTO_CHUNK_BYTES", chunked.score_matrix_bytes(spec) - 1)
    # PyTorch CPU tensors may also go to the NumPy fast path (on views of them).
    allowed = ("chunked", "fast") if backend.name == "torch" else ("chunked",)
    assert auto_choice(spec) in allowed
    monkeypatch.setattr(_composed, "AUTO_CHUNK_BYTES", chunked.score_matrix_bytes(spec))
    assert _select(spec, "auto") is _composed
    # Named explicitly, the chunked path runs whatever the size.
    assert _select(spec, "chunked") is _REGISTRY["chunked"].impl


def test_configured_block_sizes_and_bad_block_sizes():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 7, 3)) for _ in range(3))
    spec = make_spec(q, k, v, None, 0.0, True, None, False, "top_left", None, None, None)
    out, lse = chunked.ChunkedAttention(block_q=3, block_k=2).forward(spec, q, k, v, None)
    exp_out, exp_lse, _ = reference_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, exp_out, atol=1e-12)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_q"):
            chunked.forward(spec, q, k, v, None, block_q=bad)
        with pytest.raises(ValueError, match="block_k"):
            chunked.ChunkedAttention(block_k=bad)


def test_no_keys_and_fully_masked_inputs():
    q = np.ones((1, 2, 3, 4))
    k = np.ones((1, 2, 0, 4))
    spec = make_spec(q, k, k, None, 0.0, False, None, False, "top_left", None, None, None)
    out, lse = chunked.forward(spec, q, k, k, None)
    assert out.shape == (1, 2, 3, 4) and np.all(out == 0) and np.all(np.isneginf(lse))
    dq, dk, dv, _ = chunked.backward(spec, q, k, k, None, out, lse, np.ones_like(out), None)
    assert np.all(dq == 0) and dk.shape == k.shape and dv.shape == k.shape
