#!/usr/bin/env python
"""What ``sinks=`` and ``alibi_slopes=`` cost on the CPU, against the ways to get the same
result without them, in one interleaved run.

For one causal GQA shape (float32, NumPy fast path unless ``--implementation``), forward
and forward + backward, median seconds of:

- ``plain``: attention without sinks or ALiBi (the baseline of every ratio);
- ``sinks``: ``sinks=`` (gpt-oss);
- ``alibi``: ``alibi_slopes=`` (BLOOM-style geometric slopes, bias built per block);
- ``alibi_dense_mask``: the same ALiBi as a dense ``(Hq, L, S)`` float ``attn_mask``
  (what a user without ``alibi_slopes=`` writes; its ``L x S`` bias is built once, outside
  the timed call, and its gradient is computed because a float mask is differentiable);
- ``torch_eager_sinks`` (when torch is installed): Hugging Face gpt-oss's eager attention
  in torch (sink logits as an extra column, softmax, drop the column), autograd backward;
- ``torch_sdpa_alibi`` (when torch is installed): torch SDPA with the dense ALiBi mask.

Each round times every variant once, in a rotating order, so machine noise spreads over
all of them; ratios are of medians taken in the same run.

Usage::

    python bench/sinks_alibi_bench.py
    python bench/sinks_alibi_bench.py --shape 1,8,2,2048,64 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import arrayattn  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import arrayattn as aa


def _alibi_slopes(h: int) -> np.ndarray:
    """BLOOM's slopes for a power-of-two head count: 2**(-8 i / h), i = 1..h."""
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def _variants(shape: tuple[int, ...], implementation: str, backward: bool):
    B, Hq, Hkv, L, E = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, L, E), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, L, E), dtype=np.float32)
    d_out = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
    sinks = rng.standard_normal(Hq).astype(np.float32)
    slopes = _alibi_slopes(Hq)
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    dense = (-slopes[:, None, None] * np.abs(i - j)).astype(np.float32)  # (Hq, L, L)
    base = dict(is_causal=True, enable_gqa=True, implementation=implementation)

    def ours(*args: Any, **kw: Any) -> Callable[[], Any]:
        if not backward:
            return lambda: aa.scaled_dot_product_attention(q, k, v, *args, **base, **kw)

        def run() -> Any:
            out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, *args, **base, **kw)
            return pullback(d_out)

        return run

    out = {
        "plain": ours(),
        "sinks": ours(sinks=sinks),
        "alibi": ours(alibi_slopes=slopes),
        "alibi_dense_mask": ours(dense),
    }
    try:
        import torch
    except ImportError:
        return out
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    ts, tdense, tdo = torch.from_numpy(sinks), torch.from_numpy(dense), torch.from_numpy(d_out)
    causal = torch.from_numpy(np.where(j <= i, 0.0, -np.inf).astype(np.float32))
    rep = Hq // Hkv

    def eager_sinks(q_, k_, v_, s_):
        ks, vs = k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1)
        w = torch.matmul(q_, ks.transpose(2, 3)) * E**-0.5 + causal
        col = s_.reshape(1, -1, 1, 1).expand(q_.shape[0], -1, q_.shape[-2], -1)
        logits = torch.cat([w, col], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        return torch.matmul(torch.softmax(logits, dim=-1)[..., :-1], vs)

    def sdpa_alibi(q_, k_, v_):
        ks, vs = k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1)
        return torch.nn.functional.scaled_dot_product_attention(q_, ks, vs, tdense + causal)

    def torch_run(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        if not backward:
            return lambda: fn(*args)

        def run() -> Any:
            leaves = [a.detach().requires_grad_(True) for a in args]
            fn(*leaves).backward(tdo)
            return [a.grad for a in leaves]

        return run

    out["torch_eager_sinks"] = torch_run(eager_sinks, tq, tk, tv, ts)
    out["torch_sdpa_alibi"] = torch_run(sdpa_alibi, tq, tk, tv)
    return out


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    names = list(fns)
    for f in fns.values():
        f()  # warm up (kernels, caches, thread pools)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1,8,2,2048,64", help="B,Hq,Hkv,L(=S),E")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--implementation", default="fast")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    print(f"shape B,Hq,Hkv,L=S,E = {shape}, float32, causal, GQA, "
          f"implementation={args.implementation!r}, {args.repeats} interleaved rounds")  # fmt: skip
    for backward in (False, True):
        med = _interleaved(_variants(shape, args.implementation, backward), args.repeats)
        print(f"\n{'forward + backward' if backward else 'forward'}")
        print(f"  {'variant':<20} {'median ms':>10} {'vs plain':>9}")
        for name, t in med.items():
            print(f"  {name:<20} {t * 1e3:>10.1f} {t / med['plain']:>8.2f}x")


if __name__ == "__main__":
    main()
