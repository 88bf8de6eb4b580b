"""Run a decode case from a ThreadSanitizer build of the emulator library.

Run as a script in a process with ``libtsan`` preloaded (a TSan-instrumented library
cannot be loaded into an uninstrumented Python otherwise):
``python _decode_tsan_run.py LIBRARY CASE [VARIANTS]``. It runs ``CASE`` of
``test_decode_emulated.py`` on the kernel variants ``VARIANTS`` (comma-separated; default:
every one, ``decode.VARIANTS``) and exits 1 when a result differs from the float64
reference. TSan writes any race it sees to stderr; the calling test reads it there.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _backward_emu as emu  # noqa: E402
import test_decode_emulated as dec  # noqa: E402


def main() -> int:
    lib = emu.load(Path(sys.argv[1]))
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else dec.decode.VARIANTS
    for variant in variants:
        try:
            dec.run_case(lib, sys.argv[2], variant)
        except AssertionError as exc:
            print(f"wrong result ({variant}): {exc}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
