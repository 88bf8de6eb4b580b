"""Structured attention in FlexAttention's vocabulary: ``mask_mod``, ``score_mod`` and
block-sparse masks, for every library arrayattn runs on.

Porting from ``torch.nn.attention.flex_attention``::

    from arrayattn.flex import create_block_mask, causal_mask, document_mask, and_masks
    block_mask = create_block_mask(document_mask(doc_ids, causal=True), B, None, L, L)
    out = arrayattn.scaled_dot_product_attention(q, k, v, block_mask=block_mask)

- :func:`create_block_mask` and :class:`BlockMask`: which blocks are empty (skipped),
  full (no mask test) or partial (the mask_mod evaluated on the block), built without the
  dense ``L x S`` mask;
- mask_mods: :data:`causal_mask`, :func:`causal`, :func:`sliding_window_mask`,
  :func:`document_mask`, :func:`prefix_lm_mask`, :func:`global_tokens_mask`,
  :data:`noop_mask`, combined with :func:`and_masks` / :func:`or_masks`; any function
  ``mask_mod(b, h, q_idx, kv_idx) -> bool`` written with array-API operations works too;
- score_mods: :class:`ScoreMod` (a function with its derivative, so the backward stays
  hand-written), :func:`relative_position_bias` (T5), :func:`relative_position_bias_2d`
  (Swin), :func:`alibi_score_mod`, :func:`softcap_score_mod`.

Semantics: ``../shared/SEMANTICS.md``, "Structured masks and score modifiers"; the docs
page "Structured attention" has pictures of each built-in and a porting table.
"""

from .attention.block_mask import BlockMask, create_block_mask
from .attention.mask_mods import (
    MaskMod,
    and_masks,
    causal,
    causal_mask,
    document_mask,
    global_tokens_mask,
    noop_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)
from .attention.score_mods import (
    ScoreMod,
    alibi_score_mod,
    relative_position_bias,
    relative_position_bias_2d,
    softcap_score_mod,
    t5_relative_position_bucket,
)

__all__ = [
    "BlockMask",
    "create_block_mask",
    "MaskMod",
    "and_masks",
    "or_masks",
    "noop_mask",
    "causal",
    "causal_mask",
    "sliding_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "global_tokens_mask",
    "ScoreMod",
    "relative_position_bias",
    "relative_position_bias_2d",
    "t5_relative_position_bucket",
    "alibi_score_mod",
    "softcap_score_mod",
]
