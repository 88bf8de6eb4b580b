"""log_softmax and cross_entropy: float64 NumPy oracles written out here, every backend and
dtype, finite differences for both backwards, torch.nn.functional as a peer (ignore_index,
label smoothing, each reduction, float16, the class axis first), and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import (
    backend_dtype,
    check_vjp_fd,
    check_vjp_matches_numpy,
    thin,
    xp_assert_close,
)

import arrayattn as aa

REDUCTIONS = ("mean", "sum", "none")


# -- oracles (float64 NumPy, plainly) -----------------------------------------------------
def ref_log_softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def ref_cross_entropy(logits, targets, axis=-1, ignore_index=-100, eps=0.0, reduction="mean"):
    """PyTorch's definition, one position at a time."""
    logp = np.moveaxis(ref_log_softmax(logits, axis), axis, -1)
    C = logp.shape[-1]
    flat_logp = logp.reshape(-1, C)
    flat_t = np.asarray(targets).reshape(-1)
    losses, kept = [], 0
    for row, t in zip(flat_logp, flat_t, strict=True):
        if t == ignore_index:
            losses.append(0.0)
            continue
        kept += 1
        losses.append(-(1 - eps) * row[t] - eps / C * row.sum())
    losses = np.array(losses).reshape(np.shape(targets))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return np.sum(losses)
    return np.sum(losses) / kept if kept else np.nan


def ce_inputs(rng, shape=(3, 4, 5), axis=-1, ignored=2, scale=3.0):
    logits = scale * rng.standard_normal(shape)
    t_shape = tuple(d for i, d in enumerate(shape) if i != axis % len(shape))
    C = shape[axis]
    targets = rng.integers(0, C, size=t_shape)
    flat = targets.reshape(-1)
    flat[rng.choice(flat.size, size=min(ignored, flat.size), replace=False)] = -100
    return logits, targets


# -- log_softmax ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape, axis", [((3, 7), -1), ((2, 3, 5), 1), ((4,), 0)])
def test_log_softmax_forward(backend, dtype_name, rng, shape, axis):
    thin(backend, (dtype_name, axis) == ("float32", 1))
    dtype = backend_dtype(backend, dtype_name)
    x = (3 * rng.standard_normal(shape)).astype(dtype_name)
    y = backend.call(aa.log_softmax, backend.asarray(x), axis=axis)
    assert y.dtype == dtype
    xp_assert_close(backend, y, ref_log_softmax(x, axis), dtype=dtype_name, atol=8e-3
                    if dtype_name == "float16" else None)  # fmt: skip


def test_log_softmax_large_and_neg_inf():
    big = np.array([[1e4, 1e4 - 1.0, -1e4], [-np.inf, 0.0, 1.0]], dtype=np.float32)
    y = aa.log_softmax(big)
    np.testing.assert_allclose(y, ref_log_softmax(big), rtol=1e-6, atol=1e-6)
    half = np.array([[6e4, 6e4 - 32.0, 3e4]], dtype=np.float16)  # exp would overflow float16
    y = aa.log_softmax(half)
    assert y.dtype == np.float16 and np.all(np.isfinite(y))
    np.testing.assert_allclose(y.astype(np.float64), ref_log_softmax(half), rtol=1e-3, atol=1e-6)
    # an all -inf slice: the log of softmax's zeros, not NaN; its gradient passes through
    row = np.full((1, 3), -np.inf)
    np.testing.assert_array_equal(aa.log_softmax(row), -np.inf)
    _, pullback = aa.vjp(aa.log_softmax, row)
    np.testing.assert_array_equal(pullback(np.ones((1, 3)))[0], 1.0)


@pytest.mark.parametrize("shape, axis", [((2, 5), -1), ((3, 4, 2), 1), ((3, 4, 2), 0)])
def test_log_softmax_backward_finite_differences(rng, shape, axis):
    check_vjp_fd(aa.log_softmax, [rng.standard_normal(shape)], {"axis": axis})


def test_log_softmax_vjp_on_backend(backend, rng):
    thin(backend, True)
    check_vjp_matches_numpy(backend, aa.log_softmax, [rng.standard_normal((2, 3, 5))], {"axis": 1})


