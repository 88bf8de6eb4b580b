"""``arrayattn.torch.scaled_dot_product_attention`` under PyTorch's autograd (CPU).

Oracles: PyTorch autograd through ``torch.nn.functional.scaled_dot_product_attention``
(masks, both causal alignments, GQA, scale, float-mask gradient), a plain eager torch
attention written below for what SDPA lacks (sinks, softcap, windows, ALiBi, lengths,
the LSE and its gradient, dropout with arrayattn's mask), and finite differences
(``torch.autograd.gradcheck``). Tolerances relative to the largest magnitude of the
reference: float64 1e-12, float32 1e-5. Skipped without torch.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa

pytest.importorskip("torch")
import torch  # noqa: E402  (after the skip: torch is optional)
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

import arrayattn.torch as aat  # noqa: E402
from arrayattn.torch import _call, _function  # noqa: E402

F = torch.nn.functional
SDPA = aat.scaled_dot_product_attention
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers ---------------------------------------------------------------------------------
def _randn(shape, dtype, gen, grad=True):
    return torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype).requires_grad_(grad)


def _close(ours, ref, dtype, what=""):
    """``|ours - ref| <= tol * max|ref|`` (infinities must match exactly)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (what, ours.shape, ref.shape)
    ours, ref = ours.detach().double(), ref.detach().double()
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(ours), inf) and torch.equal(ours[inf], ref[inf]), what
    ours, ref = ours[~inf], ref[~inf]
    if ref.numel() == 0:
        return
    scale = max(ref.abs().max().item(), 1e-300)
    err = (ours - ref).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: error {err:.3g} vs scale {scale:.3g}"


def _outputs_and_grads(fn, leaves, cotangents):
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    wanted = [x for x in leaves if x is not None and x.requires_grad]
    grads = torch.autograd.grad(outs, wanted, cotangents, allow_unused=True)
    return outs, grads


def _compare(ours_fn, ref_fn, leaves, dtype, gen):
    ref_outs = ref_fn(*leaves)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    cots = tuple(torch.randn(o.shape, dtype=torch.float64, generator=gen).to(o.dtype)
                 for o in ref_outs)  # fmt: skip
    ref_outs, ref_grads = _outputs_and_grads(ref_fn, leaves, cots)
    outs, grads = _outputs_and_grads(ours_fn, leaves, cots)
    for i, (a, b) in enumerate(zip(outs, ref_outs, strict=True)):
        _close(a, b, dtype, f"output {i}")
    for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        assert a is not None and b is not None, f"gradient {i} missing"
        _close(a, b, dtype, f"gradient {i}")


