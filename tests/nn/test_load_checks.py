"""Hostile state dicts and configurations for the nn layers' loading (issue 35):
``MultiHeadAttention.load`` and ``Layer.load`` refuse NaN/Inf weights (also those a cast
to ``dtype`` overflows into Inf) and tensors whose dtype is not real floating, each
naming the checkpoint key and the parameter, with ``check_finite=False`` as the opt-out;
RoPE scaling a configuration cannot use fails when the layer is made, not at its first
call; ``rope_kwargs_from_config`` names the config field of a wrong type."""

from __future__ import annotations

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.nn import MLP, MultiHeadAttention

MHA = MultiHeadAttention(8, 2, rope="half", causal=True)


def state(**changes):
    out = {f"attn.{k}": v for k, v in MHA.init(seed=0, xp=np, dtype=np.float64).items()}
    out.update(changes)
    return out


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_refused_naming_key_and_parameter(bad):
    sd = state()
    sd["attn.k_proj.weight"] = sd["attn.k_proj.weight"].copy()
    sd["attn.k_proj.weight"][1, 2] = bad
    with pytest.raises(
        ValueError, match=r"state_dict\['attn.k_proj.weight'\] \(parameter 'k_proj.weight'\) holds"
    ):
        MHA.load(sd, prefix="attn.")
    p = MHA.load(sd, prefix="attn.", check_finite=False)
    assert not np.isfinite(p["k_proj.weight"][1, 2])
    assert np.array_equal(p["q_proj.weight"], sd["attn.q_proj.weight"])
    mlp = MLP(4, 6, activation="silu", bias=False)
    w = {k: np.ones(s) for k, s in mlp.param_shapes().items()}
    w["fc1.weight"] = np.full(w["fc1.weight"].shape, bad)
    with pytest.raises(ValueError, match=r"'fc1.weight'.*non-finite.*check_finite=False"):
        mlp.load(w)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_a_cast_that_overflows_is_refused():
    sd = state()
    sd["attn.o_proj.weight"] = sd["attn.o_proj.weight"] * 1e6  # > float16's 65504
    with pytest.raises(ValueError, match=r"'o_proj.weight'.*after the cast to float16"):
        MHA.load(sd, prefix="attn.", dtype=np.float16)
    assert MHA.load(sd, prefix="attn.", dtype=np.float32)["o_proj.weight"].dtype == np.float32


@pytest.mark.parametrize(
    "bad", [np.ones((8, 8), np.int32), np.ones((8, 8), bool), np.ones((8, 8), np.complex64)]
)
def test_a_non_float_weight_is_refused_even_with_dtype(bad):
    with pytest.raises(TypeError, match=rf"'attn.q_proj.weight'.*dtype {bad.dtype}.*floating"):
        MHA.load(state(**{"attn.q_proj.weight": bad}), prefix="attn.", dtype=np.float32)


def test_check_finite_must_be_a_bool():
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        MHA.load(state(), prefix="attn.", check_finite="yes")


@pytest.mark.parametrize(
    "scaling, pattern",
    [
        ({"rope_type": "wavy"}, r"rope_type must be one of .*'wavy'"),
        ({"rope_type": "linear"}, r"needs rope_scaling\['factor'\]"),
        ({"rope_type": "linear", "factor": -2.0}, r"factor'\] must be a positive"),
        ({"rope_type": "dynamic", "factor": 2.0}, r"needs max_position_embeddings"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 2, "long_factor": [1.0]},
            r"long_factor",
        ),
    ],
    ids=["unknown", "no factor", "negative", "dynamic", "longrope"],
)
def test_bad_rope_scaling_fails_when_the_layer_is_made(scaling, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(
            8,
            2,
            rope="half",
            rope_scaling=scaling,
            max_position_embeddings=None if scaling["rope_type"] == "dynamic" else 16,
        )


@pytest.mark.parametrize(
    "config, error, pattern",
    [
        ({"hidden_size": "64", "num_attention_heads": 4}, TypeError, r"config's hidden_size"),
        ({"hidden_size": 64, "num_attention_heads": 0}, ValueError, r"num_attention_heads must"),
        ({"head_dim": 16.0}, TypeError, r"config's head_dim must be a positive int"),
        ({"head_dim": 16, "rope_theta": "1e4"}, TypeError, r"config's rope_theta must be a number"),
        ({"head_dim": 16, "max_position_embeddings": -1}, ValueError, r"max_position_embeddings"),
        (
            {"head_dim": 16, "rope_scaling": {"rope_type": "nope"}},
            ValueError,
            r"rope_scaling.*'nope'",
        ),
        ({"head_dim": 16, "rope_scaling": [1]}, TypeError, r"must be a dict"),
        ({"head_dim": 16, "layer_types": 3}, TypeError, r"layer_types must be a list"),
        (
            {"head_dim": 16, "layer_types": ["a"], "rope_parameters": {"a": 5}},
            TypeError,
            r"rope_parameters\['a'\] must be a dict",
        ),
    ],
)
def test_rope_kwargs_from_config_names_the_field(config, error, pattern):
    with pytest.raises(error, match=pattern):
        aa.rope_kwargs_from_config(config, layer_type="a" if "rope_parameters" in config else None)
