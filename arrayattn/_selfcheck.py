"""The main job (``python -m arrayattn``): which backends are here, does every op agree
with a float64 reference on each, and how fast is attention on NumPy.

The references below are plain float64 NumPy, written from ``SEMANTICS.md`` without
calling the code they check. No GPU is needed; CuPy is checked when a device exists.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["main", "available_backends"]


@dataclass
class _Backend:
    name: str
    xp: Any
    device: Any
    to_numpy: Callable[[Any], np.ndarray]

    def asarray(self, a: np.ndarray) -> Any:
        if self.name == "jax":
            return self.xp.asarray(a)
        if self.name == "dask":  # two chunks along the first axis: the blockwise path runs
            import dask.array as da

            return da.from_array(a, chunks=(max(1, -(-a.shape[0] // 2)),) + a.shape[1:])
        return self.xp.asarray(a, device=self.device)


def available_backends() -> list[_Backend]:
    """Every array library importable here (and usable: CuPy needs a device)."""
    found: list[_Backend] = []
    import array_api_compat.numpy as xnp

    found.append(_Backend("numpy", xnp, "cpu", np.asarray))
    try:
        import array_api_strict as xs

        def strict_np(x: Any) -> np.ndarray:
            x = xs.asarray(x, device=xs.Device("CPU_DEVICE"))
            return np.asarray(x._array)

        found.append(_Backend("array_api_strict", xs, xs.Device("CPU_DEVICE"), strict_np))
        found.append(_Backend("array_api_strict:device1", xs, xs.Device("device1"), strict_np))
    except ImportError:
        pass
    try:
        import array_api_compat.torch as xt
        import torch  # noqa: F401

        found.append(_Backend("torch", xt, "cpu", lambda x: x.detach().cpu().numpy()))
    except ImportError:
        pass
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        found.append(_Backend("jax", jnp, jax.devices()[0], np.asarray))
    except ImportError:
        pass
    try:
        import array_api_compat.dask.array as xd
        import dask

        def dask_np(x: Any) -> np.ndarray:
            with dask.config.set(scheduler="synchronous"):  # one process, no cluster
                return np.asarray(x.compute())

        found.append(_Backend("dask", xd, "cpu", dask_np))
    except ImportError:
        pass
    try:
        import array_api_compat.cupy as xc
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            found.append(_Backend("cupy", xc, cupy.cuda.Device(0), lambda x: x.get()))
    except Exception:  # no cupy, or no driver/device
        pass
    return found


# -- float64 references -------------------------------------------------------------
def _ref_attention(q, k, v, mask, causal_offset, G, scale, sinks=None, slopes=None):
    k = np.repeat(k, G, axis=-3)
    v = np.repeat(v, G, axis=-3)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    L, S = s.shape[-2:]
    if slopes is not None:  # ALiBi: -slope * |i + offset - j|
        dist = np.abs(np.arange(L)[:, None] + (causal_offset or 0) - np.arange(S)[None, :])
        s = s - slopes[:, None, None] * dist
    allowed = np.ones((L, S), bool)
    if causal_offset is not None:
        allowed = np.arange(S)[None, :] <= np.arange(L)[:, None] + causal_offset
    if mask is not None:
        allowed = allowed & mask
    s = np.where(allowed, s, -np.inf)
    if sinks is not None:  # gpt-oss: one more logit column with no value
        s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], s.shape[:-1] + (1,))], -1)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    p = e / np.where(z > 0, z, 1.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def _ref_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _ref_rope_half(x, pos, theta=10000.0):
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)
    sin = np.concatenate([np.sin(ang)] * 2, -1)
    rot = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def _ref_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _ref_layer(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


_TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3}


def _check_backend(b: _Backend, rng: np.random.Generator) -> list[tuple[str, str, float, bool]]:
    import arrayattn as aa

    rows = []
    # float16 is not in the standard: array-api-strict has none; JAX's is checked too.
    dtypes = [dt for dt in ("float64", "float32", "float16") if hasattr(b.xp, dt)]
    B, Hq, Hkv, L, S, E = 2, 4, 2, 7, 9, 16
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, E))
    mask = rng.random((L, S)) > 0.3
    sinks = rng.standard_normal(Hq)
    slopes = 2.0 ** -np.arange(1.0, Hq + 1)
    x = rng.standard_normal((3, L, E))
    w = rng.standard_normal(E)
    bias = rng.standard_normal(E)
    pos = np.arange(L, dtype=np.float64)
    for dt in dtypes:
        ndt = np.dtype(dt)
        xdt = getattr(b.xp, dt)

        def arr(a, xdt=xdt, ndt=ndt):
            return b.asarray(a.astype(ndt))

        def rounded(a, ndt=ndt):
            return a.astype(ndt).astype(np.float64)

        cases: list[tuple[str, Any, np.ndarray]] = []
        cases.append(
            (
                "sdpa causal bottom_right+GQA",
                aa.scaled_dot_product_attention(
                    arr(q),
                    arr(k),
                    arr(v),
                    is_causal=True,
                    enable_gqa=True,
                    causal_align="bottom_right",
                ),
                _ref_attention(
                    rounded(q), rounded(k), rounded(v), None, S - L, Hq // Hkv, 1 / math.sqrt(E)
                ),
            )
        )
        cases.append(
            (
                "sdpa bool mask",
                aa.scaled_dot_product_attention(
                    arr(q), arr(k), arr(v), b.asarray(mask), enable_gqa=True
                ),
                _ref_attention(
                    rounded(q), rounded(k), rounded(v), mask, None, Hq // Hkv, 1 / math.sqrt(E)
                ),
            )
        )
        cases.append(
            (
                "sdpa sinks+ALiBi causal",
                aa.scaled_dot_product_attention(
                    arr(q),
                    arr(k),
                    arr(v),
                    is_causal=True,
                    enable_gqa=True,
                    causal_align="bottom_right",
                    sinks=arr(sinks),
                    alibi_slopes=arr(slopes),
                ),
                _ref_attention(
                    rounded(q),
                    rounded(k),
                    rounded(v),
                    None,
                    S - L,
                    Hq // Hkv,
                    1 / math.sqrt(E),
                    rounded(sinks),
                    rounded(slopes),
                ),
            )
        )
        cases.append(("softmax", aa.softmax(arr(x)), _ref_softmax(rounded(x))))
        freqs = aa.rope_frequencies(
            E, b.asarray(pos), dtype=b.xp.float64 if dt == "float64" else None
        )
        cases.append(
            (
                "rope half",
                aa.apply_rope(arr(x), freqs, layout="half"),
                _ref_rope_half(rounded(x), pos),
            )
        )
        cases.append(
            ("rms_norm", aa.rms_norm(arr(x), arr(w)), _ref_rms(rounded(x), rounded(w), 1e-6))
        )
        cases.append(
            (
                "layer_norm",
                aa.layer_norm(arr(x), arr(w), arr(bias)),
                _ref_layer(rounded(x), rounded(w), rounded(bias), 1e-5),
            )
        )
        cases.append(("split/merge heads", aa.merge_heads(aa.split_heads(arr(x), 4)), rounded(x)))
        for name, got, want in cases:
            err = float(np.max(np.abs(b.to_numpy(got).astype(np.float64) - want)))
            scale = float(np.max(np.abs(want))) or 1.0
            rel = err / scale
            # angles in float32 carry ~1e-6 * position of phase error by design
            tol = _TOL[dt] * (4 if name == "rope half" else 1)
            rows.append((name, dt, rel, rel <= tol))
    rows.append(_check_gradient(b, rng))
    return rows


def _check_gradient(b: _Backend, rng: np.random.Generator) -> tuple[str, str, float, bool]:
    """vjp of attention (causal, GQA, softcap) against central finite differences."""
    import arrayattn as aa

    q = rng.standard_normal((1, 2, 3, 4))
    k = rng.standard_normal((1, 1, 4, 4))
    v = rng.standard_normal((1, 1, 4, 4))
    do = rng.standard_normal((1, 2, 3, 4))
    opts: dict[str, Any] = dict(
        is_causal=True, enable_gqa=True, softcap=2.0, causal_align="bottom_right"
    )

    def f(qq):
        out = aa.scaled_dot_product_attention(b.asarray(qq), b.asarray(k), b.asarray(v), **opts)
        return float(np.sum(b.to_numpy(out) * do))

    _, pullback = aa.vjp(
        aa.scaled_dot_product_attention, b.asarray(q), b.asarray(k), b.asarray(v), **opts
    )
    dq = b.to_numpy(pullback(b.asarray(do))[0])
    fd = np.zeros_like(q)
    h = 1e-6
    for idx in np.ndindex(q.shape):
        e = np.zeros_like(q)
        e[idx] = h
        fd[idx] = (f(q + e) - f(q - e)) / (2 * h)
    err = float(np.max(np.abs(dq - fd)))
    return ("vjp sdpa dq vs finite diff", "float64", err, err < 1e-6)


def _time(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, float, float]:
    """``(min, median, max)`` seconds of ``fn()`` over ``repeats`` rounds after a warm-up:
    on a shared machine single medians swing, and the spread shows by how much."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times)), max(times)


