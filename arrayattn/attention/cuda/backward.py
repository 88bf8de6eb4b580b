"""Fused attention backward on CuPy: the FlashAttention-2 kernels of ``attn_bwd.cu``.

``FusedAttention.backward`` (``fused.py``) calls :func:`backward` here when
:func:`declines` returns ``None``; otherwise the array-API backward runs (chunked for large
score matrices, else composed) from the same saved LSE. Three steps on the GPU:

1. ``aa_bwd_preprocess``: ``D = rowsum(dO * O) - dLSE`` and ``LSE * log2(e)`` per row
   (``+inf`` on empty rows, which makes every probability of the row 0).
2. ``aa_bwd_dkdv_*``: one thread block per (key block, KV head, batch) recomputes
   ``P = exp(S - LSE)`` tile by tile, keeps its dK/dV rows on chip while it loops over
   the query heads of its GQA group and the query blocks that can see its keys, and
   (default mode) adds ``dQ = dS K`` into a float32 accumulator with atomics, converted to
   the query dtype at the end.
3. Deterministic mode: ``aa_bwd_dq_*``, one block per (query block, query head, batch)
   that owns its dQ rows and visits key blocks in a fixed order, replaces the atomics.
   Every gradient is then bit-identical from run to run (the default mode's dQ is not:
   float atomics add in arrival order). It recomputes S and dP once more, so it costs
   about 7/5 of the default mode's matrix products.

**Deterministic mode** is a process-wide setting, like
``torch.use_deterministic_algorithms``: :func:`set_deterministic`, the context manager
:func:`deterministic`, or the environment variable ``ARRAYATTN_DETERMINISTIC=1`` at import.
:func:`backward` also takes ``deterministic=`` per call.

**Kernel variants** (``ARRAYATTN_BWD_VARIANT``, read at each call by :func:`bwd_variant`):
``v1`` the kernels described above; ``v2`` the same
tensor-core kernels with a cp.async pipeline (``aa_bwd_dkdv_mma2`` / ``aa_bwd_dq_mma2``:
Q/dO/LSE/D, or K/V for the deterministic dQ, double-buffered, one barrier per step opening
it, 64-row query steps run as register sub-steps). v2 covers float16/bfloat16 at the padded
head dims 64 and 128 with ``E`` and ``Ev`` multiples of 8 (16-byte copies), every option
included; anything else (float32/float64, head dims 32/96/256, ``E``/``Ev`` not multiples
of 8) runs v1's kernels under ``v2`` too (:func:`backward_plan` says which,
``BackwardPlan.variant``). ``v3`` (``attn_bwd_v3.cu``: ``aa_bwd_dkdv_mma3``) is v2 with the
warp's K/V MMA fragments held in registers across the whole query loop, 128-row query
steps (half the barriers) and a fully unrolled S/dP loop, at padded head dim 64 only (with
v2's deterministic dQ kernel); elsewhere ``v3`` runs v2's plan (or v1's). Its sums run in
v2's order: deterministic gradients are v2's bits. ``v4`` (``attn_bwd_v4.cu``:
``aa_bwd_dkdv_mma4``) tiles every product of the dK/dV kernel two-dimensionally over its 8
warps as FlashAttention-2's backward does (S^T/dP^T by (keys x queries) warp tiles, P^T and
dS^T through shared memory, dK/dV by 32-key warp slices, dQ by 32-row warp slices), at
padded head dims 64 and 128 (float16/bfloat16, ``E``/``Ev`` multiples of 8), every option
of v2, block masks included (its ``FLEX`` instantiation, see below), with v2's
deterministic dQ kernel; its dK/dV sums run in v2's order (deterministic gradients are
v2's bits; block masks run it only under an explicit ``ARRAYATTN_BWD_VARIANT=v4``:
on an H100 it ran them 0.81x v2's speed, see below); elsewhere ``v4`` runs
v2's plan (or v1's), as it does on a device whose blocks cannot have its 173-178 KB of
shared memory (pre-Hopper parts). Head dim 256 in float16/bfloat16 runs, under ``v4``,
``aa_bwd_dkdv_mma4`` at head dim 256 (64-key blocks, 64- or 32-row query steps) and v2's
deterministic dQ kernel on tensor cores (``E``/``Ev`` multiples of 8; block masks stay on
the CUDA cores); ``ARRAYATTN_BWD_D256_TC=0`` (:data:`D256_TC_ENV`) keeps the CUDA-core
kernels, which it replaced after an H100 measured it 9-18x faster. See
``bench/BACKWARD_KERNEL_NOTES.md``.

**What runs in the kernels** (:func:`declines` gives the reason for anything else): CuPy
arrays of float16 and bfloat16 (tensor cores, ``mma.sync`` m16n8k16, head dims up to 128;
CUDA cores with float32 accumulators at 256), float32 and float64 (CUDA cores), head dims
up to 256 (``E`` and ``Ev`` may differ; the tiles are zero-padded), both causal alignments,
windows, GQA/MQA, ``q_lengths``/``kv_lengths``, softcap, the seed-defined dropout
(regenerated, never stored), a dense boolean ``attn_mask`` of any broadcastable shape
(read through element strides, as the forward kernels read it), any broadcasting of the
leading dims (inputs are made contiguous; K/V broadcast over batch dims are reduced back
after the kernels), ALiBi slopes (the bias recomputed per element from indices), sinks
(already in the saved LSE; their gradient is a row reduction the caller does). A float
``attn_mask`` (additive bias) declines: its gradient is a
dense ``L x S`` array, which the array-API backward computes.

**Block masks** (``arrayattn.flex``; on by default since they ran on an H100 on
2026-11-26; ``ARRAYATTN_FLEX_BWD_KERNELS=0``, read at each call by
:func:`flex_kernels_enabled`, sends every flex call's backward to the array-API backward
instead): the
instantiations with a last template argument ``true`` (:func:`flex_plan`) read the block
table of ``flex_table.py`` (cached on the ``BlockMask``, shared with the forward): the dQ
kernel walks per query block the forward's list of non-empty key blocks, the dK/dV kernel
per key block the transposed list (the non-empty query blocks), and partial blocks' bits
are ANDed where the dense bool mask is. v4's dK/dV kernel (float16/bfloat16 at head dims 64
and 128; its partial blocks' bits a 32-key word per row through ``aa_bflex_word``, full
blocks on its plain path), v2's kernels and the CUDA-core kernels (float32/float64, and
16-bit at head dim 256) have them, deterministic mode included (v4 beside v2's FLEX dQ
kernel: v2 FLEX's bits); v3 runs v2's, v1's tensor-core kernels decline (the array-API
backward runs those calls). Which variant runs block masks: ``ARRAYATTN_BWD_VARIANT`` when
set (``=v2`` against ``=v4`` is the A/B), else :data:`FLEX_DEFAULT_VARIANT` (``v2``: v4's
FLEX kernel was prepared on the CPU and becomes the default only after a GPU
measurement). No score_mod (declined), and each kernel tile must lie inside one mask block
(``flex_table.backward_tiles_fit``); v4's query steps (128 rows at head dim 64) need a
larger ``Q_BLOCK`` than v2's (64), so a block mask that v4's tiles do not fit but v2's do
runs v2's FLEX kernels (:func:`flex_plan_for`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._backend import Array, is_cupy, library_name
from ..dropout import dropout_threshold
from ..spec import AttentionSpec
from . import _loader, flex_table
from .operands import (
    compute_capability,
    device_index,
    is_block,
    kernel_diagonal,
    kernel_kind,
    mask_operand,
    per_head_operand,
)
from .tiles import DIAG_FROM_LENGTHS, block_full, key_range

__all__ = [
    "backward",
    "declines",
    "run_kernels",
    "backward_plan",
    "BackwardPlan",
    "row_range",
    "dkdv_schedule",
    "dq_schedule",
    "set_deterministic",
    "is_deterministic",
    "deterministic",
    "COMPILE_VARIANTS",
    "HOT_VARIANTS",
    "kernel_file",
    "VARIANTS",
    "bwd_variant",
    "flex_plan",
    "flex_plan_for",
    "flex_bwd_variant",
    "FLEX_DEFAULT_VARIANT",
    "flex_declines",
    "flex_kernels_enabled",
    "FLEX_ENV",
    "D256_TC_ENV",
    "d256_tc_rows",
]

SOURCE = "attn_bwd.cu"
SOURCE_V3 = "attn_bwd_v3.cu"
"""v3's dK/dV kernel (``aa_bwd_dkdv_mma3``); it includes ``attn_bwd.cu``."""
SOURCE_V4 = "attn_bwd_v4.cu"
"""v4's dK/dV kernel (``aa_bwd_dkdv_mma4``); it includes ``attn_bwd.cu``."""
NULL = np.uint64(0)
"""A null pointer argument for the kernels (CuPy passes a numpy scalar by value)."""

