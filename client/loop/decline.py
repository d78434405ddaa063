"""A run that gets worse, or no better, told in the line that sees it: held-out reward falling from
its best, held-out reward not rising above where training started, training reward falling from its
best, entropy collapsing before the task is learned, and held-out tasks all given one answer. Pure
functions of the loop's figures.

Runs on untuned tasks (too high a learning rate, mostly) have been seen to climb, then fall below
their best held-out reward while entropy collapsed until every rollout of a group gave the same
answer, and nothing said so. A fall counts when it is more than two standard errors of the
difference between the two evaluations (each evaluation's SE: the per-task rewards' std over
sqrt(n)), so that a noisy evaluation of a few tasks does not cry wolf.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

from client.loop.report import short_float
from protocol.names import policy_name

ENTROPY_COLLAPSE_FRACTION = 0.25  # a step's entropy below this share of the run's first trained step's
MOSTLY_SOLVED_REWARD = 0.8  # on the usual 0..1 reward: low entropy there is the task learned, not a collapse
# A run is told it has not got better from this share of its steps on, and at most NO_GAIN_STEPS steps in. From
# half on, 9 of the 30 16-step runs in bench/results/learn-sweep.jsonl would have been told so and then risen past
# the noise (chain_sum learns late); from three quarters, 2. The 15 that never did are told at steps 12 and 16
# (each evaluation's SE taken as a binomial one over its 64 questions).
NO_GAIN_FRACTION = 0.75
NO_GAIN_STEPS = 50
FEW_GROUPS_WITH_SIGNAL = 0.5  # below this share of groups with a reward spread, too little to learn from is the cause
# Batches compared when training reward falls: the mean of the last TRAINING_WINDOW against the best earlier
# run of as many. In bench/tool_agent.py's seed 2 the batches went from 0.58 (steps 4-7) to 0.27 (steps 11-14)
# while the held-out curve fell back to its start, and the step lines blamed the tasks. Replayed on the batch
# rewards of three other tool-agent runs (8 to 16 steps), the rule stays silent.
TRAINING_WINDOW = 4
# One final reply given to this share of the held-out tasks, scoring below it: the README's real-model
# command (SmolLM2, leg_counting) rose 0.071 -> 0.234 held out while its answer at step 16 was "12" to
# 32 of the 64 questions, and most of its reward was that answer's hits; nothing said so.
ONE_ANSWER_SHARE = 0.5
ONE_ANSWER_TASKS = 8  # fewer held-out replies than this say nothing of a collapse


def stderr_of(rewards: list[float]) -> float | None:
    """The standard error of the mean of per-task rewards (sample std / sqrt(n)); None with fewer
    than two, when nothing can be said about the noise."""
    n = len(rewards)
    if n < 2:
        return None
    mean = sum(rewards) / n
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1) / n)


def best_eval(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation with the highest held-out reward, the earliest on ties (its step, reward and
    stderr); None before any evaluation scored."""
    scored = [e for e in evals if e.get("reward") is not None]
    if not scored:
        return None
    best = max(scored, key=lambda e: (e["reward"], -e["step"]))
    return {"step": best["step"], "reward": best["reward"], "stderr": best.get("stderr")}


