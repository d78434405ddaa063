"""The jobs and job_events tables: each job, its idempotency key and result, and the events it sent."""

from __future__ import annotations

import json
import time
from typing import Any

from server.store.database import Database


class Jobs:
    def __init__(self, db: Database):
        self._db = db

    def put(self, job: dict[str, Any], request: str | None = None) -> None:
        """The job's record, and with it (one transaction) its request when it must be kept (`request`)."""
        kept = [] if request is None else [("INSERT OR REPLACE INTO job_requests VALUES (?, ?, ?)",
                                            (job["id"], request, time.time()))]
        self._db.write([("INSERT OR REPLACE INTO jobs (id, run, kind, idempotency_key, status, result, error, created, "
                         "updated, body_hash, attempt_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (job["id"], job["run"], job["kind"], job["idempotency_key"], job["status"],
                          json.dumps(job.get("result")), job.get("error"), job.get("created", time.time()), time.time(),
                          job.get("body_hash"), job.get("attempt_from", 0))), *kept])

    def request(self, job_id: str) -> str | None:
        """The request kept with a job (put's `request`), as stored; None when none was."""
        rows = self._db.rows("SELECT request FROM job_requests WHERE job_id = ?", (job_id,))
        return rows[0]["request"] if rows else None

    def by_key(self, run: str, key: str) -> dict[str, Any] | None:
        rows = self._db.rows("SELECT * FROM jobs WHERE run = ? AND idempotency_key = ?", (run, key))
        return _job(rows[0]) if rows else None

    def get(self, job_id: str) -> dict[str, Any] | None:
        rows = self._db.rows("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def all(self, status: str | None = None) -> list[dict[str, Any]]:
        if status is None:
            return [_job(r) for r in self._db.rows("SELECT * FROM jobs ORDER BY created")]
        return [_job(r) for r in self._db.rows("SELECT * FROM jobs WHERE status = ? ORDER BY created", (status,))]

    def put_event(self, job_id: str, seq: int, type_: str, data: dict[str, Any]) -> None:
        self._db.write([("INSERT OR REPLACE INTO job_events VALUES (?, ?, ?, ?, ?)",
                         (job_id, seq, type_, json.dumps(data), time.time()))])

    def count_events(self, job_id: str) -> int:
        return self._db.rows("SELECT COUNT(*) AS n FROM job_events WHERE job_id = ?", (job_id,))[0]["n"]

    def events(self, job_id: str, after: int = -1) -> list[dict[str, Any]]:
        rows = self._db.rows("SELECT seq, type, data FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq",
                             (job_id, after))
        return [{"seq": r["seq"], "type": r["type"], "data": json.loads(r["data"])} for r in rows]


def _job(row: dict[str, Any]) -> dict[str, Any]:
    row["result"] = json.loads(row["result"]) if row.get("result") else None
    return row
