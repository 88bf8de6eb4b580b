"""Bad input gets a clear error naming the argument; inputs are never modified."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import attention_inputs

import arrayattn as aa


def _qkv(rng, q_shape=(1, 2, 3, 4), k_shape=(1, 2, 5, 4), v_shape=None, dtype="float64"):
    q, k, v, _ = attention_inputs(rng, q_shape, k_shape, v_shape, dtype=dtype)
    return q, k, v


SDPA = aa.scaled_dot_product_attention


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, kwargs, match",
    [
        ((1, 2, 3, 4), (1, 2, 5, 6), (1, 2, 5, 6), {}, "key head_dim 6"),
        ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 6, 4), {}, "value"),
        ((1, 6, 3, 4), (1, 4, 5, 4), None, {"enable_gqa": True}, r"Hq % Hkv"),
        ((1, 4, 3, 4), (1, 2, 5, 4), None, {}, "enable_gqa"),
        ((1, 2, 3, 4), (1, 2, 5, 4), (1, 3, 5, 4), {}, "value heads"),
        ((2, 2, 3, 4), (3, 2, 5, 4), None, {}, "batch dims"),
        ((4,), (5, 4), None, {}, "query"),
    ],
    ids=["head_dim", "value_len", "gqa_ratio", "heads_without_gqa", "kv_heads", "batch", "1d"],
)
def test_shape_errors(rng, q_shape, k_shape, v_shape, kwargs, match):
    q, k, v = _qkv(rng, q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=match):
        SDPA(q, k, v, **kwargs)


@pytest.mark.parametrize("mask_shape", [(3, 4), (2, 3, 3, 5), (1, 3, 1, 1), (2, 1, 2, 3, 5)])
def test_mask_that_does_not_broadcast(rng, mask_shape):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="attn_mask"):
        SDPA(q, k, v, np.ones(mask_shape, dtype=bool))
    with pytest.raises(ValueError, match="attn_mask"):
        aa.attention_weights(q, k, np.zeros(mask_shape))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.int8, np.complex64])
def test_integer_mask_is_a_type_error(rng, dtype):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="attn_mask"):
        SDPA(q, k, v, np.ones((3, 5), dtype=dtype))


def test_non_float_inputs(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="query"):
        SDPA(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="key"):
        SDPA(q, k.astype(np.float32), v)
    with pytest.raises(TypeError, match="value"):
        SDPA(q, k, v.astype(np.float32))
    with pytest.raises(TypeError, match="query"):
        SDPA([[1.0]], k, v)


def test_two_libraries_is_a_type_error(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="key"):
        SDPA(q, torch.asarray(k), v)
    with pytest.raises(TypeError, match="attn_mask"):
        SDPA(q, k, v, torch.ones((3, 5), dtype=torch.bool))
    with pytest.raises(TypeError, match="freqs"):
        aa.apply_rope(q, torch.asarray(aa.rope_frequencies(4, 3, xp=np)))
    with pytest.raises(TypeError, match="weight"):
        aa.rms_norm(q, torch.ones(4, dtype=torch.float64))


def test_two_devices_is_a_type_error(rng):
    xp = pytest.importorskip("array_api_strict")
    cpu, dev1 = xp.Device("CPU_DEVICE"), xp.Device("device1")
    q, k, v = _qkv(rng)
    qa = xp.asarray(q, device=cpu)
    ka, kb = xp.asarray(k, device=cpu), xp.asarray(k, device=dev1)
    va = xp.asarray(v, device=cpu)
    with pytest.raises(TypeError, match="key.*device"):
        SDPA(qa, kb, va)
    with pytest.raises(TypeError, match="attn_mask.*device"):
        SDPA(qa, ka, va, xp.ones((3, 5), dtype=xp.bool, device=dev1))
    with pytest.raises(TypeError, match="device"):
        aa.layer_norm(qa, xp.ones(4, dtype=xp.float64, device=dev1), None)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_dropout_p_outside_unit_interval(rng, p):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="dropout_p"):
        SDPA(q, k, v, dropout_p=p, seed=0)
    with pytest.raises(ValueError, match="dropout_p"):
        aa.dropout_mask(q, k, p, seed=0)


def test_dropout_p_and_seed_types(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="dropout_p"):
        SDPA(q, k, v, dropout_p="0.1")
    with pytest.raises(TypeError, match="seed"):
        SDPA(q, k, v, dropout_p=0.1, seed=1.5)


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_scale(rng, scale):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="scale"):
        SDPA(q, k, v, scale=scale)


def test_scale_type(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="scale"):
        SDPA(q, k, v, scale="1")


@pytest.mark.parametrize(
    "window, exc",
    [
        ((1,), ValueError),
        ((1, 2, 3), ValueError),
        (3, ValueError),
        ("ab", ValueError),
        ((-2, 0), ValueError),
        ((0, -5), ValueError),
        ((1.5, 0), TypeError),
        ((True, 0), TypeError),
        ((0, None), TypeError),
    ],
)
def test_bad_window(rng, window, exc):
    q, k, v = _qkv(rng)
    with pytest.raises(exc, match="window"):
        SDPA(q, k, v, window=window)


def test_window_accepts_numpy_ints(rng):
    q, k, v = _qkv(rng)
    a = SDPA(q, k, v, window=(np.int64(1), np.int32(0)))
    b = SDPA(q, k, v, window=(1, 0))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("align", ["top", "bottom-right", None, "TOP_LEFT"])
def test_bad_causal_align(rng, align):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="causal_align"):
        SDPA(q, k, v, is_causal=True, causal_align=align)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_softcap(rng, softcap):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="softcap"):
        SDPA(q, k, v, softcap=softcap)


def test_bad_is_causal_and_implementation(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="is_causal"):
        SDPA(q, k, v, is_causal="yes")
    with pytest.raises(ValueError, match="implementation"):
        SDPA(q, k, v, implementation="nope")


def test_bad_layout_and_num_heads():
    x = np.zeros((2, 3, 8))
    with pytest.raises(ValueError, match="layout"):
        aa.apply_rope(x, aa.rope_frequencies(8, 3, xp=np), layout="rotate_half")
    with pytest.raises(ValueError, match="num_heads"):
        aa.split_heads(x, 3)
    with pytest.raises(ValueError, match="num_heads"):
        aa.split_heads(x, 0)


def _calls(q, k, v, m, bm, x, w, b, f):
    """Every public op, through the forward and through vjp + pullback."""
    opts = {"enable_gqa": True, "is_causal": True, "dropout_p": 0.2, "seed": 1, "softcap": 3.0}
    yield aa.scaled_dot_product_attention, (q, k, v, m), dict(opts, return_lse=True)
    yield aa.scaled_dot_product_attention, (q, k, v, bm), opts
    yield aa.attention_weights, (q, k, m), opts
    yield aa.softmax, (x,), {}
    yield aa.split_heads, (x, 2), {}
    yield aa.merge_heads, (q,), {}
    yield aa.repeat_kv, (k, 2), {}
    yield aa.apply_rope, (x, f), {"layout": "half"}
    yield aa.rms_norm, (x, w), {"cast_before_weight": False}
    yield aa.layer_norm, (x, w, b), {}


def _zeros_like_out(out):
    if isinstance(out, tuple):
        return tuple(np.ones(o.shape, dtype=o.dtype) for o in out)
    return np.ones(out.shape, dtype=out.dtype)


def test_inputs_never_modified(rng):
    q, k, v = _qkv(rng, (2, 4, 3, 4), (2, 2, 5, 4))
    m = rng.standard_normal((3, 5))
    bm = rng.random((2, 1, 3, 5)) < 0.5
    x = rng.standard_normal((2, 3, 4))
    w, b = rng.standard_normal(4), rng.standard_normal(4)
    f = aa.rope_frequencies(4, 3, xp=np, dtype=np.float64)
    arrays = (q, k, v, m, bm, x, w, b, f)
    copies = tuple(a.copy() for a in arrays)
    for fn, args, kwargs in _calls(*arrays):
        out = fn(*args, **kwargs)
        out, pullback = aa.vjp(fn, *args, **kwargs)
        cot = _zeros_like_out(out)
        cot_copy = tuple(c.copy() for c in cot) if isinstance(cot, tuple) else cot.copy()
        grads = pullback(cot)
        for a, c in zip(arrays, copies, strict=True):
            np.testing.assert_array_equal(a, c, err_msg=f"{fn.__name__} modified an input")
        for cc, c0 in zip(
            cot if isinstance(cot, tuple) else (cot,),
            cot_copy if isinstance(cot, tuple) else (cot_copy,),
            strict=True,
        ):
            np.testing.assert_array_equal(cc, c0, err_msg=f"{fn.__name__} modified the cotangent")
        # gradients are fresh arrays, not views of the inputs
        for g in grads:
            if g is not None:
                assert not any(np.shares_memory(g, a) for a in arrays), fn.__name__


def test_torch_inputs_never_modified(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.asarray(a) for a in _qkv(rng, (1, 2, 3, 4), (1, 2, 5, 4)))
    m = torch.asarray(rng.standard_normal((3, 5)))
    copies = [t.clone() for t in (q, k, v, m)]
    out, pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, m, is_causal=True, return_lse=True
    )
    pullback((torch.ones_like(out[0]), torch.ones_like(out[1])))
    for t, c in zip((q, k, v, m), copies, strict=True):
        assert torch.equal(t, c)


def test_swapped_sequence_and_heads_axes_get_a_layout_hint():
    """A (B, L, H, E) tensor passed as (B, H, L, E): the message points at the layout,
    not at enable_gqa (which would point the wrong way)."""
    q, k = np.ones((2, 10, 8, 16)), np.ones((2, 12, 2, 16))  # (B, L, H, E) with GQA 8/2
    for kw in ({}, {"enable_gqa": True}):
        with pytest.raises(ValueError, match=r"look like \(batch, sequence, heads, head_dim\)"):
            aa.scaled_dot_product_attention(q, k, k, **kw)
    # A real head mismatch (8 query heads, 2 KV heads, forgot enable_gqa): the GQA hint.
    q, k = np.ones((2, 8, 12, 16)), np.ones((2, 2, 12, 16))
    with pytest.raises(ValueError, match="pass enable_gqa=True") as err:
        aa.scaled_dot_product_attention(q, k, k)
    assert "look like" not in str(err.value)


def test_a_float_mask_of_zeros_and_ones_warns():
    """A Hugging Face-style mask (1 = attend) passed as floats is added to the scores:
    warn, naming what to pass instead; no warning for an all-zero or additive mask."""
    import warnings

    q = np.ones((1, 2, 4, 8), np.float32)
    hf = np.ones((1, 1, 4, 4), np.float32)
    hf[..., 0] = 0
    with pytest.warns(UserWarning, match="holding only 0.0 and 1.0.*bool mask"):
        aa.scaled_dot_product_attention(q, q, q, attn_mask=hf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aa.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros((4, 4), np.float32))
        additive = np.where(hf > 0, 0.0, -np.inf).astype(np.float32)
        aa.scaled_dot_product_attention(q, q, q, attn_mask=additive)
        aa.scaled_dot_product_attention(q, q, q, attn_mask=hf > 0)  # bool: what to pass