def two_standard_errors(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Two standard errors of the difference between two evaluations (their SEs known)."""
    return 2 * math.hypot(a["stderr"], b["stderr"])


def held_out_decline(evals: list[dict[str, Any]], run: str, learning_rate: float | None,
                     keep_best: bool) -> str | None:
    """A warning when the latest evaluation fell from the best before it by more than two standard
    errors of their difference (sqrt(se_best^2 + se_latest^2)); None otherwise, or when either
    evaluation's SE is unknown (fewer than two tasks scored)."""
    if not evals or evals[-1].get("reward") is None:
        return None
    latest, best = evals[-1], best_eval(evals[:-1])
    if best is None or best["stderr"] is None or latest.get("stderr") is None:
        return None
    fall, two_se = best["reward"] - latest["reward"], two_standard_errors(best, latest)
    if fall <= 0 or fall <= two_se:
        return None
    lr = f", now {short_float(learning_rate)}" if learning_rate else ""
    serve = (f"--keep-best will serve step {best['step']} at the end unless a later step scores higher" if keep_best
             else f"{policy_name(run, best['step'])} serves it, and --keep-best would make {run} serve it at the end")
    return (f"held-out reward fell from {best['reward']:.3f} (step {best['step']}) to {latest['reward']:.3f} "
            f"(step {latest['step']}), more than two standard errors ({two_se:.3f}): the policy is getting worse; "
            f"likely too high a learning rate (--learning-rate{lr}) or a collapse onto one answer (see entropy); "
            f"{serve}")


def no_held_out_gain(evals: list[dict[str, Any]], start_step: int, run_steps: int,
                     history: list[dict[str, Any]], learning_rate: float | None) -> str | None:
    """A warning when the run is NO_GAIN_FRACTION of its steps (at most NO_GAIN_STEPS) past the
    evaluation training started from (the last at or before `start_step`: step 0, or the warm
    start's), and no evaluation since has beaten it by more than two standard errors of their
    difference; with the share of groups that had a reward spread to learn from (the summary's
    `history`), which says why. None otherwise, or when an evaluation's SE is unknown."""
    scored = [e for e in evals if e.get("reward") is not None]
    start = next((e for e in reversed(scored) if e["step"] <= start_step), None)
    later = [e for e in scored if start is not None and e["step"] > start["step"]]
    if not later or later[-1] is not evals[-1] or start.get("stderr") is None:
        return None
    due = max(math.ceil(NO_GAIN_FRACTION * (run_steps - start["step"])), 1)
    if later[-1]["step"] - start["step"] < min(due, NO_GAIN_STEPS):
        return None
    if any(e.get("stderr") is None or e["reward"] - start["reward"] > two_standard_errors(start, e) for e in later):
        return None
    best = best_eval(later)
    two_se = two_standard_errors(start, best)
    return (f"held-out reward is no better than at step {start['step']} ({start['reward']:.3f}) after "
            f"{later[-1]['step'] - start['step']} steps: the best since, {best['reward']:.3f} at step {best['step']}, "
            f"is within two standard errors ({two_se:.3f}); " + _no_gain_cause(history, learning_rate))


def _no_gain_cause(history: list[dict[str, Any]], learning_rate: float | None) -> str:
    aside = sum(h.get("groups_set_aside") or 0 for h in history)  # --dynamic-sampling's: constant too
    total = aside + sum(h.get("groups_total") or 0 for h in history)
    constant = aside + sum(h.get("groups_dropped_constant") or 0 for h in history)
    if not total:
        return "the run is training but not learning"
    share = 1 - constant / total
    if share < FEW_GROUPS_WITH_SIGNAL:
        return (f"only {share:.0%} of its groups had a reward spread to learn from (in the rest every rollout scored "
                f"the same): more rollouts per task (--group-size), other groups sampled in their place "
                f"(--dynamic-sampling), or tasks it sometimes solves (--warm-start, --curriculum, an easier prompt)")
    lr = f", now {short_float(learning_rate)}" if learning_rate else ""
    return (f"{share:.0%} of its groups had a reward spread, so its steps trained: too small a learning rate "
            f"(--learning-rate{lr}), or a training reward that rises without carrying over to the held-out tasks "
            f"(compare the step lines' reward)")


def training_reward_decline(batches: list[tuple[int, float]], window: int = TRAINING_WINDOW) -> str | None:
    """A warning when the mean batch reward of the last `window` attempts fell below the best earlier
    run of `window` attempts by more than two standard errors of their difference (each mean's SE
    the std of all the run's batch rewards over sqrt(window)); None otherwise, or with fewer than
    2 * window batches. `batches`: every attempt's step and the batch reward the server reported, in
    order. Batches differ by their prompts' difficulty, so the noise is taken from the whole run."""
    if len(batches) < 2 * window:
        return None
    rewards = [r for _, r in batches]
    latest = sum(rewards[-window:]) / window
    means = [sum(rewards[i:i + window]) / window for i in range(len(rewards) - 2 * window + 1)]
    best = max(range(len(means)), key=lambda i: (means[i], -i))
    two_se = 2 * math.sqrt(2) * statistics.stdev(rewards) / math.sqrt(window)
    if means[best] - latest <= two_se:
        return None
    return (f"training reward fell from {means[best]:.3f} (steps {batches[best][0]}-{batches[best + window - 1][0]}) "
            f"to {latest:.3f} (steps {batches[-window][0]}-{batches[-1][0]}), more than two standard errors "
            f"({two_se:.3f}): the policy is getting worse at tasks it solved before, not facing harder ones; read a "
            f"few failed rollouts, lower --learning-rate, and --keep-best with --eval-every keeps the best step served")


def first_entropy(history: list[dict[str, Any]]) -> tuple[int, float] | None:
    """The run's first trained step that measured entropy, and that entropy (the summary's history
    is kept across a resume, so a resumed run compares with its own first step)."""
    return next(((h["step"], h["entropy"]) for h in history if h.get("trained") and h.get("entropy") is not None),
                None)


def entropy_collapse(first: tuple[int, float] | None, step: int, entropy: float | None, reward: float | None,
                     groups_solved: int = 0, groups_total: int = 0) -> str | None:
    """A warning when this trained step's entropy fell below ENTROPY_COLLAPSE_FRACTION of the first
    trained step's while the batch is not mostly solved (mean reward under MOSTLY_SOLVED_REWARD and
    fewer than half its groups solved by every rollout): the policy stopped exploring before it
    learned the task. None otherwise."""
    if first is None or entropy is None or first[0] >= step or first[1] <= 0:
        return None
    if entropy >= ENTROPY_COLLAPSE_FRACTION * first[1]:
        return None
    if (reward is not None and reward >= MOSTLY_SOLVED_REWARD) or (groups_total and groups_solved * 2 >= groups_total):
        return None
    said = "-" if reward is None else f"{reward:.3g}"
    return (f"entropy fell from {first[1]:.3g} to {entropy:.3g} nats per token since step {first[0]} while reward is "
            f"{said}: the policy is collapsing onto one answer before it has learned the task; lower --learning-rate")


def one_answer(replies: list[str], reward: float | None) -> str | None:
    """A warning when one final reply (non-empty, as `final_reply` gives it) answers at least
    ONE_ANSWER_SHARE of the held-out tasks, and the held-out reward is below that share: the policy
    is collapsing onto one answer whatever the question, and its reward is mostly how often that
    answer happens to be right. A reward at or above the share is a task whose answers are mostly
    that one, learned. None with fewer than ONE_ANSWER_TASKS replies or no reward."""
    said = [r for r in replies if r]
    if len(said) < ONE_ANSWER_TASKS or reward is None:
        return None
    answer, count = Counter(said).most_common(1)[0]
    share = count / len(replies)
    if share < ONE_ANSWER_SHARE or reward >= share:
        return None
    shown = answer if len(answer) <= 40 else answer[:37] + "..."
    return (f"{count} of {len(replies)} held-out tasks got the same final reply, {shown!r}, and held-out reward "
            f"({reward:.3f}) is below that share: the policy is collapsing onto one answer whatever the question, "
            f"and its reward is mostly how often that answer is right, not the task learned; the task may be beyond "
            f"the model as posed: an easier setting (--curriculum), demonstrations (--warm-start), or a tool that "
            f"computes what it cannot")


def keep_best_line(run: str, best: dict[str, Any], latest: dict[str, Any]) -> str:
    """What --keep-best did at the end of a run whose best held-out step is not its latest."""
    return (f"--keep-best: run {run} now serves step {best['step']} (held-out {best['reward']:.3f}); step "
            f"{latest['step']} scored {latest['reward']:.3f} (training goes on from step {latest['step']}: "
            f"{policy_name(run, latest['step'])} serves it)")
