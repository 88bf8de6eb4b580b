"""Subnormal floats flushed to zero while the NumPy fast path computes (x86-64 Linux).

On x86 CPUs an operation that produces a subnormal result (or reads a subnormal input)
takes a microcode assist of a hundred cycles or more unless the thread's MXCSR register
has its flush-to-zero (FTZ) and denormals-are-zero (DAZ) bits set. Attention meets this
as soon as scores spread by more than ~87 in a row (float32 ``exp`` below ``e**-87.3``,
``FLT_MIN``): measured on a 2-core Xeon (``bench/RESULTS.md``), NumPy's ``exp`` over a
256 x 512 float32 tile took 826 us when its results were subnormal against 73 us, and the
fast path's forward at L = 2048 (scores with standard deviation 16, as trained models
without QK-norm give) 5.4x its time on unit scores. TensorFlow and XLA run their CPU
kernels with FTZ/DAZ set for the same reason; PyTorch offers
``torch.set_flush_denormal``.

:func:`flushed` sets both bits for the calling thread and restores the thread's previous
floating-point environment on exit (MXCSR is per thread: nothing outside the block, and
no other thread, sees a change). What it changes in results: values below the smallest
normal (``1.2e-38`` in float32, ``2.2e-308`` in float64) become 0, in the products, the
exponentials and the sums of the tiles; next to a row's largest weight (1 after the
shift, or the row sums the static path keeps above ``static_shift.TINY``) such a term is
below the dtype's resolution. ``ARRAYATTN_FLUSH_DENORMALS=0`` turns it off.

How: glibc's ``fegetenv``/``fesetenv`` through ``ctypes``; on x86-64 its ``fenv_t`` is the
28-byte x87 environment followed by the 32-bit MXCSR. The first use checks the effect
itself (``1e-38 * 0.5`` is 0 inside the block and not after it) and turns the feature off
where it does not hold (another C library, another CPU): then :func:`flushed` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["available", "flushed"]

_FTZ = 0x8000  # MXCSR bit 15: results below the smallest normal become 0
_DAZ = 0x0040  # MXCSR bit 6: subnormal inputs read as 0
_MXCSR_OFFSET = 28  # glibc x86-64 fenv_t: x87 environment (28 bytes), then __mxcsr
_ENV_BYTES = 64  # room for fenv_t (32 bytes on x86-64)

_LIBM: Any = None
_CHECKED = False
_LOCK = threading.Lock()


def _libm() -> Any:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        get, put = lib.fegetenv, lib.fesetenv
    except (OSError, AttributeError):
        return None
    for fn in (get, put):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return lib


def _set(lib: Any) -> ctypes.Array[ctypes.c_char] | None:
    """Set FTZ and DAZ for this thread; the environment before, or ``None``."""
    saved = ctypes.create_string_buffer(_ENV_BYTES)
    if lib.fegetenv(saved) != 0:
        return None
    env = ctypes.create_string_buffer(saved.raw, _ENV_BYTES)
    at = _MXCSR_OFFSET
    mxcsr = int.from_bytes(env.raw[at : at + 4], "little") | _FTZ | _DAZ
    ctypes.memmove(ctypes.addressof(env) + at, mxcsr.to_bytes(4, "little"), 4)
    if lib.fesetenv(env) != 0:
        lib.fesetenv(saved)
        return None
    return saved


def _works(lib: Any) -> bool:
    """Whether setting the bits flushes, and restoring them un-flushes, on this thread."""
    tiny = np.array([1e-38], np.float32)
    saved = _set(lib)
    if saved is None:
        return False
    try:
        inside = float((tiny * np.float32(0.5))[0])
    finally:
        lib.fesetenv(saved)
    after = float((tiny * np.float32(0.5))[0])
    return inside == 0.0 and after != 0.0


def available() -> bool:
    """Whether :func:`flushed` flushes here (x86-64 Linux with glibc, checked once, and
    not turned off by ``ARRAYATTN_FLUSH_DENORMALS=0``).

    Examples:
        >>> isinstance(available(), bool)
        True
    """
    global _LIBM, _CHECKED
    if os.environ.get("ARRAYATTN_FLUSH_DENORMALS", "").strip() == "0":
        return False
    if not _CHECKED:
        with _LOCK:
            if not _CHECKED:
                lib = _libm()
                _LIBM = lib if lib is not None and _works(lib) else None
                _CHECKED = True
    return _LIBM is not None


@contextlib.contextmanager
def flushed() -> Iterator[None]:
    """Flush subnormal results and inputs to zero on this thread inside the block (see
    the module's text); the thread's floating-point environment is restored on exit.

    Examples:
        >>> import numpy as np
        >>> with flushed():
        ...     x = np.array([1e-38], np.float32) * np.float32(0.5)
        >>> bool(x[0] == 0) == available()
        True
    """
    saved = _set(_LIBM) if available() else None
    try:
        yield
    finally:
        if saved is not None:
            _LIBM.fesetenv(saved)
