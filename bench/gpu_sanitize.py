"""Launch each family of fused-kernel variants once, on small shapes, for compute-sanitizer.

Every case runs the forward (with its LSE) and the backward through ``arrayattn.vjp``
with ``implementation="fused"``: the float16/bfloat16 tensor-core kernels and the
float32/float64 SIMT ones, head dims 64 and 128, ragged L and S (not multiples of the
tiles), both causal alignments, a window, GQA, per-sequence lengths (rows and keys cut),
softcap with dropout, and sinks with ALiBi. Shapes are small so that racecheck, which
slows kernels by orders of magnitude, finishes in minutes. Exits 1 if an output or
gradient is not finite.

Usage (on a GPU machine; ``bench/gpu_first_run.sh`` runs both)::

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/gpu_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/gpu_sanitize.py --small
    python3 bench/gpu_sanitize.py --xp numpy    # the same calls on NumPy: a smoke run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import arrayattn as aa
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import arrayattn as aa


PASSED_AS_IS = ("is_causal", "causal_align", "window", "enable_gqa", "softcap", "dropout_p", "seed")
"""Case options that are ``scaled_dot_product_attention`` keywords unchanged."""


def cases(small: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(name, options)``: shapes and the ``scaled_dot_product_attention`` options."""
    L, S = (37, 70) if small else (77, 130)
    dims = (64,) if small else (64, 128)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for E in dims:
            base = {"dtype": dtype, "B": 2, "Hq": 4, "Hkv": 4, "L": L, "S": S, "E": E}
            yield f"{dtype} E{E} full", base
            yield f"{dtype} E{E} causal top_left", {**base, "is_causal": True}
            yield (
                f"{dtype} E{E} causal bottom_right",
                {**base, "is_causal": True, "causal_align": "bottom_right"},
            )
        base = {"dtype": dtype, "B": 2, "Hq": 4, "Hkv": 4, "L": L, "S": S, "E": 64}
        yield f"{dtype} window", {**base, "window": (16, 3), "causal_align": "bottom_right"}
        yield f"{dtype} gqa 4/2", {**base, "Hkv": 2, "enable_gqa": True, "is_causal": True}
        yield f"{dtype} lengths", {**base, "lengths": True, "is_causal": True,
                                   "causal_align": "bottom_right"}  # fmt: skip
        yield f"{dtype} softcap dropout", {**base, "softcap": 20.0, "dropout_p": 0.25, "seed": 7}
        yield f"{dtype} sinks alibi", {**base, "sinks": True, "alibi": True, "is_causal": True}


def run_case(xp: Any, implementation: str, opts: dict[str, Any], rng) -> bool | None:
    """Forward and backward of one case; ``True`` when everything is finite, ``None``
    when the library has no such dtype (bfloat16 in NumPy and older CuPy)."""
    dtype = getattr(xp, opts["dtype"], None)
    if dtype is None:
        return None
    B, Hq, Hkv, L, S, E = (opts[k] for k in ("B", "Hq", "Hkv", "L", "S", "E"))

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32), dtype=dtype)

    q, k, v = arr(B, Hq, L, E), arr(B, Hkv, S, E), arr(B, Hkv, S, E)
    kwargs: dict[str, Any] = {name: opts[name] for name in PASSED_AS_IS if name in opts}
    if opts.get("lengths"):
        kwargs["q_lengths"] = xp.asarray(np.array([L, L // 2], np.int32))
        kwargs["kv_lengths"] = xp.asarray(np.array([S - 5, S // 3], np.int32))
    if opts.get("sinks"):
        kwargs["sinks"] = xp.asarray(rng.standard_normal(Hq).astype(np.float32))
    if opts.get("alibi"):
        kwargs["alibi_slopes"] = xp.asarray(2.0 ** -np.arange(1, Hq + 1, dtype=np.float32))
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, return_lse=True,
        implementation=implementation, **kwargs,
    )  # fmt: skip
    grads = pullback((xp.ones_like(out), xp.zeros_like(lse)))
    arrays = [out, *grads[:3]]
    finite = all(bool(xp.all(xp.isfinite(xp.astype(a, xp.float32)))) for a in arrays)
    # Empty rows give LSE -inf (or the sink), never NaN.
    return finite and not bool(xp.any(xp.isnan(lse)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--xp", default="cupy", help="cupy (default) or numpy (a smoke run)")
    p.add_argument("--small", action="store_true", help="smaller shapes (for racecheck)")
    args = p.parse_args(argv)
    if args.xp == "cupy":
        import cupy as xp

        implementation = "fused"
    else:
        xp, implementation = np, "auto"
    rng = np.random.default_rng(0)
    bad = []
    for name, opts in cases(args.small):
        ok = run_case(xp, implementation, opts, rng)
        status = {True: "ok", False: "NOT FINITE", None: "skipped (no such dtype here)"}[ok]
        print(f"{name}: {status}", flush=True)
        if ok is False:
            bad.append(name)
    if args.xp == "cupy":
        xp.cuda.Device().synchronize()
    print(f"{len(bad)} case(s) not finite" + (f": {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
