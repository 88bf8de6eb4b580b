"""Run backward kernels from a ThreadSanitizer build of the emulator library.

Run as a script in a process with ``libtsan`` preloaded (a TSan-instrumented library
cannot be loaded into an uninstrumented Python otherwise):
``python _backward_tsan_run.py LIBRARY KIND DETERMINISTIC [VARIANT [E,EV]]``. It runs the
race case of ``test_backward_emulated.py`` (VARIANT ``v1``, the default) or, for ``v2``,
its ``v2_race`` case at E = 56, Ev = 64 (several pipelined query steps; ``v3``, ``v4``: a
smaller ``v3_race`` case defined below, two 128-row steps per head; ``E,EV`` other head
dims for it, e.g. ``200,256`` with ``ARRAYATTN_BWD_D256_TC=1``), and exits 1 when a
gradient differs from the float64 reference. TSan writes any race it sees to stderr; the
calling test reads it there.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _backward_emu as emu  # noqa: E402
import test_backward_emulated as bwd  # noqa: E402


def main() -> int:
    lib, kind, deterministic = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    variant = sys.argv[4] if len(sys.argv) > 4 else "v1"
    e, ev = (int(x) for x in sys.argv[5].split(",")) if len(sys.argv) > 5 else (56, 64)
    if variant in ("v3", "v4"):
        # v3's and v4's 128-row steps (head dim 64): one key block seen by rows 80..149
        # (bottom-right), two steps per head, two heads (the prefetch across the GQA
        # group); sinks and ALiBi.
        bwd.CASES["v3_race"] = dict(B=1, Hq=2, Hkv=1, L=150, S=70, causal=True,
                                    align="bottom_right", sinks=True, alibi=True)  # fmt: skip
        got, ref, _ = bwd.run_case(emu.load(lib), kind, "v3_race", deterministic=deterministic,
                                   E=e, Ev=ev, variant=variant)  # fmt: skip
    elif variant == "v2":
        got, ref, _ = bwd.run_case(emu.load(lib), kind, "v2_race", deterministic=deterministic,
                                   E=56, Ev=64, variant="v2")  # fmt: skip
    else:
        got, ref, _ = bwd.run_case(emu.load(lib), kind, "race", deterministic=deterministic)
    errors = [bwd.rel(g, r) for g, r in zip(got, ref, strict=True)]
    print("relative errors dq, dk, dv:", errors)
    return 0 if max(errors) <= bwd.TOL[kind] else 1


if __name__ == "__main__":
    sys.exit(main())
