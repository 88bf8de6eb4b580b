"""Backend fixtures shared by every test, from the public kit :mod:`arrayattn.testing`.

``backend`` (and ``xp``) run a test once per selected backend: ``--backends`` or the
``ARRAYATTN_BACKENDS`` environment variable (comma-separated names from ``BACKENDS``;
default: all). A backend that is not installed is skipped, never failed.

The ``arrayattn`` pytest plugin (entry point) provides ``--backends``, the
parametrisation and ``xp`` itself; the fixtures are re-declared here (overriding the
plugin's, which pytest allows) and the option and hook added only when the plugin is
off (``-p no:arrayattn``, ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``, or arrayattn not
installed), so both ways give the same tests and neither registers anything twice.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from arrayattn._backend import library_name
from arrayattn.testing._backends import BACKENDS, Backend, make_backend, selected_backends
from arrayattn.testing._fixtures import (
    add_backends_option,
    arrayattn_backend,
    dtype_name,
    numpy_backend,
    parametrize_backends,
    plugin_active,
    register_markers,
    rng,
    xp,
)

# Test modules in subfolders import the shared oracles and helpers (``_reference``,
# ``_helpers``) from here, whatever pytest's import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# Names earlier tests imported from here.
_make = make_backend
__all__ = [
    "BACKENDS",
    "Backend",
    "arrayattn_backend",
    "backend",
    "dtype_name",
    "library_of",
    "numpy_backend",
    "rng",
    "xp",
]


def _selected() -> list[str]:
    return selected_backends()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if not plugin_active(pluginmanager):
        add_backends_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    if not plugin_active(config.pluginmanager):
        register_markers(config)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not plugin_active(metafunc.config.pluginmanager):
        parametrize_backends(metafunc)


@pytest.fixture
def backend(arrayattn_backend: Backend) -> Backend:
    """One installed backend (skips the test when the library or device is missing)."""
    return arrayattn_backend


def library_of(x: Any) -> str:
    import array_api_compat

    return library_name(array_api_compat.array_namespace(x))
