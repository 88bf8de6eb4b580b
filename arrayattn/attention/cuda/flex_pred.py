"""Built-in mask_mods evaluated inside the CUDA kernels (FlexAttention's codegen, issue 32).

A block mask whose mask_mod is a tree of built-ins (:mod:`..mask_mods`: causal, sliding
windows, documents from per-token ids, prefix-LM, global tokens, ``noop_mask``, under
``and_masks``/``or_masks``) gets a C expression generated from the tree's *structure*
only; every run-time value (window bounds, prefix lengths, global-token counts, where
the per-token id arrays start and their row stride) is an int32 *parameter* stored in
the block mask's table (``flex_table.py``), and per-token ids / per-batch prefix lengths
are appended to the table as int32 arrays. So one compiled kernel serves every mask of
the same structure, and the table holds no bits for the partial blocks: the kernels
evaluate the predicate on them (``common.cuh``, ``aa_flex_pred``).

The expression reads ``F`` (the table), ``P`` (its parameter area, ``F + F[12]``), ``b``
(the table's batch index, stored in the partial id slot of a partial block's pair), ``q``
and ``kv`` (query row and key, positions in the call): e.g. a causal document mask is
``((F[P[0] + b * P[1] + q] == F[P[2] + b * P[3] + kv]) & (kv <= q))`` (``&`` and ``|``,
not ``&&`` and ``||``: with every load unconditional the compiler hoists the parameters
out of the kernels' element loops; ``aa_flex_pred`` clamps q and kv). The kernels see it
as the macro ``AA_FLEX_PRED_EXPR`` in front of their source (:func:`prelude`), which also
defines ``AA_FLEX_PRED`` (the compile-time switch in ``attn_fwd.cu`` / ``attn_bwd.cu``).

A mask_mod that is not such a tree (a plain function anywhere in it), ids or values
that do not fit int32, or ``ARRAYATTN_FLEX_PREDICATE=0`` keep the bits path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .. import mask_mods as mm

__all__ = [
    "PREDICATE_ENV",
    "Predicate",
    "predicate_enabled",
    "generate",
    "prelude",
    "sample_prelude",
]

PREDICATE_ENV = "ARRAYATTN_FLEX_PREDICATE"

_I32 = np.iinfo(np.int32)


def predicate_enabled() -> bool:
    """Whether built-in mask_mods are evaluated in the kernels: when
    ``ARRAYATTN_FLEX_PREDICATE`` is ``1``/``true``/``yes`` (read at each table build, for
    A/B runs against the bits path). Off by default: on an H100 (2026-11-26, 17:03 and
    17:16 UTC) the predicate was correct in every GPU test (compute-sanitizer clean) and
    its table a third of the bits' (331 KB against 986 KB, packed documents at
    L = 16384), but its first form ran the forward 1.8-2.0x slower than the bits path
    (forward+backward 3% slower, the backward alone 6% faster); the present form (all
    loads unconditional, hoisted) has not run on a GPU."""
    return os.environ.get(PREDICATE_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass
class Predicate:
    """A generated predicate: ``expr`` (structure only), ``params`` (the int32 parameter
    area; the slots named in ``arrays`` hold an array's table offset once laid out) and
    ``arrays`` (``(slot, int32 array)`` pairs appended to the table)."""

    expr: str
    params: list[int] = field(default_factory=list)
    arrays: list[tuple[int, np.ndarray]] = field(default_factory=list)

    def param(self, value: int) -> str:
        """A new int32 parameter slot holding ``value``: ``P[k]``."""
        if not _I32.min <= int(value) <= _I32.max:
            raise _Unsupported(f"parameter {value} does not fit int32")
        self.params.append(int(value))
        return f"P[{len(self.params) - 1}]"

    def array(self, host: np.ndarray) -> str:
        """A new slot for the table offset of ``host`` (appended as int32): ``P[k]``."""
        if host.size and (host.min() < _I32.min or host.max() > _I32.max):
            raise _Unsupported("per-token values do not fit int32")
        slot = self.param(0)
        self.arrays.append((len(self.params) - 1, np.ascontiguousarray(host, np.int32)))
        return slot

    @property
    def source(self) -> str:
        """What goes in front of the kernel source (:func:`prelude`)."""
        return prelude(self.expr)


class _Unsupported(Exception):
    """The mask_mod (or a value in it) cannot be evaluated in the kernels."""


def prelude(expr: str) -> str:
    """The text prepended to a kernel source for NVRTC (and the emulators): the switch and
    the expression. Part of the compiled module's cache key (``_loader.get_kernel``)."""
    return f"#define AA_FLEX_PRED 1\n#define AA_FLEX_PRED_EXPR ({expr})\n"


def _rows(pred: Predicate, host: np.ndarray, batches: int, what: str) -> tuple[str, str]:
    """``(offset slot, row stride slot)`` of per-batch rows ``host`` ((B, N) or (N,)),
    read at ``b`` in ``[0, batches)``; a single row is shared (stride 0)."""
    rows = 1 if host.ndim == 1 else host.shape[0]
    if rows > 1 and rows < batches:
        raise _Unsupported(f"{what} has {rows} rows, the block mask {batches} batches")
    off = pred.array(host)
    stride = pred.param(host.shape[-1] if rows > 1 else 0)
    return off, stride


def _window(pred: Predicate, m: mm._Window) -> str:
    parts = []
    if m.left >= 0:  # kv >= q + offset - left
        parts.append(f"(kv - q >= {pred.param(m.offset - m.left)})")
    if m.right >= 0:  # kv <= q + offset + right
        parts.append(f"(kv - q <= {pred.param(m.offset + m.right)})")
    if not parts:
        return "true"
    return parts[0] if len(parts) == 1 else "(" + " & ".join(parts) + ")"


def _document(pred: Predicate, m: mm._Document, batches: int) -> str:
    qh, kh = m._host
    qo, qs = _rows(pred, qh, batches, "document_ids")
    if m.kv_ids is m.q_ids:  # self-attention: one copy of the ids in the table
        ko, ks = qo, qs
    else:
        ko, ks = _rows(pred, kh, batches, "kv_document_ids")
    same = f"(F[{qo} + b * {qs} + q] == F[{ko} + b * {ks} + kv])"
    return f"({same} & (kv <= q))" if m.causal else same


def _prefix(pred: Predicate, m: mm._PrefixLM, batches: int) -> str:
    if m.value is not None:
        return f"((kv < {pred.param(m.value)}) | (kv <= q))"
    host = m._host
    if host.shape[0] != 1 and host.shape[0] < batches:
        raise _Unsupported(f"prefix_lengths has {host.shape[0]} values, {batches} batches")
    off = pred.array(host)
    stride = pred.param(1 if host.shape[0] > 1 else 0)
    return f"((kv < F[{off} + b * {stride}]) | (kv <= q))"


def _node(pred: Predicate, m: mm.MaskMod, batches: int) -> str:
    """The C expression of ``m`` (parameters appended to ``pred``)."""
    if isinstance(m, mm._Combined):
        op = " & " if m.op == "and" else " | "
        return "(" + op.join(_node(pred, c, batches) for c in m.mods) + ")"
    if isinstance(m, mm._Noop):
        return "true"
    if isinstance(m, mm._Window):
        return _window(pred, m)
    if isinstance(m, mm._Document):
        return _document(pred, m, batches)
    if isinstance(m, mm._PrefixLM):
        return _prefix(pred, m, batches)
    if isinstance(m, mm._Global):
        n = pred.param(m.n)
        return f"((q < {n}) | (kv < {n}))"
    raise _Unsupported(f"{m!r} is not a built-in mask_mod")


def generate(mask_mod: object, batches: int) -> Predicate | None:
    """The predicate of ``mask_mod`` for a table of ``batches`` batch indices, or ``None``
    when it is not a tree of built-ins (or a value does not fit int32): the bits path.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.flex import document_mask
        >>> p = generate(document_mask(np.zeros((2, 8), np.int32), causal=True), 2)
        >>> p.expr
        '((F[P[0] + b * P[1] + q] == F[P[0] + b * P[1] + kv]) & (kv <= q))'
        >>> p.params
        [0, 8]
    """
    if not isinstance(mask_mod, mm.MaskMod):
        return None
    pred = Predicate(expr="")
    try:
        pred.expr = _node(pred, mask_mod, batches)
    except _Unsupported:
        return None
    return pred


def sample_prelude() -> str:
    """A representative predicate for the compile checks (``.ci/compile_kernels.py
    --flex-pred``, ``tests/kernels/test_nvrtc.py``): every built-in's code shape at once
    (windows, global tokens, per-batch documents and prefix lengths, and/or)."""
    ids = np.zeros((2, 8), np.int32)
    mod = mm.and_masks(
        mm.or_masks(mm.sliding_window_mask(4), mm.global_tokens_mask(1)),
        mm.or_masks(mm.document_mask(ids, causal=True), mm.prefix_lm_mask(np.zeros(2, np.int32))),
    )
    pred = generate(mod, 2)
    assert pred is not None
    return pred.source
