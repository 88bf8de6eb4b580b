"""``MultiHeadAttention`` with a KV cache: the caches a layer makes, and attention over
a cache (new keys/values appended at each row's own position, restored on failure)."""

from __future__ import annotations

from typing import Any

from ..._backend import Array, device_of
from ...attention.spec import make_spec
from ...ops.attention import scaled_dot_product_attention
from ..cascade_cache import CascadeKVCache
from ..kv_cache import KVCache
from ..paged_kv_cache import PagedKVCache
from . import decode
from .config import AttentionConfig

__all__ = ["new_cache", "new_paged_cache", "cached_attention", "SdpaArgs"]

#: The positional options of an attention call after q, k, v:
#: ``(attn_mask, dropout_p, is_causal, scale, enable_gqa)``.
SdpaArgs = tuple[Array | None, float, bool, float | None, bool]


def new_cache(
    cfg: AttentionConfig,
    batch_size: int,
    max_length: int,
    *,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> KVCache:
    """An empty :class:`KVCache` for the layer."""
    return KVCache.allocate(
        batch_size,
        cfg.kv_heads,
        max_length,
        cfg.dim_per_head,
        value_dim=cfg.value_dim_per_head,
        xp=xp,
        device=device,
        dtype=dtype,
    )


def new_paged_cache(
    cfg: AttentionConfig,
    batch_size: int,
    num_pages: int,
    page_size: int = 16,
    *,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> PagedKVCache:
    """An empty :class:`PagedKVCache` for the layer."""
    return PagedKVCache(
        batch_size=batch_size,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.dim_per_head,
        value_dim=cfg.value_dim_per_head,
        xp=xp,
        device=device,
        dtype=dtype,
    )


def cached_attention(
    cfg: AttentionConfig,
    xp: Any,
    cache: KVCache | PagedKVCache | CascadeKVCache,
    qh: Array,
    kh: Array,
    vh: Array,
    n_new: tuple[int, ...],
    cross: bool,
    sdpa_args: SdpaArgs,
    opts: dict[str, Any],
) -> tuple[Array, Array | None, dict[str, Array]]:
    """Append the new keys/values to ``cache`` and attend over it, all under the cache's
    lock (the caller, a module call, holds it already); the cache is restored when
    anything raises."""
    with cache.lock:
        return _cached_attention(cfg, xp, cache, qh, kh, vh, n_new, cross, sdpa_args, opts)


def _cached_attention(
    cfg: AttentionConfig,
    xp: Any,
    cache: KVCache | PagedKVCache | CascadeKVCache,
    qh: Array,
    kh: Array,
    vh: Array,
    n_new: tuple[int, ...],
    cross: bool,
    sdpa_args: SdpaArgs,
    opts: dict[str, Any],
) -> tuple[Array, Array | None, dict[str, Array]]:
    L = int(qh.shape[-2])
    B = int(qh.shape[0])
    if cross:  # the context's keys/values fill the cache once; every query sees them
        n_new = (int(kh.shape[-2]),) * B
    starts = cache.lengths.tolist()
    totals = [s + n for s, n in zip(starts, n_new, strict=True)]
    S = max(totals)
    full_q = cross or all(n == L for n in n_new)
    full_kv = all(t == S for t in totals)
    # Check the attention call on views of the final shapes before writing anything.
    kk = xp.broadcast_to(kh[..., :1, :], (B, int(kh.shape[1]), S, int(kh.shape[3])))
    vv = xp.broadcast_to(vh[..., :1, :], (B, int(vh.shape[1]), S, int(vh.shape[3])))
    spec = make_spec(
        qh,
        kk,
        vv,
        *sdpa_args,
        opts["causal_align"],
        opts["window"],
        opts["softcap"],
        opts["seed"],
        **{k: opts[k] for k in ("sinks", "alibi_slopes") if k in opts},
    )
    snap = cache._snapshot()
    try:
        if isinstance(cache, CascadeKVCache):  # shared prefix once + each row's suffix
            cache.append(kh, vh, n_new)
            _, _, _, scale, _ = sdpa_args
            o = cache.attend(
                qh,
                n_new,
                scale=scale,
                causal=cfg.causal,
                window=cfg.window,
                softcap=cfg.softcap,
                sinks=opts.get("sinks"),
                implementation=cfg.implementation,
            )
            return o, None, {}
        if isinstance(cache, PagedKVCache):
            cache.append(kh, vh, n_new)
            attention_mask, _, _, scale, _ = sdpa_args
            o = cache.attend(
                qh,
                n_new,
                scale=scale,
                causal=cfg.causal,
                window=cfg.window,
                softcap=cfg.softcap,
                attn_mask=attention_mask,
                sinks=opts.get("sinks"),
                alibi_slopes=opts.get("alibi_slopes"),
            )
            return o, None, {}
        keys, values = cache.append(kh, vh, n_new)
        lens: dict[str, Array] = {}
        if not full_kv:
            lens["kv_lengths"] = cache.kv_lengths(xp)
        if not full_q:
            lens["q_lengths"] = xp.asarray(list(n_new), dtype=xp.int64, device=device_of(qh))
            lens.setdefault("kv_lengths", cache.kv_lengths(xp))
        # The ignore: mypy (2.4) maps a *tuple followed by two **dicts onto the tuple's
        # parameters again (so no overload matches); opts and lens hold other keywords.
        o = None
        if not cross and decode.takes(spec, cfg.implementation, n_new):
            o = decode.decode_attention(spec, qh, keys, values, cache.lengths)
        if o is None:
            o = scaled_dot_product_attention(  # type: ignore[call-overload]
                qh, keys, values, *sdpa_args, **opts, implementation=cfg.implementation, **lens
            )
        return o, keys, lens
    except BaseException:
        cache._restore(snap)
        raise
