"""Runs: one trainable LoRA per run on the shared base model, its optimizer, its checkpoints, and
the names it is served under (`run` = latest step, `run@N` = step N).

A run's step number advances in one place, server/training/commit.py, after the step's checkpoint
is durable and before it is published (invariant: what is served as `run` is the newest checkpoint).
The manager owns the mechanics that commit uses: checkpoints, restore, publish. One exception, asked
for: a pin (server/training/pins.py) makes `run` serve an earlier step (the best held-out one,
`client.train --keep-best`) until the run's next step is published; training goes on from the latest.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from protocol.config import RunSpec
from protocol.metrics import StepMetrics
from server.engine.base import Engine
from server.model_host import ModelHost, available_memory
from server.serving import Policy, ServedModels
from server.training import base_models, bounds, checkpoints, pins
from server.training.base_models import OtherModel, RunConflict, RunRecord
from server.training.hyperparams import default_learning_rate
from server.training.leases import Leases

if TYPE_CHECKING:
    from server.store import Store

log = logging.getLogger("artisan.runs")
SERVED_SNAPSHOTS = 3  # recent steps kept loaded; older ones load from their checkpoint on demand


@dataclass
class Run:
    spec: RunSpec
    dir: Path
    step: int
    adapter: str  # the adapter the trainer updates
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    host: ModelHost
    snapshots: dict[int, str] = field(default_factory=dict)  # step -> served adapter name
    # Steps a client still samples from (a pipelined run's rollouts in flight): kept loaded past
    # SERVED_SNAPSHOTS until the client retains other steps (RunManager.retain).
    retained: set[int] = field(default_factory=set)
    highest_used: int = 0  # numbers up to here are taken, by damaged steps set aside too
    damaged: list[str] = field(default_factory=list)  # what was found damaged at start, for the run's status
    serving_step: int | None = None  # an earlier step the bare name serves (training/pins.py); None: the latest

    @property
    def next_step(self) -> int:
        """The number the run's next trained step gets: never one a damaged step had."""
        return max(self.step, self.highest_used) + 1

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "project": self.spec.project, "step": self.step,
                "lora": self.spec.lora.model_dump(), "checkpoints": checkpoints.steps(self.checkpoint_dir),
                "damaged": self.damaged,
                # what the bare name decodes with: the latest step, or the one pinned (PUT .../serving)
                "serving_step": self.step if self.serving_step is None else self.serving_step,
                "serving_pinned": self.serving_step is not None,
                # what a job that names no learning rate trains at (derived from the base model)
                "default_learning_rate": default_learning_rate(self.host.config)}

    def last_metrics(self, kind: str) -> StepMetrics | None:
        """The figures of the run's latest step, when it was a step of this kind."""
        meta = checkpoints.read_meta(self.checkpoint_dir, self.step)
        return StepMetrics.model_validate(meta.get("metrics", {})) if meta.get("kind") == kind else None


def new_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A run's optimizer; data-parallel training processes build the same one over their copy."""
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)


def adapter_name(run: str, suffix: str) -> str:
    # peft adapter names are module attribute names: the run name is kept distinct by a hex tail,
    # so `x-y`, `x_y` and `x.y` never collide.
    safe = "".join(c if c.isalnum() else "_" for c in run)
    return f"{safe}_{run.encode().hex()[-12:]}__{suffix}"