def _ms(t: tuple[float, float, float]) -> str:
    """``median (min-max)`` in milliseconds."""
    return f"{t[1] * 1e3:.1f} ({t[0] * 1e3:.1f}-{t[2] * 1e3:.1f})"


def _timing_table(
    rng: np.random.Generator,
    shape: tuple[int, int, int, int] = (1, 8, 1024, 64),
    repeats: int = 5,
) -> list[str]:
    import arrayattn as aa

    B, H, L, D = shape
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
    flops = 4 * B * H * L * L * D
    lines = [
        f"timing on NumPy, float32, B={B} H={H} L=S={L} D={D}: median (min-max) ms over "
        f"{repeats} rounds (fwd+bwd: {min(3, repeats)})",
        f"{'implementation':<16}{'causal':<8}{'fwd ms':>22}{'GFLOP/s':>9}{'fwd+bwd ms':>24}",
    ]
    peers: list[tuple[str, Callable[..., Any]]] = [
        (
            name,
            lambda c, n=name: aa.scaled_dot_product_attention(
                q, k, v, is_causal=c, implementation=n
            ),
        )
        for name in aa.implementations()
        # Paths for other array types (CuPy's fused kernels, Dask's blockwise graph)
        # decline NumPy inputs; this table times what runs on these arrays.
        if name not in ("fused", "dask")
    ]
    for name, fwd in peers:
        for causal in (False, True):
            t = _time(functools.partial(fwd, causal), repeats=repeats)

            def fwd_bwd(name=name, causal=causal):
                out, pb = aa.vjp(
                    aa.scaled_dot_product_attention, q, k, v, is_causal=causal, implementation=name
                )
                return pb(out)

            tb = _time(fwd_bwd, repeats=min(3, repeats))
            f = flops / (2 if causal else 1)
            lines.append(
                f"{name:<16}{causal!s:<8}{_ms(t):>22}{f / t[1] / 1e9:9.1f}{_ms(tb):>24}"
            )
    if importlib.util.find_spec("torch") is not None:
        import torch

        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        for causal in (False, True):
            sdpa = torch.nn.functional.scaled_dot_product_attention
            t = _time(functools.partial(sdpa, tq, tk, tv, is_causal=causal), repeats=repeats)
            f = flops / (2 if causal else 1)
            lines.append(f"{'torch sdpa':<16}{causal!s:<8}{_ms(t):>22}{f / t[1] / 1e9:9.1f}")
    return lines


