"""The ops: attention, softmax, heads, RoPE, norms (each with a backward rule)."""

from . import (
    _dask,  # noqa: F401  (registers implementation="dask" where Dask is installed)
    _numpy_fast,  # noqa: F401  (registers implementation="fast", NumPy)
    chunked,  # noqa: F401  (registers implementation="chunked")
)
from .attention import (
    attention_weights,
    dropout_mask,
    implementations,
    register_implementation,
    scaled_dot_product_attention,
)
from .heads import merge_heads, repeat_kv, split_heads
from .merge import merge_attention_states
from .norms import layer_norm, rms_norm
from .rope import apply_rope, rope_frequencies
from .rope_multi import grid_positions, mrope_frequencies, multi_axis_rope_frequencies, wan_axes_dim
from .rope_scaling import ROPE_TYPES, rope_inv_freq, rope_kwargs_from_config
from .sinusoidal import sinusoidal_embedding
from .softmax import softmax
from .varlen import varlen_attention


def _register_cuda_kernels() -> None:
    # implementation="fused" (CuPy kernels) exists only where CuPy is installed; this
    # checks for CuPy without importing it, so NumPy-only installs never load it.
    try:
        from ..kernels import register
    except ImportError:
        return
    try:
        register()
    except ImportError:
        pass


_register_cuda_kernels()

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
]
