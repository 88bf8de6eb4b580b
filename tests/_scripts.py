"""Scripts of the checkout (examples, benchmarks, CI tools, docs hooks) loaded as
modules, for the tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root."""


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The script at ``ROOT / relative`` as a fresh module named ``name`` (its file
    name's stem by default), registered in ``sys.modules`` first: dataclasses look their
    module up there while the script runs."""
    path = ROOT / relative
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
