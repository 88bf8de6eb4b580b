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
from .._backend import Array, device_of, namespace_of, resolve_namespace
from ..ops._attention_spec import make_spec
from ..ops.attention import attention_weights, implementations, scaled_dot_product_attention
from ..ops.heads import merge_heads, split_heads
from ..ops.norms import layer_norm, rms_norm
from ..ops.rope import ROPE_LAYOUTS, apply_rope, rope_frequencies
from .kv_cache import KVCache, host_lengths
from .linear import linear
from .paged_kv_cache import PagedKVCache

__all__ = ["MultiHeadAttention", "Cotangents"]

QK_NORMS = ("rms", "layer")
QK_NORM_SCOPES = ("head", "full")
PADDING_SIDES = ("right", "left")

Params = dict[str, Array]


class Cotangents(tuple):
    """What a :meth:`MultiHeadAttention.vjp` pullback returns: the tuple
    ``(dx, dcontext, dparams)`` (so ``dx, dcontext, dparams = pullback(d_out)`` works),
    with the cotangents of the other inputs as attributes: :attr:`value` (the separate
    ``value`` input, else ``None``) and :attr:`attn_mask` (a float mask, else ``None``).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(embed_dim=8, num_heads=2)
        >>> params = mha.init(seed=0, xp=np, dtype=np.float64)
        >>> x, bias = np.ones((1, 3, 8)), np.zeros((1, 2, 3, 3))
        >>> y, pullback = mha.vjp(params, x, attn_mask=bias)
        >>> grads = pullback(np.ones_like(y))
        >>> grads.x.shape, grads.context, grads.attn_mask.shape
        ((1, 3, 8), None, (1, 2, 3, 3))
    """

    def __new__(cls, dx: Array, dcontext: Array | None, dparams: Params, dvalue: Any, dmask: Any):
        self = super().__new__(cls, (dx, dcontext, dparams))
        self._value, self._attn_mask = dvalue, dmask
        return self

    @property
    def x(self) -> Array:
        """Cotangent of ``x``."""
        return self[0]

    @property
    def context(self) -> Array | None:
        """Cotangent of ``context`` (keys' input; also values' without ``value``)."""
        return self[1]

    @property
    def params(self) -> Params:
        """One cotangent per parameter name."""
        return self[2]

    @property
    def value(self) -> Array | None:
        """Cotangent of the separate ``value`` input (``None`` without one)."""
        return self._value

    @property
    def attn_mask(self) -> Array | None:
        """Cotangent of a float ``attn_mask`` (a learned bias), in its shape; ``None`` for
        a bool mask or none."""
        return self._attn_mask


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _real(name: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        want = "a real number" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _flag(name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        want = "a bool" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")


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
                token has position 0; ``attn_mask`` cannot be combined with it.
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
        plan = self._check_call(
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
                back = tuple((n - s) % n for s in shifts)
                pullbacks[name] = lambda dy: (_roll_rows(dy, back),)
            return _roll_rows(a, shifts)

        if left:  # move each row's real tokens to the front (right padding)
            x = roll("roll_x", x, tuple(L_ - n for L_, n in zip(plan["L"], n_new, strict=True)))
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
            rot = self._rope_freqs(xp, x, positions, freqs, plan["starts"])
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
                self.alibi_slopes(), dtype=_stat_dtype(xp, x.dtype), device=device_of(x)
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
    def _check_call(
        self,
        x: Array,
        context: Array | None,
        value: Array | None,
        attn_mask: Array | None,
        positions: Any,
        freqs: Array | None,
        lengths: Any,
        padding_side: str,
        cache: Any,
        training: bool,
        seed: Any,
        need_weights: bool = False,
    ) -> dict[str, Any]:
        """Validate a call's arguments (nothing is computed or changed); returns what the
        forward needs: the host lengths of the new tokens and the cache's starts."""
        xp = namespace_of(x=x)
        if x.ndim < 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (..., L, embed_dim={self.embed_dim}), got {tuple(x.shape)}"
            )
        _flag("training", training)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
        if value is not None and context is None:
            raise ValueError("value (the values' input) needs context (the keys' input)")
        for name, a, width in (
            ("context", context, self.kv_input_dim),
            ("value", value, self.value_input_dim),
        ):
            if a is None:
                continue
            if a.ndim < 2 or a.shape[-1] != width:
                dim = "context_dim" if name == "context" else "value_context_dim"
                raise ValueError(
                    f"{name} must have shape (..., S, {dim}={width}), got {tuple(a.shape)}"
                )
        if value is not None and value.shape[-2] != context.shape[-2]:
            raise ValueError(
                f"value and context must have the same length S, got shapes "
                f"{tuple(value.shape)} and {tuple(context.shape)}"
            )
        if context is not None and (self.rope is not None or freqs is not None):
            raise ValueError(
                "context (cross-attention) with rope is not supported: RoPE positions of "
                "queries and context keys are not comparable"
            )
        if attn_mask is not None and not array_api_compat.is_array_api_obj(attn_mask):
            raise TypeError(f"attn_mask must be an array or None, got {type(attn_mask).__name__}")
        if attn_mask is not None and not (
            attn_mask.dtype == xp.bool or xp.isdtype(attn_mask.dtype, "real floating")
        ):
            raise TypeError(
                f"attn_mask must be bool (True = takes part) or real floating (added to the "
                f"scores), got {attn_mask.dtype}"
            )
        self._check_positions(x, positions, freqs)
        L = int(x.shape[-2])
        n_new: tuple[int, ...] | None = None
        lengths_array = None
        batched = lengths is not None or cache is not None or padding_side == "left"
        if batched and x.ndim != 3:
            raise ValueError(
                f"with a cache or lengths, x must be (B, L, embed_dim), got {tuple(x.shape)}"
            )
        B = int(x.shape[0])
        if lengths is not None:
            if context is not None:
                raise ValueError("lengths is for self-attention; mask a context with attn_mask")
            n_new = host_lengths("lengths", lengths, B, L)
            if cache is None:  # left padding is rolled to the right before attention
                lengths_array = xp.asarray(list(n_new), dtype=xp.int64, device=device_of(x))
        elif padding_side == "left":
            raise ValueError('padding_side="left" needs lengths (real tokens per row)')
        if padding_side == "left" and attn_mask is not None:
            raise ValueError(
                'attn_mask cannot be combined with padding_side="left"; lengths already masks '
                "the padding (use right padding for other masks)"
            )
        starts = None
        if cache is not None:
            if not isinstance(cache, (KVCache, PagedKVCache)):
                raise TypeError(
                    f"cache must be a KVCache or PagedKVCache, got {type(cache).__name__}"
                )
            if cache.batch_size != B:
                raise ValueError(
                    f"cache has {cache.batch_size} sequences (rows) but x has {B} rows"
                )
            kinds = (cache.num_kv_heads, cache.head_dim, cache.value_dim)
            want = (self.kv_heads, self.dim_per_head, self.value_dim_per_head)
            if kinds != want:
                raise ValueError(
                    f"cache holds (num_kv_heads, head_dim, value_dim) = {kinds}, this layer "
                    f"needs {want}"
                )
            if context is not None:
                if isinstance(cache, PagedKVCache):
                    raise ValueError(
                        "a PagedKVCache is for self-attention; use KVCache for context"
                    )
                held = cache.lengths
                S = int(context.shape[-2])
                if held.max() > 0 and (held != S).any():
                    raise ValueError(
                        f"cache holds the keys/values of a context of length {held.tolist()}, "
                        f"got a context of length {S}; call cache.reset() before attending to "
                        f"a new context"
                    )
                if held.max() == 0:
                    cache.check_append((S,) * B, x.dtype)
            else:
                if n_new is None:
                    n_new = (L,) * B
                cache.check_append(n_new, x.dtype)
                starts = cache.lengths.tolist()
            if isinstance(cache, PagedKVCache) and training and self.dropout_p > 0:
                raise ValueError("dropout (training=True) is not supported with a PagedKVCache")
            if isinstance(cache, PagedKVCache) and need_weights:
                raise ValueError("need_weights is not supported with a PagedKVCache")
        return {
            "n_new": n_new,
            "lengths_array": lengths_array,
            "starts": starts,
            "L": (L,) * B if batched else None,
        }

    def _check_positions(self, x: Array, positions: Any, freqs: Array | None) -> None:
        L = int(x.shape[-2])
        if positions is not None and freqs is not None:
            raise ValueError("give positions or freqs, not both")
        if freqs is not None:
            if self.rope is None:
                raise ValueError("freqs needs a rope layout (rope='half' or 'interleaved')")
            xp = namespace_of(freqs=freqs)
            if not xp.isdtype(freqs.dtype, "complex floating"):
                raise TypeError(f"freqs must be complex (exp(i * angle)), got {freqs.dtype}")
            if freqs.ndim not in (2, 3, 4) or freqs.shape[-2] != L:
                raise ValueError(
                    f"freqs must be (L, F), (B, L, F) or (B, 1, L, F) with L={L}, got shape "
                    f"{tuple(freqs.shape)}"
                )
            return
        if positions is None:
            return
        if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
            return
        if not array_api_compat.is_array_api_obj(positions):
            raise TypeError(
                f"positions must be an int or an integer array (L,) or (B, L), got "
                f"{type(positions).__name__} {positions!r}"
            )
        xp = namespace_of(x=x, positions=positions)
        if not (
            xp.isdtype(positions.dtype, "integral") or xp.isdtype(positions.dtype, "real floating")
        ):
            raise TypeError(f"positions must have an integer dtype, got {positions.dtype}")
        A = self.rope_position_axes
        if A is not None:
            if positions.ndim not in (2, 3) or tuple(positions.shape[-2:]) != (L, A):
                raise ValueError(
                    f"positions must be (L, A) or (B, L, A) with L={L} and A={A} axes (one "
                    f"column per axis), got shape {tuple(positions.shape)}"
                )
            return
        if positions.ndim not in (1, 2) or positions.shape[-1] != L:
            raise ValueError(
                f"positions must be an int or an array (L,) or (B, L) with L={L}, got shape "
                f"{tuple(positions.shape)}"
            )

    def _rope_freqs(
        self,
        xp: Any,
        x: Array,
        positions: Any,
        freqs: Array | None,
        starts: list[int] | None,
    ) -> Array:
        if freqs is not None:
            rot = freqs
        else:
            L = int(x.shape[-2])
            real = _stat_dtype(xp, x.dtype)
            dev = device_of(x)
            seq_len = None
            if positions is None and starts is not None and len(set(starts)) > 1:
                # Each sequence continues from its own cached length.
                pos = xp.asarray(
                    [[s + i for i in range(L)] for s in starts], dtype=real, device=dev
                )
                seq_len = max(starts) + L
            elif positions is None or isinstance(positions, numbers.Integral):
                start = (starts[0] if starts else 0) if positions is None else int(positions)
                pos = xp.arange(start, start + L, dtype=real, device=dev)
                seq_len = start + L
            else:
                pos = positions
                if self._needs_seq_len():  # HF's max(position_ids) + 1: read from the data
                    seq_len = int(xp.max(positions)) + 1
            A = self.rope_position_axes
            if A is not None and (positions is None or isinstance(positions, numbers.Integral)):
                pos = xp.stack([pos] * A, axis=-1)  # text tokens: every axis the same
            rot = self._frequencies(pos, real, seq_len)
        if rot.ndim == 3:  # (B, L, F) -> (B, 1, L, F): the same positions for every head
            rot = xp.expand_dims(rot, axis=1)
        return rot

    def _needs_seq_len(self) -> bool:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type")) in ("dynamic", "longrope")

    def _frequencies(self, pos: Array, real: Any, seq_len: int | None) -> Array:
        """The complex factors of this layer's RoPE variant at positions ``pos``."""
        scaled: dict[str, Any] = {}
        if self.rope_scaling is not None:
            scaled["rope_scaling"] = dict(self.rope_scaling)
            scaled["seq_len"] = seq_len
        if self.max_position_embeddings is not None:
            scaled["max_position_embeddings"] = self.max_position_embeddings
        if self.rope_axes is not None:
            from ..ops.rope_multi import multi_axis_rope_frequencies

            return multi_axis_rope_frequencies(
                self.rope_axes, pos, theta=self.rope_theta, dtype=real
            )
        if self.mrope_section is not None:
            from ..ops.rope_multi import mrope_frequencies

            return mrope_frequencies(
                self.dim_per_head,
                pos,
                self.mrope_section,
                theta=self.rope_theta,
                dtype=real,
                **scaled,
            )
        if self.partial_rotary_factor is not None:
            scaled["partial_rotary_factor"] = self.partial_rotary_factor
        return rope_frequencies(self.dim_per_head, pos, theta=self.rope_theta, dtype=real, **scaled)


def _stat_dtype(xp: Any, dtype: Any) -> Any:
    return xp.float64 if dtype == xp.float64 else xp.float32


def _roll_rows(x: Array, shifts: tuple[int, ...], axis: int = -2) -> Array:
    """Row ``b`` of ``x`` rotated left by ``shifts[b]`` along ``axis`` (a permutation per
    row: left padding <-> right padding)."""
    xp = namespace_of(x=x)
    n = int(x.shape[axis])
    ax = axis % x.ndim
    rows = []
    for b, s in enumerate(shifts):
        row = x[b : b + 1, ...]
        s = s % n if n else 0
        if s:
            head = tuple(slice(None) if d != ax else slice(s, None) for d in range(x.ndim))
            tail = tuple(slice(None) if d != ax else slice(0, s) for d in range(x.ndim))
            row = xp.concat((row[head], row[tail]), axis=ax)
        rows.append(row)
    return xp.concat(rows, axis=0)


def _to_namespace(arrays: Mapping[str, Any], xp: Any, device: Any, dtype: Any) -> Params:
    ns = resolve_namespace(xp)
    out: Params = {}
    for name, a in arrays.items():
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(
                f"state_dict[{name!r}] must be an array (NumPy, torch, ...), got {type(a).__name__}"
            )
        dt = _same_dtype(ns, a.dtype, name) if dtype is None else dtype
        out[name] = ns.asarray(_portable(a, ns), dtype=dt, device=device)
    return out


def _dtype_name(dtype: Any) -> str:
    # numpy/cupy/jax dtypes print as "float64", torch's as "torch.float64".
    return str(getattr(dtype, "name", None) or dtype).rsplit(".", 1)[-1]


def _same_dtype(ns: Any, dtype: Any, name: str) -> Any:
    """The target namespace's dtype with the same name as a checkpoint tensor's dtype
    (torch, NumPy, CuPy, JAX dtypes alike), so a float16 or float64 checkpoint keeps it."""
    dname = _dtype_name(dtype)
    target = getattr(ns, dname, None)
    if target is None or not ns.isdtype(target, "real floating"):
        raise TypeError(
            f"state_dict[{name!r}] has dtype {dtype}, which has no real floating counterpart "
            f"in the target library; pass dtype= to load() (e.g. float32)"
        )
    return target


def _portable(a: Any, ns: Any) -> Any:
    """``a`` in a form ``ns.asarray`` accepts: torch and CuPy tensors bound for another
    library go through host NumPy (torch's bfloat16 via float32)."""
    if array_api_compat.is_torch_array(a):
        a = a.detach()
        if array_api_compat.is_torch_namespace(ns):
            return a
        a = a.cpu()
        if _dtype_name(a.dtype) == "bfloat16":
            a = a.float()
        return a.numpy()
    if array_api_compat.is_cupy_array(a) and not array_api_compat.is_cupy_namespace(ns):
        return a.get()
    return a
