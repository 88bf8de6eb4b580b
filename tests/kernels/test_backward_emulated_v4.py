# ruff: noqa: F811  (the helpers are imported from test_backward_emulated)
"""The backward kernels' variant v4 (``aa_bwd_dkdv_mma4`` in ``attn_bwd_v4.cu``,
``ARRAYATTN_BWD_VARIANT=v4``: FlashAttention-2's warp tiling, P^T/dS^T through shared
memory) on the CPU through the host emulator: against the float64 reference on the option
matrix at both head dims it has (64: E = 56, Ev = 64; 128: E = 120, Ev = 128, zero-padded
columns and E != Ev), bit for bit against v2 in deterministic mode (v4 changes the warp
tiling, not the order of any dK/dV sum; the dQ kernel is v2's), and under ThreadSanitizer
from the switchable-barrier build (no race as written; each of ``attn_bwd_v4.cu``'s two
barriers deleted in turn is reported).

Kept short (CI time): one emulator library, the reference cases split between the head
dims, one race run as written and one per deleted barrier, all from one switchable build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention.cuda.backward import SOURCE_V4, backward_plan

emu = pytest.importorskip("_backward_emu")
tsan = pytest.importorskip("_tsan")
from test_backward_emulated import CASES, TOL, rel, run_case  # noqa: E402

pytestmark = pytest.mark.skipif(
    emu.compiler() is None or emu.cuda_include() is None,
    reason="needs g++ (C++20) and the CUDA headers (cuda_fp16.h) for the host emulator",
)

DIMS = {64: (56, 64), 128: (120, 128)}  # padded head dim -> (E, Ev)


def _names(cases: tuple[tuple[str, int, str], ...]) -> list[str]:
    names: list[str] = []
    for kind, d, variant in cases:
        plan = backward_plan(kind, *DIMS[d], variant=variant)
        names += [n for n in (plan.preprocess, plan.dkdv, plan.dq, plan.convert) if n]
    return sorted(set(names))


LIB_PLANS = (
    ("float16", 64, "v4"),
    ("float16", 128, "v4"),
    ("bfloat16", 64, "v4"),
    ("float16", 64, "v2"),
    ("float16", 128, "v2"),
)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    # attn_bwd_v4.cu includes attn_bwd.cu: v2's kernels build from the same file.
    return emu.build(_names(LIB_PLANS), tmp_path_factory.mktemp("bwd_emu_v4"),
                     kernel_file=SOURCE_V4)  # fmt: skip


def _check(got, ref, kind):
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL[kind], f"{name}: relative error {rel(g, r):.3g}"


def test_v4_plan():
    for d, (e, ev) in DIMS.items():
        plan = backward_plan("float16", e, ev, variant="v4")
        v2 = backward_plan("float16", e, ev, variant="v2")
        assert plan.variant == "v4" and plan.dkdv.startswith("aa_bwd_dkdv_mma4<")
        assert plan.head_dim == d and plan.dq == v2.dq and plan.convert == v2.convert
        assert plan.dkdv_threads == 256 and plan.dkdv_smem <= 227 * 1024
    # where v4 has no kernel: v2's plan, then v1's
    assert backward_plan("float16", 96, 96, variant="v4") == backward_plan(
        "float16", 96, 96, variant="v2"
    )
    assert backward_plan("float16", 60, 64, variant="v4").variant == "v1"  # E % 8 != 0
    assert backward_plan("float32", 64, 64, variant="v4") == backward_plan(
        "float32", 64, 64, variant="v2"
    )


# The option matrix in the atomic-dQ mode (v4's own dQ code), split between the two head
# dims (CI time; each case at one of them): a boolean mask with GQA and top-left causal,
# a window with softcap, sinks with ALiBi and bottom-right lengths (bfloat16), empty rows,
# dropout with dLSE, bottom-right causal with lengths; the plain path (whole key blocks)
# and dropout again run in the deterministic test below (v4's dK/dV against the reference
# and v2's bits). Several steps per head (the pipeline, the prefetch across the group's
# heads) run in the race check below, which also compares with the reference.
@pytest.mark.parametrize(
    "kind,d,case",
    [
        ("float16", 64, "bool_mask_gqa"),
        ("float16", 128, "window_softcap"),
        ("bfloat16", 64, "sinks_alibi"),
        ("float16", 128, "empty_rows"),
        ("float16", 64, "dropout_dlse"),
        ("float16", 128, "bottom_right_lengths"),
    ],
)
def test_v4_matches_reference(library, kind, d, case):
    e, ev = DIMS[d]
    got, ref, launch = run_case(library, kind, case, deterministic=False, E=e, Ev=ev,
                                variant="v4")  # fmt: skip
    names = [name for name, *_ in launch.launches]
    assert any(n.startswith("aa_bwd_dkdv_mma4<") for n in names), names
    _check(got, ref, kind)


# One sequence and one KV head each (CI time: two runs per case), a GQA group of two.
# v4_bits_plain: one whole key block of 128 (the other cases' blocks are ragged), no
# option: every step takes the kernel's plain path (no option applies to the whole step).
BITS_CASES = {
    "v4_bits_dropout": dict(B=1, Hq=2, Hkv=1, dropout_p=0.3, seed=1234, d_lse=True, causal=True),
    "v4_bits_plain": dict(B=1, Hq=2, Hkv=1, L=40, S=128),
}


@pytest.mark.parametrize("d,case", [(64, "v4_bits_dropout"), (128, "v4_bits_plain")])
def test_v4_is_bitwise_v2_in_deterministic_mode(library, d, case):
    """Deterministic mode: v4's dK/dV kernel beside v2's dQ kernel gives v2's very bits
    (and matches the float64 reference)."""
    CASES.update(BITS_CASES)
    kw = dict(deterministic=True, E=DIMS[d][0], Ev=DIMS[d][1])
    v4, ref, l4 = run_case(library, "float16", case, variant="v4", **kw)
    v2, _, l2 = run_case(library, "float16", case, variant="v2", **kw)
    assert any("_mma4<" in n for n, *_ in l4.launches)
    assert not any("_mma4<" in n for n, *_ in l2.launches)
    _check(v4, ref, "float16")
    for a, b in zip(v4, v2, strict=True):
        assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def switchable_v4(tmp_path_factory) -> Path:
    """One ThreadSanitizer build of v4's race-case kernels (float16, D = 64) from a copy of
    the kernels whose ``attn_bwd_v4.cu`` barriers ``AA_EMU_SKIP_BARRIER`` switches off."""
    tsan.require_python_tsan(emu.compiler() or "g++")
    work = tmp_path_factory.mktemp("bwd_tsan_v4")
    kdir = tsan.kernels_with_switchable_barriers(SOURCE_V4, work / "switchable")
    return emu.compile_library(_names((("float16", 64, "v4"),)), work, tsan.FLAGS,
                               kernels_dir=kdir, kernel_file=SOURCE_V4)  # fmt: skip


def _tsan_run(built: Path, skip_barrier: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_PRELOAD=tsan.libtsan(emu.compiler() or "g++") or "")
    env.pop("AA_EMU_EAGER", None)
    env.pop(tsan.SKIP_BARRIER, None)
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    if skip_barrier is not None:
        env = tsan.skip_barrier_env(skip_barrier, env)
    script = Path(__file__).resolve().parent / "_backward_tsan_run.py"
    return subprocess.run([sys.executable, str(script), str(built), "float16", "0", "v4"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip


def test_v4_has_no_data_race(switchable_v4):
    """One ThreadSanitizer run of v4 as written (atomic dQ: both barriers of
    ``aa_bwd_dkdv_mma4`` are exercised; cp.async copies deferred to their wait, as on the
    GPU), on ``_backward_tsan_run.py``'s 128-row-step race case: two steps per head
    (bottom-right causal, L = 150, S = 70), two heads of one GQA group, sinks and ALiBi; the
    gradients are also checked against the float64 reference there."""
    res = _tsan_run(switchable_v4)
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("site", range(len(tsan.barrier_offsets(SOURCE_V4))))
def test_v4_race_check_catches_every_missing_barrier(switchable_v4, site):
    """Deleting either ``__syncthreads()`` of ``attn_bwd_v4.cu`` (the step's, P^T/dS^T's)
    makes the race check report a race (the same switchable build as the run above, one
    run per barrier: about 5 s since the emulators reuse their threads)."""
    assert len(tsan.barrier_offsets(SOURCE_V4)) == 2
    res = _tsan_run(switchable_v4, skip_barrier=site)
    assert tsan.REPORT in res.stderr, f"barrier {site} of {SOURCE_V4} removed, yet no race"


def test_v4_shared_memory_is_the_kernels_own(tmp_path):
    """v4's launch size (``backward_plan``) equals ``AaBwdMma4Smem``, the layout
    ``aa_bwd_dkdv_mma4`` carves its dynamic shared memory into."""
    import re

    plans = [backward_plan(k, *DIMS[d], variant="v4") for k in ("float16", "bfloat16")
             for d in DIMS]  # fmt: skip
    exprs = []
    for plan in plans:
        hd, bm, bn = (a.strip() for a in re.search(r"<(.*)>", plan.dkdv).group(1).split(",")[1:4])
        exprs.append(f"AaBwdMma4Smem<{hd}, {bm}, {bn}>::value")
    assert emu.host_ints(tmp_path, SOURCE_V4, exprs) == [p.dkdv_smem for p in plans]
