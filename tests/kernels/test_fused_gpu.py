"""The fused forward kernels on a real GPU (CuPy), against a float64 reference written
plainly here. Skips cleanly without CuPy or without a CUDA device.

Every case draws fresh random inputs, the kernels' output buffers are poisoned with NaN
before launch (``fused.POISON_OUTPUTS``), sizes are not multiples of the tiles, and
every dtype, mask kind, causal alignment, window, GQA ratio, lengths, softcap and
dropout is covered. Accuracy (issue 4): relative Frobenius error float32 <= 1e-5,
float64 <= 1e-12, float16 <= 2x PyTorch float16 SDPA's error on the same inputs when a
CUDA PyTorch is installed (else <= 3e-3), bfloat16 <= 2e-2; never NaN; empty rows 0.
"""

from __future__ import annotations

import math

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
from arrayattn.attention.cuda import fused  # noqa: E402
from arrayattn.attention.dropout import dropout_keep  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(fused, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True, params=["v1", "v2", "v3"])
def fwd_variant(request, monkeypatch) -> str:
    """Every test runs on the v1 forward kernels and again with ARRAYATTN_FWD_VARIANT=v2
    (the default: aa_fwd_tc2 where tiles.v2_declines lets it run, v1 elsewhere) and v3
    (v2, and float32 through aa_fwd_tf32). v2 changes only float16/bfloat16 calls and v3
    only float32 ones beyond v2, so the other runs are skipped."""
    callspec = getattr(request.node, "callspec", None)
    dtype = callspec.params.get("dtype") if callspec is not None else None
    if request.param == "v2" and dtype is not None and "16" not in str(dtype):
        pytest.skip("v2 is a float16/bfloat16 variant")
    if request.param == "v3" and (dtype is None or "float32" not in str(dtype)):
        pytest.skip("v3 differs from v2 in float32 calls only")
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", request.param)
    return request.param


def reference(
    q,
    k,
    v,
    *,
    mask=None,
    is_causal=False,
    align="top_left",
    window=None,
    softcap=None,
    scale=None,
    dropout_p=0.0,
    seed=0,
    q_lens=None,
    kv_lens=None,
):
    """float64 SDPA over (B, Hq, L, E) / (B, Hkv, S, E) numpy arrays; mask broadcastable
    to (B, Hq, L, S)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    left, right = window if window is not None else (-1, -1)
    if is_causal:
        right = 0 if right == -1 else min(right, 0)
    full_mask = None if mask is None else np.broadcast_to(mask, (B, Hq, L, S))
    out = np.zeros((B, Hq, L, v.shape[-1]))
    lse = np.full((B, Hq, L), -np.inf)
    for b in range(B):
        ql = L if q_lens is None else int(q_lens[b])
        kl = S if kv_lens is None else int(kv_lens[b])
        off = 0 if align == "top_left" else kl - ql
        i = np.arange(L)[:, None]
        j = np.arange(S)[None, :]
        ok = (i < ql) & (j < kl)
        if left >= 0:
            ok &= j >= i + off - left
        if right >= 0:
            ok &= j <= i + off + right
        for h in range(Hq):
            s = scale * q[b, h] @ k[b, h // G].T
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            allow = ok.copy()
            if full_mask is not None:
                if full_mask.dtype == bool:
                    allow &= full_mask[b, h]
                else:
                    s = s + full_mask[b, h]
            s = np.where(allow, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(s - m)
            tot = e.sum(axis=1, keepdims=True)
            p = e / np.where(tot > 0, tot, 1.0)
            lse[b, h] = np.where(
                tot[:, 0] > 0, m[:, 0] + np.log(np.maximum(tot[:, 0], 1e-300)), -np.inf
            )
            if dropout_p > 0:
                import array_api_compat.numpy as xnp

                keep = dropout_keep(
                    xnp,
                    seed,
                    dropout_p,
                    np.int32(b),
                    np.int32(h),
                    np.arange(L, dtype=np.int32)[:, None],
                    np.arange(S, dtype=np.int32),
                )
                p = np.where(keep, p / (1 - dropout_p), 0.0)
            out[b, h] = p @ v[b, h // G]
    return out, lse


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _torch_f16_error(q, k, v, ref, is_causal, G) -> float | None:
    """PyTorch float16 SDPA's relative error on the same inputs (CUDA PyTorch only)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tq, tk, tv = (torch.as_tensor(np.asarray(x), device="cuda") for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=is_causal, enable_gqa=G > 1
    )
    return _rel(o.double().cpu().numpy(), ref)


_TOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def _run_case(
    dtype,
    B,
    Hq,
    Hkv,
    L,
    S,
    E,
    Ev=None,
    *,
    seed_data=0,
    mask_kind=None,
    mask_shape=None,
    compare_torch=False,
    **opts,
):
    rng = np.random.default_rng(seed_data)
    Ev = E if Ev is None else Ev
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    mask = None
    if mask_kind == "bool":
        mask = rng.random(mask_shape or (B, Hq, L, S)) < 0.7
    elif mask_kind == "float":
        mask = rng.standard_normal(mask_shape or (B, Hq, L, S)).astype(np.float32)
    ql, kl = opts.pop("q_lens", None), opts.pop("kv_lens", None)
    kw = dict(opts)
    if ql is not None:
        kw["q_lengths"] = cp.asarray(np.asarray(ql, dtype=np.int32))
    if kl is not None:
        kw["kv_lengths"] = cp.asarray(np.asarray(kl, dtype=np.int32))
    out, lse = aa.scaled_dot_product_attention(
        cp.asarray(q),
        cp.asarray(k),
        cp.asarray(v),
        None if mask is None else cp.asarray(mask),
        enable_gqa=Hq != Hkv,
        return_lse=True,
        implementation="fused",
        **kw,
    )
    out, lse = out.get().astype(np.float64), lse.get().astype(np.float64)
    ref, ref_lse = reference(
        q,
        k,
        v,
        mask=mask,
        is_causal=opts.get("is_causal", False),
        align=opts.get("causal_align", "top_left"),
        window=opts.get("window"),
        softcap=opts.get("softcap"),
        scale=opts.get("scale"),
        dropout_p=opts.get("dropout_p", 0.0),
        seed=opts.get("seed", 0),
        q_lens=ql,
        kv_lens=kl,
    )
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN (unwritten output?)"
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    err = _rel(out, ref)
    tol = _TOL[np.dtype(dtype).name]
    if compare_torch and np.dtype(dtype) == np.float16 and mask is None and not kw.get("window"):
        t_err = _torch_f16_error(q, k, v, ref, opts.get("is_causal", False), Hq // Hkv)
        if t_err is not None:
            tol = 2 * t_err
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"
    fin = ~empty
    lse_tol = 1e-3 if np.dtype(dtype).itemsize == 2 else (1e-5 if dtype == np.float32 else 1e-12)
    assert np.max(np.abs(lse[fin] - ref_lse[fin]), initial=0) <= lse_tol * max(
        1, np.abs(ref_lse[fin]).max(initial=1)
    )


DTYPES = [np.float16, np.float32, np.float64]


@pytest.mark.parametrize("causal", [False, True])
def test_forward_variant_runs_its_kernel(monkeypatch, fwd_variant, causal) -> None:
    """The switch reaches the launch: float16 D = 128 runs aa_fwd_tc2 under v2 and
    aa_fwd_tc under v1 (several 64-key tiles, causal block skipping, ragged tails)."""
    from arrayattn.attention.cuda import _loader

    names: list[str] = []
    real = _loader.get_kernel
    monkeypatch.setattr(_loader, "get_kernel", lambda f, n, *a: names.append(n) or real(f, n, *a))
    _run_case(np.float16, 2, 4, 2, 1000, 1000, 128, seed_data=13, is_causal=causal)
    want = "aa_fwd_tc2<0, 128," if fwd_variant == "v2" else "aa_fwd_tc<0, 128,"
    assert any(n.startswith(want) for n in names), names


@pytest.mark.parametrize(
    "E,opts",
    [
        (96, {"is_causal": False}),
        (96, {"is_causal": True}),
        (96, {"is_causal": True, "causal_align": "bottom_right", "q_lens": [700, 129],
              "kv_lens": [1000, 0]}),
        (96, {"window": (200, 30)}),
        (80, {"is_causal": True}),  # padded to 96
    ],
    ids=["noncausal", "causal", "causal_br_lengths", "window", "e80_causal"],
)  # fmt: skip
def test_fwd_tc2_d96_switch_runs_its_kernel(monkeypatch, fwd_variant, E, opts) -> None:
    """ARRAYATTN_FWD_TC2_D96=1: float16 D = 96 runs aa_fwd_tc2 (64-key tiles) under v2 and
    aa_fwd_tc under v1, float16-accurate against float64 (several key tiles, GQA, causal
    block skipping, ragged tails, lengths with an empty sequence, windows)."""
    from arrayattn.attention.cuda import _loader

    monkeypatch.setenv("ARRAYATTN_FWD_TC2_D96", "1")
    names: list[str] = []
    real = _loader.get_kernel
    monkeypatch.setattr(_loader, "get_kernel", lambda f, n, *a: names.append(n) or real(f, n, *a))
    _run_case(np.float16, 2, 4, 2, 1000, 1000, E, seed_data=E, compare_torch=True, **opts)
    want = "aa_fwd_tc2<0, 96," if fwd_variant == "v2" else "aa_fwd_tc<0, 96,"
    assert any(n.startswith(want) for n in names), names


@pytest.mark.parametrize("dtype", [np.float32])
@pytest.mark.parametrize("E", [64, 128])
def test_float32_variant_runs_its_kernel(monkeypatch, fwd_variant, dtype, E) -> None:
    """float32 at D = 64/128 runs aa_fwd_tf32 under v3 (three TF32 products per product)
    and aa_fwd_simt under v1, at float32's 1e-5 against float64 (several key tiles,
    causal block skipping, ragged tails)."""
    from arrayattn.attention.cuda import _loader

    names: list[str] = []
    real = _loader.get_kernel
    monkeypatch.setattr(_loader, "get_kernel", lambda f, n, *a: names.append(n) or real(f, n, *a))
    _run_case(dtype, 2, 4, 2, 1000, 1000, E, seed_data=17, is_causal=True)
    want = f"aa_fwd_tf32<{E}," if fwd_variant == "v3" else f"aa_fwd_simt<float, {E},"
    assert any(n.startswith(want) for n in names), names


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", [32, 64, 80, 96, 128, 256])
def test_head_dims(dtype, E) -> None:
    _run_case(dtype, 2, 4, 2, 203, 157, E, seed_data=E, compare_torch=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(300, 300), (129, 517), (517, 129), (1, 77)])
