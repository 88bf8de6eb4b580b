"""arrayattn.testing itself: the oracle and its VJP against finite differences, the
comparison rules and messages, deterministic strategies, reports, adapters (a fake
``flash_attn_func``, torch SDPA) and arrayattn's own implementation on every backend."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from _helpers import numerical_vjp
from hypothesis import given, seed, settings

import arrayattn as aa
from arrayattn.testing import (
    assert_attention_close,
    attention_calls,
    check_attention,
    naive_attention,
    reference_attention,
    reference_vjp,
)
from arrayattn.testing.adapters import arrayattn_sdpa, flash_attn, torch_sdpa

# -- the oracle --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "causal_align": "bottom_right", "softcap": 2.0},
        {"window": (1, 0), "enable_gqa": True, "mask": "float"},
        {"sinks": True, "alibi": True, "is_causal": True},
        {"dropout_p": 0.3, "seed": 7, "mask": "bool", "scale": 0.7},
        {"kv_lengths": True, "q_lengths": True, "causal_align": "bottom_right", "is_causal": True},
    ],
    ids=["softcap", "gqa-window-fmask", "sinks-alibi", "dropout", "lengths"],
)
def test_reference_vjp_matches_finite_differences(options):
    rng = np.random.default_rng(0)
    opts = dict(options)
    q = rng.standard_normal((2, 4, 3, 2))
    k = rng.standard_normal((2, 2 if opts.get("enable_gqa") else 4, 4, 2))
    v = rng.standard_normal(k.shape[:-1] + (3,))
    mask = opts.pop("mask", None)
    if mask == "float":
        mask = rng.standard_normal((2, 1, 3, 4))
    elif mask == "bool":
        mask = rng.random((3, 4)) < 0.7
    if opts.pop("sinks", False):
        opts["sinks"] = np.array([0.5, -1.0, 2.0, 0.0])
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625])
    if opts.pop("kv_lengths", False):
        opts["kv_lengths"] = np.array([4, 2])
    if opts.pop("q_lengths", False):
        opts["q_lengths"] = np.array([1, 3])
    d_out = rng.standard_normal((2, 4, 3, 3))
    d_lse = rng.standard_normal((2, 4, 3))
    grads = reference_vjp(d_out, q, k, v, mask, d_lse=d_lse, **opts)

    def f(q_, k_, v_, m_, sinks_):
        o = dict(opts)
        if sinks_ is not None:
            o["sinks"] = sinks_
        return reference_attention(q_, k_, v_, m_, **o)

    args = [q, k, v, mask, opts.get("sinks")]
    wrt = [0, 1, 2] + ([3] if mask is not None and mask.dtype != bool else [])
    wrt += [4] if "sinks" in opts else []
    for i in wrt:
        fd = numerical_vjp(f, args, i, (d_out, d_lse))
        got = grads[i]
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-7, err_msg=f"argument {i}")


def test_reference_matches_arrayattn_and_sink_rows():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    mask = np.array([[True, True, False], [False, False, False], [True, False, True]])
    out, lse, p = reference_attention(q, k, v, mask, return_probs=True)
    ref_out, ref_lse, ref_p = __import__("_reference").attention(q, k, v, mask)
    np.testing.assert_allclose(out, ref_out, rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(p, ref_p, atol=1e-15)
    got, got_lse = aa.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    assert_attention_close(got, out, dtype="float64")
    assert_attention_close(got_lse, lse, dtype="float64", what="lse")
    # With a sink, an empty row has output 0 and a finite LSE: the sink's logit.
    sinks = np.array([0.5, -1.0])
    out, lse = reference_attention(q, k, v, mask, sinks=sinks)
    np.testing.assert_array_equal(out[0, :, 1], 0.0)
    np.testing.assert_allclose(lse[0, :, 1], sinks)


# -- comparisons ---------------------------------------------------------------------------


def test_assert_attention_close_messages():
    e = np.zeros((2, 3))
    a = e.copy()
    a[1, 2] = np.nan
    with pytest.raises(AssertionError, match=r"output \(float32\): NaN at index \(1, 2\)"):
        assert_attention_close(a, e, dtype="float32")
    lse = np.array([0.5, -np.inf])
    with pytest.raises(
        AssertionError, match=r"lse \(float32\): 0.5 at index \(1,\), expected -inf"
    ):
        assert_attention_close(np.array([0.5, 0.5]), lse, dtype="float32", what="lse")
    with pytest.raises(
        AssertionError,
        match=r"error 0.001 at index \(1,\) .*relative Frobenius error 0.000447; allowed 2e-05",
    ):
        assert_attention_close(np.array([1.0, 2.001]), np.array([1.0, 2.0]), dtype="float32")
    assert_attention_close(np.array([1.0, 2.0 + 1e-6]), np.array([1.0, 2.0]), dtype="float32")
    assert_attention_close(lse, lse, dtype="float64")


def test_flashattention_rule_for_float16():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(3))
    expected, _ = reference_attention(q, k, v)
    naive, _ = naive_attention(q, k, v, dtype="float16")
    out = aa.scaled_dot_product_attention(q, k, v)
    assert_attention_close(out, expected, dtype="float16", baseline=naive)
    err = float(np.max(np.abs(naive - expected)))
    assert err > 0
    with pytest.raises(AssertionError, match="FlashAttention's rule"):
        assert_attention_close(expected + 5 * err, expected, dtype="float16", baseline=naive)


# -- strategies ----------------------------------------------------------------------------


def _draws(**deco):
    seen = []

    @settings(max_examples=15, deadline=None, database=None, **deco.get("settings", {}))
    @given(attention_calls(xp="numpy", max_len=6))
    def collect(call):
        seen.append(call.describe() + repr(call.query.sum()))

    if "seed" in deco:
        collect = seed(deco["seed"])(collect)
    collect()
    return seen


def test_strategies_are_deterministic():
    assert _draws(settings={"derandomize": True}) == _draws(settings={"derandomize": True})
    assert _draws(seed=1234) == _draws(seed=1234)
    assert _draws(seed=1234) != _draws(seed=4321)


def test_import_needs_neither_pytest_nor_hypothesis():
    code = (
        "import sys; sys.modules['pytest'] = None; sys.modules['hypothesis'] = None\n"
        "import numpy as np, arrayattn.testing as t\n"
        "q = np.ones((1, 1, 2, 4)); out, lse = t.reference_attention(q, q, q)\n"
        "t.assert_attention_close(out, out, dtype='float64')\n"
        "try:\n    t.attention_calls\n"
        "except ImportError:\n    print('strategies need hypothesis')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "strategies need hypothesis" in res.stdout


# -- reports and adapters --------------------------------------------------------------------


def test_arrayattn_passes_on_every_backend(backend):
    # A few examples per feature (JAX compiles every shape: fewer rows there).
    features = None
    examples = 3
    if backend.compiles_per_shape:
        features = [
            "basic",
            "causal_bottom_right",
            "gqa",
            "empty_rows",
            "lengths",  # concrete lengths closed over by a jitted call
            "lse",
            "gradients",
        ]
        examples = 2
    report = check_attention(adapter=arrayattn_sdpa(backend), examples=examples, features=features)
    assert report.ok, report.table()
    for row in report.rows:
        optional = ("sinks", "alibi") + (
            ("low_precision",) if backend.dtype("float16") is None else ()
        )
        if row.feature not in optional:
            assert row.status == "passed", report.table()
    again = json.loads(report.to_json())
    assert again["ok"] and len(again["rows"]) == len(report.rows)


@pytest.mark.parametrize("implementation", [i for i in aa.implementations() if i != "auto"])
def test_every_implementation_passes_on_numpy(implementation):
    # implementation="dask" takes Dask arrays: the kit runs it on its dask backend.
    backend = "dask" if implementation == "dask" else "numpy"
    adapter = arrayattn_sdpa(backend, implementation=implementation)
    report = check_attention(adapter=adapter, examples=3)
    assert report.ok, report.table()


def _fake_flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's signature and layout (B, L, H, D), computed by arrayattn."""
    import torch

    if alibi_slopes is not None:
        raise NotImplementedError("alibi")
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
    out, lse = aa.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=qh.shape[1] != kh.shape[1],
        causal_align="bottom_right",
        window=window,
        softcap=softcap or None,
        return_lse=True,
    )
    out = out.transpose(1, 2)
    return (out, lse, torch.empty(0)) if return_attn_probs else out


