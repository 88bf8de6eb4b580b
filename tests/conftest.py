"""Backend fixtures shared by every test.

``xp`` is parametrised over the array libraries that are installed, selected with the
``ARRAYATTN_BACKENDS`` environment variable (comma-separated names from BACKENDS; default:
all). A backend that is not installed is skipped, never failed.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from arrayattn._backend import library_name

# Test modules in subfolders import the shared oracles and helpers (``_reference``,
# ``_helpers``) from here, whatever pytest's import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@dataclass(frozen=True)
class Backend:
    """An array library under test, on one device."""

    name: str
    xp: Any  # array-API namespace
    device: Any

    def asarray(self, a: np.ndarray) -> Any:
        """Move a NumPy array (the test's data) to this backend, keeping its dtype."""
        if self.name == "jax":
            import jax.numpy as jnp

            return jnp.asarray(a)
        return self.xp.asarray(a, device=self.device)

    def to_numpy(self, x: Any) -> np.ndarray:
        """Bring an array of this backend back to NumPy."""
        if self.name == "cupy":
            return x.get()
        if self.name == "torch":
            return x.detach().cpu().numpy()
        if self.name.startswith("array_api_strict"):  # also array_api_strict_device1
            import array_api_strict

            x = array_api_strict.asarray(x, device=array_api_strict.Device("CPU_DEVICE"))
            return np.asarray(x._array)
        return np.asarray(x)

    @property
    def compiles_per_shape(self) -> bool:
        """True for JAX, where every new shape costs a compilation (about a second): big
        test matrices run a representative subset there (see ``_helpers.thin``)."""
        return self.name == "jax"

    def call(self, fn: Any, *arrays: Any, **options: Any) -> Any:
        """``fn(*arrays, **options)``; on JAX under ``jax.jit`` (options static), which
        also proves the op traces without data-dependent Python values."""
        if self.name == "jax":
            return _jit_arrays(functools.partial(fn, **options), arrays)
        return fn(*arrays, **options)

    def vjp(self, fn: Any, arrays: tuple, cotangent: Any, **options: Any) -> tuple[Any, Any]:
        """``(out, grads)`` of ``arrayattn.vjp(fn, *arrays, **options)`` pulled back with
        ``cotangent`` (an array of this backend, or a tuple for tuple outputs); jitted on
        JAX."""
        import arrayattn

        def run(*a: Any) -> tuple[Any, Any]:
            out, pullback = arrayattn.vjp(fn, *a, **options)
            return out, pullback(cotangent)

        if self.name == "jax":
            return _jit_arrays(run, arrays)
        return run(*arrays)

    def __repr__(self) -> str:
        return self.name


def _jit_arrays(fn: Any, args: tuple) -> Any:
    """``jax.jit(fn)(*args)`` tracing only the JAX arrays; other positional arguments
    (ints such as ``num_heads``, ``None``) stay static Python values."""
    import jax

    dynamic = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

    def inner(*arrays: Any) -> Any:
        full = list(args)
        for i, a in zip(dynamic, arrays, strict=True):
            full[i] = a
        return fn(*full)

    return jax.jit(inner)(*(args[i] for i in dynamic))


def _make(name: str) -> Backend:
    if name == "numpy":
        import array_api_compat.numpy as xp

        return Backend(name, xp, "cpu")
    if name == "array_api_strict":
        import array_api_strict as xp

        return Backend(name, xp, xp.Device("CPU_DEVICE"))
    if name == "array_api_strict_device1":
        import array_api_strict as xp

        return Backend(name, xp, xp.Device("device1"))
    if name == "torch":
        import array_api_compat.torch as xp
        import torch

        return Backend(name, xp, torch.device("cpu"))
    if name == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as xp

        return Backend(name, xp, jax.devices()[0])
    if name == "dask":
        import array_api_compat.dask.array as xp

        return Backend(name, xp, "cpu")
    if name == "cupy":
        import array_api_compat.cupy as xp
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise ImportError("no CUDA device")
        return Backend(name, xp, cupy.cuda.Device(0))
    raise ValueError(f"unknown backend {name!r}")


BACKENDS = (
    "numpy",
    "array_api_strict",
    "array_api_strict_device1",
    "torch",
    "jax",
    "dask",
    "cupy",
)


def _selected() -> list[str]:
    env = os.environ.get("ARRAYATTN_BACKENDS", "").strip()
    if not env:
        return list(BACKENDS)
    names = [n.strip() for n in env.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise ValueError(f"ARRAYATTN_BACKENDS names unknown backends {unknown}; known: {BACKENDS}")
    return names


@pytest.fixture(params=_selected())
def backend(request: pytest.FixtureRequest) -> Backend:
    """One installed backend (skips the test when the library or device is missing)."""
    try:
        return _make(request.param)
    except Exception as exc:  # ImportError, or a CUDA runtime error without a GPU
        pytest.skip(f"{request.param} not available: {exc}")


@pytest.fixture
def xp(backend: Backend) -> Any:
    """The array-API namespace of ``backend``."""
    return backend.xp


def library_of(x: Any) -> str:
    import array_api_compat

    return library_name(array_api_compat.array_namespace(x))


@pytest.fixture(params=("float16", "float32", "float64"))
def dtype_name(request: pytest.FixtureRequest) -> str:
    """A floating dtype name; pair with ``_helpers.backend_dtype`` (skips what a backend
    lacks, such as float16 on array-api-strict)."""
    return request.param


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed-seed NumPy generator: tests draw their data with NumPy and move it with
    ``backend.asarray`` so every backend sees the same numbers."""
    return np.random.default_rng(20240611)


@pytest.fixture
def numpy_backend() -> Backend:
    """The NumPy backend, for checks that only need one library (finite differences)."""
    return _make("numpy")
