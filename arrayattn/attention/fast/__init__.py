"""``implementation="fast"``: the NumPy fast path, on NumPy arrays and on PyTorch CPU
tensors through zero-copy NumPy views of them (the backend layer's
:func:`~arrayattn._backend.numpy_bridge`). The call's spec is rebuilt over the views
(same options), the NumPy code runs, and the results come back as tensors over the NumPy
results' memory.

- :mod:`.layout`: what the forward and backward share (declining, the tunables, the
  layout of the inputs, structural helpers, scratch buffers, the static score bound);
- :mod:`.forward`: GQA-stacked tiles and split-KV decode;
- :mod:`.backward`: FlashAttention-2's backward from the saved LSE;
- :mod:`.flex`: block masks, mask_mods and score_mods (``arrayattn.flex``): which key
  runs a tile visits (empty blocks skipped, the mask_mod only on partial ones) and the
  mods evaluated on NumPy index arrays of global positions;
- this module: the registered implementation and its cost model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..._backend import Array, NumpyBridge, is_numpy, numpy_bridge, resolve_namespace
from ..cost import CostModel, Features, PathCost, visited_per_head
from ..registry import register_implementation
from ..spec import AttentionSpec
from . import backward as _backward
from . import forward as _forward
from .layout import declines

__all__ = ["FastPath", "numpy_spec", "declines", "COST"]

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
        >>> from arrayattn.attention.spec import make_spec
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


def _bridge(spec: AttentionSpec) -> NumpyBridge:
    bridge = numpy_bridge(spec.xp, spec.device)
    assert bridge is not None  # declines() refuses a library that has none
    return bridge


class FastPath:
    """The registered ``"fast"`` implementation: NumPy arrays directly, and PyTorch CPU
    tensors through zero-copy NumPy views (``_backend.numpy_bridge``): inputs are viewed,
    never copied, and the results are tensors over the NumPy results' memory."""

    @staticmethod
    def forward(
        spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Array | None
    ) -> tuple[Array, Array]:
        """``(out, lse)`` as :func:`arrayattn.attention.fast.forward.forward`, in the
        arguments' library."""
        if is_numpy(spec.xp):
            return _forward.forward(spec, query, key, value, attn_mask)
        bridge = _bridge(spec)
        views = (bridge.to_numpy(x) for x in (query, key, value, attn_mask))
        out, lse = _forward.forward(numpy_spec(spec, bridge), *views)
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
        """``(d_query, d_key, d_value, d_mask)`` as
        :func:`arrayattn.attention.fast.backward.backward`, in the arguments' library."""
        if is_numpy(spec.xp):
            return _backward.backward(spec, query, key, value, attn_mask, out, lse, d_out, d_lse)
        bridge = _bridge(spec)
        arrays = (query, key, value, attn_mask, out, lse, d_out, d_lse)
        grads = _backward.backward(numpy_spec(spec, bridge), *(bridge.to_numpy(x) for x in arrays))
        return tuple(bridge.from_numpy(g) for g in grads)


# -- its cost and its registration ----------------------------------------------------------
def _features(spec: AttentionSpec, threads: int) -> Features:
    """One step per (tile, key block): tiles of query rows of a GQA group (split-KV gives
    every thread a unit); no small products (one BLAS call per tile, on one thread)."""
    heads = spec.batch_size * spec.Hq
    visited = visited_per_head(spec) * heads
    n, hs, block = _forward.tile_plan(spec)
    group = spec.Hq if spec.Hkv == 1 else spec.G
    # (Decode tiles that take every head of a row, forward.all_heads, are still counted
    # per GQA group: the fitted constants were measured so; refit with calibrate_auto.)
    hs = min(hs, group)
    tiles = spec.batch_size * (spec.Hq // group) * -(-group // hs) * -(-spec.L // n)
    keys_per_tile = max(1, visited // max(1, heads * spec.L))
    steps = tiles * max(1, -(-keys_per_tile // block))
    if tiles < threads:  # split-KV: one unit per thread
        steps = max(steps, threads)
    return steps, 0, visited, visited * (spec.E + spec.Ev)


_NUMPY = PathCost(call=100e-6, step=40e-6, mat=0.0, elem=1.0e-9, mac=0.03e-9, elem_threaded=True)
COST = CostModel(
    "fast",
    {
        "numpy": _NUMPY,
        # On PyTorch CPU tensors: the same NumPy code on views of them; its call is set to
        # the array-API paths' plus the ~0.15 ms measured for the views and the NumPy spec
        # (B2 H3 L=S=5: fast 0.32 ms, composed 0.19 ms on tensors).
        "array": dataclasses.replace(_NUMPY, call=0.95e-3),
    },
    _features,
)
"""The fast path's cost model (:class:`~arrayattn.attention.cost.CostModel`)."""

register_implementation("fast", FastPath(), declines=declines, auto_rank=0, cost=COST)
