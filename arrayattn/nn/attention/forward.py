"""``MultiHeadAttention``'s forward pass: projections, heads, qk-norm, RoPE, attention
(with or without a cache), merged heads, output projection; each op's pullback kept for
the backward when asked."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ..._autodiff import vjp
from ..._backend import Array, device_of, lse_dtype, namespace_of
from ...ops.attention import attention_weights, scaled_dot_product_attention
from ...ops.heads import merge_heads, split_heads
from ...ops.norms import layer_norm, rms_norm
from ...ops.rope import apply_rope
from .._padding import _roll_rows
from ..cascade_cache import CascadeKVCache
from ..kv_cache import KVCache
from ..linear import linear
from ..paged_kv_cache import PagedKVCache
from .cache import cached_attention
from .call import check_call
from .config import AttentionConfig
from .params import check_params
from .rope import layer_rope_frequencies

__all__ = ["run", "projection", "norm", "rolled_positions", "flex_options"]


def flex_options(block_mask: Any, mask_mod: Any, score_mod: Any) -> dict[str, Any]:
    """The structured options of a call (:mod:`arrayattn.flex`) that were given, as the
    keywords of :func:`arrayattn.scaled_dot_product_attention`.

    Examples:
        >>> from arrayattn.flex import causal_mask
        >>> sorted(flex_options(None, causal_mask, None))
        ['mask_mod']
    """
    given = {"block_mask": block_mask, "mask_mod": mask_mod, "score_mod": score_mod}
    return {k: v for k, v in given.items() if v is not None}


def run(
    cfg: AttentionConfig,
    params: Mapping[str, Array],
    x: Array,
    context: Array | None,
    value: Array | None,
    attn_mask: Array | None,
    positions: Any,
    freqs: Array | None,
    lengths: Any,
    padding_side: str,
    cache: KVCache | PagedKVCache | CascadeKVCache | None,
    training: bool,
    seed: int | None,
    need_weights: bool,
    pullbacks: dict[str, Callable[..., tuple[Any, ...]]] | None,
    flex: dict[str, Any] | None = None,
) -> tuple[Array, dict[str, Any]]:
    """The forward pass: ``(out, info)``; ``pullbacks`` (a dict) collects each op's
    pullback for :func:`~.backward.backward`; ``flex``: the call's ``block_mask`` /
    ``mask_mod`` / ``score_mod`` (:func:`flex_options`), passed to the attention. With
    a cache, the whole call holds the cache's lock: the lengths it checks and takes
    positions from are the ones it appends at, whatever other threads do with the
    cache."""
    guard: AbstractContextManager[Any]
    guard = cache.lock if isinstance(cache, (KVCache, PagedKVCache)) else nullcontext()
    with guard:
        return _run(
            cfg,
            params,
            x,
            context,
            value,
            attn_mask,
            positions,
            freqs,
            lengths,
            padding_side,
            cache,
            training,
            seed,
            need_weights,
            pullbacks,
            flex or {},
        )


def _run(
    cfg: AttentionConfig,
    params: Mapping[str, Array],
    x: Array,
    context: Array | None,
    value: Array | None,
    attn_mask: Array | None,
    positions: Any,
    freqs: Array | None,
    lengths: Any,
    padding_side: str,
    cache: KVCache | PagedKVCache | CascadeKVCache | None,
    training: bool,
    seed: int | None,
    need_weights: bool,
    pullbacks: dict[str, Callable[..., tuple[Any, ...]]] | None,
    flex: dict[str, Any],
) -> tuple[Array, dict[str, Any]]:
    # Everything is validated before the cache changes: a rejected call changes nothing.
    check_params(cfg, params)
    xp = namespace_of(x=x, context=context, value=value, attn_mask=attn_mask, freqs=freqs)
    namespace_of(x=x, **{f"params[{k!r}]": v for k, v in params.items()})
    plan = check_call(
        cfg,
        x,
        context,
        value,
        attn_mask,
        positions,
        freqs,
        lengths,
        padding_side,
        cache,
        training,
        seed,
        need_weights,
        flex,
    )
    p = params
    n_new, left = plan["n_new"], padding_side == "left"

    def call(name: str, op: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if pullbacks is None:
            return op(*args, **kw)
        out, pb = vjp(op, *args, **kw)
        pullbacks[name] = pb
        return out

    def roll(name: str, a: Array, shifts: tuple[int, ...]) -> Array:
        if pullbacks is not None:
            n = int(a.shape[-2])
            back = tuple((n - s) % n if n else 0 for s in shifts)
            pullbacks[name] = lambda dy: (_roll_rows(dy, back),)
        return _roll_rows(a, shifts)

    if left:  # move each row's real tokens to the front (right padding)
        shifts = tuple(L_ - n for L_, n in zip(plan["L"], n_new, strict=True))
        x = roll("roll_x", x, shifts)
        positions, freqs = rolled_positions(xp, x, positions, freqs, shifts, cfg)
    Hq, Hkv = cfg.num_heads, cfg.kv_heads
    fq, fk, fv = cfg._widths()
    cross = context is not None
    reuse = cross and cache is not None and int(cache.lengths.max()) > 0
    # Projections.
    if cfg.packed_qkv and not cross:
        qkv = call("qkv", linear, x, p["qkv_proj.weight"], p.get("qkv_proj.bias"))
        q, k, v = qkv[..., :fq], qkv[..., fq : fq + fk], qkv[..., fq + fk :]
    else:
        w, b = projection(cfg, p, "q", (0, fq))
        q = call("q", linear, x, w, b)
        if not reuse:
            src_k = context if cross else x
            src_v = value if value is not None else src_k
            w, b = projection(cfg, p, "k", (fq, fq + fk))
            k = call("k", linear, src_k, w, b)
            w, b = projection(cfg, p, "v", (fq + fk, fq + fk + fv))
            v = call("v", linear, src_v, w, b)
    full_norm = cfg.qk_norm is not None and cfg.qk_norm_scope == "full"
    if full_norm:
        q = norm(cfg, call, "q", q, p)
    qh = call("q_heads", split_heads, q, Hq)
    if not full_norm:
        qh = norm(cfg, call, "q", qh, p)
    rot = None
    if cfg.rope is not None:
        rot = layer_rope_frequencies(cfg, xp, x, positions, freqs, plan["starts"])
        qh = call("q_rope", apply_rope, qh, rot, layout=cfg.rope)
    if reuse:
        # A filled cross-attention cache already holds the context's keys and values
        # (check_call refuses a PagedKVCache with context).
        assert isinstance(cache, KVCache)
        kh, vh = cache.filled()
    else:
        if full_norm:
            k = norm(cfg, call, "k", k, p)
        kh = call("k_heads", split_heads, k, Hkv)
        if not full_norm:
            kh = norm(cfg, call, "k", kh, p)
        vh = call("v_heads", split_heads, v, Hkv)
        if rot is not None:
            kh = call("k_rope", apply_rope, kh, rot, layout=cfg.rope)
    use_dropout = training and cfg.dropout_p > 0
    opts: dict[str, Any] = dict(
        causal_align="bottom_right",
        window=cfg.window,
        softcap=cfg.softcap,
        seed=seed if use_dropout else None,
    )
    opts.update(flex)  # (check_call refused them with a cache and left padding)
    if cfg.sinks:
        opts["sinks"] = p["sinks"]
    if cfg.alibi:
        opts["alibi_slopes"] = xp.asarray(
            cfg.alibi_slopes(), dtype=lse_dtype(xp, x.dtype), device=device_of(x)
        )
    sdpa_args = (
        attn_mask,
        cfg.dropout_p if use_dropout else 0.0,
        cfg.causal,
        cfg.scale,
        True,
    )
    weights = None
    if cache is not None and not reuse:
        o, kh_all, lens = cached_attention(
            cfg, xp, cache, qh, kh, vh, n_new, cross, sdpa_args, opts
        )
        if need_weights:
            # The ignore: mypy (2.4) maps a *tuple followed by two **dicts onto the tuple's
            # parameters again ("multiple values"); opts and lens hold other keywords.
            weights = attention_weights(qh, kh_all, *sdpa_args, **opts, **lens)  # type: ignore[misc]
    else:
        lens = {}
        if plan["lengths_array"] is not None:
            lens = {"q_lengths": plan["lengths_array"], "kv_lengths": plan["lengths_array"]}
        o = call(
            "attention",
            scaled_dot_product_attention,
            qh,
            kh,
            vh,
            *sdpa_args,
            **opts,
            implementation=cfg.implementation,
            **lens,
        )
        if need_weights:
            weights = attention_weights(qh, kh, *sdpa_args, **opts, **lens)  # type: ignore[misc]
    om = call("merge", merge_heads, o)
    out = call("o_proj", linear, om, p["o_proj.weight"], p.get("o_proj.bias"))
    if left:
        back = tuple(int(n) for n in n_new)
        out = roll("roll_out", out, back)
        if weights is not None:
            weights = _roll_rows(weights, back, axis=-2)
            if cache is None:  # key columns are x's rows, rolled too
                weights = _roll_rows(weights, back, axis=-1)
    info = {
        "xp": xp,
        "cross": cross,
        "separate_value": value is not None,
        "left": left,
        "weights": weights,
        "float_mask": attn_mask is not None and attn_mask.dtype != xp.bool,
        "score_params": _score_params(flex.get("score_mod")),
    }
    return out, info


def _score_params(score_mod: Any) -> int:
    """How many parameters (a bias table) the call's score_mod has."""
    return len(getattr(score_mod, "params", ()))


