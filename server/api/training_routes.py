"""Runs, training jobs, job events, checkpoints and logged evaluation groups."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from client.types import TrajectoryGroup
from server.api.auth import require_api_key
from server.api.errors import APIError
from server.training.assemble import AssemblyError
from server.training.jobs import TERMINAL, parse_config, parse_payload
from server.training.runs import Run, RunSpec
from server.training.steps import validate_groups

router = APIRouter(dependencies=[Depends(require_api_key)])


class JobRequest(BaseModel):
    kind: Literal["rl", "sft"] = "rl"
    groups: list[dict[str, Any]] | None = None
    conversations: list[dict[str, Any]] | None = None
    config: dict[str, Any] | None = None
    idempotency_key: str | None = Field(default=None, max_length=200)


class LogRequest(BaseModel):
    groups: list[dict[str, Any]]
    split: str = Field(default="val", pattern=r"^[A-Za-z0-9_-]{1,32}$")
    step: int | None = None


class PruneRequest(BaseModel):
    best_metric: str | None = None
    mode: Literal["max", "min"] = "max"
    keep_last: int = Field(default=1, ge=1)


def _state(request: Request):
    return request.app.state.artisan


def _run(request: Request, name: str) -> Run:
    run = _state(request).runs.runs.get(name)
    if run is None:
        raise APIError(404, f"run {name!r} does not exist", param="name", code="run_not_found")
    return run


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return (f"{loc}: {err['msg']}" if loc else err["msg"]), loc or None


@router.post("/v1/runs")
async def create_run(spec: RunSpec, request: Request) -> dict[str, Any]:
    state = _state(request)
    if spec.base_model not in (None, state.host.name, str(state.host.model_dir)):
        raise APIError(400, f"this server hosts {state.host.name!r}, not {spec.base_model!r}", param="base_model")
    try:
        run, created = await asyncio.to_thread(state.runs.get_or_create, spec)
    except ValueError as e:
        raise APIError(409, str(e), param="lora", code="run_conflict")
    state.store.put_run(run.name, spec.project, spec.model_dump())
    return {**run.info(), "created": created, "base_model": state.host.name}


@router.get("/v1/runs")
async def list_runs(request: Request) -> dict[str, Any]:
    return {"data": [r.info() for r in _state(request).runs.runs.values()]}


@router.get("/v1/runs/{name}")
async def get_run(name: str, request: Request) -> dict[str, Any]:
    run = _run(request, name)
    return {**run.info(), "steps": _state(request).store.steps(name)}


@router.post("/v1/runs/{name}/jobs", status_code=202)
async def submit_job(name: str, body: JobRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    run = _run(request, name)
    try:
        config = parse_config(body.kind, body.config)
        payload = parse_payload(body.kind, body.model_dump())
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param, code="invalid_value")
    if not payload:
        raise APIError(400, "nothing to train: send groups (rl) or conversations (sft)",
                       param="groups" if body.kind == "rl" else "conversations")
    try:
        if body.kind == "rl":
            await asyncio.to_thread(validate_groups, state.host, payload)
    except AssemblyError as e:
        raise APIError(400, str(e), param="groups", code="invalid_trajectory")
    job, created = state.jobs.submit(run, body.kind, body.idempotency_key, payload, config)
    # Follow from `after`: a resubmitted interrupted job keeps its id and old events.
    return {"job_id": job.id, "status": job.status, "created": created, "after": job.attempt_from - 1}


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> dict[str, Any]:
    job = _state(request).jobs.get(job_id)
    if job is None:
        raise APIError(404, f"job {job_id!r} does not exist", code="job_not_found")
    return job


@router.get("/v1/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request, after: int = Query(-1, ge=-1)):
    """Server-sent events from `after` on; the stream ends after the job's terminal event.
    A client that lost its connection reconnects with the last `seq` it saw."""
    jobs = _state(request).jobs
    if jobs.get(job_id) is None:
        raise APIError(404, f"job {job_id!r} does not exist", code="job_not_found")

    async def stream():
        last = after
        idle = 0.0
        while True:
            events = await asyncio.to_thread(jobs.events, job_id, last)
            for ev in events:
                last = ev["seq"]
                yield f"data: {json.dumps(ev)}\n\n"
                if ev["type"] in ("result", "error", "interrupted"):
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


@router.get("/v1/runs/{name}/checkpoints")
async def list_checkpoints(name: str, request: Request) -> dict[str, Any]:
    return {"data": _state(request).runs.list_checkpoints(_run(request, name))}


@router.delete("/v1/runs/{name}/checkpoints/{step}")
async def delete_checkpoint(name: str, step: int, request: Request) -> dict[str, Any]:
    run = _run(request, name)
    try:
        _state(request).runs.delete_checkpoint(run, step)
    except ValueError as e:
        raise APIError(409, str(e), code="checkpoint_in_use")
    except KeyError:
        raise APIError(404, f"run {name!r} has no checkpoint at step {step}", code="checkpoint_not_found")
    return {"deleted": step}


@router.post("/v1/runs/{name}/checkpoints/prune")
async def prune_checkpoints(name: str, body: PruneRequest, request: Request) -> dict[str, Any]:
    run = _run(request, name)
    deleted = _state(request).runs.prune(run, body.best_metric, body.mode, body.keep_last)
    return {"deleted": deleted, "kept": [c["step"] for c in _state(request).runs.list_checkpoints(run)]}


@router.post("/v1/runs/{name}/log")
async def log_groups(name: str, body: LogRequest, request: Request) -> dict[str, Any]:
    """Store evaluation (or any non-training) groups for browsing; nothing is trained."""
    state = _state(request)
    run = _run(request, name)
    try:
        groups = [TrajectoryGroup.model_validate(g) for g in body.groups]
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param, code="invalid_value")
    step = body.step if body.step is not None else run.step
    rows = [(gi, ti, t.reward, t.model_dump(mode="json")) for gi, g in enumerate(groups) for ti, t in enumerate(g.trajectories)]
    await asyncio.to_thread(state.store.put_trajectories, name, step, body.split, rows)
    if state.exports is not None:  # queued; a slow exporter never delays this answer
        state.exports.submit(name, step, body.split, groups)
    rewards = [r[2] for r in rows]
    return {"stored": len(rows), "step": step, "split": body.split,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None}


@router.get("/v1/runs/{name}/trajectories")
async def list_trajectories(name: str, request: Request, step: int | None = None, split: str | None = None) -> dict[str, Any]:
    """Stored trajectories with their token ids and logprobs (what was trained or logged)."""
    _run(request, name)
    rows = await asyncio.to_thread(_state(request).store.trajectories, name, step, split)
    return {"data": rows}
