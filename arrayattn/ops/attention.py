"""Scaled dot-product attention: the public entry points and their backward rules.

One definition (``SEMANTICS.md``) and several implementations behind it
(:mod:`arrayattn.attention`). This module validates the call into an
:class:`~arrayattn.attention.spec.AttentionSpec`, has the registry pick an
implementation (``implementation="auto"`` by default) and, for :func:`arrayattn.vjp`,
returns a pullback that runs the same implementation's backward.
"""

from __future__ import annotations

from typing import Any, Literal, overload

from .._autodiff import Pullback, register_vjp
from .._backend import Array, is_dask, known_shape
from ..attention import composed as _composed
from ..attention import implementations as _implementations  # noqa: F401  (registers them)
from ..attention.block_mask import BlockMask
from ..attention.registry import (
    Implementation,
    auto_choice,
    implementations,
    register_implementation,
    select,
)
from ..attention.spec import AttentionSpec, make_spec

__all__ = [
    "scaled_dot_product_attention",
    "attention_weights",
    "dropout_mask",
    "register_implementation",
    "implementations",
    "auto_choice",
    "Implementation",
]


# The overloads tell type checkers what a call returns: the output alone, or with
# return_lse=True the pair (output, LSE). One function at run time (the last definition).
@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: Literal[False] = False,
    implementation: str = "auto",
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Array: ...
@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: Literal[True],
    implementation: str = "auto",
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> tuple[Array, Array]: ...
@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Array | tuple[Array, Array]: ...
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention with PyTorch's signature and semantics, plus
    FlashAttention's options.

    Shapes: ``query (..., Hq, L, E)``, ``key (..., Hkv, S, E)``, ``value (..., Hkv, S, Ev)``
    -> output ``(..., Hq, L, Ev)`` in the input dtype; leading dims broadcast. With
    ``return_lse=True`` also the natural-log LSE of the masked scores, ``(..., Hq, L)``,
    float32 (float64 for float64 inputs).

    Args:
        query, key, value: real floating arrays of one dtype, library and device.
        attn_mask: bool (``True`` = takes part) or float (added to the scores),
            broadcastable to ``(..., Hq, L, S)``. Combined with ``is_causal`` by AND.
        dropout_p: probability in ``[0, 1)`` of dropping an attention probability; the
            kept ones are scaled by ``1 / (1 - dropout_p)``.
        is_causal: causal mask, aligned by ``causal_align``.
        scale: score scale; default ``1 / sqrt(E)``.
        enable_gqa: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        causal_align: ``"top_left"`` (PyTorch: ``j <= i``) or ``"bottom_right"``
            (FlashAttention >= 2.1: ``j <= i + S - L``, what a KV cache needs).
        window: ``(left, right)`` sliding window around the aligned diagonal, inclusive,
            ``-1`` unbounded (FlashAttention's convention). HF's "W keys including itself"
            is ``(W - 1, 0)``.
        softcap: ``softcap * tanh(scores / softcap)`` before masks (Gemma 2).
        seed: dropout seed; the mask is a pure function of ``(seed, batch, head, i, j)``,
            identical on every backend. ``None`` draws one.
        return_lse: also return the log-sum-exp.
        implementation: ``"auto"`` or a name from :func:`implementations`
            (``"composed"``: whole ``L x S`` score matrices; ``"chunked"``: online
            softmax over key blocks, memory ``O(L x block)``). ``"auto"`` runs the CuPy
            kernel when it takes the call, else the cheapest of ``"composed"``,
            ``"chunked"`` and the NumPy ``"fast"`` path (NumPy arrays, and PyTorch CPU
            tensors through zero-copy NumPy views) by a measured cost model
            (``arrayattn.attention.cost``; docs: Performance, "How auto chooses"), never
            ``"composed"`` when one of its row blocks would exceed
            ``arrayattn.attention.composed.AUTO_CHUNK_BYTES`` (256 MiB).
        q_lengths, kv_lengths: optional integer arrays of the broadcast batch shape
            (``(B,)`` for 4-D inputs; ``()`` for 3-D), same library and device: the
            number of valid queries / keys of each sequence (padding at the end; values
            are clipped to ``[0, L]`` / ``[0, S]``). Keys ``j >= kv_lengths[b]`` are
            masked; query rows ``i >= q_lengths[b]`` are empty (output 0, LSE ``-inf``
            or the sink with ``sinks``, zero gradients). With
            ``causal_align="bottom_right"`` each sequence's
            diagonal is offset by ``kv_lengths[b] - q_lengths[b]`` (FlashAttention's
            varlen semantics); ``"top_left"`` keeps offset 0. No dense mask is built.
        sinks: learnable attention sinks (gpt-oss): one logit per query head, shape
            ``(Hq,)`` or broadcastable to ``(..., Hq)``, floating, same library and
            device. Each joins its head's softmax denominator as an extra logit with no
            value: ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``, so rows may
            sum to less than 1. The LSE includes the sink; a row whose keys are all masked
            gives output 0 and LSE ``sink_h`` (finite). Differentiable: :func:`arrayattn.vjp`
            returns its gradient in a trailing dict, ``pullback(g)[-1]["sinks"]``.
        alibi_slopes: ALiBi slopes, shape ``(Hq,)`` or ``(B, Hq)`` (broadcastable to
            ``(..., Hq)``): adds ``-slope_h * |i + offset - j|`` to the scores after the
            softcap, where ``offset`` is the aligned diagonal of ``causal_align`` (0
            top-left, ``S - L`` bottom-right; per sequence with lengths). This is
            FlashAttention's definition: ``causal_align="bottom_right"`` matches FA's
            ``alibi_slopes`` (for causal calls its outputs; FA's causal LSE differs by a
            per-row constant). No ``L x S`` bias is built on the chunked, fast and fused
            paths. The slopes are constants: no gradient is returned for them.
        block_mask: a :class:`arrayattn.flex.BlockMask` from
            :func:`arrayattn.flex.create_block_mask` for this call's ``(B, Hq, L, S)``
            (FlexAttention's): its ``mask_mod`` is ANDed with every other mask, its empty
            blocks are skipped and its full blocks need no mask test.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's convention,
            on broadcasting int32 index arrays): a shortcut for a block mask (built-ins of
            :mod:`arrayattn.flex` are classified per call from index ranges, any other
            function is evaluated on every block computed; build a block mask once to
            skip empty blocks and reuse it).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied after the
            softcap and ALiBi, before a float mask; a :class:`arrayattn.flex.ScoreMod`
            carries its derivative (required under :func:`arrayattn.vjp`) and
            parameters, whose gradients ``vjp`` returns as
            ``pullback(g)[-1]["score_mod"]``.

    Rows with no key left return 0 (and LSE ``-inf``, or the sink), never NaN.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((2, 8, 16, 64), dtype=np.float32)
        >>> kv = rng.standard_normal((2, 2, 16, 64), dtype=np.float32)
        >>> out, lse = aa.scaled_dot_product_attention(
        ...     q, kv, kv, is_causal=True, enable_gqa=True, return_lse=True)
        >>> out.shape, lse.shape, out.dtype, lse.dtype
        ((2, 8, 16, 64), (2, 8, 16), dtype('float32'), dtype('float32'))

        Sinks (gpt-oss) and ALiBi (BLOOM) with their gradients:

        >>> sinks = np.zeros(8, dtype=np.float32)
        >>> slopes = 2.0 ** -np.arange(1, 9, dtype=np.float32)
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, kv, kv,
        ...     is_causal=True, enable_gqa=True, sinks=sinks, alibi_slopes=slopes)
        >>> dq, dk, dv, keyword_grads = pullback(np.ones_like(out))
        >>> keyword_grads["sinks"].shape
        (8,)
    """
    spec = make_spec(
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
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        lse_wanted=return_lse,
        block_mask=block_mask,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )
    out, lse = select(spec, implementation).forward(spec, query, key, value, attn_mask)
    return (out, lse) if return_lse else out


@register_vjp(scaled_dot_product_attention)
def _sdpa_vjp(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> tuple[Array | tuple[Array, Array], Pullback]:
    spec = make_spec(
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
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        block_mask=block_mask,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )
    if spec.score_mod is not None and not spec.score_mod.differentiable:
        raise TypeError(
            f"score_mod {spec.score_mod!r} has no derivative, so vjp cannot differentiate "
            "through it: wrap it as arrayattn.flex.ScoreMod(fn, grad=d_fn_d_score)"
        )
    impl = select(spec, implementation)
    out, lse = impl.forward(spec, query, key, value, attn_mask)

    def pullback(cotangent: Any) -> tuple[Any, ...]:
        d_out, d_lse = split_cotangent(cotangent, return_lse, spec.out_shape, spec.lse_shape)
        dq, dk, dv, dmask = impl.backward(
            spec, query, key, value, attn_mask, out, lse, d_out, d_lse
        )
        extra: dict[str, Any] = {}
        if spec.sinks is not None:
            # The sinks' gradient needs only row statistics (LSE, dO . O, dLSE), the same
            # on every implementation, so it is computed once here.
            extra["sinks"] = _composed.sinks_gradient(spec, out, lse, d_out, d_lse)
        if spec.score_mod is not None and spec.score_mod.params:
            # Likewise a score_mod's parameters (a bias table): one pass, any path (on
            # Dask arrays a graph of its own, one task per scheduled block pair).
            param_grads = _composed.score_mod_param_grads
            if is_dask(spec.xp):
                from ..attention.dask import score_mod_param_grads as param_grads
            extra["score_mod"] = param_grads(
                spec, query, key, value, attn_mask, out, lse, d_out, d_lse
            )
        if not extra:
            return dq, dk, dv, dmask
        return dq, dk, dv, dmask, extra

    return ((out, lse) if return_lse else out), pullback


def split_cotangent(
    cotangent: Any, return_lse: bool, out_shape: tuple[int, ...], lse_shape: tuple[int, ...]
) -> tuple[Array | None, Array | None]:
    """``(d_out, d_lse)`` from the cotangent given to an attention pullback: the pair
    itself when the forward returned ``(out, lse)`` (``return_lse``), else ``d_out``
    alone; each part that is not ``None`` must have its output's shape."""
    if return_lse:
        if not isinstance(cotangent, (tuple, list)) or len(cotangent) != 2:
            raise TypeError(
                "cotangent must be a pair (d_out, d_lse) when return_lse=True, got "
                f"{type(cotangent).__name__}"
            )
        d_out, d_lse = cotangent
    else:
        d_out, d_lse = cotangent, None
    _check_cotangent("d_out", d_out, out_shape)
    _check_cotangent("d_lse", d_lse, lse_shape)
    return d_out, d_lse


