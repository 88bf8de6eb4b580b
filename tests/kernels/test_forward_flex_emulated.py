"""Block masks (``arrayattn.flex``) in the forward kernels, on the CPU: ``fused.py`` with a
NumPy-backed stand-in for CuPy (``test_fused_glue.py``'s) builds the block table and the
partial blocks' bits (``cuda/flex_table.py``) and launches ``attn_fwd.cu``'s kernels under
the host emulator (``forward_emulator_launch.cpp``): v2 ``aa_fwd_tc2``, v1 ``aa_fwd_tc``
and the CUDA-core ``aa_fwd_simt``, each against a float64 reference with the mask_mod
evaluated densely (``test_forward_emulated.reference``). One ThreadSanitizer run.

Also the host side alone: the table layout against ``BlockMask.kinds``, the bits against
the mask_mod, and the fused path's choices (what it declines, and the backward it takes).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import _tsan as tsan
import numpy as np
import pytest
import test_fused_glue as glue
from test_forward_emulated import Case, reference

from arrayattn.attention import block_mask as bmod
from arrayattn.attention.cuda import _loader, flex_pred, flex_table, fused
from arrayattn.attention.spec import make_spec
from arrayattn.flex import (
    and_masks,
    create_block_mask,
    document_mask,
    global_tokens_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    """test_fused_glue's stand-in cupy (NumPy arrays, kernels replayed on the emulator),
    with NumPy arrays taken for CuPy's by fused.declines."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulator")
    work = tmp_path_factory.mktemp("flex_glue")
    monkeypatch.setitem(sys.modules, "cupy", glue._fake_cupy(work))
    monkeypatch.setattr(_loader, "_KERNELS", {})
    monkeypatch.setattr(fused, "POISON_OUTPUTS", True)
    monkeypatch.setattr(fused, "is_cupy", lambda xp: True)
    return work


def _dense(bm, B: int, Hq: int, L: int, S: int) -> np.ndarray:
    """The mask_mod on every pair: (B, Hq, L, S) bool."""
    b = np.arange(B, dtype=np.int32).reshape(B, 1, 1, 1)
    h = np.arange(Hq, dtype=np.int32).reshape(1, Hq, 1, 1)
    i = np.arange(L, dtype=np.int32).reshape(L, 1)
    j = np.arange(S, dtype=np.int32)
    return np.broadcast_to(bm.mask_mod(b, h, i, j), (B, Hq, L, S))


