"""Extra sections of the CPU benchmark (``python -m arrayattn.bench --decode
--array-api --crossover``): decode, the array-API paths on other libraries' arrays, and
``implementation="auto"``'s crossover. Imported only by :mod:`arrayattn.bench`.

Every section interleaves its peers round by round and keeps the median of the rounds;
PyTorch runs with ``OMP_WAIT_POLICY=PASSIVE`` (set by ``main`` before torch is imported)
so that its idle OpenMP threads do not spin against the next peer.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attention.spec import AttentionSpec

__all__ = [
    "DecodeShape",
    "DECODE_SHAPES",
    "measure_decode",
    "format_decode",
    "measure_array_api",
    "format_array_api",
    "measure_crossover",
    "format_crossover",
]


@dataclass(frozen=True)
class DecodeShape:
    """A decode step: ``L`` queries over a KV cache of ``S`` keys, GQA ``Hq``/``Hkv``,
    bottom-right causal (what a generation loop runs)."""

    B: int
    L: int
    S: int
    Hq: int = 32
    Hkv: int = 8
    D: int = 128

    @property
    def label(self) -> str:
        return f"B={self.B} L={self.L} S={self.S} Hq={self.Hq} Hkv={self.Hkv} D={self.D}"

    def kv_bytes(self, itemsize: int) -> int:
        """Bytes of K and V: what a memory-bound decode step must read once."""
        return 2 * self.B * self.Hkv * self.S * self.D * itemsize


# The four decode shapes (32 query heads over 8 KV heads, D = 128).
DECODE_SHAPES = (
    DecodeShape(1, 1, 4096),
    DecodeShape(1, 1, 32768),
    DecodeShape(4, 1, 8192),
    DecodeShape(1, 16, 32768),
)


def _interleaved(calls: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls interleaved round by round (one warm-up)."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _spread(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _torch_sdpa():
    import torch

    return torch, torch.nn.functional.scaled_dot_product_attention


def measure_decode(shape: DecodeShape, repeats: int, dtype: str = "float32") -> dict[str, Any]:
    """arrayattn (``"auto"``, NumPy arrays) against PyTorch SDPA (``enable_gqa=True``, a
    bottom-right boolean mask when ``L > 1``: SDPA's ``is_causal`` is top-left)."""
    import numpy as np

    import arrayattn as aa

    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    q = rng.standard_normal((shape.B, shape.Hq, shape.L, shape.D), dtype=np.float32).astype(dt)
    k, v = (
        rng.standard_normal((shape.B, shape.Hkv, shape.S, shape.D), dtype=np.float32).astype(dt)
        for _ in range(2)
    )
    kw: dict[str, Any] = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)
    calls = {"arrayattn auto": lambda: aa.scaled_dot_product_attention(q, k, v, **kw)}
    try:
        torch, sdpa = _torch_sdpa()
    except ImportError:
        torch = None
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        mask = None
        if shape.L > 1:
            mask = torch.ones(shape.L, shape.S, dtype=torch.bool).tril(shape.S - shape.L)

        def torch_call():
            with torch.no_grad():
                return sdpa(tq, tk, tv, attn_mask=mask, enable_gqa=True)

        calls["torch sdpa"] = torch_call
    times = _spread(calls, repeats)
    from arrayattn.attention.spec import make_spec
    from arrayattn.ops.attention import auto_choice

    spec = make_spec(q, k, v, None, 0.0, True, None, True, "bottom_right", None, None, None)
    return {
        "shape": shape,
        "times": times,
        "gb": shape.kv_bytes(dt.itemsize) / 1e9,
        "auto": auto_choice(spec),
        "dtype": dtype,
    }


