"""Conformance with PyTorch (pinned torch==2.13.0): forward and autograd gradients of
scaled_dot_product_attention, rms_norm, layer_norm, softmax, and RoPE as Hugging Face
(``rotate_half``) and Meta LLaMA (``view_as_complex``) write it. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

import arrayattn as aa

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _t(a, grad=True):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def _close(ours, theirs, rtol=1e-10, atol=1e-12, msg=""):
    a = ours.detach().numpy() if isinstance(ours, torch.Tensor) else np.asarray(ours)
    np.testing.assert_allclose(a, theirs.detach().numpy(), rtol=rtol, atol=atol, err_msg=msg)


def _compare(ours_fn, theirs_fn, arrays, opts_ours, opts_theirs, seed=0):
    """Forward and gradients: our vjp on torch arrays vs torch autograd. Float NumPy
    arrays become differentiable float64 tensors; bool arrays are passed as they are."""
    rng = np.random.default_rng(seed)
    leaves = [torch.tensor(a) if a.dtype == np.bool_ else _t(a) for a in arrays]
    ref_out = theirs_fn(*leaves, **opts_theirs)
    cot = rng.standard_normal(tuple(ref_out.shape))
    (ref_out * torch.tensor(cot)).sum().backward()
    out, pullback = aa.vjp(ours_fn, *(torch.tensor(a) for a in arrays), **opts_ours)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    _close(out, ref_out, msg="forward")
    grads = pullback(torch.tensor(cot))
    for i, (g, leaf) in enumerate(zip(grads, leaves, strict=True)):
        if leaf.requires_grad:
            _close(g, leaf.grad, msg=f"gradient {i}")
        else:
            assert g is None, f"gradient {i} of a bool mask must be None"


SDPA_CASES = [
    ("plain", (2, 3, 5, 8), (2, 3, 7, 8), None, {}),
    ("scale", (1, 2, 4, 8), (1, 2, 6, 8), None, {"scale": 0.3}),
    ("causal_square", (1, 2, 6, 4), (1, 2, 6, 4), None, {"is_causal": True}),
    ("causal_L<S", (1, 2, 3, 4), (1, 2, 6, 4), None, {"is_causal": True}),
    ("causal_L>S", (1, 2, 6, 4), (1, 2, 4, 4), None, {"is_causal": True}),
    ("bool_mask", (2, 2, 4, 4), (2, 2, 6, 4), ("bool", (2, 1, 4, 6)), {}),
    ("float_mask", (2, 2, 4, 4), (2, 2, 6, 4), ("float", (2, 2, 4, 6)), {}),
    ("float_mask_bcast", (2, 2, 4, 4), (2, 2, 6, 4), ("float", (4, 6)), {}),
    ("gqa", (2, 6, 4, 4), (2, 2, 5, 4), None, {"enable_gqa": True}),
    (
        "gqa_causal_scale",
        (1, 4, 5, 4),
        (1, 1, 5, 4),
        None,
        {"enable_gqa": True, "is_causal": True, "scale": 0.5},
    ),
    ("gqa_mask", (1, 4, 3, 4), (1, 2, 5, 4), ("float", (1, 4, 3, 5)), {"enable_gqa": True}),
    ("value_dim", (1, 2, 3, 4), (1, 2, 5, 4), None, {}),
    ("3d", (3, 4, 4), (3, 6, 4), ("bool", (4, 6)), {}),
]


@pytest.mark.parametrize(
    "name, q_shape, k_shape, mask, kwargs", SDPA_CASES, ids=[c[0] for c in SDPA_CASES]
)
def test_sdpa_forward_and_gradients(name, q_shape, k_shape, mask, kwargs):
    rng = np.random.default_rng(len(name))
    q = rng.standard_normal(q_shape)
    k = rng.standard_normal(k_shape)
    v_shape = k_shape[:-1] + (3,) if name == "value_dim" else k_shape
    v = rng.standard_normal(v_shape)
    arrays = [q, k, v]
    if mask is not None:
        kind, shape = mask
        if kind == "bool":
            m = rng.random(shape) < 0.7
            m[..., 0] = True  # torch returns NaN on fully masked rows; we return 0
        else:
            m = rng.standard_normal(shape)
        arrays.append(m)

    def theirs(q, k, v, m=None, **kw):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)

    _compare(aa.scaled_dot_product_attention, theirs, arrays, kwargs, kwargs)


def test_sdpa_bool_mask_forward_and_gradients():
    """A boolean mask passed as a torch bool tensor to both (not differentiated)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 4, 4), (2, 2, 6, 4), (2, 2, 6, 4)))
    m = rng.random((2, 1, 4, 6)) < 0.6
    m[..., 2] = True
    tq, tk, tv = _t(q), _t(k), _t(v)
    tm = torch.tensor(m)
    ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=False)
    cot = rng.standard_normal(tuple(ref.shape))
    (ref * torch.tensor(cot)).sum().backward()
    out, pullback = aa.vjp(
        aa.scaled_dot_product_attention, torch.tensor(q), torch.tensor(k), torch.tensor(v), tm
    )
    _close(out, ref)
    dq, dk, dv, dm = pullback(torch.tensor(cot))
    assert dm is None
    for g, leaf in ((dq, tq), (dk, tk), (dv, tv)):
        _close(g, leaf.grad)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sdpa_low_precision_close_to_torch(dtype):
    rng = np.random.default_rng(2)
    dt = getattr(torch, dtype)
    q, k, v = (
        torch.tensor(rng.standard_normal(s), dtype=dt)
        for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8))
    )
    ref = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True
    )
    out = aa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == dt
    tol = 4e-3 if dtype == "float16" else 3e-5
    _close(out.double(), ref, rtol=tol, atol=tol)