def _run(
    monkeypatch,
    variant: str,
    dtype,
    d: int,
    bm,
    *,
    B: int,
    Hq: int,
    Hkv: int,
    L: int,
    S: int,
    attn_mask=None,
    sinks: bool = False,
    q_lens=None,
    kv_lens=None,
    causal: bool = False,
    bottom_right: bool = False,
    want: str,
    predicate: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """fused.forward with ``bm`` on the emulator vs the float64 dense reference; with
    ``predicate`` set, ARRAYATTN_FLEX_PREDICATE=1/0 and a check that the kernel was (not)
    compiled with the mask_mod's predicate. Returns ``(out, lse)`` in float64."""
    monkeypatch.setenv("ARRAYATTN_FWD_VARIANT", variant)
    if predicate is not None:
        monkeypatch.setenv(flex_pred.PREDICATE_ENV, "1" if predicate else "0")
    del glue.PRELUDES[:]
    launched: list[str] = []
    real = _loader.get_kernel
    monkeypatch.setattr(
        _loader, "get_kernel", lambda f, n, *a: launched.append(n) or real(f, n, *a)
    )
    rng = np.random.default_rng(7)
    q = (rng.standard_normal((B, Hq, L, d)) * 1.5).astype(dtype)
    k = (rng.standard_normal((B, Hkv, S, d)) * 1.5).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, d)).astype(dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    sk = (rng.standard_normal(Hq) * 2.0).astype(acc) if sinks else None
    kw: dict = {}
    if q_lens is not None:
        kw["q_lengths"] = np.asarray(q_lens)
    if kv_lens is not None:
        kw["kv_lengths"] = np.asarray(kv_lens)
    spec = make_spec(
        q, k, v, attn_mask, 0.0, causal, None, Hq != Hkv,
        "bottom_right" if bottom_right else "top_left", None, None, None,
        sinks=sk, block_mask=bm, **kw,
    )  # fmt: skip
    assert fused.declines(spec) is None, fused.declines(spec)
    out, lse = fused.FUSED.forward(spec, q, k, v, attn_mask)
    assert launched and all(n.startswith(want) for n in launched), launched
    mode = flex_table.predicate(bm) is not None  # (a table per device and path)
    tables = [key for key in bm._tables if key[0] == "cuda_flex_table" and key[2] == mode]
    assert len(tables) == 1  # the table is cached on the block mask
    if predicate is not None:  # the kernel was compiled with the predicate, or without
        assert glue.PRELUDES and all(("AA_FLEX_PRED" in p) == predicate for p in glue.PRELUDES)

    # float64 reference: the mask_mod dense, ANDed with the dense bool mask
    dense = _dense(bm, B, Hq, L, S)
    if attn_mask is not None:
        dense = dense & np.broadcast_to(attn_mask, dense.shape)
    kind = {np.float16: "float16", np.float32: "float32", np.float64: "float64"}[dtype]
    case = Case(
        kind, d, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, causal=causal, bottom_right=bottom_right,
        mask_kind=1, q_lens=None if q_lens is None else tuple(q_lens),
        kv_lens=None if kv_lens is None else tuple(kv_lens), sinks=sinks,
    )  # fmt: skip
    x = {"q": q.astype(np.float64), "k": k.astype(np.float64), "v": v.astype(np.float64)}
    if sinks:
        x["sinks"] = np.broadcast_to(sk.astype(np.float64), (B, Hq))
    ref_out, ref_lse = reference(case, x, dense)
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="empty rows differ")
    assert (out[empty] == 0).all(), "empty rows must give exactly 0"
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert err <= {np.float16: 3e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype], err
    fin = ~empty
    lse_err = np.max(np.abs(lse[fin] - ref_lse[fin]) / np.maximum(1, np.abs(ref_lse[fin])))
    assert lse_err <= {np.float16: 1e-4, np.float32: 1e-5, np.float64: 1e-12}[dtype], lse_err
    return out, lse


def _doc_ids(L: int, lengths: list[int]) -> np.ndarray:
    ids = np.repeat(np.arange(len(lengths)), lengths)
    assert ids.size == L
    return ids


@pytest.mark.slow
def test_v2_document_causal_gqa_sinks(fake_cupy, monkeypatch) -> None:
    """aa_fwd_tc2 at D = 128: packed documents (causal), GQA, sinks, L = S = 330 (ragged),
    block size (128, 64): empty, full and partial blocks, the prefetch jumping over empty
    ones."""
    L = 330
    bm = create_block_mask(
        document_mask(_doc_ids(L, [20, 250, 40, 20]), causal=True), None, None, L, L,
        block_size=(128, 64),
    )  # fmt: skip
    kinds = set(np.unique(bm.kinds).tolist())
    assert kinds == {bmod.EMPTY, bmod.PARTIAL, bmod.FULL}, kinds
    _run(monkeypatch, "v2", np.float16, 128, bm, B=1, Hq=4, Hkv=2, L=L, S=L, sinks=True,
         want="aa_fwd_tc2<0, 128, false, 4, false>")  # fmt: skip


@pytest.mark.slow
def test_v2_d96_document_causal_lengths(fake_cupy, monkeypatch) -> None:
    """aa_fwd_tc2 at D = 96 (ARRAYATTN_FWD_TC2_D96=1) with a block mask: packed documents
    (causal), GQA, per-batch lengths, L = S = 200 (ragged); empty, full and partial blocks."""
    monkeypatch.setenv("ARRAYATTN_FWD_TC2_D96", "1")
    L = 200
    bm = create_block_mask(
        document_mask(_doc_ids(L, [30, 120, 50]), causal=True), None, None, L, L,
        block_size=(128, 64),
    )  # fmt: skip
    _run(monkeypatch, "v3", np.float16, 96, bm, B=2, Hq=2, Hkv=1, L=L, S=L,
         q_lens=[200, 150], kv_lens=[200, 170],
         want="aa_fwd_tc2<0, 96, false, 4, false>")  # fmt: skip