def _check_cotangent(name: str, x: Array | None, shape: tuple[int, ...]) -> None:
    if x is not None and known_shape(name, x) != tuple(shape):
        raise ValueError(f"cotangent {name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def attention_weights(
    query: Array,
    key: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Array:
    """The attention probabilities ``(..., Hq, L, S)`` that
    :func:`scaled_dot_product_attention` with the same arguments multiplies into
    ``value`` (after dropout, when ``dropout_p > 0`` with the same ``seed``), in the
    input dtype. This is what ``need_weights`` / ``output_attentions`` give: it builds the
    whole ``L x S`` matrix, so use it for inspection, not for long sequences.
    ``q_lengths``/``kv_lengths``, ``sinks`` and ``alibi_slopes`` as in
    :func:`scaled_dot_product_attention`: with sinks each row sums to
    ``1 - exp(sink_h - LSE_i)`` (the sink's column is left out, as gpt-oss does), and
    ``vjp`` returns the sinks' gradient in a trailing dict.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> q = np.ones((1, 1, 3, 4)); k = np.ones((1, 1, 5, 4))
        >>> w = aa.attention_weights(q, k, is_causal=True, causal_align="bottom_right")
        >>> w.shape, float(w[0, 0, 0].sum())
        ((1, 1, 3, 5), 1.0)
    """
    # One definition of the weights: the vjp rule's forward (its pullback is dropped).
    weights, _ = _attention_weights_vjp(
        query,
        key,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_align=causal_align,
        window=window,
        softcap=softcap,
        seed=seed,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        block_mask=block_mask,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )
    return weights


def _weights_spec(
    query: Array,
    key: Array,
    attn_mask: Array | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    causal_align: str,
    window: Any,
    softcap: float | None,
    seed: int | None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> AttentionSpec:
    # The value plays no part in the weights; key stands in for it (same S, Ev = E).
    return make_spec(
        query,
        key,
        key,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_align,
        window,
        softcap,
        seed,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        block_mask=block_mask,
        mask_mod=mask_mod,
        score_mod=score_mod,
    )


def _weights_out(spec: AttentionSpec, p: Array) -> Array:
    xp = spec.xp
    shape = spec.out_shape[:-1] + (spec.S,)
    full = spec.lead + (spec.Hq // spec.G, spec.G, spec.L, spec.S)
    return xp.astype(xp.reshape(spec.ungroup_rows(xp.broadcast_to(p, full)), shape), spec.dtype)


@register_vjp(attention_weights)
def _attention_weights_vjp(
    query: Array,
    key: Array,
    attn_mask: Array | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> tuple[Array, Pullback]:
    spec = _weights_spec(
        query,
        key,
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
        block_mask,
        mask_mod,
        score_mod,
    )
    xp = spec.xp
    s, tanh, qg, kg = _composed.masked_scores(spec, query, key, attn_mask)
    p, lse = _composed.softmax_with_lse(spec, s)
    lse_g = xp.expand_dims(lse, axis=-1)
    rows_cols = None
    if spec.dropout_p > 0:
        rows_cols = _composed.index_block(spec, 0, spec.L, 0, spec.S)
        out = _weights_out(spec, _composed.apply_dropout(spec, p, *rows_cols))
    else:
        out = _weights_out(spec, p)

    def pullback(d_weights: Array) -> tuple[Any, ...]:
        _check_cotangent("d_weights", d_weights, tuple(out.shape))
        shape = tuple(out.shape)
        dw = xp.astype(spec.group_rows(d_weights, shape), spec.cdtype)
        if rows_cols is not None:
            dw = _composed.apply_dropout(spec, dw, *rows_cols)
        row = xp.sum(dw * p, axis=-1, keepdims=True)
        ds = p * (dw - row)
        # Garbage in excluded keys (or empty query rows) must not meet ds's zeros.
        qc, kc = _composed.finite_or_zero(spec, qg), _composed.finite_or_zero(spec, kg)
        if spec.score_mod is not None and not spec.score_mod.differentiable:
            raise TypeError(
                f"score_mod {spec.score_mod!r} has no derivative: wrap it as "
                "arrayattn.flex.ScoreMod(fn, grad=d_fn_d_score)"
            )
        grads = _composed.scores_pullback(spec, qc, kc, ds, tanh, attn_mask)
        extra: dict[str, Any] = {}
        if spec.sinks is not None:
            # d sink_h = sum_ij dW_ij * dP_ij/d sink = -sum_i p_sink_i * rowsum(dW * P)_i.
            p_sink = _composed.sink_probability(spec, lse_g)
            extra["sinks"] = _composed.reduce_sinks(spec, -(p_sink * row))
        if spec.score_mod is not None and spec.score_mod.params:
            idx = _composed.flex_indices(spec, *_composed.index_block(spec, 0, spec.L, 0, spec.S))
            extra["score_mod"] = tuple(
                xp.astype(g, prm.dtype, copy=False)
                for g, prm in zip(spec.score_mod.param_grads(ds, *idx), spec.score_mod.params,
                                  strict=True)
            )  # fmt: skip
        return grads + (extra,) if extra else grads

    return out, pullback


def dropout_mask(
    query: Array,
    key: Array,
    dropout_p: float,
    seed: int,
    enable_gqa: bool = False,
) -> Array:
    """The boolean keep-mask ``(..., Hq, L, S)`` that attention with these shapes,
    ``dropout_p`` and ``seed`` applies (``True`` = kept). Identical on every backend.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> q = np.zeros((1, 2, 4, 8), dtype=np.float32)
        >>> aa.dropout_mask(q, q, 0.25, seed=7).shape
        (1, 2, 4, 4)
    """
    if seed is None:
        raise ValueError("seed must be an int for dropout_mask, got None")
    spec = make_spec(
        query, key, key, None, dropout_p, False, None, enable_gqa, "top_left", None, None, seed
    )
    xp = spec.xp
    m = _composed.dropout_mask(spec)
    return xp.reshape(m, spec.out_shape[:-1] + (spec.S,))
