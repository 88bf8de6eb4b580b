"""Log-softmax and cross-entropy (PyTorch's semantics, class axis last by default), with
hand-written backwards.

Both compute in float32 (float64 for float64 inputs) through a log-sum-exp with the
maximum subtracted first, and return the input's dtype. Array-API operations only: the
target's log-probability is picked with a one-hot comparison (the standard's
``take_along_axis`` is recent), which is also what the backward needs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .._autodiff import Pullback, register_vjp
from .._backend import (
    Array,
    compute_dtype,
    device_of,
    full_scalar,
    is_lazy,
    is_numpy,
    is_real_floating,
    namespace_of,
    prod,
)
from .softmax import _check as _check_axis

__all__ = ["log_softmax", "cross_entropy", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


def _log_softmax(xp: Any, x: Array, axis: int) -> Array:
    """``x - logsumexp(x)`` along ``axis`` in the compute dtype. An all ``-inf`` slice
    gives ``-inf`` (the log of softmax's zeros), not NaN."""
    cd = compute_dtype(xp, x.dtype)
    xc = x if x.dtype == cd else xp.astype(x, cd)
    if x.shape[axis] == 0:  # nothing to normalise (and max has no identity)
        return xc
    dev = device_of(x)
    m = xp.max(xc, axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, full_scalar(xp, 0.0, cd, dev))
    shifted = xc - m
    total = xp.sum(xp.exp(shifted), axis=axis, keepdims=True)
    total = xp.where(total > 0, total, full_scalar(xp, 1.0, cd, dev))
    return shifted - xp.log(total)


def log_softmax(x: Array, axis: int = -1) -> Array:
    """Log-softmax along ``axis``: ``x - logsumexp(x, axis)``, PyTorch's
    ``nn.functional.log_softmax``, computed in float32 (float64 for float64 input) with
    the maximum subtracted first, returned in ``x``'s dtype.

    Shapes: any ``x``; the result has ``x``'s shape. A slice that is all ``-inf`` gives
    ``-inf`` (the log of :func:`softmax`'s zeros) where PyTorch gives NaN.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> np.round(aa.log_softmax(np.array([0.0, np.log(3.0)])), 4)
        array([-1.3863, -0.2877])
    """
    xp = _check_axis(x, axis)
    return xp.astype(_log_softmax(xp, x, axis), x.dtype)


@register_vjp(log_softmax)
def _log_softmax_vjp(x: Array, axis: int = -1) -> tuple[Array, Pullback]:
    xp = _check_axis(x, axis)
    y = _log_softmax(xp, x, axis)

    def pullback(dy: Array) -> tuple[Array]:
        if tuple(dy.shape) != tuple(x.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(x.shape)}")
        g = xp.astype(dy, y.dtype)
        # d log_softmax: dy - softmax * sum(dy) along the axis
        dx = g - xp.exp(y) * xp.sum(g, axis=axis, keepdims=True)
        return (xp.astype(dx, x.dtype),)

    return xp.astype(y, x.dtype), pullback


# -- cross-entropy ---------------------------------------------------------------------
def _check_ce(
    logits: Array,
    targets: Array,
    axis: int,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> tuple[Any, int, int]:
    """Checks the arguments; returns ``(xp, axis >= 0, number of classes)``."""
    xp = namespace_of(logits=logits, targets=targets)
    if not is_real_floating(xp, logits.dtype):
        raise TypeError(f"logits must have a real floating dtype, got {logits.dtype}")
    if logits.ndim < 1:
        raise ValueError(
            f"logits must have a class axis (at least 1 dim), got shape {tuple(logits.shape)}"
        )
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -logits.ndim <= axis < logits.ndim:
        raise ValueError(
            f"axis must be an int in [-{logits.ndim}, {logits.ndim}) (logits' class axis), "
            f"got {axis!r}"
        )
    if not xp.isdtype(targets.dtype, "integral"):
        raise TypeError(
            f"targets must have an integer dtype (class ids in [0, C)), got {targets.dtype}; "
            "class-probability targets are not supported"
        )
    ax = axis % logits.ndim
    expected = tuple(int(d) for i, d in enumerate(logits.shape) if i != ax)
    if tuple(int(d) for d in targets.shape) != expected:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)}, expected {expected} (logits' shape "
            f"{tuple(logits.shape)} without the class axis axis={axis})"
        )
    C = int(logits.shape[ax])
    if C < 1:
        raise ValueError(
            f"logits must have at least one class along axis={axis}, got shape "
            f"{tuple(logits.shape)}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(
            f"ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(
            f"label_smoothing must be a number in [0, 1], got "
            f"{type(label_smoothing).__name__} {label_smoothing!r}"
        )
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return xp, ax, C


