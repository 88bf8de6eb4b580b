"""MkDocs hook: publish the project's source with the site, so every page leads to its code.

The site is read offline and from disk, and the project has no public repository address
to link to, so the code travels with the site instead of behind a ``repo_url``:

* every ``arrayattn/**/*.py``, ``examples/*.py`` and ``bench/*.py`` becomes a page
  ``source/<path>.html`` (highlighted, numbered lines, each line an anchor), kept out of
  the navigation and of the search index; pages link to them as ``source/<path>.md``
  (e.g. the Examples page to ``source/examples/tiny_gpt.py.md``);
* every documentation page's own Markdown becomes ``source/docs/<page>.html``, and the
  page's "view source" button (Material's ``content.action.view``) opens it;
* API entries show their code inline (mkdocstrings ``show_source``).

Nothing here touches the network.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

PREFIX = "source"
# (folder, glob, fence language) of the repository files published as pages.
SOURCES = (
    ("arrayattn", "**/*.py", "python"),
    ("examples", "*.py", "python"),
    ("bench", "*.py", "python"),
)
_TICKS = re.compile(r"`{3,}")


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _page(path: str, text: str, language: str) -> str:
    # A fence longer than any backtick run in the file, so the file cannot close it.
    fence = "`" * max([3, *(len(m.group(0)) + 1 for m in _TICKS.finditer(text))])
    return (
        f"---\nsearch:\n  exclude: true\n---\n\n# `{path}`\n\n"
        f'{fence}{language} linenums="1"\n{text.rstrip()}\n{fence}\n'
    )


def _generated(config, src_uri: str, content: str) -> File:
    return File.generated(config, src_uri, content=content, inclusion=InclusionLevel.NOT_IN_NAV)


def on_files(files, config):
    """Add the source pages (repository files and the docs' own Markdown)."""
    root = _root(config)
    docs = [f for f in files.documentation_pages() if not f.generated_by]
    for folder, pattern, language in SOURCES:
        for path in sorted((root / folder).glob(pattern)):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in rel:
                continue
            text = path.read_text(encoding="utf-8")
            files.append(_generated(config, f"{PREFIX}/{rel}.md", _page(rel, text, language)))
    for f in docs:
        rel = f"docs/{f.src_uri}"
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        files.append(_generated(config, f"{PREFIX}/{rel}.md", _page(rel, text, "markdown")))
    return files


def on_page_context(context, page, config, nav):
    """Point the page's "view source" button at its Markdown source page."""
    if page.file.generated_by or page.file.src_uri.startswith(f"{PREFIX}/"):
        page.edit_url = None  # generated pages have no Markdown of their own
        return context
    target = f"{PREFIX}/docs/{page.file.src_uri}.html"
    page.edit_url = posixpath.relpath(target, posixpath.dirname(page.file.dest_uri) or ".")
    return context
