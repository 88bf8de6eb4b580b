"""Hypothesis properties of attention over random shapes (L != S, odd lengths, Hq/Hkv
ratios), on every backend. Data is drawn with NumPy from a drawn seed and moved with
``backend.asarray`` so every backend sees the same numbers."""

from __future__ import annotations

import _reference as ref
import numpy as np
from _helpers import attention_inputs, xp_assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayattn as aa
from arrayattn.testing.strategies import attention_problems as attention_problem

SDPA = aa.scaled_dot_product_attention


def _settings(backend, n: int = 25):
    # JAX compiles every new shape (about a second each): a few examples there.
    return settings(
        max_examples=2 if backend.compiles_per_shape else n,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )


def _inputs(problem, dtype="float64"):
    q_shape, k_shape, mask, kwargs, seed = problem
    rng = np.random.default_rng(seed)
    L, S = q_shape[-2], k_shape[-2]
    m = None if mask is None else (mask, (q_shape[0], 1, L, S))
    return attention_inputs(rng, q_shape, k_shape, None, m, dtype=dtype), kwargs


def test_probabilities_are_row_stochastic_or_zero(backend):
    @_settings(backend)
    @given(attention_problem())
    def check(problem):
        (q, k, _, m), kwargs = _inputs(problem)
        _, _, expected = ref.attention(q, k, k, m, **kwargs)
        mb = None if m is None else backend.asarray(m)
        w = backend.to_numpy(
            backend.call(aa.attention_weights, backend.asarray(q), backend.asarray(k), mb, **kwargs)
        )
        assert np.all(w >= 0)
        rows = w.sum(axis=-1)
        empty = expected.sum(axis=-1) == 0
        np.testing.assert_allclose(rows[~empty], 1.0, rtol=1e-12)
        np.testing.assert_array_equal(w[empty], 0.0)
        np.testing.assert_allclose(w, expected, rtol=1e-10, atol=1e-12)

    check()


def test_permuting_keys_and_values_together(backend):
    @_settings(backend)
    @given(attention_problem(structure=False), st.randoms(use_true_random=False))
    def check(problem, random):
        (q, k, v, m), kwargs = _inputs(problem)
        S = k.shape[-2]
        perm = list(range(S))
        random.shuffle(perm)
        perm = np.array(perm)
        args = [backend.asarray(a) for a in (q, k, v)]
        mb = None if m is None else backend.asarray(m)
        out, lse = backend.call(SDPA, *args, mb, return_lse=True, **kwargs)
        pargs = [backend.asarray(a) for a in (q, k[..., perm, :], v[..., perm, :])]
        pm = None if m is None else backend.asarray(m[..., perm])
        out_p, lse_p = backend.call(SDPA, *pargs, pm, return_lse=True, **kwargs)
        xp_assert_close(backend, out_p, backend.to_numpy(out), rtol=1e-10, atol=1e-12)
        xp_assert_close(backend, lse_p, backend.to_numpy(lse), rtol=1e-10, atol=1e-12)

    check()


def test_causal_output_ignores_future_keys(backend):
    @_settings(backend)
    @given(attention_problem(structure=False), st.sampled_from(["top_left", "bottom_right"]))
    def check(problem, align):
        (q, k, v, m), kwargs = _inputs(problem)
        kwargs = dict(kwargs, is_causal=True, causal_align=align)
        L, S = q.shape[-2], k.shape[-2]
        offset = 0 if align == "top_left" else S - L
        rng = np.random.default_rng(problem[-1] + 1)
        k2, v2 = k + rng.standard_normal(k.shape), v + rng.standard_normal(v.shape)
        mb = None if m is None else backend.asarray(m)
        out = backend.to_numpy(
            backend.call(SDPA, *(backend.asarray(a) for a in (q, k, v)), mb, **kwargs)
        )
        for i in range(L):
            last = i + offset  # keys j > last are in query i's future
            kp, vp = k.copy(), v.copy()
            if last + 1 < S:
                kp[..., max(last + 1, 0) :, :] = k2[..., max(last + 1, 0) :, :]
                vp[..., max(last + 1, 0) :, :] = v2[..., max(last + 1, 0) :, :]
            out_p = backend.to_numpy(
                backend.call(SDPA, *(backend.asarray(a) for a in (q, kp, vp)), mb, **kwargs)
            )
            np.testing.assert_allclose(out_p[..., i, :], out[..., i, :], rtol=1e-12, atol=1e-14)
            if backend.compiles_per_shape:
                break

    check()


