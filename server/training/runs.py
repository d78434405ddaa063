"""Runs: one trainable LoRA per run on the shared base model, its optimizer, its checkpoints,
and the names it is served under (`run` = latest step, `run@N` = step N)."""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, field_validator

from server.model_host import ModelHost, Policy
from server.training import checkpoints

log = logging.getLogger("artisan.runs")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SERVED_SNAPSHOTS = 3  # recent steps kept loaded; older ones load from their checkpoint on demand


class LoraSettings(BaseModel):
    rank: int = Field(default=8, ge=1, le=1024)
    alpha: float = Field(default=16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_LINEAR))
    seed: int = 0


class RunSpec(BaseModel):
    name: str
    project: str = "default"
    base_model: str | None = None
    lora: LoraSettings = Field(default_factory=LoraSettings)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not RUN_NAME.match(v) or "@" in v:
            raise ValueError("run name must be 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit")
        return v


@dataclass
class Run:
    spec: RunSpec
    dir: Path
    step: int
    train_adapter: str
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    snapshots: dict[int, str] = field(default_factory=dict)  # step -> loaded adapter name

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "project": self.spec.project, "step": self.step,
                "lora": self.spec.lora.model_dump(), "checkpoints": checkpoints.steps(self.checkpoint_dir)}


def _adapter_name(run: str, suffix: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", run) + "__" + suffix


class RunManager:
    def __init__(self, host: ModelHost, data_dir: Path):
        self.host = host
        self.root = Path(data_dir) / "runs"
        self.root.mkdir(parents=True, exist_ok=True)
        self.runs: dict[str, Run] = {}
        self._lock = threading.RLock()

    # ---- lifecycle -------------------------------------------------------------------------
    def resume_all(self) -> None:
        """Bring every run back at its last complete checkpoint (after a restart or a crash)."""
        for meta in sorted(self.root.glob("*/run.json")):
            spec = RunSpec.model_validate_json(meta.read_text())
            try:
                self._open(spec, create=False)
            except Exception:
                log.exception("could not resume run %s", spec.name)

    def get_or_create(self, spec: RunSpec) -> tuple[Run, bool]:
        with self._lock:
            existing = self.runs.get(spec.name)
            if existing is not None:
                if existing.spec.lora != spec.lora:
                    raise ValueError(f"run {spec.name!r} exists with different LoRA settings "
                                     f"({existing.spec.lora.model_dump()})")
                return existing, False
            return self._open(spec, create=True), True

    def _open(self, spec: RunSpec, create: bool) -> Run:
        from peft import LoraConfig

        run_dir = self.root / spec.name
        ckpt_root = run_dir / "checkpoints"
        checkpoints.clean_partial(ckpt_root)
        done = checkpoints.steps(ckpt_root)
        lora = LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules=spec.lora.target_modules,
                          lora_dropout=0.0, bias="none")
        train_adapter = _adapter_name(spec.name, "train")
        with self.host.lock:
            torch.manual_seed(spec.lora.seed)  # the same spec always starts from the same LoRA
            self.host.add_adapter(train_adapter, lora)
            params = self.host.adapter_params(train_adapter)
            for p in params:
                p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)
        run = Run(spec, run_dir, 0, train_adapter, optimizer, params)
        if done:
            step = done[-1]
            self._load_into(run, step)
            run.step = step
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "run.json").write_text(spec.model_dump_json(indent=2))
            self.save_checkpoint(run, {"kind": "init"})
        self.runs[spec.name] = run
        self.publish(run)
        log.info("run %s at step %d", spec.name, run.step)
        return run

    def _load_into(self, run: Run, step: int) -> None:
        from peft import set_peft_model_state_dict

        state = checkpoints.read_adapter(run.checkpoint_dir, step)
        with self.host.lock:
            set_peft_model_state_dict(self.host.model, state, adapter_name=run.train_adapter)
        run.optimizer.load_state_dict(checkpoints.read_optimizer(run.checkpoint_dir, step))

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, run: Run, meta: dict[str, Any]) -> None:
        state = self.host.adapter_state(run.train_adapter)
        checkpoints.write(run.checkpoint_dir, run.step, state, run.optimizer.state_dict(), meta)

    def list_checkpoints(self, run: Run) -> list[dict[str, Any]]:
        out = []
        for step in checkpoints.steps(run.checkpoint_dir):
            meta = checkpoints.read_meta(run.checkpoint_dir, step)
            out.append({"step": step, "metrics": meta.get("metrics", {}), "created": meta.get("created")})
        return out

    def delete_checkpoint(self, run: Run, step: int) -> None:
        if step == run.step:
            raise ValueError("the latest checkpoint is the run's state and cannot be deleted")
        if step not in checkpoints.steps(run.checkpoint_dir):
            raise KeyError(step)
        self._unload(run, step)
        checkpoints.delete(run.checkpoint_dir, step)

    def prune(self, run: Run, best_metric: str | None = None, mode: str = "max", keep_last: int = 1) -> list[int]:
        """Delete old checkpoints, keeping the latest `keep_last` and the best by `best_metric`."""
        infos = self.list_checkpoints(run)
        keep = {i["step"] for i in infos[-keep_last:]} | {run.step}
        scored = [i for i in infos if isinstance(i["metrics"].get(best_metric or ""), (int, float))]
        if best_metric and scored:
            pick = max if mode == "max" else min
            keep.add(pick(scored, key=lambda i: i["metrics"][best_metric])["step"])
        deleted = []
        for i in infos:
            if i["step"] not in keep:
                self.delete_checkpoint(run, i["step"])
                deleted.append(i["step"])
        return deleted

    # ---- serving ---------------------------------------------------------------------------
    def publish(self, run: Run) -> None:
        """Serve the train adapter's current weights as `run` and `run@step`, at once, in memory.
        The snapshot is a copy: training the next step never changes what a request decodes with."""
        adapter = self._snapshot(run, run.step, self.host.adapter_state(run.train_adapter))
        policy = Policy(run.name, adapter, run.name, run.step)
        self.host.register_policy(run.name, policy)
        self.host.register_policy(f"{run.name}@{run.step}", Policy(f"{run.name}@{run.step}", adapter, run.name, run.step))
        for old in sorted(run.snapshots)[:-SERVED_SNAPSHOTS]:
            self._unload(run, old)

    def _snapshot(self, run: Run, step: int, state: dict[str, torch.Tensor]) -> str:
        from peft import LoraConfig

        adapter = _adapter_name(run.name, f"s{step}")
        lora = LoraConfig(r=run.spec.lora.rank, lora_alpha=run.spec.lora.alpha,
                          target_modules=run.spec.lora.target_modules, lora_dropout=0.0, bias="none")
        with self.host.lock:
            if adapter in getattr(self.host.model, "peft_config", {}):
                self.host.delete_adapter(adapter)
            self.host.add_adapter(adapter, lora, state)
            self.host.model.set_adapter(run.train_adapter)
        run.snapshots[step] = adapter
        return adapter

    def _unload(self, run: Run, step: int) -> None:
        adapter = run.snapshots.get(step)
        if adapter is None or step == run.step:
            return
        if adapter in self.host.adapters_in_use():
            return  # a request is still decoding on it; unloaded at a later publish
        self.host.unregister_policy(f"{run.name}@{step}")
        self.host.delete_adapter(adapter)
        del run.snapshots[step]

    def resolve(self, model: str) -> Policy | None:
        policy = self.host.resolve(model)
        if policy is not None or "@" not in model:
            return policy
        name, _, step_text = model.rpartition("@")
        run = self.runs.get(name)
        if run is None or not step_text.isdigit() or int(step_text) not in checkpoints.steps(run.checkpoint_dir):
            return None
        step = int(step_text)
        with self._lock:
            adapter = self._snapshot(run, step, checkpoints.read_adapter(run.checkpoint_dir, step))
            policy = Policy(model, adapter, name, step)
            self.host.register_policy(model, policy)
        return policy
