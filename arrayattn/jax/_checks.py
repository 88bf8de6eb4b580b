"""Checks of what only the JAX entry point needs: JAX (or NumPy) arrays, static options (never
traced) and an explicit dropout seed (JAX has no global random state). Everything else
(shapes, dtypes, masks, lengths) is checked by ``make_spec``, the same as on every
library, when the call is traced."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..attention.dropout import normalize_seed

__all__ = ["as_jax_array", "require_static", "static_seed"]


def _traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def as_jax_array(name: str, x: Any, optional: bool = False) -> Any:
    """``x`` as a ``jax.Array``: a JAX array (traced or not) as it is, a NumPy array
    converted (as every ``jax.numpy`` function converts it), ``None`` where
    ``optional``; anything else (another library's array, a list) is a ``TypeError``.

    Examples:
        >>> try:
        ...     as_jax_array("query", [[1.0]])
        ... except TypeError as e:
        ...     print(str(e)[:51])
        query must be a jax.Array (or a NumPy array), got b
    """
    if x is None and optional:
        return None
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    kind = type(x)
    raise TypeError(
        f"{name} must be a jax.Array (or a NumPy array), got {kind.__module__}."
        f"{kind.__qualname__}; convert it with jax.numpy.asarray, or call "
        "arrayattn.scaled_dot_product_attention, which takes every array-API library's arrays"
    )


def require_static(name: str, value: Any) -> None:
    """``TypeError`` when ``value`` is traced: options that shape the computation
    (``dropout_p``, ``scale``, ``softcap``, ``is_causal``, ``window``, ...) must be
    Python values at trace time.

    Examples:
        >>> require_static("scale", 0.5)
    """
    parts = value if isinstance(value, (tuple, list)) else (value,)
    if any(_traced(v) for v in parts):
        raise TypeError(
            f"{name} must be a static Python value, got a traced JAX value "
            f"({_describe(value)}); under jax.jit pass it through static_argnames / "
            "static_argnums, or close over it"
        )


def _describe(value: Any) -> str:
    aval = getattr(value, "aval", None)
    return str(aval) if aval is not None else type(value).__name__


def _is_key(seed: Any) -> bool:
    if not isinstance(seed, jax.Array):
        return False
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed.shape == ()
    return seed.dtype == jnp.uint32 and seed.shape == (2,)  # a raw jax.random.PRNGKey


def static_seed(seed: Any, dropout_p: float) -> int | None:
    """The dropout seed as a Python int (``None`` without dropout).

    ``seed``: a Python or NumPy integer, or a concrete ``jax.random`` key (a typed key
    from ``jax.random.key`` or a raw ``jax.random.PRNGKey``), which becomes the int
    ``jax.random.bits(key, (), uint32)``. With ``dropout_p > 0`` a seed is required
    (``ValueError``); a traced seed or key is a ``TypeError``: the mask's seed is static.

    Examples:
        >>> static_seed(7, 0.1), static_seed(None, 0.0)
        (7, None)
        >>> static_seed(jax.random.key(0), 0.1) == int(
        ...     jax.random.bits(jax.random.key(0), (), jax.numpy.uint32))
        True
    """
    if _traced(seed):
        raise TypeError(
            f"seed must be a static int or a concrete jax.random key, got a traced value "
            f"({_describe(seed)}); the dropout mask's seed is static: under jax.jit pass "
            "it through static_argnames, or draw it outside the jitted function "
            "(each new seed then compiles once more)"
        )
    if seed is None:
        if dropout_p > 0:
            raise ValueError(
                f"seed is required with dropout_p={dropout_p} > 0: JAX has no global random "
                "state; pass seed=<int> or seed=<jax.random key> (the same seed gives the "
                "same mask, in the forward and the backward)"
            )
        return None
    if _is_key(seed):
        seed = int(jax.random.bits(seed, (), jnp.uint32))
    elif isinstance(seed, jax.Array):
        raise TypeError(
            "seed must be an int or a jax.random key (a typed key, or a uint32 PRNGKey of "
            f"shape (2,)), got a jax.Array of shape {tuple(seed.shape)} and dtype {seed.dtype}"
        )
    return normalize_seed(seed)
