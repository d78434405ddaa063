"""Runs, training jobs, job events, checkpoints and logged evaluation groups."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from protocol.choices import INT64
from protocol.config import RunSpec
from protocol.jobs import TERMINAL_EVENTS, JobRequest, JointJob, RLJob, SFTJob
from protocol.trajectory import TrajectoryGroup
from server.api.auth import CallerDep, require_api_key
from server.api.deps import RunDep, State
from server.api.deps import get_run as run_named
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.request_errors import APIError, other_model
from server.runs.base_models import OtherModel, RunConflict
from server.runs.leases import LEASE_SECONDS, LeaseHeld
from server.runs.ownership import Caller, NameTaken, RunLimit
from server.runs.run import Run
from server.state import ServerState
from server.store import trajectory_rows
from server.training import bounds, distill
from server.training.assemble import AssemblyError, check_submission
from server.training.jobs import ACTIVE, Job, KeyConflict

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))
SPLIT = r"^[A-Za-z0-9_-]{1,32}$"
StepPath = Annotated[int, Path(ge=0, le=INT64)]
RUN = documented(404, 409)  # a run-scoped route: no such run (or not this key's), or a damaged checkpoint
JobId = Annotated[str, Path(pattern=r"^job-[0-9a-f]{16}$", description="a job's id")]


class LogRequest(BaseModel):
    groups: list[TrajectoryGroup] = Field(max_length=100_000)
    split: str = Field(default="val", pattern=SPLIT)
    step: int | None = Field(default=None, ge=0, le=INT64)


class PruneRequest(BaseModel):
    best_metric: str | None = Field(default=None, max_length=100)
    mode: Literal["max", "min"] = "max"
    keep_last: int = Field(default=1, ge=1, le=INT64)


def _name_taken(name: str) -> APIError:
    # Run names are one namespace: this 409 is the one answer that tells a name is in use.
    return APIError(409, f"run name {name!r} is taken by another key; choose another name", param="name",
                    code="run_name_taken")


@router.post("/v1/runs", responses=documented(403, 409))
async def create_run(spec: RunSpec, state: State, who: CallerDep) -> dict[str, Any]:
    if spec.base_model is not None and spec.base_model not in state.served.base_aliases:
        raise APIError(400, f"this server hosts {state.host.name!r}, not {spec.base_model!r}", param="base_model")
    if state.host.untrainable:
        raise APIError(400, state.host.untrainable, param="base_model", code="model_not_trainable")
    try:
        run, created = await asyncio.to_thread(state.runs.create, spec, who, state.settings.max_runs_per_key)
    except NameTaken:
        raise _name_taken(spec.name) from None
    except RunLimit as e:
        raise APIError(403, str(e), param="name", code="run_limit_reached") from None
    except OtherModel as e:
        raise other_model(str(e)) from None
    except RunConflict as e:
        raise APIError(409, str(e), param=e.param, code=e.code) from None
    except bounds.TooLarge as e:  # depends on the runs there are: deleting one can make room
        raise APIError(409, str(e), param="lora.rank", code="insufficient_memory") from None
    except ValueError as e:  # settings this model cannot take (target modules it does not have)
        raise APIError(400, str(e), param="lora", code="invalid_value") from None
    return {**run.info(), "created": created, "base_model": state.host.name}


@router.get("/v1/runs")
async def list_runs(state: State, who: CallerDep) -> dict[str, Any]:
    return {"data": [r.info() for r in state.runs.all() if state.runs.owners.visible(who, r.name)]}


@router.get("/v1/runs/{name}", responses=RUN)
async def get_run(run: RunDep, state: State) -> dict[str, Any]:
    return {**run.info(), "steps": state.store.steps.of(run.name)}


@router.delete("/v1/runs/{name}", responses=RUN)
async def delete_run(run: RunDep, state: State) -> dict[str, Any]:
    """Delete a run: its jobs cancelled, its served names withdrawn, its adapters unloaded, its
    checkpoints and stored trajectories, steps and jobs removed. A run of that name can then be
    created afresh."""
    state.runs.forget(run)  # at once: from here no request or submission finds it, and its name is taken
    await asyncio.to_thread(state.runs.delete, run, state.jobs.cancel_run)
    return {"deleted": run.name, "step": run.step}


class LeaseRequest(BaseModel):
    lease_id: str = Field(pattern=r"^[0-9a-f]{16,64}$", description="the client's own random id")
    seconds: float = Field(default=LEASE_SECONDS, ge=1, le=3600, description="until it expires unless renewed")


def lease_conflict(e: LeaseHeld) -> APIError:
    return APIError(409, str(e), param="name", code="run_trained_by_another_client")


LeaseHeader = Annotated[str | None, Header(alias="X-Artisan-Lease", max_length=64)]


def check_lease(run: RunDep, state: State, lease: LeaseHeader = None) -> None:
    """A job is queued unless another client holds the run's lease (server/runs/leases.py)."""
    try:
        state.runs.leases.check(run.name, lease)
    except LeaseHeld as e:
        raise lease_conflict(e)


