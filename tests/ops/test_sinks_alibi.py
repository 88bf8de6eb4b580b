"""``sinks=`` (gpt-oss learnable attention sinks) and ``alibi_slopes=`` (FlashAttention's
ALiBi) on every backend and every implementation (composed, chunked, NumPy fast path).

Oracles, all written here and none calling arrayattn:

- ``reference``: float64 NumPy attention, dense and explicit; the sink is one more logit
  column with no value (``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``), ALiBi is
  ``-slope_h * |i + offset - j|`` from the aligned diagonal (SEMANTICS.md).
- ``gpt_oss_eager``: Hugging Face gpt-oss's ``eager_attention_forward`` written in torch
  (concatenate the sink logits as an extra column, softmax, drop the column) with autograd
  for the gradients, sinks included.
- ``fa_alibi_bias``: FlashAttention's test reference ``attn_bias_from_alibi_slopes``
  (tests/test_flash_attn.py), written in NumPy.
- Finite differences for the sinks' gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import TOLERANCES, backend_dtype, numerical_vjp, thin, xp_assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.attention import chunked
from arrayattn.attention.fast import layout as _numpy_fast

SDPA = aa.scaled_dot_product_attention
IMPLEMENTATIONS = ("composed", "chunked", "fast")


# -- oracles ------------------------------------------------------------------------------
def reference(
    q,
    k,
    v,
    *,
    sinks=None,
    alibi_slopes=None,
    mask=None,
    is_causal=False,
    causal_align="top_left",
    window=None,
    softcap=None,
    scale=None,
    enable_gqa=False,
    q_lengths=None,
    kv_lengths=None,
):
    """``(out, lse, probs)`` in float64 for 4-D ``q (B, Hq, L, E)``, ``k/v (B, Hkv, S, *)``;
    ``sinks``/``alibi_slopes`` broadcastable to ``(B, Hq)``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, L, E = q.shape
    S = k.shape[-2]
    if enable_gqa and k.shape[1] != Hq:
        k = np.repeat(k, Hq // k.shape[1], axis=1)
        v = np.repeat(v, Hq // v.shape[1], axis=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    allowed = np.ones((B, 1, L, S), dtype=bool)
    dist = np.zeros((B, 1, L, S))
    for b in range(B):
        ql = L if q_lengths is None else int(np.clip(q_lengths[b], 0, L))
        kl = S if kv_lengths is None else int(np.clip(kv_lengths[b], 0, S))
        if causal_align == "top_left":
            off = 0
        else:  # per-sequence diagonal with lengths (FlashAttention varlen)
            off = (kl - ql) if (q_lengths is not None or kv_lengths is not None) else S - L
        a = (i < ql) & (j < kl)
        left, right = window if window is not None else (-1, -1)
        if is_causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            a &= j >= i + off - left
        if right >= 0:
            a &= j <= i + off + right
        allowed[b, 0] = a
        dist[b, 0] = np.abs(i + off - j)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), (B, Hq))
        s = s - slopes[:, :, None, None] * dist
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = allowed & mask
        else:
            s = s + mask.astype(np.float64)
    s = np.where(allowed, s, -np.inf)
    if sinks is not None:  # gpt-oss: one more logit column, no value
        sk = np.broadcast_to(np.asarray(sinks, np.float64), (B, Hq))[:, :, None, None]
        s = np.concatenate([s, np.broadcast_to(sk, (B, Hq, L, 1))], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    nonempty = total > 0
    p = np.where(nonempty, e / np.where(nonempty, total, 1.0), 0.0)
    lse = np.where(nonempty, m + np.log(np.where(nonempty, total, 1.0)), -np.inf)[..., 0]
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse, p


def fa_alibi_bias(slopes, seqlen_q, seqlen_k, causal=False):
    """FlashAttention's ``attn_bias_from_alibi_slopes`` (tests/test_flash_attn.py, no
    padding masks) in NumPy: ``slopes (batch, nheads)`` -> bias broadcastable to
    ``(batch, nheads, seqlen_q, seqlen_k)``. Causal: the row-independent
    ``slope * (j - (seqlen_k - 1))``; else ``-slope * |i + seqlen_k - seqlen_q - j|``."""
    slopes = np.asarray(slopes, np.float64)[:, :, None, None]
    if causal:
        return np.arange(-seqlen_k + 1, 1, dtype=np.float64) * slopes
    row_idx = np.arange(seqlen_q)[:, None]
    col_idx = np.arange(seqlen_k)
    relative_pos = np.abs(row_idx + seqlen_k - seqlen_q - col_idx)
    return -slopes * relative_pos


def fa_attention(q, k, v, slopes, causal):
    """FlashAttention's reference attention with ALiBi (bottom-right causal), float64."""
    L, S = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s = s + fa_alibi_bias(slopes, L, S, causal)
    if causal:  # FA >= 2.1: query i sees keys j <= i + S - L
        s = np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + S - L, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return (e / e.sum(-1, keepdims=True)) @ v, (m + np.log(e.sum(-1, keepdims=True)))[..., 0]


# -- helpers --------------------------------------------------------------------------------
def _skip_unless_runs(backend, implementation):
    if implementation == "fast" and backend.name != "numpy":
        pytest.skip("the fast path is NumPy's")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows and keys, so the chunked and fast paths tile these small
    problems (several query and key blocks, ragged tails, partly masked blocks)."""
    monkeypatch.setattr(chunked, "BLOCK_Q", 3)
    monkeypatch.setattr(chunked, "BLOCK_K", 4)
    monkeypatch.setattr(_numpy_fast, "FWD_ROWS", 4)
    monkeypatch.setattr(_numpy_fast, "BLOCK_ELEMENTS", 20)
    monkeypatch.setattr(_numpy_fast, "BWD_ROWS", 3)
    monkeypatch.setattr(_numpy_fast, "BWD_KEYS", 5)


# name: (q shape, k shape, options, sinks shape or None, slopes shape or None, mask)
CONFIGS = {
    "sinks_plain": ((2, 4, 7, 8), (2, 4, 9, 8), {}, (4,), None, None),
    "alibi_causal_br_gqa": (
        (2, 4, 9, 8),
        (2, 2, 13, 8),
        dict(is_causal=True, causal_align="bottom_right", enable_gqa=True),
        None,
        (2, 4),
        None,
    ),
    "both_window_softcap_tl": (
        (1, 2, 11, 4),
        (1, 2, 6, 4),
        dict(window=(3, 1), softcap=2.0),
        (1, 2),
        (2,),
        None,
    ),
    "both_boolmask_empty_rows": (
        (2, 2, 6, 8),
        (2, 1, 10, 8),
        dict(is_causal=True, enable_gqa=True),
        (2, 1),
        (2,),
        "bool",
    ),
    "both_floatmask_lengths": (
        (2, 2, 8, 8),
        (2, 2, 8, 8),
        dict(is_causal=True, causal_align="bottom_right", lengths=True),
        (2,),
        (2, 2),
        "float",
    ),
}


def _problem(name, rng, dtype="float64"):
    q_shape, k_shape, opts, sink_shape, slope_shape, mask_kind = CONFIGS[name]
    opts = dict(opts)
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal(k_shape).astype(dtype)
    arrays = {}
    if sink_shape is not None:
        arrays["sinks"] = (rng.standard_normal(sink_shape) * 2).astype(dtype)
    if slope_shape is not None:
        arrays["alibi_slopes"] = rng.uniform(0.05, 1.0, slope_shape).astype(dtype)
    if mask_kind == "bool":
        m = rng.random((q_shape[0], 1, q_shape[-2], k_shape[-2])) < 0.7
        m[:, :, 2] = False  # a row whose keys are all masked: the sink alone
        arrays["mask"] = m
    elif mask_kind == "float":
        arrays["mask"] = rng.standard_normal((q_shape[-2], k_shape[-2])).astype(dtype)
    if opts.pop("lengths", False):
        arrays["q_lengths"] = np.array([q_shape[-2], 3])
        arrays["kv_lengths"] = np.array([k_shape[-2] - 2, 0])  # no key at all: sink alone
    return (q, k, v), arrays, opts


def _tol(dtype):
    r, a = TOLERANCES[dtype]
    return dict(rtol=r * 3, atol=a * 3) if dtype == "float16" else dict(rtol=r, atol=a)


# -- every backend, every implementation, against the float64 oracle -----------------------
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_reference(backend, dtype_name, implementation, name, small_blocks) -> None:
    _skip_unless_runs(backend, implementation)
    thin(backend, name == "both_floatmask_lengths" and dtype_name == "float32")
    if backend.name == "dask" and implementation == "chunked" and dtype_name != "float64":
        pytest.skip("dask's chunked path: the float64 cases")
    dt = backend_dtype(backend, dtype_name)
    del dt
    rng = np.random.default_rng(7)
    (q, k, v), arrays, opts = _problem(name, rng, dtype_name)
    mask = arrays.pop("mask", None)
    want_out, want_lse, _ = reference(q, k, v, mask=mask, **arrays, **opts)
    b_arrays = {n: backend.asarray(a) for n, a in arrays.items()}
    args = tuple(backend.asarray(x) for x in (q, k, v))
    if mask is not None:
        args = args + (backend.asarray(mask),)
    names = list(b_arrays)

    def call(*a):  # every array positional, so that JAX traces them all under jit
        keywords = dict(zip(names, a[len(args) :], strict=True))
        return SDPA(*a[: len(args)], return_lse=True, implementation=implementation,
                    **keywords, **opts)  # fmt: skip

    out, lse = backend.call(call, *args, *b_arrays.values())
    xp_assert_close(backend, out, want_out, dtype=dtype_name, **_tol(dtype_name))
    lse_dtype = "float64" if dtype_name == "float64" else "float32"
    xp_assert_close(backend, lse, want_lse, dtype=lse_dtype, **_tol(dtype_name))
    if "sinks" in arrays:  # a sink makes every LSE finite, even of rows with no key
        assert np.isfinite(backend.to_numpy(lse)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_numpy_float64(backend, implementation, name, small_blocks) -> None:
    """Every backend's pullback (q, k, v, float mask and the sinks' dict) equals the
    float64 NumPy composed one, which the finite-difference and torch tests check."""
    _skip_unless_runs(backend, implementation)
    thin(backend, name == "both_floatmask_lengths" and implementation == "composed")
    if backend.name != "numpy" and implementation == "chunked" and name != "both_floatmask_lengths":
        pytest.skip("chunked gradients on other backends: one representative config")
    dt = backend_dtype(backend, "float64")
    del dt
    rng = np.random.default_rng(3)
    (q, k, v), arrays, opts = _problem(name, rng)
    mask = arrays.pop("mask", None)
    args = (q, k, v) + ((mask,) if mask is not None else ())
    (out, lse), pullback = aa.vjp(
        SDPA, *args, return_lse=True, implementation="composed", **arrays, **opts
    )
    cot = (rng.standard_normal(out.shape), rng.standard_normal(lse.shape))
    want = pullback(cot)
    b_args = tuple(backend.asarray(x) for x in args)
    b_arrays = {n: backend.asarray(a) for n, a in arrays.items()}
    b_cot = tuple(backend.asarray(c) for c in cot)
    # Eager on every backend (JAX included): the jitted forward is covered above.
    (b_out, b_lse), b_pullback = aa.vjp(
        SDPA, *b_args, return_lse=True, implementation=implementation, **b_arrays, **opts
    )
    got = b_pullback(b_cot)
    xp_assert_close(backend, b_out, out, rtol=1e-9, atol=1e-11)
    assert len(got) == len(want)
    for i in range(len(args)):
        if want[i] is None:
            assert got[i] is None
        else:
            xp_assert_close(backend, got[i], want[i], rtol=1e-9, atol=1e-11, err_msg=f"arg {i}")
    if "sinks" in arrays:
        assert set(got[-1]) == {"sinks"}
        d_sinks = got[-1]["sinks"]
        assert tuple(d_sinks.shape) == arrays["sinks"].shape
        xp_assert_close(backend, d_sinks, want[-1]["sinks"], rtol=1e-9, atol=1e-11)
    else:
        assert not isinstance(got[-1], dict)


# -- finite differences -------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sinks_and_inputs_gradients_by_finite_differences(implementation, name, small_blocks):
    rng = np.random.default_rng(11)
    (q, k, v), arrays, opts = _problem(name, rng)
    mask = arrays.pop("mask", None)
    sinks = arrays.pop("sinks", None)
    if sinks is None:
        sinks = rng.standard_normal(q.shape[1])

    def f(q, k, v, sinks):
        args = (q, k, v) + ((mask,) if mask is not None else ())
        return SDPA(
            *args, sinks=sinks, return_lse=True, implementation=implementation, **arrays, **opts
        )

    (out, lse), pullback = aa.vjp(
        SDPA,
        *((q, k, v) + ((mask,) if mask is not None else ())),
        sinks=sinks,
        return_lse=True,
        implementation=implementation,
        **arrays,
        **opts,
    )
    cot = (rng.standard_normal(out.shape), rng.standard_normal(lse.shape))
    grads = pullback(cot)
    # The sinks on every path; q and k once (the other paths' q/k/v gradients equal the
    # composed path's in test_gradients_match_numpy_float64).
    checks = [(3, grads[-1]["sinks"])]
    if implementation == "composed":
        checks += [(0, grads[0]), (1, grads[1]), (2, grads[2])]
    for index, got in checks:
        num = numerical_vjp(f, (q, k, v, sinks), index, cot)
        np.testing.assert_allclose(got, num, rtol=1e-6, atol=1e-8, err_msg=f"argument {index}")


def test_sinks_gradient_without_lse_cotangent_and_broadcast_shape() -> None:
    """Sinks of shape (B, 1) (one per sequence, shared by the heads) get their gradient
    summed over the heads; a pullback of ``d_out`` alone."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 2, 5, 4))
    k = rng.standard_normal((3, 2, 6, 4))
    sinks = rng.standard_normal((3, 1))
    out, pullback = aa.vjp(SDPA, q, k, k, sinks=sinks, is_causal=True)
    cot = rng.standard_normal(out.shape)
    d_sinks = pullback(cot)[-1]["sinks"]
    num = numerical_vjp(lambda s: SDPA(q, k, k, sinks=s, is_causal=True), (sinks,), 0, cot)
    assert d_sinks.shape == (3, 1)
    np.testing.assert_allclose(d_sinks, num, rtol=1e-6, atol=1e-8)


