"""The CUDA kernel of ``PagedKVCache.attend`` (``arrayattn/kernels/paged_attn.cu``): its own
source compiled for the CPU with g++ and launched with the arguments the CuPy path builds
(``kernel_arguments``), against the array-API paged loop on NumPy; nvcc compiles every
instantiation without spills; on a GPU (CuPy) the kernel path equals the generic one."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from arrayattn.nn import PagedKVCache
from arrayattn.nn._paged_kernel import DIMS, KERNEL_FILE, kernel_arguments, kernel_name

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "arrayattn" / "kernels"


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    lib = tmp_path_factory.mktemp("paged") / "paged_host.so"
    cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(KERNELS)]
    cmd += ["-x", "c++", str(Path(__file__).with_name("paged_kernel_host.cpp")), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def run_host(lib, args, rows, block=32):
    c_args = []
    for a in args:
        if isinstance(a, np.ndarray):
            assert a.flags.c_contiguous
            c_args.append(ctypes.c_void_p(a.ctypes.data))
        elif isinstance(a, np.int32):
            c_args.append(ctypes.c_int(int(a)))
        elif isinstance(a, np.float32):
            c_args.append(ctypes.c_float(float(a)))
        else:
            c_args.append(ctypes.c_double(float(a)))
    fn = lib.aa_paged_attn_f32 if args[0].dtype == np.float32 else lib.aa_paged_attn_f64
    fn(*c_args, ctypes.c_int(-(-rows // block)), ctypes.c_int(block))


CASES = [
    dict(causal=True),
    dict(causal=True, window=(2, 0), softcap=1.5),
    dict(causal=False, sinks=True, alibi="per-head", window=(3, 1)),
    dict(causal=True, sinks=True, alibi="per-batch", softcap=2.0),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_host_kernel_equals_the_paged_loop(host_kernel, dtype, case):
    opts = CASES[case]
    rng = np.random.default_rng(case)
    B, Hq, Hkv, D, Dv, P = 3, 4, 2, 5, 3, 3
    dt = np.dtype(dtype)
    cache = PagedKVCache(
        batch_size=B,
        num_pages=10,
        page_size=P,
        num_kv_heads=Hkv,
        head_dim=D,
        value_dim=Dv,
        xp=np,
        dtype=dt,
    )
    rng.shuffle(cache.free_pages)
    k = rng.standard_normal((B, Hkv, 8, D)).astype(dt)
    v = rng.standard_normal((B, Hkv, 8, Dv)).astype(dt)
    cache.append(k[:, :, :5], v[:, :, :5], [5, 2, 0])
    cache.append(k[:, :, 5:], v[:, :, 5:], [3, 1, 1])
    cache.free(2)  # an empty sequence
    q = rng.standard_normal((B, Hq, 3, D)).astype(dt)
    nq = [3, 2, 0]
    kw = dict(
        scale=0.45,
        causal=opts["causal"],
        window=opts.get("window"),
        softcap=opts.get("softcap"),
        sinks=rng.standard_normal(Hq).astype(dt) if opts.get("sinks") else None,
        alibi_slopes={
            None: None,
            "per-head": np.array([0.5, 0.25, 0.125, 0.0625], dt),
            "per-batch": rng.uniform(0, 1, (B, Hq)).astype(dt),
        }[opts.get("alibi")],
    )
    want = cache.attend(q, nq, **kw)
    args, out, rows = kernel_arguments(cache, q, nq, **kw)
    run_host(host_kernel, args, rows)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(out, want, **tol)
    assert not np.any(out[2]) and not np.any(out[1, :, 2:])  # padded query rows are 0


def test_every_instantiation_compiles_with_nvcc_without_spills(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    names = [kernel_name(t, d, dv) for t in ("float32", "float64") for d in DIMS for dv in DIMS]
    src = tmp_path / "inst.cu"
    text = f'#include "{KERNELS / KERNEL_FILE}"\n'
    for i, name in enumerate(names):  # taking each address instantiates it
        text += f"auto* aa_inst_{i} = &{name};\n"
    src.write_text(text)
    cmd = ["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd + [str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("0 bytes spill stores") == len(names), res.stderr


def test_cupy_kernel_path_equals_the_generic_loop():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001  (no driver)
        pytest.skip(f"no CUDA device: {exc}")
    import array_api_compat.cupy as xp

    rng = np.random.default_rng(7)
    cache = PagedKVCache(
        batch_size=2,
        num_pages=8,
        page_size=4,
        num_kv_heads=2,
        head_dim=64,
        xp=xp,
        dtype=xp.float32,
    )
    rng.shuffle(cache.free_pages)
    kv = xp.asarray(rng.standard_normal((2, 2, 9, 64)).astype(np.float32))
    cache.append(kv, kv, [9, 4])
    q = xp.asarray(rng.standard_normal((2, 8, 1, 64)).astype(np.float32))
    sinks = xp.asarray(rng.standard_normal(8).astype(np.float32))
    kernel = cache.attend(q, [1, 1], causal=True, sinks=sinks, window=(5, 0))
    cache.use_kernel = False
    generic = cache.attend(q, [1, 1], causal=True, sinks=sinks, window=(5, 0))
    np.testing.assert_allclose(kernel.get(), generic.get(), rtol=1e-5, atol=1e-6)


def test_every_instantiation_compiles_under_nvrtc():
    """CuPy compiles with NVRTC, stricter than nvcc; the same lookup as
    tests/kernels/test_nvrtc.py finds libnvrtc."""
    from _nvrtc import find_nvrtc, lowered_names

    lib = find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found")
    names = [kernel_name(t, d, dv) for t in ("float32", "float64") for d in DIMS for dv in DIMS]
    lowered_names(lib, KERNEL_FILE, names)
