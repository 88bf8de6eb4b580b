"""Launch each family of fused-kernel variants once, on small shapes, for compute-sanitizer.

Every case runs the forward (with its LSE) and the backward through ``arrayattn.vjp``
with ``implementation="fused"``: the float16/bfloat16 tensor-core kernels and the
float32/float64 SIMT ones, head dims 64 and 128, ragged L and S (not multiples of the
tiles), both causal alignments, a window, GQA, per-sequence lengths (rows and keys cut),
softcap with dropout, and sinks with ALiBi. Shapes are small so that racecheck, which
slows kernels by orders of magnitude, finishes in minutes. Exits 1 if an output or
gradient is not finite.

Usage (on a GPU machine; ``bench/gpu_first_contact.sh`` runs them with CuPy's pool off)::

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
        if dtype in ("float16", "bfloat16"):  # head dims with their own tiles (the
            # opt-in aa_fwd_tc2 at 96, the tensor-core backward at 256: SANITIZE_ENV)
            for E in (96, 256):
                yield f"{dtype} E{E} causal", {**base, "E": E, "is_causal": True}
        # arrayattn.flex: a block mask (the kernels' block table and partial-block bits)
        yield f"{dtype} block mask", {**base, "doc_mask": True, "is_causal": True}
        # L <= 16 over S >= 128: the split-KV decode kernels (an empty sequence included)
        yield f"{dtype} decode gqa lengths", {**base, "Hq": 8, "Hkv": 2, "L": 1, "S": 300,
                                              "enable_gqa": True, "is_causal": True,
                                              "causal_align": "bottom_right", "lengths": True}


TOLERANCES = {
    # (output and LSE, gradients): relative Frobenius error against float64
    "float16": (5e-3, 2e-2),
    "bfloat16": (3e-2, 8e-2),
    "float32": (2e-5, 2e-4),
    "float64": (1e-10, 1e-9),
}


def _call(xp: Any, implementation: str, opts: dict[str, Any], arrays: dict[str, np.ndarray]):
    """Forward (output, LSE) and the gradients (dq, dk, dv) of one case on ``xp``, the
    inputs ``arrays`` (float32 values) in the case's dtype (float64 on NumPy)."""
    dtype = xp.float64 if xp is np else getattr(xp, opts["dtype"])

    def put(a: np.ndarray, dt: Any = None) -> Any:
        return xp.asarray(a, dtype=dtype if dt is None else dt)

    q, k, v = (put(arrays[n]) for n in ("q", "k", "v"))
    kwargs: dict[str, Any] = {name: opts[name] for name in PASSED_AS_IS if name in opts}
    if opts.get("lengths"):
        kwargs["q_lengths"] = put(arrays["q_lengths"], xp.int32)
        kwargs["kv_lengths"] = put(arrays["kv_lengths"], xp.int32)
    if opts.get("sinks"):
        kwargs["sinks"] = put(arrays["sinks"], xp.float32)
    if opts.get("alibi"):
        kwargs["alibi_slopes"] = put(arrays["alibi"], xp.float32)
    if opts.get("doc_mask"):  # three documents over the queries and over the keys
        from arrayattn import flex

        L, S = arrays["q"].shape[-2], arrays["k"].shape[-2]
        ids_q = xp.asarray(np.arange(L) * 3 // max(L, 1), dtype=xp.int32)
        ids_k = xp.asarray(np.arange(S) * 3 // max(S, 1), dtype=xp.int32)
        kwargs["block_mask"] = flex.create_block_mask(
            flex.document_mask(ids_q, ids_k), arrays["q"].shape[0], None, L, S, xp=xp
        )
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention, q, k, v, return_lse=True,
        implementation=implementation, **kwargs,
    )  # fmt: skip
    d_out = put(arrays["d_out"])
    d_lse = xp.asarray(arrays["d_lse"], dtype=lse.dtype)
    grads = pullback((d_out, d_lse))
    return [out, lse, *grads[:3]]


def _host64(xp: Any, a: Any) -> np.ndarray:
    if xp is np:
        return np.asarray(a, dtype=np.float64)
    if a.dtype not in (xp.float32, xp.float64):  # 16-bit: through float32, exactly
        a = a.astype(xp.float32)
    return xp.asnumpy(a).astype(np.float64)


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative Frobenius error over the positions where the reference is finite; inf when
    the two disagree on which positions are finite (empty rows: LSE -inf)."""
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(got)) or (~fin & (got != ref)).any():
        return float("inf")
    den = np.linalg.norm(ref[fin])
    num = np.linalg.norm(got[fin] - ref[fin])
    return float(num / den) if den > 0 else float(num)


def run_case(
    xp: Any, implementation: str, opts: dict[str, Any], rng, check: bool = False
) -> tuple[bool | None, str]:
    """Forward and backward of one case: ``(ok, detail)``. ``ok`` is ``True`` when every
    output and gradient is finite (and, with ``check``, within :data:`TOLERANCES` of the
    same call in float64 on NumPy), ``None`` when the library has no such dtype."""
    if getattr(xp, opts["dtype"], None) is None:
        return None, ""
    B, Hq, Hkv, L, S, E = (opts[k] for k in ("B", "Hq", "Hkv", "L", "S", "E"))

    def draw(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    arrays = {
        "q": draw(B, Hq, L, E), "k": draw(B, Hkv, S, E), "v": draw(B, Hkv, S, E),
        "d_out": draw(B, Hq, L, E), "d_lse": 0.5 * draw(B, Hq, L),
        "q_lengths": np.array([L, L // 2], np.int32),
        "kv_lengths": np.array([S - 5, S // 3], np.int32),
        "sinks": draw(Hq), "alibi": 2.0 ** -np.arange(1, Hq + 1, dtype=np.float32),
    }  # fmt: skip
    if check and xp is not np:
        # The reference sees the values the kernel sees: rounded to the case's dtype.
        for n in ("q", "k", "v", "d_out"):
            arrays[n] = _host64(xp, xp.asarray(arrays[n], dtype=getattr(xp, opts["dtype"])))
    got = _call(xp, implementation, opts, arrays)
    host = [_host64(xp, a) for a in got]
    finite = all(bool(np.isfinite(a).all()) for i, a in enumerate(host) if i != 1)
    # Empty rows give LSE -inf (or the sink), never NaN.
    finite = finite and not bool(np.isnan(host[1]).any())
    if not check:
        return finite, ""
    ref = [np.asarray(a) for a in _call(np, "auto", opts, arrays)]
    errs = [_rel(g, r) for g, r in zip(host, ref, strict=True)]
    tol_fwd, tol_bwd = TOLERANCES[opts["dtype"]]
    ok = finite and all(e <= tol_fwd for e in errs[:2]) and all(e <= tol_bwd for e in errs[2:])
    detail = "out {:.1e} lse {:.1e} dq {:.1e} dk {:.1e} dv {:.1e}".format(*errs)
    return ok, detail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--xp", default="cupy", help="cupy (default) or numpy (a smoke run)")
    p.add_argument("--small", action="store_true", help="smaller shapes (for racecheck)")
    p.add_argument(
        "--check", action="store_true",
        help="also compare every output and gradient with float64 on NumPy",
    )  # fmt: skip
    p.add_argument(
        "--no-pool", action="store_true",
        help="CuPy without its memory pool (every array its own cudaMalloc), so that "
        "memcheck sees accesses past an allocation's end",
    )  # fmt: skip
    p.add_argument("--dtypes", default="float16,bfloat16,float32,float64")
    p.add_argument(
        "--plant-oob", action="store_true",
        help="first launch a kernel that writes one element past an allocation: memcheck "
        "must report exactly that error (proof that it is not blind)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.xp == "cupy":
        import cupy as xp

        implementation = "fused"
        if args.no_pool:
            xp.cuda.set_allocator(None)
            xp.cuda.set_pinned_memory_allocator(None)
    else:
        xp, implementation = np, "auto"
    if args.plant_oob and args.xp == "cupy":
        planted = xp.RawKernel(
            'extern "C" __global__ void aa_planted_oob(float* a, int n) '
            "{ if (threadIdx.x == 0) a[n + 3] = 1.0f; }",
            "aa_planted_oob",
        )
        a = xp.zeros(1000, dtype=xp.float32)
        planted((1,), (32,), (a, np.int32(1000)))
        xp.cuda.Device().synchronize()
        print("planted: one write 12 bytes past a 4000-byte allocation", flush=True)
    rng = np.random.default_rng(0)
    bad = []
    dtypes = args.dtypes.split(",")
    for name, opts in cases(args.small):
        if opts["dtype"] not in dtypes:
            continue
        try:
            ok, detail = run_case(xp, implementation, opts, rng, check=args.check)
        except Exception as exc:  # noqa: BLE001 - report every case, then fail
            ok, detail = False, f"raised {type(exc).__name__}: {str(exc).splitlines()[:3]}"
        label = "ok" if args.check else "finite"
        status = {True: label, False: "FAILED", None: "skipped (no such dtype here)"}[ok]
        print(f"{name}: {status} {detail}".rstrip(), flush=True)
        if ok is False:
            bad.append(name)
    if args.xp == "cupy":
        xp.cuda.Device().synchronize()
    print(f"{len(bad)} case(s) failed" + (f": {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
