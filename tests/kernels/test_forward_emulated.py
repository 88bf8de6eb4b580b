"""The forward kernels of attn_fwd.cu, run on the CPU under a host emulator, against a
float64 reference written plainly here.

``forward_emulator.h`` supplies one OS thread per CUDA thread, barriers, warp shuffles,
and the PTX operations (ldmatrix, mma.sync m16n8k16, cp.async groups) following the PTX
ISA fragment layouts, so this runs the kernels' own source: tile indexing, fragment
layouts, pipeline bookkeeping, online softmax, masks, lengths, dropout, empty rows. It
does not show GPU-only effects (real asynchrony, ex2.approx rounding, performance).
The output buffers start poisoned with NaN bytes.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import _tsan as tsan
import numpy as np
import pytest

from arrayattn.attention.cuda.tiles import (
    DIAG_FROM_LENGTHS,
    TC2_D96_ENV,
    ForwardLaunch,
    TileConfig,
    forward_kernel_name,
    forward_launch,
    is_heavy,
    tc_row_tiles,
    tile_config,
    tile_config_tf32,
    tile_config_v2,
)
from arrayattn.attention.dropout import dropout_keep, dropout_threshold

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _launch_opted_in(*args) -> ForwardLaunch:
    """``forward_launch`` with ``ARRAYATTN_FWD_TC2_D96=1`` (v2 at D = 96, off by default),
    so that the D = 96 cases run aa_fwd_tc2 whatever the caller's environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TC2_D96_ENV, "1")
        return forward_launch(*args)


@dataclass(frozen=True)
class Case:
    kind: str
    d: int
    B: int = 1
    Hq: int = 2
    Hkv: int = 1
    L: int = 70
    S: int = 75
    causal: bool = False
    bottom_right: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    dropout_p: float = 0.0
    mask_kind: int = 0  # 0 none, 1 bool, 2 float
    mask_b: bool = True  # mask varies over batch (else broadcast)
    mask_h: bool = True  # ... over heads
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None
    bshd: bool = False  # q/k/v stored (B, L, H, D): strided rows
    seed: int = 1234
    mt: int | None = None  # tensor-core row tiles per warp (None: the default)
    sinks: bool = False  # gpt-oss sinks, one logit per (batch, head)
    alibi: bool = False  # ALiBi slopes, one per (batch, head)
    variant: str = "v1"  # forward kernel variant (ARRAYATTN_FWD_VARIANT): v1, v2 or v3
    k_boost: int = 0  # the first k_boost keys scaled by 4: row maxima early, later tiles
    # mostly raise none (v2's rescale skip)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def row_tiles(self) -> int | None:
        """The tensor-core MT this case runs (as fused.py would pick it), None for SIMT."""
        if self.kind not in ("float16", "bfloat16"):
            return None
        if self.mt is not None:
            return self.mt
        heavy = is_heavy(self.softcap is not None, self.dropout_p > 0, self.mask_kind)
        return tc_row_tiles(self.d, heavy)

    @property
    def kernel(self) -> str:
        if self.variant in ("v2", "v3"):
            launch = _launch_opted_in(
                self.kind,
                self.d,
                self.softcap is not None,
                self.dropout_p > 0,
                self.mask_kind,
                self.alibi,
                1.0 / math.sqrt(self.d),
                self.variant,
            )
            assert launch.variant == self.variant, f"{self.variant} declines {self}"
            return launch.name
        return forward_kernel_name(
            self.kind,
            self.d,
            self.softcap is not None,
            self.dropout_p > 0,
            self.mask_kind,
            self.row_tiles,
        )


