#!/usr/bin/env python
"""What a block mask (``arrayattn.flex``) costs on the NumPy fast path, for a packed
batch: ``N`` documents of random lengths packed into one sequence of ``L`` tokens, with
a causal document mask. In one interleaved run, median seconds of:

- ``block_mask``: one call with ``create_block_mask(document_mask(ids, causal=True))``
  (the block mask built once, outside the timed call, as a model reuses it over layers);
- ``per_doc``: the sum of ``N`` calls, one per document, ``is_causal=True`` on each
  document's slice (the lower bound: no work outside the documents, ``N`` call overheads);
- ``dense_mask``: the same mask as a dense ``(L, L)`` bool ``attn_mask`` (built once,
  outside the timed call);
- ``create_block_mask``: building the block mask (no pair is evaluated for the built-in
  mask_mods: blocks are classified from each block's smallest and largest document id);
- ``fast_fine_table``: the finer table (``FINE_BLOCKS``) the fast path builds once per
  block mask of a built-in mask_mod, on its first call (cached with the block mask).

With ``--backward`` the forward + ``vjp`` pullback is timed too (``block_mask`` against
``per_doc``). Each round times every variant once, in a rotating order, so machine
noise spreads over all of them; the spread is the min-max range of the rounds.

Usage::

    OMP_WAIT_POLICY=PASSIVE python bench/flex_bench.py
    OMP_WAIT_POLICY=PASSIVE python bench/flex_bench.py --length 4096 --repeats 3 --backward
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    import arrayattn  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import arrayattn as aa
from arrayattn.attention.fast.flex import FINE_BLOCKS
from arrayattn.flex import create_block_mask, document_mask


def doc_lengths(total: int, n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` lengths in ``[lo, hi]`` summing to ``total`` (a fixed seed: the same packing
    every run). Drawn uniformly, then scaled to the total and the rounding error spread
    over the documents that stay within bounds."""
    rng = np.random.default_rng(seed)
    if not n * lo <= total <= n * hi:
        raise ValueError(f"{n} documents of {lo}..{hi} tokens cannot sum to {total}")
    for _ in range(10_000):
        raw = rng.uniform(lo, hi, n)
        lengths = np.floor(raw / raw.sum() * total).astype(int)
        lengths[: total - lengths.sum()] += 1
        if lengths.min() >= lo and lengths.max() <= hi:
            return [int(x) for x in lengths]
    raise RuntimeError("no packing found")


def _variants(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    L, H, D = args.length, args.heads, args.dim
    lengths = doc_lengths(L, args.documents, args.min_doc, args.max_doc, args.seed)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, L, D), dtype=np.float32)
    k = rng.standard_normal((1, H, L, D), dtype=np.float32)
    v = rng.standard_normal((1, H, L, D), dtype=np.float32)
    d_out = rng.standard_normal((1, H, L, D), dtype=np.float32)
    ids = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    mod = document_mask(ids, causal=True)
    bm = create_block_mask(mod, 1, None, L, L, block_size=args.block)
    dense = (ids[:, None] == ids[None, :]) & np.tri(L, dtype=bool)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    impl = args.implementation
    sdpa = aa.scaled_dot_product_attention

    def block_mask():
        return sdpa(q, k, v, block_mask=bm, implementation=impl)

    def per_doc():
        for s, n in zip(starts, lengths, strict=True):
            sl = slice(s, s + n)
            sdpa(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, implementation=impl)

    def dense_mask():
        return sdpa(q, k, v, attn_mask=dense, implementation=impl)

    def build():
        return create_block_mask(document_mask(ids, causal=True), 1, None, L, L,
                                 block_size=args.block)  # fmt: skip

    def fine_table():  # what the fast path adds on a BlockMask's first call
        return create_block_mask(document_mask(ids, causal=True), 1, None, L, L,
                                 block_size=FINE_BLOCKS)  # fmt: skip

    out = {"block_mask": block_mask, "per_doc": per_doc, "dense_mask": dense_mask,
           "create_block_mask": build, "fast_fine_table": fine_table}  # fmt: skip
    if args.backward:

        def block_mask_bwd():
            o, pb = aa.vjp(sdpa, q, k, v, block_mask=bm, implementation=impl)
            return pb(d_out)

        def per_doc_bwd():
            for s, n in zip(starts, lengths, strict=True):
                sl = slice(s, s + n)
                o, pb = aa.vjp(sdpa, q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                               implementation=impl)  # fmt: skip
                pb(d_out[:, :, sl])

        out["block_mask_fwd_bwd"] = block_mask_bwd
        out["per_doc_fwd_bwd"] = per_doc_bwd
    print(f"documents: {lengths} (sum {sum(lengths)}); block mask {bm.kinds.shape}, "
          f"sparsity {bm.sparsity():.1f}%", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--min-doc", type=int, default=512)
    p.add_argument("--max-doc", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--implementation", default="fast")
    p.add_argument("--backward", action="store_true")
    args = p.parse_args(argv)
    if args.documents * args.min_doc > args.length:  # small smoke runs: shorter documents
        args.min_doc = max(1, args.length // (2 * args.documents))
        args.max_doc = max(args.min_doc, 2 * args.length // args.documents)
    variants = _variants(args)
    names = list(variants)
    for f in variants.values():  # warm-up (thread pool, caches)
        f()
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            c0, t0 = time.process_time(), time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    med = {n: statistics.median(t) for n, t in times.items()}
    cmed = {n: statistics.median(t) for n, t in cpu.items()}
    print(f"\nL = {args.length}, H = {args.heads}, D = {args.dim}, float32, "
          f"implementation={args.implementation}, {args.repeats} interleaved rounds\n")  # fmt: skip
    print("| variant | wall median ms | wall min-max ms | CPU median ms | CPU min-max ms |")
    print("|---|---|---|---|---|")
    for n in names:
        wall = f"{med[n] * 1e3:.1f} | {min(times[n]) * 1e3:.1f}-{max(times[n]) * 1e3:.1f}"
        used = f"{cmed[n] * 1e3:.1f} | {min(cpu[n]) * 1e3:.1f}-{max(cpu[n]) * 1e3:.1f}"
        print(f"| {n} | {wall} | {used} |")
    print()

    def ratio(a: str, b: str) -> str:
        per_round = [x / y for x, y in zip(times[a], times[b], strict=True)]
        return (f"wall {med[a] / med[b]:.2f} (per round {min(per_round):.2f}-"
                f"{max(per_round):.2f}), CPU {cmed[a] / cmed[b]:.2f}")  # fmt: skip

    print(f"- (a)/(b) block_mask / per_doc: {ratio('block_mask', 'per_doc')} (target <= 1.2)")
    print(f"- (c)/(a) dense_mask / block_mask: {ratio('dense_mask', 'block_mask')} (target >= 4)")
    print(f"- create_block_mask: {med['create_block_mask'] * 1e3:.2f} ms (target < 20 ms)")
    if args.backward:
        print("- forward + backward (vjp + pullback), block_mask / per_doc: "
              f"{ratio('block_mask_fwd_bwd', 'per_doc_fwd_bwd')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
