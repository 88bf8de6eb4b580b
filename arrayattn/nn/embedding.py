"""``embedding``: table lookup by integer ids, with a backward that needs no scatter.

The array API standard has no scatter-add, so the weight gradient is a one-hot matrix
product, taken over blocks of ids to bound the memory of the one-hot matrix.
"""

from __future__ import annotations

from typing import Any

from .._autodiff import Pullback, register_vjp
from .._backend import Array, compute_dtype, device_of, is_real_floating, namespace_of, prod

__all__ = ["embedding"]

_IDS_PER_BLOCK = 2048


def _check(ids: Array, weight: Array) -> Any:
    xp = namespace_of(ids=ids, weight=weight)
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
    if not is_real_floating(xp, weight.dtype):
        raise TypeError(f"weight must have a real floating dtype, got {weight.dtype}")
    if weight.ndim != 2:
        raise ValueError(
            f"weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(weight.shape)}"
        )
    return xp


def _lookup(xp: Any, ids: Array, weight: Array) -> Array:
    flat = xp.reshape(ids, (prod(ids.shape),))
    rows = xp.take(weight, flat, axis=0)
    return xp.reshape(rows, tuple(ids.shape) + (int(weight.shape[1]),))


def embedding(ids: Array, weight: Array) -> Array:
    """Rows of ``weight`` picked by ``ids`` (PyTorch ``nn.functional.embedding``).

    Shapes: ``ids`` integer ``(...)``, ``weight`` ``(num_embeddings, dim)`` ->
    ``(..., dim)`` in ``weight``'s dtype. Ids must lie in ``[0, num_embeddings)``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.nn.embedding(np.array([[2, 0]]), np.eye(3)).tolist()
        [[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]]
    """
    xp = _check(ids, weight)
    return _lookup(xp, ids, weight)


@register_vjp(embedding)
def _embedding_vjp(ids: Array, weight: Array) -> tuple[Array, Pullback]:
    xp = _check(ids, weight)
    out = _lookup(xp, ids, weight)

    def pullback(dy: Array) -> tuple[None, Array]:
        if tuple(dy.shape) != tuple(out.shape):
            raise ValueError(f"cotangent has shape {tuple(dy.shape)}, expected {tuple(out.shape)}")
        V, D = (int(d) for d in weight.shape)
        n = prod(ids.shape)
        cd = compute_dtype(xp, weight.dtype)
        flat = xp.reshape(ids, (n, 1))
        g = xp.astype(xp.reshape(dy, (n, D)), cd)
        vocab = xp.arange(V, dtype=ids.dtype, device=device_of(ids))
        dw = xp.zeros((V, D), dtype=cd, device=device_of(weight))
        for start in range(0, n, _IDS_PER_BLOCK):
            stop = min(n, start + _IDS_PER_BLOCK)
            one_hot = xp.astype(flat[start:stop, :] == vocab, cd)  # (block, V)
            dw = dw + xp.matmul(xp.matrix_transpose(one_hot), g[start:stop, :])
        return None, xp.astype(dw, weight.dtype)

    return out, pullback
