#!/usr/bin/env python
"""``jax.grad`` of attention: ``arrayattn.jax`` against ``jax.nn.dot_product_attention``.

One call, ``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))`` with ``loss = sum(out * w)``
(``w`` a fixed random array, so every output element has its own cotangent), forward and
backward, for each peer:

- ``arrayattn``: ``arrayattn.jax.scaled_dot_product_attention`` (``implementation="auto"``:
  on the CPU platform the NumPy fast path inside ``jax.pure_callback``);
- ``arrayattn-traced``: the same with ``implementation="chunked"``: arrayattn's chunked
  array-API code traced with ``jax.numpy`` and compiled by XLA (what runs off the CPU);
- ``xla``: ``jax.nn.dot_product_attention(..., implementation="xla")`` on the same arrays
  (transposed to its ``(B, T, N, H)`` layout inside the jitted function), JAX's autodiff.

Time: interleaved rounds in one process (each round runs every peer once, in a rotating
order), median and min-max, and the ratio of medians to ``xla``. Memory, each peer in a
fresh subprocess: the peak RSS growth of one compiled call (Linux ``VmHWM`` reset after
compiling, minus the RSS before the call) and XLA's own figure for the compiled program
(``memory_analysis().temp_size_in_bytes``, which cannot see the NumPy memory of a host
callback). ``OMP_WAIT_POLICY=PASSIVE`` is set before anything is imported.

Usage::

    python bench/jax_bridge.py                      # B1 H1 L16384 D64 float32
    python bench/jax_bridge.py --heads 2 --causal
    python bench/jax_bridge.py --quick              # a smoke size (L=512)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

try:
    import arrayattn  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEERS = ("arrayattn", "arrayattn-traced", "xla")


@dataclass(frozen=True)
class Shape:
    """One benchmark call: ``(B, H, L, D)`` query, key and value (``S = L``)."""

    batch: int = 1
    heads: int = 1
    length: int = 16384
    head_dim: int = 64
    causal: bool = False
    dtype: str = "float32"

    @property
    def label(self) -> str:
        causal = ", causal" if self.causal else ""
        return (
            f"B={self.batch} H={self.heads} L=S={self.length} D={self.head_dim} "
            f"{self.dtype}{causal}"
        )


def _inputs(shape: Shape) -> tuple[Any, ...]:
    import jax
    import jax.numpy as jnp

    dims = (shape.batch, shape.heads, shape.length, shape.head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(k, dims, dtype=jnp.dtype(shape.dtype)) for k in keys)


def gradient_fn(peer: str, shape: Shape) -> Any:
    """The jitted ``(q, k, v, w) -> (dq, dk, dv)`` of ``peer``."""
    import jax
    import jax.numpy as jnp

    import arrayattn.jax as aaj

    def attention(q: Any, k: Any, v: Any) -> Any:
        if peer == "xla":
            t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (B, H, L, D) <-> (B, L, H, D)
            out = jax.nn.dot_product_attention(
                t(q), t(k), t(v), is_causal=shape.causal, implementation="xla"
            )
            return t(out)
        implementation = "chunked" if peer == "arrayattn-traced" else "auto"
        return aaj.scaled_dot_product_attention(
            q, k, v, is_causal=shape.causal, implementation=implementation
        )

    def loss(q: Any, k: Any, v: Any, w: Any) -> Any:
        return jnp.sum(attention(q, k, v) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _vm(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(peer: str, shape: Shape) -> dict[str, float]:
    """Compile and run ``peer`` once in this (fresh) process: peak RSS growth of the run
    and XLA's temp bytes, in MiB, and the seconds the compilation took."""
    import jax

    args = _inputs(shape)
    t0 = time.perf_counter()
    compiled = gradient_fn(peer, shape).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    before = _vm("VmRSS")
    jax.block_until_ready(compiled(*args))
    peak = _vm("VmHWM")
    return {
        "rss_mib": max(0, peak - before) / 2**20,
        "xla_temp_mib": temp / 2**20,
        "compile_s": compile_s,
    }


def memory(peer: str, shape: Shape, timeout: float) -> dict[str, float] | str:
    """:func:`child` in a subprocess; a short reason when it failed."""
    if not os.path.exists("/proc/self/clear_refs"):
        return "no /proc (Linux only)"
    cmd = [sys.executable, __file__, "--child", peer, "--shape-json", json.dumps(asdict(shape))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    except subprocess.CalledProcessError as e:
        return "failed: " + (e.stderr.strip().splitlines() or ["?"])[-1][:120]


def timings(peers: list[str], shape: Shape, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each peer over ``rounds`` interleaved rounds (after one
    warm-up call each, which compiles)."""
    import jax

    args = _inputs(shape)
    fns = {p: gradient_fn(p, shape) for p in peers}
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {p: [] for p in peers}
    for r in range(rounds):
        for p in peers[r % len(peers) :] + peers[: r % len(peers)]:
            gc.collect()
            t0 = time.perf_counter()
            jax.block_until_ready(fns[p](*args))
            times[p].append(time.perf_counter() - t0)
    return times


def table(shape: Shape, times: dict[str, list[float]], mem: dict[str, Any]) -> str:
    """The results as a Markdown table (ratios to ``xla`` where it ran)."""
    base_t = statistics.median(times["xla"]) if times.get("xla") else None
    base_m = mem.get("xla") if isinstance(mem.get("xla"), dict) else None
    lines = [
        f"jax.grad (forward + backward), {shape.label}",
        "",
        "| peer | median s | min-max s | time vs xla | peak RSS MiB | RSS vs xla "
        "| XLA temp MiB | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{med / base_t:.2f}x" if base_t else "-"
        m = mem.get(p)
        if isinstance(m, dict):
            rss = f"{m['rss_mib']:.0f}"
            rss_ratio = f"{m['rss_mib'] / base_m['rss_mib']:.3f}x" if base_m else "-"
            temp, comp = f"{m['xla_temp_mib']:.0f}", f"{m['compile_s']:.1f}"
        else:
            rss, rss_ratio, temp, comp = (m or "-"), "-", "-", "-"
        lines.append(
            f"| {p} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {ratio} | {rss} | {rss_ratio} "
            f"| {temp} | {comp} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--length", type=int, help="L = S (default 16384; --quick: 512)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --quick: 2)")
    ap.add_argument("--peers", default="arrayattn,xla", help=f"comma-separated, of {PEERS}")
    ap.add_argument("--no-memory", action="store_true", help="skip the subprocess memory runs")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per memory run")
    ap.add_argument("--quick", action="store_true", help="a smoke size: L=512, 2 rounds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--shape-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        if args.dtype == "float64" or "float64" in (args.shape_json or ""):
            import jax

            jax.config.update("jax_enable_x64", True)
        print(json.dumps(child(args.child, Shape(**json.loads(args.shape_json)))))
        return 0
    if args.length is None:
        args.length = 512 if args.quick else 16384
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    shape = Shape(args.batch, args.heads, args.length, args.head_dim, args.causal, args.dtype)
    if shape.dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        ap.error(f"--peers: unknown {unknown}; choose from {PEERS}")
    import jax

    print(f"{shape.label}; jax {jax.__version__} on {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs, {args.rounds} interleaved rounds", flush=True)  # fmt: skip
    mem: dict[str, Any] = {}
    if not args.no_memory:
        for p in peers:
            mem[p] = memory(p, shape, args.timeout)
            print(f"  memory {p}: {mem[p]}", flush=True)
    print(table(shape, timings(peers, shape, args.rounds), mem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
