#!/usr/bin/env python
"""Compile every CUDA kernel variant for sm_90 and report registers, spills and memory.

For each source under ``arrayattn/attention/cuda`` this writes a wrapper: the source as the
CuPy loader sees it (local headers inlined) plus one host function per template
instantiation that takes the kernel's address, which makes nvcc instantiate exactly the
name expressions ``cupy.RawModule`` is given at run time. Each wrapper is compiled with
``nvcc -arch=sm_90 -cubin -Xptxas -v`` (groups in parallel), ptxas' report is parsed and
a table printed: variant, registers, stack frame, spill stores/loads, dynamic shared
memory.

Exit status: 0 when everything compiled and no hot variant spills; 1 on a spill (or a
missing report) in a hot variant; 2 on a compile error. Without nvcc it prints that the
check was skipped and exits 0.

The backward and decode kernels join the check through ``COMPILE_VARIANTS: dict[str,
list[str]]`` (source file -> name expressions) and ``HOT_VARIANTS: list[str]`` of
``arrayattn/attention/cuda/backward.py`` and ``decode.py``; so do the forward's v2
variants (``tiles.py``).

Usage: ``python .ci/compile_kernels.py [--jobs N] [--arch sm_90] [--hot-only]
[--source attn_fwd.cu ...] [--flex-pred]`` (``--flex-pred``: the block-mask predicate
variants of ``flex_variants.compile_variants``, bits path and predicate side by side).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from arrayattn.attention.cuda._loader import kernel_source  # noqa: E402
from arrayattn.attention.cuda.tiles import (  # noqa: E402
    HEAD_DIMS,
    forward_kernel_name,
    is_heavy,
    tc_row_tiles,
    tile_config,
)

FWD = "attn_fwd.cu"


def forward_variants() -> list[tuple[str, str, int, int | None]]:
    """(name expression, dtype kind, head dim, row tiles per warp) of every forward variant
    checked: every dtype x head dim without extras, the feature flags on the tuned head
    dims, and the other tensor-core warp shape (MT) for A/B timing."""
    out: list[tuple[str, str, int, int | None]] = []

    def add(kind: str, d: int, softcap: bool, dropout: bool, mask: int, mt=None) -> None:
        if kind in ("float16", "bfloat16") and mt is None:
            mt = tc_row_tiles(d, is_heavy(softcap, dropout, mask))  # what fused.py picks
        out.append((forward_kernel_name(kind, d, softcap, dropout, mask, mt), kind, d, mt))

    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in HEAD_DIMS:
            add(kind, d, False, False, 0)
    for d in (64, 128):
        add("float16", d, True, False, 0)
        add("float16", d, False, True, 0)
        add("float16", d, False, False, 1)
        add("float16", d, False, False, 2)
        add("float16", d, True, True, 2)
    add("bfloat16", 128, True, True, 1)
    add("float16", 256, True, True, 2)
    add("float32", 128, True, True, 2)
    add("float32", 64, False, False, 1)
    add("float32", 256, True, True, 1)
    add("float64", 128, True, True, 1)
    add("float64", 256, True, True, 2)
    for d in (64, 128):
        add("float16", d, False, False, 0, mt=3 - tc_row_tiles(d))
    # Block masks (arrayattn.flex; MASK | 4): every kernel family, alone and mixed (v1 runs
    # them at D = 32, 96, 128 and 256, v2 at D = 64; tiles.v2_declines).
    for d in (64, 128, 256):
        add("float16", d, False, False, 4)
    add("bfloat16", 128, False, False, 4)
    add("float16", 128, True, True, 5)
    add("bfloat16", 64, True, False, 6)
    add("float32", 64, False, False, 4)
    add("float32", 128, True, False, 5)
    add("float64", 64, False, False, 4)
    add("float64", 256, False, True, 6)
    return out


# Causal, windows and lengths are run-time arguments of the same instantiation, so the
# "causal" hot variants are these very kernels.
HOT = {
    forward_kernel_name("float16", 64, False, False, 0),
    forward_kernel_name("float16", 128, False, False, 0),
}


@dataclass
class Report:
    name: str
    registers: int = -1
    stack: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    smem: str = "-"

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def _norm(name: str) -> str:
    # (a trailing defaulted ``bool`` template argument, e.g. the backward kernels' FLEX,
    # is spelled out in ptxas' demangled names but not in the name expressions)
    return re.sub(r",false>$", ">", re.sub(r"\s+", "", name))


def _demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if tool is None:
        return names
    res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    return res.stdout.splitlines()


def _instantiation_name(demangled: str) -> str:
    """``void aa_fwd_tc<0, 128, false, false, 0>(unsigned short const*, ...)`` ->
    ``aa_fwd_tc<0, 128, false, false, 0>``."""
    s = demangled.strip()
    if s.startswith("void "):
        s = s[5:]
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return s[:i]
    return s


def parse_ptxas(text: str) -> dict[str, Report]:
    """ptxas ``-v`` output -> reports keyed by the (normalised) instantiation name."""
    mangled: list[str] = []
    raw: list[Report] = []
    current: Report | None = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = Report(m.group(1))
            mangled.append(m.group(1))
            raw.append(current)
            continue
        if current is None:
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
    names = _demangle(mangled)
    out = {}
    for rep, dem in zip(raw, names, strict=True):
        rep.name = _instantiation_name(dem)
        out[_norm(rep.name)] = rep
    return out


def compile_group(
    source: str, names: list[str], arch: str, work: Path, tag: str, prelude: str = ""
) -> tuple[str, str, int]:
    """Compile one wrapper (``prelude`` in front of the source, as the loader puts a
    block-mask predicate); returns (tag, ptxas/nvcc output, return code)."""
    lines = [prelude + kernel_source(source), "", "// instantiations (the cupy name expressions)"]
    for i, name in enumerate(names):
        lines.append(f"void* aa_compile_check_{i}() {{ return (void*)&{name}; }}")
    src = work / f"{tag}.cu"
    src.write_text("\n".join(lines) + "\n")
    cmd = [
        "nvcc",
        f"-arch={arch}",
        "-cubin",
        "-Xptxas",
        "-v",
        "-std=c++17",
        "-o",
        str(work / f"{tag}.cubin"),
        str(src),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return tag, res.stdout + res.stderr, res.returncode


def _extra_variants() -> tuple[dict[str, list[str]], set[str]]:
    """The variants (and hot ones) of the kernel modules beside the forward's v1 list: the
    backward (``backward.py``), the split-KV decode (``decode.py``) and the forward's v2
    (``tiles.py``)."""
    variants: dict[str, list[str]] = {}
    hot: set[str] = set()
    for module in (
        "arrayattn.attention.cuda.backward",
        "arrayattn.attention.cuda.decode",
        "arrayattn.attention.cuda.tiles",  # the forward's v2 (aa_fwd_tc2) variants
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        variants.update(getattr(mod, "COMPILE_VARIANTS", {}))
        hot |= set(getattr(mod, "HOT_VARIANTS", ()))
    return variants, hot


def flex_pred_check(arch: str, jobs: int) -> int:
    """``--flex-pred``: one block-mask instantiation per kernel family
    (``flex_variants.compile_variants``) compiled as the bits path reads the table and with a
    generated predicate in front (``flex_pred.sample_prelude``), side by side; 1 when a
    predicate variant spills or is not reported, 2 on a compile error."""
    from arrayattn.attention.cuda.flex_pred import sample_prelude
    from arrayattn.attention.cuda.flex_variants import compile_variants

    variants = compile_variants()
    modes = {"bits": "", "pred": sample_prelude()}
    reports: dict[str, dict[str, Report]] = {m: {} for m in modes}
    failed = []
    with tempfile.TemporaryDirectory(prefix="aa_compile_pred_") as tmp:
        work = Path(tmp)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futs = {
                pool.submit(
                    compile_group, src, [name], arch, work, f"{mode}_{Path(src).stem}_{i}", pre
                ): mode
                for mode, pre in modes.items()
                for src, names in variants.items()
                for i, name in enumerate(names)
            }
            for fut in concurrent.futures.as_completed(futs):
                tag, text, rc = fut.result()
                if rc != 0:
                    failed.append((tag, text))
                    continue
                reports[futs[fut]].update(parse_ptxas(text))
    names = [n for ns in variants.values() for n in ns]
    width = max(len(n) for n in names)
    cols = "regs stack spill_st spill_ld"
    print(f"{'variant':<{width}}  bits: {cols} | pred: {cols}")
    status = 0
    for name in names:
        row = [f"{name:<{width}}"]
        for mode in modes:
            rep = reports[mode].get(_norm(name))
            if rep is None:
                row.append(" (no ptxas report)")
                status = max(status, 1)
                continue
            row.append(
                f"{rep.registers:5d} {rep.stack:5d} {rep.spill_stores:8d} {rep.spill_loads:8d}"
            )
            if mode == "pred" and rep.spills:
                status = max(status, 1)
        print("  ".join(row[:1]) + "        " + " | ".join(row[1:]))
    for tag, text in failed:
        print(f"--- compile error in {tag} ---\n{text[-4000:]}", file=sys.stderr)
        status = 2
    if status == 1:
        print("FAIL: a predicate variant spills registers (or was not reported)", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--hot-only", action="store_true", help="only the hot variants")
    ap.add_argument(
        "--flex-pred",
        action="store_true",
        help="only the block-mask predicate variants, beside their bits-path builds",
    )
    ap.add_argument(
        "--source", action="append", help="only these .cu files (repeatable; default: all)"
    )
    args = ap.parse_args(argv)

    if shutil.which("nvcc") is None:
        print("nvcc not found: CUDA kernel compile check skipped")
        return 0
    if args.flex_pred:
        return flex_pred_check(args.arch, args.jobs)

    def wanted(source: str) -> bool:
        return not args.source or source in args.source

    fwd = forward_variants() if wanted(FWD) else []
    smem = {_norm(n): tile_config(kind, d, mt).smem_bytes for n, kind, d, mt in fwd}
    groups: dict[tuple[str, str], list[str]] = {}
    for name, kind, d, _ in fwd:
        if args.hot_only and name not in HOT:
            continue
        groups.setdefault((FWD, f"fwd_{kind}_d{d}"), []).append(name)
    extra, extra_hot = _extra_variants()
    hot = set(HOT) | extra_hot
    for source, names in extra.items():
        if not wanted(source):
            continue
        stem = Path(source).stem
        chosen = [n for n in names if not args.hot_only or n in hot]
        for i in range(0, len(chosen), 4):
            groups[(source, f"{stem}_{i // 4}")] = chosen[i : i + 4]

    start = time.time()
    reports: dict[str, Report] = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="aa_compile_") as tmp:
        work = Path(tmp)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futs = [
                pool.submit(compile_group, src, names, args.arch, work, tag)
                for (src, tag), names in groups.items()
            ]
            for fut in concurrent.futures.as_completed(futs):
                tag, text, rc = fut.result()
                if rc != 0:
                    failed.append((tag, text))
                    continue
                reports.update(parse_ptxas(text))

    expected = [n for names in groups.values() for n in names]
    width = max(len(n) for n in expected) if expected else 10
    print(f"{'variant':<{width}}  regs  stack  spill_st  spill_ld  dyn_smem  hot")
    status = 0
    for name in expected:
        rep = reports.get(_norm(name))
        is_hot = name in hot
        if rep is None:
            print(f"{name:<{width}}  (no ptxas report)")
            if is_hot:
                status = max(status, 1)
            continue
        dyn = smem.get(_norm(name), "-")
        print(
            f"{name:<{width}}  {rep.registers:4d}  {rep.stack:5d}  {rep.spill_stores:8d}  "
            f"{rep.spill_loads:8d}  {dyn!s:>8}  {'*' if is_hot else ''}"
        )
        if rep.spills and is_hot:
            status = max(status, 1)
    spilled = [n for n in expected if (r := reports.get(_norm(n))) is not None and r.spills]
    print(
        f"{len(expected)} variants in {len(groups)} compiles, {time.time() - start:.0f} s, "
        f"arch {args.arch}; spilling: {', '.join(spilled) if spilled else 'none'}"
    )
    for tag, text in failed:
        print(f"--- compile error in {tag} ---\n{text[-4000:]}", file=sys.stderr)
        status = 2
    if status == 1:
        print("FAIL: a hot variant spills registers (or was not reported)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
