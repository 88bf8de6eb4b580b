"""arrayattn.torch.hf against transformers itself: tiny random 2-layer models of Llama,
Qwen3 (a sliding-window layer), Gemma 2 (softcaps, alternating sliding windows) and
gpt-oss (sinks, alternating sliding windows) built from configs (nothing downloaded),
run with ``attn_implementation="arrayattn"`` and with transformers' own ``"eager"`` (and
``"sdpa"`` where the family supports it):

- logits of a left-padded batch of prompts of different lengths (float64 to 1e-10,
  float32 to 1e-5, relative to the largest logit);
- one training step's parameter gradients (float64, 1e-10; sinks included);
- greedy ``generate`` token for token (KV cache, left padding, prompts longer than the
  windows; a static cache for the no-mask prefill);
- dropout: reproducible under ``torch.manual_seed`` in training, no effect in eval;
- the mask function: without it transformers drops the padding (logits change).

transformers computes RMSNorm, RoPE tables and some softmaxes in float32 even in a
float64 model: those islands would round the two runs apart by ~1e-7. The float64
comparisons run transformers' code with them promoted (``torch.float32``,
``torch.float`` and ``Tensor.float`` mean float64 inside :func:`hf_float64`), as
tests/examples/test_hf_causal_lm.py does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import arrayattn.torch as aat  # noqa: E402
from arrayattn.torch import hf  # noqa: E402

NAME = aat.register_hf_attention()

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,  # larger than the default: softcaps, windows and sinks matter
)
PROMPT_LENGTHS = (7, 3, 10)  # longer than every window below
NEW_TOKENS = 6
PAD = 0

# family -> (config class, model class, config fields beyond COMMON, has SDPA)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True), True),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        True,
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=2.5,
        ),
        False,  # transformers refuses SDPA for Gemma 2 (softcap)
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=8,
            sliding_window=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",  # the grouped-GEMM default refuses float64
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
        False,  # SDPA has no sinks
    ),
}


@contextlib.contextmanager
def hf_float64() -> Iterator[None]:
    """Run transformers' code with its float32 islands (norms, RoPE, softmax) in float64."""
    saved = (torch.float32, torch.float, torch.Tensor.float)
    torch.float32 = torch.float64
    torch.float = torch.float64
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved


def precision(dtype: Any) -> contextlib.AbstractContextManager[None]:
    return hf_float64() if dtype == torch.float64 else contextlib.nullcontext()


def build(family: str, dtype: Any = torch.float64, **overrides: Any) -> Any:
    """A tiny random model of ``family`` in ``dtype`` (eval mode, eager attention)."""
    cfg_name, model_name, extra, _ = FAMILIES[family]
    with precision(dtype):  # RoPE tables and Gemma's embedding scale built in float64
        config = getattr(transformers, cfg_name)(
            **COMMON, **{**extra, **overrides}, attn_implementation="eager"
        )
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config)
        with torch.no_grad():  # the init leaves some parameters at 0 or 1: perturb them all
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        return model.to(dtype).eval()


_MODELS: dict[str, Any] = {}


def model64(family: str) -> Any:
    """The float64 model of ``family``, built once per test session."""
    if family not in _MODELS:
        _MODELS[family] = build(family)
    return _MODELS[family]


def padded_batch(seed: int = 0) -> tuple[Any, Any, Any]:
    """Left-padded ``(ids, attention_mask, position_ids)`` of prompts of PROMPT_LENGTHS."""
    rng = np.random.default_rng(seed)
    L = max(PROMPT_LENGTHS)
    ids = torch.full((len(PROMPT_LENGTHS), L), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROMPT_LENGTHS):
        ids[b, L - n :] = torch.from_numpy(rng.integers(2, COMMON["vocab_size"], n))
        mask[b, L - n :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)  # positions as generate() builds


