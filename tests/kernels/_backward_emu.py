"""Run the backward kernels of ``arrayattn/attention/cuda/attn_bwd.cu`` on the CPU.

``backward_emulator.h`` supplies host versions of the CUDA features the kernels use (one
OS thread per CUDA thread, barriers for ``__syncthreads`` and the warp collectives
``ldmatrix`` / ``mma.sync`` / ``__shfl_xor_sync``). This module compiles the kernel file
with g++ into a shared library exposing each instantiation by its name expression, and
gives :func:`arrayattn.attention.cuda.backward.run_kernels` a ``launch`` that calls it with
NumPy arrays, so the very launch plan the CuPy path uses runs here.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def compiler() -> str | None:
    """The host C++20 compiler, or ``None``."""
    return shutil.which("g++")


def cuda_include() -> Path | None:
    """A CUDA include dir with ``cuda_fp16.h`` (host conversions), or ``None``."""
    for base in ("/usr/local/cuda/include",):
        if (Path(base) / "cuda_fp16.h").exists():
            return Path(base)
    nvcc = shutil.which("nvcc")
    if nvcc:
        cand = Path(nvcc).resolve().parent.parent / "include"
        if (cand / "cuda_fp16.h").exists():
            return cand
    return None


def host_ints(tmp_path: Path, kernel_file: str, exprs: list[str]) -> list[int]:
    """The values of the C++ integer expressions ``exprs`` (e.g. a kernel's shared-memory
    layout, ``AaBwdMma4Smem<128, 64, 128>::value``), from a host program that includes
    ``kernel_file`` under the emulator header: what the kernels themselves compute."""
    lines = ['#include "backward_emulator.h"', f'#include "{kernel_file}"', "#include <cstdio>",
             "int main() {"]  # fmt: skip
    lines += [f'    std::printf("%d\\n", (int)({e}));' for e in exprs]
    lines.append("}")
    src = tmp_path / "host_ints.cpp"
    src.write_text("\n".join(lines) + "\n")
    kernels = HERE.parent.parent / "arrayattn" / "attention" / "cuda"
    exe = tmp_path / "host_ints"
    cmd = [compiler() or "g++", "-std=c++20", "-w", f"-I{HERE}", f"-I{kernels}",
           f"-I{cuda_include()}", str(src), "-o", str(exe), "-pthread"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = subprocess.run([str(exe)], capture_output=True, text=True).stdout
    return [int(x) for x in printed.split()]


def _source(names: list[str], kernel_file: str = "attn_bwd.cu", prelude: str = "") -> str:
    lines = [
        prelude,  # a block-mask predicate (flex_pred.py) in front, as the loader does
        '#include "backward_emulator.h"',
        f'#include "{kernel_file}"',
        "#include <cstring>",
        "struct AaEmuEntry { const char* name; void (*call)(void**); };",
        "static const AaEmuEntry aa_emu_entries[] = {",
    ]
    for name in names:
        lines.append(f'    {{"{name}", [](void** p) {{ aa_emu_call(&{name}, p); }}}},')
    lines += [
        "};",
        'extern "C" int aa_emu_run(const char* name, unsigned gx, unsigned gy, unsigned gz,',
        "                          int threads, unsigned long long smem, void** params) {",
        "    for (const auto& e : aa_emu_entries) {",
        "        if (std::strcmp(e.name, name) != 0) continue;",
        "        aa_emu_launch({gx, gy, gz}, threads, smem, [&] { e.call(params); });",
        "        return 0;",
        "    }",
        "    return -1;",
        "}",
    ]
    if kernel_file != "attn_bwd.cu":
        return "\n".join(lines) + "\n"
    lines += [
        "// The schedule helpers, for comparison with their Python mirrors.",
        'extern "C" void aa_emu_row_range(int c0, int c1, int off, int left, int right,',
        "                                 int q_len, int* out) {",
        "    aa_row_range(c0, c1, off, left, right, q_len, out[0], out[1]);",
        "}",
        'extern "C" void aa_emu_key_range(int r0, int r1, int off, int left, int right,',
        "                                 int kv_len, int* out) {",
        "    aa_key_range(r0, r1, off, left, right, kv_len, out[0], out[1]);",
        "}",
        'extern "C" int aa_emu_block_full(int r0, int r1, int c0, int c1, int off, int left,',
        "                                 int right, int kv_len) {",
        "    return aa_block_full(r0, r1, c0, c1, off, left, right, kv_len) ? 1 : 0;",
        "}",
    ]
    return "\n".join(lines) + "\n"


def compile_library(
    names: list[str],
    work: Path,
    flags: tuple[str, ...] = ("-O1",),
    kernels_dir: Path | None = None,
    kernel_file: str = "attn_bwd.cu",
    prelude: str = "",
) -> Path:
    """Compile the emulator library for the instantiations ``names`` of ``kernel_file``
    (``attn_bwd.cu`` or ``decode_attn.cu``) with ``flags`` (optimisation, sanitizers);
    cached in ``work`` by content and flags. ``kernels_dir`` replaces the package's kernel
    sources (a mutated copy); ``prelude`` goes in front (``flex_table.prelude``)."""
    kernels = kernels_dir or Path(str(resources.files("arrayattn.attention.cuda")))
    inc = cuda_include()
    text = _source(names, kernel_file, prelude)
    digest = hashlib.sha256(
        (
            " ".join(flags)
            + text
            + "".join(
                (HERE / h).read_text()
                for h in ("backward_emulator.h", "emulator_warp.h", "emulator_barrier.h")
            )
            + (kernels / kernel_file).read_text()
            + (kernels / "common.cuh").read_text()
            + (kernels / "elem16.cuh").read_text()
        ).encode()
    ).hexdigest()[:16]
    lib = work / f"aa_bwd_emu_{digest}.so"
    # Several processes (pytest-xdist workers given one shared ``work``) may want the same
    # library: one builds it under the lock, the others wait for it and load that build.
    with open(work / f"aa_bwd_emu_{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        src = work / f"aa_bwd_emu_{digest}.cpp"
        src.write_text(text)
        partial = work / f"aa_bwd_emu_{digest}.{os.getpid()}.tmp"
        cmd = [
            compiler() or "g++",
            "-std=c++20",
            *flags,
            "-pthread",
            "-shared",
            "-fPIC",
            "-w",
            f"-I{HERE}",
            f"-I{kernels}",
            f"-I{inc}",
            str(src),
            "-o",
            str(partial),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"emulator build failed:\n{res.stderr[-6000:]}")
        os.replace(partial, lib)
    return lib


def shared_work(tmp_path_factory) -> Path:
    """A build folder every pytest-xdist worker of this test session shares (the session's
    base temporary folder without xdist): a library several test files build is compiled
    once, by :func:`compile_library`'s content key."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' common parent (popen-gw0, popen-gw1, ...)
    work = base / "aa_emu_builds"
    work.mkdir(exist_ok=True)
    return work


