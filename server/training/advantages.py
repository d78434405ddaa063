"""Group-relative advantages (invariant 5) and the filter that keeps float noise from
becoming signal (invariant 3)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float] | None  # None: the group carries no signal and is dropped
    mean: float
    std: float
    spread: float
    # Why a dropped group carries no signal: "empty" (every rollout failed), "single" (one
    # rollout, nothing to compare it with) or "constant" (no reward differs by `min_spread`).
    dropped: str | None = None


def group_advantages(rewards: list[float], scale: bool = False, min_spread: float = 1e-6) -> GroupAdvantages:
    """Reward minus the group mean; divided by the group std only when `scale` is asked for.

    A group whose rewards differ by less than `min_spread` is dropped rather than trained on:
    normalising [0.1, 0.1 + 1e-11] by its std would turn rounding error into a full-size update.
    """
    if not rewards:
        return GroupAdvantages(None, 0.0, 0.0, 0.0, dropped="empty")
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    spread = max(rewards) - min(rewards)
    if len(rewards) < 2:
        return GroupAdvantages(None, mean, std, spread, dropped="single")
    if spread < min_spread:
        return GroupAdvantages(None, mean, std, spread, dropped="constant")
    adv = [r - mean for r in rewards]
    if scale:
        adv = [a / (std + 1e-6) for a in adv]
    return GroupAdvantages(adv, mean, std, spread)


def awr_weights(advantages: list[float]) -> list[float]:
    """Advantage-weighted SFT weights as TinyZero uses them: normalised advantages shifted to be
    positive and clamped, so every sample is imitated, better ones more (never 'unlearned')."""
    n = len(advantages)
    mean = sum(advantages) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / n) or 1.0
    return [min(max(max(min((a - mean) / std, 3.0), -3.0) + 1.0, 0.1), 5.0) for a in advantages]
