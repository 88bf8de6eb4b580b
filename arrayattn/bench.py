"""CPU attention benchmark: arrayattn against PyTorch SDPA and plain NumPy, in one run.

Run it as ``python -m arrayattn.bench`` or ``python bench/cpu_bench.py`` (the same code).
Importing ``arrayattn`` never imports this module, and this module imports nothing heavy
(no torch, no matplotlib) until :func:`main` runs.

For each shape it measures, with the peers interleaved round by round so that a machine
whose load changes affects them alike:

- forward time and forward+backward time (``arrayattn.vjp`` + pullback; PyTorch autograd
  through ``scaled_dot_product_attention``), the median of ``--repeats`` rounds after one
  warm-up;
- GFLOP/s with FlashAttention's counting: ``4 * B * H * L * S * D`` forward, half of it
  for causal, backward 2.5 times the forward;
- the time ratio to PyTorch (below 1 is faster than PyTorch);
- peak memory of one forward+backward: ``tracemalloc`` for the NumPy-based peers, the
  growth of the peak RSS (in a subprocess) for PyTorch.

``--long`` adds FlashAttention's long-sequence case (L = 32768, H = 4, D = 64, causal,
``implementation="auto"``) and reports its peak memory growth beyond the inputs.

Examples:
    ```bash
    python -m arrayattn.bench --quick
    python -m arrayattn.bench --repeats 5 --append-results --plot bench.png
    ```
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["main", "Shape", "DEFAULT_SHAPES", "QUICK_SHAPES", "LONG_SHAPE"]


@dataclass(frozen=True)
class Shape:
    """One benchmark case: ``(B, H, L, D)`` self-attention, optionally causal."""

    B: int
    H: int
    L: int
    D: int
    causal: bool = False

    @property
    def label(self) -> str:
        c = ", causal" if self.causal else ""
        return f"B={self.B} H={self.H} L={self.L} D={self.D}{c}"

    def flops_forward(self) -> float:
        f = 4.0 * self.B * self.H * self.L * self.L * self.D
        return f / 2 if self.causal else f

    def flops_forward_backward(self) -> float:
        return 3.5 * self.flops_forward()


DEFAULT_SHAPES = (
    Shape(1, 16, 2048, 64),
    Shape(1, 8, 4096, 64, causal=True),
    Shape(4, 8, 1024, 128),
)
QUICK_SHAPES = (Shape(1, 4, 256, 32), Shape(1, 2, 384, 32, causal=True))
LONG_SHAPE = Shape(1, 4, 32768, 64, causal=True)
LONG_MEMORY_TARGET_MIB = 512
# The composed path and the NumPy baseline hold whole L x S matrices (several at once in
# the backward); they are skipped above this many score elements.
DENSE_LIMIT_ELEMENTS = 1 << 28


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------
class Progress:
    """Progress on stderr: a tqdm bar when installed and stderr is a terminal, else one
    line per step."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.started = time.perf_counter()
        self._bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, file=sys.stderr, unit="step", leave=False)
            except ImportError:
                self._bar = None

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(text)
            self._bar.update(1)
            return
        elapsed = time.perf_counter() - self.started
        print(f"[{self.done}/{self.total} {elapsed:6.1f}s] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------------------
# Peers
# ---------------------------------------------------------------------------------------
@dataclass
class Peer:
    """A contender: builds ``forward()`` and ``forward_backward()`` callables for a shape."""

    name: str
    setup: Callable[[Shape, Any], tuple[Callable[[], Any], Callable[[], Any]]]
    memory: str = "tracemalloc"  # or "rss"
    skip: Callable[[Shape], str | None] = lambda shape: None


# A peer's setup gives its forward and its forward+backward, each a call with no arguments.
_Calls = tuple[Callable[[], Any], Callable[[], Any]]


def _inputs(shape: Shape, dtype: Any, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    dims = (shape.B, shape.H, shape.L, shape.D)
    q, k, v = (rng.standard_normal(dims, dtype=np.float32).astype(dtype) for _ in range(3))
    d_out = rng.standard_normal(dims, dtype=np.float32).astype(dtype)
    return q, k, v, d_out


def _arrayattn_peer(implementation: str) -> Peer:
    def setup(shape: Shape, data: Any) -> _Calls:
        import arrayattn as aa

        q, k, v, d_out = data

        def forward():
            return aa.scaled_dot_product_attention(
                q, k, v, is_causal=shape.causal, implementation=implementation
            )

        def forward_backward():
            _, pullback = aa.vjp(
                aa.scaled_dot_product_attention,
                q,
                k,
                v,
                is_causal=shape.causal,
                implementation=implementation,
            )
            return pullback(d_out)

        return forward, forward_backward

    def skip(shape: Shape) -> str | None:
        if implementation == "composed" and shape.B * shape.H * shape.L**2 > DENSE_LIMIT_ELEMENTS:
            return "L x S matrices too large"
        return None

    return Peer(f"arrayattn {implementation}", setup, skip=skip)


def _numpy_baseline_peer() -> Peer:
    """Plain NumPy attention as a user would write it: whole score matrices."""

    def setup(shape: Shape, data: Any) -> _Calls:
        import numpy as np

        q, k, v, d_out = data
        scale = 1.0 / math.sqrt(shape.D)
        if shape.causal:
            blocked = np.triu(np.ones((shape.L, shape.L), dtype=bool), k=1)

        def probs():
            s = (q @ np.swapaxes(k, -1, -2)) * scale
            if shape.causal:
                s = np.where(blocked, -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            return p / p.sum(axis=-1, keepdims=True)

        def forward():
            return probs() @ v

        def forward_backward():
            p = probs()
            out = p @ v
            dv = np.swapaxes(p, -1, -2) @ d_out
            dp = d_out @ np.swapaxes(v, -1, -2)
            ds = p * (dp - (d_out * out).sum(axis=-1, keepdims=True)) * scale
            return ds @ k, np.swapaxes(ds, -1, -2) @ q, dv

        return forward, forward_backward

    def skip(shape: Shape) -> str | None:
        if shape.B * shape.H * shape.L**2 > DENSE_LIMIT_ELEMENTS:
            return "L x S matrices too large"
        return None

    return Peer("numpy baseline", setup, skip=skip)


def _torch_peer() -> Peer:
    def setup(shape: Shape, data: Any) -> _Calls:
        import torch

        q, k, v, d_out = (torch.from_numpy(x) for x in data)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def forward():
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=shape.causal)

        gq, gk, gv = (x.clone().requires_grad_(True) for x in (q, k, v))

        def forward_backward():
            out = sdpa(gq, gk, gv, is_causal=shape.causal)
            out.backward(d_out)
            grads = (gq.grad, gk.grad, gv.grad)
            gq.grad = gk.grad = gv.grad = None
            return grads

        return forward, forward_backward

    return Peer("torch sdpa", setup, memory="rss")


def torch_version() -> str | None:
    """The installed PyTorch version, or ``None``."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def available_peers(names: list[str] | None = None) -> list[Peer]:
    """The peers of this run: arrayattn auto / chunked (when registered) / composed,
    PyTorch SDPA (when installed) and the NumPy baseline; ``names`` filters them."""
    import arrayattn as aa

    peers = [_arrayattn_peer("auto")]
    if "chunked" in aa.implementations():
        peers.append(_arrayattn_peer("chunked"))
    peers.append(_arrayattn_peer("composed"))
    if torch_version() is not None:
        peers.append(_torch_peer())
    peers.append(_numpy_baseline_peer())
    if names:
        wanted = {n.strip() for n in names}
        peers = [p for p in peers if p.name in wanted or wanted & set(p.name.split())]
    return peers


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------
@dataclass
class Result:
    peer: str
    forward_s: float | None = None
    forward_backward_s: float | None = None
    peak_mib: float | None = None
    memory_method: str = ""
    note: str = ""
    forward_all: list[float] = field(default_factory=list)
    forward_backward_all: list[float] = field(default_factory=list)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peak_tracemalloc(fn: Callable[[], Any]) -> float:
    """Peak bytes allocated (and traced) while ``fn`` runs, in MiB."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return (peak - base) / 2**20


_RSS_CHILD = r"""
import json, resource, sys
sys.path[:0] = json.loads(sys.argv[2])
from arrayattn import bench
spec = json.loads(sys.argv[1])
shape = bench.Shape(**spec["shape"])
import numpy as np
data = bench._inputs(shape, np.dtype(spec["dtype"]))
peer = {p.name: p for p in bench.available_peers()}[spec["peer"]]
_, fb = peer.setup(shape, data)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = rss()
fb()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": max(0, peak - before)}))
"""


def _peak_rss_subprocess(peer: str, shape: Shape, dtype: str) -> float | None:
    """Peak RSS growth (MiB) of one forward+backward in a fresh process (Linux only)."""
    if not os.path.exists("/proc/self/statm"):
        return None
    spec = {"shape": shape.__dict__, "dtype": dtype, "peer": peer}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, json.dumps(spec), json.dumps(sys.path)],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])["growth"] / 2**20
    except (subprocess.SubprocessError, ValueError, KeyError, IndexError):
        return None


