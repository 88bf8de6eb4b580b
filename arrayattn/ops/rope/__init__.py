"""Rotary position embeddings from complex arrays, and their variants.

- :mod:`.core`: :func:`rope_frequencies` (the complex factors ``exp(i * pos * theta_j)``,
  with Hugging Face ``rope_scaling``) and :func:`apply_rope` (with its backward), in the
  ``"interleaved"`` (Meta) and ``"half"`` (Hugging Face ``rotate_half``) layouts;
- :mod:`.scaling`: the scaled inverse-frequency ladders of Hugging Face's RoPE types
  (linear, dynamic NTK, llama3, YaRN, LongRoPE, partial rotary);
- :mod:`.multi`: multi-axis RoPE (Wan2.1/FLUX per-axis ladders, Qwen2-VL M-RoPE).
"""

from __future__ import annotations

from .core import ROPE_LAYOUTS, apply_rope, rope_frequencies
from .multi import grid_positions, mrope_frequencies, multi_axis_rope_frequencies, wan_axes_dim
from .scaling import ROPE_TYPES, rope_inv_freq, rope_kwargs_from_config

__all__ = [
    "rope_frequencies",
    "apply_rope",
    "ROPE_LAYOUTS",
    "ROPE_TYPES",
    "rope_inv_freq",
    "rope_kwargs_from_config",
    "multi_axis_rope_frequencies",
    "mrope_frequencies",
    "grid_positions",
    "wan_axes_dim",
]
