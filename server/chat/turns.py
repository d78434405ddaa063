"""The turn cache: every assistant turn this server sampled, by what a client echoes back.

A client sends earlier turns back as plain messages (content, reasoning, tool calls). Looking them
up here lets the next prompt contain the exact sampled ids instead of a re-tokenization, and lets
a training job recover the ids of a turn whose Choice lost them on the way (a streamed or
litellm-rebuilt choice).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.chat.template import content_text, json_arguments


@dataclass(frozen=True)
class SampledTurn:
    """An assistant turn exactly as sampled: the ids after the generation prompt."""

    token_ids: tuple[int, ...]
    record: dict[str, Any] | None = None  # the choice's logprobs and sampling record, when cached


def _canonical_arguments(arguments: Any) -> str:
    arguments = json_arguments(arguments)
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, sort_keys=True)


def turn_key(message: dict[str, Any]) -> str:
    """Identity of an assistant turn by what a client echoes back."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append([call.get("id") if isinstance(call, dict) else None, fn.get("name"),
                      _canonical_arguments(fn.get("arguments", {}))])
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    payload = json.dumps([content_text(message.get("content")) or "", reasoning, calls], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


class TurnCache:
    """Several rollouts of a group often write the same turn ("The price is 12."), each after its
    own prompt: a turn's text keeps its few newest samplings, and the renderer tells them apart by
    the prompt each was sampled from."""

    def __init__(self, capacity: int = 50_000, per_turn: int = 8):
        self.capacity, self.per_turn = capacity, per_turn
        self._items: OrderedDict[str, list[SampledTurn]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, message: dict[str, Any], turn: SampledTurn) -> None:
        key = turn_key(message)
        with self._lock:
            self._items[key] = [turn, *self._items.get(key, [])][: self.per_turn]
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def lookup(self, message: dict[str, Any]) -> list[SampledTurn]:
        """The samplings this turn may be, newest first: the ids a client or a training job
        carries in the message itself, else what this server remembers."""
        ids = message.get("token_ids")
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            return [SampledTurn(tuple(ids))]
        with self._lock:
            return list(self._items.get(turn_key(message), []))
