"""arrayattn inside Hugging Face transformers models: an attention function for
``transformers.AttentionInterface`` and the mask function beside it.

After :func:`register_hf_attention`, ``attn_implementation="arrayattn"`` (in
``from_pretrained``, ``from_config``, the config, or ``model.set_attn_implementation``)
runs every attention layer of a transformers model through
:func:`arrayattn.torch.scaled_dot_product_attention`, whose backward is arrayattn's own.

The mask function registered beside it is transformers' own ``sdpa_mask``: a
``(B, 1, L, S)`` bool mask (``True`` = takes part) holding padding, causality and
sliding windows, or ``None`` where transformers can tell that the mask is plain causal
(no padding) and SDPA's ``is_causal`` would do. :func:`hf_attention_forward` reads a
``None`` mask exactly as transformers' SDPA integration does, and passes causality (and
a layer's window) to arrayattn as structure instead of a dense mask.

This module imports transformers only inside its functions, so that importing
:mod:`arrayattn.torch` never needs it.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from ._function import scaled_dot_product_attention as _scaled_dot_product_attention

__all__ = ["register_hf_attention", "hf_attention_forward"]

# Names transformers reads itself: its own implementations, and the patterns it takes
# for flash/flex/SDPA variants, paged attention and hub kernels ("org/repo"), whose
# checks or loaders would run instead of ours.
_RESERVED = re.compile(r"^(eager|paged\|.*)$|flash|flex|sdpa|/|:")


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One transformers attention layer's attention, computed by arrayattn.

    The function transformers calls as ``attention_interface(self, query, key, value,
    attention_mask, dropout=..., scaling=..., **kwargs)`` once
    :func:`register_hf_attention` has registered it; transformers' SDPA integration's
    layout and return value.

    Shapes: ``query (B, Hq, L, D)``, ``key (B, Hkv, S, D)``, ``value (B, Hkv, S, Dv)``
    (``Hq`` a multiple of ``Hkv``: GQA, K/V never repeated) -> ``(out, None)`` with
    ``out (B, L, Hq, Dv)`` contiguous; no attention weights are ever formed.

    Args:
        module: the calling attention layer. Read for ``training`` (dropout only acts
            in training mode, as in transformers' eager attention) and ``is_causal``
            (default ``True``) when ``is_causal`` is not given.
        query, key, value: as above, one dtype and device; with a KV cache ``key`` and
            ``value`` hold the cache's keys, the queries' own included.
        attention_mask: the mask transformers built with the registered mask function:
            bool ``(B, 1, L, S)`` (``True`` = takes part), a float one added to the
            scores (a user's 4-D mask), or ``None``. A mask holds everything (padding,
            causality, windows) and is used alone. ``None`` means what it means to
            transformers' SDPA integration: causal for a causal layer with ``L > 1``
            (keys past the first ``L``, a static cache's empty slots at prefill, are
            dropped), every key for ``L == 1`` or a non-causal layer.
        dropout: attention-probability dropout, used when ``module.training``; its
            seed comes from PyTorch's default generator (``torch.manual_seed``
            reproduces it).
        scaling: score scale; ``None``: ``1 / sqrt(D)``.
        sliding_window: the layer's window in transformers' sense, the last
            ``sliding_window`` keys including the query's own (arrayattn's
            ``window=(sliding_window - 1, 0)``). Applied for a ``None`` mask of a causal
            layer; a mask already holds it.
        softcap: ``softcap * tanh(scores / softcap)`` before the masks (Gemma 2).
        s_aux: attention-sink logits, one per query head ``(Hq,)`` (gpt-oss): extra
            terms of every row's softmax denominator, differentiable.
        is_causal: overrides ``module.is_causal``.
        **kwargs: transformers' other keyword arguments (position ids, cache
            positions, ...), unused. ``position_bias`` (T5's learned bias) and a paged
            ``cache`` (continuous batching) are refused with a ``ValueError``;
            ``output_attentions=True`` warns (the weights are ``None``).

    Returns:
        ``(out, None)``: ``out (B, L, Hq, Dv)`` in ``query``'s dtype.

    Raises:
        ValueError: ``sliding_window`` not a positive int, ``position_bias`` or a paged
            ``cache`` given; arrayattn's own errors for shapes, dtypes and masks.

    Examples:
        >>> import torch
        >>> from arrayattn.torch.hf import hf_attention_forward
        >>> layer = torch.nn.Module()  # stands for a model's attention layer
        >>> g = torch.Generator().manual_seed(0)
        >>> q = torch.randn(2, 4, 5, 8, generator=g)  # (B, Hq, L, D)
        >>> kv = torch.randn(2, 2, 5, 8, generator=g)  # (B, Hkv, S, D)
        >>> out, weights = hf_attention_forward(layer, q, kv, kv, None, sliding_window=3)
        >>> out.shape, weights
        (torch.Size([2, 5, 4, 8]), None)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q, kv, kv, is_causal=True, enable_gqa=True).transpose(1, 2)
        >>> bool(torch.allclose(out[:, :3], ref[:, :3], atol=1e-6))  # inside the window
        True
    """
    _refuse_unsupported(kwargs)
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"sliding_window must be a positive int (the keys a query sees, its own "
            f"included) or None, got {sliding_window!r}"
        )
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    training = bool(getattr(module, "training", True))
    L = query.shape[-2]
    options: dict[str, Any] = {}
    if attention_mask is None and causal:
        if L > 1 and key.shape[-2] > L:
            # transformers gives no mask for a static cache's prefill (the cache starts
            # at position 0, the keys past L are empty slots): top-left causal, as SDPA
            # does; dropping those keys first spares work, as SDPA's integration does.
            key, value = key[..., :L, :], value[..., :L, :]
        # One query (decoding) sees every key it is given: bottom-right alignment.
        options["causal_align"] = "bottom_right" if L == 1 else "top_left"
        options["is_causal"] = True
        if sliding_window is not None:
            options["window"] = (sliding_window - 1, 0)
    out = _attend(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=float(dropout) if training else 0.0,
        scale=scaling,
        enable_gqa=query.shape[-3] != key.shape[-3],
        softcap=softcap,
        sinks=s_aux,
        **options,
    )
    return out.transpose(1, 2).contiguous(), None


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options: Any) -> Any:
    """The one call into arrayattn (tests replace it to count the layers it serves)."""
    return _scaled_dot_product_attention(query, key, value, **options)


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """A ``ValueError`` for the keyword arguments transformers passes that this function
    cannot honour, instead of ignoring them silently (a warning for
    ``output_attentions``, which SDPA's integration also only warns about)."""
    if kwargs.get("output_attentions"):
        warnings.warn(
            "output_attentions=True: the arrayattn attention function never forms the "
            "attention weights and returns None for them; use attn_implementation='eager' "
            "to get them",
            stacklevel=3,
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            "position_bias (a learned per-head bias, T5-style models) is not supported by "
            "the arrayattn attention function; use attn_implementation='sdpa' or 'eager' "
            "for this model"
        )
    if kwargs.get("cache") is not None:
        raise ValueError(
            f"cache={type(kwargs['cache']).__name__}: paged caches (continuous batching) "
            "are not supported by the arrayattn attention function; expected cache=None "
            "(use generate(), whose KV caches are supported)"
        )