def test_sdpa_dropout_statistics_match_torch_convention():
    """Torch's dropout RNG differs; both scale kept probabilities by 1/(1-p). With one
    query row and all-equal keys, every kept weight is exactly 1/(S (1-p))."""
    S, p = 64, 0.25
    q = torch.zeros((1, 1, 1, 4), dtype=torch.float64)
    k = torch.zeros((1, 1, S, 4), dtype=torch.float64)
    w = aa.attention_weights(q, k, dropout_p=p, seed=0)
    kept = w[w > 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (S * (1 - p))))


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_rms_norm(with_weight, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8))
    w = rng.standard_normal(8) if with_weight else None
    if dtype == "float64":
        tx, tw = _t(x), (None if w is None else _t(w))
        ref = F.rms_norm(tx, (8,), tw, eps=1e-6)
        cot = rng.standard_normal(tuple(ref.shape))
        (ref * torch.tensor(cot)).sum().backward()
        out, pullback = aa.vjp(
            aa.rms_norm, torch.tensor(x), None if w is None else torch.tensor(w), 1e-6
        )
        _close(out, ref)
        grads = pullback(torch.tensor(cot))
        _close(grads[0], tx.grad)
        if with_weight:
            _close(grads[1], tw.grad)
        else:
            assert grads[1] is None
        return
    # low precision: compared with torch's float64 result at the dtype's tolerance
    dt = getattr(torch, dtype)
    tx = torch.tensor(x, dtype=dt)
    tw = None if w is None else torch.tensor(w, dtype=dt)
    ours = aa.rms_norm(tx, tw, 1e-6)
    ref = F.rms_norm(tx.double(), (8,), None if tw is None else tw.double(), eps=1e-6)
    assert ours.dtype == dt
    tol = 8e-3 if dtype == "float16" else 3e-5
    _close(ours.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("weight, bias", [(True, True), (False, False), (True, False)])
def test_layer_norm(weight, bias):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6)) * 3 + 1
    w = rng.standard_normal(6) if weight else None
    b = rng.standard_normal(6) if bias else None
    tx, tw, tb = _t(x), (None if w is None else _t(w)), (None if b is None else _t(b))
    ref = F.layer_norm(tx, (6,), tw, tb, eps=1e-5)
    cot = rng.standard_normal(tuple(ref.shape))
    (ref * torch.tensor(cot)).sum().backward()
    out, pullback = aa.vjp(
        aa.layer_norm,
        torch.tensor(x),
        None if w is None else torch.tensor(w),
        None if b is None else torch.tensor(b),
        1e-5,
    )
    _close(out, ref)
    dx, dw, db, _ = pullback(torch.tensor(cot))
    _close(dx, tx.grad)
    if weight:
        _close(dw, tw.grad)
    if bias:
        _close(db, tb.grad)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax(dim):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 5)) * 4
    _compare(
        aa.softmax,
        lambda t, axis: torch.softmax(t, dim=axis),
        [x],
        {"axis": dim},
        {"axis": dim},
    )


# -- RoPE as the reference implementations write it ------------------------------------


def _hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _hf_rope(x, positions, head_dim, base=10000.0):
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb (one tensor)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    freqs = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return (x * cos) + (_hf_rotate_half(x) * sin)


