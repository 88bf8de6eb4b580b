"""The Dask path on a ``dask.distributed`` cluster whose workers fail (issue 35).

One 2-worker cluster of processes (one thread each) serves the module:

- a worker process killed (``SIGKILL``) while a forward or a forward+backward graph runs:
  Dask recomputes the lost tasks on the survivor (and on the worker its nanny restarts)
  and the result is bit-identical to an undisturbed run;
- workers restarted between calls change nothing;
- (``KeyboardInterrupt`` while the client waits is in ``bench/interrupt_bench.py``'s
  ``dask-distributed`` scenario, run in a subprocess by test_reliability_interrupts.py);
- a block whose task cannot fit in a worker's ``memory_limit``: a ``MemoryError`` naming
  the sizes and the chunk size to choose, raised before the task allocates (without it,
  the nanny kills the worker, Dask retries the task on each worker in turn and the
  caller gets ``KilledWorker``).

The kill is made deterministic: a wrapper installed in the workers kills the first
worker that reaches its second block task of the graph, so the graph has surely started
and not finished. Every wait has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

import arrayattn as aa

distributed = pytest.importorskip("distributed")
da = pytest.importorskip("dask.array")

SDPA = aa.scaled_dot_product_attention
TIMEOUT_S = 90
rng = np.random.default_rng(35)
Q, K, V = (rng.standard_normal((1, 4, 512, 32)).astype(np.float32) for _ in range(3))
CHUNKS = (1, 2, 128, 32)  # 4 x 4 blocks per head chunk, 2 head chunks


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit="1GiB",
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        c.wait_for_workers(2, timeout=TIMEOUT_S)
        yield c


def _graphs(kind: str) -> list:
    q, k, v = (da.from_array(x, chunks=CHUNKS) for x in (Q, K, V))
    if kind == "forward":
        return [SDPA(q, k, v, is_causal=True, return_lse=True)[0]]
    out, pullback = aa.vjp(SDPA, q, k, v, is_causal=True)
    return [out, *pullback(da.ones_like(out))]


def _compute(client, kind: str) -> list[np.ndarray]:
    futures = client.compute(_graphs(kind))
    return client.gather(futures, errors="raise", direct=False) if futures else []


def _assert_same_results(got: list, want: list) -> None:
    """Every result bit for bit. (Until 2026-11-26 dQ and dK of a forward+backward could
    differ by a float32 ulp from run to run on a loaded machine: a cotangent chunk is a
    broadcast view where Dask makes it and a contiguous array where it arrives over the
    network, and NumPy ran products with the broadcast one outside BLAS. The fast path
    now lays such operands out for BLAS, ``fast.layout.blas_ready``.)"""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _kill_second_call(name: str, marker: str) -> None:
    """Runs in each worker: wrap the task function ``name`` so that the first worker to
    reach its second call (the marker file is created once) kills itself."""
    import os as _os
    import signal as _signal

    from arrayattn.attention.dask import tasks

    real = getattr(tasks, "_real_" + name, None) or getattr(tasks, name)
    setattr(tasks, "_real_" + name, real)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            try:
                fd = _os.open(marker, _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                _os.close(fd)
                _os.kill(_os.getpid(), _signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(tasks, name, wrapper)


def _unwrap(name: str) -> None:
    from arrayattn.attention.dask import tasks

    real = getattr(tasks, "_real_" + name, None)
    if real is not None:
        setattr(tasks, name, real)


@pytest.mark.parametrize(
    "kind, task", [("forward", "_forward_block"), ("forward+backward", "_backward_block")]
)
def test_worker_killed_mid_graph_gives_the_undisturbed_result(client, kind, task):
    want = _compute(client, kind)
    pids_before = set(client.run(os.getpid).values())
    marker = os.path.join(tempfile.mkdtemp(), "killed")
    client.run(_kill_second_call, task, marker)
    try:
        futures = client.compute(_graphs(kind))
        distributed.wait(futures, timeout=TIMEOUT_S)  # raises TimeoutError on a hang
        got = client.gather(futures)
    finally:
        client.run(_unwrap, task, on_error="return")  # (a worker may be restarting)
    assert os.path.exists(marker), "no worker was killed: the graph ran too few tasks"
    client.wait_for_workers(2, timeout=TIMEOUT_S)  # the nanny restarted the killed one
    assert set(client.run(os.getpid).values()) != pids_before
    _assert_same_results(got, want)


def test_restarted_workers_change_nothing(client):
    want = _compute(client, "forward+backward")
    client.restart(timeout=TIMEOUT_S, wait_for_workers=True)
    got = _compute(client, "forward+backward")
    _assert_same_results(got, want)
    local = aa.vjp(SDPA, Q, K, V, is_causal=True)
    np.testing.assert_allclose(got[0], local[0], rtol=1e-5, atol=1e-5)


def test_block_beyond_the_worker_memory_limit_is_a_clear_error(client):
    # Broadcast views: chunks of 512 MiB that take no memory, so that nothing is
    # allocated before the task's own check.
    big = da.broadcast_to(da.ones((1, 1, 1, 1024), dtype=np.float32), (1, 1, 2**17, 1024))
    out = SDPA(big, big, big)
    with pytest.raises(MemoryError, match=r"memory limit.*rechunk the sequence axis"):
        client.compute(out).result(timeout=TIMEOUT_S)
    # The workers were not killed and serve the next call.
    np.testing.assert_array_equal(_compute(client, "forward")[0], _compute(client, "forward")[0])