class RunManager:
    def __init__(self, host: ModelHost, engine: Engine, served: ServedModels, data_dir: Path,
                 adapter_memory: int | None = None, memory_reserve: int = 0, store: Store | None = None):
        self.host, self.engine, self.served, self.store = host, engine, served, store
        self.adapter_memory, self.memory_reserve = adapter_memory, memory_reserve
        self.root = Path(data_dir) / "runs"
        self.root.mkdir(parents=True, exist_ok=True)
        self.trash = Path(data_dir) / "deleted-runs"  # deleted runs' folders on their way out
        shutil.rmtree(self.trash, ignore_errors=True)
        self._deleting: set[str] = set()
        self._runs: dict[str, Run] = {}
        self._lock = threading.RLock()
        self.problems: dict[str, str] = {}  # run -> why it could not be resumed, for /health
        self.other_models: dict[str, OtherModel] = {}  # runs of another base model, never loaded here
        self.leases = Leases()  # which client trains each run (server/training/leases.py)

    def get(self, name: str) -> Run | None:
        return self._runs.get(name)

    def all(self) -> list[Run]:
        return list(self._runs.values())

    # ---- lifecycle -----------------------------------------------------------------------------
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
                self.problems[name] = f"run {name} could not be resumed: {base_models.one_line(exc)}"
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
            self._withdraw(run)
        self.leases.drop(run.name)

    def _withdraw(self, run: Run) -> None:
        self.served.withdraw(run.name)
        for step in run.snapshots:
            self.served.withdraw(f"{run.name}@{step}")

    def remove(self, run: Run, grace: float = 60.0) -> None:
        """The second half, once no job of the run is running: its adapters unloaded (a request
        already decoding on one finishes first, for up to `grace` seconds) and its files deleted.
        The folder is moved out of runs/ first, so a crash midway never resumes half a run."""
        deadline = time.monotonic() + grace
        with self._lock:  # again: a job that was committing when it was cancelled published its step
            self._withdraw(run)
        for adapter in list(run.snapshots.values()):
            while self.served.in_use(adapter) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.served.in_use(adapter):
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

    def lora_config(self, spec: RunSpec) -> Any:
        from peft import LoraConfig

        targets = spec.lora.target_modules or self.host.lora_targets
        unknown = sorted(set(targets) - set(self.host.lora_targets))
        if unknown:
            raise ValueError(f"lora.target_modules: {', '.join(unknown)} are not linear layers of this model "
                             f"(it has {', '.join(self.host.lora_targets)})")
        limit = self.engine.max_lora_rank
        if limit is not None and spec.lora.rank > limit:
            raise ValueError(f"lora.rank: {spec.lora.rank} is more than this server's engine serves ({limit}; "
                             f"art-server --vllm-max-lora-rank)")
        return LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules=targets,
                          lora_dropout=0.0, bias="none")

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
        lora = self.lora_config(spec)
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
                self._load(run, run.step)  # _intact_steps has just checked it
            except Exception:
                with self.host.lock:  # so that a later open of this run can add it again
                    self.host.delete_adapter(adapter)
                raise
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.save_checkpoint(run, 0, {"kind": "init"})
        self._record_base(spec, on_disk, create)
        self._runs[spec.name] = run
        self.publish(run)
        pins.restore(self, run)
        log.info("run %s at step %d", spec.name, run.step)
        return run

    def _record_base(self, spec: RunRecord, on_disk: RunRecord | None, create: bool) -> None:
        """run.json and the store say which base model the run belongs to (a run from before they
        did, found to fit, is recorded as this model's from now on)."""
        host, recorded = self.host, on_disk if on_disk and on_disk.base_fingerprint else None
        base = recorded.base_model if recorded else host.name
        if recorded is not None and base not in host.aliases:  # the same shapes under another name
            log.info("run %s was trained on %s, which has %s's shapes: served by it", spec.name, base, host.name)
        if create or recorded is None:  # a registration's settings are what the checkpoints were found to fit
            base_models.write_record(self.root / spec.name, spec.model_copy(
                update={"base_model": base, "base_fingerprint": host.base_fingerprint}))
        if self.store is not None:
            self.store.record_run_base(spec.name, base, host.base_fingerprint)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, run: Run, step: int, meta: dict[str, Any]) -> None:
        """The trained adapter and its optimizer state, atomically, as checkpoint `step`."""
        with self.host.lock:
            state = self.host.adapter_state(run.adapter)
        checkpoints.write(run.checkpoint_dir, step, state, run.optimizer.state_dict(), meta)

    def load_checkpoint(self, run: Run, step: int) -> None:
        checkpoints.check(run.checkpoint_dir, step)
        self._load(run, step)

    def _load(self, run: Run, step: int) -> None:
        state = checkpoints.read_adapter(run.checkpoint_dir, step)
        with self.host.lock:
            self.host.load_adapter_state(run.adapter, state)
        run.optimizer.load_state_dict(checkpoints.read_optimizer(run.checkpoint_dir, step))

    def restore(self, run: Run) -> None:
        """Back to the latest checkpoint's weights and optimizer state (a step that failed midway)."""
        self.load_checkpoint(run, run.step)

    def list_checkpoints(self, run: Run) -> list[dict[str, Any]]:
        out = []
        for step in checkpoints.steps(run.checkpoint_dir):
            try:
                meta = checkpoints.read_meta(run.checkpoint_dir, step)
            except checkpoints.CheckpointDamaged as exc:
                out.append({"step": step, "metrics": {}, "created": None, "damaged": str(exc)})
                continue
            out.append({"step": step, "metrics": meta.get("metrics", {}), "created": meta.get("created")})
        return out

    def delete_checkpoint(self, run: Run, step: int) -> None:
        if step == run.step:
            raise ValueError("the latest checkpoint is the run's state and cannot be deleted")
        if step == run.serving_step:
            raise ValueError(f"step {step} is what run {run.name} serves (pinned: PUT /v1/runs/{run.name}/serving "
                             f"{{\"step\": null}} serves the latest again); it cannot be deleted while it is")
        if step not in checkpoints.steps(run.checkpoint_dir):
            raise KeyError(step)
        self._unload(run, step)
        checkpoints.delete(run.checkpoint_dir, step)

    def prune(self, run: Run, best_metric: str | None = None, mode: str = "max", keep_last: int = 1) -> list[int]:
        """Delete old checkpoints, keeping the latest `keep_last` and the best by `best_metric`."""
        infos = self.list_checkpoints(run)
        keep = {i["step"] for i in infos[-keep_last:]} | {run.step} | \
            ({run.serving_step} if run.serving_step is not None else set())
        scored = [i for i in infos if isinstance(v := i["metrics"].get(best_metric or ""), (int, float))
                  and math.isfinite(v)]
        if best_metric and scored:
            pick = max if mode == "max" else min
            keep.add(pick(scored, key=lambda i: i["metrics"][best_metric])["step"])
        deleted = []
        for i in infos:
            if i["step"] not in keep:
                self.delete_checkpoint(run, i["step"])
                deleted.append(i["step"])
        return deleted

    # ---- serving -------------------------------------------------------------------------------
    def publish(self, run: Run) -> None:
        """Serve the trained adapter's current weights as `run` and `run@step`, at once. The
        snapshot is a copy: training the next step never changes what a request decodes with."""
        with self.host.lock:
            state = self.host.adapter_state(run.adapter)
        self._serve_step(run, run.step, state, latest=True)
        with self._lock:  # a client's retain() unloads from the same table
            if run.serving_step is not None:  # a newly trained step: the name serves the latest again
                pins.drop(run)  # and once more, under the lock: a pin made since _serve_step is undone whole
                self.served.publish(run.name, run.step, run.snapshots[run.step], latest=True)
            for old in sorted(run.snapshots)[:-SERVED_SNAPSHOTS]:
                if old not in run.retained:
                    self._unload(run, old)

    def retain(self, run: Run, steps: set[int]) -> list[int]:
        """Keep exactly these steps' adapters loaded (and the latest, and any a request is decoding
        on); unload the rest. A step unloaded here is still servable: `resolve` loads it from its
        checkpoint when asked. Returns the steps loaded now."""
        with self._lock:
            run.retained = set(steps)
            for old in sorted(run.snapshots):
                if old not in run.retained:
                    self._unload(run, old)
            return sorted(run.snapshots)

    def _serve_step(self, run: Run, step: int, state: dict[str, torch.Tensor], latest: bool) -> Policy:
        adapter = adapter_name(run.name, f"s{step}")
        self.engine.load_adapter(adapter, self.lora_config(run.spec), state)
        run.snapshots[step] = adapter
        self.served.publish(run.name, step, adapter, latest)
        return Policy(f"{run.name}@{step}", adapter, run.name, step)

    def _unload(self, run: Run, step: int) -> None:
        adapter = run.snapshots.get(step)
        if adapter is None or step in (run.step, run.serving_step) or self.served.in_use(adapter):
            return  # the latest step, or a request still decoding on it: unloaded at a later publish
        self.served.withdraw(f"{run.name}@{step}")
        self.engine.unload_adapter(adapter)
        del run.snapshots[step]

    def resolve(self, model: str) -> Policy | None:
        """The policy a request's `model` names; an older `run@N` is loaded from its checkpoint."""
        policy = self.served.resolve(model)
        if policy is not None or "@" not in model:
            return policy
        name, _, step_text = model.rpartition("@")
        run = self._runs.get(name)
        if run is None or not step_text.isdigit() or int(step_text) not in checkpoints.steps(run.checkpoint_dir):
            return None
        step = int(step_text)
        with self._lock:
            if (policy := self.served.resolve(model)) is not None:
                return policy
            checkpoints.check(run.checkpoint_dir, step)  # a clear error naming the step, never a half-read adapter
            return self._serve_step(run, step, checkpoints.read_adapter(run.checkpoint_dir, step), latest=False)
