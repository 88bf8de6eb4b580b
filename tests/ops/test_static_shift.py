"""The static shift (an online softmax without the running maximum where a bound allows
it) on the chunked path: when it is taken, that its results are the exact path's, and
that rows it cannot trust are redone exactly. The NumPy fast path's own use of it is
tested in test_numpy_fast."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import xp_assert_close
from _reference import attention as reference_attention

import arrayattn as aa
from arrayattn.attention import chunked
from arrayattn.attention import composed as _composed
from arrayattn.attention import static_shift as _static_shift
from arrayattn.attention.spec import make_spec

EAGER = ("numpy", "array_api_strict", "array_api_strict_device1", "torch", "cupy")


@pytest.fixture(autouse=True)
def _small_calls_too(monkeypatch):
    """The tests' calls are small: let them take the static shift (decode-shaped calls
    are tested apart, in test_decode_shaped_calls_keep_the_running_max)."""
    monkeypatch.setattr(_static_shift, "MIN_ROWS", 1)


def _spec(q, k, v, mask=None, **options):
    return make_spec(
        q,
        k,
        v,
        mask,
        0.0,
        options.pop("is_causal", False),
        None,
        options.pop("enable_gqa", False),
        "top_left",
        None,
        options.pop("softcap", None),
        None,
        **options,
    )


def _bounded(q, k, v, mask=None, **options) -> bool:
    spec = _spec(q, k, v, mask, **options)
    qg = spec.group_query(q) * spec.scale
    return _static_shift.bounded(spec, qg, spec.group_kv(k, spec.k_shape), v).static


def test_bound_decisions():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))
    assert _bounded(q, k, v)
    # float32: max |q| |k| / sqrt(E) about 35 * 5.4 = 190 > 80, exp could overflow ...
    assert not _bounded(q * 30, k, v)
    # ... while float64 has room up to 690.
    assert _bounded(*(x.astype(np.float64) for x in (q * 30, k, v)))
    assert _bounded(q * 30, k, v, softcap=30.0)  # the cap bounds the scores
    assert not _bounded(q, k, v, np.zeros((8, 8), np.float32))  # a float mask: arbitrary scores
    assert _bounded(q, k, v, np.ones((8, 8), dtype=bool))
    assert _bounded(q, k, v, alibi_slopes=np.array([0.5, 0.0], np.float32))
    assert not _bounded(q, k, v, alibi_slopes=np.array([0.5, -0.1], np.float32))  # raises scores
    big_v = v.copy()
    big_v[0, 0, 0, 0] = 1e35  # room = log(S) + log(max |v|) past the limit
    assert not _bounded(q, k, big_v)
    # Non-finite rows are left out of the bound (their scores are non-finite on either
    # path); the finite rows still decide.
    nan_k = k.copy()
    nan_k[0, 1, 3, 2] = np.nan
    assert _bounded(q, nan_k, v)
    nan_k[0, 0, 5, :] = 1e4
    assert not _bounded(q, nan_k, v)


def test_bound_takes_the_value_range_the_caller_already_read():
    """The chunked forward hands the bound the (max, min) of V that the finiteness check
    read: the decisions are the ones the bound takes when it reads V itself."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 128, 16)).astype(np.float32) for _ in range(3))
    big_v = v.copy()
    big_v[0, 0, 0, 0] = 1e35  # room past the limit
    for args in ((q, k, v), (q * 30, k, v), (q, k, big_v), (q, k, v * 0)):
        spec = _spec(*args, None)
        qg = spec.group_query(args[0]) * spec.scale
        kg, vg = spec.group_kv(args[1], spec.k_shape), spec.group_kv(args[2], spec.v_shape)
        given = _static_shift.bounded(spec, qg, kg, vg, _composed.value_range(np, vg))
        assert given == _static_shift.bounded(spec, qg, kg, vg)
    nan_range = (float("nan"), 0.0)
    assert not _static_shift.bounded(spec, qg, kg, vg, nan_range).static


