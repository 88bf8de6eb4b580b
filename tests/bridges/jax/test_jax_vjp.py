"""``arrayattn.jax.scaled_dot_product_attention``: arrayattn's attention as a
``jax.custom_vjp``, on both of its paths (``"auto"`` on this CPU: the NumPy fast path in
a ``jax.pure_callback``; ``"chunked"``: the array-API code traced with ``jax.numpy``).

Oracles, none calling arrayattn's attention:

- ``jax.grad`` through ``jax.nn.dot_product_attention(implementation="xla")`` (JAX's own
  code and autodiff; its softmax is float32 whatever the input dtype, so it is held to
  float32's tolerance);
- ``plain``: attention written here in ``jax.numpy`` (sinks, softcap, windows, ALiBi,
  lengths, LSE, a given dropout keep-mask), differentiated by ``jax.vjp``: float64 to
  1e-12 relative to the largest magnitude;
- ``jax.test_util.check_grads``: finite differences in float64.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# jax.numpy, not jax alone: without JAX installed, "import jax" finds this test folder
# (tests/ is on sys.path) as an empty namespace package.
jnp = pytest.importorskip("jax.numpy")
import jax  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import arrayattn as aa  # noqa: E402
import arrayattn.jax as aaj  # noqa: E402

SDPA = aaj.scaled_dot_product_attention
PATHS = ("auto", "chunked")  # the host callback and the traced path, on this CPU
TOL = {"float32": 1e-5, "float64": 1e-12}


@pytest.fixture(scope="module", autouse=True)
def x64() -> Iterator[None]:
    """float64 as the project's JAX backend has it (arrayattn.testing: jax_enable_x64)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def close(got: Any, want: Any, tol: float) -> None:
    """``max |got - want| <= tol * max |want|`` (or ``tol`` where ``want`` is all 0)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    scale = max(float(np.max(np.abs(want[fin]), initial=0.0)), 1.0 if not fin.any() else 0.0)
    err = float(np.max(np.abs(got[fin] - want[fin]), initial=0.0))
    assert err <= tol * max(scale, 1e-300) or err <= tol * 1e-3, (err, scale)


def normal(seed: int, shape: tuple[int, ...], dtype: Any = "float64") -> Any:
    """Standard normal numbers as a JAX array (drawn by NumPy: ``jax.random`` would
    compile once per shape)."""
    x = np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(x, dtype=jnp.dtype(dtype))


def bernoulli(seed: int, p: float, shape: tuple[int, ...]) -> Any:
    return jnp.asarray(np.random.default_rng(seed).random(shape) < p)


# -- the plain jax.numpy oracle --------------------------------------------------------
def plain(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    is_causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    sinks: Any = None,
    alibi: Any = None,
    keep: Any = None,
    dropout_p: float = 0.0,
) -> tuple[Any, Any]:
    """``(out, lse)`` for ``q (B, Hq, L, E)``, ``k/v (B, Hkv, S, *)`` (GQA by repeat),
    as SEMANTICS.md defines them: scale, softcap, ALiBi, float mask, then every way of
    excluding a key; empty rows give 0 and LSE -inf (or the sink)."""
    B, Hq, L, E = q.shape
    S = k.shape[-2]
    k, v = (jnp.repeat(x, Hq // x.shape[1], axis=1) for x in (k, v))
    s = (1 / math.sqrt(E) if scale is None else scale) * q @ jnp.swapaxes(k, -1, -2)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    i, j = jnp.arange(L)[:, None], jnp.arange(S)[None, :]
    q_len = jnp.full((B,), L) if q_lengths is None else q_lengths
    kv_len = jnp.full((B,), S) if kv_lengths is None else kv_lengths
    off = jnp.zeros((B,), dtype=int)
    if causal_align == "bottom_right":
        off = kv_len - q_len if q_lengths is not None or kv_lengths is not None else off + S - L
    off = off[:, None, None, None]
    if alibi is not None:
        s = s - alibi[None, :, None, None] * jnp.abs(i + off - j)
    allowed = jnp.ones(s.shape, dtype=bool)
    if mask is not None and mask.dtype == jnp.bool_:
        allowed &= mask
    elif mask is not None:
        s = s + mask
    if is_causal:
        allowed &= j <= i + off
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i + off - left
        if right >= 0:
            allowed &= j <= i + off + right
    allowed &= j < kv_len[:, None, None, None]
    allowed &= i < q_len[:, None, None, None]
    m = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # softmax ignores it
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, 0.0) - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None, :, None, None] - m)
    p = e / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    if keep is not None:
        p = jnp.where(keep, p / (1 - dropout_p), 0.0)
    return (p @ v).astype(q.dtype), lse[..., 0]


def xla_peer(q: Any, k: Any, v: Any, mask: Any = None, **kw: Any) -> Any:
    """``jax.nn.dot_product_attention`` in arrayattn's layout (bool ``mask`` or a float
    ``bias``; fewer KV heads is GQA)."""
    t = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)  # noqa: E731
    bias, bmask = (None, mask) if mask is None or mask.dtype == jnp.bool_ else (mask, None)
    out = jax.nn.dot_product_attention(
        t(q), t(k), t(v), bias=bias, mask=bmask, implementation="xla", **kw
    )
    return t(out)


def vjp_of(fn: Any, primals: tuple[Any, ...], cotangent: Any) -> tuple[Any, Any]:
    """``(fn(*primals), its vjp with cotangent)``, jitted (one compilation, instead of
    one per primitive and shape)."""

    def run(primals: tuple[Any, ...], cotangent: Any) -> tuple[Any, Any]:
        out, pullback = jax.vjp(fn, *primals)
        return out, pullback(cotangent)

    return jax.jit(run)(primals, cotangent)


# -- against jax.nn.dot_product_attention -------------------------------------------------
PEER_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal-gqa-scale": {"is_causal": True, "scale": 0.3, "hkv": 1},
    "bool-mask": {"mask": "bool"},
    "float-bias": {"mask": "float", "is_causal": True, "hkv": 1},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("case", list(PEER_CASES))
def test_gradients_equal_jax_nn_dot_product_attention(path: str, dtype: str, case: str) -> None:
    opts = dict(PEER_CASES[case])
    hkv, mask_kind = opts.pop("hkv", 2), opts.pop("mask", None)
    q, k, v = (
        normal(0, (2, 2, 6, 8), dtype),
        normal(1, (2, hkv, 7, 8), dtype),
        normal(2, (2, hkv, 7, 8), dtype),
    )
    mask = None
    if mask_kind == "bool":
        mask = bernoulli(3, 0.7, (2, 2, 6, 7)).at[..., 0].set(True)
    elif mask_kind == "float":
        mask = normal(3, (1, 2, 6, 7), dtype)
    d_out = normal(4, (2, 2, 6, 8), dtype)
    diff = (0, 1, 2) + ((3,) if mask_kind == "float" else ())
    primals = (q, k, v) + ((mask,) if mask_kind == "float" else ())

    def ours(q: Any, k: Any, v: Any, m: Any = mask) -> Any:
        return SDPA(q, k, v, m, enable_gqa=hkv != 2, implementation=path, **opts)

    def peer(q: Any, k: Any, v: Any, m: Any = mask) -> Any:
        return xla_peer(q, k, v, m, **opts)

    out, grads = vjp_of(ours, primals, d_out)
    want_out, want = vjp_of(peer, primals, d_out)
    assert len(grads) == len(diff) and out.dtype == jnp.dtype(dtype)
    close(out, want_out, 1e-5)  # the peer's softmax is float32 in both dtypes
    for g, w, x in zip(grads, want, primals, strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype
        close(g, w, 1e-5)


# -- every option, against the plain oracle in float64 -------------------------------------
@st.composite
def calls(draw: Any) -> dict[str, Any]:
    hq, hkv = draw(st.sampled_from([(2, 2), (4, 2)]))
    L, S = draw(st.sampled_from([(5, 5), (4, 7)]))
    c: dict[str, Any] = {"shape": (2, hq, hkv, L, S)}
    c["is_causal"] = draw(st.booleans())
    c["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    c["window"] = draw(st.sampled_from([None, (1, 0), (2, 1), (-1, 1)]))
    c["softcap"] = draw(st.sampled_from([None, 1.5]))
    c["mask"] = draw(st.sampled_from([None, "bool", "float"]))
    c["sinks"] = draw(st.booleans())
    c["alibi"] = draw(st.booleans())
    c["lengths"] = draw(st.sampled_from([None, "q", "kv", "both"]))
    return c


def _check_call(c: dict[str, Any], path: str) -> None:
    B, hq, hkv, L, S = c["shape"]
    q, k, v = normal(10, (B, hq, L, 8)), normal(11, (B, hkv, S, 8)), normal(12, (B, hkv, S, 8))
    mask = None
    if c["mask"] == "bool":
        mask = bernoulli(13, 0.7, (B, 1, L, S))
    elif c["mask"] == "float":
        mask = normal(13, (1, hq, L, S))
    sinks = normal(14, (hq,)) if c["sinks"] else None
    alibi = 2.0 ** -jnp.arange(1, hq + 1, dtype=jnp.float64) if c["alibi"] else None
    lengths = c["lengths"] or ""
    q_len = jnp.asarray([L - 1, 0], dtype=jnp.int32) if lengths in ("q", "both") else None
    kv_len = jnp.asarray([S, 2], dtype=jnp.int32) if lengths in ("kv", "both") else None
    opts: dict[str, Any] = {n: c[n] for n in ("is_causal", "causal_align", "window", "softcap")}
    fixed: dict[str, Any] = {"q_lengths": q_len, "kv_lengths": kv_len}
    primals: dict[str, Any] = {"q": q, "k": k, "v": v}
    if c["mask"] == "float":
        primals["mask"] = mask
    if sinks is not None:
        primals["sinks"] = sinks

    def ours(*xs: Any) -> Any:
        a = dict(zip(primals, xs, strict=True))
        return SDPA(
            a["q"], a["k"], a["v"], a.get("mask", mask), enable_gqa=hq != hkv,
            sinks=a.get("sinks"), alibi_slopes=alibi, return_lse=True, implementation=path,
            **fixed, **opts,
        )  # fmt: skip

    def oracle(*xs: Any) -> Any:
        a = dict(zip(primals, xs, strict=True))
        return plain(
            a["q"], a["k"], a["v"], a.get("mask", mask), sinks=a.get("sinks"), alibi=alibi,
            q_lengths=q_len, kv_lengths=kv_len, **opts,
        )  # fmt: skip

    cot = (normal(15, (B, hq, L, 8)), normal(16, (B, hq, L)))
    (out, lse), grads = vjp_of(ours, tuple(primals.values()), cot)
    (want_out, want_lse), want = vjp_of(oracle, tuple(primals.values()), cot)
    close(out, want_out, TOL["float64"])
    close(lse, want_lse, TOL["float64"])
    for name, g, w in zip(primals, grads, want, strict=True):
        assert g.shape == primals[name].shape, name
        close(g, w, TOL["float64"])


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=calls())
def test_every_option_and_its_gradients_equal_the_plain_oracle(
    path: str, c: dict[str, Any]
) -> None:
    _check_call(c, path)


def test_the_plain_oracle_sees_each_option() -> None:
    """The oracle comparison could not pass by ignoring an option: each changes it."""
    q, k = normal(0, (2, 2, 5, 8)), normal(1, (2, 2, 5, 8))
    base = plain(q, k, k)[0]
    for kw in (
        {"is_causal": True},
        {"window": (1, 0)},
        {"softcap": 0.5},
        {"sinks": jnp.zeros(2)},
        {"alibi": jnp.ones(2)},
        {"kv_lengths": jnp.asarray([2, 3])},
        {"q_lengths": jnp.asarray([2, 3])},
    ):
        assert not np.allclose(plain(q, k, k, **kw)[0], base), kw


@pytest.mark.parametrize("path", PATHS)
def test_check_grads_by_finite_differences(path: str) -> None:
    q, k, v = normal(20, (1, 2, 4, 4)), normal(21, (1, 2, 5, 4)), normal(22, (1, 2, 5, 4))
    mask, sinks = normal(23, (1, 1, 4, 5)), normal(24, (2,))

    def f(q: Any, k: Any, v: Any, mask: Any, sinks: Any) -> Any:
        out, lse = SDPA(q, k, v, mask, is_causal=True, causal_align="bottom_right",
                        softcap=2.0, sinks=sinks, return_lse=True, implementation=path)  # fmt: skip
        return out, lse

    check_grads(jax.jit(f), (q, k, v, mask, sinks), order=1, modes=["rev"])
    if path == "auto":  # and outside jit (slow on the traced path, which runs op by op)
        check_grads(f, (q, k, v, mask, sinks), order=1, modes=["rev"])


# -- transformations ------------------------------------------------------------------
def _inputs() -> tuple[Any, ...]:
    return normal(30, (3, 2, 4, 6, 8)), normal(31, (3, 2, 2, 6, 8)), normal(32, (3, 2, 2, 6, 8))


@pytest.mark.parametrize("path", PATHS)
def test_jit_grad_value_and_grad_and_their_compositions(path: str) -> None:
    qs, ks, vs = _inputs()
    sinks = normal(33, (4,))

    def loss(q: Any, k: Any, v: Any, sinks: Any) -> Any:
        out = SDPA(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks, implementation=path)
        return jnp.sum(out**2)

    def ref_loss(q: Any, k: Any, v: Any, sinks: Any) -> Any:
        return jnp.sum(plain(q, k, v, is_causal=True, sinks=sinks)[0] ** 2)

    args = (qs[0], ks[0], vs[0], sinks)
    ref_vg = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3)))
    want_val, want = ref_vg(*args)
    val, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
    close(val, want_val, 1e-12)
    for a, b in zip(g, want, strict=True):
        close(a, b, 1e-12)
    # vmap(grad) and jit(vmap(grad)) over a leading axis: each slice its own gradient.
    batched = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, 0, 0, None))
    for fn in (batched, jax.jit(batched)):
        dq, dk = fn(qs, ks, vs, sinks)
        for i in range(3):
            _, (want_dq, want_dk, _, _) = ref_vg(qs[i], ks[i], vs[i], sinks)
            close(dq[i], want_dq, 1e-12)
            close(dk[i], want_dk, 1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_vmap_over_some_arguments_equals_each_slice(path: str) -> None:
    """Mapped and unmapped arguments mixed (a shared query, mapped masks of lower rank,
    sinks; lengths unmapped): each slice equals the call on that slice alone."""
    qs, ks, vs = _inputs()
    masks = normal(34, (3, 6, 6))  # (L, S) per slice, broadcast over batch and heads
    sinks = normal(35, (3, 4))
    kv_len = jnp.asarray([6, 3], dtype=jnp.int32)

    def f(q: Any, k: Any, v: Any, m: Any, s: Any) -> Any:
        return SDPA(q, k, v, m, enable_gqa=True, kv_lengths=kv_len, sinks=s,
                    return_lse=True, implementation=path)  # fmt: skip

    def grads(*a: Any) -> Any:
        return jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2), argnums=(0, 3, 4))(*a)

    in_axes = (None, 0, 0, 0, 0)
    out, lse = jax.jit(jax.vmap(f, in_axes=in_axes))(qs[0], ks, vs, masks, sinks)
    mapped = jax.jit(jax.vmap(grads, in_axes=in_axes))(qs[0], ks, vs, masks, sinks)
    one, one_grads = jax.jit(f), jax.jit(grads)
    for i in range(3):
        o, l_ = one(qs[0], ks[i], vs[i], masks[i], sinks[i])
        close(out[i], o, 1e-12)
        close(lse[i], l_, 1e-12)
        for a, b in zip(mapped, one_grads(qs[0], ks[i], vs[i], masks[i], sinks[i]), strict=True):
            close(a[i], b, 1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_residuals_are_the_inputs_the_output_and_the_lse(path: str, capsys: Any) -> None:
    q, k, v = normal(40, (1, 2, 8, 4)), normal(41, (1, 2, 12, 4)), normal(42, (1, 2, 12, 4))

    def f(q: Any, k: Any, v: Any) -> Any:
        return SDPA(q, k, v, is_causal=True, implementation=path)

    print_saved_residuals(f, q, k, v)
    lines = [line for line in capsys.readouterr().out.splitlines() if "[" in line]
    shapes = sorted(line.split("[", 1)[1].split("]", 1)[0] for line in lines)
    # q, k, v, the output and the LSE; no (..., 8, 12) scores or probabilities.
    assert shapes == sorted(["1,2,8,4", "1,2,12,4", "1,2,12,4", "1,2,8,4", "1,2,8"]), lines


# -- dropout ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_dropout_is_the_seeds_mask_and_reproducible(path: str) -> None:
    q, k, v = normal(50, (2, 2, 5, 8)), normal(51, (2, 2, 6, 8)), normal(52, (2, 2, 6, 8))
    p, seed = 0.3, 1234
    keep = jnp.asarray(aa.dropout_mask(np.asarray(q), np.asarray(k), p, seed=seed))

    @functools.partial(jax.jit, static_argnames="seed")
    def ours(q: Any, k: Any, v: Any, seed: Any = seed) -> Any:
        return SDPA(q, k, v, dropout_p=p, seed=seed, is_causal=True, implementation=path)

    def oracle(q: Any, k: Any, v: Any) -> Any:
        return plain(q, k, v, is_causal=True, keep=keep, dropout_p=p)[0]

    d_out = normal(53, (2, 2, 5, 8))
    out, grads = vjp_of(ours, (q, k, v), d_out)
    want_out, want = vjp_of(oracle, (q, k, v), d_out)
    close(out, want_out, 1e-12)
    for a, b in zip(grads, want, strict=True):
        close(a, b, 1e-12)
    # Same seed, same mask: the jitted forward alone is bit-identical run to run, and
    # equals the forward inside vjp up to rounding (on a GPU XLA fuses the two programs
    # differently, so their last bits may differ; the dropped positions may not).
    first = ours(q, k, v)
    assert np.array_equal(ours(q, k, v), first)
    assert np.array_equal(np.asarray(first) == 0, np.asarray(out) == 0)
    close(first, out, 1e-12)
    assert not np.allclose(ours(q, k, v, seed=seed + 1), out)
    # A jax.random key is its uint32 draw (outside jit: a key must be concrete; the
    # traced path is left out here only because it runs slowly outside jit).
    key = jax.random.key(7)
    as_int = int(jax.random.bits(key, (), jnp.uint32))
    if path == "auto":
        by_key = SDPA(q, k, v, dropout_p=p, seed=key, is_causal=True, implementation=path)
        by_int = ours(q, k, v, seed=as_int)
        # (eager against jitted: on a GPU XLA compiles them differently, so only the
        # dropped positions must agree bit for bit)
        assert np.array_equal(np.asarray(by_key) == 0, np.asarray(by_int) == 0)
        close(by_key, by_int, 1e-12)
    # Under vmap each slice gets the mask it gets alone.
    vm = jax.jit(jax.vmap(lambda q: ours(q, k, v)))(jnp.stack([2 * q, q]))
    assert np.allclose(vm[1], out, rtol=0, atol=1e-12)
    assert np.allclose(vm[0], ours(2 * q, k, v), rtol=0, atol=1e-12)


# -- other dtypes ----------------------------------------------------------------------
def test_bfloat16_runs_traced_and_float16_on_the_host() -> None:
    assert aaj.path_for("auto", jnp.bfloat16, "cpu") == (False, "chunked")
    assert aaj.path_for("auto", jnp.float16, "cpu") == (True, "auto")
    assert aaj.path_for("auto", jnp.float32, "gpu") == (False, "chunked")
    q = normal(60, (1, 2, 6, 8), "float32")
    want = jax.grad(lambda q: jnp.sum(xla_peer(q, q, q, is_causal=True)))(q)

    def loss(q: Any) -> Any:
        return jnp.sum(SDPA(q, q, q, is_causal=True).astype(jnp.float32))

    for dtype in ("bfloat16", "float16"):
        g = jax.jit(jax.grad(loss))(q.astype(dtype))
        assert g.dtype == jnp.dtype(dtype)
        close(g.astype(jnp.float32), want, 5e-2)


# -- errors ------------------------------------------------------------------------------
def test_bad_inputs_are_clear_errors_naming_the_argument() -> None:
    q = normal(70, (1, 2, 4, 8), "float32")
    with pytest.raises(TypeError, match=r"query must be a jax.Array \(or a NumPy array\), got "):
        SDPA(np.asarray(q).tolist(), q, q)
    with pytest.raises(TypeError, match="sinks must be a jax.Array .* got builtins.tuple"):
        SDPA(q, q, q, sinks=(0.0, 0.0))  # type: ignore[call-overload]
    assert np.array_equal(SDPA(np.asarray(q), q, q), SDPA(q, q, q))  # as jax.numpy does
    with pytest.raises(TypeError, match="key dtype float64 differs from query dtype float32"):
        SDPA(q, q.astype(jnp.float64), q)
    with pytest.raises(TypeError, match="query must have a real floating dtype"):
        SDPA(q.astype(jnp.int32), q.astype(jnp.int32), q.astype(jnp.int32))
    with pytest.raises(ValueError, match="seed is required with dropout_p=0.1"):
        SDPA(q, q, q, dropout_p=0.1)
    with pytest.raises(TypeError, match="seed must be an int"):
        SDPA(q, q, q, dropout_p=0.1, seed="7")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="seed must be a static int"):
        jax.jit(lambda q, s: SDPA(q, q, q, dropout_p=0.1, seed=s))(q, 3)
    with pytest.raises(TypeError, match="scale must be a static Python value"):
        jax.jit(lambda q, s: SDPA(q, q, q, scale=s))(q, 0.5)
    with pytest.raises(ValueError, match="implementation='fused' cannot run inside a JAX trace"):
        SDPA(q, q, q, implementation="fused")
    with pytest.raises(ValueError, match="implementation='fast' .* got bfloat16"):
        SDPA(*(q.astype(jnp.bfloat16),) * 3, implementation="fast")
    with pytest.raises(ValueError, match="implementation must be one of"):
        SDPA(q, q, q, implementation="nope")


def test_import_without_jax_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for name in [m for m in sys.modules if m == "arrayattn.jax" or m.startswith("arrayattn.jax.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "jax", None)  # what an absent package looks like
    with pytest.raises(
        ImportError, match=r"arrayattn.jax needs JAX.*pip install 'arrayattn\[jax\]'"
    ):
        import arrayattn.jax  # noqa: F401
