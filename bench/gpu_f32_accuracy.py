#!/usr/bin/env python
"""float32 forward accuracy on a GPU against float64, per forward variant.

For head dims 64 and 128 and L = S in ``--lengths`` (B = 1, H = 4, causal and not), the
float32 output of each ``ARRAYATTN_FWD_VARIANT`` in ``--variants`` (v2: the CUDA-core
kernel ``aa_fwd_simt``; v3: ``aa_fwd_tf32``, three TF32 products per product) against the
float64 kernel's output on the same (float32-valued) inputs: relative Frobenius error of
the output and the largest LSE difference. PyTorch's float32 SDPA on the same inputs is
printed beside them when PyTorch has CUDA. Issue 28's bar: 1e-5.

Usage::

    python bench/gpu_f32_accuracy.py --out gpu-run/bench.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--variants", default="v2,v3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import cupy as cp

    import arrayattn as aa

    try:
        import torch

        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    variants = args.variants.split(",")
    head = "| D | L=S | causal | " + " | ".join(f"{v} out err | {v} LSE err" for v in variants)
    head += " | torch out err |" if has_torch else " |"
    lines = [
        "\n### float32 forward accuracy against the float64 kernel\n",
        head,
        "|" + "---|" * (3 + 2 * len(variants) + int(has_torch)),
    ]
    rng = cp.random.default_rng(0)
    for d in (64, 128):
        for n in (int(x) for x in args.lengths.split(",")):
            for causal in (False, True):
                q, k, v = (rng.standard_normal((1, 4, n, d), dtype=cp.float32) for _ in range(3))
                o64, l64 = aa.scaled_dot_product_attention(
                    *(x.astype(cp.float64) for x in (q, k, v)), is_causal=causal,
                    return_lse=True,
                )  # fmt: skip
                row = [str(d), str(n), "yes" if causal else "no"]
                for var in variants:
                    os.environ["ARRAYATTN_FWD_VARIANT"] = var
                    o, lse = aa.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             return_lse=True)  # fmt: skip
                    err = float(cp.linalg.norm(o.astype(cp.float64) - o64) / cp.linalg.norm(o64))
                    lerr = float(cp.max(cp.abs(lse.astype(cp.float64) - l64)))
                    row += [f"{err:.1e}", f"{lerr:.1e}"]
                os.environ.pop("ARRAYATTN_FWD_VARIANT", None)
                if has_torch:
                    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                    to = torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal
                    )
                    ot = cp.from_dlpack(to).astype(cp.float64)
                    row.append(f"{float(cp.linalg.norm(ot - o64) / cp.linalg.norm(o64)):.1e}")
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
