"""The kept_responses table: Responses kept for `previous_response_id` and retrieval
(server/harness/responses.py), stored so that they outlive a restart.

Rows go and come back as the harness writes them, JSON columns as text; which are still whole and unexpired
is the harness's rule.
"""

from __future__ import annotations

from typing import Any, Iterable

from server.store.database import Database


COLUMNS = ("id", "owner", "model", "created", "body", "messages", "input_items")


class StoredResponses:
    def __init__(self, db: Database):
        self._db = db

    def write(self, kept: dict[str, Any] | None, dropped: Iterable[str] = ()) -> None:
        """One response kept (a row of its columns, the JSON ones as text) and others dropped, in one
        transaction."""
        statements = [("DELETE FROM kept_responses WHERE id = ?", (i,)) for i in dropped]
        if kept is not None:
            statements.append((f"INSERT OR REPLACE INTO kept_responses ({', '.join(COLUMNS)}) "
                               f"VALUES ({', '.join('?' * len(COLUMNS))})", tuple(kept[c] for c in COLUMNS)))
        if statements:
            self._db.write(statements)

    def load(self) -> list[dict[str, Any]]:
        """Every row, oldest first, its JSON columns as text."""
        return self._db.rows(f"SELECT {', '.join(COLUMNS)} FROM kept_responses ORDER BY created, rowid")