def logits(model: Any, implementation: str, batch: tuple[Any, Any, Any]) -> Any:
    ids, mask, positions = batch
    model.set_attn_implementation(implementation)
    with precision(model.dtype), torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def relative_error(got: Any, expected: Any) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every call into arrayattn: the key length, the options and the output's
    autograd node."""
    seen: list[dict[str, Any]] = []
    attend = hf._attend

    def spy(query: Any, key: Any, value: Any, **options: Any) -> Any:
        out = attend(query, key, value, **options)
        node = out.grad_fn.name() if out.grad_fn is not None else None
        seen.append(dict(L=query.shape[-2], S=key.shape[-2], grad_fn=node, **options))
        return out

    monkeypatch.setattr(hf, "_attend", spy)
    return seen


# --- registration ------------------------------------------------------------------------


def test_registration_is_idempotent_and_registers_the_mask_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    assert aat.register_hf_attention() == NAME == "arrayattn"
    assert aat.register_hf_attention("arrayattn") == "arrayattn"
    assert AttentionInterface()[NAME] is hf.hf_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is sdpa_mask
    assert aat.hf_attention_forward is hf.hf_attention_forward  # the package's lazy names
    # what runs is the torch.autograd.Function of arrayattn.torch
    assert hf._scaled_dot_product_attention is aat.scaled_dot_product_attention


RESERVED = [
    "",
    "eager",
    "sdpa",
    "my_sdpa",
    "flash_attention_2",
    "flex_attention",
    "paged|arrayattn",
    "org/kernel",
]


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_names_are_refused(name):
    with pytest.raises(ValueError, match="name must be a new attention implementation name"):
        aat.register_hf_attention(name)


def test_a_name_that_is_not_a_str_is_a_type_error():
    with pytest.raises(TypeError, match="name must be a str, got int: 3"):
        aat.register_hf_attention(3)  # type: ignore[arg-type]


def test_mask_function_keeps_the_padding(calls):
    """Registered without its mask function (transformers' behaviour for a bare
    AttentionInterface entry), the attention function gets ``attention_mask=None``: the
    padding is dropped and the real tokens' logits change."""
    from transformers import AttentionInterface

    model, batch = model64("llama"), padded_batch()
    real = batch[1].bool()
    expected = logits(model, "eager", batch)
    assert relative_error(logits(model, NAME, batch)[real], expected[real]) <= 1e-10
    assert all(c["attn_mask"] is not None for c in calls)
    AttentionInterface.register("arrayattn_without_mask", hf.hf_attention_forward)
    try:
        dropped = logits(model, "arrayattn_without_mask", batch)
    finally:
        del AttentionInterface._global_mapping["arrayattn_without_mask"]
        model.set_attn_implementation("eager")
    assert relative_error(dropped[real], expected[real]) > 1e-2
    # the unpadded row never saw padding: the same either way
    full = int(np.argmax(PROMPT_LENGTHS))
    assert relative_error(dropped[full], expected[full]) <= 1e-10


# --- logits ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_eager_and_sdpa_float64(family, calls):
    model, batch = model64(family), padded_batch()
    real = batch[1].bool()
    got = logits(model, NAME, batch)
    assert len(calls) == COMMON["num_hidden_layers"]  # every layer ran through arrayattn
    references = ["eager"] + (["sdpa"] if FAMILIES[family][3] else [])
    for reference in references:
        expected = logits(model, reference, batch)
        err = relative_error(got[real], expected[real])
        assert err <= 1e-10, f"{family} vs {reference}: relative logit error {err:.3g}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_eager_float32(family):
    model, batch = build(family, torch.float32), padded_batch(1)
    real = batch[1].bool()
    got = logits(model, NAME, batch)
    assert got.dtype == torch.float32
    err = relative_error(got[real], logits(model, "eager", batch)[real])
    assert err <= 1e-5, f"{family}: relative logit error {err:.3g}"


# --- training ----------------------------------------------------------------------------


