"""Adapters: how the kit calls an attention function (layout, argument names, outputs,
gradients) and what it supports.

An :class:`Adapter` runs one :class:`~arrayattn.testing.AttentionCall` (arrayattn's
layout ``(..., H, L, E)`` and names) through a user function and returns NumPy float64
results in that layout. Ready-made: :func:`for_function` (any function with arrayattn's /
PyTorch's argument names, in ``"BHLD"`` or ``"BLHD"`` layout), :func:`arrayattn_sdpa`,
:func:`torch_sdpa`, :func:`jax_dpa`, :func:`keras_dpa` and :func:`flash_attn` (the
``flash_attn_func`` signature).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ._backends import Backend, make_backend
from ._calls import FEATURES, AttentionCall, library_features
from ._compare import dtype_name
from .oracles import to_numpy

__all__ = [
    "Adapter",
    "NotExpressible",
    "for_function",
    "arrayattn_sdpa",
    "torch_sdpa",
    "jax_dpa",
    "keras_dpa",
    "flash_attn",
]


class NotExpressible(Exception):
    """Raised by an adapter for a drawn call the function cannot express (a combination
    of options it lacks); the check skips that example instead of failing it."""


Result = tuple[np.ndarray, np.ndarray | None]
Grads = tuple[np.ndarray, ...]
ForwardBackward = Callable[[AttentionCall, Backend, np.ndarray], tuple[np.ndarray, Grads]]


@dataclass
class Adapter:
    """How to run calls through one attention function.

    Attributes:
        name: shown in the report.
        run: ``run(call, backend, want_lse) -> (out, lse or None)``, NumPy arrays in
            arrayattn's layout.
        supports: feature names (from :data:`~arrayattn.testing.FEATURES`) to check.
        backend: the backend name the arrays are created on.
        vjp: ``vjp(call, backend, d_out) -> (dq, dk, dv)`` in arrayattn's layout, or
            ``None`` (then ``"gradients"`` is not supported).
        dtypes: dtypes the battery draws (``"low_precision"`` adds float16/bfloat16).
        alignments: causal alignments the function accepts for windows.
        lead_ndim_fixed: inputs are always 4-D ``(B, H, L, E)`` unless ``"broadcast"``.
        same_value_dim: the function needs ``Ev == E``.
        conventions: feature -> documented difference; a failure there is reported as
            ``convention``, not ``failed``.
        notes: documented differences the adapter bridges (layout, names).
        takes_seed: whether the function takes a dropout ``seed`` (its mask is then
            compared with arrayattn's); ``False``: its dropout is random and checked
            statistically instead; ``None``: unknown, one call tells.
        forward_backward: ``forward_backward(call, backend, d_out) -> (out, (dq, dk,
            dv))`` from one forward pass (one random dropout mask), or ``None``; checks
            the gradients of a function that takes no seed.

    Examples:
        >>> from arrayattn.testing.adapters import arrayattn_sdpa
        >>> arrayattn_sdpa().backend
        'numpy'
    """

    name: str
    run: Callable[[AttentionCall, Backend, bool], Result]
    supports: frozenset[str]
    backend: str = "numpy"
    vjp: Callable[[AttentionCall, Backend, np.ndarray], tuple[Any, ...]] | None = None
    dtypes: tuple[str, ...] = ("float32",)
    alignments: tuple[str, ...] = ("top_left", "bottom_right")
    lead_ndim_fixed: bool = True
    same_value_dim: bool = False
    conventions: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    takes_seed: bool | None = True
    forward_backward: ForwardBackward | None = None


def _np_dtype(x: Any) -> Any:
    """The NumPy dtype of an array's values (float32 for bfloat16, which NumPy lacks)."""
    name = str(x.dtype).rsplit(".", 1)[-1]
    return np.float32 if name == "bfloat16" else np.dtype(name)


def _blhd(x: Any, xp: Any) -> Any:
    """``(..., H, L, D)`` <-> ``(..., L, H, D)`` (its own inverse)."""
    axes = tuple(range(x.ndim - 3)) + (x.ndim - 2, x.ndim - 3, x.ndim - 1)
    return xp.permute_dims(x, axes)


def _np_blhd(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -2, -3)


def _out_and_grads_by_autodiff(
    fn_of_arrays: Callable[..., Any], backend: Backend, arrays: tuple[Any, ...], d_out: np.ndarray
) -> tuple[np.ndarray, Grads]:
    """Output and cotangents of ``fn_of_arrays(*arrays)`` (one output) from one forward
    pass, by the backend's own autodiff (torch.autograd, jax.vjp)."""
    if backend.name == "torch":
        import torch

        leaves = [a.detach().clone().requires_grad_(True) for a in arrays]
        out = fn_of_arrays(*leaves)
        cot = torch.as_tensor(d_out, dtype=out.dtype, device=out.device)
        grads = torch.autograd.grad(out, leaves, cot, allow_unused=True)
        return to_numpy(out).astype(np.float64), tuple(
            np.zeros(tuple(a.shape)) if g is None else to_numpy(g).astype(np.float64)
            for a, g in zip(leaves, grads, strict=True)
        )
    if backend.name == "jax":
        import jax
        import jax.numpy as jnp

        out, pullback = jax.vjp(fn_of_arrays, *arrays)
        grads = pullback(jnp.asarray(d_out, dtype=out.dtype))
        return np.asarray(out, dtype=np.float64), tuple(
            np.asarray(g, dtype=np.float64) for g in grads
        )
    raise NotExpressible(f"no autodiff for backend {backend.name}")


def _grads_by_autodiff(
    fn_of_arrays: Callable[..., Any], backend: Backend, arrays: tuple[Any, ...], d_out: np.ndarray
) -> Grads:
    """Cotangents of ``fn_of_arrays(*arrays)`` (one output) by the backend's own
    autodiff (torch.autograd, jax.vjp)."""
    return _out_and_grads_by_autodiff(fn_of_arrays, backend, arrays, d_out)[1]


def for_function(
    fn: Callable[..., Any],
    *,
    layout: str = "BHLD",
    supports: Iterable[str] | None = None,
    xp: str | ModuleType | Backend = "numpy",
    name: str | None = None,
    vjp: Callable[..., Any] | None = None,
    dtypes: Iterable[Any] = ("float32",),
) -> Adapter:
    """An adapter for ``fn(query, key, value, attn_mask=None, dropout_p=0.0,
    is_causal=False, scale=None, enable_gqa=False, **options)`` with arrayattn's option
    names (``causal_align``, ``window``, ``softcap``, ``seed``, ``q_lengths``,
    ``kv_lengths``, ``sinks``, ``alibi_slopes``); with ``return_lse=True`` it must
    return ``(out, lse)``, LSE shaped ``(..., H, L)``.

    A function with ``dropout_p`` but no ``seed`` (PyTorch's signature) draws its own
    random mask: its dropout is checked statistically (keep rate, ``1 / (1 - p)``
    scaling, ``p = 0``, gradients against the mask its output shows), never compared
    with a seed-defined mask. With ``**kwargs`` and no ``seed``, one call tells.

    Args:
        fn: the function under test.
        layout: ``"BHLD"`` (``(..., H, L, D)``) or ``"BLHD"`` (``(..., L, H, D)``,
            FlashAttention's) for query/key/value/output; masks stay ``(..., H, L, S)``.
        supports: features to check; default: ``basic`` and every feature whose
            argument ``fn``'s signature names (all of them with ``**kwargs``), plus
            ``gradients`` on torch and JAX (their autodiff) or when ``vjp`` is given.
        xp: the library ``fn``'s arrays belong to: its module (``numpy``, ``torch``,
            ``jax.numpy``, ``array_api_strict``, ``dask.array``, ``cupy``, or
            array-api-compat's wrapper of one), a name from
            :data:`~arrayattn.testing.BACKENDS`, or a :class:`~arrayattn.testing.Backend`.
        name: for the report (default: ``fn``'s qualified name).
        vjp: optional ``vjp(q, k, v, mask, d_out, **options) -> (dq, dk, dv)`` in the
            same layout.
        dtypes: dtypes the battery draws (names or any library's dtype objects).

    Examples:
        >>> import arrayattn as aa
        >>> from arrayattn.testing.adapters import for_function
        >>> a = for_function(aa.scaled_dot_product_attention)
        >>> {"window", "lse", "softcap"} <= a.supports
        True
    """
    if layout not in ("BHLD", "BLHD"):
        raise ValueError(f"layout must be 'BHLD' or 'BLHD', got {layout!r}")
    backend = make_backend(xp)
    import arrayattn

    if vjp is None and fn in arrayattn.differentiable_ops():
        # arrayattn's own ops: their hand-written backward, on any backend.
        def vjp(q: Any, k: Any, v: Any, mask: Any, d_out: Any, **options: Any) -> Any:
            _, pullback = arrayattn.vjp(fn, q, k, v, mask, **options)
            return pullback(backend.asarray(np.asarray(d_out, dtype=_np_dtype(q))))

    if supports is None:
        supports = _supports_from_signature(fn)
        if backend.name in ("torch", "jax") or vjp is not None:
            supports.add("gradients")
    unknown = set(supports) - set(FEATURES)
    if unknown:
        raise ValueError(f"supports must be names from FEATURES, got unknown {sorted(unknown)}")
    blhd = layout == "BLHD"

    def prepare(call: AttentionCall, b: Backend) -> tuple[tuple[Any, ...], dict[str, Any]]:
        q, k, v, m = call.arrays(b)
        if blhd:
            q, k, v = (_blhd(x, b.xp) for x in (q, k, v))
        kwargs = call.kwargs(b)
        if m is not None:
            kwargs["attn_mask"] = m
        return (q, k, v), kwargs

    def run(call: AttentionCall, b: Backend, want_lse: bool) -> Result:
        (q, k, v), kwargs = prepare(call, b)
        if want_lse:
            out, lse = fn(q, k, v, return_lse=True, **kwargs)
            lse = to_numpy(lse).astype(np.float64)
        else:
            out, lse = fn(q, k, v, **kwargs), None
        out = to_numpy(out).astype(np.float64)
        return (_np_blhd(out) if blhd else out), lse

    def forward_backward(call: AttentionCall, b: Backend, d_out: np.ndarray) -> tuple[Any, Grads]:
        (q, k, v), kwargs = prepare(call, b)
        dout = _np_blhd(d_out) if blhd else d_out
        out, g = _out_and_grads_by_autodiff(
            lambda q_, k_, v_: fn(q_, k_, v_, **kwargs), b, (q, k, v), dout
        )
        return (_np_blhd(out), tuple(_np_blhd(x) for x in g)) if blhd else (out, g)

    def grads(call: AttentionCall, b: Backend, d_out: np.ndarray) -> Grads:
        if vjp is None:
            return forward_backward(call, b, d_out)[1]
        (q, k, v), kwargs = prepare(call, b)
        dout = _np_blhd(d_out) if blhd else d_out
        g = vjp(q, k, v, kwargs.pop("attn_mask", None), dout, **kwargs)
        g = tuple(to_numpy(x).astype(np.float64) for x in g[:3])
        return tuple(_np_blhd(x) for x in g) if blhd else g

    gradients = "gradients" in supports
    return Adapter(
        name=name or str(getattr(fn, "__qualname__", repr(fn))),
        run=run,
        supports=frozenset(supports),
        backend=backend.name,
        vjp=grads if gradients else None,
        dtypes=tuple(dtype_name(d) for d in dtypes),
        lead_ndim_fixed=True,
        notes=("layout BLHD: (batch, L, heads, dim), transposed by the adapter",) if blhd else (),
        takes_seed=_takes_seed_from_signature(fn),
        # One pass shares one random dropout mask: only the backend's own autodiff gives
        # that (a separate vjp= call draws another mask).
        forward_backward=forward_backward if gradients and vjp is None else None,
    )


_ARG_FEATURES = {
    "attn_mask": ("bool_mask", "float_mask", "empty_rows"),
    "is_causal": ("causal_top_left",),
    "causal_align": ("causal_bottom_right",),
    "scale": ("scale",),
    "enable_gqa": ("gqa",),
    "window": ("window",),
    "softcap": ("softcap",),
    "q_lengths": ("lengths",),
    "dropout_p": ("dropout",),
    "sinks": ("sinks",),
    "alibi_slopes": ("alibi",),
    "return_lse": ("lse",),
}


def _takes_seed_from_signature(fn: Callable[..., Any]) -> bool | None:
    """``True`` when ``fn`` names ``seed``, ``False`` when its signature has neither
    ``seed`` nor ``**kwargs`` (PyTorch's), ``None`` when its signature cannot tell."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return None
    if "seed" in params:
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None  # **kwargs may pass it on to a function that rejects it
    return False


def _supports_from_signature(fn: Callable[..., Any]) -> set[str]:
    out = {"basic", "broadcast", "zero_length", "low_precision", "adversarial", "combined"}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: options unknown
        return out
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for arg, feats in _ARG_FEATURES.items():
        if var_kw or arg in params:
            out.update(feats)
    return out


def arrayattn_sdpa(
    xp: str | ModuleType | Backend = "numpy", implementation: str = "auto"
) -> Adapter:
    """arrayattn's own :func:`~arrayattn.scaled_dot_product_attention` on backend ``xp``
    (jitted on JAX), every feature this version supports, gradients by
    :func:`arrayattn.vjp`.

    Examples:
        >>> from arrayattn.testing.adapters import arrayattn_sdpa
        >>> "causal_bottom_right" in arrayattn_sdpa("numpy").supports
        True
    """
    import arrayattn as aa

    backend = make_backend(xp)
    sdpa = aa.scaled_dot_product_attention

    def guarded(fn: Callable[[], Any]) -> Any:
        # A named implementation may decline a call (the NumPy fast path: empty sizes,
        # other libraries): not a failure of the contract.
        try:
            return fn()
        except ValueError as exc:
            if implementation != "auto" and "cannot run this call" in str(exc):
                raise NotExpressible(str(exc)) from exc
            raise

    def run(call: AttentionCall, b: Backend, want_lse: bool) -> Result:
        q, k, v, m = call.arrays(b)
        res = guarded(
            lambda: b.call(
                sdpa,
                q,
                k,
                v,
                m,
                return_lse=want_lse,
                implementation=implementation,
                **call.kwargs(b),
            )
        )
        if want_lse:
            return to_numpy(res[0]).astype(np.float64), to_numpy(res[1]).astype(np.float64)
        return to_numpy(res).astype(np.float64), None

    def grads(call: AttentionCall, b: Backend, d_out: np.ndarray) -> tuple[np.ndarray, ...]:
        q, k, v, m = call.arrays(b)
        cot = call._to(b, d_out)
        _, g = guarded(
            lambda: b.vjp(sdpa, (q, k, v, m), cot, implementation=implementation, **call.kwargs(b))
        )
        return tuple(to_numpy(x).astype(np.float64) for x in g[:3])

    return Adapter(
        name=f"arrayattn.scaled_dot_product_attention ({implementation})",
        run=run,
        supports=library_features(),
        backend=backend.name,
        vjp=grads,
        dtypes=("float32", "float64"),
        lead_ndim_fixed=False,
    )


def torch_sdpa(fn: Callable[..., Any] | None = None) -> Adapter:
    """``torch.nn.functional.scaled_dot_product_attention`` (or ``fn`` with its
    signature) on CPU tensors; bottom-right causal through
    ``torch.nn.attention.bias.causal_lower_right``; gradients by autograd. No LSE,
    windows, softcap, lengths, sinks or ALiBi in its signature; its dropout draws
    from torch's generator (no seed), so it is checked statistically instead of against
    a seed-defined mask.

    Examples:
        >>> from arrayattn.testing.adapters import torch_sdpa
        >>> a = torch_sdpa()  # doctest: +SKIP
    """
    import torch

    sdpa = fn or torch.nn.functional.scaled_dot_product_attention

    def options(call: AttentionCall, b: Backend) -> tuple[tuple[Any, ...], dict[str, Any]]:
        q, k, v, m = call.arrays(b)
        opts = call.options
        kwargs: dict[str, Any] = {}
        if opts.get("scale") is not None:
            kwargs["scale"] = opts["scale"]
        if opts.get("enable_gqa"):
            kwargs["enable_gqa"] = True
        if opts.get("is_causal"):
            if opts.get("causal_align") == "bottom_right":
                if m is not None:
                    raise NotExpressible("bottom-right causal bias together with attn_mask")
                from torch.nn.attention.bias import causal_lower_right

                m = causal_lower_right(call.L, call.S)
            else:
                if m is not None:
                    raise NotExpressible("attn_mask together with is_causal (SDPA rejects it)")
                kwargs["is_causal"] = True
        if m is not None:
            kwargs["attn_mask"] = m
        if "dropout_p" in opts:
            if opts.get("seed") is not None:
                raise NotExpressible("a dropout seed (SDPA draws from torch's generator)")
            kwargs["dropout_p"] = opts["dropout_p"]
        return (q, k, v), kwargs

    def run(call: AttentionCall, b: Backend, want_lse: bool) -> Result:
        (q, k, v), kwargs = options(call, b)
        return to_numpy(sdpa(q, k, v, **kwargs)).astype(np.float64), None

    def forward_backward(call: AttentionCall, b: Backend, d_out: np.ndarray) -> tuple[Any, Grads]:
        (q, k, v), kwargs = options(call, b)
        return _out_and_grads_by_autodiff(lambda *a: sdpa(*a, **kwargs), b, (q, k, v), d_out)

    def grads(call: AttentionCall, b: Backend, d_out: np.ndarray) -> Grads:
        return forward_backward(call, b, d_out)[1]

    return Adapter(
        name=f"torch.nn.functional.scaled_dot_product_attention (torch {torch.__version__})",
        run=run,
        supports=frozenset(
            {
                "basic",
                "scale",
                "bool_mask",
                "float_mask",
                "empty_rows",
                "causal_top_left",
                "causal_bottom_right",
                "gqa",
                "broadcast",
                "zero_length",
                "dropout",
                "low_precision",
                "adversarial",
                "gradients",
                "combined",
            }
        ),
        backend="torch",
        vjp=grads,
        dtypes=("float32", "float64"),
        lead_ndim_fixed=False,
        conventions={
            "empty_rows": "SDPA returned NaN on fully masked rows for years "
            "(pytorch #103749, #103963)",
        },
        notes=(
            "is_causal is top-left; bottom-right via torch.nn.attention.bias.causal_lower_right",
            "attn_mask and is_causal cannot be combined (RuntimeError); such calls are skipped",
        ),
        # Dropout draws from torch's generator: no seed to pass.
        takes_seed=False,
        forward_backward=forward_backward,
    )


def jax_dpa(fn: Callable[..., Any] | None = None) -> Adapter:
    """``jax.nn.dot_product_attention`` (or ``fn`` with its signature): layout BTNH
    ``(B, T, N, H)``, transposed by the adapter; ``mask=`` for bool masks, ``bias=`` for
    float ones (made 4-D); ``local_window_size`` for windows (top-left aligned, ``-1``
    passed as ``L + S``); ``query_seq_lengths``/``key_value_seq_lengths``; LSE through
    ``return_residual``; gradients by ``jax.vjp``.

    Examples:
        >>> from arrayattn.testing.adapters import jax_dpa
        >>> a = jax_dpa()  # doctest: +SKIP
    """
    import jax

    dpa = fn or jax.nn.dot_product_attention

    def prepare(call: AttentionCall, b: Backend) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if call.query.ndim != 4 or call.key.ndim != 4 or call.value.ndim != 4:
            raise NotExpressible("jax.nn.dot_product_attention takes 4-D (B, T, N, H) inputs")
        q, k, v, m = call.arrays(b)
        q, k, v = (_blhd(x, b.xp) for x in (q, k, v))
        opts = call.options
        kwargs: dict[str, Any] = {}
        if m is not None:
            assert call.attn_mask is not None  # m is the call's mask on the backend
            m = b.xp.reshape(m, (1,) * (4 - m.ndim) + tuple(m.shape))
            kwargs["mask" if call.attn_mask.dtype == np.bool_ else "bias"] = m
        if opts.get("scale") is not None:
            kwargs["scale"] = opts["scale"]
        align = opts.get("causal_align", "top_left")
        if align == "bottom_right" and call.L != call.S:
            raise NotExpressible("bottom-right alignment")
        if opts.get("is_causal"):
            kwargs["is_causal"] = True
        if opts.get("window") is not None:
            big = call.L + call.S
            kwargs["local_window_size"] = tuple(big if w < 0 else w for w in opts["window"])
        if opts.get("q_lengths") is not None:
            kwargs["query_seq_lengths"] = b.asarray(opts["q_lengths"].astype(np.int32))
        if opts.get("kv_lengths") is not None:
            kwargs["key_value_seq_lengths"] = b.asarray(opts["kv_lengths"].astype(np.int32))
        return (q, k, v), kwargs

    def run(call: AttentionCall, b: Backend, want_lse: bool) -> Result:
        (q, k, v), kwargs = prepare(call, b)
        if want_lse:
            out, lse = dpa(q, k, v, return_residual=True, **kwargs)
            # The residual is (B, T, N): back to arrayattn's (B, N, T).
            lse = np.swapaxes(np.asarray(lse, dtype=np.float64), -1, -2)
        else:
            out, lse = dpa(q, k, v, **kwargs), None
        return _np_blhd(np.asarray(out, dtype=np.float64)), lse

    def grads(call: AttentionCall, b: Backend, d_out: np.ndarray) -> tuple[np.ndarray, ...]:
        (q, k, v), kwargs = prepare(call, b)
        g = _grads_by_autodiff(lambda *a: dpa(*a, **kwargs), b, (q, k, v), _np_blhd(d_out))
        return tuple(_np_blhd(x) for x in g)

    return Adapter(
        name=f"jax.nn.dot_product_attention (jax {jax.__version__})",
        run=run,
        supports=frozenset(
            {
                "basic",
                "scale",
                "bool_mask",
                "float_mask",
                "empty_rows",
                "causal_top_left",
                "window",
                "gqa",
                "zero_length",
                "lengths",
                "low_precision",
                "adversarial",
                "lse",
                "gradients",
                "combined",
            }
        ),
        backend="jax",
        vjp=grads,
        dtypes=("float32",),
        alignments=("top_left",),
        same_value_dim=True,
        conventions={
            "empty_rows": "fully masked rows get the mean of the values (masking adds the "
            "dtype's most negative finite number), not 0",
        },
        notes=(
            "layout BTNH (batch, T, heads, dim): transposed by the adapter (convention)",
            "LSE (return_residual) is (B, T, N): transposed by the adapter",
            "is_causal and local_window_size are top-left aligned; no bottom-right option",
            "masks must be 4-D: the adapter prefixes ones; value head dim must equal key's",
        ),
    )


def keras_dpa(fn: Callable[..., Any] | None = None) -> Adapter:
    """``keras.ops.dot_product_attention`` (layout BTNH, ``mask=``/``bias=``,
    ``attn_logits_soft_cap`` for softcap) on whatever backend Keras runs, inputs given as
    NumPy float32. Raises ``ImportError`` when Keras is not installed.

    Examples:
        >>> from arrayattn.testing.adapters import keras_dpa
        >>> a = keras_dpa()  # doctest: +SKIP
    """
    import keras

    dpa = fn or keras.ops.dot_product_attention

    def run(call: AttentionCall, b: Backend, want_lse: bool) -> Result:
        if call.query.ndim != 4 or call.key.ndim != 4 or call.value.ndim != 4:
            raise NotExpressible("keras takes 4-D (B, T, N, H) inputs")
        q, k, v, m = call.arrays(b)
        q, k, v = (_np_blhd(x) for x in (q, k, v))
        opts = call.options
        kwargs: dict[str, Any] = {}
        if m is not None:
            m = np.reshape(m, (1,) * (4 - m.ndim) + m.shape)
            kwargs["mask" if m.dtype == np.bool_ else "bias"] = m
        if opts.get("scale") is not None:
            kwargs["scale"] = opts["scale"]
        if opts.get("causal_align") == "bottom_right" and call.L != call.S:
            raise NotExpressible("bottom-right alignment")
        if opts.get("is_causal"):
            kwargs["is_causal"] = True
        if opts.get("softcap") is not None:
            kwargs["attn_logits_soft_cap"] = opts["softcap"]
        out = keras.ops.convert_to_numpy(dpa(q, k, v, **kwargs))
        return _np_blhd(np.asarray(out, dtype=np.float64)), None

    return Adapter(
        name=f"keras.ops.dot_product_attention (keras {keras.__version__})",
        run=run,
        supports=frozenset(
            {
                "basic",
                "scale",
                "bool_mask",
                "float_mask",
                "empty_rows",
                "causal_top_left",
                "softcap",
                "gqa",
                "adversarial",
                "combined",
            }
        ),
        backend="numpy",
        alignments=("top_left",),
        same_value_dim=True,
        notes=("layout BTNH: transposed by the adapter (convention)",),
    )


def flash_attn(
    fn: Callable[..., Any],
    *,
    xp: str | ModuleType | Backend = "torch",
    dtypes: Iterable[Any] = ("float16", "bfloat16"),
) -> Adapter:
    """A function with FlashAttention's ``flash_attn_func(q, k, v, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False)`` signature: layout
    ``(B, L, H, D)``, causal and windows bottom-right aligned, GQA implied by the head
    counts, no masks, LSE ``(B, H, L)`` as the second output with
    ``return_attn_probs=True``; gradients by autograd on torch tensors.

    Examples:
        >>> from arrayattn.testing.adapters import flash_attn
        >>> a = flash_attn(lambda q, k, v, **kw: q, xp="numpy", dtypes=("float32",))
        >>> sorted(a.supports)[:3]
        ['adversarial', 'alibi', 'basic']
    """
    backend = make_backend(xp)

    def prepare(call: AttentionCall, b: Backend) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if call.query.ndim != 4 or call.key.ndim != 4 or call.value.ndim != 4:
            raise NotExpressible("flash_attn_func takes 4-D (B, L, H, D) inputs")
        opts = call.options
        if (opts.get("is_causal") or opts.get("window")) and call.L != call.S:
            if opts.get("causal_align", "top_left") != "bottom_right":
                raise NotExpressible("top-left alignment with L != S")
        q, k, v, _ = call.arrays(b)
        q, k, v = (_blhd(x, b.xp) for x in (q, k, v))
        kwargs: dict[str, Any] = {}
        if opts.get("scale") is not None:
            kwargs["softmax_scale"] = opts["scale"]
        if opts.get("is_causal"):
            kwargs["causal"] = True
        if opts.get("window") is not None:
            kwargs["window_size"] = tuple(opts["window"])
        if opts.get("softcap") is not None:
            kwargs["softcap"] = opts["softcap"]
        if opts.get("alibi_slopes") is not None:
            kwargs["alibi_slopes"] = call.kwargs(b)["alibi_slopes"]
        return (q, k, v), kwargs

    def run(call: AttentionCall, b: Backend, want_lse: bool) -> Result:
        (q, k, v), kwargs = prepare(call, b)
        if want_lse:
            res = fn(q, k, v, return_attn_probs=True, **kwargs)
            out, lse = res[0], to_numpy(res[1]).astype(np.float64)
        else:
            out, lse = fn(q, k, v, **kwargs), None
        return _np_blhd(to_numpy(out).astype(np.float64)), lse

    def grads(call: AttentionCall, b: Backend, d_out: np.ndarray) -> tuple[np.ndarray, ...]:
        (q, k, v), kwargs = prepare(call, b)
        g = _grads_by_autodiff(lambda *a: fn(*a, **kwargs), b, (q, k, v), _np_blhd(d_out))
        return tuple(_np_blhd(x) for x in g)

    supports = {
        "basic",
        "scale",
        "empty_rows",
        "causal_bottom_right",
        "window",
        "softcap",
        "gqa",
        "alibi",
        "low_precision",
        "adversarial",
        "lse",
        "combined",
    }
    if backend.name in ("torch", "jax"):
        supports.add("gradients")
    return Adapter(
        name=getattr(fn, "__qualname__", "flash_attn_func"),
        run=run,
        supports=frozenset(supports),
        backend=backend.name,
        vjp=grads if "gradients" in supports else None,
        dtypes=tuple(dtype_name(d) for d in dtypes),
        alignments=("bottom_right",),
        same_value_dim=True,
        notes=(
            "layout (B, L, H, D): transposed by the adapter",
            "causal and windows are bottom-right aligned (FlashAttention >= 2.1)",
        ),
    )
