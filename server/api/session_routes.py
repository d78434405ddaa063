"""Sessions recorded by the server (server/harness/sessions.py): look one up, drop one, train on scored ones.

`POST /v1/runs/{name}/session-jobs` takes `{session_id, reward}` groups, assembles each session's
trajectory from what was recorded, and submits an ordinary RL job: the same checks before it is
queued (token ids, model fingerprint), the same token-exact assembly when it trains, the same
events to follow.

Any other path under a session is a 404 that names the session's routes: a harness given a session
base URL with one path segment too many or too few otherwise gets a bare "Not Found".
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from protocol.jobs import RLJob, SessionJob
from protocol.trajectory import TrajectoryGroup
from server.api.auth import caller, require_api_key
from server.api.deps import RunDep, SessionId, State, session_error
from server.api.errors import APIError, documented
from server.api.limits import GuardedRoute
from server.api.training_routes import LeaseChecked, queue_job
from server.harness.sessions import SessionError

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


@router.get("/v1/sessions/{session_id}", responses=documented(403, 404))
async def get_session(session_id: SessionId, request: Request, state: State) -> dict[str, Any]:
    try:
        return state.sessions.get(session_id, caller(request)).info()
    except SessionError as e:
        raise session_error(e)


@router.delete("/v1/sessions/{session_id}", responses=documented(403, 404))
async def delete_session(session_id: SessionId, request: Request, state: State) -> dict[str, Any]:
    try:
        state.sessions.delete(session_id, caller(request))
    except SessionError as e:
        raise session_error(e)
    return {"deleted": session_id}


@router.post("/v1/runs/{name}/session-jobs", status_code=202, responses=documented(403, 404, 409),
             dependencies=[LeaseChecked])
async def submit_session_job(run: RunDep, body: SessionJob, request: Request, state: State) -> dict[str, Any]:
    owner, groups = caller(request), []
    for gi, g in enumerate(body.groups):
        trajectories = []
        for si, s in enumerate(g.sessions):
            try:
                trajectories.append(state.sessions.trajectory(s.session_id, owner, s.reward, s.metrics))
            except SessionError as e:
                raise APIError(e.status if e.status != 409 else 400, f"groups[{gi}].sessions[{si}]: {e.message}",
                               param=f"groups[{gi}].sessions[{si}].session_id", code="session_unavailable")
        groups.append(TrajectoryGroup(trajectories=trajectories, exceptions=g.exceptions, value=g.value,
                                      metadata={"sessions": [s.session_id for s in g.sessions]}))
    return await queue_job(state, run, RLJob(groups=groups, config=body.config, idempotency_key=body.idempotency_key))


_SESSION_ROUTES = ("POST chat/completions, POST responses, POST messages and GET models under "
                   "/v1/sessions/{id}/ (or /v1/sessions/{id}/v1/, for a base URL that ends in /v1)")


# Registered after the chat, Responses and Messages routers (server/app.py), so it only sees what they did not take.
@router.api_route("/v1/sessions/{session_id}/{rest:path}", include_in_schema=False,
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def no_such_session_route(session_id: SessionId, rest: str, request: Request) -> None:
    raise APIError(404, f"no route {request.method} /v1/sessions/{session_id}/{rest}: a session serves "
                        f"{_SESSION_ROUTES}", code="unknown_route")
