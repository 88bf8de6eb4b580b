"""MultiHeadAttention: forward against a plain NumPy float64 reference, every gradient
(inputs and parameters) against finite differences, KV-cache decoding, cross-attention,
GQA, qk-norm and RoPE variants, parameter loading; on every backend where practical."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mha_reference import mha as reference_mha

import arrayattn as aa
from arrayattn._backend import device_of
from arrayattn.nn import KVCache, MultiHeadAttention
from arrayattn.ops import attention as attention_module

CONFIGS = {
    "mha-bias": dict(embed_dim=12, num_heads=3),
    "gqa-causal": dict(embed_dim=12, num_heads=4, num_kv_heads=2, bias=False, causal=True),
    "mqa-rope-half": dict(embed_dim=16, num_heads=4, num_kv_heads=1, causal=True, rope="half"),
    "rope-interleaved-rmsnorm": dict(
        embed_dim=16,
        num_heads=2,
        rope="interleaved",
        qk_norm="rms",
        causal=True,
        bias=False,
        out_bias=True,
    ),
    "packed-layernorm": dict(embed_dim=12, num_heads=3, packed_qkv=True, qk_norm="layer"),
    "head-dim-theta": dict(
        embed_dim=12,
        num_heads=2,
        head_dim=4,
        num_kv_heads=1,
        rope="half",
        rope_theta=100.0,
        scale=0.3,
    ),
    "packed-gqa-window": dict(
        embed_dim=12,
        num_heads=4,
        num_kv_heads=2,
        packed_qkv=True,
        causal=True,
        window=(2, 0),
    ),
}
CROSS = dict(embed_dim=12, num_heads=4, num_kv_heads=2, context_dim=7, qk_norm="rms")


def window_mask(cfg, L, S):
    """The window part of the mask for the reference (which knows only causal)."""
    if cfg.window is None:
        return None
    left, right = cfg.window
    i, j = np.arange(L)[:, None] + (S - L), np.arange(S)[None, :]
    ok = np.ones((L, S), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def inputs(cfg, rng, B=2, L=5, S=None):
    x = rng.standard_normal((B, L, cfg.embed_dim))
    ctx = None if S is None else rng.standard_normal((B, S, cfg.kv_input_dim))
    return x, ctx


def perturbed_params(mha, seed):
    """Random parameters (norm weights/biases too, so their gradients are not special)."""
    params = mha.init(seed=seed, xp=np, dtype=np.float64)
    rng = np.random.default_rng(seed + 100)
    return {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in params.items()}


def padding_mask(B, S, rng):
    lengths = rng.integers(S // 2 + 1, S + 1, size=B)
    return (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


def on_backend_device(backend, x):
    return device_of(x) == device_of(backend.asarray(np.zeros(1)))


def to_backend(backend, tree):
    return {k: backend.asarray(v) for k, v in tree.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_reference(backend, name):
    mha = MultiHeadAttention(**CONFIGS[name])
    rng = np.random.default_rng(0)
    p = perturbed_params(mha, 1)
    x, _ = inputs(mha, rng)
    mask = padding_mask(2, 5, rng)
    win = window_mask(mha, 5, 5)
    ref = reference_mha(mha, p, x, mask=mask if win is None else mask & win)
    out = mha(to_backend(backend, p), backend.asarray(x), attn_mask=backend.asarray(mask))
    assert on_backend_device(backend, out)
    np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=1e-10, atol=1e-12)


def test_float32_forward_close_to_float64_reference(backend):
    mha = MultiHeadAttention(**CONFIGS["rope-interleaved-rmsnorm"])
    p = mha.init(seed=3, xp=backend.xp, device=backend.device, dtype=backend.xp.float32)
    x = np.random.default_rng(4).standard_normal((2, 6, 16)).astype(np.float32)
    out = mha(p, backend.asarray(x))
    assert out.dtype == backend.xp.float32
    p64 = {k: backend.to_numpy(v) for k, v in p.items()}
    ref = reference_mha(mha, p64, x)
    np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=1e-4, atol=2e-5)


def fd_check(mha, params, x, context=None, rng=None, eps=1e-5, **kw):
    """Directional central differences for x, context and every parameter."""
    rng = rng or np.random.default_rng(7)
    out, pullback = mha.vjp(params, x, context, **kw)
    dy = rng.standard_normal(out.shape)
    dx, dctx, dparams = pullback(dy)
    assert set(dparams) == set(params), "a gradient per parameter, no more"
    assert (dctx is None) == (context is None)

    def loss(p, xx, cc):
        return float(np.sum(mha(p, xx, cc, **kw) * dy))

    def check(label, analytic, shift):
        for _ in range(2):
            u = rng.standard_normal(analytic.shape)
            num = (loss(*shift(eps * u)) - loss(*shift(-eps * u))) / (2 * eps)
            ana = float(np.sum(analytic * u))
            assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)), (label, num, ana)

    for name in params:
        assert dparams[name].shape == params[name].shape
        check(name, dparams[name], lambda d, n=name: ({**params, n: params[n] + d}, x, context))
    check("x", dx, lambda d: (params, x + d, context))
    if context is not None:
        check("context", dctx, lambda d: (params, x, context + d))
    return out, (dx, dctx, dparams)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_gradient_against_finite_differences(name):
    mha = MultiHeadAttention(**CONFIGS[name])
    rng = np.random.default_rng(5)
    x, _ = inputs(mha, rng)
    fd_check(mha, perturbed_params(mha, 2), x, attn_mask=padding_mask(2, 5, rng))


def test_rope_positions_offset_and_per_batch_gradients():
    mha = MultiHeadAttention(**CONFIGS["mqa-rope-half"])
    rng = np.random.default_rng(6)
    x, _ = inputs(mha, rng)
    p = perturbed_params(mha, 3)
    positions = np.array([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    out = mha(p, x, positions=positions)
    np.testing.assert_allclose(out, reference_mha(mha, p, x, positions=positions), rtol=1e-10)
    np.testing.assert_allclose(
        mha(p, x, positions=3), reference_mha(mha, p, x, positions=np.arange(3, 8)), rtol=1e-10
    )
    fd_check(mha, p, x, positions=positions)


def test_cross_attention_with_l_ne_s(backend):
    mha = MultiHeadAttention(**CROSS)
    rng = np.random.default_rng(8)
    x, ctx = inputs(mha, rng, L=3, S=7)
    p = perturbed_params(mha, 4)
    mask = padding_mask(2, 7, rng)
    ref = reference_mha(mha, p, x, ctx, mask=mask)
    out = mha(
        to_backend(backend, p),
        backend.asarray(x),
        backend.asarray(ctx),
        attn_mask=backend.asarray(mask),
    )
    assert out.shape == (2, 3, 12)
    np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=1e-10, atol=1e-12)
    if backend.name == "numpy":
        fd_check(mha, p, x, ctx, attn_mask=mask)


@pytest.mark.parametrize("name", ["gqa-causal", "packed-layernorm", "rope-interleaved-rmsnorm"])
def test_vjp_on_backend_equals_numpy(backend, name):
    mha = MultiHeadAttention(**CONFIGS[name])
    rng = np.random.default_rng(9)
    x, _ = inputs(mha, rng)
    p = perturbed_params(mha, 5)
    dy = rng.standard_normal((2, 5, mha.embed_dim))
    _, pb = mha.vjp(p, x)
    dx, _, dp = pb(dy)
    out_b, pb_b = mha.vjp(to_backend(backend, p), backend.asarray(x))
    dx_b, dctx_b, dp_b = pb_b(backend.asarray(dy))
    assert dctx_b is None
    np.testing.assert_allclose(backend.to_numpy(dx_b), dx, rtol=1e-10, atol=1e-12)
    for k in dp:
        assert on_backend_device(backend, dp_b[k])
        np.testing.assert_allclose(backend.to_numpy(dp_b[k]), dp[k], rtol=1e-10, atol=1e-12)


def test_dropout_gradients_with_fixed_seed():
    mha = MultiHeadAttention(embed_dim=12, num_heads=3, num_kv_heads=1, dropout_p=0.3)
    rng = np.random.default_rng(10)
    x, _ = inputs(mha, rng)
    p = perturbed_params(mha, 6)
    out = mha(p, x, training=True, seed=1234)
    keep = np.asarray(
        aa.dropout_mask(np.zeros((2, 3, 5, 4)), np.zeros((2, 3, 5, 4)), 0.3, seed=1234)
    )
    np.testing.assert_allclose(out, reference_mha(mha, p, x, keep=keep), rtol=1e-10)
    assert not np.allclose(out, mha(p, x))  # evaluation mode: no dropout
    np.testing.assert_array_equal(out, mha(p, x, training=True, seed=1234))
    fd_check(mha, p, x, training=True, seed=1234)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = MultiHeadAttention(
        embed_dim=16, num_heads=4, num_kv_heads=2, causal=True, rope="half", qk_norm="rms"
    )
    full = MultiHeadAttention(embed_dim=16, num_heads=4, causal=True, rope="half", qk_norm="rms")
    p = perturbed_params(gqa, 11)
    D, G = 4, 2

    def repeat_rows(w):  # KV head h serves query heads h*G .. h*G+G-1
        blocks = w.reshape(2, D, *w.shape[1:])
        return np.repeat(blocks, G, axis=0).reshape(4 * D, *w.shape[1:])

    pf = dict(p)
    for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        pf[name] = repeat_rows(p[name])
    x = np.random.default_rng(12).standard_normal((2, 6, 16))
    np.testing.assert_allclose(gqa(p, x), full(pf, x), rtol=1e-12, atol=1e-13)
    dy = np.random.default_rng(13).standard_normal((2, 6, 16))
    dx_g, _, dp_g = gqa.vjp(p, x)[1](dy)
    dx_f, _, dp_f = full.vjp(pf, x)[1](dy)
    np.testing.assert_allclose(dx_g, dx_f, rtol=1e-10, atol=1e-12)
    for name in ("k_proj.weight", "v_proj.bias"):  # the shared rows' gradients add up
        summed = dp_f[name].reshape(2, G, D, *dp_f[name].shape[1:]).sum(axis=1)
        np.testing.assert_allclose(dp_g[name], summed.reshape(dp_g[name].shape), rtol=1e-10)


@pytest.mark.parametrize(
    "name", ["gqa-causal", "mqa-rope-half", "rope-interleaved-rmsnorm", "packed-gqa-window"]
)
def test_kv_cache_decoding_equals_full_sequence(backend, name):
    mha = MultiHeadAttention(**CONFIGS[name])
    rng = np.random.default_rng(14)
    T = 7
    x = rng.standard_normal((2, T, mha.embed_dim))
    p = perturbed_params(mha, 7)
    full = mha(p, x)
    pb = to_backend(backend, p)
    cache = mha.new_cache(2, 10, xp=backend.xp, device=backend.device, dtype=backend.xp.float64)
    pieces = [mha(pb, backend.asarray(x[:, :3]), cache=cache)]  # prefill 3 tokens
    for t in range(3, T):  # then one token at a time
        step = mha(pb, backend.asarray(x[:, t : t + 1]), cache=cache)
        assert cache.length == t + 1
        np.testing.assert_allclose(
            backend.to_numpy(step), full[:, t : t + 1], rtol=1e-10, atol=1e-12
        )
        pieces.append(step)
    assert cache.in_place == (backend.name != "jax")


def test_kv_cache_in_place_and_functional_fallback(monkeypatch):
    mha = MultiHeadAttention(**CONFIGS["mqa-rope-half"])
    x = np.random.default_rng(15).standard_normal((1, 4, 16))
    p = perturbed_params(mha, 8)
    full = mha(p, x)
    cache = mha.new_cache(1, 6, dtype=np.float64)
    buffer = cache.keys
    outs = [mha(p, x[:, t : t + 1], cache=cache) for t in range(4)]
    assert cache.keys is buffer  # written in place, no new buffer
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-10)
    monkeypatch.setattr(KVCache, "in_place", property(lambda self: False))
    cache = mha.new_cache(1, 6, dtype=np.float64)
    buffer = cache.keys
    outs = [mha(p, x[:, t : t + 1], cache=cache) for t in range(4)]
    assert cache.keys is not buffer and not np.any(buffer)  # new arrays, old one untouched
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-10)
    with pytest.raises(ValueError, match="overflow"):
        mha(p, np.zeros((1, 3, 16)), cache=cache)


@pytest.mark.parametrize("qk_norm", [None, "rms", "layer"])
def test_cross_attention_cache_is_filled_once_and_reused(backend, qk_norm, monkeypatch):
    # Encoder-decoder decoding: the context's keys/values are projected on the first
    # call and reused by every later step; each step equals the uncached call.
    mha = MultiHeadAttention(**{**CROSS, "qk_norm": qk_norm})
    rng = np.random.default_rng(21)
    x, ctx = inputs(mha, rng, B=2, L=4, S=6)
    p = perturbed_params(mha, 9)
    mask = padding_mask(2, 6, rng)
    full = mha(p, x, ctx, attn_mask=mask)
    pb, ctx_b, mask_b = to_backend(backend, p), backend.asarray(ctx), backend.asarray(mask)
    cache = mha.new_cache(2, 6, xp=backend.xp, device=backend.device, dtype=backend.xp.float64)
    projected = []
    real_linear = aa.nn.attention.forward.linear

    def counting_linear(inp, weight, bias=None):
        projected.append(int(inp.shape[-1]))
        return real_linear(inp, weight, bias)

    monkeypatch.setattr(aa.nn.attention.forward, "linear", counting_linear)
    for t in range(4):
        step = mha(pb, backend.asarray(x[:, t : t + 1]), ctx_b, attn_mask=mask_b, cache=cache)
        assert cache.length == 6
        np.testing.assert_allclose(
            backend.to_numpy(step), full[:, t : t + 1], rtol=1e-10, atol=1e-12
        )
    # Context projections (input width context_dim=7) ran on the first call only.
    assert projected.count(mha.kv_input_dim) == 2
    with pytest.raises(ValueError, match="cache.reset"):
        mha(pb, backend.asarray(x[:, :1]), backend.asarray(ctx[:, :5]), cache=cache)
    cache.reset()
    out = mha(pb, backend.asarray(x[:, :1]), backend.asarray(ctx[:, :5]), cache=cache)
    np.testing.assert_allclose(
        backend.to_numpy(out), mha(p, x[:, :1], ctx[:, :5]), rtol=1e-10, atol=1e-12
    )


def test_kv_cache_with_padding_mask_over_prefix():
    mha = MultiHeadAttention(**CONFIGS["gqa-causal"])
    rng = np.random.default_rng(16)
    x = rng.standard_normal((2, 5, 12))
    p = perturbed_params(mha, 9)
    mask = padding_mask(2, 5, rng)
    full = mha(p, x, attn_mask=mask)
    cache = mha.new_cache(2, 5, dtype=np.float64)
    mha(p, x[:, :4], cache=cache, attn_mask=mask[..., :4])
    last = mha(p, x[:, 4:], cache=cache, attn_mask=mask)
    np.testing.assert_allclose(last, full[:, 4:], rtol=1e-10)


def test_load_takes_checkpoint_names_without_renaming():
    mha = MultiHeadAttention(**CONFIGS["rope-interleaved-rmsnorm"])
    p = mha.init(seed=0, xp=np)
    prefix = "model.layers.3.self_attn."
    state = {prefix + k: v.astype(np.float16) for k, v in p.items()}
    state["model.layers.3.mlp.up_proj.weight"] = np.zeros((2, 2), np.float16)
    loaded = mha.load(state, prefix=prefix)
    assert loaded["q_proj.weight"].dtype == np.float16
    loaded32 = mha.load(state, prefix=prefix, dtype=np.float32)
    np.testing.assert_allclose(loaded32["o_proj.weight"], p["o_proj.weight"], rtol=1e-3)
    with pytest.raises(KeyError, match="rotary_emb"):
        mha.load({**state, prefix + "rotary_emb.inv_freq": np.zeros(4)}, prefix=prefix)
    assert set(
        mha.load(
            {**state, prefix + "rotary_emb.inv_freq": np.zeros(4)}, prefix=prefix, strict=False
        )
    ) == set(p)
    with pytest.raises(KeyError, match="q_norm.weight"):
        mha.load({k: v for k, v in state.items() if "q_norm" not in k}, prefix=prefix)


def test_init_is_deterministic_and_on_the_requested_device(backend):
    mha = MultiHeadAttention(**CONFIGS["packed-layernorm"])
    a = mha.init(seed=3, xp=backend.xp, device=backend.device, dtype=backend.xp.float64)
    b = mha.init(seed=3, xp=np, dtype=np.float64)
    assert set(a) == {
        "qkv_proj.weight",
        "qkv_proj.bias",
        "o_proj.weight",
        "o_proj.bias",
        "q_norm.weight",
        "q_norm.bias",
        "k_norm.weight",
        "k_norm.bias",
    }
    for k in a:
        assert on_backend_device(backend, a[k])
        np.testing.assert_array_equal(backend.to_numpy(a[k]), b[k])
    assert a["qkv_proj.weight"].shape == (36, 12)


def test_bad_configurations_and_inputs_name_the_argument():
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(embed_dim=12, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="qk_norm"):
        MultiHeadAttention(embed_dim=12, num_heads=4, qk_norm="batch")
    with pytest.raises(ValueError, match="rope"):
        MultiHeadAttention(embed_dim=12, num_heads=4, rope="full")
    with pytest.raises(ValueError, match="packed_qkv"):
        MultiHeadAttention(embed_dim=12, num_heads=4, packed_qkv=True, context_dim=5)
    with pytest.raises(ValueError, match="implementation must be one of .*'flash'"):
        MultiHeadAttention(embed_dim=12, num_heads=4, implementation="flash")
    mha = MultiHeadAttention(embed_dim=12, num_heads=4)
    p = mha.init(seed=0, xp=np)
    with pytest.raises(ValueError, match="x must have shape"):
        mha(p, np.zeros((2, 3, 8), np.float32))
    with pytest.raises(KeyError, match="missing"):
        mha({k: v for k, v in p.items() if k != "o_proj.bias"}, np.zeros((1, 2, 12), np.float32))
    with pytest.raises(ValueError, match="shape"):
        mha({**p, "q_proj.weight": np.zeros((12, 5), np.float32)}, np.zeros((1, 2, 12), np.float32))


@settings(max_examples=25, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    rope=st.sampled_from([None, "half", "interleaved"]),
    qk_norm=st.sampled_from([None, "rms", "layer"]),
    packed=st.booleans(),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_kv_cache_in_any_chunks_equals_full_sequence(kv_heads, rope, qk_norm, packed, chunks, seed):
    """Feeding the sequence through the cache in any chunk sizes gives the full causal
    forward, for any head grouping, RoPE layout and qk-norm."""
    mha = MultiHeadAttention(
        embed_dim=16,
        num_heads=4,
        num_kv_heads=kv_heads,
        rope=rope,
        qk_norm=qk_norm,
        packed_qkv=packed,
        causal=True,
    )
    T = sum(chunks)
    x = np.random.default_rng(seed).standard_normal((2, T, 16))
    p = perturbed_params(mha, seed)
    full = mha(p, x)
    cache = mha.new_cache(2, T + 1, dtype=np.float64)
    start = 0
    for n in chunks:
        got = mha(p, x[:, start : start + n], cache=cache)
        np.testing.assert_allclose(got, full[:, start : start + n], rtol=1e-9, atol=1e-11)
        start += n
    assert cache.length == T


@pytest.mark.parametrize("implementation", ["composed", "chunked", "fast"])
def test_implementation_is_used_and_agrees_with_auto(implementation, monkeypatch):
    base = dict(embed_dim=16, num_heads=4, num_kv_heads=2, rope="half", causal=True)
    auto = MultiHeadAttention(**base)
    chosen = MultiHeadAttention(**base, implementation=implementation)
    params = perturbed_params(auto, 3)
    x, _ = inputs(auto, np.random.default_rng(4), B=2, L=7)
    seen = []
    real_select = attention_module.select

    def spy(spec, name):
        seen.append(name)
        return real_select(spec, name)

    monkeypatch.setattr(attention_module, "select", spy)
    y_auto, pb_auto = auto.vjp(params, x)
    y, pb = chosen.vjp(params, x)
    assert seen and set(seen) == {"auto", implementation}
    np.testing.assert_allclose(y, y_auto, rtol=1e-12, atol=1e-12)
    d_out = np.random.default_rng(5).standard_normal(y.shape)
    (dx_a, _, dp_a), (dx, _, dp) = pb_auto(d_out), pb(d_out)
    np.testing.assert_allclose(dx, dx_a, rtol=1e-10, atol=1e-12)
    for name in dp_a:
        np.testing.assert_allclose(dp[name], dp_a[name], rtol=1e-10, atol=1e-12, err_msg=name)