def _gradients(model: Any, implementation: str, batch: tuple[Any, Any, Any]) -> dict[str, Any]:
    ids, mask, positions = batch
    model.set_attn_implementation(implementation)
    model.train()
    model.zero_grad(set_to_none=True)
    try:
        with hf_float64():
            # a label counts where the token and the one predicting it are both real (a
            # padding position's output is 0 here, an average of values in eager)
            predictor = torch.nn.functional.pad(mask[:, :-1], (1, 0))
            labels = ids.masked_fill((mask == 0) | (predictor == 0), -100)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
            out.loss.backward()
    finally:
        model.eval()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_step_gradients_equal_eager(family, calls):
    model, batch = model64(family), padded_batch(2)
    got = _gradients(model, NAME, batch)
    # arrayattn's own backward ran (the autograd Function), once per layer
    assert [c["grad_fn"] for c in calls] == ["AttentionFunctionBackward"] * 2
    expected = _gradients(model, "eager", batch)
    assert got.keys() == expected.keys()
    if family == "gpt_oss":
        assert any(n.endswith("self_attn.sinks") for n in got)
    scale = max(float(g.abs().max()) for g in expected.values())
    for n, g in expected.items():
        err = float((got[n] - g).abs().max()) / scale
        assert err <= 1e-10, f"{family}: gradient of {n} off by {err:.3g}"


# --- generation --------------------------------------------------------------------------


def _generate(model: Any, implementation: str, batch: tuple[Any, Any, Any], **kw: Any) -> Any:
    ids, mask, _ = batch
    model.set_attn_implementation(implementation)
    with hf_float64(), torch.no_grad():
        seq = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
            **kw,
        )
    return seq[:, ids.shape[1] :]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generation_equals_eager(family, calls):
    model, batch = model64(family), padded_batch(3)
    got = _generate(model, NAME, batch)
    np.testing.assert_array_equal(got, _generate(model, "eager", batch))
    decode = [c for c in calls if c["L"] == 1]
    assert len(decode) == (NEW_TOKENS - 1) * COMMON["num_hidden_layers"]


def test_static_cache_prefill_without_mask(calls):
    """An unpadded batch's prefill into a static cache: transformers gives no mask, the
    keys past the prompt are empty cache slots; padded batches get masks."""
    model = model64("llama")
    ids, _, _ = padded_batch(4)
    unpadded = (ids[:, -3:], torch.ones_like(ids[:, -3:]), None)
    for batch in (unpadded, padded_batch(4)):
        calls.clear()
        got = _generate(model, NAME, batch, cache_implementation="static")
        np.testing.assert_array_equal(got, _generate(model, "eager", batch))
        np.testing.assert_array_equal(got, _generate(model, "sdpa", batch))
        prefill = calls[0]
        if batch is unpadded:
            assert prefill["attn_mask"] is None and prefill["is_causal"]
            assert prefill["S"] == prefill["L"] == 3  # the empty slots dropped
        else:
            assert prefill["attn_mask"] is not None


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_several_new_tokens_after_a_cache(family, calls):
    """Three tokens at once after a cached prompt (no padding): the queries are the last
    L of S keys, which transformers says with a mask (never ``None``)."""
    model = model64(family)
    ids = padded_batch(7)[0][:, -8:]  # unpadded rows
    outputs = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with hf_float64(), torch.no_grad():
            cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
            outputs[implementation] = model(input_ids=ids[:, 5:], past_key_values=cache).logits
    assert relative_error(outputs[NAME], outputs["eager"]) <= 1e-10
    continuation = [c for c in calls if c["L"] == 3]
    assert continuation and all(c["attn_mask"] is not None for c in continuation)


# --- dropout -----------------------------------------------------------------------------


def test_dropout_reproducible_in_training_and_off_in_eval():
    model, batch = build("gpt_oss", attention_dropout=0.5), padded_batch(5)
    real = batch[1].bool()
    eager = logits(model, "eager", batch)
    assert relative_error(logits(model, NAME, batch)[real], eager[real]) <= 1e-10
    model.train()
    try:
        runs = []
        for seed in (7, 7, 8):
            torch.manual_seed(seed)
            runs.append(logits(model, NAME, batch))
    finally:
        model.eval()
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    assert relative_error(runs[0][real], runs[2][real]) > 1e-3
    assert relative_error(runs[0][real], eager[real]) > 1e-3
    # the function itself: dropout only acts on a module in training mode
    layer = torch.nn.Module().eval()
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    off, _ = hf.hf_attention_forward(layer, q, q, q, None, dropout=0.5)
    torch.testing.assert_close(off, hf.hf_attention_forward(layer, q, q, q, None)[0])
    layer.train()
    assert not torch.allclose(off, hf.hf_attention_forward(layer, q, q, q, None, dropout=0.5)[0])


