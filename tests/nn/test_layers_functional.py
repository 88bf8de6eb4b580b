"""The functional layers (Linear, LayerNorm, RMSNorm, Embedding, MLP): each against a
plain float64 NumPy formula and against the matching torch.nn module with the same
weights (loaded through ``load`` from its ``state_dict()``), every cotangent against
finite differences, ``init``/``load``/``check_params`` and their errors, and a run on
every backend against NumPy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import thin, xp_assert_close

import arrayattn as aa
from arrayattn.nn import MLP, Embedding, LayerCotangents, LayerNorm, Linear, RMSNorm


# -- float64 NumPy formulas --------------------------------------------------------------
def np_linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def np_gelu(x, tanh=False):
    if tanh:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_layer(layer, p, x):
    """The layer's forward written out in float64 NumPy."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    if isinstance(layer, Linear):
        return np_linear(x, p["weight"], p.get("bias"))
    if isinstance(layer, LayerNorm):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        y = (x - mu) / np.sqrt(var + layer.eps) * p["weight"]
        return y + p["bias"] if layer.bias else y
    if isinstance(layer, RMSNorm):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + layer.eps) * p["weight"]
    if isinstance(layer, Embedding):
        return p["weight"][x]
    act = {
        "gelu": np_gelu,
        "gelu_tanh": lambda h: np_gelu(h, tanh=True),
        "silu": np_silu,
    }[layer.activation]

    def proj(name, h):
        return np_linear(h, p[f"{name}.weight"], p.get(f"{name}.bias"))

    if layer.gated:
        return proj("down_proj", act(proj("gate_proj", x)) * proj("up_proj", x))
    return proj("fc2", act(proj("fc1", x)))


LAYERS = {
    "linear": Linear(5, 3),
    "linear_nobias": Linear(5, 3, bias=False),
    "layer_norm": LayerNorm(5, eps=1e-5),
    "layer_norm_nobias": LayerNorm(5, eps=1e-3, bias=False),
    "rms_norm": RMSNorm(5, eps=1e-6),
    "embedding": Embedding(7, 5),
    "mlp_gelu": MLP(5, 6),
    "mlp_gelu_tanh": MLP(5, 6, activation="gelu_tanh", bias=False),
    "swiglu": MLP(5, 6, activation="silu", gated=True, bias=False),
    "geglu_bias": MLP(5, 6, activation="gelu", gated=True),
}


def perturbed(layer, seed, xp=np, dtype=np.float64):
    """init's parameters moved off their init values (norm weights of one and biases of
    zero would hide mistakes)."""
    p = layer.init(seed=seed, xp=np, dtype=np.float64)
    rng = np.random.default_rng(seed + 100)
    p = {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in p.items()}
    return p


def inputs(layer, rng, shape=(2, 3)):
    if isinstance(layer, Embedding):
        return rng.integers(0, layer.num_embeddings, size=shape)
    dim = layer.in_features if isinstance(layer, Linear) else layer.dim
    return rng.standard_normal(shape + (dim,))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_forward_matches_numpy_formula(name, rng):
    layer = LAYERS[name]
    p = perturbed(layer, 0)
    x = inputs(layer, rng)
    np.testing.assert_allclose(layer(p, x), np_layer(layer, p, x), rtol=1e-12, atol=1e-13)
    out, _ = layer.vjp(p, x)
    np.testing.assert_allclose(out, layer(p, x), rtol=0, atol=0)


# -- finite differences ----------------------------------------------------------------------
def _fd(f, value, direction, eps=1e-6):
    return (f(value + eps * direction) - f(value - eps * direction)) / (2 * eps)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_vjp_matches_finite_differences(name, rng):
    layer = LAYERS[name]
    p = perturbed(layer, 1)
    x = inputs(layer, rng)
    out, pullback = layer.vjp(p, x)
    c = rng.standard_normal(out.shape)
    grads = pullback(c)
    assert isinstance(grads, LayerCotangents)
    dx, dparams = grads
    assert sorted(dparams) == sorted(p)
    for n, g in dparams.items():
        assert g.shape == p[n].shape and g.dtype == p[n].dtype, n
        v = rng.standard_normal(p[n].shape)
        num = _fd(lambda w, n=n: np.sum(layer({**p, n: w}, x) * c), p[n], v)
        assert abs(np.sum(g * v) - num) <= 1e-7 * max(1.0, abs(num)), (n, np.sum(g * v), num)
    if isinstance(layer, Embedding):
        assert dx is None
        return
    assert dx.shape == x.shape
    v = rng.standard_normal(x.shape)
    num = _fd(lambda a: np.sum(layer(p, a) * c), x, v)
    assert abs(np.sum(dx * v) - num) <= 1e-7 * max(1.0, abs(num)), (np.sum(dx * v), num)


