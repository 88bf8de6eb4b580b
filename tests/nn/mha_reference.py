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


def rope_angles(positions, D, theta):
    inv = theta ** (-np.arange(D // 2) * 2.0 / D)
    return np.asarray(positions, np.float64)[..., :, None] * inv  # (L, D/2) or (B, L, D/2)


def rope(x, ang, layout):
    """Rotate by angles ``ang`` (..., L, F) (F <= D/2 pairs; the rest passes through)."""
    D, F = x.shape[-1], ang.shape[-1]
    if ang.ndim == 3:
        ang = ang[:, None]
    c, s = np.cos(ang), np.sin(ang)
    if layout == "half":
        a, b, rest = x[..., :F], x[..., F : 2 * F], x[..., 2 * F :]
        return np.concatenate(
            [a * c - b * s, a * s + b * c, np.broadcast_to(rest, a.shape[:-1] + rest.shape[-1:])],
            axis=-1,
        )
    a, b = x[..., 0 : 2 * F : 2], x[..., 1 : 2 * F : 2]
    out = np.array(np.broadcast_to(x, np.broadcast_shapes(x.shape, c.shape[:-1] + (D,))))
    out[..., 0 : 2 * F : 2] = a * c - b * s
    out[..., 1 : 2 * F : 2] = a * s + b * c
    return out


def mha(
    cfg,
    p,
    x,
    context=None,
    mask=None,
    positions=None,
    keep=None,
    *,
    value=None,
    angles=None,
    q_lengths=None,
    kv_lengths=None,
    sinks=None,
    alibi_slopes=None,
    return_weights=False,
):
    """``cfg``: a MultiHeadAttention (only its plain fields are read); ``p``: NumPy
    params; ``mask``: bool (True = attend) or float (added) broadcastable to
    (B, Hq, L, S); ``keep``: dropout keep-mask (B, Hq, L, S) or None; ``angles``: RoPE
    angles instead of positions; ``q_lengths``/``kv_lengths``: per-sequence valid lengths
    (padding at the end; bottom-right diagonal per sequence); ``sinks (Hq,)``;
    ``alibi_slopes (Hq,)``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    Hq = cfg.num_heads
    Hkv = cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads
    D = cfg.embed_dim // Hq if cfg.head_dim is None else cfg.head_dim
    Dv = D if getattr(cfg, "v_head_dim", None) is None else cfg.v_head_dim
    fq, fk, fv = Hq * D, Hkv * D, Hkv * Dv
    src = x if context is None else np.asarray(context, np.float64)
    src_v = src if value is None else np.asarray(value, np.float64)
    if cfg.packed_qkv:
        W, b = p["qkv_proj.weight"], p.get("qkv_proj.bias")
        rows = np.split(np.arange(fq + fk + fv), [fq, fq + fk])
        q, k, v = (
            linear(inp, W[r], None if b is None else b[r])
            for inp, r in zip((x, src, src_v), rows, strict=True)
        )
    else:
        q = linear(x, p["q_proj.weight"], p.get("q_proj.bias"))
        k = linear(src, p["k_proj.weight"], p.get("k_proj.bias"))
        v = linear(src_v, p["v_proj.weight"], p.get("v_proj.bias"))
    full = getattr(cfg, "qk_norm_scope", "head") == "full"

    def norm(t, which):
        if cfg.qk_norm == "rms":
            return rms(t, p[f"{which}_norm.weight"], cfg.norm_eps)
        if cfg.qk_norm == "layer":
            return layer(t, p[f"{which}_norm.weight"], p[f"{which}_norm.bias"], cfg.norm_eps)
        return t

    if full:
        q, k = norm(q, "q"), norm(k, "k")
    q, k, v = heads(q, Hq), heads(k, Hkv), heads(v, Hkv)
    if not full:
        q, k = norm(q, "q"), norm(k, "k")
    L, S = q.shape[-2], k.shape[-2]
    if cfg.rope is not None:
        if angles is None:
            pos = np.arange(L) if positions is None else positions
            angles = rope_angles(pos, D, cfg.rope_theta)
        q = rope(q, angles, cfg.rope)
        k = rope(k, angles, cfg.rope)
    k = np.repeat(k, Hq // Hkv, axis=-3)
    v = np.repeat(v, Hq // Hkv, axis=-3)
    scale = 1 / np.sqrt(D) if cfg.scale is None else cfg.scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    softcap = getattr(cfg, "softcap", None)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    B = x.shape[0] if x.ndim == 3 else 1
    ql = np.full(B, L) if q_lengths is None else np.asarray(q_lengths)
    kl = np.full(B, S) if kv_lengths is None else np.asarray(kv_lengths)
    i = np.arange(L)[None, None, :, None]
    j = np.arange(S)[None, None, None, :]
    diag = i + (kl - ql)[:, None, None, None]  # bottom-right, per sequence
    allowed = (j < kl[:, None, None, None]) & (i < ql[:, None, None, None])
    if cfg.causal:
        allowed = allowed & (j <= diag)
    if cfg.window is not None:
        left, right = cfg.window
        if left >= 0:
            allowed = allowed & (j >= diag - left)
        if right >= 0:
            allowed = allowed & (j <= diag + right)
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, np.float64)[:, None, None] * np.abs(diag - j)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            allowed = allowed & mask
        else:
            s = s + mask
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[:, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        tot = tot + np.exp(np.asarray(sinks, np.float64)[:, None, None] - m)
    w = e / np.where(tot > 0, tot, 1.0)
    if keep is not None:
        w = w * keep / (1 - cfg.dropout_p)
    o = unheads(w @ v)
    out = linear(o, p["o_proj.weight"], p.get("o_proj.bias"))
    return (out, w) if return_weights else out
