"""Shared pieces of the kernels' data-race checks (ThreadSanitizer over the emulators).

Every CUDA thread of an emulated kernel is an OS thread, and the emulators' barriers
(``emulator_barrier.h``) order nothing but their own threads, so TSan reports any pair of
accesses from different threads with no barrier between them, however the threads ran.
The tests that use this also delete one ``__syncthreads();`` at a time, to show the check
notices each barrier the schedule needs. They do it with one build per kernel family
(:func:`kernels_with_switchable_barriers`): every barrier of the copied source becomes
conditional on the ``AA_EMU_SKIP_BARRIER`` environment variable, so running that build with
``AA_EMU_SKIP_BARRIER=i`` is the kernel with barrier ``i`` deleted (every thread skips the
same one), and each deletion costs a run instead of a ThreadSanitizer compile.
:func:`kernels_without_barrier` (the literal deletion) is kept for checking a single site
by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import cache
from importlib import resources
from pathlib import Path

import pytest

FLAGS = ("-O1", "-g", "-fsanitize=thread")
KERNELS = Path(str(resources.files("arrayattn.attention.cuda")))
BARRIER = "__syncthreads();"
REPORT = "WARNING: ThreadSanitizer"
HALT_ON_RACE = "halt_on_error=1"  # TSAN_OPTIONS where the first report is enough
SKIP_BARRIER = "AA_EMU_SKIP_BARRIER"  # which barrier a switchable build skips (unset: none)
# Put before the kernel file in a switchable copy. The variable is read once, while the
# program or library loads, before any emulated CUDA thread exists: the threads only read
# a constant, which orders nothing (a function-local static's guard would be an acquire).
_SWITCH_PRELUDE = f"""#include <cstdlib>
// Test copy (tests/kernels/_tsan.py): barrier number ${SKIP_BARRIER} is skipped.
static const int aa_emu_skip_barrier = [] {{
    const char* s = std::getenv("{SKIP_BARRIER}");
    return s ? std::atoi(s) : -1;
}}();
"""


def barrier_offsets(source: str) -> list[int]:
    """Character offsets of every ``__syncthreads();`` in a kernel file's text."""
    text = (KERNELS / source).read_text()
    out, pos = [], text.find(BARRIER)
    while pos >= 0:
        out.append(pos)
        pos = text.find(BARRIER, pos + 1)
    return out


def kernels_without_barrier(source: str, site: int, dest: Path) -> Path:
    """A copy of the kernel sources in ``dest`` with barrier number ``site`` of ``source``
    commented out; returns ``dest``."""
    shutil.copytree(KERNELS, dest, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    text = (dest / source).read_text()
    pos = barrier_offsets(source)[site]
    (dest / source).write_text(text[:pos] + "/* removed */" + text[pos + len(BARRIER) :])
    return dest


def kernels_with_switchable_barriers(source: str, dest: Path) -> Path:
    """A copy of the kernel sources in ``dest`` where barrier number ``i`` of ``source``
    is skipped when the program runs with ``AA_EMU_SKIP_BARRIER=i`` (and none is skipped
    without it); returns ``dest``. Barrier ``i`` becomes
    ``{ if (aa_emu_skip_barrier != i) __syncthreads(); }`` in place (each is a statement of
    its own), and a ``#line`` directive keeps the file's line numbers in reports."""
    shutil.copytree(KERNELS, dest, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    text = (dest / source).read_text()
    pieces, prev = [], 0
    for i, pos in enumerate(barrier_offsets(source)):
        pieces += [text[prev:pos], f"{{ if (aa_emu_skip_barrier != {i}) {BARRIER} }}"]
        prev = pos + len(BARRIER)
    pieces.append(text[prev:])
    header = _SWITCH_PRELUDE + f'#line 1 "{source}"\n'
    (dest / source).write_text(header + "".join(pieces))
    return dest


def skip_barrier_env(site: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for running a switchable build without barrier
    ``site``, stopping at ThreadSanitizer's first report."""
    return dict(os.environ if env is None else env, **{SKIP_BARRIER: str(site)},
                TSAN_OPTIONS=HALT_ON_RACE)  # fmt: skip


@cache
def libtsan(compiler: str = "g++") -> str | None:
    """Path of the compiler's libtsan (to preload into an uninstrumented Python), or None."""
    path = subprocess.run(
        [compiler, "-print-file-name=libtsan.so"], capture_output=True, text=True
    ).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def python_fails_with(lib: str) -> str | None:
    """None when a Python with ``lib`` preloaded starts here, else its error output (TSan
    needs an address layout some kernels do not give)."""
    probe = subprocess.run(
        [sys.executable, "-c", "pass"], env=dict(os.environ, LD_PRELOAD=lib), capture_output=True
    )
    return None if probe.returncode == 0 else probe.stderr.decode(errors="replace")[-300:]


def require_python_tsan(compiler: str = "g++") -> str:
    """The compiler's libtsan, when a Python with it preloaded starts here (what the race
    checks run their kernels under); else the calling test or fixture is skipped."""
    lib = libtsan(compiler)
    if lib is None:
        pytest.skip("no libtsan for this compiler")
    error = python_fails_with(lib)
    if error is not None:
        pytest.skip(f"ThreadSanitizer does not run here: {error}")
    return lib


def program_runs(work: Path, compiler: str = "g++") -> bool:
    """Whether a -fsanitize=thread program builds and runs here (TSan needs an address
    layout some kernels do not give)."""
    probe = work / "tsan_probe.cpp"
    probe.write_text("#include <thread>\nint main() { std::thread([] {}).join(); }\n")
    exe = work / "tsan_probe"
    built = subprocess.run(
        [compiler, "-std=c++20", *FLAGS, "-pthread", str(probe), "-o", str(exe)],
        capture_output=True,
    )
    return built.returncode == 0 and subprocess.run([str(exe)]).returncode == 0
