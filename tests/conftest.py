"""Backend fixtures shared by every test.

``xp`` is parametrised over the array libraries that are installed, selected with the
``ARRAYATTN_BACKENDS`` environment variable (comma-separated names from BACKENDS; default:
all). A backend that is not installed is skipped, never failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from arrayattn._backend import library_name


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
        if self.name == "array_api_strict":
            import array_api_strict

            x = array_api_strict.asarray(x, device=array_api_strict.Device("CPU_DEVICE"))
            return np.asarray(x._array)
        return np.asarray(x)

    def __repr__(self) -> str:
        return self.name


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
        import torch  # noqa: F401

        return Backend(name, xp, "cpu")
    if name == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as xp

        return Backend(name, xp, jax.devices()[0])
    if name == "cupy":
        import array_api_compat.cupy as xp
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise ImportError("no CUDA device")
        return Backend(name, xp, cupy.cuda.Device(0))
    raise ValueError(f"unknown backend {name!r}")


BACKENDS = ("numpy", "array_api_strict", "array_api_strict_device1", "torch", "jax", "cupy")


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