def eager_attention(
    q, k, v, mask=None, *, is_causal=False, align="top_left", window=None, softcap=None,
    scale=None, enable_gqa=False, sinks=None, alibi=None, q_lengths=None, kv_lengths=None,
    keep=None, dropout_p=0.0,
):  # fmt: skip
    """Attention written plainly with torch operations (autograd differentiates it):
    (B, Hq, L, E) queries against (B, Hkv, S, E) keys; returns ``(out, lse)``. ``keep``:
    a dropout keep-mask (B, Hq, L, S) applied to the probabilities."""
    B, Hq, L, E = q.shape
    S = k.shape[-2]
    if enable_gqa:
        k = k.repeat_interleave(Hq // k.shape[1], dim=1)
        v = v.repeat_interleave(Hq // v.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * (1 / E**0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L).view(1, 1, L, 1)
    j = torch.arange(S).view(1, 1, 1, S)
    ql = torch.full((B,), L) if q_lengths is None else q_lengths.clamp(0, L)
    kl = torch.full((B,), S) if kv_lengths is None else kv_lengths.clamp(0, S)
    off = (kl - ql) if align == "bottom_right" else torch.zeros(B, dtype=torch.int64)
    off = off.view(B, 1, 1, 1)
    if alibi is not None:
        s = s - alibi.view(*alibi.shape[:-1], Hq, 1, 1) * (i + off - j).abs().to(s.dtype)
    allowed = (j < kl.view(B, 1, 1, 1)) & (i < ql.view(B, 1, 1, 1))
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        s = s + mask
    if is_causal:
        allowed = allowed & (j <= i + off)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (j >= i + off - left)
        if right >= 0:
            allowed = allowed & (j <= i + off + right)
    s = s.masked_fill(~allowed, float("-inf"))
    logits = s
    if sinks is not None:
        sink_col = sinks.to(s.dtype).view(-1, Hq, 1, 1).expand(B, Hq, L, 1)
        logits = torch.cat([s, sink_col], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe.unsqueeze(-1))
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v, lse


# -- against torch SDPA ----------------------------------------------------------------------
SDPA_CASES = {
    "plain": ((2, 3, 5, 8), (2, 3, 7, 8), None, {}),
    "scale": ((1, 2, 4, 8), (1, 2, 6, 8), None, {"scale": 0.3}),
    "causal_top_left": ((1, 2, 6, 4), (1, 2, 9, 4), None, {"is_causal": True}),
    "causal_bottom_right": ((1, 2, 4, 4), (1, 2, 9, 4), "lower_right", {}),
    "bool_mask": ((2, 2, 4, 4), (2, 2, 6, 4), ("bool", (2, 1, 4, 6)), {}),
    "float_mask_grad": ((2, 2, 4, 4), (2, 2, 6, 4), ("float", (2, 2, 4, 6)), {}),
    "float_mask_broadcast_grad": ((2, 2, 4, 4), (2, 2, 6, 4), ("float", (1, 4, 6)), {}),
    "gqa": ((2, 6, 4, 4), (2, 2, 5, 4), None, {"enable_gqa": True}),
    "gqa_causal_scale": ((1, 4, 5, 4), (1, 1, 5, 4), None,
                         {"enable_gqa": True, "is_causal": True, "scale": 0.5}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_forward_and_gradients_equal_torch_sdpa_autograd(case, dtype):
    q_shape, k_shape, mask_kind, opts = SDPA_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    q, k, v = (_randn(s, dtype, gen) for s in (q_shape, k_shape, k_shape))
    mask, ours_kw = None, {}
    if mask_kind == "lower_right":  # torch's bottom-right causal bias; ours is an option
        L, S = q_shape[-2], k_shape[-2]
        ref_mask = causal_lower_right(L, S)
        ours_kw = {"is_causal": True, "causal_align": "bottom_right"}
    elif mask_kind is not None:
        kind, shape = mask_kind
        if kind == "bool":
            mask = torch.rand(shape, generator=gen) < 0.6
            mask[..., 0] = True  # no empty rows (SDPA gives NaN there)
        else:
            mask = _randn(shape, dtype, gen)
        ref_mask = mask
    else:
        ref_mask = None

    def ours(q, k, v, mask):
        return SDPA(q, k, v, mask, **opts, **ours_kw)

    def ref(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, ref_mask, **opts)

    _compare(ours, ref, (q, k, v, mask), dtype, gen)


# -- against a plain eager torch attention (what SDPA lacks) ---------------------------------
@st.composite
def _calls(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2]))
    L, S = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    E = draw(st.sampled_from([4, 8]))
    opts = {
        "is_causal": draw(st.booleans()),
        "align": draw(st.sampled_from(["top_left", "bottom_right"])),
        "window": draw(st.none() | st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
        "softcap": draw(st.none() | st.sampled_from([0.7, 5.0])),
        "sinks": draw(st.booleans()),
        "alibi": draw(st.booleans()),
        "lengths": draw(st.booleans()),
        "mask": draw(st.sampled_from([None, "bool", "float"])),
    }
    return (B, Hkv, G, L, S, E), opts


def _eager_case(dims, opts, dtype, gen):
    B, Hkv, G, L, S, E = dims
    Hq = Hkv * G
    q = _randn((B, Hq, L, E), dtype, gen)
    k, v = (_randn((B, Hkv, S, E), dtype, gen) for _ in range(2))
    kw = dict(is_causal=opts["is_causal"], window=opts["window"], softcap=opts["softcap"],
              enable_gqa=G > 1)  # fmt: skip
    ours_kw = dict(kw, causal_align=opts["align"], return_lse=True)
    ref_kw = dict(kw, align=opts["align"])
    sinks = _randn((Hq,), dtype, gen) if opts["sinks"] else None
    mask = None
    if opts["mask"] == "bool":
        mask = torch.rand((B, 1, L, S), generator=gen) < 0.7
    elif opts["mask"] == "float":
        mask = _randn((1, Hq, L, S), dtype, gen)
    if opts["alibi"]:
        slopes = torch.rand((B, Hq), dtype=torch.float64, generator=gen).to(dtype)
        ours_kw["alibi_slopes"] = ref_kw["alibi"] = slopes
    if opts["lengths"]:
        ours_kw["q_lengths"] = ref_kw["q_lengths"] = torch.randint(0, L + 1, (B,), generator=gen)
        ours_kw["kv_lengths"] = ref_kw["kv_lengths"] = torch.randint(0, S + 1, (B,), generator=gen)

    def ours(q, k, v, mask, sinks):
        return SDPA(q, k, v, mask, sinks=sinks, **ours_kw)

    def ref(q, k, v, mask, sinks):
        return eager_attention(q, k, v, mask, sinks=sinks, **ref_kw)

    return ours, ref, (q, k, v, mask, sinks)


@FEW
@given(
    call=_calls(), dtype=st.sampled_from([torch.float64, torch.float32]), seed=st.integers(0, 99)
)
def test_options_sdpa_lacks_equal_an_eager_torch_attention(call, dtype, seed):
    """Sinks, softcap, windows, ALiBi, lengths, both alignments, with the LSE returned
    and a cotangent on it (d_lse flows); empty rows included."""
    dims, opts = call
    gen = torch.Generator().manual_seed(seed)
    ours, ref, leaves = _eager_case(dims, opts, dtype, gen)
    _compare(ours, ref, leaves, dtype, gen)


@pytest.mark.parametrize(
    "opts",
    [
        {
            "sinks": True,
            "softcap": 2.0,
            "window": (2, 1),
            "alibi": True,
            "lengths": True,
            "mask": "float",
            "is_causal": True,
            "align": "bottom_right",
        },
        {
            "sinks": True,
            "softcap": None,
            "window": None,
            "alibi": False,
            "lengths": False,
            "mask": None,
            "is_causal": False,
            "align": "top_left",
        },
    ],  # fmt: skip
    ids=["everything", "sinks"],
)
def test_every_option_at_once_equals_the_eager_attention(opts):
    gen = torch.Generator().manual_seed(5)
    ours, ref, leaves = _eager_case((2, 2, 2, 7, 9, 8), opts, torch.float64, gen)
    _compare(ours, ref, leaves, torch.float64, gen)


def test_gradcheck_against_finite_differences():
    gen = torch.Generator().manual_seed(1)
    q = _randn((1, 2, 3, 4), torch.float64, gen)
    k, v = (_randn((1, 1, 4, 4), torch.float64, gen) for _ in range(2))
    mask = _randn((3, 4), torch.float64, gen)
    sinks = _randn((2,), torch.float64, gen)

    def fn(q, k, v, mask, sinks):
        return SDPA(q, k, v, mask, is_causal=True, causal_align="bottom_right", softcap=3.0,
                    enable_gqa=True, sinks=sinks, return_lse=True)  # fmt: skip

    assert torch.autograd.gradcheck(fn, (q, k, v, mask, sinks))


# -- dropout ---------------------------------------------------------------------------------
def test_dropout_gradients_follow_arrayattn_dropout_mask():
    gen = torch.Generator().manual_seed(2)
    q = _randn((2, 4, 6, 8), torch.float64, gen)
    k, v = (_randn((2, 2, 7, 8), torch.float64, gen) for _ in range(2))
    p, seed = 0.3, 1234
    keep = aa.dropout_mask(q.detach(), k.detach(), p, seed, enable_gqa=True)
    assert isinstance(keep, torch.Tensor) and keep.shape == (2, 4, 6, 7)
    assert 0 < keep.float().mean() < 1

    def ours(q, k, v):
        return SDPA(q, k, v, dropout_p=p, seed=seed, enable_gqa=True)

    def ref(q, k, v):
        return eager_attention(q, k, v, enable_gqa=True, keep=keep, dropout_p=p)[0]

    _compare(ours, ref, (q, k, v), torch.float64, gen)


def test_dropout_seed_comes_from_torch_manual_seed_and_backward_reuses_it():
    gen = torch.Generator().manual_seed(3)
    q = _randn((1, 2, 5, 4), torch.float64, gen)
    g = torch.randn((1, 2, 5, 4), dtype=torch.float64, generator=gen)

    def run():
        out = SDPA(q, q, q, dropout_p=0.4)
        (dq,) = torch.autograd.grad(out, q, g)
        return out, dq

    torch.manual_seed(7)
    drawn = int(torch.randint(0, 2**32, (1,), dtype=torch.int64).item())
    torch.manual_seed(7)
    out1, dq1 = run()
    torch.manual_seed(7)
    out2, dq2 = run()
    assert torch.equal(out1, out2) and torch.equal(dq1, dq2)
    out3, _ = run()  # the generator moved on: another mask
    assert not torch.equal(out1, out3)

    # The drawn seed is the one the forward and the backward used.
    keep = aa.dropout_mask(q.detach(), q.detach(), 0.4, drawn)

    def ref(q):
        return eager_attention(q, q, q, keep=keep, dropout_p=0.4)[0]

    ref_out = ref(q)
    (ref_dq,) = torch.autograd.grad(ref_out, q, g)
    _close(out1, ref_out, torch.float64, "output")
    _close(dq1, ref_dq, torch.float64, "dq")


def test_activation_checkpointing_recomputes_the_same_dropout_mask():
    """torch.utils.checkpoint restores PyTorch's RNG state before recomputing: the seed
    drawn from it, hence the mask, is the forward's."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(11)
    q0 = torch.randn((1, 2, 6, 4), dtype=torch.float64, generator=gen)
    w = torch.randn((4, 4), dtype=torch.float64, generator=gen)

    def block(q):
        h = q @ w
        return SDPA(h, h, h, dropout_p=0.5, is_causal=True).tanh().sum()

    q1, q2 = q0.clone().requires_grad_(), q0.clone().requires_grad_()
    torch.manual_seed(3)
    (g1,) = torch.autograd.grad(checkpoint(block, q1, use_reentrant=False), q1)
    torch.manual_seed(3)
    (g2,) = torch.autograd.grad(block(q2), q2)
    assert torch.equal(g1, g2)


# -- autograd contract -----------------------------------------------------------------------
SUBSETS = [s for n in range(1, 6) for s in itertools.combinations("qkvms", n)]


@pytest.mark.parametrize("subset", ["".join(s) for s in SUBSETS[::3]] + ["s", "m", "qkvms"])
def test_gradients_only_for_the_inputs_that_require_them(subset):
    gen = torch.Generator().manual_seed(4)
    names = "qkvms"
    shapes = [(1, 2, 4, 4), (1, 2, 5, 4), (1, 2, 5, 4), (4, 5), (2,)]
    full = [_randn(s, torch.float64, gen) for s in shapes]
    cot = torch.randn((1, 2, 4, 4), dtype=torch.float64, generator=gen)
    SDPA(*full[:4], is_causal=True, sinks=full[4]).backward(cot)
    part = [
        x.detach().clone().requires_grad_(n in subset) for n, x in zip(names, full, strict=True)
    ]
    SDPA(*part[:4], is_causal=True, sinks=part[4]).backward(cot)
    for n, x, ref in zip(names, part, full, strict=True):
        if n in subset:
            _close(x.grad, ref.grad, torch.float64, n)
        else:
            assert x.grad is None, n


def test_only_sinks_requiring_grad_skips_the_attention_backward(monkeypatch):
    class NoBackward:
        def __init__(self, impl):
            self.forward = impl.forward

        def backward(self, *args):
            raise AssertionError("the attention backward ran for the sinks' gradient alone")

    select = _function.select
    monkeypatch.setattr(_function, "select", lambda *a: NoBackward(select(*a)))
    q = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    out = SDPA(q, q, q, sinks=sinks)
    (d_sinks,) = torch.autograd.grad(out.sum(), sinks)
    ref = eager_attention(q, q, q, sinks=sinks)[0]
    _close(d_sinks, torch.autograd.grad(ref.sum(), sinks)[0], torch.float64, "sinks")
    k = q.clone().requires_grad_()  # now the attention backward is needed
    with pytest.raises(AssertionError, match="the attention backward ran"):
        SDPA(q, k, q, sinks=sinks).sum().backward()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_build_no_graph_and_save_nothing(mode):
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    saved = []
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with context:
            out, lse = SDPA(q, q, q, is_causal=True, return_lse=True)
    assert out.grad_fn is None and not out.requires_grad and lse.grad_fn is None
    assert saved == []
    ref = F.scaled_dot_product_attention(q.detach(), q.detach(), q.detach(), is_causal=True)
    _close(out, ref, torch.float32)


def test_saves_only_inputs_output_and_lse_never_the_weights():
    B, H, L, S, D = 1, 2, 48, 64, 4  # L x S per head is far larger than any input
    q = torch.randn(B, H, L, D, requires_grad=True)
    k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(2))
    sinks = torch.zeros(H, requires_grad=True)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(tuple(t.shape)) or t, lambda t: t
    ):
        out = SDPA(q, k, v, is_causal=True, sinks=sinks)
    expected = [q.shape, k.shape, v.shape, sinks.shape, out.shape, (B, H, L)]
    assert sorted(saved) == sorted(tuple(s) for s in expected)
    assert all(np.prod(s) < L * S for s in saved)
    out.sum().backward()
    assert q.grad is not None and sinks.grad is not None


def test_non_contiguous_views_from_a_bld_layout_and_inputs_unchanged():
    gen = torch.Generator().manual_seed(6)
    base = [_randn((2, 5, 4, 8), torch.float32, gen) for _ in range(3)]  # (B, L, H, D)
    views = [x.transpose(1, 2) for x in base]
    assert not views[0].is_contiguous()
    before = [x.detach().clone() for x in base]
    cot = torch.randn((2, 4, 5, 8), generator=gen)
    out = SDPA(*views, is_causal=True)
    grads = torch.autograd.grad(out, base, cot)
    ref = F.scaled_dot_product_attention(*views, is_causal=True)
    ref_grads = torch.autograd.grad(ref, base, cot)
    _close(out, ref, torch.float32, "output")
    for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        _close(a, b, torch.float32, f"gradient {i}")
    assert all(torch.equal(x, b) for x, b in zip(base, before, strict=True))


def test_broadcast_cotangent_and_unused_lse():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    out, lse = SDPA(q, q, q, return_lse=True)
    (dq,) = torch.autograd.grad(out.sum(), q, retain_graph=True)  # a stride-0 cotangent
    ref = F.scaled_dot_product_attention(q, q, q)
    (ref_dq,) = torch.autograd.grad(ref.sum(), q)
    _close(dq, ref_dq, torch.float64, "dq")
    (dq_lse,) = torch.autograd.grad(lse.sum(), q)  # only the LSE gets a cotangent
    (ref_dq_lse,) = torch.autograd.grad(eager_attention(q, q, q)[1].sum(), q)
    _close(dq_lse, ref_dq_lse, torch.float64, "dq through the LSE")


def test_double_backward_is_refused():
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    out = SDPA(q, q, q)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_on_cpu_runs_our_backward(dtype):
    """float16 takes the NumPy fast path, bfloat16 (no NumPy dtype) the array-API paths
    in torch operations: both through arrayattn's Function, compared with float64."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (_randn((1, 2, 16, 16), dtype, gen) for _ in range(3))
    out = SDPA(q, k, v, is_causal=True)
    assert out.dtype == dtype and out.grad_fn.name() == "AttentionFunctionBackward"
    cot = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), cot.to(dtype))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), cot.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert a.dtype == dtype
        err = (a.double() - b).abs().max().item()
        assert err <= tol * b.abs().max().item(), err


