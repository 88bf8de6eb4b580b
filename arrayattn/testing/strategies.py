"""Hypothesis strategies for attention calls (this module needs ``hypothesis``).

:func:`attention_calls` draws whole :class:`~arrayattn.testing.AttentionCall` objects;
:func:`shapes` and :func:`masks` are its building blocks. Array values come from a NumPy
generator seeded by a drawn integer (fast, and the same numbers on every backend); sizes
and options are drawn directly so hypothesis shrinks a failure to the smallest shapes and
the fewest options. Under ``derandomize=True`` or a fixed ``@seed`` every draw is
deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st

from ._backends import Backend
from ._calls import FEATURES, AttentionCall, _as_backend, library_features
from ._compare import dtype_name, round_to_dtype

__all__ = ["Shapes", "shapes", "masks", "attention_calls", "attention_problems"]

_BROADCASTS = ("kv_batch_1", "q_batch_1", "kv_no_batch", "extra_lead", "one_kv_head", "no_lead")


class Shapes(NamedTuple):
    """``query``, ``key``, ``value`` shapes and whether the call needs ``enable_gqa``."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    enable_gqa: bool


@st.composite
def shapes(
    draw: Any,
    *,
    max_len: int = 8,
    min_len: int = 1,
    gqa: bool = True,
    broadcast: bool = False,
    same_value_dim: bool = False,
    max_batch: int = 2,
) -> Shapes:
    """Attention shapes ``(..., Hq, L, E)``, ``(..., Hkv, S, E)``, ``(..., Hkv, S, Ev)``.

    Ragged ``L != S`` (each in ``[min_len, max_len]``, so ``min_len=0`` draws empty
    sequences), head dims 1 to 8, ``Ev`` different from ``E`` unless
    ``same_value_dim``; with ``gqa`` also ``Hq = G * Hkv`` for ``G`` of 2 or 3; with
    ``broadcast`` leading dims that broadcast (batch of 1 against ``B``, no batch dim,
    an extra leading dim, 3-D inputs) or one KV head shared by all query heads.

    Examples:
        >>> from hypothesis import given, settings
        >>> from arrayattn.testing.strategies import shapes
        >>> @settings(max_examples=5, derandomize=True)
        ... @given(shapes(gqa=True))
        ... def check(s):
        ...     assert s.query[-1] == s.key[-1] and s.query[-3] % s.key[-3] == 0
        >>> check()
    """
    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(2, 3)) if gqa else 1
    L = draw(st.integers(min_len, max_len))
    S = draw(st.integers(min_len, max_len))
    E = draw(st.sampled_from([1, 2, 3, 4, 8]))
    Ev = E if same_value_dim else draw(st.sampled_from([E, 1, 3, 5]))
    Hq = Hkv * G
    q_lead: tuple[int, ...] = (B,)
    kv_lead: tuple[int, ...] = (B,)
    if broadcast:
        how = draw(st.sampled_from(_BROADCASTS))
        if how == "kv_batch_1":
            q_lead, kv_lead = (max(B, 2),), (1,)
        elif how == "q_batch_1":
            q_lead, kv_lead = (1,), (max(B, 2),)
        elif how == "kv_no_batch":
            kv_lead = ()
        elif how == "extra_lead":
            q_lead, kv_lead = (2, B), (B,)
        elif how == "one_kv_head" and not gqa:
            Hkv = 1
            Hq = max(Hq, 2)
        elif how == "no_lead":
            q_lead = kv_lead = ()
    q = q_lead + (Hq, L, E)
    k = kv_lead + (Hkv, S, E)
    v = kv_lead + (Hkv, S, Ev)
    return Shapes(q, k, v, gqa and G > 1)


def _lead(sh: Shapes) -> tuple[int, ...]:
    return tuple(int(d) for d in np.broadcast_shapes(sh.query[:-3], sh.key[:-3], sh.value[:-3]))


def _heads(sh: Shapes) -> int:
    return max(sh.query[-3], sh.key[-3])


