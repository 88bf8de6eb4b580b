"""RoPE scaling from Hugging Face configs: every rope_type against transformers' own
ROPE_INIT_FUNCTIONS and rotary classes (configs written here, no download), on every
backend, with errors and the backward of scaled (non-unit) frequencies."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import check_vjp_fd, name_of_dtype, thin, xp_assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

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
    with pytest.raises(ValueError, match="rotary dim"):
        aa.rope_inv_freq(2, {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
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


# --- whole config.json dicts, read as transformers reads them ---------------------------

LLAMA31 = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}
PHI3 = {  # longrope, the pretraining length at the top level (it wins)
    "model_type": "phi3",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.1 * j for j in range(8)],
        "long_factor": [2.0 + 0.7 * j for j in range(8)],
        "original_max_position_embeddings": 999,
    },
}
GPT_OSS = {  # yarn with truncate false, new rope_parameters format
    "model_type": "gpt_oss",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
        "rope_theta": 150000.0,
    },
}
NEOX = {  # GPT-NeoX's rotary_pct
    "model_type": "gpt_neox",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rotary_pct": 0.25,
    "rotary_emb_base": 20000,
}
GEMMA3 = {  # rope parameters per layer type
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


@pytest.mark.parametrize(
    "config, layer_type, seq_len",
    [
        (LLAMA31, None, None),
        (PHI3, None, 32),
        (PHI3, None, 200),
        (GPT_OSS, None, None),
        (NEOX, None, None),
        (GEMMA3, "full_attention", None),
        (GEMMA3, "sliding_attention", None),
    ],
    ids=[
        "llama3.1",
        "phi3-short",
        "phi3-long",
        "gpt-oss",
        "gpt-neox",
        "gemma3-full",
        "gemma3-sliding",
    ],
)
def test_kwargs_from_config_equal_hf_rotary(config, layer_type, seq_len):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib

    mt = config["model_type"].replace("_text", "")
    conf_module = importlib.import_module(f"transformers.models.{mt}.configuration_{mt}")
    config_cls = next(
        c
        for c in vars(conf_module).values()
        if isinstance(c, type) and getattr(c, "model_type", None) == config["model_type"]
    )
    cfg = config_cls(**{k: v for k, v in config.items() if k != "model_type"})
    module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    rotary_cls = next(
        getattr(module, n)
        for n in dir(module)
        if n.endswith("RotaryEmbedding") and "Vision" not in n
    )
    rotary = rotary_cls(cfg)
    prefix = "" if layer_type is None else f"{layer_type}_"
    if seq_len is not None:  # HF's run-time update (longrope picks its factors by length)
        x = torch.zeros(1, dtype=torch.float32)
        rotary(x, torch.arange(seq_len)[None])
    expected = getattr(rotary, f"{prefix}inv_freq").numpy()
    expected_af = getattr(rotary, f"{prefix}attention_scaling")
    kw = aa.rope_kwargs_from_config(config, layer_type=layer_type)
    got, af = aa.rope_inv_freq(**kw, seq_len=seq_len, dtype=np.float64)
    np.testing.assert_allclose(got, expected, rtol=5e-7)
    assert af == pytest.approx(expected_af, rel=1e-12)


def test_kwargs_from_config_errors():
    with pytest.raises(ValueError, match="layer_type"):
        aa.rope_kwargs_from_config(GEMMA3)
    with pytest.raises(ValueError, match="layer_type"):
        aa.rope_kwargs_from_config(LLAMA31, layer_type="full_attention")
    with pytest.raises(ValueError, match="head_dim"):
        aa.rope_kwargs_from_config({"rope_theta": 10.0})
    with pytest.raises(TypeError, match="config"):
        aa.rope_kwargs_from_config([("rope_theta", 10.0)])


# --- random configs of every type against transformers ---------------------------------


@st.composite
def _random_config(draw):
    kind = draw(st.sampled_from(["linear", "dynamic", "llama3", "yarn", "longrope"]))
    head_dim = draw(st.sampled_from([16, 32, 64, 80, 128]))
    partial = draw(st.sampled_from([1.0, 0.5, 0.25]))
    rotary = int(head_dim * partial)
    params = {
        "rope_type": kind,
        "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 1e6, 123.0])),
        "partial_rotary_factor": partial,
    }
    factor = draw(st.floats(1.0, 64.0))
    original = draw(st.sampled_from([16, 128, 2048]))
    if kind in ("linear", "dynamic", "llama3", "yarn"):
        params["factor"] = factor
    if kind in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = original
    if kind == "llama3":
        low = draw(st.floats(0.5, 2.0))
        params.update(low_freq_factor=low, high_freq_factor=low + draw(st.floats(0.5, 8.0)))
    if kind == "yarn":
        params["beta_fast"] = draw(st.sampled_from([None, 8, 32, 64]))
        params["beta_slow"] = draw(st.sampled_from([None, 1, 2]))
        params["truncate"] = draw(st.booleans())
        if draw(st.booleans()):
            params.update(
                mscale=draw(st.floats(0.5, 2.0)), mscale_all_dim=draw(st.floats(0.5, 2.0))
            )
    if kind == "longrope":
        n = rotary // 2
        params["short_factor"] = draw(st.lists(st.floats(1.0, 4.0), min_size=n, max_size=n))
        params["long_factor"] = draw(st.lists(st.floats(1.0, 64.0), min_size=n, max_size=n))
        params["factor"] = factor
    seq_len = draw(st.sampled_from([None, 8, 3000, 70000]))
    return head_dim, params, seq_len


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_random_config())
def test_random_configs_equal_hf(case):
    head_dim, params, seq_len = case
    torch, LlamaConfig, INIT, _, _ = _hf()
    mpe = 4096  # above every original length drawn (transformers checks llama3's)
    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=mpe,
        rope_parameters=dict(params),
    )
    expected, expected_af = INIT[params["rope_type"]](cfg, "cpu", seq_len=seq_len)
    got, af = aa.rope_inv_freq(
        head_dim, params, max_position_embeddings=mpe, seq_len=seq_len, dtype=np.float64
    )
    # float32 in transformers: a few ulps, more where llama3's blend cancels
    np.testing.assert_allclose(got, expected.numpy(), rtol=2e-6, atol=0)
    assert af == pytest.approx(expected_af, rel=1e-12)