def test_bfloat16_mask_and_sinks_next_to_float32_queries():
    """NumPy has no bfloat16: such a mask and sinks are widened (exactly) for the NumPy
    path, and their gradients come back in bfloat16."""
    gen = torch.Generator().manual_seed(10)
    q, k, v = (_randn((1, 2, 40, 16), torch.float32, gen) for _ in range(3))
    mask = _randn((40, 40), torch.bfloat16, gen)
    sinks = _randn((2,), torch.bfloat16, gen)
    cot = torch.randn((1, 2, 40, 16), generator=gen)
    leaves = (q, k, v, mask, sinks)
    out = SDPA(q, k, v, mask, sinks=sinks, implementation="fast")
    grads = torch.autograd.grad(out, leaves, cot)
    assert grads[3].dtype == grads[4].dtype == torch.bfloat16
    wide = [x.detach().float().requires_grad_() for x in leaves]
    ref = eager_attention(*wide[:4], sinks=wide[4])[0]
    ref_grads = torch.autograd.grad(ref, wide, cot)
    _close(out, ref, torch.float32, "output")
    for i, (a, b) in enumerate(zip(grads[:3], ref_grads[:3], strict=True)):
        _close(a, b, torch.float32, f"gradient {i}")
    for a, b in zip(grads[3:], ref_grads[3:], strict=True):  # one bfloat16 rounding
        assert (a.float() - b).abs().max() <= 2**-8 * b.abs().max()


