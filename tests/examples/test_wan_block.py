"""examples/wan_block.py against a float64 torch transcription of Wan2.1's attention
block (``wan/modules/model.py``: ``sinusoidal_embedding_1d``, ``rope_params``,
``rope_apply``, ``WanRMSNorm``, ``WanLayerNorm``, ``WanSelfAttention``,
``WanT2VCrossAttention``, ``WanI2VCrossAttention``, ``WanAttentionBlock`` and the
model's time embedding), written out below: forward, and gradients of the inputs and of
every parameter (torch autograd)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import xp_assert_close
from _scripts import load_script


def _load_example():
    return load_script("examples/wan_block.py")


wan = _load_example()


def _torch_wan(torch, dim, ffn_dim, num_heads, freq_dim, text_len, eps=1e-6, i2v=True):
    """Wan2.1's block + time embedding; float64 here (its casts to float32 become casts to
    the model's dtype; the bf16/fp16 parameter casts of some copies are dropped)."""
    nn = torch.nn

    def sinusoidal_embedding_1d(d, position):
        half = d // 2
        position = position.type(torch.float64)
        sinusoid = torch.outer(
            position, torch.pow(10000, -torch.arange(half).to(position).div(half))
        )
        return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)

    def rope_params(max_seq_len, d, theta=10000):
        freqs = torch.outer(
            torch.arange(max_seq_len),
            1.0 / torch.pow(theta, torch.arange(0, d, 2).to(torch.float64).div(d)),
        )
        return torch.polar(torch.ones_like(freqs), freqs)

    def rope_apply(x, grid_sizes, freqs):
        n, c = x.size(2), x.size(3) // 2
        freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
        output = []
        for i, (f, h, w) in enumerate(grid_sizes):
            seq_len = f * h * w
            x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
            freqs_i = torch.cat(
                [
                    freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                    freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                    freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
                ],
                dim=-1,
            ).reshape(seq_len, 1, -1)
            x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
            output.append(torch.cat([x_i, x[i, seq_len:]]))
        return torch.stack(output).to(x.dtype)  # Wan2.1: .float(); a no-op in float64

    def attention(q, k, v, k_lens=None):  # (B, L, N, d) -> (B, L, N, d); Wan's k_lens
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if k_lens is not None:  # keys past each sample's length take no part
            keep = torch.arange(k.shape[2])[None, :] < torch.as_tensor(k_lens)[:, None]
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * self.weight

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)

        def forward(self, x, seq_lens, grid_sizes, freqs):
            b, s, n, d = *x.shape[:2], num_heads, dim // num_heads
            q = self.norm_q(self.q(x)).view(b, s, n, d)
            k = self.norm_k(self.k(x)).view(b, s, n, d)
            v = self.v(x).view(b, s, n, d)
            x = attention(
                rope_apply(q, grid_sizes, freqs), rope_apply(k, grid_sizes, freqs), v, seq_lens
            )
            return self.o(x.flatten(2))

    class T2VCrossAttention(SelfAttention):
        def forward(self, x, context):
            b, n, d = x.size(0), num_heads, dim // num_heads
            q = self.norm_q(self.q(x)).view(b, -1, n, d)
            k = self.norm_k(self.k(context)).view(b, -1, n, d)
            v = self.v(context).view(b, -1, n, d)
            return self.o(attention(q, k, v).flatten(2))

    class I2VCrossAttention(SelfAttention):
        def __init__(self):
            super().__init__()
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim)

        def forward(self, x, context):
            image_context_length = context.shape[1] - text_len
            context_img = context[:, :image_context_length]
            context = context[:, image_context_length:]
            b, n, d = x.size(0), num_heads, dim // num_heads
            q = self.norm_q(self.q(x)).view(b, -1, n, d)
            k = self.norm_k(self.k(context)).view(b, -1, n, d)
            v = self.v(context).view(b, -1, n, d)
            k_img = self.norm_k_img(self.k_img(context_img)).view(b, -1, n, d)
            v_img = self.v_img(context_img).view(b, -1, n, d)
            img_x = attention(q, k_img, v_img).flatten(2)
            x = attention(q, k, v).flatten(2)
            return self.o(x + img_x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.time_embedding = nn.Sequential(
                nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)
            )
            self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
            self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
            self.self_attn = SelfAttention()
            self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
            self.cross_attn = I2VCrossAttention() if i2v else T2VCrossAttention()
            self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
            self.ffn = nn.Sequential(
                nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim)
            )
            self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
            d = dim // num_heads
            self.freqs = torch.cat(
                [
                    rope_params(1024, d - 4 * (d // 6)),
                    rope_params(1024, 2 * (d // 6)),
                    rope_params(1024, 2 * (d // 6)),
                ],
                dim=1,
            )

        def forward(self, x, t, context, grid_sizes, seq_lens=None):
            # Wan2.1: .float() on the float64 embedding; the model's dtype here
            e = self.time_embedding(sinusoidal_embedding_1d(freq_dim, t).to(x.dtype))
            e0 = self.time_projection(e).unflatten(1, (6, dim))
            e = (self.modulation + e0).chunk(6, dim=1)
            y = self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], seq_lens, grid_sizes, self.freqs)
            x = x + y * e[2]
            x = x + self.cross_attn(self.norm3(x), context)
            y = self.ffn(self.norm2(x) * (1 + e[4]) + e[3])
            return x + y * e[5]

    return Block().double()


@pytest.mark.parametrize(
    "dim, heads, grid, text_len, image_len",
    [(48, 4, (2, 2, 3), 5, 3), (36, 3, (1, 3, 2), 4, 2), (24, 2, (2, 1, 2), 3, 0)],
    ids=["i2v-48", "i2v-36", "t2v-24"],
)
def test_block_equals_wan_forward_and_gradients(dim, heads, grid, text_len, image_len):
    torch = pytest.importorskip("torch")
    i2v = image_len > 0
    block = wan.WanBlock(dim=dim, ffn_dim=2 * dim, num_heads=heads, freq_dim=16, image_context=i2v)
    params = block.init(seed=3, xp=np, dtype=np.float64)
    x, t, ctx, img = wan.random_inputs(
        block, grid, text_len=text_len, image_len=image_len, xp=np, dtype=np.float64
    )
    ref = _torch_wan(torch, dim, 2 * dim, heads, 16, text_len, i2v=i2v)
    # the example's names are Wan2.1's: the state dict loads strictly
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=True)
    tx, tctx = (torch.from_numpy(a).requires_grad_() for a in (x, ctx))
    timg = torch.from_numpy(img).requires_grad_() if i2v else None
    context = torch.cat([timg, tctx], dim=1) if i2v else tctx
    expected = ref(tx, torch.from_numpy(t), context, [grid] * x.shape[0])

    out, pullback = block.vjp(params, x, t, ctx, img, grid)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-10, atol=1e-10)

    cot = np.random.default_rng(4).standard_normal(out.shape)
    expected.backward(torch.from_numpy(cot))
    dx, dctx, dimg, dparams = pullback(cot)
    pairs = [(dx, tx, "x"), (dctx, tctx, "context")] + ([(dimg, timg, "img")] if i2v else [])
    for got, want, name in pairs:
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-9, atol=1e-9, err_msg=name)
    assert i2v or dimg is None
    named = dict(ref.named_parameters())
    assert set(dparams) == set(named)
    for name, g in dparams.items():
        np.testing.assert_allclose(
            g, named[name].grad.numpy(), rtol=1e-9, atol=1e-9, err_msg=f"d {name}"
        )


def test_per_sample_grids_with_padding_equal_wan():
    """Samples of different (F, H, W) padded to one length, as WanModel pads to seq_len:
    padding keys masked in self-attention (Wan's k_lens=seq_lens), padding rows
    unrotated (rope_apply passes them through)."""
    torch = pytest.importorskip("torch")
    grids = [(2, 2, 3), (1, 3, 2), (2, 2, 2)]
    block = wan.WanBlock(dim=24, ffn_dim=40, num_heads=2, freq_dim=8)
    params = block.init(seed=5, xp=np, dtype=np.float64)
    x, t, ctx, img = wan.random_inputs(block, grids, batch=3, xp=np, dtype=np.float64)
    assert x.shape[1] == 12
    ref = _torch_wan(torch, 24, 40, 2, 8, ctx.shape[1])
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=True)
    tx = torch.from_numpy(x).requires_grad_()
    seq_lens = [int(np.prod(g)) for g in grids]
    context = torch.cat([torch.from_numpy(img), torch.from_numpy(ctx)], dim=1)
    expected = ref(tx, torch.from_numpy(t), context, grids, seq_lens)
    out, pullback = block.vjp(params, x, t, ctx, img, grids)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-10, atol=1e-10)
    cot = np.random.default_rng(6).standard_normal(out.shape)
    expected.backward(torch.from_numpy(cot))
    dx, _, _, dparams = pullback(cot)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-9)
    named = dict(ref.named_parameters())
    for name, g in dparams.items():
        np.testing.assert_allclose(g, named[name].grad.numpy(), rtol=1e-9, atol=1e-9, err_msg=name)


