"""Structured attention (``arrayattn.flex``) on CuPy arrays on a real GPU, against the
same calls on NumPy in float64. The fused kernels run block masks but decline score_mod
calls, so ``"auto"`` runs those on the array-API chunked path on the GPU: this checks that
path, the block mask built with ``xp=cupy`` (document ids on the device) and the
score_mod's table gradient there (block masks in the kernels:
tests/kernels/test_fused_flex_gpu.py). Skips cleanly without CuPy or without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
try:
    _NDEV = cp.cuda.runtime.getDeviceCount()
except Exception:  # no driver / no device
    _NDEV = 0
if _NDEV == 0:
    pytest.skip("CuPy has no CUDA device", allow_module_level=True)

import arrayattn as aa  # noqa: E402
from arrayattn import flex  # noqa: E402
from arrayattn.attention.registry import auto_choice  # noqa: E402
from arrayattn.attention.spec import make_spec  # noqa: E402

pytestmark = pytest.mark.gpu


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 2e-5)])
@pytest.mark.parametrize("B,Hq,Hkv,L", [(2, 4, 2, 300), (1, 8, 8, 1000)])
def test_document_mask_with_t5_bias_equals_numpy(dtype, tol, B, Hq, Hkv, L) -> None:
    rng = np.random.default_rng(L)
    E = 64
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, L, E))
    v = rng.standard_normal((B, Hkv, L, E))
    cuts = np.sort(rng.choice(np.arange(1, L), 5, replace=False))
    ids = np.stack([np.searchsorted(cuts, np.arange(L), side="right")] * B)
    ids[-1] = ids[-1][::-1].copy() if B > 1 else ids[-1]  # another packing for row 1
    table = rng.standard_normal((32, Hq))
    g = rng.standard_normal((B, Hq, L, E))

    def run(xp, a_q, a_k, a_v, a_ids, a_table, a_g):
        bm = flex.create_block_mask(flex.document_mask(a_ids, causal=True), B, None, L, L,
                                    block_size=64, xp=xp)  # fmt: skip
        sm = flex.relative_position_bias(a_table)
        (out, lse), pb = aa.vjp(aa.scaled_dot_product_attention, a_q, a_k, a_v,
                                enable_gqa=True, block_mask=bm, score_mod=sm,
                                return_lse=True)  # fmt: skip
        dq, dk, dv, extra = pb((a_g, xp.zeros_like(lse)))
        return out, lse, dq, dk, dv, extra["score_mod"][0]

    want = run(np, q, k, v, ids, table, g)
    dt = getattr(cp, dtype)
    got = run(cp, *(cp.asarray(x, dtype=dt) for x in (q, k, v)), cp.asarray(ids),
              cp.asarray(table, dtype=dt), cp.asarray(g, dtype=dt))  # fmt: skip
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dtable"), got, want, strict=True):
        b_np = np.asarray(b)
        a_np = cp.asnumpy(a)
        fin = np.isfinite(b_np)
        assert np.array_equal(np.isfinite(a_np), fin), name
        assert _rel(a_np[fin], b_np[fin]) <= tol, (name, _rel(a_np[fin], b_np[fin]))


@pytest.mark.parametrize("predicate", ["1", "0"], ids=["pred", "bits"])
def test_auto_runs_the_chunked_path_for_score_mod_on_cupy(predicate, monkeypatch) -> None:
    """(The block mask alone in the kernels: causal_mask evaluated in them, or its bits
    with ARRAYATTN_FLEX_PREDICATE=0.)"""
    monkeypatch.setenv("ARRAYATTN_FLEX_PREDICATE", predicate)
    q = cp.ones((1, 2, 256, 64), dtype=cp.float16)
    bm = flex.create_block_mask(flex.causal_mask, None, None, 256, 256, xp=cp)
    spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None,
                     block_mask=bm, score_mod=flex.softcap_score_mod(50.0))  # fmt: skip
    assert auto_choice(spec) in ("chunked", "composed")
    spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None,
                     block_mask=bm)  # fmt: skip
    assert auto_choice(spec) == "fused"  # a block mask alone runs in the kernels
    out = aa.scaled_dot_product_attention(q, q, q, block_mask=bm)
    ref = aa.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert float(cp.max(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)))) < 2e-3


def test_block_mask_from_numpy_is_refused_on_cupy() -> None:
    q = cp.ones((1, 1, 16, 8), dtype=cp.float32)
    bm = flex.create_block_mask(flex.causal_mask, None, None, 16, 16)  # NumPy
    with pytest.raises(ValueError, match="library cupy"):
        aa.scaled_dot_product_attention(q, q, q, block_mask=bm)


@pytest.mark.parametrize("predicate", ["1", "0"], ids=["pred", "bits"])
def test_builtin_mask_mods_in_the_kernels_equal_numpy(predicate, monkeypatch) -> None:
    """Documents (q/kv ids differing) and (window or global tokens) on the fused path,
    forward and gradients, with the mask_mod evaluated in the kernels or read from bits;
    the same calls on NumPy float64 (the composed path)."""
    monkeypatch.setenv("ARRAYATTN_FLEX_PREDICATE", predicate)
    rng = np.random.default_rng(3)
    B, H, L, S, E = 2, 4, 400, 520, 64
    q = rng.standard_normal((B, H, L, E))
    k, v = (rng.standard_normal((B, H, S, E)) for _ in range(2))
    g = rng.standard_normal((B, H, L, E))
    qi = np.stack([np.repeat([0, 1, 2], [100, 200, 100]), np.repeat([0, 1], [300, 100])])
    ki = np.stack([np.repeat([0, 1, 2], [200, 200, 120]), np.repeat([0, 1], [20, 500])])

    def run(xp, conv):
        mod = flex.and_masks(
            flex.document_mask(conv(qi), conv(ki)),
            flex.or_masks(flex.sliding_window_mask(150, 40), flex.global_tokens_mask(16)),
        )
        bm = flex.create_block_mask(mod, B, None, L, S, xp=xp)
        out, pb = aa.vjp(aa.scaled_dot_product_attention, *(conv(x) for x in (q, k, v)),
                         block_mask=bm)  # fmt: skip
        return (out, *pb(conv(g))[:3])

    want = run(np, lambda x: x)
    got = run(
        cp, lambda x: cp.asarray(x, dtype=cp.float32) if x.dtype.kind == "f" else cp.asarray(x)
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert _rel(cp.asnumpy(a), b) <= 4e-5, (name, _rel(cp.asnumpy(a), b))
