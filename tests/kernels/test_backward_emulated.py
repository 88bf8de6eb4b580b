"""The backward kernels (``attn_bwd.cu``) run on the CPU through the host emulator.

The kernels' own source is compiled with g++ against ``backward_emulator.h`` (threads,
barriers, ``ldmatrix``/``mma.sync`` fragment semantics from the PTX ISA) and launched by
the same :func:`arrayattn.attention.cuda.backward.run_kernels` plan the CuPy path uses. Gradients
are compared with a plain float64 NumPy backward written below. Output buffers start as
NaN, so unwritten elements fail. No GPU is involved: this checks indexing, tiling,
fragment layouts, block skipping, GQA loops, lengths, dropout regeneration and the
deterministic/atomic schedules, and (built with ThreadSanitizer, below) that no two
threads touch the same shared memory without a barrier between them; not GPU timing or
the real ``ex2.approx``/tensor-core rounding.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention.cuda.backward import backward_plan, run_kernels

emu = pytest.importorskip("_backward_emu")
tsan = pytest.importorskip("_tsan")
reference = pytest.importorskip("_backward_reference").reference

pytestmark = pytest.mark.skipif(
    emu.compiler() is None or emu.cuda_include() is None,
    reason="needs g++ (C++20) and the CUDA headers (cuda_fp16.h) for the host emulator",
)


# -- dtype plumbing -------------------------------------------------------------------------
def to_kernel(x: np.ndarray, kind: str) -> np.ndarray:
    """float64 -> the kernel's storage (bfloat16 as uint16 bits, round to nearest even)."""
    if kind == "bfloat16":
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.astype(np.uint16)
    return np.ascontiguousarray(x, dtype={"float16": np.float16, "float32": np.float32,
                                          "float64": np.float64}[kind])  # fmt: skip


