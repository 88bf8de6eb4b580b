#!/usr/bin/env python3
"""Register, shared-memory and SASS proxies of the backward kernels, without a GPU.

Compiles each named instantiation of ``attn_bwd.cu`` / ``attn_bwd_v3.cu`` / ``attn_bwd_v4.cu``
with NVRTC exactly as
``cupy.RawModule`` does (``_loader.COMPILE_OPTIONS``, the loader's inlined source) for
``sm_90`` to a cubin, then reads it with ``cuobjdump -res-usage`` (registers, stack, local
memory) and ``nvdisasm`` (SASS). Per kernel it prints: registers, spill instructions
(STL/LDL), the dynamic shared memory of its backward plan, blocks per SM that register
and shared-memory budgets allow (65536 registers, 227 KB, 2048 threads), and in the
steady-state part of the SASS (from the first to the last HMMA) the count of HMMA, LDSM,
BAR, MUFU, RED and of all instructions per HMMA. No timing: these are proxies.

Usage (``cuobjdump``/``nvdisasm`` from PATH or ``--cuobjdump``/``--nvdisasm``)::

    python bench/bwd_sass_proxy.py --variants v2,v3,v4 --head-dims 64,128
    python bench/bwd_sass_proxy.py --variants v2,v4 --flex  # the block-mask (FLEX) plans
"""

from __future__ import annotations

import argparse
import ctypes
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _nvrtc import find_nvrtc  # noqa: E402

from arrayattn.attention.cuda import _loader, backward  # noqa: E402


def cubin(lib: ctypes.CDLL, names: list[str], source: str) -> tuple[bytes, dict[str, str]]:
    prog = ctypes.c_void_p()
    # attn_bwd_v3.cu and attn_bwd_v4.cu include attn_bwd.cu
    src = _loader.kernel_source(source).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, source.encode(), 0, None, None) == 0
    for n in names:
        assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0
    opts = [o.encode() for o in _loader.COMPILE_OPTIONS] + [b"-arch=sm_90"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(log.value.decode(errors="replace")[-6000:])
    lowered = {}
    for n in names:
        out = ctypes.c_char_p()
        assert lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)) == 0
        lowered[n] = out.value.decode()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetCUBIN(prog, buf) == 0
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw, lowered


def sass_counts(sass: str, mangled: str) -> dict[str, float]:
    m = re.search(r"\.text\." + re.escape(mangled) + r":(.*?)(?:\n\s*\.section|\Z)", sass, re.S)
    body = m.group(1) if m else ""
    ins = [ln.split("*/", 1)[1].strip() for ln in body.splitlines()
           if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln) and "*/" in ln]  # fmt: skip
    ins = [i for i in ins if i and not i.startswith("NOP")]
    op = [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for i in ins]
    spill = sum(1 for o in op if o.startswith(("STL", "LDL")))
    hm = [k for k, o in enumerate(op) if o.startswith("HMMA")]
    if not hm:
        return dict(total=len(op), spill=spill)
    loop = op[hm[0] : hm[-1] + 1]

    def c(p: str) -> int:
        return sum(1 for o in loop if o.startswith(p))

    n = c("HMMA")
    return dict(total=len(op), spill=spill, hmma=n, ldsm=c("LDSM"), bar=c("BAR"),
                mufu=c("MUFU"), red=c("RED"), per_hmma=len(loop) / n)  # fmt: skip


def sass_loops(sass: str, mangled: str) -> list[tuple[int, int, int, int, int]]:
    """The loops of one kernel's SASS (a branch back to an earlier address): (start, end,
    instructions, HMMA, LDSM) each, innermost loops' instructions excluded from the loops
    around them (the per-iteration cost of each loop level), ordered by start address."""
    m = re.search(r"\.text\." + re.escape(mangled) + r":(.*?)(?:\n\s*\.section|\Z)", sass, re.S)
    body = m.group(1) if m else ""
    ins: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    for ln in body.splitlines():
        lm = re.match(r"\s*(\.L_x_\d+):", ln)
        if lm:
            labels[lm.group(1)] = len(ins)
            continue
        im = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", ln)
        if im and not im.group(2).startswith("NOP"):
            ins.append((int(im.group(1), 16), im.group(2)))
    loops = []
    for k, (_, text) in enumerate(ins):
        bm = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if bm and labels.get(bm.group(1), k + 1) <= k:
            loops.append((labels[bm.group(1)], k))
    out = []
    for a, b in loops:
        inner = [(c, d) for c, d in loops if a <= c and d <= b and (c, d) != (a, b)]
        keep = [i for i in range(a, b + 1) if not any(c <= i <= d for c, d in inner)]
        ops = [re.sub(r"^@!?U?P\w+\s+", "", ins[i][1]).split()[0] for i in keep]
        out.append((a, b, len(ops), sum(o.startswith("HMMA") for o in ops),
                    sum(o.startswith("LDSM") for o in ops)))  # fmt: skip
    return sorted(out)


