"""A Wan2.1 diffusion-transformer block on arrayattn, forward and hand-written backward.

The block of Wan2.1's ``WanModel`` (``wan/modules/model.py``) with the timestep embedding
that drives it, written with arrayattn ops only:

- timestep: ``sinusoidal_embedding`` (Wan2.1's ``sinusoidal_embedding_1d``) -> Linear ->
  SiLU -> Linear (``time_embedding``) -> SiLU -> Linear to ``6 * dim``
  (``time_projection``), added to the block's learned ``modulation``: six
  ``(shift, scale, gate)`` vectors;
- self-attention on ``LayerNorm(x) * (1 + scale) + shift``: q/k RMSNorm over the *full*
  projected width (before the head split), 3D RoPE over (frame, height, width) with
  ``head_dim`` split ``d - 4 (d // 6), 2 (d // 6), 2 (d // 6)``
  (``multi_axis_rope_frequencies``), gated residual;
- image-to-video cross-attention: one query against the text tokens and one against the
  image (CLIP) tokens, each with its own RMSNorm'd keys, the two outputs summed before the
  output projection; plain residual (``image_context=False``, ``--t2v``: text only, as
  Wan2.1's text-to-video blocks);
- the tanh-GELU feed-forward network on the modulated LayerNorm, gated residual.

Parameters are a dict named as Wan2.1's state dict (``self_attn.q.weight``,
``cross_attn.norm_k_img.weight``, ``modulation``, ``time_embedding.0.weight``, ...), so
a checkpoint's block loads after stripping ``blocks.<i>.``. ``WanBlock.vjp`` returns the
output and a pullback giving the gradients of ``x``, of both contexts and of every
parameter, composed from the ops' pullbacks (``arrayattn.vjp``): no autograd engine.

    python examples/wan_block.py [--xp numpy|cupy] [--frames 2 --height 4 --width 4]
                                 [--dim 128 --heads 4] [--t2v] [--check]

``--check`` compares the pullback with central finite differences along a random
direction, in float64.
"""

from __future__ import annotations

import os

# The matrices here are small: BLAS threads cost more in synchronisation than they gain
# (40x slower on a busy 2-core machine). One thread unless the caller says otherwise; this
# only takes effect when NumPy is imported after it (running the script).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import arrayattn as aa  # noqa: E402
from arrayattn import vjp  # noqa: E402
from arrayattn.nn import gelu, linear, silu  # noqa: E402

Params = dict[str, Any]
# One (F, H, W) for the whole batch, or one per sample (x padded to the longest).
Grid = tuple[int, int, int] | Sequence[tuple[int, int, int]]


class _Tape:
    """Runs ops through ``arrayattn.vjp`` and keeps their pullbacks by name."""

    def __init__(self) -> None:
        self.pullbacks: dict[str, Callable[[Any], tuple[Any, ...]]] = {}

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        out, pullback = vjp(fn, *args, **kw)
        self.pullbacks[name] = pullback
        return out

    def back(self, name: str, cotangent: Any) -> tuple[Any, ...]:
        return self.pullbacks[name](cotangent)