def measure_shape(
    shape: Shape,
    peers: list[Peer],
    repeats: int,
    dtype: str,
    progress: Progress,
    memory: bool = True,
) -> list[Result]:
    """Time every peer on ``shape`` (interleaved rounds) and measure its peak memory."""
    import numpy as np

    data = _inputs(shape, np.dtype(dtype))
    results = {p.name: Result(p.name) for p in peers}
    runnable = []
    for p in peers:
        reason = p.skip(shape)
        if reason:
            results[p.name].note = f"skipped: {reason}"
            continue
        fwd, fb = p.setup(shape, data)
        progress.step(f"{shape.label}: warm-up {p.name}")
        fwd()
        fb()
        runnable.append((p, fwd, fb))
    for r in range(repeats):
        for p, fwd, fb in runnable:
            gc.collect()
            results[p.name].forward_all.append(_timed(fwd))
            gc.collect()
            results[p.name].forward_backward_all.append(_timed(fb))
            progress.step(f"{shape.label}: round {r + 1}/{repeats} {p.name}")
    for p, _fwd, fb in runnable:
        res = results[p.name]
        res.forward_s = statistics.median(res.forward_all)
        res.forward_backward_s = statistics.median(res.forward_backward_all)
        if not memory:
            continue
        if p.memory == "tracemalloc":
            res.peak_mib = _peak_tracemalloc(fb)
            res.memory_method = "tracemalloc"
        else:
            res.peak_mib = _peak_rss_subprocess(p.name, shape, dtype)
            res.memory_method = "peak RSS growth"
        progress.step(f"{shape.label}: memory {p.name}")
    return [results[p.name] for p in peers]


