"""Block masks (``arrayattn.flex``) in the fused forward kernels on a real GPU (CuPy): the
kernels' block table and partial-block bits (``cuda/flex_table.py``) against the NumPy
composed path in float64, on v1 (``aa_fwd_tc``, ``aa_fwd_simt``) and v2 (``aa_fwd_tc2``);
that ``"auto"`` takes the fused path and which kernel ran (a spy on the loader); ``vjp``
with the backward kernels opted out (``ARRAYATTN_FLEX_BWD_KERNELS=0``: fused forward,
array-API backward from the kernel's LSE) against NumPy; a timing print of block mask vs
dense mask on a packed 8-document batch (not asserted); and the backward kernels'
block-mask instantiations (the default since they ran on an H100: v2 and the CUDA-core
kernels, both dQ modes; v4's ``aa_bwd_dkdv_mma4<..., true>`` under
``ARRAYATTN_BWD_VARIANT=v4`` at head dims 64 and 128, float16; a spy checks they ran) against NumPy
float64.
Skips cleanly without CuPy or without a CUDA device.

    python -m pytest tests/kernels/test_fused_flex_gpu.py -q -s
"""

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
from arrayattn.attention.cuda import _loader, flex_pred, fused  # noqa: E402
from arrayattn.attention.cuda import backward as kernels_backward  # noqa: E402
from arrayattn.attention.registry import auto_choice  # noqa: E402
from arrayattn.attention.spec import make_spec  # noqa: E402

pytestmark = pytest.mark.gpu

_TOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}
_LSE_TOL = {"float16": 1e-3, "bfloat16": 1e-3, "float32": 1e-5, "float64": 1e-12}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(fused, "POISON_OUTPUTS", True)


_PRELUDES: list[str] = []
"""The preludes the loader got during the test (a built-in mask_mod's predicate or "")."""

# Built-in mask_mods evaluated in the kernels (flex_pred.py, the default) and the bits path
# (ARRAYATTN_FLEX_PREDICATE=0): both on every block-mask run below.
_PRED = pytest.mark.parametrize("predicate", [True, False], ids=["pred", "bits"])


def _set_predicate(monkeypatch, predicate: bool) -> None:
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "1" if predicate else "0")


def _check_path(predicate: bool, names: list[str]) -> None:
    """Every block-mask kernel loaded was compiled with the predicate (or none was), the
    others without."""
    assert names and len(names) == len(_PRELUDES)
    for name, pre in zip(names, _PRELUDES, strict=True):
        flex_kernel = name.endswith(", true>") or ", 4" in name or ", 5" in name or ", 6" in name
        assert ("AA_FLEX_PRED" in pre) == (predicate and flex_kernel), (name, pre)


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """Name expressions of the forward kernels loaded during the test."""
    names: list[str] = []
    real = _loader.get_kernel

    def spy(filename, name, smem=0, prelude=""):
        names.append(name)
        _PRELUDES.append(prelude)
        return real(filename, name, smem, prelude)

    del _PRELUDES[:]

    monkeypatch.setattr(_loader, "get_kernel", spy)
    return names


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _doc_ids(rng, B: int, L: int, docs: int) -> np.ndarray:
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), docs - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(L), side="right"))
    return np.stack(rows)


