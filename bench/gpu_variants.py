#!/usr/bin/env python
"""Compile and load every CUDA kernel variant through CuPy, in parallel, and read from the
driver what each one costs: registers, local memory (stack and spills), static and
dynamic shared memory, and resident blocks per SM.

The variants are the ones the CPU compile check knows (``.ci/compile_kernels.py``'s
forward list, ``COMPILE_VARIANTS`` of ``arrayattn.attention.cuda.backward`` and ``.decode``);
each is loaded exactly as the library loads it
(``arrayattn.attention.cuda._loader.get_kernel``, with the launch's dynamic shared memory), so
this also fills CuPy's on-disk kernel cache for the processes that follow.

Prints a Markdown table (and writes it to ``--out``). Exit status 1 when a variant fails
to compile or load, or cannot keep one block resident.

Usage (on a GPU machine)::

    python3 bench/gpu_variants.py --jobs 12 --out variants.md
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Variant:
    source: str
    name: str
    threads: int
    smem: int  # dynamic shared memory of the launch (bytes)


def _forward_variants() -> list[Variant]:
    path = ROOT / ".ci" / "compile_kernels.py"
    spec = importlib.util.spec_from_file_location("compile_kernels", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compile_kernels"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    from arrayattn.attention.cuda.tiles import tile_config

    out = []
    for name, kind, d, mt in mod.forward_variants():
        cfg = tile_config(kind, d, mt)
        out.append(Variant("attn_fwd.cu", name, cfg.threads, cfg.smem_bytes))
    # v2 (aa_fwd_tc2, ARRAYATTN_FWD_VARIANT=v2): AaTc2Cfg<D>, D is the second template
    # argument; v3's aa_fwd_tf32: AaTf32Cfg<D>, D the first
    from arrayattn.attention.cuda.tiles import COMPILE_VARIANTS, tile_config_tf32, tile_config_v2

    for source, names in COMPILE_VARIANTS.items():
        for name in names:
            args = name.split("<")[1].split(",")
            if name.startswith("aa_fwd_tf32<"):
                cfg = tile_config_tf32(int(args[0]))
            else:
                cfg = tile_config_v2(int(args[1]))
            out.append(Variant(source, name, cfg.threads, cfg.smem_bytes))
    return out


def _backward_variants() -> list[Variant]:
    from arrayattn.attention.cuda import backward

    launch: dict[str, tuple[int, int]] = {}
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in (32, 64, 96, 128, 256):
            for variant in getattr(backward, "VARIANTS", ("v1",)):  # ARRAYATTN_BWD_VARIANT
                plans = [backward.backward_plan(kind, d, d, variant=variant)]
                if hasattr(backward, "flex_plan"):  # the block-mask (FLEX) instantiations
                    plans.append(backward.flex_plan(kind, d, d, variant=variant))
                for plan in plans:
                    if plan is None:
                        continue
                    launch.setdefault(plan.dkdv, (plan.dkdv_threads, plan.dkdv_smem))
                    launch.setdefault(plan.dq, (plan.dq_threads, plan.dq_smem))
    # every compiled plan, the opt-in ones (head dim 256 on tensor cores) included
    for plan in getattr(backward, "_all_plans", list)():
        launch.setdefault(plan.dkdv, (plan.dkdv_threads, plan.dkdv_smem))
        launch.setdefault(plan.dq, (plan.dq_threads, plan.dq_smem))
    out = []
    for source, names in backward.COMPILE_VARIANTS.items():
        for name in names:
            threads, smem = launch.get(name, (256, 0))
            out.append(Variant(source, name, threads, smem))
    return out


def _decode_variants() -> list[Variant]:
    from arrayattn.attention.cuda import decode

    launch: dict[str, tuple[int, int]] = {}
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in decode.HEAD_DIMS:
            for rows in (1, 2, 4, 8):
                for variant in decode.VARIANTS:
                    plan = decode.decode_plan(kind, d, d, rows, variant=variant)
                    assert plan is not None
                    launch.setdefault(plan.split, (plan.threads, plan.smem))
                    launch.setdefault(plan.merge, (plan.threads, plan.merge_smem))
    return [
        Variant(source, name, *launch[name])
        for source, names in decode.COMPILE_VARIANTS.items()
        for name in names
    ]


def all_variants() -> list[Variant]:
    return _forward_variants() + _backward_variants() + _decode_variants()


def load_one(v: Variant) -> dict:
    """Compile and load ``v`` on device 0; the driver's figures for it."""
    import cupy

    from arrayattn.attention.cuda import _loader

    row: dict = {"source": v.source, "name": v.name, "threads": v.threads, "smem": v.smem}
    t0 = time.perf_counter()
    try:
        k = _loader.get_kernel(v.source, v.name, v.smem)
        attrs = k.attributes
        row.update(
            ok=True,
            regs=attrs.get("num_regs"),
            local=attrs.get("local_size_bytes"),
            static_smem=attrs.get("shared_size_bytes"),
            max_dyn_smem=attrs.get("max_dynamic_shared_size_bytes"),
        )
        try:
            from cupy_backends.cuda.api import driver

            row["blocks_per_sm"] = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                k.kernel.ptr, v.threads, v.smem
            )
        except Exception as exc:  # noqa: BLE001 - report, do not fail the table
            row["blocks_per_sm"] = f"? ({type(exc).__name__})"
    except Exception as exc:  # noqa: BLE001
        text = str(exc).strip().splitlines()
        row.update(ok=False, error=f"{type(exc).__name__}: {' | '.join(text[-6:])[:600]}")
    cupy.cuda.Device().synchronize()
    row["seconds"] = time.perf_counter() - t0
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| source | variant | threads | regs | local B | static smem | dyn smem | "
        "blocks/SM | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("ok"):
            lines.append(
                f"| {r['source']} | `{r['name']}` | {r['threads']} | FAILED: "
                f"{r.get('error', '?')} | | | | | {r['seconds']:.1f} |"
            )
            continue
        lines.append(
            f"| {r['source']} | `{r['name']}` | {r['threads']} | {r['regs']} | {r['local']} | "
            f"{r['static_smem']} | {r['smem']} | {r['blocks_per_sm']} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--list", action="store_true", help="list the variants and exit (no GPU)")
    args = ap.parse_args(argv)
    variants = all_variants()
    if args.list:
        for v in variants:
            print(f"{v.source}\t{v.name}\t{v.threads}\t{v.smem}")
        print(f"{len(variants)} variants")
        return 0
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        print(f"no CUDA device through CuPy ({type(exc).__name__}: {exc})")
        return 1
    t0 = time.perf_counter()
    rows: list[dict] = []
    ctx = mp.get_context("spawn")  # CUDA cannot be forked into workers
    with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(load_one, v): v for v in variants}
        for fut in cf.as_completed(futures):
            v = futures[fut]
            try:
                row = fut.result()
            except Exception as exc:  # noqa: BLE001 - a worker died
                row = {"source": v.source, "name": v.name, "threads": v.threads,
                       "smem": v.smem, "ok": False, "seconds": 0.0,
                       "error": f"worker died: {type(exc).__name__}: {exc}"}  # fmt: skip
            rows.append(row)
            status = "ok" if row.get("ok") else "FAILED"
            print(f"{status} {row['seconds']:.1f}s {v.source} {v.name}", flush=True)
    order = {(v.source, v.name): i for i, v in enumerate(variants)}
    rows.sort(key=lambda r: order[(r["source"], r["name"])])
    text = table(rows)
    bad = [r for r in rows if not r.get("ok")]
    no_fit = [r for r in rows if r.get("ok") and r.get("blocks_per_sm") == 0]
    summary = (
        f"{len(rows)} variants in {time.perf_counter() - t0:.1f} s: {len(bad)} failed, "
        f"{len(no_fit)} with no resident block, "
        f"{sum(1 for r in rows if r.get('ok') and (r.get('local') or 0) > 0)} with local memory"
    )
    print(text)
    print(summary)
    if args.out is not None:
        args.out.write_text(text + "\n\n" + summary + "\n")
    return 1 if (bad or no_fit) else 0


if __name__ == "__main__":
    raise SystemExit(main())
