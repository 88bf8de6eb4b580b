"""A tiny LLaMA-style GPT trained with arrayattn's hand-written backward, then decoded
with a KV cache.

Character-level model on ``examples/data/sonnets.txt``: token embedding, ``n_layers`` x
(RMSNorm -> GQA ``MultiHeadAttention`` with RoPE -> residual, RMSNorm -> SwiGLU MLP ->
residual), final RMSNorm, a head tied to the embedding (or not), trained on
``arrayattn.cross_entropy``. The layers are ``arrayattn.nn``'s (``Embedding``,
``RMSNorm``, ``MultiHeadAttention``, ``MLP``, ``Linear``) over one flat dict of
parameters with Hugging Face LLaMA names; the loss's gradient is the model-level
backward composed by hand from their ``vjp`` pullbacks and the loss's; the optimiser is
AdamW written with array-API operations. Generation appends one token at a
time to per-layer KV caches and checks, at every step, that the cached logits equal a full
recomputation over the whole sequence.

    python examples/tiny_gpt.py [--steps 300] [--seed 0] [--xp numpy|cupy|torch]
"""

from __future__ import annotations

import os

# The matrices here are tiny: BLAS threads cost more in synchronisation than they gain
# (8x slower on a busy 2-core machine). One thread unless the caller says otherwise; this
# only takes effect when NumPy is imported after it (running the script).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import arrayattn as aa  # noqa: E402
from arrayattn.nn import MLP, Embedding, Linear, MultiHeadAttention, RMSNorm  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "sonnets.txt"


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 176  # ~ 8/3 * dim, LLaMA's SwiGLU sizing
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tied: bool = True
    # The attention path (see arrayattn.implementations()): on CuPy "auto" runs the fused
    # kernels (trained here on an H200, 2026-11-26), "chunked" the array-API path.
    implementation: str = "auto"

    @property
    def attention(self) -> MultiHeadAttention:
        return MultiHeadAttention(
            embed_dim=self.dim,
            num_heads=self.n_heads,
            num_kv_heads=self.n_kv_heads,
            bias=False,
            rope="half",
            rope_theta=self.rope_theta,
            causal=True,
            implementation=self.implementation,
        )

    @property
    def embed(self) -> Embedding:
        return Embedding(self.vocab_size, self.dim)

    @property
    def norm(self) -> RMSNorm:
        return RMSNorm(self.dim, eps=self.norm_eps)

    @property
    def mlp(self) -> MLP:
        """LLaMA's SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""
        return MLP(self.dim, self.ffn_dim, activation="silu", gated=True, bias=False)

    @property
    def head(self) -> Linear:
        return Linear(self.dim, self.vocab_size, bias=False)


# -- data ------------------------------------------------------------------------------
class CharTokenizer:
    """Characters of the training text <-> ids."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, s: str) -> np.ndarray:
        return np.array([self.index[c] for c in s], dtype=np.int64)

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def batches(data: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator):
    """Endless random windows ``(inputs, targets)`` of ``(batch_size, seq_len)`` ids."""
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        idx = starts[:, None] + np.arange(seq_len)[None, :]
        yield data[idx], data[idx + 1]


