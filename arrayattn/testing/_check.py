"""``check_attention``: a conformance battery for any attention function, one row per
feature, each a hypothesis search that shrinks a failure to a minimal example."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ._backends import Backend, make_backend
from ._calls import FEATURE_DOCS, FEATURES, AttentionCall
from ._compare import assert_attention_close, naive_attention
from .adapters import Adapter, NotExpressible, for_function

__all__ = ["check_attention", "check_call", "ConformanceReport", "FeatureResult"]

PASSED, FAILED, UNSUPPORTED, CONVENTION = "passed", "failed", "not supported", "convention"
EMPTY_ROW_MECHANISMS = ("bool_mask", "float_mask", "lengths", "causal_bottom_right")
# Options a gradient check exercises besides plain attention (where supported).
GRADIENT_OPTIONS = (
    "gqa",
    "scale",
    "float_mask",
    "causal_top_left",
    "causal_bottom_right",
    "softcap",
    "sinks",
    "alibi",
)


@dataclass
class FeatureResult:
    """One row of a :class:`ConformanceReport`."""

    feature: str
    status: str  # "passed", "failed", "not supported" or "convention"
    detail: str = ""
    example: dict[str, Any] | None = None  # the minimal failing call, when failed
    examples_run: int = 0
    skipped: int = 0  # drawn calls the adapter could not express
    left_out: int = 0  # calls with fully masked rows, left out under a convention


@dataclass
class ConformanceReport:
    """What :func:`check_attention` found: one :class:`FeatureResult` per feature.

    ``str(report)`` (or :meth:`table`) is a fixed-width table; :meth:`to_json` the same
    as JSON. ``report.ok`` is True when nothing failed.

    Examples:
        >>> from arrayattn.testing import ConformanceReport, FeatureResult
        >>> r = ConformanceReport("f", "numpy", [FeatureResult("basic", "passed")])
        >>> r.ok, r.status("basic")
        (True, 'passed')
    """

    name: str
    backend: str
    rows: list[FeatureResult]
    notes: list[str] = field(default_factory=list)
    dtypes: tuple[str, ...] = ()
    examples: int = 0

    @property
    def ok(self) -> bool:
        return all(r.status != FAILED for r in self.rows)

    def status(self, feature: str) -> str:
        """The status of ``feature``'s row."""
        for r in self.rows:
            if r.feature == feature:
                return r.status
        raise KeyError(f"no row for feature {feature!r}")

    def row(self, feature: str) -> FeatureResult:
        """``feature``'s row."""
        for r in self.rows:
            if r.feature == feature:
                return r
        raise KeyError(f"no row for feature {feature!r}")

    def failures(self) -> list[FeatureResult]:
        return [r for r in self.rows if r.status == FAILED]

    def table(self) -> str:
        """The report as a fixed-width text table (details of failures below it)."""
        head = (
            f"{self.name} on {self.backend} ({', '.join(self.dtypes)}; "
            f"up to {self.examples} examples per feature)"
        )
        width = max(len(r.feature) for r in self.rows) if self.rows else 7
        lines = [head, "", f"{'feature':<{width}}  {'status':<13}  detail"]
        lines.append(f"{'-' * width}  {'-' * 13}  {'-' * 40}")
        for r in self.rows:
            detail = r.detail if r.status != PASSED else f"{r.examples_run} examples checked"
            if r.status == PASSED and r.skipped:
                detail += f"; {r.skipped} not expressible, skipped"
            if r.status == PASSED and r.left_out:
                detail += f"; {r.left_out} with fully masked rows left out"
            lines.append(f"{r.feature:<{width}}  {r.status:<13}  {detail}")
        for r in self.rows:
            if r.example is not None:
                lines += ["", f"[{r.feature}] minimal failing example: {r.example['call']}"]
                lines.append(f"    {r.example['error']}")
        if self.notes:
            lines += ["", "conventions bridged by the adapter (not failures):"]
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "dtypes": list(self.dtypes),
            "examples": self.examples,
            "ok": self.ok,
            "notes": list(self.notes),
            "rows": [asdict(r) for r in self.rows],
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON (``json.dumps`` keyword arguments pass through)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)


