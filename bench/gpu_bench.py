#!/usr/bin/env python
"""GPU attention benchmark: arrayattn's fused CuPy kernels vs PyTorch SDPA, same run.

For each dtype, head dim D (64, 128), sequence length L = S (512 .. 16384) with
batch x L = 16k tokens and H = 2048 / D heads, causal and not, it times

* ``fused``: ``scaled_dot_product_attention(..., implementation="fused")`` on CuPy,
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the same memory
  (shared through DLPack), forced to the flash backend for float16/bfloat16 and left on
  its default choice for float32,
* ``composed``: the array-API reference path on CuPy (skipped where its L x S score
  matrices would not fit),

with CUDA events around back-to-back calls (warm-up first; the median over three groups
of ``--reps / 3`` calls each, two input sets alternated so repeated runs do not just hit
L2); the host cost of one tiny call is printed separately. TFLOP/s use FlashAttention's counting:
forward ``4 * B * H * L * S * D`` flops, halved when causal; backward 2.5x forward.
``--backward`` adds backward and forward+backward rows (``arrayattn.vjp`` against torch
autograd). The table is printed and appended to ``bench/RESULTS.md`` with the device name.
Every fused result is also compared with torch's output (relative Frobenius error) so a
fast wrong kernel cannot pass unnoticed.

Usage::

    python bench/gpu_bench.py                       # the issue's full grid
    python bench/gpu_bench.py --dtypes float16 --head-dims 128 --lengths 2048,8192
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "RESULTS.md"
COMPOSED_MAX_BYTES = 8 * 2**30  # skip the composed path above this score-matrix size


def flops_forward(B: int, H: int, L: int, S: int, D: int, causal: bool) -> float:
    """FlashAttention's count: two matmuls of 2*L*S*D flops per (batch, head)."""
    f = 4.0 * B * H * L * S * D
    return f / 2 if causal else f


def _time_events(fn: Callable[[int], object], warmup: int, reps: int, event, sync) -> float:
    """Median over 3 groups of the mean milliseconds per call of ``fn(i)`` launched back to
    back (``i`` alternates the input set) between two device events, so that host-side
    launch overhead overlaps device work as it does in a real program; the device is
    synchronised only around each group."""
    for i in range(warmup):
        fn(i)
    sync()
    n = max(1, reps // 3)
    times = []
    for _ in range(3):
        start, stop = event(), event()
        start.record()
        for i in range(n):
            fn(i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / n if hasattr(start, "elapsed_time")
                     else _cupy_elapsed(start, stop) / n)  # fmt: skip
    sync()
    return statistics.median(times)


def _cupy_elapsed(start, stop) -> float:
    import cupy as cp

    return cp.cuda.get_elapsed_time(start, stop)


def time_cuda(fn: Callable[[int], object], warmup: int, reps: int) -> float:
    """Milliseconds per call of ``fn(i)`` on CuPy's current stream (see :func:`_time_events`)."""
    import cupy as cp

    return _time_events(fn, warmup, reps, cp.cuda.Event, cp.cuda.Device().synchronize)


def time_torch(fn: Callable[[int], object], warmup: int, reps: int) -> float:
    """As :func:`time_cuda`, with torch's events on torch's current stream."""
    import torch

    return _time_events(
        fn, warmup, reps, lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize
    )


def launch_overhead_ms(reps: int = 200) -> float:
    """Host milliseconds per ``scaled_dot_product_attention(implementation="fused")`` call
    on a tiny input (1 x 1 x 16 x 64 float16), device synchronised after the loop only:
    the Python and launch cost that a small call cannot hide."""
    import time

    import cupy as cp

    import arrayattn as aa

    q = cp.random.standard_normal((1, 1, 16, 64), dtype=cp.float32).astype(cp.float16)
    for _ in range(5):
        aa.scaled_dot_product_attention(q, q, q, implementation="fused")
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        aa.scaled_dot_product_attention(q, q, q, implementation="fused")
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def _rel(a, b) -> float:
    import cupy as cp

    a = a.astype(cp.float64)
    b = b.astype(cp.float64)
    return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))