# -- torch.nn as a peer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _torch_module(torch, layer):
    nn, F = torch.nn, torch.nn.functional
    if isinstance(layer, Linear):
        return nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
    if isinstance(layer, LayerNorm):
        return nn.LayerNorm(layer.dim, eps=layer.eps, bias=layer.bias)
    if isinstance(layer, RMSNorm):
        return nn.RMSNorm(layer.dim, eps=layer.eps)
    if isinstance(layer, Embedding):
        return nn.Embedding(layer.num_embeddings, layer.embedding_dim)
    act = {
        "gelu": F.gelu,
        "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
        "silu": F.silu,
    }[layer.activation]

    class TorchMLP(nn.Module):  # timm/CLIP names, or Hugging Face LLaMA's when gated
        def __init__(self):
            super().__init__()
            d, h, b = layer.dim, layer.hidden_dim, layer.bias
            if layer.gated:
                self.gate_proj, self.up_proj = nn.Linear(d, h, bias=b), nn.Linear(d, h, bias=b)
                self.down_proj = nn.Linear(h, d, bias=b)
            else:
                self.fc1, self.fc2 = nn.Linear(d, h, bias=b), nn.Linear(h, d, bias=b)

        def forward(self, x):
            if layer.gated:
                return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
            return self.fc2(act(self.fc1(x)))

    return TorchMLP()


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_matches_torch_module(torch, name, rng):
    layer = LAYERS[name]
    torch.manual_seed(0)
    module = _torch_module(torch, layer).double()
    with torch.no_grad():  # off the default init, as above
        for t in module.parameters():
            t.add_(0.3 * torch.randn_like(t))
    p = layer.load(module.state_dict())  # torch float64 tensors -> NumPy float64
    assert all(a.dtype == np.float64 and isinstance(a, np.ndarray) for a in p.values())
    x = inputs(layer, rng)
    tx = torch.tensor(x, requires_grad=not isinstance(layer, Embedding))
    ref = module(tx)
    out, pullback = layer.vjp(p, x)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    c = rng.standard_normal(out.shape)
    ref.backward(torch.tensor(c))
    dx, dparams = pullback(c)
    if tx.requires_grad:
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    for n, t in module.named_parameters():
        np.testing.assert_allclose(dparams[n], t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=n)


def test_float32_torch_state_dict_and_float16_inputs(torch, rng):
    torch.manual_seed(1)
    module = torch.nn.LayerNorm(8)
    ln = LayerNorm(8)
    p = ln.load(module.state_dict())
    assert p["weight"].dtype == np.float32
    x = rng.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(ln(p, x), module(torch.tensor(x)).detach().numpy(), atol=1e-6)
    half = ln.load(module.state_dict(), dtype=np.float16)
    y = ln(half, x.astype(np.float16))
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), ln(p, x), atol=4e-3)


# -- init -----------------------------------------------------------------------------------------
def test_init_is_pytorch_default_and_reproducible():
    lin = Linear(64, 32)
    p = lin.init(seed=3, xp=np)
    assert p["weight"].dtype == np.float32 and p["weight"].shape == (32, 64)
    bound = 1 / math.sqrt(64)
    assert np.abs(p["weight"]).max() <= bound and np.abs(p["bias"]).max() <= bound
    assert np.abs(p["weight"]).max() > 0.9 * bound  # uniform over the whole range
    q = lin.init(seed=3, xp=np)
    assert all(np.array_equal(p[k], q[k]) for k in p)
    e = Embedding(1000, 16).init(seed=0, xp=np, dtype=np.float64)["weight"]
    assert abs(e.mean()) < 0.02 and abs(e.std() - 1) < 0.02  # N(0, 1) as nn.Embedding
    mlp = MLP(8, 32, gated=True).init(seed=0, xp=np)
    assert np.abs(mlp["down_proj.weight"]).max() <= 1 / math.sqrt(32)
    assert np.abs(mlp["up_proj.bias"]).max() <= 1 / math.sqrt(8)
    np.testing.assert_array_equal(RMSNorm(4).init(seed=0, xp=np)["weight"], 1.0)
    ln = LayerNorm(4).init(seed=0, xp=np)
    np.testing.assert_array_equal(ln["bias"], 0.0)