# -- peers: gpt-oss eager attention in torch, FlashAttention's ALiBi --------------------------
def gpt_oss_eager(query, key, value, sinks, *, scaling, sliding_window=None, torch):
    """Hugging Face gpt-oss ``eager_attention_forward`` (causal mask, GQA by ``repeat_kv``,
    optional sliding window), written in torch: sink logits as an extra column, softmax,
    the column dropped."""
    n_rep = query.shape[1] // key.shape[1]
    key_states = key.repeat_interleave(n_rep, dim=1)
    value_states = value.repeat_interleave(n_rep, dim=1)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    L, S = query.shape[-2], key.shape[-2]
    i = torch.arange(L)[:, None] + (S - L)  # a KV cache: queries are the last L positions
    j = torch.arange(S)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (j > i - sliding_window)
    causal_mask = torch.zeros((L, S), dtype=attn_weights.dtype)
    causal_mask = causal_mask.masked_fill(~allowed, torch.finfo(attn_weights.dtype).min)
    attn_weights = attn_weights + causal_mask
    sink_col = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sink_col], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = torch.nn.functional.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]
    return torch.matmul(scores, value_states)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("L,S", [(7, 7), (4, 9)])
def test_matches_gpt_oss_eager_torch(implementation, sliding_window, L, S, small_blocks):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, L, 8))
    k = rng.standard_normal((2, 2, S, 8))
    v = rng.standard_normal((2, 2, S, 8))
    sinks = rng.standard_normal(4)
    d_out = rng.standard_normal((2, 4, L, 8))
    tq, tk, tv, ts = (torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks))
    t_out = gpt_oss_eager(tq, tk, tv, ts, scaling=8**-0.5, sliding_window=sliding_window,
                          torch=torch)  # fmt: skip
    t_out.backward(torch.tensor(d_out))
    window = None if sliding_window is None else (sliding_window - 1, 0)  # HF's W keys
    out, pullback = aa.vjp(
        SDPA,
        q,
        k,
        v,
        is_causal=True,
        causal_align="bottom_right",
        window=window,
        enable_gqa=True,
        sinks=sinks,
        implementation=implementation,
    )
    dq, dk, dv, kw = pullback(d_out)
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-10, atol=1e-12)
    for got, t in ((dq, tq), (dk, tk), (dv, tv), (kw["sinks"], ts)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_matches_gpt_oss_eager_torch_backend_float32() -> None:
    """The same comparison with torch tensors in and out (the torch backend), float32."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k = torch.randn(1, 1, 6, 16, generator=g)
    v = torch.randn(1, 1, 6, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    want = gpt_oss_eager(q, k, v, sinks, scaling=0.25, torch=torch)
    got = SDPA(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,S", [(6, 6), (4, 11), (9, 5)])
def test_alibi_matches_flash_attention_definition(implementation, causal, L, S, small_blocks):
    """``causal_align="bottom_right"`` gives FlashAttention's ALiBi outputs, causal or not.
    The LSE equals FA's without causal; with causal FA's bias is the row-independent
    ``slope * (j - S + 1)``, which differs from ours by ``slope * (L - 1 - i)`` per row
    (softmax-invariant, so the outputs agree and the LSEs differ by exactly that)."""
    if causal and L > S:
        pytest.skip("rows with no key: FlashAttention's reference gives NaN there")
    rng = np.random.default_rng(4)
    B, H, E = 2, 3, 8
    q = rng.standard_normal((B, H, L, E))
    k = rng.standard_normal((B, H, S, E))
    v = rng.standard_normal((B, H, S, E))
    slopes = rng.uniform(0.1, 1.0, (B, H))
    want_out, fa_lse = fa_attention(q, k, v, slopes, causal)
    out, lse = SDPA(
        q,
        k,
        v,
        is_causal=causal,
        causal_align="bottom_right",
        alibi_slopes=slopes,
        return_lse=True,
        implementation=implementation,
    )
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    shift = slopes[:, :, None] * (L - 1 - np.arange(L)) if causal else 0.0
    np.testing.assert_allclose(lse, fa_lse + shift, rtol=1e-10, atol=1e-12)


def test_alibi_never_builds_an_l_by_s_array_on_the_fast_path(monkeypatch) -> None:
    """The fast path's ALiBi blocks are at most ``rows x key-block`` elements."""
    seen = []
    real = _numpy_fast._alibi_distance

    def spy(st, r0, r1, c0, c1, cd):
        seen.append((r1 - r0) * (c1 - c0))
        return real(st, r0, r1, c0, c1, cd)

    monkeypatch.setattr(_numpy_fast, "_alibi_distance", spy)
    monkeypatch.setattr(_numpy_fast, "FWD_ROWS", 16)
    monkeypatch.setattr(_numpy_fast, "BLOCK_ELEMENTS", 256)
    q = np.ones((1, 1, 64, 8), np.float32)
    aa.scaled_dot_product_attention(q, q, q, alibi_slopes=np.ones(1, np.float32),
                                    implementation="fast")  # fmt: skip
    assert seen and max(seen) <= 256 < 64 * 64


# -- empty rows, weights, varlen, errors ------------------------------------------------------
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_row_with_only_the_sink(implementation) -> None:
    """Every key masked but a sink: output 0, LSE = sink, zero q/k/v gradients from that
    row and d sink = dLSE - D = dLSE there (D = dO . O = 0)."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 4, 8))
    k = rng.standard_normal((1, 2, 5, 8))
    mask = np.ones((4, 5), bool)
    mask[1] = False
    sinks = np.array([0.5, -1.5])
    (out, lse), pullback = aa.vjp(SDPA, q, k, k, mask, sinks=sinks, return_lse=True,
                                  implementation=implementation)  # fmt: skip
    assert (out[:, :, 1] == 0).all()
    np.testing.assert_allclose(lse[0, :, 1], sinks)
    d_lse = np.zeros(lse.shape)
    d_lse[0, :, 1] = [2.0, 3.0]
    dq, dk, dv, _, kw = pullback((np.zeros(out.shape), d_lse))
    assert not dq.any() and not dk.any() and not dv.any()
    np.testing.assert_allclose(kw["sinks"], [2.0, 3.0])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_garbage_in_excluded_keys_never_reaches_results(implementation) -> None:
    """NaN/Inf in keys and values past ``kv_lengths`` or right of the causal diagonal stay
    out of the output, the LSE and every gradient, the sinks' included (SEMANTICS.md)."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 2, 6, 4))
    k = rng.standard_normal((2, 2, 8, 4))
    v = rng.standard_normal((2, 2, 8, 4))
    kv_lengths = np.array([6, 3])
    opts = dict(is_causal=True, causal_align="bottom_right", kv_lengths=kv_lengths,
                sinks=np.array([0.3, -0.7]), alibi_slopes=np.array([0.5, 0.25]),
                return_lse=True, implementation=implementation)  # fmt: skip
    (clean, clean_lse), pb_clean = aa.vjp(SDPA, q, k, v, **opts)
    kg, vg = k.copy(), v.copy()
    kg[0, :, 6:] = np.nan
    vg[1, :, 3:] = np.inf
    (out, lse), pb = aa.vjp(SDPA, q, kg, vg, **opts)
    # (Not bit-equal on the fast path: garbage sends it from the static to the exact shift.)
    np.testing.assert_allclose(out, clean, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, clean_lse, rtol=1e-12, atol=1e-14)
    cot = (rng.standard_normal(out.shape), rng.standard_normal(lse.shape))
    got, want = pb(cot), pb_clean(cot)
    for i in (0, 1, 2):
        assert np.isfinite(got[i]).all()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[-1]["sinks"], want[-1]["sinks"], rtol=1e-12, atol=1e-14)


