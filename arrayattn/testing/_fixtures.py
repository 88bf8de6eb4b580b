"""pytest fixtures and hooks over the installed backends, shared by the ``arrayattn``
pytest plugin (:mod:`arrayattn.testing.pytest_plugin`) and arrayattn's own
``tests/conftest.py``.

The backend list is read after the command line is parsed (``--backends``, else
``ARRAYATTN_BACKENDS``, else all), so the parametrisation happens in
``pytest_generate_tests`` rather than in a fixture's static ``params``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from ._backends import ENV_VAR, Backend, make_backend, selected_backends

__all__ = [
    "PLUGIN_NAME",
    "plugin_active",
    "add_backends_option",
    "register_markers",
    "backend_names",
    "parametrize_backends",
    "arrayattn_backend",
    "xp",
    "dtype_name",
    "rng",
    "numpy_backend",
]

# The entry-point name in pyproject.toml: ``-p no:arrayattn`` disables the plugin.
PLUGIN_NAME = "arrayattn"
PLUGIN_MODULE = "arrayattn.testing.pytest_plugin"
BACKEND_FIXTURE = "arrayattn_backend"


def plugin_active(pluginmanager: pytest.PytestPluginManager) -> bool:
    """True when the plugin module is registered, whether through its entry point
    (``arrayattn``) or by module name (``-p arrayattn.testing.pytest_plugin``); a
    ``conftest.py`` then leaves ``--backends`` and the parametrisation to it."""
    mod = sys.modules.get(PLUGIN_MODULE)
    return mod is not None and pluginmanager.is_registered(mod)


SKIP_MARKER = "skip_xp_backends"


def register_markers(config: pytest.Config) -> None:
    """Declare ``@pytest.mark.skip_xp_backends("jax", reason=...)`` (SciPy's name): the
    ``xp`` / ``arrayattn_backend`` fixtures skip the named backends."""
    config.addinivalue_line(
        "markers",
        f"{SKIP_MARKER}(*names, reason=...): skip these backends of the xp fixture",
    )


def add_backends_option(parser: pytest.Parser) -> None:
    """Add ``--backends`` (comma-separated backend names)."""
    parser.getgroup("arrayattn").addoption(
        "--backends",
        action="store",
        default=None,
        dest="arrayattn_backends",
        help=(
            "comma-separated array backends for the xp fixture (numpy, array_api_strict, "
            f"array_api_strict_device1, torch, jax, dask, cupy); default: ${ENV_VAR}, "
            "else all; missing libraries are skipped"
        ),
    )


def backend_names(config: pytest.Config) -> list[str]:
    """The selected backend names (``--backends``, else ``ARRAYATTN_BACKENDS``, else all);
    unknown names are a usage error."""
    try:
        return selected_backends(config.getoption("arrayattn_backends", default=None))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def parametrize_backends(metafunc: pytest.Metafunc) -> None:
    """Parametrise every test that uses ``arrayattn_backend`` (directly or through ``xp``)
    over the selected backends, with the backend name as the test id."""
    if BACKEND_FIXTURE in metafunc.fixturenames:
        names = backend_names(metafunc.config)
        metafunc.parametrize(BACKEND_FIXTURE, names, indirect=True, ids=names, scope="function")


@pytest.fixture
def arrayattn_backend(request: pytest.FixtureRequest) -> Backend:
    """One selected :class:`~arrayattn.testing.Backend`; skips the test when its library
    (or device) is missing."""
    name = getattr(request, "param", None)
    if name is None:  # not parametrised (no hook ran): the first selected backend
        name = backend_names(request.config)[0]
    for marker in request.node.iter_markers(SKIP_MARKER):
        if name in marker.args:
            pytest.skip(marker.kwargs.get("reason", f"skipped on {name}"))
    try:
        return make_backend(name)
    except Exception as exc:  # ImportError, or a CUDA runtime error without a GPU
        pytest.skip(f"{name} not available: {exc}")


@pytest.fixture
def xp(arrayattn_backend: Backend) -> Any:
    """The array-API namespace of one selected backend (as SciPy's ``xp`` fixture)."""
    return arrayattn_backend.xp


@pytest.fixture(params=("float16", "float32", "float64"))
def dtype_name(request: pytest.FixtureRequest) -> str:
    """A floating dtype name; pair with ``helpers.backend_dtype`` (skips what a backend
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
    return make_backend("numpy")
