"""Griffe extension: render the package's Sphinx roles in Markdown.

The docstrings are written to read well in ``help()`` and use Sphinx roles (:func:`vjp`).
mkdocstrings parses them as Google-style Markdown, where the roles would show as raw text,
so this extension rewrites them when the API pages are built (the source files are not
touched): ``:func:`name```, ``:meth:``, ``:class:``, ... -> ```name``` (a leading ``~``
keeps the last dotted part, as Sphinx does).

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


def _role(m: re.Match) -> str:
    target = m.group(1)
    if "`~" in m.group(0):  # Sphinx's "~": show only the last dotted part
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class RstToMarkdown(griffe.Extension):
    """Rewrite Sphinx roles in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        obj.docstring.value = _ROLE.sub(_role, obj.docstring.value)
