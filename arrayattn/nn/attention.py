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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import array_api_compat

from .._autodiff import vjp
from .._backend import Array, device_of, lse_dtype, namespace_of, resolve_namespace
from ..ops._attention_spec import make_spec
from ..ops.attention import attention_weights, implementations, scaled_dot_product_attention
from ..ops.heads import merge_heads, split_heads
from ..ops.norms import layer_norm, rms_norm
from ..ops.rope import ROPE_LAYOUTS, apply_rope
from ._checkpoint import _to_namespace
from ._cotangents import Cotangents
from ._mha_call import check_call
from ._mha_rope import layer_rope_frequencies
from ._padding import _roll_rows
from ._validate import _count, _flag, _real
from .kv_cache import KVCache
from .linear import linear
from .paged_kv_cache import PagedKVCache

__all__ = ["MultiHeadAttention", "Cotangents"]

QK_NORMS = ("rms", "layer")
QK_NORM_SCOPES = ("head", "full")

Params = dict[str, Array]


@dataclass(frozen=True)
class MultiHeadAttention:
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

    embed_dim: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    context_dim: int | None = None
    value_context_dim: int | None = None
    bias: bool = True
    out_bias: bool | None = None
    packed_qkv: bool = False
    qk_norm: str | None = None
    qk_norm_scope: str = "head"
    norm_eps: float = 1e-6
    rope: str | None = None
    rope_theta: float = 10000.0
    causal: bool = False
    dropout_p: float = 0.0
    scale: float | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    alibi: bool = False
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    partial_rotary_factor: float | None = None
    max_position_embeddings: int | None = None
    rope_axes: tuple[int, ...] | None = None
    mrope_section: tuple[int, ...] | None = None
    implementation: str = "auto"

    def __post_init__(self) -> None:
        _count("embed_dim", self.embed_dim)
        hq = _count("num_heads", self.num_heads)
        hkv = _count("num_kv_heads", self.kv_heads)
        if hq % hkv:
            raise ValueError(
                f"num_heads={hq} must be a multiple of num_kv_heads={hkv} (GQA: Hq % Hkv == 0)"
            )
        if self.head_dim is None and self.embed_dim % hq:
            raise ValueError(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={hq}; pass head_dim"
            )
        for name in ("head_dim", "v_head_dim", "context_dim", "value_context_dim"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name))
        _flag("bias", self.bias)
        _flag("out_bias", self.out_bias, optional=True)
        _flag("packed_qkv", self.packed_qkv)
        _flag("causal", self.causal)
        if self.qk_norm not in (None,) + QK_NORMS:
            raise ValueError(f"qk_norm must be None or one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(
                f"qk_norm_scope must be one of {QK_NORM_SCOPES}, got {self.qk_norm_scope!r}"
            )
        if self.rope not in (None,) + ROPE_LAYOUTS:
            raise ValueError(f"rope must be None or one of {ROPE_LAYOUTS}, got {self.rope!r}")
        if self.rope is not None and self.dim_per_head % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.dim_per_head}")
        if self.packed_qkv and (self.kv_input_dim, self.value_input_dim) != (self.embed_dim,) * 2:
            raise ValueError(
                f"packed_qkv needs context_dim == value_context_dim == embed_dim (one weight "
                f"for every input), got context_dim={self.context_dim}, value_context_dim="
                f"{self.value_context_dim}, embed_dim={self.embed_dim}"
            )
        eps = _real("norm_eps", self.norm_eps)
        if eps < 0:
            raise ValueError(f"norm_eps must be a finite number >= 0, got {self.norm_eps!r}")
        if not 0.0 <= _real("dropout_p", self.dropout_p) < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {self.dropout_p!r}")
        if _real("rope_theta", self.rope_theta) <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        _real("scale", self.scale, optional=True)
        if self.softcap is not None and _real("softcap", self.softcap, optional=True) <= 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap!r}")
        if self.window is not None:
            w = self.window
            if (
                not isinstance(w, (tuple, list))
                or len(w) != 2
                or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in w)
                or any(b < -1 for b in w)
            ):
                raise ValueError(
                    f"window must be None or (left, right) ints >= -1 (-1 unbounded), got {w!r}"
                )
        _flag("sinks", self.sinks)
        _flag("alibi", self.alibi)
        self._check_rope_variants()
        if not isinstance(self.implementation, str) or self.implementation not in implementations():
            raise ValueError(
                f"implementation must be one of {implementations()}, got {self.implementation!r}"
            )

    def _check_rope_variants(self) -> None:
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Mapping):
            raise TypeError(
                f"rope_scaling must be a dict (config.json's rope_scaling) or None, got "
                f"{type(self.rope_scaling).__name__}"
            )
        if self.partial_rotary_factor is not None:
            f = _real("partial_rotary_factor", self.partial_rotary_factor)
            if not 0 < f <= 1:
                raise ValueError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        if self.max_position_embeddings is not None:
            _count("max_position_embeddings", self.max_position_embeddings)
        for name in ("rope_axes", "mrope_section"):
            axes = getattr(self, name)
            if axes is None:
                continue
            if not isinstance(axes, (tuple, list)) or not axes:
                raise TypeError(f"{name} must be a tuple of ints or None, got {axes!r}")
            for a in axes:
                _count(name, a)
            object.__setattr__(self, name, tuple(int(a) for a in axes))
        variants = [n for n in ("rope_axes", "mrope_section") if getattr(self, n) is not None]
        if variants and self.rope is None:
            raise ValueError(f"{variants[0]} needs a rope layout (rope='half' or 'interleaved')")
        if len(variants) > 1:
            raise ValueError("give rope_axes (per-axis ladders) or mrope_section, not both")
        if self.rope_axes is not None and sum(self.rope_axes) > self.dim_per_head:
            raise ValueError(
                f"rope_axes {self.rope_axes} rotate {sum(self.rope_axes)} features, more than "
                f"head_dim={self.dim_per_head}"
            )
        if self.rope_axes is not None and self.rope_scaling is not None:
            raise ValueError("rope_scaling applies to one ladder; it cannot scale rope_axes")

    @property
    def rope_position_axes(self) -> int | None:
        """Columns of a position (``A`` of multi-axis RoPE / M-RoPE), ``None`` for 1-D."""
        axes = self.rope_axes if self.rope_axes is not None else self.mrope_section
        return None if axes is None else len(axes)

    def alibi_slopes(self) -> tuple[float, ...]:
        """The ALiBi slope of each query head: ``2 ** (-8 h / n)`` for ``h = 1..n`` when
        ``n = num_heads`` is a power of two, else those of the next lower power of two
        followed by every other slope of the next higher one (Press et al., BLOOM, MPT).

        Examples:
            >>> from arrayattn.nn import MultiHeadAttention
            >>> MultiHeadAttention(8, 4, alibi=True).alibi_slopes()
            (0.25, 0.0625, 0.015625, 0.00390625)
        """
        n = self.num_heads

        def powers(m: int) -> list[float]:
            start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
            return [start ** (i + 1) for i in range(m)]

        low = 2 ** int(math.floor(math.log2(n)))
        slopes = powers(low) + powers(2 * low)[0::2][: n - low]
        return tuple(slopes)

    # -- derived sizes ----------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """``Hkv``."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        """``D``, the query/key features per head."""
        return self.embed_dim // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def value_dim_per_head(self) -> int:
        """``Dv``, the value features per head."""
        return self.dim_per_head if self.v_head_dim is None else self.v_head_dim

    @property
    def kv_input_dim(self) -> int:
        """Features of the keys' input (``context``, or ``x``)."""
        return self.embed_dim if self.context_dim is None else self.context_dim

    @property
    def value_input_dim(self) -> int:
        """Features of the values' input (``value``, else ``context``, else ``x``)."""
        return self.kv_input_dim if self.value_context_dim is None else self.value_context_dim

    @property
    def has_out_bias(self) -> bool:
        """Whether ``o_proj`` has a bias."""
        return self.bias if self.out_bias is None else self.out_bias

    def _widths(self) -> tuple[int, int, int]:
        D, Dv = self.dim_per_head, self.value_dim_per_head
        return self.num_heads * D, self.kv_heads * D, self.kv_heads * Dv

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameter names this configuration expects and their shapes.

        Examples:
            >>> from arrayattn.nn import MultiHeadAttention
            >>> MultiHeadAttention(8, 2, v_head_dim=3, bias=False).param_shapes()["o_proj.weight"]
            (8, 6)
        """
        E, C, Cv, D = self.embed_dim, self.kv_input_dim, self.value_input_dim, self.dim_per_head
        fq, fk, fv = self._widths()
        shapes: dict[str, tuple[int, ...]] = {}
        if self.packed_qkv:
            shapes["qkv_proj.weight"] = (fq + fk + fv, E)
            if self.bias:
                shapes["qkv_proj.bias"] = (fq + fk + fv,)
        else:
            for name, out_f, in_f in (("q_proj", fq, E), ("k_proj", fk, C), ("v_proj", fv, Cv)):
                shapes[f"{name}.weight"] = (out_f, in_f)
                if self.bias:
                    shapes[f"{name}.bias"] = (out_f,)
        shapes["o_proj.weight"] = (E, self.num_heads * self.value_dim_per_head)
        if self.has_out_bias:
            shapes["o_proj.bias"] = (E,)
        if self.sinks:
            shapes["sinks"] = (self.num_heads,)
        if self.qk_norm is not None:
            full = self.qk_norm_scope == "full"
            for name, width in (("q_norm", fq), ("k_norm", fk)):
                n = width if full else D
                shapes[f"{name}.weight"] = (n,)
                if self.qk_norm == "layer":
                    shapes[f"{name}.bias"] = (n,)
        return shapes

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
        import numpy as np

        rng = np.random.default_rng(seed)
        host: dict[str, Any] = {}
        shapes = self.param_shapes()
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                host[name] = np.ones(shape)
            elif name.endswith("norm.bias") or name == "sinks":
                host[name] = np.zeros(shape)
            else:
                fan_in = shapes[name.rsplit(".", 1)[0] + ".weight"][1]
                bound = 1.0 / math.sqrt(fan_in)
                host[name] = rng.uniform(-bound, bound, size=shape)
        ns = resolve_namespace(xp)
        return _to_namespace(host, ns, device, ns.float32 if dtype is None else dtype)

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

        Missing names are always a ``KeyError``; the message lists the missing and the
        unexpected names together.

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
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping of names to arrays, got {type(state_dict).__name__}"
            )
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__} {prefix!r}")
        if rename is not None and not (isinstance(rename, Mapping) or callable(rename)):
            raise TypeError(
                f"rename must be a mapping, a callable or None, got {type(rename).__name__}"
            )
        _flag("strict", strict)
        expected = self.param_shapes()
        found: dict[str, tuple[str, Any]] = {}
        for key, tensor in state_dict.items():
            if not isinstance(key, str) or not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            if rename is not None:
                name = rename.get(name, name) if isinstance(rename, Mapping) else rename(name)
                if name is None:
                    continue
            if name in found:
                raise ValueError(
                    f"state_dict names {found[name][0]!r} and {key!r} both map to {name!r}"
                )
            found[name] = (key, tensor)
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(found[n][0] for n in set(found) - set(expected))
        if missing or (strict and unexpected):
            raise KeyError(
                f"state_dict does not fit this configuration: missing {missing} (names after "
                f"prefix {prefix!r} and rename), unexpected {unexpected}"
                + (" (strict=False ignores unexpected names)" if unexpected else "")
            )
        params = _to_namespace({n: found[n][1] for n in expected}, xp, device, dtype)
        self.check_params(params)
        return params

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
        if not isinstance(params, Mapping):
            raise TypeError(
                f"params must be a mapping of parameter names to arrays (see param_shapes()), "
                f"got {type(params).__name__} {params!r:.60}"
            )
        expected = self.param_shapes()
        if set(params) != set(expected):
            missing = sorted(set(expected) - set(params))
            extra = sorted(set(params) - set(expected), key=str)
            raise KeyError(
                f"params must have exactly the names {sorted(expected)}; missing {missing}, "
                f"unexpected {extra}"
            )
        for name, shape in expected.items():
            a = params[name]
            if not array_api_compat.is_array_api_obj(a):
                raise TypeError(
                    f"params[{name!r}] must be an array, got {type(a).__name__}; convert it "
                    f"with xp.asarray"
                )
            got = tuple(int(d) for d in a.shape)
            if got != shape:
                raise ValueError(f"params[{name!r}] has shape {got}, expected {shape}")

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
        return KVCache.allocate(
            batch_size,
            self.kv_heads,
            max_length,
            self.dim_per_head,
            value_dim=self.value_dim_per_head,
            xp=xp,
            device=device,
            dtype=dtype,
        )

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
        return PagedKVCache(
            batch_size=batch_size,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=self.kv_heads,
            head_dim=self.dim_per_head,
            value_dim=self.value_dim_per_head,
            xp=xp,
            device=device,
            dtype=dtype,
        )

    # -- forward and backward ---------------------------------------------------------
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
        cache: KVCache | PagedKVCache | None = None,
        training: bool = False,
        seed: int | None = None,
        need_weights: bool = False,
        average_attn_weights: bool = True,
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
            cache: a :class:`KVCache` or :class:`PagedKVCache`. Self-attention: row
                ``b``'s new keys/values are appended after its own cached tokens and its
                queries attend to everything it holds (bottom-right causal per sequence
                when ``causal``; per-sequence ``kv_lengths``, never a dense mask).
                Cross-attention (with ``context``, :class:`KVCache` only): the cache holds
                the context's keys/values, as in encoder-decoder decoding; a call with an
                empty cache projects the context and fills it, later calls reuse it
                (``context`` must then have the cached length; ``cache.reset()`` before a
                new context). A call that raises leaves the cache unchanged.
            training: apply attention dropout (``dropout_p``).
            seed: dropout seed (drawn when ``None``).
            need_weights: also return the attention probabilities, as
                ``torch.nn.MultiheadAttention``: ``(..., L, S)`` averaged over heads
                (``average_attn_weights=True``) or ``(..., Hq, L, S)``. They cost an
                ``L x S`` matrix per head; not with a :class:`PagedKVCache`.
            average_attn_weights: see ``need_weights``.

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
        out, info = self._run(
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
    ) -> tuple[Array, Callable[[Array], Cotangents]]:
        """Run the layer and return ``(out, pullback)``; ``pullback(d_out)`` returns
        :class:`Cotangents` ``(dx, dcontext, dparams)``: the cotangents of ``x``, of
        ``context`` (``None`` without one) and a dict with one entry per parameter; the
        separate ``value`` input's and a float ``attn_mask``'s are its attributes
        ``.value`` and ``.attn_mask``. Same arguments as :meth:`__call__` (no cache:
        decoding needs no gradients). With dropout, the same mask (seed) is used forward
        and backward.

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
        """
        pullbacks: dict[str, Callable[..., tuple[Any, ...]]] = {}
        out, info = self._run(
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
        )

        def pullback(d_out: Array) -> Cotangents:
            return self._backward(pullbacks, info, d_out)

        return out, pullback

    # -- the forward pass ----------------------------------------------------------------
    def _run(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None,
        value: Array | None,
        attn_mask: Array | None,
        positions: Any,
        freqs: Array | None,
        lengths: Any,
        padding_side: str,
        cache: KVCache | PagedKVCache | None,
        training: bool,
        seed: int | None,
        need_weights: bool,
        pullbacks: dict[str, Callable[..., tuple[Any, ...]]] | None,
    ) -> tuple[Array, dict[str, Any]]:
        # Everything is validated before the cache changes: a rejected call changes nothing.
        self.check_params(params)
        xp = namespace_of(x=x, context=context, value=value, attn_mask=attn_mask, freqs=freqs)
        namespace_of(x=x, **{f"params[{k!r}]": v for k, v in params.items()})
        plan = check_call(
            self,
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
        )
        p = params
        n_new, left = plan["n_new"], padding_side == "left"

        def call(name: str, op: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            if pullbacks is None:
                return op(*args, **kw)
            out, pb = vjp(op, *args, **kw)
            pullbacks[name] = pb
            return out

        def roll(name: str, a: Array, shifts: tuple[int, ...]) -> Array:
            if pullbacks is not None:
                n = int(a.shape[-2])
                back = tuple((n - s) % n if n else 0 for s in shifts)
                pullbacks[name] = lambda dy: (_roll_rows(dy, back),)
            return _roll_rows(a, shifts)

        if left:  # move each row's real tokens to the front (right padding)
            shifts = tuple(L_ - n for L_, n in zip(plan["L"], n_new, strict=True))
            x = roll("roll_x", x, shifts)
            positions, freqs = _rolled_positions(xp, x, positions, freqs, shifts, self)
        Hq, Hkv = self.num_heads, self.kv_heads
        fq, fk, fv = self._widths()
        cross = context is not None
        reuse = cross and cache is not None and int(cache.lengths.max()) > 0
        # Projections.
        if self.packed_qkv and not cross:
            qkv = call("qkv", linear, x, p["qkv_proj.weight"], p.get("qkv_proj.bias"))
            q, k, v = qkv[..., :fq], qkv[..., fq : fq + fk], qkv[..., fq + fk :]
        else:
            w, b = self._projection(p, "q", (0, fq))
            q = call("q", linear, x, w, b)
            if not reuse:
                src_k = context if cross else x
                src_v = value if value is not None else src_k
                w, b = self._projection(p, "k", (fq, fq + fk))
                k = call("k", linear, src_k, w, b)
                w, b = self._projection(p, "v", (fq + fk, fq + fk + fv))
                v = call("v", linear, src_v, w, b)
        full_norm = self.qk_norm is not None and self.qk_norm_scope == "full"
        if full_norm:
            q = self._norm(call, "q", q, p)
        qh = call("q_heads", split_heads, q, Hq)
        if not full_norm:
            qh = self._norm(call, "q", qh, p)
        rot = None
        if self.rope is not None:
            rot = layer_rope_frequencies(self, xp, x, positions, freqs, plan["starts"])
            qh = call("q_rope", apply_rope, qh, rot, layout=self.rope)
        if reuse:
            # A filled cross-attention cache already holds the context's keys and values.
            kh, vh = cache.filled()
        else:
            if full_norm:
                k = self._norm(call, "k", k, p)
            kh = call("k_heads", split_heads, k, Hkv)
            if not full_norm:
                kh = self._norm(call, "k", kh, p)
            vh = call("v_heads", split_heads, v, Hkv)
            if rot is not None:
                kh = call("k_rope", apply_rope, kh, rot, layout=self.rope)
        use_dropout = training and self.dropout_p > 0
        opts: dict[str, Any] = dict(
            causal_align="bottom_right",
            window=self.window,
            softcap=self.softcap,
            seed=seed if use_dropout else None,
        )
        if self.sinks:
            opts["sinks"] = p["sinks"]
        if self.alibi:
            opts["alibi_slopes"] = xp.asarray(
                self.alibi_slopes(), dtype=lse_dtype(xp, x.dtype), device=device_of(x)
            )
        sdpa_args = (
            attn_mask,
            self.dropout_p if use_dropout else 0.0,
            self.causal,
            self.scale,
            True,
        )
        weights = None
        if cache is not None and not reuse:
            o, kh_all, lens = self._cached_attention(
                xp, cache, qh, kh, vh, n_new, cross, sdpa_args, opts
            )
            if need_weights:
                weights = attention_weights(qh, kh_all, *sdpa_args, **opts, **lens)
        else:
            lens = {}
            if plan["lengths_array"] is not None:
                lens = {"q_lengths": plan["lengths_array"], "kv_lengths": plan["lengths_array"]}
            o = call(
                "attention",
                scaled_dot_product_attention,
                qh,
                kh,
                vh,
                *sdpa_args,
                **opts,
                implementation=self.implementation,
                **lens,
            )
            if need_weights:
                weights = attention_weights(qh, kh, *sdpa_args, **opts, **lens)
        om = call("merge", merge_heads, o)
        out = call("o_proj", linear, om, p["o_proj.weight"], p.get("o_proj.bias"))
        if left:
            back = tuple(int(n) for n in n_new)
            out = roll("roll_out", out, back)
            if weights is not None:
                weights = _roll_rows(weights, back, axis=-2)
                if cache is None:  # key columns are x's rows, rolled too
                    weights = _roll_rows(weights, back, axis=-1)
        info = {
            "xp": xp,
            "cross": cross,
            "separate_value": value is not None,
            "left": left,
            "weights": weights,
            "float_mask": attn_mask is not None and attn_mask.dtype != xp.bool,
        }
        return out, info

    def _cached_attention(
        self,
        xp: Any,
        cache: KVCache | PagedKVCache,
        qh: Array,
        kh: Array,
        vh: Array,
        n_new: tuple[int, ...],
        cross: bool,
        sdpa_args: tuple[Any, ...],
        opts: dict[str, Any],
    ) -> tuple[Array, Array | None, dict[str, Array]]:
        """Append the new keys/values (each row at its own position) and attend; the
        cache is restored if anything fails."""
        L = int(qh.shape[-2])
        B = int(qh.shape[0])
        if cross:  # the context's keys/values fill the cache once; every query sees them
            n_new = (int(kh.shape[-2]),) * B
        starts = cache.lengths.tolist()
        totals = [s + n for s, n in zip(starts, n_new, strict=True)]
        S = max(totals)
        full_q = cross or all(n == L for n in n_new)
        full_kv = all(t == S for t in totals)
        # Check the attention call on views of the final shapes before writing anything.
        kk = xp.broadcast_to(kh[..., :1, :], (B, int(kh.shape[1]), S, int(kh.shape[3])))
        vv = xp.broadcast_to(vh[..., :1, :], (B, int(vh.shape[1]), S, int(vh.shape[3])))
        make_spec(
            qh,
            kk,
            vv,
            *sdpa_args,
            opts["causal_align"],
            opts["window"],
            opts["softcap"],
            opts["seed"],
            **{k: opts[k] for k in ("sinks", "alibi_slopes") if k in opts},
        )
        snap = cache._snapshot()
        try:
            if isinstance(cache, PagedKVCache):
                cache.append(kh, vh, n_new)
                attention_mask, _, _, scale, _ = sdpa_args
                o = cache.attend(
                    qh,
                    n_new,
                    scale=scale,
                    causal=self.causal,
                    window=self.window,
                    softcap=self.softcap,
                    attn_mask=attention_mask,
                    sinks=opts.get("sinks"),
                    alibi_slopes=opts.get("alibi_slopes"),
                )
                return o, None, {}
            keys, values = cache.append(kh, vh, n_new)
            lens: dict[str, Array] = {}
            if not full_kv:
                lens["kv_lengths"] = cache.kv_lengths(xp)
            if not full_q:
                lens["q_lengths"] = xp.asarray(list(n_new), dtype=xp.int64, device=device_of(qh))
                lens.setdefault("kv_lengths", cache.kv_lengths(xp))
            o = scaled_dot_product_attention(
                qh, keys, values, *sdpa_args, **opts, implementation=self.implementation, **lens
            )
            return o, keys, lens
        except BaseException:
            cache._restore(snap)
            raise

    def _projection(
        self, p: Mapping[str, Array], which: str, rows: tuple[int, int]
    ) -> tuple[Array, Array | None]:
        """Weight and bias of the ``q``/``k``/``v`` projection (rows of the packed one)."""
        if not self.packed_qkv:
            return p[f"{which}_proj.weight"], p.get(f"{which}_proj.bias")
        r0, r1 = rows
        b = p.get("qkv_proj.bias")
        return p["qkv_proj.weight"][r0:r1, :], None if b is None else b[r0:r1]

    def _norm(
        self, call: Callable[..., Any], which: str, h: Array, p: Mapping[str, Array]
    ) -> Array:
        """The qk-norm of queries (``which="q"``) or keys; ``h`` itself without one."""
        name = f"{which}_norm"
        if self.qk_norm == "rms":
            return call(name, rms_norm, h, p[f"{name}.weight"], self.norm_eps)
        if self.qk_norm == "layer":
            return call(name, layer_norm, h, p[f"{name}.weight"], p[f"{name}.bias"], self.norm_eps)
        return h

    # -- the backward pass ---------------------------------------------------------------
    def _backward(
        self,
        pullbacks: Mapping[str, Callable[..., tuple[Any, ...]]],
        info: Mapping[str, Any],
        d_out: Array,
    ) -> Cotangents:
        xp = info["xp"]
        grads: Params = {}
        if info["left"]:
            (d_out,) = pullbacks["roll_out"](d_out)

        d_om, dw, db = pullbacks["o_proj"](d_out)
        grads["o_proj.weight"] = dw
        if db is not None:
            grads["o_proj.bias"] = db
        (d_o,) = pullbacks["merge"](d_om)
        back = pullbacks["attention"](d_o)
        d_qh, d_kh, d_vh, d_mask = back[:4]
        if self.sinks:  # keyword arrays' cotangents come in a trailing dict
            grads["sinks"] = back[-1]["sinks"]
        if self.rope is not None:
            d_qh = pullbacks["q_rope"](d_qh)[0]
            d_kh = pullbacks["k_rope"](d_kh)[0]
        full_norm = self.qk_norm_scope == "full"
        if self.qk_norm is not None and not full_norm:
            d_qh = self._norm_back(pullbacks, grads, "q_norm", d_qh)
            d_kh = self._norm_back(pullbacks, grads, "k_norm", d_kh)
        d_q = pullbacks["q_heads"](d_qh)[0]
        d_k = pullbacks["k_heads"](d_kh)[0]
        d_v = pullbacks["v_heads"](d_vh)[0]
        if self.qk_norm is not None and full_norm:
            d_q = self._norm_back(pullbacks, grads, "q_norm", d_q)
            d_k = self._norm_back(pullbacks, grads, "k_norm", d_k)
        if self.packed_qkv and not info["cross"]:
            d_x, dw, db = pullbacks["qkv"](xp.concat((d_q, d_k, d_v), axis=-1))
            grads["qkv_proj.weight"] = dw
            if db is not None:
                grads["qkv_proj.bias"] = db
            d_src_k = d_src_v = None
        else:
            parts = {w: pullbacks[w](d) for w, d in (("q", d_q), ("k", d_k), ("v", d_v))}
            d_x, d_src_k, d_src_v = parts["q"][0], parts["k"][0], parts["v"][0]
            if self.packed_qkv:  # rows of one weight: their gradients stack
                grads["qkv_proj.weight"] = xp.concat([parts[w][1] for w in "qkv"], axis=0)
                if self.bias:
                    grads["qkv_proj.bias"] = xp.concat([parts[w][2] for w in "qkv"], axis=0)
            else:
                for w in "qkv":
                    grads[f"{w}_proj.weight"] = parts[w][1]
                    if parts[w][2] is not None:
                        grads[f"{w}_proj.bias"] = parts[w][2]
        d_context = d_value = None
        if not info["cross"]:
            if d_src_k is not None:
                d_x = d_x + d_src_k + d_src_v
        elif info["separate_value"]:
            d_context, d_value = d_src_k, d_src_v
        else:
            d_context = d_src_k + d_src_v
        if info["left"]:
            (d_x,) = pullbacks["roll_x"](d_x)
        grads = {name: grads[name] for name in self.param_shapes()}
        return Cotangents(d_x, d_context, grads, d_value, d_mask if info["float_mask"] else None)

    def _norm_back(
        self,
        pullbacks: Mapping[str, Callable[..., tuple[Any, ...]]],
        grads: Params,
        name: str,
        d: Array,
    ) -> Array:
        back = pullbacks[name](d)
        grads[f"{name}.weight"] = back[1]
        if self.qk_norm == "layer":
            grads[f"{name}.bias"] = back[2]
        return back[0]

    # -- checks and helpers -------------------------------------------------------------


def _rolled_positions(
    xp: Any,
    x: Array,
    positions: Any,
    freqs: Array | None,
    shifts: tuple[int, ...],
    mha: MultiHeadAttention,
) -> tuple[Any, Array | None]:
    """Explicit positions / frequencies given for left-padded rows, rotated with them."""
    B, L = int(x.shape[0]), int(x.shape[-2])
    if positions is not None and not isinstance(positions, numbers.Integral):
        cols = () if mha.rope_position_axes is None else (mha.rope_position_axes,)
        positions = xp.broadcast_to(positions, (B, L) + cols)
        positions = _roll_rows(positions, shifts, axis=1)
    if freqs is not None:
        if freqs.ndim == 3:  # (B, L, F) -> (B, 1, L, F)
            freqs = xp.expand_dims(freqs, axis=1)
        freqs = _roll_rows(xp.broadcast_to(freqs, (B, 1, L, int(freqs.shape[-1]))), shifts)
    return positions, freqs
