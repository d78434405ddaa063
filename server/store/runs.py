"""The runs table: which runs the store holds data of, under which project, and who created each
(a tenant's name; NULL for the admin). A run's own record, its spec and base model, is its
run.json, beside its checkpoints (server/runs/base_models.py): this table keeps nothing of it, so
the two cannot disagree, and a run whose folder is gone is still listed with its stored steps."""

from __future__ import annotations

import time
from typing import Any

from server.store.database import Database


class Runs:
    def __init__(self, db: Database):
        self._db = db

    def add(self, name: str, project: str, owner: str | None = None) -> None:
        self._db.write([("INSERT OR IGNORE INTO runs (name, project, created, owner) VALUES (?, ?, ?, ?)",
                         (name, project, time.time(), owner))])

    def forget(self, name: str) -> None:
        self._db.write([("DELETE FROM runs WHERE name = ?", (name,))])

    def all(self) -> list[dict[str, Any]]:
        return self._db.rows("SELECT name, project, created, owner FROM runs ORDER BY created")

    def delete(self, name: str) -> None:
        """Everything stored of a run, in one transaction: a run made again under its name starts empty
        (its idempotency keys, steps and trajectories gone with it)."""
        self._db.write([
            ("DELETE FROM job_events WHERE job_id IN (SELECT id FROM jobs WHERE run = ?)", (name,)),
            ("DELETE FROM job_requests WHERE job_id IN (SELECT id FROM jobs WHERE run = ?)", (name,)),
            *((f"DELETE FROM {table} WHERE run = ?", (name,)) for table in ("jobs", "trajectories", "attempts", "steps")),
            ("DELETE FROM runs WHERE name = ?", (name,)),
        ])