def tool_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the ``--cuobjdump``/``--nvdisasm`` tool paths (PATH's by
    default), for this script and the others that read cubins with its helpers."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    return ap


def nvrtc_or_report() -> ctypes.CDLL | None:
    """libnvrtc, or ``None`` after saying on stderr that none was found."""
    lib = find_nvrtc()
    if lib is None:
        print("no NVRTC library found", file=sys.stderr)
    return lib


def main() -> int:
    ap = tool_parser(__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(backward.VARIANTS))
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--kind", default="float16")
    ap.add_argument("--loops", action="store_true", help="print each kernel's SASS loops")
    ap.add_argument("--flex", action="store_true", help="the block-mask plans (flex_plan)")
    a = ap.parse_args()
    lib = nvrtc_or_report()
    if lib is None:
        return 2
    rows = []
    for var in a.variants.split(","):
        for d in (int(x) for x in a.head_dims.split(",")):
            pick = backward.flex_plan if a.flex else backward.backward_plan
            plan = pick(a.kind, d, d, variant=var)
            assert plan is not None
            for name, thr, smem in ((plan.dkdv, plan.dkdv_threads, plan.dkdv_smem),
                                    (plan.dq, plan.dq_threads, plan.dq_smem)):  # fmt: skip
                rows.append((var, d, name, thr, smem))
    names = sorted({r[2] for r in rows})
    # one program per file: v4's dK/dV kernel from attn_bwd_v4.cu, the rest from v3's file
    groups: dict[str, list[str]] = {}
    for n in names:
        v4 = backward.kernel_file(n) == backward.SOURCE_V4
        src = backward.SOURCE_V4 if v4 else backward.SOURCE_V3
        groups.setdefault(src, []).append(n)
    lowered: dict[str, str] = {}
    res = sass = ""
    with tempfile.TemporaryDirectory() as tmp:
        for src, group in groups.items():
            blob, low = cubin(lib, group, src)
            lowered.update(low)
            path = Path(tmp) / f"{src}.cubin"
            path.write_bytes(blob)
            res += subprocess.run([a.cuobjdump, "-res-usage", str(path)], capture_output=True,
                                  text=True, check=True).stdout  # fmt: skip
            sass += subprocess.run([a.nvdisasm, "-c", str(path)], capture_output=True,
                                   text=True, check=True).stdout  # fmt: skip
    regs = {}
    for fn, r in re.findall(r"Function (\S+):\s*\n\s*REG:(\d+)", res):
        regs[fn] = int(r)
    print("| variant | D | kernel | threads | regs | spill instr | dyn smem KB | blocks/SM "
          "| HMMA | LDSM | BAR | MUFU | RED | instr/HMMA |")  # fmt: skip
    print("|" + "---|" * 14)
    for var, d, name, thr, smem in rows:
        mg = lowered[name]
        r = regs.get(mg, -1)
        per_block_regs = ((r + 7) // 8 * 8) * thr
        blocks = min(65536 // max(per_block_regs, 1), (227 * 1024) // max(smem + 1024, 1),
                     2048 // thr, 32)  # fmt: skip
        s = sass_counts(sass, mg)
        print(
            f"| {var} | {d} | `{name}` | {thr} | {r} | {s.get('spill')} | {smem / 1024:.1f} "
            f"| {blocks} | {s.get('hmma', '-')} | {s.get('ldsm', '-')} | {s.get('bar', '-')} "
            f"| {s.get('mufu', '-')} | {s.get('red', '-')} | {s.get('per_hmma', 0):.2f} |"
        )
        if a.loops:
            for lp in sass_loops(sass, mg):
                print(
                    f"    loop [{lp[0]}, {lp[1]}]: {lp[2]} instructions, {lp[3]} HMMA, "
                    f"{lp[4]} LDSM per iteration (inner loops excluded)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
