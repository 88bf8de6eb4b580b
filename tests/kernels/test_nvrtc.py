"""Every kernel variant compiles under NVRTC exactly as ``cupy.RawModule`` compiles them.

``nvcc`` (``.ci/compile_kernels.py``) is more permissive than NVRTC: it accepts host
functions, includes the CUDA runtime headers implicitly, and so on. This test hands the
source the loader produces (``_loader.kernel_source``: local headers inlined) and every
name expression the compile check builds (the forward variants of
``.ci/compile_kernels.py``, ``backward.COMPILE_VARIANTS``) to NVRTC, with the loader's
options, and checks that each name gets a lowered (mangled) name. It caught a
``constexpr`` host function in a launch bound that nvcc accepts and NVRTC rejects. No GPU
is needed, only ``libnvrtc`` (the ``test`` extra installs the ``nvidia-cuda-nvrtc`` wheel on
Linux x86-64; point ``ARRAYATTN_NVRTC`` at the library file to use another). Skipped when
it cannot be found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import _compile_check
import pytest

from arrayattn.kernels import _loader
from arrayattn.kernels.backward import COMPILE_VARIANTS


def _variants() -> dict[str, list[str]]:
    """Source file -> the name expressions .ci/compile_kernels.py compiles with nvcc."""
    mod = _compile_check.load()
    out = {mod.FWD: [name for name, *_ in mod.forward_variants()]}
    out.update(COMPILE_VARIANTS)
    return out


def _find_nvrtc() -> ctypes.CDLL | None:
    candidates: list[str] = []
    if os.environ.get("ARRAYATTN_NVRTC"):
        candidates.append(os.environ["ARRAYATTN_NVRTC"])
    try:
        import nvidia  # the nvidia-cuda-nvrtc wheel's namespace package

        for base in getattr(nvidia, "__path__", []):
            candidates += sorted(str(p) for p in Path(base).glob("cu*/lib/libnvrtc.so.*"))
            candidates += sorted(str(p) for p in Path(base).glob("cuda_nvrtc/lib/libnvrtc.so.*"))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for cand in candidates:
        if "builtins" in cand or "alt" in Path(cand).name:
            continue
        try:
            # The builtins library next to it is loaded by NVRTC itself: preload it.
            for b in sorted(Path(cand).parent.glob("libnvrtc-builtins.so.*")):
                if "alt" not in b.name:
                    ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(cand)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("source", ["attn_fwd.cu", "attn_bwd.cu"])
def test_every_variant_compiles_under_nvrtc(source: str) -> None:
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc, or set ARRAYATTN_NVRTC)")
    names = _variants()[source]
    assert len(names) >= 20, names
    prog = ctypes.c_void_p()
    src = _loader.kernel_source(source).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, source.encode(), 0, None, None) == 0
    try:
        for name in names:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        opts = [o.encode() for o in _loader.COMPILE_OPTIONS] + [b"-arch=compute_90"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"NVRTC failed:\n{log.value.decode(errors='replace')[-6000:]}"
        for name in names:
            lowered = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)) == 0
            assert lowered.value and lowered.value.startswith(b"_Z"), name
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
