"""The forward kernels' tile schedule (arrayattn/attention/cuda/tiles.py, mirroring attn_fwd.cu)
against the dense structural mask, on the CPU.

For every query block the kernel visits a range of key tiles and masks elements only on
tiles it does not know to be entirely allowed. The schedule is right when (1) every
allowed (i, j) lies in a visited tile, (2) every tile declared unmasked is entirely
allowed (so skipping the element test changes nothing), and (3) tiles that are neither
needed nor partially masked are not visited beyond the block-rounding of the key range.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrayattn.attention.cuda import tiles
from arrayattn.attention.cuda.tiles import (
    HEAD_DIMS,
    TileConfig,
    allowed,
    block_schedule,
    forward_kernel_name,
    forward_launch,
    head_dim_bucket,
    row_keys,
    tc_row_tiles,
    tile_config,
    tile_config_v2,
)


def dense_allowed(L, S, q_len, kv_len, bottom_right, left, right) -> np.ndarray:
    """The reference: SEMANTICS.md's rule written plainly over the whole L x S grid."""
    offset = (kv_len - q_len) if bottom_right else 0
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ok = (i < q_len) & (j < kv_len)
    if left >= 0:
        ok &= j >= i + offset - left
    if right >= 0:
        ok &= j <= i + offset + right
    return ok


