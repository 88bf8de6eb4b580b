"""The kit finds planted bugs: deliberately wrong attention functions, each reported by
``check_attention`` as failing on the right feature with a shrunk example, while the
same function without its bug passes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn.testing import check_attention

SUPPORTS = (
    "basic",
    "scale",
    "bool_mask",
    "empty_rows",
    "causal_top_left",
    "causal_bottom_right",
    "window",
    "gqa",
    "lse",
)


def planted(bug: str | None):
    """A plain NumPy attention with arrayattn's signature and one bug."""

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        *,
        causal_align="top_left",
        window=None,
        return_lse=False,
    ):
        q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
        Hq, L, E = q.shape[-3:]
        Hkv, S = k.shape[-3], k.shape[-2]
        if Hkv != Hq:
            heads = np.arange(Hq)
            # the GQA bug: h % Hkv instead of h // (Hq // Hkv)
            idx = heads % Hkv if bug == "gqa_modulo" else heads // (Hq // Hkv)
            k, v = k[..., idx, :, :], v[..., idx, :, :]
        if scale is None:
            scale = 1.0 / math.sqrt(E)
        if bug == "missing_scale":
            scale = 1.0
        s = q @ np.swapaxes(k, -1, -2) * scale
        i, j = np.arange(L)[:, None], np.arange(S)
        offset = 0
        if causal_align == "bottom_right":
            offset = L - S if bug == "bottom_right_offset" else S - L
        diag = i + offset
        allowed = np.ones((L, S), dtype=bool)
        if is_causal:
            allowed &= j <= diag
        if window is not None:
            left, right = window
            if left >= 0:
                # the window bug: an exclusive left edge
                allowed &= (j > diag - left) if bug == "window_off_by_one" else (j >= diag - left)
            if right >= 0:
                allowed &= j <= diag + right
        if attn_mask is not None:
            allowed = allowed & np.asarray(attn_mask)
        s = np.where(allowed, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        if bug != "nan_empty_rows":
            m = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            e = np.exp(s - m)
            total = np.sum(e, axis=-1, keepdims=True)
            if bug == "nan_empty_rows":
                p = e / total
            else:
                p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
            lse = np.log(total) if bug == "lse_without_max" else m + np.log(total)
        out = (p @ v).astype(query.dtype)
        lse = lse[..., 0].astype(np.float32 if query.dtype != np.float64 else np.float64)
        return (out, lse) if return_lse else out

    return sdpa


BUGS = {
    "bottom_right_offset": "causal_bottom_right",
    "window_off_by_one": "window",
    "nan_empty_rows": "empty_rows",
    "missing_scale": "scale",
    "gqa_modulo": "gqa",
    "lse_without_max": "lse",
}


def test_correct_planted_function_passes():
    report = check_attention(planted(None), supports=SUPPORTS, examples=15)
    assert report.ok, report.table()


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_fails_on_its_feature(bug):
    feature = BUGS[bug]
    report = check_attention(
        planted(bug), supports=SUPPORTS, examples=25, features=["basic", feature]
    )
    row = report.row(feature)
    assert row.status == "failed", report.table()
    assert row.example is not None and row.example["error"]
    spec = row.example["spec"]
    # Shrunk: a handful of queries and keys, head dim at most 2.
    assert spec["query_shape"][-2] <= 3 and spec["key_shape"][-2] <= 3, row.example["call"]
    assert spec["query_shape"][-1] <= 2, row.example["call"]
    if feature != "scale":  # the default scale of E = 1 is 1: "basic" misses that bug
        assert report.status("basic") == "passed", report.table()
    text = report.table()
    assert "minimal failing example" in text and feature in text
    assert '"status": "failed"' in report.to_json()
