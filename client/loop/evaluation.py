"""Held-out evaluation: a step's reward on tasks it never trained on, seeded per step, and its record."""

from __future__ import annotations

import time
from typing import Any

from client.loop.decline import stderr_of
from client.model import TrainableModel
from client.loop.report import figure
from client.loop.rollout_source import LocalRollouts, RolloutSource
from protocol.domains import domain_figures
from protocol.names import policy_name
from protocol.trajectory import Trajectory, TrajectoryGroup
from rollouts.env import Example, Task
from rollouts.seeding import derive_seed


def mean_reward(groups: list[TrajectoryGroup]) -> float | None:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards) if rewards else None


def eval_seed(seed: int | None, step: int) -> int | None:
    """An evaluation's sampling seed: the run's, per step, so that each step's is its own; None: unseeded."""
    return None if seed is None else derive_seed(seed, "eval", step)


def final_reply(trajectory: Trajectory) -> str:
    """The text of the trajectory's last assistant turn, its whitespace collapsed: the answer the
    episode ended on ("" when that turn has no text, a tool call's)."""
    last = next((m for m in reversed(trajectory.messages()) if m.get("role") == "assistant"), {})
    content = last.get("content")
    return " ".join(content.split()) if isinstance(content, str) else ""


async def evaluate_on(rollouts: RolloutSource, tasks: list[Task], progress: bool, step: int | None = None,
                      by_domain: dict[str, Any] | None = None, seed: int | None = None,
                      rewards: list[float] | None = None, replies: list[str] | None = None) -> float | None:
    """Held-out reward of step `step` (the latest by default), logged as that step's. `by_domain`,
    if given, receives the reward per domain of tasks that name one; `rewards`, each task's reward
    (a task whose rollout failed has none); `replies`, each task's final reply. `seed`: as
    RolloutSource.run_groups'."""
    model = rollouts.model
    policy = None if step is None else policy_name(model.name, step)
    groups = await rollouts.run_groups(tasks, 1, progress=progress, description="eval", policy=policy, seed=seed)
    await model.log(groups, split="val", step=step)
    if by_domain is not None:
        by_domain.update({d: f["reward_mean"] for d, f in domain_figures(groups).items()})
    if rewards is not None:
        rewards.extend(mean_reward([g]) for g in groups if g.trajectories)
    if replies is not None:
        replies.extend(final_reply(g.trajectories[0]) for g in groups if g.trajectories)
    return mean_reward(groups)


async def evaluate(model: TrainableModel, example: Example, tasks: list[Task], progress: bool,
                   step: int | None = None, by_domain: dict[str, Any] | None = None, seed: int | None = None,
                   rewards: list[float] | None = None) -> float | None:
    """evaluate_on with the rollouts run in this process (the library's call, bench/async.py's)."""
    return await evaluate_on(LocalRollouts(model, example), tasks, progress, step, by_domain, seed, rewards)


def eval_record(step: int, reward: float | None, rewards: list[float], by_domain: dict[str, Any],
                started: float) -> dict[str, Any]:
    """One evaluation as summary.json keeps it."""
    return {"step": step, "reward": reward, "stderr": stderr_of(rewards), "wall_seconds": time.time() - started,
            **({"by_domain": by_domain} if by_domain else {})}


def measure_note(tasks: int, temperature: float) -> str:
    """What the held-out reward is, said once per run: it is not the benches' greedy accuracy."""
    how = "the greedy answer" if temperature == 0 else f"one answer sampled at temperature {figure(temperature)}"
    return f"held-out reward: the mean over {tasks} tasks of {how}, each seeded per step when --seed is given"


def eval_line(step: int, reward: float | None, by_domain: dict[str, Any], warnings: list[str] | None,
              note: str | None = None) -> str:
    domains = ", ".join(f"{d} {figure(r)}" for d, r in by_domain.items())
    said = "-" if reward is None else f"{reward:.3f}"
    return (f"eval @ step {step}: reward {said}" + (f" ({domains})" if domains else "")
            + (f"\n  {note}" if note else "") + "".join(f"\n  warning: {w}" for w in warnings or []))
