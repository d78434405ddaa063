"""What a recorded session holds (server/harness/sessions.py keeps them): its exchanges and what
they count against its limits, how its stored rows (server/store/sessions.py) read back, and its
conversations by the one history rule (protocol/histories.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from protocol.histories import RecordedExchange, histories, spliced
from protocol.trajectory import History

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


@dataclass
class Exchange:
    messages: Messages  # what the turn was sampled after, in chat terms
    tools: Tools
    choice: dict[str, Any]  # the chat choice as sampled


@dataclass
class Session:
    id: str
    owner: str
    created: float
    touched: float
    exchanges: list[Exchange] = field(default_factory=list)
    tokens: int = 0
    bytes: int = 0
    taken_by: str | None = None  # the job (or submission under way) that took it for training
    next_seq: int = 0  # the stored place of its next exchange

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "last_used": self.touched, "exchanges": len(self.exchanges),
                "tokens": self.tokens, "bytes": self.bytes, "trained_by": self.taken_by}


def size(value: Any) -> int:
    """Bytes a recorded value takes as JSON, the measure of a session's size."""
    return len(json.dumps(value, ensure_ascii=False, default=str).encode())


def exchange_tokens(exchange: Exchange) -> int:
    """Tokens an exchange counts against its session: its prompt and what was sampled."""
    return exchange.choice["sampling"]["prompt_len"] + len(exchange.choice["token_ids"])


def restored_session(row: dict[str, Any], exchange_rows: list[dict[str, Any]]) -> Session:
    """A stored session (server/store/sessions.py's rows) as it was recorded; an error naming what
    is wrong when its rows are damaged."""
    owner, sid, taken_by = row["owner"], row["id"], row["taken_by"]
    if not (isinstance(owner, str) and isinstance(sid, str) and sid):
        raise ValueError(f"its owner and id are {owner!r} and {sid!r}, not text")
    if taken_by is not None and not isinstance(taken_by, str):
        raise ValueError(f"taken_by is {taken_by!r}")
    created, touched = _instant(row["created"], "created"), _instant(row["touched"], "touched")
    if not exchange_rows:
        raise ValueError("it has no exchanges")
    session = Session(sid, owner, created, touched, taken_by=taken_by)
    for r in exchange_rows:
        if not isinstance(r["seq"], int):
            raise ValueError(f"an exchange's seq is {r['seq']!r}")
        exchange = stored_exchange(r["exchange"])
        session.exchanges.append(exchange)
        session.tokens += exchange_tokens(exchange)
        session.bytes += size([exchange.messages, exchange.tools]) + size(exchange.choice)
        session.next_seq = r["seq"] + 1  # the rows come in seq order
    return session


def _instant(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} is {value!r}, not a time")
    return float(value)


def stored_exchange(text: Any) -> Exchange:
    """A stored exchange's JSON as the Exchange it was; an error when it is not one training can read."""
    data = json.loads(text)
    messages, tools, choice = data["messages"], data["tools"], data["choice"]
    if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise ValueError("its messages are not a list of objects")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("its tools are not a list of objects")
    Choice.model_validate(choice)
    ids, prompt_len = choice["token_ids"], choice["sampling"]["prompt_len"]
    if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids) and isinstance(prompt_len, int)):
        raise ValueError("its token ids or prompt length are not integers")
    return Exchange(messages, tools, choice)


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
