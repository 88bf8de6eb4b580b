# ruff: noqa: F811  (the helpers are imported from test_backward_emulated)
"""The 16-bit backward at padded head dim 256 on tensor cores (``ARRAYATTN_BWD_D256_TC``,
opt-in under variant v4: ``aa_bwd_dkdv_mma4`` with 64-key blocks and 64- or 32-row query
steps, v2's ``aa_bwd_dq_mma2`` in deterministic mode) on the CPU through the host
emulator: the switch's plans, the launch sizes against the kernels' own shared-memory
layouts, the float64 reference on v4's option matrix (E = 200, Ev = 256: zero-padded
columns, E != Ev; and E = Ev = 256), deterministic mode bit-identical from run to run, and
one ThreadSanitizer run (the deleted-barrier checks of ``attn_bwd_v4.cu`` run at D = 64 in
``test_backward_emulated_v4.py``: the barriers do not depend on the head dim).

A file of its own so ``pytest -n 2 --dist loadfile`` runs it beside the other variants'.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention.cuda import backward
from arrayattn.attention.cuda.backward import D256_TC_ENV, SOURCE_V4, backward_plan, flex_plan

emu = pytest.importorskip("_backward_emu")
tsan = pytest.importorskip("_tsan")
from test_backward_emulated import TOL, rel, run_case  # noqa: E402

pytestmark = pytest.mark.skipif(
    emu.compiler() is None or emu.cuda_include() is None,
    reason="needs g++ (C++20) and the CUDA headers (cuda_fp16.h) for the host emulator",
)

E, EV = 200, 256  # padded head dim 256: zero-padded Q/K columns, E != Ev


def _plans() -> list[backward.BackwardPlan]:
    """The D = 256 tensor-core plans of both tilings, both 16-bit kinds."""
    out = []
    for kind in ("float16", "bfloat16"):
        for rows in ("64", "32"):
            os.environ[D256_TC_ENV] = rows
            try:
                out.append(backward_plan(kind, E, EV, variant="v4"))
            finally:
                del os.environ[D256_TC_ENV]
    return out


def test_d256_switch_plans(monkeypatch):
    """Off (0): the CUDA-core kernels, as before. On (unset, empty, 1/64 and 32): v4's
    dK/dV kernel at head dim 256 (64 keys, 64- or 32-row steps) with v2's deterministic dQ,
    under v4 only; E or Ev not multiples of 8, block masks and other dtypes stay on the
    CUDA cores. Anything else is refused with the value named."""
    monkeypatch.setenv(D256_TC_ENV, "0")
    assert not backward_plan("float16", E, EV, variant="v4").tensor_cores
    for raw, bm in ((None, 64), ("", 64), ("1", 64), ("64", 64), ("32", 32)):
        if raw is None:
            monkeypatch.delenv(D256_TC_ENV, raising=False)
        else:
            monkeypatch.setenv(D256_TC_ENV, raw)
        for kind, t in (("float16", "AaF16"), ("bfloat16", "AaBF16")):
            plan = backward_plan(kind, E, EV, variant="v4")
            assert plan.tensor_cores and plan.variant == "v4" and plan.head_dim == 256
            assert plan.dkdv == f"aa_bwd_dkdv_mma4<{t}, 256, {bm}, 64, 4, 16>"
            assert plan.dq == f"aa_bwd_dq_mma2<{t}, 256, 4, 32>"
            assert (plan.dkdv_block_m, plan.dkdv_block_n, plan.dkdv_threads) == (bm, 64, 256)
            assert plan.dkdv_smem <= 227 * 1024 and plan.dq_smem <= 227 * 1024
            assert plan.dkdv in backward.HOT_VARIANTS and plan.dq in backward.HOT_VARIANTS
            assert plan.dkdv in backward.COMPILE_VARIANTS[SOURCE_V4]
            assert plan.dq in backward.COMPILE_VARIANTS[backward.SOURCE]
        for variant in ("v1", "v2", "v3"):
            assert not backward_plan("float16", E, EV, variant=variant).tensor_cores
        assert not backward_plan("float16", 204, 256, variant="v4").tensor_cores  # E % 8
        assert not backward_plan("float32", E, EV, variant="v4").tensor_cores
        assert backward_plan("float16", 128, 128, variant="v4").dkdv.startswith(
            "aa_bwd_dkdv_mma4<AaF16, 128,"
        )
        assert not flex_plan("float16", E, EV, variant="v4").tensor_cores
    monkeypatch.setenv(D256_TC_ENV, "yes")
    with pytest.raises(ValueError, match=D256_TC_ENV):
        backward_plan("float16", E, EV, variant="v4")


def test_d256_shared_memory_is_the_kernels_own(tmp_path):
    """The launch sizes equal ``AaBwdMma4Smem`` / ``AaBwdDqMma2Smem`` at head dim 256."""
    plans = _plans()
    exprs = []
    for plan in plans:
        hd, bm, bn = (a.strip() for a in re.search(r"<(.*)>", plan.dkdv).group(1).split(",")[1:4])
        exprs.append(f"AaBwdMma4Smem<{hd}, {bm}, {bn}>::value")
        hd, nw, qbn = (a.strip() for a in re.search(r"<(.*)>", plan.dq).group(1).split(",")[1:4])
        exprs.append(f"AaBwdDqMma2Smem<{hd}, {nw}, {qbn}>::value")
    got = emu.host_ints(tmp_path, SOURCE_V4, exprs)
    assert got == [n for p in plans for n in (p.dkdv_smem, p.dq_smem)]


def _names() -> list[str]:
    names = {n for p in _plans() for n in (p.preprocess, p.dkdv, p.dq, p.convert) if n}
    return sorted(names)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    # attn_bwd_v4.cu includes attn_bwd.cu: v2's dQ kernel builds from the same file.
    return emu.build(_names(), tmp_path_factory.mktemp("bwd_emu_d256"), kernel_file=SOURCE_V4)


def _check(got, ref, kind):
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL[kind], f"{name}: relative error {rel(g, r):.3g}"


# v4's option matrix (atomic dQ: the kernel's own dQ code), split between the two tilings
# (CI time: each case at one of them): bool mask + GQA + causal, window + softcap, sinks +
# ALiBi (bfloat16), dropout + dLSE, bottom-right lengths, empty rows; several query steps
# per key block (L = 37..150 over 64/32-row steps) and ragged 64-key blocks (S = 70).
@pytest.mark.parametrize(
    "rows,kind,case",
    [
        ("64", "float16", "bool_mask_gqa"),
        ("32", "float16", "window_softcap"),
        ("64", "bfloat16", "sinks_alibi"),
        ("32", "float16", "dropout_dlse"),
        ("64", "float16", "bottom_right_lengths"),
        ("32", "bfloat16", "empty_rows"),
    ],
)
def test_d256_matches_reference(library, monkeypatch, rows, kind, case):
    monkeypatch.setenv(D256_TC_ENV, rows)
    got, ref, launch = run_case(library, kind, case, deterministic=False, E=E, Ev=EV,
                                variant="v4")  # fmt: skip
    names = [name for name, *_ in launch.launches]
    assert any(n.startswith(f"aa_bwd_dkdv_mma4<{'AaF16' if kind == 'float16' else 'AaBF16'}, "
                            f"256, {rows},") for n in names), names  # fmt: skip
    _check(got, ref, kind)


def test_d256_deterministic_is_reproducible(library, monkeypatch):
    """Deterministic mode (v2's dQ kernel at head dim 256, the dK/dV kernel without dQ
    atomics): the float64 reference, and the same bits on a second run. E = Ev = 256, the
    plain path included (causal: whole blocks below the diagonal)."""
    monkeypatch.setenv(D256_TC_ENV, "1")
    kw = dict(deterministic=True, E=256, Ev=256, variant="v4")
    a, ref, launch = run_case(library, "float16", "causal_gqa", **kw)
    b, _, _ = run_case(library, "float16", "causal_gqa", **kw)
    assert any(n.startswith("aa_bwd_dq_mma2<AaF16, 256,") for n, *_ in launch.launches)
    _check(a, ref, "float16")
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)


@pytest.fixture(scope="module")
def tsan_library(tmp_path_factory) -> Path:
    """A ThreadSanitizer build of the float16 D = 256 kernels (64-row steps)."""
    tsan.require_python_tsan(emu.compiler() or "g++")
    names = [n for n in _names() if "AaBF16" not in n and ", 256, 32, 64," not in n]
    return emu.compile_library(names, tmp_path_factory.mktemp("bwd_tsan_d256"), tsan.FLAGS,
                               kernel_file=SOURCE_V4)  # fmt: skip


def test_d256_has_no_data_race(tsan_library):
    """One ThreadSanitizer run of the D = 256 dK/dV kernel as written (atomic dQ: both
    barriers exercised; cp.async copies deferred to their wait, as on the GPU):
    ``_backward_tsan_run.py``'s v4 race case (two 64-row steps per head, two heads of one
    GQA group, bottom-right causal, sinks, ALiBi) at E = 200, Ev = 256, also checked
    against the float64 reference there."""
    env = dict(os.environ, LD_PRELOAD=tsan.libtsan(emu.compiler() or "g++") or "")
    env.pop("AA_EMU_EAGER", None)
    env.pop(tsan.SKIP_BARRIER, None)
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    env[D256_TC_ENV] = "1"
    script = Path(__file__).resolve().parent / "_backward_tsan_run.py"
    res = subprocess.run([sys.executable, str(script), str(tsan_library), "float16", "0", "v4",
                          f"{E},{EV}"], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "relative errors" in res.stdout
