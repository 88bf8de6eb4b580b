#!/usr/bin/env python
"""examples/wan_block.py (NumPy, hand-written backward) against the same Wan2.1 block in
PyTorch on the CPU (autograd), one thread each, interleaved in the same run.

The PyTorch block is the float64 transcription of Wan2.1's code that the example's test
checks against (``tests/examples/test_wan_block.py``), cast to float32 here. Both get the
same parameters and inputs; each repeat times the forward and forward + backward of one
side, then of the other, and the table gives medians and the ratio.

    python bench/wan_block_bench.py [--dim 256 --heads 2 --grid 2,8,8 --repeats 7]
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--grid", default="2,8,8")
    ap.add_argument("--text", type=int, default=32)
    ap.add_argument("--image", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    wan = _load("wan_block", ROOT / "examples" / "wan_block.py")
    oracle = _load("test_wan_block", ROOT / "tests" / "examples" / "test_wan_block.py")

    grid = tuple(int(g) for g in args.grid.split(","))
    block = wan.WanBlock(dim=args.dim, ffn_dim=4 * args.dim, num_heads=args.heads)
    params = block.init(seed=0, xp=np)
    x, t, ctx, img = wan.random_inputs(
        block, grid, batch=args.batch, text_len=args.text, image_len=args.image, xp=np
    )
    ref = oracle._torch_wan(torch, args.dim, 4 * args.dim, args.heads, block.freq_dim, args.text)
    ref.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in params.items()})
    ref = ref.float()
    ref.freqs = ref.freqs.to(torch.complex128)  # Wan2.1 keeps its RoPE table in float64
    tx, tctx, timg = (torch.from_numpy(a) for a in (x, ctx, img))
    tt = torch.from_numpy(t)
    cot = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    tcot = torch.from_numpy(cot)

    def ours_fwd():
        block(params, x, t, ctx, img, grid)

    def ours_fwd_bwd():
        out, pullback = block.vjp(params, x, t, ctx, img, grid)
        pullback(cot)

    def torch_fwd():
        with torch.no_grad():
            ref(tx, tt, torch.cat([timg, tctx], dim=1), [grid] * args.batch)

    def torch_fwd_bwd():
        a, c, i = (v.clone().requires_grad_() for v in (tx, tctx, timg))
        ref.zero_grad(set_to_none=True)
        out = ref(a, tt, torch.cat([i, c], dim=1), [grid] * args.batch)
        out.backward(tcot)

    # same numbers first (float32 on both sides)
    out = block(params, x, t, ctx, img, grid)
    with torch.no_grad():
        ref_out = ref(tx, tt, torch.cat([timg, tctx], dim=1), [grid] * args.batch).numpy()
    err = float(np.max(np.abs(out - ref_out)) / np.max(np.abs(ref_out)))

    cases = {"forward": (ours_fwd, torch_fwd), "forward+backward": (ours_fwd_bwd, torch_fwd_bwd)}
    times = {(c, side): [] for c in cases for side in ("arrayattn", "torch")}
    for fns in cases.values():  # warm-up
        for fn in fns:
            fn()
    for _ in range(args.repeats):
        for case, (ours, theirs) in cases.items():
            for side, fn in (("arrayattn", ours), ("torch", theirs)):
                t0 = time.perf_counter()
                fn()
                times[(case, side)].append(time.perf_counter() - t0)

    L = int(np.prod(grid))
    print(
        f"Wan2.1 block, float32, one thread: B={args.batch}, grid {grid} ({L} tokens), "
        f"dim={args.dim}, heads={args.heads} (head_dim {args.dim // args.heads}), "
        f"ffn {4 * args.dim}, text {args.text} + image {args.image} tokens; "
        f"max |out - torch| / max |torch| = {err:.1e}"
    )
    print(f"{'':18s} {'arrayattn ms':>13s} {'torch ms':>10s} {'ratio':>7s}")
    for case in cases:
        a = statistics.median(times[(case, "arrayattn")]) * 1e3
        b = statistics.median(times[(case, "torch")]) * 1e3
        print(f"{case:18s} {a:13.2f} {b:10.2f} {a / b:6.2f}x")


if __name__ == "__main__":
    main()