_KIND_TYPES = {
    "float16": ("AaF16", "float"),
    "bfloat16": ("AaBF16", "float"),
    "float32": ("float", "float"),
    "float64": ("double", "double"),
}
_GRID_YZ_MAX = 65535
_SIMT_HEAD_DIMS = (32, 64, 128, 256)
_MMA_HEAD_DIMS = (32, 64, 96, 128)
VARIANTS = ("v1", "v2", "v3", "v4")
"""The backward kernel variants ``ARRAYATTN_BWD_VARIANT`` selects (``v4`` the default)."""

DEFAULT_VARIANT = "v4"
"""The kernels when ``ARRAYATTN_BWD_VARIANT`` is unset: ``v4``, since it ran on an NVIDIA
H100 (2026-11-26, 14:23 UTC) correct in every v4 GPU backward test (36: gradients against
float64, deterministic mode bit-identical, dK/dV equal to v2's bits), under
compute-sanitizer's memcheck and racecheck, and through ``arrayattn.torch`` on CUDA
tensors (28 gradient tests), at 2.3-3.0x v2's speed (float16, L = 4096, non-deterministic
dQ: 185-231 TFLOP/s against 72-119; 0.78-0.85x PyTorch's flash backend). v4 runs v2's
plan where it does not serve a call (block masks, devices without its shared memory,
other dtypes and head dims). v2 became the default after an NVIDIA H200 run (08:31 UTC,
1.22-1.66x v1)."""
_V2_HEAD_DIMS = (64, 128)
_V3_HEAD_DIMS = (64,)
_V4_HEAD_DIMS = (64, 128)
_V4_TILES = {64: (128, 128, 4, 32), 128: (64, 128, 4, 16)}
"""v4's ``aa_bwd_dkdv_mma4`` tiles per head dim: (query rows per step BM, keys per block BN,
warps along the keys of S^T WK, register sub-step of each warp's queries TQS); the largest
that compile without spills on sm_90 (D = 64: 248 registers, D = 128: 255)."""

_V4_D256_TILES = {64: (64, 64, 4, 16), 32: (32, 64, 4, 16)}
"""v4's ``aa_bwd_dkdv_mma4`` tiles at padded head dim 256 (16-bit; :data:`D256_TC_ENV`),
keyed by the query rows per step BM: (BM, BN, WK, TQS) as :data:`_V4_TILES`. 64 keys per
block (each warp's 32-key x 64-dim slices of dK and dV: 128 accumulator registers, as v4 at
D = 128). sm_90: BM = 64 255 registers and 222208 bytes of shared memory, BM = 32 236 and
145920; no spill, one block (8 warps) per SM either way."""
_D256_DQ_TILES = (4, 32)
"""v2's deterministic ``aa_bwd_dq_mma2`` at head dim 256: (warps, keys per step); 64 query
rows per block, 242 registers on sm_90, no spill."""

D256_TC_ENV = "ARRAYATTN_BWD_D256_TC"
"""Tensor cores for the float16/bfloat16 backward at padded head dim 256 (``E``, ``Ev`` in
(128, 256], multiples of 8) under variant ``v4``: ``1`` or ``64`` (64-row query steps; also
unset or empty, the default since the H100 run of 2026-11-26, 17:02 UTC: backward 0.77-0.83x
PyTorch's flash backend at L = 2048, 9-18x the CUDA-core kernels) or ``32`` (32-row steps)
run ``aa_bwd_dkdv_mma4`` there (and v2's ``aa_bwd_dq_mma2`` in deterministic mode); ``0``
keeps the CUDA-core kernels. Read at each call."""


def d256_tc_rows() -> int | None:
    """The query rows per step :data:`D256_TC_ENV` asks for at head dim 256 (64 or 32), or
    ``None`` (``0``: the CUDA-core kernels); ``ValueError`` for any other value.

    Examples:
        >>> d256_tc_rows() in (None, 32, 64)
        True
    """
    raw = os.environ.get(D256_TC_ENV, "").strip()
    if raw == "0":
        return None
    if raw in ("", "1", "64", "32"):
        return 32 if raw == "32" else 64
    raise ValueError(f"{D256_TC_ENV} must be 0, 1, 64 or 32, got {raw!r}")


_DETERMINISTIC: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "arrayattn_deterministic",
    default=os.environ.get("ARRAYATTN_DETERMINISTIC", "").strip().lower() in ("1", "true", "yes"),
)


# -- the deterministic setting ----------------------------------------------------------------
def set_deterministic(flag: bool) -> None:
    """Make the fused backward bit-reproducible (``True``) or use dQ atomics (``False``,
    the default; faster). Applies to the current context (thread / task).

    Examples:
        >>> from arrayattn.attention.cuda import backward
        >>> backward.set_deterministic(True); backward.is_deterministic()
        True
        >>> backward.set_deterministic(False)
    """
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {type(flag).__name__}")
    _DETERMINISTIC.set(flag)