CASES = {
    "f16_d64_gqa_bshd_ragged": Case("float16", 64, Hq=4, Hkv=2, L=150, S=141, bshd=True),
    "f16_d64_causal_br_lengths": Case(
        "float16",
        64,
        B=2,
        Hq=1,
        L=70,
        S=200,
        causal=True,
        bottom_right=True,
        q_lens=(70, 33),
        kv_lens=(200, 150),
    ),
    "f16_d128_causal_tl": Case("float16", 128, Hq=1, L=129, S=129, causal=True),
    "f16_d128_mt1_causal_tl": Case("float16", 128, Hq=1, L=129, S=129, causal=True, mt=1),
    "f16_d64_mt1_gqa_bshd_ragged": Case("float16", 64, Hq=4, Hkv=2, L=150, S=141, bshd=True, mt=1),
    "f16_d96_window_dropout": Case(
        "float16", 96, Hq=2, L=140, S=100, window=(30, 10), dropout_p=0.1
    ),
    "bf16_d32_softcap_dropout_window_floatmask": Case(
        "bfloat16",
        32,
        B=2,
        Hq=2,
        Hkv=2,
        L=130,
        S=97,
        window=(20, 5),
        softcap=2.0,
        dropout_p=0.3,
        mask_kind=2,
        mask_b=False,
    ),
    # Blocks with no key tile at all (kv_len 0; query blocks past q_len): only the Q copy
    # is in flight when the epilogue reuses its shared memory for the output.
    "f16_d64_no_key_tiles": Case(
        "float16", 64, B=2, Hq=1, L=260, S=90, q_lens=(260, 20), kv_lens=(0, 90)
    ),
    "f16_d256_boolmask_empty_rows": Case(
        "float16", 256, Hq=1, L=70, S=75, mask_kind=1, mask_h=False
    ),
    "f32_d64_causal_gqa_softcap_dropout_bool": Case(
        "float32",
        64,
        Hq=4,
        Hkv=2,
        L=100,
        S=90,
        causal=True,
        softcap=5.0,
        dropout_p=0.2,
        mask_kind=1,
    ),
    "f64_d32_window_lengths_floatmask": Case(
        "float64",
        32,
        B=2,
        Hq=2,
        Hkv=1,
        L=45,
        S=80,
        window=(7, 3),
        bottom_right=True,
        q_lens=(45, 20),
        kv_lens=(60, 80),
        mask_kind=2,
        bshd=True,
    ),
    # Sinks and ALiBi (runtime options of the same instantiations): with empty rows
    # (a masked row, rows past q_len, a sequence with no key) where the sink alone is left.
    "f16_d64_sinks_alibi_causal_br_lengths": Case(
        "float16",
        64,
        B=2,
        Hq=2,
        Hkv=1,
        L=70,
        S=200,
        causal=True,
        bottom_right=True,
        q_lens=(70, 33),
        kv_lens=(200, 0),
        sinks=True,
        alibi=True,
    ),
    "bf16_d128_sinks_alibi_window_dropout_boolmask": Case(
        "bfloat16",
        128,
        Hq=2,
        L=140,
        S=100,
        window=(30, 10),
        dropout_p=0.1,
        mask_kind=1,
        sinks=True,
        alibi=True,
    ),
    "f32_d64_sinks_alibi_softcap_gqa": Case(
        "float32", 64, Hq=4, Hkv=2, L=100, S=90, softcap=5.0, sinks=True, alibi=True
    ),
    "f64_d32_sinks_alibi_floatmask_tl": Case(
        "float64", 32, B=2, Hq=2, L=45, S=80, causal=True, mask_kind=2, sinks=True, alibi=True
    ),
}

