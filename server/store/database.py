"""The run store's storage: one SQLite (WAL) connection under a lock, its migrations, and its repair at start."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterable

from server.store.encoding import strict_json
from server.store.repair import copy_readable, damage, move_aside
from server.store.schema import MIGRATIONS

log = logging.getLogger("artisan.store")


class Database:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.problems: list[str] = []  # what was found wrong with the store, for /health and the log
        self._lock = threading.Lock()
        why = damage(self.path)
        aside = move_aside(self.path) if why is not None else None
        self._db = _connect(self.path)
        self._migrate()
        if aside is not None:
            kept, lost = copy_readable(aside, self._db)
            self.report(f"the run store at {self.path} was damaged ({why}); it was moved to {aside.name} and what "
                        f"could be read was copied into a new store ({kept} rows kept"
                        + (f"; unreadable rows lost from {', '.join(lost)}" if lost else "") + ")")

    def report(self, problem: str) -> None:
        log.error("%s", problem)
        self.problems.append(problem)

    def close(self) -> None:
        """Move the WAL's pages into the main file and close: after a clean stop the main file
        holds everything, and a lost or damaged WAL loses nothing."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
            row = self._db.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            for i, sql in enumerate(MIGRATIONS[version:], start=version + 1):
                self._db.execute("BEGIN")
                for statement in (s for s in sql.split(";") if s.strip()):
                    self._db.execute(statement)
                self._db.execute("DELETE FROM schema_version")
                self._db.execute("INSERT INTO schema_version VALUES (?)", (i,))
                self._db.execute("COMMIT")

    def write(self, statements: Iterable[tuple[str, tuple]]) -> None:
        """The statements in one transaction: all of them or none."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except Exception:
                if self._db.in_transaction:  # SQLite rolls back by itself on some errors (a full disk)
                    self._db.execute("ROLLBACK")
                raise

    def execute(self, sql: str, args: tuple = ()) -> int:
        """One statement, committed on its own; the number of rows it changed."""
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def rows(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._db.execute(sql, args)
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
SQLITE_STORAGE_CODES = (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN)


def storage_failure(exc: BaseException) -> bool:
    """A full, read-only or failing disk under the data directory (SQLite says "database or disk is
    full" or "disk I/O error"; safetensors raises its own error, with the OS's words in it)."""
    if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) is not None:
        return exc.sqlite_errorcode & 0xFF in SQLITE_STORAGE_CODES  # not a lock, a schema or an SQL bug
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return True
    return any(os.strerror(code) in str(exc) for code in STORAGE_ERRNOS)


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.create_function("artisan_strict_json", 1, strict_json, deterministic=True)
    return db
