"""Compare the tool calls an agent made with ground-truth actions.

An action is a tool name plus its arguments. Arguments compare by canonical JSON with list order
kept: in e.g. `modify_items(item_ids=[a, b], new_item_ids=[c, d])` position pairs the lists up.
A call whose arguments did not parse is kept (it was an action the agent took) but matches nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from pydantic import BaseModel

from rewards.canonical import canonical_json


class Action(BaseModel):
    name: str
    arguments: dict[str, Any] | None = None  # None: the call's arguments were not a JSON object
    raw_arguments: str | None = None  # the unparsable text, kept for logs

    def key(self) -> str | None:
        """Identity for matching; None for an unparsable call, which equals no other action."""
        if self.arguments is None:
            return None
        return canonical_json({"name": self.name, "arguments": self.arguments}, sort_lists=False)


ActionLike = Action | Mapping[str, Any]


class ActionComparison(BaseModel):
    exact_match: bool  # same actions in the same order
    unordered_match: bool  # same multiset of actions
    matched: int
    precision: float  # matched / actions taken; 1.0 when none were taken
    recall: float  # matched / expected actions; 1.0 when none were expected
    f1: float
    missing: list[Action]  # expected but not taken
    unexpected: list[Action]  # taken but not expected (unparsable calls included)


def compare_actions(actual: Sequence[ActionLike], expected: Sequence[ActionLike]) -> ActionComparison:
    got, want = _as_actions(actual), _as_actions(expected)
    got_keys, want_keys = [a.key() for a in got], [a.key() for a in want]
    got_count = Counter(k for k in got_keys if k is not None)
    want_count = Counter(k for k in want_keys if k is not None)
    matched = sum((got_count & want_count).values())
    precision = matched / len(got) if got else 1.0
    recall = matched / len(want) if want else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    unordered = matched == len(got) == len(want)
    return ActionComparison(
        exact_match=unordered and got_keys == want_keys,
        unordered_match=unordered,
        matched=matched,
        precision=precision,
        recall=recall,
        f1=f1,
        missing=_leftover(want, got_count),
        unexpected=_leftover(got, want_count),
    )


def actions_match(actual: Sequence[ActionLike], expected: Sequence[ActionLike], *, ordered: bool = True) -> bool:
    result = compare_actions(actual, expected)
    return result.exact_match if ordered else result.unordered_match


def extract_actions(messages: Iterable[Any]) -> list[Action]:
    """The tool calls of the assistant turns in an OpenAI message list, in order.

    Accepts message dicts, pydantic messages, and Choices (their `.message` is used).
    """
    actions: list[Action] = []
    for message in messages:
        message = _as_dict(getattr(message, "message", message))
        if "message" in message and "finish_reason" in message:  # a Choice serialised as a dict
            message = _as_dict(message["message"])
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            function = _as_dict(call).get("function") or {}
            function = _as_dict(function)
            actions.append(_parse_call(str(function.get("name", "")), function.get("arguments")))
    return actions


def _parse_call(name: str, arguments: Any) -> Action:
    if isinstance(arguments, dict):
        return Action(name=name, arguments=arguments)
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    if not text.strip():
        # Some servers send "" for a call of a tool without parameters.
        return Action(name=name, arguments={})
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return Action(name=name, arguments=parsed)
    return Action(name=name, arguments=None, raw_arguments=text)


def _as_actions(items: Sequence[ActionLike]) -> list[Action]:
    return [a if isinstance(a, Action) else Action.model_validate(a) for a in items]


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return {}


def _leftover(actions: list[Action], other: Counter[str]) -> list[Action]:
    """The actions not paired with one in `other` (each of `other`'s actions pairs once)."""
    remaining = Counter(other)
    out = []
    for action in actions:
        key = action.key()
        if key is not None and remaining[key] > 0:
            remaining[key] -= 1
        else:
            out.append(action)
    return out
