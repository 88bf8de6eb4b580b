"""Long decoding runs: a small ``MultiHeadAttention`` layer decodes 10,000 steps with a
``KVCache`` and with a ``PagedKVCache``, each row reset (its pages freed) on a fixed
schedule, memory measured at intervals, and the last segment compared bit for bit with a
fresh cache replaying it.

Memory is the process's resident set (``/proc/self/statm``) and ``tracemalloc``'s current
and peak traced bytes (NumPy's array data included), each sampled after ``gc.collect()``:
a full collection also empties the interpreter's free lists of tuples, floats and dicts,
whose blocks tracemalloc counts as live (without it the current figure climbs by ~0.5
MiB over the first 1,000 steps and then stays, the free lists' bound). The outputs are folded into a
running SHA-256 (constant memory) and the last one kept, so recording them does not grow
memory either.

    python bench/long_decode.py [--steps 10000] [--every 1000] [--no-tracemalloc]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from arrayattn.nn import KVCache, MultiHeadAttention, PagedKVCache

WIDTH, HEADS, CAPACITY, PAGE = 64, 4, 256, 16
#: Row ``b`` is reset (its pages freed) before every step ``t`` with ``t % periods[b] == 0``:
#: rows hold different lengths, and the paged pool (exactly large enough) is reused in a
#: scattered order. The rows' lengths repeat every ``lcm(periods)`` steps (1,000 here):
#: the library's bounded caches of per-shape masks fill during the first such cycle.
PERIODS = (250, 200)
B = len(PERIODS)
KINDS = ("contiguous", "paged")


def num_pages(periods: tuple[int, ...]) -> int:
    """Pages the schedule ``periods`` needs at most: each row's longest run."""
    return sum(math.ceil(p / PAGE) for p in periods)


def layer() -> tuple[MultiHeadAttention, dict[str, Any]]:
    """The layer (width 64, 4 heads, RoPE, causal) and its float32 parameters."""
    mha = MultiHeadAttention(WIDTH, HEADS, rope="half", causal=True)
    return mha, mha.init(seed=0, xp=np, dtype=np.float32)


def token(step: int) -> np.ndarray:
    """The input of decode step ``step``, ``(B, 1, WIDTH)`` float32, the same in every run."""
    return np.random.default_rng([7, step]).standard_normal((B, 1, WIDTH), dtype=np.float32)


def new_cache(
    mha: MultiHeadAttention, kind: str, periods: tuple[int, ...] = PERIODS
) -> KVCache | PagedKVCache:
    """An empty cache of ``kind`` (``"contiguous"`` or ``"paged"``) for ``mha``."""
    if kind == "contiguous":
        return mha.new_cache(B, CAPACITY, xp=np, dtype=np.float32)
    return mha.new_paged_cache(B, num_pages(periods), PAGE, xp=np, dtype=np.float32)


