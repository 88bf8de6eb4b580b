"""Griffe extension: render the package's reStructuredText-isms in Markdown.

The docstrings are written to read well in ``help()``: Sphinx roles (:func:`vjp`) and
``Example::`` literal blocks. mkdocstrings parses them as Google-style Markdown, where the
roles would show as raw text, so this extension rewrites them when the API pages are
built (the source files are not touched):

* ``:func:`name```, ``:meth:``, ``:class:``, ... -> ```name``` (a leading ``~`` keeps the
  last dotted part, as Sphinx does);
* ``Example::`` / ``Examples::`` -> ``Example:`` so the Google parser makes it an examples
  section (rendered as a doctest code block).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|obj|exc):`~?([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)(Examples?)::\s*$", re.MULTILINE)


def _role(m: re.Match) -> str:
    target = m.group(1)
    if "`~" in m.group(0):  # Sphinx's "~": show only the last dotted part
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class RstToMarkdown(griffe.Extension):
    """Rewrite Sphinx roles and ``Example::`` blocks in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = _ROLE.sub(_role, obj.docstring.value)
        obj.docstring.value = _EXAMPLE.sub(r"\1\2:", text)
