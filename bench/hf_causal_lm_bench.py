#!/usr/bin/env python
"""examples/hf_causal_lm.py (NumPy) against transformers' ``generate`` (PyTorch CPU) on the
same random checkpoint, one thread each, interleaved in the same run.

A random model of ``--family`` is built by transformers and written with
``save_pretrained`` into a temporary directory (nothing is downloaded); both sides load
it in float32 and generate greedily for the same batch of prompts of different lengths
(left-padded, with the cache). Each repeat times one side, then the other; the table
gives the medians, decoded tokens per second, the spread and the ratio (of the medians,
and of each back-to-back pair). One thread each: BLAS, PyTorch and arrayattn's own
attention workers (``ARRAYATTN_NUM_THREADS=1`` unless set).

    python bench/hf_causal_lm_bench.py [--family llama --hidden 512 --layers 8
        --heads 8 --kv-heads 2 --vocab 8192 --prompts 16,48,96,128 --new 32 --repeats 3]
"""

from __future__ import annotations

import os

# one thread each: BLAS, OpenMP and arrayattn's own attention workers
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "ARRAYATTN_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 64}),
}


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "hf_causal_lm", ROOT / "examples" / "hf_causal_lm.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(CLASSES), default="llama")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompts", default="16,48,96,128", help="prompt lengths")
    ap.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(1)
    hf = _load_example()
    cfg_name, model_name, extra = CLASSES[args.family]
    attn = "eager" if args.family == "gemma2" else "sdpa"  # Gemma 2 (softcap) has no sdpa
    config = getattr(transformers, cfg_name)(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=(8 * args.hidden) // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        attn_implementation=attn,
        **extra,
    )
    torch.manual_seed(0)
    ref = getattr(transformers, model_name)(config).eval()
    lengths = [int(n) for n in args.prompts.split(",")]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args.vocab, n).tolist() for n in lengths]
    L = max(lengths)
    ids = np.zeros((len(prompts), L), dtype=np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :], mask[b, L - len(p) :] = p, 1

    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        model = hf.CausalLM.from_pretrained(d, dtype=np.float32)

    def ours() -> np.ndarray:
        return model.generate(prompts, args.new, pad_token_id=0)

    def theirs() -> np.ndarray:
        with torch.no_grad():
            seq = ref.generate(
                input_ids=torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
            )
        return seq[:, L:].numpy()

    theirs_name = f"transformers (torch, {attn})"
    times: dict[str, list[float]] = {"arrayattn (NumPy)": [], theirs_name: []}
    outs = {}
    for _ in range(args.repeats):
        for name, fn in zip(times, (ours, theirs), strict=True):
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    a, b = outs.values()
    agree = float(np.mean(a == b))
    new_tokens = len(prompts) * args.new
    print(
        f"{args.family}: hidden {args.hidden}, {args.layers} layers, heads {args.heads}/"
        f"{args.kv_heads}, vocab {args.vocab}, prompts {lengths}, {args.new} new tokens each, "
        f"float32, 1 thread, {args.repeats} repeats interleaved"
    )
    print(f"{'':28s} {'median s':>9s} {'tokens/s':>9s} {'min s':>7s} {'max s':>7s}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, m in med.items():
        print(
            f"{name:28s} {m:9.3f} {new_tokens / m:9.1f} {min(times[name]):7.3f} "
            f"{max(times[name]):7.3f}"
        )
    ratios = sorted(a / b for a, b in zip(*times.values(), strict=True))
    print(
        f"per-repeat time ratios (ours / theirs, each pair run back to back): "
        f"{', '.join(f'{r:.2f}' for r in ratios)}"
    )
    ratio = med["arrayattn (NumPy)"] / med[theirs_name]
    print(f"time ratio arrayattn / transformers: {ratio:.2f}; greedy tokens equal: {agree:.0%}")


if __name__ == "__main__":
    main()
