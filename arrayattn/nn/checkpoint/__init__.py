"""Reading checkpoint files without trusting them: ``.safetensors`` headers validated
against the file before any data is read, JSON files (``config.json``, indexes) read
strictly, and every file of a checkpoint directory kept inside it. Every error is a
:class:`CheckpointError` naming the file and the tensor or field."""

from .directory import (
    INDEX_NAME,
    read_checkpoint_headers,
    read_checkpoint_tensors,
    safetensors_files,
)
from .errors import CheckpointError
from .files import MAX_JSON_BYTES, checkpoint_file, read_json, regular_file_size
from .safetensors import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsHeader,
    TensorInfo,
    check_finite_array,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)

__all__ = [
    "CheckpointError",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "TensorInfo",
    "check_finite_array",
    "checkpoint_file",
    "read_checkpoint_headers",
    "read_checkpoint_tensors",
    "read_json",
    "read_safetensors",
    "read_safetensors_header",
    "regular_file_size",
    "safetensors_files",
    "write_safetensors",
]
