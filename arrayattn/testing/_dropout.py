"""Dropout of a function that takes no seed (PyTorch's signature): its mask is random, so
its output cannot be compared with arrayattn's seed-defined mask. What holds for every
correct mask is checked instead.

The calls use the identity as ``value`` (``S x S``, so output entry ``(i, j)`` is
``P[i, j] * keep[i, j] / (1 - p)``: the output shows the mask), random query and key,
and ``p`` of 0.2, 0.5 and 0.9:

- ``p = 0`` gives the output without dropout (random values, against the reference);
- the keep rate is ``1 - p`` (Hoeffding's bound over every entry);
- output rows sum to 1 on average (Bernstein's bound over every row): the output's mean
  over calls is the output without dropout, also close to ``p = 1``;
- kept entries are ``P / (1 - p)``: the ``1 / (1 - p)`` scaling;
- gradients, when the adapter gives them from the same forward pass, match the mask
  the output shows.

The statistical bounds fail a correct function with probability below ``FALSE_ALARM``
each, whatever its random generator draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ._backends import Backend
from ._calls import AttentionCall
from ._compare import assert_attention_close, naive_attention, round_to_dtype
from ._watch import watch
from .adapters import Adapter, Grads, NotExpressible
from .oracles import reference_attention

__all__ = ["CHECKS", "SeedlessOutcome", "check_dropout_without_seed", "preferred_dtype"]

DROPOUT_PS = (0.2, 0.5, 0.9)
CALLS_PER_P = 4
P_ZERO_CALLS = 3
GRADIENT_P = 0.5
# (B, H, L, S): with S x S identity values the head dims are S too (some functions need
# the value head dim to equal the key's). 16 384 entries and 1 024 rows per p.
SHAPE = (2, 4, 32, 16)
# Probability that a correct function fails one statistical bound.
FALSE_ALARM = 1e-9

CHECKS = {
    "p_zero": "p = 0 gives the output without dropout",
    "keep_rate": "keep rate 1 - p",
    "row_mean": "output mean unbiased",
    "scaling": "kept entries scaled by 1/(1 - p)",
    "gradients": "gradients match the mask the output shows",
}


@dataclass
class Sample:
    """One call with identity values, its probabilities without dropout, its output."""

    call: AttentionCall
    p: float
    probs: np.ndarray
    out: np.ndarray


@dataclass
class SeedlessOutcome:
    """What the seedless checks found.

    Attributes:
        checks: description -> ``"passed"`` or ``"failed"``, for the checks that ran.
        calls: calls made to the function.
        failure: the failed check's message, or ``None``.
        call: the call it failed on.
        not_checkable: why no check could run (the adapter cannot express the calls).
    """

    checks: dict[str, str]
    calls: int
    failure: str | None = None
    call: AttentionCall | None = None
    not_checkable: str | None = None


@dataclass
class _Session:
    adapter: Adapter
    backend: Backend
    dtype: str
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    calls: int = 0
    last_call: AttentionCall | None = None
    samples: list[Sample] | None = None

    def output(self, call: AttentionCall) -> np.ndarray:
        """``call``'s output through the adapter; inputs must stay unchanged."""
        self.calls += 1
        self.last_call = call
        watched = watch(call)
        out, _ = self.adapter.run(watched, self.backend, False)
        watched.assert_unchanged()
        return out

    def forward_backward(self, call: AttentionCall, d_out: np.ndarray) -> tuple[np.ndarray, Grads]:
        assert self.adapter.forward_backward is not None
        self.calls += 1
        self.last_call = call
        watched = watch(call)
        out, grads = self.adapter.forward_backward(watched, self.backend, d_out)
        watched.assert_unchanged()
        return out, grads

    def identity_samples(self) -> list[Sample]:
        """``CALLS_PER_P`` identity-value calls at each p (made once, shared by checks)."""
        if self.samples is None:
            self.samples = []
            for p in DROPOUT_PS:
                for _ in range(CALLS_PER_P):
                    call = _identity_call(self, p)
                    self.samples.append(Sample(call, p, _probs(call), self.output(call)))
        return self.samples


