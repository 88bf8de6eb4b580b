"""``MultiHeadAttention`` with ``block_mask=``, ``mask_mod=`` and ``score_mod=``
(float64, NumPy).

Oracle: the same layer written in torch (projections, heads, GQA, a dense eager
attention with the same document mask and T5 bias, the output projection),
differentiated by PyTorch autograd: the output and the cotangents of ``x``, of every
parameter and of the bias table, 1e-12. Also: the weights with ``need_weights``, lengths
ANDed with the mask, and the combinations the layer refuses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import flex
from arrayattn.nn import MultiHeadAttention

torch = pytest.importorskip("torch")
from _torch_oracles import t5_bucket  # noqa: E402

TOL = {"rtol": 1e-12, "atol": 1e-12}
B, L, EMBED, HQ, HKV = 2, 14, 16, 4, 2
IDS = np.repeat([[0, 1, 2], [0, 0, 1]], [4, 6, 4], axis=1)  # (B, L) packed documents


def torch_layer(p, x, table, causal):
    """The layer in torch: ``y``, with the document mask (ANDed with bottom-right causal,
    = top-left for L = S) and the T5 bias."""
    D = EMBED // HQ

    def heads(t, h):
        return t.view(B, L, h, D).transpose(1, 2)

    q = heads(x @ p["q_proj.weight"].T, HQ)
    k = heads(x @ p["k_proj.weight"].T, HKV).repeat_interleave(HQ // HKV, 1)
    v = heads(x @ p["v_proj.weight"].T, HKV).repeat_interleave(HQ // HKV, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    qi, ki = torch.arange(L).view(L, 1), torch.arange(L)
    s = s + table[t5_bucket(ki - qi, max_distance=20)].permute(2, 0, 1)
    ids = torch.from_numpy(IDS)
    keep = ids[:, :, None] == ids[:, None, :]
    if causal:
        keep = keep & (ki <= qi)
    s = torch.where(keep[:, None], s, -math.inf)
    o = torch.softmax(s, dim=-1) @ v
    return o.transpose(1, 2).reshape(B, L, EMBED) @ p["o_proj.weight"].T


@pytest.mark.parametrize("given", ["block_mask", "mask_mod"])
def test_forward_and_vjp_match_torch_autograd(given) -> None:
    causal = given == "block_mask"
    mha = MultiHeadAttention(EMBED, HQ, num_kv_heads=HKV, bias=False, causal=causal)
    params = mha.init(seed=0, xp=np, dtype=np.float64)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, EMBED))
    table = rng.standard_normal((32, HQ))
    mod = flex.document_mask(IDS)
    opts = {"mask_mod": mod}
    if given == "block_mask":
        opts = {"block_mask": flex.create_block_mask(mod, B, None, L, L, block_size=4)}
    sm = flex.relative_position_bias(table, max_distance=20)
    y, pullback = mha.vjp(params, x, score_mod=sm, **opts)
    np.testing.assert_allclose(mha(params, x, score_mod=sm, **opts), y, **TOL)
    d_y = rng.standard_normal(y.shape)
    g = pullback(d_y)

    pt = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    xt = torch.tensor(x, requires_grad=True)
    tt = torch.tensor(table, requires_grad=True)
    yt = torch_layer(pt, xt, tt, causal)
    np.testing.assert_allclose(y, yt.detach(), **TOL)
    (yt * torch.from_numpy(d_y)).sum().backward()
    np.testing.assert_allclose(g.x, xt.grad, **TOL)
    for name, a in g.params.items():
        np.testing.assert_allclose(a, pt[name].grad, **TOL, err_msg=name)
    assert g.score_mod is not None and len(g.score_mod) == 1
    np.testing.assert_allclose(g.score_mod[0], tt.grad, **TOL)


def test_weights_lengths_and_refusals() -> None:
    mha = MultiHeadAttention(EMBED, HQ, num_kv_heads=HKV, bias=False)
    params = mha.init(seed=2, xp=np, dtype=np.float64)
    x = np.random.default_rng(3).standard_normal((B, L, EMBED))
    mod = flex.document_mask(IDS)
    y, w = mha(params, x, mask_mod=mod, need_weights=True, average_attn_weights=False)
    same = IDS[:, :, None] == IDS[:, None, :]
    assert w.shape == (B, HQ, L, L)
    assert (w[:, :, ~same[0]][0] == 0).all() and np.allclose(w.sum(-1), 1.0)
    # The mask_mod equals the same dense bool mask; lengths AND with it.
    dense = mha(params, x, attn_mask=same[:, None], lengths=[L, 9])
    np.testing.assert_allclose(mha(params, x, mask_mod=mod, lengths=[L, 9]), dense, **TOL)
    # Without a score_mod, the cotangents carry none.
    _, pullback = mha.vjp(params, x, mask_mod=mod)
    assert pullback(np.ones_like(y)).score_mod is None
    with pytest.raises(ValueError, match="mask_mod with a cache is not supported"):
        mha(params, x, mask_mod=mod, cache=mha.new_cache(B, 32, dtype=np.float64))
    with pytest.raises(ValueError, match='block_mask with padding_side="left"'):
        bm = flex.create_block_mask(mod, B, None, L, L)
        mha(params, x, block_mask=bm, lengths=[L, 9], padding_side="left")
    with pytest.raises(ValueError, match=r"block_mask was built for other calls.*L = 14"):
        mha(params, x, block_mask=flex.create_block_mask(mod, B, None, 7, 7))
    with pytest.raises(ValueError, match=r"table has 2 heads.*Hq = 4"):
        mha(params, x, score_mod=flex.relative_position_bias(np.zeros((32, 2))))