def rss_mib() -> float:
    """The process's resident set size in MiB (``nan`` without ``/proc``)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return math.nan
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class Run:
    """What a run measured: ``samples`` rows ``(step, rss MiB, traced KiB, peak KiB)``,
    the SHA-256 of the outputs from ``record_from`` on, the last output and the time."""

    samples: list[tuple[int, float, float, float]] = field(default_factory=list)
    digest: str = ""
    last: np.ndarray | None = None
    recorded: int = 0
    seconds: float = 0.0


def decode(
    kind: str,
    start: int,
    stop: int,
    *,
    record_from: int,
    every: int = 0,
    trace: bool = True,
    periods: tuple[int, ...] = PERIODS,
) -> Run:
    """Decode steps ``[start, stop)`` with a fresh cache of ``kind`` under the reset
    schedule; sample memory every ``every`` steps (and at ``stop``) and record the outputs
    of steps ``>= record_from``."""
    assert len(periods) == B and max(periods) <= CAPACITY, periods
    mha, params = layer()
    cache = new_cache(mha, kind, periods)
    run, sha = Run(), hashlib.sha256()
    started = tracemalloc.is_tracing()
    if trace and not started:
        tracemalloc.start()

    def sample(step: int) -> None:
        gc.collect()
        cur, peak = tracemalloc.get_traced_memory() if tracemalloc.is_tracing() else (0, 0)
        run.samples.append((step, rss_mib(), cur / 2**10, peak / 2**10))

    t0 = time.perf_counter()
    for t in range(start, stop):
        if every and (t - start) % every == 0:
            sample(t)
        for b, period in enumerate(periods):
            if t % period == 0:
                cache.reset(b)
        y = mha(params, token(t), cache=cache)
        if t >= record_from:
            sha.update(y.tobytes())
            run.last, run.recorded = y, run.recorded + 1
    run.seconds = time.perf_counter() - t0
    sample(stop)
    if trace and not started:
        tracemalloc.stop()
    run.digest = sha.hexdigest()
    return run


def last_segment(steps: int, periods: tuple[int, ...] = PERIODS) -> tuple[int, int]:
    """``(start, compare_from)``: a fresh run from ``start`` (the earliest of the rows'
    last resets) reaches the long run's state at ``compare_from`` (the latest of them)."""
    resets = [((steps - 1) // p) * p for p in periods]
    return min(resets), max(resets)


def long_and_fresh(
    kind: str, steps: int, every: int, trace: bool = True, periods: tuple[int, ...] = PERIODS
) -> tuple[Run, Run]:
    """The long run of ``steps`` steps and the fresh replay of its last segment."""
    start, compare_from = last_segment(steps, periods)
    long = decode(
        kind, 0, steps, record_from=compare_from, every=every, trace=trace, periods=periods
    )
    fresh = decode(kind, start, steps, record_from=compare_from, trace=False, periods=periods)
    return long, fresh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--no-tracemalloc", action="store_true")
    args = ap.parse_args(argv)
    ok = True
    print(
        f"MultiHeadAttention(width {WIDTH}, {HEADS} heads, rope, causal), batch {B}, "
        f"float32; KVCache capacity {CAPACITY}; PagedKVCache {num_pages(PERIODS)} pages of "
        f"{PAGE}; "
        f"row b reset every {PERIODS} steps; {args.steps} steps"
    )
    for kind in KINDS:
        long, fresh = long_and_fresh(kind, args.steps, args.every, not args.no_tracemalloc)
        print(f"\n{kind}: {args.steps} steps in {long.seconds:.1f} s")
        print("| step | RSS MiB | tracemalloc current KiB | tracemalloc peak KiB |")
        print("|---:|---:|---:|---:|")
        for step, rss, cur, peak in long.samples:
            print(f"| {step} | {rss:.1f} | {cur:.1f} | {peak:.1f} |")
        # Growth after the first cycle of lengths (the bounded caches' warm-up).
        cycle = math.lcm(*PERIODS)
        first = next((s for s in long.samples if s[0] >= cycle), long.samples[0])
        end = long.samples[-1]
        print(
            f"growth from step {first[0]} to {end[0]}: RSS {end[1] - first[1]:+.2f} MiB, "
            f"tracemalloc current {end[2] - first[2]:+.1f} KiB; over the whole run: RSS "
            f"{end[1] - long.samples[0][1]:+.2f} MiB, tracemalloc {end[2]:.1f} KiB"
        )
        same = (
            long.digest == fresh.digest
            and long.recorded == fresh.recorded
            and long.last is not None
            and fresh.last is not None
            and np.array_equal(long.last, fresh.last)
        )
        ok &= same
        print(
            f"last segment ({long.recorded} steps from {last_segment(args.steps)[1]}): "
            f"fresh replay {'bit-identical' if same else 'DIFFERS'} (sha256 "
            f"{long.digest[:16]} vs {fresh.digest[:16]})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
