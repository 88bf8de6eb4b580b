"""``block_mask=``, ``mask_mod=`` and ``score_mod=`` (:mod:`arrayattn.flex`) on torch
tensors: which library a call runs on, and the score_mod's parameters as autograd inputs.

A call runs either on NumPy views of CPU tensors (float16/32/64: the NumPy fast path) or
on the tensors themselves (arrayattn's array-API paths in PyTorch operations: CUDA
tensors, CPU bfloat16). A structured call runs where its masks live:

- a ``BlockMask`` built for NumPy (``create_block_mask``'s default) runs on the NumPy
  views (CPU tensors of float16/32/64 only); one built with ``xp=torch`` (and
  ``device=query.device``) on the tensors; any other library is a ``ValueError``;
- a ``mask_mod`` or ``score_mod`` holding torch tensors (document ids, ALiBi slopes, a
  closure) runs on the tensors, one holding NumPy arrays on the NumPy views;
- a ``ScoreMod``'s ``params`` (a bias table) are torch tensors that take part in
  autograd: they are inputs of the ``AttentionFunction`` and get their gradient from the
  hand-written backward (``arrayattn.vjp``'s ``"score_mod"`` entry). A score_mod that can
  be rebuilt over other arrays (``rebuild=``, the built-ins) runs over views of them on
  either side; one that cannot runs on the tensors.

Contradictory requirements (a NumPy block mask with a mask_mod holding torch tensors, a
NumPy block mask for CUDA tensors) are errors that say what to build instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.block_mask import BlockMask
from ..attention.held import held_libraries
from ..attention.mask_mods import as_mask_mod
from ..attention.score_mods import ScoreMod, as_score_mod
from ._tensors import Arrays

__all__ = ["Flex", "prepare_flex"]

_FOR_CPU = "float16/float32/float64 CPU tensors"


@dataclass(frozen=True)
class Flex:
    """A call's structured options, checked: ``numpy`` whether it runs on NumPy views
    (``None``: where the tensors run anyway), the score_mod as given (its ``params``
    the torch tensors autograd differentiates) or ``None``."""

    block_mask: BlockMask | None
    mask_mod: Any
    score_mod: ScoreMod | None
    numpy: bool | None

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return () if self.score_mod is None else tuple(self.score_mod.params)

    def backend_score_mod(self, arrays: Arrays) -> ScoreMod | None:
        """The score_mod over the arrays the call computes with (NumPy views, or
        detached tensors), or as given where it cannot be rebuilt."""
        smod = self.score_mod
        if smod is None or not smod.params or not smod.rebindable:
            return smod
        return smod.with_params(tuple(arrays.to_backend(p) for p in smod.params))


def prepare_flex(
    query: torch.Tensor, block_mask: Any, mask_mod: Any, score_mod: Any
) -> Flex | None:
    """Check the structured options of a call on ``query``'s device and decide where it
    runs (see the module); ``None`` when none is given.

    Examples:
        >>> import torch
        >>> from arrayattn.flex import create_block_mask, causal_mask
        >>> q = torch.ones(1, 2, 8, 4)
        >>> prepare_flex(q, create_block_mask(causal_mask, None, None, 8, 8), None, None).numpy
        True
        >>> prepare_flex(q, create_block_mask(causal_mask, None, None, 8, 8, xp=torch),
        ...              None, None).numpy
        False
    """
    if block_mask is None and mask_mod is None and score_mod is None:
        return None
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a BlockMask from arrayattn.flex.create_block_mask, got "
            f"{type(block_mask).__module__}.{type(block_mask).__qualname__}"
        )
    numpy_ok = Arrays(query).numpy
    where = f"{query.device} {query.dtype}"
    need: dict[str, str] = {}  # library -> why
    if block_mask is not None:
        lib = block_mask.library
        if lib not in ("numpy", "torch"):
            raise ValueError(
                f"block_mask was built for {lib} (create_block_mask(..., xp={lib})), but "
                f"query is a torch tensor on {query.device}: arrayattn.torch takes block "
                "masks built with create_block_mask(..., xp=torch, device=query.device), or "
                f"for {_FOR_CPU} the default (NumPy) ones"
            )
        need[lib] = f"block_mask was built for {lib}"
    mod = None if mask_mod is None else as_mask_mod(mask_mod)
    for name, obj, exclude in (
        ("block_mask's mask_mod", None if block_mask is None else block_mask.mask_mod, ()),
        ("mask_mod", mod, ()),
        ("score_mod", score_mod, ()),
    ):
        if obj is None:
            continue
        if name == "score_mod":
            given = as_score_mod(obj)
            exclude = tuple(given.params) if given.rebindable else ()
        libs = held_libraries(obj, exclude)
        other = libs - {"numpy", "torch"}
        if other:
            raise TypeError(
                f"{name} {obj!r} holds {', '.join(sorted(other))} arrays; on torch tensors "
                "it must hold torch tensors (or NumPy arrays, for CPU tensors)"
            )
        for lib in sorted(libs):
            need.setdefault(lib, f"{name} {obj!r} holds {lib} arrays")
    smod = None if score_mod is None else as_score_mod(score_mod)
    if smod is not None:
        for i, p in enumerate(smod.params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"score_mod {smod!r} params[{i}] must be a torch.Tensor (it takes part in "
                    f"autograd), got {type(p).__module__}.{type(p).__qualname__}"
                )
            if p.device != query.device:
                raise TypeError(
                    f"score_mod {smod!r} params[{i}] is on device {p.device} but query is on "
                    f"device {query.device}; expected one device"
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"score_mod {smod!r} params[{i}] must be a floating tensor, got {p.dtype}"
                )
        if smod.params and not smod.rebindable:
            need.setdefault(
                "torch", f"score_mod {smod!r} holds its params and has no rebuild= function"
            )
    if "numpy" in need and "torch" in need:
        raise TypeError(
            f"the call's structured options need two libraries: {need['numpy']}, but "
            f"{need['torch']}. Build them on one: create_block_mask(..., xp=torch, "
            "device=query.device) with torch tensors in the mask_mod/score_mod, or NumPy "
            "arrays throughout"
        )
    if "numpy" in need and not numpy_ok:
        raise ValueError(
            f"{need['numpy']}, which runs {_FOR_CPU}; query is {where}: build it on "
            "torch tensors instead (create_block_mask(..., xp=torch, device=query.device))"
        )
    if block_mask is not None and block_mask.library == "torch" and block_mask.device is not None:
        got = torch.device(block_mask.device)
        if got.type != query.device.type or (
            got.index is not None
            and query.device.index is not None
            and got.index != query.device.index
        ):
            raise ValueError(
                f"block_mask was built for device {block_mask.device} but query is on "
                f"device {query.device}; build it with create_block_mask(..., xp=torch, "
                "device=query.device)"
            )
        if str(got) != str(query.device):
            # check_call compares device strings: "cuda" and "cuda:0" are one device here
            # (the copy shares the mask's caches).
            block_mask = dataclasses.replace(block_mask, device=query.device)
    return Flex(block_mask, mask_mod, smod, numpy_ok and "torch" not in need)
