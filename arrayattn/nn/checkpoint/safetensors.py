"""``.safetensors`` files read without trusting them.

The format is an 8-byte little-endian header length ``n``, a UTF-8 JSON header of ``n``
bytes (tensor name -> ``dtype``, ``shape``, ``data_offsets`` into the data region; an
optional ``__metadata__`` of strings) and the data region. Before any tensor data is
read or any array allocated, the whole header is checked against the file's size: the
length prefix fits the file (a prefix of ``2**60`` allocates nothing), the header is
UTF-8 JSON without a name twice, every dtype is known, every ``data_offsets`` pair lies
inside the data region and spans exactly ``prod(shape) * itemsize`` bytes, and no two
tensors overlap. Data is then read with exactly the bytes each tensor needs, so memory
is bounded by the file's size (BF16, widened to float32, by twice that).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .errors import CheckpointError
from .files import parse_json, regular_file_size

__all__ = [
    "SAFETENSORS_DTYPES",
    "MAX_HEADER_BYTES",
    "TensorInfo",
    "SafetensorsHeader",
    "read_safetensors_header",
    "read_safetensors",
    "check_finite_array",
    "write_safetensors",
]

MAX_HEADER_BYTES = 100 * 2**20
"""The largest header read (100 MiB, the ``safetensors`` library's own limit)."""

# safetensors dtype name -> the little-endian NumPy dtype its bytes are read as. BF16 is
# read as uint16 and widened to float32 exactly (a bfloat16 is a float32's top half);
# BOOL as uint8 (any non-zero byte is True).
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "u1",
}

_FLOATS = ("F64", "F32", "F16", "BF16")
_FINITE_BLOCK = 2**20  # elements checked at a time: no temporary the size of a tensor


class TensorInfo(NamedTuple):
    """One tensor of a validated header.

    Attributes:
        file: the ``.safetensors`` file.
        dtype: the safetensors dtype name (``"BF16"``, ``"F32"``, ...).
        shape: the declared shape.
        offset: where its bytes start, from the start of the file.
        nbytes: how many bytes it has (``prod(shape) * itemsize``).
    """

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: ``tensors`` (name -> :class:`TensorInfo`, in header order),
    ``metadata`` (the ``__metadata__`` strings) and the file's ``size``."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    size: int


_NAME_OF = {
    np.dtype(v).newbyteorder("<"): k
    for k, v in SAFETENSORS_DTYPES.items()
    if k not in ("BF16", "BOOL")
}


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write NumPy arrays as a ``.safetensors`` file (what ``safetensors.numpy.save_file``
    writes, without that package; no BF16, which NumPy lacks).

    Shapes: any; each array is stored C-contiguous, little-endian.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        >>> write_safetensors(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
        >>> read_safetensors(path)["w"].tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if a.dtype == np.bool_:
            kind, a = "BOOL", a.astype(np.uint8)
        else:
            le = a.dtype.newbyteorder("<")
            if le not in _NAME_OF:
                raise TypeError(
                    f"tensors[{name!r}] has dtype {a.dtype}, which has no safetensors name"
                )
            kind, a = _NAME_OF[le], a.astype(le)
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": kind,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_info(p: Path, name: str, info: Any, data_start: int, data_len: int) -> TensorInfo:
    where = f"{p}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{where}: header entry must be an object with dtype, shape and data_offsets, "
            f"got {type(info).__name__}"
        )
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointError(
            f"{where}: header entry lacks {missing} (expected dtype, shape, data_offsets)"
        )
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where}: dtype {dtype!r} is not one this reader knows "
            f"(expected one of {', '.join(SAFETENSORS_DTYPES)})"
        )
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of ints >= 0, got {shape!r:.80}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_nonneg_int(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(
            f"{where}: data_offsets must be [begin, end] ints with 0 <= begin <= end, got "
            f"{offsets!r:.80}"
        )
    begin, end = int(offsets[0]), int(offsets[1])
    if end > data_len:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] run past the end of the data region "
            f"({data_len} bytes after the header): the file is truncated or corrupt"
        )
    itemsize = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
    nbytes = math.prod(int(d) for d in shape) * itemsize
    if end - begin != nbytes:
        raise CheckpointError(
            f"{where}: shape {tuple(shape)} of {dtype} needs {nbytes} bytes but its "
            f"data_offsets [{begin}, {end}] span {end - begin}"
        )
    return TensorInfo(p, dtype, tuple(int(d) for d in shape), data_start + begin, nbytes)


