"""``.ci/compile_kernels.py`` (the nvcc compile check) loaded as a module, for the tests
that read its parser and its list of kernel variants."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

from _scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "compile_kernels.py"


@cache
def load() -> ModuleType:
    """The script as a module (loaded once)."""
    return load_script(".ci/compile_kernels.py")
