"""A training step's commit, in one place and in order, and the roll-back of one that cannot land.

A step that trained is committed in these stages, each durable before the next begins:

    pending     the store holds the step's figures, trajectories and attempt, marked pending
    checkpoint  adapter and optimizer state, written atomically: after a crash, the truth
    advance     the run's step number moves to the new step
    publish     the new adapter is served as `run` and `run@step`
    confirm     the store marks the step done
    export      its groups are queued to the exporters (never waited on)
    retention   trajectories of steps past the retention window are pruned

A crash between two stages is settled at start-up (`settle_after_crash`) by the checkpoints: a
pending step whose checkpoint exists happened, one whose checkpoint does not did not. A step that
trained nothing, failed or was stopped changes nothing but the store's record of its attempt.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from protocol.jobs import RLJob, SFTJob, TrainResult
from protocol.metrics import StepMetrics
from server.export_queue import ExportQueue
from server.faults import crash_point
from server.runs import checkpoints
from server.runs.facade import Runs
from server.runs.run import Run
from server.store import Store, trajectory_rows
from server.training.health import step_warnings
from server.training.steps import ComputedStep

log = logging.getLogger("artisan.jobs")  # settle_after_crash runs at the job worker's start, in its log


@dataclass
class CommitTargets:
    """Everything a committed step reaches."""

    runs: Runs  # checkpoints and serving
    store: Store
    export_queue: ExportQueue | None = None
    keep_trajectory_steps: int | None = None  # None keeps every step's trajectories


@dataclass
class Attempt:
    """One try at a run's next step: the job that asks for it and what that job submitted."""

    job_id: str
    idempotency_key: str
    request: RLJob | SFTJob
    step: int  # the step it becomes if it trains
    stored: bool = False  # its pending rows are in the store (the checkpoint decides them)

    @property
    def kind(self) -> str:
        return self.request.kind


def next_attempt(run: Run, job_id: str, idempotency_key: str, request: RLJob | SFTJob) -> Attempt:
    """A job's try at the run's next step, numbered past every step ever written (damaged ones too)."""
    return Attempt(job_id, idempotency_key, request, run.next_step)


def commit_step(to: CommitTargets, run: Run, attempt: Attempt, computed: ComputedStep) -> TrainResult:
    """The attempt's end when nothing failed: stored as untrained, or committed stage by stage."""
    m, warnings = computed.metrics, computed.warnings
    if not computed.trained:
        to.store.steps.put_attempt(run.name, attempt.step, attempt.kind, attempt.job_id, "untrained",
                                   m.model_dump(mode="json"), warnings)
        return TrainResult(step=run.step, trained=False, metrics=m, warnings=warnings, job_id=attempt.job_id)

    groups = attempt.request.groups if isinstance(attempt.request, RLJob) else []
    figures = m.model_dump(mode="json")
    to.store.steps.put(run.name, attempt.step, attempt.kind, figures, warnings, trajectory_rows(groups),
                       pending=True, job_id=attempt.job_id)
    attempt.stored = True
    crash_point("pending_stored")

    m.checkpoint_seconds, m.publish_seconds = to.runs.land(run, attempt.step, {
        "kind": attempt.kind, "metrics": figures, "warnings": warnings, "created": time.time(),
        "job_id": attempt.job_id, "idempotency_key": attempt.idempotency_key})

    to.store.steps.confirm(run.name, run.step)
    crash_point("step_confirmed")

    if groups and to.export_queue is not None:
        to.export_queue.submit(run.name, run.step, "train", groups)
    if to.keep_trajectory_steps is not None:
        to.store.trajectories.prune(run.name, to.keep_trajectory_steps)
    return TrainResult(step=run.step, trained=True, metrics=m, warnings=warnings, job_id=attempt.job_id)


def roll_back(to: CommitTargets, run: Run, attempt: Attempt, outcome: str, why: str,
              metrics: StepMetrics | None = None) -> None:
    """An attempt that failed or was stopped: the store settled against the checkpoints (a step
    whose checkpoint was written happened), the attempt kept with `why`, and the run's weights
    and optimizer state back at its latest checkpoint."""
    to.runs.restore(run)  # first: a store that cannot be written (a full disk) must not leave trained weights
    if attempt.stored:
        to.store.steps.settle_pending(run.name, set(checkpoints.steps(run.checkpoint_dir)), outcome, why)
    else:
        warnings = [*step_warnings(metrics), why] if metrics is not None else [why]
        to.store.steps.put_attempt(run.name, attempt.step, attempt.kind, attempt.job_id, outcome,
                                   metrics.model_dump(mode="json") if metrics is not None else {}, warnings)


def settle_after_crash(runs: Runs, store: Store) -> dict[str, TrainResult]:
    """The store made to agree with the checkpoints, which are the truth after a crash: a pending
    step whose checkpoint exists is confirmed, one whose checkpoint does not is deleted, and a
    trained step the store lost (its WAL lost or damaged) is put back from its checkpoint's
    figures. Returns each checkpointed step's result by the job that trained it."""
    done_by_job: dict[str, TrainResult] = {}
    lost: list[str] = []
    for run in runs.all():
        written = checkpoints.steps(run.checkpoint_dir)
        store.steps.settle_pending(run.name, set(written))
        stored = {s["step"] for s in store.steps.of(run.name)}
        for step in written:
            try:
                meta = checkpoints.read_meta(run.checkpoint_dir, step)
            except checkpoints.CheckpointDamaged as exc:  # an older step: the run goes on without it
                log.error("run %s: %s", run.name, exc)
                continue
            if meta.get("kind") not in ("rl", "sft"):
                continue
            if step not in stored:
                lost.append(f"{run.name} step {step}")
                store.steps.put(run.name, step, meta["kind"], meta.get("metrics", {}), meta.get("warnings", []), [],
                                job_id=meta.get("job_id"))
            if meta.get("job_id"):
                done_by_job[meta["job_id"]] = TrainResult(
                    step=step, trained=True, metrics=StepMetrics.model_validate(meta.get("metrics", {})),
                    warnings=meta.get("warnings", []), job_id=meta["job_id"])
    if lost:
        store.report(f"the run store at {store.path} had lost {len(lost)} trained step(s) that the checkpoints hold "
                     f"({', '.join(lost[:5])}{', ...' if len(lost) > 5 else ''}): their figures were restored from "
                     f"the checkpoints; their trajectories are gone")
    return done_by_job
