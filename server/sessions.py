"""Sessions recorded by the server: how an agent whose code cannot be changed gets trained.

A harness (the OpenAI Agents SDK, a coding agent, anything that only lets one set its base URL)
is pointed at `/v1/sessions/{id}/...`. Every exchange under that URL, whichever API face it came
through, is kept here in chat terms: the conversation the turn was sampled after, the tools, and the
choice exactly as sampled (token ids, logprobs, sampling record). Scoring a session turns it into a
trajectory: each exchange that a later one continues is spliced into that later conversation as the
Choice it was, so training sees the same Choices a hand-written rollout would have appended, and
the same token-exact checks apply (server/training/assemble.py).

A session belongs to the API key that opened it, expires when unused for `ttl` seconds, and holds
at most `max_exchanges` exchanges and `max_tokens` recorded tokens; a full session refuses new
exchanges rather than dropping old ones (a trajectory with a hole would train on a lie).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from openai.types.chat.chat_completion import Choice

from protocol.trajectory import History, Trajectory
from server.chat.sampled_turns import turn_key
from server.chat.template import content_text


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


def _norm(m: dict[str, Any]) -> str:
    """A message's identity for telling whether one conversation continues another: an assistant
    turn by what a client echoes back of it, anything else by role, text and call id."""
    if m.get("role") == "assistant":
        return "assistant:" + turn_key(m)
    try:
        text = content_text(m.get("content"))
    except (KeyError, TypeError):
        text = json.dumps(m.get("content"), sort_keys=True, default=str)
    return json.dumps([m.get("role"), text, m.get("tool_call_id")], ensure_ascii=False)


class Sessions:
    """Live sessions, bounded in number, size and age."""

    def __init__(self, ttl: float = 3600.0, max_sessions: int = 10_000, max_exchanges: int = 1_000,
                 max_tokens: int = 2_000_000, clock: Callable[[], float] = time.time):
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
        main, *others = _histories(exchanges)
        return Trajectory(messages_and_choices=main.messages_and_choices, tools=main.tools,
                          additional_histories=others, reward=reward, metrics=dict(metrics or {}),
                          metadata={"session_id": session_id})


def _histories(exchanges: list[Exchange]) -> list[History]:
    """The session's conversations, the last one recorded first. An exchange whose conversation
    continues an earlier exchange's (its messages start with that conversation and that turn) is
    the same conversation, longer; each conversation nobody continued is one history."""
    keys = [[_norm(m) for m in e.messages] for e in exchanges]
    turns = [_norm(e.choice["message"]) for e in exchanges]
    parent: dict[int, int] = {}
    for j in range(len(exchanges)):
        best = None
        for i in range(j):
            n = len(keys[i])
            if len(keys[j]) > n and keys[j][:n] == keys[i] and keys[j][n] == turns[i]:
                if best is None or n >= len(keys[best]):
                    best = i
        if best is not None:
            parent[j] = best
    continued = set(parent.values())
    histories = []
    for leaf in reversed([j for j in range(len(exchanges)) if j not in continued]):
        e = exchanges[leaf]
        items: list[Any] = list(e.messages)
        k = leaf
        while k in parent:
            k = parent[k]
            items[len(exchanges[k].messages)] = Choice.model_validate(exchanges[k].choice)
        items.append(Choice.model_validate(e.choice))
        histories.append(History(messages_and_choices=items, tools=e.tools))
    return histories
