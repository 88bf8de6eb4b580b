"""Small functional layers in the style of :class:`~arrayattn.nn.MultiHeadAttention`:
:class:`Linear`, :class:`LayerNorm`, :class:`RMSNorm`, :class:`Embedding` and the
transformer :class:`MLP` (plain or gated: SwiGLU/GeGLU).

Each is a frozen dataclass holding only its configuration; the parameters are a plain
dict of arrays with PyTorch / Hugging Face names (``weight``, ``bias``; ``fc1.weight``
or ``gate_proj.weight`` ...), made by ``init`` or taken from a checkpoint by ``load``
(with ``prefix=`` and ``rename=``). ``layer(params, x)`` runs the forward;
``layer.vjp(params, x)`` returns ``(out, pullback)`` where ``pullback(d_out)`` gives a
:class:`LayerCotangents` ``(dx, dparams)``, composed from the pullbacks of the ops each
layer calls (``linear``, ``layer_norm``, ``rms_norm``, ``embedding``, ``gelu``,
``silu``): no autograd engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._autodiff import vjp as _vjp
from .._backend import Array, resolve_namespace
from ..ops.norms import layer_norm, rms_norm
from ._checkpoint import _to_namespace
from ._validate import _count, _flag, _real
from .activations import gelu, silu
from .attention.params import check_params as _check_params
from .attention.params import load_params as _load_params
from .embedding import embedding
from .linear import linear

__all__ = [
    "Layer",
    "LayerCotangents",
    "Linear",
    "LayerNorm",
    "RMSNorm",
    "Embedding",
    "MLP",
    "MLP_ACTIVATIONS",
]

Params = dict[str, Array]
MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "silu")


class LayerCotangents(NamedTuple):
    """What the pullback of a layer's ``vjp`` returns: ``(x, params)``, so
    ``dx, dparams = pullback(d_out)`` works.

    Attributes:
        x: the cotangent of the layer's input (``None`` for :class:`Embedding`, whose
            input is integer ids).
        params: one cotangent per parameter name, in the parameters' shapes and dtypes.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import Linear
        >>> lin = Linear(3, 2)
        >>> p = lin.init(seed=0, xp=np)
        >>> y, pullback = lin.vjp(p, np.ones((4, 3), np.float32))
        >>> grads = pullback(np.ones_like(y))
        >>> grads.x.shape, sorted(grads.params), grads.params["bias"].tolist()
        ((4, 3), ['bias', 'weight'], [4.0, 4.0])
    """

    x: Array | None
    params: Params


class Layer:
    """The methods every layer here shares: ``init``, ``load``, ``check_params``
    (each layer supplies ``param_shapes`` and its own initial values)."""

    def param_shapes(self) -> dict[str, tuple[int, ...]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _initial(self, rng: Any) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def init(self, *, seed: int, xp: Any = None, device: Any = None, dtype: Any = None) -> Params:
        """Fresh parameters with PyTorch's default initialisation (``nn.Linear``: weight
        and bias uniform in ``+-1/sqrt(in_features)``; norms: weight one, bias zero;
        ``nn.Embedding``: standard normal). The numbers come from NumPy's generator
        seeded by ``seed`` (the same on every backend), then move to
        ``xp``/``device``/``dtype`` (default NumPy, float32).

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import LayerNorm
            >>> p = LayerNorm(4).init(seed=0, xp=np, dtype=np.float64)
            >>> p["weight"].tolist(), p["bias"].dtype
            ([1.0, 1.0, 1.0, 1.0], dtype('float64'))
        """
        import numpy as np

        host = self._initial(np.random.default_rng(seed))
        ns = resolve_namespace(xp)
        return _to_namespace(host, ns, device, ns.float32 if dtype is None else dtype)

    def load(
        self,
        state_dict: Mapping[str, Any],
        *,
        prefix: str = "",
        rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
        xp: Any = None,
        device: Any = None,
        dtype: Any = None,
        strict: bool = True,
        check_finite: bool = True,
    ) -> Params:
        """Take this layer's tensors from a checkpoint dict (``safetensors.numpy.load_file``,
        a ``torch`` ``state_dict()``, ...) by their names under ``prefix``, moved to
        ``xp``/``device`` (default NumPy), as :meth:`MultiHeadAttention.load
        <arrayattn.nn.MultiHeadAttention.load>` does.

        Args:
            state_dict: name -> array (NumPy, torch, CuPy, JAX, ...).
            prefix: only names starting with it are read; it is removed before matching
                (``"model.layers.0.mlp."``).
            rename: maps a checkpoint name (after the prefix) to this layer's name: a dict
                (names not in it are kept), or a function returning the new name, or
                ``None`` to skip that tensor (``{"intermediate.dense.weight":
                "fc1.weight", ...}`` for BERT's MLP).
            xp, device: where the parameters go.
            dtype: the dtype they are cast to; default: each tensor keeps its own.
            strict: reject names under ``prefix`` this layer does not use.
            check_finite: a loaded parameter holding NaN or Inf (after the cast to
                ``dtype``) is a ``ValueError`` naming it; ``False`` loads it as it is.

        Missing names are a ``KeyError`` listing the missing and the unexpected names;
        wrong shapes a ``ValueError`` naming the parameter; a tensor whose dtype is not
        real floating (integer, bool, complex) a ``TypeError``.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import MLP
            >>> mlp = MLP(4, 8, activation="silu", gated=True, bias=False)
            >>> state = {f"model.layers.0.mlp.{n}": np.zeros(s)
            ...          for n, s in mlp.param_shapes().items()}
            >>> p = mlp.load(state, prefix="model.layers.0.mlp.")
            >>> sorted(p)
            ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
        """
        return _load_params(
            self,
            state_dict,
            prefix=prefix,
            rename=rename,
            xp=xp,
            device=device,
            dtype=dtype,
            strict=strict,
            check_finite=check_finite,
        )

    def check_params(self, params: Mapping[str, Array]) -> None:
        """Raise ``TypeError``/``KeyError``/``ValueError`` when ``params`` does not fit this
        layer: not a mapping, a value that is not an array, missing or unexpected names,
        wrong shapes.

        Examples:
            >>> import numpy as np
            >>> from arrayattn.nn import RMSNorm
            >>> try:
            ...     RMSNorm(4).check_params({"weight": np.ones(3)})
            ... except ValueError as e:
            ...     print(e)
            params['weight'] has shape (3,), expected (4,)
        """
        _check_params(self, params)


def _uniform_linear(rng: Any, out_f: int, in_f: int, bias: bool, name: str = "") -> dict:
    """``nn.Linear``'s default init: weight and bias uniform in ``+-1/sqrt(in_f)``."""
    bound = 1.0 / math.sqrt(in_f)
    out = {f"{name}weight": rng.uniform(-bound, bound, size=(out_f, in_f))}
    if bias:
        out[f"{name}bias"] = rng.uniform(-bound, bound, size=(out_f,))
    return out


# -- Linear -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Linear(Layer):
    """``y = x @ weight.T + bias``, PyTorch's ``nn.Linear``.

    Args:
        in_features: features of ``x``.
        out_features: features of the output.
        bias: whether there is a ``bias`` parameter.

    Parameters: ``weight`` ``(out_features, in_features)``, ``bias`` ``(out_features,)``.
    Shapes: ``x`` ``(..., in_features)`` -> ``(..., out_features)`` in ``x``'s dtype.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import Linear
        >>> lin = Linear(3, 2, bias=False)
        >>> p = lin.init(seed=0, xp=np)
        >>> lin(p, np.ones((5, 3), np.float32)).shape
        (5, 2)
    """

    in_features: int
    out_features: int
    bias: bool = True

    def __post_init__(self) -> None:
        _count("in_features", self.in_features)
        _count("out_features", self.out_features)
        _flag("bias", self.bias)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"weight": (out_features, in_features), "bias": (out_features,)}`` (no
        ``bias`` with ``bias=False``).

        Examples:
            >>> from arrayattn.nn import Linear
            >>> Linear(3, 2).param_shapes()
            {'weight': (2, 3), 'bias': (2,)}
        """
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.out_features, self.in_features)}
        if self.bias:
            shapes["bias"] = (self.out_features,)
        return shapes

    def _initial(self, rng: Any) -> dict[str, Any]:
        return _uniform_linear(rng, self.out_features, self.in_features, self.bias)

    def __call__(self, params: Mapping[str, Array], x: Array) -> Array:
        """The output ``(..., out_features)``."""
        self.check_params(params)
        return linear(x, params["weight"], params.get("bias"))

    def vjp(
        self, params: Mapping[str, Array], x: Array
    ) -> tuple[Array, Callable[[Array], LayerCotangents]]:
        """``(out, pullback)``; ``pullback(d_out)`` gives :class:`LayerCotangents`
        ``(dx, {"weight": dW, "bias": db})``: ``dx = d_out @ W``, ``dW = d_out^T x``,
        ``db = sum(d_out)`` over the leading dims (:func:`~arrayattn.nn.linear`'s rule)."""
        self.check_params(params)
        args = (x, params["weight"]) + ((params["bias"],) if self.bias else ())
        out, pb = _vjp(linear, *args)

        def pullback(d_out: Array) -> LayerCotangents:
            grads = pb(d_out)
            dparams = {"weight": grads[1]}
            if self.bias:
                dparams["bias"] = grads[2]
            return LayerCotangents(grads[0], dparams)

        return out, pullback


# -- norms --------------------------------------------------------------------------------
def _eps(value: Any) -> None:
    if _real("eps", value) < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class LayerNorm(Layer):
    """LayerNorm over the last axis, PyTorch's ``nn.LayerNorm(dim, eps, bias=bias)``:
    ``(x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance, statistics
    in float32 (float64 for float64 input).

    Args:
        dim: features of ``x`` (the last axis).
        eps: added to the variance.
        bias: whether there is a ``bias`` parameter.

    Parameters: ``weight`` ``(dim,)``, ``bias`` ``(dim,)``. Shapes: ``x`` ``(..., dim)``
    -> ``x``'s shape and dtype.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import LayerNorm
        >>> ln = LayerNorm(2, eps=0.0)
        >>> ln(ln.init(seed=0, xp=np, dtype=np.float64), np.array([[1.0, 3.0]]))
        array([[-1.,  1.]])
    """

    dim: int
    eps: float = 1e-5
    bias: bool = True

    def __post_init__(self) -> None:
        _count("dim", self.dim)
        _eps(self.eps)
        _flag("bias", self.bias)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"weight": (dim,), "bias": (dim,)}`` (no ``bias`` with ``bias=False``)."""
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.dim,)}
        if self.bias:
            shapes["bias"] = (self.dim,)
        return shapes

    def _initial(self, rng: Any) -> dict[str, Any]:
        import numpy as np

        out = {"weight": np.ones(self.dim)}
        if self.bias:
            out["bias"] = np.zeros(self.dim)
        return out

    def __call__(self, params: Mapping[str, Array], x: Array) -> Array:
        """The normalised ``x``."""
        self.check_params(params)
        return layer_norm(x, params["weight"], params.get("bias"), self.eps)

    def vjp(
        self, params: Mapping[str, Array], x: Array
    ) -> tuple[Array, Callable[[Array], LayerCotangents]]:
        """``(out, pullback)``; ``pullback(d_out)`` gives :class:`LayerCotangents`
        ``(dx, {"weight": dw, "bias": db})`` (:func:`~arrayattn.layer_norm`'s rule)."""
        self.check_params(params)
        out, pb = _vjp(layer_norm, x, params["weight"], params.get("bias"), self.eps)

        def pullback(d_out: Array) -> LayerCotangents:
            dx, dw, db, _ = pb(d_out)
            dparams = {"weight": dw}
            if self.bias:
                dparams["bias"] = db
            return LayerCotangents(dx, dparams)

        return out, pullback


@dataclass(frozen=True)
class RMSNorm(Layer):
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * weight`` in LLaMA's
    order (normalise in float32, cast back to ``x``'s dtype, then multiply by
    ``weight``), PyTorch's ``nn.RMSNorm(dim, eps)`` and Hugging Face's ``LlamaRMSNorm``.

    Args:
        dim: features of ``x`` (the last axis).
        eps: added to the mean square (PyTorch's default ``None`` is the dtype's
            machine epsilon; pass it explicitly there to compare).

    Parameters: ``weight`` ``(dim,)``. Shapes: ``x`` ``(..., dim)`` -> ``x``'s shape (the
    dtype is the promotion of ``x``'s and ``weight``'s).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import RMSNorm
        >>> norm = RMSNorm(2, eps=0.0)
        >>> norm(norm.init(seed=0, xp=np, dtype=np.float64), np.array([[3.0, 4.0]])).round(4)
        array([[0.8485, 1.1314]])
    """

    dim: int
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _count("dim", self.dim)
        _eps(self.eps)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"weight": (dim,)}``."""
        return {"weight": (self.dim,)}

    def _initial(self, rng: Any) -> dict[str, Any]:
        import numpy as np

        return {"weight": np.ones(self.dim)}

    def __call__(self, params: Mapping[str, Array], x: Array) -> Array:
        """The normalised ``x``."""
        self.check_params(params)
        return rms_norm(x, params["weight"], self.eps)

    def vjp(
        self, params: Mapping[str, Array], x: Array
    ) -> tuple[Array, Callable[[Array], LayerCotangents]]:
        """``(out, pullback)``; ``pullback(d_out)`` gives :class:`LayerCotangents`
        ``(dx, {"weight": dw})`` (:func:`~arrayattn.rms_norm`'s rule)."""
        self.check_params(params)
        out, pb = _vjp(rms_norm, x, params["weight"], self.eps)

        def pullback(d_out: Array) -> LayerCotangents:
            dx, dw, _ = pb(d_out)
            return LayerCotangents(dx, {"weight": dw})

        return out, pullback