def test_flash_attn_signature_adapter():
    pytest.importorskip("torch")
    adapter = flash_attn(_fake_flash_attn_func, xp="torch")
    supports = adapter.supports - {"alibi", "gradients"}
    report = check_attention(adapter=adapter, supports=supports, examples=4)
    assert "alibi" in adapter.supports  # the caller's adapter is not modified
    assert report.ok, report.table()
    assert report.status("causal_bottom_right") == "passed"
    assert report.status("bool_mask") == "not supported"

    def top_left(*args, **kwargs):  # a port that forgot FlashAttention's alignment
        q, k = args[0], args[1]
        if kwargs.get("causal") and q.shape[1] != k.shape[1]:
            import torch

            L, S = q.shape[1], k.shape[1]
            keep = torch.ones(L, S, dtype=torch.bool).tril()
            out = aa.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in args[:3]),
                attn_mask=keep,
                enable_gqa=q.shape[2] != k.shape[2],
                scale=kwargs.get("softmax_scale"),
            )
            return out.transpose(1, 2)
        return _fake_flash_attn_func(*args, **kwargs)

    bad = flash_attn(top_left, xp="torch", dtypes=("float32",))
    report = check_attention(adapter=bad, examples=10, features=["causal_bottom_right"])
    assert report.status("causal_bottom_right") == "failed", report.table()


def test_torch_sdpa_adapter_smoke():
    pytest.importorskip("torch")
    report = check_attention(
        adapter=torch_sdpa(), examples=3, features=["basic", "gqa", "causal_bottom_right", "lse"]
    )
    assert report.status("lse") == "not supported"
    assert report.ok, report.table()


def test_cli_reports_missing_peer_cleanly():
    code = (
        "import sys; sys.modules['keras'] = None\n"
        "from arrayattn.testing.__main__ import main\n"
        "sys.exit(main(['--peer', 'keras']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert "keras is not installed" in res.stderr and "Traceback" not in res.stderr


def test_rows_with_nothing_expressible_are_not_passed():
    from arrayattn.testing.adapters import NotExpressible

    def never(q, k, v, **options):
        raise NotExpressible("nothing")

    adapter = arrayattn_sdpa("numpy")
    adapter = type(adapter)(
        name="never", run=lambda c, b, w: never(c, b, w), supports=adapter.supports - {"softcap"}
    )
    report = check_attention(adapter=adapter, examples=3, features=["basic", "window", "softcap"])
    # Supported but no usable call: "no examples kept"; a feature the adapter lacks:
    # "not supported". Neither is a failure.
    statuses = [r.status for r in report.rows]
    assert statuses == ["no examples kept", "no examples kept", "not supported"], report.table()
    assert report.ok
    assert "3 not expressible by the adapter" in report.row("window").detail