def _mask_mod(name: str, xp, rng_seed: int, B: int, L: int):
    rng = np.random.default_rng(rng_seed)
    if name == "document":
        ids = _doc_ids(rng, B, L, 5)
        return flex.document_mask(xp.asarray(ids), causal=True)
    if name == "prefix_lm":
        return flex.prefix_lm_mask(xp.asarray(np.array([L // 3, 17] * B)[:B]))
    if name == "window_global":
        return flex.or_masks(flex.sliding_window_mask(100, 0), flex.global_tokens_mask(24))
    raise ValueError(name)


_CASES = {
    # name: (B, Hq, Hkv, L, S, extra options)
    "document": (2, 4, 2, 700, 700, {}),
    "prefix_lm": (2, 2, 2, 333, 333, {"sinks": True, "kv_lengths": [333, 200]}),
    "window_global": (1, 4, 1, 517, 600, {"bool_mask": True, "q_lengths": [450]}),
}


# (case, dtype, forward variant, head dim): every case on every kernel family at D = 64
# (v2 aa_fwd_tc2, v1 aa_fwd_tc, aa_fwd_simt float and double, v3 aa_fwd_tf32), and v2 and
# v3 at D = 128 (v1 with the dense bool mask there in float16), one NVRTC compile per
# kernel variant.
_RUNS = [
    (case, dtype, variant, 64)
    for case in _CASES
    for dtype, variant in (("float16", "v2"), ("float16", "v1"), ("float32", "v1"),
                           ("float64", "v1"), ("float32", "v3"))
] + [(case, "float16", "v2", 128) for case in ("document", "window_global")] + [
    (case, "float32", "v3", 128) for case in ("document", "window_global")
]  # fmt: skip


@_PRED
@pytest.mark.parametrize("case,dtype,variant,E", _RUNS)
def test_block_mask_matches_numpy(case, dtype, variant, E, launched, monkeypatch,
                                  predicate) -> None:  # fmt: skip
    """The fused forward with a block mask (block size 128: every kernel's tiles) against
    NumPy's composed path in float64 on the same (rounded) inputs; the built-in mask_mod
    evaluated in the kernel, or its bits (``predicate``)."""
    _set_predicate(monkeypatch, predicate)
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", variant)
    B, Hq, Hkv, L, S, extra = _CASES[case]
    rng = np.random.default_rng(abs(hash((case, E))) % 2**32)
    npdt = getattr(np, dtype)
    q, k, v = (
        rng.standard_normal(shape).astype(npdt)
        for shape in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E))
    )
    opts: dict = dict(enable_gqa=Hq != Hkv, return_lse=True)
    if extra.get("bool_mask"):
        opts["attn_mask"] = rng.random((L, S)) < 0.9
    if extra.get("sinks"):
        opts["sinks"] = rng.standard_normal(Hq)
    for name in ("q_lengths", "kv_lengths"):
        if name in extra:
            opts[name] = np.asarray(extra[name], dtype=np.int32)

    bm_np = flex.create_block_mask(_mask_mod(case, np, 7, B, L), B, None, L, S)
    ref, ref_lse = aa.scaled_dot_product_attention(
        *(x.astype(np.float64) for x in (q, k, v)), block_mask=bm_np,
        implementation="composed", **opts,
    )  # fmt: skip
    bm = flex.create_block_mask(_mask_mod(case, cp, 7, B, L), B, None, L, S, xp=cp)
    d_opts = {n: cp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in opts.items()}
    spec = make_spec(
        *(cp.asarray(x) for x in (q, k, v)), d_opts.get("attn_mask"), 0.0, False, None,
        Hq != Hkv, "top_left", None, None, None, block_mask=bm,
        **{n: d_opts[n] for n in ("q_lengths", "kv_lengths", "sinks") if n in d_opts},
    )  # fmt: skip
    assert auto_choice(spec) == "fused", fused.declines(spec)
    out, lse = aa.scaled_dot_product_attention(
        *(cp.asarray(x) for x in (q, k, v)), block_mask=bm, **d_opts
    )
    assert launched and all(
        n.startswith("aa_fwd_") and (", 4" in n or ", 5" in n) for n in launched
    ), launched
    if variant == "v2" and (E == 64 or "attn_mask" not in opts):  # (v2: dense masks at 64)
        assert all(n.startswith("aa_fwd_tc2<") for n in launched), launched
    if variant == "v3":  # float32 on tensor cores, every mask kind
        assert all(n.startswith("aa_fwd_tf32<") for n in launched), launched
    tables = [key for key in bm._tables if key[0] == "cuda_flex_table"]
    assert len(tables) == 1  # the table was built once, on this device
    _check_path(predicate, launched)
    out_np = cp.asnumpy(out).astype(np.float64)
    lse_np = cp.asnumpy(lse).astype(np.float64)
    assert not np.isnan(out_np).any() and not np.isnan(lse_np).any()
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse_np), fin)
    assert (out_np[~fin] == 0).all()
    assert _rel(out_np, ref) <= _TOL[dtype], _rel(out_np, ref)
    err = np.max(np.abs(lse_np[fin] - ref_lse[fin]) / np.maximum(1, np.abs(ref_lse[fin])))
    assert err <= _LSE_TOL[dtype], err


