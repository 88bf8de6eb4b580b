"""The one exception of checkpoint reading."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be loaded: truncated or corrupt files,
    hostile headers or indexes, a ``config.json`` with missing or impossible fields,
    tensors that do not fit the configuration, non-finite weights.

    The message names the file and the tensor or field, what was seen and what was
    expected. It is a ``ValueError``; a file that is not there or cannot be opened is
    the ``OSError`` (``FileNotFoundError``, ``PermissionError``) naming it instead.

    Examples:
        >>> from arrayattn.nn import CheckpointError
        >>> issubclass(CheckpointError, ValueError)
        True
    """
