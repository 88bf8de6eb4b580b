"""The budgeted GPU first-contact script (``bench/gpu_first_contact.sh``) on a machine
without a GPU: every stage fails fast with a status line, the files that come back are
still written (at most 8, the device tool's limit), and a hanging stage costs its own
time slice, never the whole budget."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_first_contact.sh"
FIRST_STAGES = ["env", "variants", "smoke", "bench", "tests", "memcheck_plant", "memcheck",
                "racecheck"]  # fmt: skip

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils' timeout",
)


def _run(tmp_path: Path, *args: str, python: str = sys.executable, **env: str):
    out = tmp_path / "out"
    full_env = dict(os.environ)
    full_env.update(
        OUT=str(out),
        PYTHON=python,
        CUDA_VISIBLE_DEVICES="",  # no GPU even where one exists: the no-GPU behaviour
        CUPY_CACHE_DIR=str(tmp_path / "cupy-cache"),
        JOBS="1",
        WHEELS=str(tmp_path / "no-wheels"),
        TESTS="tests/kernels/test_fused_gpu.py",
        **env,
    )
    t0 = time.monotonic()
    res = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=tmp_path, env=full_env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    return res, out, time.monotonic() - t0


def _status(out: Path) -> dict[str, str]:
    lines = (out / "status.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines if not line.split()[0].endswith(":")}


def test_first_plan_without_a_gpu_writes_every_status_line_within_budget(tmp_path):
    res, out, seconds = _run(tmp_path, "first", BUDGET="200")
    assert res.returncode == 0, res.stderr[-2000:]
    status = _status(out)
    assert list(status) == FIRST_STAGES, status
    for name in ("env", "variants", "smoke"):
        assert "rc=0 " not in status[name], status[name]  # no GPU: a failure, not a pass
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"log.txt", "status.txt"} <= set(files), files
    log = (out / "log.txt").read_text()
    assert "=== env" in log and "plan=first budget=200s" in log
    assert seconds < 200
    assert "---- status" in res.stdout  # the status table ends the output the tool returns


def test_a_hanging_stage_costs_its_slice_and_later_stages_are_skipped(tmp_path):
    hang = tmp_path / "python-that-hangs"
    hang.write_text("#!/bin/sh\nsleep 600\n")
    hang.chmod(0o755)
    res, out, seconds = _run(tmp_path, "first", python=str(hang), BUDGET="14")
    assert res.returncode == 0, res.stderr[-2000:]
    status = (out / "status.txt").read_text()
    assert "env" in status and "(timed out)" in status, status
    assert "skipped:" in status and "of the budget left" in status, status
    assert seconds < 14 + 20  # the budget, plus timeout's grace and bash's own start-up


def test_rerun_and_unknown_plans(tmp_path):
    res, out, _ = _run(tmp_path, "rerun", BUDGET="120", STAGES="env,smoke")
    assert res.returncode == 0
    assert list(_status(out)) == ["env", "smoke"]
    bad = subprocess.run(["bash", str(SCRIPT), "everything"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_variant_list_builds_without_a_gpu() -> None:
    """``bench/gpu_variants.py``'s list (what the ``variants`` stage loads) builds on the
    CPU: every compile-list name with its launch shape (a name it cannot parse failed the
    stage on a GPU once, costing its device time)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_variants
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from arrayattn.attention.cuda.tiles import COMPILE_VARIANTS

    names = {v.name: v for v in gpu_variants.all_variants()}
    for listed in COMPILE_VARIANTS.values():
        for name in listed:
            assert name in names and names[name].threads > 0 and names[name].smem > 0, name
    assert names["aa_fwd_tf32<128, false, 0, false>"].smem == 101376
