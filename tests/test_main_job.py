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


def test_command_line(capsys) -> None:
    """``--help`` prints the options and does not run the job; ``--quick`` skips the timing
    table; ``--backends`` checks only those, and an unknown one is a usage error."""
    import pytest

    with pytest.raises(SystemExit) as done:
        _selfcheck.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--backends" in out and "backends found" not in out
    assert _selfcheck.main(["--quick", "--backends", "numpy"]) == 0
    out = capsys.readouterr().out
    assert "timing on NumPy" not in out
    checked = {line.split()[0] for line in out.splitlines() if line.startswith("numpy ")}
    assert checked == {"numpy"} and "\ntorch " not in out
    assert _selfcheck.main(["--quick", "--backends", "numpy,nosuchlib"]) == 2
    assert "nosuchlib" in capsys.readouterr().err


def test_timing_table_shows_the_spread() -> None:
    lines = _selfcheck._timing_table(np.random.default_rng(0), shape=(1, 2, 16, 8), repeats=3)
    assert "median (min-max)" in lines[0]
    row = lines[2]
    assert row.count("(") >= 2 and "-" in row  # fwd and fwd+bwd: median (min-max)


def test_dask_is_listed_and_checked() -> None:
    import pytest

    pytest.importorskip("dask")
    dask_backend = next(b for b in _selfcheck.available_backends() if b.name == "dask")
    rows = _selfcheck._check_backend(dask_backend, np.random.default_rng(0))
    failed = [(name, dt, err) for name, dt, err, ok in rows if not ok]
    assert rows and not failed, failed


def test_progress_lines_are_plain_when_not_a_terminal(capsys) -> None:
    progress = _selfcheck._Progress()  # pytest's captured stderr is not a terminal
    progress.step("checking numpy ...")
    progress.step("timing ...")
    progress.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines() == ["checking numpy ...", "timing ..."]


def test_public_namespace_helpers() -> None:
    """``arrayattn.array_namespace`` (arrays or a library module) and ``arrayattn.device``:
    what examples need instead of the private backend layer."""
    import array_api_compat
    import pytest

    import arrayattn as aa

    xp = aa.array_namespace(np)
    assert aa.array_namespace(None) is xp
    assert aa.array_namespace(np.ones(2), np.zeros(3)) is xp
    assert array_api_compat.is_numpy_namespace(xp) and aa.device(np.ones(2)) == "cpu"
    torch = pytest.importorskip("torch")
    assert array_api_compat.is_torch_namespace(aa.array_namespace(torch))
    with pytest.raises(TypeError, match="one library"):
        aa.array_namespace(np.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="nothing"):
        aa.array_namespace()
