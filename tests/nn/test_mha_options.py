"""MultiHeadAttention options of issue 15: v_head_dim, separate key/value inputs, full-dim
qk-norm, softcap, packed cross-attention, precomputed RoPE frequencies, need_weights,
per-sequence lengths with right/left padding, the float-mask gradient; and load()
(dtype kept, rename, strict). Forward against the float64 NumPy reference on every
backend, every gradient (inputs, parameters, the float mask) by finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import thin
from mha_reference import mha as reference_mha
from mha_reference import rope_angles

from arrayattn.nn import MultiHeadAttention

TOL = dict(rtol=1e-10, atol=1e-12)

SELF = {
    "v-head-dim": dict(embed_dim=12, num_heads=4, num_kv_heads=2, v_head_dim=5, causal=True),
    "full-qk-rms-rope": dict(
        embed_dim=16,
        num_heads=4,
        num_kv_heads=2,
        qk_norm="rms",
        qk_norm_scope="full",
        rope="half",
        causal=True,
        bias=False,
    ),
    "full-qk-layer-packed": dict(
        embed_dim=12, num_heads=3, packed_qkv=True, qk_norm="layer", qk_norm_scope="full"
    ),
    "softcap-window": dict(embed_dim=12, num_heads=3, softcap=0.7, causal=True, window=(2, 0)),
    "packed-vdim-mqa": dict(
        embed_dim=12, num_heads=3, num_kv_heads=1, packed_qkv=True, v_head_dim=2, rope="interleaved"
    ),
}
CROSS = {
    "kv-inputs": dict(
        embed_dim=12, num_heads=4, num_kv_heads=2, context_dim=7, value_context_dim=5, v_head_dim=3
    ),
    "packed-cross": dict(embed_dim=12, num_heads=3, packed_qkv=True, softcap=2.0),
    "packed-cross-gqa-vdim": dict(
        embed_dim=12, num_heads=4, num_kv_heads=2, packed_qkv=True, v_head_dim=2, qk_norm="rms"
    ),
}


def perturbed(mha, seed):
    params = mha.init(seed=seed, xp=np, dtype=np.float64)
    rng = np.random.default_rng(seed + 100)
    return {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in params.items()}


def to_backend(backend, tree):
    return {k: backend.asarray(v) for k, v in tree.items()}


def cross_inputs(mha, rng, B=2, L=3, S=6, separate_value=True):
    x = rng.standard_normal((B, L, mha.embed_dim))
    ctx = rng.standard_normal((B, S, mha.kv_input_dim))
    val = rng.standard_normal((B, S, mha.value_input_dim)) if separate_value else None
    return x, ctx, val


def fd_check(mha, params, inputs, *, mask=None, eps=1e-5, rng=None, **kw):
    """Directional central differences for every array input (``inputs``: name -> array
    among x/context/value), every parameter and a float ``mask``."""
    rng = rng or np.random.default_rng(7)
    names = list(inputs)

    def run(p, arrays, m):
        a = dict(arrays)
        x = a.pop("x")
        ctx = a.pop("context", None)
        return mha(p, x, ctx, attn_mask=m, **a, **kw)

    x = inputs["x"]
    ctx = inputs.get("context")
    extra = {k: v for k, v in inputs.items() if k not in ("x", "context")}
    out, pullback = mha.vjp(params, x, ctx, attn_mask=mask, **extra, **kw)
    np.testing.assert_allclose(out, run(params, inputs, mask), rtol=1e-12, atol=1e-13)
    dy = rng.standard_normal(out.shape)
    g = pullback(dy)
    assert set(g.params) == set(params)
    analytic = {"x": g.x, "context": g.context, "value": g.value}

    def loss(p, arrays, m):
        return float(np.sum(run(p, arrays, m) * dy))

    def check(label, ana, shift):
        for _ in range(2):
            u = rng.standard_normal(ana.shape)
            num = (loss(*shift(eps * u)) - loss(*shift(-eps * u))) / (2 * eps)
            got = float(np.sum(ana * u))
            assert abs(num - got) <= 1e-6 * max(1.0, abs(num)), (label, num, got)

    for n in params:
        assert g.params[n].shape == params[n].shape, n
        check(n, g.params[n], lambda d, n=n: ({**params, n: params[n] + d}, inputs, mask))
    for n in names:
        check(n, analytic[n], lambda d, n=n: (params, {**inputs, n: inputs[n] + d}, mask))
    if mask is not None and mask.dtype != bool:
        assert g.attn_mask.shape == mask.shape
        check("attn_mask", g.attn_mask, lambda d: (params, inputs, mask + d))
    else:
        assert g.attn_mask is None
    return g


@pytest.mark.parametrize("name", sorted(SELF))
def test_self_attention_options_match_reference(backend, name):
    thin(backend, name in ("full-qk-rms-rope", "softcap-window"))
    mha = MultiHeadAttention(**SELF[name])
    rng = np.random.default_rng(1)
    p = perturbed(mha, 2)
    x = rng.standard_normal((2, 5, mha.embed_dim))
    bias = rng.standard_normal((2, 1, 5, 5))  # a float mask: a learned bias
    ref = reference_mha(mha, p, x, mask=bias)
    out = mha(to_backend(backend, p), backend.asarray(x), attn_mask=backend.asarray(bias))
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)


@pytest.mark.parametrize("name", sorted(SELF))
def test_self_attention_options_gradients(name):
    mha = MultiHeadAttention(**SELF[name])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, mha.embed_dim))
    bias = rng.standard_normal((1, mha.num_heads, 4, 4))
    fd_check(mha, perturbed(mha, 4), {"x": x}, mask=bias)


@pytest.mark.parametrize("name", sorted(CROSS))
def test_key_value_inputs_and_packed_cross_attention(backend, name):
    thin(backend, name == "packed-cross-gqa-vdim")
    mha = MultiHeadAttention(**CROSS[name])
    rng = np.random.default_rng(5)
    p = perturbed(mha, 6)
    x, ctx, val = cross_inputs(mha, rng)
    keep = rng.random((2, 1, 1, 6)) > 0.3
    keep[..., 0] = True
    ref = reference_mha(mha, p, x, ctx, mask=keep, value=val)
    out = mha(
        to_backend(backend, p),
        backend.asarray(x),
        backend.asarray(ctx),
        value=backend.asarray(val),
        attn_mask=backend.asarray(keep),
    )
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)
    if backend.name == "numpy":
        g = fd_check(mha, p, {"x": x, "context": ctx, "value": val}, mask=keep)
        assert g.value.shape == val.shape and g.context.shape == ctx.shape


def test_packed_cross_attention_without_separate_value_sums_key_and_value_gradients():
    mha = MultiHeadAttention(**CROSS["packed-cross"])
    rng = np.random.default_rng(8)
    x, ctx, _ = cross_inputs(mha, rng, separate_value=False)
    p = perturbed(mha, 9)
    np.testing.assert_allclose(mha(p, x, ctx), reference_mha(mha, p, x, ctx), **TOL)
    g = fd_check(mha, p, {"x": x, "context": ctx})
    assert g.value is None


def test_freqs_override_equals_positions_and_takes_any_angles(backend):
    thin(backend, False)
    mha = MultiHeadAttention(**SELF["full-qk-rms-rope"])
    rng = np.random.default_rng(10)
    p = perturbed(mha, 11)
    x = rng.standard_normal((2, 6, mha.embed_dim))
    D = mha.dim_per_head
    pos = np.array([[0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9]])
    freqs = np.exp(1j * rope_angles(pos, D, mha.rope_theta))  # (B, L, D/2)
    pb, xb = to_backend(backend, p), backend.asarray(x)
    want = backend.to_numpy(mha(pb, xb, positions=backend.asarray(pos)))
    got = mha(pb, xb, freqs=backend.asarray(freqs))
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL)
    # Multi-axis style angles: one ladder per part of the head dim, any positions.
    angles = rng.uniform(-3, 3, size=(6, D // 2))
    out = mha(pb, xb, freqs=backend.asarray(np.exp(1j * angles)))
    np.testing.assert_allclose(
        backend.to_numpy(out), reference_mha(mha, p, x, angles=angles), **TOL
    )
    if backend.name == "numpy":
        fd_check(mha, p, {"x": x}, freqs=np.exp(1j * angles[None, None]))


@pytest.mark.parametrize("name", ["v-head-dim", "full-qk-layer-packed", "softcap-window"])
def test_lengths_without_cache_right_and_left_padding(backend, name):
    thin(backend, name == "v-head-dim")
    mha = MultiHeadAttention(**SELF[name])
    rng = np.random.default_rng(12)
    p = perturbed(mha, 13)
    n = [5, 2, 3]
    right = rng.standard_normal((3, 5, mha.embed_dim))
    left = np.stack([np.roll(right[b], 5 - n[b], axis=0) for b in range(3)])
    pb = to_backend(backend, p)
    out_r = backend.to_numpy(mha(pb, backend.asarray(right), lengths=n))
    out_l = backend.to_numpy(
        mha(pb, backend.asarray(left), lengths=backend.asarray(np.array(n)), padding_side="left")
    )
    ref = reference_mha(mha, p, right, q_lengths=n, kv_lengths=n)
    for b, nb in enumerate(n):  # real rows equal each sequence computed alone
        alone = reference_mha(mha, p, right[b : b + 1, :nb])
        np.testing.assert_allclose(out_r[b, :nb], alone[0], **TOL)
        np.testing.assert_allclose(out_l[b, 5 - nb :], alone[0], **TOL)
    np.testing.assert_allclose(out_r, ref, **TOL)  # padded rows: o_proj's bias
    if backend.name == "numpy":
        fd_check(mha, p, {"x": left}, lengths=n, padding_side="left")
        fd_check(mha, p, {"x": right}, lengths=n)


@pytest.mark.parametrize("average", [True, False])
def test_need_weights_matches_reference(backend, average):
    thin(backend, average)
    mha = MultiHeadAttention(**SELF["softcap-window"])
    rng = np.random.default_rng(14)
    p = perturbed(mha, 15)
    x = rng.standard_normal((2, 5, 12))
    ref_out, ref_w = reference_mha(mha, p, x, return_weights=True)
    out, w = mha(
        to_backend(backend, p), backend.asarray(x), need_weights=True, average_attn_weights=average
    )
    np.testing.assert_allclose(backend.to_numpy(out), ref_out, **TOL)
    want = ref_w.mean(axis=1) if average else ref_w
    assert tuple(w.shape) == want.shape
    np.testing.assert_allclose(backend.to_numpy(w), want, **TOL)


def test_need_weights_with_left_padding_follow_the_callers_rows_and_columns():
    mha = MultiHeadAttention(embed_dim=8, num_heads=2, causal=True)
    p = perturbed(mha, 16)
    rng = np.random.default_rng(17)
    right = rng.standard_normal((2, 4, 8))
    n = [4, 2]
    left = np.stack([np.roll(right[b], 4 - n[b], axis=0) for b in range(2)])
    _, w_r = mha(p, right, lengths=n, need_weights=True, average_attn_weights=False)
    _, w_l = mha(
        p, left, lengths=n, padding_side="left", need_weights=True, average_attn_weights=False
    )
    np.testing.assert_allclose(w_l[1, :, 2:, 2:], w_r[1, :, :2, :2], **TOL)
    assert not np.any(w_l[1, :, :, :2])  # padding keys get no weight


def test_load_keeps_a_float64_torch_state_dict_and_the_next_call_works():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    state = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = torch.nn.Linear(8, 8, dtype=torch.float64)
        state.update({f"{name}.{k}": v for k, v in lin.state_dict().items()})
    mha = MultiHeadAttention(8, 2)
    p = mha.load(state)
    assert p["q_proj.weight"].dtype == np.float64
    np.testing.assert_array_equal(p["o_proj.bias"], state["o_proj.bias"].numpy())
    y = mha(p, np.ones((1, 3, 8)))  # float64 through the whole layer
    assert y.dtype == np.float64
    cache = mha.new_cache(1, 4)  # dtype follows the parameters
    mha(p, np.ones((1, 3, 8)), cache=cache)
    assert cache.dtype == np.float64
    half = mha.load({k: v.half() for k, v in state.items()})
    assert half["k_proj.weight"].dtype == np.float16
    explicit = mha.load(state, dtype=np.float32)
    assert explicit["v_proj.bias"].dtype == np.float32
    bf16 = {k: v.bfloat16() for k, v in state.items()}
    with pytest.raises(TypeError, match="bfloat16.*dtype="):
        mha.load(bf16)
    assert mha.load(bf16, dtype=np.float32)["q_proj.weight"].dtype == np.float32
    import array_api_compat.torch as xpt

    on_torch = mha.load(state, xp=xpt)
    assert on_torch["q_proj.weight"].dtype == torch.float64


def test_load_renames_by_mapping_or_function_and_names_missing_and_unexpected():
    mha = MultiHeadAttention(8, 2, qk_norm="rms", qk_norm_scope="full", bias=False)
    p = mha.init(seed=0, xp=np)
    wan = {  # Wan2.1's names for the same tensors
        "blocks.0.self_attn.q.weight": p["q_proj.weight"],
        "blocks.0.self_attn.k.weight": p["k_proj.weight"],
        "blocks.0.self_attn.v.weight": p["v_proj.weight"],
        "blocks.0.self_attn.o.weight": p["o_proj.weight"],
        "blocks.0.self_attn.norm_q.weight": p["q_norm.weight"],
        "blocks.0.self_attn.norm_k.weight": p["k_norm.weight"],
    }
    names = {"q.weight": "q_proj.weight", "k.weight": "k_proj.weight"}
    names |= {"v.weight": "v_proj.weight", "o.weight": "o_proj.weight"}
    names |= {"norm_q.weight": "q_norm.weight", "norm_k.weight": "k_norm.weight"}
    got = mha.load(wan, prefix="blocks.0.self_attn.", rename=names)
    for k in p:
        np.testing.assert_array_equal(got[k], p[k])

    def by_function(name):
        if name.startswith("norm_"):
            return name[5] + "_norm.weight"
        return name[0] + "_proj.weight"

    got = mha.load(wan, prefix="blocks.0.self_attn.", rename=by_function)
    assert set(got) == set(p)
    with pytest.raises(KeyError, match=r"missing \['k_norm.weight'\].*unexpected \['blocks.0"):
        mha.load(
            {**wan, "blocks.0.self_attn.extra": np.zeros(1)},
            prefix="blocks.0.self_attn.",
            rename=lambda n: None if n == "norm_k.weight" else names.get(n, n),
        )
    with pytest.raises(KeyError, match="unexpected.*strict=False"):
        mha.load(
            {**wan, "blocks.0.self_attn.extra": np.zeros(1)},
            prefix="blocks.0.self_attn.",
            rename=names,
        )
    ok = mha.load(
        {**wan, "blocks.0.self_attn.extra": np.zeros(1)},
        prefix="blocks.0.self_attn.",
        rename=names,
        strict=False,
    )
    assert set(ok) == set(p)


def test_left_padding_rotates_explicit_positions_and_freqs_with_the_rows():
    mha = MultiHeadAttention(**SELF["full-qk-rms-rope"])
    p = perturbed(mha, 18)
    rng = np.random.default_rng(19)
    n = [5, 3]
    right = rng.standard_normal((2, 5, mha.embed_dim))
    left = np.stack([np.roll(right[b], 5 - n[b], axis=0) for b in range(2)])
    pos_r = np.array([[7, 8, 9, 10, 11], [2, 3, 4, 0, 0]])
    pos_l = np.stack([np.roll(pos_r[b], 5 - n[b]) for b in range(2)])
    want = mha(p, right, lengths=n, positions=pos_r)
    got = mha(p, left, lengths=n, padding_side="left", positions=pos_l)
    f_l = np.exp(1j * rope_angles(pos_l, mha.dim_per_head, mha.rope_theta))
    got_f = mha(p, left, lengths=n, padding_side="left", freqs=f_l)
    for b, nb in enumerate(n):
        np.testing.assert_allclose(got[b, 5 - nb :], want[b, :nb], **TOL)
        np.testing.assert_allclose(got_f[b, 5 - nb :], want[b, :nb], **TOL)