def load(lib: Path) -> ctypes.CDLL:
    """Load a library :func:`compile_library` built."""
    dll = ctypes.CDLL(str(lib))
    dll.aa_emu_run.restype = ctypes.c_int
    dll.aa_emu_run.argtypes = [
        ctypes.c_char_p,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_int,
        ctypes.c_ulonglong,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    return dll


def build(
    names: list[str], work: Path, kernel_file: str | None = None, prelude: str = ""
) -> ctypes.CDLL:
    """Compile (cached) and load the emulator library for the instantiations ``names`` of
    ``kernel_file``; by default ``attn_bwd.cu``, or the v4/v3 source (which includes it)
    when a name is one of their dK/dV kernels (v4 is the default backward variant)."""
    if kernel_file is None:
        kernel_file = "attn_bwd.cu"
        if any(n.startswith("aa_bwd_dkdv_mma4<") for n in names):
            kernel_file = "attn_bwd_v4.cu"
        elif any(n.startswith("aa_bwd_dkdv_mma3<") for n in names):
            kernel_file = "attn_bwd_v3.cu"
    return load(compile_library(names, work, kernel_file=kernel_file, prelude=prelude))


_SCALARS = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}


class Launcher:
    """``launch(name, grid, threads, smem, args)`` on the emulator; records every launch."""

    def __init__(self, dll: ctypes.CDLL, strided: bool = False):
        self.dll = dll
        self.strided = strided  # kernels that take element strides accept views
        self.launches: list[tuple[str, tuple[int, int, int], int, int]] = []

    def __call__(self, name: str, grid, threads: int, smem: int, args) -> None:
        keep: list[Any] = []
        ptrs = (ctypes.c_void_p * len(args))()
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                assert self.strided or a.flags.c_contiguous, f"argument {i} of {name} is strided"
                obj = ctypes.c_void_p(a.ctypes.data)
            elif isinstance(a, np.generic):
                obj = _SCALARS[a.dtype](a.item())
            else:
                raise TypeError(f"argument {i} of {name}: unsupported {type(a).__name__}")
            keep.append(obj)
            ptrs[i] = ctypes.cast(ctypes.pointer(obj), ctypes.c_void_p)
        self.launches.append((name, tuple(grid), threads, smem))
        rc = self.dll.aa_emu_run(name.encode(), *grid, threads, smem, ptrs)
        if rc != 0:
            raise KeyError(f"kernel {name!r} is not in the emulator library")


class PoisonXp:
    """The allocation half of an array namespace for :func:`run_kernels`: NumPy arrays,
    ``empty`` filled with NaN (all-ones bits for 16-bit storage), so any output element a
    kernel fails to write shows up."""

    float32 = np.float32
    float64 = np.float64

    @staticmethod
    def empty(shape, dtype):
        dt = np.dtype(dtype)
        if dt == np.uint16:
            return np.full(shape, 0xFFFF, dtype=dt)
        if dt == np.int16:  # bfloat16 storage handed over by the DLPack bridge
            return np.full(shape, -1, dtype=dt)
        return np.full(shape, np.nan, dtype=dt)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype=dtype)
