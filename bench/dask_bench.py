"""Dask scale-out benchmark: attention on a ``dask.distributed`` cluster against one process.

The same causal attention call (float32, inputs persisted on the cluster) runs as a Dask
graph on the cluster (``implementation="auto"`` picks the Dask path) and as one NumPy
call in this process (the NumPy fast path with this process's threads), interleaved and
repeated. Chunks over batch, over heads and over the sequence; forward and
forward+backward. Printed per case: graph build time, new tasks in the graph, median
compute time (from building the graph to its results being on the workers, as the inputs
are; ``--gather`` also brings them to this process; each run on inputs persisted afresh
before its clock starts), the ratio to one process, and each
worker's peak resident memory (high-water mark over the case's runs).

Where the inputs live decides much of the time: Dask runs a task on the worker that
holds all its inputs whenever one does, whatever that worker's backlog. By default a
chunk's q, k and v are made by one task and so live on one worker, as in self-attention,
where one projection of the hidden states' chunk makes all three (``--placement
colocated``). ``--placement independent`` persists each array on its own, so a chunk's
q, k and v land on workers independently (cross-attention inputs from different sources,
or arrays loaded one by one).

Usage::

    python bench/dask_bench.py                       # LocalCluster, 2 processes x 1 thread
    python bench/dask_bench.py --quick               # small shapes, a smoke run
    python bench/dask_bench.py --long                # also causal L=32768, 1.5 GiB workers
    python bench/dask_bench.py --workers 4 --threads-per-worker 2
    python bench/dask_bench.py --placement independent   # q, k, v persisted apart
    python bench/dask_bench.py --scheduler-address tcp://10.0.0.1:8786   # a real cluster
    python bench/dask_bench.py --append-results bench/RESULTS.md

Workers need only arrayattn (and NumPy) installed. On a real cluster the one-process
peer still runs in this (the client's) process.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import arrayattn as aa
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import arrayattn as aa


SETTLE_S = 0.05
"""Untimed pause between persisting a run's inputs (after releasing the previous run's)
and starting its clock."""


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, int, int, int]  # (B, H, L, D)
    chunks: tuple[int, int, int, int]


def cases(length: int, heads: int, dim: int, chunk: int) -> list[Case]:
    """Chunks over batch (B = heads, one head), heads, and the sequence (same work)."""
    return [
        Case("batch", (heads, 1, length, dim), (1, 1, length, dim)),
        Case("heads", (1, heads, length, dim), (1, 1, length, dim)),
        Case("sequence", (1, heads, length, dim), (1, heads, chunk, dim)),
    ]


def _reset_peak_rss(client) -> None:
    """Restart each worker's resident-memory high-water mark from its current size.

    Needed on Linux: a process started by ``fork`` + ``exec`` (multiprocessing's "spawn",
    as Dask's nanny starts workers) inherits the parent's high-water mark, so without it a
    fresh worker reported the client process's size at the time (300-900 MiB after the
    other cases' one-process calls, against 64 MiB resident)."""

    def reset() -> None:  # nested, so it pickles by value (workers need not see bench/)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        except OSError:
            pass  # elsewhere the mark keeps counting from the worker's start

    client.run(reset)


def _peak_rss_mib(client) -> float:
    """The largest worker's resident-memory high-water mark (MiB) since
    :func:`_reset_peak_rss` (or, where it cannot reset, since the worker started)."""

    def peak() -> float:  # nested, so it pickles by value
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0  # kB
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB

    return max(client.run(peak).values())


def _graph_tasks(collections: list[Any]) -> int:
    keys: set = set()
    for c in collections:
        keys.update(dict(c.__dask_graph__()))
    return len(keys)


def persist_inputs(client, qkv: np.ndarray, chunks: tuple, placement: str, name: str) -> list:
    """``[q, k, v]`` (``qkv[0]``, ``qkv[1]``, ``qkv[2]``) as Dask arrays in ``chunks``,
    persisted on the cluster and waited for.

    ``placement="colocated"``: one task makes the q, k and v chunks of each block (as one
    QKV projection of the hidden states' chunk does), so they live on one worker.
    ``"independent"``: each array is persisted on its own, so its chunks land wherever
    Dask puts them, apart from the other arrays' chunks.
    """
    import dask.array as da
    from distributed import wait

    if placement == "colocated":
        stacked = da.from_array(qkv, chunks=(3, *chunks), name=name)
        xs = client.persist([stacked[0], stacked[1], stacked[2]])
    elif placement == "independent":
        xs = [
            client.persist(da.from_array(qkv[n], chunks=chunks, name=f"{name}-{n}"))
            for n in range(3)
        ]
    else:
        raise ValueError(f"placement: expected 'colocated' or 'independent', got {placement!r}")
    wait(xs)
    return list(xs)


def run_case(
    client,
    case: Case,
    backward: bool,
    repeats: int,
    gather: bool = False,
    seed: int = 0,
    placement: str = "colocated",
) -> dict:
    import dask.array as da
    from distributed import wait

    rng = np.random.default_rng(seed)
    # One array holds q, k and v (the same numbers as three draws); the one-process call
    # reads views of it, so the inputs are not kept twice in this process.
    qkv_host = rng.standard_normal((3, *case.shape), dtype=np.float32)
    q, k, v = qkv_host
    runs = itertools.count()

    def persisted_inputs() -> list:
        # Every run gets inputs of its own, persisted (untimed) before its clock starts:
        # the graph is deterministic, so a run on the previous run's inputs would have the
        # previous run's keys (and could be handed its results, or have its tasks
        # cancelled while those are released). Aliasing one persisted copy instead
        # (``map_blocks``) would time a stage of extra tasks that are not attention's.
        xs = persist_inputs(client, qkv_host, case.chunks, placement, f"input-{next(runs)}")
        # Let the previous run's releases reach the scheduler and workers before the
        # clock starts. Before this, the client sent them (2 to 12 release messages)
        # within 0.2 ms after the timed graph, so the scheduler and the workers freed the
        # previous run's keys while the timed graph ran.
        time.sleep(SETTLE_S)
        return xs

    def build(q_, k_, v_) -> list:
        if not backward:
            return [aa.scaled_dot_product_attention(q_, k_, v_, is_causal=True)]
        out, pullback = aa.vjp(aa.scaled_dot_product_attention, q_, k_, v_, is_causal=True)
        return [out, *pullback(da.ones_like(out))]

    def one_process():
        if not backward:
            return aa.scaled_dot_product_attention(q, k, v, is_causal=True)
        out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, is_causal=True)
        return out, pullback(np.ones_like(out))

    _reset_peak_rss(client)
    inputs = persisted_inputs()
    input_keys = {key for x in inputs for key in dict(x.__dask_graph__())}
    t0 = time.perf_counter()
    graph = build(*inputs)
    graph_s = time.perf_counter() - t0
    tasks = _graph_tasks(graph) - len(input_keys)

    def on_cluster(inputs: list) -> float:
        """Seconds from building the graph to its results being on the workers."""
        t0 = time.perf_counter()
        if gather:
            client.compute(build(*inputs), sync=True)
        else:
            wait(client.persist(build(*inputs)))  # released when the futures go
        return time.perf_counter() - t0

    # Warm-up of both (imports, worker pools, Dask's per-task-name duration estimates),
    # then interleaved timed runs.
    one_process()
    on_cluster(inputs)
    single, cluster = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_process()
        single.append(time.perf_counter() - t0)
        inputs = None  # the previous run's inputs are released before new ones are made
        inputs = persisted_inputs()
        cluster.append(on_cluster(inputs))
    peak_mib = _peak_rss_mib(client)
    return {
        "case": case,
        "backward": backward,
        "graph_s": graph_s,
        "tasks": tasks,
        "single_s": statistics.median(single),
        "cluster_s": statistics.median(cluster),
        "ratios": [c / s for c, s in zip(cluster, single, strict=True)],
        "peak_mib": peak_mib,
    }


