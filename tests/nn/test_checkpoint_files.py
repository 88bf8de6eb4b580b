"""Hostile checkpoint files (issue 35): ``arrayattn.nn.checkpoint`` reads a
``.safetensors`` file, a JSON file or a checkpoint directory without trusting it.

Each damaged file is made from a good one written by the ``safetensors`` library
itself, then cut, bit-flipped or given a rewritten header. Every case must be a
:class:`CheckpointError` (a ``ValueError``, never ``KeyError``/``MemoryError``/
``UnicodeDecodeError``/``IndexError``) naming the file and the tensor or field, raised
with little memory allocated (``tracemalloc`` peak, which NumPy reports to) even when the
header claims 2**60 bytes; where the ``safetensors`` library (the format's reference
reader) also rejects the file, that is asserted too. Good files read equal to the
reference's arrays. Files named outside a checkpoint directory are never opened
(an audit hook records every ``open``).
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from arrayattn.nn import CheckpointError, read_safetensors
from arrayattn.nn.checkpoint import (
    checkpoint_file,
    read_checkpoint_headers,
    read_checkpoint_tensors,
    read_json,
    read_safetensors_header,
    safetensors_files,
)

st = pytest.importorskip("safetensors.numpy")

TENSORS = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.arange(5, dtype=np.float16),
    "c": np.array([[1, -2], [3, 4]], dtype=np.int64),
}
MAX_PEAK = 8 * 2**20  # bytes any failing read may allocate (the good file is 120 bytes)

# -- opened files, recorded by an audit hook (it cannot be removed: it is gated) ---------
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _opened(action):
    global _OPENED
    _OPENED = []
    try:
        action()
    except CheckpointError:
        pass
    finally:
        seen, _OPENED = _OPENED, None
    return seen


# -- making damaged files -------------------------------------------------------------------
def write_good(path: Path) -> Path:
    st.save_file(TENSORS, str(path), metadata={"format": "np"})
    return path


def split(path: Path) -> tuple[int, bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def write_raw(path: Path, header: bytes, data: bytes, n: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)


def rewrite(path: Path, change) -> None:
    """The header as a dict, changed by ``change`` (in place), written back before the
    same data."""
    _, header, data = split(path)
    obj = json.loads(header)
    change(obj)
    write_raw(path, json.dumps(obj).encode(), data)


def _cut_header(p):
    n, header, _ = split(p)
    write_raw(p, header[: n // 2], b"", n=n)


def _cut_data(p):
    p.write_bytes(p.read_bytes()[:-3])


def _flip_utf8(p):
    n, header, data = split(p)
    write_raw(p, header.replace(b'"a"', b'"\xff"'), data)


def _flip_json(p):
    n, header, data = split(p)
    write_raw(p, header.replace(b":", b";", 1), data)


def _huge_prefix(p):
    _, header, data = split(p)
    write_raw(p, header, data, n=2**60)


def _set(name, key, value):
    def change(obj):
        obj[name][key] = value

    return lambda p: rewrite(p, change)


def _duplicate_key(p):
    _, header, data = split(p)
    obj = json.loads(header)
    dup = json.dumps(obj["a"])
    text = json.dumps(obj)[:-1] + f', "a": {dup}}}'
    write_raw(p, text.encode(), data)


def _overlap(p):
    def change(obj):
        a, c = obj["a"]["data_offsets"], obj["c"]["data_offsets"]
        # c (32 bytes) moved to start 8 bytes into a (48 bytes)
        obj["c"]["data_offsets"] = [a[0] + 8, a[0] + 8 + (c[1] - c[0])]

    rewrite(p, change)


def _put(key, value):
    return lambda obj: obj.__setitem__(key, value)


# (label, damage, regex the message must match after the file name, reference rejects it)
DAMAGE = [
    ("empty file", lambda p: p.write_bytes(b""), r"0 bytes, too short", True),
    ("cut in the length", lambda p: p.write_bytes(p.read_bytes()[:5]), r"too short", True),
    ("cut in the header", _cut_header, r"header length prefix says \d+ bytes but only", True),
    ("cut in the data", _cut_data, r"tensor '\w'.*past the end of the data region", True),
    ("prefix 2**60", _huge_prefix, r"says 1152921504606846976 bytes but only", True),
    ("header not UTF-8", _flip_utf8, r"not valid UTF-8 \(byte \d+", True),
    ("header not JSON", _flip_json, r"not valid JSON \(Expecting", True),
    ("header a list", lambda p: write_raw(p, b"[1, 2]", b""), r"must be a JSON object", True),
    ("name twice", _duplicate_key, r"key 'a' appears twice", False),
    ("dtype unknown", _set("a", "dtype", "F7"), r"tensor 'a': dtype 'F7' is not one", True),
    ("dtype not str", _set("a", "dtype", 4), r"tensor 'a': dtype 4 is not one", True),
    ("shape negative", _set("a", "shape", [-3, 4]), r"tensor 'a': shape must be", True),
    ("shape floats", _set("a", "shape", [3.0, 4]), r"tensor 'a': shape must be", True),
    ("shape too big", _set("a", "shape", [3, 5]), r"'a': shape \(3, 5\) of F32 needs 60", True),
    ("offsets past end", _set("b", "data_offsets", [0, 10**15]), r"'b': data_offsets", True),
    ("offsets reversed", _set("b", "data_offsets", [10, 0]), r"'b': data_offsets must", True),
    ("offsets one int", _set("b", "data_offsets", [3]), r"'b': data_offsets must", True),
    ("overlap", _overlap, r"tensors '\w' and '\w' overlap", True),
    ("entry lacks shape", lambda p: rewrite(p, lambda o: o["a"].pop("shape")), r"lacks", True),
    ("entry a string", lambda p: rewrite(p, _put("a", "x")), r"'a': header entry", True),
    (
        "metadata not str",
        lambda p: rewrite(p, _put("__metadata__", {"k": 1})),
        r"__metadata__",
        True,
    ),
]


@pytest.mark.parametrize(
    "label, damage, pattern, reference_rejects", DAMAGE, ids=[d[0] for d in DAMAGE]
)
def test_damaged_safetensors_is_a_clear_error_before_allocating(
    tmp_path, label, damage, pattern, reference_rejects
):
    path = write_good(tmp_path / "model.safetensors")
    damage(path)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            read_safetensors(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert re.search(pattern, message), message
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, (KeyError, MemoryError, UnicodeError, IndexError))
    assert peak < MAX_PEAK, f"{label}: {peak} bytes allocated before the error"
    # the header alone fails the same way
    with pytest.raises(CheckpointError):
        read_safetensors_header(path)
    if reference_rejects:  # the format's reference reader agrees the file is bad
        with pytest.raises(Exception):  # noqa: B017 - it raises its own types
            st.load_file(str(path))


def test_good_file_reads_as_the_reference_reads_it(tmp_path):
    path = write_good(tmp_path / "model.safetensors")
    ref = st.load_file(str(path))
    got = read_safetensors(path)
    assert set(got) == set(ref)
    for name, a in ref.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        np.testing.assert_array_equal(got[name], a)
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "np"}
    assert read_safetensors(path, names=["b"]).keys() == {"b"}
    with pytest.raises(CheckpointError, match="no tensor 'zz'"):
        read_safetensors(path, names=["zz"])
    # a zero-size tensor and a bool tensor
    st.save_file(
        {"e": np.zeros((0, 3), np.float32), "m": np.array([True, False])},
        str(tmp_path / "z.safetensors"),
    )
    z = read_safetensors(tmp_path / "z.safetensors")
    assert z["e"].shape == (0, 3) and z["m"].tolist() == [True, False]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_name_file_and_tensor_or_load_when_allowed(tmp_path, bad):
    w = np.ones((4, 3), np.float32)
    w[2, 1] = bad
    path = tmp_path / "model.safetensors"
    st.save_file({"ok": np.ones(2, np.float32), "w": w}, str(path))
    with pytest.raises(CheckpointError, match=r"tensor 'w' holds 1 non-finite values.*\(2, 1\)"):
        read_safetensors(path)
    got = read_safetensors(path, check_finite=False)
    np.testing.assert_array_equal(got["w"], w)
    assert read_safetensors(path, names=["ok"])["ok"].tolist() == [1.0, 1.0]


def test_not_a_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)  # opening it would block until a writer came
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_safetensors(fifo)
    with pytest.raises(FileNotFoundError):
        read_safetensors(tmp_path / "absent.safetensors")


# -- JSON files ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, pattern",
    [
        (b'{"a": 1,}', r"not valid JSON \(.*line 1 column"),
        (b'{"a": "\xff"}', r"not valid UTF-8 \(byte 7"),
        (b"[1, 2]", r"expected a JSON object .*got a list"),
        (b'{"a": 1, "a": 2}', r"key 'a' appears twice"),
        (b"[" * 100000 + b"]" * 100000, r"nested too deeply|JSON object"),
        (b'{"a": ' + b"9" * 5000 + b"}", r"not readable JSON|not valid JSON"),
    ],
    ids=["json", "utf8", "list", "duplicate", "deep", "huge int"],
)
def test_corrupt_json_is_a_clear_error(tmp_path, raw, pattern):
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=pattern) as info:
        read_json(path)
    assert str(info.value).startswith(str(path))


def test_json_larger_than_the_cap_is_not_read(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"a": "' + b"x" * 2000 + b'"}')
    with pytest.raises(CheckpointError, match=r"2009 bytes, more than the 1000"):
        read_json(path, max_bytes=1000)


# -- directories: nothing outside is read -----------------------------------------------------
def _sharded(d: Path, shard_names: dict[str, str]) -> None:
    """Tensors of TENSORS written to the shards ``shard_names`` maps them to, and an
    index listing them."""
    d.mkdir(exist_ok=True)
    by_shard: dict[str, dict] = {}
    for name, shard in shard_names.items():
        by_shard.setdefault(shard, {})[name] = TENSORS[name]
    for shard, tensors in by_shard.items():
        if "/" not in shard and not os.path.isabs(shard):
            st.save_file(tensors, str(d / shard))
    index = {"metadata": {}, "weight_map": shard_names}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_directory_reads_every_tensor(tmp_path):
    d = tmp_path / "ckpt"
    _sharded(d, {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"})
    assert [p.name for p in safetensors_files(d)] == ["s1.safetensors", "s2.safetensors"]
    got = read_checkpoint_tensors(read_checkpoint_headers(d))
    for name, a in TENSORS.items():
        np.testing.assert_array_equal(got[name], a)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "symlinked dir"])
def test_index_naming_a_file_outside_is_refused_before_reading(tmp_path, how):
    d = tmp_path / "ckpt"
    outside = write_good(tmp_path / "outside.safetensors")
    if how == "dotdot":
        shard = "../outside.safetensors"
    elif how == "absolute":
        shard = str(outside)
    elif how == "symlink":
        shard = "s2.safetensors"
    else:
        shard = "sub/outside.safetensors"
    _sharded(d, {"a": "s1.safetensors", "b": shard})
    if how == "symlink":
        (d / shard).unlink()
        (d / shard).symlink_to(outside)
    if how == "symlinked dir":
        (d / "sub").symlink_to(tmp_path)
    pattern = "not a relative path" if how in ("dotdot", "absolute") else "outside the checkpoint"
    with pytest.raises(CheckpointError, match=pattern) as info:
        read_checkpoint_headers(d)
    assert str(info.value).startswith(str(d / "model.safetensors.index.json"))
    opened = _opened(lambda: read_checkpoint_headers(d))
    assert opened, "the audit hook saw nothing"
    outside_reads = [p for p in opened if os.path.realpath(p) == os.path.realpath(outside)]
    assert not outside_reads, f"read a file outside the checkpoint: {outside_reads}"


def test_glob_and_single_file_symlinks_out_are_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    outside = write_good(tmp_path / "outside.safetensors")
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        safetensors_files(d)
    (d / "model.safetensors").unlink()
    (d / "evil.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="'evil.safetensors' resolves to"):
        read_checkpoint_headers(d)
    assert not [p for p in _opened(lambda: read_checkpoint_headers(d)) if "outside" in p]


def test_hub_cache_snapshot_links_to_blobs_are_followed(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    write_good(repo / "blobs" / "0123abcd")
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / "0123abcd")
    got = read_checkpoint_tensors(read_checkpoint_headers(snap))
    np.testing.assert_array_equal(got["a"], TENSORS["a"])
    # but a snapshot link beyond the repository is still refused
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(write_good(tmp_path / "elsewhere.safetensors"))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        read_checkpoint_headers(snap)


@pytest.mark.parametrize(
    "index, pattern",
    [
        ({"weight_map": ["s1.safetensors"]}, r"'weight_map' must be an object.*got list"),
        ({"metadata": {}}, r"'weight_map' must be an object.*got nothing"),
        ({"weight_map": {}}, r"lists no tensor"),
        ({"weight_map": {"a": 3}}, r"weight_map\['a'\] must be a shard file name"),
        ({"weight_map": {"a": "missing.safetensors"}}, r"names shard 'missing.safetensors', wh"),
        ({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}, r"'b'\] says shard"),
        ({"weight_map": {"a": "s1.safetensors"}}, r"tensor 'c' is not listed"),
        ({"weight_map": {"a": ""}}, r"is not a non-empty string"),
    ],
    ids=[
        "list",
        "absent",
        "empty",
        "not str",
        "missing shard",
        "wrong shard",
        "unlisted",
        "empty name",
    ],
)
def test_corrupt_index_is_a_clear_error(tmp_path, index, pattern):
    d = tmp_path / "ckpt"
    d.mkdir()
    st.save_file({"a": TENSORS["a"]}, str(d / "s1.safetensors"))
    st.save_file({"b": TENSORS["b"], "c": TENSORS["c"]}, str(d / "s2.safetensors"))
    if "not listed" in pattern:
        index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=pattern) as info:
        read_checkpoint_headers(d)
    assert "model.safetensors.index.json" in str(info.value) or "s2.safetensors" in str(info.value)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    st.save_file({"a": TENSORS["a"]}, str(d / "x.safetensors"))
    st.save_file({"a": TENSORS["a"] + 1}, str(d / "y.safetensors"))
    with pytest.raises(CheckpointError, match=r"y.safetensors: tensor 'a' is also in x.safe"):
        read_checkpoint_headers(d)


def test_checkpoint_file_refuses_traversal_names(tmp_path):
    for name in ("../x", "/etc/passwd", "a/../../x", "C:\\x", "..\\x", "a\x00b"):
        with pytest.raises(CheckpointError):
            checkpoint_file(tmp_path, name)
    assert checkpoint_file(tmp_path, "sub/x.safetensors") == tmp_path / "sub" / "x.safetensors"


def test_write_safetensors_is_read_by_the_reference(tmp_path):
    from arrayattn.nn.checkpoint import write_safetensors

    path = tmp_path / "w.safetensors"
    tensors = {**TENSORS, "m": np.array([True, False, True]), "e": np.zeros((2, 0), np.float64)}
    write_safetensors(path, tensors, metadata={"format": "np"})
    ref = st.load_file(str(path))
    assert set(ref) == set(tensors)
    for name, a in tensors.items():
        assert ref[name].dtype == a.dtype and ref[name].shape == a.shape
        np.testing.assert_array_equal(ref[name], a)
    assert split(path)[0] % 8 == 0  # the data region starts aligned, as the library writes
    with pytest.raises(TypeError, match=r"tensors\['x'\] has dtype complex64"):
        write_safetensors(path, {"x": np.zeros(2, np.complex64)})
