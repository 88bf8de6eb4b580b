"""Plain float64 NumPy oracles, written from the semantics page and never calling
arrayattn's implementations.

Each function takes arrays (NumPy, or anything :func:`to_numpy` understands), computes in
float64 with the most obvious formula (explicit ``repeat`` for GQA, a dense ``L x S``
mask, ``cos``/``sin`` rotations for RoPE) and returns float64 NumPy arrays. Tests compare
every backend and dtype against these; :func:`reference_attention` and
:func:`reference_vjp` are the full-signature attention oracle and its gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

import numpy as np

__all__ = [
    "reference_attention",
    "reference_vjp",
    "AttentionGrads",
    "to_numpy",
    "dropout_keep",
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


@overload
def _f64(x: None) -> None: ...
@overload
def _f64(x: Any) -> np.ndarray: ...
def _f64(x: Any) -> np.ndarray | None:
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
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    keep: Any = None,
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


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """Softmax; an all ``-inf`` slice gives zeros."""
    x = _f64(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def rms_norm(x: Any, weight: Any, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last axis."""
    x = _f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * _f64(weight)


def layer_norm(x: Any, weight: Any, bias: Any, eps: float = 1e-5) -> np.ndarray:
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


def rope_angles(head_dim: int, positions: Any, theta: float = 10000.0) -> np.ndarray:
    """Angles ``pos * theta ** (-2j / head_dim)``, shape ``positions.shape + (head_dim//2,)``."""
    j = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * j / head_dim)
    return np.asarray(positions, dtype=np.float64)[..., None] * inv_freq


def apply_rope(x: Any, angles: Any, layout: str = "interleaved") -> np.ndarray:
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


