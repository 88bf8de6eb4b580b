"""MkDocs hook: put ``bench/RESULTS.md`` (and the plots it shows) into the site.

The benchmark results live next to the benchmarks, outside ``docs/``, and are appended to
whenever someone measures again. This hook reads them at build time, so the site always
shows the current file without a copy to keep in sync:

* the marker ``<!-- bench-results -->`` in ``performance.md`` is replaced by the latest
  run of each machine (a CPU run, ``### Run of DATE``, is keyed by its ``cpu`` and
  ``cores`` lines; a GPU run, ``## DEVICE — DATE — commit ...``, by its device), with an
  earlier run of that machine kept while it has tables the later ones lack (a partial
  repeat hides nothing), headings moved under the page's ``## Benchmark results``, and a
  link to the full record;
* the full record, the whole file, is the page ``performance-record.html`` (generated,
  kept out of the navigation);
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

from mkdocs.structure.files import File, InclusionLevel

MARKER = "<!-- bench-results -->"
RESULTS = "bench/RESULTS.md"
PAGE = "performance.md"
RECORD = "performance-record.md"
# Files a results page may link to that are worth publishing with the site.
PUBLISHED_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp", ".csv", ".json", ".txt"}

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s")
# The two kinds of run the benchmarks append: arrayattn/bench.py (CPU) and
# bench/gpu_bench.py (GPU, "## <device> — <date> — commit <sha>").
_CPU_RUN = re.compile(r"^#{2,3} Run of (?P<date>.+?)\s*$")
_GPU_RUN = re.compile(r"^## (?P<device>.+?) — (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d UTC)")
_MACHINE_LINE = re.compile(r"^- (cpu|cores): (.+)$")


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


def _sections(lines: list[str]) -> list[list[str]]:
    """The file cut before every heading of level 2 or 3 outside code fences."""
    sections: list[list[str]] = [[]]
    in_fence = False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and re.match(r"^#{2,3}\s", line):
            sections.append([])
        sections[-1].append(line)
    return [sec for sec in sections if any(x.strip() for x in sec)]


def _machine(section: list[str]) -> tuple[str, str] | None:
    """(machine, date) of a run section, or ``None`` for any other section."""
    if m := _GPU_RUN.match(section[0]):
        return m.group("device").strip(), m.group("date")
    if m := _CPU_RUN.match(section[0]):
        facts = dict(x.group(1, 2) for line in section if (x := _MACHINE_LINE.match(line)))
        name = facts.get("cpu", "unnamed CPU")
        if "cores" in facts:
            name += f", {facts['cores']}"
        return name, m.group("date")
    return None


def _tables(section: list[str]) -> frozenset[str]:
    """The titles of a run's tables (its headings below the run's own), or the run's own
    heading for a run without any (a GPU run's single table)."""
    titles, in_fence = set(), False
    for line in section[1:]:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := _HEADING.match(line)):
            titles.add(line[len(m.group(1)) :].strip())
    return frozenset(titles) or frozenset({"(the run)"})


def latest_runs(lines: list[str]) -> list[tuple[str, str, list[str]]]:
    """(machine, date, section) of the latest run of each machine, in file order (runs
    are appended, so later is newer). A run that measured only some tables (a repeat of
    one section) does not hide the rest: an earlier run of the same machine is kept too
    when it has a table no later kept run of that machine has, so each table shows once,
    at its latest."""
    runs = [(key, sec) for sec in _sections(lines) if (key := _machine(sec)) is not None]
    covered: dict[str, set[str]] = {}
    kept = []
    for (machine, date), section in reversed(runs):
        tables = _tables(section)
        seen = covered.setdefault(machine, set())
        if not tables <= seen:
            kept.append((machine, date, section))
            seen |= tables
    return kept[::-1]


def _render(lines: list[str], root: Path, published: set[str], top: int) -> str:
    """``lines`` with headings moved so their top level is ``top`` and links resolved."""
    levels, in_fence = [], False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := _HEADING.match(line)):
            levels.append(len(m.group(1)))
    shift = max(0, top - min(levels)) if levels else 0
    out, in_fence = [], False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append(line)
        elif in_fence:
            out.append(line)
        else:
            if _HEADING.match(line):
                line = "#" * shift + line
            out.append(_rewrite_line(line, root, published))
    return "\n".join(out) + "\n"


def _read(root: Path) -> list[str] | None:
    source = root / RESULTS
    if not source.is_file():
        return None
    lines = source.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]  # its title: the pages have their own
    return lines


def _results_markdown(root: Path) -> tuple[str, set[str]]:
    """The performance page's part: the latest run of each machine and a link to all."""
    lines = _read(root)
    if lines is None:
        return (
            '!!! note "No benchmark results yet"\n'
            f"    `{RESULTS}` did not exist when this site was built. Run the benchmarks "
            "(see above) and rebuild the docs to show them here.\n",
            set(),
        )
    published: set[str] = set()
    runs = latest_runs(lines)
    parts = [
        f"The latest run of each machine in `{RESULTS}` (and, where that run repeated only "
        f"some tables, the latest run with the others), included when the site was built. "
        f"Every run, with the single-thread floor and the analysis written by hand, is in "
        f"the [full record]({RECORD}).\n"
    ]
    for machine, date, section in runs:
        body = section[1:]
        parts.append(f"### {machine}: run of {date}\n")
        parts.append(_render(body, root, published, 4))
    if not runs:
        parts.append(f"No run found in `{RESULTS}`; see the [full record]({RECORD}).\n")
    return "\n".join(parts), published


def _record_markdown(root: Path) -> tuple[str, set[str]]:
    """The full record page: the whole file."""
    lines = _read(root) or []
    published: set[str] = set()
    text = _render(lines, root, published, 2)
    header = (
        "# Benchmark record\n\n"
        f"*Every run in `{RESULTS}`, oldest first, included when the site was built. "
        "The [Performance](performance.md) page says how the figures are measured and "
        "shows the latest run of each machine.*\n\n"
    )
    return header + text, published


def on_files(files, config):
    """Publish the full record page and the files RESULTS.md links to (plots, CSV)."""
    root = _root(config)
    _, published = _results_markdown(root)
    record, more = _record_markdown(root)
    for path in sorted(published | more):
        files.append(File(path, str(root), config["site_dir"], config["use_directory_urls"]))
    files.append(
        File.generated(config, RECORD, content=record, inclusion=InclusionLevel.NOT_IN_NAV)
    )
    return files


def on_page_markdown(markdown, page, config, files):
    """Replace the marker on the performance page by the results."""
    if page.file.src_uri != PAGE or MARKER not in markdown:
        return markdown
    text, _ = _results_markdown(_root(config))
    return markdown.replace(MARKER, text)
