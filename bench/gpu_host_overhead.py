#!/usr/bin/env python
"""Where the host time of one small fused call goes, on a GPU machine with CuPy.

A decode step (B = 1, 32 query heads over 8 KV heads, D = 128, float16, S = 4096) moves
16.8 MB, about 5 us at HBM speed, so the Python and launch cost of the call is its
speed. This prints the host microseconds per call of the pieces, each timed alone over
back-to-back calls with the device synchronised only at the end:

* the whole call (``implementation="fused"``), decode-shaped and a tiny prefill;
* ``make_spec`` alone, the implementation's ``declines`` alone;
* CuPy's floor: an empty ``RawKernel`` launch with as many arguments as the decode split
  kernel, and ``cupy.empty``;
* PyTorch's SDPA on the same decode tensors, for scale;

then a ``cProfile`` of the decode call sorted by own time (top 25).

Usage::

    python bench/gpu_host_overhead.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_call_us(fn: Callable[[], object], reps: int = 300) -> float:
    import cupy as cp

    for _ in range(20):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


def main() -> None:
    import cupy as cp
    import numpy as np

    import arrayattn as aa
    from arrayattn.attention.registry import select
    from arrayattn.attention.spec import make_spec

    rs = cp.random.RandomState(0)
    q = rs.standard_normal((1, 32, 1, 128), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((1, 8, 4096, 128), dtype=cp.float32).astype(cp.float16)
    v = rs.standard_normal((1, 8, 4096, 128), dtype=cp.float32).astype(cp.float16)
    t = rs.standard_normal((1, 1, 16, 64), dtype=cp.float32).astype(cp.float16)

    def decode() -> object:
        return aa.scaled_dot_product_attention(q, k, v, enable_gqa=True, implementation="fused")

    def tiny() -> object:
        return aa.scaled_dot_product_attention(t, t, t, implementation="fused")

    def spec() -> object:
        return make_spec(q, k, v, None, 0.0, False, None, True, "top_left", None, None, None)

    s = spec()

    def declines() -> object:
        return select(s, "fused")

    noop = cp.RawKernel(
        'extern "C" __global__ void noop(' + ", ".join(f"long long a{i}" for i in range(30))
        + ") {}",
        "noop",
    )
    args = tuple(np.int64(i) for i in range(30))

    def launch() -> object:
        return noop((1,), (32,), args)

    def empties() -> object:
        return [cp.empty((4096,), dtype=cp.float32) for _ in range(4)]

    rows = [
        ("decode call (fused, S=4096)", per_call_us(decode)),
        ("tiny prefill call (fused, 1x1x16x64)", per_call_us(tiny)),
        ("make_spec", per_call_us(spec)),
        ("select(spec, 'fused') (declines)", per_call_us(declines)),
        ("empty RawKernel launch, 30 int64 args", per_call_us(launch)),
        ("4 x cupy.empty", per_call_us(empties)),
    ]
    try:
        import torch

        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        F = torch.nn.functional
        rows.append(
            ("torch SDPA decode (enable_gqa)",
             per_call_us(lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)))
        )  # fmt: skip
    except Exception as exc:  # no CUDA torch: the peer row is optional
        print(f"torch: {exc!r}")
    print("| host cost | us per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        decode()
    cp.cuda.Device().synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue())


if __name__ == "__main__":
    main()
