"""The run store: SQLite storage in the data directory, and one repository per concern over its tables."""

from __future__ import annotations

from pathlib import Path

from server.store.database import Database, storage_failure
from server.store.encoding import json_safe
from server.store.jobs import Jobs
from server.store.runs import Runs
from server.store.responses import StoredResponses
from server.store.schema import MIGRATIONS
from server.store.sessions import StoredSessions
from server.store.steps import INTERRUPTED, OUTCOMES, Steps
from server.store.trajectories import Trajectories, trajectory_rows

__all__ = ["INTERRUPTED", "MIGRATIONS", "OUTCOMES", "Store", "json_safe", "storage_failure", "trajectory_rows"]


class Store:
    """Runs, steps with their metrics and warnings, every step attempt (trained or not: the record of
    a run that does not learn), jobs and their events, every trajectory trained or logged with
    token ids and logprobs, and the recorded sessions and kept Responses not yet expired. One
    connection guarded by a lock; writes are small transactions, so a crash loses at most the step
    in flight.

    A clean stop checkpoints the WAL into the main file (`close`), so the main file alone holds the
    data. A store found damaged at start (SQLite's quick_check fails, or the file is not a database)
    is moved aside and what can still be read is copied into a new one, row by row where whole
    tables cannot be read: the server serves what it can, and says so (`problems`, shown on /health).
    """

    def __init__(self, path: Path):
        self.db = Database(path)
        self.runs = Runs(self.db)
        self.steps = Steps(self.db)
        self.trajectories = Trajectories(self.db)
        self.jobs = Jobs(self.db)
        self.sessions = StoredSessions(self.db)
        self.responses = StoredResponses(self.db)

    @property
    def path(self) -> Path:
        return self.db.path

    @property
    def problems(self) -> list[str]:
        """What was found wrong with the store, for /health and the log."""
        return self.db.problems

    def report(self, problem: str) -> None:
        self.db.report(problem)

    def close(self) -> None:
        self.db.close()