def test_auto_takes_the_fused_path(launched) -> None:
    q = cp.ones((1, 2, 256, 64), dtype=cp.float16)
    bm = flex.create_block_mask(flex.causal_mask, None, None, 256, 256, xp=cp)
    spec = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None,
                     block_mask=bm)  # fmt: skip
    assert auto_choice(spec) == "fused"
    # built-in mask_mods get a block mask from make_spec, so they run in the kernel too
    spec2 = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None,
                      mask_mod=flex.causal_mask)  # fmt: skip
    assert auto_choice(spec2) == "fused"
    out = aa.scaled_dot_product_attention(q, q, q, block_mask=bm)
    assert launched and ", 4" in launched[-1]
    ref = aa.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert float(cp.max(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)))) < 2e-3
    # score_mod stays on the array-API path
    spec3 = make_spec(q, q, q, None, 0.0, False, None, False, "top_left", None, None, None,
                      block_mask=bm, score_mod=flex.softcap_score_mod(5.0))  # fmt: skip
    assert auto_choice(spec3) != "fused"
    # decode-shaped calls run the prefill kernel with the block mask
    qd = cp.ones((1, 2, 4, 64), dtype=cp.float16)
    kd = cp.ones((1, 2, 2000, 64), dtype=cp.float16)
    bmd = flex.create_block_mask(flex.causal(1996), None, None, 4, 2000, xp=cp)
    aa.scaled_dot_product_attention(qd, kd, kd, block_mask=bmd)
    assert launched[-1].startswith("aa_fwd_tc")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_vjp_fused_forward_array_api_backward(dtype, launched, monkeypatch) -> None:
    """vjp with a block mask, the backward kernels opted out: the fused forward kernel
    (spy), the array-API backward from its LSE (the backward kernels are never called),
    gradients against NumPy float64."""
    monkeypatch.setenv(kernels_backward.FLEX_ENV, "0")  # opted out of the backward kernels
    bwd_calls: list[int] = []
    real_bwd = kernels_backward.backward
    monkeypatch.setattr(
        kernels_backward, "backward", lambda *a: bwd_calls.append(1) or real_bwd(*a)
    )
    fwd_calls: list[int] = []
    real_fwd = fused.FusedAttention.forward
    monkeypatch.setattr(
        fused.FusedAttention, "forward",
        lambda self, *a, **k: fwd_calls.append(1) or real_fwd(self, *a, **k),
    )  # fmt: skip
    rng = np.random.default_rng(3)
    B, Hq, Hkv, L, E = 2, 4, 2, 400, 64
    ids = _doc_ids(rng, B, L, 4)
    q, k, v, g = (rng.standard_normal(s) for s in
                  ((B, Hq, L, E), (B, Hkv, L, E), (B, Hkv, L, E), (B, Hq, L, E)))  # fmt: skip

    def run(xp, dt, conv):
        bm = flex.create_block_mask(flex.document_mask(conv(ids), causal=True), B, None, L, L,
                                    xp=xp)  # fmt: skip
        arrs = [conv(x).astype(dt) for x in (q, k, v)]
        out, pb = aa.vjp(aa.scaled_dot_product_attention, *arrs, enable_gqa=True,
                         block_mask=bm)  # fmt: skip
        return (out, *pb(conv(g).astype(dt))[:3])

    want = run(np, np.float64, lambda x: x)
    got = run(cp, getattr(cp, dtype), cp.asarray)
    assert fwd_calls and not bwd_calls
    assert launched and all(", 4" in n for n in launched), launched
    tol = 1e-5 if dtype == "float32" else 3e-3
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = _rel(cp.asnumpy(a.astype(cp.float64)), b)
        assert err <= (tol if name == "out" else 4 * tol), (name, err)


