"""Synthetic tool-use conversations for pretraining the embedded base model.

They teach the format and the skill every tool-using agent needs (call a tool with a value
copied from the question, then quote the number it returns) on made-up tools. The demo task's
own tools (get_price, get_stock) never appear: learning those, and which one to call, is left
to the warm-start SFT and to RL.
"""

from __future__ import annotations

import json
import random
from typing import Any

from examples.demo.task import ITEMS

_TOOLS = [
    ("get_weather", "city", "temperature"), ("get_balance", "account", "balance"), ("get_age", "person", "age"),
    ("get_height", "building", "height"), ("get_score", "team", "score"), ("get_population", "town", "population"),
    ("get_distance", "place", "distance"), ("get_rating", "movie", "rating"), ("get_weight", "animal", "weight"),
    ("get_count", "thing", "count"), ("lookup_order", "order", "total"), ("lookup_user", "user", "points"),
    ("find_room", "room", "floor"), ("check_speed", "car", "speed"), ("check_size", "box", "size"),
]
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
    picked = rng.sample(_TOOLS, rng.randint(2, 3))
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
