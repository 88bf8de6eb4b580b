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
* Forward kernel variant: ``ARRAYATTN_FWD_VARIANT`` = ``v3`` (the default: ``aa_fwd_tc2``
  for 16-bit dtypes at D = 64/128, 1.25-1.36x v1 on an H200, and ``aa_fwd_tf32`` for
  float32 at D = 64/128, three TF32 products per product, 2.1-2.3x the CUDA-core kernel
  on an H100), ``v2`` (float32 on CUDA cores) or ``v1``; ``tiles.forward_launch`` picks
  the kernel, ``tiles.v2_declines`` and ``tiles.tf32_declines`` say which calls stay on
  v1.
* Decode-shaped calls (``L <= 16`` query rows over ``S >= 128`` keys, no mask, no
  dropout) run the split-KV decode kernels of ``decode.py`` instead of the prefill kernel.
* ``sinks`` (folded into each row's denominator at the end of the online softmax) and
  ``alibi_slopes`` (``-slope * |i + offset - j|`` computed per element from indices: no
  ``L x S`` bias), read as contiguous ``(batch * Hq,)`` arrays in the accumulation dtype.
* Block masks (``arrayattn.flex``: ``block_mask=``, or a built-in ``mask_mod`` for which
  ``make_spec`` builds one): the kernels read a compact table built once per
  ``BlockMask`` and device (``flex_table.py``; cached on the block mask, so pass the same
  one to every call and layer): per (batch, head, query block) the non-empty key blocks,
  full or partial, and the bits of the partial blocks from one evaluation of the
  mask_mod on them; or, for a tree of built-in mask_mods with
  ``ARRAYATTN_FLEX_PREDICATE=1`` (``flex_pred.py``; opt-in), no bits: a predicate
  generated from the tree's structure is compiled into the kernel and its values read
  from the table. Empty blocks are skipped, partial ones set excluded scores to -inf
  (ANDed with causal, windows, lengths and a dense mask). Declined (the array-API
  chunked path runs them): ``score_mod``, a plain mask_mod function without a block mask, block
  sizes the kernel's tiles do not divide (``Q_BLOCK % BM``, ``KV_BLOCK % BN``; the
  default 128 fits every kernel), non-CuPy arrays, blocks of a larger call. The decode
  kernels decline them; the backward of such a call is the backward kernels' block-mask
  instantiations where ``backward.declines`` takes the call (``ARRAYATTN_FLEX_BWD_KERNELS=0``
  opts out), else the array-API backward on the
  kernel's LSE.
* Fallback rule (``declines``): the kernel declines non-CuPy arrays, other dtypes, head
  dims above 256, 16-bit dtypes on devices older than sm_80, and batch or head counts
  above 65535 (grid limits). ``implementation="auto"`` then moves on to the next path;
  ``implementation="fused"`` raises ``ValueError`` with the reason.
* Layout: the kernels read any strides whose innermost (head-dim) stride is 1 and whose
  broadcast leading dims flatten to one batch stride (16-byte aligned rows for 16-bit
  types); anything else is copied to a contiguous array first (K/V broadcast over
  several leading dims are then materialised along those dims, never along heads).

Backward: :meth:`FusedAttention.backward` runs ``arrayattn/attention/cuda/backward.py`` (the
backward kernels) when that module exists and does not decline the call, else the
chunked array-API backward for large score matrices, else the composed one.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ..._backend import Array, is_cupy, library_name
from .. import chunked, composed
from ..composed import AUTO_CHUNK_BYTES
from ..dropout import dropout_threshold
from ..spec import AttentionSpec
from . import _bridge, _loader, decode, flex_table
from . import backward as kernels_backward
from .operands import (
    KINDS,
    compute_capability,
    device_index,
    is_block,
    kernel_diagonal,
    kernel_kind,
    lengths_operand,
    mask_operand,
    operand,
    per_head_operand,
)
from .tiles import ForwardLaunch, forward_launch, head_dim_bucket

__all__ = ["FusedAttention", "FUSED", "declines", "auto_declines"]

_GRID_YZ_MAX = 65535
_LOG2E = 1.0 / math.log(2.0)

