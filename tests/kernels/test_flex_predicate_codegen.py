"""The block-mask predicate's code generation (``cuda/flex_pred.py``) on the host alone:
mask_mod structure -> C expression, run-time values -> the table's parameter area, the
fall-backs to the bits path, and the expression evaluated by a Python mirror of the
kernels' ``aa_flex_pred`` on the built table against the mask_mod itself."""

from __future__ import annotations

import re

import array_api_compat.numpy as xnp
import numpy as np
import pytest

from arrayattn.attention import block_mask as bmod
from arrayattn.attention.cuda import flex_pred, flex_table
from arrayattn.flex import (
    and_masks,
    causal,
    causal_mask,
    create_block_mask,
    document_mask,
    global_tokens_mask,
    noop_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)


@pytest.fixture(autouse=True)
def _predicate_on(monkeypatch) -> None:
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "1")


def test_off_by_default(monkeypatch) -> None:
    """The bits path unless ARRAYATTN_FLEX_PREDICATE=1 (the bits path ran the forward
    faster on an H100)."""
    monkeypatch.delenv(flex_pred.PREDICATE_ENV)
    assert not flex_pred.predicate_enabled()
    bm = create_block_mask(causal_mask, None, None, 256, 256)
    assert flex_table.prelude(bm) == ""


def test_structure_only_sources() -> None:
    """The source names parameter slots, never values: masks of one structure share it
    (one compiled kernel), another structure gets another."""
    a = flex_pred.generate(or_masks(sliding_window_mask(40), global_tokens_mask(8)), 1)
    b = flex_pred.generate(or_masks(sliding_window_mask(7, 3), global_tokens_mask(1)), 1)
    assert a is not None and b is not None
    assert a.expr == "(((kv - q >= P[0]) & (kv - q <= P[1])) | ((q < P[2]) | (kv < P[2])))"
    assert a.expr == b.expr and a.source == b.source
    assert (a.params, b.params) == ([-40, 0, 8], [-7, 3, 1])
    c = flex_pred.generate(causal(5), 1)
    assert c is not None and c.expr == "(kv - q <= P[0])" and c.params == [5]
    assert flex_pred.generate(noop_mask, 1).expr == "true"  # type: ignore[union-attr]
    ids = np.arange(16) // 4
    d1 = flex_pred.generate(document_mask(ids), 1)
    d2 = flex_pred.generate(document_mask(ids[::-1].copy()), 1)
    assert d1 is not None and d2 is not None and d1.source == d2.source
    assert d1.expr == "(F[P[0] + b * P[1] + q] == F[P[0] + b * P[1] + kv])"  # one id copy
    dq = flex_pred.generate(document_mask(ids, ids.copy(), causal=True), 1)
    assert dq is not None and "P[2]" in dq.expr and dq.expr.endswith("& (kv <= q))")
    p = flex_pred.generate(and_masks(prefix_lm_mask(np.array([3, 9])), causal_mask), 2)
    assert p is not None
    assert p.expr == "(((kv < F[P[0] + b * P[1]]) | (kv <= q)) & (kv - q <= P[2]))"
    assert p.source.startswith("#define AA_FLEX_PRED 1\n#define AA_FLEX_PRED_EXPR (")


def test_fallbacks_to_bits(monkeypatch) -> None:
    """A plain function anywhere in the tree, values past int32, ids with fewer rows than
    the block mask's batches, and ARRAYATTN_FLEX_PREDICATE=0 keep the bits."""

    def plain(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    assert flex_pred.generate(plain, 1) is None
    assert flex_pred.generate(and_masks(causal_mask, plain), 1) is None
    assert flex_pred.generate(global_tokens_mask(2**31), 1) is None
    assert flex_pred.generate(document_mask(np.array([0, 2**40])), 1) is None
    assert flex_pred.generate(document_mask(np.zeros((2, 8), np.int64)), 3) is None
    assert flex_pred.generate(prefix_lm_mask(np.array([1, 2])), 3) is None
    bm = create_block_mask(causal_mask, None, None, 256, 256)
    assert flex_table.prelude(bm) != ""
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "0")
    assert flex_table.prelude(bm) == "" and flex_table.predicate(bm) is None
    t = np.asarray(flex_table.build(bm, xnp))
    assert t[12] == 0 and t.size > int(t[9])  # the bits path: bits after the lists


