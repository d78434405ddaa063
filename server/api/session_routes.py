"""Sessions recorded by the server (server/harness/sessions.py): look one up, drop one, train on scored ones.

`POST /v1/runs/{name}/session-jobs` takes `{session_id, reward}` groups, assembles each session's
trajectory from what was recorded, and submits an ordinary RL job: the same checks before it is
queued (token ids, model fingerprint), the same token-exact assembly when it trains, the same
events to follow. The assembled job is stored with it, and its idempotency key is looked up before
its sessions: a retry after the sessions are gone (expired or deleted) still answers as the job
does, and an interrupted job runs again from what it stored. The sessions a job took stay taken
across a restart (they are stored, server/harness/sessions.py): a session trains once.

Any other path under a session is a 404 (a path it serves, asked with another method, a 405) that names
the session's routes: a harness given a session base URL with one path segment too many or too few
learns from the error what the base URL should have been.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request

from protocol.jobs import JointSessionJob, RLJob, ScoredSession, SessionJob
from protocol.trajectory import Trajectory, TrajectoryGroup
from server.api.auth import CallerDep, caller, require_api_key
from server.api.deps import RunDep, SessionId, State
from server.api.errors import CATCH_ALL, allow_header, documented
from server.api.limits import GuardedRoute
from server.api.training_routes import (LeaseChecked, LeaseHeader, accepted, check_job, joint_part, key_reused,
                                        queue_job, queue_together)
from server.harness.sessions import SessionError
from server.request_errors import APIError, session_error
from server.runs.run import Run
from server.state import ServerState
from server.training.digests import body_hash
from server.training.jobs import KeyConflict

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


@router.get("/v1/sessions/{session_id}", responses=documented(404))
async def get_session(session_id: SessionId, request: Request, state: State) -> dict[str, Any]:
    try:
        return state.sessions.get(session_id, caller(request)).info()
    except SessionError as e:
        raise session_error(e)


@router.delete("/v1/sessions/{session_id}", responses=documented(404))
async def delete_session(session_id: SessionId, request: Request, state: State) -> dict[str, Any]:
    try:
        await asyncio.to_thread(state.sessions.delete, session_id, caller(request))  # it writes the store
    except SessionError as e:
        raise session_error(e)
    return {"deleted": session_id}


@router.post("/v1/runs/{name}/session-jobs", status_code=202, responses=documented(400, 404, 409),
             dependencies=[LeaseChecked])
async def submit_session_job(run: RunDep, body: SessionJob, request: Request, state: State) -> dict[str, Any]:
    """The job under this idempotency key when there is one (its sessions may be gone: expired or
    deleted), else a new job assembled from the sessions, which it takes."""
    digest = body_hash(body)
    try:
        known = state.jobs.known(run.name, body.idempotency_key, digest)
    except KeyConflict as e:
        raise key_reused(e)
    if known is not None and known.status != "interrupted":
        return accepted(known, False)
    if known is not None and (kept := await asyncio.to_thread(state.jobs.kept_request, known.id)) is not None:
        return await queue_job(state, run, kept, digest, keep_request=True)  # runs again from its stored groups
    return await _new_session_job(state, run, body, caller(request), digest)


async def _new_session_job(state: ServerState, run: Run, body: SessionJob, owner: str, digest: str
                           ) -> dict[str, Any]:
    """Take the sessions, and queue the job assembled from them with its groups stored; the
    sessions are given back if it is not queued."""
    token, job = _take_sessions(state, body, owner)
    try:
        answer = await queue_job(state, run, job, digest, keep_request=True)
    except BaseException:
        state.sessions.release(token)
        raise
    await asyncio.to_thread(state.sessions.settle, token, answer["job_id"])  # it writes the store
    return answer


def _take_sessions(state: ServerState, body: SessionJob, owner: str, field: str = "") -> tuple[str, RLJob]:
    """Claim the sessions (none in flight, none another job took) and assemble their trajectories:
    the claim's token and the RL job; nothing stays claimed if assembly fails. `field` prefixes
    the field an error names."""
    where = {}  # each session's first place in the body, for the field an error names
    for gi, g in enumerate(body.groups):
        for si, s in enumerate(g.sessions):
            where.setdefault(s.session_id, f"{field}groups[{gi}].sessions[{si}]")
    try:
        token = state.sessions.claim(where, owner, lambda holder: _still_holds(state, holder))
    except SessionError as e:
        raise _unavailable(e, where)
    try:
        groups = [TrajectoryGroup(trajectories=[_trajectory(state, s, owner, where) for s in g.sessions],
                                  exceptions=g.exceptions, value=g.value,
                                  metadata={"sessions": [s.session_id for s in g.sessions]}) for g in body.groups]
        return token, RLJob(groups=groups, config=body.config, idempotency_key=body.idempotency_key)
    except BaseException:
        state.sessions.release(token)
        raise


@router.post("/v1/joint-session-jobs", status_code=202, responses=documented(400, 404, 409))
async def submit_joint_session_job(body: JointSessionJob, request: Request, state: State, who: CallerDep,
                                   lease: LeaseHeader = None) -> dict[str, Any]:
    """Session jobs of several runs (each role's harness recorded its own sessions) trained as one
    unit, as `/v1/joint-jobs` trains RL jobs: each run's part is its key's job when it has one,
    else assembled from its sessions, which it takes."""
    key, owner = body.idempotency_key or uuid.uuid4().hex, caller(request)
    parts, taken = [], []
    try:
        for name, part in body.jobs.items():
            run = joint_part(state, who, lease, name)
            part = part.model_copy(update={"idempotency_key": key})
            digest = body_hash(part)
            try:
                known = state.jobs.known(run.name, key, digest)
            except KeyConflict as e:
                raise key_reused(e)
            job = None if known is None else await asyncio.to_thread(state.jobs.kept_request, known.id)
            if job is None:
                token, job = _take_sessions(state, part, owner, f"jobs[{name!r}].")
                taken.append((run.name, token))
            await check_job(state, job, f"jobs[{name!r}].")
            parts.append((run, job, digest))
        answer = await queue_together(state, key, parts, keep_request=True)
    except BaseException:
        for _, token in taken:
            state.sessions.release(token)
        raise
    for run_name, token in taken:  # it writes the store
        await asyncio.to_thread(state.sessions.settle, token, answer["jobs"][run_name]["job_id"])
    return answer


def _still_holds(state: ServerState, holder: str) -> bool:
    """Whether the job (or submission under way) that took a session holds it still: a job that
    failed or was cancelled trained nothing, so its sessions may be submitted again."""
    job = state.jobs.get(holder)
    return job is None or job["status"] not in ("failed", "cancelled")


def _trajectory(state: ServerState, s: ScoredSession, owner: str, where: dict[str, str]) -> Trajectory:
    try:
        return state.sessions.trajectory(s.session_id, owner, s.reward, s.metrics)
    except SessionError as e:
        raise _unavailable(e, where)


def _unavailable(e: SessionError, where: dict[str, str]) -> APIError:
    field = where.get(e.session_id or "", "groups")
    return APIError(e.status, f"{field}: {e.message}", param=f"{field}.session_id" if e.session_id else "groups",
                    code="session_unavailable")


_SESSION_ROUTES = ("POST chat/completions, POST responses, GET and DELETE responses/{id}, GET "
                   "responses/{id}/input_items, POST messages, POST messages/count_tokens and GET models under "
                   "/v1/sessions/{id}/ (or /v1/sessions/{id}/v1/, for a base URL that ends in /v1)")


# Registered after the chat, Responses and Messages routers (server/app.py), so it only sees what they did not take.
@router.api_route("/v1/sessions/{session_id}/{rest:path}", include_in_schema=False, name=CATCH_ALL,
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def no_such_session_route(session_id: SessionId, rest: str, request: Request) -> None:
    # A path a session serves, asked with another method, is a 405 as anywhere else; a path it does not, a 404.
    path = f"/v1/sessions/{session_id}/{rest}"
    if allow := allow_header(request):
        raise APIError(405, f"{path} does not take {request.method}: a session serves {_SESSION_ROUTES}",
                       code="method_not_allowed", headers=allow)
    raise APIError(404, f"no route {request.method} {path}: a session serves {_SESSION_ROUTES}", code="unknown_route")