def test_no_keys_at_all_gives_the_sink() -> None:
    q = np.ones((1, 2, 3, 4))
    k = np.ones((1, 2, 0, 4))
    out, lse = SDPA(q, k, k, sinks=np.array([1.0, 2.0]), return_lse=True)
    assert out.shape == (1, 2, 3, 4) and not out.any()
    np.testing.assert_array_equal(lse, [[[1.0] * 3, [2.0] * 3]])


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_weights_with_sinks_and_alibi(dropout_p) -> None:
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 2, 5, 4))
    k = rng.standard_normal((2, 2, 7, 4))
    sinks = rng.standard_normal(2)
    slopes = np.array([0.5, 0.25])
    opts = dict(is_causal=True, causal_align="bottom_right", alibi_slopes=slopes,
                dropout_p=dropout_p, seed=3)  # fmt: skip
    w = aa.attention_weights(q, k, sinks=sinks, **opts)
    _, _, p = reference(q, k, k, sinks=sinks, alibi_slopes=slopes, is_causal=True,
                        causal_align="bottom_right")  # fmt: skip
    if dropout_p:
        keep = aa.dropout_mask(q, k, dropout_p, seed=3)
        p = np.where(keep, p / (1 - dropout_p), 0.0)
    np.testing.assert_allclose(w, p, rtol=1e-12, atol=1e-14)
    if not dropout_p:  # each row sums to 1 - p_sink
        assert (w.sum(-1) < 1).all()
    cot = rng.standard_normal(w.shape)
    _, pullback = aa.vjp(aa.attention_weights, q, k, sinks=sinks, **opts)
    d_sinks = pullback(cot)[-1]["sinks"]
    num = numerical_vjp(lambda s: aa.attention_weights(q, k, sinks=s, **opts), (sinks,), 0, cot)
    np.testing.assert_allclose(d_sinks, num, rtol=1e-6, atol=1e-8)