def is_deterministic() -> bool:
    """The current deterministic setting (see :func:`set_deterministic`)."""
    return _DETERMINISTIC.get()


@contextlib.contextmanager
def deterministic(flag: bool = True) -> Iterator[None]:
    """Context manager: the fused backward inside the block runs deterministic (or not).

    Examples:
        >>> from arrayattn.attention.cuda import backward
        >>> with backward.deterministic():
        ...     backward.is_deterministic()
        True
    """
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {type(flag).__name__}")
    token = _DETERMINISTIC.set(flag)
    try:
        yield
    finally:
        _DETERMINISTIC.reset(token)


# -- kernel variants and launch shapes ----------------------------------------------------------
def bwd_variant(default: str = DEFAULT_VARIANT) -> str:
    """The backward kernel variant ``ARRAYATTN_BWD_VARIANT`` names (``default``,
    :data:`DEFAULT_VARIANT` unless given, when unset or empty), read at each call so a
    benchmark can switch it between runs.

    Raises ``ValueError`` for any other value.

    Examples:
        >>> bwd_variant() in VARIANTS  # "v4" unless the environment names another
        True
    """
    raw = os.environ.get("ARRAYATTN_BWD_VARIANT", "").strip().lower() or default
    if raw not in VARIANTS:
        raise ValueError(f"ARRAYATTN_BWD_VARIANT must be one of {VARIANTS}, got {raw!r}")
    return raw


FLEX_DEFAULT_VARIANT = "v2"
"""The block-mask backward's variant when ``ARRAYATTN_BWD_VARIANT`` is unset: ``v2``'s FLEX
kernels, which ran on an H100, until v4's FLEX dK/dV kernel (prepared on the CPU,
2026-11-26) has been measured on a GPU; ``ARRAYATTN_BWD_VARIANT=v4`` selects it (the A/B:
``=v2`` against ``=v4``, ``bench/gpu_first_contact.sh``'s ``ab_flex`` stage)."""


def flex_bwd_variant() -> str:
    """The variant :func:`flex_plan` runs block masks with when given none:
    ``ARRAYATTN_BWD_VARIANT``, else :data:`FLEX_DEFAULT_VARIANT` (read at each call)."""
    return bwd_variant(FLEX_DEFAULT_VARIANT)


@dataclass(frozen=True)
class BackwardPlan:
    """The kernels and launch shapes of one backward: which instantiations run, their
    threads per block, tile sizes and dynamic shared memory (bytes)."""

    kind: str
    head_dim: int  # the kernels' padded head dim (>= E and Ev)
    tensor_cores: bool
    preprocess: str
    dkdv: str
    dkdv_threads: int
    dkdv_block_n: int  # keys per dK/dV thread block
    dkdv_block_m: int  # query rows per step of that block
    dkdv_smem: int
    dq: str
    dq_threads: int
    dq_block_m: int  # query rows per dQ thread block (deterministic mode)
    dq_block_n: int  # keys per step of that block
    dq_smem: int
    convert: str | None  # dQ accumulator -> query dtype (None: float32/float64 in place)
    variant: str = "v1"  # the kernels' variant (v2/v3 asked for may give an older plan)


def _bucket(need: int, dims: Sequence[int]) -> int | None:
    for d in dims:
        if need <= d:
            return d
    return None


def _simt_tiles(kind: str, d: int) -> tuple[int, int]:
    """(keys per block BN, query rows per step BM) of the CUDA-core kernels (256 threads)."""
    if kind == "float64":
        if d <= 64:
            return 64, 32
        return (32, 32) if d == 128 else (16, 16)
    return (64, 32) if d <= 128 else (32, 32)


def _mma4_smem(d: int, bm: int, bn: int) -> int:
    """``AaBwdMma4Smem``: K, V; two stages of Q, dO; P^T, dS^T; two stages of lse2, delta."""
    pitch = d + 8
    return (2 * bn * pitch + 4 * bm * pitch + 2 * bn * (bm + 8)) * 2 + 4 * bm * 4


def _dq_mma2(t: str, d: int, qnw: int, qbn: int) -> dict[str, Any]:
    """v2's ``aa_bwd_dq_mma2`` fields of a plan: ``qnw`` warps (16 query rows each),
    ``qbn`` keys per step; shared memory ``AaBwdDqMma2Smem`` (Q, dO; two stages of K, V;
    lse2, delta)."""
    qbm, pitch = 16 * qnw, d + 8
    return dict(
        dq=f"aa_bwd_dq_mma2<{t}, {d}, {qnw}, {qbn}>",
        dq_threads=32 * qnw,
        dq_block_m=qbm,
        dq_block_n=qbn,
        dq_smem=(2 * qbm * pitch + 4 * qbn * pitch) * 2 + 2 * qbm * 4,
    )


def _plan_v2(kind: str, d: int) -> BackwardPlan:
    """The v2 tensor-core plan (``aa_bwd_dkdv_mma2`` / ``aa_bwd_dq_mma2``) at padded head
    dim ``d`` (64 or 128)."""
    t, _ = _KIND_TYPES[kind]
    # dK/dV: 8 warps, 128 keys, query steps of 64 rows (one pipeline stage and barrier)
    # run as register sub-steps of BMS rows: D = 128 holds 16 rows at a time next to its
    # 128 accumulator registers (254 registers, no spill), D = 64 all 64 (252).
    nw, bm, bms = {64: (8, 64, 64), 128: (8, 64, 16)}[d]
    qnw, qbn = {64: (4, 64), 128: (4, 32)}[d]  # deterministic dQ: v1's tiles
    bn, pitch = 16 * nw, d + 8
    return BackwardPlan(
        kind=kind,
        head_dim=d,
        tensor_cores=True,
        preprocess=f"aa_bwd_preprocess<{t}, float>",
        dkdv=f"aa_bwd_dkdv_mma2<{t}, {d}, {nw}, {bm}, {bms}>",
        dkdv_threads=32 * nw,
        dkdv_block_n=bn,
        dkdv_block_m=bm,
        # K, V; two stages of Q, dO; dS^T; two stages of lse2, delta (AaBwdMma2Smem)
        dkdv_smem=(2 * bn * pitch + 4 * bm * pitch + bn * (bm + 8)) * 2 + 4 * bm * 4,
        convert=f"aa_bwd_convert<{t}, float>",
        variant="v2",
        **_dq_mma2(t, d, qnw, qbn),
    )