@pytest.mark.slow
def test_v3_tf32_document_causal_gqa_sinks_lengths(fake_cupy, monkeypatch) -> None:
    """aa_fwd_tf32 (v3, float32 on tensor cores) at D = 128 through fused.py: packed
    documents (causal), GQA, sinks, per-batch lengths, block size (128, 64) over 64 x 32
    tiles; float32's 1e-5 against float64."""
    L = 300
    bm = create_block_mask(
        document_mask(_doc_ids(L, [20, 200, 50, 30]), causal=True), None, None, L, L,
        block_size=(128, 64),
    )  # fmt: skip
    _run(monkeypatch, "v3", np.float32, 128, bm, B=2, Hq=2, Hkv=1, L=L, S=L, sinks=True,
         q_lens=[300, 170], kv_lens=[300, 250],
         want="aa_fwd_tf32<128, false, 4, false>")  # fmt: skip


@pytest.mark.slow
def test_v1_window_global_lengths_boolmask(fake_cupy, monkeypatch) -> None:
    """aa_fwd_tc (v1): sliding window + global tokens, ragged L = 300 / S = 280, per-batch
    lengths, GQA, and a dense bool mask ANDed (MASK = 1 | 4)."""
    B, Hq, L, S = 2, 2, 300, 280
    mod = or_masks(sliding_window_mask(48, 0), global_tokens_mask(16))
    bm = create_block_mask(mod, None, None, L, S)
    rng = np.random.default_rng(1)
    mask = rng.random((L, S)) < 0.9
    _run(monkeypatch, "v1", np.float16, 64, bm, B=B, Hq=Hq, Hkv=1, L=L, S=S,
         attn_mask=mask, q_lens=[300, 190], kv_lens=[280, 150],
         want="aa_fwd_tc<0, 64, 2, false, false, 5>")  # fmt: skip


@pytest.mark.slow
def test_simt_prefix_lm_per_batch_bottom_right_sinks(fake_cupy, monkeypatch) -> None:
    """aa_fwd_simt (float32): prefix-LM with per-batch prefixes (a B = 2 block mask),
    bottom-right causal alignment and lengths ANDed, sinks; a batch with no key."""
    B, L, S = 2, 200, 260
    bm = create_block_mask(prefix_lm_mask(np.array([50, 150])), B, None, L, S)
    _run(monkeypatch, "v2", np.float32, 64, bm, B=B, Hq=2, Hkv=2, L=L, S=S, sinks=True,
         causal=True, bottom_right=True, q_lens=[200, 120], kv_lens=[260, 0],
         want="aa_fwd_simt<float, 64, false, false, 4>")  # fmt: skip


@pytest.mark.slow
def test_simt_f64_mid_word_tiles_per_head(fake_cupy, monkeypatch) -> None:
    """aa_fwd_simt (float64, D = 256: 32 x 16 tiles): block size (96, 48), so key tiles
    start mid-word in the bits (words of 48 keys); a per-head mask_mod (H = Hq)."""
    B, Hq, L, S = 1, 2, 150, 170

    def mod(b, h, q_idx, kv_idx):  # head 0: window of 20; head 1: even keys or diagonal
        return ((h == 0) & (abs(q_idx - kv_idx) <= 20)) | (
            (h == 1) & ((kv_idx % 2 == 0) | (q_idx == kv_idx))
        )

    bm = create_block_mask(mod, B, Hq, L, S, block_size=(96, 48))
    _run(monkeypatch, "v2", np.float64, 256, bm, B=B, Hq=Hq, Hkv=1, L=L, S=S,
         want="aa_fwd_simt<double, 256, false, false, 4>")  # fmt: skip