@st.composite
def masks(
    draw: Any,
    sh: Shapes,
    *,
    kind: str | None = None,
    empty_rows: bool = False,
    dtype: str = "float32",
) -> np.ndarray:
    """An ``attn_mask`` for calls of shapes ``sh``: bool (``True`` takes part, about 70%)
    or float (a bias, with ``-inf`` entries sometimes), of a shape that broadcasts to
    ``(*batch, Hq, L, S)`` (full, per batch, ``(L, S)``, one row for all queries).
    ``empty_rows`` masks at least one query row completely (all ``False`` / ``-inf``).

    Examples:
        >>> from hypothesis import find
        >>> from arrayattn.testing.strategies import Shapes, masks
        >>> sh = Shapes((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), False)
        >>> m = find(masks(sh, kind="bool", empty_rows=True), lambda m: True)
        >>> bool((~m.any(axis=-1)).any())
        True
    """
    lead, H = _lead(sh), _heads(sh)
    L, S = sh.query[-2], sh.key[-2]
    kind = kind or draw(st.sampled_from(["bool", "float"]))
    choices = [lead + (H, L, S), lead + (1, L, S), (L, S)]
    if not empty_rows:
        choices.append((1, S))
    shape = draw(st.sampled_from(choices))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "bool":
        m = rng.random(shape) < 0.7
    else:
        m = round_to_dtype(rng.standard_normal(shape), dtype)
        if draw(st.booleans()):
            m = np.where(rng.random(shape) < 0.2, -np.inf, m)
    if empty_rows and L > 0:
        row = draw(st.integers(0, L - 1))
        m = m.copy()
        m[..., row, :] = False if kind == "bool" else -np.inf
    return m


def _values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape)