class _Progress:
    """One line per step on stderr; on a terminal the line is rewritten in place."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def step(self, text: str) -> None:
        if self.tty:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arrayattn",
        description="arrayattn's main job: list the array libraries and devices found, check "
        "every op on each against a float64 reference, and time attention on NumPy "
        "(no GPU needed; CuPy is checked when a device exists).",
    )
    p.add_argument(
        "--quick", action="store_true", help="the checks only, without the timing table"
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends to check (default: every one found), e.g. numpy,torch",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timing rounds per implementation (default 5)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Print backends, check each op on each backend, print a timing table (unless
    ``--quick``). Returns a process exit code: 0 when every check passes, 1 when one
    fails, 2 for bad arguments (``--help`` lists them)."""
    import arrayattn as aa

    args = _parser().parse_args(argv)
    if args.repeats < 1:
        print(f"--repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    backends = available_backends()
    found = [b.name for b in backends]
    if args.backends:
        wanted = [n.strip() for n in args.backends.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in found]
        if unknown:
            print(
                f"--backends: {', '.join(unknown)} not found here; found: {', '.join(found)}",
                file=sys.stderr,
            )
            return 2
        backends = [b for b in backends if b.name in wanted]
    print(f"arrayattn {aa.__version__}")
    print("backends found: " + ", ".join(f"{b.name} ({b.device})" for b in available_backends()))
    print("implementations: " + ", ".join(aa.implementations()))
    failures = 0
    progress = _Progress()
    rows_out: list[str] = []
    for b in backends:
        progress.step(f"checking {b.name} ...")
        try:
            rows = _check_backend(b, rng)
        except Exception as exc:  # report and go on: one broken backend is one failure
            rows_out.append(
                f"{b.name:<26}{'(error)':<32}{'':<9}{'':>10}  FAIL {type(exc).__name__}: {exc}"
            )
            failures += 1
            continue
        for name, dt, err, ok in rows:
            failures += not ok
            rows_out.append(f"{b.name:<26}{name:<32}{dt:<9}{err:10.2e}  {'ok' if ok else 'FAIL'}")
    timing: list[str] = []
    if not args.quick:
        progress.step("timing attention on NumPy ...")
        timing = _timing_table(rng, repeats=args.repeats)
    progress.close()
    print(f"\n{'backend':<26}{'check':<32}{'dtype':<9}{'rel err':>10}  ok")
    for line in rows_out:
        print(line)
    if timing:
        print()
        for line in timing:
            print(line)
    print(f"\n{'all checks passed' if failures == 0 else f'{failures} check(s) FAILED'}")
    return 1 if failures else 0