def test_bound_says_when_every_score_is_finite():
    """``finite`` (masked pairs may be removed by adding -inf) only when no query or key
    entry is NaN/inf and no product can overflow, whatever a softcap does to the bound."""

    def finite(q, k, v, **options) -> bool:
        spec = _spec(q, k, v, None, **options)
        qg = spec.group_query(q) * spec.scale
        found = _static_shift.bounded(spec, qg, spec.group_kv(k, spec.k_shape), v)
        assert found.static or not found.finite
        return found.finite

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))
    assert finite(q, k, v)
    for x in (q, k):
        for bad in (np.nan, np.inf):
            y = x.copy()
            y[0, 1, 2, 3] = bad
            assert not finite(*((y, k) if x is q else (q, y)), v)
    big_q, big_k = q.copy(), k.copy()
    big_q[0, 0, 0, 0] = big_k[0, 0, 0, 0] = 1e17  # |q| |k| = 1e34: a product could overflow
    assert not finite(big_q, big_k, v, softcap=30.0)  # static (the cap bounds s), not finite
    assert not finite(q * 30, k, v)  # not static at all


def test_decode_shaped_calls_keep_the_running_max(monkeypatch):
    # Few query rows per KV head over long keys: the bound's passes over K and V would
    # cost as much as the memory-bound attention itself.
    monkeypatch.setattr(_static_shift, "MIN_ROWS", 128)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((1, 2, 64, 8)).astype(np.float32)
    q = rng.standard_normal((1, 8, 15, 8)).astype(np.float32)  # G * L = 4 * 15 = 60
    spec = _spec(q, kv, kv, enable_gqa=True)
    qg, kg = spec.group_query(q) * spec.scale, spec.group_kv(kv, spec.k_shape)
    assert not _static_shift.bounded(spec, qg, kg, kg).static
    q = rng.standard_normal((1, 8, 32, 8)).astype(np.float32)  # 4 * 32 = 128
    spec = _spec(q, kv, kv, enable_gqa=True)
    qg = spec.group_query(q) * spec.scale
    assert _static_shift.bounded(spec, qg, kg, kg).static


def test_lazy_libraries_never_take_it():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 8, 16))) for _ in range(3))
    assert not _bounded(q, k, v)


def _spy(monkeypatch, block_q: int, block_k: int) -> list[bool]:
    """Blocks of ``block_q x block_k``; records the ``static`` flag of every row block the
    chunked forward runs."""
    monkeypatch.setattr(chunked, "BLOCK_Q", block_q)
    monkeypatch.setattr(chunked, "BLOCK_K", block_k)
    calls: list[bool] = []
    original = chunked._Rows.block

    def block(self, r0, r1, static):
        calls.append(static)
        return original(self, r0, r1, static)

    monkeypatch.setattr(chunked._Rows, "block", block)
    return calls


@pytest.mark.parametrize("is_causal", [False, True])
def test_taken_and_equal_to_the_reference(backend, monkeypatch, is_causal):
    if backend.name not in EAGER:
        pytest.skip("the static shift needs an eager library")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 40, 8))
    k, v = (rng.standard_normal((2, 2, 50, 8)) for _ in range(2))
    calls = _spy(monkeypatch, 16, 16)
    out, lse = aa.scaled_dot_product_attention(
        *(backend.asarray(x) for x in (q, k, v)),
        is_causal=is_causal,
        enable_gqa=True,
        return_lse=True,
        implementation="chunked",
    )
    assert calls == [True] * 3  # three row blocks, none redone
    want, want_lse, _ = reference_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    xp_assert_close(backend, out, want, rtol=1e-12, atol=1e-12)
    xp_assert_close(backend, lse, want_lse, rtol=1e-12, atol=1e-12)


