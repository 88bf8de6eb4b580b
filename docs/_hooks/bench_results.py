"""MkDocs hook: put ``bench/RESULTS.md`` (and the plots it shows) into the performance page.

The benchmark results live next to the benchmarks, outside ``docs/``, and are rewritten
whenever someone measures again. This hook reads them at build time, so the site always
shows the current file without a copy to keep in sync:

* the marker ``<!-- bench-results -->`` in ``performance.md`` is replaced by the file's
  text without its title, headings moved down so its top level is ``###`` (under the
  page's own ``## Benchmark results``);
* links and images are resolved relative to ``bench/``: files that exist there (plots,
  CSV) are published with the site under ``bench/...``; anything else (a source file, a
  missing plot) becomes plain text, so a strict build never fails on the results file;
* without a results file the marker becomes a note saying so.

Nothing here touches the network.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

MARKER = "<!-- bench-results -->"
RESULTS = "bench/RESULTS.md"
PAGE = "performance.md"
# Files a results page may link to that are worth publishing with the site.
PUBLISHED_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp", ".csv", ".json", ".txt"}

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s")


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _resolve(target: str, root: Path) -> str | None:
    """The repository path (``bench/...``) a relative link in RESULTS.md points to, when
    it is a publishable file that exists; otherwise ``None``."""
    path = posixpath.normpath(posixpath.join(posixpath.dirname(RESULTS), target.split("#")[0]))
    if not path.startswith("bench/") or Path(path).suffix.lower() not in PUBLISHED_SUFFIXES:
        return None
    return path if (root / path).is_file() else None


def _rewrite_line(line: str, root: Path, published: set[str]) -> str:
    def fix(m: re.Match) -> str:
        bang, text, target, title = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            return m.group(0)  # web address or in-page anchor: keep
        path = _resolve(target, root)
        if path is not None:
            published.add(path)
            return f"{bang}[{text}]({path}{title})"
        label = text or target
        return f"{label} (`{posixpath.join('bench', target)}`)" if not bang else f"*({label})*"

    return _LINK.sub(fix, line)


def _heading_shift(lines: list[str]) -> int:
    """How many levels to move headings down so the file's top level becomes ``###``
    (the results sit under the page's ``## Benchmark results``)."""
    levels, in_fence = [], False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := _HEADING.match(line)):
            levels.append(len(m.group(1)))
    return max(0, 3 - min(levels)) if levels else 0


def _results_markdown(root: Path) -> tuple[str, set[str]]:
    source = root / RESULTS
    if not source.is_file():
        return (
            '!!! note "No benchmark results yet"\n'
            f"    `{RESULTS}` did not exist when this site was built. Run the benchmarks "
            "(see above) and rebuild the docs to show them here.\n",
            set(),
        )
    published: set[str] = set()
    out, in_fence = [], False
    lines = source.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]  # its title: the page's "Benchmark results" section has one
    shift = _heading_shift(lines)
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append(line)
            continue
        if in_fence:
            out.append(line)
            continue
        if _HEADING.match(line):
            line = "#" * shift + line
        out.append(_rewrite_line(line, root, published))
    text = "\n".join(out)
    header = f"*The text below is `{RESULTS}`, included when the site was built.*\n\n"
    return header + text + "\n", published


def on_files(files, config):
    """Publish the files RESULTS.md links to (plots, CSV) under ``bench/``."""
    root = _root(config)
    _, published = _results_markdown(root)
    for path in sorted(published):
        files.append(File(path, str(root), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    """Replace the marker on the performance page by the results."""
    if page.file.src_uri != PAGE or MARKER not in markdown:
        return markdown
    text, _ = _results_markdown(_root(config))
    return markdown.replace(MARKER, text)
