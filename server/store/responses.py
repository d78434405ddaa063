"""The kept_responses table: Responses kept for `previous_response_id` and retrieval
(server/harness/responses.py), stored so that they outlive a restart.

Rows go back as stored; which are still whole and unexpired is the harness's rule. Plain json.dumps, not
the store's NaN-as-null: a logprob of -inf must read back as it was sampled.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from server.store.database import Database


class StoredResponses:
    def __init__(self, db: Database):
        self._db = db

    def write(self, kept: dict[str, Any] | None, dropped: Iterable[str] = ()) -> None:
        """One response kept (a row of owner, id, model, created, body (JSON text), messages and
        input_items) and others dropped, in one transaction."""
        statements = [("DELETE FROM kept_responses WHERE id = ?", (i,)) for i in dropped]
        if kept is not None:
            statements.append(("INSERT OR REPLACE INTO kept_responses (id, owner, model, created, body, messages, "
                               "input_items) VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (kept["id"], kept["owner"], kept["model"], kept["created"], kept["body"],
                                json.dumps(kept["messages"], ensure_ascii=False),
                                json.dumps(kept["input_items"], ensure_ascii=False))))
        if statements:
            self._db.write(statements)

    def load(self) -> list[dict[str, Any]]:
        """Every row, oldest first, its JSON columns as text."""
        return self._db.rows("SELECT id, owner, model, created, body, messages, input_items FROM kept_responses "
                             "ORDER BY created, rowid")