# The v2 tensor-core kernel (aa_fwd_tc2, ARRAYATTN_FWD_VARIANT=v2) on the same option
# matrix, less dropout (v2 declines it: tiles.v2_declines); 64-key tiles, so S spans
# several tiles and ragged tails, and k_boost makes later tiles skip the O rescale.
V2_CASES = {
    "v2_f16_d64_gqa_bshd_ragged": Case(
        "float16", 64, Hq=4, Hkv=2, L=150, S=141, bshd=True, variant="v2"
    ),
    "v2_f16_d64_causal_br_lengths": Case(
        "float16",
        64,
        B=2,
        Hq=1,
        L=70,
        S=200,
        causal=True,
        bottom_right=True,
        q_lens=(70, 33),
        kv_lens=(200, 150),
        variant="v2",
    ),
    "v2_f16_d128_causal_tl": Case("float16", 128, Hq=1, L=200, S=200, causal=True, variant="v2"),
    "v2_f16_d128_rescale_skip": Case("float16", 128, Hq=1, L=130, S=300, k_boost=64, variant="v2"),
    "v2_bf16_d128_noncausal_gqa": Case("bfloat16", 128, Hq=2, Hkv=1, L=140, S=257, variant="v2"),
    "v2_f16_d128_window": Case("float16", 128, Hq=2, L=140, S=100, window=(30, 10), variant="v2"),
    "v2_bf16_d128_causal_br": Case(
        "bfloat16", 128, Hq=1, L=90, S=230, causal=True, bottom_right=True, variant="v2"
    ),
    "v2_f16_d64_softcap_window_floatmask": Case(
        "float16",
        64,
        B=2,
        Hq=2,
        Hkv=2,
        L=130,
        S=97,
        window=(20, 5),
        softcap=2.0,
        mask_kind=2,
        mask_b=False,
        variant="v2",
    ),
    "v2_f16_d64_no_key_tiles": Case(
        "float16", 64, B=2, Hq=1, L=260, S=90, q_lens=(260, 20), kv_lens=(0, 90), variant="v2"
    ),
    "v2_f16_d64_boolmask_empty_rows": Case(
        "float16", 64, Hq=1, L=70, S=75, mask_kind=1, mask_h=False, variant="v2"
    ),
    "v2_f16_d64_floatmask_causal": Case(
        "float16", 64, Hq=1, L=100, S=150, causal=True, mask_kind=2, variant="v2"
    ),
    "v2_f16_d64_softcap_causal_br": Case(
        "float16",
        64,
        Hq=1,
        L=70,
        S=160,
        causal=True,
        bottom_right=True,
        softcap=3.0,
        variant="v2",
    ),
    "v2_f16_d64_sinks_alibi_causal_br_lengths": Case(
        "float16",
        64,
        B=2,
        Hq=2,
        Hkv=1,
        L=70,
        S=200,
        causal=True,
        bottom_right=True,
        q_lens=(70, 33),
        kv_lens=(200, 0),
        sinks=True,
        alibi=True,
        variant="v2",
    ),
    "v2_f16_d64_alibi_window": Case(
        "float16", 64, Hq=2, L=140, S=180, window=(50, 20), alibi=True, variant="v2"
    ),
    "v2_bf16_d64_sinks_alibi_softcap_window_boolmask": Case(
        "bfloat16",
        64,
        Hq=2,
        L=140,
        S=100,
        window=(30, 10),
        softcap=2.0,
        mask_kind=1,
        sinks=True,
        alibi=True,
        variant="v2",
    ),
}
# v2 at D = 96 (ARRAYATTN_FWD_TC2_D96=1): 12 chunks a row copied by 96 of the 128 threads,
# 6 k-steps, 12 O n-tiles; the options v2 runs at D = 128 (causal both alignments,
# windows, lengths, GQA, strided rows, sinks, blocks with no key tile, the O rescale skip;
# block masks in test_forward_flex_emulated.py).
V2_CASES.update({
    "v2_f16_d96_gqa_bshd_ragged_rescale": Case(
        "float16", 96, Hq=4, Hkv=2, L=150, S=141, bshd=True, k_boost=64, variant="v2"
    ),
    "v2_bf16_d96_causal_br_lengths_sinks": Case(
        "bfloat16", 96, B=2, Hq=2, Hkv=1, L=70, S=200, causal=True, bottom_right=True,
        q_lens=(70, 33), kv_lens=(200, 0), sinks=True, variant="v2",
    ),
    "v2_f16_d96_causal_tl_window": Case(
        "float16", 96, Hq=1, L=200, S=230, causal=True, window=(90, 0), variant="v2"
    ),
})  # fmt: skip
CASES.update(V2_CASES)

# aa_fwd_tf32 (float32 on tensor cores as three TF32 products, ARRAYATTN_FWD_VARIANT=v3):
# 64 x 64 tiles at D = 64, 64 x 32 at D = 128; float32's tolerance (1e-5) holds it to
# float accuracy, which a single TF32 product (about 1e-3) would fail.
TF32_CASES = {
    "v3_f32_d64_gqa_bshd_ragged": Case(
        "float32", 64, Hq=4, Hkv=2, L=150, S=141, bshd=True, variant="v3"
    ),
    "v3_f32_d128_causal_br_lengths_rescale": Case(
        "float32", 128, B=2, Hq=1, L=70, S=200, causal=True, bottom_right=True,
        q_lens=(70, 33), kv_lens=(200, 150), k_boost=64, variant="v3",
    ),
    "v3_f32_d128_window_boolmask_empty_rows": Case(
        "float32", 128, Hq=2, L=100, S=75, window=(30, 10), mask_kind=1, mask_h=False,
        variant="v3",
    ),
    "v3_f32_d64_sinks_alibi_softcap_floatmask": Case(
        "float32", 64, B=2, Hq=2, Hkv=1, L=90, S=130, causal=True, softcap=2.0, mask_kind=2,
        sinks=True, alibi=True, variant="v3",
    ),
    "v3_f32_d64_no_key_tiles": Case(
        "float32", 64, B=2, Hq=1, L=140, S=90, q_lens=(140, 20), kv_lens=(0, 90), variant="v3"
    ),
}  # fmt: skip
CASES.update(TF32_CASES)

