"""Dtype-aware comparison of attention results against the float64 reference.

Rules (``assert_attention_close``):

- float64: max abs error <= 1e-12 * max(1, max |expected|);
- float32: the same with 1e-5;
- float16 / bfloat16: FlashAttention's rule: the error is at most ``factor`` (2) times the
  error of the same computation done naively in that dtype (``baseline``, see
  :func:`naive_attention`) plus one rounding of the expected values; without a baseline,
  4 ulps of the dtype relative to ``max(1, max |expected|)``.
- A ``baseline`` also widens float32's bound the same way when that is larger (large
  logits lose digits in any float32 score).
- Non-finite values: ``expected`` ``-inf``/``+inf``/NaN must be matched exactly; a
  NaN/Inf in ``actual`` where ``expected`` is finite fails with its first index.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .oracles import _forward, to_numpy

__all__ = [
    "ATTENTION_TOLERANCES",
    "assert_attention_close",
    "naive_attention",
    "round_to_dtype",
    "error_summary",
    "dtype_name",
]

ATTENTION_TOLERANCES = {"float64": 1e-12, "float32": 1e-5}
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
FA_FACTOR = 2.0
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# str() of the dtypes np.dtype() cannot read: torch.float32, array_api_strict.float32.
_DTYPE_PREFIXES = ("torch.", "array_api_strict.")


def dtype_name(dtype: Any) -> str:
    """The name (``"float32"``, ...) of a dtype given as a name or as any library's dtype
    object: NumPy scalar types and ``np.dtype``, CuPy's (NumPy's), torch dtypes, JAX and
    ml_dtypes types (``jnp.bfloat16``), array-api-strict dtypes.

    Raises:
        ValueError: ``dtype`` is not float16, bfloat16, float32 or float64 in any form.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing._compare import dtype_name
        >>> dtype_name(np.float32), dtype_name(np.dtype("float16")), dtype_name("float64")
        ('float32', 'float16', 'float64')
    """
    name = _plain_dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise ValueError(
            "dtype must be float16, bfloat16, float32 or float64 (a name or any library's "
            f"dtype object), got {dtype!r}"
        )
    return name


def _plain_dtype_name(dtype: Any) -> str | None:
    if isinstance(dtype, str) and dtype in FLOAT_DTYPES:
        return dtype
    if dtype is None:  # np.dtype(None) would read it as float64
        return None
    try:
        # NumPy/CuPy dtypes and scalar types, JAX's and ml_dtypes' (bfloat16 included).
        return np.dtype(dtype).name
    except (TypeError, ValueError):
        text = str(dtype)
    for prefix in _DTYPE_PREFIXES:
        if text.startswith(prefix):
            return text[len(prefix) :]
    return None


def round_to_dtype(x: Any, dtype: Any) -> np.ndarray:
    """Float64 values of ``x`` rounded (to nearest even) to ``dtype``'s precision;
    bfloat16 without ml_dtypes, by bit manipulation of float32.

    Examples:
        >>> from arrayattn.testing import round_to_dtype
        >>> float(round_to_dtype(1.0 + 2.0**-9, "bfloat16"))
        1.0
        >>> float(round_to_dtype(1 / 3, "float16"))
        0.333251953125
    """
    dtype = dtype_name(dtype)
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x
    if dtype in ("float32", "float16"):
        with np.errstate(over="ignore"):
            return x.astype(dtype).astype(np.float64)
    # bfloat16
    with np.errstate(over="ignore", invalid="ignore"):
        f = np.ascontiguousarray(x.astype(np.float32))
    b = f.view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = b.view(np.float32).astype(np.float64).reshape(x.shape)
    return np.where(np.isfinite(x), out, x)


def naive_attention(*args: Any, dtype: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of :func:`~arrayattn.testing.reference_attention`'s call computed
    naively in ``dtype``: every intermediate (scores, exponentials, sums, probabilities,
    output) rounded to it (a name or any library's dtype object). The baseline of
    FlashAttention's tolerance rule.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import naive_attention
        >>> q = np.full((1, 1, 2, 4), 0.1)
        >>> naive_attention(q, q, q, dtype="float16")[0].shape
        (1, 1, 2, 4)
    """
    dtype = dtype_name(dtype)
    names = (
        "query key value attn_mask dropout_p is_causal scale enable_gqa causal_align window "
        "softcap seed q_lengths kv_lengths sinks alibi_slopes"
    ).split()
    defaults: dict[str, Any] = dict.fromkeys(names)
    defaults.update(dropout_p=0.0, is_causal=False, enable_gqa=False, causal_align="top_left")
    defaults.update(zip(names, args, strict=False))
    defaults.update(kwargs)

    def rnd(x: np.ndarray) -> np.ndarray:
        return round_to_dtype(x, dtype)

    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # NumPy multiplies float16/float32 in that dtype; bfloat16 rounds once at the end.
        if dtype in ("float16", "float32"):
            return np.matmul(a.astype(dtype), b.astype(dtype)).astype(np.float64)
        return rnd(np.matmul(rnd(a), rnd(b)))

    with np.errstate(over="ignore", invalid="ignore"):
        f = _forward(**{n: defaults[n] for n in names}, rnd=rnd, matmul=matmul)
    out = f.out.reshape(f.out.shape[f.out.ndim - f.out_ndim :])
    return out, f.lse.reshape(out.shape[:-1])


