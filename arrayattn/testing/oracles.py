"""Plain float64 NumPy oracles, written from ``SEMANTICS.md`` and never calling arrayattn.

Each function takes NumPy arrays, computes in float64 with the most obvious formula
(explicit ``repeat`` for GQA, a dense ``L x S`` mask, ``cos``/``sin`` rotations for RoPE)
and returns float64 NumPy arrays. Tests compare every backend and dtype against these.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "attention",
    "structural_mask",
    "softmax",
    "rms_norm",
    "layer_norm",
    "rope_angles",
    "apply_rope",
    "split_heads",
    "merge_heads",
    "repeat_kv",
    "dropout_bits",
]


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def structural_mask(
    L: int,
    S: int,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
) -> np.ndarray:
    """Dense ``(L, S)`` "may attend" matrix for causal alignment and sliding window."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    diag = i + (0 if causal_align == "top_left" else S - L)
    allowed = np.ones((L, S), dtype=bool)
    if is_causal:
        allowed &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= diag - left
        if right >= 0:
            allowed &= j <= diag + right
    return allowed


def attention(
    q,
    k,
    v,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    keep=None,
    seed: int | None = None,  # noqa: ARG001 - the mask comes in as ``keep``
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference attention: ``(out, lse, probs)``.

    ``keep`` is the boolean keep-mask broadcastable to ``(..., Hq, L, S)`` used when
    ``dropout_p > 0``; ``probs`` are after dropout (what ``attention_weights`` returns).
    Empty rows give output 0, LSE ``-inf`` and zero probabilities.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    L, E = q.shape[-2:]
    S = k.shape[-2]
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, group, axis=-3)
        v = np.repeat(v, group, axis=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    allowed = structural_mask(L, S, is_causal=is_causal, causal_align=causal_align, window=window)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = allowed & mask
        else:
            s = s + mask.astype(np.float64)
    s = np.where(allowed, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(s - row_max)
    total = np.sum(e, axis=-1, keepdims=True)
    nonempty = total > 0
    p = np.where(nonempty, e / np.where(nonempty, total, 1.0), 0.0)
    lse = np.where(nonempty, row_max + np.log(np.where(nonempty, total, 1.0)), -np.inf)[..., 0]
    if dropout_p > 0:
        p = np.where(keep, p / (1.0 - dropout_p), 0.0)
    out = p @ v
    return out, lse, p


def softmax(x, axis: int = -1) -> np.ndarray:
    """Softmax; an all ``-inf`` slice gives zeros."""
    x = _f64(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def rms_norm(x, weight, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last axis."""
    x = _f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * _f64(weight)


def layer_norm(x, weight, bias, eps: float = 1e-5) -> np.ndarray:
    """``(x - mean) / sqrt(biased var + eps) * weight + bias`` over the last axis."""
    x = _f64(x)
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y


def rope_angles(head_dim: int, positions, theta: float = 10000.0) -> np.ndarray:
    """Angles ``pos * theta ** (-2j / head_dim)``, shape ``positions.shape + (head_dim//2,)``."""
    j = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * j / head_dim)
    return np.asarray(positions, dtype=np.float64)[..., None] * inv_freq


def apply_rope(x, angles, layout: str = "interleaved") -> np.ndarray:
    """Rotate feature pairs of ``x`` by ``angles`` ``(..., L, F)`` with real cos/sin.

    ``interleaved`` pairs ``(2j, 2j+1)``; ``half`` pairs ``(j, j + F)``; features from
    ``2F`` on pass through."""
    x = _f64(x)
    angles = _f64(angles)
    F = angles.shape[-1]
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.array(
        np.broadcast_to(x, np.broadcast_shapes(x.shape[:-1], angles.shape[:-1]) + x.shape[-1:])
    )
    if layout == "interleaved":
        a, b = out[..., 0 : 2 * F : 2].copy(), out[..., 1 : 2 * F : 2].copy()
        out[..., 0 : 2 * F : 2] = a * cos - b * sin
        out[..., 1 : 2 * F : 2] = a * sin + b * cos
    elif layout == "half":
        a, b = out[..., :F].copy(), out[..., F : 2 * F].copy()
        out[..., :F] = a * cos - b * sin
        out[..., F : 2 * F] = a * sin + b * cos
    else:
        raise ValueError(layout)
    return out


def split_heads(x, num_heads: int) -> np.ndarray:
    """``(..., L, H*D) -> (..., H, L, D)``."""
    x = np.asarray(x)
    L, F = x.shape[-2:]
    y = x.reshape(x.shape[:-2] + (L, num_heads, F // num_heads))
    return np.swapaxes(y, -2, -3)


def merge_heads(x) -> np.ndarray:
    """``(..., H, L, D) -> (..., L, H*D)``."""
    x = np.asarray(x)
    H, L, D = x.shape[-3:]
    return np.swapaxes(x, -2, -3).reshape(x.shape[:-3] + (L, H * D))


def repeat_kv(x, n_rep: int) -> np.ndarray:
    """Each head repeated ``n_rep`` times in place (``repeat_interleave`` on axis -3)."""
    return np.repeat(np.asarray(x), n_rep, axis=-3)


# -- the dropout hash, scalar Python from the algorithm in arrayattn/ops/dropout.py's
#    docstring (kept independent so a change to either side is caught) -----------------
_ROUND_KEYS = (0x3C6E, 0xB7E1, 0x9E37, 0x5851)


def _round(x: int, key: int) -> int:
    return ((((x ^ key) * 0x6F4B) >> 7) & 0xFFFF) ^ (x >> 5)


def _permute(a: int, b: int) -> tuple[int, int]:
    for key in _ROUND_KEYS:
        a, b = b, a ^ _round(b, key)
    return a, b


def dropout_bits(seed: int, batch: int, head: int, row: int, col: int) -> int:
    """24 random bits for one ``(seed, batch, head, row, col)``, in plain Python ints."""
    seed %= 2**32
    a, b = _permute(seed & 0xFFFF, (seed >> 16) & 0xFFFF)
    for v in (batch, head, row, col):
        a, b = _permute(a ^ (v & 0xFFFF), b ^ ((v >> 16) & 0x7FFF))
    a, b = _permute(a, b)
    return (a << 8) | (b >> 8)