def _plan_v3(kind: str, d: int) -> BackwardPlan:
    """The v3 plan at padded head dim ``d`` (64): ``aa_bwd_dkdv_mma3`` (the warp's K/V
    fragments in registers for the whole block, 128-row query steps as 32-row register
    sub-steps) and v2's deterministic dQ kernel."""
    t, _ = _KIND_TYPES[kind]
    nw, bm, bms = {64: (8, 128, 32)}[d]
    bn, pitch = 16 * nw, d + 8
    return dataclasses.replace(
        _plan_v2(kind, d),
        dkdv=f"aa_bwd_dkdv_mma3<{t}, {d}, {nw}, {bm}, {bms}>",
        dkdv_threads=32 * nw,
        dkdv_block_n=bn,
        dkdv_block_m=bm,
        # v2's layout (AaBwdMma2Smem) at BM = 128: K, V; two stages of Q, dO; dS^T; stats
        dkdv_smem=(2 * bn * pitch + 4 * bm * pitch + bn * (bm + 8)) * 2 + 4 * bm * 4,
        variant="v3",
    )


def _plan_v4(kind: str, d: int) -> BackwardPlan:
    """The v4 plan at padded head dim ``d`` (64 or 128): ``aa_bwd_dkdv_mma4`` (FA2's warp
    tiling, P^T/dS^T through shared memory) and v2's deterministic dQ kernel."""
    t, _ = _KIND_TYPES[kind]
    bm, bn, wk, tqs = _V4_TILES[d]
    return dataclasses.replace(
        _plan_v2(kind, d),
        dkdv=f"aa_bwd_dkdv_mma4<{t}, {d}, {bm}, {bn}, {wk}, {tqs}>",
        dkdv_threads=256,
        dkdv_block_n=bn,
        dkdv_block_m=bm,
        dkdv_smem=_mma4_smem(d, bm, bn),
        variant="v4",
    )


def _plan_v4_d256(kind: str, bm: int) -> BackwardPlan:
    """The tensor-core plan at padded head dim 256 (:data:`D256_TC_ENV`): v4's
    ``aa_bwd_dkdv_mma4`` with BM-row query steps over 64-key blocks (:data:`_V4_D256_TILES`)
    and v2's deterministic ``aa_bwd_dq_mma2`` (:data:`_D256_DQ_TILES`)."""
    t, _ = _KIND_TYPES[kind]
    d = 256
    bm, bn, wk, tqs = _V4_D256_TILES[bm]
    return BackwardPlan(
        kind=kind,
        head_dim=d,
        tensor_cores=True,
        preprocess=f"aa_bwd_preprocess<{t}, float>",
        dkdv=f"aa_bwd_dkdv_mma4<{t}, {d}, {bm}, {bn}, {wk}, {tqs}>",
        dkdv_threads=256,
        dkdv_block_n=bn,
        dkdv_block_m=bm,
        dkdv_smem=_mma4_smem(d, bm, bn),
        convert=f"aa_bwd_convert<{t}, float>",
        variant="v4",
        **_dq_mma2(t, d, *_D256_DQ_TILES),
    )


def backward_plan(kind: str, e: int, ev: int, variant: str | None = None) -> BackwardPlan | None:
    """The backward kernels for dtype ``kind`` and head dims ``e`` (query/key) and ``ev``
    (value), or ``None`` when no variant holds them (both above 256). ``variant``
    (``"v1"``/``"v2"``/``"v3"``/``"v4"``; ``None``: :func:`bwd_variant`, the environment) picks the
    kernels; ``"v2"`` gives v1's plan where v2 has no kernels (see the module docstring),
    ``"v3"`` gives v2's plan (or v1's) where v3 has none (it has head dim 64 only), ``"v4"``
    likewise (it has head dims 64 and 128).

    Examples:
        >>> p = backward_plan("float16", 128, 128, variant="v1")
        >>> p.dkdv, p.dkdv_block_n, p.dq
        ('aa_bwd_dkdv_mma<AaF16, 128, 8, 16>', 128, 'aa_bwd_dq_mma<AaF16, 128, 4, 32>')
        >>> backward_plan("float16", 128, 128, variant="v2").dkdv
        'aa_bwd_dkdv_mma2<AaF16, 128, 8, 64, 16>'
        >>> backward_plan("float16", 96, 96, variant="v2").variant
        'v1'
        >>> backward_plan("float16", 64, 64, variant="v3").dkdv
        'aa_bwd_dkdv_mma3<AaF16, 64, 8, 128, 32>'
        >>> backward_plan("float16", 128, 128, variant="v3").variant
        'v2'
        >>> backward_plan("float16", 128, 128, variant="v4").dkdv
        'aa_bwd_dkdv_mma4<AaF16, 128, 64, 128, 4, 16>'
    """
    if kind not in _KIND_TYPES:
        raise ValueError(f"kind must be one of {tuple(_KIND_TYPES)}, got {kind!r}")
    if variant is None:
        variant = bwd_variant()
    elif variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    t, acc = _KIND_TYPES[kind]
    need = max(e, ev, 1)
    pre = f"aa_bwd_preprocess<{t}, {acc}>"
    if kind in ("float16", "bfloat16"):
        d = _bucket(need, _MMA_HEAD_DIMS)
        # v2 and v3 copy rows in 16-byte pieces: E and Ev multiples of 8 (else v1 below).
        # v3 has head dim 64 only; elsewhere it declines to v2's kernels (then v1's).
        aligned = e % 8 == 0 and ev % 8 == 0
        if variant == "v3" and d in _V3_HEAD_DIMS and aligned:
            return _plan_v3(kind, d)
        if variant == "v4" and d in _V4_HEAD_DIMS and aligned:
            return _plan_v4(kind, d)
        if variant in ("v2", "v3", "v4") and d in _V2_HEAD_DIMS and aligned:
            return _plan_v2(kind, d)
        # Head dim 256 on tensor cores under v4 unless ARRAYATTN_BWD_D256_TC=0;
        # otherwise the CUDA-core kernels below.
        if variant == "v4" and d is None and need <= 256 and aligned:
            rows = d256_tc_rows()
            if rows is not None:
                return _plan_v4_d256(kind, rows)
        if d is not None:
            # (warps, query rows per step): the largest tiles that compile without
            # register spills on sm_90 (D=96 spills 8 bytes; .ci/compile_kernels.py).
            nw, bm = {32: (4, 64), 64: (8, 32), 96: (6, 16), 128: (8, 16)}[d]
            qnw, qbn = {32: (4, 64), 64: (4, 64), 96: (4, 64), 128: (4, 32)}[d]
            bn, qbm, pitch = 16 * nw, 16 * qnw, d + 8
            return BackwardPlan(
                kind=kind,
                head_dim=d,
                tensor_cores=True,
                preprocess=pre,
                dkdv=f"aa_bwd_dkdv_mma<{t}, {d}, {nw}, {bm}>",
                dkdv_threads=32 * nw,
                dkdv_block_n=bn,
                dkdv_block_m=bm,
                dkdv_smem=(2 * bn * pitch + 2 * bm * pitch + bn * (bm + 8)) * 2 + 2 * bm * 4,
                dq=f"aa_bwd_dq_mma<{t}, {d}, {qnw}, {qbn}>",
                dq_threads=32 * qnw,
                dq_block_m=qbm,
                dq_block_n=qbn,
                dq_smem=(2 * qbm * pitch + 2 * qbn * pitch) * 2 + 2 * qbm * 4,
                convert=f"aa_bwd_convert<{t}, float>",
            )
    d = _bucket(need, _SIMT_HEAD_DIMS)
    if d is None:
        return None
    bn, bm = _simt_tiles(kind, d)
    size = 8 if kind == "float64" else 4
    smem = (2 * bn * (d + 1) + 2 * bm * (d + 1) + 2 * bm * (bn + 1) + 2 * bm) * size
    tail = f"{t}, {acc}, {d}, {bn}, {bm}, 256"
    return BackwardPlan(
        kind=kind,
        head_dim=d,
        tensor_cores=False,
        preprocess=pre,
        dkdv=f"aa_bwd_dkdv_simt<{tail}>",
        dkdv_threads=256,
        dkdv_block_n=bn,
        dkdv_block_m=bm,
        dkdv_smem=smem,
        dq=f"aa_bwd_dq_simt<{tail}>",
        dq_threads=256,
        dq_block_m=bm,
        dq_block_n=bn,
        dq_smem=smem,
        convert=None if kind in ("float32", "float64") else f"aa_bwd_convert<{t}, float>",
    )