def error_summary(actual: np.ndarray, expected: np.ndarray) -> tuple[float, tuple, float]:
    """``(max abs error, its index, relative Frobenius error)`` over the positions where
    both are finite."""
    both = np.isfinite(actual) & np.isfinite(expected)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(both, np.abs(actual - expected), 0.0)
    if diff.size == 0:
        return 0.0, (), 0.0
    idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
    norm = float(np.linalg.norm(np.where(both, expected, 0.0)))
    err = float(np.linalg.norm(diff))
    rel = err / norm if norm > 0 else (0.0 if err == 0 else math.inf)
    return float(diff[idx]), tuple(int(i) for i in idx), rel


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def assert_attention_close(
    actual: Any,
    expected: Any,
    *,
    dtype: Any,
    what: str = "output",
    baseline: Any = None,
    factor: float = FA_FACTOR,
) -> None:
    """Assert that ``actual`` (any library's array) matches the float64 ``expected``
    within ``dtype``'s tolerance (rules in this module's docstring).

    Args:
        actual: the implementation's result, any shape.
        expected: the float64 reference of the same shape
            (:func:`~arrayattn.testing.reference_attention` on the same rounded inputs).
        dtype: the dtype the implementation computed in (its inputs'):
            ``"float64"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``, or that dtype
            as any library's object (``np.float32``, ``np.dtype("float16")``,
            ``torch.bfloat16``, ``jnp.float32``, ``array_api_strict.float64``).
        what: a name for the message (``"output"``, ``"lse"``, ``"dq"``).
        baseline: the same computation done naively in ``dtype``
            (:func:`naive_attention`); FlashAttention's rule for low precision.
        factor: how many times the baseline's error is allowed.

    Raises:
        AssertionError: naming ``what``, the first offending index, the values there,
            the max abs and relative Frobenius errors and the bound applied.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import assert_attention_close
        >>> assert_attention_close(np.float32([1, 2]), np.array([1.0, 2.0]), dtype="float32")
        >>> assert_attention_close(np.array([0.0, np.nan]), np.zeros(2), dtype="float64")
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: output (float64): NaN at index (1,) where the reference is 0 ...
        >>> assert_attention_close(np.float32([1, 2]), np.array([1.0, 2.0]), dtype=np.float32)
    """
    dtype = dtype_name(dtype)
    a = to_numpy(actual)
    a = np.asarray(a, dtype=np.float64) if a.dtype != np.float64 else a
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what} ({dtype}): shape {a.shape}, expected {e.shape}")
    bad = ~np.isfinite(a) & np.isfinite(e)
    if bad.any():
        idx = _first(bad)
        kind = "NaN" if np.isnan(a[idx]) else str(a[idx])
        raise AssertionError(
            f"{what} ({dtype}): {kind} at index {idx} where the reference is {e[idx]:.6g} "
            f"({int(bad.sum())} of {a.size} entries non-finite)"
        )
    nonfinite = ~np.isfinite(e)
    wrong = nonfinite & ~((a == e) | (np.isnan(a) & np.isnan(e)))
    if wrong.any():
        idx = _first(wrong)
        raise AssertionError(
            f"{what} ({dtype}): {a[idx]:.6g} at index {idx}, expected {e[idx]} exactly "
            f"({int(wrong.sum())} such entries)"
        )
    err, idx, rel = error_summary(a, e)
    finite_e = np.where(nonfinite, 0.0, e)
    magnitude = max(1.0, float(np.max(np.abs(finite_e)))) if e.size else 1.0
    if dtype in ATTENTION_TOLERANCES:
        bound = ATTENTION_TOLERANCES[dtype] * magnitude
        rule = f"{ATTENTION_TOLERANCES[dtype]:g} x max(1, max|expected|)"
    else:  # float16 or bfloat16
        bound = 4 * _EPS[dtype] * magnitude
        rule = f"4 ulp of {dtype} x max(1, max|expected|)"
    if baseline is not None and dtype != "float64":
        b = np.asarray(to_numpy(baseline), dtype=np.float64)
        if b.shape == e.shape:
            base_err, _, _ = error_summary(b, e)
            if np.isfinite(base_err) and not (~np.isfinite(b) & np.isfinite(e)).any():
                fa = factor * base_err + _EPS[dtype] * magnitude
                # float16/bfloat16: FlashAttention's rule alone; float32 keeps the fixed
                # bound as a floor (the naive float32 error is often tiny).
                if fa > bound or dtype in ("float16", "bfloat16"):
                    bound = fa
                    rule = (
                        f"{factor:g} x the naive {dtype} computation's error {base_err:.3g} "
                        f"+ 1 ulp (FlashAttention's rule)"
                    )
    if err > bound:
        raise AssertionError(
            f"{what} ({dtype}): max abs error {err:.3g} at index {idx} (actual "
            f"{a[idx]:.8g}, expected {e[idx]:.8g}); relative Frobenius error {rel:.3g}; "
            f"allowed {bound:.3g} ({rule})"
        )
