"""The demo task: a tiny shop assistant that must look things up before it answers.

The user asks for an item's price or its stock. The right move is to call the matching tool
with the item's name, then answer with the number the tool returned. Numbers are drawn per task,
so they can only come from the tool. Reward 1 only for the right tool, the right item and the
right number in the final answer; metrics show which part went wrong.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from rollouts.env import Environment, Example, Message, RolloutSettings, Score, Task, ToolError

ITEMS = [
    "apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum",
    "melon", "kiwi", "carrot", "potato", "tomato", "onion", "garlic", "pepper", "bread", "butter",
    "cheese", "milk", "yogurt", "coffee", "tea", "sugar", "salt", "rice", "pasta", "flour",
    "honey", "jam", "soap", "towel", "candle", "lamp", "chair", "table", "pillow", "blanket",
    "pencil", "notebook", "stapler", "scissors", "bottle", "basket", "hammer", "ladder",
]

SYSTEM_PROMPT = "You are a shop assistant. Look up prices and stock with the tools, then answer."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_price", "description": "Price of an item in dollars.",
     "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}},
    {"type": "function", "function": {"name": "get_stock", "description": "Units of an item in stock.",
     "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}},
]
# Phrased like the base model's pretraining chats (server/embedded/corpus.py), so the warm start
# only has to teach these two tools.
QUESTIONS = {
    "price": ["What is the price of {item}?", "Tell me the price for {item}.", "price of {item}?",
              "I need the price of {item}, please.", "Can you check the price of {item}?"],
    "stock": ["What is the stock of {item}?", "Tell me the stock for {item}.", "stock of {item}?",
              "I need the stock of {item}, please.", "Can you check the stock of {item}?"],
}
TOOL_FOR = {"price": "get_price", "stock": "get_stock"}


def make_task(rng: random.Random, item: str, index: int, split: str) -> Task:
    kind = rng.choice(["price", "stock"])
    question = rng.choice(QUESTIONS[kind]).format(item=item)
    return Task(
        id=f"{split}-{index}",
        data={"item": item, "kind": kind, "question": question,
              "price": rng.randint(2, 99), "stock": rng.randint(2, 99)},
        metadata={"kind": kind, "item": item, "split": split},
    )


def answer_text(kind: str, item: str, value: int) -> str:
    return f"The {kind} of {item} is {value}."


class ShopEnv(Environment):
    tools = TOOLS

    def __init__(self, task: Task):
        self.task = task
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def initial_messages(self) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.data["question"]}]

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        self.calls.append((name, arguments))
        if name not in ("get_price", "get_stock"):
            raise ToolError(f"unknown tool {name!r}")
        item = arguments.get("item")
        if item != self.task.data["item"]:
            raise ToolError(f"unknown item {item!r}")
        key = "price" if name == "get_price" else "stock"
        return {"item": item, key: self.task.data[key]}

    async def score(self, messages: list[Message]) -> Score:
        d = self.task.data
        right_tool = any(n == TOOL_FOR[d["kind"]] and a.get("item") == d["item"] for n, a in self.calls)
        final = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
        text = final.get("content") or ""
        numbers = {int(n) for n in re.findall(r"\d+", text)}
        right_number = d[d["kind"]] in numbers
        success = right_tool and right_number and not final.get("tool_calls")
        return Score(
            reward=1.0 if success else 0.0,
            metrics={"right_tool": right_tool, "right_number": right_number, "tool_calls": len(self.calls)},
        )


def demonstration(task: Task, mistake: bool, rng: random.Random) -> list[Message]:
    """A worked conversation for warm-start SFT. A mistake calls the other tool and reports its
    number, which looks fluent but earns no reward: the habit RL has to unlearn."""
    d = task.data
    kind = d["kind"] if not mistake else ("stock" if d["kind"] == "price" else "price")
    tool = TOOL_FOR[kind]
    result = {"item": d["item"], kind: d[kind]}
    call_id = f"call_{rng.randrange(16**8):08x}"
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": d["question"]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps({"item": d["item"]})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
        {"role": "assistant", "content": answer_text(kind, d["item"], d[kind])},
    ]


class ShopExample(Example):
    def __init__(self, n_train: int = 512, n_eval: int = 64):
        super().__init__(name="demo", settings=RolloutSettings(max_turns=4, max_tokens=48, temperature=0.6))
        self.n_train, self.n_eval = n_train, n_eval

    def train_tasks(self, seed: int) -> list[Task]:
        rng = random.Random(seed)
        return [make_task(rng, rng.choice(ITEMS), i, "train") for i in range(self.n_train)]

    def eval_tasks(self) -> list[Task]:
        # Held out by draw, not by vocabulary: a fresh seed gives new item/question/number combinations.
        rng = random.Random(10_000)
        return [make_task(rng, rng.choice(ITEMS), i, "eval") for i in range(self.n_eval)]

    def make_env(self, task: Task) -> Environment:
        return ShopEnv(task)


def make_example(**kwargs: Any) -> ShopExample:
    return ShopExample(**kwargs)
