"""Which recorded exchange continues which: the one rule that turns model calls into histories.

Three places record a rollout as model calls instead of messages and choices: the server's sessions
(server/harness/sessions.py), ART's client-side capture (client/adapters/art_exchanges.py) and the verifiers relay
(client/adapters/verifiers.py). Each puts its records in one shape, `RecordedExchange`, and asks
`histories` which exchanges form one conversation, so the same calls always train as the same
histories whichever way they were captured.

The rule:

- Two messages are the same turn when `turn_identity` says so. An assistant message is known by
  what a client echoes back of it (text, reasoning, each call's id, name and arguments as JSON),
  the same identity the server splices a sampled turn's ids by (server/chat/sampled_turns.py); any
  other message by all its fields but those that are None, its text parts read as one text (what a
  chat template sees).
- An exchange continues an earlier one when its tools are the same and its messages start with the
  earlier exchange's messages and then the turn the earlier one sampled. Tools are part of the
  prompt: a turn sampled under other tools is not in the prompt a later render would make.
- Every exchange trains once. An exchange joins the history whose latest exchange it continues;
  one that continues an exchange another has continued already (a retry, a branch) starts a history
  of its own, where the earlier turn stays the plain message it echoed (the server finds its ids
  by that identity, so the prompt still renders as sampled).
- The history that holds the last exchange comes first (the conversation the rollout ended in);
  the others follow in the order they began.

Pure functions over plain messages; nothing here knows an API or imports torch.
"""

from __future__ import annotations

import json
from typing import Any, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from protocol.choices import Message

C = TypeVar("C")


class RecordedExchange(BaseModel):
    """One model call in chat terms: the conversation it was sampled after, the tools it was
    offered, and the choice it sampled (a chat choice, its `message` the assistant turn)."""

    model_config = ConfigDict(frozen=True)

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    choice: dict[str, Any]

    @field_validator("tools")
    @classmethod
    def _no_tools_is_none(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        # An empty list and none render the same prompt.
        return tools or None

    @field_validator("choice")
    @classmethod
    def _has_a_turn(cls, choice: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(choice.get("message"), dict):
            raise ValueError("a recorded choice needs its sampled `message`")
        return choice

    @property
    def turn(self) -> Message:
        return self.choice["message"]


def _text(content: Any) -> Any:
    """Content as the one text a template reads; anything but text parts stays as it is."""
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content


def _arguments(arguments: Any) -> Any:
    """A call's arguments compared as the mapping they parse to, so whitespace and key order
    do not matter; a string that is not a JSON object is compared as written."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        arguments = parsed if isinstance(parsed, dict) else arguments
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, sort_keys=True)


def turn_identity(message: Message) -> str:
    """What makes two messages the same turn. An assistant turn is what a client echoes back of
    it, so a refusal field, the content as parts or the arguments re-serialised do not make it
    another turn; any other message is all its fields that are set, its content as text."""
    if message.get("role") == "assistant":
        calls = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            calls.append([call.get("id") if isinstance(call, dict) else None, fn.get("name"),
                          _arguments(fn.get("arguments", {}))])
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        return json.dumps(["assistant", _text(message.get("content")) or "", reasoning, calls],
                          ensure_ascii=False, default=str)
    fields = {k: _text(v) if k == "content" else v for k, v in message.items() if v is not None}
    return json.dumps(fields, ensure_ascii=False, sort_keys=True, default=str)


def histories(exchanges: Sequence[RecordedExchange]) -> list[list[int]]:
    """The conversations the exchanges make, each as the indices of the exchanges it chains, in
    order: the one holding the last exchange first, then the others in the order they began."""
    keys = [[turn_identity(m) for m in e.messages] for e in exchanges]
    turns = [turn_identity(e.turn) for e in exchanges]

    def continues(j: int, i: int) -> bool:
        n = len(keys[i])
        return (exchanges[j].tools == exchanges[i].tools and len(keys[j]) > n
                and keys[j][n] == turns[i] and keys[j][:n] == keys[i])

    chains: list[list[int]] = []
    for j in range(len(exchanges)):
        # Several can be continued only when they were asked and answered alike (n > 1, a retry):
        # the one with the longest conversation, then the latest, is the one carried on.
        open_ = [c for c in chains if continues(j, c[-1])]
        if open_:
            max(open_, key=lambda c: (len(keys[c[-1]]), c[-1])).append(j)
        else:
            chains.append([j])
    if not chains:
        return []
    last = next(c for c in chains if c[-1] == len(exchanges) - 1)
    return [last, *(c for c in chains if c is not last)]


def spliced(exchanges: Sequence[RecordedExchange], chain: Sequence[int], choices: Sequence[C]
            ) -> list[Message | C]:
    """A chain's conversation as training reads it: the latest exchange's messages, every chained
    turn in them (and the last one, appended) as its caller's Choice, `choices[i]` for exchange i."""
    *earlier, last = chain
    items: list[Message | C] = list(exchanges[last].messages)
    for i in earlier:
        items[len(exchanges[i].messages)] = choices[i]
    items.append(choices[last])
    return items