# (case, dtype, deterministic, ARRAYATTN_BWD_VARIANT, head dim): v2 (float16 at D = 64),
# the CUDA-core kernels (float32), v4 (aa_bwd_dkdv_mma4 FLEX, float16 at D = 64 and 128:
# every case, both dQ modes; bfloat16 runs on the CPU emulator), the atomic and the
# deterministic dQ.
_BWD_RUNS = [
    ("document", "float16", False, "v2", 64),
    ("document", "float16", True, "v2", 64),
    ("prefix_lm", "float32", False, "v2", 64),
    ("window_global", "float16", True, "v2", 64),
    ("window_global", "float32", True, "v2", 64),
    ("document", "float16", False, "v4", 64),
    ("document", "float16", True, "v4", 128),
    ("prefix_lm", "float16", False, "v4", 128),
    ("prefix_lm", "float16", True, "v4", 64),
    ("window_global", "float16", True, "v4", 64),
    ("window_global", "float16", False, "v4", 128),
]
_GRAD_TOL = {"float16": 2e-2, "float32": 4e-5}  # (the emulated tests' bounds)


@_PRED
@pytest.mark.parametrize("case,dtype,deterministic,variant,E", _BWD_RUNS)
def test_backward_kernels_with_block_masks(case, dtype, deterministic, variant, E, launched,
                                           monkeypatch, predicate) -> None:  # fmt: skip
    """By default (ARRAYATTN_FLEX_BWD_KERNELS unset) vjp with a block mask runs the
    backward kernels' FLEX instantiations (spy: the dK/dV kernel, and the dQ kernel in
    deterministic mode, with the last template argument ``true``; v4's dK/dV kernel beside
    v2's dQ under ARRAYATTN_BWD_VARIANT=v4, v2's under v2); out, dq, dk, dv against NumPy
    float64 (the composed path on the same rounded inputs)."""
    monkeypatch.delenv(kernels_backward.FLEX_ENV, raising=False)
    _set_predicate(monkeypatch, predicate)
    monkeypatch.setenv("ARRAYATTN_BWD_VARIANT", variant)
    B, Hq, Hkv, L, S, extra = _CASES[case]
    rng = np.random.default_rng(abs(hash((case, dtype, E))) % 2**32)
    npdt = getattr(np, dtype)
    q, k, v = (
        rng.standard_normal(shape).astype(npdt).astype(np.float64)
        for shape in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E))
    )
    g = rng.standard_normal((B, Hq, L, E))
    opts: dict = dict(enable_gqa=Hq != Hkv)
    if extra.get("bool_mask"):
        opts["attn_mask"] = rng.random((L, S)) < 0.9
    if extra.get("sinks"):
        opts["sinks"] = rng.standard_normal(Hq)
    for name in ("q_lengths", "kv_lengths"):
        if name in extra:
            opts[name] = np.asarray(extra[name], dtype=np.int32)

    def run(xp, dt, conv):
        bm = flex.create_block_mask(_mask_mod(case, xp, 7, B, L), B, None, L, S, xp=xp)
        kw = {n: conv(a) if isinstance(a, np.ndarray) else a for n, a in opts.items()}
        arrs = [conv(x).astype(dt) for x in (q, k, v)]
        out, pb = aa.vjp(aa.scaled_dot_product_attention, *arrs, block_mask=bm, **kw)
        return (out, *pb(conv(g).astype(dt))[:3])

    want = run(np, np.float64, lambda x: x)
    with kernels_backward.deterministic(deterministic):
        got = run(cp, getattr(cp, dtype), cp.asarray)
    dkdv = [n for n in launched if n.startswith("aa_bwd_dkdv_")]
    dq = [n for n in launched if n.startswith("aa_bwd_dq_")]
    assert dkdv and all(n.endswith(", true>") for n in dkdv), launched
    assert bool(dq) == deterministic and all(n.endswith(", true>") for n in dq), launched
    if dtype == "float32":
        assert all("simt<" in n for n in dkdv + dq), launched
    else:  # v4: its own dK/dV kernel, v2's deterministic dQ
        assert all(("mma4<" if variant == "v4" else "mma2<") in n for n in dkdv), launched
        assert all("mma2<" in n for n in dq), launched
    _check_path(predicate, launched)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        a_np = cp.asnumpy(a.astype(cp.float64))
        assert np.isfinite(a_np).all(), name
        err = _rel(a_np, b)
        assert err <= (_TOL[dtype] if name == "out" else _GRAD_TOL[dtype]), (name, err)