def device_name() -> str:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _commit() -> str:
    try:
        res = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return res.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_case(args, dtype_name: str, D: int, L: int, causal: bool, torch) -> list[dict]:
    import cupy as cp

    import arrayattn as aa

    dtype = getattr(cp, dtype_name)
    B = max(1, args.tokens // L)
    H = 2048 // D
    S = L
    rs = cp.random.RandomState(L * 131 + D)
    sets = []
    for _ in range(2):
        q, k, v = (
            rs.standard_normal((B, H, L, D), dtype=cp.float32).astype(dtype) for _ in range(3)
        )
        sets.append((q, k, v))
    fwd = flops_forward(B, H, L, S, D, causal)
    rows: list[dict] = []
    base = dict(dtype=dtype_name, D=D, L=L, B=B, H=H, causal=causal)

    def fused(i: int):
        q, k, v = sets[i % 2]
        return aa.scaled_dot_product_attention(q, k, v, is_causal=causal, implementation="fused")

    ms_fused = time_cuda(fused, args.warmup, args.reps)
    out_fused = fused(0)

    ms_torch = None
    err = None
    if torch is not None:
        tsets = [tuple(torch.from_dlpack(x) for x in s) for s in sets]
        F = torch.nn.functional

        def run_torch(i: int):
            q, k, v = tsets[i % 2]
            with _torch_backend(args, dtype_name):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        try:
            ms_torch = time_torch(run_torch, args.warmup, args.reps)
            err = _rel(out_fused, cp.from_dlpack(run_torch(0)))
        except RuntimeError as exc:  # e.g. no flash kernel for this case
            print(f"  torch failed: {exc}".splitlines()[0], file=sys.stderr)

    ms_comp = None
    score_bytes = B * H * L * S * 4
    if not args.no_composed and score_bytes <= COMPOSED_MAX_BYTES:

        def comp(i: int):
            q, k, v = sets[i % 2]
            return aa.scaled_dot_product_attention(
                q, k, v, is_causal=causal, implementation="composed"
            )

        try:
            ms_comp = time_cuda(comp, 1, max(3, args.reps // 4))
        except cp.cuda.memory.OutOfMemoryError:
            ms_comp = None
        cp.get_default_memory_pool().free_all_blocks()

    rows.append(
        dict(base, pass_="fwd", ms=ms_fused, tflops=fwd / ms_fused / 1e9,
             torch_ms=ms_torch, torch_tflops=None if ms_torch is None else fwd / ms_torch / 1e9,
             ratio=None if ms_torch is None else ms_torch / ms_fused,
             composed_ms=ms_comp, err_vs_torch=err)
    )  # fmt: skip

    if args.backward:
        rows.extend(_bench_backward(args, base, sets, causal, fwd, torch))
    sets.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def _bench_backward(args, base, sets, causal, fwd, torch) -> list[dict]:
    """Backward and forward+backward rows: arrayattn.vjp vs torch autograd."""
    import cupy as cp

    import arrayattn as aa

    rs = cp.random.RandomState(7)
    d_out = rs.standard_normal(sets[0][0].shape, dtype=cp.float32).astype(sets[0][0].dtype)

    def fwd_bwd(i: int):
        q, k, v = sets[i % 2]
        _, pullback = aa.vjp(
            aa.scaled_dot_product_attention, q, k, v, is_causal=causal, implementation="fused"
        )
        return pullback(d_out)

    ms_fb = time_cuda(fwd_bwd, args.warmup, args.reps)
    pullbacks = []
    for i in range(2):
        q, k, v = sets[i]
        pullbacks.append(
            aa.vjp(aa.scaled_dot_product_attention, q, k, v, is_causal=causal,
                   implementation="fused")[1]
        )  # fmt: skip
    ms_b = time_cuda(lambda i: pullbacks[i % 2](d_out), args.warmup, args.reps)

    t_fb = t_b = None
    if torch is not None:
        F = torch.nn.functional
        td = torch.from_dlpack(d_out)
        tsets = [
            tuple(torch.from_dlpack(x).detach().clone().requires_grad_(True) for x in s)
            for s in sets
        ]

        def t_forward(i):
            q, k, v = tsets[i % 2]
            with _torch_backend(args, base["dtype"]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def t_fwd_bwd(i):
            q, k, v = tsets[i % 2]
            out = t_forward(i)
            return torch.autograd.grad(out, (q, k, v), td)

        outs = [t_forward(i) for i in range(2)]

        def t_bwd(i):
            q, k, v = tsets[i % 2]
            return torch.autograd.grad(outs[i % 2], (q, k, v), td, retain_graph=True)

        try:
            t_fb = time_torch(t_fwd_bwd, args.warmup, args.reps)
            t_b = time_torch(t_bwd, args.warmup, args.reps)
        except RuntimeError as exc:
            print(f"  torch backward failed: {exc}".splitlines()[0], file=sys.stderr)
    bwd = 2.5 * fwd
    rows = []
    for name, ms, tms, fl in (("bwd", ms_b, t_b, bwd), ("fwd+bwd", ms_fb, t_fb, fwd + bwd)):
        rows.append(
            dict(base, pass_=name, ms=ms, tflops=fl / ms / 1e9, torch_ms=tms,
                 torch_tflops=None if tms is None else fl / tms / 1e9,
                 ratio=None if tms is None else tms / ms, composed_ms=None, err_vs_torch=None)
        )  # fmt: skip
    rows.extend(
        _backward_checks(args, base, sets, causal, bwd, d_out, pullbacks, t_b, rows[0],
                         t_bwd if torch is not None else None)
    )  # fmt: skip
    return rows


# -- backward extras (owned by the backward kernels' work, arrayattn/attention/cuda/backward.py) --
def _backward_checks(args, base, sets, causal, bwd_flops, d_out, pullbacks, torch_ms,
                     bwd_row, torch_bwd) -> list[dict]:  # fmt: skip
    """Fill the backward row's gradient error against torch (max relative Frobenius error
    over dq, dk, dv) and add a ``bwd-det`` row: the deterministic backward mode
    (``arrayattn.attention.cuda.backward.deterministic()``), timed the same way."""
    import cupy as cp

    import arrayattn as aa
    from arrayattn.attention.cuda import backward as kernels_backward

    if torch_bwd is not None:
        ours = pullbacks[0](d_out)
        theirs = torch_bwd(0)
        bwd_row["err_vs_torch"] = max(
            _rel(a, cp.from_dlpack(b.detach())) for a, b in zip(ours, theirs, strict=True)
        )
    with kernels_backward.deterministic(True):
        det_pullbacks = []
        for i in range(2):
            q, k, v = sets[i]
            det_pullbacks.append(
                aa.vjp(aa.scaled_dot_product_attention, q, k, v, is_causal=causal,
                       implementation="fused")[1]
            )  # fmt: skip
        ms = time_cuda(lambda i: det_pullbacks[i % 2](d_out), args.warmup, args.reps)
        first, again = det_pullbacks[0](d_out), det_pullbacks[0](d_out)
        identical = all(bool((a == b).all()) for a, b in zip(first, again, strict=True))
    if not identical:
        print("  WARNING: deterministic backward differed between two runs", file=sys.stderr)
    return [
        dict(base, pass_="bwd-det" if identical else "bwd-det (NOT REPRODUCIBLE)", ms=ms,
             tflops=bwd_flops / ms / 1e9, torch_ms=torch_ms,
             torch_tflops=None if torch_ms is None else bwd_flops / torch_ms / 1e9,
             ratio=None if torch_ms is None else torch_ms / ms, composed_ms=None,
             err_vs_torch=None)
    ]  # fmt: skip


def decode_rows(lengths: list[int], reps: int) -> list[str]:
    """Decode: one new token (L = 1) of B = 1, H = 32 query heads over 8 KV heads, D = 128,
    float16, against caches of S keys: GB/s of the K and V bytes read, and the same call
    through PyTorch's SDPA (enable_gqa) on the same memory."""
    import cupy as cp

    import arrayattn as aa

    lines = [
        "| S | fused ms | fused GB/s | torch ms | torch GB/s | torch ms / fused ms | rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    torch = _cuda_torch()
    for S in lengths:
        rs = cp.random.RandomState(S)
        sets = []
        for _ in range(4):  # rotate over 4 caches so the 60 MB L2 cannot hold them
            q = rs.standard_normal((1, 32, 1, 128), dtype=cp.float32).astype(cp.float16)
            k = rs.standard_normal((1, 8, S, 128), dtype=cp.float32).astype(cp.float16)
            v = rs.standard_normal((1, 8, S, 128), dtype=cp.float32).astype(cp.float16)
            sets.append((q, k, v))
        nbytes = 2 * 8 * S * 128 * 2

        def fused(i: int, sets=sets):
            q, k, v = sets[i % 4]
            return aa.scaled_dot_product_attention(
                q, k, v, enable_gqa=True, implementation="fused"
            )

        ms = time_cuda(fused, 3, reps)
        t_ms = err = None
        if torch is not None:
            tsets = [tuple(torch.from_dlpack(x) for x in st) for st in sets]

            def run_torch(i: int, tsets=tsets):
                q, k, v = tsets[i % 4]
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            try:
                t_ms = time_torch(run_torch, 3, reps)
                err = _rel(fused(0), cp.from_dlpack(run_torch(0)))
            except RuntimeError as exc:
                print(f"  torch failed: {exc}".splitlines()[0], file=sys.stderr)
        line = (
            f"| {S} | {ms:.4f} | {nbytes / ms / 1e6:.0f} | {_fmt(t_ms, '.4f')} | "
            f"{_fmt(None if t_ms is None else nbytes / t_ms / 1e6, '.0f')} | "
            f"{_fmt(None if t_ms is None else t_ms / ms, '.2f')} | {_fmt(err, '.1e')} |"
        )
        print(line, flush=True)
        lines.append(line)
        sets.clear()
        cp.get_default_memory_pool().free_all_blocks()
    return lines


def long_rows(L: int = 131072, H: int = 8, D: int = 128) -> list[str]:
    """Causal float16 forward and forward+backward at L = S = ``L`` (no L x S buffer: the
    score matrix alone would be 2 * H * L * L bytes), with the peak of CuPy's pool."""
    import cupy as cp

    import arrayattn as aa

    rs = cp.random.RandomState(1)
    q, k, v = (
        rs.standard_normal((1, H, L, D), dtype=cp.float32).astype(cp.float16) for _ in range(3)
    )
    pool = cp.get_default_memory_pool()
    base = pool.used_bytes()
    fwd = flops_forward(1, H, L, L, D, True)

    def fb(i: int):
        out, pullback = aa.vjp(
            aa.scaled_dot_product_attention, q, k, v, is_causal=True, implementation="fused"
        )
        return pullback(out)

    ms_f = time_cuda(
        lambda i: aa.scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation="fused"
        ),
        1,
        3,
    )
    ms_fb = time_cuda(fb, 1, 3)
    peak = (pool.total_bytes() - base) / 2**30
    dense = 2 * H * L * L / 2**30
    lines = [
        f"L = S = {L}, H = {H}, D = {D}, float16, causal: forward {ms_f:.1f} ms "
        f"({fwd / ms_f / 1e9:.0f} TFLOP/s), forward+backward {ms_fb:.1f} ms "
        f"({3.5 * fwd / ms_fb / 1e9:.0f} TFLOP/s); pool beyond the inputs {peak:.2f} GiB "
        f"(a float16 score matrix would be {dense:.0f} GiB)"
    ]
    print(lines[0], flush=True)
    return lines


def _env_switches() -> str:
    """The ``ARRAYATTN_*`` variables set for this run (kernel variant switches such as
    ``ARRAYATTN_FWD_VARIANT``), as ``" NAME=value"`` words for a table's header line."""
    return "".join(f" {k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("ARRAYATTN_") and v)  # fmt: skip


def _torch_backend(args, dtype_name: str):
    """The peer's SDPA backend: ``--torch-backend`` (flash by default for 16-bit dtypes,
    cuDNN where asked: PyTorch offers both on Hopper; PyTorch's own choice for the
    others)."""
    import contextlib

    if dtype_name not in ("float16", "bfloat16") or args.torch_backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION"}[args.torch_backend]  # fmt: skip
    return sdpa_kernel(getattr(SDPBackend, name))


def _cuda_torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (
        "| dtype | D | L=S | B | H | causal | pass | fused ms | fused TFLOP/s | torch ms "
        "| torch TFLOP/s | speed vs torch (torch ms / fused ms) | composed ms | rel err vs torch |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['D']} | {r['L']} | {r['B']} | {r['H']} | "
            f"{'yes' if r['causal'] else 'no'} | {r['pass_']} | {_fmt(r['ms'], '.3f')} | "
            f"{_fmt(r['tflops'], '.1f')} | {_fmt(r['torch_ms'], '.3f')} | "
            f"{_fmt(r['torch_tflops'], '.1f')} | {_fmt(r['ratio'], '.2f')} | "
            f"{_fmt(r['composed_ms'], '.2f')} | {_fmt(r['err_vs_torch'], '.1e')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x L")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backward", action="store_true", help="also time backward passes")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--torch-backend", default="flash", choices=["flash", "cudnn", "efficient", "default"],
        help="the peer's SDPA backend for float16/bfloat16 (default: flash)",
    )  # fmt: skip
    ap.add_argument("--no-composed", action="store_true")
    ap.add_argument("--no-append", action="store_true", help="do not write bench/RESULTS.md")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument(
        "--decode", default=None, help="only the decode table, at these cache lengths S"
    )
    ap.add_argument("--long", action="store_true", help="only the L = 131072 causal run")
    args = ap.parse_args(argv)

    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy, no driver, no device
        print(f"no CUDA device through CuPy ({exc}); nothing to benchmark")
        return 0
    torch = None
    if not args.no_torch:
        try:
            import torch as _torch

            if _torch.cuda.is_available():
                torch = _torch
            else:
                print("torch has no CUDA: torch columns left empty", file=sys.stderr)
        except ImportError:
            print("torch not installed: torch columns left empty", file=sys.stderr)

    if args.decode or args.long:
        lines = (
            decode_rows([int(x) for x in args.decode.split(",")], args.reps)
            if args.decode
            else long_rows()
        )
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                env = _env_switches()
                f.write(f"\n{device_name()} {_commit()}{env} {' '.join(argv or sys.argv[1:])}\n\n")
                f.write(text + "\n")
        return 0
    try:
        print(f"launch overhead: {launch_overhead_ms():.3f} ms per tiny fused call (host)",
              flush=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        print(f"launch overhead: FAILED {type(exc).__name__}: {exc}", flush=True)
    causal_opts = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows: list[dict] = []
    for dtype_name in args.dtypes.split(","):
        for D in (int(x) for x in args.head_dims.split(",")):
            for L in (int(x) for x in args.lengths.split(",")):
                for causal in causal_opts:
                    try:
                        got = bench_case(args, dtype_name, D, L, causal, torch)
                    except Exception as exc:  # noqa: BLE001 - one case must not end the table
                        import traceback

                        print(f"{dtype_name} D={D} L={L} causal={causal}: FAILED "
                              f"{type(exc).__name__}: {exc}", flush=True)  # fmt: skip
                        traceback.print_exc()
                        continue
                    rows.extend(got)
                    for r in got:
                        print(
                            f"{dtype_name} D={D} L={L} causal={causal} {r['pass_']}: "
                            f"{r['tflops']:.1f} TFLOP/s, torch/fused "
                            f"{_fmt(r['ratio'], '.2f')}x, err {_fmt(r['err_vs_torch'], '.1e')}",
                            flush=True,
                        )
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            env = _env_switches()
            f.write(
                f"\n{device_name()} {_commit()}{env} {' '.join(argv or sys.argv[1:])}\n\n{text}\n"
            )
    if not args.no_append:
        import cupy as cp

        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        versions = f"CuPy {cp.__version__}"
        if torch is not None:
            versions += f", torch {torch.__version__}"
        header = (
            f"\n## {device_name()} — {stamp} — commit {_commit()}\n\n"
            f"{versions}; peer SDPA backend {args.torch_backend} (16-bit); "
            f"batch x L = {args.tokens} tokens, H = 2048 / D; median over 3 "
            f"groups of {max(1, args.reps // 3)} back-to-back calls (CUDA events); "
            f"FlashAttention flop counting "
            f"(causal halves; backward 2.5x forward).\n\n"
        )
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write(header + text + "\n")
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
