"""Sessions recorded by the server: how an agent whose code cannot be changed gets trained.

A harness (the OpenAI Agents SDK, a coding agent, anything that only lets one set its base URL)
is pointed at `/v1/sessions/{id}/...`. Every exchange under that URL, whichever API face it came
through, is kept here in chat terms: the conversation the turn was sampled after, the tools, and the
choice exactly as sampled (token ids, logprobs, sampling record). Scoring a session turns it into a
trajectory: each exchange that a later one continues is spliced into that later conversation as the
Choice it was (which continues which is protocol/histories.py's rule, shared with the client's
captures), so training sees the same Choices a hand-written rollout would have appended, and
the same token-exact checks apply (server/training/assemble.py).

A session is the API key's that recorded into it: ids are per key, so another key's id is simply
another session (no answer tells that it exists). A session comes to be when its first exchange is
recorded, never by a request that failed; it expires when unused for `ttl` seconds, and holds at
most `max_exchanges` exchanges, `max_tokens` recorded tokens and `max_bytes` bytes; a full session
refuses new exchanges rather than dropping old ones (a trajectory with a hole would train on a lie).
Each key may hold `max_per_key` sessions and the server `max_sessions`, so one key cannot lock the
others out. Message fields no chat template reads are dropped before recording: they change no
prompt, so keeping them would only spend memory.

A session job takes its sessions (`claim`): it refuses a session with an exchange still being
sampled (the trajectory would miss it) and one another job took (it would train twice); a taken
session records no more. What a job took is in its stored request (server/training/jobs.py), so a
job outlives its sessions.

Sessions are read from memory and kept in the run store (server/store/sessions.py), so they outlive
a restart until they expire: each exchange is written before its answer's last byte goes out (off
the event loop: a large one takes a while), the job that took a session is written once it is
stored, and a deletion or expiry removes the rows. Writes are queued in the order memory changed
and written in that order, so the store never sees a session deleted before its last exchange.
At start the unexpired ones are read back; one whose rows are damaged is dropped, with a log line.
A restart loses only the exchanges still being sampled (their clients got no answer).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from collections import Counter, OrderedDict, defaultdict, deque
from typing import Any, Callable, Iterable

from protocol.trajectory import Trajectory
from server.harness.kept_fields import SERVER_FIELDS, kept_message, rendered_fields
from server.harness.session_records import (Exchange, Messages, Session, Tools, exchange_tokens, restored_session,
                                            session_histories, size)
from server.store.sessions import Statements, StoredSessions, deleted, recorded, taken

log = logging.getLogger("artisan.sessions")

Key = tuple[str, str]  # (owner, session id)


class SessionError(Exception):
    """A session cannot be used: `status` says how (400 nothing to train on, 404 unknown, 409 full,
    in flight or taken, 429 too many sessions); `session_id` names the one at fault, when one is."""

    def __init__(self, status: int, message: str, session_id: str | None = None):
        super().__init__(message)
        self.status, self.message, self.session_id = status, message, session_id


class _Write:
    """Rows to write, built when written (a large exchange is serialised off the event loop); `error`
    is what the store answered, for whoever waits on it."""

    def __init__(self, statements: Callable[[], Statements]):
        self.statements, self.error = statements, None


class Recording:
    """One request's exchanges on their way into a session. `begin` before sampling (it refuses a
    full session, or one past the caps, before any work is done), the recorder called with each
    choice (off the event loop: it returns once the exchange is stored), `end` once the request is
    over however it ended (until then a session job refuses the session: its trajectory would miss
    this exchange)."""

    def __init__(self, sessions: "Sessions", key: Key):
        self._sessions, self.key = sessions, key
        self._pending: tuple[Messages, Tools, int] | None = None
        self._open = False

    def begin(self, messages: Messages, tools: Tools) -> None:
        self._pending = self._sessions._begin(self.key, messages, tools)
        self._open = True

    def __call__(self, choice: dict[str, Any]) -> None:
        assert self._pending is not None, "begin() first"
        messages, tools, nbytes = self._pending
        self._sessions._record(self.key, Exchange(messages, tools, choice), nbytes)

    def end(self) -> None:
        if self._open:
            self._open = False
            self._sessions._end(self.key)


class Sessions:
    """Live sessions, bounded in number (per key and in all), size and age."""

    def __init__(self, ttl: float, max_sessions: int, max_per_key: int, max_exchanges: int, max_tokens: int,
                 max_bytes: int, kept_fields: frozenset[str] | None = None, clock: Callable[[], float] = time.time,
                 store: StoredSessions | None = None):
        """With a store, the sessions it keeps that have not expired are live again."""
        self.ttl, self.max_sessions, self.max_per_key = ttl, max_sessions, max_per_key
        self.max_exchanges, self.max_tokens, self.max_bytes = max_exchanges, max_tokens, max_bytes
        self.kept = None if kept_fields is None else kept_fields | SERVER_FIELDS
        self.clock = clock
        self._live: OrderedDict[Key, Session] = OrderedDict()  # least recently used first
        self._sampling: Counter[Key] = Counter()  # exchanges being sampled, per session (recorded yet or not)
        self._held: Counter[str] = Counter()  # per owner: sessions live or being sampled into
        self._lock = threading.Lock()
        self._store = store
        self._unwritten: deque[_Write] = deque()  # in the order memory changed; appended under _lock
        self._writing = threading.Lock()  # one writer at a time, so the store changes in that order too
        if store is not None:
            self._restore()

    @classmethod
    def from_settings(cls, settings: Any, template: Any = None, store: StoredSessions | None = None) -> "Sessions":
        """The bounds are Settings' (session_ttl, max_sessions, max_sessions_per_key, session_max_*);
        the fields kept are those the served model's chat template may render (every one without it).
        With a store, the sessions it keeps that have not expired are live again."""
        return cls(ttl=settings.session_ttl, max_sessions=settings.max_sessions,
                   max_per_key=settings.max_sessions_per_key, max_exchanges=settings.session_max_exchanges,
                   max_tokens=settings.session_max_tokens, max_bytes=settings.session_max_bytes,
                   kept_fields=None if template is None else rendered_fields(template), store=store)

    # ---- the store -------------------------------------------------------------------------------
    def _queue(self, statements: Callable[[], Statements]) -> _Write | None:
        """A write, in its place after every change memory saw before it (call under _lock)."""
        if self._store is None:
            return None
        write = _Write(statements)
        self._unwritten.append(write)
        return write

    def _persist(self, write: _Write | None) -> None:
        """Every queued write, in order, and `write`'s error raised: once this returns, `write` is stored.
        (Blocking: not on the event loop.)"""
        if self._store is None:
            return
        with self._writing:
            while self._unwritten:
                queued = self._unwritten.popleft()
                try:
                    self._store.write(queued.statements())
                except Exception as exc:
                    log.error("a recorded session could not be stored: %s: %s", type(exc).__name__, exc)
                    queued.error = exc
        if write is not None and write.error is not None:
            raise write.error

    def _restore(self) -> None:
        """The stored sessions not expired, live again as they were (taken or not); expired ones and
        damaged ones (each named in the log) are removed from the store."""
        assert self._store is not None
        try:
            rows, exchange_rows = self._store.load()
        except sqlite3.DatabaseError as exc:  # the store's repair at start leaves this rare: serve without them
            log.error("the stored sessions could not be read (%s); none were restored", exc)
            return
        exchanges: defaultdict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
        for r in exchange_rows:
            exchanges[(r["owner"], r["session_id"])].append(r)
        now, restored, gone = self.clock(), [], []  # gone: (owner, id) as stored, whatever their types
        for row in rows:
            key = (row["owner"], row["id"])
            try:
                session = restored_session(row, exchanges.pop(key, []))
            except Exception as exc:
                log.warning("stored session %r of key %r is damaged (%s: %s); it is dropped",
                            row["id"], row["owner"], type(exc).__name__, exc)
                gone.append(key)
                continue
            if now - session.touched > self.ttl:
                gone.append(key)
            else:
                restored.append(session)
        for key in exchanges:  # exchanges whose session row is missing cannot be a whole session
            log.warning("stored exchanges of session %r of key %r have no session row; they are dropped",
                        key[1], key[0])
            gone.append(key)
        try:
            self._store.delete(gone)
        except sqlite3.Error as exc:
            log.error("expired or damaged sessions could not be removed from the store: %s", exc)
        with self._lock:
            for session in sorted(restored, key=lambda s: s.touched):  # least recently used first, as in life
                key = (session.owner, session.id)
                was = self._is_held(key)
                self._live[key] = session
                self._recount(key, was)
        if restored:
            log.info("restored %d recorded session(s) from the store", len(restored))

    # ---- what counts -----------------------------------------------------------------------------
    def _is_held(self, key: Key) -> bool:
        """A session counts against its key's and the server's caps while it is live or being
        sampled into (a first exchange in flight holds its place, so concurrent ones cannot overshoot)."""
        return key in self._live or self._sampling[key] > 0

    def _recount(self, key: Key, was_held: bool) -> None:
        now_held = self._is_held(key)
        if now_held != was_held:
            self._held[key[0]] += 1 if now_held else -1
            if not self._held[key[0]]:
                del self._held[key[0]]

    def _drop(self, key: Key) -> _Write | None:
        was = self._is_held(key)
        write = self._queue(lambda: deleted(*key)) if self._live.pop(key, None) is not None else None
        self._recount(key, was)
        return write

    def _expire(self, now: float) -> None:
        while self._live:
            key, oldest = next(iter(self._live.items()))
            if now - oldest.touched <= self.ttl:
                return
            self._drop(key)

    def _check_room(self, key: Key) -> None:
        """A 429 when a new session would pass its key's count or the server's."""
        owned = self._held[key[0]]
        if owned >= self.max_per_key:
            raise SessionError(429, f"this key has {owned} sessions, the most one key may keep; train or delete some, "
                                    f"or wait {self.ttl:.0f} s for unused ones to expire", key[1])
        total = sum(self._held.values())
        if total >= self.max_sessions:
            raise SessionError(429, f"{total} sessions are live, the most this server keeps; train or delete some, "
                                    f"or wait {self.ttl:.0f} s for unused ones to expire", key[1])

    def _check_fits(self, session: Session, nbytes: int) -> None:
        """A 409 when the session cannot take one more exchange of `nbytes` bytes (or was taken)."""
        if session.taken_by is not None:
            raise SessionError(409, f"session {session.id!r} was submitted for training by {session.taken_by} and "
                                    f"records no more: record into a new session id", session.id)
        exchanges = len(session.exchanges) + self._sampling[(session.owner, session.id)]
        if exchanges >= self.max_exchanges or session.tokens >= self.max_tokens or \
                session.bytes + nbytes > self.max_bytes:
            raise SessionError(409, f"session {session.id!r} is full ({len(session.exchanges)} exchanges, "
                                    f"{session.tokens} tokens, {session.bytes} bytes, and this exchange's "
                                    f"{nbytes} bytes; at most {self.max_exchanges}, {self.max_tokens} and "
                                    f"{self.max_bytes}): score it and start another", session.id)

    # ---- recording -------------------------------------------------------------------------------
    def recording(self, session_id: str, owner: str) -> Recording:
        """How one request records into the session: nothing is created or checked until it begins."""
        return Recording(self, (owner, session_id))

    def _begin(self, key: Key, messages: Messages, tools: Tools) -> tuple[Messages, Tools, int]:
        kept = [kept_message(m, self.kept) for m in messages]
        nbytes = size([kept, tools])
        with self._lock:
            now = self.clock()
            self._expire(now)
            session = self._live.get(key)
            if session is None:
                if not self._is_held(key):
                    self._check_room(key)
                session = Session(key[1], key[0], now, now)  # checked as empty; created when recorded into
            self._check_fits(session, nbytes)
            was = self._is_held(key)
            self._sampling[key] += 1
            self._recount(key, was)
            if key in self._live:
                session.touched = now
                self._live.move_to_end(key)
        return kept, tools, nbytes

    def _record(self, key: Key, exchange: Exchange, nbytes: int) -> None:
        """In memory, then in the store (blocking: call it off the event loop). An exchange the store
        refuses is forgotten and the error raised: the request fails rather than answer with an
        exchange a restart would lose."""
        tokens, nbytes = exchange_tokens(exchange), nbytes + size(exchange.choice)
        row = {"messages": exchange.messages, "tools": exchange.tools, "choice": exchange.choice}
        with self._lock:
            now = self.clock()
            session = self._live.get(key)
            first = session is None
            if session is None:
                was = self._is_held(key)
                session = self._live[key] = Session(key[1], key[0], now, now)
                self._recount(key, was)
            session.exchanges.append(exchange)
            session.tokens += tokens
            session.bytes += nbytes
            session.touched = now
            self._live.move_to_end(key)
            seq, created = session.next_seq, session.created
            session.next_seq += 1
            write = self._queue(lambda: recorded(key[0], key[1], seq, row, created, now, first))
        try:
            self._persist(write)
        except Exception:
            self._forget(key, exchange, tokens, nbytes)
            raise

    def _forget(self, key: Key, exchange: Exchange, tokens: int, nbytes: int) -> None:
        """An exchange the store refused, out of its session (and a session it alone made, out of memory)."""
        with self._lock:
            session = self._live.get(key)
            if session is None:
                return
            for i, e in enumerate(session.exchanges):
                if e is exchange:
                    del session.exchanges[i]
                    session.tokens, session.bytes = session.tokens - tokens, session.bytes - nbytes
                    break
            if not session.exchanges:
                self._drop(key)

    def _end(self, key: Key) -> None:
        with self._lock:
            was = self._is_held(key)
            self._sampling[key] -= 1
            if self._sampling[key] <= 0:
                del self._sampling[key]
            self._recount(key, was)

    # ---- reading ---------------------------------------------------------------------------------
    def _found(self, key: Key) -> Session:
        self._expire(self.clock())
        session = self._live.get(key)
        if session is None:
            raise SessionError(404, f"session {key[1]!r} does not exist (never recorded into, or expired after "
                                    f"{self.ttl:.0f} s unused)", key[1])
        return session

    def get(self, session_id: str, owner: str) -> Session:
        with self._lock:
            return self._found((owner, session_id))

    def delete(self, session_id: str, owner: str) -> None:
        """Gone from memory and from the store (blocking: call it off the event loop)."""
        with self._lock:
            self._found((owner, session_id))
            write = self._drop((owner, session_id))
        self._persist(write)

    # ---- training --------------------------------------------------------------------------------
    def claim(self, session_ids: Iterable[str], owner: str, still_taken: Callable[[str], bool]) -> str:
        """Take the sessions for one submission, all or none, and return the token that holds them
        (`settle` names the job then, `release` frees them when the submission fails). Refused: a
        session with an exchange still being sampled (its trajectory would miss it; all such are
        named), and one taken by a job that `still_taken` says still holds it (it would train twice)."""
        keys = list(dict.fromkeys((owner, sid) for sid in session_ids))
        with self._lock:
            busy = [key[1] for key in keys if self._sampling[key] > 0]  # a first exchange in flight included
            if busy:
                raise SessionError(409, f"session(s) {', '.join(repr(s) for s in busy)} have an exchange still "
                                        f"being sampled: submit once every request in them is answered", busy[0])
            sessions = [self._found(key) for key in keys]
            for s in sessions:
                if s.taken_by is not None and still_taken(s.taken_by):
                    raise SessionError(409, f"session {s.id!r} was already submitted for training by {s.taken_by}; "
                                            f"a session trains once (resubmit that job's idempotency key to "
                                            f"follow it)", s.id)
            token = "submission-" + uuid.uuid4().hex[:16]  # a job id once the job is queued
            for s in sessions:
                s.taken_by = token
        return token

    def settle(self, token: str, job_id: str) -> None:
        """The sessions a submission took now name its job, in the store too, so that they train once
        across a restart (blocking: call it off the event loop). The job is queued whatever the store
        says: a failure to store this is logged, and memory holds the sessions until a restart."""
        try:
            self._persist(self._retake(token, job_id, stored=True))
        except Exception as exc:
            log.error("the sessions job %s took could not be marked taken in the store: %s: %s", job_id,
                      type(exc).__name__, exc)

    def release(self, token: str) -> None:
        """A submission that failed gives its sessions back (only memory knew the submission)."""
        self._retake(token, None, stored=False)

    def _retake(self, token: str, taken_by: str | None, stored: bool) -> _Write | None:
        with self._lock:
            keys = [(s.owner, s.id) for s in self._live.values() if s.taken_by == token]
            for key in keys:
                self._live[key].taken_by = taken_by
            if not (stored and keys):
                return None
            return self._queue(lambda: [st for owner, sid in keys for st in taken(owner, sid, taken_by)])

    def trajectory(self, session_id: str, owner: str, reward: float, metrics: dict[str, Any] | None = None
                   ) -> Trajectory:
        with self._lock:
            exchanges = list(self._found((owner, session_id)).exchanges)
        if not exchanges:
            raise SessionError(400, f"session {session_id!r} has no exchanges to train on", session_id)
        main, *others = session_histories(exchanges)
        return Trajectory(messages_and_choices=main.messages_and_choices, tools=main.tools,
                          additional_histories=others, reward=reward, metrics=dict(metrics or {}),
                          metadata={"session_id": session_id})
