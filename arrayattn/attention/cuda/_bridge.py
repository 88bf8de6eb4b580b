"""The fused kernels on PyTorch CUDA tensors and JAX GPU arrays, through DLPack.

A GPU user of PyTorch or JAX holds the data where the kernels can read it, but not as
CuPy arrays; bfloat16, the usual training dtype, has no CuPy dtype at all. This module
hands such arrays to the kernels without a copy (:class:`arrayattn._backend.CupyBridge`:
bfloat16 as its int16 storage, which the kernels read as bits) and the results back as
arrays of the caller's library. The spec is rewritten once for the CuPy side
(:func:`cupy_spec`: CuPy namespace and device, the kind in ``kernel_kind`` for
bfloat16, per-head arrays in float32), so the kernels' code is the CuPy path's.

What it does not do: calls whose inputs record gradients for PyTorch's autograd
(``implementation="fused"`` declines them: autograd could not see through the kernels;
``arrayattn.vjp`` gives the kernels' backward), JAX arrays under tracing (``jax.jit``),
and bfloat16 inputs broadcast over leading dims (their gradient reduction would need a
bfloat16 sum on CuPy). ``implementation="auto"`` picks this route first, as it does the
kernels for CuPy arrays (``ARRAYATTN_AUTO_DLPACK=0`` keeps such calls on the array-API
paths; ``tests/kernels/test_fused_gpu.py`` checks the route on a GPU; on the CPU,
``tests/kernels/test_fused_glue.py`` runs it with NumPy playing CuPy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._backend import Array, CupyBridge, cupy_bridge, library_name
from .. import chunked, composed
from ..composed import AUTO_CHUNK_BYTES
from ..spec import AttentionSpec
from . import backward as kernels_backward
from .operands import device_index

__all__ = ["bridge_for", "declines", "cupy_spec", "forward", "backward"]


def bridge_for(spec: AttentionSpec, *arrays: Array | None) -> CupyBridge | None:
    """The bridge for the call's library and device, or ``None``."""
    return cupy_bridge(spec.xp, spec.device, *arrays)


def declines(spec: AttentionSpec) -> str | None:
    """Why the bridge cannot take a non-CuPy call (``None``: it can; the kernels' own
    checks follow)."""
    br = bridge_for(spec)
    if br is None:
        return (
            f"the fused kernels need CuPy arrays, or PyTorch CUDA tensors / JAX GPU arrays "
            f"(with CuPy installed), got {library_name(spec.xp)} arrays on {spec.device}"
        )
    if spec.autograd:
        return "the inputs record gradients for PyTorch's autograd (use arrayattn.vjp)"
    if br.kind(spec.dtype) == "bfloat16":
        full = spec.lead
        for name, shape in (("query", spec.q_shape), ("key", spec.k_shape),
                            ("value", spec.v_shape)):  # fmt: skip
            lead = tuple(shape[:-3])
            if (1,) * (len(full) - len(lead)) + lead != full:
                return f"bfloat16 {name} broadcast over leading dims {lead} -> {full}"
    return None


def cupy_spec(spec: AttentionSpec, br: CupyBridge) -> AttentionSpec:
    """``spec`` for the same call on CuPy views of its arrays."""
    import array_api_compat.cupy as cxp
    import cupy

    kind = br.kind(spec.dtype)
    assert kind is not None

    def conv(a: Any) -> Any:
        return br.to_cupy(a)

    def conv32(a: Any) -> Any:
        return br.to_cupy(a, as_float32=True)

    return dataclasses.replace(
        spec,
        xp=cxp,
        device=cupy.cuda.Device(device_index(spec)),
        dtype=cupy.int16 if kind == "bfloat16" else cupy.dtype(kind),
        cdtype=cupy.dtype("float64" if kind == "float64" else "float32"),
        kernel_kind="bfloat16" if kind == "bfloat16" else None,
        q_lengths=conv(spec.q_lengths),
        kv_lengths=conv(spec.kv_lengths),
        q_len_g=conv(spec.q_len_g),
        kv_len_g=conv(spec.kv_len_g),
        offset_g=conv(spec.offset_g),
        sinks=conv32(spec.sinks),
        alibi_slopes=conv32(spec.alibi_slopes),
        sinks_g=conv32(spec.sinks_g),
        alibi_g=conv32(spec.alibi_g),
    )


def _mask(br: CupyBridge, spec: AttentionSpec, attn_mask: Any) -> Any:
    return br.to_cupy(attn_mask, as_float32=spec.mask_kind == "float")


def forward(
    impl: Any, spec: AttentionSpec, query: Array, key: Array, value: Array, attn_mask: Any
) -> tuple[Array, Array]:
    """``impl.forward`` (the CuPy path) on views of the call's arrays; the output in the
    caller's library and dtype, the LSE in float32 (float64 for float64)."""
    br = bridge_for(spec, query, key, value)
    assert br is not None
    cs = cupy_spec(spec, br)
    out, lse = impl.forward(
        cs, br.to_cupy(query), br.to_cupy(key), br.to_cupy(value), _mask(br, spec, attn_mask)
    )
    return br.from_cupy(out, cs.kernel_kind), br.from_cupy(lse)


def backward(
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Any,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
) -> tuple[Array, Array, Array, Array | None]:
    """The backward kernels on views of the call's arrays; where they decline, the
    array-API backward on the caller's own arrays (chunked for large score matrices)."""
    br = bridge_for(spec, query, key, value)
    assert br is not None
    cs = cupy_spec(spec, br)
    if kernels_backward.declines(cs) is not None:
        args = (spec, query, key, value, attn_mask, out, lse, d_out, d_lse)
        if chunked.score_matrix_bytes(spec) > AUTO_CHUNK_BYTES:
            return chunked.backward(*args)
        return composed.backward(*args)
    conv = br.to_cupy
    dq, dk, dv, _ = kernels_backward.backward(
        cs, conv(query), conv(key), conv(value), _mask(br, spec, attn_mask), conv(out),
        conv(lse), conv(d_out), conv(d_lse),
    )  # fmt: skip
    kind = cs.kernel_kind
    return br.from_cupy(dq, kind), br.from_cupy(dk, kind), br.from_cupy(dv, kind), None
