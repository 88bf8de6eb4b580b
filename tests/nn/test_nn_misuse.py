"""Misuse table of the module layer (issue 12, item 13 and the sweep around it): every
bad argument to ``MultiHeadAttention``, ``KVCache`` and ``PagedKVCache`` is a
``TypeError``/``ValueError`` (``KeyError`` for parameter names) that names the argument,
what was seen and what was expected; and a rejected module call leaves its cache as it
was."""

from __future__ import annotations

import numpy as np
import pytest

from arrayattn.nn import KVCache, MultiHeadAttention, PagedKVCache

MHA = MultiHeadAttention(embed_dim=8, num_heads=2, rope="half", causal=True)
ROPELESS = MultiHeadAttention(embed_dim=8, num_heads=2)
P = MHA.init(seed=0, xp=np)
X = np.ones((2, 3, 8), np.float32)


def call(**kw):
    return lambda: MHA(P, X, **kw)


def config(**kw):
    return lambda: MultiHeadAttention(**{"embed_dim": 8, "num_heads": 2, **kw})


# (label, action, exception, regex the message must match: argument, seen, expected)
TABLE = [
    # configuration
    (
        "norm_eps str",
        config(norm_eps="x"),
        TypeError,
        r"norm_eps must be a real number, got str 'x'",
    ),
    (
        "dropout_p str",
        config(dropout_p="a"),
        TypeError,
        r"dropout_p must be a real number, got str 'a'",
    ),
    ("dropout_p 1", config(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (
        "embed_dim float",
        config(embed_dim=8.0),
        TypeError,
        r"embed_dim must be a positive int, got float 8.0",
    ),
    ("num_heads 0", config(num_heads=0), ValueError, r"num_heads must be a positive int, got 0"),
    ("v_head_dim 0", config(v_head_dim=0), ValueError, r"v_head_dim must be a positive int, got 0"),
    ("bias str", config(bias="yes"), TypeError, r"bias must be a bool, got str 'yes'"),
    ("causal int", config(causal=1), TypeError, r"causal must be a bool, got int 1"),
    (
        "window 1-tuple",
        config(window=(1,)),
        ValueError,
        r"window must be None or \(left, right\).*got \(1,\)",
    ),
    ("window < -1", config(window=(-2, 0)), ValueError, r"window must be .* >= -1.*got \(-2, 0\)"),
    (
        "softcap negative",
        config(softcap=-1.0),
        ValueError,
        r"softcap must be > 0 or None, got -1.0",
    ),
    (
        "softcap str",
        config(softcap="a"),
        TypeError,
        r"softcap must be a real number or None, got str",
    ),
    ("scale nan", config(scale=float("nan")), ValueError, r"scale must be finite, got nan"),
    ("rope_theta 0", config(rope_theta=0), ValueError, r"rope_theta must be > 0, got 0"),
    (
        "qk_norm_scope",
        config(qk_norm_scope="all"),
        ValueError,
        r"qk_norm_scope must be one of \('head', 'full'\), got 'all'",
    ),
    (
        "packed widths",
        config(packed_qkv=True, value_context_dim=5),
        ValueError,
        r"packed_qkv needs .*value_context_dim=5",
    ),
    # parameters
    (
        "params None",
        lambda: MHA(None, X),
        TypeError,
        r"params must be a mapping .* got NoneType None",
    ),
    (
        "params list",
        lambda: MHA(list(P.items()), X),
        TypeError,
        r"params must be a mapping .* got list",
    ),
    (
        "list parameter",
        lambda: MHA({**P, "q_proj.weight": P["q_proj.weight"].tolist()}, X),
        TypeError,
        r"params\['q_proj.weight'\] must be an array, got list",
    ),
    (
        "parameter shape",
        lambda: MHA({**P, "q_proj.weight": np.zeros((8, 5), np.float32)}, X),
        ValueError,
        r"params\['q_proj.weight'\] has shape \(8, 5\), expected \(8, 8\)",
    ),
    # call arguments
    (
        "positions float",
        call(positions=2.5),
        TypeError,
        r"positions must be an int or an integer array .* got float 2.5",
    ),
    (
        "positions bool",
        call(positions=True),
        TypeError,
        r"positions must be an int or an integer array .* got bool True",
    ),
    (
        "positions shape",
        call(positions=np.arange(4)),
        ValueError,
        r"positions must be .* L=3, got shape \(4,\)",
    ),
    (
        "positions complex",
        call(positions=np.arange(3) * 1j),
        TypeError,
        r"positions must have an integer dtype, got complex128",
    ),
    (
        "positions and freqs",
        call(positions=1, freqs=np.ones((3, 2), np.complex64)),
        ValueError,
        r"positions or freqs, not both",
    ),
    (
        "freqs real",
        call(freqs=np.ones((3, 2), np.float32)),
        TypeError,
        r"freqs must be complex .* got float32",
    ),
    (
        "freqs length",
        call(freqs=np.ones((4, 2), np.complex64)),
        ValueError,
        r"freqs must be \(L, F\).* L=3, got shape \(4, 2\)",
    ),
    (
        "freqs without rope",
        lambda: ROPELESS(ROPELESS.init(seed=0, xp=np), X, freqs=np.ones((3, 2), np.complex64)),
        ValueError,
        r"freqs needs a rope layout",
    ),
    (
        "x width",
        lambda: MHA(P, np.ones((2, 3, 5), np.float32)),
        ValueError,
        r"x must have shape \(..., L, embed_dim=8\), got \(2, 3, 5\)",
    ),
    (
        "attn_mask int",
        call(attn_mask=np.ones((3, 3), np.int64)),
        TypeError,
        r"attn_mask must be bool .* or real floating .* got int64",
    ),
    (
        "attn_mask list",
        call(attn_mask=[[True]]),
        TypeError,
        r"attn_mask must be an array from an array-API library, got list",
    ),
    ("lengths float", call(lengths=[1.5, 2]), TypeError, r"lengths must hold ints, got float 1.5"),
    ("lengths count", call(lengths=[1, 2, 3]), ValueError, r"lengths must have 2 entries .* got 3"),
    ("lengths range", call(lengths=[4, 2]), ValueError, r"lengths\[0\] = 4 is outside \[0, 3\]"),
    (
        "lengths scalar",
        call(lengths=3),
        TypeError,
        r"lengths must be a sequence or 1-D integer array of 2 counts, got int 3",
    ),
    (
        "lengths float array",
        call(lengths=np.array([1.0, 2.0])),
        TypeError,
        r"lengths must have an integer dtype, got float64",
    ),
    (
        "padding_side",
        call(padding_side="top", lengths=[1, 2]),
        ValueError,
        r"padding_side must be one of \('right', 'left'\), got 'top'",
    ),
    (
        "left without lengths",
        call(padding_side="left"),
        ValueError,
        r'padding_side="left" needs lengths',
    ),
    (
        "left with mask",
        call(padding_side="left", lengths=[1, 2], attn_mask=np.ones((3, 3), bool)),
        ValueError,
        r"attn_mask cannot be combined with padding_side=\"left\"",
    ),
    ("training str", call(training="no"), TypeError, r"training must be a bool, got str 'no'"),
    ("seed float", call(seed=1.5), TypeError, r"seed must be an int or None, got float 1.5"),
    (
        "need_weights str",
        call(need_weights="y"),
        TypeError,
        r"need_weights must be a bool, got str 'y'",
    ),
    (
        "cache type",
        call(cache={}),
        TypeError,
        r"cache must be a KVCache, PagedKVCache or CascadeKVCache, got dict",
    ),
    (
        "cache rows",
        call(cache=MHA.new_cache(3, 8)),
        ValueError,
        r"cache has 3 sequences \(rows\) but x has 2 rows",
    ),
    (
        "cache heads",
        call(cache=KVCache.allocate(2, 1, 8, 4)),
        ValueError,
        r"cache holds \(num_kv_heads, head_dim, value_dim\) = \(1, 4, 4\), this layer needs "
        r"\(2, 4, 4\)",
    ),
    (
        "cache 4-D x",
        lambda: MHA(P, np.ones((1, 2, 3, 8), np.float32), cache=MHA.new_cache(1, 8)),
        ValueError,
        r"with a cache or lengths, x must be \(B, L, embed_dim\), got \(1, 2, 3, 8\)",
    ),
    (
        "paged need_weights",
        call(cache=MHA.new_paged_cache(2, 4, 4), need_weights=True),
        ValueError,
        r"need_weights is not supported with a PagedKVCache",
    ),
    (
        "value without context",
        call(value=X),
        ValueError,
        r"value \(the values' input\) needs context",
    ),
    (
        "rope with context",
        lambda: MHA(P, X, X),
        ValueError,
        r"context \(cross-attention\) with rope is not supported",
    ),
    # load
    (
        "load None",
        lambda: MHA.load(None),
        TypeError,
        r"state_dict must be a mapping of names to arrays, got NoneType",
    ),
    (
        "load rename",
        lambda: MHA.load(P, rename=5),
        TypeError,
        r"rename must be a mapping, a callable or None, got int",
    ),
    (
        "load list tensor",
        lambda: MHA.load({**P, "o_proj.bias": [0.0] * 8}),
        TypeError,
        r"state_dict\['o_proj.bias'\] must be an array .* got list",
    ),
    ("load missing", lambda: MHA.load({}), KeyError, r"missing \['k_proj.bias'"),
    (
        "load duplicate",
        lambda: MHA.load(
            {**P, "q.weight": P["q_proj.weight"]}, rename={"q.weight": "q_proj.weight"}
        ),
        ValueError,
        r"'q_proj.weight' and 'q.weight' both map to 'q_proj.weight'",
    ),
    # caches
    (
        "KVCache length float",
        lambda: KVCache(np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2)), length=2.5),
        TypeError,
        r"length must be an int >= 0, got float 2.5",
    ),
    (
        "KVCache length range",
        lambda: KVCache(np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2)), length=5),
        ValueError,
        r"length must be in \[0, 4\] \(max_length\), got 5",
    ),
    (
        "KVCache dtypes",
        lambda: KVCache(np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2), np.float32)),
        TypeError,
        r"keys \(float64\) and values \(float32\) must share a dtype",
    ),
    (
        "allocate float dim",
        lambda: KVCache.allocate(1, 1, 4, 2.0),
        TypeError,
        r"head_dim must be an int >= 1, got float 2.0",
    ),
    (
        "allocate bool",
        lambda: KVCache.allocate(True, 1, 4, 2),
        TypeError,
        r"batch_size must be an int >= 1, got bool True",
    ),
    (
        "reset row",
        lambda: KVCache.allocate(2, 1, 4, 2).reset(5),
        ValueError,
        r"rows must be in \[0, 2\), got 5",
    ),
    (
        "append width",
        lambda: KVCache.allocate(1, 1, 4, 2).append(np.zeros((1, 1, 1, 3)), np.zeros((1, 1, 1, 2))),
        ValueError,
        r"key must have shape \(B, Hkv, l, D\) = \(1, 1\) \+ \(l, 2\), got \(1, 1, 1, 3\)",
    ),
    (
        "paged page_size",
        lambda: PagedKVCache(batch_size=1, num_pages=2, page_size=1.5, num_kv_heads=1, head_dim=2),
        TypeError,
        r"page_size must be an int >= 1, got float 1.5",
    ),
    (
        "paged free row",
        lambda: PagedKVCache(
            batch_size=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2
        ).free(3),
        ValueError,
        r"rows must be in \[0, 1\), got 3",
    ),
    (
        "paged query",
        lambda: PagedKVCache(
            batch_size=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2
        ).attend(np.zeros((2, 1, 1, 2))),
        ValueError,
        r"query must be \(B=1, Hq, L, D\), got \(2, 1, 1, 2\)",
    ),
]