def format_decode(results: list[dict[str, Any]]) -> str:
    lines = [
        "#### Decode (bottom-right causal, GQA, NumPy arrays; K/V read once = the GB below)",
        "",
        "| shape | auto ran | arrayattn ms | GB/s of K/V | torch ms | torch GB/s | ratio "
        "(median) | ratio min-max over rounds |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        a = r["times"]["arrayattn auto"]
        t = r["times"].get("torch sdpa")
        am = statistics.median(a)
        row = (
            f"| {r['shape'].label} ({r['dtype']}) | {r['auto']} | {am * 1e3:.2f} | "
            f"{r['gb'] / am:.1f} |"
        )
        if t:
            tm = statistics.median(t)
            ratios = [x / y for x, y in zip(a, t, strict=True)]
            row += (
                f" {tm * 1e3:.2f} | {r['gb'] / tm:.1f} | {am / tm:.2f} | "
                f"{min(ratios):.2f}-{max(ratios):.2f} |"
            )
        else:
            row += " - | - | - | - |"
        lines.append(row)
    return "\n".join(lines) + "\n"


ARRAY_API_SHAPE = (1, 8, 2048, 64)


def _torch_calls(q: Any, k: Any, v: Any, causal: bool) -> dict[str, Callable[[], Any]]:
    import arrayattn as aa

    torch, sdpa = _torch_sdpa()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

    def ref():
        with torch.no_grad():
            return sdpa(tq, tk, tv, is_causal=causal)

    calls = {"torch sdpa": ref}
    for impl in ("composed", "chunked", "auto"):
        calls[f"arrayattn {impl}"] = functools.partial(
            aa.scaled_dot_product_attention, tq, tk, tv, is_causal=causal, implementation=impl
        )
    calls[f"arrayattn auto (ran {_auto_ran(tq, tk, tv, causal)})"] = calls.pop("arrayattn auto")
    calls["array-API floor (chunked's blocks, minimal ops)"] = functools.partial(
        _online_softmax_floor, torch, tq, tk, tv, causal, _chunked_blocks(tq, tk, tv, causal)
    )
    return calls


def _plain_spec(q: Any, k: Any, v: Any, causal: bool) -> AttentionSpec:
    from .attention.spec import make_spec

    return make_spec(q, k, v, None, 0.0, causal, None, False, "top_left", None, None, None)


def _auto_ran(q: Any, k: Any, v: Any, causal: bool) -> str:
    from .ops.attention import auto_choice

    return auto_choice(_plain_spec(q, k, v, causal))


def _chunked_blocks(q: Any, k: Any, v: Any, causal: bool) -> tuple[int, int]:
    from .attention.chunked import block_sizes

    return block_sizes(_plain_spec(q, k, v, causal))


def _online_softmax_floor(
    torch: Any, q: Any, k: Any, v: Any, causal: bool, blocks: tuple[int, int]
) -> Any:
    """The least any array-API formulation of the chunked path does, written in the
    library's own ops: per block one product for the scores (into a reused buffer), the
    causal diagonal's columns given a cached 0/-inf bias in place, ``exp`` in place (the
    static shift: no row max, no rescale), the row sums and one product with ``V``, and
    the accumulation; one normalisation at the end. Keys past the diagonal are never
    computed. No masks, lengths, bound check, garbage handling or checks: what the
    chunked path costs beyond this is its generality."""
    bq, bk = blocks
    L, S = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5
    accs, sums, biases = [], [], {}
    with torch.no_grad():
        s_buf = torch.empty(q.shape[:-2].numel() * bq * bk, dtype=q.dtype)
        for r0 in range(0, L, bq):
            r1 = min(r0 + bq, L)
            qb = q[..., r0:r1, :] * scale
            acc = total = None
            for c0 in range(0, r1 if causal else S, bk):
                c1 = min(c0 + bk, r1 if causal else S)
                s = s_buf[: qb.shape[:-1].numel() * (c1 - c0)].view(qb.shape[:-1] + (c1 - c0,))
                torch.matmul(qb, k[..., c0:c1, :].mT, out=s)
                if causal and c1 > r0 + 1:  # the diagonal's columns [max(c0, r0), c1)
                    e0 = max(c0, r0)
                    key = (r1 - r0, e0 - r0, c1 - r0)
                    if key not in biases:
                        rows = torch.arange(r0, r1).unsqueeze(-1)
                        cut = torch.arange(e0, c1) > rows
                        biases[key] = torch.zeros(cut.shape, dtype=q.dtype).masked_fill_(
                            cut, float("-inf")
                        )
                    s[..., e0 - c0 :].add_(biases[key])
                p = s.exp_()
                t = p.sum(-1, keepdim=True)
                pv = p @ v[..., c0:c1, :]
                acc = pv if acc is None else acc.add_(pv)
                total = t if total is None else total.add_(t)
            accs.append(acc)
            sums.append(total)
    return torch.cat(accs, -2) / torch.cat(sums, -2)


def _jax_calls(q: Any, k: Any, v: Any, causal: bool) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    import arrayattn as aa

    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    bt = [jnp.swapaxes(x, 1, 2) for x in (jq, jk, jv)]  # jax.nn takes (B, T, N, H)

    def run(fn, args):
        return lambda: fn(*args).block_until_ready()

    ref = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal))
    calls = {"jax dot_product_attention": run(ref, bt)}
    for impl in ("composed", "chunked", "auto"):
        fn = jax.jit(
            functools.partial(
                aa.scaled_dot_product_attention, is_causal=causal, implementation=impl
            )
        )
        calls[f"arrayattn {impl}"] = run(fn, (jq, jk, jv))
    return calls