# -- cross_entropy forward ------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_cross_entropy_forward(backend, dtype_name, rng, reduction, eps):
    thin(backend, dtype_name == "float32" and eps == 0.2)
    dtype = backend_dtype(backend, dtype_name)
    logits, targets = ce_inputs(rng)
    logits = logits.astype(dtype_name)
    out = backend.call(
        aa.cross_entropy,
        backend.asarray(logits),
        backend.asarray(targets),
        label_smoothing=eps,
        reduction=reduction,
    )
    assert out.dtype == dtype
    expected = ref_cross_entropy(logits, targets, eps=eps, reduction=reduction)
    rtol, atol = {"float16": (2e-3, 4e-3), "float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}[
        dtype_name
    ]
    xp_assert_close(backend, out, expected, dtype=dtype_name, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "shape, axis", [((6,), 0), ((4, 6), -1), ((2, 5, 3), 1), ((2, 3, 4, 5), 1), ((5, 2, 3), 0)]
)
def test_cross_entropy_class_axis(rng, shape, axis):
    logits, targets = ce_inputs(rng, shape, axis, ignored=1 if len(shape) > 1 else 0)
    for reduction in REDUCTIONS:
        got = aa.cross_entropy(logits, targets, axis=axis, reduction=reduction, label_smoothing=0.1)
        want = ref_cross_entropy(logits, targets, axis, eps=0.1, reduction=reduction)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_cross_entropy_ignored_positions_and_their_count():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 5.0, 0.0], [1.0, 1.0, 1.0]])
    targets = np.array([0, -100, 2])
    per = aa.cross_entropy(logits, targets, reduction="none")
    assert per[1] == 0.0
    # the mean divides by the 2 positions that count, not by 3
    assert aa.cross_entropy(logits, targets) == pytest.approx((per[0] + per[2]) / 2, rel=1e-15)
    assert aa.cross_entropy(logits, targets, reduction="sum") == pytest.approx(per.sum())
    # another ignore_index; -100 is then an ordinary (out of range) id
    t = np.array([0, 7, 2])
    np.testing.assert_allclose(aa.cross_entropy(logits, t, ignore_index=7, reduction="none"), per)
    # every position ignored: a NaN mean (as PyTorch), a zero sum, zero gradients
    none = np.full(3, -100)
    assert np.isnan(aa.cross_entropy(logits, none))
    assert aa.cross_entropy(logits, none, reduction="sum") == 0.0
    loss, pullback = aa.vjp(aa.cross_entropy, logits, none, label_smoothing=0.3)
    np.testing.assert_array_equal(pullback(np.ones_like(loss))[0], 0.0)


def test_cross_entropy_stability_and_dtypes():
    big = np.array([[1e4, 0.0, -1e4], [3e4, 3e4, -3e4]], dtype=np.float32)
    t = np.array([1, 0])
    loss = aa.cross_entropy(big, t, reduction="none")
    assert loss.dtype == np.float32 and np.all(np.isfinite(loss))
    np.testing.assert_allclose(loss, [1e4, np.log(2.0)], rtol=1e-6)
    half = np.array([[6e4, 0.0, -6e4]], dtype=np.float16)
    out = aa.cross_entropy(half, np.array([0]), label_smoothing=0.1)
    assert out.dtype == np.float16 and np.isfinite(out)
    np.testing.assert_allclose(
        float(out), ref_cross_entropy(half, np.array([0]), eps=0.1), rtol=2e-3
    )
    # integer targets of any width, unsigned too (ignore_index -100 then never matches)
    logits = np.random.default_rng(0).standard_normal((4, 300))
    ids = np.array([0, 299, 5, 17])
    want = ref_cross_entropy(logits, ids)
    for dt in (np.int8, np.uint8, np.int16, np.uint16, np.int32):
        if np.iinfo(dt).max >= 299:
            np.testing.assert_allclose(aa.cross_entropy(logits, ids.astype(dt)), want)
    small = np.array([0, 2, 1, 2], dtype=np.uint8)
    np.testing.assert_allclose(
        aa.cross_entropy(logits[:, :3], small), ref_cross_entropy(logits[:, :3], small)
    )


