"""``check_attention``: a conformance battery for any attention function, one row per
feature, each a hypothesis search that shrinks a failure to a minimal example."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ._backends import Backend, make_backend
from ._calls import FEATURE_DOCS, FEATURES, AttentionCall
from ._compare import assert_attention_close, dtype_name, naive_attention
from ._dropout import check_dropout_without_seed, preferred_dtype
from ._watch import watch
from .adapters import Adapter, NotExpressible, for_function

__all__ = ["check_attention", "check_call", "ConformanceReport", "FeatureResult"]

PASSED, FAILED, UNSUPPORTED, CONVENTION = "passed", "failed", "not supported", "convention"
# A supported feature none of whose drawn calls could be used (not expressible by the
# adapter, or left out under a convention): no evidence either way, unlike UNSUPPORTED.
NO_EXAMPLES = "no examples kept"
# Dropout of a function that takes no seed, when not even the seedless checks can run.
NOT_CHECKABLE = "not checkable"
STATUSES = (PASSED, FAILED, UNSUPPORTED, CONVENTION, NO_EXAMPLES, NOT_CHECKABLE)
KIT_INSTALL_HINT = "pip install 'arrayattn[kit]' (from a checkout: pip install -e '.[kit]')"
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
    status: str  # one of STATUSES
    detail: str = ""
    example: dict[str, Any] | None = None  # the minimal failing call, when failed
    examples_run: int = 0
    skipped: int = 0  # drawn calls the adapter could not express
    left_out: int = 0  # calls with fully masked rows, left out under a convention
    # Checks of a row not compared with the reference (dropout without a seed):
    # description -> "passed" / "failed", in the order they ran.
    checks: dict[str, str] = field(default_factory=dict)


@dataclass
class ConformanceReport:
    """What :func:`check_attention` found: one :class:`FeatureResult` per feature.

    ``str(report)`` (or :meth:`table`) is a fixed-width table; :meth:`to_json` the same
    as JSON. ``report.ok`` is True when nothing failed. A row's status is ``"passed"``,
    ``"failed"``, ``"convention"`` (a documented difference), ``"not supported"`` (the
    function or backend lacks the feature), ``"no examples kept"`` (supported, but no
    drawn call could be used) or ``"not checkable"`` (dropout without a seed that not
    even the statistical checks could run on).

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
        width = max([len("feature")] + [len(r.feature) for r in self.rows])
        status_width = max([13] + [len(r.status) for r in self.rows])
        lines = [head, "", f"{'feature':<{width}}  {'status':<{status_width}}  detail"]
        lines.append(f"{'-' * width}  {'-' * status_width}  {'-' * 40}")
        for r in self.rows:
            detail = _passed_detail(r) if r.status == PASSED else r.detail
            lines.append(f"{r.feature:<{width}}  {r.status:<{status_width}}  {detail}")
        for r in self.rows:
            if r.example is not None:
                lines += ["", f"[{r.feature}] minimal failing example: {r.example['call']}"]
                lines.append(f"    {r.example['error']}")
                if r.checks:
                    ran = "; ".join(f"{name}: {result}" for name, result in r.checks.items())
                    lines.append(f"    checks run: {ran}")
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


def _passed_detail(r: FeatureResult) -> str:
    """What a passed row checked: its examples (and those skipped or left out), or the
    seedless checks it ran."""
    if r.checks:
        return f"{r.examples_run} calls checked without a seed: {'; '.join(r.checks)}"
    detail = f"{r.examples_run} examples checked"
    if r.skipped:
        detail += f"; {r.skipped} not expressible, skipped"
    if r.left_out:
        detail += f"; {r.left_out} with fully masked rows left out"
    return detail


def _lse_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def require_hypothesis() -> None:
    """Raise ``ModuleNotFoundError`` saying what to install when hypothesis (which draws
    the calls of :func:`check_attention`) is missing.

    Examples:
        >>> from arrayattn.testing._check import require_hypothesis
        >>> require_hypothesis()  # installed here: nothing happens
    """
    try:
        import hypothesis  # noqa: F401
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"arrayattn.testing's conformance checks need hypothesis, which is not installed "
            f"here ({exc}). Install what the kit needs with {KIT_INSTALL_HINT}.",
            name="hypothesis",
        ) from exc


