"""How far behind the trainer a sampled group is, and the bound that drops it (DESIGN.md,
"Off-policy and asynchronous training").

A group's staleness is the number of steps between the policy that sampled it (the step in its
choices' sampling records; the oldest, if its rollouts spanned steps) and the weights the step
that trains it starts from. Synchronous training is staleness 0: sampled from step n, trained
from step n into step n+1. Pure functions: the server's filter, the client's pipeline and the
tests share them.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.choices import choice_sampling
from protocol.names import names_run
from protocol.trajectory import TrajectoryGroup


def sampled_step(group: TrajectoryGroup, run: str) -> int | None:
    """The oldest policy step of this run that sampled any choice of the group. Step 0 is the
    untrained adapter or the base model, the same policy; a choice of another run says nothing
    about this one. None when no choice carries a sampling record that counts."""
    steps = []
    for t in group.trajectories:
        for h in t.histories():
            for c in h.choices():
                info = choice_sampling(c)
                if info is not None and (info.step == 0 or names_run(info.policy, run)):
                    steps.append(info.step)
    return min(steps) if steps else None


def staleness(trained_from: int, sampled_at: int | None) -> int | None:
    """Steps between the sampler and the weights a step starts from. A sampler newer than those
    weights (a run rolled back to an earlier checkpoint) is 0 behind, not negative."""
    return None if sampled_at is None else max(0, trained_from - sampled_at)


@dataclass(frozen=True)
class StalenessSplit:
    kept: list[int]  # indices of the groups within the bound (or of unknown staleness)
    dropped: list[int]  # indices of the groups past it
    mean: float | None  # over the kept groups whose staleness is known
    max: int | None


def split_by_staleness(stalenesses: list[int | None], bound: int | None) -> StalenessSplit:
    """Keep the groups at most `bound` steps stale (every group when `bound` is None); a group of
    unknown staleness (no sampling record of this run) is kept and left out of the figures."""
    kept = [i for i, s in enumerate(stalenesses) if bound is None or s is None or s <= bound]
    dropped = [i for i, s in enumerate(stalenesses) if i not in set(kept)]
    known = [stalenesses[i] for i in kept if stalenesses[i] is not None]
    return StalenessSplit(kept, dropped, sum(known) / len(known) if known else None, max(known) if known else None)


def expected_staleness(training: bool, groups_ahead: int, groups_per_step: int) -> int:
    """How stale a group started now from the newest served step will be when it trains, if groups
    train in the order they finish: one step for the step training now, one for every full batch
    of groups already sampling or ready ahead of it. (A straggler, overtaken by later groups, ends
    up staler; the server's bound drops it.)"""
    return int(training) + groups_ahead // groups_per_step


def may_start_group(training: bool, groups_ahead: int, groups_per_step: int, bound: int) -> bool:
    """A rollout worker waits rather than start a group that would train more than `bound` steps
    stale. bound 0 is synchronous training: no sampling while a step trains, and one batch of
    groups per step."""
    return expected_staleness(training, groups_ahead, groups_per_step) <= bound