def test_causal_alignments(dtype, align, L, S) -> None:
    _run_case(
        dtype,
        1,
        2,
        1,
        L,
        S,
        64,
        seed_data=L + S,
        is_causal=True,
        causal_align=align,
        compare_torch=align == "top_left" and L == S,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "window,causal",
    [((31, 7), False), ((64, 0), False), ((0, 0), False), ((100, -1), True), ((-1, 40), False)],
)
def test_windows(dtype, window, causal) -> None:
    _run_case(
        dtype,
        1,
        2,
        2,
        333,
        301,
        128,
        seed_data=7,
        window=window,
        is_causal=causal,
        causal_align="bottom_right",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_gqa_ratios(dtype, Hq, Hkv) -> None:
    _run_case(dtype, 2, Hq, Hkv, 150, 170, 64, seed_data=Hq * 10 + Hkv, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [None, (1, 1, 140, 190), (2, 1, 1, 190), (140, 190)])
def test_dense_masks(dtype, kind, shape) -> None:
    _run_case(
        dtype, 2, 3, 3, 140, 190, 64, seed_data=3, mask_kind=kind, mask_shape=shape, is_causal=True
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_lengths(dtype, align) -> None:
    _run_case(
        dtype,
        3,
        2,
        1,
        200,
        260,
        64,
        seed_data=11,
        is_causal=True,
        causal_align=align,
        q_lens=[200, 57, 0],
        kv_lens=[260, 100, 30],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_and_dropout(dtype) -> None:
    _run_case(
        dtype,
        2,
        2,
        1,
        150,
        140,
        64,
        seed_data=5,
        softcap=3.0,
        dropout_p=0.25,
        seed=99,
        is_causal=True,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_and_alibi(dtype) -> None:
    """gpt-oss sinks ``(Hq,)`` and per-batch ALiBi slopes ``(B, Hq)`` in the kernels,
    against the composed path in float64 on the same (rounded) inputs; the second
    sequence has no key, so its rows hold the sink alone (output 0, LSE = sink)."""
    rng = np.random.default_rng(11)
    B, Hq, Hkv, L, S, E = 2, 4, 2, 150, 260, 64
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    sinks = rng.standard_normal(Hq).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, Hq + 1))[None, :] * np.array([[1.0], [0.5]])
    kv_lengths = np.array([S, 0], dtype=np.int32)
    opts = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True)
    out, lse = aa.scaled_dot_product_attention(
        *(cp.asarray(x) for x in (q, k, v)), implementation="fused",
        sinks=cp.asarray(sinks), alibi_slopes=cp.asarray(slopes),
        kv_lengths=cp.asarray(kv_lengths), **opts,
    )  # fmt: skip
    ref, ref_lse = aa.scaled_dot_product_attention(
        *(x.astype(np.float64) for x in (q, k, v)), implementation="composed",
        sinks=sinks.astype(np.float64), alibi_slopes=slopes, kv_lengths=kv_lengths, **opts,
    )  # fmt: skip
    out, lse = out.get().astype(np.float64), lse.get().astype(np.float64)
    assert np.isfinite(lse).all() and (out[1] == 0).all()
    assert _rel(out, ref) <= _TOL[np.dtype(dtype).name]
    lse_tol = 1e-3 if np.dtype(dtype).itemsize == 2 else (1e-5 if dtype == np.float32 else 1e-12)
    assert np.max(np.abs(lse - ref_lse)) <= lse_tol * max(1, np.abs(ref_lse).max())


DECODE_CASES = {
    # (B, Hq, Hkv, L, S, E, options): L <= 16 over S >= 128 runs the split-KV decode kernels
    "gqa_one_token_lengths": (2, 8, 2, 1, 1000, 128,
                              dict(is_causal=True, causal_align="bottom_right",
                                   kv_lens=(1000, 300))),
    "speculative_five_rows": (1, 4, 4, 5, 4100, 64,
                              dict(is_causal=True, causal_align="bottom_right")),
    "mqa_e80_softcap": (3, 4, 1, 1, 129, 80, dict(softcap=5.0)),
    "window_top_left_q_lengths": (2, 4, 2, 16, 700, 64,
                                  dict(window=(100, 3), q_lens=(16, 3), kv_lens=(700, 0))),
}  # fmt: skip


@pytest.mark.parametrize("variant", ["v1", "v2"])  # ARRAYATTN_DECODE_VARIANT
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_shapes_run_the_decode_kernels(monkeypatch, dtype, case, variant) -> None:
    from arrayattn.attention.cuda import decode

    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", variant)
    calls = []
    real = decode.forward
    monkeypatch.setattr(decode, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    launched = []
    real_launch = decode._cupy_launch

    def spy_launch(name, *a, **kw):
        launched.append(name)
        return real_launch(name, *a, **kw)

    monkeypatch.setattr(decode, "_cupy_launch", spy_launch)
    B, Hq, Hkv, L, S, E, opts = DECODE_CASES[case]
    _run_case(dtype, B, Hq, Hkv, L, S, E, seed_data=S, **dict(opts))
    assert calls, "the decode kernels did not run"
    assert launched and all(("_v2<" in n) == (variant == "v2") for n in launched), launched


@pytest.mark.parametrize("variant", ["v1", "v2"])  # ARRAYATTN_DECODE_VARIANT
def test_decode_and_prefill_kernels_agree(monkeypatch, variant) -> None:
    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", variant)
    rs = cp.random.RandomState(4)
    q = rs.standard_normal((2, 32, 1, 128), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((2, 8, 5000, 128), dtype=cp.float32).astype(cp.float16)
    kw = dict(enable_gqa=True, is_causal=True, causal_align="bottom_right", return_lse=True,
              implementation="fused")  # fmt: skip
    out, lse = aa.scaled_dot_product_attention(q, k, k, **kw)
    monkeypatch.setenv("ARRAYATTN_FUSED_DECODE", "0")
    out2, lse2 = aa.scaled_dot_product_attention(q, k, k, **kw)
    assert float(cp.abs(out.astype(cp.float32) - out2.astype(cp.float32)).max()) < 2e-3
    assert float(cp.abs(lse - lse2).max()) < 1e-4


def test_bfloat16_if_available() -> None:
    # NumPy may know bfloat16 (ml_dtypes, imported by JAX) while CuPy does not (CuPy 14.2
    # on the H200 of 2026-11-26): the kernels' bf16 variants are then reachable only
    # through PyTorch tensors (test_torch_cuda_tensors_through_dlpack).
    if not hasattr(cp, "bfloat16"):
        pytest.skip("CuPy has no bfloat16 dtype")
    bf16 = np.dtype(cp.bfloat16)
    _run_case(bf16, 1, 2, 1, 130, 97, 64, seed_data=1, is_causal=True)


def test_varlen_through_fused() -> None:
    rng = np.random.default_rng(4)
    cu = np.array([0, 50, 51, 180], dtype=np.int32)
    q = rng.standard_normal((4, 180, 64)).astype(np.float32)
    kv = rng.standard_normal((2, 180, 64)).astype(np.float32)
    out = aa.varlen_attention(
        cp.asarray(q),
        cp.asarray(kv),
        cp.asarray(kv),
        cp.asarray(cu),
        cp.asarray(cu),
        is_causal=True,
        implementation="fused",
    ).get()
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        ref, _ = reference(q[None, :, a:b], kv[None, :, a:b], kv[None, :, a:b], is_causal=True)
        assert _rel(out[:, a:b], ref[0]) <= 1e-5


def test_auto_picks_fused_on_cupy() -> None:
    from arrayattn.attention import registry

    x = cp.ones((1, 2, 8, 64), dtype=cp.float32)
    spec = aa.attention.spec.make_spec(
        x, x, x, None, 0.0, False, None, False, "top_left", None, None, None
    )
    assert registry.select(spec, "auto") is fused.FUSED


def test_fused_declines_clearly() -> None:
    x = cp.ones((1, 2, 8, 300), dtype=cp.float32)  # head dim > 256
    with pytest.raises(ValueError, match="exceed"):
        aa.scaled_dot_product_attention(x, x, x, implementation="fused")
    y = np.ones((1, 2, 8, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="CuPy"):
        aa.scaled_dot_product_attention(y, y, y, implementation="fused")


def test_noncontiguous_and_broadcast_inputs() -> None:
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 100, 4, 64)).astype(np.float16)  # (B, L, H, E)
    k = rng.standard_normal((1, 90, 2, 64)).astype(np.float16)  # batch-broadcast
    qg = cp.asarray(q).transpose(0, 2, 1, 3)
    kg = cp.asarray(k).transpose(0, 2, 1, 3)
    out = aa.scaled_dot_product_attention(qg, kg, kg, enable_gqa=True, implementation="fused")
    kb = np.broadcast_to(k.transpose(0, 2, 1, 3), (2, 2, 90, 64))
    ref, _ = reference(q.transpose(0, 2, 1, 3), kb, kb)
    assert _rel(out.get().astype(np.float64), ref) <= 3e-3


@pytest.mark.slow
def test_long_sequence_memory() -> None:
    """L = 131072, H = 8, D = 128 float16 runs (no L x S buffer); spot-check rows."""
    L, H, D = 131072, 8, 128
    rs = cp.random.RandomState(0)
    q = rs.standard_normal((1, H, L, D), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((1, H, L, D), dtype=cp.float32).astype(cp.float16)
    v = rs.standard_normal((1, H, L, D), dtype=cp.float32).astype(cp.float16)
    out = aa.scaled_dot_product_attention(q, k, v, is_causal=True, implementation="fused")
    assert not bool(cp.isnan(out).any())
    rows = [0, 1, 777, L - 1]
    for h in (0, H - 1):
        for i in rows:
            s = (k[0, h, : i + 1].astype(cp.float64) @ q[0, h, i].astype(cp.float64)) / math.sqrt(D)
            p = cp.exp(s - s.max())
            ref = (p / p.sum()) @ v[0, h, : i + 1].astype(cp.float64)
            got = out[0, h, i].astype(cp.float64)
            assert float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref)) <= 5e-3


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("L,S", [(300, 517), (1, 2000)])  # prefill and decode kernels
def test_torch_cuda_tensors_through_dlpack(dtype_name, L, S) -> None:
    """PyTorch CUDA tensors reach the kernels through DLPack, bfloat16 as its storage;
    forward and backward against float64, in the caller's dtype, inputs untouched."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    dt = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(L)
    q = torch.randn(2, 8, L, 128, device="cuda", generator=g).to(dt)
    k = torch.randn(2, 2, S, 128, device="cuda", generator=g).to(dt)
    v = torch.randn(2, 2, S, 128, device="cuda", generator=g).to(dt)
    d_out = torch.randn(2, 8, L, 128, device="cuda", generator=g).to(dt)
    kw = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)
    before = [x.clone() for x in (q, k, v)]
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="fused",
                           **kw)  # fmt: skip
    dq, dk, dv = pullback(d_out)[:3]
    assert out.dtype == dq.dtype == dt and out.device == q.device
    assert all(torch.equal(x, b) for x, b in zip((q, k, v), before, strict=True))
    # "auto" takes the same route (the kernels' bits), for tensors not recording gradients
    auto = aa.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(auto, out)
    f64 = [x.double() for x in (q, k, v)]
    ref, ref_pull = aa.vjp(aa.scaled_dot_product_attention, *f64, implementation="composed",
                           **kw)  # fmt: skip
    tol = 2e-2 if dtype_name == "bfloat16" else 3e-3
    for got, want in zip((out, dq, dk, dv), (ref, *ref_pull(d_out.double())[:3]), strict=True):
        err = float((got.double() - want).norm() / want.norm())
        assert err <= 2 * tol, err


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("L,S", [(300, 517), (1, 2000)])  # prefill and decode kernels
def test_jax_gpu_arrays_through_dlpack(dtype_name, L, S) -> None:
    """JAX GPU arrays reach the kernels through DLPack when ``implementation="fused"`` is
    named (bfloat16 as its storage): forward and backward against float64, results JAX
    arrays of the caller's dtype on the caller's device."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU here")
    rng = np.random.default_rng(L)
    dt = getattr(jnp, dtype_name)
    host = [rng.standard_normal(s).astype(np.float32)
            for s in ((2, 8, L, 128), (2, 2, S, 128), (2, 2, S, 128), (2, 8, L, 128))]  # fmt: skip
    q, k, v, d_out = (jnp.asarray(x, dtype=dt) for x in host)
    kw = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)
    out, pullback = aa.vjp(aa.scaled_dot_product_attention, q, k, v, implementation="fused",
                           **kw)  # fmt: skip
    dq, dk, dv = pullback(d_out)[:3]
    for got, like in ((out, q), (dq, q), (dk, k), (dv, v)):
        assert isinstance(got, jax.Array) and got.dtype == dt
        assert got.devices() == like.devices() and got.shape == like.shape
    # "auto" takes the same route (the kernels' bits)
    assert np.array_equal(np.asarray(aa.scaled_dot_product_attention(q, k, v, **kw)),
                          np.asarray(out))  # fmt: skip
    f64 = [np.asarray(x).astype(np.float64) for x in (q, k, v, d_out)]
    ref, ref_pull = aa.vjp(aa.scaled_dot_product_attention, *f64[:3], **kw)
    tol = {"bfloat16": 2e-2, "float16": 3e-3, "float32": 1e-5}[dtype_name]
    for got, want in zip((out, dq, dk, dv), (ref, *ref_pull(f64[3])[:3]), strict=True):
        g = np.asarray(got).astype(np.float64)
        err = float(np.linalg.norm(g - want) / np.linalg.norm(want))
        assert err <= 2 * tol, err
