"""The NumPy fast path's shared layer: tiled attention with BLAS products, in-place
ufuncs and threads.

This module holds what the forward and backward share: declining, the tunables, the
layout of the inputs (broadcast views, lengths, garbage checks), structural helpers,
scratch buffers and the static score bound.

This is the one attention module that is NumPy-specific (everything else is written
against the array API). ``implementation="auto"`` picks it for NumPy arrays; it declines
every other library, and calls it does not support, which then fall to the chunked or
composed paths.

How it works (see ``SEMANTICS.md`` for what it computes):

- Forward tiles are ``(batch, query head, block of query rows)``. A tile multiplies its
  scaled queries into the keys it can see (``Structure.col_range`` skips the keys a
  causal or windowed block never touches) with BLAS, exponentiates in place and
  multiplies into the values, one key block at a time with an online softmax when the
  row block does not fit the cache budget. Only blocks cut by the causal/window edge
  build a structural mask; user masks are sliced per tile from a broadcast view.
- Softmax stabilisation: when a bound on every score of the tile (``|q_i| * max|k_j|``
  times the scale, or the softcap) shows that ``exp`` cannot overflow, the row maximum is
  not needed at all (a pass and a rescale fewer); rows whose sum underflows are recomputed
  on the exact running-max path, which is also used whenever the bound is too loose or a
  float mask adds arbitrary scores.
- Backward follows FlashAttention-2 from the saved LSE, in work units of
  ``(batch, KV head, key chunk)`` (:mod:`arrayattn.attention.fast.backward`); the forward's
  GQA-stacked tiles and split-KV decode are in :mod:`arrayattn.attention.fast.forward`.
- A thread pool runs the units, with BLAS kept to one thread meanwhile and ``fork``
  handled (:mod:`arrayattn.attention.threads`; ``ARRAYATTN_NUM_THREADS`` sets the pool's
  size).
- Garbage (NaN/Inf) in excluded keys, values and query rows is checked for once per call
  (only when the call excludes something) and kept out of every product
  (:meth:`_Layout.prepare_garbage`).

No buffer of ``L x S`` elements is ever allocated: per worker the largest buffers hold
``rows x key-block`` elements (:data:`BLOCK_ELEMENTS`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from ..._backend import is_numpy, numpy_bridge
from .. import mask_mods as _mm
from .. import static_shift as _static_shift
from ..spec import AttentionSpec
from ..structure import Structure, structural_allowed

__all__ = ["declines", "BLOCK_ELEMENTS", "FWD_ROWS", "BWD_ROWS", "BWD_KEYS"]

# Tunables (measured on a 2-core AMD EPYC with 1 MiB L2 per core; see bench/RESULTS.md).
FWD_ROWS = 256
"""Query rows per forward tile."""
BLOCK_ELEMENTS = 1 << 18
"""Largest ``rows x keys`` block a worker holds (1 MiB in float32: 256 rows x 1024 keys;
measured 1-2% faster than 512 keys on every CPU target shape, one and two threads)."""
BWD_ROWS = 256
"""Query rows per backward block."""
BWD_KEYS = 512
"""Keys per backward block (512 beat 256 by 8-10% at L=2048..4096, D=64; at D=128 and at
L<=1024 the two were within noise: interleaved A/B, 2026-11-22)."""
_SERIAL_WORK = 1 << 20
"""Calls with fewer ``L x S x heads`` score elements than this run on the calling thread."""

# The static shift (see _static_shift): used only when scores, row sums and value sums
# stay well below exp's overflow; a row sum below TINY may have lost precision.
_BITS = {np.dtype(np.float32): 32, np.dtype(np.float64): 64}
_STATIC_LIMIT = {dt: _static_shift.LIMIT[b] for dt, b in _BITS.items()}
_TINY_SUM = {dt: _static_shift.TINY[b] for dt, b in _BITS.items()}

_SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# ---------------------------------------------------------------------------------------
# Registration and declining
# ---------------------------------------------------------------------------------------
def declines(spec: AttentionSpec) -> str | None:
    """``None`` when the fast path can run ``spec``, else the reason it cannot (then
    ``"auto"`` moves on to the chunked/composed paths, and ``implementation="fast"``
    raises a ``ValueError`` with the reason).

    Examples:
        >>> import numpy as np
        >>> from arrayattn.attention.spec import make_spec
        >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
        >>> spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None,
        ...                  None, None)
        >>> declines(spec) is None
        True
    """
    dtype = spec.dtype
    if not is_numpy(spec.xp):
        bridge = numpy_bridge(spec.xp, spec.device)
        if bridge is None:
            return "the NumPy fast path runs on NumPy arrays and PyTorch CPU tensors only"
        if spec.autograd:
            return (
                "inputs that require grad: PyTorch's autograd cannot follow the NumPy fast "
                "path (use arrayattn.vjp on detached tensors, or torch.no_grad())"
            )
        dtype = bridge.dtype(spec.dtype)  # None: NumPy has no such dtype (bfloat16)
        if spec.mask_kind == "float" and bridge.dtype(spec.mask_dtype) is None:
            return (
                f"the NumPy fast path cannot view a {spec.mask_dtype} attn_mask (NumPy has "
                "no such dtype); cast the mask to the inputs' dtype"
            )
    if dtype is None or np.dtype(dtype) not in _SUPPORTED_DTYPES:
        return f"the NumPy fast path supports float16/float32/float64, got {spec.dtype}"
    if min(spec.L, spec.S, spec.E, spec.Ev) == 0:
        return "the NumPy fast path needs non-empty L, S and head dims"
    if spec.flex and not is_numpy(spec.xp):
        # The mods are evaluated on NumPy index arrays: those that capture arrays of the
        # call's library (document ids, bias tables, slopes) would compute in it.
        if spec.score_mod is not None:
            return (
                "a score_mod on PyTorch tensors: the NumPy fast path evaluates it on NumPy "
                "arrays, and its captured arrays are tensors (the chunked and composed "
                "paths run it)"
            )
        if spec.mask_mod is not None and not index_only(spec.mask_mod):
            return (
                f"mask_mod {spec.mask_mod!r} on PyTorch tensors: the NumPy fast path "
                "evaluates mask_mods on NumPy index arrays, and this one may capture "
                "tensors (the chunked and composed paths run it)"
            )
    return None


def index_only(mod: Any) -> bool:
    """True for built-in mask_mods that capture no arrays (causal, windows, global
    tokens, no-op, a prefix-LM with an int length, and/or of those): they give the same
    result on NumPy index arrays whichever library the call's arrays are in."""
    if isinstance(mod, _mm._Combined):
        return all(index_only(m) for m in mod.mods)
    if isinstance(mod, _mm._PrefixLM):
        return mod.per_batch is None
    return isinstance(mod, (_mm._Window, _mm._Global, _mm._Noop))


