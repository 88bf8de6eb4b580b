"""MultiHeadAttention options of issue 14: learnable sinks (HF gpt-oss's parameter
``sinks``), ALiBi, Hugging Face RoPE scaling, multi-axis RoPE (Wan2.1 / FLUX) and M-RoPE,
with softcap; forward against the float64 NumPy reference on every backend, gradients
(the sinks' included) by finite differences, and both KV caches against recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import thin
from mha_reference import mha as reference_mha
from test_kv_cache_batched import alone, make_cache, run_ragged
from test_mha_options import fd_check, perturbed, to_backend

import arrayattn as aa
from arrayattn.nn import MultiHeadAttention

TOL = dict(rtol=1e-10, atol=1e-12)
GPT_OSS = dict(
    embed_dim=16,
    num_heads=4,
    num_kv_heads=2,
    sinks=True,
    rope="half",
    causal=True,
    window=(3, 0),
    bias=True,
)
ALIBI = dict(embed_dim=12, num_heads=3, alibi=True, causal=True, softcap=2.0)


def bloom_slopes(n):
    """BLOOM's ``build_alibi_tensor`` slopes, written out as in transformers."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (i + 1) for i in range(0, 2 * (n - closest), 2)]
    return slopes


@pytest.mark.parametrize("n", [1, 3, 4, 6, 8, 12])
def test_alibi_slopes_are_blooms(n):
    got = MultiHeadAttention(embed_dim=2 * n, num_heads=n, alibi=True).alibi_slopes()
    np.testing.assert_allclose(got, bloom_slopes(n), rtol=1e-15)


@pytest.mark.parametrize("name", ["sinks", "alibi"])
def test_sinks_and_alibi_match_reference(backend, name):
    thin(backend, name == "sinks")
    cfg = GPT_OSS if name == "sinks" else ALIBI
    mha = MultiHeadAttention(**cfg)
    p = perturbed(mha, 1)
    assert ("sinks" in p) == (name == "sinks") and p.get("sinks", np.zeros(4)).shape == (4,)
    x = np.random.default_rng(2).standard_normal((2, 6, mha.embed_dim))
    kw = {"sinks": p["sinks"]} if name == "sinks" else {"alibi_slopes": mha.alibi_slopes()}
    ref = reference_mha(mha, p, x, **kw)
    out = mha(to_backend(backend, p), backend.asarray(x))
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)
    _, w = mha(to_backend(backend, p), backend.asarray(x), need_weights=True)
    _, w_ref = reference_mha(mha, p, x, return_weights=True, **kw)
    np.testing.assert_allclose(backend.to_numpy(w), w_ref.mean(axis=1), **TOL)


@pytest.mark.parametrize("name", ["sinks", "alibi"])
def test_sinks_and_alibi_gradients(name):
    mha = MultiHeadAttention(**(GPT_OSS if name == "sinks" else ALIBI))
    x = np.random.default_rng(3).standard_normal((2, 5, mha.embed_dim))
    bias = np.random.default_rng(4).standard_normal((2, 1, 5, 5))
    g = fd_check(mha, perturbed(mha, 5), {"x": x}, mask=bias)
    assert ("sinks" in g.params) == (name == "sinks")


def test_sinks_load_under_hugging_face_names():
    mha = MultiHeadAttention(**GPT_OSS)
    p = perturbed(mha, 6)
    prefix = "model.layers.0.self_attn."
    loaded = mha.load({prefix + k: v for k, v in p.items()}, prefix=prefix)
    np.testing.assert_array_equal(loaded["sinks"], p["sinks"])


def wan_angles(positions, axes_dim, theta):
    """Wan2.1's rope_params per axis, concatenated: (L, A) positions -> (L, sum/2)."""
    parts = []
    for a, d in enumerate(axes_dim):
        inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        parts.append(np.asarray(positions, np.float64)[..., a, None] * inv)
    return np.concatenate(parts, axis=-1)


