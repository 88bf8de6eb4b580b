"""``arrayattn.attention.cuda.backward.backward`` end to end on the CPU: the glue around the
kernels (layouts, broadcast leading dims and heads, GQA, lengths, options, reductions
back to the arguments' shapes) with the kernels run by the host emulator and "cupy"
played by NumPy. Compared with the composed backward through ``arrayattn.vjp``.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.attention.cuda import backward as bwd
from arrayattn.attention.spec import make_spec

emu = pytest.importorskip("_backward_emu")

pytestmark = pytest.mark.skipif(
    emu.compiler() is None or emu.cuda_include() is None,
    reason="needs g++ (C++20) and the CUDA headers (cuda_fp16.h) for the host emulator",
)


def _fake_cupy() -> types.ModuleType:
    """The few CuPy functions the glue calls, backed by NumPy (empty -> NaN-filled)."""
    m = types.ModuleType("cupy")
    m.ndarray = type("NotACupyArray", (), {})
    for name in ("broadcast_to", "ascontiguousarray", "zeros", "zeros_like", "asarray", "full"):
        setattr(m, name, getattr(np, name))
    m.float16, m.float32, m.float64, m.int32 = np.float16, np.float32, np.float64, np.int32
    m.bool_, m.uint8 = np.bool_, np.uint8
    m.empty = emu.PoisonXp.empty
    m.int16, m.dtype, m.from_dlpack = np.int16, np.dtype, np.from_dlpack  # the bridge's
    device = types.SimpleNamespace(id=0, compute_capability="90")
    m.cuda = types.SimpleNamespace(
        Device=lambda i=0: device, runtime=types.SimpleNamespace(getDevice=lambda: 0)
    )
    return m


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    names = []
    for kind in ("float64", "float32", "float16"):
        for d in (32, 64):
            plan = bwd.backward_plan(kind, d, d)
            names += [n for n in (plan.preprocess, plan.dkdv, plan.dq, plan.convert) if n]
    return emu.build(sorted(set(names)), tmp_path_factory.mktemp("bwd_glue"))


@pytest.fixture
def kernels_on_host(library, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(bwd, "declines", lambda spec: None)
    launcher = emu.Launcher(library)
    monkeypatch.setattr(bwd, "_cupy_launch", launcher)
    return launcher


CASES = {
    # name: (q shape, k shape, v shape, options)
    "gqa_causal": ((2, 4, 19, 16), (2, 2, 23, 16), (2, 2, 23, 8), dict(is_causal=True)),
    "kv_broadcast_batch": ((3, 2, 17, 16), (1, 2, 21, 16), (1, 2, 21, 16), dict()),
    "mqa_bottom_right": (
        (2, 3, 9, 24),
        (2, 1, 30, 24),
        (2, 1, 30, 24),
        dict(is_causal=True, causal_align="bottom_right"),
    ),
    "unbatched_query_heads_1": ((1, 13, 16), (3, 13, 16), (3, 13, 16), dict(enable_gqa=False)),
    "lengths_window_softcap": (
        (2, 2, 20, 16),
        (2, 2, 25, 16),
        (2, 2, 25, 16),
        dict(window=(4, 2), softcap=5.0, lengths=True),
    ),
    "dropout_dlse": ((1, 2, 18, 16), (1, 2, 18, 16), (1, 2, 18, 16), dict(dropout_p=0.3, seed=3)),
    # boolean attn_mask (L, S) broadcast over batch and heads, with causal on top
    "bool_mask": ((2, 2, 19, 16), (2, 1, 21, 16), (2, 1, 21, 16), dict(mask=(19, 21))),
    # boolean attn_mask per batch and head (batch, heads, L, S)
    "bool_mask_full": ((2, 2, 9, 16), (2, 2, 13, 16), (2, 2, 13, 16), dict(mask=(2, 2, 9, 13))),
    # sinks (Hq,) through the saved LSE and per-batch ALiBi slopes (B, Hq), GQA, lengths
    "sinks_alibi": (
        (2, 4, 19, 16),
        (2, 2, 23, 16),
        (2, 2, 23, 16),
        dict(is_causal=True, causal_align="bottom_right", lengths=True, sinks=True),
    ),
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["float64", "float32", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_glue_matches_composed(kernels_on_host, case, kind, deterministic):
    qs, ks, vs, opts = CASES[case]
    opts = dict(opts)
    opts.setdefault("enable_gqa", True)
    rng = np.random.default_rng(5)
    dt = np.dtype(kind)
    q, k, v = (rng.standard_normal(s).astype(dt) for s in (qs, ks, vs))
    attn_mask = None
    if "mask" in opts:
        attn_mask = rng.random(opts.pop("mask")) < 0.6
        opts["is_causal"] = case == "bool_mask"
    if opts.pop("lengths", False):
        opts["q_lengths"] = np.array([20, 7], dtype=np.int32)
        opts["kv_lengths"] = np.array([11, 25], dtype=np.int32)
    if opts.pop("sinks", False):
        opts["sinks"] = rng.standard_normal(qs[-3]).astype(dt)
        opts["alibi_slopes"] = rng.random((qs[0], qs[-3])).astype(dt)
    (out, lse), pullback = aa.vjp(
        aa.scaled_dot_product_attention,
        q,
        k,
        v,
        attn_mask,
        return_lse=True,
        implementation="composed",
        **opts,
    )
    d_out = rng.standard_normal(out.shape).astype(dt)
    d_lse = rng.standard_normal(lse.shape).astype(lse.dtype) if "dropout" in case else None
    want = pullback((d_out, d_lse))[:3]

    spec = make_spec(
        q,
        k,
        v,
        attn_mask,
        opts.get("dropout_p", 0.0),
        opts.get("is_causal", False),
        None,
        opts["enable_gqa"],
        opts.get("causal_align", "top_left"),
        opts.get("window"),
        opts.get("softcap"),
        opts.get("seed"),
        q_lengths=opts.get("q_lengths"),
        kv_lengths=opts.get("kv_lengths"),
        sinks=opts.get("sinks"),
        alibi_slopes=opts.get("alibi_slopes"),
    )
    got = bwd.backward(
        spec, q, k, v, attn_mask, out, lse, d_out, d_lse, deterministic=deterministic
    )
    assert got[3] is None
    assert any("_dq_" in n for n, *_ in kernels_on_host.launches) == deterministic
    tol = {"float64": 1e-11, "float32": 2e-5, "float16": 2e-2}[kind]
    for name, g, w, arg in zip(("dq", "dk", "dv"), got[:3], want, (q, k, v), strict=True):
        assert g.shape == arg.shape and g.dtype == arg.dtype, name
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30)
        assert err <= tol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("row0,col0", [(32, 0), (0, 32), (48, 16)])
def test_block_of_a_larger_call_keeps_its_diagonal(kernels_on_host, row0, col0):
    """A block task of the Dask path (a causal call's block whose diagonal is moved by
    ``row0 - col0``, with the whole row's LSE): the kernels take that diagonal (on the
    first GPU run, 2026-11-26, they assumed 0 and dQ was 78% off)."""
    import math

    from arrayattn.attention import composed as _composed
    from arrayattn.attention.dask.plan import _Block, _Call

    rows, d = 32, 32
    rng = np.random.default_rng(9)
    q, k, v, d_out = (rng.standard_normal((1, 2, rows, d)) for _ in range(4))
    call = _Call(dropout_p=0.0, scale=1.0 / math.sqrt(d), enable_gqa=False, window=(-1, 0),
                 softcap=None, seed=None, L=row0 + rows, S=col0 + rows, diagonal=0,
                 per_sequence_diagonal=False, offset_bounds=None)  # fmt: skip
    blk = _Block(call, batch_ids=(0,), head0=0, row0=row0, col0=col0, partial_keys=True)
    spec = blk.spec(q, k, v, None, None, None, None)
    out, lse = _composed.forward(spec, q, k, v, None)
    lse = lse + 0.7  # the whole row's LSE is larger than the block's: P sums below 1
    want = _composed.backward(spec, q, k, v, None, out, lse, d_out, None)[:3]
    got = bwd.backward(spec, q, k, v, None, out, lse, d_out, None)[:3]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_compute_capability_of_three_digits(monkeypatch):
    """CuPy reports compute capability as one string ("90", "100"): read as a number
    (it was split into characters, so "100" raised)."""
    from arrayattn.attention.cuda import fused

    spec = make_spec(*(np.zeros((1, 1, 4, 8), np.float16),) * 3, None, 0.0, False, None,
                     False, "top_left", None, None, None)  # fmt: skip
    for cc, declined in (("100", False), ("90", False), ("75", True)):
        device = types.SimpleNamespace(compute_capability=cc)
        fake = types.ModuleType("cupy")
        fake.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            Device=lambda i=0, device=device: device,
        )
        monkeypatch.setitem(sys.modules, "cupy", fake)
        monkeypatch.setattr(bwd, "is_cupy", lambda xp: True)
        monkeypatch.setattr(fused, "is_cupy", lambda xp: True)
        for reason in (bwd.declines(spec), fused.declines(spec)):
            assert (reason is not None and "compute capability" in reason) == declined, reason


def test_torch_bfloat16_backward_through_the_dlpack_bridge(kernels_on_host, monkeypatch, tmp_path):
    """PyTorch bfloat16 tensors through the bridge (``kernels/_bridge.py``): int16 storage
    into the backward kernels, bfloat16 gradients back. CPU tensors play CUDA ones."""
    torch = pytest.importorskip("torch")
    import array_api_compat

    from arrayattn._backend import CupyBridge
    from arrayattn.attention import composed as _composed
    from arrayattn.attention.cuda import _bridge, fused

    plan = bwd.backward_plan("bfloat16", 32, 32)
    names = [n for n in (plan.preprocess, plan.dkdv, plan.dq, plan.convert) if n]
    lib = emu.build(names, tmp_path)
    monkeypatch.setattr(bwd, "_cupy_launch", emu.Launcher(lib))
    fake_cxp = types.ModuleType("array_api_compat.cupy")  # is_cupy_namespace: by name
    monkeypatch.setitem(sys.modules, "array_api_compat.cupy", fake_cxp)
    monkeypatch.setattr(
        _bridge, "cupy_bridge",
        lambda xp, device, *a: CupyBridge("torch") if array_api_compat.is_torch_namespace(xp)
        else None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 19, 32, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 2, 23, 32, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 23, 32, generator=g).to(torch.bfloat16)
    d_out = torch.randn(2, 4, 19, 32, generator=g).to(torch.bfloat16)
    spec = make_spec(q, k, v, None, 0.0, True, None, True, "bottom_right", None, None, None)
    spec32 = make_spec(q.float(), k.float(), v.float(), None, 0.0, True, None, True,
                       "bottom_right", None, None, None)  # fmt: skip
    f32 = [x.float() for x in (q, k, v)]
    out32, lse = _composed.forward(spec32, *f32, None)
    want = _composed.backward(spec32, *f32, None, out32, lse, d_out.float(), None)[:3]
    got = fused.FUSED.backward(spec, q, k, v, None, out32.to(torch.bfloat16), lse, d_out, None)
    for name, a, w in zip(("dq", "dk", "dv"), got[:3], want, strict=True):
        assert isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16, name
        err = float((a.float() - w).norm() / w.norm())
        assert err <= 3e-2, (name, err)
