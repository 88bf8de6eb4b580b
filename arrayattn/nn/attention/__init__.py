"""``MultiHeadAttention``: projections, heads, optional qk-norm and RoPE, attention, output
projection; with GQA/MQA, cross-attention, dropout, KV caches and a hand-written backward.

Parameters live in a plain dict with Hugging Face names and PyTorch ``nn.Linear`` layout
``(out_features, in_features)``: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``
(or ``qkv_proj.weight`` rows ``[q; k; v]`` when packed), ``o_proj.weight``, their
``.bias``, and ``q_norm.weight``/``k_norm.weight`` (+ ``.bias`` for LayerNorm). A
checkpoint's tensors load by these names, or through ``rename=``
(:meth:`MultiHeadAttention.load`).

The backward (:meth:`MultiHeadAttention.vjp`) composes the pullbacks of the ops it calls
(``linear``, ``split_heads``, ``rms_norm``/``layer_norm``, ``apply_rope``,
``scaled_dot_product_attention``, ``merge_heads``); nothing is differentiated
automatically.

The package: :mod:`.config` (the fields, their checks, derived sizes, parameter shapes),
:mod:`.params` (fresh, loaded and checked parameters), :mod:`.call` (a call's
arguments, checked before anything runs), :mod:`.rope` (a call's RoPE factors),
:mod:`.cache` (KV caches and attention over them), :mod:`.forward` and
:mod:`.backward`; this module is the layer, its methods delegating to those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

from ..._backend import Array
from ...attention.block_mask import BlockMask
from .._cotangents import Cotangents
from .._validate import _flag
from ..cascade_cache import CascadeKVCache
from ..kv_cache import KVCache
from ..paged_kv_cache import PagedKVCache
from .backward import backward
from .cache import new_cache, new_paged_cache
from .config import QK_NORM_SCOPES, QK_NORMS, AttentionConfig
from .forward import flex_options, run
from .params import Params, check_params, init_params, load_params

__all__ = ["MultiHeadAttention", "Cotangents", "AttentionConfig", "QK_NORMS", "QK_NORM_SCOPES"]


@dataclass(frozen=True)
class MultiHeadAttention(AttentionConfig):
    """Multi-head attention layer (configuration only; parameters are a separate dict).

    Args:
        embed_dim: features of ``x`` and of the output.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``; ``1`` is MQA); default
            ``num_heads``. Query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        head_dim: query/key features per head ``D``; default ``embed_dim // num_heads``.
        v_head_dim: value features per head ``Dv`` (``d_v != d_k``); default ``head_dim``.
            ``o_proj`` then maps ``num_heads * v_head_dim`` features to ``embed_dim``.
        context_dim: features of the ``context`` that keys (and values) are projected
            from in cross-attention (PyTorch's ``kdim``); default ``embed_dim``.
        value_context_dim: features of a separate ``value`` input (PyTorch's ``vdim``,
            the tutorial's ``E_v``); default ``context_dim``.
        bias: biases on the q/k/v projections.
        out_bias: bias on ``o_proj``; default ``bias``.
        packed_qkv: one ``qkv_proj`` (rows ``[q; k; v]``, PyTorch's ``in_proj_weight``)
            instead of three projections. Self-attention runs one matmul; with a
            ``context`` the rows are split and applied to ``x``, ``context`` and
            ``value`` (as ``torch.nn.MultiheadAttention`` does), which needs every input
            ``embed_dim`` wide.
        qk_norm: ``None``, ``"rms"`` or ``"layer"``: norm of queries and keys before RoPE.
        qk_norm_scope: ``"head"`` (default): over ``head_dim`` of each head (timm's
            ``qk_norm``, Qwen3, Gemma 3), weights ``(head_dim,)``; ``"full"``: over the
            whole projected width before the head split (Wan2.1, OLMo 2), weights
            ``(num_heads * head_dim,)`` and ``(num_kv_heads * head_dim,)``.
        norm_eps: epsilon of the qk-norm.
        rope: ``None``, ``"interleaved"`` (Meta LLaMA) or ``"half"`` (Hugging Face
            ``rotate_half``): rotary embedding of queries and keys (self-attention only).
        rope_theta: RoPE base.
        causal: causal masking, bottom-right aligned (equal to PyTorch's top-left when
            ``L == S``; with a KV cache a new token sees the whole prefix).
        dropout_p: attention-probability dropout, applied when called with
            ``training=True``.
        scale: score scale; default ``1 / sqrt(head_dim)``.
        window: ``(left, right)`` sliding window (FlashAttention convention), or ``None``.
        softcap: ``softcap * tanh(scores / softcap)`` before masks (Gemma 2's
            ``attn_logit_softcapping``), or ``None``.
        sinks: learnable attention sinks (gpt-oss): a parameter ``sinks`` ``(num_heads,)``
            (Hugging Face's name), one logit per query head that joins every row's softmax
            denominator with no value; it gets a gradient.
        alibi: ALiBi (BLOOM, MPT): bias ``-slope_h * |i + offset - j|`` with the standard
            geometric slopes of :meth:`alibi_slopes` (no parameter, no gradient), never a
            dense mask on the fast, chunked and fused paths.
        rope_scaling: a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict as in
            ``config.json`` (``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``);
            ``yarn``/``longrope``'s attention factor scales the rotation as HF does.
        partial_rotary_factor: rotate only the first ``head_dim * factor`` features
            (the config field of that name).
        max_position_embeddings: the config field, read by some scaling types.
        rope_axes: multi-axis RoPE with an independent ladder per axis over a split of
            the head dim (Wan2.1's ``wan_axes_dim(head_dim)``, FLUX's ``axes_dim``);
            ``positions`` then have one column per axis, ``(L, A)`` or ``(B, L, A)``.
        mrope_section: Qwen2-VL's M-RoPE (one ladder, a position per section);
            ``positions`` ``(L, 3)`` or ``(B, L, 3)``. Without ``positions`` (text) every
            axis takes the 1-D positions.
        implementation: the attention implementation every call uses (``"auto"``,
            ``"composed"``, ``"chunked"``, ``"fast"`` on NumPy, ``"fused"`` on CuPy; see
            :func:`arrayattn.implementations`), as ``attn_implementation`` in Hugging
            Face configs.

    Shapes: ``x`` ``(..., L, embed_dim)``, ``context`` ``(..., S, context_dim)``, ``value``
    ``(..., S, value_context_dim)`` -> output ``(..., L, embed_dim)``; with a cache or
    ``lengths``, ``x`` is ``(B, L, embed_dim)``.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(embed_dim=32, num_heads=4, num_kv_heads=2,
        ...                          rope="half", causal=True, bias=False)
        >>> params = mha.init(seed=0, xp=np)
        >>> sorted(params)
        ['k_proj.weight', 'o_proj.weight', 'q_proj.weight', 'v_proj.weight']
        >>> x = np.ones((2, 5, 32), dtype=np.float32)
        >>> y, pullback = mha.vjp(params, x)
        >>> dx, dcontext, dparams = pullback(np.ones_like(y))
        >>> y.shape, dx.shape, dcontext, dparams["q_proj.weight"].shape
        ((2, 5, 32), (2, 5, 32), None, (32, 32))
    """

    # -- parameters -----------------------------------------------------------------
    def init(self, *, seed: int, xp: Any = None, device: Any = None, dtype: Any = None) -> Params:
        """Fresh parameters: projections uniform in ``+-1/sqrt(in_features)`` (PyTorch's
        ``nn.Linear`` default), norm weights one and norm biases zero. The numbers come
        from NumPy's generator seeded by ``seed`` (identical on every backend), then move
        to ``xp``/``device``/``dtype`` (default NumPy, float32).

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import MultiHeadAttention
            >>> p = MultiHeadAttention(8, 2).init(seed=0, xp=np, dtype=np.float64)
            >>> p["q_proj.weight"].shape, p["q_proj.weight"].dtype
            ((8, 8), dtype('float64'))
        """
        return init_params(self, seed=seed, xp=xp, device=device, dtype=dtype)

    def load(
        self,
        state_dict: Mapping[str, Any],
        *,
        prefix: str = "",
        rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
        strict: bool = True,
        check_finite: bool = True,
    ) -> Params:
        """Take this layer's tensors from a checkpoint dict (``safetensors.numpy.load_file``,
        a ``torch`` ``state_dict()``, ...) by their names under ``prefix``
        (``"model.layers.0.self_attn."``), moved to ``xp``/``device`` (default NumPy).

        Args:
            state_dict: name -> array (NumPy, torch, CuPy, JAX, ...).
            prefix: only names starting with it are read; it is removed before matching.
            rename: maps a checkpoint name (after the prefix) to this layer's name: a dict
                (names not in it are kept), or a function returning the new name, or
                ``None`` to skip that tensor. E.g. ``{"in_proj_weight":
                "qkv_proj.weight", "out_proj.weight": "o_proj.weight"}`` for
                ``torch.nn.MultiheadAttention``, ``{"norm_q.weight": "q_norm.weight"}``
                for Wan2.1.
            xp, device: where the parameters go.
            dtype: the dtype they are cast to; default: each tensor keeps its own dtype
                (a float64 ``torch`` state dict gives float64 arrays). A dtype the target
                library lacks (bfloat16 on NumPy) then is a ``TypeError`` asking for
                ``dtype=``.
            strict: reject names under ``prefix`` this configuration does not use.
            check_finite: a loaded parameter holding NaN or Inf (after the cast to
                ``dtype``) is a ``ValueError`` naming it; ``False`` loads it as it is.

        Missing names are always a ``KeyError``; the message lists the missing and the
        unexpected names together. A tensor whose dtype is not real floating (integer,
        bool, complex) is a ``TypeError``, a wrong shape a ``ValueError``.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import MultiHeadAttention
            >>> mha = MultiHeadAttention(8, 2, packed_qkv=True)
            >>> sd = {"attn.in_proj_weight": np.zeros((24, 8)), "attn.in_proj_bias": np.zeros(24),
            ...       "attn.out_proj.weight": np.zeros((8, 8)), "attn.out_proj.bias": np.zeros(8)}
            >>> p = mha.load(sd, prefix="attn.", rename=lambda n: n.replace("in_proj_", "qkv_proj.")
            ...              .replace("out_proj", "o_proj"))
            >>> sorted(p), p["o_proj.weight"].dtype
            (['o_proj.bias', 'o_proj.weight', 'qkv_proj.bias', 'qkv_proj.weight'], dtype('float64'))
        """
        return load_params(
            self,
            state_dict,
            prefix=prefix,
            rename=rename,
            xp=xp,
            device=device,
            dtype=dtype,
            strict=strict,
            check_finite=check_finite,
        )

    def check_params(self, params: Mapping[str, Array]) -> None:
        """Raise ``TypeError``/``KeyError``/``ValueError`` when ``params`` does not fit this
        layer: not a mapping, a value that is not an array, missing or unexpected names,
        wrong shapes.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import MultiHeadAttention
            >>> mha = MultiHeadAttention(8, 2)
            >>> mha.check_params(mha.init(seed=0, xp=np))  # fine: returns None
        """
        check_params(self, params)

    # -- caches -----------------------------------------------------------------------
    def new_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> KVCache:
        """An empty :class:`KVCache` for this layer (``(B, Hkv, max_length, head_dim)``,
        values ``v_head_dim``). ``dtype=None`` follows the parameters (the buffers are
        made at the first call, in the dtype, library and device of the keys).

        Examples:
            >>> from arrayattn.nn import MultiHeadAttention
            >>> MultiHeadAttention(8, 2).new_cache(3, 16).max_length
            16
        """
        return new_cache(self, batch_size, max_length, xp=xp, device=device, dtype=dtype)

    def new_paged_cache(
        self,
        batch_size: int,
        num_pages: int,
        page_size: int = 16,
        *,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> PagedKVCache:
        """An empty :class:`PagedKVCache` for this layer: ``batch_size`` sequence slots
        sharing ``num_pages`` pages of ``page_size`` tokens. ``dtype=None`` follows the
        parameters.

        Examples:
            >>> from arrayattn.nn import MultiHeadAttention
            >>> MultiHeadAttention(8, 2).new_paged_cache(4, num_pages=32).capacity
            512
        """
        return new_paged_cache(
            self, batch_size, num_pages, page_size, xp=xp, device=device, dtype=dtype
        )

    # -- forward and backward ---------------------------------------------------------
    # For type checkers: the output alone, or with need_weights=True (output, weights).
    @overload
    def __call__(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None = None,
        *,
        value: Array | None = None,
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        freqs: Array | None = None,
        lengths: Any = None,
        padding_side: str = "right",
        cache: KVCache | PagedKVCache | CascadeKVCache | None = None,
        training: bool = False,
        seed: int | None = None,
        need_weights: Literal[False] = False,
        average_attn_weights: bool = True,
        block_mask: BlockMask | None = None,
        mask_mod: Any = None,
        score_mod: Any = None,
    ) -> Array: ...
    @overload
    def __call__(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None = None,
        *,
        value: Array | None = None,
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        freqs: Array | None = None,
        lengths: Any = None,
        padding_side: str = "right",
        cache: KVCache | PagedKVCache | CascadeKVCache | None = None,
        training: bool = False,
        seed: int | None = None,
        need_weights: Literal[True],
        average_attn_weights: bool = True,
        block_mask: BlockMask | None = None,
        mask_mod: Any = None,
        score_mod: Any = None,
    ) -> tuple[Array, Array]: ...
    @overload
    def __call__(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None = None,
        *,
        value: Array | None = None,
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        freqs: Array | None = None,
        lengths: Any = None,
        padding_side: str = "right",
        cache: KVCache | PagedKVCache | CascadeKVCache | None = None,
        training: bool = False,
        seed: int | None = None,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        block_mask: BlockMask | None = None,
        mask_mod: Any = None,
        score_mod: Any = None,
    ) -> Array | tuple[Array, Array]: ...
    def __call__(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None = None,
        *,
        value: Array | None = None,
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        freqs: Array | None = None,
        lengths: Any = None,
        padding_side: str = "right",
        cache: KVCache | PagedKVCache | CascadeKVCache | None = None,
        training: bool = False,
        seed: int | None = None,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        block_mask: BlockMask | None = None,
        mask_mod: Any = None,
        score_mod: Any = None,
    ) -> Array | tuple[Array, Array]:
        """The layer's output ``(..., L, embed_dim)`` (and the attention weights with
        ``need_weights``).

        Args:
            params: the parameter dict (see :meth:`param_shapes`).
            x: queries' input ``(..., L, embed_dim)`` (also keys'/values' input in
                self-attention).
            context: keys'/values' input ``(..., S, context_dim)`` for cross-attention.
            value: a separate values' input ``(..., S, value_context_dim)`` (with
                ``context`` as the keys' input: PyTorch's ``key``/``value``).
            attn_mask: bool (``True`` = takes part) or additive float mask broadcastable
                to ``(..., Hq, L, S)`` (``S`` = the longest cached sequence with a cache),
                e.g. a padding mask ``(B, 1, 1, S)``. A float mask gets a gradient
                (:attr:`Cotangents.attn_mask`).
            positions: RoPE positions: an int (first position), or an int array ``(L,)``
                or ``(B, L)``; default: each sequence's cached length (or 0) onwards.
            freqs: precomputed complex RoPE factors for the new tokens instead of
                ``positions`` (multi-axis or scaled RoPE): ``(L, F)``, ``(B, L, F)`` or
                ``(B, 1, L, F)``, ``F <= head_dim // 2`` (the rest passes unrotated).
            lengths: real tokens per row of ``x`` ``(B,)`` (ints or an integer array), the
                rest is padding (self-attention). Without a cache it masks padded keys
                and empties padded query rows through ``q_lengths``/``kv_lengths`` (no
                dense mask). With a cache row ``b`` appends only its ``lengths[b]``
                tokens. Outputs at padded rows are ``o_proj``'s bias (no attention).
            padding_side: ``"right"`` (real tokens first) or ``"left"`` (real tokens
                last, as batched generation pads prompts); needs ``lengths``. Left-padded
                rows are moved to the right internally, so each sequence's first real
                token has position 0 (explicit ``positions``/``freqs``, given in the
                caller's layout, move with their rows); ``attn_mask`` cannot be combined
                with it.
            cache: a :class:`KVCache`, :class:`PagedKVCache` or
                :class:`CascadeKVCache`. Self-attention: row
                ``b``'s new keys/values are appended after its own cached tokens and its
                queries attend to everything it holds (bottom-right causal per sequence
                when ``causal``; per-sequence ``kv_lengths``, never a dense mask).
                Cross-attention (with ``context``, :class:`KVCache` only): the cache holds
                the context's keys/values, as in encoder-decoder decoding; a call with an
                empty cache projects the context and fills it, later calls reuse it
                (``context`` must then have the cached length; ``cache.reset()`` before a
                new context). A :class:`CascadeKVCache` (self-attention): the shared
                prefix, filled once by a call with ``cache=cascade.prefix`` on the common
                prompt, is read once for all rows and merged by LSE with each row's own
                suffix, which this call appends to (positions continue after the prefix).
                A call that raises leaves the cache unchanged.
            training: apply attention dropout (``dropout_p``).
            seed: dropout seed (drawn when ``None``).
            need_weights: also return the attention probabilities, as
                ``torch.nn.MultiheadAttention``: ``(..., L, S)`` averaged over heads
                (``average_attn_weights=True``) or ``(..., Hq, L, S)``. They cost an
                ``L x S`` matrix per head; not with a :class:`PagedKVCache`.
            average_attn_weights: see ``need_weights``.
            block_mask: a :class:`~arrayattn.flex.BlockMask` for the attention call
                ``(B, num_heads, L, S)`` (``B`` the flat batch of ``x``'s leading dims),
                passed to :func:`arrayattn.scaled_dot_product_attention` and ANDed with
                ``causal``, ``window``, ``attn_mask`` and ``lengths``; not with a cache
                or ``padding_side="left"``. Query/key indices are positions within the
                call (``0..L-1``, ``0..S-1``).
            mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (:mod:`arrayattn.flex`),
                alone or the one ``block_mask`` holds.
            score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to the
                scaled scores (after ``softcap`` and ALiBi); a :class:`~arrayattn.flex.ScoreMod`
                with its derivative for :meth:`vjp`, whose ``params`` (a T5 or Swin bias
                table) get gradients in :attr:`Cotangents.score_mod`.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import MultiHeadAttention
            >>> mha = MultiHeadAttention(embed_dim=8, num_heads=2, causal=True, rope="half")
            >>> p = mha.init(seed=0, xp=np)
            >>> prompts = np.ones((2, 4, 8), np.float32)     # row 1 has 2 real tokens
            >>> cache = mha.new_cache(batch_size=2, max_length=8)
            >>> y = mha(p, prompts, cache=cache, lengths=[4, 2])
            >>> y = mha(p, np.ones((2, 1, 8), np.float32), cache=cache)  # one step each
            >>> cache.lengths.tolist()
            [5, 3]
            >>> y, w = mha(p, prompts, need_weights=True)
            >>> w.shape
            (2, 4, 4)
        """
        _flag("need_weights", need_weights)
        _flag("average_attn_weights", average_attn_weights)
        out, info = run(
            self,
            params,
            x,
            context,
            value,
            attn_mask,
            positions,
            freqs,
            lengths,
            padding_side,
            cache,
            training,
            seed,
            need_weights,
            None,
            flex_options(block_mask, mask_mod, score_mod),
        )
        if not need_weights:
            return out
        w = info["weights"]
        if average_attn_weights:
            w = info["xp"].mean(w, axis=-3)
        return out, w

    forward = __call__

    def vjp(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None = None,
        *,
        value: Array | None = None,
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        freqs: Array | None = None,
        lengths: Any = None,
        padding_side: str = "right",
        training: bool = False,
        seed: int | None = None,
        block_mask: BlockMask | None = None,
        mask_mod: Any = None,
        score_mod: Any = None,
    ) -> tuple[Array, Callable[[Array], Cotangents]]:
        """Run the layer and return ``(out, pullback)``; ``pullback(d_out)`` returns
        :class:`Cotangents` ``(dx, dcontext, dparams)``: the cotangents of ``x``, of
        ``context`` (``None`` without one) and a dict with one entry per parameter; the
        separate ``value`` input's and a float ``attn_mask``'s are its attributes
        ``.value`` and ``.attn_mask``, a score_mod's parameters' ``.score_mod``. Same
        arguments as :meth:`__call__` (no cache: decoding needs no gradients). With
        dropout, the same mask (seed) is used forward and backward.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import MultiHeadAttention
            >>> mha = MultiHeadAttention(embed_dim=8, num_heads=2, context_dim=6,
            ...                          value_context_dim=5, v_head_dim=3)
            >>> p = mha.init(seed=0, xp=np)
            >>> x, k, v = (np.ones((1, n, d), np.float32) for n, d in ((2, 8), (4, 6), (4, 5)))
            >>> y, pullback = mha.vjp(p, x, k, value=v)
            >>> g = pullback(np.ones_like(y))
            >>> g.x.shape, g.context.shape, g.value.shape
            ((1, 2, 8), (1, 4, 6), (1, 4, 5))

            A document mask and a learned T5 bias table (its gradient in ``.score_mod``):

            >>> from arrayattn.flex import document_mask, relative_position_bias
            >>> table = np.zeros((32, 2), np.float32)          # (num_buckets, num_heads)
            >>> x, k, v = (np.ones((1, 6, d), np.float32) for d in (8, 6, 5))
            >>> y, pullback = mha.vjp(p, x, k, value=v,
            ...                       mask_mod=document_mask(np.arange(6) // 3),
            ...                       score_mod=relative_position_bias(table))
            >>> pullback(np.ones_like(y)).score_mod[0].shape
            (32, 2)
        """
        pullbacks: dict[str, Callable[..., tuple[Any, ...]]] = {}
        out, info = run(
            self,
            params,
            x,
            context,
            value,
            attn_mask,
            positions,
            freqs,
            lengths,
            padding_side,
            None,
            training,
            seed,
            False,
            pullbacks,
            flex_options(block_mask, mask_mod, score_mod),
        )

        def pullback(d_out: Array) -> Cotangents:
            return backward(self, pullbacks, info, d_out)

        return out, pullback
