"""``PagedKVCache``: keys and values in fixed-size pages shared by all sequences, a block
table per sequence, and attention that reads the pages where they are.

Memory is a pool of ``num_pages`` pages of ``page_size`` tokens, sized by the tokens the
batch holds at once rather than by ``batch x max_length``. A sequence takes pages from the
free list as it grows (in whatever order the list gives them: a sequence's pages need not
be adjacent) and gives them back with :meth:`PagedKVCache.free` when it finishes, so a new
sequence reuses them. Attention (:meth:`PagedKVCache.attend`) is an online-softmax loop
whose key blocks are the pages: each step reads the next pages of every sequence
``b`` from ``block_table[b]`` (``keys_per_step // page_size`` of them, at least one); the
cache is never gathered into one ``(B, S)`` buffer.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from .._backend import Array, device_of, namespace_of, resolve_namespace
from ._capacity import check_buffer_size
from ._paged_kernel import attend_with_kernel, kernel_supports
from ._shared import SharedState, locked
from .kv_cache import check_count, check_new_entries, check_rows, host_lengths

__all__ = ["PagedKVCache"]


class PagedKVCache(SharedState):
    """A paged KV cache for ``batch_size`` sequence slots.

    Pages: keys ``(num_pages, Hkv, page_size, D)``, values ``(num_pages, Hkv, page_size,
    Dv)``. Slot ``b`` (row ``b`` of the module's input) holds one sequence of
    ``lengths[b]`` tokens whose token ``t`` lives at offset ``t % page_size`` of page
    ``block_tables[b][t // page_size]``.

    Args:
        batch_size: sequence slots (rows of the module's input).
        num_pages: pages in the pool; the cache holds at most ``num_pages * page_size``
            tokens over all sequences together.
        page_size: tokens per page.
        num_kv_heads: key/value heads ``Hkv``.
        head_dim: key features ``D``.
        value_dim: value features ``Dv`` (default ``head_dim``).
        xp, device, dtype: where the pages live; ``dtype=None`` creates them at the first
            append in the appended keys' dtype (and, without ``xp``, library and device).

    Threads and processes: every method runs under the cache's re-entrant :attr:`lock`
    (``append``, ``free``, ``attend`` are each atomic; concurrent appends serialise), as
    for :class:`~arrayattn.nn.KVCache`; ``block_tables`` and ``free_pages`` are plain
    lists, to be changed only through the methods while other threads use the cache. It
    pickles (and deep-copies) with its pages, tables and free list.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import PagedKVCache
        >>> cache = PagedKVCache(batch_size=2, num_pages=8, page_size=4, num_kv_heads=1,
        ...                      head_dim=8, xp=np)
        >>> new = np.ones((2, 1, 6, 8), np.float32)
        >>> cache.append(new, new, lengths=[6, 2])       # row 0: 6 tokens, row 1: 2
        >>> cache.lengths.tolist(), cache.block_tables, cache.pages_in_use
        ([6, 2], [[0, 1], [2]], 3)
        >>> cache.free(0)                                 # sequence 0 finished
        >>> cache.pages_in_use, cache.lengths.tolist()
        (1, [0, 2])
    """

    #: Keys of each sequence one step of :meth:`attend` reads (whole pages, at least one):
    #: the block size of its online softmax.
    keys_per_step: int = 128
    #: On CuPy, run :meth:`attend` on the split-KV decode kernels of
    #: ``kernels/decode_attn.cu`` (pages read in place through the block table, the keys
    #: of a sequence split across thread blocks) when they take the call.
    use_kernel: bool = True

    def __init__(
        self,
        *,
        batch_size: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        self._init_lock()
        self.batch_size = check_count("batch_size", batch_size)
        self.num_pages = check_count("num_pages", num_pages)
        self.page_size = check_count("page_size", page_size)
        self.num_kv_heads = check_count("num_kv_heads", num_kv_heads)
        self.head_dim = check_count("head_dim", head_dim)
        self.value_dim = self.head_dim if value_dim is None else check_count("value_dim", value_dim)
        ns = None if xp is None and dtype is None else resolve_namespace(xp)
        # Before the free list (a Python int per page) or any page exists.
        check_buffer_size(self._what(), self._pool_shape(), ns, device, dtype)
        free_list = f"{self._what()} free list"
        check_buffer_size(free_list, (self.num_pages,), np, "cpu", None, itemsize=40)
        self._lengths = np.zeros(self.batch_size, dtype=np.int64)
        self.block_tables: list[list[int]] = [[] for _ in range(self.batch_size)]
        # Pages are taken from the front; a finished sequence's pages go to the back.
        self.free_pages: list[int] = list(range(self.num_pages))
        self.keys: Array | None = None
        self.values: Array | None = None
        self.xp = ns
        self.device = device
        self._dtype = dtype
        if dtype is not None:
            self._materialise()

    def _what(self) -> str:
        return (
            f"paged KV cache (num_pages={self.num_pages}, page_size={self.page_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim})"
        )

    def _pool_shape(self) -> tuple[int, ...]:
        """Keys and values of the pool together: ``(num_pages, Hkv, page_size, D + Dv)``."""
        shape = (self.num_pages, self.num_kv_heads, self.page_size)
        return shape + (self.head_dim + self.value_dim,)

    def _materialise(self) -> None:
        shape = (self.num_pages, self.num_kv_heads, self.page_size)
        xp, dev, dt = self.xp, self.device, self._dtype
        assert xp is not None  # called once the library is known (xp=, dtype= or an append)
        check_buffer_size(self._what(), self._pool_shape(), xp, dev, dt)
        self.keys = xp.zeros(shape + (self.head_dim,), dtype=dt, device=dev)
        self.values = xp.zeros(shape + (self.value_dim,), dtype=dt, device=dev)
        self.device = device_of(self.keys)
        self._dtype = self.keys.dtype  # the library's dtype object (np.float32 -> dtype)

    # -- state ------------------------------------------------------------------------
    @property
    def dtype(self) -> Any:
        """The pages' dtype (``None`` until the first append when created without one)."""
        return self._dtype

    @property
    @locked
    def lengths(self) -> np.ndarray:
        """Tokens held per sequence, a NumPy int64 array ``(B,)`` (a copy)."""
        return self._lengths.copy()

    @property
    @locked
    def pages_in_use(self) -> int:
        """Pages held by sequences (the rest are free)."""
        return self.num_pages - len(self.free_pages)

    @property
    def capacity(self) -> int:
        """Tokens the pool holds over all sequences: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @locked
    def free(self, rows: int | Sequence[int] | None = None) -> None:
        """End the sequences in ``rows`` (default: all): their pages return to the free
        list (for any sequence to reuse) and their slots start empty.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import PagedKVCache
            >>> cache = PagedKVCache(batch_size=2, num_pages=4, page_size=2, num_kv_heads=1,
            ...                      head_dim=2, xp=np)
            >>> cache.append(np.ones((2, 1, 3, 2)), np.ones((2, 1, 3, 2)))
            >>> cache.free(1)
            >>> cache.free_pages, cache.block_tables
            ([2, 3], [[0, 1], []])
        """
        todo = range(self.batch_size) if rows is None else check_rows(rows, self.batch_size)
        for b in todo:  # all checked before any changes (a row named twice frees once)
            self.free_pages.extend(self.block_tables[b])
            self.block_tables[b] = []
            self._lengths[b] = 0

    reset = free

    # -- writing ----------------------------------------------------------------------
    def _pages_needed(self, n: Sequence[int]) -> list[int]:
        P = self.page_size
        return [  # integer ceil: exact at any count (a float ceil rounds past 2**53)
            -(-(int(held) + new) // P) - len(table)
            for held, new, table in zip(self._lengths, n, self.block_tables, strict=True)
        ]

    @locked
    def check_append(self, new_lengths: Sequence[int], dtype: Any = None) -> None:
        """Raise, changing nothing, when the free pages cannot hold ``new_lengths[b]`` more
        tokens of every sequence ``b`` or ``dtype`` differs from the pages' dtype.

        Examples:
            >>> from arrayattn.nn import PagedKVCache
            >>> cache = PagedKVCache(batch_size=2, num_pages=2, page_size=4, num_kv_heads=1,
            ...                      head_dim=2)
            >>> cache.check_append([5, 1])  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: paged KV cache overflow in sequence 1: 0 cached + 1 new tokens need ...
        """
        # Counts past the capacity are reported below, naming the cache.
        n = host_lengths("lengths", new_lengths, self.batch_size, sys.maxsize)
        need = self._pages_needed(n)
        free = len(self.free_pages)
        left = free
        for b, k in enumerate(need):
            if k > left:
                taken = f" once sequences 0..{b - 1} take {free - left}" if free > left else ""
                raise ValueError(
                    f"paged KV cache overflow in sequence {b}: {int(self._lengths[b])} cached "
                    f"+ {n[b]} new tokens need {k} more pages of {self.page_size} tokens, but "
                    f"only {left} of {self.num_pages} pages are free{taken} (pool "
                    f"num_pages={self.num_pages}, {free} free before this batch, which needs "
                    f"{sum(need)}; capacity {self.capacity} tokens over all sequences, "
                    f"{int(self._lengths.sum())} held); nothing was written; free() finished "
                    f"sequences or create a larger cache"
                )
            left -= k
        if dtype is not None and self._dtype is not None and dtype != self._dtype:
            raise TypeError(
                f"the new keys/values have dtype {dtype} but the paged KV cache (capacity "
                f"{self.capacity} tokens in {self.num_pages} pages) holds {self._dtype}; "
                f"create it with dtype={dtype} or dtype=None, which follows the layer's "
                f"parameters"
            )

    @locked
    def append(self, key: Array, value: Array, lengths: Sequence[int] | None = None) -> None:
        """Write the first ``lengths[b]`` tokens of ``key[b] (Hkv, l, D)`` and ``value[b]
        (Hkv, l, Dv)`` (default all ``l``) after sequence ``b``'s cached tokens, taking
        pages from the free list as needed. A rejected append changes nothing (a pool
        that runs out part way through the batch is found before any page is taken), and
        one interrupted part way is undone. Atomic under :attr:`lock`.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import PagedKVCache
            >>> cache = PagedKVCache(batch_size=1, num_pages=4, page_size=2, num_kv_heads=1,
            ...                      head_dim=2)
            >>> cache.append(np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2)))
            >>> cache.lengths.tolist(), cache.block_tables, cache.dtype
            ([3], [[0, 1]], dtype('float64'))
        """
        xp, _, n = check_new_entries(
            key, value, lengths, self.batch_size, self.num_kv_heads, self.head_dim, self.value_dim
        )
        self.check_append(n, key.dtype)
        snap = self._snapshot()
        try:
            if self.keys is None:
                if self.xp is None:
                    self.xp, self.device = xp, device_of(key)
                self._dtype = key.dtype
                self._materialise()
            namespace_of(cache=self.keys, key=key)
            for b, (need, m) in enumerate(zip(self._pages_needed(n), n, strict=True)):
                self.block_tables[b].extend(self.free_pages[:need])
                del self.free_pages[:need]
                self._write_row(xp, b, key[b, ...], value[b, ...], m)
        except BaseException:
            self._restore(snap)
            raise

    def _write_row(self, xp: Any, b: int, key: Array, value: Array, m: int) -> None:
        P, pos, t = self.page_size, int(self._lengths[b]), 0
        while t < m:
            page, off = self.block_tables[b][pos // P], pos % P
            c = min(P - off, m - t)
            self.keys = _put(xp, self.keys, page, off, key[:, t : t + c, :])
            self.values = _put(xp, self.values, page, off, value[:, t : t + c, :])
            pos, t = pos + c, t + c
        self._lengths[b] = pos

    @locked
    def _snapshot(self) -> tuple[Any, ...]:
        return (
            self._lengths.copy(),
            [list(t) for t in self.block_tables],
            list(self.free_pages),
            self.keys,
            self.values,
            self._dtype,
            self.xp,
            self.device,
        )

    @locked
    def _restore(self, snap: tuple[Any, ...]) -> None:
        lengths, tables, free, self.keys, self.values = snap[:5]
        self._dtype, self.xp, self.device = snap[5:]
        self._lengths = lengths.copy()
        # The same list objects, refilled: a caller holding cache.free_pages sees them.
        for table, saved in zip(self.block_tables, tables, strict=True):
            table[:] = saved
        self.free_pages[:] = free

    # -- attention ----------------------------------------------------------------------
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
        attn_mask: Array | None = None,
        sinks: Array | None = None,
        alibi_slopes: Array | None = None,
    ) -> Array:
        """Attention of ``query (B, Hq, L, D)`` over each sequence's cached tokens.

        Query row ``i < q_lengths[b]`` of sequence ``b`` (default all ``L``) is the token
        at position ``lengths[b] - q_lengths[b] + i`` (the newest tokens, bottom-right
        aligned); rows past ``q_lengths[b]`` are padding and return 0. The options mean
        what they mean in :func:`arrayattn.scaled_dot_product_attention` (``window``
        around that diagonal; ``attn_mask`` broadcastable to ``(B, Hq, L, max(lengths))``;
        ``sinks (Hq,)`` join the softmax denominator; ``alibi_slopes`` ``(Hq,)`` or
        ``(B, Hq)``). Query head ``h`` reads KV head ``h // (Hq // Hkv)``. Returns
        ``(B, Hq, L, Dv)`` in ``query``'s dtype. Forward only.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import PagedKVCache
            >>> cache = PagedKVCache(batch_size=1, num_pages=4, page_size=2, num_kv_heads=1,
            ...                      head_dim=4, xp=np)
            >>> kv = np.ones((1, 1, 5, 4))
            >>> cache.append(kv, kv)
            >>> cache.attend(np.ones((1, 2, 1, 4)), causal=True).shape
            (1, 2, 1, 4)
        """
        xp = namespace_of(query=query, attn_mask=attn_mask, sinks=sinks, alibi=alibi_slopes)
        if query.ndim != 4 or int(query.shape[0]) != self.batch_size:
            raise ValueError(
                f"query must be (B={self.batch_size}, Hq, L, D), got {tuple(query.shape)}"
            )
        B, Hq, L, D = (int(d) for d in query.shape)
        Hkv, P = self.num_kv_heads, self.page_size
        if Hq % Hkv or D != self.head_dim:
            raise ValueError(
                f"query must have a multiple of {Hkv} heads and head_dim {self.head_dim}, got "
                f"shape {tuple(query.shape)}"
            )
        nq = host_lengths("q_lengths", (L,) * B if q_lengths is None else q_lengths, B, L)
        kv = self._lengths.tolist()
        for b in range(B):
            if nq[b] > kv[b]:
                raise ValueError(
                    f"sequence {b} has {nq[b]} new queries but holds only {kv[b]} tokens"
                )
        if (
            self.use_kernel
            and array_api_compat.is_cupy_array(query)
            and kernel_supports(str(self._dtype), str(query.dtype), D, self.value_dim, attn_mask)
        ):
            return attend_with_kernel(
                self,
                query,
                nq,
                scale=1.0 / math.sqrt(D) if scale is None else float(scale),
                causal=causal,
                window=window,
                softcap=softcap,
                sinks=sinks,
                alibi_slopes=alibi_slopes,
            )
        G, dev = Hq // Hkv, device_of(query)
        cd = xp.float64 if query.dtype == xp.float64 else xp.float32
        S = max(kv)

        def const(a: Any, dtype: Any, shape: tuple[int, ...]) -> Array:
            return xp.reshape(xp.asarray(np.asarray(a).tolist(), dtype=dtype, device=dev), shape)

        # Grouped layout (B, Hkv, G, L, .): query head h = kv_head * G + g reads kv_head.
        row = np.arange(L)
        qpos_h = np.asarray(kv)[:, None] - np.asarray(nq)[:, None] + row[None, :]
        qpos = const(qpos_h, xp.int64, (B, 1, 1, L, 1))
        qvalid = const(row[None, :] < np.asarray(nq)[:, None], xp.bool, (B, 1, 1, L, 1))
        kvlen = const(kv, xp.int64, (B, 1, 1, 1, 1))
        q = xp.astype(xp.reshape(query, (B, Hkv, G, L, D)), cd)
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        sink_rows = None if sinks is None else _per_head(xp, cd, sinks, Hkv, G)
        slope_rows = None if alibi_slopes is None else _per_head(xp, cd, alibi_slopes, Hkv, G)
        full_mask = None
        if attn_mask is not None:
            full_mask = xp.broadcast_to(attn_mask, (B, Hq, L, S))
        neg_inf = xp.asarray(-xp.inf, dtype=cd, device=dev)
        zero = xp.asarray(0.0, dtype=cd, device=dev)
        m = xp.full((B, Hkv, G, L, 1), -xp.inf, dtype=cd, device=dev)
        l_sum = xp.zeros((B, Hkv, G, L, 1), dtype=cd, device=dev)
        acc = xp.zeros((B, Hkv, G, L, self.value_dim), dtype=cd, device=dev)
        # Each step reads `per` pages of every sequence (about keys_per_step keys).
        per = max(1, self.keys_per_step // P)
        W = per * P
        n_steps = math.ceil(max((math.ceil(n / P) for n in kv), default=0) / per)
        # A sequence with fewer pages reads page 0 in the later steps, fully masked.
        tables = np.zeros((B, n_steps * per), dtype=np.int64)
        for b, t in enumerate(self.block_tables):
            tables[b, : len(t)] = t
        for step in range(n_steps):
            k, v = self._page_block(xp, tables[:, step * per : (step + 1) * per])
            k = xp.expand_dims(xp.astype(k, cd), axis=2)  # (B, Hkv, 1, W, D)
            v = xp.expand_dims(xp.astype(v, cd), axis=2)
            j = const(list(range(step * W, (step + 1) * W)), xp.int64, (1, 1, 1, 1, W))
            filled = j < kvlen  # (B, 1, 1, 1, P): positions past a sequence's length are stale
            allowed = filled & qvalid
            if causal:
                allowed = allowed & (j <= qpos)
            if window is not None:
                left, right = window
                if left >= 0:
                    allowed = allowed & (j >= qpos - left)
                if right >= 0:
                    allowed = allowed & (j <= qpos + right)
            s = xp.matmul(q, xp.matrix_transpose(k)) * scale
            if softcap is not None:
                s = softcap * xp.tanh(s / softcap)
            if slope_rows is not None:
                s = s - slope_rows * xp.astype(xp.abs(qpos - j), cd)
            if full_mask is not None:
                block = _mask_block(xp, full_mask, step * W, W, S, (B, Hkv, G, L, W))
                if block.dtype == xp.bool:
                    allowed = allowed & block
                else:
                    s = s + xp.astype(block, cd)
            s = xp.where(allowed, s, neg_inf)
            v = xp.where(xp.reshape(filled, (B, 1, 1, W, 1)), v, zero)
            m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))
            m_safe = xp.where(m_new == neg_inf, zero, m_new)
            corr = xp.exp(m - m_safe)
            p = xp.exp(s - m_safe)
            l_sum = l_sum * corr + xp.sum(p, axis=-1, keepdims=True)
            acc = acc * corr + xp.matmul(p, v)
            m = m_new
        if sink_rows is not None:
            m_f = xp.maximum(m, sink_rows)
            corr = xp.exp(m - m_f)
            l_sum = l_sum * corr + xp.exp(sink_rows - m_f)
            acc = acc * corr
        ok = l_sum > 0
        out = xp.where(ok, acc / xp.where(ok, l_sum, xp.ones_like(l_sum)), zero)
        return xp.astype(xp.reshape(out, (B, Hq, L, self.value_dim)), query.dtype)

    def _page_block(self, xp: Any, pages: np.ndarray) -> tuple[Array, Array]:
        """Keys ``(B, Hkv, n * P, D)`` and values of the pages ``pages (B, n)``: a view of
        the page itself for one page of one sequence, else a block of ``B * n`` pages
        (never the whole cache)."""
        B, n = (int(d) for d in pages.shape)
        # attend reads pages only after an append, which allocates both pools.
        assert self.keys is not None and self.values is not None
        if B == 1 and n == 1:
            p = int(pages[0, 0])
            return self.keys[p : p + 1, ...], self.values[p : p + 1, ...]
        ids = xp.asarray(pages.reshape(-1).tolist(), dtype=xp.int64, device=self.device)
        out = []
        for pool in (self.keys, self.values):
            block = xp.take(pool, ids, axis=0)  # (B * n, Hkv, P, F)
            if n > 1:
                H, P, F = (int(d) for d in block.shape[1:])
                block = xp.permute_dims(xp.reshape(block, (B, n, H, P, F)), (0, 2, 1, 3, 4))
                block = xp.reshape(block, (B, H, n * P, F))
            out.append(block)
        return out[0], out[1]

    @locked
    def __repr__(self) -> str:
        return (
            f"PagedKVCache(lengths={self._lengths.tolist()}, pages_in_use={self.pages_in_use}"
            f"/{self.num_pages}, page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self._dtype})"
        )


def _per_head(xp: Any, cd: Any, a: Array, Hkv: int, G: int) -> Array:
    """Per-head values ``(Hq,)`` or ``(B, Hq)`` as ``(B or 1, Hkv, G, 1, 1)``, the grouped
    layout of the paged loop."""
    lead = 1 if a.ndim == 1 else int(a.shape[0])
    return xp.reshape(xp.astype(a, cd), (lead, Hkv, G, 1, 1))


def _mask_block(xp: Any, mask: Array, start: int, P: int, S: int, shape: tuple[int, ...]) -> Array:
    """Columns ``[start, start + P)`` of the broadcast mask ``(B, Hq, L, S)``, padded past
    ``S`` (those columns are masked by the lengths anyway), in the grouped ``shape``."""
    stop = min(start + P, S)
    block = mask[..., start:stop]
    if stop - start < P:
        pad_shape = tuple(int(d) for d in block.shape[:-1]) + (P - (stop - start),)
        pad = xp.zeros(pad_shape, dtype=mask.dtype, device=device_of(mask))
        block = xp.concat((block, pad), axis=-1)
    return xp.reshape(block, shape)


def _put(xp: Any, pages: Array, page: int, off: int, new: Array) -> Array:
    """``pages`` with ``pages[page, :, off:off + l] = new`` (in place where writable)."""
    stop = off + int(new.shape[1])
    if array_api_compat.is_writeable_array(pages):
        pages[page, :, off:stop, :] = new
        return pages
    row = pages[page : page + 1, ...]
    row = xp.concat((row[:, :, :off, :], new[None, ...], row[:, :, stop:, :]), axis=2)
    return xp.concat((pages[:page, ...], row, pages[page + 1 :, ...]), axis=0)
