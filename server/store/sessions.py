"""The sessions and session_exchanges tables: recorded sessions (server/harness/sessions.py), kept so
that they outlive a restart.

What makes a stored exchange whole is the harness's rule, not the store's: `load` hands the rows back
as stored (the exchange as its JSON text) and `delete` drops the ones the harness found damaged. The
statements are built here and written by `write`, so that the harness can order writes of its own.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from server.store.database import Database

Statements = list[tuple[str, tuple]]


class StoredSessions:
    def __init__(self, db: Database):
        self._db = db

    def write(self, statements: Statements) -> None:
        """The statements in one transaction."""
        self._db.write(statements)

    def load(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(sessions, exchanges) as stored: each session's owner, id, created, touched and taken_by;
        each exchange's owner, session_id, seq and its JSON text, in seq order."""
        sessions = self._db.rows("SELECT owner, id, created, touched, taken_by FROM sessions")
        exchanges = self._db.rows("SELECT owner, session_id, seq, exchange FROM session_exchanges "
                                  "ORDER BY owner, session_id, seq")
        return sessions, exchanges

    def delete(self, keys: Iterable[tuple[Any, Any]]) -> None:
        """Every row of the sessions named (owner, id), as found (damaged values included)."""
        statements = [s for key in keys for s in deleted(*key)]
        if statements:
            self._db.write(statements)


def recorded(owner: str, session_id: str, seq: int, exchange: Any, created: float, touched: float,
             first: bool) -> Statements:
    """One exchange more, and the session's row (made anew, with no older exchanges under its id, for
    its first one). Plain json.dumps, not the store's NaN-as-null: a logprob of -inf must read back as it
    was sampled, and nothing queries these rows with SQLite's JSON functions."""
    row = json.dumps(exchange, ensure_ascii=False, default=str)
    head: Statements = [*deleted(owner, session_id),
                        ("INSERT INTO sessions (owner, id, created, touched, taken_by) VALUES (?, ?, ?, ?, NULL)",
                         (owner, session_id, created, touched))] if first else \
        [("UPDATE sessions SET touched = ? WHERE owner = ? AND id = ?", (touched, owner, session_id))]
    return [*head, ("INSERT OR REPLACE INTO session_exchanges (owner, session_id, seq, exchange) VALUES (?, ?, ?, ?)",
                    (owner, session_id, seq, row))]


def taken(owner: str, session_id: str, taken_by: str | None) -> Statements:
    return [("UPDATE sessions SET taken_by = ? WHERE owner = ? AND id = ?", (taken_by, owner, session_id))]


def deleted(owner: Any, session_id: Any) -> Statements:
    return [("DELETE FROM session_exchanges WHERE owner IS ? AND session_id IS ?", (owner, session_id)),
            ("DELETE FROM sessions WHERE owner IS ? AND id IS ?", (owner, session_id))]