def measure_long(dtype: str, progress: Progress) -> dict[str, Any]:
    """L = 32768, H = 4, D = 64 causal forward+backward through ``implementation="auto"``:
    time and peak traced memory beyond the inputs."""
    import numpy as np

    import arrayattn as aa

    shape = LONG_SHAPE
    q, k, v, d_out = _inputs(shape, np.dtype(dtype))
    progress.step(f"{shape.label}: forward+backward (auto, tracemalloc)")
    # Passing the implementation explicitly documents which path "auto" picked.
    spec_impl = _auto_choice(q, k, v, shape)

    def fb():
        _, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, is_causal=True)
        return pullback(d_out)

    t0 = time.perf_counter()
    peak = _peak_tracemalloc(fb)
    elapsed = time.perf_counter() - t0
    return {
        "shape": shape,
        "implementation": spec_impl,
        "forward_backward_s": elapsed,
        "peak_mib": peak,
        "gflops": shape.flops_forward_backward() / elapsed / 1e9,
        "target_mib": LONG_MEMORY_TARGET_MIB,
    }


def _auto_choice(q: Any, k: Any, v: Any, shape: Shape) -> str:
    from arrayattn.attention.registry import auto_choice
    from arrayattn.attention.spec import make_spec

    spec = make_spec(q, k, v, None, 0.0, shape.causal, None, False, "top_left", None, None, None)
    return auto_choice(spec)