# ---------------------------------------------------------------------------------------
# Layout: broadcast views, indices, structural helpers
# ---------------------------------------------------------------------------------------
class _Layout:
    """Broadcast views of the inputs in ``(*lead, heads, seq, dim)`` and index helpers."""

    def __init__(
        self,
        spec: AttentionSpec,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        attn_mask: np.ndarray | None,
    ) -> None:
        self.spec = spec
        cd = np.dtype(spec.cdtype)
        self.cd = cd
        nd = len(spec.lead) + 3
        self.lead_index: list[tuple[int, ...]] = (
            list(np.ndindex(*spec.lead)) if spec.lead else [()]
        )
        self._raw: dict[str, np.ndarray] = {}
        self.q = self._view("q", query, spec.q_shape, nd, (spec.Hq, spec.L, spec.E), cd)
        self.k = self._view("k", key, spec.k_shape, nd, (spec.Hkv, spec.S, spec.E), cd)
        self.v = self._view("v", value, spec.v_shape, nd, (spec.Hkv, spec.S, spec.Ev), cd)
        self.mask = None
        if attn_mask is not None:
            m = np.asarray(attn_mask)
            m = m.reshape((1,) * (nd - m.ndim) + m.shape)
            self.mask_padded_shape: tuple[int, ...] = m.shape
            self.mask = np.broadcast_to(m, spec.lead + (spec.Hq, spec.L, spec.S))
        self.scale = spec.scale
        # Per-sequence lengths: rows >= q_len are empty, keys >= kv_len excluded, and
        # bottom-right alignment puts each sequence's diagonal at its own offset.
        nb = len(self.lead_index)
        self.q_len = _per_batch(getattr(spec, "q_len_g", None), nb, spec.L)
        self.kv_len = _per_batch(getattr(spec, "kv_len_g", None), nb, spec.S)
        offsets = getattr(spec, "offset_g", None)
        st = spec.structure
        if offsets is None:
            self.structs = [st] * nb
        else:
            flat = np.asarray(offsets).reshape(-1)
            self.structs = [dataclasses.replace(st, offset=int(flat[i])) for i in range(nb)]
        self.limit = _STATIC_LIMIT[cd]
        self.tiny = _TINY_SUM[cd]
        # Per-(batch, query head) sinks and ALiBi slopes, ``(*lead, Hq)`` views.
        self.sinks = self._per_head(spec.sinks, cd)
        self.alibi = self._per_head(spec.alibi_slopes, cd)
        self._garbage_ready = False
        # The call's FlexPlan (arrayattn.flex: mask_mod, block mask, score_mod) or None.
        self.flex: Any = None
        self._values_lock = threading.Lock()

    def _per_head(self, x, cd):
        if x is None:
            return None
        a = np.asarray(x).astype(cd, copy=False)
        a = a.reshape((1,) * (len(self.spec.lead) + 1 - a.ndim) + a.shape)
        return np.broadcast_to(a, self.spec.lead + (self.spec.Hq,))

    def _view(self, name, x, shape, nd, tail, cd):
        a = np.asarray(x)
        a = a.astype(cd) if a.dtype != cd else blas_ready(a)  # astype's copy is both
        a = a.reshape((1,) * (nd - a.ndim) + a.shape)
        self._raw[name] = a  # unbroadcast: data checks read each element once
        return np.broadcast_to(a, self.spec.lead + tail)

    def prepare_garbage(self, backward: bool = False, lazy_values: bool = False) -> None:
        """Set up what keeps garbage (NaN, Inf, or values so huge that products overflow)
        in excluded pairs out of every result (SEMANTICS, "Garbage in masked
        positions"), decided on the data once per call, only when the call excludes
        something. One norm pass per input: a finite norm proves the entries finite.

        - ``v_op`` (and ``q_op``/``k_op`` for the backward): the operands that meet
          excluded pairs' zero weights in products (``P V``, ``dS K``, ``dS^T Q``,
          ``dO V^T``), with non-finite entries zeroed; the inputs themselves when finite;
        - ``v_bad``: ``(*lead, Hkv, S)`` indicator of value rows holding NaN/Inf (rows
          that attend to one become NaN), or ``None``;
        - ``qk_garbage``: scores may be non-finite, so a float mask's ``-inf`` must be
          re-applied after the addition (``inf + -inf`` is NaN);
        - ``v_norm``: the largest value-row norm (bounds ``dO V^T`` in the backward).

        ``lazy_values`` (the forward): V is not read up front (a pass over the whole
        buffer, a KV cache's unfilled tail included, cost a third of a decode step);
        ``values_checked`` stays ``False`` and a tile whose output is not finite calls
        :meth:`check_values` and is computed again (finite outputs cannot have met
        garbage: ``0 * NaN`` and ``0 * Inf`` are NaN)."""
        spec = self.spec
        if not self._garbage_ready:
            self._garbage_ready = True
            self.q_op, self.k_op, self.v_op = self.q, self.k, self.v
            self.v_bad: np.ndarray | None = None
            self.qk_garbage = False
            self.v_norm = 0.0
            self._qk_checked = False
            self.values_checked = not spec.may_mask
            if not lazy_values:
                self.check_values()
        if spec.may_mask and not self._qk_checked and (backward or spec.mask_kind == "float"):
            self._qk_checked = True
            big = float(np.finfo(self.cd).max) / 4
            norms = {}
            for name in ("q", "k"):
                raw = self._raw[name]
                norms[name] = _max_norm(raw)
                if not math.isfinite(norms[name]) and not np.isfinite(raw).all():
                    op = np.broadcast_to(_finite_or_zero(raw), getattr(self, name).shape)
                    setattr(self, f"{name}_op", op)
            bound = norms["q"] * norms["k"] * abs(spec.scale)
            self.qk_garbage = spec.mask_kind == "float" and not bound < big

    def check_values(self) -> None:
        """The value part of :meth:`prepare_garbage` (once; thread-safe)."""
        with self._values_lock:
            if self.values_checked:
                return
            raw = self._raw["v"]
            v_norm = _max_norm(raw)
            if not math.isfinite(v_norm) and not np.isfinite(raw).all():
                cleaned = _finite_or_zero(raw)
                bad = np.logical_not(np.isfinite(raw).all(axis=-1)).astype(self.cd)
                self.v_bad = np.broadcast_to(bad, self.spec.lead + (self.spec.Hkv, self.spec.S))
                self.v_op = np.broadcast_to(cleaned, self.v.shape)
                v_norm = _max_norm(cleaned)
            self.v_norm = v_norm
            self.values_checked = True

    def values_checked_now(self) -> bool:
        """``values_checked`` read under the check's lock (never mid-update)."""
        with self._values_lock:
            return self.values_checked

    def kv_head(self, h: int) -> int:
        spec = self.spec
        if spec.Hkv == 1:
            return 0
        return h // spec.G

    def heads_of(self, hk: int) -> list[int]:
        return [h for h in range(self.spec.Hq) if self.kv_head(h) == hk]


