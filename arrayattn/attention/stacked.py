"""Broadcast K/V read once: a call whose key and value have batch dims 1 against queries
with ``B`` rows (``AttentionSpec.stack_kv``) run as one call of a single batch row.

The query heads of all ``B`` rows that read one KV head are stacked into that head's
group, in the order ``(KV head, row, query head of the group)``: the call becomes a GQA
call with ``B`` times the group size, over the same K/V, which every path already reads
once per group (one product per tile covers all rows). Per-row and per-head inputs
follow the rows: the mask (indexed per stacked row; a mask without batch and head dims
is reused as it is), sinks and ALiBi slopes, and dropout, which hashes each stacked
head's original ``(row, head)`` (``AttentionSpec.original_ids``), so the result is
bit-identical in its dropout mask to the per-row call. Gradients of K/V are then the GQA
sums over the group, i.e. over every row that read them.

The fast, chunked and composed paths call :func:`forward`/:func:`backward` first thing
when ``spec.stack_kv`` is set; K and V are only reshaped (views), never copied; the
queries, output and cotangents are permuted (copies of the size of the output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._backend import Array, Namespace, sum_to_shape
from .spec import AttentionSpec, _per_head_g

__all__ = ["stacked_spec", "forward", "backward"]

Forward = Callable[[AttentionSpec, Array, Array, Array, "Array | None"], tuple[Array, Array]]
Backward = Callable[..., tuple[Any, ...]]


def _split(spec: AttentionSpec) -> tuple[int, int, int]:
    """``(rows, KV heads, query heads per KV head)`` of the original call."""
    hk = spec.Hkv if spec.Hkv > 1 else 1
    return spec.batch_size, hk, spec.Hq // hk


def _stack(spec: AttentionSpec, x: Array, tail: tuple[int, ...]) -> Array:
    """``(*lead, Hq, *tail)`` -> ``(1, Hk * B * g, *tail)``, heads ordered (KV head, row,
    head of the group)."""
    xp = spec.xp
    b, hk, g = _split(spec)
    x = xp.reshape(x, (b, hk, g) + tail)
    x = xp.permute_dims(x, (1, 0, 2) + tuple(range(3, 3 + len(tail))))
    return xp.reshape(x, (1, hk * b * g) + tail)


def _unstack(spec: AttentionSpec, x: Array, tail: tuple[int, ...]) -> Array:
    """The inverse of :func:`_stack`: ``(*lead, Hq, *tail)``."""
    xp = spec.xp
    b, hk, g = _split(spec)
    x = xp.reshape(x, (hk, b, g) + tail)
    x = xp.permute_dims(x, (1, 0, 2) + tuple(range(3, 3 + len(tail))))
    return xp.reshape(x, spec.lead + (spec.Hq,) + tail)


def _padded(spec: AttentionSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    nd = len(spec.lead) + 3
    return (1,) * (nd - len(shape)) + tuple(shape)


def _mask_reused(spec: AttentionSpec) -> bool:
    """True when the mask has no batch and head dims (one ``(L, S)`` pattern for every
    row): the stacked call uses it as it is, without a copy."""
    assert spec.mask_shape is not None
    return all(d == 1 for d in _padded(spec, spec.mask_shape)[:-2])


def _stack_mask(spec: AttentionSpec, attn_mask: Array) -> Array:
    xp = spec.xp
    assert spec.mask_shape is not None
    padded = _padded(spec, spec.mask_shape)
    if _mask_reused(spec):
        return xp.reshape(attn_mask, (1, 1) + padded[-2:])
    full = xp.broadcast_to(xp.reshape(attn_mask, padded), spec.lead + (spec.Hq, spec.L, spec.S))
    return _stack(spec, full, (spec.L, spec.S))


def _stack_per_head(spec: AttentionSpec, xp: Namespace, x: Array | None) -> Array | None:
    """Sinks / ALiBi slopes (broadcastable to ``(*lead, Hq)``) as ``(Hq',)``."""
    if x is None:
        return None
    shape = tuple(x.shape)
    full = xp.broadcast_to(
        xp.reshape(x, (1,) * (len(spec.lead) + 1 - len(shape)) + shape), spec.lead + (spec.Hq,)
    )
    return xp.reshape(_stack(spec, full, ()), (-1,))


def stacked_spec(spec: AttentionSpec) -> AttentionSpec:
    """The single-row GQA call that ``spec`` (``stack_kv``) is run as.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((16, 32, 1, 8), np.float32); kv = np.ones((1, 8, 64, 8), np.float32)
        >>> spec = make_spec(q, kv, kv, None, 0.0, False, None, True, "top_left", None,
        ...                  None, None)
        >>> s = stacked_spec(spec)
        >>> spec.stack_kv, s.lead, s.Hq, s.Hkv, s.G, s.stacked_from
        (True, (1,), 512, 8, 64, (16, 4))
    """
    assert spec.stack_kv and spec.batch_ids is None
    xp = spec.xp
    b, hk, g = _split(spec)
    hq = hk * b * g
    k_heads = _padded(spec, spec.k_shape)[-3]
    v_heads = _padded(spec, spec.v_shape)[-3]
    mask_shape = None
    if spec.mask_shape is not None:
        padded = _padded(spec, spec.mask_shape)
        mask_shape = (1, 1) + padded[-2:] if _mask_reused(spec) else (1, hq, spec.L, spec.S)
    sinks = _stack_per_head(spec, xp, spec.sinks)
    alibi = _stack_per_head(spec, xp, spec.alibi_slopes)
    G = hq // spec.Hkv
    return dataclasses.replace(
        spec,
        q_shape=(1, hq, spec.L, spec.E),
        k_shape=(1, k_heads, spec.S, spec.E),
        v_shape=(1, v_heads, spec.S, spec.Ev),
        mask_shape=mask_shape,
        lead=(1,),
        Hq=hq,
        G=G,
        out_ndim=4,
        sinks=sinks,
        alibi_slopes=alibi,
        sinks_g=_per_head_g(xp, "sinks", sinks, (1,), hq, G, spec.cdtype),
        alibi_g=_per_head_g(xp, "alibi_slopes", alibi, (1,), hq, G, spec.cdtype),
        stack_kv=False,
        stacked_from=(b, g),
    )


def _operands(
    spec: AttentionSpec,
    stacked: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
) -> tuple[Array, Array, Array, Array | None]:
    xp = spec.xp
    q = _stack(spec, xp.reshape(query, spec.lead + (spec.Hq, spec.L, spec.E)), (spec.L, spec.E))
    k = xp.reshape(key, stacked.k_shape)  # a view: K/V are read once, never copied
    v = xp.reshape(value, stacked.v_shape)
    m = None if attn_mask is None else _stack_mask(spec, attn_mask)
    return q, k, v, m


def forward(
    impl: Forward,
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
) -> tuple[Array, Array]:
    """``impl``'s ``(out, lse)`` of the ``stack_kv`` call ``spec``, run as its stacked
    single-row call and returned in the call's own layout.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((4, 8, 2, 16))
        >>> kv = rng.standard_normal((1, 2, 32, 16))
        >>> out = aa.scaled_dot_product_attention(q, kv, kv, enable_gqa=True,
        ...                                       implementation="fast")
        >>> kv4 = np.repeat(kv, 4, axis=0)  # the same call with K/V copied per row
        >>> ref = aa.scaled_dot_product_attention(q, kv4, kv4, enable_gqa=True)
        >>> bool(np.abs(out - ref).max() < 1e-12)
        True
    """
    stacked = stacked_spec(spec)
    out, lse = impl(stacked, *_operands(spec, stacked, query, key, value, attn_mask))
    xp = spec.xp
    out = xp.reshape(_unstack(spec, out, (spec.L, spec.Ev)), spec.out_shape)
    lse = xp.reshape(_unstack(spec, lse, (spec.L,)), spec.lse_shape)
    return out, lse


def backward(
    impl: Backward,
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
) -> tuple[Any, ...]:
    """``impl``'s ``(d_query, d_key, d_value, d_mask)`` of the ``stack_kv`` call
    ``spec`` through its stacked call: ``d_key``/``d_value`` are the sums over every row
    (the GQA sums of the stacked groups), ``d_mask`` is summed back to the mask's shape."""
    xp = spec.xp
    stacked = stacked_spec(spec)
    full_out = spec.lead + (spec.Hq, spec.L, spec.Ev)
    full_lse = spec.lead + (spec.Hq, spec.L)

    def rows(x: Array | None, full: tuple[int, ...]) -> Array | None:
        return None if x is None else _stack(spec, xp.reshape(x, full), full[len(spec.lead) + 1 :])

    dq, dk, dv, dmask = impl(
        stacked,
        *_operands(spec, stacked, query, key, value, attn_mask),
        rows(out, full_out),
        rows(lse, full_lse),
        rows(d_out, full_out),
        rows(d_lse, full_lse),
    )
    dq = xp.reshape(_unstack(spec, dq, (spec.L, spec.E)), spec.q_shape)
    dk = xp.reshape(dk, spec.k_shape)
    dv = xp.reshape(dv, spec.v_shape)
    if dmask is not None:
        assert spec.mask_shape is not None
        if not _mask_reused(spec):
            dmask = sum_to_shape(
                xp, _unstack(spec, dmask, (spec.L, spec.S)), _padded(spec, spec.mask_shape)
            )
        dmask = xp.reshape(dmask, spec.mask_shape)
    return dq, dk, dv, dmask
