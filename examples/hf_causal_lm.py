"""Hugging Face causal language models (Llama, Qwen2, Qwen3, Mistral, Gemma 2, gpt-oss) run
on arrayattn layers, with batched generation from a per-sequence KV cache.

A model directory as ``save_pretrained`` writes it (``config.json`` and ``*.safetensors``,
sharded through ``model.safetensors.index.json`` or not; never downloaded here) is loaded
into plain dicts of arrays on NumPy or CuPy. Each decoder layer is an
:class:`arrayattn.nn.MultiHeadAttention` configured from the config (GQA, qk-norm,
sliding windows per layer from ``layer_types`` / ``sliding_window_pattern``, Gemma 2's
softcaps and query scale, gpt-oss sinks, RoPE and its scaling from ``rope_parameters`` /
``rope_scaling``) followed by the family's MLP (SwiGLU, Gemma's tanh-GELU, gpt-oss's
top-k mixture of experts). Prompts of different lengths are left-padded into one batch,
prefilled in one call per layer and decoded together: every row of the cache appends at
its own position. Prompts that share a prefix (``--shared-prefix``, or detected when the
common prefix has at least ``SHARED_PREFIX_MIN`` tokens) are decoded from a
:class:`arrayattn.nn.CascadeKVCache`: the common prefix prefilled once and held once, each
row's own rest in its suffix.

    python examples/hf_causal_lm.py --model-dir DIR --prompt "Hello" --prompt "Once upon"
    python examples/hf_causal_lm.py --model-dir DIR --prompt-ids "1,2,3;4,5" --max-new-tokens 8
        [--device cpu|cuda] [--dtype float32|float64|float16] [--temperature 0.8 --top-k 50]
        [--top-p 0.9] [--seed 0] [--cache contiguous|paged] [--shared-prefix]

Prompts are text when the directory has ``tokenizer.json`` (read with the ``tokenizers``
package), else token ids: ``--prompt-ids`` takes comma-separated ids, prompts separated
by ``;``.

Nothing in the directory is trusted: files are read through ``arrayattn.nn.checkpoint``
(paths kept inside the directory, safetensors headers validated against the file before
any data is read), the config is checked field by field and every tensor's shape and
dtype against it before any tensor data is read, and weights holding NaN or Inf are
refused (``--allow-nonfinite`` loads them). Every problem is a ``CheckpointError``
naming the file and the tensor or field; on the command line it is one line on stderr
and exit status 1 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import arrayattn as aa
from arrayattn.nn import (
    CascadeKVCache,
    MultiHeadAttention,
    embedding,
    gelu,
    linear,
    read_safetensors,
    silu,
)
from arrayattn.nn.checkpoint import (
    CheckpointError,
    TensorInfo,
    checkpoint_file,
    read_checkpoint_headers,
    read_checkpoint_tensors,
    read_json,
    regular_file_size,
)
from arrayattn.ops import rms_norm

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss")
SHARED_PREFIX_MIN = 64
"""Common prompt tokens from which :meth:`CausalLM.generate` uses a cascade cache unasked."""

__all__ = [
    "CausalLM",
    "CheckpointError",
    "check_config",
    "check_attention",
    "check_tensors",
    "inspect_model_dir",
    "load_model_dir",
    "main",
    "cli",
    "read_safetensors",
]

# -- reading a model directory -----------------------------------------------------------
# Every file is read through arrayattn.nn.checkpoint, which trusts nothing in it: paths
# stay inside the directory, safetensors headers are validated against the file before
# any data is read, JSON is strict. The config is then checked here, field by field,
# and every tensor's declared shape and dtype against it, before any tensor data is read.
# Every problem is a CheckpointError (a ValueError) naming the file and tensor or field.

# field -> (kind, required): "count" an int >= 1, "index" an int >= 0, "positive" a
# finite number > 0, "nonneg" a finite number >= 0, "bool", "str"
CONFIG_FIELDS: dict[str, tuple[str, bool]] = {
    "vocab_size": ("count", True),
    "hidden_size": ("count", True),
    "intermediate_size": ("count", True),
    "num_hidden_layers": ("count", True),
    "num_attention_heads": ("count", True),
    "num_key_value_heads": ("count", False),
    "head_dim": ("count", False),
    "max_position_embeddings": ("count", False),
    "sliding_window": ("count", False),
    "sliding_window_pattern": ("count", False),
    "max_window_layers": ("index", False),
    "num_local_experts": ("count", False),
    "num_experts_per_tok": ("count", False),
    "rms_norm_eps": ("nonneg", False),
    "rope_theta": ("positive", False),
    "partial_rotary_factor": ("positive", False),
    "query_pre_attn_scalar": ("positive", False),
    "attn_logit_softcapping": ("positive", False),
    "final_logit_softcapping": ("positive", False),
    "swiglu_limit": ("positive", False),
    "swiglu_alpha": ("positive", False),
    "attention_bias": ("bool", False),
    "mlp_bias": ("bool", False),
    "use_sliding_window": ("bool", False),
    "tie_word_embeddings": ("bool", False),
    "model_type": ("str", True),
    "hidden_act": ("str", False),
    "hidden_activation": ("str", False),
}
LAYER_TYPES = ("full_attention", "sliding_attention")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16")


def _field_ok(kind: str, value: Any) -> bool:
    if kind in ("count", "index"):
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= (1 if kind == "count" else 0)
        )
    if kind in ("positive", "nonneg"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return math.isfinite(value) and (value > 0 if kind == "positive" else value >= 0)
    return isinstance(value, bool if kind == "bool" else str)


_EXPECTED = {
    "count": "an int >= 1",
    "index": "an int >= 0",
    "positive": "a finite number > 0",
    "nonneg": "a finite number >= 0",
    "bool": "true or false",
    "str": "a string",
}


def check_token_ids(config: Mapping[str, Any], source: str, vocab_size: int) -> None:
    """``bos_token_id``/``pad_token_id`` (an int) and ``eos_token_id`` (an int or a list
    of ints) of a config or ``generation_config.json``: ``null`` or 64-bit ints, else a
    :class:`CheckpointError` naming ``source`` and the field. Ids outside the vocabulary
    are allowed, as transformers allows them: they are never looked up in the embedding
    (a pad id only fills finished rows; old LLaMA configs carry ``pad_token_id: -1``).

    Examples:
        >>> check_token_ids({"eos_token_id": [1, 2], "pad_token_id": None}, "config.json", 8)
        >>> try:
        ...     check_token_ids({"eos_token_id": "2"}, "config.json", 8)
        ... except CheckpointError as e:
        ...     print(e)
        config.json: eos_token_id is '2', expected null, an int or a list of them
    """
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and -(2**63) <= t < 2**63 for t in ids
        ):
            also = " or a list of them" if key == "eos_token_id" else ""
            raise CheckpointError(
                f"{source}: {key} is {value!r:.80}, expected null, an int{also}"
            )


def check_config(config: Any, source: str = "config") -> None:
    """Raise :class:`CheckpointError` naming ``source`` (the ``config.json`` path) and the
    field when ``config`` cannot describe a model here: not an object; a family other
    than :data:`FAMILIES` or a quantized checkpoint; a missing required size; a size,
    flag or number of the wrong type or out of range (zero, negative, a float or string
    for an int, NaN); heads not dividing the width (without ``head_dim``) or key/value
    heads not dividing the heads; more experts per token than experts; ``layer_types``
    of the wrong length or with unknown types; an unknown activation; token ids outside
    the vocabulary. Sizes are checked against the checkpoint's tensors, and then the
    RoPE fields, by :func:`check_tensors`; nothing here allocates in proportion to them.

    Examples:
        >>> config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
        ...           "intermediate_size": 12, "num_hidden_layers": 1,
        ...           "num_attention_heads": 3}
        >>> try:
        ...     check_config(config, "config.json")
        ... except CheckpointError as e:
        ...     print(str(e)[:62])
        config.json: hidden_size=8 is not divisible by num_attention_h
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(config).__name__}")
    family = config.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{source}: model_type must be one of {FAMILIES}, got {family!r:.80}")
    if config.get("quantization_config"):
        raise CheckpointError(
            f"{source}: quantized checkpoints (quantization_config, e.g. gpt-oss MXFP4) "
            "are not supported: use a BF16/F16/F32 checkpoint"
        )
    required = dict.fromkeys(("num_local_experts", "num_experts_per_tok"), family == "gpt_oss")
    for key, (kind, needed) in CONFIG_FIELDS.items():
        value = config.get(key)
        if value is None:
            if needed or required.get(key):
                raise CheckpointError(
                    f"{source}: required field {key!r} is missing (expected {_EXPECTED[kind]})"
                )
            continue
        if not _field_ok(kind, value):
            raise CheckpointError(
                f"{source}: {key} is {type(value).__name__} {value!r:.80}, expected "
                f"{_EXPECTED[kind]}"
            )
    H, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    if config.get("head_dim") is None and H % heads:
        raise CheckpointError(
            f"{source}: hidden_size={H} is not divisible by num_attention_heads={heads} "
            "and there is no head_dim"
        )
    if heads % kv:
        raise CheckpointError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
        )
    if family == "gpt_oss" and config["num_experts_per_tok"] > config["num_local_experts"]:
        raise CheckpointError(
            f"{source}: num_experts_per_tok={config['num_experts_per_tok']} exceeds "
            f"num_local_experts={config['num_local_experts']}"
        )
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            got = f"{len(types)} entries" if isinstance(types, list) else repr(types)[:80]
            raise CheckpointError(
                f"{source}: layer_types must be a list of num_hidden_layers={n} strings, got {got}"
            )
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise CheckpointError(
                f"{source}: layer_types holds {unknown}, expected only {LAYER_TYPES}"
            )
    if family != "gpt_oss":
        act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
        try:
            _activation(act)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
    check_token_ids(config, source, config["vocab_size"])