POISON_OUTPUTS = False
"""Testing aid: when True, output buffers are filled with NaN before each launch, so a
row or column the kernel fails to write shows up in the result."""


def auto_declines(spec: AttentionSpec) -> str | None:
    """What ``implementation="auto"`` adds: nothing beyond :func:`declines`. CuPy arrays,
    PyTorch CUDA tensors (not recording gradients) and JAX GPU arrays (outside tracing)
    all run the kernels under ``"auto"``, the latter two through DLPack
    (``tests/kernels/test_fused_gpu.py`` checks the route on a GPU). Set
    ``ARRAYATTN_AUTO_DLPACK=0`` to keep PyTorch and JAX arrays on the array-API paths
    under ``"auto"``."""
    if is_cupy(spec.xp) or os.environ.get("ARRAYATTN_AUTO_DLPACK", "1") != "0":
        return None
    return f"{library_name(spec.xp)} arrays reach the fused kernels only when named"


def declines(spec: AttentionSpec) -> str | None:
    """``None`` when the fused forward kernel runs this call, else the reason it does not
    (used by ``implementation="auto"`` to fall back and by ``"fused"`` for its error)."""
    if not is_cupy(spec.xp):
        reason = _bridge.declines(spec)
        if reason is not None:
            return reason
    if spec.flex:  # (the array-API chunked path runs what the kernels decline)
        reason = _flex_declines(spec)
        if reason is not None:
            return reason
    kind = kernel_kind(spec)
    if kind is None:
        return f"no fused kernel for dtype {spec.dtype}; expected one of {KINDS}"
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
        cc = compute_capability(spec)
        if cc < 80:
            return (
                f"{kind} kernels need compute capability >= 8.0 (mma.sync bf16/f16, "
                f"cp.async, ldmatrix); this device has {cc / 10:.1f}"
            )
    if spec.block_mask is not None:
        launch = _launch(spec, kind, head_dim_bucket(spec.E, spec.Ev) or 0, spec.mask_kind)
        reason = flex_table.tiles_fit(spec.block_mask, launch.config.block_m, launch.config.block_n)
        if reason is not None:
            return f"block mask: {reason}"
    return None


def _flex_declines(spec: AttentionSpec) -> str | None:
    """Why the kernels do not run this ``arrayattn.flex`` call, or ``None``: they run a
    block mask (its mask_mod through the block table and the partial blocks' bits, see
    ``flex_table.py``), not a score_mod, not a mask_mod without a block mask (a plain
    function: built-ins get one from ``make_spec``), and only on CuPy arrays of a whole
    call."""
    if spec.score_mod is not None:
        return "score_mod is not in the CUDA kernels (the array-API paths run it)"
    if spec.block_mask is None:
        return (
            "a mask_mod function without a block mask: the kernels read a BlockMask's block "
            "table; pass block_mask=arrayattn.flex.create_block_mask(mask_mod, B, H, L, S, "
            "xp=cupy) (built once, reused across calls)"
        )
    if not is_cupy(spec.xp):
        return f"block masks reach the kernels from CuPy arrays only, not {library_name(spec.xp)}"
    if is_block(spec):
        return "a block mask in a block of a larger call (the Dask path's tasks)"
    return None


