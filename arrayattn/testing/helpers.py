"""Test helpers over a :class:`~arrayattn.testing.Backend`: dtype tolerances, closeness
against a NumPy oracle, and finite differences for checking hand-written backwards.

arrayattn's own test suite uses these (``tests/_helpers.py`` re-exports them). pytest is
imported only by the helpers that skip a test (:func:`backend_dtype`, :func:`thin`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DTYPES",
    "TOLERANCES",
    "backend_dtype",
    "lse_dtype_name",
    "name_of_dtype",
    "xp_assert_close",
    "assert_same_device",
    "numerical_vjp",
    "check_vjp_fd",
    "random_like",
    "attention_inputs",
    "thin",
    "check_vjp_matches_numpy",
]

DTYPES = ("float16", "float32", "float64")

# (rtol, atol) of an op's result in that dtype against the float64 reference computed
# from the same (already rounded) inputs. float16 results are rounded once to float16
# (eps 2**-10) after float32 accumulation; float32 accumulates a few ulps.
TOLERANCES = {
    "float16": (4e-3, 4e-3),
    "float32": (3e-5, 3e-6),
    "float64": (1e-10, 1e-12),
}


def name_of_dtype(dtype: Any) -> str:
    """``'float32'`` for any library's float32 dtype object."""
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        dtype = np.dtype(dtype)
    s = str(dtype)
    for name in ("bfloat16", "float16", "float32", "float64", "complex64", "complex128", "bool"):
        if s.endswith(name):
            return name
    return s


def backend_dtype(backend: Any, name: str) -> Any:
    """The backend's dtype called ``name``; skips the test when the backend lacks it
    (array-api-strict has no float16)."""
    dt = getattr(backend.xp, name, None)
    if dt is None:
        import pytest

        pytest.skip(f"{backend.name} has no {name}")
    return dt


def lse_dtype_name(name: str) -> str:
    """LSE/statistics dtype for inputs of dtype ``name``."""
    return "float64" if name == "float64" else "float32"


def assert_same_device(backend: Any, x: Any) -> None:
    import array_api_compat

    dev = array_api_compat.device(x)
    assert dev == backend.device, f"result on {dev!r}, expected {backend.device!r}"


def xp_assert_close(
    backend: Any,
    actual: Any,
    expected: np.ndarray,
    *,
    dtype: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    check_device: bool = True,
    err_msg: str = "",
) -> None:
    """``actual`` (a ``backend`` array) equals the float64 NumPy ``expected``.

    Checks the shape, the dtype name (``dtype``; default: don't check), the device, and
    the values within the tolerance of ``dtype`` (``rtol``/``atol`` override). ``-inf``
    must match exactly; NaN never passes."""
    if dtype is not None:
        assert name_of_dtype(actual.dtype) == dtype, f"dtype {actual.dtype}, expected {dtype}"
    if check_device:
        assert_same_device(backend, actual)
    got = backend.to_numpy(actual).astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
    assert not np.isnan(got).any(), f"NaN in result {err_msg}"
    r, a = TOLERANCES[dtype or "float64"]
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=err_msg)


def random_like(rng: np.random.Generator, x: Any) -> np.ndarray:
    return rng.standard_normal(np.shape(x))


def _inner(out: Any, cot: Any) -> float:
    if isinstance(out, (tuple, list)):
        return sum(_inner(o, c) for o, c in zip(out, cot, strict=True) if c is not None)
    o = np.asarray(out, dtype=np.float64)
    c = np.asarray(cot, dtype=np.float64)
    finite = np.isfinite(o)  # -inf LSE entries of empty rows carry no gradient
    return float(np.sum(np.where(finite, o, 0.0) * c))