def from_kernel(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _names(plan) -> list[str]:
    return [n for n in (plan.preprocess, plan.dkdv, plan.dq, plan.convert) if n]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    names = []
    for kind in ("float64", "float32", "float16", "bfloat16"):
        for d in (32, 64):
            names += _names(backward_plan(kind, d, d, variant="v1"))
    # v2 (ARRAYATTN_BWD_VARIANT=v2): its own kernels at head dims 64 and 128.
    for kind in ("float16", "bfloat16"):
        for d in (64, 128):
            names += _names(backward_plan(kind, d, d, variant="v2"))
    names += _names(backward_plan("bfloat16", 128, 128, variant="v1"))  # v1 == v2 bits
    # test_backward_emulated_v2.py imports this fixture: one build for both files.
    return emu.build(sorted(set(names)), emu.shared_work(tmp_path_factory))


CASES = {
    "plain": dict(),
    "causal_gqa": dict(causal=True, Hq=4, Hkv=2),
    "bottom_right_lengths": dict(
        causal=True, align="bottom_right", q_lens=(37, 20), k_lens=(70, 11)
    ),
    "window_softcap": dict(window=(9, 3), softcap=2.5, Hq=3, Hkv=1),
    "dropout_dlse": dict(dropout_p=0.3, seed=1234, d_lse=True, causal=True),
    "bool_mask_gqa": dict(causal=True, Hq=4, Hkv=2, mask=True),
    "empty_rows": dict(
        causal=True, align="bottom_right", L=45, S=20, q_lens=(45, 3), k_lens=(0, 20)
    ),
    # gpt-oss sinks (only through the saved LSE) and ALiBi slopes (recomputed bias), with
    # GQA, bottom-right lengths, a sequence with no key (the sink alone) and dLSE.
    "sinks_alibi": dict(
        causal=True,
        align="bottom_right",
        Hq=4,
        Hkv=2,
        q_lens=(37, 20),
        k_lens=(70, 0),
        d_lse=True,
        sinks=True,
        alibi=True,
    ),
    # Small enough for ThreadSanitizer (one block spawns up to 256 OS threads), still
    # several query and key blocks (bottom-right: the last rows see both key blocks) with
    # ragged tails, causal skipping and a GQA group.
    # (With sinks and ALiBi, so their code runs under ThreadSanitizer too.)
    "race": dict(
        B=1, Hq=2, Hkv=1, L=37, S=70, causal=True, align="bottom_right", sinks=True, alibi=True
    ),
    # v2's pipeline: several 64-row query steps per key block (the prefetch of the next
    # block, and across the GQA group's heads), three key blocks of 128 with a ragged tail,
    # bottom-right causal skipping, lengths (a shorter second sequence), dropout, dLSE.
    # (One KV head with a group of two, for CI time: its slowest case; several KV heads
    # run in the smaller cases, causal_gqa and bool_mask_gqa.)
    "v2_pipeline": dict(
        Hq=2,
        Hkv=1,
        L=150,
        S=290,
        causal=True,
        align="bottom_right",
        q_lens=(150, 77),
        k_lens=(290, 140),
        dropout_p=0.2,
        seed=99,
        d_lse=True,
    ),
    # v2 under ThreadSanitizer: three query steps per head, two heads, two key blocks.
    "v2_race": dict(
        B=1,
        Hq=2,
        Hkv=1,
        L=150,
        S=140,
        causal=True,
        align="bottom_right",
        sinks=True,
        alibi=True,
    ),
}
V2_ONLY = ("v2_pipeline", "v2_race")
"""Cases sized for v2's tiles (128 keys, 64-row steps); the v1 tests skip them (slow)."""


def run_case(library, kind, case, *, deterministic, seed=0, E=24, Ev=32, variant="v1"):
    c = dict(
        B=2,
        Hq=2,
        Hkv=2,
        L=37,
        S=70,
        causal=False,
        align="top_left",
        window=(-1, -1),
        softcap=None,
        q_lens=None,
        k_lens=None,
        dropout_p=0.0,
        seed=0,
        d_lse=False,
        mask=False,
        sinks=False,
        alibi=False,
    )
    c.update(CASES[case])
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, L, S = c["B"], c["Hq"], c["Hkv"], c["L"], c["S"]
    q = rng.standard_normal((B, Hq, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    d_out = rng.standard_normal((B, Hq, L, Ev))
    d_lse = rng.standard_normal((B, Hq, L)) if c["d_lse"] else None
    # Round inputs to the kernel dtype first so the reference sees the same numbers.
    q, k, v, d_out = (from_kernel(to_kernel(x, kind), kind) for x in (q, k, v, d_out))
    q_lens = None if c["q_lens"] is None else np.asarray(c["q_lens"], np.int32)
    k_lens = None if c["k_lens"] is None else np.asarray(c["k_lens"], np.int32)
    scale = 1.0 / math.sqrt(E)
    # A random boolean mask per (batch, row, key), broadcast over heads (stride 0), with
    # some rows masked out entirely (empty rows through the mask alone).
    mask = None
    if c["mask"]:
        mask = rng.random((B, 1, L, S)) < 0.7
        mask[:, :, ::7] = False
    acc = np.float64 if kind == "float64" else np.float32
    sinks = rng.standard_normal((B, Hq)).astype(acc) if c["sinks"] else None
    alibi = None
    if c["alibi"]:
        alibi = (2.0 ** -np.arange(1.0, Hq + 1))[None, :] * (1.0 + np.arange(B))[:, None]
        alibi = alibi.astype(acc)
    opts = dict(scale=scale, softcap=c["softcap"], causal=c["causal"], align=c["align"],
                window=c["window"], q_lens=q_lens, k_lens=k_lens, dropout_p=c["dropout_p"],
                seed=c["seed"], mask=mask, sinks=sinks, alibi=alibi)  # fmt: skip
    out, lse, dq_ref, dk_ref, dv_ref = reference(q, k, v, d_out, d_lse, **opts)

    plan = backward_plan(kind, E, Ev, variant=variant)
    right = c["window"][1]
    if c["causal"]:
        right = 0 if right < 0 else min(right, 0)
    launch = emu.Launcher(library)
    dq, dk, dv = run_kernels(
        emu.PoisonXp,
        launch,
        plan,
        to_kernel(q, kind),
        to_kernel(k, kind),
        to_kernel(v, kind),
        to_kernel(out, kind),
        to_kernel(d_out, kind),
        np.ascontiguousarray(lse, dtype=acc),
        None if d_lse is None else np.ascontiguousarray(d_lse, dtype=acc),
        scale=scale,
        softcap=c["softcap"],
        bottom_right=c["align"] == "bottom_right",
        window=(c["window"][0], right),
        q_lens=q_lens,
        kv_lens=k_lens,
        seed=c["seed"],
        dropout_p=c["dropout_p"],
        mask=None if mask is None else mask.astype(np.uint8),
        mask_strides=(L * S, 0, S, 1),
        deterministic=deterministic,
        alibi=None if alibi is None else np.ascontiguousarray(alibi.reshape(-1)),
    )
    got = tuple(from_kernel(x, kind) for x in (dq, dk, dv))
    return got, (dq_ref, dk_ref, dv_ref), launch


TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-2, "bfloat16": 5e-2}


V1_CASES = [c for c in CASES if c not in V2_ONLY]


@pytest.mark.parametrize("case", V1_CASES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["float64", "float32"])
def test_simt_kernels_match_reference(library, kind, case, deterministic):
    got, ref, _ = run_case(library, kind, case, deterministic=deterministic)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL[kind], f"{name}: relative error {rel(g, r):.3g}"


@pytest.mark.parametrize("case", V1_CASES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_tensor_core_kernels_match_reference(library, kind, case, deterministic):
    got, ref, launch = run_case(library, kind, case, deterministic=deterministic)
    assert any("mma" in name for name, *_ in launch.launches)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL[kind], f"{name}: relative error {rel(g, r):.3g}"


def test_head_dim_64_vector_loads(library):
    """E = Ev = 64: the 16-byte load path of the tensor-core kernels and the D=64 tiles."""
    got, ref, _ = run_case(library, "float16", "causal_gqa", deterministic=False, E=64, Ev=64)
    for g, r in zip(got, ref, strict=True):
        assert rel(g, r) <= TOL["float16"]


def test_deterministic_mode_is_bit_identical(library):
    runs = [run_case(library, "float32", "causal_gqa", deterministic=True)[0] for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert np.array_equal(a, b)


# -- data races ---------------------------------------------------------------------------
# The emulator library built with ThreadSanitizer (see _tsan.py) and run in a child process
# that preloads libtsan. Nothing but the kernel's own barriers may order its threads: the
# barriers are emulator_barrier.h's, and the dQ atomics relaxed atomic_ref adds, as CUDA's
# atomicAdd is (seq_cst adds would order the threads and hide races).
def _plan_names(kind: str, variant: str = "v1") -> list[str]:
    """The instantiations of the race case: v1 at head dim 32, v2 at 64 (its smallest)."""
    d = 32 if variant == "v1" else 64
    return _names(backward_plan(kind, d, d, variant=variant))


def _run_under_tsan(
    lib: Path,
    kind: str,
    deterministic: bool,
    variant: str = "v1",
    eager: bool = False,
    skip_barrier: int | None = None,
) -> subprocess.CompletedProcess:
    """``_backward_tsan_run.py`` in a child with libtsan preloaded; ``eager``: cp.async
    copies land at issue (AA_EMU_EAGER=1), exposing a prefetch into a buffer still read;
    ``skip_barrier``: run a switchable build (``tsan.kernels_with_switchable_barriers``)
    without that barrier, stopping at the first report."""
    env = dict(os.environ, LD_PRELOAD=tsan.libtsan(emu.compiler() or "g++") or "")
    env.pop("AA_EMU_EAGER", None)
    env.pop(tsan.SKIP_BARRIER, None)
    # The float64 reference's matrix products at the v2 race case's sizes would start
    # OpenBLAS threads, whose own unsynchronised writes TSan reports (not the kernels').
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    if eager:
        env["AA_EMU_EAGER"] = "1"
    if skip_barrier is not None:
        env = tsan.skip_barrier_env(skip_barrier, env)
    script = Path(__file__).resolve().parent / "_backward_tsan_run.py"
    return subprocess.run(
        [sys.executable, str(script), str(lib), kind, str(int(deterministic)), variant],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


@pytest.fixture(scope="module")
def tsan_work(tmp_path_factory) -> Path:
    tsan.require_python_tsan(emu.compiler() or "g++")
    return tmp_path_factory.mktemp("bwd_tsan")


@pytest.mark.parametrize(
    "kind,deterministic,variant,eager",
    [
        ("float16", False, "v1", False),
        ("float16", True, "v1", False),
        ("float32", True, "v1", False),
        # v2: both dQ modes, both copy-landing modes, both 16-bit kinds, in two runs
        # (each TSan run of v2 takes about a minute here: CI time)
        ("float16", False, "v2", False),
        ("bfloat16", True, "v2", True),
    ],
)
def test_backward_kernels_have_no_data_race(
    tsan_work: Path, kind: str, deterministic: bool, variant: str, eager: bool
):
    lib = emu.compile_library(_plan_names(kind, variant), tsan_work, tsan.FLAGS)
    res = _run_under_tsan(lib, kind, deterministic, variant=variant, eager=eager)
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


def _barrier_sites() -> list[tuple[int, str, bool, str]]:
    """(occurrence, kind, deterministic, variant) that runs each ``__syncthreads();`` of
    attn_bwd.cu: float32 for the CUDA-core kernels, float16 for the tensor-core ones, v2's
    race case for v2's kernels; the atomic dQ schedule for the barrier of dK/dV's
    ``if (dq_acc)`` part, else the deterministic one (there the atomic part's own barrier
    would also cover the next step's reloads)."""
    src = (tsan.KERNELS / "attn_bwd.cu").read_text()
    tc_start = src.index("aa_bwd_dkdv_mma(")
    v2_start = src.index("aa_bwd_dkdv_mma2(")
    sites = []
    for i, pos in enumerate(tsan.barrier_offsets("attn_bwd.cu")):
        atomic_only = src[:pos].rstrip().endswith("if (dq_acc) {")
        kind = "float16" if pos > tc_start else "float32"
        sites.append((i, kind, not atomic_only, "v2" if pos > v2_start else "v1"))
    return sites


@pytest.fixture(scope="module")
def switchable_libraries(tsan_work: Path):
    """``(kind, variant) -> library``: one ThreadSanitizer build of the race case's
    instantiations from a copy of the kernels whose barriers ``AA_EMU_SKIP_BARRIER``
    switches off one at a time (built on first use, then shared by every site)."""
    kdir = tsan.kernels_with_switchable_barriers("attn_bwd.cu", tsan_work / "switchable")
    built: dict[tuple[str, str], Path] = {}

    def get(kind: str, variant: str) -> Path:
        if (kind, variant) not in built:
            names = _plan_names(kind, variant)
            built[kind, variant] = emu.compile_library(names, tsan_work, tsan.FLAGS,
                                                       kernels_dir=kdir)  # fmt: skip
        return built[kind, variant]

    return get


@pytest.mark.parametrize("site,kind,deterministic,variant", _barrier_sites())
def test_race_check_catches_every_missing_barrier(
    switchable_libraries, site: int, kind: str, deterministic: bool, variant: str
):
    """Deleting any one ``__syncthreads()`` of the backward kernels makes the race check
    fail. Every site is checked, each in a run of its own; the deletion is the switchable
    build run with ``AA_EMU_SKIP_BARRIER=site`` (one compile per kernel family instead of
    one per site: see ``_tsan.py``)."""
    lib = switchable_libraries(kind, variant)
    res = _run_under_tsan(lib, kind, deterministic, variant=variant, skip_barrier=site)
    assert tsan.REPORT in res.stderr, (
        f"barrier {site} removed ({kind} kernels), yet no race was reported"
    )


def test_switchable_build_skips_nothing_by_default(switchable_libraries):
    """Without ``AA_EMU_SKIP_BARRIER`` the switchable build is the kernels as written: no
    race, right gradients (so the reports above come from the skipped barrier alone)."""
    res = _run_under_tsan(switchable_libraries("float32", "v1"), "float32", True)
    assert tsan.REPORT not in res.stderr, res.stderr[:6000]
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


def test_simt_shared_memory_is_the_kernels_own(tmp_path):
    """The CUDA-core backward's shared memory, computed by ``backward_plan`` for the launch,
    equals ``AaBwdSimtSmem`` in ``attn_bwd.cu`` (the kernels' launch bounds): the Python
    figure is checked against the kernel source's, for every CUDA-core plan."""
    import re

    plans = []
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in (32, 64, 128, 256):
            plan = backward_plan(kind, d, d)
            if plan is not None and not plan.tensor_cores:
                plans.append(plan)
    assert plans
    exprs = []
    for plan in plans:
        # aa_bwd_dkdv_simt<T, Acc, HD, BN, BM, NT>
        args = re.search(r"<(.*)>", plan.dkdv).group(1).split(",")
        acc, hd, bn, bm = (a.strip() for a in args[1:5])
        exprs.append(f"AaBwdSimtSmem<{acc}, {hd}, {bn}, {bm}>::value")
    got = emu.host_ints(tmp_path, "attn_bwd.cu", exprs)
    assert got == [p.dkdv_smem for p in plans] == [p.dq_smem for p in plans]


def test_v2_shared_memory_is_the_kernels_own(tmp_path):
    """v2's launch sizes (``backward_plan``) equal ``AaBwdMma2Smem`` / ``AaBwdDqMma2Smem``,
    the layouts the kernels carve their dynamic shared memory into."""
    import re

    plans = [
        backward_plan(k, d, d, variant="v2") for k in ("float16", "bfloat16") for d in (64, 128)
    ]
    exprs = []
    for plan in plans:
        hd, nw, bm = (a.strip() for a in re.search(r"<(.*)>", plan.dkdv).group(1).split(",")[1:4])
        exprs.append(f"AaBwdMma2Smem<{hd}, {nw}, {bm}>::value")
        hd, nw, bn = (a.strip() for a in re.search(r"<(.*)>", plan.dq).group(1).split(",")[1:4])
        exprs.append(f"AaBwdDqMma2Smem<{hd}, {nw}, {bn}>::value")
    got = emu.host_ints(tmp_path, "attn_bwd.cu", exprs)
    assert got == [n for p in plans for n in (p.dkdv_smem, p.dq_smem)]
