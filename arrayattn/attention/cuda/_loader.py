"""Loading the CUDA sources into CuPy: one compiled module per (device, kernel variant).

The ``.cu`` files ship inside the package and are read through :mod:`importlib.resources`;
``#include "common.cuh"`` is inlined here so NVRTC needs no include path (and the source
text, hence CuPy's on-disk cache key, changes whenever a header does). Each template
instantiation is compiled on first use through ``cupy.RawModule(name_expressions=...)``
and kept for the life of the process; CuPy also caches the binary on disk. A *prelude*
(the block-mask predicate of ``flex_pred.py``: ``#define`` lines) goes in front of the
source; it is part of both caches' keys (the source text), so every predicate structure
is its own module.
"""

from __future__ import annotations

import re
import threading
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["kernel_source", "get_kernel", "COMPILE_OPTIONS"]

COMPILE_OPTIONS = ("-std=c++17",)

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_./]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^#pragma once\s*$", re.MULTILINE)
_LOCK = threading.Lock()
_KERNELS: dict[tuple[int, str, str, str], Any] = {}


@cache
def kernel_source(filename: str) -> str:
    """The text of ``arrayattn/attention/cuda/<filename>`` with local includes inlined (each
    header once, its ``#pragma once`` dropped)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")

        def repl(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(inc)

        return _PRAGMA_ONCE.sub("", _INCLUDE.sub(repl, text))

    return expand(filename)


def get_kernel(filename: str, name_expression: str, smem_bytes: int = 0, prelude: str = "") -> Any:
    """The compiled ``cupy.RawKernel`` for ``name_expression`` (a template instantiation
    such as ``"aa_fwd_tc<0, 128, false, false, 0>"``) from ``filename`` with ``prelude``
    in front (``flex_table.prelude``; ``""``: none), on the current device, with its
    dynamic shared-memory limit raised to ``smem_bytes`` when that exceeds the 48 KB
    default."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, filename, name_expression, prelude)
    kern = _KERNELS.get(key)
    if kern is not None:
        return kern
    with _LOCK:
        kern = _KERNELS.get(key)
        if kern is None:
            module = cupy.RawModule(
                code=prelude + kernel_source(filename),
                options=COMPILE_OPTIONS,
                name_expressions=[name_expression],
            )
            kern = module.get_function(name_expression)
            if smem_bytes > 48 * 1024:
                kern.max_dynamic_shared_size_bytes = smem_bytes
            _KERNELS[key] = kern
    return kern
