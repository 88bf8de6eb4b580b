"""Validation of a ``MultiHeadAttention`` call: every argument is checked before anything
is computed or a cache is written, so a rejected call changes nothing."""

from __future__ import annotations

import numbers
from typing import Any

import array_api_compat

from ..._backend import Array, device_of, namespace_of
from .._validate import _flag
from ..cascade_cache import CascadeKVCache
from ..kv_cache import KVCache, host_lengths
from ..paged_kv_cache import PagedKVCache
from .config import AttentionConfig

__all__ = ["check_call", "check_positions"]

PADDING_SIDES = ("right", "left")


def check_call(
    mha: AttentionConfig,
    x: Array,
    context: Array | None,
    value: Array | None,
    attn_mask: Array | None,
    positions: Any,
    freqs: Array | None,
    lengths: Any,
    padding_side: str,
    cache: Any,
    training: bool,
    seed: Any,
    need_weights: bool = False,
    flex: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate a call's arguments (nothing is computed or changed); returns what the
    forward needs: the host lengths of the new tokens and the cache's starts. ``flex``:
    the ``block_mask``/``mask_mod``/``score_mod`` given (the attention checks them
    against its shapes; here only what the layer cannot combine them with)."""
    xp = namespace_of(x=x)
    if flex:
        names = "/".join(sorted(flex))
        if cache is not None:
            raise ValueError(
                f"{names} with a cache is not supported: the attention then runs over the "
                "cache's keys (positions the call's block mask does not describe); call "
                "without a cache, or pass attn_mask / lengths"
            )
        if padding_side == "left":
            raise ValueError(
                f'{names} with padding_side="left" is not supported: left-padded rows are '
                "moved internally, which shifts the positions a mask_mod sees; pad on the "
                "right"
            )
    if x.ndim < 2 or x.shape[-1] != mha.embed_dim:
        raise ValueError(
            f"x must have shape (..., L, embed_dim={mha.embed_dim}), got {tuple(x.shape)}"
        )
    _flag("training", training)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    if value is not None and context is None:
        raise ValueError("value (the values' input) needs context (the keys' input)")
    for name, a, width in (
        ("context", context, mha.kv_input_dim),
        ("value", value, mha.value_input_dim),
    ):
        if a is None:
            continue
        if a.ndim < 2 or a.shape[-1] != width:
            dim = "context_dim" if name == "context" else "value_context_dim"
            raise ValueError(
                f"{name} must have shape (..., S, {dim}={width}), got {tuple(a.shape)}"
            )
    # (value without context was refused above: context is not None here)
    if value is not None and context is not None and value.shape[-2] != context.shape[-2]:
        raise ValueError(
            f"value and context must have the same length S, got shapes "
            f"{tuple(value.shape)} and {tuple(context.shape)}"
        )
    if context is not None and (mha.rope is not None or freqs is not None):
        raise ValueError(
            "context (cross-attention) with rope is not supported: RoPE positions of "
            "queries and context keys are not comparable"
        )
    if attn_mask is not None and not array_api_compat.is_array_api_obj(attn_mask):
        raise TypeError(f"attn_mask must be an array or None, got {type(attn_mask).__name__}")
    # is_array_api_obj narrows attn_mask to array_api_compat's array types, one of them a
    # protocol without .dtype; every array-API array has one.
    mask_dtype = None if attn_mask is None else attn_mask.dtype  # type: ignore[union-attr]
    if mask_dtype is not None and not (
        mask_dtype == xp.bool or xp.isdtype(mask_dtype, "real floating")
    ):
        raise TypeError(
            f"attn_mask must be bool (True = takes part) or real floating (added to the "
            f"scores), got {mask_dtype}"
        )
    check_positions(mha, x, positions, freqs)
    L = int(x.shape[-2])
    n_new: tuple[int, ...] | None = None
    lengths_array = None
    batched = lengths is not None or cache is not None or padding_side == "left"
    if batched and x.ndim != 3:
        raise ValueError(
            f"with a cache or lengths, x must be (B, L, embed_dim), got {tuple(x.shape)}"
        )
    B = int(x.shape[0])
    if lengths is not None:
        if context is not None:
            raise ValueError("lengths is for mha-attention; mask a context with attn_mask")
        n_new = host_lengths("lengths", lengths, B, L)
        if cache is None:  # left padding is rolled to the right before attention
            lengths_array = xp.asarray(list(n_new), dtype=xp.int64, device=device_of(x))
    elif padding_side == "left":
        raise ValueError('padding_side="left" needs lengths (real tokens per row)')
    if padding_side == "left" and attn_mask is not None:
        raise ValueError(
            'attn_mask cannot be combined with padding_side="left"; lengths already masks '
            "the padding (use right padding for other masks)"
        )
    starts = None
    if cache is not None:
        if not isinstance(cache, (KVCache, PagedKVCache, CascadeKVCache)):
            raise TypeError(
                f"cache must be a KVCache, PagedKVCache or CascadeKVCache, got "
                f"{type(cache).__name__}"
            )
        if isinstance(cache, CascadeKVCache):
            _check_cascade(mha, context, attn_mask, training, need_weights)
        if cache.batch_size != B:
            raise ValueError(f"cache has {cache.batch_size} sequences (rows) but x has {B} rows")
        kinds = (cache.num_kv_heads, cache.head_dim, cache.value_dim)
        want = (mha.kv_heads, mha.dim_per_head, mha.value_dim_per_head)
        if kinds != want:
            raise ValueError(
                f"cache holds (num_kv_heads, head_dim, value_dim) = {kinds}, this layer "
                f"needs {want}"
            )
        if context is not None:
            if isinstance(cache, PagedKVCache):
                raise ValueError("a PagedKVCache is for mha-attention; use KVCache for context")
            held = cache.lengths
            S = int(context.shape[-2])
            if held.max() > 0 and (held != S).any():
                raise ValueError(
                    f"cache holds the keys/values of a context of length {held.tolist()}, "
                    f"got a context of length {S}; call cache.reset() before attending to "
                    f"a new context"
                )
            if held.max() == 0:
                cache.check_append((S,) * B, x.dtype)
        else:
            if n_new is None:
                n_new = (L,) * B
            cache.check_append(n_new, x.dtype)
            starts = cache.lengths.tolist()
        if isinstance(cache, PagedKVCache) and training and mha.dropout_p > 0:
            raise ValueError("dropout (training=True) is not supported with a PagedKVCache")
        if isinstance(cache, PagedKVCache) and need_weights:
            raise ValueError("need_weights is not supported with a PagedKVCache")
    return {
        "n_new": n_new,
        "lengths_array": lengths_array,
        "starts": starts,
        "L": (L,) * B if batched else None,
    }


def check_positions(mha: AttentionConfig, x: Array, positions: Any, freqs: Array | None) -> None:
    L = int(x.shape[-2])
    if positions is not None and freqs is not None:
        raise ValueError("give positions or freqs, not both")
    if freqs is not None:
        if mha.rope is None:
            raise ValueError("freqs needs a rope layout (rope='half' or 'interleaved')")
        xp = namespace_of(freqs=freqs)
        if not xp.isdtype(freqs.dtype, "complex floating"):
            raise TypeError(f"freqs must be complex (exp(i * angle)), got {freqs.dtype}")
        if freqs.ndim not in (2, 3, 4) or freqs.shape[-2] != L:
            raise ValueError(
                f"freqs must be (L, F), (B, L, F) or (B, 1, L, F) with L={L}, got shape "
                f"{tuple(freqs.shape)}"
            )
        return
    if positions is None:
        return
    if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        return
    if not array_api_compat.is_array_api_obj(positions):
        raise TypeError(
            f"positions must be an int or an integer array (L,) or (B, L), got "
            f"{type(positions).__name__} {positions!r}"
        )
    xp = namespace_of(x=x, positions=positions)
    if not (
        xp.isdtype(positions.dtype, "integral") or xp.isdtype(positions.dtype, "real floating")
    ):
        raise TypeError(f"positions must have an integer dtype, got {positions.dtype}")
    A = mha.rope_position_axes
    if A is not None:
        if positions.ndim not in (2, 3) or tuple(positions.shape[-2:]) != (L, A):
            raise ValueError(
                f"positions must be (L, A) or (B, L, A) with L={L} and A={A} axes (one "
                f"column per axis), got shape {tuple(positions.shape)}"
            )
        return
    if positions.ndim not in (1, 2) or positions.shape[-1] != L:
        raise ValueError(
            f"positions must be an int or an array (L,) or (B, L) with L={L}, got shape "
            f"{tuple(positions.shape)}"
        )


def _check_cascade(
    mha: Any, context: Any, attn_mask: Any, training: bool, need_weights: bool
) -> None:
    """What a :class:`CascadeKVCache` does not take (it attends by prefix and suffix
    calls merged by LSE): a context, a mask, weights, dropout, ALiBi."""
    for what, bad in (
        ("a context (cross-attention)", context is not None),
        ("attn_mask", attn_mask is not None),
        ("need_weights", need_weights),
        ("dropout (training=True)", training and mha.dropout_p > 0),
        ("alibi", getattr(mha, "alibi", False)),
    ):
        if bad:
            raise ValueError(f"{what} is not supported with a CascadeKVCache")
