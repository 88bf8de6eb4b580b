"""The documentation site as a reader gets it: built once per session (strict MkDocs, as
``.ci/docs.sh`` does), then checked from disk.

- every docstring example on the API pages is a highlighted ``>>>`` code block, and no
  page holds blockquoted ``>>>`` text (what ``Example::`` rendered as);
- every link, script, stylesheet and image of every page resolves to a file of the built
  site opened from disk (``file://``: no folder links, no links from the domain root), and
  every ``#anchor`` into a page exists there;
- no page loads a script, stylesheet or image from the network;
- the Getting started page's code runs on every backend of the test matrix.

Skipped when MkDocs, Material or mkdocstrings is not installed (the ``docs`` extra).
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import array_api_compat
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_ATTR = re.compile(r"""<(?P<tag>a|link|script|img|iframe|source)\b(?P<attrs>[^>]*)>""", re.I)
_URL_ATTR = re.compile(r"""\b(?P<name>href|src)\s*=\s*(?P<q>["'])(?P<url>.*?)(?P=q)""", re.I)
_ID = re.compile(r"""\bid\s*=\s*["']([^"']+)["']""")
_HEADING = re.compile(r'<h\d id="(?P<id>[^"]+)" class="doc doc-heading"')
_PROMPT = '<span class="gp">&gt;&gt;&gt; </span>'


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    env.pop("ARRAYATTN_SITE_URL", None)  # the disk layout is what is checked
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-4000:]}"
    return out


def _pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


def _refs(text: str):
    """(tag, attribute, url, attributes) of every link-like attribute in an HTML page."""
    for m in _ATTR.finditer(text):
        for a in _URL_ATTR.finditer(m.group("attrs")):
            yield (
                m.group("tag").lower(),
                a.group("name").lower(),
                html.unescape(a.group("url")),
                m.group("attrs"),
            )


def _is_remote(url: str) -> bool:
    return url.startswith("//") or bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url))


def _docstrings():
    """Docstring of an API page heading id (``arrayattn.softmax.softmax``), found as
    mkdocstrings finds it (griffe, aliases followed)."""
    import griffe

    package = griffe.load("arrayattn", search_paths=[str(ROOT)], resolve_aliases=False)

    def docstring(path: str) -> str | None:
        try:
            obj = package[path.split(".", 1)[1]] if "." in path else package
            if obj.is_alias:
                obj = obj.final_target
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        return obj.docstring.value if obj.docstring else ""

    return docstring


def test_api_examples_render_as_code(site: Path):
    docstring = _docstrings()
    checked = 0
    for page in sorted((site / "api").glob("*.html")):
        text = page.read_text(encoding="utf-8")
        headings = list(_HEADING.finditer(text))
        for i, m in enumerate(headings):
            end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
            section = text[m.end() : end]
            kind = re.search(r"doc-object-name doc-(\w+)-name", section)
            if kind is None or kind.group(1) == "module":
                continue  # modules: their docstrings hold no examples here
            doc = docstring(m.group("id"))
            assert doc is not None, f"{page.name}: cannot find {m.group('id')}"
            if ">>>" not in doc:
                continue
            n_doc = sum(1 for line in doc.splitlines() if line.lstrip().startswith(">>>"))
            assert '<div class="highlight">' in section and _PROMPT in section, (
                f"{page.name}: the example of {m.group('id')} is not a highlighted code block"
            )
            assert section.count(_PROMPT) >= n_doc, (
                f"{page.name}: {m.group('id')} shows {section.count(_PROMPT)} of its "
                f"{n_doc} '>>>' lines as code"
            )
            checked += 1
    assert checked >= 20, f"only {checked} API entries with examples found on the API pages"


def test_no_blockquoted_prompts(site: Path):
    for page in _pages(site):
        text = page.read_text(encoding="utf-8")
        body = re.sub(r"<code>.*?</code>", "", text, flags=re.S)
        assert "<blockquote>\n<blockquote>" not in body, f"{page}: nested blockquotes"
        assert not re.search(r"<(p|blockquote)>\s*&gt;&gt;&gt;", body), (
            f"{page}: '>>>' rendered as text, not code"
        )


