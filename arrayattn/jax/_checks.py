"""Checks of what only the JAX entry point needs: JAX (or NumPy) arrays, static options (never
traced) and an explicit dropout seed (JAX has no global random state). Everything else
(shapes, dtypes, masks, lengths) is checked by ``make_spec``, the same as on every
library, when the call is traced."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..attention.block_mask import BlockMask
from ..attention.dropout import normalize_seed
from ..attention.held import held_arrays, held_libraries
from ..attention.mask_mods import MaskMod, as_mask_mod, classifiable
from ..attention.score_mods import ScoreMod, as_score_mod

__all__ = ["as_jax_array", "require_static", "static_seed", "check_flex", "Flex"]


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


class Flex(NamedTuple):
    """A call's structured options, checked: the block mask and mask_mod as given, the
    score_mod (a :class:`~arrayattn.flex.ScoreMod`, rebuilt over ``params`` inside the
    ``custom_vjp``), its ``params`` as JAX arrays, ``traced``: why the call must run the
    traced path (a mask_mod or score_mod holding JAX arrays), or ``""``, and ``host``: why
    it must run on the host (one holding NumPy arrays, which traced indices cannot
    index), or ``""``."""

    block_mask: BlockMask | None = None
    mask_mod: Any = None
    score_mod: ScoreMod | None = None
    params: tuple[Any, ...] = ()
    traced: str = ""
    host: str = ""


def check_flex(block_mask: Any, mask_mod: Any, score_mod: Any) -> Flex:
    """Check ``block_mask``/``mask_mod``/``score_mod`` for a JAX call.

    A block mask built for NumPy (the default) or JAX (``xp=jax.numpy``) runs on either
    path (its block kinds are NumPy arrays); another library is a ``ValueError``. Arrays
    a mask_mod or score_mod holds must be NumPy arrays (the call then runs on the host;
    the built-in mask_mods' NumPy ids run on either path) or concrete JAX arrays (the
    traced path); both at once, or a traced one, is a
    ``TypeError`` (a score_mod's ``params``
    excepted: they are the custom_vjp's inputs and get gradients). A score_mod with params
    must be rebuildable (``ScoreMod(..., rebuild=)``, the built-ins are).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.flex import causal_mask, relative_position_bias
        >>> f = check_flex(None, causal_mask, relative_position_bias(np.zeros((32, 2))))
        >>> type(f.params[0]).__name__, f.traced
        ('ArrayImpl', '')
    """
    if block_mask is None and mask_mod is None and score_mod is None:
        return Flex()
    traced = host = ""
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                "block_mask must be a BlockMask from arrayattn.flex.create_block_mask, got "
                f"{type(block_mask).__module__}.{type(block_mask).__qualname__}"
            )
        if block_mask.library not in ("numpy", "jax"):
            raise ValueError(
                f"block_mask was built for {block_mask.library} "
                f"(create_block_mask(..., xp={block_mask.library})); arrayattn.jax takes "
                "block masks built for NumPy (the default) or JAX (xp=jax.numpy)"
            )
    smod = None if score_mod is None else as_score_mod(score_mod)
    params: tuple[Any, ...] = ()
    if smod is not None and smod.params:
        if not smod.rebindable:
            raise TypeError(
                f"score_mod {smod!r} has params but no rebuild= function: under "
                "jax.custom_vjp its params must be inputs of the call, so arrayattn.jax "
                "rebuilds the score_mod over them; pass ScoreMod(..., rebuild=lambda "
                "params: <the same ScoreMod over params>)"
            )
        params = tuple(
            as_jax_array(f"score_mod {smod!r} params[{i}]", p) for i, p in enumerate(smod.params)
        )
    checks = (
        ("block_mask's mask_mod", None if block_mask is None else block_mask.mask_mod, ()),
        ("mask_mod", None if mask_mod is None else as_mask_mod(mask_mod), ()),
        ("score_mod", smod, () if smod is None else tuple(smod.params)),
    )
    for name, obj, exclude in checks:
        if obj is None:
            continue
        if any(_traced(x) for x in held_arrays(obj, exclude)):
            raise TypeError(
                f"{name} {obj!r} holds a traced JAX array: arrays a mask_mod or score_mod "
                "captures must be concrete (NumPy or JAX arrays made outside jax.jit / "
                "jax.grad); a learned table belongs in a ScoreMod's params, which get "
                "gradients"
            )
        libs = held_libraries(obj, exclude)
        if libs - {"numpy", "jax"}:
            raise TypeError(
                f"{name} {obj!r} holds {', '.join(sorted(libs - {'numpy', 'jax'}))} arrays; "
                "arrayattn.jax takes NumPy or JAX arrays there"
            )
        if "jax" in libs and not traced:
            traced = f"{name} {obj!r} holds JAX arrays"
        # the built-ins move NumPy ids to the indices' library when evaluated, so they
        # run on every path; a user's function indexing NumPy arrays cannot take
        # traced indices
        builtin = isinstance(obj, MaskMod) and classifiable(obj)
        if "numpy" in libs and not host and not builtin:
            host = f"{name} {obj!r} holds NumPy arrays"
    if traced and host:
        raise TypeError(
            f"{host} but {traced}: build them on one library (JAX arrays run on every "
            "path; NumPy arrays on the CPU host path only)"
        )
    return Flex(block_mask, mask_mod, smod, params, traced, host)