def _meta_rope(x, start, end, head_dim, theta=10000.0):
    """Meta LLaMA's precompute_freqs_cis + apply_rotary_emb (float64 variant)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: (head_dim // 2)].double() / head_dim))
    t = torch.arange(start, end, dtype=torch.float64)
    freqs_cis = torch.polar(
        torch.ones(end - start, head_dim // 2, dtype=torch.float64), torch.outer(t, freqs)
    )
    x_ = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("start", [0, 7])
def test_rope_half_matches_hf_rotate_half(start):
    rng = np.random.default_rng(6)
    B, H, L, D = 2, 3, 5, 8
    x = _t(rng.standard_normal((B, H, L, D)))
    positions = torch.arange(start, start + L)
    ref = _hf_rope(x, positions, D)
    cot = torch.tensor(rng.standard_normal((B, H, L, D)))
    (ref * cot).sum().backward()
    freqs = aa.rope_frequencies(D, positions, dtype=torch.float64)
    out, pullback = aa.vjp(aa.apply_rope, x.detach(), freqs, layout="half")
    _close(out, ref)
    dx, dfreqs = pullback(cot)
    assert dfreqs is None
    _close(dx, x.grad)


@pytest.mark.parametrize("start", [0, 7])
def test_rope_interleaved_matches_meta_view_as_complex(start):
    rng = np.random.default_rng(7)
    B, L, H, D = 2, 5, 3, 8
    x = _t(rng.standard_normal((B, H, L, D)))
    ref = _meta_rope(x, start, start + L, D)
    cot = torch.tensor(rng.standard_normal((B, H, L, D)))
    (ref * cot).sum().backward()
    freqs = aa.rope_frequencies(D, torch.arange(start, start + L), dtype=torch.float64)
    out, pullback = aa.vjp(aa.apply_rope, x.detach(), freqs, layout="interleaved")
    _close(out, ref)
    _close(pullback(cot)[0], x.grad)


def test_rope_float32_default_frequencies_close_to_hf():
    """Default (float32 angles, complex64) on float32 input, as HF computes in float32."""
    rng = np.random.default_rng(8)
    x = torch.tensor(rng.standard_normal((1, 2, 6, 16)), dtype=torch.float32)
    positions = torch.arange(6)
    ref = _hf_rope(x.double(), positions, 16)
    out = aa.apply_rope(x, aa.rope_frequencies(16, positions), layout="half")
    assert out.dtype == torch.float32
    _close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_partial_rotary_matches_neox_style():
    """GPT-NeoX partial rotary: rotate the first rotary_dim features, pass the rest."""
    rng = np.random.default_rng(9)
    x = _t(rng.standard_normal((1, 2, 4, 10)), grad=False)
    rot = 6
    positions = torch.arange(4)
    ref = torch.cat((_hf_rope(x[..., :rot], positions, rot), x[..., rot:]), dim=-1)
    out = aa.apply_rope(x, aa.rope_frequencies(rot, positions, dtype=torch.float64), layout="half")
    _close(out, ref)


def test_hf_style_finfo_min_padding_mask():
    """Hugging Face builds additive masks with finfo(dtype).min (not -inf): a padded key
    gets ~zero weight, and a fully padded query row is uniform, as in torch."""
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 4, 4), (2, 2, 5, 4), (2, 2, 5, 4)))
    lengths = np.array([5, 3])
    keep = np.arange(5)[None, :] < lengths[:, None]  # (B, S)
    causal = np.tril(np.ones((4, 5), dtype=bool), k=1)
    allowed = keep[:, None, None, :] & causal[None, None]
    allowed[1, :, 0, :] = False  # one fully masked row
    bias = np.where(allowed, 0.0, np.finfo(np.float64).min)
    _compare(
        aa.scaled_dot_product_attention,
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        [q, k, v, bias],
        {},
        {},
    )


AUTOGRAD_CASES = {
    "plain": {},
    "causal_bottom_right": {"is_causal": True, "causal_align": "bottom_right"},
    "bool_mask": {"mask": "bool"},
    "float_mask": {"mask": "float"},
    "gqa": {"enable_gqa": True, "kv_heads": 2},
    "window_softcap": {"window": (2, 1), "softcap": 3.0},
    "lengths": {"q_lengths": [4, 6], "kv_lengths": [7, 3], "is_causal": True},
    "sinks_alibi": {"sinks": True, "alibi_slopes": [0.5, 0.25, 0.125, 0.0625]},
    "dropout": {"dropout_p": 0.3, "seed": 7},
}


@pytest.mark.parametrize("implementation", ["auto", "composed", "chunked"])
@pytest.mark.parametrize("case", list(AUTOGRAD_CASES))
def test_torch_autograd_through_sdpa_equals_the_manual_backward(implementation, case):
    """Tensors that require grad: PyTorch's autograd follows the array-API path op by op
    (no in-place step it needs undone, no ``out=``) and its gradients equal our
    hand-written backward's (``aa.vjp``), itself checked against PyTorch above."""
    opts = dict(AUTOGRAD_CASES[case])
    rng = np.random.default_rng(sorted(AUTOGRAD_CASES).index(case))
    hkv = opts.pop("kv_heads", 4)
    arrays = [rng.standard_normal((2, 4, 6, 8))]
    arrays += [rng.standard_normal((2, hkv, 7, 8)) for _ in range(2)]
    mask = opts.pop("mask", None)
    if mask == "bool":
        m = rng.random((2, 1, 6, 7)) < 0.7
        m[..., 0] = True
        arrays.append(m)
    elif mask == "float":
        arrays.append(rng.standard_normal((2, 4, 6, 7)))
    for name in ("q_lengths", "kv_lengths"):
        if name in opts:
            opts[name] = torch.tensor(opts[name], dtype=torch.int32)
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = torch.tensor(opts["alibi_slopes"], dtype=torch.float64)
    sinks = rng.standard_normal(4) if opts.pop("sinks", False) else None
    opts["implementation"] = implementation

    leaves = [torch.tensor(a) if a.dtype == np.bool_ else _t(a) for a in arrays]
    sink_leaf = None if sinks is None else _t(sinks)
    extra = {} if sinks is None else {"sinks": sink_leaf}
    out = aa.scaled_dot_product_attention(*leaves, **opts, **extra)
    assert out.requires_grad
    cot = rng.standard_normal(tuple(out.shape))
    (out * torch.tensor(cot)).sum().backward()

    plain = [torch.tensor(a) for a in arrays]
    extra = {} if sinks is None else {"sinks": torch.tensor(sinks)}
    want, pullback = aa.vjp(aa.scaled_dot_product_attention, *plain, **opts, **extra)
    _close(out, want, msg="forward")
    grads = pullback(torch.tensor(cot))
    for i, leaf in enumerate(leaves):
        if leaf.requires_grad:
            _close(leaf.grad, grads[i], rtol=1e-9, atol=1e-11, msg=f"gradient {i}")
    if sinks is not None:
        _close(sink_leaf.grad, grads[-1]["sinks"], rtol=1e-9, atol=1e-11, msg="sinks")


