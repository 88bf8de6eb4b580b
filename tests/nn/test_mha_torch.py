"""MultiHeadAttention against PyTorch (forward and autograd gradients of inputs and every
parameter): ``torch.nn.MultiheadAttention`` with the same weights, and Hugging Face /
Meta style LLaMA attention layers written with torch here. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

from arrayattn.nn import MultiHeadAttention

torch = pytest.importorskip("torch")

TOL = dict(rtol=1e-9, atol=1e-11)


def t64(a, grad=True):
    return torch.tensor(np.asarray(a, np.float64), requires_grad=grad)


def random_params(mha, seed):
    params = mha.init(seed=seed, xp=np, dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    return {k: v + 0.2 * rng.standard_normal(v.shape) for k, v in params.items()}


@pytest.mark.parametrize("causal", [False, True])
def test_packed_self_attention_equals_torch_multihead_attention(causal):
    E, H, B, L = 12, 3, 2, 5
    mha = MultiHeadAttention(embed_dim=E, num_heads=H, packed_qkv=True, causal=causal)
    p = random_params(mha, 0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, E))
    lengths = np.array([5, 3])
    keep = np.arange(L)[None, :] < lengths[:, None]  # (B, S) True = attend
    dy = rng.standard_normal((B, L, E))

    ref = torch.nn.MultiheadAttention(E, H, bias=True, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.tensor(p["qkv_proj.weight"]))  # rows [q; k; v]
        ref.in_proj_bias.copy_(torch.tensor(p["qkv_proj.bias"]))
        ref.out_proj.weight.copy_(torch.tensor(p["o_proj.weight"]))
        ref.out_proj.bias.copy_(torch.tensor(p["o_proj.bias"]))
    xt = t64(x)
    causal_block = torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if causal else None
    out_t, _ = ref(
        xt, xt, xt, key_padding_mask=torch.tensor(~keep), attn_mask=causal_block, need_weights=False
    )
    out_t.backward(torch.tensor(dy))

    mask = keep[:, None, None, :]
    out, pullback = mha.vjp(p, x, attn_mask=mask)
    dx, _, dp = pullback(dy)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **TOL)
    np.testing.assert_allclose(dp["qkv_proj.weight"], ref.in_proj_weight.grad.numpy(), **TOL)
    np.testing.assert_allclose(dp["qkv_proj.bias"], ref.in_proj_bias.grad.numpy(), **TOL)
    np.testing.assert_allclose(dp["o_proj.weight"], ref.out_proj.weight.grad.numpy(), **TOL)
    np.testing.assert_allclose(dp["o_proj.bias"], ref.out_proj.bias.grad.numpy(), **TOL)


def test_cross_attention_equals_torch_multihead_attention_with_kdim():
    E, H, C, B, L, S = 12, 4, 7, 2, 3, 6
    mha = MultiHeadAttention(embed_dim=E, num_heads=H, context_dim=C)
    p = random_params(mha, 2)
    rng = np.random.default_rng(3)
    x, ctx = rng.standard_normal((B, L, E)), rng.standard_normal((B, S, C))
    dy = rng.standard_normal((B, L, E))

    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, kdim=C, vdim=C, dtype=torch.float64)
    with torch.no_grad():
        ref.q_proj_weight.copy_(torch.tensor(p["q_proj.weight"]))
        ref.k_proj_weight.copy_(torch.tensor(p["k_proj.weight"]))
        ref.v_proj_weight.copy_(torch.tensor(p["v_proj.weight"]))
        ref.in_proj_bias.copy_(
            torch.tensor(np.concatenate([p["q_proj.bias"], p["k_proj.bias"], p["v_proj.bias"]]))
        )
        ref.out_proj.weight.copy_(torch.tensor(p["o_proj.weight"]))
        ref.out_proj.bias.copy_(torch.tensor(p["o_proj.bias"]))
    xt, ct = t64(x), t64(ctx)
    out_t, _ = ref(xt, ct, ct, need_weights=False)
    out_t.backward(torch.tensor(dy))

    out, pullback = mha.vjp(p, x, ctx)
    dx, dctx, dp = pullback(dy)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **TOL)
    np.testing.assert_allclose(dctx, ct.grad.numpy(), **TOL)
    for ours, theirs in (
        ("q_proj.weight", ref.q_proj_weight),
        ("k_proj.weight", ref.k_proj_weight),
        ("v_proj.weight", ref.v_proj_weight),
        ("o_proj.weight", ref.out_proj.weight),
        ("o_proj.bias", ref.out_proj.bias),
    ):
        np.testing.assert_allclose(dp[ours], theirs.grad.numpy(), **TOL, err_msg=ours)
    bias_grad = ref.in_proj_bias.grad.numpy()
    np.testing.assert_allclose(
        np.concatenate([dp["q_proj.bias"], dp["k_proj.bias"], dp["v_proj.bias"]]), bias_grad, **TOL
    )


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hf_llama_attention(w, x, positions, Hq, Hkv, D, theta, qk_norm_eps=None, layout="half"):
    """A Hugging Face LlamaAttention / Qwen3Attention forward (rotate_half RoPE,
    repeat_kv, causal mask, optional per-head RMS q/k norm), or Meta's complex RoPE when
    ``layout="interleaved"``. ``w``: torch params by HF name."""
    B, L, _ = x.shape
    q = (x @ w["q_proj.weight"].T).view(B, L, Hq, D)
    k = (x @ w["k_proj.weight"].T).view(B, L, Hkv, D)
    v = (x @ w["v_proj.weight"].T).view(B, L, Hkv, D).transpose(1, 2)
    if qk_norm_eps is not None:
        q = _rms(q, w["q_norm.weight"], qk_norm_eps)
        k = _rms(k, w["k_norm.weight"], qk_norm_eps)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (L, D/2)
    if layout == "half":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()

        def rotate_half(t):
            return torch.cat((-t[..., D // 2 :], t[..., : D // 2]), dim=-1)

        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    else:  # Meta llama/model.py: view_as_complex on (B, L, H, D/2, 2)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[None, :, None, :]
        q = torch.view_as_real(torch.view_as_complex(q.reshape(B, L, Hq, -1, 2)) * freqs_cis)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(B, L, Hkv, -1, 2)) * freqs_cis)
        q = q.flatten(3).transpose(1, 2)
        k = k.flatten(3).transpose(1, 2)
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / D**0.5
    causal = torch.triu(torch.full((L, L), float("-inf"), dtype=torch.float64), 1)
    attn = torch.softmax(scores + causal, dim=-1) @ v
    return attn.transpose(1, 2).reshape(B, L, Hq * D) @ w["o_proj.weight"].T


@pytest.mark.parametrize(
    "layout, qk_norm, offset",
    [("half", None, 0), ("half", "rms", 7), ("interleaved", None, 3), ("interleaved", "rms", 0)],
)
def test_equals_hf_style_llama_attention_with_gqa_rope_and_qk_norm(layout, qk_norm, offset):
    E, Hq, Hkv, D, B, L = 16, 4, 2, 8, 2, 6
    mha = MultiHeadAttention(
        embed_dim=E,
        num_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        bias=False,
        rope=layout,
        rope_theta=500.0,
        qk_norm=qk_norm,
        causal=True,
    )
    p = random_params(mha, 4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B, L, E))
    dy = rng.standard_normal((B, L, E))
    w = {k: t64(v) for k, v in p.items()}
    xt = t64(x)
    out_t = hf_llama_attention(
        w,
        xt,
        torch.arange(offset, offset + L),
        Hq,
        Hkv,
        D,
        500.0,
        qk_norm_eps=1e-6 if qk_norm else None,
        layout=layout,
    )
    out_t.backward(torch.tensor(dy))

    out, pullback = mha.vjp(p, x, positions=offset)
    dx, _, dp = pullback(dy)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **TOL)
    assert set(dp) == set(w)
    for name in w:
        np.testing.assert_allclose(dp[name], w[name].grad.numpy(), **TOL, err_msg=name)


def test_timm_style_qk_layernorm_attention():
    """timm's Attention(qkv_bias=True, qk_norm=True): packed qkv, per-head LayerNorm."""
    E, H, B, L = 12, 3, 2, 4
    D = E // H
    mha = MultiHeadAttention(
        embed_dim=E, num_heads=H, packed_qkv=True, qk_norm="layer", norm_eps=1e-5
    )
    p = random_params(mha, 6)
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((B, L, E)), rng.standard_normal((B, L, E))
    w = {k: t64(v) for k, v in p.items()}
    xt = t64(x)
    qkv = (xt @ w["qkv_proj.weight"].T + w["qkv_proj.bias"]).reshape(B, L, 3, H, D)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    q = torch.nn.functional.layer_norm(q, (D,), w["q_norm.weight"], w["q_norm.bias"], 1e-5)
    k = torch.nn.functional.layer_norm(k, (D,), w["k_norm.weight"], w["k_norm.bias"], 1e-5)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out_t = o.transpose(1, 2).reshape(B, L, E) @ w["o_proj.weight"].T + w["o_proj.bias"]
    out_t.backward(torch.tensor(dy))
    out, pullback = mha.vjp(p, x)
    dx, _, dp = pullback(dy)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **TOL)
    for name in w:
        np.testing.assert_allclose(dp[name], w[name].grad.numpy(), **TOL, err_msg=name)