# -- built-in mask_mods evaluated in the kernels (flex_pred.py) ---------------------------------
def _pred_cases() -> dict[str, tuple]:
    """name -> (mask_mod, B of the block mask, block size, run keyword arguments): every
    built-in under the predicate, block sizes that do not divide L, GQA and lengths."""
    L, S = 200, 230
    ids2 = np.stack([_doc_ids(L, [60, 100, 40]), _doc_ids(L, [150, 50])])
    kv2 = np.stack([_doc_ids(S, [80, 100, 50]), _doc_ids(S, [30, 200])])
    win_glob = or_masks(sliding_window_mask(40, 0), global_tokens_mask(12))
    return {
        # self documents, not causal, per-batch ids, GQA (v2, D = 64: 128 x 64 tiles)
        "document_self": (document_mask(ids2), 2, (128, 64),
                          dict(variant="v2", dtype=np.float16, d=64, B=2, Hq=4, Hkv=2, L=L,
                               S=L, want="aa_fwd_tc2<0, 64, false, 4, false>")),
        # q/kv documents differing, causal, lengths (v1 tensor cores, D = 96)
        "document_qkv_causal": (document_mask(ids2, kv2, causal=True), 2, (128, 64),
                                dict(variant="v1", dtype=np.float16, d=96, B=2, Hq=2, Hkv=1,
                                     L=L, S=S, q_lens=[200, 130], kv_lens=[230, 170],
                                     want="aa_fwd_tc<0, 96,")),
        # per-batch prefix-LM, lengths, sinks (CUDA cores, float64 at D = 256: 32 x 16
        # tiles starting mid-word in the bits path's 48-key rows)
        "prefix_lm": (prefix_lm_mask(np.array([50, 150])), 2, (96, 48),
                      dict(variant="v2", dtype=np.float64, d=256, B=2, Hq=2, Hkv=2, L=L, S=S,
                           sinks=True, q_lens=[200, 120], kv_lens=[230, 90],
                           want="aa_fwd_simt<double, 256, false, false, 4>")),
        # window + global tokens, GQA (v3, float32 on tensor cores)
        "window_global": (win_glob, None, (128, 64),
                          dict(variant="v3", dtype=np.float32, d=128, B=1, Hq=2, Hkv=1, L=L,
                               S=S, want="aa_fwd_tf32<128, false, 4, false>")),
        # and/or: (window or global) and documents, causal alignment of a dense bool mask
        "and_or": (and_masks(win_glob, document_mask(_doc_ids(L, [90, 110]))), None, (128, 64),
                   dict(variant="v2", dtype=np.float16, d=128, B=1, Hq=2, Hkv=2, L=L, S=L,
                        want="aa_fwd_tc2<0, 128, false, 4, false>")),
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_pred_cases()))
def test_predicate_equals_bits_and_reference(fake_cupy, monkeypatch, name) -> None:
    """The predicate path (the mask_mod compiled into the kernel, no bits in the table)
    and the bits path (ARRAYATTN_FLEX_PREDICATE=0) each against the float64 reference,
    and bit for bit equal to each other (same scores, same masking)."""
    mod, Bm, block, kw = _pred_cases()[name]
    bm = create_block_mask(mod, Bm, None, kw["L"], kw["S"], block_size=block)
    assert (bm.kinds == bmod.PARTIAL).any()
    assert flex_pred.generate(bm.mask_mod, bm.kinds.shape[0]) is not None
    out_p, lse_p = _run(monkeypatch, bm=bm, predicate=True, **kw)
    out_b, lse_b = _run(monkeypatch, bm=bm, predicate=False, **kw)
    np.testing.assert_array_equal(out_p, out_b)
    np.testing.assert_array_equal(lse_p, lse_b)