def _launch(spec: AttentionSpec, kind: str, d: int, mask_kind: Any) -> ForwardLaunch:
    """The forward kernel for the call (``tiles.forward_launch``); with a block mask whose
    block size v2's 128 x 64 tiles do not divide, v1's (when those do)."""
    dense = 0 if mask_kind is None else (1 if mask_kind == "bool" else 2)
    mk = dense | (flex_table.MASK_FLEX if spec.block_mask is not None else 0)
    args = (kind, d, spec.softcap is not None, spec.dropout_p > 0.0, mk,
            spec.alibi_slopes is not None, spec.scale)  # fmt: skip
    launch = forward_launch(*args)
    if (
        spec.block_mask is not None
        and launch.variant in ("v2", "v3")
        and flex_table.tiles_fit(spec.block_mask, launch.config.block_m, launch.config.block_n)
    ):
        launch = forward_launch(*args, variant="v1")
    return launch


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

        kind = kernel_kind(spec)
        d = head_dim_bucket(spec.E, spec.Ev)
        assert kind is not None and d is not None  # declines() refused the call otherwise
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

        if decode.declines(spec, attn_mask is not None) is None:  # (declines block masks)
            return decode.forward(spec, query, key, value, poison=POISON_OUTPUTS)

        dropout = spec.dropout_p > 0.0
        # ARRAYATTN_FWD_VARIANT (tiles.forward_variant): v3 unless v1/v2 is asked for or
        # it declines the call (tiles.v2_declines and tf32_declines list what stays on v1).
        launch = _launch(spec, kind, d, None if attn_mask is None else spec.mask_kind)
        cfg = launch.config
        # 16-byte row loads: the 16-bit kernels and aa_fwd_tf32 (v3 float32)
        aligned16 = kind in ("float16", "bfloat16") or launch.variant == "v3"
        # A block mask: its table on this device (built once, cached on the BlockMask).
        flex: Any = np.uint64(0)
        if spec.block_mask is not None:
            flex = flex_table.table(spec.block_mask, spec.xp, device_index(spec), spec.device)
        q, q_sb, q_sh, q_sr = operand(spec, query, d, aligned16)
        k, k_sb, k_sh, k_sr = operand(spec, key, d, aligned16)
        v, v_sb, v_sh, v_sr = operand(spec, value, d, aligned16)

        out = cupy.empty((B, Hq, L, d), dtype=q.dtype)
        lse = cupy.empty((B, Hq, L), dtype=lse_dtype)
        if POISON_OUTPUTS:
            out.fill(np.nan if out.dtype.kind == "f" else -1)  # -1: the bits of a bf16 NaN
            lse.fill(np.nan)
        null = np.uint64(0)
        mask_arr: Any = null
        m_st: list[Any] | tuple[int, ...] = (0, 0, 0, 0)  # (batch, head, row, col) strides
        if attn_mask is not None:
            mask_arr, *m_st = mask_operand(spec, attn_mask, acc)
        sinks = per_head_operand(spec, spec.sinks, acc)
        alibi = per_head_operand(spec, spec.alibi_slopes, acc)
        q_lens = lengths_operand(spec, "q_len_g")
        kv_lens = lengths_operand(spec, "kv_len_g")

        st = spec.structure
        diag = kernel_diagonal(spec)
        assert diag is not None  # declines() refused the call otherwise
        # a built-in mask_mod's predicate is compiled into the kernel (flex_table.prelude)
        prelude = "" if spec.block_mask is None else flex_table.prelude(spec.block_mask)
        kernel = _loader.get_kernel("attn_fwd.cu", launch.name, cfg.smem_bytes, prelude)

        i64 = np.int64
        cap = 1.0 if spec.softcap is None else spec.softcap
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
            np.uint32(spec.seed if dropout and spec.seed is not None else 0),
            np.uint32(dropout_threshold(spec.dropout_p) if dropout else 0),
            acc(1.0 / (1.0 - spec.dropout_p)),
            null if sinks is None else sinks,
            null if alibi is None else alibi,
            flex,
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
        """The backward kernels (``backward.py``) where they take the call, else the
        array-API backward on the saved LSE (chunked for large score matrices); PyTorch and
        JAX GPU arrays through the DLPack bridge (``_bridge.py``)."""
        args = (spec, query, key, value, attn_mask, out, lse, d_out, d_lse)
        if spec.flex:
            # Block masks reach the backward kernels unless opted out
            # (ARRAYATTN_FLEX_BWD_KERNELS=0, backward.flex_declines); else array-API backward.
            if kernels_backward.flex_kernels_enabled() and kernels_backward.declines(spec) is None:
                return kernels_backward.backward(*args)
            if chunked.score_matrix_bytes(spec) > AUTO_CHUNK_BYTES:
                return chunked.backward(*args)
            return composed.backward(*args)
        if not is_cupy(spec.xp):
            if _bridge.bridge_for(spec, query, key, value) is not None:  # PyTorch / JAX GPU
                return _bridge.backward(*args)
        if kernels_backward.declines(spec) is None:
            return kernels_backward.backward(*args)
        if chunked.score_matrix_bytes(spec) > AUTO_CHUNK_BYTES:
            return chunked.backward(*args)
        return composed.backward(*args)


FUSED = FusedAttention()