def _lse_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def check_call(adapter: Adapter, backend: Backend, call: AttentionCall) -> None:
    """Run one call through ``adapter`` and compare output, LSE (when the call asks for
    it) and gradients (likewise) with the float64 reference; raises ``AssertionError``
    on a mismatch, :class:`~arrayattn.testing.adapters.NotExpressible` when the adapter
    cannot make the call.

    Examples:
        >>> from arrayattn.testing import AttentionCall, check_call, make_backend
        >>> from arrayattn.testing.adapters import arrayattn_sdpa
        >>> import numpy as np
        >>> c = AttentionCall(np.ones((1, 1, 2, 4)), np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)))
        >>> check_call(arrayattn_sdpa(), make_backend("numpy"), c)
    """
    want_lse = "lse" in call.features
    out, lse = adapter.run(call, backend, want_lse)
    expected, expected_lse = call.reference()
    baseline = baseline_lse = None
    if call.dtype != "float64":
        args = (call.query, call.key, call.value, call.attn_mask)
        baseline, baseline_lse = naive_attention(*args, dtype=call.dtype, **call.options)
    assert_attention_close(out, expected, dtype=call.dtype, what="output", baseline=baseline)
    if want_lse:
        if lse is None:
            raise AssertionError("lse: the function returned none")
        # Low-precision calls: FlashAttention's rule for the LSE too (JAX returns it in the
        # input dtype; the contract's float32 LSE passes the rule with room to spare).
        assert_attention_close(
            lse,
            expected_lse,
            dtype=_lse_dtype(call.dtype) if baseline is None else call.dtype,
            what="lse",
            baseline=baseline_lse,
        )
    # Gradients are compared in float32/float64 only: the kit has no naive low-precision
    # backward to set FlashAttention's rule for them.
    if (
        "gradients" in call.features
        and adapter.vjp is not None
        and call.dtype in ("float32", "float64")
    ):
        rng = np.random.default_rng(0)
        d_out = rng.standard_normal(expected.shape)
        from ._compare import round_to_dtype

        d_out = round_to_dtype(d_out, call.dtype)
        got = adapter.vjp(call, backend, d_out)
        ref = call.reference_vjp(d_out)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref[:3], strict=True):
            assert_attention_close(g, r, dtype=call.dtype, what=name)


def _row_features(feature: str, supports: frozenset[str]) -> tuple[set[str], set[str]] | None:
    """``(allowed, required)`` features of the calls a row draws, or ``None`` when the
    row cannot run (a feature it needs is unsupported)."""
    if feature == "basic":
        return set(), set()
    if feature == "combined":
        return set(supports) - {"zero_length"}, set()
    if feature == "empty_rows":
        for mech in EMPTY_ROW_MECHANISMS:
            if mech in supports:
                return {"empty_rows", mech}, {"empty_rows"}
        return None
    if feature == "gradients":
        return {"gradients"} | (set(GRADIENT_OPTIONS) & supports), {"gradients"}
    if feature == "adversarial":
        return {"adversarial"} | ({"low_precision"} & supports), {"adversarial"}
    return {feature}, {feature}


def check_attention(
    fn: Callable[..., Any] | None = None,
    *,
    layout: str = "BHLD",
    supports: Iterable[str] | None = None,
    xp: str | Backend = "numpy",
    examples: int = 20,
    adapter: Adapter | None = None,
    features: Iterable[str] | None = None,
    dtypes: Iterable[str] | None = None,
    max_len: int = 8,
) -> ConformanceReport:
    """Check an attention function against arrayattn's semantics, feature by feature.

    For each feature (rows of :data:`~arrayattn.testing.FEATURES`) hypothesis draws up
    to ``examples`` calls exercising it (derandomized: the same calls every run), runs
    them through the function and compares output, LSE and gradients with the float64
    reference (:func:`~arrayattn.testing.assert_attention_close`'s rules). The first
    failure is shrunk to a minimal call (smallest shapes, fewest options) and reported
    with its error message.

    Args:
        fn: the function, with arrayattn's/PyTorch's argument names (see
            :func:`~arrayattn.testing.adapters.for_function`); omit it with ``adapter``.
        layout: ``"BHLD"`` or ``"BLHD"`` (``fn``'s query/key/value/output layout).
        supports: features ``fn`` implements (default: from its signature); the
            others are reported as ``not supported``.
        xp: backend name (or :class:`~arrayattn.testing.Backend`) of ``fn``'s arrays.
        examples: calls drawn per feature (CI: a handful; a full report: 50+).
        adapter: a ready-made :class:`~arrayattn.testing.adapters.Adapter` instead of
            ``fn`` (``adapters.torch_sdpa()``, ``adapters.jax_dpa()``,
            ``adapters.flash_attn(flash_attn_func)``, ``adapters.arrayattn_sdpa()``).
        features: only these rows (default: all).
        dtypes: dtypes drawn (default: the adapter's).
        max_len: largest ``L`` and ``S`` drawn.

    Returns:
        A :class:`ConformanceReport` (print it, or ``.to_json()``).

    Examples:
        >>> import arrayattn as aa
        >>> from arrayattn.testing import check_attention
        >>> report = check_attention(aa.scaled_dot_product_attention, examples=3,
        ...                          features=["basic", "window", "lse"])
        >>> report.ok, report.status("window")
        (True, 'passed')
    """
    if adapter is None:
        if fn is None:
            raise TypeError("check_attention needs fn or adapter=, got neither")
        adapter = for_function(fn, layout=layout, supports=supports, xp=xp)
    elif supports is not None:  # a copy: the caller's adapter is left as it was
        adapter = dataclasses.replace(adapter, supports=frozenset(supports))
    backend = make_backend(adapter.backend)
    supported = adapter.supports
    if adapter.vjp is None:
        supported = supported - {"gradients"}
    draw_dtypes = tuple(dtypes or adapter.dtypes)
    wanted = list(FEATURES if features is None else features)
    unknown = set(wanted) - set(FEATURES)
    if unknown:
        raise ValueError(f"features must be names from FEATURES, got unknown {sorted(unknown)}")

    # The empty-rows row runs first: when it fails on a documented convention, calls with
    # empty rows are left out of the other rows (they would only repeat that difference).
    order = sorted(wanted, key=lambda f: f != "empty_rows")
    skip_empty = False
    results: dict[str, FeatureResult] = {}
    for feature in order:
        row = _run_row(
            feature, adapter, backend, supported, draw_dtypes, examples, max_len, skip_empty
        )
        results[feature] = row
        if feature == "empty_rows" and row.status == CONVENTION:
            skip_empty = True
    rows = [results[f] for f in wanted]
    notes = list(adapter.notes)
    if skip_empty:
        notes.append("calls with fully masked rows are left out of the other rows (convention)")
    return ConformanceReport(adapter.name, backend.name, rows, notes, draw_dtypes, examples)