def aligned(a: np.ndarray) -> np.ndarray:
    """``a``, or an aligned copy of it where its data is not aligned to its item size.

    Arrays over received bytes can start anywhere: Dask hands a worker the chunks of an
    array embedded in its graph (``da.from_array`` of a NumPy array) at any byte offset.
    NumPy's BLAS products copy such an operand on every call; one copy up front costs
    a memcpy instead (a float32 block of 4 heads x 2048 x 2048 x 64 on one thread, one
    byte off: forward 47.3 against 44.3 ms before this copy, 44.2 ms with it).

    Examples:
        >>> import numpy as np
        >>> raw = np.zeros(4 * 3 + 1, dtype=np.uint8)
        >>> x = raw[1:].view(np.float32)            # starts one byte off
        >>> x.flags.aligned, aligned(x).flags.aligned, aligned(x).shape
        (False, True, (3,))
    """
    return a if a.flags.aligned else a.copy()


def blas_ready(a: np.ndarray) -> np.ndarray:
    """``a`` aligned (:func:`aligned`), and copied to C order where its last two axes
    (rows, features) are not laid out as BLAS takes them: a unit stride along the
    features and rows no closer than a row's width (a broadcast ``np.broadcast_to``
    view has stride 0 there).

    Why: NumPy runs a product with such an operand in its own loop, not in BLAS, and
    that loop rounds differently. The same values then gave other results by a float32
    ulp, and on Dask a cotangent chunk is a broadcast view where it is made and a
    contiguous array where it arrives over the network, so a forward+backward graph's
    dQ and dK changed from run to run with the scheduling (measured 2026-11-26).

    Examples:
        >>> import numpy as np
        >>> ones = np.broadcast_to(np.float32(1), (2, 3, 4))
        >>> ones.strides, blas_ready(ones).strides
        ((0, 0, 0), (48, 16, 4))
    """
    a = aligned(a)
    if a.ndim < 2 or a.size == 0:
        return a
    item = a.itemsize
    rows, cols = a.shape[-2:]
    unit = cols == 1 or a.strides[-1] == item
    spaced = rows == 1 or a.strides[-2] >= cols * item
    return a if unit and spaced else np.ascontiguousarray(a)


