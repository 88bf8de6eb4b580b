"""One attention call as data (:class:`AttentionCall`) and the feature names the kit
checks. No hypothesis here: strategies build calls, adapters run them."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ._backends import Backend, make_backend
from ._compare import round_to_dtype
from .oracles import reference_attention, reference_vjp

__all__ = ["FEATURES", "OPTION_FEATURES", "AttentionCall", "library_features"]

# One row of the conformance report each, in this order.
FEATURES = (
    "basic",
    "scale",
    "bool_mask",
    "float_mask",
    "empty_rows",
    "causal_top_left",
    "causal_bottom_right",
    "window",
    "softcap",
    "gqa",
    "broadcast",
    "zero_length",
    "lengths",
    "dropout",
    "sinks",
    "alibi",
    "low_precision",
    "adversarial",
    "lse",
    "gradients",
    "combined",
)

# Features that are keyword options of the call (the rest are shapes, values, dtypes or
# outputs).
OPTION_FEATURES = (
    "scale",
    "bool_mask",
    "float_mask",
    "causal_top_left",
    "causal_bottom_right",
    "window",
    "softcap",
    "gqa",
    "lengths",
    "dropout",
    "sinks",
    "alibi",
)

FEATURE_DOCS = {
    "basic": "plain attention, ragged L != S, odd head dims",
    "scale": "explicit scale=",
    "bool_mask": "bool attn_mask (True takes part), broadcastable shapes",
    "float_mask": "float attn_mask added to the scores",
    "empty_rows": "fully masked rows: output 0, LSE -inf, never NaN",
    "causal_top_left": "is_causal, top-left alignment (j <= i), L != S",
    "causal_bottom_right": "is_causal, bottom-right alignment (j <= i + S - L), L != S",
    "window": "sliding window (left, right), inclusive, -1 unbounded",
    "softcap": "softcap * tanh(s / softcap) before masks",
    "gqa": "grouped-query heads: head h reads KV head h // (Hq // Hkv)",
    "broadcast": "leading dims that broadcast, one KV head for all",
    "zero_length": "L or S of 0",
    "lengths": "per-sequence q_lengths / kv_lengths",
    "dropout": "seed-defined dropout (arrayattn's mask)",
    "sinks": "attention sinks (one logit per head in the denominator)",
    "alibi": "ALiBi slopes, -slope * |i + offset - j|",
    "low_precision": "float16 / bfloat16 (FlashAttention's tolerance rule)",
    "adversarial": "large logits, float16 values near overflow",
    "lse": "log-sum-exp output",
    "gradients": "backward: dq, dk, dv (and float mask) against the float64 VJP",
    "combined": "every supported option drawn together",
}


def library_features() -> frozenset[str]:
    """The features arrayattn's own ``scaled_dot_product_attention`` accepts here: all
    but ``sinks``/``alibi``, which count only when its signature has ``sinks=`` /
    ``alibi_slopes=`` (so the kit works before and after they land).

    Examples:
        >>> from arrayattn.testing import library_features
        >>> {"window", "lse", "gradients"} <= library_features()
        True
    """
    import arrayattn

    params = inspect.signature(arrayattn.scaled_dot_product_attention).parameters
    out = set(FEATURES) - {"sinks", "alibi"}
    if "sinks" in params:
        out.add("sinks")
    if "alibi_slopes" in params:
        out.add("alibi")
    return frozenset(out)


def _as_backend(xp: Any) -> Backend | None:
    """A Backend from a backend name, a Backend, or an array library's module (numpy,
    torch, jax.numpy, ...); ``None`` stays ``None``."""
    return None if xp is None else make_backend(xp)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One drawn attention call, in arrayattn's layout ``(..., H, L, E)`` and names.

    ``query``/``key``/``value`` hold float64 values already rounded to ``dtype`` (so the
    float64 reference sees exactly what the implementation sees); ``options`` are
    :func:`arrayattn.scaled_dot_product_attention`'s keyword arguments (lengths, sinks
    and slopes as NumPy arrays); ``features`` says what the call exercises.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import AttentionCall
        >>> c = AttentionCall(np.ones((1, 1, 2, 4)), np.ones((1, 1, 3, 4)),
        ...                   np.ones((1, 1, 3, 4)), None, {"is_causal": True})
        >>> c.reference()[0].shape
        (1, 1, 2, 4)
        >>> c.describe()
        'float32 q(1, 1, 2, 4) k(1, 1, 3, 4) v(1, 1, 3, 4) is_causal=True'
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: np.ndarray | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    features: frozenset[str] = frozenset()
    backend: Backend | None = None

    @property
    def L(self) -> int:
        return self.query.shape[-2]

    @property
    def S(self) -> int:
        return self.key.shape[-2]

    def reference(self, return_probs: bool = False) -> tuple[np.ndarray, ...]:
        """:func:`~arrayattn.testing.reference_attention` of this call (float64)."""
        return reference_attention(
            self.query,
            self.key,
            self.value,
            self.attn_mask,
            return_probs=return_probs,
            **self.options,
        )

    def reference_vjp(self, d_out: np.ndarray, d_lse: np.ndarray | None = None) -> Any:
        """:func:`~arrayattn.testing.reference_vjp` of this call (float64)."""
        return reference_vjp(
            d_out, self.query, self.key, self.value, self.attn_mask, d_lse=d_lse, **self.options
        )

    def _to(self, backend: Backend, a: np.ndarray, dtype: str | None = None) -> Any:
        dtype = dtype or self.dtype
        if dtype == "bfloat16":  # NumPy has none: go through float32 (values are exact)
            x = backend.asarray(a.astype(np.float32))
            return backend.xp.astype(x, backend.xp.bfloat16)
        return backend.asarray(a.astype(dtype))

    def arrays(
        self, backend: Backend | str | ModuleType | None = None
    ) -> tuple[Any, Any, Any, Any]:
        """``(query, key, value, attn_mask)`` in ``dtype`` on ``backend`` (default: the
        call's own, else NumPy); a float mask keeps ``dtype``, a bool mask stays bool."""
        b = _as_backend(backend) or self.backend or make_backend("numpy")
        q, k, v = (self._to(b, x) for x in (self.query, self.key, self.value))
        m = self.attn_mask
        if m is not None:
            # A copy: on NumPy, asarray would hand the function this call's own mask.
            m = b.asarray(m.copy()) if m.dtype == np.bool_ else self._to(b, m)
        return q, k, v, m

    def kwargs(self, backend: Backend | str | ModuleType | None = None) -> dict[str, Any]:
        """``options`` with array values moved to ``backend`` (lengths as int32, sinks
        and slopes in float32, or float64 for float64 calls)."""
        b = _as_backend(backend) or self.backend or make_backend("numpy")
        out = dict(self.options)
        for name in ("q_lengths", "kv_lengths"):
            if out.get(name) is not None:
                # np.array copies: the function must not get this call's own lengths.
                out[name] = b.asarray(np.array(out[name], dtype=np.int32))
        side = "float64" if self.dtype == "float64" else "float32"
        for name in ("sinks", "alibi_slopes"):
            if out.get(name) is not None:
                out[name] = self._to(b, np.asarray(out[name]), side)
        return out

    def describe(self) -> str:
        """A one-line summary: dtype, shapes, options, mask kind and shape."""
        parts = [
            self.dtype,
            f"q{self.query.shape}",
            f"k{self.key.shape}",
            f"v{self.value.shape}",
        ]
        if self.attn_mask is not None:
            kind = "bool" if self.attn_mask.dtype == np.bool_ else "float"
            parts.append(f"{kind}_mask{self.attn_mask.shape}")
        for name, value in sorted(self.options.items()):
            if isinstance(value, np.ndarray):
                value = value.tolist()
            if isinstance(value, float):
                value = float(f"{value:.4g}")
            parts.append(f"{name}={value}")
        scale = float(np.max(np.abs(self.query), initial=0.0))
        if scale > 50:
            parts.append(f"max|q|={scale:.3g}")
        return " ".join(parts)

    def to_dict(self, with_data: bool = False) -> dict[str, Any]:
        """JSON-ready description (``with_data``: also the arrays as nested lists)."""
        d: dict[str, Any] = {
            "dtype": self.dtype,
            "query_shape": list(self.query.shape),
            "key_shape": list(self.key.shape),
            "value_shape": list(self.value.shape),
            "mask": None
            if self.attn_mask is None
            else {
                "kind": "bool" if self.attn_mask.dtype == np.bool_ else "float",
                "shape": list(self.attn_mask.shape),
            },
            "options": {
                k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in self.options.items()
            },
            "features": sorted(self.features),
        }
        if with_data:
            d["data"] = {
                "query": self.query.tolist(),
                "key": self.key.tolist(),
                "value": self.value.tolist(),
                "attn_mask": None if self.attn_mask is None else self.attn_mask.tolist(),
            }
        return d

    def rounded(self, dtype: str) -> AttentionCall:
        """The same call in another dtype (values re-rounded to it)."""
        r = {n: round_to_dtype(getattr(self, n), dtype) for n in ("query", "key", "value")}
        m = self.attn_mask
        if m is not None and m.dtype != np.bool_:
            m = round_to_dtype(m, dtype)
        return AttentionCall(
            r["query"], r["key"], r["value"], m, self.options, dtype, self.features, self.backend
        )