def _class_ids(xp: Any, targets: Array, C: int, ignore_index: int) -> tuple[Array, Array | None]:
    """``(ids, valid)``: the targets in a dtype that holds ``C - 1``, and the bool mask of
    the entries that are not ``ignore_index`` (``None`` when none can be)."""
    info = xp.iinfo(targets.dtype)
    ids = targets if info.max >= C - 1 else xp.astype(targets, xp.int64)
    info = xp.iinfo(ids.dtype)
    valid = ids != ignore_index if info.min <= ignore_index <= info.max else None
    return ids, valid


def _check_range(xp: Any, ids: Array, valid: Array | None, C: int, ignore_index: int) -> None:
    """Eager libraries only: a Python decision on values cannot be taken under
    ``jax.jit`` or on a Dask graph."""
    if is_lazy(xp):
        return
    bad = (ids < 0) | (ids >= C)
    if valid is not None:
        bad = bad & valid
    if bool(xp.any(bad)):
        real = ids if valid is None else xp.where(valid, ids, xp.zeros_like(ids))
        lo, hi = int(xp.min(real)), int(xp.max(real))
        raise ValueError(
            f"targets must be class ids in [0, {C}) or ignore_index={ignore_index}, got "
            f"values from {lo} to {hi}"
        )


def _ce_forward(xp, logits, targets, ax, C, ignore_index, eps, reduction):
    """The loss in the compute dtype, with what the backward needs."""
    ids, valid = _class_ids(xp, targets, C, ignore_index)
    _check_range(xp, ids, valid, C, ignore_index)
    logp = _log_softmax(xp, logits, ax)
    cd, dev = logp.dtype, device_of(logits)
    zero = full_scalar(xp, 0.0, cd, dev)
    shape = [1] * logits.ndim
    shape[ax] = C
    classes = xp.reshape(xp.arange(C, dtype=ids.dtype, device=dev), tuple(shape))
    one_hot = xp.expand_dims(ids, axis=ax) == classes  # bool, logits' shape
    per = -xp.sum(xp.where(one_hot, logp, zero), axis=ax)
    if eps > 0:
        per = (1.0 - eps) * per - (eps / C) * xp.sum(logp, axis=ax)
    if valid is not None:
        per = xp.where(valid, per, zero)
    count = None
    if reduction == "none":
        loss = per
    elif reduction == "sum":
        loss = xp.sum(per)
    else:
        if valid is not None:
            count = xp.sum(xp.astype(valid, cd))
        else:
            count = full_scalar(xp, float(prod(targets.shape)), cd, dev)
        # NaN when nothing counts (as PyTorch), without a 0 / 0 warning; the backward
        # divides by the safe count and weighs ignored positions by zero
        any_kept = count > 0
        count = xp.where(any_kept, count, full_scalar(xp, 1.0, cd, dev))
        total = xp.sum(per) / count
        loss = xp.where(any_kept, total, full_scalar(xp, math.nan, cd, dev))
    return loss, logp, one_hot, valid, count


def _result(xp: Any, loss: Array, dtype: Any) -> Array:
    """``loss`` in ``dtype``, as an array: NumPy's full reductions give a NumPy scalar
    (``np.float64``), which is not an array to the array API (nor to ``vjp``)."""
    out = xp.astype(loss, dtype)
    return xp.asarray(out) if is_numpy(xp) else out


