#!/usr/bin/env python
"""Block masks in the fused kernels against PyTorch's FlexAttention, same device, same inputs.

One packed sequence of ``--docs`` causal documents (lengths drawn with seed 0), float16,
B = 1, H = ``--heads``, D = ``--head-dim``, L = S = ``--length``. Timed, each as the median
of ``--reps`` synchronised calls after warm-up:

- arrayattn with ``block_mask=`` (``create_block_mask(document_mask(ids, causal=True))``):
  the forward, and forward + backward through ``arrayattn.vjp`` with the backward kernels'
  block-mask instantiations (``ARRAYATTN_FLEX_BWD_KERNELS=1``, set here unless given),
  once per backward variant of ``--bwd-variants`` (``ARRAYATTN_BWD_VARIANT`` set for each
  row, e.g. ``v2,v4``: v2's FLEX dK/dV kernel against v4's, in the same run);
  The kernels read the mask_mod compiled in (a predicate, no bits) unless
  ``ARRAYATTN_FLEX_PREDICATE=0`` (bits): the header line says which, with the table's
  bytes and build time (``bench/gpu_first_contact.sh``'s ``ab_flex_pred`` runs both);
- the same mask as a dense bool ``attn_mask`` (forward), and plain causal over the whole
  sequence (the kernels with no block table; more pairs than the documents have);
- PyTorch: ``torch.compile(flex_attention)`` with its own ``create_block_mask`` on the same
  mask_mod (forward and forward + backward), and SDPA causal over the whole sequence.

TFLOP/s count only the pairs the mask keeps (FlashAttention's counting: forward
``4 H D pairs``, backward 2.5x that), so the causal rows' figures are comparable work per
second, not the same work. ``err`` is each output's relative Frobenius error against
arrayattn's dense-mask call's output in float32.

Usage::

    python bench/gpu_flex_bench.py --out gpu-run/bench.md
    python bench/gpu_flex_bench.py --bwd-variants v2,v4 --out gpu-run/bench.md  # A/B
    python bench/gpu_flex_bench.py --xp numpy --length 1024 --heads 2 --no-compile  # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("ARRAYATTN_FLEX_BWD_KERNELS", "1")

import numpy as np  # noqa: E402


def _doc_lengths(rng: np.random.Generator, L: int, docs: int) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, L), docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [L]]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--xp", default="cupy", choices=["cupy", "numpy"])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="PyTorch flex eager (CPU smoke)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=None, help="append the table to this file")
    ap.add_argument(
        "--bwd-variants",
        default="",
        help="comma-separated ARRAYATTN_BWD_VARIANT values, one fwd+bwd row each "
        "(default: the environment's, one row)",
    )
    args = ap.parse_args(argv)
    bwd_variants = _bwd_variants(args.bwd_variants)

    import arrayattn as aa
    from arrayattn import flex

    if args.xp == "cupy":
        import cupy as xp

        def sync() -> None:
            xp.cuda.Device().synchronize()

        dev_name = xp.cuda.runtime.getDeviceProperties(0)["name"]
        dev_name = dev_name.decode() if isinstance(dev_name, bytes) else dev_name
        dt = xp.float16
    else:
        xp = np

        def sync() -> None:
            pass

        dev_name = "CPU (NumPy)"
        dt = np.float32

    rng = np.random.default_rng(0)
    B, H, L, E = 1, args.heads, args.length, args.head_dim
    lens = _doc_lengths(rng, L, args.docs)
    ids_np = np.repeat(np.arange(args.docs), lens).astype(np.int32)
    pairs = int(sum(int(n) * (int(n) + 1) // 2 for n in lens))
    causal_pairs = L * (L + 1) // 2
    qkv_np = [rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(3)]
    g_np = rng.standard_normal((B, H, L, E)).astype(np.float32)
    q, k, v = (xp.asarray(a, dtype=dt) for a in qkv_np)
    g = xp.asarray(g_np, dtype=dt)
    ids = xp.asarray(ids_np)

    def timed(fn: Callable[[], object], reps: int = args.reps) -> float:
        fn()
        sync()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    rows: list[tuple[str, float, int, str]] = []  # name, ms, pairs, err
    t0 = time.perf_counter()
    bm = flex.create_block_mask(flex.document_mask(ids, causal=True), B, None, L, L, xp=xp)
    sync()
    t_create = (time.perf_counter() - t0) * 1e3
    t_create = min(t_create, timed(
        lambda: flex.create_block_mask(flex.document_mask(ids, causal=True), B, None, L, L, xp=xp)
    ))  # fmt: skip
    # The kernels' table: the partial blocks' bits, or (a built-in mask_mod, unless
    # ARRAYATTN_FLEX_PREDICATE=0) the predicate's parameters and the ids, no bits.
    from arrayattn.attention.cuda import flex_table

    table = flex_table.build(bm, xp)
    t_table = timed(lambda: flex_table.build(bm, xp))
    path = "predicate" if flex_table.predicate(bm) is not None else "bits"
    i = xp.arange(L)
    dense = (ids[:, None] == ids[None, :]) & (i[None, :] <= i[:, None])
    ref = aa.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    ref32 = np.asarray(_host(xp, ref), dtype=np.float32)

    def err(out: object) -> str:
        o = np.asarray(_host(xp, out), dtype=np.float32)
        return f"{np.linalg.norm(o - ref32) / np.linalg.norm(ref32):.1e}"

    def ours_fwd() -> object:
        return aa.scaled_dot_product_attention(q, k, v, block_mask=bm)

    def ours_fwd_bwd() -> object:
        out, pb = aa.vjp(aa.scaled_dot_product_attention, q, k, v, block_mask=bm)
        return pb(g)

    rows.append(("arrayattn block mask, forward", timed(ours_fwd), pairs, err(ours_fwd())))
    for variant in bwd_variants:
        ms = _with_bwd_variant(variant, lambda: timed(ours_fwd_bwd))
        rows.append((f"arrayattn block mask, fwd+bwd ({_bwd_label(variant, E)})", ms, pairs, ""))
    rows.append((
        "arrayattn dense bool mask, forward",
        timed(lambda: aa.scaled_dot_product_attention(q, k, v, attn_mask=dense), 3), pairs, "0",
    ))  # fmt: skip
    rows.append((
        "arrayattn causal (whole sequence), forward",
        timed(lambda: aa.scaled_dot_product_attention(q, k, v, is_causal=True)), causal_pairs, "",
    ))  # fmt: skip

    def ours_causal_fb() -> object:
        out, pb = aa.vjp(aa.scaled_dot_product_attention, q, k, v, is_causal=True)
        return pb(g)

    rows.append(("arrayattn causal (whole sequence), fwd+bwd", timed(ours_causal_fb),
                 causal_pairs, ""))  # fmt: skip
    torch_note = ""
    if not args.no_torch:
        try:
            torch_note = _torch_rows(args, xp, q, k, v, g, ids_np, pairs, causal_pairs,
                                     timed, err, rows)  # fmt: skip
        except Exception as exc:  # a peer failing must not lose our figures
            torch_note = f"PyTorch flex_attention failed: {type(exc).__name__}: {exc}"[:400]

    lines = [
        f"\n### Block masks vs FlexAttention — {dev_name} — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
        f"packed {args.docs} causal documents (lengths {', '.join(map(str, lens))}), "
        f"B=1 H={H} L=S={L} D={E} {np.dtype(dt).name}; block mask "
        f"{bm.sparsity():.1f}% empty, `create_block_mask` {t_create:.2f} ms; kernel table "
        f"({path}, ARRAYATTN_FLEX_PREDICATE={os.environ.get('ARRAYATTN_FLEX_PREDICATE')}) "
        f"{int(table.nbytes)} bytes, built in {t_table:.2f} ms; "
        f"ARRAYATTN_FLEX_BWD_KERNELS={os.environ.get('ARRAYATTN_FLEX_BWD_KERNELS')}; "
        f"median of {args.reps}. {torch_note}\n",
        "| call | ms | TFLOP/s (kept pairs) | err vs dense |",
        "|---|---|---|---|",
    ]
    for name, ms, n, e in rows:
        flops = 4.0 * B * H * E * n * (3.5 if "bwd" in name else 1.0)
        lines.append(f"| {name} | {ms:.3f} | {flops / (ms * 1e-3) / 1e12:.1f} | {e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


def _bwd_variants(spec: str) -> list[str | None]:
    """``--bwd-variants``' list (``None``: the environment's variant, one row)."""
    from arrayattn.attention.cuda.backward import VARIANTS

    names = [v.strip().lower() for v in spec.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"--bwd-variants: each must be one of {VARIANTS}, got {v!r}")
    return list(names) or [None]


def _bwd_label(variant: str | None, d: int) -> str:
    """The row's backward: the variant and the dK/dV kernel its float16 block-mask plan
    runs at head dim ``d``."""
    from arrayattn.attention.cuda.backward import flex_bwd_variant, flex_plan

    name = variant or flex_bwd_variant()
    plan = flex_plan("float16", d, d, name)
    kernel = plan.dkdv.split("<")[0] if plan is not None else "array-API backward"
    return f"backward {name}: {kernel}"


def _with_bwd_variant(variant: str | None, fn: Callable[[], float]) -> float:
    """``fn()`` with ``ARRAYATTN_BWD_VARIANT=variant`` (read at each backward call), the
    environment restored after."""
    if variant is None:
        return fn()
    old = os.environ.get("ARRAYATTN_BWD_VARIANT")
    os.environ["ARRAYATTN_BWD_VARIANT"] = variant
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["ARRAYATTN_BWD_VARIANT"]
        else:
            os.environ["ARRAYATTN_BWD_VARIANT"] = old


def _host(xp: object, a: object) -> np.ndarray:
    if xp is np:
        return np.asarray(a)
    return xp.asnumpy(a.astype(xp.float32))  # type: ignore[attr-defined]


def _torch_rows(args, xp, q, k, v, g, ids_np, pairs, causal_pairs, timed, err, rows) -> str:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = "cuda" if xp is not np else "cpu"

    def tt(a: object) -> torch.Tensor:
        return torch.from_dlpack(a) if xp is not np else torch.from_numpy(np.asarray(a))

    tq, tk, tv, tg = (tt(a) for a in (q, k, v, g))
    doc = torch.as_tensor(ids_np, device=device)

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    t0 = time.perf_counter()
    tbm = create_block_mask(mask_mod, None, None, args.length, args.length, device=device)
    t_create = (time.perf_counter() - t0) * 1e3
    fa = flex_attention if args.no_compile else torch.compile(flex_attention)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fa(tq, tk, tv, block_mask=tbm)
    if device == "cuda":
        torch.cuda.synchronize()
    t_compile = time.perf_counter() - t0

    def fwd() -> object:
        with torch.no_grad():
            return fa(tq, tk, tv, block_mask=tbm)

    def fwd_bwd() -> object:
        a, b, c = (x.detach().requires_grad_() for x in (tq, tk, tv))
        o = fa(a, b, c, block_mask=tbm)
        return torch.autograd.grad(o, (a, b, c), tg)

    rows.append(("torch flex_attention (compiled), forward", timed(fwd), pairs,
                 err(out.to(torch.float32).cpu().numpy())))  # fmt: skip
    note = ""
    try:
        rows.append(("torch flex_attention (compiled), fwd+bwd", timed(fwd_bwd), pairs, ""))
    except Exception as exc:  # no backward on CPU
        note = f" Its backward: {type(exc).__name__}: {exc}"[:200]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_fwd() -> object:
        with torch.no_grad():
            return sdpa(tq, tk, tv, is_causal=True)

    def sdpa_fb() -> object:
        a, b, c = (x.detach().requires_grad_() for x in (tq, tk, tv))
        return torch.autograd.grad(sdpa(a, b, c, is_causal=True), (a, b, c), tg)

    rows.append(("torch SDPA causal (whole sequence), forward", timed(sdpa_fwd), causal_pairs, ""))
    rows.append(("torch SDPA causal (whole sequence), fwd+bwd", timed(sdpa_fb), causal_pairs, ""))
    return (f"PyTorch {torch.__version__}: its create_block_mask {t_create:.1f} ms (first "
            f"call), first flex call with compilation {t_compile:.1f} s.{note}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
