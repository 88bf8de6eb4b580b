"""Structured attention (``arrayattn.flex``) against PyTorch's own FlexAttention.

Every built-in mask_mod and score_mod is written a second time in torch, the way a
FlexAttention user writes it, and compared in float64 on the CPU:

- output and LSE against ``torch.nn.attention.flex_attention.flex_attention`` (eager; it
  has no backward on the CPU) with a block mask from torch's own ``create_block_mask``;
- gradients of q, k, v and a score_mod's table against torch autograd through a plain
  dense eager implementation of the same mask_mod/score_mod
  (``where(mask, score_mod(scores), -inf)``, softmax, ``@ v``);
- the block classification against torch's ``BlockMask`` counts (``kv_num_blocks`` +
  ``full_kv_num_blocks``).

Peers: T5's bucket is Hugging Face's ``T5Attention._relative_position_bucket``; Swin's
2-D bias is indexed by Swin's ``relative_position_index``; ``alibi_score_mod`` and
``softcap_score_mod`` are also compared with the ``alibi_slopes=`` / ``softcap=`` options.
Shapes: B = 2 with per-batch documents, GQA (4 query heads on 2 KV heads), L != S and
block sizes that divide neither.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import arrayattn as aa
from arrayattn import flex
from arrayattn.attention import chunked

torch = pytest.importorskip("torch")
fa = pytest.importorskip("torch.nn.attention.flex_attention")
from _torch_oracles import dense_attention  # noqa: E402

SDPA = aa.scaled_dot_product_attention
IMPLEMENTATIONS = ("composed", "chunked")
TOL = {"rtol": 1e-12, "atol": 1e-12}
B, HQ, HKV, E = 2, 4, 2, 8
BLOCK = 16


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Chunked tiles smaller than the block mask's blocks and not aligned with them."""
    monkeypatch.setattr(chunked, "BLOCK_Q", 7)
    monkeypatch.setattr(chunked, "BLOCK_K", 10)


# -- the peers ------------------------------------------------------------------------------
def torch_flex(q, k, v, mask_fn, score_fn, L, S, block=BLOCK, H=None):
    """``(out, lse)`` of torch's eager flex_attention with torch's create_block_mask."""
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    bm = None
    if mask_fn is not None:
        bm = fa.create_block_mask(mask_fn, q.shape[0], H, L, S, device="cpu", BLOCK_SIZE=block)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile"
        out, aux = fa.flex_attention(
            qt, kt, vt, score_mod=score_fn, block_mask=bm, enable_gqa=True,
            return_aux=fa.AuxRequest(lse=True),
        )  # fmt: skip
    return out.numpy(), aux.lse.numpy(), bm


def torch_eager(q, k, v, mask_fn, score_fn, table=None, cot=None, cot_lse=None):
    """Dense eager attention in torch with autograd: ``(out, lse, dq, dk, dv, dtable)``.
    Empty rows give output 0 and LSE -inf with zero gradients."""
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, lse = dense_attention(qt, kt, vt, mask_fn, score_fn)
    loss = (out * torch.from_numpy(cot)).sum()
    if cot_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.from_numpy(cot_lse)).sum()
    loss.backward()
    grads = [x.grad.numpy() for x in (qt, kt, vt)]
    grads.append(None if table is None else table.grad.numpy())
    return (out.detach().numpy(), lse.detach().numpy(), *grads)


def hf_t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(
        relative_position, bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance,
    )  # fmt: skip


