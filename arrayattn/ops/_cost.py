"""The cost model behind ``implementation="auto"``: estimated seconds of each path.

Each of the composed, chunked and NumPy fast paths costs, for a call,

    call + step * steps + mat * products + elem * elements / elem_threads
         + mac * multiply_adds / threads
         + skinny * multiply_adds * min(1, K/V bytes / CACHE_BYTES)  (decode-shaped calls)

where ``steps`` is the number of Python-level tiles or blocks the path runs (its
per-call overhead grows with them), ``products`` the small matrix products a batched
``matmul`` runs one by one (one per KV head, batch entry and block: the GQA group's
query rows are stacked into one), ``elements`` the score elements it computes (the
elementwise passes: ``exp``, max, sums, masks), ``multiply_adds`` the products' work
(``elements * (E + Ev)``) and ``threads`` the worker threads. Causal and windowed calls
count only the keys each path actually visits; GQA counts K/V once per group (the
stacked products). The constants were fitted on the machine of ``bench/RESULTS.md``
(``python bench/calibrate_auto.py`` refits them); only their ratios matter for the
choice, and ``docs/performance.md`` lists the crossover points they give.

The model decides only among paths that accept the call; a registered path outside
the model (the CuPy kernel) keeps its rank ahead of them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .._backend import is_numpy
from ._attention_spec import AttentionSpec

__all__ = [
    "PathCost",
    "COSTS",
    "features",
    "estimate",
    "choose",
    "composed_block_bytes",
    "MODELLED",
]

MODELLED = ("fast", "chunked", "composed")


@dataclass(frozen=True)
class PathCost:
    """Fitted constants of one path on one kind of library (seconds)."""

    call: float
    step: float
    mat: float
    elem: float
    mac: float
    elem_threaded: bool  # do the elementwise passes use every thread?
    # Extra seconds per multiply-add when a call's products have at most SKINNY_ROWS
    # stacked rows (decode) and its K/V do not fit the cache: such products read each K/V
    # element for only a few rows, so they run at memory speed, far below the ``mac`` rate
    # of prefill-shaped ones (scaled by the K/V bytes over CACHE_BYTES, at most 1).
    skinny: float = 0.0


SKINNY_ROWS = 16
CACHE_BYTES = 32 * 2**20


# From bench/calibrate_auto.py's fits and repeated interleaved timings on a 2-vCPU AMD
# EPYC (NumPy 2.4 + OpenBLAS, PyTorch 2.13 CPU, float32), rounded: the machine is shared
# and single fits moved by 2-5x under load, so these are typical values, not one run's.
# NumPy's batched matmul calls (multi-threaded) OpenBLAS once per small product: ``mat``
# is that call's cost, which the fast path avoids (one thread per tile, BLAS pinned to 1).
# "array" is every non-NumPy array-API library (measured on PyTorch CPU tensors).
COSTS: dict[tuple[str, str], PathCost] = {
    ("fast", "numpy"): PathCost(
        call=100e-6, step=40e-6, mat=0.0, elem=1.0e-9, mac=0.03e-9, elem_threaded=True
    ),
    ("composed", "numpy"): PathCost(
        call=50e-6,
        step=50e-6,
        mat=4.0e-6,
        elem=8.0e-9,
        mac=0.03e-9,
        elem_threaded=False,
        skinny=0.09e-9,
    ),
    ("chunked", "numpy"): PathCost(
        call=80e-6,
        step=100e-6,
        mat=4.0e-6,
        elem=9.0e-9,
        mac=0.03e-9,
        elem_threaded=False,
        skinny=0.09e-9,
    ),
    ("composed", "array"): PathCost(
        call=0.8e-3,
        step=110e-6,
        mat=0.05e-6,
        elem=1.5e-9,
        mac=0.06e-9,
        elem_threaded=True,
        skinny=0.15e-9,
    ),
    # Chunked's elements cost less than composed's since its blocks mask only the band's
    # edges and write into reused buffers: 58 vs 71 ms (B1 H8 L2048 D64), 13.6 vs 20.1
    # (L1024 causal) on PyTorch CPU tensors, calibrate_auto.py, 2026-11-23.
    ("chunked", "array"): PathCost(
        call=0.8e-3,
        step=140e-6,
        mat=0.13e-6,
        elem=1.3e-9,
        mac=0.06e-9,
        elem_threaded=True,
        skinny=0.15e-9,
    ),
}


# The fast path on PyTorch CPU tensors: the same NumPy code on views of them; its call is
# set to the array-API paths' plus the ~0.15 ms measured for the views and the NumPy spec
# (B2 H3 L=S=5: fast 0.32 ms, composed 0.19 ms on tensors).
COSTS[("fast", "array")] = dataclasses.replace(COSTS[("fast", "numpy")], call=0.95e-3)


def _threads() -> int:
    from ._fast_threads import num_threads

    try:
        return num_threads()
    except ValueError:  # a bad ARRAYATTN_NUM_THREADS is reported by the fast path itself
        return max(1, os.cpu_count() or 1)


def _clipped_sum(a: int, n: int, S: int) -> int:
    """``sum(min(S, max(0, a + i)) for i in range(n))`` in closed form."""
    if n <= 0:
        return 0
    i0 = min(n, max(0, -a))  # first i with a + i >= 0
    i1 = min(n, max(i0, S - a))  # first i with a + i >= S
    # a + i for i in [i0, i1), then S for i in [i1, n)
    ramp = (i1 - i0) * a + (i1 * (i1 - 1) - i0 * (i0 - 1)) // 2
    return ramp + (n - i1) * S


def _visited_per_head(spec: AttentionSpec) -> int:
    """Score elements of one (batch, head) inside the causal/window band (all ``L x S``
    without one); per-sequence lengths are data and not counted. Row ``i`` sees keys
    ``[i + off - left, i + off + right]`` within ``[0, S)``: sums of clipped ramps."""
    L, S = spec.L, spec.S
    st = spec.structure
    if st.is_trivial or L == 0 or S == 0:
        return L * S
    hi = L * S if st.right < 0 else _clipped_sum(st.offset + st.right + 1, L, S)
    lo = 0 if st.left < 0 else _clipped_sum(st.offset - st.left, L, S)
    return max(0, hi - lo)  # (each row's hi >= lo: right + 1 > -left)


def composed_block_bytes(spec: AttentionSpec) -> int:
    """Bytes of the composed path's largest row-block score matrix (compute dtype)."""
    from ._composed import row_blocks

    rows_keys = max(((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in row_blocks(spec)), default=0)
    return rows_keys * spec.batch_size * spec.Hq * spec.itemsize


def features(spec: AttentionSpec, name: str, threads: int) -> tuple[int, int, int, int]:
    """``(steps, products, elements, multiply_adds)`` of path ``name`` for this call."""
    heads = spec.batch_size * spec.Hq
    groups = spec.batch_size * (spec.Hq // spec.G)  # stacked products per block
    visited = _visited_per_head(spec) * heads
    width = spec.E + spec.Ev
    if name == "fast":
        from ._fast_forward import tile_plan

        n, hs, block = tile_plan(spec)
        group = spec.Hq if spec.Hkv == 1 else spec.G
        tiles = spec.batch_size * (spec.Hq // group) * -(-group // hs) * -(-spec.L // n)
        keys_per_tile = max(1, visited // max(1, heads * spec.L)) * 1
        steps = tiles * max(1, -(-keys_per_tile // block))
        if tiles < threads:  # split-KV: one unit per thread
            steps = max(steps, threads)
        return steps, 0, visited, visited * width
    if name == "composed":
        from ._composed import row_blocks

        blocks = row_blocks(spec)
        elements = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks) * heads
        return len(blocks), 2 * len(blocks) * groups, elements, elements * width
    from .chunked import block_sizes

    bq, bk = block_sizes(spec)
    # The forward trims each row block's keys to those its rows see (col_range): the
    # scores it computes are each row block's rows times that range.
    st = spec.structure
    L = max(1, spec.L)
    steps = elements = 0
    for r0 in range(0, L, bq):
        r1 = min(r0 + bq, L)
        lo, hi = st.col_range(r0, r1, spec.S)
        keys = hi - lo
        steps += max(1, -(-keys // bk))
        elements += (r1 - r0) * keys
    elements *= heads
    return steps, 2 * steps * groups, elements, elements * width


def estimate(
    spec: AttentionSpec, name: str, threads: int | None = None, cost: PathCost | None = None
) -> float:
    """Estimated seconds of path ``name`` (``"fast"``, ``"chunked"``, ``"composed"``)
    for the forward of this call (with ``cost``'s constants instead of the table's when
    given).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.ops._attention_spec import make_spec
        >>> q = np.ones((256, 8, 1, 64), np.float32); kv = np.ones((256, 8, 128, 64), np.float32)
        >>> spec = make_spec(q, kv, kv, None, 0.0, False, None, False, "top_left", None,
        ...                  None, None)
        >>> estimate(spec, "composed", 2) < estimate(spec, "fast", 2)
        True
    """
    threads = _threads() if threads is None else threads
    lib = "numpy" if is_numpy(spec.xp) else "array"
    c = COSTS[(name, lib)] if cost is None else cost
    steps, products, elements, macs = features(spec, name, threads)
    elem_div = threads if c.elem_threaded else 1
    skinny = 0.0
    if c.skinny and spec.G * spec.L <= SKINNY_ROWS:
        kv_bytes = spec.batch_size * spec.Hkv * spec.S * (spec.E + spec.Ev) * spec.itemsize
        skinny = c.skinny * macs * min(1.0, kv_bytes / CACHE_BYTES)
    return (
        c.call
        + c.step * steps
        + c.mat * products
        + c.elem * elements / elem_div
        + c.mac * macs / threads
        + skinny
    )


def choose(spec: AttentionSpec, names: list[str], threads: int | None = None) -> str:
    """The modelled path among ``names`` with the lowest estimate (ties: first given)."""
    threads = _threads() if threads is None else threads
    return min(names, key=lambda n: estimate(spec, n, threads))
