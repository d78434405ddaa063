"""Training jobs: submit returns at once, a worker runs jobs one at a time, clients follow events.

Each run has its own queue and the worker takes the runs in turn (round-robin), so a run that
queued many jobs delays another run by at most one of its jobs, which the bounds checked at
submission (server/training/bounds.py) and the time limit keep finite.

Idempotency: a submission carries a key; the same key with the same body returns the same job
and trains once, the same key with another body is refused. Events are stored, so a client whose
connection dropped resumes from the last event it saw. A job's step is computed by steps.py and
committed (or rolled back) by commit.py, which after a crash settles the store against the
checkpoints, which decide whether a step happened. Jobs can be cancelled, and run at most
`time_limit` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from protocol.jobs import TERMINAL_EVENTS, RLJob, SFTJob, TrainResult
from protocol.metrics import StepMetrics
from server.export_queue import ExportQueue
from server.faults import crash_point
from server.runs.facade import NotServed, OtherBaseModel, Runs
from server.runs.run import Run
from server.store import Store, storage_failure
from server.training import distill, steps
from server.training.assemble import Cancelled, Interrupted
from server.training.commit import Attempt, CommitTargets, commit_step, next_attempt, roll_back, settle_after_crash
from server.training.digests import body_hash
from server.training.optimize import optimize

log = logging.getLogger("artisan.jobs")
ACTIVE = ("queued", "running")


def found(runs: Runs, name: str) -> Run | None:
    """The run a queued job names; None once it was deleted."""
    try:
        return runs.find(name)
    except (NotServed, OtherBaseModel):  # not LookupError: a KeyError from a bug is no deleted run
        return None


class KeyConflict(ValueError):
    """The idempotency key was used for a different submission (a 409)."""


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
    # Jobs of other runs trained with this one as a unit (a JointJob), queued behind this one alone.
    partners: list["Job"] = field(default_factory=list)
    ended: bool = False  # its end is stored, or kept in memory (_remember)

    @property
    def unit(self) -> list["Job"]:
        return [self, *self.partners]

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "kind": self.kind, "idempotency_key": self.key,
                "status": self.status, "result": self.result, "error": self.error, "created": self.created,
                "body_hash": self.body_hash, "attempt_from": self.attempt_from}


class JobManager:
    def __init__(self, runs: Runs, store: Store, export_queue: ExportQueue | None = None,
                 keep_trajectory_steps: int | None = None, *, time_limit: float,
                 max_optimizer_steps: int | None = None, optimize_step: Callable[..., Any] = optimize):
        self.runs, self.store = runs, store
        self.optimize = optimize_step  # in this process, or a DataParallelTrainer's (server/training/data_parallel.py)
        self.targets = CommitTargets(runs, store, export_queue, keep_trajectory_steps)
        self.time_limit, self.max_optimizer_steps = time_limit, max_optimizer_steps
        self.teacher = distill.teacher_of(runs)
        # Queued jobs per run, runs in the order the worker serves them; guarded by _turns.
        self._queues: "OrderedDict[str, deque[Job]]" = OrderedDict()
        self._turns = threading.Condition()
        self._stopping = False
        self.running: Job | None = None
        self._active: dict[str, Job] = {}
        # Jobs whose end the store could not take (a full disk): their record and terminal event,
        # served from here so that no client follows a job that never ends.
        self._unstored: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.fault: str | None = None  # the last write failure, until a job ends well again (/health)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="artisan-trainer", daemon=True)

    def start(self) -> None:
        self._recover()
        self._thread.start()

    def stop(self) -> None:
        with self._turns:
            self._stopping = True
            self._turns.notify_all()
        self._thread.join(timeout=5)

    # ---- recovery ------------------------------------------------------------------------------
    def _recover(self) -> None:
        """After a crash: the store settled against the checkpoints (commit.py's `settle_after_crash`),
        then a job whose step reached its checkpoint is completed and every other unfinished job is
        interrupted."""
        done_by_job = settle_after_crash(self.runs, self.store)
        for status in ACTIVE:
            for rec in self.store.jobs.all(status):
                job = self._from_record(rec)
                done = done_by_job.get(job.id)
                if done is not None:
                    job.status, job.result = "succeeded", done.model_dump(mode="json")
                    self._event(job, "result", job.result)
                else:
                    job.status, job.error = "interrupted", "the server restarted before this job finished; resubmit it"
                    self._event(job, "interrupted", {"message": job.error})
                self.store.jobs.put(job.record())

    def _from_record(self, rec: dict[str, Any]) -> Job:
        job = Job(rec["id"], rec["run"], rec["kind"], rec["idempotency_key"], rec.get("body_hash") or "",
                  status=rec["status"], result=rec["result"], error=rec["error"], created=rec["created"],
                  attempt_from=rec.get("attempt_from") or 0)
        job.n_events = self.store.jobs.count_events(job.id)
        return job

    # ---- submit / follow / cancel ----------------------------------------------------------------
    def known(self, run: str, key: str | None, digest: str) -> Job | None:
        """The job submitted under `key` to `run`, if any; a KeyConflict when it was another body."""
        if key is None:
            return None
        with self._lock:
            return self._known(run, key, digest)

    def _known(self, run: str, key: str, digest: str) -> Job | None:
        known = next((j for j in self._active.values() if j.run == run and j.key == key), None)
        rec = None if known else self.store.jobs.by_key(run, key)
        if known is None and rec is not None:
            known = self._from_record(rec)
        if known is not None and known.body_hash and known.body_hash != digest:
            raise KeyConflict(f"idempotency key {key!r} was used for a different submission (job {known.id})")
        return known

    def kept_request(self, job_id: str) -> RLJob | None:
        """The request stored with a job (submit's `keep_request`); None when none was, or it cannot
        be read back (the store's damage: the job is then as if it had kept none)."""
        stored = self.store.jobs.request(job_id)
        if stored is None:
            return None
        try:
            return RLJob.model_validate_json(stored)
        except ValueError:
            log.exception("job %s: its stored request cannot be read", job_id)
            return None

    def submit(self, run: Run, request: RLJob | SFTJob, digest: str | None = None,
               keep_request: bool = False) -> tuple[Job, bool]:
        """Returns (job, created). A known key returns its job; an interrupted one runs again.
        `digest` stands for the body when the request was made from another (a session job's);
        `keep_request` stores the request with the job, for a body that cannot be sent again."""
        return self.submit_together([(run, request, digest)], keep_request)[0]

    def submit_together(self, parts: list[tuple[Run, RLJob | SFTJob, str | None]],
                        keep_request: bool = False) -> list[tuple[Job, bool]]:
        """One job per (run, request, digest), trained as one unit (protocol/jobs.py JointJob): the
        first new one is queued and takes the others with it. Every key is checked before any job is
        stored, so a conflict on one run leaves no job on another."""
        with self._lock:
            keyed = [(run, request, request.idempotency_key or uuid.uuid4().hex, digest or body_hash(request))
                     for run, request, digest in parts]
            known = [self._known(run.name, key, digest) for run, _, key, digest in keyed]
            out: list[tuple[Job, bool]] = []
            for (run, request, key, digest), was in zip(keyed, known):
                if was is not None and was.status != "interrupted":
                    out.append((was, False))
                    continue
                job = Job(was.id if was else "job-" + uuid.uuid4().hex[:16], run.name, request.kind, key, digest,
                          request=request)
                job.n_events = job.attempt_from = was.n_events if was else 0
                # first: a store that cannot take it (a full disk) leaves no trace
                self.store.jobs.put(job.record(), request.model_dump_json() if keep_request else None)
                self._active[job.id] = job
                out.append((job, True))
        new = [job for job, created in out if created]
        for job in new:
            try:
                self._event(job, "queued", {"position": self.queued()})
            except Exception:  # the job is stored, so it is accepted: it runs without its queued event
                log.exception("job %s: its queued event could not be stored", job.id)
        if new:
            new[0].partners = new[1:]
            with self._turns:
                self._queues.setdefault(new[0].run, deque()).append(new[0])
                self._turns.notify_all()
        return out

    def queued(self) -> int:
        with self._turns:
            return sum(len(q) for q in self._queues.values())

    def _next(self) -> Job | None:
        """The first queued job of the run whose turn it is (the run is then last in line)."""
        with self._turns:
            while not self._stopping and not self._queues:
                self._turns.wait()
            if self._stopping:
                return None
            name, jobs = next(iter(self._queues.items()))
            job = jobs.popleft()
            if jobs:
                self._queues.move_to_end(name)
            else:
                del self._queues[name]
            self.running = job
            return job

    def _unqueue(self, job: Job) -> bool:
        """Take a job out of its run's queue; False when the worker has it already."""
        with self._turns:
            jobs = self._queues.get(job.run)
            if jobs is None or job not in jobs:
                return False
            jobs.remove(job)
            if not jobs:
                del self._queues[job.run]
            return True

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._active.get(job_id)
            if job is not None:
                return job.record()
            if job_id in self._unstored:
                return self._unstored[job_id][0]
        return self.store.jobs.get(job_id)

    def events(self, job_id: str, after: int = -1) -> list[dict[str, Any]]:
        events = self.store.jobs.events(job_id, after)
        unstored = self._unstored.get(job_id)
        if unstored is not None and unstored[1]["seq"] > after and not any(e["type"] in TERMINAL_EVENTS for e in events):
            events.append(unstored[1])
        return events

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """End a queued job now, or stop a running one at its next turn or micro-batch."""
        with self._lock:
            job = self._active.get(job_id)
        if job is None:
            return self.store.jobs.get(job_id)
        job.cancel.set()  # a partner of a joint job is in no queue: its unit sees this when it starts
        if self._unqueue(job):
            self._finish(job, lambda: self._end_all(job.unit, "cancelled", "cancelled before it started", "cancelled"))
        return job.record()

    def cancel_run(self, run: str) -> None:
        """Cancel every job of a run and return once none is running (a running job stops at its
        next turn or micro-batch, or ends its commit)."""
        with self._lock:
            jobs = [j for j in self._active.values() if j.run == run]
        for job in jobs:
            self.cancel(job.id)
        with self._turns:
            while self.running is not None and any(j.run == run for j in self.running.unit):
                self._turns.wait(0.1)

    def _event(self, job: Job, type_: str, data: dict[str, Any]) -> None:
        with self._lock:
            seq = job.n_events
            job.n_events += 1
            self.store.jobs.put_event(job.id, seq, type_, data)

    # ---- worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._next()) is not None:
            self._finish(job, lambda: self._run(job))
            with self._turns:
                self.running = None
                self._turns.notify_all()

    def _finish(self, job: Job, body: Any) -> None:
        try:
            body()
        except Exception as exc:  # a roll-back or a store write failed too: this job ends, the worker goes on
            log.exception("job %s could not end cleanly", job.id)
            for j in job.unit:
                if not j.ended:
                    self._end_unstored(j, f"{type(exc).__name__}: {exc}")
        finally:
            for j in job.unit:
                j.request = None
                with self._lock:
                    self._active.pop(j.id, None)

    def _run(self, job: Job) -> None:
        """A job and its partners (most jobs have none): every step computed, then each committed;
        a failure before the commits rolls every run back (commit.py), one at a commit leaves the
        steps already committed, which their checkpoints hold."""
        jobs = job.unit
        runs = [found(self.runs, j.run) for j in jobs]
        if any(j.cancel.is_set() for j in jobs) or None in runs:
            why = "cancelled before it started" + ("" if None not in runs else ": a run of its joint job was deleted")
            for j, run in zip(jobs, runs):
                if run is None:  # deleted, with its jobs' records: nothing to write back
                    j.ended = True
                else:
                    self._end(j, "cancelled", why, "cancelled")
            return
        for j, run in zip(jobs, runs):
            j.status = "running"
            self.store.jobs.put(j.record())
            self._event(j, "started", {"step": run.step, **({"with": [p.run for p in jobs if p is not j]}
                                                             if len(jobs) > 1 else {})})
        queued = max(0.0, time.time() - job.created)  # this attempt's: a resubmitted job is created anew
        deadline = time.monotonic() + self.time_limit
        stop = lambda: any(j.cancel.is_set() for j in jobs) or time.monotonic() > deadline  # noqa: E731
        attempts = [next_attempt(run, j.id, j.key, j.request) for j, run in zip(jobs, runs)]
        at, computed, results = 0, [], []  # the job being worked on; its unit's computed steps, and commits
        try:
            crash_point("step_start")
            for at, (j, run) in enumerate(zip(jobs, runs)):
                progress = lambda stage, data, j=j: self._event(j, "progress", {"stage": stage, **data})  # noqa: E731
                computed.append(steps.compute(run, j.request, steps.Hooks(
                    progress, stop, self.optimize, self.max_optimizer_steps, self.teacher)))
                computed[-1].metrics.queue_seconds = queued
            for at, (run, attempt, step) in enumerate(zip(runs, attempts, computed)):
                results.append(commit_step(self.targets, run, attempt, step))
        except Exception as exc:
            # the runs whose step began (weights possibly changed): up to jobs[at], or all once computed
            self._fail(jobs, runs, attempts, at, max(at + 1, len(computed)), len(results), exc)
        for j, result in zip(jobs, results):
            self._succeed(j, result)

    def _fail(self, jobs: list[Job], runs: list[Run], attempts: list[Attempt], at: int, begun: int, committed: int,
              exc: Exception) -> None:
        """The uncommitted jobs of a unit after `exc`, raised by jobs[at]: the runs whose step began
        rolled back with why, each job ended as the failure says (a partner's naming the run that failed)."""
        status, outcome, event, why, metrics = self._failure(exc, jobs[at], any(j.cancel.is_set() for j in jobs))
        for i in range(committed, len(jobs)):
            said = why if i == at else f"run {jobs[at].run}'s step: {why}"
            if i < begun:
                stored_why = said if status != "cancelled" else \
                    "The job was cancelled before its step was committed; the run is unchanged."
                roll_back(self.targets, runs[i], attempts[i], outcome, stored_why, metrics if i == at else None)
            self._end(jobs[i], status, said if status != "cancelled" else "cancelled", event)

    def _failure(self, exc: Exception, job: Job, cancelled: bool) -> tuple[str, str, str, str, StepMetrics | None]:
        """(job status, stored outcome, terminal event, why, figures) of a step that raised `exc`."""
        if isinstance(exc, Cancelled):
            if cancelled:
                return "cancelled", "cancelled", "cancelled", "cancelled", None
            why = f"ran past its time limit of {self.time_limit:.0f}s"
            return "failed", "failed", "error", (
                f"The job {why} and was stopped before its step was committed; the run is unchanged. "
                f"Submit fewer groups or epochs, or raise art-server --job-time-limit."), None
        why = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, steps.StepFailed):  # an update that must not be served: the run's problem, not the server's
            return "failed", "failed", "error", why, exc.metrics
        if isinstance(exc, Interrupted):  # a lost machine's, not the job's: the same key runs it again
            return "interrupted", "failed", "interrupted", why, None
        log.error("job %s failed", job.id, exc_info=exc)
        if storage_failure(exc):
            self.fault = f"job {job.id} of run {job.run} could not write to the data directory: {why}"
        return "failed", "failed", "error", why, None

    def _succeed(self, job: Job, result: TrainResult) -> None:
        job.status, job.result = "succeeded", result.model_dump(mode="json")
        self.fault = None
        try:
            self.store.jobs.put(job.record())
            self._event(job, "result", job.result)
            job.ended = True
        except Exception as exc:  # the step is committed and served: the job succeeded, whatever the store says
            log.exception("job %s: its success could not be stored", job.id)
            self._remember(job, {"seq": job.n_events, "type": "result", "data": job.result},
                           f"job {job.id} of run {job.run} succeeded and could not be recorded: "
                           f"{type(exc).__name__}: {exc}")

    def _end_all(self, jobs: list[Job], status: str, message: str, event: str) -> None:
        for j in jobs:
            self._end(j, status, message, event)

    def _end(self, job: Job, status: str, message: str, event: str) -> None:
        job.status, job.error = status, message
        self.store.jobs.put(job.record())
        self._event(job, event, {"message": message})
        job.ended = True

    def _remember(self, job: Job, event: dict[str, Any], fault: str) -> None:
        """A job's end kept in memory (its record and terminal event served from here), said on /health."""
        self.fault = fault
        with self._lock:
            self._unstored[job.id] = (job.record(), event)
        job.ended = True

    def _end_unstored(self, job: Job, why: str) -> None:
        """A job whose failure the store could not take either: failed in memory, said on /health."""
        job.status, job.error = "failed", why
        self._remember(job, {"seq": job.n_events, "type": "error", "data": {"message": why}},
                       f"job {job.id} of run {job.run} failed and could not be recorded: {why}")
        try:
            self._end(job, "failed", why, "error")
            with self._lock:
                self._unstored.pop(job.id, None)
        except Exception:
            log.exception("job %s: its failure could not be stored either; it is kept in memory", job.id)
