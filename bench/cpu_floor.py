#!/usr/bin/env python
"""The floor of tiled NumPy attention on this CPU, against PyTorch's SDPA on one thread.

Any attention written with NumPy calls pays, per score element, at least the BLAS
products of its tile and one ``np.exp``: the forward multiplies ``Q K^T`` and ``P V``
and exponentiates once; the FlashAttention-2 backward recomputes ``Q K^T`` and ``exp``,
and multiplies ``dO V^T``, ``P^T dO``, ``dS^T Q`` and ``dS K`` with two elementwise
passes for ``dS = P * (dP - delta)``. This script times exactly those calls, single
threaded, on the fast path's own tile shapes (``arrayattn.attention.fast.layout``), adds them
up over the scores a shape visits (half for causal) and compares that floor, the fast
path itself and PyTorch's SDPA, all on one thread in the same run. A floor above 1.0x
means no NumPy tiling can match PyTorch on this machine, whatever its Python overhead
or threading; the per-score breakdown shows which call is responsible.

Usage::

    python bench/cpu_floor.py                      # the CPU issue's three target shapes
    python bench/cpu_floor.py --shapes "1,4,1024,64" --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import arrayattn  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from arrayattn.attention.fast import layout as _numpy_fast
from arrayattn.bench import (
    DEFAULT_SHAPES,
    Shape,
    _arrayattn_peer,
    _inputs,
    _torch_peer,
    parse_shapes,
)


def _median_seconds(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def building_blocks(shape: Shape, repeats: int) -> dict[str, float]:
    """Nanoseconds per score element of each call a tiled forward/backward must make,
    on the fast path's tile shapes, one thread."""
    rows = min(_numpy_fast.FWD_ROWS, shape.L)
    width = max(1, min(shape.L, _numpy_fast.BLOCK_ELEMENTS // rows))
    b_rows = min(_numpy_fast.BWD_ROWS, shape.L)
    b_keys = min(_numpy_fast.BWD_KEYS, shape.L)
    D = shape.D
    rng = np.random.default_rng(0)
    f32 = np.float32
    q = rng.standard_normal((rows, D), dtype=f32) * f32(D**-0.5)
    k = rng.standard_normal((width, D), dtype=f32)
    v = rng.standard_normal((width, D), dtype=f32)
    s = np.empty((rows, width), f32)
    np.matmul(q, k.T, out=s)
    p = np.exp(s)
    o = np.empty((rows, D), f32)
    ns: dict[str, float] = {}

    def per_score(fn: Callable[[], Any], n: int) -> float:
        return _median_seconds(fn, repeats, inner=5) / n * 1e9

    n_fwd = rows * width
    ns["QK^T"] = per_score(lambda: np.matmul(q, k.T, out=s), n_fwd)
    ns["exp"] = per_score(lambda: np.exp(s, out=p), n_fwd)
    ns["PV"] = per_score(lambda: np.matmul(p, v, out=o), n_fwd)

    # Backward block (rows x keys): five products and the two passes of dS.
    qb, dob = q[:b_rows], rng.standard_normal((b_rows, D), dtype=f32)
    kb, vb = k[:b_keys], v[:b_keys]
    pb = p[:b_rows, :b_keys].copy()
    dp = np.empty((b_rows, b_keys), f32)
    delta = rng.standard_normal((b_rows, 1), dtype=f32)
    t_rows, t_keys = np.empty((b_rows, D), f32), np.empty((b_keys, D), f32)
    n_bwd = b_rows * b_keys

    dp_in = rng.standard_normal((b_rows, b_keys), dtype=f32)

    def ds_passes() -> None:
        np.subtract(dp_in, delta, out=dp)
        np.multiply(dp, pb, out=dp)

    ns["bwd QK^T"] = per_score(lambda: np.matmul(qb, kb.T, out=dp), n_bwd)
    sb = s[:b_rows, :b_keys].copy()  # realistic scores: exp of them stays in range
    ns["bwd exp"] = per_score(lambda: np.exp(sb, out=dp), n_bwd)
    ns["dO V^T"] = per_score(lambda: np.matmul(dob, vb.T, out=dp), n_bwd)
    ns["dS passes"] = per_score(ds_passes, n_bwd)
    ns["P^T dO"] = per_score(lambda: np.matmul(pb.T, dob, out=t_keys), n_bwd)
    ns["dS^T Q"] = per_score(lambda: np.matmul(dp.T, qb, out=t_keys), n_bwd)
    ns["dS K"] = per_score(lambda: np.matmul(dp, kb, out=t_rows), n_bwd)
    return ns


def visited_scores(shape: Shape) -> float:
    """Score elements a shape computes: all of ``L x L``, or the causal triangle."""
    full = shape.B * shape.H * shape.L * shape.L
    return full * (shape.L + 1) / (2 * shape.L) if shape.causal else full


def measure(shape: Shape, repeats: int) -> dict[str, Any]:
    ns = building_blocks(shape, repeats)
    fwd_ns = ns["QK^T"] + ns["exp"] + ns["PV"]
    bwd_keys = ("bwd QK^T", "bwd exp", "dO V^T", "dS passes", "P^T dO", "dS^T Q", "dS K")
    bwd_ns = sum(ns[key] for key in bwd_keys)
    n = visited_scores(shape)

    # The same inputs and callables as the main benchmark's fast-path and torch peers.
    data = _inputs(shape, np.float32, seed=1)
    torch_fwd, torch_fb = _torch_peer().setup(shape, data)
    fast_fwd, fast_fb = _arrayattn_peer("fast").setup(shape, data)

    times = {}
    for name, fn in (
        ("torch fwd", torch_fwd),
        ("fast fwd", fast_fwd),
        ("torch fb", torch_fb),
        ("fast fb", fast_fb),
    ):
        times[name] = _median_seconds(fn, repeats)
    return {
        "ns": ns,
        "floor fwd": fwd_ns * n * 1e-9,
        "floor fb": (fwd_ns + bwd_ns) * n * 1e-9,
        **times,
    }


def format_shape(shape: Shape, r: dict[str, Any]) -> str:
    tf, tfb = r["torch fwd"], r["torch fb"]
    n = visited_scores(shape)
    lines = [
        f"#### {shape.label} (float32, one thread)",
        "",
        "| | fwd ms | fwd / torch | fwd+bwd ms | fwd+bwd / torch |",
        "|---|---:|---:|---:|---:|",
        f"| NumPy floor (BLAS + exp only) | {r['floor fwd'] * 1e3:.1f} | "
        f"{r['floor fwd'] / tf:.2f} | {r['floor fb'] * 1e3:.1f} | {r['floor fb'] / tfb:.2f} |",
        f"| arrayattn fast path | {r['fast fwd'] * 1e3:.1f} | {r['fast fwd'] / tf:.2f} | "
        f"{r['fast fb'] * 1e3:.1f} | {r['fast fb'] / tfb:.2f} |",
        f"| torch sdpa | {tf * 1e3:.1f} | 1.00 | {tfb * 1e3:.1f} | 1.00 |",
        "",
        "ns per score element: "
        + ", ".join(f"{key} {val:.2f}" for key, val in r["ns"].items())
        + f"; torch all-in: fwd {tf / n * 1e9:.2f}, fwd+bwd {tfb / n * 1e9:.2f}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, help='e.g. "1,16,2048,64;1,8,4096,64,c"')
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("cpu_floor.py compares against PyTorch: pip install 'torch==2.13.0'")
        return 2
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("cpu_floor.py pins BLAS to one thread with threadpoolctl: pip install threadpoolctl")
        return 2

    os.environ["ARRAYATTN_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    with threadpool_limits(1):
        for shape in args.shapes or DEFAULT_SHAPES:
            print(format_shape(shape, measure(shape, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
