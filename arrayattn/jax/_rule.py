"""One attention call's forward and backward on any array library, from its static options
and its arrays: the machinery of ``arrayattn.ops.attention._sdpa_vjp`` (``make_spec``,
the registry's ``select``, ``impl.forward``/``impl.backward``, ``sinks_gradient``),
shared by both JAX paths: traced with ``jax.numpy`` arrays, and on the host with the
NumPy arrays a ``jax.pure_callback`` receives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._backend import Array, array_namespace, library_name
from ..attention import composed as _composed
from ..attention import implementations as _implementations  # noqa: F401  (registers them)
from ..attention.registry import select
from ..attention.spec import AttentionSpec, make_spec

__all__ = ["Call", "Arrays", "call_spec", "forward", "backward"]


@dataclass(frozen=True)
class Call:
    """The static (hashable, never traced) options of one attention call, validated.

    ``implementation`` is the registry name the chosen path runs (``"auto"`` included);
    ``on_host``: the NumPy fast path through ``jax.pure_callback`` instead of tracing the
    array-API code with ``jax.numpy``. ``block_mask``, ``mask_mod``: as given;
    ``score_mod``: a :class:`~arrayattn.flex.ScoreMod` whose ``params`` are replaced by
    the arrays the call receives (:meth:`~arrayattn.flex.ScoreMod.with_params`).
    """

    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    causal_align: str = "top_left"
    window: tuple[int, int] | None = None
    softcap: float | None = None
    seed: int | None = None
    return_lse: bool = False
    implementation: str = "auto"
    on_host: bool = False
    block_mask: Any = None
    mask_mod: Any = None
    score_mod: Any = None

    @property
    def flex(self) -> bool:
        """True with a block mask, a mask_mod or a score_mod (``arrayattn.flex``)."""
        return self.block_mask is not None or self.mask_mod is not None or (
            self.score_mod is not None
        )


class Arrays(NamedTuple):
    """The array arguments of one call (``None`` where not given); a JAX pytree, so also
    the structure of their cotangents (``None`` where there is no gradient)."""

    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    sinks: Any = None
    alibi_slopes: Any = None


def call_spec(
    call: Call,
    arrays: Arrays,
    batch_ids: tuple[int, ...] | None = None,
    params: tuple[Array, ...] = (),
) -> AttentionSpec:
    """The validated :class:`~arrayattn.attention.spec.AttentionSpec` of the call.
    ``batch_ids``: the dropout hash's batch index of each flat batch entry (the host path
    under ``jax.vmap``, whose vmapped axes must not change the mask of a slice).
    ``params``: the score_mod's parameters as this path's arrays (NumPy on the host,
    ``jax.numpy`` arrays or tracers when traced); the block mask is used on the library
    of ``arrays`` (its block kinds are NumPy on both paths).

    Examples:
        >>> import numpy as np
        >>> q = np.ones((2, 3, 4, 8), np.float32)
        >>> spec = call_spec(Call(is_causal=True), Arrays(q, q, q))
        >>> spec.out_shape, spec.lse_shape
        ((2, 3, 4, 8), (2, 3, 4))
    """
    spec = make_spec(
        arrays.query,
        arrays.key,
        arrays.value,
        arrays.attn_mask,
        call.dropout_p,
        call.is_causal,
        call.scale,
        call.enable_gqa,
        call.causal_align,
        call.window,
        call.softcap,
        call.seed,
        q_lengths=arrays.q_lengths,
        kv_lengths=arrays.kv_lengths,
        sinks=arrays.sinks,
        alibi_slopes=arrays.alibi_slopes,
        **_flex_options(call, arrays, params),
    )
    if batch_ids is not None:
        spec = dataclasses.replace(spec, batch_ids=batch_ids)
    return spec


def _flex_options(call: Call, arrays: Arrays, params: tuple[Array, ...]) -> dict[str, Any]:
    if not call.flex:
        return {}
    bm = call.block_mask
    if bm is not None:
        lib = library_name(array_namespace(arrays.query))
        if bm.library != lib:  # NumPy and JAX masks run on both paths (checked by the entry)
            bm = dataclasses.replace(bm, library=lib, device=None)
    smod = call.score_mod
    if smod is not None and smod.params:
        smod = smod.with_params(tuple(params))
    return {"block_mask": bm, "mask_mod": call.mask_mod, "score_mod": smod}


def forward(
    call: Call,
    arrays: Arrays,
    batch_ids: tuple[int, ...] | None = None,
    params: tuple[Array, ...] = (),
) -> tuple[Array, Array]:
    """``(out, lse)``: output ``(..., Hq, L, Ev)`` in the input dtype and LSE
    ``(..., Hq, L)`` in float32 (float64 for float64 inputs), from the implementation
    ``call.implementation`` names (or ``"auto"``'s choice).

    Examples:
        >>> import numpy as np
        >>> q = np.ones((1, 2, 4, 8), np.float32)
        >>> out, lse = forward(Call(), Arrays(q, q, q))
        >>> out.shape, lse.shape, lse.dtype
        ((1, 2, 4, 8), (1, 2, 4), dtype('float32'))
    """
    spec = call_spec(call, arrays, batch_ids, params)
    impl = select(spec, call.implementation)
    return impl.forward(spec, arrays.query, arrays.key, arrays.value, arrays.attn_mask)


def backward(
    call: Call,
    arrays: Arrays,
    out: Array,
    lse: Array,
    d_out: Array | None,
    d_lse: Array | None,
    batch_ids: tuple[int, ...] | None = None,
    params: tuple[Array, ...] = (),
) -> tuple[Arrays, tuple[Array, ...]]:
    """The cotangents of ``arrays`` (same shapes and dtypes; ``None`` for a bool mask,
    the lengths and the ALiBi slopes, which have none) from the saved ``out`` and ``lse``
    and the cotangents ``d_out`` (output's shape) and ``d_lse`` (LSE's shape, or
    ``None``): FlashAttention-2's backward of the implementation, and the sinks'
    gradient from row statistics, as ``arrayattn.vjp`` computes them; with them the
    gradients of the score_mod's ``params`` (a tuple, empty without).

    Examples:
        >>> import numpy as np
        >>> q = np.ones((1, 2, 4, 8), np.float32)
        >>> out, lse = forward(Call(), Arrays(q, q, q))
        >>> grads, d_params = backward(Call(), Arrays(q, q, q), out, lse, np.ones_like(out),
        ...                            None)
        >>> grads.query.shape, grads.attn_mask is None, d_params
        ((1, 2, 4, 8), True, ())
    """
    spec = call_spec(call, arrays, batch_ids, params)
    impl = select(spec, call.implementation)
    dq, dk, dv, d_mask = impl.backward(
        spec, arrays.query, arrays.key, arrays.value, arrays.attn_mask, out, lse, d_out, d_lse
    )
    # The sinks' gradient needs only row statistics (LSE, dO . O, dLSE), the same on
    # every implementation, so it is computed once here (as in _sdpa_vjp).
    d_sinks = _composed.sinks_gradient(spec, out, lse, d_out, d_lse)
    d_params: tuple[Array, ...] = ()
    if spec.score_mod is not None and spec.score_mod.params:
        if not spec.score_mod.differentiable:  # (a ScoreMod may declare itself so)
            raise TypeError(f"score_mod {spec.score_mod!r} has no derivative")
        d_params = _composed.score_mod_param_grads(
            spec, arrays.query, arrays.key, arrays.value, arrays.attn_mask, out, lse, d_out,
            d_lse,
        )  # fmt: skip
    return Arrays(dq, dk, dv, d_mask, None, None, d_sinks, None), d_params
