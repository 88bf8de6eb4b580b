"""Dropout of a function that takes no seed (PyTorch's signature): checked by what holds
for any random mask (``p = 0``, keep rate, mean output, ``1 / (1 - p)`` scaling,
gradients against the mask the output shows), never failed for the missing ``seed``;
and a wrong one (no ``1 / (1 - p)`` scaling) still fails the statistical check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.testing import check_attention
from arrayattn.testing.adapters import NotExpressible, for_function, torch_sdpa

# The row's checks, in the order they run (the last needs the function's gradients).
ALL_CHECKS = [
    "p = 0 gives the output without dropout",
    "keep rate 1 - p",
    "output mean unbiased",
    "kept entries scaled by 1/(1 - p)",
    "gradients match the mask the output shows",
]
WITHOUT_GRADIENTS = ALL_CHECKS[:-1]


def numpy_sdpa_random_dropout(scaled: bool = True):
    """PyTorch's signature over arrayattn's NumPy implementation, with a fresh random
    dropout mask every call (a random seed drawn inside: none can be passed in);
    ``scaled=False`` forgets the 1 / (1 - p) scaling."""
    rng = np.random.default_rng()

    def scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        seed = int(rng.integers(2**31)) if dropout_p > 0 else None
        out = aa.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed=seed
        )
        return out if scaled else out * (1 - dropout_p)

    return scaled_dot_product_attention


def torch_pytorch_signature(scaled: bool = True):
    """torch's SDPA behind exactly its own signature (the builtin has no inspectable
    one); ``scaled=False`` forgets the 1 / (1 - p) scaling."""
    import torch.nn.functional as F

    def scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out if scaled else out * (1 - dropout_p)

    return scaled_dot_product_attention


def _no_seed_error(report) -> None:
    text = report.table()
    assert "TypeError" not in text and "unexpected keyword" not in text, text


def test_numpy_function_without_seed_passes_dropout_and_combined():
    fn = numpy_sdpa_random_dropout()
    report = check_attention(fn, examples=8, features=["basic", "dropout", "combined"])
    assert report.ok, report.table()
    row = report.row("dropout")
    assert row.status == "passed", report.table()
    assert row.checks == dict.fromkeys(WITHOUT_GRADIENTS, "passed")
    assert report.status("combined") == "passed", report.table()
    assert "checked without a seed" in report.table()
    _no_seed_error(report)


# causal_lower_right warns of NaN for L > S; the kit compares those rows anyway.
@pytest.mark.filterwarnings("ignore:Lower right causal bias:UserWarning")
def test_torch_sdpa_wrapped_like_the_kit_passes_dropout():
    pytest.importorskip("torch")
    fn = torch_pytorch_signature()
    features = ["basic", "dropout", "gradients", "combined"]
    # As the kit's adapter wraps PyTorch (bottom-right causal bias, no mask with causal).
    report = check_attention(adapter=torch_sdpa(fn), examples=5, features=features)
    assert report.ok, report.table()
    assert report.row("dropout").checks == dict.fromkeys(ALL_CHECKS, "passed"), report.table()
    _no_seed_error(report)
    # The function alone, read from its signature: dropout_p but no seed.
    report = check_attention(fn, xp="torch", examples=3, features=["basic", "dropout"])
    assert report.row("dropout").checks == dict.fromkeys(ALL_CHECKS, "passed"), report.table()
    _no_seed_error(report)


def test_torch_builtin_without_signature_is_told_by_its_type_error():
    torch = pytest.importorskip("torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    report = check_attention(
        sdpa, xp=torch, supports={"basic", "dropout"}, examples=3, features=["dropout"]
    )
    assert report.status("dropout") == "passed", report.table()
    assert report.row("dropout").checks == dict.fromkeys(WITHOUT_GRADIENTS, "passed")


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_function_forgetting_the_scaling_fails_the_statistical_check(library):
    if library == "torch":
        pytest.importorskip("torch")
        fn = torch_pytorch_signature(scaled=False)
    else:
        fn = numpy_sdpa_random_dropout(scaled=False)
    report = check_attention(fn, xp=library, examples=3, features=["basic", "dropout"])
    row = report.row("dropout")
    assert row.status == "failed" and not report.ok, report.table()
    assert row.checks["keep rate 1 - p"] == "passed"
    assert row.checks["output mean unbiased"] == "failed", report.table()
    assert "the mean output is not the output without dropout" in row.detail
    assert row.example is not None and "dropout_p=" in row.example["call"]
    assert report.status("basic") == "passed"
    _no_seed_error(report)


def test_function_that_ignores_dropout_fails_the_keep_rate():
    def no_dropout(query, key, value, dropout_p=0.0):
        return aa.scaled_dot_product_attention(query, key, value)

    report = check_attention(no_dropout, examples=2, features=["dropout"])
    row = report.row("dropout")
    assert row.status == "failed" and row.checks["keep rate 1 - p"] == "failed", report.table()
    assert "1.0000 of 16384 output entries kept, expected 1 - p = 0.8" in row.detail


def test_dropout_no_seedless_call_can_express_is_not_checkable():
    adapter = for_function(numpy_sdpa_random_dropout())
    plain_run = adapter.run

    def run(call, backend, want_lse):
        if "dropout_p" in call.options:
            raise NotExpressible("this function runs dropout only in training mode")
        return plain_run(call, backend, want_lse)

    adapter = dataclasses.replace(adapter, run=run)
    report = check_attention(adapter=adapter, examples=2, features=["basic", "dropout"])
    row = report.row("dropout")
    assert row.status == "not checkable", report.table()
    assert row.detail == "without a seed: this function runs dropout only in training mode"
    assert report.ok
