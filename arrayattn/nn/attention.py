"""``MultiHeadAttention``: projections, heads, optional qk-norm and RoPE, attention, output
projection; with GQA/MQA, cross-attention, dropout, a KV cache and a hand-written backward.

Parameters live in a plain dict with Hugging Face names and PyTorch ``nn.Linear`` layout
``(out_features, in_features)``: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``
(or ``qkv_proj.weight`` rows ``[q; k; v]`` when packed), ``o_proj.weight``, their
``.bias``, and ``q_norm.weight``/``k_norm.weight`` (+ ``.bias`` for LayerNorm). A
checkpoint's tensors load without renaming (:meth:`MultiHeadAttention.load`).

The backward (:meth:`MultiHeadAttention.vjp`) composes the pullbacks of the ops it calls
(``linear``, ``split_heads``, ``rms_norm``/``layer_norm``, ``apply_rope``,
``scaled_dot_product_attention``, ``merge_heads``); nothing is differentiated
automatically.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._autodiff import vjp
from .._backend import Array, device_of, namespace_of, resolve_namespace
from ..ops.attention import implementations, scaled_dot_product_attention
from ..ops.heads import merge_heads, split_heads
from ..ops.norms import layer_norm, rms_norm
from ..ops.rope import ROPE_LAYOUTS, apply_rope, rope_frequencies
from .kv_cache import KVCache
from .linear import linear

__all__ = ["MultiHeadAttention"]

QK_NORMS = ("rms", "layer")

Params = dict[str, Array]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class MultiHeadAttention:
    """Multi-head attention layer (configuration only; parameters are a separate dict).

    Args:
        embed_dim: features of ``x`` and of the output.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``; ``1`` is MQA); default
            ``num_heads``. Query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        head_dim: features per head; default ``embed_dim // num_heads``.
        context_dim: features of the ``context`` that keys/values are projected from in
            cross-attention; default ``embed_dim``.
        bias: biases on the q/k/v projections.
        out_bias: bias on ``o_proj``; default ``bias``.
        packed_qkv: one ``qkv_proj`` (rows ``[q; k; v]``) instead of three projections
            (self-attention only).
        qk_norm: ``None``, ``"rms"`` or ``"layer"``: per-head norm of queries and keys
            over ``head_dim`` (timm's ``qk_norm``, Qwen3), before RoPE.
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
        implementation: the attention implementation every call uses (``"auto"``,
            ``"composed"``, ``"chunked"``, ``"fast"`` on NumPy, ``"fused"`` on CuPy; see
            :func:`arrayattn.implementations`), as ``attn_implementation`` in Hugging
            Face configs.

    Shapes: ``x`` ``(..., L, embed_dim)``, ``context`` ``(..., S, context_dim)`` -> output
    ``(..., L, embed_dim)``; with a cache, ``x`` is ``(B, L, embed_dim)``.

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
    context_dim: int | None = None
    bias: bool = True
    out_bias: bool | None = None
    packed_qkv: bool = False
    qk_norm: str | None = None
    norm_eps: float = 1e-6
    rope: str | None = None
    rope_theta: float = 10000.0
    causal: bool = False
    dropout_p: float = 0.0
    scale: float | None = None
    window: tuple[int, int] | None = None
    implementation: str = "auto"

    def __post_init__(self) -> None:
        _positive_int("embed_dim", self.embed_dim)
        hq = _positive_int("num_heads", self.num_heads)
        hkv = _positive_int("num_kv_heads", self.kv_heads)
        if hq % hkv:
            raise ValueError(
                f"num_heads={hq} must be a multiple of num_kv_heads={hkv} (GQA: Hq % Hkv == 0)"
            )
        if self.head_dim is None and self.embed_dim % hq:
            raise ValueError(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={hq}; pass head_dim"
            )
        _positive_int("head_dim", self.dim_per_head)
        _positive_int("context_dim", self.kv_input_dim)
        if self.qk_norm not in (None,) + QK_NORMS:
            raise ValueError(f"qk_norm must be None or one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.rope not in (None,) + ROPE_LAYOUTS:
            raise ValueError(f"rope must be None or one of {ROPE_LAYOUTS}, got {self.rope!r}")
        if self.rope is not None and self.dim_per_head % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.dim_per_head}")
        if self.packed_qkv and self.kv_input_dim != self.embed_dim:
            raise ValueError(
                f"packed_qkv needs context_dim == embed_dim (self-attention), got "
                f"context_dim={self.context_dim}, embed_dim={self.embed_dim}"
            )
        if not 0.0 <= float(self.dropout_p) < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {self.dropout_p!r}")
        if self.implementation not in implementations():
            raise ValueError(
                f"implementation must be one of {implementations()}, got {self.implementation!r}"
            )
        if not (math.isfinite(self.norm_eps) and self.norm_eps >= 0):
            raise ValueError(f"norm_eps must be a finite number >= 0, got {self.norm_eps!r}")

    # -- derived sizes ----------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.embed_dim // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def kv_input_dim(self) -> int:
        return self.embed_dim if self.context_dim is None else self.context_dim

    @property
    def has_out_bias(self) -> bool:
        return self.bias if self.out_bias is None else self.out_bias

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameter names this configuration expects and their shapes."""
        E, C, D = self.embed_dim, self.kv_input_dim, self.dim_per_head
        fq, fkv = self.num_heads * D, self.kv_heads * D
        shapes: dict[str, tuple[int, ...]] = {}
        if self.packed_qkv:
            shapes["qkv_proj.weight"] = (fq + 2 * fkv, E)
            if self.bias:
                shapes["qkv_proj.bias"] = (fq + 2 * fkv,)
        else:
            for name, out_f, in_f in (("q_proj", fq, E), ("k_proj", fkv, C), ("v_proj", fkv, C)):
                shapes[f"{name}.weight"] = (out_f, in_f)
                if self.bias:
                    shapes[f"{name}.bias"] = (out_f,)
        shapes["o_proj.weight"] = (E, fq)
        if self.has_out_bias:
            shapes["o_proj.bias"] = (E,)
        if self.qk_norm is not None:
            for name in ("q_norm", "k_norm"):
                shapes[f"{name}.weight"] = (D,)
                if self.qk_norm == "layer":
                    shapes[f"{name}.bias"] = (D,)
        return shapes

    # -- parameters -----------------------------------------------------------------
    def init(self, *, seed: int, xp: Any = None, device: Any = None, dtype: Any = None) -> Params:
        """Fresh parameters: projections uniform in ``+-1/sqrt(in_features)`` (PyTorch's
        ``nn.Linear`` default), norm weights one and norm biases zero. The numbers come
        from NumPy's generator seeded by ``seed`` (identical on every backend), then move
        to ``xp``/``device``/``dtype`` (default NumPy, float32)."""
        import numpy as np

        rng = np.random.default_rng(seed)
        host: dict[str, Any] = {}
        for name, shape in self.param_shapes().items():
            if name.endswith("norm.weight"):
                host[name] = np.ones(shape)
            elif name.endswith("norm.bias"):
                host[name] = np.zeros(shape)
            else:
                fan_in = self.param_shapes()[name.rsplit(".", 1)[0] + ".weight"][1]
                bound = 1.0 / math.sqrt(fan_in)
                host[name] = rng.uniform(-bound, bound, size=shape)
        ns = resolve_namespace(xp)
        return _to_namespace(host, ns, device, ns.float32 if dtype is None else dtype)

    def load(
        self,
        state_dict: Mapping[str, Any],
        *,
        prefix: str = "",
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
        strict: bool = True,
    ) -> Params:
        """Take this layer's tensors from a checkpoint dict (e.g. ``safetensors.numpy.
        load_file``) by their names under ``prefix`` (``"model.layers.0.self_attn."``),
        without renaming, moved to ``xp``/``device`` (default NumPy) and cast to ``dtype``
        (default: kept). ``strict`` rejects unknown names under ``prefix``."""
        expected = self.param_shapes()
        found = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing = sorted(set(expected) - set(found))
        if missing:
            raise KeyError(f"state_dict lacks {[prefix + m for m in missing]}")
        unexpected = sorted(set(found) - set(expected))
        if strict and unexpected:
            raise KeyError(
                f"state_dict has names this configuration does not use: "
                f"{[prefix + u for u in unexpected]} (strict=False ignores them)"
            )
        params = _to_namespace({k: found[k] for k in expected}, xp, device, dtype)
        self.check_params(params)
        return params

    def check_params(self, params: Mapping[str, Array]) -> None:
        """Raise ``KeyError``/``ValueError`` when ``params`` does not fit this layer."""
        expected = self.param_shapes()
        if set(params) != set(expected):
            missing = sorted(set(expected) - set(params))
            extra = sorted(set(params) - set(expected))
            raise KeyError(
                f"params must have exactly the names {sorted(expected)}; missing {missing}, "
                f"unexpected {extra}"
            )
        for name, shape in expected.items():
            got = tuple(int(d) for d in params[name].shape)
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
        """An empty :class:`KVCache` for this layer (``(B, Hkv, max_length, head_dim)``)."""
        return KVCache.allocate(
            batch_size,
            self.kv_heads,
            max_length,
            self.dim_per_head,
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
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        cache: KVCache | None = None,
        training: bool = False,
        seed: int | None = None,
    ) -> Array:
        """The layer's output ``(..., L, embed_dim)``.

        Args:
            params: the parameter dict (see :meth:`param_shapes`).
            x: queries' input ``(..., L, embed_dim)`` (also keys'/values' input in
                self-attention).
            context: keys'/values' input ``(..., S, context_dim)`` for cross-attention.
            attn_mask: bool (``True`` = takes part) or additive float mask broadcastable
                to ``(..., Hq, L, S)`` (``S`` = cached + new tokens with a cache), e.g. a
                padding mask ``(B, 1, 1, S)``.
            positions: RoPE positions: an int offset (first position), or an int array
                ``(L,)`` or ``(B, L)``; default ``cache.length`` (or 0) onwards.
            cache: a :class:`KVCache`. Self-attention: the new keys/values are appended
                to it and the queries attend to all cached ones (bottom-right causal when
                ``causal``). Cross-attention (with ``context``): the cache holds the
                context's keys/values, as in encoder-decoder decoding; a call with an
                empty cache projects the context and fills it, later calls reuse it and
                skip the key/value projections (``context`` must then have the cached
                length; ``cache.reset()`` before a new context).
            training: apply attention dropout (``dropout_p``).
            seed: dropout seed (drawn when ``None``).
        """
        out, _ = self._run(params, x, context, attn_mask, positions, cache, training, seed, None)
        return out

    forward = __call__

    def vjp(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None = None,
        *,
        attn_mask: Array | None = None,
        positions: Array | int | None = None,
        training: bool = False,
        seed: int | None = None,
    ) -> tuple[Array, Callable[[Array], tuple[Array, Array | None, Params]]]:
        """Run the layer and return ``(out, pullback)``; ``pullback(d_out)`` returns
        ``(dx, dcontext, dparams)``: the cotangents of ``x``, of ``context`` (``None``
        without one) and a dict with one entry per parameter. Same arguments as
        :meth:`__call__` (no cache: decoding needs no gradients). With dropout, the same
        mask (seed) is used forward and backward."""
        pullbacks: dict[str, Callable[..., tuple[Any, ...]]] = {}
        out, info = self._run(
            params, x, context, attn_mask, positions, None, training, seed, pullbacks
        )

        def pullback(d_out: Array) -> tuple[Array, Array | None, Params]:
            return self._backward(pullbacks, info, d_out)

        return out, pullback

    def _run(
        self,
        params: Mapping[str, Array],
        x: Array,
        context: Array | None,
        attn_mask: Array | None,
        positions: Array | int | None,
        cache: KVCache | None,
        training: bool,
        seed: int | None,
        pullbacks: dict[str, Callable[..., tuple[Any, ...]]] | None,
    ) -> tuple[Array, dict[str, Any]]:
        xp = namespace_of(x=x, context=context, attn_mask=attn_mask)
        self.check_params(params)
        self._check_inputs(x, context, cache)
        p = params

        def call(name: str, op: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            if pullbacks is None:
                return op(*args, **kw)
            out, pb = vjp(op, *args, **kw)
            pullbacks[name] = pb
            return out

        D, Hq, Hkv = self.dim_per_head, self.num_heads, self.kv_heads
        fq, fkv = Hq * D, Hkv * D
        if self.packed_qkv:
            qkv = call("qkv_proj", linear, x, p["qkv_proj.weight"], p.get("qkv_proj.bias"))
            q = qkv[..., :fq]
            k = qkv[..., fq : fq + fkv]
            v = qkv[..., fq + fkv :]
        else:
            q = call("q_proj", linear, x, p["q_proj.weight"], p.get("q_proj.bias"))
        qh = self._norm_heads(call, "q", call("q_heads", split_heads, q, Hq), p)
        freqs = None
        if self.rope is not None:
            offset = 0 if cache is None else cache.length
            freqs = self._rope_freqs(xp, x, positions, offset)
            qh = call("q_rope", apply_rope, qh, freqs, layout=self.rope)
        if cache is not None and context is not None and cache.length > 0:
            # A filled cross-attention cache already holds the context's keys and values.
            kh, vh = cache.filled()
        else:
            if not self.packed_qkv:
                source = x if context is None else context
                k = call("k_proj", linear, source, p["k_proj.weight"], p.get("k_proj.bias"))
                v = call("v_proj", linear, source, p["v_proj.weight"], p.get("v_proj.bias"))
            kh = self._norm_heads(call, "k", call("k_heads", split_heads, k, Hkv), p)
            vh = call("v_heads", split_heads, v, Hkv)
            if freqs is not None:
                kh = call("k_rope", apply_rope, kh, freqs, layout=self.rope)
            if cache is not None:
                kh, vh = cache.append(kh, vh)
        use_dropout = training and self.dropout_p > 0
        o = call(
            "attention",
            scaled_dot_product_attention,
            qh,
            kh,
            vh,
            attn_mask,
            self.dropout_p if use_dropout else 0.0,
            self.causal,
            self.scale,
            True,
            causal_align="bottom_right",
            window=self.window,
            seed=seed if use_dropout else None,
            implementation=self.implementation,
        )
        om = call("merge", merge_heads, o)
        out = call("o_proj", linear, om, p["o_proj.weight"], p.get("o_proj.bias"))
        info = {"xp": xp, "has_context": context is not None}
        return out, info

    def _backward(
        self,
        pullbacks: Mapping[str, Callable[..., tuple[Any, ...]]],
        info: Mapping[str, Any],
        d_out: Array,
    ) -> tuple[Array, Array | None, Params]:
        xp = info["xp"]
        grads: Params = {}

        def linear_back(name: str, dy: Array) -> Array:
            dx, dw, db = pullbacks[name](dy)
            grads[f"{name}.weight"] = dw
            if db is not None:
                grads[f"{name}.bias"] = db
            return dx

        d_om = linear_back("o_proj", d_out)
        (d_o,) = pullbacks["merge"](d_om)
        d_qh, d_kh, d_vh = pullbacks["attention"](d_o)[:3]
        if self.rope is not None:
            d_qh = pullbacks["q_rope"](d_qh)[0]
            d_kh = pullbacks["k_rope"](d_kh)[0]
        if self.qk_norm is not None:
            for name, d in (("q_norm", d_qh), ("k_norm", d_kh)):
                back = pullbacks[name](d)
                grads[f"{name}.weight"] = back[1]
                if self.qk_norm == "layer":
                    grads[f"{name}.bias"] = back[2]
                if name == "q_norm":
                    d_qh = back[0]
                else:
                    d_kh = back[0]
        d_q = pullbacks["q_heads"](d_qh)[0]
        d_k = pullbacks["k_heads"](d_kh)[0]
        d_v = pullbacks["v_heads"](d_vh)[0]
        if self.packed_qkv:
            d_x = linear_back("qkv_proj", xp.concat((d_q, d_k, d_v), axis=-1))
            return d_x, None, grads
        d_x = linear_back("q_proj", d_q)
        d_source = linear_back("k_proj", d_k) + linear_back("v_proj", d_v)
        if info["has_context"]:
            return d_x, d_source, grads
        return d_x + d_source, None, grads

    # -- helpers ----------------------------------------------------------------------
    def _norm_heads(
        self, call: Callable[..., Any], which: str, h: Array, p: Mapping[str, Array]
    ) -> Array:
        """The qk-norm of query (``which="q"``) or key heads; ``h`` itself without one."""
        name = f"{which}_norm"
        if self.qk_norm == "rms":
            return call(name, rms_norm, h, p[f"{name}.weight"], self.norm_eps)
        if self.qk_norm == "layer":
            return call(name, layer_norm, h, p[f"{name}.weight"], p[f"{name}.bias"], self.norm_eps)
        return h

    def _check_inputs(self, x: Array, context: Array | None, cache: KVCache | None) -> None:
        if x.ndim < 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (..., L, embed_dim={self.embed_dim}), got {tuple(x.shape)}"
            )
        if context is not None:
            if self.packed_qkv:
                raise ValueError("context (cross-attention) needs packed_qkv=False")
            if self.rope is not None:
                raise ValueError(
                    "context (cross-attention) with rope is not supported: RoPE positions "
                    "of queries and context keys are not comparable"
                )
            if context.ndim < 2 or context.shape[-1] != self.kv_input_dim:
                raise ValueError(
                    f"context must have shape (..., S, context_dim={self.kv_input_dim}), got "
                    f"{tuple(context.shape)}"
                )
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
            if context is not None and cache.length and context.shape[-2] != cache.length:
                raise ValueError(
                    f"cache holds the keys/values of a context of length {cache.length}, got "
                    f"a context of length {context.shape[-2]}; call cache.reset() before "
                    f"attending to a new context"
                )
            if x.ndim != 3:
                raise ValueError(f"with a cache, x must be (B, L, embed_dim), got {x.shape}")

    def _rope_freqs(self, xp: Any, x: Array, positions: Array | int | None, offset: int) -> Array:
        L = int(x.shape[-2])
        real = xp.float64 if x.dtype == xp.float64 else xp.float32
        if positions is None or isinstance(positions, numbers.Integral):
            start = offset if positions is None else int(positions)
            pos = xp.arange(start, start + L, dtype=real, device=device_of(x))
        else:
            if positions.ndim not in (1, 2) or positions.shape[-1] != L:
                raise ValueError(
                    f"positions must be an int or an array (L,) or (B, L) with L={L}, got "
                    f"shape {tuple(positions.shape)}"
                )
            pos = positions
        freqs = rope_frequencies(self.dim_per_head, pos, theta=self.rope_theta, dtype=real)
        if freqs.ndim == 3:  # (B, L, F) -> (B, 1, L, F): the same positions for every head
            freqs = xp.expand_dims(freqs, axis=1)
        return freqs


def _to_namespace(arrays: Mapping[str, Any], xp: Any, device: Any, dtype: Any) -> Params:
    ns = resolve_namespace(xp)
    out: Params = {}
    for name, a in arrays.items():
        dt = dtype
        if dt is None:
            dt = ns.float32 if not hasattr(a, "dtype") else _same_dtype(ns, a.dtype)
        out[name] = ns.asarray(a, dtype=dt, device=device)
    return out


def _same_dtype(ns: Any, dtype: Any) -> Any:
    """The namespace's dtype with the same name as a host array's dtype (float32 if
    unknown), so a float16 checkpoint stays float16 unless asked otherwise."""
    name = getattr(dtype, "name", str(dtype))
    return getattr(ns, name, ns.float32)
