"""Dask path with a block mask: a packed batch of 8 documents (causal within each) against
the same call without the block mask (causal over the whole sequence, and no mask), on
Dask's local threaded scheduler.

Printed per variant: the tasks of the forward graph (all of them, and the per-pair block
tasks), the same for forward+backward, and the wall time of computing each (minimum of
``--repeats`` runs; inputs are NumPy arrays wrapped by ``da.from_array``).

Usage::

    python bench/dask_flex_bench.py                # L=16384, B1 H8 D64 float32, chunks 2048
    python bench/dask_flex_bench.py --quick        # L=4096, chunks 512
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import arrayattn as aa
from arrayattn.flex import create_block_mask, document_mask

# 8 documents of uneven lengths (fractions of L): they end inside chunks, not on them.
DOC_FRACTIONS = (1500, 2600, 1800, 3100, 900, 2200, 2484, 1800)


def _doc_lengths(n: int) -> list[int]:
    total = sum(DOC_FRACTIONS)
    lengths = [f * n // total for f in DOC_FRACTIONS]
    lengths[-1] += n - sum(lengths)
    return lengths


def _block_tasks(graph: dict, prefixes: tuple[str, ...]) -> int:
    return sum(
        1 for k in graph if isinstance(k, tuple) and len(k) == 5 and str(k[0]).startswith(prefixes)
    )


def main() -> None:
    import dask
    import dask.array as da

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-backward", action="store_true")
    args = ap.parse_args()
    n, chunk = (4096, 512) if args.quick else (16384, 2048)
    B, H, D = 1, 8, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, n, D), dtype=np.float32) for _ in range(3))
    lengths = _doc_lengths(n)
    ids = np.repeat(np.arange(len(lengths)), lengths)
    t0 = time.perf_counter()
    bm = create_block_mask(document_mask(ids, causal=True), None, None, n, n)
    t_bm = time.perf_counter() - t0
    print(f"L={n} B{B} H{H} D{D} float32, chunks {chunk} along L; documents {lengths}")
    print(
        f"block mask: {bm.kinds.shape[-2]}x{bm.kinds.shape[-1]} blocks of {bm.Q_BLOCK}, "
        f"sparsity {bm.sparsity():.1f}%, built in {t_bm * 1e3:.1f} ms"
    )
    variants: dict[str, dict[str, Any]] = {
        "document block mask": {"block_mask": bm},
        "causal, no block mask": {"is_causal": True},
        "no mask": {},
    }
    dq, dk, dv = (da.from_array(x, chunks=(1, H, chunk, D)) for x in (q, k, v))
    print(
        "| variant | fwd tasks (blocks) | fwd s | fwd+bwd tasks (blocks) | fwd+bwd s |\n"
        "|---|---:|---:|---:|---:|"
    )
    with dask.config.set(scheduler="threads", num_workers=args.workers):
        for name, options in variants.items():
            out = aa.scaled_dot_product_attention(dq, dk, dv, **options)
            fwd_graph = dict(out.__dask_graph__())
            fwd_blocks = _block_tasks(fwd_graph, ("attn-blocks-", "attn-edge-blocks-"))
            fwd_t = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out.compute()
                fwd_t.append(time.perf_counter() - t0)
            row = f"| {name} | {len(fwd_graph)} ({fwd_blocks}) | {min(fwd_t):.2f} |"
            if args.no_backward:
                print(row + " - | - |", flush=True)
                continue
            out, pullback = aa.vjp(aa.scaled_dot_product_attention, dq, dk, dv, **options)
            grads = pullback(da.ones_like(out))[:3]
            graph: dict = {}
            for g in grads:
                graph.update(dict(g.__dask_graph__()))
            blocks = _block_tasks(graph, ("attn-blocks-", "attn-edge-blocks-", "attn-bwd-"))
            both_t = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                dask.compute(*grads)
                both_t.append(time.perf_counter() - t0)
            print(row + f" {len(graph)} ({blocks}) | {min(both_t):.2f} |", flush=True)


if __name__ == "__main__":
    main()