FLEX_ENV = "ARRAYATTN_FLEX_BWD_KERNELS"
"""The environment variable that lets block-mask calls reach the backward kernels."""


def flex_kernels_enabled() -> bool:
    """Whether block-mask backwards may run in the kernels (:func:`flex_plan`): yes unless
    ``ARRAYATTN_FLEX_BWD_KERNELS`` is ``0``/``false``/``no`` (read at each call; the opt-out
    sends them to the array-API backward, as before they had run on a GPU)."""
    return os.environ.get(FLEX_ENV, "").strip().lower() not in ("0", "false", "no")


def _flexed(name: str) -> str:
    return name[:-1] + ", true>"


def flex_plan(kind: str, e: int, ev: int, variant: str | None = None) -> BackwardPlan | None:
    """The block-mask plan: :func:`backward_plan`'s with the dK/dV and dQ kernels' ``FLEX``
    instantiations (v3 gives v2's; v4's dK/dV kernel beside v2's dQ kernel; v1's tensor-core
    kernels have none: v2's where v2 holds the call, else ``None``). ``variant`` ``None``:
    :func:`flex_bwd_variant` (``ARRAYATTN_BWD_VARIANT``, else v2's until v4's FLEX kernel
    has run on a GPU).

    Examples:
        >>> flex_plan("float16", 64, 64, variant="v3").dkdv
        'aa_bwd_dkdv_mma2<AaF16, 64, 8, 64, 64, true>'
        >>> p = flex_plan("float16", 128, 128, variant="v4")
        >>> p.dkdv
        'aa_bwd_dkdv_mma4<AaF16, 128, 64, 128, 4, 16, true>'
        >>> p.dq
        'aa_bwd_dq_mma2<AaF16, 128, 4, 32, true>'
        >>> flex_plan("float32", 64, 64).dq
        'aa_bwd_dq_simt<float, float, 64, 64, 32, 256, true>'
        >>> flex_plan("float16", 96, 96) is None
        True
    """
    plan = backward_plan(kind, e, ev, flex_bwd_variant() if variant is None else variant)
    if plan is None:
        return None
    v4_flexed = plan.variant == "v4" and plan.head_dim in _V4_HEAD_DIMS  # (not D = 256)
    if plan.variant == "v3" or (plan.variant == "v4" and not v4_flexed) or (
        plan.tensor_cores and plan.variant == "v1"
    ):
        plan = backward_plan(kind, e, ev, "v2")
        if plan is None or (plan.tensor_cores and plan.variant != "v2"):
            return None
    return dataclasses.replace(plan, dkdv=_flexed(plan.dkdv), dq=_flexed(plan.dq))


def _flex_tiles(plan: BackwardPlan) -> tuple[tuple[int, int], ...]:
    """The (query rows, keys) tiles of ``plan`` that must lie inside one mask block."""
    return ((plan.dkdv_block_m, plan.dkdv_block_n), (plan.dq_block_m, plan.dq_block_n))


def flex_plan_for(
    kind: str, e: int, ev: int, bm: Any, variant: str | None = None
) -> tuple[BackwardPlan | None, str | None]:
    """``(plan, None)``: the :func:`flex_plan` that runs block mask ``bm`` (v4's, or v2's
    where v4's larger query steps do not fit ``bm``'s blocks but v2's do), else
    ``(None, why not)``."""
    plan = flex_plan(kind, e, ev, variant)
    if plan is None:
        return None, (
            f"block masks: no backward kernel reads them at {kind} E={e}, Ev={ev} "
            "(v4's or v2's at head dims 64/128 with E, Ev multiples of 8, or the CUDA-core "
            "kernels)"
        )
    reason = flex_table.backward_tiles_fit(bm, _flex_tiles(plan))
    if reason is not None and plan.variant == "v4":
        v2 = flex_plan(kind, e, ev, "v2")
        if v2 is not None and flex_table.backward_tiles_fit(bm, _flex_tiles(v2)) is None:
            return v2, None
    return (None, f"block mask: {reason}") if reason is not None else (plan, None)


def _all_plans() -> list[BackwardPlan]:
    """v1's plans at every bucket, then v2's own (its instantiations only: the 16-bit kinds
    at head dims 64 and 128)."""
    plans = []
    for kind in _KIND_TYPES:
        dims = _MMA_HEAD_DIMS + (256,) if kind in ("float16", "bfloat16") else _SIMT_HEAD_DIMS
        for d in dims:
            plan = backward_plan(kind, d, d, variant="v1")
            if plan is not None:
                plans.append(plan)
    for kind in ("float16", "bfloat16"):
        for d in _V2_HEAD_DIMS:
            plans.append(_plan_v2(kind, d))
        for d in _V3_HEAD_DIMS:
            plans.append(_plan_v3(kind, d))
        for d in _V4_HEAD_DIMS:
            plans.append(_plan_v4(kind, d))
        for bm in _V4_D256_TILES:  # head dim 256 (ARRAYATTN_BWD_D256_TC)
            plans.append(_plan_v4_d256(kind, bm))
    # block masks: the FLEX instantiations of the CUDA-core, v2 and v4 kernels
    for kind in _KIND_TYPES:
        for d in _SIMT_HEAD_DIMS:
            plan = flex_plan(kind, d, d, variant="v2")
            if plan is not None:
                plans.append(plan)
    for kind in ("float16", "bfloat16"):
        for d in _V4_HEAD_DIMS:
            plans.append(flex_plan(kind, d, d, variant="v4"))  # type: ignore[arg-type]
    return plans


