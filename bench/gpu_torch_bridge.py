#!/usr/bin/env python
"""bfloat16 and float16 through ``arrayattn.torch`` on CUDA tensors against PyTorch's flash
backend, same run, same tensors.

CuPy has no bfloat16, so PyTorch CUDA tensors are the only way a user reaches the fused
kernels' bfloat16 variants: ``arrayattn.torch.scaled_dot_product_attention`` hands their
storage to the kernels through DLPack and runs their backward under ``torch.autograd``.
For each dtype, head dim D, L = S (batch x L = ``--tokens``, H = 2048 / D) and causal
mode this times the forward (under ``torch.no_grad``) and forward+backward
(``torch.autograd.grad``) of both, with CUDA events around back-to-back calls (warm-up
first, median of three groups, two input sets alternated), and compares both outputs with
a float64 reference on the same inputs: ``err`` is arrayattn's relative Frobenius error,
``torch err`` PyTorch's. TFLOP/s use FlashAttention's counting (forward ``4 B H L S D``,
halved when causal; backward 2.5x forward).

Usage::

    python bench/gpu_torch_bridge.py --out gpu-run/bench.md
    python bench/gpu_torch_bridge.py --device cpu --lengths 64 --tokens 64   # smoke, CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _median_ms(fn: Callable[[int], object], warmup: int, reps: int, device: str) -> float:
    import torch

    for i in range(warmup):
        fn(i)
    n = max(1, reps // 3)
    times = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for i in range(n):
                fn(i)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / n)
        else:
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            times.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(times)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def run(args: argparse.Namespace) -> list[str]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import arrayattn.torch as aat

    F = torch.nn.functional
    dev = args.device
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for D in (int(x) for x in args.head_dims.split(",")):
            for L in (int(x) for x in args.lengths.split(",")):
                for causal in (False, True):
                    B, H = max(1, args.tokens // L), max(1, 2048 // D)
                    g = torch.Generator(device=dev).manual_seed(L + D)
                    sets = [
                        [torch.randn(B, H, L, D, device=dev, generator=g).to(dtype)
                         for _ in range(3)]
                        for _ in range(2)
                    ]  # fmt: skip
                    cot = torch.randn(B, H, L, D, device=dev, generator=g).to(dtype)

                    def ours(q, k, v, causal=causal):
                        return aat.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def theirs(q, k, v, causal=causal):
                        if dev != "cuda":
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def fwd(fn, sets=sets):
                        def call(i):
                            with torch.no_grad():
                                return fn(*sets[i % 2])

                        return call

                    def fwd_bwd(fn, sets=sets, cot=cot):
                        leaves = [[x.detach().requires_grad_() for x in s] for s in sets]

                        def call(i):
                            q, k, v = leaves[i % 2]
                            return torch.autograd.grad(fn(q, k, v), (q, k, v), cot)

                        return call

                    q, k, v = sets[0]
                    with torch.no_grad():
                        ref = F.scaled_dot_product_attention(
                            q.double(), k.double(), v.double(), is_causal=causal
                        )
                        err = _rel(ours(q, k, v), ref)
                        terr = _rel(theirs(q, k, v), ref)
                    fl = 4.0 * B * H * L * L * D / (2 if causal else 1)
                    for name, flops, a, b in (
                        ("fwd", fl, fwd(ours), fwd(theirs)),
                        ("fwd+bwd", 3.5 * fl, fwd_bwd(ours), fwd_bwd(theirs)),
                    ):
                        ms = _median_ms(a, args.warmup, args.reps, dev)
                        tms = _median_ms(b, args.warmup, args.reps, dev)
                        rows.append(
                            f"| {dtype_name} | {D} | {L} | {B} | {H} | "
                            f"{'yes' if causal else 'no'} | {name} | {ms:.3f} | "
                            f"{flops / ms / 1e9:.1f} | {tms:.3f} | {flops / tms / 1e9:.1f} | "
                            f"{tms / ms:.2f} | "
                            + (f"{err:.1e} | {terr:.1e} |" if name == "fwd" else "- | - |")
                        )
                        print(rows[-1], flush=True)
                    del sets, cot
                    if dev == "cuda":
                        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--tokens", type=int, default=16384, help="batch x L")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="append the table to this file")
    args = p.parse_args()
    import torch

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    head = [
        f"\n{name}, arrayattn.torch (fused kernels through DLPack) vs torch SDPA "
        f"(flash backend), torch {torch.__version__}: {' '.join(sys.argv[1:])}\n",
        "| dtype | D | L=S | B | H | causal | pass | arrayattn ms | TFLOP/s | torch ms | "
        "torch TFLOP/s | speed vs torch | err vs f64 | torch err vs f64 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows = run(args)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(head + rows) + "\n")


if __name__ == "__main__":
    main()
