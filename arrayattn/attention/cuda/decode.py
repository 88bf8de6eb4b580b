"""Split-KV decode on CuPy: the kernels of ``decode_attn.cu`` for a few query rows of each
sequence over a long key/value cache, contiguous or paged.

Decode (one to a few new tokens against thousands of cached keys) is memory-bound: the
work is reading K and V once. The prefill kernel gives each (batch, head) one block of 128
query rows, so a decode step of B = 1 and 32 heads ran 32 thread blocks on a 132-SM GPU,
each walking every key: 54-58 GB/s on an H200 (2026-11-26), about 1.4% of its bandwidth.
Here the keys of a sequence are split across thread blocks (enough blocks to fill the
GPU), each block reads a key/value row once for all the query heads of a GQA group and all
L rows, 16-byte vectors per lane, and a second small kernel merges the splits by their
LSE, exactly as :func:`arrayattn.merge_attention_states` does (sinks folded in there).

Two users: ``implementation="fused"`` (``fused.py``) sends calls with ``L <= 16`` query
rows over ``S >= 128`` keys here (no ``attn_mask``, no dropout; everything else: causal
both alignments, windows, lengths, GQA, softcap, sinks, ALiBi, the LSE), and
``PagedKVCache.attend`` on CuPy reads its pages in place through the block table
(``arrayattn/nn/_paged_kernel.py``). ``ARRAYATTN_FUSED_DECODE=0`` sends fused calls to the
prefill kernel instead (A/B timing).

Two variants of the kernels, picked by ``ARRAYATTN_DECODE_VARIANT`` when a plan is made
(:func:`decode_plan`): ``v1`` and ``v2`` (the default, :data:`DEFAULT_VARIANT`), which
keeps a ring of key steps in flight per warp, aims at 2-4 blocks per SM instead of 2 and
merges the splits with one block per query row (the comments of ``aa_decode_split_v2`` in
``decode_attn.cu`` say why). Both compute the same thing; on an H200 v2 ran 2.2-2.4x v1's
device speed at 16k-128k keys.

:func:`run_decode` builds both launches for any ``launch`` function: CuPy's here, the host
emulator's in the CPU tests (``tests/kernels/test_decode_emulated.py``), so the tests run
the very arguments and launch shapes the GPU gets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ..._backend import Array
from . import _loader
from .operands import (
    kernel_diagonal,
    kernel_kind,
    lengths_operand,
    operand,
    per_head_operand,
)

__all__ = [
    "SOURCE",
    "HEAD_DIMS",
    "MAX_QUERY_ROWS",
    "VARIANTS",
    "DecodePlan",
    "decode_plan",
    "decode_variant",
    "num_splits",
    "run_decode",
    "declines",
    "forward",
    "COMPILE_VARIANTS",
    "HOT_VARIANTS",
]

SOURCE = "decode_attn.cu"
HEAD_DIMS = (32, 64, 128, 256)
"""Kernel head dims (buckets): E and Ev are any multiples of 8 up to the bucket."""
MAX_QUERY_ROWS = 16
"""The fused path uses the decode kernels for calls of at most this many query rows."""
MIN_KEYS = 128
"""...over at least this many keys (below it the prefill kernel's one pass is as good)."""
WARPS = 4  # AA_DEC_WARPS (and AA_DEC2_WARPS)
MIN_KEYS_PER_SPLIT = 256
VARIANTS = ("v1", "v2")
"""The kernel variants ``ARRAYATTN_DECODE_VARIANT`` chooses from (default ``v2``)."""
_KIND_TYPES = {"float16": "AaF16", "bfloat16": "AaBF16", "float32": "float", "float64": "double"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
NULL = np.uint64(0)

Launch = Callable[[str, tuple[int, int, int], int, int, tuple[Any, ...]], None]


@dataclass(frozen=True)
class DecodePlan:
    """The two kernels of one decode and their launch shapes."""

    kind: str
    head_dim: int  # D: the bucket holding E and Ev
    rows: int  # query rows per split block (ROWS)
    split: str  # name expression of the split kernel
    merge: str  # ... of the merge kernel
    threads: int
    smem: int  # dynamic shared memory of the split kernel (bytes)
    keys_per_step: int  # keys a block's warps take per step (WARPS * KPW)
    variant: str = "v1"
    blocks_per_sm: int = 2  # what num_splits aims at (v2: the kernel's launch bounds)
    merge_rows: int = WARPS  # query rows per merge block (v1: a warp each; v2: a block)
    merge_smem: int = 0  # dynamic shared memory of the merge kernel (bytes)


DEFAULT_VARIANT = "v2"
"""The kernels when ``ARRAYATTN_DECODE_VARIANT`` is unset: ``v2``, since it ran on an NVIDIA
H200 (2026-11-26, 08:13 UTC) correct in every GPU test (contiguous and paged caches) and
2.2-2.4x v1's device speed at 16k-128k keys (2446 GB/s at S = 131072, v1 1065; B = 1,
GQA 32/8, D = 128, float16)."""


def decode_variant() -> str:
    """The kernel variant ``ARRAYATTN_DECODE_VARIANT`` asks for: ``"v1"`` or ``"v2"``
    (:data:`DEFAULT_VARIANT` when unset or empty); anything else is a ``ValueError``."""
    env = os.environ.get("ARRAYATTN_DECODE_VARIANT", "").strip()
    if not env:
        return DEFAULT_VARIANT
    if env not in VARIANTS:
        raise ValueError(f"ARRAYATTN_DECODE_VARIANT must be one of {VARIANTS}, got {env!r}")
    return env


def decode_plan(
    kind: str, e: int, ev: int, group_rows: int = 8, variant: str | None = None
) -> DecodePlan | None:
    """The decode kernels for dtype ``kind``, head dims ``e``, ``ev`` and ``group_rows``
    query rows per KV head (``Hq // Hkv * L``), or ``None`` when no variant holds them
    (head dims above 256, or not multiples of 8). ``variant`` (``"v1"``/``"v2"``) defaults
    to :func:`decode_variant`'s, read from the environment at each call.

    Examples:
        >>> p = decode_plan("float16", 128, 128, group_rows=4)   # GQA 32/8, one new token
        >>> p.split, p.merge, p.keys_per_step
        ('aa_decode_split_v2<AaF16, 128, 4>', 'aa_decode_merge_v2<AaF16, 128>', 8)
        >>> decode_plan("float16", 128, 128, group_rows=4, variant="v1").split
        'aa_decode_split<AaF16, 128, 4>'
    """
    if kind not in _KIND_TYPES:
        raise ValueError(f"kind must be one of {tuple(_KIND_TYPES)}, got {kind!r}")
    if variant is None:
        variant = decode_variant()
    elif variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return _plan(kind, int(e), int(ev), int(group_rows), variant)


@cache  # a pure function of its arguments, asked twice per decode call (host time matters)
def _plan(kind: str, e: int, ev: int, group_rows: int, variant: str) -> DecodePlan | None:
    need = max(e, ev, 1)
    if e % 8 or ev % 8:
        return None
    d = next((h for h in HEAD_DIMS if need <= h), None)
    if d is None:
        return None
    t = _KIND_TYPES[kind]
    size = _ITEMSIZE[kind]
    acc = 8 if kind == "float64" else 4
    # Query rows per block: the GQA group's rows (query heads per KV head x L) rounded up
    # to 1, 2, 4 or 8 (float64, whose registers are twice as wide: 4, and 2 at D = 256,
    # where 4 spill); more rows are taken in chunks, each re-reading the keys. Fewer rows,
    # fewer registers, more warps per SM to keep loads in flight.
    cap = (2 if d == 256 else 4) if kind == "float64" else 8
    rows = next(r for r in (1, 2, 4, 8) if r >= min(group_rows, cap))
    vec = 16 // size
    lanes = min(32, d // vec)
    if variant == "v2":
        # AaDec2Occ (decode_attn.cu): the blocks per SM the kernel's register cap allows
        # without spills, by the 32-bit registers of a lane's accumulator rows.
        epl = d // lanes
        state = rows * epl * acc // 4
        if size == 2:
            blocks = 4 if state <= 16 else (3 if state <= 32 else 2)
        elif size == 4:
            blocks = 4 if state <= 8 else (3 if state <= 32 and epl <= 4 else 2)
        else:
            blocks = 4 if state <= 4 else 2
        return DecodePlan(
            kind=kind,
            head_dim=d,
            rows=rows,
            split=f"aa_decode_split_v2<{t}, {d}, {rows}>",
            merge=f"aa_decode_merge_v2<{t}, {d}>",
            threads=32 * WARPS,
            smem=WARPS * rows * (d + 2) * acc,
            keys_per_step=WARPS * (32 // lanes),
            variant="v2",
            blocks_per_sm=blocks,
            merge_rows=1,
            merge_smem=WARPS * d * acc,
        )
    return DecodePlan(
        kind=kind,
        head_dim=d,
        rows=rows,
        split=f"aa_decode_split<{t}, {d}, {rows}>",
        merge=f"aa_decode_merge<{t}, {d}>",
        threads=32 * WARPS,
        smem=WARPS * rows * (d + 2) * acc,
        keys_per_step=WARPS * (32 // lanes),
    )


def _all_variants() -> list[str]:
    names: list[str] = []
    for kind in _KIND_TYPES:
        for d in HEAD_DIMS:
            for rows in (1, 2, 4, 8):
                plan = decode_plan(kind, d, d, rows, variant="v1")
                assert plan is not None
                names += [n for n in (plan.split, plan.merge) if n not in names]
    # v2: every 16-bit instantiation, float32/float64 at D = 128 only (CI time; the others
    # compile on first use through NVRTC like any instantiation).
    for kind in _KIND_TYPES:
        for d in HEAD_DIMS if kind in ("float16", "bfloat16") else (128,):
            for rows in (1, 2, 4, 8):
                plan = decode_plan(kind, d, d, rows, variant="v2")
                assert plan is not None
                names += [n for n in (plan.split, plan.merge) if n not in names]
    return names


COMPILE_VARIANTS: dict[str, list[str]] = {SOURCE: _all_variants()}
"""The decode instantiations (every v1 one, v2's as above), for ``.ci/compile_kernels.py``
and ``bench/gpu_variants.py``."""

HOT_VARIANTS: list[str] = [
    decode_plan(kind, d, d, rows, variant=variant).split  # type: ignore[union-attr]
    for variant in VARIANTS
    for kind in ("float16", "bfloat16")
    for d in (64, 128)
    for rows in (1, 2, 4, 8)
]
"""The split kernels the compile check fails on when they spill."""


def num_splits(
    units: int,
    key_span: int,
    sm_count: int,
    keys_per_step: int,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    blocks_per_sm: int = 2,
    one_wave: bool = False,
) -> tuple[int, int]:
    """``(splits, keys_per_split)`` for ``units`` (batch x KV heads x row chunks) blocks of
    work over at most ``key_span`` keys each: enough splits for about ``blocks_per_sm``
    blocks per SM, none shorter than ``min_keys_per_split`` keys, each a multiple of the
    block's step. ``one_wave``: at most ``blocks_per_sm * sm_count`` blocks in all (when
    the units allow), for a kernel that fills the SMs at exactly that many blocks, where one
    block more would run as a second wave on its own.

    Examples:
        >>> num_splits(8, 131072, 132, 8)   # B = 1, 8 KV heads, a 128k cache
        (33, 3976)
        >>> num_splits(512, 4096, 132, 8)   # a large batch needs no split
        (1, 4096)
        >>> num_splits(8, 131072, 132, 8, blocks_per_sm=3, one_wave=True)   # v2, fp16, 4 rows
        (49, 2680)
    """
    span = max(1, key_span)
    slots = blocks_per_sm * sm_count
    want = max(1, slots // max(1, units)) if one_wave else -(-slots // max(1, units))
    splits = max(1, min(want, span // max(1, min_keys_per_split)))
    per = -(-span // splits)
    per = -(-per // keys_per_step) * keys_per_step
    return -(-span // per), per


def run_decode(
    xp: Any,
    launch: Launch,
    plan: DecodePlan,
    q: Array,
    q_strides: tuple[int, int, int],
    k: Array,
    k_strides: tuple[int, int, int],
    v: Array,
    v_strides: tuple[int, int, int],
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    rows: int,
    keys: int,
    e: int,
    ev: int,
    scale: float,
    out_dtype: Any,
    diag: int = 0,
    window: tuple[int, int] = (-1, -1),
    tables: Array | None = None,
    page_size: int = 1,
    q_lens: Array | None = None,
    kv_lens: Array | None = None,
    softcap: float | None = None,
    alibi: Array | None = None,
    sinks: Array | None = None,
    sm_count: int = 132,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    poison: bool = False,
) -> tuple[Array, Array]:
    """Launch the split and merge kernels; returns ``(out, lse)``: ``out`` contiguous
    ``(batch, heads, rows, ev)`` of ``out_dtype``, ``lse`` ``(batch, heads, rows)`` in the
    accumulation dtype (natural log).

    ``q`` (``(batch, heads, rows, e)`` elements at ``b * q_strides[0] + h * q_strides[1] +
    i * q_strides[2]``), ``k``/``v`` with ``(page, head, row)`` strides: without
    ``tables`` the page is the batch index and the row the key index (a contiguous
    cache, ``keys`` long); with ``tables`` (int32 ``(batch, max_pages)``) key ``j`` of
    sequence ``b`` is row ``j % page_size`` of page ``tables[b, j // page_size]``.
    ``q_lens``/``kv_lens`` int32 ``(batch,)`` or ``None``; ``diag`` the kernels' diagonal
    (``tiles.DIAG_FROM_LENGTHS``: each sequence's ``kv_len - q_len``); ``window`` with the
    causal bound folded in; ``alibi``/``sinks`` contiguous ``(batch * heads,)`` in the
    accumulation dtype. Strides in elements, every 16-byte vector aligned. ``sm_count``
    and ``min_keys_per_split`` set the number of splits (:func:`num_splits`); ``poison``
    fills every buffer with NaN first (a testing aid: an unwritten element shows).
    """
    f64 = plan.kind == "float64"
    acc_np = np.float64 if f64 else np.float32
    acc = xp.float64 if f64 else xp.float32
    i32, i64 = np.int32, np.int64
    group = heads // kv_heads
    chunks = -(-group * rows // plan.rows)
    splits, per_split = num_splits(
        batch * kv_heads * chunks, keys, sm_count, plan.keys_per_step, min_keys_per_split,
        plan.blocks_per_sm, plan.variant == "v2",
    )  # fmt: skip
    total_rows = batch * heads * rows
    if plan.variant == "v1":
        part_o = xp.empty((total_rows * splits * plan.head_dim,), dtype=acc)
        part_lse = xp.empty((total_rows * splits,), dtype=acc)
        work = [part_o, part_lse]
    else:  # one allocation for both partial buffers (one pool call fewer per decode)
        n_o = total_rows * splits * plan.head_dim
        part = xp.empty((n_o + total_rows * splits,), dtype=acc)
        part_o, part_lse = part[:n_o], part[n_o:]
        work = [part]
    out = xp.empty((batch, heads, rows, ev), dtype=out_dtype)
    lse = xp.empty((batch, heads, rows), dtype=acc)
    if poison:
        for a in (*work, out, lse):
            a.fill(np.nan if np.dtype(a.dtype).kind == "f" else -1)  # -1: a bf16 NaN
    max_pages = 0 if tables is None else int(tables.shape[-1])
    launch(
        plan.split,
        (splits, kv_heads * chunks, batch),
        plan.threads,
        plan.smem,
        (
            q, *(i64(s) for s in q_strides),
            k, *(i64(s) for s in k_strides),
            v, *(i64(s) for s in v_strides),
            NULL if tables is None else tables, i32(max_pages), i32(page_size),
            NULL if q_lens is None else q_lens, NULL if kv_lens is None else kv_lens,
            i32(rows), i32(keys), i32(heads), i32(kv_heads), i32(e), i32(ev),
            i32(diag), i32(window[0]), i32(window[1]),
            acc_np(scale), acc_np(0.0 if softcap is None else softcap),
            NULL if alibi is None else alibi, i32(per_split),
            part_o, part_lse,
        ),
    )  # fmt: skip
    launch(
        plan.merge,
        (max(1, -(-total_rows // plan.merge_rows)), 1, 1),
        plan.threads,
        plan.merge_smem,
        (
            part_o, part_lse, i32(splits), i64(total_rows), i32(rows),
            NULL if sinks is None else sinks, i32(ev), out, lse,
        ),
    )  # fmt: skip
    return out, lse


# -- the fused implementation's decode ---------------------------------------------------------
def declines(spec: Any, has_mask: bool) -> str | None:
    """``None`` when the fused forward runs this call on the decode kernels, else why not
    (the prefill kernel then runs it)."""
    env = os.environ.get("ARRAYATTN_FUSED_DECODE", "").strip()
    if env == "0":
        return "ARRAYATTN_FUSED_DECODE=0"
    if spec.L > MAX_QUERY_ROWS or spec.S < MIN_KEYS:
        return f"L={spec.L} query rows over S={spec.S} keys is not decode-shaped"
    if has_mask:
        return "a dense attn_mask runs on the prefill kernel"
    if getattr(spec, "flex", False):
        return "block masks / mask_mod / score_mod (arrayattn.flex) run on the prefill kernel"
    if spec.dropout_p > 0:
        return "dropout runs on the prefill kernel"
    kind = kernel_kind(spec)
    if kind is None or decode_plan(kind, spec.E, spec.Ev) is None:
        return f"head dims E={spec.E}, Ev={spec.Ev} are not multiples of 8 up to 256"
    return None


@cache
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _cupy_launch(
    name: str, grid: tuple[int, int, int], threads: int, smem: int, args: tuple[Any, ...]
) -> None:
    kernel = _loader.get_kernel(SOURCE, name, smem)
    kernel(grid, (threads,), args, shared_mem=smem)


def forward(
    spec: Any, query: Array, key: Array, value: Array, poison: bool = False
) -> tuple[Array, Array]:
    """Output (the user's layout and dtype) and LSE of a decode-shaped call on CuPy arrays
    (:func:`declines` returned ``None``); ``poison`` as in :func:`run_decode`."""
    import cupy

    kind = kernel_kind(spec)
    assert kind is not None
    plan = decode_plan(kind, spec.E, spec.Ev, spec.G * spec.L)
    assert plan is not None
    acc = np.float64 if kind == "float64" else np.float32
    q, q_sb, q_sh, q_sr = operand(spec, query, spec.E, True)
    k, k_sb, k_sh, k_sr = operand(spec, key, spec.E, True)
    v, v_sb, v_sh, v_sr = operand(spec, value, spec.Ev, True)
    diag = kernel_diagonal(spec)
    assert diag is not None
    st = spec.structure
    out, lse = run_decode(
        cupy, _cupy_launch, plan,
        q, (q_sb, q_sh, q_sr), k, (k_sb, k_sh, k_sr), v, (v_sb, v_sh, v_sr),
        batch=spec.batch_size, heads=spec.Hq, kv_heads=spec.Hkv, rows=spec.L, keys=spec.S,
        e=spec.E, ev=spec.Ev, scale=spec.scale, out_dtype=q.dtype, diag=diag,
        window=(st.left, st.right),
        q_lens=lengths_operand(spec, "q_len_g"), kv_lens=lengths_operand(spec, "kv_len_g"),
        softcap=spec.softcap, alibi=per_head_operand(spec, spec.alibi_slopes, acc),
        sinks=per_head_operand(spec, spec.sinks, acc),
        sm_count=_sm_count(cupy.cuda.runtime.getDevice()), poison=poison,
    )  # fmt: skip
    return out.reshape(spec.out_shape), lse.reshape(spec.lse_shape)
