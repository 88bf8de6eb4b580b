"""The RoPE factors of a ``MultiHeadAttention`` call: per-sequence positions with a
cache, HF RoPE scaling, multi-axis RoPE and M-RoPE, or the caller's ``freqs``."""

from __future__ import annotations

import numbers
from typing import Any

from ..._backend import Array, device_of, is_cupy, is_numpy, lse_dtype
from ...ops.rope import mrope_frequencies, multi_axis_rope_frequencies, rope_frequencies
from .config import AttentionConfig

__all__ = ["layer_rope_frequencies"]


def layer_rope_frequencies(
    mha: AttentionConfig,
    xp: Any,
    x: Array,
    positions: Any,
    freqs: Array | None,
    starts: list[int] | None,
) -> Array:
    if freqs is not None:
        rot = freqs
    elif positions is None and (is_numpy(xp) or is_cupy(xp)):
        # From the cache's lengths: every layer of a decoding step asks for the same
        # factors (layers of one model share their RoPE fields), so the last few are kept
        # (eager libraries only: a traced JAX array must not outlive its trace).
        L = int(x.shape[-2])
        key = (
            _rope_fields(mha),
            L,
            None if starts is None else tuple(starts),
            str(x.dtype),
            id(xp),
            repr(device_of(x)),
        )
        rot = _RECENT.get(key)
        if rot is None:
            rot = _positions_frequencies(mha, xp, x, positions, starts)
            if len(_RECENT) >= _RECENT_SIZE:
                _RECENT.pop(next(iter(_RECENT)), None)
            _RECENT[key] = rot
    else:
        rot = _positions_frequencies(mha, xp, x, positions, starts)
    if rot.ndim == 3:  # (B, L, F) -> (B, 1, L, F): the same positions for every head
        rot = xp.expand_dims(rot, axis=1)
    return rot


_RECENT: dict[tuple[Any, ...], Array] = {}
_RECENT_SIZE = 8


def _rope_fields(mha: AttentionConfig) -> tuple[Any, ...]:
    """What a layer's RoPE factors depend on besides the positions."""
    return (
        mha.dim_per_head,
        mha.rope_theta,
        repr(mha.rope_scaling),
        mha.partial_rotary_factor,
        mha.max_position_embeddings,
        mha.rope_axes,
        mha.mrope_section,
        mha.rope_position_axes,
    )


def _positions_frequencies(
    mha: AttentionConfig, xp: Any, x: Array, positions: Any, starts: list[int] | None
) -> Array:
    L = int(x.shape[-2])
    real = lse_dtype(xp, x.dtype)
    dev = device_of(x)
    seq_len = None
    if positions is None and starts is not None and len(set(starts)) > 1:
        # Each sequence continues from its own cached length.
        pos = xp.asarray([[s + i for i in range(L)] for s in starts], dtype=real, device=dev)
        seq_len = max(starts) + L
    elif positions is None or isinstance(positions, numbers.Integral):
        start = (starts[0] if starts else 0) if positions is None else int(positions)
        pos = xp.arange(start, start + L, dtype=real, device=dev)
        seq_len = start + L
    else:
        pos = positions
        if _needs_seq_len(mha):  # HF's max(position_ids) + 1: read from the data
            seq_len = int(xp.max(positions)) + 1
    A = mha.rope_position_axes
    if A is not None and (positions is None or isinstance(positions, numbers.Integral)):
        pos = xp.stack([pos] * A, axis=-1)  # text tokens: every axis the same
    rot = _frequencies(mha, pos, real, seq_len)
    return rot


def _needs_seq_len(mha: AttentionConfig) -> bool:
    scaling = mha.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type")) in ("dynamic", "longrope")


def _frequencies(mha: AttentionConfig, pos: Array, real: Any, seq_len: int | None) -> Array:
    """The complex factors of this layer's RoPE variant at positions ``pos``."""
    scaled: dict[str, Any] = {}
    if mha.rope_scaling is not None:
        scaled["rope_scaling"] = dict(mha.rope_scaling)
        scaled["seq_len"] = seq_len
    if mha.max_position_embeddings is not None:
        scaled["max_position_embeddings"] = mha.max_position_embeddings
    if mha.rope_axes is not None:
        return multi_axis_rope_frequencies(mha.rope_axes, pos, theta=mha.rope_theta, dtype=real)
    if mha.mrope_section is not None:
        return mrope_frequencies(
            mha.dim_per_head,
            pos,
            mha.mrope_section,
            theta=mha.rope_theta,
            dtype=real,
            **scaled,
        )
    if mha.partial_rotary_factor is not None:
        scaled["partial_rotary_factor"] = mha.partial_rotary_factor
    return rope_frequencies(mha.dim_per_head, pos, theta=mha.rope_theta, dtype=real, **scaled)
