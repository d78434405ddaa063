"""Training jobs: submit returns at once, a worker runs jobs one at a time, clients follow events.

Idempotency: a submission carries a key; the same key with the same body returns the same job
and trains once, the same key with another body is refused. Events are stored, so a client whose
connection dropped resumes from the last event it saw. A step is committed in a recoverable
order: its figures and trajectories are stored as pending, then its checkpoint is written, then
the store marks it done; after a crash the checkpoint decides whether the step happened. Jobs
can be cancelled, and run at most `time_limit` seconds.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.jobs import RLJob, SFTJob, TrainResult
from protocol.metrics import StepMetrics
from server.faults import crash_point
from server.store import Store, trajectory_rows
from server.training import checkpoints, steps
from server.training.optimize import Cancelled
from server.training.runs import Run, RunManager

log = logging.getLogger("artisan.jobs")
ACTIVE = ("queued", "running")


class KeyConflict(ValueError):
    """The idempotency key was used for a different submission (a 409)."""


def body_hash(request: RLJob | SFTJob) -> str:
    payload = request.model_dump_json(exclude={"idempotency_key"})
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


@dataclass
class Job:
    id: str
    run: str
    kind: str  # "rl" or "sft"
    key: str
    body_hash: str
    request: RLJob | SFTJob | None = None
    status: str = "queued"  # queued, running, succeeded, failed, interrupted, cancelled
    result: dict[str, Any] | None = None
    error: str | None = None
    created: float = field(default_factory=time.time)
    n_events: int = 0
    attempt_from: int = 0  # first event of the current attempt (a resubmitted interrupted job runs again)
    cancel: threading.Event = field(default_factory=threading.Event)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "kind": self.kind, "idempotency_key": self.key,
                "status": self.status, "result": self.result, "error": self.error, "created": self.created,
                "body_hash": self.body_hash, "attempt_from": self.attempt_from}


class JobManager:
    def __init__(self, runs: RunManager, store: Store, exports: Any = None,
                 keep_trajectory_steps: int | None = None, time_limit: float = 6 * 3600):
        self.runs, self.store = runs, store
        self.keep_trajectory_steps = keep_trajectory_steps
        self.exports = exports  # optional exporters (server/export): queued, never waited on
        self.time_limit = time_limit
        self._queue: "queue.Queue[Job | None]" = queue.Queue()
        self._active: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="artisan-trainer", daemon=True)

    def start(self) -> None:
        self._recover()
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    # ---- recovery ------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Reconcile the store with the checkpoints, which are the truth after a crash: a pending
        step whose checkpoint exists is confirmed, one whose checkpoint does not is deleted, a job
        whose step reached its checkpoint is completed, every other unfinished job is interrupted."""
        done_by_job: dict[str, dict[str, Any]] = {}
        for run in self.runs.all():
            written = checkpoints.steps(run.checkpoint_dir)
            self.store.settle_pending(run.name, set(written))
            stored = {s["step"] for s in self.store.steps(run.name)}
            for step in written:
                meta = checkpoints.read_meta(run.checkpoint_dir, step)
                if meta.get("kind") not in ("rl", "sft"):
                    continue
                if step not in stored:
                    self.store.put_step(run.name, step, meta["kind"], meta.get("metrics", {}), meta.get("warnings", []), [])
                if meta.get("job_id"):
                    done_by_job[meta["job_id"]] = TrainResult(
                        step=step, trained=True, metrics=StepMetrics.model_validate(meta.get("metrics", {})),
                        warnings=meta.get("warnings", []), job_id=meta["job_id"]).model_dump(mode="json")
        for status in ACTIVE:
            for rec in self.store.jobs(status):
                job = self._from_record(rec)
                done = done_by_job.get(job.id)
                if done is not None:
                    job.status, job.result = "succeeded", done
                    self._event(job, "result", done)
                else:
                    job.status, job.error = "interrupted", "the server restarted before this job finished; resubmit it"
                    self._event(job, "interrupted", {"message": job.error})
                self.store.put_job(job.record())

    def _from_record(self, rec: dict[str, Any]) -> Job:
        job = Job(rec["id"], rec["run"], rec["kind"], rec["idempotency_key"], rec.get("body_hash") or "",
                  status=rec["status"], result=rec["result"], error=rec["error"], created=rec["created"],
                  attempt_from=rec.get("attempt_from") or 0)
        job.n_events = self.store.count_events(job.id)
        return job

    # ---- submit / follow / cancel ----------------------------------------------------------------
    def submit(self, run: Run, request: RLJob | SFTJob) -> tuple[Job, bool]:
        """Returns (job, created). A known key returns its job; an interrupted one runs again."""
        key, digest = request.idempotency_key or uuid.uuid4().hex, body_hash(request)
        with self._lock:
            known = next((j for j in self._active.values() if j.run == run.name and j.key == key), None)
            rec = None if known else self.store.job_by_key(run.name, key)
            if known is None and rec is not None:
                known = self._from_record(rec)
            if known is not None and known.body_hash and known.body_hash != digest:
                raise KeyConflict(f"idempotency key {key!r} was used for a different submission (job {known.id})")
            if known is not None and known.status != "interrupted":
                return known, False
            job = Job(known.id if known else "job-" + uuid.uuid4().hex[:16], run.name, request.kind, key, digest,
                      request=request)
            job.n_events = job.attempt_from = known.n_events if known else 0
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

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Stop a queued job before it starts, or a running one at its next micro-batch."""
        with self._lock:
            job = self._active.get(job_id)
        if job is None:
            return self.store.job(job_id)
        job.cancel.set()
        return job.record()

    def _event(self, job: Job, type_: str, data: dict[str, Any]) -> None:
        with self._lock:
            seq = job.n_events
            job.n_events += 1
            self.store.put_event(job.id, seq, type_, data)

    # ---- worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job)
            finally:
                job.request = None
                with self._lock:
                    self._active.pop(job.id, None)

    def _run(self, job: Job) -> None:
        run = self.runs.get(job.run)
        if job.cancel.is_set() or run is None:
            return self._end(job, "cancelled", "cancelled before it started", "cancelled")
        job.status = "running"
        self.store.put_job(job.record())
        self._event(job, "started", {"step": run.step})
        deadline = time.monotonic() + self.time_limit
        stop = lambda: job.cancel.is_set() or time.monotonic() > deadline  # noqa: E731
        progress = lambda stage, data: self._event(job, "progress", {"stage": stage, **data})  # noqa: E731
        try:
            result = self._train(job, run, progress, stop)
        except Cancelled:
            run.restore()
            why = "cancelled" if job.cancel.is_set() else f"ran past its time limit of {self.time_limit:.0f}s"
            return self._end(job, "cancelled" if job.cancel.is_set() else "failed", why,
                             "cancelled" if job.cancel.is_set() else "error")
        except Exception as exc:
            log.exception("job %s failed", job.id)
            run.restore()  # whatever the step changed before it failed is not the run's state
            self.store.settle_pending(run.name, set(checkpoints.steps(run.checkpoint_dir)))
            return self._end(job, "failed", f"{type(exc).__name__}: {exc}", "error")
        job.status, job.result = "succeeded", result.model_dump(mode="json")
        self.store.put_job(job.record())
        self._event(job, "result", job.result)

    def _train(self, job: Job, run: Run, progress, stop) -> TrainResult:
        """The step, committed in order: store (pending), checkpoint, store (done)."""
        meta = {"job_id": job.id, "idempotency_key": job.key}
        req = job.request
        pending = {"step": run.step + 1, "kind": req.kind,
                   "rows": trajectory_rows(req.groups) if isinstance(req, RLJob) else []}

        def before_commit(m: StepMetrics, warnings: list[str]) -> None:
            self.store.put_step(run.name, pending["step"], req.kind, m.model_dump(mode="json"), warnings,
                                pending["rows"], pending=True)
            crash_point("pending_stored")

        crash_point("step_start")
        hooks = steps.Hooks(progress, stop, before_commit)
        if isinstance(req, RLJob):
            result = steps.rl_step(run, req.groups, req.config, meta, hooks)
        else:
            result = steps.sft_step(run, req.conversations, req.config, meta, hooks)
        result.job_id = job.id
        if result.trained:
            self.store.confirm_step(run.name, result.step)
            crash_point("step_confirmed")
            self._after_step(run, req, result)
        return result

    def _after_step(self, run: Run, req: RLJob | SFTJob, result: TrainResult) -> None:
        if isinstance(req, RLJob) and self.exports is not None:
            self.exports.submit(run.name, result.step, "train", req.groups)
        if self.keep_trajectory_steps is not None:
            self.store.prune_trajectories(run.name, self.keep_trajectory_steps)

    def _end(self, job: Job, status: str, message: str, event: str) -> None:
        job.status, job.error = status, message
        self.store.put_job(job.record())
        self._event(job, event, {"message": message})
