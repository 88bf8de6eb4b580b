"""Structured attention (``arrayattn.flex``): ``block_mask=``, ``mask_mod=`` and
``score_mod=`` with every other option, on the composed and chunked paths.

Oracles (PyTorch's own FlexAttention is the peer in ``test_flex_peers.py``):

- ``reference``: float64 NumPy attention, dense and explicit, written here: softcap, ALiBi,
  the score_mod (T5's bucket and Swin's index written here too), then every mask
  (structure, lengths and the dense bool mask built from the mask_mod with broadcasting
  index arrays), the sink as one more logit column with no value (SEMANTICS.md);
- the dense-mask path of arrayattn itself: a call with ``block_mask`` equals the same
  call with the dense bool ``attn_mask`` (dropout included, same seed), gradients too;
- evaluation for block kinds: a built-in's classification (from index ranges) equals
  that of the same function wrapped in a plain lambda (evaluated), or is conservative
  (partial where evaluation says empty or full, never the reverse);
- finite differences for the score_mod tables' gradients.

``ARRAYATTN_FLEX_EXAMPLES`` sets the hypothesis examples (default 100, about 2 s).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from _helpers import numerical_vjp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn import flex
from arrayattn.attention import chunked
from arrayattn.attention.block_mask import EMPTY, FULL, PARTIAL
from arrayattn.attention.mask_mods import as_mask_mod, classifiable

SDPA = aa.scaled_dot_product_attention
IMPLEMENTATIONS = ("composed", "chunked")
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(chunked, "BLOCK_Q", 3)
    monkeypatch.setattr(chunked, "BLOCK_K", 4)


# -- oracles --------------------------------------------------------------------------------
def hf_t5_bucket(rp, bidirectional=True, num_buckets=32, max_distance=128):
    """Hugging Face's ``T5Attention._relative_position_bucket`` in NumPy (float32 log)."""
    rp = np.asarray(rp, np.int64)
    buckets = np.zeros_like(rp)
    if bidirectional:
        num_buckets //= 2
        buckets += (rp > 0).astype(np.int64) * num_buckets
        rp = np.abs(rp)
    else:
        rp = -np.minimum(rp, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0): a small position
        large = max_exact + (
            np.log(rp.astype(np.float32) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(rp < max_exact, rp, large)


def swin_index(wh, ww):
    """Swin's ``relative_position_index`` (N, N) in NumPy."""
    coords = np.stack(np.meshgrid(np.arange(wh), np.arange(ww), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0)
    return (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1


def dense_mask(mod, B, H, L, S):
    """The mask_mod evaluated on broadcasting index arrays, ``(B, H, L, S)`` bool."""
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    got = mod(b, h, np.arange(L).reshape(L, 1), np.arange(S))
    return np.broadcast_to(np.asarray(got), (B, H, L, S))


def reference(q, k, v, *, allowed=None, bias=None, sinks=None, alibi_slopes=None,
              is_causal=False, causal_align="top_left", window=None, softcap=None,
              enable_gqa=False, q_lengths=None, kv_lengths=None, **_):  # fmt: skip
    """``(out, lse)`` in float64: ``allowed`` the mask_mod's dense mask ``(B, Hq, L, S)``,
    ``bias`` the score_mod's additive bias or a function of the scores."""
    B, Hq, L, E = q.shape
    S = k.shape[-2]
    if enable_gqa:
        k = np.repeat(k, Hq // k.shape[1], axis=1)
        v = np.repeat(v, Hq // v.shape[1], axis=1)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(E)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    keep = np.ones((B, Hq, L, S), bool)
    dist = np.zeros((B, 1, L, S))
    for b in range(B):
        ql = L if q_lengths is None else int(q_lengths[b])
        kl = S if kv_lengths is None else int(kv_lengths[b])
        off = 0
        if causal_align == "bottom_right":
            off = (kl - ql) if (q_lengths is not None or kv_lengths is not None) else S - L
        a = (i < ql) & (j < kl)
        left, right = window if window is not None else (-1, -1)
        if is_causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            a &= j >= i + off - left
        if right >= 0:
            a &= j <= i + off + right
        keep[b] &= a
        dist[b, 0] = np.abs(i + off - j)
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes)[None, :, None, None] * dist
    if callable(bias):
        s = bias(s)
    elif bias is not None:
        s = s + bias
    if allowed is not None:
        keep &= allowed
    s = np.where(keep, s, -np.inf)
    if sinks is not None:
        sk = np.broadcast_to(np.asarray(sinks)[None, :, None, None], (B, Hq, L, 1))
        s = np.concatenate([s, sk], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    some = total > 0
    p = np.where(some, e / np.where(some, total, 1.0), 0.0)
    lse = np.where(some, m + np.log(np.where(some, total, 1.0)), -np.inf)[..., 0]
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


# -- hypothesis: masks, block sizes, shapes and every option ---------------------------------
def _doc_ids(draw, B, n, contiguous):
    if contiguous:
        return np.sort(np.array(draw(st.lists(st.integers(0, 3), min_size=B * n,
                                              max_size=B * n))).reshape(B, n), axis=-1)  # fmt: skip
    return np.array(draw(st.lists(st.integers(0, 2), min_size=B * n, max_size=B * n))).reshape(B, n)


@st.composite
def mask_mods(draw, B, L, S, depth=0):
    kind = draw(
        st.sampled_from(
            ["causal", "window", "document", "prefix", "global", "noop", "plain"]
            + (["and", "or"] if depth == 0 else [])
        )
    )
    if kind == "causal":
        return flex.causal(draw(st.integers(-3, 3)))
    if kind == "window":
        return flex.sliding_window_mask(
            draw(st.integers(-1, 4)), draw(st.integers(-1, 3)), offset=draw(st.integers(-2, 2))
        )
    if kind == "document":
        contiguous = draw(st.booleans())
        qd = _doc_ids(draw, B, L, contiguous)
        kd = qd if (L == S and draw(st.booleans())) else _doc_ids(draw, B, S, contiguous)
        if B == 1 and draw(st.booleans()):
            qd, kd = qd[0], kd[0]  # shared by the batch
        return flex.document_mask(qd, kd, causal=draw(st.booleans()))
    if kind == "prefix":
        if draw(st.booleans()):
            return flex.prefix_lm_mask(draw(st.integers(0, S)))
        return flex.prefix_lm_mask(np.array(draw(st.lists(st.integers(0, S), min_size=B,
                                                           max_size=B))))  # fmt: skip
    if kind == "global":
        return flex.global_tokens_mask(draw(st.integers(0, 3)))
    if kind == "noop":
        return flex.noop_mask
    if kind == "plain":  # a function, classified by evaluation; depends on the head
        m = draw(st.integers(2, 4))
        return lambda b, h, q, kv: (kv + h) % m != q % m
    parts = draw(st.lists(mask_mods(B, L, S, depth=1), min_size=2, max_size=3))
    return (flex.and_masks if kind == "and" else flex.or_masks)(*parts)


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 2))
    Hq = Hkv * G
    L = draw(st.integers(1, 12))
    S = draw(st.integers(1, 12))
    E = draw(st.sampled_from([2, 4]))
    mod = draw(mask_mods(B, L, S))
    block = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    opts = {"enable_gqa": G > 1, "is_causal": draw(st.booleans())}
    opts["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.5, 5.0))
    if draw(st.booleans()):
        opts["dropout_p"] = draw(st.sampled_from([0.2, 0.5]))
        opts["seed"] = draw(st.integers(0, 2**31 - 1))
    score = draw(st.sampled_from([None, "t5", "swin", "softcap", "alibi"]))
    extras = {
        "sinks": draw(st.booleans()),
        "alibi": draw(st.booleans()),
        "lengths": draw(st.booleans()),
        "lse": draw(st.booleans()),
        "bm_heads": draw(st.booleans()),
    }
    seed = draw(st.integers(0, 2**32 - 1))
    return (B, Hq, Hkv, L, S, E), mod, block, opts, score, extras, seed


def _score_mod(score, rng, Hq, L, S):
    """``(ScoreMod, oracle bias)`` for the drawn score_mod."""
    if score is None:
        return None, None
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    if score == "t5":
        table = rng.standard_normal((8, Hq))
        bias = table[hf_t5_bucket(j - i, num_buckets=8, max_distance=10)].transpose(2, 0, 1)
        return flex.relative_position_bias(table, max_distance=10), bias[None]
    if score == "swin":  # a (4, 3) window covers up to 12 tokens
        table = rng.standard_normal((7 * 5, 1))
        bias = table[swin_index(4, 3)[:L, :S], 0]
        return flex.relative_position_bias_2d(table, (4, 3)), bias
    if score == "softcap":
        return flex.softcap_score_mod(1.5), lambda s: 1.5 * np.tanh(s / 1.5)
    slopes = rng.uniform(0.1, 1.0, Hq)
    bias = -slopes[:, None, None] * np.abs(i + 1 - j)
    return flex.alibi_score_mod(slopes, offset=1), bias[None]


def _classification_is_sound(mod, B, H, L, S, block):
    """The built-in's kinds equal evaluation's, or are partial where evaluation is sure."""
    got = flex.create_block_mask(mod, B, H, L, S, block_size=block).kinds
    want = flex.create_block_mask(lambda *a: mod(*a), B, H, L, S, block_size=block).kinds
    got = np.broadcast_to(got, want.shape)
    assert ((got == want) | (got == PARTIAL)).all(), (mod, got, want)


@settings(
    max_examples=int(os.environ.get("ARRAYATTN_FLEX_EXAMPLES", "100")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(problems())
def test_hypothesis_block_mask_matches_dense_oracles(small_tiles, problem) -> None:
    (B, Hq, Hkv, L, S, E), mod, block, opts, score, extras, seed = problem
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, E))
    sm, bias = _score_mod(score, rng, Hq, L, S)
    arrays = {}
    if extras["sinks"]:
        arrays["sinks"] = rng.standard_normal(Hq)
    if extras["alibi"]:
        arrays["alibi_slopes"] = rng.uniform(0.0, 1.0, Hq)
    if extras["lengths"]:
        arrays["q_lengths"] = rng.integers(0, L + 1, B)
        arrays["kv_lengths"] = rng.integers(0, S + 1, B)
    H = Hq if extras["bm_heads"] or not classifiable(as_mask_mod(mod)) else None
    bm = flex.create_block_mask(mod, B, H, L, S, block_size=block)
    allowed = dense_mask(bm.mask_mod, B, Hq, L, S)
    _classification_is_sound(bm.mask_mod, B, Hq, L, S, block)
    lse_wanted = extras["lse"] or "dropout_p" not in opts
    want_out, want_lse = reference(q, k, v, allowed=allowed, bias=bias, **arrays, **opts)
    cot = rng.standard_normal(want_out.shape)
    cot_lse = np.where(np.isfinite(want_lse), rng.standard_normal(want_lse.shape), 0.0)
    common = dict(score_mod=sm, return_lse=lse_wanted, **arrays, **opts)
    grads = {}
    for impl in IMPLEMENTATIONS:
        for how, extra in (
            ("block_mask", {"block_mask": bm}),
            ("mask_mod", {"mask_mod": bm.mask_mod}),
            ("dense", {"attn_mask": allowed}),
        ):
            got, pullback = aa.vjp(SDPA, q, k, v, implementation=impl, **extra, **common)
            out, lse = got if lse_wanted else (got, None)
            if lse is not None:
                np.testing.assert_allclose(lse, want_lse, **TOL, err_msg=f"{impl} {how} lse")
                assert (out[np.isneginf(want_lse)] == 0).all()  # empty rows: exactly 0
            if "dropout_p" not in opts:
                np.testing.assert_allclose(out, want_out, **TOL, err_msg=f"{impl} {how}")
            g = pullback((cot, cot_lse) if lse_wanted else cot)
            tables = g[-1].get("score_mod", ()) if isinstance(g[-1], dict) else ()
            grads[impl, how] = (out, *g[:3], *tables)
    ref = grads["composed", "dense"]
    for key, got in grads.items():
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            np.testing.assert_allclose(a, b, **TOL, err_msg=f"{key} entry {i}")


# -- deterministic checks -------------------------------------------------------------------
def _problem(seed=0, B=2, Hq=4, Hkv=2, L=19, S=23, E=4):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, E))
    return q, k, v, rng


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_table_gradients_match_finite_differences(small_tiles, impl) -> None:
    q, k, v, rng = _problem(L=12, S=12)
    ids = np.array([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    bm = flex.create_block_mask(flex.document_mask(ids, causal=True), 2, None, 12, 12,
                                block_size=(5, 3))  # fmt: skip
    opts = dict(enable_gqa=True, block_mask=bm, implementation=impl, return_lse=True)
    cot = (rng.standard_normal((2, 4, 12, 4)), rng.standard_normal((2, 4, 12)))
    t5 = rng.standard_normal((8, 4)) * 0.5
    swin = rng.standard_normal((7 * 5, 1)) * 0.5
    cases = (
        (t5, lambda t: flex.relative_position_bias(t, max_distance=10)),
        (swin, lambda t: flex.relative_position_bias_2d(t, (4, 3))),
    )
    for table, make in cases:
        _, pullback = aa.vjp(SDPA, q, k, v, score_mod=make(table), **opts)
        (dtable,) = pullback(cot)[-1]["score_mod"]
        assert dtable.shape == table.shape and dtable.dtype == table.dtype

        def f(t, make=make):
            return SDPA(q, k, v, score_mod=make(t), **opts)

        np.testing.assert_allclose(dtable, numerical_vjp(f, (table,), 0, cot), rtol=1e-6,
                                   atol=1e-8)  # fmt: skip


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bit_identical_run_to_run(small_tiles, impl) -> None:
    q, k, v, rng = _problem(1)
    ids = np.sort(rng.integers(0, 4, (2, 23)), axis=-1)
    mod = flex.or_masks(flex.document_mask(ids[:, :19], ids, causal=True),
                        flex.global_tokens_mask(2))  # fmt: skip
    bm = flex.create_block_mask(mod, 2, None, 19, 23, block_size=(4, 6))
    table = rng.standard_normal((32, 4))
    opts = dict(enable_gqa=True, block_mask=bm, implementation=impl, return_lse=True,
                dropout_p=0.3, seed=7, sinks=rng.standard_normal(4), softcap=3.0)  # fmt: skip
    cot = (rng.standard_normal((2, 4, 19, 4)), None)
    runs = []
    for _ in range(2):
        sm = flex.relative_position_bias(table)
        (out, lse), pullback = aa.vjp(SDPA, q, k, v, score_mod=sm, **opts)
        g = pullback(cot)
        runs.append((out, lse, *g[:3], *g[-1]["score_mod"], g[-1]["sinks"]))
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mask_mod_alone_and_attention_weights() -> None:
    """``mask_mod=`` without a block mask (built-ins get one, functions are evaluated
    on every tile) and ``attention_weights`` agree with the block mask and dense mask."""
    q, k, v, _ = _problem(2)
    mod = flex.and_masks(flex.causal(4), flex.sliding_window_mask(6, -1))
    bm = flex.create_block_mask(mod, None, None, 19, 23, block_size=5)
    dense = dense_mask(mod, 1, 1, 19, 23)
    want = SDPA(q, k, v, attn_mask=dense, enable_gqa=True)
    for impl in IMPLEMENTATIONS:
        for kw in ({"mask_mod": mod}, {"mask_mod": lambda *a: mod(*a)}, {"block_mask": bm},
                   {"block_mask": bm, "mask_mod": mod}):  # fmt: skip
            got = SDPA(q, k, v, enable_gqa=True, implementation=impl, **kw)
            np.testing.assert_allclose(got, want, **TOL)
    w = aa.attention_weights(
        q, k, enable_gqa=True, block_mask=bm, score_mod=flex.softcap_score_mod(2)
    )
    np.testing.assert_allclose(
        w, aa.attention_weights(q, k, enable_gqa=True, attn_mask=dense, softcap=2.0), **TOL
    )


def test_empty_rows_zero_output_and_sink_lse() -> None:
    """Query documents with no key: output 0, LSE -inf, or exactly the sink with one."""
    q, k, v, rng = _problem(3, L=8, S=8)
    qd = np.array([[0, 0, 1, 1, 2, 2, 2, 2]] * 2)
    kd = np.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    bm = flex.create_block_mask(flex.document_mask(qd, kd), 2, None, 8, 8, block_size=3)
    sinks = rng.standard_normal(4)
    for impl in IMPLEMENTATIONS:
        out, lse = SDPA(q, k, v, enable_gqa=True, block_mask=bm, return_lse=True,
                        implementation=impl)  # fmt: skip
        assert (out[:, :, 4:] == 0).all() and np.isneginf(lse[:, :, 4:]).all()
        assert np.isfinite(lse[:, :, :4]).all()
        out, lse = SDPA(q, k, v, enable_gqa=True, block_mask=bm, return_lse=True, sinks=sinks,
                        implementation=impl)  # fmt: skip
        assert (out[:, :, 4:] == 0).all()
        np.testing.assert_allclose(lse[:, :, 4:], np.broadcast_to(sinks[:, None], (2, 4, 4)))


def test_tile_of_full_and_empty_blocks_is_tested(monkeypatch) -> None:
    """A chunked tile whose visited blocks are all full but which also spans empty ones
    must test the mask_mod (it once attended the empty blocks' keys)."""
    monkeypatch.setattr(chunked, "BLOCK_Q", 3)
    monkeypatch.setattr(chunked, "BLOCK_K", 4)
    q, k, v, _ = _problem(9, B=1, Hq=1, Hkv=1, L=4, S=2)
    bm = flex.create_block_mask(flex.global_tokens_mask(1), None, None, 4, 2, block_size=1)
    assert bm.to_string() == "##\n#.\n#.\n#."
    dense = dense_mask(bm.mask_mod, 1, 1, 4, 2)
    want = reference(q, k, v, allowed=dense)
    for impl in IMPLEMENTATIONS:
        out, lse = SDPA(q, k, v, block_mask=bm, return_lse=True, implementation=impl)
        np.testing.assert_allclose(out, want[0], **TOL, err_msg=impl)
        np.testing.assert_allclose(lse, want[1], **TOL, err_msg=impl)


def test_plain_mask_mod_sees_only_the_calls_indices() -> None:
    """Ragged last blocks are evaluated without indices past L or S, so a plain function
    may index per-token arrays (FlexAttention's ``doc[q_idx] == doc[kv_idx]``)."""
    doc = np.repeat(np.arange(3), [4, 6, 3])  # 13 tokens, blocks of 5

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    got = flex.create_block_mask(same_doc, None, None, 13, 13, block_size=5)
    want = flex.create_block_mask(flex.document_mask(doc), None, None, 13, 13, block_size=5)
    np.testing.assert_array_equal(got.kinds, want.kinds)


# -- other array libraries ------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_other_libraries_match_numpy(backend, impl) -> None:
    """The block mask built with ``xp=`` the library (document ids and the T5 table in
    it), forward and pullback equal NumPy's."""
    if backend.name not in ("array_api_strict", "torch", "numpy"):
        # (JAX eagerly gives the same to 1e-15 but compiles each op once: ~10 s of CI.)
        pytest.skip("composed/chunked flex paths checked on NumPy, array-api-strict, torch")
    q, k, v, rng = _problem(4)
    ids = np.sort(rng.integers(0, 3, (2, 23)), axis=-1)
    table = rng.standard_normal((32, 4))
    cot = rng.standard_normal((2, 4, 19, 4))

    def run(xp, device, conv):
        mod = flex.and_masks(flex.document_mask(conv(ids[:, :19]), conv(ids)),
                             flex.causal(4))  # fmt: skip
        bm = flex.create_block_mask(mod, 2, None, 19, 23, block_size=(4, 5), xp=xp,
                                    device=device)  # fmt: skip
        sm = flex.relative_position_bias(conv(table))
        out, pullback = aa.vjp(SDPA, conv(q), conv(k), conv(v), block_mask=bm, score_mod=sm,
                               enable_gqa=True, implementation=impl)  # fmt: skip
        g = pullback(conv(cot))
        return out, *g[:3], *g[-1]["score_mod"]

    want = run(None, None, lambda a: a)
    got = run(backend.xp, backend.device, backend.asarray)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(backend.to_numpy(a), b, **TOL)


def test_block_mask_of_another_library_is_refused() -> None:
    torch = pytest.importorskip("torch")
    q, k, v, _ = _problem(5)
    bm = flex.create_block_mask(flex.causal_mask, None, None, 19, 23)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"library torch \(it was built for numpy"):
        SDPA(qt, kt, vt, block_mask=bm, enable_gqa=True)


# -- errors ---------------------------------------------------------------------------------
def test_mask_mod_errors() -> None:
    q, k, v, _ = _problem(6)

    def int_mask(b, h, q_idx, kv_idx):
        return kv_idx - q_idx

    def wrong_shape(b, h, q_idx, kv_idx):
        return np.ones((3,), bool)

    for call in (
        lambda: flex.create_block_mask(int_mask, None, None, 19, 23),
        lambda: SDPA(q, k, v, enable_gqa=True, mask_mod=int_mask),
    ):
        with pytest.raises(TypeError, match="mask_mod int_mask must return a boolean array"):
            call()
    for call in (
        lambda: flex.create_block_mask(wrong_shape, None, None, 19, 23),
        lambda: SDPA(q, k, v, enable_gqa=True, mask_mod=wrong_shape),
    ):
        with pytest.raises(ValueError, match=r"wrong_shape returned shape \(3,\)"):
            call()
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        flex.create_block_mask(3, None, None, 4, 4)


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((None, None, 19, 22), r"L = 19, S = 23 \(it has L = 19, S = 22\)"),
        ((None, None, 18, 23), r"L = 19, S = 23 \(it has L = 18, S = 23\)"),
        ((3, None, 19, 23), r"batch 2 \(it has B = 3"),
        ((None, 2, 19, 23), r"4 query heads \(it has H = 2"),
    ],
)
def test_block_mask_for_other_shapes_is_refused(shape, match) -> None:
    q, k, v, _ = _problem(7)
    bm = flex.create_block_mask(flex.causal_mask, *shape)
    with pytest.raises(ValueError, match=match):
        SDPA(q, k, v, enable_gqa=True, block_mask=bm)


def test_other_call_errors() -> None:
    q, k, v, _ = _problem(8)
    bm = flex.create_block_mask(flex.causal_mask, None, None, 19, 23)
    with pytest.raises(ValueError, match="mask_mod and block_mask were both given and differ"):
        SDPA(q, k, v, enable_gqa=True, block_mask=bm, mask_mod=flex.noop_mask)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        SDPA(q, k, v, enable_gqa=True, block_mask=np.ones((19, 23), bool))

    def bare(score, b, h, q_idx, kv_idx):
        return score * 2

    SDPA(q, k, v, enable_gqa=True, score_mod=bare)  # forward only: fine
    with pytest.raises(TypeError, match="score_mod bare has no derivative"):
        aa.vjp(SDPA, q, k, v, enable_gqa=True, score_mod=bare)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        SDPA(q, k, v, enable_gqa=True, score_mod=3)
    ids = np.zeros((2, 23), int)
    with pytest.raises(ValueError, match="depends on the batch or head axis"):
        flex.create_block_mask(flex.document_mask(ids), None, None, 23, 23)
    with pytest.raises(ValueError, match=r"document ids cover 23 queries and 23 keys"):
        flex.create_block_mask(flex.document_mask(ids), 2, None, 24, 23)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: flex.sliding_window_mask(-2), ValueError, "window bounds must be >= -1"),
        (lambda: flex.sliding_window_mask(1.5), TypeError, "left must be an int"),
        (lambda: flex.causal(True), TypeError, "offset must be an int"),
        (lambda: flex.global_tokens_mask(-1), ValueError, "num_global must be >= 0"),
        (lambda: flex.global_tokens_mask(2.0), TypeError, "num_global must be an int"),
        (lambda: flex.document_mask([0, 1]), TypeError, "document_ids must be an integer array"),
        (lambda: flex.document_mask(np.zeros(3)), TypeError, "integer dtype"),
        (lambda: flex.document_mask(np.zeros((1, 1, 3), int)), ValueError, r"\(B, N\) or"),
        (lambda: flex.document_mask(np.zeros(3, int), np.zeros(3)), TypeError, "kv_document_ids"),
        (lambda: flex.prefix_lm_mask(np.zeros((2, 2), int)), ValueError, "prefix_lengths"),
        (lambda: flex.and_masks(), ValueError, "and_masks needs at least one"),
        (lambda: flex.or_masks(flex.causal_mask, 3), TypeError, "mask_mod must be callable"),
        (lambda: flex.create_block_mask(flex.causal_mask, 0, None, 4, 4), ValueError, "B must"),
        (lambda: flex.create_block_mask(flex.causal_mask, None, 1.5, 4, 4), ValueError, "H must"),
        (lambda: flex.create_block_mask(flex.causal_mask, None, None, -1, 4), ValueError, "L must"),
        (
            lambda: flex.create_block_mask(flex.causal_mask, None, None, 4, 4, block_size=0),
            ValueError,
            "block_size must be >= 1",
        ),
        (
            lambda: flex.create_block_mask(
                flex.causal_mask, None, None, 4, 4, block_size=(1, 2, 3)
            ),
            ValueError,
            "block_size must be an int or a pair",
        ),
        (lambda: flex.relative_position_bias(np.zeros(5)), ValueError, "must be a 2-D array"),
        (
            lambda: flex.relative_position_bias(np.zeros((5, 2)), num_buckets=32),
            ValueError,
            "table has 5 buckets, num_buckets is 32",
        ),
        (
            lambda: flex.relative_position_bias_2d(np.zeros((9, 2)), (2, 3)),
            ValueError,
            r"\(2 Wh - 1\) \* \(2 Ww - 1\) = 15 rows",
        ),
        (lambda: flex.softcap_score_mod(0.0), ValueError, "softcap must be > 0"),
        (lambda: flex.ScoreMod(3), TypeError, "score_mod must be callable"),
        (
            lambda: flex.ScoreMod(lambda s, *a: s, params=(np.zeros((2, 2)),)),
            ValueError,
            "needs param_grads",
        ),
    ],
)
def test_builtin_argument_errors(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


# -- BlockMask ------------------------------------------------------------------------------
def _builtins(B, L, S):
    ids = np.repeat(np.arange(4), -(-max(L, S) // 4))[: max(L, S)]
    ids2 = np.stack([ids, np.sort(np.roll(ids, 3))])[:B]
    return [
        flex.causal_mask,
        flex.causal(S - L),
        flex.sliding_window_mask(7),
        flex.sliding_window_mask(3, 5, offset=-2),
        flex.sliding_window_mask(-1, 2),
        flex.document_mask(ids2[:, :L], ids2[:, :S]),
        flex.document_mask(ids2[:, :L], ids2[:, :S], causal=True),
        flex.prefix_lm_mask(np.array([5, 17])[:B]),
        flex.prefix_lm_mask(9),
        flex.global_tokens_mask(3),
        flex.noop_mask,
        flex.and_masks(flex.causal_mask, flex.sliding_window_mask(6)),
    ]


def _conservative(B, L, S):
    """Built-ins classified conservatively: a union full only through its parts together,
    an intersection empty only through its parts together, query/key documents that
    differ with causality, documents that are not contiguous runs."""
    qd = np.repeat(np.arange(5), 8)[:L]
    kd = np.repeat(np.arange(5), 9)[:S]
    return [
        flex.or_masks(flex.sliding_window_mask(4, 4), flex.global_tokens_mask(2)),
        flex.or_masks(flex.causal_mask, flex.prefix_lm_mask(3)),
        flex.and_masks(flex.prefix_lm_mask(4), flex.global_tokens_mask(20)),
        flex.document_mask(qd, kd, causal=True),
        flex.document_mask(np.array([0, 1] * 20)[:L], np.array([0, 1] * 21)[:S]),
    ]


@pytest.mark.parametrize(("L", "S", "block"), [(37, 37, 8), (30, 41, (7, 5)), (16, 9, 1)])
def test_builtin_kinds_equal_evaluation(L, S, block) -> None:
    """Classified from index ranges, the built-ins (self-attention documents, windows,
    prefixes, globals and their combinations) give exactly evaluation's kinds."""
    for mod in _builtins(2, L, S):
        got = flex.create_block_mask(mod, 2, None, L, S, block_size=block).kinds
        want = flex.create_block_mask(lambda *a, m=mod: m(*a), 2, 1, L, S, block_size=block)
        np.testing.assert_array_equal(np.broadcast_to(got, want.kinds.shape), want.kinds,
                                      err_msg=repr(mod))  # fmt: skip
    for mod in _conservative(2, L, S):
        _classification_is_sound(mod, 2, 1, L, S, block)


def test_accessors_and_picture() -> None:
    ids = np.array([0] * 3 + [1] * 5 + [2] * 4)
    bm = flex.create_block_mask(flex.document_mask(ids, causal=True), None, None, 12, 12,
                                block_size=2)  # fmt: skip
    assert bm.to_string() == "\n".join(["+.....", "++....", ".++...", ".+#+..", "....+.", "....#+"])
    assert bm.BLOCK_SIZE == (2, 2) and (bm.L, bm.S) == (12, 12)
    assert bm.kinds.shape == (1, 1, 6, 6)
    for kind, num, idx in (
        (PARTIAL, bm.kv_num_blocks, bm.kv_indices),
        (FULL, bm.full_kv_num_blocks, bm.full_kv_indices),
    ):
        assert num.shape == (1, 1, 6) and idx.shape == (1, 1, 6, 6)
        for i in range(6):
            n = int(num[0, 0, i])
            want = np.nonzero(bm.kinds[0, 0, i] == kind)[0]
            np.testing.assert_array_equal(idx[0, 0, i, :n], want)
    assert bm.sparsity() == pytest.approx(100 * np.mean(bm.kinds == EMPTY))
    assert "sparsity=" in str(bm) and bm.to_string() in str(bm)
    # Long masks: one character per k-th block.
    big = flex.create_block_mask(flex.causal_mask, None, None, 1024, 1024, block_size=8)
    lines = big.to_string(max_blocks=32).splitlines()
    assert len(lines) == 32 and all(len(x) == 32 for x in lines)
    assert lines[0] == "+" + "." * 31 and lines[-1] == "#" * 31 + "+"
