"""An email-search agent in the shape of OpenPipe's art-e: questions about a generated inbox, answered
by searching it (SQLite FTS5), reading messages and answering with the ids of the messages cited.

Reward of a training rollout: `judge_weight` x RULER + (1 - judge_weight) x exact match, 0.5 each
by default. Exact match (examples/email/answers.py) is 1 when the answer states the question's
fact (an amount, a date, a place, an order number, a code; however it is written) and no other
value of its kind. RULER (rewards/ruler/) ranks the rollouts of a group against each other, with
the question, its reference answer and the id of the message it comes from in the rubric; its
judge is the one `client.train --judge` names, by default art-server's base model through the
server's own OpenAI API (never the adapter being trained, so the judge does not drift with the
policy). A judgment that fails (the judge unreachable, or no valid verdict after the retries)
excludes its group, counted, as rewards/ruler/ does; the judge's malformed replies are counted
per group and per step. Held-out evaluation runs one rollout per question, where a relative judge
has nothing to compare: its reward is the exact match alone.

    art-server --model "$(python -c 'from tests.real_models import smollm2_gguf; print(smollm2_gguf())')" \\
        --chat-template tests/data/templates/qwen2_5.jinja &
    python -m client.train --example email --run email-1 --steps 8 --groups-per-step 4 --group-size 4
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from examples.email.env import EmailEnv
from examples.email.mailbox import DEFAULT_SEED, DEFAULT_SIZE, Fact, Mailbox, generate, mailbox_path
from protocol.trajectory import TrajectoryGroup
from rollouts.env import Environment, Example, RolloutSettings, Task

EVAL_SIZE = 64  # held-out questions, about facts of other messages than the training questions'

RUBRIC = """\
- The user asked: {question}
- The reference answer is: {answer} (it comes from message {message_id}). A final answer that states
  this value, in any wording or format, is correct; one that states another value, several values,
  or none is wrong.
- A trajectory with a correct final answer must score higher than any with a wrong or missing one.
- Among correct ones, prefer those that cite message {message_id} in the answer's sources and
  that found it with fewer tool calls.
- Among wrong ones, prefer those that searched sensibly (keywords from the question) and read
  the messages they found over ones that guessed, repeated themselves or made malformed tool calls."""


@functools.cache
def questions(seed: int, size: int) -> tuple[list[Fact], list[Fact]]:
    """(train, held-out) facts of the mailbox, in a fixed shuffled order; the held-out questions
    are about messages no training question is about."""
    _, facts = generate(seed, size)
    by_message: dict[str, list[Fact]] = {}
    for fact in facts:
        by_message.setdefault(fact.message_id, []).append(fact)
    ids = sorted(by_message)
    random.Random(seed).shuffle(ids)
    held_out: list[Fact] = []
    train: list[Fact] = []
    for mid in ids:
        (held_out if len(held_out) < EVAL_SIZE else train).extend(by_message[mid])
    random.Random(seed + 1).shuffle(train)
    return train, held_out[:EVAL_SIZE]


def fact_task(fact: Fact, split: str, index: int) -> Task:
    data = {"question": fact.question, "answer": fact.answer, "kind": fact.kind, "message_id": fact.message_id}
    return Task(id=f"email-{split}-{index}", data=data, metadata={"split": split, **data})


@dataclass
class EmailExample(Example):
    name: str = "email"
    # Every turn is one tool call (the answer tool ends the episode): a small model then searches
    # instead of writing prose, its calls always parse, and it acts on one result at a time.
    settings: RolloutSettings = field(default_factory=lambda: RolloutSettings(
        max_turns=6, max_tokens=128, tool_choice="required", parallel_tool_calls=False))
    seed: int = DEFAULT_SEED
    size: int = DEFAULT_SIZE
    cache: Path | None = None  # where the mailbox's SQLite file is built; None: mailbox.cache_dir()
    judge_weight: float = 0.5

    def train_tasks(self, seed: int) -> list[Task]:
        # `seed` orders nothing here: client.train draws from the list with its own seed.
        return [fact_task(f, "train", i) for i, f in enumerate(questions(self.seed, self.size)[0])]

    def eval_tasks(self) -> list[Task]:
        return [fact_task(f, "eval", i) for i, f in enumerate(questions(self.seed, self.size)[1])]

    @functools.cached_property
    def mailbox(self) -> Mailbox:
        return Mailbox(mailbox_path(self.seed, self.size, self.cache))

    def make_env(self, task: Task) -> Environment:
        return EmailEnv(task, self.mailbox)

    def group_scorer(self, judge: Any):
        if judge is None or self.judge_weight == 0:
            return None
        from rewards.ruler import score_group

        async def score(group: TrajectoryGroup) -> TrajectoryGroup:
            task = group.trajectories[0].metadata
            rubric = RUBRIC.format(question=task["question"], answer=task["answer"], message_id=task["message_id"])
            # Tool results are email bodies and search hits: 600 characters keep a whole message.
            return await score_group(group, judge, rubric, weight=self.judge_weight, max_retries=2,
                                     max_tool_output_chars=600)

        return score


def make_example(**kwargs: Any) -> EmailExample:
    return EmailExample(**kwargs)


__all__ = ["EmailEnv", "EmailExample", "make_example", "questions"]
