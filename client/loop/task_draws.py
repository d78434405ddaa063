"""Which training task a run samples its next group of: seeded passes over the task list.

A pass visits every task once in an order drawn from the run's seed, and the next pass draws a new
order. Draws with replacement repeat questions early (72 distinct in the first 80 of 1,024 for the
tool agent's seed 2) and can put one question into consecutive steps, where rollouts that scored
by luck are rewarded twice (README, the tool agent). TRL, verifiers and tinker also iterate over a
shuffled dataset.
"""

from __future__ import annotations

import random

from rollouts.env import Task


class TaskDraws:
    """The tasks of a run of seed `seed`, one at a time: `next()` repeats for the same seed and tasks."""

    def __init__(self, tasks: list[Task], seed: int):
        self.rng = random.Random(seed)
        self.replace(tasks)

    def replace(self, tasks: list[Task]) -> None:
        """Another task list (a curriculum's new level): a new pass over it begins at the next draw."""
        self.tasks, self.left = tasks, []
        self.drawn = 0  # since this list began: what a resumed run skips to go on where it stopped

    def skip(self, n: int) -> None:
        """Go on after `n` draws from this list, as a run resumed after drawing them must: starting
        over would repeat the first pass's questions while the rest wait."""
        for _ in range(n):
            self.next()

    def next(self) -> Task:
        if not self.tasks:  # a run that only evaluates or warm-starts never draws, so only a draw refuses
            raise ValueError("the example has no training tasks to draw from")
        if not self.left:
            self.left = self.rng.sample(range(len(self.tasks)), len(self.tasks))[::-1]
        self.drawn += 1
        return self.tasks[self.left.pop()]
