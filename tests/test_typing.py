"""arrayattn's annotations from a user's side: the PEP 561 marker (``py.typed``) is
installed with the package, and a small user script type-checks against the public API
with mypy (the checker CI runs on the package itself, ``[tool.mypy]`` in pyproject.toml).
"""

from __future__ import annotations

import importlib.resources
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What a user writes. Each reveal_type is matched, in order, with REVEALED below; the
# line marked "wrong" must be the script's only error (the checker sees the annotations:
# were arrayattn untyped, everything would be Any and nothing an error).
USER_SCRIPT = """\
import numpy as np

import arrayattn as aa
import arrayattn.testing

q = np.zeros((1, 2, 4, 8), dtype=np.float32)
out = aa.scaled_dot_product_attention(q, q, q, is_causal=True)
shape: tuple[int, ...] = out.shape
reveal_type(aa.scaled_dot_product_attention(q, q, q))
out, lse = aa.scaled_dot_product_attention(q, q, q, return_lse=True)
reveal_type(aa.scaled_dot_product_attention(q, q, q, return_lse=True))
both = aa.scaled_dot_product_attention(q, q, q, return_lse=True)
lse_shape = both[1].shape

y, pullback = aa.vjp(aa.scaled_dot_product_attention, q, q, q, is_causal=True)
dq, dk, dv = pullback(np.ones_like(y))

mha = aa.nn.MultiHeadAttention(embed_dim=8, num_heads=2, causal=True)
params = mha.init(seed=0, xp=np, dtype=np.float32)
x = np.ones((1, 4, 8), dtype=np.float32)
h = mha(params, x)
reveal_type(mha(params, x, need_weights=True))
h2, mha_pullback = mha.vjp(params, x)
grads = mha_pullback(np.ones_like(h2))
dparams: dict = grads.params

report = aa.testing.check_attention(aa.scaled_dot_product_attention, xp="numpy", examples=2)
passed: bool = report.ok

aa.scaled_dot_product_attention(q, q, q, is_causal="yes")  # wrong
"""

REVEALED = ["Any", "tuple[Any, Any]", "tuple[Any, Any]"]


def test_py_typed_marker_is_installed() -> None:
    # Without it, type checkers treat the installed package as untyped (PEP 561).
    marker = importlib.resources.files("arrayattn").joinpath("py.typed")
    assert marker.is_file()


@pytest.fixture(scope="module")
def mypy_on_user_script(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    pytest.importorskip("mypy", reason="mypy (the test extra) is not installed")
    script = tmp_path_factory.mktemp("typing") / "user_script.py"
    script.write_text(USER_SCRIPT)
    # From the repository root, with the package's config: its .mypy_cache (what
    # `mypy arrayattn` leaves) makes this take well under a second; cold, mypy first
    # analyses the package and what it imports (about 20-30 s). The editable install's
    # import hook is invisible to mypy, so the package is found as the source tree here;
    # the marker that a wheel install needs is checked above.
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # Only the script's own lines: the package's errors are CI's mypy step's business.
    lines = [line for line in proc.stdout.splitlines() if line.startswith(str(script))]
    return proc.stdout + proc.stderr, lines


def _line_of(marker: str) -> int:
    return next(n for n, text in enumerate(USER_SCRIPT.splitlines(), 1) if text.endswith(marker))


def test_user_script_type_checks(mypy_on_user_script: tuple[str, list[str]]) -> None:
    output, lines = mypy_on_user_script
    errors = [line for line in lines if ": error:" in line]
    wrong = _line_of("# wrong")
    assert [int(e.split(":")[1]) for e in errors] == [wrong], output


def test_return_lse_is_typed_as_a_pair(mypy_on_user_script: tuple[str, list[str]]) -> None:
    output, lines = mypy_on_user_script
    revealed = [
        m.group(1) for line in lines if (m := re.search(r'Revealed type is "(.*)"', line))
    ]
    assert revealed == REVEALED, output