# -- torch.compile ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_gives_the_eager_results(backend):
    gen = torch.Generator().manual_seed(9)
    q, k, v = (_randn((1, 2, 6, 8), torch.float64, gen) for _ in range(3))
    w = _randn((8, 8), torch.float64, gen)
    sinks = _randn((2,), torch.float64, gen)

    def model(q, k, v, w, sinks):
        out, lse = SDPA(q @ w, k, v, is_causal=True, sinks=sinks, return_lse=True)
        return (out.tanh() * 2).sum() + lse.sum()

    def reference(q, k, v, w, sinks):
        out, lse = eager_attention(q @ w, k, v, is_causal=True, sinks=sinks)
        return (out.tanh() * 2).sum() + lse.sum()

    leaves = (q, k, v, w, sinks)
    ref = reference(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    _close(loss, ref, torch.float64, "loss")
    for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        _close(a, b, torch.float64, f"gradient {i}")


# -- errors ----------------------------------------------------------------------------------
def test_bad_inputs_are_errors_naming_the_argument():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got numpy.ndarray"):
        SDPA(q.numpy(), q, q)
    with pytest.raises(TypeError, match=r"attn_mask must be a torch.Tensor, got builtins.list"):
        SDPA(q, q, q, [[True]])
    with pytest.raises(TypeError, match=r"value must be a torch.Tensor, got None"):
        SDPA(q, q, None)
    with pytest.raises(TypeError, match=r"key dtype torch.float64 differs from query dtype"):
        SDPA(q, q.double(), q)
    with pytest.raises(
        TypeError, match=r"key is on device meta but query is on device cpu; all tensors"
    ):
        SDPA(q, q.to("meta"), q)
    for bad in (torch.int32, torch.complex64):
        with pytest.raises(TypeError, match=r"query must have a real floating dtype"):
            SDPA(q.to(bad), q.to(bad), q.to(bad))
    slopes = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"alibi_slopes requires grad.*alibi_slopes.detach"):
        SDPA(q, q, q, alibi_slopes=slopes)
    with torch.no_grad():  # no gradient wanted: the slopes are fine
        SDPA(q, q, q, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        SDPA(q, q, q, dropout_p=1.5)


def test_cuda_tensors_without_cupy_say_what_to_install(monkeypatch):
    spec = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(_call.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"CuPy, which is not installed; pip install .*cuda12"):
        _call.route(spec, "auto")
    assert _call.route(spec, "chunked") == "chunked"  # the array-API path needs no CuPy
    assert _call.route(types.SimpleNamespace(device=torch.device("cpu")), "auto") == "auto"


# -- the package -----------------------------------------------------------------------------
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_import_without_torch_is_a_clear_import_error():
    done = _python(
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import arrayattn.torch\n"
        "except ImportError as e:\n    print('ImportError:', e)"
    )
    assert "ImportError: arrayattn.torch needs PyTorch" in done.stdout, done.stderr
    assert "pip install torch" in done.stdout


def test_import_does_not_import_transformers_and_unknown_names_fail():
    done = _python("import sys, arrayattn.torch; print('transformers' in sys.modules)")
    assert done.stdout.split() == ["False"], done.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        aat.nothing_here  # noqa: B018
