"""``linear``: the affine map of PyTorch's ``nn.Linear`` (weight layout ``(out, in)``), with
its backward."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._autodiff import Pullback, register_vjp
from .._backend import Array, compute_dtype, is_cupy, is_numpy, is_real_floating, namespace_of, prod

__all__ = ["linear"]


def _check(x: Array, weight: Array, bias: Array | None) -> Any:
    xp = namespace_of(x=x, weight=weight, bias=bias)
    for name, a in (("x", x), ("weight", weight), ("bias", bias)):
        if a is not None and not is_real_floating(xp, a.dtype):
            raise TypeError(f"{name} must have a real floating dtype, got {a.dtype}")
    if weight.ndim != 2:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's in_features {weight.shape[1]} (weight shape "
            f"{tuple(weight.shape)}), got x shape {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias must have shape ({weight.shape[0]},) (out_features), got {tuple(bias.shape)}"
        )
    dtypes = {a.dtype for a in (x, weight, bias) if a is not None}
    if len(dtypes) != 1:
        raise TypeError(
            f"x, weight and bias must share one dtype, got x {x.dtype}, weight {weight.dtype}"
            + ("" if bias is None else f", bias {bias.dtype}")
        )
    return xp


def _cast(xp: Any, a: Array, dtype: Any) -> Array:
    # astype copies even when the dtype already matches; skip that copy.
    return a if a.dtype == dtype else xp.astype(a, dtype)


FEW_ROWS = (2, 8)
"""Row counts (tokens) for which NumPy's product runs over blocks of the weight's rows."""


def _few_rows(x2: Any, weight: Any) -> Any:
    """``x2 @ weight.T`` for a few rows ``x2`` ``(M, in)`` and a C-contiguous NumPy
    ``weight`` ``(out, in)``, as ``weight[block] @ x2.T`` over blocks of the weight's rows
    of a few hundred KiB: each block is packed once while it sits in the cache. One GEMM
    over the whole weight streams and packs it at a far lower rate for so few rows
    (decoding a batch: 1.5x faster at 2-4 rows, 1.2x at 8, on the weights of an 8-layer
    model; a single row is a GEMV, and from 16 rows on blocks no longer help)."""
    M = int(x2.shape[0])
    out_f, in_f = (int(d) for d in weight.shape)
    block = (512 if M <= 4 else 256) * 1024
    step = max(16, block // (weight.itemsize * max(in_f, 1)))
    xt = np.ascontiguousarray(x2.T)
    out = np.empty((out_f, M), dtype=weight.dtype)
    for j in range(0, out_f, step):
        np.matmul(weight[j : j + step], xt, out=out[j : j + step])
    return np.ascontiguousarray(out.T)


def _forward(xp: Any, x: Array, weight: Array, bias: Array | None) -> Array:
    cd = compute_dtype(xp, x.dtype)
    xc, wt = _cast(xp, x, cd), xp.matrix_transpose(_cast(xp, weight, cd))
    rows = prod(x.shape[:-1])
    if (
        FEW_ROWS[0] <= rows <= FEW_ROWS[1]
        and is_numpy(xp)
        and x.dtype == weight.dtype == cd
        and weight.flags.c_contiguous
    ):
        y = _few_rows(xp.reshape(xc, (rows, int(x.shape[-1]))), weight)
        y = xp.reshape(y, (*tuple(x.shape[:-1]), int(weight.shape[0])))
    elif x.ndim > 2 and (is_numpy(xp) or is_cupy(xp)):
        # One (rows, in) @ (in, out) GEMM: a stacked matmul against a 2-D weight runs one
        # GEMM (or a GEMV, for one token per row while decoding) per leading index.
        lead = tuple(x.shape[:-1])
        y = xp.matmul(xp.reshape(xc, (-1, int(x.shape[-1]))), wt)
        y = xp.reshape(y, (*lead, int(weight.shape[0])))
    else:
        y = xp.matmul(xc, wt)
    if bias is not None:
        y = y + _cast(xp, bias, cd)
    return _cast(xp, y, x.dtype)


def linear(x: Array, weight: Array, bias: Array | None = None) -> Array:
    """``y = x @ weight.T + bias``, PyTorch's ``nn.functional.linear``.

    Shapes: ``x`` ``(..., in_features)``, ``weight`` ``(out_features, in_features)``
    (``nn.Linear`` and Hugging Face checkpoint layout), ``bias`` ``(out_features,)`` or
    ``None`` -> ``(..., out_features)`` in ``x``'s dtype (float16 computes in float32).
    On NumPy and CuPy the leading dims are flattened into one GEMM; on NumPy, 2 to 8 rows
    (a decoding step's batch) against a C-contiguous weight run over blocks of the
    weight's rows (see ``FEW_ROWS``), 1.2-1.5x faster than one GEMM there.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> w = np.arange(6.0).reshape(3, 2)          # out=3, in=2
        >>> aa.nn.linear(np.ones((4, 2)), w, np.zeros(3)).shape
        (4, 3)
    """
    xp = _check(x, weight, bias)
    return _forward(xp, x, weight, bias)


@register_vjp(linear)
def _linear_vjp(x: Array, weight: Array, bias: Array | None = None) -> tuple[Array, Pullback]:
    xp = _check(x, weight, bias)
    y = _forward(xp, x, weight, bias)

    def pullback(dy: Array) -> tuple[Array, Array, Array | None]:
        if tuple(dy.shape) != tuple(y.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(y.shape)}")
        cd = compute_dtype(xp, x.dtype)
        g = _cast(xp, dy, cd)
        out_f, in_f = (int(d) for d in weight.shape)
        n = prod(x.shape[:-1])
        g2 = xp.reshape(g, (n, out_f))
        x2 = xp.reshape(_cast(xp, x, cd), (n, in_f))
        dx = xp.matmul(g, _cast(xp, weight, cd))
        dw = xp.matmul(xp.matrix_transpose(g2), x2)
        db = None if bias is None else _cast(xp, xp.sum(g2, axis=0), bias.dtype)
        return _cast(xp, dx, x.dtype), _cast(xp, dw, weight.dtype), db

    return y, pullback
