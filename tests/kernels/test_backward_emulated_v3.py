# ruff: noqa: F811  (the helpers are imported from test_backward_emulated)
"""The backward kernels' variant v3 (``aa_bwd_dkdv_mma3`` in ``attn_bwd_v3.cu``,
``ARRAYATTN_BWD_VARIANT=v3``) on the CPU through the host emulator: against the float64
reference on the main options, bit for bit against v2 in deterministic mode (v3 only moves
operands into registers and changes step sizes, not the order of any sum), and under
ThreadSanitizer. v3 runs at head dim 64 (E = 56, Ev = 64: zero-padded columns, E != Ev);
elsewhere it declines to v2's kernels, which ``test_backward_emulated_v2.py`` covers.

Kept short (CI time): one emulator library holding v3's and v2's head-dim-64 kernels, one
race run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention.cuda.backward import SOURCE_V3, backward_plan

emu = pytest.importorskip("_backward_emu")
tsan = pytest.importorskip("_tsan")
from test_backward_emulated import TOL, rel, run_case  # noqa: E402

pytestmark = pytest.mark.skipif(
    emu.compiler() is None or emu.cuda_include() is None,
    reason="needs g++ (C++20) and the CUDA headers (cuda_fp16.h) for the host emulator",
)

E, EV = 56, 64


def _names(kinds: tuple[str, ...], variants: tuple[str, ...]) -> list[str]:
    names: list[str] = []
    for kind in kinds:
        for variant in variants:
            plan = backward_plan(kind, E, EV, variant=variant)
            names += [n for n in (plan.preprocess, plan.dkdv, plan.dq, plan.convert) if n]
    return sorted(set(names))


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    # attn_bwd_v3.cu includes attn_bwd.cu: v2's kernels build from the same file.
    names = _names(("float16", "bfloat16"), ("v2", "v3"))
    return emu.build(names, tmp_path_factory.mktemp("bwd_emu_v3"), kernel_file=SOURCE_V3)


def _check(got, ref, kind):
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL[kind], f"{name}: relative error {rel(g, r):.3g}"


def test_v3_plan():
    plan = backward_plan("float16", E, EV, variant="v3")
    assert plan.variant == "v3" and plan.dkdv.startswith("aa_bwd_dkdv_mma3<")
    assert plan.dq == backward_plan("float16", E, EV, variant="v2").dq
    assert backward_plan("float16", 120, 128, variant="v3") == backward_plan(
        "float16", 120, 128, variant="v2"
    )  # head dim 128: v2's kernels
    assert backward_plan("float16", 60, 64, variant="v3").variant == "v1"  # E % 8 != 0


# The option matrix in the atomic-dQ mode (v3's own dQ code), at v1's small sizes (one
# 128-row step; CI time): a boolean mask with GQA, a window with softcap, sinks with ALiBi
# and bottom-right lengths, empty rows, dropout with dLSE. Several steps per head (the
# pipeline, the prefetch across the group's heads) run in the race check below, which also
# compares with the float64 reference. ("v2_pipeline", 20 s here per kind, passed too.)
@pytest.mark.parametrize(
    "kind,case",
    [
        ("float16", "bool_mask_gqa"),
        ("float16", "window_softcap"),
        ("bfloat16", "sinks_alibi"),
        ("float16", "empty_rows"),
        ("float16", "dropout_dlse"),
    ],
)
def test_v3_matches_reference(library, kind, case):
    got, ref, launch = run_case(library, kind, case, deterministic=False, E=E, Ev=EV,
                                variant="v3")  # fmt: skip
    names = [name for name, *_ in launch.launches]
    assert any(n.startswith("aa_bwd_dkdv_mma3<") for n in names), names
    _check(got, ref, kind)


@pytest.mark.parametrize("case", ["bool_mask_gqa"])
def test_v3_is_bitwise_v2_in_deterministic_mode(library, case):
    """Deterministic mode: v3's dK/dV kernel beside v2's dQ kernel gives v2's very bits
    (and matches the float64 reference)."""
    kw = dict(deterministic=True, E=E, Ev=EV)
    v3, ref, l3 = run_case(library, "float16", case, variant="v3", **kw)
    v2, _, l2 = run_case(library, "float16", case, variant="v2", **kw)
    assert any("_mma3<" in n for n, *_ in l3.launches)
    assert not any("_mma3<" in n for n, *_ in l2.launches)
    _check(v3, ref, "float16")
    for a, b in zip(v3, v2, strict=True):
        assert np.array_equal(a, b)


def test_v3_has_no_data_race(tmp_path_factory):
    """One ThreadSanitizer run of v3 (atomic dQ: every barrier of aa_bwd_dkdv_mma3 is
    exercised; cp.async copies deferred to their wait, as on the GPU), on
    ``_backward_tsan_run.py``'s v3 race case: two 128-row steps per head (bottom-right
    causal, L = 150, S = 70), two heads of one GQA group, sinks and ALiBi; the gradients
    are also checked against the float64 reference there."""
    lib = tsan.require_python_tsan(emu.compiler() or "g++")
    work = tmp_path_factory.mktemp("bwd_tsan_v3")
    built = emu.compile_library(_names(("float16",), ("v3",)), work, tsan.FLAGS,
                                kernel_file=SOURCE_V3)  # fmt: skip
    env = dict(os.environ, LD_PRELOAD=lib)
    env.pop("AA_EMU_EAGER", None)
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    script = Path(__file__).resolve().parent / "_backward_tsan_run.py"
    res = subprocess.run([sys.executable, str(script), str(built), "float16", "0", "v3"],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
