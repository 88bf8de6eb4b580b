"""RoPE scaling from a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict.

The inverse frequencies ``inv_freq_j`` (one per rotated feature pair) and the attention
factor of every scaling type in Hugging Face ``transformers``' ``ROPE_INIT_FUNCTIONS``
(``default``, ``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``), computed from
the dict exactly as it appears in a model's ``config.json``. The ladder is a few hundred
numbers that depend on the config only, so it is computed once in float64 Python floats
(each formula reads as HF's) and then placed on the caller's namespace and device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from ..._backend import Array, resolve_namespace

__all__ = ["ROPE_TYPES", "check_rope_scaling", "rope_inv_freq", "rope_kwargs_from_config"]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Old configs name the type "type"; Qwen2-VL's "mrope" is the default ladder (the sections
# only say which position each frequency reads: ``mrope_frequencies``); early Phi-3
# configs call LongRoPE "su".
_ALIASES = {"mrope": "default", "su": "longrope"}


def _positive(name: str, value: Any, *, integral: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and integral:
        ok = isinstance(value, numbers.Integral)
    if not ok or not math.isfinite(float(value)) or not float(value) > 0:
        kind = "a positive int" if integral else "a positive finite number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return float(value)


def _rotary_dim(head_dim: Any, partial_rotary_factor: Any) -> int:
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 2:
        raise ValueError(f"head_dim must be an int >= 2, got {head_dim!r}")
    factor = _positive("partial_rotary_factor", partial_rotary_factor)
    if factor > 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}")
    dim = int(int(head_dim) * factor)  # HF: int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"the rotary dim int(head_dim * partial_rotary_factor) = int({head_dim} * "
            f"{partial_rotary_factor}) = {dim} must be a positive even int"
        )
    return dim


def _resolve(
    head_dim: int,
    rope_scaling: Mapping[str, Any] | None,
    theta: float,
    partial_rotary_factor: float | None,
    max_position_embeddings: int | None,
) -> tuple[str, dict[str, Any], float, int]:
    """``(rope_type, params, base, rotary_dim)`` with HF's precedence: the dict's own
    ``rope_theta`` / ``partial_rotary_factor`` win over the keyword fallbacks (the
    top-level config fields of the old ``rope_scaling`` format)."""
    if rope_scaling is None:
        params: dict[str, Any] = {}
    elif isinstance(rope_scaling, Mapping):
        params = dict(rope_scaling)
    else:
        raise TypeError(
            f"rope_scaling must be a dict (config.json's rope_scaling or rope_parameters) or "
            f"None, got {type(rope_scaling).__name__}"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling's rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    base = params.get("rope_theta")
    base = _positive("rope_theta" if base is not None else "theta", theta if base is None else base)
    factor = params.get("partial_rotary_factor")
    factor = partial_rotary_factor if factor is None else factor
    dim = _rotary_dim(head_dim, 1.0 if factor is None else factor)
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF's standardize_rope_params: the pretraining length defaults to the config's.
        if params.get("original_max_position_embeddings") is None:
            if max_position_embeddings is None:
                raise ValueError(
                    f"rope_type {rope_type!r} needs original_max_position_embeddings in "
                    "rope_scaling or max_position_embeddings=; got neither"
                )
            params["original_max_position_embeddings"] = max_position_embeddings
        _positive(
            "original_max_position_embeddings",
            params["original_max_position_embeddings"],
            integral=True,
        )
    return rope_type, params, base, dim


def _require(params: Mapping[str, Any], key: str, rope_type: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs rope_scaling[{key!r}]; got {dict(params)}")
    return _positive(f"rope_scaling[{key!r}]", params[key])


# What each rope type's init function returns: the inverse frequencies and the attention factor.
_Freqs = tuple[list[float], float]


def _ladder(base: float, dim: int) -> list[float]:
    # HF: 1 / base ** (arange(0, dim, 2) / dim)
    return [1.0 / base ** (i / dim) for i in range(0, dim, 2)]


def _linear(params: dict, base: float, dim: int, mpe: int | None, seq_len: int | None) -> _Freqs:
    factor = _require(params, "factor", "linear")
    return [f / factor for f in _ladder(base, dim)], 1.0


def _dynamic(params: dict, base: float, dim: int, mpe: int | None, seq_len: int | None) -> _Freqs:
    factor = _require(params, "factor", "dynamic")
    if mpe is None:
        raise ValueError("rope_type 'dynamic' needs max_position_embeddings=, got None")
    if dim <= 2:  # the exponent R / (R - 2) below
        raise ValueError(f"rope_type 'dynamic' needs a rotary dim > 2, got {dim}")
    # HF: the length defaults to max_position_embeddings and never goes below it.
    length = mpe if seq_len is None else max(int(seq_len), mpe)
    base = base * ((factor * length / mpe) - (factor - 1)) ** (dim / (dim - 2))
    return _ladder(base, dim), 1.0


def _llama3(params: dict, base: float, dim: int, mpe: int | None, seq_len: int | None) -> _Freqs:
    factor = _require(params, "factor", "llama3")
    low_freq_factor = _require(params, "low_freq_factor", "llama3")
    high_freq_factor = _require(params, "high_freq_factor", "llama3")
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for f in _ladder(base, dim):
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:  # high frequencies: unchanged
            out.append(f)
        elif wavelen > low_freq_wavelen:  # low frequencies: interpolated by factor
            out.append(f / factor)
        else:  # in between: a smooth blend of the two
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * f / factor + smooth * f)
    return out, 1.0


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, base: float, dim: int, mpe: int | None, seq_len: int | None) -> _Freqs:
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3: the ratio of the two lengths
        if mpe is None:
            raise ValueError(
                "rope_type 'yarn' without rope_scaling['factor'] needs max_position_embeddings="
            )
        factor = mpe / original
    factor = _positive("rope_scaling['factor']", factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    out = []
    for j, f in enumerate(_ladder(base, dim)):
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        extrapolation = 1 - ramp  # weight of the unscaled frequency
        out.append((f / factor) * (1 - extrapolation) + f * extrapolation)
    return out, float(attention_factor)


def _longrope(params: dict, base: float, dim: int, mpe: int | None, seq_len: int | None) -> _Freqs:
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the two lengths
        if mpe is None:
            raise ValueError(
                "rope_type 'longrope' without rope_scaling['factor'] needs max_position_embeddings="
            )
        factor = mpe / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    key = "long_factor" if seq_len is not None and int(seq_len) > original else "short_factor"
    ext = params.get(key)
    if not isinstance(ext, Sequence) or len(ext) != dim // 2:
        raise ValueError(
            f"rope_type 'longrope' needs rope_scaling[{key!r}], a list of {dim // 2} numbers "
            f"(rotary dim / 2), got {ext!r}"
        )
    ladder = _ladder(base, dim)
    return [f / float(e) for f, e in zip(ladder, ext, strict=True)], float(attention_factor)


_INIT = {
    "default": lambda params, base, dim, mpe, seq_len: (_ladder(base, dim), 1.0),
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def inv_freq_list(
    head_dim: int,
    rope_scaling: Mapping[str, Any] | None = None,
    *,
    theta: float = 10000.0,
    partial_rotary_factor: float | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[list[float], float]:
    """The inverse frequencies as float64 Python floats and the attention factor (the
    array-free core of :func:`rope_inv_freq`)."""
    if max_position_embeddings is not None:
        _positive("max_position_embeddings", max_position_embeddings, integral=True)
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
            raise ValueError(f"seq_len must be an int >= 0 or None, got {seq_len!r}")
    rope_type, params, base, dim = _resolve(
        head_dim, rope_scaling, theta, partial_rotary_factor, max_position_embeddings
    )
    return _INIT[rope_type](params, base, dim, max_position_embeddings, seq_len)


_EAGER_DIM = 2**16


def check_rope_scaling(
    head_dim: int,
    rope_scaling: Mapping[str, Any] | None,
    *,
    theta: float = 10000.0,
    partial_rotary_factor: float | None = None,
    max_position_embeddings: int | None = None,
) -> None:
    """Raise now what :func:`rope_inv_freq` would raise later for these arguments: an
    unknown ``rope_type``, a missing or invalid key of its type, an impossible rotary dim.
    ``longrope`` is checked for both of its factor lists (the short one and, beyond the
    pretraining length, the long one). Above a rotary dim of ``2**16`` only the type and
    the fields every type shares are checked (the per-type checks build the ladder, one
    float per pair of features)."""
    dim = _resolve(head_dim, rope_scaling, theta, partial_rotary_factor, max_position_embeddings)[3]
    if dim > _EAGER_DIM:
        return
    lengths: tuple[int | None, ...] = (None,)
    if isinstance(rope_scaling, Mapping):
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if _ALIASES.get(kind, kind) == "longrope":
            original = rope_scaling.get("original_max_position_embeddings")
            original = max_position_embeddings if original is None else original
            if isinstance(original, numbers.Integral) and not isinstance(original, bool):
                lengths = (None, int(original) + 1)
    for seq_len in lengths:
        inv_freq_list(
            head_dim,
            rope_scaling,
            theta=theta,
            partial_rotary_factor=partial_rotary_factor,
            max_position_embeddings=max_position_embeddings,
            seq_len=seq_len,
        )


def real_dtype(xp: Any, dtype: Any) -> Any:
    """The real dtype angles are computed in: float64 for float64/complex128, float32 for
    the default and every narrower float (and complex64)."""
    if dtype is None:
        return xp.float32
    if dtype in (xp.complex128, xp.float64):
        return xp.float64
    # float16/bfloat16 exist only in some namespaces (array-api-strict has neither).
    low = tuple(getattr(xp, name) for name in ("float16", "bfloat16") if hasattr(xp, name))
    if dtype in (xp.complex64, xp.float32) + low:
        return xp.float32
    raise TypeError(f"dtype must be a float or complex dtype, got {dtype!r}")


def rope_inv_freq(
    head_dim: int,
    rope_scaling: Mapping[str, Any] | None = None,
    *,
    theta: float = 10000.0,
    partial_rotary_factor: float | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> tuple[Array, float]:
    """RoPE inverse frequencies and attention factor for a Hugging Face RoPE config.

    The numbers of ``transformers``' ``ROPE_INIT_FUNCTIONS[rope_type](config,
    seq_len=seq_len)`` (and of the models' ``compute_default_rope_parameters`` for
    ``"default"``), from the ``rope_scaling`` (old) or ``rope_parameters`` (new) dict as it
    appears in ``config.json``: ``rope_type`` (or ``type``) one of ``"default"``,
    ``"linear"``, ``"dynamic"``, ``"llama3"``, ``"yarn"``, ``"longrope"`` (``"mrope"``
    means ``"default"``), with that type's keys (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``, ``beta_fast``,
    ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``,
    ``short_factor``, ``long_factor``). ``None`` is the plain ladder.

    Shapes: result ``(R // 2,)`` where ``R = int(head_dim * partial_rotary_factor)`` is
    the rotary dim (``head_dim`` when no factor is given), and a Python float.

    Args:
        head_dim: the attention head dim ``D`` (the config's ``head_dim``, or
            ``hidden_size // num_attention_heads``).
        rope_scaling: the config's ``rope_scaling`` / ``rope_parameters`` dict, or None.
            Its own ``rope_theta`` and ``partial_rotary_factor`` win over the keywords.
        theta: the base when the dict has no ``rope_theta`` (the old format's top-level
            ``rope_theta``).
        partial_rotary_factor: the fraction of ``head_dim`` rotated when the dict has none
            (the old format's top-level field); default 1.
        max_position_embeddings: the config's ``max_position_embeddings``: needed by
            ``dynamic``, and by ``yarn``/``longrope`` without ``factor``; the default of
            ``original_max_position_embeddings``, as in HF.
        seq_len: the sequence length HF passes at run time (``max(position_ids) + 1``):
            ``dynamic`` grows its base beyond ``max_position_embeddings``; ``longrope``
            takes ``long_factor`` beyond ``original_max_position_embeddings``. ``None`` is
            HF's value at initialisation.
        xp, device: where to build the result (default NumPy, CPU).
        dtype: its real dtype (default float32, as HF's ``inv_freq``; float64 keeps the
            float64 ladder).

    Returns:
        ``(inv_freq, attention_factor)``: HF multiplies ``cos`` and ``sin`` by
        ``attention_factor`` (1.0 except for ``yarn`` and ``longrope``), which scales the
        attention scores by its square. :func:`rope_frequencies` with ``rope_scaling=``
        applies it for you.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        ...           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        ...           "rope_theta": 500000.0}
        >>> inv_freq, af = aa.rope_inv_freq(128, llama3, xp=np)
        >>> inv_freq.shape, inv_freq.dtype, af
        ((64,), dtype('float32'), 1.0)
        >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        >>> round(aa.rope_inv_freq(64, yarn, xp=np)[1], 4)
        1.1386
    """
    values, attention_factor = inv_freq_list(
        head_dim,
        rope_scaling,
        theta=theta,
        partial_rotary_factor=partial_rotary_factor,
        max_position_embeddings=max_position_embeddings,
        seq_len=seq_len,
    )
    ns = resolve_namespace(xp)
    return ns.asarray(values, dtype=real_dtype(ns, dtype), device=device), attention_factor


def rope_kwargs_from_config(
    config: Mapping[str, Any], *, layer_type: str | None = None
) -> dict[str, Any]:
    """The RoPE keywords of a Hugging Face ``config.json`` (a dict), for
    :func:`rope_frequencies` / :func:`rope_inv_freq`.

    Reads, as ``transformers`` standardises them: ``rope_parameters`` (new) or
    ``rope_scaling`` (old), ``rope_theta`` (top level in old configs, GPT-NeoX's
    ``rotary_emb_base``; default 10000),
    ``partial_rotary_factor`` (or GPT-NeoX's ``rotary_pct``), ``head_dim`` (else
    ``hidden_size // num_attention_heads``), ``max_position_embeddings``, and a top-level
    ``original_max_position_embeddings`` (Phi-3), which wins for ``llama3``/``yarn``/
    ``longrope``. Configs whose ``rope_parameters`` are per layer type (keys from
    ``layer_types``, e.g. ``"full_attention"``, ``"sliding_attention"``) need
    ``layer_type``. Model-specific defaults that live in a model's Python config class
    rather than in ``config.json`` are not known here.

    Returns:
        ``{"head_dim", "rope_scaling", "theta", "partial_rotary_factor",
        "max_position_embeddings"}``: pass them with the positions,
        ``rope_frequencies(positions=pos, seq_len=..., **kwargs)``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> config = {"hidden_size": 4096, "num_attention_heads": 32,
        ...           "max_position_embeddings": 131072, "rope_theta": 500000.0,
        ...           "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
        ...                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        ...                            "original_max_position_embeddings": 8192}}
        >>> kw = aa.rope_kwargs_from_config(config)
        >>> kw["head_dim"], kw["theta"]
        (128, 500000.0)
        >>> aa.rope_frequencies(positions=4, **kw).shape
        (4, 64)
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (config.json), got {type(config).__name__}")
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise TypeError(f"config's rope_parameters/rope_scaling must be a dict, got {params!r}")
    labels = config.get("layer_types") or ()
    if not isinstance(labels, (list, tuple)):
        raise TypeError(f"config's layer_types must be a list of strings, got {labels!r:.80}")
    nested = [k for k in params if k in labels]
    if nested:
        if layer_type not in nested:
            raise ValueError(
                f"config's rope_parameters are per layer type {sorted(nested)}: pass "
                f"layer_type= one of them, got {layer_type!r}"
            )
        params = params[layer_type]
    elif layer_type is not None:
        raise ValueError(
            f"layer_type={layer_type!r} given but config's rope_parameters are not per layer type"
        )
    if not isinstance(params, Mapping):
        raise TypeError(
            f"config's rope_parameters[{layer_type!r}] must be a dict, got {params!r:.80}"
        )
    params = dict(params or {})
    head_dim = config.get("head_dim")
    if head_dim is None:
        if config.get("hidden_size") is None or config.get("num_attention_heads") is None:
            raise ValueError(
                "config has neither head_dim nor hidden_size and num_attention_heads "
                f"(got hidden_size={config.get('hidden_size')!r}, num_attention_heads="
                f"{config.get('num_attention_heads')!r})"
            )
        head_dim = _config_int(config, "hidden_size") // _config_int(config, "num_attention_heads")
    else:
        head_dim = _config_int(config, "head_dim")
    partial = config.get("partial_rotary_factor", config.get("rotary_pct"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("llama3", "yarn", "longrope", "su") and (
        config.get("original_max_position_embeddings") is not None
    ):
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    theta = config.get("rope_theta", config.get("rotary_emb_base"))
    mpe = config.get("max_position_embeddings")
    if mpe is not None:
        mpe = _config_int(config, "max_position_embeddings")
    base = 10000.0 if theta is None else _config_real(config, "rope_theta", theta)
    factor = None if partial is None else _config_real(config, "partial_rotary_factor", partial)
    out: dict[str, Any] = {
        "head_dim": int(head_dim),
        "rope_scaling": params or None,
        "theta": base,
        "partial_rotary_factor": factor,
        "max_position_embeddings": mpe,
    }
    source = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    try:
        check_rope_scaling(
            int(head_dim),
            params or None,
            theta=base,
            partial_rotary_factor=factor,
            max_position_embeddings=mpe,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"config's RoPE fields ({source}, rope_theta, head_dim): {e}") from None
    return out


def _config_int(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"config's {key} must be a positive int, got {type(value).__name__} {value!r:.80}"
        )
    if value < 1:
        raise ValueError(f"config's {key} must be a positive int, got {value!r}")
    return int(value)


def _config_real(config: Mapping[str, Any], key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"config's {key} must be a number, got {type(value).__name__} {value!r:.80}"
        )
    if not math.isfinite(float(value)) or not float(value) > 0:
        raise ValueError(f"config's {key} must be a positive finite number, got {value!r}")
    return float(value)
