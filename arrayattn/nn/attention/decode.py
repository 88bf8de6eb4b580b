"""The decoding step of ``MultiHeadAttention`` over a :class:`~arrayattn.nn.KVCache` on
NumPy: one new query per sequence attending to everything its row of the cache holds.

A decoding step's attention is a few small products (``B x Hq`` rows against at most
``max(lengths)`` keys); the general paths (``scaled_dot_product_attention`` with its
spec, cost model and row blocks) spend several times its arithmetic on bookkeeping
there (about 410 us against 60 us at 4 rows x 8 heads over 150 keys).
:func:`decode_attention` computes the same exact softmax directly, in the order the
composed path does (query scaled first, softcap, per-row key range, max shift, ``exp``,
sum, ``P @ V``, normalisation; sinks join the denominator, where the composed path folds
them in after normalising: the same within rounding), on the spec the call was already
checked with. It runs only for calls it covers (see :func:`takes`) and hands
back ``None`` whenever its output is not finite, so that the general path decides what
non-finite inputs give (``docs/semantics.md``): its answers are the general path's
within rounding.
"""

from __future__ import annotations

import numpy as np

from ..._backend import Array, is_numpy
from ...attention.spec import AttentionSpec

__all__ = ["takes", "decode_attention"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def takes(spec: AttentionSpec, implementation: str, n_new: tuple[int, ...]) -> bool:
    """True when :func:`decode_attention` computes this cached call: NumPy, ``"auto"``,
    one new token in every row, float32/float64 computed in its own dtype, and nothing
    beyond causality, a window, a softcap and sinks (no mask, dropout, ALiBi,
    ``mask_mod``/``score_mod``, K/V broadcast over the batch)."""
    return (
        implementation == "auto"
        and spec.L == 1
        and all(n == 1 for n in n_new)
        and is_numpy(spec.xp)
        and np.dtype(spec.dtype) in _DTYPES
        and spec.cdtype == spec.dtype
        and spec.mask_kind is None
        and spec.dropout_p == 0
        and spec.alibi_g is None
        and spec.score_mod is None
        and spec.mask_mod is None
        and spec.block_mask is None
        and not spec.stack_kv
    )


def decode_attention(
    spec: AttentionSpec, qh: Array, keys: Array, values: Array, lengths: np.ndarray
) -> Array | None:
    """Attention of ``qh`` ``(B, Hq, 1, E)`` over ``keys``/``values``
    ``(B, Hkv, S, E|Ev)``, row ``b`` over its first ``lengths[b]`` keys (the last one its
    own, bottom-right aligned), as ``(B, Hq, 1, Ev)`` in ``qh``'s dtype; ``None`` when
    the result holds NaN or Inf, from the inputs or from garbage in excluded positions
    (then the general path computes it, and warns as it does)."""
    with np.errstate(all="ignore"):
        return _attend(spec, qh, keys, values, lengths)


def _attend(
    spec: AttentionSpec, qh: Array, keys: Array, values: Array, lengths: np.ndarray
) -> Array | None:
    B, Hkv, S, E = (int(d) for d in keys.shape)
    G, Ev = spec.G, int(values.shape[-1])
    # GQA: the G query heads of a KV head stacked as the rows of one product
    q = np.reshape(qh, (B, Hkv, G, E))
    if spec.scale != 1.0:
        q = q * spec.scale
    s = np.matmul(q, np.swapaxes(keys, -1, -2))[:, :, :, None, :]
    # (the composed path's grouped layout (B, Hkv, G, L=1, S), on which sinks_g broadcasts)
    if spec.softcap is not None:
        s = np.tanh(s / spec.softcap) * spec.softcap
    # Row b sees keys [lo_b, hi_b): its own filled ones, within the window around its
    # diagonal (key lengths[b] - 1). Keys past a row's length may hold anything.
    st = spec.structure
    last = lengths - 1
    hi = lengths if st.right < 0 else np.minimum(lengths, last + st.right + 1)
    j = np.arange(S)
    allowed = j < hi[:, None]
    if st.left >= 0:
        allowed &= j >= (last - st.left)[:, None]
    if not allowed.all():
        s = np.where(allowed[:, None, None, None, :], s, -np.inf)
    # (NaN or Inf in an excluded value reaches the output as 0 * NaN: the result is then
    # not finite and the general path, which cleans the values, computes the call)
    m = np.max(s, axis=-1, keepdims=True)
    sink = spec.sinks_g
    if sink is not None:
        m = np.maximum(m, sink)
    e = np.exp(s - m)
    total = np.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - m)
    out = np.matmul(e[:, :, :, 0, :], values) / total[:, :, :, 0, :]  # (B, Hkv, G, Ev)
    if not np.isfinite(out).all():
        return None
    return np.reshape(out.astype(qh.dtype, copy=False), (B, Hkv * G, 1, Ev))
