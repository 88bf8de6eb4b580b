"""The safetensors of a checkpoint directory as ``save_pretrained`` writes it: one
``model.safetensors``, or shards listed by ``model.safetensors.index.json``, or (neither)
every ``*.safetensors``. Every file is checked to stay inside the directory before it is
opened; the headers of all shards are validated and cross-checked (no tensor in two
shards, the index and the shards agree) before any tensor data is read."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .files import checkpoint_file, read_json
from .safetensors import TensorInfo, read_safetensors, read_safetensors_header

__all__ = ["INDEX_NAME", "safetensors_files", "read_checkpoint_headers", "read_checkpoint_tensors"]

INDEX_NAME = "model.safetensors.index.json"


def _exists(path: Path) -> bool:
    return os.path.lexists(path)  # a dangling symlink counts: it is then refused or missing


def _index_shards(d: Path) -> tuple[list[Path], dict[str, str]]:
    index = checkpoint_file(d, INDEX_NAME)
    obj = read_json(index)
    weight_map = obj.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index}: field 'weight_map' must be an object of tensor name -> shard file, "
            f"got {type(weight_map).__name__ if weight_map is not None else 'nothing'}"
        )
    if not weight_map:
        raise CheckpointError(f"{index}: field 'weight_map' lists no tensor")
    files: dict[str, Path] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(
                f"{index}: weight_map[{tensor!r}] must be a shard file name, got {shard!r:.80}"
            )
        if shard not in files:
            path = checkpoint_file(d, shard, named_by=str(index))
            if not _exists(path):
                raise CheckpointError(
                    f"{index}: weight_map[{tensor!r}] names shard {shard!r}, which is not in {d}"
                )
            files[shard] = path
    return [files[s] for s in sorted(files)], weight_map


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint directory, each checked to stay inside
    it (see :func:`checkpoint_file`): the shards its index lists, else
    ``model.safetensors``, else every ``*.safetensors``.

    Raises:
        CheckpointError: a corrupt index (not JSON, ``weight_map`` not an object of file
            names), a shard named outside the directory (``../x``, an absolute path, a
            symlink out), a shard that does not exist, no file at all.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> from arrayattn.nn.checkpoint import write_safetensors
        >>> write_safetensors(os.path.join(d, "model.safetensors"),
        ...                   {"w": np.zeros(2, np.float32)})
        >>> [p.name for p in safetensors_files(d)]
        ['model.safetensors']
    """
    d = Path(model_dir)
    if _exists(d / INDEX_NAME):
        return _index_shards(d)[0]
    if _exists(d / "model.safetensors"):
        return [checkpoint_file(d, "model.safetensors")]
    files = [checkpoint_file(d, p.name) for p in sorted(d.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors file (a save_pretrained directory)")
    return files


def read_checkpoint_headers(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory (name -> :class:`TensorInfo`, which names
    its file), from the validated headers of its files; no tensor data is read.

    Raises:
        CheckpointError: see :func:`safetensors_files` and :func:`read_safetensors_header`;
            a tensor in two files; an index listing a tensor its shard lacks, or a shard
            holding a tensor its index does not list.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> from arrayattn.nn.checkpoint import write_safetensors
        >>> write_safetensors(os.path.join(d, "model.safetensors"),
        ...                   {"w": np.zeros((2, 3), np.float32)})
        >>> read_checkpoint_headers(d)["w"].shape
        (2, 3)
    """
    d = Path(model_dir)
    weight_map: dict[str, str] | None = None
    if _exists(d / INDEX_NAME):
        files, weight_map = _index_shards(d)
    else:
        files = safetensors_files(d)
    out: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_safetensors_header(path).tensors.items():
            if name in out:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is also in {out[name].file.name}: a tensor may "
                    f"be in one file only"
                )
            out[name] = info
    if weight_map is not None:
        index = d / INDEX_NAME
        for name, shard in weight_map.items():
            if name not in out or out[name].file != d / shard:
                raise CheckpointError(
                    f"{index}: weight_map[{name!r}] says shard {shard!r}, but "
                    + (f"it is in {out[name].file.name}" if name in out else "no shard holds it")
                )
        unlisted = sorted(set(out) - set(weight_map))
        if unlisted:
            raise CheckpointError(
                f"{out[unlisted[0]].file}: tensor {unlisted[0]!r} is not listed in {index}'s "
                f"weight_map ({len(unlisted)} such)"
            )
    return out


def read_checkpoint_tensors(
    headers: Mapping[str, TensorInfo],
    names: Iterable[str] | None = None,
    *,
    check_finite: bool = True,
) -> dict[str, np.ndarray]:
    """The data of ``names`` (default all) of :func:`read_checkpoint_headers`' result, read
    file by file with exactly the bytes each tensor needs.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> from arrayattn.nn.checkpoint import write_safetensors
        >>> write_safetensors(os.path.join(d, "model.safetensors"),
        ...                   {"w": np.ones(2, np.float32)})
        >>> read_checkpoint_tensors(read_checkpoint_headers(d))["w"].tolist()
        [1.0, 1.0]
    """
    wanted = list(headers) if names is None else list(names)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(headers[name].file, []).append(name)
    out: dict[str, np.ndarray] = {}
    for path, group in by_file.items():
        out.update(read_safetensors(path, names=group, check_finite=check_finite))
    return {n: out[n] for n in wanted}
