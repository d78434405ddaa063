"""One art-server per `--data-dir`.

Two servers on one directory would both write its run store, checkpoints and adapters and both
resume the same jobs; nothing in them is built for a second writer. The first server holds an
exclusive lock on a file in the directory for as long as it lives (the kernel releases it when
the process ends, however it ends); a second one stops at start-up with one line.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "art-server.lock"

_held: dict[Path, int] = {}  # open descriptors, kept for the life of the process


class DataDirBusy(SystemExit):
    """Another art-server holds the data directory."""


def lock_data_dir(data_dir: Path) -> None:
    data_dir = Path(data_dir).resolve()
    if data_dir in _held:
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise DataDirBusy(f"--data-dir {data_dir}: another art-server holds it"
                          f"{f' (pid {holder})' if holder.isdigit() else ''}; stop it or pass another --data-dir")
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[data_dir] = fd
