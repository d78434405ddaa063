"""Training jobs on the wire: what a client submits, the events it follows, what it gets back.

A submission is one of two typed requests, told apart by `kind`, validated once where it
arrives. Its idempotency key makes a retried submission train once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.config import RUN_NAME, SFTConfig, TrainConfig
from protocol.metrics import StepMetrics
from protocol.trajectory import MAX_ABS_REWARD, Conversation, TrajectoryGroup

IDEMPOTENCY_KEY = r"^[A-Za-z0-9_.:-]{1,200}$"
SESSION_ID = r"^[A-Za-z0-9_.:-]{1,128}$"  # chosen by the client; it goes in a URL path
# The events that end a job's stream; every other event is progress.
TERMINAL_EVENTS = ("result", "error", "interrupted", "cancelled")


def check_values(values: list[float | None], config: TrainConfig) -> None:
    """A baseline "given" needs every group's value: a group without one would otherwise be
    compared with nothing (dropped, or trained on its raw reward), so it is refused by name."""
    if config.baseline != "given":
        return
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise ValueError(f"baseline 'given'{' (loss apo, A*-PO)' if config.loss == 'apo' else ''} needs each "
                         f"group's value (V*(x)); groups[{missing[0]}] has none ({len(missing)} of {len(values)} "
                         f"groups lack it)")


class RLJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["rl"] = "rl"
    groups: list[TrajectoryGroup] = Field(max_length=100_000, json_schema_extra={"minItems": 1})
    config: TrainConfig = Field(default_factory=TrainConfig)
    idempotency_key: str | None = Field(default=None, pattern=IDEMPOTENCY_KEY)

    @field_validator("groups")
    @classmethod
    def _some(cls, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        if not groups:
            raise ValueError("nothing to train: send groups (rl) or conversations (sft)")
        return groups

    @model_validator(mode="after")
    def _values(self) -> "RLJob":
        check_values([g.value for g in self.groups], self.config)
        return self


class SFTJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["sft"]
    conversations: list[Conversation] = Field(max_length=1_000_000, json_schema_extra={"minItems": 1})
    config: SFTConfig = Field(default_factory=SFTConfig)
    idempotency_key: str | None = Field(default=None, pattern=IDEMPOTENCY_KEY)

    @field_validator("conversations")
    @classmethod
    def _some(cls, conversations: list[Conversation]) -> list[Conversation]:
        if not conversations:
            raise ValueError("nothing to train: send groups (rl) or conversations (sft)")
        return conversations


class ScoredSession(BaseModel):
    """A session the server recorded (an agent run through `/v1/sessions/{id}/...`), and its reward."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(pattern=SESSION_ID)
    reward: float = Field(allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)  # as Trajectory.reward
    metrics: dict[str, float | int | bool | None] = Field(default_factory=dict)


class SessionGroup(BaseModel):
    """The sessions of one task, compared with each other; `exceptions` as in a TrajectoryGroup."""

    model_config = ConfigDict(extra="forbid")

    sessions: list[ScoredSession] = Field(max_length=10_000)
    exceptions: list[str] = Field(default_factory=list)
    value: float | None = Field(default=None, allow_inf_nan=False, ge=-MAX_ABS_REWARD,
                                le=MAX_ABS_REWARD)  # as TrajectoryGroup.value


class SessionJob(BaseModel):
    """An RL job whose trajectories the server assembles from the sessions it recorded."""

    model_config = ConfigDict(extra="forbid")

    groups: list[SessionGroup] = Field(min_length=1, max_length=100_000)
    config: TrainConfig = Field(default_factory=TrainConfig)
    idempotency_key: str | None = Field(default=None, pattern=IDEMPOTENCY_KEY)

    @model_validator(mode="after")
    def _values(self) -> "SessionJob":
        check_values([g.value for g in self.groups], self.config)
        return self


class _Joint(BaseModel):
    """Jobs of several runs under one idempotency key, given once, at the top."""

    model_config = ConfigDict(extra="forbid")

    idempotency_key: str | None = Field(default=None, pattern=IDEMPOTENCY_KEY)

    @model_validator(mode="after")
    def _one_key(self) -> "_Joint":
        for name, job in self.jobs.items():
            if job.idempotency_key not in (None, self.idempotency_key):
                raise ValueError(f"jobs[{name!r}] has an idempotency_key of its own: a joint job has one, at its top")
        return self


RunName = Annotated[str, Field(pattern=RUN_NAME)]


class JointJob(_Joint):
    """RL jobs of several runs (the roles of one multi-agent episode) trained at one step boundary:
    every run's step is computed before any is committed, and a step that fails or is cancelled
    before the commits rolls every run back. Each run gets a job of its own to follow, under the
    one idempotency key; a commit that fails after another run's landed (a full disk, a crash)
    leaves the landed one, and the same submission trains only the runs whose step did not."""

    jobs: dict[RunName, RLJob] = Field(min_length=2, max_length=16, description="each run's job")


class JointSessionJob(_Joint):
    """A JointJob whose parts are session jobs: each role's harness recorded sessions under its own
    run's session URLs, and every run trains on its sessions at one step boundary."""

    jobs: dict[RunName, SessionJob] = Field(min_length=2, max_length=16, description="each run's session job")


JobRequest = Annotated[Union[RLJob, SFTJob], Field(discriminator="kind")]
JOB_KINDS = ("rl", "sft")


class TrainResult(BaseModel):
    step: int
    trained: bool
    metrics: StepMetrics = Field(default_factory=StepMetrics)
    warnings: list[str] = Field(default_factory=list)
    job_id: str | None = None


class JobEvent(BaseModel):
    seq: int
    type: str  # queued, started, progress, or one of TERMINAL_EVENTS
    data: dict[str, Any] = Field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS
