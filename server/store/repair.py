"""Repair of a damaged run store: find the damage, move the file aside, copy out what can still be read."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path


def damage(path: Path) -> str | None:
    """What SQLite finds wrong with the store at `path`, or None (also when there is none yet)."""
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(path)
        try:
            found = [r[0] for r in db.execute("PRAGMA quick_check(5)").fetchall()]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    return None if found == ["ok"] else "; ".join(found)


def move_aside(path: Path) -> Path:
    """Rename a damaged store (with its WAL and shared memory) out of the way; the new name."""
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.rename(f"{path}{suffix}", f"{aside}{suffix}")
    return aside


def copy_readable(damaged: Path, into: sqlite3.Connection, chunk: int = 64) -> tuple[int, list[str]]:
    """Copy each table's readable rows from a damaged store; where a whole table cannot be read,
    go by rowid ranges and skip the ranges that fail. Returns (rows copied, tables that lost rows)."""
    try:
        into.execute("ATTACH DATABASE ? AS old", (str(damaged),))
    except sqlite3.DatabaseError:
        return 0, ["every table (the file is not a database)"]
    kept, lost = 0, []
    tables = [r[0] for r in into.execute("SELECT name FROM main.sqlite_master WHERE type = 'table' "
                                          "AND name NOT LIKE 'sqlite_%' AND name != 'schema_version'")]
    for table in tables:
        try:  # an older store may lack later columns: copy the ones both have
            old_cols = {r[1] for r in into.execute(f"PRAGMA old.table_info({table})")}
        except sqlite3.DatabaseError:
            old_cols = set()
        cols = ", ".join(r[1] for r in into.execute(f"PRAGMA main.table_info({table})") if r[1] in old_cols)
        if not cols:
            lost.append(table)
            continue
        copy = f"INSERT OR IGNORE INTO main.{table} ({cols}) SELECT {cols} FROM old.{table}"
        try:
            kept += into.execute(copy).rowcount
            continue
        except sqlite3.DatabaseError:
            pass
        try:
            top = into.execute(f"SELECT MAX(rowid) FROM old.{table}").fetchone()[0] or 0
        except sqlite3.DatabaseError:
            top = 1 << 20
        missing = False
        for start in range(0, top + 1, chunk):
            try:
                kept += into.execute(f"{copy} WHERE rowid >= ? AND rowid < ?", (start, start + chunk)).rowcount
            except sqlite3.DatabaseError:
                missing = True
        if missing:
            lost.append(table)
    into.execute("DETACH DATABASE old")
    return kept, lost
