"""The array libraries a test can run on: one :class:`Backend` per library and device.

``BACKENDS`` names every backend the kit knows; :func:`selected_backends` reads a
selection (``--backends`` or ``ARRAYATTN_BACKENDS``, comma-separated); :func:`make_backend`
imports one and raises ``ImportError`` when it is not installed (the pytest fixtures turn
that into a skip, never a failure). No pytest import here: the kit is usable without it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "BACKENDS",
    "Backend",
    "make_backend",
    "selected_backends",
    "available_backends",
]

BACKENDS = (
    "numpy",
    "array_api_strict",
    "array_api_strict_device1",
    "torch",
    "jax",
    "dask",
    "cupy",
)

ENV_VAR = "ARRAYATTN_BACKENDS"

# The library modules (and array-api-compat's wrappers of them) that name a backend.
LIBRARY_MODULES = (
    "numpy, cupy, torch, jax.numpy, array_api_strict, dask.array, or array-api-compat's "
    "wrapper of one such as array_api_compat.numpy"
)


@dataclass(frozen=True)
class Backend:
    """An array library under test, on one device.

    Attributes:
        name: one of :data:`BACKENDS`.
        xp: its array-API namespace.
        device: the device arrays are created on.

    Examples:
        >>> from arrayattn.testing import make_backend
        >>> import numpy as np
        >>> b = make_backend("numpy")
        >>> b.to_numpy(b.asarray(np.arange(3.0))).tolist()
        [0.0, 1.0, 2.0]
    """

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

    def dtype(self, name: str) -> Any:
        """The backend's dtype called ``name``, or ``None`` when it has none (float16 on
        array-api-strict, bfloat16 on NumPy)."""
        return getattr(self.xp, name, None)

    @property
    def compiles_per_shape(self) -> bool:
        """True for JAX, where every new shape costs a compilation (about a second): big
        test matrices run a representative subset there."""
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

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # By name (a namespace module cannot be pickled): the backend is made again with
        # make_backend in the process that unpickles it, on the device that name gives.
        return (make_backend, (self.name,))


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


def backend_name_of(library: Any) -> str | None:
    """The :data:`BACKENDS` name of an array library's module or array-API namespace
    (``numpy``, ``array_api_compat.numpy``, ``torch``, ``jax.numpy``, ...), or ``None``
    when it is none of them.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing._backends import backend_name_of
        >>> backend_name_of(np), backend_name_of(np.linalg)
        ('numpy', None)
    """
    import array_api_compat as compat

    if not isinstance(getattr(library, "__name__", None), str):  # not a module
        return None
    recognisers = (
        ("numpy", compat.is_numpy_namespace),
        ("array_api_strict", compat.is_array_api_strict_namespace),
        ("torch", compat.is_torch_namespace),
        ("jax", compat.is_jax_namespace),
        ("dask", compat.is_dask_namespace),
        ("cupy", compat.is_cupy_namespace),
    )
    for name, is_namespace in recognisers:
        if is_namespace(library):
            return name
    return None


def make_backend(name: str | ModuleType | Backend) -> Backend:
    """The :class:`Backend` called ``name``, or the one of a library module (``numpy``,
    ``torch``, ``jax.numpy``, ``array_api_strict``, ``dask.array``, ``cupy``, and
    array-api-compat's wrapped namespaces such as ``array_api_compat.numpy``): the
    ``xp`` of the array-API world. A :class:`Backend` is returned as it is.

    Raises:
        ValueError: ``name`` is a string not in :data:`BACKENDS`.
        TypeError: ``name`` is a module (or other object) of no supported library.
        ImportError: the library (or, for CuPy, a CUDA device) is missing.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import make_backend
        >>> make_backend("numpy").device
        'cpu'
        >>> make_backend(np).name
        'numpy'
    """
    if isinstance(name, Backend):
        return name
    if not isinstance(name, str):
        library = name
        found = backend_name_of(library)
        if found is None:
            raise TypeError(
                f"xp must be a backend name from {BACKENDS} or an array library module "
                f"({LIBRARY_MODULES}); got {library!r}"
            )
        name = found
    if name == "numpy":
        import array_api_compat.numpy as xnp

        return Backend(name, xnp, "cpu")
    if name == "array_api_strict":
        import array_api_strict

        return Backend(name, array_api_strict, array_api_strict.Device("CPU_DEVICE"))
    if name == "array_api_strict_device1":
        import array_api_strict

        return Backend(name, array_api_strict, array_api_strict.Device("device1"))
    if name == "torch":
        import array_api_compat.torch as xtorch
        import torch

        return Backend(name, xtorch, torch.device("cpu"))
    if name == "jax":
        import jax

        # Without x64, float64 arrays silently become float32.
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        return Backend(name, jnp, jax.devices()[0])
    if name == "dask":
        import array_api_compat.dask.array as xdask

        return Backend(name, xdask, "cpu")
    if name == "cupy":
        import array_api_compat.cupy as xcupy
        import cupy

        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDA runtime error without a driver
            raise ImportError(f"no CUDA device: {exc}") from exc
        if count < 1:
            raise ImportError("no CUDA device")
        return Backend(name, xcupy, cupy.cuda.Device(0))
    raise ValueError(
        f"backend must be one of {BACKENDS} or an array library module ({LIBRARY_MODULES}); "
        f"got {name!r}"
    )


def selected_backends(option: str | Sequence[str] | None = None) -> list[str]:
    """The backend names to run: ``option`` (a comma-separated string or a sequence, as
    given to ``--backends``), else the ``ARRAYATTN_BACKENDS`` environment variable, else
    all of :data:`BACKENDS`. Unknown names are a ``ValueError``.

    Examples:
        >>> from arrayattn.testing import selected_backends
        >>> selected_backends("numpy, torch")
        ['numpy', 'torch']
    """
    if option is None:
        option = os.environ.get(ENV_VAR, "")
    if isinstance(option, str):
        names = [n.strip() for n in option.split(",") if n.strip()]
    else:
        names = [str(n).strip() for n in option if str(n).strip()]
    if not names:
        return list(BACKENDS)
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise ValueError(
            f"backends (--backends / {ENV_VAR}) names unknown backends {unknown}; known: {BACKENDS}"
        )
    return names


def available_backends(names: Sequence[str] | None = None) -> list[str]:
    """Those of ``names`` (default: all of :data:`BACKENDS`) that import here.

    Examples:
        >>> from arrayattn.testing import available_backends
        >>> "numpy" in available_backends()
        True
    """
    out = []
    for name in BACKENDS if names is None else names:
        try:
            make_backend(name)
        except Exception:  # ImportError, or a CUDA runtime error without a GPU
            continue
        out.append(name)
    return out
