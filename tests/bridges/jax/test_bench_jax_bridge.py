"""Smoke test of ``bench/jax_bridge.py`` on a tiny size: every peer runs, the table has
its rows and ratios, and the memory measurement (the subprocess child) gives numbers.
Timings are never asserted."""

from __future__ import annotations

import pytest
from _scripts import load_script

# "jax.numpy", not "jax": a bare "jax" folder on sys.path imports as a namespace package
pytest.importorskip("jax.numpy")


def test_quick_run_prints_every_peer_with_its_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench/jax_bridge.py")
    peers = "arrayattn,arrayattn-traced,xla"
    argv = ["--quick", "--length", "32", "--rounds", "1", "--no-memory", "--peers", peers]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "B=1 H=1 L=S=32 D=64 float32" in out
    for peer in peers.split(","):
        row = next(line for line in out.splitlines() if line.startswith(f"| {peer} |"))
        assert row.split("|")[4].strip().endswith("x"), row  # the time ratio to xla
    assert "| xla | " in out and "1.00x" in out


def test_the_memory_child_measures_rss_and_xla_temp_bytes() -> None:
    bench = load_script("bench/jax_bridge.py")
    got = bench.child("arrayattn", bench.Shape(length=32, head_dim=8))
    assert set(got) == {"rss_mib", "xla_temp_mib", "compile_s"}
    assert all(v >= 0 for v in got.values())
    line = bench.table(
        bench.Shape(length=32), {"arrayattn": [0.5, 0.7], "xla": [1.0, 1.2]},
        {"arrayattn": {"rss_mib": 10.0, "xla_temp_mib": 1.0, "compile_s": 0.1},
         "xla": {"rss_mib": 40.0, "xla_temp_mib": 30.0, "compile_s": 0.2}},
    ).splitlines()[4]  # fmt: skip
    assert line == "| arrayattn | 0.600 | 0.500-0.700 | 0.55x | 10 | 0.250x | 1 | 0.1 |"


def test_unknown_peers_are_refused() -> None:
    bench = load_script("bench/jax_bridge.py")
    with pytest.raises(SystemExit):
        bench.main(["--peers", "arrayattn,nope", "--no-memory"])