# -- cross_entropy backward -----------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.25, 1.0])
def test_cross_entropy_backward_finite_differences(rng, reduction, eps):
    logits, targets = ce_inputs(rng, (3, 4, 5))
    _, grads = check_vjp_fd(
        aa.cross_entropy,
        [logits, targets],
        {"label_smoothing": eps, "reduction": reduction},
        wrt=[0],
    )
    assert grads[1] is None  # integer targets get no cotangent


def test_cross_entropy_backward_class_axis_first(rng):
    logits, targets = ce_inputs(rng, (4, 3, 2), axis=0, ignored=1)
    check_vjp_fd(aa.cross_entropy, [logits, targets], {"axis": 0, "label_smoothing": 0.1}, wrt=[0])


def test_cross_entropy_gradient_closed_form(rng):
    logits, targets = ce_inputs(rng, (6, 4), ignored=2)
    loss, pullback = aa.vjp(aa.cross_entropy, logits, targets, label_smoothing=0.2)
    (d,) = pullback(np.asarray(1.0))[:1]
    p = np.exp(ref_log_softmax(logits))
    keep = targets != -100
    target = 0.8 * np.eye(4)[np.where(keep, targets, 0)] + 0.2 / 4
    expected = (p - target) * keep[:, None] / keep.sum()
    np.testing.assert_allclose(d, expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(d.sum(-1), 0.0, atol=1e-15)  # each row's gradient sums to 0


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_vjp_on_backend(backend, rng, reduction):
    thin(backend, reduction == "mean")
    logits, targets = ce_inputs(rng, (2, 3, 5))
    check_vjp_matches_numpy(
        backend,
        aa.cross_entropy,
        [logits, targets],
        {"label_smoothing": 0.1, "reduction": reduction},
    )


def test_float16_gradient_is_float16(rng):
    logits, targets = ce_inputs(rng, (3, 5), ignored=1)
    loss, pullback = aa.vjp(aa.cross_entropy, logits.astype(np.float16), targets)
    (d, _) = pullback(np.ones((), np.float16))
    assert loss.dtype == d.dtype == np.float16
    _, pullback64 = aa.vjp(aa.cross_entropy, logits.astype(np.float16).astype(np.float64), targets)
    np.testing.assert_allclose(d.astype(np.float64), pullback64(np.asarray(1.0))[0], atol=1e-3)


def test_ops_are_differentiable_and_exported():
    ops = aa.differentiable_ops()
    assert aa.log_softmax in ops and aa.cross_entropy in ops
    assert aa.ops.cross_entropy is aa.cross_entropy and aa.ops.log_softmax is aa.log_softmax


# -- PyTorch as a peer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_cross_entropy_matches_torch(torch, rng, reduction, eps, ignore_index):
    F = torch.nn.functional
    logits, targets = ce_inputs(rng, (2, 3, 6))
    targets[targets == -100] = ignore_index
    ours, pullback = aa.vjp(
        aa.cross_entropy,
        logits,
        targets,
        ignore_index=ignore_index,
        label_smoothing=eps,
        reduction=reduction,
    )
    # PyTorch's class axis is 1: move ours (last) there
    t_logits = torch.tensor(np.moveaxis(logits, -1, 1), requires_grad=True)
    theirs = F.cross_entropy(
        t_logits,
        torch.tensor(targets),
        ignore_index=ignore_index,
        label_smoothing=eps,
        reduction=reduction,
    )
    np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-12, atol=1e-14)
    g = rng.standard_normal(np.shape(ours))
    theirs.backward(torch.tensor(g))
    (d, _) = pullback(np.asarray(g))
    np.testing.assert_allclose(d, np.moveaxis(t_logits.grad.numpy(), 1, -1), rtol=1e-10,
                               atol=1e-14)  # fmt: skip
    # the same call with PyTorch's layout: axis=1
    same = aa.cross_entropy(
        np.moveaxis(logits, -1, 1),
        targets,
        axis=1,
        ignore_index=ignore_index,
        label_smoothing=eps,
        reduction=reduction,
    )
    np.testing.assert_allclose(same, ours, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_float16_matches_torch(torch, rng, reduction):
    F = torch.nn.functional
    logits, targets = ce_inputs(rng, (8, 10), scale=4.0)
    half = logits.astype(np.float16)
    ours = aa.cross_entropy(half, targets, label_smoothing=0.1, reduction=reduction)
    theirs = F.cross_entropy(
        torch.tensor(half), torch.tensor(targets), label_smoothing=0.1, reduction=reduction
    )
    assert ours.dtype == np.float16 and theirs.dtype == torch.float16
    np.testing.assert_allclose(
        ours.astype(np.float64), theirs.numpy().astype(np.float64), rtol=2e-3, atol=2e-3
    )


def test_log_softmax_matches_torch(torch, rng):
    x = 5 * rng.standard_normal((3, 4, 7))
    for axis in (-1, 1, 0):
        ours, pullback = aa.vjp(aa.log_softmax, x, axis=axis)
        tx = torch.tensor(x, requires_grad=True)
        theirs = torch.nn.functional.log_softmax(tx, dim=axis)
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-13, atol=1e-13)
        g = rng.standard_normal(x.shape)
        theirs.backward(torch.tensor(g))
        np.testing.assert_allclose(pullback(g)[0], tx.grad.numpy(), rtol=1e-12, atol=1e-13)
    half = x.astype(np.float16)
    theirs = torch.nn.functional.log_softmax(torch.tensor(half), dim=-1).numpy()
    ours = aa.log_softmax(half)
    assert ours.dtype == np.float16
    np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), atol=1.6e-2,
                               rtol=2e-3)  # fmt: skip


