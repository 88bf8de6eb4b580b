"""How the CUDA kernels see a call: its dtype kind, device, diagonal, and operands.

Shared by the prefill forward (``fused.py``), the backward (``backward.py``) and the
decode kernels (``decode.py``), which read the same arrays in the same layouts: any
strides whose innermost (head-dim) stride is 1 and whose broadcast leading dims flatten
to one batch stride (16-byte aligned rows where the kernels load 16 bytes at once);
anything else is copied to a contiguous array first. No CuPy import at module level.
"""

from __future__ import annotations

from typing import Any

from ..spec import AttentionSpec
from .tiles import DIAG_FROM_LENGTHS

__all__ = [
    "KINDS",
    "kernel_kind",
    "device_index",
    "compute_capability",
    "is_block",
    "kernel_diagonal",
    "operand",
    "mask_operand",
    "per_head_operand",
    "lengths_operand",
]

KINDS = ("float16", "bfloat16", "float32", "float64")


def kernel_kind(spec: AttentionSpec) -> str | None:
    """The kernels' dtype name for the call (``"float16"``, ``"bfloat16"``, ``"float32"``,
    ``"float64"``; bfloat16 also when the arrays are its int16 storage), or ``None``."""
    if spec.kernel_kind is not None:
        return spec.kernel_kind
    dtype = spec.dtype
    try:
        return _KIND_BY_DTYPE[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype object
        pass
    name = str(dtype).removeprefix("torch.")
    kind = name if name in KINDS else None
    try:
        if len(_KIND_BY_DTYPE) < 64:
            _KIND_BY_DTYPE[dtype] = kind
    except TypeError:
        pass
    return kind


# ``str(dtype)`` costs microseconds per call and every launch asks (a decode step's host
# time is its speed), so the answer is remembered per dtype object.
_KIND_BY_DTYPE: dict[Any, str | None] = {}


def compute_capability(spec: AttentionSpec) -> int:
    """The compute capability of the call's device as one number (CuPy's "90", "100")."""
    import cupy

    return int(cupy.cuda.Device(device_index(spec)).compute_capability)


def is_block(spec: AttentionSpec) -> bool:
    """Whether ``spec`` is one block of a larger call (the Dask path's tasks)."""
    return bool(
        spec.batch_ids is not None or spec.row0 or spec.col0 or spec.head0 or spec.partial_keys
    )


def kernel_diagonal(spec: AttentionSpec) -> int | None:
    """The kernels' ``diag`` argument for this call: the constant diagonal offset (query
    ``i`` sits on key ``i + diag``: 0 top-left, ``S - L`` bottom-right, anything for a
    block of a larger call), or :data:`~.tiles.DIAG_FROM_LENGTHS` where each sequence's
    offset is its ``kv_len - q_len`` (bottom-right with lengths); ``None`` when the call's
    per-sequence offsets are neither (a block whose lengths were cut by the block)."""
    if spec.offset_g is None:
        return int(spec.structure.offset)
    if not is_block(spec):
        return DIAG_FROM_LENGTHS  # make_spec's offset_g is kv_len - q_len, as the kernels'
    xp = spec.xp
    kv = spec.kv_len_g if spec.kv_len_g is not None else spec.S
    q = spec.q_len_g if spec.q_len_g is not None else spec.L
    if bool(xp.all(spec.offset_g == kv - q)):
        return DIAG_FROM_LENGTHS
    return None


def device_index(spec: AttentionSpec) -> int:
    """The CUDA device ordinal of the call's arrays (CuPy, PyTorch or JAX device)."""
    dev = spec.device
    for attr in ("index", "id"):  # torch.device, jax Device, cupy Device
        idx = getattr(dev, attr, None)
        if isinstance(idx, int):
            return idx
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def _batch_stride(
    shape: tuple[int, ...], strides: tuple[int, ...], lead: tuple[int, ...]
) -> int | None:
    """One element stride ``s`` with ``offset(flat batch b) = b * s`` for an array whose
    leading dims broadcast to ``lead``, or ``None`` when no single stride works."""
    bs: int | None = None
    span = 1
    for size, st, n in zip(reversed(shape), reversed(strides), reversed(lead), strict=True):
        if n == 1:
            continue
        eff = st if size > 1 else 0
        if bs is None:
            bs = eff
        elif eff != bs * span:
            return None
        span *= n
    return 0 if bs is None else bs


def _data_ptr(x: Any) -> int:
    ptr = getattr(getattr(x, "data", None), "ptr", None)  # CuPy: no interface dict to build
    if type(ptr) is int:
        return ptr
    iface = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    return int(iface["data"][0])


def _elem_strides(x: Any) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _padded_view(spec: AttentionSpec, x: Any) -> Any:
    nd = len(spec.lead) + 3
    if x.ndim < nd:
        x = x.reshape((1,) * (nd - x.ndim) + tuple(x.shape))
    return x


def operand(spec: AttentionSpec, x: Any, width: int, aligned16: bool) -> tuple[Any, int, int, int]:
    """``x`` (query/key/value, any layout) as ``(array, batch, head, row stride)`` in
    elements, zero-padded along the head dim to ``width``."""
    import cupy

    x = _padded_view(spec, x)
    if x.shape[-1] < width:
        pad = cupy.zeros(tuple(x.shape[:-1]) + (width - x.shape[-1],), dtype=x.dtype)
        x = cupy.concatenate([x, pad], axis=-1)
    lead = spec.lead

    def layout(a: Any) -> tuple[int, int, int] | None:
        st = _elem_strides(a)
        if a.shape[-1] > 1 and st[-1] != 1:
            return None
        bs = _batch_stride(tuple(a.shape[:-3]), st[:-3], lead)
        if bs is None:
            return None
        hs = st[-3] if a.shape[-3] > 1 else 0
        rs = st[-2] if a.shape[-2] > 1 else width
        per16 = 16 // a.dtype.itemsize  # elements per 16 bytes
        if aligned16 and (_data_ptr(a) % 16 or bs % per16 or hs % per16 or rs % per16):
            return None
        return bs, hs, rs

    got = layout(x)
    if got is None:
        x = cupy.ascontiguousarray(x)
        got = layout(x)
    if got is None:  # broadcast over several leading dims: materialise those dims only
        x = cupy.ascontiguousarray(cupy.broadcast_to(x, lead + tuple(x.shape[-3:])))
        got = layout(x)
    assert got is not None
    return (x,) + got


def mask_operand(spec: AttentionSpec, mask: Any, acc: Any) -> tuple[Any, ...]:
    """The dense mask as ``(array, batch, head, row, col strides)``: bool as uint8, float
    cast to the accumulation dtype; broadcast dims get stride 0."""
    import cupy

    m = _padded_view(spec, mask)
    if spec.mask_kind == "bool":
        m = m.astype(cupy.uint8) if m.dtype != cupy.bool_ else m.view(cupy.uint8)
    else:
        m = m.astype(acc)

    def layout(a: Any) -> tuple[int, ...] | None:
        st = _elem_strides(a)
        bs = _batch_stride(tuple(a.shape[:-3]), st[:-3], spec.lead)
        if bs is None:
            return None
        return (bs,) + tuple(s if n > 1 else 0 for s, n in zip(st[-3:], a.shape[-3:], strict=True))

    got = layout(m)
    if got is None:
        m = cupy.ascontiguousarray(cupy.broadcast_to(m, spec.lead + tuple(m.shape[-3:])))
        got = layout(m)
    assert got is not None  # contiguous over the broadcast leading dims: one batch stride
    return (m,) + got


def per_head_operand(spec: AttentionSpec, x: Any, acc: Any) -> Any:
    """A per-head array (``sinks``, ``alibi_slopes``, broadcastable to ``(*lead, Hq)``) as
    the kernels read it: contiguous ``(B * Hq,)`` in the accumulation dtype, or ``None``."""
    import cupy

    if x is None:
        return None
    a = cupy.asarray(x).astype(acc, copy=False)
    a = a.reshape((1,) * (len(spec.lead) + 1 - a.ndim) + tuple(a.shape))
    a = cupy.broadcast_to(a, spec.lead + (spec.Hq,))
    return cupy.ascontiguousarray(a).reshape(spec.batch_size * spec.Hq)


def lengths_operand(spec: AttentionSpec, name: str) -> Any:
    """``spec.<name>`` (``q_len_g``, ``kv_len_g``) as contiguous int32 ``(B,)``, or ``None``."""
    import cupy

    x = getattr(spec, name, None)
    if x is None:
        return None
    return cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.int32).reshape(spec.batch_size))