TORCH_NAMES = {
    "in_proj_weight": "qkv_proj.weight",
    "in_proj_bias": "qkv_proj.bias",
    "out_proj.weight": "o_proj.weight",
    "out_proj.bias": "o_proj.bias",
}


@pytest.mark.parametrize("average", [True, False])
def test_kdim_vdim_weights_and_float_mask_gradient_equal_torch(average):
    """The PyTorch tutorial's E_q != E_k != E_v, need_weights (averaged or per head) and
    a learned float mask whose gradient comes from the module's vjp."""
    E, H, Ck, Cv, B, L, S = 12, 3, 7, 5, 2, 3, 6
    mha = MultiHeadAttention(embed_dim=E, num_heads=H, context_dim=Ck, value_context_dim=Cv)
    p = random_params(mha, 8)
    rng = np.random.default_rng(9)
    x, k, v = (rng.standard_normal((B, n, d)) for n, d in ((L, E), (S, Ck), (S, Cv)))
    mask = rng.standard_normal((L, S))
    dy = rng.standard_normal((B, L, E))
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, kdim=Ck, vdim=Cv, dtype=torch.float64)
    with torch.no_grad():
        for ours, theirs in (("q", ref.q_proj_weight), ("k", ref.k_proj_weight)):
            theirs.copy_(torch.tensor(p[f"{ours}_proj.weight"]))
        ref.v_proj_weight.copy_(torch.tensor(p["v_proj.weight"]))
        ref.in_proj_bias.copy_(
            torch.tensor(np.concatenate([p["q_proj.bias"], p["k_proj.bias"], p["v_proj.bias"]]))
        )
        ref.out_proj.weight.copy_(torch.tensor(p["o_proj.weight"]))
        ref.out_proj.bias.copy_(torch.tensor(p["o_proj.bias"]))
    xt, kt, vt, mt = t64(x), t64(k), t64(v), t64(mask)
    out_t, w_t = ref(xt, kt, vt, attn_mask=mt, need_weights=True, average_attn_weights=average)
    out_t.backward(torch.tensor(dy))
    out, w = mha(p, x, k, value=v, attn_mask=mask, need_weights=True, average_attn_weights=average)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(w, w_t.detach().numpy(), **TOL)
    _, pullback = mha.vjp(p, x, k, value=v, attn_mask=mask)
    g = pullback(dy)
    np.testing.assert_allclose(g.x, xt.grad.numpy(), **TOL)
    np.testing.assert_allclose(g.context, kt.grad.numpy(), **TOL)
    np.testing.assert_allclose(g.value, vt.grad.numpy(), **TOL)
    np.testing.assert_allclose(g.attn_mask, mt.grad.numpy(), **TOL)
    np.testing.assert_allclose(g.params["v_proj.weight"], ref.v_proj_weight.grad.numpy(), **TOL)


