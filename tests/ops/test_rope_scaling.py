"""RoPE scaling from Hugging Face configs: every rope_type against transformers' own
ROPE_INIT_FUNCTIONS and rotary classes (configs written here, no download), on every
backend, with errors and the backward of scaled (non-unit) frequencies."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import check_vjp_fd, name_of_dtype, thin, xp_assert_close

import arrayattn as aa

HEAD_DIM = 64
MPE = 64  # max_position_embeddings: small, so positions beyond it exercise dynamic/longrope

CONFIGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    },
    "yarn_mscale": {  # DeepSeek-V3 style: mscale / mscale_all_dim, beta_* given
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    },
    "yarn_untruncated": {
        "rope_type": "yarn",
        "factor": 2.5,
        "truncate": False,
        "attention_factor": 1.3,
        "original_max_position_embeddings": 16,
        "rope_theta": 1000000.0,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.03 * j for j in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.5 * j for j in range(HEAD_DIM // 2)],
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    },
}


def _hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    return torch, LlamaConfig, ROPE_INIT_FUNCTIONS, LlamaRotaryEmbedding, apply_rotary_pos_emb


def _llama_config(LlamaConfig, params: dict, **extra):
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MPE,
        rope_parameters=dict(params),
        **extra,
    )


def _hf_inv_freq(name: str, params: dict, seq_len):
    torch, LlamaConfig, INIT, Rotary, _ = _hf()
    cfg = _llama_config(LlamaConfig, params)
    if params["rope_type"] == "default":
        inv, af = Rotary.compute_default_rope_parameters(cfg)
    else:
        inv, af = INIT[params["rope_type"]](cfg, "cpu", seq_len=seq_len)
    return inv.numpy().astype(np.float64), float(af)


@pytest.mark.parametrize("seq_len", [None, 48, 100])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inv_freq_equals_hf(name, seq_len):
    params = CONFIGS[name]
    expected, expected_af = _hf_inv_freq(name, params, seq_len)
    got, af = aa.rope_inv_freq(
        HEAD_DIM, params, max_position_embeddings=MPE, seq_len=seq_len, dtype=np.float64
    )
    # HF computes the ladder in float32: equal to a few float32 ulps.
    np.testing.assert_allclose(got, expected, rtol=5e-7, atol=0)
    assert af == pytest.approx(expected_af, rel=1e-12)
    got32, _ = aa.rope_inv_freq(HEAD_DIM, params, max_position_embeddings=MPE, seq_len=seq_len)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, expected, rtol=5e-7, atol=0)


@pytest.mark.parametrize(
    "params",
    [
        {"type": "linear", "factor": 2.0},
        {"type": "dynamic", "factor": 3.0},
        {"rope_type": "yarn", "factor": 8.0},  # original length from max_position_embeddings
    ],
)
def test_old_rope_scaling_format_equals_hf(params):
    """config.json of older models: rope_scaling with "type", rope_theta at the top level."""
    torch, LlamaConfig, INIT, _, _ = _hf()
    cfg = LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MPE,
        rope_scaling=dict(params),
        rope_theta=50000.0,
    )
    kind = params.get("rope_type", params.get("type"))
    expected, expected_af = INIT[kind](cfg, "cpu", seq_len=80)
    got, af = aa.rope_inv_freq(
        HEAD_DIM, params, theta=50000.0, max_position_embeddings=MPE, seq_len=80, dtype=np.float64
    )
    np.testing.assert_allclose(got, expected.numpy(), rtol=5e-7)
    assert af == pytest.approx(expected_af, rel=1e-12)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "longrope"])
def test_partial_rotary_equals_hf(name):
    """partial_rotary_factor inside rope_parameters (and GPT-NeoX's default ladder)."""
    torch, LlamaConfig, INIT, _, _ = _hf()
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    params = dict(CONFIGS[name], partial_rotary_factor=0.5)
    if name == "longrope":
        params["short_factor"] = params["short_factor"][: HEAD_DIM // 4]
        params["long_factor"] = params["long_factor"][: HEAD_DIM // 4]
    if name == "default":
        cfg = GPTNeoXConfig(
            hidden_size=4 * HEAD_DIM,
            num_attention_heads=4,
            max_position_embeddings=MPE,
            rope_parameters=params,
        )
        expected, _ = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        expected, _ = INIT[name](_llama_config(LlamaConfig, params), "cpu")
    got, _ = aa.rope_inv_freq(HEAD_DIM, params, max_position_embeddings=MPE, dtype=np.float64)
    assert got.shape == (HEAD_DIM // 4,)
    np.testing.assert_allclose(got, expected.numpy(), rtol=5e-7)
    # the keyword is the fallback for the old format's top-level field
    kw = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    got_kw, _ = aa.rope_inv_freq(
        HEAD_DIM, kw, partial_rotary_factor=0.5, max_position_embeddings=MPE, dtype=np.float64
    )
    np.testing.assert_array_equal(got_kw, got)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rotated_q_k_equal_hf_rotary_embedding(rng, name):
    """End to end: HF's LlamaRotaryEmbedding (incl. its dynamic/longrope update at run time
    and the attention factor on cos/sin) + apply_rotary_pos_emb == apply_rope(half)."""
    torch, LlamaConfig, _, Rotary, apply_hf = _hf()
    params = CONFIGS[name]
    L = 80  # beyond max_position_embeddings and every original length
    rotary = Rotary(_llama_config(LlamaConfig, params))
    q = rng.standard_normal((2, 3, L, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((2, 1, L, HEAD_DIM)).astype(np.float32)
    position_ids = torch.arange(L)[None].expand(2, L)
    cos, sin = rotary(torch.from_numpy(q), position_ids)
    q_hf, k_hf = apply_hf(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    freqs = aa.rope_frequencies(
        HEAD_DIM, np.arange(L), rope_scaling=params, max_position_embeddings=MPE, seq_len=L
    )
    assert freqs.dtype == np.complex64
    for x, ref in ((q, q_hf), (k, k_hf)):
        y = aa.apply_rope(x, freqs, layout="half")
        # float32 angles up to 80 rad on both sides
        np.testing.assert_allclose(y, ref.numpy(), rtol=2e-5, atol=2e-5)


def test_attention_factor_can_be_left_to_the_caller():
    params = CONFIGS["yarn"]
    f = aa.rope_frequencies(HEAD_DIM, 10, rope_scaling=params, dtype=np.float64)
    unit = aa.rope_frequencies(
        HEAD_DIM, 10, rope_scaling=params, apply_attention_factor=False, dtype=np.float64
    )
    _, af = aa.rope_inv_freq(HEAD_DIM, params)
    np.testing.assert_allclose(np.abs(unit), 1.0, rtol=1e-12)
    np.testing.assert_allclose(f, af * unit, rtol=1e-12)


def test_no_scaling_is_the_plain_ladder():
    for params in (None, {"rope_type": "default"}, {"type": "mrope", "mrope_section": [8, 12, 12]}):
        f = aa.rope_frequencies(HEAD_DIM, 7, rope_scaling=params, theta=500.0, dtype=np.float64)
        j = np.arange(HEAD_DIM // 2)
        expected = np.exp(1j * np.arange(7)[:, None] * 500.0 ** (-2 * j / HEAD_DIM))
        np.testing.assert_allclose(f, expected, rtol=1e-13)


def test_dynamic_depends_on_seq_len():
    params = CONFIGS["dynamic"]
    kw = {"rope_scaling": params, "max_position_embeddings": MPE, "dtype": np.float64}
    short = aa.rope_frequencies(HEAD_DIM, 10, **kw)  # seq_len = 10 <= MPE: plain ladder
    np.testing.assert_allclose(short, aa.rope_frequencies(HEAD_DIM, 10, dtype=np.float64))
    long_ = aa.rope_frequencies(HEAD_DIM, np.arange(10), seq_len=200, **kw)
    assert not np.allclose(long_, short)
    with pytest.raises(ValueError, match="seq_len"):
        aa.rope_frequencies(HEAD_DIM, np.arange(10), **kw)


@pytest.mark.parametrize("name", ["llama3", "yarn", "longrope"])
def test_frequencies_on_backend(backend, name):
    thin(backend, name == "yarn")
    xp = backend.xp
    params = CONFIGS[name]
    pos = np.array([[0, 3, 70], [5, 6, 7]])
    kw = {"rope_scaling": params, "max_position_embeddings": MPE, "seq_len": 71}
    expected = aa.rope_frequencies(HEAD_DIM, pos, dtype=np.float64, **kw)
    got = backend.call(aa.rope_frequencies, HEAD_DIM, backend.asarray(pos), dtype=xp.float64, **kw)
    assert name_of_dtype(got.dtype) == "complex128"
    xp_assert_close(backend, xp.real(got), expected.real)
    xp_assert_close(backend, xp.imag(got), expected.imag)
    inv, af = aa.rope_inv_freq(HEAD_DIM, params, xp=xp, device=backend.device, seq_len=71)
    assert name_of_dtype(inv.dtype) == "float32"
    xp_assert_close(
        backend, inv, aa.rope_inv_freq(HEAD_DIM, params, seq_len=71)[0], dtype="float32"
    )


def test_backward_with_attention_factor(rng):
    """Scaled factors (|f| = attention factor != 1): the pullback is still the conjugate
    rotation, checked by finite differences."""
    x = rng.standard_normal((2, 5, 8))
    f = aa.rope_frequencies(
        8, np.arange(5), rope_scaling=CONFIGS["yarn"], dtype=np.float64, max_position_embeddings=MPE
    )
    assert not np.allclose(np.abs(f), 1.0)
    for layout in ("half", "interleaved"):
        check_vjp_fd(aa.apply_rope, [x, f], {"layout": layout}, wrt=[0])


def test_errors():
    with pytest.raises(ValueError, match="rope_type"):
        aa.rope_inv_freq(8, {"rope_type": "su"})
    with pytest.raises(TypeError, match="rope_scaling"):
        aa.rope_inv_freq(8, [("rope_type", "linear")])
    with pytest.raises(ValueError, match="factor"):
        aa.rope_inv_freq(8, {"rope_type": "linear"})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        aa.rope_inv_freq(8, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        aa.rope_inv_freq(8, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="long_factor"):
        aa.rope_inv_freq(
            8,
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 3,
                "factor": 2.0,
                "original_max_position_embeddings": 4,
            },
            seq_len=10,
        )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        aa.rope_inv_freq(8, {"partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="rotary dim"):
        aa.rope_inv_freq(10, None, partial_rotary_factor=0.5)  # 5 features
    with pytest.raises(ValueError, match="rope_theta"):
        aa.rope_inv_freq(8, {"rope_theta": -1.0})
    with pytest.raises(ValueError, match="seq_len"):
        aa.rope_inv_freq(8, None, seq_len=-1)
