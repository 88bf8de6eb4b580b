"""Decoding with the per-sequence ``KVCache`` and the ``PagedKVCache`` on NumPy: time per
decode step of one ``MultiHeadAttention`` layer for a ragged batch, and the memory each
cache holds, measured interleaved in one run (the machine may be shared: compare the
ratios, not the absolute numbers).

    python bench/kv_cache_bench.py [--batch 8] [--steps 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from arrayattn.nn import MultiHeadAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    B, T, P = args.batch, args.max_prompt, args.page_size
    mha = MultiHeadAttention(
        embed_dim=512, num_heads=8, num_kv_heads=2, rope="half", causal=True, bias=False
    )
    params = mha.init(seed=0, xp=np, dtype=np.float32)
    rng = np.random.default_rng(0)
    lengths = rng.integers(T // 8, T + 1, size=B).tolist()
    prompts = rng.standard_normal((B, T, 512), dtype=np.float32)
    steps = rng.standard_normal((args.steps, B, 1, 512), dtype=np.float32)
    pages = sum(-(-(n + args.steps) // P) for n in lengths)

    def fresh(kind: str):
        if kind == "contiguous":
            cache = mha.new_cache(B, T + args.steps)
        else:
            cache = mha.new_paged_cache(B, num_pages=pages, page_size=P)
        mha(params, prompts, cache=cache, lengths=lengths)
        return cache

    times: dict[str, list[float]] = {"contiguous": [], "paged": []}
    outputs: dict[str, np.ndarray] = {}
    memory: dict[str, int] = {}
    for _ in range(args.repeats):
        for kind in times:  # interleaved: both see the same machine load
            cache = fresh(kind)
            t0 = time.perf_counter()
            for x in steps:
                y = mha(params, x, cache=cache)
            times[kind].append((time.perf_counter() - t0) / args.steps)
            outputs[kind] = y
            memory[kind] = cache.keys.nbytes + cache.values.nbytes
    diff = float(np.max(np.abs(outputs["contiguous"] - outputs["paged"])))
    held = sum(lengths) + B * args.steps
    print(
        f"B={B} prompts {min(lengths)}..{max(lengths)} tokens, {args.steps} decode steps, "
        f"E=512 Hq=8 Hkv=2 D=64 float32, page_size={P}; {held} tokens held"
    )
    for kind, ts in times.items():
        print(
            f"{kind:>10}: {1e3 * statistics.median(ts):7.2f} ms/step (median of "
            f"{len(ts)}), cache memory {memory[kind] / 2**20:6.2f} MiB"
        )
    ratio = statistics.median(times["paged"]) / statistics.median(times["contiguous"])
    print(f"paged / contiguous time: {ratio:.2f}; max |difference| of outputs {diff:.1e}")


if __name__ == "__main__":
    main()
