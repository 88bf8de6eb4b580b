"""Validation of attention arguments into one :class:`AttentionSpec`.

Every implementation (composed, chunked, NumPy fast path, CuPy kernel) starts from the
same spec, so the error messages and the meaning of every option are defined once.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Any

from .._backend import (
    Array,
    Namespace,
    broadcast_shapes,
    compute_dtype,
    device_of,
    is_lazy,
    is_real_floating,
    known_shape,
    namespace_of,
    plain_array_types,
    prod,
    records_gradients,
)
from .dropout import normalize_seed
from .structure import CAUSAL_ALIGNMENTS, Structure, parse_window

Shape = tuple[int, ...]

__all__ = ["AttentionSpec", "make_spec", "draw_seed"]


def draw_seed() -> int:
    """A fresh 32-bit seed for dropout calls that gave none; the vjp stores it so the
    backward pass regenerates the same mask."""
    return int.from_bytes(os.urandom(4), "little")


@dataclass(frozen=True)
class AttentionSpec:
    """Everything derived from a validated attention call.

    Shapes: the call's ``query`` is ``(*lead_q, Hq, L, E)``; internally every array is
    padded to ``ndim = len(lead) + 3`` and queries are viewed grouped as
    ``(*lead, Hq // G, G, L, E)`` against keys ``(*lead, Hk, 1, S, E)`` so GQA broadcasts
    instead of repeating K/V.
    """

    xp: Namespace
    device: Any
    dtype: Any  # the inputs' dtype (and the output's)
    cdtype: Any  # accumulation dtype
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    mask_shape: tuple[int, ...] | None
    lead: tuple[int, ...]  # broadcast leading (batch) dims of the output
    Hq: int
    Hkv: int
    G: int  # queries per KV head (1 without GQA)
    L: int
    S: int
    E: int
    Ev: int
    scale: float
    mask_kind: str | None  # None, "bool" or "float"
    structure: Structure
    softcap: float | None
    dropout_p: float
    seed: int | None
    out_ndim: int
    # Per-sequence lengths (keyword options q_lengths / kv_lengths): the user's int arrays
    # of shape ``lead``, and derived int32 arrays shaped ``(*lead, 1, 1, 1, 1)`` for the
    # grouped layout: lengths clipped to [0, L] / [0, S], and the per-sequence diagonal
    # offset (``None`` where the plain ``structure.offset`` applies).
    q_lengths: Array | None = None
    kv_lengths: Array | None = None
    q_len_g: Array | None = None
    kv_len_g: Array | None = None
    offset_g: Array | None = None
    # gpt-oss attention sinks and ALiBi slopes (keyword options sinks / alibi_slopes):
    # the user's arrays (broadcastable to ``(*lead, Hq)``) and their compute-dtype views
    # in the grouped layout, ``(*lead or 1s, Hq/G or 1, G or 1, 1, 1)``, which broadcast
    # against grouped score blocks ``(..., l, s)`` and row statistics ``(..., l, 1)``.
    sinks: Array | None = None
    alibi_slopes: Array | None = None
    sinks_g: Array | None = None
    alibi_g: Array | None = None
    # Private: this call is one block of a larger call split by a blocked or distributed
    # path (``arrayattn.attention.dask``), made by :meth:`as_block`. Structure and lengths are
    # in the block's own coordinates; dropout hashes global positions, so it adds these
    # origins (``batch_ids``: the global flat batch index of each local one). With
    # ``partial_keys`` the block sees only some keys of each row while the LSE is the
    # whole row's, so no path may renormalise rows over the block's keys.
    batch_ids: tuple[int, ...] | None = None
    head0: int = 0
    row0: int = 0
    col0: int = 0
    partial_keys: bool = False
    offset_range: tuple[int, int] | None = None
    # Some input is recorded by its own library's autograd (a PyTorch tensor that
    # requires grad, under grad mode): paths that leave the library (the fast path on
    # NumPy views of CPU tensors) decline, so that autograd still sees every operation.
    autograd: bool = False
    # False when the caller drops the LSE (``scaled_dot_product_attention`` without
    # ``return_lse``, outside ``vjp``): a path may arrange its work for the output alone.
    # The LSE it returns must still be right (the Dask path's is then a graph of its own).
    lse_wanted: bool = True
    # Private: the arrays are the raw 16-bit storage (int16) of this floating kind, which
    # the array library cannot hold (bfloat16 handed to CuPy from PyTorch or JAX through
    # DLPack, arrayattn/attention/cuda/fused.py): only the fused kernels take such a spec.
    kernel_kind: str | None = None
    # The attention mask's own dtype (``None`` without a mask): a float mask may differ from
    # the inputs' dtype, and a path that views it in another library must be able to.
    mask_dtype: Any = None
    # K/V read once for the whole batch (derived in ``make_spec``): key and value have
    # batch (leading) dims all 1 while the query has ``batch_size > 1`` rows of its own,
    # and nothing per row (lengths) forbids stacking. The fast, chunked and composed paths
    # then fold the batch's rows into each KV-head group (``arrayattn.attention.stacked``)
    # so that one product per tile covers every row; K/V are never copied per row.
    stack_kv: bool = False
    # Private: this spec is such a stacked call, of the original ``(batch_size, group)``:
    # query head ``h'`` of it is row ``(h' // group) % batch_size``, head
    # ``(h' // (batch_size * group)) * group + h' % group`` of the original call (dropout
    # hashes the original indices, bit-identical to the non-stacked call).
    stacked_from: tuple[int, int] | None = None
    # Structured masks and score modifiers (keyword options block_mask / mask_mod /
    # score_mod, arrayattn.flex): ``mask_mod`` is the MaskMod every path evaluates on the
    # blocks it computes (ANDed with every other mask); ``block_mask`` (may be None with a
    # mask_mod given alone) says which blocks are empty (skipped) or full (no test);
    # ``score_mod`` a ScoreMod applied to the scores after softcap and ALiBi.
    block_mask: Any = None
    mask_mod: Any = None
    score_mod: Any = None

    def as_block(
        self,
        *,
        batch_ids: tuple[int, ...] | None,
        head0: int,
        row0: int,
        col0: int,
        structure: Structure,
        offset_g: Array | None = None,
        offset_range: tuple[int, int] | None = None,
        partial_keys: bool = False,
    ) -> AttentionSpec:
        """This spec as the block of a larger call whose first head, query row and key
        are ``head0``, ``row0``, ``col0``: ``structure`` and ``offset_g`` are the block's
        own (the call's bounds, its diagonal moved by ``row0 - col0``; not rebuilt from
        the block's sizes, which would drop bounds beyond them), the origins feed the
        dropout hash."""
        return dataclasses.replace(
            self,
            structure=structure,
            offset_g=offset_g,
            offset_range=offset_range,
            batch_ids=batch_ids,
            head0=head0,
            row0=row0,
            col0=col0,
            partial_keys=partial_keys,
            stack_kv=False,
        )

    @property
    def has_lengths(self) -> bool:
        """True when ``q_lengths`` or ``kv_lengths`` was given."""
        return self.q_lengths is not None or self.kv_lengths is not None

    @property
    def may_mask(self) -> bool:
        """True when some (query, key) pair may be excluded (a mask, lengths, or a
        causal/window structure that cuts): then excluded keys and values may hold
        garbage (NaN, Inf) that the paths must keep out of every result. Decided from
        the arguments alone, never from data."""
        return (
            self.mask_kind is not None
            or self.has_lengths
            or self.mask_mod is not None
            or not self.structure.excludes_nothing(self.L, self.S)
        )

    @property
    def flex(self) -> bool:
        """True with a mask_mod or a score_mod (``arrayattn.flex``): paths that do not
        evaluate them decline."""
        return self.mask_mod is not None or self.score_mod is not None

    @property
    def offset_bounds(self) -> tuple[int, int] | None:
        """Bounds ``(lo, hi)`` of the per-sequence diagonal offsets (their values are data,
        so blocked paths skip only key blocks no possible offset reaches), or ``None``."""
        if self.offset_g is None:
            return None
        if self.offset_range is not None:
            return self.offset_range
        kv_min = 0 if self.kv_lengths is not None else self.S
        q_min = 0 if self.q_lengths is not None else self.L
        return kv_min - self.L, self.S - q_min

    @property
    def out_shape(self) -> tuple[int, ...]:
        shape = self.lead + (self.Hq, self.L, self.Ev)
        return shape[len(shape) - self.out_ndim :]

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return self.out_shape[:-1]

    @property
    def batch_size(self) -> int:
        return prod(self.lead)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the compute dtype (8 for float64, else 4)."""
        return 8 if self.cdtype == self.xp.float64 else 4

    # -- layout helpers -------------------------------------------------------------
    def _pad(self, x: Array, shape: tuple[int, ...]) -> Array:
        full = len(self.lead) + 3
        if len(shape) < full:
            x = self.xp.reshape(x, (1,) * (full - len(shape)) + tuple(shape))
        return x

    def group_query(self, q: Array) -> Array:
        """``(*lead_q, Hq, L, E)`` -> ``(*lead_q, Hq/G, G, L, E)``."""
        return self.group_rows(q, self.q_shape)

    def group_kv(self, x: Array, shape: tuple[int, ...]) -> Array:
        """``(*lead_k, Hk, S, D)`` -> ``(*lead_k, Hk, 1, S, D)``."""
        x = self._pad(x, shape)
        return self.xp.expand_dims(x, axis=-3)

    def group_rows(self, x: Array, shape: tuple[int, ...]) -> Array:
        """An array broadcastable to ``(*lead, Hq, L, X)`` viewed as grouped
        ``(*lead, Hq/G or 1, G or 1, L, X)``."""
        x = self._pad(x, shape)
        heads = x.shape[-3]
        if heads == 1:
            return self.xp.expand_dims(x, axis=-3)
        return self.xp.reshape(
            x, tuple(x.shape[:-3]) + (self.Hq // self.G, self.G) + tuple(x.shape[-2:])
        )

    def ungroup_rows(self, x: Array) -> Array:
        """Grouped ``(*lead, Hq/G, G, L, X)`` -> ``(*lead, Hq, L, X)``."""
        return self.xp.reshape(
            x, tuple(x.shape[:-4]) + (x.shape[-4] * x.shape[-3],) + tuple(x.shape[-2:])
        )

    def ungroup_out(self, x: Array) -> Array:
        """Grouped output rows -> the user's output shape."""
        return self.xp.reshape(self.ungroup_rows(x), self.out_shape)

    def original_ids(self, bi: int, heads: Any) -> tuple[Any, Any]:
        """The dropout hash's ``(batch, head)`` indices of flat batch ``bi`` and the
        (int, or int array of) query heads ``heads`` of this call: the global ones of a
        block (:meth:`as_block`), the original rows and heads of a stacked call
        (``stacked_from``)."""
        if self.stacked_from is not None:
            rows, group = self.stacked_from
            h = heads + self.head0
            return (h // group) % rows, (h // (rows * group)) * group + h % group
        b = bi if self.batch_ids is None else self.batch_ids[bi]
        return b, heads + self.head0

    def index_arrays(self) -> tuple[Array, Array]:
        """int32 (batch, head) indices in the grouped layout, for dropout."""
        xp = self.xp
        if self.stacked_from is not None:
            flat = xp.arange(self.head0, self.head0 + self.Hq, dtype=xp.int32, device=self.device)
            b, h = self.original_ids(0, flat - self.head0)
            shape = (1,) * len(self.lead) + (self.Hq // self.G, self.G, 1, 1)
            return xp.reshape(b, shape), xp.reshape(h, shape)
        if self.batch_ids is None:
            batch = xp.arange(self.batch_size, dtype=xp.int32, device=self.device)
        else:
            batch = xp.asarray(self.batch_ids, dtype=xp.int32, device=self.device)
        batch = xp.reshape(batch, self.lead + (1, 1, 1, 1))
        head = xp.reshape(
            xp.arange(self.head0, self.head0 + self.Hq, dtype=xp.int32, device=self.device),
            (self.Hq // self.G, self.G, 1, 1),
        )
        return batch, head


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _check_floating(xp: Namespace, name: str, x: Array) -> None:
    if not is_real_floating(xp, x.dtype):
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32, float64), "
            f"got {x.dtype}"
        )


def make_spec(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    causal_align: str,
    window: Any,
    softcap: float | None,
    seed: int | None,
    *,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    lse_wanted: bool = True,
    block_mask: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> AttentionSpec:
    """Validate an attention call (see ``SEMANTICS.md``) and derive its spec.
    ``lse_wanted=False``: the caller will not use the LSE (see ``AttentionSpec``).

    A call whose spec depends only on its arrays' types, shapes, dtypes and devices and on
    its scalar options (NumPy or CuPy arrays, no optional array, no dropout) reuses the
    spec of an earlier identical call: a decode step on a GPU is bound by this function's
    host time otherwise (54 us of a 181 us call on an H200's host)."""
    if block_mask is not None or mask_mod is not None or score_mod is not None:
        spec = _make_spec(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            causal_align, window, softcap, seed, q_lengths=q_lengths, kv_lengths=kv_lengths,
            sinks=sinks, alibi_slopes=alibi_slopes, lse_wanted=lse_wanted,
        )  # fmt: skip
        return _with_flex(spec, block_mask, mask_mod, score_mod)
    cache_key = _spec_cache_key(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        causal_align, window, softcap, seed, q_lengths, kv_lengths, sinks, alibi_slopes,
        lse_wanted,
    )  # fmt: skip
    if cache_key is not None:
        cached = _SPEC_CACHE.get(cache_key)
        if cached is not None:
            return cached
    spec = _make_spec(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        causal_align, window, softcap, seed, q_lengths=q_lengths, kv_lengths=kv_lengths,
        sinks=sinks, alibi_slopes=alibi_slopes, lse_wanted=lse_wanted,
    )  # fmt: skip
    if cache_key is not None:
        if len(_SPEC_CACHE) >= _SPEC_CACHE_SIZE:
            _SPEC_CACHE.clear()  # a process cycling through many shapes: start again
        _SPEC_CACHE[cache_key] = spec
    return spec


def _with_flex(
    spec: AttentionSpec, block_mask: Any, mask_mod: Any, score_mod: Any
) -> AttentionSpec:
    """``spec`` with its structured mask and score modifier (``arrayattn.flex``), checked
    against the call: a block mask built for other shapes or another library is a
    ``ValueError``; a block mask and a different mask_mod together too."""
    from .block_mask import BlockMask, create_block_mask
    from .mask_mods import as_mask_mod, classifiable
    from .score_mods import as_score_mod

    mod = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                "block_mask must be a BlockMask from arrayattn.flex.create_block_mask, got "
                f"{type(block_mask).__name__}"
            )
        block_mask.check_call(spec.xp, spec.device, spec.batch_size, spec.Hq, spec.L, spec.S)
        mod = block_mask.mask_mod
        # (a plain function is wrapped anew by each as_mask_mod: compare the functions)
        if mask_mod is not None and not (
            as_mask_mod(mask_mod) is mod or getattr(mod, "fn", None) is mask_mod
        ):
            raise ValueError(
                "mask_mod and block_mask were both given and differ: the block mask already "
                "holds its mask_mod (pass one of them)"
            )
    elif mask_mod is not None:
        mod = as_mask_mod(mask_mod)
        if classifiable(mod):  # built-ins: the block classification is cheap
            block_mask = create_block_mask(
                mod, spec.batch_size, None, spec.L, spec.S, xp=spec.xp, device=spec.device
            )
    smod = None if score_mod is None else as_score_mod(score_mod)
    heads = None if smod is None else smod.heads
    if heads is not None and heads not in (1, spec.Hq):
        raise ValueError(
            f"score_mod {smod!r}: its table has {heads} heads, but the call has Hq = "
            f"{spec.Hq} query heads; expected a table (entries, {spec.Hq}), or (entries, 1) "
            "shared by every head"
        )
    return dataclasses.replace(
        spec, block_mask=block_mask, mask_mod=mod, score_mod=smod, stack_kv=False
    )


_SPEC_CACHE: dict[tuple[Any, ...], AttentionSpec] = {}
_SPEC_CACHE_SIZE = 256


def _spec_cache_key(
    query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any,
    scale: Any, enable_gqa: Any, causal_align: Any, window: Any, softcap: Any, seed: Any,
    q_lengths: Any, kv_lengths: Any, sinks: Any, alibi_slopes: Any, lse_wanted: Any,
) -> tuple[Any, ...] | None:  # fmt: skip
    """The key under which :func:`make_spec`'s result for this call may be reused, or
    ``None`` when it may not: arrays other than plain NumPy/CuPy ndarrays of one type
    (PyTorch's autograd state, JAX tracers and Dask's chunks enter a spec), any optional
    array (their values are checked), dropout (a seed may be drawn), or an option that is
    not a plain hashable value (it is validated by the full path every time)."""
    t = type(query)
    if type(key) is not t or type(value) is not t or t not in plain_array_types():
        return None
    if any(x is not None for x in (attn_mask, q_lengths, kv_lengths, sinks, alibi_slopes)):
        return None
    scalars = (dropout_p, is_causal, scale, enable_gqa, causal_align, softcap, seed, lse_wanted)
    if not all(x is None or type(x) in _PLAIN for x in scalars) or dropout_p:
        return None
    if window is not None and not (type(window) is tuple and all(type(w) is int for w in window)):
        return None
    devices = tuple(getattr(x.device, "id", x.device) for x in (query, key, value))
    return (
        t, query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, devices,
        *((type(x), x) for x in scalars), window,
    )  # fmt: skip


_PLAIN = (bool, int, float, str)


def _make_spec(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    causal_align: str,
    window: Any,
    softcap: float | None,
    seed: int | None,
    *,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    sinks: Array | None = None,
    alibi_slopes: Array | None = None,
    lse_wanted: bool = True,
) -> AttentionSpec:
    """:func:`make_spec` without its cache."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is None:  # namespace_of skips None (the optional arrays)
            raise TypeError(f"{name} must be an array from an array-API library, got None")
    xp = namespace_of(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    q_shape, k_shape, v_shape = _check_qkv(xp, query, key, value)
    L, E = q_shape[-2:]
    S, Ev = v_shape[-2:]
    lead, Hq, Hkv, G = _heads(q_shape, k_shape, v_shape, enable_gqa)
    mask_kind, mask_shape = _mask(xp, attn_mask, lead + (Hq, L, S))
    if mask_kind == "float":
        _warn_on_zero_one_mask(xp, attn_mask)

    # NumPy's bool scalar (type name "bool" in NumPy 2, "bool_" before) is no Python int.
    if not isinstance(is_causal, (bool, int)) and type(is_causal).__name__ not in ("bool", "bool_"):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if causal_align not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNMENTS}, got {causal_align!r}")
    window_pair = parse_window(window)
    scale_f, softcap_f, p, seed_n = _scalars(E, scale, softcap, dropout_p, seed)

    structure = Structure.build(L, S, bool(is_causal), causal_align, window_pair)
    q_len_g = _lengths_g(xp, "q_lengths", q_lengths, lead, L)
    kv_len_g = _lengths_g(xp, "kv_lengths", kv_lengths, lead, S)
    offset_g = None
    if causal_align == "bottom_right" and (q_len_g is not None or kv_len_g is not None):
        # FlashAttention varlen: each sequence's diagonal ends at its own last key.
        kv_len = kv_len_g if kv_len_g is not None else S
        q_len = q_len_g if q_len_g is not None else L
        offset_g = kv_len - q_len
    cdtype = compute_dtype(xp, query.dtype)
    stack_kv = _stack_kv(q_shape, k_shape, v_shape, lead, Hq, q_lengths, kv_lengths)

    return AttentionSpec(
        xp=xp,
        device=device_of(query),
        dtype=query.dtype,
        cdtype=cdtype,
        q_shape=q_shape,
        k_shape=k_shape,
        v_shape=v_shape,
        mask_shape=mask_shape,
        lead=lead,
        Hq=Hq,
        Hkv=Hkv,
        G=G,
        L=L,
        S=S,
        E=E,
        Ev=Ev,
        scale=scale_f,
        mask_kind=mask_kind,
        structure=structure,
        softcap=softcap_f,
        dropout_p=p,
        seed=seed_n,
        out_ndim=max(len(q_shape), len(k_shape), len(v_shape)),
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        q_len_g=q_len_g,
        kv_len_g=kv_len_g,
        offset_g=offset_g,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        sinks_g=_per_head_g(xp, "sinks", sinks, lead, Hq, G, cdtype),
        alibi_g=_per_head_g(xp, "alibi_slopes", alibi_slopes, lead, Hq, G, cdtype),
        autograd=records_gradients(query, key, value, attn_mask, sinks, alibi_slopes),
        lse_wanted=bool(lse_wanted),
        mask_dtype=None if attn_mask is None else attn_mask.dtype,
        stack_kv=stack_kv,
    )


def _stack_kv(
    q_shape: Shape,
    k_shape: Shape,
    v_shape: Shape,
    lead: Shape,
    Hq: int,
    q_lengths: Array | None,
    kv_lengths: Array | None,
) -> bool:
    """True when one K/V serves several query rows that can be stacked into its head
    groups: K and V have batch dims all 1, the query has every row of ``lead`` (more than
    one) and all ``Hq`` heads, and no per-row lengths (a shared K/V seen to different
    lengths per row takes the per-row route)."""
    nd = len(lead) + 3

    def batch_dims(s: Shape) -> Shape:
        return ((1,) * (nd - len(s)) + s)[:-3]

    if prod(lead) <= 1 or q_lengths is not None or kv_lengths is not None:
        return False
    if prod(batch_dims(k_shape)) != 1 or prod(batch_dims(v_shape)) != 1:
        return False
    q_heads = q_shape[-3] if len(q_shape) >= 3 else 1
    return batch_dims(q_shape) == lead and q_heads == Hq


def _check_qkv(xp: Namespace, query: Array, key: Array, value: Array) -> tuple[Shape, Shape, Shape]:
    """Query, key and value shapes, once their dtypes, ranks, head dims and key counts
    agree."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_floating(xp, name, x)
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dims (..., seq, head_dim), got shape {tuple(x.shape)}"
            )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        bad, dt = ("key", key.dtype) if key.dtype != query.dtype else ("value", value.dtype)
        raise TypeError(
            f"{bad} dtype {dt} differs from query dtype {query.dtype}; expected one dtype"
        )
    q_shape, k_shape, v_shape = (
        known_shape(n, x) for n, x in (("query", query), ("key", key), ("value", value))
    )
    E, Ek = q_shape[-1], k_shape[-1]
    S, Sv = k_shape[-2], v_shape[-2]
    if Ek != E:
        raise ValueError(
            f"key head_dim {Ek} (shape {k_shape}) differs from query head_dim {E} (shape {q_shape})"
        )
    if Sv != S:
        raise ValueError(f"value has {Sv} keys (shape {v_shape}) but key has {S} (shape {k_shape})")
    return q_shape, k_shape, v_shape


def _heads(q_shape: Shape, k_shape: Shape, v_shape: Shape, enable_gqa: bool) -> tuple:
    """``(lead, Hq, Hkv, G)``: broadcast batch dims, query and KV heads, GQA group size.
    Shapes of fewer than 3 dims have one head."""
    ndim = max(len(q_shape), len(k_shape), len(v_shape), 3)

    def pad(s: Shape) -> Shape:
        return (1,) * (ndim - len(s)) + s

    pq, pk, pv = pad(q_shape), pad(k_shape), pad(v_shape)
    Hq = pq[-3]
    try:
        Hk = broadcast_shapes((pk[-3],), (pv[-3],))[0]
    except ValueError:
        raise ValueError(
            f"key heads {pk[-3]} and value heads {pv[-3]} differ; expected equal"
        ) from None
    try:
        lead = broadcast_shapes(pq[:-3], pk[:-3], pv[:-3])
    except ValueError:
        raise ValueError(
            f"batch dims of query {q_shape}, key {k_shape} and value {v_shape} do not broadcast"
        ) from None

    if enable_gqa and Hk != Hq:
        if Hq % Hk != 0:
            raise ValueError(
                f"query heads {Hq} must be a multiple of key/value heads {Hk} for GQA "
                f"(Hq % Hkv == 0); got query {q_shape}, key {k_shape}"
                + _swapped_layout_hint(pq, pk)
            )
        return lead, Hq, Hk, Hq // Hk
    if Hk not in (1, Hq) and Hq != 1:
        hint = _swapped_layout_hint(pq, pk)
        raise ValueError(
            f"query has {Hq} heads but key/value have {Hk}"
            + (hint or "; pass enable_gqa=True for grouped-query attention, or give equal "
               "head counts")
        )  # fmt: skip
    return lead, max(Hq, Hk), Hk, 1  # plain broadcasting over the head axis, as matmul does


def _warn_on_zero_one_mask(xp: Namespace, attn_mask: Array) -> None:
    """Warn when a float mask holds only 0 and 1 (and some 1): a Hugging Face-style mask
    (1 = attend) passed as floats, which attention adds to the scores instead of
    selecting keys. Values are read only where that is free of side effects (not JAX,
    whose arrays may be traced, nor Dask, whose graph it would compute)."""
    if is_lazy(xp) or prod(known_shape("attn_mask", attn_mask)) == 0:
        return
    zero_one = (attn_mask == 0) | (attn_mask == 1)
    if bool(xp.all(zero_one)) and bool(xp.any(attn_mask == 1)):
        warnings.warn(
            "attn_mask is a float mask holding only 0.0 and 1.0: a float mask is ADDED to "
            "the scores (a 1 raises a logit by one), it does not select keys. For a "
            "Hugging Face-style mask (1 = attend) pass a bool mask (attn_mask == 1: True "
            "takes part), or an additive one (0 to keep, -inf to drop).",
            UserWarning,
            stacklevel=5,  # _warn_on_zero_one_mask, _make_spec, make_spec, the op, the caller
        )


def _swapped_layout_hint(q_shape: Shape, k_shape: Shape) -> str:
    """A hint when head-count trouble comes from a (batch, sequence, heads, head_dim)
    layout: the heads axis (-3) then holds the sequence lengths, which do not fit as
    head counts, while the -2 axis holds head counts that do (equal, or a GQA multiple).
    ``""`` when the shapes do not suggest it (when L equals the head count nothing can
    tell)."""
    if len(q_shape) < 4 or len(k_shape) < 4:
        return ""
    hq, hk = q_shape[-2], k_shape[-2]
    if hq < 1 or hk < 1 or hq % hk:
        return ""
    if k_shape[-3] >= 1 and q_shape[-3] % k_shape[-3] == 0:
        return ""  # the heads axis could hold real GQA head counts: no layout to suggest
    return (
        f"; the shapes look like (batch, sequence, heads, head_dim) (query sequence "
        f"{q_shape[-3]}, key sequence {k_shape[-3]}, {hq} and {hk} heads): arrayattn takes "
        f"(..., heads, sequence, head_dim), PyTorch's layout; swap the two axes first, e.g. "
        f"xp.permute_dims(x, (0, 2, 1, 3))"
    )


def _mask(xp: Namespace, attn_mask: Array | None, target: Shape) -> tuple[str | None, Shape | None]:
    """``(kind, shape)`` of the mask: ``"bool"`` or ``"float"`` (``None`` without one),
    once its shape broadcasts to the weights' ``target`` (batch..., heads, L, S)."""
    if attn_mask is None:
        return None, None
    if xp.isdtype(attn_mask.dtype, "bool"):
        kind = "bool"
    elif is_real_floating(xp, attn_mask.dtype):
        kind = "float"
    else:
        raise TypeError(
            f"attn_mask must be bool (True = takes part) or a real floating additive "
            f"bias, got dtype {attn_mask.dtype}"
        )
    shape = known_shape("attn_mask", attn_mask)
    try:
        ok = broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"attn_mask of shape {shape} does not broadcast to the attention "
            f"weights' shape {target} (batch..., heads, L, S)"
        )
    return kind, shape


def _scalars(
    E: int, scale: Any, softcap: Any, dropout_p: Any, seed: Any
) -> tuple[float, float | None, float, int | None]:
    """``(scale, softcap, dropout_p, seed)`` checked and normalised: the scale defaults to
    ``1/sqrt(E)``; a seed is drawn when dropout is on and none was given."""
    if scale is None:
        scale_f = 1.0 / math.sqrt(E) if E > 0 else 1.0
    else:
        scale_f = _as_float("scale", scale)
        if not math.isfinite(scale_f):
            raise ValueError(f"scale must be finite, got {scale_f}")

    softcap_f = None
    if softcap is not None:
        softcap_f = _as_float("softcap", softcap)
        if not (math.isfinite(softcap_f) and softcap_f > 0):
            raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap_f}")
        # softcap = 0 is FlashAttention's "off"; we ask for None to keep one spelling.

    p = _as_float("dropout_p", dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    seed_n = None
    if p > 0.0:
        seed_n = draw_seed() if seed is None else normalize_seed(seed)
    elif seed is not None:
        normalize_seed(seed)  # still validate the type
    return scale_f, softcap_f, p, seed_n


def _per_head_g(
    xp: Namespace,
    name: str,
    x: Array | None,
    lead: tuple[int, ...],
    Hq: int,
    G: int,
    cdtype: Any,
) -> Array | None:
    """Validate a per-head array (``sinks``, ``alibi_slopes``) broadcastable to
    ``(*lead, Hq)`` and view it in the grouped layout ``(..., Hq/G, G, 1, 1)`` (size-1
    axes kept where it broadcasts) in the compute dtype. Never copies when the dtype
    already matches."""
    if x is None:
        return None
    if not is_real_floating(xp, x.dtype):
        raise TypeError(
            f"{name} must have a real floating dtype (one value per query head), got {x.dtype}"
        )
    shape = known_shape(name, x)
    target = lead + (Hq,)
    try:
        ok = len(shape) >= 1 and broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to (batch..., Hq) = {target}; "
            f"expected ({Hq},) or a shape broadcastable to {target}"
        )
    y = xp.astype(x, cdtype, copy=False)
    y = xp.reshape(y, (1,) * (len(target) - len(shape)) + shape)
    heads = y.shape[-1]
    tail = (Hq // G, G) if heads != 1 else (1, 1)
    return xp.reshape(y, tuple(y.shape[:-1]) + tail + (1, 1))


_INT32_MAX = 2**31 - 1


def _lengths_g(
    xp: Namespace, name: str, lengths: Array | None, lead: tuple[int, ...], size: int
) -> Array | None:
    """Validate per-sequence lengths and shape them for the grouped layout: int32,
    clipped to ``[0, size]``, shape ``(*lead, 1, 1, 1, 1)``. Values are data: no Python
    decision is taken on them."""
    if lengths is None:
        return None
    if not xp.isdtype(lengths.dtype, "integral"):
        raise TypeError(f"{name} must have an integer dtype, got {lengths.dtype}")
    shape = known_shape(name, lengths)
    if shape != lead:
        raise ValueError(
            f"{name} must have the broadcast batch shape {lead} of query/key/value "
            f"(one length per sequence), got shape {shape}"
        )
    if size > _INT32_MAX:
        raise ValueError(
            f"{name} needs a sequence axis of at most 2**31 - 1 positions (lengths and "
            f"positions are int32), got {size}"
        )
    dev = device_of(lengths)
    # Clip in the lengths' own dtype, then cast: a cast first wraps 2**32 + 2 to 2.
    dt = lengths.dtype
    x = lengths
    if xp.isdtype(dt, "signed integer"):
        x = xp.maximum(x, xp.asarray(0, dtype=dt, device=dev))
    if size <= int(xp.iinfo(dt).max):  # else no value of dt can exceed size
        x = xp.minimum(x, xp.asarray(size, dtype=dt, device=dev))
    x = xp.astype(x, xp.int32)
    return xp.reshape(x, lead + (1, 1, 1, 1))
