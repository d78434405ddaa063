"""A pipelined training run: rollout workers keep sampling from the newest served step while a
step trains (DESIGN.md, "Off-policy and asynchronous training").

One loop for every bound S (`max_steps_off_policy`); S = 0 is synchronous training.
- A worker starts a group only when `protocol.staleness.may_start_group` says it would train at
  most S steps stale; otherwise it waits. With S = 0 nothing samples while a step trains, and a
  step samples exactly one batch.
- Each group is sampled from one step, named `run@step`, so a step landing mid-rollout does not
  mix policies inside a group, and its staleness is one number.
- A batch is submitted as soon as `groups_per_step` groups are ready, in the order they finished,
  stating the bound (TrainConfig.max_steps_off_policy): a straggler overtaken by later groups is
  dropped and counted by the server, which reads each choice's sampling record.
- Dynamic sampling (DAPO's): a group `set_aside` picks (its rollouts all scored alike, so it would
  train nothing) is kept out of the batch, and another group is sampled in its place, up to
  `max_set_aside` a batch; past that, groups go in as they come. A synchronous run's batch is then
  put in the order its groups started, so that a seeded run repeats whatever order they finish in.
- Every batch is journalled before it is submitted and forgotten once its result is in. A run
  restarted after an interruption resubmits a journalled batch with the same idempotency key
  (derived from its content), so the server trains it once whether or not it had already.
- After each step, the steps still being sampled from are retained on the server (`retain`), and
  older adapters are unloaded there: they stay servable from their checkpoints, not in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from client.gather import TooManyExceptions, check_exceptions
from protocol.jobs import TrainResult
from protocol.names import policy_name
from protocol.staleness import may_start_group
from protocol.trajectory import TrajectoryGroup

# (policy to sample from, e.g. "run@3"; the group's index in the run) -> the scored group. Rollout
# errors belong in the group's `exceptions`; an exception raised here ends the run.
SampleGroup = Callable[[str, int], Awaitable[TrajectoryGroup]]
# (groups, idempotency key) -> the step's result
TrainBatch = Callable[[list[TrajectoryGroup], str], Awaitable[TrainResult]]
# the steps still sampled from -> keep their adapters loaded, unload the others
Retain = Callable[[set[int]], Awaitable[Any]]
# a finished group -> True to sample another in its place (dynamic sampling)
SetAside = Callable[[TrajectoryGroup], bool]
# (group, step it was sampled from, its index in the run)
Sampled = tuple[TrajectoryGroup, int, int]


@dataclass
class StepOutcome:
    """One training attempt: its groups, the policy step each was sampled from, and the server's
    result, or the error that kept it from being submitted (too many failed rollouts)."""

    groups: list[TrajectoryGroup]
    sampled_steps: list[int | None]
    result: TrainResult | None = None
    error: TooManyExceptions | None = None
    resumed: bool = False  # a journalled batch from an interrupted run
    set_aside: list[TrajectoryGroup] = field(default_factory=list)  # sampled, and replaced by dynamic sampling


def batch_key(run: str, groups: list[TrajectoryGroup]) -> str:
    """An idempotency key that is the batch's content: the same groups resubmitted after a restart
    get the same key and train once; other groups never share it."""
    body = json.dumps([g.model_dump(mode="json") for g in groups], sort_keys=True, allow_nan=True)
    return f"{run[:100]}.{hashlib.sha256(body.encode()).hexdigest()[:40]}"


class Journal:
    """Batches submitted and not yet answered, one file each, written atomically."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def add(self, key: str, groups: list[TrajectoryGroup]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{key}.tmp"
        tmp.write_text(json.dumps({"key": key, "groups": [g.model_dump(mode="json") for g in groups]},
                                  allow_nan=True))
        os.replace(tmp, self.folder / f"{key}.json")

    def done(self, key: str) -> None:
        (self.folder / f"{key}.json").unlink(missing_ok=True)

    def pending(self) -> list[tuple[str, list[TrajectoryGroup]]]:
        if not self.folder.is_dir():
            return []
        files = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
        out = []
        for path in files:
            record = json.loads(path.read_text())
            out.append((record["key"], [TrajectoryGroup.model_validate(g) for g in record["groups"]]))
        return out


@dataclass
class _State:
    served: int  # the newest step the server serves
    training: bool = False
    sampling: int = 0
    ready: list[Sampled] = field(default_factory=list)  # as finished
    started: int = 0  # groups started, for the sampler's index
    in_flight: Counter = field(default_factory=Counter)  # step -> groups sampling from it
    aside: list[Sampled] = field(default_factory=list)  # set aside since the last batch was taken


