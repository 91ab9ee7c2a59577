"""ferry.checkpoint's errors, below both checkpoint.py and the records
module; ferry.checkpoint re-exports them (their __module__ says so)."""
from __future__ import annotations

from typing import Optional

from ._ferry import FerryError


class CheckpointError(FerryError):
    """A snapshot failed (I/O error, bad path, no memory). `path` is the
    checkpoint's path, `code` the FERRY_E* name; an I/O error is also an
    OSError."""

    def __init__(self, message: str, path: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = path
        self.code = code

    def __str__(self):
        return self.args[0]


class CheckpointIOError(CheckpointError, OSError):
    """A snapshot that could not be written (disk full, unwritable path)."""


def _error(message, path, code):
    cls = CheckpointIOError if code == "FERRY_EIO" else CheckpointError
    return cls(message, path, code)


for _cls in (CheckpointError, CheckpointIOError):
    _cls.__module__ = "ferry.checkpoint"