def test_internal_links_resolve_from_disk(site: Path):
    ids: dict[Path, set[str]] = {}

    def ids_of(path: Path) -> set[str]:
        if path not in ids:
            ids[path] = set(_ID.findall(path.read_text(encoding="utf-8")))
        return ids[path]

    problems = []
    for page in _pages(site):
        for tag, attr, url, _ in _refs(page.read_text(encoding="utf-8")):
            if not url or _is_remote(url) or url.startswith("#"):
                if url.startswith("#") and len(url) > 1 and tag == "a":
                    if unquote(url[1:]) not in ids_of(page):
                        problems.append(f"{page.relative_to(site)}: {url} (no such anchor)")
                continue
            parts = urlsplit(url)
            if parts.path.startswith("/"):
                problems.append(f"{page.relative_to(site)}: {url} (from the domain root)")
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not target.is_file():
                what = "a folder" if target.is_dir() else "missing"
                problems.append(f"{page.relative_to(site)}: {tag} {attr}={url} ({what})")
                continue
            if parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in ids_of(target):
                    problems.append(f"{page.relative_to(site)}: {url} (no such anchor)")
    assert not problems, "links that do not open from disk:\n" + "\n".join(problems[:50])


def test_nothing_loaded_from_the_network(site: Path):
    problems = []
    for page in _pages(site):
        text = page.read_text(encoding="utf-8")
        for tag, attr, url, attrs in _refs(text):
            loads = tag in ("script", "img", "iframe", "source") or (
                tag == "link"
                and re.search(r"""rel=["'][^"']*(stylesheet|preload|modulepreload)""", attrs)
            )
            if loads and _is_remote(url) and not url.startswith("data:"):
                problems.append(f"{page.relative_to(site)}: <{tag} {attr}={url}>")
        for m in re.finditer(r"@import\s+url\(\s*['\"]?(https?:)?//", text):
            problems.append(f"{page.relative_to(site)}: {m.group(0)}")
    for sheet in site.rglob("*.css"):
        if re.search(r"@import\s+(url\()?\s*['\"]?(https?:)?//", sheet.read_text("utf-8")):
            problems.append(f"{sheet.relative_to(site)}: @import from the network")
    assert not problems, "pages that load from the network:\n" + "\n".join(problems[:50])


def test_site_has_offline_search_and_math(site: Path):
    assert (site / "search" / "search_index.js").is_file()  # search from file://
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "tex-svg-full.js" in (site / "api" / "softmax.html").read_text(encoding="utf-8")
    assert 'href="getting-started.html"' in index  # file URLs, not folders


# --- Getting started on every backend --------------------------------------------------

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_XP_LINE = "import array_api_compat.numpy as xp"
_DEVICE_LINE = "device = None"


def test_getting_started_runs_on_every_backend(backend):
    text = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    blocks = _BLOCK.findall(text)
    code = "\n".join(blocks)
    # The page chooses its library in two lines; put the backend's in their place.
    assert re.search(rf"^{re.escape(_XP_LINE)}\b", code, re.M), "the page's xp line moved"
    assert re.search(rf"^{re.escape(_DEVICE_LINE)}\b", code, re.M), "the page's device line"
    namespace = {"__name__": "__docs__", "xp": backend.xp, "device": backend.device}
    for number, block in enumerate(blocks, 1):
        block = re.sub(rf"^{re.escape(_XP_LINE)}.*$", "pass", block, flags=re.M)
        block = re.sub(rf"^{re.escape(_DEVICE_LINE)}.*$", "pass", block, flags=re.M)
        exec(compile(block, f"getting-started.md (python block {number})", "exec"), namespace)
    out = namespace["out"]
    like = backend.asarray(np.zeros(1, dtype=np.float32))
    assert array_api_compat.array_namespace(out) is array_api_compat.array_namespace(like)
    assert array_api_compat.device(out) == array_api_compat.device(like)


def test_long_code_lines_wrap_instead_of_scrolling():
    """Code comments longer than the column were cut off behind a horizontal scroll bar:
    the site's stylesheet wraps code lines (but not program-output ``text`` blocks), and
    every page loads it."""
    root = Path(__file__).resolve().parents[2]
    css = (root / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rule = css[css.index(".md-typeset pre > code {") :]
    assert "white-space: pre-wrap" in rule.split("}")[0]
    assert ".language-text pre > code" in css
    assert "stylesheets/extra.css" in (root / "mkdocs.yml").read_text(encoding="utf-8")
