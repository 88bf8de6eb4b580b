#!/usr/bin/env python
"""A CPU training step (forward + backward) of attention on torch tensors:
``arrayattn.torch.scaled_dot_product_attention`` (PyTorch's autograd calling arrayattn's
backward) against ``torch.nn.functional.scaled_dot_product_attention``, in one
interleaved run.

Rows, per case (full and causal), float32, median and min-max milliseconds of
``out = attention(q, k, v); out.backward(d_out)`` with q, k, v requiring grad:

- ``torch sdpa``: PyTorch's SDPA and its autograd (the baseline of every ratio);
- ``torch sdpa, flush_denormal``: the same under ``torch.set_flush_denormal(True)``
  (subnormals flushed to zero, as arrayattn's fast path does on its threads: the fair
  peer when ``--logit-scale`` puts exponentials in the subnormal range);
- ``arrayattn.torch``: the same call through arrayattn's autograd Function;
- ``arrayattn.torch, (B,L,H,D) views``: inputs that are ``x.transpose(1, 2)`` views of a
  ``(B, L, H, D)`` layout (what a projection gives), not copied by the bridge;
- ``arrayattn vjp, NumPy``: ``arrayattn.vjp`` on NumPy arrays of the same data, the
  same fast path without PyTorch: the difference to ``arrayattn.torch`` is what the
  bridge costs.

Each round times every row once, in a rotating order, so machine noise spreads over all
of them; ratios are of medians from the same run. ``OMP_WAIT_POLICY=PASSIVE`` is set
before PyTorch is imported (its idle OpenMP threads must not spin against the fast
path's workers).

Usage::

    python bench/torch_bridge.py                 # B1 H16 L2048 D64, 7 rounds
    python bench/torch_bridge.py --quick         # a small smoke run
    python bench/torch_bridge.py --shape 1,8,4096,64 --repeats 5 --threads 2
    python bench/torch_bridge.py --logit-scale 4   # scores with std ~16 (subnormal exp)
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
import torch

import arrayattn as aa
import arrayattn.torch as aat

BASELINE = "torch sdpa"


def _steps(
    shape: tuple[int, int, int, int], causal: bool, logit_scale: float = 1.0
) -> dict[str, Callable[[], None]]:
    """One training step per row, on the same data."""
    B, H, L, D = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(B, H, L, D, generator=gen) for _ in range(4))
    q, k = q * logit_scale, k * logit_scale  # scores' standard deviation: logit_scale**2
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    views = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    arrays = [x.numpy() for x in (q, k, v)]
    d_out_np = d_out.numpy()

    def torch_step(
        attention: Callable[..., torch.Tensor], inputs: list[torch.Tensor]
    ) -> Callable[[], None]:
        def step() -> None:
            for x in inputs:
                x.grad = None
            attention(*inputs, is_causal=causal).backward(d_out)

        return step

    def flushed(step: Callable[[], None]) -> Callable[[], None]:
        """``step`` with PyTorch's ``set_flush_denormal(True)`` (what arrayattn's fast path
        does on its own threads), restored after."""

        def run() -> None:
            torch.set_flush_denormal(True)
            try:
                step()
            finally:
                torch.set_flush_denormal(False)

        return run

    def numpy_step() -> None:
        _, pullback = aa.vjp(aa.scaled_dot_product_attention, *arrays, is_causal=causal)
        pullback(d_out_np)

    return {
        BASELINE: torch_step(torch.nn.functional.scaled_dot_product_attention, leaves),
        "torch sdpa, flush_denormal": flushed(
            torch_step(torch.nn.functional.scaled_dot_product_attention, leaves)
        ),
        "arrayattn.torch": torch_step(aat.scaled_dot_product_attention, leaves),
        "arrayattn.torch, (B,L,H,D) views": torch_step(aat.scaled_dot_product_attention, views),
        "arrayattn vjp, NumPy": numpy_step,
    }


def measure(
    shape: tuple[int, int, int, int], causal: bool, repeats: int, logit_scale: float = 1.0
) -> dict[str, list[float]]:
    """Seconds per step of every row, ``repeats`` interleaved rounds after a warm-up."""
    steps = _steps(shape, causal, logit_scale)
    names = list(steps)
    for name in names:
        steps[name]()  # warm-up: thread pools, allocator, first-call imports
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def table(
    shape: tuple[int, int, int, int],
    results: dict[bool, dict[str, list[float]]],
    logit_scale: float = 1.0,
) -> str:
    B, H, L, D = shape
    lines = [
        f"B={B} H={H} L={L} D={D} float32, q and k times {logit_scale:g}, forward + backward, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads",
        "",
        "| case | peer | median ms | min-max ms | ratio to torch sdpa |",
        "|---|---|---:|---:|---:|",
    ]
    for causal, times in results.items():
        base = statistics.median(times[BASELINE])
        for name, ts in times.items():
            med = statistics.median(ts)
            lines.append(
                f"| {'causal' if causal else 'full'} | {name} | {med * 1e3:.1f} | "
                f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | {med / base:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,16,2048,64", help="B,H,L,D (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--logit-scale",
        type=float,
        default=1.0,
        help="q and k times this (scores' std = its square; 4 gives ~16, as trained models "
        "without QK-norm; rows then spread past exp's float32 normal range)",
    )
    parser.add_argument("--quick", action="store_true", help="B1 H2 L128 D32, 2 rounds")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in ("1,2,128,32" if args.quick else args.shape).split(",")]
    if len(sizes) != 4:
        parser.error(f"--shape must be B,H,L,D, got {args.shape!r}")
    shape = (sizes[0], sizes[1], sizes[2], sizes[3])
    repeats = 2 if args.quick else args.repeats
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    scale = args.logit_scale
    results = {causal: measure(shape, causal, repeats, scale) for causal in (False, True)}
    print(table(shape, results, scale))
    print(f"\nnumpy {np.__version__}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
