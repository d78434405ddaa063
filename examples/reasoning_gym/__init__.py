"""reasoning-gym's procedural tasks as an artisan example, for a small chat model.

One question, one answer, scored by reasoning-gym's own `score_answer` (rewards/reasoning_gym.py).
SmolLM2-135M ignores reasoning-gym's own prompt (it answers in sentences, 0% exact on every easy
task tried); two solved questions of the same dataset as earlier chat turns make it copy their
form, which puts its base accuracy between 4% and 44% on the easy settings below: room to learn,
and groups that disagree. bench/learn_base_rates.py measures it per task and prompt. The default
prompt, `fewshot_drawn`, draws each question's two solved questions from a pool: `fewshot`'s fixed
pair lends every question the same two answers to copy, and GRPO rewards a copy whenever it is
right (products' held-out answers collapsed onto "0", from "0 * 6 = 0"). With drawn
shots no task of the README's sweep ended below its base, and chain_sum, flat with the fixed pair,
learns in every seed. `fewshot` stays for the figures measured with it.

This is the task bench/learn.py trains with artisan and with TRL, and the one the SmolLM2
learning regression test (tests/learning/) trains:

    python -m client.train --server URL --example reasoning_gym --steps 24 --group-size 8 --groups-per-step 4
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import reasoning_gym

from rewards.reasoning_gym import exact_reply, score_reply
from rollouts.env import Environment, Example, RolloutSettings, Score, Task, ToolError

# Easy settings of reasoning-gym datasets; bench/learn_base_rates.py measures SmolLM2 on each.
SETTINGS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
                             allow_parentheses=False, allow_negation=False),
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "spell_backward": dict(min_word_len=3, max_word_len=4),
    "gcd": dict(min_value=1, max_value=20),
    "lcm": dict(min_value=1, max_value=10),
    "leg_counting": dict(min_animals=1, max_animals=1, min_instances=1, max_instances=2),
    "count_bits": dict(min_n=1, max_n=16),
    "letter_counting": dict(min_words=3, max_words=5),
    # Added for bench/learn_sweep.py's families (string, logic, algorithmic); SmolLM2's greedy few-shot
    # accuracy on 32 held-out questions: 0.16, 0.31, 0.36.
    "word_sequence_reversal": dict(min_words=2, max_words=3),
    "syllogism": dict(),
    "count_primes": dict(min_n=1, max_n=20),
}

# Difficulty levels for a curriculum (client/loop/curriculum.py), each a reasoning-gym dataset's own
# settings; level 0 is SETTINGS' easy one. leg_counting grows in kinds of animals and how many of each.
LEVELS: dict[str, list[dict[str, Any]]] = {
    "leg_counting": [SETTINGS["leg_counting"],
                     dict(min_animals=1, max_animals=2, min_instances=1, max_instances=3),
                     dict(min_animals=2, max_animals=3, min_instances=1, max_instances=4),
                     dict(min_animals=3, max_animals=4, min_instances=2, max_instances=6)],
    "chain_sum": [SETTINGS["chain_sum"], dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1),
                  dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
                  dict(min_terms=3, max_terms=4, min_digits=2, max_digits=2)],
    "products": [SETTINGS["products"], dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
                 dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)],
}

# System prompts that ask for the bare answer, each (system prompt, text appended to the question);
# the user-turn variants repeat the instruction where a small chat model attends to it most.
PROMPTS: dict[str, tuple[str, str]] = {
    "number": ("Answer with only the number.", ""),
    "final": ("Reply with only the final answer, nothing else.", ""),
    "user_number": ("Answer with only the number.", "\nAnswer with only the number."),
    "user_final": ("Reply with only the final answer, nothing else.", "\nReply with only the final answer, nothing else."),
    # Two solved questions of the same dataset as earlier chat turns: the model copies their form.
    "fewshot": ("Answer with only the final answer.", ""),
    # The same, with the two drawn for each question from a pool. Fixed shots also lend the model two
    # answers to copy, and GRPO rewards the copy whenever it is right: on products and chain_sum the
    # held-out answers collapsed onto a shot's answer ("0" from "0 * 6 = 0") with either trainer.
    "fewshot_drawn": ("Answer with only the final answer.", ""),
}
FEWSHOT_SEED, FEWSHOT_N, FEWSHOT_POOL = 99_999, 2, 64
SHORT_REPLY_TOKENS = 8

TASK, PROMPT = "leg_counting", "fewshot_drawn"  # chosen by measuring: the README's sweep
# A base model (Gemma 3 270M) never learned a chat template's markers: under its instruction template
# it wrote a stray token where each would go and never ended a turn (held-out accuracy 0.006). This
# template gives it the shots as plain "Question:" and "Answer:" lines, which it continues and ends
# with a newline: serve it with `--chat-template BASE_MODEL_TEMPLATE --stop-token '\n'`.
BASE_MODEL_TEMPLATE, BASE_MODEL_STOP = Path(__file__).with_name("base_model.jinja"), ("\n",)
TRAIN_SEED, EVAL_SEED = 0, 10_000  # disjoint seeds: the held-out rows are other questions


def rows(task: str, size: int, seed: int, level: int = 0) -> list[dict[str, Any]]:
    """`size` questions of `task` at difficulty `level` (LEVELS; 0 is SETTINGS' easy one). A task
    without settings here is asked at reasoning-gym's own defaults."""
    options = LEVELS[task][level] if task in LEVELS else SETTINGS.get(task, {})
    if level and task not in LEVELS:
        raise ValueError(f"reasoning-gym task {task!r} has no difficulty levels; those with levels: "
                         f"{', '.join(sorted(LEVELS))}")
    return list(reasoning_gym.create_dataset(task, size=size, seed=seed + 1000 * level, **options))


def messages(row: dict[str, Any], prompt: str) -> list[dict[str, str]]:
    system, suffix = PROMPTS[prompt]
    task = row["metadata"]["source_dataset"]
    if prompt == "fewshot":
        solved = _pool(task)[:FEWSHOT_N]
    elif prompt == "fewshot_drawn":
        solved = _drawn(task, row["question"])
    else:
        solved = []
    shots = [m for ex in solved
             for m in ({"role": "user", "content": ex["question"]}, {"role": "assistant", "content": str(ex["answer"])})]
    return [{"role": "system", "content": system}, *shots, {"role": "user", "content": row["question"] + suffix}]


@functools.cache
def _pool(task: str) -> list[dict[str, Any]]:
    """The solved questions shots come from; `fewshot`'s two are its first two."""
    return rows(task, FEWSHOT_POOL, FEWSHOT_SEED)


def _drawn(task: str, question: str) -> list[dict[str, Any]]:
    """FEWSHOT_N shots of distinct questions for `question`, the same on every call and in every
    process (seeded by a hash of its text, not Python's salted one), and none of them the question
    itself. Easy settings repeat questions (leg_counting's pool of 64 holds 43), so a draw that
    repeats one is drawn again."""
    pool = [ex for ex in _pool(task) if ex["question"] != question]
    rng = random.Random(hashlib.sha256(question.encode()).digest())
    while True:
        shots = rng.sample(pool, FEWSHOT_N)
        if len({ex["question"] for ex in shots}) == FEWSHOT_N:
            return shots


score = score_reply
# What a rollout is rewarded with: reasoning-gym's score_answer as it is, or its full credit alone.
REWARDS: dict[str, Callable[[str | None, dict[str, Any]], float]] = {"score_answer": score_reply, "exact": exact_reply}
REWARD = "score_answer"  # --reward exact did no better on the sweep (README)


async def greedy_replies(client: Any, model: str, rows: list[dict[str, Any]], prompt: str, max_tokens: int,
                         concurrency: int = 32) -> list[str]:
    """`model`'s greedy reply to each row, through an AsyncOpenAI client (the benches' held-out measure)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(row: dict[str, Any]) -> str:
        async with limit:
            r = await client.chat.completions.create(model=model, messages=messages(row, prompt),
                                                     temperature=0.0, max_tokens=max_tokens)
        return r.choices[0].message.content or ""

    return list(await asyncio.gather(*(one(r) for r in rows)))


async def greedy_scores(client: Any, model: str, rows: list[dict[str, Any]], prompt: str, max_tokens: int,
                        concurrency: int = 32) -> list[float]:
    """Each row's score for `model`'s greedy reply."""
    replies = await greedy_replies(client, model, rows, prompt, max_tokens, concurrency)
    return [score(reply, row) for reply, row in zip(replies, rows)]


class ReasoningGymEnv(Environment):
    """One question; the first answer ends the episode."""

    def __init__(self, row: dict[str, Any], prompt: str, reward: str):
        self.row, self.prompt, self.reward = row, prompt, REWARDS[reward]

    def initial_messages(self):
        return messages(self.row, self.prompt)

    async def call_tool(self, name, arguments):
        raise ToolError("this task has no tools")

    async def score(self, history) -> Score:
        return Score(reward=self.reward(history[-1].get("content"), self.row))


@dataclass
class ReasoningGymExample(Example):
    task: str = TASK
    prompt: str = PROMPT
    n_train: int = 1024
    n_eval: int = 64
    reward: str = REWARD

    def levels(self) -> int:
        return len(LEVELS.get(self.task, [None]))

    def train_tasks(self, seed: int) -> list[Task]:
        # `seed` orders nothing here: client.train shuffles; the rows are fixed by TRAIN_SEED so a
        # run and its baseline see the same questions.
        return [Task(id=f"train-L{self.level}-{i}", data={"row": r}, metadata={"level": self.level})
                for i, r in enumerate(self._rows(self.n_train, TRAIN_SEED))]

    def eval_tasks(self) -> list[Task]:
        return [Task(id=f"eval-L{self.level}-{i}", data={"row": r}, metadata={"level": self.level})
                for i, r in enumerate(self._rows(self.n_eval, EVAL_SEED))]

    def make_env(self, task: Task) -> Environment:
        return ReasoningGymEnv(task.data["row"], self.prompt, self.reward)

    def _rows(self, size: int, seed: int) -> list[dict[str, Any]]:
        return rows(self.task, size, seed, self.level)


def make_example(task: str = TASK, prompt: str = PROMPT, reward: Literal["score_answer", "exact"] = REWARD,
                 **kwargs: Any) -> ReasoningGymExample:
    if task not in reasoning_gym.factory.DATASETS:
        near = difflib.get_close_matches(task, reasoning_gym.factory.DATASETS, n=3)
        raise ValueError(f"reasoning-gym has no task {task!r}"
                         + (f"; did you mean {', '.join(near)}?" if near else f"; its tasks: "
                            f"{', '.join(sorted(reasoning_gym.factory.DATASETS))}"))
    if task not in SETTINGS:
        _check_shots(task)
    return ReasoningGymExample(name=f"reasoning-gym-{task}", task=task, prompt=prompt, reward=reward,
                               settings=RolloutSettings(max_turns=1, max_tokens=reply_tokens(task), temperature=1.0),
                               **kwargs)


def _check_shots(task: str) -> None:
    """A task asked at reasoning-gym's defaults must build its shot pool, and the shots must have
    answers to show (a few datasets, such as boxnet and rush_hour, score a reply without one)."""
    try:
        pool = _pool(task)
    except Exception as e:  # e.g. composite, which needs the datasets it mixes named
        raise ValueError(f"reasoning-gym task {task!r} cannot be built at its defaults: {type(e).__name__}: {e}") \
            from None
    if any(ex["answer"] is None for ex in pool):
        raise ValueError(f"reasoning-gym task {task!r} gives its questions no reference answer, and this example's "
                         f"prompt shows two solved ones: use its verifiers environment (environments/reasoning_gym_env)")


def reply_tokens(task: str) -> int:
    """A reply's token budget. The easy settings' answers are a few tokens, and 8 leaves room for a
    sentence the reward then scores 0 (measured). A task asked at reasoning-gym's defaults gets room
    for the longest answer of its shot pool at a token a UTF-8 byte (byte-level tokenizers never need
    more), and the same 8 beside it."""
    if task in SETTINGS:
        return SHORT_REPLY_TOKENS
    return SHORT_REPLY_TOKENS + max(len(str(ex["answer"]).encode()) for ex in _pool(task))
