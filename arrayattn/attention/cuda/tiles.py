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
    "FWD_VARIANTS",
    "V2_HEAD_DIMS",
    "V2_FEATURE_HEAD_DIMS",
    "V2_OPT_IN_HEAD_DIMS",
    "TC2_D96_ENV",
    "v2_head_dims",
    "ForwardLaunch",
    "forward_variant",
    "v2_declines",
    "forward_launch",
    "tile_config_v2",
    "forward_kernel_name_v2",
    "TF32_HEAD_DIMS",
    "tf32_declines",
    "tile_config_tf32",
    "forward_kernel_name_tf32",
    "row_keys",
    "COMPILE_VARIANTS",
    "HOT_VARIANTS",
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
    (none), 1 (bool) or 2 (float bias), plus 4 with a block mask (``arrayattn.flex``;
    ``flex_table.MASK_FLEX``); ``mt`` as in :func:`tile_config`.

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


# -- forward kernel variants (ARRAYATTN_FWD_VARIANT) ---------------------------------------
FWD_VARIANTS = ("v1", "v2", "v3")
"""Forward kernel variants: ``v1`` (``aa_fwd_tc`` / ``aa_fwd_simt``), ``v2`` (the default,
``aa_fwd_tc2``: 128 x 64 tiles, one barrier per key tile, the scale folded into the exp2
FMA, the O rescale skipped when no row max grew; 16-bit kinds only) and ``v3`` (the
default: v2, and float32 on tensor cores through ``aa_fwd_tf32``, three TF32 products
per product)."""

V2_HEAD_DIMS = (64, 128)
"""Head dims ``aa_fwd_tc2`` serves always. D = 32 and 256 stay on v1 (not the target);
D = 96 runs on v2 too (:data:`V2_OPT_IN_HEAD_DIMS`) unless ``ARRAYATTN_FWD_TC2_D96=0``:
on an H100 (2026-11-26, 17:02 UTC) it ran 1.39-1.55x v1's speed there, 0.94-1.07x
PyTorch's flash backend (v1 0.63-0.68x)."""

V2_OPT_IN_HEAD_DIMS = (96,)
"""Head dims ``aa_fwd_tc2`` serves unless :data:`TC2_D96_ENV` is ``0``: D = 96 (128 x 64
tiles, 244 registers and no spill on sm_90; v1 runs
it with 32-key tiles). A row is 12 16-byte chunks, which 128 threads do not split into
whole rows, so 96 of them copy K and V (``aa_tile_async_rows``)."""

TC2_D96_ENV = "ARRAYATTN_FWD_TC2_D96"
"""Unset, empty or ``1`` (the default since the H100 run of 2026-11-26, 17:02 UTC): 16-bit
D = 96 calls of variants v2/v3 run ``aa_fwd_tc2`` (64-key tiles); ``0``: v1's
``aa_fwd_tc`` (32-key tiles), as before."""