LeaseChecked = Depends(check_lease)


@router.put("/v1/runs/{name}/lease", responses=RUN)
async def hold_lease(run: RunDep, body: LeaseRequest, state: State) -> dict[str, Any]:
    """Take the run for this client, or renew it (the same id); a 409 while another client has it."""
    try:
        lease = state.runs.leases.hold(run.name, body.lease_id, body.seconds)
    except LeaseHeld as e:
        raise lease_conflict(e)
    return {"run": run.name, "lease_id": lease.id, "since": lease.since, "seconds": lease.seconds}


@router.delete("/v1/runs/{name}/lease/{lease_id}", responses=RUN)
async def release_lease(run: RunDep, lease_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16,64}$")],
                        state: State) -> dict[str, Any]:
    return {"run": run.name, "released": state.runs.leases.release(run.name, lease_id)}


@router.post("/v1/runs/{name}/jobs", status_code=202, responses=RUN, dependencies=[LeaseChecked])
async def submit_job(run: RunDep, state: State, job: JobRequest) -> dict[str, Any]:
    return await queue_job(state, run, job)


async def queue_job(state: ServerState, run: Run, job: RLJob | SFTJob, digest: str | None = None,
                    keep_request: bool = False) -> dict[str, Any]:
    """Check what only this model can tell about a job, then queue it (once per idempotency key;
    `digest` and `keep_request` as JobManager.submit's)."""
    await check_job(state, job)
    try:
        # In a thread: hashing and storing a large job's body would hold up every other request.
        submitted, created = await asyncio.to_thread(state.jobs.submit, run, job, digest, keep_request)
    except KeyConflict as e:
        raise key_reused(e)
    return accepted(submitted, created)


@router.post("/v1/joint-jobs", status_code=202, responses=documented(400, 404, 409))
async def submit_joint_job(body: JointJob, state: State, who: CallerDep, lease: LeaseHeader = None) -> dict[str, Any]:
    """RL jobs of several runs trained at one step boundary (protocol/jobs.py JointJob): each run is
    checked as its own route checks it, then one job per run is queued, and they train as one unit."""
    key, parts = body.idempotency_key or uuid.uuid4().hex, []
    for name, job in body.jobs.items():
        run = joint_part(state, who, lease, name)
        await check_job(state, job, f"jobs[{name!r}].")
        parts.append((run, job.model_copy(update={"idempotency_key": key}), None))
    return await queue_together(state, key, parts)


def joint_part(state: ServerState, who: Caller, lease: str | None, name: str) -> Run:
    """A joint job's run, checked as its own routes check it (owner, then lease)."""
    run = run_named(name, state, who)
    check_lease(run, state, lease)
    return run


async def queue_together(state: ServerState, key: str, parts: list[tuple[Run, RLJob, str | None]],
                         keep_request: bool = False) -> dict[str, Any]:
    """A joint job's checked parts queued as one unit; the 202's body names each run's job."""
    try:
        submitted = await asyncio.to_thread(state.jobs.submit_together, parts, keep_request)
    except KeyConflict as e:
        raise key_reused(e)
    return {"idempotency_key": key, "jobs": {job.run: accepted(job, created) for job, created in submitted}}


