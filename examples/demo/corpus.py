"""Synthetic tool-use conversations for pretraining the embedded base model.

They teach the format and the skill every tool-using agent needs (pick the tool the question is
about, call it with a value copied from the question, then quote the number it returns) on
made-up tools. Which tool a task's user really wants, and the habits of one task, are left to
the warm-start SFT and to RL.
"""

from __future__ import annotations

import json
import random
from typing import Any

from examples.demo.task import ITEMS

# Tool names are composed at random (verb_field), so the only way to fit this data is to copy:
# the field from the question into the tool name, the parameter from the tool's schema, the value
# from the question, and the number from the tool's result into the answer.
_VERBS = ["get", "check", "find", "lookup", "fetch"]
_FIELDS = ["temperature", "balance", "age", "height", "score", "population", "distance", "rating", "weight",
           "count", "total", "points", "floor", "speed", "size", "price", "stock", "length", "width", "depth",
           "volume", "capacity", "duration", "salary", "budget", "cost", "rank", "level", "grade", "year",
           "number", "quantity", "limit", "fee", "tax", "discount", "area", "power", "voltage", "margin"]
_PARAMS = ["item", "city", "user", "name", "id", "place", "thing", "product", "account", "code", "team", "car"]
_WORDS = ITEMS + ["paris", "london", "tokyo", "alice", "bob", "carol", "red", "blue", "tigers", "lions", "tower",
                  "bridge", "river", "castle", "garden", "dog", "cat", "horse", "truck", "boat", "A12", "B7", "C33"]
_QUESTIONS = ["What is the {field} of {value}?", "Tell me the {field} for {value}.", "{field} of {value}?",
              "I need the {field} of {value}, please.", "Can you check the {field} of {value}?"]
_ANSWERS = ["The {field} of {value} is {n}.", "{value} has a {field} of {n}.", "It is {n}.",
            "The {field} is {n}."]


def tool_schema(name: str, param: str, field: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"Returns the {field} of a {param}.",
        "parameters": {"type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


def conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    fields = rng.sample(_FIELDS, rng.randint(2, 3))
    picked = [(f"{rng.choice(_VERBS)}_{f}", rng.choice(_PARAMS), f) for f in fields]
    name, param, field = rng.choice(picked)
    value = rng.choice(_WORDS)
    n = rng.randint(2, 999)
    call_id = f"call_{rng.randrange(16 ** 8):08x}"
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Use the tools to answer."},
        {"role": "user", "content": rng.choice(_QUESTIONS).format(field=field, value=value)},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": name, "arguments": json.dumps({param: value})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({param: value, field: n})},
        {"role": "assistant", "content": rng.choice(_ANSWERS).format(field=field, value=value, n=n)},
    ]
    return messages, [tool_schema(*t) for t in picked]