def numerical_vjp(
    fn: Callable[..., Any],
    args: Sequence[Any],
    index: int,
    cotangent: Any,
    kwargs: dict | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Central finite differences of ``<fn(*args, **kwargs), cotangent>`` with respect to
    ``args[index]`` (a float64 NumPy array)."""
    kwargs = kwargs or {}
    x = np.asarray(args[index], dtype=np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        vals = []
        for sign in (1.0, -1.0):
            xs = x.copy()
            xs[idx] += sign * eps
            a = list(args)
            a[index] = xs
            vals.append(_inner(fn(*a, **kwargs), cotangent))
        grad[idx] = (vals[0] - vals[1]) / (2 * eps)
    return grad


def check_vjp_fd(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict | None = None,
    *,
    wrt: Sequence[int] | None = None,
    cotangent: Any = None,
    seed: int = 0,
    rtol: float = 1e-6,
    atol: float = 1e-8,
) -> tuple[Any, tuple[Any, ...]]:
    """Compare ``arrayattn.vjp(fn, *args, **kwargs)``'s pullback with finite differences
    (float64 NumPy). ``wrt`` are the positional indices to check (default: every float
    array). Returns ``(out, grads)`` for further checks."""
    import arrayattn as aa

    kwargs = kwargs or {}
    rng = np.random.default_rng(seed)
    out, pullback = aa.vjp(fn, *args, **kwargs)
    if cotangent is None:
        if isinstance(out, tuple):
            cotangent = tuple(random_like(rng, o) for o in out)
        else:
            cotangent = random_like(rng, out)
    grads = pullback(cotangent)
    assert len(grads) == len(args)
    if wrt is None:
        wrt = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
    assert wrt, "nothing to check"
    for i in wrt:
        assert grads[i] is not None, f"no gradient for argument {i}"
        assert grads[i].shape == np.shape(args[i]), f"gradient {i} shape {grads[i].shape}"
        assert grads[i].dtype == np.asarray(args[i]).dtype
        num = numerical_vjp(fn, args, i, cotangent, kwargs)
        np.testing.assert_allclose(
            grads[i], num, rtol=rtol, atol=atol, err_msg=f"gradient of argument {i}"
        )
    return out, grads


def attention_inputs(
    rng: np.random.Generator,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...] | None = None,
    mask: tuple[str, tuple[int, ...]] | None = None,
    dtype: str = "float64",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Random ``(q, k, v, mask)`` NumPy arrays in ``dtype`` (mask: ``("bool", shape)`` with
    ~70% True, or ``("float", shape)`` of bias values)."""
    v_shape = k_shape if v_shape is None else v_shape
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal(v_shape).astype(dtype)
    m = None
    if mask is not None:
        kind, shape = mask
        if kind == "bool":
            m = rng.random(shape) < 0.7
        else:
            m = rng.standard_normal(shape).astype(dtype)
    return q, k, v, m


def thin(backend: Any, keep: bool) -> None:
    """Skip on backends that compile per shape (JAX) unless ``keep``: big matrices run a
    representative subset there so the suite stays within its CI time budget."""
    if backend.compiles_per_shape and not keep:
        import pytest

        pytest.skip(f"{backend.name}: covered by the representative subset")


def check_vjp_matches_numpy(
    backend: Any,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict | None = None,
    *,
    seed: int = 0,
    rtol: float = 1e-9,
    atol: float = 1e-11,
) -> None:
    """The backend's forward and pullback equal NumPy's (float64 NumPy ``args``; ints and
    ``None`` pass through; complex arrays move too)."""
    import arrayattn as aa

    kwargs = kwargs or {}
    rng = np.random.default_rng(seed)
    out_np, pullback = aa.vjp(fn, *args, **kwargs)
    cot: tuple[np.ndarray, ...] | np.ndarray
    if isinstance(out_np, tuple):
        cot = tuple(random_like(rng, o).astype(o.dtype) for o in out_np)
        cot_b = tuple(backend.asarray(c) for c in cot)
    else:
        cot = random_like(rng, out_np).astype(out_np.dtype)
        cot_b = backend.asarray(cot)
    grads_np = pullback(cot)
    b_args = tuple(backend.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    out_b, grads_b = backend.vjp(fn, b_args, cot_b, **kwargs)
    outs_np = out_np if isinstance(out_np, tuple) else (out_np,)
    outs_b = out_b if isinstance(out_b, tuple) else (out_b,)
    for o_b, o_np in zip(outs_b, outs_np, strict=True):
        xp_assert_close(backend, o_b, o_np, rtol=rtol, atol=atol)
    assert len(grads_b) == len(grads_np)
    for i, (g_b, g_np) in enumerate(zip(grads_b, grads_np, strict=True)):
        if g_np is None:
            assert g_b is None, f"gradient {i} should be None"
            continue
        assert name_of_dtype(g_b.dtype) == name_of_dtype(g_np.dtype)
        xp_assert_close(backend, g_b, g_np, rtol=rtol, atol=atol, err_msg=f"gradient {i}")
