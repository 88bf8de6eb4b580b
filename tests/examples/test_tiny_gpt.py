"""examples/tiny_gpt.py: the model-level backward against finite differences, a short
training run whose loss falls, and KV-cache decoding equal to full recomputation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script

from arrayattn.nn import KVCache

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt.py"


def _load_example():
    return load_script("examples/tiny_gpt.py")


gpt = _load_example()


def tiny_config(tied: bool):
    return gpt.GPTConfig(
        vocab_size=11, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, tied=tied
    )


def float64_params(cfg, seed):
    params = gpt.init_params(cfg, seed=seed, xp=np)
    rng = np.random.default_rng(seed)
    # larger than the init so every path (norm weights too) carries a visible gradient
    return {k: v.astype(np.float64) + 0.1 * rng.standard_normal(v.shape) for k, v in params.items()}


@pytest.mark.parametrize("tied", [True, False])
def test_model_backward_matches_finite_differences(tied):
    cfg = tiny_config(tied)
    params = float64_params(cfg, 0)
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, 11, (2, 7)), rng.integers(0, 11, (2, 7))

    def loss_of(p):
        logits, _ = gpt.forward(p, cfg, ids)
        return float(gpt.loss_and_grad(logits, targets)[0])

    logits, tape = gpt.forward(params, cfg, ids, record=True)
    _, d_logits = gpt.loss_and_grad(logits, targets)
    grads = gpt.backward(tape, cfg, d_logits)
    assert set(grads) == set(params)
    eps = 1e-5
    for name, value in params.items():
        assert grads[name].shape == value.shape, name
        u = rng.standard_normal(value.shape)
        num = (
            loss_of({**params, name: value + eps * u}) - loss_of({**params, name: value - eps * u})
        ) / (2 * eps)
        ana = float(np.sum(grads[name] * u))
        assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)), (name, num, ana)


def test_cross_entropy_matches_plain_numpy():
    rng = np.random.default_rng(2)
    logits, targets = rng.standard_normal((2, 3, 5)), rng.integers(0, 5, (2, 3))
    loss, grad = gpt.loss_and_grad(logits, targets)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.mean(np.take_along_axis(logp, targets[..., None], -1))
    np.testing.assert_allclose(loss, expected, rtol=1e-12)
    softmax = np.exp(logp)
    np.testing.assert_allclose(grad, (softmax - np.eye(5)[targets]) / targets.size, rtol=1e-12)
    np.testing.assert_allclose(grad.sum(-1), 0.0, atol=1e-15)


def test_parameters_and_gradients_share_the_hugging_face_names():
    cfg = tiny_config(False)
    params = gpt.init_params(cfg, seed=0, xp=np)
    assert "model.layers.1.mlp.gate_proj.weight" in params and "lm_head.weight" in params
    assert set(gpt.subtree(params, "model.layers.0.mlp.")) == set(cfg.mlp.param_shapes())
    cfg.mlp.check_params(gpt.subtree(params, "model.layers.1.mlp."))
    cfg.attention.check_params(gpt.subtree(params, "model.layers.1.self_attn."))


def test_kv_cache_generation_equals_full_recomputation_every_step():
    cfg = tiny_config(True)
    params = gpt.init_params(cfg, seed=3, xp=np)
    ids, worst = gpt.generate(params, cfg, np.array([1, 2, 3]), new_tokens=12, seed=0, xp=np)
    assert len(ids) == 15 and 0 <= worst < 1e-5


def test_kv_cache_buffers_are_written_in_place():
    cfg = tiny_config(True)
    params = gpt.init_params(cfg, seed=4, xp=np)
    caches = [cfg.attention.new_cache(1, 8, xp=np) for _ in range(cfg.n_layers)]
    buffers = [c.keys for c in caches]
    gpt.forward(params, cfg, np.array([[1, 2, 3]]), caches=caches)
    gpt.forward(params, cfg, np.array([[4]]), caches=caches)
    assert all(isinstance(c, KVCache) and c.length == 4 for c in caches)
    assert all(c.keys is b for c, b in zip(caches, buffers, strict=True))


def test_script_trains_and_decodes_quickly():
    # A subprocess, so the script's one-BLAS-thread default applies as it does for users.
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "30", "--new-tokens", "10", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = run.stdout
    first, last = (float(v) for v in re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.5, out  # from ~ln(55) = 4.0 to below 3.5 in 30 steps
    assert "KV-cache logits == full recomputation at all 10 steps" in out