_STORAGE = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
}


def _cfg_struct(kind: str, d: int, mt: int | None, variant: str = "v1") -> str:
    if variant == "v2":
        return f"AaTc2Cfg<{d}>"
    if variant == "v3" and kind == "float32":
        return f"AaTf32Cfg<{d}>"
    if kind in ("float16", "bfloat16"):
        return f"AaTcCfg<{d}, {mt}>"
    return f"AaSimtCfg<{'double' if kind == 'float64' else 'float'}, {d}>"


def _defines(kind: str, d: int, kernel: str, mt: int | None, variant: str = "v1") -> list[str]:
    tio = {
        "float16": "unsigned short",
        "bfloat16": "unsigned short",
        "float32": "float",
        "float64": "double",
    }[kind]
    tacc = "double" if kind == "float64" else "float"
    return [
        f"-DAA_KERNEL={kernel}",
        f"-DAA_TIO={tio}",
        f"-DAA_TACC={tacc}",
        f"-DAA_CFG={_cfg_struct(kind, d, mt, variant)}",
    ]


def build_emulator(
    case: Case,
    exe: Path,
    flags: tuple[str, ...] = ("-O1",),
    kernels_dir: Path | None = None,
) -> str:
    """Compile the emulator driver for ``case``'s kernel into ``exe``; returns the
    compiler's error text ("" on success). ``kernels_dir`` replaces the package's kernel
    sources (a mutated copy)."""
    kernels = kernels_dir or Path(str(resources.files("arrayattn.attention.cuda")))
    cmd = [
        "g++",
        "-std=c++20",
        *flags,
        "-pthread",
        "-I",
        str(HERE),
        "-I",
        str(kernels),
        *_defines(case.kind, case.d, case.kernel, case.row_tiles, case.variant),
        str(HERE / "forward_emulator_main.cpp"),
        "-o",
        str(exe),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res.stderr if res.returncode else ""


@pytest.fixture(scope="module")
def executables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the host emulator")
    variants = {c.kernel: c for c in CASES.values()}
    return build_emulators(variants, tmp_path_factory.mktemp("fwd_emu"))


def build_emulators(
    cases: dict[str, Case],
    work: Path,
    flags: tuple[str, ...] = ("-O1",),
    kernels_dir: Path | None = None,
) -> dict[str, Path]:
    """One emulator executable per entry of ``cases`` (two compiles at a time), keyed alike;
    a compile error fails the test. ``kernels_dir`` as for :func:`build_emulator`."""

    def build(key: str) -> tuple[str, Path, str]:
        exe = work / f"emu_{abs(hash(key))}"
        return key, exe, build_emulator(cases[key], exe, flags, kernels_dir)

    out = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for key, exe, err in pool.map(build, cases):
            if err:
                pytest.fail(f"building the emulator for {key} ({flags}) failed:\n{err[-3000:]}")
            out[key] = exe
    return out


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _inputs(case: Case, rng: np.random.Generator):
    """Random inputs in the storage dtype, and their exact float64 values."""
    shapes = {
        "q": (case.B, case.Hq, case.L, case.d),
        "k": (case.B, case.Hkv, case.S, case.d),
        "v": (case.B, case.Hkv, case.S, case.d),
    }
    stored, exact = {}, {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape) * (1.5 if name != "v" else 1.0)
        if name == "k" and case.k_boost:
            x[:, :, : case.k_boost] *= 4.0
        if case.kind == "bfloat16":
            bits = _bf16_bits(x)
            stored[name], exact[name] = bits, _bf16_value(bits)
        else:
            xs = x.astype(_STORAGE[case.kind])
            stored[name], exact[name] = xs, xs.astype(np.float64)
    mask = None
    if case.mask_kind:
        mshape = (case.B if case.mask_b else 1, case.Hq if case.mask_h else 1, case.L, case.S)
        if case.mask_kind == 1:
            mask = rng.random(mshape) < 0.8
            mask[..., 3, :] = False  # an empty row (output 0, LSE -inf)
        else:
            mask = rng.standard_normal(mshape)
            mask[..., 5, ::3] = -np.inf
            mask = mask.astype(np.float64 if case.kind == "float64" else np.float32)
    acc = np.float64 if case.kind == "float64" else np.float32
    if case.sinks:  # (B, Hq) logits around the scores' scale, one very large
        sinks = (rng.standard_normal((case.B, case.Hq)) * 2.0).astype(acc)
        sinks[0, 0] = 30.0
        stored["sinks"], exact["sinks"] = sinks, sinks.astype(np.float64)
    if case.alibi:  # BLOOM-like geometric slopes, varied per batch
        base = 2.0 ** -np.arange(1, case.Hq + 1)
        slopes = (base[None, :] * (1.0 + np.arange(case.B)[:, None])).astype(acc)
        stored["alibi"], exact["alibi"] = slopes, slopes.astype(np.float64)
    return stored, exact, mask


def _structure(case: Case) -> tuple[int, int]:
    left, right = case.window if case.window is not None else (-1, -1)
    if case.causal:
        right = 0 if right == -1 else min(right, 0)
    return left, right


def reference(case: Case, x: dict, mask) -> tuple[np.ndarray, np.ndarray]:
    """SEMANTICS.md in float64, one (batch, head) at a time."""
    q, k, v = x["q"], x["k"], x["v"]
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    G = Hq // case.Hkv
    scale = 1.0 / math.sqrt(case.d)
    left, right = _structure(case)
    out = np.zeros((B, Hq, L, case.d))
    lse = np.full((B, Hq, L), -np.inf)
    for b in range(B):
        ql = case.q_lens[b] if case.q_lens else L
        kl = case.kv_lens[b] if case.kv_lens else S
        off = (kl - ql) if case.bottom_right else 0
        i = np.arange(L)[:, None]
        j = np.arange(S)[None, :]
        ok = (i < ql) & (j < kl)
        if left >= 0:
            ok = ok & (j >= i + off - left)
        if right >= 0:
            ok = ok & (j <= i + off + right)
        for h in range(Hq):
            s = scale * (q[b, h] @ k[b, h // G].T)
            if case.softcap is not None:
                s = case.softcap * np.tanh(s / case.softcap)
            if "alibi" in x:  # FlashAttention's ALiBi: -slope * |i + offset - j|
                s = s - x["alibi"][b, h] * np.abs(i + off - j)
            allow = ok.copy()
            if mask is not None:
                mb = mask[b if case.mask_b else 0, h if case.mask_h else 0]
                if case.mask_kind == 1:
                    allow &= mb
                else:
                    s = s + mb
            s = np.where(allow, s, -np.inf)
            if "sinks" in x:  # gpt-oss: the sink is one more logit column with no value
                s = np.concatenate([s, np.full((L, 1), x["sinks"][b, h])], axis=1)
            m = s.max(axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(s - m)
            tot = e.sum(axis=1, keepdims=True)
            if "sinks" in x:
                e = e[:, :-1]
            p = e / np.where(tot > 0, tot, 1.0)
            lse[b, h] = np.where(
                tot[:, 0] > 0, m[:, 0] + np.log(np.where(tot > 0, tot, 1))[:, 0], -np.inf
            )
            if case.dropout_p > 0:
                import array_api_compat.numpy as xnp

                keep = dropout_keep(
                    xnp,
                    case.seed,
                    case.dropout_p,
                    np.int32(b),
                    np.int32(h),
                    np.arange(L, dtype=np.int32)[:, None],
                    np.arange(S, dtype=np.int32),
                )
                p = np.where(keep, p / (1.0 - case.dropout_p), 0.0)
            out[b, h] = p @ v[b, h // G]
    return out, lse


def _launch_config(case: Case) -> TileConfig:
    """The launch shape fused.py would use for ``case``'s kernel."""
    if case.variant == "v2":
        return tile_config_v2(case.d)
    if case.variant == "v3":
        return tile_config_tf32(case.d)
    return tile_config(case.kind, case.d, case.row_tiles)


def launch_emulator(
    exe: Path, case: Case, stored: dict, mask, work: Path, eager: bool = False
) -> subprocess.CompletedProcess:
    """Write the inputs, run the emulator; its exit status and stderr are the caller's."""
    tc = _launch_config(case)
    left, right = _structure(case)
    header = np.array(
        [
            case.B,
            case.Hq,
            case.Hkv,
            case.L,
            case.S,
            case.d,
            case.Hq // case.Hkv,
            DIAG_FROM_LENGTHS if case.bottom_right else 0,
            left,
            right,
            case.mask_kind,
            int(case.mask_b),
            int(case.mask_h),
            int(case.q_lens is not None),
            int(case.kv_lens is not None),
            case.seed,
            dropout_threshold(case.dropout_p) if case.dropout_p > 0 else 0,
            int(case.bshd),
            tc.smem_bytes,
            tc.block_m,
            int(case.sinks),
            int(case.alibi),
        ],
        dtype=np.int64,
    )
    scale = 1.0 / math.sqrt(case.d)
    floats = np.array([scale, case.softcap or 0.0, 1.0 / (1.0 - case.dropout_p), 0.0])
    path_in, path_out = work / "in.bin", work / "out.bin"
    with open(path_in, "wb") as f:
        f.write(header.tobytes())
        f.write(floats.tobytes())
        for name in ("q", "k", "v"):
            a = stored[name]
            if case.bshd:
                a = np.transpose(a, (0, 2, 1, 3))  # stored (B, L, H, D)
            f.write(np.ascontiguousarray(a).tobytes())
        if mask is not None:
            m = mask.astype(np.uint8) if case.mask_kind == 1 else mask
            f.write(np.ascontiguousarray(m).tobytes())
        if case.q_lens is not None:
            f.write(np.asarray(case.q_lens, dtype=np.int32).tobytes())
        if case.kv_lens is not None:
            f.write(np.asarray(case.kv_lens, dtype=np.int32).tobytes())
        for name in ("sinks", "alibi"):
            if name in stored:
                f.write(np.ascontiguousarray(stored[name]).tobytes())
    env = dict(os.environ)
    env.pop("AA_EMU_EAGER", None)
    if eager:
        env["AA_EMU_EAGER"] = "1"
    return subprocess.run(
        [str(exe), str(path_in), str(path_out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def run_emulated(exe: Path, case: Case, stored: dict, mask, work: Path, eager: bool = False):
    """Run the kernel under the emulator; (output, LSE) as float64 arrays."""
    res = launch_emulator(exe, case, stored, mask, work, eager)
    assert res.returncode == 0, f"emulator exit {res.returncode}: {res.stderr[-2000:]}"
    return read_outputs(case, work)


def read_outputs(case: Case, work: Path) -> tuple[np.ndarray, np.ndarray]:
    """(output, LSE) as float64 arrays from the emulator's last run in ``work``."""
    raw = (work / "out.bin").read_bytes()
    n_out = case.B * case.Hq * case.L * case.d
    tio = np.uint16 if case.kind == "bfloat16" else _STORAGE[case.kind]
    isz = np.dtype(tio).itemsize
    out = np.frombuffer(raw[: n_out * isz], dtype=tio).reshape(case.B, case.Hq, case.L, case.d)
    out = _bf16_value(out) if case.kind == "bfloat16" else out.astype(np.float64)
    lse_t = np.float64 if case.kind == "float64" else np.float32
    lse = np.frombuffer(raw[n_out * isz :], dtype=lse_t).reshape(case.B, case.Hq, case.L)
    return out, lse.astype(np.float64)


_TOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}
_LSE_TOL = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-5, "float64": 1e-12}


_EAGER = [
    "f16_d64_gqa_bshd_ragged",
    "f16_d256_boolmask_empty_rows",
    "v2_f16_d64_gqa_bshd_ragged",
    "v2_f16_d128_causal_tl",
]


@pytest.mark.parametrize("name,eager", [(n, False) for n in CASES] + [(n, True) for n in _EAGER])
def test_forward_kernel_emulated(name: str, eager: bool, executables, tmp_path: Path) -> None:
    case = CASES[name]
    rng = np.random.default_rng()  # fresh inputs every run
    stored, exact, mask = _inputs(case, rng)
    out, lse = run_emulated(executables[case.kernel], case, stored, mask, tmp_path, eager)
    _assert_matches_reference(case, out, lse, *reference(case, exact, mask))


def _assert_matches_reference(case: Case, out, lse, ref_out, ref_lse) -> None:

    assert not np.isnan(out).any(), "NaN in the output (unwritten or a NaN leak)"
    assert not np.isnan(lse).any(), "NaN in the LSE"
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="empty rows differ")
    assert (out[empty] == 0).all(), "empty rows must give exactly 0"
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert err <= _TOL[case.kind], f"relative Frobenius error {err:.2e}"
    finite = ~empty
    lse_err = np.max(np.abs(lse[finite] - ref_lse[finite]) / np.maximum(1, np.abs(ref_lse[finite])))
    assert lse_err <= _LSE_TOL[case.kind], f"LSE error {lse_err:.2e}"


# -- data races ---------------------------------------------------------------------------
# The same emulator built with ThreadSanitizer. Every CUDA thread is an OS thread and every
# barrier an emulator_barrier.h barrier (which orders nothing but its own threads), so
# TSan's happens-before analysis sees exactly the kernel's own ordering: a shared-memory
# access from another thread with no __syncthreads (or warp barrier) in between is
# reported whatever order the threads happened to run in. cp.async copies land at the
# issuing thread's wait_group (a read that needs them without a barrier after that wait is
# a race); with AA_EMU_EAGER=1 they land at issue, which exposes a copy into a buffer
# another thread may still be reading (write after read).
_RACE_CASES = {
    # MT = 2 (Q fragments re-read from shared memory), GQA, strided rows, two row blocks
    # and a ragged second key tile.
    "f16_d64_mt2_gqa": Case("float16", 64, Hq=2, Hkv=1, L=140, S=80, bshd=True),
    # MT = 1 (Q in registers), causal block skipping.
    "f16_d64_mt1_causal": Case("float16", 64, Hq=1, L=140, S=140, causal=True, mt=1),
    # Blocks with no key tile: the epilogue reuses the Q buffer with only Q's copy in flight.
    "f16_d64_no_key_tiles": CASES["f16_d64_no_key_tiles"],
    # Sinks and ALiBi (runtime pointers read by every thread, the sink fold in the epilogue).
    "f16_d64_sinks_alibi": Case(
        "float16",
        64,
        Hq=2,
        Hkv=1,
        L=70,
        S=80,
        causal=True,
        bottom_right=True,
        sinks=True,
        alibi=True,
    ),  # fmt: skip
    # v2 (aa_fwd_tc2): one barrier per key tile, K[n+1] and V[n+1] copied into the other
    # stage right after it; two row blocks, GQA, strided rows, ragged tails.
    "v2_f16_d64_gqa": Case("float16", 64, Hq=2, Hkv=1, L=140, S=150, bshd=True, variant="v2"),
    "v2_f16_d64_causal": Case("float16", 64, Hq=1, L=140, S=140, causal=True, variant="v2"),
    "v2_f16_d64_no_key_tiles": CASES["v2_f16_d64_no_key_tiles"],
    # D = 96: warp 3 copies no K/V row; blocks with no key tile and a ragged second tile.
    "v2_f16_d96_no_key_tiles": Case(
        "float16", 96, B=2, Hq=1, L=260, S=90, q_lens=(260, 20), kv_lens=(0, 90), variant="v2"
    ),
    # v3 (aa_fwd_tf32): the same one-barrier schedule in float; blocks with no key tile and
    # a sequence of two key tiles.
    "v3_f32_d64_no_key_tiles": CASES["v3_f32_d64_no_key_tiles"],
    # The CUDA-core kernels, float and double.
    "f32_d64_causal_gqa_softcap_dropout_bool": CASES["f32_d64_causal_gqa_softcap_dropout_bool"],
    "f64_d32_window_lengths_floatmask": CASES["f64_d32_window_lengths_floatmask"],
}


@pytest.fixture(scope="module")
def tsan_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the host emulator")
    work = tmp_path_factory.mktemp("fwd_tsan")
    if not tsan.program_runs(work):
        pytest.skip("g++ cannot build and run a -fsanitize=thread program here")
    return work


@pytest.fixture(scope="module")
def tsan_executables(tsan_work: Path) -> dict[str, Path]:
    """kernel -> its ThreadSanitizer build: one compile per distinct kernel, shared by the
    race cases that run it (the build depends on the kernel alone, as ``executables``)."""
    return build_emulators({c.kernel: c for c in _RACE_CASES.values()}, tsan_work, tsan.FLAGS)


@pytest.mark.parametrize("eager", [False, True], ids=["copies_at_wait", "copies_at_issue"])
@pytest.mark.parametrize("name", _RACE_CASES)
def test_forward_kernel_has_no_data_race(
    name: str, eager: bool, tsan_executables, tmp_path: Path
) -> None:
    case = _RACE_CASES[name]
    stored, exact, mask = _inputs(case, np.random.default_rng())
    res = launch_emulator(tsan_executables[case.kernel], case, stored, mask, tmp_path, eager)
    assert tsan.REPORT not in res.stderr, f"ThreadSanitizer report:\n{res.stderr[:6000]}"
    assert res.returncode == 0, f"emulator exit {res.returncode}: {res.stderr[-2000:]}"
    out, lse = read_outputs(case, tmp_path)
    _assert_matches_reference(case, out, lse, *reference(case, exact, mask))


def _barrier_sites() -> list[tuple[int, str]]:
    """(occurrence, kernel) of every ``__syncthreads();`` in attn_fwd.cu (the kernels
    appear in the order aa_fwd_tc, aa_fwd_tc2, aa_fwd_simt, aa_fwd_tf32)."""
    text = (tsan.KERNELS / "attn_fwd.cu").read_text()
    tc2_start = text.index("aa_fwd_tc2(")
    simt_start = text.index("aa_fwd_simt(")
    tf32_start = text.index("aa_fwd_tf32(")
    offsets = tsan.barrier_offsets("attn_fwd.cu")

    def kernel(pos: int) -> str:
        if pos > tf32_start:
            return "tf32"
        return "simt" if pos > simt_start else ("tc2" if pos > tc2_start else "tc")

    return [(i, kernel(pos)) for i, pos in enumerate(offsets)]


# A case whose schedule needs each barrier: the tensor-core barriers guard K/V/Q tiles
# (the no-key-tiles case also has blocks where only Q's copy is in flight at the epilogue),
# the CUDA-core ones Q^T, K/V and P^T.
_MUTATION_CASE = {
    "tc": "f16_d64_no_key_tiles",
    "tc2": "v2_f16_d64_no_key_tiles",
    "simt": "f32_d64_causal_gqa_softcap_dropout_bool",
    "tf32": "v3_f32_d64_no_key_tiles",
}


@pytest.fixture(scope="module")
def switchable_executables(tsan_work: Path) -> dict[str, Path]:
    """kernel family -> a ThreadSanitizer build of its mutation case from a copy of
    attn_fwd.cu whose barriers ``AA_EMU_SKIP_BARRIER`` switches off one at a time (one
    compile per family, shared by its sites; see ``_tsan.py``)."""
    work = tsan_work / "switchable"
    kdir = tsan.kernels_with_switchable_barriers("attn_fwd.cu", work / "kernels")
    cases = {kernel: _RACE_CASES[name] for kernel, name in _MUTATION_CASE.items()}
    return build_emulators(cases, work, tsan.FLAGS, kernels_dir=kdir)


@pytest.mark.parametrize("site,kernel", _barrier_sites())
def test_race_check_catches_every_missing_barrier(
    site: int,
    kernel: str,
    switchable_executables: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deleting any one ``__syncthreads()`` of the forward kernels makes the race check
    fail, so a barrier the schedule needs cannot silently go missing. Every site is
    checked in a run of its own: the family's switchable build with
    ``AA_EMU_SKIP_BARRIER=site``."""
    case = _RACE_CASES[_MUTATION_CASE[kernel]]
    stored, _, mask = _inputs(case, np.random.default_rng(site))
    for name, value in tsan.skip_barrier_env(site, {}).items():
        monkeypatch.setenv(name, value)
    res = launch_emulator(switchable_executables[kernel], case, stored, mask, tmp_path)
    assert tsan.REPORT in res.stderr, f"barrier {site} ({kernel}) removed, yet no race was reported"


def test_switchable_build_skips_nothing_by_default(
    switchable_executables: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``AA_EMU_SKIP_BARRIER`` a switchable build is the kernel as written (the
    prelude is the same for every family): no race, the reference's result."""
    monkeypatch.delenv(tsan.SKIP_BARRIER, raising=False)
    case = _RACE_CASES[_MUTATION_CASE["simt"]]
    stored, exact, mask = _inputs(case, np.random.default_rng(0))
    res = launch_emulator(switchable_executables["simt"], case, stored, mask, tmp_path)
    assert tsan.REPORT not in res.stderr, f"ThreadSanitizer report:\n{res.stderr[:6000]}"
    assert res.returncode == 0, f"emulator exit {res.returncode}: {res.stderr[-2000:]}"
    out, lse = read_outputs(case, tmp_path)
    _assert_matches_reference(case, out, lse, *reference(case, exact, mask))