# -- errors ---------------------------------------------------------------------------------
def test_cross_entropy_errors():
    logits = np.zeros((2, 3))
    t = np.array([0, 1])
    with pytest.raises(ValueError, match=r"reduction must be one of .*'mean'.*got 'avg'"):
        aa.cross_entropy(logits, t, reduction="avg")
    with pytest.raises(TypeError, match=r"targets must have an integer dtype.*float64"):
        aa.cross_entropy(logits, t.astype(np.float64))
    with pytest.raises(TypeError, match=r"targets must have an integer dtype.*bool"):
        aa.cross_entropy(logits, np.array([True, False]))
    with pytest.raises(ValueError, match=r"targets has shape \(3,\), expected \(2,\)"):
        aa.cross_entropy(logits, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"expected \(3,\) .*axis=0"):
        aa.cross_entropy(logits, t, axis=0)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got"):
            aa.cross_entropy(logits, t, label_smoothing=bad)
    with pytest.raises(TypeError, match=r"label_smoothing must be a number in \[0, 1\].*str"):
        aa.cross_entropy(logits, t, label_smoothing="0.1")
    with pytest.raises(TypeError, match=r"ignore_index must be an int, got float"):
        aa.cross_entropy(logits, t, ignore_index=-100.0)
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\) or ignore_index=-100, got .*3"):
        aa.cross_entropy(logits, np.array([0, 3]))
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\).*-1"):
        aa.cross_entropy(logits, np.array([-1, 0]))
    with pytest.raises(TypeError, match=r"logits must have a real floating dtype, got int64"):
        aa.cross_entropy(np.zeros((2, 3), np.int64), t)
    with pytest.raises(ValueError, match=r"axis must be an int in \[-2, 2\).*got 2"):
        aa.cross_entropy(logits, t, axis=2)
    with pytest.raises(ValueError, match=r"logits must have a class axis"):
        aa.cross_entropy(np.ones(()), np.array(0))
    with pytest.raises(ValueError, match="at least one class"):
        aa.cross_entropy(np.zeros((2, 0)), t)
    with pytest.raises(TypeError, match="targets must be an array"):
        aa.cross_entropy(logits, [0, 1])
    _, pullback = aa.vjp(aa.cross_entropy, logits, t)
    with pytest.raises(ValueError, match=r"cotangent has shape \(2,\), expected \(\).*'mean'"):
        pullback(np.ones(2))


def test_cross_entropy_libraries_must_match(torch):
    with pytest.raises(TypeError, match="targets is a torch array but logits is a numpy"):
        aa.cross_entropy(np.zeros((2, 3)), torch.tensor([0, 1]))


def test_log_softmax_errors():
    with pytest.raises(TypeError, match="x must have a real floating dtype"):
        aa.log_softmax(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="axis must be an int in"):
        aa.log_softmax(np.zeros((2, 3)), axis=3)
