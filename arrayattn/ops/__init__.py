"""The ops: attention, softmax, heads, RoPE, norms (each with a backward rule)."""

from .attention import (
    attention_weights,
    dropout_mask,
    implementations,
    register_implementation,
    scaled_dot_product_attention,
)
from .heads import merge_heads, repeat_kv, split_heads
from .norms import layer_norm, rms_norm
from .rope import apply_rope, rope_frequencies
from .softmax import softmax

__all__ = [
    "scaled_dot_product_attention",
    "attention_weights",
    "dropout_mask",
    "implementations",
    "register_implementation",
    "softmax",
    "split_heads",
    "merge_heads",
    "repeat_kv",
    "rope_frequencies",
    "apply_rope",
    "rms_norm",
    "layer_norm",
]