# -- parameters -----------------------------------------------------------------------
def init_params(cfg: GPTConfig, *, seed: int, xp: Any, device: Any = None) -> dict[str, Any]:
    """Parameters under Hugging Face LLaMA names (``model.layers.0.self_attn.q_proj.weight``
    ...), float32, on ``xp``/``device``: GPT-2's normal init (not ``init``'s PyTorch
    defaults), norm weights one."""
    ns = aa.array_namespace(xp)
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> Any:
        return ns.asarray(rng.normal(0.0, std, size=shape), dtype=ns.float32, device=device)

    def ones(n: int) -> Any:
        return ns.ones((n,), dtype=ns.float32, device=device)

    d, f = cfg.dim, cfg.ffn_dim
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual projections
    params = {"model.embed_tokens.weight": normal((cfg.vocab_size, d), 0.02)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        attn = cfg.attention.init(seed=seed + 1 + i, xp=ns, device=device, dtype=ns.float32)
        for name, value in attn.items():
            params[p + "self_attn." + name] = value
        params[p + "self_attn.o_proj.weight"] = normal((d, d), out_std)
        params[p + "input_layernorm.weight"] = ones(d)
        params[p + "post_attention_layernorm.weight"] = ones(d)
        params[p + "mlp.gate_proj.weight"] = normal((f, d), 0.02)
        params[p + "mlp.up_proj.weight"] = normal((f, d), 0.02)
        params[p + "mlp.down_proj.weight"] = normal((d, f), out_std)
    params["model.norm.weight"] = ones(d)
    if not cfg.tied:
        params["lm_head.weight"] = normal((cfg.vocab_size, d), 0.02)
    return params


def subtree(params: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The parameters under ``prefix``, without it: one layer's dict."""
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


# -- forward and backward ---------------------------------------------------------------
# The tape: tag -> (parameter prefix, the layer's pullback)
Tape = dict[str, tuple[str, Callable[[Any], Any]]]


def forward(
    params: dict[str, Any],
    cfg: GPTConfig,
    ids: Any,
    *,
    caches: list | None = None,
    record: bool = False,
) -> tuple[Any, Tape]:
    """Logits ``(B, T, vocab)`` for ids ``(B, T)``. With ``caches`` (one ``KVCache`` per
    layer) the ids are the next tokens after those cached. With ``record`` the second
    result is the tape of pullbacks that :func:`backward` walks in reverse."""
    tape: Tape = {}

    def call(tag: str, prefix: str, layer: Any, x: Any, **kw: Any) -> Any:
        p = subtree(params, prefix)
        if not record:
            return layer(p, x, **kw)
        out, pullback = layer.vjp(p, x)
        tape[tag] = (prefix, pullback)
        return out

    x = call("embed", "model.embed_tokens.", cfg.embed, ids)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        cache = {} if caches is None else {"cache": caches[i]}
        h = call(f"{i}.norm1", p + "input_layernorm.", cfg.norm, x)
        x = x + call(f"{i}.attn", p + "self_attn.", cfg.attention, h, **cache)
        h = call(f"{i}.norm2", p + "post_attention_layernorm.", cfg.norm, x)
        x = x + call(f"{i}.mlp", p + "mlp.", cfg.mlp, h)
    x = call("final_norm", "model.norm.", cfg.norm, x)
    # tied: the head's weight is the embedding's (its gradient adds to the lookup's)
    logits = call("head", "model.embed_tokens." if cfg.tied else "lm_head.", cfg.head, x)
    return logits, tape


def backward(tape: Tape, cfg: GPTConfig, d_logits: Any) -> dict[str, Any]:
    """The gradient of every parameter from the forward tape and ``d loss / d logits``:
    the forward, read bottom-up, with each layer replaced by its pullback; cotangents add
    at the residuals and at the tied embedding."""
    grads: dict[str, Any] = {}

    def back(tag: str, d_out: Any) -> Any:
        prefix, pullback = tape[tag]
        cot = pullback(d_out)  # (dx, dparams), or MultiHeadAttention's (dx, dcontext, dparams)
        for name, g in cot[-1].items():
            key = prefix + name
            grads[key] = g if key not in grads else grads[key] + g
        return cot[0]

    dx = back("final_norm", back("head", d_logits))
    for i in reversed(range(cfg.n_layers)):
        dx = dx + back(f"{i}.norm2", back(f"{i}.mlp", dx))
        dx = dx + back(f"{i}.norm1", back(f"{i}.attn", dx))
    back("embed", dx)
    return grads


def loss_and_grad(logits: Any, targets: Any) -> tuple[Any, Any]:
    """Mean token cross-entropy (``arrayattn.cross_entropy``) and its gradient w.r.t. the
    logits."""
    loss, pullback = aa.vjp(aa.cross_entropy, logits, targets)
    d_logits, _ = pullback(aa.array_namespace(loss).ones_like(loss))
    return loss, d_logits


# -- optimiser ----------------------------------------------------------------------------
class AdamW:
    """AdamW (decoupled weight decay on matrices only) with linear warm-up, written with
    array-API operations; returns new parameter arrays instead of writing in place."""

    def __init__(
        self,
        params: dict[str, Any],
        lr: float = 3e-3,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        warmup: int = 20,
    ) -> None:
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.warmup = weight_decay, warmup
        self.step_count = 0
        self.m = {k: v * 0.0 for k, v in params.items()}
        self.v = {k: v * 0.0 for k, v in params.items()}

    def step(self, xp: Any, params: dict[str, Any], grads: dict[str, Any]) -> dict[str, Any]:
        self.step_count += 1
        t = self.step_count
        b1, b2 = self.betas
        lr = self.lr * min(1.0, t / self.warmup)
        new = {}
        for k, p in params.items():
            g = grads[k]
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * (g * g)
            update = (self.m[k] / (1 - b1**t)) / (xp.sqrt(self.v[k] / (1 - b2**t)) + self.eps)
            if p.ndim >= 2:
                update = update + self.weight_decay * p
            new[k] = p - lr * update
        return new


# -- training and generation ----------------------------------------------------------
def train(
    params: dict[str, Any],
    cfg: GPTConfig,
    data: np.ndarray,
    *,
    steps: int,
    seed: int,
    xp: Any,
    device: Any = None,
    batch_size: int = 16,
    seq_len: int = 64,
    lr: float = 3e-3,
    log_every: int = 25,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], list[float]]:
    """``steps`` AdamW steps on random windows; returns the new params and the losses."""
    ns = aa.array_namespace(xp)
    opt = AdamW(params, lr=lr)
    losses = []
    start = time.perf_counter()
    stream = batches(data, batch_size, seq_len, np.random.default_rng(seed))
    for step in range(1, steps + 1):
        inputs, targets = next(stream)
        ids = ns.asarray(inputs, device=device)
        tgt = ns.asarray(targets, device=device)
        logits, tape = forward(params, cfg, ids, record=True)
        loss, d_logits = loss_and_grad(logits, tgt)
        grads = backward(tape, cfg, d_logits)
        params = opt.step(ns, params, grads)
        losses.append(float(to_numpy(loss)))
        if step == 1 or step % log_every == 0 or step == steps:
            log(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:6.1f} s)")
    return params, losses


