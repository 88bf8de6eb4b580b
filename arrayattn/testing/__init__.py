"""arrayattn.testing: check any attention implementation against arrayattn's numerically
defined semantics, on any array backend.

- :func:`reference_attention` / :func:`reference_vjp`: the contract computed plainly in
  float64 NumPy (output, LSE, probabilities; gradients).
- :func:`assert_attention_close`: dtype-aware comparison (FlashAttention's rule for
  float16/bfloat16) that names the first NaN/Inf and the errors.
- :func:`check_attention`: a per-feature conformance battery with shrunk failing
  examples, for your function or a peer's (:mod:`arrayattn.testing.adapters`); inputs
  must stay unchanged, and dropout without a seed is checked statistically.
- :mod:`arrayattn.testing.strategies` (needs hypothesis): :func:`attention_calls`,
  :func:`shapes`, :func:`masks`.
- a pytest plugin (entry point ``arrayattn``): an ``xp`` fixture over the installed
  backends, ``--backends`` / ``ARRAYATTN_BACKENDS``.

Importing this package needs neither pytest nor hypothesis; the strategies (and
:func:`check_attention`, which draws from them) import hypothesis when used.

Examples:
    >>> import numpy as np
    >>> import arrayattn as aa
    >>> from arrayattn.testing import reference_attention, assert_attention_close
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    >>> expected, lse = reference_attention(q, k, v, is_causal=True)
    >>> out = aa.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> assert_attention_close(out, expected, dtype="float32", what="output")
"""

from __future__ import annotations

from typing import Any

from ._backends import BACKENDS, Backend, available_backends, make_backend, selected_backends
from ._calls import FEATURES, AttentionCall, library_features
from ._check import ConformanceReport, FeatureResult, check_attention, check_call
from ._compare import ATTENTION_TOLERANCES, assert_attention_close, naive_attention, round_to_dtype
from .oracles import AttentionGrads, reference_attention, reference_vjp, to_numpy

__all__ = [
    "reference_attention",
    "reference_vjp",
    "AttentionGrads",
    "assert_attention_close",
    "naive_attention",
    "round_to_dtype",
    "ATTENTION_TOLERANCES",
    "check_attention",
    "check_call",
    "ConformanceReport",
    "FeatureResult",
    "AttentionCall",
    "FEATURES",
    "library_features",
    "attention_calls",
    "shapes",
    "masks",
    "Backend",
    "BACKENDS",
    "make_backend",
    "selected_backends",
    "available_backends",
    "to_numpy",
]

_STRATEGIES = ("attention_calls", "shapes", "masks")


def __getattr__(name: str) -> Any:
    # The strategies need hypothesis: import it only when they are asked for.
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'arrayattn.testing' has no attribute {name!r}")