def test_block_on_backend(backend):
    """The block is array-API code: every backend gives NumPy's forward and gradients
    (the example's own choices are NumPy and CuPy)."""
    if backend.name in ("jax", "dask"):
        # eager JAX compiles every op per shape; Dask builds a graph of the whole block
        # (12 s here): the ops themselves are tested on both.
        pytest.skip(f"{backend.name}: too slow for a whole block")
    xp = backend.xp
    block = wan.WanBlock(dim=24, ffn_dim=32, num_heads=2, freq_dim=8, cross_attn_norm=False)
    grid = [(1, 2, 2), (1, 1, 3)]  # per-sample grids: padding, kv_lengths, built with xp
    params = block.init(seed=0, xp=np, dtype=np.float64)
    inputs = wan.random_inputs(block, grid, text_len=3, image_len=2, xp=np, dtype=np.float64)
    out, pullback = block.vjp(params, *inputs, grid)
    cot = np.random.default_rng(1).standard_normal(out.shape)
    grads = pullback(cot)
    b_params = {k: backend.asarray(v) for k, v in params.items()}
    b_inputs = [backend.asarray(a) for a in inputs]
    b_out, b_pullback = block.vjp(b_params, *b_inputs, grid)
    xp_assert_close(backend, b_out, out, dtype="float64", rtol=1e-10, atol=1e-10)
    b_grads = b_pullback(xp.asarray(backend.asarray(cot)))
    for g_b, g in zip(b_grads[:3], grads[:3], strict=True):
        xp_assert_close(backend, g_b, g, rtol=1e-9, atol=1e-9)
    for name, g in grads[3].items():
        xp_assert_close(backend, b_grads[3][name], g, rtol=1e-9, atol=1e-9, err_msg=name)


