"""Which runs this server has: created, resumed at start, refused (another model's, unreadable), deleted."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import torch

from protocol.config import RunSpec
from server.engine.base import Engine
from server.model.host import ModelHost
from server.model.memory import available_memory
from server.log_limits import one_line
from server.runs import base_models, checkpoints, pins
from server.runs.base_models import NameCaseConflict, OtherModel, RunConflict, RunRecord
from server.runs.run import Run, adapter_name, lora_config, new_optimizer
from server.runs.saved_steps import SavedSteps
from server.runs.served_steps import ServedSteps
from server.training import bounds


log = logging.getLogger("artisan.runs")


class RunRegistry:
    def __init__(self, host: ModelHost, engine: Engine, data_dir: Path, table: dict[str, Run],
                 lock: threading.RLock, serving: ServedSteps, saved: SavedSteps, adapter_memory: int | None = None,
                 memory_reserve: int = 0):
        self.host, self.engine = host, engine
        self.serving, self.saved = serving, saved
        self.adapter_memory, self.memory_reserve = adapter_memory, memory_reserve
        self.root = Path(data_dir) / "runs"
        self.root.mkdir(parents=True, exist_ok=True)
        self.trash = Path(data_dir) / "deleted-runs"  # deleted runs' folders on their way out
        shutil.rmtree(self.trash, ignore_errors=True)
        self._deleting: set[str] = set()
        self._runs = table  # shared with `serving`, which finds a `run@N` it has to load in it
        self._lock = lock
        self.problems: dict[str, str] = {}  # run -> why it could not be resumed, for /health
        self.other_models: dict[str, OtherModel] = {}  # runs of another base model, never loaded here

    def get(self, name: str) -> Run | None:
        return self._runs.get(name)

    def all(self) -> list[Run]:
        return list(self._runs.values())

    def resume_all(self) -> None:
        """Bring every run back at its last complete checkpoint (after a restart or a crash); a run
        of another base model stays on disk, untouched, and is listed as not served."""
        for meta in sorted(self.root.glob("*/run.json")):
            name = meta.parent.name
            record = base_models.read_record(meta.parent)
            if record is None:
                self.problems[name] = (f"run {name}: its run.json cannot be read; register the run again with the "
                                       f"LoRA settings it was trained with to serve it")
                log.error("%s", self.problems[name])
                continue
            try:
                self._open(record, create=False)
            except OtherModel as exc:
                self.other_models[name] = exc
                log.warning(exc.line)  # the whole line as the message: one each, never collapsed
            except Exception as exc:  # one run's damaged files never stop the server or the other runs
                self.problems[name] = f"run {name} could not be resumed: {one_line(exc)}"
                log.error("%s", self.problems[name], exc_info=log.isEnabledFor(logging.DEBUG))

    def other_model(self, name: str) -> str | None:
        """Why run `name` is not served here when it is another base model's (a 409's message)."""
        other = self.other_models.get(name)
        return None if other is None else str(other)

    def problem_lines(self) -> list[str]:
        """What /health reports about runs: one line each, another model's runs last (nothing is lost there)."""
        return [*self.problems.values(), *(f"run {r.name}: {d}" for r in self.all() for d in r.damaged),
                *(self.other_models[n].line for n in sorted(self.other_models))]

    def get_or_create(self, spec: RunSpec) -> tuple[Run, bool]:
        with self._lock:
            if spec.name in self._deleting:
                raise RunConflict(f"run {spec.name!r} is being deleted; create it again once that is done")
            if (twin := self._case_twin(spec.name)) is not None:
                raise NameCaseConflict(spec.name, twin)
            if (other := self.other_models.get(spec.name)) is not None:
                raise other.again()
            existing = self._runs.get(spec.name)
            if existing is not None:
                if existing.spec.lora != spec.lora:
                    raise RunConflict(f"run {spec.name!r} exists with different LoRA settings "
                                      f"({existing.spec.lora.model_dump()}, not {spec.lora.model_dump()})")
                return existing, False
            self.check_memory(spec)
            try:
                run = self._open(RunRecord(**spec.model_dump()), create=True)
            except OtherModel as exc:  # files without a readable run.json, of another model
                self.problems.pop(spec.name, None)
                self.other_models[spec.name] = exc
                raise
            self.problems.pop(spec.name, None)  # an unreadable run.json, written again
            return run, True

    def _case_twin(self, name: str) -> str | None:
        """A run, here or on disk, whose name differs from `name` only by case, when `name` is new
        (twins from before this rule stay registrable under their own names)."""
        names = {*self._runs, *self._deleting, *(p.name for p in self.root.iterdir() if p.is_dir())}
        if name in names:
            return None
        return next((n for n in sorted(names) if n.casefold() == name.casefold()), None)

    def run_bytes(self, spec: RunSpec) -> int:
        """What a run's adapter costs at steady state (server/training/bounds.py: BYTES_PER_LORA_PARAM)."""
        targets = spec.lora.target_modules or self.host.lora_targets
        return bounds.run_bytes(spec.lora.rank, [(i, o) for leaf, i, o in self.host.linear_shapes if leaf in targets])

    def check_memory(self, spec: RunSpec) -> None:
        """Refuse a run whose adapter would not fit: past --adapter-memory-mb with the runs there
        are, or into the memory kept free on the device (--memory-reserve-mb)."""
        need = self.run_bytes(spec)
        if self.adapter_memory is not None:
            used = sum(self.run_bytes(r.spec) for r in self._runs.values())
            bounds.check_budget(spec.lora.rank, need, used, self.adapter_memory)
        bounds.check_run_memory(spec.lora.rank, need, available_memory(self.host.device), self.memory_reserve)

    def forget(self, run: Run) -> None:
        """The first half of deleting a run: no request or submission finds it any more, and its
        name cannot be taken again until `deleted` says so."""
        with self._lock:
            if self._runs.get(run.name) is run:
                del self._runs[run.name]
            self._deleting.add(run.name)
            self.serving.withdraw(run)

    def remove(self, run: Run, grace: float = 60.0) -> None:
        """The second half, once no job of the run is running: its adapters unloaded (a request
        already decoding on one finishes first, for up to `grace` seconds) and its files deleted.
        The folder is moved out of runs/ first, so a crash midway never resumes half a run."""
        deadline = time.monotonic() + grace
        with self._lock:  # again: a job that was committing when it was cancelled published its step
            self.serving.withdraw(run)
        served = self.serving.served
        for adapter in list(run.snapshots.values()):
            while served.in_use(adapter) and time.monotonic() < deadline:
                time.sleep(0.05)
            if served.in_use(adapter):
                log.error("run %s: adapter %s still decodes after %.0fs; it stays loaded", run.name, adapter, grace)
                continue
            self.engine.unload_adapter(adapter)
        run.snapshots.clear()
        with self.host.lock:
            self.host.delete_adapter(run.adapter)
        run.optimizer.state.clear()
        if run.dir.exists():
            self.trash.mkdir(parents=True, exist_ok=True)
            aside = self.trash / f"{run.name}-{time.time_ns()}"
            run.dir.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        log.info("run %s deleted", run.name)

    def deleted(self, name: str) -> None:
        """The name is free again (once the store has forgotten the run too)."""
        with self._lock:
            self._deleting.discard(name)

    def _intact_steps(self, name: str, root: Path) -> tuple[list[int], list[str]]:
        """The run's steps once damaged newest ones are set aside (the newest intact step is the
        run's state), and what was wrong with each of those."""
        done, found = checkpoints.steps(root), []
        while done and (why := checkpoints.damage(root, done[-1])) is not None:
            step = done.pop()
            aside = checkpoints.set_aside(root, step, why)
            found.append(f"step {step}'s checkpoint is damaged ({why}); it was moved to {aside.name} and the run "
                         f"resumes from step {done[-1] if done else 'none'}; step numbers go on after {step}")
            log.error("run %s: %s", name, found[-1])
        return done, found

    def _open(self, spec: RunRecord, create: bool) -> Run:
        """Resume a run from its files (`spec`: its run.json), or create one (`spec`: what the client
        asked for; files already there are a run whose run.json was lost, and must agree with it).
        Whose run it is, and whether its checkpoints fit, is told before any adapter is added."""
        run_dir = self.root / spec.name
        on_disk = base_models.read_record(run_dir) if create else spec
        if on_disk is not None and on_disk.base_fingerprint not in (None, self.host.base_fingerprint):
            raise OtherModel(spec.name, on_disk.base_model or "another base model", self.host.name)
        checkpoints.clean_partial(run_dir / "checkpoints")
        done, damaged = self._intact_steps(spec.name, run_dir / "checkpoints")
        if not done and damaged:
            raise checkpoints.CheckpointDamaged(f"run {spec.name}: no intact checkpoint is left: {damaged[-1]}")
        lora = lora_config(spec, self.host, self.engine)
        if done:  # from the checkpoint's header, before an adapter is added that it could not be loaded into
            base_models.check_fit(spec, checkpoints.step_dir(run_dir / "checkpoints", done[-1]) / "adapter.safetensors",
                                  self.host, on_disk.base_model if on_disk else None)
        adapter = adapter_name(spec.name, "train")
        with self.host.lock:
            torch.manual_seed(spec.lora.seed)  # the same spec always starts from the same LoRA
            self.host.add_adapter(adapter, lora)
            params = self.host.adapter_params(adapter)
            for p in params:
                p.requires_grad_(True)
        optimizer = new_optimizer(params)
        run = Run(spec, run_dir, 0, adapter, optimizer, params, self.host,
                  highest_used=checkpoints.highest_used(run_dir / "checkpoints"), damaged=damaged)
        if done:
            run.step = done[-1]
            try:
                self.saved.load(run, run.step, check=False)  # _intact_steps has just checked it
            except Exception:
                with self.host.lock:  # so that a later open of this run can add it again
                    self.host.delete_adapter(adapter)
                raise
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.saved.save(run, 0, {"kind": "init"})
        self._record_base(spec, on_disk, create)
        self._runs[spec.name] = run
        self.serving.publish(run)
        pins.restore(self.serving, run)
        log.info("run %s at step %d", spec.name, run.step)
        return run

    def _record_base(self, spec: RunRecord, on_disk: RunRecord | None, create: bool) -> None:
        """run.json says which base model the run belongs to (a run from before it did, found to
        fit, is recorded as this model's from now on)."""
        host, recorded = self.host, on_disk if on_disk and on_disk.base_fingerprint else None
        base = recorded.base_model if recorded else host.name
        if recorded is not None and base not in host.aliases:  # the same shapes under another name
            log.info("run %s was trained on %s, which has %s's shapes: served by it", spec.name, base, host.name)
        if create or recorded is None:  # a registration's settings are what the checkpoints were found to fit
            base_models.write_record(self.root / spec.name, spec.model_copy(
                update={"base_model": base, "base_fingerprint": host.base_fingerprint}))
