"""arrayattn for JAX: attention as a ``jax.custom_vjp`` with arrayattn's own backward.

``arrayattn.scaled_dot_product_attention`` takes JAX arrays too, but ``jax.grad`` then
differentiates through its array-API code with JAX's autodiff. This package's
:func:`scaled_dot_product_attention` has the same signature and semantics and gives
``jax.grad`` arrayattn's memory-efficient backward (FlashAttention-2 from the saved LSE:
sinks and float-mask gradients, dropout regenerated from the seed), under ``jax.jit``,
``jax.vmap`` and their compositions. It needs JAX (``pip install 'arrayattn[jax]'``);
``import arrayattn`` does not import it.
"""

from __future__ import annotations

try:
    import jax as _jax  # noqa: F401
except ImportError as error:  # pragma: no cover (JAX is installed where tests run)
    raise ModuleNotFoundError(
        "arrayattn.jax needs JAX, which is not installed: pip install 'arrayattn[jax]' "
        "(jax and jaxlib); arrayattn itself runs without it"
    ) from error

from .attention import path_for, scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention", "path_for"]