def _mirror(expr: str):
    """The C expression as Python (the kernels' aa_flex_pred without the range test)."""
    py = expr.replace("&&", " and ").replace("||", " or ").replace("true", "True")
    return eval(f"lambda F, P, b, q, kv: {py}")  # noqa: S307 (generated here, not input)


def _cases() -> dict[str, tuple]:
    L, S = 200, 170
    ids = np.stack([np.repeat([0, 1, 2], [60, 100, 40]), np.repeat([0, 1], [150, 50])])
    kv_ids = np.stack([np.repeat([0, 1, 2], [50, 70, 50]), np.repeat([0, 1], [20, 150])])
    wg = or_masks(sliding_window_mask(30, 2, offset=-3), global_tokens_mask(9))
    return {
        "document": (document_mask(ids, kv_ids, causal=True), 2, L, S),
        "prefix_lm": (prefix_lm_mask(np.array([33, 120])), 2, L, S),
        "prefix_int": (prefix_lm_mask(77), None, L, S),
        "window_global": (wg, None, L, S),
        "and_or": (and_masks(wg, document_mask(ids[0])), None, L, L),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_parameters_in_table_match_mask_mod(name: str) -> None:
    """The table holds no bits; its header points at the parameters, the arrays follow
    them, every partial pair holds its batch index; the expression evaluated on the
    table (the mirror) equals the mask_mod on every pair of every partial block."""
    mod, B, L, S = _cases()[name]
    bm = create_block_mask(mod, B, None, L, S, block_size=(64, 48))
    pred = flex_table.predicate(bm)
    assert pred is not None
    t = np.asarray(flex_table.build(bm, xnp))
    nq, nk, oc, ol, ob, otc, otl = (int(t[i]) for i in (0, 1, 7, 8, 9, 10, 11))
    off_p, tl, ts = (int(x) for x in t[12:15])
    Bt, Ht = bm.kinds.shape[:2]
    assert (tl, ts) == (L, S) and off_p == otl + Bt * Ht * nk * (nq + 1) * 2  # after tlists
    assert ob == t.size  # no bits
    params = t[off_p : off_p + len(pred.params)]
    for slot, arr in pred.arrays:  # the arrays at the offsets their slots hold
        np.testing.assert_array_equal(t[params[slot] : params[slot] + arr.size], arr.ravel())
    for k, v in enumerate(pred.params):
        if k not in {slot for slot, _ in pred.arrays}:
            assert params[k] == v
    lists = t[ol:otc].reshape(Bt, Ht, nq, nk + 1, 2)
    fn = _mirror(pred.expr)
    qb, kb = bm.Q_BLOCK, bm.KV_BLOCK
    checked = 0
    for b in range(Bt):
        for qi in range(nq):
            for kj, slot in lists[b, 0, qi]:
                if kj == nk:
                    break
                assert (slot >= 0) == (bm.kinds[b, 0, qi, kj] == bmod.PARTIAL)
                if slot < 0:
                    continue
                assert slot == b  # the pair's second value: the table's batch index
                qs = np.arange(qi * qb, min(L, (qi + 1) * qb))
                ks = np.arange(kj * kb, min(S, (kj + 1) * kb))
                want = np.broadcast_to(mod(b, 0, qs[:, None], ks[None, :]), (qs.size, ks.size))
                got = [[fn(t, params, slot, int(q), int(k)) for k in ks] for q in qs]
                np.testing.assert_array_equal(np.asarray(got, bool), want)
                checked += 1
    assert checked > 0


def test_packed_documents_table_bytes() -> None:
    """bench/RESULTS.md's case: 8 documents in L = 16384, block 128: the predicate table
    is the bits table less its bits plus the ids (one copy for self-attention)."""
    L = 16384
    lengths = [1000, 3000, 1500, 2500, 2000, 1800, 2584, 2000]
    ids = np.repeat(np.arange(8), lengths)
    bm = create_block_mask(document_mask(ids, causal=True), None, None, L, L)
    with_pred = np.asarray(flex_table.build(bm, xnp))
    n_partial = int((bm.kinds == bmod.PARTIAL).sum())
    assert int(with_pred[9]) == with_pred.size
    host, _ = flex_table.host_layout(bm.kinds, 128, 128)
    bits_words = host.size + n_partial * 128 * 4
    assert with_pred.size == host.size + 2 + L  # 2 parameters, the ids once
    assert with_pred.size < bits_words
    assert re.search(r"F\[P\[0\] \+ b \* P\[1\] \+ kv\]", flex_table.prelude(bm))