def measure_array_api(
    repeats: int, shape: tuple[int, int, int, int] = ARRAY_API_SHAPE
) -> list[dict]:
    """The array-API paths (composed, chunked, auto) on PyTorch tensors against PyTorch
    SDPA, and on JAX arrays (under ``jax.jit``) against ``jax.nn.dot_product_attention``
    (also jitted), full and causal, float32."""
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    out = []
    for lib, ref, make in (
        ("torch", "torch sdpa", _torch_calls),
        ("jax", "jax dot_product_attention", _jax_calls),
    ):
        for causal in (False, True):
            try:
                calls = make(q, k, v, causal)
            except ImportError:
                break
            out.append({"lib": lib, "causal": causal, "ref": ref, "times": _spread(calls, repeats)})
    return out


def format_array_api(
    results: list[dict], shape: tuple[int, int, int, int] = ARRAY_API_SHAPE
) -> str:
    B, H, L, D = shape
    lines = [
        f"#### Array-API paths on other libraries' arrays (B={B} H={H} L={L} D={D}, float32, "
        "forward)",
        "",
        "| library | causal | peer | ms (median) | ratio to the library's own attention "
        "(median) | ratio min-max over rounds |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        ref = r["times"][r["ref"]]
        for name, ts in r["times"].items():
            ratios = [x / y for x, y in zip(ts, ref, strict=True)]
            lines.append(
                f"| {r['lib']} | {'yes' if r['causal'] else 'no'} | {name} | "
                f"{statistics.median(ts) * 1e3:.1f} | "
                f"{statistics.median(ts) / statistics.median(ref):.2f} | "
                f"{min(ratios):.2f}-{max(ratios):.2f} |"
            )
    return "\n".join(lines) + "\n"


# (B, H, L=S) of the crossover sweep on NumPy arrays: tiny batched problems to prefill.
CROSSOVER = (
    (2048, 1, 4),
    (256, 8, 8),
    (64, 8, 32),
    (16, 8, 64),
    (4, 8, 128),
    (2, 8, 256),
    (1, 8, 512),
    (1, 8, 1024),
)


def measure_crossover(repeats: int, D: int = 64) -> list[dict]:
    """Each modelled path and ``"auto"`` on NumPy arrays over :data:`CROSSOVER` (causal
    and not) plus the issue's decode-like ``B=256 H=8 L=1 S=128``: where the cheapest
    path changes, and what ``"auto"`` picks."""
    import numpy as np

    import arrayattn as aa
    from arrayattn.attention.spec import make_spec
    from arrayattn.ops.attention import auto_choice

    rng = np.random.default_rng(0)
    cases = [(B, H, n, n, c) for B, H, n in CROSSOVER for c in (False, True)]
    cases.insert(0, (256, 8, 1, 128, False))
    out = []
    for B, H, L, S, causal in cases:
        q = rng.standard_normal((B, H, L, D), dtype=np.float32)
        k, v = (rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(2))
        calls = {
            impl: functools.partial(
                aa.scaled_dot_product_attention, q, k, v, is_causal=causal, implementation=impl
            )
            for impl in ("fast", "composed", "chunked", "auto")
        }
        spec = make_spec(q, k, v, None, 0.0, causal, None, False, "top_left", None, None, None)
        out.append(
            {
                "case": (B, H, L, S, causal),
                "times": _interleaved(calls, repeats),
                "auto": auto_choice(spec),
            }
        )
    return out


def format_crossover(results: list[dict], D: int = 64) -> str:
    lines = [
        f'#### `implementation="auto"` crossover on NumPy arrays (D={D}, float32, forward ms)',
        "",
        "| B | H | L | S | causal | fast | composed | chunked | auto | auto ran | fastest |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        B, H, L, S, c = r["case"]
        t = r["times"]
        fastest = min(("fast", "composed", "chunked"), key=t.get)
        lines.append(
            f"| {B} | {H} | {L} | {S} | {'yes' if c else 'no'} | {t['fast'] * 1e3:.2f} | "
            f"{t['composed'] * 1e3:.2f} | {t['chunked'] * 1e3:.2f} | {t['auto'] * 1e3:.2f} | "
            f"{r['auto']} | {fastest} |"
        )
    return "\n".join(lines) + "\n"
