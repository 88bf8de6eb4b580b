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
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import arrayattn as aa
from arrayattn.nn import CascadeKVCache, MultiHeadAttention, embedding, gelu, linear, silu
from arrayattn.ops import rms_norm

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss")
SHARED_PREFIX_MIN = 64
"""Common prompt tokens from which :meth:`CausalLM.generate` uses a cascade cache unasked."""

# safetensors dtype names -> NumPy; BF16 has no NumPy dtype and is widened to float32.
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


# -- reading a model directory -----------------------------------------------------------
def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as NumPy arrays (BF16 widened to float32,
    exactly: a bfloat16 is the top half of a float32).

    The format is an 8-byte little-endian header length, a JSON header (name -> dtype,
    shape, byte offsets) and the raw data; reading it here needs no framework, which
    ``safetensors.numpy`` would for BF16 checkpoints (most released ones).

    Examples:
        >>> import numpy as np, tempfile, os
        >>> from safetensors.numpy import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
        >>> read_safetensors(path)["w"].tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8 : 8 + n].tobytes())
    data = raw[8 + n :]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        chunk = data[start:end]
        if info["dtype"] == "BF16":
            bits = chunk.view("<u2").astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(shape)
        elif info["dtype"] in _ST_DTYPES:
            out[name] = np.array(chunk.view(np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<")))
            out[name] = out[name].reshape(shape)
        else:
            raise TypeError(
                f"{path}: tensor {name!r} has safetensors dtype {info['dtype']}, which this "
                f"example does not read (expected one of BF16, {', '.join(_ST_DTYPES)})"
            )
    return out


def load_model_dir(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config, tensors)`` of a Hugging Face model directory: ``config.json`` and every
    tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json`` lists
    (else all ``*.safetensors`` files). The token ids generation uses are
    :func:`generation_token_ids`'s."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model-dir {d} has no config.json (a save_pretrained dir)")
    config = json.loads((d / "config.json").read_text())
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--model-dir {d} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(d / f))
    return config, tensors


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
    gen = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if gen is not None and gen.is_file():
        source = json.loads(gen.read_text())
        if not isinstance(source, dict):
            raise ValueError(f"{gen}: expected a JSON object, got {type(source).__name__}")
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
def layer_windows(config: Mapping[str, Any]) -> list[tuple[int, int] | None]:
    """The sliding window of each layer in arrayattn's ``(left, right)`` convention: HF's
    ``sliding_window=W`` (W keys including the query's own) is ``(W - 1, 0)``.

    Which layers slide: ``layer_types`` (``"sliding_attention"``) when the config has it,
    else Gemma's ``sliding_window_pattern`` (every layer but each ``pattern``-th; Gemma 2
    and gpt-oss configs without either alternate, as their config classes do), else
    Qwen2's ``use_sliding_window`` from layer ``max_window_layers`` on, else (Mistral)
    every layer when ``sliding_window`` is set.

    Examples:
        >>> layer_windows({"num_hidden_layers": 3, "sliding_window": 4,
        ...                "layer_types": ["sliding_attention", "full_attention",
        ...                                "sliding_attention"]})
        [(3, 0), None, (3, 0)]
    """
    n = int(config["num_hidden_layers"])
    w = config.get("sliding_window")
    if w is None:
        return [None] * n
    win = (int(w) - 1, 0)
    if config.get("layer_types"):
        return [win if t == "sliding_attention" else None for t in config["layer_types"]]
    pattern = config.get("sliding_window_pattern")
    if pattern is None and config.get("model_type") in ("gemma2", "gpt_oss"):
        pattern = 2  # their config classes' default: sliding and full layers alternate
    if pattern:
        return [win if (i + 1) % int(pattern) else None for i in range(n)]
    if "use_sliding_window" in config:
        if not config["use_sliding_window"]:
            return [None] * n
        first = int(config.get("max_window_layers", 0))
        return [win if i >= first else None for i in range(n)]
    return [win] * n


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
        window=layer_windows(config)[i],
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
        cls, model_dir: str | Path, *, xp: Any = np, device: Any = None, dtype: Any = None
    ) -> CausalLM:
        """Load ``model_dir`` (see :func:`load_model_dir`)."""
        config, tensors = load_model_dir(model_dir)
        return cls.from_state(config, tensors, xp=xp, device=device, dtype=dtype)

    @classmethod
    def from_state(
        cls,
        config: Mapping[str, Any],
        tensors: Mapping[str, Any],
        *,
        xp: Any = np,
        device: Any = None,
        dtype: Any = None,
    ) -> CausalLM:
        """Build from a config dict and a name -> array dict (HF names). ``dtype``:
        default float32."""
        config = dict(config)
        family = config.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"config's model_type must be one of {FAMILIES}, got {family!r}")
        if config.get("quantization_config"):
            raise ValueError(
                "quantized checkpoints (config's quantization_config, e.g. gpt-oss MXFP4) "
                "are not supported: use a BF16/F16/F32 checkpoint"
            )
        xp = aa.array_namespace(xp)  # array-API namespace: asarray(..., device=) on CuPy too
        dtype = xp.float32 if dtype is None else dtype
        used: set[str] = set()

        def take(name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Any:
            if name not in tensors:
                raise KeyError(f"checkpoint has no tensor {name!r} (model_type {family!r})")
            used.add(name)
            a = np.asarray(tensors[name])
            if transform is not None:
                a = transform(a.astype(np.float64))
            return xp.asarray(a, dtype=dtype, device=device)

        def norm_weight(name: str) -> Any:
            # Gemma's RMSNorm multiplies by (1 + weight): folded in once here.
            return take(name, (lambda w: 1.0 + w) if family == "gemma2" else None)

        n_layers = int(config["num_hidden_layers"])
        attention = [attention_module(config, i) for i in range(n_layers)]
        layers: list[dict[str, Any]] = []
        for i, mha in enumerate(attention):
            pre = f"model.layers.{i}."
            attn_names = {
                k[len(pre) + len("self_attn.") :]
                for k in tensors
                if k.startswith(pre + "self_attn.") and not k.endswith("rotary_emb.inv_freq")
            }
            layer: dict[str, Any] = {
                "attn": {n: take(pre + "self_attn." + n) for n in attn_names},
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
                for n in ("gate_proj", "up_proj", "down_proj"):
                    layer[n] = take(f"{pre}mlp.{n}.weight")
                    b = f"{pre}mlp.{n}.bias"
                    layer[n + "_b"] = take(b) if b in tensors else None
            layers.append(layer)
        params = {
            "embed": take("model.embed_tokens.weight"),
            "norm": norm_weight("model.norm.weight"),
        }
        params["lm_head"] = (
            take("lm_head.weight") if "lm_head.weight" in tensors else params["embed"]
        )
        unused = sorted(k for k in set(tensors) - used if not k.endswith("rotary_emb.inv_freq"))
        if unused:
            raise KeyError(f"checkpoint tensors this {family} model does not use: {unused[:8]}")
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

    def _mlp(self, layer: Mapping[str, Any], x: Any) -> Any:
        if self.family == "gpt_oss":
            return self._moe(layer, x)
        # the config classes' defaults when config.json leaves the field out
        default = "gelu_pytorch_tanh" if self.family == "gemma2" else "silu"
        act = _activation(
            self.config.get("hidden_activation") or self.config.get("hidden_act") or default
        )
        g = linear(x, layer["gate_proj"], layer["gate_proj_b"])
        u = linear(x, layer["up_proj"], layer["up_proj_b"])
        return linear(act(g) * u, layer["down_proj"], layer["down_proj_b"])

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
        one decoding step). ``last_only`` returns only the last position ``(B, 1, V)``."""
        xp, cfg = self.xp, self.config
        ids = xp.asarray(ids)
        L = int(ids.shape[1])
        x = embedding(ids, self.params["embed"])
        if self.family == "gemma2":  # scaled by sqrt(hidden) in the model's dtype
            x = x * xp.asarray(math.sqrt(int(cfg["hidden_size"])), dtype=x.dtype)
        kw: dict[str, Any] = {}
        if lengths is not None and any(int(n) != L for n in lengths):
            kw = {"lengths": [int(n) for n in lengths], "padding_side": "left"}
        for i, (mha, layer) in enumerate(zip(self.attention, self.layers, strict=True)):
            h = self._norm(x, layer["input_norm"])
            cache = None if caches is None else caches[i]
            a = mha(layer["attn"], h, cache=cache, **kw)
            if self.family == "gemma2":
                x = x + self._norm(a, layer["post_attn_norm"])
                h = self._norm(x, layer["pre_ffn_norm"])
                x = x + self._norm(self._mlp(layer, h), layer["post_ffn_norm"])
            else:
                x = x + a
                x = x + self._mlp(layer, self._norm(x, layer["post_attn_norm"]))
        if last_only:
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
        "--shared-prefix",
        action="store_true",
        default=None,
        help="decode from a cascade cache holding the prompts' common prefix once "
        "(default: when they share at least SHARED_PREFIX_MIN tokens)",
    )
    args = ap.parse_args(argv)

    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    tok = None
    tok_path = Path(args.model_dir) / "tokenizer.json"
    if args.prompt_ids:
        prompts = parse_prompt_ids(args.prompt_ids)
    elif tok_path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        prompts = [tok.encode(p).ids for p in (args.prompt or ["Hello"])]
    else:
        ap.error(f"{args.model_dir} has no tokenizer.json: give --prompt-ids")

    t0 = time.perf_counter()
    model = CausalLM.from_pretrained(args.model_dir, xp=xp, dtype=getattr(xp, args.dtype))
    special = generation_token_ids(model.config, args.model_dir)
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


if __name__ == "__main__":
    sys.exit(main())