def test_gqa_equals_repeat_kv_then_attention(backend):
    @_settings(backend)
    @given(attention_problem())
    def check(problem):
        (q, k, v, m), kwargs = _inputs(problem)
        G = q.shape[-3] // k.shape[-3]
        kwargs = dict(kwargs, enable_gqa=True)
        mb = None if m is None else backend.asarray(m)
        qb, kb, vb = (backend.asarray(a) for a in (q, k, v))
        grouped = backend.call(SDPA, qb, kb, vb, mb, **kwargs)
        kr, vr = aa.repeat_kv(kb, G), aa.repeat_kv(vb, G)
        plain = backend.call(SDPA, qb, kr, vr, mb, **dict(kwargs, enable_gqa=False))
        xp_assert_close(backend, grouped, backend.to_numpy(plain), rtol=1e-10, atol=1e-12)

    check()


def test_lse_merges_two_halves_of_the_keys(backend):
    @_settings(backend)
    @given(attention_problem(), st.data())
    def check(problem, data):
        (q, k, v, m), kwargs = _inputs(problem)
        S = k.shape[-2]
        if S < 2:
            return
        cut = data.draw(st.integers(1, S - 1))
        # structure depends on absolute key positions: express it as a dense bool mask
        allowed = ref.structural_mask(
            q.shape[-2],
            S,
            is_causal=kwargs.pop("is_causal", False),
            causal_align=kwargs.pop("causal_align", "top_left"),
            window=kwargs.pop("window", None),
        )
        if m is None:
            m = allowed
        elif m.dtype == np.bool_:
            m = m & allowed
        else:
            m = np.where(allowed, m, -np.inf)
        mb = backend.asarray(m)
        qb = backend.asarray(q)
        out, lse = backend.call(
            SDPA, qb, backend.asarray(k), backend.asarray(v), mb, return_lse=True, **kwargs
        )
        parts = []
        for sl in (slice(0, cut), slice(cut, S)):
            o_i, l_i = backend.call(
                SDPA,
                qb,
                backend.asarray(k[..., sl, :]),
                backend.asarray(v[..., sl, :]),
                backend.asarray(np.ascontiguousarray(m[..., sl])),
                return_lse=True,
                **kwargs,
            )
            parts.append((backend.to_numpy(o_i), backend.to_numpy(l_i)))
        (o1, l1), (o2, l2) = parts
        merged_lse = np.logaddexp(l1, l2)
        safe = np.where(np.isfinite(merged_lse), merged_lse, 0.0)
        w1 = np.where(np.isfinite(l1), np.exp(l1 - safe), 0.0)[..., None]
        w2 = np.where(np.isfinite(l2), np.exp(l2 - safe), 0.0)[..., None]
        xp_assert_close(backend, out, w1 * o1 + w2 * o2, rtol=1e-10, atol=1e-12)
        xp_assert_close(backend, lse, merged_lse, rtol=1e-10, atol=1e-12)

    check()


def test_rope_preserves_norms_and_is_relative(backend):
    @_settings(backend)
    @given(
        st.sampled_from(["interleaved", "half"]),
        st.integers(1, 4).map(lambda n: 2 * n),
        st.integers(0, 50),
        st.integers(0, 50),
        st.integers(0, 100),
        st.integers(0, 2**32 - 1),
    )
    def check(layout, D, m, n, shift, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((2, 3, D))
        xb = backend.asarray(x)
        xp = backend.xp

        def rope(vec, pos):
            f = aa.rope_frequencies(D, backend.asarray(np.array([pos])), dtype=xp.float64)
            return backend.to_numpy(backend.call(aa.apply_rope, vec, f, layout=layout))

        pos = backend.asarray(np.arange(m, m + 3))
        f = aa.rope_frequencies(D, pos, dtype=xp.float64)
        y = backend.to_numpy(backend.call(aa.apply_rope, xb, f, layout=layout))
        np.testing.assert_allclose(
            np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12
        )
        qv = backend.asarray(x[:1, :1])
        kv = backend.asarray(x[1:, 1:2])
        a = np.sum(rope(qv, m) * rope(kv, n))
        b = np.sum(rope(qv, m + shift) * rope(kv, n + shift))
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)

    check()


def test_dropout_masks_identical_across_backends(backend):
    @_settings(backend)
    @given(attention_problem(structure=False), st.integers(0, 2**40), st.floats(0.05, 0.95))
    def check(problem, seed, p):
        (q, k, _, _), kwargs = _inputs(problem, dtype="float32")
        gqa = kwargs["enable_gqa"]
        expected = aa.dropout_mask(q, k, p, seed=seed, enable_gqa=gqa)
        got = backend.call(
            aa.dropout_mask,
            backend.asarray(q),
            backend.asarray(k),
            dropout_p=p,
            seed=seed,
            enable_gqa=gqa,
        )
        np.testing.assert_array_equal(backend.to_numpy(got), expected)

    check()