@pytest.mark.slow
def test_v2_document_no_data_race(fake_cupy, monkeypatch, tmp_path: Path) -> None:
    """ThreadSanitizer over aa_fwd_tc2 with a block mask (the listed-tile prefetch into
    the other stage; the document mask_mod evaluated in the kernel, AA_FLEX_PRED): no
    report, and the result still matches."""
    if not tsan.program_runs(tmp_path):
        pytest.skip("g++ cannot build and run a -fsanitize=thread program here")
    built: dict[str, Path] = {}

    def exe(name: str, work: Path, prelude: str = "") -> Path:
        if name + prelude not in built:
            out = tmp_path / f"tsan_{len(built)}"
            cmd = ["g++", "-std=c++20", *tsan.FLAGS, "-pthread", "-I", str(glue.HERE), "-I",
                   str(tsan.KERNELS), f"-DAA_KERNEL={name}", f"-DAA_CFG={glue._cfg(name)}",
                   *glue.prelude_args(prelude, work),
                   str(glue.HERE / "forward_emulator_launch.cpp"), "-o", str(out)]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-3000:]
            built[name + prelude] = out
        return built[name + prelude]

    monkeypatch.setattr(glue, "_exe", exe)
    real_run = subprocess.run

    def run(cmd, *a, **kw):  # the replay: fail on a ThreadSanitizer report
        res = real_run(cmd, *a, **kw)
        if isinstance(cmd, list) and str(cmd[0]).startswith(str(tmp_path / "tsan_")):
            assert tsan.REPORT not in res.stderr, res.stderr[:6000]
        return res

    monkeypatch.setattr(glue.subprocess, "run", run)
    L = 200
    bm = create_block_mask(
        document_mask(_doc_ids(L, [30, 120, 50]), causal=True), None, None, L, L,
        block_size=(128, 64),
    )  # fmt: skip
    _run(monkeypatch, "v2", np.float16, 64, bm, B=1, Hq=2, Hkv=1, L=L, S=L, predicate=True,
         want="aa_fwd_tc2<0, 64, false, 4, false>")  # fmt: skip


# -- host side only (no emulator) ---------------------------------------------------------
def test_table_layout_and_bits(monkeypatch) -> None:
    """The table against BlockMask.kinds (counts, ascending lists, partial ids) and the
    bits against the mask_mod, including a ragged last block and B/H broadcasting (the
    bits path: ARRAYATTN_FLEX_PREDICATE=0, else a built-in has no bits)."""
    monkeypatch.setenv(flex_pred.PREDICATE_ENV, "0")
    L, S = 200, 170
    ids = np.stack([_doc_ids(L, [60, 140]), _doc_ids(L, [150, 50])])
    kv_ids = ids[:, :S]
    bm = create_block_mask(document_mask(ids, kv_ids), 2, None, L, S, block_size=(64, 48))
    import array_api_compat.numpy as xnp

    t = np.asarray(flex_table.build(bm, xnp))
    nq, nk, tsb, tsh, qb, kb, wpr, oc, ol, ob = t[:10]
    Bt, Ht = bm.kinds.shape[:2]
    assert (nq, nk, qb, kb, wpr) == (4, 4, 64, 48, 2) and (tsb, tsh) == (Ht, 0)
    counts = t[oc:ol].reshape(Bt, Ht, nq)
    lists = t[ol : t[10]].reshape(Bt, Ht, nq, nk + 1, 2)  # (transposed lists after)
    words = t[ob:].view(np.uint32).reshape(-1, qb, wpr)
    dense = _dense(bm, 2, 1, L, S)
    seen = 0
    for b in range(Bt):
        for qi in range(nq):
            row = bm.kinds[b, 0, qi]
            listed = lists[b, 0, qi, : counts[b, 0, qi]]
            np.testing.assert_array_equal(listed[:, 0], np.nonzero(row)[0])
            assert tuple(lists[b, 0, qi, counts[b, 0, qi]]) == (nk, -1)  # the end pair
            for kj, pid in listed:
                assert (pid >= 0) == (row[kj] == bmod.PARTIAL)
                if pid < 0:
                    continue
                seen += 1
                bits = np.unpackbits(words[pid].view(np.uint8), bitorder="little")
                bits = bits.reshape(qb, wpr * 32)[:, :kb].astype(bool)
                r1, c1 = min(L, (qi + 1) * qb), min(S, (kj + 1) * kb)
                want = dense[b, 0, qi * qb : r1, kj * kb : c1]
                np.testing.assert_array_equal(bits[: r1 - qi * qb, : c1 - kj * kb], want)
                assert not bits[r1 - qi * qb :].any() and not bits[:, c1 - kj * kb :].any()
    assert seen == int((bm.kinds == bmod.PARTIAL).sum()) > 0


