"""The kit takes ``xp`` and ``dtype`` the way the array-API world passes them: ``xp`` as
the library's module (numpy, torch, jax.numpy, array_api_strict, dask.array and
array-api-compat's wrappers) as well as a backend name, ``dtype`` as any library's dtype
object as well as a name."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import arrayattn as aa
from arrayattn.testing import (
    assert_attention_close,
    check_attention,
    make_backend,
    naive_attention,
    reference_attention,
    round_to_dtype,
)

# (module to import, the backend name it stands for)
LIBRARY_MODULES = [
    ("numpy", "numpy"),
    ("array_api_compat.numpy", "numpy"),
    ("array_api_strict", "array_api_strict"),
    ("torch", "torch"),
    ("array_api_compat.torch", "torch"),
    ("jax.numpy", "jax"),
    ("dask.array", "dask"),
    ("array_api_compat.dask.array", "dask"),
]


@pytest.mark.parametrize(("module", "name"), LIBRARY_MODULES, ids=[m for m, _ in LIBRARY_MODULES])
def test_xp_may_be_the_library_module(module, name):
    xp = pytest.importorskip(module)
    assert make_backend(xp).name == name
    report = check_attention(aa.scaled_dot_product_attention, xp=xp, examples=2, features=["basic"])
    assert report.backend == name
    assert report.ok and report.status("basic") == "passed", report.table()


def test_xp_may_be_arrayattns_namespace_of_a_library():
    if not hasattr(aa, "array_namespace"):
        pytest.skip("this arrayattn has no array_namespace")
    report = check_attention(
        aa.scaled_dot_product_attention, xp=aa.array_namespace(np), examples=2, features=["basic"]
    )
    assert report.backend == "numpy" and report.ok, report.table()


def test_xp_of_no_supported_library_names_what_is_accepted():
    with pytest.raises(TypeError) as info:
        check_attention(aa.scaled_dot_product_attention, xp=math, examples=1)
    message = str(info.value)
    assert "xp must be a backend name" in message and "module 'math'" in message
    for accepted in ("numpy", "torch", "jax.numpy", "array_api_strict", "dask.array", "cupy"):
        assert accepted in message
    with pytest.raises(ValueError, match="backend must be one of .* got 'nunpy'"):
        check_attention(aa.scaled_dot_product_attention, xp="nunpy", examples=1)


def _dtype_objects() -> list[tuple[str, object, str]]:
    """(library, dtype object, its name) for every installed library."""
    found = [
        ("numpy", np.float32, "float32"),
        ("numpy", np.dtype("float64"), "float64"),
        ("numpy", np.float16, "float16"),
    ]
    for library, attrs in (
        ("torch", ("float32", "float64", "float16", "bfloat16")),
        ("jax.numpy", ("float32", "bfloat16")),
        ("ml_dtypes", ("bfloat16",)),
        ("array_api_strict", ("float32", "float64")),
    ):
        try:
            module = importlib.import_module(library)
        except ImportError:
            continue
        found += [(library, getattr(module, a), a) for a in attrs]
    return found


@pytest.mark.parametrize(("library", "dtype", "name"), _dtype_objects(), ids=repr)
def test_dtype_may_be_any_librarys_dtype_object(library, dtype, name):
    rng = np.random.default_rng(0)
    q, k, v = (round_to_dtype(rng.standard_normal((1, 2, 3, 4)), name) for _ in range(3))
    expected, _ = reference_attention(q, k, v)
    baseline, _ = naive_attention(q, k, v, dtype=dtype)
    assert_attention_close(baseline, expected, dtype=dtype, baseline=baseline)
    np.testing.assert_array_equal(round_to_dtype(expected, dtype), round_to_dtype(expected, name))
    # Messages name the dtype as usual.
    with pytest.raises(AssertionError, match=rf"^output \({name}\): max abs error"):
        assert_attention_close(expected + 1.0, expected, dtype=dtype)


def test_torch_dtype_with_a_torch_result():
    torch = pytest.importorskip("torch")
    q = torch.ones((1, 1, 2, 4), dtype=torch.bfloat16)
    out = aa.scaled_dot_product_attention(q, q, q)
    expected, _ = reference_attention(q, q, q)
    assert_attention_close(out, expected, dtype=q.dtype)  # torch.bfloat16


@pytest.mark.parametrize(
    "dtype", [np.int32, "int8", None, object()], ids=["np.int32", "int8", "None", "object"]
)
def test_other_dtypes_are_refused_naming_what_was_seen(dtype):
    pattern = r"dtype must be float16, bfloat16, float32 or float64 .*got "
    with pytest.raises(ValueError, match=pattern) as info:
        assert_attention_close(np.zeros(2), np.zeros(2), dtype=dtype)
    assert repr(dtype) in str(info.value)


def test_check_attention_draws_dtype_objects():
    report = check_attention(
        aa.scaled_dot_product_attention, dtypes=[np.float64], examples=2, features=["basic"]
    )
    assert report.dtypes == ("float64",) and report.ok, report.table()
