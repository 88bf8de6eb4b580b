"""The registered ``"fast"`` implementation: the NumPy fast path (``_fast_forward``,
``_fast_backward``, and ``_numpy_fast`` for what they share and the registration's
``declines``) on NumPy arrays, and on PyTorch CPU tensors through zero-copy NumPy views of
them (the backend layer's :func:`~arrayattn._backend.numpy_bridge`). The call's spec is
rebuilt over the views (same options), the NumPy code runs, and the results come back as
tensors over the NumPy results' memory.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._backend import Array, NumpyBridge, is_numpy, numpy_bridge, resolve_namespace
from ._attention_spec import AttentionSpec
from ._fast_backward import backward
from ._fast_forward import forward

__all__ = ["FastPath", "numpy_spec"]

_SPEC_ARRAYS = (
    "q_lengths",
    "kv_lengths",
    "q_len_g",
    "kv_len_g",
    "offset_g",
    "sinks",
    "alibi_slopes",
    "sinks_g",
    "alibi_g",
)


def numpy_spec(spec: AttentionSpec, bridge: NumpyBridge) -> AttentionSpec:
    """``spec`` over NumPy views of its arrays (same call, same options).

    Examples:
        >>> import torch
        >>> from arrayattn.ops._attention_spec import make_spec
        >>> q = torch.ones((1, 2, 8, 4))
        >>> spec = make_spec(q, q, q, None, 0.0, True, None, False, "top_left", None,
        ...                  None, None, kv_lengths=torch.tensor([5]))
        >>> nspec = numpy_spec(spec, numpy_bridge(spec.xp, spec.device))
        >>> nspec.dtype, type(nspec.kv_lengths).__name__, nspec.L
        (dtype('float32'), 'ndarray', 8)
    """
    views = {name: bridge.to_numpy(getattr(spec, name)) for name in _SPEC_ARRAYS}
    dtype = bridge.dtype(spec.dtype)
    cdtype = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
    xp = resolve_namespace(np)
    return dataclasses.replace(spec, xp=xp, device="cpu", dtype=dtype, cdtype=cdtype, **views)


class FastPath:
    """The registered ``"fast"`` implementation: NumPy arrays directly, and PyTorch CPU
    tensors through zero-copy NumPy views (``_backend.numpy_bridge``): inputs are viewed,
    never copied, and the results are tensors over the NumPy results' memory."""

    @staticmethod
    def forward(
        spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
    ) -> tuple[Array, Array]:
        """``(out, lse)`` as :func:`arrayattn.ops._fast_forward.forward`, in the
        arguments' library."""
        if is_numpy(spec.xp):
            return forward(spec, query, key, value, attn_mask)
        bridge = numpy_bridge(spec.xp, spec.device)
        views = (bridge.to_numpy(x) for x in (query, key, value, attn_mask))
        out, lse = forward(numpy_spec(spec, bridge), *views)
        return bridge.from_numpy(out), bridge.from_numpy(lse)

    @staticmethod
    def backward(
        spec: AttentionSpec,
        query: Array,
        key: Array,
        value: Array,
        attn_mask: Array | None,
        out: Array,
        lse: Array,
        d_out: Array | None,
        d_lse: Array | None,
    ) -> tuple[Array | None, ...]:
        """``(d_query, d_key, d_value, d_mask)`` as :func:`arrayattn.ops._fast_backward.backward`,
        in the arguments' library."""
        if is_numpy(spec.xp):
            return backward(spec, query, key, value, attn_mask, out, lse, d_out, d_lse)
        bridge = numpy_bridge(spec.xp, spec.device)
        arrays = (query, key, value, attn_mask, out, lse, d_out, d_lse)
        grads = backward(numpy_spec(spec, bridge), *(bridge.to_numpy(x) for x in arrays))
        return tuple(bridge.from_numpy(g) for g in grads)