@pytest.mark.parametrize("E", [64, 128])
def test_backward_v4_block_mask_is_v2_bits_deterministic(E, launched, monkeypatch) -> None:
    """Deterministic mode: v4's FLEX dK/dV kernel (beside v2's FLEX dQ kernel) gives v2
    FLEX's very bits (same steps in the same order, same sums), on the document case."""
    monkeypatch.delenv(kernels_backward.FLEX_ENV, raising=False)
    B, Hq, Hkv, L, S, _ = _CASES["document"]
    rng = np.random.default_rng(E)
    q, k, v, g = (
        cp.asarray(rng.standard_normal(shape), dtype=cp.float16)
        for shape in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E), (B, Hq, L, E))
    )
    bm = flex.create_block_mask(_mask_mod("document", cp, 7, B, L), B, None, L, S, xp=cp)
    grads = {}
    for variant in ("v2", "v4"):
        monkeypatch.setenv("ARRAYATTN_BWD_VARIANT", variant)
        with kernels_backward.deterministic(True):
            _, pb = aa.vjp(aa.scaled_dot_product_attention, q, k, v, enable_gqa=True,
                           block_mask=bm)  # fmt: skip
            grads[variant] = [cp.asnumpy(x) for x in pb(g)[:3]]
    assert any("mma4<" in n and n.endswith(", true>") for n in launched), launched
    for name, a, b in zip(("dq", "dk", "dv"), grads["v4"], grads["v2"], strict=True):
        assert np.array_equal(a, b), name


def test_timing_block_mask_vs_dense_mask_packed_documents() -> None:
    """Not asserted: float16, B = 1, H = 16, D = 128, L = 16384 packed with 8 documents
    (causal within each): the block mask call against the same mask as a dense bool
    ``attn_mask`` and against plain causal (the lower bound of the work)."""
    rng = np.random.default_rng(0)
    B, H, L, E = 1, 16, 16384, 128
    ids = _doc_ids(rng, B, L, 8)
    q, k, v = (cp.asarray(rng.standard_normal((B, H, L, E)), dtype=cp.float16) for _ in range(3))
    ids_d = cp.asarray(ids)
    t0 = cp.cuda.Event()
    t1 = cp.cuda.Event()
    t0.record()
    bm = flex.create_block_mask(flex.document_mask(ids_d, causal=True), B, None, L, L, xp=cp)
    t1.record()
    t1.synchronize()
    t_create = cp.cuda.get_elapsed_time(t0, t1)
    i = cp.arange(L)
    dense = (ids_d[0][:, None] == ids_d[0][None, :]) & (i[None, :] <= i[:, None])

    def timed(fn, reps=5) -> float:
        fn()
        cp.cuda.Device().synchronize()
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        t1.synchronize()
        return cp.cuda.get_elapsed_time(t0, t1) / reps

    t_first = timed(lambda: aa.scaled_dot_product_attention(q, k, v, block_mask=bm), reps=1)
    t_block = timed(lambda: aa.scaled_dot_product_attention(q, k, v, block_mask=bm))
    t_dense = timed(lambda: aa.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    t_causal = timed(lambda: aa.scaled_dot_product_attention(q, k, v, is_causal=True))
    out_b = aa.scaled_dot_product_attention(q, k, v, block_mask=bm)
    out_d = aa.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    err = float(cp.linalg.norm((out_b - out_d).astype(cp.float32)) / cp.linalg.norm(
        out_d.astype(cp.float32)))  # fmt: skip
    print(
        f"\npacked 8 documents, float16 B=1 H=16 L=16384 D=128 on "
        f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: "
        f"create_block_mask {t_create:.2f} ms (sparsity {bm.sparsity():.1f}%); "
        f"block mask {t_block:.2f} ms (first call with the table build {t_first:.2f} ms); "
        f"dense bool mask {t_dense:.2f} ms; plain causal {t_causal:.2f} ms; "
        f"block vs dense rel. diff {err:.1e}"
    )
    assert err < 5e-3