def test_script_runs_with_its_check(capsys):
    for extra in ([], ["--t2v"]):
        wan.main(["--dim", "24", "--heads", "2", "--frames", "1", "--height", "2", "--width",
                  "3", "--repeat", "1", "--check"] + extra)  # fmt: skip
        text = capsys.readouterr().out
        assert "finite-difference check" in text and "run 0" in text


def test_errors():
    with pytest.raises(ValueError, match="num_heads"):
        wan.WanBlock(dim=10, num_heads=3)
    block = wan.WanBlock(dim=24, ffn_dim=32, num_heads=2, freq_dim=8)
    params = block.init(seed=0, xp=np)
    x, t, ctx, img = wan.random_inputs(block, (1, 2, 2), xp=np)
    with pytest.raises(ValueError, match="grid"):
        block(params, x, t, ctx, img, (1, 2, 3))
    with pytest.raises(ValueError, match="grid"):
        block(params, x, t, ctx, img, [(1, 2, 2)] * 3)  # batch of 2
    with pytest.raises(ValueError, match="grid"):
        block(params, x, t, ctx, img, [(1, 2, 2), (1, 1, 5)])  # 5 tokens > 4
    with pytest.raises(ValueError, match="context_img"):
        block(params, x, t, ctx, None, (1, 2, 2))
