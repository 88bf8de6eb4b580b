#!/usr/bin/env python
"""Plot the fused kernels' float16 TFLOP/s against PyTorch's from a GPU run recorded in
``bench/RESULTS.md`` (the tables ``bench/gpu_bench.py`` writes): forward and backward by
sequence length, one line per head dim and causality, PyTorch dashed.

Usage::

    python bench/plot_gpu.py                          # the last GPU run in bench/RESULTS.md
    python bench/plot_gpu.py --device "NVIDIA H200" --out docs/img/bench_gpu.png

Needs matplotlib (``pip install '.[plot]'``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_RUN = re.compile(r"^## (?P<device>.+?) — (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d UTC)")


def last_run(text: str, device: str | None) -> tuple[str, str, list[dict]]:
    """``(device, date, rows)`` of the last GPU run (of ``device``, if given): the rows of
    its gpu_bench tables as dicts keyed by the table's column names."""
    runs: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        m = _RUN.match(line)
        if m:
            runs.append((m["device"], m["date"], []))
        elif line.startswith("## ") and runs:
            runs.append(("", "", []))  # another section ends the run
        elif runs:
            runs[-1][2].append(line)
    runs = [r for r in runs if r[0] and (device is None or r[0] == device)]
    if not runs:
        raise SystemExit(f"no GPU run{' of ' + device if device else ''} in the file")
    for dev, date, lines in reversed(runs):  # the last run with gpu_bench.py's tables
        rows, header = [], None
        for line in lines:
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "dtype":
                header = cells
            elif header and not set(cells[0]) <= {"-"}:
                rows.append(dict(zip(header, cells, strict=False)))
        rows = [r for r in rows if "fused TFLOP/s" in r]
        if rows:
            return dev, date, rows
    raise SystemExit("no GPU run with gpu_bench.py's tables in the file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "bench_gpu.png")
    args = ap.parse_args(argv)
    dev, date, rows = last_run(args.results.read_text(encoding="utf-8"), args.device)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[plot]')", file=sys.stderr)
        return 1
    series: dict[tuple[str, str, str, str], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get("dtype") != "float16" or r.get("pass") not in ("fwd", "bwd"):
            continue
        L = int(r["L=S"])
        for who, col in (("arrayattn", "fused TFLOP/s"), ("PyTorch flash", "torch TFLOP/s")):
            if r.get(col, "-") != "-":
                series[(r["pass"], r["D"], r["causal"], who)].append((L, float(r[col])))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
    colors = {("64", "no"): "C0", ("64", "yes"): "C1", ("128", "no"): "C2", ("128", "yes"): "C3"}
    for ax, pass_, title in zip(axes, ("fwd", "bwd"), ("forward", "backward"), strict=True):
        for (p, d, causal, who), pts in sorted(series.items()):
            if p != pass_:
                continue
            pts.sort()
            ax.plot(
                [x for x, _ in pts], [y for _, y in pts],
                color=colors.get((d, causal), "k"),
                linestyle="-" if who == "arrayattn" else "--",
                marker="o" if who == "arrayattn" else None,
                label=f"{who}, D={d}{', causal' if causal == 'yes' else ''}",
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("L = S (batch x L = 16k tokens)")
        ax.set_title(f"float16 {title}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (FlashAttention counting)")
    axes[0].set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    fig.suptitle(f"arrayattn fused kernels vs PyTorch flash, {dev}, {date}", fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
