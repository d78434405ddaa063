"""The runs table: each run's name, project, spec, owner and base model."""

from __future__ import annotations

import json
import time
from typing import Any

from server.store.database import Database


class Runs:
    def __init__(self, db: Database):
        self._db = db

    def add(self, name: str, project: str, spec: dict[str, Any], owner: str | None = None) -> None:
        self._db.write([("INSERT OR IGNORE INTO runs (name, project, spec, created, owner) VALUES (?, ?, ?, ?, ?)",
                         (name, project, json.dumps(spec), time.time(), owner))])

    def record_base(self, name: str, base_model: str, fingerprint: str) -> None:
        self._db.write([("UPDATE runs SET base_model = ?, base_fingerprint = ? WHERE name = ?",
                         (base_model, fingerprint, name))])

    def forget(self, name: str) -> None:
        self._db.write([("DELETE FROM runs WHERE name = ?", (name,))])

    def all(self) -> list[dict[str, Any]]:
        return self._db.rows("SELECT name, project, spec, created, owner, base_model, base_fingerprint FROM runs "
                             "ORDER BY created")

    def delete(self, name: str) -> None:
        """Everything stored of a run, in one transaction: a run made again under its name starts empty
        (its idempotency keys, steps and trajectories gone with it)."""
        self._db.write([
            ("DELETE FROM job_events WHERE job_id IN (SELECT id FROM jobs WHERE run = ?)", (name,)),
            ("DELETE FROM job_requests WHERE job_id IN (SELECT id FROM jobs WHERE run = ?)", (name,)),
            *((f"DELETE FROM {table} WHERE run = ?", (name,)) for table in ("jobs", "trajectories", "attempts", "steps")),
            ("DELETE FROM runs WHERE name = ?", (name,)),
        ])
