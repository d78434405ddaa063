"""reasoning-gym's own score of a reply, as every artisan user of reasoning-gym scores it (the
verifiers taskset in environments/reasoning_gym_env, bench/learn.py): `score_answer` of the
row's dataset, on the reply's last `<answer>` if it wrote one, else on the stripped reply, so a
bare correct answer still counts; 0 where the scorer raises on the reply. Needs the `reasoning-gym`
package."""

from __future__ import annotations

from typing import Any


def score_reply(reply: str | None, row: dict[str, Any]) -> float:
    import reasoning_gym  # here, not at the top: rewards/ is imported where reasoning-gym is not installed
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(reply or "")
    if answer is None:
        answer = (reply or "").strip()
    score_answer = reasoning_gym.get_score_answer_fn(row["metadata"]["source_dataset"])
    try:
        return float(score_answer(answer, row))
    except Exception:
        # A scorer that raises has not paid the reply. Most datasets' scorers give 0 to a reply they
        # cannot parse, and some raise instead (prime_factorization's int() on "2 and 32"); raised
        # from here, it would make the rollout an error, which reads as a broken tool or server. A
        # scorer that raised on every reply would score every rollout 0, which the step names.
        return 0.0


def exact_reply(reply: str | None, row: dict[str, Any]) -> float:
    """1 for a reply `score_answer` gives full credit, else 0. Its default (leg_counting,
    basic_arithmetic, count_primes, word_sequence_reversal among the sweep's tasks) pays
    len(answer) / len(reply) to a reply that contains the answer, so "10" earns 0.5 on every
    question whose answer is 0 or 1: a reward for wrong numbers."""
    return 1.0 if score_reply(reply, row) >= 1.0 else 0.0
