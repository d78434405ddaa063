"""A greedy held-out evaluation's scores, and the part of them that depends on the question.

bench/learn.py's two trainers and the sweep (bench/learn_sweep.py) read a run's evaluations the
same way: each question's reply and score, and what the same replies score given to the other
questions, which is all a policy that answers one thing whatever it is asked would score.
"""

from __future__ import annotations

from typing import Any

from examples import reasoning_gym as learn_task


def held_out(replies: list[str], eval_rows) -> dict[str, Any]:
    """One greedy evaluation: its accuracy, each question's reply (whitespace collapsed) and score, and
    what the same replies score given to the other questions (`shuffled`), which is all a policy
    whose reply does not depend on the question scores."""
    scores = [learn_task.score(reply, row) for reply, row in zip(replies, eval_rows)]
    replies = [" ".join(r.split()) for r in replies]
    return {"accuracy": sum(scores) / len(scores), "replies": replies, "scores": scores,
            "shuffled": shuffled(replies, eval_rows)}


def shuffled(replies: list[str], rows) -> float:
    """The mean score of every reply on every other question. Answering one thing to all scores its
    accuracy here too, and so does a reply that reasoning-gym's scorer pays in part whatever the
    question: it gives len(answer) / len(reply) to a reply that contains the answer, so leg_counting's
    "10" earns 0.5 on every question whose answer is 0."""
    n = len(rows)
    if n < 2:
        return 0.0
    on_each = {reply: [learn_task.score(reply, row) for row in rows] for reply in set(replies)}
    total = sum(sum(on_each[reply]) for reply in replies)
    own = sum(on_each[reply][i] for i, reply in enumerate(replies))
    return (total - own) / (n * (n - 1))


def beyond_shuffled(held: dict[str, Any]) -> float:
    """An evaluation's accuracy less what its replies score given to other questions (`shuffled`):
    the part of it that depends on the question. The README's leg_counting command rose 0.071 ->
    0.234 on leg_counting with 11 of its 17 rewarded answers "12"; a sweep run rose 0.039 -> 0.180
    answering "10" to 28 of 64 questions, paid 0.5 on each whose answer is 0."""
    return round(held["accuracy"] - held["shuffled"], 4)


def first_and_last(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluations a run's record keeps whole: before training and at its end."""
    return {"base": evals[0], "final": evals[-1]}
