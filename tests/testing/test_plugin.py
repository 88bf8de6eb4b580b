"""The ``arrayattn`` pytest plugin: the ``xp`` fixture over ``--backends`` /
``ARRAYATTN_BACKENDS``, and its coexistence with arrayattn's own ``tests/conftest.py``
(plugin on, plugin off). Each case runs pytest in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "arrayattn" for ep in entry_points(group="pytest11"))


# Installed with its entry point (pip install -e '.[test]'), pytest loads the plugin
# itself (loading it again by module name would register it twice); otherwise load it by
# module name, as the entry point would.
PLUGIN = [] if _entry_point_installed() else ["-p", "arrayattn.testing.pytest_plugin"]

USER_TEST = """
import numpy as np
import pytest

def test_add(xp, arrayattn_backend):
    x = arrayattn_backend.asarray(np.arange(3.0))
    assert arrayattn_backend.to_numpy(xp.sum(x)) == 3.0

@pytest.mark.skip_xp_backends("array_api_strict", reason="not today")
def test_marked(xp):
    assert xp is not None
"""


def _pytest(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.pop("ARRAYATTN_BACKENDS", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
    )


def _count(res: subprocess.CompletedProcess, word: str) -> int:
    m = re.search(rf"(\d+) {word}", res.stdout)
    return int(m.group(1)) if m else 0


def test_xp_fixture_in_a_user_project(tmp_path):
    pytest.importorskip("array_api_strict")  # the run below selects it
    (tmp_path / "test_user.py").write_text(USER_TEST)
    res = _pytest(*PLUGIN, "--backends", "numpy,array_api_strict", "-vv", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "test_add[numpy]" in res.stdout and "test_add[array_api_strict]" in res.stdout
    assert _count(res, "passed") == 3 and _count(res, "skipped") == 1, res.stdout
    res = _pytest(*PLUGIN, "--strict-markers", cwd=tmp_path, env={"ARRAYATTN_BACKENDS": "numpy"})
    assert _count(res, "passed") == 2, res.stdout
    res = _pytest(*PLUGIN, "--backends", "nonesuch", cwd=tmp_path)
    assert res.returncode == 4 and "unknown backends ['nonesuch']" in res.stderr


@pytest.mark.parametrize("mode", ["plugin", "no-plugin"])
def test_project_conftest_with_and_without_plugin(mode):
    args = PLUGIN if mode == "plugin" else ["-p", "no:arrayattn"]
    target = "tests/ops/test_softmax.py"
    res = _pytest(*args, "--backends", "numpy,torch", "--co", target, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert ids
    assert any("numpy" in i for i in ids) and any("torch" in i for i in ids)
    assert not any("array_api_strict" in i for i in ids)
    # The same tests either way (and as the environment variable selects them).
    res_env = _pytest(*args, "--co", target, cwd=ROOT, env={"ARRAYATTN_BACKENDS": "numpy,torch"})
    assert [line for line in res_env.stdout.splitlines() if "::" in line] == ids
