"""The CUDA kernel path of ``PagedKVCache.attend`` (the split-KV decode kernels of
``arrayattn/attention/cuda/decode_attn.cu``): their own source under the host emulator, launched
with the arguments the CuPy path builds (``attend_with_kernel``), against the array-API
paged loop on NumPy; on a GPU (CuPy) the kernel path equals the generic one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention.cuda import decode
from arrayattn.nn import PagedKVCache
from arrayattn.nn._paged_kernel import attend_with_kernel, kernel_supports

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the emulator
emu = pytest.importorskip("_backward_emu")

CASES = [
    dict(causal=True),
    dict(causal=True, window=(2, 0), softcap=1.5),
    dict(causal=False, sinks=True, alibi="per-head", window=(3, 1)),
    dict(causal=True, sinks=True, alibi="per-batch", softcap=2.0),
]
B, HQ, HKV, D, DV, P = 3, 4, 2, 16, 24, 3


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if emu.compiler() is None or emu.cuda_include() is None:
        pytest.skip("needs g++ (C++20) and the CUDA headers for the host emulator")
    names = set()
    for kind in ("float16", "float32", "float64"):
        for variant in decode.VARIANTS:
            plan = decode.decode_plan(kind, D, DV, HQ // HKV * 3, variant=variant)
            names |= {plan.split, plan.merge}
    return emu.build(sorted(names), tmp_path_factory.mktemp("paged"), kernel_file=decode.SOURCE)


def _filled_cache(rng, dt):
    cache = PagedKVCache(batch_size=B, num_pages=12, page_size=P, num_kv_heads=HKV,
                         head_dim=D, value_dim=DV, xp=np, dtype=dt)  # fmt: skip
    rng.shuffle(cache.free_pages)
    k = rng.standard_normal((B, HKV, 8, D)).astype(dt)
    v = rng.standard_normal((B, HKV, 8, DV)).astype(dt)
    cache.append(k[:, :, :5], v[:, :, :5], [5, 2, 0])
    cache.append(k[:, :, 5:], v[:, :, 5:], [3, 1, 1])
    cache.free(2)  # an empty sequence
    return cache


@pytest.mark.parametrize("variant", decode.VARIANTS)  # ARRAYATTN_DECODE_VARIANT
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_equal_the_paged_loop(library, dtype, case, variant, monkeypatch):
    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", variant)  # read by attend_with_kernel's plan
    opts = CASES[case]
    rng = np.random.default_rng(case)
    dt = np.dtype(dtype)
    cache = _filled_cache(rng, dt)
    q = rng.standard_normal((B, HQ, 3, D)).astype(dt)
    nq = [3, 2, 0]
    kw = dict(
        scale=0.45,
        causal=opts["causal"],
        window=opts.get("window"),
        softcap=opts.get("softcap"),
        sinks=rng.standard_normal(HQ).astype(dt) if opts.get("sinks") else None,
        alibi_slopes={
            None: None,
            "per-head": np.array([0.5, 0.25, 0.125, 0.0625], dt),
            "per-batch": rng.uniform(0, 1, (B, HQ)).astype(dt),
        }[opts.get("alibi")],
    )
    assert kernel_supports(dtype, dtype, D, DV, None)
    want = cache.attend(q, nq, **kw)  # NumPy: the array-API paged loop
    launcher = emu.Launcher(library)
    got = attend_with_kernel(cache, q, nq, launch=launcher, alloc=emu.PoisonXp, **kw)
    assert all(("_v2<" in name) == (variant == "v2") for name, *_ in launcher.launches)
    assert got.dtype == dt and got.shape == (B, HQ, 3, DV)
    tol = {"float16": dict(rtol=4e-3, atol=4e-3), "float32": dict(rtol=1e-5, atol=1e-6),
           "float64": dict(rtol=1e-12, atol=1e-13)}[dtype]  # fmt: skip
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tol)
    assert not np.any(got[2]) and not np.any(got[1, :, 2:])  # padded query rows are 0


def test_kernel_supports():
    assert not kernel_supports("float32", "float32", D, DV, np.ones((1, 1), bool))  # a mask
    assert not kernel_supports("float16", "float32", D, DV, None)  # query not the cache's
    assert not kernel_supports("float32", "float32", 12, DV, None)  # not a multiple of 8
    assert not kernel_supports("int8", "int8", D, DV, None)


@pytest.mark.parametrize("variant", decode.VARIANTS)  # ARRAYATTN_DECODE_VARIANT
def test_cupy_kernel_path_equals_the_generic_loop(variant, monkeypatch):
    monkeypatch.setenv("ARRAYATTN_DECODE_VARIANT", variant)
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001  (no driver)
        pytest.skip(f"no CUDA device: {exc}")
    import array_api_compat.cupy as xp

    rng = np.random.default_rng(7)
    for dtype, tol in ((xp.float32, 1e-5), (xp.float16, 4e-3)):
        cache = PagedKVCache(
            batch_size=2,
            num_pages=8,
            page_size=4,
            num_kv_heads=2,
            head_dim=64,
            xp=xp,
            dtype=dtype,
        )
        rng.shuffle(cache.free_pages)
        kv = xp.asarray(rng.standard_normal((2, 2, 9, 64)).astype(np.float32)).astype(dtype)
        cache.append(kv, kv, [9, 4])
        q = xp.asarray(rng.standard_normal((2, 8, 1, 64)).astype(np.float32)).astype(dtype)
        sinks = xp.asarray(rng.standard_normal(8).astype(np.float32)).astype(dtype)
        kernel = cache.attend(q, [1, 1], causal=True, sinks=sinks, window=(5, 0))
        cache.use_kernel = False
        generic = cache.attend(q, [1, 1], causal=True, sinks=sinks, window=(5, 0))
        np.testing.assert_allclose(
            kernel.get().astype(np.float64), generic.get().astype(np.float64), rtol=tol, atol=tol
        )