def _finite_or_zero(a: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(a), a, a.dtype.type(0))


def _max_norm(a: np.ndarray) -> float:
    """The largest row norm of ``a`` (``inf``/``nan`` when an entry is non-finite or the
    squares overflow; 0 for an empty array)."""
    return float(_norms(a).max()) if a.size else 0.0


def _per_batch(lengths: Any, nb: int, default: int) -> list[int]:
    if lengths is None:
        return [default] * nb
    return [int(x) for x in np.asarray(lengths).reshape(-1)]


def _row_range(st: Structure, c0: int, c1: int, L: int) -> tuple[int, int]:
    """Half-open range of query rows that can see at least one key of ``[c0, c1)``."""
    lo = 0 if st.right < 0 else max(0, c0 - st.offset - st.right)
    hi = L if st.left < 0 else min(L, c1 - 1 - st.offset + st.left + 1)
    return lo, max(lo, hi)


def _fully_visible(st: Structure, r0: int, r1: int, c0: int, c1: int) -> bool:
    """True when every row of ``[r0, r1)`` sees every key of ``[c0, c1)``."""
    if st.right >= 0 and r0 + st.offset + st.right < c1 - 1:
        return False
    if st.left >= 0 and r1 - 1 + st.offset - st.left > c0:
        return False
    return True


