"""A plain float64 NumPy attention backward (dense, explicit GQA repeat, the softmax
Jacobian written out) for the backward-kernel tests; never calls the code under test
except the seed-defined dropout hash (whose CUDA twin is checked bit for bit in
``test_dropout_hash_host.py``)."""

from __future__ import annotations

import numpy as np

from arrayattn.attention.dropout import dropout_keep

__all__ = ["reference"]


def reference(q, k, v, d_out, d_lse, *, scale, softcap, causal, align, window, q_lens, k_lens,
              dropout_p, seed, mask=None, sinks=None, alibi=None):  # fmt: skip
    """Forward (out, lse) and backward (dq, dk, dv) in float64, dense and explicit.
    ``sinks`` (gpt-oss logits) and ``alibi`` (slopes) are ``(B, Hq)`` or ``None``."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    allowed = np.ones((B, 1, L, S), dtype=bool)
    dist = np.zeros((B, 1, L, S))
    for b in range(B):
        ql = L if q_lens is None else int(q_lens[b])
        kl = S if k_lens is None else int(k_lens[b])
        off = kl - ql if align == "bottom_right" else 0
        a = (i < ql) & (j < kl)
        left, right = window
        if causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            a &= j >= i + off - left
        if right >= 0:
            a &= j <= i + off + right
        allowed[b, 0] = a
        dist[b, 0] = np.abs(i + off - j)  # ALiBi: distance from the aligned diagonal
    if mask is not None:  # boolean attn_mask, True = takes part
        allowed = allowed & np.asarray(mask, dtype=bool)
    raw = (q @ np.swapaxes(kr, -1, -2)) * scale
    t = np.tanh(raw / softcap) if softcap else None
    s = softcap * t if softcap else raw
    if alibi is not None:
        s = s - np.asarray(alibi, np.float64)[:, :, None, None] * dist
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:  # one more logit per head, with no value
        sk = np.asarray(sinks, np.float64)[:, :, None, None]
        m = np.maximum(m, sk)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    if sinks is not None:
        tot = tot + np.exp(sk - m)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    lse = np.where(tot > 0, m + np.log(np.where(tot > 0, tot, 1.0)), -np.inf)[..., 0]
    if dropout_p > 0:
        xp = np.__array_namespace__() if hasattr(np, "__array_namespace__") else np
        keep = dropout_keep(
            xp, seed, dropout_p, np.arange(B, dtype=np.int32).reshape(B, 1, 1, 1),
            np.arange(Hq, dtype=np.int32).reshape(1, Hq, 1, 1),
            np.arange(L, dtype=np.int32).reshape(L, 1), np.arange(S, dtype=np.int32),
        )  # fmt: skip
        inv = 1.0 / (1.0 - dropout_p)
        pd = np.where(keep, p * inv, 0.0)
    else:
        keep, inv, pd = None, 1.0, p
    out = pd @ vr
    # backward: softmax Jacobian written directly (no D = rowsum(dO * O) shortcut)
    dvr = np.swapaxes(pd, -1, -2) @ d_out
    dpd = d_out @ np.swapaxes(vr, -1, -2)
    dp = np.where(keep, dpd * inv, 0.0) if keep is not None else dpd
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if d_lse is not None:
        ds = ds + p * np.asarray(d_lse, np.float64)[..., None]
    if softcap:
        ds = ds * (1.0 - t * t)
    ds = ds * scale
    dq = ds @ kr
    dkr = np.swapaxes(ds, -1, -2) @ q
    dk = dkr.reshape(B, Hkv, G, S, E).sum(2)
    dv = dvr.reshape(B, Hkv, G, S, v.shape[-1]).sum(2)
    return out, lse, dq, dk, dv
