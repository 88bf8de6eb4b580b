"""NVRTC, the compiler ``cupy.RawModule`` uses, driven through ctypes without a GPU: the
kernel tests compile every variant of each ``.cu`` file with it (tests/kernels/test_nvrtc.py,
tests/nn/test_paged_kernel.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from arrayattn.attention.cuda import _loader


def find_nvrtc() -> ctypes.CDLL | None:
    """``libnvrtc`` (``ARRAYATTN_NVRTC``, the nvidia-cuda-nvrtc wheel, or the system's), with
    its builtins library preloaded; ``None`` when none is found."""
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


def lowered_names(
    lib: ctypes.CDLL,
    source: str,
    names: list[str],
    prelude: str = "",
    syntax_only: bool = False,
) -> dict[str, bytes]:
    """Compile ``source`` (local headers inlined, as the loader does, ``prelude`` in front:
    a block-mask predicate) with the loader's options for sm_90 and every name expression
    in ``names``; return each name's lowered (mangled) name. Fails with the end of NVRTC's
    log when the compile fails.

    ``syntax_only``: stop after NVRTC's front end (``-fdevice-syntax-only``): every name is
    still instantiated and checked (templates, launch bounds, host functions in JIT mode,
    static assertions), but no PTX is generated, which is ~99% of the time (the forward's
    81 variants: 0.2 s against 34 s)."""
    prog = ctypes.c_void_p()
    src = (prelude + _loader.kernel_source(source)).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, source.encode(), 0, None, None) == 0
    try:
        for name in names:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        opts = [o.encode() for o in _loader.COMPILE_OPTIONS] + [b"-arch=compute_90"]
        if syntax_only:
            opts.append(b"-fdevice-syntax-only")
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"NVRTC failed:\n{log.value.decode(errors='replace')[-6000:]}"
        lowered = {}
        for name in names:
            out = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)) == 0
            lowered[name] = out.value
        return lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
