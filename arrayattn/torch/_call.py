"""A call's torch tensors at arrayattn's door: what it may pass, the dropout seed
PyTorch's generator gives, and which implementation runs it on the tensors' device.

Where the data goes from here (:mod:`._tensors`): CPU tensors of a NumPy dtype as
zero-copy NumPy views (the NumPy fast path), CUDA tensors through DLPack to the fused
kernels (:mod:`arrayattn.attention.cuda._bridge`, bfloat16 as its 16-bit storage), and
the rest (CPU bfloat16, which NumPy cannot hold) as the tensors themselves, on arrayattn's
array-API paths in PyTorch operations.
"""

from __future__ import annotations

import importlib.util
import numbers
from typing import Any

import torch

from ..attention.registry import registered
from ..attention.spec import AttentionSpec

__all__ = ["check_tensors", "check_no_grad_wanted", "draw_torch_seed", "route"]

CUPY_HINT = (
    "pip install 'arrayattn[cuda12]' (cupy-cuda12x) or 'arrayattn[cuda13]' (cupy-cuda13x), "
    "matching your CUDA"
)
"""What to install for CUDA tensors (named in the error a CUDA call without CuPy gets)."""


def check_tensors(**arrays: Any) -> None:
    """Raise a ``TypeError`` naming the first entry that is neither ``None`` nor a
    ``torch.Tensor`` (``query``, ``key`` and ``value`` may not be ``None``), that is on
    another device than the first, or (``key``, ``value``) of another dtype than
    ``query``."""
    first: tuple[str, torch.device] | None = None
    for name, x in arrays.items():
        if x is None and name not in ("query", "key", "value"):
            continue
        if not isinstance(x, torch.Tensor):
            kind = "None" if x is None else f"{type(x).__module__}.{type(x).__qualname__}"
            raise TypeError(f"{name} must be a torch.Tensor, got {kind}")
        if first is None:
            first = (name, x.device)
        if x.device != first[1]:
            raise TypeError(
                f"{name} is on device {x.device} but {first[0]} is on device {first[1]}; "
                "all tensors of one call must be on one device"
            )
        if name in ("key", "value") and x.dtype != arrays["query"].dtype:
            raise TypeError(
                f"{name} dtype {x.dtype} differs from query dtype {arrays['query'].dtype}; "
                "expected one dtype"
            )


def check_no_grad_wanted(**arrays: torch.Tensor | None) -> None:
    """Raise a ``ValueError`` naming an argument that requires grad under grad mode but
    has no gradient in arrayattn (``alibi_slopes``: constants, as in FlashAttention):
    autograd would otherwise leave its ``.grad`` silently unset."""
    if not torch.is_grad_enabled():
        return
    for name, x in arrays.items():
        if x is not None and x.requires_grad:
            raise ValueError(
                f"{name} requires grad, but arrayattn returns no gradient for {name} "
                f"(constants, as in FlashAttention); pass {name}.detach(), or compute its "
                "bias as a float attn_mask, which gets one"
            )


def draw_torch_seed(dropout_p: Any, seed: Any) -> Any:
    """The dropout seed of a call: ``seed`` as given, or, when dropout is on and none
    was given, 32 bits drawn from PyTorch's default CPU generator, so ``torch.manual_seed``
    makes the masks reproducible as it does ``torch.nn.functional.dropout``'s. (The
    backward regenerates the mask from this seed.) Invalid values are left to the spec's
    checks, which name them."""
    if seed is not None or isinstance(dropout_p, bool):
        return seed
    if not isinstance(dropout_p, numbers.Real) or not float(dropout_p) > 0.0:
        return seed
    return int(torch.randint(0, 2**32, (1,), dtype=torch.int64).item())


def route(spec: AttentionSpec, implementation: str) -> str:
    """The implementation name to ask the registry for: on CUDA tensors,
    ``implementation="auto"`` means arrayattn's fused kernels through DLPack
    (``"fused"``), or ``"auto"``'s array-API choice where the kernels decline the call.
    A CUDA call that needs the kernels without CuPy installed is an ``ImportError``
    saying what to install. Other devices: ``implementation`` unchanged."""
    if getattr(spec.device, "type", None) != "cuda" or implementation not in ("auto", "fused"):
        return implementation
    if importlib.util.find_spec("cupy") is None:
        raise ImportError(
            f"query is a CUDA tensor ({spec.device}): arrayattn runs CUDA tensors on its "
            f"CUDA kernels through CuPy, which is not installed; {CUPY_HINT}. "
            "implementation='chunked' runs arrayattn's array-API path in PyTorch "
            "operations instead.",
            name="cupy",
        )
    if implementation == "fused":
        return implementation
    fused = registered("fused")
    if fused is not None and fused.declines(spec) is None:
        return "fused"
    return "auto"
