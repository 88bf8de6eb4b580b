"""The fused implementation's Python side (fused.py, _loader.py), end to end on the CPU.

A stand-in ``cupy`` module backed by NumPy replaces CuPy; its kernels record each launch
(grid, block, shared memory, every argument with its type and the memory behind every
pointer) and replay it through the host emulator of the real ``attn_fwd.cu``
(``forward_emulator_launch.cpp``), which also checks the argument list against the
kernel's C++ signature. So this covers argument order and widths, strides of
transposed and broadcast inputs, head-dim padding, GQA, masks, lengths, dropout seeds,
the output shapes and dtypes, against the composed reference path on the same spec.
Not covered: CuPy and NVRTC themselves (GPU tests).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import sys
import types
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention import composed as _composed
from arrayattn.attention.cuda import _loader, fused
from arrayattn.attention.spec import make_spec

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
_EXES: dict[str, Path] = {}
PRELUDES: list[str] = []
"""The preludes of the modules the fake CuPy compiled (the tests check which path ran)."""


def _cfg(name: str) -> str:
    m2 = re.match(r"aa_fwd_tc2<\s*\d+\s*,\s*(\d+)", name)  # v2: AaTc2Cfg<D>
    if m2:
        return f"AaTc2Cfg<{m2.group(1)}>"
    m3 = re.match(r"aa_fwd_tf32<\s*(\d+)", name)  # v3 float32: AaTf32Cfg<D>
    if m3:
        return f"AaTf32Cfg<{m3.group(1)}>"
    m = re.match(r"aa_fwd_(tc|simt)<\s*(\w+)\s*,\s*(\d+)\s*,\s*(\w+)", name)
    assert m, name
    kind, t, d, mt = m.groups()
    return f"AaTcCfg<{d}, {mt}>" if kind == "tc" else f"AaSimtCfg<{t}, {d}>"


def prelude_args(prelude: str, work: Path) -> list[str]:
    """g++ arguments putting ``prelude`` (a block-mask predicate, ``flex_pred.py``) in
    front of the kernel source, as the loader does for NVRTC."""
    if not prelude:
        return []
    path = work / f"prelude_{hashlib.sha256(prelude.encode()).hexdigest()[:16]}.h"
    path.write_text(prelude)
    return ["-include", str(path)]


def _exe(name: str, work: Path, prelude: str = "") -> Path:
    key = name + "\n" + prelude
    if key not in _EXES:
        exe = work / f"launch_{len(_EXES)}"
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-I", str(HERE), "-I",
               str(resources.files("arrayattn.attention.cuda")), f"-DAA_KERNEL={name}",
               f"-DAA_CFG={_cfg(name)}", *prelude_args(prelude, work),
               str(HERE / "forward_emulator_launch.cpp"), "-o", str(exe)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        _EXES[key] = exe
    return _EXES[key]


def _extent(a: np.ndarray) -> tuple[int, int]:
    """Byte range [lo, hi) an array's elements occupy (strides may be 0 or negative)."""
    ptr = a.__array_interface__["data"][0]
    if a.size == 0:
        return ptr, ptr
    lo = hi = ptr
    for n, st in zip(a.shape, a.strides, strict=True):
        lo += min(0, st * (n - 1))
        hi += max(0, st * (n - 1))
    return lo, hi + a.itemsize


_TAGS = {np.int64: "q", np.int32: "i", np.uint32: "I", np.float32: "f", np.float64: "d"}


