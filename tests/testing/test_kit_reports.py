"""What the report says: rows without a usable example ("no examples kept") apart from
features a peer lacks ("not supported"); functions that write into their inputs fail,
naming the argument; the command line without hypothesis says what to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.testing import check_attention

ROOT = Path(__file__).resolve().parents[2]

# -- "no examples kept" versus "not supported" --------------------------------------------


def test_jax_rows_left_out_are_no_examples_kept_not_unsupported(capsys):
    pytest.importorskip("jax")
    from arrayattn.testing.__main__ import main

    argv = ["--peer", "jax", "--examples", "5", "--features", "empty_rows,lengths,softcap"]
    assert main([*argv, "--json"]) == 0
    rows = {r["feature"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["empty_rows"]["status"] == "convention"
    # Every drawn lengths call has a fully masked row, left out under JAX's convention.
    assert rows["lengths"]["status"] == "no examples kept", rows["lengths"]
    assert rows["lengths"]["left_out"] == 5
    assert rows["softcap"]["status"] == "not supported"
    main(argv)
    table = capsys.readouterr().out
    assert "lengths     no examples kept  none of 5 drawn calls could be used" in table
    assert "softcap     not supported" in table


# -- inputs are never modified -------------------------------------------------------------


def writes_into(argument: str):
    """arrayattn's attention that then writes into one of its arguments."""

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        is_causal=False,
        scale=None,
        q_lengths=None,
        kv_lengths=None,
    ):
        out = aa.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask,
            is_causal=is_causal,
            scale=scale,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
        )
        target = {"query": query, "value": value, "attn_mask": attn_mask}.get(argument)
        target = kv_lengths if argument == "kv_lengths" else target
        if target is not None and target.dtype == np.bool_:
            np.logical_not(target, out=target)
        elif target is not None:
            target += 1
        return out

    return sdpa


@pytest.mark.parametrize(
    ("argument", "feature"),
    [("query", "basic"), ("value", "basic"), ("attn_mask", "bool_mask"), ("kv_lengths", "lengths")],
)
def test_function_writing_into_an_input_fails_naming_it(argument, feature):
    report = check_attention(writes_into(argument), examples=5, features=["basic", feature])
    row = report.row(feature)
    assert row.status == "failed" and not report.ok, report.table()
    assert f"inputs: the function wrote into its {argument} argument" in row.detail
    assert row.example is not None
    if feature != "basic":  # basic calls have no mask or lengths to write into
        assert report.status("basic") == "passed", report.table()


def test_torch_function_writing_through_a_transposed_query_fails():
    torch = pytest.importorskip("torch")

    def blhd_sdpa(query, key, value, scale=None):
        out = aa.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (query, key, value)), scale=scale
        )
        query.mul_(2)  # in place, through the adapter's transposed view
        return out.transpose(1, 2)

    report = check_attention(blhd_sdpa, layout="BLHD", xp=torch, examples=3, features=["basic"])
    assert report.status("basic") == "failed", report.table()
    assert "wrote into its query argument" in report.row("basic").detail


# -- the command line without hypothesis ------------------------------------------------------

HIDE_HYPOTHESIS = """
import runpy, sys

class HideHypothesis:
    # As if hypothesis were not installed (it is, in the test environment).
    def find_spec(self, name, path=None, target=None):
        if name == "hypothesis" or name.startswith("hypothesis."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideHypothesis())
sys.argv = ["python -m arrayattn.testing", "--peer", "torch"]
runpy.run_module("arrayattn.testing", run_name="__main__", alter_sys=True)
"""


def test_cli_without_hypothesis_says_what_to_install():
    res = subprocess.run(
        [sys.executable, "-c", HIDE_HYPOTHESIS], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "need hypothesis, which is not installed here" in res.stderr
    assert "pip install -e '.[kit]'" in res.stderr and "arrayattn[kit]" in res.stderr


def test_kit_extra_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {req.split(">")[0].split("=")[0].strip() for req in extras["kit"]}
    assert {"hypothesis", "pytest"} <= names