@st.composite
def attention_calls(
    draw: Any,
    xp: Any = None,
    dtypes: Iterable[Any] = ("float32",),
    max_len: int = 8,
    features: Iterable[str] | None = None,
    *,
    require: Iterable[str] = (),
    alignments: Iterable[str] = ("top_left", "bottom_right"),
    lead_ndim_fixed: bool = True,
    same_value_dim: bool = False,
) -> AttentionCall:
    """Whole attention calls: shapes, options, masks and values.

    Args:
        xp: a backend name, :class:`~arrayattn.testing.Backend` or library module
            (``numpy``, ``torch``, ``jax.numpy``, ...) the calls are bound to
            (``call.arrays()`` then returns its arrays); dtypes it lacks are not drawn.
        dtypes: dtypes to draw from, names or any library's dtype objects
            (``"low_precision"`` adds float16/bfloat16).
        max_len: largest ``L`` and ``S``.
        features: names from :data:`~arrayattn.testing.FEATURES` that may appear
            (default: everything this arrayattn supports, sinks and ALiBi only when its
            signature has them); each appears in about half the draws.
        require: features every call exercises.
        alignments: causal alignments the implementation accepts (windows are drawn
            with one of them; FlashAttention accepts only ``"bottom_right"``).
        lead_ndim_fixed: without ``"broadcast"``, inputs are 4-D ``(B, H, L, E)``.
        same_value_dim: ``Ev == E`` always.

    Covers L or S of 0 and 1 (``"zero_length"``), ragged ``L != S``, broadcast
    leading dims, GQA ratios, bool/float masks with fully masked rows, both causal
    alignments with ``L != S``, windows, softcap, per-sequence lengths, sinks/ALiBi,
    dropout seeds and adversarial values (logits in the hundreds, float16 values near
    overflow).

    Examples:
        >>> from hypothesis import given, settings
        >>> from arrayattn.testing import attention_calls
        >>> @settings(max_examples=10, derandomize=True, deadline=None)
        ... @given(attention_calls(features={"gqa", "window"}, require={"window"}))
        ... def check(call):
        ...     out, lse = call.reference()
        ...     assert out.shape[-2] == call.L and "window" in call.options
        >>> check()
    """
    backend: Backend | None = _as_backend(xp)
    allowed = set(library_features() if features is None else features)
    required = set(require)
    unknown = (allowed | required) - set(FEATURES)
    if unknown:
        raise ValueError(f"features must be names from FEATURES, got unknown {sorted(unknown)}")
    allowed |= required
    aligns = [a for a in ("top_left", "bottom_right") if a in set(alignments)]

    def want(name: str) -> bool:
        if name in required:
            return True
        return name in allowed and draw(st.booleans())

    # Decisions first, sizes next: hypothesis shrinks toward the first choices.
    def present(pool: list[str]) -> list[str]:
        return pool if backend is None else [d for d in pool if backend.dtype(d) is not None]

    dtype_pool = present([dtype_name(d) for d in dtypes])
    # Low precision only where the backend has float16 or bfloat16 (not array-api-strict).
    low_pool = present(["float16", "bfloat16"])
    if "low_precision" in allowed and low_pool and want("low_precision"):
        dtype_pool = low_pool
    if not dtype_pool:
        raise ValueError(f"none of the dtypes {list(dtypes)} exists on {backend}")
    dtype = draw(st.sampled_from(dtype_pool))

    gqa = want("gqa")
    broadcast = want("broadcast")
    zero = want("zero_length")
    lengths = want("lengths")
    sh = draw(
        shapes(
            max_len=max_len,
            min_len=0 if zero else 1,
            gqa=gqa,
            broadcast=broadcast,
            same_value_dim=same_value_dim,
        )
    )
    if zero and "zero_length" in required and 0 not in (sh.query[-2], sh.key[-2]):
        which = draw(st.sampled_from(["L", "S", "both"]))
        qs, ks, vs = list(sh.query), list(sh.key), list(sh.value)
        if which in ("L", "both"):
            qs[-2] = 0
        if which in ("S", "both"):
            ks[-2] = vs[-2] = 0
        sh = Shapes(tuple(qs), tuple(ks), tuple(vs), sh.enable_gqa)
    L, S = sh.query[-2], sh.key[-2]
    lead, H = _lead(sh), _heads(sh)
    options: dict[str, Any] = {}
    used = set()
    if sh.enable_gqa:
        options["enable_gqa"] = True
        used.add("gqa")
    if broadcast:
        used.add("broadcast")
    if 0 in (L, S):
        used.add("zero_length")

    causal_kinds = [
        f for f in ("causal_top_left", "causal_bottom_right") if f in allowed and f in required
    ] or [f for f in ("causal_top_left", "causal_bottom_right") if f in allowed]
    causal = None
    if causal_kinds and any(want(f) for f in causal_kinds):
        causal = draw(st.sampled_from(causal_kinds))
        options["is_causal"] = True
        if causal == "causal_bottom_right":
            options["causal_align"] = "bottom_right"
        used.add(causal)
    if want("window"):
        left = draw(st.integers(-1, max_len))
        right = draw(st.integers(-1, max_len))
        options["window"] = (left, right)
        if causal is None:
            if not aligns:
                aligns = ["top_left"]
            align = draw(st.sampled_from(aligns))
            if align == "bottom_right":
                options["causal_align"] = "bottom_right"
        used.add("window")
    if want("softcap"):
        options["softcap"] = draw(st.sampled_from([0.5, 1.0, 5.0, 30.0]))
        used.add("softcap")
    if want("scale"):
        options["scale"] = draw(st.sampled_from([0.05, 0.3, 1.0, 2.5]))
        used.add("scale")

    # Empty rows through one mechanism the implementation supports, in this order.
    empty = want("empty_rows") and L > 0
    via = None
    if empty:
        for mech in ("bool_mask", "float_mask", "lengths", "causal_bottom_right"):
            if mech in allowed:
                via = mech
                break
        used.add("empty_rows")
    mask = None
    mask_kinds = [k for k in ("bool_mask", "float_mask") if k in allowed]
    if via in ("bool_mask", "float_mask"):
        mask = draw(masks(sh, kind=via.split("_")[0], empty_rows=True, dtype=dtype))
        used.add(via)
    elif mask_kinds and any(want(k) for k in mask_kinds):
        kind = draw(st.sampled_from(mask_kinds))
        mask = draw(masks(sh, kind=kind.split("_")[0], dtype=dtype))
        used.add(kind)
    if via == "causal_bottom_right":
        if L <= S:  # rows i < L - S see no key: make L exceed S
            sh = Shapes(
                sh.query[:-2] + (S + draw(st.integers(1, 3)), sh.query[-1]),
                sh.key,
                sh.value,
                sh.enable_gqa,
            )
            L = sh.query[-2]
        options["is_causal"] = True
        options["causal_align"] = "bottom_right"
        used.add("causal_bottom_right")

    if (lengths or via == "lengths") and math.prod(lead) > 0:
        n = math.prod(lead)
        which = "kv" if via == "lengths" else draw(st.sampled_from(["q", "kv", "both"]))
        if which in ("q", "both"):
            ql = draw(st.lists(st.integers(0, L), min_size=n, max_size=n))
            options["q_lengths"] = np.asarray(ql, dtype=np.int32).reshape(lead)
        if which in ("kv", "both"):
            kl = draw(st.lists(st.integers(0, S), min_size=n, max_size=n))
            if via == "lengths":
                kl[draw(st.integers(0, n - 1))] = 0
            options["kv_lengths"] = np.asarray(kl, dtype=np.int32).reshape(lead)
        used.add("lengths")
    # Sinks and ALiBi are not combined with lengths: how they meet padded query rows is
    # an implementation detail the contract does not fix.
    if "lengths" not in used:
        if want("sinks"):
            options["sinks"] = np.asarray(
                draw(st.lists(st.sampled_from([-2.0, 0.0, 0.5, 3.0]), min_size=H, max_size=H))
            )
            used.add("sinks")
        if want("alibi"):
            options["alibi_slopes"] = np.asarray([2.0 ** (-(h + 1)) for h in range(H)])
            used.add("alibi")
    if want("dropout"):
        options["dropout_p"] = draw(st.sampled_from([0.1, 0.3, 0.5]))
        options["seed"] = draw(st.integers(0, 2**32 - 1))
        used.add("dropout")

    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    q = _values(rng, sh.query)
    k = _values(rng, sh.key)
    v = _values(rng, sh.value)
    if want("adversarial"):
        # Logits in the hundreds (softmax is one-hot without the max subtraction) and,
        # in float16, values near its overflow (65504): half of it, so that dropout's
        # 1 / (1 - p) <= 2 keeps the exact output representable.
        q = q * draw(st.sampled_from([30.0, 300.0]))
        if dtype == "float16" and v.size:
            v = v * (3.0e4 / max(float(np.max(np.abs(v))), 1e-30))
        used.add("adversarial")
    for f in ("lse", "gradients"):
        if want(f):
            used.add(f)
    if dtype in ("float16", "bfloat16"):
        used.add("low_precision")
    q, k, v = (round_to_dtype(x, dtype) for x in (q, k, v))
    return AttentionCall(q, k, v, mask, options, dtype, frozenset(used), backend)


