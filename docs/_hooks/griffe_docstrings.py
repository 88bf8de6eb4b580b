"""Griffe extension: render the package's docstrings as the Google parser expects them.

The docstrings are written to read well in ``help()``. mkdocstrings parses them as
Google-style Markdown, so this extension rewrites two habits when the API pages are built
(the source files are not touched):

* Sphinx roles (:func:`vjp`) would show as raw text: ``:func:`name```, ``:meth:``,
  ``:class:``, ... -> ```name``` (a leading ``~`` keeps the last dotted part, as Sphinx
  does);
* an argument entry naming several arguments (``xp, device: ...``, natural in ``help()``)
  matches no parameter, so the table showed it as "required" with no type: it becomes
  one entry per name with the same description, so each gets its own type and default.

Examples are written in the source as Google ``Examples:`` sections, which the parser
renders as highlighted ``>>>`` code; nothing here rewrites them (``Example::`` and
``Example:`` would render as text: ``.ci/docstring_examples.py`` converts them and
``tests/docs`` fails while any is left).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|obj|exc):`~?([^`]+)`")
_ARGS = re.compile(
    r"^(?P<indent>[ \t]*)(?:Args|Arguments|Parameters|Params|Keyword Args|"
    r"Keyword Arguments|Other Parameters):[ \t]*$"
)
# "name, name2 (type): text" -- two or more names, an optional type, the description.
_GROUPED = re.compile(
    r"^(?P<indent>[ \t]+)(?P<names>\*{0,2}\w+(?:[ \t]*,[ \t]*\*{0,2}\w+)+)"
    r"(?P<type>[ \t]*\([^)]*\))?:(?P<rest>.*)$"
)


def _role(m: re.Match) -> str:
    target = m.group(1)
    if "`~" in m.group(0):  # Sphinx's "~": show only the last dotted part
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def split_grouped_args(text: str) -> str:
    """``text`` with every argument entry that names several arguments written as one
    entry per name (each with the entry's type and description)."""
    lines = text.split("\n")
    out: list[str] = []
    i, section_indent = 0, None
    while i < len(lines):
        line = lines[i]
        if m := _ARGS.match(line):
            section_indent = len(m.group("indent"))
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip():
            indent = len(line) - len(line.lstrip())
            if indent <= section_indent:
                section_indent = None  # the section ended
            elif g := _GROUPED.match(line):
                # The entry's continuation: blank lines and lines indented deeper.
                j = i + 1
                while j < len(lines) and (
                    not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
                ):
                    j += 1
                while j > i + 1 and not lines[j - 1].strip():
                    j -= 1
                body = lines[i + 1 : j]
                for name in (n.strip() for n in g.group("names").split(",")):
                    out.append(
                        f"{g.group('indent')}{name}{g.group('type') or ''}:{g.group('rest')}"
                    )
                    out.extend(body)
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    """Rewrite Sphinx roles and grouped argument entries in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        obj.docstring.value = split_grouped_args(_ROLE.sub(_role, obj.docstring.value))