def test_varlen_with_sinks_and_alibi() -> None:
    """Each packed sequence equals its own call; the sinks' gradient sums over them."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((4, 7, 8))
    kv = rng.standard_normal((2, 9, 8))
    cu_q, cu_k = np.array([0, 3, 7]), np.array([0, 5, 9])
    sinks = rng.standard_normal(4)
    slopes = np.array([[0.5, 0.25, 0.125, 0.0625], [1.0, 0.5, 0.25, 0.125]])
    opts = dict(is_causal=True, causal_align="bottom_right")
    out, pullback = aa.vjp(aa.varlen_attention, q, kv, kv, cu_q, cu_k, sinks=sinks,
                           alibi_slopes=slopes, **opts)  # fmt: skip
    d_out = rng.standard_normal(out.shape)
    total = np.zeros(4)
    for n, (a, b, c, d) in enumerate(((0, 3, 0, 5), (3, 7, 5, 9))):
        part, pb = aa.vjp(SDPA, q[:, a:b], kv[:, c:d], kv[:, c:d], enable_gqa=True,
                          sinks=sinks, alibi_slopes=slopes[n], **opts)  # fmt: skip
        np.testing.assert_allclose(out[:, a:b], part, rtol=1e-12, atol=1e-14)
        total += pb(d_out[:, a:b])[-1]["sinks"]
    grads = pullback(d_out)
    assert len(grads) == 6
    np.testing.assert_allclose(grads[-1]["sinks"], total, rtol=1e-10, atol=1e-12)


def test_errors_name_the_argument() -> None:
    q = np.ones((2, 4, 3, 8), np.float32)
    with pytest.raises(TypeError, match="sinks must have a real floating dtype"):
        SDPA(q, q, q, sinks=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\) does not broadcast"):
        SDPA(q, q, q, sinks=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(3, 4\)"):
        SDPA(q, q, q, alibi_slopes=np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="alibi_slopes of shape"):
        SDPA(q, q, q, alibi_slopes=np.zeros((), np.float32))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="sinks is a torch array"):
        SDPA(q, q, q, sinks=torch.zeros(4))


def test_inputs_are_not_modified() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    sinks = rng.standard_normal(2).astype(np.float32)
    slopes = np.array([0.5, 0.25], np.float32)
    before = (q.copy(), sinks.copy(), slopes.copy())
    for impl in IMPLEMENTATIONS:
        out, pb = aa.vjp(SDPA, q, q, q, sinks=sinks, alibi_slopes=slopes, implementation=impl)
        pb(np.ones_like(out))
    for a, b in zip((q, sinks, slopes), before, strict=True):
        np.testing.assert_array_equal(a, b)


# -- hypothesis: shapes, alignments, windows, lengths with sinks and ALiBi ------------------
@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    L = draw(st.integers(1, 9))
    S = draw(st.integers(1, 9))
    E = draw(st.sampled_from([1, 4, 8]))
    opts = {"enable_gqa": G > 1}
    opts["is_causal"] = draw(st.booleans())
    opts["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.5, 5.0))
    sinks = draw(st.sampled_from([None, "head", "batch_head", "batch"]))
    alibi = draw(st.sampled_from([None, "head", "batch_head"]))
    if sinks is None and alibi is None:
        sinks = "head"
    lengths = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return (B, Hkv * G, L, E), (B, Hkv, S, E), opts, sinks, alibi, lengths, seed


def _draw_arrays(problem):
    q_shape, k_shape, opts, sinks, alibi, lengths, seed = problem
    rng = np.random.default_rng(seed)
    B, Hq = q_shape[:2]
    q = rng.standard_normal(q_shape)
    k = rng.standard_normal(k_shape)
    v = rng.standard_normal(k_shape)
    arrays = {}
    sink_shapes = {"head": (Hq,), "batch_head": (B, Hq), "batch": (B, 1)}
    if sinks is not None:
        arrays["sinks"] = rng.standard_normal(sink_shapes[sinks]) * 2
    if alibi is not None:
        arrays["alibi_slopes"] = rng.uniform(0.0, 1.5, sink_shapes[alibi])
    if lengths:
        arrays["q_lengths"] = rng.integers(0, q_shape[-2] + 1, B)
        arrays["kv_lengths"] = rng.integers(0, k_shape[-2] + 1, B)
    return (q, k, v), arrays, opts


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(problems())
def test_hypothesis_every_implementation_matches_reference(problem) -> None:
    (q, k, v), arrays, opts = _draw_arrays(problem)
    want_out, want_lse, _ = reference(q, k, v, **arrays, **opts)
    cot = np.random.default_rng(0).standard_normal(want_out.shape)
    grads = {}
    with pytest.MonkeyPatch.context() as mp:  # small tiles for chunked and fast
        mp.setattr(chunked, "BLOCK_Q", 2)
        mp.setattr(chunked, "BLOCK_K", 3)
        mp.setattr(_numpy_fast, "FWD_ROWS", 3)
        mp.setattr(_numpy_fast, "BLOCK_ELEMENTS", 9)
        mp.setattr(_numpy_fast, "BWD_ROWS", 2)
        mp.setattr(_numpy_fast, "BWD_KEYS", 3)
        for impl in IMPLEMENTATIONS:
            (out, lse), pullback = aa.vjp(
                SDPA, q, k, v, return_lse=True, implementation=impl, **arrays, **opts
            )
            np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12, err_msg=impl)
            np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12, err_msg=impl)
            grads[impl] = pullback((cot, None))
    for impl in ("chunked", "fast"):
        for i, (a, b) in enumerate(zip(grads[impl][:3], grads["composed"][:3], strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11, err_msg=f"{impl} grad {i}")
        if "sinks" in arrays:
            np.testing.assert_allclose(
                grads[impl][-1]["sinks"], grads["composed"][-1]["sinks"], rtol=1e-9, atol=1e-11
            )
