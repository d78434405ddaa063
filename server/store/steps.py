"""The steps and attempts tables: each trained step's figures, and every attempt at a step, trained or not."""

from __future__ import annotations

import json
import time
from typing import Any

from server.store.database import Database
from server.store.encoding import dumps
from server.store.trajectories import Rows, insert

# How an attempt ended. Only "trained" advanced the run; "untrained" had nothing to train (its
# warnings say why); "interrupted" was being committed when the server stopped, before its checkpoint.
OUTCOMES = ("trained", "untrained", "failed", "cancelled", "interrupted")
INTERRUPTED = ("The server stopped before this step's checkpoint was written, so the step did not happen; "
               "its job was interrupted and trains it again when resubmitted.")


class Steps:
    def __init__(self, db: Database):
        self._db = db

    def put(self, run: str, step: int, kind: str, metrics: dict[str, Any], warnings: list[str],
            trajectories: Rows, split: str = "train", pending: bool = False, job_id: str | None = None) -> None:
        """A trained step: its metrics, its trajectories and its attempt, in one transaction. A
        pending step is one whose checkpoint is being written: `confirm` or `settle_pending`
        decides it."""
        now = time.time()
        stmts = [("INSERT OR REPLACE INTO steps (run, step, kind, metrics, warnings, created, pending) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (run, step, kind, dumps(metrics), json.dumps(warnings), now, int(pending))),
                 ("DELETE FROM trajectories WHERE run = ? AND step = ? AND split = ?", (run, step, split)),
                 _attempt_insert(run, step, kind, job_id, "trained", metrics, warnings, now, pending)]
        stmts += insert(run, step, split, trajectories, now)
        self._db.write(stmts)

    def put_attempt(self, run: str, step: int, kind: str, job_id: str | None, outcome: str,
                    metrics: dict[str, Any], warnings: list[str]) -> None:
        """An attempt that did not advance the run (`step` is the step it would have been)."""
        if outcome not in OUTCOMES or outcome == "trained":
            raise ValueError(f"not an outcome of an attempt that did not train: {outcome!r}")
        self._db.write([_attempt_insert(run, step, kind, job_id, outcome, metrics, warnings, time.time(), False)])

    def confirm(self, run: str, step: int) -> None:
        self._db.write([("UPDATE steps SET pending = 0 WHERE run = ? AND step = ?", (run, step)),
                        ("UPDATE attempts SET pending = 0 WHERE run = ? AND step = ? AND pending = 1", (run, step))])

    def settle_pending(self, run: str, checkpointed: set[int], outcome: str = "interrupted",
                       why: str = INTERRUPTED) -> None:
        """A pending step whose checkpoint exists happened; one whose does not did not, and its
        attempt keeps `outcome` and `why` (after a crash: interrupted; after an error: the error)."""
        pending = [r["step"] for r in self._db.rows("SELECT step FROM steps WHERE run = ? AND pending = 1", (run,))]
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
            self._db.write(stmts)

    def of(self, run: str) -> list[dict[str, Any]]:
        """The run's trained steps (not those still pending), oldest first."""
        rows = self._db.rows("SELECT step, kind, metrics, warnings, created FROM steps WHERE run = ? AND pending = 0 "
                             "ORDER BY step", (run,))
        for r in rows:
            r["metrics"], r["warnings"] = json.loads(r["metrics"]), json.loads(r["warnings"])
        return rows

    def attempts(self, run: str) -> list[dict[str, Any]]:
        """Every attempt at a step of `run`, oldest first."""
        rows = self._db.rows("SELECT attempt, job_id, step, kind, trained, outcome, warnings, metrics, created, "
                             "pending FROM attempts WHERE run = ? ORDER BY attempt", (run,))
        for r in rows:
            r["trained"], r["pending"] = bool(r["trained"]), bool(r["pending"])
            r["metrics"], r["warnings"] = json.loads(r["metrics"]), json.loads(r["warnings"])
        return rows


def _attempt_insert(run: str, step: int, kind: str, job_id: str | None, outcome: str, metrics: dict[str, Any],
                    warnings: list[str], now: float, pending: bool) -> tuple[str, tuple]:
    # The attempt number is the run's next, taken inside the write's transaction.
    return ("INSERT INTO attempts (run, attempt, job_id, step, kind, trained, outcome, warnings, metrics, created, "
            "pending) SELECT ?, COALESCE(MAX(attempt), 0) + 1, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM attempts WHERE run = ?",
            (run, job_id, step, kind, int(outcome == "trained"), outcome, json.dumps(warnings), dumps(metrics), now,
             int(pending), run))