def test_packed_cross_attention_loaded_from_a_torch_state_dict_equals_torch():
    """torch.nn.MultiheadAttention(E, H) called as cross-attention splits in_proj_weight's
    rows over query, key and value; its state dict loads through rename= as float64."""
    E, H, B, L, S = 12, 4, 2, 3, 5
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    mha = MultiHeadAttention(embed_dim=E, num_heads=H, packed_qkv=True)
    p = mha.load(ref.state_dict(), rename=TORCH_NAMES)
    assert p["qkv_proj.weight"].dtype == np.float64
    rng = np.random.default_rng(10)
    x, k, v = (rng.standard_normal((B, n, E)) for n in (L, S, S))
    dy = rng.standard_normal((B, L, E))
    xt, kt, vt = t64(x), t64(k), t64(v)
    out_t, _ = ref(xt, kt, vt, need_weights=False)
    out_t.backward(torch.tensor(dy))
    out, pullback = mha.vjp(p, x, k, value=v)
    g = pullback(dy)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    for ours, theirs in ((g.x, xt), (g.context, kt), (g.value, vt)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), **TOL)
    np.testing.assert_allclose(g.params["qkv_proj.weight"], ref.in_proj_weight.grad.numpy(), **TOL)
    np.testing.assert_allclose(g.params["qkv_proj.bias"], ref.in_proj_bias.grad.numpy(), **TOL)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_gpt_oss_attention_with_sinks_equals_transformers_eager_attention(sliding_window):
    """The attention core is transformers' own gpt-oss ``eager_attention_forward`` (sinks
    concatenated as an extra logit column); projections, GQA and rotate_half RoPE around it
    as in ``GptOssAttention``; forward and autograd gradients, the sinks' included."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    E, Hq, Hkv, D, B, L = 16, 4, 2, 4, 2, 6
    mha = MultiHeadAttention(
        embed_dim=E,
        num_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        sinks=True,
        rope="half",
        rope_theta=150000.0,
        causal=True,
        window=None if sliding_window is None else (sliding_window - 1, 0),
    )
    p = random_params(mha, 11)
    rng = np.random.default_rng(12)
    x, dy = rng.standard_normal((B, L, E)), rng.standard_normal((B, L, E))
    w = {k: t64(v) for k, v in p.items()}
    xt = t64(x)

    class Module(torch.nn.Module):
        num_key_value_groups = Hq // Hkv

        def __init__(self):
            super().__init__()
            self.sinks = w["sinks"]

    def proj(name, n):
        y = xt @ w[f"{name}.weight"].T + w[f"{name}.bias"]
        return y.view(B, L, n, D).transpose(1, 2)

    q, k, v = proj("q_proj", Hq), proj("k_proj", Hkv), proj("v_proj", Hkv)
    inv = 1.0 / 150000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rotate_half(t):
        return torch.cat((-t[..., D // 2 :], t[..., : D // 2]), dim=-1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (j > i - sliding_window)
    mask = torch.where(allowed, 0.0, float("-inf")).to(torch.float64)[None, None]
    o, _ = gpt_oss.eager_attention_forward(Module(), q, k, v, mask, scaling=D**-0.5)
    out_t = o.reshape(B, L, Hq * D) @ w["o_proj.weight"].T + w["o_proj.bias"]
    out_t.backward(torch.tensor(dy))

    out, pullback = mha.vjp(p, x)
    g = pullback(dy)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(g.x, xt.grad.numpy(), **TOL)
    for name in w:
        np.testing.assert_allclose(g.params[name], w[name].grad.numpy(), **TOL, err_msg=name)
