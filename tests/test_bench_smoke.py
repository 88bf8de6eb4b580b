"""Smoke test of the benchmark CLI (``python -m arrayattn.bench``) on tiny shapes.

Timings are never asserted: the test checks that every part of a run (peers, tables,
memory measurement, results file) works and reports what it measured."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _scripts import load_script

from arrayattn import bench

TINY = "1,2,48,16;1,2,40,16,causal"


def test_parse_shapes_reads_causal_and_rejects_bad_entries():
    shapes = bench.parse_shapes("1,2,48,16; 2,4,8,8,c")
    assert shapes == [bench.Shape(1, 2, 48, 16), bench.Shape(2, 4, 8, 8, causal=True)]
    with pytest.raises(Exception, match="B,H,L,D"):
        bench.parse_shapes("1,2,3")


def test_flop_counting_follows_flashattention():
    s = bench.Shape(2, 3, 5, 7)
    assert s.flops_forward() == 4 * 2 * 3 * 5 * 5 * 7
    assert bench.Shape(2, 3, 5, 7, causal=True).flops_forward() == s.flops_forward() / 2
    assert s.flops_forward_backward() == 3.5 * s.flops_forward()


def test_quick_run_prints_a_table_per_shape_and_appends_results(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    code = bench.main(
        [
            "--shapes",
            TINY,
            "--repeats",
            "1",
            "--quiet",
            "--peers",
            "auto,composed,baseline",
            "--append-results",
            "--results",
            str(results),
            "--note",
            "smoke",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("| peer | fwd ms") == 2
    for peer in ("arrayattn auto", "arrayattn composed", "numpy baseline"):
        assert out.count(f"| {peer} | ") == 2
    text = results.read_text()
    assert text.startswith("# arrayattn CPU benchmark results")
    assert "smoke" in text and "- numpy:" in text and "- blas:" in text
    assert "B=1 H=2 L=40 D=16, causal" in text
    # Peak memory is measured (tracemalloc) for the NumPy peers: a number, not "-".
    row = next(line for line in text.splitlines() if line.startswith("| arrayattn auto |"))
    assert row.rstrip(" |").split("|")[-1].strip() != "-"


def test_torch_peer_is_measured_when_installed(capsys):
    pytest.importorskip("torch")
    bench.main(
        [
            "--shapes",
            "1,2,32,16",
            "--repeats",
            "1",
            "--quiet",
            "--no-memory",
            "--peers",
            "auto,torch",
        ]
    )
    out = capsys.readouterr().out
    assert "| torch sdpa | " in out
    row = next(line for line in out.splitlines() if line.startswith("| arrayattn auto |"))
    assert row.split("|")[4].strip() not in ("", "-")  # a ratio to torch was computed


def test_module_entry_point_runs_quick_mode():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "arrayattn.bench",
            "--quick",
            "--shapes",
            "1,1,24,8",
            "--repeats",
            "1",
            "--no-memory",
            "--peers",
            "auto",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "| arrayattn auto | " in done.stdout
    assert "[1/" in done.stderr  # progress lines (stderr is not a terminal here)
    assert "- threads (--threads): 1" in done.stdout


def test_importing_arrayattn_does_not_import_the_bench_or_torch():
    code = "import sys, arrayattn; print('arrayattn.bench' in sys.modules, 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "False"]


def test_cpu_floor_script_reports_floor_fast_path_and_torch():
    pytest.importorskip("torch")
    pytest.importorskip("threadpoolctl")
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "cpu_floor.py"
    done = subprocess.run(
        [sys.executable, str(script), "--shapes", "1,2,64,16;1,1,96,16,c", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("(float32, one thread)") == 2
    rows = ("| NumPy floor (BLAS + exp only) | ", "| arrayattn fast path | ", "| torch sdpa | ")
    for row in rows:
        assert out.count(row) == 2
    assert "ns per score element: QK^T" in out and "torch all-in" in out


def test_decode_section_measures_gb_per_second_and_ratio():
    from arrayattn import bench_sections as sec

    shape = sec.DecodeShape(B=1, L=2, S=64, Hq=4, Hkv=2, D=8)
    result = sec.measure_decode(shape, repeats=2)
    assert result["gb"] == 2 * 1 * 2 * 64 * 8 * 4 / 1e9
    assert len(result["times"]["arrayattn auto"]) == 2
    text = sec.format_decode([result])
    assert "GB/s of K/V" in text and shape.label in text


def test_array_api_and_crossover_tables_format_measured_times():
    from arrayattn import bench_sections as sec

    rounds = {"torch sdpa": [1.0, 2.0], "arrayattn composed": [2.0, 3.0]}
    text = sec.format_array_api(
        [{"lib": "torch", "causal": True, "ref": "torch sdpa", "times": rounds}]
    )
    assert "| torch | yes | arrayattn composed | 2500.0 | 1.67 | 1.50-2.00 |" in text
    times = {"fast": 3e-3, "composed": 1e-3, "chunked": 2e-3, "auto": 1e-3}
    text = sec.format_crossover([{"case": (2, 8, 4, 4, False), "times": times, "auto": "composed"}])
    assert "| 2 | 8 | 4 | 4 | no | 3.00 | 1.00 | 2.00 | 1.00 | composed | composed |" in text


def test_array_api_section_names_what_auto_ran_and_times_the_floor():
    pytest.importorskip("torch")
    from arrayattn import bench_sections as sec

    results = sec.measure_array_api(repeats=1, shape=(1, 2, 64, 8))
    torch_rows = [r for r in results if r["lib"] == "torch"]
    assert len(torch_rows) == 2
    for r in torch_rows:
        names = set(r["times"])
        assert "array-API floor (chunked's blocks, minimal ops)" in names
        assert any(n.startswith("arrayattn auto (ran ") for n in names)
    text = sec.format_array_api(results, shape=(1, 2, 64, 8))
    assert "array-API floor" in text


def _load_script(name: str):
    return load_script(f"bench/{name}.py")


def test_gpu_sanitize_script_runs_its_cases_on_numpy_and_flags_non_finite(capsys, monkeypatch):
    """The sanitizer driver's calls run on NumPy (every option it passes is accepted), one
    line per case; ``--check`` compares each with float64 (itself, on NumPy); a NaN
    anywhere in an output or gradient makes it exit 1."""
    import numpy as np

    script = _load_script("gpu_sanitize")
    names = [name for name, _ in script.cases(small=True)]
    for args, label in (([], "finite"), (["--check"], "ok")):
        assert script.main(["--xp", "numpy", "--small", *args]) == 0
        out = capsys.readouterr().out
        for name in names:  # NumPy has no bfloat16
            skipped = name.startswith("bfloat16")
            status = "skipped (no such dtype here)" if skipped else label
            assert f"{name}: {status}" in out
        assert out.endswith("0 case(s) failed\n")

    real_vjp = script.aa.vjp

    def poisoned(*args, **kwargs):
        (out, lse), pullback = real_vjp(*args, **kwargs)
        out = out.copy()
        out[..., 0, 0] = np.nan
        return (out, lse), pullback

    monkeypatch.setattr(script.aa, "vjp", poisoned)
    assert script.main(["--xp", "numpy", "--small"]) == 1
    assert "float32 E64 full: FAILED" in capsys.readouterr().out


def test_torch_bridge_script_prints_every_row_and_its_ratio(capsys):
    pytest.importorskip("torch")
    script = _load_script("torch_bridge")
    assert script.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = ("torch sdpa", "torch sdpa, flush_denormal", "arrayattn.torch",
            "arrayattn.torch, (B,L,H,D) views", "arrayattn vjp, NumPy")  # fmt: skip
    for case in ("full", "causal"):
        for name in rows:
            assert f"| {case} | {name} | " in out
    base = next(line for line in out.splitlines() if line.startswith("| full | torch sdpa |"))
    assert base.rstrip(" |").endswith("| 1.00")


def test_subnormal_bench_prints_a_row_per_scale_and_restores_the_environment(capsys):
    import os

    script = _load_script("subnormal_bench")
    before = os.environ.get("ARRAYATTN_FLUSH_DENORMALS")
    assert script.main(["--shape", "1,1,64,16", "--scales", "1,8", "--repeats", "1"]) == 0
    assert os.environ.get("ARRAYATTN_FLUSH_DENORMALS") == before
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| 1", "| 8"]  # after the header
    assert all(r.count(" / ") == (3 if "torch" in sys.modules else 2) for r in rows[1:])


def test_cascade_bench_quick_prints_both_comparisons(capsys):
    script = _load_script("cascade_bench")
    assert script.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for case in ("copied-prefix decode", "cascade decode", "ragged decode", "uniform"):
        assert case in out
    assert "cascade speed-up over copied prefix:" in out and "ragged / uniform" in out
    diff = float(out.split("max |cascade - copied| ")[1].split(";")[0])
    assert diff < 1e-5  # the two caches attend to the same keys


def test_flex_bench_small_run_prints_the_ratios(capsys):
    script = _load_script("flex_bench")
    lengths = script.doc_lengths(16384, 8, 512, 4096, seed=0)
    assert sum(lengths) == 16384 and min(lengths) >= 512 and max(lengths) <= 4096
    assert lengths == script.doc_lengths(16384, 8, 512, 4096, seed=0)  # fixed packing
    argv = ["--length", "512", "--heads", "2", "--dim", "16", "--repeats", "1", "--backward"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    for line in ("(a)/(b) block_mask / per_doc:", "(c)/(a) dense_mask / block_mask:",
                 "create_block_mask:", "forward + backward"):  # fmt: skip
        assert line in out