def register_hf_attention(name: str = "arrayattn") -> str:
    """Register arrayattn with transformers under ``name``: the attention function
    (:func:`hf_attention_forward`, ``transformers.AttentionInterface``) and its mask
    function (transformers' ``sdpa_mask``, ``AttentionMaskInterface``). Calling it again
    is harmless.

    Without a mask function registered under the same name, transformers hands the
    attention function ``attention_mask=None`` and a padded batch's padding is silently
    ignored; this registers both.

    Args:
        name: the ``attn_implementation`` name to register; not one transformers reads
            itself (``"eager"``, names containing ``"sdpa"``, ``"flash"``, ``"flex"``,
            ``"/"`` or ``":"``, or starting with ``"paged|"``).

    Returns:
        ``name``, to pass as ``attn_implementation``.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is empty or one transformers reads itself.

    Examples:
        >>> import pytest
        >>> transformers = pytest.importorskip("transformers")
        >>> import torch
        >>> from arrayattn.torch import register_hf_attention
        >>> name = register_hf_attention()
        >>> config = transformers.LlamaConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, attn_implementation=name)
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
        >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding
        >>> with torch.no_grad():
        ...     ours = model(ids, attention_mask=mask).logits
        ...     model.set_attn_implementation("eager")
        ...     eager = model(ids, attention_mask=mask).logits
        >>> bool(torch.allclose(ours[mask.bool()], eager[mask.bool()], atol=1e-5))
        True
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}: {name!r}")
    if not name or _RESERVED.search(name):
        raise ValueError(
            f"name must be a new attention implementation name (not 'eager', not "
            f"containing 'sdpa', 'flash', 'flex', '/' or ':', not starting with "
            f"'paged|'), got {name!r}"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
