"""Run the Python examples of the documentation, so the docs cannot drift from the code.

Every fenced ``python`` block of every page under ``docs/`` runs, in page order, with one
namespace per page (later blocks may use what earlier ones defined). Blocks that are only
a call signature (``name(args...)`` without an ``import``) are skipped. A block whose
``import`` names a library that is not installed (``torch``, ``cupy``, ...) is skipped and
reported, and so is every later block of the page that uses a name such a skipped block
would have defined (``nn = torch.nn`` in one block, ``nn.Linear`` in the next). Anything
else that raises fails the run.

Opting out (for examples that need downloaded data, a GPU or minutes), with HTML comments
that do not show on the site: ``<!-- docs-examples: skip -->`` anywhere in a page skips the
page; ``<!-- docs-examples: skip-next -->`` on the line before a block skips that block.

    python .ci/docs_examples.py            # from the repository root
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
import traceback
import warnings
from pathlib import Path

BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SIGNATURE = re.compile(r"^[\w.]+\(")
SKIP_PAGE = "<!-- docs-examples: skip -->"
SKIP_NEXT = "<!-- docs-examples: skip-next -->"


def _names(code: str) -> tuple[set[str], set[str]]:
    """``(defined, used)``: the names a block binds (assignments, imports, defs) and the
    names it reads; both empty when it does not parse (its failure is reported anyway)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set(), set()
    defined: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                defined.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
    return defined, used


def run_page(page: Path, root: Path) -> tuple[int, int, list[str]]:
    """Run one page's blocks; return (ran, skipped, failures)."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    ran, skipped, failures = 0, 0, []
    unavailable: set[str] = set()  # names only a skipped block would have defined
    text = page.read_text(encoding="utf-8")
    if SKIP_PAGE in text:
        print(f"skipped {page.relative_to(root)}: marked {SKIP_PAGE}")
        return 0, 0, []
    for number, match in enumerate(BLOCK.finditer(text)):
        code = match.group(1)
        if SIGNATURE.match(code) and "import" not in code:
            continue
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        if before.strip() == SKIP_NEXT:
            skipped += 1
            unavailable |= _names(code)[0]
            continue
        where = f"{page.relative_to(root)} (python block {number + 1})"
        defined, used = _names(code)
        # (a name the block binds itself, an import say, is its own)
        needs = sorted(n for n in (used & unavailable) - defined if n not in namespace)
        if needs:
            skipped += 1
            unavailable |= defined
            print(f"skipped {where}: uses {', '.join(needs)} from a skipped block")
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(compile(code, where, "exec"), namespace)
            ran += 1
        except ModuleNotFoundError as e:
            skipped += 1
            unavailable |= defined
            print(f"skipped {where}: {e.name} is not installed")
        except Exception:
            failures.append(f"{where}:\n{traceback.format_exc(limit=3)}")
    return ran, skipped, failures


def main() -> int:
    root = Path(__file__).resolve().parents[1] / "docs"
    ran = skipped = 0
    failures: list[str] = []
    for page in sorted(root.rglob("*.md")):
        r, s, f = run_page(page, root)
        ran, skipped, failures = ran + r, skipped + s, failures + f
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    print(f"docs examples: {ran} ran, {skipped} skipped, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
