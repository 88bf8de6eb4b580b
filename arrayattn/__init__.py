"""arrayattn: attention written once against the Python array API standard.

Runs on NumPy, CuPy, array-api-strict, PyTorch, JAX and Dask arrays (through
array-api-compat); every op has a hand-written backward reachable through :func:`vjp`.
"""

from . import flex, nn
from ._autodiff import differentiable_ops, vjp
from ._backend import array_namespace, device
from .flex import BlockMask, ScoreMod, create_block_mask
from .ops import (
    ROPE_TYPES,
    apply_rope,
    attention_weights,
    cross_entropy,
    dropout_mask,
    grid_positions,
    implementations,
    layer_norm,
    log_softmax,
    merge_attention_states,
    merge_heads,
    mrope_frequencies,
    multi_axis_rope_frequencies,
    repeat_kv,
    rms_norm,
    rope_frequencies,
    rope_inv_freq,
    rope_kwargs_from_config,
    scaled_dot_product_attention,
    sinusoidal_embedding,
    softmax,
    split_heads,
    varlen_attention,
    wan_axes_dim,
)

__version__ = "0.1.0"

__all__ = [
    "array_namespace",
    "device",
    "scaled_dot_product_attention",
    "varlen_attention",
    "merge_attention_states",
    "attention_weights",
    "dropout_mask",
    "implementations",
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
    "vjp",
    "differentiable_ops",
    "nn",
    "flex",
    "create_block_mask",
    "BlockMask",
    "ScoreMod",
    "__version__",
]
