"""A plain float64 NumPy multi-head attention written independently of arrayattn, the
oracle of the module tests (no arrayattn import here)."""

from __future__ import annotations

import numpy as np


def linear(x, w, b=None):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return y if b is None else y + np.asarray(b, np.float64)


def heads(x, h):
    *lead, L, F = x.shape
    return np.moveaxis(x.reshape(*lead, L, h, F // h), -2, -3)


def unheads(x):
    *lead, H, L, D = x.shape
    return np.moveaxis(x, -3, -2).reshape(*lead, L, H * D)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rope(x, positions, theta, layout):
    D = x.shape[-1]
    inv = theta ** (-np.arange(D // 2) * 2.0 / D)
    ang = np.asarray(positions, np.float64)[..., :, None] * inv  # (L, D/2) or (B, L, D/2)
    if ang.ndim == 3:
        ang = ang[:, None]
    c, s = np.cos(ang), np.sin(ang)
    if layout == "half":
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def mha(cfg, p, x, context=None, mask=None, positions=None, keep=None):
    """``cfg``: a MultiHeadAttention (only its plain fields are read); ``p``: NumPy
    params; ``mask``: bool (True = attend) broadcastable to (B, Hq, L, S); ``keep``:
    dropout keep-mask (B, Hq, L, S) or None."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    Hq = cfg.num_heads
    Hkv = cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads
    D = cfg.embed_dim // Hq if cfg.head_dim is None else cfg.head_dim
    src = x if context is None else np.asarray(context, np.float64)
    if cfg.packed_qkv:
        qkv = linear(x, p["qkv_proj.weight"], p.get("qkv_proj.bias"))
        q, k, v = np.split(qkv, [Hq * D, Hq * D + Hkv * D], axis=-1)
    else:
        q = linear(x, p["q_proj.weight"], p.get("q_proj.bias"))
        k = linear(src, p["k_proj.weight"], p.get("k_proj.bias"))
        v = linear(src, p["v_proj.weight"], p.get("v_proj.bias"))
    q, k, v = heads(q, Hq), heads(k, Hkv), heads(v, Hkv)
    if cfg.qk_norm == "rms":
        q = rms(q, p["q_norm.weight"], cfg.norm_eps)
        k = rms(k, p["k_norm.weight"], cfg.norm_eps)
    elif cfg.qk_norm == "layer":
        q = layer(q, p["q_norm.weight"], p["q_norm.bias"], cfg.norm_eps)
        k = layer(k, p["k_norm.weight"], p["k_norm.bias"], cfg.norm_eps)
    L, S = q.shape[-2], k.shape[-2]
    if cfg.rope is not None:
        pos = np.arange(L) if positions is None else positions
        q = rope(q, pos, cfg.rope_theta, cfg.rope)
        k = rope(k, pos, cfg.rope_theta, cfg.rope)
    k = np.repeat(k, Hq // Hkv, axis=-3)
    v = np.repeat(v, Hq // Hkv, axis=-3)
    scale = 1 / np.sqrt(D) if cfg.scale is None else cfg.scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    allowed = np.ones((L, S), bool)
    if cfg.causal:
        allowed &= np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    allowed = allowed if mask is None else allowed & mask
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(axis=-1, keepdims=True)
    w = e / np.where(tot > 0, tot, 1.0)
    if keep is not None:
        w = w * keep / (1 - cfg.dropout_p)
    o = unheads(w @ v)
    return linear(o, p["o_proj.weight"], p.get("o_proj.bias"))
