"""``arrayattn.jax.scaled_dot_product_attention``: arrayattn's attention as a
``jax.custom_vjp`` whose backward is arrayattn's own (FlashAttention-2 from the saved
LSE), so ``jax.grad`` never differentiates through the forward's code.

Two paths run a call (:func:`path_for`): on the CPU platform the NumPy fast path inside
``jax.pure_callback`` (:mod:`._host`), elsewhere (and for bfloat16) the array-API code
traced with ``jax.numpy`` and compiled by XLA. The residuals are the inputs, the output
and the LSE: never an ``L x S`` array.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Literal, TypeAlias, overload

import jax
import jax.numpy as jnp
import numpy as np

from .._backend import Array
from ..attention.block_mask import BlockMask
from ..attention.structure import parse_window
from . import _host, _rule
from ._checks import as_jax_array, check_flex, require_static, static_seed
from ._rule import Arrays, Call

__all__ = ["scaled_dot_product_attention", "path_for", "HOST_DTYPES", "TRACED_AUTO"]

HOST_DTYPES = ("float16", "float32", "float64")
"""The dtypes the NumPy fast path (the host path) takes; bfloat16 is traced."""

TRACED_AUTO = "chunked"
"""What ``implementation="auto"`` runs when it traces the array-API code (off the CPU
platform, or bfloat16): the chunked path, its loops over blocks unrolled into the XLA
program. Its memory is then XLA's schedule: on the CPU platform XLA kept most blocks
alive (docs: Frameworks, JAX), which is why the CPU runs the host path instead."""

_NOT_IN_JAX = ("fused", "dask")

ArrayIn: TypeAlias = jax.Array | np.ndarray
"""What the array arguments take: JAX arrays (traced or not), or NumPy arrays (converted
as ``jax.numpy`` converts them)."""


def _platform(arrays: Arrays) -> str:
    """The platform the call runs on: a concrete array's device, else JAX's default
    backend (traced arrays carry no device)."""
    for x in arrays:
        if x is not None and not isinstance(x, jax.core.Tracer):
            try:
                return str(next(iter(x.devices())).platform)
            except (AttributeError, StopIteration):  # pragma: no cover (a deleted array)
                break
    return str(jax.default_backend())


def path_for(implementation: str, dtype: Any, platform: str) -> tuple[bool, str]:
    """``(on_host, name)``: whether the call runs on the host (the NumPy fast path in a
    ``jax.pure_callback``) and the registered implementation it runs.

    ``"auto"``: the host on the CPU platform for float16/float32/float64 (NumPy's
    ``"auto"`` then picks, the fast path at all but tiny sizes), else the traced
    :data:`TRACED_AUTO`. ``"fast"``: the host, any platform. Another registered name
    (``"chunked"``, ``"composed"``, one of your own): traced.

    Examples:
        >>> path_for("auto", jax.numpy.float32, "cpu")
        (True, 'auto')
        >>> path_for("auto", jax.numpy.float32, "gpu"), path_for("auto", jax.numpy.bfloat16, "cpu")
        ((False, 'chunked'), (False, 'chunked'))
        >>> path_for("composed", jax.numpy.float32, "cpu")
        (False, 'composed')
    """
    if not isinstance(implementation, str):
        raise TypeError(f"implementation must be a str, got {type(implementation).__name__}")
    on_host_dtype = jnp.dtype(dtype).name in HOST_DTYPES
    if implementation == "fast":
        if not on_host_dtype:
            raise ValueError(
                f"implementation='fast' (the NumPy fast path) takes {', '.join(HOST_DTYPES)}, "
                f"got {jnp.dtype(dtype).name}; use 'auto' or 'chunked'"
            )
        return True, "fast"
    if implementation in _NOT_IN_JAX:
        raise ValueError(
            f"implementation={implementation!r} cannot run inside a JAX trace (the CuPy "
            "kernels and the Dask path take their own arrays); use 'auto', 'fast', "
            "'chunked' or 'composed'"
        )
    if implementation == "auto":
        if platform == "cpu" and on_host_dtype:
            return True, "auto"
        return False, TRACED_AUTO
    return False, implementation


Params: TypeAlias = tuple[Any, ...]
"""The score_mod's parameters (a bias table): differentiable inputs of the custom_vjp."""


def _forward(call: Call, arrays: Arrays, params: Params) -> tuple[Array, Array]:
    if call.on_host:
        return _host.forward(call, arrays, params)
    return _rule.forward(call, arrays, params=params)