def cross_entropy(
    logits: Array,
    targets: Array,
    *,
    axis: int = -1,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Array:
    """Cross-entropy between ``logits`` and integer class ``targets``, PyTorch's
    ``nn.functional.cross_entropy`` with the **class axis last** by default (PyTorch's is
    axis 1: pass ``axis=1`` for ``(N, C, d1, ...)`` logits).

    With ``logp = log_softmax(logits, axis)``, ``C`` classes and ``eps = label_smoothing``,
    each position's loss is ``-(1 - eps) * logp[target] - eps / C * sum_c logp[c]``;
    positions whose target is ``ignore_index`` contribute 0. ``reduction="mean"`` divides
    the sum by the number of positions that are not ignored (NaN when all are, as
    PyTorch), ``"sum"`` sums, ``"none"`` returns the per-position losses.

    Args:
        logits: real floating ``(..., C, ...)`` with the classes along ``axis``.
        targets: integer class ids, ``logits``' shape without ``axis``; each in
            ``[0, C)`` or equal to ``ignore_index`` (checked on NumPy, CuPy, PyTorch and
            array-api-strict; on JAX and Dask, which take no decision on values, an id
            out of range matches no class).
        axis: the class axis of ``logits``.
        ignore_index: targets equal to it contribute nothing and are left out of the
            mean's denominator.
        label_smoothing: ``eps`` in ``[0, 1]``: the target distribution is
            ``(1 - eps) * one_hot + eps / C``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Shapes: ``"mean"``/``"sum"`` -> ``()``; ``"none"`` -> ``targets``' shape; in
    ``logits``' dtype (computed in float32 for float16/bfloat16, float64 for float64).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> round(float(aa.cross_entropy(logits, np.array([0, 2]))), 4)
        0.6691
        >>> aa.cross_entropy(logits, np.array([0, -100]), reduction="none").round(4)
        array([0.2395, 0.    ])
    """
    xp, ax, C = _check_ce(logits, targets, axis, ignore_index, label_smoothing, reduction)
    eps = float(label_smoothing)
    loss, *_ = _ce_forward(xp, logits, targets, ax, C, ignore_index, eps, reduction)
    return _result(xp, loss, logits.dtype)


@register_vjp(cross_entropy)
def _cross_entropy_vjp(
    logits: Array,
    targets: Array,
    *,
    axis: int = -1,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> tuple[Array, Pullback]:
    xp, ax, C = _check_ce(logits, targets, axis, ignore_index, label_smoothing, reduction)
    eps = float(label_smoothing)
    loss, logp, one_hot, valid, count = _ce_forward(
        xp, logits, targets, ax, C, ignore_index, eps, reduction
    )
    out = _result(xp, loss, logits.dtype)

    def pullback(d_loss: Array) -> tuple[Array, None]:
        if tuple(d_loss.shape) != tuple(out.shape):
            raise ValueError(
                f"cotangent has shape {tuple(d_loss.shape)}, expected {tuple(out.shape)} "
                f"(the loss, reduction={reduction!r})"
            )
        cd = logp.dtype
        zero = full_scalar(xp, 0.0, cd, device_of(logits))
        g = xp.astype(d_loss, cd)
        if reduction == "mean":
            g = g / count
        # one weight per position: the cotangent, zero where the target is ignored
        w = g if reduction == "none" else xp.broadcast_to(g, tuple(targets.shape))
        if valid is not None:
            w = xp.where(valid, w, zero)
        # d loss_i / d logits_i = softmax - (1 - eps) * one_hot - eps / C
        p = xp.exp(logp)
        target = (1.0 - eps) * xp.astype(one_hot, cd)
        if eps > 0:
            target = target + eps / C
        d_logits = xp.expand_dims(w, axis=ax) * (p - target)
        return xp.astype(d_logits, logits.dtype), None

    return out, pullback
