"""Multi-axis RoPE: Wan2.1's 3D RoPE (its rope_params + rope_apply reproduced below in
torch), FLUX's EmbedND (reproduced), Qwen2-VL / Qwen3-VL M-RoPE (transformers' own rotary
classes), grid positions, every backend."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import check_vjp_fd, name_of_dtype, thin, xp_assert_close

import arrayattn as aa

# --- Wan2.1 (wan/modules/model.py), written out plainly in float64 torch ---------------


def _wan_rope_params(torch, max_seq_len: int, dim: int, theta: float = 10000.0):
    # complex exp(i * pos * theta ** (-2j / dim)), float64 angles: Wan2.1's rope_params
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))
    angles = torch.outer(torch.arange(max_seq_len).to(torch.float64), inv)
    return torch.polar(torch.ones_like(angles), angles)


def _wan_freqs(torch, d: int):
    # the model's table: three ladders over d - 4 (d // 6), 2 (d // 6), 2 (d // 6) features
    return torch.cat(
        [
            _wan_rope_params(torch, 1024, d - 4 * (d // 6)),
            _wan_rope_params(torch, 1024, 2 * (d // 6)),
            _wan_rope_params(torch, 1024, 2 * (d // 6)),
        ],
        dim=1,
    )


def _wan_rope_apply(torch, x, grid_sizes, freqs):
    """x: (B, L, N, D); rotates the first F*H*W tokens of each sample (Wan2.1's rope_apply)."""
    n, c = x.size(2), x.size(3) // 2
    parts = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    out = []
    for i, (f, h, w) in enumerate(grid_sizes):
        seq_len = f * h * w
        xi = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        fi = torch.cat(
            [
                parts[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                parts[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                parts[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(seq_len, 1, -1)
        xi = torch.view_as_real(xi * fi).flatten(2)
        out.append(torch.cat([xi, x[i, seq_len:].to(torch.float64)]))
    return torch.stack(out)


@pytest.mark.parametrize("d, grid", [(12, (2, 3, 4)), (20, (3, 2, 2)), (128, (2, 4, 3))])
def test_wan_3d_rope_equals_wan(rng, d, grid):
    torch = pytest.importorskip("torch")
    B, N = 2, 3
    L = int(np.prod(grid))
    x = rng.standard_normal((B, L, N, d))
    expected = _wan_rope_apply(torch, torch.from_numpy(x), [grid] * B, _wan_freqs(torch, d))
    pos = aa.grid_positions(grid, xp=np)
    f = aa.multi_axis_rope_frequencies(aa.wan_axes_dim(d), pos, dtype=np.float64)
    assert f.shape == (L, d // 2) and f.dtype == np.complex128
    # arrayattn's layout is (B, N, L, D)
    y = aa.apply_rope(np.moveaxis(x, 2, 1), f, layout="interleaved")
    np.testing.assert_allclose(np.moveaxis(y, 1, 2), expected.numpy(), rtol=1e-12, atol=1e-12)


def test_wan_padding_tokens_pass_through(rng):
    """Wan2.1 leaves the tokens after F*H*W unrotated: per-sample grids of different sizes
    are per-sample positions with padding rows at angle 0 (frequency 1)."""
    torch = pytest.importorskip("torch")
    d, grids, L = 12, [(2, 2, 3), (1, 3, 2)], 14
    x = rng.standard_normal((2, L, 2, d))
    expected = _wan_rope_apply(torch, torch.from_numpy(x), grids, _wan_freqs(torch, d))
    pos = np.zeros((2, L, 3), dtype=np.int64)
    for i, g in enumerate(grids):
        pos[i, : int(np.prod(g))] = aa.grid_positions(g, xp=np)
    f = aa.multi_axis_rope_frequencies(aa.wan_axes_dim(d), pos, dtype=np.float64)  # (B, L, F)
    y = aa.apply_rope(np.moveaxis(x, 2, 1), f[:, None])
    np.testing.assert_allclose(np.moveaxis(y, 1, 2), expected.numpy(), rtol=1e-12, atol=1e-12)


# --- FLUX (flux/math.py rope/apply_rope + EmbedND), written out plainly ----------------


def _flux_rope(pos: np.ndarray, dim: int, theta: float) -> np.ndarray:
    scale = np.arange(0, dim, 2, dtype=np.float64) / dim
    omega = 1.0 / theta**scale
    out = pos[..., None] * omega  # (..., N, dim/2)
    m = np.stack([np.cos(out), -np.sin(out), np.sin(out), np.cos(out)], axis=-1)
    return m.reshape(*out.shape, 2, 2)


def _flux_apply(x: np.ndarray, ids: np.ndarray, axes_dim, theta: float) -> np.ndarray:
    """x (B, H, N, D), ids (B, N, A): EmbedND then FLUX's apply_rope."""
    pe = np.concatenate([_flux_rope(ids[..., i], d, theta) for i, d in enumerate(axes_dim)], -3)
    pe = pe[:, None]  # (B, 1, N, D/2, 2, 2)
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2)
    out = pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]
    return out.reshape(x.shape)


def test_flux_axes_dim_equals_flux(rng):
    axes_dim, theta = (4, 6, 6), 10000.0
    B, H, T = 2, 3, 3  # 3 text tokens at (0, 0, 0) then a 2 x 3 image at (0, h, w)
    ids = np.concatenate([np.zeros((T, 3)), aa.grid_positions((1, 2, 3), xp=np)], axis=0)
    ids = np.broadcast_to(ids, (B,) + ids.shape).astype(np.float64)
    x = rng.standard_normal((B, H, ids.shape[1], sum(axes_dim)))
    f = aa.multi_axis_rope_frequencies(axes_dim, ids, theta=theta, dtype=np.float64)
    y = aa.apply_rope(x, f[:, None], layout="interleaved")
    np.testing.assert_allclose(y, _flux_apply(x, ids, axes_dim, theta), rtol=1e-12, atol=1e-12)


def test_per_axis_theta_and_unused_axis():
    pos = aa.grid_positions((3, 4), xp=np)
    f = aa.multi_axis_rope_frequencies((4, 0), pos, theta=(100.0, 7.0), dtype=np.float64)
    np.testing.assert_allclose(f, aa.rope_frequencies(4, pos[:, 0], theta=100.0, dtype=np.float64))


# --- Qwen2-VL / Qwen3-VL M-RoPE: transformers' own classes ----------------------------


def _qwen_positions(rng):
    # 4 text tokens, a 2 x 2 x 3 video grid starting at 4, 3 text tokens after it
    text = np.stack([np.arange(4)] * 3, axis=-1)
    vision = aa.grid_positions((2, 2, 3), offset=4, xp=np)
    after = np.stack([np.arange(7, 10)] * 3, axis=-1)
    one = np.concatenate([text, vision, after], axis=0)  # (19, 3)
    other = rng.integers(0, 40, size=one.shape)
    return np.stack([one, other])  # (B=2, N, 3)


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen3_vl", "qwen2_vl_yarn"])
def test_mrope_equals_transformers(rng, variant):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    head_dim = 32
    pos = _qwen_positions(rng)
    position_ids = torch.from_numpy(np.moveaxis(pos, -1, 0).copy())  # HF: (3, B, N)
    if variant.startswith("qwen2_vl"):
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VLRotaryEmbedding as Rotary,
        )
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

        section, interleaved = [4, 6, 6], False
        params = {"rope_type": "default", "mrope_section": section, "rope_theta": 1000.0}
        if variant.endswith("yarn"):
            params.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
        cfg = Qwen2VLTextConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            max_position_embeddings=32,
            rope_parameters=params,
        )
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (
            Qwen3VLTextRotaryEmbedding as Rotary,
        )
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

        section, interleaved = [6, 5, 5], True
        params = {
            "rope_type": "default",
            "mrope_section": section,
            "mrope_interleaved": True,
            "rope_theta": 1000.0,
        }
        cfg = Qwen3VLTextConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            head_dim=head_dim,
            rope_parameters=params,
        )
    q = rng.standard_normal((2, 4, pos.shape[1], head_dim)).astype(np.float32)
    cos, sin = Rotary(cfg)(torch.from_numpy(q), position_ids)
    q_hf, _ = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    f = aa.mrope_frequencies(
        head_dim,
        pos,
        section,
        interleaved=interleaved,
        rope_scaling=params,
        max_position_embeddings=32,
    )
    assert f.shape == (2, pos.shape[1], head_dim // 2) and f.dtype == np.complex64
    # the sections (and Qwen3-VL's interleaving) read from the config's dict itself
    g = aa.mrope_frequencies(head_dim, pos, rope_scaling=params, max_position_embeddings=32)
    np.testing.assert_array_equal(g, f)
    y = aa.apply_rope(q, f[:, None], layout="half")
    np.testing.assert_allclose(y, q_hf.numpy(), rtol=2e-5, atol=2e-5)


def test_mrope_text_tokens_are_plain_rope():
    pos = np.stack([np.arange(9)] * 3, axis=-1)
    for interleaved in (False, True):
        f = aa.mrope_frequencies(24, pos, [4, 4, 4], interleaved=interleaved, dtype=np.float64)
        np.testing.assert_allclose(f, aa.rope_frequencies(24, 9, xp=np, dtype=np.float64))


# --- backends, backward, errors ---------------------------------------------------------


def test_grid_positions(backend):
    xp = backend.xp
    g = aa.grid_positions((2, 3, 4), offset=(1, 0, 5), xp=xp, device=backend.device)
    assert tuple(g.shape) == (24, 3) and g.dtype == xp.int64
    f, h, w = np.meshgrid(np.arange(2), np.arange(3), np.arange(4), indexing="ij")
    expected = np.stack([f.ravel() + 1, h.ravel(), w.ravel() + 5], axis=-1)
    np.testing.assert_array_equal(backend.to_numpy(g), expected)


@pytest.mark.parametrize("kind", ["multi_axis", "mrope"])
def test_frequencies_on_backend(backend, rng, kind):
    thin(backend, kind == "mrope")
    xp = backend.xp
    pos = rng.integers(0, 50, size=(2, 7, 3))
    if kind == "multi_axis":
        kw = {}

        def run(p, **o):
            return aa.multi_axis_rope_frequencies((6, 4, 4), p, **o)

    else:
        kw = {"interleaved": True}

        def run(p, **o):
            return aa.mrope_frequencies(14, p, [3, 2, 2], **o)

    for real in ("float32", "float64"):
        expected = run(pos, dtype=getattr(np, real), **kw)
        got = backend.call(run, backend.asarray(pos), dtype=getattr(xp, real), **kw)
        assert name_of_dtype(got.dtype) == ("complex128" if real == "float64" else "complex64")
        tol = {"rtol": 1e-12, "atol": 1e-12} if real == "float64" else {"rtol": 1e-6, "atol": 1e-6}
        xp_assert_close(backend, xp.real(got), expected.real, **tol)
        xp_assert_close(backend, xp.imag(got), expected.imag, **tol)
        # rotating with them on the backend: both layouts
        x = rng.standard_normal((2, 2, 7, 16)).astype(real)
        for layout in ("interleaved", "half"):
            y = backend.call(
                aa.apply_rope, backend.asarray(x), xp.expand_dims(got, axis=1), layout=layout
            )
            ref = aa.apply_rope(x, expected[:, None], layout=layout)
            xp_assert_close(backend, y, ref, dtype=real, **tol)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_backward_finite_differences(rng, layout):
    pos = aa.grid_positions((2, 2, 2), xp=np)
    x = rng.standard_normal((1, 2, 8, 14))
    f = aa.multi_axis_rope_frequencies(aa.wan_axes_dim(12), pos, dtype=np.float64)
    check_vjp_fd(aa.apply_rope, [x, f], {"layout": layout}, wrt=[0])
    g = aa.mrope_frequencies(12, pos, [2, 2, 2], dtype=np.float64)
    check_vjp_fd(aa.apply_rope, [x, g], {"layout": layout}, wrt=[0])


def test_errors():
    pos = aa.grid_positions((2, 2), xp=np)
    with pytest.raises(ValueError, match="positions"):
        aa.multi_axis_rope_frequencies((4, 4, 4), pos)  # 2 columns for 3 axes
    with pytest.raises(ValueError, match="axes_dim"):
        aa.multi_axis_rope_frequencies((4, 3), pos)
    with pytest.raises(ValueError, match="theta"):
        aa.multi_axis_rope_frequencies((4, 4), pos, theta=(1.0, 2.0, 3.0))
    with pytest.raises(TypeError, match="positions"):
        aa.multi_axis_rope_frequencies((4, 4), pos > 0)
    with pytest.raises(ValueError, match="mrope_section"):
        aa.mrope_frequencies(16, pos, [4, 3])  # sums to 7, not 8
    with pytest.raises(ValueError, match="mrope_section"):
        aa.mrope_frequencies(16, pos)
    with pytest.raises(ValueError, match="interleaved"):
        aa.mrope_frequencies(16, pos, [4, 4], interleaved=True)
    with pytest.raises(ValueError, match="seq_len"):
        aa.mrope_frequencies(16, pos, [4, 4], rope_scaling={"rope_type": "dynamic", "factor": 2})
    with pytest.raises(ValueError, match="offset"):
        aa.grid_positions((2, 3), offset=(1, 2, 3))
    with pytest.raises(ValueError, match="grid"):
        aa.grid_positions((2, -1))
    with pytest.raises(ValueError, match="head_dim"):
        aa.wan_axes_dim(4)


def test_mrope_takes_what_rope_kwargs_from_config_returns():
    """``mrope_frequencies(positions=..., **rope_kwargs_from_config(config))`` works: it
    accepts every key the config helper returns (``partial_rotary_factor`` included)."""
    config = {"hidden_size": 1536, "num_attention_heads": 12, "rope_theta": 1e6,
              "max_position_embeddings": 32768,
              "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}  # fmt: skip
    kw = aa.rope_kwargs_from_config(config)
    assert "partial_rotary_factor" in kw
    pos = np.broadcast_to(np.arange(5)[:, None], (5, 3))
    f = aa.mrope_frequencies(positions=pos, **kw)
    # equal positions on every axis: plain 1-D RoPE of the same ladder
    np.testing.assert_allclose(f, aa.rope_frequencies(positions=np.arange(5), **kw), rtol=1e-6)
    # a partial rotary factor: the sections count the rotated frequencies
    half = aa.mrope_frequencies(
        128, pos, [8, 12, 12], theta=1e6, partial_rotary_factor=0.5
    )
    assert half.shape == (5, 32)
    with pytest.raises(ValueError, match="must sum to 32"):
        aa.mrope_frequencies(128, pos, [16, 24, 24], partial_rotary_factor=0.5)