_EXCLUDED_CACHE: dict[tuple[int, ...], np.ndarray] = {}


def _blocked_out(st: Structure, r0: int, r1: int, c0: int, c1: int) -> np.ndarray | None:
    """Boolean ``(r1-r0, c1-c0)`` array of structurally *excluded* pairs, or ``None``.

    The pattern depends only on the block's shape and its diagonal's position, so it is
    cached (blocks along the causal diagonal repeat it)."""
    if _fully_visible(st, r0, r1, c0, c1):
        return None
    key = (r1 - r0, c1 - c0, r0 + st.offset - c0, st.left, st.right)
    excluded = _EXCLUDED_CACHE.get(key)
    if excluded is None:
        rows = np.arange(r0, r1, dtype=np.int32).reshape(-1, 1)
        cols = np.arange(c0, c1, dtype=np.int32)
        allowed = structural_allowed(np, st, rows, cols)
        assert allowed is not None  # the block is not fully visible: something is masked
        excluded = np.logical_not(allowed)
        if len(_EXCLUDED_CACHE) > 512:
            _EXCLUDED_CACHE.clear()
        _EXCLUDED_CACHE[key] = excluded
    return excluded


_ALIBI_CACHE: dict[tuple[int, ...], np.ndarray] = {}


def _alibi_distance(st: Structure, r0: int, r1: int, c0: int, c1: int, cd: Any) -> np.ndarray:
    """``|i + offset - j|`` for rows ``[r0, r1)`` x keys ``[c0, c1)`` in ``cd``: ALiBi's
    distance from the aligned diagonal. It depends only on the block's shape and the
    diagonal's position, so it is cached like the structural masks."""
    key = (r1 - r0, c1 - c0, r0 + st.offset - c0, np.dtype(cd).num)
    dist = _ALIBI_CACHE.get(key)
    if dist is None:
        rows = np.arange(r0, r1, dtype=np.int64).reshape(-1, 1) + st.offset
        dist = np.abs(rows - np.arange(c0, c1, dtype=np.int64)).astype(cd)
        dist.flags.writeable = False
        if len(_ALIBI_CACHE) > 512:
            _ALIBI_CACHE.clear()
        _ALIBI_CACHE[key] = dist
    return dist


def _add_alibi(
    lay: _Layout,
    structure: Structure,
    b: tuple[int, ...],
    h: int,
    r0: int,
    r1: int,
    c0: int,
    c1: int,
    s: np.ndarray,
) -> None:
    """``s -= slope_(b,h) * |i + offset - j|`` in place (ALiBi, after the softcap)."""
    if lay.alibi is None:
        return
    slope = lay.alibi[b + (h,)]
    dist = _alibi_distance(structure, r0, r1, c0, c1, s.dtype)
    np.subtract(s, dist * slope, out=s)


def _merge_sinks(lay: _Layout, out: np.ndarray, lse: np.ndarray) -> None:
    """Fold the sinks into the whole normalised output and its LSE, in place:
    ``LSE' = logaddexp(LSE, sink)``, ``out *= exp(LSE - LSE')`` (rows with no key get
    output 0 and ``LSE' = sink``), as ``_composed.merge_sinks``."""
    if lay.sinks is None:
        return
    sink = lay.sinks[..., None]
    new = np.logaddexp(lse, sink)
    # lse -inf (no key): factor 0; a NaN LSE (NaN scores) keeps its NaN row.
    factor = np.where(lse == -np.inf, 0.0, np.exp(lse - np.where(np.isfinite(new), new, 0.0)))
    np.multiply(out, factor[..., None].astype(out.dtype, copy=False), out=out)
    lse[...] = new


