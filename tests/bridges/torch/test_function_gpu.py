"""``arrayattn.torch.scaled_dot_product_attention`` on CUDA tensors: arrayattn's fused
kernels reached through DLPack (CuPy), differentiated by PyTorch's autograd with the
kernels' backward. Skips cleanly without a CUDA PyTorch, CuPy or a device.

Oracles: torch autograd through ``torch.nn.functional.scaled_dot_product_attention`` in
float64 on the same GPU (and an eager float64 attention written here for sinks and
dropout). Accuracy, as relative Frobenius errors against float64: float32 <= 1e-5;
float16 and bfloat16 <= 2x PyTorch's own SDPA error in that dtype on the same inputs and
cotangent (plus a small floor, for cases where PyTorch is unusually exact).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "cuda") or not torch.cuda.is_available():
    pytest.skip("PyTorch has no CUDA device", allow_module_level=True)
cp = pytest.importorskip("cupy")
try:
    _NDEV = cp.cuda.runtime.getDeviceCount()
except Exception:  # no driver / no device
    _NDEV = 0
if _NDEV == 0:
    pytest.skip("CuPy has no CUDA device", allow_module_level=True)

import arrayattn as aa  # noqa: E402
import arrayattn.torch as aat  # noqa: E402
from arrayattn.attention.spec import make_spec  # noqa: E402
from arrayattn.torch import _call  # noqa: E402

pytestmark = pytest.mark.gpu
F = torch.nn.functional
SDPA = aat.scaled_dot_product_attention
FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(dtype, q_shape, k_shape, seed, layout="bhld"):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(shape):
        if layout == "blhd":  # (B, L, H, D) storage, viewed as (B, H, L, D)
            B, H, L, D = shape
            x = torch.randn(B, L, H, D, device="cuda", generator=g).transpose(1, 2)
        else:
            x = torch.randn(*shape, device="cuda", generator=g)
        return x.to(dtype)

    return make(q_shape), make(k_shape), make(k_shape), g


def _grads(fn, leaves, cot):
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, cot.to(out.dtype)))


CASES = {
    "plain": ((2, 4, 200, 64), (2, 4, 333, 64), {}),
    "causal": ((2, 4, 257, 64), (2, 4, 257, 64), {"is_causal": True}),
    "gqa_causal": ((1, 8, 130, 128), (1, 2, 130, 128), {"is_causal": True, "enable_gqa": True}),
    "decode": ((2, 8, 1, 64), (2, 2, 700, 64), {"enable_gqa": True}),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_gradients_match_torch_sdpa_autograd_on_cuda(case, dtype, layout):
    q_shape, k_shape, opts = CASES[case]
    q, k, v, g = _inputs(dtype, q_shape, k_shape, seed=len(case), layout=layout)
    before = [x.clone() for x in (q, k, v)]
    spec = make_spec(q, k, v, None, 0.0, opts.get("is_causal", False), None,
                     opts.get("enable_gqa", False), "top_left", None, None, None)  # fmt: skip
    assert _call.route(spec, "auto") == "fused"  # the kernels, not the array-API path
    cot = torch.randn(q_shape[:-1] + (k_shape[-1],), device="cuda", generator=g)

    ours = _grads(lambda q, k, v: SDPA(q, k, v, **opts), (q, k, v), cot)
    assert ours[0].dtype == dtype and ours[0].device == q.device
    assert ours[0].grad_fn.name() == "AttentionFunctionBackward"
    ref = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **opts),
                 [x.double() for x in (q, k, v)], cot.double())  # fmt: skip
    theirs = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **opts),
                    (q, k, v), cot)  # fmt: skip
    for name, got, want, peer in zip(("out", "dq", "dk", "dv"), ours, ref, theirs, strict=True):
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        err = _rel(got, want)
        bound = 1e-5 if dtype == torch.float32 else 2 * _rel(peer, want) + FLOOR[dtype]
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"
    assert all(torch.equal(x, b) for x, b in zip((q, k, v), before, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_float_mask_and_sinks_gradients_on_cuda(dtype):
    """A float mask's gradient (the kernels' backward declines it: the array-API backward
    on the CUDA tensors) and the sinks' gradient, against float64 eager attention."""
    q, k, v, g = _inputs(dtype, (2, 4, 96, 64), (2, 4, 120, 64), seed=11)
    mask = torch.randn(1, 4, 96, 120, device="cuda", generator=g).to(dtype)
    sinks = torch.randn(4, device="cuda", generator=g)
    cot = torch.randn(2, 4, 96, 64, device="cuda", generator=g)

    def eager(q, k, v, mask, sinks):
        s = (q @ k.transpose(-1, -2)) / 8.0 + mask
        logits = torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 96, 1).to(s.dtype)], -1)
        return torch.softmax(logits, -1)[..., :-1] @ v

    leaves = [q, k, v, mask, sinks]
    ours_leaves = [x.detach().requires_grad_() for x in leaves]
    out = SDPA(*ours_leaves[:4], sinks=ours_leaves[4])
    ours = (out, *torch.autograd.grad(out, ours_leaves, cot.to(dtype)))
    ref = _grads(eager, [x.double() for x in leaves], cot.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, want in zip(("out", "dq", "dk", "dv", "dmask", "dsinks"), ours, ref,
                               strict=True):  # fmt: skip
        assert _rel(got, want) <= tol, (name, _rel(got, want))


def test_dropout_on_cuda_follows_the_mask_and_torch_manual_seed():
    q, k, v, g = _inputs(torch.float32, (1, 4, 64, 64), (1, 4, 80, 64), seed=12)
    cot = torch.randn(1, 4, 64, 64, device="cuda", generator=g)
    p = 0.25

    def run():
        return _grads(lambda q, k, v: SDPA(q, k, v, dropout_p=p), (q, k, v), cot)

    torch.manual_seed(5)
    drawn = int(torch.randint(0, 2**32, (1,), dtype=torch.int64).item())
    torch.manual_seed(5)
    first = run()
    torch.manual_seed(5)
    second = run()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    keep = aa.dropout_mask(q.double(), k.double(), p, drawn)

    def eager(q, k, v):
        w = torch.softmax((q @ k.transpose(-1, -2)) / 8.0, -1)
        return (w * keep / (1 - p)) @ v

    ref = _grads(eager, [x.double() for x in (q, k, v)], cot.double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), first, ref, strict=True):
        assert _rel(got, want) <= 1e-5, (name, _rel(got, want))


def test_cuda_training_step_under_torch_compile():
    q, k, v, g = _inputs(torch.bfloat16, (2, 4, 128, 64), (2, 4, 128, 64), seed=13)
    w = torch.randn(64, 64, device="cuda", generator=g).to(torch.bfloat16) / 8

    def model(attention, q, k, v, w):
        return attention(q @ w, k, v, is_causal=True).float().square().sum()

    leaves = [x.detach().requires_grad_() for x in (q, k, v, w)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: model(SDPA, *a), backend="aot_eager")
    loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, w)]
    ref_loss = model(F.scaled_dot_product_attention, *ref_leaves)
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves)
    assert _rel(loss, ref_loss) <= 3e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) <= 3e-2