def test_multi_axis_rope_matches_wan_angles(backend):
    thin(backend, True)
    D = 12
    mha = MultiHeadAttention(
        embed_dim=24,
        num_heads=2,
        head_dim=D,
        rope="interleaved",
        rope_axes=aa.wan_axes_dim(D),
        qk_norm="rms",
        qk_norm_scope="full",
    )
    p = perturbed(mha, 7)
    pos = np.asarray(aa.grid_positions((2, 2, 3), xp=np))  # (F*H*W, 3)
    x = np.random.default_rng(8).standard_normal((2, 12, 24))
    ref = reference_mha(mha, p, x, angles=wan_angles(pos, aa.wan_axes_dim(D), 10000.0))
    out = mha(to_backend(backend, p), backend.asarray(x), positions=backend.asarray(pos))
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)
    if backend.name == "numpy":
        fd_check(mha, p, {"x": x}, positions=pos)
    with pytest.raises(ValueError, match=r"positions must be \(L, A\) or \(B, L, A\)"):
        mha(p, x, positions=np.arange(12))


def test_mrope_text_positions_equal_plain_rope_and_sections_follow_their_axis():
    base = dict(embed_dim=32, num_heads=2, rope="half", causal=True)
    plain = MultiHeadAttention(**base)
    mrope = MultiHeadAttention(**base, mrope_section=(2, 3, 3))
    p = perturbed(plain, 9)
    x = np.random.default_rng(10).standard_normal((2, 6, 32))
    np.testing.assert_allclose(mrope(p, x), plain(p, x), **TOL)  # text: t = h = w
    pos = np.random.default_rng(11).integers(0, 20, size=(2, 6, 3))
    want = mrope(p, x, freqs=aa.mrope_frequencies(16, pos, (2, 3, 3), dtype=np.float64))
    np.testing.assert_allclose(mrope(p, x, positions=pos), want, **TOL)
    cache = mrope.new_cache(2, 8)  # text decoding continues the positions per sequence
    mrope(p, x[:, :4], cache=cache)
    np.testing.assert_allclose(mrope(p, x[:, 4:], cache=cache), plain(p, x)[:, 4:], **TOL)


SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_scaling_equals_the_scaled_frequencies(name):
    cfg = dict(embed_dim=16, num_heads=2, rope="half", causal=True, max_position_embeddings=4)
    mha = MultiHeadAttention(**cfg, rope_scaling=SCALINGS[name])
    plain = MultiHeadAttention(**cfg)
    p = perturbed(mha, 12)
    x = np.random.default_rng(13).standard_normal((2, 7, 16))
    f = aa.rope_frequencies(
        8,
        np.arange(7.0),
        rope_scaling=SCALINGS[name],
        max_position_embeddings=4,
        seq_len=7,
        dtype=np.float64,
    )
    want = plain(p, x, freqs=f)
    np.testing.assert_allclose(mha(p, x), want, **TOL)
    assert not np.allclose(mha(p, x), plain(p, x))
    if name != "dynamic":  # dynamic NTK depends on the length seen, as in HF
        cache = mha.new_cache(2, 8)
        mha(p, x[:, :5], cache=cache)
        np.testing.assert_allclose(mha(p, x[:, 5:], cache=cache), want[:, 5:], **TOL)
    fd_check(mha, p, {"x": x})


def test_partial_rotary_factor_rotates_the_leading_features():
    cfg = dict(embed_dim=16, num_heads=2, rope="half", causal=True)
    mha = MultiHeadAttention(**cfg, partial_rotary_factor=0.5)
    p = perturbed(mha, 14)
    x = np.random.default_rng(15).standard_normal((1, 5, 16))
    angles = np.arange(5.0)[:, None] * 10000.0 ** (-np.arange(2) * 2.0 / 4)  # R = 4
    np.testing.assert_allclose(mha(p, x), reference_mha(mha, p, x, angles=angles), **TOL)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_variants_in_ragged_cached_decoding(backend, kind):
    thin(backend, False)
    cfg = dict(
        embed_dim=16,
        num_heads=4,
        num_kv_heads=2,
        rope="half",
        causal=True,
        sinks=True,
        alibi=True,
        softcap=3.0,
        rope_scaling=SCALINGS["llama3"],
    )
    mha = MultiHeadAttention(**cfg)
    rng = np.random.default_rng(16)
    p = perturbed(mha, 17)
    run_ragged(backend, mha, p, make_cache(mha, kind, backend, rng=rng), "left", rng)
    assert alone is not None
