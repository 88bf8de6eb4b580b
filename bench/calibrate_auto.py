#!/usr/bin/env python
"""Fit the constants of ``implementation="auto"``'s cost model on this machine.

Times the composed, chunked and fast paths' forward on a table of probe
shapes (tiny batched problems, decode, prefill; causal and not; GQA), the paths
interleaved round by round and the minimum of ``--repeats`` rounds kept, then fits each
path's constants (its ``CostModel``: per call, per step, per small product, per score
element, per multiply-add; ``arrayattn/attention/cost.py`` has the formula) by
non-negative least squares on relative error, and prints them per path and library kind
to paste into that path's ``COST`` (``composed.py``, ``chunked.py``, ``fast/__init__.py``),
with each probe's measured and modelled times and the path ``"auto"`` would pick.

Usage::

    python bench/calibrate_auto.py                 # NumPy and PyTorch tensors, float32
    python bench/calibrate_auto.py --libs numpy --repeats 7
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's idle threads must not spin

try:
    import arrayattn  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import arrayattn as aa
from arrayattn.attention import cost as _cost
from arrayattn.attention import registry
from arrayattn.attention.spec import make_spec

# (B, Hq, Hkv, L, S, D, causal): bottom-right causal, as a KV cache uses it.
PROBES = (
    (256, 8, 8, 1, 128, 64, False),
    (2048, 1, 1, 4, 4, 64, False),
    (512, 8, 8, 4, 4, 64, False),
    (64, 8, 8, 16, 16, 64, True),
    (16, 8, 8, 64, 64, 64, True),
    (8, 8, 8, 128, 128, 32, False),
    (2, 8, 8, 256, 256, 64, True),
    (1, 8, 8, 512, 512, 128, False),
    (1, 8, 8, 1024, 1024, 64, True),
    (1, 8, 8, 1024, 1024, 64, False),
    (1, 8, 8, 2048, 2048, 64, False),
    (1, 32, 8, 1, 4096, 128, True),
    (16, 32, 8, 1, 1024, 128, True),
    (1, 32, 8, 16, 4096, 128, True),
    (1, 32, 8, 1, 16384, 128, True),
    (4, 32, 8, 4, 2048, 64, True),
)


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _caller(q, k, v, path: str, kw: dict):
    return lambda: aa.scaled_dot_product_attention(q, k, v, implementation=path, **kw)


def measure(lib: str, repeats: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    # PyTorch CPU tensors reach the fast path too (zero-copy NumPy views of them).
    paths = ["fast", "composed", "chunked"]
    for B, Hq, Hkv, L, S, D, causal in PROBES:
        q = rng.standard_normal((B, Hq, L, D), dtype=np.float32)
        k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
        v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
        if lib == "torch":
            import torch

            q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        kw = dict(is_causal=causal, causal_align="bottom_right", enable_gqa=Hq != Hkv)
        calls = {p: _caller(q, k, v, p, kw) for p in paths}
        for fn in calls.values():
            fn()  # warm-up
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(repeats):  # interleaved rounds
            for p, fn in calls.items():
                best[p] = min(best[p], _time(fn, 1))
        spec = make_spec(
            q, k, v, None, 0.0, causal, None, Hq != Hkv, "bottom_right", None, None, None
        )
        rows.append({"shape": (B, Hq, Hkv, L, S, D, causal), "spec": spec, "times": best})
        label = f"B={B} Hq={Hq} Hkv={Hkv} L={L} S={S} D={D}{' causal' if causal else ''}"
        print(
            f"{lib:6s} {label:52s} " + " ".join(f"{p} {t * 1e3:8.2f} ms" for p, t in best.items()),
            file=sys.stderr,
            flush=True,
        )
    return rows


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    try:
        from scipy.optimize import nnls

        return nnls(a, b)[0]
    except ImportError:  # clipped least squares: good enough for a starting point
        x = np.linalg.lstsq(a, b, rcond=None)[0]
        return np.clip(x, 0.0, None)


def fit(rows: list[dict], lib: str, threads: int) -> dict[str, _cost.PathCost]:
    key = "numpy" if lib == "numpy" else "array"
    fitted = {}
    for path in rows[0]["times"]:
        model = registry.cost_model(path)
        old = model.constants[key]
        feats, target = [], []
        for r in rows:
            steps, products, elements, macs = model.features(r["spec"], threads)
            div = threads if old.elem_threaded else 1
            t = r["times"][path]
            # The hand-set skinny (decode) term is not fitted: take it off the time.
            only_skinny = _cost.PathCost(0, 0, 0, 0, 0, old.elem_threaded, skinny=old.skinny)
            rest = max(t - model.estimate(r["spec"], threads, only_skinny), 0.05 * t)
            # Relative error: every probe counts alike whatever its size.
            feats.append(np.array([1.0, steps, products, elements / div, macs / threads]) / t)
            target.append(rest / t)
        x = _nnls(np.array(feats), np.array(target))
        # (the skinny term is set by hand from decode timings: too few probes to fit it)
        fitted[path] = _cost.PathCost(
            *(float(v) for v in x), elem_threaded=old.elem_threaded, skinny=old.skinny
        )
    return fitted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default="numpy,torch", help="numpy and/or torch")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    threads = _cost.threads()
    for lib in args.libs.split(","):
        rows = measure(lib, args.repeats)
        fitted = fit(rows, lib, threads)
        key = "numpy" if lib == "numpy" else "array"
        print(f"# {lib}: fitted constants ({threads} threads)")
        for path, c in fitted.items():
            print(f'    {path} "{key}": {c!r},')
        print(f"# {lib}: measured vs modelled (ms), and the fitted choice")
        for r in rows:
            est = {
                p: registry.cost_model(p).estimate(r["spec"], threads, c) for p, c in fitted.items()
            }
            best = min(r["times"], key=r["times"].get)
            pick = min(est, key=est.get)
            print(
                f"#   {r['shape']}: "
                + ", ".join(f"{k} {r['times'][k] * 1e3:.2f}/{est[k] * 1e3:.2f}" for k in r["times"])
                + f"; fastest {best}, model picks {pick}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