# ---------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def format_table(shape: Shape, results: list[Result], dtype: str) -> str:
    """A Markdown table of one shape's results."""
    ref = next((r for r in results if r.peer == "torch sdpa" and r.forward_s), None)
    head = (
        f"#### {shape.label} ({dtype})\n\n"
        "| peer | fwd ms | fwd GFLOP/s | fwd / torch | fwd+bwd ms | fwd+bwd GFLOP/s "
        "| fwd+bwd / torch | peak MiB (fwd+bwd) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in results:
        fwd, fwd_bwd = r.forward_s, r.forward_backward_s  # measured together, or neither
        if fwd is None or fwd_bwd is None:
            lines.append(f"| {r.peer} | {r.note or '-'} | | | | | | |")
            continue
        f_gf = shape.flops_forward() / fwd / 1e9
        fb_gf = shape.flops_forward_backward() / fwd_bwd / 1e9
        f_ratio = fwd / ref.forward_s if ref and ref.forward_s else None
        fb_ratio = fwd_bwd / ref.forward_backward_s if ref and ref.forward_backward_s else None
        mem = _fmt(r.peak_mib, ".1f")
        if r.peak_mib is not None and r.memory_method == "peak RSS growth":
            mem += " (RSS)"
        lines.append(
            f"| {r.peer} | {fwd * 1e3:.1f} | {f_gf:.1f} | {_fmt(f_ratio, '.2f')} | "
            f"{fwd_bwd * 1e3:.1f} | {fb_gf:.1f} | {_fmt(fb_ratio, '.2f')} | {mem} |"
        )
    return head + "\n".join(lines) + "\n"


def format_long(long: dict[str, Any]) -> str:
    s = long["shape"]
    ok = "meets" if long["peak_mib"] < long["target_mib"] else "MISSES"
    return (
        f'#### long sequence: {s.label}, forward+backward, implementation="auto" '
        f"(ran {long['implementation']!r})\n\n"
        f"- time {long['forward_backward_s']:.1f} s ({long['gflops']:.1f} GFLOP/s, "
        f"under tracemalloc)\n"
        f"- peak traced memory beyond the inputs: {long['peak_mib']:.1f} MiB "
        f"({ok} the < {long['target_mib']} MiB target)\n"
    )


def machine_description() -> dict[str, str]:
    """CPU model, cores, library versions and BLAS of this machine."""
    import numpy as np

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    blas = "unknown"
    try:
        from threadpoolctl import threadpool_info

        blas = "; ".join(
            f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture', '?')}, "
            f"{i.get('num_threads')} threads)"
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        )
    except ImportError:
        try:
            cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
            blas = f"{cfg.get('name')} {cfg.get('version')} (threadpoolctl not installed)"
        except Exception:
            pass
    import arrayattn as aa
    from arrayattn.attention.threads import num_threads

    try:
        load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "?"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical, {usable} usable",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch_version() or "not installed",
        "arrayattn": aa.__version__,
        "blas": blas,
        "fast path threads": str(num_threads()),
        "load average at start": load,
    }


def format_machine(info: dict[str, str]) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n"


