"""arrayattn for PyTorch users: attention on torch tensors whose backward, under
``loss.backward()``, is arrayattn's own (a ``torch.autograd.Function``).

- :func:`scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``'s
  signature plus FlashAttention's options, on CPU (the NumPy fast path through zero-copy
  views) and CUDA tensors (arrayattn's kernels through DLPack, CuPy needed);
- :class:`AttentionFunction`: the autograd function itself;
- ``register_hf_attention``, ``hf_attention_forward``: the Hugging Face attention
  interface (:mod:`arrayattn.torch.hf`, imported on first use, so that importing this
  package never imports transformers).

Importing this package needs PyTorch (``pip install torch``); ``import arrayattn`` does
not import it.
"""

from __future__ import annotations

from typing import Any


def _require_torch() -> None:
    try:
        import torch
    except ImportError as e:
        raise ModuleNotFoundError(
            "arrayattn.torch needs PyTorch, which is not installed: pip install torch "
            "(or pip install 'arrayattn[torch]')"
        ) from e
    # A folder named "torch" on sys.path (for example a checkout folder) imports as an empty
    # namespace package when the real one is missing.
    if not hasattr(torch, "autograd"):
        raise ImportError(
            f"arrayattn.torch needs PyTorch, but 'torch' is {getattr(torch, '__path__', torch)!r}, "
            "not PyTorch: pip install torch"
        )


_require_torch()

from ._function import AttentionFunction, scaled_dot_product_attention  # noqa: E402

__all__ = [
    "scaled_dot_product_attention",
    "AttentionFunction",
    "register_hf_attention",
    "hf_attention_forward",
]

_HF_NAMES = ("register_hf_attention", "hf_attention_forward")


def __getattr__(name: str) -> Any:
    """The Hugging Face names, imported on first use (they import transformers)."""
    if name in _HF_NAMES:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