@dataclass(frozen=True)
class WanBlock:
    """Shapes and options of one Wan2.1 attention block (``WanAttentionBlock``, I2V
    cross-attention) and its timestep embedding."""

    dim: int = 128
    ffn_dim: int = 256
    num_heads: int = 4
    freq_dim: int = 64  # width of the sinusoidal timestep embedding
    eps: float = 1e-6
    cross_attn_norm: bool = True  # WanModel's default: affine LayerNorm before cross-attn
    image_context: bool = True  # I2V cross-attention (text + image); False: T2V (text only)
    theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} must be a multiple of num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        d, f = self.dim, self.ffn_dim
        shapes: dict[str, tuple[int, ...]] = {
            "time_embedding.0.weight": (d, self.freq_dim),
            "time_embedding.0.bias": (d,),
            "time_embedding.2.weight": (d, d),
            "time_embedding.2.bias": (d,),
            "time_projection.1.weight": (6 * d, d),
            "time_projection.1.bias": (6 * d,),
            "modulation": (1, 6, d),
        }
        for proj in ("q", "k", "v", "o"):
            shapes[f"self_attn.{proj}.weight"] = (d, d)
            shapes[f"self_attn.{proj}.bias"] = (d,)
        image = ("k_img", "v_img") if self.image_context else ()
        for proj in ("q", "k", "v", "o") + image:
            shapes[f"cross_attn.{proj}.weight"] = (d, d)
            shapes[f"cross_attn.{proj}.bias"] = (d,)
        for norm in ("self_attn.norm_q", "self_attn.norm_k"):
            shapes[f"{norm}.weight"] = (d,)
        for norm in ("norm_q", "norm_k") + (("norm_k_img",) if self.image_context else ()):
            shapes[f"cross_attn.{norm}.weight"] = (d,)
        if self.cross_attn_norm:
            shapes["norm3.weight"] = (d,)
            shapes["norm3.bias"] = (d,)
        shapes["ffn.0.weight"] = (f, d)
        shapes["ffn.0.bias"] = (f,)
        shapes["ffn.2.weight"] = (d, f)
        shapes["ffn.2.bias"] = (d,)
        return shapes

    def init(self, *, seed: int, xp: Any = None, device: Any = None, dtype: Any = None) -> Params:
        """Random parameters (weights ~ N(0, 1/fan_in), norm weights near 1, biases small)."""
        ns = aa.array_namespace(xp)
        rng = np.random.default_rng(seed)
        out: Params = {}
        for name, shape in self.param_shapes().items():
            if name.endswith(".bias") or name == "modulation":
                a = 0.1 * rng.standard_normal(shape)
            elif "norm" in name:
                a = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                a = rng.standard_normal(shape) / math.sqrt(shape[1])
            out[name] = ns.asarray(
                a.astype(np.float32) if dtype is None else a,
                dtype=dtype,
                device=device,
            )
        return out

    # -- forward ---------------------------------------------------------------------

    def __call__(
        self,
        params: Mapping[str, Any],
        x: Any,
        t: Any,
        context: Any,
        context_img: Any,
        grid: Grid,
    ) -> Any:
        """The block's output.

        Shapes: ``x`` ``(B, F*H*W, dim)`` patch tokens in (frame, height, width) order;
        ``t`` ``(B,)`` timesteps; ``context`` ``(B, Lt, dim)`` text tokens;
        ``grid`` ``(F, H, W)`` shared by the batch, or one per sample (then ``x`` is padded
        to ``L >= F*H*W`` tokens per sample, as Wan2.1 pads to ``seq_len``; the padding
        keys are masked in the self-attention, its rows are computed but unrotated);
        ``context_img`` ``(B, Li, dim)`` image tokens (``None`` for a T2V block,
        ``image_context=False``) -> ``x``'s shape.
        """
        return self._forward(_Tape(), params, x, t, context, context_img, grid)[0]

    def vjp(
        self,
        params: Mapping[str, Any],
        x: Any,
        t: Any,
        context: Any,
        context_img: Any,
        grid: Grid,
    ) -> tuple[Any, Callable[[Any], tuple[Any, Any, Any, Params]]]:
        """``(out, pullback)``; ``pullback(d_out) -> (dx, d_context, d_context_img,
        d_params)`` (``t`` is not differentiated; ``d_context_img`` is ``None`` for T2V)."""
        tape = _Tape()
        out, saved = self._forward(tape, params, x, t, context, context_img, grid)

        def pullback(d_out: Any) -> tuple[Any, Any, Any, Params]:
            return self._backward(tape, saved, params, d_out)

        return out, pullback

    def _positions(self, xp: Any, grid: Grid, B: int, L: int, device: Any) -> tuple[Any, Any]:
        """``(freqs, seq_lens)``: RoPE factors for one shared grid ``(L, F)``, or for one
        grid per sample ``(B, 1, L, F)`` with the tokens after ``F*H*W`` left unrotated
        (position 0 on every axis, as Wan2.1's ``rope_apply`` passes them through) and
        their lengths ``(B,)`` for the self-attention's ``kv_lengths`` (Wan2.1's
        ``k_lens=seq_lens``)."""
        axes = aa.wan_axes_dim(self.head_dim)
        # Wan2.1 builds its RoPE table in float64 (rope_params): so do we.
        if len(grid) == 3 and all(isinstance(g, int) for g in grid):
            if L != math.prod(grid):
                raise ValueError(f"x has {L} tokens but grid {tuple(grid)} holds {math.prod(grid)}")
            pos = aa.grid_positions(grid, xp=xp, device=device)
            return aa.multi_axis_rope_frequencies(
                axes, pos, theta=self.theta, dtype=xp.float64
            ), None
        if len(grid) != B:
            raise ValueError(f"grid must be one (F, H, W) or one per sample ({B}), got {grid!r}")
        rows = []
        for g in grid:
            n = math.prod(g)
            if n > L:
                raise ValueError(f"grid {tuple(g)} holds {n} tokens, more than x's {L}")
            pad = xp.zeros((L - n, 3), dtype=xp.int64, device=device)
            rows.append(xp.concat((aa.grid_positions(g, xp=xp, device=device), pad), axis=0))
        pos = xp.stack(rows, axis=0)  # (B, L, 3)
        freqs = aa.multi_axis_rope_frequencies(axes, pos, theta=self.theta, dtype=xp.float64)
        seq_lens = xp.asarray([math.prod(g) for g in grid], dtype=xp.int64, device=device)
        return xp.expand_dims(freqs, axis=1), seq_lens

    def _forward(self, tape, p, x, t, context, context_img, grid):
        xp = aa.array_namespace(x)
        device = aa.device(x)
        B, L, D = (int(s) for s in x.shape)
        if (context_img is None) == self.image_context:
            raise ValueError(
                "context_img must be given for an I2V block (image_context=True) and None "
                f"for a T2V one; image_context={self.image_context}, context_img is "
                f"{'None' if context_img is None else 'given'}"
            )
        s: dict[str, Any] = {}

        # timestep -> six modulation vectors (B, 6, D)
        e_sin = aa.sinusoidal_embedding(self.freq_dim, t, dtype=x.dtype)
        h = tape("te0", linear, e_sin, p["time_embedding.0.weight"], p["time_embedding.0.bias"])
        h = tape("te_act", silu, h)
        e = tape("te2", linear, h, p["time_embedding.2.weight"], p["time_embedding.2.bias"])
        e = tape("tp_act", silu, e)
        e0 = tape("tp", linear, e, p["time_projection.1.weight"], p["time_projection.1.bias"])
        mod = p["modulation"] + xp.reshape(e0, (B, 6, D))
        m = [mod[:, i : i + 1, :] for i in range(6)]  # (B, 1, D) each
        s["m"] = m

        # self-attention on the modulated LayerNorm, gated residual
        n1 = tape("norm1", aa.layer_norm, x, None, None, eps=self.eps)
        xin = n1 * (1 + m[1]) + m[0]
        s["n1"] = n1
        freqs, seq_lens = self._positions(xp, grid, B, L, device)
        y = self._attention(tape, "self_attn", p, xin, [(xin, xin, "k", "v", freqs, seq_lens)])
        s["y_self"] = y
        x2 = x + y * m[2]

        # cross-attention (text + image, summed before the output projection)
        cin = x2
        if self.cross_attn_norm:
            cin = tape("norm3", aa.layer_norm, x2, p["norm3.weight"], p["norm3.bias"], eps=self.eps)
        sources = [(context, context, "k", "v", None, None)]
        if self.image_context:
            sources.append((context_img, context_img, "k_img", "v_img", None, None))
        x3 = x2 + self._attention(tape, "cross_attn", p, cin, sources)

        # feed-forward network on the modulated LayerNorm, gated residual
        n2 = tape("norm2", aa.layer_norm, x3, None, None, eps=self.eps)
        s["n2"] = n2
        fin = n2 * (1 + m[4]) + m[3]
        hid = tape("ffn0", linear, fin, p["ffn.0.weight"], p["ffn.0.bias"])
        hid = tape("ffn_act", gelu, hid, approximate="tanh")
        y2 = tape("ffn2", linear, hid, p["ffn.2.weight"], p["ffn.2.bias"])
        s["y_ffn"] = y2
        return x3 + y2 * m[5], s

    def _attention(self, tape, prefix, p, x, sources):
        """Wan2.1 attention: q/k RMSNorm over the full width, then heads (RoPE when
        ``freqs`` is given); the outputs of every (key, value) source are summed before
        the output projection."""
        n = self.num_heads
        q = tape(f"{prefix}.q", linear, x, p[f"{prefix}.q.weight"], p[f"{prefix}.q.bias"])
        q = tape(f"{prefix}.norm_q", aa.rms_norm, q, p[f"{prefix}.norm_q.weight"], eps=self.eps)
        q = tape(f"{prefix}.q_heads", aa.split_heads, q, n)
        merged = None
        for src_k, src_v, k_name, v_name, freqs, kv_lengths in sources:
            tag = f"{prefix}.{k_name}"
            k = tape(tag, linear, src_k, p[f"{tag}.weight"], p[f"{tag}.bias"])
            norm = f"{prefix}.norm_{k_name}"
            k = tape(norm, aa.rms_norm, k, p[f"{norm}.weight"], eps=self.eps)
            k = tape(f"{tag}_heads", aa.split_heads, k, n)
            vtag = f"{prefix}.{v_name}"
            v = tape(vtag, linear, src_v, p[f"{vtag}.weight"], p[f"{vtag}.bias"])
            v = tape(f"{vtag}_heads", aa.split_heads, v, n)
            qr = q
            if freqs is not None:
                qr = tape(f"{prefix}.q_rope", aa.apply_rope, q, freqs)
                k = tape(f"{tag}_rope", aa.apply_rope, k, freqs)
            o = tape(
                f"{tag}_attn", aa.scaled_dot_product_attention, qr, k, v, kv_lengths=kv_lengths
            )
            o = tape(f"{tag}_merge", aa.merge_heads, o)
            merged = o if merged is None else merged + o
        return tape(f"{prefix}.o", linear, merged, p[f"{prefix}.o.weight"], p[f"{prefix}.o.bias"])

    # -- backward --------------------------------------------------------------------

    def _attention_back(self, tape, prefix, d_out, sources, grads):
        """Pull ``d_out`` back through ``_attention``; returns d(query input) and one
        (d_key_input, d_value_input) per source."""
        d_merged, grads[f"{prefix}.o.weight"], grads[f"{prefix}.o.bias"] = tape.back(
            f"{prefix}.o", d_out
        )
        d_q = None
        d_sources = []
        for k_name, v_name, has_rope in sources:
            tag, vtag = f"{prefix}.{k_name}", f"{prefix}.{v_name}"
            d_o = tape.back(f"{tag}_merge", d_merged)[0]
            dq, dk, dv = tape.back(f"{tag}_attn", d_o)
            if has_rope:
                dq = tape.back(f"{prefix}.q_rope", dq)[0]
                dk = tape.back(f"{tag}_rope", dk)[0]
            d_q = dq if d_q is None else d_q + dq
            dv = tape.back(f"{vtag}_heads", dv)[0]
            d_src_v, grads[f"{vtag}.weight"], grads[f"{vtag}.bias"] = tape.back(vtag, dv)
            dk = tape.back(f"{tag}_heads", dk)[0]
            norm = f"{prefix}.norm_{k_name}"
            dk, grads[f"{norm}.weight"] = tape.back(norm, dk)
            d_src_k, grads[f"{tag}.weight"], grads[f"{tag}.bias"] = tape.back(tag, dk)
            d_sources.append((d_src_k, d_src_v))
        d_q = tape.back(f"{prefix}.q_heads", d_q)[0]
        d_q, grads[f"{prefix}.norm_q.weight"] = tape.back(f"{prefix}.norm_q", d_q)
        d_x, grads[f"{prefix}.q.weight"], grads[f"{prefix}.q.bias"] = tape.back(f"{prefix}.q", d_q)
        return d_x, d_sources

    def _backward(self, tape, s, p, d_out):
        xp = aa.array_namespace(d_out)
        m = s["m"]
        grads: Params = {}
        d_m: list[Any] = [None] * 6

        def rows(a: Any) -> Any:  # sum over tokens, keeping (B, 1, D)
            return xp.sum(a, axis=1, keepdims=True)

        # x4 = x3 + y_ffn * m5
        d_x3 = d_out
        d_m[5] = rows(d_out * s["y_ffn"])
        d_y2 = d_out * m[5]
        d_hid, grads["ffn.2.weight"], grads["ffn.2.bias"] = tape.back("ffn2", d_y2)
        d_hid = tape.back("ffn_act", d_hid)[0]
        d_fin, grads["ffn.0.weight"], grads["ffn.0.bias"] = tape.back("ffn0", d_hid)
        # fin = n2 * (1 + m4) + m3
        d_m[3] = rows(d_fin)
        d_m[4] = rows(d_fin * s["n2"])
        d_x3 = d_x3 + tape.back("norm2", d_fin * (1 + m[4]))[0]

        # x3 = x2 + cross_attn(cin)
        sources = [("k", "v", False)] + ([("k_img", "v_img", False)] if self.image_context else [])
        d_cin, d_src = self._attention_back(tape, "cross_attn", d_x3, sources, grads)
        d_context = d_src[0][0] + d_src[0][1]
        d_context_img = d_src[1][0] + d_src[1][1] if self.image_context else None
        d_x2 = d_x3
        if self.cross_attn_norm:
            d_cin, grads["norm3.weight"], grads["norm3.bias"] = tape.back("norm3", d_cin)
        d_x2 = d_x2 + d_cin

        # x2 = x + y_self * m2
        d_x = d_x2
        d_m[2] = rows(d_x2 * s["y_self"])
        d_xin, d_src = self._attention_back(
            tape, "self_attn", d_x2 * m[2], [("k", "v", True)], grads
        )
        d_xin = d_xin + d_src[0][0] + d_src[0][1]
        # xin = n1 * (1 + m1) + m0
        d_m[0] = rows(d_xin)
        d_m[1] = rows(d_xin * s["n1"])
        d_x = d_x + tape.back("norm1", d_xin * (1 + m[1]))[0]

        # mod = modulation + e0.reshape(B, 6, D)
        d_mod = xp.concat(d_m, axis=1)  # (B, 6, D)
        grads["modulation"] = xp.sum(d_mod, axis=0, keepdims=True)
        B = int(d_mod.shape[0])
        d_e0 = xp.reshape(d_mod, (B, 6 * self.dim))
        d_e, grads["time_projection.1.weight"], grads["time_projection.1.bias"] = tape.back(
            "tp", d_e0
        )
        d_e = tape.back("tp_act", d_e)[0]
        d_h, grads["time_embedding.2.weight"], grads["time_embedding.2.bias"] = tape.back(
            "te2", d_e
        )
        d_h = tape.back("te_act", d_h)[0]
        _, grads["time_embedding.0.weight"], grads["time_embedding.0.bias"] = tape.back("te0", d_h)
        return d_x, d_context, d_context_img, {k: grads[k] for k in p}