def _backward(
    call: Call,
    arrays: Arrays,
    params: Params,
    out: Array,
    lse: Array,
    d_out: Array,
    d_lse: Array | None,
) -> tuple[Arrays, Params]:
    if call.score_mod is not None and not call.score_mod.differentiable:
        raise TypeError(
            f"score_mod {call.score_mod!r} has no derivative, so jax.grad cannot run its "
            "backward: wrap it as arrayattn.flex.ScoreMod(fn, grad=d_fn_d_score)"
        )
    if call.on_host:
        return _host.backward(call, arrays, out, lse, d_out, d_lse, params)
    return _rule.backward(call, arrays, out, lse, d_out, d_lse, params=params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(call: Call, arrays: Arrays, params: Params) -> Any:
    out, lse = _forward(call, arrays, params)
    return (out, lse) if call.return_lse else out


def _attention_fwd(
    call: Call, arrays: Arrays, params: Params
) -> tuple[Any, tuple[Arrays, Params, Array, Array]]:
    out, lse = _forward(call, arrays, params)
    # The residuals: the inputs, the output and the LSE (row statistics), nothing L x S.
    return ((out, lse) if call.return_lse else out), (arrays, params, out, lse)


def _attention_bwd(
    call: Call, residuals: tuple[Arrays, Params, Array, Array], cotangent: Any
) -> tuple[Arrays, Params]:
    arrays, params, out, lse = residuals
    d_out, d_lse = cotangent if call.return_lse else (cotangent, None)
    return _backward(call, arrays, params, out, lse, d_out, d_lse)


_attention.defvjp(_attention_fwd, _attention_bwd)


# The overloads tell type checkers what a call returns: the output alone, or with
# return_lse=True the pair (output, LSE).
@overload
def scaled_dot_product_attention(
    query: ArrayIn,
    key: ArrayIn,
    value: ArrayIn,
    attn_mask: ArrayIn | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | jax.Array | None = None,
    return_lse: Literal[False] = False,
    implementation: str = "auto",
    q_lengths: ArrayIn | None = None,
    kv_lengths: ArrayIn | None = None,
    sinks: ArrayIn | None = None,
    alibi_slopes: ArrayIn | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> jax.Array: ...
@overload
def scaled_dot_product_attention(
    query: ArrayIn,
    key: ArrayIn,
    value: ArrayIn,
    attn_mask: ArrayIn | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | jax.Array | None = None,
    return_lse: Literal[True],
    implementation: str = "auto",
    q_lengths: ArrayIn | None = None,
    kv_lengths: ArrayIn | None = None,
    sinks: ArrayIn | None = None,
    alibi_slopes: ArrayIn | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> tuple[jax.Array, jax.Array]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayIn,
    key: ArrayIn,
    value: ArrayIn,
    attn_mask: ArrayIn | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | jax.Array | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    q_lengths: ArrayIn | None = None,
    kv_lengths: ArrayIn | None = None,
    sinks: ArrayIn | None = None,
    alibi_slopes: ArrayIn | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...
def scaled_dot_product_attention(
    query: ArrayIn,
    key: ArrayIn,
    value: ArrayIn,
    attn_mask: ArrayIn | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | jax.Array | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    q_lengths: ArrayIn | None = None,
    kv_lengths: ArrayIn | None = None,
    sinks: ArrayIn | None = None,
    alibi_slopes: ArrayIn | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`arrayattn.scaled_dot_product_attention` on JAX arrays, with arrayattn's
    own backward under ``jax.grad`` (a ``jax.custom_vjp``).

    Shapes: ``query (..., Hq, L, E)``, ``key (..., Hkv, S, E)``, ``value (..., Hkv, S,
    Ev)`` -> output ``(..., Hq, L, Ev)`` in the input dtype; with ``return_lse=True``
    also the LSE ``(..., Hq, L)``, float32 (float64 for float64 inputs). This is
    PyTorch's layout (heads before the sequence), not ``jax.nn.dot_product_attention``'s
    ``(B, T, N, H)``: ``jnp.swapaxes(x, -3, -2)`` converts. Every argument means what it
    means in :func:`arrayattn.scaled_dot_product_attention`, with these differences:

    - the arrays are JAX arrays (traced or not; NumPy arrays are converted, any other
      library's arrays are a ``TypeError``); gradients flow to ``query``,
      ``key``, ``value``, a float ``attn_mask``, ``sinks``, a score_mod's ``params``
      and, through ``d_lse``, from the LSE. ``q_lengths``, ``kv_lengths`` and
      ``alibi_slopes`` are constants: their gradient is zero, as under ``jax.lax.stop_gradient``.
    - every other argument is static (a Python value when traced: under ``jax.jit``
      pass it with ``static_argnames`` or close over it); a traced one is a
      ``TypeError`` naming it.
    - ``seed`` is required when ``dropout_p > 0`` (JAX has no global random state): an
      int, or a concrete ``jax.random`` key, which becomes the int
      ``jax.random.bits(key, (), uint32)``. The mask is a function of ``(seed, batch,
      head, i, j)`` and equals ``arrayattn.dropout_mask`` with that seed; under
      ``jax.vmap`` each slice gets the mask it gets alone.
    - ``implementation``: ``"auto"`` runs the NumPy fast path inside a
      ``jax.pure_callback`` on the CPU platform (float16/32/64), and the chunked path
      traced with ``jax.numpy`` elsewhere or for bfloat16; ``"fast"`` forces the
      callback, ``"chunked"``/``"composed"`` (or your registered names) the traced path
      (:func:`path_for`). The CuPy kernels cannot run inside a JAX trace.
    - ``block_mask``, ``mask_mod``, ``score_mod`` (:mod:`arrayattn.flex`) are static:
      a block mask built for NumPy (the default) or JAX (``xp=jax.numpy``) runs on
      either path; a mask_mod or score_mod holding NumPy arrays (document ids) runs on
      the host path only, one holding concrete JAX arrays on either (``"auto"`` then
      traces); arrays they hold must not be traced. A ``ScoreMod``'s ``params`` (a bias
      table, ``relative_position_bias(table)``) are the exception: they are inputs of
      the ``custom_vjp`` (traced or not) and ``jax.grad`` differentiates them; the
      score_mod is rebuilt over them (``ScoreMod(..., rebuild=)``; the built-ins have
      it). Under ``jax.vmap`` the host path runs such a call one slice at a time, so a
      mask_mod sees each slice's own batch indices and a table may be vmapped too. A
      score_mod without a derivative runs forward; ``jax.grad`` through it is a
      ``TypeError``.

    Works under ``jax.jit``, ``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``,
    ``jax.vmap`` (over any axes; each slice gives what it gives alone) and their
    compositions. Forward mode (``jax.jvp``, ``jax.jacfwd``) and second derivatives are
    not supported: a ``custom_vjp`` defines reverse mode only.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import arrayattn.jax as aaj
        >>> q = jax.random.normal(jax.random.key(0), (2, 8, 16, 64), jnp.float32)
        >>> kv = jax.random.normal(jax.random.key(1), (2, 2, 16, 64), jnp.float32)
        >>> out = aaj.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        >>> out.shape, out.dtype
        ((2, 8, 16, 64), dtype('float32'))

        Gradients (arrayattn's backward), under ``jax.jit``:

        >>> def loss(q, k, v):
        ...     return aaj.scaled_dot_product_attention(q, k, v, is_causal=True,
        ...                                             enable_gqa=True).sum()
        >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
        >>> dq.shape, dk.shape
        ((2, 8, 16, 64), (2, 2, 16, 64))

        Sinks with their gradient, and the LSE:

        >>> sinks = jnp.zeros(8, jnp.float32)
        >>> out, lse = aaj.scaled_dot_product_attention(q, kv, kv, enable_gqa=True,
        ...                                             sinks=sinks, return_lse=True)
        >>> lse.shape, jax.grad(lambda s: aaj.scaled_dot_product_attention(
        ...     q, kv, kv, enable_gqa=True, sinks=s).sum())(sinks).shape
        ((2, 8, 16), (8,))

        A document mask and a T5 bias table, differentiated by ``jax.grad``:

        >>> import numpy as np
        >>> from arrayattn.flex import create_block_mask, document_mask, relative_position_bias
        >>> bm = create_block_mask(document_mask(np.arange(16) // 6), None, None, 16, 16,
        ...                        block_size=4)
        >>> def biased(table):
        ...     return aaj.scaled_dot_product_attention(
        ...         q, kv, kv, enable_gqa=True, block_mask=bm,
        ...         score_mod=relative_position_bias(table)).sum()
        >>> jax.grad(biased)(jnp.zeros((32, 8), jnp.float32)).shape
        (32, 8)
    """
    given = Arrays(query, key, value, attn_mask, q_lengths, kv_lengths, sinks, alibi_slopes)
    arrays = Arrays(
        *(
            as_jax_array(name, x, optional=name not in ("query", "key", "value"))
            for name, x in given._asdict().items()
        )
    )
    options = {
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
        "enable_gqa": enable_gqa,
        "causal_align": causal_align,
        "window": window,
        "softcap": softcap,
        "return_lse": return_lse,
        "implementation": implementation,
    }
    for option, setting in options.items():
        require_static(option, setting)
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    on_host, runs = path_for(implementation, arrays.query.dtype, _platform(arrays))
    flex = check_flex(block_mask, mask_mod, score_mod)
    if flex.traced and on_host:
        if implementation == "fast":
            raise ValueError(
                f"implementation='fast' runs NumPy on the host, but {flex.traced}: "
                "use implementation='auto' or 'chunked' (traced), or NumPy arrays there"
            )
        on_host, runs = False, TRACED_AUTO
    if flex.host and not on_host:
        raise ValueError(
            f"{flex.host}, which this call's traced path (implementation={implementation!r}"
            f" on {_platform(arrays)}, {jnp.dtype(arrays.query.dtype).name}) cannot index "
            "with traced indices: build it on JAX arrays (e.g. "
            "document_mask(jnp.asarray(ids))), or run the host path (implementation='auto' "
            "on the CPU, float16/32/64)"
        )
    seed_n = static_seed(seed, float(dropout_p))
    call = Call(
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_align=causal_align,
        window=parse_window(window),
        softcap=softcap,
        seed=seed_n if dropout_p > 0 else None,  # without dropout it must not key the trace
        return_lse=bool(return_lse),
        implementation=runs,
        on_host=on_host,
        block_mask=flex.block_mask,
        mask_mod=flex.mask_mod,
        score_mod=flex.score_mod,
    )
    _rule.call_spec(call, arrays, params=flex.params)  # errors now, named
    return _attention(call, arrays, flex.params)
