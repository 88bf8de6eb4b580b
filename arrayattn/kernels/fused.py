"""``implementation="fused"``: FlashAttention-2 forward kernels of ours on CuPy arrays.

What runs in the kernel (``attn_fwd.cu``) and what does not:

* dtypes float16 and bfloat16 (tensor cores, compute capability >= 8.0), float32 and
  float64 (CUDA cores, any device). Head dims up to 256; ``E`` and ``Ev`` other than
  32/64/96/128/256 are zero-padded to the next of those (a copy of Q, K, V).
* causal (both alignments), windows, GQA/MQA (the KV head is indexed, never repeated),
  ``q_lengths``/``kv_lengths`` (and so ``varlen_attention``, which pads to them), softcap,
  the seed-defined dropout, ``return_lse``, dense bool and float ``attn_mask`` of any
  broadcastable shape (read in the kernel through element strides; a float mask is first
  cast to the kernel's accumulation dtype, a copy of the mask's own, unbroadcast shape).
* Decode-shaped calls (``L <= 16`` query rows over ``S >= 128`` keys, no mask, no
  dropout) run the split-KV decode kernels of ``decode.py`` instead of the prefill kernel.
* ``sinks`` (folded into each row's denominator at the end of the online softmax) and
  ``alibi_slopes`` (``-slope * |i + offset - j|`` computed per element from indices: no
  ``L x S`` bias), read as contiguous ``(batch * Hq,)`` arrays in the accumulation dtype.
* Fallback rule (``declines``): the kernel declines non-CuPy arrays, other dtypes, head
  dims above 256, 16-bit dtypes on devices older than sm_80, and batch or head counts
  above 65535 (grid limits). ``implementation="auto"`` then moves on to the next path;
  ``implementation="fused"`` raises ``ValueError`` with the reason.
* Layout: the kernels read any strides whose innermost (head-dim) stride is 1 and whose
  broadcast leading dims flatten to one batch stride (16-byte aligned rows for 16-bit
  types); anything else is copied to a contiguous array first (K/V broadcast over
  several leading dims are then materialised along those dims, never along heads).

Backward: :meth:`FusedAttention.backward` runs ``arrayattn/kernels/backward.py`` (the
backward kernels) when that module exists and does not decline the call, else the
chunked array-API backward for large score matrices, else the composed one.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import numpy as np

from .._backend import Array, is_cupy, library_name
from ..ops._attention_spec import AttentionSpec
from ..ops.dropout import dropout_threshold
from . import _loader
from .tiles import (
    DIAG_FROM_LENGTHS,
    forward_kernel_name,
    head_dim_bucket,
    is_heavy,
    tc_row_tiles,
    tile_config,
)

__all__ = ["FusedAttention", "FUSED", "declines", "auto_declines", "kernel_diagonal", "kernel_kind"]

_KINDS = ("float16", "bfloat16", "float32", "float64")
_GRID_YZ_MAX = 65535
_LOG2E = 1.0 / math.log(2.0)
_BACKWARD_MODULE = "arrayattn.kernels.backward"

POISON_OUTPUTS = False
"""Testing aid: when True, output buffers are filled with NaN before each launch, so a
row or column the kernel fails to write shows up in the result."""


def kernel_kind(spec: AttentionSpec) -> str | None:
    """The kernels' dtype name for the call (``"float16"``, ``"bfloat16"``, ``"float32"``,
    ``"float64"``; bfloat16 also when the arrays are its int16 storage), or ``None``."""
    if spec.kernel_kind is not None:
        return spec.kernel_kind
    name = str(spec.dtype).removeprefix("torch.")
    return name if name in _KINDS else None


_kind = kernel_kind


def _compute_capability(spec: AttentionSpec) -> int:
    import cupy

    from ._bridge import _device_index

    return int(cupy.cuda.Device(_device_index(spec)).compute_capability)


def _is_block(spec: AttentionSpec) -> bool:
    return bool(
        spec.batch_ids is not None or spec.row0 or spec.col0 or spec.head0 or spec.partial_keys
    )


def kernel_diagonal(spec: AttentionSpec) -> int | None:
    """The kernels' ``diag`` argument for this call: the constant diagonal offset (query
    ``i`` sits on key ``i + diag``: 0 top-left, ``S - L`` bottom-right, anything for a
    block of a larger call), or :data:`~.tiles.DIAG_FROM_LENGTHS` where each sequence's
    offset is its ``kv_len - q_len`` (bottom-right with lengths); ``None`` when the call's
    per-sequence offsets are neither (a block whose lengths were cut by the block)."""
    if spec.offset_g is None:
        return int(spec.structure.offset)
    if not _is_block(spec):
        return DIAG_FROM_LENGTHS  # make_spec's offset_g is kv_len - q_len, as the kernels'
    xp = spec.xp
    kv = spec.kv_len_g if spec.kv_len_g is not None else spec.S
    q = spec.q_len_g if spec.q_len_g is not None else spec.L
    if bool(xp.all(spec.offset_g == kv - q)):
        return DIAG_FROM_LENGTHS
    return None


def auto_declines(spec: AttentionSpec) -> str | None:
    """What ``implementation="auto"`` adds: CuPy arrays only. PyTorch CUDA tensors and JAX
    GPU arrays reach the kernels (through DLPack) when ``implementation="fused"`` is
    named; ``"auto"`` keeps them on the array-API paths until that route has run on a
    GPU."""
    if not is_cupy(spec.xp):
        return f"{library_name(spec.xp)} arrays reach the fused kernels only when named"
    return None


def declines(spec: AttentionSpec) -> str | None:
    """``None`` when the fused forward kernel runs this call, else the reason it does not
    (used by ``implementation="auto"`` to fall back and by ``"fused"`` for its error)."""
    if not is_cupy(spec.xp):
        from . import _bridge

        reason = _bridge.declines(spec)
        if reason is not None:
            return reason
    kind = _kind(spec)
    if kind is None:
        return f"no fused kernel for dtype {spec.dtype}; expected one of {_KINDS}"
    if spec.E == 0 or spec.Ev == 0:
        return f"head dims must be positive, got E={spec.E}, Ev={spec.Ev}"
    if head_dim_bucket(spec.E, spec.Ev) is None:
        return f"head dims E={spec.E}, Ev={spec.Ev} exceed the kernels' maximum of 256"
    if spec.dropout_p > 0 and (spec.batch_ids or spec.head0 or spec.row0 or spec.col0):
        return "the kernels hash dropout at local positions; this is a block of a larger call"
    if spec.batch_size > _GRID_YZ_MAX or spec.Hq > _GRID_YZ_MAX:
        return (
            f"batch size {spec.batch_size} or head count {spec.Hq} exceeds the grid "
            f"limit {_GRID_YZ_MAX}"
        )
    if kernel_diagonal(spec) is None:
        return "this block's per-sequence diagonal offsets are not its kv_len - q_len"
    if kind in ("float16", "bfloat16"):
        cc = _compute_capability(spec)
        if cc < 80:
            return (
                f"{kind} kernels need compute capability >= 8.0 (mma.sync bf16/f16, "
                f"cp.async, ldmatrix); this device has {cc / 10:.1f}"
            )
    return None


# -- operands ------------------------------------------------------------------------------
def _batch_stride(shape: tuple[int, ...], strides: tuple[int, ...], lead: tuple[int, ...]):
    """One element stride ``s`` with ``offset(flat batch b) = b * s`` for an array whose
    leading dims broadcast to ``lead``, or ``None`` when no single stride works."""
    bs: int | None = None
    span = 1
    for size, st, n in zip(reversed(shape), reversed(strides), reversed(lead), strict=True):
        if n == 1:
            continue
        eff = st if size > 1 else 0
        if bs is None:
            bs = eff
        elif eff != bs * span:
            return None
        span *= n
    return 0 if bs is None else bs


def _data_ptr(x: Any) -> int:
    iface = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    return int(iface["data"][0])


def _elem_strides(x: Any) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _padded_view(spec: AttentionSpec, x: Any) -> Any:
    nd = len(spec.lead) + 3
    if x.ndim < nd:
        x = x.reshape((1,) * (nd - x.ndim) + tuple(x.shape))
    return x


def _operand(spec: AttentionSpec, x: Any, width: int, aligned16: bool):
    """``x`` (query/key/value, any layout) as ``(array, batch, head, row stride)`` in
    elements, zero-padded along the head dim to ``width``."""
    import cupy

    x = _padded_view(spec, x)
    if x.shape[-1] < width:
        pad = cupy.zeros(tuple(x.shape[:-1]) + (width - x.shape[-1],), dtype=x.dtype)
        x = cupy.concatenate([x, pad], axis=-1)
    lead = spec.lead

    def layout(a: Any):
        st = _elem_strides(a)
        if a.shape[-1] > 1 and st[-1] != 1:
            return None
        bs = _batch_stride(tuple(a.shape[:-3]), st[:-3], lead)
        if bs is None:
            return None
        hs = st[-3] if a.shape[-3] > 1 else 0
        rs = st[-2] if a.shape[-2] > 1 else width
        if aligned16 and (_data_ptr(a) % 16 or bs % 8 or hs % 8 or rs % 8):
            return None
        return bs, hs, rs

    got = layout(x)
    if got is None:
        x = cupy.ascontiguousarray(x)
        got = layout(x)
    if got is None:  # broadcast over several leading dims: materialise those dims only
        x = cupy.ascontiguousarray(cupy.broadcast_to(x, lead + tuple(x.shape[-3:])))
        got = layout(x)
    assert got is not None
    return (x,) + got


def _mask_operand(spec: AttentionSpec, mask: Any, acc: Any):
    """The dense mask as ``(array, batch, head, row, col strides)``: bool as uint8, float
    cast to the accumulation dtype; broadcast dims get stride 0."""
    import cupy

    m = _padded_view(spec, mask)
    if spec.mask_kind == "bool":
        m = m.astype(cupy.uint8) if m.dtype != cupy.bool_ else m.view(cupy.uint8)
    else:
        m = m.astype(acc)

    def layout(a: Any):
        st = _elem_strides(a)
        bs = _batch_stride(tuple(a.shape[:-3]), st[:-3], spec.lead)
        if bs is None:
            return None
        return (bs,) + tuple(s if n > 1 else 0 for s, n in zip(st[-3:], a.shape[-3:], strict=True))

    got = layout(m)
    if got is None:
        m = cupy.ascontiguousarray(cupy.broadcast_to(m, spec.lead + tuple(m.shape[-3:])))
        got = layout(m)
    return (m,) + got


def per_head_operand(spec: AttentionSpec, x: Any, acc: Any) -> Any:
    """A per-head array (``sinks``, ``alibi_slopes``, broadcastable to ``(*lead, Hq)``) as
    the kernels read it: contiguous ``(B * Hq,)`` in the accumulation dtype, or ``None``."""
    import cupy

    if x is None:
        return None
    a = cupy.asarray(x).astype(acc, copy=False)
    a = a.reshape((1,) * (len(spec.lead) + 1 - a.ndim) + tuple(a.shape))
    a = cupy.broadcast_to(a, spec.lead + (spec.Hq,))
    return cupy.ascontiguousarray(a).reshape(spec.batch_size * spec.Hq)


def _lengths(spec: AttentionSpec, name: str) -> Any:
    import cupy

    x = getattr(spec, name, None)
    if x is None:
        return None
    return cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.int32).reshape(spec.batch_size))


# -- the implementation ---------------------------------------------------------------------
class FusedAttention:
    """Forward through ``attn_fwd.cu``; backward through the backward kernels when present.

    Example (needs CuPy and a GPU)::

        >>> import cupy as cp, arrayattn as aa  # doctest: +SKIP
        >>> q = cp.random.standard_normal((2, 8, 1000, 128)).astype(cp.float16)  # doctest: +SKIP
        >>> out = aa.scaled_dot_product_attention(  # doctest: +SKIP
        ...     q, q, q, is_causal=True, implementation="fused"
        ... )
    """

    def forward(
        self, spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
    ) -> tuple[Array, Array]:
        """Output (user layout, input dtype) and LSE (float32, float64 for float64), on
        the inputs' device."""
        import cupy

        if not is_cupy(spec.xp):
            from . import _bridge

            if _bridge.bridge_for(spec, query, key, value) is not None:  # PyTorch / JAX GPU
                return _bridge.forward(self, spec, query, key, value, attn_mask)
        dev = getattr(spec.device, "id", None)
        if dev is None:
            return self._forward(spec, query, key, value, attn_mask)
        with cupy.cuda.Device(dev):
            return self._forward(spec, query, key, value, attn_mask)

    def _forward(
        self, spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
    ) -> tuple[Array, Array]:
        import cupy

        kind = _kind(spec)
        d = head_dim_bucket(spec.E, spec.Ev)
        f64 = kind == "float64"
        acc = np.float64 if f64 else np.float32
        lse_dtype = cupy.float64 if f64 else cupy.float32
        B, Hq, L, S = spec.batch_size, spec.Hq, spec.L, spec.S
        if B == 0 or Hq == 0 or L == 0 or S == 0:  # S = 0: every row is empty
            out = cupy.zeros(spec.out_shape, dtype=spec.dtype)
            lse = cupy.full(spec.lse_shape, -np.inf, dtype=lse_dtype)
            if spec.sinks is not None and B * Hq * L > 0:  # no key: LSE = the sink
                sink = per_head_operand(spec, spec.sinks, lse_dtype)
                lse = cupy.broadcast_to(sink.reshape(spec.lead + (Hq, 1)), spec.lead + (Hq, L))
                lse = cupy.ascontiguousarray(lse).reshape(spec.lse_shape)
            return out, lse

        from . import decode

        if decode.declines(spec, attn_mask is not None) is None:
            return decode.forward(spec, query, key, value)

        softcap = spec.softcap is not None
        dropout = spec.dropout_p > 0.0
        mask_kind = 0 if attn_mask is None else (1 if spec.mask_kind == "bool" else 2)
        tc = kind in ("float16", "bfloat16")
        mt = tc_row_tiles(d, is_heavy(softcap, dropout, mask_kind)) if tc else None
        cfg = tile_config(kind, d, mt)
        q, q_sb, q_sh, q_sr = _operand(spec, query, d, tc)
        k, k_sb, k_sh, k_sr = _operand(spec, key, d, tc)
        v, v_sb, v_sh, v_sr = _operand(spec, value, d, tc)

        out = cupy.empty((B, Hq, L, d), dtype=q.dtype)
        lse = cupy.empty((B, Hq, L), dtype=lse_dtype)
        if POISON_OUTPUTS:
            out.fill(np.nan if out.dtype.kind == "f" else -1)  # -1: the bits of a bf16 NaN
            lse.fill(np.nan)
        null = np.uint64(0)
        mask_arr: Any = null
        m_st = (0, 0, 0, 0)
        if attn_mask is not None:
            mask_arr, *m_st = _mask_operand(spec, attn_mask, acc)
        sinks = per_head_operand(spec, spec.sinks, acc)
        alibi = per_head_operand(spec, spec.alibi_slopes, acc)
        q_lens = _lengths(spec, "q_len_g")
        kv_lens = _lengths(spec, "kv_len_g")

        st = spec.structure
        diag = kernel_diagonal(spec)
        assert diag is not None  # declines() refused the call otherwise
        name = forward_kernel_name(kind, d, softcap, dropout, mask_kind, mt)
        kernel = _loader.get_kernel("attn_fwd.cu", name, cfg.smem_bytes)

        i64 = np.int64
        cap = spec.softcap if softcap else 1.0
        args = (
            q, k, v, out, lse, mask_arr,
            null if q_lens is None else q_lens,
            null if kv_lens is None else kv_lens,
            null, null,  # cu_q, cu_k: packed varlen reaches us padded (ops/varlen.py)
            i64(q_sb), i64(q_sh), i64(q_sr),
            i64(k_sb), i64(k_sh), i64(k_sr),
            i64(v_sb), i64(v_sh), i64(v_sr),
            i64(Hq * L * d), i64(L * d), i64(d),
            i64(Hq * L), i64(L),
            *(i64(s) for s in m_st),
            np.int32(L), np.int32(S), np.int32(spec.G), np.int32(diag),
            np.int32(st.left), np.int32(st.right),
            acc(spec.scale * _LOG2E), acc(spec.scale), acc(cap), acc(1.0 / cap),
            np.uint32(spec.seed if dropout else 0),
            np.uint32(dropout_threshold(spec.dropout_p) if dropout else 0),
            acc(1.0 / (1.0 - spec.dropout_p)),
            null if sinks is None else sinks,
            null if alibi is None else alibi,
        )  # fmt: skip
        grid = ((L + cfg.block_m - 1) // cfg.block_m, Hq, B)
        kernel(grid, (cfg.threads,), args, shared_mem=cfg.smem_bytes)

        if d != spec.Ev:
            out = out[..., : spec.Ev]
        out = cupy.ascontiguousarray(out).reshape(spec.out_shape)
        return out, lse.reshape(spec.lse_shape)

    def backward(
        self,
        spec: AttentionSpec,
        query: Array,
        key: Array,
        value: Array,
        attn_mask: Array | None,
        out: Array,
        lse: Array,
        d_out: Array | None,
        d_lse: Array | None,
    ) -> tuple[Array, Array, Array, Array | None]:
        """The hook the backward kernels plug into: ``arrayattn/kernels/backward.py``
        provides ``backward(spec, query, key, value, attn_mask, out, lse, d_out, d_lse)``
        and optionally ``declines(spec) -> str | None``; without it (or when it declines)
        the array-API backward runs on the saved LSE (chunked for large score matrices)."""
        args = (spec, query, key, value, attn_mask, out, lse, d_out, d_lse)
        if not is_cupy(spec.xp):
            from . import _bridge

            if _bridge.bridge_for(spec, query, key, value) is not None:  # PyTorch / JAX GPU
                return _bridge.backward(*args)
        if importlib.util.find_spec(_BACKWARD_MODULE) is not None:
            bwd = importlib.import_module(_BACKWARD_MODULE)
            decline = getattr(bwd, "declines", None)
            if decline is None or decline(spec) is None:
                return bwd.backward(*args)
        from ..ops import _composed, chunked

        if chunked.score_matrix_bytes(spec) > chunked.AUTO_CHUNK_BYTES:
            return chunked.backward(*args)
        return _composed.backward(*args)


FUSED = FusedAttention()