class _FakeKernel:
    def __init__(self, name: str, work: Path, prelude: str = "") -> None:
        self.name = name
        self.work = work
        self.prelude = prelude
        self.max_dynamic_shared_size_bytes = 0
        self.launches = 0

    def __call__(self, grid, block, args, shared_mem=0):
        exe = _exe(self.name, self.work, self.prelude)
        ranges = []
        records = []
        for a in args:
            if isinstance(a, np.ndarray):
                lo, hi = _extent(a)
                ranges.append((lo, hi))
                ptr = a.__array_interface__["data"][0]
                records.append((b"p", len(ranges) - 1, ptr - lo))
            elif isinstance(a, np.uint64):
                assert int(a) == 0, "a uint64 argument stands for a null pointer only"
                records.append((b"n", 0, 0))
            elif type(a) in _TAGS:
                tag = _TAGS[type(a)]
                if tag in "fd":
                    bits = np.array([float(a)], dtype=np.float64).view(np.int64)[0]
                    records.append((tag.encode(), 0, int(bits)))
                else:
                    records.append((tag.encode(), int(a), 0))
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}: pass numpy scalars")
        assert shared_mem <= 48 * 1024 or self.max_dynamic_shared_size_bytes >= shared_mem
        path_in, path_out = self.work / "launch.bin", self.work / "launch.out"
        with open(path_in, "wb") as f:
            gx, gy, gz = (tuple(grid) + (1, 1))[:3]
            head = [gx, gy, gz, int(np.prod(block)), shared_mem, len(ranges)]
            f.write(np.array(head, dtype=np.int64).tobytes())
            for lo, hi in ranges:
                f.write(np.int64(hi - lo).tobytes())
                f.write(ctypes.string_at(lo, hi - lo))
            f.write(np.int64(len(records)).tobytes())
            for tag, v0, v1 in records:
                f.write(tag)
                f.write(np.array([v0, v1], dtype=np.int64).tobytes())
        res = subprocess.run([str(exe), str(path_in), str(path_out)], capture_output=True,
                             text=True, timeout=900)  # fmt: skip
        assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
        data = path_out.read_bytes()
        pos = 0
        for lo, hi in ranges:
            ctypes.memmove(lo, data[pos : pos + hi - lo], hi - lo)
            pos += hi - lo
        self.launches += 1


def _fake_cupy(work: Path) -> types.ModuleType:
    cp = types.ModuleType("cupy")
    for name in (
        "zeros",
        "empty",
        "full",
        "concatenate",
        "ascontiguousarray",
        "broadcast_to",
        "asarray",
        "bool_",
        "uint8",
        "int32",
        "float16",
        "float32",
        "float64",
        "int16",
        "dtype",
        "from_dlpack",
    ):
        setattr(cp, name, getattr(np, name))
    # array_api_compat's is_cupy_array looks up cupy.ndarray once cupy is imported: a class
    # no NumPy array belongs to (the arrays stay NumPy's, so NumPy paths serve them).
    cp.ndarray = type("ndarray", (), {})

    class _Device:
        def __init__(self, i: int = 0) -> None:
            self.id = i
            self.compute_capability = "90"

        def __enter__(self) -> _Device:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0), Device=_Device
    )

    class RawModule:
        def __init__(self, code: str, options=(), name_expressions=()) -> None:
            assert "aa_drop_round" in code and "#include" not in code.split("aa_smem")[0][-200:]
            self.names = list(name_expressions)
            # what the loader put in front of the source (a block-mask predicate)
            src = _loader.kernel_source("attn_fwd.cu")
            self.prelude = code[: len(code) - len(src)] if code.endswith(src) else ""
            PRELUDES.append(self.prelude)

        def get_function(self, name: str) -> _FakeKernel:
            assert name in self.names
            return _FakeKernel(name, work, self.prelude)

    cp.RawModule = RawModule
    return cp


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulator")
    work = tmp_path_factory.mktemp("glue")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(work))
    monkeypatch.setattr(_loader, "_KERNELS", {})
    monkeypatch.setattr(fused, "POISON_OUTPUTS", True)
    return work