def swin_relative_position_index(wh, ww):
    """Swin Transformer's ``relative_position_index`` (``WindowAttention.__init__``)."""
    coords_h, coords_w = torch.arange(wh), torch.arange(ww)
    coords = torch.stack(torch.meshgrid([coords_h, coords_w], indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += wh - 1
    relative_coords[:, :, 1] += ww - 1
    relative_coords[:, :, 0] *= 2 * ww - 1
    return relative_coords.sum(-1)


# -- mask cases: (ours, torch's) for shapes L, S ---------------------------------------------
def _docs(rng, n, bounds):
    """Per-batch contiguous document ids ``(B, n)`` cut at ``bounds[b]``."""
    ids = np.zeros((B, n), np.int64)
    for b, cuts in enumerate(bounds):
        for c in cuts:
            ids[b, c:] += 1
    return ids


def mask_case(name, L, S):
    if name == "causal":
        return flex.causal_mask, lambda b, h, q, kv: q >= kv
    if name == "causal_bottom_right":
        return flex.causal(S - L), lambda b, h, q, kv: kv <= q + (S - L)
    if name == "sliding_window":
        return flex.sliding_window_mask(5), lambda b, h, q, kv: (kv <= q) & (kv >= q - 5)
    if name == "window_two_sided_offset":
        m = flex.sliding_window_mask(3, 2, offset=4)
        return m, lambda b, h, q, kv: (kv >= q + 4 - 3) & (kv <= q + 4 + 2)
    if name in ("document", "document_causal"):
        ids = _docs(None, max(L, S), [(9, 30), (20, 21)])
        ids_t = torch.from_numpy(ids)
        causal = name == "document_causal"
        ours = flex.document_mask(ids[:, :L], ids[:, :S], causal=causal)

        def doc(b, h, q, kv):
            same = ids_t[b, q] == ids_t[b, kv]
            return same & (kv <= q) if causal else same

        return ours, doc
    if name in ("document_cross", "document_cross_causal"):
        # Query and key documents differ (packed cross-attention); document 7 of the
        # queries has no key at all: empty rows.
        qd = _docs(None, L, [(12, 25), (3,)])
        kd = _docs(None, S, [(20, 40), (30,)])
        qd[1, 30:] = 7
        qt, kt = torch.from_numpy(qd), torch.from_numpy(kd)
        causal = name.endswith("causal")
        ours = flex.document_mask(qd, kd, causal=causal)

        def cross(b, h, q, kv):
            same = qt[b, q] == kt[b, kv]
            return same & (kv <= q) if causal else same

        return ours, cross
    if name == "prefix_lm":
        p = np.array([11, 3])
        pt = torch.from_numpy(p)
        return flex.prefix_lm_mask(p), lambda b, h, q, kv: (kv < pt[b]) | (kv <= q)
    if name == "prefix_lm_int":
        return flex.prefix_lm_mask(20), lambda b, h, q, kv: (kv < 20) | (kv <= q)
    if name == "global_tokens":
        return flex.global_tokens_mask(3), lambda b, h, q, kv: (q < 3) | (kv < 3)
    if name == "window_or_global":
        ours = flex.or_masks(flex.sliding_window_mask(4, 4), flex.global_tokens_mask(2))
        return ours, lambda b, h, q, kv: ((kv >= q - 4) & (kv <= q + 4)) | (q < 2) | (kv < 2)
    if name == "causal_and_document_and_window":
        ids = _docs(None, max(L, S), [(17,), (5, 28)])
        ids_t = torch.from_numpy(ids)
        ours = flex.and_masks(
            flex.causal_mask, flex.document_mask(ids[:, :L], ids[:, :S]),
            flex.sliding_window_mask(8),
        )  # fmt: skip
        return ours, lambda b, h, q, kv: (q >= kv) & (ids_t[b, q] == ids_t[b, kv]) & (kv >= q - 8)
    if name == "noop":
        return flex.noop_mask, lambda b, h, q, kv: q >= 0
    if name == "per_head":  # a plain function depending on the head (evaluated)
        ours = lambda b, h, q, kv: (kv <= q + h) | (kv % 5 == 0)  # noqa: E731
        return ours, ours
    raise AssertionError(name)


MASKS = [
    "causal", "causal_bottom_right", "sliding_window", "window_two_sided_offset",
    "document", "document_causal", "document_cross", "document_cross_causal", "prefix_lm",
    "prefix_lm_int", "global_tokens", "window_or_global", "causal_and_document_and_window",
    "noop", "per_head",
]  # fmt: skip


def _inputs(L, S, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, HQ, L, E))
    k = rng.standard_normal((B, HKV, S, E))
    v = rng.standard_normal((B, HKV, S, E))
    return q, k, v, rng


def _check_against_peers(q, k, v, rng, ours_mask, t_mask, ours_score=None, t_score=None,
                         table=None, table_t=None, H=None, block=BLOCK, exact=True):  # fmt: skip
    L, S = q.shape[-2], k.shape[-2]
    want_out, want_lse, tbm = torch_flex(q, k, v, t_mask, t_score, L, S, block, H)
    cot = rng.standard_normal(want_out.shape)
    cot_lse = np.where(np.isfinite(want_lse), rng.standard_normal(want_lse.shape), 0.0)
    e_out, e_lse, *e_grads = torch_eager(q, k, v, t_mask, t_score, table_t, cot, cot_lse)
    np.testing.assert_allclose(e_out, want_out, **TOL)  # the two torch peers agree
    np.testing.assert_array_equal(np.isneginf(want_lse), np.isneginf(e_lse))
    bm = None
    if ours_mask is not None:
        bm = flex.create_block_mask(ours_mask, B, H, L, S, block_size=block)
        ours_nonempty = bm.kv_num_blocks + bm.full_kv_num_blocks
        theirs = (tbm.kv_num_blocks + tbm.full_kv_num_blocks).numpy()
        ours_nonempty = np.broadcast_to(ours_nonempty, theirs.shape)
        if exact:
            np.testing.assert_array_equal(ours_nonempty, theirs)
        else:  # a conservative classification: never fewer non-empty blocks
            assert (ours_nonempty >= theirs).all()
    for impl in IMPLEMENTATIONS:
        (out, lse), pullback = aa.vjp(
            SDPA, q, k, v, enable_gqa=True, block_mask=bm, score_mod=ours_score,
            return_lse=True, implementation=impl,
        )  # fmt: skip
        np.testing.assert_allclose(out, want_out, **TOL, err_msg=impl)
        np.testing.assert_allclose(lse, want_lse, **TOL, err_msg=impl)
        grads = pullback((cot, cot_lse))
        for i, name in enumerate("qkv"):
            np.testing.assert_allclose(grads[i], e_grads[i], **TOL, err_msg=f"{impl} d{name}")
        if table is not None:
            (dtable,) = grads[-1]["score_mod"]
            np.testing.assert_allclose(dtable, e_grads[3], **TOL, err_msg=f"{impl} dtable")
    return want_out, want_lse


@pytest.mark.parametrize("name", MASKS)
def test_mask_mods_match_flex_attention(name) -> None:
    L, S = (37, 45) if name != "document" and name != "document_causal" else (45, 45)
    q, k, v, rng = _inputs(L, S)
    ours, theirs = mask_case(name, L, S)
    # Causal document masks with query and key documents that differ are classified
    # conservatively (documents' id ranges, then causality): some empty blocks are
    # evaluated as partial ones.
    exact = name != "document_cross_causal"
    H = HQ if name == "per_head" else None
    _, lse = _check_against_peers(q, k, v, rng, ours, theirs, H=H, exact=exact)
    if name.startswith("document_cross"):
        assert np.isneginf(lse[1, :, 30:]).all()  # the query document with no keys


def test_t5_bias_with_document_mask_matches_hf_bucket_and_flex() -> None:
    L, S = 37, 45
    q, k, v, rng = _inputs(L, S, seed=1)
    table = rng.standard_normal((32, HQ))
    table_t = torch.tensor(table, requires_grad=True)

    def t5(score, b, h, q_idx, kv_idx):
        return score + table_t[hf_t5_bucket(kv_idx - q_idx, max_distance=20), h]

    # The bucket function itself: equal to Hugging Face's on every relative position.
    rp = np.arange(-300, 301)
    for bidirectional in (True, False):
        np.testing.assert_array_equal(
            flex.t5_relative_position_bucket(rp, bidirectional=bidirectional),
            hf_t5_bucket(torch.from_numpy(rp), bidirectional=bidirectional).numpy(),
        )
    ours_mask, t_mask = mask_case("document_causal", L, S)
    ours_score = flex.relative_position_bias(table, max_distance=20)
    _check_against_peers(q, k, v, rng, ours_mask, t_mask, ours_score, t5, table, table_t)


def test_t5_bias_shared_over_heads_unidirectional() -> None:
    L, S = 21, 50
    q, k, v, rng = _inputs(L, S, seed=2)
    table = rng.standard_normal((16, 1))
    table_t = torch.tensor(table, requires_grad=True)

    def t5(score, b, h, q_idx, kv_idx):
        bucket = hf_t5_bucket(kv_idx - q_idx, bidirectional=False, num_buckets=16)
        return score + table_t[bucket, 0]

    ours_score = flex.relative_position_bias(table, bidirectional=False)
    _check_against_peers(q, k, v, rng, None, None, ours_score, t5, table, table_t)


def test_swin_2d_bias_matches_relative_position_index() -> None:
    wh, ww = 5, 7
    N = wh * ww
    q, k, v, rng = _inputs(N, N, seed=3)
    table = rng.standard_normal(((2 * wh - 1) * (2 * ww - 1), HQ))
    table_t = torch.tensor(table, requires_grad=True)
    index = swin_relative_position_index(wh, ww)

    def swin(score, b, h, q_idx, kv_idx):
        return score + table_t[index[q_idx, kv_idx], h]

    # The dense bias Swin adds, (H, N, N), equals ours evaluated on the full index grid.
    bias_swin = table[index.reshape(-1).numpy()].reshape(N, N, HQ).transpose(2, 0, 1)
    sm = flex.relative_position_bias_2d(table, (wh, ww))
    ours_bias = sm(np.zeros((1, HQ, N, N)), 0, np.arange(HQ).reshape(HQ, 1, 1),
                   np.arange(N).reshape(N, 1), np.arange(N))  # fmt: skip
    np.testing.assert_array_equal(ours_bias[0], bias_swin)
    ours_mask, t_mask = mask_case("window_or_global", N, N)
    _check_against_peers(q, k, v, rng, ours_mask, t_mask, sm, swin, table, table_t)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_alibi_score_mod_equals_option_and_flex(align) -> None:
    L, S = 19, 33
    q, k, v, rng = _inputs(L, S, seed=4)
    slopes = rng.uniform(0.05, 1.0, HQ)
    off = 0 if align == "top_left" else S - L
    slopes_t = torch.from_numpy(slopes)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes_t[h] * (q_idx + off - kv_idx).abs()

    ours_mask, t_mask = (flex.causal(off), lambda b, h, qi, ki: ki <= qi + off)
    want_out, want_lse = _check_against_peers(
        q, k, v, rng, ours_mask, t_mask, flex.alibi_score_mod(slopes, offset=off), alibi
    )
    cot = rng.standard_normal(want_out.shape)
    for impl in IMPLEMENTATIONS:
        opts = dict(enable_gqa=True, is_causal=True, causal_align=align, implementation=impl)
        (out, lse), pb = aa.vjp(SDPA, q, k, v, alibi_slopes=slopes, return_lse=True, **opts)
        np.testing.assert_allclose(out, want_out, **TOL)
        np.testing.assert_allclose(lse, want_lse, **TOL)
        (out2, lse2), pb2 = aa.vjp(
            SDPA, q, k, v, score_mod=flex.alibi_score_mod(slopes, offset=off), return_lse=True,
            **opts,
        )  # fmt: skip
        for a, b in zip(pb((cot, None))[:3], pb2((cot, None))[:3], strict=True):
            np.testing.assert_allclose(a, b, **TOL)


def test_softcap_score_mod_equals_option_and_flex() -> None:
    L, S = 40, 24
    q, k, v, rng = _inputs(L, S, seed=5)
    q *= 4.0  # scores well past the cap

    def cap(score, b, h, q_idx, kv_idx):
        return 2.5 * torch.tanh(score / 2.5)

    ours_mask, t_mask = mask_case("prefix_lm", L, S)
    bm = flex.create_block_mask(ours_mask, B, None, L, S, block_size=(8, 5))
    want_out, want_lse = _check_against_peers(
        q, k, v, rng, ours_mask, t_mask, flex.softcap_score_mod(2.5), cap, block=BLOCK
    )
    cot = rng.standard_normal(want_out.shape)
    for impl in IMPLEMENTATIONS:
        opts = dict(enable_gqa=True, block_mask=bm, return_lse=True, implementation=impl)
        (out, lse), pb = aa.vjp(SDPA, q, k, v, softcap=2.5, **opts)
        np.testing.assert_allclose(out, want_out, **TOL)
        np.testing.assert_allclose(lse, want_lse, **TOL)
        (_, _), pb2 = aa.vjp(SDPA, q, k, v, score_mod=flex.softcap_score_mod(2.5), **opts)
        for a, b in zip(pb((cot, None))[:3], pb2((cot, None))[:3], strict=True):
            np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("name", ["causal", "document_causal", "window_or_global", "prefix_lm"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("n", [96, 100])
def test_block_counts_match_torch_block_mask(name, block, n) -> None:
    """Non-empty key blocks per query block equal torch's; full ones too away from the
    ragged last block (torch pads the last block with masked pairs, so it is never full
    there; we count only real pairs). Sparsity is the share of empty blocks, torch's
    number where the blocks divide the lengths (torch weighs blocks by their nominal
    size)."""
    L = S = n
    ours, theirs = mask_case(name, L, S)
    bm = flex.create_block_mask(ours, B, None, L, S, block_size=block)
    tbm = fa.create_block_mask(theirs, B, None, L, S, device="cpu", BLOCK_SIZE=block)
    got = np.broadcast_to(bm.kv_num_blocks + bm.full_kv_num_blocks, (B, 1, bm.kinds.shape[2]))
    np.testing.assert_array_equal(got, (tbm.kv_num_blocks + tbm.full_kv_num_blocks).numpy())
    assert bm.kinds.shape[-2:] == (math.ceil(L / block), math.ceil(S / block))
    # Full blocks torch finds are full for us too.
    nq = bm.kinds.shape[2]
    for b in range(B):
        for i in range(nq):
            nf = int(tbm.full_kv_num_blocks[b, 0, i])
            theirs_full = set(tbm.full_kv_indices[b, 0, i, :nf].tolist())
            ours_full = set(np.nonzero(bm.kinds[min(b, bm.kinds.shape[0] - 1), 0, i] == 2)[0])
            assert theirs_full <= ours_full
    nonempty = (tbm.kv_num_blocks + tbm.full_kv_num_blocks).sum().item()
    assert bm.sparsity() == pytest.approx(100 * (1 - nonempty / (B * nq * bm.kinds.shape[3])))
    if n % block == 0:
        assert bm.sparsity() == pytest.approx(tbm.sparsity())
