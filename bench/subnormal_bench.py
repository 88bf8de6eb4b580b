#!/usr/bin/env python
"""The NumPy fast path with and without subnormals flushed to zero
(``ARRAYATTN_FLUSH_DENORMALS``), against PyTorch's SDPA, as the scores grow.

q and k are multiplied by ``c`` (scores' standard deviation ``c**2`` at unit-normal
inputs): from ``c`` about 4 a row's scores spread past ``exp``'s float32 normal range and
x86 CPUs take a microcode assist per subnormal result (see
``arrayattn/attention/denormals.py``). Rows, per ``c``: the share of shifted scores whose
``exp`` is subnormal (first head), and the median forward and backward milliseconds of
arrayattn (flush on, flush off) and PyTorch (forward under ``no_grad``; backward of its
autograd), all interleaved round by round in one process.

Usage::

    python bench/subnormal_bench.py                       # B1 H16 L2048 D64, c = 1 2 4 6
    python bench/subnormal_bench.py --scales 1,4 --repeats 3 --shape 1,8,1024,64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its threads

try:
    import arrayattn  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import arrayattn as aa

FLOAT32_SUBNORMAL_BAND = (-103.3, -87.34)  # exp(x) subnormal (nonzero, below FLT_MIN)


def _arrayattn(q, k, v, d_out, flush: str) -> tuple[Callable[[], None], Callable[[], None]]:
    state: dict[str, object] = {}

    def forward() -> None:
        os.environ["ARRAYATTN_FLUSH_DENORMALS"] = flush
        state["out"], state["pullback"] = aa.vjp(aa.scaled_dot_product_attention, q, k, v)

    def backward() -> None:
        os.environ["ARRAYATTN_FLUSH_DENORMALS"] = flush
        state["pullback"](d_out)  # type: ignore[operator]

    return forward, backward


def _torch(q, k, v, d_out) -> tuple[Callable[[], None], Callable[[], None]] | None:
    try:
        import torch
    except ImportError:
        return None
    leaves = [torch.from_numpy(x).clone().requires_grad_() for x in (q, k, v)]
    g = torch.from_numpy(d_out)
    state: dict[str, object] = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward() -> None:
        for x in leaves:
            x.grad = None
        state["out"] = sdpa(*leaves)

    def backward() -> None:
        state["out"].backward(g)  # type: ignore[attr-defined]

    return forward, backward


def _restore(value: str | None) -> None:
    """Put ``ARRAYATTN_FLUSH_DENORMALS`` back as the caller had it."""
    if value is None:
        os.environ.pop("ARRAYATTN_FLUSH_DENORMALS", None)
    else:
        os.environ["ARRAYATTN_FLUSH_DENORMALS"] = value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,16,2048,64", help="B,H,L,D (default %(default)s)")
    ap.add_argument("--scales", default="1,2,4,6", help="factors c on q and k")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    args = ap.parse_args(argv)
    saved = os.environ.get("ARRAYATTN_FLUSH_DENORMALS")
    B, H, L, D = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    base = [rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(4)]
    print(f"B={B} H={H} L={L} D={D} float32, forward / backward median ms of "
          f"{args.repeats} interleaved rounds; numpy {np.__version__}\n")  # fmt: skip
    print("| c | score std | subnormal exp share | arrayattn (flush) fwd / bwd | "
          "arrayattn (no flush) fwd / bwd | torch sdpa fwd / bwd |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for c in (float(x) for x in args.scales.split(",")):
        q, k = base[0] * np.float32(c), base[1] * np.float32(c)
        v, d_out = base[2], base[3]
        s = q[0, 0].astype(np.float64) @ k[0, 0].T.astype(np.float64) / np.sqrt(D)
        z = s - s.max(-1, keepdims=True)
        share = float(((z > FLOAT32_SUBNORMAL_BAND[0]) & (z < FLOAT32_SUBNORMAL_BAND[1])).mean())
        peers = {
            "flush": _arrayattn(q, k, v, d_out, "1"),
            "no flush": _arrayattn(q, k, v, d_out, "0"),
        }
        torch_calls = _torch(q, k, v, d_out)
        if torch_calls is not None:
            peers["torch"] = torch_calls
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in peers}
        for f, b in peers.values():  # warm-up
            f()
            b()
        names = list(peers)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                f, b = peers[name]
                t0 = time.perf_counter()
                f()
                t1 = time.perf_counter()
                b()
                t2 = time.perf_counter()
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
        _restore(saved)

        def cell(name: str, times: dict[str, tuple[list[float], list[float]]] = times) -> str:
            if name not in times:
                return "-"
            fw, bw = (statistics.median(x) * 1e3 for x in times[name])
            return f"{fw:.0f} / {bw:.0f}"

        print(f"| {c:g} | {s.std():.1f} | {share:.1%} | {cell('flush')} | {cell('no flush')} | "
              f"{cell('torch')} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
