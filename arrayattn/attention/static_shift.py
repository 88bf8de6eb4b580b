"""The static shift: an online softmax with no running maximum, where a bound allows it.

Softmax is shift-invariant; the running row maximum of an online softmax only keeps
``exp`` from overflowing. When a bound shows that no score can exceed ``limit - room``
(``room`` = ``log S + log max|v|``, so the row sums and ``P @ V`` stay finite too),
``exp(S)`` itself is safe: the per-block maximum, the shift and the rescale of the
accumulator all go, and a block costs the scores product, ``exp`` and the value product.

The bound is Cauchy-Schwarz: ``|q_i . k_j| * |scale| <= |q_i| |scale| max_j |k_j|`` over
the KV head of each query head, capped at ``softcap`` when there is one. A float mask
(arbitrary additive scores) or an ALiBi slope below 0 (a bias that raises scores) rules
it out. Non-finite inputs give a non-finite bound or room, which rules it out too.

Scores far below the bound make tiny row sums: a row whose sum falls below :data:`TINY`
may have lost precision to underflow, and the caller redoes it with the running maximum.
Without ALiBi an unmasked key adds at least ``exp(-limit) > 0`` (a normal number), so a
sum of exactly 0 means the row has no key at all, and is already exact.

Used by the NumPy fast path (per tile) and by the chunked array-API path (per call, on
libraries that run eagerly: deciding needs the bound's value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._backend import Array, Namespace, is_lazy, to_floats
from .spec import AttentionSpec

__all__ = ["LIMIT", "TINY", "MIN_ROWS", "ScoreBound", "limit_and_tiny", "bounded"]

LIMIT = {32: 80.0, 64: 690.0}
"""Largest ``bound + room`` by compute-dtype bits: ``exp`` overflows above ~88.7 in
float32 and ~709.8 in float64."""
TINY = {32: 1e-25, 64: 1e-280}
"""A static-path row sum below this may have lost precision to underflow."""
MIN_ROWS = 128
"""Query rows per KV head (GQA group times ``L``) from which the chunked path bounds the
scores: the bound reads all of K and V (their norms and range), which pays for itself by
the passes it saves over each block's scores only when many query rows share those keys;
decode (a few rows over a long cache) is memory-bound, and the extra reads cost what the
attention itself does. The NumPy fast path's per-tile rule is
``_fast_forward.STATIC_MIN_ROWS``."""


def limit_and_tiny(xp: Namespace, cdtype: Any) -> tuple[float, float]:
    """``(LIMIT, TINY)`` for the compute dtype ``cdtype`` (float32 or float64)."""
    bits = 64 if cdtype == xp.float64 else 32
    return LIMIT[bits], TINY[bits]


@dataclass(frozen=True)
class ScoreBound:
    """What :func:`bounded` learnt about a call's scores."""

    static: bool
    """The call may take the static shift."""
    finite: bool = False
    """With ``static``: every score of the call (before masking) is finite, since every
    query and key entry is and no partial sum of a product can overflow. A block's
    masked pairs may then be removed by adding ``-inf`` (no ``NaN`` to replace)."""


NONE = ScoreBound(False)

_FINITE_PRODUCT = 1e30
"""Largest ``max|q_i| * max|k_j|`` (scale included) taken to rule out an overflowing
partial sum of a score product (float32 overflows at 3.4e38)."""


def bounded(
    spec: AttentionSpec,
    qg: Array,
    kg: Array,
    vc: Array,
    v_range: tuple[float, float] | None = None,
) -> ScoreBound:
    """Whether the call may take the static shift (``.static``), and whether all its
    scores are finite (``.finite``): ``qg`` the grouped query already multiplied by the
    scale, ``kg`` the grouped keys and ``vc`` the values with non-finite entries cleared,
    all in the compute dtype; ``v_range`` the ``(max, min)`` of ``vc`` when the caller
    already read them (``_composed.value_operands_and_range``). Never static on lazy
    libraries (JAX, Dask), where no Python decision may be taken on values.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 1, 128, 8), np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None,
        ...                  None, None)
        >>> qg, kg = spec.group_query(q) / 8 ** 0.5, spec.group_kv(q, spec.k_shape)
        >>> bounded(spec, qg, kg, kg)
        ScoreBound(static=True, finite=True)
        >>> bounded(spec, qg * 100, kg, kg).static  # scores up to 800: exp would overflow
        False
    """
    xp = spec.xp
    if is_lazy(xp) or spec.mask_kind == "float" or spec.score_mod is not None:
        return NONE  # (a score_mod may move scores anywhere: no bound from |q| |k|)
    if spec.G * spec.L < MIN_ROWS:  # decode-shaped: the bound would cost what it saves
        return NONE
    if 0 in tuple(qg.shape) or 0 in tuple(kg.shape):
        return NONE  # nothing to bound (the callers handle empty calls apart)
    limit, _ = limit_and_tiny(xp, spec.cdtype)
    # max_i |q_i| * max_j |k_j| per KV head: the largest bound of any row decides. Rows
    # holding NaN or infinity are left out: their scores are non-finite, and the running
    # maximum of a row with such a score is non-finite too, so the exact path shifts it
    # by 0 as well (same result); the other rows then keep the path a clean call takes.
    q_rows, k_rows = _row_norms(xp, qg), _row_norms(xp, kg)
    q_norm = xp.max(_finite_or_zero(xp, q_rows), axis=(-2, -1))  # (*lead, Hk)
    k_norm = xp.max(_finite_or_zero(xp, k_rows), axis=(-2, -1))
    # The bound, and the largest norms of all rows (NaN or inf when any entry is).
    facts = [xp.max(q_norm * k_norm), xp.max(q_rows), xp.max(k_rows)]
    read_v = v_range is None and 0 not in tuple(vc.shape)
    if read_v:  # max |v| from two reductions (no |v| temporary)
        facts += [xp.max(vc), xp.min(vc)]
    if spec.alibi_g is not None:
        facts.append(xp.astype(xp.min(spec.alibi_g), facts[0].dtype))
    values = to_floats(xp.stack(facts))  # one transfer (one GPU synchronisation)
    bound, q_max, k_max, rest = values[0], values[1], values[2], values[3:]
    if spec.alibi_g is not None and not rest.pop() >= 0.0:  # a slope < 0 raises scores
        return NONE
    v_extremes = rest if read_v else list(v_range or ())
    v_max = 0.0
    if v_extremes:
        if not all(math.isfinite(e) for e in v_extremes):
            return NONE
        v_max = max(abs(e) for e in v_extremes)
    room = math.log(max(spec.S, 1)) + math.log(max(v_max, 1.0))
    if spec.softcap is not None:
        bound = min(bound, spec.softcap)
    if not bound + room <= limit:  # (also for a NaN bound)
        return NONE
    return ScoreBound(True, q_max * k_max <= _FINITE_PRODUCT)  # False for NaN or inf


def _row_norms(xp: Namespace, x: Array) -> Array:
    """Euclidean norms over the last axis: the array API's ``linalg.vector_norm`` where the
    library has the extension (no ``x``-sized temporary), else ``sqrt(sum(x * x))``."""
    linalg = getattr(xp, "linalg", None)
    if linalg is not None and hasattr(linalg, "vector_norm"):
        return linalg.vector_norm(x, axis=-1)
    return xp.sqrt(xp.sum(x * x, axis=-1))


def _finite_or_zero(xp: Namespace, x: Array) -> Array:
    return xp.where(xp.isfinite(x), x, xp.zeros_like(x))