def save_plot(path: str, tables: list[tuple[Shape, list[Result]]]) -> str | None:
    """Bar chart of the time ratios to PyTorch; returns a reason when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, attr, title in (
        (axes[0], "forward_s", "forward"),
        (axes[1], "forward_backward_s", "forward+backward"),
    ):
        labels = [s.label for s, _ in tables]
        peers = [r.peer for r in tables[0][1]] if tables else []
        width = 0.8 / max(1, len(peers))
        for i, peer in enumerate(peers):
            ratios = []
            for _, results in tables:
                ref = next((r for r in results if r.peer == "torch sdpa"), None)
                mine = next((r for r in results if r.peer == peer), None)
                a = getattr(mine, attr, None) if mine else None
                b = getattr(ref, attr, None) if ref else None
                ratios.append(a / b if a and b else float("nan"))
            ax.bar([x + i * width for x in range(len(labels))], ratios, width, label=peer)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=15, fontsize=7)
        ax.set_title(f"{title}: time / PyTorch SDPA time")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def default_results_path() -> Path:
    """``bench/RESULTS.md`` of the source checkout arrayattn runs from, else ``./``."""
    import arrayattn

    repo = Path(arrayattn.__file__).resolve().parents[1]
    if (repo / "bench").is_dir():
        return repo / "bench" / "RESULTS.md"
    return Path("RESULTS.md")


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[Shape]:
    """``"B,H,L,D[,causal];..."`` -> shapes (``causal`` is ``c``, ``causal`` or ``1``)."""
    shapes = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        fields = [f.strip() for f in part.split(",")]
        if len(fields) not in (4, 5):
            raise argparse.ArgumentTypeError(
                f"--shapes entries are B,H,L,D or B,H,L,D,causal; got {part!r}"
            )
        try:
            B, H, L, D = (int(f) for f in fields[:4])
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes sizes must be ints; got {part!r}") from None
        causal = len(fields) == 5 and fields[4].lower() in ("c", "causal", "1", "true")
        shapes.append(Shape(B, H, L, D, causal))
    if not shapes:
        raise argparse.ArgumentTypeError("--shapes is empty")
    return shapes


def set_threads(n: int) -> None:
    """Give every peer ``n`` threads: PyTorch's intra-op pool, BLAS (threadpoolctl, when
    installed) and arrayattn's fast-path pool (``ARRAYATTN_NUM_THREADS``); the RSS
    subprocesses inherit the environment variables."""
    for var in ("ARRAYATTN_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)
    except ImportError:
        pass
    if torch_version() is not None:
        import torch

        torch.set_num_threads(n)


def _sections(args: argparse.Namespace) -> list[str]:
    """The decode / array-API / crossover tables asked for on the command line."""
    from . import bench_sections as sec

    texts = []
    if args.decode:
        results = [sec.measure_decode(d, args.repeats, args.dtype) for d in sec.DECODE_SHAPES]
        texts.append(sec.format_decode(results))
    if args.array_api:
        texts.append(sec.format_array_api(sec.measure_array_api(args.repeats)))
    if args.crossover:
        texts.append(sec.format_crossover(sec.measure_crossover(args.repeats)))
    for text in texts:
        print(text, flush=True)
    return texts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arrayattn.bench",
        description="Benchmark arrayattn's CPU attention against PyTorch SDPA and NumPy.",
    )
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--shapes", type=parse_shapes, help='e.g. "1,16,2048,64;1,8,4096,64,causal"')
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per peer (median)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16"))
    p.add_argument("--peers", help="comma-separated subset, e.g. auto,torch,composed")
    p.add_argument("--long", action="store_true", help="add the L=32768 memory case")
    p.add_argument(
        "--decode",
        action="store_true",
        help="add decode rows: GB/s of K/V and the ratio to PyTorch SDPA (GQA 32/8, D=128)",
    )
    p.add_argument(
        "--array-api",
        action="store_true",
        help="add the composed/chunked/auto paths on PyTorch tensors and JAX arrays "
        "against each library's own attention",
    )
    p.add_argument(
        "--crossover",
        action="store_true",
        help='add the implementation="auto" crossover sweep on NumPy arrays',
    )
    p.add_argument(
        "--only-sections",
        action="store_true",
        help="run only the sections asked for (--decode/--array-api/--crossover/--long), "
        "not the prefill shapes",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--plot", metavar="PATH", help="save a ratio plot (needs matplotlib)")
    p.add_argument("--append-results", action="store_true", help="append to bench/RESULTS.md")
    p.add_argument("--results", metavar="PATH", help="file for --append-results")
    p.add_argument("--note", default="", help="a line of context written with the results")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument(
        "--threads",
        type=int,
        help="threads for every peer (PyTorch, BLAS, the fast path's pool); default: theirs",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints Markdown tables to stdout, progress to stderr."""
    args = build_parser().parse_args(argv)
    # PyTorch's idle OpenMP threads must not spin while the next peer runs (set before
    # torch is imported; a user's own setting wins).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    shapes = args.shapes or list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    if args.only_sections:
        shapes = []
    peers = available_peers(args.peers.split(",") if args.peers else None)
    if not peers:
        raise SystemExit(f"--peers {args.peers!r} matches no peer")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        set_threads(args.threads)
    machine = machine_description()
    if args.threads is not None:
        machine["threads (--threads)"] = str(args.threads)

    n_steps = 0
    for s in shapes:
        live = sum(1 for p in peers if not p.skip(s))
        n_steps += live * (1 + args.repeats + (0 if args.no_memory else 1))
    progress = Progress(n_steps + (1 if args.long else 0), enabled=not args.quiet)

    tables = []
    out = []
    for s in shapes:
        results = measure_shape(s, peers, args.repeats, args.dtype, progress, not args.no_memory)
        tables.append((s, results))
        table = format_table(s, results, args.dtype)
        out.append(table)
        print(table, flush=True)
    if args.long:
        text = format_long(measure_long(args.dtype, progress))
        out.append(text)
        print(text, flush=True)
    out.extend(_sections(args))
    progress.close()
    try:
        machine["load average at end"] = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        pass

    header = (
        f"### Run of {machine['date']}\n\n"
        + (f"{args.note}\n\n" if args.note else "")
        + format_machine(machine)
        + f"- repeats: {args.repeats} (median), peers interleaved round by round\n\n"
    )
    print(header)
    if args.plot:
        reason = save_plot(args.plot, tables)
        print(f"plot: {reason}" if reason else f"plot saved to {args.plot}", file=sys.stderr)
    if args.append_results:
        path = Path(args.results) if args.results else default_results_path()
        new = not path.exists()
        with open(path, "a", encoding="utf-8") as f:
            if new:
                f.write("# arrayattn CPU benchmark results\n\n")
                f.write("Appended by `python -m arrayattn.bench --append-results`.\n\n")
            f.write(header + "\n".join(out) + "\n")
        print(f"appended to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
