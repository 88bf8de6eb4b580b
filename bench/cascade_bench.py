"""Serving on the CPU (issue 33): a decode step over a shared prompt with the
``CascadeKVCache`` (the prefix held once, read once for the whole batch) against the
per-row ``KVCache`` holding a copy of the prefix in every row; and a ragged decode step
(rows of different cache lengths) against the same batch all at the mean length.

Every case runs in interleaved rounds (each round times every case once, so all see the
same machine load) and the table gives medians and the ratios from the same run. The
outputs of the cascade and copied-prefix steps are compared (max |difference|).

    python bench/cascade_bench.py              # the issue's target shapes
    python bench/cascade_bench.py --quick      # small shapes, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    import arrayattn as aa
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import arrayattn as aa
from arrayattn.nn import CascadeKVCache, KVCache


def _shared_prefix_cases(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], str]:
    rng = np.random.default_rng(0)
    B, Hq, Hk, D, P, T = args.batch, args.heads, args.kv_heads, 128, args.prefix, args.suffix
    f32 = np.float32
    pk, pv = (rng.standard_normal((1, Hk, P, D), dtype=f32) for _ in range(2))
    sk, sv = (rng.standard_normal((B, Hk, T, D), dtype=f32) for _ in range(2))
    q = rng.standard_normal((B, Hq, 1, D), dtype=f32)
    cascade = CascadeKVCache(batch_size=B, num_kv_heads=Hk, head_dim=D, prefix_length=P,
                             max_suffix_length=T + 1, xp=np, dtype=f32)  # fmt: skip
    cascade.fill_prefix(pk, pv)
    cascade.append(sk, sv)
    copied = KVCache.allocate(B, Hk, P + T + 1, D, xp=np, dtype=f32)
    copied.append(np.concatenate([np.repeat(pk, B, 0), sk], 2),
                  np.concatenate([np.repeat(pv, B, 0), sv], 2))  # fmt: skip

    def step_copied() -> np.ndarray:
        k, v = copied.filled()
        opts = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)
        return aa.scaled_dot_product_attention(q, k, v, **opts)  # type: ignore[arg-type]

    def step_cascade() -> np.ndarray:
        return np.asarray(cascade.attend(q, causal=True))

    diff = float(np.abs(step_copied() - step_cascade()).max())
    mem = (cascade.prefix.keys.nbytes * 2 + (cascade.suffix.keys.nbytes * 2)) / 2**20
    mem_c = (copied.keys.nbytes + copied.values.nbytes) / 2**20  # type: ignore[union-attr]
    note = (
        f"shared prefix: B={B} prefix {P} + suffix {T} tokens, GQA {Hq}/{Hk}, D=128 float32; "
        f"max |cascade - copied| {diff:.1e}; memory cascade {mem:.1f} MiB, copied {mem_c:.1f} MiB"
    )
    return {"copied-prefix decode": step_copied, "cascade decode": step_cascade}, note


def _ragged_cases(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], str]:
    rng = np.random.default_rng(1)
    B, Hq, Hk, D = 8, args.heads, args.kv_heads, 128
    lo, hi = args.ragged
    lengths = np.linspace(lo, hi, B).astype(np.int64)
    mean = int(round(float(lengths.mean())))
    f32 = np.float32
    k, v = (rng.standard_normal((B, Hk, hi, D), dtype=f32) for _ in range(2))
    q = rng.standard_normal((B, Hq, 1, D), dtype=f32)
    ku, vu = np.ascontiguousarray(k[:, :, :mean]), np.ascontiguousarray(v[:, :, :mean])
    opts = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)

    def ragged() -> np.ndarray:
        return aa.scaled_dot_product_attention(q, k, v, kv_lengths=lengths, **opts)  # type: ignore[arg-type]

    def uniform() -> np.ndarray:
        return aa.scaled_dot_product_attention(q, ku, vu, **opts)  # type: ignore[arg-type]

    note = f"ragged: B={B} lengths {lo}..{hi} (mean {mean}) against all rows at {mean}"
    return {"ragged decode": ragged, "uniform mean-length decode": uniform}, note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, 3 rounds")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", type=int, default=3, help="steps timed per round and case")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.kv_heads, args.prefix, args.suffix = 4, 8, 2, 512, 16
        args.ragged, args.rounds, args.inner = (20, 500), 3, 1
    else:
        args.batch, args.heads, args.kv_heads, args.prefix, args.suffix = 16, 32, 8, 4096, 64
        args.ragged = (100, 4000)
    groups = [_shared_prefix_cases(args), _ragged_cases(args)]
    times: dict[str, list[float]] = {name: [] for cases, _ in groups for name in cases}
    for cases, _ in groups:
        for f in cases.values():
            f()  # warm-up
    for _ in range(args.rounds):
        for cases, _ in groups:
            for name, f in cases.items():
                t0 = time.perf_counter()
                for _ in range(args.inner):
                    f()
                times[name].append((time.perf_counter() - t0) / args.inner)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{'case':<28} {'ms/step':>9}  (median of {args.rounds} interleaved rounds)")
    for cases, note in groups:
        print(f"# {note}")
        for name in cases:
            print(f"{name:<28} {1e3 * med[name]:9.2f}")
    speedup = med["copied-prefix decode"] / med["cascade decode"]
    ragged = med["ragged decode"] / med["uniform mean-length decode"]
    print(f"cascade speed-up over copied prefix: {speedup:.2f}x (target >= 4)")
    print(f"ragged / uniform mean-length time:   {ragged:.2f} (target <= 1.2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