def check_attention(config: Mapping[str, Any], source: str = "config") -> None:
    """The RoPE fields and the attention layer's own checks (``rope_kwargs_from_config``,
    :class:`MultiHeadAttention`: an unknown ``rope_type``, a missing scaling key, an odd
    head dim) on one layer of each kind, as a :class:`CheckpointError` naming ``source``.
    Called by :func:`check_tensors` once the sizes are known to fit real tensors."""
    types = config.get("layer_types") or [None]
    kinds: dict[Any, int] = {}
    for i, t in enumerate(types):
        kinds.setdefault(t, i)
    for i in [*kinds.values(), int(config["num_hidden_layers"]) - 1]:
        try:
            attention_module(config, i)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None


class TensorSpec(NamedTuple):
    """What :func:`check_tensors` reads of a tensor: its shape, its dtype's name, and
    where it comes from (a file, for the messages)."""

    shape: tuple[int, ...]
    dtype: str
    where: str


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model reads (``lm_head.weight`` too, which
    a checkpoint with tied embeddings leaves out). ``config`` must have passed
    :func:`check_config`.

    Examples:
        >>> config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
        ...           "intermediate_size": 12, "num_hidden_layers": 1,
        ...           "num_attention_heads": 2, "num_key_value_heads": 1}
        >>> expected_shapes(config)["model.layers.0.self_attn.k_proj.weight"]
        (4, 8)
    """
    family = config["model_type"]
    V, H, inter = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    shapes["lm_head.weight"] = (V, H)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family == "gemma2":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(int(config["num_hidden_layers"])):
        pre = f"model.layers.{i}."
        for name, shape in attention_module(config, i).param_shapes().items():
            shapes[pre + "self_attn." + name] = shape
        for norm in norms:
            shapes[f"{pre}{norm}.weight"] = (H,)
        m = pre + "mlp."
        if family == "gpt_oss":
            E = config["num_local_experts"]
            shapes.update(
                {
                    m + "router.weight": (E, H),
                    m + "router.bias": (E,),
                    m + "experts.gate_up_proj": (E, H, 2 * inter),
                    m + "experts.gate_up_proj_bias": (E, 2 * inter),
                    m + "experts.down_proj": (E, inter, H),
                    m + "experts.down_proj_bias": (E, H),
                }
            )
        else:
            for name, shape in (
                ("gate_proj", (inter, H)),
                ("up_proj", (inter, H)),
                ("down_proj", (H, inter)),
            ):
                shapes[f"{m}{name}.weight"] = shape
                if config.get("mlp_bias"):
                    shapes[f"{m}{name}.bias"] = shape[:1]
    return shapes


_LAYER = re.compile(r"model\.layers\.(\d{1,12})\.")


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # old checkpoints' RoPE buffers


def check_tensors(
    config: Mapping[str, Any], tensors: Mapping[str, TensorSpec], source: str = "config"
) -> None:
    """Raise :class:`CheckpointError` when the checkpoint's tensors (name ->
    :class:`TensorSpec`, from headers or arrays) do not fit ``config`` (checked by
    :func:`check_config`; ``source`` names it): ``num_hidden_layers`` other than the
    layers the tensors hold (checked first: ``10**9`` layers builds nothing), a missing
    or unused name, a wrong shape (``vocab_size`` ``10**12`` against a real embedding),
    a dtype that is not floating. Messages name the tensor's file.

    Examples:
        >>> config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
        ...           "intermediate_size": 12, "num_hidden_layers": 10**9,
        ...           "num_attention_heads": 2}
        >>> specs = {"model.layers.0.input_layernorm.weight": TensorSpec((8,), "F32", "a")}
        >>> try:
        ...     check_tensors(config, specs, "config.json")
        ... except CheckpointError as e:
        ...     print(str(e)[:61])
        config.json: num_hidden_layers is 1000000000 but the checkpoi
    """
    family, n = config["model_type"], int(config["num_hidden_layers"])
    layers = sorted({int(m.group(1)) for k in tensors if (m := _LAYER.match(k))})
    if len(layers) != n or (layers and layers[-1] != n - 1):
        beyond = [i for i in layers if i >= n]
        if beyond:
            name = next(k for k in tensors if k.startswith(f"model.layers.{beyond[0]}."))
            raise CheckpointError(
                f"{tensors[name].where}: tensor {name!r} belongs to layer {beyond[0]}, but "
                f"{source} says num_hidden_layers is {n}"
            )
        held = f"layers {layers[0]}..{layers[-1]}" if layers else "no layer"
        raise CheckpointError(
            f"{source}: num_hidden_layers is {n} but the checkpoint's tensors hold {held} "
            f"({len(layers)} distinct; tensors model.layers.N.*)"
        )
    # the sizes against two real tensors first: everything built below is then bounded
    # by the files' sizes (a head_dim of 10**9 would build a RoPE ladder that large)
    H, heads = config["hidden_size"], config["num_attention_heads"]
    D = config.get("head_dim") or H // heads
    for name, shape in (
        ("model.embed_tokens.weight", (config["vocab_size"], H)),
        ("model.layers.0.self_attn.q_proj.weight", (heads * D, H)),
    ):
        if name not in tensors:
            raise CheckpointError(
                f"checkpoint has no tensor {name!r}, which {source}'s {family} model needs"
            )
        if tensors[name].shape != shape:
            raise CheckpointError(
                f"{tensors[name].where}: tensor {name!r} has shape {tensors[name].shape}, "
                f"expected {shape} from {source} (vocab_size={config['vocab_size']}, "
                f"hidden_size={H}, num_attention_heads={heads}, head_dim={D})"
            )
    check_attention(config, source)
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in tensors and k != "lm_head.weight"]
    if missing:
        raise CheckpointError(
            f"checkpoint has no tensor {missing[0]!r} ({len(missing)} missing), which "
            f"{source}'s {family} model with {n} layers needs"
        )
    unused = sorted(k for k in tensors if k not in expected and not _ignored(k))
    if unused:
        raise CheckpointError(
            f"checkpoint tensors this {family} model ({source}) does not use: {unused[:8]} "
            f"(in {tensors[unused[0]].where})"
        )
    sizes = ", ".join(
        f"{k}={config[k]}"
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_local_experts",
        )
        if config.get(k) is not None
    )
    for name, spec in tensors.items():
        if _ignored(name):
            continue
        if spec.shape != expected[name]:
            raise CheckpointError(
                f"{spec.where}: tensor {name!r} has shape {spec.shape}, expected "
                f"{expected[name]} from {source} ({sizes})"
            )
        if spec.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{spec.where}: tensor {name!r} has dtype {spec.dtype}, expected a floating "
                f"dtype (BF16, F16, F32, F64)"
            )


def _narrower_than_float32(dtype: Any) -> bool:
    try:
        return dtype is not None and np.dtype(dtype).itemsize < 4
    except TypeError:
        return True


def _spec_of_array(name: str, a: Any) -> TensorSpec:
    if not isinstance(name, str):
        raise CheckpointError(f"checkpoint tensor names must be strings, got {name!r:.80}")
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise CheckpointError(f"checkpoint tensor {name!r} is a {type(a).__name__}, not an array")
    dtype = str(getattr(a.dtype, "name", a.dtype)).rsplit(".", 1)[-1]
    return TensorSpec(tuple(int(d) for d in a.shape), dtype, "checkpoint")


def inspect_model_dir(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """``(config, headers)`` of a model directory, everything checked but no tensor data
    read (milliseconds): ``config.json`` (:func:`check_config`; ``generation_config.json``'s
    token ids checked, see :func:`generation_token_ids`), every file's header against its
    size, every tensor's declared name, shape and dtype against the config
    (:func:`check_tensors`). See :func:`load_model_dir`.

    Examples:
        >>> import tempfile
        >>> try:
        ...     inspect_model_dir(tempfile.mkdtemp())
        ... except FileNotFoundError as e:
        ...     print(str(e)[-42:])
        has no config.json (a save_pretrained dir)
    """
    d = Path(model_dir)
    if not os.path.lexists(d / "config.json"):
        raise FileNotFoundError(f"--model-dir {d} has no config.json (a save_pretrained dir)")
    config_path = checkpoint_file(d, "config.json")
    config = read_json(config_path)
    check_config(config, str(config_path))
    if os.path.lexists(d / "generation_config.json"):
        gen_path = checkpoint_file(d, "generation_config.json")
        gen = read_json(gen_path)
        check_token_ids(gen, str(gen_path), config["vocab_size"])
    headers = read_checkpoint_headers(d)
    specs = {n: TensorSpec(h.shape, h.dtype, str(h.file)) for n, h in headers.items()}
    check_tensors(config, specs, str(config_path))
    return config, headers


def load_model_dir(
    model_dir: str | Path, *, check_finite: bool = True
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config, tensors)`` of a Hugging Face model directory: ``config.json`` and every
    tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json`` lists
    (else all ``*.safetensors`` files). The token ids generation uses are
    :func:`generation_token_ids`'s.

    Nothing is trusted and nothing large is allocated before it is checked
    (:func:`inspect_model_dir`: the config, then every file's header against its size and
    every tensor's declared shape and dtype against the config); then exactly the
    tensors' bytes are read. No file outside ``model_dir`` is read (an index naming
    ``../x.safetensors``, an absolute path or a symlink out is refused).
    ``check_finite``: a weight holding NaN or Inf is an error naming its file and tensor
    (``False`` loads it). Every problem is a :class:`CheckpointError` naming the file and
    the tensor or field; a missing ``config.json`` a ``FileNotFoundError``."""
    config, headers = inspect_model_dir(model_dir)
    names = [n for n in headers if not _ignored(n)]
    return config, read_checkpoint_tensors(headers, names, check_finite=check_finite)


