"""The Performance page shows the latest run of each machine in bench/RESULTS.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]

RESULTS = """# arrayattn CPU benchmark results

### Run of 2026-01-01 00:00 UTC

- cpu: AMD EPYC
- cores: 2 logical, 2 usable

old CPU table

### Analysis (written by hand)

text

## NVIDIA H100 80GB HBM3 — 2026-01-02 00:00 UTC — commit abc

GPU table

### Run of 2026-01-03 00:00 UTC

- cpu: Intel Xeon
- cores: 8 logical, 8 usable

xeon table

### Run of 2026-01-04 00:00 UTC

- cpu: AMD EPYC
- cores: 2 logical, 2 usable

new CPU table
"""


def _hook():
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]')")
    return load_script("docs/_hooks/bench_results.py")


def test_latest_run_per_machine():
    runs = _hook().latest_runs(RESULTS.splitlines()[1:])
    assert [(m, d) for m, d, _ in runs] == [
        ("NVIDIA H100 80GB HBM3", "2026-01-02 00:00 UTC"),
        ("Intel Xeon, 8 logical, 8 usable", "2026-01-03 00:00 UTC"),
        ("AMD EPYC, 2 logical, 2 usable", "2026-01-04 00:00 UTC"),
    ]
    text = "\n".join(runs[-1][2])
    assert "new CPU table" in text and "old CPU table" not in text


def test_page_links_the_full_record(tmp_path):
    hook = _hook()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "RESULTS.md").write_text(RESULTS, encoding="utf-8")
    page, _ = hook._results_markdown(tmp_path)
    assert f"]({hook.RECORD})" in page
    assert "old CPU table" not in page and "Analysis" not in page
    assert "### AMD EPYC, 2 logical, 2 usable: run of 2026-01-04 00:00 UTC" in page
    record, _ = hook._record_markdown(tmp_path)
    assert "old CPU table" in record and "Analysis" in record


def test_a_partial_repeat_hides_no_table():
    text = """### Run of 2026-01-01 00:00 UTC

- cpu: AMD EPYC

#### prefill

p1

#### decode

d1

### Run of 2026-01-02 00:00 UTC

- cpu: AMD EPYC

#### decode

d2
"""
    runs = _hook().latest_runs(text.splitlines())
    assert [d for _, d, _ in runs] == ["2026-01-01 00:00 UTC", "2026-01-02 00:00 UTC"]


def test_no_merge_conflict_markers_in_published_text():
    import re

    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
    files = [
        ROOT / "bench" / "RESULTS.md",
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]
    left = [
        str(f.relative_to(ROOT))
        for f in files
        if f.is_file() and marker.search(f.read_text("utf-8"))
    ]
    assert not left, f"merge conflict markers left in {left}"
