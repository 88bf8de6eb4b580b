#!/usr/bin/env python
"""Hostile checkpoints through examples/hf_causal_lm.py: how fast each is refused and how
much memory is allocated first, next to loading the undamaged checkpoint.

A random Llama checkpoint (``--hidden``, ``--layers``, ``--vocab``; float32
``model.safetensors``) is written into a temporary directory, copied and damaged once per
case; each case loads it with ``CausalLM.from_pretrained`` and reports the time until the
``CheckpointError`` (median of ``--repeats``) and the ``tracemalloc`` peak (NumPy reports
its allocations to it). The last rows are the undamaged load with and without the NaN/Inf
scan, and the command line's wall time to exit on one damaged directory.

    python bench/checkpoint_faults_bench.py [--hidden 256 --layers 4 --vocab 8192 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _scripts import load_script  # noqa: E402

hf = load_script("examples/hf_causal_lm.py")


def write_checkpoint(d: Path, hidden: int, layers: int, vocab: int) -> None:
    from safetensors.numpy import save_file

    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 64),
        "num_key_value_heads": max(1, hidden // 256),
        "max_position_embeddings": 4096,
    }
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    save_file(
        {
            k: (0.02 * rng.standard_normal(s)).astype(np.float32)
            for k, s in hf.expected_shapes(config).items()
        },
        str(d / "model.safetensors"),
    )


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        (d / "config.json").write_text(json.dumps(config))

    return damage


def _prefix(d: Path) -> None:
    p = d / "model.safetensors"
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", 2**60))


def _cut(d: Path) -> None:
    p = d / "model.safetensors"
    os.truncate(p, p.stat().st_size - 4)


def _nan_last(d: Path) -> None:
    p = d / "model.safetensors"
    with open(p, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(np.array([np.nan], np.float32).tobytes())


def _traversal(d: Path) -> None:
    from arrayattn.nn.checkpoint import read_safetensors_header

    names = read_safetensors_header(d / "model.safetensors").tensors
    weight_map = dict.fromkeys(names, "model.safetensors")
    weight_map[next(iter(names))] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


CASES: dict[str, Callable[[Path], None]] = {
    "header length 2**60": _prefix,
    "file cut by 4 bytes": _cut,
    "num_hidden_layers 10**9": _edit_config(num_hidden_layers=10**9),
    "vocab_size 10**12": _edit_config(vocab_size=10**12),
    "unknown rope_type": _edit_config(rope_scaling={"rope_type": "wavy"}),
    "index naming ../outside": _traversal,
    "NaN in the last weight": _nan_last,
}


def measure(action: Callable[[], object], repeats: int) -> tuple[float, int, str]:
    times, peak, outcome = [], 0, "loaded"
    for _ in range(repeats):
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            action()
            outcome = "loaded"
        except hf.CheckpointError as e:
            outcome = "CheckpointError: " + str(e).split(": ", 1)[-1][:60]
        times.append(time.perf_counter() - t0)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return statistics.median(times), peak, outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        good = Path(tmp) / "good"
        write_checkpoint(good, args.hidden, args.layers, args.vocab)
        size = (good / "model.safetensors").stat().st_size
        print(
            f"checkpoint: llama, hidden {args.hidden}, {args.layers} layers, vocab "
            f"{args.vocab}: {size / 2**20:.1f} MiB float32\n"
        )
        print(f"| {'case':<28} | {'time':>9} | {'peak memory':>11} | outcome |")
        print(f"|{'-' * 30}|{'-' * 11}|{'-' * 13}|---|")
        rows = []
        for name, damage in CASES.items():
            d = Path(tmp) / name.replace(" ", "_").replace("/", "_")
            shutil.copytree(good, d)
            damage(d)
            rows.append((name, *measure(lambda d=d: hf.CausalLM.from_pretrained(d), args.repeats)))
        rows.append(
            (
                "undamaged, NaN/Inf scan",
                *measure(lambda: hf.CausalLM.from_pretrained(good), args.repeats),
            )
        )
        rows.append(
            (
                "undamaged, check_finite=False",
                *measure(
                    lambda: hf.CausalLM.from_pretrained(good, check_finite=False), args.repeats
                ),
            )
        )
        for name, t, peak, outcome in rows:
            print(f"| {name:<28} | {t * 1e3:7.1f} ms | {peak / 2**20:7.2f} MiB | {outcome} |")
        bad = Path(tmp) / "file_cut_by_4_bytes"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        t0 = time.perf_counter()
        run = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "hf_causal_lm.py"),
                "--model-dir",
                str(bad),
                "--prompt-ids",
                "1,2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        wall = time.perf_counter() - t0
        print(
            f"\ncommand line on the cut file: exit {run.returncode} after {wall:.2f} s "
            f"(interpreter start and imports included): {run.stderr.strip()[:120]}"
        )


if __name__ == "__main__":
    main()