def kernel_file(name: str) -> str:
    """The ``.cu`` file that defines the instantiation ``name`` (``attn_bwd_v3.cu`` for v3's
    dK/dV kernel, ``attn_bwd_v4.cu`` for v4's, else ``attn_bwd.cu``).

    Examples:
        >>> kernel_file("aa_bwd_dkdv_mma3<AaF16, 64, 8, 128, 32>")
        'attn_bwd_v3.cu'
        >>> kernel_file("aa_bwd_dq_mma2<AaF16, 64, 4, 64>")
        'attn_bwd.cu'
        >>> kernel_file("aa_bwd_dkdv_mma4<AaF16, 128, 64, 128, 4, 16>")
        'attn_bwd_v4.cu'
    """
    if name.startswith("aa_bwd_dkdv_mma3<"):
        return SOURCE_V3
    return SOURCE_V4 if name.startswith("aa_bwd_dkdv_mma4<") else SOURCE


def _variant_names() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {SOURCE: [], SOURCE_V3: [], SOURCE_V4: []}
    for plan in _all_plans():
        for name in (plan.preprocess, plan.dkdv, plan.dq, plan.convert):
            if name is not None and name not in names[kernel_file(name)]:
                names[kernel_file(name)].append(name)
    return names


COMPILE_VARIANTS: dict[str, list[str]] = _variant_names()
"""Every backward instantiation, for ``.ci/compile_kernels.py`` (and the CPU emulator)."""

HOT_VARIANTS: list[str] = list(
    dict.fromkeys(
        name
        for variant in VARIANTS
        for kind in ("float16", "bfloat16")
        for d in (64, 128)
        for name in (
            backward_plan(kind, d, d, variant).dkdv,  # type: ignore[union-attr]
            backward_plan(kind, d, d, variant).dq,  # type: ignore[union-attr]
            flex_plan(kind, d, d, variant).dkdv,  # type: ignore[union-attr]
        )
    )
) + list(
    dict.fromkeys(
        name
        for kind in ("float16", "bfloat16")
        for bm in _V4_D256_TILES
        for name in (_plan_v4_d256(kind, bm).dkdv, _plan_v4_d256(kind, bm).dq)
    )
)
"""The variants the compile check fails on when they spill: float16/bfloat16 at D = 64, 128,
of every variant, their block-mask (FLEX) dK/dV kernels, and the tensor-core kernels
at D = 256."""


# -- the block schedule, mirrored from attn_bwd.cu for the host and the CPU tests -----------------
def row_range(c0: int, c1: int, offset: int, left: int, right: int, q_len: int) -> tuple[int, int]:
    """``aa_row_range``: the half-open range of query rows that may see some key of
    ``[c0, c1)`` (the inverse of ``tiles.key_range``); empty as ``lo >= hi``."""
    if c1 <= c0:
        return 0, 0
    lo, hi = 0, q_len
    if right >= 0:
        lo = max(0, c0 - offset - right)
    if left >= 0:
        hi = min(q_len, c1 - 1 - offset + left + 1)
    return lo, max(lo, hi)


