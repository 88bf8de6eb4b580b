"""Misuse table (issue 12): every public op function given bad input raises a
``TypeError`` or ``ValueError`` that names the argument, and never modifies its inputs
or returns garbage. Pullbacks given a malformed cotangent do the same. (The module rows,
``MultiHeadAttention`` and ``KVCache``, live in ``tests/nn``.)
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import arrayattn as aa

SDPA = aa.scaled_dot_product_attention
rng = np.random.default_rng(0)
Q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
K = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
X = rng.standard_normal((2, 3, 8)).astype(np.float32)
W = np.ones(8, np.float32)
CU = np.array([0, 2, 3])
FREQS = aa.rope_frequencies(4, 3)


def _torch():
    torch = pytest.importorskip("torch")
    return torch.zeros((1, 2, 3, 4))


# (id, call, exception type, a regex the message must match: the argument's name)
CASES = [
    # scaled_dot_product_attention
    ("sdpa-query-list", lambda: SDPA([[1.0]], K, K), TypeError, "query"),
    ("sdpa-int-query", lambda: SDPA(Q.astype(np.int32), K, K), TypeError, "query"),
    ("sdpa-complex-key", lambda: SDPA(Q, K.astype(np.complex64), K), TypeError, "key"),
    ("sdpa-dtype-mix", lambda: SDPA(Q, K.astype(np.float64), K), TypeError, "key"),
    ("sdpa-1d", lambda: SDPA(Q[0, 0, 0], K, K), ValueError, "query"),
    ("sdpa-head-dim", lambda: SDPA(Q, K[..., :3], K), ValueError, "head_dim"),
    ("sdpa-value-len", lambda: SDPA(Q, K, K[..., :4, :]), ValueError, "value"),
    (
        "sdpa-gqa",
        lambda: SDPA(
            np.ones((1, 3, 3, 4)), np.ones((1, 2, 5, 4)), np.ones((1, 2, 5, 4)), enable_gqa=True
        ),
        ValueError,
        "heads",
    ),
    (
        "sdpa-heads",
        lambda: SDPA(np.ones((1, 4, 3, 4)), np.ones((1, 2, 5, 4)), np.ones((1, 2, 5, 4))),
        ValueError,
        "enable_gqa",
    ),
    (
        "sdpa-batch",
        lambda: SDPA(np.ones((2, 2, 3, 4)), np.ones((3, 2, 5, 4)), np.ones((3, 2, 5, 4))),
        ValueError,
        "batch",
    ),
    ("sdpa-int-mask", lambda: SDPA(Q, K, K, np.ones((3, 5), np.int64)), TypeError, "attn_mask"),
    ("sdpa-mask-shape", lambda: SDPA(Q, K, K, np.ones((3, 4), bool)), ValueError, "attn_mask"),
    ("sdpa-mask-library", lambda: SDPA(Q, K, K, _torch()), TypeError, "attn_mask"),
    ("sdpa-dropout-1", lambda: SDPA(Q, K, K, dropout_p=1.0), ValueError, "dropout_p"),
    ("sdpa-dropout-neg", lambda: SDPA(Q, K, K, dropout_p=-0.1), ValueError, "dropout_p"),
    ("sdpa-dropout-str", lambda: SDPA(Q, K, K, dropout_p="a"), TypeError, "dropout_p"),
    ("sdpa-dropout-nan", lambda: SDPA(Q, K, K, dropout_p=float("nan")), ValueError, "dropout_p"),
    ("sdpa-scale-inf", lambda: SDPA(Q, K, K, scale=float("inf")), ValueError, "scale"),
    ("sdpa-scale-nan", lambda: SDPA(Q, K, K, scale=float("nan")), ValueError, "scale"),
    ("sdpa-scale-str", lambda: SDPA(Q, K, K, scale="1"), TypeError, "scale"),
    ("sdpa-scale-array", lambda: SDPA(Q, K, K, scale=np.ones(2)), TypeError, "scale"),
    ("sdpa-softcap-0", lambda: SDPA(Q, K, K, softcap=0.0), ValueError, "softcap"),
    ("sdpa-softcap-neg", lambda: SDPA(Q, K, K, softcap=-1.0), ValueError, "softcap"),
    ("sdpa-causal-str", lambda: SDPA(Q, K, K, is_causal="yes"), TypeError, "is_causal"),
    ("sdpa-align", lambda: SDPA(Q, K, K, causal_align="bottom"), ValueError, "causal_align"),
    ("sdpa-window-int", lambda: SDPA(Q, K, K, window=3), ValueError, "window"),
    ("sdpa-window-neg", lambda: SDPA(Q, K, K, window=(-2, 0)), ValueError, "window"),
    ("sdpa-window-float", lambda: SDPA(Q, K, K, window=(1.5, 0)), TypeError, "window"),
    ("sdpa-window-bool", lambda: SDPA(Q, K, K, window=(True, 0)), TypeError, "window"),
    ("sdpa-seed-str", lambda: SDPA(Q, K, K, dropout_p=0.1, seed="x"), TypeError, "seed"),
    ("sdpa-impl", lambda: SDPA(Q, K, K, implementation="flash"), ValueError, "implementation"),
    (
        "sdpa-kv-lengths-float",
        lambda: SDPA(Q, K, K, kv_lengths=np.array([2.0])),
        TypeError,
        "kv_lengths",
    ),
    (
        "sdpa-kv-lengths-shape",
        lambda: SDPA(Q, K, K, kv_lengths=np.array([2, 3])),
        ValueError,
        "kv_lengths",
    ),
    ("sdpa-q-lengths-int", lambda: SDPA(Q, K, K, q_lengths=2), TypeError, "q_lengths"),
    ("sdpa-library-mix", lambda: SDPA(Q, _torch(), K), TypeError, "key"),
    ("sdpa-query-none", lambda: SDPA(None, K, K), TypeError, "query"),
    ("sdpa-mask-python-bool", lambda: SDPA(Q, K, K, True), TypeError, "attn_mask"),
    ("sdpa-kv-lengths-list", lambda: SDPA(Q, K, K, kv_lengths=[2]), TypeError, "kv_lengths"),
    (
        "sdpa-kv-lengths-bool",
        lambda: SDPA(Q, K, K, kv_lengths=np.array([True])),
        TypeError,
        "kv_lengths",
    ),
    (
        "sdpa-return-lse-array",
        lambda: SDPA(Q, K, K, implementation=None),
        ValueError,
        "implementation",
    ),
    ("sdpa-0d", lambda: SDPA(np.float32(1.0), K, K), (TypeError, ValueError), "query"),
    ("varlen-none", lambda: aa.varlen_attention(None, X, X, CU, CU), TypeError, "query"),
    ("varlen-cu-none", lambda: aa.varlen_attention(X, X, X, None, CU), TypeError, "cu_seqlens_q"),
    ("rms-none", lambda: aa.rms_norm(None, W), TypeError, "x"),
    ("layer-norm-none", lambda: aa.layer_norm(None, W, W), TypeError, "x"),
    ("softmax-none", lambda: aa.softmax(None), TypeError, "x"),
    ("split-heads-none", lambda: aa.split_heads(None, 2), TypeError, "x"),
    ("apply-rope-none", lambda: aa.apply_rope(None, FREQS), TypeError, "x"),
    ("apply-rope-freqs-none", lambda: aa.apply_rope(Q, None), TypeError, "freqs"),
    ("merge-none", lambda: aa.merge_attention_states([None], [None]), TypeError, "outs"),
    # varlen_attention
    ("varlen-2d", lambda: aa.varlen_attention(X[0], X[0], X[0], CU, CU), ValueError, "query"),
    (
        "varlen-cu-float",
        lambda: aa.varlen_attention(X, X, X, CU.astype(float), CU),
        TypeError,
        "cu_seqlens_q",
    ),
    (
        "varlen-cu-2d",
        lambda: aa.varlen_attention(X, X, X, CU[None], CU),
        ValueError,
        "cu_seqlens_q",
    ),
    (
        "varlen-cu-end",
        lambda: aa.varlen_attention(X, X, X, np.array([0, 2, 4]), CU),
        ValueError,
        "cu_seqlens_q",
    ),
    (
        "varlen-cu-decreasing",
        lambda: aa.varlen_attention(X, X, X, np.array([0, 3, 2, 3]), np.array([0, 1, 2, 3])),
        ValueError,
        "cu_seqlens_q",
    ),
    (
        "varlen-cu-count",
        lambda: aa.varlen_attention(X, X, X, CU, np.array([0, 3])),
        ValueError,
        "cu_seqlens",
    ),
    (
        "varlen-max-neg",
        lambda: aa.varlen_attention(X, X, X, CU, CU, max_seqlen_q=-1),
        ValueError,
        "max_seqlen_q",
    ),
    (
        "varlen-max-float",
        lambda: aa.varlen_attention(X, X, X, CU, CU, max_seqlen_k=2.5),
        TypeError,
        "max_seqlen_k",
    ),
    (
        "varlen-impl",
        lambda: aa.varlen_attention(X, X, X, CU, CU, implementation="x"),
        ValueError,
        "implementation",
    ),
    (
        "varlen-dropout",
        lambda: aa.varlen_attention(X, X, X, CU, CU, dropout_p=2),
        ValueError,
        "dropout_p",
    ),
    # merge_attention_states
    ("merge-empty", lambda: aa.merge_attention_states([], []), ValueError, "outs"),
    ("merge-array", lambda: aa.merge_attention_states(Q, Q[..., 0]), TypeError, "outs"),
    ("merge-count", lambda: aa.merge_attention_states([Q, Q], [Q[..., 0]]), ValueError, "lses"),
    (
        "merge-shape",
        lambda: aa.merge_attention_states([Q, Q[..., :2]], [Q[..., 0], Q[..., 0]]),
        ValueError,
        r"outs\[1\]",
    ),
    ("merge-lse-shape", lambda: aa.merge_attention_states([Q], [Q]), ValueError, r"lses\[0\]"),
    (
        "merge-int",
        lambda: aa.merge_attention_states([Q.astype(int)], [Q[..., 0]]),
        TypeError,
        r"outs\[0\]",
    ),
    # attention_weights / dropout_mask
    ("weights-int", lambda: aa.attention_weights(Q.astype(int), K), TypeError, "query"),
    (
        "weights-mask",
        lambda: aa.attention_weights(Q, K, np.ones((2, 2), bool)),
        ValueError,
        "attn_mask",
    ),
    ("dropout-mask-seed", lambda: aa.dropout_mask(Q, K, 0.1, None), ValueError, "seed"),
    ("dropout-mask-p", lambda: aa.dropout_mask(Q, K, 1.5, 1), ValueError, "dropout_p"),
    # softmax / heads
    ("softmax-int", lambda: aa.softmax(np.ones(3, int)), TypeError, "x"),
    ("softmax-axis", lambda: aa.softmax(X, axis=5), ValueError, "axis"),
    ("softmax-axis-float", lambda: aa.softmax(X, axis=1.0), TypeError, "axis"),
    ("split-heads-divide", lambda: aa.split_heads(X, 3), ValueError, "num_heads"),
    ("split-heads-zero", lambda: aa.split_heads(X, 0), ValueError, "num_heads"),
    ("split-heads-float", lambda: aa.split_heads(X, 2.0), TypeError, "num_heads"),
    ("merge-heads-2d", lambda: aa.merge_heads(X[0]), ValueError, "x"),
    ("repeat-kv-zero", lambda: aa.repeat_kv(Q, 0), ValueError, "n_rep"),
    ("repeat-kv-str", lambda: aa.repeat_kv(Q, "2"), TypeError, "n_rep"),
    # rope
    ("rope-odd", lambda: aa.rope_frequencies(5, 3), ValueError, "head_dim"),
    ("rope-zero", lambda: aa.rope_frequencies(0, 3), ValueError, "head_dim"),
    ("rope-float-dim", lambda: aa.rope_frequencies(4.0, 3), (TypeError, ValueError), "head_dim"),
    ("rope-theta", lambda: aa.rope_frequencies(4, 3, theta=-1.0), ValueError, "theta"),
    ("rope-positions", lambda: aa.rope_frequencies(4, 2.5), TypeError, "positions"),
    ("apply-rope-real", lambda: aa.apply_rope(Q, np.ones((3, 2))), TypeError, "freqs"),
    ("apply-rope-wide", lambda: aa.apply_rope(Q[..., :2], FREQS), ValueError, "freqs"),
    ("apply-rope-layout", lambda: aa.apply_rope(Q, FREQS, layout="x"), ValueError, "layout"),
    ("apply-rope-int", lambda: aa.apply_rope(Q.astype(int), FREQS), TypeError, "x"),
    # norms
    ("rms-eps", lambda: aa.rms_norm(X, W, eps=-1.0), ValueError, "eps"),
    ("rms-eps-str", lambda: aa.rms_norm(X, W, eps="x"), TypeError, "eps"),
    ("rms-weight", lambda: aa.rms_norm(X, W[:3]), ValueError, "weight"),
    ("rms-int", lambda: aa.rms_norm(X.astype(int), W), TypeError, "x"),
    ("layer-norm-bias", lambda: aa.layer_norm(X, W, W[:2]), ValueError, "bias"),
    ("layer-norm-eps", lambda: aa.layer_norm(X, W, W, eps=float("nan")), ValueError, "eps"),
    # vjp and registration
    ("vjp-unregistered", lambda: aa.vjp(np.sum, X), TypeError, "fn"),
    ("register-name", lambda: aa.ops.register_implementation("", object()), ValueError, "name"),
    ("register-auto", lambda: aa.ops.register_implementation("auto", object()), ValueError, "name"),
    ("register-impl", lambda: aa.ops.register_implementation("mine", object()), TypeError, "impl"),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_is_a_clear_error(call, exc, pattern):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert re.search(pattern, message), f"message does not name {pattern!r}: {message}"


# Pullbacks given a malformed cotangent (item 13, op level).
def _pullback(return_lse: bool = False):
    out, pullback = aa.vjp(SDPA, Q, K, K, return_lse=return_lse)
    return out, pullback


COTANGENT_CASES = [
    ("pair-without-lse", lambda o: (np.ones_like(o), None), False, TypeError, "cotangent"),
    ("array-with-lse", lambda o: np.ones_like(o[0]), True, TypeError, "cotangent"),
    ("complex", lambda o: np.ones_like(o) + 1j, False, TypeError, "complex"),
    ("int", lambda o: np.ones(o.shape, int), False, TypeError, "cotangent"),
    ("shape", lambda o: np.ones((1, 2, 3, 5), np.float32), False, ValueError, "shape"),
    (
        "lse-shape",
        lambda o: (np.ones_like(o[0]), np.ones((3,))),
        True,
        ValueError,
        "d_lse",
    ),
    ("torch", lambda o: __import__("torch").ones(tuple(o.shape)), False, TypeError, "torch"),
    ("list-of-three", lambda o: [o[0], o[1], o[1]], True, TypeError, "cotangent"),
    ("python-float", lambda o: 1.0, False, TypeError, "cotangent"),
]


@pytest.mark.parametrize(
    "make, return_lse, exc, pattern",
    [c[1:] for c in COTANGENT_CASES],
    ids=[c[0] for c in COTANGENT_CASES],
)
def test_bad_cotangent_is_a_clear_error(make, return_lse, exc, pattern):
    if pattern == "torch":
        pytest.importorskip("torch")
    out, pullback = _pullback(return_lse)
    with pytest.raises(exc, match=pattern):
        pullback(make(out))


@pytest.mark.parametrize(
    "fn, args",
    [
        (aa.softmax, (X,)),
        (aa.rms_norm, (X, W)),
        (aa.split_heads, (X, 2)),
        (aa.apply_rope, (Q, FREQS)),
        (aa.varlen_attention, (X, X, X, CU, CU)),
        (aa.attention_weights, (Q, K)),
    ],
)
def test_every_pullback_rejects_complex_and_foreign_cotangents(fn, args):
    """The cotangent check is shared by every registered op, not only attention."""
    out, pullback = aa.vjp(fn, *args)
    with pytest.raises(TypeError, match="cotangent"):
        pullback(np.ones(out.shape, np.complex64))
    with pytest.raises(TypeError, match="cotangent"):
        pullback((out, out))
    np.testing.assert_equal(len(pullback(np.ones_like(out))), len(args))


def test_error_leaves_no_state_behind():
    """A rejected call changes nothing: the same good call afterwards gives the same
    result as before (no cache or pool left half-updated)."""
    before = SDPA(Q, K, K, is_causal=True)
    for _, call, _exc, _ in CASES:
        try:
            call()
        except (TypeError, ValueError, pytest.skip.Exception):
            pass
    np.testing.assert_array_equal(SDPA(Q, K, K, is_causal=True), before)


ACCEPTED = [
    ("numpy-int-window", lambda: SDPA(Q, K, K, window=(np.int64(1), np.int32(0)))),
    ("numpy-float-scale", lambda: SDPA(Q, K, K, scale=np.float32(0.5))),
    ("numpy-float-dropout", lambda: SDPA(Q, K, K, dropout_p=np.float64(0.1), seed=3)),
    ("numpy-bool-causal", lambda: SDPA(Q, K, K, is_causal=np.bool_(True))),
    (
        "negative-lengths",
        lambda: SDPA(Q, K, K, kv_lengths=np.array([-5]), q_lengths=np.array([-1])),
    ),
    ("numpy-int-heads", lambda: aa.split_heads(X, np.int64(2))),
    (
        "numpy-int-max-seqlen",
        lambda: aa.varlen_attention(X, X, X, CU, CU, max_seqlen_q=np.int64(2)),
    ),
]


@pytest.mark.parametrize("call", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_numpy_scalars_and_edge_values_are_accepted(call):
    """NumPy scalars stand in for Python numbers, and out-of-range lengths clip."""
    out = call()
    assert np.isfinite(np.asarray(out)).all()
