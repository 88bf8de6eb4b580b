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

This module holds the formula and what every path's features share; each path owns its
constants and its features (a :class:`CostModel` it registers with, in ``composed.py``,
``chunked.py`` and ``fast/``), and :mod:`arrayattn.attention.registry` asks the
registered models. The model decides only among paths that accept the call; a
registered path without one (the CuPy kernels, the Dask path) keeps its rank ahead of
them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from .._backend import is_numpy
from .spec import AttentionSpec

__all__ = [
    "PathCost",
    "CostModel",
    "Features",
    "threads",
    "visited_per_head",
    "SKINNY_ROWS",
    "CACHE_BYTES",
]

Features = tuple[int, int, int, int]
"""``(steps, products, elements, multiply_adds)`` of one path for one call."""


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




def threads() -> int:
    """The worker threads the NumPy paths use (``ARRAYATTN_NUM_THREADS``, else the CPUs)."""
    from .threads import num_threads

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


def visited_per_head(spec: AttentionSpec) -> int:
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


@dataclass(frozen=True)
class CostModel:
    """One path's estimate: its fitted constants for NumPy (``"numpy"``) and for every
    other array-API library (``"array"``), and its features for a call."""

    name: str
    constants: dict[str, PathCost]
    features: Callable[[AttentionSpec, int], Features]

    def estimate(
        self, spec: AttentionSpec, threads_: int | None = None, constants: PathCost | None = None
    ) -> float:
        """Estimated seconds of this path's forward for ``spec`` (with ``constants``
        instead of the fitted ones when given), on ``threads_`` worker threads.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.attention import registry
            >>> from arrayattn.attention.spec import make_spec
            >>> q = np.ones((256, 8, 1, 64), np.float32)
            >>> kv = np.ones((256, 8, 128, 64), np.float32)
            >>> spec = make_spec(q, kv, kv, None, 0.0, False, None, False, "top_left", None,
            ...                  None, None)
            >>> composed, fast = registry.cost_model("composed"), registry.cost_model("fast")
            >>> composed.estimate(spec, 2) < fast.estimate(spec, 2)
            True
        """
        n_threads = threads() if threads_ is None else threads_
        lib = "numpy" if is_numpy(spec.xp) else "array"
        c = self.constants[lib] if constants is None else constants
        steps, products, elements, macs = self.features(spec, n_threads)
        elem_div = n_threads if c.elem_threaded else 1
        skinny = 0.0
        if c.skinny and spec.G * spec.L <= SKINNY_ROWS:
            kv_bytes = spec.batch_size * spec.Hkv * spec.S * (spec.E + spec.Ev) * spec.itemsize
            skinny = c.skinny * macs * min(1.0, kv_bytes / CACHE_BYTES)
        return (
            c.call
            + c.step * steps
            + c.mat * products
            + c.elem * elements / elem_div
            + c.mac * macs / n_threads
            + skinny
        )