def generate(
    params: dict[str, Any],
    cfg: GPTConfig,
    prompt: np.ndarray,
    *,
    new_tokens: int,
    seed: int,
    xp: Any,
    device: Any = None,
    temperature: float = 0.8,
    check: bool = True,
) -> tuple[np.ndarray, float]:
    """Sample ``new_tokens`` after ``prompt`` with per-layer KV caches. With ``check``,
    every step's cached logits are compared with a full forward over the whole sequence;
    returns the ids and the largest absolute difference seen (asserted small)."""
    ns = aa.array_namespace(xp)
    rng = np.random.default_rng(seed)
    total = len(prompt) + new_tokens
    caches = [cfg.attention.new_cache(1, total, xp=ns, device=device) for _ in range(cfg.n_layers)]
    ids = list(int(t) for t in prompt)
    step_input = ns.asarray(np.asarray(prompt)[None, :], device=device)  # prefill
    worst = 0.0
    for _ in range(new_tokens):
        logits, _ = forward(params, cfg, step_input, caches=caches)
        last = to_numpy(logits[0, -1, :]).astype(np.float64)
        if check:
            full, _ = forward(params, cfg, ns.asarray(np.array([ids]), device=device))
            reference = to_numpy(full[0, -1, :]).astype(np.float64)
            diff = float(np.max(np.abs(last - reference)))
            worst = max(worst, diff)
            scale = max(1.0, float(np.max(np.abs(reference))))
            assert diff <= 1e-4 * scale, f"cached logits differ from recomputation by {diff}"
        probs = np.exp((last - last.max()) / temperature)
        nxt = int(rng.choice(len(probs), p=probs / probs.sum()))
        ids.append(nxt)
        step_input = ns.asarray(np.array([[nxt]]), device=device)
    return np.array(ids), worst


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy copy of an array from NumPy, CuPy, PyTorch or array-api-strict."""
    if hasattr(x, "get"):  # CuPy
        return x.get()
    if hasattr(x, "detach"):  # PyTorch
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError):  # array-api-strict on a non-CPU device
        import array_api_strict

        return np.asarray(array_api_strict.asarray(x, device=array_api_strict.Device("CPU_DEVICE")))


def _library(name: str) -> tuple[Any, Any]:
    if name == "numpy":
        return np, None
    if name == "cupy":
        import cupy

        return cupy, None
    if name == "torch":
        import torch

        return torch, "cpu"
    if name == "array_api_strict":
        import array_api_strict

        return array_api_strict, None
    raise ValueError(f"--xp must be numpy, cupy, torch or array_api_strict, got {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init, batches, sampling")
    parser.add_argument("--xp", default="numpy", help="numpy (default), cupy, torch, ...")
    parser.add_argument("--untied", action="store_true", help="separate lm_head weight")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument(
        "--implementation",
        default="auto",
        help="attention path: auto (default; the fused kernels on CuPy), composed, chunked, ...",
    )
    args = parser.parse_args(argv)

    lib, device = _library(args.xp)
    text = DATA.read_text()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    cfg = GPTConfig(
        vocab_size=len(tok.chars), tied=not args.untied, implementation=args.implementation
    )
    params = init_params(cfg, seed=args.seed, xp=lib, device=device)
    n_params = sum(math.prod(int(d) for d in v.shape) for v in params.values())
    print(
        f"tiny GPT: {n_params} parameters, vocab {cfg.vocab_size}, {len(data)} characters, "
        f"xp={args.xp}"
    )
    start = time.perf_counter()
    params, losses = train(
        params, cfg, data, steps=args.steps, seed=args.seed, xp=lib, device=device
    )
    print(
        f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s: loss "
        f"{losses[0]:.3f} -> {np.mean(losses[-10:]):.3f} (mean of the last 10)"
    )
    prompt = tok.encode("Shall I ")
    ids, worst = generate(
        params, cfg, prompt, new_tokens=args.new_tokens, seed=args.seed, xp=lib, device=device
    )
    print(
        f"KV-cache logits == full recomputation at all {args.new_tokens} steps "
        f"(max abs diff {worst:.2e})"
    )
    print("-" * 60)
    print(tok.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
