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
  mask_mods: blocks are classified from each block's smallest and largest document id).

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

    out = {"block_mask": block_mask, "per_doc": per_doc, "dense_mask": dense_mask,
           "create_block_mask": build}  # fmt: skip
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
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\nL = {args.length}, H = {args.heads}, D = {args.dim}, float32, "
          f"implementation={args.implementation}, {args.repeats} interleaved rounds\n")  # fmt: skip
    print("| variant | median ms | min-max ms |")
    print("|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n] * 1e3:.1f} | {min(times[n]) * 1e3:.1f}-{max(times[n]) * 1e3:.1f} |")
    print()
    print(f"- (a)/(b) block_mask / per_doc: {med['block_mask'] / med['per_doc']:.2f} "
          "(target <= 1.2)")  # fmt: skip
    print(f"- (c)/(a) dense_mask / block_mask: {med['dense_mask'] / med['block_mask']:.2f} "
          "(target >= 4)")  # fmt: skip
    print(f"- create_block_mask: {med['create_block_mask'] * 1e3:.2f} ms (target < 20 ms)")
    if args.backward:
        ratio = med["block_mask_fwd_bwd"] / med["per_doc_fwd_bwd"]
        print(f"- forward + backward, block_mask / per_doc: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
