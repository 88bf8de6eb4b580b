"""Attention over packed variable-length batches (FlashAttention's ``varlen`` API).

Sequences of different lengths are packed one after another along the token axis, and
``cu_seqlens`` (cumulative lengths, starting at 0) says where each one starts. Each query
sequence attends only to its own key sequence.

How: the packed tokens are gathered into a padded batch ``(n, H, max_seqlen, E)`` and
run through :func:`~arrayattn.ops.attention.scaled_dot_product_attention` with per-sequence
``q_lengths``/``kv_lengths``, then gathered back. So every implementation (composed,
chunked, fast paths) serves varlen calls, no ``total x total`` mask is ever built, and
dropout is by construction the padded call's: batch index = sequence index, row and
column = positions within the sequence. The padded batch costs ``n * max_seqlen`` rows,
so very unequal lengths waste work on padding (which is masked out, never wrong).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from .._autodiff import Pullback, register_vjp, vjp
from .._backend import (
    Array,
    Namespace,
    device_of,
    is_lazy,
    lse_dtype,
    namespace_of,
    require_arrays,
)
from ..attention.fits import require_memory
from ..attention.spec import make_spec
from .attention import implementations, scaled_dot_product_attention, split_cotangent

__all__ = ["varlen_attention"]


@dataclass(frozen=True)
class _Packing:
    """Gather indices between packed tokens and one padded batch of ``n`` sequences."""

    n: int
    max_len: int
    total: int
    lengths: Array  # (n,) int
    pad_index: Array  # (n * max_len,) packed token feeding each padded slot (clipped)
    pad_valid: Array  # (n, 1, max_len, 1) bool: padded slot holds a real token
    unpack_index: Array  # (total,) padded slot (flattened b * max_len + i) of each token

    @property
    def degenerate(self) -> bool:
        return self.n == 0 or self.max_len == 0 or self.total == 0


def _packing(xp: Namespace, cu: Array, max_len: int, total: int) -> _Packing:
    dev = device_of(cu)
    n = int(cu.shape[0]) - 1
    idt = _index_dtype(xp, cu, n, max_len, total)
    cu = xp.astype(cu, idt, copy=False)
    starts = cu[:-1]
    lengths = cu[1:] - starts
    if n == 0 or max_len == 0 or total == 0:
        empty = xp.zeros((0,), dtype=idt, device=dev)
        return _Packing(n, max_len, total, lengths, empty, empty, empty)
    pos = xp.reshape(xp.arange(max_len, dtype=idt, device=dev), (1, max_len))
    zero = xp.asarray(0, dtype=idt, device=dev)
    last = xp.maximum(lengths - 1, zero)
    slot = xp.reshape(starts, (n, 1)) + xp.minimum(pos, xp.reshape(last, (n, 1)))
    slot = xp.minimum(xp.maximum(slot, zero), xp.asarray(total - 1, dtype=idt, device=dev))
    valid = pos < xp.reshape(lengths, (n, 1))
    tokens = xp.arange(total, dtype=idt, device=dev)
    seq = xp.searchsorted(cu, tokens, side="right") - 1
    seq = xp.astype(seq, idt)
    seq = xp.minimum(xp.maximum(seq, zero), xp.asarray(n - 1, dtype=idt, device=dev))
    within = tokens - xp.take(starts, seq, axis=0)
    within = xp.minimum(xp.maximum(within, zero), xp.asarray(max_len - 1, dtype=idt, device=dev))
    return _Packing(
        n,
        max_len,
        total,
        lengths,
        xp.reshape(slot, (n * max_len,)),
        xp.reshape(valid, (n, 1, max_len, 1)),
        seq * max_len + within,
    )


def _pad(xp: Namespace, x: Array, pk: _Packing, valid: bool = False) -> Array:
    """Packed ``(H, total, D)`` -> padded ``(n, H, max_len, D)`` (zeros in the padding
    when ``valid``; otherwise copies of a real token, masked out by the lengths)."""
    h, d = int(x.shape[0]), int(x.shape[-1])
    y = xp.take(x, pk.pad_index, axis=1)
    y = xp.permute_dims(xp.reshape(y, (h, pk.n, pk.max_len, d)), (1, 0, 2, 3))
    if valid:
        y = xp.where(pk.pad_valid, y, xp.zeros((), dtype=y.dtype, device=device_of(y)))
    return y


def _unpad(xp: Namespace, y: Array, pk: _Packing) -> Array:
    """Padded ``(n, H, max_len, D)`` -> packed ``(H, total, D)``."""
    h, d = int(y.shape[1]), int(y.shape[-1])
    y = xp.reshape(xp.permute_dims(y, (1, 0, 2, 3)), (h, pk.n * pk.max_len, d))
    return xp.take(y, pk.unpack_index, axis=1)


def _check_offsets(xp: Namespace, cu_name: str, cu: Array, total: int) -> None:
    """``cu`` starts at 0, ends at ``total`` and never decreases. Compared, never
    subtracted: differences of offsets near the dtype's limits wrap (int32
    ``-2**31 - (2**31 - 1)`` is ``1``), comparisons do not."""
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise ValueError(
            f"{cu_name} must start at 0 and end at the packed length {total}; "
            f"got first {first}, last {last}"
        )
    if int(cu.shape[0]) > 1 and bool(xp.any(cu[1:] < cu[:-1])):
        at = int(xp.argmax(xp.astype(cu[1:] < cu[:-1], xp.int8)))
        raise ValueError(
            f"{cu_name} must be non-decreasing (lengths >= 0); got {cu_name}[{at + 1}] = "
            f"{int(cu[at + 1])} after {cu_name}[{at}] = {int(cu[at])}"
        )


def _max_len(xp: Namespace, name: str, given: Any, cu: Array, total: int) -> int:
    cu_name = "cu_seqlens_q" if name.endswith("_q") else "cu_seqlens_k"
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise TypeError(f"{name} must be an int >= 0 (or None), got {type(given).__name__}")
        if given < 0:
            raise ValueError(f"{name} must be an int >= 0 (or None), got {given!r}")
        if not is_lazy(xp):  # (JAX, Dask: values cannot be read there; the caller's word)
            _check_offsets(xp, cu_name, cu, total)
        # No sequence is longer than the packed total: a larger value (10**7 for a few
        # tokens) would only size padding, gigabytes of it.
        return min(int(given), total)
    # Not given: read the offsets once (a device->host sync) and check them on the way.
    _check_offsets(xp, cu_name, cu, total)
    if int(cu.shape[0]) == 1:
        return 0
    return int(xp.max(cu[1:] - cu[:-1]))  # (non-decreasing, within [0, total]: no wrap)


def _index_dtype(xp: Namespace, cu: Array, n: int, max_len: int, total: int) -> Any:
    """The offsets' dtype when it holds every padded slot index ``n * max_len`` and the
    packed total, else int64: int32 offsets of 40,000 sequences padded to 100,000 tokens
    index 4 * 10**9 slots, which int32 arithmetic would wrap."""
    need = max(n * max_len, total, max_len)
    if need <= int(xp.iinfo(cu.dtype).max):
        return cu.dtype
    if need > int(xp.iinfo(xp.int64).max):
        raise ValueError(
            f"varlen_attention's padded batch has {n} sequences x {max_len} positions = "
            f"{n * max_len} slots, beyond int64 indexing"
        )
    return xp.int64


def _validate(query, key, value, cu_seqlens_q, cu_seqlens_k):
    require_arrays(
        query=query,
        key=key,
        value=value,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
    )
    xp = namespace_of(
        query=query,
        key=key,
        value=value,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
    )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must be packed as (heads, total_tokens, head_dim), got shape "
                f"{tuple(x.shape)}"
            )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not xp.isdtype(cu.dtype, "integral"):
            raise TypeError(f"{name} must have an integer dtype, got {cu.dtype}")
        if cu.ndim != 1 or int(cu.shape[0]) < 1:
            raise ValueError(
                f"{name} must be 1-D (num_sequences + 1,) starting at 0, got shape "
                f"{tuple(cu.shape)}"
            )
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
            f"{tuple(cu_seqlens_k.shape)} must describe the same number of sequences"
        )
    if int(key.shape[1]) != int(value.shape[1]):
        raise ValueError(
            f"value has {value.shape[1]} tokens (shape {tuple(value.shape)}) but key has "
            f"{key.shape[1]} (shape {tuple(key.shape)})"
        )
    return xp


def _setup(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    xp = _validate(query, key, value, cu_seqlens_q, cu_seqlens_k)
    total_q, total_k = int(query.shape[1]), int(key.shape[1])
    mq = _max_len(xp, "max_seqlen_q", max_seqlen_q, cu_seqlens_q, total_q)
    mk = _max_len(xp, "max_seqlen_k", max_seqlen_k, cu_seqlens_k, total_k)
    if total_q and total_k:  # (no key or no query: nothing is padded)
        _check_padding_fits(xp, query, key, value, int(cu_seqlens_q.shape[0]) - 1, mq, mk)
    pq = _packing(xp, cu_seqlens_q, mq, total_q)
    pk = _packing(xp, cu_seqlens_k, mk, total_k)
    return xp, pq, pk


def _empty_result(
    xp: Namespace, query: Array, value: Array, sinks: Array | None = None
) -> tuple[Array, Array]:
    dev = device_of(query)
    hq, tq = int(query.shape[0]), int(query.shape[1])
    hq = max(hq, int(value.shape[0]))
    out = xp.zeros((hq, tq, int(value.shape[-1])), dtype=query.dtype, device=dev)
    ldt = lse_dtype(xp, query.dtype)
    if sinks is None:
        lse = xp.full((hq, tq), -math.inf, dtype=ldt, device=dev)
    else:  # rows with no key but a sink: LSE = sink
        sink = xp.reshape(xp.astype(sinks, ldt), (int(sinks.shape[-1]), 1))
        lse = xp.broadcast_to(sink, (hq, tq))
    return out, lse


def varlen_attention(
    query: Array,
    key: Array,
    value: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
) -> Array | tuple[Array, Array]:
    """Attention over a packed batch of variable-length sequences.

    Shapes (heads first, as :func:`~arrayattn.ops.heads.split_heads` of packed tokens):
    ``query (Hq, total_q, E)``, ``key (Hkv, total_k, E)``, ``value (Hkv, total_k, Ev)``;
    ``cu_seqlens_q``/``cu_seqlens_k`` integer ``(n + 1,)``, starting at 0 and ending at
    ``total_q``/``total_k``: sequence ``b`` is tokens ``[cu[b], cu[b+1])``. Output
    ``(Hq, total_q, Ev)`` in the input dtype (and with ``return_lse=True`` the LSE
    ``(Hq, total_q)`` in float32/float64).

    Query sequence ``b`` attends to key sequence ``b`` only. GQA is automatic when
    ``Hq != Hkv`` (``Hq % Hkv == 0`` required). Causal masks and windows are per
    sequence; ``causal_align="bottom_right"`` aligns each sequence's last query with its
    last key (FlashAttention's varlen semantics). Dropout uses batch index = sequence
    index and positions within the sequence, so it equals the padded call
    ``scaled_dot_product_attention(..., q_lengths=, kv_lengths=)`` with the same seed.
    Other options as in :func:`~arrayattn.ops.attention.scaled_dot_product_attention`;
    ``sinks`` are ``(Hq,)`` (their gradient, from :func:`arrayattn.vjp`, sums over the
    sequences) and ``alibi_slopes`` ``(Hq,)`` or per sequence ``(n, Hq)``, measured from
    each sequence's own diagonal.

    ``max_seqlen_q``/``max_seqlen_k`` (Python ints, the longest sequence) size the padded
    batch; when left ``None`` they are read from ``cu_seqlens`` (a device->host sync;
    pass them under ``jax.jit``). The offsets are validated either way (they must start
    at 0, end at the packed length and never decrease; compared, so values near the
    dtype's limits cannot wrap), except on JAX and Dask, whose values are not read.
    Values above the packed length ``total_q``/``total_k`` are clipped to it (no
    sequence is longer), so an oversized bound costs no memory. Values smaller than a
    real length truncate that sequence silently. A padded batch that cannot fit in the
    free memory is a ``MemoryError`` before it is allocated.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((4, 7, 8)); kv = rng.standard_normal((2, 9, 8))
        >>> cu_q = np.array([0, 3, 7]); cu_k = np.array([0, 5, 9])
        >>> out = aa.varlen_attention(q, kv, kv, cu_q, cu_k, is_causal=True)
        >>> first = aa.scaled_dot_product_attention(
        ...     q[:, :3], kv[:, :5], kv[:, :5], is_causal=True, enable_gqa=True)
        >>> out.shape, bool(np.allclose(out[:, :3], first))
        ((4, 7, 8), True)
    """
    out, lse = _varlen(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dict(
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            causal_align=causal_align,
            window=window,
            softcap=softcap,
            seed=seed,
            implementation=implementation,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
        ),
        differentiate=False,
    )[0]
    return (out, lse) if return_lse else out


def _varlen(query, key, value, cu_q, cu_k, max_q, max_k, options, differentiate):
    """``((out, lse), padded pullback or None, packings)``."""
    xp, pq, pk = _setup(query, key, value, cu_q, cu_k, max_q, max_k)
    gqa = int(query.shape[0]) != int(key.shape[0])
    # Validate shapes and options up front (the padded call would too, but with padded
    # shapes in its messages; and degenerate calls never reach it).
    make_spec(
        query,
        key,
        value,
        None,
        options["dropout_p"],
        options["is_causal"],
        options["scale"],
        gqa,
        options["causal_align"],
        options["window"],
        options["softcap"],
        options["seed"],
        sinks=options["sinks"],
        # Per-sequence slopes (n, Hq) are checked by the padded call, whose batch is n.
        alibi_slopes=None
        if options["alibi_slopes"] is None or options["alibi_slopes"].ndim > 1
        else options["alibi_slopes"],
    )
    if options["implementation"] not in implementations():
        raise ValueError(
            f"implementation must be one of {implementations()}, got {options['implementation']!r}"
        )
    if pq.degenerate or pk.degenerate:
        return _empty_result(xp, query, value, options["sinks"]), None, (pq, pk)
    qp, kp, vp = _pad(xp, query, pq), _pad(xp, key, pk), _pad(xp, value, pk)
    kwargs = dict(options, enable_gqa=gqa, return_lse=True)
    kwargs.update(q_lengths=pq.lengths, kv_lengths=pk.lengths)
    if differentiate:
        (out_p, lse_p), pullback = vjp(scaled_dot_product_attention, qp, kp, vp, **kwargs)
    else:
        out_p, lse_p = scaled_dot_product_attention(qp, kp, vp, **kwargs)
        pullback = None
    out = _unpad(xp, out_p, pq)
    lse = _unpad(xp, xp.expand_dims(lse_p, axis=-1), pq)[..., 0]
    return (out, lse), pullback, (pq, pk)


def _check_padding_fits(
    xp: Namespace, query: Array, key: Array, value: Array, n: int, mq: int, mk: int
) -> None:
    """``MemoryError`` before padding when the padded batch of ``n`` sequences of
    ``mq``/``mk`` positions (its gather indices, query, key, value and the output)
    cannot fit: one long sequence among many short ones pads them all to its length."""
    size = 8 if query.dtype == xp.float64 else 4
    hq, hkv = int(query.shape[0]), int(key.shape[0])
    e, ev = int(query.shape[-1]), int(value.shape[-1])
    parts = {
        "gather indices": n * (mq + mk) * 9,  # int64 slots and a bool validity each
        f"padded query ({n} x {hq} x {mq} x {e})": n * hq * mq * e * size,
        f"padded key and value ({n} x {hkv} x {mk} x {e}+{ev})": n * hkv * mk * (e + ev) * size,
        "padded output": n * max(hq, int(value.shape[0])) * mq * ev * size,
    }
    require_memory(
        xp,
        device_of(query),
        parts,
        "varlen_attention",
        "the padding grows with the longest sequence: run very unequal sequences in "
        "separate calls (grouped by length), and pass max_seqlen_q/max_seqlen_k no larger "
        "than the longest sequence",
    )


@register_vjp(varlen_attention)
def _varlen_vjp(
    query: Array,
    key: Array,
    value: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
) -> tuple[Array | tuple[Array, Array], Pullback]:
    options = dict(
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        causal_align=causal_align,
        window=window,
        softcap=softcap,
        seed=seed,
        implementation=implementation,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    (out, lse), pad_pullback, (pq, pk) = _varlen(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        options,
        differentiate=True,
    )
    xp = namespace_of(query=query)

    def pullback(cotangent: Any) -> tuple[Any, ...]:
        d_out, d_lse = split_cotangent(cotangent, return_lse, tuple(out.shape), tuple(lse.shape))
        if pad_pullback is None:
            zeros = tuple(
                xp.zeros(tuple(x.shape), dtype=x.dtype, device=device_of(x))
                for x in (query, key, value)
            )
            if sinks is not None:
                zero = xp.zeros(tuple(sinks.shape), dtype=sinks.dtype, device=device_of(sinks))
                return zeros + (None, None, {"sinks": zero})
            return zeros + (None, None)
        d_out_p = None if d_out is None else _pad(xp, d_out, pq, valid=True)
        d_lse_p = None
        if d_lse is not None:
            d_lse_p = _pad(xp, xp.expand_dims(d_lse, axis=-1), pq, valid=True)[..., 0]
        grads = pad_pullback((d_out_p, d_lse_p))
        dq_p, dk_p, dv_p = grads[:3]
        result: tuple[Any, ...] = (
            _unpad(xp, dq_p, pq),
            _unpad(xp, dk_p, pk),
            _unpad(xp, dv_p, pk),
            None,
            None,
        )
        if sinks is not None:
            result = result + (grads[-1],)  # {"sinks": ...}, summed over the sequences
        return result

    return ((out, lse) if return_lse else out), pullback
