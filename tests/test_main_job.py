"""The main job (``python -m arrayattn``): its timing table runs every implementation that
takes NumPy arrays, and its checks pass on NumPy. A regression test: the table once named
every registered implementation, so registering the Dask path broke the main job."""

from __future__ import annotations

import numpy as np

from arrayattn import _selfcheck


def test_timing_table_runs_every_numpy_implementation() -> None:
    lines = _selfcheck._timing_table(np.random.default_rng(0), shape=(1, 2, 16, 8), repeats=1)
    names = {line.split()[0] for line in lines[2:]}
    assert {"auto", "composed", "chunked", "fast"} <= names
    assert "dask" not in names and "fused" not in names


def test_checks_pass_on_numpy() -> None:
    numpy_backend = next(b for b in _selfcheck.available_backends() if b.name == "numpy")
    rows = _selfcheck._check_backend(numpy_backend, np.random.default_rng(0))
    failed = [(name, dt, err) for name, dt, err, ok in rows if not ok]
    assert rows and not failed, failed