@pytest.mark.parametrize("label, action, error, message", TABLE, ids=[t[0] for t in TABLE])
def test_misuse_is_a_clear_error(label, action, error, message):
    with pytest.raises(error, match=message):
        action()


def test_integral_numbers_of_any_type_are_accepted():
    cache = KVCache.allocate(np.int64(1), np.int32(2), np.int64(4), np.int64(2), xp=np)
    assert (cache.batch_size, cache.num_kv_heads, cache.max_length, cache.head_dim) == (1, 2, 4, 2)
    mha = MultiHeadAttention(
        embed_dim=np.int64(8), num_heads=np.int64(2), norm_eps=np.float32(1e-5)
    )
    assert mha.dim_per_head == 4
    y = MHA(P, X, positions=np.int64(3))
    assert y.shape == X.shape


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_every_rejected_cached_call_leaves_the_cache_unchanged(kind):
    """Issue 12 item 2, over the whole table of call misuses that reach a cache."""
    cache = MHA.new_cache(2, 8) if kind == "contiguous" else MHA.new_paged_cache(2, 8, 2)
    MHA(P, X, cache=cache)
    state = (cache.lengths.tolist(), getattr(cache, "block_tables", None))
    bad = [
        dict(attn_mask=np.ones((2, 1, 1, 6), np.int8)),
        dict(attn_mask=np.ones((2, 1, 1, 7), bool)),
        dict(positions=0.5),
        dict(lengths=[1, 4]),
        dict(freqs=np.ones((3, 2), np.float32)),
        dict(seed=2.5, training=True),
    ]
    for kw in bad:
        with pytest.raises((TypeError, ValueError)):
            MHA(P, X, cache=cache, **kw)
        assert (cache.lengths.tolist(), getattr(cache, "block_tables", None)) == state, kw
    with pytest.raises(TypeError):  # parameters of another dtype than the cache
        MHA({k: v.astype(np.float64) for k, v in P.items()}, X.astype(np.float64), cache=cache)
    assert (cache.lengths.tolist(), getattr(cache, "block_tables", None)) == state


def test_a_prompt_longer_than_the_cache_names_the_cache():
    """A prompt longer than the cache's capacity: the error names the cache, its capacity
    and the tokens asked for, not an argument ("lengths") the caller never passed."""
    mha = MultiHeadAttention(8, 2, causal=True)
    params = mha.init(seed=0, xp=np)
    prompt = np.ones((1, 6, 8), np.float32)
    for cache, words in (
        (mha.new_cache(1, 4), "KV cache overflow in sequence 0: 0 cached + 6 new tokens > "
                              "its capacity max_length=4"),
        (mha.new_paged_cache(1, num_pages=1, page_size=4), "paged KV cache overflow"),
    ):  # fmt: skip
        with pytest.raises(ValueError) as err:
            mha(params, prompt, cache=cache)
        assert words in str(err.value) and "lengths[0]" not in str(err.value)
        assert cache.lengths.tolist() == [0]  # nothing written