def random_inputs(
    block: WanBlock,
    grid: Grid,
    *,
    batch: int = 2,
    text_len: int = 12,
    image_len: int = 5,
    seed: int = 0,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """``(x, t, context, context_img)`` drawn with NumPy and moved to ``xp``
    (``context_img`` is ``None`` for a T2V block)."""
    ns = aa.array_namespace(xp)
    rng = np.random.default_rng(seed)
    dt = ns.float32 if dtype is None else dtype
    shared = len(grid) == 3 and all(isinstance(g, int) for g in grid)
    L = math.prod(grid) if shared else max(math.prod(g) for g in grid)

    def arr(shape: tuple[int, ...]) -> Any:
        return ns.asarray(rng.standard_normal(shape), dtype=dt, device=device)

    t = ns.asarray(rng.integers(0, 1000, size=(batch,)), dtype=ns.int64, device=device)
    return (
        arr((batch, L, block.dim)),
        t,
        arr((batch, text_len, block.dim)),
        arr((batch, image_len, block.dim)) if block.image_context else None,
    )


def _directional_check(block: WanBlock, grid: tuple[int, int, int], xp: Any) -> float:
    """Relative error of <pullback(c), v> against the central difference of <out, c>."""
    f64 = xp.float64
    params = block.init(seed=1, xp=xp, dtype=f64)
    x, t, ctx, img = random_inputs(block, grid, xp=xp, dtype=f64)
    rng = np.random.default_rng(2)
    out, pullback = block.vjp(params, x, t, ctx, img, grid)
    c = xp.asarray(rng.standard_normal(tuple(out.shape)), dtype=f64)
    dx, dctx, dimg, dp = pullback(c)
    dirs = {
        k: xp.asarray(rng.standard_normal(tuple(v.shape)), dtype=f64) for k, v in params.items()
    }
    vx, vc = (xp.asarray(rng.standard_normal(tuple(a.shape)), dtype=f64) for a in (x, ctx))
    analytic = float(xp.sum(dx * vx) + xp.sum(dctx * vc))
    vi = None
    if img is not None:
        vi = xp.asarray(rng.standard_normal(tuple(img.shape)), dtype=f64)
        analytic += float(xp.sum(dimg * vi))
    analytic += sum(float(xp.sum(dp[k] * dirs[k])) for k in params)
    eps = 1e-6

    def value(sign: float) -> float:
        p = {k: params[k] + sign * eps * dirs[k] for k in params}
        im = None if img is None else img + sign * eps * vi
        y = block(p, x + sign * eps * vx, t, ctx + sign * eps * vc, im, grid)
        return float(xp.sum(y * c))

    numeric = (value(1.0) - value(-1.0)) / (2 * eps)
    return abs(analytic - numeric) / max(abs(numeric), 1e-12)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--xp", choices=("numpy", "cupy"), default="numpy")
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--height", type=int, default=4)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--t2v", action="store_true", help="text-only cross-attention (T2V)")
    ap.add_argument("--check", action="store_true", help="finite-difference check (float64)")
    args = ap.parse_args(argv)
    if args.xp == "cupy":
        import array_api_compat.cupy as xp
    else:
        import array_api_compat.numpy as xp
    grid = (args.frames, args.height, args.width)
    block = WanBlock(
        dim=args.dim, ffn_dim=2 * args.dim, num_heads=args.heads, image_context=not args.t2v
    )
    params = block.init(seed=0, xp=xp)
    x, t, ctx, img = random_inputs(block, grid, batch=args.batch, xp=xp)
    print(
        f"Wan2.1 block on {args.xp}: B={args.batch}, grid (F, H, W)={grid} -> "
        f"{math.prod(grid)} tokens, dim={block.dim}, heads={block.num_heads}, "
        f"head_dim={block.head_dim} split {aa.wan_axes_dim(block.head_dim)} for RoPE, "
        f"{'T2V' if args.t2v else 'I2V'} cross-attention"
    )
    for i in range(args.repeat):
        t0 = time.perf_counter()
        out, pullback = block.vjp(params, x, t, ctx, img, grid)
        t1 = time.perf_counter()
        dx, dctx, dimg, dparams = pullback(xp.ones_like(out))
        if args.xp == "cupy":
            import cupy

            cupy.cuda.Device().synchronize()
        t2 = time.perf_counter()
        print(
            f"  run {i}: forward {1e3 * (t1 - t0):.1f} ms, backward {1e3 * (t2 - t1):.1f} ms; "
            f"|out| {float(xp.linalg.vector_norm(out)):.4g}, |dx| "
            f"{float(xp.linalg.vector_norm(dx)):.4g}, {len(dparams)} parameter gradients"
        )
    if args.check:
        err = _directional_check(block, (1, 2, 3), xp)
        print(f"finite-difference check (float64, random direction): relative error {err:.2e}")
        if err > 1e-6:
            raise SystemExit("backward does not match finite differences")


if __name__ == "__main__":
    main()
