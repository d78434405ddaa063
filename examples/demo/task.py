"""The demo task: a tiny shop assistant that must look a price up before it answers.

The user asks for an item's price. The right move is to call `get_price` with the item's name,
then answer with the number the tool returned. Prices are drawn per task, so they can only come
from the tool. The warm-started model often skips the lookup and answers with a made-up price,
fluent and wrong: the habit RL has to unlearn. Reward 1 only for a lookup of the right item and a
final answer that states the price the tool returned and names no other item ("The price of plum
is 36." does not answer a question about a pencil that costs 36); metrics show which part went
wrong.

One kind of question on purpose: the embedded model is too small to learn, from a warm start,
which of two tools a question asks for (its choice at the tool-name token did not depend on the
question at all), so a two-tool demo would measure that limit instead of RL.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from protocol.trajectory import Conversation
from rollouts.env import Environment, Example, Message, RolloutSettings, Score, Task, ToolError

ITEMS = [
    "apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum",
    "melon", "kiwi", "carrot", "potato", "tomato", "onion", "garlic", "pepper", "bread", "butter",
    "cheese", "milk", "yogurt", "coffee", "tea", "sugar", "salt", "rice", "pasta", "flour",
    "honey", "jam", "soap", "towel", "candle", "lamp", "chair", "table", "pillow", "blanket",
    "pencil", "notebook", "stapler", "scissors", "bottle", "basket", "hammer", "ladder",
]

SYSTEM_PROMPT = "You are a shop assistant. Look up prices with the tool, then answer."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_price", "description": "Price of an item in dollars.",
     "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}},
]
# Phrased like the base model's pretraining chats (examples/demo/corpus.py), so the warm start
# only has to teach this tool.
QUESTIONS = ["What is the price of {item}?", "Tell me the price for {item}.", "price of {item}?",
             "I need the price of {item}, please.", "Can you check the price of {item}?"]


def make_task(rng: random.Random, item: str, index: int, split: str) -> Task:
    question = rng.choice(QUESTIONS).format(item=item)
    return Task(id=f"{split}-{index}", data={"item": item, "question": question, "price": rng.randint(2, 99)},
                metadata={"item": item, "split": split})


def names(text: str, item: str) -> bool:
    """The answer mentions the item as a word, in any case ("Pencil", not "pencils" or "pencilcase")."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(item)}(?![A-Za-z0-9])", text, re.IGNORECASE) is not None


def answer_text(price: int) -> str:
    # The item is not repeated: a model this small copies it into the tool call reliably but not
    # into prose (trained on "The price of {item} is {n}.", it named the asked item in 3 answers
    # of 128), so the answer states the price of what was looked up, and naming any other item fails.
    return f"The price is {price}."


class ShopEnv(Environment):
    tools = TOOLS

    def __init__(self, task: Task):
        self.task = task
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def initial_messages(self) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.data["question"]}]

    def asked_item(self, name: str, arguments: dict[str, Any]) -> str:
        """The item a call asks the price of, the call recorded; a ToolError for any other call."""
        self.calls.append((name, arguments))
        if name != "get_price":
            raise ToolError(f"unknown tool {name!r}")
        item = arguments.get("item")
        if item != self.task.data["item"]:
            raise ToolError(f"unknown item {item!r}")
        return item

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        return {"item": self.asked_item(name, arguments), "price": self.task.data["price"]}

    async def score(self, messages: list[Message]) -> Score:
        d = self.task.data
        looked_up = any(n == "get_price" and a.get("item") == d["item"] for n, a in self.calls)
        final = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
        text = final.get("content") or ""
        right_number = d["price"] in {int(n) for n in re.findall(r"\d+", text)}
        other_item = next((i for i in ITEMS if i != d["item"] and names(text, i)), None)
        success = looked_up and right_number and other_item is None and not final.get("tool_calls")
        return Score(
            reward=1.0 if success else 0.0,
            metrics={"looked_up": looked_up, "right_number": right_number, "names_other_item": other_item is not None,
                     "tool_calls": len(self.calls)},
        )


def demonstration(task: Task, mistake: bool, rng: random.Random) -> list[Message]:
    """A worked conversation for warm-start SFT. A mistake skips the lookup and states a made-up
    price: it reads as well as the right answer and earns nothing."""
    d = task.data
    system_and_user = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": d["question"]}]
    if mistake:
        guess = rng.choice([n for n in range(2, 100) if n != d["price"]])
        return [*system_and_user, {"role": "assistant", "content": answer_text(guess)}]
    call_id = f"call_{rng.randrange(16**8):08x}"
    return [
        *system_and_user,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_price", "arguments": json.dumps({"item": d["item"]})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"item": d["item"], "price": d["price"]})},
        {"role": "assistant", "content": answer_text(d["price"])},
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

    def demonstrations(self, n: int) -> list[Conversation]:
        # Right episodes only, of draws of their own: the warm start a user would write.
        rng = random.Random(20_000)
        return [Conversation(messages=demonstration(make_task(rng, rng.choice(ITEMS), i, "demo"), False, rng),
                             tools=TOOLS) for i in range(n)]


def make_example(**kwargs: Any) -> ShopExample:
    return ShopExample(**kwargs)
