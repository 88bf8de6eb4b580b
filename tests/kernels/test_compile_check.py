"""The CUDA compile check (.ci/compile_kernels.py): its ptxas-report parser on a canned
report, and, when nvcc is installed, a real compile of the forward kernels' hot variants
for sm_90 (the backward kernels' variants are checked by .ci/run's full run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from _compile_check import SCRIPT
from _compile_check import load as _load

SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z9aa_fwd_tcILi0ELi128ELb0ELb0ELi0EEvPKtS1_S1_PtPfPKvPKiS7_S7_S7_xxxxxxxxxxxxxxxxxxiiiiiiffffjjf' for 'sm_90'
ptxas info    : Function properties for _Z9aa_fwd_tcILi0ELi128ELb0ELb0ELi0EEvPKtS1_S1_PtPfPKvPKiS7_S7_S7_xxxxxxxxxxxxxxxxxxiiiiiiffffjjf
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z11aa_fwd_simtIdLi32ELb1ELb0ELi2EEvPKT_S2_S2_PS0_S3_PKvPKiS7_S7_S7_xxxxxxxxxxxxxxxxxxiiiiiiS0_S0_S0_S0_jjS0_' for 'sm_90'
ptxas info    : Function properties for _Z11aa_fwd_simtIdLi32ELb1ELb0ELi2EEvPKT_S2_S2_PS0_S3_PKvPKiS7_S7_S7_xxxxxxxxxxxxxxxxxxiiiiiiS0_S0_S0_S0_jjS0_
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
"""  # noqa: E501


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt demangles the names")
def test_parse_ptxas_report() -> None:
    mod = _load()
    reps = mod.parse_ptxas(SAMPLE)
    tc = reps[mod._norm("aa_fwd_tc<0, 128, false, false, 0>")]
    assert (tc.registers, tc.stack, tc.spill_stores, tc.spill_loads) == (255, 8, 12, 16)
    assert tc.spills
    simt = reps[mod._norm("aa_fwd_simt<double, 32, true, false, 2>")]
    assert (simt.registers, simt.spill_stores, simt.spill_loads) == (96, 0, 0)
    assert not simt.spills


def test_variant_list_covers_every_dtype_and_head_dim() -> None:
    mod = _load()
    names = {v[0] for v in mod.forward_variants()}
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in (32, 64, 96, 128, 256):
            assert mod.forward_kernel_name(kind, d, False, False, 0) in names
    assert mod.HOT <= names


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.skipif(
    os.environ.get("ARRAYATTN_CI_COMPILE_STAGE") == "1",
    reason="CI's compile stage (.ci/compile_kernels.py, after the tests) checks every "
    "variant, the hot ones' spills included",
)
def test_hot_variants_compile_without_spills() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--hot-only", "--source", "attn_fwd.cu"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "aa_fwd_tc<0, 128, 2, false, false, 0>" in res.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_flex_predicate_variants_compile_without_spills() -> None:
    """One block-mask instantiation per kernel family with a generated predicate in front
    (``--flex-pred``, beside the same instantiations on the bits path): no spills."""
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--flex-pred"],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "aa_fwd_tc2<0, 64, false, 4, false>" in res.stdout
    assert "aa_bwd_dkdv_mma2<AaF16, 64, 8, 64, 64, true>" in res.stdout
