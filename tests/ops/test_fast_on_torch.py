"""The NumPy fast path on PyTorch CPU tensors (zero-copy NumPy views through
``_backend.numpy_bridge``) and the in-place ``exp`` of score blocks
(``_backend.exp_shifted``).

Oracles: ``arrayattn.testing.reference_attention``/``reference_vjp`` (float64 NumPy,
written densely) and, where installed, PyTorch's own SDPA and autograd.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn._backend import exp_shifted, numpy_bridge, resolve_namespace
from arrayattn.attention.spec import make_spec
from arrayattn.ops import attention as attention_mod
from arrayattn.testing import reference_attention, reference_vjp

torch = pytest.importorskip("torch")

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _t(a: np.ndarray, dtype=None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype or torch.float32)


def _spec(q, k, v, **kw):
    return make_spec(
        q,
        k,
        v,
        kw.pop("attn_mask", None),
        0.0,
        kw.pop("is_causal", False),
        None,
        kw.pop("enable_gqa", False),
        "top_left",
        None,
        None,
        None,
        **kw,
    )


@SETTINGS
@given(
    data=st.data(),
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    G=st.sampled_from([1, 2]),
    L=st.integers(1, 40),
    S=st.integers(1, 40),
    E=st.sampled_from([4, 16]),
    kind=st.sampled_from(
        [
            "none",
            "causal_tl",
            "causal_br",
            "window",
            "bool",
            "float",
            "lengths",
            "dropout",
            "softcap",
            "sinks",
            "alibi",
        ]
    ),
)
def test_fast_on_torch_matches_float64_reference(data, B, Hkv, G, L, S, E, kind):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    Hq = Hkv * G
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, E + 3))
    kw: dict = {"enable_gqa": G > 1}
    if kind.startswith("causal"):
        kw.update(
            is_causal=True, causal_align="top_left" if kind == "causal_tl" else "bottom_right"
        )
    elif kind == "window":
        kw.update(window=(3, 1))
    elif kind == "bool":
        kw["attn_mask"] = rng.random((L, S)) > 0.3
    elif kind == "float":
        kw["attn_mask"] = rng.standard_normal((B, 1, L, S))
    elif kind == "lengths":
        kw.update(q_lengths=rng.integers(0, L + 1, B), kv_lengths=rng.integers(0, S + 1, B))
    elif kind == "dropout":
        kw.update(dropout_p=0.3, seed=7)
    elif kind == "softcap":
        kw["softcap"] = 5.0
    elif kind == "sinks":
        kw["sinks"] = rng.standard_normal(Hq)
    elif kind == "alibi":
        kw["alibi_slopes"] = rng.random(Hq)

    def torch_kw():
        out = {}
        for name, x in kw.items():
            if isinstance(x, np.ndarray):
                dtype = None
                if x.dtype == bool:
                    dtype = torch.bool
                elif x.dtype.kind == "i":
                    dtype = torch.int64
                x = _t(x, dtype)
            out[name] = x
        return out

    qt, kt, vt = _t(q), _t(k), _t(v)
    before = [x.clone() for x in (qt, kt, vt)]
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention,
        qt,
        kt,
        vt,
        return_lse=True,
        implementation="fast",
        **torch_kw(),
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    # the oracle sees the float32-rounded inputs
    q32, k32, v32 = (x.numpy().astype(np.float64) for x in (qt, kt, vt))
    r_out, r_lse = reference_attention(q32, k32, v32, **kw)
    np.testing.assert_allclose(out.numpy(), r_out, rtol=2e-4, atol=2e-5)
    finite = np.isfinite(r_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], r_lse[finite], rtol=2e-4, atol=2e-5)

    d_out = rng.standard_normal(tuple(out.shape))
    grads = pullback((_t(d_out), None))
    ref = reference_vjp(d_out, q32, k32, v32, **kw)
    for got, want in zip(grads[:3], (ref.query, ref.key, ref.value), strict=True):
        assert isinstance(got, torch.Tensor)
        np.testing.assert_allclose(got.numpy(), want, rtol=5e-4, atol=5e-4)
    for x, b in zip((qt, kt, vt), before, strict=True):
        assert torch.equal(x, b)  # inputs never modified


def test_fast_on_torch_is_what_auto_runs_and_matches_torch_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 32, generator=g) for _ in range(3))
    spec = _spec(q, k, v)
    assert attention_mod.auto_choice(spec) == "fast"
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        got = aa.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fast_on_torch_gradients_match_torch_autograd():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 8, 64, 16, generator=g, requires_grad=True) for _ in range(3))
    kg, vg = k[:, :2], v[:, :2]  # GQA 8/2, non-contiguous views
    out, pullback = aa.vjp(
        aa.scaled_dot_product_attention,
        *(x.detach() for x in (q, kg, vg)),
        is_causal=True,
        enable_gqa=True,
        implementation="fast",
    )
    d_out = torch.randn(out.shape, generator=g)
    dq, dk, dv = pullback(d_out)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, kg, vg, is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
    wq, wk, wv = torch.autograd.grad(want, (q, kg, vg), d_out)
    for got, w in zip((dq, dk, dv), (wq, wk, wv), strict=True):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)


def test_fast_on_torch_shares_no_memory_with_the_inputs_and_float16():
    q = torch.randn(1, 2, 16, 8)
    out = aa.scaled_dot_product_attention(q, q, q, implementation="fast")
    assert out.data_ptr() != q.data_ptr()
    h = q.half()
    out16 = aa.scaled_dot_product_attention(h, h, h, implementation="fast")
    assert out16.dtype == torch.float16
    ref = reference_attention(h.numpy().astype(np.float64), *(h.numpy().astype(np.float64),) * 2)[0]
    np.testing.assert_allclose(out16.numpy().astype(np.float64), ref, rtol=2e-3, atol=2e-3)


def test_fast_declines_bfloat16_and_other_devices_and_auto_moves_on():
    b = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float16/float32/float64"):
        aa.scaled_dot_product_attention(b, b, b, implementation="fast")
    assert attention_mod.auto_choice(_spec(b, b, b)) != "fast"
    assert aa.scaled_dot_product_attention(b, b, b).dtype == torch.bfloat16
    assert numpy_bridge(resolve_namespace(torch), torch.device("meta")) is None
    assert numpy_bridge(resolve_namespace(np), "cpu") is None


def test_fast_declines_a_bfloat16_mask_beside_float32_inputs():
    # The inputs' dtype is viewable but the float mask's is not: the fast path must decline
    # (it used to crash converting the mask), and "auto" must give torch's own answer.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g) for _ in range(3))
    mask = torch.randn(24, 24, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 attn_mask"):
        aa.scaled_dot_product_attention(q, k, v, attn_mask=mask, implementation="fast")
    assert attention_mod.auto_choice(_spec(q, k, v, attn_mask=mask)) != "fast"
    out = aa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# exp_shifted: exp(s - m) in s's own memory where the library allows it
# ---------------------------------------------------------------------------------------
def _np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_exp_shifted_overwrites_only_its_scratch(lib):
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 3, 5))
    m = s.max(axis=-1, keepdims=True)
    want = np.exp(s - m)
    if lib == "numpy":
        scratch, shift, xp = s.copy(), m.copy(), resolve_namespace(np)
    else:
        scratch, shift, xp = torch.from_numpy(s.copy()), torch.from_numpy(m.copy()), None
        xp = resolve_namespace(torch)
    shift_before = m.copy()
    got = exp_shifted(xp, scratch, shift)
    np.testing.assert_allclose(_np(got), want, rtol=1e-15)
    np.testing.assert_array_equal(_np(shift), shift_before)  # the shift is read only


def test_exp_shifted_returns_a_new_array_when_it_cannot_overwrite():
    xp = resolve_namespace(np)
    s = np.zeros((1, 4))
    m = np.ones((3, 1))  # broadcasts s to (3, 4): the result cannot live in s
    got = exp_shifted(xp, s, m)
    assert got.shape == (3, 4) and np.all(s == 0)
    ro = np.broadcast_to(np.zeros(4), (2, 4))  # read-only view
    got = exp_shifted(xp, ro, np.zeros((2, 1)))
    np.testing.assert_array_equal(got, np.ones((2, 4)))
