"""``block_mask=``, ``mask_mod=`` and ``score_mod=`` through ``arrayattn.torch``'s
autograd function (CPU, float64).

Oracles: PyTorch autograd through a plain dense eager attention with the same mask_mod
and score_mod written in torch (outputs, LSE and the gradients of q, k, v and the bias
table, 1e-12), and ``torch.nn.attention.flex_attention.flex_attention`` (eager; it has
no backward on the CPU) for the forward. Both sides a call can run on are covered:
NumPy views (a NumPy block mask) and the tensors themselves (``xp=torch`` masks, torch
document ids), and the errors for masks built for another library, device or shape.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from arrayattn import flex

torch = pytest.importorskip("torch")
fa = pytest.importorskip("torch.nn.attention.flex_attention")
from _torch_oracles import dense_attention as dense  # noqa: E402
from _torch_oracles import t5_bucket  # noqa: E402

import arrayattn.torch as aat  # noqa: E402
from arrayattn.torch import _flex  # noqa: E402

SDPA = aat.scaled_dot_product_attention
TOL = {"rtol": 1e-12, "atol": 1e-12}
B, HQ, HKV, E = 2, 4, 2, 8
L, S = 24, 40
BLOCK = 8


def _docs(n: int) -> np.ndarray:
    """Per-batch contiguous document ids ``(B, n)``."""
    ids = np.zeros((B, n), np.int64)
    for b, cuts in enumerate([(7, 19), (12,)]):
        for c in cuts:
            ids[b, c:] += 1
    return ids


IDS = _docs(S)
IDS_T = torch.from_numpy(IDS)


def inputs(seed: int = 0, Lq: int = L, Sk: int = S):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, HQ, Lq, E), (B, HKV, Sk, E), (B, HKV, Sk, E))
    return [torch.randn(s, dtype=torch.float64, generator=g, requires_grad=True) for s in shapes]


def grads_of(out, lse, leaves, cot, cot_lse):
    loss = (out * cot).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * cot_lse).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def doc_causal_t(b, h, q, kv):
    return (IDS_T[b, q] == IDS_T[b, kv]) & (kv <= q + (S - L))


# (block_mask or None, mask_mod for the call, torch mask_fn for the peers, side)
def mask_cases():
    doc_np = flex.and_masks(flex.document_mask(IDS[:, :L], IDS), flex.causal(S - L))
    doc_t = flex.and_masks(flex.document_mask(IDS_T[:, :L], IDS_T), flex.causal(S - L))
    per_head = lambda b, h, q, kv: (kv <= q + h) | (kv % 5 == 0)  # noqa: E731

    def shifted(b, h, q, kv):  # a doc mask written FlexAttention's way, on torch ids
        return IDS_T[b, q] == IDS_T[b, kv]

    return {
        "numpy_block_mask": (
            flex.create_block_mask(doc_np, B, None, L, S, block_size=BLOCK), None,
            lambda b, h, q, kv: (IDS_T[:, :L][b, q] == IDS_T[b, kv]) & (kv <= q + S - L),
        ),
        "torch_block_mask": (
            flex.create_block_mask(doc_t, B, None, L, S, block_size=BLOCK, xp=torch,
                                   device="cpu"), None,
            lambda b, h, q, kv: (IDS_T[:, :L][b, q] == IDS_T[b, kv]) & (kv <= q + S - L),
        ),
        "torch_ids_mask_mod_alone": (None, doc_t,
            lambda b, h, q, kv: (IDS_T[:, :L][b, q] == IDS_T[b, kv]) & (kv <= q + S - L)),
        "plain_function_per_head": (None, per_head, per_head),
        "plain_function_torch_global": (
            flex.create_block_mask(shifted, B, None, L, S, block_size=BLOCK, xp=torch),
            shifted, shifted,
        ),
        "causal_builtin": (None, flex.causal_mask, lambda b, h, q, kv: kv <= q),
    }  # fmt: skip


CASES = list(mask_cases())


@pytest.mark.parametrize("case", CASES)
def test_masks_and_t5_table_match_dense_autograd_and_flex_attention(case) -> None:
    bm, mod, mask_fn = mask_cases()[case]
    q, k, v = inputs(1)
    g = torch.Generator().manual_seed(2)
    table = torch.randn(32, HQ, dtype=torch.float64, generator=g, requires_grad=True)
    ref_table = table.detach().clone().requires_grad_(True)

    def t5(score, b, h, qi, ki):
        return score + ref_table[t5_bucket(ki - qi, max_distance=20), h]

    ours_score = flex.relative_position_bias(table, max_distance=20)
    out, lse = SDPA(q, k, v, enable_gqa=True, block_mask=bm, mask_mod=mod,
                    score_mod=ours_score, return_lse=True)  # fmt: skip
    assert out.grad_fn is not None and out.grad_fn.name() == "AttentionFunctionBackward"
    rq, rk, rv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    want_out, want_lse = dense(rq, rk, rv, mask_fn, t5)
    np.testing.assert_allclose(out.detach(), want_out.detach(), **TOL)
    np.testing.assert_allclose(lse.detach(), want_lse.detach(), **TOL)
    cot = torch.randn(out.shape, dtype=torch.float64, generator=g)
    cot_lse = torch.where(torch.isfinite(want_lse), torch.randn(lse.shape, generator=g,
                          dtype=torch.float64), 0.0)  # fmt: skip
    got = grads_of(out, lse, (q, k, v, table), cot, cot_lse)
    want = grads_of(want_out, want_lse, (rq, rk, rv, ref_table), cot, cot_lse)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), got, want, strict=True):
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)
    # PyTorch's own flex_attention, forward (eager, CPU).
    tbm = fa.create_block_mask(mask_fn, B, HQ, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile"
        f_out, aux = fa.flex_attention(
            q.detach(), k.detach(), v.detach(), score_mod=t5, block_mask=tbm, enable_gqa=True,
            return_aux=fa.AuxRequest(lse=True),
        )  # fmt: skip
    np.testing.assert_allclose(out.detach(), f_out, **TOL)
    np.testing.assert_allclose(lse.detach(), aux.lse, **TOL)


def test_the_side_a_call_runs_on() -> None:
    """NumPy views for NumPy masks, the tensors for torch ones; the score_mod over the
    arrays of that side."""
    q = torch.ones(B, HQ, L, E, dtype=torch.float64)
    table = torch.zeros(32, HQ, dtype=torch.float64, requires_grad=True)
    sm = flex.relative_position_bias(table)
    bm_np = flex.create_block_mask(flex.causal_mask, None, None, L, S)
    bm_t = flex.create_block_mask(flex.causal_mask, None, None, L, S, xp=torch)
    assert _flex.prepare_flex(q, bm_np, None, sm).numpy is True
    assert _flex.prepare_flex(q, bm_t, None, sm).numpy is False
    assert _flex.prepare_flex(q, None, flex.document_mask(IDS_T), None).numpy is False
    assert _flex.prepare_flex(q, None, flex.document_mask(IDS), None).numpy is True
    assert _flex.prepare_flex(q, None, None, None) is None
    flex_np = _flex.prepare_flex(q, bm_np, None, sm)
    views = flex_np.backend_score_mod(_flex.Arrays(q))
    assert isinstance(views.params[0], np.ndarray)
    assert np.shares_memory(views.params[0], table.detach().numpy())
    # A user ScoreMod holding its torch table without rebuild= runs on the tensors.
    ts = torch.zeros(HQ, dtype=torch.float64, requires_grad=True)
    own = flex.ScoreMod(lambda s, b, h, qi, ki: s + ts[h], params=(ts,),
                        param_grads=lambda ds, b, h, qi, ki: (ds,))  # fmt: skip
    assert _flex.prepare_flex(q, None, None, own).numpy is False


def test_own_score_mod_without_rebuild_gets_its_gradient() -> None:
    q, k, v = inputs(3)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(HQ, dtype=torch.float64, generator=g, requires_grad=True)
    ref = bias.detach().clone().requires_grad_(True)

    def pg(ds, b, h, qi, ki):  # ds in the path's layout; h broadcasts to it
        idx = torch.broadcast_to(torch.as_tensor(h), ds.shape).reshape(-1)
        return (torch.zeros(HQ, dtype=ds.dtype).index_add_(0, idx, ds.reshape(-1)),)

    own = flex.ScoreMod(lambda s, b, h, qi, ki: s + bias[h], params=(bias,), param_grads=pg)
    out = SDPA(q, k, v, enable_gqa=True, is_causal=True, score_mod=own, implementation="composed")
    want, _ = dense(*(x.detach().clone().requires_grad_(True) for x in (q, k, v)),
                    lambda b, h, qi, ki: ki <= qi, lambda s, b, h, qi, ki: s + ref[h])  # fmt: skip
    np.testing.assert_allclose(out.detach(), want.detach(), **TOL)
    out.sum().backward()
    want.sum().backward()
    np.testing.assert_allclose(bias.grad, ref.grad, **TOL)


def test_no_grad_and_constant_table() -> None:
    q, k, v = (x.detach() for x in inputs(5))
    table = torch.zeros(32, HQ, dtype=torch.float64)
    bm = flex.create_block_mask(flex.causal(S - L), None, None, L, S, block_size=BLOCK)
    out = SDPA(
        q, k, v, enable_gqa=True, block_mask=bm, score_mod=flex.relative_position_bias(table)
    )
    ref = SDPA(q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right")
    assert out.grad_fn is None
    np.testing.assert_allclose(out, ref, **TOL)
    # Only q requires grad: the table gets none, q does.
    qg = q.clone().requires_grad_(True)
    SDPA(qg, k, v, enable_gqa=True, block_mask=bm,
         score_mod=flex.relative_position_bias(table)).sum().backward()  # fmt: skip
    assert qg.grad is not None and table.grad is None


# -- errors ---------------------------------------------------------------------------------
def test_errors_name_the_argument_and_what_is_expected() -> None:
    q, k, v = (x.detach() for x in inputs(6))
    bm = flex.create_block_mask(flex.causal_mask, None, None, L, S)
    other = dataclasses.replace(bm, library="cupy")
    with pytest.raises(ValueError, match=r"block_mask was built for cupy.*xp=torch"):
        SDPA(q, k, v, enable_gqa=True, block_mask=other)
    with pytest.raises(ValueError, match=r"block_mask was built for other calls.*L = 24, S = 40"):
        SDPA(q, k, v, enable_gqa=True,
             block_mask=flex.create_block_mask(flex.causal_mask, None, None, L, L))  # fmt: skip
    with pytest.raises(ValueError, match=r"batch 2 \(it has B = 3"):
        SDPA(q, k, v, enable_gqa=True,
             block_mask=flex.create_block_mask(flex.causal_mask, 3, None, L, S))  # fmt: skip
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        SDPA(q, k, v, enable_gqa=True, block_mask="causal")
    # NumPy masks run float16/32/64 CPU tensors; bfloat16 runs on the tensors.
    with pytest.raises(ValueError, match=r"built for numpy.*torch.bfloat16.*xp=torch"):
        SDPA(q.bfloat16(), k.bfloat16(), v.bfloat16(), enable_gqa=True, block_mask=bm)
    bm_t = flex.create_block_mask(flex.causal_mask, None, None, L, S, xp=torch, device="cpu")
    out = SDPA(q.bfloat16(), k.bfloat16(), v.bfloat16(), enable_gqa=True, block_mask=bm_t)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"built for device meta but query is on device cpu"):
        SDPA(q, k, v, enable_gqa=True, block_mask=dataclasses.replace(bm_t, device="meta"))
    # Two libraries at once.
    with pytest.raises(TypeError, match=r"need two libraries.*built for numpy.*holds torch"):
        SDPA(q, k, v, enable_gqa=True, block_mask=bm, score_mod=flex.alibi_score_mod(
            torch.ones(HQ, dtype=torch.float64)))  # fmt: skip
    # A NumPy block mask whose mask_mod holds torch ids (classified from their NumPy copy).
    torch_ids = flex.create_block_mask(flex.document_mask(IDS_T[:, :L], IDS_T), B, None, L, S)
    with pytest.raises(TypeError, match=r"built for numpy, but block_mask's mask_mod .* torch"):
        SDPA(q, k, v, enable_gqa=True, block_mask=torch_ids)
    # Params: torch tensors on query's device.
    with pytest.raises(TypeError, match=r"params\[0\] must be a torch.Tensor.*numpy.ndarray"):
        SDPA(q, k, v, enable_gqa=True, score_mod=flex.relative_position_bias(np.zeros((32, HQ))))
    with pytest.raises(TypeError, match=r"params\[0\] is on device meta"):
        SDPA(q, k, v, enable_gqa=True, score_mod=flex.relative_position_bias(
            torch.zeros(32, HQ, device="meta")))  # fmt: skip
    # A table of the wrong head count.
    with pytest.raises(ValueError, match=r"table has 3 heads.*Hq = 4"):
        SDPA(
            q,
            k,
            v,
            enable_gqa=True,
            score_mod=flex.relative_position_bias(torch.zeros(32, 3, dtype=torch.float64)),
        )
    # A bare function runs forward, not backward.
    bare = lambda s, b, h, qi, ki: s * 2  # noqa: E731
    assert SDPA(q, k, v, enable_gqa=True, score_mod=bare).shape == (B, HQ, L, E)
    with pytest.raises(TypeError, match="has no derivative.*ScoreMod"):
        SDPA(q.requires_grad_(True), k, v, enable_gqa=True, score_mod=bare)
    with pytest.raises(ValueError, match="mask_mod and block_mask were both given and differ"):
        SDPA(q, k, v, enable_gqa=True, block_mask=bm, mask_mod=flex.noop_mask)
