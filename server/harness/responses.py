"""Responses kept for `previous_response_id`, retrieval, deletion and their input items (OpenAI's
Responses API): the body a response answered with, the request's own input as items, and the
conversation it ended, in chat terms, so a request that names it continues it with no history of
its own.

Kept for a bounded time, number and size (oldest first out: a response carries its token ids and
logprobs, so a count alone would let long agent transcripts hold gigabytes), and only for the API
key that created it: another caller is told it does not exist, as a missing one is. A continued
conversation renders its earlier turns through the turn cache like any other, so they are spliced
as their exact ids.

With a store (server/store/responses.py) they outlive a restart until they expire, as recorded
sessions do: `put` and `delete` write before they return (blocking: call them off the event loop),
each change of memory and its write under one lock, so the store sees them in memory's order; what
expired while only read is dropped from the store by the next write. At start the unexpired ones are
read back; a damaged row is dropped, with a log line.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from server.store.responses import StoredResponses

log = logging.getLogger("artisan")


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    model: str
    messages: tuple[dict[str, Any], ...]  # the input conversation (without instructions) and the output turn
    body: str  # the response as it was answered (JSON)
    input_items: tuple[dict[str, Any], ...]  # the request's own input, as Responses items with ids
    at: float
    size: int  # characters of its JSON, counted against the store's bound


class ResponseStore:
    def __init__(self, ttl: float, capacity: int = 10_000, max_bytes: int = 256 * 2**20,
                 clock: Callable[[], float] = time.time, store: StoredResponses | None = None):
        self.ttl, self.capacity, self.max_bytes, self.clock = ttl, capacity, max_bytes, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # memory
        self._writing = threading.Lock()  # a change of memory and its write, in order
        self._store = store
        self._unstored: list[str] = []  # dropped from memory, not yet from the store
        if store is not None:
            self._restore()

    def put(self, response_id: str, owner: str, model: str, messages: list[dict[str, Any]],
            body: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        row = {"id": response_id, "owner": owner, "model": model, "created": self.clock(), "body": _json(body),
               "messages": _json(messages), "input_items": _json(input_items)}
        kept = StoredResponse(owner, model, tuple(messages), row["body"], tuple(input_items), row["created"],
                              _size(row))
        with self._writing:
            with self._lock:
                self._drop(response_id)
                self._hold(response_id, kept)
                dropped, self._unstored = self._unstored, []
            self._write(row, dropped)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            now = self.clock()
            while self._items and now - next(iter(self._items.values())).at > self.ttl:
                self._drop(next(iter(self._items)))
            found = self._items.get(response_id)
        return found if found is not None and found.owner == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        """Whether `owner`'s response was kept (and now is not)."""
        with self._writing:
            if self.get(response_id, owner) is None:
                return False
            with self._lock:
                self._drop(response_id)
                dropped, self._unstored = self._unstored, []
            self._write(None, dropped)
            return True

    # ---- memory (under _lock) ---------------------------------------------------------------------
    def _hold(self, response_id: str, kept: StoredResponse) -> None:
        self._items[response_id] = kept
        self._bytes += kept.size
        while len(self._items) > self.capacity or (self._bytes > self.max_bytes and len(self._items) > 1):
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        gone = self._items.pop(response_id, None)
        if gone is not None:
            self._bytes -= gone.size
            if self._store is not None:
                self._unstored.append(response_id)

    # ---- the store (under _writing) ---------------------------------------------------------------
    def _write(self, row: dict[str, Any] | None, dropped: list[str]) -> None:
        if self._store is None:
            return
        try:
            self._store.write(row, dropped)  # the deletes first: a response put again is replaced
        except Exception as exc:  # memory still holds it: this server serves it, a restart will not
            log.error("a kept response could not be stored: %s: %s", type(exc).__name__, exc)

    def _restore(self) -> None:
        """The stored responses that have not expired, oldest first, within the bounds; the others, and
        damaged ones (each named in the log), are removed from the store."""
        try:
            rows = self._store.load()
        except Exception as exc:
            log.error("the kept responses could not be read from the store (%s); none were restored", exc)
            return
        now, gone = self.clock(), []
        for row in rows:
            try:
                if now - row["created"] > self.ttl:
                    gone.append(row["id"])
                    continue
                json.loads(row["body"])
                kept = StoredResponse(row["owner"], row["model"], tuple(json.loads(row["messages"])), row["body"],
                                      tuple(json.loads(row["input_items"])), row["created"], _size(row))
            except Exception as exc:
                log.warning("kept response %r is damaged in the store (%s: %s); it is dropped", row.get("id"),
                            type(exc).__name__, exc)
                gone.append(row["id"])
                continue
            self._hold(row["id"], kept)
        gone += self._unstored  # past the bounds
        self._unstored = []
        self._write(None, gone)
        if self._items:
            log.info("restored %d kept response(s) from the store", len(self._items))


def _json(value: Any) -> str:
    """Plain json.dumps, not the store's NaN-as-null: a logprob of -inf must read back as it was sampled."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _size(row: dict[str, Any]) -> int:
    return len(row["body"]) + len(row["messages"]) + len(row["input_items"])
