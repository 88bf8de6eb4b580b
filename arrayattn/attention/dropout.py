"""Seed-defined dropout masks, identical on every backend.

The keep/drop decision for attention probability ``(b, h, i, j)`` is a pure function of
``(seed, b, h, i, j)``, computed with int32 array-API operations only. Nothing is stored
between forward and backward: the backward pass (and any kernel) regenerates the mask.

The hash is a 32-bit Feistel permutation on two 16-bit halves. Every intermediate value
stays below 2**31, so it is exact in int32 on every library (the standard leaves integer
overflow unspecified, and JAX without x64 has no int64). The same arithmetic is written in
CUDA C++ in ``arrayattn/attention/cuda`` and must stay bit-identical to this file.

Algorithm (all values are non-negative int32, ``& 0xFFFF`` keeps 16 bits)::

    round(x, k) = (((x ^ k) * 0x6F4B) >> 7 & 0xFFFF) ^ (x >> 5)
    permute(a, b): for r in 0..3: a, b = b, a ^ round(b, ROUND_KEYS[r])
    absorb(a, b, v): a ^= v & 0xFFFF; b ^= (v >> 16) & 0x7FFF; permute(a, b)
    state = permute(seed & 0xFFFF, (seed >> 16) & 0xFFFF)
    for v in (batch, head, row, col): state = absorb(state, v)
    state = permute(state)                # finaliser: neighbouring cols decorrelate
    bits24 = (a << 8) | (b >> 8)          # uniform in [0, 2**24)
    keep = bits24 >= round(p * 2**24)
"""

from __future__ import annotations

from .._backend import Array, Namespace

__all__ = ["dropout_bits", "dropout_keep", "dropout_threshold", "normalize_seed", "ROUND_KEYS"]

_MASK16 = 0xFFFF
_MULTIPLIER = 0x6F4B  # < 2**15, so (16-bit value) * multiplier < 2**31
ROUND_KEYS = (0x3C6E, 0xB7E1, 0x9E37, 0x5851)
_SEED_MODULUS = 2**32


def normalize_seed(seed: int) -> int:
    """Reduce a Python integer seed to the 32 bits the mask depends on.

    Raises ``TypeError`` for anything but an integer (``bool`` included)."""
    if isinstance(seed, bool):  # operator.index(True) would pass
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(seed, int):
        try:
            import operator

            seed = operator.index(seed)  # numpy integers
        except TypeError:
            raise TypeError(f"seed must be an int, got {type(seed).__name__}") from None
    return int(seed) % _SEED_MODULUS


def _round(x: Array | int, key: int) -> Array | int:
    return ((((x ^ key) * _MULTIPLIER) >> 7) & _MASK16) ^ (x >> 5)


def _permute(a: Array | int, b: Array | int) -> tuple[Array | int, Array | int]:
    for key in ROUND_KEYS:
        a, b = b, a ^ _round(b, key)
    return a, b


def _absorb(a: Array | int, b: Array | int, v: Array) -> tuple[Array, Array]:
    return _permute(a ^ (v & _MASK16), b ^ ((v >> 16) & 0x7FFF))


def dropout_bits(
    xp: Namespace, seed: int, batch: Array, head: Array, row: Array, col: Array
) -> Array:
    """24 uniform random bits (int32 in ``[0, 2**24)``) per ``(batch, head, row, col)``.

    ``batch``, ``head``, ``row`` and ``col`` are non-negative int32 index arrays that
    broadcast together; the result has their broadcast shape. Absorbing the indices in
    this order lets broadcasting do the cheap work on small arrays first.
    """
    s = normalize_seed(seed)
    a, b = _permute(s & _MASK16, (s >> 16) & _MASK16)  # Python ints: free
    a, b = _absorb(a, b, batch)
    a, b = _absorb(a, b, head)
    a, b = _absorb(a, b, row)
    a, b = _absorb(a, b, col)
    a, b = _permute(a, b)
    return (a << 8) | (b >> 8)


def dropout_threshold(p: float) -> int:
    """The integer threshold on :func:`dropout_bits`: an element is kept when its bits are
    ``>= dropout_threshold(p)``, so it is kept with probability ``1 - threshold / 2**24``."""
    return int(round(p * (1 << 24)))


def dropout_keep(
    xp: Namespace,
    seed: int,
    p: float,
    batch: Array,
    head: Array,
    row: Array,
    col: Array,
) -> Array:
    """Boolean keep-mask for dropout probability ``p`` at the given indices.

    Examples:
        >>> import numpy as np, array_api_compat
        >>> xp = array_api_compat.array_namespace(np.empty(0))
        >>> i = xp.reshape(xp.arange(4, dtype=xp.int32), (4, 1))
        >>> j = xp.arange(6, dtype=xp.int32)
        >>> zero = xp.zeros((), dtype=xp.int32)
        >>> dropout_keep(xp, 0, 0.5, zero, zero, i, j).shape
        (4, 6)
    """
    return dropout_bits(xp, seed, batch, head, row, col) >= dropout_threshold(p)
