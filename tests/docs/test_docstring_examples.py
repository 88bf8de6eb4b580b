"""Docstring examples are Google ``Examples:`` sections, the form the API pages render as
highlighted ``>>>`` code (``Example::`` and ``Example:`` render as blockquoted text)."""

from __future__ import annotations

from pathlib import Path

from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    return load_script(".ci/docstring_examples.py")


def test_no_rst_example_headings_left():
    left = _tool().leftovers(ROOT / "arrayattn")
    assert not left, (
        "docstring examples must be Google 'Examples:' sections (run "
        f"python .ci/docstring_examples.py to convert): {left}"
    )


def test_conversion_keeps_the_doctest():
    tool = _tool()
    before = (
        'def f():\n    """Doc.\n\n    Example::\n\n        >>> 1 + 1\n        2\n\n'
        '    More text.\n    """\n'
    )
    after = tool.convert(before)
    assert after == (
        'def f():\n    """Doc.\n\n    Examples:\n        >>> 1 + 1\n        2\n\n'
        '    More text.\n    """\n'
    )
    assert tool.convert(after) == after  # idempotent
    admonition = 'def g():\n    """Doc.\n\n    Example:\n        >>> 3\n        3\n    """\n'
    assert "    Examples:\n        >>> 3\n" in tool.convert(admonition)
    assert tool.OLD.search(before) and tool.OLD.search(admonition)
    spaced = 'def h():\n    """Doc.\n\n    Examples:\n\n        >>> 4\n        4\n    """\n'
    assert tool.OLD.search(spaced)
    assert "    Examples:\n        >>> 4\n        4\n" in tool.convert(spaced)
    assert not tool.OLD.search(after)