def _check(q, k, v, mask=None, tol=None, **kw):
    opts = dict(dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                causal_align="top_left", window=None, softcap=None, seed=None)  # fmt: skip
    names = ("q_lengths", "kv_lengths", "sinks", "alibi_slopes")
    lengths = {n: kw.pop(n) for n in names if n in kw}
    opts.update(kw)
    spec = make_spec(q, k, v, mask, *opts.values(), **lengths)
    before = [x.copy() for x in (q, k, v)]
    out, lse = fused.FUSED.forward(spec, q, k, v, mask)
    ref_out, ref_lse = _composed.forward(spec, q, k, v, mask)
    for x, b in zip((q, k, v), before, strict=True):
        np.testing.assert_array_equal(x, b)  # inputs untouched
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == ref_lse.dtype
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    o, r = out.astype(np.float64), ref_out.astype(np.float64)
    err = np.linalg.norm(o - r) / np.linalg.norm(r)
    assert err <= (tol or {2: 4e-3, 4: 1e-5, 8: 1e-12}[out.dtype.itemsize]), err
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


def test_padding_gqa_bottom_right_float32(fake_cupy) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 4, 37, 80), dtype=np.float32)  # E = 80 -> kernel D = 96
    k = rng.standard_normal((2, 2, 70, 80), dtype=np.float32)
    v = rng.standard_normal((2, 2, 70, 48), dtype=np.float32)  # Ev = 48
    _check(q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right")


def test_strided_and_batch_broadcast_float16(fake_cupy) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 70, 3, 64)).astype(np.float16).transpose(0, 2, 1, 3)
    k = rng.standard_normal((1, 3, 75, 64)).astype(np.float16)  # broadcast over batch
    v = rng.standard_normal((1, 75, 3, 64)).astype(np.float16).transpose(0, 2, 1, 3)
    _check(q, k, v, is_causal=True)


def test_multi_lead_bool_mask_window_softcap_dropout_float16(fake_cupy) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 3, 1, 40, 32)).astype(np.float16)
    k = rng.standard_normal((1, 3, 1, 50, 32)).astype(np.float16)  # lead (1, 3) vs (2, 3)
    mask = rng.random((40, 50)) < 0.8
    _check(q, k, k, mask, window=(9, 4), softcap=2.5, dropout_p=0.3, seed=77)


def test_float_mask_lengths_float64(fake_cupy) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((3, 2, 45, 32))
    k = rng.standard_normal((3, 2, 60, 32))
    mask = rng.standard_normal((3, 1, 1, 60))
    _check(q, k, k, mask, is_causal=True, causal_align="bottom_right",
           q_lengths=np.array([45, 10, 0]), kv_lengths=np.array([60, 33, 5]))  # fmt: skip


def test_three_dim_and_head_broadcast_float32(fake_cupy) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 33, 64), dtype=np.float32)  # one query head, broadcast
    k = rng.standard_normal((2, 50, 64), dtype=np.float32)
    _check(q, k, k, window=(5, -1))


