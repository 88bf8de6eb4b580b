"""The docs' example runner (``.ci/docs_examples.py``): a block that needs a library that
is not installed is skipped, and so are the later blocks that use what it would have
defined (before, those failed with a ``NameError`` on a machine without PyTorch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("docs_examples", ROOT / ".ci/docs_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_blocks_using_a_skipped_blocks_names_are_skipped(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport no_such_library_here as nn\nmodel = nn.Linear(2, 2)\n```\n\n"
        "```python\nout = model(1)\n```\n\n"  # uses a name of the skipped block
        "```python\nname = nn.__name__\n```\n\n"
        "```python\nx = 1 + 1\nassert x == 2\n```\n\n"  # independent: runs
        "<!-- docs-examples: skip-next -->\n```python\nslow = 3\n```\n\n"
        "```python\nvalue = slow + 1\n```\n",  # depends on a block skipped by the marker
        encoding="utf-8",
    )
    ran, skipped, failures = _runner().run_page(page, tmp_path)
    assert failures == [] and ran == 1 and skipped == 5
    out = capsys.readouterr().out
    assert "no_such_library_here is not installed" in out
    assert "uses model from a skipped block" in out and "uses nn from a skipped block" in out


def test_a_real_failure_still_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nundefined_name + 1\n```\n", encoding="utf-8")
    ran, skipped, failures = _runner().run_page(page, tmp_path)
    assert ran == 0 and skipped == 0 and len(failures) == 1 and "NameError" in failures[0]
