"""Layers built on the ops: ``linear``, ``embedding``, activations, the layers ``Linear``,
``LayerNorm``, ``RMSNorm``, ``Embedding``, ``MLP``, and ``MultiHeadAttention`` with a
``KVCache`` (per-sequence lengths), a ``PagedKVCache`` or a ``CascadeKVCache`` (a shared
prefix held once); ``read_safetensors`` reads checkpoint files without trusting them
(``CheckpointError``). Parameters are plain dicts of
arrays with Hugging Face names; every layer's backward is composed from the ops'
hand-written pullbacks."""

from ._cotangents import Cotangents
from .activations import erf, gelu, silu
from .attention import MultiHeadAttention
from .cascade_cache import CascadeKVCache
from .checkpoint import CheckpointError, read_safetensors
from .embedding import embedding
from .kv_cache import KVCache
from .layers import MLP, Embedding, LayerCotangents, LayerNorm, Linear, RMSNorm
from .linear import linear
from .paged_kv_cache import PagedKVCache

__all__ = [
    "linear",
    "embedding",
    "erf",
    "gelu",
    "silu",
    "Linear",
    "LayerNorm",
    "RMSNorm",
    "Embedding",
    "MLP",
    "LayerCotangents",
    "MultiHeadAttention",
    "Cotangents",
    "KVCache",
    "PagedKVCache",
    "CheckpointError",
    "read_safetensors",
    "CascadeKVCache",
]
