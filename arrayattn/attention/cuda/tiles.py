"""The forward kernels' tile shapes and schedule, in plain Python.

This mirrors the constants and the block-skipping logic of ``attn_fwd.cu`` and
``common.cuh`` (``AaTcCfg``, ``AaTcDefaultMT``, ``AaSimtCfg``, ``aa_key_range``, ``aa_block_full``,
``aa_allowed``) so that the launch configuration is computed in one place on the host and
the schedule can be tested on a CPU against the dense structural mask. No CuPy import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "HEAD_DIMS",
    "TileConfig",
    "tile_config",
    "tc_row_tiles",
    "is_heavy",
    "head_dim_bucket",
    "key_range",
    "block_full",
    "allowed",
    "block_schedule",
    "forward_kernel_name",
    "DIAG_FROM_LENGTHS",
]

DIAG_FROM_LENGTHS = -(2**31)
"""The kernels' ``diag`` argument meaning "offset = kv_len - q_len of each sequence"
(``AA_DIAG_FROM_LENGTHS`` in ``common.cuh``); any other value is the constant offset."""

HEAD_DIMS = (32, 64, 96, 128, 256)
"""Head dims the kernels are instantiated for; others are zero-padded up to the next."""


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one forward kernel variant."""

    block_m: int  # query rows per thread block
    block_n: int  # keys per streamed tile
    threads: int
    smem_bytes: int  # dynamic shared memory


def head_dim_bucket(e: int, ev: int) -> int | None:
    """The kernel head dim serving query/key dim ``e`` and value dim ``ev`` (the smallest
    instantiated one that holds both), or ``None`` when both exceed 256."""
    need = max(e, ev)
    for d in HEAD_DIMS:
        if need <= d:
            return d
    return None


def tc_row_tiles(d: int, heavy: bool = False) -> int:
    """Row tiles of 16 per warp (``MT``) of the tensor-core kernel at head dim ``d``: 2
    (FlashAttention-2's 32 rows per warp, each K/V fragment feeding two row tiles), but 1
    for D = 256 and for ``heavy`` variants (dropout, or softcap with a dense mask), which
    spill registers at MT = 2 (see .ci/compile_kernels.py). The environment variable
    ``ARRAYATTN_FWD_TC_MT`` (1 or 2) overrides the choice, for A/B timing on a GPU."""
    env = os.environ.get("ARRAYATTN_FWD_TC_MT")
    if env:
        if env not in ("1", "2"):
            raise ValueError(f"ARRAYATTN_FWD_TC_MT must be 1 or 2, got {env!r}")
        return int(env)
    return 1 if (d == 256 or heavy) else 2


def is_heavy(softcap: bool, dropout: bool, mask_kind: int) -> bool:
    """Feature flags whose tensor-core variant runs with one row tile per warp."""
    return dropout or (softcap and mask_kind != 0)


