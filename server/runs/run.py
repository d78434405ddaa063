"""One run in memory: its spec, trainable adapter, optimizer, step and loaded snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.config import RunSpec
from protocol.metrics import StepMetrics
from server.engine.base import Engine
from server.model.host import ModelHost
from server.runs import checkpoints
from server.training.hyperparams import default_learning_rate


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
    # SERVED_SNAPSHOTS until the client retains other steps (ServedSteps.retain).
    retained: set[int] = field(default_factory=set)
    highest_used: int = 0  # numbers up to here are taken, by damaged steps set aside too
    damaged: list[str] = field(default_factory=list)  # what was found damaged at start, for the run's status
    serving_step: int | None = None  # an earlier step the bare name serves (runs/pins.py); None: the latest

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
                "default_learning_rate": default_learning_rate(self.host)}

    def last_kind(self) -> str | None:
        """What the run's latest step was ("rl", "sft"); None before its first."""
        return checkpoints.read_meta(self.checkpoint_dir, self.step).get("kind")

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


def lora_config(spec: RunSpec, host: ModelHost, engine: Engine) -> Any:
    """The peft LoRA config of a run's adapters, refused when this model or engine cannot hold it."""
    from peft import LoraConfig

    targets = spec.lora.target_modules or host.lora_targets
    unknown = sorted(set(targets) - set(host.lora_targets))
    if unknown:
        raise ValueError(f"lora.target_modules: {', '.join(unknown)} are not linear layers of this model "
                         f"(it has {', '.join(host.lora_targets)})")
    limit = engine.max_lora_rank
    if limit is not None and spec.lora.rank > limit:
        raise ValueError(f"lora.rank: {spec.lora.rank} is more than this server's engine serves ({limit}; "
                         f"art-server --vllm-max-lora-rank)")
    return LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules=targets,
                      exclude_modules=host.lora_excluded, lora_dropout=0.0, bias="none")