def _check_no_overlap(p: Path, tensors: Mapping[str, TensorInfo]) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, n) for n, t in tensors.items() if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise CheckpointError(
                f"{p}: tensors {a!r} and {b!r} overlap in the data region (bytes "
                f"{begin_b}..{end_a} of the file belong to both)"
            )


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """The header of a ``.safetensors`` file, validated against the file's size; no tensor
    data is read.

    Shapes: none (the declared shapes are in the result).

    Raises:
        CheckpointError: naming the file (and the tensor): not a regular file; shorter
            than the 8-byte length prefix; a prefix larger than the rest of the file or
            than :data:`MAX_HEADER_BYTES`; a header that is not UTF-8 JSON, not an object,
            names a tensor twice, has an entry without ``dtype``/``shape``/``data_offsets``
            or with an unknown dtype; offsets outside the data region, not spanning
            ``prod(shape) * itemsize`` bytes, or overlapping another tensor's;
            ``__metadata__`` that is not an object of strings.
        OSError: the file is missing or cannot be opened.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        >>> write_safetensors(path, {"w": np.zeros((2, 3), np.float32)})
        >>> info = read_safetensors_header(path).tensors["w"]
        >>> info.dtype, info.shape, info.nbytes
        ('F32', (2, 3), 24)
    """
    p = Path(path)
    size = regular_file_size(p, what="safetensors file")
    if size < 8:
        raise CheckpointError(
            f"{p}: {size} bytes, too short for the 8-byte header length: the file is "
            f"truncated or not a safetensors file"
        )
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(
                f"{p}: the header length prefix says {n} bytes but only {size - 8} follow it: "
                f"the file is truncated or not a safetensors file"
            )
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{p}: the header length prefix says {n} bytes, more than the "
                f"{MAX_HEADER_BYTES} a safetensors header may have"
            )
        raw = f.read(n)
    if len(raw) != n:
        raise CheckpointError(f"{p}: the file ended inside its header (it changed while read)")
    header = parse_json(raw, f"{p} (safetensors header)")
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{p}: the header must be a JSON object of tensors, got a {type(header).__name__}"
        )
    data_start, data_len = 8 + n, size - 8 - n
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(
            f"{p}: __metadata__ must be an object of strings, got {metadata!r:.80}"
        )
    tensors = {
        name: _tensor_info(p, name, info, data_start, data_len)
        for name, info in header.items()
        if name != "__metadata__"
    }
    _check_no_overlap(p, tensors)
    return SafetensorsHeader(p, tensors, dict(metadata), size)


def check_finite_array(a: np.ndarray, where: str) -> None:
    """:class:`CheckpointError` ``"{where} holds N non-finite values ..."`` when a floating
    array has a NaN or an infinity; checked in blocks (no temporary the array's size).

    Examples:
        >>> import numpy as np
        >>> check_finite_array(np.ones(3), "w")
        >>> try:
        ...     check_finite_array(np.array([1.0, np.nan, np.inf]), "tensor 'w'")
        ... except CheckpointError as e:
        ...     print(str(e)[:54])
        tensor 'w' holds 2 non-finite values (NaN or Inf), the
    """
    if not np.issubdtype(a.dtype, np.floating):
        return
    flat = a.reshape(-1)
    bad, first = 0, -1
    for start in range(0, flat.size, _FINITE_BLOCK):
        block = ~np.isfinite(flat[start : start + _FINITE_BLOCK])
        k = int(np.count_nonzero(block))
        if k and first < 0:
            first = start + int(np.argmax(block))
        bad += k
    if bad:
        index = tuple(int(i) for i in np.unravel_index(first, a.shape))
        raise CheckpointError(
            f"{where} holds {bad} non-finite values (NaN or Inf), the first at index "
            f"{index} ({flat[first]}): the checkpoint is corrupt or its training diverged "
            f"(check_finite=False loads it anyway)"
        )


def _read_tensor(f: Any, name: str, t: TensorInfo) -> np.ndarray:
    raw = np.empty(
        t.nbytes // np.dtype(SAFETENSORS_DTYPES[t.dtype]).itemsize,
        dtype=SAFETENSORS_DTYPES[t.dtype],
    )
    f.seek(t.offset)
    got = f.readinto(raw.data.cast("B")) if t.nbytes else 0
    if got != t.nbytes:
        raise CheckpointError(
            f"{t.file}: tensor {name!r}: read {got} of its {t.nbytes} bytes (the file "
            f"changed while read)"
        )
    if t.dtype == "BF16":
        out = (raw.astype(np.uint32) << 16).view(np.float32)
    elif t.dtype == "BOOL":
        out = raw != 0
    else:
        out = raw.astype(raw.dtype.newbyteorder("="), copy=False)
    return out.reshape(t.shape)


def read_safetensors(
    path: str | Path,
    *,
    names: Iterable[str] | None = None,
    check_finite: bool = True,
) -> dict[str, np.ndarray]:
    """Tensors of one ``.safetensors`` file as NumPy arrays, the header validated first
    (:func:`read_safetensors_header`); no framework needed, BF16 widened to float32
    exactly (a bfloat16 is the top half of a float32).

    Shapes: each array has its header's shape.

    Args:
        path: the file.
        names: the tensors to read (default all); a name the file lacks is an error.
        check_finite: a floating tensor holding NaN or Inf is a :class:`CheckpointError`
            naming the file and tensor (``False``: load it as it is).

    Raises:
        CheckpointError: see :func:`read_safetensors_header`; non-finite values.
        OSError: the file is missing or cannot be opened.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        >>> write_safetensors(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
        >>> read_safetensors(path)["w"].tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
    header = read_safetensors_header(path)
    wanted = list(header.tensors) if names is None else list(names)
    absent = [n for n in wanted if n not in header.tensors]
    if absent:
        raise CheckpointError(f"{header.path}: no tensor {absent[0]!r} in its header")
    out: dict[str, np.ndarray] = {}
    with open(header.path, "rb") as f:
        for name in wanted:
            t = header.tensors[name]
            out[name] = a = _read_tensor(f, name, t)
            if check_finite and t.dtype in _FLOATS:
                check_finite_array(a, f"{header.path}: tensor {name!r}")
    return out
