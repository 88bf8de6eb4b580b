"""The Dask path's backward block task on CuPy chunks (the fused kernels), without Dask:
a block given its row's ``D = rowsum(dO * O)`` and no output (``_dask_tasks._row_delta``,
as the Dask backward builds it for rows with several key blocks) must return the gradients
of the block that reads the output and lets the kernel's preprocessing form ``D``.

On NumPy the two are bit for bit equal (``tests/test_dask_scale.py``). On CuPy the kernel
reduces ``dO * O`` in its own order, so they agree to rounding. The GPU machines have no
Dask, so the block is described here by hand; a CPU test checks that description against
the Dask plan's own. GPU tests skip without CuPy or a device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.attention.dask import tasks as _dask_tasks
from arrayattn.attention.dask.plan import _Block, _Call
from arrayattn.testing._compare import error_summary

ROWS, D = 256, 64


def _causal_block(rows: int, head_dim: int) -> _Block:
    """Block (query block 1, key block 0) of a causal self-attention over ``2 * rows``
    positions in blocks of ``rows``: a full block, one of two key blocks of its row."""
    call = _Call(
        dropout_p=0.0,
        scale=1.0 / math.sqrt(head_dim),
        enable_gqa=False,
        window=(-1, 0),
        softcap=None,
        seed=None,
        L=2 * rows,
        S=2 * rows,
        diagonal=0,
        per_sequence_diagonal=False,
        offset_bounds=None,
    )
    return _Block(call, batch_ids=(0,), head0=0, row0=rows, col0=0, partial_keys=True)


def test_the_hand_made_block_is_the_dask_plans():
    da = pytest.importorskip("dask.array")
    from arrayattn.attention.dask.plan import _plan
    from arrayattn.attention.spec import make_spec

    x = da.zeros((1, 2, 2 * ROWS, D), chunks=(1, 2, ROWS, D), dtype=np.float32)
    spec = make_spec(x, x, x, None, 0.0, True, None, False, "top_left", None, None, None)
    assert _plan(spec, x, x, x, None, "test").block((0,), 0, 1, 0) == _causal_block(ROWS, D)


@pytest.mark.gpu
@pytest.mark.parametrize("with_d_lse", [False, True])
@pytest.mark.parametrize(
    ("dtype", "tol"), [("float16", 1e-5), ("float32", 1e-5), ("float64", 1e-12)]
)
def test_rows_d_gives_the_blocks_own_gradients_on_cupy(dtype, tol, with_d_lse):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:  # no driver, no device
        pytest.skip(f"no CUDA device: {exc}")
    r = np.random.default_rng(5)
    q, k, v = (r.standard_normal((1, 2, 2 * ROWS, D)).astype(dtype) for _ in range(3))
    out, lse = aa.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    out_i, lse_i = out[:, :, ROWS:], lse[:, :, ROWS:]
    d_out = r.standard_normal(out_i.shape).astype(dtype)
    d_lse = r.standard_normal(lse_i.shape).astype(lse_i.dtype) if with_d_lse else None
    host = (q[:, :, ROWS:], k[:, :, :ROWS], v[:, :, :ROWS], None, out_i, lse_i, d_out, d_lse)
    dev = tuple(None if a is None else cupy.asarray(a) for a in host)
    blk = _causal_block(ROWS, D)

    own = _dask_tasks._backward_block(None, blk, *dev, None, None)
    delta = _dask_tasks._row_delta(dev[4], dev[6])
    given = _dask_tasks._backward_block(
        None, blk, *dev[:4], None, *dev[5:], None, None, None, None, delta
    )
    on_numpy = _dask_tasks._backward_block(None, blk, *host, None, None)
    for name, a, b, c in zip(("dq", "dk", "dv"), own, given, on_numpy, strict=False):
        a, b = cupy.asnumpy(a), cupy.asnumpy(b)
        assert a.dtype == b.dtype == c.dtype, name
        assert all(np.isfinite(x).all() for x in (a, b, c)), name
        rel_given = error_summary(b, a)[2]  # relative Frobenius error
        assert rel_given <= tol, (name, rel_given)
        # The fused kernel's block against the NumPy fast path's, both in float32/64:
        # each within 1e-5 of float64 (issue 5's bound), so within 2e-5 of each other.
        rel_numpy = error_summary(a, c)[2]
        assert rel_numpy <= max(tol, 2e-5), (name, rel_numpy)