# -- load with prefix and rename ---------------------------------------------------------------
def test_load_with_prefix_and_rename():
    rng = np.random.default_rng(0)
    bert = MLP(4, 8)  # BERT's names for it: intermediate.dense, output.dense
    state = {
        "encoder.layer.0.intermediate.dense.weight": rng.standard_normal((8, 4)),
        "encoder.layer.0.intermediate.dense.bias": rng.standard_normal(8),
        "encoder.layer.0.output.dense.weight": rng.standard_normal((4, 8)),
        "encoder.layer.0.output.dense.bias": rng.standard_normal(4),
        "encoder.layer.0.output.LayerNorm.weight": np.ones(4),
        "encoder.layer.0.output.LayerNorm.bias": np.zeros(4),
        "encoder.layer.1.output.dense.bias": np.zeros(4),
    }
    names = {
        "intermediate.dense.weight": "fc1.weight",
        "intermediate.dense.bias": "fc1.bias",
        "output.dense.weight": "fc2.weight",
        "output.dense.bias": "fc2.bias",
    }
    p = bert.load(state, prefix="encoder.layer.0.", rename=names, strict=False)
    assert sorted(p) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    np.testing.assert_array_equal(p["fc2.weight"], state["encoder.layer.0.output.dense.weight"])
    # the same with a function that skips what is not the MLP's
    p2 = bert.load(
        state,
        prefix="encoder.layer.0.",
        rename=lambda n: names.get(n),
    )
    assert all(np.array_equal(p[k], p2[k]) for k in p)
    # strict (the default) names what it does not use
    with pytest.raises(KeyError, match=r"unexpected \['encoder.layer.0.output.LayerNorm.bias'"):
        bert.load(state, prefix="encoder.layer.0.", rename=names)
    ln = LayerNorm(4).load(state, prefix="encoder.layer.0.output.LayerNorm.")
    np.testing.assert_array_equal(ln["weight"], 1.0)
    # into another library and dtype
    torch = pytest.importorskip("torch")
    t = LayerNorm(4).load(
        state, prefix="encoder.layer.0.output.LayerNorm.", xp=torch, dtype=torch.float32
    )
    assert isinstance(t["weight"], torch.Tensor) and t["weight"].dtype == torch.float32


def test_load_and_check_params_errors():
    lin = Linear(3, 2)
    with pytest.raises(KeyError, match=r"missing \['bias'\]"):
        lin.load({"weight": np.zeros((2, 3))})
    with pytest.raises(KeyError, match=r"missing \['bias', 'weight'\] .*prefix 'fc.'"):
        lin.load({"weight": np.zeros((2, 3))}, prefix="fc.")
    with pytest.raises(
        ValueError, match=r"params\['weight'\] has shape \(3, 2\), expected \(2, 3\)"
    ):
        lin.load({"weight": np.zeros((3, 2)), "bias": np.zeros(2)})
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        lin.load([np.zeros((2, 3))])
    with pytest.raises(TypeError, match=r"state_dict\['weight'\] must be an array"):
        lin.load({"weight": [[0.0] * 3] * 2, "bias": np.zeros(2)})
    p = lin.init(seed=0, xp=np)
    with pytest.raises(KeyError, match=r"missing \['bias'\], unexpected \[\]"):
        lin({"weight": p["weight"]}, np.ones((1, 3), np.float32))
    with pytest.raises(KeyError, match=r"unexpected \['bias'\]"):
        Linear(3, 2, bias=False).vjp(p, np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"params\['fc2.weight'\] has shape"):
        MLP(4, 8).check_params({**MLP(4, 8).init(seed=0, xp=np), "fc2.weight": np.zeros((8, 4))})
    with pytest.raises(TypeError, match=r"params\['weight'\] must be an array, got list"):
        RMSNorm(2).check_params({"weight": [1.0, 1.0]})
    with pytest.raises(TypeError, match="params must be a mapping"):
        RMSNorm(2)(None, np.ones(2))
    # inputs of the wrong width are the op's error, naming both shapes
    with pytest.raises(ValueError, match=r"x's last dim must equal weight's in_features 3"):
        lin(p, np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"weight has shape \(5,\), expected"):
        RMSNorm(5)(RMSNorm(5).init(seed=0, xp=np), np.ones((2, 4), np.float32))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: Linear(0, 2), ValueError, "in_features must be a positive int, got 0"),
        (lambda: Linear(2.0, 2), TypeError, "in_features must be a positive int, got float"),
        (lambda: Linear(2, 2, bias=1), TypeError, "bias must be a bool, got int"),
        (lambda: LayerNorm(4, eps=-1.0), ValueError, "eps must be a finite number >= 0"),
        (lambda: RMSNorm(4, eps=float("inf")), ValueError, "eps must be finite"),
        (lambda: Embedding(10, -1), ValueError, "embedding_dim must be a positive int"),
        (lambda: MLP(4, 8, activation="relu"), ValueError, "activation must be one of"),
        (lambda: MLP(4, 8, gated="yes"), TypeError, "gated must be a bool, got str"),
    ],
)
def test_configuration_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_layers_are_frozen_and_hashable():
    lin = Linear(3, 2)
    with pytest.raises(AttributeError):
        lin.in_features = 4
    assert {lin: 1}[Linear(3, 2)] == 1