def check_call(adapter: Adapter, backend: Backend, call: AttentionCall) -> None:
    """Run one call through ``adapter`` and compare output, LSE (when the call asks for
    it) and gradients (likewise) with the float64 reference; raises ``AssertionError``
    on a mismatch (also when the function wrote into one of its inputs: query, key,
    value, mask, lengths, sinks or slopes must be left unchanged),
    :class:`~arrayattn.testing.adapters.NotExpressible` when the adapter cannot make the
    call.

    Examples:
        >>> from arrayattn.testing import AttentionCall, check_call, make_backend
        >>> from arrayattn.testing.adapters import arrayattn_sdpa
        >>> import numpy as np
        >>> c = AttentionCall(np.ones((1, 1, 2, 4)), np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)))
        >>> check_call(arrayattn_sdpa(), make_backend("numpy"), c)
    """
    want_lse = "lse" in call.features
    watched = watch(call)
    out, lse = adapter.run(watched, backend, want_lse)
    watched.assert_unchanged()
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
        watched = watch(call)
        got = adapter.vjp(watched, backend, d_out)
        watched.assert_unchanged()
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
    xp: str | ModuleType | Backend = "numpy",
    examples: int = 20,
    adapter: Adapter | None = None,
    features: Iterable[str] | None = None,
    dtypes: Iterable[Any] | None = None,
    max_len: int = 8,
) -> ConformanceReport:
    """Check an attention function against arrayattn's semantics, feature by feature.

    For each feature (rows of :data:`~arrayattn.testing.FEATURES`) hypothesis draws up
    to ``examples`` calls exercising it (derandomized: the same calls every run), runs
    them through the function and compares output, LSE and gradients with the float64
    reference (:func:`~arrayattn.testing.assert_attention_close`'s rules). The first
    failure is shrunk to a minimal call (smallest shapes, fewest options) and reported
    with its error message. After every call the arrays handed to the function must be
    unchanged: a function that writes into its inputs fails, naming the argument.

    A function that takes ``dropout_p`` but no ``seed`` (PyTorch's signature) draws a
    random mask: its ``dropout`` row runs statistical checks instead (keep rate,
    ``1 / (1 - p)`` scaling, ``p = 0``, the mean output, gradients against the mask the
    output shows; the row's ``checks`` say which ran), and ``combined`` leaves dropout
    out. A row none of whose drawn calls could be used is ``no examples kept``, not
    ``not supported`` (a feature the function or backend lacks).

    Args:
        fn: the function, with arrayattn's/PyTorch's argument names (see
            :func:`~arrayattn.testing.adapters.for_function`); omit it with ``adapter``.
        layout: ``"BHLD"`` or ``"BLHD"`` (``fn``'s query/key/value/output layout).
        supports: features ``fn`` implements (default: from its signature); the
            others are reported as ``not supported``.
        xp: the library of ``fn``'s arrays: its module (``numpy``, ``torch``,
            ``jax.numpy``, ``array_api_strict``, ``dask.array``, ``cupy``, or
            array-api-compat's wrapper of one such as ``array_api_compat.numpy``), a
            name from :data:`~arrayattn.testing.BACKENDS`, or a
            :class:`~arrayattn.testing.Backend`.
        examples: calls drawn per feature (CI: a handful; a full report: 50+).
        adapter: a ready-made :class:`~arrayattn.testing.adapters.Adapter` instead of
            ``fn`` (``adapters.torch_sdpa()``, ``adapters.jax_dpa()``,
            ``adapters.flash_attn(flash_attn_func)``, ``adapters.arrayattn_sdpa()``).
        features: only these rows (default: all).
        dtypes: dtypes drawn (default: the adapter's), as names or any library's dtype
            objects.
        max_len: largest ``L`` and ``S`` drawn.

    Returns:
        A :class:`ConformanceReport` (print it, or ``.to_json()``).

    Raises:
        ModuleNotFoundError: hypothesis is not installed (the message says what to
            install).

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
    require_hypothesis()
    backend = make_backend(adapter.backend)
    supported = adapter.supports
    if adapter.vjp is None:
        supported = supported - {"gradients"}
    draw_dtypes = tuple(dtype_name(d) for d in (dtypes or adapter.dtypes))
    wanted = list(FEATURES if features is None else features)
    unknown = set(wanted) - set(FEATURES)
    if unknown:
        raise ValueError(f"features must be names from FEATURES, got unknown {sorted(unknown)}")
    seeded = True
    if "dropout" in supported and {"dropout", "combined"} & set(wanted):
        seeded = _takes_seed(adapter, backend)

    # The empty-rows row runs first: when it fails on a documented convention, calls with
    # empty rows are left out of the other rows (they would only repeat that difference).
    order = sorted(wanted, key=lambda f: f != "empty_rows")
    skip_empty = False
    results: dict[str, FeatureResult] = {}
    for feature in order:
        if feature == "dropout" and "dropout" in supported and not seeded:
            row = _seedless_dropout_row(adapter, backend)
        else:
            # Without a seed, drawn dropout calls have no exact reference.
            row_supported = supported if seeded else supported - {"dropout"}
            row = _run_row(
                feature, adapter, backend, row_supported, draw_dtypes, examples, max_len, skip_empty
            )
        results[feature] = row
        if feature == "empty_rows" and row.status == CONVENTION:
            skip_empty = True
    rows = [results[f] for f in wanted]
    notes = list(adapter.notes)
    if not seeded:
        notes.append(
            "the function takes no dropout seed (its mask is random): the dropout row checks "
            "it statistically, and dropout is left out of the other rows"
        )
    if skip_empty:
        notes.append("calls with fully masked rows are left out of the other rows (convention)")
    return ConformanceReport(adapter.name, backend.name, rows, notes, draw_dtypes, examples)


def _takes_seed(adapter: Adapter, backend: Backend) -> bool:
    """``adapter.takes_seed``; when unknown, whether one small dropout call with a seed
    raises a ``TypeError`` naming ``seed`` (``**kwargs`` passed on to PyTorch)."""
    if adapter.takes_seed is not None:
        return adapter.takes_seed
    shape = (1, 1, 2, 4)
    probe = AttentionCall(
        np.ones(shape),
        np.ones(shape),
        np.ones(shape),
        None,
        {"dropout_p": 0.5, "seed": 0},
        preferred_dtype(adapter, backend),
        frozenset({"dropout"}),
        backend,
    )
    try:
        adapter.run(probe, backend, False)
    except TypeError as exc:
        return "seed" not in str(exc)
    except Exception:  # any other failure shows in the dropout row itself
        return True
    return True


def _seedless_dropout_row(adapter: Adapter, backend: Backend) -> FeatureResult:
    """The dropout row of a function that takes no seed: the statistical checks."""
    found = check_dropout_without_seed(adapter, backend)
    if found.not_checkable is not None:
        detail = f"without a seed: {found.not_checkable}"
        return FeatureResult(
            "dropout", NOT_CHECKABLE, detail, None, found.calls, checks=found.checks
        )
    if found.failure is None:
        return FeatureResult("dropout", PASSED, "", None, found.calls, checks=found.checks)
    failed = next(name for name, result in found.checks.items() if result == "failed")
    detail = f"without a seed, {failed}: {found.failure}"
    status = FAILED
    if "dropout" in adapter.conventions:
        status = CONVENTION
        detail = f"{adapter.conventions['dropout']}: {detail}"
    example = None
    if found.call is not None:
        example = {"call": found.call.describe(), "error": detail, "spec": found.call.to_dict()}
    return FeatureResult("dropout", status, detail, example, found.calls, checks=found.checks)


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

    def fails(
        call: AttentionCall, counts: dict[str, int] = counts, errors: dict[int, str] = errors
    ) -> bool:
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
        if checked == 0:  # a supported feature without one usable call: no evidence
            return FeatureResult(
                feature,
                NO_EXAMPLES,
                _no_examples_detail(counts),
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


def _no_examples_detail(counts: dict[str, int]) -> str:
    """Why none of a row's drawn calls was used."""
    reasons = []
    if counts["skipped"]:
        reasons.append(f"{counts['skipped']} not expressible by the adapter")
    if counts["left_out"]:
        reasons.append(f"{counts['left_out']} left out for fully masked rows, a convention")
    return (
        f"none of {counts['run']} drawn calls could be used ({', '.join(reasons)}); "
        "more examples may find one"
    )