def check_dropout_without_seed(adapter: Adapter, backend: Backend) -> SeedlessOutcome:
    """Run the seedless dropout checks (module docstring) on ``adapter``'s function.

    Stops at the first failing check; a check the adapter cannot express
    (:class:`~arrayattn.testing.adapters.NotExpressible`) makes the row not checkable.

    Examples:
        >>> import numpy as np
        >>> from arrayattn.testing import make_backend
        >>> from arrayattn.testing.adapters import for_function
        >>> def plain(query, key, value, dropout_p=0.0):  # drops nothing: wrong
        ...     s = query @ np.swapaxes(key, -1, -2) / np.sqrt(query.shape[-1])
        ...     e = np.exp(s - s.max(-1, keepdims=True))
        ...     return e / e.sum(-1, keepdims=True) @ value
        >>> found = check_dropout_without_seed(for_function(plain), make_backend("numpy"))
        >>> found.checks
        {'p = 0 gives the output without dropout': 'passed', 'keep rate 1 - p': 'failed'}
    """
    session = _Session(adapter, backend, preferred_dtype(adapter, backend))
    steps: list[tuple[str, Callable[[_Session], None]]] = [
        ("p_zero", _check_p_zero),
        ("keep_rate", _check_keep_rate),
        ("row_mean", _check_row_mean),
        ("scaling", _check_scaling),
    ]
    # The kit has a float64 backward only; low precision has no tolerance rule for it.
    if adapter.forward_backward is not None and session.dtype in ("float32", "float64"):
        steps.append(("gradients", _check_gradients))
    checks: dict[str, str] = {}
    for key, step in steps:
        try:
            step(session)
        except NotExpressible as exc:
            return SeedlessOutcome(checks, session.calls, not_checkable=str(exc))
        except AssertionError as exc:
            checks[CHECKS[key]] = "failed"
            message = str(exc).splitlines()[0]
            return SeedlessOutcome(checks, session.calls, message, session.last_call)
        except Exception as exc:  # the function under test raised
            checks[CHECKS[key]] = "failed"
            message = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            return SeedlessOutcome(checks, session.calls, message, session.last_call)
        checks[CHECKS[key]] = "passed"
    return SeedlessOutcome(checks, session.calls)


def preferred_dtype(adapter: Adapter, backend: Backend) -> str:
    """The dtype single calls to ``adapter`` use: float32 (else float64, else the
    adapter's first dtype) where the backend has it.

    Examples:
        >>> from arrayattn.testing import make_backend
        >>> from arrayattn.testing.adapters import arrayattn_sdpa
        >>> preferred_dtype(arrayattn_sdpa(), make_backend("numpy"))
        'float32'
    """
    preferred = [d for d in ("float32", "float64") if d in adapter.dtypes]
    for dtype in preferred + list(adapter.dtypes):
        if backend.dtype(dtype) is not None:
            return dtype
    return "float32"


def _random(session: _Session, shape: tuple[int, ...], spread: float = 1.0) -> np.ndarray:
    return round_to_dtype(session.rng.standard_normal(shape) * spread, session.dtype)


def _identity_call(session: _Session, p: float) -> AttentionCall:
    B, H, L, S = SHAPE
    # Small logits: every probability is well above 0, so a zero entry is a dropped one.
    q = _random(session, (B, H, L, S), 0.5)
    k = _random(session, (B, H, S, S), 0.5)
    v = np.broadcast_to(np.eye(S), (B, H, S, S)).copy()
    return AttentionCall(
        q, k, v, None, {"dropout_p": p}, session.dtype, frozenset({"dropout"}), session.backend
    )


def _probs(call: AttentionCall) -> np.ndarray:
    """``call``'s attention probabilities without dropout (float64)."""
    return reference_attention(call.query, call.key, call.value, return_probs=True)[2]


def _check_p_zero(session: _Session) -> None:
    B, H, L, S = SHAPE
    for _ in range(P_ZERO_CALLS):
        q = _random(session, (B, H, L, S))
        k = _random(session, (B, H, S, S))
        v = _random(session, (B, H, S, S))
        # dropout_p=0.0 passed explicitly: the function's own handling of p = 0.
        options = {"dropout_p": 0.0}
        call = AttentionCall(
            q, k, v, None, options, session.dtype, frozenset({"dropout"}), session.backend
        )
        out = session.output(call)
        expected = reference_attention(q, k, v)[0]
        baseline = None
        if session.dtype != "float64":  # FlashAttention's rule for low precision
            baseline = naive_attention(q, k, v, dtype=session.dtype)[0]
        assert_attention_close(
            out, expected, dtype=session.dtype, what="output at dropout_p=0", baseline=baseline
        )


