"""``CascadeKVCache``: one shared prefix (a common system prompt) held once, plus a suffix
per row, for decoding a batch of requests that share a prompt (FlashInfer's cascade
attention).

Attention of row ``b`` over its cache is attention over the union of the prefix and its
own suffix (``SEMANTICS.md``, "Broadcast K/V and shared prefixes"), computed as two calls
merged by their LSEs (:func:`arrayattn.merge_attention_states`):

- every row's queries against the prefix, whose K/V have batch 1: the attention paths
  stack the rows into each KV-head group (``AttentionSpec.stack_kv``), so the prefix is
  read once per step for the whole batch, never copied per row;
- each row's queries against its own suffix (a :class:`~arrayattn.nn.KVCache` or a
  :class:`~arrayattn.nn.PagedKVCache`), causal within the suffix (bottom-right).

Suffix tokens sit at positions ``prefix_length + i`` (RoPE continues after the prefix):
:attr:`CascadeKVCache.lengths` is what ``MultiHeadAttention`` reads its positions from.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._backend import Array, device_of, namespace_of
from ..attention.merge import merge_attention_states
from ..ops.attention import scaled_dot_product_attention
from ._shared import SharedState, locked
from .kv_cache import KVCache, check_count, host_lengths
from .paged_kv_cache import PagedKVCache

__all__ = ["CascadeKVCache"]


class _PrefixCache(KVCache):
    """The shared prefix: a :class:`KVCache` of one row that refuses new tokens once any
    row's suffix holds some (the suffixes' positions and attention assume the prefix)."""

    _owner: CascadeKVCache

    def check_append(self, new_lengths: Sequence[int], dtype: Any = None) -> None:
        """As :meth:`KVCache.check_append`; also a ``ValueError`` once suffixes exist."""
        held = self._owner.suffix.lengths
        if int(held.max()) > 0 and max(int(n) for n in new_lengths) > 0:
            raise ValueError(
                f"the shared prefix cannot change once suffixes exist (suffix lengths "
                f"{held.tolist()}); reset() every row's suffix before refilling the prefix"
            )
        super().check_append(new_lengths, dtype)

    def append(
        self, key: Array, value: Array, lengths: Sequence[int] | None = None
    ) -> tuple[Array, Array]:
        """As :meth:`KVCache.append`, checked by :meth:`check_append` first."""
        n = [int(key.shape[-2])] if lengths is None else list(lengths)
        self.check_append(n)
        return super().append(key, value, lengths)


class CascadeKVCache(SharedState):
    """A shared prefix of up to ``prefix_length`` tokens, held once (K/V of batch 1), and
    per-row suffixes of ``batch_size`` rows (a :class:`KVCache` of ``max_suffix_length``
    positions, or a :class:`PagedKVCache` when ``num_pages`` is given).

    Fill the prefix once, e.g. ``layer(prompt, cache=cascade.prefix)`` with the common
    prompt ``(1, P, embed_dim)`` (or :meth:`fill_prefix` with keys/values), then decode
    with ``layer(x, cache=cascade)``: each call appends every row's new tokens to its
    suffix and attends over prefix + suffix. The prefix cannot change while any suffix
    holds tokens; :meth:`reset` empties suffix rows (the prefix stays).

    Args:
        batch_size: rows (sequences) of the suffixes.
        num_kv_heads, head_dim, value_dim: the layer's K/V shape (``value_dim`` defaults
            to ``head_dim``).
        prefix_length: capacity of the shared prefix.
        max_suffix_length: capacity of each row's suffix (contiguous suffixes).
        num_pages, page_size: paged suffixes instead (a pool of ``num_pages`` pages).
        xp, device, dtype: where the buffers live (as :meth:`KVCache.allocate`).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import CascadeKVCache, KVCache
        >>> rng = np.random.default_rng(0)
        >>> cache = CascadeKVCache(batch_size=3, num_kv_heads=2, head_dim=8,
        ...                        prefix_length=32, max_suffix_length=8, xp=np)
        >>> pk, pv = rng.standard_normal((2, 1, 2, 20, 8))    # a 20-token shared prompt
        >>> cache.fill_prefix(pk, pv)
        >>> sk, sv = rng.standard_normal((2, 3, 2, 1, 8))     # one new token per row
        >>> cache.append(sk, sv)
        >>> q = rng.standard_normal((3, 4, 1, 8))             # GQA: 4 query heads
        >>> out = cache.attend(q, causal=True)
        >>> cache.lengths.tolist(), out.shape
        ([21, 21, 21], (3, 4, 1, 8))
        >>> copied = np.concatenate([np.repeat(pk, 3, 0), sk], axis=2)  # prefix per row
        >>> copied_v = np.concatenate([np.repeat(pv, 3, 0), sv], axis=2)
        >>> import arrayattn as aa
        >>> ref = aa.scaled_dot_product_attention(q, copied, copied_v, enable_gqa=True)
        >>> bool(np.abs(out - ref).max() < 1e-12)
        True
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        prefix_length: int,
        max_suffix_length: int | None = None,
        num_pages: int | None = None,
        page_size: int = 16,
        value_dim: int | None = None,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        self._init_lock()  # one lock around the prefix and the suffixes (see _shared.py)
        B = check_count("batch_size", batch_size)
        check_count("prefix_length", prefix_length)
        if (max_suffix_length is None) == (num_pages is None):
            raise ValueError(
                "give exactly one of max_suffix_length (contiguous suffixes) and num_pages "
                f"(paged suffixes); got max_suffix_length={max_suffix_length!r}, "
                f"num_pages={num_pages!r}"
            )
        kw = dict(value_dim=value_dim, xp=xp, device=device, dtype=dtype)
        prefix = _PrefixCache.allocate(1, num_kv_heads, prefix_length, head_dim, **kw)
        assert isinstance(prefix, _PrefixCache)
        prefix._owner = self
        self.prefix: _PrefixCache = prefix
        self.suffix: KVCache | PagedKVCache
        if num_pages is not None:
            self.suffix = PagedKVCache(
                batch_size=B,
                num_pages=num_pages,
                page_size=page_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                **kw,
            )
        else:
            self.suffix = KVCache.allocate(B, num_kv_heads, check_count(
                "max_suffix_length", max_suffix_length), head_dim, **kw)  # fmt: skip
        self.batch_size = B
        self.num_kv_heads = self.prefix.num_kv_heads
        self.head_dim = self.prefix.head_dim
        self.value_dim = self.prefix.value_dim

    # -- state ------------------------------------------------------------------------
    @property
    def prefix_length(self) -> int:
        """Tokens of the shared prefix."""
        return int(self.prefix.lengths[0])

    @property
    def suffix_lengths(self) -> np.ndarray:
        """Tokens of each row's own suffix, NumPy int64 ``(B,)`` (a copy)."""
        return self.suffix.lengths

    @property
    def lengths(self) -> np.ndarray:
        """Tokens each row attends to (prefix + its suffix), NumPy int64 ``(B,)``: the
        position of each row's next token."""
        return self.suffix.lengths + self.prefix_length

    @property
    def dtype(self) -> Any:
        """The buffers' dtype (``None`` until known)."""
        return self.prefix.dtype if self.prefix.dtype is not None else self.suffix.dtype

    @locked
    def reset(self, rows: int | Sequence[int] | None = None) -> None:
        """Empty the suffixes of ``rows`` (default: all); the prefix stays. A
        ``ValueError`` for a row outside ``[0, batch_size)``, before anything changes."""
        todo = range(self.batch_size) if rows is None else rows
        items = [todo] if isinstance(todo, (int, np.integer)) else list(todo)
        for b in items:
            b = check_count("rows", b, minimum=0)
            if b >= self.batch_size:
                raise ValueError(f"rows must be in [0, {self.batch_size}), got {b}")
        self.suffix.reset(items)

    @locked
    def reset_prefix(self) -> None:
        """Empty the prefix (and every suffix, which assumed it)."""
        self.suffix.reset()
        self.prefix.reset()

    # -- writing ----------------------------------------------------------------------
    @locked
    def fill_prefix(self, key: Array, value: Array) -> None:
        """Append ``key (1, Hkv, P, D)`` / ``value (1, Hkv, P, Dv)`` to the shared prefix
        (a ``ValueError``, changing nothing, once suffixes exist or past its capacity)."""
        self.prefix.append(key, value)

    @locked
    def check_append(self, new_lengths: Sequence[int], dtype: Any = None) -> None:
        """Raise, changing nothing, when the suffixes cannot take ``new_lengths[b]``
        tokens of each row ``b`` (a full suffix cache names the row and its capacity)."""
        host_lengths("lengths", new_lengths, self.batch_size, sys.maxsize)
        self.suffix.check_append(new_lengths, dtype)

    @locked
    def append(self, key: Array, value: Array, lengths: Sequence[int] | None = None) -> None:
        """Append ``key (B, Hkv, l, D)`` / ``value`` to the rows' suffixes (row ``b``
        takes its first ``lengths[b]`` tokens, default all ``l``). A rejected append
        changes nothing."""
        n = [int(key.shape[-2])] * self.batch_size if lengths is None else list(lengths)
        if int(key.shape[0]) != self.batch_size:
            raise ValueError(
                f"key has {int(key.shape[0])} rows but the cascade cache has "
                f"{self.batch_size}; expected key of shape ({self.batch_size}, Hkv, l, D)"
            )
        self.check_append(n, key.dtype)
        self.suffix.append(key, value, n)

    @locked
    def _snapshot(self) -> tuple[Any, ...]:
        return self.prefix._snapshot(), self.suffix._snapshot()

    @locked
    def _restore(self, snap: tuple[Any, ...]) -> None:
        self.prefix._restore(snap[0])
        self.suffix._restore(snap[1])

    # -- attention --------------------------------------------------------------------
    def _suffix_kv(self, xp: Any) -> tuple[Array, Array] | None:
        """The suffixes as contiguous ``(B, Hkv, max suffix, D)`` K/V (views for a
        :class:`KVCache`; the pages gathered for a :class:`PagedKVCache`), or ``None``
        when every suffix is empty."""
        held = self.suffix.lengths
        if int(held.max()) == 0:
            return None
        if isinstance(self.suffix, KVCache):
            return self.suffix.filled()
        tables = self.suffix.block_tables
        n = max(len(t) for t in tables)
        pages = np.array([t + [t[0] if t else 0] * (n - len(t)) for t in tables], np.int64)
        return self.suffix._page_block(xp, pages)

    def _window_mask(
        self, xp: Any, query: Array, n: Sequence[int], held: np.ndarray,
        window: tuple[int, int] | None,
    ) -> Array | None:  # fmt: skip
        """Bool ``(B, 1, L, P)``: prefix key ``j`` within ``left`` of each query's position
        ``P + held[b] - n[b] + i`` (``None`` without a left bound: every prefix key is
        before every query, so a right bound never cuts it)."""
        if window is None or window[0] < 0:
            return None
        P, L = self.prefix_length, int(query.shape[2])
        pos = P + held[:, None] - np.asarray(n)[:, None] + np.arange(L)[None, :]  # (B, L)
        keep = np.arange(P)[None, None, :] >= (pos - window[0])[:, :, None]
        return xp.asarray(keep[:, None], device=device_of(query))

    @locked
    def attend(
        self,
        query: Array,
        q_lengths: Sequence[int] | None = None,
        *,
        scale: float | None = None,
        causal: bool = False,
        window: tuple[int, int] | None = None,
        softcap: float | None = None,
        sinks: Array | None = None,
        implementation: str = "auto",
        return_lse: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attention of ``query (B, Hq, L, D)`` over each row's prefix + suffix.

        Query row ``i < q_lengths[b]`` (default all ``L``) of row ``b`` is the suffix
        token at position ``prefix_length + suffix_lengths[b] - q_lengths[b] + i``: it
        sees the whole prefix and (``causal``) its suffix up to itself; rows past
        ``q_lengths[b]`` are padding and return 0 (LSE ``-inf``). ``scale``, ``softcap``
        and ``sinks`` mean what they mean in
        :func:`arrayattn.scaled_dot_product_attention`; query head ``h`` reads KV head
        ``h // (Hq // Hkv)``. ``window = (left, right)`` is around each query's own
        position, as in the per-row cache: the suffix call takes it (bottom-right), the
        prefix call a per-row mask of the prefix keys within ``left`` of the query (the
        rows stay stacked over the one prefix). Returns ``(B, Hq, L, Dv)`` in ``query``'s
        dtype (and the LSE with ``return_lse``)."""
        xp = namespace_of(query=query, sinks=sinks)
        if query.ndim != 4 or int(query.shape[0]) != self.batch_size:
            raise ValueError(
                f"query must be (B, Hq, L, D) with B = {self.batch_size} rows, got shape "
                f"{tuple(query.shape)}"
            )
        L = int(query.shape[2])
        n = host_lengths("q_lengths", (L,) * self.batch_size if q_lengths is None
                         else q_lengths, self.batch_size, L)  # fmt: skip
        held = self.suffix.lengths
        for b, (m, s) in enumerate(zip(n, held.tolist(), strict=True)):
            if m > s:
                raise ValueError(
                    f"q_lengths[{b}] = {m} exceeds row {b}'s suffix of {s} tokens; append "
                    "the new tokens' keys/values before attending"
                )
        outs, lses = [], []
        if self.prefix_length > 0:
            pk, pv = self.prefix.filled()  # (1, Hkv, P, D): read once for all rows
            o, lse = scaled_dot_product_attention(
                query, pk, pv, self._window_mask(xp, query, n, held, window), scale=scale,
                enable_gqa=True, softcap=softcap, return_lse=True,
                implementation=implementation, sinks=sinks,
            )  # fmt: skip
            outs.append(o)
            lses.append(lse)
            sinks = None  # the sinks join one denominator, once
        kv = self._suffix_kv(xp)
        if kv is not None:
            dev = device_of(query)
            kv_len = xp.asarray(held.tolist(), dtype=xp.int64, device=dev)
            q_len = None
            if any(m != L for m in n):
                q_len = xp.asarray(list(n), dtype=xp.int64, device=dev)
            o, lse = scaled_dot_product_attention(
                query, kv[0], kv[1], is_causal=causal, scale=scale, enable_gqa=True,
                causal_align="bottom_right", window=window, softcap=softcap, return_lse=True,
                implementation=implementation, sinks=sinks, kv_lengths=kv_len, q_lengths=q_len,
            )  # fmt: skip
            outs.append(o)
            lses.append(lse)
        if not outs:
            shape = tuple(int(d) for d in query.shape[:3])
            out = xp.zeros(shape + (self.value_dim,), dtype=query.dtype, device=device_of(query))
            lse_e = xp.full(shape, -math.inf, dtype=xp.float64 if query.dtype == xp.float64
                            else xp.float32, device=device_of(query))  # fmt: skip
            return (out, lse_e) if return_lse else out
        out, lse = outs[0], lses[0]
        if len(outs) > 1:
            out, lse = merge_attention_states(outs, lses)
        if any(m != L for m in n):  # padding rows: 0 and -inf, as the per-row cache
            rows = np.arange(L)[None, :] < np.asarray(n)[:, None]  # (B, L)
            ok = xp.asarray(rows.reshape(self.batch_size, 1, L), device=device_of(query))
            out = xp.where(ok[..., None], out, xp.zeros_like(out))
            lse = xp.where(ok, lse, xp.full_like(lse, -math.inf))
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        return (
            f"CascadeKVCache(prefix_length={self.prefix_length}, "
            f"suffix_lengths={self.suffix.lengths.tolist()}, suffix={type(self.suffix).__name__}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"
        )