def test_rows_with_tiny_sums_are_redone_exactly(monkeypatch):
    # Every key points one way and the first query row the other way, with scores near
    # -78 (the bound allows it: 78 + log 4 < 80): in float32 its row sums (~1e-34) are
    # under TINY and its P V terms with |v| ~ 1e-6 would be subnormal. Its row block is
    # redone with the running maximum; the other block stays on the static shift.
    u = np.zeros(8, np.float32)
    u[0] = 1.0
    k = np.stack([u + 0.01 * i * np.eye(8, dtype=np.float32)[1] for i in range(4)])[None, None]
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    q = np.zeros((1, 1, 4, 8), np.float32)
    q[0, 0, 0] = -78.0 * math.sqrt(8) * u  # score -78 * |k| cos with every key
    q[0, 0, 1:, :] = np.float32(0.5)
    v = np.random.default_rng(2).uniform(1e-6, 2e-6, (1, 1, 4, 8)).astype(np.float32)
    calls = _spy(monkeypatch, 2, 4)
    out, lse = aa.scaled_dot_product_attention(q, k, v, return_lse=True, implementation="chunked")
    assert calls == [True, True, False]  # row block 0 again, without the static shift
    want, want_lse, _ = reference_attention(q, k, v)
    np.testing.assert_allclose(out, want, rtol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6)


def test_empty_rows_are_exact_and_not_redone(backend, monkeypatch):
    # Rows past q_lengths have no key (sum exactly 0): already exact, no second pass.
    if backend.name not in EAGER:
        pytest.skip("the static shift needs an eager library")
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 12, 4)) for _ in range(3))
    lengths = np.array([5, 12], dtype=np.int32)
    calls = _spy(monkeypatch, 4, 4)
    args = [backend.asarray(x) for x in (q, k, v)]
    opts = {"q_lengths": backend.asarray(lengths), "is_causal": True, "return_lse": True}
    out, lse = aa.scaled_dot_product_attention(*args, implementation="chunked", **opts)
    assert calls == [True] * 3
    want, want_lse = aa.scaled_dot_product_attention(*args, implementation="composed", **opts)
    xp_assert_close(backend, out, backend.to_numpy(want), rtol=1e-12, atol=1e-12)
    xp_assert_close(backend, lse, backend.to_numpy(want_lse), rtol=1e-12, atol=0)
    assert np.all(backend.to_numpy(out)[0, :, 5:] == 0)
    assert np.all(np.isneginf(backend.to_numpy(lse)[0, :, 5:]))


def test_alibi_rows_that_underflow_to_zero_are_redone(monkeypatch):
    # ALiBi lowers far scores past exp's range: a row's sum can be 0 with keys present.
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    q[..., 4:, :] = 0.0  # rows 4-5: every score 0, so only ALiBi's -slope * distance
    slopes = np.array([40.0, 0.5], np.float32)  # head 0: -40 * 3 = -120 at distance >= 3
    calls = _spy(monkeypatch, 2, 2)
    opts = {"alibi_slopes": slopes, "causal_align": "bottom_right", "return_lse": True}
    kk, vv = k[..., :2, :], v[..., :2, :]  # keys 0-1: distance >= 3 for rows 4-5
    out, lse = aa.scaled_dot_product_attention(q, kk, vv, implementation="chunked", **opts)
    assert calls[:3] == [True] * 3 and False in calls[3:]
    want, want_lse = aa.scaled_dot_product_attention(q, kk, vv, implementation="composed", **opts)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    assert np.all(np.isfinite(lse[0, 0, 4:]))  # far, but present: not an empty row


@pytest.mark.parametrize("implementation", ["chunked", "composed"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_torch_autograd_follows_the_array_api_paths(implementation, softcap):
    # Inputs that require grad: no out= workspace (autograd does not follow out=), and the
    # in-place masking and exp stay differentiable.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((1, 2, 20, 8)) for _ in range(3)]
    ours = [torch.tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = aa.scaled_dot_product_attention(
        *ours, is_causal=True, softcap=softcap, implementation=implementation
    )
    q, k, v = theirs  # softcap written out: PyTorch's SDPA has none
    s = q @ k.mT / math.sqrt(8)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), -math.inf)
    want = torch.softmax(s, dim=-1) @ v
    cot = torch.tensor(rng.standard_normal(tuple(want.shape)))
    (out * cot).sum().backward()
    (want * cot).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
