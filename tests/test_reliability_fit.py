"""Requests that cannot fit, and sizes near integer limits (issue 35).

- The composed path works in row blocks: a call whose ``L x S`` scores exceed memory
  never allocates them. When even one row block, or the output itself, cannot fit in the
  memory the machine has free, it raises a ``MemoryError`` naming the sizes and the path
  to use instead, before allocating anything large (with Linux's overcommit a too-large
  allocation may "succeed" and the process is killed when it touches it).
- ``varlen_attention``: offsets near int32/int64/uint64 limits are compared, never
  subtracted first (differences wrap), whether or not ``max_seqlen`` is given; padded
  slot indices that overflow the offsets' dtype are computed in int64; padding that
  cannot fit is a ``MemoryError`` before it is allocated.
- ``q_lengths``/``kv_lengths`` at the dtype limits clip to ``[0, L]``/``[0, S]``; a
  sequence axis beyond int32 positions with lengths is a clear error.

Inputs far beyond memory are broadcast views (``np.broadcast_to``), which take none.
"""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

import arrayattn as aa
from arrayattn import _backend
from arrayattn.attention import composed
from arrayattn.attention.spec import make_spec
from arrayattn.ops import varlen

SDPA = aa.scaled_dot_product_attention


def _view(shape, dtype=np.float32):
    """An array of ``shape`` that takes no memory (every element the same 0.5)."""
    return np.broadcast_to(np.full((1,) * len(shape), 0.5, dtype), shape)


def _spec(q, k, v, **kw):
    return make_spec(q, k, v, None, 0.0, False, None, False, "top_left", None, None, None, **kw)


@pytest.fixture
def free_bytes(monkeypatch):
    """Pretend the machine has ``n`` bytes free: ``free_bytes(n)``."""

    def set_free(n: int) -> None:
        monkeypatch.setattr(_backend, "_host_available_bytes", lambda: n)

    return set_free


def test_available_memory_is_known_for_host_arrays_only():
    free = _backend.available_memory(_backend.resolve_namespace(np), "cpu")
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            total = int(next(x for x in f if x.startswith("MemTotal:")).split()[1]) * 1024
        assert free is not None and 0 < free <= total
    torch = pytest.importorskip("torch")
    xp = _backend.resolve_namespace(torch)
    assert _backend.available_memory(xp, torch.device("cpu")) is not None or free is None
    assert _backend.available_memory(xp, torch.device("cuda")) is None  # not host memory