class Pipeline:
    """`steps(until)` yields each training attempt until the run reaches step `until`; break out of
    it (inside `contextlib.aclosing`) to stop early, and the workers stop with it."""

    def __init__(self, sample_group: SampleGroup, train_batch: TrainBatch, *, run: str, served_step: int,
                 groups_per_step: int, max_steps_off_policy: int, journal: Journal | None = None,
                 max_exceptions: int | float = 0.5, retain: Retain | None = None,
                 set_aside: SetAside | None = None, max_set_aside: int = 0):
        if groups_per_step < 1 or max_steps_off_policy < 0:
            raise ValueError("groups_per_step must be >= 1 and max_steps_off_policy >= 0")
        self.sample_group, self.train_batch, self.run = sample_group, train_batch, run
        self.groups_per_step, self.bound = groups_per_step, max_steps_off_policy
        self.journal, self.max_exceptions, self.retain = journal, max_exceptions, retain
        self.set_aside, self.max_set_aside = set_aside, max_set_aside
        self.state = _State(served=served_step)
        self._changed = asyncio.Condition()
        self._until = served_step

    @property
    def served_step(self) -> int:
        return self.state.served

    def _wanted(self) -> bool:
        """Whether a group started now is needed and would train within the bound."""
        s, g = self.state, self.groups_per_step
        ahead = s.sampling + len(s.ready)
        needed = (self._until - s.served - int(s.training)) * g
        return ahead < needed and may_start_group(s.training, ahead, g, self.bound)

    async def _worker(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._wanted)
                step, index = self.state.served, self.state.started
                self.state.sampling += 1
                self.state.started += 1
                self.state.in_flight[step] += 1
            try:
                group = await self.sample_group(policy_name(self.run, step), index)
            finally:
                async with self._changed:
                    self.state.sampling -= 1
                    self.state.in_flight[step] -= 1
                    self.state.in_flight += Counter()  # drops the steps no group samples from
                    self._changed.notify_all()
            async with self._changed:
                s = self.state
                if self.set_aside is not None and len(s.aside) < self.max_set_aside and self.set_aside(group):
                    s.aside.append((group, step, index))  # one fewer ahead: a worker starts one in its place
                else:
                    s.ready.append((group, step, index))
                self._changed.notify_all()

    async def _take_batch(self) -> tuple[list[Sampled], list[Sampled]]:
        """The next batch, and the groups set aside while it filled."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.state.ready) >= self.groups_per_step)
            batch = self.state.ready[: self.groups_per_step]
            del self.state.ready[: self.groups_per_step]
            set_aside, self.state.aside = self.state.aside, []
            if self.set_aside is not None and self.bound == 0:
                batch, set_aside = self._by_index(batch, set_aside)
            # Taken and marked training at once: no worker may see the batch gone and the trainer idle.
            self.state.training = True
            self._changed.notify_all()
            return batch, set_aside

    def _by_index(self, batch: list[Sampled], set_aside: list[Sampled]) -> tuple[list[Sampled], list[Sampled]]:
        """A synchronous batch whose every group has finished, in index order. Which groups started
        does not depend on the order they finished in (one starts for each set aside), but once the
        cap was reached, which of the groups to set aside went into the batch did: the lowest indices
        are the ones set aside."""
        groups = sorted([*batch, *set_aside], key=lambda e: e[2])
        aside = set(sorted(index for group, _, index in groups if self.set_aside(group))[: len(set_aside)])
        return [e for e in groups if e[2] not in aside], [e for e in groups if e[2] in aside]

    async def _train(self, key: str, groups: list[TrajectoryGroup]) -> TrainResult:
        async with self._changed:
            self.state.training = True
            self._changed.notify_all()
        try:
            result = await self.train_batch(groups, key)
        except BaseException:
            async with self._changed:  # the batch stays journalled: a restart resubmits it
                self.state.training = False
                self._changed.notify_all()
            raise
        if self.journal is not None:
            self.journal.done(key)
        async with self._changed:
            self.state.training = False
            if result.trained:
                self.state.served = result.step
            self._changed.notify_all()
            sampled_from = {self.state.served, *self.state.in_flight}
        if self.retain is not None and self.bound > 0 and result.trained:
            await self.retain(sampled_from)
        return result

    async def steps(self, until_step: int, workers: int | None = None) -> AsyncIterator[StepOutcome]:
        self._until = until_step
        # More workers than the bound lets sample at once would only ever wait.
        n_workers = workers or self.groups_per_step * (self.bound + 1)
        tasks: list[asyncio.Task] = []
        try:
            for key, groups in (self.journal.pending() if self.journal is not None else []):
                result = await self._train(key, groups)
                yield StepOutcome(groups, [None] * len(groups), result, resumed=True)
            tasks = [asyncio.create_task(self._worker(), name=f"rollout-worker-{i}") for i in range(n_workers)]
            while self.state.served < until_step:
                batch, aside = await self._first(self._take_batch(), tasks)
                groups, sampled = [g for g, _, _ in batch], [s for _, s, _ in batch]
                set_aside = [g for g, _, _ in aside]
                try:
                    rollouts = sum(len(g.trajectories) + len(g.exceptions) for g in groups)
                    check_exceptions(groups, rollouts, self.max_exceptions)
                except TooManyExceptions as exc:  # an outage may pass: an attempt, not the end of the run
                    async with self._changed:
                        self.state.training = False
                        self._changed.notify_all()
                    yield StepOutcome(groups, sampled, error=exc, set_aside=set_aside)
                    continue
                key = batch_key(self.run, groups)
                if self.journal is not None:
                    self.journal.add(key, groups)
                result = await self._first(self._train(key, groups), tasks)
                yield StepOutcome(groups, sampled, result, set_aside=set_aside)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _first(awaitable: Awaitable, workers: list[asyncio.Task]):
        """`awaitable`'s result, unless a worker fails first: then its error, not a wait for ever."""
        main = asyncio.ensure_future(awaitable)
        try:
            while True:
                failed = [t for t in workers if t.done() and not t.cancelled() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
                pending = [t for t in workers if not t.done()]
                done, _ = await asyncio.wait([main, *pending], return_when=asyncio.FIRST_COMPLETED)
                if main in done:
                    return main.result()
        finally:
            # Ended before it (Ctrl-C, a failed worker): it ends first, so that the caller's record of
            # the run is final. A train call that answered after the caller had unwound would move
            # the run a step past the summary it had just written.
            if not main.done():
                main.cancel()
                await asyncio.wait([main])
            if not main.cancelled():
                main.exception()  # retrieved: an error it ended with is the caller's error's, not a warning
