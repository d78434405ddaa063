"""reasoning-gym's leg counting with tools: a small model learns to use them over several turns.

"How many legs are there in total if you have 3 woodlouses, 1 leech, 2 ducks?" SmolLM2-135M knows
neither a woodlouse's legs nor how to add 42 and 4 reliably. Here it has two tools, `legs(animal)`
(reasoning-gym's own table) and `calculate(expression)`, and an episode of up to five turns: look
every animal up, calculate, answer. The reward is reasoning-gym's own `score_answer` on the final
reply, so a tool only pays when its result reaches the answer.

A warm start teaches the episode's shape first: `demonstrations()` writes worked episodes (every
animal looked up in one turn, one sum, the answer) and art-server's SFT job trains on them
(`client.train --warm-start N`). The demonstrations are a split of their own: questions of two or
three kinds of animal (to four with `--demonstration-kinds 4`), where training and the held-out
questions have three or four. So the warm start teaches the shape, not the answers GRPO is judged
on: after 128 of the default's demonstrations (one epoch) greedy success is about 0.8 on questions
like the demonstrations and about 0.3 on the held-out ones: 0.62 on those of three kinds and 0.03
on those of four, where it looks up three or four animals and then sums three terms, the most any
demonstration has. Its slips: most often a count or a leg number copied from the wrong animal, or a
product left out of the sum; also an animal not looked up, a misspelt one ("grassman"), a malformed
call. GRPO is left to remove them, and to write a fourth term.
Episodes of one animal alone were tried as the warm start first: the model then looked up one
animal of every question, and no rollout of a several-animal question ever earned reward.
Also tried: a lookup that names the closest animal to one it does not know, with one
demonstration in four misnaming an animal and looking up the suggested name next (the slip at
weight 0, so SFT trains only the mending). Without such demonstrations the model never looked up
again after a refusal (0 of 59 training episodes); with them it looked animals up again after
calculating, refused or not, and seed 2's first seven training batches scored 0.05-0.38 against
0.16-0.69 without them.

SmolLM2's own chat template renders no tools; serve this example with `chat_template.jinja`
beside this file (ChatML with Hermes' tool tags, read by art-server's hermes parser):

    art-server --model <SmolLM2 GGUF> --chat-template examples/leg_lookup/chat_template.jinja
    python -m client.train --example leg_lookup --warm-start 128 --steps 24 ...
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import reasoning_gym
from reasoning_gym.arithmetic.leg_counting import ANIMALS

from client.errors import ConfigError
from protocol.trajectory import Conversation
from rewards.reasoning_gym import score_reply
from rollouts.env import Environment, Example, Message, RolloutSettings, Score, Task, ToolError

CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
SYSTEM_PROMPT = "Look up each animal's legs, calculate the total, then reply with only the number."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "legs", "description": "How many legs one animal of a kind has.",
        "parameters": {"type": "object", "properties": {"animal": {"type": "string"}}, "required": ["animal"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression of integers (+, -, *, /, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
# reasoning-gym's leg_counting settings: the questions trained and held out have three or four
# kinds of animal, the demonstrations two to `demonstration_kinds` (3 by default); one to four of each.
TASK = dict(min_animals=3, max_animals=4, min_instances=1, max_instances=4)
DEMONSTRATION_TASK = dict(TASK, min_animals=2, max_animals=3)
TRAIN_SEED, EVAL_SEED, WARM_START_SEED = 0, 10_000, 20_000  # each its own draw of questions

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_VALUE = 10 ** 12  # a calculator, not a bignum engine: a tower of powers is refused, not computed


def calculate(expression: str) -> str:
    """Integer arithmetic, evaluated from the parse tree (never `eval`). An integral result prints
    without a decimal point, as reasoning-gym's answers do."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            result = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ToolError("division by zero")
            result = _OPERATORS[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.operand))
        else:
            raise ToolError(f"not arithmetic: {expression!r}")
        if abs(result) > MAX_VALUE:
            raise ToolError("number too large")
        return result

    try:
        tree = ast.parse(str(expression).replace("×", "*"), mode="eval")
    except SyntaxError:
        raise ToolError(f"not arithmetic: {expression!r}") from None
    result = value(tree.body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def animal_of(name: str) -> str | None:
    """The kind in reasoning-gym's table that `name` is, singular or the plural its questions write
    ("woodlouses"); None for an animal it does not have."""
    name = str(name).strip().lower()
    return next((c for c in (name, name.removesuffix("s"), name.removesuffix("es")) if c in ANIMALS), None)


def legs(animal: str) -> str:
    """reasoning-gym's legs for one animal, by its name or its plural."""
    kind = animal_of(animal)
    if kind is None:
        raise ToolError(f"unknown animal {animal!r}")
    return str(ANIMALS[kind])


def rows(options: dict[str, Any], size: int, seed: int) -> list[dict[str, Any]]:
    return list(reasoning_gym.create_dataset("leg_counting", size=size, seed=seed, **options))


def opening(row: dict[str, Any]) -> list[Message]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]


