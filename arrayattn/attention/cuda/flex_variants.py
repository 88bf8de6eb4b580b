"""The block-mask instantiations the compile checks build with a generated predicate
(``flex_pred.sample_prelude``) beside their bits-path builds: one per kernel family.

Its own module because it names kernels of both the forward (``tiles``) and the backward
(``backward``), which import the block table, which imports ``flex_pred``.
"""

from __future__ import annotations

from .backward import flex_plan
from .tiles import forward_kernel_name, forward_kernel_name_tf32

__all__ = ["compile_variants"]


def compile_variants() -> dict[str, list[str]]:
    """Source file -> one block-mask instantiation per kernel family, compiled with
    :func:`~arrayattn.attention.cuda.flex_pred.sample_prelude` by the compile checks: the
    forward's v1 (``aa_fwd_tc``), v2 (``aa_fwd_tc2``), v3 (``aa_fwd_tf32``) and CUDA-core
    (``aa_fwd_simt``) kernels, the backward's v2 (``mma2``) and CUDA-core (``simt``) dK/dV
    and dQ kernels, and v4's (``mma4``) dK/dV kernel."""
    fwd = [
        forward_kernel_name("float16", 128, False, False, 4),
        "aa_fwd_tc2<0, 64, false, 4, false>",
        forward_kernel_name_tf32(128, False, 4, False),
        forward_kernel_name("float32", 64, False, False, 4),
    ]
    bwd: list[str] = []
    for kind, d in (("float16", 64), ("float16", 128), ("float32", 64)):
        plan = flex_plan(kind, d, d, "v2")
        assert plan is not None
        bwd += [plan.dkdv, plan.dq]
    v4: list[str] = []  # v4's FLEX dK/dV kernel (its words: aa_bflex_word)
    for d in (64, 128):
        plan = flex_plan("float16", d, d, "v4")
        assert plan is not None
        v4.append(plan.dkdv)
    return {"attn_fwd.cu": fwd, "attn_bwd.cu": bwd, "attn_bwd_v4.cu": v4}
