"""Advantages: reward minus a baseline. Group-relative by default (invariant 5), leave-one-out
(REINFORCE with an unbiased baseline), or a value the client gives per group (A*-PO's V*(x));
and the filter that keeps float noise from becoming signal (invariant 3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.trajectory import rewards_differ


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float] | None  # None: the group carries no signal and is dropped
    mean: float
    std: float
    spread: float
    # Why a dropped group carries no signal: "empty" (every rollout failed), "single" (one
    # rollout, nothing to compare it with) or "constant" (no reward differs by `min_spread`).
    dropped: str | None = None


def _stats(rewards: list[float]) -> tuple[float, float, float]:
    """Mean, population std and spread (max - min) of a non-empty group's rewards."""
    mean = sum(rewards) / len(rewards)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)), max(rewards) - min(rewards)


def group_advantages(rewards: list[float], scale: bool = False, min_spread: float = 1e-6) -> GroupAdvantages:
    """Reward minus the group mean; divided by the group std only when `scale` is asked for.

    A group whose rewards differ by less than `min_spread` is dropped rather than trained on:
    normalising [0.1, 0.1 + 1e-11] by its std would turn rounding error into a full-size update.
    """
    if not rewards:
        return GroupAdvantages(None, 0.0, 0.0, 0.0, dropped="empty")
    mean, std, spread = _stats(rewards)
    if len(rewards) < 2:
        return GroupAdvantages(None, mean, std, spread, dropped="single")
    if not rewards_differ(rewards, min_spread):
        return GroupAdvantages(None, mean, std, spread, dropped="constant")
    adv = [r - mean for r in rewards]
    if scale:
        adv = [a / (std + 1e-6) for a in adv]
    return GroupAdvantages(adv, mean, std, spread)


def leave_one_out_advantages(rewards: list[float], min_spread: float = 1e-6) -> GroupAdvantages:
    """RLOO: each reward minus the mean of the others' (n/(n-1) times reward minus the group mean),
    REINFORCE's baseline that does not depend on the sample it baselines."""
    g = group_advantages(rewards, False, min_spread)
    if g.advantages is None:
        return g
    n = len(rewards)
    return GroupAdvantages([a * n / (n - 1) for a in g.advantages], g.mean, g.std, g.spread)


def given_value_advantages(rewards: list[float], value: float, keep_zero: bool, min_spread: float = 1e-6
                           ) -> GroupAdvantages:
    """Each reward minus the value the client estimated for the group's prompt (A*-PO's V*(x)).

    One rollout is enough: the baseline does not come from the group. Only a group with no rollout
    is dropped, and, unless `keep_zero` (A*-PO's loss still pulls log pi/pi_ref towards 0 there),
    one where every reward equals the value to within `min_spread` (no policy gradient at all)."""
    if not rewards:
        return GroupAdvantages(None, 0.0, 0.0, 0.0, dropped="empty")
    mean, std, spread = _stats(rewards)
    adv = [r - value for r in rewards]
    if not keep_zero and max(abs(a) for a in adv) < min_spread:
        return GroupAdvantages(None, mean, std, spread, dropped="constant")
    return GroupAdvantages(adv, mean, std, spread)


def awr_weights(advantages: list[float]) -> list[float]:
    """Advantage-weighted SFT weights as TinyZero uses them: normalised advantages shifted to be
    positive and clamped, so every sample is imitated, better ones more (never 'unlearned')."""
    n = len(advantages)
    mean = sum(advantages) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / n) or 1.0
    return [min(max(max(min((a - mean) / std, 3.0), -3.0) + 1.0, 0.1), 5.0) for a in advantages]


def reverse_kl_advantages(student: list[float], teacher: list[float], coef: float) -> list[float]:
    """On-policy distillation's per-token advantages: coef * (log p_teacher - log p_student) of
    each sampled token, so that the policy gradient lowers the reverse KL KL(student || teacher),
    whose single-sample estimate at a token the student sampled is log p_student - log p_teacher."""
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student logprobs against {len(teacher)} of the teacher")
    return [coef * (t - s) for s, t in zip(student, teacher)]