GENERATION_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def generation_token_ids(
    config: Mapping[str, Any], model_dir: str | Path | None = None
) -> dict[str, Any]:
    """The special token ids ``generate()`` uses, found where transformers finds them:
    all from ``generation_config.json`` when the directory has one (ids it lacks are
    ``None``, as in transformers, even where ``config.json`` has them), else from the
    model config (its top level, then a ``decoder``/``generator``/``text_config`` section, as
    ``GenerationConfig.from_model_config`` reads it). ``eos_token_id`` comes back as a
    list (one id or several, in the file's order) or ``None``.

    Examples:
        >>> generation_token_ids({"eos_token_id": 2, "pad_token_id": None})
        {'bos_token_id': None, 'eos_token_id': [2], 'pad_token_id': None}
    """
    source: Mapping[str, Any] = config
    if model_dir is not None and os.path.lexists(Path(model_dir) / "generation_config.json"):
        gen_path = checkpoint_file(Path(model_dir), "generation_config.json")
        source = read_json(gen_path)
        check_token_ids(source, str(gen_path), int(config.get("vocab_size") or 0))
    out: dict[str, Any] = {}
    for key in GENERATION_TOKENS:
        value = source.get(key)
        if value is None and source is config:
            for section in ("decoder", "generator", "text_config"):
                sub = config.get(section)
                if isinstance(sub, Mapping) and sub.get(key) is not None:
                    value = sub[key]
                    break
        out[key] = value
    eos = out["eos_token_id"]
    if eos is not None:
        out["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos)
    return out


# -- the model ---------------------------------------------------------------------------
def layer_window(config: Mapping[str, Any], i: int) -> tuple[int, int] | None:
    """The sliding window of layer ``i`` in arrayattn's ``(left, right)`` convention: HF's
    ``sliding_window=W`` (W keys including the query's own) is ``(W - 1, 0)``.

    Which layers slide: ``layer_types`` (``"sliding_attention"``) when the config has it,
    else Gemma's ``sliding_window_pattern`` (every layer but each ``pattern``-th; Gemma 2
    and gpt-oss configs without either alternate, as their config classes do), else
    Qwen2's ``use_sliding_window`` from layer ``max_window_layers`` on, else (Mistral)
    every layer when ``sliding_window`` is set. Nothing is built per layer, so a config
    claiming 10**9 layers costs nothing here.

    Examples:
        >>> layer_window({"num_hidden_layers": 3, "sliding_window": 4,
        ...               "layer_types": ["sliding_attention", "full_attention"]}, 0)
        (3, 0)
    """
    w = config.get("sliding_window")
    if w is None:
        return None
    win = (int(w) - 1, 0)
    if config.get("layer_types"):
        return win if config["layer_types"][i] == "sliding_attention" else None
    pattern = config.get("sliding_window_pattern")
    if pattern is None and config.get("model_type") in ("gemma2", "gpt_oss"):
        pattern = 2  # their config classes' default: sliding and full layers alternate
    if pattern:
        return win if (i + 1) % int(pattern) else None
    if "use_sliding_window" in config:
        if not config["use_sliding_window"]:
            return None
        return win if i >= int(config.get("max_window_layers") or 0) else None
    return win


def layer_windows(config: Mapping[str, Any]) -> list[tuple[int, int] | None]:
    """:func:`layer_window` of every layer (``num_hidden_layers`` of them).

    Examples:
        >>> layer_windows({"num_hidden_layers": 3, "sliding_window": 4,
        ...                "layer_types": ["sliding_attention", "full_attention",
        ...                                "sliding_attention"]})
        [(3, 0), None, (3, 0)]
    """
    return [layer_window(config, i) for i in range(int(config["num_hidden_layers"]))]


def _layer_type(config: Mapping[str, Any], i: int) -> str | None:
    params = config.get("rope_parameters") or {}
    types = config.get("layer_types") or ()
    if types and any(k in types for k in params):  # rope parameters per layer type
        return types[i]
    return None


def attention_module(config: Mapping[str, Any], i: int) -> MultiHeadAttention:
    """Layer ``i``'s attention as a :class:`MultiHeadAttention` configuration.

    Examples:
        >>> config = {"model_type": "gemma2", "hidden_size": 64, "num_attention_heads": 4,
        ...           "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        ...           "sliding_window": 8, "query_pre_attn_scalar": 16,
        ...           "attn_logit_softcapping": 50.0}
        >>> m = attention_module(config, 0)
        >>> m.kv_heads, m.window, m.softcap, m.scale
        (2, (7, 0), 50.0, 0.25)
        >>> attention_module(config, 1).window is None
        True
    """
    family = config["model_type"]
    rope = aa.rope_kwargs_from_config(config, layer_type=_layer_type(config, i))
    bias = bool(config.get("attention_bias", family == "gpt_oss"))
    return MultiHeadAttention(
        embed_dim=int(config["hidden_size"]),
        num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        head_dim=rope["head_dim"],
        bias=True if family == "qwen2" else bias,  # Qwen2: q/k/v biases, none on o_proj
        out_bias=False if family == "qwen2" else bias,
        qk_norm="rms" if family == "qwen3" else None,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope="half",  # HF's rotate_half (gpt-oss's chunk(2) is the same pairing)
        rope_theta=rope["theta"],
        rope_scaling=rope["rope_scaling"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        max_position_embeddings=rope["max_position_embeddings"],
        causal=True,
        window=layer_window(config, i),
        scale=(
            float(config["query_pre_attn_scalar"]) ** -0.5
            if family == "gemma2" and config.get("query_pre_attn_scalar")
            else None
        ),
        softcap=config.get("attn_logit_softcapping") if family == "gemma2" else None,
        sinks=family == "gpt_oss",
    )


def _activation(name: str) -> Callable[[Any], Any]:
    if name in ("silu", "swish"):
        return silu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: gelu(x, approximate="tanh")
    if name == "gelu":
        return gelu
    raise ValueError(f"config's hidden_act {name!r} is not supported (silu, gelu, gelu_*)")


@dataclass
class CausalLM:
    """A decoder-only model: config, one :class:`MultiHeadAttention` per layer, and the
    parameters as dicts of arrays (``xp``/``device``/``dtype``).

    Shapes: ``ids`` ``(B, L)`` -> logits ``(B, L, vocab_size)``.

    Examples:
        >>> import numpy as np
        >>> config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
        ...           "intermediate_size": 12, "num_hidden_layers": 1,
        ...           "num_attention_heads": 2, "num_key_value_heads": 1}
        >>> rng = np.random.default_rng(0)
        >>> shapes = {"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,),
        ...           "lm_head.weight": (10, 8)}
        >>> p = "model.layers.0."
        >>> shapes.update({p + "input_layernorm.weight": (8,),
        ...     p + "post_attention_layernorm.weight": (8,),
        ...     p + "self_attn.q_proj.weight": (8, 8), p + "self_attn.k_proj.weight": (4, 8),
        ...     p + "self_attn.v_proj.weight": (4, 8), p + "self_attn.o_proj.weight": (8, 8),
        ...     p + "mlp.gate_proj.weight": (12, 8), p + "mlp.up_proj.weight": (12, 8),
        ...     p + "mlp.down_proj.weight": (8, 12)})
        >>> model = CausalLM.from_state(config, {k: rng.standard_normal(s)
        ...                                      for k, s in shapes.items()})
        >>> model(np.array([[1, 2, 3], [0, 4, 5]]), lengths=[3, 2]).shape
        (2, 3, 10)
        >>> model.generate([[1, 2, 3], [4, 5]], max_new_tokens=2).shape
        (2, 2)
    """

    config: dict[str, Any]
    attention: list[MultiHeadAttention]
    layers: list[dict[str, Any]]
    params: dict[str, Any]
    xp: Any

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        xp: Any = np,
        device: Any = None,
        dtype: Any = None,
        check_finite: bool = True,
    ) -> CausalLM:
        """Load ``model_dir`` (see :func:`load_model_dir`, which checks everything it
        reads and raises :class:`CheckpointError` naming the file and tensor or field)."""
        config, tensors = load_model_dir(model_dir, check_finite=check_finite)
        source = str(Path(model_dir) / "config.json")
        # the files held no NaN/Inf; only a cast to a narrower dtype can make one
        return cls.from_state(
            config,
            tensors,
            xp=xp,
            device=device,
            dtype=dtype,
            check_finite=check_finite and _narrower_than_float32(dtype),
            source=source,
        )

    @classmethod
    def from_state(
        cls,
        config: Mapping[str, Any],
        tensors: Mapping[str, Any],
        *,
        xp: Any = np,
        device: Any = None,
        dtype: Any = None,
        check_finite: bool = True,
        source: str = "config",
    ) -> CausalLM:
        """Build from a config dict and a name -> array dict (HF names). ``dtype``:
        default float32. The config (:func:`check_config`) and every tensor's name, shape
        and dtype (:func:`check_tensors`) are checked before anything is converted;
        ``check_finite``: a tensor holding NaN or Inf is an error. Every problem is a
        :class:`CheckpointError` naming the tensor or the field (of ``source``)."""
        if not isinstance(tensors, Mapping):
            raise TypeError(
                f"tensors must be a mapping of names to arrays, got {type(tensors).__name__}"
            )
        check_config(config, source)
        config = dict(config)
        check_tensors(config, {n: _spec_of_array(n, a) for n, a in tensors.items()}, source)
        family = config["model_type"]
        xp = aa.array_namespace(xp)  # array-API namespace: asarray(..., device=) on CuPy too
        dtype = xp.float32 if dtype is None else dtype

        def take(name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Any:
            a = np.asarray(tensors[name])
            if transform is not None:
                a = transform(a.astype(np.float64))
            out = xp.asarray(a, dtype=dtype, device=device)
            if check_finite and not bool(xp.all(xp.isfinite(out))):
                kind = str(out.dtype)
                raise CheckpointError(
                    f"checkpoint tensor {name!r} holds non-finite values (NaN or Inf) as "
                    f"{kind}: a NaN/Inf in the checkpoint or a value beyond {kind}'s range "
                    f"(check_finite=False loads it anyway)"
                )
            return out

        def norm_weight(name: str) -> Any:
            # Gemma's RMSNorm multiplies by (1 + weight): folded in once here.
            return take(name, (lambda w: 1.0 + w) if family == "gemma2" else None)

        def stacked(names: Sequence[str]) -> Any:
            # (out, in) weights stacked by rows (biases concatenated): one GEMM for
            # several projections, each weight contiguous in its (out, in) layout, the
            # one linear's few-rows product (a decoding step) reads fastest
            parts = [take(n) for n in names]
            return parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)

        n_layers = int(config["num_hidden_layers"])
        # one q/k/v projection (rows [q; k; v]) per layer: one GEMM instead of three
        attention = [
            replace(attention_module(config, i), packed_qkv=True) for i in range(n_layers)
        ]
        layers: list[dict[str, Any]] = []
        for i, mha in enumerate(attention):
            pre = f"model.layers.{i}."
            sa = pre + "self_attn."
            attn = {}
            for n in mha.param_shapes():
                if n.startswith("qkv_proj."):
                    kind = n.split(".", 1)[1]
                    attn[n] = stacked([f"{sa}{w}_proj.{kind}" for w in "qkv"])
                else:
                    attn[n] = take(sa + n)
            layer: dict[str, Any] = {
                "attn": attn,
                "input_norm": norm_weight(pre + "input_layernorm.weight"),
                "post_attn_norm": norm_weight(pre + "post_attention_layernorm.weight"),
            }
            mha.check_params(layer["attn"])
            if family == "gemma2":
                layer["pre_ffn_norm"] = norm_weight(pre + "pre_feedforward_layernorm.weight")
                layer["post_ffn_norm"] = norm_weight(pre + "post_feedforward_layernorm.weight")
            if family == "gpt_oss":
                m = pre + "mlp."
                layer["router_w"] = take(m + "router.weight")
                layer["router_b"] = take(m + "router.bias")
                for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                    layer[n] = take(m + "experts." + n)
            else:
                # gate and up as one projection (rows [gate; up]): one GEMM; the two
                # names stay, as views of its halves
                m, inter = pre + "mlp.", int(config["intermediate_size"])
                gu = stacked([m + "gate_proj.weight", m + "up_proj.weight"])
                layer.update(gate_up=gu, gate_proj=gu[:inter, :], up_proj=gu[inter:, :])
                layer["down_proj"] = take(m + "down_proj.weight")
                bias = bool(config.get("mlp_bias"))
                layer["gate_up_b"] = (
                    stacked([m + "gate_proj.bias", m + "up_proj.bias"]) if bias else None
                )
                layer["down_proj_b"] = take(m + "down_proj.bias") if bias else None
            layers.append(layer)
        params = {
            "embed": take("model.embed_tokens.weight"),
            "norm": norm_weight("model.norm.weight"),
        }
        params["lm_head"] = (
            take("lm_head.weight") if "lm_head.weight" in tensors else params["embed"]
        )
        return cls(config, attention, layers, params, xp)

    # -- pieces ----------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.config["model_type"]

    def _norm(self, x: Any, weight: Any) -> Any:
        eps = float(self.config.get("rms_norm_eps", 1e-6))
        # Llama/Qwen/Mistral cast back before the weight; Gemma 2 and gpt-oss multiply
        # in the compute dtype and cast last.
        late = self.family in ("gemma2", "gpt_oss")
        return rms_norm(x, weight, eps, cast_before_weight=not late)

    def _ffn(self, layer: Mapping[str, Any], x: Any, rows: Any = None) -> Any:
        """``x`` plus the layer's feed-forward half (norms and MLP, token by token), on
        the rows ``rows`` of ``x`` flattened to ``(B * L, hidden)`` only (the others
        keep their value) when given."""
        if rows is None:
            return x + self._ffn_delta(layer, x)
        xp = self.xp
        flat = xp.reshape(x, (-1, int(x.shape[-1])))  # (x is this call's own array)
        sub = xp.take(flat, rows, axis=0)
        flat[rows] = sub + self._ffn_delta(layer, sub)
        return xp.reshape(flat, x.shape)

    def _ffn_delta(self, layer: Mapping[str, Any], x: Any) -> Any:
        if self.family == "gemma2":
            h = self._norm(x, layer["pre_ffn_norm"])
            return self._norm(self._mlp(layer, h), layer["post_ffn_norm"])
        return self._mlp(layer, self._norm(x, layer["post_attn_norm"]))

    def _mlp(self, layer: Mapping[str, Any], x: Any) -> Any:
        if self.family == "gpt_oss":
            return self._moe(layer, x)
        # the config classes' defaults when config.json leaves the field out
        default = "gelu_pytorch_tanh" if self.family == "gemma2" else "silu"
        act = _activation(
            self.config.get("hidden_activation") or self.config.get("hidden_act") or default
        )
        inter = int(self.config["intermediate_size"])
        gu = linear(x, layer["gate_up"], layer["gate_up_b"])
        return linear(act(gu[..., :inter]) * gu[..., inter:], layer["down_proj"],
                      layer["down_proj_b"])  # fmt: skip

    def _moe(self, layer: Mapping[str, Any], x: Any) -> Any:
        """gpt-oss's mixture of experts: a router picks ``num_experts_per_tok`` experts
        per token, weighted by the softmax of their router logits; each expert is a
        clamped SwiGLU (``gate * sigmoid(alpha * gate) * (up + 1)``, gate and up
        interleaved in ``gate_up_proj``). Only the chosen experts run, on their tokens."""
        xp, cfg = self.xp, self.config
        k = int(cfg["num_experts_per_tok"])
        limit, alpha = float(cfg.get("swiglu_limit", 7.0)), float(cfg.get("swiglu_alpha", 1.702))
        shape = x.shape
        h = xp.reshape(x, (-1, shape[-1]))
        logits = linear(h, layer["router_w"], layer["router_b"])  # (T, E)
        top = xp.argsort(-logits, axis=-1)[:, :k]
        top_logits = xp.take_along_axis(logits, top, axis=-1)
        w = xp.exp(top_logits - xp.max(top_logits, axis=-1, keepdims=True))
        w = w / xp.sum(w, axis=-1, keepdims=True)
        chosen = _to_host(top)
        out = xp.zeros_like(h)
        for e in np.unique(chosen):  # ascending, as HF adds the experts' outputs
            rows, slot = np.nonzero(chosen == e)
            idx = xp.asarray(rows)
            gu = h[idx] @ layer["gate_up_proj"][int(e)] + layer["gate_up_proj_bias"][int(e)]
            gate = xp.minimum(gu[:, ::2], limit)
            up = xp.clip(gu[:, 1::2], -limit, limit)
            glu = gate / (1.0 + xp.exp(-alpha * gate))
            y = ((up + 1.0) * glu) @ layer["down_proj"][int(e)] + layer["down_proj_bias"][int(e)]
            out[idx] += y * w[idx, xp.asarray(slot)][:, None]
        return xp.reshape(out, shape)

    # -- forward ---------------------------------------------------------------------
    def __call__(
        self,
        ids: Any,
        *,
        lengths: Sequence[int] | None = None,
        caches: Sequence[Any] | None = None,
        last_only: bool = False,
    ) -> Any:
        """Logits ``(B, L, vocab)`` of left-padded ``ids`` ``(B, L)`` (``lengths`` real
        tokens at the end of each row; default all). With ``caches`` (one per layer, from
        :meth:`new_caches`) the tokens are appended to each sequence's cache (prefill or
        one decoding step). ``last_only`` returns only the last position ``(B, 1, V)``.
        Logits at padded positions mean nothing (the feed-forward halves skip them)."""
        xp, cfg = self.xp, self.config
        ids = xp.asarray(ids)
        L = int(ids.shape[1])
        x = embedding(ids, self.params["embed"])
        if self.family == "gemma2":  # scaled by sqrt(hidden) in the model's dtype
            x = x * xp.asarray(math.sqrt(int(cfg["hidden_size"])), dtype=x.dtype)
        kw: dict[str, Any] = {}
        rows = None
        if lengths is not None and any(int(n) != L for n in lengths):
            kw = {"lengths": [int(n) for n in lengths], "padding_side": "left"}
            # the per-token half of each layer (norms, MLP) runs on the real tokens only
            pad = L - np.asarray(kw["lengths"])
            real = np.arange(L)[None, :] >= pad[:, None]
            rows = xp.asarray(np.flatnonzero(real), device=aa.device(x))
        last = len(self.layers) - 1
        for i, (mha, layer) in enumerate(zip(self.attention, self.layers, strict=True)):
            h = self._norm(x, layer["input_norm"])
            cache = None if caches is None else caches[i]
            a = mha(layer["attn"], h, cache=cache, **kw)
            if self.family == "gemma2":
                x = x + self._norm(a, layer["post_attn_norm"])
            else:
                x = x + a
            if last_only and i == last:  # the logits read the last position only
                x, rows = x[:, -1:, :], None
            x = self._ffn(layer, x, rows)
        if last_only and x.shape[1] != 1:
            x = x[:, -1:, :]
        logits = linear(self._norm(x, self.params["norm"]), self.params["lm_head"])
        cap = cfg.get("final_logit_softcapping") if self.family == "gemma2" else None
        if cap:
            logits = xp.tanh(logits / cap) * cap
        return logits

    def new_caches(
        self,
        batch_size: int,
        max_length: int,
        *,
        paged: bool = False,
        page_size: int = 16,
        shared_prefix: int = 0,
    ) -> list[Any]:
        """One KV cache per layer: :class:`arrayattn.nn.KVCache` rows of ``max_length``,
        or a :class:`arrayattn.nn.PagedKVCache` whose pool holds ``batch_size *
        max_length`` tokens; with ``shared_prefix > 0`` a
        :class:`arrayattn.nn.CascadeKVCache` of that prefix and suffixes of the rest
        (contiguous or paged)."""
        dtype = self.params["embed"].dtype
        dev = aa.device(self.params["embed"])
        if shared_prefix > 0:
            rest = max_length - shared_prefix
            suffix = (
                {"num_pages": batch_size * -(-rest // page_size), "page_size": page_size}
                if paged
                else {"max_suffix_length": rest}
            )
            return [
                CascadeKVCache(batch_size=batch_size, num_kv_heads=m.kv_heads,
                               head_dim=m.dim_per_head, value_dim=m.value_dim_per_head,
                               prefix_length=shared_prefix, xp=self.xp, device=dev,
                               dtype=dtype, **suffix)  # fmt: skip
                for m in self.attention
            ]
        if paged:
            pages = batch_size * -(-max_length // page_size)
            return [
                m.new_paged_cache(batch_size, pages, page_size, xp=self.xp, device=dev, dtype=dtype)
                for m in self.attention
            ]
        return [
            m.new_cache(batch_size, max_length, xp=self.xp, device=dev, dtype=dtype)
            for m in self.attention
        ]

    def shared_prefix_length(self, prompts: Sequence[Sequence[int]], shared: bool | None) -> int:
        """Tokens of the prompts' common prefix that a :class:`CascadeKVCache` would hold
        (each row keeps at least one token of its own), or 0 where it is not used:
        ``shared=False``, one prompt, a layer with ALiBi (the cascade cache does not take
        it), or ``shared=None`` (detect) and fewer than
        ``SHARED_PREFIX_MIN`` common tokens."""
        if shared is False or len(prompts) < 2:
            return 0
        if any(m.alibi for m in self.attention):
            return 0
        n = min(len(p) for p in prompts) - 1
        common = 0
        while common < n and all(p[common] == prompts[0][common] for p in prompts):
            common += 1
        return common if shared or common >= SHARED_PREFIX_MIN else 0

    # -- generation ------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_token_id: int | Iterable[int] | None = None,
        pad_token_id: int | None = None,
        paged: bool = False,
        progress: Callable[[int, int], None] | None = None,
        stats: dict[str, float] | None = None,
        shared_prefix: bool | None = None,
    ) -> np.ndarray:
        """New tokens ``(B, T)`` (host int64) for prompts of different lengths, decoded
        together from one cache per layer: greedy with ``temperature=0``, else sampled
        (``top_k``, ``top_p``). A row that emits ``eos_token_id`` is finished: its later
        tokens are ``pad_token_id``, or the first EOS id without one (as Hugging Face's
        ``generate``); decoding stops when every row has finished (``T`` may then be below
        ``max_new_tokens``). ``shared_prefix`` (``None``: detect, see
        :meth:`shared_prefix_length`): the prompts' common prefix is prefilled once into
        a :class:`arrayattn.nn.CascadeKVCache` per layer and each row's rest after it."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        B = len(prompts)
        lengths = [len(p) for p in prompts]
        L = max(lengths)
        eos = (
            []
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else list(dict.fromkeys(eos_token_id))
        )
        # As generate(): without a pad id, finished rows are padded with the first EOS id.
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        ids = np.full((B, L), pad, dtype=np.int64)
        for b, p in enumerate(prompts):
            ids[b, L - len(p) :] = p
        P = self.shared_prefix_length(prompts, shared_prefix)
        caches = self.new_caches(B, L + max_new_tokens, paged=paged, shared_prefix=P)
        rng = np.random.default_rng(seed)
        done = np.zeros(B, dtype=bool)
        out: list[np.ndarray] = []
        t0 = time.perf_counter()
        if P:  # the common prefix once, then each row's rest (left-padded) after it
            self(np.asarray([list(prompts[0][:P])]), caches=[c.prefix for c in caches])
            rest = [n - P for n in lengths]
            ids_rest = ids[:, L - max(rest) :]
            logits = self(ids_rest, lengths=rest, caches=caches, last_only=True)
        else:
            logits = self(ids, lengths=lengths, caches=caches, last_only=True)
        t_prefill = time.perf_counter() - t0
        for step in range(max_new_tokens):
            nxt = self._pick(logits[:, -1, :], temperature, top_k, top_p, rng)
            nxt = np.where(done, pad, nxt)
            out.append(nxt)
            done |= np.isin(nxt, list(eos))
            if progress is not None:
                progress(step + 1, max_new_tokens)
            if done.all() or step + 1 == max_new_tokens:
                if progress is not None and step + 1 < max_new_tokens:
                    progress(step + 1, step + 1)  # stopped early: close the bar
                break
            logits = self(nxt[:, None], caches=caches)
        if stats is not None:
            stats.update(
                prefill_s=t_prefill,
                prefill_tokens=float(sum(lengths)),
                total_s=time.perf_counter() - t0,
                new_tokens=float(B * len(out)),
            )
        return np.stack(out, axis=1)

    def _pick(
        self,
        logits: Any,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        rng: np.random.Generator,
    ) -> np.ndarray:
        if temperature <= 0:
            return _to_host(self.xp.argmax(logits, axis=-1)).astype(np.int64)
        z = _to_host(logits).astype(np.float64) / temperature
        if top_k is not None and top_k < z.shape[-1]:
            kth = np.sort(z, axis=-1)[:, -top_k][:, None]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        if top_p is not None and top_p < 1.0:
            order = np.argsort(-p, axis=-1)
            sp = np.take_along_axis(p, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            drop = np.cumsum(sp, axis=-1) - sp >= top_p
            sp[drop] = 0.0
            p = np.zeros_like(p)
            np.put_along_axis(p, order, sp, axis=-1)
            p /= p.sum(axis=-1, keepdims=True)
        return np.array([rng.choice(p.shape[-1], p=row) for row in p], dtype=np.int64)


def _to_host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


# -- command line ------------------------------------------------------------------------
def progress_bar(width: int = 30, stream: Any = None) -> Callable[[int, int], None]:
    """A text progress bar ``[#####.....] 5/10 steps`` redrawn in place on ``stream``
    (default: ``sys.stderr`` at the time of drawing)."""

    def show(done: int, total: int) -> None:
        out = sys.stderr if stream is None else stream
        filled = width * done // max(total, 1)
        out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps")
        if done >= total:
            out.write("\n")
        out.flush()

    return show


def parse_prompt_ids(text: str) -> list[list[int]]:
    """``"1,2,3;4,5"`` -> ``[[1, 2, 3], [4, 5]]``.

    Examples:
        >>> parse_prompt_ids("1,2,3; 4,5")
        [[1, 2, 3], [4, 5]]
    """
    prompts = []
    for part in text.split(";"):
        part = part.strip()
        if part:
            try:
                prompts.append([int(t) for t in part.split(",") if t.strip()])
            except ValueError:
                raise ValueError(
                    f"--prompt-ids must be comma-separated ints, prompts separated by ';', "
                    f"got {part!r}"
                ) from None
    if not prompts:
        raise ValueError(f"--prompt-ids holds no prompt: {text!r}")
    return prompts


def generation_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the generation arguments, or None: ``--max-new-tokens`` >= 1,
    ``--top-k`` >= 1, ``--top-p`` in (0, 1], ``--temperature`` finite and >= 0."""
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if args.top_k is not None and args.top_k < 1:
        return f"--top-k must be >= 1, got {args.top_k}"
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        return f"--top-p must be in (0, 1], got {args.top_p}"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature must be a finite number >= 0, got {args.temperature}"
    return None


def _memory_bytes(array: Any) -> int | None:
    """The memory ``array``'s library keeps arrays in: the GPU's for CuPy, else the
    host's (None when the platform does not say)."""
    try:
        if type(array).__module__.split(".")[0] == "cupy":
            import cupy

            return int(cupy.cuda.Device().mem_info[1])
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def request_error(
    model: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, paged: bool
) -> str | None:
    """What makes a generation request impossible, or None: a token id outside
    ``[0, vocab_size)`` (it would silently wrap, or fail, in the embedding), or a KV
    cache for ``max(len(prompt)) + max_new_tokens`` positions larger than the memory the
    model lives in (checked before the cache is allocated).

    Examples:
        >>> import numpy as np
        >>> config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
        ...           "intermediate_size": 8, "num_hidden_layers": 1,
        ...           "num_attention_heads": 2}
        >>> state = {k: np.zeros(s) for k, s in expected_shapes(config).items()}
        >>> model = CausalLM.from_state(config, state)
        >>> request_error(model, [[1, 12]], 4, paged=False)
        '--prompt-ids: token id 12 of prompt 0 is outside the vocabulary [0, 10)'
        >>> request_error(model, [[1, 2]], 10**15, paged=False)[:45]
        '--max-new-tokens 1000000000000000: the KV cac'
    """
    vocab = int(model.config["vocab_size"])
    for b, p in enumerate(prompts):
        for t in p:
            if not 0 <= int(t) < vocab:
                return (
                    f"--prompt-ids: token id {t} of prompt {b} is outside the vocabulary "
                    f"[0, {vocab})"
                )
    length = max(len(p) for p in prompts) + max_new_tokens
    if paged:
        length = -(-length // 16) * 16
    itemsize = int(np.dtype(str(model.params["embed"].dtype)).itemsize)
    need = sum(
        len(prompts) * length * m.kv_heads * (m.dim_per_head + m.value_dim_per_head) * itemsize
        for m in model.attention
    )
    have = _memory_bytes(model.params["embed"])
    if have is not None and need > have:
        return (
            f"--max-new-tokens {max_new_tokens}: the KV cache for {len(prompts)} prompts of "
            f"up to {length} positions needs {need / 2**30:.3g} GiB, more than the "
            f"{have / 2**30:.3g} GiB of memory here"
        )
    return None


def load_tokenizer(model_dir: str | Path) -> Any:
    """The directory's ``tokenizer.json`` (``tokenizers`` package), kept inside the
    directory; a file ``tokenizers`` cannot read is a :class:`CheckpointError` naming it."""
    path = checkpoint_file(model_dir, "tokenizer.json")
    size = regular_file_size(path, what="tokenizer file")
    if size > 2**30:  # real ones are a few MB
        raise CheckpointError(f"{path}: {size} bytes, more than the 1 GiB a tokenizer may have")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        message = " ".join(str(e).splitlines())
        raise CheckpointError(
            f"{path}: not a tokenizer file tokenizers can read ({message})"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="config.json + *.safetensors directory")
    ap.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
    ap.add_argument("--prompt-ids", help="token ids: '1,2,3;4,5' (prompts separated by ';')")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "float64", "float16"), default="float32")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", choices=("contiguous", "paged"), default="contiguous")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--allow-nonfinite", action="store_true", help="load weights holding NaN/Inf anyway"
    )
    ap.add_argument("--debug", action="store_true", help="errors with their traceback")
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        default=None,
        help="decode from a cascade cache holding the prompts' common prefix once "
        "(default: when they share at least SHARED_PREFIX_MIN tokens)",
    )
    args = ap.parse_args(argv)
    bad = generation_args_error(args)
    if bad:
        ap.error(bad)

    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    inspect_model_dir(args.model_dir)  # a broken checkpoint is reported first (milliseconds)
    tok = None
    tok_path = Path(args.model_dir) / "tokenizer.json"
    if args.prompt_ids:
        try:
            prompts = parse_prompt_ids(args.prompt_ids)
        except ValueError as e:
            ap.error(str(e))
    elif os.path.lexists(tok_path):
        tok = load_tokenizer(args.model_dir)
        prompts = [tok.encode(p).ids for p in (args.prompt or ["Hello"])]
    else:
        ap.error(f"{args.model_dir} has no tokenizer.json: give --prompt-ids")

    t0 = time.perf_counter()
    model = CausalLM.from_pretrained(
        args.model_dir, xp=xp, dtype=getattr(xp, args.dtype), check_finite=not args.allow_nonfinite
    )
    special = generation_token_ids(model.config, args.model_dir)
    bad = request_error(model, prompts, args.max_new_tokens, paged=args.cache == "paged")
    if bad:
        ap.error(bad)
    print(
        f"loaded {model.family} ({len(model.layers)} layers) on {args.device} "
        f"{args.dtype} in {time.perf_counter() - t0:.2f} s",
        file=sys.stderr,
    )
    stats: dict[str, float] = {}
    new = model.generate(
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
        paged=args.cache == "paged",
        shared_prefix=args.shared_prefix,
        progress=None if args.no_progress else progress_bar(),
        stats=stats,
    )
    for p, row in zip(prompts, new.tolist(), strict=True):
        if tok is not None:
            print(repr(tok.decode(list(p) + row, skip_special_tokens=True)))
        else:
            print(",".join(map(str, p)) + " -> " + ",".join(map(str, row)))
    decode_s = stats["total_s"] - stats["prefill_s"]
    decoded = stats["new_tokens"] - len(prompts)  # the first new tokens come from prefill
    print(
        f"prefill: {int(stats['prefill_tokens'])} tokens in {stats['prefill_s']:.3f} s; "
        f"decode: {int(stats['new_tokens'])} new tokens in {stats['total_s']:.3f} s, "
        f"{decoded / decode_s if decode_s > 0 else float('nan'):.1f} tokens/s "
        f"(batch {len(prompts)})"
    )
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """The command line: :func:`main`, with every error as one line on stderr
    (``hf_causal_lm.py: error: ...``, naming the file and tensor or field) and exit
    status 1; 130 on Ctrl-C. ``--debug`` lets the exception and its traceback through.
    Argument errors are argparse's (usage and one line, status 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    prog = Path(sys.argv[0]).name if argv is None else "hf_causal_lm.py"
    try:
        return main(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the command line's one-line report
        if debug:
            raise
        kind = "" if isinstance(e, CheckpointError) else f"{type(e).__name__}: "
        message = " ".join(str(e).splitlines())
        print(f"{prog}: error: {kind}{message} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