@st.composite
def attention_problems(draw: Any, structure: bool = True, gqa: bool = True) -> tuple:
    """Compact attention problems ``(q_shape, k_shape, mask_kind, kwargs, seed)``:
    4-D shapes with ``L``, ``S`` in 1..9 and ``Hq = G * Hkv``, optional causal alignment
    and window (``structure``), softcap and scale, a mask kind (``None``, ``"bool"``,
    ``"float"``) and a NumPy seed for the values. Tests that build their own arrays
    (``helpers.attention_inputs``) draw these; :func:`attention_calls` draws whole calls.

    Examples:
        >>> from hypothesis import find
        >>> from arrayattn.testing.strategies import attention_problems
        >>> q_shape, k_shape, mask, kwargs, seed = find(attention_problems(), lambda p: True)
        >>> len(q_shape), q_shape[-1] == k_shape[-1]
        (4, True)
    """
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3)) if gqa else 1
    L = draw(st.integers(1, 9))
    S = draw(st.integers(1, 9))
    E = draw(st.sampled_from([1, 3, 4, 8]))
    kwargs: dict[str, Any] = {"enable_gqa": G > 1}
    if structure:
        if draw(st.booleans()):
            kwargs["is_causal"] = True
        kwargs["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
        if draw(st.booleans()):
            kwargs["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.floats(0.5, 5.0))
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.1, 2.0))
    mask = draw(st.sampled_from([None, "bool", "float"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return (B, Hkv * G, L, E), (B, Hkv, S, E), mask, kwargs, seed
