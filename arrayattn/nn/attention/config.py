"""``MultiHeadAttention``'s configuration: its fields, their validation, the sizes derived
from them and the parameter shapes they imply. The layer (``__init__.py``) is this class
with its methods; the modules beside it take the configuration, never the layer."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...ops.attention import implementations
from ...ops.rope import ROPE_LAYOUTS
from ...ops.rope.scaling import check_rope_scaling
from .._validate import _count, _flag, _real

__all__ = ["AttentionConfig", "QK_NORMS", "QK_NORM_SCOPES"]

QK_NORMS = ("rms", "layer")
QK_NORM_SCOPES = ("head", "full")


@dataclass(frozen=True)
class AttentionConfig:
    """The fields of :class:`~arrayattn.nn.MultiHeadAttention` (documented there), checked
    when made, with the sizes they imply."""

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
        softcap = _real("softcap", self.softcap, optional=True)
        if softcap is not None and softcap <= 0:
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
        if self.rope is not None and self.rope_scaling is not None:
            # An unknown rope_type or a missing key fails here, not at the first call.
            try:
                check_rope_scaling(
                    self.dim_per_head,
                    self.rope_scaling,
                    theta=self.rope_theta,
                    partial_rotary_factor=(
                        None if self.mrope_section is not None else self.partial_rotary_factor
                    ),
                    max_position_embeddings=self.max_position_embeddings,
                )
            except (TypeError, ValueError) as e:
                raise type(e)(f"rope_scaling={dict(self.rope_scaling)!r:.200}: {e}") from None

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