def _autograd_ops():
    """``(op, differentiable arrays, other arguments)``."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 4, 6, 8))
    w, b = rng.standard_normal(8), rng.standard_normal(8)
    packed = rng.standard_normal((4, 10, 8))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    freqs = torch.tensor(aa.rope_frequencies(8, 6, xp=np))
    varlen = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "is_causal": True}
    return {
        "rms_norm": (aa.rms_norm, [x, w], {}),
        "layer_norm": (aa.layer_norm, [x, w, b], {}),
        "softmax": (aa.softmax, [x], {"axis": -1}),
        "apply_rope": (aa.apply_rope, [x], {"freqs": freqs}),
        "attention_weights": (aa.attention_weights, [x, x], {"is_causal": True}),
        "varlen_chunked": (
            aa.varlen_attention,
            [packed, packed + 1, packed - 1],
            {**varlen, "implementation": "chunked"},
        ),
    }


@pytest.mark.parametrize("name", list(_autograd_ops()))
def test_torch_autograd_through_other_ops_equals_the_manual_backward(name):
    fn, arrays, opts = _autograd_ops()[name]
    leaves = [_t(a) for a in arrays]
    out = fn(*leaves, **opts)
    cot = np.random.default_rng(12).standard_normal(tuple(out.shape))
    (out * torch.tensor(cot)).sum().backward()
    want, pullback = aa.vjp(fn, *(torch.tensor(a) for a in arrays), **opts)
    _close(out, want, msg="forward")
    for i, (leaf, g) in enumerate(zip(leaves, pullback(torch.tensor(cot)), strict=False)):
        _close(leaf.grad, g, rtol=1e-9, atol=1e-11, msg=f"gradient {i}")