def _key_spans(
    st: Structure, r0: int, r1: int, c_lo: int, c_hi: int, width: int
) -> list[tuple[int, int]]:
    """Key blocks of at most ``width`` covering ``[c_lo, c_hi)`` for rows ``[r0, r1)``,
    cut so that the keys every row sees form whole blocks and only the (narrow) window
    edges need a structural mask."""
    full_lo = c_lo if st.left < 0 else max(c_lo, r1 - 1 + st.offset - st.left)
    full_hi = c_hi if st.right < 0 else min(c_hi, r0 + st.offset + st.right + 1)
    if full_lo >= full_hi:
        return _spans(c_lo, c_hi, width)
    return (
        _spans(c_lo, full_lo, width)
        + _spans(full_lo, full_hi, width)
        + _spans(full_hi, c_hi, width)
    )


# Relative slack on norms summed in the compute dtype: their rounding error is at most
# about head_dim * eps (1.5e-5 for float32 at head_dim 128), far below this.
_NORM_SLACK = 1.0 + 1e-3


def _norms(x: np.ndarray) -> np.ndarray:
    """Upper bounds on the Euclidean norms over the last axis. Summed in the array's own
    dtype (a float64 copy of Q and K cost 5% of a D=128 forward); an overflow gives
    ``inf``, which only sends the tile to the exact path."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(np.einsum("...d,...d->...", x, x)) * _NORM_SLACK


def _spans(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


# ---------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------
class _Scratch:
    """A ``rows x keys`` scratch buffer whose ``[:n, :w]`` blocks are contiguous (the
    first ``n * w`` elements), so that ufuncs over a block narrower than the buffer run
    as one loop rather than one short loop per row (causal edges and last key blocks:
    a strided 256 x 256 block cost ~30% more per element in ``exp``)."""

    def __init__(self, rows: int, keys: int, dtype: Any):
        self._flat = np.empty(rows * keys, dtype)

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        rows, keys = index
        assert rows.start is None and keys.start is None and rows.stop is not None
        return self._flat[: rows.stop * keys.stop].reshape(rows.stop, keys.stop)


def _static_bounds(spec: AttentionSpec, lay: _Layout) -> tuple[np.ndarray, float] | None:
    """Per-(batch, query head, row) upper bound on ``|score|`` (or ``None`` when a float
    mask rules the static shift out), and the extra log-room the sums need.

    ALiBi with slopes >= 0 keeps the bound: its bias is <= 0, so it only lowers scores,
    and rows whose sums then underflow are redone on the exact path (forward), while
    ``exp(S)`` underflowing in the backward means ``P <= exp(-87 + 40)``, far below
    rounding. A negative slope can raise scores without bound: exact path."""
    if spec.mask_kind == "float":  # arbitrary additive scores: exact path
        return None
    if spec.score_mod is not None:  # scores no longer bounded by |q| |k|: exact path
        return None
    if lay.alibi is not None and not (lay.alibi.size == 0 or float(np.min(lay.alibi)) >= 0.0):
        return None
    q_norm = _norms(lay.q) * abs(spec.scale)  # (*lead, Hq, L)
    k_max = _norms(lay.k).max(axis=-1)  # (*lead, Hkv)
    # max |v| from two reductions (no |v| temporary); NaN propagates into ``room``.
    v_max = float(np.maximum(np.abs(np.max(lay.v)), np.abs(np.min(lay.v)))) if lay.v.size else 0.0
    room = math.log(max(spec.S, 1)) + math.log(max(v_max, 1.0))
    if not math.isfinite(room):
        return None
    # Bound per (lead, Hq, L): |q_i| * max_j |k_j| for the KV head of each query head.
    kv_of = np.array([lay.kv_head(h) for h in range(spec.Hq)])
    bound = q_norm * k_max[..., kv_of][..., None]
    if spec.softcap is not None:
        bound = np.minimum(bound, spec.softcap)
    return bound, room
