"""The one door to runs that routes and the job worker use: create, delete, resume, commit, roll back, serve."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from protocol.config import RunSpec
from protocol.names import run_of
from server.engine.base import Engine
from server.model.host import ModelHost
from server.runs import pins
from server.runs.leases import Leases
from server.runs.ownership import Caller, NameTaken, Owners
from server.runs.registry import RunRegistry
from server.runs.run import Run
from server.runs.saved_steps import SavedSteps
from server.runs.served_steps import ServedSteps
from server.sampling.served_names import Policy, ServedModels


class NotServed(LookupError):
    """No model of that name, as the caller sees them (another tenant's run is one that does not exist)."""


class OtherBaseModel(LookupError):
    """A run of another base model, kept on disk but not loadable here; the message says which."""


class Runs:
    """One trainable LoRA per run on the shared base model, its optimizer, its checkpoints, and the
    names it is served under (`run` = latest step, `run@N` = step N).

    A run's step number advances in one place, server/training/commit.py, after the step's checkpoint
    is durable and before it is published (invariant: what is served as `run` is the newest
    checkpoint); this object holds the mechanics commit uses: checkpoints, restore, publish. One
    exception, asked for: a pin (server/runs/pins.py) makes `run` serve an earlier step (the best
    held-out one, `client.train --keep-best`) until the run's next step is published; training goes
    on from the latest.
    """

    def __init__(self, host: ModelHost, engine: Engine, served: ServedModels, data_dir: Path, owners: Owners,
                 adapter_memory: int | None = None, memory_reserve: int = 0):
        lock = threading.RLock()  # one for the runs table and every run's served names
        table: dict[str, Run] = {}
        self.serving = ServedSteps(host, engine, served, lock, table.get)
        self.saved = SavedSteps(host, self.serving)  # a run's checkpoints: listed, deleted, pruned
        self.registry = RunRegistry(host, engine, data_dir, table, lock, self.serving, self.saved,
                                    adapter_memory, memory_reserve)
        self.leases = Leases()  # which client trains each run (server/runs/leases.py)
        self.owners = owners  # who created each run: a tenant sees only its own

    # ---- which runs there are ------------------------------------------------------------------
    def all(self) -> list[Run]:
        return self.registry.all()

    def resume_all(self) -> None:
        self.registry.resume_all()

    def create(self, spec: RunSpec, who: Caller, max_runs: int) -> tuple[Run, bool]:
        """The run `spec` names, made for `who` unless it exists; True when this call made it.
        The name is claimed first, so two keys creating it at once cannot both get it, and given
        back when no run is made. NameTaken: another key's run (to a tenant, an existing run with
        no recorded owner is the admin's); RunLimit: `who` has `max_runs` runs; or the registry's
        reason (OtherModel, RunConflict, bounds.TooLarge, ValueError for LoRA settings this model
        cannot take)."""
        claimed = self.owners.claim(spec.name, who.owner, who.admin, max_runs, spec.project)
        try:
            run, created = self.registry.get_or_create(spec)
        except BaseException:
            if claimed:
                self.owners.release(spec.name)
            raise
        if claimed and not created and not who.admin:
            self.owners.release(spec.name)
            raise NameTaken(spec.name)
        return run, created

    def forget(self, run: Run) -> None:
        """Deleting a run, first half: nothing finds it, its name stays taken until `delete` ends."""
        self.registry.forget(run)
        self.leases.drop(run.name)

    def delete(self, run: Run, cancel_jobs: Callable[[str], None]) -> None:
        """Deleting a run, second half, once `forget` has hidden it: its jobs cancelled
        (`cancel_jobs`: the job worker's, a floor above the runs), its adapters unloaded and its
        files deleted, everything stored of it erased, and its name free again."""
        try:
            cancel_jobs(run.name)
            self.registry.remove(run)
            self.owners.erase(run.name)
        finally:
            self.registry.deleted(run.name)

    def problem_lines(self) -> list[str]:
        return self.registry.problem_lines()

    # ---- what a name serves ----------------------------------------------------------------------
    def find(self, name: str, who: Caller | None = None) -> Run:
        """The run `name`, as `who` sees it (None: the server itself): a route's one door to a run.
        NotServed for a run `who` cannot see (another tenant's is one that does not exist), or
        OtherBaseModel for a run this model cannot load (the message says which)."""
        visible = who is None or self.owners.visible(who, name)
        run = self.registry.get(name) if visible else None
        if run is not None:
            return run
        why = self.registry.other_model(name) if visible else None
        raise OtherBaseModel(why) if why is not None else NotServed(name)

    def acquire(self, model: str, who: Caller | None = None) -> Policy:
        """The policy `model` names (a run: its latest step; `run@N`; the base model), held loaded
        until `release`: the one door a request takes to the runs, with `find`'s rule for the run."""
        if model not in self.serving.served.base_aliases:
            self.find(run_of(model), who)  # run names hold no '@'
        policy = self.serving.acquire(model)  # None: no such step, or the run went in between
        if policy is None:
            raise NotServed(model)
        return policy

    def release(self, policy: Policy) -> None:
        self.serving.served.release(policy)

    def retain(self, run: Run, steps: set[int]) -> list[int]:
        return self.serving.retain(run, steps)

    def pin(self, run: Run, step: int | None) -> None:
        pins.pin(self.serving, run, step)

    # ---- a step's commit and roll-back (server/training/commit.py) ------------------------------
    def land(self, run: Run, step: int, meta: dict[str, Any]) -> tuple[float, float]:
        """A trained step lands: its checkpoint written (from then on it happened), the run at that
        step, its adapter served under the run's names. Returns the seconds the checkpoint and the
        serving took."""
        started = time.perf_counter()
        self.saved.save(run, step, meta)
        saved = time.perf_counter()
        run.step = step
        self.serving.publish(run)
        return saved - started, time.perf_counter() - saved

    def restore(self, run: Run) -> None:
        self.saved.restore(run)
