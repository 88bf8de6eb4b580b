"""The files of a checkpoint directory, trusted no further than their names: every path
is resolved (symlinks followed) and must stay inside the directory, and must be a regular
file (never a FIFO or a device, whose reads could block or never end); JSON files are
size-capped, strict UTF-8, an object, without duplicate keys."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from .errors import CheckpointError

__all__ = ["checkpoint_file", "read_json", "regular_file_size", "MAX_JSON_BYTES"]

MAX_JSON_BYTES = 64 * 2**20
"""The largest ``config.json`` / index / ``generation_config.json`` read (64 MiB; real ones
are kilobytes, a sharded index of a large model a few megabytes)."""


def _roots(model_dir: Path) -> list[Path]:
    """The folders a checkpoint's files may resolve into: the directory itself, and for
    a Hugging Face hub cache snapshot (``models--org--name/snapshots/<rev>/``, whose files
    are symlinks to ``../../blobs/<hash>``) that repository's ``blobs`` folder."""
    root = model_dir.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots


def checkpoint_file(model_dir: str | Path, name: str, *, named_by: str | None = None) -> Path:
    """``model_dir / name``, refused (:class:`CheckpointError`) unless it stays inside
    ``model_dir`` once resolved: ``name`` must be a relative path without ``..``, and a
    symlink may not point outside (the Hugging Face hub cache's ``snapshots/<rev>`` ->
    ``../../blobs`` links are accepted). Nothing is opened; whether the file exists is the
    caller's question.

    Args:
        model_dir: the checkpoint directory.
        name: a file name from the directory or from a file in it (an index's shard).
        named_by: the file that named ``name``, for the message.

    Examples:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> checkpoint_file(d, "model.safetensors").name
        'model.safetensors'
        >>> try:
        ...     checkpoint_file(d, "../outside.safetensors", named_by="index.json")
        ... except CheckpointError as e:
        ...     print("refused:", "is not a relative path inside" in str(e))
        refused: True
    """
    d = Path(model_dir)
    where = f"{named_by}: " if named_by else f"{d}: "
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{where}file name {name!r} is not a non-empty string")
    posix, win = PurePosixPath(name), PureWindowsPath(name)
    if (
        posix.is_absolute()
        or win.is_absolute()
        or win.drive
        or ".." in posix.parts
        or (".." in win.parts)
    ):
        raise CheckpointError(
            f"{where}{name!r} is not a relative path inside the checkpoint directory "
            f"{d} (absolute paths and '..' are refused; nothing outside it is read)"
        )
    path = d / name
    try:
        resolved, roots = path.resolve(), _roots(d)
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before 3.13)
        raise CheckpointError(f"{where}{name!r} cannot be resolved ({e})") from None
    if not any(resolved.is_relative_to(r) for r in roots):
        raise CheckpointError(
            f"{where}{name!r} resolves to {resolved}, outside the checkpoint directory "
            f"{roots[0]} (a symlink out of it); nothing outside it is read"
        )
    return path


def regular_file_size(path: Path, *, what: str = "file") -> int:
    """The size of ``path`` in bytes; :class:`CheckpointError` unless it is a regular file
    (a FIFO or device could block or never end), the ``OSError`` when it is missing."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: the {what} is not a regular file (mode {st.st_mode:o})")
    return st.st_size


def _object_without_duplicates(source: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointError(f"{source}: key {key!r} appears twice in one JSON object")
            out[key] = value
        return out

    return hook


def parse_json(raw: bytes, source: str) -> Any:
    """``raw`` as strict UTF-8 JSON: :class:`CheckpointError` naming ``source`` and the
    position on invalid UTF-8 or JSON, duplicate keys, or nesting too deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{source}: not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r}); "
            f"the file is corrupt"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=_object_without_duplicates(source))
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except RecursionError:
        raise CheckpointError(f"{source}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer literal beyond Python's digit limit
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: not readable JSON ({e})") from None


def read_json(path: str | Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON object file (``config.json``, an index), read without trusting it.

    Shapes: none; returns the object as a dict.

    Raises:
        CheckpointError: naming ``path``: not a regular file, larger than ``max_bytes``,
            not UTF-8, not JSON, a key twice in one object, or not an object at the top.
        OSError: the file is missing or cannot be opened.

    Examples:
        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
        >>> with open(path, "w") as f:
        ...     f.write("[1, 2]")
        6
        >>> try:
        ...     read_json(path)
        ... except CheckpointError as e:
        ...     print(str(e).rsplit(": ", 1)[1])
        expected a JSON object ({...}), got a list
    """
    p = Path(path)
    size = regular_file_size(p, what="JSON file")
    if size > max_bytes:
        raise CheckpointError(
            f"{p}: {size} bytes, more than the {max_bytes} a JSON file here may have"
        )
    with open(p, "rb") as f:
        raw = f.read(size + 1)  # size is known and capped: no max_bytes buffer
    obj = parse_json(raw, str(p))
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p}: expected a JSON object ({{...}}), got a {type(obj).__name__}")
    return obj