def projection(
    cfg: AttentionConfig, p: Mapping[str, Array], which: str, rows: tuple[int, int]
) -> tuple[Array, Array | None]:
    if not cfg.packed_qkv:
        return p[f"{which}_proj.weight"], p.get(f"{which}_proj.bias")
    r0, r1 = rows
    b = p.get("qkv_proj.bias")
    return p["qkv_proj.weight"][r0:r1, :], None if b is None else b[r0:r1]


def norm(
    cfg: AttentionConfig, call: Callable[..., Any], which: str, h: Array, p: Mapping[str, Array]
) -> Array:
    name = f"{which}_norm"
    if cfg.qk_norm == "rms":
        return call(name, rms_norm, h, p[f"{name}.weight"], cfg.norm_eps)
    if cfg.qk_norm == "layer":
        return call(name, layer_norm, h, p[f"{name}.weight"], p[f"{name}.bias"], cfg.norm_eps)
    return h


def rolled_positions(
    xp: Any,
    x: Array,
    positions: Any,
    freqs: Array | None,
    shifts: tuple[int, ...],
    cfg: AttentionConfig,
) -> tuple[Any, Array | None]:
    """Explicit positions / frequencies given for left-padded rows, rotated with them."""
    B, L = int(x.shape[0]), int(x.shape[-2])
    if positions is not None and not isinstance(positions, numbers.Integral):
        cols = () if cfg.rope_position_axes is None else (cfg.rope_position_axes,)
        positions = xp.broadcast_to(positions, (B, L) + cols)
        positions = _roll_rows(positions, shifts, axis=1)
    if freqs is not None:
        if freqs.ndim == 3:  # (B, L, F) -> (B, 1, L, F)
            freqs = xp.expand_dims(freqs, axis=1)
        freqs = _roll_rows(xp.broadcast_to(freqs, (B, 1, L, int(freqs.shape[-1]))), shifts)
    return positions, freqs
