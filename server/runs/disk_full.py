"""A step's files that the disk could not take whole, as one named error.

A full disk shows itself differently in each writer: Python's own writes raise OSError ENOSPC (or
EDQUOT, over a quota), safetensors raises its own error with the OS's words in it, and torch.save
cuts the file short and says only "unexpected pos 497728 vs 497620". Each is the same fact to an
operator, and to /health (server/store/database.py `storage_failure`: DiskFull is an OSError
ENOSPC), so each becomes DiskFull, naming the file and the space left.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch's zip writer (caffe2/serialize/inline_container.cc) after a write the disk cut short
_TORCH_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing")


class DiskFull(OSError):
    """A step's file could not be written whole: the disk is full or over its quota."""

    def __init__(self, path: Path, free: int):
        self.path, self.free = path, free
        super().__init__(errno.ENOSPC, f"the disk is full: {path} could not be written whole ({free:,} bytes free "
                                       f"there); free some space and try again")

    def __str__(self) -> str:  # one line, without OSError's "[Errno 28]"
        return self.strerror


def out_of_space(exc: BaseException) -> bool:
    """Whether `exc` is a write the disk could not take (not a bug, not a damaged file)."""
    if isinstance(exc, OSError) and exc.errno in _ERRNOS:
        return True
    text = str(exc)
    return any(words in text for words in _TORCH_SHORT_WRITE) or any(os.strerror(e) in text for e in _ERRNOS)


def free_bytes(path: Path) -> int:
    """The space left on the filesystem that holds `path` (its nearest existing parent)."""
    for where in (path, *path.parents):
        if where.exists():
            return shutil.disk_usage(where).free
    return 0


class ShortWrite(Exception):
    """Which file a write of many ran out of space on; the writer turns it into DiskFull once its
    partial files are gone, so the space it names is the space there is."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path


@contextmanager
def writing(path: Path) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if out_of_space(exc):
            raise ShortWrite(path) from exc
        raise
