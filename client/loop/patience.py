"""When a run cannot learn: count the training attempts in a row that trained nothing, and say why.

A step with nothing to train does not advance the run, so a loop that waits for the step to
reach its target would try again for ever (or, capped, end "successfully" at step 0). After
`limit` such attempts in a row the loop stops with one paragraph naming the cause, read from the
attempts' own figures: constant rewards (with the reward seen), groups of one, failed rollouts
(with the first error), nothing trainable in the rollouts.

One case does not wait for `limit`: a run at step 0 whose held-out evaluation scored exactly 0 and
whose first attempt scored 0 in every rollout. The model has shown no reward anywhere, and every
further attempt is another full batch of the same (the retail example on the embedded model spent
7.5 minutes on three of them, when 41 s had told the story).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from client.errors import RunCannotLearn
from protocol.jobs import TrainResult
from protocol.metrics import COLLAPSE_WARNING_OPENING
from protocol.trajectory import TrajectoryGroup

MAX_REWARD_VALUES = 8  # distinct rewards kept per attempt: enough to tell "all 0.0" from a spread


def attempt_record(groups: list[TrajectoryGroup], result: TrainResult) -> dict[str, Any]:
    """One attempt as the summary keeps it: the server's figures and warnings, and what only the
    client saw (which rewards occurred, the largest group, the first rollout error)."""
    rewards = sorted({round(t.reward, 6) for g in groups for t in g.trajectories})
    return {"step": result.step, "trained": result.trained, **result.metrics.model_dump(),
            "warnings": result.warnings, "reward_values": rewards[:MAX_REWARD_VALUES],
            "largest_group": max((len(g.trajectories) for g in groups), default=0),
            "first_exception": next((e for g in groups for e in g.exceptions), None)}


def set_aside_record(groups: list[TrajectoryGroup], set_aside: list[TrajectoryGroup]) -> dict[str, Any]:
    """Dynamic sampling's part of an attempt's record: the groups kept out of the batch, and the
    reward over every rollout sampled (the batch's own mean leaves out the groups that scored alike)."""
    rewards = [t.reward for g in (*groups, *set_aside) for t in g.trajectories]
    return {"groups_set_aside": len(set_aside),
            "reward_mean_sampled": sum(rewards) / len(rewards) if rewards else None}


def failed_rollouts_record(step: int, error: Exception) -> dict[str, Any]:
    """An attempt whose rollouts failed too often to be trained on (gather's TooManyExceptions)."""
    return {"step": step, "trained": False, "rollouts_failed": str(error), "warnings": [str(error)]}


def cause_of(attempt: dict[str, Any]) -> str:
    if attempt.get("rollouts_failed") or attempt.get("trajectories_total") == 0:
        return "rollouts_failed"
    if attempt.get("largest_group", 2) < 2 and attempt.get("baseline") != "given":  # the server drops such groups as constant: say why first
        return "group_size_1"
    if attempt.get("groups_total") and attempt.get("groups_dropped_constant") == attempt.get("groups_total"):
        return "constant_reward"
    if attempt.get("trainable_tokens") == 0:
        return "no_trainable_choices"
    return "other"


def _reward(value: float) -> str:
    return str(float(value))


def _collapse_warning(attempt: dict[str, Any]) -> str | None:
    return next((w for w in attempt.get("warnings", []) if w.startswith(COLLAPSE_WARNING_OPENING)), None)


def _settled_collapse(attempts: list[dict[str, Any]]) -> str | None:
    """The verdict once attempts after the server's collapse warning, at the same weights, scored
    alike too: the warning left it to them. None while none has (--patience 1 stops at the warning)."""
    for i, attempt in enumerate(attempts):
        if (collapse := _collapse_warning(attempt)) is None:
            continue
        n = sum(cause_of(a) == "constant_reward" for a in attempts[i + 1:])
        if not n:
            return None
        return (f"After the server's warning below, {n} more attempt{'s' * (n != 1)} at the same weights scored "
                f"alike in every group: the last trained step broke the policy. Read a few completions; the "
                f"earlier steps are still served (run@N, and --keep-best with --eval-every serves the best one), "
                f"and a new run with a lower --learning-rate or more --groups-per-step may keep what they "
                f"learned. The server said: {collapse}")
    return None


def _constant_reward(attempts: list[dict[str, Any]], best_elsewhere: float | None) -> str:
    values = sorted({v for a in attempts for v in a.get("reward_values") or []})
    if len(values) == 1:
        v = _reward(values[0])
        if best_elsewhere is not None and best_elsewhere > values[0]:
            # family_relationships on SmolLM2 stopped at step 1 this way; with --dynamic-sampling 8 it trained on
            resample = ("" if any("groups_set_aside" in a for a in attempts)
                        else ", --dynamic-sampling N (other tasks sampled in place of groups that scored alike)")
            text = (f"Every rollout of these attempts scored {v}, so no rollout did better than its siblings, "
                    f"though other rollouts of this run did better (up to {best_elsewhere:.3g}): reward is too "
                    f"rare for batches this small. Use a larger --group-size or --groups-per-step{resample}, or a "
                    f"higher --patience.")
        elif values[0] <= 0:
            text = (f"Every rollout scored {v}, so no rollout did better than its siblings and there is nothing "
                    f"to learn from: the model never earns reward on this task. Try a stronger --model on the "
                    f"server, an easier task, or check the reward.")
        elif values[0] >= 1:
            text = (f"Every rollout scored {v}: the model already solves every task it was given, so there is "
                    f"nothing left to learn. Use harder tasks.")
        else:
            text = (f"Every rollout scored {v}, so the reward never tells a better attempt from a worse one. "
                    f"Check the reward.")
    else:
        text = (f"Within every group all rollouts scored the same (rewards seen: "
                f"{', '.join(_reward(v) for v in values)}), so no rollout did better than its siblings: the "
                f"model does the same thing every time it sees a task. Raise --temperature or --group-size, or "
                f"use tasks it solves only sometimes.")
    collapse = next((w for a in attempts if (w := _collapse_warning(a))), None)
    return text + (f" The server adds: {collapse}" if collapse else "")


def _rollouts_failed(attempts: list[dict[str, Any]]) -> str:
    a = attempts[-1]
    failed = a.get("trajectories_excluded", 0)
    detail = a.get("rollouts_failed") or (f"{failed} of {failed + a.get('trajectories_total', 0)} rollouts failed; "
                                          f"first error: {a.get('first_exception')}")
    return (f"The rollouts failed ({detail}). That is an infrastructure failure (the server, a tool backend or "
            f"the judge), not a reward of 0, so nothing was trained. Fix what the error names and run again.")


def _group_size_1(attempts: list[dict[str, Any]], group_size: int | None) -> str:
    if group_size == 1:
        return ("Every group had a single rollout (--group-size 1): a rollout's advantage is its reward minus "
                "its group's mean reward, so a group of one carries no signal. Use --group-size 2 or more "
                "(8 is usual).")
    first = next((a.get("first_exception") for a in attempts if a.get("first_exception")), None)
    return (f"Every group was left with at most one rollout because the others failed (first error: {first}), "
            f"and a group of one carries no signal. Fix what the error names and run again.")


def _no_trainable_choices(attempts: list[dict[str, Any]]) -> str:
    said = next((w for a in attempts for w in a.get("warnings", []) if "trainable tokens" in w.lower()), None)
    return "The rollouts held no trainable choices, so there was nothing to train." + (
        f" The server says: {said}" if said else "")


def _other(attempts: list[dict[str, Any]]) -> str:
    warnings = list(dict.fromkeys(w for a in attempts for w in a.get("warnings", [])))
    return "The server trained nothing" + (f" and said: {' '.join(warnings)}" if warnings else " and gave no warning.")


def diagnose(attempts: list[dict[str, Any]], group_size: int | None = None,
             best_elsewhere: float | None = None) -> tuple[str, str]:
    """(cause, sentence) for a streak of attempts that trained nothing: the most frequent cause
    among them (the latest on a tie), described from the attempts that had it. `best_elsewhere`:
    the best reward this run earned outside the streak (earlier attempts, evaluations), which
    tells "never earns reward" from "earns it too rarely". A collapse the server warned of, that the
    attempts after its warning confirmed, comes first: its streak is constant rewards too."""
    if settled := _settled_collapse(attempts):
        return "collapse", settled
    causes = [cause_of(a) for a in attempts]
    counts = Counter(causes)
    cause = max(reversed(causes), key=lambda c: counts[c])
    mine = [a for a, c in zip(attempts, causes) if c == cause]
    if cause == "constant_reward":
        return cause, _constant_reward(mine, best_elsewhere)
    if cause == "rollouts_failed":
        return cause, _rollouts_failed(mine)
    if cause == "group_size_1":
        return cause, _group_size_1(mine, group_size)
    if cause == "no_trainable_choices":
        return cause, _no_trainable_choices(mine)
    return cause, _other(mine)


@dataclass
class Patience:
    """Attempts in a row that trained nothing, and the verdict once there are `limit` of them."""

    limit: int
    streak: list[dict[str, Any]] = field(default_factory=list)
    best_reward: float | None = None  # the best single reward of any attempt, streak or not
    attempts: int = 0

    def record(self, attempt: dict[str, Any]) -> None:
        self.attempts += 1
        self.streak = [] if attempt["trained"] else [*self.streak, attempt]
        better = [v for v in attempt.get("reward_values", []) if self.best_reward is None or v > self.best_reward]
        if better:
            self.best_reward = max(better)

    @property
    def exhausted(self) -> bool:
        return len(self.streak) >= self.limit

    def hopeless(self, step: int, step0_evals: list[float | None]) -> bool:
        """Whether to stop now, before `limit`: at step 0, held-out reward exactly 0 (`step0_evals`:
        the run's evaluations of step 0) and this process's first attempt scored 0 in every rollout, none
        of which failed: a failed rollout was never scored, and might have earned what the others did not."""
        if step != 0 or self.attempts != 1 or len(self.streak) != 1 or not step0_evals:
            return False
        first = self.streak[0]
        return (all(r == 0.0 for r in step0_evals) and cause_of(first) == "constant_reward"
                and first.get("reward_values") == [0.0] and not first.get("trajectories_excluded"))

    def verdict(self, step: int, group_size: int | None = None, where: str | None = None,
                eval_rewards: tuple[float | None, ...] = (), early: bool = False) -> RunCannotLearn:
        """`eval_rewards`: the run's held-out mean rewards, another place reward may have shown up.
        `early`: the stop is `hopeless`'s, before `limit` attempts."""
        best = max([r for r in (self.best_reward, *eval_rewards) if r is not None], default=None)
        cause, sentence = diagnose(self.streak, group_size, best)
        n = len(self.streak)
        head = (f"Stopped after the first training attempt, without waiting for --patience {self.limit}: it trained "
                f"nothing and the held-out evaluation scored 0 too, so the run stays at step {step}." if early else
                f"Stopped: {n} training attempt{'s' * (n != 1)} in a row trained nothing, so the run stays at "
                f"step {step}.")
        message = f"{head} {sentence}" + (f" The attempts are in {where}." if where else "")
        return RunCannotLearn(message, cause)
