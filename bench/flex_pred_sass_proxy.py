#!/usr/bin/env python3
"""Register and SASS proxies of the block-mask kernels, bits path vs predicate, no GPU.

For one block-mask instantiation per kernel family (``flex_variants.compile_variants``) this
compiles the loader's source twice with NVRTC for ``sm_90`` exactly as ``cupy.RawModule``
does: as the bits path reads the table, and with a generated predicate in front
(``flex_pred.sample_prelude``: windows, global tokens, per-batch documents and prefix
lengths, and/or); then reads the cubins with ``cuobjdump -res-usage`` and ``nvdisasm``
(``bench/bwd_sass_proxy.py``'s helpers). Per kernel and path: registers, spill
instructions, SASS instructions in all, HMMA and instructions per HMMA between the first
and the last HMMA (tensor-core kernels), FFMA/DFMA (CUDA-core kernels). No timing.

Usage (``cuobjdump``/``nvdisasm`` from PATH or ``--cuobjdump``/``--nvdisasm``)::

    python bench/flex_pred_sass_proxy.py [--mask document]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402
from bwd_sass_proxy import cubin, nvrtc_or_report, sass_counts, tool_parser  # noqa: E402

from arrayattn.attention.cuda import _loader, flex_pred, flex_variants  # noqa: E402
from arrayattn.flex import document_mask  # noqa: E402


def _fma(sass: str, mangled: str) -> int:
    """FFMA + DFMA instructions of one kernel (the CUDA-core kernels' arithmetic)."""
    m = re.search(r"\.text\." + re.escape(mangled) + r":(.*?)(?:\n\s*\.section|\Z)", sass, re.S)
    return len(re.findall(r"\b[FD]FMA\b", m.group(1) if m else ""))


def main() -> int:
    ap = tool_parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--mask",
        default="sample",
        choices=["sample", "document"],
        help="the predicate: flex_pred.sample_prelude, or a causal document mask's",
    )
    a = ap.parse_args()
    lib = nvrtc_or_report()
    if lib is None:
        return 2
    real_source = _loader.kernel_source
    rows = []
    pred = flex_pred.sample_prelude()
    if a.mask == "document":
        doc = flex_pred.generate(document_mask(np.zeros(8, np.int32), causal=True), 1)
        assert doc is not None
        pred = doc.source
    for path, prelude in (("bits", ""), ("pred", pred)):
        # cubin() compiles _loader.kernel_source(source): the prelude goes in front there
        _loader.kernel_source = lambda f, p=prelude: p + real_source(f)  # type: ignore[assignment]
        try:
            for src, names in flex_variants.compile_variants().items():
                blob, lowered = cubin(lib, names, src)
                with tempfile.TemporaryDirectory() as tmp:
                    cub = Path(tmp) / "k.cubin"
                    cub.write_bytes(blob)
                    res = subprocess.run([a.cuobjdump, "-res-usage", str(cub)], check=True,
                                         capture_output=True, text=True).stdout  # fmt: skip
                    sass = subprocess.run([a.nvdisasm, "-c", str(cub)], check=True,
                                          capture_output=True, text=True).stdout  # fmt: skip
                regs = {
                    fn: int(r) for fn, r in re.findall(r"Function (\S+):\s*\n\s*REG:(\d+)", res)
                }
                for name in names:
                    mg = lowered[name]
                    s = sass_counts(sass, mg)
                    rows.append((name, path, regs.get(mg, -1), s, _fma(sass, mg)))
        finally:
            _loader.kernel_source = real_source  # type: ignore[assignment]
    print("| kernel | path | regs | spill instr | SASS instr | HMMA | instr/HMMA | FFMA+DFMA |")
    print("|" + "---|" * 8)
    for name, path, r, s, fma in sorted(rows, key=lambda x: (x[0], x[1])):
        per = f"{s['per_hmma']:.2f}" if "per_hmma" in s else "-"
        print(f"| `{name}` | {path} | {r} | {s.get('spill')} | {s.get('total')} "
              f"| {s.get('hmma', '-')} | {per} | {fma} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