def dkdv_schedule(
    c0: int,
    block_n: int,
    block_m: int,
    q_len: int,
    kv_len: int,
    offset: int,
    left: int,
    right: int,
) -> list[tuple[int, bool]]:
    """The query blocks ``(m0, full)`` the dK/dV kernel visits (for each query head of the
    group, in this order) for the key block starting at ``c0``; ``full`` means the element
    mask is skipped. Mirrors the loop of ``aa_bwd_dkdv_*``."""
    lo, hi = row_range(c0, min(c0 + block_n, kv_len), offset, left, right, q_len)
    return [
        (m0, block_full(m0, m0 + block_m, c0, c0 + block_n, offset, left, right, kv_len))
        for m0 in range((lo // block_m) * block_m if hi > lo else hi, hi, block_m)
    ]


def dq_schedule(
    m0: int,
    block_m: int,
    block_n: int,
    q_len: int,
    kv_len: int,
    offset: int,
    left: int,
    right: int,
) -> list[tuple[int, bool]]:
    """The key blocks ``(c0, full)`` the deterministic dQ kernel visits, in order, for the
    query block starting at ``m0``. Mirrors the loop of ``aa_bwd_dq_*``."""
    lo, hi = key_range(m0, min(m0 + block_m, q_len), offset, left, right, kv_len)
    return [
        (c0, block_full(m0, m0 + block_m, c0, c0 + block_n, offset, left, right, kv_len))
        for c0 in range((lo // block_n) * block_n if hi > lo else hi, hi, block_n)
    ]


# -- running the kernels (any launcher: CuPy, or the CPU emulator in the tests) ----------------
Launch = Callable[[str, tuple[int, int, int], int, int, tuple[Any, ...]], None]
"""``launch(name, grid, threads, smem_bytes, args)`` runs one kernel instantiation."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run_kernels(
    xp: Any,
    launch: Launch,
    plan: BackwardPlan,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    d_out: Array,
    lse: Array,
    d_lse: Array | None,
    *,
    scale: float,
    softcap: float | None = None,
    bottom_right: bool = False,
    diagonal: int | None = None,
    window: tuple[int, int] = (-1, -1),
    q_lens: Array | None = None,
    kv_lens: Array | None = None,
    seed: int = 0,
    dropout_p: float = 0.0,
    mask: Array | None = None,
    mask_strides: tuple[int, int, int, int] = (0, 0, 0, 0),
    deterministic: bool = False,
    alibi: Array | None = None,
    flex: Array | None = None,
) -> tuple[Array, Array, Array]:
    """The backward on contiguous arrays: ``q (B, Hq, L, E)``, ``k (B, Hkv, S, E)``,
    ``v (B, Hkv, S, Ev)``, ``out``/``d_out (B, Hq, L, Ev)`` in the kernel dtype,
    ``diagonal`` the kernels' ``diag`` (``fused.kernel_diagonal``; default: per-sequence
    ``kv_len - q_len`` when ``bottom_right``, else 0),
    ``lse``/``d_lse (B, Hq, L)`` float32 (float64 for float64); ``q_lens``/``kv_lens``
    int32 ``(B,)`` or ``None``. Returns contiguous ``(dq, dk, dv)`` of q's, k's and v's
    shapes and dtype. ``xp`` allocates the buffers (CuPy, or NumPy under the emulator);
    ``launch`` runs each kernel. ``window`` is ``(left, right)`` with ``-1`` unbounded and
    the causal bound already folded in (``Structure``). ``mask`` is a boolean attn_mask
    as uint8 (nonzero = takes part) read at ``b * s0 + h * s1 + i * s2 + j * s3`` for the
    element strides ``mask_strides`` (0 on broadcast dims). ``alibi`` holds ALiBi slopes,
    contiguous ``(B * Hq,)`` in the accumulation dtype, or ``None``. Sinks need no
    argument: ``lse`` includes them. ``flex``: a block mask's table (``flex_table.build``)
    for a :func:`flex_plan` plan, else ``None``.
    """
    B, Hq, L, E = (int(s) for s in q.shape)
    Hkv, S, Ev = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    f64 = plan.kind == "float64"
    acc_np = np.float64 if f64 else np.float32
    acc = xp.float64 if f64 else xp.float32
    i32, u32 = np.int32, np.uint32

    rows = B * Hq * L
    delta = xp.empty((B, Hq, L), dtype=acc)
    lse2 = xp.empty((B, Hq, L), dtype=acc)
    launch(
        plan.preprocess,
        (_cdiv(rows, 8), 1, 1),
        256,
        0,
        (out, d_out, lse, NULL if d_lse is None else d_lse, delta, lse2, np.int64(rows), i32(Ev)),
    )

    dropout = dropout_p > 0.0
    if diagonal is None:
        diag = DIAG_FROM_LENGTHS if bottom_right else 0
    else:
        diag = int(diagonal)
    common = (
        q, k, v, d_out, lse2, delta,
        i32(Hq), i32(Hkv), i32(L), i32(S), i32(E), i32(Ev),
        acc_np(scale), acc_np(0.0 if softcap is None else softcap),
        i32(diag), i32(window[0]), i32(window[1]),
        NULL if q_lens is None else q_lens, NULL if kv_lens is None else kv_lens,
        u32(seed if dropout else 0), u32(dropout_threshold(dropout_p) if dropout else 0),
        acc_np(1.0 / (1.0 - dropout_p)),
        NULL if mask is None else mask, *(np.int64(st) for st in mask_strides),
        NULL if alibi is None else alibi,
        NULL if flex is None else flex,
    )  # fmt: skip
    dk = xp.empty((B, Hkv, S, E), dtype=q.dtype)
    dv = xp.empty((B, Hkv, S, Ev), dtype=q.dtype)
    grid_kv = (_cdiv(S, plan.dkdv_block_n), Hkv, B)
    if deterministic:
        launch(plan.dkdv, grid_kv, plan.dkdv_threads, plan.dkdv_smem, common + (dk, dv, NULL))
        dq = xp.empty((B, Hq, L, E), dtype=q.dtype)
        grid_q = (_cdiv(L, plan.dq_block_m), Hq, B)
        launch(plan.dq, grid_q, plan.dq_threads, plan.dq_smem, common + (dq,))
        return dq, dk, dv
    dq_acc = xp.zeros((B, Hq, L, E), dtype=acc)
    launch(plan.dkdv, grid_kv, plan.dkdv_threads, plan.dkdv_smem, common + (dk, dv, dq_acc))
    if plan.convert is None:
        return dq_acc, dk, dv
    dq = xp.empty((B, Hq, L, E), dtype=q.dtype)
    n = B * Hq * L * E
    launch(plan.convert, (_cdiv(n, 256), 1, 1), 256, 0, (dq_acc, dq, np.int64(n)))
    return dq, dk, dv


# -- the implementation hook ----------------------------------------------------------------------
def declines(spec: AttentionSpec) -> str | None:
    """``None`` when the backward kernels run this call, else why not (the caller then
    uses the array-API backward on the same saved LSE)."""
    if not is_cupy(spec.xp):
        return f"the backward kernels need CuPy arrays, got {library_name(spec.xp)}"
    kind = kernel_kind(spec)
    if kind is None:
        return f"dtype {spec.dtype} is not float16, bfloat16, float32 or float64"
    if backward_plan(kind, spec.E, spec.Ev, variant="v1") is None:
        return f"head dims E={spec.E}, Ev={spec.Ev} exceed 256"
    if spec.mask_kind == "float":
        return "a float attn_mask (bias) needs its dense gradient: the array-API backward"
    if spec.batch_size > _GRID_YZ_MAX or spec.Hq > _GRID_YZ_MAX:
        return f"batch {spec.batch_size} or heads {spec.Hq} above the grid limit {_GRID_YZ_MAX}"
    if spec.dropout_p > 0 and (spec.batch_ids or spec.head0 or spec.row0 or spec.col0):
        return "the kernels hash dropout at local positions; this is a block of a larger call"
    if kernel_diagonal(spec) is None:
        return "this block's per-sequence diagonal offsets are not its kv_len - q_len"
    if spec.flex:
        reason = flex_declines(spec)
        if reason is not None:
            return reason
    if kind in ("float16", "bfloat16"):
        # CuPy gives "90", "100", ...: the whole string is the number (major * 10 + minor)
        cc = compute_capability(spec)
        if cc < 80:
            return (
                f"{kind} backward kernels need compute capability >= 8.0; this device has "
                f"{cc / 10:.1f}"
            )
    return None


def flex_declines(spec: AttentionSpec) -> str | None:
    """Why the backward kernels do not run this ``arrayattn.flex`` call, or ``None`` (see
    the module docstring, "Block masks")."""
    if not flex_kernels_enabled():
        return f"{FLEX_ENV}=0 sends block-mask backwards to the array-API backward"
    if spec.score_mod is not None:
        return "score_mod is not in the backward kernels (the array-API backward runs it)"
    if spec.block_mask is None:
        return "a mask_mod without a block mask: the backward kernels read a BlockMask's table"
    if is_block(spec):
        return "a block mask in a block of a larger call (the Dask path's tasks)"
    kind = kernel_kind(spec)
    assert kind is not None
    return flex_plan_for(kind, spec.E, spec.Ev, spec.block_mask)[1]


def _full(
    spec: AttentionSpec, x: Array, shape: tuple[int, ...], heads: int, tail: tuple[int, ...]
) -> Array:
    """``x`` (one of the call's arrays, of its own ``shape``) broadcast to
    ``(*lead, heads, *tail)`` and made a contiguous ``(B, heads, *tail)`` array."""
    import cupy

    nd = len(spec.lead) + 3 if len(tail) == 2 else len(spec.lead) + 2
    x = x.reshape((1,) * (nd - len(shape)) + tuple(shape))
    x = cupy.broadcast_to(x, spec.lead + (heads,) + tuple(tail))
    x = cupy.ascontiguousarray(x).reshape((spec.batch_size, heads) + tuple(tail))
    if getattr(getattr(x, "data", None), "ptr", 0) % 16:
        x = x.copy()  # a view at an odd offset: the 16-byte tile loads need aligned rows
    return x


def _reduce(spec: AttentionSpec, g: Array, shape: tuple[int, ...], heads: int) -> Array:
    """Kernel gradient ``(B, heads, X, Y)`` -> the argument's own ``shape``, summing over
    dims that broadcasting stretched (in float32/float64, then cast back)."""
    import cupy

    full = spec.lead + (heads,) + tuple(g.shape[-2:])
    g = g.reshape(full)
    nd = len(full)
    own = (1,) * (nd - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(nd) if own[a] == 1 and full[a] != 1)
    if axes:
        acc = cupy.float64 if g.dtype == cupy.float64 else cupy.float32
        g = g.astype(acc).sum(axis=axes, keepdims=True).astype(spec.dtype)
    return g.reshape(shape)


def _lengths(spec: AttentionSpec, x: Array | None) -> Array | None:
    import cupy

    if x is None:
        return None
    return cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.int32).reshape(spec.batch_size))


def _max_smem(device: int) -> int:
    """The dynamic shared memory a block may opt into on CUDA device ``device`` (bytes)."""
    import cupy

    try:
        attrs = cupy.cuda.Device(device).attributes
        return int(attrs.get("MaxSharedMemoryPerBlockOptin", 227 * 1024))
    except Exception:  # an attribute this CuPy does not report: assume a Hopper-class part
        return 227 * 1024


def _cupy_launch(
    name: str,
    grid: tuple[int, int, int],
    threads: int,
    smem: int,
    args: tuple[Any, ...],
    prelude: str = "",
) -> None:
    kernel = _loader.get_kernel(kernel_file(name), name, smem, prelude)
    kernel(grid, (threads,), args, shared_mem=smem)


def _flex_launch(
    name: str,
    grid: tuple[int, int, int],
    threads: int,
    smem: int,
    args: tuple[Any, ...],
    prelude: str = "",
) -> None:
    """:func:`_cupy_launch` with a block-mask predicate's ``prelude`` for the ``FLEX``
    instantiations only (the preprocess and convert kernels stay one module each)."""
    _cupy_launch(name, grid, threads, smem, args, prelude if name.endswith(", true>") else "")


def backward(
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Array | None,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
    *,
    deterministic: bool | None = None,
) -> tuple[Array, Array, Array, Array | None]:
    """``(d_query, d_key, d_value, None)`` in the user's shapes and dtype, through the
    backward kernels (the ``Implementation.backward`` signature; ``d_out``/``d_lse``
    ``None`` mean zero). ``deterministic=None`` uses :func:`is_deterministic`.

    Raises ``ValueError`` naming the reason when :func:`declines` does.

    Example (needs CuPy and a GPU)::

        >>> import cupy as cp, arrayattn as aa  # doctest: +SKIP
        >>> q = cp.random.standard_normal((2, 8, 512, 64)).astype(cp.float16)  # doctest: +SKIP
        >>> out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, q, q,  # doctest: +SKIP
        ...                        is_causal=True, implementation="fused")
        >>> dq, dk, dv = pullback(cp.ones_like(out))  # doctest: +SKIP
    """
    import cupy

    reason = declines(spec)
    if reason is not None:
        raise ValueError(f"the fused backward cannot run this call: {reason}")
    det = is_deterministic() if deterministic is None else bool(deterministic)
    kind = kernel_kind(spec)
    assert kind is not None  # declines() refuses a dtype without kernels
    plan = backward_plan(kind, spec.E, spec.Ev, bwd_variant())
    if spec.flex:  # declines() checked the block mask, the plan and its tiles
        plan = flex_plan_for(kind, spec.E, spec.Ev, spec.block_mask)[0]
    assert plan is not None  # declines() refuses head dims no variant holds
    if plan.variant == "v4" and plan.dkdv_smem > _max_smem(device_index(spec)):
        # v4's 173-178 KB: Hopper-sized. (v2's tiles fit any block mask v4's fit.)
        plan = (flex_plan if spec.flex else backward_plan)(kind, spec.E, spec.Ev, "v2")
        assert plan is not None
    B, Hq, Hkv, L, S, E, Ev = (spec.batch_size, spec.Hq, spec.Hkv, spec.L, spec.S, spec.E, spec.Ev)
    if B == 0 or Hq == 0 or L == 0 or S == 0 or E == 0 and Ev == 0:
        zeros = [
            cupy.zeros(s, dtype=spec.dtype) for s in (spec.q_shape, spec.k_shape, spec.v_shape)
        ]
        return zeros[0], zeros[1], zeros[2], None

    flex = None
    launch: Callable[..., None] = _cupy_launch
    if spec.flex:  # the block table on this device (built once, cached on the BlockMask)
        assert spec.block_mask is not None
        flex = flex_table.table(spec.block_mask, spec.xp, device_index(spec), spec.device)
        # a built-in mask_mod's predicate compiled into the FLEX kernels (flex_table.prelude)
        prelude = flex_table.prelude(spec.block_mask)
        if prelude:
            launch = functools.partial(_flex_launch, prelude=prelude)
    q = _full(spec, query, spec.q_shape, Hq, (L, E))
    k = _full(spec, key, spec.k_shape, Hkv, (S, E))
    v = _full(spec, value, spec.v_shape, Hkv, (S, Ev))
    o = _full(spec, out, spec.out_shape, Hq, (L, Ev))
    do = cupy.zeros_like(o) if d_out is None else _full(spec, d_out, spec.out_shape, Hq, (L, Ev))
    acc = cupy.float64 if kind == "float64" else cupy.float32
    lse_c = _full(spec, lse.astype(acc, copy=False), spec.lse_shape, Hq, (L,))
    dlse_c = None
    if d_lse is not None:
        dlse_c = _full(spec, d_lse.astype(acc, copy=False), spec.lse_shape, Hq, (L,))

    mask = None
    mask_strides = (0, 0, 0, 0)
    if attn_mask is not None:
        mask, *strides = mask_operand(spec, attn_mask, acc)  # as the forward kernels read it
        bs, hs, rs, cs = (int(x) for x in strides)
        mask_strides = (bs, hs, rs, cs)

    st = spec.structure
    dq, dk, dv = run_kernels(
        cupy,
        launch,
        plan,
        q,
        k,
        v,
        o,
        do,
        lse_c,
        dlse_c,
        scale=spec.scale,
        softcap=spec.softcap,
        diagonal=kernel_diagonal(spec),
        window=(st.left, st.right),
        q_lens=_lengths(spec, spec.q_len_g),
        kv_lens=_lengths(spec, spec.kv_len_g),
        seed=spec.seed or 0,
        dropout_p=spec.dropout_p,
        mask=mask,
        mask_strides=mask_strides,
        deterministic=det,
        alibi=per_head_operand(spec, spec.alibi_slopes, acc),
        flex=flex,
    )
    return (
        _reduce(spec, dq, spec.q_shape, Hq),
        _reduce(spec, dk, spec.k_shape, Hkv),
        _reduce(spec, dv, spec.v_shape, Hkv),
        None,
    )
