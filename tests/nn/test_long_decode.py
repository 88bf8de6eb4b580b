"""A long decoding run, shortened (issue 35): ``bench/long_decode.py`` runs 10,000 steps
and prints its table; here 600 steps of the same layer with each cache kind and shorter
reset periods. Traced memory stays flat after the first resets (a leak of one
output-sized array per step would add over 150 KiB), and the last segment equals, bit
for bit, a fresh cache replaying it (pages reused in a scattered order read the same)."""

from __future__ import annotations

import numpy as np
import pytest
from _scripts import load_script

STEPS, EVERY = 600, 100
#: Row resets every 100 and 50 steps: the rows' lengths repeat every 100 steps, so the
#: library's bounded per-shape caches are full after the first 100.
PERIODS = (100, 50)
#: Allowed growth of tracemalloc's current bytes (after gc.collect) between step 300 and
#: the end (~2-6 KiB measured: the library's bounded caches); one leaked (2, 1, 64)
#: float32 array per step would add ~180 KiB.
SLACK_KIB = 48


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/long_decode.py", "long_decode_bench")


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_long_run_keeps_memory_flat_and_equals_a_fresh_run(bench, kind):
    long, fresh = bench.long_and_fresh(kind, STEPS, EVERY, periods=PERIODS)
    start, compare_from = bench.last_segment(STEPS, PERIODS)
    assert (start, compare_from) == (500, 550)
    assert long.recorded == fresh.recorded == STEPS - compare_from
    assert long.digest == fresh.digest
    np.testing.assert_array_equal(long.last, fresh.last)
    by_step = {step: cur for step, _, cur, _ in long.samples}
    assert sorted(by_step) == list(range(0, STEPS + 1, EVERY))
    growth = by_step[STEPS] - by_step[300]
    assert growth < SLACK_KIB, long.samples


def test_the_script_prints_its_table(bench, capsys):
    assert bench.main(["--steps", "120", "--every", "60"]) == 0
    out = capsys.readouterr().out
    assert out.count("| step | RSS MiB | tracemalloc current KiB |") == 2
    assert out.count("bit-identical") == 2
