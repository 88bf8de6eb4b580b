"""The ``arrayattn`` pytest plugin (registered under the ``pytest11`` entry point).

Gives every test suite that has arrayattn installed:

- an ``xp`` fixture: the array-API namespace of each selected backend in turn (tests run
  once per backend, with the backend name as the test id; missing libraries skip);
- ``arrayattn_backend``: the :class:`~arrayattn.testing.Backend` behind it (``.xp``,
  ``.device``, ``.asarray(numpy_array)``, ``.to_numpy(array)``);
- ``--backends=numpy,torch`` (default: ``$ARRAYATTN_BACKENDS``, else all);
- ``@pytest.mark.skip_xp_backends("dask", reason=...)`` to skip some backends (SciPy's
  marker name).

A ``conftest.py`` that defines its own ``xp`` fixture overrides the plugin's, as pytest
does for any plugin fixture; ``-p no:arrayattn`` switches the plugin off.
"""

from __future__ import annotations

import pytest

from ._fixtures import (
    add_backends_option,
    arrayattn_backend,
    backend_names,
    parametrize_backends,
    register_markers,
    xp,
)

__all__ = ["arrayattn_backend", "xp"]


def pytest_addoption(parser: pytest.Parser) -> None:
    add_backends_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    register_markers(config)
    backend_names(config)  # a bad --backends is a usage error before collection


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_backends(metafunc)


def pytest_report_header(config: pytest.Config) -> str:
    return f"arrayattn backends: {', '.join(backend_names(config))}"
