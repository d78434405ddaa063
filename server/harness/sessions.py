"""Sessions recorded by the server: how an agent whose code cannot be changed gets trained.

A harness (the OpenAI Agents SDK, a coding agent, anything that only lets one set its base URL)
is pointed at `/v1/sessions/{id}/...`. Every exchange under that URL, whichever API face it came
through, is kept here in chat terms: the conversation the turn was sampled after, the tools, and the
choice exactly as sampled (token ids, logprobs, sampling record). Scoring a session turns it into a
trajectory: each exchange that a later one continues is spliced into that later conversation as the
Choice it was (which continues which is protocol/histories.py's rule, shared with the client's
captures), so training sees the same Choices a hand-written rollout would have appended, and
the same token-exact checks apply (server/training/assemble.py).

A session belongs to the API key that opened it, expires when unused for `ttl` seconds, and holds
at most `max_exchanges` exchanges and `max_tokens` recorded tokens; a full session refuses new
exchanges rather than dropping old ones (a trajectory with a hole would train on a lie).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from openai.types.chat.chat_completion import Choice

from protocol.histories import RecordedExchange, histories, spliced
from protocol.trajectory import History, Trajectory


class SessionError(Exception):
    """A session cannot be used: `status` says how (403 another caller's, 404 unknown, 409 full,
    429 too many live sessions)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Exchange:
    messages: list[dict[str, Any]]  # what the turn was sampled after, in chat terms
    tools: list[dict[str, Any]] | None
    choice: dict[str, Any]  # the chat choice as sampled


@dataclass
class Session:
    id: str
    owner: str
    created: float
    touched: float
    exchanges: list[Exchange] = field(default_factory=list)
    tokens: int = 0

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "last_used": self.touched,
                "exchanges": len(self.exchanges), "tokens": self.tokens}


class Sessions:
    """Live sessions, bounded in number, size and age."""

    # The bounds are Settings' (session_ttl, max_sessions, session_max_exchanges, session_max_tokens).
    def __init__(self, ttl: float, max_sessions: int, max_exchanges: int, max_tokens: int,
                 clock: Callable[[], float] = time.time):
        self.ttl, self.max_sessions, self.max_exchanges, self.max_tokens = ttl, max_sessions, max_exchanges, max_tokens
        self.clock = clock
        self._live: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._live:
            oldest = next(iter(self._live.values()))
            if now - oldest.touched <= self.ttl:
                return
            self._live.popitem(last=False)

    def _owned(self, session_id: str, owner: str) -> Session | None:
        session = self._live.get(session_id)
        if session is not None and session.owner != owner:
            raise SessionError(403, f"session {session_id!r} belongs to another API key")
        return session

    def open(self, session_id: str, owner: str) -> Session:
        """The session, created on first use, ready to record one more exchange."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            session = self._owned(session_id, owner)
            if session is None:
                if len(self._live) >= self.max_sessions:
                    raise SessionError(429, f"{len(self._live)} sessions are live, the most this server keeps; "
                                            f"train or delete some, or wait {self.ttl:.0f} s for unused ones to expire")
                session = self._live[session_id] = Session(session_id, owner, now, now)
            if len(session.exchanges) >= self.max_exchanges or session.tokens >= self.max_tokens:
                raise SessionError(409, f"session {session_id!r} is full ({len(session.exchanges)} exchanges, "
                                        f"{session.tokens} tokens; at most {self.max_exchanges} and "
                                        f"{self.max_tokens}): score it and start another")
            session.touched = now
            self._live.move_to_end(session_id)
            return session

    def recorder(self, session: Session) -> Callable[[list[dict[str, Any]], list[dict[str, Any]] | None,
                                                       dict[str, Any]], None]:
        def record(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, choice: dict[str, Any]) -> None:
            with self._lock:
                session.exchanges.append(Exchange([dict(m) for m in messages], tools, choice))
                session.tokens += choice["sampling"]["prompt_len"] + len(choice["token_ids"])
                session.touched = self.clock()
                if session.id in self._live:
                    self._live.move_to_end(session.id)
        return record

    def get(self, session_id: str, owner: str) -> Session:
        with self._lock:
            self._expire(self.clock())
            session = self._owned(session_id, owner)
        if session is None:
            raise SessionError(404, f"session {session_id!r} does not exist (never used, or expired after "
                                    f"{self.ttl:.0f} s unused)")
        return session

    def delete(self, session_id: str, owner: str) -> None:
        self.get(session_id, owner)
        with self._lock:
            self._live.pop(session_id, None)

    def trajectory(self, session_id: str, owner: str, reward: float, metrics: dict[str, Any] | None = None
                   ) -> Trajectory:
        session = self.get(session_id, owner)
        with self._lock:
            exchanges = list(session.exchanges)
        if not exchanges:
            raise SessionError(409, f"session {session_id!r} has no exchanges to train on")
        main, *others = session_histories(exchanges)
        return Trajectory(messages_and_choices=main.messages_and_choices, tools=main.tools,
                          additional_histories=others, reward=reward, metrics=dict(metrics or {}),
                          metadata={"session_id": session_id})


def recorded_exchange(exchange: Exchange) -> RecordedExchange:
    """A session's exchange in the shape the history rule reads (protocol/histories.py)."""
    return RecordedExchange(messages=exchange.messages, tools=exchange.tools, choice=exchange.choice)


def session_histories(exchanges: list[Exchange]) -> list[History]:
    """The session's conversations by the one history rule (protocol/histories.py): the one the
    session ended in first, each sampled turn in it as the Choice it was."""
    recorded = [recorded_exchange(e) for e in exchanges]
    choices = [Choice.model_validate(e.choice) for e in exchanges]
    return [History(messages_and_choices=spliced(recorded, chain, choices), tools=recorded[chain[-1]].tools)
            for chain in histories(recorded)]
