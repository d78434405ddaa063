"""The run store: SQLite (WAL) in the data directory.

Runs, steps with their metrics and warnings, every step attempt (trained or not: the record of
a run that does not learn), jobs and their events, and every trajectory trained or logged with
token ids and logprobs. One connection guarded by a lock; writes are small
transactions, so a crash loses at most the step in flight.

A clean stop checkpoints the WAL into the main file (`close`), so the main file alone holds the
data. A store found damaged at start (SQLite's quick_check fails, or the file is not a database)
is moved aside and what can still be read is copied into a new one, row by row where whole
tables cannot be read: the server serves what it can, and says so (`problems`, shown on /health).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("artisan.store")

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE runs (name TEXT PRIMARY KEY, project TEXT, spec TEXT, created REAL);
    CREATE TABLE steps (run TEXT, step INTEGER, kind TEXT, metrics TEXT, warnings TEXT, created REAL,
                        PRIMARY KEY (run, step));
    CREATE TABLE jobs (id TEXT PRIMARY KEY, run TEXT, kind TEXT, idempotency_key TEXT, status TEXT,
                       result TEXT, error TEXT, created REAL, updated REAL);
    CREATE UNIQUE INDEX jobs_key ON jobs (run, idempotency_key);
    CREATE TABLE job_events (job_id TEXT, seq INTEGER, type TEXT, data TEXT, created REAL,
                             PRIMARY KEY (job_id, seq));
    CREATE TABLE trajectories (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, step INTEGER, split TEXT,
                               group_index INTEGER, traj_index INTEGER, reward REAL, data TEXT, created REAL);
    CREATE INDEX traj_run_step ON trajectories (run, step, split);
    """,
    # 2: idempotency keys remember their body; jobs their current attempt; steps commit in two phases
    """
    ALTER TABLE jobs ADD COLUMN body_hash TEXT;
    ALTER TABLE jobs ADD COLUMN attempt_from INTEGER DEFAULT 0;
    ALTER TABLE steps ADD COLUMN pending INTEGER DEFAULT 0;
    """,
    # 3: every step attempt, trained or not; the steps a store already holds were trained attempts
    """
    CREATE TABLE attempts (run TEXT, attempt INTEGER, job_id TEXT, step INTEGER, kind TEXT, trained INTEGER,
                           outcome TEXT, warnings TEXT, metrics TEXT, created REAL, pending INTEGER DEFAULT 0,
                           PRIMARY KEY (run, attempt));
    INSERT INTO attempts (run, attempt, job_id, step, kind, trained, outcome, warnings, metrics, created, pending)
        SELECT run, ROW_NUMBER() OVER (PARTITION BY run ORDER BY step), NULL, step, kind, 1, 'trained',
               warnings, metrics, created, pending FROM steps;
    """,
    # 4: who created each run: a tenant's name, NULL for the admin (server/ownership.py)
    """
    ALTER TABLE runs ADD COLUMN owner TEXT;
    """,
    # 5: the base model each run belongs to (server/training/base_models.py); NULL for runs made before
    """
    ALTER TABLE runs ADD COLUMN base_model TEXT;
    ALTER TABLE runs ADD COLUMN base_fingerprint TEXT;
    """,
]
# How an attempt ended. Only "trained" advanced the run; "untrained" had nothing to train (its
# warnings say why); "interrupted" was being committed when the server stopped, before its checkpoint.
OUTCOMES = ("trained", "untrained", "failed", "cancelled", "interrupted")
INTERRUPTED = ("The server stopped before this step's checkpoint was written, so the step did not happen; "
               "its job was interrupted and trains it again when resubmitted.")


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.problems: list[str] = []  # what was found wrong with the store, for /health and the log
        self._lock = threading.Lock()
        why = _damage(self.path)
        aside = _move_aside(self.path) if why is not None else None
        self._db = _connect(self.path)
        self._migrate()
        if aside is not None:
            kept, lost = _copy_readable(aside, self._db)
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

    def _write(self, statements: Iterable[tuple[str, tuple]]) -> None:
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

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            cur = self._db.execute(sql, args)
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    # ---- runs and steps --------------------------------------------------------------------
    def put_run(self, name: str, project: str, spec: dict[str, Any], owner: str | None = None) -> None:
        self._write([("INSERT OR IGNORE INTO runs (name, project, spec, created, owner) VALUES (?, ?, ?, ?, ?)",
                      (name, project, json.dumps(spec), time.time(), owner))])

    def record_run_base(self, name: str, base_model: str, fingerprint: str) -> None:
        self._write([("UPDATE runs SET base_model = ?, base_fingerprint = ? WHERE name = ?", (base_model, fingerprint, name))])

    def forget_run(self, name: str) -> None:
        self._write([("DELETE FROM runs WHERE name = ?", (name,))])

    def runs(self) -> list[dict[str, Any]]:
        return self._rows("SELECT name, project, spec, created, owner, base_model, base_fingerprint FROM runs "
                          "ORDER BY created")

    def delete_run(self, name: str) -> None:
        """Everything stored of a run, in one transaction: a run made again under its name starts empty
        (its idempotency keys, steps and trajectories gone with it)."""
        self._write([
            ("DELETE FROM job_events WHERE job_id IN (SELECT id FROM jobs WHERE run = ?)", (name,)),
            *((f"DELETE FROM {table} WHERE run = ?", (name,)) for table in ("jobs", "trajectories", "attempts", "steps")),
            ("DELETE FROM runs WHERE name = ?", (name,)),
        ])

    def put_step(self, run: str, step: int, kind: str, metrics: dict[str, Any], warnings: list[str],
                 trajectories: list[tuple[int, int, float, dict[str, Any]]], split: str = "train",
                 pending: bool = False, job_id: str | None = None) -> None:
        """A trained step: its metrics, its trajectories and its attempt, in one transaction. A
        pending step is one whose checkpoint is being written: `confirm_step` or `settle_pending`
        decides it."""
        now = time.time()
        stmts = [("INSERT OR REPLACE INTO steps (run, step, kind, metrics, warnings, created, pending) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (run, step, kind, _dumps(metrics), json.dumps(warnings), now, int(pending))),
                 ("DELETE FROM trajectories WHERE run = ? AND step = ? AND split = ?", (run, step, split)),
                 _attempt_insert(run, step, kind, job_id, "trained", metrics, warnings, now, pending)]
        stmts += [("INSERT INTO trajectories (run, step, split, group_index, traj_index, reward, data, created) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (run, step, split, g, t, r, _dumps(d), now))
                  for g, t, r, d in trajectories]
        self._write(stmts)

    def put_attempt(self, run: str, step: int, kind: str, job_id: str | None, outcome: str,
                    metrics: dict[str, Any], warnings: list[str]) -> None:
        """An attempt that did not advance the run (`step` is the step it would have been)."""
        if outcome not in OUTCOMES or outcome == "trained":
            raise ValueError(f"not an outcome of an attempt that did not train: {outcome!r}")
        self._write([_attempt_insert(run, step, kind, job_id, outcome, metrics, warnings, time.time(), False)])

    def confirm_step(self, run: str, step: int) -> None:
        self._write([("UPDATE steps SET pending = 0 WHERE run = ? AND step = ?", (run, step)),
                     ("UPDATE attempts SET pending = 0 WHERE run = ? AND step = ? AND pending = 1", (run, step))])

    def settle_pending(self, run: str, checkpointed: set[int], outcome: str = "interrupted",
                       why: str = INTERRUPTED) -> None:
        """A pending step whose checkpoint exists happened; one whose does not did not, and its
        attempt keeps `outcome` and `why` (after a crash: interrupted; after an error: the error)."""
        pending = [r["step"] for r in self._rows("SELECT step FROM steps WHERE run = ? AND pending = 1", (run,))]
        stmts: list[tuple[str, tuple]] = []
        for step in pending:
            if step in checkpointed:
                stmts += [("UPDATE steps SET pending = 0 WHERE run = ? AND step = ?", (run, step)),
                          ("UPDATE attempts SET pending = 0 WHERE run = ? AND step = ? AND pending = 1", (run, step))]
            else:
                stmts += [("DELETE FROM steps WHERE run = ? AND step = ?", (run, step)),
                          ("DELETE FROM trajectories WHERE run = ? AND step = ? AND split = 'train'", (run, step)),
                          ("UPDATE attempts SET pending = 0, trained = 0, outcome = ?, "
                           "warnings = json_insert(warnings, '$[#]', ?) WHERE run = ? AND step = ? AND pending = 1",
                           (outcome, why, run, step))]
        if stmts:
            self._write(stmts)

    def attempts(self, run: str) -> list[dict[str, Any]]:
        """Every attempt at a step of `run`, oldest first."""
        rows = self._rows("SELECT attempt, job_id, step, kind, trained, outcome, warnings, metrics, created, pending "
                          "FROM attempts WHERE run = ? ORDER BY attempt", (run,))
        for r in rows:
            r["trained"], r["pending"] = bool(r["trained"]), bool(r["pending"])
            r["metrics"], r["warnings"] = json.loads(r["metrics"]), json.loads(r["warnings"])
        return rows

    def put_trajectories(self, run: str, step: int, split: str,
                         trajectories: list[tuple[int, int, float, dict[str, Any]]]) -> None:
        now = time.time()
        self._write([("INSERT INTO trajectories (run, step, split, group_index, traj_index, reward, data, created) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (run, step, split, g, t, r, _dumps(d), now))
                     for g, t, r, d in trajectories])

    def prune_trajectories(self, run: str, keep_steps: int) -> int:
        """Retention: drop the trajectories of all but the newest `keep_steps` steps of a run (step
        metrics and warnings are small and always kept). Returns the rows deleted."""
        with self._lock:
            newest = self._db.execute("SELECT MAX(step) FROM trajectories WHERE run = ?", (run,)).fetchone()[0]
        if newest is None:
            return 0
        with self._lock:
            cur = self._db.execute("DELETE FROM trajectories WHERE run = ? AND step <= ?", (run, newest - keep_steps))
            return cur.rowcount

    def trajectory_steps(self, run: str) -> list[int]:
        return [r["step"] for r in self._rows("SELECT DISTINCT step FROM trajectories WHERE run = ? ORDER BY step", (run,))]

    def steps(self, run: str) -> list[dict[str, Any]]:
        rows = self._rows("SELECT step, kind, metrics, warnings, created FROM steps WHERE run = ? AND pending = 0 "
                          "ORDER BY step", (run,))
        for r in rows:
            r["metrics"], r["warnings"] = json.loads(r["metrics"]), json.loads(r["warnings"])
        return rows

    def trajectories(self, run: str, step: int | None = None, split: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT id, step, split, group_index, traj_index, reward, data FROM trajectories WHERE run = ?", [run]
        if step is not None:
            sql, args = sql + " AND step = ?", args + [step]
        if split is not None:
            sql, args = sql + " AND split = ?", args + [split]
        rows = self._rows(sql + " ORDER BY step, group_index, traj_index", tuple(args))
        for r in rows:
            r["data"] = json.loads(r["data"])
        return rows

    # ---- browsing (the web UI) --------------------------------------------------------------
    def reward_by_step(self, run: str) -> list[dict[str, Any]]:
        """Mean reward and count per (split, step): the reward curves, without loading any JSON."""
        return self._rows("SELECT split, step, COUNT(*) AS n, AVG(reward) AS reward_mean FROM trajectories "
                          "WHERE run = ? GROUP BY split, step ORDER BY split, step", (run,))

    def find_trajectories(self, run: str, step: int | None = None, split: str | None = None,
                          group: int | None = None, min_reward: float | None = None,
                          max_reward: float | None = None, meta_key: str | None = None,
                          meta_value: str | None = None, text: str | None = None,
                          limit: int = 500) -> list[dict[str, Any]]:
        """Trajectory summaries (no messages, tokens or logprobs) matching every filter given.

        The JSON filters run inside SQLite so a search never ships every trajectory's token data
        to Python. `meta_value` matches the metadata value's text form (`true`, `3`, `retail`);
        `text` is a case-insensitive substring of any message content or tool-call arguments.
        """
        where, args = ["run = ?"], [run]
        for clause, value in (("step = ?", step), ("split = ?", split), ("group_index = ?", group),
                              ("reward >= ?", min_reward), ("reward <= ?", max_reward)):
            if value is not None:
                where.append(clause)
                args.append(value)
        json_where, json_args = [], []
        if meta_key:
            # json_each rather than a json path built from the key: the key is data, never syntax.
            json_where.append("EXISTS (SELECT 1 FROM json_each(doc, '$.metadata') WHERE key = ? AND "
                              "(CASE WHEN type IN ('true', 'false', 'null') THEN type "
                              "WHEN type IN ('object', 'array') THEN value ELSE CAST(atom AS TEXT) END) = ?)")
            json_args += [meta_key, meta_value or ""]
        if text:
            escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            json_where.append("EXISTS (SELECT 1 FROM json_tree(doc, '$.messages_and_choices') "
                              "WHERE key IN ('content', 'text', 'arguments') AND type = 'text' "
                              "AND value LIKE ? ESCAPE '\\')")
            json_args.append(f"%{escaped}%")
        # `doc` is the row as SQLite-readable JSON: json.dumps writes NaN for a NaN metric, which
        # SQLite's JSON functions reject, so those rare rows are rewritten (NaN as null) on the fly.
        rows = self._rows("SELECT id, step, split, group_index, traj_index, reward, "
                          "json_extract(doc, '$.metadata') AS metadata, json_extract(doc, '$.metrics') AS metrics "
                          "FROM (SELECT *, CASE WHEN json_valid(data) THEN data ELSE artisan_strict_json(data) END AS doc "
                          f"FROM trajectories WHERE {' AND '.join(where)}) "
                          f"WHERE {' AND '.join(json_where) or '1'} "
                          "ORDER BY step, split, group_index, traj_index LIMIT ?", (*args, *json_args, limit))
        for r in rows:
            r["metadata"], r["metrics"] = json.loads(r["metadata"] or "{}"), json.loads(r["metrics"] or "{}")
        return rows

    def trajectory(self, traj_id: int) -> dict[str, Any] | None:
        rows = self._rows("SELECT id, run, step, split, group_index, traj_index, reward, data FROM trajectories "
                          "WHERE id = ?", (traj_id,))
        if not rows:
            return None
        rows[0]["data"] = json.loads(rows[0]["data"])
        return rows[0]

    # ---- jobs ------------------------------------------------------------------------------
    def put_job(self, job: dict[str, Any]) -> None:
        self._write([("INSERT OR REPLACE INTO jobs (id, run, kind, idempotency_key, status, result, error, created, "
                      "updated, body_hash, attempt_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (job["id"], job["run"], job["kind"], job["idempotency_key"], job["status"],
                       json.dumps(job.get("result")), job.get("error"), job.get("created", time.time()), time.time(),
                       job.get("body_hash"), job.get("attempt_from", 0)))])

    def job_by_key(self, run: str, key: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM jobs WHERE run = ? AND idempotency_key = ?", (run, key))
        return _job(rows[0]) if rows else None

    def job(self, job_id: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def jobs(self, status: str | None = None) -> list[dict[str, Any]]:
        if status is None:
            return [_job(r) for r in self._rows("SELECT * FROM jobs ORDER BY created")]
        return [_job(r) for r in self._rows("SELECT * FROM jobs WHERE status = ? ORDER BY created", (status,))]

    def put_event(self, job_id: str, seq: int, type_: str, data: dict[str, Any]) -> None:
        self._write([("INSERT OR REPLACE INTO job_events VALUES (?, ?, ?, ?, ?)",
                      (job_id, seq, type_, json.dumps(data), time.time()))])

    def count_events(self, job_id: str) -> int:
        return self._rows("SELECT COUNT(*) AS n FROM job_events WHERE job_id = ?", (job_id,))[0]["n"]

    def events(self, job_id: str, after: int = -1) -> list[dict[str, Any]]:
        rows = self._rows("SELECT seq, type, data FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq", (job_id, after))
        return [{"seq": r["seq"], "type": r["type"], "data": json.loads(r["data"])} for r in rows]


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
    db.create_function("artisan_strict_json", 1, _strict_json, deterministic=True)
    return db


def _damage(path: Path) -> str | None:
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


def _move_aside(path: Path) -> Path:
    """Rename a damaged store (with its WAL and shared memory) out of the way; the new name."""
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.rename(f"{path}{suffix}", f"{aside}{suffix}")
    return aside


def _copy_readable(damaged: Path, into: sqlite3.Connection, chunk: int = 64) -> tuple[int, list[str]]:
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


def _attempt_insert(run: str, step: int, kind: str, job_id: str | None, outcome: str, metrics: dict[str, Any],
                    warnings: list[str], now: float, pending: bool) -> tuple[str, tuple]:
    # The attempt number is the run's next, taken inside the write's transaction.
    return ("INSERT INTO attempts (run, attempt, job_id, step, kind, trained, outcome, warnings, metrics, created, "
            "pending) SELECT ?, COALESCE(MAX(attempt), 0) + 1, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM attempts WHERE run = ?",
            (run, job_id, step, kind, int(outcome == "trained"), outcome, json.dumps(warnings), _dumps(metrics), now,
             int(pending), run))


def trajectory_rows(groups: list[Any]) -> list[tuple[int, int, float, dict[str, Any]]]:
    """Groups as the store keeps them: (group index, trajectory index, reward, trajectory)."""
    return [(gi, ti, t.reward, t.model_dump(mode="json"))
            for gi, g in enumerate(groups) for ti, t in enumerate(g.trajectories)]


def _strict_json(text: str) -> str:
    return json.dumps(json.loads(text, parse_constant=lambda _: None))


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinity replaced by None, the convention of every stored figure."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def _dumps(obj: Any) -> str:
    """JSON that every reader can parse: a NaN metric is stored as null (strict JSON has no NaN)."""
    return json.dumps(json_safe(obj))


def _job(row: dict[str, Any]) -> dict[str, Any]:
    row["result"] = json.loads(row["result"]) if row.get("result") else None
    return row
