"""``.ci/compile_kernels.py`` (the nvcc compile check) loaded as a module, for the tests
that read its parser and its list of kernel variants."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "compile_kernels.py"


@cache
def load() -> ModuleType:
    """The script as a module (loaded once)."""
    spec = importlib.util.spec_from_file_location("compile_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compile_kernels"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
