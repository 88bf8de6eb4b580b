"""CPU attention benchmark: arrayattn (auto, chunked, composed) against PyTorch SDPA and a
plain NumPy baseline, measured in one run. Same as ``python -m arrayattn.bench``.

Usage::

    python bench/cpu_bench.py                  # the issue's three target shapes
    python bench/cpu_bench.py --quick          # small shapes, a smoke run
    python bench/cpu_bench.py --long           # also L=32768 causal fwd+bwd peak memory
    python bench/cpu_bench.py --append-results --plot bench/ratios.png

The code lives in ``arrayattn/bench.py`` so that an installed package runs it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    try:
        from arrayattn.bench import main
    except ImportError:  # running from a checkout without installing
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from arrayattn.bench import main
    raise SystemExit(main())
