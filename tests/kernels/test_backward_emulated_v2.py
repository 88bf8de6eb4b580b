# ruff: noqa: F811  (the library fixture is imported from test_backward_emulated)
"""The backward kernels' variant v2 (``aa_bwd_dkdv_mma2`` / ``aa_bwd_dq_mma2``,
``ARRAYATTN_BWD_VARIANT=v2``, the default) on the CPU through the host emulator, against
the float64 reference; v1's tests, the shared helpers and the race checks of both variants
are in ``test_backward_emulated.py``. A file of its own so that ``pytest -n auto --dist
loadfile`` runs it beside v1's (each is several minutes of emulation).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("_backward_emu")
pytest.importorskip("_tsan")
from test_backward_emulated import CASES, TOL, library, rel, run_case  # noqa: E402, F401

# -- variant v2 (aa_bwd_dkdv_mma2 / aa_bwd_dq_mma2) ----------------------------------------------
# The same option matrix as v1's, at E = 56, Ev = 64 (padded head dim 64: zero-padded
# columns, E != Ev) and at E = 120, Ev = 128 (head dim 128: 16-row register sub-steps).
V2_DIMS = {64: (56, 64), 128: (120, 128)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_v2_kernels_match_reference(library, kind, case, deterministic):
    E, Ev = V2_DIMS[64]
    got, ref, launch = run_case(
        library, kind, case, deterministic=deterministic, E=E, Ev=Ev, variant="v2"
    )
    names = [name for name, *_ in launch.launches]
    assert any("aa_bwd_dkdv_mma2<" in n for n in names), names
    assert deterministic == any("aa_bwd_dq_mma2<" in n for n in names), names
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL[kind], f"{name}: relative error {rel(g, r):.3g}"


@pytest.mark.parametrize(
    "case", ["plain", "v2_pipeline", "bool_mask_gqa", "window_softcap", "sinks_alibi"]
)
@pytest.mark.parametrize("deterministic", [False, True])
def test_v2_head_dim_128_matches_reference(library, case, deterministic):
    E, Ev = V2_DIMS[128]
    got, ref, launch = run_case(
        library, "float16", case, deterministic=deterministic, E=E, Ev=Ev, variant="v2"
    )
    assert any("aa_bwd_dkdv_mma2<AaF16, 128," in n for n, *_ in launch.launches)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: unwritten or non-finite elements"
        assert rel(g, r) <= TOL["float16"], f"{name}: relative error {rel(g, r):.3g}"


@pytest.mark.parametrize(
    "case,d", [("v2_pipeline", 64), ("bool_mask_gqa", 64), ("bool_mask_gqa", 128)]
)  # (v2_pipeline at 128, the slowest case, is covered against float64 above)
def test_v2_is_bitwise_v1_in_deterministic_mode(library, case, d):
    """v2 changes when data arrives, not the arithmetic: every MMA accumulates in v1's
    order (query rows in 16-row chunks, keys by block), so the deterministic gradients of
    both variants are the same bits."""
    E, Ev = V2_DIMS[d]
    kw = dict(deterministic=True, E=E, Ev=Ev)
    v1, _, l1 = run_case(library, "bfloat16", case, variant="v1", **kw)
    v2, _, l2 = run_case(library, "bfloat16", case, variant="v2", **kw)
    assert not any("mma2" in n for n, *_ in l1.launches)
    assert any("mma2" in n for n, *_ in l2.launches)
    for a, b in zip(v1, v2, strict=True):
        assert np.array_equal(a, b)
