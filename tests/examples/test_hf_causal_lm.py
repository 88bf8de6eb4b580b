"""examples/hf_causal_lm.py against transformers itself: for each family (Llama, Qwen2,
Qwen3, Mistral, Gemma 2, gpt-oss) a tiny random 2-layer model is built by transformers,
written with ``save_pretrained`` (safetensors) into ``tmp_path`` and loaded by the
example's code; nothing is downloaded.

- logits of a left-padded batch of prompts of different lengths equal transformers'
  float64 logits (eager attention, ``attention_mask`` and the position ids ``generate``
  uses) to ``1e-9`` relative to the largest logit;
- cached batched greedy generation equals ``generate(do_sample=False)`` token for token.

transformers computes RMSNorm and the RoPE tables in float32 even in a float64 model
(``.to(torch.float32)``, ``.float()``, an inv_freq ladder built with ``dtype=torch.float``):
those islands round to ~1e-7. The float64 oracle is transformers' own code run with them
promoted (``torch.float32``, ``torch.float`` and ``Tensor.float`` mean float64 inside
:func:`hf_float64`, and Gemma's embedding scale, a float32 buffer, is remade in float64);
the model as shipped is also compared, to float32 rounding.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _load_example():
    return load_script("examples/hf_causal_lm.py")


hf = _load_example()

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,  # larger than the default: softcaps, routers, windows all matter
    attn_implementation="eager",
)
PROMPT_LENGTHS = (7, 3, 10)
NEW_TOKENS = 6
PAD = 0

# family -> (config class, model class, config fields beyond COMMON)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500.0,
            },
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=8, sliding_window=4)),
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
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
                "rope_theta": 150000.0,
            },
        ),
    ),
}


def _op_has_sinks() -> bool:
    from arrayattn import scaled_dot_product_attention

    return "sinks" in inspect.signature(scaled_dot_product_attention).parameters


@contextlib.contextmanager
def hf_float64():
    """Run transformers' code with its float32 islands (norms, RoPE) in float64."""
    saved = (torch.float32, torch.float, torch.Tensor.float)
    torch.float32 = torch.float64
    torch.float = torch.float64
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved


def build(family: str, directory: Path, shard: bool = False):
    """A tiny random model of ``family``, saved to ``directory``; returns the float64
    oracle model (RoPE tables rebuilt in float64)."""
    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # the init leaves some parameters at 0 or 1: perturb them all
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(directory, max_shard_size="20KB" if shard else "5GB")
    model = model.double()
    with hf_float64():
        for name, module in list(model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding"):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], type(module)(model.config).double())
            if hasattr(module, "scalar_embed_scale"):  # Gemma's sqrt(hidden), made in float32
                module.embed_scale = torch.tensor(module.scalar_embed_scale, dtype=torch.float64)
    return model


_BUILT: dict[str, tuple[Path, object]] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family)`` -> (directory, float64 oracle), built once per module (the llama
    checkpoint sharded)."""

    def get(family: str):
        if family not in _BUILT:
            d = tmp_path_factory.mktemp(family)
            _BUILT[family] = (d, build(family, d, shard=family == "llama"))
        return _BUILT[family]

    yield get
    _BUILT.clear()


def padded_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, COMMON["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
    L = max(PROMPT_LENGTHS)
    ids = np.full((len(prompts), L), PAD, dtype=np.int64)
    mask = np.zeros((len(prompts), L), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = p
        mask[b, L - len(p) :] = 1
    return prompts, ids, mask


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = torch.from_numpy(mask)
    position_ids = (m.cumsum(-1) - 1).clamp(min=0)  # as generate() builds them
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=m, position_ids=position_ids)
    return out.logits.numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_generation_equal_transformers(family, saved):
    if family == "gpt_oss" and not _op_has_sinks():
        pytest.skip("scaled_dot_product_attention has no sinks= yet (issue 14, sinks branch)")
    tmp_path, oracle = saved(family)
    if family == "llama":  # the sharded layout: an index and several files
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = hf.CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    prompts, ids, mask = padded_batch()
    real = mask.astype(bool)

    got = np.asarray(model(ids, lengths=PROMPT_LENGTHS))
    with hf_float64():
        expected = hf_logits(oracle, ids, mask)
    err = np.max(np.abs(got[real] - expected[real])) / np.max(np.abs(expected[real]))
    assert err <= 1e-9, f"{family}: max relative logit error {err:.3g}"
    # transformers as shipped (float32 norms, RoPE tables and softmax) on the unpadded
    # row (its float32 softmax turns padded rows into NaN that reach the others through
    # 0 * NaN): float32 rounding away
    full = int(np.argmax(PROMPT_LENGTHS))
    shipped = hf_logits(oracle, ids, mask)[full]
    assert np.max(np.abs(got[full] - shipped)) / np.max(np.abs(shipped)) < 1e-5

    def hf_generate(eos):
        with hf_float64(), torch.no_grad():
            seq = oracle.generate(
                input_ids=torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=PAD,
                eos_token_id=eos,
            )
        return seq[:, ids.shape[1] :].numpy()

    expected = hf_generate(None)
    new = model.generate(prompts, NEW_TOKENS, eos_token_id=None, pad_token_id=PAD)
    np.testing.assert_array_equal(new, expected)
    # A row that emits EOS pads after it; generation stops once every row has.
    eos = int(expected[0, 1])
    expected = hf_generate(eos)
    new = model.generate(prompts, NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD)
    np.testing.assert_array_equal(new, expected)
    assert (new[0, 2:] == PAD).all()


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gpt_oss"])
def test_paged_cache_and_float32_generation(saved, family):
    """The paged cache decodes the same tokens (qk-norm; softcap and windows; sinks);
    float32 weights give float32 logits close to float64."""
    if family == "gpt_oss" and not _op_has_sinks():
        pytest.skip("scaled_dot_product_attention has no sinks= yet (issue 14, sinks branch)")
    tmp_path, _ = saved(family)
    prompts, ids, _ = padded_batch(1)
    m64 = hf.CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    m32 = hf.CausalLM.from_pretrained(tmp_path)
    contiguous = m64.generate(prompts, NEW_TOKENS)
    np.testing.assert_array_equal(m64.generate(prompts, NEW_TOKENS, paged=True), contiguous)
    l64 = m64(ids, lengths=PROMPT_LENGTHS)
    l32 = m32(ids, lengths=PROMPT_LENGTHS)
    assert l32.dtype == np.float32
    real = ids != PAD
    np.testing.assert_allclose(l32[real], l64[real], rtol=0, atol=1e-4 * np.abs(l64).max())


def test_sampling_is_seeded_and_respects_top_k(saved):
    tmp_path, _ = saved("mistral")
    model = hf.CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    prompts, _, _ = padded_batch(2)
    kw = dict(temperature=0.9, top_k=5, top_p=0.9, seed=3)
    a = model.generate(prompts, NEW_TOKENS, **kw)
    np.testing.assert_array_equal(a, model.generate(prompts, NEW_TOKENS, **kw))
    one = model.generate(prompts, NEW_TOKENS, temperature=1.0, top_k=1, seed=4)
    np.testing.assert_array_equal(one, model.generate(prompts, NEW_TOKENS))  # top-1 = greedy


def test_bf16_safetensors_are_read_exactly(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"w": w, "h": torch.arange(4, dtype=torch.float16)}, tmp_path / "a.safetensors")
    got = hf.read_safetensors(tmp_path / "a.safetensors")
    assert got["w"].dtype == np.float32 and got["h"].dtype == np.float16
    np.testing.assert_array_equal(got["w"], w.float().numpy())
    np.testing.assert_array_equal(got["h"], np.arange(4, dtype=np.float16))


def test_layer_windows_from_config_fields():
    base = {"num_hidden_layers": 4, "sliding_window": 8}
    assert hf.layer_windows(base) == [(7, 0)] * 4  # Mistral: every layer
    assert hf.layer_windows({**base, "sliding_window_pattern": 2}) == [(7, 0), None] * 2
    qwen = {**base, "use_sliding_window": True, "max_window_layers": 3}
    assert hf.layer_windows(qwen) == [None, None, None, (7, 0)]
    assert hf.layer_windows({**qwen, "use_sliding_window": False}) == [None] * 4
    assert hf.layer_windows({**base, "sliding_window": None}) == [None] * 4
    for family in ("gemma2", "gpt_oss"):  # old configs without layer_types alternate
        assert hf.layer_windows({**base, "model_type": family}) == [(7, 0), None] * 2


def test_command_line(saved, tmp_path, capsys):
    tmp_path = Path(shutil.copytree(saved("llama")[0], tmp_path / "llama"))  # gets a tokenizer
    code = hf.main(
        ["--model-dir", str(tmp_path), "--prompt-ids", "5,6,7;8,9", "--max-new-tokens", "3"]
    )
    assert code == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert lines[0].startswith("5,6,7 -> ") and lines[1].startswith("8,9 -> ")
    assert "tokens/s" in lines[-1]
    assert "3/3 steps" in out.err  # the progress bar
    # --shared-prefix: the common "5,6" once in a cascade cache, the same tokens.
    shared = ["--model-dir", str(tmp_path), "--prompt-ids", "5,6,7;5,6,9", "--no-progress"]
    assert hf.main([*shared, "--shared-prefix"]) == 0
    cascade = capsys.readouterr().out.splitlines()[:2]
    assert hf.main(shared) == 0
    assert capsys.readouterr().out.splitlines()[:2] == cascade
    # With a tokenizer.json the prompts are text (a word-level tokenizer over the vocab).
    tokenizers = pytest.importorskip("tokenizers")
    Tokenizer, models, pre_tokenizers = (
        tokenizers.Tokenizer,
        tokenizers.models,
        tokenizers.pre_tokenizers,
    )

    vocab = {f"w{i}": i for i in range(COMMON["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    args = ["--model-dir", str(tmp_path), "--max-new-tokens", "2", "--no-progress"]
    assert hf.main([*args, "--prompt", "w5 w6 w7", "--prompt", "w8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("'w5 w6 w7 w") and lines[1].startswith("'w8 w")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(SystemExit):  # no tokenizer.json and no --prompt-ids
        hf.main(["--model-dir", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.main(["--model-dir", str(tmp_path / "nowhere"), "--prompt-ids", "1"])


def test_loading_errors_name_the_problem(saved):
    config, tensors = hf.load_model_dir(saved("llama")[0])
    assert len(tensors) == len(
        json.loads((saved("llama")[0] / "model.safetensors.index.json").read_text())["weight_map"]
    )
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    # a CheckpointError (a ValueError), never a KeyError (issue 35)
    with pytest.raises(hf.CheckpointError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        hf.CausalLM.from_state(config, missing)
    with pytest.raises(hf.CheckpointError, match="does not use.*model.extra"):
        hf.CausalLM.from_state(config, {**tensors, "model.extra": np.zeros(2)})
    with pytest.raises(ValueError, match="model_type must be one of.*'gpt2'"):
        hf.CausalLM.from_state({**config, "model_type": "gpt2"}, tensors)
    with pytest.raises(ValueError, match="quantized"):
        hf.CausalLM.from_state(
            {**config, "quantization_config": {"quant_method": "mxfp4"}}, tensors
        )
    with pytest.raises(ValueError, match="--prompt-ids must be comma-separated ints"):
        hf.parse_prompt_ids("1,x;2")


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "layout", ["list_in_generation_config", "list_in_config_only", "generation_config_without_eos"]
)
def test_eos_and_pad_ids_are_found_where_generate_finds_them(saved, tmp_path, capsys, layout):
    """Checkpoints often carry one EOS id in config.json and a list in
    generation_config.json: generate() uses the latter (the whole file, when there is one)
    and, without a pad id, pads finished rows with the first EOS id. The runner must stop
    and pad exactly where generate() does."""
    src, oracle = saved("llama")
    d = Path(shutil.copytree(src, tmp_path / "llama"))
    prompts, ids, mask = padded_batch()
    free = hf.CausalLM.from_pretrained(d, dtype=np.float64).generate(prompts, NEW_TOKENS)
    stop, other = int(free[0, 1]), int(free[1, 0])  # row 0 ends at step 2, row 1 at once
    eos_list = [stop, other] if stop != other else [stop]
    config, gen = d / "config.json", d / "generation_config.json"
    _edit_json(config, pad_token_id=None, eos_token_id=other)
    if layout == "list_in_generation_config":
        _edit_json(gen, pad_token_id=None, eos_token_id=eos_list)
    elif layout == "list_in_config_only":
        gen.unlink()
        _edit_json(config, eos_token_id=eos_list)
    else:
        _edit_json(gen, pad_token_id=None, eos_token_id=None)

    # transformers' own reading of the directory, and its generate() with it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d).generation_config
    special = hf.generation_token_ids(json.loads(config.read_text()), d)
    expected_eos = loaded.eos_token_id
    if isinstance(expected_eos, int):
        expected_eos = [expected_eos]
    assert special["eos_token_id"] == expected_eos
    assert special["pad_token_id"] == loaded.pad_token_id is None
    oracle.generation_config = loaded
    with hf_float64(), torch.no_grad():
        seq = oracle.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    expected = seq[:, ids.shape[1] :].numpy()

    model = hf.CausalLM.from_pretrained(d, dtype=np.float64)
    new = model.generate(
        prompts, NEW_TOKENS, **{k: special[k] for k in ("eos_token_id", "pad_token_id")}
    )
    np.testing.assert_array_equal(new, expected)
    if layout == "generation_config_without_eos":
        assert new.shape[1] == NEW_TOKENS  # no EOS at all: runs to the end, as generate()
    else:
        assert (new[0, 2:] == eos_list[0]).all() and (new[1, 1:] == eos_list[0]).all()

    # The command line finds and uses the same ids.
    ids_arg = ";".join(",".join(map(str, p)) for p in prompts)
    args = ["--model-dir", str(d), "--prompt-ids", ids_arg, "--dtype", "float64", "--no-progress"]
    assert hf.main([*args, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    rows = [
        line.split(" -> ")[1] for line in capsys.readouterr().out.splitlines() if " -> " in line
    ]
    assert [list(map(int, r.split(","))) for r in rows] == new.tolist()


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_shared_prefix_generation_equals_transformers(saved, family):
    """Prompts sharing a prefix, decoded from a CascadeKVCache per layer (contiguous and
    paged suffixes; Gemma 2's sliding windows cut the prefix; gpt-oss sinks): the greedy
    tokens of transformers' generate(), with an EOS list and no pad id (finished rows pad
    with the first EOS id), and of the per-row caches."""
    if family == "gpt_oss" and not _op_has_sinks():
        pytest.skip("scaled_dot_product_attention has no sinks= yet (issue 14, sinks branch)")
    tmp_path, oracle = saved(family)
    model = hf.CausalLM.from_pretrained(tmp_path, dtype=np.float64)
    rng = np.random.default_rng(3)
    prefix = rng.integers(2, COMMON["vocab_size"], 9).tolist()
    prompts = [prefix + rng.integers(2, COMMON["vocab_size"], n).tolist() for n in (3, 1, 5)]
    assert model.shared_prefix_length(prompts, True) == 9
    assert model.shared_prefix_length(prompts, None) == 0  # below SHARED_PREFIX_MIN
    L = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), L), dtype=np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :], mask[b, L - len(p) :] = p, 1
    free = model.generate(prompts, NEW_TOKENS, shared_prefix=False)
    eos = [int(free[0, 1]), int(free[2, 3])]
    with hf_float64(), torch.no_grad():
        seq = oracle.generate(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
        )  # fmt: skip
    expected = seq[:, L:].numpy()
    for paged in (False, True):
        new = model.generate(prompts, NEW_TOKENS, eos_token_id=eos, pad_token_id=None,
                             shared_prefix=True, paged=paged)  # fmt: skip
        np.testing.assert_array_equal(new, expected)
    per_row = model.generate(prompts, NEW_TOKENS, eos_token_id=eos, shared_prefix=False)
    np.testing.assert_array_equal(per_row, expected)


def _cupy_device():
    """CuPy when it has a CUDA device, else ``None`` (the GPU tests below then skip)."""
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no CuPy, no driver, no device
        return None


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_cupy_logits_and_greedy_generation_equal_transformers(family, saved):
    """The runner on CuPy arrays (the fused kernels: prefill, split-KV decode, and the
    paged cache's kernel) against transformers' float64 oracle on the CPU: logits to
    1e-9 in float64, greedy tokens equal with both cache kinds."""
    cupy = _cupy_device()
    if cupy is None:
        pytest.skip("no CUDA device through CuPy")
    if family == "gpt_oss" and not _op_has_sinks():
        pytest.skip("scaled_dot_product_attention has no sinks= yet")
    tmp_path, oracle = saved(family)
    model = hf.CausalLM.from_pretrained(tmp_path, xp=cupy, dtype=np.float64)
    prompts, ids, mask = padded_batch()
    real = mask.astype(bool)
    got = cupy.asnumpy(model(cupy.asarray(ids), lengths=PROMPT_LENGTHS))
    with hf_float64():
        expected = hf_logits(oracle, ids, mask)
    err = np.max(np.abs(got[real] - expected[real])) / np.max(np.abs(expected[real]))
    assert err <= 1e-9, f"{family} on CuPy: max relative logit error {err:.3g}"
    with hf_float64(), torch.no_grad():
        seq = oracle.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    expected_tokens = seq[:, ids.shape[1] :].numpy()
    for paged in (False, True):
        new = model.generate(prompts, NEW_TOKENS, eos_token_id=None, pad_token_id=PAD,
                             paged=paged)  # fmt: skip
        np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(new)), expected_tokens)