def tile_config(kind: str, d: int, mt: int | None = None) -> TileConfig:
    """Tile shape of kernel ``kind`` (``"float16"``, ``"bfloat16"``, ``"float32"`` or
    ``"float64"``) at head dim ``d`` (and ``mt`` row tiles per warp for the 16-bit
    kernel; default :func:`tc_row_tiles`); the same numbers as the ``*Cfg`` structs in
    ``attn_fwd.cu``.

    Examples:
        >>> tile_config("float16", 128, mt=2)
        TileConfig(block_m=128, block_n=32, threads=128, smem_bytes=69632)
    """
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {d}")
    if kind in ("float16", "bfloat16"):
        mt = tc_row_tiles(d) if mt is None else mt
        if mt not in (1, 2):
            raise ValueError(f"mt must be 1 or 2, got {mt}")
        bm = 64 if d == 256 else 128
        bn = 32 if (d == 256 or (mt == 2 and d >= 96)) else 64
        pitch = d + 8
        return TileConfig(bm, bn, (bm // (16 * mt)) * 32, (bm + 4 * bn) * pitch * 2)
    if kind in ("float32", "float64"):
        f64 = kind == "float64"
        size = 8 if f64 else 4
        bm = 32 if f64 else 64
        bn = (16 if d == 256 else 32) if f64 else (64 if d <= 64 else 32)
        qp, kp = bm + 4, d + 1
        smem = (d * qp + 2 * bn * kp + 2 * bn * d + bn * qp) * size
        return TileConfig(bm, bn, 128, smem)
    raise ValueError(f"kind must be float16, bfloat16, float32 or float64, got {kind!r}")


def allowed(i: int, j: int, offset: int, left: int, right: int, kv_len: int) -> bool:
    """``aa_allowed``: query ``i`` may see key ``j`` (structure and key length)."""
    diag = i + offset
    return j < kv_len and (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)


def key_range(r0: int, r1: int, offset: int, left: int, right: int, kv_len: int) -> tuple[int, int]:
    """``aa_key_range``: half-open range of keys rows ``[r0, r1)`` may see."""
    lo, hi = 0, kv_len
    if r1 <= r0:
        return 0, 0
    if left >= 0:
        lo = max(0, r0 + offset - left)
    if right >= 0:
        hi = min(kv_len, r1 - 1 + offset + right + 1)
    return lo, max(lo, hi)


def block_full(
    r0: int, r1: int, c0: int, c1: int, offset: int, left: int, right: int, kv_len: int
) -> bool:
    """``aa_block_full``: every ``(i, j)`` in the block is structurally allowed."""
    if c1 > kv_len:
        return False
    if left >= 0 and c0 < r1 - 1 + offset - left:
        return False
    if right >= 0 and c1 - 1 > r0 + offset + right:
        return False
    return True


def block_schedule(
    r0: int,
    block_m: int,
    block_n: int,
    q_len: int,
    kv_len: int,
    offset: int,
    left: int,
    right: int,
) -> list[tuple[int, bool]]:
    """The key tiles the kernel visits for the query block starting at row ``r0``, as
    ``(tile index, masked)`` pairs; ``masked`` is False where the kernel skips element
    masking. Mirrors the loop bounds and the ``full`` test of both forward kernels."""
    rows_valid = q_len - r0
    lo, hi = key_range(r0, r0 + min(rows_valid, block_m), offset, left, right, kv_len)
    n_begin = lo // block_n
    n_end = (hi + block_n - 1) // block_n if hi > lo else n_begin
    out = []
    for n in range(n_begin, n_end):
        c0 = n * block_n
        full = r0 + block_m <= q_len and block_full(
            r0, r0 + block_m, c0, c0 + block_n, offset, left, right, kv_len
        )
        out.append((n, not full))
    return out


def forward_kernel_name(
    kind: str, d: int, softcap: bool, dropout: bool, mask_kind: int, mt: int | None = None
) -> str:
    """The template instantiation (a ``cupy.RawModule`` name expression) of the forward
    kernel for dtype ``kind``, head dim ``d``, and the feature flags; ``mask_kind`` is 0
    (none), 1 (bool) or 2 (float bias); ``mt`` as in :func:`tile_config`.

    Examples:
        >>> forward_kernel_name("float16", 128, False, False, 0, mt=2)
        'aa_fwd_tc<0, 128, 2, false, false, 0>'
    """
    flags = f"{str(softcap).lower()}, {str(dropout).lower()}, {mask_kind}"
    if kind in ("float16", "bfloat16"):
        mt = tc_row_tiles(d, is_heavy(softcap, dropout, mask_kind)) if mt is None else mt
        return f"aa_fwd_tc<{0 if kind == 'float16' else 1}, {d}, {mt}, {flags}>"
    if kind in ("float32", "float64"):
        return f"aa_fwd_simt<{'double' if kind == 'float64' else 'float'}, {d}, {flags}>"
    raise ValueError(f"kind must be float16, bfloat16, float32 or float64, got {kind!r}")
