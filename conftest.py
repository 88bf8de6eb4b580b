"""Collection rules for the doctests in the package itself (``--doctest-modules``).

The framework bridges import their framework at module level, as they must; where that
framework is not installed, their modules are not collected rather than failing to import.
"""

from __future__ import annotations

import ast
import importlib.util

import pytest

_OPTIONAL = ("torch", "jax", "dask", "cupy", "array_api_strict", "transformers", "safetensors")


def _installed(name: str) -> bool:
    """find_spec on the real top-level name: a namespace package (a bare "torch" folder)
    has no origin and does not count as installed."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


collect_ignore_glob = [
    f"arrayattn/{name}/*.py" for name in ("torch", "jax") if not _installed(name)
]


def _imports(example: object) -> set[str]:
    """The top-level modules one doctest example imports."""
    try:
        tree = ast.parse(getattr(example, "source", ""))
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip a docstring example that imports an optional library which is not installed
    (the package's own doctests show torch, Dask and CuPy calls), naming the library."""
    missing = {name for name in _OPTIONAL if not _installed(name)}
    if not missing:
        return
    for item in items:
        dtest = getattr(item, "dtest", None)  # a DoctestItem's parsed docstring
        if dtest is None:
            continue
        needed = sorted(set().union(*map(_imports, dtest.examples)) & missing)
        if needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(needed)}, not installed"))
