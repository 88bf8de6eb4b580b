"""The CUDA dropout hash (arrayattn/attention/cuda/common.cuh) against the Python one.

The hash is plain integer code marked ``__host__ __device__``; a tiny host program built
with g++ (or nvcc) calls it over many indices and the bits must equal
:func:`arrayattn.attention.dropout.dropout_bits` exactly. No GPU is needed.
"""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from arrayattn.attention.dropout import dropout_bits, dropout_threshold

_HOST_PROGRAM = r"""
#include <cstdio>
#include "common.cuh"
int main() {
    unsigned int seed; int n;
    if (std::scanf("%u %d", &seed, &n) != 2) return 2;
    for (int k = 0; k < n; ++k) {
        int b, h, r, c;
        if (std::scanf("%d %d %d %d", &b, &h, &r, &c) != 4) return 3;
        // Both entry points: the one-shot hash and the staged (prefix/row/col) one the
        // kernels use must agree.
        unsigned int one = aa_drop_bits(seed, b, h, r, c);
        unsigned int staged = aa_drop_bits_rc(aa_drop_row(aa_drop_prefix(seed, b, h), r), c);
        if (one != staged) return 4;
        std::printf("%u\n", one);
    }
    return 0;
}
"""


def _compiler() -> list[str] | None:
    if shutil.which("g++"):
        return ["g++", "-O1", "-std=c++17", "-x", "c++"]
    if shutil.which("nvcc"):
        return ["nvcc", "-O1", "-std=c++17", "-x", "cu"]
    return None


@pytest.fixture(scope="module")
def host_hash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cmd = _compiler()
    if cmd is None:
        pytest.skip("neither g++ nor nvcc is available to build the host hash program")
    work = tmp_path_factory.mktemp("hash")
    src = work / "hash_main.cpp"
    src.write_text(_HOST_PROGRAM)
    include = resources.files("arrayattn.attention.cuda")
    exe = work / "hash_main"
    subprocess.run(
        cmd + [str(src), "-I", str(include), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    return exe


def _run(exe: Path, seed: int, idx: np.ndarray) -> np.ndarray:
    lines = [f"{seed} {len(idx)}"] + [" ".join(str(int(v)) for v in row) for row in idx]
    res = subprocess.run(
        [str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
    )
    return np.array([int(x) for x in res.stdout.split()], dtype=np.int64)


def _python_bits(seed: int, idx: np.ndarray) -> np.ndarray:
    import array_api_compat.numpy as xp

    cols = [np.asarray(idx[:, k], dtype=np.int32) for k in range(4)]
    return np.asarray(dropout_bits(xp, seed, *cols), dtype=np.int64)


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 123456789])
def test_cuda_hash_matches_python(host_hash: Path, seed: int) -> None:
    rng = np.random.default_rng(seed % 1000)
    small = rng.integers(0, 64, size=(1500, 4))
    large = rng.integers(0, 2**31 - 1, size=(500, 4))  # indices using the high 15 bits
    edges = np.array(
        [[0, 0, 0, 0], [2**16 - 1, 2**16, 2**16 + 1, 2**31 - 1], [1, 0, 0, 0], [0, 0, 0, 1]]
    )
    idx = np.concatenate([small, large, edges])
    got = _run(host_hash, seed, idx)
    want = _python_bits(seed, idx)
    np.testing.assert_array_equal(got, want)
    assert got.min() >= 0 and got.max() < 2**24


def test_hash_is_not_trivial(host_hash: Path) -> None:
    # A test that cannot fail is a defect: neighbouring columns must differ, and the keep
    # rate at p = 0.5 must be near one half.
    idx = np.array([[0, 0, 3, j] for j in range(4000)])
    bits = _run(host_hash, 42, idx)
    assert len(np.unique(bits)) > 3900
    keep = bits >= dropout_threshold(0.5)
    assert 0.45 < keep.mean() < 0.55