# -- every backend ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["linear", "layer_norm", "rms_norm", "embedding", "swiglu"])
def test_layers_on_backend(backend, name, rng):
    thin(backend, name in ("swiglu", "embedding"))
    layer = LAYERS[name]
    p = perturbed(layer, 2)
    x = inputs(layer, rng)
    out, pullback = layer.vjp(p, x)
    c = rng.standard_normal(out.shape)
    dx, dparams = pullback(c)
    bp = {k: backend.asarray(v) for k, v in p.items()}
    b_out, b_pullback = layer.vjp(bp, backend.asarray(x))
    xp_assert_close(backend, b_out, out, rtol=1e-10, atol=1e-12)
    b_dx, b_dparams = b_pullback(backend.asarray(c))
    if dx is None:
        assert b_dx is None
    else:
        xp_assert_close(backend, b_dx, dx, rtol=1e-10, atol=1e-12)
    for k in dparams:
        xp_assert_close(backend, b_dparams[k], dparams[k], rtol=1e-10, atol=1e-12, err_msg=k)
    # init on the backend: same numbers as on NumPy
    fresh = layer.init(seed=0, xp=backend.xp, device=backend.device)
    ref = layer.init(seed=0, xp=np)
    for k in ref:
        xp_assert_close(backend, fresh[k], ref[k], dtype="float32", rtol=0, atol=0)


def test_a_tiny_classifier_learns():
    """Embedding -> LayerNorm -> MLP -> Linear -> cross_entropy, trained by hand."""
    rng = np.random.default_rng(0)
    vocab, dim, classes = 12, 16, 3
    layers = {
        "embed": Embedding(vocab, dim),
        "norm": LayerNorm(dim),
        "mlp": MLP(dim, 32),
        "head": Linear(dim, classes),
    }
    params = {k: m.init(seed=i, xp=np, dtype=np.float64) for i, (k, m) in enumerate(layers.items())}
    ids = rng.integers(0, vocab, size=(64, 5))
    labels = ids.max(axis=1) % classes  # a function of the tokens

    def step(params):
        x, pb_e = layers["embed"].vjp(params["embed"], ids)
        h, pb_n = layers["norm"].vjp(params["norm"], x)
        m, pb_m = layers["mlp"].vjp(params["mlp"], h)
        pooled = (h + m).mean(axis=1)
        logits, pb_h = layers["head"].vjp(params["head"], pooled)
        loss, pb_loss = aa.vjp(aa.cross_entropy, logits, labels)
        d_logits, _ = pb_loss(np.ones_like(loss))
        d_pooled, g_head = pb_h(d_logits)
        d_hm = np.repeat(d_pooled[:, None, :] / ids.shape[1], ids.shape[1], axis=1)
        d_h, g_mlp = pb_m(d_hm)
        d_x, g_norm = pb_n(d_h + d_hm)
        _, g_embed = pb_e(d_x)
        grads = {"embed": g_embed, "norm": g_norm, "mlp": g_mlp, "head": g_head}
        return float(loss), grads

    first = None
    for _ in range(60):
        loss, grads = step(params)
        first = loss if first is None else first
        params = {k: {n: v - 0.3 * grads[k][n] for n, v in p.items()} for k, p in params.items()}
    assert loss < 0.5 * first, (first, loss)
