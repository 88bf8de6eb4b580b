"""The public ops: attention, softmax, heads, RoPE, norms, merge, varlen, sinusoidal
embeddings, log-softmax and cross-entropy (each with a backward rule). Attention's
machinery (the spec, the registry, the implementations) is :mod:`arrayattn.attention`."""

from ..attention.merge import merge_attention_states
from .attention import (
    attention_weights,
    dropout_mask,
    implementations,
    register_implementation,
    scaled_dot_product_attention,
)
from .heads import merge_heads, repeat_kv, split_heads
from .losses import cross_entropy, log_softmax
from .norms import layer_norm, rms_norm
from .rope import (
    ROPE_TYPES,
    apply_rope,
    grid_positions,
    mrope_frequencies,
    multi_axis_rope_frequencies,
    rope_frequencies,
    rope_inv_freq,
    rope_kwargs_from_config,
    wan_axes_dim,
)
from .sinusoidal import sinusoidal_embedding
from .softmax import softmax
from .varlen import varlen_attention

__all__ = [
    "scaled_dot_product_attention",
    "varlen_attention",
    "merge_attention_states",
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
    "rope_inv_freq",
    "rope_kwargs_from_config",
    "ROPE_TYPES",
    "multi_axis_rope_frequencies",
    "mrope_frequencies",
    "grid_positions",
    "wan_axes_dim",
    "sinusoidal_embedding",
    "rms_norm",
    "layer_norm",
    "log_softmax",
    "cross_entropy",
]
