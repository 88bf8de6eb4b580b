"""The package's import graph: no cycles anywhere in ``arrayattn``, and the layers in
their order (the machinery in ``arrayattn.attention`` imports neither the public ops nor
the layers; the registry imports no implementation).

Every import counts: at module level, inside functions (lazy), under ``TYPE_CHECKING``,
and ``importlib.import_module("arrayattn....")`` with a literal name. ``from . import x``
inside a package is an edge to ``x``, not to the package being initialised (an
ancestor of the importing module is always loaded first and never re-run).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "arrayattn"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    """``module -> the arrayattn modules it imports`` (see the module docstring)."""
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    _resolve(mod, is_pkg, node.level, node.module)
                    if node.level
                    else (node.module or "")
                )
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                targets = [node.args[0].value]
            for t in targets:
                while t and t not in mods:  # a name imported from a module: the module
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("arrayattn") and not mod.startswith(t + "."):
                    edges[mod].add(t)
    for mod in mods:
        edges.setdefault(mod, set())
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layers_import_downwards_only():
    edges = import_graph()
    for mod, targets in edges.items():
        if mod.startswith("arrayattn.attention"):
            upward = sorted(t for t in targets if t.startswith(("arrayattn.ops", "arrayattn.nn")))
            assert not upward, f"{mod} (the machinery) imports the layers above it: {upward}"
        if mod.startswith("arrayattn.ops"):
            upward = sorted(t for t in targets if t.startswith("arrayattn.nn"))
            assert not upward, f"{mod} (an op) imports the nn layer: {upward}"
    registry = edges["arrayattn.attention.registry"]
    assert registry <= {"arrayattn._backend", "arrayattn.attention.spec"}, registry
    # each implementation registers itself: the registry's users, not the registry, know them
    impls = edges["arrayattn.attention.implementations"]
    assert impls == {f"arrayattn.attention.{n}" for n in ("composed", "chunked", "fast", "dask",
                                                          "cuda")}  # fmt: skip


def test_framework_bridges_sit_on_top():
    # arrayattn.torch and arrayattn.jax use the public ops; nothing else in the package
    # imports them, so importing arrayattn never imports a framework bridge.
    edges = import_graph()
    bridges = ("arrayattn.torch", "arrayattn.jax")
    assert any(m.startswith(bridges) for m in edges), "the bridges are not in the graph"
    for mod, targets in edges.items():
        if mod.startswith(bridges):
            continue
        upward = sorted(t for t in targets if t.startswith(bridges))
        assert not upward, f"{mod} imports a framework bridge: {upward}"