def test_scores_far_beyond_memory_run_in_row_blocks():
    """L = S = 10**6: the full scores would take 4 TB; every row block's take about
    ROW_BLOCK_BYTES (at most twice: whole rows), and the call passes the memory check
    (it would run, for hours)."""
    n = 10**6
    q = _view((1, 1, n, 8))
    spec = _spec(q, q, q)
    blocks = composed.row_blocks(spec)
    largest = max((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks) * 4
    assert largest <= 2 * composed.ROW_BLOCK_BYTES
    assert sum(r1 - r0 for r0, r1, _, _ in blocks) == n
    composed.check_memory(spec)  # the output (32 MB) fits: no error


def test_composed_never_allocates_the_full_scores():
    """A call whose scores would take 256 MiB peaks at a few row blocks (8 MiB each)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 8192, 4)).astype(np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        out = SDPA(q, k, v, implementation="composed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    np.testing.assert_allclose(out, SDPA(q, k, v, implementation="chunked"), atol=1e-5)


def test_one_row_block_beyond_memory_is_a_memory_error_before_allocating():
    """One query row over 2**32 keys in 64 heads: a single row block's scores take 1 TiB,
    beyond any machine here; the error comes before anything large is allocated."""
    q = _view((1, 64, 1, 8))
    kv = _view((1, 64, 2**32, 8))
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError) as info:
            SDPA(q, kv, kv, implementation="composed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert "implementation='composed'" in msg and "row-block temporaries" in msg, msg
    assert "implementation='chunked'" in msg and "available" in msg, msg
    assert peak < 2**20, f"allocated {peak} bytes before the error"


def test_output_beyond_memory_is_a_memory_error_naming_the_output():
    q = _view((1, 64, 2**26, 64))  # the output alone: 1 TiB
    kv = _view((1, 64, 16, 64))
    with pytest.raises(MemoryError, match=r"output.*split the call"):
        SDPA(q, kv, kv, implementation="composed")


def test_backward_checks_its_gradients_too(free_bytes):
    """A call whose forward fits but whose gradients (2 GiB here) do not."""
    q = _view((1, 8, 2**15, 256))
    spec = _spec(q, q, q)
    free_bytes(2**30)
    composed.check_memory(spec)  # forward: 2 x 256 MiB output + blocks: fits
    with pytest.raises(MemoryError, match="gradients"):
        composed.check_memory(spec, backward=True)
    free_bytes(2**40)
    composed.check_memory(spec, backward=True)


def test_unknown_free_memory_checks_nothing(free_bytes):
    free_bytes(None)
    composed.check_memory(_spec(*(_view((1, 64, 2**16, 64)),) * 3), backward=True)


# -- varlen_attention ----------------------------------------------------------------------
X = np.random.default_rng(1).standard_normal((2, 5, 4)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("max_seqlen", [None, 4])
def test_varlen_offsets_that_wrap_are_rejected(dtype, max_seqlen):
    """[0, max, min, -1, 5]: every difference is >= 0 after it wraps (max - 0, min - max
    wraps to 1, -1 - min, 5 - -1), so subtracting first let it through and sized the
    padding by 2**31 or 2**63 positions."""
    info = np.iinfo(dtype)
    cu = np.array([0, info.max, info.min, -1, 5], dtype=dtype)
    with pytest.raises(ValueError, match=rf"cu_seqlens_q\[2\] = {info.min} after"):
        aa.varlen_attention(
            X, X, X, cu, np.array([0, 1, 2, 3, 5]), max_seqlen_q=max_seqlen, max_seqlen_k=4
        )


def test_varlen_unsigned_offsets_that_decrease_are_rejected():
    cu = np.array([0, 2**64 - 1, 5], dtype=np.uint64)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        aa.varlen_attention(X, X, X, np.array([0, 2, 5]), cu)


@pytest.mark.parametrize("cu", [[0, 2, 3, 2, 5], [1, 2, 5], [0, 2, 6]])
def test_varlen_bad_offsets_are_rejected_with_max_seqlen_given(cu):
    """Passing max_seqlen used to skip every check of the offsets (silently wrong)."""
    good = np.linspace(0, 5, len(cu)).astype(np.int64)
    with pytest.raises(ValueError, match="cu_seqlens_q must"):
        aa.varlen_attention(X, X, X, np.array(cu), good, max_seqlen_q=5, max_seqlen_k=5)


def test_varlen_offsets_at_the_dtype_limit_are_accepted():
    """Offsets of a narrow dtype used up to its maximum give the int64 call's result."""
    cu = np.array([0, 2, 5], dtype=np.int8)
    want = aa.varlen_attention(X, X, X, cu.astype(np.int64), cu.astype(np.int64))
    got = aa.varlen_attention(X, X, X, cu, cu)
    np.testing.assert_array_equal(got, want)
    assert varlen._index_dtype(np, cu, 2, 3, 5) == np.int8
    # 40,000 sequences padded to 100,000 positions: 4 * 10**9 slots need int64.
    assert varlen._index_dtype(np, np.zeros(1, np.int32), 40_000, 100_000, 10**6) == np.int64


def test_varlen_padding_beyond_memory_is_a_memory_error_before_allocating():
    """4096 one-token sequences and one of 2**20 tokens pad to 4097 x 2**20 positions."""
    n_short, long = 4096, 2**20
    total = n_short + long
    x = _view((8, total, 64))
    cu = np.concatenate([np.arange(n_short + 1), [total]])
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError, match=r"varlen_attention.*padded query"):
            aa.varlen_attention(x, x, x, cu, cu)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"allocated {peak} bytes before the error"


# -- q_lengths / kv_lengths ---------------------------------------------------------------
@pytest.mark.parametrize(
    "lengths, dtype, clipped",
    [
        ([np.iinfo(np.int64).min, np.iinfo(np.int64).max], "int64", [0, 5]),
        ([np.iinfo(np.int32).min, np.iinfo(np.int32).max], "int32", [0, 5]),
        ([np.iinfo(np.uint64).max, 0], "uint64", [5, 0]),
    ],
)
@pytest.mark.parametrize("which", ["q_lengths", "kv_lengths"])
def test_lengths_at_the_dtype_limits_clip(lengths, dtype, clipped, which):
    rng = np.random.default_rng(2)
    q, k = (rng.standard_normal((2, 1, 5, 4)) for _ in range(2))
    want = SDPA(q, k, k, **{which: np.array(clipped)}, implementation="composed")
    for impl in ("composed", "chunked", "fast"):
        got = SDPA(q, k, k, **{which: np.array(lengths, dtype=dtype)}, implementation=impl)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_lengths_with_a_sequence_axis_beyond_int32_is_a_clear_error():
    q = _view((1, 1, 1, 4))
    kv = _view((1, 1, 2**31, 4))
    with pytest.raises(ValueError, match=r"kv_lengths .* 2\*\*31 - 1 .* got 2147483648"):
        SDPA(q, kv, kv, kv_lengths=np.array([3]))
