"""Collection rules for the doctests in the package itself (``--doctest-modules``).

The framework bridges import their framework at module level, as they must; where that
framework is not installed, their modules are not collected rather than failing to import.
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []

# find_spec on the real top-level name: a namespace package (a bare "torch" folder) has no
# origin and does not count as installed.
for _framework in ("torch", "jax"):
    _spec = importlib.util.find_spec(_framework)
    if _spec is None or _spec.origin is None:
        collect_ignore_glob.append(f"arrayattn/{_framework}/*.py")
