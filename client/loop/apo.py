"""A*-PO's first stage (Brantley et al. 2025, "Accelerating RL for LLM Reasoning with Optimal
Advantage Regression"): the optimal value V*(x) of each prompt, estimated from N samples of the
reference policy (the base model, as art-server serves it under its own name, never the adapter
being trained):

    V*(x) = beta_1 * log( mean_i exp(r(x, y_i) / beta_1) ),   y_i ~ pi_ref(. | x)

The second stage samples one answer per prompt from the policy and regresses
beta_2 * log pi/pi_ref on r - V*(x) (the server's loss "apo", baseline "given").

What went wrong in the seed post-mortem is made visible here rather than trained on: a reference
sample that failed for infrastructure reasons is excluded from V* and counted (never a reward of
0); a prompt whose every reference sample failed has no value, is not kept, and its draw counts as
failed rollouts (an outage is not the prompt's fault); a prompt no
reference sample solved (every reward <= 0: new_ragen's "all V* negative, no positive signal")
is skipped by default (as the paper's code and TRL's A2PO filter all-incorrect prompts) and
counted, and a run whose draws are all such prompts stops with an error that says so.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from client.errors import RunCannotLearn
from protocol.trajectory import TrajectoryGroup


def optimal_value(rewards: list[float], beta: float) -> float:
    """beta * log(mean(exp(r / beta))), computed stably (the max factored out). Between the mean
    reward (beta -> infinity) and the max (beta -> 0)."""
    if not rewards:
        raise ValueError("V* needs at least one reference reward")
    if beta <= 0:
        raise ValueError("beta must be > 0")
    top = max(rewards)
    return top + beta * math.log(sum(math.exp((r - top) / beta) for r in rewards) / len(rewards))


def solved(rewards: list[float]) -> bool:
    """Whether any reference sample scored above 0: with binary rewards, solved at least once."""
    return any(r > 0 for r in rewards)


@dataclass(frozen=True)
class ValueEstimate:
    value: float | None  # None: every reference sample failed (no reward to estimate from)
    rewards: tuple[float, ...]
    failed: int  # reference samples that raised (infrastructure), excluded
    errors: tuple[str, ...] = ()  # what they raised

    @property
    def usable(self) -> bool:
        return self.value is not None


# n -> the reference policy's group of n rollouts of the prompt being estimated
SampleReference = Callable[[int], Awaitable[TrajectoryGroup]]


@dataclass
class ValueTable:
    """V* per prompt, estimated the first time a prompt is drawn and kept (a prompt drawn again
    costs nothing). `figures()` is what the run reports of stage 1."""

    samples: int  # LoopConfig's value_samples, value_beta and skip_unsolved
    beta: float
    skip_unsolved: bool
    estimates: dict[str, ValueEstimate] = field(default_factory=dict)
    skipped_unsolved: int = 0  # draws of a prompt no reference sample solved
    failed_estimates: int = 0  # estimates whose every reference sample failed (not kept)
    _pending: dict[str, asyncio.Future] = field(default_factory=dict)

    async def get(self, key: str, sample: SampleReference) -> ValueEstimate:
        if key in self.estimates:
            return self.estimates[key]
        if key not in self._pending:  # two workers drawing one prompt sample it once
            self._pending[key] = asyncio.ensure_future(self._estimate(key, sample))
        return await asyncio.shield(self._pending[key])

    async def _estimate(self, key: str, sample: SampleReference) -> ValueEstimate:
        group = await sample(self.samples)
        rewards = tuple(t.reward for t in group.trajectories)
        est = ValueEstimate(optimal_value(list(rewards), self.beta) if rewards else None, rewards,
                            len(group.exceptions), tuple(group.exceptions))
        # Without a value the failure was the infrastructure's (an outage, a restart), not the
        # prompt's: it is estimated again the next time it is drawn.
        if est.usable:
            self.estimates[key] = est
        else:
            self.failed_estimates += 1
        self._pending.pop(key, None)
        return est

    def trainable(self, est: ValueEstimate) -> bool:
        """Whether a prompt with this estimate is worth a policy sample; counts the skips."""
        if not est.usable:
            return False
        if self.skip_unsolved and not solved(list(est.rewards)):
            self.skipped_unsolved += 1
            return False
        return True

    def figures(self) -> dict[str, float | int | None]:
        ests = list(self.estimates.values())
        values = [e.value for e in ests if e.value is not None]
        return {"value_prompts": len(ests),
                "value_samples": sum(len(e.rewards) + e.failed for e in ests),
                "value_samples_failed": sum(e.failed for e in ests),
                "value_estimates_failed": self.failed_estimates,
                "value_prompts_unsolved": sum(e.usable and not solved(list(e.rewards)) for e in ests),
                "value_draws_skipped_unsolved": self.skipped_unsolved,
                "value_estimated_mean": sum(values) / len(values) if values else None}


class NothingToRegress(RunCannotLearn):
    """A*-PO drew prompt after prompt that no reference sample solved: nothing can be learnt."""

    def __init__(self, draws: int, samples: int):
        super().__init__(f"A*-PO: none of {draws} prompts drawn in a row had a reference sample (of {samples} from "
                         f"the base model each) scoring above 0, so V* gives nothing to regress towards. The "
                         f"tasks are too hard for the base model: start lower (--curriculum, --start-level), or "
                         f"use more --value-samples.", cause="no_reference_success")