def long_run(args) -> dict:
    """Causal L=32768 (one head's dense scores: 4 GiB) on workers limited in memory."""
    from distributed import Client, LocalCluster

    length, chunk = args.long_length, args.long_chunk
    case = Case("sequence (long)", (1, 1, length, args.dim), (1, 1, chunk, args.dim))
    with (
        LocalCluster(
            n_workers=args.workers,
            threads_per_worker=args.threads_per_worker,
            processes=True,
            memory_limit=args.long_memory_limit,
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        return run_case(client, case, True, repeats=1, gather=args.gather, placement=args.placement)


def table(rows: list[dict], workers: str) -> str:
    lines = [
        f"| chunks over | pass | shape (B,H,L,D) | chunks | graph | tasks | one process | "
        f"cluster ({workers}) | ratio (median of pairs; all) | peak worker RSS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["case"]
        ratio = statistics.median(r["ratios"])  # of the interleaved pairs
        all_ratios = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {c.name} | {'fwd+bwd' if r['backward'] else 'fwd'} | {c.shape} | "
            f"{c.chunks} | {r['graph_s'] * 1e3:.0f} ms | {r['tasks']} | "
            f"{r['single_s']:.2f} s | {r['cluster_s']:.2f} s | {ratio:.2f} ({all_ratios}) | "
            f"{r['peak_mib']:.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--scheduler-address", default=None, help="use this running cluster")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=2048, help="sequence chunk length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--long", action="store_true", help="also the L=32768 memory run")
    p.add_argument("--long-length", type=int, default=32768)
    p.add_argument("--long-chunk", type=int, default=4096)
    p.add_argument("--long-memory-limit", default="1.5GiB")
    p.add_argument("--cases", default="batch,heads,sequence")
    p.add_argument("--gather", action="store_true", help="time bringing results back too")
    p.add_argument("--lean", action="store_true", help="workers without profiler/GIL monitor")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument(
        "--placement",
        choices=("colocated", "independent"),
        default="colocated",
        help="inputs: a chunk's q, k, v made by one task (as by one QKV projection), "
        "or each array persisted on its own",
    )
    p.add_argument("--append-results", default=None, help="append a section to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.length, args.chunk, args.repeats = 512, 128, 1
        args.long_length, args.long_chunk = 2048, 512

    import dask
    from distributed import Client, LocalCluster

    if args.lean:
        # Worker housekeeping that samples threads while tasks run (stack profiler every
        # 10 ms, GIL contention monitor every 1 ms): off, for LocalClusters started here.
        dask.config.set(
            {
                "distributed.worker.profile.enabled": False,
                "distributed.admin.system-monitor.gil.enabled": False,
            }
        )
    if args.scheduler_address:
        client = Client(args.scheduler_address)
        cluster = None
    else:
        cluster = LocalCluster(
            n_workers=args.workers,
            threads_per_worker=args.threads_per_worker,
            processes=True,
            dashboard_address=None,
        )
        client = Client(cluster)
    info = client.scheduler_info()
    nthreads = [w["nthreads"] for w in info["workers"].values()]
    workers = f"{len(nthreads)} workers x {max(nthreads, default=0)} threads"
    wanted = set(args.cases.split(","))
    rows = []
    try:
        for case in cases(args.length, args.heads, args.dim, args.chunk):
            if case.name not in wanted:
                continue
            for backward in (False, True):
                if ("fwdbwd" if backward else "fwd") not in args.passes.split(","):
                    continue
                rows.append(
                    run_case(
                        client,
                        case,
                        backward,
                        args.repeats,
                        args.gather,
                        placement=args.placement,
                    )
                )
                print(table(rows[-1:], workers).splitlines()[-1], flush=True)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    long_rows = []
    if args.long and not args.scheduler_address:
        long_rows.append(long_run(args))
    text = table(rows, workers)
    print(text)
    if long_rows:
        print(f"\nmemory limit per worker: {args.long_memory_limit}")
        print(table(long_rows, workers))
    if args.append_results:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = [
            f"\n### Dask scale-out run of {now} (`python bench/dask_bench.py`)\n",
            f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
            f"Python {platform.python_version()}; causal, float32; inputs "
            f"{args.placement} (`--placement`).\n",
            text,
        ]
        if long_rows:
            section += [
                f"\nWorkers limited to {args.long_memory_limit} each:\n",
                table(long_rows, workers),
            ]
        with open(args.append_results, "a") as f:
            f.write("\n".join(section) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
