"""Training jobs: submit returns at once, a worker runs jobs one at a time, clients follow events.

Idempotency: a submission carries a key; a retried submission with the same key returns the
same job and trains once. Events are stored, so a client whose connection dropped reconnects
and resumes from the last event it saw. After a crash, a job whose step reached a checkpoint is
completed from the checkpoint's record; one that did not is marked interrupted, and resubmitting
its key runs it again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from client.types import Conversation, SFTConfig, TrainConfig, TrainResult, TrajectoryGroup
from server.model_host import ModelHost
from server.store import Store
from server.training import checkpoints, steps
from server.training.runs import Run, RunManager

log = logging.getLogger("artisan.jobs")
TERMINAL = {"succeeded", "failed", "interrupted"}


@dataclass
class Job:
    id: str
    run: str
    kind: str  # "rl" or "sft"
    key: str
    payload: Any = None
    config: Any = None
    status: str = "queued"
    result: dict[str, Any] | None = None
    error: str | None = None
    created: float = field(default_factory=time.time)
    n_events: int = 0
    attempt_from: int = 0  # first event of the current attempt (a resubmitted interrupted job runs again)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "kind": self.kind, "idempotency_key": self.key,
                "status": self.status, "result": self.result, "error": self.error, "created": self.created}


class JobManager:
    def __init__(self, host: ModelHost, runs: RunManager, store: Store, exports: Any = None,
                 keep_trajectory_steps: int | None = None):
        self.host, self.runs, self.store = host, runs, store
        self.keep_trajectory_steps = keep_trajectory_steps
        self.exports = exports  # optional exporters (server/export): queued, never waited on
        self._queue: "queue.Queue[Job | None]" = queue.Queue()
        self._active: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified on every event
        self._thread = threading.Thread(target=self._work, name="artisan-trainer", daemon=True)

    def start(self) -> None:
        self._recover()
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    # ---- recovery --------------------------------------------------------------------------
    def _recover(self) -> None:
        """Reconcile the store with the checkpoints, which are the truth after a crash: a step
        that reached its checkpoint gets its store row, a job whose step did is completed, and
        every other unfinished job is marked interrupted."""
        done_by_job: dict[str, dict[str, Any]] = {}
        for run in self.runs.runs.values():
            stored = {s["step"] for s in self.store.steps(run.name)}
            for step in checkpoints.steps(run.checkpoint_dir):
                meta = checkpoints.read_meta(run.checkpoint_dir, step)
                if meta.get("kind") not in ("rl", "sft"):
                    continue
                if step not in stored:
                    self.store.put_step(run.name, step, meta["kind"], meta.get("metrics", {}), meta.get("warnings", []), [])
                if meta.get("job_id"):
                    done_by_job[meta["job_id"]] = TrainResult(
                        step=step, trained=True, metrics=meta.get("metrics", {}), warnings=meta.get("warnings", []),
                        job_id=meta["job_id"]).model_dump()
        for status in ("queued", "running"):
            for rec in self.store.jobs(status):
                job = Job(rec["id"], rec["run"], rec["kind"], rec["idempotency_key"], created=rec["created"])
                job.n_events = len(self.store.events(job.id))
                done = done_by_job.get(job.id)
                if done is not None:
                    job.status, job.result = "succeeded", done
                    self._event(job, "result", done)
                else:
                    job.status, job.error = "interrupted", "the server restarted before this job finished; resubmit it"
                    self._event(job, "interrupted", {"message": job.error})
                self.store.put_job(job.record())

    # ---- submit / follow -------------------------------------------------------------------
    def submit(self, run: Run, kind: str, key: str | None, payload: Any, config: Any) -> tuple[Job, bool]:
        """Returns (job, created). A known key returns its job; an interrupted one runs again."""
        key = key or uuid.uuid4().hex
        with self._lock:
            for job in self._active.values():
                if job.run == run.name and job.key == key:
                    return job, False
            rec = self.store.job_by_key(run.name, key)
            if rec is not None and rec["status"] != "interrupted":
                job = Job(rec["id"], rec["run"], rec["kind"], key, status=rec["status"], result=rec["result"],
                          error=rec["error"], created=rec["created"])
                return job, False
            job = Job(rec["id"] if rec else "job-" + uuid.uuid4().hex[:16], run.name, kind, key, payload, config)
            job.n_events = job.attempt_from = len(self.store.events(job.id)) if rec else 0
            self._active[job.id] = job
            self.store.put_job(job.record())
        self._event(job, "queued", {"position": self._queue.qsize()})
        self._queue.put(job)
        return job, True

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._active.get(job_id)
            if job is not None:
                return job.record()
        return self.store.job(job_id)

    def events(self, job_id: str, after: int = -1) -> list[dict[str, Any]]:
        return self.store.events(job_id, after)

    def _event(self, job: Job, type_: str, data: dict[str, Any]) -> None:
        with self._lock:
            seq = job.n_events
            job.n_events += 1
            self.store.put_event(job.id, seq, type_, data)
            self.changed.notify_all()

    # ---- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: Job) -> None:
        run = self.runs.runs[job.run]
        job.status = "running"
        self.store.put_job(job.record())
        self._event(job, "started", {"step": run.step})
        meta = {"job_id": job.id, "idempotency_key": job.key}
        progress = lambda stage, data: self._event(job, "progress", {"stage": stage, **data})  # noqa: E731
        try:
            if job.kind == "rl":
                result = steps.rl_step(self.host, self.runs, run, job.payload, job.config, meta, progress)
            else:
                result = steps.sft_step(self.host, self.runs, run, job.payload, job.config, meta, progress)
            result.job_id = job.id
            if result.trained and job.kind == "rl":
                self.store.put_step(run.name, result.step, "rl", result.metrics, result.warnings,
                                    _trajectory_rows(job.payload))
                if self.exports is not None:
                    self.exports.submit(run.name, result.step, "train", job.payload)
                if self.keep_trajectory_steps is not None:
                    self.store.prune_trajectories(run.name, self.keep_trajectory_steps)
            elif result.trained:
                self.store.put_step(run.name, result.step, "sft", result.metrics, result.warnings, [])
            job.status, job.result = "succeeded", result.model_dump()
            self.store.put_job(job.record())
            self._event(job, "result", job.result)
        except Exception as exc:
            log.exception("job %s failed", job.id)
            job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"
            self.store.put_job(job.record())
            self._event(job, "error", {"message": job.error})
        finally:
            job.payload = None
            with self._lock:
                self._active.pop(job.id, None)


def _trajectory_rows(groups: list[TrajectoryGroup]) -> list[tuple[int, int, float, dict[str, Any]]]:
    return [(gi, ti, t.reward, t.model_dump(mode="json"))
            for gi, g in enumerate(groups) for ti, t in enumerate(g.trajectories)]


def parse_config(kind: str, raw: dict[str, Any] | None) -> TrainConfig | SFTConfig:
    return (TrainConfig if kind == "rl" else SFTConfig).model_validate(raw or {})


def parse_payload(kind: str, body: dict[str, Any]) -> list[TrajectoryGroup] | list[Conversation]:
    if kind == "rl":
        return [TrajectoryGroup.model_validate(g) for g in body.get("groups") or []]
    return [Conversation.model_validate(c) for c in body.get("conversations") or []]
