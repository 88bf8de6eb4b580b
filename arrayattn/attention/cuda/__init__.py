"""``implementation="fused"``: CUDA kernels of our own on CuPy arrays, loaded through
``cupy.RawModule`` and cached per device.

- ``attn_fwd.cu`` / :mod:`.fused`: the FlashAttention-2 style prefill forward (and the
  implementation object, its declining and its ``"auto"`` rule);
- ``attn_bwd.cu`` / :mod:`.backward`: the backward (dK/dV with dQ atomics, or the
  deterministic dQ kernel);
- ``decode_attn.cu`` / :mod:`.decode`: split-KV decode for a few query rows over a long
  cache (also ``PagedKVCache``'s kernel path);
- :mod:`.operands`: how the kernels see a call (dtype kind, device, diagonal, operand
  layouts); :mod:`.flex_table`: block masks (``arrayattn.flex``) as the forward kernels
  read them; :mod:`.tiles`: the forward's tile shapes and schedule in plain Python;
  :mod:`._loader`: the ``.cu`` sources as CuPy compiles them; :mod:`._bridge`: PyTorch
  and JAX GPU arrays through DLPack; ``common.cuh``/``elem16.cuh``: shared device code.

Importing this package does not import CuPy. Where CuPy is installed it registers
``implementation="fused"``, first in ``implementation="auto"``'s order; it declines
anything but CuPy arrays under ``"auto"``, so NumPy-only installs never see it.
"""

from __future__ import annotations

import importlib.util

from ..registry import register_implementation

__all__ = ["register"]


def register() -> None:
    """Register ``implementation="fused"`` (auto rank -1: tried before every other path).

    Raises ``ImportError`` when CuPy is not installed, without importing it otherwise.
    """
    if importlib.util.find_spec("cupy") is None:
        raise ImportError("cupy is not installed; implementation='fused' is unavailable")
    from .fused import FUSED, auto_declines, declines

    register_implementation(
        "fused", FUSED, declines=declines, auto_rank=-1, auto_declines=auto_declines
    )


if importlib.util.find_spec("cupy") is not None:
    register()