def test_sinks_alibi_gqa_lengths_float16(fake_cupy) -> None:
    """Sinks ``(Hq,)`` and per-batch ALiBi slopes ``(B, Hq)`` reach the kernel as
    ``(B * Hq,)`` arrays; a sequence with no key leaves the sink alone (output 0)."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 4, 37, 64)).astype(np.float16)
    k = rng.standard_normal((2, 2, 70, 64)).astype(np.float16)
    sinks = rng.standard_normal(4).astype(np.float16)
    slopes = (2.0 ** -np.arange(1, 5))[None, :] * np.array([[1.0], [2.0]])
    _check(q, k, k, enable_gqa=True, is_causal=True, causal_align="bottom_right",
           kv_lengths=np.array([70, 0]), sinks=sinks, alibi_slopes=slopes)  # fmt: skip


@pytest.mark.parametrize("features", [False, True])
def test_forward_variant_v2_float16(fake_cupy, monkeypatch, features) -> None:
    """ARRAYATTN_FWD_VARIANT=v2 through fused.py: aa_fwd_tc2 at D = 128 (strided, GQA,
    causal bottom-right, lengths) and, with sinks, ALiBi and a bool mask, at D = 64; the
    launch replays on the emulator against the composed path."""
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", "v2")
    launched: list[str] = []
    real = _loader.get_kernel
    monkeypatch.setattr(
        _loader, "get_kernel", lambda f, n, *a: launched.append(n) or real(f, n, *a)
    )
    rng = np.random.default_rng()
    e = 64 if features else 128
    q = rng.standard_normal((2, 70, 4, e)).astype(np.float16).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 2, 150, e)).astype(np.float16)
    kw: dict = {}
    mask = None
    if features:
        mask = rng.random((70, 150)) < 0.8
        kw = dict(sinks=rng.standard_normal(4).astype(np.float16),
                  alibi_slopes=2.0 ** -np.arange(1, 5))  # fmt: skip
    _check(q, k, k, mask, enable_gqa=True, is_causal=True, causal_align="bottom_right",
           q_lengths=np.array([70, 41]), kv_lengths=np.array([150, 90]), **kw)  # fmt: skip
    assert launched and all(n.startswith(f"aa_fwd_tc2<0, {e},") for n in launched), launched


@pytest.mark.parametrize("features", [False, True])
def test_forward_variant_v3_float32(fake_cupy, monkeypatch, features) -> None:
    """ARRAYATTN_FWD_VARIANT=v3 through fused.py: float32 runs aa_fwd_tf32 (three TF32
    products per product) at D = 128 (strided rows, GQA, causal bottom-right, lengths) and,
    with sinks, ALiBi, softcap and a float mask, at D = 64; float32's 1e-5 against the
    composed path; dropout stays on aa_fwd_simt."""
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", "v3")
    launched: list[str] = []
    real = _loader.get_kernel
    monkeypatch.setattr(
        _loader, "get_kernel", lambda f, n, *a: launched.append(n) or real(f, n, *a)
    )
    rng = np.random.default_rng()
    e = 64 if features else 128
    q = rng.standard_normal((2, 70, 4, e)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 2, 150, e)).astype(np.float32)
    kw: dict = {}
    mask = None
    if features:
        mask = rng.standard_normal((70, 150)).astype(np.float32)
        kw = dict(sinks=rng.standard_normal(4).astype(np.float32),
                  alibi_slopes=2.0 ** -np.arange(1, 5), softcap=3.0)  # fmt: skip
    _check(q, k, k, mask, enable_gqa=True, is_causal=True, causal_align="bottom_right",
           q_lengths=np.array([70, 41]), kv_lengths=np.array([150, 90]), **kw)  # fmt: skip
    assert launched and all(n.startswith(f"aa_fwd_tf32<{e},") for n in launched), launched
    launched.clear()
    _check(q, k, k, enable_gqa=True, dropout_p=0.2, seed=5)
    assert launched and all(n.startswith("aa_fwd_simt<float,") for n in launched), launched


def test_sinks_alibi_broadcast_float64(fake_cupy) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((3, 2, 20, 32))
    k = rng.standard_normal((3, 2, 30, 32))
    _check(q, k, k, window=(4, 2), sinks=rng.standard_normal((3, 1)),
           alibi_slopes=np.array([0.5, 0.125]))  # fmt: skip


def test_no_keys_float32(fake_cupy) -> None:
    """S = 0 (every row empty): output 0 and LSE -inf without a launch (the first GPU run,
    2026-11-26, found the operand layout failing on the empty key array)."""
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 4, 3, 64), dtype=np.float32)
    k = np.zeros((1, 2, 0, 64), dtype=np.float32)
    spec = make_spec(q, k, k, None, 0.0, True, None, True, "top_left", None, None, None)
    out, lse = fused.FUSED.forward(spec, q, k, k, None)
    assert out.shape == (1, 4, 3, 64) and not out.any()
    assert lse.shape == (1, 4, 3) and np.isneginf(lse).all()


@pytest.mark.parametrize("row0,col0", [(64, 0), (0, 64), (96, 32)])
def test_block_of_a_larger_call_keeps_its_diagonal_float32(fake_cupy, row0, col0) -> None:
    """A block of a causal call (the Dask path's blocks on CuPy chunks): its diagonal is
    moved by ``row0 - col0``, which the kernels take as ``diag`` (before the first GPU run
    they assumed 0 or ``S - L`` and got such blocks wrong, on the GPU and here)."""
    import math

    from arrayattn.attention.dask.plan import _Block, _Call

    rows = 64
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 2, rows, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, rows, 64), dtype=np.float32)
    call = _Call(dropout_p=0.0, scale=1.0 / math.sqrt(64), enable_gqa=False, window=(-1, 0),
                 softcap=None, seed=None, L=row0 + rows, S=col0 + rows, diagonal=0,
                 per_sequence_diagonal=False, offset_bounds=None)  # fmt: skip
    blk = _Block(call, batch_ids=(0,), head0=0, row0=row0, col0=col0, partial_keys=True)
    spec = blk.spec(q, k, k, None, None, None, None)
    assert spec.structure.offset == row0 - col0
    assert fused.kernel_diagonal(spec) == row0 - col0
    out, lse = fused.FUSED.forward(spec, q, k, k, None)
    ref_out, ref_lse = _composed.forward(spec, q, k, k, None)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-6)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


def test_torch_tensors_through_the_dlpack_bridge_bfloat16_and_float16(fake_cupy, monkeypatch):
    """PyTorch tensors reach the kernels through DLPack (``kernels/_bridge.py``): bfloat16
    as its int16 storage, the output back as a bfloat16 tensor. Here CPU tensors play the
    CUDA ones (NumPy plays CuPy); on a GPU, tests/kernels/test_fused_gpu.py runs it."""
    torch = pytest.importorskip("torch")
    import array_api_compat

    import arrayattn as aa
    from arrayattn._backend import CupyBridge
    from arrayattn.attention import registry
    from arrayattn.attention.cuda import _bridge

    registered = registry.Registered(fused.FUSED, fused.declines, -1, fused.auto_declines)
    monkeypatch.setitem(registry._REGISTRY, "fused", registered)  # as cuda.register()
    fake_cxp = types.ModuleType("array_api_compat.cupy")  # is_cupy_namespace: by name
    monkeypatch.setitem(sys.modules, "array_api_compat.cupy", fake_cxp)
    monkeypatch.setattr(
        _bridge, "cupy_bridge",
        lambda xp, device, *a: CupyBridge("torch") if array_api_compat.is_torch_namespace(xp)
        else None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
        q = torch.randn(2, 4, 37, 64, generator=g).to(dtype)
        k = torch.randn(2, 2, 70, 64, generator=g).to(dtype)
        v = torch.randn(2, 2, 70, 64, generator=g).to(dtype)
        sinks = torch.randn(4, generator=g).to(dtype)
        kw = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True, sinks=sinks,
                  return_lse=True)  # fmt: skip
        before = [x.clone() for x in (q, k, v)]
        out, lse = aa.scaled_dot_product_attention(q, k, v, implementation="fused", **kw)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype and lse.dtype == torch.float32
        for x, b in zip((q, k, v), before, strict=True):
            assert torch.equal(x, b)  # inputs untouched
        kw32 = dict(kw, sinks=sinks.float())
        ref, ref_lse = aa.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), implementation="composed", **kw32
        )
        err = float((out.float() - ref).norm() / ref.norm())
        assert err <= tol, err
        assert float((lse - ref_lse).abs().max()) <= 1e-4
    # "auto" takes this route too, unless ARRAYATTN_AUTO_DLPACK=0
    from arrayattn.attention.registry import auto_choice
    from arrayattn.attention.spec import make_spec

    spec = make_spec(q, k, v, None, 0.0, True, None, True, "top_left", None, None, None)
    assert auto_choice(spec) == "fused"
    monkeypatch.setenv("ARRAYATTN_AUTO_DLPACK", "0")
    assert auto_choice(spec) != "fused"