def _has_empty_rows(call: AttentionCall) -> bool:
    return bool(np.isneginf(call.reference()[1]).any())


def _run_row(
    feature: str,
    adapter: Adapter,
    backend: Backend,
    supported: frozenset[str],
    draw_dtypes: tuple[str, ...],
    examples: int,
    max_len: int,
    skip_empty: bool,
) -> FeatureResult:
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    from .strategies import attention_calls

    plan = None if feature not in supported | {"basic"} else _row_features(feature, supported)
    if plan is None:
        return FeatureResult(feature, UNSUPPORTED, FEATURE_DOCS[feature])
    allowed, required = plan
    row_dtypes = draw_dtypes
    if feature == "low_precision":
        row_dtypes = ("float16", "bfloat16")
        if not any(backend.dtype(d) is not None for d in row_dtypes):
            return FeatureResult(feature, UNSUPPORTED, f"{backend.name} has neither")
    strategy = attention_calls(
        xp=backend,
        dtypes=[d for d in row_dtypes if backend.dtype(d) is not None] or ["float32"],
        max_len=max_len,
        features=allowed,
        require=required,
        alignments=adapter.alignments,
        same_value_dim=adapter.same_value_dim,
    )
    counts = {"run": 0, "skipped": 0, "left_out": 0}
    errors: dict[int, str] = {}

    def fails(call: AttentionCall, counts=counts, errors=errors) -> bool:
        try:
            if skip_empty and _has_empty_rows(call):
                counts["left_out"] += 1
                return False
            check_call(adapter, backend, call)
        except NotExpressible:
            counts["skipped"] += 1
            return False
        except AssertionError as exc:
            errors[id(call)] = str(exc).splitlines()[0]
            return True
        except Exception as exc:  # the function under test raised
            errors[id(call)] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            return True
        finally:
            counts["run"] += 1
        return False

    try:
        minimal = find(
            strategy,
            fails,
            settings=settings(
                max_examples=examples,
                derandomize=True,
                database=None,
                deadline=None,
                phases=(Phase.generate, Phase.shrink),
                suppress_health_check=list(HealthCheck),
            ),
        )
    except NoSuchExample:
        checked = counts["run"] - counts["skipped"] - counts["left_out"]
        if checked == 0:  # nothing the function could express: no evidence either way
            return FeatureResult(
                feature,
                UNSUPPORTED,
                f"none of {counts['run']} drawn calls was expressible or kept",
                None,
                0,
                counts["skipped"],
                counts["left_out"],
            )
        return FeatureResult(
            feature, PASSED, "", None, checked, counts["skipped"], counts["left_out"]
        )
    if not fails(minimal):  # flaky: report what the search saw
        detail = "failed during the search but not when re-run (flaky)"
    else:
        detail = errors[id(minimal)]
    status = CONVENTION if feature in adapter.conventions else FAILED
    if status == CONVENTION:
        detail = f"{adapter.conventions[feature]}: {detail}"
    return FeatureResult(
        feature,
        status,
        detail,
        {"call": minimal.describe(), "error": detail, "spec": minimal.to_dict()},
        counts["run"],
        counts["skipped"],
    )
