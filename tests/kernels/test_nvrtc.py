"""Every kernel variant compiles under NVRTC exactly as ``cupy.RawModule`` compiles them
(every variant through NVRTC's front end, a sample of each source through to PTX).

``nvcc`` (``.ci/compile_kernels.py``) is more permissive than NVRTC: it accepts host
functions, includes the CUDA runtime headers implicitly, and so on. This test hands the
source the loader produces (``_loader.kernel_source``: local headers inlined) and every
name expression the compile check builds (the forward variants of
``.ci/compile_kernels.py``, ``backward.COMPILE_VARIANTS``, ``decode.COMPILE_VARIANTS``) to
NVRTC, with the loader's options, and checks that each name gets a lowered (mangled) name.
It caught a ``constexpr`` host function in a launch bound that nvcc accepts and NVRTC
rejects. No GPU is needed, only ``libnvrtc`` (the ``test`` extra installs the
``nvidia-cuda-nvrtc`` wheel on Linux x86-64; point ``ARRAYATTN_NVRTC`` at the library file
to use another). Skipped when it cannot be found.
"""

from __future__ import annotations

import ctypes

import _compile_check
import pytest
from _nvrtc import find_nvrtc, lowered_names

from arrayattn.attention.cuda import backward, decode, flex_pred, flex_variants, tiles


def _variants() -> dict[str, list[str]]:
    """Source file -> the name expressions .ci/compile_kernels.py compiles with nvcc."""
    mod = _compile_check.load()
    out = {mod.FWD: [name for name, *_ in mod.forward_variants()]}
    out.update(backward.COMPILE_VARIANTS)
    out.update(decode.COMPILE_VARIANTS)
    for source, names in tiles.COMPILE_VARIANTS.items():  # the forward's v2 (aa_fwd_tc2)
        out.setdefault(source, []).extend(names)
    return out


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    """libnvrtc, or the module's tests are skipped."""
    found = find_nvrtc()
    if found is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc, or set ARRAYATTN_NVRTC)")
    return found


@pytest.mark.parametrize(
    "source", ["attn_fwd.cu", "attn_bwd.cu", "attn_bwd_v3.cu", "attn_bwd_v4.cu", "decode_attn.cu"]
)
def test_every_variant_compiles_under_nvrtc(lib: ctypes.CDLL, source: str) -> None:
    names = _variants()[source]
    # attn_bwd_v3.cu: backward v3's dK/dV kernel only (float16, bfloat16 at head dim 64);
    # attn_bwd_v4.cu: v4's (float16, bfloat16 at head dims 64, 128), each also FLEX
    least = {"attn_bwd_v3.cu": 2, "attn_bwd_v4.cu": 8}.get(source, 20)
    assert len(names) >= least, names
    # Every name through NVRTC's front end, where its rejections of what nvcc accepts
    # come from (checked: a constexpr host function in a launch bound, a dependent
    # static_assert, an unannotated host call are each caught as in a full compile).
    for name, lowered in lowered_names(lib, source, names, syntax_only=True).items():
        assert lowered and lowered.startswith(b"_Z"), name


@pytest.mark.parametrize(
    "source", ["attn_fwd.cu", "attn_bwd.cu", "attn_bwd_v3.cu", "attn_bwd_v4.cu", "decode_attn.cu"]
)
def test_sample_variants_compile_to_ptx_under_nvrtc(lib: ctypes.CDLL, source: str) -> None:
    """The first and last variants of each source through all of NVRTC, PTX included
    (the rest of NVRTC's pipeline, NVVM, with the loader's options); .ci/compile_kernels.py
    builds every variant to SASS with nvcc."""
    names = _variants()[source]
    sample = list(dict.fromkeys([names[0], names[-1]]))
    for name, lowered in lowered_names(lib, source, sample).items():
        assert lowered and lowered.startswith(b"_Z"), name


@pytest.mark.parametrize("source", ["attn_fwd.cu", "attn_bwd.cu", "attn_bwd_v4.cu"])
def test_flex_predicate_variants_compile_under_nvrtc(lib: ctypes.CDLL, source: str) -> None:
    """One block-mask instantiation per kernel family with a generated predicate in front
    (flex_pred.sample_prelude: every built-in's code shape), as the loader compiles it."""
    names = flex_variants.compile_variants()[source]
    prelude = flex_pred.sample_prelude()
    for name, lowered in lowered_names(lib, source, names, prelude).items():
        assert lowered and lowered.startswith(b"_Z"), name