def split_heads(x: Any, num_heads: int) -> np.ndarray:
    """``(..., L, H*D) -> (..., H, L, D)``."""
    x = np.asarray(x)
    L, F = x.shape[-2:]
    y = x.reshape(x.shape[:-2] + (L, num_heads, F // num_heads))
    return np.swapaxes(y, -2, -3)


def merge_heads(x: Any) -> np.ndarray:
    """``(..., H, L, D) -> (..., L, H*D)``."""
    x = np.asarray(x)
    H, L, D = x.shape[-3:]
    return np.swapaxes(x, -2, -3).reshape(x.shape[:-3] + (L, H * D))


def repeat_kv(x: Any, n_rep: int) -> np.ndarray:
    """Each head repeated ``n_rep`` times in place (``repeat_interleave`` on axis -3)."""
    return np.repeat(np.asarray(x), n_rep, axis=-3)


# -- the dropout hash, scalar Python from the algorithm in arrayattn/attention/dropout.py's
#    docstring (kept independent so a change to either side is caught) -----------------
_ROUND_KEYS = (0x3C6E, 0xB7E1, 0x9E37, 0x5851)

# Python ints, or NumPy int64 arrays where the same integer ops apply elementwise
# (dropout_keep hashes whole index grids at once).
_Ints = int | np.ndarray


def _round(x: _Ints, key: int) -> _Ints:
    return ((((x ^ key) * 0x6F4B) >> 7) & 0xFFFF) ^ (x >> 5)


def _permute(a: _Ints, b: _Ints) -> tuple[_Ints, _Ints]:
    for key in _ROUND_KEYS:
        a, b = b, a ^ _round(b, key)
    return a, b


def dropout_bits(seed: int, batch: _Ints, head: _Ints, row: _Ints, col: _Ints) -> _Ints:
    """24 random bits for one ``(seed, batch, head, row, col)``, in plain Python ints (or
    for NumPy int64 index arrays, elementwise)."""
    seed %= 2**32
    a, b = _permute(seed & 0xFFFF, (seed >> 16) & 0xFFFF)
    for v in (batch, head, row, col):
        a, b = _permute(a ^ (v & 0xFFFF), b ^ ((v >> 16) & 0x7FFF))
    a, b = _permute(a, b)
    return (a << 8) | (b >> 8)


# -- the full-signature attention oracle and its gradients --------------------------------


@overload
def to_numpy(x: None) -> None: ...
@overload
def to_numpy(x: Any) -> np.ndarray: ...
def to_numpy(x: Any) -> np.ndarray | None:
    """A NumPy copy-or-view of any backend's array (``None`` passes through): torch
    tensors (bfloat16 widened to float32), CuPy, array-api-strict on any device, JAX and
    Dask arrays, Python scalars.

    Examples:
        >>> from arrayattn.testing import to_numpy
        >>> to_numpy([1.0, 2.0]).tolist()
        [1.0, 2.0]
    """
    if x is None or isinstance(x, np.ndarray):
        return x
    top = type(x).__module__.split(".")[0]
    if top == "torch":
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # NumPy has no bfloat16
            x = x.float()
        return x.numpy()
    if top == "cupy":
        return x.get()
    if top == "array_api_strict":
        import array_api_strict

        x = array_api_strict.asarray(x, device=array_api_strict.Device("CPU_DEVICE"))
        return np.asarray(x._array)
    return np.asarray(x)


def dropout_keep(seed: int, p: float, lead: tuple[int, ...], Hq: int, L: int, S: int) -> np.ndarray:
    """Boolean keep-mask ``(*lead, Hq, L, S)`` of seed-defined dropout, from the scalar
    hash :func:`dropout_bits` applied to NumPy integer arrays (the batch index is the flat
    index over ``lead``).

    Examples:
        >>> from arrayattn.testing.oracles import dropout_keep
        >>> dropout_keep(0, 0.5, (1,), 2, 3, 4).shape
        (1, 2, 3, 4)
    """
    batch = np.arange(math.prod(lead), dtype=np.int64).reshape(lead + (1, 1, 1))
    head = np.arange(Hq, dtype=np.int64).reshape(Hq, 1, 1)
    row = np.arange(L, dtype=np.int64).reshape(L, 1)
    col = np.arange(S, dtype=np.int64)
    bits = dropout_bits(int(seed), batch, head, row, col)
    keep = bits >= int(round(p * (1 << 24)))
    return np.broadcast_to(keep, lead + (Hq, L, S))


class AttentionGrads(NamedTuple):
    """Cotangents of :func:`reference_vjp` (float64), ``None`` where an input was absent
    or gets no gradient (bool masks, ALiBi slopes, lengths)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: np.ndarray | None
    sinks: np.ndarray | None


@dataclass
class _Forward:
    shapes: tuple[tuple[int, ...], ...]  # q, k, v shapes as given
    mask_shape: tuple[int, ...] | None
    lead: tuple[int, ...]
    G: int
    Hk: int
    out_ndim: int
    scale: float
    q: np.ndarray  # (*lead, Hq, L, E)
    k: np.ndarray  # (*lead, Hq, S, E), garbage in unseen keys zeroed
    v: np.ndarray
    tanh: np.ndarray | None
    softcap: float | None
    p: np.ndarray  # probabilities before dropout
    pd: np.ndarray  # after dropout (what multiplies value)
    drop_scale: np.ndarray | None  # keep / (1 - p), or None without dropout
    p_sink: np.ndarray | None  # (*lead, Hq, L)
    out: np.ndarray
    lse: np.ndarray


def _pad(shape: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return (1,) * (ndim - len(shape)) + tuple(shape)


def _forward(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    causal_align: str,
    window: tuple[int, int] | None,
    softcap: float | None,
    seed: int | None,
    q_lengths: Any,
    kv_lengths: Any,
    sinks: Any,
    alibi_slopes: Any,
    rnd: Any = None,
    matmul: Any = None,
) -> _Forward:
    # ``rnd`` rounds intermediates to a low precision and ``matmul`` multiplies in it: the
    # naive same-dtype computation whose error sets FlashAttention's tolerance
    # (arrayattn.testing._compare).
    rnd = rnd or (lambda x: x)
    matmul = matmul or np.matmul
    q, k, v = (to_numpy(x).astype(np.float64) for x in (query, key, value))
    shapes = (q.shape, k.shape, v.shape)
    ndim = max(q.ndim, k.ndim, v.ndim, 3)
    q, k, v = (x.reshape(_pad(x.shape, ndim)) for x in (q, k, v))
    L, E = q.shape[-2:]
    S, Ev = k.shape[-2], v.shape[-1]
    Hq, Hk = q.shape[-3], max(k.shape[-3], v.shape[-3])
    G = 1
    if enable_gqa and Hk != Hq:
        G = Hq // Hk
        k, v = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)
    Hq = max(Hq, Hk) if G == 1 else Hq
    lead = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    q = np.broadcast_to(q, lead + (Hq, L, E))
    k = np.broadcast_to(k, lead + (Hq, S, E))
    v = np.broadcast_to(v, lead + (Hq, S, Ev))
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)

    # Where each row's diagonal sits; per sequence with lengths and bottom-right alignment.
    i = np.arange(L).reshape(L, 1)
    j = np.arange(S)
    allowed = np.ones(lead + (Hq, L, S), dtype=bool)
    ql = kl = None
    if q_lengths is not None:
        ql = np.clip(to_numpy(q_lengths).astype(np.int64), 0, L).reshape(lead + (1, 1, 1))
        allowed = allowed & (i < ql)
    if kv_lengths is not None:
        kl = np.clip(to_numpy(kv_lengths).astype(np.int64), 0, S).reshape(lead + (1, 1, 1))
        allowed = allowed & (j < kl)
    offset: Any = 0
    if causal_align == "bottom_right":
        offset = S - L
        if ql is not None or kl is not None:
            offset = (S if kl is None else kl) - (L if ql is None else ql)
    diag = i + offset
    if is_causal:
        allowed = allowed & (j <= diag)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (j >= diag - left)
        if right >= 0:
            allowed = allowed & (j <= diag + right)
    mask_shape = None
    fmask = None
    if attn_mask is not None:
        m = to_numpy(attn_mask)
        mask_shape = m.shape
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            fmask = m.astype(np.float64)

    # Keys no row of a (batch, head) may see may hold anything (NaN, Inf): zero them so
    # the matmuls below cannot carry them into any output or gradient.
    seen = np.expand_dims(allowed.any(axis=-2), -1)
    k = np.where(seen, k, 0.0)
    v = np.where(seen, v, 0.0)

    s = rnd(matmul(q, np.swapaxes(k, -1, -2)) * scale)
    tanh = None
    if softcap is not None:
        tanh = np.tanh(s / softcap)
        s = rnd(softcap * tanh)
    if fmask is not None:
        s = s + fmask
    if alibi_slopes is not None:
        slopes = to_numpy(alibi_slopes).astype(np.float64)
        s = s - slopes[..., None, None] * np.abs(diag - j)
    s = np.where(allowed, s, -np.inf)
    row_max = np.max(s, axis=-1, initial=-np.inf)
    sink = None
    if sinks is not None:
        sink = np.broadcast_to(to_numpy(sinks).astype(np.float64)[..., None], lead + (Hq, L))
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = rnd(np.exp(rnd(s - row_max[..., None])))
    total = rnd(np.sum(e, axis=-1))
    e_sink = None
    if sink is not None:
        e_sink = np.exp(sink - row_max)
        total = total + e_sink
    nonempty = total > 0
    safe = np.where(nonempty, total, 1.0)
    p = rnd(np.where(nonempty[..., None], e / safe[..., None], 0.0))
    lse = np.where(nonempty, row_max + np.log(safe), -np.inf)
    p_sink = None if e_sink is None else np.where(nonempty, e_sink / safe, 0.0)
    drop_scale = None
    pd = p
    if dropout_p > 0:
        assert seed is not None  # the oracle's dropout is the seed-defined one
        drop_scale = dropout_keep(seed, dropout_p, lead, Hq, L, S) / (1.0 - dropout_p)
        pd = p * drop_scale
    out = matmul(rnd(pd), v)
    out_ndim = max(len(x) for x in shapes)
    return _Forward(
        shapes,
        mask_shape,
        lead,
        G,
        Hk,
        out_ndim,
        scale,
        q,
        k,
        v,
        tanh,
        None if softcap is None else float(softcap),
        p,
        pd,
        drop_scale,
        p_sink,
        out,
        lse,
    )


def reference_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    return_probs: bool = False,
) -> tuple[np.ndarray, ...]:
    """The attention contract computed plainly in float64 NumPy: ``(out, lse)``, or
    ``(out, lse, probs)`` with ``return_probs=True``.

    Same signature and meaning as :func:`arrayattn.scaled_dot_product_attention` (whole
    ``L x S`` score matrices, explicit ``repeat`` for GQA, a dense mask), plus ``sinks``
    (one logit per query head joining every row's denominator) and ``alibi_slopes``
    (bias ``-slope_h * |i + offset - j|``). Inputs may be any library's arrays; they are
    read in float64, whatever their dtype, so pass the rounded low-precision inputs to
    compare a float16 result.

    Shapes: ``query (..., Hq, L, E)``, ``key (..., Hkv, S, E)``, ``value (..., Hkv, S,
    Ev)`` -> ``out (..., Hq, L, Ev)``, ``lse (..., Hq, L)``, ``probs (..., Hq, L, S)``
    (after dropout). Empty rows give output 0, LSE ``-inf`` (the sink's logit with
    ``sinks``) and zero probabilities. ``dropout_p > 0`` needs an int ``seed``.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import reference_attention
        >>> q = np.ones((1, 2, 3, 4)); k = v = np.ones((1, 2, 5, 4))
        >>> out, lse = reference_attention(q, k, v, is_causal=True)
        >>> out.shape, lse.shape, out.dtype
        ((1, 2, 3, 4), (1, 2, 3), dtype('float64'))
        >>> out, lse, p = reference_attention(q, k, v, attn_mask=np.zeros((3, 5), bool),
        ...                                   return_probs=True)
        >>> float(abs(out).max()), float(lse.max()), float(p.sum())
        (0.0, -inf, 0.0)
    """
    if dropout_p > 0 and seed is None:
        raise ValueError("seed must be an int when dropout_p > 0, got None")
    f = _forward(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_align,
        window,
        softcap,
        seed,
        q_lengths,
        kv_lengths,
        sinks,
        alibi_slopes,
    )
    out = f.out.reshape(f.out.shape[f.out.ndim - f.out_ndim :])
    lse = f.lse.reshape(out.shape[:-1])
    if return_probs:
        return out, lse, f.pd.reshape(out.shape[:-1] + (f.pd.shape[-1],))
    return out, lse


def _reduce_to(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast gradient back to an input's ``shape``."""
    padded = _pad(shape, g.ndim)
    lead = g.ndim - len(padded)
    g = g.sum(axis=tuple(range(lead))) if lead > 0 else g
    axes = tuple(a for a in range(g.ndim) if padded[a] == 1 and g.shape[a] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


def reference_vjp(
    d_out: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    d_lse: Any = None,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
) -> AttentionGrads:
    """Float64 gradients of :func:`reference_attention` pulled back from ``d_out`` (the
    output's cotangent, ``None`` for zero) and ``d_lse`` (the LSE's, optional).

    The FlashAttention-2 rule written densely: ``dP = dO V^T``, ``D = rowsum(dO * O)``,
    ``dS = P * (dP - D + dLSE)``, chained through ALiBi/masks (identity), softcap
    (``1 - tanh^2``) and the scale; GQA sums over each group's query heads; broadcast
    dims are summed back to each input's shape. Empty rows contribute nothing. Returns
    :class:`AttentionGrads` with ``attn_mask`` set for float masks and ``sinks`` when
    given.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import reference_vjp
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
        >>> g = reference_vjp(np.ones((2, 3, 4)), q, k, v, is_causal=True)
        >>> g.query.shape, g.key.shape, g.attn_mask is None
        ((2, 3, 4), (2, 3, 4), True)
    """
    if dropout_p > 0 and seed is None:
        raise ValueError("seed must be an int when dropout_p > 0, got None")
    f = _forward(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_align,
        window,
        softcap,
        seed,
        q_lengths,
        kv_lengths,
        sinks,
        alibi_slopes,
    )
    full_out = f.out.shape
    do = np.zeros(full_out) if d_out is None else np.broadcast_to(to_numpy(d_out), full_out)
    dl = (
        np.zeros(f.lse.shape)
        if d_lse is None
        else np.broadcast_to(to_numpy(d_lse).astype(np.float64), f.lse.shape)
    )
    # Non-finite LSE entries (empty rows) carry no gradient.
    dl = np.where(np.isfinite(f.lse), dl, 0.0)
    dv = np.swapaxes(f.pd, -1, -2) @ do
    dp = do @ np.swapaxes(f.v, -1, -2)
    if f.drop_scale is not None:
        dp = dp * f.drop_scale
    D = np.sum(do * f.out, axis=-1)
    ds = f.p * (dp - D[..., None] + dl[..., None])
    d_sinks = None
    if f.p_sink is not None:
        d_sinks = _reduce_to(np.sum(f.p_sink * (dl - D), axis=-1), np.shape(to_numpy(sinks)))
    d_mask = None
    if f.mask_shape is not None and to_numpy(attn_mask).dtype != np.bool_:
        d_mask = _reduce_to(ds, f.mask_shape)
    if f.tanh is not None:
        ds = ds * (1.0 - f.tanh**2)
    ds = ds * f.scale
    dq = ds @ f.k
    dk = np.swapaxes(ds, -1, -2) @ f.q

    def back(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if f.G > 1:  # GQA: the query heads of one group share their KV head
            g = g.reshape(g.shape[:-3] + (f.Hk, f.G) + g.shape[-2:]).sum(axis=-3)
        return _reduce_to(g, shape)

    q_shape, k_shape, v_shape = f.shapes
    return AttentionGrads(
        _reduce_to(dq, q_shape),
        back(dk, k_shape),
        back(dv, v_shape),
        d_mask,
        d_sinks,
    )