# -- Embedding ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Embedding(Layer):
    """Rows of ``weight`` picked by integer ids, PyTorch's ``nn.Embedding``.

    Args:
        num_embeddings: rows of the table (vocabulary size).
        embedding_dim: features of each row.

    Parameters: ``weight`` ``(num_embeddings, embedding_dim)``. Shapes: ``ids`` integer
    ``(...)`` in ``[0, num_embeddings)`` -> ``(..., embedding_dim)`` in ``weight``'s dtype.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import Embedding
        >>> emb = Embedding(10, 4)
        >>> emb(emb.init(seed=0, xp=np), np.array([[1, 2, 3]])).shape
        (1, 3, 4)
    """

    num_embeddings: int
    embedding_dim: int

    def __post_init__(self) -> None:
        _count("num_embeddings", self.num_embeddings)
        _count("embedding_dim", self.embedding_dim)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"weight": (num_embeddings, embedding_dim)}``."""
        return {"weight": (self.num_embeddings, self.embedding_dim)}

    def _initial(self, rng: Any) -> dict[str, Any]:
        return {"weight": rng.standard_normal((self.num_embeddings, self.embedding_dim))}

    def __call__(self, params: Mapping[str, Array], ids: Array) -> Array:
        """The rows ``(..., embedding_dim)``."""
        self.check_params(params)
        return embedding(ids, params["weight"])

    def vjp(
        self, params: Mapping[str, Array], ids: Array
    ) -> tuple[Array, Callable[[Array], LayerCotangents]]:
        """``(out, pullback)``; ``pullback(d_out)`` gives :class:`LayerCotangents`
        ``(None, {"weight": dW})``: each cotangent row added into the table row it was read
        from (:func:`~arrayattn.nn.embedding`'s rule); the ids get ``None``."""
        self.check_params(params)
        out, pb = _vjp(embedding, ids, params["weight"])

        def pullback(d_out: Array) -> LayerCotangents:
            return LayerCotangents(None, {"weight": pb(d_out)[1]})

        return out, pullback


# -- MLP ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLP(Layer):
    """The transformer feed-forward block, plain or gated.

    - ``gated=False``: ``fc2(act(fc1(x)))``, parameters ``fc1.weight``
      ``(hidden_dim, dim)``, ``fc2.weight`` ``(dim, hidden_dim)`` (+ ``.bias``): the
      names of CLIP, ViT (timm), OPT and Whisper; BERT's ``intermediate.dense`` and
      ``output.dense`` load through ``rename=``.
    - ``gated=True`` (SwiGLU with ``"silu"``, GeGLU with ``"gelu"``/``"gelu_tanh"``):
      ``down_proj(act(gate_proj(x)) * up_proj(x))``, Hugging Face LLaMA's names
      ``gate_proj.weight``, ``up_proj.weight`` ``(hidden_dim, dim)`` and
      ``down_proj.weight`` ``(dim, hidden_dim)`` (+ ``.bias``).

    Args:
        dim: features of ``x`` and of the output.
        hidden_dim: the hidden width (``intermediate_size``).
        activation: ``"gelu"`` (exact, BERT's ``"gelu"``), ``"gelu_tanh"`` (GPT-2's
            ``"gelu_new"``, Gemma's ``"gelu_pytorch_tanh"``) or ``"silu"`` (LLaMA).
        gated: the gated form above.
        bias: biases on every projection (LLaMA's MLP has none: ``bias=False``).

    Shapes: ``x`` ``(..., dim)`` -> ``(..., dim)`` in ``x``'s dtype.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.nn import MLP
        >>> swiglu = MLP(8, 16, activation="silu", gated=True, bias=False)
        >>> sorted(swiglu.param_shapes())
        ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
        >>> p = swiglu.init(seed=0, xp=np)
        >>> y, pullback = swiglu.vjp(p, np.ones((2, 3, 8), np.float32))
        >>> dx, dparams = pullback(np.ones_like(y))
        >>> y.shape, dx.shape, dparams["up_proj.weight"].shape
        ((2, 3, 8), (2, 3, 8), (16, 8))
    """

    dim: int
    hidden_dim: int
    activation: str = "gelu"
    gated: bool = False
    bias: bool = True

    def __post_init__(self) -> None:
        _count("dim", self.dim)
        _count("hidden_dim", self.hidden_dim)
        if not isinstance(self.activation, str) or self.activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {MLP_ACTIVATIONS}, got {self.activation!r}"
            )
        _flag("gated", self.gated)
        _flag("bias", self.bias)

    def _projections(self) -> tuple[tuple[str, int, int], ...]:
        d, h = self.dim, self.hidden_dim
        if self.gated:
            return (("gate_proj", h, d), ("up_proj", h, d), ("down_proj", d, h))
        return (("fc1", h, d), ("fc2", d, h))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameter names and shapes (see the class).

        Examples:
            >>> from arrayattn.nn import MLP
            >>> MLP(4, 8).param_shapes()
            {'fc1.weight': (8, 4), 'fc1.bias': (8,), 'fc2.weight': (4, 8), 'fc2.bias': (4,)}
        """
        shapes: dict[str, tuple[int, ...]] = {}
        for name, out_f, in_f in self._projections():
            shapes[f"{name}.weight"] = (out_f, in_f)
            if self.bias:
                shapes[f"{name}.bias"] = (out_f,)
        return shapes

    def _initial(self, rng: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, out_f, in_f in self._projections():
            out.update(_uniform_linear(rng, out_f, in_f, self.bias, name + "."))
        return out

    def _act(self) -> tuple[Callable[..., Array], dict[str, str]]:
        if self.activation == "silu":
            return silu, {}
        return gelu, {"approximate": "tanh" if self.activation == "gelu_tanh" else "none"}

    def _proj(self, params: Mapping[str, Array], name: str) -> tuple[Array, ...]:
        w = (params[f"{name}.weight"],)
        return w + (params[f"{name}.bias"],) if self.bias else w

    def __call__(self, params: Mapping[str, Array], x: Array) -> Array:
        """The output ``(..., dim)``."""
        self.check_params(params)
        act, kw = self._act()
        if not self.gated:
            h = act(linear(x, *self._proj(params, "fc1")), **kw)
            return linear(h, *self._proj(params, "fc2"))
        g = act(linear(x, *self._proj(params, "gate_proj")), **kw)
        u = linear(x, *self._proj(params, "up_proj"))
        return linear(g * u, *self._proj(params, "down_proj"))

    def vjp(
        self, params: Mapping[str, Array], x: Array
    ) -> tuple[Array, Callable[[Array], LayerCotangents]]:
        """``(out, pullback)``; ``pullback(d_out)`` gives :class:`LayerCotangents`
        ``(dx, dparams)`` with one entry per parameter: the pullbacks of ``linear`` and
        the activation in reverse order; in the gated form the product rule
        ``d(act(g) * u) = (du * act(g), dact * u)`` and ``dx = dx_gate + dx_up``."""
        self.check_params(params)
        act, kw = self._act()
        first = "gate_proj" if self.gated else "fc1"
        last = "down_proj" if self.gated else "fc2"
        h, pb_first = _vjp(linear, x, *self._proj(params, first))
        a, pb_act = _vjp(act, h, **kw)
        if self.gated:
            u, pb_up = _vjp(linear, x, *self._proj(params, "up_proj"))
            a_times_u = a * u
        else:
            a_times_u = a
        out, pb_last = _vjp(linear, a_times_u, *self._proj(params, last))

        def pullback(d_out: Array) -> LayerCotangents:
            dparams: dict[str, Array] = {}

            def record(name: str, grads: tuple[Any, ...]) -> Any:
                dparams[f"{name}.weight"] = grads[1]
                if self.bias:
                    dparams[f"{name}.bias"] = grads[2]
                return grads[0]

            d_mid = record(last, pb_last(d_out))
            if self.gated:
                dx_up = record("up_proj", pb_up(d_mid * a))
                d_mid = d_mid * u
            (dh,) = pb_act(d_mid)
            dx = record(first, pb_first(dh))
            if self.gated:
                dx = dx + dx_up
            return LayerCotangents(dx, {n: dparams[n] for n in self.param_shapes()})

        return out, pullback
