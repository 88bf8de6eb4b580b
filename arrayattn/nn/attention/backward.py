"""``MultiHeadAttention``'s backward pass: the cotangents of the inputs and of every
parameter, composed from the pullbacks the forward pass kept."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._backend import Array
from .._cotangents import Cotangents
from .config import AttentionConfig
from .params import Params

__all__ = ["backward", "norm_back"]


def backward(
    cfg: AttentionConfig,
    pullbacks: Mapping[str, Callable[..., tuple[Any, ...]]],
    info: Mapping[str, Any],
    d_out: Array,
) -> Cotangents:
    """The layer's cotangents from the ops' pullbacks :func:`~.forward.run` collected."""
    xp = info["xp"]
    grads: Params = {}
    if info["left"]:
        (d_out,) = pullbacks["roll_out"](d_out)

    d_om, dw, db = pullbacks["o_proj"](d_out)
    grads["o_proj.weight"] = dw
    if db is not None:
        grads["o_proj.bias"] = db
    (d_o,) = pullbacks["merge"](d_om)
    back = pullbacks["attention"](d_o)
    d_qh, d_kh, d_vh, d_mask = back[:4]
    if cfg.sinks:  # keyword arrays' cotangents come in a trailing dict
        grads["sinks"] = back[-1]["sinks"]
    d_score = back[-1]["score_mod"] if info.get("score_params") else None
    if cfg.rope is not None:
        d_qh = pullbacks["q_rope"](d_qh)[0]
        d_kh = pullbacks["k_rope"](d_kh)[0]
    full_norm = cfg.qk_norm_scope == "full"
    if cfg.qk_norm is not None and not full_norm:
        d_qh = norm_back(cfg, pullbacks, grads, "q_norm", d_qh)
        d_kh = norm_back(cfg, pullbacks, grads, "k_norm", d_kh)
    d_q = pullbacks["q_heads"](d_qh)[0]
    d_k = pullbacks["k_heads"](d_kh)[0]
    d_v = pullbacks["v_heads"](d_vh)[0]
    if cfg.qk_norm is not None and full_norm:
        d_q = norm_back(cfg, pullbacks, grads, "q_norm", d_q)
        d_k = norm_back(cfg, pullbacks, grads, "k_norm", d_k)
    if cfg.packed_qkv and not info["cross"]:
        d_x, dw, db = pullbacks["qkv"](xp.concat((d_q, d_k, d_v), axis=-1))
        grads["qkv_proj.weight"] = dw
        if db is not None:
            grads["qkv_proj.bias"] = db
        d_src_k = d_src_v = None
    else:
        parts = {w: pullbacks[w](d) for w, d in (("q", d_q), ("k", d_k), ("v", d_v))}
        d_x, d_src_k, d_src_v = parts["q"][0], parts["k"][0], parts["v"][0]
        if cfg.packed_qkv:  # rows of one weight: their gradients stack
            grads["qkv_proj.weight"] = xp.concat([parts[w][1] for w in "qkv"], axis=0)
            if cfg.bias:
                grads["qkv_proj.bias"] = xp.concat([parts[w][2] for w in "qkv"], axis=0)
        else:
            for w in "qkv":
                grads[f"{w}_proj.weight"] = parts[w][1]
                if parts[w][2] is not None:
                    grads[f"{w}_proj.bias"] = parts[w][2]
    d_context = d_value = None
    if not info["cross"]:
        if d_src_k is not None:
            d_x = d_x + d_src_k + d_src_v
    elif info["separate_value"]:
        d_context, d_value = d_src_k, d_src_v
    else:
        assert d_src_k is not None  # cross-attention projects the context on its own
        d_context = d_src_k + d_src_v
    if info["left"]:
        (d_x,) = pullbacks["roll_x"](d_x)
    grads = {name: grads[name] for name in cfg.param_shapes()}
    return Cotangents(
        d_x, d_context, grads, d_value, d_mask if info["float_mask"] else None, d_score
    )


def norm_back(
    cfg: AttentionConfig,
    pullbacks: Mapping[str, Callable[..., tuple[Any, ...]]],
    grads: Params,
    name: str,
    d: Array,
) -> Array:
    back = pullbacks[name](d)
    grads[f"{name}.weight"] = back[1]
    if cfg.qk_norm == "layer":
        grads[f"{name}.bias"] = back[2]
    return back[0]
