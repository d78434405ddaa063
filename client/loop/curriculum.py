"""A curriculum, as TinyZero ran one: the task source draws at a difficulty level, and every
`every` steps the held-out success of the current level is measured; when it reaches
`threshold` the level goes up (never down, never past the example's top level).

The level is the Example's (rollouts/env.py: `Example.level`, `Example.levels()`): an example
that has levels makes its train and held-out tasks at its current level. `client.train
--curriculum THRESHOLD` drives it and reports, every step, the level its rollouts were drawn at
and the success last measured at that level.
"""

from __future__ import annotations

from dataclasses import dataclass


def success_rate(rewards: list[float], success_at: float = 1.0) -> float | None:
    """The fraction of rewards at or above `success_at` (solved tasks, for a 0/1 reward)."""
    return sum(r >= success_at for r in rewards) / len(rewards) if rewards else None


def next_level(level: int, success: float | None, threshold: float, levels: int) -> int:
    """One level up when the current level's success reached the threshold and a harder one exists."""
    if success is not None and success >= threshold and level + 1 < levels:
        return level + 1
    return level


@dataclass(frozen=True)
class Curriculum:
    threshold: float = 0.8
    every: int = 25  # TinyZero's interval
    eval_tasks: int = 32  # held-out tasks of the current level per check
    success_at: float = 1.0  # a reward that counts as solved

    def __post_init__(self):
        if not 0 < self.threshold <= 1:
            raise ValueError(f"curriculum threshold {self.threshold}: a success rate in (0, 1]")
        if self.every < 1 or self.eval_tasks < 1:
            raise ValueError("curriculum every and eval_tasks must be >= 1")

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0