async def check_job(state: ServerState, job: RLJob | SFTJob, where: str = "") -> None:
    """What only this model can tell about a job (its size, token ids, teacher): a 4xx naming the field."""
    try:
        bounds.check_steps(bounds.requested_steps(job), state.jobs.max_optimizer_steps, "asks for")
    except bounds.TooLarge as e:
        raise APIError(400, str(e), param=where + "config", code="job_too_large")
    if isinstance(job, RLJob):
        try:
            await asyncio.to_thread(check_submission, job.groups, state.host.vocab_size, state.host.fingerprint)
        except AssemblyError as e:
            raise APIError(400, str(e), param=where + "groups", code="invalid_trajectory")
        if job.config.distill is not None:
            teacher = job.config.distill.teacher
            problem = await asyncio.to_thread(distill.teacher_problem, state.runs, state.host, teacher)
            if problem is not None:
                raise APIError(404 if problem.missing else 409, str(problem), param=where + "config.distill.teacher",
                               code="teacher_unavailable")


def key_reused(e: KeyConflict) -> APIError:
    return APIError(409, str(e), param="idempotency_key", code="idempotency_key_reused")


def accepted(job: Job, created: bool) -> dict[str, Any]:
    """The 202's body. Follow from `after`: a resubmitted job keeps its id, and its earlier attempts' events."""
    return {"job_id": job.id, "status": job.status, "created": created, "after": job.attempt_from - 1}


def _found(state: ServerState, who: Caller, job_id: str) -> dict[str, Any]:
    """The job, when it exists and is of a run the caller may see (another tenant's is absent)."""
    job = state.jobs.get(job_id)
    if job is None or not state.runs.owners.visible(who, job["run"]):
        raise APIError(404, f"job {job_id!r} does not exist", code="job_not_found")
    return job


@router.get("/v1/jobs/{job_id}", responses=documented(404))
async def get_job(job_id: JobId, state: State, who: CallerDep) -> dict[str, Any]:
    return _found(state, who, job_id)


@router.delete("/v1/jobs/{job_id}", responses=documented(404))
async def cancel_job(job_id: JobId, state: State, who: CallerDep) -> dict[str, Any]:
    """Cancel a queued or running job: a step it has not committed never lands."""
    _found(state, who, job_id)
    return state.jobs.cancel(job_id)


@router.get("/v1/jobs/{job_id}/events", responses=documented(404))
async def job_events(job_id: JobId, request: Request, state: State, who: CallerDep,
                     after: int = Query(-1, ge=-1, le=INT64)):
    """Server-sent events from `after` on; the stream ends after the job's terminal event.
    A client that lost its connection reconnects with the last `seq` it saw."""
    jobs = state.jobs
    _found(state, who, job_id)

    async def stream():
        last, idle = after, 0.0
        while True:
            events = await asyncio.to_thread(jobs.events, job_id, last)
            for ev in events:
                last = ev["seq"]
                yield f"data: {json.dumps(ev)}\n\n"
                if ev["type"] in TERMINAL_EVENTS:
                    return
            if not events and jobs.get(job_id)["status"] not in ACTIVE:
                # Finished, and `after` is at or past its last event: nothing more will come. Read once
                # more, since a job's status is stored just before its terminal event.
                for ev in await asyncio.to_thread(jobs.events, job_id, last):
                    yield f"data: {json.dumps(ev)}\n\n"
                return
            if not events:
                idle += 0.1
                if idle >= 15:  # a comment line keeps proxies from closing an idle stream
                    idle = 0.0
                    yield ": keep-alive\n\n"
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.1)

    return StreamingResponse(stream(), media_type="text/event-stream")


@router.get("/v1/runs/{name}/checkpoints", responses=RUN)
async def list_checkpoints(run: RunDep, state: State) -> dict[str, Any]:
    return {"data": state.runs.saved.entries(run)}


