"""Torch oracles shared by the structured-attention tests (``tests/ops/test_flex_peers.py``,
``tests/bridges/torch/test_torch_flex.py``, ``tests/nn/test_mha_flex.py``): written once,
in plain eager torch, differentiable by PyTorch autograd. Import only where torch is
installed (the callers ``pytest.importorskip`` it first)."""

from __future__ import annotations

import math

import torch


def t5_bucket(rel: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's bidirectional relative-position bucket, as Hugging Face's
    ``T5Attention._relative_position_bucket`` writes it (``test_flex_peers.py`` checks
    arrayattn's against that function itself)."""
    n = num_buckets // 2
    buckets = (rel > 0).to(torch.long) * n
    rel = torch.abs(rel)
    exact = n // 2
    large = exact + (
        torch.log(rel.float() / exact) / math.log(max_distance / exact) * (n - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, n - 1))
    return buckets + torch.where(rel < exact, rel, large)


def dense_attention(q, k, v, mask_fn, score_fn):  # noqa: ANN001, ANN201
    """Dense eager attention ``(out, lse)`` on ``(B, H, L, E)`` tensors (GQA by repeating
    K/V heads): scores scaled by ``1/sqrt(E)``, then ``score_fn(s, b, h, q_idx, kv_idx)``,
    then ``mask_fn(b, h, q_idx, kv_idx)`` (FlexAttention's conventions; either may be
    ``None``). Empty rows give output 0 and LSE -inf with zero gradients."""
    Lq, Sk = q.shape[-2], k.shape[-2]
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    qi, ki = torch.arange(Lq).view(Lq, 1), torch.arange(Sk)
    if score_fn is not None:
        s = score_fn(s, b, h, qi, ki)
    if mask_fn is not None:
        s = torch.where(torch.broadcast_to(mask_fn(b, h, qi, ki), s.shape), s, -math.inf)
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    some = total > 0
    safe = torch.where(some, total, 1.0)
    return (e / safe) @ vv, torch.where(some, m + torch.log(safe), -math.inf)[..., 0]