def v2_head_dims() -> tuple[int, ...]:
    """The head dims v2 serves now: :data:`V2_HEAD_DIMS`, plus D = 96 unless
    :data:`TC2_D96_ENV` is ``0``; ``ValueError`` for a value other than ``0``/``1``/empty."""
    env = os.environ.get(TC2_D96_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{TC2_D96_ENV} must be 0 or 1, got {env!r}")
    return V2_HEAD_DIMS if env == "0" else V2_HEAD_DIMS + V2_OPT_IN_HEAD_DIMS


V2_FEATURE_HEAD_DIMS = (64,)
"""Head dims where v2 also runs softcap, dense masks and ALiBi (at D = 128 those variants
spill 32-132 bytes at the 255-register cap of two blocks per SM, so v1 runs them)."""

_V2_SOURCE = "attn_fwd.cu"


@dataclass(frozen=True)
class ForwardLaunch:
    """What ``fused.py`` launches: the kernel's name expression, its launch shape, and
    the variant that serves the call (``v2`` falls back to ``v1`` where it declines)."""

    name: str
    config: TileConfig
    variant: str


DEFAULT_FWD_VARIANT = "v3"
"""The forward variant when ``ARRAYATTN_FWD_VARIANT`` is unset: ``v3`` (v2's kernels for
16-bit kinds, ``aa_fwd_tf32`` for float32), since it ran on an NVIDIA H100 (2026-11-26,
14:00 UTC) correct in every float32 GPU test, 1.0-1.7e-6 from float64 up to L = 32768,
and 2.1-2.3x the CUDA-core kernel (1.10-1.56x PyTorch's float32 SDPA). v2 became the
16-bit default after an NVIDIA H200 run (08:13 UTC: 1.25-1.36x v1, 0.94-1.03x PyTorch's
flash backend). ``v1`` and ``v2`` stay selectable (and v1 runs whatever v2 and v3
decline)."""


def forward_variant() -> str:
    """The forward variant asked for by ``ARRAYATTN_FWD_VARIANT`` (:data:`DEFAULT_FWD_VARIANT`
    when unset or empty), for A/B timing on a GPU; ``ValueError`` for any other value."""
    env = os.environ.get("ARRAYATTN_FWD_VARIANT")
    if not env:
        return DEFAULT_FWD_VARIANT
    if env not in FWD_VARIANTS:
        raise ValueError(f"ARRAYATTN_FWD_VARIANT must be one of {FWD_VARIANTS}, got {env!r}")
    return env


def v2_declines(
    kind: str,
    d: int,
    dropout: bool,
    scale: float,
    softcap: bool = False,
    mask_kind: int = 0,
    alibi: bool = False,
) -> str | None:
    """``None`` when ``aa_fwd_tc2`` serves the call, else why ``aa_fwd_tc`` (v1) does:
    float32/float64 (CUDA-core kernels), head dims other than :func:`v2_head_dims`
    (:data:`V2_HEAD_DIMS`, and D = 96 under ``ARRAYATTN_FWD_TC2_D96=1``),
    dropout (the hash per element does not fit the register budget of 32 rows x 64 keys
    per warp), softcap / dense masks / ALiBi above D = 64 (:data:`V2_FEATURE_HEAD_DIMS`;
    they spill), and a scale that is not positive (v2 takes the row
    max on raw scores and scales it once, which needs ``scale > 0``). Sinks, causal
    (both alignments), windows, lengths, GQA and block masks (``mask_kind`` 4,
    ``arrayattn.flex``) run on v2 at every v2 head dim."""
    if kind not in ("float16", "bfloat16"):
        return f"v2 is a tensor-core kernel (float16/bfloat16), not {kind}"
    dims = v2_head_dims()
    if d not in dims:
        return f"v2 serves head dims {dims} ({TC2_D96_ENV}=0 leaves out 96), not {d}"
    if dropout:
        return "v2 has no dropout (register budget); v1 runs it"
    if (softcap or mask_kind & 3 or alibi) and d not in V2_FEATURE_HEAD_DIMS:
        return f"v2 runs softcap, dense masks and ALiBi at D in {V2_FEATURE_HEAD_DIMS} only"
    if not scale >= 1e-30:  # > 0, and scale * log2(e) a normal float32 (NaN fails too)
        return f"v2 needs scale > 0 (row max on raw scores), got {scale}"
    return None


def tile_config_v2(d: int) -> TileConfig:
    """Launch shape of ``aa_fwd_tc2`` (``AaTc2Cfg`` in ``attn_fwd.cu``): 128 query rows (4
    warps x 32), 64 keys per tile, Q plus two stages of K and V in shared memory.

    Examples:
        >>> tile_config_v2(128)
        TileConfig(block_m=128, block_n=64, threads=128, smem_bytes=104448)
        >>> tile_config_v2(96).smem_bytes
        79872
    """
    dims = V2_HEAD_DIMS + V2_OPT_IN_HEAD_DIMS
    if d not in dims:
        raise ValueError(f"v2 head dim must be one of {dims}, got {d}")
    bm, bn = 128, 64
    return TileConfig(bm, bn, 128, (bm + 4 * bn) * (d + 8) * 2)


def forward_kernel_name_v2(kind: str, d: int, softcap: bool, mask_kind: int, alibi: bool) -> str:
    """Name expression of ``aa_fwd_tc2<DT, D, SOFTCAP, MASK, ALIBI>``.

    Examples:
        >>> forward_kernel_name_v2("float16", 128, False, 0, False)
        'aa_fwd_tc2<0, 128, false, 0, false>'
    """
    if kind not in ("float16", "bfloat16"):
        raise ValueError(f"v2 kinds are float16 and bfloat16, got {kind!r}")
    dt = 0 if kind == "float16" else 1
    return f"aa_fwd_tc2<{dt}, {d}, {str(softcap).lower()}, {mask_kind}, {str(alibi).lower()}>"


TF32_HEAD_DIMS = (64, 128)
"""Head dims ``aa_fwd_tf32`` (float32 on tensor cores, variant ``v3``) is instantiated for."""


def tf32_declines(
    kind: str, d: int, dropout: bool, scale: float
) -> str | None:  # fmt: skip
    """``None`` when ``aa_fwd_tf32`` serves a float32 call under variant ``v3``, else why
    the CUDA-core kernel (``aa_fwd_simt``) does: other dtypes, head dims other than
    :data:`TF32_HEAD_DIMS`, dropout, a scale that is not positive (the row max is taken on
    raw scores, as in v2). Softcap, dense and block masks, ALiBi, sinks, causal, windows,
    lengths and GQA run on it.

    Examples:
        >>> tf32_declines("float32", 128, False, 0.088) is None
        True
        >>> tf32_declines("float32", 128, True, 0.088)
        'v3 float32 has no dropout; aa_fwd_simt runs it'
    """
    if kind != "float32":
        return f"aa_fwd_tf32 is for float32, not {kind}"
    if d not in TF32_HEAD_DIMS:
        return f"aa_fwd_tf32 is instantiated for head dims {TF32_HEAD_DIMS}, not {d}"
    if dropout:
        return "v3 float32 has no dropout; aa_fwd_simt runs it"
    if not scale >= 1e-30:
        return f"aa_fwd_tf32 needs scale > 0 (row max on raw scores), got {scale}"
    return None


def tile_config_tf32(d: int) -> TileConfig:
    """Launch shape of ``aa_fwd_tf32`` (``AaTf32Cfg`` in ``attn_fwd.cu``): 64 query rows (4
    warps x 16), 64 keys per tile at D = 64 and 32 at D = 128, Q plus two stages of K and
    V in float with a row pitch of D + 4.

    Examples:
        >>> tile_config_tf32(128)
        TileConfig(block_m=64, block_n=32, threads=128, smem_bytes=101376)
    """
    if d not in TF32_HEAD_DIMS:
        raise ValueError(f"tf32 head dim must be one of {TF32_HEAD_DIMS}, got {d}")
    bm, bn = 64, 64 if d <= 64 else 32
    return TileConfig(bm, bn, 128, (bm + 4 * bn) * (d + 4) * 4)


def forward_kernel_name_tf32(d: int, softcap: bool, mask_kind: int, alibi: bool) -> str:
    """Name expression of ``aa_fwd_tf32<D, SOFTCAP, MASK, ALIBI>``.

    Examples:
        >>> forward_kernel_name_tf32(64, False, 4, False)
        'aa_fwd_tf32<64, false, 4, false>'
    """
    return f"aa_fwd_tf32<{d}, {str(softcap).lower()}, {mask_kind}, {str(alibi).lower()}>"


def forward_launch(
    kind: str,
    d: int,
    softcap: bool,
    dropout: bool,
    mask_kind: int,
    alibi: bool,
    scale: float,
    variant: str | None = None,
) -> ForwardLaunch:
    """The forward kernel for one call: ``variant`` (default :func:`forward_variant`)
    ``v2`` runs ``aa_fwd_tc2`` unless :func:`v2_declines`, otherwise exactly what v1 has
    always run (:func:`tc_row_tiles`, :func:`tile_config`, :func:`forward_kernel_name`).

    Examples:
        >>> forward_launch("float16", 128, False, False, 0, False, 0.088, "v2").name
        'aa_fwd_tc2<0, 128, false, 0, false>'
        >>> forward_launch("float16", 128, False, True, 0, False, 0.088, "v2").variant
        'v1'
    """
    variant = forward_variant() if variant is None else variant
    if variant not in FWD_VARIANTS:
        raise ValueError(f"variant must be one of {FWD_VARIANTS}, got {variant!r}")
    if variant == "v3":
        if tf32_declines(kind, d, dropout, scale) is None:
            name = forward_kernel_name_tf32(d, softcap, mask_kind, alibi)
            return ForwardLaunch(name, tile_config_tf32(d), "v3")
        variant = "v2"  # 16-bit kinds as v2; float32 it declines as v1
    if variant == "v2" and v2_declines(kind, d, dropout, scale, softcap, mask_kind, alibi) is None:
        name = forward_kernel_name_v2(kind, d, softcap, mask_kind, alibi)
        return ForwardLaunch(name, tile_config_v2(d), "v2")
    tc = kind in ("float16", "bfloat16")
    mt = tc_row_tiles(d, is_heavy(softcap, dropout, mask_kind)) if tc else None
    name = forward_kernel_name(kind, d, softcap, dropout, mask_kind, mt)
    return ForwardLaunch(name, tile_config(kind, d, mt), "v1")


def row_keys(
    i: int, q_len: int, offset: int, left: int, right: int, kv_len: int, j0: int
) -> tuple[int, int]:
    """``aa_row_keys`` (v2's masked tiles): ``(base, span)`` such that key ``j0 + k``
    (``j0 + k >= 0``) is allowed for row ``i`` exactly when ``(base + k) mod 2**32 <=
    span``, i.e. ``i < q_len and allowed(i, j0 + k, ...)``; unsigned 32-bit arithmetic as
    in the kernel."""
    diag = i + offset
    jlo = max(diag - left, 0) if left >= 0 else 0
    jhi = kv_len - 1
    if right >= 0 and diag + right < jhi:
        jhi = diag + right
    if i >= q_len or jhi < jlo:
        jlo = jhi = 2**31 - 1
    mask = 0xFFFFFFFF
    return (j0 - jlo) & mask, (jhi - jlo) & mask


def _v2_variants() -> list[str]:
    """The v2 instantiations compiled by CI and loaded by ``bench/gpu_variants.py``: both
    16-bit kinds at every v2 head dim without features, and the feature flags (softcap,
    bool and float masks, ALiBi, block masks) at D = 64 in float16, plus bfloat16 mixes."""
    out = [
        forward_kernel_name_v2(kind, d, False, 0, False)
        for kind in ("float16", "bfloat16")
        for d in V2_HEAD_DIMS + V2_OPT_IN_HEAD_DIMS
    ]
    for d in V2_FEATURE_HEAD_DIMS:
        out += [
            forward_kernel_name_v2("float16", d, True, 0, False),
            forward_kernel_name_v2("float16", d, False, 1, False),
            forward_kernel_name_v2("float16", d, False, 2, False),
            forward_kernel_name_v2("float16", d, False, 0, True),
            forward_kernel_name_v2("bfloat16", d, True, 1, True),
            # a block mask (arrayattn.flex) with a bool mask and every feature
            forward_kernel_name_v2("bfloat16", d, True, 5, True),
        ]
    # block masks (arrayattn.flex; MASK 4) at every v2 head dim (D = 96 included)
    out += [
        forward_kernel_name_v2(kind, d, False, 4, False)
        for kind in ("float16", "bfloat16")
        for d in V2_HEAD_DIMS + V2_OPT_IN_HEAD_DIMS
    ]
    # aa_fwd_tf32 (v3, float32 on tensor cores): plain at both head dims, block masks, and
    # the features at both
    out += [
        forward_kernel_name_tf32(d, softcap, mk, alibi)
        for d in TF32_HEAD_DIMS
        for softcap, mk, alibi in (
            (False, 0, False), (False, 4, False), (True, 0, False), (False, 1, False),
            (False, 2, False), (False, 0, True), (True, 5, True),
        )
    ]  # fmt: skip
    return out


COMPILE_VARIANTS: dict[str, list[str]] = {_V2_SOURCE: _v2_variants()}
"""Source file -> the v2 name expressions (``.ci/compile_kernels.py``, ``test_nvrtc.py``,
``bench/gpu_variants.py``); v1's list is ``.ci/compile_kernels.py``'s own."""

HOT_VARIANTS: list[str] = [
    forward_kernel_name_v2(kind, d, False, mk, False)
    for kind in ("float16", "bfloat16")
    for d in V2_HEAD_DIMS + V2_OPT_IN_HEAD_DIMS
    for mk in ((0, 4) if d in V2_OPT_IN_HEAD_DIMS else (0,))
] + [forward_kernel_name_tf32(d, False, 0, False) for d in TF32_HEAD_DIMS]
"""v2 variants that must not spill (the plain 16-bit kernels, and D = 96's block-mask ones,
250 registers; causal, windows and lengths are run-time arguments of the same
instantiations)."""