@router.delete("/v1/runs/{name}/checkpoints/{step}", responses=RUN)
async def delete_checkpoint(run: RunDep, step: StepPath, state: State) -> dict[str, Any]:
    try:
        state.runs.saved.delete(run, step)
    except ValueError as e:
        raise APIError(409, str(e), code="checkpoint_in_use")
    except KeyError:
        raise APIError(404, f"run {run.name!r} has no checkpoint at step {step}", code="checkpoint_not_found")
    return {"deleted": step}


@router.post("/v1/runs/{name}/checkpoints/prune", responses=RUN)
async def prune_checkpoints(run: RunDep, body: PruneRequest, state: State) -> dict[str, Any]:
    deleted = state.runs.saved.prune(run, body.best_metric, body.mode, body.keep_last)
    return {"deleted": deleted, "kept": [c["step"] for c in state.runs.saved.entries(run)]}


class RetainRequest(BaseModel):
    steps: list[Annotated[int, Field(ge=0, le=INT64)]] = Field(max_length=10_000)


@router.post("/v1/runs/{name}/adapters/retain", responses=RUN)
async def retain_adapters(run: RunDep, body: RetainRequest, state: State) -> dict[str, Any]:
    """Keep these steps' adapters loaded for rollouts still sampling from them, and unload the
    others (the latest step and adapters a request is decoding on stay). An unloaded step is
    still served: it is loaded from its checkpoint when a request names it."""
    loaded = await asyncio.to_thread(state.runs.retain, run, set(body.steps))
    return {"retained": sorted(set(body.steps)), "loaded": loaded}


@router.post("/v1/runs/{name}/log", responses=RUN)
async def log_groups(run: RunDep, body: LogRequest, state: State) -> dict[str, Any]:
    """Store evaluation (or any non-training) groups for browsing; nothing is trained."""
    step = body.step if body.step is not None else run.step
    rows = trajectory_rows(body.groups)
    await asyncio.to_thread(state.store.trajectories.put, run.name, step, body.split, rows)
    if state.export_queue is not None:  # queued; a slow exporter never delays this answer
        state.export_queue.submit(run.name, step, body.split, body.groups)
    rewards = [r[2] for r in rows]
    return {"stored": len(rows), "step": step, "split": body.split,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None}


@router.get("/v1/runs/{name}/trajectories", responses=RUN)
async def list_trajectories(run: RunDep, state: State, step: int | None = Query(None, ge=0, le=INT64),
                            split: str | None = Query(None, pattern=SPLIT)) -> dict[str, Any]:
    """Stored trajectories with their token ids and logprobs (what was trained or logged)."""
    rows = await asyncio.to_thread(state.store.trajectories.of, run.name, step, split)
    return {"data": rows}


class ServingRequest(BaseModel):
    step: int | None = Field(ge=0, le=INT64, description="the step the run's name serves until the run trains its "
                                                        "next step; null: its latest")


@router.put("/v1/runs/{name}/serving", responses=RUN, dependencies=[LeaseChecked])
async def serve_step(run: RunDep, body: ServingRequest, state: State) -> dict[str, Any]:
    """Pin what the run's bare name serves to an earlier step (its best on held-out tasks, say), or
    back to its latest. `name@N` keeps serving every step; training goes on from the latest weights,
    and the run's next trained step is served under its name again. Survives a restart."""
    try:
        await asyncio.to_thread(state.runs.pin, run, body.step)
    except KeyError:
        if body.step in {s["step"] for s in await asyncio.to_thread(state.store.steps.of, run.name)}:
            raise APIError(409, f"run {run.name!r} trained step {body.step}, but its checkpoint was deleted: it "
                                f"cannot be served (GET /v1/runs/{run.name}/checkpoints lists the steps that can)",
                           param="step", code="checkpoint_not_found") from None
        raise APIError(404, f"run {run.name!r} has no step {body.step} (its latest is step {run.step})",
                       param="step", code="step_not_found") from None
    pinned = run.serving_step
    return {"run": run.name, "serving_step": run.step if pinned is None else pinned, "latest_step": run.step,
            "pinned": pinned is not None}
