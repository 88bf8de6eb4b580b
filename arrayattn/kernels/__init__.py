"""CUDA kernels for CuPy arrays: the fused FlashAttention-2 forward (``attn_fwd.cu``) and
backward (``attn_bwd*.cu``), loaded through ``cupy.RawModule`` and cached per device.

Importing this package does not import CuPy. :func:`register` (called from
``arrayattn.ops`` when CuPy is installed) adds ``implementation="fused"``; it is first in
``implementation="auto"``'s order and declines anything but CuPy arrays, so NumPy-only
installs never see it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["register"]


def register() -> None:
    """Register ``implementation="fused"`` (auto rank -1: tried before every other path).

    Raises ``ImportError`` when CuPy is not installed, without importing it otherwise.
    """
    if importlib.util.find_spec("cupy") is None:
        raise ImportError("cupy is not installed; implementation='fused' is unavailable")
    from ..ops.attention import register_implementation
    from .fused import FUSED, auto_declines, declines

    register_implementation(
        "fused", FUSED, declines=declines, auto_rank=-1, auto_declines=auto_declines
    )
