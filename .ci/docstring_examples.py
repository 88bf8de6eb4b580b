"""Rewrite reStructuredText ``Example::`` blocks in docstrings as Google ``Examples:`` sections.

The API pages are built by mkdocstrings with the Google docstring parser. It renders an
``Examples:`` section's ``>>>`` lines as highlighted code, but takes ``Example:`` for an
admonition and ``Example::`` for plain text: both show their ``>>>`` lines as nested
blockquotes holding one run-on paragraph. This script makes the rewrite mechanical, so
docstrings that arrive with the old form are fixed the same way
(``tests/docs/test_docstring_examples.py`` fails while any is left):

    Example::                  Examples:
                        ->         >>> import numpy as np
        >>> import numpy as np

(also ``Example:``, and ``Examples:`` with a blank line after it, which the parser ends
there, leaving the block as text).

A block that holds no ``>>>`` (a shell command) becomes a fenced ``bash`` block under the
same heading, so it renders as code too. Doctest still finds every ``>>>`` line.

    python .ci/docstring_examples.py          # rewrite arrayattn/** in place
    python .ci/docstring_examples.py --check  # list what is left; exit 1 if any
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The heading (any indent: ``Example::``, ``Examples::``, the admonition ``Example:``, or
# ``Examples:`` followed by a blank line, which ends the section before it starts), the
# blank line(s) after it, then the indented block.
_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)(?:(?:Examples?::|Example:)[ \t]*\n(?:[ \t]*\n)*"
    r"|Examples:[ \t]*\n(?:[ \t]*\n)+)"
    r"(?P<body>(?:(?P=indent)[ \t]+\S.*\n|[ \t]*\n)+)",
    re.MULTILINE,
)
# Headings that do not render as code: ``Example::``, ``Examples::``, ``Example:``, and
# ``Examples:`` with a blank line after it.
OLD = re.compile(
    r"^[ \t]*(?:(?:Examples?::|Example:)[ \t]*$|Examples:[ \t]*\n[ \t]*$)", re.MULTILINE
)


def _rewrite(m: re.Match) -> str:
    indent, body = m.group("indent"), m.group("body")
    trailing = body[len(body.rstrip("\n")) + 1 :]  # blank lines after the block stay
    lines = body.rstrip("\n").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    inner = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    sub = indent + "    "
    text = [(sub + x[inner:]) if x.strip() else "" for x in lines]
    if not any(x.lstrip().startswith(">>>") for x in lines):
        text = [sub + "```bash", *text, sub + "```"]
    return f"{indent}Examples:\n" + "\n".join(text) + "\n" + trailing


def convert(text: str) -> str:
    """``text`` with every ``Example::`` block rewritten as an ``Examples:`` section."""
    return _BLOCK.sub(_rewrite, text)


def leftovers(root: Path) -> list[str]:
    """``path:line`` of every ``Example::`` heading left under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for m in OLD.finditer(text):
            found.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}")
    return found


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[1] / "arrayattn"
    if "--check" not in argv:
        for path in sorted(root.rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            new = convert(text)
            if new != text:
                path.write_text(new, encoding="utf-8")
                print(f"rewrote {path.relative_to(root.parent)}")
    left = leftovers(root)
    for where in left:
        print(f"left: {where}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