def check_schedule(L, S, q_len, kv_len, bottom_right, left, right, bm, bn) -> None:
    ref = dense_allowed(L, S, q_len, kv_len, bottom_right, left, right)
    offset = (kv_len - q_len) if bottom_right else 0
    for r0 in range(0, L, bm):
        rows = slice(r0, min(r0 + bm, L))
        tiles = block_schedule(r0, bm, bn, q_len, kv_len, offset, left, right)
        visited = np.zeros(S, dtype=bool)
        indices = [n for n, _ in tiles]
        assert indices == sorted(set(indices)), "tiles visited once each, in order"
        for n, masked in tiles:
            c0, c1 = n * bn, min((n + 1) * bn, S)
            assert c0 < max(S, 1), f"tile {n} starts past S={S}"
            visited[c0:c1] = True
            block = ref[rows, c0:c1]
            if not masked:
                # Unmasked tiles: full height (bm rows, all < q_len) and width (bn keys,
                # all < kv_len), every element allowed.
                assert r0 + bm <= q_len and (n + 1) * bn <= kv_len
                assert block.all(), f"tile {n} of rows {r0}.. skipped masking wrongly"
            # The element predicate the kernel applies on masked tiles equals the ref.
            for ii in range(rows.start, rows.stop, max(1, (rows.stop - rows.start) // 5)):
                for jj in range(c0, c1, max(1, (c1 - c0) // 7)):
                    want = bool(ref[ii, jj])
                    got = ii < q_len and allowed(ii, jj, offset, left, right, kv_len)
                    assert got == want
        needed = ref[rows].any(axis=0)
        assert not (needed & ~visited).any(), f"rows {r0}..: allowed keys in unvisited tiles"
        if tiles:
            # No visited tile lies wholly outside the block's key range.
            lo = int(np.argmax(needed)) if needed.any() else None
            if lo is not None:
                hi = int(S - np.argmax(needed[::-1]))
                assert tiles[0][0] == lo // bn and tiles[-1][0] == (hi - 1) // bn
            else:
                pytest.fail(f"rows {r0}..: tiles {tiles} visited with nothing allowed")


CASES = [
    # L, S, q_len, kv_len, bottom_right, left, right
    (300, 300, 300, 300, False, -1, -1),
    (300, 300, 300, 300, False, -1, 0),  # causal top-left
    (200, 517, 200, 517, True, -1, 0),  # causal bottom-right, S > L
    (517, 200, 517, 200, True, -1, 0),  # bottom-right, L > S: leading rows empty
    (517, 200, 517, 200, False, -1, 0),
    (333, 333, 333, 333, False, 64, 0),  # sliding window
    (333, 401, 333, 401, True, 31, 5),
    (256, 256, 256, 256, False, 0, 0),  # diagonal only
    (256, 256, 256, 256, False, 5, -1),
    (300, 280, 123, 201, True, -1, 0),  # per-sequence lengths
    (300, 280, 123, 201, False, 17, 3),
    (300, 280, 0, 201, False, -1, -1),  # empty sequence
    (300, 280, 100, 0, True, -1, 0),  # no keys
    (1, 1, 1, 1, False, -1, 0),
    (129, 65, 129, 65, False, -1, -1),  # one past the tile sizes
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "kind,d", [("float16", 128), ("float16", 256), ("float32", 64), ("float64", 128)]
)
def test_schedule_matches_dense_mask(case, kind, d) -> None:
    cfg = tile_config(kind, d)
    check_schedule(*case, cfg.block_m, cfg.block_n)


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 300),
    S=st.integers(0, 300),
    q_frac=st.floats(0, 1),
    kv_frac=st.floats(0, 1),
    bottom_right=st.booleans(),
    left=st.integers(-1, 90),
    right=st.integers(-1, 90),
    tiles=st.sampled_from([(128, 64), (64, 32), (64, 64), (32, 32)]),
)
def test_schedule_random(L, S, q_frac, kv_frac, bottom_right, left, right, tiles) -> None:
    q_len = int(round(q_frac * L))
    kv_len = int(round(kv_frac * S))
    check_schedule(L, S, q_len, kv_len, bottom_right, left, right, *tiles)


def test_head_dim_bucket() -> None:
    assert head_dim_bucket(64, 64) == 64
    assert head_dim_bucket(80, 64) == 96
    assert head_dim_bucket(1, 130) == 256
    assert head_dim_bucket(257, 1) is None
    assert all(head_dim_bucket(d, d) == d for d in HEAD_DIMS)


def test_tile_configs_fit_shared_memory() -> None:
    # H100/H200: 227 KB of dynamic shared memory per block at most.
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in HEAD_DIMS:
            cfg = tile_config(kind, d)
            assert cfg.smem_bytes <= 227 * 1024, (kind, d, cfg)
            assert cfg.block_m % 16 == 0 and cfg.block_n % 16 == 0


def test_kernel_names() -> None:
    assert (
        forward_kernel_name("bfloat16", 64, True, False, 2) == "aa_fwd_tc<1, 64, 1, true, false, 2>"
    )
    assert forward_kernel_name("float64", 32, False, True, 1) == (
        "aa_fwd_simt<double, 32, false, true, 1>"
    )
    # The heavy variants (dropout, or softcap with a mask) run one row tile per warp.
    assert forward_kernel_name("float16", 128, False, False, 0) == (
        "aa_fwd_tc<0, 128, 2, false, false, 0>"
    )
    assert forward_kernel_name("float16", 128, False, True, 0).startswith("aa_fwd_tc<0, 128, 1,")
    with pytest.raises(ValueError, match="kind"):
        forward_kernel_name("int8", 64, False, False, 0)


# -- v2 (aa_fwd_tc2, ARRAYATTN_FWD_VARIANT=v2) --------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("d", tiles.V2_HEAD_DIMS + tiles.V2_OPT_IN_HEAD_DIMS)
def test_v2_schedule_matches_dense_mask(case, d) -> None:
    cfg = tile_config_v2(d)
    assert (cfg.block_m, cfg.block_n, cfg.threads) == (128, 64, 128)
    check_schedule(*case, cfg.block_m, cfg.block_n)


@settings(max_examples=300, deadline=None)
@given(
    i=st.integers(0, 400),
    q_len=st.integers(0, 400),
    offset=st.integers(-400, 400),
    left=st.integers(-1, 200),
    right=st.integers(-1, 200),
    kv_len=st.integers(0, 400),
    c0=st.sampled_from(range(0, 448, 64)),
)
def test_v2_row_keys_match_allowed(i, q_len, offset, left, right, kv_len, c0) -> None:
    """v2's branch-free element test on masked tiles (one unsigned compare per key) is
    the structural rule, key by key, for every key of a 64-key tile."""
    for t in range(4):  # the four threads of a row, each at keys c0 + 2t + 8 nt + e
        base, span = row_keys(i, q_len, offset, left, right, kv_len, c0 + 2 * t)
        for k in [8 * nt + e for nt in range(8) for e in (0, 1)]:
            want = i < q_len and allowed(i, c0 + 2 * t + k, offset, left, right, kv_len)
            assert (((base + k) & 0xFFFFFFFF) <= span) == want, (t, k)


def test_v2_fits_two_blocks_per_sm() -> None:
    # sm_90: 228 KB of shared memory per SM, 1 KB reserved per block; 227 KB per block.
    for d in tiles.V2_HEAD_DIMS + tiles.V2_OPT_IN_HEAD_DIMS:
        smem = tile_config_v2(d).smem_bytes
        assert 2 * (smem + 1024) <= 228 * 1024, (d, smem)
    assert tile_config_v2(128).smem_bytes == (128 + 4 * 64) * 136 * 2


def test_forward_variant_switch(monkeypatch) -> None:
    monkeypatch.delenv("ARRAYATTN_FWD_VARIANT", raising=False)
    assert tiles.forward_variant() == tiles.DEFAULT_FWD_VARIANT == "v3"  # measured faster
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", "")
    assert tiles.forward_variant() == "v3"
    assert forward_launch("float32", 128, False, False, 0, False, 0.1).name.startswith(
        "aa_fwd_tf32<128,"
    )
    assert forward_launch("float16", 128, False, False, 0, False, 0.1).variant == "v2"
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", "v1")
    assert tiles.forward_variant() == "v1"
    assert forward_launch("float16", 128, False, False, 0, False, 0.1).variant == "v1"
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", "v2")
    assert tiles.forward_variant() == "v2"
    assert forward_launch("float16", 128, False, False, 0, False, 0.1).variant == "v2"
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", "V2")
    with pytest.raises(ValueError, match="ARRAYATTN_FWD_VARIANT"):
        tiles.forward_variant()
    with pytest.raises(ValueError, match="variant"):
        forward_launch("float16", 128, False, False, 0, False, 0.1, "v9")


def test_v2_d96_switch(monkeypatch) -> None:
    """D = 96 runs v2 (aa_fwd_tc2, 64-key tiles) unless ARRAYATTN_FWD_TC2_D96=0, under
    v2 and v3 (the default), for what v2 runs at D = 128 (block masks included; softcap,
    dense masks, ALiBi and dropout stay on v1), with compiled, spill-checked
    instantiations; v1 ignores the switch."""
    compiled = set(tiles.COMPILE_VARIANTS["attn_fwd.cu"])
    monkeypatch.setenv(tiles.TC2_D96_ENV, "0")
    for variant in ("v2", "v3"):
        assert forward_launch("float16", 96, False, False, 0, False, 0.1, variant).variant == "v1"
    monkeypatch.delenv(tiles.TC2_D96_ENV, raising=False)
    assert forward_launch("float16", 96, False, False, 0, False, 0.1, "v3").variant == "v2"
    monkeypatch.setenv(tiles.TC2_D96_ENV, "1")
    for kind in ("float16", "bfloat16"):
        for mk in (0, 4):
            for variant in ("v2", "v3"):
                launch = forward_launch(kind, 96, False, False, mk, False, 0.1, variant)
                assert launch.variant == "v2" and launch.config == tile_config_v2(96)
                assert launch.name in compiled and launch.name in tiles.HOT_VARIANTS
            assert forward_launch(kind, 96, False, False, mk, False, 0.1, "v1").variant == "v1"
        for softcap, dropout, mask, alibi in _FLAGS:
            if softcap or dropout or mask or alibi:
                launch = forward_launch(kind, 96, softcap, dropout, mask, alibi, 0.1, "v3")
                assert launch.variant == "v1", (softcap, dropout, mask, alibi)
    assert forward_launch("float16", 64, False, False, 0, False, 0.1, "v3").variant == "v2"
    monkeypatch.setenv(tiles.TC2_D96_ENV, "yes")
    with pytest.raises(ValueError, match=tiles.TC2_D96_ENV):
        forward_launch("float16", 96, False, False, 0, False, 0.1, "v3")
    assert tile_config_v2(96) == TileConfig(128, 64, 128, (128 + 4 * 64) * 104 * 2)


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_v3_is_v2_with_float32_on_tensor_cores(kind, d) -> None:
    """v3 runs aa_fwd_tf32 where tf32_declines says so (float32 at D = 64/128, no dropout,
    scale > 0), with a compiled instantiation (block masks included); every other call gets
    exactly v2's launch."""
    compiled = set(tiles.COMPILE_VARIANTS["attn_fwd.cu"])
    for softcap, dropout, mask, alibi in _FLAGS:
        for scale in (0.125, 0.0):
            for flex in (0, 4):
                mk = mask | flex
                v2 = forward_launch(kind, d, softcap, dropout, mk, alibi, scale, "v2")
                v3 = forward_launch(kind, d, softcap, dropout, mk, alibi, scale, "v3")
                if tiles.tf32_declines(kind, d, dropout, scale) is not None:
                    assert v3 == v2
                    continue
                assert kind == "float32" and d in tiles.TF32_HEAD_DIMS
                assert not dropout and scale > 0
                assert v3.variant == "v3" and v3.config == tiles.tile_config_tf32(d)
                assert v3.name == tiles.forward_kernel_name_tf32(d, softcap, mk, alibi)
                if (softcap, mk, alibi) in ((False, 0, False), (False, 4, False)):
                    assert v3.name in compiled


_FLAGS = [
    (softcap, dropout, mask, alibi)
    for softcap in (False, True)
    for dropout in (False, True)
    for mask in (0, 1, 2)
    for alibi in (False, True)
]


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_v1_launch_is_unchanged(kind, d) -> None:
    """The v1 launch is exactly what fused.py computed before the switch."""
    tc = kind in ("float16", "bfloat16")
    for softcap, dropout, mask, alibi in _FLAGS:
        launch = forward_launch(kind, d, softcap, dropout, mask, alibi, 0.125, "v1")
        mt = tc_row_tiles(d, tiles.is_heavy(softcap, dropout, mask)) if tc else None
        assert launch.variant == "v1"
        assert launch.name == forward_kernel_name(kind, d, softcap, dropout, mask, mt)
        assert launch.config == tile_config(kind, d, mt)


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_v2_serves_or_declines_to_v1(kind, d) -> None:
    """v2 runs where v2_declines says so, with a compiled instantiation; everywhere else
    the call gets exactly the v1 launch."""
    compiled = set(tiles.COMPILE_VARIANTS["attn_fwd.cu"])
    for softcap, dropout, mask, alibi in _FLAGS:
        for scale in (0.125, 0.0, -0.5):
            v1 = forward_launch(kind, d, softcap, dropout, mask, alibi, scale, "v1")
            v2 = forward_launch(kind, d, softcap, dropout, mask, alibi, scale, "v2")
            reason = tiles.v2_declines(kind, d, dropout, scale, softcap, mask, alibi)
            if reason is not None:
                assert v2 == v1, reason
                continue
            assert kind in ("float16", "bfloat16") and d in tiles.v2_head_dims()
            assert not dropout and scale > 0
            assert v2.variant == "v2" and v2.name.startswith("aa_fwd_tc2<")
            assert v2.config == tile_config_v2(d)
            if not (softcap or mask or alibi):
                assert v2.name in tiles.HOT_VARIANTS
            if (kind, softcap, mask, alibi) in (
                ("float16", False, 0, False),
                ("bfloat16", False, 0, False),
                ("float16", True, 0, False),
                ("float16", False, 1, False),
                ("float16", False, 2, False),
                ("float16", False, 0, True),
                ("bfloat16", True, 1, True),
            ):
                assert v2.name in compiled, v2.name