def _hoeffding(n: int) -> float:
    """Half-width of the mean of ``n`` independent values in [0, 1] (Hoeffding)."""
    return math.sqrt(math.log(2 / FALSE_ALARM) / (2 * n))


def _bernstein(variance: float, spread: float, n: int) -> float:
    """Half-width of the mean of ``n`` independent values within ``spread`` of their
    mean, of average variance ``variance`` (Bernstein's inequality)."""
    log_term = math.log(2 / FALSE_ALARM)
    a = 2 * spread * log_term / 3
    return (a + math.sqrt(a * a + 8 * n * variance * log_term)) / (2 * n)


def _by_p(session: _Session) -> dict[float, list[Sample]]:
    groups: dict[float, list[Sample]] = {}
    for sample in session.identity_samples():
        groups.setdefault(sample.p, []).append(sample)
    return groups


def _check_keep_rate(session: _Session) -> None:
    for p, samples in _by_p(session).items():
        session.last_call = samples[0].call
        for s in samples:
            bad = ~np.isfinite(s.out)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                raise AssertionError(
                    f"dropout_p={p}: output {s.out[idx]} at index {idx} (must be finite)"
                )
        kept = sum(int(np.count_nonzero(s.out)) for s in samples)
        n = sum(s.out.size for s in samples)
        bound = _hoeffding(n)
        if abs(kept / n - (1 - p)) > bound:
            raise AssertionError(
                f"dropout_p={p}: {kept / n:.4f} of {n} output entries kept, expected "
                f"1 - p = {1 - p:.4g} within {bound:.3g} (Hoeffding's bound)"
            )


def _check_row_mean(session: _Session) -> None:
    for p, samples in _by_p(session).items():
        session.last_call = samples[0].call
        # Identity values: an output row is its probabilities after dropout, which sum
        # to 1 in expectation (every row of P sums to 1).
        rows = np.concatenate([s.out.sum(axis=-1).ravel() for s in samples])
        # A kept entry is P / (1 - p) with probability 1 - p: a row's variance is
        # p / (1 - p) * sum(P ** 2).
        squares = np.concatenate([(s.probs**2).sum(axis=-1).ravel() for s in samples])
        variance = p / (1 - p) * float(np.mean(squares))
        bound = _bernstein(variance, max(1.0, p / (1 - p)), rows.size)
        mean = float(rows.mean())
        if abs(mean - 1.0) > bound:
            raise AssertionError(
                f"dropout_p={p}: output rows (value = identity) sum to {mean:.4f} on average "
                f"over {rows.size} rows, expected 1 within {bound:.3g} (Bernstein's bound): "
                "the mean output is not the output without dropout"
            )


def _check_scaling(session: _Session) -> None:
    for s in session.identity_samples():
        session.last_call = s.call
        expected = s.probs * (s.out != 0) / (1 - s.p)
        assert_attention_close(
            s.out,
            expected,
            dtype=session.dtype,
            what=f"output at dropout_p={s.p} (kept entries must be P / (1 - p))",
        )


def _check_gradients(session: _Session) -> None:
    call = _identity_call(session, GRADIENT_P)
    d_out = _random(session, call.query.shape[:-1] + (call.value.shape[-1],))
    out, grads = session.forward_backward(call, d_out)
    expected = _grads_with_mask(call, out != 0, GRADIENT_P, d_out)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        assert_attention_close(
            got,
            want,
            dtype=session.dtype,
            what=f"{name} at dropout_p={GRADIENT_P} (with the mask the output shows)",
        )


def _grads_with_mask(
    call: AttentionCall, keep: np.ndarray, p: float, d_out: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` in float64 of plain attention with dropout mask ``keep``."""
    q, k, v = call.query, call.key, call.value
    scale = 1.0 / math.sqrt(q.shape[-1])
    probs = _probs(call)
    drop = keep / (1 - p)
    dv = np.swapaxes(probs * drop, -1, -2) @ d_out
    d_probs = (d_out @ np.swapaxes(v, -1, -2)) * drop
    d_scores = probs * (d_probs - np.sum(d_probs * probs, axis=-1, keepdims=True))
    dq = scale * d_scores @ k
    dk = scale * np.swapaxes(d_scores, -1, -2) @ q
    return dq, dk, dv
