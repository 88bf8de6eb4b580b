#!/usr/bin/env python
"""The split-KV decode kernels' device time alone, v1 against v2, on a GPU with CuPy.

``gpu_bench.py --decode`` times whole calls back to back, so at short caches it measures
the call's host cost (about 0.18 ms on an H200's host in 2026-11), not the kernels. Here
the device is first given a spin kernel of a few milliseconds; while it runs, the host
queues ``--calls`` decode calls (``decode.run_decode``: the split and merge kernels and
their buffers) between two CUDA events. The events then bracket only device work, so
their difference over ``--calls`` is the kernels' time per call, whatever the host cost.
Shape: B = 1, 32 query heads over 8 KV heads, D = 128, float16, one new token, 4 caches
rotated (no cache fits the 60 MB L2 alone at S >= 64k); GB/s count K and V bytes once.
Also printed: the largest difference between v1's and v2's outputs and LSEs.

Usage::

    python bench/gpu_decode_kernels.py --lengths 4096,16384,65536,131072 [--out bench.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384,65536,131072")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy or no device: nothing to time
        print(f"no CUDA device through CuPy ({exc}); nothing to time")
        return 0
    from arrayattn.attention.cuda import decode as d

    dev = cp.cuda.runtime.getDevice()
    sm = d._sm_count(dev)
    clock_khz = int(cp.cuda.Device(dev).attributes["ClockRate"])
    spin = cp.RawKernel(SPIN, "spin")
    Hq, Hkv, D = 32, 8, 128
    lines = [
        "| S | variant | device ms per call | GB/s of K+V |",
        "|---|---|---|---|",
    ]
    for S in (int(x) for x in args.lengths.split(",")):
        rs = cp.random.RandomState(S)
        shapes = ((1, Hq, 1, D), (1, Hkv, S, D), (1, Hkv, S, D))
        sets = [
            tuple(rs.standard_normal(s, dtype=cp.float32).astype(cp.float16) for s in shapes)
            for _ in range(4)
        ]
        results = {}
        for variant in d.VARIANTS:
            plan = d.decode_plan("float16", D, D, Hq // Hkv, variant=variant)
            assert plan is not None

            def call(i: int, plan=plan, sets=sets, S=S):  # noqa: ANN202, N803
                q, k, v = sets[i % 4]
                return d.run_decode(
                    cp, d._cupy_launch, plan, q, (Hq * D, D, D), k, (Hkv * S * D, S * D, D),
                    v, (Hkv * S * D, S * D, D), batch=1, heads=Hq, kv_heads=Hkv, rows=1,
                    keys=S, e=D, ev=D, scale=D**-0.5, out_dtype=cp.float16, sm_count=sm,
                )  # fmt: skip

            for i in range(3):
                call(i)
            times = []
            for _ in range(3):
                cp.cuda.Device().synchronize()
                # enough spin (0.3 ms per call) for the host to queue every call before
                # the device reaches the start event
                spin((1,), (1,), (cp.int64(clock_khz * 1000 * 3 * args.calls // 10000),))
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                for i in range(args.calls):
                    call(i)
                stop.record()
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop) / args.calls)
            ms = sorted(times)[1]
            results[variant] = call(0)
            gbs = 2 * Hkv * S * D * 2 / ms / 1e6
            line = f"| {S} | {variant} | {ms:.4f} | {gbs:.0f} |"
            print(line, flush=True)
            lines.append(line)
        o1, l1 = results["v1"]
        o2, l2 = results["v2"]
        diff = float(cp.abs(o1.astype(cp.float32) - o2.astype(cp.float32)).max())
        ldiff = float(cp.abs(l1 - l2).max())
        print(f"  S={S}: max |out v1 - v2| {diff:.1e}, max |lse v1 - v2| {ldiff:.1e}", flush=True)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            name = cp.cuda.runtime.getDeviceProperties(dev)["name"]
            name = name.decode() if isinstance(name, bytes) else name
            f.write(f"\n{name}: decode kernels alone (bench/gpu_decode_kernels.py)\n\n")
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
