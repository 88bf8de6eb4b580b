"""Torch tensors to the arrays an implementation runs on, and its results back, with no
copy either way.

CPU tensors of a dtype NumPy has (float16, float32, float64) become NumPy views of their
memory (``t.detach().numpy()``: any strides, no copy), so the call is the NumPy call
exactly: ``"auto"`` chooses among the NumPy paths by their own cost model, and every
array the implementation sees, lengths and sinks included, is NumPy. Results come back
with ``torch.from_numpy`` (sharing the result's memory). Other tensors (CUDA, where the
fused kernels take them through DLPack themselves; CPU bfloat16) pass through as
detached tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from .._backend import NumpyBridge

__all__ = ["Arrays"]


class Arrays:
    """The conversion for one call, decided by ``query``: NumPy views for a CPU tensor
    of a NumPy dtype (unless ``numpy=False``), else the tensors themselves (detached).
    On the NumPy side, a floating tensor of a dtype NumPy lacks (a bfloat16 mask or
    sinks next to float32 queries) is widened to float32 first (exact; its gradient
    comes back in its dtype).

    Examples:
        >>> import torch
        >>> t = torch.ones(2, 3).t()  # a non-contiguous view
        >>> arrays = Arrays(t)
        >>> view = arrays.to_backend(t)
        >>> type(view).__name__, view.shape, view.strides  # the tensor's memory, no copy
        ('ndarray', (3, 2), (4, 12))
        >>> Arrays(t.bfloat16()).numpy  # NumPy has no bfloat16
        False
    """

    def __init__(self, query: torch.Tensor, numpy: bool | None = None) -> None:
        self._bridge = bridge = NumpyBridge(torch)
        can = query.device.type == "cpu" and bridge.dtype(query.dtype) is not None
        # numpy=False: the tensors themselves even where NumPy views could run (a call
        # whose block mask or mask_mod holds torch tensors, arrayattn.torch._flex).
        self.numpy = can if numpy is None else (can and numpy)

    def to_backend(self, x: torch.Tensor | None) -> Any:
        """``x`` as the implementation's array (``None`` stays ``None``)."""
        if x is None:
            return None
        if not self.numpy:
            return x.detach()
        if x.is_floating_point() and self._bridge.dtype(x.dtype) is None:
            x = x.detach().float()
        return self._bridge.to_numpy(x)

    def to_torch(self, a: Any, like: torch.Tensor | None = None) -> Any:
        """An implementation's result as a tensor (``None`` stays ``None``), in the dtype
        of ``like`` when given (the input a gradient belongs to)."""
        if a is None:
            return None
        t = self._bridge.from_numpy(a) if self.numpy else a
        return t if like is None or t.dtype == like.dtype else t.to(like.dtype)