def _spec(bm=None, mask_mod=None, score_mod=None, dtype=np.float16, d=64, L=256, S=256):
    q = np.zeros((1, 2, L, d), dtype)
    k = np.zeros((1, 2, S, d), dtype)
    return make_spec(q, k, k, None, 0.0, False, None, False, "top_left", None, None, None,
                     block_mask=bm, mask_mod=mask_mod, score_mod=score_mod)  # fmt: skip


def test_declines_and_routes(fake_cupy, monkeypatch) -> None:
    """What the kernels decline (score_mod, a plain mask_mod function without a block
    mask, block sizes the tiles do not divide) and which kernel runs a block mask: v2 at
    D = 64 and 128, v1 at other head dims and when v2's 64-key tiles do not fit."""
    from arrayattn.flex import causal_mask, softcap_score_mod

    L = 256
    assert "score_mod" in fused.declines(_spec(score_mod=softcap_score_mod(5.0)))

    def plain(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    assert "without a block mask" in fused.declines(_spec(mask_mod=plain))
    bm = create_block_mask(causal_mask, None, None, L, L)
    assert fused.declines(_spec(bm)) is None
    assert fused.declines(_spec(mask_mod=causal_mask)) is None  # built-in: make_spec's mask
    for d, variant in ((64, "v2"), (128, "v2"), (96, "v2"), (256, "v1")):
        spec = _spec(bm, d=d)
        assert fused._launch(spec, "float16", d, None).variant == variant
    monkeypatch.setenv("ARRAYATTN_FWD_TC2_D96", "0")  # v1 at D = 96 (the switch off)
    assert fused._launch(_spec(bm, d=96), "float16", 96, None).variant == "v1"
    monkeypatch.delenv("ARRAYATTN_FWD_TC2_D96")
    bm32 = create_block_mask(causal_mask, None, None, L, L, block_size=(128, 32))
    assert "multiple of the kernel's" in fused.declines(_spec(bm32))  # D = 64: 64-key tiles
    assert fused.declines(_spec(bm32, d=128)) is None  # v1 at D = 128: 32-key tiles
    assert fused._launch(_spec(bm32, d=128), "float16", 128, None).variant == "v1"
    odd = create_block_mask(causal_mask, None, None, L, L, block_size=(100, 100))
    assert "multiple of the kernel's" in fused.declines(_spec(odd))
    assert "multiple of the kernel's" in fused.declines(_spec(odd, dtype=np.float32))
    from arrayattn.attention.cuda import decode

    dec = _spec(create_block_mask(causal_mask, None, None, 4, L), L=4)
    assert "flex" in decode.declines(dec, False)


def test_backward_routing_of_block_masks(fake_cupy, monkeypatch) -> None:
    """FusedAttention.backward sends a block-mask call to the backward kernels where
    backward.declines takes it (the default since they ran on a GPU), and to the
    array-API backward with ARRAYATTN_FLEX_BWD_KERNELS=0, whatever declines says."""
    from arrayattn.attention.cuda import backward as kernels_backward
    from arrayattn.flex import causal_mask

    calls: list[str] = []
    monkeypatch.setattr(kernels_backward, "declines", lambda spec: None)
    monkeypatch.setattr(kernels_backward, "backward", lambda *a: calls.append("kernel"))
    monkeypatch.setattr(
        fused.composed, "backward", lambda *a: calls.append("composed") or (None,) * 4
    )
    spec = _spec(create_block_mask(causal_mask, None, None, 256, 256))
    monkeypatch.delenv(kernels_backward.FLEX_ENV, raising=False)
    fused.FUSED.backward(spec, *(None,) * 8)
    monkeypatch.setenv(kernels_backward.FLEX_ENV, "0")
    fused.FUSED.backward(spec, *(None,) * 8)
    assert calls == ["kernel", "composed"]
