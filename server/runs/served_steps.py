"""A run's served names: its steps' adapters loaded, published as `run` and `run@N`, retained, resolved."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from protocol.names import policy_name, split_policy
from server.engine.base import Engine
from server.model.host import ModelHost
from server.runs import checkpoints, pins
from server.runs.run import Run, adapter_name, lora_config
from server.sampling.served_names import Policy, ServedModels

SERVED_SNAPSHOTS = 3  # recent steps kept loaded; older ones load from their checkpoint on demand


class ServedSteps:
    def __init__(self, host: ModelHost, engine: Engine, served: ServedModels, lock: threading.RLock,
                 find: Callable[[str], Run | None]):
        self.host, self.engine, self.served = host, engine, served
        self.lock = lock  # the runs' one lock: a run being created, deleted or pinned meanwhile waits
        self._find = find  # a run by name, among those not deleted

    def publish(self, run: Run) -> None:
        """Serve the trained adapter's current weights as `run` and `run@step`, at once. The
        snapshot is a copy: training the next step never changes what a request decodes with."""
        with self.host.lock:
            state = self.host.adapter_state(run.adapter)
        self._serve_step(run, run.step, state, latest=True)
        with self.lock:  # a client's retain() unloads from the same table
            if run.serving_step is not None:  # a newly trained step: the name serves the latest again
                pins.drop(run)  # and once more, under the lock: a pin made since _serve_step is undone whole
                self.served.publish(run.name, run.step, run.snapshots[run.step], latest=True)
            for old in sorted(run.snapshots)[:-SERVED_SNAPSHOTS]:
                if old not in run.retained:
                    self.unload(run, old)

    def retain(self, run: Run, steps: set[int]) -> list[int]:
        """Keep exactly these steps' adapters loaded (and the latest, and any a request is decoding
        on); unload the rest. A step unloaded here is still servable: `resolve` loads it from its
        checkpoint when asked. Returns the steps loaded now."""
        with self.lock:
            run.retained = set(steps)
            for old in sorted(run.snapshots):
                if old not in run.retained:
                    self.unload(run, old)
            return sorted(run.snapshots)

    def resolve(self, model: str) -> Policy | None:
        """The policy a request's `model` names; an older `run@N` is loaded from its checkpoint."""
        policy = self.served.resolve(model)
        name, step = split_policy(model)
        if policy is not None or step is None:
            return policy
        run = self._find(name)
        if run is None or step not in checkpoints.steps(run.checkpoint_dir):
            return None
        with self.lock:
            if (policy := self.served.resolve(model)) is not None:
                return policy
            checkpoints.check(run.checkpoint_dir, step)  # a clear error naming the step, never a half-read adapter
            return self._serve_step(run, step, checkpoints.read_adapter(run.checkpoint_dir, step), latest=False)

    def acquire(self, model: str) -> Policy | None:
        """`resolve`, with the policy held until `served.release`. A loaded step is found and held in
        one step of the served table, without the runs' lock (so a request never waits on a run being
        created); an older `run@N` is loaded under it first."""
        policy = self.served.acquire(model)
        name, step = split_policy(model)
        if policy is not None or step is None:
            return policy
        with self.lock:  # unloads are made under it: what `resolve` loads stays until it is held
            return self.served.acquire(model) if self.resolve(model) is not None else None

    def withdraw(self, run: Run) -> None:
        """No request finds the run under any of its names any more (its adapters stay loaded)."""
        self.served.withdraw(run.name)
        for step in run.snapshots:
            self.served.withdraw(policy_name(run.name, step))

    def unload(self, run: Run, step: int) -> None:
        """Step `step`'s adapter unloaded and its name withdrawn, unless it is the latest, the pinned
        one, or a request is decoding on it (then a later publish unloads it)."""
        adapter = run.snapshots.get(step)
        if adapter is None or step in (run.step, run.serving_step):
            return
        if not self.served.withdraw_idle(policy_name(run.name, step), adapter):
            return
        self.engine.unload_adapter(adapter)
        del run.snapshots[step]

    def _serve_step(self, run: Run, step: int, state: dict[str, torch.Tensor], latest: bool) -> Policy:
        adapter = adapter_name(run.name, f"s{step}")
        self.engine.load_adapter(adapter, lora_config(run.spec, self.host, self.engine), state)
        run.snapshots[step] = adapter
        self.served.publish(run.name, step, adapter, latest)
        return Policy(policy_name(run.name, step), adapter, run.name, step)
