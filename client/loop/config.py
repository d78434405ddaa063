"""What one run of the training loop is: where, what, how long, and how each step trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from client.loop.curriculum import Curriculum
from client.loop.ray_rollouts import RayWorkers
from protocol.config import TrainConfig


class WarmStart(BaseModel):
    """SFT on the example's demonstrations as a new run's first step, before GRPO (client/loop/training_loop.py)."""

    demonstrations: int = Field(ge=1)
    epochs: int = Field(default=1, ge=1, le=100)
    learning_rate: float | None = Field(default=None, gt=0, le=1.0)  # None: the server's default for the model


class LoopConfig(BaseModel):
    """One run of the loop: where, what, how long, and how each step trains."""

    server: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    run: str = "demo-run"
    project: str = "default"
    example: str = "demo"
    steps: int = Field(default=20, ge=0)
    groups_per_step: int = Field(default=8, ge=1)
    group_size: int = Field(default=8, ge=1)
    eval_every: int = Field(default=5, ge=0)
    eval_tasks: int = Field(default=64, ge=1)
    # Attempts in a row that may train nothing before the loop gives up (see client/loop/patience.py).
    patience: int = Field(default=3, ge=1)
    # DAPO's dynamic sampling (client/pipeline.py): up to this many groups a step are sampled in place
    # of groups whose rollouts all scored alike, so that a step trains on groups with signal; 0: off.
    dynamic_sampling: int = Field(default=0, ge=0, le=1024)
    # Steps a group's sampler may be behind the weights that train it (client/pipeline.py); 0 is
    # synchronous: no sampling while a step trains.
    max_steps_off_policy: int = Field(default=0, ge=0, le=64)
    # How long each call waits out an unreachable server (a restart) before the run gives up; None:
    # ARTISAN_RETRY_SECONDS, else 300 (client/model.py).
    retry_seconds: float | None = Field(default=None, ge=0)
    # Seeds the task draws and every rollout's and evaluation's sampling (rollouts/seeding.py), so
    # that the same command gives the same curve; None: tasks drawn from 0, sampling unseeded.
    seed: int | None = None
    out: Path = Path("out/train")
    reward: Literal["env", "ruler"] = "env"
    judge: str | None = None
    progress: bool = True
    train: TrainConfig = TrainConfig()
    # Overrides of the example's rollout settings (max_turns, max_tokens, temperature); None keeps its own.
    rollout_overrides: dict[str, Any] = {}
    # Raise the example's difficulty level as its held-out success passes a threshold (client/loop/curriculum.py).
    curriculum: Curriculum | None = None
    start_level: int = Field(default=0, ge=0)
    # A*-PO's stage 1 (client/loop/apo.py), for a TrainConfig whose baseline is "given" (loss "apo").
    value_samples: int = Field(default=8, ge=1, le=1024)
    value_beta: float = Field(default=0.5, gt=0)
    skip_unsolved: bool = True
    # The example's own options, passed to its make_example (`--domain retail --domain airline`).
    example_kwargs: dict[str, Any] = {}
    # Run rollouts (training, evaluation, A*-PO's reference samples) on Ray workers; None: here.
    ray: RayWorkers | None = None
    # At the end, if an earlier step scored higher on held-out tasks than the latest, the run's name
    # serves that step (PUT /v1/runs/{name}/serving); training still goes on from the latest.
    keep_best: bool = False
    # None: the run starts GRPO from the base model.
    warm_start: WarmStart | None = None
    # A multi-agent example's roles to train (client/loop/team_loop.py); None: every role.
    train_roles: list[str] | None = None

    @property
    def task_seed(self) -> int:
        """The seed the training tasks are drawn from: an unseeded run draws the tasks of seed 0."""
        return 0 if self.seed is None else self.seed