def _calls(turn: int, calls: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(calls)]


def demonstration(row: dict[str, Any]) -> Conversation:
    """A worked episode of `row`: every animal looked up in one turn, their total calculated in the
    next, the result as the answer."""
    animals: dict[str, int] = row["metadata"]["animals"]
    lookups = _calls(0, [("legs", {"animal": a}) for a in animals])
    expression = " + ".join(f"{n} * {legs(a)}" for a, n in animals.items())
    total = calculate(expression)
    return Conversation(messages=[
        *opening(row),
        {"role": "assistant", "content": "", "tool_calls": lookups},
        *({"role": "tool", "tool_call_id": c["id"], "content": legs(a)} for c, a in zip(lookups, animals)),
        {"role": "assistant", "content": "", "tool_calls": _calls(1, [("calculate", {"expression": expression})])},
        {"role": "tool", "tool_call_id": "call_1_0", "content": total},
        {"role": "assistant", "content": total}], tools=TOOLS)


class LegLookupEnv(Environment):
    """One question; the model may call the tools, and its first plain reply is the answer."""

    tools = TOOLS

    def __init__(self, row: dict[str, Any]):
        self.row = row
        self.looked_up: set[str] = set()
        self.calculated = False

    def initial_messages(self) -> list[Message]:
        return opening(self.row)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name == "legs":
            result = legs(arguments.get("animal", ""))
            self.looked_up.add(animal_of(arguments["animal"]))
            return result
        if name == "calculate":
            self.calculated = True
            return calculate(arguments.get("expression", ""))
        raise ToolError(f"unknown tool {name!r}; the tools are legs and calculate")

    async def score(self, messages: list[Message]) -> Score:
        last = messages[-1] if messages else {}
        answered = last.get("role") == "assistant" and not last.get("tool_calls")
        reward = score_reply(last.get("content"), self.row) if answered else 0.0
        animals = self.row["metadata"]["animals"]
        found = sum(a in self.looked_up for a in animals)
        return Score(reward=reward, metrics={"animals_looked_up": found / len(animals),
                                             "calculated": self.calculated, "answered": answered})


@dataclass
class LegLookupExample(Example):
    n_train: int = 1024
    n_eval: int = 64
    # Demonstrations of up to three kinds never write a sum of four terms, and the warm start then
    # solves almost no four-kind question; up to four trades a weaker start for one GRPO can lift
    # (README, the tool agent). Set by `client.train --demonstration-kinds 4`.
    demonstration_kinds: int = DEMONSTRATION_TASK["max_animals"]

    def __post_init__(self) -> None:
        # Refused here, before client.train reaches a server or a warm start begins.
        if not DEMONSTRATION_TASK["min_animals"] <= self.demonstration_kinds <= TASK["max_animals"]:
            raise ConfigError(f"--demonstration-kinds must be {DEMONSTRATION_TASK['min_animals']} to "
                              f"{TASK['max_animals']}, not {self.demonstration_kinds}")

    def train_tasks(self, seed: int) -> list[Task]:
        # `seed` orders nothing here: client.train shuffles; the rows are fixed by TRAIN_SEED.
        return [Task(id=f"train-{i}", data={"row": r}) for i, r in enumerate(rows(TASK, self.n_train, TRAIN_SEED))]

    def eval_tasks(self) -> list[Task]:
        return [Task(id=f"eval-{i}", data={"row": r}) for i, r in enumerate(rows(TASK, self.n_eval, EVAL_SEED))]

    def make_env(self, task: Task) -> Environment:
        return LegLookupEnv(task.data["row"])

    def demonstrations(self, n: int) -> list[Conversation]:
        # Drawn from a split and a seed of their own, and no held-out question among them (a draw of
        # three kinds can repeat one).
        held_out = {t.data["row"]["question"] for t in self.eval_tasks()}
        task = dict(DEMONSTRATION_TASK, max_animals=self.demonstration_kinds)
        fresh = [r for r in rows(task, 2 * n, WARM_START_SEED) if r["question"] not in held_out]
        return [demonstration(r) for r in fresh[:n]]


def make_example(**kwargs: Any) -> LegLookupExample:
    # Lookups, a calculation, the answer, and two spare turns (one lookup per turn, or a retried
    # call). A turn of four lookups is 121-130 tokens as the demonstrations write them (SmolLM2's
    # tokenizer, 200 training questions), at or past the limit: with a long name ("praying mantis")
    # a correct turn is cut and scores 0. The warm start's greedy held-out success was the same at
    # 192, on three kinds and on four, so the limit is not what holds it on four kinds; a higher one
    # changes every seeded figure of this example (the README's tool agent, `make test-learn`), so it
    # waits for those to be rerun.
    # Temperature 0.7 is what bench/tool_agent.py measured; the warm start's batches scored about one
    # in twenty at first at 1 and at 0.7 alike, and the two were not compared further.
    return LegLookupExample(name="leg_lookup", settings=RolloutSettings(max_turns=5, max_tokens=128, temperature=0.7),
                            **kwargs)