# --- the routes to the implementation ----------------------------------------------------


def test_from_pretrained_from_config_and_set_attn_implementation(tmp_path, calls):
    model, batch = build("qwen3", torch.float32), padded_batch(6)
    real = batch[1].bool()
    expected = logits(model, "eager", batch)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME
    config = transformers.AutoConfig.from_pretrained(tmp_path, attn_implementation=NAME)
    from_config = transformers.AutoModelForCausalLM.from_config(config)
    from_config.load_state_dict(model.state_dict())
    for m in (loaded.eval(), from_config.eval(), model):
        calls.clear()
        ids, mask, positions = batch
        if m is model:
            m.set_attn_implementation(NAME)
        with torch.no_grad():
            got = m(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert len(calls) == COMMON["num_hidden_layers"]
        assert relative_error(got[real], expected[real]) <= 1e-5


# --- the function alone, against transformers' SDPA integration ------------------------


def _layer(causal: bool = True) -> Any:
    layer = torch.nn.Module().eval()
    layer.is_causal = causal
    layer.num_key_value_groups = 2
    return layer


def _qkv(L: int, S: int, seed: int = 0) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, S, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, S, 6, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize(
    "L, S, causal",
    [(5, 5, True), (1, 7, True), (4, 9, True), (5, 5, False), (3, 7, False)],
    ids=["causal", "decode", "static-prefill", "bidirectional", "cross"],
)
def test_no_mask_means_what_it_means_to_sdpa(L, S, causal):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(L, S)
    if causal and 1 < L < S:  # a static cache's empty slots: never read
        k[..., L:, :], v[..., L:, :] = float("nan"), float("nan")
    ours, weights = hf.hf_attention_forward(_layer(causal), q, k, v, None, scaling=0.3)
    ref, _ = sdpa_attention_forward(_layer(causal), q, k, v, None, scaling=0.3)
    assert weights is None and ours.shape == (2, L, 4, 6) and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_equal_sdpa(kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(4, 6, seed=1)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(2, 1, 4, 6, generator=g) > 0.4
    mask[..., 0] = True  # every row keeps a key: SDPA's empty rows differ from ours (0)
    if kind == "float":
        mask = torch.randn(2, 1, 4, 6, generator=g, dtype=torch.float64).masked_fill(
            ~mask, torch.finfo(torch.float64).min
        )
    ours, _ = hf.hf_attention_forward(_layer(), q, k, v, mask, sliding_window=2)
    ref, _ = sdpa_attention_forward(_layer(), q, k, v, mask)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_sliding_window_is_transformers_definition():
    """``sliding_window=W`` with no mask: the keys transformers' own sliding-window mask
    keeps (``q - kv < W``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    q, k, v = _qkv(7, 7, seed=3)
    for window in (1, 3, 6, 7):
        mask = sdpa_mask(
            2,
            7,
            7,
            mask_function=sliding_window_causal_mask_function(window),
            allow_is_causal_skip=False,
        )
        ours, _ = hf.hf_attention_forward(_layer(), q, k, v, None, sliding_window=window)
        ref, _ = sdpa_attention_forward(_layer(), q, k, v, mask)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg=f"window {window}")


def test_unsupported_arguments_name_themselves():
    q, k, v = _qkv(3, 3)
    with pytest.raises(ValueError, match="position_bias"):
        hf.hf_attention_forward(_layer(), q, k, v, None, position_bias=torch.zeros(1, 4, 3, 3))
    with pytest.raises(ValueError, match="cache=object: paged caches"):
        hf.hf_attention_forward(_layer(), q, k, v, None, cache=object())
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match=f"sliding_window must be a positive int.*{bad!r}"):
            hf.hf_attention_forward(_layer(), q, k, v, None, sliding_window=bad)
    with pytest.warns(UserWarning, match="output_attentions=True: .* returns None"):
        _, weights = hf.hf_attention_forward(_layer(), q, k, v, None, output_attentions=True)
    assert weights is None
    # inputs are never modified
    before = [x.clone() for x in (q, k, v)]
    hf.hf_attention_forward(_layer(), q, k, v, None, sliding_window=2)
    for x, y in zip((q, k, v), before, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
